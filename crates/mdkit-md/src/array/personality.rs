//! The level-specific half of an array: the [`Personality`] trait every RAID level implements,
//! and the types sync work reports with.
//!
//! The core ([`ArrayCore`]) owns everything level-independent: members and their failure, the
//! superblocks, the dirty/clean gate, the region barrier, the bitmap, flushes and the sync
//! engine's scheduling. A personality maps array sectors to member sectors, chooses copies,
//! and does one unit of sync work when the engine asks. It reaches members only through the
//! core's wrappers (`ArrayCore::member_read`, `member_write`, ...), which add the data offset,
//! count in-flight requests and fail members on write errors.
//!
//! Units: every `*_sectors` value is 512-byte sectors. Array sectors are what the array's user
//! sees; member sectors are relative to a member's `data_offset`.

use std::io;
use std::ops::Range;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags};

use super::core::ArrayCore;
use super::slots::SlotTable;
use crate::layout::Level;

/// What one unit of sync work does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncMode {
    /// Make the copies/parity of an unclean array consistent (read one, write the others).
    Resync,
    /// Rebuild members that are in a slot but not in sync (spares being recovered, re-added
    /// members, replacements) from the in-sync ones. Ranges are in the *recovery* domain.
    Recover,
    /// Read every copy/parity and count mismatches, changing nothing.
    Check,
    /// Like check, and rewrite what does not match.
    Repair,
}

impl SyncMode {
    /// md's `sync_action` word.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncMode::Resync => "resync",
            SyncMode::Recover => "recover",
            SyncMode::Check => "check",
            SyncMode::Repair => "repair",
        }
    }
}

/// What a unit of sync work found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncOutcome {
    /// Sectors counted as mismatched, md semantics: a whole compare unit (64 KiB for the
    /// mirrors) adds its sectors when any byte differs.
    pub mismatch_sectors: u64,
    /// The mismatched units as sync-domain sector ranges (ascending, merged where adjacent).
    pub mismatch_ranges: Vec<Range<u64>>,
}

impl SyncOutcome {
    /// Records a mismatched unit.
    pub fn add_mismatch(&mut self, range: Range<u64>) {
        self.mismatch_sectors += range.end - range.start;
        match self.mismatch_ranges.last_mut() {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => self.mismatch_ranges.push(range),
        }
    }

    /// Records a unit in which `copies` copies differ from the reference: md counts the unit's
    /// sectors once per differing copy; the range is recorded once.
    pub fn add_mismatch_copies(&mut self, range: Range<u64>, copies: u64) {
        let len = range.end - range.start;
        self.add_mismatch(range);
        self.mismatch_sectors += len * copies.saturating_sub(1);
    }

    /// Appends another outcome (for later ranges).
    pub fn merge(&mut self, other: SyncOutcome) {
        let ranged: u64 = other.mismatch_ranges.iter().map(|r| r.end - r.start).sum();
        for r in other.mismatch_ranges {
            self.add_mismatch(r);
        }
        self.mismatch_sectors += other.mismatch_sectors - ranged;
    }
}

