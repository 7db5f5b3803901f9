//! Issue 4 acceptance on real arrays: raid1, raid10 (near and offset), raid5 and raid6 with
//! internal bitmaps (1 MiB bitmap chunks, so 9 to 18 bits) on crash-recording members, under concurrent random writes
//! (some FUA), array flushes, lazy and threshold bit clearing and clean/active transitions,
//! ending with a clean stop. The power is cut at **every** flush point of the log and at random
//! points in between; each image is built with all, none, a random subset or random sector
//! tears of the volatile writes. For every image:
//! - the members assemble, the bitmap-guided resync runs, and `check` finds 0 mismatches;
//! - every write acknowledged before the last completed flush started, and every acknowledged
//!   FUA write, reads back exactly; every other sector holds its old or its new contents;
//! - the resync touched only chunks whose bit is set in the image (every member data I/O of the
//!   resync, traced, maps into a dirty chunk), and an image of a clean stop resyncs nothing.
//!
//! The first test keeps the array active for the whole workload (a long `safe_mode_delay`);
//! the clean stop at the end is included. The second has clean <-> active transitions during
//! the workload (`safe_mode_delay` 10 ms): a cut between one member's "clean" superblock and
//! another member's data flush must still assemble as unclean (every member is flushed before
//! any clean superblock is written, as in `Array::stop`).
//!
//! Both run a shorter workload with fewer random cuts by default (still over a thousand crash
//! images for the first: at least 201 per case); the `_full` variants (`#[ignore]`d, run by `scripts/soak`) run the
//! full size.
//!
//! `MDKIT_SOAK=1` runs more seeds with longer workloads; `MDKIT_TEST_SEED` replays one seed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashGroup, CrashPoint, CrashPolicy, DeviceRef, IoOp, MemDevice, Rng, SharedBuf,
    Tracer, WriteFlags,
};
use mdkit_md::array::{Array, AssembleOptions, CreateOptions, MemberDev, assemble, create};
use mdkit_md::format::bitmap::{BitmapSuper, test_bit};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::format::superblock::{DeviceRole, Superblock};
use mdkit_md::layout::{ArrayGeometry, Level};
use parking_lot::Mutex;

use crate::array_util::durable::{Flushed, Written, durable};

const MIB: u64 = 1 << 20;
const MEMBER_BYTES: u64 = 10 * MIB;
/// The bitmap chunk equals the sync engine's step (1 MiB): the engine syncs whole steps, so with
/// smaller bitmap chunks it would (correctly, but wastefully) touch clean chunks next to dirty
/// ones.
const BITMAP_CHUNK_BYTES: u32 = 1 << 20;

#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    level: Level,
    members: usize,
    layout: Option<u32>,
}

const CASES: [Case; 5] = [
    Case { name: "r1", level: Level::Raid1, members: 2, layout: None },
    Case { name: "r10n2", level: Level::Raid10, members: 4, layout: Some(0x102) },
    Case { name: "r10o2", level: Level::Raid10, members: 3, layout: Some(0x10201) },
    Case { name: "r5", level: Level::Raid5, members: 3, layout: None },
    Case { name: "r6", level: Level::Raid6, members: 4, layout: None },
];

#[derive(Default)]
struct History {
    written: Vec<Written>,
    flushes: Vec<Flushed>,
}

fn soak() -> bool {
    std::env::var("MDKIT_SOAK").is_ok_and(|v| v == "1")
}

