//! mdkit-thin: dm-thin provisioning in user space.
//!
//! [`meta`] is the metadata library: kernel-compatible (version 2) btrees, space maps and
//! transactions, with offline check / dump / restore. The pool runtime builds on it.

pub mod meta;
