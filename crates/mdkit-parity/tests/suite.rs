//! The crate's integration tests as one binary: each tests/*.rs file is a module here, so the
//! suite compiles and links one test binary per crate instead of one per file (each file used
//! to be its own crate that optimised its own copies of the shared generics, then linked).
//! A new test file needs a `mod` line below; shared helpers are reached with `use crate::...`.

mod common;

mod kernel_crosscheck;
mod parity;
mod selection;
