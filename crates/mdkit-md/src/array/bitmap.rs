//! The write-intent bitmap runtime (md internal bitmap, version 4 on disk).
//!
//! One bit per `chunksize` bytes of the sync domain, the same bitmap on every member (see
//! [`crate::format::bitmap`] for the bytes). The promise this component keeps, whatever the
//! timing of requests, power cuts and member failures:
//!
//! > **A chunk's bit is durable on every working member before [`WriteIntentBitmap::start_write`]
//! > returns for a write to that chunk, and it is cleared only after a member flush that covers
//! > every data write it described has completed — never while the array is degraded.**
//!
//! So after a crash the set bits are a superset of the chunks whose copies may differ, and a
//! member that left for a while can be re-added by recovering only the chunks written meanwhile.
//!
//! # What it costs
//! ```text
//!  start_write(range)          per chunk: one CAS on the chunk's own counter
//!    bit already durable  ---> return                                 (no lock, no I/O)
//!    bit not durable      ---> round lock: set bit, join the next round
//!                              round writer: snapshot the wanted pages, one FUA write per
//!                              member per run of adjacent pages (whole 4 KiB pages); every
//!                              request that joined before the snapshot is served
//!  end_write(range, ok)        per chunk: one CAS (pending - 1; NEEDED when !ok)
//!  daemon (every time_base, or when idle dirty chunks >= flush_chunks)
//!    age idle chunks (periodic sweeps: a whole idle region at a time, idle_region_bytes)
//!    -> events_cleared durable -> flush every member -> clear bits of chunks still idle
//!    since before the flush -> write changed pages (plain writes)
//! ```
//! Chunk counters live in per-page blocks of atomics allocated on first use; the idle-dirty
//! count behind `flush_chunks` and the statistics are sharded by chunk. Nothing on the write
//! path takes a lock shared with other chunks' writers unless the bit must be written.
//!
//! # Bitmap I/O
//! Every bitmap write is a whole, 4 KiB-aligned page (the bitmap must start 4 KiB aligned on
//! each member). The last page is written whole (padding) when the member's reserved space
//! ([`BitmapMember::space_bytes`]) covers it; when it does not, the 4 KiB block is read, the
//! bitmap's bytes are overlaid and the block is written back whole (read-modify-write; the
//! owner of the bytes beyond the space serialises with [`WriteIntentBitmap::tail_block_guard`]).
//! Writes that must be durable (bits being set, the bitmap superblock) are FUA; clears are
//! plain writes. A member whose bitmap write or flush fails is reported through the
//! [`FailFn`] and left out of later rounds; a round succeeds when at least one member took it.
//!
//! # Kernel rules kept (drivers/md/md-bitmap.c)
//! - load: uuid must match; bitmap `events < md events` (or STALE) means every bit is needed;
//!   dirty bits are NEEDED (resync) from `resync_offset` on — from sector 0 when the array is
//!   degraded and `events_cleared != events`, so a later re-add recovers them;
//! - `events` is written before every md superblock ([`WriteIntentBitmap::update_superblock`]);
//!   `events_cleared` is advanced to the md events (and made durable) before bits are cleared,
//!   never while degraded, and never past the events the members' md superblocks hold (a
//!   successful write advances it in the kernel, so it never passes a round still in
//!   flight); a re-add is possible when `member events >= events_cleared`;
//! - a write that did not reach every slot (`end_write(.., false)`) marks its chunks NEEDED;
//!   NEEDED chunks are never cleared until [`WriteIntentBitmap::end_sync`].
//!
//! Unlike the kernel (which reads one member), load takes the union of the bits of every
//! readable member and rewrites members that differ, so a bit that reached only some members
//! before a crash is kept.

mod chunks;
mod load;
mod pages;
mod sweep;

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use mdkit_io::DeviceRef;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use crate::format::SECTOR_BYTES;
use crate::format::bitmap::{BitmapGeometry, BitmapSuper, COUNTER_MAX};
use crate::format::superblock::Superblock;

use chunks::{ChunkState, Sharded};
use pages::{MemberIo, Page};

pub use load::BitmapCreate;

/// Called with a member's slot and the error when a bitmap write or flush on it fails; the
/// array fails the member. Must not block (it runs inside bitmap I/O completion).
pub type FailFn = Arc<dyn Fn(u32, &io::Error) + Send + Sync>;

/// Bytes per bitmap page (the unit of every bitmap read and write).
pub const PAGE_BYTES: u64 = crate::format::METADATA_BLOCK_BYTES as u64;

