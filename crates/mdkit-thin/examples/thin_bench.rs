//! In-process benchmark of the thin-pool runtime against the plain data device, same file,
//! same `FileDevice` (io_uring, O_DIRECT), same workload generator, one run (bench/thin.sh
//! calls it next to the NBD runs):
//!
//! * 4 KiB random writes with FUA on every write, QD32 (the upstream "O_SYNC IOs to mapped
//!   data" case), 4 KiB random writes without FUA, 4 KiB random reads — on a fully provisioned
//!   thin volume vs the raw data file over the same range;
//! * first-write provisioning rate (4 KiB writes, each to a new block) with and without
//!   zeroing of new blocks.
//!
//! ```text
//! cargo run --release -p mdkit-thin --example thin_bench -- \
//!     [--dir /var/tmp/mdkit-bench-thin] [--size-mib 1024] [--seconds 10] [--qd 32] \
//!     [--reps 2] [--threads 2] [--provision-blocks 4096] [--direct auto|require|off] [--ram] \\
//!     [--workloads fua,write,flush,read,provision] [--profile thin|plain]
//! ```
//! `--ram` puts both devices on `MemDevice` RAM disks: no device cost, so the difference is the
//! thin layer's CPU cost per request. `--workloads fua,write,flush,read,provision` picks workloads and `--profile
//! thin|plain` runs one side only (for `perf record`; no ratios). `--threads` data-path threads carry the load the way
//! `mdkit serve` does: one current-thread runtime each, with an io_uring per thread and member.
//!
//! Prints one line per run and a table: median IOPS per side, the median of the per-run
//! thin/plain ratios (runs alternate plain-thin, thin-plain) with its 95% bootstrap interval,
//! and the median CPU time of the whole process per I/O on each side (user + system, and user
//! alone, from /proc/self/stat). On a disk whose speed drifts (a VM's), many short runs
//! (`--seconds 1 --reps 61`) pin the ratio down far better than a few long ones: one pair
//! then spans two seconds of drift instead of ten.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, IoBuf, Rng, SharedBuf, WriteFlags};
use mdkit_thin::pool::{Pool, PoolOptions};

const BLOCK_BYTES: u64 = 64 << 10;
const IO_BYTES: u64 = 4096;

struct Args {
    dir: PathBuf,
    size_bytes: u64,
    seconds: u64,
    qd: usize,
    reps: usize,
    threads: usize,
    provision_blocks: u64,
    direct: DirectMode,
    /// RAM disks instead of files: the CPU cost of the thin layer alone.
    ram: bool,
    /// Workloads to run (names as in `Op::key`).
    workloads: Vec<String>,
    /// Run only this side ("thin" or "plain"), for profiling.
    profile: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp/mdkit-bench-thin"),
        size_bytes: 1 << 30,
        seconds: 10,
        qd: 32,
        reps: 2,
        threads: 2,
        provision_blocks: 4096,
        direct: DirectMode::Auto,
        ram: false,
        workloads: ["fua", "write", "read", "provision"].map(String::from).to_vec(),
        profile: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        let num = |s: String| s.parse::<u64>().map_err(|e| format!("{s}: {e}"));
        match k.as_str() {
            "--dir" => a.dir = PathBuf::from(v()?),
            "--size-mib" => a.size_bytes = num(v()?)? << 20,
            "--seconds" => a.seconds = num(v()?)?,
            "--qd" => a.qd = num(v()?)? as usize,
            "--reps" => a.reps = num(v()?)? as usize,
            "--threads" => a.threads = num(v()?)? as usize,
            "--provision-blocks" => a.provision_blocks = num(v()?)?,
            "--ram" => a.ram = true,
            "--workloads" => a.workloads = v()?.split(',').map(str::to_string).collect(),
            "--profile" => {
                let side = v()?;
                if side != "thin" && side != "plain" {
                    return Err(format!("--profile {side}: thin or plain"));
                }
                a.profile = Some(side);
            }
            "--direct" => {
                a.direct = match v()?.as_str() {
                    "auto" => DirectMode::Auto,
                    "require" => DirectMode::Require,
                    "off" => DirectMode::Off,
                    o => return Err(format!("--direct {o}: auto, require or off")),
                }
            }
            "-h" | "--help" => return Err("usage: thin_bench [--dir D] [--size-mib N] [--seconds S] [--qd N] [--reps N] [--threads N] [--provision-blocks N] [--direct auto|require|off] [--ram] [--workloads fua,write,flush,read,provision] [--profile thin|plain]".into()),
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    if !a.size_bytes.is_multiple_of(BLOCK_BYTES) || a.size_bytes == 0 || a.qd == 0 || a.reps == 0 || a.threads == 0 {
        return Err("size must be a non-zero multiple of 64 KiB; qd, reps, threads > 0".into());
    }
    Ok(a)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    ReadRandom,
    WriteRandom {
        fua: bool,
    },
    /// A write, then a flush once it completed (fio's `--fsync=1`, the O_SYNC case over NBD).
    WriteFlush,
}

/// `qd` tasks, each issuing one 4 KiB request at a time at random aligned offsets in
/// `[0, span)`, for `seconds`. Returns IOPS.
/// CPU time the whole process used so far, in µs: (user, user + system), from /proc/self/stat
/// (clock ticks of USER_HZ = 100 on Linux); 0 where unreadable.
fn process_cpu_us() -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return (0.0, 0.0) };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return (0.0, 0.0) };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) * 10_000.0, (ticks(11) + ticks(12)) * 10_000.0)
}

