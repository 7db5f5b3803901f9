//! raid5/6 restripes (issue 17) under concurrent writes (every write reads back, check finds 0
//! mismatches): to more members (`grow --raid-devices`: raid5 4 -> 5 and 3 -> 5, raid6 4 -> 5
//! and 4 -> 6; the array grows) and over the same members (`grow --chunk` / `--layout`: raid5
//! chunk 64 -> 128 KiB, chunk and layout at once, raid6 Q-last -> rotating Q); a reshape
//! stopped half-way resumes from the superblocks' reshape_position, an unreadable range
//! mid-reshape is recorded where it was read, refusals (no room to move the data offset, a
//! degraded array) change nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use mdkit_io::{BlockDevice, BlockDeviceExt, FaultRule, OpMask, Rng, SharedBuf, WriteFlags};
use mdkit_md::array::{Array, AssembleOptions, GrowChange, MdError, MdErrorKind, assemble, read_superblock};
use mdkit_md::format::bitmap::BitmapSuper;
use mdkit_md::format::superblock::{Superblock, feature};
use mdkit_md::layout::Level;

use crate::array_util::*;

/// Random writes until told to stop; returns the model and how many writes it did.
fn writer(a: Arc<Array>, mut m: Model, seed: u64, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(Model, u64)> {
    tokio::spawn(async move {
        let mut rng = Rng::new(seed);
        let mut n = 0u64;
        while !stop.load(Ordering::Acquire) {
            random_write(&*a, &mut m, &mut rng, 24).await;
            n += 1;
            tokio::task::yield_now().await;
        }
        (m, n)
    })
}

/// Waits until the running reshape recorded a checkpoint (a position past its start).
async fn until_checkpointed(a: &Array) {
    for polls in 0.. {
        if a.core().personality().reshape().is_some_and(|r| r.position_sectors() > 0) {
            return;
        }
        assert!(polls < 10_000, "no reshape checkpoint: {:?}", a.sync_status());
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A member's superblock, its bitmap's sector and the bitmap header there.
async fn bitmap_header(m: &SimMember) -> (Superblock, u64, BitmapSuper) {
    let sb = read_superblock(&m.dev).await.unwrap();
    let at = sb.bitmap_sector().expect("internal bitmap");
    let head = m.dev.read_vec(at * 512, 4096).await.unwrap();
    (sb, at, BitmapSuper::decode(&head).unwrap())
}

async fn filled(ms: &[SimMember], n: u32, chunk_kib: u32, rng: &mut Rng) -> (Arc<Array>, Model) {
    filled_level(ms, Level::Raid5, n, chunk_kib, rng).await
}

async fn filled_level(ms: &[SimMember], level: Level, n: u32, chunk_kib: u32, rng: &mut Rng) -> (Arc<Array>, Model) {
    let bitmap = level != Level::Raid0;
    let a = Arc::new(create_array(ms, opts(level, n, Some(chunk_kib), None, bitmap, true)).await);
    let mut m = Model::new(a.size_bytes());
    fill(&*a, &mut m, rng).await;
    (a, m)
}

async fn grow_under_writes(name: &str, level: Level, old: usize, new: usize) {
    let s = seed(name, 41);
    let mut rng = Rng::new(s);
    let ms = mem_members(&format!("{name}-"), new, 16 * MIB);
    let (a, m) = filled_level(&ms[..old], level, old as u32, 64, &mut rng).await;
    let before = a.size_bytes();
    // md lets a sync run above sync_speed_min only while the array is idle; the writer keeps
    // it busy, so the floor sets the pace (1 MB/s by default: 15 s for these members; 5 MB/s: 3 s).
    a.set_attribute("sync_speed_min", "5000").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    tokio::task::yield_now().await;
    let add = member_devs(&ms[old..]);
    let r = a.grow(GrowChange::RaidDevices(new as u32), add).await.unwrap();
    assert!(r.summary.contains("reshape"), "{}", r.summary);
    let st = a.sync_status();
    assert!(st.action == "reshape" || a.core().personality().reshape().is_some_and(|r| r.is_done()), "{st:?}");
    a.wait_reshape().await.unwrap();
    stop.store(true, Ordering::Release);
    let (mut m, writes) = w.await.unwrap();
    eprintln!("{name}: {writes} writes during the reshape");
    assert!(writes > 0);
    let after = a.size_bytes();
    let parity = if level == Level::Raid10 { 0 } else { level.max_degraded() as usize };
    assert_eq!(after / ((new - parity) as u64), before / ((old - parity) as u64), "the array grows by the new members");
    assert_eq!(a.info().raid_disks, new as u32);
    verify_all(&*a, &m).await;
    let mut grown = Model::new(after);
    grown.apply(0, &m.data);
    m = grown;
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0, "{name}: check after the reshape");
    a.stop().await.unwrap();
    let sb = read_superblock(&ms[0].dev).await.unwrap();
    assert_eq!(sb.feature_map & feature::RESHAPE_ACTIVE, 0);
    assert_eq!(sb.raid_disks, new as u32);
    // The bitmap covers the new geometry: raid10's the grown array (resized at the start), the
    // parity levels' the unchanged member size; every member's copy says so, and its reserved
    // space ends before the moved data.
    let want_sync = if level == Level::Raid10 { after / 512 } else { sb.size_sectors };
    for m in &ms {
        let (sb, at, bms) = bitmap_header(m).await;
        assert_eq!(bms.sync_size_sectors, want_sync, "{name}: {}: bitmap sync_size", m.name);
        assert!(at + u64::from(bms.sectors_reserved) <= sb.data_offset_sectors, "{name}: {}: {bms:?}", m.name);
    }
    let b = assemble_array(&ms).await;
    verify_all(&b, &m).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_4_to_5_under_writes() {
    grow_under_writes("reshape45", Level::Raid5, 4, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_3_to_5_under_writes() {
    grow_under_writes("reshape35", Level::Raid5, 3, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_4_to_5_under_writes() {
    grow_under_writes("reshape6-45", Level::Raid6, 4, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_near2_4_to_5_under_writes() {
    grow_under_writes("reshape10-45", Level::Raid10, 4, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_near2_4_to_7_under_writes() {
    grow_under_writes("reshape10-47", Level::Raid10, 4, 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_4_to_6_under_writes() {
    grow_under_writes("reshape6-46", Level::Raid6, 4, 6).await;
}

/// A reshape to fewer members while a writer writes: refused until the array is cut to the
/// smaller size (`--array-size`, which the refusal names), then it runs backwards from the end
/// of the smaller array with the data moving up; every write reads back, check finds 0
/// mismatches, the members left over become spares, and the array assembles again (from the
/// members it keeps, the spares beside them).
async fn shrink_under_writes(name: &str, level: Level, old: usize, new: usize) {
    let s = seed(name, 43);
    let mut rng = Rng::new(s);
    let ms = mem_members(&format!("{name}-"), old, 16 * MIB);
    let (a, full) = filled_level(&ms, level, old as u32, 64, &mut rng).await;
    let dof_before = read_superblock(&ms[0].dev).await.unwrap().data_offset_sectors;
    let size = cut_for_fewer_members(&a, new as u32).await;
    assert_eq!(a.size_bytes(), size);
    let mut m = Model::new(size);
    m.apply(0, &full.data[..size as usize]);
    a.set_attribute("sync_speed_min", "5000").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    tokio::task::yield_now().await;
    let r = a.grow(GrowChange::RaidDevices(new as u32), Vec::new()).await.unwrap();
    assert!(r.summary.contains("moves up"), "{}", r.summary);
    assert_eq!(a.size_bytes(), size, "the array keeps the size it was cut to");
    a.wait_reshape().await.unwrap();
    stop.store(true, Ordering::Release);
    let (mut m, writes) = w.await.unwrap();
    eprintln!("{name}: {writes} writes during the reshape");
    assert!(writes > 0);
    assert_eq!((a.info().raid_disks, a.size_bytes()), (new as u32, size));
    assert_eq!(a.core().slots().spares().len(), old - new, "the members left over are spares");
    verify_all(&*a, &m).await;
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0, "{name}: check after the reshape");
    a.stop().await.unwrap();
    for (i, mb) in ms.iter().enumerate() {
        let sb = read_superblock(&mb.dev).await.unwrap();
        assert_eq!((sb.feature_map & feature::RESHAPE_ACTIVE, sb.raid_disks), (0, new as u32), "{}", mb.name);
        assert!(sb.data_offset_sectors > dof_before, "{}: the data moved up: {sb:?}", mb.name);
        let spare = sb.raw_role() == mdkit_md::format::superblock::ROLE_SPARE;
        assert_eq!(spare, i >= new, "{}: role {:#x}", mb.name, sb.raw_role());
        let (_, _, bms) = bitmap_header(mb).await;
        let want = if level == Level::Raid10 { size.div_ceil(512) } else { sb.size_sectors };
        assert!(bms.sync_size_sectors >= want && bms.sync_size_sectors <= sb.size_sectors * old as u64, "{bms:?}");
    }
    let b = assemble_array(&ms).await;
    assert_eq!((b.info().raid_disks, b.core().slots().spares().len()), (new as u32, old - new));
    b.set_array_size(Some(size)).unwrap();
    verify_all(&b, &m).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_5_to_4_under_writes() {
    shrink_under_writes("shrink54", Level::Raid5, 5, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_5_to_3_under_writes() {
    shrink_under_writes("shrink53", Level::Raid5, 5, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_5_to_4_under_writes() {
    shrink_under_writes("shrink6-54", Level::Raid6, 5, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_near2_5_to_4_under_writes() {
    shrink_under_writes("shrink10-54", Level::Raid10, 5, 4).await;
}

/// A restripe over the same members (`grow --chunk` / `--layout`) while a writer writes: the
/// size stays, every write reads back, check finds 0 mismatches, the superblocks carry the new
/// chunk and layout with the data offset moved down by the larger chunk, and the array
/// assembles again from them.
async fn restripe_under_writes(name: &str, level: Level, n: usize, layout: Option<u32>, change: GrowChange) {
    let mut rng = Rng::new(seed(name, 59));
    let ms = mem_members(&format!("{name}-"), n, 16 * MIB);
    let a = Arc::new(create_array(&ms, opts(level, n as u32, Some(64), layout, true, true)).await);
    let mut m = Model::new(a.size_bytes());
    fill(&*a, &mut m, &mut rng).await;
    let (before, old) = (a.size_bytes(), read_superblock(&ms[0].dev).await.unwrap());
    let GrowChange::Restripe { layout: to_layout, chunk_sectors: to_chunk } = change else { panic!("{change:?}") };
    let want = (to_layout.unwrap_or(old.layout), to_chunk.unwrap_or(old.chunk_sectors));
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    tokio::task::yield_now().await;
    let r = a.grow(change, vec![]).await.unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(r.summary.contains("reshape"), "{}", r.summary);
    a.wait_reshape().await.unwrap();
    stop.store(true, Ordering::Release);
    let (m, writes) = w.await.unwrap();
    eprintln!("{name}: {writes} writes during the restripe ({})", r.summary);
    assert_eq!(a.size_bytes(), before, "a restripe over the same members keeps the size");
    assert_eq!((a.info().layout, a.info().chunk_sectors), want);
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0, "{name}: check after the restripe");
    a.stop().await.unwrap();
    let sb = read_superblock(&ms[0].dev).await.unwrap();
    assert_eq!(sb.feature_map & feature::RESHAPE_ACTIVE, 0);
    assert_eq!((sb.layout, sb.chunk_sectors, sb.raid_disks), (want.0, want.1, n as u32));
    // At least the larger chunk (raid5_run's rule), and about half the room before the data
    // where there is room, as mdadm moves it (so the kernel can continue it crash-safely).
    let (least, moved) = (u64::from(old.chunk_sectors.max(want.1)), old.data_offset_sectors - sb.data_offset_sectors);
    assert!(moved >= least && moved.is_multiple_of(8), "{name}: moved {moved}, at least {least}");
    assert!(moved >= old.data_offset_sectors / 4, "{name}: moved {moved} of {}", old.data_offset_sectors);
    let b = assemble_array(&ms).await;
    verify_all(&b, &m).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_chunk_64_to_128_under_writes() {
    restripe_under_writes(
        "chunk64-128",
        Level::Raid5,
        4,
        None,
        GrowChange::Restripe { layout: None, chunk_sectors: Some(256) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_chunk_64_to_32_and_layout_under_writes() {
    // left-symmetric -> right-asymmetric (md layout 1) and 32 KiB chunks in one restripe.
    let change = GrowChange::Restripe { layout: Some(1), chunk_sectors: Some(64) };
    restripe_under_writes("chunk64-32", Level::Raid5, 3, None, change).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_layout_6_to_rotating_q_under_writes() {
    // left-symmetric-6 (Q on the last member, md layout 18), what raid5 -> raid6 with
    // --layout preserve leaves, to left-symmetric (Q rotating, layout 2): mdadm's second step.
    let change = GrowChange::Restripe { layout: Some(2), chunk_sectors: None };
    restripe_under_writes("raid6-q", Level::Raid6, 5, Some(18), change).await;
}

/// Restripes the engine cannot make are refused before anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restripe_refusals_change_nothing() {
    let ms = mem_members("rsref-", 4, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 4, Some(64), None, true, true)).await;
    let refused = |change| {
        let a = &a;
        async move { a.grow(change, vec![]).await.unwrap_err().to_string() }
    };
    let e = refused(GrowChange::Restripe { layout: None, chunk_sectors: Some(128) }).await;
    assert!(e.contains("already these"), "{e}");
    let e = refused(GrowChange::Restripe { layout: None, chunk_sectors: Some(96) }).await;
    assert!(e.contains("power of 2"), "{e}");
    let e = refused(GrowChange::Restripe { layout: Some(42), chunk_sectors: None }).await;
    assert!(e.contains("algorithm 42"), "{e}");
    // 15 MiB per member is no multiple of 2 MiB (mdadm refuses too: --size first).
    let e = refused(GrowChange::Restripe { layout: None, chunk_sectors: Some(4096) }).await;
    assert!(e.contains("not a multiple of the new chunk (2048 KiB)"), "{e}");
    // 1 MiB chunks: the data would move down 1 MiB; mdkit's arrays leave less before it.
    let e = refused(GrowChange::Restripe { layout: None, chunk_sectors: Some(2048) }).await;
    assert!(e.contains("free sectors before its data"), "{e}");
    a.stop().await.unwrap();
    let sb = read_superblock(&ms[0].dev).await.unwrap();
    assert_eq!((sb.chunk_sectors, sb.layout, sb.feature_map & feature::RESHAPE_ACTIVE), (128, 2, 0));
}

/// Stopped half-way (slow `sync_speed_max`), the array assembles from the recorded
/// reshape_position, serves the data, and the reshape finishes. While it runs, `detail` shows
/// its speed and the time left, and `sync_speed` its speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_reshape_resumes_from_its_checkpoint() {
    let mut rng = Rng::new(seed("reshape-resume", 43));
    let ms = mem_members("resume-", 5, 16 * MIB);
    let (a, m) = filled(&ms[..4], 4, 64, &mut rng).await;
    a.set_attribute("sync_speed_max", "20000").unwrap();
    a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap();
    a.set_attribute("sync_speed_max", "20000").unwrap();
    // Until a checkpoint is recorded (the engine has moved and measured windows by then).
    until_checkpointed(&a).await;
    let detail = a.detail();
    eprintln!("detail during the reshape: {}", detail["sync"]);
    // Progress as mdadm --detail and /proc/mdstat show it: a speed and the time left.
    let sync = &detail["sync"];
    assert_eq!(sync["action"], "reshape");
    assert!(sync["speed_kib"].as_u64().is_some_and(|s| s > 0), "{sync}");
    assert!(sync["eta_s"].as_u64().is_some(), "{sync}");
    assert!(a.get_attribute("sync_speed").unwrap().parse::<u64>().is_ok_and(|s| s > 0));
    a.stop().await.unwrap();
    drop(a);
    let sb = read_superblock(&ms[2].dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "stopped mid-way: still reshaping");
    let pos = sb.reshape_position_sectors;
    assert!(pos > 0, "the stop recorded where it got to");
    let b = Arc::new(assemble_array(&ms).await);
    assert_eq!(b.get_attribute("reshape_position").unwrap(), pos.to_string());
    assert_eq!(b.sync_status().action, "reshape");
    verify_all(&*b, &m).await;
    fast_sync(&b);
    b.wait_reshape().await.unwrap();
    verify_all(&*b, &m).await;
    assert_eq!(check(&b).await, 0);
    b.stop().await.unwrap();
}

/// A grown array whose reshape just finished, before `wait_reshape` assembled it again.
async fn reshape_finished(prefix: &str, rng: &mut Rng) -> (Vec<SimMember>, Arc<Array>) {
    let ms = mem_members(prefix, 5, 16 * MIB);
    let (a, _) = filled(&ms[..4], 4, 64, rng).await;
    fast_sync(&a);
    a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap();
    for polls in 0.. {
        if a.core().personality().reshape().is_some_and(|r| r.is_done()) {
            break;
        }
        assert!(polls < 10_000, "the reshape did not finish: {:?}", a.sync_status());
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    (ms, a)
}

/// The operator's stop is final: the reassembly that ends a reshape does not start the array
/// again afterwards (it used to, leaving an array the service no longer knew running).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_array_is_not_assembled_again_when_its_reshape_ends() {
    let mut rng = Rng::new(seed("reshape-stop-final", 47));
    let (ms, a) = reshape_finished("stopfinal-", &mut rng).await;
    a.stop().await.unwrap();
    let events = read_superblock(&ms[0].dev).await.unwrap().events;
    let e = a.wait_reshape().await.unwrap_err().to_string();
    assert!(e.contains("stopped"), "{e}");
    assert!(a.is_stopped());
    assert_eq!(read_superblock(&ms[0].dev).await.unwrap().events, events, "nothing written after the stop");
    let e = a.grow(GrowChange::RaidDevices(5), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("stopped"), "{e}");
}

/// A stop that arrives while `wait_reshape` assembles the array again stops the new array
/// (whichever gets there first, the array ends stopped and clean).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_the_reassembly_that_ends_a_reshape_stops_the_new_array() {
    let mut rng = Rng::new(seed("reshape-stop-race", 48));
    for round in 0..4 {
        let (ms, a) = reshape_finished(&format!("stoprace{round}-"), &mut rng).await;
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.wait_reshape().await }
        });
        for _ in 0..round {
            tokio::task::yield_now().await;
        }
        a.stop().await.unwrap();
        let waited = waiter.await.unwrap();
        assert!(a.is_stopped(), "round {round}: the array runs after the stop ({waited:?})");
        for m in &ms {
            let sb = read_superblock(&m.dev).await.unwrap();
            assert_eq!(sb.resync_offset_sectors, u64::MAX, "round {round}: {} not clean", m.name);
            if waited.is_ok() {
                assert_eq!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "round {round}: still reshaping");
            }
        }
    }
}

/// A member failed during a reshape holds the old layout: re-adding it from the bitmap would
/// mark it in sync (the reshape moved data without setting bits) and serve wrong data from it.
/// Re-add is refused while the reshape runs and after it; `--add` rebuilds it in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_left_during_a_reshape_is_not_re_added_from_the_bitmap() {
    let mut rng = Rng::new(seed("reshape-readd", 49));
    let ms = mem_members("readd-", 5, 16 * MIB);
    let (a, m) = filled(&ms[..4], 4, 64, &mut rng).await;
    a.core().bitmap.as_ref().unwrap().sweep_now().await.unwrap(); // a clean bitmap: nothing dirty
    a.set_attribute("sync_speed_max", "2000").unwrap();
    a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap();
    until_checkpointed(&a).await;
    a.fail_member(&ms[2].name).await.unwrap();
    let e = a.re_add_member(ms[2].member_dev()).await.unwrap_err().to_string();
    assert!(e.contains("reshaping"), "{e}");
    fast_sync(&a);
    a.wait_reshape().await.unwrap();
    let e = a.re_add_member(ms[2].member_dev()).await.unwrap_err().to_string();
    assert!(e.contains("left during a reshape") && e.contains("use --add"), "{e}");
    a.add_member(ms[2].member_dev()).await.unwrap();
    a.wait_sync_idle().await;
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0, "check after the full rebuild");
    // The rebuilt member serves: another member out, every block still reads back.
    a.fail_member(&ms[0].name).await.unwrap();
    verify_all(&*a, &m).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_change_nothing() {
    let ms = mem_members("refuse-", 5, 16 * MIB);
    // 512 KiB chunks, 4 -> 5: the data must move down 2 MiB; mdkit leaves 1 MiB before it.
    let a = create_array(&ms[..4], opts(Level::Raid5, 4, Some(512), None, false, true)).await;
    let e = a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap_err().to_string();
    assert!(e.contains("free sectors before its data") && e.contains("backup file"), "{e}");
    let e = a.grow(GrowChange::RaidDevices(6), member_devs(&ms[4..])).await.unwrap_err().to_string();
    assert!(e.contains("exactly 2 new device"), "{e}");
    assert_eq!(a.info().raid_disks, 4);
    a.stop().await.unwrap();
    let sb = read_superblock(&ms[0].dev).await.unwrap();
    assert_eq!((sb.raid_disks, sb.feature_map & feature::RESHAPE_ACTIVE), (4, 0));
}

/// A read that cannot be rebuilt while a reshape moves the data down (frozen at its start, so
/// every stripe is still at the old geometry's offset): the lost range goes into both members'
/// bad-block logs at the device sectors the reads went to, so a second read fails at once
/// without touching the media; a write clears it and the reshape then finishes cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_range_mid_reshape_is_recorded_where_it_was_read() {
    let mut rng = Rng::new(seed("reshape-unreadable", 47));
    let ms = faulty_members("rsbad-", 5, 16 * MIB);
    let (a, mut model) = filled(&ms[..4], 4, 64, &mut rng).await;
    let old_dof: Vec<u64> =
        ms[1..3].iter().map(|m| a.core().slots().find(&m.name).unwrap().data_offset_sectors).collect();
    a.set_attribute("sync_action", "frozen").unwrap();
    a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap();
    assert_eq!(a.get_attribute("reshape_position").unwrap(), "0", "frozen before the first window");
    let moved = a.core().slots().find(&ms[1].name).unwrap();
    assert!(moved.old_base_sectors > 0, "the reshape moves data down: old geometry above the new data offset");

    // Stripe 0's chunk on members 1 and 2, at the old geometry's place on the device.
    let rules: Vec<_> = ms[1..3]
        .iter()
        .zip(&old_dof)
        .map(|(m, dof)| {
            let at = dof * 512;
            m.fault.as_ref().unwrap().add(FaultRule::error(OpMask::READ, Some(at..at + 64 * 1024)))
        })
        .collect();
    let data_len = 3 * 64 * 1024;
    let e = a.read_vec(0, data_len).await.expect_err("two of four members unreadable");
    assert_eq!(MdError::of(&e).map(|m| m.kind), Some(MdErrorKind::Unrecoverable), "{e}");
    for (m, dof) in ms[1..3].iter().zip(&old_dof) {
        let listed = a.get_attribute(&format!("dev-{}/bad_blocks", m.name)).unwrap();
        let start: u64 =
            listed.split_whitespace().next().unwrap_or_else(|| panic!("{}: nothing recorded", m.name)).parse().unwrap();
        assert_eq!(start, *dof, "{}: recorded where the read went, not at the new data offset: {listed:?}", m.name);
    }
    let fired: Vec<_> = ms[1..3].iter().zip(&rules).map(|(m, r)| m.fault.as_ref().unwrap().fired(*r)).collect();
    a.read_vec(0, data_len).await.expect_err("listed as lost until rewritten");
    let again: Vec<_> = ms[1..3].iter().zip(&rules).map(|(m, r)| m.fault.as_ref().unwrap().fired(*r)).collect();
    assert_eq!(fired, again, "a listed range is not read from the media again");

    for (m, r) in ms[1..3].iter().zip(rules) {
        assert!(m.fault.as_ref().unwrap().remove(r));
    }
    let mut buf = vec![0u8; data_len];
    rng.fill(&mut buf);
    a.write(0, SharedBuf::from_slice(&buf), WriteFlags::NONE).await.unwrap();
    model.apply(0, &buf);
    for m in &ms[1..3] {
        assert_eq!(
            a.get_attribute(&format!("dev-{}/bad_blocks", m.name)).unwrap(),
            "",
            "{}: cleared by the write",
            m.name
        );
    }
    a.set_attribute("sync_action", "idle").unwrap();
    fast_sync(&a);
    a.wait_reshape().await.unwrap();
    verify_all(&*a, &model).await;
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

/// The superblock and bitmap header of the first members as they were before a reshape
/// started, to write back as a cut in the start round would have left them.
struct HeadersBefore {
    saved: Vec<(Vec<u8>, Vec<u8>)>,
    sb_at: u64,
    bitmap_at: u64,
    super_offset_sectors: u64,
}

impl HeadersBefore {
    async fn save(ms: &[SimMember]) -> HeadersBefore {
        let sb = read_superblock(&ms[0].dev).await.unwrap();
        let (sb_at, bitmap_at) = (sb.super_offset_sectors * 512, sb.bitmap_sector().expect("a bitmap") * 512);
        let saved = ms
            .iter()
            .map(|m| {
                let (mut sb, mut bm) = (vec![0u8; 4096], vec![0u8; 4096]);
                m.mem.as_ref().unwrap().read_bytes(sb_at, &mut sb);
                m.mem.as_ref().unwrap().read_bytes(bitmap_at, &mut bm);
                (sb, bm)
            })
            .collect();
        HeadersBefore { saved, sb_at, bitmap_at, super_offset_sectors: sb.super_offset_sectors }
    }

    /// Member `i` as if the start round (events `start`) missed it: its old superblock (and
    /// bitmap header) one event behind.
    fn missed(&self, m: &SimMember, i: usize, start: u64, with_bitmap: bool) {
        let mem = m.mem.as_ref().unwrap();
        let mut sb = Superblock::decode(&self.saved[i].0, self.super_offset_sectors).unwrap();
        sb.events = start - 1;
        mem.write_bytes(self.sb_at, &sb.encode().unwrap());
        if with_bitmap {
            let mut page = self.saved[i].1.clone();
            let mut bms = BitmapSuper::decode(&page).unwrap();
            bms.events = start - 1;
            bms.write_header(&mut page).unwrap();
            mem.write_bytes(self.bitmap_at, &page);
        }
    }
}

/// A cut while the reshape starts (its superblocks are written one member at a time): two old
/// members keep their pre-reshape superblock, one of them also its bitmap header (written
/// just before its superblock). Nothing had moved, so assembly takes both into the reshape at
/// position 0 (the geometry vote alone left 3 of 5 on the new side and 2 of 4 on the old: no
/// group could run); every member is in sync, the data reads back, the reshape finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_missed_the_reshape_start_join_it() {
    let mut rng = Rng::new(seed("reshape-start-cut", 53));
    let ms = mem_members("rscut-", 5, 16 * MIB);
    let (a, model) = filled(&ms[..4], 4, 64, &mut rng).await;
    // The grow stops the array first; the state the start round then overwrites is this.
    a.stop().await.unwrap();
    drop(a);
    let before = HeadersBefore::save(&ms[..4]).await;
    let a = Arc::new(assemble_array(&ms[..4]).await);
    a.set_attribute("sync_action", "frozen").unwrap();
    a.grow(GrowChange::RaidDevices(5), member_devs(&ms[4..])).await.unwrap();
    a.stop().await.unwrap();
    drop(a);
    // Rounds after the start only exist because this test stopped the array: the members that
    // got the start round keep theirs as the last; the cut ones are one round behind it.
    let start = read_superblock(&ms[0].dev).await.unwrap().events;
    before.missed(&ms[1], 1, start, true);
    before.missed(&ms[2], 2, start, false);
    assert_eq!(read_superblock(&ms[2].dev).await.unwrap().raid_disks, 4, "member 2 as the cut left it");

    let o = AssembleOptions { name: "rscut".into(), start_frozen: true, ..AssembleOptions::default() };
    let got = assemble(member_devs(&ms), o).await.unwrap_or_else(|e| panic!("assembly after the cut: {e}"));
    assert!(got.refused.is_empty(), "no member left out: {:?}", got.refused);
    let note = got.notes.iter().find(|n| n.contains("started the reshape")).expect("the adoption is reported");
    assert!(note.contains("rscut-1") && note.contains("rscut-2"), "{note}");
    let b = Arc::new(got.array);
    assert_eq!(b.core().degraded(), 0, "every member in sync: {:#}", b.detail());
    assert_eq!(b.get_attribute("reshape_position").unwrap(), "0");
    assert_eq!(b.get_attribute("raid_disks").unwrap(), "5");
    verify_all(&*b, &model).await;
    b.set_attribute("sync_action", "idle").unwrap();
    fast_sync(&b);
    b.wait_reshape().await.unwrap();
    verify_all(&*b, &model).await;
    assert_eq!(check(&b).await, 0);
    for m in &ms {
        assert_eq!(read_superblock(&m.dev).await.unwrap().raid_disks, 5, "{}: recorded in the new geometry", m.name);
    }
    b.stop().await.unwrap();
}

/// The same cut while a reshape to fewer members starts (raid5 5 -> 4, the array cut to the
/// smaller size first): member 1 keeps its pre-reshape superblock and bitmap header, member 4
/// (whose role the reshape drops) its superblock. Nothing had moved, so assembly takes both
/// into the reshape at its start (the end of the smaller array); the data reads back and the
/// reshape finishes with member 4 a spare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_missed_a_shrink_start_join_it() {
    let mut rng = Rng::new(seed("shrink-start-cut", 59));
    let ms = mem_members("sscut-", 5, 16 * MIB);
    let (a, mut model) = filled(&ms, 5, 64, &mut rng).await;
    a.stop().await.unwrap();
    drop(a);
    let before = HeadersBefore::save(&ms).await;
    let a = Arc::new(assemble_array(&ms).await);
    let size = cut_for_fewer_members(&a, 4).await;
    model.data.truncate(size as usize);
    a.set_attribute("sync_action", "frozen").unwrap();
    a.grow(GrowChange::RaidDevices(4), Vec::new()).await.unwrap();
    let start_position = a.get_attribute("reshape_position").unwrap();
    a.stop().await.unwrap();
    drop(a);
    let start = read_superblock(&ms[0].dev).await.unwrap().events;
    before.missed(&ms[1], 1, start, true);
    before.missed(&ms[4], 4, start, false);
    assert_eq!(read_superblock(&ms[4].dev).await.unwrap().raid_disks, 5, "member 4 as the cut left it");

    let o = AssembleOptions { name: "sscut".into(), start_frozen: true, ..AssembleOptions::default() };
    let got = assemble(member_devs(&ms), o).await.unwrap_or_else(|e| panic!("assembly after the cut: {e}"));
    assert!(got.refused.is_empty(), "no member left out: {:?}", got.refused);
    let note = got.notes.iter().find(|n| n.contains("started the reshape")).expect("the adoption is reported");
    assert!(note.contains("sscut-1") && note.contains("sscut-4"), "{note}");
    let b = Arc::new(got.array);
    assert_eq!(b.core().degraded(), 0, "every member in sync: {:#}", b.detail());
    assert_eq!(b.get_attribute("reshape_position").unwrap(), start_position);
    assert_eq!(b.get_attribute("raid_disks").unwrap(), "4");
    b.set_array_size(Some(size)).unwrap();
    verify_all(&*b, &model).await;
    b.set_attribute("sync_action", "idle").unwrap();
    fast_sync(&b);
    b.wait_reshape().await.unwrap();
    verify_all(&*b, &model).await;
    assert_eq!(check(&b).await, 0);
    assert_eq!(b.core().slots().spares().len(), 1, "the dropped member is a spare");
    b.stop().await.unwrap();
}

/// raid0 to more members (`grow --raid-devices N --add DEV...`), as mdadm does it: raid0 ->
/// raid4 with the parity role empty, a forward restripe in which the first new device fills
/// the old parity role (recovered by the reshape: RECOVERY_OFFSET) and the new parity role
/// stays empty, then raid0 again. Under a writer: every write reads back, the array grows by
/// the new members, and assembles again as raid0.
async fn raid0_grow_under_writes(name: &str, old: usize, new: usize) {
    let mut rng = Rng::new(seed(name, 47));
    let ms = mem_members(&format!("{name}-"), new, 16 * MIB);
    let (a, m) = filled_level(&ms[..old], Level::Raid0, old as u32, 64, &mut rng).await;
    let before = a.size_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    tokio::task::yield_now().await;
    let r = a.grow(GrowChange::RaidDevices(new as u32), member_devs(&ms[old..])).await.unwrap();
    assert!(r.summary.contains("raid0 again when it finishes"), "{}", r.summary);
    a.set_attribute("sync_speed_min", "5000").unwrap();
    if a.core().personality().reshape().is_some_and(|r| !r.is_done()) {
        assert_eq!((a.info().level, a.info().raid_disks), (Level::Raid4, new as u32 + 1), "raid4 while it moves");
    }
    a.wait_reshape().await.unwrap();
    stop.store(true, Ordering::Release);
    let (mut m, writes) = w.await.unwrap();
    eprintln!("{name}: {writes} writes during the reshape");
    assert!(writes > 0);
    assert_eq!((a.info().level, a.info().raid_disks), (Level::Raid0, new as u32));
    assert_eq!(a.size_bytes() / new as u64, before / old as u64, "the array grows by the new members");
    verify_all(&*a, &m).await;
    let mut grown = Model::new(a.size_bytes());
    grown.apply(0, &m.data);
    m = grown;
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    verify_all(&*a, &m).await;
    a.stop().await.unwrap();
    for mb in &ms {
        let sb = read_superblock(&mb.dev).await.unwrap();
        assert_eq!(
            (sb.level, sb.raid_disks, sb.feature_map & feature::RESHAPE_ACTIVE),
            (0, new as u32, 0),
            "{}",
            mb.name
        );
    }
    let b = assemble_array(&ms).await;
    verify_all(&b, &m).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_3_to_4_under_writes() {
    raid0_grow_under_writes("reshape0-34", 3, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_2_to_4_under_writes() {
    raid0_grow_under_writes("reshape0-24", 2, 4).await;
}

/// A raid0 of three members (`members[..3]`, filled) restriping onto `members[3]`, stopped
/// after its first checkpoint; returns what the array holds.
async fn stopped_raid0_restripe(ms: &[SimMember], rng: &mut Rng) -> Model {
    let (a, m) = filled_level(&ms[..3], Level::Raid0, 3, 64, rng).await;
    a.grow(GrowChange::RaidDevices(4), member_devs(&ms[3..])).await.unwrap();
    a.set_attribute("sync_speed_max", "20000").unwrap();
    until_checkpointed(&a).await;
    a.stop().await.unwrap();
    m
}

/// Lets the resumed raid0 restripe `b` finish (raid4 of 5, the parity role empty), then takes it
/// back to raid0 with `grow --level 0`, checking the data at each step.
async fn finish_back_to_raid0(b: Arc<Array>, m: &Model) {
    fast_sync(&b);
    b.wait_reshape().await.unwrap();
    assert_eq!((b.info().level, b.info().raid_disks, b.core().degraded()), (Level::Raid4, 5, 1));
    verify_all(&*b, m).await;
    b.grow(
        GrowChange::Level { level: Level::Raid0, layout: mdkit_md::format::takeover::LayoutChoice::Default },
        Vec::new(),
    )
    .await
    .unwrap();
    assert_eq!((b.info().level, b.info().raid_disks), (Level::Raid0, 4));
    verify_all(&*b, m).await;
    b.stop().await.unwrap();
}

/// A raid0 restripe stopped half-way assembles as the raid4 reshape it is on disk: the device
/// in the old parity role records how far the reshape recovered it (the new geometry's
/// per-member position), reads are right, the reshape finishes as raid4 with the parity role
/// empty (the level to go back to lives in the grow that started it, as in mdadm), and
/// `grow --level 0` makes it raid0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_raid0_restripe_resumes_and_goes_back_to_raid0() {
    let mut rng = Rng::new(seed("reshape0-resume", 47));
    let ms = mem_members("resume0-", 4, 16 * MIB);
    let m = stopped_raid0_restripe(&ms, &mut rng).await;
    let sb = read_superblock(&ms[3].dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "stopped mid-way: still reshaping");
    assert_eq!((sb.level, sb.raid_disks, sb.delta_disks, sb.raw_role()), (4, 5, 1, 3));
    assert_ne!(sb.feature_map & feature::RECOVERY_OFFSET, 0, "recovered by the reshape");
    let pos = sb.reshape_position_sectors;
    assert_eq!(sb.recovery_offset_sectors, pos / 4, "the new geometry's per-member position");
    let b = Arc::new(assemble_array(&ms).await);
    assert_eq!(b.sync_status().action, "reshape");
    assert_eq!(b.core().degraded(), 1, "the old parity role counts as missing in the old geometry only");
    verify_all(&*b, &m).await;
    finish_back_to_raid0(b, &m).await;
}

/// A member the restripe recovers whose superblock claims more than the reshape wrote on it
/// (recovery_offset crafted to its whole data area, checksum valid) is capped at assembly, which
/// says so: beyond the reshape position, where that member holds no parity, a read that a data
/// member fails is an unrecoverable error, never data rebuilt from it (before the cap this read
/// returned wrong data). Below the position the reshape did write it; the same data reads
/// back, the restripe resumes and ends, and the array goes back to raid0 intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_offset_past_the_reshape_position_is_not_trusted() {
    let mut rng = Rng::new(seed("reshape0-crafted-recovery", 53));
    let ms = faulty_members("crafted0-", 4, 16 * MIB);
    let m = stopped_raid0_restripe(&ms, &mut rng).await;
    let mut sb = read_superblock(&ms[3].dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "stopped mid-way");
    assert!(sb.recovery_offset_sectors < sb.data_size_sectors / 2, "{}", sb.recovery_offset_sectors);
    sb.recovery_offset_sectors = sb.data_size_sectors;
    ms[3].mem.as_ref().unwrap().write_bytes(sb.super_offset_sectors * 512, &sb.encode().unwrap());
    // The members as they are now: the probe below records a bad block on member 0.
    let image = |m: &SimMember| {
        let mut v = vec![0u8; (16 * MIB) as usize];
        m.mem.as_ref().unwrap().read_bytes(0, &mut v);
        v
    };
    let saved: Vec<Vec<u8>> = ms.iter().map(image).collect();

    let o = AssembleOptions { name: "crafted".into(), start_frozen: true, ..AssembleOptions::default() };
    let got = assemble(member_devs(&ms), o).await.unwrap();
    let note = got.notes.iter().find(|n| n.contains("recovery_offset")).unwrap_or_else(|| panic!("{:?}", got.notes));
    assert!(note.contains("crafted0-3") && note.contains("not trusted past sector"), "{note}");
    let b = got.array;
    let position: u64 = b.get_attribute("reshape_position").unwrap().parse().unwrap();
    let sb0 = read_superblock(&ms[0].dev).await.unwrap();
    assert_eq!(sb0.raw_role(), 0);
    // The old geometry (raid4 of 3 data roles, 64 KiB chunks) in its last row: member 0's chunk.
    let row = sb0.data_size_sectors / 128 - 1;
    let (array_at, member_at) = (row * 3 * 64 * 1024, (sb0.data_offset_sectors + row * 128) * 512);
    assert!(array_at / 512 > position, "the probe lies beyond the reshape position {position}");
    let rule =
        ms[0].fault.as_ref().unwrap().add(FaultRule::error(OpMask::READ, Some(member_at..member_at + 64 * 1024)));
    let e = b.read_vec(array_at, 64 * 1024).await.expect_err("member 0 failed the read; no parity holds that row");
    assert_eq!(MdError::of(&e).map(|m| m.kind), Some(MdErrorKind::Unrecoverable), "{e}");
    ms[0].fault.as_ref().unwrap().remove(rule);
    b.stop().await.unwrap();
    drop(b);
    for (m, v) in ms.iter().zip(&saved) {
        m.mem.as_ref().unwrap().write_bytes(0, v);
    }

    let b = Arc::new(assemble_array(&ms).await);
    assert_eq!((b.sync_status().action, b.core().degraded()), ("reshape", 1));
    verify_all(&*b, &m).await;
    finish_back_to_raid0(b, &m).await;
}

/// A raid0 of members of different sizes (more than one zone) cannot take the raid4 step md
/// needs: refused with the reason, nothing changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_of_several_zones_is_refused_unchanged() {
    let mut ms = mem_members("zones0-", 2, 16 * MIB);
    ms.extend(mem_members("zones0-big-", 1, 24 * MIB));
    ms.extend(mem_members("zones0-new-", 1, 24 * MIB));
    let a = create_array(&ms[..3], opts(Level::Raid0, 3, Some(64), None, false, true)).await;
    let before = a.size_bytes();
    let e = a.grow(GrowChange::RaidDevices(4), member_devs(&ms[3..])).await.unwrap_err().to_string();
    assert!(e.contains("cannot grow raid0 to 4 members") && e.contains("more than one zone"), "{e}");
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid0, 3, before), "unchanged");
    a.stop().await.unwrap();
}
