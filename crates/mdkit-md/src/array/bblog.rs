//! The bad-block policy of the member I/O wrappers and the log writer (md-lifecycle.md 4.2-4.3).
//!
//! - A member write that fails is retried in aligned units of `max(2^bblog_shift, 8)` sectors
//!   (md's narrow_write_error; never less than 4 KiB); each unit that still fails is recorded as
//!   a bad block. The member is kept; the write reports [`MdErrorKind::BadBlockRecorded`] so the
//!   personality counts it like a copy that did not take the data. The record is made durable
//!   (a superblock round writes the log, then the superblock with BAD_BLOCKS) *before* the
//!   member write returns, so no array write is acknowledged on the strength of an entry that a
//!   crash could lose.
//! - The member is failed instead (md_error), as before, when the level has no redundancy, the
//!   member has no log, the log is full, or the round that would persist it fails.
//! - A successful write forgets the ranges it covered; the change is persisted by the next
//!   round (a stale entry only sends reads elsewhere).
//! - The log page is written FUA before the member's superblock in every round where the list
//!   changed: `bblog_size` sectors at `super_offset + bblog_offset`, unused entries all-ones.
//! - A read that no copy and no parity can supply (md's handle_failed_stripe for raid4/5/6,
//!   fix_read_error for raid1/10) records the range on each member whose read failed
//!   ([`ArrayCore::record_unreadable`]): the lost block is never read from the media again
//!   (reads there get EIO at once) until a write replaces it and clears the entry. Only where
//!   that cannot be recorded does the personality fall back to failing the member.

use std::io;

use mdkit_io::{BlockDeviceExt, SharedBuf, WriteFlags};

use super::core::ArrayCore;
use super::errors::{MdError, MdErrorKind};
use super::io::member_error;
use super::member::{Member, flag};
use crate::format::badblocks::{self, BadBlock};

const SECTOR_BYTES: u64 = 512;
/// Retry unit floor: 4 KiB (members are never written in smaller pieces).
const MIN_RETRY_SECTORS: u64 = 8;

impl ArrayCore {
    /// The error for a read of data-area `sector` that a known bad range `bad` covers.
    pub(crate) fn known_bad_block(&self, m: &Member, sector: u64, bad: BadBlock) -> io::Error {
        let detail = format!(
            "the member's bad-block log lists device sectors {}..{}; not read",
            bad.start_sector,
            bad.start_sector + bad.len_sectors
        );
        MdError::new(MdErrorKind::KnownBadBlock, self.name(), "read", sector, detail).member(m.name()).into()
    }

    /// A write of data-area `[sector, sector + len)` landed: forget bad blocks there.
    pub(crate) fn note_good_write(&self, m: &Member, sector: u64, len_sectors: u64) {
        if m.bad_blocks().is_empty() {
            return;
        }
        if m.bad_blocks().clear(m.data_offset_sectors + sector, len_sectors) {
            tracing::info!(
                array = self.name(),
                member = m.name(),
                sector,
                len_sectors,
                "bad blocks cleared by a successful write"
            );
        }
    }

    /// A member write (or write-zeroes, `data` `None`) failed with `e`: record bad blocks or
    /// fail the member (see the module documentation).
    pub(crate) async fn write_error(
        &self,
        m: &Member,
        op: &'static str,
        sector: u64,
        len_sectors: u64,
        data: Option<(&SharedBuf, WriteFlags)>,
        e: io::Error,
    ) -> io::Result<()> {
        let err = member_error(self, m, op, sector, e);
        if !self.personality().has_redundancy() || !m.bad_blocks().has_log() || m.is_faulty() {
            self.fail_member_on_error(m, &err.to_string());
            return Err(err);
        }
        let bad = match data {
            Some((buf, flags)) => self.narrow_write_error(m, sector, buf, flags).await,
            None => vec![(sector, len_sectors)],
        };
        if bad.is_empty() {
            tracing::warn!(
                array = self.name(),
                member = m.name(),
                sector,
                "write error did not repeat on retry: {err}"
            );
            return Ok(());
        }
        for (s, n) in &bad {
            if !m.bad_blocks().set(m.data_offset_sectors + s, *n) {
                let why = format!("{err}; sectors {s}..{} cannot be recorded: the bad-block log is full", s + n);
                self.fail_member_on_error(m, &why);
                return Err(err);
            }
        }
        if let Err(e) = self.update_superblocks("bad block recorded").await {
            self.fail_member_on_error(m, &format!("{err}; the bad-block log could not be written: {e}"));
            return Err(err);
        }
        if m.is_faulty() {
            return Err(err);
        }
        m.set(flag::WRITE_ERROR_SEEN);
        let ranges: Vec<String> = bad.iter().map(|(s, n)| format!("{s}+{n}")).collect();
        tracing::warn!(
            array = self.name(),
            member = m.name(),
            ranges = %ranges.join(","),
            "write error recorded as bad blocks (data-area sectors); the member stays: {err}"
        );
        let detail = format!("data-area sectors {} recorded in the bad-block log: {err}", ranges.join(", "));
        Err(MdError::new(MdErrorKind::BadBlockRecorded, self.name(), op, sector, detail).member(m.name()).into())
    }

