//! The thin-pool runtime: dm-thin pools, thin volumes and snapshots over any two
//! `mdkit_io::BlockDevice`s (a metadata device and a data device), with the kernel's on-disk
//! format (see [`crate::meta`]).
//!
//! ```text
//!   ThinVolume (BlockDevice) ──► MappingTable of its device (sharded cells + cached mappings)
//!        │  fast path: mapped, unshared ──────────────────────────────► data device
//!        │  slow path: provision / break sharing / discard / lookup miss
//!        ▼
//!   metadata worker thread (bounded queue) ──► ThinMetadata ──► metadata device
//!        commit round: flush data, commit metadata, pass down discards
//! ```
//!
//! # The data path
//! * **Fast path** (upstream "dm thin: Improve performance of O_SYNC IOs to mapped data"): a
//!   read, or a write (FUA included) to a block that is mapped and unshared goes straight to the
//!   data device from the caller's task: one short shard lock to take an in-flight reference,
//!   no worker, no metadata lock, no pool-wide lock. A FUA write whose mapping is committed is a
//!   FUA write on the data device and nothing else; if its mapping is not committed yet, the
//!   write is followed by a commit round.
//! * **Slow path**: a write to an unmapped block *provisions* it (allocate on the worker, zero
//!   the new block unless zeroing is off or the write covers it, write, insert the mapping); a
//!   write to a shared block *breaks sharing* (allocate, copy the old block unless fully
//!   overwritten, remap). Only the writes that provision or break sharing — and I/O to a block
//!   while such an operation holds it — wait: per-virtual-block cells in the device's
//!   [`MappingTable`](table), the bio-prison equivalent. Reads of unmapped blocks return zeroes.
//! * **Discard** unmaps whole blocks (partial blocks are ignored, as discard is advisory);
//!   blocks left with no reference are discarded on the data device after the next commit
//!   (`discard_passdown`). **Write zeroes** unmaps whole blocks and writes zeroes into mapped
//!   partial blocks (with NO_HOLE semantics it writes zeroes, provisioning as needed).
//! * **Durability**: the pool behaves like a disk with a volatile cache. A flush commits when
//!   metadata changed (else it flushes the data device only); a FUA write is durable on
//!   completion; commits also happen at least every `commit_interval` and after every admin
//!   operation (create, snapshot, delete, transaction id), as dm-thin does after each message.
//!   Concurrent flushes share one commit round.
//! * **Out of data space**: `error_if_no_space` fails provisioning writes at once with ENOSPC;
//!   otherwise they queue up to `no_space_timeout` (dm default 60 s) for space (freed blocks
//!   become free at the next commit; a grown data device via [`Pool::resize_data`]) and then
//!   fail. Free space down to `low_water_blocks` (free <= mark, dm-thin's test) logs a warning
//!   once per crossing and shows in status. The metadata engine keeps a reserve so a commit always has room; when metadata
//!   space runs out the pool commits (blocks the open transaction freed become usable) and
//!   retries once; still out of space, it commits and goes read-only (no NEEDS_CHECK) until
//!   the metadata grows ([`Pool::resize_metadata`]).
//! * **Metadata I/O error or damage**: the transaction is aborted, NEEDS_CHECK is set in the
//!   superblock, the pool fails every write; reads of committed mappings continue.
//! * A pool whose superblock has NEEDS_CHECK opens read-only (status says why; the typed
//!   [`ModeCause`] says it too). A read-write open runs [`crate::meta::check`] first
//!   (`check_on_open`) and refuses damaged metadata, naming the block, without writing anything.
//! * Opening never formats: only [`OpenMode::Create`] / [`OpenMode::OpenOrCreate`] format, and
//!   only a blank device; [`OpenMode::Overwrite`] formats anything (see [`open`]).
//!
//! Thin volume sizes are not stored in dm-thin metadata; callers pass the size to
//! [`Pool::thin`] (the `mdkit` service keeps them in its thin state file).
//!
//! The pool needs a tokio runtime with the time driver (`enable_all`): the periodic commit and
//! the no-space timeout use timers.

pub mod open;
mod origin;
mod resize;
mod state;
mod status;
mod table;
mod thin;
mod tools;
mod util;
mod worker;

use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use mdkit_io::{BlockDevice, DeviceRef};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

use crate::meta::{DeviceDetails, DeviceMetaIo, Mapping, MetaError, MetaIo, SharedMetadata};

