//! raid1: n-way mirroring. Every member holds the whole array at the same member sector; reads
//! go to the least-busy readable copy (the first copy where an unfinished resync may have left
//! the copies different); a read error is retried on another copy and the bad copy rewritten
//! (md's fix_read_error) or failed; writes go to every working member, recovering ones and
//! replacements included. The sync domain and the recovery domain are member sectors, which are
//! also array sectors.

use std::io;
use std::ops::Range;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags};

use super::core::ArrayCore;
use super::mirror;
use super::personality::{Personality, SyncMode, SyncOutcome};
use super::slots::SlotTable;
use crate::layout::{Level, MemberSector};

/// See the module documentation.
pub struct Raid1 {
    raid_disks: usize,
    member_size_sectors: u64,
}

impl Raid1 {
    pub fn new(raid_disks: u32, member_size_sectors: u64) -> Raid1 {
        Raid1 { raid_disks: raid_disks as usize, member_size_sectors }
    }

    fn copies(&self, sector: u64) -> Vec<MemberSector> {
        (0..self.raid_disks).map(|member| MemberSector { member, sector }).collect()
    }
}

impl Personality for Raid1 {
    fn level(&self) -> Level {
        Level::Raid1
    }

    fn array_sectors(&self) -> u64 {
        self.member_size_sectors
    }

    fn can_run(&self, slots: &SlotTable) -> bool {
        (0..self.raid_disks).any(|r| slots.in_sync(r).is_some())
    }

    fn read<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, buf: IoBuf) -> IoFuture<'a, ReadResult> {
        Box::pin(async move {
            let len = buf.len() as u64 / 512;
            mirror::read_copies(a, &self.copies(offset_sectors), len, buf, offset_sectors..offset_sectors + len, false)
                .await
        })
    }

    fn write<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        buf: SharedBuf,
        flags: WriteFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move { mirror::write_copies(a, &self.copies(offset_sectors), &buf, flags).await })
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        // Zeroes (punched holes on files) rather than plain discards keep the mirrors equal, so a
        // later check does not count discarded ranges as mismatches.
        Box::pin(async move {
            mirror::zero_copies(a, &self.copies(offset_sectors), len_sectors, ZeroFlags::default()).await
        })
    }

    fn write_zeroes<'a>(
        &'a self,
        a: &'a ArrayCore,
        offset_sectors: u64,
        len_sectors: u64,
        flags: ZeroFlags,
    ) -> IoFuture<'a, io::Result<()>> {
        Box::pin(async move { mirror::zero_copies(a, &self.copies(offset_sectors), len_sectors, flags).await })
    }

    fn sync_domain_sectors(&self) -> u64 {
        self.member_size_sectors
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
            let len = len.min(self.member_size_sectors.saturating_sub(start));
            if len == 0 {
                return Ok(SyncOutcome::default());
            }
            let _b = a.barrier.raise(start..start + len).await;
            mirror::sync_copies(a, mode, &self.copies(start), len, start..start + len).await
        })
    }
}
