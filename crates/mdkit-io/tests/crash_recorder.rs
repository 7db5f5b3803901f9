//! Property tests of the crash recorder against an independent oracle.
//!
//! Random concurrent workloads (writes, FUA writes, write-zeroes, flushes) run on a group of 2–3
//! devices. The test keeps its own timeline: the group point just before each request's first
//! poll (its issue event) and just after it returns (its completion). From that timeline alone
//! it decides, at every crash point, which writes the block-device contract makes durable, and
//! checks each image:
//!
//! * every sector holds its durable value (last durable write to it, in issue order) or the value
//!   of some write to it issued before the point — and is never a mix of two writes;
//! * every durable write not overwritten by a later-issued write reads back;
//! * `LoseAll` images hold exactly the durable values, `KeepAll` images exactly the last issued
//!   value;
//! * `forget_before` does not change any image at or after its point.
//!
//! Seeds are printed on failure (`seed N`); rerun one with `CRASH_SEED=N`.

use std::sync::{Arc, Mutex};

use mdkit_io::{
    BlockDevice, CrashDevice, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, MemDevice, Rng, SharedBuf, WriteFlags,
    ZeroFlags,
};

const DEV_BYTES: u64 = 256 * 1024;
const SECTORS: u64 = DEV_BYTES / 512;

#[derive(Clone, Debug)]
enum Kind {
    /// `id` 0 means write-zeroes.
    Write {
        lba: u64,
        sectors: u64,
        id: u64,
        fua: bool,
    },
    Flush,
}

#[derive(Clone, Debug)]
struct OpRec {
    member: usize,
    kind: Kind,
    /// Event index of the issue (= group point just before the first poll).
    issued: u64,
    /// Group point just after completion (= completion event index + 1).
    completed: u64,
}

fn sector_content(id: u64, lba: u64) -> [u8; 512] {
    let mut s = [0u8; 512];
    if id == 0 {
        return s;
    }
    s[..8].copy_from_slice(&id.to_le_bytes());
    s[8..16].copy_from_slice(&lba.to_le_bytes());
    for (i, b) in s[16..].iter_mut().enumerate() {
        *b = (id as u8).wrapping_mul(31).wrapping_add(lba as u8).wrapping_add(i as u8);
    }
    s
}

/// The write id a sector holds (0 = zeroes); panics on a sector that is no write's content.
fn sector_id(img: &[u8], lba: u64, ctx: &str) -> u64 {
    let s = &img[(lba * 512) as usize..((lba + 1) * 512) as usize];
    let id = u64::from_le_bytes(s[..8].try_into().unwrap());
    assert_eq!(
        s,
        &sector_content(id, lba)[..],
        "{ctx}: sector {lba} is not whole content of write {id} (mixed/torn within a sector)"
    );
    id
}

async fn run_workload(
    seed: u64,
    members: usize,
    tasks: usize,
    ops_per_task: usize,
    group: &CrashGroup,
) -> (Vec<Arc<CrashDevice>>, Vec<OpRec>) {
    let devs: Vec<Arc<CrashDevice>> = (0..members)
        .map(|i| Arc::new(group.wrap(format!("m{i}"), MemDevice::new(format!("m{i}"), DEV_BYTES))))
        .collect();
    let log = Arc::new(Mutex::new(Vec::new()));
    let next_id = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let mut handles = Vec::new();
    for t in 0..tasks {
        let (devs, log, group, next_id) = (devs.clone(), log.clone(), group.clone(), next_id.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed * 7919 + t as u64);
            for _ in 0..ops_per_task {
                let member = rng.below(devs.len() as u64) as usize;
                let dev = &devs[member];
                let roll = rng.below(100);
                let kind = if roll < 15 {
                    Kind::Flush
                } else {
                    let sectors = 1 + rng.below(16);
                    let lba = rng.below(SECTORS - sectors);
                    let id = if roll < 20 { 0 } else { next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed) };
                    Kind::Write { lba, sectors, id, fua: rng.chance(1, 4) }
                };
                let issued = group.now().0;
                match &kind {
                    Kind::Flush => dev.flush().await.unwrap(),
                    Kind::Write { lba, sectors, id: 0, fua } => dev
                        .write_zeroes(lba * 512, sectors * 512, ZeroFlags { fua: *fua, no_unmap: false })
                        .await
                        .unwrap(),
                    Kind::Write { lba, sectors, id, fua } => {
                        let mut data = Vec::with_capacity((*sectors * 512) as usize);
                        for s in 0..*sectors {
                            data.extend_from_slice(&sector_content(*id, lba + s));
                        }
                        let flags = if *fua { WriteFlags::FUA } else { WriteFlags::NONE };
                        dev.write(lba * 512, SharedBuf::from_slice(&data), flags).await.unwrap()
                    }
                }
                let completed = group.now().0;
                log.lock().unwrap().push(OpRec { member, kind, issued, completed });
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    let mut ops = log.lock().unwrap().clone();
    ops.sort_by_key(|o| o.issued);
    (devs, ops)
}

/// The oracle: what the contract says about each member at a point, from the test's timeline.
struct Oracle<'a> {
    ops: &'a [OpRec],
}