pub use open::{BLANK_SCAN_BLOCKS, DeviceContents};
pub use resize::Resized;
pub use state::{ModeCause, PoolMode};
pub use table::TableCounters;
pub use thin::ThinVolume;

use state::PoolState;
use table::MappingTable;
use worker::{Cmd, Worker};

pub use tools::SnapUse;

/// What the pool does with discards (dm-thin features `ignore_discard`, `no_discard_passdown`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DiscardMode {
    /// Unmap, and discard freed blocks on the data device.
    #[default]
    Passdown,
    /// Unmap only.
    NoPassdown,
    /// Discards are accepted and do nothing.
    Ignore,
}

impl DiscardMode {
    /// The dmsetup status word.
    pub fn as_str(self) -> &'static str {
        match self {
            DiscardMode::Passdown => "discard_passdown",
            DiscardMode::NoPassdown => "no_discard_passdown",
            DiscardMode::Ignore => "ignore_discard",
        }
    }
}

/// Runtime options of a pool (dm-thin table features and module parameters, and more).
#[derive(Clone, Copy, Debug)]
pub struct PoolOptions {
    /// Zero newly provisioned blocks unless the write covers them (`!skip_block_zeroing`).
    pub zero_new_blocks: bool,
    /// Fail provisioning writes at once when out of data space (else queue them).
    pub error_if_no_space: bool,
    /// How long writes queue for data space before failing (dm-thin's no_space_timeout,
    /// default 60 s). Must be non-zero: a pool never hangs.
    pub no_space_timeout: Duration,
    pub discard: DiscardMode,
    /// Free data blocks below which the pool warns and status shows `low_water`.
    pub low_water_blocks: u64,
    /// Commit at least this often when metadata changed (dm-thin: 1 s). Zero disables the
    /// periodic commit (commits then happen on flush, FUA and admin operations only).
    pub commit_interval: Duration,
    /// Open read-only: no writes, no metadata changes.
    pub read_only: bool,
    /// Run the metadata checker before a read-write open and refuse damaged metadata.
    pub check_on_open: bool,
    /// Clean metadata blocks cached by the engine.
    pub metadata_cache_blocks: usize,
    /// Mappings each open thin device caches in its table at most (per shard rounded down to a
    /// power of two; a mapping pushed out of its set is reloaded from the metadata when next
    /// used).
    pub mapping_cache_entries: usize,
    /// Commands queued for the metadata worker at most.
    pub worker_queue_depth: usize,
}

impl Default for PoolOptions {
    fn default() -> PoolOptions {
        PoolOptions {
            zero_new_blocks: true,
            error_if_no_space: false,
            no_space_timeout: Duration::from_secs(60),
            discard: DiscardMode::Passdown,
            low_water_blocks: 0,
            commit_interval: Duration::from_secs(1),
            read_only: false,
            check_on_open: true,
            metadata_cache_blocks: crate::meta::cache::DEFAULT_CACHE_BLOCKS,
            mapping_cache_entries: 1 << 20,
            worker_queue_depth: 1024,
        }
    }
}

/// How [`Pool::start`] treats the metadata device (see [`open`] for the blank rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// It must hold a pool; nothing is ever formatted.
    Open,
    /// It must be blank (the first [`BLANK_SCAN_BLOCKS`] blocks zeroes): format a new pool.
    Create { data_block_bytes: u64 },
    /// Format whatever the device holds (`pool-create --force`): destroys any pool there.
    Overwrite { data_block_bytes: u64 },
    /// Format when blank, else open (a config pool with `create = true`). A device whose
    /// superblock is zeroes but which holds other metadata is refused, never formatted.
    OpenOrCreate { data_block_bytes: u64 },
}

//------------------------------------------------------------------------------------------------
// Errors

