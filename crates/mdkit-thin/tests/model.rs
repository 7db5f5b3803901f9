//! Randomized model test: the engine against plain maps across commits, aborts, reopens and
//! injected I/O errors. The seed is printed; rerun with MDKIT_SEED=<n> to reproduce.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use mdkit_io::Rng;
use mdkit_thin::meta::{CheckOptions, FormatOptions, MemMetaIo, MetaError, MetaIo, OpenOptions, ThinMetadata, check};

fn seed() -> u64 {
    std::env::var("MDKIT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x00de_c0de)
}

#[test]
fn engine_matches_model_across_commit_abort_reopen() {
    let seed = seed();
    eprintln!("MDKIT_SEED={seed}");
    let mem = Arc::new(MemMetaIo::new("model.meta", 8192));
    let io: Arc<dyn MetaIo> = mem.clone();
    // A small cache and early write-back exercise eviction and re-reading.
    let opts = OpenOptions { cache_blocks: 256, writeback_threshold_blocks: 64, ..Default::default() };
    let mut md = ThinMetadata::format_with(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 60_000, metadata_nr_blocks: None },
        opts,
    )
    .unwrap();
    let mut model = Model::default();
    let mut committed = model.clone();
    let mut rng = Rng::new(seed);
    let mut ops = 0u64;
    for step in 0..150 {
        for _ in 0..(100 + rng.below(700)) {
            let what = random_op(&mut md, &mut model, &mut rng, 10, 3000);
            ops += 1;
            if std::env::var("MDKIT_DEBUG").is_ok() && step >= 7 {
                assert_matches(&md, &model, &format!("step {step} op {ops}: {what}"));
            }
        }
        match rng.below(10) {
            0..=5 => {
                md.commit().unwrap();
                committed = model.clone();
                let r = check(&*io, &CheckOptions::default());
                assert!(r.is_clean() && r.warnings.is_empty(), "step {step} seed {seed}:\n{r}");
            }
            6..=7 => {
                md.abort().unwrap();
                model = committed.clone();
            }
            _ => {
                // Crash-free restart: uncommitted work is gone.
                drop(md);
                md = ThinMetadata::open_with(io.clone(), opts).unwrap();
                model = committed.clone();
            }
        }
        assert_matches(&md, &model, &format!("step {step} seed {seed}"));
    }
    eprintln!("{ops} operations, {} devices, status {:?}", model.devices.len(), md.status());
}

#[test]
fn io_error_during_commit_poisons_then_abort_recovers() {
    let mem = Arc::new(MemMetaIo::new("fail.meta", 4096));
    let io: Arc<dyn MetaIo> = mem.clone();
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 10_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(3);
    for _ in 0..500 {
        random_op(&mut md, &mut model, &mut rng, 4, 2000);
    }
    md.commit().unwrap();
    let committed = model.clone();
    for _ in 0..500 {
        random_op(&mut md, &mut model, &mut rng, 4, 2000);
    }
    // Fail the 3rd write call of the commit, and check the superblock never moved.
    let before = mem.peek(0);
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    mem.set_hook(Some(Box::new(move |w| {
        if w.is_some() && c.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(std::io::Error::other("injected write error"));
        }
        Ok(())
    })));
    let e = md.commit().unwrap_err();
    assert!(matches!(e, MetaError::Io { op: "write", .. }), "{e}");
    assert_eq!(*mem.peek(0), *before, "superblock untouched by a failed commit");
    assert!(md.is_poisoned().is_some());
    assert!(matches!(md.create_thin(77), Err(MetaError::Poisoned { .. })));
    mem.set_hook(None);
    md.set_needs_check().unwrap();
    md.abort().unwrap();
    assert!(md.needs_check(), "needs_check was written to the committed superblock");
    assert_matches(&md, &committed, "after abort");
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    assert!(r.needs_check_flag);
    // What thin_check --clear-needs-check-flag does, offline.
    drop(md);
    let r = mdkit_thin::meta::clear_needs_check(&*io, &CheckOptions::default()).unwrap();
    assert!(r.is_clean() && !r.needs_check_flag);
    let mut md = ThinMetadata::open(io.clone()).unwrap();
    assert!(!md.needs_check());
    // The pool works again.
    let mut model = committed;
    for _ in 0..300 {
        random_op(&mut md, &mut model, &mut rng, 4, 2000);
    }
    md.commit().unwrap();
    assert_matches(&md, &model, "after recovery");
}

#[test]
fn out_of_data_space_changes_nothing_and_frees_become_usable_after_commit() {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("ods.meta", 1024));
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 100, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(1).unwrap();
    for vb in 0..100 {
        md.provision(1, vb).unwrap();
    }
    assert!(matches!(md.provision(1, 100), Err(MetaError::OutOfDataSpace { nr_blocks: 100 })));
    assert!(md.is_poisoned().is_none(), "out of data space does not poison");
    assert_eq!(md.device_details(1).unwrap().mapped_blocks, 100);
    md.commit().unwrap();
    // Freed in this transaction: not reusable until commit (the last commit still maps them).
    assert_eq!(md.remove_range(1, 0, 10).unwrap(), 10);
    assert!(matches!(md.alloc_data_block(), Err(MetaError::OutOfDataSpace { .. })));
    md.commit().unwrap();
    let b = md.alloc_data_block().unwrap();
    assert!(b < 10, "a block freed by the last transaction is reused after commit");
    md.dec_data_block(b).unwrap();
    md.commit().unwrap();
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
}

