//! Pool state shared by the metadata worker and the data path: transaction numbers, mode,
//! free space, counters. Only atomics and short locks; nothing here is touched by the fast
//! path except `mode` (one relaxed load) and `committed_txn` (FUA writes).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, watch};

use super::PoolOptions;

/// Whether the pool accepts writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// Normal operation (`rw`; `out_of_data_space` in status when no data block is free).
    ReadWrite,
    /// Opened read-only, NEEDS_CHECK set on open, or metadata space exhausted (`ro`).
    ReadOnly,
    /// A metadata operation failed: the transaction was aborted and NEEDS_CHECK set. Writes
    /// fail; reads of committed mappings continue (`Fail` in dm-thin's status).
    Failed,
}

/// Why the pool is in its mode: what the volume layer and status match on (never the text of
/// the reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ModeCause {
    /// Read-write, nothing to report.
    #[default]
    None,
    /// Opened read-only on request (`read_only` option).
    ReadOnlyOption,
    /// NEEDS_CHECK was set in the superblock when the pool opened: check/repair offline.
    NeedsCheck,
    /// Metadata space ran out; growing the metadata device cures it.
    MetadataSpaceExhausted,
    /// A metadata operation failed: transaction aborted, NEEDS_CHECK set (mode `Failed`).
    MetadataFailure,
}

impl ModeCause {
    /// True when the metadata must be checked offline before the pool is used read-write.
    pub fn needs_check(self) -> bool {
        matches!(self, ModeCause::NeedsCheck | ModeCause::MetadataFailure)
    }
}

const MODE_RW: u8 = 0;
const MODE_RO: u8 = 1;
const MODE_FAILED: u8 = 2;

/// Event counters of a pool (slow path and worker; the fast path counts per volume).
#[derive(Default)]
pub(crate) struct Counters {
    pub commits: AtomicU64,
    pub commit_rounds: AtomicU64,
    pub provisions: AtomicU64,
    pub sharing_breaks: AtomicU64,
    pub zeroed_blocks: AtomicU64,
    pub discarded_blocks: AtomicU64,
    pub passdown_blocks: AtomicU64,
    pub passdown_errors: AtomicU64,
    pub no_space_waits: AtomicU64,
    pub no_space_errors: AtomicU64,
    pub worker_lookups: AtomicU64,
}

pub(crate) struct PoolState {
    pub name: String,
    pub block_bytes: u64,
    pub opts: PoolOptions,
    /// Passdown is effective (configured, and the data device supports discard).
    pub passdown: bool,
    /// Transaction mappings inserted now belong to (changed only by the worker, under the
    /// metadata write lock).
    pub open_txn: AtomicU64,
    /// Last transaction whose commit completed.
    pub committed_txn: AtomicU64,
    /// Uncommitted metadata changes exist (mappings, devices, transaction id).
    pub meta_dirty: AtomicBool,
    mode: AtomicU8,
    mode_reason: Mutex<(ModeCause, String)>,
    pub closed: AtomicBool,
    pub free_data_blocks: AtomicU64,
    pub total_data_blocks: AtomicU64,
    /// Bumped whenever data space may have become available (commit, resize, close).
    pub space_gen: AtomicU64,
    pub space_notify: Notify,
    pub low_water_reached: AtomicBool,
    /// The low-water mark in data blocks (from `opts`; changed by `Pool::set_low_water_blocks`).
    pub low_water_blocks: AtomicU64,
    /// Counts times the low-water mark was reached (dm-thin's low-water dm event).
    pub low_water_events: watch::Sender<u64>,
    pub counters: Counters,
}

impl PoolState {
    pub fn new(name: String, block_bytes: u64, opts: PoolOptions, passdown: bool) -> PoolState {
        let low_water_blocks = opts.low_water_blocks;
        PoolState {
            name,
            block_bytes,
            opts,
            passdown,
            open_txn: AtomicU64::new(1),
            committed_txn: AtomicU64::new(0),
            meta_dirty: AtomicBool::new(false),
            mode: AtomicU8::new(MODE_RW),
            mode_reason: Mutex::new((ModeCause::None, String::new())),
            closed: AtomicBool::new(false),
            free_data_blocks: AtomicU64::new(0),
            total_data_blocks: AtomicU64::new(0),
            space_gen: AtomicU64::new(0),
            space_notify: Notify::new(),
            low_water_reached: AtomicBool::new(false),
            low_water_blocks: AtomicU64::new(low_water_blocks),
            low_water_events: watch::Sender::new(0),
            counters: Counters::default(),
        }
    }

    pub fn mode(&self) -> PoolMode {
        match self.mode.load(Ordering::Acquire) {
            MODE_RW => PoolMode::ReadWrite,
            MODE_RO => PoolMode::ReadOnly,
            _ => PoolMode::Failed,
        }
    }

    pub fn mode_reason(&self) -> String {
        self.mode_reason.lock().1.clone()
    }

    pub fn mode_cause(&self) -> ModeCause {
        self.mode_reason.lock().0
    }

    /// Moves to `mode` (never back from Failed) with its cause and a reason for status and
    /// errors.
    pub fn set_mode(&self, mode: PoolMode, cause: ModeCause, reason: impl Into<String>) {
        let mut r = self.mode_reason.lock();
        if self.mode() == PoolMode::Failed {
            return;
        }
        *r = (cause, reason.into());
        let v = match mode {
            PoolMode::ReadWrite => MODE_RW,
            PoolMode::ReadOnly => MODE_RO,
            PoolMode::Failed => MODE_FAILED,
        };
        self.mode.store(v, Ordering::Release);
        drop(r);
        // Writers queued for space must see the new mode.
        self.wake_space_waiters();
    }

    /// Ok when writes may proceed; otherwise the error the write fails with.
    pub fn check_writable(&self) -> io::Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("thin pool {}: closed", self.name)));
        }
        match self.mode() {
            PoolMode::ReadWrite => Ok(()),
            PoolMode::ReadOnly => Err(io::Error::new(
                io::ErrorKind::ReadOnlyFilesystem,
                format!("thin pool {} is read-only: {}", self.name, self.mode_reason()),
            )),
            PoolMode::Failed => Err(io::Error::other(format!(
                "thin pool {} has failed (needs_check): {}",
                self.name,
                self.mode_reason()
            ))),
        }
    }

    pub fn check_open(&self) -> io::Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("thin pool {}: closed", self.name)));
        }
        Ok(())
    }

    /// Mappings of transactions after this one are not trusted by reads (after a failure
    /// the metadata went back to the last commit).
    pub fn max_valid_txn(&self) -> u64 {
        if self.mode() == PoolMode::Failed { self.committed_txn.load(Ordering::Acquire) } else { u64::MAX }
    }

    pub fn is_committed(&self, txn: u64) -> bool {
        txn <= self.committed_txn.load(Ordering::Acquire)
    }

    pub fn wake_space_waiters(&self) {
        self.space_gen.fetch_add(1, Ordering::AcqRel);
        self.space_notify.notify_waiters();
    }

    pub fn out_of_data_space(&self) -> bool {
        self.mode() == PoolMode::ReadWrite && self.free_data_blocks.load(Ordering::Acquire) == 0
    }
}
