//! raid4/5/6 restriping, to more members (`grow --raid-devices`) or to a new chunk or layout
//! over the same members (`grow --chunk` / `--layout`) forwards, to fewer members backwards;
//! raid10 near layouts to more or fewer members; kernel-compatible: the
//! [`Reshape`] personality serves an array whose superblocks say RESHAPE_ACTIVE, and the
//! engine ([`run`]) moves it window by window from the old to the new geometry.
//!
//! ```text
//!  array sector 0 ──────────── safe ───── progress ── window ──────────── old end
//!  │  new geometry (durable)   │ moved,   │ being    │ old geometry (intact on disk)
//!  │  (new_data_offset, N+k)   │ not yet  │ moved:   │ (data_offset, N members)
//!  │                           │ recorded │ all I/O  │
//!  reads: new                    reads: new  waits     reads/writes: old
//!  writes: new                   writes wait for the next checkpoint
//! ```
//!
//! Like raid5.c reshape_request (forward: delta_disks > 0, or delta_disks == 0 with the data
//! moving down): the new geometry starts `|new_offset|` sectors lower on every member (mdadm ≥
//! 3.3 without a backup file), so its writes trail the old geometry's reads. Over the same
//! members old and new addresses coincide, so the move is at least the larger chunk (raid5_run's
//! rule for a restripe that is "not really in-place"), and where there is room about half the
//! free space before the data, as mdadm moves it. A window is written only when its new-geometry end
//! stays below where the old copy of the last recorded position (`safe`, what every superblock's
//! `reshape_position` says) begins; otherwise the engine first flushes the members and records
//! `reshape_position = progress` in every superblock (the kernel's checkpoint rule). After a
//! crash the array assembles at the recorded position: below it the new geometry is complete
//! and flushed, above it the old copy was never overwritten. User writes into `[safe,
//! progress)` wait for the next checkpoint (they would be lost if the array came back at
//! `safe`); the engine takes that checkpoint as soon as one waits.
//!
//! Backwards (fewer members, raid5.c with reshape_backwards) everything mirrors: the engine
//! starts at the end of the smaller array (every superblock's `reshape_position`), the new
//! geometry holds from the boundary to the end and starts `new_offset` sectors *higher* on
//! every member, so its writes stay above the old rows of `[0, safe)`; user writes into
//! `[progress, safe)` wait for the next checkpoint. The array gives the smaller size from the
//! start (the operator cut it with `--array-size` first); at the end the members in the roles
//! dropped become spares (raid5_finish_reshape).
//!
//! Windows are whole new-geometry stripes, written as full stripes (parity from the data
//! alone), or for raid10 whole chunks written to every copy (raid10.c reshape_request; its
//! offset move is one chunk); new stripes past the old array end are zero-filled. At the end the superblocks get
//! the new geometry (data_offset = new, data_size grown by the move, RESHAPE_ACTIVE cleared,
//! md_finish_reshape) and [`super::Array::wait_reshape`] assembles the array again at its new
//! size. Resync/check wait until the reshape is done (the kernel refuses both meanwhile).

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags, join_read_parts};
use tokio::sync::{Notify, RwLock};

use super::core::ArrayCore;
use super::member::{Base, Member, flag};
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::raid5::Raid5;
use super::raid10::Raid10;
use super::slots::SlotTable;
use crate::format::reshape::ReshapeState;
use crate::format::superblock::Superblock;
use crate::layout::{Level, ParityGeometry, Raid10Geometry};

/// Largest window moved at once (array sectors, before rounding to whole new stripes).
const MAX_WINDOW_SECTORS: u64 = 8192;
/// A checkpoint at least this often while moving (md: every 10 s).
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(10);

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// The personality of a raid4/5/6 or raid10 array in the middle of a reshape (see the module
/// docs).
pub struct Reshape {
    name: String,
    state: ReshapeState,
    old: Box<dyn Personality>,
    new: Box<dyn Personality>,
    /// Where array sectors lie on the members in each geometry (the engine's safety rule).
    old_rows: Rows,
    new_rows: Rows,
    /// Windows are multiples of this (array sectors): whole new stripes for parity, one
    /// (larger) chunk for raid10 as raid10.c reshape_request copies.
    unit_sectors: u64,
    old_array_sectors: u64,
    new_array_sectors: u64,
    /// The sync domain (bitmap): per-member sectors for parity, the new array for raid10.
    sync_domain_sectors: u64,
    /// The boundary in memory: below it (forwards) or from it on (backwards) the new geometry
    /// holds the data.
    progress: AtomicU64,
    /// What every superblock's `reshape_position` says.
    safe: AtomicU64,
    /// User requests hold it shared; the engine exclusively while it moves a window.
    window: RwLock<()>,
    /// A user write waits for a checkpoint.
    want_checkpoint: AtomicBool,
    checkpointed: Notify,
    done: AtomicBool,
    finished: Notify,
    /// Per-member KiB/s since the engine started or resumed (md's `sync_speed` during a reshape).
    speed_kib: AtomicU64,
}

