//! Thin volumes: the data path (see the `pool` module docs for the rules).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mdkit_io::{
    BlockDevice, DeviceRef, Extent, ExtentFlags, IoBuf, IoFuture, IoOp, ReadResult, SharedBuf, Topology, WriteFlags,
    ZeroFlags, check_io, join_read_parts,
};

use super::origin::Origin;

use super::table::{AcquireDecision, Cached, Known, ReadDecision, TableCounters, WriteDecision};
use super::util::{Detached, join_all};
use super::worker::{AllocFailure, known_from};
use super::{DiscardMode, PoolMode, ThinDev};

/// Blocks whose cells one discard holds at once (dm's BIO_PRISON_MAX_RANGE idea: big discards
/// proceed in regions, so memory stays bounded).
const DISCARD_CHUNK_BLOCKS: u64 = 1024;
/// Largest buffer used to zero or copy part of a data block.
const COPY_CHUNK_BYTES: u64 = 1 << 20;

/// A thin device opened as a block device. Clone freely; clones share everything.
#[derive(Clone)]
pub struct ThinVolume {
    dev: Arc<ThinDev>,
    name: Arc<str>,
    topology: Topology,
    /// The external origin this handle reads unmapped blocks from (`origin.rs`).
    origin: Option<Arc<Origin>>,
}

impl std::fmt::Debug for ThinVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThinVolume").field("name", &self.name).field("size_bytes", &self.topology.size_bytes).finish()
    }
}

impl ThinVolume {
    pub(crate) fn new(dev: Arc<ThinDev>, size_bytes: u64) -> ThinVolume {
        let pool = &dev.pool;
        let data = pool.data.topology();
        let bs = pool.state.block_bytes;
        let topology = Topology {
            size_bytes,
            logical_block_bytes: data.logical_block_bytes,
            physical_block_bytes: data.physical_block_bytes.max(4096),
            optimal_io_bytes: u32::try_from(bs).unwrap_or(u32::MAX).min(data.max_io_bytes),
            max_io_bytes: data.max_io_bytes,
            supports_fua: true,
            volatile_cache: true,
            supports_discard: pool.state.opts.discard != DiscardMode::Ignore,
            supports_write_zeroes: true,
            discard_granularity_bytes: u32::try_from(bs).unwrap_or(u32::MAX),
            rotational: data.rotational,
        };
        let name: Arc<str> = format!("{}/thin{}", pool.state.name, dev.id).into();
        ThinVolume { dev, name, topology, origin: None }
    }

    /// This handle with an external origin (dm-thin's fourth `thin` argument, see `origin.rs`):
    /// unmapped blocks read from `origin`, which this volume only ever reads. Its size is taken
    /// now. Fails when the volume's size is not a multiple of the origin's logical block.
    pub fn with_external_origin(mut self, origin: DeviceRef) -> io::Result<ThinVolume> {
        let lbs = origin.topology().logical_block_bytes.max(self.topology.logical_block_bytes);
        if !self.topology.size_bytes.is_multiple_of(u64::from(lbs)) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: size {} bytes is not a multiple of external origin {}'s {lbs}-byte logical block",
                    self.name,
                    self.topology.size_bytes,
                    origin.name()
                ),
            ));
        }
        self.topology.logical_block_bytes = lbs;
        self.topology.physical_block_bytes = self.topology.physical_block_bytes.max(lbs);
        self.origin = Some(Arc::new(Origin::new(origin)));
        Ok(self)
    }

    /// The external origin's name and size (taken when it was attached or last refreshed), if any.
    pub fn external_origin(&self) -> Option<(&str, u64)> {
        self.origin.as_deref().map(|o| (o.dev.name(), o.size_bytes()))
    }

    /// Samples the external origin's size again (see `origin.rs`): `Some((old, new))` bytes, or
    /// `None` without an origin.
    pub fn refresh_external_origin(&self) -> io::Result<Option<(u64, u64)>> {
        self.origin.as_deref().map(|o| o.refresh()).transpose()
    }

    /// The thin device id.
    pub fn id(&self) -> u64 {
        self.dev.id
    }

    pub fn size_bytes(&self) -> u64 {
        self.topology.size_bytes
    }

    /// Fast-path and slow-path counters of this device's mapping table.
    pub fn counters(&self) -> TableCounters {
        self.dev.table.counters()
    }

    /// Mappings the table holds now.
    pub fn cached_mappings(&self) -> usize {
        self.dev.table.len()
    }

    /// Splits `[offset, offset+len)` into per-block pieces: (vblock, offset in block, length).
    fn pieces(&self, offset_bytes: u64, len_bytes: u64) -> Vec<(u64, u64, u64)> {
        let bs = self.dev.pool.state.block_bytes;
        let mut v = Vec::new();
        let mut pos = offset_bytes;
        let end = offset_bytes + len_bytes;
        while pos < end {
            let vb = pos / bs;
            let off = pos % bs;
            let n = (bs - off).min(end - pos);
            v.push((vb, off, n));
            pos += n;
        }
        v
    }

    fn detached<T: Send + 'static>(
        &self,
        f: impl Future<Output = T> + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = T> + Send + 'static>> {
        Box::pin(Detached::new(f))
    }
}

