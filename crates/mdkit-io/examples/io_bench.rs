//! Raw `FileDevice` throughput, for comparison with fio's io_uring engine on the same file
//! (`crates/mdkit-io/bench.sh` runs both side by side).
//!
//! ```text
//! cargo run -p mdkit-io --release --example io_bench -- --file /var/tmp/bench.img \
//!     [--runtime-secs 10] [--threads 1] [--workloads randread4k-qd1,randwrite4k-qd32,...]
//! ```
//! Workloads are `<kind><bs>-qd<N>` with kind one of `randread`, `randwrite`, `seqwrite` and
//! bs like `4k` or `1m`. Prints one line per workload:
//! `workload=<name> iops=<n> mib_per_s=<n> lat_avg_us=<n> cpu_us_per_io=<n>` (user + system CPU
//! time of the process per I/O: the overhead measure that survives a busy machine).
//! The file must exist and be at least as large as the region used (the whole file).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{BlockDevice, DirectMode, FileDevice, FileOptions, IoBuf, Rng, SharedBuf, WriteFlags};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RandRead,
    RandWrite,
    SeqWrite,
}

#[derive(Clone, Debug)]
struct Workload {
    name: String,
    kind: Kind,
    block_bytes: u64,
    queue_depth: u32,
}

fn parse_size(s: &str) -> Option<u64> {
    let (num, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1024),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    num.parse::<u64>().ok().map(|n| n * mult)
}

fn parse_workload(s: &str) -> Result<Workload, String> {
    let (head, qd) = s.split_once("-qd").ok_or_else(|| format!("workload {s:?}: expected <kind><bs>-qd<N>"))?;
    let queue_depth: u32 = qd.parse().map_err(|_| format!("workload {s:?}: bad queue depth"))?;
    let (kind, bs) = if let Some(b) = head.strip_prefix("randread") {
        (Kind::RandRead, b)
    } else if let Some(b) = head.strip_prefix("randwrite") {
        (Kind::RandWrite, b)
    } else if let Some(b) = head.strip_prefix("seqwrite") {
        (Kind::SeqWrite, b)
    } else {
        return Err(format!("workload {s:?}: kind must be randread, randwrite or seqwrite"));
    };
    let block_bytes = parse_size(bs).ok_or_else(|| format!("workload {s:?}: bad block size"))?;
    if block_bytes == 0 || block_bytes % 4096 != 0 || queue_depth == 0 {
        return Err(format!("workload {s:?}: block size must be a multiple of 4k, queue depth >= 1"));
    }
    Ok(Workload { name: s.to_string(), kind, block_bytes, queue_depth })
}

struct Args {
    file: String,
    runtime: Duration,
    threads: usize,
    workloads: Vec<Workload>,
}

fn parse_args() -> Result<Args, String> {
    let mut file = None;
    let mut runtime_secs = 10u64;
    let mut threads = 1usize;
    let mut workloads = "randread4k-qd1,randread4k-qd32,randwrite4k-qd1,randwrite4k-qd32,seqwrite1m-qd4".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--file" => file = Some(val()?),
            "--runtime-secs" => runtime_secs = val()?.parse().map_err(|_| "bad --runtime-secs")?,
            "--threads" => threads = val()?.parse().map_err(|_| "bad --threads")?,
            "--workloads" => workloads = val()?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let file = file.ok_or("--file is required")?;
    let workloads = workloads.split(',').map(parse_workload).collect::<Result<Vec<_>, _>>()?;
    Ok(Args { file, runtime: Duration::from_secs(runtime_secs.max(1)), threads: threads.max(1), workloads })
}

async fn run(dev: Arc<FileDevice>, w: Workload, runtime: Duration) -> (u64, Duration) {
    let size = dev.topology().size_bytes;
    let blocks = size / w.block_bytes;
    assert!(blocks > 0, "file smaller than one block");
    let done = Arc::new(AtomicU64::new(0));
    let cursor = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + runtime;
    let mut tasks = Vec::new();
    for t in 0..w.queue_depth {
        let (dev, w, done, cursor) = (dev.clone(), w.clone(), done.clone(), cursor.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(0xbe9c_0000 + u64::from(t));
            let mut data = vec![0u8; w.block_bytes as usize];
            rng.fill(&mut data);
            let wbuf = SharedBuf::from_slice(&data);
            let mut rbuf = IoBuf::zeroed(w.block_bytes as usize);
            let mut n = 0u64;
            while Instant::now() < deadline {
                let block = match w.kind {
                    Kind::SeqWrite => cursor.fetch_add(1, Ordering::Relaxed) % blocks,
                    _ => rng.below(blocks),
                };
                let off = block * w.block_bytes;
                match w.kind {
                    Kind::RandRead => {
                        let (b, r) = dev.read(off, rbuf).await;
                        r.expect("read");
                        rbuf = b;
                    }
                    Kind::RandWrite | Kind::SeqWrite => {
                        dev.write(off, wbuf.clone(), WriteFlags::NONE).await.expect("write")
                    }
                }
                n += 1;
            }
            done.fetch_add(n, Ordering::Relaxed);
        }));
    }
    for t in tasks {
        t.await.expect("bench task");
    }
    (done.load(Ordering::Relaxed), start.elapsed())
}

/// User + system CPU time of this process.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\nusage: io_bench --file PATH [--runtime-secs N] [--threads N] [--workloads LIST]");
            std::process::exit(2);
        }
    };
    let rt = if args.threads == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build()
    }
    .expect("tokio runtime");
    rt.block_on(async {
        for w in &args.workloads {
            let opts =
                FileOptions { direct: DirectMode::Require, queue_depth: w.queue_depth, ..FileOptions::default() };
            let dev = match FileDevice::open(&args.file, opts) {
                Ok(d) => Arc::new(d),
                Err(e) => {
                    eprintln!("io_bench: {e}");
                    std::process::exit(1);
                }
            };
            let cpu_before = cpu_time();
            let (ops, elapsed) = run(dev, w.clone(), args.runtime).await;
            let cpu = cpu_time().saturating_sub(cpu_before);
            let secs = elapsed.as_secs_f64();
            let iops = ops as f64 / secs;
            let mib = iops * w.block_bytes as f64 / f64::from(1 << 20);
            let lat_us = if ops > 0 { secs * 1e6 * f64::from(w.queue_depth) / ops as f64 } else { 0.0 };
            let cpu_us_per_io = if ops > 0 { cpu.as_secs_f64() * 1e6 / ops as f64 } else { 0.0 };
            println!(
                "workload={} iops={:.0} mib_per_s={:.1} lat_avg_us={:.1} cpu_us_per_io={:.2}",
                w.name, iops, mib, lat_us, cpu_us_per_io
            );
        }
    });
}