/// Default `flush_chunks`: 0, no threshold — bits clear after `time_base` of idleness only, as
/// md does. A threshold bounds the resync after a crash to about that many chunks plus those
/// being written, at a price: a workload whose busy set is larger pays a bitmap write again for
/// chunks cleared under it (measured: 4 MiB chunks over 1 TiB, QD32, about a third fewer IOPS
/// with 65536).
pub const DEFAULT_FLUSH_CHUNKS: u64 = 0;

/// Default `idle_region_bytes`: periodic sweeps clear a chunk's bit only once the whole GiB of
/// the sync domain around it has gone unwritten for a `time_base` (see `sweep`).
pub const DEFAULT_IDLE_REGION_BYTES: u64 = 1 << 30;

/// How often the daemon looks at the idle-dirty count between sweeps (the threshold check on
/// the write path is approximate per shard; this bounds how late a crossing is noticed).
const THRESHOLD_POLL: Duration = Duration::from_millis(100);

/// One member's copy of the bitmap.
#[derive(Clone)]
pub struct BitmapMember {
    /// What [`FailFn`] is called with (the array's slot / role of the member).
    pub slot: u32,
    pub dev: DeviceRef,
    /// Absolute byte offset of the bitmap superblock on `dev` (`super_offset + bitmap_offset`);
    /// must be a multiple of 4 KiB.
    pub bitmap_offset_bytes: u64,
    /// Bytes from `bitmap_offset_bytes` the bitmap may use before running into data or other
    /// metadata (bad-block log, superblock); see [`bitmap_space_bytes`].
    pub space_bytes: u64,
}

impl std::fmt::Debug for BitmapMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BitmapMember(slot {} {} @ {} space {})",
            self.slot,
            self.dev.name(),
            self.bitmap_offset_bytes,
            self.space_bytes
        )
    }
}

impl BitmapMember {
    /// The member's bitmap location and space from its md superblock.
    pub fn from_superblock(slot: u32, dev: DeviceRef, sb: &Superblock) -> io::Result<BitmapMember> {
        let device_sectors = dev.topology().sectors();
        let sector = sb.bitmap_sector().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: the superblock has no internal bitmap", dev.name()),
            )
        })?;
        let space_bytes = bitmap_space_bytes(sb, device_sectors).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: the bitmap at sector {sector} lies outside the device", dev.name()),
            )
        })?;
        Ok(BitmapMember { slot, dev, bitmap_offset_bytes: sector * SECTOR_BYTES, space_bytes })
    }
}

/// Bytes the internal bitmap of `sb` may occupy: from its start to the nearest of the data
/// area, the bad-block log, the superblock and the end of the device that lies after it
/// (`None` when the superblock has no bitmap or it starts outside the device).
pub fn bitmap_space_bytes(sb: &Superblock, device_sectors: u64) -> Option<u64> {
    let start = sb.bitmap_sector()?;
    if start >= device_sectors {
        return None;
    }
    let mut limit = device_sectors;
    let mut consider = |s: u64| {
        if s > start {
            limit = limit.min(s);
        }
    };
    consider(sb.data_offset_sectors);
    consider(sb.super_offset_sectors);
    if let Some(b) = sb.bblog_sector() {
        consider(b);
    }
    Some((limit - start) * SECTOR_BYTES)
}

/// What the bitmap needs to know about its array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitmapArrayInfo {
    /// For errors and logs ("md0").
    pub name: String,
    /// The array's `set_uuid`; the bitmap's uuid must match.
    pub set_uuid: [u8; 16],
    /// The md event count of the assembled array.
    pub events: u64,
    /// md `resync_offset` (recovery_cp): dirty bits at or beyond it need resync;
    /// `MAX_SECTOR` when the array was clean.
    pub resync_offset_sectors: u64,
    /// The sync domain in sectors (kernel `resync_max_sectors`: per-member size for
    /// raid1/4/5/6, array size for raid10); the number of bits follows from it.
    pub sync_size_sectors: u64,
    /// Whether a slot lacks an in-sync member at assembly.
    pub degraded: bool,
}

/// Counters (cumulative since load) and current state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BitmapStats {
    /// `start_write` calls (data writes covered by the bitmap).
    pub data_writes: u64,
    /// `start_write` calls that found every bit already durable (no lock, no I/O).
    pub fast_path_writes: u64,
    /// Bitmap write requests issued to members: one per member per round per run of adjacent
    /// pages (each whole 4 KiB pages), however many requests the round serves.
    pub page_writes: u64,
    /// Of those, read-modify-writes of a tail block that could not be padded.
    pub rmw_page_writes: u64,
    /// Rounds that set bits (durable, FUA), however many requests and pages they served.
    pub set_rounds: u64,
    /// Rounds that wrote cleared bits.
    pub clear_rounds: u64,
    /// Rounds for the bitmap superblock or whole-bitmap writes alone (events, new members).
    pub header_rounds: u64,
    /// Clear sweeps run (periodic, threshold, explicit).
    pub sweeps: u64,
    /// Member flushes issued by clear sweeps.
    pub member_flushes: u64,
    pub bits_set: u64,
    pub bits_cleared: u64,
    /// Chunks whose bit is set in memory now.
    pub dirty_chunks: u64,
    /// Dirty chunks with no write in flight and not needing sync (what `flush_chunks` counts).
    pub idle_dirty_chunks: u64,
    /// Chunks that need resync/recovery.
    pub needed_chunks: u64,
}

