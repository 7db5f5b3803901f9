//! The crate's kernel-lab tests (qemu guests, ../shared/lab) as a binary of their own, beside
//! tests/suite.rs. scripts/run-tests starts it first, so the slowest tests of the crate begin at
//! once and run beside the other binaries instead of forming the suite's tail: in one binary
//! the labs ran where the test names sorted them, two at a time, and on a busy machine the md
//! suite went on alone for six minutes after every other binary had finished.

mod array_util;
mod bitmap_support;
mod common;

mod array_lab;
mod badblocks_lab;
mod bitmap_lab;
mod format_lab;
mod grow_lab;
mod raid5_lab;
mod reshape_lab;
mod takeover_lab;
