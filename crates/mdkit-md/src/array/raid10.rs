//! raid10: near / far / offset copies (from `layout::Raid10Geometry`). Requests are split at
//! chunk boundaries; each piece has `near * far` copies and is read from the least-busy readable
//! copy (the other copies on error, with md's rewrite repair) and written to all of them. The
//! sync domain (resync, check, repair, bitmap) is array sectors; the recovery domain is member
//! sectors, as in md: a rebuilding member is walked by its own sectors, each piece read from
//! another copy of the array range it holds.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags, join_read_parts};

use super::core::ArrayCore;
use super::io::join_all;
use super::member::{Base, Member, flag};
use super::mirror;
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::raid0::chunk_pieces;
use super::slots::SlotTable;
use crate::layout::{Level, MemberSector, Raid10Geometry};

/// See the module documentation.
pub struct Raid10 {
    geo: Raid10Geometry,
    raid_disks: usize,
    chunk_sectors: u64,
    /// Which geometry's start member sectors count from (a reshape runs two of them).
    pub(crate) base: Base,
}

impl Raid10 {
    pub fn new(geo: Raid10Geometry, raid_disks: u32) -> Raid10 {
        let chunk_sectors = geo.chunk_sectors();
        Raid10 { geo, raid_disks: raid_disks as usize, chunk_sectors, base: Base::DataOffset }
    }

    /// The copies of `sector`, as sectors of each member's data area.
    fn copies(&self, a: &ArrayCore, sector: u64) -> io::Result<Vec<MemberSector>> {
        let mut copies = self
            .geo
            .map(sector)
            .ok_or_else(|| io::Error::other(format!("{}: array sector {sector} does not map", a.name())))?;
        if self.base != Base::DataOffset {
            let slots = a.slots();
            for c in &mut copies {
                c.sector += slots.slot(c.member).and_then(|s| s.member.as_ref()).map_or(0, |m| self.base.of(m));
            }
        }
        Ok(copies)
    }

    /// Rebuilds one chunk piece `[dev_sector, dev_sector+n)` of `target` (holding `role`).
    async fn recover_piece(
        &self,
        a: &ArrayCore,
        role: usize,
        target: &Arc<Member>,
        dev_sector: u64,
        n: u64,
    ) -> io::Result<()> {
        let Some(array_sector) = self.geo.unmap(role, dev_sector) else {
            return Ok(()); // the unused tail of the last row
        };
        let copies = self.copies(a, array_sector)?;
        let n = n.min(self.geo.array_sectors() - array_sector);
        debug_assert!(copies.iter().any(|c| c.member == role && c.sector == dev_sector), "unmap/map disagree");
        let sources: Vec<MemberSector> = copies.iter().copied().filter(|c| c.member != role).collect();
        let _b = a.barrier.raise(array_sector..array_sector + n).await;
        let slots = a.slots();
        let sources: Vec<MemberSector> = sources.into_iter().filter(|c| slots.in_sync(c.member).is_some()).collect();
        let (data, r) = mirror::read_copies(
            a,
            &sources,
            n,
            IoBuf::uninit_contents(n as usize * 512),
            array_sector..array_sector + n,
            true,
        )
        .await;
        r?;
        a.member_write(target, dev_sector, data.freeze(), WriteFlags::NONE).await
    }
}

impl Personality for Raid10 {
    fn level(&self) -> Level {
        Level::Raid10
    }

    fn array_sectors(&self) -> u64 {
        self.geo.array_sectors()
    }

    fn can_run(&self, slots: &SlotTable) -> bool {
        // The copy pattern repeats every raid_disks chunks: check one period.
        let chunks = self.geo.array_sectors() / self.chunk_sectors;
        (0..chunks.min(self.raid_disks as u64 * 2)).all(|c| {
            self.geo
                .map(c * self.chunk_sectors)
                .is_some_and(|copies| copies.iter().any(|cp| slots.in_sync(cp.member).is_some()))
        })
    }

