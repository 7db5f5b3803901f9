//! [`ArrayCore`]: the level-independent state of a running array that personalities and the sync
//! engine work against: the members (slot table), member failure, the superblock writer's state,
//! the write gate, the region barrier, the bitmap, the resync checkpoint, the needs-check flag.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use super::barrier::RegionBarrier;
use super::behind::WriteBehind;
use super::bitmap::{BitmapMember, FailFn, WriteIntentBitmap};
use super::errors::{Clock, DEFAULT_MAX_READ_ERRORS, MonotonicClock};
use super::flush::FlushBatcher;
use super::gate::WriteGate;
use super::io::join_all;
use super::member::{Member, flag};
use super::personality::Personality;
use super::sb::SbState;
use super::slots::SlotTable;
use super::sync::SyncState;
use crate::format::superblock::{MAX_SECTOR, MetadataVersion};
use crate::layout::Level;

/// Facts about the array that do not change while it runs (from the superblocks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayInfo {
    /// mdkit's name for the array ("md0"); used in every message.
    pub name: String,
    pub level: Level,
    pub raid_disks: u32,
    /// The superblock's layout word.
    pub layout: u32,
    pub chunk_sectors: u32,
    /// The superblock's `size`: per-member sectors used (0 for raid0).
    pub member_size_sectors: u64,
    pub uuid: [u8; 16],
    /// The superblock's `set_name` ("host:name").
    pub set_name: String,
    /// Creation time, md encoding.
    pub ctime: u64,
    pub metadata: MetadataVersion,
}

/// See the module documentation. Shared (`Arc`) by the array handle, its background tasks and
/// every request in flight.
pub struct ArrayCore {
    info: ArrayInfo,
    pers: Arc<dyn Personality>,
    slots: RwLock<Arc<SlotTable>>,
    /// Serialises membership changes (add, remove, spare activation, replacement completion).
    pub(crate) membership: tokio::sync::Mutex<()>,
    /// Serialises the "may this member fail?" decision.
    fail_lock: Mutex<()>,
    pub(crate) gate: WriteGate,
    /// Region barrier over the sync domain: user writes vs sync work.
    pub barrier: RegionBarrier,
    pub(crate) sb: SbState,
    /// The write-intent bitmap (`array/bitmap.rs`), when the array has one.
    pub bitmap: Option<WriteIntentBitmap>,
    /// raid1 writes still outstanding to write-mostly members (`array/behind.rs`).
    pub behind: WriteBehind,
    /// The `Arc` this core lives in (set by `Array::start`): behind writes outlive the request.
    me: OnceLock<Weak<ArrayCore>>,
    /// One member-flush round serves every flush that arrived before it.
    pub flusher: FlushBatcher,
    /// Sync domain below this is known in sync; [`MAX_SECTOR`] when the whole array is.
    resync_cp: AtomicU64,
    failures_noted: AtomicU64,
    failures_recorded: AtomicU64,
    needs_check: Mutex<Option<String>>,
    needs_check_flag: AtomicBool,
    broken: AtomicBool,
    /// Why the array is broken (for `detail` / `status`).
    broken_reason: Mutex<Option<String>>,
    /// User reads answered with an error because no member could supply or rebuild the data.
    unrecoverable_reads: AtomicU64,
    pub(crate) sync: SyncState,
    /// Wakes the array daemon (safe mode, failure recording) and the sync engine.
    pub(crate) wake: Notify,
    pub(crate) sync_wake: Notify,
    shutdown: AtomicBool,
    user_requests: AtomicU64,
    /// md's `max_read_errors` (raid1/raid10).
    max_read_errors: AtomicU64,
    /// Time for the read-error policy (replaceable in tests).
    clock: RwLock<Arc<dyn Clock>>,
}

