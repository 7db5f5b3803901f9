//! Component-level benchmarks of the write-intent bitmap and flush batching on io_uring file
//! members (`bench/bitmap.sh` and `bench/flush.sh` run them side by side with their references).
//!
//! ```text
//! bitmap_bench bitmap --dir DIR --mode bitmap|none --chunk-bytes N --domain-gib G --qd Q
//!                     [--members 2] [--copies 2] [--data-mib 1024] [--secs 10]
//! bitmap_bench flush  --dir DIR --batching on|off --clients C [--members 2] [--secs 5]
//! bitmap_bench array  --dir DIR --level raid1|raid10 --members N --mode bitmap|none
//!                     --chunk-bytes N --qd Q[,Q...] [--secs 10] [--warmup-secs W] [--touch on|off]
//! bitmap_bench array-pair --dir DIR --level raid1|raid10 --members N --chunk-bytes N
//!                     --qd Q[,Q...] [--pairs 7] [--secs 2] [--warmup-secs W] [--touch on|off]
//!                     [--virtual-gib G] [--data-mib M]
//! bitmap_bench array-flush --dir DIR --level raid1|raid10 --members N --batching on|off
//!                     --clients C [--secs 5]
//! ```
//! `array`: an md array (created `--assume-clean`, internal bitmap of `chunk-bytes` chunks or
//! `--bitmap=none`) over the member files `DIR/bitmap-bench-m<i>.img`, Q workers of 4 KiB
//! random writes through `Array::write` for `secs` (after `--warmup-secs` of the same, not
//! counted: the steady state, where the bitmap holds the chunks the workload keeps busy;
//! `--touch on` first writes 4 KiB into every bitmap chunk, in both modes, so the steady state
//! of a workload spread over the whole array is reached without minutes of warm-up). With `--virtual-gib G` each member is
//! presented as G GiB whose data area (from 1 MiB) folds onto the file's pre-written data area
//! (`offset mod data-mib`), so a large array (many bitmap chunks) runs on small files with the
//! same data I/O in both modes; the metadata area (first MiB) is the file's own.
//! `array-flush`: C clients each loop on a 4 KiB write then `Array::flush` (flush batching on or
//! off through the `flush_batching` attribute).
//! `bitmap`: Q workers each loop on one 4 KiB random write of the array — `start_write` on its
//! chunk (mode `bitmap`), one 4 KiB data write to each of `copies` members (chosen per chunk
//! among `members`, raid10-like when copies < members), `end_write` — the work a mirror does
//! around the bitmap, without the rest of the array. The sync domain is `domain-gib` (so the
//! bitmap has as many chunks as an array that size); the data writes land in a pre-written
//! `data-mib` region of each member file at `domain offset mod region`, so both modes do the
//! same data I/O. Mode `none` skips the bitmap (`--bitmap=none`).
//! `flush`: C clients each loop on a 4 KiB write to every member then a flush request through
//! the `FlushBatcher` (a round flushes every member); `--batching off` runs a round per request.
//! `--flush-latency-us N` models a device whose cache flush costs N µs and is serviced one at a
//! time (a wrapper adds that before each member flush); without it the file's own fdatasync
//! cost is all there is.
//!
//! Prints one line `key=value ...` per run. The member files `DIR/bitmap-bench-m<i>.img` must
//! exist and hold at least 1 MiB + `data-mib` (the script prepares them).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{
    BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, IoBuf, IoFuture, MicroTimer, ReadResult, Rng,
    SharedBuf, Topology, Tracer, WriteFlags, ZeroFlags,
};
use mdkit_md::array::bitmap::{BitmapArrayInfo, BitmapCreate, BitmapMember, WriteIntentBitmap};
use mdkit_md::array::flush::FlushBatcher;

const BITMAP_OFFSET_BYTES: u64 = 8192;
const DATA_BASE_BYTES: u64 = 1 << 20;