/// Where array sectors lie on the members of one geometry, row by row (a row: one chunk on
/// every member).
#[derive(Clone, Copy, Debug)]
enum Rows {
    Parity {
        chunk: u64,
        data_disks: u64,
    },
    /// raid10 near copies (no far copies).
    Near {
        chunk: u64,
        disks: u64,
        copies: u64,
    },
}

impl Rows {
    /// Copies of every array sector (parity geometries: 1).
    fn copies(self) -> u64 {
        match self {
            Rows::Parity { .. } => 1,
            Rows::Near { copies, .. } => copies,
        }
    }

    /// The first member sector of the row holding array sector `x`.
    fn start_of(self, x: u64) -> u64 {
        match self {
            Rows::Parity { chunk, data_disks } => x / (chunk * data_disks) * chunk,
            Rows::Near { chunk, disks, copies } => x / chunk * copies / disks * chunk,
        }
    }

    /// The member sector just past every row array sectors `[0, end)` touch.
    fn end_of(self, end: u64) -> u64 {
        match self {
            Rows::Parity { chunk, data_disks } => end.div_ceil(chunk * data_disks) * chunk,
            Rows::Near { .. } if end == 0 => 0,
            Rows::Near { chunk, disks, copies } => ((end.div_ceil(chunk) * copies - 1) / disks + 1) * chunk,
        }
    }
}

/// One geometry of a reshape, its member sectors counted from `base`.
fn geometry(
    name: &str,
    sb: &Superblock,
    st: &ReshapeState,
    (disks, layout, chunk): (u32, u32, u32),
    base: Base,
) -> io::Result<(Box<dyn Personality>, Rows)> {
    if st.level == Level::Raid10 {
        let g = Raid10Geometry::new(disks, layout, chunk, sb.size_sectors).map_err(|e| invalid(e.to_string()))?;
        if g.far_copies() != 1 {
            return Err(invalid(format!("{name}: a reshape of raid10 far or offset layouts is not supported yet")));
        }
        let rows = Rows::Near { chunk: u64::from(chunk), disks: u64::from(disks), copies: u64::from(g.near_copies()) };
        let mut p = Raid10::new(g, disks);
        p.base = base;
        return Ok((Box::new(p), rows));
    }
    let g = ParityGeometry::new(st.level, disks, layout, chunk).map_err(|e| invalid(e.to_string()))?;
    let rows = Rows::Parity { chunk: u64::from(chunk), data_disks: g.data_disks() as u64 };
    let mut p = Raid5::new(name, g, sb.size_sectors)?;
    p.base = base;
    Ok((Box::new(p), rows))
}