impl Oracle<'_> {
    fn durable(&self, w: &OpRec, p: u64) -> bool {
        let Kind::Write { fua, .. } = w.kind else { return false };
        if w.completed > p {
            return false; // not completed before the point
        }
        let complete_index = w.completed - 1;
        fua || self.ops.iter().any(|f| {
            matches!(f.kind, Kind::Flush) && f.member == w.member && f.completed <= p && complete_index < f.issued
        })
    }

    fn id(o: &OpRec) -> u64 {
        match o.kind {
            Kind::Write { id, .. } => id,
            Kind::Flush => unreachable!("only writes cover sectors"),
        }
    }

    /// Per sector of member `m`: the (id, durable) of writes covering it issued before `p`, in
    /// issue order.
    fn sector_history(&self, m: usize, p: u64) -> Vec<Vec<(u64, bool)>> {
        let mut hist = vec![Vec::new(); SECTORS as usize];
        for o in self.ops.iter().filter(|o| o.member == m && o.issued < p) {
            if let Kind::Write { lba, sectors, .. } = o.kind {
                let durable = self.durable(o, p);
                for s in lba..lba + sectors {
                    hist[s as usize].push((Self::id(o), durable));
                }
            }
        }
        hist
    }

    fn check_image(&self, hist: &[Vec<(u64, bool)>], m: usize, img: &[u8], policy: CrashPolicy, ctx: &str) {
        for lba in 0..SECTORS {
            let got = sector_id(img, lba, ctx);
            let covering = &hist[lba as usize];
            let last_durable = covering.iter().rposition(|&(_, d)| d);
            let durable_value = last_durable.map_or(0, |i| covering[i].0);
            let allowed = got == durable_value || covering.iter().any(|&(id, _)| id == got);
            assert!(allowed, "{ctx}: m{m} sector {lba} holds write {got}, durable value {durable_value}");
            if last_durable.is_some_and(|i| i == covering.len() - 1) {
                assert_eq!(got, durable_value, "{ctx}: m{m} sector {lba}: durable write does not read back");
            }
            match policy {
                CrashPolicy::LoseAll => assert_eq!(got, durable_value, "{ctx}: m{m} sector {lba} (LoseAll)"),
                CrashPolicy::KeepAll => {
                    let last = covering.last().map_or(0, |&(id, _)| id);
                    assert_eq!(got, last, "{ctx}: m{m} sector {lba} (KeepAll)");
                }
                _ => {}
            }
        }
    }
}

