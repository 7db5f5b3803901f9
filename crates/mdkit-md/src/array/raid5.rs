//! raid4/5/6: the parity personality (kernel layouts from [`ParityGeometry`], P/Q from
//! `mdkit-parity`), with a stripe cache and a run-time `stripe_size`.
//!
//! ```text
//!  read ─ split at chunks ─┬─ data member readable ─► one member read per chunk piece
//!                          └─ missing / read error ─► stripe exclusive ─► read the others ─► rebuild (+ rewrite a bad block)
//!  write ─ split by stripe ─► stripe cache (cache.rs) ─► batch per stripe ─► plan (plan.rs) ─► exec (exec.rs)
//!                                  pieces that arrive together share one batch;
//!                                  a sequential write ending mid-stripe is held ≤ 1 tick for its continuation
//!  sync_range ─ barrier ─► per stripe exclusive ─► resync / recover / check / repair (scrub.rs)
//! ```
//!
//! **Write path.** A write is cut into per-stripe pieces that go to the [stripe cache](cache):
//! one entry per busy stripe, sharded, bounded by `stripe_cache_size`. The task that finds the
//! stripe idle leads: it takes every pending piece of the stripe into one batch, plans it per
//! `stripe_size` unit (full rows read nothing; otherwise read-modify-write or reconstruct-write,
//! whichever needs fewer member reads, md's rule and `rmw_level`), merges consecutive units
//! planned alike into single member I/Os, and writes. Pieces arriving meanwhile wait and are
//! carried by the next batch, so conflicting updates of a stripe serialise and independent
//! stripes run in parallel.
//!
//! **Gathering.** A write that continues a recent one (a sequential stream) and ends inside a
//! stripe is held before its batch runs, so the stream's next write can complete the stripe and
//! the batch reads nothing. The hold ends as soon as the batch covers whole rows, when an
//! exclusive user waits, when every write in flight is itself held (nothing else is coming:
//! queue drained, e.g. QD1), or after a time limit: `preread_bypass_threshold` × the larger of
//! `stripe_gather_hold_us` (default 1 ms) and twice the recent write-batch latency (capped at
//! 50 ms). A stream at queue depth k issues its next write when its oldest completes, so the
//! continuation of the newest write arrives about one write latency later — under a deep
//! queue on a busy disk that is many milliseconds, and a fixed 1 ms hold gave up on most
//! stream frontiers (each give-up costs two partial batches with reads). Threshold 0 disables
//! holding, as md's bypass threshold decides how long pre-reading stripes are held back.
//! Random writes are never held.
//!
//! **`stripe_size`** (4–64 KiB in 4 KiB steps, default 4 KiB as md) is the unit of parity work
//! and member I/O for partial-stripe writes: a partial write is widened to whole units (md's
//! stripe-head pages). Beyond md, full rows are not cut into units: a full-stripe portion goes
//! out as one member write per member per stripe, so large writes do not depend on it and small
//! random writes keep the smallest unit — `stripe_size` only bounds the small-write unit.
//! Changing it takes effect for batches that start afterwards; a batch in flight finishes with
//! the value it started with. The write-intent bitmap and the barrier always cover the widest
//! unit (64 KiB), so any setting is covered.
//!
//! **Degraded.** Data for a missing member is folded into parity (reconstruct-write); parity for
//! a missing member is skipped; reads of a missing member are rebuilt under the stripe's
//! exclusive access. A member that fails mid-write is failed by the core's wrapper and the write
//! succeeds while the level's redundancy covers it. Recovering members and replacements get
//! every write; they are read only below their recovery offset.
//!
//! Attributes (md names): `stripe_size`, `stripe_cache_size` (17..32768, default 256; stripes
//! with work in flight — each holds at most a chunk per member while it works, and a batch's
//! buffers are the size of its writes), `stripe_cache_active`, `preread_bypass_threshold`,
//! `rmw_level` (0 never read-modify-write, 1 choose by reads (default), 2 prefer it on ties);
//! beyond md `stripe_gather_hold_us`, `stripe_gather_hold_limit_us` (read-only: the hold limit
//! now, per threshold step) and counters: `stripe_batches`, `stripe_batched_writes`,
//! `full_stripe_writes`, `rmw_writes`, `rcw_writes`, `reconstruct_writes` (runs of each kind),
//! `member_reads_during_writes`, `member_writes`, `held_batches`, `hold_timeouts`,
//! `degraded_reads`, `sync_reads`, `sync_writes`, and `mismatch_members` (check/repair: which
//! member each mismatched unit blames).

mod cache;
mod exec;
mod plan;
mod scrub;
mod stripe;

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags, join_read_parts};
use parking_lot::Mutex;
use tokio::time::Instant;

use self::cache::{BatchError, BatchResult, Leadership, StripeCache, StripeEntry, Turn, WriteTicket, to_io};
use self::exec::Target;
use self::plan::{Members, Mode, RoleSet, Seg, bit, has};
use self::stripe::StripeShape;
use super::core::ArrayCore;
use super::errors::{MdError, MdErrorKind};
use super::io::join_all;
use super::member::{Base, Member};
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::raid0::chunk_pieces;
use super::slots::SlotTable;
use crate::format::superblock::Superblock;
use crate::layout::{Level, ParityGeometry};

const SECTOR: u64 = 512;

