//! A member's bad-block list in memory (md's `rdev->badblocks`, include/linux/badblocks.h and
//! block/badblocks.c; md-lifecycle.md section 4).
//!
//! - Ranges are absolute member-device sectors, sorted and merged; on disk each is stored in
//!   pieces of at most 512 units of `2^bblog_shift` sectors ([`crate::format::badblocks`]).
//! - Capacity is counted in on-disk entries: at most one 4 KiB page (512 entries), fewer when
//!   `bblog_size` reserves less. A member without a log (`bblog_offset` or `bblog_size` 0)
//!   cannot record anything: a bad block that cannot be persisted fails the member instead.
//! - Setting rounds *outward* to whole units (badblocks_set), clearing rounds *inward*
//!   (badblocks_clear: never forget more than was rewritten). A change that would overflow the
//!   log is refused whole: a set reports failure (the caller fails the member), a clear is
//!   dropped (the range stays bad, as the kernel does when a split finds no free slot).
//! - Every change bumps a generation; the superblock writer persists the list and marks that
//!   generation written. Entries newer than the last written generation are md's
//!   *unacknowledged* ones: a write that recorded them is acknowledged only after the round.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::format::badblocks::{BadBlock, ENTRIES_PER_PAGE, MAX_ENTRY_UNITS};
use crate::format::superblock::Superblock;

/// See the module documentation.
#[derive(Debug)]
pub struct BadBlockList {
    /// `Some(shift)` when the member has a log to persist entries in.
    shift: Option<u8>,
    capacity_entries: usize,
    /// `!ranges.is_empty()`, readable without the lock (every member I/O asks).
    any: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    ranges: Vec<BadBlock>,
    generation: u64,
    written: u64,
}

impl BadBlockList {
    /// An empty list for a member described by `sb` (its log's shift and size).
    pub fn for_superblock(sb: &Superblock) -> BadBlockList {
        let has_log = sb.bblog_sector().is_some() && sb.bblog_shift < 54;
        let shift = has_log.then_some(sb.bblog_shift);
        let capacity_entries =
            if has_log { (usize::from(sb.bblog_size_sectors) * 64).min(ENTRIES_PER_PAGE) } else { 0 };
        BadBlockList { shift, capacity_entries, any: AtomicBool::new(false), state: Mutex::new(State::default()) }
    }

    /// Whether entries can be recorded (the member has a log).
    pub fn has_log(&self) -> bool {
        self.shift.is_some()
    }

    pub fn shift(&self) -> Option<u8> {
        self.shift
    }

    /// Loads the entries read from disk at assembly (all acknowledged).
    pub fn load(&self, blocks: &[BadBlock]) {
        let mut s = self.state.lock();
        for b in blocks {
            insert(&mut s.ranges, b.start_sector, b.start_sector.saturating_add(b.len_sectors));
        }
        self.any.store(!s.ranges.is_empty(), Ordering::Release);
    }

    /// The merged ranges.
    pub fn ranges(&self) -> Vec<BadBlock> {
        self.state.lock().ranges.clone()
    }

    /// On-disk entries the list needs.
    pub fn entries(&self) -> usize {
        entries_for(&self.state.lock().ranges, self.shift.unwrap_or(0))
    }

    /// Bad sectors in total.
    pub fn sectors(&self) -> u64 {
        self.state.lock().ranges.iter().map(|b| b.len_sectors).sum()
    }

    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// The first bad range overlapping absolute sectors `[start, start + len)`.
    pub fn first_overlap(&self, start: u64, len: u64) -> Option<BadBlock> {
        if self.is_empty() {
            return None;
        }
        let end = start.saturating_add(len);
        let s = self.state.lock();
        s.ranges.iter().find(|b| b.start_sector < end && b.start_sector + b.len_sectors > start).copied()
    }

