//! One member device of a running array: its device, where its data lives, its state flags
//! (md's rdev flags), its recovery progress, and the in-flight counter that least-busy reads use.
//!
//! State changes are atomic flag updates on the member; which slot a member fills is decided by
//! the slot table (see `slots.rs`), swapped as a whole when membership changes.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use mdkit_io::DeviceRef;
use parking_lot::Mutex;

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
}

/// One member device.
pub struct Member {
    name: String,
    dev: DeviceRef,
    /// Permanent index into `dev_roles` (the superblock's `dev_number`).
    pub dev_number: u32,
    pub data_offset_sectors: u64,
    /// Sectors usable for data from `data_offset` (the superblock's `data_size`).
    pub data_size_sectors: u64,
    pub super_offset_sectors: u64,
    /// This member's own superblock as last written or read: the per-member fields the
    /// superblock writer starts from.
    sb: Mutex<Superblock>,
    state: AtomicU32,
    /// Member sectors already rebuilt while recovering (0 for a fresh spare; `MAX_SECTOR`
    /// once a rebuild completed). Only meaningful while the member is not in sync.
    recovery_offset_sectors: AtomicU64,
    in_flight: AtomicU32,
    /// Read errors seen (md `errors`).
    read_errors: AtomicU64,
    /// Read errors fixed by rewriting (md `cnt_corrected_read`).
    corrected_reads: AtomicU32,
}

impl Member {
    /// A member described by its superblock. State flags start empty (the assembler sets them).
    pub fn new(name: impl Into<String>, dev: DeviceRef, sb: Superblock) -> Member {
        let mut state = 0;
        if sb.devflags & DEVFLAG_WRITE_MOSTLY != 0 {
            state |= flag::WRITE_MOSTLY;
        }
        Member {
            name: name.into(),
            dev,
            dev_number: sb.dev_number,
            data_offset_sectors: sb.data_offset_sectors,
            data_size_sectors: sb.data_size_sectors,
            super_offset_sectors: sb.super_offset_sectors,
            corrected_reads: AtomicU32::new(sb.cnt_corrected_read),
            sb: Mutex::new(sb),
            state: AtomicU32::new(state),
            recovery_offset_sectors: AtomicU64::new(0),
            in_flight: AtomicU32::new(0),
            read_errors: AtomicU64::new(0),
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

    pub(crate) fn note_read_error(&self) {
        self.read_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn corrected_reads(&self) -> u32 {
        self.corrected_reads.load(Ordering::Relaxed)
    }

    /// Saturates at `u32::MAX`: the count starts from the superblock's `cnt_corrected_read`,
    /// which a damaged or crafted member may set to the maximum.
    pub(crate) fn note_corrected_read(&self) {
        let _ = self.corrected_reads.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1));
    }

    /// A copy of the member's superblock as last written.
    pub fn superblock(&self) -> Superblock {
        self.sb.lock().clone()
    }

    pub(crate) fn store_superblock(&self, sb: Superblock) {
        *self.sb.lock() = sb;
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
