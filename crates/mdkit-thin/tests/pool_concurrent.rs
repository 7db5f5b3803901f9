//! Concurrency of the pool runtime against a model: many tasks on a multi-threaded runtime
//! write and read overlapping virtual blocks of two volumes while snapshots of the busy volume
//! are taken (and deleted) and blocks are discarded.
//!
//! * Region A (blocks 0..24): 4 KiB chunks are owned round-robin by 12 writer tasks, so every
//!   block is written by many tasks at once: first writes race on unprovisioned blocks, and
//!   after each snapshot, writes race to break sharing of the same block.
//! * Region B (blocks 24..28): each block belongs to one task, which writes it, reads it and
//!   discards it (discards racing with the other tasks' I/O on the same shards and worker).
//! * Region C (blocks 28..32): one task writes while another discards the same blocks.
//!
//! Afterwards: every chunk of regions A and B reads its last written value (no lost writes);
//! every snapshot holds, per chunk, a value that was current while it was being taken;
//! region C holds zeroes or a value written there; the two volumes share no data block (no
//! double allocation); the metadata passes `check` and thin_check.
//!
//! A second test runs owned-block writes, read-backs, discards and scans of unmapped blocks
//! over a volume far larger than a tiny mapping cache, so mappings are evicted and reloaded
//! from the metadata while I/O on them is in flight.

use crate::common;
use crate::pool_util;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, MemDevice, Rng, SharedBuf, WriteFlags};
use mdkit_thin::meta::{CheckOptions, MemMetaIo, check};
use mdkit_thin::pool::{Pool, ThinVolume};
use pool_util::*;

const VOL_BLOCKS: u64 = 32;
const VOL_BYTES: u64 = VOL_BLOCKS * BLOCK_BYTES;
const CHUNK: u64 = 4096;
const CHUNKS_PER_BLOCK: u64 = BLOCK_BYTES / CHUNK;
const REGION_A_BLOCKS: u64 = 24;
const WRITERS: u64 = 12;
const OPS_PER_TASK: u64 = 250;

/// A write (or discard, tag 0) of one chunk, on the logical clock.
#[derive(Clone, Copy, Debug)]
struct Ev {
    vol: u64,
    chunk: u64,
    tag: u64,
    issue: u64,
    complete: u64,
}

struct Shared {
    clock: AtomicU64,
    tags: AtomicU64,
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }
    fn tag(&self) -> u64 {
        self.tags.fetch_add(1, Ordering::SeqCst)
    }
}

fn chunk_data(tag: u64, chunk: u64) -> SharedBuf {
    SharedBuf::from_slice(&pattern(tag, chunk * CHUNK, CHUNK as usize))
}

fn read_tag(buf: &[u8], chunk: u64, what: &str) -> u64 {
    let mut tag = None;
    for s in 0..(CHUNK / 512) {
        let off = chunk * CHUNK + s * 512;
        let i = (s * 512) as usize;
        let t =
            sector_tag(&buf[i..i + 512], off).unwrap_or_else(|| panic!("{what}: chunk {chunk} sector {s} is garbage"));
        assert!(tag.is_none_or(|x| x == t), "{what}: chunk {chunk} is torn ({tag:?} vs {t})");
        tag = Some(t);
    }
    tag.unwrap()
}