/// An error of a pool operation, naming the pool.
#[derive(Debug, thiserror::Error)]
#[error("thin pool {pool}: {kind}")]
pub struct PoolError {
    pub pool: String,
    pub kind: PoolErrorKind,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolErrorKind {
    /// The metadata engine refused or failed (corruption names the block).
    #[error(transparent)]
    Meta(MetaError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// `check_on_open` found damage; nothing was written.
    #[error(
        "metadata device {device}: the check found {nr_errors} error(s), first: {first}; refusing to open read-write (read-only opens serve what is intact); {hint}",
        hint = open::RECOVERY_HINT
    )]
    CheckFailed { device: String, nr_errors: u64, first_block: Option<u64>, first: String },
    /// Formatting refused: the metadata device is not blank (and the mode does not overwrite).
    #[error(
        "metadata device {device}: {contents}; refusing to overwrite it (only `mdkit thin pool-create --force` formats a device that is not blank)"
    )]
    NotBlank { device: String, contents: DeviceContents },
    /// Opening found no superblock at block 0 (all zeroes); nothing was written.
    #[error(
        "metadata device {device}: no thin-pool superblock at block 0: {contents}; {hint}",
        hint = open::no_superblock_hint(contents)
    )]
    NoSuperblock { device: String, contents: DeviceContents },
    /// Opening found damaged metadata (the error names the block); nothing was written.
    #[error("{err}; {hint}", err = .0, hint = open::RECOVERY_HINT)]
    Damaged(MetaError),
    #[error("{0}")]
    InvalidArgument(String),
    /// The thin device is open (in use by a volume or export).
    #[error("{0}")]
    Busy(String),
    #[error("read-only: {0}")]
    ReadOnly(String),
    #[error("failed: {0}")]
    Failed(String),
    #[error("closed")]
    Closed,
}

impl PoolError {
    pub fn new(pool: &str, kind: PoolErrorKind) -> PoolError {
        PoolError { pool: pool.to_string(), kind }
    }

    /// The metadata block a corruption is about, if this is one.
    pub fn corrupt_block(&self) -> Option<u64> {
        match &self.kind {
            PoolErrorKind::Meta(e) | PoolErrorKind::Damaged(e) => e.corrupt_block(),
            PoolErrorKind::NoSuperblock { .. } => Some(0),
            PoolErrorKind::CheckFailed { first_block, .. } => *first_block,
            _ => None,
        }
    }
}

impl From<PoolError> for io::Error {
    fn from(e: PoolError) -> io::Error {
        let kind = match &e.kind {
            PoolErrorKind::InvalidArgument(_) => io::ErrorKind::InvalidInput,
            PoolErrorKind::Busy(_) => io::ErrorKind::ResourceBusy,
            PoolErrorKind::ReadOnly(_) => io::ErrorKind::ReadOnlyFilesystem,
            PoolErrorKind::Closed => io::ErrorKind::BrokenPipe,
            PoolErrorKind::Io { source, .. } => source.kind(),
            PoolErrorKind::Meta(MetaError::NoSuchDevice(_)) => io::ErrorKind::NotFound,
            PoolErrorKind::Meta(MetaError::DeviceExists(_)) => io::ErrorKind::AlreadyExists,
            PoolErrorKind::Meta(MetaError::InvalidArgument(_) | MetaError::TransactionIdMismatch { .. }) => {
                io::ErrorKind::InvalidInput
            }
            PoolErrorKind::Meta(MetaError::OutOfMetadataSpace { .. } | MetaError::OutOfDataSpace { .. }) => {
                io::ErrorKind::StorageFull
            }
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e.to_string())
    }
}

//------------------------------------------------------------------------------------------------
// Status

/// Pool counters (events since open).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounters {
    pub commits: u64,
    pub commit_rounds: u64,
    pub provisions: u64,
    pub sharing_breaks: u64,
    pub zeroed_blocks: u64,
    pub discarded_blocks: u64,
    pub passdown_blocks: u64,
    pub passdown_errors: u64,
    pub no_space_waits: u64,
    pub no_space_errors: u64,
    pub worker_lookups: u64,
    /// Summed over the open volumes.
    pub volumes: TableCounters,
}

/// A pool's status: the numbers of `dmsetup status` (its `Display` prints that line) and more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    pub transaction_id: u64,
    pub used_metadata_blocks: u64,
    pub total_metadata_blocks: u64,
    pub used_data_blocks: u64,
    pub total_data_blocks: u64,
    pub held_root: Option<u64>,
    pub mode: PoolMode,
    pub out_of_data_space: bool,
    /// Effective: `Passdown` only when the data device supports discard.
    pub discard: DiscardMode,
    pub error_if_no_space: bool,
    pub needs_check: bool,
    pub metadata_low_water_blocks: u64,
    pub data_block_bytes: u64,
    pub low_water_blocks: u64,
    pub low_water_reached: bool,
    pub zero_new_blocks: bool,
    pub no_space_timeout_ms: u64,
    /// Why the pool is read-only or failed.
    pub mode_reason: String,
    pub metadata_device: String,
    pub data_device: String,
    pub counters: PoolCounters,
}