/// Builds the personality for superblock `sb` (RESHAPE_ACTIVE; its state already validated).
pub fn build(name: &str, sb: &Superblock, st: ReshapeState) -> io::Result<Arc<dyn Personality>> {
    if !matches!(st.level, Level::Raid4 | Level::Raid5 | Level::Raid6 | Level::Raid10) {
        return Err(invalid(format!("{name}: a reshape of {} is not supported yet", st.level.name())));
    }
    // Forward the data moves down (new_offset <= 0), backward up (md.c new_offset_store).
    if (st.backwards && st.new_offset_sectors < 0) || (!st.backwards && st.new_offset_sectors > 0) {
        let (dir, way) = if st.backwards { ("backwards", "up") } else { ("forwards", "down") };
        let why = format!("a {dir} reshape moves the data offset {way}, not by {} sectors", st.new_offset_sectors);
        return Err(invalid(format!("{name}: reshape state refused: {why}")));
    }
    let old_shape = (st.old_raid_disks, st.old_layout, st.old_chunk_sectors);
    let (old, old_rows) = geometry(name, sb, &st, old_shape, Base::ReshapeOld)?;
    let new_shape = (st.new_raid_disks, st.new_layout, st.new_chunk_sectors);
    let (new, new_rows) = geometry(name, sb, &st, new_shape, Base::ReshapeNew)?;
    let (old_array_sectors, new_array_sectors) = (old.array_sectors(), new.array_sectors());
    let shrinks = new_array_sectors < old_array_sectors;
    if shrinks != (st.backwards && st.new_raid_disks < st.old_raid_disks) || old_rows.copies() != new_rows.copies() {
        // Only a backwards reshape to fewer members makes the array smaller, and none changes
        // the copies (raid5_check_reshape, raid10_check_reshape); a superblock that says
        // otherwise was not written by md.
        let why = format!(
            "the new geometry ({new_array_sectors} sectors, {} copies) does not fit the old one ({old_array_sectors} sectors, {} copies)",
            new_rows.copies(),
            old_rows.copies()
        );
        return Err(invalid(format!("{name}: reshape state refused: {why}")));
    }
    let (unit_sectors, sync_domain_sectors) = match st.level {
        Level::Raid10 => (u64::from(st.old_chunk_sectors.max(st.new_chunk_sectors)), new.sync_domain_sectors()),
        _ => (st.step_sectors(), sb.size_sectors),
    };
    let position = st.position_sectors.min(new_array_sectors);
    Ok(Arc::new(Reshape {
        name: name.to_string(),
        state: st,
        old,
        new,
        old_rows,
        new_rows,
        unit_sectors,
        old_array_sectors,
        new_array_sectors,
        sync_domain_sectors,
        progress: AtomicU64::new(position),
        safe: AtomicU64::new(position),
        window: RwLock::new(()),
        want_checkpoint: AtomicBool::new(false),
        checkpointed: Notify::new(),
        done: AtomicBool::new(false),
        finished: Notify::new(),
        speed_kib: AtomicU64::new(0),
    }))
}

impl Reshape {
    pub fn state(&self) -> &ReshapeState {
        &self.state
    }

    /// The recorded position (array sectors; below it the new geometry holds).
    pub fn position_sectors(&self) -> u64 {
        self.safe.load(Ordering::Acquire)
    }

