//! One payload-memory budget for the whole server.
//!
//! Every READ and WRITE holds budget for its payload from the moment its buffer is allocated
//! until its reply has left the socket; a WRITE's buffer is allocated only once the budget is
//! granted. So whatever clients announce and however they stall, the payload buffers alive at
//! once never exceed [`PayloadBudget::limit_bytes`] (per-connection limits come on top and
//! stay). Not counted: the block-rounding of misaligned requests and the second buffer of a
//! read-modify-write, both short-lived and at most one request's size.
//!
//! ```text
//!   units ≤ SMALL_REQUEST_UNITS   may use the whole budget
//!   larger requests               may use all but the reserve (a quarter of the budget)
//! ```
//!
//! The reserve keeps small requests moving while large writes from stalled clients hold
//! everything they may hold: 256 clients that announce 32 MiB writes and stop sending pin at
//! most three quarters of the budget, and a well-behaved client's 4 KiB requests still run.
//!
//! Cost on the data path: one compare-and-swap on a shared counter to take, one `fetch_sub` and
//! one load to give back (per batch of replies written). Only when the budget is exhausted does
//! a connection register on a [`Notify`], and only then does giving back touch its lock.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

/// Unit of the budget (and of the per-connection byte limit).
pub const BUDGET_UNIT_BYTES: u64 = 4096;
/// Requests up to this many units (1 MiB) may use the reserve.
pub const SMALL_REQUEST_UNITS: u64 = 256;

/// The server-wide payload budget. See the module documentation.
#[derive(Debug)]
pub struct PayloadBudget {
    limit_units: u64,
    /// What requests larger than [`SMALL_REQUEST_UNITS`] may hold together.
    large_ceiling_units: u64,
    used_units: AtomicU64,
    peak_units: AtomicU64,
    /// Connections currently waiting for budget (0 = giving back skips the notify lock).
    waiters: AtomicUsize,
    /// Times a request had to wait for budget.
    waits: AtomicU64,
    released: Arc<Notify>,
}

/// Counters of the budget, for status output and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BudgetSnapshot {
    pub limit_bytes: u64,
    pub used_bytes: u64,
    /// Highest `used_bytes` seen since the server started.
    pub peak_bytes: u64,
    /// Requests that had to wait for budget.
    pub waits: u64,
}

impl PayloadBudget {
    /// A budget of `limit_bytes`, raised when needed so that one request of
    /// `max_payload_bytes` fits beside the reserve (limit ≥ 4/3 of the largest payload).
    pub fn new(limit_bytes: u64, max_payload_bytes: u32) -> PayloadBudget {
        let max_payload_units = u64::from(max_payload_bytes).div_ceil(BUDGET_UNIT_BYTES).max(1);
        let mut limit_units = (limit_bytes / BUDGET_UNIT_BYTES).max(SMALL_REQUEST_UNITS);
        if limit_units - limit_units / 4 < max_payload_units {
            limit_units = (max_payload_units * 4).div_ceil(3) + 1;
        }
        PayloadBudget {
            limit_units,
            large_ceiling_units: limit_units - limit_units / 4,
            used_units: AtomicU64::new(0),
            peak_units: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            released: Arc::new(Notify::new()),
        }
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_units * BUDGET_UNIT_BYTES
    }

    pub fn snapshot(&self) -> BudgetSnapshot {
        BudgetSnapshot {
            limit_bytes: self.limit_bytes(),
            used_bytes: self.used_units.load(Ordering::Relaxed) * BUDGET_UNIT_BYTES,
            peak_bytes: self.peak_units.load(Ordering::Relaxed) * BUDGET_UNIT_BYTES,
            waits: self.waits.load(Ordering::Relaxed),
        }
    }

