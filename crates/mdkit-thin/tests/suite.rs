//! The crate's integration tests as one binary: each tests/*.rs file is a module here, so the
//! suite compiles and links one test binary per crate instead of one per file (each file used
//! to be its own crate that optimised its own copies of the shared generics, then linked).
//! A new test file needs a `mod` line below; shared helpers are reached with `use crate::...`.

mod common;
#[path = "../../../fuzz/corpus_replay.rs"]
mod corpus_replay;
mod pool_util;

mod concurrent;
mod corruption;
mod crash;
mod device_io;
mod external_origin;
mod external_origin_lab;
mod fuzz_corpus;
mod kernel_lab;
mod metadata_space;
mod model;
mod no_panic;
mod pool_bad_input;
mod pool_concurrent;
mod pool_crash;
mod pool_grow_kernel_lab;
mod pool_kernel_lab;
mod pool_open_safety;
mod pool_tools;
mod restore_refusals;
mod tools_interop;
mod tools_repair_delta;