    /// Array size once the reshape is done.
    pub fn new_array_sectors(&self) -> u64 {
        self.new_array_sectors
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits until the engine recorded the end of the reshape.
    pub async fn wait_done(&self) {
        loop {
            let n = self.finished.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.is_done() {
                return;
            }
            n.await;
        }
    }

    /// Splits `[off, off + len)` at the geometry boundary `p`: the lengths below and from it.
    fn split(off: u64, len: u64, p: u64) -> (u64, u64) {
        let below = p.saturating_sub(off).min(len);
        (below, len - below)
    }

    /// The geometries below and from the boundary: (new, old) forwards, (old, new) backwards.
    fn sides(&self) -> (&dyn Personality, &dyn Personality) {
        if self.state.backwards { (&*self.old, &*self.new) } else { (&*self.new, &*self.old) }
    }

    /// Whether a member in `role` that is not in sync is recovered by the reshape itself: a
    /// role of the old geometry that had no member (raid0 -> raid4's missing parity) filled when
    /// a forward reshape started (raid5_start_reshape gives it recovery_offset 0 and raises it
    /// with the new geometry's per-member position: the old geometry never reads it).
    fn recovers(&self, role: usize) -> bool {
        !self.state.backwards && role < self.state.old_raid_disks as usize
    }

    /// Whether every role missing in a geometry holds only parity there (parity-last
    /// layouts; a member the reshape recovers counts as missing in the old geometry only):
    /// nothing is rebuilt from parity, so an unclean shutdown leaves nothing to distrust
    /// (raid5_run's dirty_parity_disks).
    pub fn missing_hold_only_parity(&self, slots: &SlotTable) -> bool {
        let st = &self.state;
        let parity = |layout: u32, disks: u32, r: u32| crate::layout::holds_only_parity(st.level, layout, disks, r);
        let (old_missing, new_missing) = self.missing_roles(slots);
        old_missing.iter().all(|&r| parity(st.old_layout, st.old_raid_disks, r))
            && new_missing.iter().all(|&r| parity(st.new_layout, st.new_raid_disks, r))
    }

    /// The roles each geometry runs without (old, new): no in-sync member, except that a
    /// member the reshape recovers is present in the new geometry (raid5.c calc_degraded).
    fn missing_roles(&self, slots: &SlotTable) -> (Vec<u32>, Vec<u32>) {
        let st = &self.state;
        let in_sync = |r: u32| slots.in_sync(r as usize).is_some();
        let recovered = |r: u32| self.recovers(r as usize) && slots.working(r as usize).is_some();
        let old = (0..st.old_raid_disks).filter(|r| !in_sync(*r)).collect();
        let new = (0..st.new_raid_disks).filter(|r| !in_sync(*r) && !recovered(*r)).collect();
        (old, new)
    }

    /// The members the reshape recovers (see [`Reshape::recovers`]).
    fn recovering_members(&self, slots: &SlotTable) -> Vec<Arc<Member>> {
        slots
            .recovering()
            .into_iter()
            .filter(|(r, m)| self.recovers(*r) && !m.has(flag::REPLACEMENT))
            .map(|(_, m)| m)
            .collect()
    }

    /// Caps what each member the reshape recovers claims to hold at what the reshape wrote on
    /// it by the recorded position: the new geometry's per-member end of that position, the most
    /// raid5_start_reshape's recovery_offset ever says. A superblock claiming more (crafted or
    /// corrupt; its checksum says nothing of that) would let the old geometry, beyond the
    /// position, rebuild data from a role that holds no parity there. Capping only lowers a
    /// claim: the reshape resumes from the position and writes those rows again. Returns
    /// (member, claimed, capped) for each member capped.
    pub fn cap_recovered(&self, slots: &SlotTable) -> Vec<(String, u64, u64)> {
        let written = self.new_rows.end_of(self.position_sectors());
        self.recovering_members(slots)
            .into_iter()
            .filter_map(|m| {
                let claimed = m.recovery_offset();
                (claimed > written).then(|| {
                    m.set_recovery_offset(written);
                    (m.name().to_string(), claimed, written)
                })
            })
            .collect()
    }

    /// Waits until a write of `[off, off + len)` may go ahead: not into the moved but not yet
    /// recorded sectors between `safe` and `progress`.
    async fn enter_write(&self, off: u64, len: u64) -> tokio::sync::RwLockReadGuard<'_, ()> {
        loop {
            let wait = self.checkpointed.notified();
            tokio::pin!(wait);
            wait.as_mut().enable();
            let g = self.window.read().await;
            let (safe, p) = (self.safe.load(Ordering::Acquire), self.progress.load(Ordering::Acquire));
            if off >= safe.max(p) || off + len <= safe.min(p) {
                return g;
            }
            drop(g);
            self.want_checkpoint.store(true, Ordering::Release);
            wait.await;
        }
    }

    /// Runs a modifying request on the geometries it touches (see [`Reshape::sides`]).
    async fn modify<'a, F>(&'a self, off: u64, len: u64, f: F) -> io::Result<()>
    where
        F: Fn(&'a dyn Personality, u64, u64, u64) -> IoFuture<'a, io::Result<()>>,
    {
        let _g = self.enter_write(off, len).await;
        let (below, above) = Reshape::split(off, len, self.progress.load(Ordering::Acquire));
        let (low, high) = self.sides();
        if below > 0 {
            f(low, off, below, 0).await?;
        }
        if above > 0 {
            f(high, off + below, above, below).await?;
        }
        Ok(())
    }
}

impl Personality for Reshape {
    fn level(&self) -> Level {
        self.state.level
    }

    /// The smaller geometry's size: the old one until a growth finishes, the new one from
    /// the start of a shrink (raid5_size with the fewer members).
    fn array_sectors(&self) -> u64 {
        self.old_array_sectors.min(self.new_array_sectors)
    }

    /// Both geometries must run; a member the reshape recovers counts as missing in the old
    /// one only (raid5.c calc_degraded while growing).
    fn can_run(&self, slots: &SlotTable) -> bool {
        self.degraded(slots) <= self.state.level.max_degraded()
    }

    /// md's calc_degraded during a reshape: the worse of the two geometries.
    fn degraded(&self, slots: &SlotTable) -> u32 {
        let (old, new) = self.missing_roles(slots);
        old.len().max(new.len()) as u32
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, off: u64, mut buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(async move {
            let _g = self.window.read().await;
            let len = buf.len() as u64 / 512;
            let (below, above) = Reshape::split(off, len, self.progress.load(Ordering::Acquire));
            let (low, high) = self.sides();
            if above == 0 {
                return low.read(a, off, buf).await;
            }
            if below == 0 {
                return high.read(a, off, buf).await;
            }
            let head = buf.split_to(below as usize * 512);
            let tail = buf.split_to(above as usize * 512);
            let h = low.read(a, off, head).await;
            let t = high.read(a, off + below, tail).await;
            join_read_parts(buf, [h, t])
        })
    }

