//! The write gate: md's clean <-> active transitions.
//!
//! Before the first write after the array was marked clean, the superblocks are rewritten
//! "active" (`resync_offset = 0`) on every member and the write waits until that is durable:
//! a crash from then on leaves the array marked dirty, so assembly resyncs it. After
//! `safe_mode_delay` (200 ms by default) without writes, the array daemon marks it clean again
//! (`resync_offset = MaxSector`, or the resync checkpoint while a resync is unfinished).
//!
//! Hot path: one atomic word, `ACTIVE` bit + writes in flight. Only transitions take the
//! (async) transition lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

/// md's default `safe_mode_delay`.
pub const DEFAULT_SAFE_MODE_DELAY: Duration = Duration::from_millis(200);

/// Set while the superblocks say "active" and no clean transition is running.
const ACTIVE: u64 = 1 << 63;

/// See the module documentation.
pub struct WriteGate {
    /// `ACTIVE` | writes in flight.
    state: AtomicU64,
    /// What the superblock writer puts on disk: active (true) or clean (false).
    pub(crate) want_active: AtomicBool,
    pub(crate) transition: Mutex<()>,
    epoch: Instant,
    last_write_end_ms: AtomicU64,
    safe_mode_delay_ms: AtomicU64,
}

impl WriteGate {
    /// A gate for an array whose superblocks currently say active (`active_on_disk`) or clean.
    pub fn new(active_on_disk: bool) -> WriteGate {
        WriteGate {
            state: AtomicU64::new(if active_on_disk { ACTIVE } else { 0 }),
            want_active: AtomicBool::new(active_on_disk),
            transition: Mutex::new(()),
            epoch: Instant::now(),
            last_write_end_ms: AtomicU64::new(0),
            safe_mode_delay_ms: AtomicU64::new(DEFAULT_SAFE_MODE_DELAY.as_millis() as u64),
        }
    }

    /// Counts a write in flight if the array is already active; `false` means the caller must
    /// take the slow path ([`WriteGate::enter_after_transition`] under the transition lock).
    pub fn try_enter(&self) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & ACTIVE == 0 {
                return false;
            }
            match self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Marks the gate active (the caller wrote the superblocks) and counts one write.
    /// Call with the transition lock held.
    pub fn enter_after_transition(&self) {
        self.state.fetch_or(ACTIVE, Ordering::AcqRel);
        self.state.fetch_add(1, Ordering::AcqRel);
    }

    /// Counts one more write for a caller already counted (the array is active and stays so
    /// while it is counted): a behind write keeps the array dirty until it completes.
    pub fn hold(&self) {
        let prev = self.state.fetch_add(1, Ordering::AcqRel);
        debug_assert!(prev & ACTIVE != 0 && prev & !ACTIVE > 0, "write gate hold without enter");
    }

    /// A write finished; returns true when it was the last one in flight.
    pub fn exit(&self) -> bool {
        self.last_write_end_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Release);
        let prev = self.state.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev & !ACTIVE > 0, "write gate exit without enter");
        prev & !ACTIVE == 1
    }

    pub fn is_active(&self) -> bool {
        self.state.load(Ordering::Acquire) & ACTIVE != 0
    }

    pub fn writes_in_flight(&self) -> u64 {
        self.state.load(Ordering::Acquire) & !ACTIVE
    }

    /// Time since the last write finished.
    pub fn idle_for(&self) -> Duration {
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_write_end_ms.load(Ordering::Acquire)))
    }

    /// Attempts to leave the active state: succeeds only with no write in flight. The caller
    /// holds the transition lock and then writes the superblocks clean.
    pub fn try_begin_clean(&self) -> bool {
        self.state.compare_exchange(ACTIVE, 0, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Undoes a failed clean transition (the array stays active).
    pub fn abort_clean(&self) {
        self.state.fetch_or(ACTIVE, Ordering::AcqRel);
    }

    pub fn safe_mode_delay(&self) -> Duration {
        Duration::from_millis(self.safe_mode_delay_ms.load(Ordering::Relaxed))
    }

    pub fn set_safe_mode_delay(&self, d: Duration) {
        self.safe_mode_delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_path_only_when_active() {
        let g = WriteGate::new(false);
        assert!(!g.try_enter());
        g.enter_after_transition();
        assert!(g.is_active());
        assert!(g.try_enter());
        assert_eq!(g.writes_in_flight(), 2);
        assert!(!g.try_begin_clean(), "writes in flight");
        assert!(!g.exit());
        assert!(g.exit());
        assert!(g.try_begin_clean());
        assert!(!g.is_active() && !g.try_enter());
        g.abort_clean();
        assert!(g.try_enter());
    }
}
