//! The fast path: cache-only lookups from many threads under a read lock while the metadata
//! thread provisions, breaks sharing and commits under the write lock. Readers must only ever
//! see complete states: a block they find mapped is one the writer mapped (or mapped before).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_thin::meta::{FormatOptions, MemMetaIo, MetaError, MetaIo, SharedMetadata, ThinMetadata};
use parking_lot::RwLock;

#[test]
fn cached_lookups_run_beside_the_writer() {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("concurrent.meta", 16384));
    let mut md = ThinMetadata::format(
        io,
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1_000_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    // vblock v of device 0 always maps to data block 2v (allocated in order) or is unmapped.
    for v in 0..50_000u64 {
        let b = md_alloc(&mut md, 2 * v);
        md.insert(0, v, b).unwrap();
    }
    md.commit().unwrap();
    let shared: SharedMetadata = Arc::new(RwLock::new(md));
    let stop = Arc::new(AtomicBool::new(false));
    let hits = Arc::new(AtomicU64::new(0));
    let would_block = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let (shared, stop, hits, would_block) = (shared.clone(), stop.clone(), hits.clone(), would_block.clone());
            std::thread::spawn(move || {
                let mut v = t * 7919;
                while !stop.load(Ordering::Relaxed) {
                    v = (v + 104_729) % 60_000;
                    let md = shared.read();
                    match md.lookup_cached(0, v) {
                        Ok(Some(m)) => {
                            assert_eq!(m.data_block, 2 * v, "reader saw a wrong mapping for {v}");
                            hits.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => assert!(v >= 50_000 || v % 3 == 0, "mapping {v} vanished"),
                        Err(MetaError::WouldBlock { .. }) => {
                            would_block.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("lookup: {e}"),
                    }
                }
            })
        })
        .collect();
    // The writer: remove every third block, add 50_000.., snapshot, commit, repeatedly.
    let start = Instant::now();
    for round in 0..5u64 {
        let mut md = shared.write();
        for v in (round * 3000..(round + 1) * 3000).filter(|v| v % 3 == 0) {
            md.remove(0, v).unwrap();
        }
        drop(md);
        for v in 50_000 + round * 2000..50_000 + (round + 1) * 2000 {
            let mut md = shared.write();
            let b = md_alloc(&mut md, 2 * v);
            md.insert(0, v, b).unwrap();
        }
        let mut md = shared.write();
        md.create_snap(round + 1, 0).unwrap();
        md.commit().unwrap();
    }
    let writer_time = start.elapsed();
    // The readers run until they have done enough lookups (a counter, not a time: on a busy
    // machine they may have had little CPU while the writer ran); the limit is a hang guard.
    while hits.load(Ordering::Relaxed) <= 1000 {
        assert!(start.elapsed() < Duration::from_secs(60), "readers made no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    eprintln!(
        "writer: {:?}; readers: {} hits, {} would-block",
        writer_time,
        hits.load(Ordering::Relaxed),
        would_block.load(Ordering::Relaxed)
    );
    assert!(hits.load(Ordering::Relaxed) > 1000);
}

/// Allocates data blocks until `want` comes up (blocks are handed out in order from 0 here),
/// releasing the ones in between.
fn md_alloc(md: &mut ThinMetadata, want: u64) -> u64 {
    loop {
        let b = md.alloc_data_block().unwrap();
        if b == want {
            return b;
        }
        assert!(b < want, "allocator skipped {want}");
        md.dec_data_block(b).unwrap();
        // Freed blocks are not reused before commit, so the cursor moves on.
    }
}