fn seeds(default: std::ops::Range<u64>) -> Vec<u64> {
    match std::env::var("CRASH_SEED") {
        Ok(s) => vec![s.parse().expect("CRASH_SEED must be a number")],
        Err(_) => default.collect(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

#[test]
fn every_point_of_random_workloads_respects_the_contract() {
    for seed in seeds(0..10) {
        let members = 2 + (seed % 2) as usize;
        let group = CrashGroup::new();
        let (devs, ops) = runtime().block_on(run_workload(seed, members, 4, 30, &group));
        let oracle = Oracle { ops: &ops };
        let points = group.points();
        assert_eq!(points.len() as u64, group.now().0 + 1);
        let flushes = ops.iter().filter(|o| matches!(o.kind, Kind::Flush)).count();
        assert_eq!(group.flush_points().len(), flushes, "seed {seed}: one flush point per flush");
        // Sanity: the workload really had in-flight overlap (issue..completion spans others).
        assert!(ops.iter().any(|o| o.completed - o.issued > 2), "seed {seed}: requests overlapped");
        let mut rng = Rng::new(seed);
        for &p in &points {
            let hist: Vec<_> = (0..members).map(|m| oracle.sector_history(m, p.0)).collect();
            for policy in CrashPolicy::ALL {
                let imgs = group.image_at(p, &mut rng, policy).unwrap();
                assert_eq!(imgs.len(), members);
                for (m, img) in imgs.iter().enumerate() {
                    let ctx = format!("seed {seed} {} {policy:?}", group.describe(p));
                    oracle.check_image(&hist[m], m, &img.to_image(), policy, &ctx);
                }
            }
        }
        // KeepAll at `now` is the live contents.
        let now = group.image_at(group.now(), &mut rng, CrashPolicy::KeepAll).unwrap();
        for (img, dev) in now.iter().zip(&devs) {
            assert!(img.same_contents(dev.live()), "seed {seed}");
        }
    }
}

#[test]
fn random_policies_really_lose_and_tear() {
    // Guards the oracle test against a recorder that never drops anything.
    let group = CrashGroup::new();
    let (_devs, _ops) = runtime().block_on(run_workload(99, 2, 4, 30, &group));
    let end = group.now();
    let keep = group.image_at(end, &mut Rng::new(1), CrashPolicy::KeepAll).unwrap();
    let lose = group.image_at(end, &mut Rng::new(1), CrashPolicy::LoseAll).unwrap();
    let tear = group.image_at(end, &mut Rng::new(1), CrashPolicy::RandomTear).unwrap();
    let differs = |a: &[MemDevice], b: &[MemDevice]| a.iter().zip(b).any(|(x, y)| !x.same_contents(y));
    assert!(differs(&keep, &lose), "some write is volatile at the end");
    assert!(differs(&tear, &keep) && differs(&tear, &lose), "tearing mixes kept and lost sectors");
}

#[test]
fn forget_before_keeps_every_later_image_identical() {
    for seed in seeds(100..104) {
        let group = CrashGroup::new();
        let _ = runtime().block_on(run_workload(seed, 3, 4, 30, &group));
        let fps = group.flush_points();
        assert!(fps.len() > 4, "seed {seed}: enough flushes");
        let cut = fps[fps.len() / 2];
        let later: Vec<CrashPoint> = group.points().into_iter().filter(|p| *p >= cut).collect();
        let images = |g: &CrashGroup| -> Vec<Vec<MemDevice>> {
            let mut out = Vec::new();
            for &p in &later {
                for policy in CrashPolicy::ALL {
                    out.push(g.image_at(p, &mut Rng::new(seed ^ p.0), policy).unwrap());
                }
            }
            out
        };
        let before = images(&group);
        let writes_before = group.retained_writes();
        group.forget_before(cut).unwrap();
        assert!(group.retained_writes() < writes_before, "seed {seed}: folding released writes");
        assert_eq!(group.points().first(), Some(&cut));
        let after = images(&group);
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            for (x, y) in a.iter().zip(b) {
                assert!(x.same_contents(y), "seed {seed}: image {i} changed by forget_before({cut})");
            }
        }
    }
}

#[test]
fn retain_flush_points_bounds_the_log() {
    let group = CrashGroup::with_options(CrashOptions { retain_flush_points: Some(3), ..CrashOptions::default() });
    let (_devs, ops) = runtime().block_on(run_workload(7, 2, 4, 200, &group));
    let flushes = ops.iter().filter(|o| matches!(o.kind, Kind::Flush)).count();
    assert!(flushes > 20);
    assert_eq!(group.flush_points().len(), 3);
    assert!(group.events().len() < ops.len(), "old events were forgotten");
    let points = group.points();
    let imgs = group.image_at(points[0], &mut Rng::new(0), CrashPolicy::RandomTear).unwrap();
    assert_eq!(imgs.len(), 2);
    assert!(group.image_at(CrashPoint(0), &mut Rng::new(0), CrashPolicy::KeepAll).is_err());
}
