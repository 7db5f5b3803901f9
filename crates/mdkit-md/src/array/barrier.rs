//! The region barrier shared by user writes and sync work (md raid1's bucketed barrier).
//!
//! The sync domain is cut into buckets of [`BUCKET_SECTORS`]; buckets hash onto
//! [`BARRIER_SLOTS`] slots, each with a count of writes in flight and a barrier flag. A write
//! counts itself in every slot its range touches; sync work (and read-error repair) raises the
//! barrier on the slots of its range and waits until no write is in flight there. Writes that
//! meet a raised barrier back off (release what they hold) and wait. Nothing is global: work on
//! one region never waits for another region (except for hash collisions, which only delay).
//!
//! Barriers are shared: several sync ranges (and read-error repairs) may hold the barrier of one
//! slot at once — they exclude writes, not each other (each only copies data that no write can
//! change while any barrier is up). So the sync engine's concurrent steps within one bucket
//! run in parallel.
//!
//! Deadlock freedom: a write never waits while holding a slot, and raising a barrier never waits
//! for another barrier.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::Notify;

/// Sectors per bucket (64 MiB, as md raid1).
pub const BUCKET_SECTORS: u64 = 1 << 17;
/// Hash slots (md raid1: 1024).
pub const BARRIER_SLOTS: usize = 1024;

struct BarrierSlot {
    pending_writes: AtomicU32,
    barrier: AtomicU32,
    changed: Notify,
}

/// See the module documentation.
pub struct RegionBarrier {
    slots: Box<[BarrierSlot]>,
}

impl Default for RegionBarrier {
    fn default() -> Self {
        RegionBarrier::new()
    }
}

impl RegionBarrier {
    pub fn new() -> RegionBarrier {
        let slots = (0..BARRIER_SLOTS)
            .map(|_| BarrierSlot {
                pending_writes: AtomicU32::new(0),
                barrier: AtomicU32::new(0),
                changed: Notify::new(),
            })
            .collect();
        RegionBarrier { slots }
    }

    /// The slots a sync-domain range touches, ascending, without duplicates.
    fn slots_of(range: &Range<u64>) -> Vec<usize> {
        if range.start >= range.end {
            return Vec::new();
        }
        let first = range.start / BUCKET_SECTORS;
        let last = (range.end - 1) / BUCKET_SECTORS;
        if last - first + 1 >= BARRIER_SLOTS as u64 {
            return (0..BARRIER_SLOTS).collect();
        }
        let mut v: Vec<usize> = (first..=last).map(|b| (b % BARRIER_SLOTS as u64) as usize).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Waits until no barrier is raised on the range, then counts a write in flight there until
    /// the guard drops.
    pub async fn enter_write(&self, range: Range<u64>) -> WriteGuard<'_> {
        let slots = Self::slots_of(&range);
        'retry: loop {
            for (i, &s) in slots.iter().enumerate() {
                let slot = &self.slots[s];
                slot.pending_writes.fetch_add(1, Ordering::SeqCst);
                if slot.barrier.load(Ordering::SeqCst) == 0 {
                    continue;
                }
                // Back off: release this slot and every slot already held, then wait.
                for &held in slots[..=i].iter() {
                    self.release_write(held);
                }
                self.wait_until(s, |sl| sl.barrier.load(Ordering::SeqCst) == 0).await;
                continue 'retry;
            }
            return WriteGuard { barrier: self, slots };
        }
    }

    /// Counts one more write in flight on `range` without waiting, for a caller that already
    /// holds a [`WriteGuard`] on it (so no barrier there can be complete): a behind write keeps
    /// sync work out of its range until it reaches the write-mostly members. Release with
    /// [`RegionBarrier::release_held`].
    pub fn hold_write(&self, range: &Range<u64>) -> Vec<usize> {
        let slots = Self::slots_of(range);
        for &s in &slots {
            self.slots[s].pending_writes.fetch_add(1, Ordering::SeqCst);
        }
        slots
    }

    /// Ends a [`RegionBarrier::hold_write`].
    pub fn release_held(&self, slots: &[usize]) {
        for &s in slots {
            self.release_write(s);
        }
    }

    fn release_write(&self, s: usize) {
        let slot = &self.slots[s];
        if slot.pending_writes.fetch_sub(1, Ordering::SeqCst) == 1 {
            slot.changed.notify_waiters();
        }
    }

    /// Raises the barrier on the range and waits until the writes in flight there have
    /// finished. New writes to the range wait until every guard on it dropped.
    pub async fn raise(&self, range: Range<u64>) -> BarrierGuard<'_> {
        let slots = Self::slots_of(&range);
        for &s in &slots {
            self.slots[s].barrier.fetch_add(1, Ordering::SeqCst);
        }
        for &s in &slots {
            self.wait_until(s, |sl| sl.pending_writes.load(Ordering::SeqCst) == 0).await;
        }
        BarrierGuard { barrier: self, slots }
    }

    async fn wait_until(&self, s: usize, cond: impl Fn(&BarrierSlot) -> bool) {
        let slot = &self.slots[s];
        loop {
            let notified = slot.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if cond(slot) {
                return;
            }
            notified.await;
        }
    }

    /// Writes in flight in the slot of a sector (diagnostics and tests).
    pub fn pending_writes_at(&self, sector: u64) -> u32 {
        let s = ((sector / BUCKET_SECTORS) % BARRIER_SLOTS as u64) as usize;
        self.slots[s].pending_writes.load(Ordering::SeqCst)
    }
}

