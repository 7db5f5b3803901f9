//! Member faults under load, on fault-injecting RAM members:
//! - a member is pulled in the middle of a verifying workload (raid1 and raid10): no error
//!   reaches the client, no acknowledged write is lost, the survivors' superblocks record the
//!   failure (role 0xfffe, higher events), a spare is rebuilt, check finds 0 mismatches and a
//!   re-assembly from the survivors has everything;
//! - a rebuild interrupted by dropping the array (no clean stop) resumes from the
//!   `recovery_offset` checkpoint after re-assembly, and finishes with correct data;
//! - a read error on one mirror is repaired by rewriting it from the other copy (transient
//!   error) or fails the member (persistent error), invisibly to the client;
//! - a member that dies during a write fails and the write still succeeds on the others;
//! - the last member the array needs is never failed: a write error there is recorded as a
//!   bad block and the client gets the error (that range then reads as an error).

use crate::array_util;

use std::sync::Arc;
use std::time::Duration;

use array_util::*;
use mdkit_io::{BlockDevice, FaultRule, OpMask, Rng};
use mdkit_md::array::{Array, AssembleOptions, assemble};
use mdkit_md::format::superblock::ROLE_FAULTY;
use mdkit_md::layout::Level;

async fn pull_during_workload(level: Level, n: usize, layout: Option<u32>, pull: usize) {
    let name = format!("{}-pull{pull}", level.name());
    let s = seed(&name, 21);
    let ms = faulty_members(&format!("{name}-"), n + 1, 16 * MIB);
    let (active, spare) = ms.split_at(n);
    let a = create_array(active, opts(level, n as u32, Some(64), layout, true, true)).await;
    fast_sync(&a);
    let a: &'static Array = Box::leak(Box::new(a));
    let mut model = Model::new(a.size_bytes());
    verifying_workload(a, s, 4, 60, 32, &mut model).await;
    // Pull the member while the next round of the workload runs.
    let h = active[pull].fault.clone().unwrap();
    let puller = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        h.pull();
    });
    verifying_workload(a, s + 1, 4, 120, 32, &mut model).await;
    puller.await.unwrap();
    verifying_workload(a, s + 2, 4, 30, 32, &mut model).await; // certainly after the pull
    verify_all(a, &model).await;
    assert_eq!(a.get_attribute(&format!("dev-{name}-{pull}/state")).unwrap(), "faulty");
    assert_eq!(a.core().degraded(), 1);
    // The survivors' superblocks record the failure.
    let survivor = active.iter().enumerate().find(|(i, _)| *i != pull).unwrap().1;
    let sb = sb_of(survivor);
    assert_eq!(sb.dev_roles[pull], ROLE_FAULTY, "{name}: survivor's dev_roles {:?}", &sb.dev_roles[..n]);
    assert!(sb.events > sb_of(&active[pull]).events);
    // Rebuild onto a spare while the workload continues.
    a.remove_member(&format!("{name}-{pull}")).await.unwrap();
    a.add_member(spare[0].member_dev()).await.unwrap();
    verifying_workload(a, s + 3, 4, 60, 32, &mut model).await;
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0, "{name}: rebuilt");
    assert!(a.get_attribute(&format!("dev-{name}-{n}/state")).unwrap().contains("in_sync"));
    assert_eq!(check(a).await, 0, "{name}: mismatches after the rebuild");
    verify_all(a, &model).await;
    a.stop().await.unwrap();
    // Re-assemble from the survivors plus the rebuilt spare: everything is there.
    let now: Vec<SimMember> = active
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != pull)
        .map(|(_, m)| m.clone())
        .chain(spare.iter().cloned())
        .collect();
    let b = assemble_array(&now).await;
    assert_eq!(b.core().degraded(), 0);
    verify_all(&b, &model).await;
    b.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_member_pulled_under_load() {
    pull_during_workload(Level::Raid1, 2, None, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_member_pulled_under_load() {
    pull_during_workload(Level::Raid10, 4, Some(0x102), 2).await;
    pull_during_workload(Level::Raid10, 3, Some(0x201), 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_rebuild_resumes_from_checkpoint() {
    for (level, n, layout) in [(Level::Raid1, 2, None), (Level::Raid10, 4, Some(0x201u32))] {
        let mut rng = Rng::new(seed("interrupted_rebuild_resumes_from_checkpoint", 5));
        let ms = faulty_members(&format!("ir-{}-", level.name()), n + 1, 32 * MIB);
        let a = create_array(&ms[..n], opts(level, n as u32, Some(64), layout, false, true)).await;
        let mut model = Model::new(a.size_bytes());
        fill(&a, &mut model, &mut rng).await;
        a.fail_member(&ms[n - 1].name).await.unwrap();
        a.remove_member(&ms[n - 1].name).await.unwrap();
        // A slow rebuild onto the spare, cut off (array dropped, no stop) past a checkpoint.
        a.set_attribute("sync_speed_min", "20000").unwrap();
        a.set_attribute("sync_speed_max", "20000").unwrap();
        a.add_member(ms[n].member_dev()).await.unwrap();
        let started = std::time::Instant::now();
        let total = loop {
            let st = a.sync_status();
            if st.running.is_some() && st.done_sectors * 3 > st.total_sectors {
                // Stall it there (the batch in flight ends), so a slow test thread on a busy
                // machine cannot let it finish before the cut.
                a.set_attribute("sync_speed_max", "1").unwrap();
                break st.total_sectors;
            }
            assert!(st.runs == 0, "{level:?}: the rebuild ended before the cut: {st:?}");
            assert!(started.elapsed() < Duration::from_secs(60), "{level:?}: the rebuild stalled: {st:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let spare_name = ms[n].name.clone();
        // The cut must find the array clean (dirty and degraded would need a forced assembly).
        let on_array: Vec<SimMember> = ms[..n - 1].iter().cloned().chain([ms[n].clone()]).collect();
        wait_clean_on_disk(&on_array).await;
        drop(a);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let survivors: Vec<SimMember> = ms[..n - 1].iter().cloned().chain([ms[n].clone()]).collect();
        let sb = sb_of(&ms[n]);
        assert!(sb.feature_map & 2 != 0, "the spare's superblock carries RECOVERY_OFFSET");
        let checkpoint = sb.recovery_offset_sectors;
        assert!(checkpoint >= total / 16, "checkpoint {checkpoint} of {total} sectors");
        let b = assemble(
            member_devs(&survivors),
            AssembleOptions { name: "md-test".into(), start_frozen: true, ..Default::default() },
        )
        .await
        .unwrap();
        assert!(
            b.notes
                .iter()
                .any(|note| note.contains(&format!("resumes rebuilding role {} from sector {checkpoint}", n - 1))),
            "{:?}",
            b.notes
        );
        let b = b.array;
        assert_eq!(b.get_attribute(&format!("dev-{spare_name}/recovery_start")).unwrap(), checkpoint.to_string());
        fast_sync(&b);
        b.request_sync("recover").unwrap();
        // The rebuild starts where the checkpoint says.
        let first = loop {
            let st = b.sync_status();
            if st.running.is_some() || st.runs > 0 {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        assert!(first.done_sectors >= checkpoint, "resumed at {} < checkpoint {checkpoint}", first.done_sectors);
        b.wait_sync_idle().await;
        assert_eq!(b.core().degraded(), 0);
        verify_all(&b, &model).await;
        assert_eq!(check(&b).await, 0);
        b.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_errors_are_repaired_or_fail_the_member() {
    let mut rng = Rng::new(seed("read_errors_are_repaired_or_fail_the_member", 8));
    let ms = faulty_members("rerr-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let dof = a.core().slots().in_sync(0).unwrap().data_offset_sectors * 512;
    // Which member serves a read at `at` (reads of one place go to the same copy when idle).
    let server = |at: u64| {
        let a = &a;
        let ms = &ms;
        async move {
            let before: Vec<u64> = ms.iter().map(|m| m.fault.as_ref().unwrap().stats().requests).collect();
            a_read(a, at, 4096).await;
            ms.iter().zip(before).position(|(m, b)| m.fault.as_ref().unwrap().stats().requests > b).unwrap()
        }
    };
    // A transient read error: the read is served from the other copy and the bad copy is
    // rewritten and read back (corrected).
    for at in [MIB, 2 * MIB] {
        let i = server(at).await;
        ms[i].fault.as_ref().unwrap().add(FaultRule::error(OpMask::READ, Some(dof + at..dof + at + 4096)).times(1));
        for _ in 0..4 {
            verify_range(&a, &model, at, 64 * 1024).await;
        }
    }
    let corrected: u32 = a.core().slots().all_members().iter().map(|m| m.corrected_reads()).sum();
    let errors: u64 = a.core().slots().all_members().iter().map(|m| m.read_errors()).sum();
    // md counts corrected sectors: each failed 64 KiB read was rewritten whole (128 sectors).
    assert_eq!((errors, corrected), (2, 2 * 128), "read errors seen and sectors corrected");
    assert_eq!(a.core().degraded(), 0, "transient read errors do not fail members");
    // A persistent read error: the rewrite does not help, the member is failed.
    let i = server(3 * MIB).await;
    ms[i].fault.as_ref().unwrap().add(FaultRule::error(OpMask::READ, Some(dof + 3 * MIB..dof + 3 * MIB + 4096)));
    for _ in 0..4 {
        verify_range(&a, &model, 3 * MIB, 8192).await;
    }
    assert_eq!(a.get_attribute(&format!("dev-{}/state", ms[i].name)).unwrap(), "faulty");
    assert_eq!(a.core().degraded(), 1, "one member failed for its unrepairable sector");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_member_is_never_failed() {
    let mut rng = Rng::new(1);
    let ms = faulty_members("last-", 2, 16 * MIB);
    let a = create_array(&ms, opts(Level::Raid1, 2, None, None, false, true)).await;
    let mut model = Model::new(a.size_bytes());
    random_write(&a, &mut model, &mut rng, 8).await;
    ms[0].fault.as_ref().unwrap().pull();
    random_write(&a, &mut model, &mut rng, 8).await; // succeeds degraded
    assert_eq!(a.core().degraded(), 1);
    assert!(a.fail_member("last-1").await.is_err(), "the last member cannot be failed");
    // A write error on its data: recorded as a bad block (its log has room), the member stays,
    // the write fails (no copy took it) and that range now reads as an error, never stale data.
    let dof = a.core().slots().all_members().iter().find(|m| m.name() == "last-1").unwrap().data_offset_sectors * 512;
    ms[1].fault.as_ref().unwrap().add(FaultRule::error(OpMask::WRITE, Some(dof..dof + 16 * MIB)));
    let (off, len) = random_extent(&mut rng, a.size_bytes(), 4);
    let r = a.write(off, mdkit_io::SharedBuf::zeroed(len as usize), mdkit_io::WriteFlags::NONE).await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("last-1"), "the error names the member: {e}");
    let kind = mdkit_md::array::MdError::of(&e).map(|m| m.kind);
    assert_eq!(kind, Some(mdkit_md::array::MdErrorKind::BadBlockRecorded), "{e}");
    assert_eq!(a.get_attribute("dev-last-1/state").unwrap(), "in_sync,write_error");
    assert_ne!(a.get_attribute("array_state").unwrap(), "broken");
    assert!(mdkit_io::BlockDeviceExt::read_vec(&a, off, len as usize).await.is_err(), "the lost range is EIO");
    // The data written before is still readable.
    if off > 0 {
        verify_range(&a, &model, 0, off).await;
    }
    if off + len < a.size_bytes() {
        verify_range(&a, &model, off + len, a.size_bytes() - off - len).await;
    }
    a.stop().await.unwrap();
}

async fn a_read(a: &Array, off: u64, len: u64) -> Vec<u8> {
    mdkit_io::BlockDeviceExt::read_vec(a, off, len as usize).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_member_error_reaches_the_client_and_marks_broken() {
    let ms = faulty_members("r0err-", 2, 8 * MIB);
    let a = create_array(&ms, opts(Level::Raid0, 2, Some(64), None, false, false)).await;
    let mut rng = Rng::new(2);
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    ms[1].fault.as_ref().unwrap().pull();
    let mut saw_error = false;
    for _ in 0..8 {
        let (off, len) = random_extent(&mut rng, a.size_bytes(), 64);
        if a.write(off, mdkit_io::SharedBuf::zeroed(len as usize), mdkit_io::WriteFlags::NONE).await.is_err() {
            saw_error = true;
        }
    }
    assert!(saw_error);
    assert_eq!(a.get_attribute("array_state").unwrap(), "broken");
    let _ = Arc::strong_count(&a.core());
}
