//! Power cuts during `grow` (crash-recording members, one power domain): `--size max`,
//! `--bitmap none` then `--bitmap internal`, raid1 `--raid-devices 3 --add`, and the level
//! changes that move no data: raid1 -> raid5 -> raid1, and raid5 -> raid6 (`--layout
//! preserve --add`, Q recovered onto the new member) -> raid5, and raid0 -> raid5 parity-last
//! (`--add`, parity recovered onto the new member), and raid0 -> raid10 near-2 (two members
//! added and recovered) -> raid0. Data is written
//! and flushed before the grow and after it; the cut falls after any completed member write
//! from the start of the grow to the end of the recovery it starts, plus random points.
//!
//! For every point and every way the volatile writes may have landed, the members as they would
//! be found must assemble; the array has the old or the new size; members left out as stale are
//! recovered as an operator would (`--re-add`, else `--add`); then every write that was durable
//! at the point reads back, every other sector holds its old or new contents, and `check` finds
//! 0 mismatches. A durable write beyond the assembled size is a lost grow.

use crate::array_util;

use array_util::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, Rng, SharedBuf,
    WriteFlags,
};
use mdkit_md::array::{
    Array, AssembleOptions, BitmapChange, GrowChange, GrowSize, LayoutChoice, assemble, read_superblock,
};
use mdkit_md::layout::Level;

/// One acknowledged write: where, what, and the log position when it was acknowledged.
struct Written {
    off: u64,
    data: Vec<u8>,
    acked_at: u64,
}

/// Writes and flushes that make up the history the cut points are judged against.
struct History {
    written: Vec<Written>,
    /// (issued at, returned at) of each completed flush.
    flushes: Vec<(u64, u64)>,
}

impl History {
    fn durable(&self, w: &Written, point: u64) -> bool {
        w.acked_at <= point && self.flushes.iter().any(|&(started, done)| done <= point && w.acked_at <= started)
    }
}

#[derive(Clone, Copy, Debug)]
enum Change {
    SizeMax,
    BitmapOffOn,
    Mirrors3,
    /// raid1 (2 mirrors) -> raid5 -> raid1.
    MirrorRaid5Mirror,
    /// raid5 -> raid6 with Q on the added member (recovered), then back to raid5.
    Raid5Raid6Raid5,
    /// raid0 -> raid5 parity-last with parity on the added member (recovered), then back to
    /// raid0 (the parity member failed and removed first).
    Raid0Raid5Raid0,
    /// raid0 -> raid10 near-2 (two added members recovered), then back to raid0 (the second
    /// copies failed and removed first).
    Raid0Raid10Raid0,
}

/// Writes `count` random 4 KiB blocks from `free` (each block at most once, so "old" is zeroes)
/// and flushes.
async fn write_and_flush(
    a: &Array,
    group: &CrashGroup,
    rng: &mut Rng,
    free: &mut Vec<u64>,
    h: &mut History,
    count: usize,
) {
    for _ in 0..count {
        let i = rng.below(free.len() as u64) as usize;
        let b = free.swap_remove(i);
        let mut data = vec![0u8; 4096];
        rng.fill(&mut data);
        a.write(b * 4096, SharedBuf::from_slice(&data), WriteFlags::NONE).await.unwrap();
        h.written.push(Written { off: b * 4096, data, acked_at: group.now().0 });
    }
    let started = group.now().0;
    a.flush().await.unwrap();
    h.flushes.push((started, group.now().0));
}

