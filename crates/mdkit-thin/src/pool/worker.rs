//! The metadata worker: one dedicated thread per pool that owns every metadata change (dm-thin's
//! worker). The data path sends it bounded commands (allocate, insert, discard, lookup-miss,
//! commit) and admin operations; it drives the engine synchronously, bridging to the async
//! devices with `Handle::block_on` (the engine's `DeviceMetaIo` does the same for metadata I/O).
//!
//! Commands are taken in batches; every commit request in a batch is answered by one commit
//! round that starts after the batch's other commands ran, so one commit satisfies every flush
//! that arrived before it started.
//!
//! # Commit round
//! 1. flush the data device: data written before the round (provisioned blocks, zeroing,
//!    copies) is durable before any metadata that maps it (the kernel's pre-commit flush);
//! 2. drop the in-memory reservations of blocks being provisioned (allocated, data being
//!    written, not mapped yet), commit, take them again: a committed state never holds a block
//!    that no mapping references, so every crash image passes `check` with no leaked blocks;
//! 3. pass down discards of the blocks unmapped in the committed transaction: they are free
//!    now and nothing is allocated until this finishes (this thread does both), so a block is
//!    never discarded while the last commit maps it, nor reused before its discard is done —
//!    the guarantees of the engine's inc/commit/discard/dec protocol without a persisted hold.

use std::collections::HashSet;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use mdkit_io::DeviceRef;
use tokio::sync::{mpsc, oneshot};

use super::state::{ModeCause, PoolMode, PoolState};
use super::table::{Cached, Known};
use super::{OpenMode, PoolError, PoolErrorKind, PoolOptions};
use crate::meta::{MetaError, MetaIo, SharedMetadata, ThinMetadata};

/// Commands handled per batch at most.
const BATCH_MAX: usize = 256;
/// Passdown discards in flight at once.
const PASSDOWN_IN_FLIGHT: usize = 32;

pub(crate) type WorkerFn = Box<dyn FnOnce(&mut Worker) + Send>;

pub(crate) enum Cmd {
    Run(WorkerFn),
    /// A commit round; the reply (if any) carries its result.
    Commit(Option<oneshot::Sender<Result<(), CommitFailure>>>),
    /// Final commit round, then the thread ends.
    Stop(oneshot::Sender<Result<(), CommitFailure>>),
}

/// Why a commit round failed (cloned to every waiter).
#[derive(Clone, Debug)]
pub(crate) struct CommitFailure {
    pub kind: io::ErrorKind,
    pub message: String,
}

impl CommitFailure {
    pub fn into_io(self) -> io::Error {
        io::Error::new(self.kind, self.message)
    }
}

/// Why an allocation failed.
pub(crate) enum AllocFailure {
    /// No free data block; `space_gen` is the pool's space generation at the failure.
    NoSpace {
        space_gen: u64,
    },
    Error(io::Error),
}

pub(crate) struct Worker {
    pub md: SharedMetadata,
    pub data: DeviceRef,
    pub handle: tokio::runtime::Handle,
    pub state: Arc<PoolState>,
    /// Blocks allocated for provisions whose mapping is not inserted yet.
    holds: HashSet<u64>,
    /// Blocks unmapped in this transaction with no reference left: discarded after commit.
    pending_passdown: Vec<u64>,
    meta_low_warned: bool,
}

/// What `Worker::start` found.
pub(crate) struct Started {
    pub worker: Worker,
    pub created: bool,
}

fn meta_err(pool: &str, e: MetaError) -> PoolError {
    PoolError::new(pool, PoolErrorKind::Meta(e))
}