    /// Records `[start, start + len)` (rounded out to whole units). `false` when the member has
    /// no log or the log has no room: the caller fails the member.
    pub fn set(&self, start: u64, len: u64) -> bool {
        let Some(shift) = self.shift else { return false };
        let unit = 1u64 << shift;
        let lo = start & !(unit - 1);
        let hi = start.saturating_add(len).div_ceil(unit).saturating_mul(unit);
        let mut s = self.state.lock();
        let mut next = s.ranges.clone();
        insert(&mut next, lo, hi);
        if entries_for(&next, shift) > self.capacity_entries {
            return false;
        }
        if next != s.ranges {
            s.ranges = next;
            s.generation += 1;
            self.any.store(true, Ordering::Release);
        }
        true
    }

    /// Forgets `[start, start + len)` after a successful write there (rounded in to whole
    /// units). Returns whether the list changed.
    pub fn clear(&self, start: u64, len: u64) -> bool {
        let shift = self.shift.unwrap_or(0);
        let unit = 1u64 << shift;
        let lo = start.div_ceil(unit).saturating_mul(unit);
        let hi = start.saturating_add(len) & !(unit - 1);
        if lo >= hi {
            return false;
        }
        let mut s = self.state.lock();
        if !s.ranges.iter().any(|b| b.start_sector < hi && b.start_sector + b.len_sectors > lo) {
            return false;
        }
        let mut next = Vec::with_capacity(s.ranges.len() + 1);
        for b in &s.ranges {
            let end = b.start_sector + b.len_sectors;
            if end <= lo || b.start_sector >= hi {
                next.push(*b);
                continue;
            }
            if b.start_sector < lo {
                next.push(BadBlock { start_sector: b.start_sector, len_sectors: lo - b.start_sector });
            }
            if end > hi {
                next.push(BadBlock { start_sector: hi, len_sectors: end - hi });
            }
        }
        if self.has_log() && entries_for(&next, shift) > self.capacity_entries {
            return false;
        }
        self.any.store(!next.is_empty(), Ordering::Release);
        s.ranges = next;
        s.generation += 1;
        true
    }

    /// Whether the list changed since it was last written.
    pub fn is_dirty(&self) -> bool {
        let s = self.state.lock();
        s.generation != s.written
    }

    /// Whether entries exist that the on-disk log does not hold yet (md's unacknowledged bad
    /// blocks).
    pub fn unacknowledged(&self) -> bool {
        let s = self.state.lock();
        s.generation != s.written && !s.ranges.is_empty()
    }

    /// The on-disk entries to write now and the generation they describe.
    pub fn snapshot(&self) -> (Vec<BadBlock>, u64) {
        let s = self.state.lock();
        (split_entries(&s.ranges, self.shift.unwrap_or(0)), s.generation)
    }

    /// Marks generation `g` as written.
    pub fn mark_written(&self, g: u64) {
        let mut s = self.state.lock();
        s.written = s.written.max(g);
    }
}

/// Merges `[lo, hi)` into the sorted, merged `ranges`.
fn insert(ranges: &mut Vec<BadBlock>, lo: u64, hi: u64) {
    if lo >= hi {
        return;
    }
    let (mut lo, mut hi) = (lo, hi);
    ranges.retain(|b| {
        let end = b.start_sector + b.len_sectors;
        if end < lo || b.start_sector > hi {
            return true;
        }
        lo = lo.min(b.start_sector);
        hi = hi.max(end);
        false
    });
    let at = ranges.partition_point(|b| b.start_sector < lo);
    ranges.insert(at, BadBlock { start_sector: lo, len_sectors: hi - lo });
}

/// The ranges cut into on-disk entries of at most 512 units.
fn split_entries(ranges: &[BadBlock], shift: u8) -> Vec<BadBlock> {
    let max = MAX_ENTRY_UNITS << shift;
    let mut out = Vec::new();
    for b in ranges {
        let (mut s, end) = (b.start_sector, b.start_sector + b.len_sectors);
        while s < end {
            let n = (end - s).min(max);
            out.push(BadBlock { start_sector: s, len_sectors: n });
            s += n;
        }
    }
    out
}

