//! `Array::grow` on running arrays (issue 17, first slice): `--size max` after the member
//! files grew (data written before and after, bitmap grown with a bigger chunk, new region
//! resynced, check finds 0 mismatches), `--bitmap internal|none` under I/O, and raid1 mirrors
//! 2 -> 3 (an added spare is recovered) and 3 -> 2 (mdadm's rules: remove a member first).
//! Writers keep running while the array is replaced: their writes wait, none fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng};
use mdkit_md::array::{
    Array, AssembleOptions, BitmapChange, CreateOptions, GrowChange, GrowSize, LayoutChoice, MemberDev, assemble,
};
use mdkit_md::format::bitmap::BitmapSuper;
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::layout::Level;

use crate::array_util::{
    MIB, Model, asked_array_size, check, create_array, fast_sync, mem_members, member_devs, opts, random_write, seed,
    verify_all,
};

/// Writes random blocks below `limit` until told to stop; returns the model it kept.
fn writer(a: Arc<Array>, mut m: Model, seed: u64, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(Model, u64)> {
    tokio::spawn(async move {
        let mut rng = Rng::new(seed);
        let mut n = 0u64;
        while !stop.load(Ordering::Acquire) || n < 8 {
            random_write(&*a, &mut m, &mut rng, 16).await;
            n += 1;
            tokio::task::yield_now().await;
        }
        (m, n)
    })
}

fn file_members(dir: &std::path::Path, n: usize, size: u64) -> Vec<MemberDev> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("m{i}.img"));
            std::fs::File::create(&p).unwrap().set_len(size).unwrap();
            let dev: DeviceRef = Arc::new(FileDevice::open(&p, FileOptions::default()).unwrap());
            MemberDev::new(format!("m{i}.img"), dev)
        })
        .collect()
}

fn reopen(dir: &std::path::Path, n: usize) -> Vec<MemberDev> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("m{i}.img"));
            let dev: DeviceRef = Arc::new(FileDevice::open(&p, FileOptions::default()).unwrap());
            MemberDev::new(format!("m{i}.img"), dev)
        })
        .collect()
}

async fn bitmap_super(dev: &DeviceRef) -> BitmapSuper {
    let sb = mdkit_md::array::read_superblock(dev).await.unwrap();
    let at = sb.bitmap_sector().expect("a bitmap") * 512;
    BitmapSuper::decode(&dev.read_vec(at, 4096).await.unwrap()).unwrap()
}