/// Writer `t`: chunks c of region A with c % WRITERS == t, on both volumes; block 24 + t/3 of
/// region B on volume t%2 when t%3 == 0.
async fn writer(t: u64, vols: [ThinVolume; 2], sh: Arc<Shared>, seed: u64) -> Vec<Ev> {
    let mut rng = Rng::new(seed ^ t);
    let mut log = Vec::new();
    let mut last: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let own: Vec<u64> = (0..REGION_A_BLOCKS * CHUNKS_PER_BLOCK).filter(|c| c % WRITERS == t).collect();
    let b_block = t.is_multiple_of(3).then(|| 24 + t / 3);
    for _ in 0..OPS_PER_TASK {
        let vi = rng.below(2);
        let v = &vols[vi as usize];
        let roll = rng.below(100);
        if let (Some(b), true) = (b_block, roll < 15) {
            let vi = t % 2;
            let v = &vols[vi as usize];
            let first = b * CHUNKS_PER_BLOCK;
            if roll < 5 {
                let issue = sh.tick();
                v.discard(b * BLOCK_BYTES, BLOCK_BYTES).await.unwrap();
                let complete = sh.tick();
                for c in first..first + CHUNKS_PER_BLOCK {
                    log.push(Ev { vol: vi, chunk: c, tag: 0, issue, complete });
                    last.insert((vi, c), 0);
                }
            } else {
                let c = first + rng.below(CHUNKS_PER_BLOCK);
                let tag = sh.tag();
                let issue = sh.tick();
                v.write(c * CHUNK, chunk_data(tag, c), WriteFlags { fua: rng.chance(1, 3) }).await.unwrap();
                let complete = sh.tick();
                log.push(Ev { vol: vi, chunk: c, tag, issue, complete });
                last.insert((vi, c), tag);
            }
            continue;
        }
        let c = own[rng.below(own.len() as u64) as usize];
        if roll < 70 {
            let tag = sh.tag();
            let issue = sh.tick();
            v.write(c * CHUNK, chunk_data(tag, c), WriteFlags { fua: rng.chance(1, 4) }).await.unwrap();
            let complete = sh.tick();
            log.push(Ev { vol: vi, chunk: c, tag, issue, complete });
            last.insert((vi, c), tag);
        } else if roll < 90 {
            // Read-your-writes on an owned chunk.
            let got = v.read_vec(c * CHUNK, CHUNK as usize).await.unwrap();
            let want = last.get(&(vi, c)).copied().unwrap_or(0);
            assert_eq!(read_tag(&got, c, "own chunk"), want, "writer {t}: volume {vi} chunk {c} lost a write");
        } else if roll < 96 {
            // A whole block of other writers' chunks: any value, never garbage.
            let b = rng.below(REGION_A_BLOCKS);
            let got = v.read_vec(b * BLOCK_BYTES, BLOCK_BYTES as usize).await.unwrap();
            for i in 0..CHUNKS_PER_BLOCK {
                let cc = b * CHUNKS_PER_BLOCK + i;
                read_tag(&got[(i * CHUNK) as usize..((i + 1) * CHUNK) as usize], cc, "foreign chunk");
            }
        } else {
            v.flush().await.unwrap();
        }
    }
    log
}

/// Region C: one task writes, another discards the same four blocks.
async fn region_c(vol: ThinVolume, sh: Arc<Shared>, seed: u64, discarder: bool) -> Vec<Ev> {
    let mut rng = Rng::new(seed ^ 0xc0c0 ^ u64::from(discarder));
    let mut log = Vec::new();
    for _ in 0..OPS_PER_TASK {
        let b = 28 + rng.below(4);
        if discarder {
            vol.discard(b * BLOCK_BYTES, BLOCK_BYTES).await.unwrap();
            tokio::task::yield_now().await;
        } else {
            let c = b * CHUNKS_PER_BLOCK + rng.below(CHUNKS_PER_BLOCK);
            let tag = sh.tag();
            let issue = sh.tick();
            vol.write(c * CHUNK, chunk_data(tag, c), WriteFlags::NONE).await.unwrap();
            log.push(Ev { vol: 0, chunk: c, tag, issue, complete: sh.tick() });
        }
    }
    log
}

