//! Crash consistency of the pool runtime: metadata and data devices in one `CrashGroup` (one
//! power domain), a random workload through thin volumes — writes (some FUA, some concurrent,
//! some spanning blocks), flushes, snapshots of volumes and of snapshots, discards,
//! write-zeroes, deletes. Then, at every flush point and at sampled points between, under torn
//! and lost volatile writes:
//! - the images open as a pool, and mdkit's `check` is clean (thin_check too, on a sample);
//! - every device whose creation completed exists (unless its deletion had started);
//! - every 512-byte sector of every volume holds the last value that was durable at that
//!   point — written before the issue of a flush or admin commit that completed, or a FUA
//!   write that completed — or the value of a later write issued before the power cut;
//! - snapshots hold exactly their origin's contents at snapshot time (until overwritten).

use crate::common;
use crate::pool_util;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashGroup, CrashPoint, CrashPolicy, DeviceRef, MemDevice, Rng, SharedBuf, WriteFlags,
    ZeroFlags,
};
use mdkit_thin::meta::{CheckOptions, MemMetaIo, check};
use mdkit_thin::pool::{Pool, PoolOptions, ThinVolume};
use pool_util::*;

const VOL_BLOCKS: u64 = 16;
const VOL_BYTES: u64 = VOL_BLOCKS * BLOCK_BYTES;
const CHUNK: u64 = 4096;
const CHUNKS: usize = (VOL_BYTES / CHUNK) as usize;
const DATA_BLOCKS: u64 = 256;

/// One write (or zeroing) of a chunk.
#[derive(Clone, Copy, Debug)]
struct Ev {
    tag: u64,
    issue: u64,
    /// `u64::MAX` if it did not complete successfully (never required).
    complete: u64,
    fua: bool,
    /// Inherited from the origin at snapshot time: durable whenever the device exists.
    base: bool,
}

struct Vol {
    /// Point after the create/snapshot returned.
    created: u64,
    /// Point before the delete was issued.
    deleting: Option<u64>,
    chunks: Vec<Vec<Ev>>,
}

#[derive(Default)]
struct History {
    vols: BTreeMap<u64, Vol>,
    /// (issue, complete) of every flush and admin commit.
    barriers: Vec<(u64, u64)>,
    next_tag: u64,
}

impl History {
    fn last_value(&self, id: u64, chunk: usize) -> u64 {
        self.vols[&id].chunks[chunk].last().map_or(0, |e| e.tag)
    }

    /// Allowed tags of a chunk at crash point `p` (0 = zeroes).
    fn allowed(&self, id: u64, chunk: usize, p: u64) -> Vec<u64> {
        let horizon = self.barriers.iter().filter(|b| b.1 <= p).map(|b| b.0).max();
        let evs = &self.vols[&id].chunks[chunk];
        let durable = |e: &Ev| {
            e.base
                || (e.complete != u64::MAX && ((e.fua && e.complete <= p) || horizon.is_some_and(|h| e.complete <= h)))
        };
        let last_durable = evs.iter().rposition(durable);
        let mut tags = vec![last_durable.map_or(0, |i| evs[i].tag)];
        let from = last_durable.map_or(0, |i| i + 1);
        tags.extend(evs[from..].iter().filter(|e| e.issue < p).map(|e| e.tag));
        tags
    }
}

fn now(g: &CrashGroup) -> u64 {
    g.now().0
}

struct Rig {
    group: CrashGroup,
    pool: Pool,
    vols: BTreeMap<u64, ThinVolume>,
    h: History,
    rng: Rng,
}

impl Rig {
    async fn barrier<F: std::future::Future<Output = T>, T>(&mut self, f: F) -> T {
        let issue = now(&self.group);
        let r = f.await;
        self.h.barriers.push((issue, now(&self.group)));
        r
    }

    async fn create(&mut self, id: u64) {
        let pool = self.pool.clone();
        self.barrier(async { pool.create_thin(id).await.unwrap() }).await;
        let created = now(&self.group);
        self.h.vols.insert(id, Vol { created, deleting: None, chunks: vec![Vec::new(); CHUNKS] });
        self.vols.insert(id, self.pool.thin(id, VOL_BYTES).await.unwrap());
    }

    async fn snapshot(&mut self, id: u64, origin: u64) {
        let pool = self.pool.clone();
        self.barrier(async { pool.create_snapshot(id, origin).await.unwrap() }).await;
        let created = now(&self.group);
        let chunks = (0..CHUNKS)
            .map(|c| {
                let tag = self.h.last_value(origin, c);
                vec![Ev { tag, issue: 0, complete: 0, fua: false, base: true }]
            })
            .collect();
        self.h.vols.insert(id, Vol { created, deleting: None, chunks });
        self.vols.insert(id, self.pool.thin(id, VOL_BYTES).await.unwrap());
    }

