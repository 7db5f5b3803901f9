//! The superblock writer (md_update_sb + super_1_sync).
//!
//! One *round* writes a new superblock to every working member: `events + 1`, `utime`,
//! `resync_offset` (0 while the array is active, else the resync checkpoint), `dev_roles`
//! (every member's role: slot, 0xfffe faulty, 0xffff spare/absent), and per member
//! `feature_map` / `recovery_offset` (RECOVERY_OFFSET while it rebuilds, REPLACEMENT when it
//! replaces), then the checksum — whole 4 KiB blocks, each member flushed first and the block
//! written FUA (md's PREFLUSH|FUA), all members concurrently, the bitmap superblock first. A member whose write fails is failed and another round records that; when
//! no member can be written (or the last one the array needs fails), the array stops writing and
//! reports needs-check.
//!
//! Rounds are serialised and coalesced: a request is satisfied by any round that *started*
//! after it was made, so many concurrent requests (failures, dirty/clean, checkpoints) share one
//! round.
//!
//! A member whose bad-block list changed gets its bad-block log written (FUA) right before its
//! superblock, which carries BAD_BLOCKS exactly when the list is non-empty (super_1_sync).
//!
//! The in-memory superblock is the array's intent; a round writes it. Other changes (a reshape
//! checkpoint's position, the finish's new geometry) are made in place
//! ([`Member::update_superblock`]) and then request a round. A round that ends keeps in memory
//! only the fields it derives itself ([`set_round_fields`]): a change made while it was in
//! flight stays, and the round it requested writes it. After a stopped array's last round no
//! round writes (a late task must not write over members that grow or the next assembly own).

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use mdkit_io::SharedBuf;

use super::core::ArrayCore;
use super::io::join_all;
use super::member::{Member, flag};
use super::slots::SlotTable;
use crate::format::badblocks::BadBlock;
use crate::format::superblock::{DEVFLAG_WRITE_MOSTLY, ROLE_FAULTY, ROLE_SPARE, Superblock, feature, md_time};

/// Serialisation and coalescing state of the superblock writer.
pub struct SbState {
    lock: tokio::sync::Mutex<()>,
    requested: AtomicU64,
    completed: AtomicU64,
    events: AtomicU64,
    rounds: AtomicU64,
    /// The "event count saturated" error was logged (once per assembly).
    saturated_logged: AtomicBool,
    /// The stopped array's last round was written: no round writes any more (its members
    /// belong to whatever opens them next, e.g. grow rewriting their superblocks).
    stopped: AtomicBool,
}

impl SbState {
    pub fn new(events: u64) -> SbState {
        SbState {
            lock: tokio::sync::Mutex::new(()),
            requested: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            events: AtomicU64::new(events),
            rounds: AtomicU64::new(0),
            saturated_logged: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// The stopped array's last round was written.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The array's event count (last round written).
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Acquire)
    }

    /// The event count for the next round: `events + 1`, saturating at `u64::MAX` like the
    /// kernel's md_update_sb (which undoes an increment that wrapped to 0, with a warning). A
    /// count that wrapped to 0 would make every member look stale to the next assembly; one
    /// at the maximum can only come from a damaged or crafted superblock.
    fn next_events(&self, array: &str) -> u64 {
        let events = self.events.load(Ordering::Acquire);
        events.checked_add(1).unwrap_or_else(|| {
            if !self.saturated_logged.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    array,
                    "event count is at its maximum (2^64-1) and stays there; re-create the array \
                     to reset it"
                );
            }
            u64::MAX
        })
    }

    /// Superblock rounds written since assembly.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }
}

enum RoundError {
    /// Some members failed their write and were failed: write another round.
    MembersFailed,
    /// The metadata cannot be written.
    Fatal(String),
}

/// The update time as the kernel writes it (super_1_sync: `mddev->utime`, whole seconds from
/// ktime_get_real_seconds): the field's upper 24 "microseconds" bits stay zero. The kernel
/// loads utime unmasked and reports it through a 32-bit field, so microseconds written there
/// show in `mdadm --detail` of a running array as an update time in 2106.
pub(crate) fn now_md_time() -> u64 {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    md_time(d.as_secs(), 0)
}

