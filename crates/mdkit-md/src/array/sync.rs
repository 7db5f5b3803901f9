//! The background sync engine: resync, recovery, check and repair (md_do_sync and
//! md_check_recovery, in one task per array).
//!
//! The engine picks work in md's order: a requested check/repair, else a resync of an unclean
//! array (from its checkpoint), else recovery (spares are first activated into empty roles or as
//! replacements; members that are in a role but not in sync are rebuilt from their
//! `recovery_offset`). Work proceeds in steps of [`STEP_SECTORS`], [`STEP_DEPTH`] at a time,
//! each step a [`Personality::sync_range`] call that raises the region barrier for its range
//! only. Progress is checkpointed into the superblocks every [`CHECKPOINT_INTERVAL`]
//! (`resync_offset` while the array is clean, each rebuilding member's `recovery_offset`), so a
//! restart resumes from the last checkpoint.
//!
//! Speed follows md: up to `sync_speed_min` (KiB/s) always; above it only while the array sees
//! no user I/O, and never above `sync_speed_max`.
//!
//! With a write-intent bitmap, a resync (and the recovery of a member re-added with the bitmap)
//! visits only the chunks the bitmap says are needed; a completed resync or recovery that leaves
//! the array whole tells the bitmap so (`end_sync`), and a rebuilt member's bitmap copy is
//! written in full before it is marked in sync.
//!
//! Beyond md, check/repair keep the list of mismatched ranges (sync-domain sectors), not only
//! their count.

use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::core::ArrayCore;
use super::io::join_all;
use super::member::{Member, flag};
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::slots::SlotTable;
use crate::format::superblock::MAX_SECTOR;

/// Sectors per sync step (1 MiB).
pub const STEP_SECTORS: u64 = 2048;
/// Steps in flight at once.
pub const STEP_DEPTH: usize = 4;
/// How often progress is written to the superblocks: at least this often, and after every
/// sixteenth of the domain (as md: `resync_max_sectors >> 4`), whichever comes first.
pub const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(3);
/// md defaults (KiB/s): /proc/sys/dev/raid/speed_limit_min and _max.
pub const DEFAULT_SPEED_MIN_KIB: u64 = 1000;
pub const DEFAULT_SPEED_MAX_KIB: u64 = 200_000;
/// At most this many mismatched ranges are kept (the count is always exact).
pub const MISMATCH_RANGES_MAX: usize = 4096;
/// After a failed run the engine waits this long (or for a membership change) before retrying.
const ERROR_BACKOFF: Duration = Duration::from_secs(30);

/// A snapshot of the engine's state (md's sync_* attributes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncStatus {
    /// md's `sync_action`: "frozen", else what runs or is decided to run next ("resync",
    /// "recover", "check", "repair"), else "idle". See [`status`].
    pub action: &'static str,
    pub running: Option<SyncMode>,
    /// md's `last_sync_action`: the action of the last run started since assembly.
    pub last_action: Option<SyncMode>,
    /// Sectors of the current run's domain done (from 0), and the domain size.
    pub done_sectors: u64,
    pub total_sectors: u64,
    /// Recent speed (KiB/s).
    pub speed_kib: u64,
    /// Estimated time to finish the current run.
    pub eta: Option<Duration>,
    pub mismatch_sectors: u64,
    pub mismatch_ranges: Vec<Range<u64>>,
    pub mismatch_ranges_truncated: bool,
    pub last_error: Option<String>,
    /// Runs finished (completed or interrupted) since assembly.
    pub runs: u64,
    /// The last finished run: mode and whether it reached the end.
    pub last_run: Option<(SyncMode, bool)>,
    /// What the current (else the last) resync or recovery run copied: sync-domain sectors,
    /// and write-intent bitmap chunks (0 without a bitmap). A bitmap-guided catch-up copies
    /// only the chunks the bitmap needed.
    pub copied_sectors: u64,
    pub copied_chunks: u64,
}

#[derive(Default)]
struct Inner {
    running: Option<SyncMode>,
    requested: Option<SyncMode>,
    done_sectors: u64,
    total_sectors: u64,
    speed_kib: u64,
    eta: Option<Duration>,
    mismatch_ranges: Vec<Range<u64>>,
    mismatch_ranges_truncated: bool,
    last_error: Option<String>,
    error_at: Option<Instant>,
    idle: bool,
    runs: u64,
    last_run: Option<(SyncMode, bool)>,
    last_action: Option<SyncMode>,
    /// `interrupt_gen` when the running action started: once it moves on, the run is stopping.
    run_generation: u64,
    copied_sectors: u64,
    copied_chunks: u64,
}

