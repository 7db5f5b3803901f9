//! `TracedDevice`: records every operation on the devices it wraps.
//!
//! One [`Tracer`] (a cheap clonable handle) can wrap many devices — typically every member of an
//! array — and keeps:
//!
//! * a bounded ring of the most recent [`TraceEvent`]s (device, op, offset, length, FUA, start
//!   time, latency, errno), the oldest overwritten first (a count of overwritten events is kept);
//! * per device and per operation: requests, bytes, errors, total/max latency, a power-of-two
//!   size histogram and a power-of-two latency histogram (µs);
//! * per device: FUA writes, writes smaller than 4096 bytes, and writes whose offset or length is
//!   not a multiple of 4096 (md lesson 1: never write less than a member's 4 KiB unit).
//!
//! Counters are atomics per device; only the event ring sits behind a (short) lock, and a ring
//! capacity of 0 disables it. [`Tracer::report`] prints the counters and histograms in the
//! layout of bcc's `biosnoop`/`bitesize`; [`Tracer::snapshot`] returns the same data as plain
//! structs for programs. A request is recorded when it completes; requests rejected by
//! validation are recorded too (they are what a tracer is for), with their errno.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, PerOp, ReadResult, Topology, WriteFlags, ZeroFlags};

/// Power-of-two buckets: bucket `k` counts values in `[2^k, 2^(k+1))`, bucket 0 also counts 0.
pub const HISTOGRAM_BUCKETS: usize = 48;
/// Default number of events kept.
pub const DEFAULT_RING_EVENTS: usize = 65536;
const UNIT_BYTES: u64 = 4096;

fn bucket(v: u64) -> usize {
    if v == 0 { 0 } else { (63 - v.leading_zeros() as usize).min(HISTOGRAM_BUCKETS - 1) }
}

/// One completed operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// Order of completion across the tracer.
    pub seq: u64,
    pub device: Arc<str>,
    pub op: IoOp,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    pub fua: bool,
    /// Start of the request, since the tracer was created.
    pub start: Duration,
    pub latency: Duration,
    /// `None` on success; the errno (or -1 when the error had none) on failure.
    pub errno: Option<i32>,
}

/// Counters of one operation kind on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpTraceStats {
    pub requests: u64,
    pub bytes: u64,
    pub errors: u64,
    pub latency_total: Duration,
    pub latency_max: Duration,
    /// Request sizes: index `k` counts sizes in `[2^k, 2^(k+1))` bytes.
    pub size_histogram: [u64; HISTOGRAM_BUCKETS],
    /// Latencies: index `k` counts latencies in `[2^k, 2^(k+1))` µs.
    pub latency_histogram_us: [u64; HISTOGRAM_BUCKETS],
}

impl Default for OpTraceStats {
    fn default() -> OpTraceStats {
        OpTraceStats {
            requests: 0,
            bytes: 0,
            errors: 0,
            latency_total: Duration::ZERO,
            latency_max: Duration::ZERO,
            size_histogram: [0; HISTOGRAM_BUCKETS],
            latency_histogram_us: [0; HISTOGRAM_BUCKETS],
        }
    }
}

impl OpTraceStats {
    pub fn latency_avg(&self) -> Duration {
        if self.requests == 0 { Duration::ZERO } else { self.latency_total / self.requests as u32 }
    }

    fn add(&mut self, o: &OpTraceStats) {
        self.requests += o.requests;
        self.bytes += o.bytes;
        self.errors += o.errors;
        self.latency_total += o.latency_total;
        self.latency_max = self.latency_max.max(o.latency_max);
        for k in 0..HISTOGRAM_BUCKETS {
            self.size_histogram[k] += o.size_histogram[k];
            self.latency_histogram_us[k] += o.latency_histogram_us[k];
        }
    }
}

/// Counters of one device (or the sum over devices).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceTraceStats {
    pub name: String,
    pub ops: PerOp<OpTraceStats>,
    pub fua_writes: u64,
    /// Writes (IoOp::Write) of fewer than 4096 bytes.
    pub writes_below_4k: u64,
    /// Writes whose offset or length is not a multiple of 4096.
    pub writes_misaligned_4k: u64,
}

