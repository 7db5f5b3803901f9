//! `md_bench --paired CYCLES`: the two ratios issue 17 sets targets for — 1 MiB sequential
//! writes against the raw member files, and a rebuild against the device's own ceiling for it —
//! measured in short alternating windows (`bench/md-pairs.sh` summarises them).
//!
//! On the 2-vCPU VMs a raw pass before the array's and another after it disagreed by up to
//! 1.6x, so one before/after pair cannot resolve a 0.9 ratio. Here the windows run back to back
//! as
//! ```text
//!   seq-write:  R X R A R X R A ... R    R = the raw files filled once (one stream each)
//!                                        X = an array over the same files, filled once
//!                                        A = the raw files again, judged as a target (A/A)
//!   rebuild:    C B C A C B C A ... C    C = the device's ceiling for a rebuild (n - 1 files
//!                                            read, or one for mirrors, a fresh file written)
//!                                        B = a rebuild onto a fresh member file
//!                                        A = the ceiling again, judged as a target (A/A)
//! ```
//! and each target window is divided by the geometric mean of the reference windows right
//! before and after it. Prints one `pair level=.. test=.. target=mdkit|aa ratio=.. mbps=..`
//! line per target window.
//!
//! `--sweep SPEC` runs sequential-write windows of other shapes instead, each against the same
//! reference (`R T1 R T2 ... R`): `raw:BYTES:PER_FILE` writes the raw files with BYTES requests,
//! PER_FILE in flight on each (`raw:524288:16` is what an array of 512 KiB chunks at client
//! depth 16 sends its members), `md:QD:bitmap|nobitmap` fills a new array at client depth QD.
//! It separates what the member I/O pattern costs on this device from what the array adds.

use super::*;

/// What a window measured: a reference (R / C) or a target (X, B or A) with its name.
enum Window {
    Reference(f64),
    Target(&'static str, f64),
}

/// Prints every target window's ratio to the geometric mean of the references beside it.
fn report_pairs(level: &str, test: &str, windows: &[Window]) {
    for (i, w) in windows.iter().enumerate() {
        let Window::Target(target, mbps) = w else { continue };
        let (Some(Window::Reference(before)), Some(Window::Reference(after))) =
            (windows.get(i.wrapping_sub(1)), windows.get(i + 1))
        else {
            continue;
        };
        let ratio = mbps / (before * after).sqrt();
        println!(
            "pair level={level} test={test} target={target} ratio={ratio:.4} mbps={mbps:.1} ref_before={before:.1} ref_after={after:.1}"
        );
    }
}

/// Runs `cycles` rounds of `reference, target, reference, A/A` and a closing reference.
async fn alternate<R, T, FR, FT>(cycles: usize, mut reference: R, mut target: T) -> Vec<Window>
where
    R: FnMut() -> FR,
    T: FnMut() -> FT,
    FR: Future<Output = f64>,
    FT: Future<Output = f64>,
{
    let mut w = Vec::new();
    for _ in 0..cycles {
        w.push(Window::Reference(reference().await));
        w.push(Window::Target("mdkit", target().await));
        w.push(Window::Reference(reference().await));
        w.push(Window::Target("aa", reference().await));
    }
    w.push(Window::Reference(reference().await));
    w
}

fn mbps(r: (u64, u64, f64)) -> f64 {
    r.1 as f64 / 1e6 / r.2
}

/// The benchmark's array over `paths` (assume-clean, 512 KiB chunks, internal bitmap except
/// raid0 or with `--no-bitmap`), as `bench_level` creates it.
async fn bench_array(a: &Args, level: Level, paths: &[String], name: &str) -> Arc<mdkit_md::array::Array> {
    let members: Vec<MemberDev> =
        paths.iter().enumerate().map(|(i, p)| MemberDev::new(format!("m{i}"), open(p))).collect();
    let mut o = CreateOptions::new(name.to_string(), level, a.members as u32);
    o.assume_clean = true;
    if level != Level::Raid1 {
        o.chunk_kib = Some(512);
    }
    let internal = level != Level::Raid0 && !a.no_bitmap;
    o.bitmap = if internal { BitmapRequest::Internal { chunk_bytes: None } } else { BitmapRequest::None };
    let array = Arc::new(create(members, o).await.unwrap_or_else(|e| panic!("create {name}: {e}")).array);
    array.set_attribute("sync_speed_max", "100000000").unwrap();
    array.set_attribute("sync_speed_min", "100000000").unwrap();
    array
}

/// Sequential 1 MiB writes: the raw files filled once vs an array over them filled once (a
/// new array each window: the raw passes overwrite its superblocks).
async fn seq_write(a: &Args, level: Level, paths: &[String], cycles: usize) {
    let raw = || raw_fill(a, paths, MIB, 4);
    let array = || array_fill(a, level, paths, a.seq_qd, !a.no_bitmap);
    let windows = alternate(cycles, raw, array).await;
    report_pairs(level.name(), "seq-write-1m", &windows);
}

/// A rebuild onto a fresh member file (role 1 failed, removed and re-added each time) vs the
/// device's ceiling for it, as `bench_level` measures them.
async fn rebuild(a: &Args, level: Level, paths: &[String], cycles: usize) {
    let name = level.name();
    let array = bench_array(a, level, paths, &format!("pairs-rebuild-{name}")).await;
    let fresh = format!("{}/md-bench-{name}-fresh.img", a.dir);
    let sources = if matches!(level, Level::Raid1 | Level::Raid10) { 1 } else { a.members - 1 };
    let fresh = &fresh;
    let ceiling = || async move {
        make_file(fresh, a.member_mib);
        let from: Vec<DeviceRef> = paths[..sources].iter().map(|p| open(p)).collect();
        let r = mbps(sync_ceiling(from, vec![open(fresh)], 8).await);
        let _ = std::fs::remove_file(fresh);
        r
    };
    let (round, held) = (std::cell::Cell::new(0usize), std::cell::RefCell::new("m1".to_string()));
    let (round, held, array_ref) = (&round, &held, &array);
    let rebuild = || async move {
        let array = array_ref;
        let k = round.get();
        round.set(k + 1);
        let old = held.borrow().clone();
        array.fail_member(&old).await.unwrap();
        array.remove_member(&old).await.unwrap();
        let spare = format!("{}/md-bench-{name}-spare{}.img", a.dir, k % 2);
        make_file(&spare, a.member_mib);
        let new = format!("spare{k}");
        let t0 = Instant::now();
        array.add_member(MemberDev::new(new.clone(), open(&spare))).await.unwrap();
        array.wait_sync_idle().await;
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(array.core().degraded(), 0, "rebuild did not complete");
        *held.borrow_mut() = new;
        let bytes = array.core().slots().in_sync(1).map_or(0, |m| m.data_size_sectors * 512);
        bytes as f64 / 1e6 / secs
    };
    let windows = alternate(cycles, ceiling, rebuild).await;
    array.stop().await.unwrap();
    for k in 0..2 {
        let _ = std::fs::remove_file(format!("{}/md-bench-{name}-spare{k}.img", a.dir));
    }
    report_pairs(name, "rebuild", &windows);
}

/// One window shape of `--sweep`.
enum Shape {
    Raw { request_bytes: u64, per_file: usize },
    Array { qd: usize, bitmap: bool },
}

impl Shape {
    fn parse(spec: &str) -> Shape {
        let f: Vec<&str> = spec.split(':').collect();
        let num = |i: usize| -> u64 {
            f.get(i).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("--sweep: bad window {spec:?}"))
        };
        match f[0] {
            "raw" => Shape::Raw { request_bytes: num(1), per_file: num(2) as usize },
            "md" => Shape::Array {
                qd: num(1) as usize,
                bitmap: match f.get(2) {
                    Some(&"bitmap") => true,
                    Some(&"nobitmap") => false,
                    _ => panic!("--sweep: {spec:?}: md:QD:bitmap|nobitmap"),
                },
            },
            _ => panic!("--sweep: {spec:?}: raw:BYTES:PER_FILE or md:QD:bitmap|nobitmap"),
        }
    }

