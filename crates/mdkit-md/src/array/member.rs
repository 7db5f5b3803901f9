//! One member device of a running array: its device, where its data lives, its state flags
//! (md's rdev flags), its recovery progress, and the in-flight counter that least-busy reads use.
//!
//! State changes are atomic flag updates on the member; which slot a member fills is decided by
//! the slot table (see `slots.rs`), swapped as a whole when membership changes.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use mdkit_io::DeviceRef;
use parking_lot::Mutex;

use super::badblocks::BadBlockList;
use super::errors::DecayingReadErrors;
use crate::format::superblock::{DEVFLAG_WRITE_MOSTLY, Superblock};

/// Member state bits (md rdev flags).
pub mod flag {
    /// Failed: never read or written again; recorded as 0xfffe in the superblocks.
    pub const FAULTY: u32 = 1;
    /// Holds valid data for its whole slot.
    pub const IN_SYNC: u32 = 2;
    /// Rebuilding to take over its slot from the current holder (md replacement).
    pub const REPLACEMENT: u32 = 4;
    /// Should be replaced by a spare as soon as one is available.
    pub const WANT_REPLACEMENT: u32 = 8;
    /// Read only when no other copy is readable (raid1 write-mostly).
    pub const WRITE_MOSTLY: u32 = 16;
    /// Re-added with a write-intent bitmap: only the chunks the bitmap says are needed are
    /// rebuilt (md's RECOVERY_BITMAP).
    pub const BITMAP_RECOVERY: u32 = 32;
    /// A write to this member failed and was recorded as a bad block (md's WriteErrorSeen,
    /// `dev-*/state` word `write_error`).
    pub const WRITE_ERROR_SEEN: u32 = 64;
}

/// One member device.
pub struct Member {
    name: String,
    dev: DeviceRef,
    /// Permanent index into `dev_roles` (the superblock's `dev_number`).
    pub dev_number: u32,
    /// Where member sector 0 is on the device: the superblock's `data_offset`, or during a
    /// reshape that moves data (NEW_OFFSET) the lower of the old and new data offsets.
    pub data_offset_sectors: u64,
    /// Sectors usable for data from `data_offset_sectors` (the superblock's `data_size`, plus
    /// the room a reshape moving data down gained).
    pub data_size_sectors: u64,
    /// During a reshape: member sector of the old geometry's start ...
    pub old_base_sectors: u64,
    /// ... and of the new geometry's start (both 0 without a reshape).
    pub new_base_sectors: u64,
    pub super_offset_sectors: u64,
    /// This member's own superblock as last written or read: the per-member fields the
    /// superblock writer starts from.
    sb: Mutex<Superblock>,
    state: AtomicU32,
    /// Member sectors already rebuilt while recovering (0 for a fresh spare; `MAX_SECTOR`
    /// once a rebuild completed). Only meaningful while the member is not in sync.
    recovery_offset_sectors: AtomicU64,
    in_flight: AtomicU32,
    /// Behind writes to this member not yet completed (write-behind): while any is, reads of
    /// the ranges they cover avoid it even if it stopped being write-mostly meanwhile.
    behind: AtomicU32,
    /// Member reads that failed (or came back short), ever (mdkit's counter).
    read_errors: AtomicU64,
    /// raid1/raid10: md's decaying `read_errors` (fix attempts).
    fix_attempts: DecayingReadErrors,
    /// raid4/5/6: md's `read_errors`: failed reads since the last successful one.
    consecutive_read_errors: AtomicU64,
    /// Sectors rewritten after a read error and read back correctly (md's `corrected_errors`,
    /// `dev-*/errors`, the superblock's `cnt_corrected_read`).
    corrected_reads: AtomicU32,
    /// Why the member was failed (for `detail`).
    fail_reason: Mutex<Option<String>>,
    /// Known-bad ranges (md's `rdev->badblocks`), persisted in the member's bad-block log.
    bad_blocks: BadBlockList,
}

/// Where member sector 0 of a geometry lies within a member's data area (a reshape runs two
/// geometries, the old one and the new one, at different data offsets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// At the member's data offset (no reshape).
    DataOffset,
    /// At the old geometry's start ([`Member::old_base_sectors`]).
    ReshapeOld,
    /// At the new geometry's start ([`Member::new_base_sectors`]).
    ReshapeNew,
}