impl BlockDevice for ThinVolume {
    fn name(&self) -> &str {
        &self.name
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn read(&self, offset_bytes: u64, mut buf: IoBuf) -> IoFuture<'_, ReadResult> {
        let bs = self.dev.pool.state.block_bytes;
        let (vb, off) = (offset_bytes / bs, offset_bytes % bs);
        self.dev.table.prefetch(vb);
        let len = buf.len() as u64;
        if let Err(e) = check_io(&self.name, &self.topology, IoOp::Read, offset_bytes, len)
            .and_then(|()| self.dev.pool.state.check_open())
        {
            return Box::pin(std::future::ready((buf, Err(e))));
        }
        if len == 0 {
            return Box::pin(std::future::ready((buf, Ok(()))));
        }
        // Reads are not detached (no `'static` future, no reference taken on the device): a
        // read dropped before its data arrived ends its in-flight count early, so a slow path
        // may reuse the data block while the device still reads it, into a buffer nobody
        // will look at. Writes must not end early (see `write`).
        let origin = self.origin.as_deref();
        if off + len <= bs {
            return Box::pin(self.dev.read_block(vb, off, buf, origin));
        }
        let pieces = self.pieces(offset_bytes, len);
        let mut futs: Vec<Pin<Box<dyn Future<Output = ReadResult> + Send + '_>>> = Vec::with_capacity(pieces.len());
        for (vb, off, n) in pieces {
            let part = buf.split_to(n as usize);
            futs.push(Box::pin(self.dev.read_block(vb, off, part, origin)));
        }
        Box::pin(async move { join_read_parts(buf, join_all(futs).await) })
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        let bs = self.dev.pool.state.block_bytes;
        let (vb, off) = (offset_bytes / bs, offset_bytes % bs);
        self.dev.table.prefetch(vb);
        let len = buf.len() as u64;
        let ok = check_io(&self.name, &self.topology, IoOp::Write, offset_bytes, len)
            .and_then(|()| self.dev.pool.state.check_writable());
        if let Err(e) = ok {
            return Box::pin(std::future::ready(Err(e)));
        }
        if len == 0 {
            return Box::pin(std::future::ready(Ok(())));
        }
        if off + len <= bs {
            return self.detached(self.dev.clone().write_block(vb, off, buf, flags.fua, self.origin.clone()));
        }
        let pieces = self.pieces(offset_bytes, len);
        let mut at = 0usize;
        let futs: Vec<Pin<Box<dyn Future<Output = io::Result<()>> + Send>>> = pieces
            .into_iter()
            .map(|(vb, off, n)| {
                let part = buf.slice(at..at + n as usize);
                at += n as usize;
                Box::pin(self.dev.clone().write_block(vb, off, part, flags.fua, self.origin.clone()))
                    as Pin<Box<dyn Future<Output = io::Result<()>> + Send>>
            })
            .collect();
        self.detached(async move { join_all(futs).await.into_iter().find(|r| r.is_err()).unwrap_or(Ok(())) })
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        // Not detached: a flush holds no cell and no in-flight count, and what it starts runs
        // on without the caller (the data device's flush once issued; a commit round once the
        // metadata worker has it), so dropping the future leaves nothing half done.
        Box::pin(self.dev.pool.flush())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        let ok = check_io(&self.name, &self.topology, IoOp::Discard, offset_bytes, len_bytes)
            .and_then(|()| self.dev.pool.state.check_writable());
        if let Err(e) = ok {
            return Box::pin(std::future::ready(Err(e)));
        }
        let state = &self.dev.pool.state;
        if state.opts.discard == DiscardMode::Ignore {
            return Box::pin(std::future::ready(Ok(())));
        }
        let bs = state.block_bytes;
        let begin = offset_bytes.div_ceil(bs);
        let end = (offset_bytes + len_bytes) / bs;
        if begin >= end {
            return Box::pin(std::future::ready(Ok(())));
        }
        let passdown = state.passdown;
        let dev = self.dev.clone();
        self.detached(async move { dev.unmap_blocks(begin, end, passdown).await })
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        let ok = check_io(&self.name, &self.topology, IoOp::WriteZeroes, offset_bytes, len_bytes)
            .and_then(|()| self.dev.pool.state.check_writable());
        if let Err(e) = ok {
            return Box::pin(std::future::ready(Err(e)));
        }
        let bs = self.dev.pool.state.block_bytes;
        let pieces = self.pieces(offset_bytes, len_bytes);
        let passdown = self.dev.pool.state.passdown;
        let dev = self.dev.clone();
        let origin = self.origin.clone();
        self.detached(async move {
            // Whole blocks are unmapped (they read as zeroes), unless the range must stay
            // allocated or the block would read an external origin; partial blocks get zeroes
            // written where they are mapped (or read the origin).
            let mut run: Option<(u64, u64)> = None;
            for (vb, off, n) in pieces {
                let on_origin = origin.as_ref().is_some_and(|o| o.covers(vb, bs));
                if !flags.no_unmap && !on_origin && off == 0 && n == bs {
                    run = match run {
                        Some((b, e)) if e == vb => Some((b, vb + 1)),
                        Some((b, e)) => {
                            dev.unmap_blocks(b, e, passdown).await?;
                            Some((vb, vb + 1))
                        }
                        None => Some((vb, vb + 1)),
                    };
                    continue;
                }
                if let Some((b, e)) = run.take() {
                    dev.unmap_blocks(b, e, passdown).await?;
                }
                dev.clone().zero_piece(vb, off, n, flags.no_unmap || on_origin, origin.clone()).await?;
            }
            if let Some((b, e)) = run {
                dev.unmap_blocks(b, e, passdown).await?;
            }
            if flags.fua {
                dev.pool.flush().await?;
            }
            Ok(())
        })
    }

    fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent>>> {
        let size_bytes = self.topology.size_bytes;
        // Below the external origin's end every block holds data: mapped, or the origin's.
        let origin_bytes = self.origin.as_deref().map_or(0, Origin::size_bytes);
        if offset_bytes < origin_bytes
            && len_bytes > 0
            && offset_bytes.checked_add(len_bytes).is_some_and(|end| end <= size_bytes)
        {
            let len_bytes = len_bytes.min(origin_bytes - offset_bytes);
            return Box::pin(std::future::ready(Ok(vec![Extent { len_bytes, flags: ExtentFlags::DATA }])));
        }
        Box::pin(self.dev.block_status(&self.name, size_bytes, offset_bytes, len_bytes, max_extents))
    }

    fn changed_since(
        &self,
        base: u64,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent<bool>>>> {
        let size_bytes = self.topology.size_bytes;
        Box::pin(self.dev.changed_since(&self.name, size_bytes, base, offset_bytes, len_bytes, max_extents))
    }
}

//------------------------------------------------------------------------------------------------
// Guards

/// A fast-path I/O counted in its shard's epoch (ended when the data I/O is done).
struct IoRef<'a> {
    dev: &'a ThinDev,
    vblock: u64,
    epoch: u8,
    write: bool,
}

impl Drop for IoRef<'_> {
    fn drop(&mut self) {
        self.dev.table.end_io(self.vblock, self.epoch, self.write);
    }
}