impl PoolStatus {
    /// dm-thin's mode word.
    pub fn mode_str(&self) -> &'static str {
        match self.mode {
            PoolMode::Failed => "Fail",
            PoolMode::ReadOnly => "ro",
            PoolMode::ReadWrite if self.out_of_data_space => "out_of_data_space",
            PoolMode::ReadWrite => "rw",
        }
    }
}

impl std::fmt::Display for PoolStatus {
    /// `<trans id> <used meta>/<total meta> <used data>/<total data> <held root|-> <mode>
    /// <discard> <error|queue>_if_no_space <needs_check|-> <metadata low water>`;
    /// just `Fail` for a failed pool, as the kernel prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.mode == PoolMode::Failed {
            return f.write_str("Fail");
        }
        write!(
            f,
            "{} {}/{} {}/{} {} {} {} {} {} {}",
            self.transaction_id,
            self.used_metadata_blocks,
            self.total_metadata_blocks,
            self.used_data_blocks,
            self.total_data_blocks,
            self.held_root.map_or("-".to_string(), |h| h.to_string()),
            self.mode_str(),
            self.discard.as_str(),
            if self.error_if_no_space { "error_if_no_space" } else { "queue_if_no_space" },
            if self.needs_check { "needs_check" } else { "-" },
            self.metadata_low_water_blocks
        )
    }
}

/// A thin device's status (`dmsetup status` of a thin target: its `Display`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThinStatus {
    pub id: u64,
    pub mapped_blocks: u64,
    pub mapped_sectors: u64,
    /// Last sector of the highest mapped block.
    pub highest_mapped_sector: Option<u64>,
    pub details: DeviceDetails,
}

impl std::fmt::Display for ThinStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.highest_mapped_sector {
            Some(h) => write!(f, "{} {h}", self.mapped_sectors),
            None => write!(f, "{} -", self.mapped_sectors),
        }
    }
}

/// Block usage of one thin device (`thin_ls`-style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThinUsage {
    pub id: u64,
    pub mapped_blocks: u64,
    /// Mapped blocks no other device maps.
    pub exclusive_blocks: u64,
    /// Mapped blocks at least one other device maps too.
    pub shared_blocks: u64,
    pub details: DeviceDetails,
}

//------------------------------------------------------------------------------------------------
// The pool

/// Shared by the pool handle, the thin devices and the periodic-commit task.
pub(crate) struct PoolInner {
    pub state: Arc<PoolState>,
    pub md: SharedMetadata,
    pub data: DeviceRef,
    metadata_name: String,
    tx: mpsc::Sender<Cmd>,
    pub handle: tokio::runtime::Handle,
    /// Open thin devices (their mapping tables).
    open: Mutex<HashMap<u64, Weak<ThinDev>>>,
    /// Serialises admin operations (snapshots freeze their origin).
    admin: tokio::sync::Mutex<()>,
    worker_exit: Mutex<Option<oneshot::Receiver<()>>>,
}

/// One open thin device: its id, its pool and its mapping table.
pub(crate) struct ThinDev {
    pub id: u64,
    pub pool: Arc<PoolInner>,
    pub table: MappingTable,
}

impl PoolInner {
    fn closed(&self) -> PoolError {
        PoolError::new(&self.state.name, PoolErrorKind::Closed)
    }

    /// Runs `f` on the metadata worker and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> R + Send + 'static,
    ) -> Result<R, PoolError> {
        let (tx, rx) = oneshot::channel();
        let cmd = Cmd::Run(Box::new(move |w: &mut Worker| {
            let _ = tx.send(f(w));
        }));
        self.tx.send(cmd).await.map_err(|_| self.closed())?;
        rx.await.map_err(|_| self.closed())
    }

    /// Same as `call`, for the data path (errors as `io::Error`).
    pub async fn call_io<R: Send + 'static>(&self, f: impl FnOnce(&mut Worker) -> R + Send + 'static) -> io::Result<R> {
        self.call(f).await.map_err(io::Error::from)
    }

    /// A commit round on the worker (batched with every other request queued with it).
    pub async fn commit(&self) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Cmd::Commit(Some(tx))).await.map_err(|_| io::Error::from(self.closed()))?;
        match rx.await {
            Ok(r) => r.map_err(|f| f.into_io()),
            Err(_) => Err(self.closed().into()),
        }
    }

    /// Makes every completed write durable: a commit round if metadata changed, else a flush
    /// of the data device.
    pub async fn flush(&self) -> io::Result<()> {
        self.state.check_open()?;
        if self.state.mode() == PoolMode::Failed {
            return Err(io::Error::other(format!(
                "thin pool {} has failed (needs_check): {}",
                self.state.name,
                self.state.mode_reason()
            )));
        }
        if self.state.meta_dirty.load(Ordering::Acquire) { self.commit().await } else { self.data.flush().await }
    }

    /// Waits until the mapping made in transaction `txn` is committed.
    pub async fn commit_covering(&self, txn: u64) -> io::Result<()> {
        if self.state.is_committed(txn) {
            return Ok(());
        }
        self.commit().await
    }

    fn open_dev(&self, id: u64) -> Option<Arc<ThinDev>> {
        self.open.lock().get(&id).and_then(Weak::upgrade)
    }
}

