//! The crate's integration tests as one binary: each tests/*.rs file is a module here, so the
//! suite compiles and links one test binary per crate instead of one per file (most of a
//! from-scratch build's time was spent optimising and linking ~70 near-identical binaries).
//! A new test file needs a `mod` line below; shared helpers are reached with `use crate::...`.

mod abuse;
mod block_status;
mod fuzz_corpus;
mod server;
