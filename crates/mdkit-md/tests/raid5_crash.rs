//! raid5/raid6 power cuts (crash-recording members, one power domain), with and without the
//! internal write-intent bitmap: during raid6's initial resync, during a workload of partial
//! and full-stripe writes with flushes and FUA writes (with `stripe_size` switched from 4 KiB
//! to 64 KiB half-way, so widened units are cut too), around dirty/clean transitions. For every
//! sampled point and way the volatile writes may have landed (all, none, random subsets, torn
//! sectors): the members as found assemble, the array resyncs (bitmap-guided when it has one),
//! `check` finds 0 mismatches, every durable write (acknowledged FUA, or acknowledged before a
//! completed flush started) reads back exactly, and every other sector holds its old or its new
//! contents.

use crate::array_util;

use std::sync::Arc;
use std::time::Duration;

use array_util::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, Rng, SharedBuf,
    WriteFlags,
};
use mdkit_md::array::{AssembleOptions, assemble};
use mdkit_md::layout::Level;

use crate::array_util::durable::{Flushed, Written, durable};

/// A v1.2 superblock write: one 4 KiB block at 4 KiB into the member.
fn is_superblock_write(kind: CrashEventKind) -> bool {
    matches!(kind, CrashEventKind::WriteIssued { offset_bytes: 4096, len_bytes: 4096, .. })
}