    fn write<'a>(
        &'a self,
        a: &'a ArrayCore,
        off: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        let len = buf.len() as u64 / 512;
        Box::pin(self.modify(off, len, move |g, o, l, skip| {
            let part = buf.slice(skip as usize * 512..(skip + l) as usize * 512);
            g.write(a, o, part, flags)
        }))
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, off: u64, len: u64) -> IoFuture<'a, io::Result<()>> {
        Box::pin(self.modify(off, len, move |g, o, l, _| g.discard(a, o, l)))
    }

    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        off: u64,
        len: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(self.modify(off, len, move |g, o, l, _| g.write_zeroes(a, o, l, flags)))
    }

    fn sync_domain_sectors(&self) -> u64 {
        self.sync_domain_sectors
    }

    fn sync_range_of(&self, off: u64, len: u64) -> Range<u64> {
        let (o, n) = (self.old.sync_range_of(off, len), self.new.sync_range_of(off, len));
        o.start.min(n.start)..o.end.max(n.end)
    }

    fn sync_range<'a>(
        &'a self,
        _a: &'a ArrayCore,
        mode: SyncMode,
        _start: u64,
        _len: u64,
    ) -> IoFuture<'a, io::Result<SyncOutcome>> {
        let e = io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!("{}: {} waits until the reshape finishes", self.name, mode.as_str()),
        );
        Box::pin(std::future::ready(Err(e)))
    }

    fn read_error_limit(&self) -> Option<u64> {
        self.new.read_error_limit()
    }

    fn optimal_io_bytes(&self) -> u32 {
        self.old.optimal_io_bytes()
    }

    fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut v = self.new.attributes();
        v.push(("reshape_position", self.position_sectors().to_string()));
        v.push(("reshape_direction", if self.state.backwards { "backwards" } else { "forwards" }.to_string()));
        v
    }

    fn set_attribute(&self, name: &str, value: &str) -> Option<io::Result<()>> {
        let r = self.new.set_attribute(name, value)?;
        Some(r.and_then(|()| self.old.set_attribute(name, value).unwrap_or(Ok(()))))
    }

    fn reshape(&self) -> Option<&Reshape> {
        Some(self)
    }

    fn stop<'a>(&'a self, a: &'a ArrayCore) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            self.old.stop(a).await?;
            self.new.stop(a).await
        })
    }
}

//------------------------------------------------------------------------------------------------
// The engine

/// Sectors the new geometry's start lies from the old one's on every old member, in the
/// reshape's direction (below forwards, above backwards; the least over the members: raid5.c
/// min_offset_diff).
fn offset_room(core: &ArrayCore, old_disks: usize, backwards: bool) -> u64 {
    let slots = core.slots();
    (0..old_disks)
        .filter_map(|r| slots.slot(r).and_then(|s| s.member.clone()))
        .map(|m| {
            let (old, new) = (m.old_base_sectors, m.new_base_sectors);
            if backwards { new.saturating_sub(old) } else { old.saturating_sub(new) }
        })
        .min()
        .unwrap_or(0)
}

impl Reshape {
    /// Whether the new geometry may be written over the array sectors of `window` while the
    /// superblocks record `safe`. Forwards its member end stays at or below where the old
    /// stripe holding `safe` starts (plus the offset room); backwards its member start stays at
    /// or above where the old rows of `[0, safe)` end (less the room).
    fn fits(&self, window: &Range<u64>, safe: u64, room: u64) -> bool {
        if self.state.backwards {
            self.new_rows.start_of(window.start) + room >= self.old_rows.end_of(safe)
        } else {
            self.new_rows.end_of(window.end) <= self.old_rows.start_of(safe) + room
        }
    }

    /// The window `[start, end)` to move at `p` (forwards from it, backwards up to it): whole
    /// units (new stripes, raid10 chunks), as many as fit (at least one), or `None` when not
    /// even one fits with `p` recorded.
    fn window_at(&self, p: u64, safe: u64, room: u64) -> Option<Range<u64>> {
        let unit = self.unit_sectors;
        let max = (MAX_WINDOW_SECTORS / unit).max(1) * unit;
        let left = if self.state.backwards { p } else { self.new_array_sectors - p };
        let mut w = max.min(left);
        let range = |w: u64| if self.state.backwards { p - w..p } else { p..p + w };
        while w > 0 && !self.fits(&range(w), safe, room) {
            w = w.saturating_sub(unit);
        }
        (w > 0).then(|| range(w))
    }

