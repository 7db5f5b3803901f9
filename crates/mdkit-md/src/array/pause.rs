//! Pausing a running array's requests while `grow` replaces it (md's mddev_suspend).
//!
//! Hot path: one atomic word, `PAUSED` bit + requests in flight, as the write gate
//! ([`super::gate`]) keeps it; no lock is taken unless a pause is on. A pauser sets `PAUSED`
//! (new requests then wait, none fails), waits until the requests in flight have drained, and
//! holds the pause until its guard drops. One pauser at a time.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{Mutex, MutexGuard, Notify};

/// Set while a pause is on (requests arriving meanwhile wait).
const PAUSED: u64 = 1 << 63;

/// See the module documentation.
pub struct Pause {
    /// `PAUSED` | requests in flight.
    state: AtomicU64,
    /// Wakes waiting requests when a pause ends, and the pauser when the last request leaves.
    changed: Notify,
    /// Serialises pausers.
    pausers: Mutex<()>,
}

/// A request in flight; it counts until dropped.
pub struct Entered<'a>(&'a Pause);

/// A pause in force (no request in flight, new ones waiting) until dropped.
pub struct Paused<'a> {
    pause: &'a Pause,
    _one: MutexGuard<'a, ()>,
}

impl Default for Pause {
    fn default() -> Pause {
        Pause { state: AtomicU64::new(0), changed: Notify::new(), pausers: Mutex::new(()) }
    }
}

impl Pause {
    /// Counts a request in flight, first waiting out a pause that is on.
    pub async fn enter(&self) -> Entered<'_> {
        loop {
            if self.try_enter() {
                return Entered(self);
            }
            let woken = self.changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.try_enter() {
                return Entered(self);
            }
            woken.await;
        }
    }

    fn try_enter(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        while s & PAUSED == 0 {
            match self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
        false
    }

    /// Stops new requests and waits until none is in flight.
    pub async fn pause(&self) -> Paused<'_> {
        let one = self.pausers.lock().await;
        self.state.fetch_or(PAUSED, Ordering::AcqRel);
        loop {
            let drained = self.changed.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.state.load(Ordering::Acquire) & !PAUSED == 0 {
                return Paused { pause: self, _one: one };
            }
            drained.await;
        }
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let before = self.0.state.fetch_sub(1, Ordering::AcqRel);
        if before == PAUSED | 1 {
            self.0.changed.notify_waiters();
        }
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        self.pause.state.fetch_and(!PAUSED, Ordering::AcqRel);
        self.pause.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_pause_waits_for_requests_in_flight_and_holds_new_ones() {
        let p = Arc::new(Pause::default());
        let first = p.enter().await;
        let pauser = tokio::spawn({
            let p = p.clone();
            async move {
                let _g = p.pause().await;
                assert_eq!(p.state.load(Ordering::Acquire), PAUSED, "nothing in flight while paused");
                tokio::task::yield_now().await;
            }
        });
        tokio::task::yield_now().await;
        assert!(!pauser.is_finished(), "the pause waits for the request in flight");
        assert!(!p.try_enter(), "new requests wait once a pause is pending");
        let later = tokio::spawn({
            let p = p.clone();
            async move {
                let _e = p.enter().await;
            }
        });
        drop(first);
        pauser.await.unwrap();
        later.await.unwrap();
        assert_eq!(p.state.load(Ordering::Acquire), 0);
    }
}