/// A thin pool. Cheap to clone; every clone is the same pool.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.inner.state.name)
            .field("block_bytes", &self.inner.state.block_bytes)
            .finish()
    }
}

impl Pool {
    /// Formats a new pool on a blank metadata device (see [`open`]) and opens it.
    pub async fn create(
        name: &str,
        metadata: DeviceRef,
        data: DeviceRef,
        data_block_bytes: u64,
        opts: PoolOptions,
    ) -> Result<Pool, PoolError> {
        Pool::start(name, metadata, data, opts, OpenMode::Create { data_block_bytes }).await
    }

    /// Opens an existing pool (made by mdkit, the kernel or thin_restore).
    pub async fn open(name: &str, metadata: DeviceRef, data: DeviceRef, opts: PoolOptions) -> Result<Pool, PoolError> {
        Pool::start(name, metadata, data, opts, OpenMode::Open).await
    }

    /// Opens or formats the pool; starts the metadata worker thread and the periodic commit.
    pub async fn start(
        name: &str,
        metadata: DeviceRef,
        data: DeviceRef,
        opts: PoolOptions,
        mode: OpenMode,
    ) -> Result<Pool, PoolError> {
        let err = |msg: String| PoolError::new(name, PoolErrorKind::InvalidArgument(msg));
        if opts.no_space_timeout.is_zero() {
            return Err(err("no_space_timeout must be non-zero (a pool never queues writes forever)".into()));
        }
        if opts.worker_queue_depth == 0 || opts.worker_queue_depth > 1 << 20 {
            return Err(err(format!("worker_queue_depth {} outside 1..=1048576", opts.worker_queue_depth)));
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| err("Pool::start must be called inside a tokio runtime".into()))?;
        let metadata_name = metadata.name().to_string();
        let (tx, rx) = mpsc::channel(opts.worker_queue_depth);
        let (ready_tx, ready_rx) = oneshot::channel();
        let (exit_tx, exit_rx) = oneshot::channel::<()>();
        let thread_name = format!("thin-meta-{name}");
        let pool_name = name.to_string();
        let h = handle.clone();
        std::thread::Builder::new()
            .name(thread_name.chars().take(15).collect())
            .spawn(move || {
                let io: Arc<dyn MetaIo> = Arc::new(DeviceMetaIo::new(metadata, h.clone()));
                match Worker::start(&pool_name, io, data, h, opts, mode) {
                    Ok(started) => {
                        let info =
                            (started.worker.md.clone(), started.worker.state.clone(), started.worker.data.clone());
                        let _ = ready_tx.send(Ok((info, started.created)));
                        started.worker.run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
                let _ = exit_tx.send(());
            })
            .map_err(|e| {
                PoolError::new(
                    name,
                    PoolErrorKind::Io { what: "starting the metadata worker thread".into(), source: e },
                )
            })?;
        let ((md, state, data), created) =
            ready_rx.await.map_err(|_| PoolError::new(name, PoolErrorKind::Closed))??;
        let inner = Arc::new(PoolInner {
            state,
            md,
            data,
            metadata_name,
            tx,
            handle: handle.clone(),
            open: Mutex::new(HashMap::new()),
            admin: tokio::sync::Mutex::new(()),
            worker_exit: Mutex::new(Some(exit_rx)),
        });
        if !opts.commit_interval.is_zero() {
            spawn_periodic_commit(&inner, opts.commit_interval);
        }
        tracing::info!(
            pool = name,
            created,
            block_bytes = inner.state.block_bytes,
            data_blocks = inner.state.total_data_blocks.load(Ordering::Acquire),
            mode = ?inner.state.mode(),
            "thin pool open"
        );
        Ok(Pool { inner })
    }

    pub fn name(&self) -> &str {
        &self.inner.state.name
    }

    pub fn data_block_bytes(&self) -> u64 {
        self.inner.state.block_bytes
    }

    pub fn mode(&self) -> PoolMode {
        self.inner.state.mode()
    }

    /// Why the pool is read-only or failed ("" when read-write).
    pub fn mode_reason(&self) -> String {
        self.inner.state.mode_reason()
    }

    /// Why the pool is in its mode, as a value to match on.
    pub fn mode_cause(&self) -> ModeCause {
        self.inner.state.mode_cause()
    }

    /// The metadata engine (for diagnostics and tests; take the read lock briefly).
    pub fn metadata(&self) -> SharedMetadata {
        self.inner.md.clone()
    }

    /// Commits now (a commit round: data flush, metadata commit if changed, passdown).
    pub async fn commit(&self) -> io::Result<()> {
        self.inner.state.check_open()?;
        self.inner.commit().await
    }

    /// Makes every write completed so far durable (what a flush of any volume does).
    pub async fn flush(&self) -> io::Result<()> {
        self.inner.flush().await
    }

    async fn admin<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut crate::meta::ThinMetadata) -> Result<R, MetaError> + Send + 'static,
    ) -> Result<R, PoolError> {
        self.inner.call(move |w| w.admin(f)).await?
    }