/// Sharded hot-path counters and plain slow-path counters.
#[derive(Default)]
struct Stats {
    data_writes: Sharded,
    fast_path_writes: Sharded,
    page_writes: AtomicU64,
    rmw_page_writes: AtomicU64,
    set_rounds: AtomicU64,
    clear_rounds: AtomicU64,
    header_rounds: AtomicU64,
    sweeps: AtomicU64,
    member_flushes: AtomicU64,
    bits_set: AtomicU64,
    bits_cleared: AtomicU64,
}

/// Run-time settings (md sysfs `bitmap/*` plus mdkit's `flush_chunks`).
struct Settings {
    /// `time_base`: the daemon period.
    daemon_sleep_ms: AtomicU64,
    flush_chunks: AtomicU64,
    /// Periodic sweeps judge idleness per region of this many sync-domain bytes (0: per chunk).
    idle_region_bytes: AtomicU64,
    /// `can_clear` as set by the user (clearing also needs a non-degraded array).
    can_clear: AtomicBool,
}

/// Shared state of one bitmap; see the module documentation.
struct Inner {
    name: String,
    geo: BitmapGeometry,
    pages: Box<[Page]>,
    /// The bitmap superblock as it will be written next (events, events_cleared, settings).
    header: Mutex<BitmapSuper>,
    members: RwLock<Arc<Vec<Arc<MemberIo>>>>,
    on_member_error: FailFn,
    degraded: AtomicBool,
    /// The md event count that the superblocks of every working member hold (the last
    /// superblock round that completed on all of them). `events_cleared` never passes it: the
    /// header's `events` is raised at the start of a round, and a member that fails during
    /// that round keeps the older count, with which it must stay re-addable.
    events_recorded: AtomicU64,
    settings: Settings,
    /// Dirty chunks with no write in flight and not needed (for `flush_chunks`).
    idle_dirty: Sharded,
    kick: Notify,
    kick_pending: AtomicBool,
    /// `time_base` changed: the daemon re-arms its timer.
    retime: Notify,
    stop: Notify,
    stopped: AtomicBool,
    /// Bitmap write rounds (group commit).
    rounds: pages::RoundState,
    /// One clear sweep at a time (daemon, shutdown, explicit).
    sweep_lock: tokio::sync::Mutex<()>,
    runtime: tokio::runtime::Handle,
    stats: Stats,
}

impl Inner {
    fn io_error(&self, kind: io::ErrorKind, what: impl std::fmt::Display) -> io::Error {
        io::Error::new(kind, format!("{}: write-intent bitmap: {what}", self.name))
    }

    fn chunks(&self) -> u64 {
        self.geo.chunks()
    }

    /// Chunks covered by a sync-domain sector range; `InvalidInput` beyond the bitmap.
    fn chunk_range(&self, range: &Range<u64>) -> io::Result<Range<u64>> {
        if range.start >= range.end {
            return Ok(0..0);
        }
        if range.end > self.geo.sync_size_sectors {
            return Err(self.io_error(
                io::ErrorKind::InvalidInput,
                format!(
                    "sectors {}..{} are beyond the {} sectors the bitmap covers",
                    range.start, range.end, self.geo.sync_size_sectors
                ),
            ));
        }
        Ok(self.geo.chunks_for_range(range.start, range.end - range.start))
    }

    fn clearing_allowed(&self) -> bool {
        !self.degraded.load(Ordering::Acquire) && self.settings.can_clear.load(Ordering::Acquire)
    }

    fn daemon_sleep(&self) -> Duration {
        Duration::from_millis(self.settings.daemon_sleep_ms.load(Ordering::Relaxed).max(1))
    }

    /// Chunks per idle region (at least 1).
    fn idle_region_chunks(&self) -> u64 {
        (self.settings.idle_region_bytes.load(Ordering::Relaxed) / u64::from(self.geo.chunk_bytes)).max(1)
    }

    fn members_snapshot(&self) -> Arc<Vec<Arc<MemberIo>>> {
        self.members.read().clone()
    }