#[test]
fn racing_writers_snapshots_and_discards_lose_nothing() {
    let seed = std::env::var("MDKIT_CONCURRENT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0xc0ffee_u64);
    eprintln!("seed {seed:#x}");
    let meta = Arc::new(MemDevice::new("meta", 8 << 20));
    let data = MemDevice::new("data", 512 * BLOCK_BYTES);
    let rt = rt();
    let (snaps, logs, mappings, final_reads) = rt.block_on(async {
        let m: DeviceRef = meta.clone();
        // Writes land 2 ms after issue: many are in flight across snapshots, sharing breaks
        // and discards of their blocks.
        let d: DeviceRef = Arc::new(LateWrites::new(data, 2, 2));
        // The default options: periodic commits (every 1 s) run concurrently too.
        let pool = Pool::create("race", m, d, BLOCK_BYTES, Default::default()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        pool.create_thin(1).await.unwrap();
        let v0 = pool.thin(0, VOL_BYTES).await.unwrap();
        let v1 = pool.thin(1, VOL_BYTES).await.unwrap();
        let sh = Arc::new(Shared { clock: AtomicU64::new(1), tags: AtomicU64::new(1) });
        let mut tasks = Vec::new();
        for t in 0..WRITERS {
            tasks.push(tokio::spawn(writer(t, [v0.clone(), v1.clone()], sh.clone(), seed)));
        }
        tasks.push(tokio::spawn(region_c(v0.clone(), sh.clone(), seed, false)));
        tasks.push(tokio::spawn(region_c(v0.clone(), sh.clone(), seed, true)));
        // Snapshots of the busy volume 0 (and of a snapshot) while the writers run.
        let mut snaps: Vec<(u64, u64, u64, u64)> = Vec::new(); // (id, origin, start, end)
        // Each snapshot as read right after it was taken: it must never change afterwards.
        let mut first_reads: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        let mut rng = Rng::new(seed ^ 0x5a);
        let mut next = 10;
        while !tasks.iter().all(|t| t.is_finished()) && next < 22 {
            tokio::time::sleep(std::time::Duration::from_millis(1 + rng.below(3))).await;
            let origin =
                if next > 12 && rng.chance(1, 4) { snaps[rng.below(snaps.len() as u64) as usize].0 } else { 0 };
            let start = sh.tick();
            pool.create_snapshot(next, origin).await.unwrap();
            snaps.push((next, origin, start, sh.tick()));
            let sv = pool.thin(next, VOL_BYTES).await.unwrap();
            first_reads.insert(next, sv.read_vec(0, VOL_BYTES as usize).await.unwrap());
            drop(sv);
            if next % 5 == 0 {
                // Delete an older snapshot of volume 0 (not one another snapshot came from).
                let victim = snaps.iter().position(|s| s.1 == 0 && s.0 != next && !snaps.iter().any(|o| o.1 == s.0));
                if let Some(i) = victim {
                    let (id, ..) = snaps.remove(i);
                    pool.delete_thin(id).await.unwrap();
                }
            }
            next += 1;
        }
        let mut logs = Vec::new();
        for t in tasks {
            logs.extend(t.await.unwrap());
        }
        assert!(snaps.len() >= 3, "snapshots were taken while writing");
        let mut final_reads = BTreeMap::new();
        for (id, v) in [(0u64, &v0), (1, &v1)] {
            final_reads.insert(id, v.read_vec(0, VOL_BYTES as usize).await.unwrap());
        }
        for &(id, ..) in &snaps {
            let v = pool.thin(id, VOL_BYTES).await.unwrap();
            let now = v.read_vec(0, VOL_BYTES as usize).await.unwrap();
            assert!(now == first_reads[&id], "snapshot {id} changed after it was taken");
            final_reads.insert(id, now);
        }
        let mut mappings = BTreeMap::new();
        for id in pool.devices().await.unwrap() {
            mappings.insert(id, pool.mappings(id).await.unwrap());
        }
        let st = pool.status().await.unwrap();
        eprintln!("status {st}; counters {:?}", st.counters);
        assert!(st.counters.volumes.cell_waits > 0, "writes did race on cells");
        assert!(st.counters.sharing_breaks > 0 && st.counters.provisions > 0);
        drop((v0, v1));
        pool.close().await.unwrap();
        (snaps, logs, mappings, final_reads)
    });

    // No lost writes: regions A and B of both volumes hold each chunk's last value.
    let mut history: BTreeMap<(u64, u64), Vec<Ev>> = BTreeMap::new();
    for e in &logs {
        history.entry((e.vol, e.chunk)).or_default().push(*e);
    }
    for evs in history.values_mut() {
        evs.sort_by_key(|e| e.issue);
    }
    for vol in [0u64, 1] {
        for c in 0..28 * CHUNKS_PER_BLOCK {
            let want = history.get(&(vol, c)).and_then(|h| h.last()).map_or(0, |e| e.tag);
            let buf = &final_reads[&vol][(c * CHUNK) as usize..((c + 1) * CHUNK) as usize];
            assert_eq!(read_tag(buf, c, "final"), want, "volume {vol} chunk {c}: lost write");
        }
    }
    // Region C: zeroes or something written there.
    for c in 28 * CHUNKS_PER_BLOCK..VOL_BLOCKS * CHUNKS_PER_BLOCK {
        let buf = &final_reads[&0][(c * CHUNK) as usize..((c + 1) * CHUNK) as usize];
        let got = read_tag(buf, c, "region C");
        assert!(
            got == 0 || history.get(&(0, c)).is_some_and(|h| h.iter().any(|e| e.tag == got)),
            "region C chunk {c}: {got}"
        );
    }
    // Snapshots: per chunk, a value current while the snapshot was taken.
    let snap_of: BTreeMap<u64, (u64, u64, u64)> = snaps.iter().map(|&(id, o, s, e)| (id, (o, s, e))).collect();
    for &(id, ..) in &snaps {
        // Follow the chain to volume 0; the window is the first snapshot's (later ones copy it).
        let (mut origin, mut start, mut end) = snap_of[&id];
        while origin != 0 {
            (origin, start, end) = snap_of[&origin];
        }
        for c in 0..VOL_BLOCKS * CHUNKS_PER_BLOCK {
            let evs = history.get(&(0, c)).map(Vec::as_slice).unwrap_or(&[]);
            let buf = &final_reads[&id][(c * CHUNK) as usize..((c + 1) * CHUNK) as usize];
            let got = read_tag(buf, c, "snapshot");
            if c >= 28 * CHUNKS_PER_BLOCK {
                // Region C has no exact history (its discards are not logged).
                assert!(got == 0 || evs.iter().any(|e| e.tag == got), "snapshot {id} chunk {c}");
                continue;
            }
            let before = evs.iter().rposition(|e| e.complete < start);
            let mut allowed = vec![before.map_or(0, |i| evs[i].tag)];
            allowed.extend(evs[before.map_or(0, |i| i + 1)..].iter().filter(|e| e.issue < end).map(|e| e.tag));
            assert!(allowed.contains(&got), "snapshot {id} chunk {c}: {got}, allowed {allowed:?}");
        }
    }
    // No double allocation: within a device no data block twice; volumes 0 and 1 (and 0's
    // snapshots vs 1) share nothing.
    let blocks_of = |id: u64| -> Vec<u64> { mappings[&id].iter().map(|(_, m)| m.data_block).collect() };
    for &id in mappings.keys() {
        let mut b = blocks_of(id);
        let n = b.len();
        b.sort_unstable();
        b.dedup();
        assert_eq!(b.len(), n, "device {id} maps a data block twice");
    }
    let one: std::collections::HashSet<u64> = blocks_of(1).into_iter().collect();
    for (&id, _) in mappings.iter().filter(|(id, _)| **id != 1) {
        assert!(blocks_of(id).iter().all(|b| !one.contains(b)), "device {id} shares a block with volume 1");
    }
    let img = meta.to_image();
    let r = check(&MemMetaIo::from_image("race", &img), &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    let path = scratch_path("pool-concurrent.meta");
    std::fs::write(&path, &img).unwrap();
    assert_thin_check_clean(&path, "after the races");
    let _ = std::fs::remove_file(&path);
    eprintln!("{} logged writes/discards, {} snapshots verified", logs.len(), snaps.len());
}

/// Snapshots of a volume under constant in-place writes (slow writes, so many are in flight
/// at every snapshot): each snapshot, read right after it was taken, never changes later, and
/// holds per chunk a value current while it was taken. This is what freezing the origin (the
/// suspend dm-thin requires for `create_snap`) guarantees.
#[test]
fn snapshots_are_point_in_time_under_in_flight_writes() {
    const BLOCKS: u64 = 4;
    let seed = 0x5a9_u64;
    let rt = rt();
    rt.block_on(async {
        let d: DeviceRef = Arc::new(LateWrites::new(MemDevice::new("data", 256 * BLOCK_BYTES), 2, 2));
        let pool =
            Pool::create("pit", Arc::new(MemDevice::new("meta", 4 << 20)), d, BLOCK_BYTES, quiet_opts()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v = pool.thin(0, BLOCKS * BLOCK_BYTES).await.unwrap();
        v.write_slice(0, &vec![0u8; (BLOCKS * BLOCK_BYTES) as usize], WriteFlags::NONE).await.unwrap();
        let sh = Arc::new(Shared { clock: AtomicU64::new(1), tags: AtomicU64::new(1) });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let (v, sh, stop) = (v.clone(), sh.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ t);
                let mut log = Vec::new();
                // Writer t owns chunks t, t+8, ...: chunk histories are sequential.
                let own: Vec<u64> = (0..BLOCKS * CHUNKS_PER_BLOCK).filter(|c| c % 8 == t).collect();
                while !stop.load(Ordering::SeqCst) {
                    let c = own[rng.below(own.len() as u64) as usize];
                    let tag = sh.tag();
                    let issue = sh.tick();
                    v.write(c * CHUNK, chunk_data(tag, c), WriteFlags::NONE).await.unwrap();
                    log.push(Ev { vol: 0, chunk: c, tag, issue, complete: sh.tick() });
                }
                log
            }));
        }
        let mut snaps = Vec::new();
        for id in 1..=8u64 {
            // Snapshots between bursts of 40 writes (counted, not timed: a busy machine slows
            // the writers and the snapshotter alike).
            let tags = sh.tags.load(Ordering::SeqCst);
            let waiting = std::time::Instant::now();
            while sh.tags.load(Ordering::SeqCst) < tags + 40 {
                assert!(waiting.elapsed() < std::time::Duration::from_secs(60), "writers made no progress");
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            let start = sh.tick();
            pool.create_snapshot(id, 0).await.unwrap();
            let end = sh.tick();
            let sv = pool.thin(id, BLOCKS * BLOCK_BYTES).await.unwrap();
            snaps.push((id, start, end, sv.read_vec(0, (BLOCKS * BLOCK_BYTES) as usize).await.unwrap()));
        }
        stop.store(true, Ordering::SeqCst);
        let mut history: BTreeMap<u64, Vec<Ev>> = BTreeMap::new();
        for t in tasks {
            for e in t.await.unwrap() {
                history.entry(e.chunk).or_default().push(e);
            }
        }
        for (id, start, end, first) in snaps {
            let sv = pool.thin(id, BLOCKS * BLOCK_BYTES).await.unwrap();
            let now = sv.read_vec(0, (BLOCKS * BLOCK_BYTES) as usize).await.unwrap();
            for c in 0..BLOCKS * CHUNKS_PER_BLOCK {
                let r = (c * CHUNK) as usize..((c + 1) * CHUNK) as usize;
                let (a, b) = (read_tag(&first[r.clone()], c, "first"), read_tag(&now[r], c, "later"));
                assert_eq!(a, b, "snapshot {id} chunk {c} changed after the snapshot was taken");
                let evs = history.get(&c).map(Vec::as_slice).unwrap_or(&[]);
                let before = evs.iter().rposition(|e| e.complete < start);
                let mut allowed = vec![before.map_or(0, |i| evs[i].tag)];
                allowed.extend(evs[before.map_or(0, |i| i + 1)..].iter().filter(|e| e.issue < end).map(|e| e.tag));
                assert!(allowed.contains(&a), "snapshot {id} chunk {c}: {a}, allowed {allowed:?}");
            }
        }
        let st = pool.status().await.unwrap();
        assert!(st.counters.volumes.fast_writes > 100, "{:?}", st.counters);
        pool.close().await.unwrap();
    });
}

/// A RAM disk whose writes reach the medium some milliseconds after they are issued (the
/// latency models of mdkit-io apply data at issue and delay only the completion): writes of
/// at most 4 KiB after `.1` ms, larger ones after `.2` ms; `.3` counts writes issued.
struct LateWrites(MemDevice, u64, u64, AtomicU64);

impl LateWrites {
    fn new(dev: MemDevice, small_ms: u64, large_ms: u64) -> LateWrites {
        LateWrites(dev, small_ms, large_ms, AtomicU64::new(0))
    }
}

impl BlockDevice for LateWrites {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn topology(&self) -> mdkit_io::Topology {
        self.0.topology()
    }
    fn read(&self, offset_bytes: u64, buf: mdkit_io::IoBuf) -> mdkit_io::IoFuture<'_, mdkit_io::ReadResult> {
        self.0.read(offset_bytes, buf)
    }
    fn write(
        &self,
        offset_bytes: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        let ms = if buf.len() <= 4096 { self.1 } else { self.2 };
        self.3.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            self.0.write(offset_bytes, buf, flags).await
        })
    }
    fn flush(&self) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.0.flush()
    }
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.0.discard(offset_bytes, len_bytes)
    }
    fn write_zeroes(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        flags: mdkit_io::ZeroFlags,
    ) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.0.write_zeroes(offset_bytes, len_bytes, flags)
    }
}