/// A held cell. `release` publishes the new state; dropping it unreleased (error paths)
/// forgets what the table knew, so the next access reloads the mapping from the metadata.
struct CellRef<'a> {
    dev: &'a ThinDev,
    vblock: u64,
    write: bool,
    done: bool,
}

impl<'a> CellRef<'a> {
    fn new(dev: &'a ThinDev, vblock: u64, write: bool) -> CellRef<'a> {
        CellRef { dev, vblock, write, done: false }
    }

    fn release(mut self, known: Known) {
        self.done = true;
        self.dev.table.release(self.vblock, known, self.write);
    }
}

impl Drop for CellRef<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.dev.table.release(self.vblock, Known::Unknown, self.write);
        }
    }
}

async fn wait(rx: Option<tokio::sync::oneshot::Receiver<()>>) {
    if let Some(rx) = rx {
        let _ = rx.await;
    }
}

//------------------------------------------------------------------------------------------------
// Per-block operations

/// What a newly provisioned block holds outside the part a write covers.
#[derive(Clone, Copy)]
enum Fill<'a> {
    /// Zeroes (when the pool zeroes new blocks).
    Zeroes,
    /// The shared data block being copied.
    Copy(u64),
    /// The external origin's part of this virtual block.
    Origin(&'a Origin, u64),
}

impl ThinDev {
    fn block_bytes(&self) -> u64 {
        self.pool.state.block_bytes
    }

    fn thin_name(&self) -> String {
        format!("{}/thin{}", self.pool.state.name, self.id)
    }

    fn data_error(&self, e: io::Error, op: &str, vblock: u64, data_block: u64) -> io::Error {
        io::Error::new(
            e.kind(),
            format!(
                "{}/thin{}: {op} of virtual block {vblock} (data block {data_block}): {e}",
                self.pool.state.name, self.id
            ),
        )
    }

    async fn read_block(&self, vblock: u64, off: u64, mut buf: IoBuf, origin: Option<&Origin>) -> ReadResult {
        let bs = self.block_bytes();
        loop {
            let max_txn = self.pool.state.max_valid_txn();
            match self.table.begin_read(vblock, max_txn) {
                ReadDecision::Mapped { data_block, epoch } => {
                    let guard = IoRef { dev: self, vblock, epoch, write: false };
                    let (b, r) = self.pool.data.read(data_block * bs + off, buf).await;
                    drop(guard);
                    return (b, r.map_err(|e| self.data_error(e, "read", vblock, data_block)));
                }
                ReadDecision::Zeroes => {
                    if let Some(o) = origin.filter(|o| o.covers(vblock, bs)) {
                        let (b, r) = o.read(vblock * bs + off, buf).await;
                        return (b, r.map_err(|e| o.error(e, &self.thin_name(), "read", vblock)));
                    }
                    buf.as_mut_slice().fill(0);
                    return (buf, Ok(()));
                }
                ReadDecision::Wait(rx) => wait(Some(rx)).await,
                ReadDecision::Resolve { drained } => {
                    // Boxed: the fast path's future stays small (no slow-path state inline).
                    let r: io::Result<()> = Box::pin(async move {
                        let cell = CellRef::new(self, vblock, false);
                        wait(drained).await;
                        cell.release(self.resolve(vblock).await?);
                        Ok(())
                    })
                    .await;
                    if let Err(e) = r {
                        return (buf, Err(e));
                    }
                }
            }
        }
    }