impl Worker {
    /// Opens (or formats) the metadata on the calling (worker) thread.
    pub fn start(
        name: &str,
        io: Arc<dyn MetaIo>,
        data: DeviceRef,
        handle: tokio::runtime::Handle,
        opts: PoolOptions,
        mode: OpenMode,
    ) -> Result<Started, PoolError> {
        let data_bytes = data.topology().size_bytes;
        let super::open::Opened { md, created, read_only: reason_ro } =
            super::open::open_or_format(name, &io, data_bytes, &opts, mode)?;
        let block_bytes = u64::from(md.data_block_size_sectors()) * 512;
        if let OpenMode::Create { data_block_bytes } | OpenMode::OpenOrCreate { data_block_bytes } = mode
            && !created
            && data_block_bytes != block_bytes
        {
            return Err(PoolError::new(
                name,
                PoolErrorKind::InvalidArgument(format!(
                    "the pool's data block size is {block_bytes} bytes, not the configured {data_block_bytes}"
                )),
            ));
        }
        let data_blocks = data_bytes / block_bytes;
        if data_blocks < md.nr_data_blocks() {
            return Err(PoolError::new(
                name,
                PoolErrorKind::InvalidArgument(format!(
                    "data device {} holds {data_blocks} blocks of {block_bytes} bytes but the metadata maps {} (too small)",
                    data.name(),
                    md.nr_data_blocks()
                )),
            ));
        }
        let topo = data.topology();
        if block_bytes % u64::from(topo.logical_block_bytes.max(1)) != 0 {
            return Err(PoolError::new(
                name,
                PoolErrorKind::InvalidArgument(format!(
                    "data block size {block_bytes} is not a multiple of the data device's {}-byte logical block",
                    topo.logical_block_bytes
                )),
            ));
        }
        let passdown = opts.discard == super::DiscardMode::Passdown && topo.supports_discard;
        let state = Arc::new(PoolState::new(name.to_string(), block_bytes, opts, passdown));
        if let Some((cause, r)) = reason_ro {
            state.set_mode(PoolMode::ReadOnly, cause, r);
        }
        let mut md = md;
        if data_blocks > md.nr_data_blocks() && !md.is_read_only() {
            // The data device grew: the kernel extends the pool on resume.
            let from = md.nr_data_blocks();
            md.resize_data(data_blocks).and_then(|()| md.commit()).map_err(|e| meta_err(name, e))?;
            tracing::info!(pool = name, from, to = data_blocks, "data device grew; pool extended");
        }
        state.total_data_blocks.store(md.nr_data_blocks(), Ordering::Release);
        state.free_data_blocks.store(md.free_data_blocks(), Ordering::Release);
        let md: SharedMetadata = Arc::new(parking_lot::RwLock::new(md));
        let worker = Worker {
            md,
            data,
            handle,
            state,
            holds: HashSet::new(),
            pending_passdown: Vec::new(),
            meta_low_warned: false,
        };
        worker.check_low_water();
        Ok(Started { worker, created })
    }

    /// The command loop; returns when told to stop or when every sender is gone (then it
    /// commits what it has, like a clean shutdown).
    pub fn run(mut self, mut rx: mpsc::Receiver<Cmd>) {
        let mut batch: Vec<Cmd> = Vec::with_capacity(BATCH_MAX);
        loop {
            let Some(first) = rx.blocking_recv() else {
                if let Err(e) = self.commit_round() {
                    tracing::error!(pool = %self.state.name, "final commit failed: {}", e.message);
                }
                return;
            };
            batch.push(first);
            while batch.len() < BATCH_MAX {
                match rx.try_recv() {
                    Ok(c) => batch.push(c),
                    Err(_) => break,
                }
            }
            let mut commit_waiters = Vec::new();
            let mut want_commit = false;
            let mut stop = None;
            for c in batch.drain(..) {
                match c {
                    Cmd::Run(f) => f(&mut self),
                    Cmd::Commit(reply) => {
                        want_commit = true;
                        commit_waiters.extend(reply);
                    }
                    Cmd::Stop(reply) => stop = Some(reply),
                }
            }
            if want_commit || stop.is_some() {
                let r = self.commit_round();
                for w in commit_waiters {
                    let _ = w.send(r.clone());
                }
                if let Some(s) = stop {
                    let _ = s.send(r);
                    return;
                }
            }
        }
    }

    //--------------------------------------------------------------------------------------------
    // Commit