/// `dev_roles` for the current membership (super_1_sync).
pub(crate) fn dev_roles(slots: &SlotTable, min_max_dev: usize) -> Vec<u16> {
    let members = slots.all_members();
    let max_dev = members.iter().map(|m| m.dev_number as usize + 1).max().unwrap_or(0).max(min_max_dev);
    let mut roles = vec![ROLE_SPARE; max_dev];
    for m in &members {
        let role = if m.is_faulty() {
            ROLE_FAULTY
        } else if let Some(r) = slots.role_of(m) {
            r as u16
        } else {
            ROLE_SPARE
        };
        roles[m.dev_number as usize] = role;
    }
    roles
}

/// What one round writes to every member, beside each member's own state.
pub(crate) struct Round<'a> {
    pub slots: &'a SlotTable,
    pub roles: &'a [u16],
    pub events: u64,
    pub utime: u64,
    pub resync_offset: u64,
}

/// Member `m`'s superblock for a round.
pub(crate) fn compose(m: &Member, round: &Round<'_>) -> Superblock {
    let mut sb = m.superblock();
    set_round_fields(&mut sb, m, round);
    sb
}

/// Sets on `sb` the fields a round derives from the array's and the member's state (md's
/// super_1_sync); every other field stays as it is. A round composes its superblocks with it,
/// and applies it again to the in-memory superblock when the write ended: storing the composed
/// superblock whole would undo a change made while the round was in flight (a reshape
/// checkpoint records its position while a clean/dirty round is flushing), and the
/// checkpoint's own round would then write the old position while the engine went on as if
/// the new one were recorded.
fn set_round_fields(sb: &mut Superblock, m: &Member, round: &Round<'_>) {
    let &Round { slots, roles, events, utime, resync_offset } = round;
    sb.events = events;
    sb.utime = utime;
    sb.resync_offset_sectors = resync_offset;
    sb.dev_roles = roles.to_vec();
    sb.cnt_corrected_read = m.corrected_reads();
    // WriteMostly1 follows the member flag (super_1_sync), so setting it at run time persists.
    if m.has(flag::WRITE_MOSTLY) {
        sb.devflags |= DEVFLAG_WRITE_MOSTLY;
    } else {
        sb.devflags &= !DEVFLAG_WRITE_MOSTLY;
    }
    let mut fm = sb.feature_map & !(feature::RECOVERY_OFFSET | feature::REPLACEMENT | feature::RECOVERY_BITMAP);
    sb.recovery_offset_sectors = 0;
    if slots.role_of(m).is_some() && !m.has(flag::IN_SYNC) {
        fm |= feature::RECOVERY_OFFSET;
        sb.recovery_offset_sectors = m.recovery_offset().min(sb.data_size_sectors);
    }
    if m.has(flag::REPLACEMENT) && slots.role_of(m).is_some() {
        fm |= feature::REPLACEMENT;
    }
    let bb = m.bad_blocks();
    if bb.has_log() {
        fm &= !feature::BAD_BLOCKS;
        if !bb.is_empty() {
            fm |= feature::BAD_BLOCKS;
        }
    }
    sb.feature_map = fm;
}

/// Marks the array stopped when the last round ends, however it ends.
struct StopAfter<'a>(&'a AtomicBool);

impl Drop for StopAfter<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

impl ArrayCore {
    /// Writes a superblock round covering everything requested before this call (see the
    /// module documentation). `why` is for the log.
    pub async fn update_superblocks(&self, why: &str) -> io::Result<()> {
        self.superblock_round(why, false).await
    }

    /// Holds superblock rounds off until the guard drops. A round resets the bitmap's member
    /// list from the slot table, so a member being added (its bitmap copy and superblock written
    /// before it enters the table) would lose its copy mid-write.
    pub(crate) async fn hold_rounds(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.sb.lock.lock().await
    }

    /// The last round of a stopping array; every later round is refused (a task still holding
    /// the stopped core must not write over what the members hold next).
    pub(crate) async fn last_superblocks(&self, why: &str) -> io::Result<()> {
        self.superblock_round(why, true).await
    }

