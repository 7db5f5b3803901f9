//! Lazy clearing: the daemon and its sweeps (md_bitmap_daemon_work, made safe to run while
//! writes continue).
//!
//! A sweep, one at a time:
//! 1. **Age**: every dirty, idle, not-needed chunk gets `age + 1` (a CAS; a `start_write`
//!    resets the age to 0). That includes bits set for a `start_write` that failed or was
//!    dropped before returning (not durable, nothing pending): no data write was issued for
//!    them, so they clear like idle ones. Chunks whose new age reaches `min_age` are candidates,
//!    remembered with the exact state word the CAS left.
//! 2. **events_cleared**: set to the md events that every working member's superblock holds
//!    ([`WriteIntentBitmap::superblocks_recorded`](super::WriteIntentBitmap::superblocks_recorded),
//!    not the header's `events`, which a round in progress has raised already) and written
//!    durably (page 0) before any bit is cleared, so a member that left before this point is
//!    never re-added on the strength of bits cleared after it left, and a member that fails
//!    during a superblock round can still be re-added from the bitmap.
//! 3. **Flush** every working member. Every data write to a candidate ended before step 1
//!    (the chunk was idle then and no write started since, or the CAS below fails), so the
//!    flush covers them all. A failed flush aborts the sweep.
//! 4. **Clear**, under each page's lock: a candidate whose state word is still exactly what
//!    step 1 left loses DURABLE and its bit; then the page's next round writes it (no FUA: a
//!    lost clear only costs resync work). Writers racing with this see DURABLE gone and set the
//!    bit again through a FUA round.
//!
//! Nothing is cleared while the array is degraded or `can_clear` is false.
//!
//! The daemon sweeps every `time_base` with `min_age` 2 (a chunk is cleared after one whole
//! idle period, as the kernel's 2 -> 1 -> 0 counter does) and, as soon as the idle dirty
//! chunks reach `flush_chunks`, with `min_age` 1 (every chunk idle now).
//!
//! **Idle regions.** Periodic sweeps judge idleness per region of `idle_region_bytes` of the
//! sync domain, not per chunk (the upstream llbitmap rule: its daemon clears a bitmap page's
//! bits only once the whole page has gone unwritten for `barrier_idle`). In step 1 a region's
//! dirty chunks all take the age of its youngest one (a chunk with a write in flight has age
//! 0), so none of them clears while anything in the region is still being written. A random
//! workload spread over many chunks then keeps its bits set instead of paying a FUA bitmap
//! write per member each time it comes back to a chunk that was cleared under it (with 4 MiB
//! chunks over 1 TiB and per-chunk clearing, most random 4 KiB writes did). The price is a
//! longer resync after a crash: every chunk written since its region last went idle. Regions
//! are derived from the chunk states at sweep time, so the write path pays nothing for them;
//! `idle_region_bytes` = 0 (or less than a chunk) is md's per-chunk rule. Threshold and
//! explicit sweeps stay per chunk: `flush_chunks` bounds the dirty chunks whatever the regions.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::chunks::ChunkState;
use super::pages::{FIRST_CHUNK_BIT, RoundKind, chunk_slot, slot_chunk};
use super::{Inner, THRESHOLD_POLL};

/// Periodic sweeps clear chunks idle for a whole period.
const PERIODIC_MIN_AGE: u32 = 2;
/// Threshold and explicit sweeps clear every idle chunk.
const EAGER_MIN_AGE: u32 = 1;

/// The background task: periodic and threshold sweeps until the bitmap stops.
pub(super) async fn daemon(inner: Arc<Inner>) {
    let mut next_periodic = tokio::time::Instant::now() + inner.daemon_sleep();
    loop {
        if inner.stopped.load(Ordering::Acquire) {
            return;
        }
        let poll_at = tokio::time::Instant::now() + THRESHOLD_POLL.min(inner.daemon_sleep());
        let kicked = tokio::select! {
            _ = inner.stop.notified() => continue,
            _ = inner.kick.notified() => true,
            _ = inner.retime.notified() => false,
            _ = tokio::time::sleep_until(next_periodic.min(poll_at)) => false,
        };
        if inner.stopped.load(Ordering::Acquire) {
            return;
        }
        let now = tokio::time::Instant::now();
        // A shorter time_base takes effect at once.
        next_periodic = next_periodic.min(now + inner.daemon_sleep());
        let min_age = if now >= next_periodic {
            next_periodic = now + inner.daemon_sleep();
            PERIODIC_MIN_AGE
        } else if kicked || over_threshold(&inner) {
            EAGER_MIN_AGE
        } else {
            continue;
        };
        if let Err(e) = sweep(&inner, min_age).await {
            tracing::warn!("{}: bitmap clear sweep: {e}", inner.name);
        }
    }
}

fn over_threshold(inner: &Inner) -> bool {
    let limit = inner.settings.flush_chunks.load(Ordering::Relaxed);
    limit != 0 && inner.idle_dirty.sum() >= limit && inner.clearing_allowed()
}