    /// Flush data, commit metadata (if changed), pass down discards. See the module docs.
    pub fn commit_round(&mut self) -> Result<(), CommitFailure> {
        let name = self.state.name.clone();
        if self.state.mode() == PoolMode::Failed {
            return Err(CommitFailure {
                kind: io::ErrorKind::Other,
                message: format!("thin pool {name} has failed (needs_check): {}", self.state.mode_reason()),
            });
        }
        self.state.counters.commit_rounds.fetch_add(1, Ordering::Relaxed);
        let data = self.data.clone();
        if let Err(e) = self.handle.block_on(data.flush()) {
            // As dm-thin's pre-commit data flush: the mappings of this transaction may point at
            // data that is not on the device, so they are never committed (and a retried
            // fdatasync would succeed without it: the kernel reports a writeback error once).
            let message = format!("thin pool {name}: data device {} flush failed: {e}", data.name());
            self.fail(&message);
            return Err(CommitFailure { kind: e.kind(), message });
        }
        if !self.state.meta_dirty.load(Ordering::Acquire) || self.md.read().is_read_only() {
            return Ok(());
        }
        let holds: Vec<u64> = self.holds.iter().copied().collect();
        let r = {
            let mut md = self.md.write();
            // Taking the reservations again after the commit needs metadata (data space-map
            // bitmaps are shadowed anew); near the reserve it could fail and lose them, so
            // they are committed as they are, like when dropping them finds no room.
            let mut undo = md.free_metadata_blocks() > holds.len() as u64 + 16;
            let mut r = Ok(());
            let to_drop = if undo { &holds[..] } else { &[][..] };
            for &b in to_drop {
                match md.dec_data_block(b) {
                    Ok(_) => {}
                    Err(MetaError::OutOfMetadataSpace { .. }) if md.is_poisoned().is_none() => {
                        // No room to drop the reservations: commit them as the kernel does
                        // (allocated, unmapped blocks; thin_check accepts them).
                        undo = false;
                        for &done in holds.iter().take_while(|&&x| x != b) {
                            if let Err(e) = md.inc_data_block(done) {
                                r = Err(e);
                            }
                        }
                        break;
                    }
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                }
            }
            let r = r.and_then(|()| md.commit()).map(|()| undo);
            if r.is_ok() {
                // Under the write lock: readers see the new transaction numbers together with
                // the committed state.
                let open = self.state.open_txn.load(Ordering::Acquire);
                self.state.committed_txn.store(open, Ordering::Release);
                self.state.open_txn.store(open + 1, Ordering::Release);
                self.state.meta_dirty.store(false, Ordering::Release);
            }
            r
        };
        let undo = match r {
            Ok(u) => u,
            Err(e) => {
                let msg = format!("thin pool {name}: metadata commit failed: {e}");
                self.fail(&msg);
                return Err(CommitFailure { kind: io::ErrorKind::Other, message: msg });
            }
        };
        self.state.counters.commits.fetch_add(1, Ordering::Relaxed);
        if undo {
            let mut lost = Vec::new();
            {
                let mut md = self.md.write();
                for &b in &holds {
                    if let Err(e) = md.inc_data_block(b) {
                        lost.push((b, e));
                    }
                }
            }
            // Every lost reservation goes before reacting to the error: the reaction may commit
            // again, which must not drop a reservation that is gone already.
            for (b, e) in &lost {
                // The provision waiting on `b` fails at insert.
                self.holds.remove(b);
                tracing::error!(pool = %name, block = b, "could not re-reserve a data block after commit: {e}");
            }
            if let Some((_, e)) = lost.first() {
                self.after_error(e);
            }
        }
        self.passdown();
        self.refresh_space();
        self.state.wake_space_waiters();
        Ok(())
    }