    /// Takes `units` if they fit under the ceiling that applies to a request of that size.
    pub fn try_take(&self, units: u64) -> bool {
        let ceiling = if units <= SMALL_REQUEST_UNITS { self.limit_units } else { self.large_ceiling_units };
        // SeqCst pairs with `give_back` (see `BudgetWaiter::poll_take`).
        let mut used = self.used_units.load(Ordering::SeqCst);
        loop {
            if used + units > ceiling {
                return false;
            }
            match self.used_units.compare_exchange_weak(used, used + units, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => {
                    let now = used + units;
                    if now > self.peak_units.load(Ordering::Relaxed) {
                        self.peak_units.fetch_max(now, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(actual) => used = actual,
            }
        }
    }

    /// Returns `units` taken earlier and wakes the connections waiting for budget, if any.
    pub fn give_back(&self, units: u64) {
        if units == 0 {
            return;
        }
        let before = self.used_units.fetch_sub(units, Ordering::SeqCst);
        debug_assert!(before >= units, "payload budget given back twice");
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.released.notify_waiters();
        }
    }
}

/// A connection's place in the queue for budget: empty while it does not wait.
pub struct BudgetWaiter {
    budget: Arc<PayloadBudget>,
    notified: Option<Pin<Box<OwnedNotified>>>,
}

impl BudgetWaiter {
    pub fn new(budget: Arc<PayloadBudget>) -> BudgetWaiter {
        BudgetWaiter { budget, notified: None }
    }

    pub fn budget(&self) -> &Arc<PayloadBudget> {
        &self.budget
    }

    /// Takes `units`, or registers the task to be woken when budget is given back.
    ///
    /// No lost wake-up: the `Notified` is created (and so receives every later
    /// `notify_waiters`) before `waiters` is raised and before the retry. Either `give_back`'s
    /// load of `waiters` sees the raise and notifies, or the retry's load of `used_units` sees
    /// the units given back (both sides are `SeqCst`).
    pub fn poll_take(&mut self, cx: &mut Context<'_>, units: u64) -> Poll<()> {
        if self.notified.is_none() {
            if self.budget.try_take(units) {
                return Poll::Ready(());
            }
            self.budget.waits.fetch_add(1, Ordering::Relaxed);
            self.notified = Some(Box::pin(self.budget.released.clone().notified_owned()));
            self.budget.waiters.fetch_add(1, Ordering::SeqCst);
        }
        loop {
            if self.budget.try_take(units) {
                self.stop_waiting();
                return Poll::Ready(());
            }
            let notified = self.notified.as_mut().expect("set above while waiting");
            if notified.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            // Budget was given back: listen again before retrying.
            *notified = Box::pin(self.budget.released.clone().notified_owned());
        }
    }

    /// Leaves the queue (the request that waited was dropped).
    pub fn stop_waiting(&mut self) {
        if self.notified.take().is_some() {
            self.budget.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for BudgetWaiter {
    fn drop(&mut self) {
        self.stop_waiting();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    const MIB: u64 = 1 << 20;

    #[test]
    fn large_requests_leave_the_reserve_to_small_ones() {
        let b = PayloadBudget::new(64 * MIB, 32 << 20);
        assert_eq!(b.limit_bytes(), 64 * MIB);
        let large = 32 * MIB / BUDGET_UNIT_BYTES;
        assert!(b.try_take(large));
        assert!(!b.try_take(large), "a second 32 MiB request would eat into the reserve");
        // Small requests still get the rest, reserve included.
        let small = SMALL_REQUEST_UNITS;
        for _ in 0..32 {
            assert!(b.try_take(small));
        }
        assert!(!b.try_take(1));
        assert_eq!(b.snapshot().peak_bytes, 64 * MIB);
        b.give_back(large + 32 * small);
        assert_eq!(b.snapshot().used_bytes, 0);
    }

    #[test]
    fn limit_is_raised_to_fit_the_largest_payload_beside_the_reserve() {
        let b = PayloadBudget::new(MIB, 32 << 20);
        assert!(b.limit_bytes() >= 32 * MIB * 4 / 3);
        assert!(b.try_take(32 * MIB / BUDGET_UNIT_BYTES));
    }

    #[tokio::test]
    async fn a_waiting_connection_is_woken_when_budget_comes_back() {
        let b = Arc::new(PayloadBudget::new(4 * MIB, MIB as u32));
        let all = b.limit_bytes() / BUDGET_UNIT_BYTES;
        while b.try_take(1) {}
        assert_eq!(b.snapshot().used_bytes, b.limit_bytes());
        let mut w = BudgetWaiter::new(b.clone());
        let waiter = tokio::spawn(async move { poll_fn(|cx| w.poll_take(cx, 1)).await });
        while b.waiters.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiter.is_finished());
        b.give_back(1);
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter).await.unwrap().unwrap();
        assert_eq!(b.waiters.load(Ordering::SeqCst), 0);
        assert_eq!(b.snapshot().used_bytes, all * BUDGET_UNIT_BYTES);
        assert_eq!(b.snapshot().waits, 1);
    }
}