/// Random writers over blocks written at most once (so "old contents" is zeroes), with FUA
/// writes, flushes and pauses (the bitmap clears, the array goes clean and active again).
async fn workload(a: Arc<Array>, group: CrashGroup, seed: u64, ops: usize) -> History {
    let blocks = a.size_bytes() / 4096;
    let free = Arc::new(Mutex::new((0..blocks).collect::<Vec<u64>>()));
    let history = Arc::new(Mutex::new(History::default()));
    let tasks: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, group, free, history) = (a.clone(), group.clone(), free.clone(), history.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ (t + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
                for _ in 0..ops {
                    let picked = {
                        let mut f = free.lock();
                        if f.len() < 4 {
                            None
                        } else {
                            let i = rng.below(f.len() as u64) as usize;
                            let b = f.swap_remove(i);
                            let mut len = 1;
                            while len < 4 && rng.chance(1, 2) && f.contains(&(b + len)) {
                                f.retain(|x| *x != b + len);
                                len += 1;
                            }
                            Some((b, len))
                        }
                    };
                    let Some((b, len)) = picked else { break };
                    let mut data = vec![0u8; (len * 4096) as usize];
                    rng.fill(&mut data);
                    let fua = rng.chance(1, 5);
                    let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
                    a.write(b * 4096, SharedBuf::from_slice(&data), flags).await.expect("array write");
                    history.lock().written.push(Written { off: b * 4096, data, fua, acked_at: group.now().0 });
                    match rng.below(12) {
                        0 | 1 => {
                            let started_at = group.now().0;
                            a.flush().await.expect("array flush");
                            history.lock().flushes.push(Flushed { started_at, done_at: group.now().0 });
                        }
                        2 => tokio::time::sleep(Duration::from_millis(5 + rng.below(40))).await,
                        _ => {}
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("writer");
    }
    Arc::try_unwrap(history).ok().expect("writers are done").into_inner()
}

/// The union of the bits in the members' bitmaps of an image (sync-domain chunks).
fn dirty_in_image(images: &[MemDevice]) -> (BTreeSet<u64>, u64) {
    let mut dirty = BTreeSet::new();
    let mut chunk_sectors = 0;
    for img in images {
        let mut head = vec![0u8; 4096];
        img.read_bytes(4096, &mut head);
        let Ok(sb) = Superblock::decode(&head, 8) else { continue };
        let Some(at) = sb.bitmap_sector() else { continue };
        let mut page0 = vec![0u8; 4096];
        img.read_bytes(at * 512, &mut page0);
        let Ok(bms) = BitmapSuper::decode(&page0) else { continue };
        let geo = bms.geometry().expect("valid geometry");
        chunk_sectors = geo.chunk_sectors();
        let mut area = vec![0u8; geo.area_bytes() as usize];
        img.read_bytes(at * 512, &mut area);
        dirty.extend((0..geo.chunks()).filter(|&c| test_bit(&area, &geo, c) == Some(true)));
    }
    (dirty, chunk_sectors)
}

/// Maps a member data sector to its sync-domain sector (raid1/4/5/6: itself; raid10: the array
/// sector).
struct DomainMap {
    geometry: ArrayGeometry,
    /// Per image: (slot, data_offset in sectors).
    members: Vec<Option<(usize, u64)>>,
}

impl DomainMap {
    fn new(images: &[MemDevice]) -> DomainMap {
        let mut geometry = None;
        let mut members = Vec::new();
        for img in images {
            let mut head = vec![0u8; 4096];
            img.read_bytes(4096, &mut head);
            let sb = Superblock::decode(&head, 8).expect("member superblock");
            if geometry.is_none() {
                let sizes = vec![sb.data_size_sectors; sb.raid_disks as usize];
                geometry = Some(ArrayGeometry::from_superblock(&sb, &sizes).expect("geometry"));
            }
            members.push(match sb.role() {
                DeviceRole::Active(slot) => Some((usize::from(slot), sb.data_offset_sectors)),
                _ => None,
            });
        }
        DomainMap { geometry: geometry.expect("at least one member"), members }
    }

    fn domain_sector(&self, image: usize, offset_bytes: u64) -> Option<u64> {
        let (slot, data_offset) = self.members[image]?;
        let member_sector = (offset_bytes / 512).checked_sub(data_offset)?;
        match &self.geometry {
            ArrayGeometry::Raid1(_) | ArrayGeometry::Parity(..) => Some(member_sector),
            ArrayGeometry::Raid10(g) => g.unmap(slot, member_sector),
            _ => None,
        }
    }
}

/// Prints the log events that touched the member blocks of the mismatched ranges, and every
/// superblock and bitmap write, up to `point` (failure diagnostics).
fn dump_timeline(group: &CrashGroup, map: &DomainMap, ranges: &[std::ops::Range<u64>], point: u64) {
    use mdkit_io::CrashEventKind;
    let names = group.members();
    let mut targets: Vec<(usize, u64, u64)> = Vec::new(); // (image, byte start, byte end)
    for r in ranges {
        for (image, m) in map.members.iter().enumerate() {
            let Some((_, data_offset)) = m else { continue };
            for member_sector in 0..(MEMBER_BYTES / 512) {
                if let Some(d) = map.domain_sector(image, (data_offset + member_sector) * 512)
                    && r.contains(&d)
                {
                    let at = (data_offset + member_sector) * 512;
                    targets.push((image, at, at + 512));
                }
            }
        }
    }
    let events = group.events();
    let issued: std::collections::HashMap<u64, &mdkit_io::CrashEvent> = events.iter().map(|e| (e.index, e)).collect();
    for e in events.iter().filter(|e| e.index < point) {
        let (off, len) = match e.kind {
            CrashEventKind::WriteIssued { offset_bytes, len_bytes, .. } => (offset_bytes, len_bytes),
            CrashEventKind::WriteCompleted { issued: i } => match issued.get(&i).map(|x| x.kind) {
                Some(CrashEventKind::WriteIssued { offset_bytes, len_bytes, .. }) => (offset_bytes, len_bytes),
                _ => continue,
            },
            _ => {
                eprintln!("  {:>6} {} {:?}", e.index, names[e.member], e.kind);
                continue;
            }
        };
        let meta = off < MIB;
        let hit = targets.iter().any(|&(m, s, t)| m == e.member && off < t && s < off + len);
        if meta || hit {
            eprintln!(
                "  {:>6} {} {:?}{}",
                e.index,
                names[e.member],
                e.kind,
                if hit { "   <== mismatched data" } else { "" }
            );
        }
    }
}

/// Requests `action` and waits until that run finished; it must have reached the end.
async fn run_sync(a: &Array, action: &str, ctx: &str) -> u64 {
    a.wait_sync_idle().await;
    let runs = a.sync_status().runs;
    a.request_sync(action).unwrap_or_else(|e| panic!("{ctx}: request {action}: {e}"));
    loop {
        a.wait_sync_idle().await;
        let st = a.sync_status();
        if st.runs > runs {
            assert_eq!(st.last_run.map(|(m, done)| (m.as_str(), done)), Some((action, true)), "{ctx}: {st:?}");
            return st.mismatch_sectors;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn check(a: &Array, ctx: &str) -> u64 {
    run_sync(a, "check", ctx).await
}

/// Assembles one crash image and checks everything the module documentation lists.
async fn check_image(
    case: Case,
    ctx: &str,
    images: Vec<MemDevice>,
    history: &History,
    point: u64,
    group: &CrashGroup,
) -> bool {
    let (dirty, chunk_sectors) = dirty_in_image(&images);
    let map = DomainMap::new(&images);
    let tracer = Tracer::new(1 << 16);
    let devs: Vec<MemberDev> = images
        .into_iter()
        .enumerate()
        .map(|(i, img)| MemberDev::new(format!("{}-{i}", case.name), Arc::new(tracer.wrap(img)) as DeviceRef))
        .collect();
    let opts = AssembleOptions { name: "crash".into(), start_frozen: true, ..AssembleOptions::default() };
    let b = assemble(devs, opts).await.unwrap_or_else(|e| panic!("{ctx}: assembly refused: {e}")).array;
    b.set_attribute("sync_speed_min", "10000000").unwrap();
    b.set_attribute("sync_speed_max", "10000000").unwrap();
    let resynced = b.get_attribute("resync_start").unwrap() != "none";
    tracer.reset();
    if resynced {
        run_sync(&b, "resync", ctx).await;
        assert_eq!(b.get_attribute("resync_start").unwrap(), "none", "{ctx}: resync did not finish");
    }
    let snap = tracer.snapshot();
    assert_eq!(snap.events_overwritten, 0);
    for e in snap.events.iter().filter(|e| matches!(e.op, IoOp::Read | IoOp::Write)) {
        let image: usize = e.device.rsplit('-').next().and_then(|s| s.parse().ok()).expect("member name");
        let Some(first) = map.domain_sector(image, e.offset_bytes) else { continue }; // metadata
        let last = map.domain_sector(image, e.offset_bytes + e.len_bytes - 512).unwrap_or(first);
        for sector in [first, last] {
            assert!(
                dirty.contains(&(sector / chunk_sectors)),
                "{ctx}: the resync touched chunk {} ({} of {} bytes at {} on {}) whose bit is clear; dirty: {dirty:?}",
                sector / chunk_sectors,
                e.op.as_str(),
                e.len_bytes,
                e.offset_bytes,
                e.device
            );
        }
    }
    for w in &history.written {
        let got = b.read_vec(w.off, w.data.len()).await.unwrap();
        if durable(w, &history.flushes, point) {
            assert!(got == w.data, "{ctx}: durable write at {} ({} bytes, fua {}) lost", w.off, w.data.len(), w.fua);
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
    let mismatches = check(&b, ctx).await;
    if mismatches != 0 {
        dump_timeline(group, &map, &b.sync_status().mismatch_ranges, point);
    }
    assert_eq!(
        mismatches,
        0,
        "{ctx}: mismatches after the bitmap-guided resync at {:?} (sync-domain sectors; {chunk_sectors} per chunk); dirty chunks in the image {dirty:?}; resynced {resynced}",
        b.sync_status().mismatch_ranges
    );
    b.stop().await.unwrap();
    resynced
}

async fn run_case(case: Case, seed: u64, ops: usize, random_points: usize, clean_transitions: bool) -> usize {
    eprintln!("{}: seed {seed} (replay with MDKIT_TEST_SEED={seed})", case.name);
    let group = CrashGroup::new();
    let devs: Vec<MemberDev> = (0..case.members)
        .map(|i| {
            let name = format!("{}-{i}", case.name);
            MemberDev::new(
                name.clone(),
                Arc::new(group.wrap(name.clone(), MemDevice::new(name, MEMBER_BYTES))) as DeviceRef,
            )
        })
        .collect();
    let mut o = CreateOptions::new("md-bm", case.level, case.members as u32);
    o.chunk_kib = case.level.uses_chunks().then_some(64);
    o.layout = case.layout;
    o.bitmap = BitmapRequest::Internal { chunk_bytes: Some(BITMAP_CHUNK_BYTES) };
    o.assume_clean = true;
    let a = Arc::new(create(devs, o).await.unwrap_or_else(|e| panic!("create: {e}")).array);
    let created = group.now().0;
    a.set_attribute("bitmap/time_base", "0.02").unwrap();
    a.set_attribute("bitmap/flush_chunks", "6").unwrap();
    a.set_attribute("safe_mode_delay", if clean_transitions { "0.01" } else { "3600" }).unwrap();
    let history = crate::array_util::with_rounds_beside(&a, workload(a.clone(), group.clone(), seed, ops)).await;
    let attr = |n: &str| a.get_attribute(n).unwrap().parse::<u64>().unwrap();
    let (set_rounds, cleared, data_writes) =
        (attr("bitmap/set_rounds"), attr("bitmap/bits_cleared"), attr("bitmap/data_writes"));
    eprintln!(
        "  {} writes, {} flushes; bitmap: {data_writes} data writes, {set_rounds} set rounds, {cleared} bits cleared",
        history.written.len(),
        history.flushes.len()
    );
    assert!(cleared > 0 && set_rounds > 0, "bits were set and cleared during the workload");
    let stopping = group.now().0;
    Arc::try_unwrap(a).ok().expect("workload done").stop().await.unwrap();
    let end = group.now().0;

    let mut rng = Rng::new(seed);
    let mut points: Vec<u64> = group.flush_points().into_iter().map(|p| p.0).filter(|&p| p > created).collect();
    let flush_points = points.len();
    points.extend((0..random_points).map(|_| created + rng.below(end - created + 1)));
    points.push(end);
    let mut resyncs = 0;
    for (k, &p) in points.iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        let ctx = format!("{}: {} ({policy:?}), seed {seed}", case.name, group.describe(CrashPoint(p)));
        let images = group.image_at(CrashPoint(p), &mut rng, policy).unwrap();
        let resynced = check_image(case, &ctx, images, &history, p, &group).await;
        resyncs += usize::from(resynced);
        if p == end {
            assert!(!resynced, "{ctx}: a clean stop needs no resync");
        }
    }
    eprintln!(
        "  {} crash images ({flush_points} flush points, {random_points} random, clean stop at {end}, stop began at {stopping}); {resyncs} resynced",
        points.len()
    );
    assert!(resyncs > points.len() / 4, "most cuts land in active periods: {resyncs} of {}", points.len());
    points.len()
}

/// How much a run covers: seeds per case, writes per writer task, random cut points per seed
/// (every flush point is always cut).
#[derive(Clone, Copy)]
struct Effort {
    seeds: u64,
    ops: usize,
    random_points: usize,
}

const FULL: Effort = Effort { seeds: 1, ops: 60, random_points: 250 };
/// About a third of [`FULL`]'s crash images.
const SHORT: Effort = Effort { seeds: 1, ops: 40, random_points: 80 };
/// The always-active test's default: [`SHORT`]'s workload with enough random cuts that the five
/// cases give over a thousand images from the random cuts alone.
const DEFAULT: Effort = Effort { seeds: 1, ops: 40, random_points: 200 };
const SOAK: Effort = Effort { seeds: 8, ops: 150, random_points: 600 };

fn run_all(clean_transitions: bool, effort: Effort) -> usize {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let replay = std::env::var("MDKIT_TEST_SEED").ok().and_then(|s| s.parse::<u64>().ok());
    let Effort { seeds, ops, random_points: random } = if soak() { SOAK } else { effort };
    let mut total = 0;
    for case in CASES {
        for i in 0..seeds {
            let seed = replay.unwrap_or(0xacce_0000 + i);
            total += rt.block_on(run_case(case, seed, ops, random, clean_transitions));
            if replay.is_some() {
                break;
            }
        }
    }
    eprintln!("bitmap_array_crash: {total} crash images assembled, resynced and checked");
    total
}

#[test]
fn raid1_raid10_raid5_raid6_survive_power_cuts_with_bitmap_guided_resync() {
    let total = run_all(false, DEFAULT);
    assert!(total >= 1000, "over a thousand crash points in the default suite: {total}");
}

#[test]
#[ignore = "soak: the first test at the full size (the suite's slowest non-lab test at that size)"]
fn raid1_raid10_raid5_raid6_survive_power_cuts_with_bitmap_guided_resync_full() {
    let total = run_all(false, FULL);
    assert!(total >= 1000, "thousands of crash points: {total}");
}

#[test]
fn power_cuts_across_clean_active_transitions() {
    let total = run_all(true, SHORT);
    assert!(total >= 500, "hundreds of crash points in the default suite: {total}");
}

#[test]
#[ignore = "soak: the transitions test at the full size (about 40 s in the suite profile)"]
fn power_cuts_across_clean_active_transitions_full() {
    let total = run_all(true, FULL);
    assert!(total >= 1000, "thousands of crash points: {total}");
}
