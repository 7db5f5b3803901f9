//! Parity microbenchmark, one core, data in cache (like the kernel's boot-time raid6 benchmark).
//!
//! ```text
//! cargo run --release -p mdkit-parity --example parity_bench [-- --seconds 0.3 --impl avx2]
//! ```
//!
//! Throughput counts the bytes of the data blocks consumed per call, as lib/raid6/algos.c does
//! (`gen()`: all data blocks; `xor()` = xor_syndrome over the upper half of the data blocks:
//! those blocks). The kernel prints "MB/s" meaning MiB/s; the `kernel-units` column uses that
//! unit (MiB/s / 1000, i.e. what "43.1 GB/s" in a boot log means) so the ratio compares like
//! with like. Time is this thread's CPU time (CLOCK_THREAD_CPUTIME_ID), so a descheduled
//! thread does not lower the figure. The kernel reference: avx2x4 gen() 27–43 GB/s natively on this machine class,
//! 6 data + 2 parity disks of 4 KiB (RAID6_TEST_DISKS = 8 in 6.1). Every configuration takes the
//! best of `--repeats` timed runs of at least `--seconds` each.

use std::hint::black_box;
use std::time::{Duration, Instant};

use mdkit_parity::Implementation;

const KERNEL_AVX2X4_GEN_LOW: f64 = 27.0;
const KERNEL_AVX2X4_GEN_HIGH: f64 = 43.0;

struct Options {
    seconds: f64,
    repeats: usize,
    only_impl: Option<String>,
    only_op: Option<String>,
}

fn parse_options() -> Options {
    let mut options = Options { seconds: 0.05, repeats: 10, only_impl: None, only_op: None };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().unwrap_or_else(|| usage(&format!("{name} needs a value")));
        match arg.as_str() {
            "--seconds" => options.seconds = value("--seconds").parse().unwrap_or_else(|_| usage("bad --seconds")),
            "--repeats" => options.repeats = value("--repeats").parse().unwrap_or_else(|_| usage("bad --repeats")),
            "--impl" => options.only_impl = Some(value("--impl")),
            "--only" => options.only_op = Some(value("--only")),
            _ => usage(&format!("unknown argument {arg:?}")),
        }
    }
    options
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "parity_bench: {problem}\nusage: parity_bench [--seconds S] [--repeats N] [--impl scalar|avx2] [--only OP-PREFIX]"
    );
    std::process::exit(2)
}

/// `data_count` data blocks followed by four output blocks (P, Q and two spares), all
/// `block_bytes` long and consecutive in one 4 KiB-aligned allocation, as the kernel's benchmark
/// uses consecutive pages and as mdkit's I/O buffers are 4 KiB-aligned. Misaligned outputs
/// would measure split-cache-line stores instead of the parity code.
struct Arena {
    storage: Vec<u8>,
    start: usize,
    block_bytes: usize,
    data_count: usize,
}

impl Arena {
    fn new(data_count: usize, block_bytes: usize) -> Arena {
        let mut storage = vec![0u8; (data_count + 4) * block_bytes + 4096];
        let start = storage.as_ptr().align_offset(4096);
        let mut x: u32 = 0x1234_5678;
        for byte in storage.iter_mut() {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            *byte = (x >> 24) as u8;
        }
        Arena { storage, start, block_bytes, data_count }
    }

    /// (data blocks, [P, Q, spare A, spare B]).
    fn split(&mut self) -> (Vec<&[u8]>, [&mut [u8]; 4]) {
        let region = &mut self.storage[self.start..][..(self.data_count + 4) * self.block_bytes];
        let (data, outputs) = region.split_at_mut(self.data_count * self.block_bytes);
        let data = data.chunks_exact(self.block_bytes).collect();
        let mut outs = outputs.chunks_exact_mut(self.block_bytes);
        let mut next = || outs.next().expect("four output blocks were allocated");
        (data, [next(), next(), next(), next()])
    }
}