fn entries_for(ranges: &[BadBlock], shift: u8) -> usize {
    let max = MAX_ENTRY_UNITS << shift;
    ranges.iter().map(|b| b.len_sectors.div_ceil(max) as usize).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(shift: u8, size_sectors: u16) -> BadBlockList {
        let mut sb = Superblock::empty();
        sb.super_offset_sectors = 8;
        sb.bblog_offset_sectors = 8;
        sb.bblog_size_sectors = size_sectors;
        sb.bblog_shift = shift;
        BadBlockList::for_superblock(&sb)
    }

    fn bb(start_sector: u64, len_sectors: u64) -> BadBlock {
        BadBlock { start_sector, len_sectors }
    }

    #[test]
    fn set_merges_rounds_out_and_overlaps() {
        let l = list(3, 8);
        assert!(l.set(10, 1));
        assert_eq!(l.ranges(), vec![bb(8, 8)], "rounded out to 8-sector units");
        assert!(l.set(16, 8));
        assert_eq!(l.ranges(), vec![bb(8, 16)], "adjacent ranges merge");
        assert!(l.set(100, 4));
        assert_eq!(l.ranges(), vec![bb(8, 16), bb(96, 8)]);
        assert_eq!(l.first_overlap(0, 8), None);
        assert_eq!(l.first_overlap(0, 9), Some(bb(8, 16)));
        assert_eq!(l.first_overlap(103, 100), Some(bb(96, 8)));
        assert_eq!(l.first_overlap(104, 100), None);
        assert_eq!((l.entries(), l.sectors()), (2, 24));
        assert!(l.is_dirty());
        let (_, g) = l.snapshot();
        l.mark_written(g);
        assert!(!l.is_dirty());
    }

    #[test]
    fn clear_rounds_in_and_splits() {
        let l = list(0, 8);
        l.load(&[bb(100, 100)]);
        assert!(!l.is_dirty(), "loaded entries are acknowledged");
        assert!(l.clear(120, 10));
        assert_eq!(l.ranges(), vec![bb(100, 20), bb(130, 70)]);
        assert!(!l.clear(0, 100), "nothing there");
        assert!(l.clear(0, 1000));
        assert!(l.is_empty());
        let s = list(3, 8);
        assert!(s.set(0, 16));
        assert!(!s.clear(1, 7), "less than a unit rewritten: stays bad");
        assert!(s.clear(1, 15));
        assert_eq!(s.ranges(), vec![bb(0, 8)]);
    }

    #[test]
    fn long_ranges_take_several_entries_and_the_log_fills() {
        let l = list(0, 1); // one sector: 64 entries
        assert!(l.set(0, 1024 + 1));
        assert_eq!(l.entries(), 3);
        assert_eq!(l.snapshot().0, vec![bb(0, 512), bb(512, 512), bb(1024, 1)]);
        for i in 0..61 {
            assert!(l.set(10_000 + i * 10, 1), "entry {i}");
        }
        assert_eq!(l.entries(), 64);
        assert!(!l.set(50_000, 1), "full");
        assert_eq!(l.entries(), 64, "a refused set changes nothing");
        assert!(l.set(10_001, 1), "merging into an entry needs no room");
        assert!(l.set(10_002, 1));
        assert_eq!(l.entries(), 64);
        assert!(!l.clear(10_001, 1), "a split that needs a 65th entry is dropped");
        assert_eq!(l.first_overlap(10_001, 1), Some(bb(10_000, 3)), "the range stays bad");
        assert!(l.clear(0, 1), "trimming needs no room");
        let none = BadBlockList::for_superblock(&Superblock::empty());
        assert!(!none.has_log() && !none.set(0, 8));
    }
}