    /// Accounts a chunk state change in the idle-dirty count; may wake the daemon.
    fn account(&self, chunk: u64, old: u32, new: u32) {
        match (ChunkState::clearable(old), ChunkState::clearable(new)) {
            (false, true) => {
                let shard = self.idle_dirty.add(chunk, 1);
                self.maybe_kick(shard);
            }
            (true, false) => {
                self.idle_dirty.add(chunk, -1);
            }
            _ => {}
        }
    }

    /// Wakes the daemon for a threshold sweep when the idle-dirty count reached `flush_chunks`.
    /// `shard_value` is the count of the shard just incremented: the total is summed only when
    /// that shard alone is at its share of the threshold (the daemon's poll catches the rest).
    fn maybe_kick(&self, shard_value: i64) {
        let limit = self.settings.flush_chunks.load(Ordering::Relaxed);
        if limit == 0 || (shard_value.max(0) as u64).saturating_mul(chunks::SHARDS as u64) < limit {
            return;
        }
        self.kick_if_over_threshold();
    }

    fn kick_if_over_threshold(&self) {
        let limit = self.settings.flush_chunks.load(Ordering::Relaxed);
        if limit == 0 || self.idle_dirty.sum() < limit || !self.clearing_allowed() {
            return;
        }
        if !self.kick_pending.swap(true, Ordering::AcqRel) {
            self.kick.notify_one();
        }
    }

    fn spawn<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.runtime.spawn(fut);
    }

    /// Decrements the pending count of `chunks` (a write that ended, or one that was never
    /// issued), marking them NEEDED when `succeeded` is false.
    fn end_chunks(&self, chunks: Range<u64>, succeeded: bool) {
        for c in chunks {
            let Some(state) = self.chunk_state(c) else {
                debug_assert!(false, "end_write on chunk {c} that never started");
                continue;
            };
            let mut old = state.load(Ordering::Acquire);
            loop {
                if ChunkState::pending(old) == 0 {
                    debug_assert!(false, "end_write on chunk {c} without a pending write");
                    break;
                }
                let mut new = old - 1;
                if !succeeded {
                    new |= ChunkState::NEEDED;
                }
                match state.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        self.account(c, old, new);
                        break;
                    }
                    Err(cur) => old = cur,
                }
            }
        }
    }
}

/// Undoes the pending counts a `start_write` took when it does not return `Ok` (error, or its
/// future dropped while waiting for a round).
struct PendingGuard<'a> {
    inner: &'a Inner,
    start: u64,
    /// Chunks `start..taken` hold a pending count.
    taken: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.taken > self.start {
            self.inner.end_chunks(self.start..self.taken, true);
        }
    }
}

//------------------------------------------------------------------------------------------------

/// The write-intent bitmap of one array; see the module documentation.
pub struct WriteIntentBitmap {
    inner: Arc<Inner>,
    daemon: Mutex<Option<tokio::task::JoinHandle<()>>>,
    shut_down: AtomicBool,
}

impl std::fmt::Debug for WriteIntentBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WriteIntentBitmap({}, {} chunks of {} bytes)",
            self.inner.name,
            self.inner.chunks(),
            self.inner.geo.chunk_bytes
        )
    }
}

impl WriteIntentBitmap {
    /// Reads and validates the bitmap from the members (md_bitmap_load): the union of every
    /// readable member's bits, uuid checked, a stale bitmap (events behind the array's, or
    /// flagged STALE) makes every chunk needed; members whose copy differs are rewritten and the
    /// bitmap superblock is updated (events, sync_size) on every member before this returns.
    /// Must be called on a tokio runtime (the clear daemon runs there).
    pub async fn load(
        members: Vec<BitmapMember>,
        array: BitmapArrayInfo,
        on_member_error: FailFn,
    ) -> io::Result<WriteIntentBitmap> {
        load::load(members, array, on_member_error).await
    }

    /// Writes a new bitmap to every member (superblock + bits: all dirty, or all clean for an
    /// array created in sync) and starts it, as `mdadm --create --bitmap=internal` and the first
    /// kernel load would.
    pub async fn create(
        members: Vec<BitmapMember>,
        array: BitmapArrayInfo,
        params: BitmapCreate,
        on_member_error: FailFn,
    ) -> io::Result<WriteIntentBitmap> {
        load::create(members, array, params, on_member_error).await
    }

    fn start(inner: Arc<Inner>) -> WriteIntentBitmap {
        let daemon = inner.runtime.spawn(sweep::daemon(inner.clone()));
        WriteIntentBitmap { inner, daemon: Mutex::new(Some(daemon)), shut_down: AtomicBool::new(false) }
    }