    /// Creates an empty thin device (committed before returning).
    pub async fn create_thin(&self, id: u64) -> Result<(), PoolError> {
        let _g = self.inner.admin.lock().await;
        self.admin(move |md| md.create_thin(id)).await
    }

    /// Creates `id` as a snapshot of `origin` (a volume or a snapshot) in O(1): writes to an
    /// open origin are stopped and drained first (dm-thin's suspend), then the snapshot is
    /// made and committed, then writes resume — now breaking sharing.
    pub async fn create_snapshot(&self, id: u64, origin: u64) -> Result<(), PoolError> {
        let _g = self.inner.admin.lock().await;
        let origin_dev = self.inner.open_dev(origin);
        if let Some(o) = &origin_dev {
            o.table.freeze().await;
        }
        let r = self
            .admin(move |md| {
                md.create_snap(id, origin)?;
                Ok(md.device_details(origin)?.snapshotted_time)
            })
            .await;
        if let Some(o) = &origin_dev {
            o.table.thaw(r.as_ref().ok().copied());
        }
        r.map(|_| ())
    }

    /// Deletes a thin device; refuses while it is open.
    pub async fn delete_thin(&self, id: u64) -> Result<(), PoolError> {
        let _g = self.inner.admin.lock().await;
        if self.inner.open_dev(id).is_some() {
            return Err(PoolError::new(
                self.name(),
                PoolErrorKind::Busy(format!("thin device {id} is open; close it first")),
            ));
        }
        self.admin(move |md| md.delete(id)).await
    }

    /// dm-thin's `set_transaction_id <current> <new>`.
    pub async fn set_transaction_id(&self, current: u64, new: u64) -> Result<(), PoolError> {
        let _g = self.inner.admin.lock().await;
        self.admin(move |md| md.set_transaction_id(current, new)).await
    }

    /// `reserve_metadata_snap`: returns the held root's block.
    pub async fn reserve_metadata_snap(&self) -> Result<u64, PoolError> {
        let _g = self.inner.admin.lock().await;
        self.admin(|md| md.reserve_metadata_snap()).await
    }

    pub async fn release_metadata_snap(&self) -> Result<(), PoolError> {
        let _g = self.inner.admin.lock().await;
        self.admin(|md| md.release_metadata_snap()).await
    }

    /// Grows the pool to the data device's current size (after the device was grown).
    pub async fn resize_data(&self) -> Result<u64, PoolError> {
        let _g = self.inner.admin.lock().await;
        let blocks = self.inner.data.topology().size_bytes / self.inner.state.block_bytes;
        let r = self.admin(move |md| md.resize_data(blocks).map(|()| blocks)).await;
        self.inner.call(|w| w.refresh_space()).await?;
        self.inner.state.wake_space_waiters();
        r
    }