async fn crash_case(name: &str, level: Level, n: usize, bitmap: bool, points: usize) {
    let s = seed(name, 37);
    let mut rng = Rng::new(s);
    let group = CrashGroup::with_options(CrashOptions::default());
    let members = crash_members(&group, &format!("{name}-"), n, 12 * MIB);
    let sims: Vec<SimMember> = members.iter().map(|(m, _)| m.clone()).collect();
    let names: Vec<String> = sims.iter().map(|m| m.name.clone()).collect();
    // raid6 resyncs from the start (so crashes land in the resync too); a raid5 built by
    // recovering its last member would be dirty *and* degraded after a crash, which md (and
    // mdkit) refuse to start without --force, so it is created clean here.
    let assume_clean = level != Level::Raid6;
    let a = create_array(&sims, opts(level, n as u32, Some(32), None, bitmap, assume_clean)).await;
    let created_at = group.now().0;
    a.set_attribute("sync_speed_min", "6000").unwrap();
    a.set_attribute("sync_speed_max", "6000").unwrap();
    a.set_attribute("safe_mode_delay", "0.02").unwrap();
    if bitmap {
        // Bits clear after 20 ms of idleness, so the bitmap really decides what a post-crash
        // resync visits (the initial all-dirty bitmap is cleared before the workload).
        a.set_attribute("bitmap/time_base", "0.02").unwrap();
        if assume_clean {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
    }
    let size = a.size_bytes();
    let blocks = size / 4096;
    let stripe_blocks = u64::from(a.topology().optimal_io_bytes) / 4096;
    // Each 4 KiB block is written at most once, so "old contents" is always zeroes.
    let mut used = vec![false; blocks as usize];
    let mut written: Vec<Written> = Vec::new();
    let mut flushes: Vec<Flushed> = Vec::new();
    for round in 0..36 {
        if round == 18 {
            a.set_attribute("stripe_size", "65536").unwrap();
        }
        let mut batch = Vec::new();
        for _ in 0..6 {
            // Mostly small writes; sometimes a whole stripe.
            let want = if rng.below(5) == 0 { stripe_blocks } else { 1 + rng.below(6) };
            let start = if want == stripe_blocks { rng.below(blocks / want) * want } else { rng.below(blocks - want) };
            if (start..start + want).any(|b| used[b as usize]) {
                continue;
            }
            for b in start..start + want {
                used[b as usize] = true;
            }
            let mut data = vec![0u8; (want * 4096) as usize];
            rng.fill(&mut data);
            batch.push((start * 4096, data, rng.below(4) == 0));
        }
        // Issued concurrently, acknowledged each with the log position at completion.
        let futs = batch.into_iter().map(|(off, data, fua)| {
            let a = &a;
            let group = &group;
            async move {
                let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
                a.write(off, SharedBuf::from_slice(&data), flags).await.unwrap();
                Written { off, data, fua, acked_at: group.now().0 }
            }
        });
        written.extend(mdkit_md::array::io::join_all(futs).await);
        if round % 3 == 0 {
            let started_at = group.now().0;
            a.flush().await.unwrap();
            flushes.push(Flushed { started_at, done_at: group.now().0 });
        }
        if round % 6 == 3 {
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    let end = group.now().0;
    drop(a);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut sample: Vec<u64> = (0..points).map(|_| created_at + rng.below(end - created_at + 1)).collect();
    let events = group.events();
    let sb_done: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.kind {
            CrashEventKind::WriteCompleted { issued } => {
                let i = events.iter().position(|x| x.index == issued)?;
                is_superblock_write(events[i].kind).then_some(e.index + 1)
            }
            _ => None,
        })
        .filter(|p| *p >= created_at)
        .collect();
    let stride = (sb_done.len() / points.max(1)).max(1);
    sample.extend(sb_done.iter().step_by(stride).copied());
    sample.extend(flushes.iter().map(|f| f.done_at).take(4));
    sample.push(end);
    let mut needed_seen: Vec<(u64, u64)> = Vec::new();
    for (k, p) in sample.into_iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        let imgs = group.image_at(CrashPoint(p), &mut rng, policy).unwrap();
        let ms = image_members(&names, imgs);
        let ctx = format!("{name}: point {p} ({policy:?}), seed {s}");
        let b = assemble(member_devs(&ms), AssembleOptions { name: "crash".into(), ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("{ctx}: assembly refused: {e}"))
            .array;
        if bitmap && assume_clean {
            let bm = &b.detail()["bitmap"];
            needed_seen.push((bm["needed_chunks"].as_u64().unwrap(), bm["chunks"].as_u64().unwrap()));
        }
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
                        "{ctx}: sector {i} of the write at {} is neither old nor new",
                        w.off
                    );
                }
            }
        }
        assert_eq!(check(&b).await, 0, "{ctx}: mismatches after the post-crash resync");
        b.stop().await.unwrap();
    }
    if bitmap && assume_clean {
        // The bitmap guided the resyncs: some crash images needed only part of the array.
        eprintln!("{name}: bitmap chunks needed per crash image: {needed_seen:?}");
        assert!(needed_seen.iter().any(|(need, all)| need < all), "{name}: {needed_seen:?}");
    }
    let _ = Arc::strong_count(&members[0].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_crash_points_with_bitmap() {
    crash_case("crash-r5b", Level::Raid5, 4, true, 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_crash_points_without_bitmap() {
    crash_case("crash-r5", Level::Raid5, 3, false, 16).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_crash_points_with_and_without_bitmap() {
    crash_case("crash-r6b", Level::Raid6, 5, true, 16).await;
    crash_case("crash-r6", Level::Raid6, 4, false, 12).await;
}

/// The ordering behind the crash cases above, checked on every superblock round directly: when
/// a member's superblock write is issued, every data write that completed on *any* member
/// before the round is already covered by a completed flush of that member. (A member's own
/// preflush is not enough: a superblock that says "clean" vouches for the parity on all members,
/// and a power cut just after the first member's clean superblock landed would leave the
/// others' unflushed writes torn under an array that assembles clean.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superblock_rounds_wait_for_every_members_flush() {
    let group = CrashGroup::with_options(CrashOptions::default());
    let members = crash_members(&group, "sbflush-", 3, 8 * MIB);
    let sims: Vec<SimMember> = members.iter().map(|(m, _)| m.clone()).collect();
    let a = create_array(&sims, opts(Level::Raid5, 3, Some(32), None, false, true)).await;
    a.set_attribute("safe_mode_delay", "0.02").unwrap();
    let created_at = group.now().0;
    let mut rng = Rng::new(5);
    // Bursts of writes, each followed by enough idleness for the array to be marked clean, so
    // there are several active -> clean -> active rounds with fresh data before each.
    for burst in 0..4u64 {
        let futs = (0..8u64).map(|i| {
            let a = &a;
            let mut data = vec![0u8; 4096];
            rng.fill(&mut data);
            async move {
                a.write((burst * 64 + i * 7) * 4096, SharedBuf::from_slice(&data), WriteFlags::NONE).await.unwrap()
            }
        });
        mdkit_md::array::io::join_all(futs.collect::<Vec<_>>()).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    let events = group.events();
    let kind_at = |i: u64| events.iter().find(|e| e.index == i).map(|e| e.kind);
    // Per member: completion indices of data writes no completed flush covers yet.
    let mut unflushed: Vec<Vec<u64>> = vec![Vec::new(); 3];
    let mut superblock_writes = 0;
    for e in events.iter().filter(|e| e.index >= created_at) {
        match e.kind {
            CrashEventKind::WriteCompleted { issued } if !kind_at(issued).is_some_and(is_superblock_write) => {
                unflushed[e.member].push(e.index)
            }
            CrashEventKind::FlushCompleted { issued } => unflushed[e.member].retain(|&c| c > issued),
            CrashEventKind::WriteIssued { .. } if is_superblock_write(e.kind) => {
                superblock_writes += 1;
                for (m, pending) in unflushed.iter().enumerate() {
                    assert!(
                        pending.is_empty(),
                        "superblock write on member {} (event {}) issued while member {m} has data writes \
                         completed at events {pending:?} that no completed flush covers",
                        e.member,
                        e.index
                    );
                }
            }
            _ => {}
        }
    }
    assert!(superblock_writes >= 3 * 4, "expected active/clean rounds on every member: {superblock_writes}");
    a.stop().await.unwrap();
}