struct Args {
    command: String,
    dir: String,
    mode_bitmap: bool,
    batching: bool,
    chunk_bytes: u32,
    domain_gib: u64,
    qd: usize,
    /// `--qd` as given: for `array`, a comma-separated list measured one after another on the
    /// same array (each after its own warm-up); the other commands use the first.
    qds: Vec<usize>,
    clients: usize,
    members: usize,
    copies: usize,
    data_mib: u64,
    secs: u64,
    flush_latency_us: u64,
    level: String,
    virtual_gib: u64,
    warmup_secs: u64,
    touch: bool,
    pairs: usize,
    /// `--direct off`: buffered member I/O (e.g. member files on tmpfs: no device noise, the
    /// data path's CPU cost is all there is).
    buffered: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("usage: bitmap_bench bitmap|flush --dir DIR ...")?;
    let mut a = Args {
        command,
        dir: String::new(),
        mode_bitmap: true,
        batching: true,
        chunk_bytes: 64 << 20,
        domain_gib: 1,
        qd: 32,
        qds: vec![32],
        clients: 32,
        members: 2,
        copies: 2,
        data_mib: 1024,
        secs: 10,
        flush_latency_us: 0,
        level: "raid1".into(),
        virtual_gib: 0,
        warmup_secs: 0,
        touch: false,
        pairs: 7,
        buffered: false,
    };
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|_| format!("{k}: '{v}' is not a number"));
        match k.as_str() {
            "--dir" => a.dir = v,
            "--mode" => a.mode_bitmap = v == "bitmap",
            "--batching" => a.batching = v == "on",
            "--chunk-bytes" => a.chunk_bytes = u32::try_from(num(&v)?).map_err(|_| "--chunk-bytes too large")?,
            "--domain-gib" => a.domain_gib = num(&v)?,
            "--qd" => {
                a.qds = v
                    .split(',')
                    .map(num)
                    .collect::<Result<Vec<u64>, String>>()?
                    .into_iter()
                    .map(|q| q as usize)
                    .collect();
                a.qd = a.qds.first().copied().unwrap_or(0);
            }
            "--clients" => a.clients = num(&v)? as usize,
            "--members" => a.members = num(&v)? as usize,
            "--copies" => a.copies = num(&v)? as usize,
            "--data-mib" => a.data_mib = num(&v)?,
            "--secs" => a.secs = num(&v)?,
            "--flush-latency-us" => a.flush_latency_us = num(&v)?,
            "--level" => a.level = v,
            "--virtual-gib" => a.virtual_gib = num(&v)?,
            "--warmup-secs" => a.warmup_secs = num(&v)?,
            "--touch" => a.touch = v == "on",
            "--pairs" => a.pairs = num(&v)? as usize,
            "--direct" => a.buffered = v == "off",
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if a.dir.is_empty()
        || a.members == 0
        || a.copies == 0
        || a.copies > a.members
        || a.qds.contains(&0)
        || a.clients == 0
    {
        return Err("need --dir, members >= copies >= 1, qd >= 1, clients >= 1".into());
    }
    Ok(a)
}

/// A member whose flushes cost `latency` and run one at a time (a device cache flush).
struct SerialFlush {
    inner: DeviceRef,
    latency: Duration,
    timer: MicroTimer,
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl BlockDevice for SerialFlush {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.inner.read(offset_bytes, buf)
    }
    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.write(offset_bytes, buf, flags)
    }
    fn flush(&self) -> IoFuture<'_, std::io::Result<()>> {
        Box::pin(async move {
            let _one = self.one_at_a_time.lock().await;
            self.timer.sleep(self.latency).await;
            self.inner.flush().await
        })
    }
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.discard(offset_bytes, len_bytes)
    }
    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.write_zeroes(offset_bytes, len_bytes, flags)
    }
}

/// A member presented larger than its file: the data area folds onto the file's data area.
struct Folded {
    inner: DeviceRef,
    size_bytes: u64,
    data_bytes: u64,
}

impl Folded {
    fn map(&self, offset_bytes: u64) -> u64 {
        if offset_bytes < DATA_BASE_BYTES {
            offset_bytes
        } else {
            DATA_BASE_BYTES + (offset_bytes - DATA_BASE_BYTES) % self.data_bytes
        }
    }
}

impl BlockDevice for Folded {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topology(&self) -> Topology {
        Topology { size_bytes: self.size_bytes, ..self.inner.topology() }
    }
    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.inner.read(self.map(offset_bytes), buf)
    }
    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, std::io::Result<()>> {
        // The benchmark's writes are single 4 KiB blocks and the region is whole 4 KiB blocks:
        // a request never wraps.
        self.inner.write(self.map(offset_bytes), buf, flags)
    }
    fn flush(&self) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.discard(self.map(offset_bytes), len_bytes)
    }
    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.write_zeroes(self.map(offset_bytes), len_bytes, flags)
    }
}