    async fn superblock_round(&self, why: &str, last: bool) -> io::Result<()> {
        if let Some(reason) = self.needs_check() {
            return Err(io::Error::other(format!(
                "{}: array needs a check, metadata writes stopped: {reason}",
                self.name()
            )));
        }
        let ticket = self.sb.requested.fetch_add(1, Ordering::AcqRel) + 1;
        let _g = self.sb.lock.lock().await;
        if self.sb.stopped.load(Ordering::Acquire) {
            if last {
                return Ok(()); // two stops at once: the other one wrote the last round
            }
            return Err(io::Error::other(format!(
                "{}: stopped, superblocks are no longer written ({why})",
                self.name()
            )));
        }
        // Set while the lock is held, so no round starts between the last one and the flag.
        let _stop = last.then(|| StopAfter(&self.sb.stopped));
        if self.sb.completed.load(Ordering::Acquire) >= ticket {
            return Ok(());
        }
        let covers = self.sb.requested.load(Ordering::Acquire);
        // Bounded: each retry fails at least one more member.
        for _ in 0..=crate::format::create::MAX_DEVICES {
            let noted = self.failures_noted();
            match self.write_round(why).await {
                Ok(()) => {
                    self.record_failures_up_to(noted);
                    self.sb.completed.fetch_max(covers, Ordering::AcqRel);
                    return Ok(());
                }
                Err(RoundError::MembersFailed) => continue,
                Err(RoundError::Fatal(reason)) => {
                    self.set_needs_check(reason.clone());
                    return Err(io::Error::other(format!(
                        "{}: superblock update ({why}) failed: {reason}",
                        self.name()
                    )));
                }
            }
        }
        let reason = "superblock writes kept failing".to_string();
        self.set_needs_check(reason.clone());
        Err(io::Error::other(format!("{}: {reason}", self.name())))
    }

    async fn write_round(&self, why: &str) -> Result<(), RoundError> {
        let slots = self.slots();
        let members = slots.working_members();
        if members.is_empty() {
            return Err(RoundError::Fatal("no working member left to write superblocks to".into()));
        }
        let events = self.sb.next_events(self.name());
        let utime = now_md_time();
        let resync_offset = if self.gate.want_active.load(Ordering::Acquire) { 0 } else { self.resync_checkpoint() };
        let min_max_dev = members.iter().map(|m| m.superblock().max_dev() as usize).max().unwrap_or(0);
        let roles = dev_roles(&slots, min_max_dev);
        let round = Round { slots: &slots, roles: &roles, events, utime, resync_offset };
        let mut failed: Vec<(Arc<Member>, String)> = Vec::new();

        // Bitmap superblock first (md_update_sb: md_bitmap_update_sb before the md superblocks).
        // Members whose bitmap write fails are failed through the bitmap's callback.
        if let Some(bm) = &self.bitmap {
            self.refresh_bitmap();
            if let Err(e) = bm.update_superblock(events).await {
                return Err(RoundError::Fatal(format!("bitmap superblock: {e}")));
            }
            let members_now = self.slots().working_members();
            for m in &members {
                if !members_now.iter().any(|x| Arc::ptr_eq(x, m)) || m.is_faulty() {
                    failed.push((m.clone(), "its bitmap write failed".into()));
                }
            }
        }
        let mut blocks = Vec::with_capacity(members.len());
        // Bad-block logs that changed, snapshotted before composing so BAD_BLOCKS matches them.
        let logs: Vec<Option<(Vec<BadBlock>, u64)>> =
            members.iter().map(|m| m.bad_blocks().is_dirty().then(|| m.bad_blocks().snapshot())).collect();
        for m in &members {
            let sb = compose(m, &round);
            let block = sb
                .encode()
                .map_err(|e| RoundError::Fatal(format!("member {}: superblock does not encode: {e}", m.name())))?;
            blocks.push(SharedBuf::from_slice(&block));
        }
        // Flush every member, then write the superblocks FUA. md_super_write puts REQ_PREFLUSH |
        // REQ_FUA on each member's superblock write, which orders a member's superblock after
        // *its own* data only; a superblock that says "clean" (or advances a checkpoint) vouches
        // for the data on all members (parity, mirrors), so no member's new superblock may reach
        // the medium before every member's data has: otherwise a power cut right after the
        // first member's "clean" landed leaves the others' unflushed writes torn under an array
        // that assembles as clean (the kernel's way out is to roll the event count back on a
        // dirty -> clean transition, so a mix of old and new superblocks reads as dirty).
        let flushed = join_all(members.iter().map(|m| async move {
            m.device().flush().await.map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("{}: member {}: flush before the superblock: {e}", self.name(), m.name()),
                )
            })
        }))
        .await;
        let results = join_all(members.iter().zip(&blocks).zip(flushed).zip(&logs).map(
            |(((m, buf), flushed), log)| async move {
                flushed?;
                // The log before the superblock that says it holds entries (BAD_BLOCKS).
                if let Some((entries, _)) = log {
                    self.write_bblog(m, entries).await?;
                }
                self.member_write_meta(m, m.super_offset_sectors * 512, buf.clone()).await
            },
        ))
        .await;
        let mut written = 0usize;
        for ((m, r), log) in members.iter().zip(results).zip(&logs) {
            match r {
                Ok(()) if !failed.iter().any(|(f, _)| Arc::ptr_eq(f, m)) => {
                    if let Some((_, generation)) = log {
                        m.bad_blocks().mark_written(*generation);
                    }
                    m.update_superblock(|cur| {
                        set_round_fields(cur, m, &round);
                        cur.sb_csum = crate::format::superblock::sb_checksum(&cur.encode_unchecked(), cur.max_dev());
                    });
                    written += 1;
                }
                Ok(()) => {}
                Err(e) => failed.push((m.clone(), e.to_string())),
            }
        }
        self.sb.events.store(events, Ordering::Release);
        self.sb.rounds.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(array = self.name(), events, why, written, failed = failed.len(), "superblocks written");
        if failed.is_empty() {
            if let Some(bm) = &self.bitmap {
                bm.superblocks_recorded(events);
            }
            return Ok(());
        }
        for (m, e) in &failed {
            if !self.fail_member_on_error(m, &format!("superblock write failed: {e}")) {
                return Err(RoundError::Fatal(format!(
                    "member {} cannot be failed (the array needs it) and its superblock write failed: {e}",
                    m.name()
                )));
            }
        }
        if written == 0 {
            return Err(RoundError::Fatal("no member accepted the superblock write".into()));
        }
        Err(RoundError::MembersFailed)
    }
}