    /// Whether every array sector is in the new geometry.
    fn all_moved(&self, p: u64) -> bool {
        if self.state.backwards { p == 0 } else { p >= self.new_array_sectors }
    }

    /// Moves `window` from the old to the new geometry with all user I/O held off.
    async fn move_window(&self, core: &ArrayCore, window: Range<u64>) -> io::Result<()> {
        let _x = self.window.write().await;
        let (p, w) = (window.start, window.end - window.start);
        let mut buf = IoBuf::zeroed((w * 512) as usize);
        let live = self.old_array_sectors.saturating_sub(p).min(w);
        if live > 0 {
            let mut head = buf.split_to((live * 512) as usize);
            let r;
            (head, r) = self.old.read(core, p, head).await;
            r?;
            let (whole, r) = join_read_parts(head, [(buf, Ok(()))]);
            r?;
            buf = whole;
        }
        self.new.write(core, p, buf.freeze(), WriteFlags::NONE).await?;
        let next = if self.state.backwards { window.start } else { window.end };
        // The new geometry below `next` is now on the recovered members too (the superblock
        // records it at the next checkpoint, when `next` is the position).
        let recovered = self.new_rows.end_of(next);
        for m in self.recovering_members(&core.slots()) {
            m.set_recovery_offset(m.recovery_offset().max(recovered));
        }
        self.progress.store(next, Ordering::Release);
        Ok(())
    }

    /// Array sectors moved from the start point up to `p` (backwards the start is the end).
    fn moved_sectors(&self, p: u64) -> u64 {
        if self.state.backwards { self.new_array_sectors.saturating_sub(p) } else { p }
    }

    /// Makes everything moved durable, then records `progress` in every superblock.
    async fn checkpoint(&self, core: &ArrayCore, why: &str) -> io::Result<()> {
        let p = self.progress.load(Ordering::Acquire);
        core.flush_members().await?;
        for m in core.slots().all_members() {
            m.update_superblock(|sb| sb.reshape_position_sectors = p);
        }
        core.update_superblocks(why).await?;
        self.safe.store(p, Ordering::Release);
        self.want_checkpoint.store(false, Ordering::Release);
        self.checkpointed.notify_waiters();
        Ok(())
    }

    /// md_finish_reshape: the superblocks get the new geometry.
    async fn finish(&self, core: &ArrayCore) -> io::Result<()> {
        core.flush_members().await?;
        // end_reshape: the members the reshape recovered hold all of the new geometry.
        for m in self.recovering_members(&core.slots()) {
            m.set(flag::IN_SYNC);
        }
        for m in core.slots().all_members() {
            m.update_superblock(|sb| {
                crate::format::reshape::finish_superblock(sb, self.new_array_sectors);
                crate::format::reshape::drop_removed_roles(sb);
            });
        }
        core.update_superblocks("reshape finished").await?;
        self.safe.store(self.progress.load(Ordering::Acquire), Ordering::Release);
        self.done.store(true, Ordering::Release);
        self.checkpointed.notify_waiters();
        self.finished.notify_waiters();
        tracing::info!(array = core.name(), sectors = self.new_array_sectors, "reshape finished");
        Ok(())
    }

    /// md's `sync_completed` during a reshape: per-member new-geometry sectors recorded (from
    /// the end backwards), of the total.
    pub fn completed(&self) -> (u64, u64) {
        let per_member = |p: u64| self.state.new_member_sectors(p);
        (per_member(self.moved_sectors(self.position_sectors())), per_member(self.new_array_sectors))
    }

    /// The engine's speed in per-member KiB/s and the time left at that speed (`None` before
    /// it measured one).
    pub fn speed_and_eta(&self) -> (u64, Option<Duration>) {
        let speed = self.speed_kib.load(Ordering::Acquire);
        let (done, total) = self.completed();
        (speed, eta(total.saturating_sub(done), speed))
    }

    /// The speed since the engine (re)started at `from` (array sectors), per member.
    fn note_speed(&self, from: u64, since: Instant) {
        let p = self.progress.load(Ordering::Acquire);
        let moved = self.state.new_member_sectors(self.moved_sectors(p).saturating_sub(self.moved_sectors(from)));
        let secs = since.elapsed().as_secs_f64().max(1e-3);
        self.speed_kib.store((moved as f64 / 2.0 / secs) as u64, Ordering::Release);
    }
}

