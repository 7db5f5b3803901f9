//! mdkit-md: Linux md RAID rebuilt in user space.
//!
//! - [`format`]: the on-disk formats, byte-compatible with the kernel and mdadm: the v1.x
//!   superblock, the write-intent bitmap, the bad-block log, array planning as
//!   `mdadm --create` does it, and `mdadm --examine`-style rendering.
//! - [`layout`]: the kernel's exact data placement for raid0/1/10/4/5/6 (array sector ↔ member
//!   sector), stripe descriptions for parity RAID and array sizes.
//! - [`array`]: the array runtime: an assembled (or newly created) array is an
//!   `mdkit_io::BlockDevice` over its members, with raid0/1/10 personalities, member failure,
//!   dirty/clean tracking, spares, resync/recovery/check/repair and md's sysfs attributes.
//!
//! `format` and `layout` are pure and synchronous: no I/O. The array runtime reads and writes
//! members through `mdkit_io::BlockDevice` and uses them to interpret what it reads.

pub mod array;
pub mod format;
pub mod fuzzing;
pub mod layout;