fn open_members(a: &Args, tracer: &Tracer) -> Result<Vec<DeviceRef>, String> {
    open_member_files(a, tracer, "m")
}

/// Opens `DIR/bitmap-bench-<set><i>.img` for every member (`set` "m", or "b" for the second
/// array of `array-pair`).
fn open_member_files(a: &Args, tracer: &Tracer, set: &str) -> Result<Vec<DeviceRef>, String> {
    (0..a.members)
        .map(|i| {
            let path = format!("{}/bitmap-bench-{set}{i}.img", a.dir);
            let direct = if a.buffered { DirectMode::Off } else { DirectMode::Require };
            let opts = FileOptions { direct, queue_depth: 256, ..FileOptions::default() };
            let dev: DeviceRef = Arc::new(FileDevice::open(&path, opts).map_err(|e| format!("{path}: {e}"))?);
            let dev: DeviceRef = if a.flush_latency_us > 0 {
                Arc::new(SerialFlush {
                    inner: dev,
                    latency: Duration::from_micros(a.flush_latency_us),
                    timer: MicroTimer::new().map_err(|e| e.to_string())?,
                    one_at_a_time: tokio::sync::Mutex::new(()),
                })
            } else {
                dev
            };
            let dev: DeviceRef = Arc::new(tracer.wrap(dev));
            if a.virtual_gib > 0 {
                let folded = Folded { inner: dev, size_bytes: a.virtual_gib << 30, data_bytes: a.data_mib << 20 };
                return Ok(Arc::new(folded) as DeviceRef);
            }
            Ok(dev)
        })
        .collect()
}

/// User + system CPU time of the process (from /proc/self/stat, USER_HZ = 100).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which ends with ')'): state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

