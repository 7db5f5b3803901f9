//! raid5/raid6 member faults under load, on fault-injecting members with flash-like latency:
//! - one member (raid5) or two (raid6, one after the other) are pulled in the middle of a
//!   verifying workload: no error reaches the client, no acknowledged write is lost, the
//!   survivors' superblocks record the failures; spares are rebuilt while the workload goes
//!   on, `check` finds 0 mismatches, and a re-assembly of survivors + rebuilt spares has
//!   everything;
//! - a rebuild cut off by dropping the array resumes from the `recovery_offset` checkpoint;
//! - a transient read error is served by reconstruction and the block rewritten (corrected,
//!   member kept); a persistent one fails the member; neither reaches the client;
//! - a member that fails a write is failed and the write succeeds; the member the array
//!   cannot run without is never failed (the client gets the error instead);
//! - a dirty degraded raid5 is refused at assembly unless forced;
//! - a read that cannot be reconstructed (raid5: a read error while another member is gone;
//!   raid6: a third) is retried once, then fails with EIO and a typed error — never data — and
//!   the member is failed and the array broken, as md does without a bad-block log; on an
//!   array that was not degraded that far only the request fails.

use crate::array_util;

use std::sync::Arc;
use std::time::Duration;

use array_util::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, DeviceError, DeviceRef, FaultRule, FaultyDevice, FlashDevice, FlashModel, IoErrorKind,
    MemDevice, OpMask, Rng, SharedBuf, WriteFlags,
};
use mdkit_md::array::{Array, AssembleOptions, MdError, MdErrorKind, assemble};
use mdkit_md::format::superblock::{ROLE_FAULTY, feature};
use mdkit_md::layout::Level;

/// Fault injectors over flash-latency RAM members.
fn members(prefix: &str, n: usize, size: u64) -> Vec<SimMember> {
    let model = FlashModel {
        read_latency_us: 30,
        write_latency_us: 20,
        rmw_latency_us: 0,
        channels: 64,
        ..FlashModel::default()
    };
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), size));
            let flash: DeviceRef = Arc::new(FlashDevice::new(mem.clone() as DeviceRef, model));
            let f = FaultyDevice::new(flash);
            let h = f.handle();
            SimMember { name, dev: Arc::new(f), mem: Some(mem), fault: Some(h) }
        })
        .collect()
}