#[test]
fn out_of_metadata_space_is_refused_up_front_and_commit_still_fits() {
    // 64 blocks of metadata: the reserve (8 floor) and a handful of nodes.
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("oms.meta", 96));
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1_000_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    let mut mapped = 0u64;
    let err = loop {
        match md.provision(0, mapped * 7) {
            Ok(_) => mapped += 1,
            Err(e) => break e,
        }
        if mapped.is_multiple_of(500) {
            md.commit().unwrap();
        }
    };
    assert!(matches!(err, MetaError::OutOfMetadataSpace { .. }), "{err}");
    assert!(md.is_poisoned().is_none(), "refused before changing anything: {:?}", md.is_poisoned());
    md.commit().unwrap();
    let md2 = ThinMetadata::open(io.clone()).unwrap();
    assert_eq!(md2.device_details(0).unwrap().mapped_blocks, mapped);
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    eprintln!("{mapped} mappings fit in 96 metadata blocks; status {:?}", md2.status());
}

#[test]
fn transaction_id_cas_and_bad_arguments() {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("args.meta", 256));
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 100, metadata_nr_blocks: None },
    )
    .unwrap();
    assert!(matches!(md.set_transaction_id(1, 2), Err(MetaError::TransactionIdMismatch { expected: 1, actual: 0 })));
    md.set_transaction_id(0, 5).unwrap();
    md.commit().unwrap();
    assert_eq!(ThinMetadata::open(io.clone()).unwrap().transaction_id(), 5);
    assert!(matches!(md.create_thin(1 << 24), Err(MetaError::InvalidArgument(_))));
    assert!(matches!(md.create_snap(1, 0), Err(MetaError::NoSuchDevice(0))));
    md.create_thin(0).unwrap();
    assert!(matches!(md.create_thin(0), Err(MetaError::DeviceExists(0))));
    assert!(matches!(md.insert(0, 0, 100), Err(MetaError::InvalidArgument(_))));
    assert!(matches!(md.delete(9), Err(MetaError::NoSuchDevice(9))));
    assert!(md.is_poisoned().is_none());
    for bad in [0u32, 64, 129, 4_194_304] {
        let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("bs.meta", 256));
        let r = ThinMetadata::format(
            io,
            FormatOptions { data_block_size_sectors: bad, nr_data_blocks: 1, metadata_nr_blocks: None },
        );
        assert!(matches!(r, Err(MetaError::InvalidArgument(_))), "{bad}");
    }
}

#[test]
fn discard_passdown_protocol_holds_blocks_until_the_discard_is_done() {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("discard.meta", 1024));
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 64, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    for vb in 0..64 {
        md.provision(0, vb).unwrap();
    }
    md.create_snap(1, 0).unwrap();
    md.commit().unwrap();
    // Discard 0..32 of the snapshot: the origin still maps those blocks, so none is free and
    // nothing may be passed down.
    let gone = md.remove_range_mappings(1, 0, 32).unwrap();
    assert_eq!(gone.len(), 32);
    assert!(gone.iter().all(|(_, m)| md.data_block_ref_count(m.data_block).unwrap() >= 1));
    // Discard 0..16 of the origin: those blocks are now free -> hold, commit, "discard", release.
    let gone = md.remove_range_mappings(0, 0, 16).unwrap();
    let free: Vec<u64> =
        gone.iter().map(|(_, m)| m.data_block).filter(|b| md.data_block_ref_count(*b).unwrap() == 0).collect();
    assert_eq!(free.len(), 16);
    for &b in &free {
        md.inc_data_block(b).unwrap();
    }
    md.commit().unwrap();
    // (discard on the data device happens here; nothing can allocate these blocks)
    assert!(matches!(md.alloc_data_block(), Err(MetaError::OutOfDataSpace { .. })));
    for &b in &free {
        assert_eq!(md.dec_data_block(b).unwrap(), 0);
    }
    md.commit().unwrap();
    let b = md.alloc_data_block().unwrap();
    assert!(free.contains(&b));
    md.dec_data_block(b).unwrap();
    md.commit().unwrap();
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
}

/// A data block mapped by 301 leaves (one per snapshot) has a count beyond what a space-map
/// bitmap entry holds (the overflow tree has it) and beyond the checker's one-byte counter per
/// block: the checker still counts it exactly, so the clean pool checks clean and one extra
/// reference is reported with both exact counts.
#[test]
fn checker_counts_a_data_block_shared_by_301_leaves_exactly() {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("shared.meta", 1024));
    let fo = FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1000, metadata_nr_blocks: None };
    let mut md = ThinMetadata::format(io.clone(), fo).unwrap();
    md.create_thin(0).unwrap();
    let b = md.provision(0, 0).unwrap().data_block;
    for dev in 1..=300 {
        md.create_snap(dev, 0).unwrap();
        // Writing elsewhere in the snapshot copies its leaf, which references `b` once more.
        md.provision(dev, 1).unwrap();
    }
    md.commit().unwrap();
    assert_eq!(md.data_block_ref_count(b).unwrap(), 301);
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");

    md.inc_data_block(b).unwrap();
    md.commit().unwrap();
    let r = check(&*io, &CheckOptions::default());
    let want = format!("data block {b}: reference count 302 in the space map, 301 counted (leaked)");
    assert!(r.errors.iter().any(|e| e.message == want), "{r}");
    assert_eq!(r.errors.len(), 1, "{r}");
}