    fn optimal_io_bytes(&self) -> u32 {
        u32::try_from(self.chunk_sectors * 512).unwrap_or(u32::MAX)
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, mut buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(async move {
            let pieces = chunk_pieces(offset_sectors, buf.len() as u64 / 512, self.chunk_sectors);
            let mut parts = Vec::with_capacity(pieces.len());
            for (s, n) in &pieces {
                parts.push((*s, *n, buf.split_to(*n as usize * 512)));
            }
            let results = join_all(parts.into_iter().map(|(s, n, part)| async move {
                match self.copies(a, s) {
                    Ok(copies) => mirror::read_copies(a, &copies, n, part, s..s + n, false).await,
                    Err(e) => (part, Err(e)),
                }
            }))
            .await;
            join_read_parts(buf, results)
        })
    }

    fn write<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let pieces = chunk_pieces(offset_sectors, buf.len() as u64 / 512, self.chunk_sectors);
            let results = join_all(pieces.iter().map(|(s, n)| {
                let from = ((s - offset_sectors) * 512) as usize;
                let data = buf.slice(from..from + *n as usize * 512);
                async move { mirror::write_copies(a, &self.copies(a, *s)?, &data, flags).await }
            }))
            .await;
            results.into_iter().collect()
        })
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        self.write_zeroes(a, offset_sectors, len_sectors, ZeroFlags::default())
    }

    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let pieces = chunk_pieces(offset_sectors, len_sectors, self.chunk_sectors);
            // Bounded concurrency: a whole-array zeroing is many chunk pieces.
            for batch in pieces.chunks(64) {
                let results = join_all(
                    batch
                        .iter()
                        .map(|(s, n)| async move { mirror::zero_copies(a, &self.copies(a, *s)?, *n, flags).await }),
                )
                .await;
                results.into_iter().collect::<io::Result<()>>()?;
            }
            Ok(())
        })
    }

    fn sync_domain_sectors(&self) -> u64 {
        self.geo.array_sectors()
    }

    fn recovery_domain_sectors(&self) -> u64 {
        self.geo.dev_sectors()
    }

    fn recovery_uses_sync_domain(&self) -> bool {
        false
    }

    fn sync_range_of(&self, offset_sectors: u64, len_sectors: u64) -> Range<u64> {
        offset_sectors..offset_sectors + len_sectors
    }

    fn sync_range<'a>(
        &'a self,
        a: &'a ArrayCore,
        mode: SyncMode,
        start: u64,
        len: u64,
    ) -> IoFuture<'a, io::Result<SyncOutcome>> {
        Box::pin(async move {
            if mode == SyncMode::Recover {
                let end = (start + len).min(self.geo.dev_sectors());
                let targets: Vec<(usize, Arc<Member>)> = a
                    .slots()
                    .recovering()
                    .into_iter()
                    .filter(|(_, m)| !m.has(flag::IN_SYNC) && m.recovery_offset() < end)
                    .collect();
                let pieces = chunk_pieces(start, end.saturating_sub(start), self.chunk_sectors);
                let work = targets.iter().flat_map(|(role, m)| pieces.iter().map(move |(s, n)| (*role, m, *s, *n)));
                let results = join_all(work.map(|(role, m, s, n)| self.recover_piece(a, role, m, s, n))).await;
                results.into_iter().collect::<io::Result<()>>()?;
                return Ok(SyncOutcome::default());
            }
            let end = (start + len).min(self.geo.array_sectors());
            if end <= start {
                return Ok(SyncOutcome::default());
            }
            let _b = a.barrier.raise(start..end).await;
            let pieces = chunk_pieces(start, end - start, self.chunk_sectors);
            let results = join_all(pieces.iter().map(|(s, n)| async move {
                let copies = self.copies(a, *s)?;
                mirror::sync_copies(a, mode, &copies, *n, *s..*s + *n).await
            }))
            .await;
            let mut out = SyncOutcome::default();
            for r in results {
                out.merge(r?);
            }
            Ok(out)
        })
    }
}