async fn grow(a: &Array, change: Change, spare: &SimMember, extra: &SimMember) {
    match change {
        Change::SizeMax => {
            a.grow(GrowChange::Size { size: GrowSize::Max, assume_clean: false }, vec![]).await.unwrap();
        }
        Change::BitmapOffOn => {
            a.grow(GrowChange::Bitmap(BitmapChange::None), vec![]).await.unwrap();
            a.grow(GrowChange::Bitmap(BitmapChange::Internal { chunk_bytes: Some(256 << 10) }), vec![]).await.unwrap();
        }
        Change::Mirrors3 => {
            a.grow(GrowChange::RaidDevices(3), vec![spare.member_dev()]).await.unwrap();
        }
        Change::MirrorRaid5Mirror => {
            let to5 = GrowChange::Level { level: Level::Raid5, layout: LayoutChoice::Default };
            a.grow(to5, vec![]).await.unwrap();
            assert_eq!(a.info().level, Level::Raid5);
            a.grow(GrowChange::Level { level: Level::Raid1, layout: LayoutChoice::Default }, vec![]).await.unwrap();
        }
        Change::Raid5Raid6Raid5 => {
            let to6 = GrowChange::Level { level: Level::Raid6, layout: LayoutChoice::Preserve };
            a.grow(to6, vec![spare.member_dev()]).await.unwrap();
            a.wait_sync_idle().await;
            assert_eq!((a.info().level, a.info().layout), (Level::Raid6, 18));
            a.grow(GrowChange::Level { level: Level::Raid5, layout: LayoutChoice::Default }, vec![]).await.unwrap();
        }
        Change::Raid0Raid10Raid0 => {
            let to10 = GrowChange::Level { level: Level::Raid10, layout: LayoutChoice::Default };
            a.grow(to10, vec![spare.member_dev(), extra.member_dev()]).await.unwrap();
            a.wait_sync_idle().await;
            assert_eq!((a.info().level, a.core().degraded()), (Level::Raid10, 0));
            a.grow(GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default }, vec![]).await.unwrap();
        }
        Change::Raid0Raid5Raid0 => {
            let to5 = GrowChange::Level { level: Level::Raid5, layout: LayoutChoice::Default };
            a.grow(to5, vec![spare.member_dev()]).await.unwrap();
            assert_eq!((a.info().level, a.info().layout), (Level::Raid5, 5));
            a.wait_sync_idle().await;
            assert_eq!(a.core().degraded(), 0);
            a.grow(GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default }, vec![]).await.unwrap();
        }
    }
    a.wait_sync_idle().await;
}

/// Points after each completed member write in `[from, to]`, thinned to about `max`, plus
/// after every superblock write (1.2: the 4 KiB at byte 4096; every metadata round, where
/// members disagree until the round ends), plus `random` uniform points.
fn cut_points(group: &CrashGroup, from: u64, to: u64, max: usize, random: usize, rng: &mut Rng) -> Vec<u64> {
    let events = group.events();
    let issued_at: std::collections::HashMap<u64, CrashEventKind> = events.iter().map(|e| (e.index, e.kind)).collect();
    let superblock = |issued: u64| {
        matches!(issued_at.get(&issued), Some(CrashEventKind::WriteIssued { offset_bytes: 4096, len_bytes: 4096, .. }))
    };
    let mut done = Vec::new();
    let mut rounds = Vec::new();
    for e in events.iter().filter(|e| (from..=to).contains(&(e.index + 1))) {
        if let CrashEventKind::WriteCompleted { issued } = e.kind {
            done.push(e.index + 1);
            if superblock(issued) {
                rounds.push(e.index + 1);
            }
        }
    }
    let stride = (done.len() / max.max(1)).max(1);
    let mut points: Vec<u64> = done.into_iter().step_by(stride).collect();
    points.extend(rounds);
    points.extend((0..random).map(|_| from + rng.below(to - from + 1)));
    points.push(to);
    points
}

/// Members left out at assembly come back as an operator brings them: `--re-add`, and when
/// that is refused, `--add` (a full rebuild). Devices without this array's superblock (a spare
/// the cut came before) stay out.
async fn recover_left_out(b: &Array, ms: &[SimMember], refused: &[String], ctx: &str) {
    if b.info().level == Level::Raid0 {
        return; // no redundancy to recover into (raid10 -> raid0 removed the second copies)
    }
    for m in ms.iter().filter(|m| refused.contains(&m.name)) {
        match read_superblock(&m.dev).await {
            Ok(sb) if sb.set_uuid == b.info().uuid => {}
            _ => continue,
        }
        if b.re_add_member(m.member_dev()).await.is_err() {
            b.add_member(m.member_dev()).await.unwrap_or_else(|e| panic!("{ctx}: --add of {} refused: {e}", m.name));
        }
    }
    b.wait_sync_idle().await;
}

