//! Power cuts at random points (crash-recording members, one power domain): during the initial
//! resync, during a workload with flushes and FUA writes, during a rebuild and around the
//! dirty/clean transitions. For every sampled point and every way the volatile writes may have
//! landed (all, none, random subsets, torn sectors), the members as they would be found are
//! assembled (always possible), the array resyncs, `check` finds 0 mismatches, and every write
//! that was durable at the point (acknowledged FUA, or acknowledged before a completed flush
//! started) reads back exactly; every other sector holds either its old or its new contents.

use crate::array_util;

use std::sync::Arc;
use std::time::Duration;

use array_util::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, FaultyDevice, Rng,
    SharedBuf, WriteFlags,
};
use mdkit_md::array::{AssembleOptions, assemble};
use mdkit_md::layout::Level;

use crate::array_util::durable::{Flushed, Written, durable};

async fn crash_case(name: &str, level: Level, n: usize, layout: Option<u32>, bitmap: bool, points: usize) {
    let s = seed(name, 31);
    let mut rng = Rng::new(s);
    let group = CrashGroup::with_options(CrashOptions::default());
    let members = crash_members(&group, &format!("{name}-"), n + 1, 8 * MIB);
    // Fault injectors above the crash recorders: a pulled member's writes never reach its log.
    let sims: Vec<SimMember> = members
        .iter()
        .map(|(m, _)| {
            let f = FaultyDevice::new(m.dev.clone());
            SimMember { fault: Some(f.handle()), dev: Arc::new(f), ..m.clone() }
        })
        .collect();
    let names: Vec<String> = sims.iter().map(|m| m.name.clone()).collect();
    let a = create_array(&sims[..n], opts(level, n as u32, Some(64), layout, bitmap, false)).await;
    let created_at = group.now().0;
    // A slow initial resync so the workload (and crash points) overlap it.
    a.set_attribute("sync_speed_min", "8000").unwrap();
    a.set_attribute("sync_speed_max", "8000").unwrap();
    a.set_attribute("safe_mode_delay", "0.02").unwrap();
    let size = a.size_bytes();
    let blocks = size / 4096;
    // Each 4 KiB block is written at most once, so "old contents" is always zeroes.
    let mut free: Vec<u64> = (0..blocks).collect();
    let mut written: Vec<Written> = Vec::new();
    let mut flushes: Vec<Flushed> = Vec::new();
    // With superblock rounds of the array's own beside the writes (sb.rs set_round_fields).
    with_rounds_beside(&a, async {
        for round in 0..40 {
            for _ in 0..6 {
                if free.len() < 8 {
                    break;
                }
                let i = rng.below(free.len() as u64) as usize;
                let b = free.swap_remove(i);
                // Extend to following free blocks for multi-block writes.
                let mut len = 1;
                while len < 6 && free.contains(&(b + len)) && b + len < blocks {
                    free.retain(|x| *x != b + len);
                    len += 1;
                }
                let mut data = vec![0u8; (len * 4096) as usize];
                rng.fill(&mut data);
                let fua = rng.below(4) == 0;
                a.write(b * 4096, SharedBuf::from_slice(&data), if fua { WriteFlags::FUA } else { WriteFlags::NONE })
                    .await
                    .unwrap();
                written.push(Written { off: b * 4096, data, fua, acked_at: group.now().0 });
            }
            if round % 3 == 0 {
                let started_at = group.now().0;
                a.flush().await.unwrap();
                flushes.push(Flushed { started_at, done_at: group.now().0 });
            }
            if round % 10 == 5 {
                // Quiet for a moment: the array is marked clean, then active again.
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
            if round == 22 && level != Level::Raid0 {
                // A member dies under the writes: acknowledged writes that missed it must never be
                // lost to a crash that re-assembles it as in sync.
                sims[n - 1].fault.as_ref().unwrap().pull();
            }
            if round == 28 && level != Level::Raid0 {
                // It is removed and a spare is rebuilt while writes go on.
                a.remove_member(&names[n - 1]).await.unwrap();
                a.add_member(sims[n].member_dev()).await.unwrap();
            }
        }
    })
    .await;
    let end = group.now().0;
    drop(a);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Sample points after the array exists: uniform over the log, just after superblock writes
    // complete (dirty/clean transitions, failure records, checkpoints: the windows where
    // ordering mistakes show), and after flushes.
    let mut sample: Vec<u64> = (0..points).map(|_| created_at + rng.below(end - created_at + 1)).collect();
    let events = group.events();
    let sb_done: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.kind {
            CrashEventKind::WriteCompleted { issued } => {
                let i = events.iter().position(|x| x.index == issued)?;
                matches!(events[i].kind, CrashEventKind::WriteIssued { offset_bytes: 4096, len_bytes: 4096, .. })
                    .then_some(e.index + 1)
            }
            _ => None,
        })
        .filter(|p| *p >= created_at)
        .collect();
    let stride = (sb_done.len() / points.max(1)).max(1);
    sample.extend(sb_done.iter().step_by(stride).copied());
    sample.extend(flushes.iter().map(|f| f.done_at).take(4));
    sample.push(end);
    for (k, p) in sample.into_iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        let imgs = group.image_at(CrashPoint(p), &mut rng, policy).unwrap();
        let ms = image_members(&names, imgs);
        let ctx = format!("{name}: point {p} ({policy:?}), seed {s}");
        let assembled = assemble(member_devs(&ms), AssembleOptions { name: "crash".into(), ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("{ctx}: assembly refused: {e}"));
        let b = assembled.array;
        fast_sync(&b);
        b.wait_sync_idle().await;
        for w in &written {
            let got = b.read_vec(w.off, w.data.len()).await.unwrap();
            if durable(w, &flushes, p) {
                assert!(got == w.data, "{ctx}: durable write at {} lost", w.off);
            } else {
                for (i, (g, d)) in got.chunks(512).zip(w.data.chunks(512)).enumerate() {
                    assert!(
                        g == d || g.iter().all(|x| *x == 0),
                        "{ctx}: sector {} of the write at {} is neither old nor new",
                        i,
                        w.off
                    );
                }
            }
        }
        if level != Level::Raid0 {
            assert_eq!(check(&b).await, 0, "{ctx}: mismatches after the post-crash resync");
        }
        b.stop().await.unwrap();
    }
    let _ = Arc::strong_count(&members[0].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_crash_points() {
    crash_case("crash-r1", Level::Raid1, 2, None, true, 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_crash_points() {
    crash_case("crash-r10", Level::Raid10, 4, Some(0x102), false, 16).await;
    crash_case("crash-r10o", Level::Raid10, 3, Some(0x10201), true, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_crash_points() {
    crash_case("crash-r0", Level::Raid0, 3, None, false, 10).await;
}