/// A discard must wait for writes in flight to the blocks it unmaps: otherwise a slow write
/// lands after the block was freed, passed down and reused by another volume.
#[test]
fn discard_waits_for_in_flight_writes_before_the_block_is_reused() {
    rt().block_on(async {
        // One data block: the block volume 0 frees is the one volume 1 gets next.
        let late = Arc::new(LateWrites::new(MemDevice::new("data", BLOCK_BYTES), 40, 1));
        let d: DeviceRef = late.clone();
        let pool = Pool::create("reuse", Arc::new(MemDevice::new("meta", 4 << 20)), d, BLOCK_BYTES, quiet_opts())
            .await
            .unwrap();
        pool.create_thin(0).await.unwrap();
        pool.create_thin(1).await.unwrap();
        let v0 = pool.thin(0, BLOCK_BYTES).await.unwrap();
        let v1 = pool.thin(1, BLOCK_BYTES).await.unwrap();
        v0.write_slice(0, &vec![1u8; BLOCK_BYTES as usize], WriteFlags::NONE).await.unwrap();
        pool.flush().await.unwrap();
        // A slow in-place write (40 ms) to volume 0, and meanwhile a discard of its block.
        let w = v0.clone();
        let issued = late.3.load(Ordering::SeqCst);
        let slow = tokio::spawn(async move { w.write_slice(8192, &[7u8; 4096], WriteFlags::NONE).await });
        // The discard starts once the slow write is on the data device (counted, not timed).
        let waiting = std::time::Instant::now();
        while late.3.load(Ordering::SeqCst) == issued {
            assert!(waiting.elapsed() < std::time::Duration::from_secs(60), "the slow write never started");
            tokio::task::yield_now().await;
        }
        v0.discard(0, BLOCK_BYTES).await.unwrap();
        pool.flush().await.unwrap(); // commit + passdown: the block is free
        v1.write_slice(0, &pattern(9, 0, 4096), WriteFlags::NONE).await.unwrap();
        slow.await.unwrap().unwrap();
        let got = v1.read_vec(0, BLOCK_BYTES as usize).await.unwrap();
        assert_eq!(&got[..4096], &pattern(9, 0, 4096)[..]);
        assert!(got[4096..].iter().all(|&b| b == 0), "volume 1's new block was overwritten by volume 0's late write");
        pool.close().await.unwrap();
    });
}