/// `mdadm --assemble`, and when it refuses a dirty degraded raid4/5/6 (the kernel's rule: a
/// grow cut between the superblock writes leaves a member one event behind, while the grown
/// part still needs its resync), `--assemble --force`, as mdadm's message tells the operator.
async fn assemble_as_operator(ms: &[SimMember], ctx: &str) -> mdkit_md::array::Assembled {
    let opts = |force| AssembleOptions { name: "grow-crash".into(), force, ..Default::default() };
    match assemble(member_devs(ms), opts(false)).await {
        Ok(a) => a,
        Err(e) if e.to_string().contains("--force") => assemble(member_devs(ms), opts(true))
            .await
            .unwrap_or_else(|e| panic!("{ctx}: assembly refused even with --force: {e}")),
        Err(e) => panic!("{ctx}: assembly refused: {e}"),
    }
}

async fn judge(b: &Array, h: &History, p: u64, ctx: &str) {
    for w in &h.written {
        let durable = h.durable(w, p);
        if w.off + 4096 > b.size_bytes() {
            assert!(!durable, "{ctx}: durable write at {} is beyond the assembled size {}", w.off, b.size_bytes());
            continue;
        }
        let got = b.read_vec(w.off, 4096).await.unwrap();
        if durable {
            assert!(got == w.data, "{ctx}: durable write at {} lost", w.off);
        } else {
            for (i, (g, d)) in got.chunks(512).zip(w.data.chunks(512)).enumerate() {
                assert!(g == d || g.iter().all(|x| *x == 0), "{ctx}: sector {i} at {} is neither old nor new", w.off);
            }
        }
    }
    if b.info().level != Level::Raid0 {
        assert_eq!(check(b).await, 0, "{ctx}: mismatches after recovery");
    }
}