impl Base {
    /// Sectors from the start of `m`'s data area to this geometry's member sector 0.
    pub fn of(self, m: &Member) -> u64 {
        match self {
            Base::DataOffset => 0,
            Base::ReshapeOld => m.old_base_sectors,
            Base::ReshapeNew => m.new_base_sectors,
        }
    }
}

impl Member {
    /// A member described by its superblock. State flags start empty (the assembler sets them).
    pub fn new(name: impl Into<String>, dev: DeviceRef, sb: Superblock) -> Member {
        let mut state = 0;
        if sb.devflags & DEVFLAG_WRITE_MOSTLY != 0 {
            state |= flag::WRITE_MOSTLY;
        }
        let old = sb.data_offset_sectors;
        let (data_offset_sectors, data_size_sectors, old_base_sectors, new_base_sectors) =
            match sb.new_data_offset_sectors() {
                Some(new) if new < old => (new, sb.data_size_sectors + (old - new), old - new, 0),
                Some(new) => (old, sb.data_size_sectors, 0, new - old),
                None => (old, sb.data_size_sectors, 0, 0),
            };
        Member {
            name: name.into(),
            dev,
            dev_number: sb.dev_number,
            data_offset_sectors,
            data_size_sectors,
            old_base_sectors,
            new_base_sectors,
            super_offset_sectors: sb.super_offset_sectors,
            corrected_reads: AtomicU32::new(sb.cnt_corrected_read),
            bad_blocks: BadBlockList::for_superblock(&sb),
            sb: Mutex::new(sb),
            state: AtomicU32::new(state),
            recovery_offset_sectors: AtomicU64::new(0),
            in_flight: AtomicU32::new(0),
            behind: AtomicU32::new(0),
            read_errors: AtomicU64::new(0),
            fix_attempts: DecayingReadErrors::default(),
            consecutive_read_errors: AtomicU64::new(0),
            fail_reason: Mutex::new(None),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn device(&self) -> &DeviceRef {
        &self.dev
    }

    pub fn flags(&self) -> u32 {
        self.state.load(Ordering::Acquire)
    }

    pub fn has(&self, f: u32) -> bool {
        self.flags() & f != 0
    }

    pub fn set(&self, f: u32) {
        self.state.fetch_or(f, Ordering::AcqRel);
    }

    pub fn clear(&self, f: u32) {
        self.state.fetch_and(!f, Ordering::AcqRel);
    }

    pub fn is_faulty(&self) -> bool {
        self.has(flag::FAULTY)
    }

    pub fn is_in_sync(&self) -> bool {
        self.flags() & (flag::IN_SYNC | flag::FAULTY) == flag::IN_SYNC
    }

    /// Whether member sectors `[.., end_sector)` hold valid data (in sync, or rebuilt that far).
    pub fn readable_to(&self, end_sector: u64) -> bool {
        let f = self.flags();
        if f & flag::FAULTY != 0 {
            return false;
        }
        f & flag::IN_SYNC != 0 || self.recovery_offset() >= end_sector
    }

    pub fn recovery_offset(&self) -> u64 {
        self.recovery_offset_sectors.load(Ordering::Acquire)
    }

    pub fn set_recovery_offset(&self, sectors: u64) {
        self.recovery_offset_sectors.store(sectors, Ordering::Release);
    }

    /// Whether reads must treat this member as lagging: write-mostly, or with behind writes
    /// still outstanding.
    pub fn lags(&self) -> bool {
        self.has(flag::WRITE_MOSTLY) || self.behind.load(Ordering::Acquire) > 0
    }

    /// Counts a behind write to this member until [`Member::behind_done`].
    pub(crate) fn behind_started(&self) {
        self.behind.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn behind_done(&self) {
        self.behind.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn io_started(&self) -> InFlightGuard<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlightGuard { m: self }
    }

    pub fn read_errors(&self) -> u64 {
        self.read_errors.load(Ordering::Relaxed)
    }

    /// Counts a failed read; returns the failed reads since the last successful one.
    pub(crate) fn note_read_error(&self) -> u64 {
        self.read_errors.fetch_add(1, Ordering::Relaxed);
        self.consecutive_read_errors.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// A successful read resets the raid4/5/6 count (md's raid5_end_read_request).
    pub(crate) fn note_read_ok(&self) {
        if self.consecutive_read_errors.load(Ordering::Relaxed) != 0 {
            self.consecutive_read_errors.store(0, Ordering::Release);
        }
    }

    /// Failed reads since the last successful one (md's raid5 `read_errors`).
    pub fn consecutive_read_errors(&self) -> u64 {
        self.consecutive_read_errors.load(Ordering::Acquire)
    }

    /// Counts an attempt to fix a read error at `now_secs` (raid1/raid10); returns md's decayed
    /// `read_errors` including it.
    pub(crate) fn note_fix_attempt(&self, now_secs: u64) -> u64 {
        self.fix_attempts.note(now_secs)
    }

    /// md's raid1/raid10 `read_errors` as of the last fix attempt.
    pub fn fix_attempts(&self) -> u64 {
        self.fix_attempts.get()
    }

    /// Sectors corrected after read errors (md's `dev-*/errors`).
    pub fn corrected_reads(&self) -> u32 {
        self.corrected_reads.load(Ordering::Relaxed)
    }

    pub(crate) fn note_corrected_sectors(&self, sectors: u64) {
        let n = u32::try_from(sectors).unwrap_or(u32::MAX);
        let _ = self.corrected_reads.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| Some(c.saturating_add(n)));
    }

    /// Why the member was failed, once it was.
    pub fn fail_reason(&self) -> Option<String> {
        self.fail_reason.lock().clone()
    }

    pub(crate) fn set_fail_reason(&self, why: &str) {
        self.fail_reason.lock().get_or_insert_with(|| why.to_string());
    }

    /// The member's known-bad ranges.
    pub fn bad_blocks(&self) -> &BadBlockList {
        &self.bad_blocks
    }

    /// A copy of the member's superblock as last written.
    pub fn superblock(&self) -> Superblock {
        self.sb.lock().clone()
    }

    /// Changes the in-memory superblock in place, under its lock. A superblock round in flight
    /// keeps the change when it stores what it wrote ([`super::sb`]); the next round writes it.
    pub(crate) fn update_superblock(&self, f: impl FnOnce(&mut Superblock)) {
        f(&mut self.sb.lock());
    }

    /// md's `dev-NAME/state` words for this member given whether it holds a slot.
    pub fn state_words(&self, has_slot: bool) -> Vec<&'static str> {
        let f = self.flags();
        let mut w = Vec::new();
        if f & flag::FAULTY != 0 {
            w.push("faulty");
        }
        if f & flag::IN_SYNC != 0 && f & flag::FAULTY == 0 {
            w.push("in_sync");
        }
        if f & flag::WRITE_MOSTLY != 0 {
            w.push("write_mostly");
        }
        if f & (flag::FAULTY | flag::IN_SYNC) == 0 {
            // md prints "spare" for every working device that is not in sync, rebuilding or not.
            w.push("spare");
        }
        if f & flag::WANT_REPLACEMENT != 0 {
            w.push("want_replacement");
        }
        if f & flag::REPLACEMENT != 0 {
            w.push("replacement");
        }
        if f & flag::WRITE_ERROR_SEEN != 0 {
            w.push("write_error");
        }
        if f & flag::FAULTY == 0 && self.bad_blocks.unacknowledged() {
            // md: a member with unacknowledged bad blocks is Blocked until they are written.
            w.push("blocked");
        }
        let _ = has_slot;
        w
    }
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Member({} dev_number {} flags {:#x})", self.name, self.dev_number, self.flags())
    }
}

/// Decrements the member's in-flight count when dropped.
pub(crate) struct InFlightGuard<'a> {
    m: &'a Member,
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.m.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mdkit_io::MemDevice;

    use super::*;

    #[test]
    fn readable_ranges_follow_recovery() {
        let mut sb = Superblock::empty();
        sb.data_size_sectors = 1000;
        let m = Member::new("m0", Arc::new(MemDevice::new("m0", 1 << 20)), sb);
        assert!(!m.readable_to(1));
        m.set_recovery_offset(100);
        assert!(m.readable_to(100) && !m.readable_to(101));
        m.set(flag::IN_SYNC);
        assert!(m.readable_to(1000));
        assert_eq!(m.state_words(true), vec!["in_sync"]);
        m.set(flag::FAULTY);
        assert!(!m.readable_to(1) && !m.is_in_sync());
        assert_eq!(m.state_words(true), vec!["faulty"]);
        {
            let _g = m.io_started();
            assert_eq!(m.in_flight(), 1);
        }
        assert_eq!(m.in_flight(), 0);
    }
}