/// One RAID level. See the module documentation for the split between core and personality.
///
/// Contract the core relies on:
/// - `read`/`write`/`discard`/`write_zeroes` get requests already validated against the array
///   size and 4 KiB aligned; writes arrive after the write gate (array marked dirty), the bitmap
///   (bits durable) and the region barrier (no sync work in the range);
/// - a write returns `Ok` only when the data is on enough members to be read back while the
///   level's redundancy lasts; members that failed a write were failed by the core's wrapper and
///   the core makes that failure durable before acknowledging;
/// - a read returns `Ok` only with correct data; read errors are retried on other copies (or
///   reconstructed) and repaired where possible, and a member is failed with
///   [`ArrayCore::fail_member`] when it cannot be repaired;
/// - `sync_range` raises the region barrier itself (it knows how its domain maps to the
///   barrier's, which is the sync domain).
pub trait Personality: Send + Sync + 'static {
    fn level(&self) -> Level;

    /// Array size in sectors.
    fn array_sectors(&self) -> u64;

    /// Whether the array can run (serve I/O) with the members the slot table says are usable.
    fn can_run(&self, slots: &SlotTable) -> bool;

    /// Slots without a working, in-sync member (md's `degraded`).
    fn degraded(&self, slots: &SlotTable) -> u32 {
        slots.missing_in_sync()
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, buf: IoBuf) -> IoFuture<'a, ReadResult>;

    fn write<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>>;

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>>;

    /// The range reads back as zeroes afterwards.
    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>>;

    /// The sync domain: what resync_offset, check/repair ranges and bitmap bits count in
    /// (per-member sectors for raid1/4/5/6, array sectors for raid10; 0 for raid0).
    fn sync_domain_sectors(&self) -> u64;

    /// The recovery domain: what `recovery_offset` counts in — per-member sectors for every
    /// level (md rebuilds raid10 by device sector too). Defaults to the sync domain.
    fn recovery_domain_sectors(&self) -> u64 {
        self.sync_domain_sectors()
    }

    /// Whether recovery ranges are sync-domain ranges (so a bitmap-guided recovery can skip the
    /// chunks the bitmap does not need). False for raid10, which rebuilds by member sector.
    fn recovery_uses_sync_domain(&self) -> bool {
        true
    }

    /// Sync-domain range touched by an array range (for bitmap bits and barriers).
    fn sync_range_of(&self, offset_sectors: u64, len_sectors: u64) -> Range<u64>;

    /// One unit of background work on `[start, start+len)` of the sync domain (of the recovery
    /// domain for [`SyncMode::Recover`]). Targets of a recovery are the working members in a
    /// role that are not in sync and whose `recovery_offset < start + len` (rewriting what a
    /// target already holds is harmless); the engine advances their `recovery_offset`.
    fn sync_range<'a>(
        &'a self,
        a: &'a ArrayCore,
        mode: SyncMode,
        start: u64,
        len: u64,
    ) -> IoFuture<'a, io::Result<SyncOutcome>>;

    /// Whether losing a member loses data for this level's I/O (raid0): member errors are then
    /// reported to the user instead of failing the member.
    fn has_redundancy(&self) -> bool {
        self.level().max_degraded() > 0
    }

    /// raid4/5/6: a member with more failed reads in a row than this is failed (md: the stripe
    /// cache size). `None`: the level counts read errors per fix attempt (raid1/raid10).
    fn read_error_limit(&self) -> Option<u64> {
        None
    }

    /// Largest preferred I/O (bytes) for the array topology (a full stripe or a chunk).
    fn optimal_io_bytes(&self) -> u32 {
        4096
    }

    /// Personality attributes with md's sysfs names (`stripe_cache_size`, ...).
    fn attributes(&self) -> Vec<(&'static str, String)> {
        vec![]
    }

    /// Sets a personality attribute; `None` when the name is not one of its attributes.
    fn set_attribute(&self, _name: &str, _value: &str) -> Option<io::Result<()>> {
        None
    }

    /// The reshape in progress, when this personality serves one (`array/reshape.rs`).
    fn reshape(&self) -> Option<&super::reshape::Reshape> {
        None
    }

    /// Called once when the array stops (after the last user I/O): drain caches, stop threads.
    fn stop<'a>(&'a self, _a: &'a ArrayCore) -> IoFuture<'a, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_merges_adjacent_ranges() {
        let mut o = SyncOutcome::default();
        o.add_mismatch(0..128);
        o.add_mismatch(128..256);
        o.add_mismatch(512..640);
        let mut p = SyncOutcome::default();
        p.add_mismatch(640..700);
        o.merge(p);
        assert_eq!(o.mismatch_sectors, 128 * 3 + 60);
        assert_eq!(o.mismatch_ranges, vec![0..256, 512..700]);
    }
}