impl ArrayCore {
    pub(crate) fn new(
        info: ArrayInfo,
        pers: Arc<dyn Personality>,
        slots: SlotTable,
        events: u64,
        resync_cp: u64,
        bitmap: Option<WriteIntentBitmap>,
    ) -> ArrayCore {
        ArrayCore {
            info,
            pers,
            slots: RwLock::new(Arc::new(slots)),
            membership: tokio::sync::Mutex::new(()),
            fail_lock: Mutex::new(()),
            gate: WriteGate::new(false),
            barrier: RegionBarrier::new(),
            sb: SbState::new(events),
            bitmap,
            behind: WriteBehind::new(),
            me: OnceLock::new(),
            flusher: FlushBatcher::new(),
            resync_cp: AtomicU64::new(resync_cp),
            failures_noted: AtomicU64::new(0),
            failures_recorded: AtomicU64::new(0),
            needs_check: Mutex::new(None),
            needs_check_flag: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            broken_reason: Mutex::new(None),
            unrecoverable_reads: AtomicU64::new(0),
            sync: SyncState::new(),
            wake: Notify::new(),
            sync_wake: Notify::new(),
            shutdown: AtomicBool::new(false),
            user_requests: AtomicU64::new(0),
            max_read_errors: AtomicU64::new(DEFAULT_MAX_READ_ERRORS),
            clock: RwLock::new(Arc::new(MonotonicClock::default())),
        }
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Records the `Arc` holding this core (once, by `Array::start`).
    pub(crate) fn set_arc(self: &Arc<Self>) {
        let _ = self.me.set(Arc::downgrade(self));
    }

    /// The `Arc` holding this core, for work that outlives a request (behind writes); `None`
    /// before `Array::start` or once the array is gone.
    pub(crate) fn arc(&self) -> Option<Arc<ArrayCore>> {
        self.me.get().and_then(Weak::upgrade)
    }

    /// md's write-behind limit for this write: the bitmap's `write_behind` when the array has
    /// a bitmap and the write may be done behind (not FUA); `None` otherwise.
    pub(crate) fn write_behind_limit(&self, fua: bool) -> Option<u64> {
        let n = self.bitmap.as_ref()?.write_behind();
        (n > 0 && !fua).then_some(u64::from(n))
    }

    pub fn info(&self) -> &ArrayInfo {
        &self.info
    }

    pub fn personality(&self) -> &Arc<dyn Personality> {
        &self.pers
    }

    /// The current membership snapshot.
    pub fn slots(&self) -> Arc<SlotTable> {
        self.slots.read().clone()
    }

    /// Installs a new membership table (hold [`ArrayCore::membership`]).
    pub(crate) fn set_slots(&self, t: SlotTable) {
        *self.slots.write() = Arc::new(t);
    }

    /// Sync domain below this is in sync ([`MAX_SECTOR`] when all of it is).
    pub fn resync_checkpoint(&self) -> u64 {
        self.resync_cp.load(Ordering::Acquire)
    }

    pub(crate) fn set_resync_checkpoint(&self, sectors: u64) {
        self.resync_cp.store(sectors, Ordering::Release);
    }

    /// Whether copies of the sync-domain range `[.., end)` may differ (an unfinished resync):
    /// mirrored reads there must all go to the same (first) copy so repeated reads agree.
    pub fn may_be_unsynced(&self, end_sector: u64) -> bool {
        let cp = self.resync_checkpoint();
        cp != MAX_SECTOR && end_sector > cp
    }

    pub fn degraded(&self) -> u32 {
        self.pers.degraded(&self.slots())
    }

    /// The metadata could not be written: the array refuses writes until checked.
    pub fn needs_check(&self) -> Option<String> {
        if !self.needs_check_flag.load(Ordering::Acquire) {
            return None;
        }
        self.needs_check.lock().clone()
    }

    pub(crate) fn set_needs_check(&self, reason: String) {
        tracing::error!(array = self.name(), "array needs a check, writes stopped: {reason}");
        let mut g = self.needs_check.lock();
        if g.is_none() {
            *g = Some(reason);
        }
        self.needs_check_flag.store(true, Ordering::Release);
    }

    /// md's `broken`: raid0 lost a member, or a member the array cannot run without failed an
    /// I/O (it is kept, the I/O failed). Writes are refused from then on, as md does.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Why the array is broken, once it is.
    pub fn broken_reason(&self) -> Option<String> {
        self.broken_reason.lock().clone()
    }

    /// Marks the array broken (first reason kept, logged once).
    fn set_broken(&self, m: &Member, why: &str) {
        let mut g = self.broken_reason.lock();
        if g.is_none() {
            *g = Some(format!("member {}: {why}", m.name()));
        }
        drop(g);
        if !self.broken.swap(true, Ordering::AcqRel) {
            tracing::error!(array = self.name(), member = m.name(), "array broken, writes are refused: {why}");
        }
    }

    /// Counts a user read that failed because the data could neither be read nor rebuilt.
    pub(crate) fn note_unrecoverable_read(&self) {
        self.unrecoverable_reads.fetch_add(1, Ordering::Relaxed);
    }

    /// User reads answered with an error because the data could neither be read nor rebuilt.
    pub fn unrecoverable_reads(&self) -> u64 {
        self.unrecoverable_reads.load(Ordering::Relaxed)
    }

    /// The sync or reshape engine's last error, if any.
    pub(crate) fn sync_status_error(&self) -> Option<String> {
        self.sync.status().last_error
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    pub(crate) fn begin_shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        self.wake.notify_one();
        self.sync_wake.notify_one();
        self.sync.interrupt();
    }

    pub(crate) fn note_user_request(&self) {
        self.user_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// User requests seen so far (the sync engine yields while this moves).
    pub fn user_requests(&self) -> u64 {
        self.user_requests.load(Ordering::Relaxed)
    }

    //--------------------------------------------------------------------------------------------
    // Read-error policy (errors.rs)

    /// md's `max_read_errors`: a raid1/raid10 member with more read-error fix attempts (decayed)
    /// is failed instead of repaired.
    pub fn max_read_errors(&self) -> u64 {
        self.max_read_errors.load(Ordering::Relaxed)
    }

    pub fn set_max_read_errors(&self, n: u64) {
        self.max_read_errors.store(n, Ordering::Relaxed);
    }

    /// Replaces the clock the read-error policy uses (tests move a [`super::ManualClock`]).
    pub fn set_clock(&self, clock: Arc<dyn Clock>) {
        *self.clock.write() = clock;
    }

    /// The read-error policy's clock.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.read().clone()
    }

    pub(crate) fn now_secs(&self) -> u64 {
        self.clock.read().now().as_secs()
    }

    /// md's exceed_read_errors (raid1/raid10): counts an attempt to fix a read error on `m`;
    /// when the decayed count passes `max_read_errors` the member is failed (if the array can
    /// run without it). Returns whether the read error should still be repaired.
    pub(crate) fn may_fix_read_error(&self, m: &Member) -> bool {
        let n = m.note_fix_attempt(self.now_secs());
        let max = self.max_read_errors();
        if n <= max {
            return true;
        }
        self.fail_member_on_error(
            m,
            &format!("read error not corrected: {n} read errors exceed max_read_errors {max}"),
        );
        false
    }

    /// raid4/5/6: `failed_in_a_row` failed reads of `m` since its last good one; more than the
    /// personality's limit (the stripe cache size) fails the member.
    pub(crate) fn check_read_error_limit(&self, m: &Member, failed_in_a_row: u64) {
        if let Some(limit) = self.pers.read_error_limit()
            && failed_in_a_row > limit
            && !m.is_faulty()
        {
            self.fail_member_on_error(
                m,
                &format!(
                    "too many read errors: {failed_in_a_row} failed reads in a row exceed {limit} (stripe_cache_size)"
                ),
            );
        }
    }

    //--------------------------------------------------------------------------------------------
    // Member failure

    /// [`ArrayCore::fail_member`] for an I/O error: when the member is the last one the array
    /// needs it is kept and the array is marked broken (md_error on raid1/raid10's last copy).
    pub fn fail_member_on_error(&self, m: &Member, reason: &str) -> bool {
        if self.fail_member(m, reason) {
            return true;
        }
        self.set_broken(m, &format!("the last member holding some data failed an I/O: {reason}"));
        false
    }

    /// Fails `m` (md's Faulty) because of `reason`: it is never used again and a superblock
    /// update recording the failure is scheduled; user writes completed after this point are
    /// acknowledged only once that update is durable ([`ArrayCore::settle_failures`]).
    ///
    /// Like md, the last member the array cannot run without is not failed (the I/O error goes
    /// to the user instead), and a level without redundancy marks the array broken. Returns
    /// whether the member is now faulty.
    pub fn fail_member(&self, m: &Member, reason: &str) -> bool {
        self.fail_member_inner(m, reason, true)
    }

    /// raid4/5/6's md_error (raid5.c raid5_error): the member is failed even when the array
    /// cannot run without it; the array is then broken (md's MD_BROKEN, "Cannot continue
    /// operation"): writes are refused and reads that need the member fail.
    pub(crate) fn fail_member_beyond_redundancy(&self, m: &Member, reason: &str) {
        if !self.fail_member_inner(m, reason, false) {
            return;
        }
        if !self.pers.can_run(&self.slots()) {
            self.set_broken(m, &format!("more members failed than the level's redundancy: {reason}"));
        }
    }

    fn fail_member_inner(&self, m: &Member, reason: &str, keep_last: bool) -> bool {
        if m.is_faulty() {
            return true;
        }
        if !self.pers.has_redundancy() {
            self.set_broken(m, &format!("member I/O error on a level without redundancy: {reason}"));
            return false;
        }
        let _g = self.fail_lock.lock();
        if m.is_faulty() {
            return true;
        }
        let slots = self.slots();
        let holds_data = slots.role_of(m).is_some() && m.is_in_sync();
        if keep_last && holds_data && !self.pers.can_run(&slots.without(m)) {
            tracing::error!(
                array = self.name(),
                member = m.name(),
                "not failing the last member the array needs; the I/O fails instead: {reason}"
            );
            return false;
        }
        m.set_fail_reason(reason);
        m.set(flag::FAULTY);
        self.failures_noted.fetch_add(1, Ordering::AcqRel);
        tracing::warn!(
            array = self.name(),
            member = m.name(),
            degraded = self.pers.degraded(&self.slots()),
            "member failed: {reason}"
        );
        // A recovery onto this member, or from it, must stop; the engine re-plans.
        self.sync.interrupt_recovery();
        self.wake.notify_one();
        true
    }

    /// Waits until every member failure noted so far is recorded in durable superblocks.
    /// User writes call this before they are acknowledged (a crash must not reassemble a member
    /// that missed an acknowledged write as in sync).
    pub async fn settle_failures(&self) -> io::Result<()> {
        let noted = self.failures_noted.load(Ordering::Acquire);
        if self.failures_recorded.load(Ordering::Acquire) >= noted {
            return Ok(());
        }
        self.update_superblocks("member failure").await?;
        if self.failures_recorded.load(Ordering::Acquire) >= noted {
            Ok(())
        } else {
            Err(io::Error::other(format!("{}: a member failure could not be recorded in the superblocks", self.name())))
        }
    }

    pub(crate) fn failures_noted(&self) -> u64 {
        self.failures_noted.load(Ordering::Acquire)
    }

    pub(crate) fn record_failures_up_to(&self, noted: u64) {
        self.failures_recorded.fetch_max(noted, Ordering::AcqRel);
    }

    pub(crate) fn failures_pending(&self) -> bool {
        self.failures_recorded.load(Ordering::Acquire) < self.failures_noted.load(Ordering::Acquire)
    }

    //--------------------------------------------------------------------------------------------
    // Bitmap

    /// The bitmap's view of the membership: every working member (spares too, so a spare's
    /// copy is current before it takes a role). The bitmap reports failures by `dev_number`.
    pub(crate) fn bitmap_members(&self, slots: &SlotTable) -> Vec<BitmapMember> {
        slots
            .working_members()
            .iter()
            .filter_map(|m| BitmapMember::from_superblock(m.dev_number, m.device().clone(), &m.superblock()).ok())
            .collect()
    }

    /// Brings the bitmap's member set and degraded flag up to date (after membership or state
    /// changes; the superblock writer calls it every round).
    pub(crate) fn refresh_bitmap(&self) {
        if let Some(bm) = &self.bitmap {
            let slots = self.slots();
            bm.set_members(self.bitmap_members(&slots));
            bm.set_degraded(slots.missing_in_sync() > 0);
        }
    }

    //--------------------------------------------------------------------------------------------
    // Flush

    /// Flushes every working member (batched: one round serves every flush that arrived before
    /// it started). A member whose flush fails is failed; the flush succeeds when the array can
    /// still run and the failures are recorded.
    pub async fn flush_members(&self) -> io::Result<()> {
        // Write-behind: the flush covers the write-mostly members too, so it waits for every
        // behind write acknowledged before it.
        self.behind.drain().await;
        self.flusher.flush(|| self.flush_round()).await
    }

    async fn flush_round(&self) -> io::Result<()> {
        let slots = self.slots();
        let members = slots.working_members();
        let results = join_all(members.iter().map(|m| self.member_flush(m))).await;
        let mut first_err = None;
        for r in results {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            let slots = self.slots();
            if !self.pers.has_redundancy() || !self.pers.can_run(&slots) || slots.working_members().is_empty() {
                return Err(e);
            }
            // Members that failed the flush are out of the array once this is durable.
            self.settle_failures().await?;
            if !self.pers.can_run(&self.slots()) {
                return Err(e);
            }
        }
        Ok(())
    }

    //--------------------------------------------------------------------------------------------
    // Dirty / clean

    /// Write-gate slow path: mark the array active on every member (durably), then count the
    /// write. Returns with the write counted in the gate.
    pub(crate) async fn enter_write_gate(&self) -> io::Result<()> {
        if self.gate.try_enter() {
            return Ok(());
        }
        let _t = self.gate.transition.lock().await;
        if self.gate.try_enter() {
            return Ok(());
        }
        self.gate.want_active.store(true, Ordering::Release);
        // On failure the superblocks may say either; `want_active` stays set (the safe side).
        self.update_superblocks("array active").await?;
        self.gate.enter_after_transition();
        Ok(())
    }

    pub(crate) fn exit_write_gate(&self) {
        if self.gate.exit() {
            self.wake.notify_one();
        }
    }

    /// Marks the array clean if no write is in flight; called by the daemon after
    /// `safe_mode_delay` of idleness. Returns whether it did.
    pub(crate) async fn try_mark_clean(&self) -> io::Result<bool> {
        let _t = self.gate.transition.lock().await;
        if !self.gate.try_begin_clean() {
            return Ok(false);
        }
        self.gate.want_active.store(false, Ordering::Release);
        match self.update_superblocks("array clean").await {
            Ok(()) => Ok(true),
            Err(e) => {
                self.gate.want_active.store(true, Ordering::Release);
                self.gate.abort_clean();
                Err(e)
            }
        }
    }
}

/// The bitmap's member-failure callback: fails the member with that `dev_number` in the array,
/// once the array exists (failures reported while the bitmap loads are applied at start).
#[derive(Default)]
pub(crate) struct BitmapFailSink {
    core: std::sync::OnceLock<std::sync::Weak<ArrayCore>>,
    early: Mutex<Vec<(u32, String)>>,
}

impl BitmapFailSink {
    pub(crate) fn fail_fn(self: &Arc<Self>) -> FailFn {
        let sink = self.clone();
        Arc::new(move |dev_number: u32, e: &io::Error| {
            sink.report(dev_number, format!("write-intent bitmap I/O failed: {e}"))
        })
    }

    fn report(&self, dev_number: u32, why: String) {
        match self.core.get().and_then(std::sync::Weak::upgrade) {
            Some(core) => {
                if let Some(m) = core.slots().all_members().into_iter().find(|m| m.dev_number == dev_number) {
                    core.fail_member_on_error(&m, &why);
                }
            }
            None => self.early.lock().push((dev_number, why)),
        }
    }

    /// Connects the sink to its array and applies what was reported before.
    pub(crate) fn attach(&self, core: &Arc<ArrayCore>) {
        let _ = self.core.set(Arc::downgrade(core));
        for (dev_number, why) in std::mem::take(&mut *self.early.lock()) {
            self.report(dev_number, why);
        }
    }
}
