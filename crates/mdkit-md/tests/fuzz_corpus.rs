//! The committed fuzz corpus of this crate's targets, replayed (fuzz/corpus_replay.rs).

use mdkit_md::fuzzing;

use crate::corpus_replay::replay;

#[test]
fn md_superblock_corpus() {
    replay("md_superblock", fuzzing::superblock);
}

#[test]
fn md_bitmap_corpus() {
    replay("md_bitmap", fuzzing::bitmap);
}

#[test]
fn md_assemble_corpus() {
    assert!(replay("md_assemble", fuzzing::assemble) >= 24, "the md_assemble seeds are committed");
}