async fn grow_size_max(level: Level, n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let small = 16 * MIB;
    let devs = file_members(dir.path(), n, small);
    let mut o = CreateOptions::new("md-grow", level, n as u32);
    o.chunk_kib = if level.uses_chunks() { Some(64) } else { None };
    // 4 KiB bitmap chunks in mdadm's 4 KiB of bitmap space: growing 10x needs a bigger chunk.
    o.bitmap = BitmapRequest::Internal { chunk_bytes: Some(4096) };
    o.assume_clean = true;
    let a = Arc::new(mdkit_md::array::create(devs.clone(), o).await.unwrap().array);
    fast_sync(&a);
    let old_size = a.size_bytes();
    let old_chunk = bitmap_super(&devs[0].dev).await.chunk_bytes;
    assert_eq!(old_chunk, 4096);
    let mut rng = Rng::new(seed("grow_size_max", 17));
    let mut m = Model::new(old_size);
    for _ in 0..64 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    // The operator grows the member files; grow re-reads their sizes.
    for i in 0..n {
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(format!("m{i}.img")))
            .unwrap()
            .set_len(10 * small)
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    tokio::task::yield_now().await;
    let r = a.grow(GrowChange::Size { size: GrowSize::Max, assume_clean: false }, vec![]).await.unwrap();
    stop.store(true, Ordering::Release);
    let (old_model, writes) = w.await.unwrap();
    assert!(writes >= 8);
    assert_eq!(r.size_bytes_before, old_size);
    assert!(r.size_bytes_after > 9 * old_size, "{r:?}");
    assert_eq!(a.size_bytes(), r.size_bytes_after);
    assert!(r.summary.contains("resync from sector"), "{}", r.summary);
    let new_chunk = bitmap_super(&devs[0].dev).await.chunk_bytes;
    assert!(new_chunk > old_chunk, "the bitmap chunk grows with the array ({new_chunk})");
    let mut m = Model::new(a.size_bytes());
    m.apply(0, &old_model.data);
    for _ in 0..64 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    a.wait_sync_idle().await;
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0, "check after the grown part's resync");
    let size = a.size_bytes();
    a.stop().await.unwrap();
    drop(a);
    let again = assemble(reopen(dir.path(), n), AssembleOptions { name: "md-grow".into(), ..Default::default() })
        .await
        .unwrap()
        .array;
    assert_eq!(again.size_bytes(), size);
    assert!(again.info().member_size_sectors * 512 > 9 * small);
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_size_max_after_the_member_files_grew() {
    grow_size_max(Level::Raid1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_size_max_after_the_member_files_grew() {
    grow_size_max(Level::Raid5, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bitmap_added_and_removed_under_io() {
    let ms = mem_members("bm", 2, 32 * MIB);
    let a = Arc::new(create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await);
    fast_sync(&a);
    assert!(a.core().bitmap.is_none());
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("bitmap_added_and_removed_under_io", 5));
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    for change in [BitmapChange::Internal { chunk_bytes: Some(MIB as u32) }, BitmapChange::None] {
        let stop = Arc::new(AtomicBool::new(false));
        let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
        tokio::task::yield_now().await;
        a.grow(GrowChange::Bitmap(change), vec![]).await.unwrap();
        stop.store(true, Ordering::Release);
        m = w.await.unwrap().0;
        let has = a.core().bitmap.is_some();
        assert_eq!(has, matches!(change, BitmapChange::Internal { .. }));
        if has {
            assert_eq!(bitmap_super(&ms[0].dev).await.chunk_bytes, MIB as u32);
            let e = a.grow(GrowChange::Bitmap(change), vec![]).await.unwrap_err().to_string();
            assert!(e.contains("already has an internal bitmap"), "{e}");
        }
        verify_all(&*a, &m).await;
    }
    let e = a.grow(GrowChange::Bitmap(BitmapChange::None), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("no bitmap to remove"), "{e}");
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
    drop(a);
    let again = crate::array_util::assemble_array(&ms).await;
    assert!(again.core().bitmap.is_none());
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_mirrors_two_to_three_and_back() {
    let ms = mem_members("r1m", 3, 16 * MIB);
    let a = Arc::new(create_array(&ms[..2], opts(Level::Raid1, 2, None, None, true, true)).await);
    fast_sync(&a);
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("raid1_mirrors_two_to_three_and_back", 9));
    for _ in 0..64 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    a.grow(GrowChange::RaidDevices(3), vec![ms[2].member_dev()]).await.unwrap();
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    a.wait_sync_idle().await;
    assert_eq!(a.info().raid_disks, 3);
    assert_eq!(a.core().degraded(), 0, "the added member was recovered into the third mirror");
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);

    // Fewer mirrors: md refuses while three members are active.
    let e = a.grow(GrowChange::RaidDevices(2), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("3 members are active; fail and remove 1"), "{e}");
    a.fail_member("r1m0").await.unwrap();
    a.remove_member("r1m0").await.unwrap();
    a.grow(GrowChange::RaidDevices(2), vec![]).await.unwrap();
    assert_eq!(a.info().raid_disks, 2);
    assert_eq!(a.core().degraded(), 0);
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);
    let e = a.grow(GrowChange::RaidDevices(3), vec![]).await;
    assert!(e.is_ok(), "growing without a spare leaves a degraded mirror, as md does");
    assert_eq!(a.core().degraded(), 1);
    a.stop().await.unwrap();
    drop(a);
    let again = crate::array_util::assemble_array(&ms[1..]).await;
    assert_eq!(again.info().raid_disks, 3);
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
}

/// A member failed before a grow that assembles the array again (here `--bitmap none`) is not
/// lost track of: it is listed as left out with the reason, `--remove` forgets it and `--add`
/// takes it back. It used to vanish from the array while the service still held it.
#[tokio::test]
async fn a_member_failed_before_a_grow_stays_listed_and_can_be_added_again() {
    let ms = mem_members("gf", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await;
    a.fail_member(&ms[1].name).await.unwrap();
    a.grow(GrowChange::Bitmap(BitmapChange::None), vec![]).await.unwrap();
    let left = a.left_out();
    assert!(left.iter().any(|r| r.member == ms[1].name && r.reason.contains("faulty before")), "{left:?}");
    a.remove_member(&ms[1].name).await.unwrap();
    assert!(a.left_out().is_empty());
    a.add_member(ms[1].member_dev()).await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.detail()["working_devices"], 2, "{}", a.detail());
    a.stop().await.unwrap();
}

#[tokio::test]
async fn restriping_changes_are_refused_by_name() {
    let ms = mem_members("r5", 3, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 3, Some(64), None, true, true)).await;
    // More members restripe (tests/reshape.rs) and need the new devices; fewer need the array
    // cut to the smaller size first, and the refusal names that size.
    let e = a.grow(GrowChange::RaidDevices(4), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("give exactly 1 new device(s) with --add, not 0"), "{e}");
    let e = a.grow(GrowChange::RaidDevices(2), vec![]).await.unwrap_err().to_string();
    assert!(e.starts_with("md-test: cannot reshape (3 -> 2 members): 2 members hold at most"), "{e}");
    assert!(e.contains("cut it first with grow --array-size") && asked_array_size(&e) < a.size_bytes(), "{e}");
    assert_eq!(a.info().raid_disks, 3, "the refusal changed nothing");
    let e = a.grow(GrowChange::Size { size: GrowSize::Sectors(64), assume_clean: false }, vec![]).await.unwrap_err();
    assert!(e.to_string().contains("shrinking would cut off data and is refused"), "{e}");
    let e = a.grow(GrowChange::RaidDevices(3), member_devs(&ms[..1])).await.unwrap_err().to_string();
    assert!(e.contains("--raid-devices 3: no change requested"), "{e}");
    a.stop().await.unwrap();
}

