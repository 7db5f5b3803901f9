//! Power cuts under write-behind (issue 19): raid1 of a local member and a slow write-mostly
//! member (every data write waits 1-3 ms of a paused tokio clock: the remote lags, behind
//! writes are outstanding most of the time) with `write_behind = 16`, both crash-recording in
//! one power domain, under concurrent random writes (some FUA) and array flushes. The power is cut at every flush
//! point and at random points, each image built with all, none, a random subset or random
//! sector tears of the volatile writes. For every image:
//! - the members assemble and the bitmap-guided resync runs (from the local member: a resync
//!   never copies from a write-mostly member when another is in sync);
//! - every write acknowledged before a completed flush started, and every FUA write, reads
//!   back exactly from **both** members' data areas; any other written sector holds its old
//!   (zero) or new contents on each;
//! - `check` finds 0 mismatches.
//!
//! `MDKIT_TEST_SEED` replays one seed.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{
    BlockDevice, CrashGroup, CrashPoint, CrashPolicy, DeviceRef, IoBuf, IoFuture, MemDevice, ReadResult, Rng,
    SharedBuf, Topology, WriteFlags, ZeroFlags,
};
use mdkit_md::array::{Array, AssembleOptions, MemberDev, assemble, create};
use mdkit_md::layout::Level;
use parking_lot::Mutex;

use crate::array_util::{MIB, check, fast_sync, opts, seed};

const MEMBER_BYTES: u64 = 12 * MIB;

/// A far member: data writes (beyond the metadata) arrive 1-3 ms late.
struct Lagging {
    inner: DeviceRef,
    from_bytes: u64,
    rng: Mutex<Rng>,
}

impl BlockDevice for Lagging {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn read(&self, off: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.inner.read(off, buf)
    }
    fn write(&self, off: u64, buf: SharedBuf, f: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            if off >= self.from_bytes {
                let ms = 1 + self.rng.lock().below(3);
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            self.inner.write(off, buf, f).await
        })
    }
    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, off: u64, len: u64) -> IoFuture<'_, io::Result<()>> {
        self.inner.discard(off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        self.inner.write_zeroes(off, len, f)
    }
}

struct Written {
    off: u64,
    data: Vec<u8>,
    fua: bool,
    acked_at: u64,
}

#[derive(Default)]
struct History {
    written: Vec<Written>,
    /// (log position before the flush was issued, after it returned).
    flushes: Vec<(u64, u64)>,
}

fn durable(w: &Written, h: &History, point: u64) -> bool {
    w.acked_at <= point && (w.fua || h.flushes.iter().any(|&(s, d)| d <= point && w.acked_at <= s))
}

