//! Ordering between plain writes and read-modify-write (RMW) cycles on one export.
//!
//! A client that did not negotiate block sizes may write 1 byte at offset 3. The device only
//! takes whole logical blocks, so the server reads the covering blocks, patches them and writes
//! them back. Between that read and that write another request (on any connection: the device
//! is shared) must not change those blocks, or the write-back would silently undo it. So:
//!
//! ```text
//!   RMW cycle            takes an exclusive range lock over its aligned span
//!   aligned write/trim   fast path: no lock at all while no RMW is running;
//!                        while any RMW runs, takes the same range lock over its span
//! ```
//!
//! The fast path is a Dekker-style handshake on two counters (both `SeqCst`): a writer bumps
//! `fast_writers` then checks `rmw_active`; an RMW bumps `rmw_active` then waits for
//! `fast_writers` to drain. Sequential consistency guarantees at least one side sees the other,
//! so an aligned write never overlaps an RMW unprotected. Once `rmw_active` is raised, new
//! writers take the slow path, so the drain is bounded by the writes already in flight.
//! Aligned clients (qemu, libnbd, the kernel) therefore never touch a lock on the data path.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// See the module documentation.
#[derive(Default)]
pub struct WriteGate {
    rmw_active: AtomicU64,
    fast_writers: AtomicU64,
    /// Woken when `fast_writers` drops to zero while an RMW waits.
    drained: Notify,
    locks: RangeLock,
}

/// What a write holds while it runs; dropping it releases whatever was taken.
pub enum WriteGuard<'a> {
    Fast(&'a WriteGate),
    Locked(RangeGuard<'a>),
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if let WriteGuard::Fast(g) = self {
            let before = g.fast_writers.fetch_sub(1, Ordering::SeqCst);
            debug_assert!(before > 0, "fast writer count underflow");
            if before == 1 && g.rmw_active.load(Ordering::SeqCst) > 0 {
                g.drained.notify_waiters();
            }
        }
    }
}

/// Held by an RMW cycle.
pub struct RmwGuard<'a> {
    gate: &'a WriteGate,
    _range: RangeGuard<'a>,
}

impl Drop for RmwGuard<'_> {
    fn drop(&mut self) {
        // `_range` is released after this body runs (fields drop after `drop`), which is fine:
        // slow-path writers wait on the range lock itself, not on this counter.
        let before = self.gate.rmw_active.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(before > 0, "rmw count underflow");
    }
}

impl WriteGate {
    pub fn new() -> WriteGate {
        WriteGate::default()
    }

    /// Entry for an aligned write, trim or write-zeroes over `range` (bytes).
    pub async fn write(&self, range: Range<u64>) -> WriteGuard<'_> {
        if self.rmw_active.load(Ordering::SeqCst) == 0 {
            self.fast_writers.fetch_add(1, Ordering::SeqCst);
            if self.rmw_active.load(Ordering::SeqCst) == 0 {
                return WriteGuard::Fast(self);
            }
            // An RMW started between the two loads: back out and take the slow path.
            drop(WriteGuard::Fast(self));
        }
        WriteGuard::Locked(self.locks.lock(range).await)
    }

    /// Entry for a read-modify-write cycle over the aligned `range` (bytes).
    pub async fn rmw(&self, range: Range<u64>) -> RmwGuard<'_> {
        self.rmw_active.fetch_add(1, Ordering::SeqCst);
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.fast_writers.load(Ordering::SeqCst) == 0 {
                break;
            }
            drained.await;
        }
        let range = self.locks.lock(range).await;
        RmwGuard { gate: self, _range: range }
    }

    /// Number of RMW cycles running or waiting (metrics, tests).
    pub fn rmw_active(&self) -> u64 {
        self.rmw_active.load(Ordering::SeqCst)
    }
}

//------------------------------------------------------------------------------------------------

/// Exclusive locks over byte ranges; overlapping lockers wait, disjoint ones do not.
/// Held ranges are few (only while RMW cycles run), so a short list behind a mutex is enough.
#[derive(Default)]
pub struct RangeLock {
    held: Mutex<Vec<(u64, Range<u64>)>>,
    next_id: AtomicU64,
    released: Arc<Notify>,
}

pub struct RangeGuard<'a> {
    lock: &'a RangeLock,
    id: u64,
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.lock.held.lock();
        let before = held.len();
        held.retain(|(id, _)| *id != self.id);
        debug_assert_eq!(held.len() + 1, before, "range guard released twice");
        drop(held);
        self.lock.released.notify_waiters();
    }
}

impl RangeLock {
    pub async fn lock(&self, range: Range<u64>) -> RangeGuard<'_> {
        debug_assert!(range.start <= range.end);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut held = self.held.lock();
                if !held.iter().any(|(_, r)| r.start < range.end && range.start < r.end) {
                    held.push((id, range));
                    return RangeGuard { lock: self, id };
                }
            }
            released.await;
        }
    }

    pub fn held_count(&self) -> usize {
        self.held.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn disjoint_ranges_do_not_wait_and_overlapping_ones_do() {
        let l = Arc::new(RangeLock::default());
        let a = l.lock(0..4096).await;
        let _b = l.lock(4096..8192).await;
        let l2 = l.clone();
        let waiter = tokio::spawn(async move {
            let _c = l2.lock(4000..4090).await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "overlapping lock must wait");
        drop(a);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        assert_eq!(l.held_count(), 1);
    }

    #[tokio::test]
    async fn rmw_waits_for_fast_writers_and_forces_slow_path() {
        let g = Arc::new(WriteGate::new());
        let w = g.write(0..4096).await;
        assert!(matches!(w, WriteGuard::Fast(_)));
        let g2 = g.clone();
        let rmw = tokio::spawn(async move {
            let _r = g2.rmw(0..4096).await;
            tokio::time::sleep(Duration::from_millis(30)).await;
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!rmw.is_finished(), "RMW must wait for the in-flight fast writer");
        drop(w);
        // While the RMW runs, a new overlapping writer must wait for it (slow path).
        tokio::time::sleep(Duration::from_millis(5)).await;
        let start = std::time::Instant::now();
        let w2 = g.write(0..4096).await;
        assert!(matches!(w2, WriteGuard::Locked(_)));
        assert!(start.elapsed() >= Duration::from_millis(10), "writer did not wait for the RMW");
        drop(w2);
        rmw.await.unwrap();
        assert!(matches!(g.write(0..4096).await, WriteGuard::Fast(_)));
        assert_eq!(g.rmw_active(), 0);
    }
}