/// `grow --level` while a writer keeps writing: raid1 -> raid5 (2 members) -> raid1, and
/// raid5 -> raid6 with Q on an added member (recovered) -> raid5, the Q member a spare after.
/// Every step: the model reads back, check finds 0 mismatches, and the array assembles again
/// at the new level from its superblocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn level_changes_under_io() {
    let lv = |level, layout| GrowChange::Level { level, layout };
    let ms = mem_members("lvl", 2, 16 * MIB);
    let a = Arc::new(create_array(&ms, opts(Level::Raid1, 2, None, None, true, true)).await);
    fast_sync(&a);
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("level_changes_under_io", 3));
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    for (to, want) in [(Level::Raid5, (Level::Raid5, 2)), (Level::Raid1, (Level::Raid1, 0))] {
        let stop = Arc::new(AtomicBool::new(false));
        let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
        a.grow(lv(to, LayoutChoice::Default), vec![]).await.unwrap();
        stop.store(true, Ordering::Release);
        m = w.await.unwrap().0;
        assert_eq!((a.info().level, a.info().layout), want);
        verify_all(&*a, &m).await;
        assert_eq!(check(&a).await, 0, "{to:?}");
    }
    a.stop().await.unwrap();
    drop(a);

    let ms = mem_members("lv6", 4, 16 * MIB);
    let a = Arc::new(create_array(&ms[..3], opts(Level::Raid5, 3, Some(64), None, true, true)).await);
    fast_sync(&a);
    let mut m = Model::new(a.size_bytes());
    let e = a.grow(lv(Level::Raid6, LayoutChoice::Default), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("pass --layout preserve"), "{e}");
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    a.grow(lv(Level::Raid6, LayoutChoice::Preserve), vec![ms[3].member_dev()]).await.unwrap();
    a.wait_sync_idle().await;
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    assert_eq!((a.info().level, a.info().layout, a.info().raid_disks), (Level::Raid6, 18, 4));
    assert_eq!(a.core().degraded(), 0, "Q was recovered onto the added member");
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);
    let e = a.grow(lv(Level::Raid5, LayoutChoice::Algorithm(3)), vec![]).await.unwrap_err().to_string();
    assert!(e.contains("keeps layout 2"), "{e}");
    a.grow(lv(Level::Raid5, LayoutChoice::Default), vec![]).await.unwrap();
    assert_eq!((a.info().level, a.info().layout, a.info().raid_disks), (Level::Raid5, 2, 3));
    assert_eq!(a.core().slots().spares().len(), 1, "the Q member is a spare");
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
    drop(a);
    let again = crate::array_util::assemble_array(&ms).await;
    assert_eq!((again.info().level, again.info().raid_disks), (Level::Raid5, 3));
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
}

