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
    //! Deterministic: a future is polled once by hand to see that it waits (no sleeps, no
    //! clocks), then awaited (under a generous hang guard) once what it waits for is released.
    use super::*;
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;
    use std::time::Duration;

    const HANG_GUARD: Duration = Duration::from_secs(30);

    /// Polls `f` exactly once with the task's waker.
    async fn poll_once<F: Future>(f: &mut Pin<Box<F>>) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
    }

    async fn finish<F: Future>(f: Pin<Box<F>>, what: &str) -> F::Output {
        tokio::time::timeout(HANG_GUARD, f).await.unwrap_or_else(|_| panic!("{what} never finished"))
    }

    #[tokio::test]
    async fn disjoint_ranges_do_not_wait_and_overlapping_ones_do() {
        let l = RangeLock::default();
        let a = l.lock(0..4096).await;
        let mut disjoint = Box::pin(l.lock(4096..8192));
        let Poll::Ready(_b) = poll_once(&mut disjoint).await else { panic!("a disjoint lock must not wait") };
        let mut overlapping = Box::pin(l.lock(4000..4090));
        assert!(poll_once(&mut overlapping).await.is_pending(), "an overlapping lock must wait");
        assert_eq!(l.held_count(), 2);
        drop(a);
        let c = finish(overlapping, "the overlapping lock after the release").await;
        assert_eq!(l.held_count(), 2);
        drop(c);
        assert_eq!(l.held_count(), 1);
    }

    #[tokio::test]
    async fn rmw_waits_for_fast_writers_and_forces_slow_path() {
        let g = WriteGate::new();
        let w = g.write(0..4096).await;
        assert!(matches!(w, WriteGuard::Fast(_)));
        let mut rmw = Box::pin(g.rmw(0..4096));
        assert!(poll_once(&mut rmw).await.is_pending(), "RMW must wait for the in-flight fast writer");
        assert_eq!(g.rmw_active(), 1);
        // While the RMW waits, a new writer (even a disjoint one) takes the slow path.
        let other = g.write(1 << 20..(1 << 20) + 4096).await;
        assert!(matches!(other, WriteGuard::Locked(_)));
        drop(other);
        drop(w);
        let r = finish(rmw, "the RMW after the fast writer drained").await;
        // While the RMW runs, an overlapping writer waits for it on the range lock.
        let mut w2 = Box::pin(g.write(0..4096));
        assert!(poll_once(&mut w2).await.is_pending(), "writer did not wait for the RMW");
        drop(r);
        let w2 = finish(w2, "the writer after the RMW").await;
        assert!(matches!(w2, WriteGuard::Locked(_)));
        drop(w2);
        assert_eq!(g.rmw_active(), 0);
        assert!(matches!(g.write(0..4096).await, WriteGuard::Fast(_)));
    }
}
