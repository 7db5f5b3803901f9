//! Write-behind (raid1, md's `--write-behind=N`): the book of writes still outstanding to
//! write-mostly members after the user write was acknowledged.
//!
//! ```text
//!  raid1 write ─ acquire (waits while N are outstanding) ─ hold bitmap chunks, barrier, gate
//!      ├─ non-write-mostly members ──────────────────────────────> acknowledge
//!      └─ task: wait for earlier overlapping behind writes ─ write-mostly members ─ complete
//! ```
//!
//! What the book answers, and who asks:
//! - *is a slot free* ([`WriteBehind::acquire`]): at most `N` (the bitmap superblock's
//!   `write_behind`, [`crate::format::bitmap::COUNTER_MAX`] at most) behind writes are
//!   outstanding; the next write waits for one to complete (bounded memory and lag);
//! - *does an earlier behind write overlap mine* ([`WriteBehind::wait_earlier_overlaps`]):
//!   overlapping writes reach a write-mostly member in the order they were acknowledged (md's
//!   serialisation of write-mostly writes, `wait_for_serialization`), so the member never ends
//!   with the older data;
//! - *is a behind write in flight on this range* ([`WriteBehind::overlaps`]): reads of such a
//!   range never go to a write-mostly member (it may still hold the old data);
//! - *has every behind write issued before now completed* ([`WriteBehind::drain`]): a FLUSH
//!   waits for that before flushing the members, so a flush covers every member.
//!
//! The list is short (at most `N` entries, a few hundred usually) and guarded by one lock held
//! for a scan; nothing here does I/O.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// One behind write in flight: its sequence number and member sector range (raid1: array
/// sectors too).
struct Entry {
    seq: u64,
    range: Range<u64>,
    bytes: u64,
}

#[derive(Default)]
struct Book {
    next_seq: u64,
    /// In flight, ascending `seq`.
    entries: Vec<Entry>,
    bytes: u64,
}

/// Counters for `detail`, `status` and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BehindStats {
    /// Behind writes outstanding now (md's `behind_writes`).
    pub outstanding_writes: u64,
    /// Bytes of those writes: how far the write-mostly members lag.
    pub outstanding_bytes: u64,
    /// The most outstanding at once (md's `bitmap/max_backlog_used`).
    pub peak_writes: u64,
    /// Behind writes completed, and those of them that failed (the member was failed).
    pub completed_writes: u64,
    pub failed_writes: u64,
    /// Times a write waited because `N` behind writes were outstanding.
    pub slot_waits: u64,
}

/// See the module documentation.
#[derive(Default)]
pub struct WriteBehind {
    book: Mutex<Book>,
    changed: Notify,
    /// Mirrors `book.entries.len()` for the lock-free "anything behind?" test on reads.
    outstanding: AtomicU64,
    peak: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    slot_waits: AtomicU64,
}

/// A registered behind write; [`WriteBehind::complete`] it exactly once.
#[derive(Debug)]
pub struct Ticket {
    pub seq: u64,
}

impl WriteBehind {
    pub fn new() -> WriteBehind {
        WriteBehind::default()
    }

