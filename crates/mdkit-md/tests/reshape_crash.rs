//! Power cuts during restripes (crash-recording members, one power domain) with writes and
//! flushes in flight: raid5, raid6 and raid10 (near-2, with a write-intent bitmap the reshape
//! resizes) 4 -> 5 members, raid0 3 -> 4 (through raid4 with the parity role empty), raid5 chunk 32 -> 64 KiB and raid6 Q-last -> rotating Q over the
//! same members (with a bitmap), and backwards to fewer members: raid5 5 -> 4 and raid10 near-2
//! 5 -> 4 with a bitmap (the array cut to the smaller size first). Cut points: member flush completions and superblock writes
//! (checkpoints) from the moment the reshape is recorded until after it finished, plus random
//! points between; every way the volatile writes may have landed (all, none, random subsets,
//! torn sectors). For each: the members as found assemble, the reshape resumes and finishes,
//! every durable write (acknowledged FUA, or acknowledged before a completed flush started) and
//! the data written before the reshape read back, every other written sector holds its old or
//! new contents, and check finds 0 mismatches.
//!
//! Beside the workload, superblock rounds of their own run every millisecond (as clean/dirty
//! transitions make them), so a round in flight during a checkpoint is the common case.
//!
//! Not cut here: the superblock round that starts the reshape. A cut there leaves members that
//! disagree on the member count; assembly takes the ones that missed only that round into the
//! reshape at position 0 (`reshape::members_that_missed_the_reshape_start_join_it`).

use std::sync::Arc;

use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, Rng, SharedBuf,
    WriteFlags,
};
use mdkit_io::{DeviceRef, MemDevice};
use mdkit_md::array::{Array, AssembleOptions, GrowChange, assemble, read_superblock};
use mdkit_md::format::takeover::LayoutChoice;
use mdkit_md::layout::Level;

use crate::array_util::durable::{Flushed, Written, durable};

use crate::array_util::*;

fn reshaping(a: &Array) -> bool {
    a.core().personality().reshape().is_some_and(|r| !r.is_done())
}

/// Writes of 1-3 fresh blocks (each block written once) and flushes while the reshape runs.
async fn workload(a: &Array, group: &CrashGroup, rng: &mut Rng, used: &mut [bool]) -> (Vec<Written>, Vec<Flushed>) {
    let blocks = used.len() as u64;
    let (mut written, mut flushes) = (Vec::new(), Vec::new());
    let mut round = 0;
    while reshaping(a) && round < 400 {
        round += 1;
        let mut batch = Vec::new();
        for _ in 0..4 {
            let want = 1 + rng.below(3);
            let start = rng.below(blocks - want);
            if (start..start + want).any(|b| used[b as usize]) {
                continue;
            }
            (start..start + want).for_each(|b| used[b as usize] = true);
            let mut data = vec![0u8; (want * 4096) as usize];
            rng.fill(&mut data);
            batch.push((start * 4096, data, rng.below(4) == 0));
        }
        let futs = batch.into_iter().map(|(off, data, fua)| async move {
            let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
            a.write(off, SharedBuf::from_slice(&data), flags).await.unwrap();
            Written { off, data, fua, acked_at: group.now().0 }
        });
        written.extend(mdkit_md::array::io::join_all(futs).await);
        if round % 2 == 0 {
            let started_at = group.now().0;
            a.flush().await.unwrap();
            flushes.push(Flushed { started_at, done_at: group.now().0 });
        }
    }
    (written, flushes)
}

