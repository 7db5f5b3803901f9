//! raid0: striping over zones (single- and multi-zone, ORIG and ALT layouts, from
//! `layout::Raid0Geometry`). A request is split at chunk boundaries (zones start on chunk
//! boundaries too) and the pieces run concurrently, one member request per chunk piece; discards
//! and write-zeroes merge consecutive pieces on the same member into one request. No redundancy:
//! a member error is the user's error (md marks the array broken), and there is no sync work.

use std::io;
use std::ops::Range;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags, join_read_parts};

use super::core::ArrayCore;
use super::io::join_all;
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::slots::SlotTable;
use crate::layout::{Level, Raid0Geometry};

/// Splits `[offset, offset+len)` at multiples of `chunk`: `(array sector, sectors)` pieces.
pub fn chunk_pieces(offset: u64, len: u64, chunk: u64) -> Vec<(u64, u64)> {
    let mut v = Vec::with_capacity((len / chunk.max(1) + 2) as usize);
    let mut pos = offset;
    let end = offset + len;
    while pos < end {
        let n = (chunk - pos % chunk).min(end - pos);
        v.push((pos, n));
        pos += n;
    }
    v
}

fn eio(msg: String) -> io::Error {
    io::Error::other(msg)
}

/// See the module documentation.
pub struct Raid0 {
    geo: Raid0Geometry,
    chunk_sectors: u64,
    raid_disks: usize,
}

impl Raid0 {
    pub fn new(geo: Raid0Geometry, chunk_sectors: u32, raid_disks: u32) -> Raid0 {
        Raid0 { geo, chunk_sectors: u64::from(chunk_sectors), raid_disks: raid_disks as usize }
    }

    /// `(role, member sector, array sector, sectors)` per chunk piece.
    fn map(&self, a: &ArrayCore, offset: u64, len: u64) -> io::Result<Vec<(usize, u64, u64, u64)>> {
        chunk_pieces(offset, len, self.chunk_sectors)
            .into_iter()
            .map(|(s, n)| {
                self.geo
                    .map(s)
                    .map(|m| (m.member, m.sector, s, n))
                    .ok_or_else(|| eio(format!("{}: array sector {s} does not map to a member", a.name())))
            })
            .collect()
    }

    /// Consecutive pieces on the same member merged: `(role, member sector, sectors)`.
    fn merged(&self, a: &ArrayCore, offset: u64, len: u64) -> io::Result<Vec<(usize, u64, u64)>> {
        let mut per: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.raid_disks];
        for (role, ms, _, n) in self.map(a, offset, len)? {
            match per[role].last_mut() {
                Some((s, l)) if *s + *l == ms => *l += n,
                _ => per[role].push((ms, n)),
            }
        }
        Ok(per.into_iter().enumerate().flat_map(|(r, v)| v.into_iter().map(move |(s, n)| (r, s, n))).collect())
    }
}

impl Personality for Raid0 {
    fn level(&self) -> Level {
        Level::Raid0
    }

    fn array_sectors(&self) -> u64 {
        self.geo.array_sectors()
    }

    fn can_run(&self, slots: &SlotTable) -> bool {
        (0..self.raid_disks).all(|r| slots.in_sync(r).is_some())
    }

    fn optimal_io_bytes(&self) -> u32 {
        u32::try_from(self.chunk_sectors * 512).unwrap_or(u32::MAX)
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, mut buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(async move {
            let pieces = match self.map(a, offset_sectors, buf.len() as u64 / 512) {
                Ok(p) => p,
                Err(e) => return (buf, Err(e)),
            };
            let slots = a.slots();
            let mut parts = Vec::with_capacity(pieces.len());
            for (role, ms, _, n) in &pieces {
                let part = buf.split_to(*n as usize * 512);
                parts.push((slots.working(*role).cloned(), *ms, part, *role));
            }
            let results = join_all(parts.into_iter().map(|(m, ms, part, role)| async move {
                match m {
                    Some(m) => a.member_read(&m, ms, part).await,
                    None => (part, Err(eio(format!("{}: role {role} has no working member", a.name())))),
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
            let pieces = self.map(a, offset_sectors, buf.len() as u64 / 512)?;
            let slots = a.slots();
            let results = join_all(pieces.iter().map(|(role, ms, s, n)| {
                let from = ((s - offset_sectors) * 512) as usize;
                let data = buf.slice(from..from + *n as usize * 512);
                let m = slots.working(*role).cloned();
                async move {
                    match m {
                        Some(m) => a.member_write(&m, *ms, data, flags).await,
                        None => Err(eio(format!("{}: role {role} has no working member", a.name()))),
                    }
                }
            }))
            .await;
            results.into_iter().collect()
        })
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let runs = self.merged(a, offset_sectors, len_sectors)?;
            let slots = a.slots();
            let results = join_all(runs.iter().map(|(role, ms, n)| {
                let m = slots.working(*role).cloned();
                async move {
                    match m {
                        Some(m) => match a.member_discard(&m, *ms, *n).await {
                            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
                            r => r,
                        },
                        None => Err(eio(format!("{}: role {role} has no working member", a.name()))),
                    }
                }
            }))
            .await;
            results.into_iter().collect()
        })
    }

    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move {
            let runs = self.merged(a, offset_sectors, len_sectors)?;
            let slots = a.slots();
            let results = join_all(runs.iter().map(|(role, ms, n)| {
                let m = slots.working(*role).cloned();
                async move {
                    match m {
                        Some(m) => a.member_write_zeroes(&m, *ms, *n, flags).await,
                        None => Err(eio(format!("{}: role {role} has no working member", a.name()))),
                    }
                }
            }))
            .await;
            results.into_iter().collect()
        })
    }

    fn sync_domain_sectors(&self) -> u64 {
        0
    }

    fn sync_range_of(&self, _offset_sectors: u64, _len_sectors: u64) -> Range<u64> {
        0..0
    }

    fn sync_range<'a>(
        &'a self,
        _a: &'a ArrayCore,
        _mode: SyncMode,
        _start: u64,
        _len: u64,
    ) -> IoFuture<'a, io::Result<SyncOutcome>> {
        Box::pin(std::future::ready(Ok(SyncOutcome::default())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_chunks() {
        assert_eq!(chunk_pieces(0, 16, 8), vec![(0, 8), (8, 8)]);
        assert_eq!(chunk_pieces(6, 4, 8), vec![(6, 2), (8, 2)]);
        assert_eq!(chunk_pieces(8, 8, 8), vec![(8, 8)]);
        assert!(chunk_pieces(3, 0, 8).is_empty());
    }
}