    async fn delete(&mut self, id: u64) {
        self.vols.remove(&id);
        let deleting = now(&self.group);
        self.h.vols.get_mut(&id).unwrap().deleting = Some(deleting);
        let pool = self.pool.clone();
        self.barrier(async { pool.delete_thin(id).await.unwrap() }).await;
    }

    /// Up to four concurrent writes to distinct chunks of one volume.
    async fn writes(&mut self, id: u64) {
        let v = self.vols[&id].clone();
        let n = 1 + self.rng.below(4) as usize;
        let mut taken = vec![false; CHUNKS];
        let mut plans = Vec::new();
        for _ in 0..n {
            let len = 1 + self.rng.below(20) as usize;
            let first = self.rng.below((CHUNKS - len) as u64 + 1) as usize;
            if taken[first..first + len].iter().any(|&t| t) {
                continue;
            }
            taken[first..first + len].iter_mut().for_each(|t| *t = true);
            self.h.next_tag += 1;
            let zero = self.rng.chance(1, 10);
            let tag = if zero { 0 } else { self.h.next_tag };
            plans.push((first, len, tag, self.rng.chance(1, 4), zero));
        }
        let group = self.group.clone();
        let issue = now(&group);
        let futs = plans.iter().map(|&(first, len, tag, fua, zero)| {
            let v = v.clone();
            let group = group.clone();
            async move {
                let off = first as u64 * CHUNK;
                let r = if zero {
                    v.write_zeroes(off, len as u64 * CHUNK, ZeroFlags { fua, no_unmap: false }).await
                } else {
                    v.write(off, SharedBuf::from_slice(&pattern(tag, off, len * CHUNK as usize)), WriteFlags { fua })
                        .await
                };
                (r, now(&group))
            }
        });
        let results = futures_join(futs.collect()).await;
        for ((first, len, tag, fua, _), (r, done)) in plans.into_iter().zip(results) {
            if let Err(e) = &r {
                panic!("write to volume {id}: {e}");
            }
            let vol = self.h.vols.get_mut(&id).unwrap();
            for c in first..first + len {
                vol.chunks[c].push(Ev { tag, issue, complete: done, fua, base: false });
            }
        }
    }

    async fn discard(&mut self, id: u64) {
        let v = self.vols[&id].clone();
        let b = self.rng.below(VOL_BLOCKS - 2);
        let n = 1 + self.rng.below(2);
        let issue = now(&self.group);
        v.discard(b * BLOCK_BYTES, n * BLOCK_BYTES).await.unwrap();
        let done = now(&self.group);
        let vol = self.h.vols.get_mut(&id).unwrap();
        let per_block = (BLOCK_BYTES / CHUNK) as usize;
        for c in (b as usize * per_block)..((b + n) as usize * per_block) {
            vol.chunks[c].push(Ev { tag: 0, issue, complete: done, fua: false, base: false });
        }
    }

    /// The live pool reads what the history says last.
    async fn verify_live(&self) {
        for (&id, v) in &self.vols {
            let got = v.read_vec(0, VOL_BYTES as usize).await.unwrap();
            for c in 0..CHUNKS {
                let want = self.h.last_value(id, c);
                for s in 0..(CHUNK / 512) {
                    let off = c as u64 * CHUNK + s * 512;
                    let tag = sector_tag(&got[off as usize..off as usize + 512], off);
                    assert_eq!(tag, Some(want), "live volume {id} sector at {off}");
                }
            }
        }
    }
}

/// Joins futures (tests only; keeps the dev-dependency list short).
async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<std::pin::Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}

async fn workload(seed: u64, group: CrashGroup, meta: DeviceRef, data: DeviceRef) -> History {
    let opts = PoolOptions { error_if_no_space: true, ..quiet_opts() };
    let pool = Pool::create("crash", meta, data, BLOCK_BYTES, opts).await.unwrap();
    let mut rig = Rig { group, pool, vols: BTreeMap::new(), h: History::default(), rng: Rng::new(seed) };
    rig.create(0).await;
    rig.create(1).await;
    let mut next_id = 2;
    for step in 0..160 {
        let ids: Vec<u64> = rig.vols.keys().copied().collect();
        let id = ids[rig.rng.below(ids.len() as u64) as usize];
        match rig.rng.below(100) {
            0..=59 => rig.writes(id).await,
            60..=71 => {
                let v = rig.vols[&id].clone();
                rig.barrier(async { v.flush().await.unwrap() }).await;
            }
            72..=79 => rig.discard(id).await,
            80..=86 if rig.vols.len() < 6 => {
                rig.snapshot(next_id, id).await;
                next_id += 1;
            }
            87..=89 if rig.vols.len() > 2 => rig.delete(id).await,
            _ => rig.writes(id).await,
        }
        if step % 40 == 39 {
            rig.verify_live().await;
        }
    }
    rig.verify_live().await;
    drop(rig.vols);
    rig.pool.close().await.unwrap();
    rig.h
}