/// Engine state shared with attributes and the CLI.
pub struct SyncState {
    inner: Mutex<Inner>,
    interrupt_gen: AtomicU64,
    frozen: AtomicBool,
    speed_min_kib: AtomicU64,
    speed_max_kib: AtomicU64,
    mismatch_sectors: AtomicU64,
    idle_changed: Notify,
}

impl SyncState {
    pub fn new() -> SyncState {
        SyncState {
            inner: Mutex::new(Inner::default()),
            interrupt_gen: AtomicU64::new(0),
            frozen: AtomicBool::new(false),
            speed_min_kib: AtomicU64::new(DEFAULT_SPEED_MIN_KIB),
            speed_max_kib: AtomicU64::new(DEFAULT_SPEED_MAX_KIB),
            mismatch_sectors: AtomicU64::new(0),
            idle_changed: Notify::new(),
        }
    }

    pub(crate) fn interrupt(&self) {
        self.interrupt_gen.fetch_add(1, Ordering::AcqRel);
    }

    /// A member failed: a running recovery must re-plan (its source or target may be gone).
    pub(crate) fn interrupt_recovery(&self) {
        if self.inner.lock().running == Some(SyncMode::Recover) {
            self.interrupt();
        }
        self.not_idle();
    }

    /// Something changed that may need sync work: waiters for idleness must wait again.
    pub(crate) fn not_idle(&self) {
        let mut g = self.inner.lock();
        g.idle = false;
        g.error_at = None;
    }

    /// A run failed recently: the engine waits before retrying.
    fn in_error_backoff(&self) -> bool {
        self.inner.lock().error_at.is_some_and(|t| t.elapsed() < ERROR_BACKOFF)
    }

    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::Acquire)
    }

    pub fn speed_min_kib(&self) -> u64 {
        self.speed_min_kib.load(Ordering::Relaxed)
    }

    pub fn speed_max_kib(&self) -> u64 {
        self.speed_max_kib.load(Ordering::Relaxed)
    }

    pub fn set_speed_min_kib(&self, v: u64) {
        self.speed_min_kib.store(v, Ordering::Relaxed);
    }

    pub fn set_speed_max_kib(&self, v: u64) {
        self.speed_max_kib.store(v.max(1), Ordering::Relaxed);
    }

    pub fn mismatch_sectors(&self) -> u64 {
        self.mismatch_sectors.load(Ordering::Relaxed)
    }

    /// The engine's own view: `action` is "frozen" (which wins, as in md), the running action
    /// unless it was told to stop, the requested one, else "idle". [`status`] adds the work the
    /// array state decides.
    pub fn status(&self) -> SyncStatus {
        let g = self.inner.lock();
        let stopping = self.interrupt_gen.load(Ordering::Acquire) != g.run_generation;
        let continuing = g.running.filter(|_| !stopping);
        let action = match (self.is_frozen(), continuing.or(g.requested)) {
            (true, _) => "frozen",
            (false, Some(m)) => m.as_str(),
            (false, None) => "idle",
        };
        SyncStatus {
            action,
            running: g.running,
            last_action: g.last_action,
            done_sectors: g.done_sectors,
            total_sectors: g.total_sectors,
            speed_kib: g.speed_kib,
            eta: g.eta,
            mismatch_sectors: self.mismatch_sectors(),
            mismatch_ranges: g.mismatch_ranges.clone(),
            mismatch_ranges_truncated: g.mismatch_ranges_truncated,
            last_error: g.last_error.clone(),
            runs: g.runs,
            last_run: g.last_run,
            copied_sectors: g.copied_sectors,
            copied_chunks: g.copied_chunks,
        }
    }

    /// md's `sync_action` write.
    pub(crate) fn request(&self, action: &str) -> io::Result<()> {
        let mut g = self.inner.lock();
        match action {
            "idle" => {
                // As md's idle_sync_thread: stop what runs and unfreeze.
                g.requested = None;
                self.frozen.store(false, Ordering::Release);
                self.interrupt();
            }
            "frozen" => {
                g.requested = None;
                self.frozen.store(true, Ordering::Release);
                self.interrupt();
            }
            "check" | "repair" => {
                if matches!(g.running, Some(SyncMode::Resync | SyncMode::Recover)) {
                    return Err(io::Error::new(
                        io::ErrorKind::ResourceBusy,
                        format!(
                            "a {} is running; {action} must wait until it finishes",
                            g.running.map_or("", |m| m.as_str())
                        ),
                    ));
                }
                g.requested = Some(if action == "check" { SyncMode::Check } else { SyncMode::Repair });
                self.frozen.store(false, Ordering::Release);
            }
            "resync" | "recover" => {
                self.frozen.store(false, Ordering::Release);
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("sync_action {other:?}: use idle, frozen, check, repair, resync or recover"),
                ));
            }
        }
        g.idle = false;
        g.error_at = None;
        Ok(())
    }

    /// The reshape engine stopped on an error (shown as `last_error`).
    pub(crate) fn note_reshape_error(&self, msg: String) {
        self.inner.lock().last_error = Some(msg);
    }

    /// The reshape engine waits while the array's sync actions are frozen.
    pub(crate) async fn wait_unfrozen(&self, wake: &Notify) {
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }

    /// Waits until the engine has nothing to do (or is frozen).
    pub async fn wait_idle(&self) {
        loop {
            let n = self.idle_changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let g = self.inner.lock();
                if (g.idle && g.requested.is_none() && g.running.is_none()) || (self.is_frozen() && g.running.is_none())
                {
                    return;
                }
            }
            n.await;
        }
    }
}

