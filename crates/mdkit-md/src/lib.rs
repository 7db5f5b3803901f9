//! mdkit-md: Linux md RAID rebuilt in user space.
//!
//! - [`format`]: the on-disk formats, byte-compatible with the kernel and mdadm: the v1.x
//!   superblock, the write-intent bitmap, the bad-block log, array planning as
//!   `mdadm --create` does it, and `mdadm --examine`-style rendering.
//! - [`layout`]: the kernel's exact data placement for raid0/1/10/4/5/6 (array sector ↔ member
//!   sector), stripe descriptions for parity RAID and array sizes.
//!
//! Everything here is pure and synchronous: no I/O. The array runtime reads and writes members
//! through `mdkit_io::BlockDevice` and uses these modules to interpret what it reads.

pub mod format;
pub mod layout;