#[test]
fn every_crash_point_opens_clean_and_keeps_every_durable_write() {
    // MDKIT_CRASH_SEED=<n> replays another workload.
    let seed = std::env::var("MDKIT_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0xc4a5_7001u64);
    eprintln!("seed {seed:#x}");
    let group = CrashGroup::new();
    let meta: DeviceRef = Arc::new(group.wrap("meta", MemDevice::new("meta", 4 << 20)));
    let data: DeviceRef = Arc::new(group.wrap("data", MemDevice::new("data", DATA_BLOCKS * BLOCK_BYTES)));
    let rt = rt();
    let h = rt.block_on(workload(seed, group.clone(), meta, data));

    let mut points: Vec<CrashPoint> = group.flush_points();
    let all = group.points();
    let mut rng = Rng::new(seed ^ 0xfeed);
    for _ in 0..60 {
        points.push(all[rng.below(all.len() as u64) as usize]);
    }
    points.sort();
    points.dedup();
    let first_volume = h.vols.values().map(|v| v.created).min().unwrap();
    let (mut images, mut tool_checked, mut sectors) = (0u64, 0u64, 0u64);
    for (pi, &p) in points.iter().enumerate() {
        if p.0 < first_volume {
            continue; // before the pool and its first volume existed
        }
        let policy = if pi % 2 == 0 {
            CrashPolicy::RandomTear
        } else {
            [CrashPolicy::LoseAll, CrashPolicy::KeepAll, CrashPolicy::RandomSubset][pi % 3]
        };
        let what = format!("{p} {policy:?} ({})", group.describe(p));
        let imgs = group.image_at(p, &mut Rng::new(seed ^ p.0), policy).unwrap();
        let meta_img = imgs[0].to_image();
        let r = check(&MemMetaIo::from_image("crash-meta", &meta_img), &CheckOptions::default());
        assert!(r.is_clean(), "{what}: mdkit check:\n{r}");
        if pi % 12 == 0 {
            let path = scratch_path("pool-crash-image.meta");
            std::fs::write(&path, &meta_img).unwrap();
            assert_thin_check_clean(&path, &what);
            tool_checked += 1;
        }
        let data_img = Arc::new(imgs[1].snapshot("crash-data"));
        let meta_dev: DeviceRef = Arc::new(MemDevice::from_image("crash-meta", &meta_img));
        rt.block_on(async {
            let opts = PoolOptions { check_on_open: false, ..quiet_opts() };
            let pool =
                Pool::open("image", meta_dev, data_img, opts).await.unwrap_or_else(|e| panic!("{what}: open: {e}"));
            let present = pool.devices().await.unwrap();
            for (&id, vol) in &h.vols {
                let must_exist = vol.created <= p.0 && vol.deleting.is_none_or(|d| d >= p.0);
                if !present.contains(&id) {
                    assert!(!must_exist, "{what}: device {id} is missing");
                    continue;
                }
                let v = pool.thin(id, VOL_BYTES).await.unwrap();
                let got = v.read_vec(0, VOL_BYTES as usize).await.unwrap();
                for c in 0..CHUNKS {
                    let allowed = h.allowed(id, c, p.0);
                    for s in 0..(CHUNK / 512) {
                        let off = c as u64 * CHUNK + s * 512;
                        let tag = sector_tag(&got[off as usize..off as usize + 512], off);
                        assert!(
                            tag.is_some_and(|t| allowed.contains(&t)),
                            "{what}: volume {id} sector at {off} holds {tag:?}, allowed {allowed:?} (history {:?})",
                            h.vols[&id].chunks[c]
                        );
                        sectors += 1;
                    }
                }
            }
            pool.close().await.unwrap();
        });
        images += 1;
    }
    let _ = std::fs::remove_file(scratch_path("pool-crash-image.meta"));
    eprintln!(
        "{images} crash images of {} points checked ({tool_checked} also with thin_check, {sectors} sectors verified), {} barriers",
        points.len(),
        h.barriers.len()
    );
    assert!(images > 100, "{images}");
}
