//! Metadata engine micro-benchmark (not a test): provisioning, commits, warm cache-only
//! lookups (single thread and under a shared read lock), break-sharing after a snapshot, and a
//! full check, on a metadata file on a real filesystem.
//!
//!   cargo run --release -p mdkit-thin --example meta_bench -- [DIR] [MAPPINGS]

use std::sync::Arc;
use std::time::Instant;

use mdkit_io::Rng;
use mdkit_thin::meta::{CheckOptions, FileMetaIo, FormatOptions, MetaIo, SharedMetadata, ThinMetadata, check};
use parking_lot::RwLock;

fn rate(n: u64, t: std::time::Duration) -> String {
    format!("{:>10.0}/s ({:.2} us each)", n as f64 / t.as_secs_f64(), t.as_secs_f64() * 1e6 / n as f64)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).cloned().unwrap_or_else(|| "/var/tmp".into());
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let path = std::path::Path::new(&dir).join("mdkit-meta-bench.meta");
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    f.set_len(1 << 30).unwrap();
    let io: Arc<dyn MetaIo> = Arc::new(FileMetaIo::from_file(f, path.display().to_string()).unwrap());
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 4 * n, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();

    let t = Instant::now();
    for vb in 0..n {
        md.provision(0, vb).unwrap();
    }
    let t_prov = t.elapsed();
    let t = Instant::now();
    md.commit().unwrap();
    let t_commit = t.elapsed();
    println!("sequential provision {n}: {}; commit {:?}", rate(n, t_prov), t_commit);

    let mut rng = Rng::new(1);
    let t = Instant::now();
    let mut hits = 0u64;
    for _ in 0..n {
        if md.lookup_cached(0, rng.below(n)).map(|m| m.is_some()).unwrap_or(false) {
            hits += 1;
        }
    }
    println!("cache-only lookups (1 thread): {} ({hits} hits)", rate(n, t.elapsed()));

    let shared: SharedMetadata = Arc::new(RwLock::new(md));
    let threads = 2u64;
    let t = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let s = shared.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::new(10 + i);
                for _ in 0..n {
                    let _ = s.read().lookup_cached(0, rng.below(n));
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    println!("cache-only lookups under RwLock ({threads} threads): {}", rate(threads * n, t.elapsed()));

    let mut md = Arc::try_unwrap(shared).unwrap().into_inner();
    md.create_snap(1, 0).unwrap();
    let k = n / 10;
    let t = Instant::now();
    for _ in 0..k {
        md.provision(0, rng.below(n)).unwrap();
    }
    let t_break = t.elapsed();
    let t = Instant::now();
    md.commit().unwrap();
    println!("random break-sharing {k}: {}; commit {:?}", rate(k, t_break), t.elapsed());
    let t = Instant::now();
    for i in 0..1000u64 {
        md.provision(1, n + i).unwrap();
        md.commit().unwrap();
    }
    println!("provision + commit (fdatasync x2) each: {}", rate(1000, t.elapsed()));
    let st = md.status();
    println!("status: {st:?}");
    drop(md);
    let t = Instant::now();
    let r = check(&*io, &CheckOptions::default());
    println!("check: {:?}, clean={} ({} mappings)", t.elapsed(), r.is_clean(), r.nr_mappings);
    let _ = std::fs::remove_file(&path);
}
