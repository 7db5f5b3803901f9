//! The committed fuzz corpus of this crate's targets, replayed (fuzz/corpus_replay.rs).

use mdkit_md::format::badblocks;
use mdkit_md::format::bitmap::BitmapSuper;
use mdkit_md::format::superblock::Superblock;
use mdkit_md::fuzzing;

use crate::corpus_replay::replay;

#[test]
fn md_superblock_corpus() {
    let seeds = replay("md_superblock", fuzzing::superblock);
    assert!(seeds >= fuzzing::seed_superblocks().len(), "the md_superblock seeds are committed");
}

#[test]
fn md_bitmap_corpus() {
    let seeds = replay("md_bitmap", fuzzing::bitmap);
    assert!(seeds >= fuzzing::seed_bitmaps().len(), "the md_bitmap seeds are committed");
}

#[test]
fn md_assemble_corpus() {
    assert!(replay("md_assemble", fuzzing::assemble) >= 24, "the md_assemble seeds are committed");
}

/// The seeds are what mdkit's create writes: a valid superblock and bitmap each, and a
/// bad-block log page.
#[test]
fn md_seeds_decode() {
    for s in fuzzing::seed_superblocks() {
        assert!(Superblock::decode(&s, 8).is_ok());
        fuzzing::superblock(&s);
    }
    let bitmaps = fuzzing::seed_bitmaps();
    let (log, bitmaps) = bitmaps.split_last().unwrap();
    for s in bitmaps {
        assert!(BitmapSuper::decode(s).is_ok());
        fuzzing::bitmap(s);
    }
    assert_eq!(badblocks::decode(log, 0).unwrap().len(), 3);
}

/// Regenerates the committed seeds of md_superblock and md_bitmap:
/// `cargo test --profile suite -p mdkit-md --test suite write_md_seed_corpus -- --ignored`.
#[test]
#[ignore = "writes fuzz/corpus; run by hand when the seeds change"]
fn write_md_seed_corpus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    for (target, seeds) in [("md_superblock", fuzzing::seed_superblocks()), ("md_bitmap", fuzzing::seed_bitmaps())] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
        }
    }
}