    /// Waits until fewer than `limit` behind writes are outstanding, then registers one for
    /// member sectors `range` (`bytes` long). `limit` is at least 1.
    pub async fn acquire(&self, limit: u64, range: Range<u64>, bytes: u64) -> Ticket {
        let limit = limit.max(1);
        let mut waited = false;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut b = self.book.lock();
                if (b.entries.len() as u64) < limit {
                    let seq = b.next_seq;
                    b.next_seq += 1;
                    b.entries.push(Entry { seq, range, bytes });
                    b.bytes += bytes;
                    let n = b.entries.len() as u64;
                    self.outstanding.store(n, Ordering::Release);
                    self.peak.fetch_max(n, Ordering::Relaxed);
                    return Ticket { seq };
                }
            }
            if !waited {
                waited = true;
                self.slot_waits.fetch_add(1, Ordering::Relaxed);
            }
            notified.await;
        }
    }

    /// The behind write of `t` is done (`ok`: every write-mostly member took it).
    pub fn complete(&self, t: Ticket, ok: bool) {
        {
            let mut b = self.book.lock();
            if let Some(i) = b.entries.iter().position(|e| e.seq == t.seq) {
                let e = b.entries.remove(i);
                b.bytes -= e.bytes;
            }
            self.outstanding.store(b.entries.len() as u64, Ordering::Release);
        }
        self.completed.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.changed.notify_waiters();
    }

    /// Whether a behind write is in flight anywhere (one atomic load).
    pub fn any(&self) -> bool {
        self.outstanding.load(Ordering::Acquire) > 0
    }

    /// Whether a behind write on member sectors overlapping `range` is in flight.
    pub fn overlaps(&self, range: &Range<u64>) -> bool {
        self.any() && self.book.lock().entries.iter().any(|e| overlap(&e.range, range))
    }

    /// Waits until no behind write overlapping `range` with a sequence number below `seq` is
    /// in flight (`u64::MAX`: none at all).
    pub async fn wait_earlier_overlaps(&self, seq: u64, range: &Range<u64>) {
        self.wait_until(|b| !b.entries.iter().any(|e| e.seq < seq && overlap(&e.range, range))).await;
    }

    /// Waits until every behind write registered before this call has completed (later ones
    /// do not hold it up).
    pub async fn drain(&self) {
        if !self.any() {
            return;
        }
        let upto = self.book.lock().next_seq;
        self.wait_until(|b| b.entries.first().is_none_or(|e| e.seq >= upto)).await;
    }

    async fn wait_until(&self, done: impl Fn(&Book) -> bool) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(&self.book.lock()) {
                return;
            }
            notified.await;
        }
    }

    pub fn stats(&self) -> BehindStats {
        let (outstanding_writes, outstanding_bytes) = {
            let b = self.book.lock();
            (b.entries.len() as u64, b.bytes)
        };
        BehindStats {
            outstanding_writes,
            outstanding_bytes,
            peak_writes: self.peak.load(Ordering::Relaxed),
            completed_writes: self.completed.load(Ordering::Relaxed),
            failed_writes: self.failed.load(Ordering::Relaxed),
            slot_waits: self.slot_waits.load(Ordering::Relaxed),
        }
    }

    /// Forgets the peak (md: writing `max_backlog_used`).
    pub fn reset_peak(&self) {
        self.peak.store(self.outstanding.load(Ordering::Acquire), Ordering::Relaxed);
    }
}

fn overlap(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_full_book_makes_the_next_write_wait_for_a_completion() {
        let wb = Arc::new(WriteBehind::new());
        let t0 = wb.acquire(2, 0..8, 4096).await;
        let _t1 = wb.acquire(2, 8..16, 4096).await;
        let w = wb.clone();
        let third = tokio::spawn(async move { w.acquire(2, 16..24, 4096).await });
        tokio::task::yield_now().await;
        assert!(!third.is_finished(), "a third behind write with N = 2 must wait");
        assert_eq!(wb.stats().slot_waits, 1);
        wb.complete(t0, true);
        let t2 = third.await.unwrap();
        assert_eq!(t2.seq, 2);
        let s = wb.stats();
        assert_eq!((s.outstanding_writes, s.outstanding_bytes, s.peak_writes), (2, 8192, 2));
    }

    #[tokio::test]
    async fn overlapping_writes_wait_only_for_earlier_overlapping_ones() {
        let wb = Arc::new(WriteBehind::new());
        let t0 = wb.acquire(8, 0..8, 4096).await;
        let t1 = wb.acquire(8, 100..108, 4096).await;
        let t2 = wb.acquire(8, 4..12, 4096).await;
        // t1 does not overlap t0: no wait.
        wb.wait_earlier_overlaps(t1.seq, &(100..108)).await;
        let w = wb.clone();
        let r = 4..12;
        let waiter = tokio::spawn(async move { w.wait_earlier_overlaps(t2.seq, &r).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "t2 overlaps the earlier t0");
        assert!(wb.overlaps(&(7..9)) && !wb.overlaps(&(12..100)));
        wb.complete(t1, true);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        wb.complete(t0, false);
        waiter.await.unwrap();
        assert_eq!(wb.stats().failed_writes, 1);
    }

    #[tokio::test]
    async fn drain_waits_for_earlier_writes_not_later_ones() {
        let wb = Arc::new(WriteBehind::new());
        let t0 = wb.acquire(8, 0..8, 4096).await;
        let w = wb.clone();
        let drain = tokio::spawn(async move { w.drain().await });
        tokio::task::yield_now().await;
        let later = wb.acquire(8, 8..16, 4096).await;
        assert!(!drain.is_finished());
        wb.complete(t0, true);
        drain.await.unwrap();
        assert!(wb.any(), "the later write is still outstanding");
        wb.complete(later, true);
        assert!(!wb.any());
    }
}