/// One sweep (see the module documentation); returns the number of bits cleared.
pub(super) async fn sweep(inner: &Arc<Inner>, min_age: u32) -> io::Result<u64> {
    let _one_at_a_time = inner.sweep_lock.lock().await;
    inner.kick_pending.store(false, Ordering::Release);
    inner.stats.sweeps.fetch_add(1, Ordering::Relaxed);
    if !inner.clearing_allowed() {
        return Ok(0);
    }
    let region_chunks = if min_age >= PERIODIC_MIN_AGE { inner.idle_region_chunks() } else { 1 };
    let candidates = age_idle_chunks(inner, min_age, region_chunks);
    if candidates.is_empty() {
        return Ok(0);
    }
    // The recorded count is read before the degraded flag is checked again: a round that
    // records a newer count after a member failed set the flag before it (refresh_bitmap
    // opens every round), so a sweep that sees the newer count also sees the array degraded.
    let recorded = inner.events_recorded.load(Ordering::Acquire);
    if !inner.clearing_allowed() {
        return Ok(0);
    }
    let advance = {
        let mut h = inner.header.lock();
        let target = recorded.min(h.events);
        let advance = h.events_cleared < target;
        if advance {
            h.events_cleared = target;
        }
        advance
    };
    if advance {
        inner.write_header().await?;
    }
    inner.flush_members().await?;
    if !inner.clearing_allowed() {
        return Ok(0);
    }
    Ok(clear(inner, &candidates).await)
}

/// Step 1: ages idle chunks, a region of `region_chunks` chunks at a time (every sweepable
/// dirty chunk of a region gets the age of the region's youngest dirty chunk plus one; a chunk
/// with a write in flight counts as age 0); returns `(chunk, state word left by the aging CAS)`
/// for those that reached `min_age`, ascending.
fn age_idle_chunks(inner: &Inner, min_age: u32, region_chunks: u64) -> Vec<(u64, u32)> {
    let region_chunks = region_chunks.max(1);
    let mut out = Vec::new();
    let mut region = Region { id: u64::MAX, youngest: ChunkState::AGE_MAX, members: Vec::new() };
    let chunks = inner.chunks();
    for (p, page) in inner.pages.iter().enumerate() {
        let Some(block) = page.chunks.get() else { continue };
        for (w, word) in page.words.iter().enumerate() {
            if p == 0 && (w as u64) < FIRST_CHUNK_BIT / 64 {
                continue;
            }
            let mut bits = word.load(Ordering::Acquire);
            while bits != 0 {
                let b = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let chunk = slot_chunk(p, b);
                if chunk >= chunks {
                    break;
                }
                if chunk / region_chunks != region.id {
                    region.age(min_age, &mut out);
                    region.id = chunk / region_chunks;
                }
                let state = &block[b];
                let old = state.load(Ordering::Acquire);
                if ChunkState::pending(old) > 0 {
                    region.youngest = 0; // being written: the region is busy
                }
                if !ChunkState::sweepable(old) {
                    continue;
                }
                region.youngest = region.youngest.min(ChunkState::age(old));
                region.members.push((chunk, state));
            }
        }
    }
    region.age(min_age, &mut out);
    out
}

/// The sweepable dirty chunks of one region, gathered by [`age_idle_chunks`].
struct Region<'a> {
    id: u64,
    /// Lowest age among the region's dirty chunks (0 when one has a write in flight).
    youngest: u32,
    members: Vec<(u64, &'a AtomicU32)>,
}

impl Region<'_> {
    /// Ages the gathered chunks to `youngest + 1` and appends those reaching `min_age` to
    /// `out`; then starts an empty region.
    fn age(&mut self, min_age: u32, out: &mut Vec<(u64, u32)>) {
        let age = (self.youngest + 1).min(ChunkState::AGE_MAX);
        for &(chunk, state) in &self.members {
            let old = state.load(Ordering::Acquire);
            if !ChunkState::sweepable(old) {
                continue; // a write started since it was gathered
            }
            let new = ChunkState::with_age(old, age);
            if new != old && state.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue; // a write started: not idle
            }
            if age >= min_age {
                out.push((chunk, new));
            }
        }
        self.members.clear();
        self.youngest = ChunkState::AGE_MAX;
    }
}

/// Step 4: clears the candidates still untouched since aging and writes their pages (one
/// round for all of them).
async fn clear(inner: &Arc<Inner>, candidates: &[(u64, u32)]) -> u64 {
    let mut cleared = 0u64;
    let need = inner.join_round(false, RoundKind::Clear, |pages, wanted| {
        for &(chunk, expected) in candidates {
            let (p, bit) = chunk_slot(chunk);
            let page = &pages[p];
            let new = ChunkState::with_age(expected & !ChunkState::DURABLE, 0);
            if page.chunk_block()[bit].compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                page.clear_bit(bit);
                inner.account(chunk, expected, new);
                wanted.insert(p);
                cleared += 1;
            }
        }
        cleared > 0
    });
    inner.stats.bits_cleared.fetch_add(cleared, Ordering::Relaxed);
    if let Some(need) = need
        && let Err(e) = inner.wait_round(need).await
    {
        // The bits stay set on disk: safe, only more resync work after a crash.
        tracing::warn!("{}: writing cleared bitmap bits: {e}", inner.name);
    }
    cleared
}