/// A write counted in the barrier's slots.
pub struct WriteGuard<'a> {
    barrier: &'a RegionBarrier,
    slots: Vec<usize>,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        for &s in &self.slots {
            self.barrier.release_write(s);
        }
    }
}

/// A raised barrier; dropping it lets writes into the region again.
pub struct BarrierGuard<'a> {
    barrier: &'a RegionBarrier,
    slots: Vec<usize>,
}

impl Drop for BarrierGuard<'_> {
    fn drop(&mut self) {
        for &s in &self.slots {
            let slot = &self.barrier.slots[s];
            if slot.barrier.fetch_sub(1, Ordering::SeqCst) == 1 {
                slot.changed.notify_waiters();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;
    use std::time::Duration;

    use super::*;

    #[test]
    fn slot_sets() {
        assert_eq!(RegionBarrier::slots_of(&(0..1)), vec![0]);
        assert_eq!(RegionBarrier::slots_of(&(0..0)), Vec::<usize>::new());
        assert_eq!(RegionBarrier::slots_of(&(BUCKET_SECTORS - 1..BUCKET_SECTORS + 1)), vec![0, 1]);
        let wrap = BUCKET_SECTORS * BARRIER_SLOTS as u64;
        assert_eq!(RegionBarrier::slots_of(&(wrap - 1..wrap + 1)), vec![0, BARRIER_SLOTS - 1]);
        assert_eq!(RegionBarrier::slots_of(&(0..u64::MAX)).len(), BARRIER_SLOTS);
    }

    /// Polls `f` exactly once with the task's waker: `Pending` means it waits (no clock involved).
    async fn poll_once<F: Future>(f: &mut Pin<Box<F>>) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
    }

    /// Awaits what a test released, under a generous hang guard.
    async fn finish<F: Future>(f: Pin<Box<F>>, what: &str) -> F::Output {
        tokio::time::timeout(Duration::from_secs(30), f).await.unwrap_or_else(|_| panic!("{what} never finished"))
    }

    #[tokio::test]
    async fn barrier_waits_for_writes_and_blocks_new_ones_in_its_region_only() {
        let b = RegionBarrier::new();
        let w = b.enter_write(0..8).await;
        let mut raise = Box::pin(b.raise(0..1024));
        assert!(poll_once(&mut raise).await.is_pending(), "barrier must wait for the write in flight");
        // A write elsewhere is not affected.
        drop(b.enter_write(BUCKET_SECTORS * 3..BUCKET_SECTORS * 3 + 8).await);
        drop(w);
        let g = finish(raise, "the barrier after the write drained").await;
        // A new write to the region waits until the barrier drops.
        let mut write = Box::pin(b.enter_write(8..16));
        assert!(poll_once(&mut write).await.is_pending(), "a write must wait for the barrier");
        drop(g);
        drop(finish(write, "the write after the barrier dropped").await);
        assert_eq!(b.pending_writes_at(0), 0);
    }

    #[tokio::test]
    async fn barriers_share_a_slot_and_writes_wait_for_all_of_them() {
        let b = RegionBarrier::new();
        let g1 = b.raise(0..8).await;
        let g2 = tokio::time::timeout(Duration::from_millis(100), b.raise(8..16))
            .await
            .expect("a second raiser does not wait");
        drop(g1);
        let blocked = tokio::time::timeout(Duration::from_millis(30), b.enter_write(0..8)).await;
        assert!(blocked.is_err(), "a write waits while any barrier is up");
        drop(g2);
        drop(b.enter_write(0..8).await);
    }
}