/// md's `stripe_cache_size` default and range.
pub const STRIPE_CACHE_DEFAULT: usize = 256;
pub const STRIPE_CACHE_MIN: usize = 17;
pub const STRIPE_CACHE_MAX: usize = 32768;
/// `stripe_size` default (md: PAGE_SIZE) and range (4 KiB steps).
pub const STRIPE_SIZE_DEFAULT_BYTES: u32 = 4096;
pub const STRIPE_SIZE_MIN_BYTES: u32 = 4096;
pub const STRIPE_SIZE_MAX_BYTES: u32 = 65536;
/// How long a sequential write ending inside a stripe waits for its continuation, per
/// `preread_bypass_threshold` step (one scheduler tick).
pub const GATHER_HOLD_DEFAULT_US: u64 = 1000;
/// Upper bound of the latency-derived part of a gathering hold.
const GATHER_HOLD_CAP_US: u64 = 50_000;
/// Stripes worked on at once by one sync step.
const SYNC_STRIPES_AT_ONCE: usize = 16;
/// Mismatch details kept for `mismatch_members`.
const MISMATCH_LOG_MAX: usize = 1024;

/// What re-reading failed members once more gave.
enum Retry {
    /// The block asked for read back.
    Target(IoBuf),
    /// These roles read back (bit set).
    Recovered(RoleSet),
    Failed,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Builds the raid4/5/6 personality for an array described by its (freshest) superblock.
pub fn build(name: &str, sb: &Superblock, geo: ParityGeometry) -> io::Result<Arc<dyn Personality>> {
    Ok(Arc::new(Raid5::new(name, geo, sb.size_sectors)?))
}

//------------------------------------------------------------------------------------------------
// Tunables and counters

/// Run-time settings (md sysfs names where md has them).
pub(crate) struct Tunables {
    stripe_size_bytes: AtomicU32,
    rmw_level: AtomicU8,
    preread_bypass_threshold: AtomicU32,
    gather_hold_us: AtomicU64,
}

impl Tunables {
    fn new() -> Tunables {
        Tunables {
            stripe_size_bytes: AtomicU32::new(STRIPE_SIZE_DEFAULT_BYTES),
            rmw_level: AtomicU8::new(1),
            preread_bypass_threshold: AtomicU32::new(1),
            gather_hold_us: AtomicU64::new(GATHER_HOLD_DEFAULT_US),
        }
    }

    pub fn stripe_size_bytes(&self) -> u32 {
        self.stripe_size_bytes.load(Ordering::Relaxed)
    }

    /// The unit of partial-stripe work in sectors (never more than a chunk).
    pub fn unit_sectors(&self, chunk_sectors: u64) -> u64 {
        (u64::from(self.stripe_size_bytes()) / SECTOR).min(chunk_sectors)
    }