/// raid5 -> raid6 `--layout preserve --add`, cut dirty (safe_mode_delay long, a write just
/// done, no stop) while Q is rebuilt onto the added member: only the Q role (left-symmetric-6:
/// Q alone on the last role) is not in sync, so nothing would be rebuilt from parity and the
/// array assembles without --force, as raid5.c counts a dirty parity disk (only_parity); QA saw
/// it refused "dirty degraded ... parity cannot be trusted" after a kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dirty_cut_while_q_is_rebuilt_after_raid5_to_raid6_assembles_without_force() {
    let ms = mem_members("q6cut", 4, 16 * MIB);
    let a = create_array(&ms[..3], opts(Level::Raid5, 3, Some(64), None, true, true)).await;
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("a_dirty_cut_while_q_is_rebuilt", 7));
    for _ in 0..16 {
        random_write(&a, &mut m, &mut rng, 32).await;
    }
    a.set_attribute("safe_mode_delay", "3600").unwrap();
    a.set_attribute("sync_speed_min", "1").unwrap();
    a.set_attribute("sync_speed_max", "1").unwrap();
    let preserve = GrowChange::Level { level: Level::Raid6, layout: LayoutChoice::Preserve };
    a.grow(preserve, vec![ms[3].member_dev()]).await.unwrap();
    random_write(&a, &mut m, &mut rng, 32).await;
    assert_eq!(a.get_attribute("array_state").unwrap(), "active", "dirty at the cut");
    assert_eq!(a.core().degraded(), 1, "Q still rebuilding at the cut");
    drop(a);
    let b = assemble(member_devs(&ms), AssembleOptions { name: "q6cut".into(), ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("refused without --force: {e}"))
        .array;
    assert_eq!((b.info().level, b.info().layout), (Level::Raid6, 18));
    fast_sync(&b);
    b.wait_sync_idle().await;
    assert_eq!(b.core().degraded(), 0);
    verify_all(&b, &m).await;
    assert_eq!(check(&b).await, 0);
    b.stop().await.unwrap();
}