/// One timed run: IOPS and the whole process's CPU µs per I/O (user, user + system).
///
/// The load runs the way `mdkit serve` runs its data path (mdkit-nbd's connection threads):
/// `threads` OS threads, each driving a current-thread runtime with its own io_uring per
/// member (`enable_thread_rings`), `qd / threads` request loops on each. The pool's commit
/// timer and metadata worker stay on the main runtime, as in the service.
async fn run(
    dev: DeviceRef,
    op: Op,
    span_bytes: u64,
    qd: usize,
    threads: usize,
    seconds: u64,
    seed: u64,
) -> (f64, (f64, f64)) {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let mut joins = Vec::new();
    for k in 0..threads {
        // Request loops dealt round-robin over the threads.
        let loops: Vec<usize> = (0..qd).filter(|t| t % threads == k).collect();
        let (dev, stop, done, ready_tx) = (dev.clone(), stop.clone(), done.clone(), ready_tx.clone());
        joins.push(std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            mdkit_io::enable_thread_rings();
            rt.block_on(async move {
                let mut tasks = Vec::new();
                for t in loops {
                    let (dev, stop, done) = (dev.clone(), stop.clone(), done.clone());
                    tasks.push(tokio::spawn(request_loop(
                        dev,
                        op,
                        span_bytes,
                        seed ^ (t as u64 * 0x9e37),
                        t,
                        stop,
                        done,
                    )));
                }
                let _ = ready_tx.send(());
                for t in tasks {
                    t.await.expect("request loop");
                }
            });
        }));
    }
    drop(ready_tx);
    for _ in 0..threads {
        ready_rx.recv().expect("data-path thread started");
    }
    let (t0, cpu0) = (Instant::now(), process_cpu_us());
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || {
        for j in joins {
            j.join().expect("data-path thread");
        }
    })
    .await
    .unwrap();
    let ios = done.load(Ordering::Relaxed) as f64;
    let cpu1 = process_cpu_us();
    let per_io = |a: f64, b: f64| (b - a) / ios.max(1.0);
    (ios / t0.elapsed().as_secs_f64(), (per_io(cpu0.0, cpu1.0), per_io(cpu0.1, cpu1.1)))
}