async fn pull_under_load(level: Level, n: usize, pulls: &[usize], seed: u64) {
    let name = format!("{}-pull", level.name());
    let ms = members(&format!("{name}-"), n + pulls.len(), 12 * MIB);
    let (active, spares) = ms.split_at(n);
    let a = create_array(active, opts(level, n as u32, Some(64), None, true, true)).await;
    fast_sync(&a);
    let a: &'static Array = Box::leak(Box::new(a));
    let mut model = Model::new(a.size_bytes());
    verifying_workload(a, seed, 4, 60, 40, &mut model).await;
    for (k, &p) in pulls.iter().enumerate() {
        // Pull the member while the next round of the workload runs.
        let h = active[p].fault.clone().unwrap();
        let puller = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3)).await;
            h.pull();
        });
        verifying_workload(a, seed + 1 + k as u64, 4, 90, 40, &mut model).await;
        puller.await.unwrap();
    }
    verifying_workload(a, seed + 10, 4, 30, 40, &mut model).await; // certainly after the pulls
    verify_all(a, &model).await;
    assert_eq!(a.core().degraded() as usize, pulls.len(), "{name}");
    let survivor = active.iter().enumerate().find(|(i, _)| !pulls.contains(i)).unwrap().1;
    let sb = sb_of(survivor);
    for &p in pulls {
        assert_eq!(a.get_attribute(&format!("dev-{name}-{p}/state")).unwrap(), "faulty");
        assert_eq!(sb.dev_roles[p], ROLE_FAULTY, "{name}: survivor's dev_roles {:?}", &sb.dev_roles[..n]);
        assert!(sb.events > sb_of(&active[p]).events);
    }
    // Rebuild onto spares while the workload continues.
    for (k, &p) in pulls.iter().enumerate() {
        a.remove_member(&format!("{name}-{p}")).await.unwrap();
        a.add_member(spares[k].member_dev()).await.unwrap();
    }
    verifying_workload(a, seed + 20, 4, 60, 40, &mut model).await;
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0, "{name}: rebuilt");
    assert_eq!(check(a).await, 0, "{name}: mismatches after the rebuild");
    verify_all(a, &model).await;
    a.stop().await.unwrap();
    let now: Vec<SimMember> = active
        .iter()
        .enumerate()
        .filter(|(i, _)| !pulls.contains(i))
        .map(|(_, m)| m.clone())
        .chain(spares.iter().cloned())
        .collect();
    let b = assemble_array(&now).await;
    assert_eq!(b.core().degraded(), 0);
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_member_pulled_under_load() {
    pull_under_load(Level::Raid5, 4, &[2], seed("raid5_member_pulled_under_load", 71)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_two_members_pulled_under_load() {
    pull_under_load(Level::Raid6, 6, &[1, 4], seed("raid6_two_members_pulled_under_load", 73)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_rebuild_resumes_from_checkpoint() {
    for (level, n, lost) in [(Level::Raid5, 4, vec![1usize]), (Level::Raid6, 5, vec![0, 3])] {
        let mut rng = Rng::new(seed("interrupted_rebuild_resumes_from_checkpoint", 5));
        let ms = mem_members(&format!("ir-{}-", level.name()), n + lost.len(), 24 * MIB);
        let a = create_array(&ms[..n], opts(level, n as u32, Some(64), None, false, true)).await;
        let mut model = Model::new(a.size_bytes());
        fill(&a, &mut model, &mut rng).await;
        for &l in &lost {
            a.fail_member(&ms[l].name).await.unwrap();
            a.remove_member(&ms[l].name).await.unwrap();
        }
        // A slow rebuild onto the spares, cut off (array dropped, no stop) past a checkpoint.
        a.set_attribute("sync_speed_min", "20000").unwrap();
        a.set_attribute("sync_speed_max", "20000").unwrap();
        // Frozen while the spares are added, so they are activated together and rebuilt in one
        // pass (a spare added during another's recovery waits for the next pass, from sector 0).
        a.request_sync("frozen").unwrap();
        for k in 0..lost.len() {
            a.add_member(ms[n + k].member_dev()).await.unwrap();
        }
        a.request_sync("recover").unwrap();
        // Every spare's superblock must carry a checkpoint before the cut (they are written one
        // after another, so a cut can leave them different: recovery resumes at the lowest).
        // (A spare whose superblock has no RECOVERY_OFFSET finished its own rebuild already:
        // the second raid6 spare can arrive while the first one's recovery runs.)
        let spare_checkpoint = || {
            (0..lost.len())
                .map(|k| sb_of(&ms[n + k]))
                .filter(|sb| sb.feature_map & 2 != 0)
                .map(|sb| sb.recovery_offset_sectors)
                .min()
                .unwrap_or(0)
        };
        let started = std::time::Instant::now();
        let total = loop {
            let st = a.sync_status();
            if st.running.is_some() && st.done_sectors * 3 > st.total_sectors && spare_checkpoint() > 0 {
                // Stall it there (the batch in flight ends), so a slow test thread on a busy
                // machine cannot let it finish before the cut.
                a.set_attribute("sync_speed_max", "1").unwrap();
                break st.total_sectors;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{level:?}: the rebuild ended or stalled before every spare had a checkpoint: {st:?}, spare checkpoint {}",
                spare_checkpoint()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let survivors: Vec<SimMember> =
            ms.iter().enumerate().filter(|(i, _)| !lost.contains(i)).map(|(_, m)| m.clone()).collect();
        // The cut must find the array clean (dirty and degraded would need a forced assembly).
        wait_clean_on_disk(&survivors).await;
        drop(a);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let checkpoint = spare_checkpoint();
        assert!(checkpoint > 0, "a spare's superblock carries RECOVERY_OFFSET");
        assert!(checkpoint >= total / 16, "checkpoint {checkpoint} of {total} sectors");
        let b = assemble(
            member_devs(&survivors),
            AssembleOptions { name: "md-test".into(), start_frozen: true, ..Default::default() },
        )
        .await
        .unwrap();
        assert!(b.notes.iter().any(|note| note.contains(&format!("from sector {checkpoint}"))), "{:?}", b.notes);
        let notes = b.notes.clone();
        let b = b.array;
        // Degraded reads are served from parity before the rebuild continues.
        verify_all(&b, &model).await;
        fast_sync(&b);
        b.request_sync("recover").unwrap();
        let first = loop {
            let st = b.sync_status();
            if st.running.is_some() || st.runs > 0 {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert!(
            first.done_sectors >= checkpoint,
            "{level:?}: resumed at {} < checkpoint {checkpoint}: {first:?}; assembly: {notes:?}",
            first.done_sectors
        );
        b.wait_sync_idle().await;
        assert_eq!(b.core().degraded(), 0, "{level:?}");
        verify_all(&b, &model).await;
        assert_eq!(check(&b).await, 0);
        b.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_errors_are_reconstructed_then_repaired_or_fail_the_member() {
    let mut rng = Rng::new(seed("read_errors_are_reconstructed_then_repaired_or_fail_the_member", 8));
    for (level, n) in [(Level::Raid5, 4), (Level::Raid6, 5)] {
        let ms = members(&format!("rerr-{}-", level.name()), n, 12 * MIB);
        let a = create_array(&ms, opts(level, n as u32, Some(64), None, false, true)).await;
        let mut model = Model::new(a.size_bytes());
        fill(&a, &mut model, &mut rng).await;
        let dof = a.core().slots().in_sync(0).unwrap().data_offset_sectors * 512;
        // Array offset 0 is chunk 0 of stripe 0: on member data_members[0] at member offset 0.
        let g = mdkit_md::layout::ParityGeometry::new(level, n as u32, 2, 128).unwrap();
        let m0 = g.stripe_map(0).data_members[0];
        let f = ms[m0].fault.clone().unwrap();
        // Transient: one failed read, then fine.
        f.add(FaultRule::error(OpMask::READ, Some(dof + 8192..dof + 12288)).times(1));
        verify_range(&a, &model, 0, 64 * 1024).await;
        let corrected: u32 = a.core().slots().all_members().iter().map(|m| m.corrected_reads()).sum();
        // md counts corrected sectors: the 64 KiB chunk piece read was rebuilt and rewritten.
        assert_eq!(corrected, 128, "{level:?}: the bad block was rewritten and read back");
        assert_eq!(a.core().degraded(), 0, "{level:?}: a corrected read error keeps the member");
        // A read error met by a write's pre-read is handled the same way.
        f.add(FaultRule::error(OpMask::READ, Some(dof + 16384..dof + 20480)).times(1));
        for _ in 0..4 {
            let off = 65536 + 16384; // chunk 1 of stripe 0: its rcw/rmw reads chunk 0 rows
            let mut b = vec![0u8; 4096];
            rng.fill(&mut b);
            model.apply(off, &b);
            a.write(off, SharedBuf::from_slice(&b), WriteFlags::NONE).await.unwrap();
        }
        verify_all(&a, &model).await;
        assert_eq!(a.core().degraded(), 0, "{level:?}");
        // Persistent: the rewrite cannot be read back, the member is failed.
        f.add(FaultRule::error(OpMask::READ, Some(dof + 40960..dof + 45056)));
        verify_range(&a, &model, 32768, 32768).await;
        assert_eq!(a.get_attribute(&format!("dev-{}/state", ms[m0].name)).unwrap(), "faulty", "{level:?}");
        assert_eq!(a.core().degraded(), 1);
        verify_all(&a, &model).await;
        a.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_errors_fail_members_within_redundancy() {
    let mut rng = Rng::new(seed("write_errors_fail_members_within_redundancy", 9));
    let ms = members("werr-", 4, 12 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 4, Some(64), None, true, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    // A member dies during writes: it is failed, the writes succeed.
    ms[1].fault.as_ref().unwrap().add(FaultRule::error(OpMask::WRITE, None));
    for _ in 0..20 {
        random_write(&a, &mut model, &mut rng, 40).await;
    }
    assert_eq!(a.get_attribute("dev-werr-1/state").unwrap(), "faulty");
    verify_all(&a, &model).await;
    // Degraded: the next member failing a write would lose data: the range is recorded as a bad
    // block on it, the client gets the error and the member stays.
    let dof = a.core().slots().all_members().iter().find(|m| m.name() == "werr-3").unwrap().data_offset_sectors * 512;
    ms[3].fault.as_ref().unwrap().add(FaultRule::error(OpMask::WRITE, Some(dof..dof + 12 * MIB)));
    let mut saw_error = false;
    for _ in 0..8 {
        let (off, len) = random_extent(&mut rng, a.size_bytes(), 48);
        if let Err(e) = a.write(off, SharedBuf::zeroed(len as usize), WriteFlags::NONE).await {
            assert!(e.to_string().contains("werr-3"), "the error names the member: {e}");
            saw_error = true;
            break;
        }
        model.zero(off, len);
    }
    assert!(saw_error, "a write hit the injected error");
    assert!(a.get_attribute("dev-werr-3/state").unwrap().contains("in_sync"));
    assert_eq!(a.core().degraded(), 1);
    assert!(a.fail_member("werr-3").await.is_err(), "the array cannot run without werr-3");
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dirty_degraded_raid5_needs_force() {
    let mut rng = Rng::new(1);
    let ms = mem_members("dd-", 4, 8 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 4, Some(64), None, false, true)).await;
    a.set_attribute("safe_mode_delay", "60").unwrap();
    let mut model = Model::new(a.size_bytes());
    random_write(&a, &mut model, &mut rng, 16).await;
    a.fail_member("dd-2").await.unwrap();
    random_write(&a, &mut model, &mut rng, 16).await;
    drop(a); // crash while active (dirty) and degraded
    tokio::time::sleep(Duration::from_millis(20)).await;
    let survivors: Vec<SimMember> = ms.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, m)| m.clone()).collect();
    let e = assemble(member_devs(&survivors), AssembleOptions { name: "dd".into(), ..Default::default() })
        .await
        .err()
        .expect("dirty degraded raid5 must be refused");
    assert!(e.to_string().contains("dirty degraded"), "{e}");
    let b = assemble(member_devs(&survivors), AssembleOptions { name: "dd".into(), force: true, ..Default::default() })
        .await
        .unwrap()
        .array;
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}

//------------------------------------------------------------------------------------------------
// Reads that cannot be reconstructed (md-lifecycle.md 5.4, raid5.c raid5_end_read_request)

fn detail_of<'a>(d: &'a serde_json::Value, m: &SimMember) -> &'a serde_json::Value {
    d["members"].as_array().unwrap().iter().find(|x| x["name"] == m.name.as_str()).expect("member in detail")
}

/// `level` on `n` members with as many members failed as it tolerates, then read errors on one
/// more member `y`: a transient one is retried once (md's R5_ReadNoMerge) and served; a
/// persistent one fails the request with EIO and a typed error — never data. As md's
/// handle_failed_stripe, the lost range is recorded in `y`'s bad-block log: `y` and the array
/// stay, the range reads EIO without touching `y` again, and a write there clears it. With
/// `log_full`, no entry can be recorded and md fails `y` instead, which breaks the array
/// (writes refused); everything visible in `detail`.
async fn degraded_to_the_limit_then_read_errors(level: Level, n: usize, gone: &[usize], y: usize, log_full: bool) {
    let name = format!("{}-uncorrectable{}", level.name(), if log_full { "-full" } else { "" });
    let mut rng = Rng::new(seed(&name, 83));
    let ms = members(&format!("{name}-"), n, 8 * MIB);
    let a = create_array(&ms, opts(level, n as u32, Some(64), None, false, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    for g in gone {
        a.fail_member(&ms[*g].name).await.unwrap();
    }
    let my = a.core().slots().find(&ms[y].name).unwrap();
    let dof = my.data_offset_sectors * 512;
    // One stripe's data: some chunk of it is on `y` or needs `y` to be rebuilt.
    let data_len = (n as u64 - if level == Level::Raid6 { 2 } else { 1 }) * 64 * 1024;
    let fy = ms[y].fault.as_ref().unwrap();
    if log_full {
        // 512 one-sector entries (one 4 KiB log page, md's limit) far from the stripe.
        let far = my.data_offset_sectors + 8192;
        for i in 0..512 {
            a.set_attribute(&format!("dev-{}/bad_blocks", ms[y].name), &format!("{} 1", far + 2 * i)).unwrap();
        }
    }
    let entries_before = detail_of(&a.detail(), &ms[y])["bad_blocks"].as_u64().unwrap();

    // Transient: the retry reads it back; the client gets its data, nothing is failed.
    let rule = fy.add(FaultRule::error(OpMask::READ, Some(dof..dof + MIB)).times(1));
    verify_range(&a, &model, 0, data_len).await;
    assert_eq!(fy.fired(rule), Some(1), "{name}: the fault was met");
    assert!(my.is_in_sync(), "{name}: a read error that the retry covers fails nothing");
    assert_eq!(a.core().unrecoverable_reads(), 0, "{name}");
    assert!(!a.core().is_broken(), "{name}");

    // Persistent, on stripe 0's chunk of `y`: EIO, typed, no data.
    let rule = fy.add(FaultRule::error(OpMask::READ, Some(dof..dof + 64 * 1024)));
    let e = a.read_vec(0, data_len as usize).await.expect_err("no data a member failed to read");
    let md = MdError::of(&e).unwrap_or_else(|| panic!("{name}: untyped error {e}"));
    assert_eq!((md.kind, md.op), (MdErrorKind::Unrecoverable, "read"), "{name}: {e}");
    assert!(e.to_string().contains(&ms[y].name), "{name}: the error names the member that failed the read: {e}");
    assert_eq!(DeviceError::kind_of(&e), IoErrorKind::Eio, "{name}: an I/O error (NBD: EIO), not another kind");
    let d = a.detail();
    assert!(d["unrecoverable_reads"].as_u64().unwrap() >= 1, "{name}: {d:#}");
    assert!(detail_of(&d, &ms[y])["read_errors"].as_u64().unwrap() >= 2, "{name}: the error and its retry");
    if log_full {
        assert!(my.is_faulty(), "{name}: with no room in its log, md fails the member");
        let why = my.fail_reason().unwrap_or_default();
        assert!(why.contains("read error not correctable") && why.contains("bad-block log"), "{name}: {why}");
        assert!(a.core().is_broken(), "{name}: more members failed than the level tolerates");
        assert_eq!(a.get_attribute("array_state").unwrap(), "broken", "{name}");
        assert!(d["broken"].as_str().unwrap_or_default().contains(&ms[y].name), "{name}: {d:#}");
        assert_eq!(detail_of(&d, &ms[y])["state"][0], "faulty", "{name}: {d:#}");
        let e = a.write(0, SharedBuf::zeroed(4096), WriteFlags::NONE).await.expect_err("writes are refused");
        assert_eq!(MdError::of(&e).map(|m| m.kind), Some(MdErrorKind::Broken), "{name}: {e}");
        // The failure is recorded where a later assembly will see it.
        a.core().settle_failures().await.unwrap();
        let survivor = (0..n).find(|i| !gone.contains(i) && *i != y).unwrap();
        assert_eq!(sb_of(&ms[survivor]).dev_roles[my.dev_number as usize], ROLE_FAULTY, "{name}");
        a.stop().await.unwrap();
        return;
    }
    assert!(my.is_in_sync() && !a.core().is_broken(), "{name}: a recorded bad block keeps the member: {d:#}");
    assert!(detail_of(&d, &ms[y])["bad_blocks"].as_u64().unwrap() > entries_before, "{name}: recorded: {d:#}");
    assert_eq!(sb_of(&ms[y]).feature_map & feature::BAD_BLOCKS, feature::BAD_BLOCKS, "{name}: persisted");
    // The lost range now fails at once, without reading `y` again.
    let fired = fy.fired(rule).unwrap();
    let e = a.read_vec(0, data_len as usize).await.expect_err("still lost");
    assert_eq!(DeviceError::kind_of(&e), IoErrorKind::Eio, "{name}: {e}");
    assert_eq!(fy.fired(rule), Some(fired), "{name}: a listed range is not read from the media");
    // Reads elsewhere and writes keep working; rewriting the stripe clears the entry.
    verify_range(&a, &model, data_len, data_len).await;
    assert!(fy.remove(rule));
    let mut buf = vec![0u8; data_len as usize];
    rng.fill(&mut buf);
    a.write(0, SharedBuf::from_slice(&buf), WriteFlags::FUA).await.unwrap();
    model.apply(0, &buf);
    verify_range(&a, &model, 0, 2 * data_len).await;
    assert_eq!(detail_of(&a.detail(), &ms[y])["bad_blocks"].as_u64().unwrap(), entries_before, "{name}: cleared");
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_read_error_on_a_degraded_array_records_a_bad_block() {
    degraded_to_the_limit_then_read_errors(Level::Raid5, 4, &[0], 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_read_error_on_a_degraded_array_with_a_full_log_fails_the_member() {
    degraded_to_the_limit_then_read_errors(Level::Raid5, 4, &[0], 1, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_third_failure_records_a_bad_block() {
    degraded_to_the_limit_then_read_errors(Level::Raid6, 5, &[0, 1], 2, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_third_failure_with_a_full_log_fails_the_request_and_the_member() {
    degraded_to_the_limit_then_read_errors(Level::Raid6, 5, &[0, 1], 2, true).await;
}

/// Not degraded, but two members fail the same stripe's reads: the request fails (EIO, typed),
/// both members are kept, nothing breaks; as md's handle_failed_stripe, the lost range is
/// recorded in both members' bad-block logs, so it fails at once until a write replaces it;
/// after that write the data reads back and a check finds the stripe consistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_two_read_errors_on_a_whole_array_fail_the_request_only() {
    let mut rng = Rng::new(seed("raid5_two_read_errors_on_a_whole_array_fail_the_request_only", 89));
    let ms = members("r5-double-", 4, 8 * MIB);
    let a = create_array(&ms, opts(Level::Raid5, 4, Some(64), None, false, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let mut rules = Vec::new();
    for m in &ms[1..3] {
        let dof = a.core().slots().find(&m.name).unwrap().data_offset_sectors * 512;
        rules.push((m, m.fault.as_ref().unwrap().add(FaultRule::error(OpMask::READ, Some(dof..dof + 64 * 1024)))));
    }
    let data_len = 3 * 64 * 1024;
    let e = a.read_vec(0, data_len).await.expect_err("two of four members unreadable");
    assert_eq!(MdError::of(&e).map(|m| m.kind), Some(MdErrorKind::Unrecoverable), "{e}");
    assert!(a.core().unrecoverable_reads() >= 1);
    let d = a.detail();
    for (m, _) in &rules {
        assert!(a.core().slots().find(&m.name).unwrap().is_in_sync(), "{}: kept", m.name);
        assert!(detail_of(&d, m)["bad_blocks"].as_u64().unwrap() >= 1, "{}: recorded: {d:#}", m.name);
    }
    assert!(!a.core().is_broken() && a.core().degraded() == 0);
    for (m, id) in rules {
        assert!(m.fault.as_ref().unwrap().remove(id));
    }
    a.read_vec(0, data_len).await.expect_err("listed as lost until rewritten");
    let mut buf = vec![0u8; data_len];
    rng.fill(&mut buf);
    a.write(0, SharedBuf::from_slice(&buf), WriteFlags::NONE).await.unwrap();
    model.apply(0, &buf);
    verify_range(&a, &model, 0, data_len as u64).await;
    for m in &ms[1..3] {
        assert_eq!(detail_of(&a.detail(), m)["bad_blocks"].as_u64().unwrap(), 0, "{}: cleared by the write", m.name);
    }
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}
