//! mdkit-thin: dm-thin provisioning in user space.
//!
//! [`meta`] is the metadata library: kernel-compatible (version 2) btrees, space maps and
//! transactions, with offline check / dump / restore. [`pool`] is the runtime: pools, thin
//! volumes (`mdkit_io::BlockDevice`s), snapshots, discards, commits, over any two devices.

pub mod fuzzing;
pub mod meta;
pub mod pool;