/// A mapping cache far smaller than what the tasks touch (`mapping_cache_entries` 1024: 16
/// slots per shard, and a virtual range of 8192 blocks): mappings are evicted and reloaded
/// from the metadata all the time while writes, read-backs, discards and scans of unmapped
/// blocks run on two threads, with writes still in flight when their mapping is evicted.
/// Every read must see the last write (or zeroes after a discard): a stale or lost mapping
/// shows up at once.
#[test]
fn a_tiny_mapping_cache_evicts_and_reloads_under_concurrent_io() {
    const VIRTUAL_BLOCKS: u64 = 8192;
    const TASKS: u64 = 8;
    const OWNED: u64 = 8;
    const OPS: u64 = 300;
    // Block k of the owned ones: spread over the whole range (97 is odd, so this is a
    // bijection modulo 8192), so owned blocks share sets with each other and with the scans.
    let owned = |t: u64, i: u64| ((t * OWNED + i) * 97) % VIRTUAL_BLOCKS;
    let is_owned = |b: u64| (0..TASKS * OWNED).any(|k| (k * 97) % VIRTUAL_BLOCKS == b);
    let seed = std::env::var("MDKIT_CONCURRENT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x7a1e_u64);
    eprintln!("seed {seed:#x}");
    let meta = Arc::new(MemDevice::new("meta", 8 << 20));
    let rt = rt();
    rt.block_on(async {
        let m: DeviceRef = meta.clone();
        let d: DeviceRef = Arc::new(LateWrites::new(MemDevice::new("data", 160 * BLOCK_BYTES), 1, 1));
        let opts = mdkit_thin::pool::PoolOptions { mapping_cache_entries: 1024, ..Default::default() };
        let pool = Pool::create("tiny", m, d, BLOCK_BYTES, opts).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let vol = pool.thin(0, VIRTUAL_BLOCKS * BLOCK_BYTES).await.unwrap();
        let tags = Arc::new(AtomicU64::new(1));
        let tag_of = |buf: &[u8], c: u64, what: &str| {
            if buf.iter().all(|&b| b == 0) { 0 } else { read_tag(buf, c, what) }
        };
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (vol, tags) = (vol.clone(), tags.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ (t + 1));
                // What each owned chunk holds: (block index, chunk) -> tag (0 = zeroes).
                let mut model: BTreeMap<(u64, u64), u64> = BTreeMap::new();
                for op in 0..OPS {
                    let i = rng.below(OWNED);
                    let b = owned(t, i);
                    let c = rng.below(CHUNKS_PER_BLOCK);
                    let off = b * BLOCK_BYTES + c * CHUNK;
                    match rng.below(10) {
                        0 => {
                            vol.discard(b * BLOCK_BYTES, BLOCK_BYTES).await.unwrap();
                            model.retain(|&(bi, _), _| bi != i);
                        }
                        1 | 2 => {
                            let got = vol.read_vec(off, CHUNK as usize).await.unwrap();
                            let want = model.get(&(i, c)).copied().unwrap_or(0);
                            assert_eq!(tag_of(&got, c, "read"), want, "task {t} op {op}: block {b} chunk {c}");
                        }
                        _ => {
                            let tag = tags.fetch_add(1, Ordering::Relaxed);
                            vol.write(off, chunk_data(tag, c), WriteFlags::NONE).await.unwrap();
                            model.insert((i, c), tag);
                            let got = vol.read_vec(off, CHUNK as usize).await.unwrap();
                            assert_eq!(tag_of(&got, c, "read-back"), tag, "task {t} op {op}: block {b} chunk {c}");
                        }
                    }
                }
                (t, model)
            }));
        }
        for s in 0..4u64 {
            let vol = vol.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ (0x5ca7 + s));
                for _ in 0..OPS {
                    let b = rng.below(VIRTUAL_BLOCKS);
                    if is_owned(b) {
                        continue;
                    }
                    let got = vol.read_vec(b * BLOCK_BYTES + rng.below(CHUNKS_PER_BLOCK) * CHUNK, CHUNK as usize).await;
                    assert!(got.unwrap().iter().all(|&x| x == 0), "unwritten block {b} is not zeroes");
                }
                (u64::MAX, BTreeMap::new())
            }));
        }
        for task in tasks {
            let (t, model) = task.await.unwrap();
            for i in (0..OWNED).filter(|_| t != u64::MAX) {
                let b = owned(t, i);
                let got = vol.read_vec(b * BLOCK_BYTES, BLOCK_BYTES as usize).await.unwrap();
                for c in 0..CHUNKS_PER_BLOCK {
                    let part = &got[(c * CHUNK) as usize..((c + 1) * CHUNK) as usize];
                    let want = model.get(&(i, c)).copied().unwrap_or(0);
                    assert_eq!(tag_of(part, c, "final"), want, "task {t}: block {b} chunk {c} at the end");
                }
            }
        }
        let counters = vol.counters();
        eprintln!("counters {counters:?}, {} mappings cached", vol.cached_mappings());
        assert!(counters.evictions > 100, "the cache was too big to evict: {counters:?}");
        assert!(vol.cached_mappings() <= 1024);
        drop(vol);
        pool.close().await.unwrap();
    });
    let r = check(&MemMetaIo::from_image("tiny", &meta.to_image()), &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
}