/// Everything a tracer knows, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceSnapshot {
    pub elapsed: Duration,
    /// Per device, in wrap order.
    pub devices: Vec<DeviceTraceStats>,
    /// The ring, oldest first.
    pub events: Vec<TraceEvent>,
    /// Events that fell out of the ring.
    pub events_overwritten: u64,
}

impl TraceSnapshot {
    /// Sum over all devices (name "total").
    pub fn total(&self) -> DeviceTraceStats {
        let mut t = DeviceTraceStats { name: "total".to_string(), ..DeviceTraceStats::default() };
        for d in &self.devices {
            for op in IoOp::ALL {
                t.ops.get_mut(op).add(d.ops.get(op));
            }
            t.fua_writes += d.fua_writes;
            t.writes_below_4k += d.writes_below_4k;
            t.writes_misaligned_4k += d.writes_misaligned_4k;
        }
        t
    }

    pub fn device(&self, name: &str) -> Option<&DeviceTraceStats> {
        self.devices.iter().find(|d| d.name == name)
    }
}

//------------------------------------------------------------------------------------------------

struct AtomicHistogram([AtomicU64; HISTOGRAM_BUCKETS]);

impl AtomicHistogram {
    fn new() -> AtomicHistogram {
        AtomicHistogram(std::array::from_fn(|_| AtomicU64::new(0)))
    }
    fn add(&self, v: u64) {
        self.0[bucket(v)].fetch_add(1, Ordering::Relaxed);
    }
    fn load(&self) -> [u64; HISTOGRAM_BUCKETS] {
        std::array::from_fn(|k| self.0[k].load(Ordering::Relaxed))
    }
    fn reset(&self) {
        self.0.iter().for_each(|a| a.store(0, Ordering::Relaxed));
    }
}

struct OpCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    latency_total_ns: AtomicU64,
    latency_max_ns: AtomicU64,
    sizes: AtomicHistogram,
    latencies_us: AtomicHistogram,
}

impl OpCounters {
    fn new() -> OpCounters {
        OpCounters {
            requests: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            latency_total_ns: AtomicU64::new(0),
            latency_max_ns: AtomicU64::new(0),
            sizes: AtomicHistogram::new(),
            latencies_us: AtomicHistogram::new(),
        }
    }

    fn load(&self) -> OpTraceStats {
        OpTraceStats {
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            latency_total: Duration::from_nanos(self.latency_total_ns.load(Ordering::Relaxed)),
            latency_max: Duration::from_nanos(self.latency_max_ns.load(Ordering::Relaxed)),
            size_histogram: self.sizes.load(),
            latency_histogram_us: self.latencies_us.load(),
        }
    }

    fn reset(&self) {
        for a in [&self.requests, &self.bytes, &self.errors, &self.latency_total_ns, &self.latency_max_ns] {
            a.store(0, Ordering::Relaxed);
        }
        self.sizes.reset();
        self.latencies_us.reset();
    }
}

struct DeviceCounters {
    name: Arc<str>,
    ops: PerOp<OpCounters>,
    fua_writes: AtomicU64,
    writes_below_4k: AtomicU64,
    writes_misaligned_4k: AtomicU64,
}

impl DeviceCounters {
    fn new(name: Arc<str>) -> DeviceCounters {
        DeviceCounters {
            name,
            ops: PerOp {
                read: OpCounters::new(),
                write: OpCounters::new(),
                flush: OpCounters::new(),
                discard: OpCounters::new(),
                write_zeroes: OpCounters::new(),
            },
            fua_writes: AtomicU64::new(0),
            writes_below_4k: AtomicU64::new(0),
            writes_misaligned_4k: AtomicU64::new(0),
        }
    }

    fn load(&self) -> DeviceTraceStats {
        let l = |op| self.ops.get(op).load();
        DeviceTraceStats {
            name: self.name.to_string(),
            ops: PerOp {
                read: l(IoOp::Read),
                write: l(IoOp::Write),
                flush: l(IoOp::Flush),
                discard: l(IoOp::Discard),
                write_zeroes: l(IoOp::WriteZeroes),
            },
            fua_writes: self.fua_writes.load(Ordering::Relaxed),
            writes_below_4k: self.writes_below_4k.load(Ordering::Relaxed),
            writes_misaligned_4k: self.writes_misaligned_4k.load(Ordering::Relaxed),
        }
    }
}

struct Ring {
    events: VecDeque<TraceEvent>,
    overwritten: u64,
}