    async fn write_block(
        self: Arc<Self>,
        vblock: u64,
        off: u64,
        data: SharedBuf,
        fua: bool,
        origin: Option<Arc<Origin>>,
    ) -> io::Result<()> {
        let bs = self.block_bytes();
        loop {
            match self.table.begin_write(vblock) {
                WriteDecision::InPlace { data_block, txn, epoch } => {
                    // The fast path: nothing but the data write (and, for FUA to a mapping not
                    // yet committed, a commit round after it).
                    // The data write carries FUA itself: a commit round that starts while it
                    // is in flight may commit the mapping without flushing this data.
                    let guard = IoRef { dev: &self, vblock, epoch, write: true };
                    let r = self.pool.data.write(data_block * bs + off, data, WriteFlags { fua }).await;
                    drop(guard);
                    r.map_err(|e| self.data_error(e, "write", vblock, data_block))?;
                    if fua {
                        self.pool.commit_covering(txn).await?;
                    }
                    return Ok(());
                }
                WriteDecision::Wait(rx) => wait(Some(rx)).await,
                WriteDecision::Frozen => self.table.wait_thawed().await,
                WriteDecision::Slow { known, drained } => {
                    // Boxed: the fast path's future stays small (no slow-path state inline).
                    let dev = self.clone();
                    return Box::pin(async move {
                        let cell = CellRef::new(&dev, vblock, true);
                        wait(drained).await;
                        dev.slow_write(cell, known, vblock, off, data, fua, origin.as_deref()).await
                    })
                    .await;
                }
            }
        }
    }

    /// Provision, break sharing, or (after a lookup miss) write in place, holding the cell.
    #[allow(clippy::too_many_arguments)]
    async fn slow_write(
        &self,
        cell: CellRef<'_>,
        known: Known,
        vblock: u64,
        off: u64,
        data: SharedBuf,
        fua: bool,
        origin: Option<&Origin>,
    ) -> io::Result<()> {
        let bs = self.block_bytes();
        let known = match known {
            Known::Unknown => self.resolve(vblock).await?,
            k => k,
        };
        self.pool.state.check_writable()?;
        if let Known::Mapped(c) = known
            && !self.table.is_shared(&c)
        {
            let r = self.pool.data.write(c.data_block * bs + off, data, WriteFlags { fua }).await;
            cell.release(known);
            r.map_err(|e| self.data_error(e, "write", vblock, c.data_block))?;
            if fua {
                self.pool.commit_covering(c.txn).await?;
            }
            return Ok(());
        }
        let old = match known {
            Known::Mapped(c) => Some(c.data_block),
            _ => None,
        };
        let src = match (old, origin) {
            (Some(o), _) => Fill::Copy(o),
            (None, Some(o)) if o.covers(vblock, bs) => Fill::Origin(o, vblock),
            _ => Fill::Zeroes,
        };
        let b = match self.alloc_block().await {
            Ok(b) => b,
            Err(e) => {
                cell.release(known);
                return Err(e);
            }
        };
        if let Err(e) = self.fill_new_block(b, src, off, &data).await {
            let _ = self.pool.call_io(move |w| w.unalloc(b)).await;
            cell.release(known);
            return Err(self.data_error(e, if old.is_some() { "breaking sharing" } else { "provisioning" }, vblock, b));
        }
        let id = self.id;
        let (time, txn) = self.pool.call_io(move |w| w.insert(id, vblock, b)).await??;
        cell.release(Known::Mapped(Cached { data_block: b, time, txn }));
        let counters = &self.pool.state.counters;
        if old.is_some() {
            counters.sharing_breaks.fetch_add(1, Ordering::Relaxed);
        } else {
            counters.provisions.fetch_add(1, Ordering::Relaxed);
        }
        if fua {
            self.pool.commit_covering(txn).await?;
        }
        Ok(())
    }