/// CPU time consumed by this thread: time while descheduled (other builds share the cores)
/// does not count, so the figure is per-core throughput.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to the valid pointer it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Best throughput (bytes per CPU-second) of `repeats` runs of at least `seconds` each.
fn measure(options: &Options, bytes_per_call: usize, mut call: impl FnMut()) -> f64 {
    // Warm up caches and clocks; size the batch to ~1 ms.
    let mut batch = 1usize;
    loop {
        let t = Instant::now();
        for _ in 0..batch {
            call();
        }
        if t.elapsed() > Duration::from_millis(1) || batch > 1 << 24 {
            break;
        }
        batch *= 2;
    }
    let mut best = 0f64;
    for _ in 0..options.repeats {
        let start = thread_cpu_seconds();
        let mut calls = 0usize;
        let mut elapsed = 0.0;
        while elapsed < options.seconds {
            for _ in 0..batch {
                call();
            }
            calls += batch;
            elapsed = thread_cpu_seconds() - start;
        }
        best = best.max((calls * bytes_per_call) as f64 / elapsed);
    }
    best
}

/// One benchmark row.
struct Case<'a> {
    op: &'static str,
    layout: String,
    block: usize,
    imp: &'a Implementation,
    bytes_per_call: usize,
}

impl Case<'_> {
    fn run(&self, options: &Options, kernel_ref: bool, call: impl FnMut()) {
        if options.only_op.as_deref().is_some_and(|prefix| !self.op.starts_with(prefix)) {
            return;
        }
        let bytes_per_s = measure(options, self.bytes_per_call, call);
        let gb_s = bytes_per_s / 1e9;
        let kernel_units = bytes_per_s / (1u64 << 20) as f64 / 1000.0;
        let ratio = if kernel_ref {
            format!(
                "{:.2}x of {KERNEL_AVX2X4_GEN_HIGH} / {:.2}x of {KERNEL_AVX2X4_GEN_LOW}",
                kernel_units / KERNEL_AVX2X4_GEN_HIGH,
                kernel_units / KERNEL_AVX2X4_GEN_LOW
            )
        } else {
            String::new()
        };
        println!(
            "{:<14} {:<6} {:>6} {:<7} {gb_s:>9.2} {kernel_units:>13.2}   {ratio}",
            self.op,
            self.layout,
            format!("{}K", self.block / 1024),
            self.imp.name()
        );
    }
}