    /// Opens thin device `id` as a block device of `size_bytes` (a multiple of the data
    /// device's logical block). Several handles to one device share its mapping table.
    pub async fn thin(&self, id: u64, size_bytes: u64) -> Result<ThinVolume, PoolError> {
        let name = self.name().to_string();
        let lbs = u64::from(self.inner.data.topology().logical_block_bytes.max(1));
        if size_bytes == 0 || !size_bytes.is_multiple_of(lbs) {
            return Err(PoolError::new(
                &name,
                PoolErrorKind::InvalidArgument(format!(
                    "thin device {id}: size {size_bytes} bytes is not a non-zero multiple of the {lbs}-byte logical block"
                )),
            ));
        }
        self.inner.state.check_open().map_err(|_| PoolError::new(&name, PoolErrorKind::Closed))?;
        let snap_time = self
            .inner
            .call(move |w| w.md.read().device_details(id))
            .await?
            .map_err(|e| PoolError::new(&name, PoolErrorKind::Meta(e)))?
            .snapshotted_time;
        let dev = {
            let mut open = self.inner.open.lock();
            match open.get(&id).and_then(Weak::upgrade) {
                Some(d) => d,
                None => {
                    let d = Arc::new(ThinDev {
                        id,
                        pool: self.inner.clone(),
                        table: MappingTable::new(snap_time, self.inner.state.opts.mapping_cache_entries),
                    });
                    open.retain(|_, w| w.strong_count() > 0);
                    open.insert(id, Arc::downgrade(&d));
                    d
                }
            }
        };
        Ok(ThinVolume::new(dev, size_bytes))
    }

    /// Ids of every thin device.
    pub async fn devices(&self) -> Result<Vec<u64>, PoolError> {
        self.inner.call(|w| w.md.read().devices()).await
    }

    /// True while a handle to thin device `id` exists.
    pub fn is_open(&self, id: u64) -> bool {
        self.inner.open_dev(id).is_some()
    }

    /// The pool's status (`Display` is the `dmsetup status` line).
    pub async fn status(&self) -> Result<PoolStatus, PoolError> {
        let st = self.inner.call(|w| w.md.read().status()).await?;
        let s = &self.inner.state;
        let mut volumes = TableCounters::default();
        let open: Vec<Arc<ThinDev>> = self.inner.open.lock().values().filter_map(Weak::upgrade).collect();
        for d in open {
            let c = d.table.counters();
            volumes.fast_reads += c.fast_reads;
            volumes.fast_writes += c.fast_writes;
            volumes.zero_reads += c.zero_reads;
            volumes.slow_ops += c.slow_ops;
            volumes.cell_waits += c.cell_waits;
            volumes.evictions += c.evictions;
        }
        let c = &s.counters;
        let ld = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let discard = match s.opts.discard {
            DiscardMode::Passdown if !s.passdown => DiscardMode::NoPassdown,
            d => d,
        };
        Ok(PoolStatus {
            transaction_id: st.transaction_id,
            used_metadata_blocks: st.used_metadata_blocks,
            total_metadata_blocks: st.total_metadata_blocks,
            used_data_blocks: st.used_data_blocks,
            total_data_blocks: st.total_data_blocks,
            held_root: st.held_root,
            mode: s.mode(),
            out_of_data_space: s.out_of_data_space(),
            discard,
            error_if_no_space: s.opts.error_if_no_space,
            needs_check: st.needs_check,
            metadata_low_water_blocks: st.metadata_low_water_blocks,
            data_block_bytes: s.block_bytes,
            low_water_blocks: s.low_water_blocks.load(Ordering::Acquire),
            low_water_reached: s.low_water_reached.load(Ordering::Acquire),
            zero_new_blocks: s.opts.zero_new_blocks,
            no_space_timeout_ms: s.opts.no_space_timeout.as_millis() as u64,
            mode_reason: s.mode_reason(),
            metadata_device: self.inner.metadata_name.clone(),
            data_device: self.inner.data.name().to_string(),
            counters: PoolCounters {
                commits: ld(&c.commits),
                commit_rounds: ld(&c.commit_rounds),
                provisions: ld(&c.provisions),
                sharing_breaks: ld(&c.sharing_breaks),
                zeroed_blocks: ld(&c.zeroed_blocks),
                discarded_blocks: ld(&c.discarded_blocks),
                passdown_blocks: ld(&c.passdown_blocks),
                passdown_errors: ld(&c.passdown_errors),
                no_space_waits: ld(&c.no_space_waits),
                no_space_errors: ld(&c.no_space_errors),
                worker_lookups: ld(&c.worker_lookups),
                volumes,
            },
        })
    }