/// Time to move `left_sectors` per member at `speed_kib` (none at speed 0).
fn eta(left_sectors: u64, speed_kib: u64) -> Option<Duration> {
    (speed_kib > 0).then(|| Duration::from_secs_f64(left_sectors as f64 / 2.0 / speed_kib as f64))
}

/// The engine task of an array whose personality is a [`Reshape`]: moves windows until the
/// end or until the array stops (then it records where it got to).
pub(crate) async fn run(core: Arc<ArrayCore>) {
    let pers = core.personality().clone();
    let Some(r) = pers.reshape() else { return };
    if let Err(e) = run_inner(&core, r).await {
        tracing::error!(array = core.name(), at = r.position_sectors(), "reshape stopped: {e}");
        core.sync.note_reshape_error(format!("reshape stopped at sector {}: {e}", r.position_sectors()));
    }
}

async fn run_inner(core: &ArrayCore, r: &Reshape) -> io::Result<()> {
    let room = offset_room(core, r.state.old_raid_disks as usize, r.state.backwards);
    let mut last = Instant::now();
    let (mut from, mut since) = (r.progress.load(Ordering::Acquire), Instant::now());
    // As md's resync: up to sync_speed_min always, above it only while no requests arrive,
    // never above sync_speed_max (on the per-member position).
    let per_member = |p: u64| r.state.new_member_sectors(r.moved_sectors(p));
    let mut pacer = super::sync::Pacer::new(core, per_member(r.progress.load(Ordering::Acquire)));
    loop {
        let p = r.progress.load(Ordering::Acquire);
        if core.is_shutting_down() || core.sync.is_frozen() || core.needs_check().is_some() {
            if p != r.position_sectors() {
                r.checkpoint(core, "reshape checkpoint (stop)").await?;
            }
            if core.is_shutting_down() || core.needs_check().is_some() {
                return Ok(());
            }
            core.sync.wait_unfrozen(&core.sync_wake).await;
            (from, since) = (r.progress.load(Ordering::Acquire), Instant::now());
            continue;
        }
        if r.all_moved(p) {
            return r.finish(core).await;
        }
        let w = match r.window_at(p, r.position_sectors(), room) {
            Some(w) => w,
            None => {
                r.checkpoint(core, "reshape checkpoint").await?;
                last = Instant::now();
                r.window_at(p, p, room).ok_or_else(|| {
                    io::Error::other(format!(
                        "{}: the data offsets moved by {room} sectors, too little for one stripe at sector {p}",
                        r.name
                    ))
                })?
            }
        };

        r.move_window(core, w).await?;
        pacer.pace_reshape(core, per_member(r.progress.load(Ordering::Acquire))).await;
        r.note_speed(from, since);
        if r.want_checkpoint.load(Ordering::Acquire) || last.elapsed() >= CHECKPOINT_INTERVAL {
            r.checkpoint(core, "reshape checkpoint").await?;
            last = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eta_is_what_is_left_at_the_speed() {
        assert_eq!(eta(4096, 1024), Some(Duration::from_secs(2)), "2 MiB per member at 1 MiB/s");
        assert_eq!(eta(4096, 0), None, "no estimate before a speed");
        assert_eq!(eta(0, 1024), Some(Duration::ZERO));
    }

    /// A crafted reshape state whose new geometry is smaller than the old one (a chunk that does
    /// not divide the used size) is refused, not run: the array's tail would be dropped.
    #[test]
    fn a_reshape_that_would_shrink_the_array_is_refused() {
        use crate::format::create::{CreateRequest, InitialSync, plan};
        use crate::format::superblock::feature;
        let mut req = CreateRequest::new(Level::Raid5, vec![64 * 2048; 4], [0x42; 16], 1_790_000_000);
        req.sync = InitialSync::AssumeClean;
        let mut sb = plan(&req).unwrap().members[1].superblock.clone();
        sb.feature_map |= feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
        (sb.new_level, sb.new_layout, sb.delta_disks) = (sb.level, sb.layout, 0);
        sb.new_chunk_sectors = 8192; // 4 MiB: the ~63 MiB used per member is no multiple of it
        sb.new_offset_sectors = -2048;
        sb.reshape_position_sectors = 0;
        let st = ReshapeState::from_superblock(&sb).unwrap().unwrap();
        let e = build("md0", &sb, st).err().expect("refused").to_string();
        assert!(e.contains("does not fit the old one"), "{e}");
        sb.new_chunk_sectors = 256;
        sb.new_offset_sectors = -256;
        let st = ReshapeState::from_superblock(&sb).unwrap().unwrap();
        assert!(build("md0", &sb, st).is_ok(), "a chunk that divides the used size runs");
    }

    /// To fewer members: runs backwards from the smaller array's end with the data moving up;
    /// the data moving down, or backwards over the same members with the offset lowered, is
    /// refused (md.c new_offset_store allows neither).
    #[test]
    fn a_reshape_to_fewer_members_runs_backwards_with_the_data_moving_up() {
        use crate::format::create::{CreateRequest, InitialSync, plan};
        use crate::format::superblock::feature;
        let mut req = CreateRequest::new(Level::Raid5, vec![64 * 2048; 5], [0x42; 16], 1_790_000_000);
        req.sync = InitialSync::AssumeClean;
        let mut sb = plan(&req).unwrap().members[1].superblock.clone();
        sb.feature_map |= feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
        (sb.new_level, sb.new_layout, sb.new_chunk_sectors) = (sb.level, sb.layout, sb.chunk_sectors);
        (sb.raid_disks, sb.delta_disks) = (4, -1);
        sb.size_sectors -= 3 * u64::from(sb.chunk_sectors);
        sb.new_offset_sectors = 3 * sb.chunk_sectors as i32;
        let end = sb.size_sectors * 3;
        sb.reshape_position_sectors = end;
        let st = ReshapeState::from_superblock(&sb).unwrap().unwrap();
        let r = build("md0", &sb, st).unwrap();
        let r = r.reshape().unwrap();
        assert!(r.state.backwards);
        assert_eq!((r.position_sectors(), r.new_array_sectors(), r.array_sectors()), (end, end, end));
        assert_eq!(r.completed().0, 0, "nothing moved at the end");
        // Backwards the window ends at p and must start above the old rows of [0, safe).
        let room = 3 * u64::from(sb.chunk_sectors);
        let w = r.window_at(end, end, room).unwrap();
        assert_eq!(w.end, end);
        assert!(r.new_rows.start_of(w.start) + room >= r.old_rows.end_of(end));
        assert!(r.all_moved(0) && !r.all_moved(w.start));
        sb.new_offset_sectors = -(sb.chunk_sectors as i32);
        let st = ReshapeState::from_superblock(&sb);
        assert!(st.is_err(), "shrinking with the data moving down: {st:?}");
        (sb.raid_disks, sb.delta_disks) = (5, 0);
        sb.size_sectors += 3 * u64::from(sb.chunk_sectors);
        sb.new_chunk_sectors = sb.chunk_sectors * 2;
        sb.feature_map |= feature::RESHAPE_BACKWARDS;
        sb.reshape_position_sectors = 0;
        let st = ReshapeState::from_superblock(&sb).unwrap().unwrap();
        let e = build("md0", &sb, st).err().expect("refused").to_string();
        assert!(e.contains("moves the data offset up"), "{e}");
    }

    #[test]
    fn rows_of_parity_and_near_geometries() {
        // raid5, 4 members, 8-sector chunks: 24 array sectors per row.
        let p = Rows::Parity { chunk: 8, data_disks: 3 };
        assert_eq!((p.start_of(0), p.start_of(23), p.start_of(24)), (0, 0, 8));
        assert_eq!((p.end_of(0), p.end_of(1), p.end_of(24), p.end_of(25)), (0, 8, 8, 16));
        // raid10 near-2 on 5 members: chunk i has copies at slots 2i, 2i + 1 (row = slot / 5).
        let n = Rows::Near { chunk: 8, disks: 5, copies: 2 };
        assert_eq!((n.start_of(0), n.start_of(16), n.start_of(24), n.start_of(40)), (0, 0, 8, 16));
        // Chunk 2 (sectors 16..24) sits in slots 4 and 5: rows 0 and 1.
        assert_eq!((n.end_of(0), n.end_of(16), n.end_of(17), n.end_of(40)), (0, 8, 16, 16));
    }

    #[test]
    fn split_at_the_boundary() {
        assert_eq!(Reshape::split(0, 8, 0), (0, 8));
        assert_eq!(Reshape::split(0, 8, 8), (8, 0));
        assert_eq!(Reshape::split(4, 8, 8), (4, 4));
        assert_eq!(Reshape::split(16, 8, 8), (0, 8));
    }
}