fn main() {
    let options = parse_options();
    let implementations: Vec<&Implementation> = match &options.only_impl {
        Some(name) => vec![Implementation::by_name(name).unwrap_or_else(|e| usage(&e.to_string()))],
        None => Implementation::available(),
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string());
    println!(
        "mdkit-parity microbenchmark: one thread, in-cache blocks, best of {} x {:.2}s thread CPU time; CPU: {cpu}",
        options.repeats, options.seconds
    );
    println!(
        "kernel reference: lib/raid6 avx2x4 gen() {KERNEL_AVX2X4_GEN_LOW}-{KERNEL_AVX2X4_GEN_HIGH} GB/s (kernel units) natively on this machine, 6+2 disks x 4 KiB"
    );
    println!(
        "{:<14} {:<6} {:>6} {:<7} {:>9} {:>13}   vs kernel avx2x4 gen()",
        "op", "disks", "block", "impl", "GB/s", "kernel-units"
    );

    for imp in &implementations {
        let imp: &Implementation = imp;
        // XOR (RAID5 P): n data blocks -> P.
        for (data, block) in [(4, 4096), (8, 4096), (4, 65536), (8, 65536)] {
            let mut arena = Arena::new(data, block);
            let (blocks, [p, ..]) = arena.split();
            let case = Case { op: "xor_gen", layout: format!("{data}+1"), block, imp, bytes_per_call: data * block };
            case.run(&options, false, || imp.xor_gen(black_box(&blocks), black_box(&mut *p)));
        }
        // RAID6 gen_syndrome.
        for (data, block) in [(4, 4096), (6, 4096), (8, 4096), (16, 4096), (6, 65536), (16, 65536)] {
            let mut arena = Arena::new(data, block);
            let (blocks, [p, q, ..]) = arena.split();
            let case = Case { op: "pq_gen", layout: format!("{data}+2"), block, imp, bytes_per_call: data * block };
            case.run(&options, true, || imp.pq_gen(black_box(&blocks), black_box(&mut *p), black_box(&mut *q)));
        }
        // The kernel's xor() figure: xor_syndrome over data blocks (disks/2 - 1) ..= disks - 3.
        {
            let (data, block) = (6usize, 4096usize);
            let (start, stop) = ((data + 2) / 2 - 1, data - 1);
            let mut arena = Arena::new(data, block);
            let (blocks, [p, q, ..]) = arena.split();
            let bytes_per_call = (stop - start + 1) * block;
            let case = Case { op: "pq_xor_synd", layout: format!("{data}+2"), block, imp, bytes_per_call };
            case.run(&options, false, || {
                let run = black_box(&blocks[start..=stop]);
                imp.pq_xor_syndrome(start, run, black_box(&mut *p), black_box(&mut *q))
            });
        }
        // Read-modify-write of one block (P ^= d, Q ^= g^i d): bytes = the one data block.
        {
            let block = 4096;
            let mut arena = Arena::new(2, block);
            let (blocks, [p, q, ..]) = arena.split();
            let case = Case { op: "pq_update", layout: "i=5".into(), block, imp, bytes_per_call: block };
            case.run(&options, false, || {
                let (old, new) = (black_box(blocks[0]), black_box(blocks[1]));
                imp.pq_update(5, old, new, black_box(&mut *p), black_box(&mut *q))
            });
        }
        // Recovery: bytes = all data blocks of the stripe (survivors read + missing rebuilt).
        for (data, block) in [(4, 4096), (6, 4096), (8, 4096), (16, 4096), (6, 65536)] {
            let mut arena = Arena::new(data, block);
            let (blocks, [p, q, a, b]) = arena.split();
            imp.pq_gen(&blocks, p, q);
            let mut holes: Vec<Option<&[u8]>> = blocks.iter().map(|b| Some(*b)).collect();
            holes[1] = None;
            holes[data - 2] = None;
            imp.recover_2data(&holes, p, q, a, b);
            assert!(a == blocks[1] && b == blocks[data - 2], "recovery self-check failed");
            let case =
                Case { op: "recover_2data", layout: format!("{data}+2"), block, imp, bytes_per_call: data * block };
            case.run(&options, false, || {
                imp.recover_2data(
                    black_box(&holes),
                    black_box(&*p),
                    black_box(&*q),
                    black_box(&mut *a),
                    black_box(&mut *b),
                )
            });
            holes[data - 2] = Some(blocks[data - 2]);
            imp.recover_datap(&holes, q, a, b);
            assert!(a == blocks[1] && b == p, "recovery self-check failed");
            let case =
                Case { op: "recover_datap", layout: format!("{data}+2"), block, imp, bytes_per_call: data * block };
            case.run(&options, false, || {
                imp.recover_datap(black_box(&holes), black_box(&*q), black_box(&mut *a), black_box(&mut *b))
            });
        }
        // Scrub check of a consistent stripe.
        for (data, block) in [(6, 4096), (6, 65536)] {
            let mut arena = Arena::new(data, block);
            let (blocks, [p, q, ..]) = arena.split();
            imp.pq_gen(&blocks, p, q);
            let case = Case { op: "pq_check", layout: format!("{data}+2"), block, imp, bytes_per_call: data * block };
            case.run(&options, false, || {
                let verdict = imp.pq_check(black_box(&blocks), black_box(&*p), black_box(&*q));
                assert_eq!(verdict, mdkit_parity::PqCheck::Consistent);
            });
        }
    }
}
