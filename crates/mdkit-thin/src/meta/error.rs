//! Errors of the metadata engine. Corruption errors name the metadata device, the block, the
//! path of block numbers from the tree root that led there (when known) and the reason.

use std::fmt;
use std::io;

use crate::meta::block::BlockKind;

/// Why a block (or a structure) is not acceptable.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Corruption {
    /// Stored checksum does not match the contents for the expected block type.
    ChecksumMismatch { kind: BlockKind, stored: u32, computed: u32, looks_like: Option<BlockKind> },
    /// The block's self-location field names another block.
    WrongBlockNumber { kind: BlockKind, found: u64 },
    /// Flags / max_entries / value_size of a btree node header are impossible.
    BadNodeHeader(String),
    /// Keys inside a node are not strictly ascending.
    KeysOutOfOrder { index: u32, prev: u64, key: u64 },
    /// A node holds more entries than max_entries.
    TooManyEntries { nr_entries: u32, max_entries: u32 },
    /// A non-root node holds fewer than max_entries / 3 entries.
    TooFewEntries { nr_entries: u32, min_entries: u32 },
    /// The node's value size is not the one this tree stores.
    ValueSizeMismatch { expected: u32, found: u32 },
    /// A parent key is greater than the first key of its child, or leaves overlap.
    KeyRangeViolation(String),
    /// The block is reached again from below itself.
    Cycle,
    /// Reached from more places than its reference count or its type allows.
    ReferencedTwice(String),
    /// A reference to block `target`, past the end of the metadata device.
    BeyondDevice { target: u64, nr_blocks: u64 },
    /// A btree deeper than any valid tree (a cycle that was not caught otherwise).
    TooDeep { depth: usize },
    /// Superblock field out of range.
    BadSuperblock(String),
    /// Space-map structures disagree with themselves or with the counted references.
    BadSpaceMap(String),
    /// Device details and mapping trees disagree.
    BadDevice(String),
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Corruption::ChecksumMismatch { kind, stored, computed, looks_like } => {
                write!(f, "checksum mismatch for a {kind}: stored {stored:#010x}, computed {computed:#010x}")?;
                match looks_like {
                    Some(k) if k != kind => write!(f, " (the block is a valid {k})"),
                    _ => Ok(()),
                }
            }
            Corruption::WrongBlockNumber { kind, found } => {
                write!(f, "{kind} claims to be block {found} (wrong block number)")
            }
            Corruption::BadNodeHeader(s) => write!(f, "bad btree node header: {s}"),
            Corruption::KeysOutOfOrder { index, prev, key } => {
                write!(f, "keys out of order: key[{index}] = {key} <= previous {prev}")
            }
            Corruption::TooManyEntries { nr_entries, max_entries } => {
                write!(f, "too many entries: {nr_entries} > max_entries {max_entries}")
            }
            Corruption::TooFewEntries { nr_entries, min_entries } => {
                write!(f, "too few entries in a non-root node: {nr_entries} < {min_entries}")
            }
            Corruption::ValueSizeMismatch { expected, found } => {
                write!(f, "value size mismatch: expected {expected}, node has {found}")
            }
            Corruption::KeyRangeViolation(s) => write!(f, "key range violation: {s}"),
            Corruption::Cycle => write!(f, "cycle: the block is its own descendant"),
            Corruption::ReferencedTwice(s) => write!(f, "block referenced twice: {s}"),
            Corruption::BeyondDevice { target, nr_blocks } => {
                write!(f, "references block {target}, beyond the end of the device ({nr_blocks} blocks)")
            }
            Corruption::TooDeep { depth } => write!(f, "btree deeper than {depth} levels (cycle?)"),
            Corruption::BadSuperblock(s) => write!(f, "bad superblock: {s}"),
            Corruption::BadSpaceMap(s) => write!(f, "bad space map: {s}"),
            Corruption::BadDevice(s) => write!(f, "bad device: {s}"),
        }
    }
}