/// Flush completions and superblock write completions in `[from, to]` (event index after).
fn interesting_points(group: &CrashGroup, from: u64, to: u64) -> Vec<u64> {
    let events = group.events();
    let issued = |i: u64| events.iter().find(|x| x.index == i).map(|x| x.kind);
    events
        .iter()
        .filter(|e| e.index >= from && e.index < to)
        .filter_map(|e| match e.kind {
            CrashEventKind::FlushCompleted { .. } => Some(e.index + 1),
            CrashEventKind::WriteCompleted { issued: i } => match issued(i) {
                Some(CrashEventKind::WriteIssued { offset_bytes: 4096, len_bytes: 4096, .. }) => Some(e.index + 1),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// One restripe to cut: the array made (level, layout; `members`, 32 KiB chunks) and the grow.
struct Kind {
    level: Level,
    members: u32,
    layout: Option<u32>,
    change: GrowChange,
    /// An internal write-intent bitmap (raid10's is resized to the new array at the start).
    bitmap: bool,
}

const GROW_RAID5: Kind =
    Kind { level: Level::Raid5, members: 4, layout: None, change: GrowChange::RaidDevices(5), bitmap: false };
const GROW_RAID6: Kind =
    Kind { level: Level::Raid6, members: 4, layout: None, change: GrowChange::RaidDevices(5), bitmap: false };
const GROW_RAID10: Kind =
    Kind { level: Level::Raid10, members: 4, layout: None, change: GrowChange::RaidDevices(5), bitmap: true };
const CHUNK_RAID5: Kind = Kind {
    level: Level::Raid5,
    members: 4,
    layout: None,
    change: GrowChange::Restripe { layout: None, chunk_sectors: Some(128) },
    bitmap: false,
};
/// left-symmetric-6 (what raid5 -> raid6 --layout preserve leaves) -> left-symmetric.
const ROTATE_Q_RAID6: Kind = Kind {
    level: Level::Raid6,
    members: 4,
    layout: Some(18),
    change: GrowChange::Restripe { layout: Some(2), chunk_sectors: None },
    bitmap: true,
};

/// raid0 -> raid4 (parity role empty) -> 4 data members -> raid0 (the first new device fills
/// the old parity role, recovered by the reshape).
const GROW_RAID0: Kind =
    Kind { level: Level::Raid0, members: 3, layout: None, change: GrowChange::RaidDevices(4), bitmap: false };

const SHRINK_RAID5: Kind =
    Kind { level: Level::Raid5, members: 5, layout: None, change: GrowChange::RaidDevices(4), bitmap: false };
const SHRINK_RAID10: Kind =
    Kind { level: Level::Raid10, members: 5, layout: None, change: GrowChange::RaidDevices(4), bitmap: true };

impl Kind {
    /// Members after the restripe, and (layout, chunk sectors) given the array's before.
    fn after(&self, layout: u32, chunk: u32) -> (u32, u32, u32) {
        match self.change {
            GrowChange::RaidDevices(n) => (n, layout, chunk),
            GrowChange::Restripe { layout: l, chunk_sectors: c } => {
                (self.members, l.unwrap_or(layout), c.unwrap_or(chunk))
            }
            _ => unreachable!("not a restripe"),
        }
    }
}

/// What a failure message needs to be understood (and replayed): the cut point, every image's
/// superblock as found, what assembly left out, and where the images were saved with the data
/// written before the reshape and the blocks written during it (`MDKIT_CRASH_DUMP`, default a
/// directory under the system temp dir; [`replay_saved_crash`] runs them again).
async fn explain(
    group: &CrashGroup,
    p: CrashPoint,
    found: Vec<MemDevice>,
    refused: &str,
    before: &Model,
    used: &[bool],
) -> String {
    let mut out = group.describe(p);
    let dir = std::env::var("MDKIT_CRASH_DUMP")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir().join("mdkit-crash-dump"));
    let _ = std::fs::create_dir_all(&dir);
    let used: Vec<u8> = used.iter().map(|&u| u8::from(u)).collect();
    let saved =
        std::fs::write(dir.join("before.bin"), &before.data).and_then(|()| std::fs::write(dir.join("used.bin"), used));
    out.push_str(&format!(
        "\n  saved to {} ({})",
        dir.display(),
        saved.map_or_else(|e| e.to_string(), |()| "ok".into())
    ));
    for (i, img) in found.into_iter().enumerate() {
        let img = Arc::new(img);
        let dev: DeviceRef = img.clone();
        let sb = match read_superblock(&dev).await {
            Ok(sb) => format!(
                "role {} events {} reshape_position {} resync_offset {} features {:#x}",
                sb.dev_number, sb.events, sb.reshape_position_sectors, sb.resync_offset_sectors, sb.feature_map
            ),
            Err(e) => format!("no superblock: {e}"),
        };
        let saved = std::fs::write(dir.join(format!("member-{i:02}.img")), img.to_image())
            .map_or_else(|e| format!(", not saved: {e}"), |()| String::new());
        out.push_str(&format!("\n  {}: {sb}{saved}", img.name()));
    }
    out.push_str(&format!("\n  {refused}"));
    out
}

/// Assembles the images a failure saved (`MDKIT_CRASH_REPLAY=DIR`, see [`explain`]), lets the
/// reshape finish and lists the blocks not written during it that no longer hold what was
/// written before it. A debugging aid: it needs a saved failure, so it is not in the suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "replays a failure saved by a crash test: MDKIT_CRASH_REPLAY=DIR"]
async fn replay_saved_crash() {
    let dir = std::path::PathBuf::from(std::env::var("MDKIT_CRASH_REPLAY").expect("MDKIT_CRASH_REPLAY=DIR"));
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("member-"))
        .collect();
    files.sort();
    let names: Vec<String> = files.iter().map(|f| f.file_stem().unwrap().to_string_lossy().into_owned()).collect();
    let images =
        files.iter().zip(&names).map(|(f, n)| MemDevice::from_image(n.clone(), &std::fs::read(f).unwrap())).collect();
    let ms = image_members(&names, images);
    let before = std::fs::read(dir.join("before.bin")).unwrap();
    let used = std::fs::read(dir.join("used.bin")).unwrap();
    let got =
        assemble(member_devs(&ms), AssembleOptions { name: "replay".into(), ..Default::default() }).await.unwrap();
    eprintln!("left out {:?}, notes {:?}", got.refused, got.notes);
    let b = got.array;
    if let Some(r) = b.core().personality().reshape() {
        eprintln!("reshape at {} of {}", r.position_sectors(), r.new_array_sectors());
    }
    b.set_array_size(Some(before.len() as u64)).unwrap();
    fast_sync(&b);
    b.wait_reshape().await.unwrap();
    fast_sync(&b);
    b.wait_sync_idle().await;
    let data = b.read_vec(0, before.len()).await.unwrap();
    let bad: Vec<usize> = (0..used.len())
        .filter(|&i| used[i] == 0 && data[i * 4096..(i + 1) * 4096] != before[i * 4096..(i + 1) * 4096])
        .collect();
    eprintln!("{} blocks changed: {:?}", bad.len(), &bad[..bad.len().min(64)]);
    assert!(bad.is_empty());
}

/// The first thing wrong with `got` (the array read back after the cut at `p`), if any.
fn first_problem(
    got: &[u8],
    before: &Model,
    used: &[bool],
    written: &[Written],
    flushes: &[Flushed],
    p: u64,
) -> Option<String> {
    for (blk, (g, d)) in got.chunks(4096).zip(before.data.chunks(4096)).enumerate() {
        if !used[blk] && g != d {
            return Some(format!("block {blk} written before the reshape changed"));
        }
    }
    for w in written {
        let g = &got[w.off as usize..w.off as usize + w.data.len()];
        if durable(w, flushes, p) {
            if g != w.data {
                return Some(format!("durable write at {} lost", w.off));
            }
            continue;
        }
        let old = before.slice(w.off, w.data.len() as u64);
        for (i, ((g, d), o)) in g.chunks(512).zip(w.data.chunks(512)).zip(old.chunks(512)).enumerate() {
            if g != d && g != o {
                return Some(format!("sector {i} of the write at {} is neither old nor new", w.off));
            }
        }
    }
    None
}

async fn reshape_crash_case(name: &str, kind: Kind, max_points: usize, random_points: usize) {
    let s = seed(name, 53);
    let mut rng = Rng::new(s);
    let group = CrashGroup::with_options(CrashOptions::default());
    let (after, _, _) = kind.after(0, 0);
    let total = after.max(kind.members) as usize;
    let members = crash_members(&group, &format!("{name}-"), total, 4 * MIB);
    let sims: Vec<SimMember> = members.iter().map(|(m, _)| m.clone()).collect();
    let names: Vec<String> = sims.iter().map(|m| m.name.clone()).collect();
    let first = kind.members as usize;
    let o = opts(kind.level, kind.members, Some(32), kind.layout, kind.bitmap, true);
    let a = create_array(&sims[..first], o).await;
    let mut want = kind.after(a.info().layout, a.info().chunk_sectors);
    if kind.level == Level::Raid0 {
        want.1 = 0; // md's takeover back to raid0 leaves layout 0 (one zone: no layout needed)
    }
    a.set_attribute("safe_mode_delay", "0.02").unwrap();
    let mut before = Model::new(a.size_bytes());
    fill(&a, &mut before, &mut rng).await;
    if after < kind.members {
        let size = cut_for_fewer_members(&a, after).await;
        before.data.truncate(size as usize);
    }
    a.flush().await.unwrap();
    a.set_attribute("sync_speed_max", "3000").unwrap();
    a.grow(kind.change, member_devs(&sims[first..])).await.unwrap();
    let started_at = group.now().0;
    let mut used = vec![false; (before.data.len() / 4096) as usize];
    // Superblock rounds of their own beside the checkpoints: a round in flight once undid a
    // checkpoint's position in memory, and a cut in the next window lost data.
    let (written, flushes) = with_rounds_beside(&a, workload(&a, &group, &mut rng, &mut used)).await;
    a.wait_reshape().await.unwrap();
    let end = group.now().0;
    eprintln!("{name}: {} writes, {} flushes during the reshape", written.len(), flushes.len());
    drop(a);
    let mut points = interesting_points(&group, started_at, end);
    let stride = (points.len() / max_points.max(1)).max(1);
    points = points.into_iter().step_by(stride).collect();
    // MDKIT_CRASH_RANDOM_POINTS=N takes N random points instead (hunting a rare failure).
    let random_points =
        std::env::var("MDKIT_CRASH_RANDOM_POINTS").ok().and_then(|n| n.parse().ok()).unwrap_or(random_points);
    points.extend((0..random_points).map(|_| started_at + rng.below(end - started_at + 1)));
    points.push(end);
    eprintln!("{name}: {} cut points", points.len());
    let mut mid_way = 0;
    for (k, p) in points.into_iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        // The same draws make the same images again for a failure report (no copy per point).
        let drawn = rng.clone();
        let ms = image_members(&names, group.image_at(CrashPoint(p), &mut rng, policy).unwrap());
        let ctx = format!("{name}: point {p} ({policy:?}), seed {s}");
        let assembled = assemble(member_devs(&ms), AssembleOptions { name: "crash".into(), ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("{ctx}: assembly refused: {e}"));
        let refused = format!("assembly left out {:?}, notes {:?}", assembled.refused, assembled.notes);
        let b = assembled.array;
        if let Some(r) = b.core().personality().reshape() {
            mid_way += usize::from(r.completed().0 > 0 && !r.is_done());
        }
        b.set_array_size(Some(before.data.len() as u64)).unwrap();
        fast_sync(&b);
        b.wait_reshape().await.unwrap_or_else(|e| panic!("{ctx}: reshape did not finish: {e}"));
        if kind.level == Level::Raid0 && b.info().level == Level::Raid4 {
            // The grow that would have gone back to raid0 died with the cut (as mdadm's).
            let back = GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default };
            b.grow(back, Vec::new()).await.unwrap_or_else(|e| panic!("{ctx}: back to raid0: {e}"));
        }
        assert_eq!((b.info().raid_disks, b.info().layout, b.info().chunk_sectors), want, "{ctx}");
        fast_sync(&b);
        b.wait_sync_idle().await;
        let got = b.read_vec(0, before.data.len()).await.unwrap();
        let mut problem = first_problem(&got, &before, &used, &written, &flushes, p);
        if problem.is_none() && b.info().level != Level::Raid0 {
            let mismatches = check(&b).await;
            problem = (mismatches > 0).then(|| format!("{mismatches} mismatches after the reshape"));
        }
        if let Some(problem) = problem {
            let found = group.image_at(CrashPoint(p), &mut drawn.clone(), policy).unwrap();
            panic!("{ctx}: {problem}\n{}", explain(&group, CrashPoint(p), found, &refused, &before, &used).await);
        }
        b.stop().await.unwrap();
    }
    eprintln!("{name}: {mid_way} images resumed a reshape from a checkpoint");
    assert!(mid_way > 0, "{name}: no cut point landed between two checkpoints");
    let _ = Arc::strong_count(&members[0].1);
}

// Cut points per kind in the default suite: 300 of the flush and superblock-write completions
// (evenly spread) and 100 random ones; the soak variants take every one and 200 random.
const POINTS: usize = 300;
const RANDOM_POINTS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_reshape_crash_points() {
    reshape_crash_case("reshape-crash", GROW_RAID5, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_reshape_crash_points() {
    reshape_crash_case("reshape6-crash", GROW_RAID6, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_reshape_crash_points() {
    reshape_crash_case("reshape10-crash", GROW_RAID10, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid0_reshape_crash_points() {
    reshape_crash_case("reshape0-crash", GROW_RAID0, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_shrink_crash_points() {
    reshape_crash_case("shrink5-crash", SHRINK_RAID5, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid10_shrink_crash_points() {
    reshape_crash_case("shrink10-crash", SHRINK_RAID10, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid5_chunk_restripe_crash_points() {
    reshape_crash_case("chunk5-crash", CHUNK_RAID5, POINTS, RANDOM_POINTS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid6_rotate_q_restripe_crash_points() {
    reshape_crash_case("rotq6-crash", ROTATE_Q_RAID6, POINTS, RANDOM_POINTS).await;
}

/// Every flush and superblock write, and many random points (scripts/soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: scripts/soak runs it"]
async fn raid5_reshape_crash_points_full() {
    reshape_crash_case("reshape-crash-full", GROW_RAID5, usize::MAX, 200).await;
}

/// The same for raid6 (scripts/soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: scripts/soak runs it"]
async fn raid6_reshape_crash_points_full() {
    reshape_crash_case("reshape6-crash-full", GROW_RAID6, usize::MAX, 200).await;
}

/// The same for the restripes over the same members (scripts/soak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: scripts/soak runs it"]
async fn restripe_crash_points_full() {
    reshape_crash_case("reshape10-crash-full", GROW_RAID10, usize::MAX, 200).await;
    reshape_crash_case("chunk5-crash-full", CHUNK_RAID5, usize::MAX, 200).await;
    reshape_crash_case("rotq6-crash-full", ROTATE_Q_RAID6, usize::MAX, 200).await;
}
