//! The raid4/5/6 write path seen from the members (TracedDevice under every member):
//! - aligned full-stripe writes read nothing, whatever `stripe_size`, and go out as one
//!   chunk-sized write per member per stripe;
//! - sequential writes smaller than a stripe, arriving together, are gathered into full
//!   stripes (almost no member reads), while a lone sequential writer at QD1 is never held
//!   (no hold runs into its timeout) and a lone random write is not held at all; on slow
//!   members a deep stream's frontier is held as long as a write takes, so it is gathered too;
//! - `stripe_size` is the unit small writes are widened to: 4 KiB random writes move 4 KiB
//!   per member I/O at 4 KiB and 64 KiB per member I/O at 64 KiB;
//! - no member write is below 4 KiB or misaligned.

use crate::array_util;

use std::sync::Arc;
use std::time::Instant;

use array_util::*;
use mdkit_io::{BlockDevice, DeviceRef, FlashDevice, IoBuf, MemDevice, Rng, SharedBuf, Tracer, WriteFlags};
use mdkit_md::array::Array;
use mdkit_md::layout::Level;

const KIB: u64 = 1024;

/// Members under one tracer, with flash-like latency (so concurrent requests overlap).
fn traced_members(prefix: &str, n: usize, size: u64, tracer: &Tracer) -> Vec<SimMember> {
    let model = flash_like_model();
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), size));
            let flash: DeviceRef = Arc::new(FlashDevice::new(mem.clone() as DeviceRef, model));
            let dev: DeviceRef = Arc::new(tracer.wrap(flash));
            SimMember { name, dev, mem: Some(mem), fault: None }
        })
        .collect()
}

fn attr(a: &Array, k: &str) -> u64 {
    a.get_attribute(k).unwrap().parse().unwrap()
}

struct Io {
    reads: u64,
    writes: u64,
    read_bytes: u64,
    write_bytes: u64,
}

fn io(t: &Tracer) -> Io {
    let s = t.snapshot().total();
    Io {
        reads: s.ops.read.requests,
        writes: s.ops.write.requests,
        read_bytes: s.ops.read.bytes,
        write_bytes: s.ops.write.bytes,
    }
}