/// Block numbers from a tree root down to the block an error is about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockPath(pub Vec<u64>);

impl fmt::Display for BlockPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return Ok(());
        }
        f.write_str(" (path from root: ")?;
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" -> ")?;
            }
            write!(f, "{b}")?;
        }
        f.write_str(")")
    }
}

/// Every error of the metadata engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    /// The metadata device failed a read, write or flush.
    #[error("{device}: metadata {op} failed at block {block}: {source}")]
    Io {
        device: String,
        op: &'static str,
        block: u64,
        #[source]
        source: io::Error,
    },
    /// A metadata block or structure is corrupt. Nothing was written because of it.
    #[error("{device}: corrupt metadata block {block}{path}: {reason}")]
    Corrupt { device: String, block: u64, path: BlockPath, reason: Corruption },
    /// The metadata uses a version or feature this engine does not implement.
    #[error("{device}: unsupported metadata: {reason}")]
    Unsupported { device: String, reason: String },
    #[error("thin device {0} does not exist")]
    NoSuchDevice(u64),
    #[error("thin device {0} already exists")]
    DeviceExists(u64),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `set_transaction_id(expected, _)` found another current id.
    #[error("transaction id mismatch: the pool is at {actual}, the caller expected {expected}")]
    TransactionIdMismatch { expected: u64, actual: u64 },
    /// No free data block (blocks freed in this transaction become free at commit).
    #[error("out of data space: no free block among {nr_blocks} data blocks")]
    OutOfDataSpace { nr_blocks: u64 },
    /// Free metadata blocks fell to the reserve (or to zero). Nothing was changed when this is
    /// returned before an operation; if it happens inside one the transaction is poisoned.
    #[error("out of metadata space: {free_blocks} free of {total_blocks} metadata blocks ({reserve_blocks} reserved)")]
    OutOfMetadataSpace { free_blocks: u64, total_blocks: u64, reserve_blocks: u64 },
    /// An earlier failure left the in-memory transaction unusable; call `abort()` (re-reads the
    /// last commit) before anything else.
    #[error("metadata transaction is poisoned by an earlier error ({reason}); abort it")]
    Poisoned { reason: String },
    /// Opened read-only (or compat_ro flags set): no changes.
    #[error("metadata is read-only: {0}")]
    ReadOnly(String),
    /// A cache-only lookup needed a block that is not in memory (dm-thin's -EWOULDBLOCK):
    /// retry on the metadata thread.
    #[error("lookup needs metadata block {block}, which is not cached")]
    WouldBlock { block: u64 },
    /// Metadata snapshot (held root) misuse.
    #[error("metadata snapshot: {0}")]
    MetadataSnap(String),
    /// A restore failed after it began writing (out of metadata space, I/O error). The old
    /// metadata is gone; `note` says whether the superblock was left cleared, so that no pool,
    /// not even an empty one, opens from the partial result.
    #[error("{device}: the restore failed after it began writing: {source}; {note}")]
    RestoreIncomplete {
        device: String,
        note: &'static str,
        #[source]
        source: Box<MetaError>,
    },
}

impl MetaError {
    /// True for errors that mean the on-disk metadata is damaged.
    pub fn is_corruption(&self) -> bool {
        matches!(self, MetaError::Corrupt { .. })
    }

    /// The block a corruption error is about.
    pub fn corrupt_block(&self) -> Option<u64> {
        match self {
            MetaError::Corrupt { block, .. } => Some(*block),
            _ => None,
        }
    }

    pub(crate) fn with_path_prefix(mut self, prefix: &[u64]) -> MetaError {
        if let MetaError::Corrupt { path, .. } = &mut self {
            let mut p = prefix.to_vec();
            p.append(&mut path.0);
            path.0 = p;
        }
        self
    }
}

pub type Result<T, E = MetaError> = std::result::Result<T, E>;