/// raid0 -> raid4 parity-last with `--add` while a writer writes: the parity member is
/// recovered, the model reads back, check finds 0; then back to raid0 (the parity member is
/// failed and removed first); a multi-zone raid0 is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_gains_parity_under_io() {
    let ms = mem_members("r0p", 4, 16 * MIB);
    let a = Arc::new(create_array(&ms[..3], opts(Level::Raid0, 3, Some(64), None, false, true)).await);
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("raid0_gains_parity_under_io", 5));
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    let size = a.size_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    let to4 = GrowChange::Level { level: Level::Raid4, layout: LayoutChoice::Default };
    let r = a.grow(to4, vec![ms[3].member_dev()]).await.unwrap();
    fast_sync(&a);
    a.wait_sync_idle().await;
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    assert!(r.summary.starts_with("level raid0 -> raid4, layout parity-last"), "{}", r.summary);
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid4, 4, size));
    assert_eq!(a.core().degraded(), 0, "parity was recovered onto the added member");
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);
    // And back, under writes: the parity member is failed and removed, the rest is the raid0.
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    let to0 = GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default };
    let r = a.grow(to0, vec![]).await.unwrap();
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    assert!(r.summary.starts_with("level raid4 -> raid0"), "{}", r.summary);
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid0, 3, size));
    verify_all(&*a, &m).await;
    a.stop().await.unwrap();
    drop(a);
    let again = crate::array_util::assemble_array(&ms[..3]).await;
    assert_eq!((again.info().level, again.size_bytes()), (Level::Raid0, size));
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
    let (parity, data) = (
        mdkit_md::array::read_superblock(&ms[3].dev).await.unwrap(),
        mdkit_md::array::read_superblock(&ms[0].dev).await.unwrap(),
    );
    assert!(data.dev_roles[parity.dev_number as usize] >= 3, "the parity member left the array: {:?}", data.dev_roles);

    let ms = mem_members("r0z", 3, 16 * MIB);
    let small = mem_members("r0s", 1, 8 * MIB);
    let devs = vec![ms[0].member_dev(), ms[1].member_dev(), small[0].member_dev()];
    let a = mdkit_md::array::create(devs, opts(Level::Raid0, 3, Some(64), None, false, true)).await.unwrap().array;
    let e = a.grow(to4, vec![]).await.unwrap_err().to_string();
    assert!(e.contains("more than one zone"), "{e}");
    a.stop().await.unwrap();
}

/// raid0 -> raid10 near-2 with two spares while a writer writes (the odd roles are recovered),
/// then raid10 -> raid0: the second copy of each pair is failed and removed as mdadm does, the
/// rest become the raid0. The model reads back at every step; check finds 0 on the raid10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_raid10_round_trip_under_io() {
    let ms = mem_members("r010", 4, 16 * MIB);
    let a = Arc::new(create_array(&ms[..2], opts(Level::Raid0, 2, Some(64), None, false, true)).await);
    let mut m = Model::new(a.size_bytes());
    let mut rng = Rng::new(seed("raid0_raid10_round_trip_under_io", 5));
    for _ in 0..32 {
        random_write(&*a, &mut m, &mut rng, 32).await;
    }
    let size = a.size_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    let to10 = GrowChange::Level { level: Level::Raid10, layout: LayoutChoice::Default };
    a.grow(to10, vec![ms[2].member_dev(), ms[3].member_dev()]).await.unwrap();
    fast_sync(&a);
    a.wait_sync_idle().await;
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    assert_eq!((a.info().level, a.info().layout, a.info().raid_disks, a.size_bytes()), (Level::Raid10, 0x102, 4, size));
    assert_eq!(a.core().degraded(), 0, "the second copies were recovered onto the added members");
    verify_all(&*a, &m).await;
    assert_eq!(check(&a).await, 0);

    let stop = Arc::new(AtomicBool::new(false));
    let w = writer(a.clone(), m, rng.next_u64(), stop.clone());
    a.grow(GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default }, vec![]).await.unwrap();
    stop.store(true, Ordering::Release);
    m = w.await.unwrap().0;
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid0, 2, size));
    verify_all(&*a, &m).await;
    a.stop().await.unwrap();
    drop(a);
    let again = crate::array_util::assemble_array(&ms).await;
    assert_eq!((again.info().level, again.info().raid_disks), (Level::Raid0, 2));
    verify_all(&again, &m).await;
    again.stop().await.unwrap();
}