    /// Discards, on the data device, the blocks the last commit freed (coalesced into runs).
    fn passdown(&mut self) {
        if self.pending_passdown.is_empty() {
            return;
        }
        let mut blocks = std::mem::take(&mut self.pending_passdown);
        blocks.sort_unstable();
        blocks.dedup();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for b in blocks {
            match runs.last_mut() {
                Some((start, n)) if *start + *n == b => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        let bs = self.state.block_bytes;
        let data = self.data.clone();
        let total: u64 = runs.iter().map(|r| r.1).sum();
        let errors = self.handle.block_on(async move {
            let mut set = tokio::task::JoinSet::new();
            let mut errors = 0u64;
            for (start, n) in runs {
                while set.len() >= PASSDOWN_IN_FLIGHT {
                    if let Some(Ok(Err(_)) | Err(_)) = set.join_next().await {
                        errors += 1;
                    }
                }
                let d = data.clone();
                set.spawn(async move { d.discard(start * bs, n * bs).await });
            }
            while let Some(r) = set.join_next().await {
                if !matches!(r, Ok(Ok(()))) {
                    errors += 1;
                }
            }
            errors
        });
        self.state.counters.passdown_blocks.fetch_add(total, Ordering::Relaxed);
        if errors > 0 {
            // Passdown is advisory: the blocks are free either way.
            self.state.counters.passdown_errors.fetch_add(errors, Ordering::Relaxed);
            tracing::warn!(pool = %self.state.name, errors, "discard passdown to the data device failed");
        }
    }

    //--------------------------------------------------------------------------------------------
    // Errors and modes

    /// Classifies an engine error: damage or I/O failure → fail the pool; metadata space
    /// exhausted → read-only; anything else is the caller's problem.
    pub fn after_error(&mut self, e: &MetaError) {
        let poisoned = self.md.read().is_poisoned().is_some();
        match e {
            MetaError::OutOfMetadataSpace { .. } if !poisoned => self.out_of_metadata_space(e),
            _ if poisoned
                || matches!(
                    e,
                    MetaError::Io { .. }
                        | MetaError::Corrupt { .. }
                        | MetaError::Poisoned { .. }
                        | MetaError::Unsupported { .. }
                ) =>
            {
                self.fail(&format!("metadata operation failed: {e}"))
            }
            _ => {}
        }
    }

    fn out_of_metadata_space(&mut self, e: &MetaError) {
        if self.state.mode() != PoolMode::ReadWrite {
            return;
        }
        tracing::error!(pool = %self.state.name, "{e}: committing and switching to read-only");
        if let Err(f) = self.commit_round() {
            tracing::error!(pool = %self.state.name, "commit before going read-only failed: {}", f.message);
        }
        self.state.set_mode(
            PoolMode::ReadOnly,
            ModeCause::MetadataSpaceExhausted,
            format!("metadata space exhausted ({e}); grow the metadata device"),
        );
    }

    /// Metadata I/O error or damage: stop writing, abort the transaction, set NEEDS_CHECK.
    pub fn fail(&mut self, reason: &str) {
        if self.state.mode() == PoolMode::Failed {
            return;
        }
        tracing::error!(pool = %self.state.name, "{reason}: aborting the transaction, setting needs_check, failing writes");
        self.state.set_mode(PoolMode::Failed, ModeCause::MetadataFailure, reason);
        let mut md = self.md.write();
        if let Err(e) = md.abort() {
            tracing::error!(pool = %self.state.name, "abort after failure: {e}");
        }
        if let Err(e) = md.set_needs_check() {
            tracing::error!(pool = %self.state.name, "setting needs_check: {e}");
        }
        drop(md);
        self.holds.clear();
        self.pending_passdown.clear();
        self.state.meta_dirty.store(false, Ordering::Release);
        self.state.wake_space_waiters();
    }

    fn check_writable(&self) -> io::Result<()> {
        self.state.check_writable()
    }

    fn io_error(&self, e: &MetaError) -> io::Error {
        let kind = match e {
            MetaError::OutOfDataSpace { .. } | MetaError::OutOfMetadataSpace { .. } => io::ErrorKind::StorageFull,
            MetaError::ReadOnly(_) => io::ErrorKind::ReadOnlyFilesystem,
            MetaError::InvalidArgument(_) | MetaError::NoSuchDevice(_) => io::ErrorKind::InvalidInput,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, format!("thin pool {}: {e}", self.state.name))
    }

    /// Refreshes the free-space numbers and the low-water warnings.
    pub fn refresh_space(&self) {
        let (free, total) = {
            let md = self.md.read();
            (md.free_data_blocks(), md.nr_data_blocks())
        };
        self.state.free_data_blocks.store(free, Ordering::Release);
        self.state.total_data_blocks.store(total, Ordering::Release);
        self.check_low_water();
    }

    /// Sets `low_water_reached`; reaching the mark logs once and raises a low-water event
    /// (re-armed when free space is back above the mark). Reached at `free <= mark`, as dm-thin's
    /// check_low_water_mark (so a mark of 0 fires when the last block is taken).
    pub fn check_low_water(&self) {
        let free = self.state.free_data_blocks.load(Ordering::Acquire);
        let lw = self.state.low_water_blocks.load(Ordering::Acquire);
        let below = free <= lw;
        let was = self.state.low_water_reached.swap(below, Ordering::AcqRel);
        if below && !was {
            tracing::warn!(pool = %self.state.name, free_data_blocks = free, low_water_blocks = lw, "thin pool data space reached the low-water mark");
            self.state.low_water_events.send_modify(|n| *n += 1);
        }
    }

    fn check_metadata_low_water(&mut self) {
        let (free, lw) = {
            let md = self.md.read();
            (md.free_metadata_blocks(), md.status().metadata_low_water_blocks)
        };
        // The metadata space map's threshold fires at `free <= threshold` (below_threshold).
        let below = free <= lw;
        if below && !self.meta_low_warned {
            tracing::warn!(pool = %self.state.name, free_metadata_blocks = free, metadata_low_water_blocks = lw, "thin pool metadata space below its low-water mark");
        }
        self.meta_low_warned = below;
    }

    //--------------------------------------------------------------------------------------------
    // Data-path operations

    /// Looks a mapping up (may read metadata blocks).
    pub fn lookup(&mut self, dev: u64, vblock: u64) -> io::Result<Known> {
        self.state.counters.worker_lookups.fetch_add(1, Ordering::Relaxed);
        let r = {
            let md = self.md.read();
            md.lookup(dev, vblock).map(|m| known_from(&self.state, m, md.changed_this_transaction(dev)))
        };
        r.map_err(|e| {
            let err = self.io_error(&e);
            self.after_error(&e);
            err
        })
    }

    /// Allocates a data block and reserves it for a provision (see `holds`).
    pub fn alloc(&mut self) -> Result<u64, AllocFailure> {
        if let Err(e) = self.check_writable() {
            return Err(AllocFailure::Error(e));
        }
        let r = self.md.write().alloc_data_block();
        let r = match r {
            Err(MetaError::OutOfDataSpace { .. }) if self.md.read().free_data_blocks() > 0 => {
                // Blocks freed in this transaction become usable once it commits.
                if let Err(f) = self.commit_round() {
                    return Err(AllocFailure::Error(f.into_io()));
                }
                self.md.write().alloc_data_block()
            }
            Err(e) if self.may_make_metadata_room(&e) => {
                if let Err(f) = self.commit_for_metadata_room() {
                    return Err(AllocFailure::Error(f.into_io()));
                }
                self.md.write().alloc_data_block()
            }
            r => r,
        };
        match r {
            Ok(b) => {
                self.holds.insert(b);
                self.refresh_space();
                self.check_metadata_low_water();
                Ok(b)
            }
            Err(MetaError::OutOfDataSpace { .. }) => {
                self.refresh_space();
                Err(AllocFailure::NoSpace { space_gen: self.state.space_gen.load(Ordering::Acquire) })
            }
            Err(e) => {
                let err = self.io_error(&e);
                self.after_error(&e);
                Err(AllocFailure::Error(err))
            }
        }
    }

    /// Gives back a reserved block whose provision failed.
    pub fn unalloc(&mut self, b: u64) {
        if self.holds.remove(&b) {
            let r = self.md.write().dec_data_block(b);
            if let Err(e) = r {
                self.after_error(&e);
            }
            self.refresh_space();
        }
    }

    /// Maps `vblock` of `dev` to the reserved block `b`; returns (mapping time, transaction).
    pub fn insert(&mut self, dev: u64, vblock: u64, b: u64) -> io::Result<(u32, u64)> {
        if !self.holds.remove(&b) {
            return Err(io::Error::other(format!(
                "thin pool {}: data block {b} lost its reservation (a failed commit or metadata error); the write is not done",
                self.state.name
            )));
        }
        if let Err(e) = self.check_writable() {
            self.holds.insert(b);
            self.unalloc(b);
            return Err(e);
        }
        let r = match self.insert_mapping(dev, vblock, b) {
            Err(e) if self.may_make_metadata_room(&e) => {
                // The commit drops and retakes the reservations: `b` is one again meanwhile.
                self.holds.insert(b);
                if let Err(f) = self.commit_for_metadata_room() {
                    return Err(f.into_io());
                }
                self.holds.remove(&b);
                self.insert_mapping(dev, vblock, b)
            }
            r => r,
        };
        match r {
            Ok(v) => {
                self.state.meta_dirty.store(true, Ordering::Release);
                Ok(v)
            }
            Err(e) => {
                let err = self.io_error(&e);
                let poisoned = self.md.read().is_poisoned().is_some();
                if !poisoned {
                    self.holds.insert(b);
                    self.unalloc(b);
                }
                self.after_error(&e);
                Err(err)
            }
        }
    }

    /// Unmaps `[begin, end)` of `dev`; blocks left with no reference are passed down after the
    /// next commit (when `passdown`). Returns how many blocks were unmapped.
    pub fn discard(&mut self, dev: u64, begin: u64, end: u64, passdown: bool) -> io::Result<u64> {
        self.check_writable()?;
        let r = match self.unmap_range(dev, begin, end, passdown) {
            Err(e) if self.may_make_metadata_room(&e) => {
                self.commit_for_metadata_room().map_err(CommitFailure::into_io)?;
                self.unmap_range(dev, begin, end, passdown)
            }
            r => r,
        };
        match r {
            Ok((n, free)) => {
                if n > 0 {
                    self.state.meta_dirty.store(true, Ordering::Release);
                    self.state.counters.discarded_blocks.fetch_add(n, Ordering::Relaxed);
                }
                self.pending_passdown.extend(free);
                self.refresh_space();
                Ok(n)
            }
            Err(e) => {
                let err = self.io_error(&e);
                self.after_error(&e);
                Err(err)
            }
        }
    }

    fn insert_mapping(&self, dev: u64, vblock: u64, b: u64) -> Result<(u32, u64), MetaError> {
        let mut md = self.md.write();
        md.insert(dev, vblock, b).map(|_| (md.time() & 0x00ff_ffff, self.state.open_txn.load(Ordering::Acquire)))
    }

    /// Unmaps `[begin, end)`; returns how many blocks were unmapped and, with `passdown`, the
    /// ones left without a reference.
    fn unmap_range(&self, dev: u64, begin: u64, end: u64, passdown: bool) -> Result<(u64, Vec<u64>), MetaError> {
        let mut md = self.md.write();
        md.remove_range_mappings(dev, begin, end).and_then(|removed| {
            let mut free = Vec::new();
            if passdown {
                for (_, m) in &removed {
                    if md.data_block_ref_count(m.data_block)? == 0 {
                        free.push(m.data_block);
                    }
                }
            }
            Ok((removed.len() as u64, free))
        })
    }

    /// An operation refused for lack of metadata space (nothing changed) while the open
    /// transaction holds metadata blocks it freed: those become allocatable when it commits,
    /// so a commit and one retry may succeed. The kernel commits before the metadata reserve
    /// is used for the same reason. Without this the pool would go read-only with much of its
    /// metadata free (random overwrites shadow, and so free, a large part of the tree within
    /// one commit interval).
    fn may_make_metadata_room(&self, e: &MetaError) -> bool {
        if !matches!(e, MetaError::OutOfMetadataSpace { .. }) || self.state.mode() != PoolMode::ReadWrite {
            return false;
        }
        let md = self.md.read();
        md.is_poisoned().is_none() && !md.is_read_only() && md.metadata_blocks_freed_uncommitted() > 0
    }

    /// The commit of [`Self::may_make_metadata_room`].
    fn commit_for_metadata_room(&mut self) -> Result<(), CommitFailure> {
        let freed = self.md.read().metadata_blocks_freed_uncommitted();
        tracing::debug!(pool = %self.state.name, freed_metadata_blocks = freed, "committing to reuse freed metadata blocks");
        // The freed blocks are uncommitted changes even when no mapping changed (a space-map
        // bitmap shadowed by an allocation).
        self.state.meta_dirty.store(true, Ordering::Release);
        self.commit_round()
    }

    /// Runs an admin mutation (create, snapshot, delete, transaction id, ...) and commits it
    /// at once, as dm-thin does after every pool message.
    pub fn admin<R>(&mut self, f: impl FnOnce(&mut ThinMetadata) -> Result<R, MetaError>) -> Result<R, PoolError> {
        let name = self.state.name.clone();
        if let Err(e) = self.check_writable() {
            return Err(PoolError::new(
                &name,
                match self.state.mode() {
                    PoolMode::Failed => PoolErrorKind::Failed(self.state.mode_reason()),
                    _ => PoolErrorKind::ReadOnly(e.to_string()),
                },
            ));
        }
        let r = {
            // At the reserve with freed blocks pending: commit first (see may_make_metadata_room).
            let at_reserve = {
                let md = self.md.read();
                md.free_metadata_blocks() == 0 && md.metadata_blocks_freed_uncommitted() > 0
            };
            if at_reserve && let Err(c) = self.commit_for_metadata_room() {
                return Err(PoolError::new(&name, PoolErrorKind::Io { what: "commit".into(), source: c.into_io() }));
            }
            f(&mut self.md.write())
        };
        match r {
            Ok(v) => {
                self.state.meta_dirty.store(true, Ordering::Release);
                self.commit_round().map_err(|c| {
                    PoolError::new(&name, PoolErrorKind::Io { what: "commit".into(), source: c.into_io() })
                })?;
                Ok(v)
            }
            Err(e) => {
                self.after_error(&e);
                Err(meta_err(&name, e))
            }
        }
    }
}

/// A cached mapping from an engine lookup.
pub(crate) fn known_from(state: &PoolState, m: Option<crate::meta::Mapping>, changed_this_txn: bool) -> Known {
    match m {
        None => Known::Unmapped,
        Some(m) => Known::Mapped(Cached {
            data_block: m.data_block,
            time: m.time,
            txn: if changed_this_txn { state.open_txn.load(Ordering::Acquire) } else { 0 },
        }),
    }
}
