//! In-process md array benchmark on io_uring file members (`bench/md.sh` runs it).
//!
//! ```text
//! md_bench --dir DIR [--levels raid0,raid1,raid10] [--members 4] [--member-mib 1024]
//!          [--secs 5] [--qd 32] [--seq-qd 16] [--paired CYCLES [--no-bitmap] [--sweep SPEC]]
//! ```
//! For each level: the raw member files first (same files, same run), then an array over them
//! (created --assume-clean, internal bitmap for raid1/raid10):
//! - 1 MiB sequential write (fills the array; raw: every file filled, one stream per file),
//! - 1 MiB sequential read, 4 KiB random read and 4 KiB random write at QD `qd`
//!   (raw: the same request stream spread over the four files, i.e. the four disks' aggregate),
//! - degraded reads (raid1/raid10: one member failed): 1 MiB sequential and 4 KiB random,
//! - a rebuild onto a fresh member file (MB/s of the member size) vs the device's ceiling for
//!   the same reads and writes, and vs one raw file written sequentially,
//! - a full resync (a new array over the same files, no bitmap) vs the device's ceiling for
//!   what it reads and writes.
//!
//! Prints one `result key=value ...` line per measurement; `bench/md.sh` turns them into a
//! table with ratios and the upstream references. With `--paired CYCLES` it measures only the
//! sequential write and the rebuild, in alternating windows (`support/paired.rs`,
//! `bench/md-pairs.sh`); `--sweep SPEC` replaces those with a comparison of several
//! sequential-write patterns against the same raw reference (`paired::sweep`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, IoBuf, Rng, SharedBuf, WriteFlags};
use mdkit_md::array::{CreateOptions, MemberDev, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::format::superblock::MAX_SECTOR;
use mdkit_md::layout::{Level, parse_level};

#[path = "support/paired.rs"]
mod paired;

const MIB: u64 = 1 << 20;

#[derive(Clone)]
struct Args {
    dir: String,
    levels: Vec<Level>,
    members: usize,
    member_mib: u64,
    secs: f64,
    qd: usize,
    seq_qd: usize,
    /// `--paired CYCLES`: alternating-window measurements only (0 = the full benchmark).
    paired: usize,
    /// `--no-bitmap` (with `--paired`): arrays without the internal bitmap.
    no_bitmap: bool,
    /// `--sweep SPEC` (with `--paired`): sequential-write windows to compare, see `paired::sweep`.
    sweep: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        dir: String::new(),
        levels: vec![Level::Raid0, Level::Raid1, Level::Raid10],
        members: 4,
        member_mib: 1024,
        secs: 5.0,
        qd: 32,
        seq_qd: 16,
        paired: 0,
        no_bitmap: false,
        sweep: None,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        if v[i] == "--no-bitmap" {
            a.no_bitmap = true;
            i += 1;
            continue;
        }
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--dir" => a.dir = val,
            "--levels" => {
                a.levels = val.split(',').map(|l| parse_level(l).unwrap_or_else(|e| panic!("--levels: {e}"))).collect()
            }
            "--members" => a.members = val.parse().expect("--members N"),
            "--member-mib" => a.member_mib = val.parse().expect("--member-mib N"),
            "--secs" => a.secs = val.parse().expect("--secs S"),
            "--qd" => a.qd = val.parse().expect("--qd N"),
            "--seq-qd" => a.seq_qd = val.parse().expect("--seq-qd N"),
            "--paired" => a.paired = val.parse().expect("--paired CYCLES"),
            "--sweep" => a.sweep = Some(val),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    assert!(!a.dir.is_empty(), "--dir DIR is required");
    a
}

fn open(path: &str) -> DeviceRef {
    let opts = FileOptions { direct: DirectMode::Require, queue_depth: 256, ..FileOptions::default() };
    Arc::new(FileDevice::open(path, opts).unwrap_or_else(|e| panic!("{path}: {e}")))
}

/// A request source: where the next request goes.
#[derive(Clone)]
enum Target {
    /// One device (the array).
    One(DeviceRef),
    /// Several devices; random requests pick one at random, sequential streams one each.
    Many(Vec<DeviceRef>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pattern {
    SeqRead,
    SeqWrite,
    RandRead,
    RandWrite,
}

/// Runs `qd` workers for `secs` (or, for a sequential write fill, until every byte is written
/// once); returns (requests, bytes, seconds).
async fn run(target: &Target, pat: Pattern, bs: u64, qd: usize, secs: f64, fill_once: bool) -> (u64, u64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let stopper = stop.clone();
    let timer = tokio::spawn(async move {
        if !fill_once {
            tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            stopper.store(true, Ordering::Relaxed);
        }
    });
    let r = run_until(target, pat, bs, qd, stop, fill_once).await;
    timer.abort();
    r
}

/// [`run`] until `stop` is set (or the fill is done).
async fn run_until(
    target: &Target,
    pat: Pattern,
    bs: u64,
    qd: usize,
    stop: Arc<AtomicBool>,
    fill_once: bool,
) -> (u64, u64, f64) {
    let ops = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let devs: Vec<DeviceRef> = match target {
        Target::One(d) => vec![d.clone()],
        Target::Many(v) => v.clone(),
    };
    let n = devs.len();
    // Sequential: one shared cursor per device; workers take the next block in turn.
    let cursors: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..qd {
        let (devs, stop, ops, bytes, cursors) =
            (devs.clone(), stop.clone(), ops.clone(), bytes.clone(), cursors.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(w as u64 * 7919 + 1);
            let data = {
                let mut b = IoBuf::zeroed(bs as usize);
                rng.fill(b.as_mut_slice());
                b.freeze()
            };
            let mut buf = Some(IoBuf::zeroed(bs as usize));
            while !stop.load(Ordering::Relaxed) {
                let (d, off) = match pat {
                    Pattern::SeqRead | Pattern::SeqWrite => {
                        let d = w % n;
                        let size = devs[d].topology().size_bytes / bs * bs;
                        let off = cursors[d].fetch_add(bs, Ordering::Relaxed);
                        if off + bs > size {
                            if fill_once {
                                break;
                            }
                            cursors[d].store(0, Ordering::Relaxed);
                            continue;
                        }
                        (d, off)
                    }
                    _ => {
                        let d = rng.below(n as u64) as usize;
                        let blocks = devs[d].topology().size_bytes / bs;
                        (d, rng.below(blocks) * bs)
                    }
                };
                match pat {
                    Pattern::SeqRead | Pattern::RandRead => {
                        let (b, r) = devs[d].read(off, buf.take().expect("buffer")).await;
                        r.unwrap_or_else(|e| panic!("read: {e}"));
                        buf = Some(b);
                    }
                    Pattern::SeqWrite | Pattern::RandWrite => {
                        let sb: SharedBuf = data.clone();
                        devs[d].write(off, sb, WriteFlags::NONE).await.unwrap_or_else(|e| panic!("write: {e}"));
                    }
                }
                ops.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(bs, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let el = t0.elapsed().as_secs_f64();
    (ops.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed), el)
}

/// The device's own ceiling for a sync pass: every 1 MiB block read from each of the `sources`
/// files and then written to each of the `targets`, `qd` blocks in flight. A rebuild reads one
/// copy (or the n - 1 members parity is computed from) and writes the fresh member; a mirror
/// resync reads one copy and writes the others; a parity resync reads every member. The member
/// files share one device here, so this, not one file written alone, bounds a sync pass.
async fn sync_ceiling(sources: Vec<DeviceRef>, targets: Vec<DeviceRef>, qd: usize) -> (u64, u64, f64) {
    let size = sources[0].topology().size_bytes / MIB * MIB;
    let cursor = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..qd)
        .map(|_| {
            let (sources, targets, cursor) = (sources.clone(), targets.clone(), cursor.clone());
            tokio::spawn(async move {
                let mut bufs: Vec<Option<IoBuf>> = sources.iter().map(|_| Some(IoBuf::zeroed(MIB as usize))).collect();
                let mut blocks = 0u64;
                loop {
                    let off = cursor.fetch_add(MIB, Ordering::Relaxed);
                    if off + MIB > size {
                        return blocks;
                    }
                    let reads =
                        sources.iter().zip(bufs.iter_mut()).map(|(d, b)| d.read(off, b.take().expect("buffer")));
                    let mut got = Vec::new();
                    for (b, res) in mdkit_md::array::io::join_all(reads).await {
                        res.unwrap_or_else(|e| panic!("read: {e}"));
                        got.push(b);
                    }
                    // The first source's block is what gets written (no copy; it comes back
                    // to be read into once the writes are done).
                    let data = got.swap_remove(0).freeze();
                    let writes = targets.iter().map(|t| t.write(off, data.clone(), WriteFlags::NONE));
                    for res in mdkit_md::array::io::join_all(writes).await {
                        res.unwrap_or_else(|e| panic!("write: {e}"));
                    }
                    got.insert(0, data.into_mut());
                    bufs = got.into_iter().map(Some).collect();
                    blocks += 1;
                }
            })
        })
        .collect();
    let mut blocks = 0;
    for w in workers {
        blocks += w.await.expect("worker");
    }
    (blocks, blocks * MIB, t0.elapsed().as_secs_f64())
}

fn report(level: &str, target: &str, test: &str, r: (u64, u64, f64)) {
    let (ops, bytes, secs) = r;
    println!(
        "result level={level} target={target} test={test} iops={:.0} mbps={:.1} secs={secs:.2}",
        ops as f64 / secs,
        bytes as f64 / 1e6 / secs
    );
}

async fn measure_all(level: &str, target: &str, t: &Target, a: &Args, fill: bool) {
    if fill {
        let seq_qd = if matches!(t, Target::Many(_)) { a.members * 4 } else { a.seq_qd };
        report(level, target, "seq-write-1m", run(t, Pattern::SeqWrite, MIB, seq_qd, a.secs, true).await);
    }
    let seq_qd = if matches!(t, Target::Many(_)) { a.members * 4 } else { a.seq_qd };
    report(level, target, "seq-read-1m", run(t, Pattern::SeqRead, MIB, seq_qd, a.secs, false).await);
    report(level, target, "rand-read-4k", run(t, Pattern::RandRead, 4096, a.qd, a.secs, false).await);
    report(level, target, "rand-write-4k", run(t, Pattern::RandWrite, 4096, a.qd, a.secs, false).await);
}

fn member_path(a: &Args, level: Level, i: usize) -> String {
    format!("{}/md-bench-{}-m{i}.img", a.dir, level.name())
}

fn make_file(path: &str, mib: u64) {
    let _ = std::fs::remove_file(path);
    let f = std::fs::File::create(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    f.set_len(mib * MIB).unwrap();
}

async fn bench_level(a: &Args, level: Level) {
    let name = level.name();
    let paths: Vec<String> = (0..a.members).map(|i| member_path(a, level, i)).collect();
    for p in &paths {
        make_file(p, a.member_mib);
    }
    // Raw: the member files themselves, filled once unmeasured (no holes: the array's pass
    // overwrites written files too), then measured; the sequential write again at the end of
    // the level (its A/A control: the device drifts between the two).
    let raw: Vec<DeviceRef> = paths.iter().map(|p| open(p)).collect();
    run(&Target::Many(raw.clone()), Pattern::SeqWrite, MIB, a.members * 4, a.secs, true).await;
    measure_all(name, "raw", &Target::Many(raw.clone()), a, true).await;
    drop(raw);
    // One fresh file written sequentially once: the reference for a rebuild (which writes a
    // fresh member file from start to end).
    let fresh = format!("{}/md-bench-{name}-fresh.img", a.dir);
    make_file(&fresh, a.member_mib);
    let single = Target::Many(vec![open(&fresh)]);
    report(name, "raw", "seq-write-1m-one-file", run(&single, Pattern::SeqWrite, MIB, 4, a.secs, true).await);
    drop(single);
    // The device's ceiling for a rebuild, before and again after it (the A/A control).
    let ceiling = |test: &'static str| {
        let sources = if matches!(level, Level::Raid1 | Level::Raid10) { 1 } else { a.members - 1 };
        let (fresh, from) = (fresh.clone(), paths[..sources].to_vec());
        async move {
            make_file(&fresh, a.member_mib);
            let from: Vec<DeviceRef> = from.iter().map(|p| open(p)).collect();
            report(name, "raw", test, sync_ceiling(from, vec![open(&fresh)], 8).await);
            let _ = std::fs::remove_file(&fresh);
        }
    };
    ceiling("rebuild-ceiling").await;

    let members: Vec<MemberDev> =
        paths.iter().enumerate().map(|(i, p)| MemberDev::new(format!("m{i}"), open(p))).collect();
    let mut o = CreateOptions::new(format!("bench-{name}"), level, a.members as u32);
    o.assume_clean = true;
    if level != Level::Raid1 {
        o.chunk_kib = Some(512);
    }
    o.bitmap = if level == Level::Raid0 { BitmapRequest::None } else { BitmapRequest::Internal { chunk_bytes: None } };
    let array = Arc::new(create(members, o).await.unwrap_or_else(|e| panic!("create {name}: {e}")).array);
    array.set_attribute("sync_speed_max", "100000000").unwrap();
    array.set_attribute("sync_speed_min", "100000000").unwrap();
    let t = Target::One(array.clone() as DeviceRef);
    measure_all(name, "mdkit", &t, a, true).await;
    if level != Level::Raid0 {
        array.fail_member("m1").await.unwrap();
        report(name, "mdkit", "degraded-seq-read-1m", run(&t, Pattern::SeqRead, MIB, a.seq_qd, a.secs, false).await);
        report(name, "mdkit", "degraded-rand-read-4k", run(&t, Pattern::RandRead, 4096, a.qd, a.secs, false).await);
        array.remove_member("m1").await.unwrap();
        let spare = format!("{}/md-bench-{name}-spare.img", a.dir);
        make_file(&spare, a.member_mib);
        let t0 = Instant::now();
        array.add_member(MemberDev::new("spare", open(&spare))).await.unwrap();
        array.wait_sync_idle().await;
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(array.core().degraded(), 0, "rebuild did not complete");
        // A rebuild writes the member's data area (raid10: its used sectors).
        let bytes = array.core().slots().in_sync(1).map_or(0, |m| m.data_size_sectors * 512);
        report(name, "mdkit", "rebuild", (1, bytes, secs));
        let _ = std::fs::remove_file(&spare);
        ceiling("rebuild-ceiling-again").await;
    }
    array.stop().await.unwrap();
    drop(array);
    if level != Level::Raid0 {
        bench_resync(a, level, &paths).await;
    }
    let raw = Target::Many(paths.iter().map(|p| open(p)).collect());
    let again = run(&raw, Pattern::SeqWrite, MIB, a.members * 4, a.secs, true).await;
    report(name, "raw", "seq-write-1m-again", again);
    drop(raw);
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
}

/// A full resync over the member files (an array created without --assume-clean and without a
/// bitmap; raid5 with mdadm's create --force, so it resyncs instead of rebuilding the last
/// member) vs the device's ceiling for what a resync reads and writes, measured before and after
/// it (the A/A control). The files hold the consistent array the rebuild left, so a parity
/// resync only reads, as after an unclean shutdown.
async fn bench_resync(a: &Args, level: Level, paths: &[String]) {
    let name = level.name();
    // A mirror resync reads the first copy and writes the others (raid10 near2: copies on
    // neighbouring members); a parity resync reads every member and writes nothing that matches.
    let (sources, targets): (Vec<&String>, Vec<&String>) = match level {
        Level::Raid1 => (paths[..1].iter().collect(), paths[1..].iter().collect()),
        Level::Raid10 => (paths.iter().step_by(2).collect(), paths.iter().skip(1).step_by(2).collect()),
        _ => (paths.iter().collect(), Vec::new()),
    };
    let ceiling = |test: &'static str| {
        let (s, t): (Vec<DeviceRef>, Vec<DeviceRef>) =
            (sources.iter().map(|p| open(p)).collect(), targets.iter().map(|p| open(p)).collect());
        async move { report(name, "raw", test, sync_ceiling(s, t, 8).await) }
    };
    ceiling("resync-ceiling").await;
    let members: Vec<MemberDev> =
        paths.iter().enumerate().map(|(i, p)| MemberDev::new(format!("m{i}"), open(p))).collect();
    let mut o = CreateOptions::new(format!("bench-resync-{name}"), level, a.members as u32);
    o.full_resync = true;
    if level != Level::Raid1 {
        o.chunk_kib = Some(512);
    }
    let t0 = Instant::now();
    let array = Arc::new(create(members, o).await.unwrap_or_else(|e| panic!("create {name}: {e}")).array);
    array.set_attribute("sync_speed_max", "100000000").unwrap();
    array.set_attribute("sync_speed_min", "100000000").unwrap();
    array.wait_sync_idle().await;
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(array.core().resync_checkpoint(), MAX_SECTOR, "resync did not complete");
    let bytes = array.core().slots().in_sync(0).map_or(0, |m| m.data_size_sectors * 512);
    report(name, "mdkit", "resync", (1, bytes, secs));
    array.stop().await.unwrap();
    drop(array);
    ceiling("resync-ceiling-again").await;
}

fn main() {
    let a = parse_args();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        for level in a.levels.clone() {
            if a.paired > 0 {
                paired::bench_level_paired(&a, level, a.paired).await;
            } else {
                bench_level(&a, level).await;
            }
        }
    });
}