/// One request at a time at random aligned offsets in `[0, span)` until `stop`.
async fn request_loop(
    dev: DeviceRef,
    op: Op,
    span_bytes: u64,
    seed: u64,
    t: usize,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) {
    let mut rng = Rng::new(seed);
    let data = SharedBuf::from_slice(&vec![0xa5u8 ^ t as u8; IO_BYTES as usize]);
    let mut buf = IoBuf::zeroed(IO_BYTES as usize);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let off = rng.below(span_bytes / IO_BYTES) * IO_BYTES;
        match op {
            Op::ReadRandom => {
                let (b, r) = dev.read(off, buf).await;
                r.expect("read");
                buf = b;
            }
            Op::WriteRandom { fua } => dev.write(off, data.clone(), WriteFlags { fua }).await.expect("write"),
            Op::WriteFlush => {
                dev.write(off, data.clone(), WriteFlags::NONE).await.expect("write");
                dev.flush().await.expect("flush");
            }
        }
        n += 1;
        // RAM disks complete at once: give the scheduler (and the timer) a turn now and then,
        // equally on both sides.
        tokio::task::consume_budget().await;
    }
    done.fetch_add(n, Ordering::Relaxed);
}

/// First writes: `blocks` 4 KiB writes, each to a different unprovisioned block (random
/// order), QD `qd`. Returns provisions per second.
async fn provision_rate(vol: DeviceRef, blocks: u64, qd: usize) -> f64 {
    let mut order: Vec<u64> = (0..blocks).collect();
    let mut rng = Rng::new(77);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let order = Arc::new(order);
    let next = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..qd {
        let (vol, order, next) = (vol.clone(), order.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let data = SharedBuf::from_slice(&[0x5au8; IO_BYTES as usize]);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&b) = order.get(i) else { break };
                vol.write(b * BLOCK_BYTES + 8192, data.clone(), WriteFlags::NONE).await.expect("first write");
                tokio::task::consume_budget().await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    vol.flush().await.expect("flush");
    blocks as f64 / t0.elapsed().as_secs_f64()
}

fn open(path: &Path, direct: DirectMode) -> DeviceRef {
    // Flush batching on, as `mdkit serve` opens file volumes and pool devices.
    let opts = FileOptions { direct, queue_depth: 256, flush_batching: true, ..FileOptions::default() };
    let d = FileDevice::open(path, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if let Some(why) = d.direct_fallback_reason() {
        eprintln!("{}: buffered I/O ({why})", path.display());
    }
    Arc::new(d)
}

fn fresh(path: &Path, size: u64) {
    let _ = std::fs::remove_file(path);
    FileDevice::create_sparse(path, size).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// 95% bootstrap interval of the median of `v` (percentile method, 4000 resamples, fixed
/// seed): how far this run's pairs pin the median down. With one run per pair the interval
/// is only as good as the pairs are independent — which is why pairs alternate their order.
fn median_interval(v: &[f64]) -> (f64, f64) {
    const RESAMPLES: usize = 4000;
    let mut rng = Rng::new(0x5eed);
    let mut medians: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let mut s: Vec<f64> = (0..v.len()).map(|_| v[rng.below(v.len() as u64) as usize]).collect();
            median(&mut s)
        })
        .collect();
    medians.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (medians[RESAMPLES * 25 / 1000], medians[RESAMPLES * 975 / 1000 - 1])
}

async fn bench(a: Args) {
    std::fs::create_dir_all(&a.dir).unwrap();
    let data_path = a.dir.join("thin-bench.data");
    let data_bytes = a.size_bytes.max(a.provision_blocks * BLOCK_BYTES);
    if !a.ram && std::fs::metadata(&data_path).map(|m| m.len()).ok() != Some(data_bytes) {
        // Written once in full: no holes or unwritten extents on either side.
        eprintln!("writing {} MiB data file {}", data_bytes >> 20, data_path.display());
        fresh(&data_path, data_bytes);
        let d = open(&data_path, a.direct);
        let chunk = SharedBuf::from_slice(&vec![1u8; 1 << 20]);
        let mut off = 0;
        while off < data_bytes {
            d.write(off, chunk.clone(), WriteFlags::NONE).await.unwrap();
            off += 1 << 20;
        }
        d.flush().await.unwrap();
    }
    let (data, data_is_direct): (DeviceRef, bool) = if a.ram {
        let m = mdkit_io::MemDevice::new("ram-data", data_bytes);
        m.write_bytes(0, &vec![1u8; data_bytes as usize]);
        (Arc::new(m), false)
    } else {
        // The plain side and the pool's data device; flush batching on, as in `mdkit serve`.
        let opts = FileOptions { direct: a.direct, queue_depth: 256, flush_batching: true, ..FileOptions::default() };
        let f = FileDevice::open(&data_path, opts).unwrap();
        let direct = f.is_direct();
        (Arc::new(f), direct)
    };
    let meta_dev = |path: &Path| -> DeviceRef {
        if a.ram {
            Arc::new(mdkit_io::MemDevice::new("ram-meta", 64 << 20))
        } else {
            fresh(path, 64 << 20);
            open(path, a.direct)
        }
    };
    let quiet = PoolOptions { commit_interval: Duration::from_secs(1), ..PoolOptions::default() };

    // First-write provisioning, with and without zeroing.
    let mut prov = Vec::new();
    let provision = a.workloads.iter().any(|w| w == "provision");
    for zero in [true, false].into_iter().filter(|_| provision) {
        let opts = PoolOptions { zero_new_blocks: zero, ..quiet };
        let pool = Pool::create("prov", meta_dev(&a.dir.join("thin-bench-prov.meta")), data.clone(), BLOCK_BYTES, opts)
            .await
            .unwrap();
        pool.create_thin(0).await.unwrap();
        let vol: DeviceRef = Arc::new(pool.thin(0, a.provision_blocks * BLOCK_BYTES).await.unwrap());
        let rate = provision_rate(vol.clone(), a.provision_blocks, a.qd).await;
        println!("run provision zeroing={zero}: {rate:.0} blocks/s");
        prov.push(rate);
        drop(vol);
        pool.close().await.unwrap();
    }

    // The pool under test: one volume over the whole range, provisioned by sequential 1 MiB
    // writes (linear allocation: virtual block i is data block i).
    let pool = Pool::create("bench", meta_dev(&a.dir.join("thin-bench.meta")), data.clone(), BLOCK_BYTES, quiet)
        .await
        .unwrap();
    pool.create_thin(0).await.unwrap();
    let thin: DeviceRef = Arc::new(pool.thin(0, a.size_bytes).await.unwrap());
    let t0 = Instant::now();
    let chunk = SharedBuf::from_slice(&vec![1u8; 1 << 20]);
    let mut off = 0;
    while off < a.size_bytes {
        thin.write(off, chunk.clone(), WriteFlags::NONE).await.unwrap();
        off += 1 << 20;
    }
    thin.flush().await.unwrap();
    println!(
        "provisioned {} MiB in {:.2} s (full-block writes, no zeroing needed)",
        a.size_bytes >> 20,
        t0.elapsed().as_secs_f64()
    );

    let workloads = [
        ("fua", "randwrite 4k QD32 FUA", Op::WriteRandom { fua: true }),
        ("write", "randwrite 4k QD32", Op::WriteRandom { fua: false }),
        ("flush", "randwrite 4k QD32 + flush each", Op::WriteFlush),
        ("read", "randread 4k QD32", Op::ReadRandom),
    ];
    // One side only when profiling: the other's runs are skipped (reported as 0).
    let side = |dev: &DeviceRef, which: &str, op: Op, rep: usize| {
        let skip = a.profile.as_deref().is_some_and(|p| p != which);
        let (dev, span, qd, threads, seconds) = (dev.clone(), a.size_bytes, a.qd, a.threads, a.seconds);
        async move { if skip { (0.0, (0.0, 0.0)) } else { run(dev, op, span, qd, threads, seconds, rep as u64).await } }
    };
    let mut rows = Vec::new();
    for (key, name, op) in workloads {
        if !a.workloads.iter().any(|w| w == key) {
            continue;
        }
        let (mut plain, mut thin_iops, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut plain_cpu, mut thin_cpu) = (Vec::new(), Vec::new());
        for rep in 0..a.reps {
            // Interleaved, the order flipping every rep, so drift of the disk hits both sides
            // alike; the ratio reported is the median of the per-rep ratios.
            let ((p, pc), (t, tc)) = if rep % 2 == 0 {
                let p = side(&data, "plain", op, rep).await;
                (p, side(&thin, "thin", op, rep).await)
            } else {
                let t = side(&thin, "thin", op, rep).await;
                (side(&data, "plain", op, rep).await, t)
            };
            println!(
                "run {name} rep {rep}: plain {p:.0} IOPS {:.2} cpu us/io ({:.2} user), thin {t:.0} IOPS {:.2} cpu us/io ({:.2} user) ({:.3})",
                pc.1,
                pc.0,
                tc.1,
                tc.0,
                t / p
            );
            plain.push(p);
            thin_iops.push(t);
            ratios.push(t / p);
            plain_cpu.push(pc);
            thin_cpu.push(tc);
        }
        let med = |v: &Vec<(f64, f64)>, total: bool| {
            let mut x: Vec<f64> = v.iter().map(|c| if total { c.1 } else { c.0 }).collect();
            median(&mut x)
        };
        let cpu = (med(&plain_cpu, true), med(&thin_cpu, true), med(&plain_cpu, false), med(&thin_cpu, false));
        let interval = median_interval(&ratios);
        rows.push((name, median(&mut plain), median(&mut thin_iops), median(&mut ratios), interval, cpu));
    }
    let st = pool.status().await.unwrap();
    println!("pool status: {st}");
    println!(
        "fast path: {} reads, {} writes; slow-path ops {}; commits {}",
        st.counters.volumes.fast_reads,
        st.counters.volumes.fast_writes,
        st.counters.volumes.slow_ops,
        st.counters.commits
    );
    drop(thin);
    pool.close().await.unwrap();

    println!();
    let io = match a.direct {
        _ if a.ram => "RAM disk (MemDevice), not a",
        DirectMode::Off => "buffered",
        _ if data_is_direct => "O_DIRECT",
        _ => "buffered (O_DIRECT unavailable)",
    };
    println!(
        "in-process, {} tasks (QD{}), {} s x {} runs (IOPS: medians; thin/plain: median of per-run ratios with its 95% bootstrap interval), {} MiB span, 64 KiB blocks, {io} file {}, {} data-path threads (current-thread runtimes, io_uring per thread, as in mdkit serve)",
        a.qd,
        a.qd,
        a.seconds,
        a.reps,
        a.size_bytes >> 20,
        data_path.display(),
        a.threads
    );
    println!(
        "{:<24}{:>14}{:>14}{:>11} {:<14}{:>16}{:>14}   upstream dm-thin/linear",
        "workload", "plain IOPS", "thin IOPS", "thin/plain", "95% interval", "cpu us/io p/t", "user p/t"
    );
    for (name, p, t, ratio, (lo, hi), (pc, tc, pu, tu)) in rows {
        let upstream = if name.contains("FUA") {
            "0.45 before (204k/451k), 1.00 after (450k/451k) the O_SYNC fast path"
        } else {
            "-"
        };
        let (cpu, user) = (format!("{pc:.2}/{tc:.2}"), format!("{pu:.2}/{tu:.2}"));
        let interval = format!("{lo:.3}-{hi:.3}");
        println!("{name:<24}{p:>14.0}{t:>14.0}{ratio:>11.3} {interval:<14}{cpu:>16}{user:>14}   {upstream}");
    }
    if provision {
        println!(
            "{:<24}{:>14.0}{:>14.0}{:>11.3} {:<14}{:>16}{:>14}   (blocks/s: zeroing on, zeroing off; ratio on/off)",
            "first-write provisioning",
            prov[0],
            prov[1],
            prov[0] / prov[1],
            "-",
            "-",
            "-"
        );
    }
}

fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(a.threads).enable_all().build().unwrap();
    rt.block_on(bench(a));
}
