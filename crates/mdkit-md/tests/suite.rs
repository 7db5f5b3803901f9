//! The crate's integration tests as one binary: each tests/*.rs file is a module here, so the
//! suite compiles and links one test binary per crate instead of one per file (each file used
//! to be its own crate that optimised its own copies of the shared generics, then linked).
//! A new test file needs a `mod` line below; shared helpers are reached with `use crate::...`.
//! Tests that boot the kernel lab are in the second binary, tests/lab.rs.

mod array_util;
mod bitmap_support;
mod common;
#[path = "../../../fuzz/corpus_replay.rs"]
mod corpus_replay;

mod array_assemble;
mod array_badblocks;
mod array_bitmap;
mod array_check;
mod array_crash;
mod array_examine;
mod array_faults;
mod array_grow;
mod array_roundtrip;
mod assemble_corruption;
mod bitmap_array_crash;
mod bitmap_crash;
mod bitmap_io_size;
mod bitmap_mdadm;
mod bitmap_resync;
mod bitmap_write_intent;
mod flush_batching;
mod format_corruption;
mod format_mdadm_examine;
mod fuzz_corpus;
mod grow_crash;
mod layout_roundtrip;
mod member_errors;
mod raid5_concurrency;
mod raid5_crash;
mod raid5_examine;
mod raid5_faults;
mod raid5_roundtrip;
mod raid5_scrub;
mod raid5_write_path;
mod reshape;
mod reshape_crash;
mod sync_action;
mod write_behind;
mod write_behind_crash;