    fn label(&self) -> String {
        match self {
            Shape::Raw { request_bytes, per_file } => format!("raw-{}k-x{per_file}", request_bytes / 1024),
            Shape::Array { qd, bitmap: true } => format!("md-qd{qd}-bitmap"),
            Shape::Array { qd, bitmap: false } => format!("md-qd{qd}-nobitmap"),
        }
    }
}

/// The raw member files filled once with `request_bytes` requests, `per_file` in flight on each.
async fn raw_fill(a: &Args, paths: &[String], request_bytes: u64, per_file: usize) -> f64 {
    let t = Target::Many(paths.iter().map(|p| open(p)).collect());
    mbps(run(&t, Pattern::SeqWrite, request_bytes, a.members * per_file, a.secs, true).await)
}

/// A new array over the member files filled once at client depth `qd`.
async fn array_fill(a: &Args, level: Level, paths: &[String], qd: usize, bitmap: bool) -> f64 {
    let a2 = Args { no_bitmap: !bitmap, ..a.clone() };
    let array = bench_array(&a2, level, paths, &format!("pairs-{}", level.name())).await;
    let r = mbps(run(&Target::One(array.clone() as DeviceRef), Pattern::SeqWrite, MIB, qd, a.secs, true).await);
    array.stop().await.unwrap();
    r
}

/// `--sweep`: every shape of `spec` in turn, each between two reference windows, `cycles` times.
async fn sweep(a: &Args, level: Level, paths: &[String], cycles: usize, spec: &str) {
    let shapes: Vec<Shape> = spec.split(',').map(Shape::parse).collect();
    let labels: Vec<&'static str> = shapes.iter().map(|s| &*Box::leak(s.label().into_boxed_str())).collect();
    let mut windows = Vec::new();
    for _ in 0..cycles {
        for (shape, label) in shapes.iter().zip(&labels) {
            windows.push(Window::Reference(raw_fill(a, paths, MIB, 4).await));
            let mbps = match *shape {
                Shape::Raw { request_bytes, per_file } => raw_fill(a, paths, request_bytes, per_file).await,
                Shape::Array { qd, bitmap } => array_fill(a, level, paths, qd, bitmap).await,
            };
            windows.push(Window::Target(label, mbps));
        }
    }
    windows.push(Window::Reference(raw_fill(a, paths, MIB, 4).await));
    report_pairs(level.name(), "seq-write-1m", &windows);
}

/// Every paired measurement of one level.
pub async fn bench_level_paired(a: &Args, level: Level, cycles: usize) {
    let paths: Vec<String> = (0..a.members).map(|i| member_path(a, level, i)).collect();
    for p in &paths {
        make_file(p, a.member_mib);
    }
    // Filled once unmeasured: no holes, as in bench_level.
    let raw = Target::Many(paths.iter().map(|p| open(p)).collect());
    run(&raw, Pattern::SeqWrite, MIB, a.members * 4, a.secs, true).await;
    drop(raw);
    if let Some(spec) = &a.sweep {
        sweep(a, level, &paths, cycles, spec).await;
    } else {
        seq_write(a, level, &paths, cycles).await;
        if level != Level::Raid0 {
            rebuild(a, level, &paths, cycles).await;
        }
    }
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
}