/// Four writers over blocks written at most once (old contents: zeroes).
async fn workload(a: Arc<Array>, group: CrashGroup, seed: u64, ops: usize) -> History {
    let blocks = a.size_bytes() / 4096;
    let free = Arc::new(Mutex::new((0..blocks).collect::<Vec<u64>>()));
    let history = Arc::new(Mutex::new(History::default()));
    let tasks: Vec<_> = (0..4u64)
        .map(|t| {
            let (a, group, free, history) = (a.clone(), group.clone(), free.clone(), history.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(seed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                for _ in 0..ops {
                    let b = {
                        let mut f = free.lock();
                        let i = rng.below(f.len() as u64) as usize;
                        f.swap_remove(i)
                    };
                    let mut data = vec![0u8; 4096];
                    rng.fill(&mut data);
                    let fua = rng.chance(1, 6);
                    let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
                    a.write(b * 4096, SharedBuf::from_slice(&data), flags).await.expect("array write");
                    history.lock().written.push(Written { off: b * 4096, data, fua, acked_at: group.now().0 });
                    if rng.below(8) == 0 {
                        let started = group.now().0;
                        a.flush().await.expect("array flush");
                        history.lock().flushes.push((started, group.now().0));
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

/// Assembles one image, resyncs, and checks both sides (see the module documentation).
async fn check_image(ctx: &str, images: Vec<MemDevice>, h: &History, point: u64, data_offset: u64) {
    let images: Vec<Arc<MemDevice>> = images.into_iter().map(Arc::new).collect();
    let devs: Vec<MemberDev> = images
        .iter()
        .enumerate()
        .map(|(i, m)| MemberDev::new(["local", "remote"][i], m.clone() as DeviceRef))
        .collect();
    let o = AssembleOptions { name: "wb-crash".into(), start_frozen: true, ..AssembleOptions::default() };
    let b = assemble(devs, o).await.unwrap_or_else(|e| panic!("{ctx}: assembly refused: {e}")).array;
    fast_sync(&b);
    b.set_attribute("sync_action", "idle").unwrap();
    b.wait_sync_idle().await;
    while b.get_attribute("resync_start").unwrap() != "none" {
        tokio::time::sleep(Duration::from_millis(1)).await;
        b.wait_sync_idle().await;
    }
    for w in &h.written {
        for (side, img) in images.iter().enumerate() {
            let mut got = vec![0u8; w.data.len()];
            img.read_bytes(data_offset + w.off, &mut got);
            if durable(w, h, point) {
                assert!(got == w.data, "{ctx}: flushed write at {} (fua {}) lost on member {side}", w.off, w.fua);
            } else {
                for (g, d) in got.chunks(512).zip(w.data.chunks(512)) {
                    assert!(
                        g == d || g.iter().all(|x| *x == 0),
                        "{ctx}: member {side} at {}: neither old nor new",
                        w.off
                    );
                }
            }
        }
    }
    assert_eq!(check(&b).await, 0, "{ctx}: mismatches after recovery");
    b.stop().await.unwrap();
}

async fn run(seed: u64, ops: usize, random_points: usize) -> (usize, u64) {
    let group = CrashGroup::new();
    let local = Arc::new(group.wrap("local", MemDevice::new("local", MEMBER_BYTES)));
    let remote_rec = Arc::new(group.wrap("remote", MemDevice::new("remote", MEMBER_BYTES)));
    // Metadata sits below 1 MiB (the data offset of a 12 MiB member); only data writes lag.
    let remote = Arc::new(Lagging { inner: remote_rec, from_bytes: MIB, rng: Mutex::new(Rng::new(seed)) });
    let mut o = opts(Level::Raid1, 2, None, None, true, true);
    o.write_behind = 16;
    let devs = vec![MemberDev::new("local", local as DeviceRef), MemberDev::new("remote", remote as DeviceRef)];
    let a = Arc::new(create(devs, o).await.unwrap_or_else(|e| panic!("create: {e}")).array);
    a.set_write_mostly("remote", true).await.unwrap();
    let data_offset = a.detail()["members"][1]["data_offset_sectors"].as_u64().unwrap() * 512;
    assert!(data_offset >= MIB, "only data writes lag: data offset {data_offset}");
    a.set_attribute("bitmap/time_base", "0.02").unwrap();
    let created = group.now().0;
    let h = workload(a.clone(), group.clone(), seed, ops).await;
    let peak = a.detail()["write_behind"]["peak_writes"].as_u64().unwrap();
    Arc::try_unwrap(a).ok().expect("workload done").stop().await.unwrap();
    let end = group.now().0;
    let mut rng = Rng::new(seed);
    let mut points: Vec<u64> = group.flush_points().into_iter().map(|p| p.0).filter(|&p| p > created).collect();
    points.extend((0..random_points).map(|_| created + rng.below(end - created + 1)));
    points.push(end);
    for (k, &p) in points.iter().enumerate() {
        let policy = CrashPolicy::ALL[k % CrashPolicy::ALL.len()];
        let ctx = format!("{} ({policy:?}), seed {seed}", group.describe(CrashPoint(p)));
        let images = group.image_at(CrashPoint(p), &mut rng, policy).unwrap();
        check_image(&ctx, images, &h, p, data_offset).await;
    }
    (points.len(), peak)
}

#[test]
fn power_cuts_with_behind_writes_outstanding_lose_no_flushed_write_on_either_side() {
    let s = seed("write_behind_crash", 0x19b0_0001);
    // A paused clock: the remote's 1-3 ms lag is virtual time, so which behind writes are
    // outstanding together, and the peak, are the same on every run of a seed however busy
    // the machine is.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    let (images, peak) = rt.block_on(run(s, 40, 120));
    eprintln!("write_behind_crash: {images} crash images, peak {peak} behind writes outstanding");
    assert!(peak > 1, "the remote lagged: behind writes were outstanding together (peak {peak})");
    assert!(images >= 150, "every flush point and the random cuts: {images}");
}
