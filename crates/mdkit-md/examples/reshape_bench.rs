//! Reshape throughput against the members' own rate, in process on io_uring O_DIRECT file
//! members (`bench/reshape.sh` runs it). Same files, same run:
//!
//! ```text
//! reshape_bench --dir DIR [--level raid5|raid6] [--members 4] [--member-mib 512]
//!               [--chunk-kib 64] [--qd 32] [--secs 4]
//! ```
//! 1. `ceiling`: what the member files do with a reshape's access pattern: on every file at
//!    once, a 1 MiB sequential reader and a 1 MiB sequential writer (two in flight each), for
//!    `secs`; bytes read plus bytes written per second, all files together.
//! 2. `reshape-a` and `reshape-b` (the A/A control: the same reshape again on new superblocks
//!    over the same files), idle: `grow --raid-devices N+1` from `--members` N with
//!    sync_speed_min/max raised, timed to the end. Member traffic is the least a restripe can
//!    do: read the old data once, write it and its parity in the new geometry once.
//! 3. `reshape-load`: the restripe started under `qd` 4 KiB random readers for `secs`, with
//!    md's default sync_speed_min (1000 KiB/s: the reshape yields to requests, as md's does):
//!    its rate meanwhile and the readers' IOPS, beside `rand-read-idle`, the same readers on
//!    the array before it. Then the readers stop and the reshape finishes.
//!
//! Prints one `result key=value ...` line per measurement.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, IoBuf, Rng, WriteFlags};
use mdkit_md::array::{Array, CreateOptions, GrowChange, MemberDev, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::layout::{Level, parse_level};

const MIB: u64 = 1 << 20;

struct Args {
    dir: String,
    level: Level,
    members: usize,
    member_mib: u64,
    chunk_kib: u32,
    qd: usize,
    secs: f64,
}

fn parse_args() -> Args {
    let mut a =
        Args { dir: String::new(), level: Level::Raid5, members: 4, member_mib: 512, chunk_kib: 64, qd: 32, secs: 4.0 };
    let v: Vec<String> = std::env::args().skip(1).collect();
    for pair in v.chunks(2) {
        let val = pair.get(1).cloned().unwrap_or_default();
        match pair[0].as_str() {
            "--dir" => a.dir = val,
            "--level" => a.level = parse_level(&val).unwrap_or_else(|e| panic!("--level: {e}")),
            "--members" => a.members = val.parse().expect("--members N"),
            "--member-mib" => a.member_mib = val.parse().expect("--member-mib N"),
            "--chunk-kib" => a.chunk_kib = val.parse().expect("--chunk-kib N"),
            "--qd" => a.qd = val.parse().expect("--qd N"),
            "--secs" => a.secs = val.parse().expect("--secs S"),
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(!a.dir.is_empty(), "--dir DIR is required");
    a
}

fn open(path: &str) -> DeviceRef {
    let opts = FileOptions { direct: DirectMode::Require, queue_depth: 256, ..FileOptions::default() };
    Arc::new(FileDevice::open(path, opts).unwrap_or_else(|e| panic!("{path}: {e}")))
}

/// Streams 1 MiB requests over `[from, to)` of `dev`, wrapping, until `stop`; counts bytes.
async fn stream(dev: DeviceRef, write: bool, from: u64, to: u64, stop: Arc<AtomicBool>, bytes: Arc<AtomicU64>) {
    let mut off = from;
    let mut buf = Some(IoBuf::zeroed(MIB as usize));
    let data = IoBuf::zeroed(MIB as usize).freeze();
    while !stop.load(Ordering::Relaxed) {
        if off + MIB > to {
            off = from;
        }
        if write {
            dev.write(off, data.clone(), WriteFlags::NONE).await.unwrap_or_else(|e| panic!("write: {e}"));
        } else {
            let (b, r) = dev.read(off, buf.take().expect("buffer")).await;
            r.unwrap_or_else(|e| panic!("read: {e}"));
            buf = Some(b);
        }
        bytes.fetch_add(MIB, Ordering::Relaxed);
        off += MIB;
    }
}

/// The members' rate for a reshape's pattern: readers in the first half of every file,
/// writers in the second, two of each per file; bytes per second.
async fn ceiling(devs: &[DeviceRef], secs: f64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for d in devs {
        let half = d.topology().size_bytes / 2 / MIB * MIB;
        for k in 0..4u64 {
            let (write, base) = (k >= 2, if k >= 2 { half } else { 0 });
            let from = base + (k % 2) * (half / 2 / MIB * MIB);
            tasks.push(tokio::spawn(stream(d.clone(), write, from, base + half, stop.clone(), bytes.clone())));
        }
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("stream");
    }
    bytes.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
}

/// `qd` 4 KiB random readers on `a` until `stop`; returns the count.
fn readers(a: Arc<Array>, qd: usize, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..qd)
        .map(|w| {
            let (a, stop) = (a.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(w as u64 + 1);
                let mut buf = Some(IoBuf::zeroed(4096));
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let blocks = a.size_bytes() / 4096;
                    let (b, r) = a.read(rng.below(blocks) * 4096, buf.take().expect("buffer")).await;
                    r.unwrap_or_else(|e| panic!("array read: {e}"));
                    buf = Some(b);
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// `min_kib`: sync_speed_min. Raised, the reshape never yields; at md's default (1000) it
/// yields to requests, as md's resync does.
async fn new_array(a: &Args, paths: &[String], min_kib: &str) -> Arc<Array> {
    let members: Vec<MemberDev> =
        paths[..a.members].iter().enumerate().map(|(i, p)| MemberDev::new(format!("m{i}"), open(p))).collect();
    let mut o = CreateOptions::new("reshape-bench", a.level, a.members as u32);
    o.assume_clean = true;
    o.chunk_kib = Some(a.chunk_kib);
    o.bitmap = BitmapRequest::None;
    let array = create(members, o).await.unwrap_or_else(|e| panic!("create: {e}")).array;
    array.set_attribute("sync_speed_max", "100000000").unwrap();
    array.set_attribute("sync_speed_min", min_kib).unwrap();
    Arc::new(array)
}

/// One timed restripe onto the last file; returns (old array bytes, member bytes, seconds).
async fn reshape(a: &Args, array: &Array, paths: &[String]) -> (u64, u64, f64) {
    let parity = u64::from(a.level.max_degraded());
    let n = a.members as u64;
    let old_bytes = array.size_bytes();
    let t0 = Instant::now();
    let add = MemberDev::new(format!("m{}", a.members), open(&paths[a.members]));
    array.grow(GrowChange::RaidDevices(a.members as u32 + 1), vec![add]).await.unwrap_or_else(|e| panic!("grow: {e}"));
    array.wait_reshape().await.unwrap_or_else(|e| panic!("reshape: {e}"));
    let secs = t0.elapsed().as_secs_f64();
    // Read the old data once; write it with the new geometry's parity once.
    let member_bytes = old_bytes + old_bytes * (n + 1) / (n + 1 - parity);
    (old_bytes, member_bytes, secs)
}

fn report(test: &str, kv: &str) {
    println!("result test={test} {kv}");
}

/// `qd` random readers for `secs`: their IOPS.
async fn read_load(array: &Arc<Array>, a: &Args) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let tasks = readers(array.clone(), a.qd, stop.clone());
    tokio::time::sleep(Duration::from_secs_f64(a.secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut n = 0;
    for t in tasks {
        n += t.await.expect("reader");
    }
    n as f64 / t0.elapsed().as_secs_f64()
}

/// The restripe started under `qd` random readers for `secs` (sync_speed_min at md's
/// default, so it yields): the share of the reshape done meanwhile and the readers' IOPS;
/// then the readers stop and the reshape finishes at full speed.
async fn reshape_under_load(a: &Args, array: &Arc<Array>, paths: &[String]) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = readers(array.clone(), a.qd, stop.clone());
    let t0 = Instant::now();
    let add = MemberDev::new(format!("m{}", a.members), open(&paths[a.members]));
    array.grow(GrowChange::RaidDevices(a.members as u32 + 1), vec![add]).await.unwrap_or_else(|e| panic!("grow: {e}"));
    tokio::time::sleep(Duration::from_secs_f64(a.secs)).await;
    let st = array.sync_status();
    let done = st.done_sectors as f64 / st.total_sectors.max(1) as f64;
    stop.store(true, Ordering::Relaxed);
    let mut n = 0;
    for t in tasks {
        n += t.await.expect("reader");
    }
    let secs = t0.elapsed().as_secs_f64();
    array.set_attribute("sync_speed_min", "100000000").unwrap();
    array.wait_reshape().await.unwrap_or_else(|e| panic!("reshape: {e}"));
    (done / secs, n as f64 / secs)
}

async fn bench(a: &Args) {
    let paths: Vec<String> = (0..=a.members).map(|i| format!("{}/reshape-bench-m{i}.img", a.dir)).collect();
    let devs: Vec<DeviceRef> = paths.iter().map(|p| open(p)).collect();
    let c = ceiling(&devs, a.secs).await;
    report("ceiling", &format!("mbps={:.1}", c / 1e6));
    drop(devs);
    for test in ["reshape-a", "reshape-b"] {
        let array = new_array(a, &paths, "100000000").await;
        let (old_bytes, member_bytes, secs) = reshape(a, &array, &paths).await;
        report(
            test,
            &format!(
                "array_mbps={:.1} member_mbps={:.1} secs={secs:.2} array_bytes={old_bytes}",
                old_bytes as f64 / 1e6 / secs,
                member_bytes as f64 / 1e6 / secs
            ),
        );
        array.stop().await.unwrap();
    }
    let array = new_array(a, &paths, "1000").await;
    report("rand-read-idle", &format!("iops={:.0}", read_load(&array, a).await));
    let old_bytes = array.size_bytes();
    let (share_per_sec, iops) = reshape_under_load(a, &array, &paths).await;
    let parity = u64::from(a.level.max_degraded());
    let n = a.members as u64;
    let member_per_array = 1.0 + (n + 1) as f64 / (n + 1 - parity) as f64;
    let array_mbps = share_per_sec * old_bytes as f64 / 1e6;
    report(
        "reshape-load",
        &format!("array_mbps={array_mbps:.1} member_mbps={:.1} read_iops={iops:.0}", array_mbps * member_per_array),
    );
    array.stop().await.unwrap();
}

fn main() {
    let a = parse_args();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(bench(&a));
}