    /// What the metadata says about `vblock` (the caller holds its cell).
    async fn resolve(&self, vblock: u64) -> io::Result<Known> {
        let state = &self.pool.state;
        if let Some(md) = self.pool.md.try_read()
            && md.is_poisoned().is_none()
            && let Ok(m) = md.lookup_cached(self.id, vblock)
        {
            return Ok(known_from(state, m, md.changed_this_transaction(self.id)));
        }
        let id = self.id;
        self.pool.call_io(move |w| w.lookup(id, vblock)).await?
    }

    /// A data block for a provision, per the out-of-space policy.
    async fn alloc_block(&self) -> io::Result<u64> {
        let state = &self.pool.state;
        let mut deadline: Option<Instant> = None;
        loop {
            state.check_writable()?;
            match self.pool.call_io(|w| w.alloc()).await? {
                Ok(b) => return Ok(b),
                Err(AllocFailure::Error(e)) => return Err(e),
                Err(AllocFailure::NoSpace { space_gen }) => {
                    let nr = state.total_data_blocks.load(Ordering::Acquire);
                    if state.opts.error_if_no_space {
                        state.counters.no_space_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(io::Error::new(
                            io::ErrorKind::StorageFull,
                            format!(
                                "thin pool {}: out of data space (all {nr} blocks in use; error_if_no_space)",
                                state.name
                            ),
                        ));
                    }
                    let timeout = state.opts.no_space_timeout;
                    let d = *deadline.get_or_insert_with(|| {
                        state.counters.no_space_waits.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(pool = %state.name, "out of data space: queueing writes for up to {} s", timeout.as_secs());
                        Instant::now() + timeout
                    });
                    let notified = state.space_notify.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    if state.space_gen.load(Ordering::Acquire) != space_gen {
                        continue;
                    }
                    if tokio::time::timeout_at(d.into(), notified).await.is_err() {
                        state.counters.no_space_errors.fetch_add(1, Ordering::Relaxed);
                        return Err(io::Error::new(
                            io::ErrorKind::StorageFull,
                            format!(
                                "thin pool {}: out of data space (all {nr} blocks in use) for {} ms; write failed",
                                state.name,
                                timeout.as_millis()
                            ),
                        ));
                    }
                }
            }
        }
    }

    /// Writes the contents of new block `b`: the write's data, over a copy of the old block
    /// (breaking sharing), of the external origin's block, or zeroes (provisioning), or just the
    /// data when it covers the block or zeroing is off (and there is nothing to copy).
    async fn fill_new_block(&self, b: u64, src: Fill<'_>, off: u64, data: &SharedBuf) -> io::Result<()> {
        let bs = self.block_bytes();
        let pool = &self.pool;
        let base = b * bs;
        let (ws, we) = (off, off + data.len() as u64);
        if ws == 0 && we == bs {
            return pool.data.write(base, data.clone(), WriteFlags::NONE).await;
        }
        let zeroes = matches!(src, Fill::Zeroes);
        if zeroes && !pool.state.opts.zero_new_blocks {
            return pool.data.write(base + off, data.clone(), WriteFlags::NONE).await;
        }
        if zeroes {
            pool.state.counters.zeroed_blocks.fetch_add(1, Ordering::Relaxed);
        }
        let mut cs = 0;
        while cs < bs {
            let ce = (cs + COPY_CHUNK_BYTES).min(bs);
            let n = (ce - cs) as usize;
            let (os, oe) = (ws.max(cs), we.min(ce));
            if ws <= cs && ce <= we {
                pool.data
                    .write(base + cs, data.slice((cs - ws) as usize..(ce - ws) as usize), WriteFlags::NONE)
                    .await?;
            } else if zeroes && os >= oe {
                zero_range(&*pool.data, base + cs, ce - cs).await?;
            } else {
                let mut buf = match src {
                    Fill::Copy(o) => {
                        let (buf, r) = pool.data.read(o * bs + cs, IoBuf::uninit_contents(n)).await;
                        r?;
                        buf
                    }
                    Fill::Origin(o, vb) => {
                        let (buf, r) = o.read(vb * bs + cs, IoBuf::uninit_contents(n)).await;
                        r.map_err(|e| o.error(e, &self.thin_name(), "copy for a partial write", vb))?;
                        buf
                    }
                    Fill::Zeroes => IoBuf::zeroed(n),
                };
                if os < oe {
                    buf.as_mut_slice()[(os - cs) as usize..(oe - cs) as usize]
                        .copy_from_slice(&data.as_slice()[(os - ws) as usize..(oe - ws) as usize]);
                }
                pool.data.write(base + cs, buf.freeze(), WriteFlags::NONE).await?;
            }
            cs = ce;
        }
        Ok(())
    }

