//! Per-chunk in-memory state and sharded counters.
//!
//! Each chunk has one `AtomicU32`, changed only by compare-and-swap:
//! ```text
//!  bits 0..19  pending   data writes between start_write and end_write (max COUNTER_MAX)
//!  bit  20     DURABLE   the bit is set and durable on every working member
//!  bit  21     NEEDED    the chunk needs resync/recovery (never cleared until end_sync)
//!  bits 24..25 age       clear sweeps that found the chunk idle (reset by every start_write)
//! ```
//! The chunk's bit in the page image (`Page::words`) is the other half of the state: set under
//! the page lock before a round is joined, cleared under the page lock by a sweep after its
//! member flush. Every value the words can hold is safe to write at any time.

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use crate::format::bitmap::COUNTER_MAX;

/// Namespace for the chunk state word.
pub(super) struct ChunkState;

impl ChunkState {
    pub const PENDING_MASK: u32 = (1 << 20) - 1;
    pub const DURABLE: u32 = 1 << 20;
    pub const NEEDED: u32 = 1 << 21;
    const AGE_SHIFT: u32 = 24;
    const AGE_MASK: u32 = 3 << Self::AGE_SHIFT;
    pub const AGE_MAX: u32 = 3;
    /// Pending writes per chunk at most (the kernel's COUNTER_MAX); more wait.
    pub const PENDING_MAX: u32 = COUNTER_MAX;

    pub fn pending(s: u32) -> u32 {
        s & Self::PENDING_MASK
    }

    pub fn age(s: u32) -> u32 {
        (s & Self::AGE_MASK) >> Self::AGE_SHIFT
    }

    pub fn with_age(s: u32, age: u32) -> u32 {
        debug_assert!(age <= Self::AGE_MAX);
        (s & !Self::AGE_MASK) | (age << Self::AGE_SHIFT)
    }

    /// Idle and not needed: a sweep may clear the chunk's bit (when set). Without DURABLE this
    /// is a bit set for a `start_write` that never returned: no data write was issued for it.
    pub fn sweepable(s: u32) -> bool {
        s & Self::NEEDED == 0 && Self::pending(s) == 0
    }

    /// Dirty, durable, idle and not needed: what `flush_chunks` counts.
    pub fn clearable(s: u32) -> bool {
        s & (Self::DURABLE | Self::NEEDED) == Self::DURABLE && Self::pending(s) == 0
    }
}

const _: () = assert!(ChunkState::PENDING_MAX <= ChunkState::PENDING_MASK);
const _: () =
    assert!(ChunkState::PENDING_MASK & (ChunkState::DURABLE | ChunkState::NEEDED | ChunkState::AGE_MASK) == 0);

/// A fresh block of chunk states (one per bitmap page).
pub(super) fn new_block(len: usize) -> Box<[AtomicU32]> {
    (0..len).map(|_| AtomicU32::new(0)).collect()
}

//------------------------------------------------------------------------------------------------

/// Number of shards of every hot-path counter.
pub(super) const SHARDS: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct PaddedCounter(AtomicI64);

/// A counter split over cache-line-padded shards chosen by chunk, so writers of different
/// chunks do not bounce one cache line. Reads sum the shards (never below 0).
#[derive(Default)]
pub(super) struct Sharded {
    shards: [PaddedCounter; SHARDS],
}

impl Sharded {
    /// Adds `delta` to the shard of `key`; returns that shard's new value.
    pub fn add(&self, key: u64, delta: i64) -> i64 {
        let shard = &self.shards[(key % SHARDS as u64) as usize].0;
        shard.fetch_add(delta, Ordering::Relaxed) + delta
    }

    pub fn sum(&self) -> u64 {
        let total: i64 = self.shards.iter().map(|s| s.0.load(Ordering::Relaxed)).sum();
        total.max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_word_fields() {
        let s = ChunkState::DURABLE | 5;
        assert_eq!(ChunkState::pending(s), 5);
        assert!(!ChunkState::clearable(s));
        let idle = ChunkState::with_age(ChunkState::DURABLE, 2);
        assert_eq!(ChunkState::age(idle), 2);
        assert!(ChunkState::clearable(idle));
        assert!(!ChunkState::clearable(idle | ChunkState::NEEDED));
        assert!(!ChunkState::clearable(0));
        assert_eq!(ChunkState::with_age(idle, 0), ChunkState::DURABLE);
    }

    #[test]
    fn sharded_counter_sums() {
        let c = Sharded::default();
        for k in 0..100 {
            c.add(k, 1);
        }
        assert_eq!(c.sum(), 100);
        c.add(3, -1);
        assert_eq!(c.sum(), 99);
        let d = Sharded::default();
        d.add(1, -1);
        assert_eq!(d.sum(), 0, "never below zero");
    }
}
