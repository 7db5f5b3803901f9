//! dm-thin metadata, version 2, byte-compatible with the Linux kernel and
//! thin-provisioning-tools: read, write, check, dump and restore.
//!
//! # Layers
//! ```text
//!   thin.rs      ThinMetadata: devices, mappings, snapshots, data refcounts, commit/abort
//!   check.rs     offline checker (thin_check equivalent), xml.rs: thin_dump / thin_restore
//!   repair.rs    thin_repair: tolerant walk of damaged metadata, rewritten elsewhere
//!   delta.rs     thin_delta: blocks that differ between two thin devices
//!   btree.rs     copy-on-write btrees with shared, reference-counted subtrees
//!   dsm.rs       data space map (bitmaps + index btree + ref-count btree, on disk)
//!   msm.rs       metadata space map (in memory during a transaction, written at commit)
//!   tm.rs        transaction manager: shadowing, dirty blocks, commit protocol
//!   cache.rs     bounded, sharded cache of clean validated blocks
//!   block.rs     4 KiB blocks, salted crc32c, self-location; io.rs: MetaIo (file, device, RAM)
//! ```
//!
//! # Transactions
//! Every change goes to new blocks (shadowing); nothing the last commit references is ever
//! overwritten, and blocks freed in a transaction are not reused before it commits. `commit()`
//! writes the new blocks, flushes, writes the superblock, flushes. A crash at any point leaves
//! the last commit intact. `abort()` re-reads the last commit. An error in the middle of an
//! operation *poisons* the transaction (in-memory state may be half-changed); the device is
//! untouched and `abort()` recovers. Out-of-data-space from `alloc_data_block` changes nothing.
//! Operations refuse to start when free metadata falls to the reserve (min(4096 blocks,
//! total/10)), so a commit always has room.
//!
//! # Concurrency: the fast path
//! The engine has one writer and many readers, the kernel's design (`pmd->root_lock`):
//! put it in a `parking_lot::RwLock` (see [`SharedMetadata`]). Lookups take `&self`:
//!
//! - [`ThinMetadata::lookup_cached`] never touches the device. It walks the current (possibly
//!   uncommitted) trees using the dirty set and the shared block cache, and returns
//!   `Err(MetaError::WouldBlock)` when a node is not in memory: the data path then defers the
//!   request to the metadata thread, exactly like dm-thin's `dm_thin_find_block(.., false)`.
//!   With a warm cache (64 KiB data blocks: one 4 KiB leaf maps up to 252 x 64 KiB ≈ 16 MiB),
//!   nearly every lookup is served from memory under the read lock.
//! - [`ThinMetadata::lookup`] may read the device; call it on the metadata thread.
//! - Mutations (`provision`, `insert`, `remove`, `create_snap`, `commit`, ...) take `&mut self`
//!   under the write lock, on the metadata thread. Each holds the lock for microseconds unless
//!   it misses the cache; `commit()` holds it across I/O.
//! - A write may skip deferral and commit iff `lookup_cached` returns a mapping with
//!   `shared == false` and, for REQ_FUA/flush semantics, `!changed_this_transaction(dev)`
//!   (guide lesson 5; dm-thin's `bio_triggers_commit`).
//!
//! The metadata device I/O is synchronous ([`MetaIo`]); over an async `BlockDevice` use
//! [`DeviceMetaIo`] from the dedicated metadata thread.
//!
//! # Using it from a pool runtime (dm-thin's rules)
//! - Read to vblock: `lookup_cached` → mapped: read data block `m.data_block`; unmapped: zeroes
//!   (or the external origin); `WouldBlock`: defer to the metadata thread (`lookup`).
//! - Write to vblock: mapped and `!m.shared` → write in place (FUA/flush: commit first if
//!   `changed_this_transaction(dev)`). Unmapped → `provision` (zero the block unless the write
//!   covers it). Shared → `provision` as well (breaks sharing: new block, old reference
//!   dropped; copy the old block's data first unless the write covers it).
//! - Flush/FUA: `commit()` if anything changed (`has_uncommitted_changes`), at least every
//!   second otherwise (dm-thin COMMIT_PERIOD).
//! - Discard: `remove_range_mappings`; to pass down, `inc_data_block` every returned block
//!   whose count is now 0, commit, discard on the data device, `dec_data_block` (a block the
//!   last commit still maps is never discarded or reused).
//! - `OutOfDataSpace` changes nothing (queue or error I/O, per `error_if_no_space`).
//!   `OutOfMetadataSpace` before an operation changes nothing; the pool should go read-only.
//!   Any other error leaves the transaction poisoned: `abort()`, `set_needs_check()`, go
//!   read-only, report. On open, `needs_check()` means: run `check` before going read-write
//!   (the kernel opens such a pool read-only).
//! - Messages: `create_thin`, `create_snap` (origin quiesced first), `delete`,
//!   `set_transaction_id`, `reserve_metadata_snap` / `release_metadata_snap`; status:
//!   `status()` (the `dmsetup status` numbers), `device_details` + `highest_mapped` for a thin.

pub mod block;
mod btree;
pub mod cache;
pub mod check;
pub mod delta;
mod dsm;
pub mod error;
pub mod io;
mod msm;
pub mod repair;
pub mod sm_format;
pub mod superblock;
mod thin;
mod tm;
pub mod xml;

pub use btree::{NodeView, ReadMode, calc_max_entries, validate_node};
pub use check::{CheckIssue, CheckOptions, CheckReport, check, clear_needs_check};
pub use dsm::MAX_DATA_BLOCKS;
pub use error::{BlockPath, Corruption, MetaError, Result};
pub use io::{DeviceMetaIo, FileMetaIo, MemMetaIo, MetaIo};
pub use superblock::Superblock;
pub use thin::{
    BLOCK_TIME_BYTES, DEVICE_DETAILS_BYTES, DeviceDetails, FormatOptions, MAX_DEVICE_ID, Mapping, OpenOptions,
    PoolStatus, ThinMetadata, pack_block_time, unpack_block_time,
};
pub use xml::{
    XmlDevice, XmlMapping, XmlMetadata, dump_xml, parse_xml, restore_xml, snapshot_xml_metadata, to_xml_metadata,
};

/// The engine shared between the metadata thread (writer) and the data path (readers).
pub type SharedMetadata = std::sync::Arc<parking_lot::RwLock<ThinMetadata>>;