async fn setup(level: Level, n: usize, chunk_kib: u32, tracer: &Tracer) -> (Vec<SimMember>, Array) {
    let ms = traced_members(&format!("wp-{}-", level.name()), n, 8 * MIB, tracer);
    let a = create_array(&ms, opts(level, n as u32, Some(chunk_kib), None, false, true)).await;
    // Keep the array marked active, so superblock writes of the clean/active transitions do
    // not mix into the counts (a first write makes it active).
    a.set_attribute("safe_mode_delay", "600").unwrap();
    a.write(0, SharedBuf::zeroed(4096), WriteFlags::NONE).await.unwrap();
    (ms, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aligned_full_stripe_writes_read_nothing() {
    let mut rng = Rng::new(seed("aligned_full_stripe_writes_read_nothing", 3));
    for (level, n) in [(Level::Raid5, 4), (Level::Raid6, 6), (Level::Raid4, 3)] {
        let tracer = Tracer::new(1024);
        let (_ms, a) = setup(level, n, 64, &tracer).await;
        let stripe = a.topology().optimal_io_bytes as u64;
        let mut model = Model::new(a.size_bytes());
        for size in ["4096", "65536", "16384"] {
            a.set_attribute("stripe_size", size).unwrap();
            tracer.reset();
            let reads_before = attr(&a, "member_reads_during_writes");
            // Single full stripes, then multi-stripe writes, some concurrent.
            for s in 0..6 {
                let mut b = vec![0u8; stripe as usize];
                rng.fill(&mut b);
                model.apply(s * stripe, &b);
                a.write(s * stripe, SharedBuf::from_slice(&b), WriteFlags::NONE).await.unwrap();
            }
            let writes = (0..4u64).map(|k| {
                let mut b = vec![0u8; 3 * stripe as usize];
                rng.fill(&mut b);
                let off = (6 + 3 * k) * stripe;
                model.apply(off, &b);
                a.write(off, SharedBuf::from_slice(&b), WriteFlags::NONE)
            });
            for r in mdkit_md::array::io::join_all(writes).await {
                r.unwrap();
            }
            let t = io(&tracer);
            let ctx = format!("{level:?} stripe_size {size}");
            assert_eq!(t.reads, 0, "{ctx}: member reads during aligned full-stripe writes");
            let stripes = 6 + 4 * 3;
            assert_eq!(t.writes, stripes * n as u64, "{ctx}: one chunk-sized write per member per stripe");
            assert_eq!(t.write_bytes, stripes * n as u64 * 64 * KIB, "{ctx}");
            assert_eq!(attr(&a, "member_reads_during_writes"), reads_before, "{ctx}");
        }
        verify_all(&a, &model).await;
        let snap = tracer.snapshot().total();
        assert_eq!((snap.writes_below_4k, snap.writes_misaligned_4k), (0, 0));
        a.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_small_writes_are_gathered_into_full_stripes() {
    let mut rng = Rng::new(seed("sequential_small_writes_are_gathered_into_full_stripes", 5));
    let tracer = Tracer::new(1024);
    let (_ms, a) = setup(Level::Raid5, 4, 64, &tracer).await; // stripe = 192 KiB
    let mut model = Model::new(a.size_bytes());
    let stripe = 192 * KIB;
    let stripes = 8u64;
    // 16 KiB sequential writes, all in flight at once (a QD-48 sequential writer).
    let req = 16 * KIB;
    tracer.reset();
    let full_before = attr(&a, "full_stripe_writes");
    let writes = (0..stripes * stripe / req).map(|k| {
        let mut b = vec![0u8; req as usize];
        rng.fill(&mut b);
        model.apply(k * req, &b);
        a.write(k * req, SharedBuf::from_slice(&b), WriteFlags::NONE)
    });
    for r in mdkit_md::array::io::join_all(writes).await {
        r.unwrap();
    }
    let t = io(&tracer);
    let full = attr(&a, "full_stripe_writes") - full_before;
    eprintln!(
        "gathered: {} member reads ({} bytes), {} member writes, {full} full-stripe runs, held {} batches, {} hold timeouts",
        t.reads,
        t.read_bytes,
        t.writes,
        attr(&a, "held_batches"),
        attr(&a, "hold_timeouts")
    );
    // The very first write of the stream is not yet known to be sequential; everything after
    // it is gathered.
    assert!(t.read_bytes <= 3 * stripe, "gathered stream read {} bytes from members", t.read_bytes);
    assert!(full >= stripes - 1, "{full} full-stripe runs for {stripes} stripes");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
}

/// A streaming writer at queue depth k issues its next write when one completes, so the
/// continuation of its newest write arrives about one write latency later. With members whose
/// writes take 4 ms (far beyond the 1 ms `stripe_gather_hold_us`), the hold limit follows the
/// measured write latency and the stream's frontier stripes are still completed, not written
/// partially with reads (which a fixed 1 ms hold did for most frontiers).
///
/// The clock is paused: the members' latencies and raid5's hold deadline and latency average
/// all run on tokio's clock, which the runtime advances only when every task waits, so the
/// outcome does not depend on how busy the machine is.
#[tokio::test(start_paused = true)]
async fn a_deep_stream_on_slow_members_is_still_gathered() {
    let tracer = Tracer::new(1024);
    let model = mdkit_io::FlashModel {
        read_latency_us: 4000,
        write_latency_us: 4000,
        rmw_latency_us: 0,
        channels: 64,
        ..mdkit_io::FlashModel::default()
    };
    let ms: Vec<SimMember> = (0..4)
        .map(|i| {
            let name = format!("slow{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), 8 * MIB));
            let flash: DeviceRef = Arc::new(FlashDevice::on_tokio_clock(mem.clone() as DeviceRef, model));
            let dev: DeviceRef = Arc::new(tracer.wrap(flash));
            SimMember { name, dev, mem: Some(mem), fault: None }
        })
        .collect();
    let a = Arc::new(create_array(&ms, opts(Level::Raid5, 4, Some(64), None, false, true)).await);
    a.set_attribute("safe_mode_delay", "600").unwrap();
    assert_eq!(attr(&a, "stripe_gather_hold_us"), 1000);
    // 128 KiB writes on 192 KiB stripes: two of every three writes end inside a stripe.
    let req = 128 * KIB;
    let total = 96 * req;
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    tracer.reset();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (a, next) = (a.clone(), next.clone());
        workers.spawn(async move {
            loop {
                let off = next.fetch_add(req, std::sync::atomic::Ordering::Relaxed);
                if off >= total {
                    return;
                }
                let b = vec![(off / req) as u8 + 1; req as usize];
                a.write(off, SharedBuf::from_slice(&b), WriteFlags::NONE).await.unwrap();
            }
        });
    }
    while let Some(r) = workers.join_next().await {
        r.unwrap();
    }
    let t = io(&tracer);
    let limit = attr(&a, "stripe_gather_hold_limit_us");
    eprintln!(
        "QD4 stream on 4 ms members: {} member reads ({} bytes), held {} batches, {} hold timeouts, hold limit now {limit} µs",
        t.reads,
        t.read_bytes,
        attr(&a, "held_batches"),
        attr(&a, "hold_timeouts")
    );
    assert!(limit >= 8000, "the hold limit follows the write latency (2 x ~4 ms), got {limit} µs");
    // Before the first batch completes the limit is still 1 ms: the stream's first frontier
    // may time out (and its stripe then goes out in two partial batches); everything after is
    // gathered. (With the fixed 1 ms hold: ~100 member reads, ~6.7 MB, ~32 timeouts.)
    assert!(attr(&a, "hold_timeouts") <= 4, "{} hold timeouts", attr(&a, "hold_timeouts"));
    assert!(t.read_bytes <= 8 * 192 * KIB, "stream read {} bytes from members", t.read_bytes);
    for k in 0..total / req {
        let mut b = IoBuf::zeroed(req as usize);
        let (b2, r) = a.read(k * req, b).await;
        r.unwrap();
        b = b2;
        assert!(b.as_slice().iter().all(|&x| x == k as u8 + 1), "write {k} does not read back");
    }
    assert_eq!(check(&a).await, 0, "parity mismatches after the stream");
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_writers_are_not_held() {
    let mut rng = Rng::new(seed("lone_writers_are_not_held", 7));
    let tracer = Tracer::new(16);
    let (_ms, a) = setup(Level::Raid6, 5, 64, &tracer).await;
    let mut model = Model::new(a.size_bytes());
    // QD1 sequential 4 KiB writes: each is hold-worthy, but nothing else is in flight.
    let t0 = Instant::now();
    for k in 0..200u64 {
        let mut b = IoBuf::zeroed(4096);
        rng.fill(b.as_mut_slice());
        model.apply(k * 4096, b.as_slice());
        a.write(k * 4096, b.freeze(), WriteFlags::NONE).await.unwrap();
    }
    let per_write = t0.elapsed() / 200;
    a.set_attribute("preread_bypass_threshold", "0").unwrap();
    let t1 = Instant::now();
    for k in 200..400u64 {
        let mut b = IoBuf::zeroed(4096);
        rng.fill(b.as_mut_slice());
        model.apply(k * 4096, b.as_slice());
        a.write(k * 4096, b.freeze(), WriteFlags::NONE).await.unwrap();
    }
    eprintln!("QD1 sequential 4 KiB write without holding: {:?}", t1.elapsed() / 200);
    a.set_attribute("preread_bypass_threshold", "1").unwrap();
    assert_eq!(attr(&a, "hold_timeouts"), 0, "a QD1 writer's batch is released at once (queue drained)");
    eprintln!(
        "QD1 sequential 4 KiB write: {per_write:?} per write (member latency 25-40 µs), held {} batches",
        attr(&a, "held_batches")
    );
    // Random QD1 writes are never hold-worthy.
    let held = attr(&a, "held_batches");
    for _ in 0..100 {
        random_write(&a, &mut model, &mut rng, 1).await;
    }
    assert_eq!(attr(&a, "held_batches"), held, "random writes are not held");
    verify_all(&a, &model).await;
    a.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_size_is_the_small_write_unit() {
    let mut rng = Rng::new(seed("stripe_size_is_the_small_write_unit", 9));
    let tracer = Tracer::new(16);
    let (_ms, a) = setup(Level::Raid5, 4, 128, &tracer).await;
    let mut model = Model::new(a.size_bytes());
    fill(&a, &mut model, &mut rng).await;
    let mut per_write = Vec::new();
    for (size, unit) in [("4096", 4 * KIB), ("65536", 64 * KIB), ("4096", 4 * KIB)] {
        a.set_attribute("stripe_size", size).unwrap();
        tracer.reset();
        let k = 50;
        for _ in 0..k {
            let off = rng.below(a.size_bytes() / 4096) * 4096;
            let mut b = IoBuf::zeroed(4096);
            rng.fill(b.as_mut_slice());
            model.apply(off, b.as_slice());
            a.write(off, b.freeze(), WriteFlags::NONE).await.unwrap();
        }
        let t = io(&tracer);
        // raid5 on 4: reconstruct-write reads the 2 other data members, writes data + P.
        assert_eq!(t.reads, 2 * k, "stripe_size {size}");
        assert_eq!(t.writes, 2 * k, "stripe_size {size}");
        assert_eq!(t.read_bytes, 2 * k * unit, "stripe_size {size}: reads widened to the unit");
        assert_eq!(t.write_bytes, 2 * k * unit, "stripe_size {size}: writes widened to the unit");
        per_write.push((size, t.read_bytes / k, t.write_bytes / k));
    }
    eprintln!("member bytes per 4 KiB random write (read, written): {per_write:?}");
    verify_all(&a, &model).await;
    let snap = tracer.snapshot().total();
    assert_eq!((snap.writes_below_4k, snap.writes_misaligned_4k), (0, 0));
    a.stop().await.unwrap();
}
