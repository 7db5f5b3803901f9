//! raid5/raid6 write benchmark in-process, on io_uring FileDevice members (`bench/raid5.sh`
//! runs it side by side with the raw member files and prints the table).
//!
//! ```text
//! raid5_bench array --dir DIR --level 5|6 --members N --workload rand4k|seq1m|qd1rand|qd1seq
//!                   [--stripe-size BYTES|default] [--qd Q] [--secs S] [--chunk-kib 512]
//!                   [--member-mib 1024] [--bitmap]
//! raid5_bench raw   --dir DIR --members N [--qd Q] [--secs S] [--member-mib 1024]
//! ```
//! `array` creates the array (`--assume-clean`, mdadm's default chunk 512 KiB, no bitmap
//! unless `--bitmap`) on `DIR/raid5-bench-m<i>.img`, which must exist fully written, and runs Q
//! writers for S seconds: `rand4k` 4 KiB random writes, `seq1m` 1 MiB sequential writes (one
//! shared cursor, wrapping), `qd1rand`/`qd1seq` one writer of 4 KiB. `raw` writes 1 MiB
//! sequentially to every member file at once, Q in flight per file (the reference for `seq1m`).
//! Prints one `key=value` line: MB/s, IOPS, latency (avg, p99), member reads/writes and bytes
//! per client write (a TracedDevice under every member), CPU µs per write, and the array's
//! write-path counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, Rng, SharedBuf, Tracer, WriteFlags};
use mdkit_md::array::{CreateOptions, MemberDev, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::layout::Level;

struct Args {
    command: String,
    dir: String,
    level: u32,
    members: usize,
    workload: String,
    stripe_size: String,
    qd: usize,
    secs: u64,
    chunk_kib: u32,
    member_mib: u64,
    bitmap: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("usage: raid5_bench array|raw --dir DIR ...")?;
    let mut a = Args {
        command,
        dir: String::new(),
        level: 5,
        members: 4,
        workload: "rand4k".into(),
        stripe_size: "default".into(),
        qd: 32,
        secs: 5,
        chunk_kib: 512,
        member_mib: 1024,
        bitmap: false,
    };
    while let Some(k) = it.next() {
        if k == "--bitmap" {
            a.bitmap = true;
            continue;
        }
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|_| format!("{k}: '{v}' is not a number"));
        match k.as_str() {
            "--dir" => a.dir = v,
            "--level" => a.level = num(&v)? as u32,
            "--members" => a.members = num(&v)? as usize,
            "--workload" => a.workload = v,
            "--stripe-size" => a.stripe_size = v,
            "--qd" => a.qd = num(&v)?.max(1) as usize,
            "--secs" => a.secs = num(&v)?,
            "--chunk-kib" => a.chunk_kib = num(&v)? as u32,
            "--member-mib" => a.member_mib = num(&v)?,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.dir.is_empty() {
        return Err("--dir is required".into());
    }
    Ok(a)
}

fn member_path(dir: &str, i: usize) -> String {
    format!("{dir}/raid5-bench-m{i}.img")
}

fn open_member(path: &str) -> Result<FileDevice, String> {
    let opts = FileOptions { direct: DirectMode::Require, queue_depth: 128, ..FileOptions::default() };
    FileDevice::open(path, opts).map_err(|e| format!("{path}: {e}"))
}

/// Process CPU time (user + system), from /proc/self/stat (clock ticks of 10 ms).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may contain spaces) start at ") ".
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

struct Lat {
    buckets_us: Vec<AtomicU64>,
}

impl Lat {
    fn new() -> Lat {
        Lat { buckets_us: (0..200_000).map(|_| AtomicU64::new(0)).collect() }
    }
    fn add(&self, d: Duration) {
        let us = (d.as_micros() as usize).min(self.buckets_us.len() - 1);
        self.buckets_us[us].fetch_add(1, Ordering::Relaxed);
    }
    fn percentile(&self, p: f64) -> u64 {
        let total: u64 = self.buckets_us.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        let want = (total as f64 * p).ceil() as u64;
        let mut seen = 0;
        for (us, b) in self.buckets_us.iter().enumerate() {
            seen += b.load(Ordering::Relaxed);
            if seen >= want {
                return us as u64;
            }
        }
        0
    }
}

async fn run_array(a: &Args) -> Result<String, String> {
    let level = match a.level {
        4 => Level::Raid4,
        5 => Level::Raid5,
        6 => Level::Raid6,
        l => return Err(format!("--level {l}: use 4, 5 or 6")),
    };
    let tracer = Tracer::new(16);
    let mut devs = Vec::new();
    for i in 0..a.members {
        let p = member_path(&a.dir, i);
        let d: DeviceRef = Arc::new(tracer.wrap(open_member(&p)?));
        devs.push(MemberDev::new(p, d));
    }
    let mut o = CreateOptions::new("bench", level, a.members as u32);
    o.chunk_kib = Some(a.chunk_kib);
    o.assume_clean = true;
    o.size_kib = Some(a.member_mib * 1024 - 4096);
    o.bitmap = if a.bitmap { BitmapRequest::Internal { chunk_bytes: None } } else { BitmapRequest::None };
    let array = create(devs, o).await.map_err(|e| e.to_string())?.array;
    if a.stripe_size != "default" {
        array.set_attribute("stripe_size", &a.stripe_size).map_err(|e| e.to_string())?;
    }
    let array = Arc::new(array);
    let stripe_size = array.get_attribute("stripe_size").map_err(|e| e.to_string())?;
    let (bs, qd, sequential) = match a.workload.as_str() {
        "rand4k" => (4096u64, a.qd, false),
        "seq1m" => (1u64 << 20, a.qd, true),
        "qd1rand" => (4096, 1, false),
        "qd1seq" => (4096, 1, true),
        w => return Err(format!("--workload {w}: use rand4k, seq1m, qd1rand or qd1seq")),
    };
    let size = array.size_bytes() / bs * bs;
    let mut data = vec![0u8; bs as usize];
    Rng::new(1).fill(&mut data);
    let data = SharedBuf::from_slice(&data);
    // Warm up (marks the array active), then measure.
    array.write(0, data.clone(), WriteFlags::NONE).await.map_err(|e| e.to_string())?;
    let attrs_before: Vec<(String, String)> = array.attributes();
    tracer.reset();
    let cursor = Arc::new(AtomicU64::new(0));
    let ops = Arc::new(AtomicU64::new(0));
    let lat = Arc::new(Lat::new());
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..qd {
        let (array, cursor, ops, lat, data) = (array.clone(), cursor.clone(), ops.clone(), lat.clone(), data.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(1000 + w as u64);
            while Instant::now() < deadline {
                let off =
                    if sequential { cursor.fetch_add(bs, Ordering::Relaxed) % size } else { rng.below(size / bs) * bs };
                let t = Instant::now();
                array.write(off, data.clone(), WriteFlags::NONE).await.expect("array write");
                lat.add(t.elapsed());
                ops.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = (cpu_time() - cpu0).as_secs_f64();
    let n = ops.load(Ordering::Relaxed).max(1);
    let snap = tracer.snapshot().total();
    let attrs_after = array.attributes();
    let delta = |k: &str| -> u64 {
        let get = |v: &[(String, String)]| {
            v.iter().find(|(x, _)| x == k).and_then(|(_, v)| v.parse::<u64>().ok()).unwrap_or(0)
        };
        get(&attrs_after) - get(&attrs_before)
    };
    let line = format!(
        "mode=array level=raid{} members={} workload={} stripe_size={} qd={} chunk_kib={} bitmap={} \
         mbps={:.1} iops={:.0} lat_avg_us={:.1} lat_p99_us={} member_reads_per_write={:.3} member_writes_per_write={:.3} \
         member_read_kib_per_write={:.1} member_write_kib_per_write={:.1} cpu_us_per_write={:.2} \
         full_stripe_runs={} rmw_runs={} rcw_runs={} batches={} batched_writes={} held_batches={} hold_timeouts={} \
         writes_below_4k={} writes_misaligned={}",
        a.level,
        a.members,
        a.workload,
        stripe_size,
        qd,
        a.chunk_kib,
        a.bitmap,
        n as f64 * bs as f64 / elapsed / 1e6,
        n as f64 / elapsed,
        elapsed * 1e6 * qd as f64 / n as f64,
        lat.percentile(0.99),
        snap.ops.read.requests as f64 / n as f64,
        snap.ops.write.requests as f64 / n as f64,
        snap.ops.read.bytes as f64 / n as f64 / 1024.0,
        snap.ops.write.bytes as f64 / n as f64 / 1024.0,
        cpu * 1e6 / n as f64,
        delta("full_stripe_writes"),
        delta("rmw_writes"),
        delta("rcw_writes"),
        delta("stripe_batches"),
        delta("stripe_batched_writes"),
        delta("held_batches"),
        delta("hold_timeouts"),
        snap.writes_below_4k,
        snap.writes_misaligned_4k,
    );
    array.stop().await.map_err(|e| e.to_string())?;
    Ok(line)
}

async fn run_raw(a: &Args) -> Result<String, String> {
    let bs = 1u64 << 20;
    let mut devs: Vec<Arc<FileDevice>> = Vec::new();
    for i in 0..a.members {
        devs.push(Arc::new(open_member(&member_path(&a.dir, i))?));
    }
    // Skip the first MiB (where an array's metadata would be).
    let size = a.member_mib * (1 << 20) / bs * bs - bs;
    let mut data = vec![0u8; bs as usize];
    Rng::new(2).fill(&mut data);
    let data = SharedBuf::from_slice(&data);
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(a.secs);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for d in &devs {
        let cursor = Arc::new(AtomicU64::new(0));
        for _ in 0..a.qd {
            let (d, cursor, ops, data) = (d.clone(), cursor.clone(), ops.clone(), data.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    let off = bs + cursor.fetch_add(bs, Ordering::Relaxed) % size;
                    d.write(off, data.clone(), WriteFlags::NONE).await.expect("member write");
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed);
    Ok(format!(
        "mode=raw members={} workload=seq1m qd_per_file={} mbps={:.1}",
        a.members,
        a.qd,
        n as f64 * bs as f64 / elapsed / 1e6
    ))
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("raid5_bench: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    let r = rt.block_on(async {
        match args.command.as_str() {
            "array" => run_array(&args).await,
            "raw" => run_raw(&args).await,
            c => Err(format!("unknown command {c}: use array or raw")),
        }
    });
    match r {
        Ok(line) => println!("{line}"),
        Err(e) => {
            eprintln!("raid5_bench: {e}");
            std::process::exit(1);
        }
    }
}