#[cfg(test)]
mod tests {
    use mdkit_io::MemDevice;

    use super::*;
    use crate::format::superblock::MAX_SECTOR;

    fn member(name: &str, dev_number: u32) -> Arc<Member> {
        let mut sb = Superblock::empty();
        sb.dev_number = dev_number;
        sb.data_size_sectors = 1000;
        sb.feature_map = feature::BITMAP_OFFSET | feature::RECOVERY_OFFSET;
        sb.dev_roles = vec![ROLE_SPARE; 4];
        Arc::new(Member::new(name, Arc::new(MemDevice::new(name, 1 << 20)), sb))
    }

    #[test]
    fn roles_and_recovery_fields() {
        let mut t = SlotTable::new(2);
        let a = member("a", 0);
        let b = member("b", 1);
        let c = member("c", 5);
        let f = member("f", 2);
        a.set(flag::IN_SYNC);
        b.set_recovery_offset(300);
        f.set(flag::FAULTY);
        t.set_holder(0, Some(a.clone()));
        t.set_holder(1, Some(b.clone()));
        t.add_spare(c.clone());
        t.add_faulty(f.clone());
        let roles = dev_roles(&t, 4);
        assert_eq!(roles, vec![0, 1, ROLE_FAULTY, ROLE_SPARE, ROLE_SPARE, ROLE_SPARE]);
        let round = |resync_offset| Round { slots: &t, roles: &roles, events: 7, utime: 1, resync_offset };
        let sa = compose(&a, &round(MAX_SECTOR));
        assert_eq!(sa.feature_map, feature::BITMAP_OFFSET, "in-sync member: no RECOVERY_OFFSET");
        assert_eq!((sa.events, sa.recovery_offset_sectors), (7, 0));
        let sb = compose(&b, &round(0));
        assert_eq!(sb.feature_map, feature::BITMAP_OFFSET | feature::RECOVERY_OFFSET);
        assert_eq!(sb.recovery_offset_sectors, 300);
        let sc = compose(&c, &round(0));
        assert_eq!(sc.feature_map & feature::RECOVERY_OFFSET, 0, "spare: no recovery");
    }

    /// A clean raid1 over `first` and a 4 MiB RAM member.
    async fn mirror_over(first: Arc<dyn mdkit_io::BlockDevice>, bitmap: bool) -> crate::array::Array {
        let name = first.name().to_string();
        let devs = vec![
            crate::array::MemberDev::new(name, first),
            crate::array::MemberDev::new("m1", Arc::new(MemDevice::new("m1", 4 << 20))),
        ];
        let mut o = crate::array::CreateOptions::new("md-test", crate::layout::Level::Raid1, 2);
        o.assume_clean = true;
        if bitmap {
            o.bitmap = crate::format::create::BitmapRequest::Internal { chunk_bytes: Some(64 << 10) };
        }
        crate::array::create(devs, o).await.unwrap().array
    }