    /// Returns once the bits of every chunk in the sync-domain sector `range` are durable on
    /// every working member; the caller may then issue the data writes and must call
    /// [`end_write`](Self::end_write) with the same range when they are done. Concurrent calls
    /// that need bits in one page share one page write per member (group commit). On `Err`
    /// nothing is held (no `end_write`).
    pub async fn start_write(&self, range: Range<u64>) -> io::Result<()> {
        let inner = &*self.inner;
        if self.shut_down.load(Ordering::Acquire) {
            return Err(inner.io_error(io::ErrorKind::BrokenPipe, "start_write after shutdown"));
        }
        let chunks = inner.chunk_range(&range)?;
        if chunks.is_empty() {
            return Ok(());
        }
        inner.stats.data_writes.add(chunks.start, 1);
        let mut guard = PendingGuard { inner, start: chunks.start, taken: chunks.start };
        let mut slow: Vec<u64> = Vec::new();
        for c in chunks.clone() {
            let durable = inner.begin_chunk(c).await;
            guard.taken = c + 1;
            if !durable {
                slow.push(c);
            }
        }
        if slow.is_empty() {
            inner.stats.fast_path_writes.add(chunks.start, 1);
        } else {
            self.inner.make_durable(&slow).await?;
        }
        guard.taken = guard.start; // handed over to end_write
        Ok(())
    }

    /// The data writes of an earlier successful `start_write(range)` are done. `succeeded`:
    /// the write reached every slot of the array — false when it was written degraded or a
    /// member failed it, which marks the chunks as needing resync/recovery.
    pub fn end_write(&self, range: Range<u64>, succeeded: bool) {
        let Ok(chunks) = self.inner.chunk_range(&range) else {
            debug_assert!(false, "end_write on a range start_write refused: {range:?}");
            return;
        };
        self.inner.end_chunks(chunks, succeeded);
    }

    /// Whether the chunk holding sync-domain sector `domain_sector` needs resync or recovery
    /// (md_bitmap_start_sync): its bit was dirty at an unclean load, it was written while
    /// degraded, or the bitmap was stale. Sectors beyond the bitmap: false.
    pub fn chunk_needs_sync(&self, domain_sector: u64) -> bool {
        let c = self.inner.geo.chunk_of_sector(domain_sector);
        if c >= self.inner.chunks() {
            return false;
        }
        self.inner.chunk_state(c).is_some_and(|s| s.load(Ordering::Acquire) & ChunkState::NEEDED != 0)
    }

    /// Resync/recovery made `range` (sync-domain sectors) consistent on every slot: the chunks
    /// it covers entirely stop being needed (their bits then clear lazily like any other). Call
    /// only when the array is not still degraded after the sync (md's `still_degraded`):
    /// otherwise the bits must stay needed for the member that is still missing.
    pub fn end_sync(&self, range: Range<u64>) {
        let inner = &*self.inner;
        let Ok(chunks) = inner.chunk_range(&range) else { return };
        for c in chunks {
            let (start, len) = inner.geo.chunk_range(c);
            if start < range.start || start + len > range.end {
                continue; // partly covered: still needed
            }
            let Some(state) = inner.chunk_state(c) else { continue };
            let old = state.fetch_and(!ChunkState::NEEDED, Ordering::AcqRel);
            inner.account(c, old, old & !ChunkState::NEEDED);
        }
    }

    /// Writes the bitmap superblock with the new md event count, durably, on every working
    /// member. The superblock writer calls it before every md superblock write (md_update_sb
    /// order), so the bitmap is never older than the superblocks.
    pub async fn update_superblock(&self, events: u64) -> io::Result<()> {
        {
            let mut h = self.inner.header.lock();
            h.events = events;
            if events < h.events_cleared {
                // Rolling back (kernel: "rocking back to read-only").
                h.events_cleared = events;
            }
        }
        self.inner.write_header().await
    }

    /// The md superblocks with `events` are durable on every working member (the array's
    /// superblock round completed without a failure): clear sweeps may advance
    /// `events_cleared` up to `events` from now on.
    pub fn superblocks_recorded(&self, events: u64) {
        self.inner.events_recorded.store(events, Ordering::Release);
    }

    /// The members that get the bitmap from now on. A member not in the previous set (a spare
    /// joining, a re-added member) gets every page written in the background; await
    /// [`sync_all_pages`](Self::sync_all_pages) before relying on its copy (e.g. before marking
    /// it in sync). Members left out get no more bitmap I/O.
    #[cfg(test)]
    pub(crate) fn members_len(&self) -> usize {
        self.inner.members_snapshot().len()
    }

    pub fn set_members(&self, members: Vec<BitmapMember>) {
        self.inner.set_members(members);
    }

    /// Whether the array is degraded: no bits are cleared (and `events_cleared` does not move)
    /// while it is, so a returning member can be recovered from the bits.
    pub fn set_degraded(&self, degraded: bool) {
        self.inner.degraded.store(degraded, Ordering::Release);
    }