    pub fn rmw_level(&self) -> u8 {
        self.rmw_level.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Counters exposed as attributes.
#[derive(Default)]
pub(crate) struct Stats {
    pub batches: Counter,
    pub batched_writes: Counter,
    pub full_runs: Counter,
    pub rmw_runs: Counter,
    pub rcw_runs: Counter,
    pub reconstruct_runs: Counter,
    pub member_reads_during_writes: Counter,
    pub member_writes: Counter,
    pub held_batches: Counter,
    pub hold_timeouts: Counter,
    pub degraded_reads: Counter,
    pub sync_reads: Counter,
    pub sync_writes: Counter,
}

impl Stats {
    pub fn count_run(&self, run: &plan::Run) {
        match run.mode {
            Mode::Full => self.full_runs.add(1),
            Mode::Rmw => self.rmw_runs.add(1),
            Mode::Rcw => self.rcw_runs.add(1),
            Mode::Reconstruct => self.reconstruct_runs.add(1),
        }
    }
}

/// Recent write ends (array sectors): a write starting at one continues a stream.
struct Streams {
    ends: [AtomicU64; 8],
    next: AtomicUsize,
}

impl Streams {
    fn new() -> Streams {
        Streams { ends: std::array::from_fn(|_| AtomicU64::new(u64::MAX)), next: AtomicUsize::new(0) }
    }

    /// Records `[offset, end)`; returns whether it continues a recent write.
    fn note(&self, offset: u64, end: u64) -> bool {
        let seq = self.ends.iter().any(|e| e.load(Ordering::Relaxed) == offset);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.ends.len();
        self.ends[i].store(end, Ordering::Relaxed);
        seq
    }
}

#[derive(Default)]
struct MismatchLog {
    /// The sync engine's run count when the log was started (a new check/repair clears it).
    run_marker: Option<u64>,
    entries: Vec<String>,
    truncated: bool,
}

//------------------------------------------------------------------------------------------------

/// See the module documentation.
pub struct Raid5 {
    name: String,
    pub(crate) geo: ParityGeometry,
    level: Level,
    pub(crate) n: usize,
    data_disks: u64,
    pub(crate) chunk_sectors: u64,
    /// Per-member sectors used (the superblock's size rounded down to a chunk): the sync domain.
    member_size_sectors: u64,
    array_sectors: u64,
    pub(crate) cache: StripeCache,
    pub(crate) tunables: Tunables,
    pub(crate) stats: Stats,
    streams: Streams,
    /// Recent write-batch latency in µs (moving average, 1/8 weight per sample).
    batch_latency_us: AtomicU64,
    mismatches: Mutex<MismatchLog>,
    /// Which geometry's start member sectors count from (a reshape runs two of them).
    pub(crate) base: Base,
}

impl Raid5 {
    pub fn new(name: &str, geo: ParityGeometry, size_sectors: u64) -> io::Result<Raid5> {
        let n = geo.raid_disks();
        if n > plan::MAX_ROLES {
            return Err(invalid(format!(
                "{name}: {} with {n} members: mdkit runs parity arrays of at most {} members",
                geo.level().name(),
                plan::MAX_ROLES
            )));
        }
        let c = geo.chunk_sectors();
        let member_size_sectors = size_sectors - size_sectors % c;
        let array_sectors = geo.array_sectors(size_sectors).ok_or_else(|| {
            invalid(format!("{name}: array of {size_sectors} sectors per member does not fit 64 bits"))
        })?;
        Ok(Raid5 {
            name: name.to_string(),
            level: geo.level(),
            n,
            data_disks: geo.data_disks() as u64,
            chunk_sectors: c,
            member_size_sectors,
            array_sectors,
            geo,
            cache: StripeCache::new(STRIPE_CACHE_DEFAULT),
            tunables: Tunables::new(),
            stats: Stats::default(),
            streams: Streams::new(),
            batch_latency_us: AtomicU64::new(0),
            mismatches: Mutex::new(MismatchLog::default()),
            base: Base::DataOffset,
        })
    }

    /// Member sector `sector` of this geometry as a sector of `m`'s data area.
    pub(crate) fn at(&self, m: &Member, sector: u64) -> u64 {
        sector + self.base.of(m)
    }

    fn max_degraded(&self) -> usize {
        self.level.max_degraded() as usize
    }

    fn shape(&self, stripe: u64) -> StripeShape {
        StripeShape::new(self.geo.stripe_map(stripe), self.n)
    }

    pub(crate) fn note_mismatch(&self, mode: SyncMode, lo: u64, hi: u64, stripe: u64, who: &str) {
        tracing::warn!(array = %self.name, stripe, sectors = ?(lo..hi), "{}: parity mismatch, blames {who}", mode.as_str());
        let mut g = self.mismatches.lock();
        if g.entries.len() >= MISMATCH_LOG_MAX {
            g.truncated = true;
            return;
        }
        g.entries.push(format!("{lo}-{hi}:stripe {stripe}:{who}"));
    }

    /// A check or repair that starts clears the mismatch details of the previous one.
    fn start_scrub_log(&self, a: &ArrayCore) {
        let runs = a.sync.status().runs;
        let mut g = self.mismatches.lock();
        if g.run_marker != Some(runs) {
            *g = MismatchLog { run_marker: Some(runs), ..MismatchLog::default() };
        }
    }

    //--------------------------------------------------------------------------------------------
    // Reads

    async fn read_impl(&self, a: &ArrayCore, offset: u64, mut buf: IoBuf) -> ReadResult {
        let len = buf.len() as u64 / SECTOR;
        let pieces = chunk_pieces(offset, len, self.chunk_sectors);
        let mut parts = Vec::with_capacity(pieces.len());
        for (pos, n) in pieces {
            parts.push((pos, n, buf.split_to((n * SECTOR) as usize)));
        }
        let results = join_all(parts.into_iter().map(|(pos, n, part)| self.read_piece(a, pos, n, part))).await;
        join_read_parts(buf, results)
    }

    /// One piece inside one chunk: straight from its data member, or rebuilt.
    async fn read_piece(&self, a: &ArrayCore, pos: u64, n: u64, part: IoBuf) -> ReadResult {
        let mp = self.geo.map(pos);
        let role = mp.data.member;
        let ms = mp.data.sector;
        let lo = ms % self.chunk_sectors;
        let m = a.slots().readable(role, ms + n).cloned();
        let mut failed = None;
        let part = match m {
            Some(m) => {
                let (part, r) = a.member_read(&m, self.at(&m, ms), part).await;
                match r {
                    Ok(()) => return (part, Ok(())),
                    Err(e) => {
                        tracing::warn!(array = a.name(), member = m.name(), "read error, rebuilding from parity: {e}");
                        failed = Some(m);
                        part
                    }
                }
            }
            None => part,
        };
        self.read_degraded(a, mp.stripe, mp.data_index, lo, lo + n, part, failed).await
    }

    /// Rebuilds data `dd` over chunk sectors `[lo, hi)` from the other members, under the
    /// stripe's exclusive access; a member whose read failed gets the block rewritten.
    #[allow(clippy::too_many_arguments)]
    async fn read_degraded(
        &self,
        a: &ArrayCore,
        stripe: u64,
        dd: usize,
        lo: u64,
        hi: u64,
        mut part: IoBuf,
        failed: Option<Arc<Member>>,
    ) -> ReadResult {
        self.stats.degraded_reads.add(1);
        let _x = self.cache.exclusive(stripe).await;
        let shape = self.shape(stripe);
        let base = stripe * self.chunk_sectors;
        let sector = base + lo;
        let len = ((hi - lo) * SECTOR) as usize;
        let target = shape.data_role(dd);
        let slots = a.slots();
        let mut excluded = bit(target);
        let mut fixes: Vec<(usize, Arc<Member>)> = failed.into_iter().map(|m| (target, m)).collect();
        let mut retried = false;
        let mut blocks: Vec<Option<IoBuf>> = loop {
            let sources: Vec<(usize, Arc<Member>)> = (0..self.n)
                .filter(|r| !has(excluded, *r))
                .filter_map(|r| slots.readable(r, base + hi).map(|m| (r, m.clone())))
                .collect();
            let missing = self.n - sources.len();
            if missing > self.max_degraded() {
                if !retried && !fixes.is_empty() {
                    // md retries a failed read once more, alone (R5_ReadNoMerge), before it
                    // gives up on the block.
                    retried = true;
                    match self.retry_failed_reads(a, &mut fixes, target, sector, len).await {
                        Retry::Target(b) => {
                            part.as_mut_slice().copy_from_slice(b.as_slice());
                            return (part, Ok(()));
                        }
                        Retry::Recovered(roles) => {
                            excluded &= !roles;
                            continue;
                        }
                        Retry::Failed => {}
                    }
                }
                let e = self.uncorrectable(a, stripe, sector..base + hi, missing, &fixes).await;
                return (part, Err(e));
            }
            let results = join_all(
                sources.iter().map(|(_, m)| a.member_read(m, self.at(m, sector), IoBuf::uninit_contents(len))),
            )
            .await;
            let mut blocks: Vec<Option<IoBuf>> = (0..self.n).map(|_| None).collect();
            let mut again = false;
            for ((r, m), (b, res)) in sources.into_iter().zip(results) {
                match res {
                    Ok(()) => blocks[r] = Some(b),
                    Err(e) => {
                        tracing::warn!(array = a.name(), member = m.name(), "read error while rebuilding: {e}");
                        excluded |= bit(r);
                        fixes.push((r, m));
                        again = true;
                    }
                }
            }
            if !again {
                break blocks;
            }
        };
        let rebuilt = {
            let refs: Vec<Option<&[u8]>> = blocks.iter().map(|b| b.as_ref().map(IoBuf::as_slice)).collect();
            shape.reconstruct(&refs, len)
        };
        match rebuilt {
            Ok(v) => {
                for (r, b) in v {
                    blocks[r] = Some(b);
                }
            }
            Err(e) => return (part, Err(io::Error::other(format!("{}: stripe {stripe}: {e}", a.name())))),
        }
        part.as_mut_slice().copy_from_slice(blocks[target].as_ref().expect("rebuilt").as_slice());
        let writes: Vec<Target> = fixes
            .into_iter()
            .filter(|(_, m)| !m.is_faulty())
            .map(|(r, m)| Target {
                role: r,
                member: m,
                sector,
                data: SharedBuf::from_slice(blocks[r].as_ref().expect("rebuilt").as_slice()),
                fixes_read: true,
            })
            .collect();
        if !writes.is_empty() {
            // The data is already rebuilt for the caller; a failing rewrite fails the member.
            let _ = exec::write_targets(a, self, writes, WriteFlags::NONE).await;
        }
        (part, Ok(()))
    }

    /// Reads every member in `fixes` (not failed meanwhile) once more. The target's block read
    /// back is the answer; other members read back rejoin the rebuild and leave `fixes`.
    async fn retry_failed_reads(
        &self,
        a: &ArrayCore,
        fixes: &mut Vec<(usize, Arc<Member>)>,
        target: usize,
        sector: u64,
        len: usize,
    ) -> Retry {
        let mut recovered = 0;
        let mut still = Vec::with_capacity(fixes.len());
        for (r, m) in fixes.drain(..) {
            if m.is_faulty() {
                still.push((r, m));
                continue;
            }
            match a.member_read(&m, self.at(&m, sector), IoBuf::uninit_contents(len)).await {
                (b, Ok(())) if r == target => return Retry::Target(b),
                (_, Ok(())) => recovered |= bit(r),
                (_, Err(e)) => {
                    tracing::warn!(array = a.name(), member = m.name(), sector, "read error again on retry: {e}");
                    still.push((r, m));
                }
            }
        }
        *fixes = still;
        if recovered != 0 { Retry::Recovered(recovered) } else { Retry::Failed }
    }

    /// A block that can neither be read nor rebuilt: the request fails (never with data a member
    /// failed to read). As md's handle_failed_stripe, each member whose read failed gets the
    /// range recorded in its bad-block log: the stripe's block is lost, the member and the
    /// array stay, later reads of it fail at once and a write there clears the entry. Where
    /// no entry can be recorded (no log, log full) and the array was already degraded to its
    /// limit, md fails the member instead (raid5_error, which has no last-member exception)
    /// and the array is broken; on an array that was not degraded that far the members are
    /// kept (only the request fails), as md's retry path does.
    async fn uncorrectable(
        &self,
        a: &ArrayCore,
        stripe: u64,
        sectors: Range<u64>,
        missing: usize,
        fixes: &[(usize, Arc<Member>)],
    ) -> io::Error {
        a.note_unrecoverable_read();
        let sector = sectors.start;
        let degraded = a.degraded() as usize;
        let slots = a.slots();
        let unavailable: Vec<String> = (0..self.n)
            .filter_map(|r| {
                if let Some((_, m)) = fixes.iter().find(|(fr, _)| *fr == r) {
                    return Some(format!("{} (read error)", m.name()));
                }
                if slots.readable(r, sectors.end).is_some() {
                    return None;
                }
                Some(match slots.slot(r).and_then(|s| s.member.as_ref()) {
                    Some(m) if m.is_faulty() => format!("{} (faulty)", m.name()),
                    Some(m) => format!("{} (not rebuilt this far)", m.name()),
                    None => format!("role {r} (empty)"),
                })
            })
            .collect();
        let detail = format!(
            "stripe {stripe}: cannot rebuild data at member sector {sector}: {missing} of {} members unavailable \
             ({}; array degraded {degraded})",
            self.n,
            unavailable.join(", ")
        );
        tracing::error!(array = a.name(), sector, "read error not correctable: {detail}");
        let len_sectors = sectors.end - sectors.start;
        for (_, m) in fixes {
            // Recorded where the read went: during a reshape this geometry's sectors sit at
            // an offset in the member's data area (`at`), as for every member I/O.
            if a.record_unreadable(m, self.at(m, sector), len_sectors).await {
                continue;
            }
            if degraded >= self.max_degraded() {
                a.fail_member_beyond_redundancy(
                    m,
                    &format!(
                        "read error not correctable at member sector {sector} (array degraded {degraded}) \
                         and no room in its bad-block log"
                    ),
                );
            }
        }
        MdError::new(MdErrorKind::Unrecoverable, a.name(), "read", sector, detail).into()
    }

    //--------------------------------------------------------------------------------------------
    // Writes

    async fn write_impl(&self, a: &ArrayCore, offset: u64, buf: SharedBuf, flags: WriteFlags) -> io::Result<()> {
        let len = buf.len() as u64 / SECTOR;
        let sequential = self.streams.note(offset, offset + len);
        let c = self.chunk_sectors;
        let mut stripes: Vec<(u64, Vec<Seg>)> = Vec::new();
        let mut at = 0usize;
        for (pos, n) in chunk_pieces(offset, len, c) {
            let chunk = pos / c;
            let (stripe, dd) = (chunk / self.data_disks, (chunk % self.data_disks) as usize);
            let lo = pos % c;
            let bytes = (n * SECTOR) as usize;
            let seg = Seg { dd, lo, hi: lo + n, data: buf.slice(at..at + bytes) };
            at += bytes;
            match stripes.last_mut() {
                Some((s, v)) if *s == stripe => v.push(seg),
                _ => stripes.push((stripe, vec![seg])),
            }
        }
        let last = stripes.len().saturating_sub(1);
        let ends_inside = !(offset + len).is_multiple_of(c * self.data_disks);
        let wave = (self.cache.limit() / 8).max(1);
        let mut first_err = None;
        let mut it = stripes.into_iter().enumerate().peekable();
        while it.peek().is_some() {
            let group: Vec<(usize, (u64, Vec<Seg>))> = it.by_ref().take(wave).collect();
            let mut res = self.cache.reserve(group.len()).await;
            let tickets: Vec<WriteTicket<'_>> = group
                .into_iter()
                .map(|(i, (s, segs))| {
                    let hold = sequential && i == last && ends_inside;
                    self.cache.enqueue_write(s, segs, flags.fua, hold, &mut res)
                })
                .collect();
            drop(res);
            for r in join_all(tickets.into_iter().map(|t| self.run_ticket(a, t))).await {
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits for a piece's batch, leading it when the stripe is handed to this task.
    async fn run_ticket(&self, a: &ArrayCore, mut t: WriteTicket<'_>) -> io::Result<()> {
        match t.wait().await {
            Turn::Done(r) => to_io(r),
            Turn::Lead => {
                let lead = Leadership { cache: &self.cache, entry: t.entry.clone() };
                self.gather(&lead.entry).await;
                let batch = self.cache.take_batch(&lead.entry);
                self.stats.batched_writes.add(batch.len() as u64);
                let started = Instant::now();
                let r = self.execute(a, lead.entry.stripe, batch.segs(), batch.fua()).await;
                self.note_batch_latency(started.elapsed());
                batch.complete_all(r);
                drop(lead);
                to_io(t.own_result().await)
            }
        }
    }

    async fn execute(&self, a: &ArrayCore, stripe: u64, segs: Vec<Seg>, fua: bool) -> BatchResult {
        self.stats.batches.add(1);
        let shape = self.shape(stripe);
        let unit = self.tunables.unit_sectors(self.chunk_sectors);
        exec::write_batch(a, self, &shape, &segs, unit, fua).await.map_err(BatchError::from)
    }

    /// Whether the segs cover every unit they touch in full (the batch would read nothing).
    fn read_free(&self, stripe: u64, segs: &[Seg]) -> bool {
        let shape = self.shape(stripe);
        let unit = self.tunables.unit_sectors(self.chunk_sectors);
        let m = Members { readable: &|_, _| true, has_targets: &|_| true };
        plan::plan(&shape, self.chunk_sectors, unit, segs, &m, 1)
            .is_ok_and(|runs| runs.iter().all(|r| r.mode == Mode::Full))
    }

    /// Folds one batch's latency into the moving average (racing updates may lose a sample).
    fn note_batch_latency(&self, took: Duration) {
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).min(GATHER_HOLD_CAP_US);
        let old = self.batch_latency_us.load(Ordering::Relaxed);
        let new = if old == 0 { sample } else { old - old / 8 + sample / 8 };
        self.batch_latency_us.store(new, Ordering::Relaxed);
    }

    /// How long a gathering hold may last per `preread_bypass_threshold` step.
    fn hold_limit_us(&self) -> u64 {
        let hold_us = self.tunables.gather_hold_us.load(Ordering::Relaxed);
        let latency = self.batch_latency_us.load(Ordering::Relaxed).saturating_mul(2).min(GATHER_HOLD_CAP_US);
        hold_us.max(latency)
    }

    /// Holds a batch that a sequential write leaves partial (see the module documentation).
    async fn gather(&self, entry: &StripeEntry) {
        let steps = u64::from(self.tunables.preread_bypass_threshold.load(Ordering::Relaxed));
        let hold_us = self.tunables.gather_hold_us.load(Ordering::Relaxed);
        if steps == 0 || hold_us == 0 {
            return;
        }
        let deadline = Instant::now() + Duration::from_micros(self.hold_limit_us().saturating_mul(steps));
        let mut holding = false;
        loop {
            let changed = entry.changed.notified();
            let drain = self.cache.drain.notified();
            tokio::pin!(changed, drain);
            changed.as_mut().enable();
            drain.as_mut().enable();
            let (segs, worthy, exclusive_waits) = self.cache.peek(entry);
            if !worthy || exclusive_waits || self.read_free(entry.stripe, &segs) {
                break;
            }
            if !holding {
                self.cache.start_hold(entry);
                self.stats.held_batches.add(1);
                holding = true;
            }
            if self.cache.drained() {
                break;
            }
            if Instant::now() >= deadline {
                self.stats.hold_timeouts.add(1);
                break;
            }
            tokio::select! {
                _ = changed => {}
                _ = drain => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
        if holding {
            self.cache.end_hold(entry);
        }
    }

    //--------------------------------------------------------------------------------------------
    // Zeroes and discards

    /// Whether every member can write zeroes (whole stripes are then zeroed on the members).
    fn members_zero(&self, a: &ArrayCore) -> bool {
        a.slots().working_members().iter().all(|m| m.device().topology().supports_write_zeroes)
    }

    /// Zeroes whole stripes `[first, end)` on every member that takes writes (P and Q of zeroes
    /// are zeroes), each stripe under its exclusive access.
    async fn zero_stripes(&self, a: &ArrayCore, first: u64, end: u64, flags: ZeroFlags) -> io::Result<()> {
        let mut s = first;
        let mut first_err = None;
        while s < end {
            let to = (s + SYNC_STRIPES_AT_ONCE as u64).min(end);
            for r in join_all((s..to).map(|st| self.zero_stripe(a, st, flags))).await {
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            s = to;
        }
        first_err.map_or(Ok(()), Err)
    }

    async fn zero_stripe(&self, a: &ArrayCore, stripe: u64, flags: ZeroFlags) -> io::Result<()> {
        let _x = self.cache.exclusive(stripe).await;
        let c = self.chunk_sectors;
        let slots = a.slots();
        let targets: Vec<Arc<Member>> =
            (0..self.n).flat_map(|r| slots.write_targets(r).cloned().collect::<Vec<_>>()).collect();
        let results =
            join_all(targets.iter().map(|m| a.member_write_zeroes(m, self.at(m, stripe * c), c, flags))).await;
        let mut first_err = None;
        for (m, r) in targets.iter().zip(results) {
            if let Err(e) = r
                && !m.is_faulty()
            {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Writes zeroes through the normal write path, in pieces of at most one stripe.
    async fn write_zero_range(&self, a: &ArrayCore, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let step = self.chunk_sectors * self.data_disks;
        let mut pos = offset;
        while pos < offset + len {
            let n = (step - pos % step).min(offset + len - pos);
            let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
            self.write_impl(a, pos, SharedBuf::zeroed((n * SECTOR) as usize), flags).await?;
            pos += n;
        }
        Ok(())
    }

    async fn write_zeroes_impl(&self, a: &ArrayCore, offset: u64, len: u64, flags: ZeroFlags) -> io::Result<()> {
        let sd = self.chunk_sectors * self.data_disks;
        let end = offset + len;
        let (full_lo, full_hi) = (offset.div_ceil(sd) * sd, end / sd * sd);
        if full_lo >= full_hi || !self.members_zero(a) {
            return self.write_zero_range(a, offset, len, flags.fua).await;
        }
        self.write_zero_range(a, offset, full_lo - offset, flags.fua).await?;
        self.zero_stripes(a, full_lo / sd, full_hi / sd, flags).await?;
        self.write_zero_range(a, full_hi, end - full_hi, flags.fua).await
    }

    /// Discard: whole stripes are zeroed on the members (keeping parity consistent; members
    /// that punch holes reclaim the space); partial stripes are left alone (advisory).
    async fn discard_impl(&self, a: &ArrayCore, offset: u64, len: u64) -> io::Result<()> {
        let sd = self.chunk_sectors * self.data_disks;
        let (full_lo, full_hi) = (offset.div_ceil(sd) * sd, (offset + len) / sd * sd);
        if full_lo >= full_hi || !self.members_zero(a) {
            return Ok(());
        }
        self.zero_stripes(a, full_lo / sd, full_hi / sd, ZeroFlags::default()).await
    }

    //--------------------------------------------------------------------------------------------
    // Sync

    async fn sync_range_impl(&self, a: &ArrayCore, mode: SyncMode, start: u64, len: u64) -> io::Result<SyncOutcome> {
        let end = (start + len).min(self.member_size_sectors);
        if start >= end {
            return Ok(SyncOutcome::default());
        }
        if matches!(mode, SyncMode::Check | SyncMode::Repair) {
            self.start_scrub_log(a);
        }
        let _b = a.barrier.raise(start..end).await;
        let c = self.chunk_sectors;
        let parts: Vec<(u64, u64, u64)> =
            (start / c..end.div_ceil(c)).map(|s| (s, start.max(s * c) - s * c, end.min((s + 1) * c) - s * c)).collect();
        let mut out = SyncOutcome::default();
        for group in parts.chunks(SYNC_STRIPES_AT_ONCE) {
            let results = join_all(group.iter().map(|&(s, lo, hi)| scrub::sync_stripe(a, self, mode, s, lo, hi))).await;
            for r in results {
                out.merge(r?);
            }
        }
        Ok(out)
    }

    //--------------------------------------------------------------------------------------------
    // Attributes

    fn set_attr(&self, name: &str, value: &str) -> io::Result<()> {
        let num = |max: u64| -> io::Result<u64> {
            let v: u64 = value.trim().parse().map_err(|_| invalid(format!("{name}: {value:?} is not a number")))?;
            if v > max {
                return Err(invalid(format!("{name}: {v} is above the maximum {max}")));
            }
            Ok(v)
        };
        match name {
            "stripe_size" => {
                let v = num(u64::from(STRIPE_SIZE_MAX_BYTES))?;
                if v < u64::from(STRIPE_SIZE_MIN_BYTES) || v % 4096 != 0 {
                    return Err(invalid(format!(
                        "stripe_size: {v} bytes; use {STRIPE_SIZE_MIN_BYTES}..={STRIPE_SIZE_MAX_BYTES} in 4096-byte steps"
                    )));
                }
                let old = self.tunables.stripe_size_bytes.swap(v as u32, Ordering::Relaxed);
                tracing::info!(array = %self.name, from = old, to = v, "stripe_size changed (batches in flight finish with the old value)");
                Ok(())
            }
            "stripe_cache_size" => {
                let v = num(STRIPE_CACHE_MAX as u64)? as usize;
                if v < STRIPE_CACHE_MIN {
                    return Err(invalid(format!(
                        "stripe_cache_size: {v}; use {STRIPE_CACHE_MIN}..={STRIPE_CACHE_MAX} stripes"
                    )));
                }
                self.cache.set_limit(v);
                Ok(())
            }
            "preread_bypass_threshold" => {
                let v = num(self.cache.limit() as u64)?;
                self.tunables.preread_bypass_threshold.store(v as u32, Ordering::Relaxed);
                Ok(())
            }
            "rmw_level" => {
                let v = num(2)?;
                self.tunables.rmw_level.store(v as u8, Ordering::Relaxed);
                Ok(())
            }
            "stripe_gather_hold_us" => {
                let v = num(1_000_000)?;
                self.tunables.gather_hold_us.store(v, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(io::Error::new(io::ErrorKind::NotFound, format!("{}: no attribute {name:?}", self.name))),
        }
    }
}

const WRITABLE: [&str; 5] =
    ["stripe_size", "stripe_cache_size", "preread_bypass_threshold", "rmw_level", "stripe_gather_hold_us"];

impl Personality for Raid5 {
    fn level(&self) -> Level {
        self.level
    }

    fn array_sectors(&self) -> u64 {
        self.array_sectors
    }

    fn can_run(&self, slots: &SlotTable) -> bool {
        let in_sync = (0..self.n).filter(|r| slots.in_sync(*r).is_some()).count();
        in_sync + self.max_degraded() >= self.n
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(self.read_impl(a, offset_sectors, buf))
    }

    fn write<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(self.write_impl(a, offset_sectors, buf, flags))
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        Box::pin(self.discard_impl(a, offset_sectors, len_sectors))
    }

    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(self.write_zeroes_impl(a, offset_sectors, len_sectors, flags))
    }

    fn sync_domain_sectors(&self) -> u64 {
        self.member_size_sectors
    }

    /// Member sectors of the stripes' rows an array range touches, widened to the largest
    /// `stripe_size` unit so the bitmap and the barrier cover any setting.
    fn sync_range_of(&self, offset_sectors: u64, len_sectors: u64) -> Range<u64> {
        if len_sectors == 0 {
            return 0..0;
        }
        let (c, d) = (self.chunk_sectors, self.data_disks);
        let last = offset_sectors + len_sectors - 1;
        let (c0, c1) = (offset_sectors / c, last / c);
        let (s0, s1) = (c0 / d, c1 / d);
        // Another chunk of the request in the same stripe covers from/to the chunk edge.
        let lo = if c1 > c0 && (c0 + 1) / d == s0 { s0 * c } else { s0 * c + offset_sectors % c };
        let hi = if c1 > c0 && (c1 - 1) / d == s1 { s1 * c + c } else { s1 * c + last % c + 1 };
        let w = (u64::from(STRIPE_SIZE_MAX_BYTES) / SECTOR).min(c);
        (lo / w * w)..(hi.div_ceil(w) * w).min(self.member_size_sectors)
    }

    fn sync_range<'a>(
        &'a self,
        a: &'a ArrayCore,
        mode: SyncMode,
        start: u64,
        len: u64,
    ) -> IoFuture<'a, io::Result<SyncOutcome>> {
        Box::pin(self.sync_range_impl(a, mode, start, len))
    }

    /// md: `read_errors > conf->max_nr_stripes` fails the member.
    fn read_error_limit(&self) -> Option<u64> {
        Some(self.cache.limit() as u64)
    }

    fn optimal_io_bytes(&self) -> u32 {
        u32::try_from(self.chunk_sectors * self.data_disks * SECTOR).unwrap_or(u32::MAX)
    }

    fn attributes(&self) -> Vec<(&'static str, String)> {
        let s = &self.stats;
        let log = self.mismatches.lock();
        let mut mm = if log.entries.is_empty() { "none".to_string() } else { log.entries.join(",") };
        if log.truncated {
            mm.push_str(",...");
        }
        vec![
            ("stripe_size", self.tunables.stripe_size_bytes().to_string()),
            ("stripe_cache_size", self.cache.limit().to_string()),
            ("stripe_cache_active", self.cache.active().to_string()),
            ("preread_bypass_threshold", self.tunables.preread_bypass_threshold.load(Ordering::Relaxed).to_string()),
            ("rmw_level", self.tunables.rmw_level().to_string()),
            ("stripe_gather_hold_us", self.tunables.gather_hold_us.load(Ordering::Relaxed).to_string()),
            ("stripe_gather_hold_limit_us", self.hold_limit_us().to_string()),
            ("stripe_batches", s.batches.get().to_string()),
            ("stripe_batched_writes", s.batched_writes.get().to_string()),
            ("full_stripe_writes", s.full_runs.get().to_string()),
            ("rmw_writes", s.rmw_runs.get().to_string()),
            ("rcw_writes", s.rcw_runs.get().to_string()),
            ("reconstruct_writes", s.reconstruct_runs.get().to_string()),
            ("member_reads_during_writes", s.member_reads_during_writes.get().to_string()),
            ("member_writes", s.member_writes.get().to_string()),
            ("held_batches", s.held_batches.get().to_string()),
            ("hold_timeouts", s.hold_timeouts.get().to_string()),
            ("degraded_reads", s.degraded_reads.get().to_string()),
            ("sync_reads", s.sync_reads.get().to_string()),
            ("sync_writes", s.sync_writes.get().to_string()),
            ("mismatch_members", mm),
        ]
    }

    fn set_attribute(&self, name: &str, value: &str) -> Option<io::Result<()>> {
        WRITABLE.contains(&name).then(|| self.set_attr(name, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r5(level: Level, n: u32, chunk: u32) -> Raid5 {
        Raid5::new("t", ParityGeometry::new(level, n, 2, chunk).unwrap(), 1 << 20).unwrap()
    }

    #[test]
    fn sync_range_of_covers_touched_rows_widened_to_64k() {
        let r = r5(Level::Raid5, 4, 1024); // 512 KiB chunk, 3 data
        // One 4 KiB block in chunk 0 at chunk sector 200: row [128, 256) after widening.
        assert_eq!(r.sync_range_of(200, 8), 128..256);
        // Chunk 1 (same stripe 0), sector 16: member sectors 0..128.
        assert_eq!(r.sync_range_of(1024 + 16, 8), 0..128);
        // Spanning the end of chunk 0 and the start of chunk 1: the whole stripe's rows.
        assert_eq!(r.sync_range_of(1000, 48), 0..1024);
        // Stripe 1 starts at member sector 1024.
        assert_eq!(r.sync_range_of(3 * 1024, 8), 1024..1152);
        // Across a stripe boundary: end of stripe 0's last chunk to the start of stripe 1.
        assert_eq!(r.sync_range_of(3 * 1024 - 8, 16), 896..1152);
        // Small chunks: widening never exceeds a chunk.
        let r = r5(Level::Raid6, 5, 16);
        assert_eq!(r.sync_range_of(8, 8), 0..16);
    }

    #[test]
    fn attributes_validate() {
        let r = r5(Level::Raid6, 6, 128);
        assert!(r.set_attr("stripe_size", "65536").is_ok());
        assert_eq!(r.tunables.unit_sectors(128), 128);
        assert_eq!(r.tunables.unit_sectors(64), 64, "never above a chunk");
        for bad in ["0", "2048", "6000", "69632", "x"] {
            assert!(r.set_attr("stripe_size", bad).is_err(), "{bad}");
        }
        assert!(r.set_attr("stripe_size", "12288").is_ok());
        assert!(r.set_attr("stripe_cache_size", "16").is_err());
        assert!(r.set_attr("stripe_cache_size", "32769").is_err());
        assert!(r.set_attr("stripe_cache_size", "17").is_ok());
        assert!(r.set_attr("rmw_level", "3").is_err());
        assert!(r.set_attribute("chunk_size", "1").is_none());
        let attrs = r.attributes();
        assert!(attrs.iter().any(|(k, v)| *k == "stripe_size" && v == "12288"));
        assert!(attrs.iter().any(|(k, v)| *k == "stripe_cache_size" && v == "17"));
    }

    #[test]
    fn streams_detect_continuations() {
        let s = Streams::new();
        assert!(!s.note(0, 8));
        assert!(s.note(8, 16));
        assert!(!s.note(100, 108));
        assert!(s.note(16, 24));
    }
}