    /// A member whose next flush, or next write starting in a byte range, once armed, says it
    /// started and waits until released.
    #[derive(Default)]
    struct Gated {
        inner: Option<MemDevice>,
        flush_armed: std::sync::atomic::AtomicBool,
        write_armed: parking_lot::Mutex<Option<std::ops::Range<u64>>>,
        hit: tokio::sync::Notify,
        release: tokio::sync::Notify,
    }

    impl Gated {
        fn new(name: &str) -> Arc<Gated> {
            Arc::new(Gated { inner: Some(MemDevice::new(name, 4 << 20)), ..Default::default() })
        }
        fn inner(&self) -> &MemDevice {
            self.inner.as_ref().expect("a device")
        }
        async fn wait_if(&self, armed: bool) {
            if armed {
                self.hit.notify_one();
                self.release.notified().await;
            }
        }
    }

    impl mdkit_io::BlockDevice for Gated {
        fn name(&self) -> &str {
            self.inner().name()
        }
        fn topology(&self) -> mdkit_io::Topology {
            self.inner().topology()
        }
        fn read(&self, offset_bytes: u64, buf: mdkit_io::IoBuf) -> mdkit_io::IoFuture<'_, mdkit_io::ReadResult> {
            self.inner().read(offset_bytes, buf)
        }
        fn write(
            &self,
            offset_bytes: u64,
            buf: SharedBuf,
            flags: mdkit_io::WriteFlags,
        ) -> mdkit_io::IoFuture<'_, io::Result<()>> {
            Box::pin(async move {
                let armed = {
                    let mut w = self.write_armed.lock();
                    w.take_if(|r| r.contains(&offset_bytes)).is_some()
                };
                self.wait_if(armed).await;
                self.inner().write(offset_bytes, buf, flags).await
            })
        }
        fn flush(&self) -> mdkit_io::IoFuture<'_, io::Result<()>> {
            Box::pin(async move {
                self.wait_if(self.flush_armed.swap(false, Ordering::AcqRel)).await;
                self.inner().flush().await
            })
        }
        fn discard(&self, offset_bytes: u64, len_bytes: u64) -> mdkit_io::IoFuture<'_, io::Result<()>> {
            self.inner().discard(offset_bytes, len_bytes)
        }
        fn write_zeroes(
            &self,
            offset_bytes: u64,
            len_bytes: u64,
            flags: mdkit_io::ZeroFlags,
        ) -> mdkit_io::IoFuture<'_, io::Result<()>> {
            self.inner().write_zeroes(offset_bytes, len_bytes, flags)
        }
    }

    /// A superblock change made while a round is in flight (a reshape checkpoint recording its
    /// position while a clean/dirty round flushes) survives that round and is written by the
    /// next. The round used to store back the superblock it had composed, undoing the change:
    /// the checkpoint's own round then wrote the old position while the reshape went on as if
    /// the new one were recorded, and a crash brought the array back at the old one, over old
    /// rows the reshape had already overwritten (a reshape crash-test failure under load).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_made_during_a_round_is_kept_and_written_by_the_next() {
        let gated = Gated::new("g0");
        let a = mirror_over(gated.clone(), false).await;
        let core = a.core();
        core.update_superblocks("settle").await.unwrap();
        let m = core.slots().all_members().into_iter().find(|m| m.name() == "g0").unwrap();
        let before = m.superblock().new_level;

        gated.flush_armed.store(true, Ordering::Release);
        let round = tokio::spawn({
            let core = core.clone();
            async move { core.update_superblocks("in flight").await }
        });
        gated.hit.notified().await; // the round composed its superblocks and is flushing
        m.update_superblock(|sb| sb.new_level = before + 4);
        gated.release.notify_one();
        round.await.unwrap().unwrap();
        assert_eq!(m.superblock().new_level, before + 4, "the round undid a change made while it ran");

        core.update_superblocks("next").await.unwrap();
        let dev: mdkit_io::DeviceRef = gated.clone();
        let on_disk = crate::array::read_superblock(&dev).await.unwrap();
        assert_eq!(on_disk.new_level, before + 4, "the next round writes the change");
        assert_eq!(on_disk.events, m.superblock().events);
        a.stop().await.unwrap();
    }

    /// Once an array stopped, a task still holding its core writes no superblock (grow rewrites
    /// a stopped array's superblocks and assembles it again: a late round would undo that), and
    /// a second stop (a service closing an array a reshape's end just reassembled) is a no-op.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_array_writes_no_more_superblocks() {
        let mem = Arc::new(MemDevice::new("a", 4 << 20));
        let a = mirror_over(mem.clone(), false).await;
        let core = a.core();
        let (first, second) = tokio::join!(a.stop(), a.stop());
        first.and(second).expect("two stops at once both succeed");
        let image = mem.to_image();
        let e = core.update_superblocks("late").await.unwrap_err();
        assert!(e.to_string().contains("stopped"), "{e}");
        a.stop().await.expect("stopping a stopped array changes nothing");
        assert!(mem.to_image() == image, "nothing written after the stop");
    }

    /// A round run while `add_member` writes the new member's bitmap copy waits until the
    /// member is in place. It used to reset the bitmap's member list from the slot table,
    /// which did not hold the new member yet: a bitmap write queued behind one in flight then
    /// skipped it, and its superblock (FUA) pointed at a zeroed bitmap, so a power cut left the
    /// added member out ("bad bitmap magic 0", a grow crash test under load).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_round_beside_add_member_keeps_the_new_members_bitmap() {
        let gated = Gated::new("g0");
        let a = Arc::new(mirror_over(gated.clone(), true).await);
        let core = a.core();
        let dev: mdkit_io::DeviceRef = gated.clone();
        let sb = crate::array::read_superblock(&dev).await.unwrap();
        let bitmap_bytes = sb.bitmap_sector().unwrap() * 512;
        // A bitmap page round in flight, held on g0.
        *gated.write_armed.lock() = Some(bitmap_bytes..sb.data_offset_sectors * 512);
        let pages = tokio::spawn({
            let core = core.clone();
            async move { core.bitmap.as_ref().unwrap().sync_all_pages().await }
        });
        gated.hit.notified().await;
        // The new member's bitmap copy now waits behind it.
        let m2 = Gated::new("m2");
        *m2.write_armed.lock() = Some(sb.super_offset_sectors * 512..bitmap_bytes); // its superblock
        let spare: Arc<dyn mdkit_io::BlockDevice> = m2.clone();
        let add = tokio::spawn({
            let (a, spare) = (a.clone(), spare.clone());
            async move { a.add_member(crate::array::MemberDev::new("m2", spare)).await }
        });
        for polls in 0.. {
            if core.bitmap.as_ref().unwrap().members_len() == 3 {
                break; // add_member set the new member and waits for its copy
            }
            assert!(polls < 10_000, "add_member never reached the bitmap copy");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let mut round = tokio::spawn({
            let core = core.clone();
            async move { core.update_superblocks("beside add_member").await }
        });
        // Give the round a chance to run (it must wait for add_member: nothing asserts that it
        // did not finish here, only what the new member holds in the end).
        let early = tokio::time::timeout(std::time::Duration::from_millis(200), &mut round).await.ok();
        gated.release.notify_one();
        pages.await.unwrap().unwrap();
        // When the new member's superblock is written (FUA: a power cut may follow at once),
        // the bitmap it points at is complete.
        m2.hit.notified().await;
        let head = mdkit_io::BlockDeviceExt::read_vec(m2.inner(), bitmap_bytes, 4096).await.unwrap();
        let copied = crate::format::bitmap::BitmapSuper::decode(&head);
        m2.release.notify_one();
        copied.expect("the added member's bitmap copy is written before its superblock");
        add.await.unwrap().unwrap();
        match early {
            Some(r) => r.unwrap().unwrap(),
            None => round.await.unwrap().unwrap(),
        }
        a.stop().await.unwrap();
    }

    #[test]
    fn event_count_saturates_instead_of_wrapping() {
        let st = SbState::new(u64::MAX - 1);
        assert_eq!(st.next_events("md0"), u64::MAX);
        st.events.store(u64::MAX, Ordering::Release);
        assert_eq!(st.next_events("md0"), u64::MAX, "no wrap to 0");
        assert!(st.saturated_logged.load(Ordering::Relaxed));
    }

    #[test]
    fn corrected_reads_saturate() {
        let mut sb = Superblock::empty();
        sb.cnt_corrected_read = u32::MAX - 1;
        sb.dev_roles = vec![0];
        let m = Member::new("a", Arc::new(MemDevice::new("a", 1 << 20)), sb);
        m.note_corrected_sectors(1);
        m.note_corrected_sectors(1);
        assert_eq!(m.corrected_reads(), u32::MAX);
    }
}