    /// Writes every page to every working member (durably) and waits.
    pub async fn sync_all_pages(&self) -> io::Result<()> {
        self.inner.write_all_pages().await
    }

    /// Runs a clear sweep now: every idle dirty chunk is cleared (after the flush), as on a
    /// clean stop. Returns the number of bits cleared (0 while degraded or `can_clear` false).
    pub async fn sweep_now(&self) -> io::Result<u64> {
        sweep::sweep(&self.inner, 1).await
    }

    /// Stops the daemon, clears every idle bit (after a flush, unless degraded) and writes the
    /// bitmap superblock. Call after the last data write; later `start_write`s fail.
    pub async fn shutdown(&self) -> io::Result<()> {
        self.shut_down.store(true, Ordering::Release);
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.stop.notify_one();
        let daemon = self.daemon.lock().take();
        if let Some(d) = daemon {
            let _ = d.await;
        }
        let cleared = sweep::sweep(&self.inner, 1).await;
        let header = self.inner.write_header().await;
        cleared.and(header)
    }

    /// The bitmap's geometry (chunk size, sync size, pages).
    pub fn geometry(&self) -> BitmapGeometry {
        self.inner.geo
    }

    /// The bitmap superblock as it will be written next.
    /// md's `write_behind` (`bitmap/backlog`): 0, or the most writes that may be outstanding
    /// to write-mostly members.
    pub fn write_behind(&self) -> u32 {
        self.inner.header.lock().write_behind
    }

    pub fn header(&self) -> BitmapSuper {
        self.inner.header.lock().clone()
    }

    /// md events when bits were last cleared.
    pub fn events_cleared(&self) -> u64 {
        self.inner.header.lock().events_cleared
    }

    /// Whether a member whose superblock has `member_events` can be re-added and recovered from
    /// the bitmap alone (md: `events >= events_cleared`); otherwise it needs a full recovery.
    pub fn can_readd(&self, member_events: u64) -> bool {
        member_events >= self.events_cleared()
    }

    /// Chunks whose bit is set in memory (what the next page writes say), ascending.
    pub fn dirty_chunks(&self) -> Vec<u64> {
        let mut v = Vec::new();
        self.inner.for_each_dirty(|c| v.push(c));
        v
    }

    /// Chunks that need resync/recovery, ascending.
    pub fn needed_chunks(&self) -> Vec<u64> {
        let mut v = Vec::new();
        self.inner.for_each_dirty(|c| {
            if self.inner.chunk_state(c).is_some_and(|s| s.load(Ordering::Acquire) & ChunkState::NEEDED != 0) {
                v.push(c);
            }
        });
        v
    }

    pub fn stats(&self) -> BitmapStats {
        let s = &self.inner.stats;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (mut dirty, mut needed) = (0, 0);
        self.inner.for_each_dirty(|c| {
            dirty += 1;
            if self.inner.chunk_state(c).is_some_and(|s| s.load(Ordering::Acquire) & ChunkState::NEEDED != 0) {
                needed += 1;
            }
        });
        BitmapStats {
            data_writes: s.data_writes.sum(),
            fast_path_writes: s.fast_path_writes.sum(),
            page_writes: r(&s.page_writes),
            rmw_page_writes: r(&s.rmw_page_writes),
            set_rounds: r(&s.set_rounds),
            clear_rounds: r(&s.clear_rounds),
            header_rounds: r(&s.header_rounds),
            sweeps: r(&s.sweeps),
            member_flushes: r(&s.member_flushes),
            bits_set: r(&s.bits_set),
            bits_cleared: r(&s.bits_cleared),
            dirty_chunks: dirty,
            idle_dirty_chunks: self.inner.idle_dirty.sum(),
            needed_chunks: needed,
        }
    }

    /// Whether some member's last page cannot be padded to 4 KiB inside its reserved space, so
    /// bitmap writes read-modify-write a 4 KiB block shared with the following structure.
    pub fn shares_tail_block(&self) -> bool {
        self.inner.members_snapshot().iter().any(|m| m.tail_shared(self.inner.geo.pages()))
    }