impl Default for SyncState {
    fn default() -> Self {
        SyncState::new()
    }
}

/// The array's sync status as md's `sync_action` reads it (md_sync_action): "frozen" first;
/// then the running or requested action; then, from the moment the array state decides it, the
/// work the engine will start next — `resync` while a resync checkpoint is set, `recover` while
/// a member in a role is not in sync or a spare can fill an empty role or replace a member
/// that wants it; else "idle". Nothing is pending where the engine would not start it either
/// (no redundancy, a read-only array, too few members, the back-off after a failed run).
pub fn status(core: &ArrayCore) -> SyncStatus {
    let mut st = core.sync.status();
    if let Some(r) = core.personality().reshape() {
        if st.action != "frozen" && !r.is_done() {
            st.action = "reshape";
        }
        (st.done_sectors, st.total_sectors) = r.completed();
        (st.speed_kib, st.eta) = r.speed_and_eta();
        return st;
    }
    if st.action == "idle"
        && let Some(mode) = pending_mode(core)
    {
        st.action = mode.as_str();
    }
    st
}

fn pending_mode(core: &ArrayCore) -> Option<SyncMode> {
    let pers = core.personality();
    if !pers.has_redundancy()
        || core.needs_check().is_some()
        || core.sync.in_error_backoff()
        || pers.reshape().is_some()
    {
        return None;
    }
    let slots = core.slots();
    if !pers.can_run(&slots) {
        return None;
    }
    if core.resync_checkpoint() != MAX_SECTOR {
        return Some(SyncMode::Resync);
    }
    let spare_has_work = !slots.spares().is_empty()
        && (!slots.empty_roles().is_empty() || (0..slots.raid_disks()).any(|r| replacement_wanted(&slots, r)));
    (spare_has_work || !slots.recovering().is_empty()).then_some(SyncMode::Recover)
}

/// The working member of `role` wants a replacement and has no working one yet.
fn replacement_wanted(slots: &SlotTable, role: usize) -> bool {
    let wants = slots.working(role).is_some_and(|m| m.has(flag::WANT_REPLACEMENT));
    let has_repl = slots.slot(role).is_some_and(|s| s.replacement.as_ref().is_some_and(|r| !r.is_faulty()));
    wants && !has_repl
}

struct Work {
    mode: SyncMode,
    start: u64,
    end: u64,
}