struct TracerInner {
    start: Instant,
    ring_capacity: usize,
    ring: Mutex<Ring>,
    seq: AtomicU64,
    devices: Mutex<Vec<Arc<DeviceCounters>>>,
}

/// Shared trace state: wrap devices with [`Tracer::wrap`], read with [`Tracer::snapshot`] /
/// [`Tracer::report`]. Clone freely.
#[derive(Clone)]
pub struct Tracer {
    inner: Arc<TracerInner>,
}

impl Default for Tracer {
    fn default() -> Tracer {
        Tracer::new(DEFAULT_RING_EVENTS)
    }
}

impl Tracer {
    /// A tracer keeping the last `ring_events` events (0 = counters only).
    pub fn new(ring_events: usize) -> Tracer {
        Tracer {
            inner: Arc::new(TracerInner {
                start: Instant::now(),
                ring_capacity: ring_events,
                ring: Mutex::new(Ring { events: VecDeque::with_capacity(ring_events.min(4096)), overwritten: 0 }),
                seq: AtomicU64::new(0),
                devices: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Wraps `dev`; its events and counters appear under `dev.name()`.
    pub fn wrap<D: BlockDevice>(&self, dev: D) -> TracedDevice<D> {
        let counters = Arc::new(DeviceCounters::new(Arc::from(dev.name())));
        self.inner.devices.lock().push(counters.clone());
        TracedDevice { inner: dev, tracer: self.clone(), counters }
    }

    pub fn snapshot(&self) -> TraceSnapshot {
        let devices = self.inner.devices.lock().iter().map(|d| d.load()).collect();
        let ring = self.inner.ring.lock();
        TraceSnapshot {
            elapsed: self.inner.start.elapsed(),
            devices,
            events: ring.events.iter().cloned().collect(),
            events_overwritten: ring.overwritten,
        }
    }

    /// Writes below 4 KiB over all wrapped devices (what benchmarks print).
    pub fn writes_below_4k(&self) -> u64 {
        self.inner.devices.lock().iter().map(|d| d.writes_below_4k.load(Ordering::Relaxed)).sum()
    }

    /// Writes not aligned to 4 KiB (offset or length) over all wrapped devices.
    pub fn writes_misaligned_4k(&self) -> u64 {
        self.inner.devices.lock().iter().map(|d| d.writes_misaligned_4k.load(Ordering::Relaxed)).sum()
    }

    /// Zeroes all counters and empties the ring (e.g. after a benchmark's warm-up).
    pub fn reset(&self) {
        for d in self.inner.devices.lock().iter() {
            IoOp::ALL.iter().for_each(|&op| d.ops.get(op).reset());
            d.fua_writes.store(0, Ordering::Relaxed);
            d.writes_below_4k.store(0, Ordering::Relaxed);
            d.writes_misaligned_4k.store(0, Ordering::Relaxed);
        }
        let mut ring = self.inner.ring.lock();
        ring.events.clear();
        ring.overwritten = 0;
    }

    /// Counter summary, size and latency histograms, and the last `max_events` events.
    pub fn report(&self, max_events: usize) -> String {
        let snap = self.snapshot();
        let mut out = String::new();
        format_counters(&mut out, &snap);
        for d in &snap.devices {
            for (op, s) in d.ops.iter().filter(|(op, s)| s.requests > 0 && *op != IoOp::Flush) {
                format_histogram(&mut out, &format!("{} {} size", d.name, op.as_str()), "bytes", &s.size_histogram);
            }
        }
        for d in &snap.devices {
            for (op, s) in d.ops.iter().filter(|(_, s)| s.requests > 0) {
                format_histogram(
                    &mut out,
                    &format!("{} {} latency", d.name, op.as_str()),
                    "usecs",
                    &s.latency_histogram_us,
                );
            }
        }
        format_events(&mut out, &snap, max_events);
        out
    }

    fn record(&self, dev: &DeviceCounters, ev: Pending, result: Result<(), i32>) {
        let latency = ev.started.elapsed();
        let c = dev.ops.get(ev.op);
        c.requests.fetch_add(1, Ordering::Relaxed);
        let ns = latency.as_nanos().min(u128::from(u64::MAX)) as u64;
        c.latency_total_ns.fetch_add(ns, Ordering::Relaxed);
        c.latency_max_ns.fetch_max(ns, Ordering::Relaxed);
        c.latencies_us.add(ns / 1000);
        if ev.op != IoOp::Flush {
            c.sizes.add(ev.len_bytes);
        }
        match result {
            Ok(()) => {
                c.bytes.fetch_add(ev.len_bytes, Ordering::Relaxed);
            }
            Err(_) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        if ev.op == IoOp::Write {
            if ev.fua {
                dev.fua_writes.fetch_add(1, Ordering::Relaxed);
            }
            if ev.len_bytes < UNIT_BYTES {
                dev.writes_below_4k.fetch_add(1, Ordering::Relaxed);
            }
            if !ev.offset_bytes.is_multiple_of(UNIT_BYTES) || !ev.len_bytes.is_multiple_of(UNIT_BYTES) {
                dev.writes_misaligned_4k.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.inner.ring_capacity == 0 {
            return;
        }
        let event = TraceEvent {
            seq: self.inner.seq.fetch_add(1, Ordering::Relaxed),
            device: dev.name.clone(),
            op: ev.op,
            offset_bytes: ev.offset_bytes,
            len_bytes: ev.len_bytes,
            fua: ev.fua,
            start: ev.started.saturating_duration_since(self.inner.start),
            latency,
            errno: result.err(),
        };
        let mut ring = self.inner.ring.lock();
        if ring.events.len() == self.inner.ring_capacity {
            ring.events.pop_front();
            ring.overwritten += 1;
        }
        ring.events.push_back(event);
    }
}

fn format_counters(out: &mut String, snap: &TraceSnapshot) {
    let _ = writeln!(
        out,
        "{:<20} {:<13} {:>10} {:>14} {:>7} {:>10} {:>10}",
        "DEVICE", "OP", "REQUESTS", "BYTES", "ERRORS", "AVG(us)", "MAX(us)"
    );
    let total = snap.total();
    let all: Vec<&DeviceTraceStats> = snap.devices.iter().chain((snap.devices.len() > 1).then_some(&total)).collect();
    for d in &all {
        for (op, s) in d.ops.iter().filter(|(_, s)| s.requests > 0) {
            let _ = writeln!(
                out,
                "{:<20} {:<13} {:>10} {:>14} {:>7} {:>10.1} {:>10.1}",
                d.name,
                op.as_str(),
                s.requests,
                s.bytes,
                s.errors,
                s.latency_avg().as_secs_f64() * 1e6,
                s.latency_max.as_secs_f64() * 1e6
            );
        }
    }
    for d in &all {
        let _ = writeln!(
            out,
            "{}: fua writes: {}, member writes < 4 KiB: {}, writes not 4 KiB-aligned: {}",
            d.name, d.fua_writes, d.writes_below_4k, d.writes_misaligned_4k
        );
    }
}

/// bcc-style histogram: `lo -> hi : count |****|`.
fn format_histogram(out: &mut String, title: &str, unit: &str, hist: &[u64; HISTOGRAM_BUCKETS]) {
    let Some(last) = hist.iter().rposition(|&c| c > 0) else { return };
    let first = hist.iter().position(|&c| c > 0).unwrap_or(0);
    let max = hist.iter().copied().max().unwrap_or(1).max(1);
    let _ = writeln!(out, "\n{title}");
    let _ = writeln!(out, "{:>24} : {:<9} distribution", unit, "count");
    for (k, &count) in hist.iter().enumerate().take(last + 1).skip(first) {
        let lo = if k == 0 { 0 } else { 1u64 << k };
        let hi = (1u64 << (k + 1)) - 1;
        let stars = (count * 40).div_ceil(max) as usize;
        let _ = writeln!(out, "{:>10} -> {:<10} : {:<9} |{:<40}|", lo, hi, count, "*".repeat(stars.min(40)));
    }
}

/// biosnoop-style event lines.
fn format_events(out: &mut String, snap: &TraceSnapshot, max_events: usize) {
    if max_events == 0 || snap.events.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\n{:<12} {:<20} {:<13} {:>14} {:>10} {:<4} {:>10} ERR",
        "TIME(s)", "DEVICE", "OP", "OFFSET(B)", "BYTES", "FUA", "LAT(us)"
    );
    let skip = snap.events.len().saturating_sub(max_events);
    for e in snap.events.iter().skip(skip) {
        let _ = writeln!(
            out,
            "{:<12.6} {:<20} {:<13} {:>14} {:>10} {:<4} {:>10.1} {}",
            e.start.as_secs_f64(),
            e.device,
            e.op.as_str(),
            e.offset_bytes,
            e.len_bytes,
            if e.fua { "F" } else { "-" },
            e.latency.as_secs_f64() * 1e6,
            e.errno.map_or_else(|| "-".to_string(), |n| n.to_string())
        );
    }
}

//------------------------------------------------------------------------------------------------

struct Pending {
    op: IoOp,
    offset_bytes: u64,
    len_bytes: u64,
    fua: bool,
    started: Instant,
}

fn errno_of(e: &io::Error) -> i32 {
    crate::error::DeviceError::errno_of(e).unwrap_or(-1)
}

/// A device whose every request is recorded by a [`Tracer`].
pub struct TracedDevice<D> {
    inner: D,
    tracer: Tracer,
    counters: Arc<DeviceCounters>,
}

impl<D: BlockDevice> TracedDevice<D> {
    /// Wraps `inner` with a tracer of its own (default ring size).
    pub fn new(inner: D) -> TracedDevice<D> {
        Tracer::default().wrap(inner)
    }

    pub fn tracer(&self) -> Tracer {
        self.tracer.clone()
    }

    /// This device's counters only.
    pub fn stats(&self) -> DeviceTraceStats {
        self.counters.load()
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    pub fn into_inner(self) -> D {
        self.inner
    }

    fn pending(op: IoOp, offset_bytes: u64, len_bytes: u64, fua: bool) -> Pending {
        Pending { op, offset_bytes, len_bytes, fua, started: Instant::now() }
    }

    fn traced<'a>(&'a self, p: Pending, fut: IoFuture<'a, io::Result<()>>) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let r = fut.await;
            self.tracer.record(&self.counters, p, r.as_ref().map(|_| ()).map_err(errno_of));
            r
        })
    }
}

impl<D: BlockDevice> BlockDevice for TracedDevice<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn topology(&self) -> Topology {
        self.inner.topology()
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        let p = Self::pending(IoOp::Read, offset_bytes, buf.len() as u64, false);
        let fut = self.inner.read(offset_bytes, buf);
        Box::pin(async move {
            let (buf, r) = fut.await;
            self.tracer.record(&self.counters, p, r.as_ref().map(|_| ()).map_err(errno_of));
            (buf, r)
        })
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        let p = Self::pending(IoOp::Write, offset_bytes, buf.len() as u64, flags.fua);
        self.traced(p, self.inner.write(offset_bytes, buf, flags))
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        let p = Self::pending(IoOp::Flush, 0, 0, false);
        self.traced(p, self.inner.flush())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        let p = Self::pending(IoOp::Discard, offset_bytes, len_bytes, false);
        self.traced(p, self.inner.discard(offset_bytes, len_bytes))
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        let p = Self::pending(IoOp::WriteZeroes, offset_bytes, len_bytes, flags.fua);
        self.traced(p, self.inner.write_zeroes(offset_bytes, len_bytes, flags))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BlockDeviceExt;
    use crate::mem::MemDevice;
    use crate::rng::Rng;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    #[test]
    fn bucket_edges() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 0);
        assert_eq!((bucket(511), bucket(512), bucket(4095), bucket(4096), bucket(8191)), (8, 9, 11, 12, 12));
        assert_eq!(bucket(u64::MAX), HISTOGRAM_BUCKETS - 1);
    }

    /// Random requests against two traced devices; every counter equals what the test issued.
    #[test]
    fn counters_and_histograms_match_what_was_issued() {
        block_on(async {
            let tracer = Tracer::new(100);
            let a = tracer.wrap(MemDevice::new("a", 1 << 22));
            let b = tracer.wrap(MemDevice::new("b", 1 << 22));
            let mut rng = Rng::new(77);
            let mut want: Vec<DeviceTraceStats> =
                ["a", "b"].iter().map(|n| DeviceTraceStats { name: n.to_string(), ..Default::default() }).collect();
            let mut issued = 0u64;
            for _ in 0..500 {
                let which = rng.below(2) as usize;
                let dev = if which == 0 { &a } else { &b };
                let w = &mut want[which];
                let len = (1 + rng.below(32)) * 512;
                let off = rng.below((1 << 22) / 512 - 32) * 512;
                let bad = rng.chance(1, 20);
                let off = if bad { (1 << 22) - 512 } else { off }; // runs past the end when len > 512
                let fails = bad && len > 512;
                let s = |w: &mut DeviceTraceStats, op| {
                    let s = w.ops.get_mut(op);
                    s.requests += 1;
                    if fails {
                        s.errors += 1;
                    } else {
                        s.bytes += len;
                    }
                    s.size_histogram[bucket(len)] += 1;
                };
                match rng.below(5) {
                    0 => {
                        assert_eq!(dev.read_vec(off, len as usize).await.is_err(), fails);
                        s(w, IoOp::Read);
                    }
                    1 | 2 => {
                        let fua = rng.chance(1, 3);
                        let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
                        assert_eq!(dev.write_slice(off, &vec![1u8; len as usize], flags).await.is_err(), fails);
                        s(w, IoOp::Write);
                        w.fua_writes += u64::from(fua);
                        w.writes_below_4k += u64::from(len < 4096);
                        w.writes_misaligned_4k += u64::from(!off.is_multiple_of(4096) || !len.is_multiple_of(4096));
                    }
                    3 => {
                        dev.flush().await.unwrap();
                        w.ops.flush.requests += 1;
                    }
                    _ => {
                        assert_eq!(dev.discard(off, len).await.is_err(), fails);
                        s(w, IoOp::Discard);
                    }
                }
                issued += 1;
            }
            let snap = tracer.snapshot();
            for (got, want) in snap.devices.iter().zip(&want) {
                assert_eq!(got.name, want.name);
                assert_eq!(got.fua_writes, want.fua_writes);
                assert_eq!(got.writes_below_4k, want.writes_below_4k);
                assert_eq!(got.writes_misaligned_4k, want.writes_misaligned_4k);
                for op in IoOp::ALL {
                    let (g, w) = (got.ops.get(op), want.ops.get(op));
                    assert_eq!((g.requests, g.bytes, g.errors), (w.requests, w.bytes, w.errors), "{} {op:?}", got.name);
                    assert_eq!(g.size_histogram, w.size_histogram, "{} {op:?}", got.name);
                    assert_eq!(g.latency_histogram_us.iter().sum::<u64>(), w.requests);
                }
            }
            let total = snap.total();
            let total_requests: u64 = total.ops.iter().map(|(_, s)| s.requests).sum();
            assert_eq!(total_requests, issued);
            assert_eq!(snap.events.len(), 100, "ring is bounded");
            assert_eq!(snap.events_overwritten, issued - 100);
            assert!(snap.events.windows(2).all(|w| w[0].seq + 1 == w[1].seq));
            assert_eq!(tracer.writes_below_4k(), want[0].writes_below_4k + want[1].writes_below_4k);
            let report = tracer.report(5);
            assert!(report.contains("member writes < 4 KiB:"), "{report}");
            assert!(report.contains("a write size"), "{report}");
            assert!(report.contains("TIME(s)"), "{report}");
            tracer.reset();
            assert_eq!(tracer.snapshot().total().ops.write.requests, 0);
        });
    }

    #[test]
    fn events_carry_op_details() {
        block_on(async {
            let d = TracedDevice::new(MemDevice::new("m0", 1 << 20));
            d.write_slice(4096, &[1u8; 8192], WriteFlags::FUA).await.unwrap();
            d.write_zeroes(0, 4096, ZeroFlags { fua: true, no_unmap: false }).await.unwrap();
            let _ = d.read_vec(1 << 20, 512).await;
            let ev = d.tracer().snapshot().events;
            assert_eq!(ev.len(), 3);
            assert_eq!((ev[0].op, ev[0].offset_bytes, ev[0].len_bytes, ev[0].fua), (IoOp::Write, 4096, 8192, true));
            assert_eq!(ev[0].errno, None);
            assert_eq!((ev[1].op, ev[1].fua), (IoOp::WriteZeroes, true));
            assert_eq!(ev[2].op, IoOp::Read);
            assert_eq!(ev[2].errno, Some(-1), "validation failure recorded");
            assert_eq!(&*ev[0].device, "m0");
            assert_eq!(d.stats().writes_below_4k, 0);
        });
    }
}