    /// Serialises a writer of the bytes that follow the bitmap in a shared 4 KiB block (see
    /// [`shares_tail_block`](Self::shares_tail_block)) with the bitmap's read-modify-write on
    /// member `slot`. `None` when the member shares no block (nothing to serialise).
    pub async fn tail_block_guard(&self, slot: u32) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let pages = self.inner.geo.pages();
        let m = self.inner.members_snapshot().iter().find(|m| m.slot == slot && m.tail_shared(pages)).cloned()?;
        Some(m.tail_lock.clone().lock_owned().await)
    }

    /// md sysfs-named attributes (`bitmap/...`) and mdkit's counters.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let inner = &*self.inner;
        let h = inner.header.lock().clone();
        let st = self.stats();
        let space = inner.members_snapshot().iter().map(|m| m.space_bytes).min().unwrap_or(0) / SECTOR_BYTES;
        vec![
            ("bitmap/location", "internal".to_string()),
            ("bitmap/metadata", "internal".to_string()),
            ("bitmap/chunksize", h.chunk_bytes.to_string()),
            ("bitmap/time_base", format_time_base(inner.settings.daemon_sleep_ms.load(Ordering::Relaxed))),
            ("bitmap/backlog", h.write_behind.to_string()),
            ("bitmap/max_backlog_used", "0".to_string()),
            ("bitmap/space", space.to_string()),
            ("bitmap/can_clear", (if inner.clearing_allowed() { "true" } else { "false" }).to_string()),
            ("bitmap/flush_chunks", inner.settings.flush_chunks.load(Ordering::Relaxed).to_string()),
            ("bitmap/idle_region_bytes", inner.settings.idle_region_bytes.load(Ordering::Relaxed).to_string()),
            ("bitmap/events", h.events.to_string()),
            ("bitmap/events_cleared", h.events_cleared.to_string()),
            ("bitmap/chunks", inner.chunks().to_string()),
            ("bitmap/dirty_chunks", st.dirty_chunks.to_string()),
            ("bitmap/idle_dirty_chunks", st.idle_dirty_chunks.to_string()),
            ("bitmap/needed_chunks", st.needed_chunks.to_string()),
            ("bitmap/data_writes", st.data_writes.to_string()),
            ("bitmap/fast_path_writes", st.fast_path_writes.to_string()),
            ("bitmap/page_writes", st.page_writes.to_string()),
            ("bitmap/rmw_page_writes", st.rmw_page_writes.to_string()),
            ("bitmap/set_rounds", st.set_rounds.to_string()),
            ("bitmap/clear_rounds", st.clear_rounds.to_string()),
            ("bitmap/header_rounds", st.header_rounds.to_string()),
            ("bitmap/sweeps", st.sweeps.to_string()),
            ("bitmap/member_flushes", st.member_flushes.to_string()),
            ("bitmap/bits_set", st.bits_set.to_string()),
            ("bitmap/bits_cleared", st.bits_cleared.to_string()),
        ]
    }

    /// Sets `bitmap/time_base` (seconds, up to 4 decimals, md's timeout_store), `bitmap/backlog`
    /// (0..=16383), `bitmap/can_clear` (true|false; true is refused while degraded),
    /// `bitmap/flush_chunks` (0 = no threshold) or `bitmap/idle_region_bytes` (0 = per chunk). The `bitmap/` prefix may be left out. `None`
    /// when `name` is not a bitmap attribute; read-only ones are `PermissionDenied`.
    pub fn set_attribute(&self, name: &str, value: &str) -> Option<io::Result<()>> {
        let inner = &*self.inner;
        let short = name.strip_prefix("bitmap/").unwrap_or(name);
        let value = value.trim();
        let invalid =
            |why: String| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: bitmap/{short}: {why}", inner.name));
        let r = match short {
            "time_base" => parse_time_base_ms(value).map_err(invalid).map(|ms| {
                inner.settings.daemon_sleep_ms.store(ms, Ordering::Relaxed);
                inner.header.lock().daemon_sleep_secs = daemon_sleep_secs_on_disk(ms);
                inner.retime.notify_one();
            }),
            "backlog" => match value.parse::<u32>() {
                Ok(v) if v <= COUNTER_MAX => {
                    inner.header.lock().write_behind = v;
                    Ok(())
                }
                _ => Err(invalid(format!("'{value}' is not a number in 0..={COUNTER_MAX}"))),
            },
            "can_clear" => match value {
                "false" => {
                    inner.settings.can_clear.store(false, Ordering::Release);
                    Ok(())
                }
                "true" if inner.degraded.load(Ordering::Acquire) => Err(io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!("{}: bitmap/can_clear: the array is degraded", inner.name),
                )),
                "true" => {
                    inner.settings.can_clear.store(true, Ordering::Release);
                    Ok(())
                }
                _ => Err(invalid(format!("'{value}' is neither true nor false"))),
            },
            "flush_chunks" => {
                value.parse::<u64>().map_err(|_| invalid(format!("'{value}' is not a number"))).map(|v| {
                    inner.settings.flush_chunks.store(v, Ordering::Relaxed);
                    inner.kick_if_over_threshold();
                })
            }
            "idle_region_bytes" => value
                .parse::<u64>()
                .map_err(|_| invalid(format!("'{value}' is not a number of bytes")))
                .map(|v| inner.settings.idle_region_bytes.store(v, Ordering::Relaxed)),
            "location" | "metadata" | "chunksize" | "space" | "max_backlog_used" | "events" | "events_cleared"
            | "chunks" | "dirty_chunks" | "idle_dirty_chunks" | "needed_chunks" | "data_writes"
            | "fast_path_writes" | "page_writes" | "rmw_page_writes" | "set_rounds" | "clear_rounds"
            | "header_rounds" | "sweeps" | "member_flushes" | "bits_set" | "bits_cleared" => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{}: bitmap/{short} is read-only", inner.name),
            )),
            _ => return None,
        };
        Some(r)
    }
}