/// The engine task: runs until the array shuts down.
pub(crate) async fn run(core: Arc<ArrayCore>) {
    loop {
        if core.is_shutting_down() {
            break;
        }
        let wake = core.sync_wake.notified();
        tokio::pin!(wake);
        wake.as_mut().enable();
        match plan(&core).await {
            Some(w) => execute(&core, w).await,
            None => {
                {
                    let mut g = core.sync.inner.lock();
                    g.idle = true;
                }
                core.sync.idle_changed.notify_waiters();
                tokio::select! {
                    _ = wake => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
    let mut g = core.sync.inner.lock();
    g.running = None;
    g.idle = true;
    drop(g);
    core.sync.idle_changed.notify_waiters();
}

async fn plan(core: &Arc<ArrayCore>) -> Option<Work> {
    let pers = core.personality().clone();
    if core.sync.is_frozen() || core.needs_check().is_some() || !pers.has_redundancy() {
        return None;
    }
    if pers.reshape().is_some() {
        // Resync, recovery and check wait until the reshape is done (raid5_start_reshape).
        core.sync.inner.lock().requested = None;
        return None;
    }
    if core.sync.in_error_backoff() {
        return None;
    }
    if !pers.can_run(&core.slots()) {
        return None;
    }
    if let Some(mode) = core.sync.inner.lock().requested.take() {
        return Some(Work { mode, start: 0, end: pers.sync_domain_sectors() });
    }
    let cp = core.resync_checkpoint();
    if cp != MAX_SECTOR {
        return Some(Work {
            mode: SyncMode::Resync,
            start: cp.min(pers.sync_domain_sectors()),
            end: pers.sync_domain_sectors(),
        });
    }
    if let Err(e) = activate_spares(core).await {
        tracing::warn!(array = core.name(), "activating spares: {e}");
    }
    let recovering = core.slots().recovering();
    if recovering.is_empty() {
        return None;
    }
    let start = recovering.iter().map(|(_, m)| m.recovery_offset()).min().unwrap_or(0);
    Some(Work {
        mode: SyncMode::Recover,
        start: start.min(pers.recovery_domain_sectors()),
        end: pers.recovery_domain_sectors(),
    })
}

/// md's remove_and_add_spares: spares fill empty roles (recovering from 0), or become the
/// replacement of a member that wants one.
async fn activate_spares(core: &Arc<ArrayCore>) -> io::Result<()> {
    let _m = core.membership.lock().await;
    let slots = core.slots();
    if slots.spares().is_empty() {
        return Ok(());
    }
    let mut t = (*slots).clone();
    let mut spares: Vec<Arc<Member>> = slots.spares().to_vec();
    let mut changed = false;
    for role in slots.empty_roles() {
        let Some(s) = spares.first().cloned() else { break };
        spares.remove(0);
        t.remove(&s);
        s.clear(flag::IN_SYNC | flag::REPLACEMENT);
        s.set_recovery_offset(0);
        t.set_holder(role, Some(s.clone()));
        tracing::info!(array = core.name(), member = s.name(), role, "spare activated: recovery starts");
        changed = true;
    }
    for role in 0..slots.raid_disks() {
        if !replacement_wanted(&slots, role) {
            continue;
        }
        let Some(s) = spares.first().cloned() else { break };
        spares.remove(0);
        make_replacement(&mut t, role, &s);
        tracing::info!(array = core.name(), member = s.name(), role, "spare becomes replacement");
        changed = true;
    }
    if changed {
        core.set_slots(t);
        core.update_superblocks("spare activated").await?;
    }
    Ok(())
}

/// Moves spare `s` into `role` of `t` as its replacement, rebuilt from sector 0.
pub(crate) fn make_replacement(t: &mut SlotTable, role: usize, s: &Arc<Member>) {
    t.remove(s);
    s.clear(flag::IN_SYNC);
    s.set(flag::REPLACEMENT);
    s.set_recovery_offset(0);
    t.set_replacement(role, Some(s.clone()));
}

fn set_running(core: &ArrayCore, w: &Work, generation: u64) {
    let mut g = core.sync.inner.lock();
    g.running = Some(w.mode);
    g.run_generation = generation;
    g.last_action = Some(w.mode);
    g.done_sectors = w.start;
    g.total_sectors = w.end;
    g.speed_kib = 0;
    g.eta = None;
    g.idle = false;
    if matches!(w.mode, SyncMode::Resync | SyncMode::Recover) {
        g.copied_sectors = 0;
        g.copied_chunks = 0;
    }
    if matches!(w.mode, SyncMode::Check | SyncMode::Repair) {
        g.mismatch_ranges.clear();
        g.mismatch_ranges_truncated = false;
        core.sync.mismatch_sectors.store(0, Ordering::Relaxed);
    }
}

fn note_mismatches(core: &ArrayCore, sectors: u64, ranges: Vec<Range<u64>>) {
    if sectors == 0 {
        return;
    }
    core.sync.mismatch_sectors.fetch_add(sectors, Ordering::Relaxed);
    let mut g = core.sync.inner.lock();
    for r in ranges {
        let full = g.mismatch_ranges.len() >= MISMATCH_RANGES_MAX;
        match g.mismatch_ranges.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ if full => g.mismatch_ranges_truncated = true,
            _ => g.mismatch_ranges.push(r),
        }
    }
}

/// Progress, speed and throttling: md's rule for every sync action, the reshape included
/// (md_do_sync serves both). As md's `resync_mark`s, the speed is measured from the older of
/// two marks taken [`MARK_STEP`] apart, so a window never starts a moment ago (the speed shown
/// spiked to 60x `sync_speed_max` right after each new window). The pace counts sectors of
/// sync I/O only: ranges a bitmap lets the sync skip do not count against the limit.
pub(crate) struct Pacer {
    /// The older mark (speeds are measured from it) and the newer one.
    marks: [Mark; 2],
    /// Sectors of sync I/O since the start.
    io_sectors: u64,
    /// Where this run started (the reshape counts every sector it moved as I/O).
    origin: u64,
    last_user_requests: u64,
}

/// A point of progress: when, the position then, the sectors of I/O then.
#[derive(Clone, Copy)]
struct Mark {
    at: Instant,
    pos: u64,
    io_sectors: u64,
}

impl Mark {
    /// The speed shown (md's status_resync): progress since this mark, over at least 1 s.
    fn shown_speed_kib(&self, pos: u64, now: Instant) -> u64 {
        let secs = now.saturating_duration_since(self.at).as_secs_f64().max(1.0);
        (pos.saturating_sub(self.pos) as f64 / 2.0 / secs) as u64
    }

    /// The speed paced (md_do_sync's currspeed): sync I/O since this mark, over the time since
    /// it (md adds 1 s, which lets a sync run unlimited for its first second; here
    /// `sync_speed_max` holds from the start).
    fn paced_speed_kib(&self, io_sectors: u64, now: Instant) -> u64 {
        let secs = now.saturating_duration_since(self.at).as_secs_f64().max(1e-3);
        (io_sectors.saturating_sub(self.io_sectors) as f64 / 2.0 / secs) as u64
    }

    /// The marks after `now`: a new one once the newer is [`MARK_STEP`] old.
    fn advance(marks: [Mark; 2], now: Mark) -> [Mark; 2] {
        if now.at.saturating_duration_since(marks[1].at) >= MARK_STEP { [marks[1], now] } else { marks }
    }
}

/// How often a new mark is taken (md's SYNC_MARK_STEP).
const MARK_STEP: Duration = Duration::from_secs(3);

impl Pacer {
    pub(crate) fn new(core: &ArrayCore, pos: u64) -> Pacer {
        let mark = Mark { at: Instant::now(), pos, io_sectors: 0 };
        Pacer { marks: [mark; 2], io_sectors: 0, origin: pos, last_user_requests: core.user_requests() }
    }

    /// Sectors of sync I/O done (not skipped).
    fn note_io(&mut self, sectors: u64) {
        self.io_sectors += sectors;
    }

    fn speed_kib(&self, pos: u64) -> u64 {
        self.marks[0].shown_speed_kib(pos, Instant::now())
    }

    /// Sleeps as md does: above `speed_min` only while idle, never above `speed_max`.
    async fn pace(&mut self, core: &ArrayCore, pos: u64, generation: u64) {
        loop {
            if core.sync.interrupt_gen.load(Ordering::Acquire) != generation || core.is_shutting_down() {
                return;
            }
            let users = core.user_requests();
            let busy = users != self.last_user_requests;
            self.last_user_requests = users;
            let limits = (core.sync.speed_min_kib(), core.sync.speed_max_kib());
            match self.wait_before_io(Instant::now(), pos, busy, limits) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return,
            }
        }
    }

    /// How long to wait at `now` before more sync I/O (`None`: go on), for `(speed_min,
    /// speed_max)` in KiB/s. The marks move on while the sync waits too: measured from a mark
    /// that stood still, a busy array stopped a sync for a minute after a few seconds at full
    /// speed (the speed over the growing window had to fall below `speed_min` first), and the
    /// speed shown stood still with it. So a wait lasts at most two mark steps, and a sync under
    /// steady user I/O keeps about `speed_min` going, as md does.
    fn wait_before_io(
        &mut self,
        now: Instant,
        pos: u64,
        busy: bool,
        (min_kib, max_kib): (u64, u64),
    ) -> Option<Duration> {
        self.marks = Mark::advance(self.marks, Mark { at: now, pos, io_sectors: self.io_sectors });
        let speed = self.marks[0].paced_speed_kib(self.io_sectors, now);
        (speed > max_kib || (speed > min_kib && busy)).then(|| Duration::from_millis(if busy { 50 } else { 10 }))
    }

    /// [`Pacer::pace`] for the reshape engine, which no sync request interrupts: `pos` counts
    /// the sectors it moved per member, all of them I/O.
    pub(crate) async fn pace_reshape(&mut self, core: &ArrayCore, pos: u64) {
        self.io_sectors = pos.saturating_sub(self.origin);
        let generation = core.sync.interrupt_gen.load(Ordering::Acquire);
        self.pace(core, pos, generation).await;
    }
}

async fn execute(core: &Arc<ArrayCore>, w: Work) {
    let pers: Arc<dyn Personality> = core.personality().clone();
    let generation = core.sync.interrupt_gen.load(Ordering::Acquire);
    set_running(core, &w, generation);
    tracing::info!(array = core.name(), action = w.mode.as_str(), from = w.start, to = w.end, "sync started");
    let mut pos = w.start;
    let mut pacer = Pacer::new(core, pos);
    let mut last_checkpoint = Instant::now();
    let mut synced_since_checkpoint = 0u64;
    let checkpoint_sectors = (w.end / 16).max(STEP_SECTORS * STEP_DEPTH as u64);
    let mut error: Option<io::Error> = None;
    let targets: Vec<Arc<Member>> = core.slots().recovering().into_iter().map(|(_, m)| m).collect();
    let bitmap_guided = core.bitmap.is_some()
        && match w.mode {
            SyncMode::Resync => true,
            SyncMode::Recover => {
                pers.recovery_uses_sync_domain()
                    && !targets.is_empty()
                    && targets.iter().all(|m| m.has(flag::BITMAP_RECOVERY))
            }
            SyncMode::Check | SyncMode::Repair => false,
        };
    while pos < w.end {
        if core.sync.interrupt_gen.load(Ordering::Acquire) != generation || core.is_shutting_down() {
            break;
        }
        let ranges: Vec<Range<u64>> = (0..STEP_DEPTH as u64)
            .map(|i| pos + i * STEP_SECTORS)
            .take_while(|s| *s < w.end)
            .map(|s| s..(s + STEP_SECTORS).min(w.end))
            .collect();
        // With a bitmap, ranges it does not need are skipped without I/O (or pacing).
        let (needed, chunks): (Vec<bool>, Vec<u64>) =
            ranges.iter().map(|r| step_work(core, r, bitmap_guided, w.start)).unzip();
        if needed.iter().any(|n| *n) {
            pacer.pace(core, pos, generation).await;
            if core.sync.interrupt_gen.load(Ordering::Acquire) != generation || core.is_shutting_down() {
                break;
            }
        }
        let work = ranges.iter().zip(&needed).filter(|(_, n)| **n).map(|(r, _)| r);
        let mut results =
            join_all(work.map(|r| pers.sync_range(core, w.mode, r.start, r.end - r.start))).await.into_iter();
        for ((r, n), chunks) in ranges.iter().zip(&needed).zip(&chunks) {
            let res = if *n {
                results.next().unwrap_or_else(|| Ok(SyncOutcome::default()))
            } else {
                Ok(SyncOutcome::default())
            };
            match res {
                Ok(o) => {
                    note_mismatches(core, o.mismatch_sectors, o.mismatch_ranges);
                    if error.is_none() {
                        pos = r.end;
                        if *n {
                            pacer.note_io(r.end - r.start);
                            synced_since_checkpoint += r.end - r.start;
                            if matches!(w.mode, SyncMode::Resync | SyncMode::Recover) {
                                note_copied(core, r.end - r.start, *chunks);
                            }
                        }
                    }
                }
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        advance(core, &w, &targets, pos);
        {
            let mut g = core.sync.inner.lock();
            g.done_sectors = pos;
            g.speed_kib = pacer.speed_kib(pos);
            g.eta = (g.speed_kib > 0).then(|| Duration::from_secs_f64((w.end - pos) as f64 / 2.0 / g.speed_kib as f64));
        }
        if error.is_some() {
            break;
        }
        let due = last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL || synced_since_checkpoint >= checkpoint_sectors;
        if due && synced_since_checkpoint > 0 && matches!(w.mode, SyncMode::Resync | SyncMode::Recover) {
            last_checkpoint = Instant::now();
            synced_since_checkpoint = 0;
            if let Err(e) = core.update_superblocks("sync checkpoint").await {
                error = Some(e);
                break;
            }
        }
    }
    let completed = pos >= w.end && error.is_none();
    finish(core, &w, &targets, completed).await;
    let mut g = core.sync.inner.lock();
    if let Some(e) = &error {
        tracing::error!(array = core.name(), action = w.mode.as_str(), at = pos, "sync stopped: {e}");
        g.last_error = Some(format!("{} stopped at sector {pos}: {e}", w.mode.as_str()));
        g.error_at = Some(Instant::now());
    }
    g.running = None;
    g.runs += 1;
    g.last_run = Some((w.mode, completed));
    g.eta = None;
    tracing::info!(
        array = core.name(),
        action = w.mode.as_str(),
        completed,
        at = pos,
        mismatch_cnt = core.sync.mismatch_sectors(),
        "sync finished"
    );
    drop(g);
    core.sync.idle_changed.notify_waiters();
}

/// Whether a step over the sync-domain range `r` has work (with `guided`, only when the bitmap
/// needs one of its chunks), and how many bitmap chunks it copies that no earlier step of the
/// run (starting at `run_start`) counted: a chunk counts in the step holding its first sector.
/// No bitmap: always work, 0 chunks.
fn step_work(core: &ArrayCore, r: &Range<u64>, guided: bool, run_start: u64) -> (bool, u64) {
    let Some(bm) = &core.bitmap else { return (true, 0) };
    let chunk = bm.geometry().chunk_sectors().max(1);
    let mut s = r.start / chunk * chunk;
    let (mut any, mut n) = (false, 0);
    while s < r.end {
        if !guided || bm.chunk_needs_sync(s.max(r.start)) {
            any = true;
            if s.max(run_start) >= r.start {
                n += 1;
            }
        }
        s += chunk;
    }
    (any, n)
}

fn note_copied(core: &ArrayCore, sectors: u64, chunks: u64) {
    let mut g = core.sync.inner.lock();
    g.copied_sectors += sectors;
    g.copied_chunks += chunks;
}

/// Records progress in memory (the superblocks get it at the next checkpoint).
fn advance(core: &ArrayCore, w: &Work, targets: &[Arc<Member>], pos: u64) {
    match w.mode {
        SyncMode::Resync => core.set_resync_checkpoint(pos),
        SyncMode::Recover => {
            for m in targets {
                if !m.is_faulty() && !m.has(flag::IN_SYNC) && m.recovery_offset() < pos {
                    m.set_recovery_offset(pos);
                }
            }
        }
        SyncMode::Check | SyncMode::Repair => {}
    }
}

async fn finish(core: &Arc<ArrayCore>, w: &Work, targets: &[Arc<Member>], completed: bool) {
    if completed
        && matches!(w.mode, SyncMode::Resync | SyncMode::Recover)
        && let Some(bm) = &core.bitmap
    {
        let slots = core.slots();
        let whole = (0..slots.raid_disks()).all(|r| slots.working(r).is_some());
        if whole {
            if w.mode == SyncMode::Recover
                && let Err(e) = bm.sync_all_pages().await
            {
                tracing::error!(array = core.name(), "writing the bitmap to rebuilt members: {e}");
                return;
            }
            bm.end_sync(0..core.personality().sync_domain_sectors());
        }
    }
    let r = match (w.mode, completed) {
        (SyncMode::Resync, true) => {
            core.set_resync_checkpoint(MAX_SECTOR);
            core.update_superblocks("resync done").await
        }
        (SyncMode::Recover, true) => complete_recovery(core, targets).await,
        (SyncMode::Resync | SyncMode::Recover, false) if !core.is_shutting_down() => {
            core.update_superblocks("sync checkpoint").await
        }
        _ => Ok(()),
    };
    if let Err(e) = r {
        tracing::error!(array = core.name(), "recording the end of {}: {e}", w.mode.as_str());
    }
}

/// Rebuilt members become in sync; a finished replacement takes its role over and the member it
/// replaced is failed (md raid1_spare_active).
async fn complete_recovery(core: &Arc<ArrayCore>, targets: &[Arc<Member>]) -> io::Result<()> {
    let _m = core.membership.lock().await;
    let slots = core.slots();
    let mut t = (*slots).clone();
    for m in targets {
        if m.is_faulty() {
            continue;
        }
        let Some(role) = slots.role_of(m) else { continue };
        m.set(flag::IN_SYNC);
        m.clear(flag::BITMAP_RECOVERY);
        m.set_recovery_offset(MAX_SECTOR);
        if m.has(flag::REPLACEMENT) {
            m.clear(flag::REPLACEMENT);
            if let Some(old) = slots.slot(role).and_then(|s| s.member.clone()) {
                old.set(flag::FAULTY);
                t.remove(&old);
                t.add_faulty(old.clone());
                tracing::info!(
                    array = core.name(),
                    member = old.name(),
                    replacement = m.name(),
                    role,
                    "replacement complete"
                );
            }
            t.set_replacement(role, None);
            t.set_holder(role, Some(m.clone()));
        }
        tracing::info!(array = core.name(), member = m.name(), role, "recovery complete: member in sync");
    }
    core.set_slots(t);
    core.update_superblocks("recovery done").await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Right after a new mark the speed is still measured over seconds: a window reset used to
    /// leave a window of a millisecond, and the speed shown spiked to 60x the real one.
    #[test]
    fn the_speed_shown_after_a_new_mark_does_not_spike() {
        let t0 = Instant::now();
        let start = Mark { at: t0, pos: 0, io_sectors: 0 };
        let secs = |ms: u64| t0 + Duration::from_millis(ms);
        // 5000 KiB/s = 10000 sectors a second, marks every 3 s.
        let mut marks = [start; 2];
        for ms in (100..=9_000).step_by(100) {
            marks = Mark::advance(marks, Mark { at: secs(ms), pos: ms * 10, io_sectors: ms * 10 });
            let next = ms + 1;
            let shown = marks[0].shown_speed_kib(next * 10, secs(next));
            if ms >= 1_000 {
                assert!((4_000..=6_000).contains(&shown), "at {ms} ms: {shown} KiB/s shown");
            }
        }
        assert!(marks[0].at >= secs(3_000), "the older mark moves on");
    }

    /// A sync that ran at 20 MB/s, then met steady user I/O with `speed_min` 1000 KiB/s: it
    /// waits at most two mark steps, not until the speed over a window that never moved has
    /// fallen below the minimum (a minute; QA saw the resync stand still for 14-60 s).
    #[test]
    fn a_busy_array_holds_a_fast_sync_back_for_two_mark_steps_at_most() {
        let t0 = Instant::now();
        let start = Mark { at: t0, pos: 0, io_sectors: 0 };
        let mut p = Pacer { marks: [start; 2], io_sectors: 0, origin: 0, last_user_requests: 0 };
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // 3 s idle at 40000 sectors a second, under sync_speed_max 20000 KiB/s.
        for ms in (0..3_000).step_by(10) {
            assert_eq!(p.wait_before_io(at(ms), ms * 40, false, (1_000, 30_000)), None, "at {ms} ms");
            p.note_io(400);
        }
        let mut ms = 3_000;
        while p.wait_before_io(at(ms), ms * 40, true, (1_000, 30_000)).is_some() {
            ms += 50;
            assert!(ms <= 3_000 + 2 * MARK_STEP.as_millis() as u64 + 100, "still waiting at {ms} ms");
        }
        assert!(ms > 3_000, "the busy array held the sync back at first");
    }

    /// The pace counts I/O, not position: skipping clean ranges does not slow the sync.
    #[test]
    fn skipped_ranges_do_not_count_against_the_limit() {
        let t0 = Instant::now();
        let mark = Mark { at: t0, pos: 0, io_sectors: 0 };
        let now = t0 + Duration::from_secs(1);
        assert_eq!(mark.paced_speed_kib(4_000, now), 2_000, "4000 sectors of I/O over 1 s");
        assert_eq!(mark.shown_speed_kib(1 << 30, now), (1u64 << 30) / 2, "the position may race ahead");
    }
}