    /// A read of data-area `[sector, sector + len_sectors)` failed on `m` and nothing else could
    /// supply the data: record the range in `m`'s bad-block log (md's rdev_set_badblocks after
    /// an uncorrectable read) and start a superblock round to persist it. Returns whether it is
    /// recorded; `false` when `m` is faulty, has no log or its log is full (the caller then
    /// applies the level's old rule). A round that fails to persist the entry leaves it in
    /// memory (reads still avoid the range; the next round retries): no acknowledged write
    /// depends on it.
    pub(crate) async fn record_unreadable(&self, m: &Member, sector: u64, len_sectors: u64) -> bool {
        let log = m.bad_blocks();
        if m.is_faulty() || !log.has_log() {
            return false;
        }
        let generation = log.snapshot().1;
        if !log.set(m.data_offset_sectors + sector, len_sectors) {
            return false;
        }
        if log.snapshot().1 == generation {
            return true; // already listed (a read of a known bad range): nothing to persist
        }
        tracing::warn!(
            array = self.name(),
            member = m.name(),
            sector,
            len_sectors,
            "read error not correctable: data-area range recorded as a bad block; the member stays"
        );
        if let Err(e) = self.update_superblocks("bad block recorded after a read error").await {
            tracing::warn!(array = self.name(), member = m.name(), "bad-block log not yet persisted: {e}");
        }
        true
    }

    /// Rewrites `buf` at data-area `sector` unit by unit; returns the `(sector, len)` runs that
    /// still fail (adjacent units merged). Units that land forget their bad blocks.
    async fn narrow_write_error(&self, m: &Member, sector: u64, buf: &SharedBuf, flags: WriteFlags) -> Vec<(u64, u64)> {
        let shift = m.bad_blocks().shift().unwrap_or(0);
        let unit = (1u64 << shift).max(MIN_RETRY_SECTORS);
        let end = sector + buf.len() as u64 / SECTOR_BYTES;
        let mut bad: Vec<(u64, u64)> = Vec::new();
        let mut s = sector;
        while s < end {
            let next = ((s / unit + 1) * unit).min(end);
            let piece = buf.slice(((s - sector) * SECTOR_BYTES) as usize..((next - sector) * SECTOR_BYTES) as usize);
            let r = {
                let _g = m.io_started();
                m.device().write((m.data_offset_sectors + s) * SECTOR_BYTES, piece, flags).await
            };
            match r {
                Ok(()) => self.note_good_write(m, s, next - s),
                Err(_) => match bad.last_mut() {
                    Some((bs, bn)) if *bs + *bn == s => *bn += next - s,
                    _ => bad.push((s, next - s)),
                },
            }
            s = next;
        }
        bad
    }

    /// Writes `entries` into `m`'s bad-block log (FUA), preserving whatever shares the log's
    /// 4 KiB blocks when the log is smaller or unaligned.
    pub(crate) async fn write_bblog(&self, m: &Member, entries: &[BadBlock]) -> io::Result<()> {
        let sb = m.superblock();
        let Some(sector) = sb.bblog_sector() else { return Ok(()) };
        let page = badblocks::encode(entries, sb.bblog_shift)
            .map_err(|e| io::Error::other(format!("{}: member {}: bad-block log: {e}", self.name(), m.name())))?;
        let size = (u64::from(sb.bblog_size_sectors) * SECTOR_BYTES).min(page.len() as u64);
        let start = sector * SECTOR_BYTES;
        let lo = start & !4095;
        let hi = (start + size).div_ceil(4096) * 4096;
        let mut block = if lo == start && hi == start + size {
            vec![0u8; (hi - lo) as usize]
        } else {
            m.device().read_metadata(lo, (hi - lo) as usize).await.map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("{}: member {}: reading around the bad-block log at byte {lo}: {e}", self.name(), m.name()),
                )
            })?
        };
        let at = (start - lo) as usize;
        block[at..at + size as usize].copy_from_slice(&page[..size as usize]);
        self.member_write_meta(m, lo, SharedBuf::from_slice(&block)).await
    }
}