impl Drop for WriteIntentBitmap {
    fn drop(&mut self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.stop.notify_one();
    }
}

/// md's time_base text: whole seconds, or seconds with a fraction.
fn format_time_base(ms: u64) -> String {
    if ms.is_multiple_of(1000) { (ms / 1000).to_string() } else { format!("{}.{:03}", ms / 1000, ms % 1000) }
}

/// Parses seconds with up to 4 decimals (md timeout_store) into milliseconds, rounded up;
/// 0 and values above one day are refused.
fn parse_time_base_ms(text: &str) -> Result<u64, String> {
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || (!frac.is_empty() && !digits(frac)) || frac.len() > 4 {
        return Err(format!("'{text}' is not a number of seconds (up to 4 decimals)"));
    }
    let secs: u64 = whole.parse().map_err(|_| format!("'{text}' is too large"))?;
    let frac_1e4: u64 = format!("{frac:0<4}").parse().unwrap_or(0);
    let ms = secs.saturating_mul(1000).saturating_add(frac_1e4.div_ceil(10));
    if ms == 0 {
        return Err("time_base must be positive".into());
    }
    if ms > 86_400_000 {
        return Err(format!("'{text}' seconds is more than a day"));
    }
    Ok(ms)
}

/// What the bitmap superblock records for a daemon period: whole seconds, at least 1 (the
/// kernel refuses 0).
fn daemon_sleep_secs_on_disk(ms: u64) -> u32 {
    u32::try_from(ms.div_ceil(1000)).unwrap_or(u32::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_base_text() {
        assert_eq!(parse_time_base_ms("5"), Ok(5000));
        assert_eq!(parse_time_base_ms("0.25"), Ok(250));
        assert_eq!(parse_time_base_ms("0.0001"), Ok(1));
        assert!(parse_time_base_ms("0").is_err());
        assert!(parse_time_base_ms("-1").is_err());
        assert!(parse_time_base_ms("1.23456").is_err());
        assert!(parse_time_base_ms("x").is_err());
        assert!(parse_time_base_ms("100000").is_err());
        assert_eq!(format_time_base(5000), "5");
        assert_eq!(format_time_base(250), "0.250");
        assert_eq!(daemon_sleep_secs_on_disk(250), 1);
        assert_eq!(daemon_sleep_secs_on_disk(5000), 5);
        assert_eq!(daemon_sleep_secs_on_disk(5001), 6);
    }

    #[test]
    fn space_from_superblock_layouts() {
        // 1.2: sb at 8, bitmap at +8 (sector 16), bad-block log at +16 (sector 24), data at 2048.
        let mut sb = Superblock::empty();
        sb.feature_map = crate::format::superblock::feature::BITMAP_OFFSET;
        sb.super_offset_sectors = 8;
        sb.bitmap_offset_raw = 8;
        sb.data_offset_sectors = 2048;
        sb.bblog_offset_sectors = 16;
        sb.bblog_size_sectors = 8;
        assert_eq!(bitmap_space_bytes(&sb, 1 << 20), Some(8 * 512));
        // No bad-block log: up to the data.
        sb.bblog_size_sectors = 0;
        assert_eq!(bitmap_space_bytes(&sb, 1 << 20), Some((2048 - 16) * 512));
        // 1.0: sb at the end, bitmap 16 sectors before it, bblog 8 before it.
        let mut sb = Superblock::empty();
        sb.feature_map = crate::format::superblock::feature::BITMAP_OFFSET;
        sb.super_offset_sectors = 100_000;
        sb.bitmap_offset_raw = (-16i32) as u32;
        sb.data_offset_sectors = 0;
        sb.bblog_offset_sectors = -8;
        sb.bblog_size_sectors = 8;
        assert_eq!(bitmap_space_bytes(&sb, 100_016), Some(8 * 512));
        sb.bblog_size_sectors = 0;
        assert_eq!(bitmap_space_bytes(&sb, 100_016), Some(16 * 512));
        // Outside the device.
        assert_eq!(bitmap_space_bytes(&sb, 1000), None);
    }
}