    /// Unmaps `[begin, end)` in regions, holding the cells of each region.
    async fn unmap_blocks(&self, begin: u64, end: u64, passdown: bool) -> io::Result<()> {
        let mut vb = begin;
        while vb < end {
            let region_end = (vb + DISCARD_CHUNK_BLOCKS).min(end);
            let mut cells = Vec::with_capacity((region_end - vb) as usize);
            for v in vb..region_end {
                loop {
                    match self.table.acquire(v) {
                        AcquireDecision::Acquired { drained, .. } => {
                            cells.push(CellRef::new(self, v, false));
                            wait(drained).await;
                            break;
                        }
                        AcquireDecision::Wait(rx) => wait(Some(rx)).await,
                    }
                }
            }
            let (id, b, e) = (self.id, vb, region_end);
            self.pool.call_io(move |w| w.discard(id, b, e, passdown)).await??;
            for c in cells {
                c.release(Known::Unmapped);
            }
            vb = region_end;
        }
        Ok(())
    }

    /// Zeroes part of one block: nothing to do when it is unmapped (unless it must become
    /// allocated), else a write of zeroes through the normal write path.
    async fn zero_piece(
        self: Arc<Self>,
        vblock: u64,
        off: u64,
        len: u64,
        allocate: bool,
        origin: Option<Arc<Origin>>,
    ) -> io::Result<()> {
        if !allocate {
            let known = loop {
                match self.table.acquire(vblock) {
                    AcquireDecision::Acquired { known, drained } => {
                        let cell = CellRef::new(&self, vblock, false);
                        wait(drained).await;
                        let k = match known {
                            Known::Unknown => self.resolve(vblock).await?,
                            k => k,
                        };
                        cell.release(k);
                        break k;
                    }
                    AcquireDecision::Wait(rx) => wait(Some(rx)).await,
                }
            };
            if known == Known::Unmapped {
                return Ok(());
            }
        }
        let mut pos = off;
        while pos < off + len {
            let n = (off + len - pos).min(COPY_CHUNK_BYTES);
            self.clone().write_block(vblock, pos, SharedBuf::zeroed(n as usize), false, origin.clone()).await?;
            pos += n;
        }
        Ok(())
    }
}

/// Zeroes a range of the data device (write-zeroes where supported, else zero buffers).
async fn zero_range(data: &dyn BlockDevice, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
    if data.topology().supports_write_zeroes {
        return data.write_zeroes(offset_bytes, len_bytes, ZeroFlags::default()).await;
    }
    let mut pos = offset_bytes;
    while pos < offset_bytes + len_bytes {
        let n = (offset_bytes + len_bytes - pos).min(COPY_CHUNK_BYTES);
        data.write(pos, SharedBuf::zeroed(n as usize), WriteFlags::NONE).await?;
        pos += n;
    }
    Ok(())
}

impl super::Pool {
    /// True when the pool fails writes (metadata error).
    pub fn is_failed(&self) -> bool {
        self.inner.state.mode() == PoolMode::Failed
    }
}