async fn grow_crash_case(name: &str, level: Level, n: usize, change: Change, points: usize) {
    let s = seed(name, 47);
    let mut rng = Rng::new(s);
    let group = CrashGroup::with_options(CrashOptions::default());
    let members: Vec<SimMember> =
        crash_members(&group, &format!("{name}-"), n + 2, 8 * MIB).into_iter().map(|(m, _)| m).collect();
    let names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
    let mut o = opts(level, n as u32, Some(64), None, level != Level::Raid0, false);
    if level != Level::Raid0 {
        o.bitmap = mdkit_md::format::create::BitmapRequest::Internal { chunk_bytes: Some(256 << 10) };
    }
    if matches!(change, Change::SizeMax) {
        o.size_kib = Some(4 * 1024);
    }
    let a = create_array(&members[..n], o).await;
    fast_sync(&a);
    a.wait_sync_idle().await;
    a.set_attribute("safe_mode_delay", "0.02").unwrap();
    let old_size = a.size_bytes();
    let mut free: Vec<u64> = (0..old_size / 4096).collect();
    let mut h = History { written: Vec::new(), flushes: Vec::new() };
    write_and_flush(&a, &group, &mut rng, &mut free, &mut h, 24).await;
    let from = group.now().0;
    with_rounds_beside(&a, grow(&a, change, &members[n], &members[n + 1])).await;
    let new_size = a.size_bytes();
    free.extend(old_size / 4096..new_size / 4096);
    write_and_flush(&a, &group, &mut rng, &mut free, &mut h, 24).await;
    let to = group.now().0;
    drop(a);
    let sample = cut_points(&group, from, to, points, points / 4, &mut rng);
    eprintln!("{name} {change:?}: {} cut points in {from}..{to}", sample.len());
    for (k, p) in sample.into_iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        let ms = image_members(&names, group.image_at(CrashPoint(p), &mut rng, policy).unwrap());
        let ctx = format!("{name} {change:?}: point {p} of {from}..{to} ({policy:?}), seed {s}");
        let assembled = assemble_as_operator(&ms, &ctx).await;
        let b = assembled.array;
        let size = b.size_bytes();
        assert!(size == old_size || size == new_size, "{ctx}: size {size}, neither {old_size} nor {new_size}");
        fast_sync(&b);
        b.wait_sync_idle().await;
        let refused: Vec<String> = assembled.refused.iter().map(|r| r.member.clone()).collect();
        if matches!(
            change,
            Change::MirrorRaid5Mirror | Change::Raid5Raid6Raid5 | Change::Raid0Raid5Raid0 | Change::Raid0Raid10Raid0
        ) {
            // A level change moves no data: a member that missed its superblock round joins
            // the new level instead of being left out for a rebuild.
            for r in &assembled.refused {
                let m = ms.iter().find(|m| m.name == r.member).unwrap();
                let ours = read_superblock(&m.dev).await.is_ok_and(|sb| sb.set_uuid == b.info().uuid);
                // raid10 -> raid0 fails and removes the second copies (the added members) first,
                // raid5 -> raid0 the parity member.
                let back_to_raid0 = matches!(change, Change::Raid0Raid10Raid0 | Change::Raid0Raid5Raid0);
                let removed = back_to_raid0 && names[n..].contains(&r.member);
                let expected = r.reason.contains("stale") || removed;
                assert!(!ours || expected, "{ctx}: {} left out: {}", r.member, r.reason);
            }
        }
        recover_left_out(&b, &ms, &refused, &ctx).await;
        judge(&b, &h, p, &ctx).await;
        b.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_grow_size_crash_points() {
    grow_crash_case("gc-r1-size", Level::Raid1, 2, Change::SizeMax, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_grow_size_crash_points() {
    grow_crash_case("gc-r5-size", Level::Raid5, 3, Change::SizeMax, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_grow_bitmap_crash_points() {
    grow_crash_case("gc-r1-bitmap", Level::Raid1, 2, Change::BitmapOffOn, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_grow_mirrors_crash_points() {
    grow_crash_case("gc-r1-mirrors", Level::Raid1, 2, Change::Mirrors3, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid1_raid5_takeover_crash_points() {
    grow_crash_case("gc-r1-r5", Level::Raid1, 2, Change::MirrorRaid5Mirror, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_raid6_takeover_crash_points() {
    grow_crash_case("gc-r5-r6", Level::Raid5, 3, Change::Raid5Raid6Raid5, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_raid10_takeover_crash_points() {
    grow_crash_case("gc-r0-r10", Level::Raid0, 2, Change::Raid0Raid10Raid0, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_raid5_takeover_crash_points() {
    grow_crash_case("gc-r0-r5", Level::Raid0, 3, Change::Raid0Raid5Raid0, 60).await;
}

/// The eight cases cut after every completed member write, plus 150 random points each
/// (`scripts/soak` runs the ignored md tests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: run by scripts/soak"]
async fn grow_crash_points_full() {
    grow_crash_case("gc-r1-size-full", Level::Raid1, 2, Change::SizeMax, 600).await;
    grow_crash_case("gc-r5-size-full", Level::Raid5, 3, Change::SizeMax, 600).await;
    grow_crash_case("gc-r1-bitmap-full", Level::Raid1, 2, Change::BitmapOffOn, 600).await;
    grow_crash_case("gc-r1-mirrors-full", Level::Raid1, 2, Change::Mirrors3, 600).await;
    grow_crash_case("gc-r1-r5-full", Level::Raid1, 2, Change::MirrorRaid5Mirror, 600).await;
    grow_crash_case("gc-r5-r6-full", Level::Raid5, 3, Change::Raid5Raid6Raid5, 600).await;
    grow_crash_case("gc-r0-r5-full", Level::Raid0, 3, Change::Raid0Raid5Raid0, 600).await;
    grow_crash_case("gc-r0-r10-full", Level::Raid0, 2, Change::Raid0Raid10Raid0, 600).await;
}