async fn bench_bitmap(a: &Args) -> Result<String, String> {
    let tracer = Tracer::new(0);
    let devs = open_members(a, &tracer)?;
    let domain_sectors = a.domain_gib << 21;
    let chunk_sectors = u64::from(a.chunk_bytes) / 512;
    let bm = if a.mode_bitmap {
        let members = devs
            .iter()
            .enumerate()
            .map(|(i, d)| BitmapMember {
                slot: i as u32,
                dev: d.clone(),
                bitmap_offset_bytes: BITMAP_OFFSET_BYTES,
                space_bytes: DATA_BASE_BYTES - BITMAP_OFFSET_BYTES,
            })
            .collect();
        let info = BitmapArrayInfo {
            name: "bench".into(),
            set_uuid: [7; 16],
            events: 1,
            resync_offset_sectors: u64::MAX,
            sync_size_sectors: domain_sectors,
            degraded: false,
        };
        let params = BitmapCreate { all_dirty: false, ..BitmapCreate::new(a.chunk_bytes) };
        let fail: mdkit_md::array::bitmap::FailFn = Arc::new(|slot, e| eprintln!("member {slot} failed: {e}"));
        Some(Arc::new(WriteIntentBitmap::create(members, info, params, fail).await.map_err(|e| e.to_string())?))
    } else {
        None
    };
    let chunks = domain_sectors.div_ceil(chunk_sectors);
    tracer.reset();
    let before = bm.as_ref().map(|b| b.stats());
    let done = Arc::new(AtomicU64::new(0));
    let lat_ns = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let data_bytes = a.data_mib << 20;
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let workers: Vec<_> = (0..a.qd)
        .map(|w| {
            let (bm, devs, done, lat_ns) = (bm.clone(), devs.clone(), done.clone(), lat_ns.clone());
            let (members, copies) = (a.members as u64, a.copies as u64);
            tokio::spawn(async move {
                let mut rng = Rng::new(0xb17 + w as u64);
                let buf = SharedBuf::from_slice(&[w as u8; 4096]);
                while Instant::now() < deadline {
                    let sector = rng.below(domain_sectors / 8) * 8;
                    let range = sector..sector + 8;
                    let t = Instant::now();
                    if let Some(bm) = &bm {
                        bm.start_write(range.clone()).await.expect("start_write");
                    }
                    let chunk = sector / chunk_sectors;
                    let at = DATA_BASE_BYTES + (sector * 512) % data_bytes;
                    for k in 0..copies {
                        let m = ((chunk * copies + k) % members) as usize;
                        devs[m].write(at, buf.clone(), WriteFlags::NONE).await.expect("data write");
                    }
                    if let Some(bm) = &bm {
                        bm.end_write(range, true);
                    }
                    lat_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| e.to_string())?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    let ops = done.load(Ordering::Relaxed);
    let snap = tracer.snapshot().total();
    let (page_writes, dirty, set_rounds) = match (&bm, &before) {
        (Some(b), Some(s0)) => {
            let s = b.stats();
            (s.page_writes - s0.page_writes, s.dirty_chunks, s.set_rounds - s0.set_rounds)
        }
        _ => (0, 0, 0),
    };
    Ok(format!(
        "mode={} chunk_bytes={} chunks={chunks} qd={} members={} copies={} iops={:.0} lat_avg_us={:.1} cpu_us_per_io={:.2} \
         data_writes={ops} bitmap_page_writes={page_writes} bitmap_writes_per_write={:.4} set_rounds={set_rounds} dirty_chunks_at_end={dirty} \
         member_writes={} member_writes_below_4k={} member_writes_misaligned_4k={}",
        if a.mode_bitmap { "bitmap" } else { "none" },
        a.chunk_bytes,
        a.qd,
        a.members,
        a.copies,
        ops as f64 / elapsed,
        lat_ns.load(Ordering::Relaxed) as f64 / ops.max(1) as f64 / 1000.0,
        cpu / ops.max(1) as f64 * 1e6,
        page_writes as f64 / ops.max(1) as f64,
        snap.ops.write.requests,
        snap.writes_below_4k,
        snap.writes_misaligned_4k,
    ))
}

async fn bench_flush(a: &Args) -> Result<String, String> {
    let tracer = Tracer::new(0);
    let devs = Arc::new(open_members(a, &tracer)?);
    let batcher = Arc::new(FlushBatcher::new());
    batcher.set_batching(a.batching);
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let data_bytes = a.data_mib << 20;
    let t0 = Instant::now();
    let clients: Vec<_> = (0..a.clients)
        .map(|c| {
            let (devs, batcher, done) = (devs.clone(), batcher.clone(), done.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(0xf1 + c as u64);
                let buf = SharedBuf::from_slice(&[c as u8; 4096]);
                while Instant::now() < deadline {
                    let at = DATA_BASE_BYTES + rng.below(data_bytes / 4096) * 4096;
                    for d in devs.iter() {
                        d.write(at, buf.clone(), WriteFlags::NONE).await.expect("write");
                    }
                    let round = {
                        let devs = devs.clone();
                        move || async move {
                            for d in devs.iter() {
                                d.flush().await?;
                            }
                            Ok(())
                        }
                    };
                    batcher.flush(round).await.expect("flush");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for c in clients {
        c.await.map_err(|e| e.to_string())?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let st = batcher.stats();
    let member_flushes = tracer.snapshot().total().ops.flush.requests;
    Ok(format!(
        "batching={} clients={} members={} flush_latency_us={} client_flushes_per_s={:.0} requests={} rounds={} member_flushes={member_flushes} \
         member_flushes_per_client_flush={:.4} rounds_per_request={:.4}",
        if a.batching { "on" } else { "off" },
        a.clients,
        a.members,
        a.flush_latency_us,
        done.load(Ordering::Relaxed) as f64 / elapsed,
        st.requests,
        st.rounds,
        member_flushes as f64 / st.requests.max(1) as f64,
        st.rounds as f64 / st.requests.max(1) as f64,
    ))
}

/// Creates an md array over the member files (traced), with or without an internal bitmap.
async fn create_array(a: &Args, tracer: &Tracer, bitmap: bool) -> Result<mdkit_md::array::Array, String> {
    create_array_on(a, tracer, bitmap, "m").await
}

async fn create_array_on(a: &Args, tracer: &Tracer, bitmap: bool, set: &str) -> Result<mdkit_md::array::Array, String> {
    use mdkit_md::array::{CreateOptions, MemberDev, create};
    use mdkit_md::format::create::BitmapRequest;
    use mdkit_md::layout::Level;
    let devs = open_member_files(a, tracer, set)?;
    let level = match a.level.as_str() {
        "raid1" => Level::Raid1,
        "raid10" => Level::Raid10,
        other => return Err(format!("--level {other}: raid1 or raid10")),
    };
    let mut o = CreateOptions::new("bench", level, a.members as u32);
    o.assume_clean = true;
    o.chunk_kib = level.uses_chunks().then_some(512);
    o.bitmap = if bitmap { BitmapRequest::Internal { chunk_bytes: Some(a.chunk_bytes) } } else { BitmapRequest::None };
    let members = devs.into_iter().enumerate().map(|(i, d)| MemberDev::new(format!("m{i}"), d)).collect();
    Ok(create(members, o).await.map_err(|e| format!("create: {e}"))?.array)
}

async fn bench_array(a: &Args) -> Result<String, String> {
    let tracer = Tracer::new(0);
    let array = Arc::new(create_array(a, &tracer, a.mode_bitmap).await?);
    let attr = |n: &str| array.get_attribute(n).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    if a.mode_bitmap {
        clean_bitmap(&array).await?;
    }
    let blocks = array.size_bytes() / 4096;
    let t_touch = Instant::now();
    if a.touch {
        touch_chunks(&array, 32, u64::from(a.chunk_bytes)).await?;
    }
    let touch_secs = t_touch.elapsed().as_secs_f64();
    let mut lines = Vec::new();
    for &qd in &a.qds {
        if a.warmup_secs > 0 {
            random_writes(&array, qd, blocks, Duration::from_secs(a.warmup_secs), 0x3a7 + qd as u64).await?;
        }
        let dirty_at_start = attr("bitmap/dirty_chunks");
        let (pw0, sr0) = (attr("bitmap/page_writes"), attr("bitmap/set_rounds"));
        tracer.reset();
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let (done, lat_ns) = random_writes(&array, qd, blocks, Duration::from_secs(a.secs), 0xa11 + qd as u64).await?;
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let ops = done;
        let snap = tracer.snapshot().total();
        let (page_writes, set_rounds, chunks) =
            (attr("bitmap/page_writes") - pw0, attr("bitmap/set_rounds") - sr0, attr("bitmap/chunks"));
        let dirty_at_end = attr("bitmap/dirty_chunks");
        lines.push(format!(
            "level={} members={} mode={} chunk_bytes={} chunks={chunks} array_gib={:.0} qd={qd} iops={:.0} \
             lat_avg_us={:.1} cpu_us_per_io={:.2} data_writes={ops} bitmap_page_writes={page_writes} \
             bitmap_writes_per_write={:.4} set_rounds={set_rounds} member_writes={} member_writes_below_4k={} \
             member_writes_misaligned_4k={} touch_secs={touch_secs:.1} dirty_chunks_start={dirty_at_start} \
             dirty_chunks_end={dirty_at_end}",
            a.level,
            a.members,
            if a.mode_bitmap { "bitmap" } else { "none" },
            a.chunk_bytes,
            array.size_bytes() as f64 / (1u64 << 30) as f64,
            ops as f64 / elapsed,
            lat_ns as f64 / ops.max(1) as f64 / 1000.0,
            cpu / ops.max(1) as f64 * 1e6,
            page_writes as f64 / ops.max(1) as f64,
            snap.ops.write.requests,
            snap.writes_below_4k,
            snap.writes_misaligned_4k,
        ));
    }
    array.stop().await.map_err(|e| format!("stop: {e}"))?;
    Ok(lines.join("\n"))
}

/// mdadm creates every bit set; start from a clean bitmap (the state after idle time), then
/// run with md's default 5 s period.
async fn clean_bitmap(array: &mdkit_md::array::Array) -> Result<(), String> {
    let attr = |n: &str| array.get_attribute(n).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    array.set_attribute("bitmap/time_base", "0.1").map_err(|e| e.to_string())?;
    for _ in 0..200 {
        if attr("bitmap/dirty_chunks") == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    array.set_attribute("bitmap/time_base", "5").map_err(|e| e.to_string())
}

/// `array-pair`: the `none` array (files `bitmap-bench-m<i>`) and the `bitmap` array (files
/// `bitmap-bench-b<i>`) exist side by side; both are touched (`--touch on`), then run in
/// strictly alternating windows of `secs` — none, bitmap, none, ..., none — first for
/// `--warmup-secs` (not recorded), then `--pairs` bitmap windows each between two recorded none
/// windows, per queue depth; so drift of the disk hits both alike (the ratio of a bitmap window
/// to the mean of its neighbours cancels a linear drift). Windows must stay well below
/// `time_base` (5 s): the bitmap array is idle while the other runs, and a region idle for a
/// whole period is cleared. One line per recorded window (`pair`: its index; none windows
/// 0..=pairs, bitmap windows 0..pairs). `--mode none` gives the second array no bitmap either
/// (an A/A run: what the files and the method alone contribute to the ratio).
async fn bench_array_pair(a: &Args) -> Result<String, String> {
    let tracers = [Tracer::new(0), Tracer::new(0)];
    let arrays = [
        Arc::new(create_array_on(a, &tracers[0], false, "m").await?),
        Arc::new(create_array_on(a, &tracers[1], a.mode_bitmap, "b").await?),
    ];
    if a.mode_bitmap {
        clean_bitmap(&arrays[1]).await?;
    }
    let mut touch_secs = [0.0; 2];
    for (k, array) in arrays.iter().enumerate() {
        let t = Instant::now();
        if a.touch {
            touch_chunks(array, 32, u64::from(a.chunk_bytes)).await?;
        }
        touch_secs[k] = t.elapsed().as_secs_f64();
    }
    let blocks = arrays[0].size_bytes().min(arrays[1].size_bytes()) / 4096;
    let window = Duration::from_secs(a.secs);
    let mut lines = Vec::new();
    for &qd in &a.qds {
        let warm_windows = a.warmup_secs.div_ceil(a.secs.max(1));
        for w in 0..warm_windows {
            for array in &arrays {
                random_writes(array, qd, blocks, window, (0x3a7 + (qd as u64)) << 16 | w).await?;
            }
        }
        let mut windows = Vec::new();
        for pair in 0..a.pairs {
            windows.push((0, pair));
            windows.push((1, pair));
        }
        windows.push((0, a.pairs));
        for (k, pair) in windows {
            let (array, tracer) = (&arrays[k], &tracers[k]);
            let attr = |n: &str| array.get_attribute(n).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let (pw0, dirty0) = (attr("bitmap/page_writes"), attr("bitmap/dirty_chunks"));
            tracer.reset();
            let cpu0 = cpu_seconds();
            let t0 = Instant::now();
            let seed = 0xa11 + ((qd as u64) << 16 | (pair as u64) << 1 | k as u64);
            let (ops, _) = random_writes(array, qd, blocks, window, seed).await?;
            let elapsed = t0.elapsed().as_secs_f64();
            let cpu = cpu_seconds() - cpu0;
            let snap = tracer.snapshot().total();
            lines.push(format!(
                "level={} members={} mode={} chunk_bytes={} chunks={} array_gib={:.0} qd={qd} pair={pair} \
                 iops={:.0} cpu_us_per_io={:.2} data_writes={ops} bitmap_page_writes={} \
                 bitmap_writes_per_write={:.4} member_writes={} member_writes_below_4k={} \
                 member_writes_misaligned_4k={} touch_secs={:.1} dirty_chunks_start={dirty0} \
                 dirty_chunks_end={}",
                a.level,
                a.members,
                if k == 1 { "bitmap" } else { "none" },
                a.chunk_bytes,
                arrays[1].get_attribute("bitmap/chunks").unwrap_or_else(|_| "0".into()),
                array.size_bytes() as f64 / (1u64 << 30) as f64,
                ops as f64 / elapsed,
                cpu / ops.max(1) as f64 * 1e6,
                attr("bitmap/page_writes") - pw0,
                (attr("bitmap/page_writes") - pw0) as f64 / ops.max(1) as f64,
                snap.ops.write.requests,
                snap.writes_below_4k,
                snap.writes_misaligned_4k,
                touch_secs[k],
                attr("bitmap/dirty_chunks"),
            ));
        }
    }
    for array in &arrays {
        array.stop().await.map_err(|e| format!("stop: {e}"))?;
    }
    Ok(lines.join("\n"))
}

/// Pre-conditioning: one 4 KiB write at the start of every bitmap chunk of the array, by `qd`
/// workers — the state a random workload over the whole array reaches once it has been
/// everywhere (on coupon-collector time: minutes for 10^5..10^6 chunks), reached in seconds.
/// The chunks are visited in a scattered order (a multiplicative permutation), as the random
/// workload would, so every idle region stays busy during the pass instead of going quiet
/// (and being cleared) behind a sequential sweep.
async fn touch_chunks(array: &Arc<mdkit_md::array::Array>, qd: usize, chunk_bytes: u64) -> Result<(), String> {
    let chunks = array.size_bytes().div_ceil(chunk_bytes);
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut stride = (0x9e37_79b9 % chunks.max(1)) | 1;
    while gcd(stride, chunks) != 1 {
        stride += 2;
    }
    let next = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..qd)
        .map(|w| {
            let (array, next) = (array.clone(), next.clone());
            tokio::spawn(async move {
                let buf = SharedBuf::from_slice(&[w as u8; 4096]);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= chunks {
                        break;
                    }
                    let c = (u128::from(i) * u128::from(stride) % u128::from(chunks)) as u64;
                    array.write(c * chunk_bytes, buf.clone(), WriteFlags::NONE).await.expect("array write");
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `qd` workers of 4 KiB random writes over `blocks` for `duration`: (writes, summed latency ns).
async fn random_writes(
    array: &Arc<mdkit_md::array::Array>,
    qd: usize,
    blocks: u64,
    duration: Duration,
    seed: u64,
) -> Result<(u64, u64), String> {
    let done = Arc::new(AtomicU64::new(0));
    let lat_ns = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let workers: Vec<_> = (0..qd)
        .map(|w| {
            let (array, done, lat_ns) = (array.clone(), done.clone(), lat_ns.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(seed + w as u64);
                let buf = SharedBuf::from_slice(&[w as u8; 4096]);
                while Instant::now() < deadline {
                    let t = Instant::now();
                    array.write(rng.below(blocks) * 4096, buf.clone(), WriteFlags::NONE).await.expect("array write");
                    lat_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| e.to_string())?;
    }
    Ok((done.load(Ordering::Relaxed), lat_ns.load(Ordering::Relaxed)))
}

async fn bench_array_flush(a: &Args) -> Result<String, String> {
    let tracer = Tracer::new(0);
    let array = Arc::new(create_array(a, &tracer, false).await?);
    array.set_attribute("flush_batching", if a.batching { "1" } else { "0" }).map_err(|e| e.to_string())?;
    let blocks = array.size_bytes() / 4096;
    tracer.reset();
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let t0 = Instant::now();
    let clients: Vec<_> = (0..a.clients)
        .map(|c| {
            let (array, done) = (array.clone(), done.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(0xf1a + c as u64);
                let buf = SharedBuf::from_slice(&[c as u8; 4096]);
                while Instant::now() < deadline {
                    array.write(rng.below(blocks) * 4096, buf.clone(), WriteFlags::NONE).await.expect("write");
                    array.flush().await.expect("flush");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for c in clients {
        c.await.map_err(|e| e.to_string())?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let flushes = done.load(Ordering::Relaxed);
    let member_flushes = tracer.snapshot().total().ops.flush.requests;
    array.stop().await.map_err(|e| format!("stop: {e}"))?;
    Ok(format!(
        "level={} members={} batching={} clients={} client_flushes_per_s={:.0} client_flushes={flushes} \
         member_flushes={member_flushes} member_flushes_per_client_flush={:.4}",
        a.level,
        a.members,
        if a.batching { "on" } else { "off" },
        a.clients,
        flushes as f64 / elapsed,
        member_flushes as f64 / flushes.max(1) as f64,
    ))
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bitmap_bench: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let r = rt.block_on(async {
        match a.command.as_str() {
            "bitmap" => bench_bitmap(&a).await,
            "flush" => bench_flush(&a).await,
            "array" => bench_array(&a).await,
            "array-flush" => bench_array_flush(&a).await,
            "array-pair" => bench_array_pair(&a).await,
            other => Err(format!("unknown command {other}")),
        }
    });
    match r {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("bitmap_bench: {e}");
            std::process::exit(1);
        }
    }
}