    /// A thin device's status (`dmsetup status` of the thin target).
    pub async fn thin_status(&self, id: u64) -> Result<ThinStatus, PoolError> {
        let name = self.name().to_string();
        let sectors_per_block = self.inner.state.block_bytes / 512;
        let (details, highest) = self
            .inner
            .call(move |w| {
                let md = w.md.read();
                Ok::<_, MetaError>((md.device_details(id)?, md.highest_mapped(id)?))
            })
            .await?
            .map_err(|e| PoolError::new(&name, PoolErrorKind::Meta(e)))?;
        Ok(ThinStatus {
            id,
            mapped_blocks: details.mapped_blocks,
            mapped_sectors: details.mapped_blocks * sectors_per_block,
            highest_mapped_sector: highest.map(|h| (h + 1) * sectors_per_block - 1),
            details,
        })
    }

    /// Mapped, exclusive and shared blocks of every device (walks every mapping).
    pub async fn list(&self) -> Result<Vec<ThinUsage>, PoolError> {
        let name = self.name().to_string();
        self.inner
            .call(|w| {
                let md = w.md.read();
                let devs = md.devices();
                let mut users: HashMap<u64, u32> = HashMap::new();
                let mut per_dev: Vec<(u64, Vec<u64>)> = Vec::with_capacity(devs.len());
                for &d in &devs {
                    let mut blocks = Vec::new();
                    md.for_each_mapping(d, 0, u64::MAX, &mut |_, m| {
                        blocks.push(m.data_block);
                        true
                    })?;
                    blocks.sort_unstable();
                    blocks.dedup();
                    for &b in &blocks {
                        *users.entry(b).or_insert(0) += 1;
                    }
                    per_dev.push((d, blocks));
                }
                per_dev
                    .into_iter()
                    .map(|(d, blocks)| {
                        let exclusive = blocks.iter().filter(|b| users[b] == 1).count() as u64;
                        Ok(ThinUsage {
                            id: d,
                            mapped_blocks: md.device_details(d)?.mapped_blocks,
                            exclusive_blocks: exclusive,
                            shared_blocks: blocks.len() as u64 - exclusive,
                            details: md.device_details(d)?,
                        })
                    })
                    .collect::<Result<Vec<_>, MetaError>>()
            })
            .await?
            .map_err(|e| PoolError::new(&name, PoolErrorKind::Meta(e)))
    }

    /// Every mapping of device `id` in order: (virtual block, mapping).
    pub async fn mappings(&self, id: u64) -> Result<Vec<(u64, Mapping)>, PoolError> {
        let name = self.name().to_string();
        self.inner
            .call(move |w| {
                let md = w.md.read();
                let mut v = Vec::new();
                md.for_each_mapping(id, 0, u64::MAX, &mut |vb, m| {
                    v.push((vb, m));
                    true
                })
                .map(|()| v)
            })
            .await?
            .map_err(|e| PoolError::new(&name, PoolErrorKind::Meta(e)))
    }

    /// Commits, stops the metadata worker and refuses further I/O. Queued writes fail.
    pub async fn close(&self) -> Result<(), PoolError> {
        let name = self.name().to_string();
        let _g = self.inner.admin.lock().await;
        if self.inner.state.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.inner.state.wake_space_waiters();
        let (tx, rx) = oneshot::channel();
        let r = match self.inner.tx.send(Cmd::Stop(tx)).await {
            Ok(()) => rx.await.map_err(|_| PoolError::new(&name, PoolErrorKind::Closed))?,
            Err(_) => return Ok(()),
        };
        let exit = self.inner.worker_exit.lock().take();
        if let Some(exit) = exit {
            let _ = exit.await;
        }
        tracing::info!(pool = %name, "thin pool closed");
        r.map_err(|f| PoolError::new(&name, PoolErrorKind::Io { what: "final commit".into(), source: f.into_io() }))
    }
}

fn spawn_periodic_commit(inner: &Arc<PoolInner>, period: Duration) {
    let weak = Arc::downgrade(inner);
    inner.handle.spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(p) = weak.upgrade() else { return };
            if p.state.closed.load(Ordering::Acquire) {
                return;
            }
            if p.state.meta_dirty.load(Ordering::Acquire) && p.state.mode() != PoolMode::Failed {
                // A full queue means commits are requested anyway.
                let _ = p.tx.try_send(Cmd::Commit(None));
            }
        }
    });
}

#[cfg(test)]
mod tests;
