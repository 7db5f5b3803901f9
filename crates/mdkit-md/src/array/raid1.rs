//! raid1: n-way mirroring. Every member holds the whole array at the same member sector; reads
//! go to the least-busy readable copy (the first copy where an unfinished resync may have left
//! the copies different); a read error is retried on another copy and the bad copy rewritten
//! (md's fix_read_error) or failed; writes go to every working member, recovering ones and
//! replacements included. The sync domain and the recovery domain are member sectors, which are
//! also array sectors.
//!
//! Write-behind (md's `--write-behind=N`, with a bitmap): a write is acknowledged once the
//! members that are not write-mostly have it; the write-mostly members get it from a task that
//! holds the bitmap chunks, the region barrier and the write gate until it completes (so the
//! bits stay dirty, sync work keeps out and the array stays active), at most `N` at once (see
//! [`super::behind`]). FUA writes, discards and write-zeroes reach every member before they
//! complete, after any overlapping behind write.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use mdkit_io::{IoBuf, IoFuture, ReadResult, SharedBuf, WriteFlags, ZeroFlags};

use super::core::ArrayCore;
use super::io::join_all;
use super::member::{Member, flag};
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
        Box::pin(async move {
            let copies = self.copies(offset_sectors);
            if let Some(limit) = a.write_behind_limit(flags.fua) {
                return write_behind(a, &copies, buf, flags, limit).await;
            }
            after_behind_writes(a, offset_sectors, buf.len() as u64 / 512).await;
            mirror::write_copies(a, &copies, &buf, flags).await
        })
    }

    fn discard<'a>(&'a self, a: &'a ArrayCore, offset_sectors: u64, len_sectors: u64) -> IoFuture<'a, io::Result<()>> {
        // Zeroes (punched holes on files) rather than plain discards keep the mirrors equal, so a
        // later check does not count discarded ranges as mismatches.
        Box::pin(async move {
            after_behind_writes(a, offset_sectors, len_sectors).await;
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
        Box::pin(async move {
            after_behind_writes(a, offset_sectors, len_sectors).await;
            mirror::zero_copies(a, &self.copies(offset_sectors), len_sectors, flags).await
        })
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

/// A write that reaches every member before it completes comes after the behind writes that
/// overlap it, so a write-mostly member sees them in order.
async fn after_behind_writes(a: &ArrayCore, sector: u64, len_sectors: u64) {
    if a.behind.any() {
        a.behind.wait_earlier_overlaps(u64::MAX, &(sector..sector + len_sectors)).await;
    }
}

/// A member and the member sector a write goes to.
type Target = (Arc<Member>, u64);

/// A write under write-behind (see the module documentation). Falls back to writing every
/// member when there is no write-mostly target, or no other target that holds the range.
async fn write_behind(
    a: &ArrayCore,
    copies: &[MemberSector],
    buf: SharedBuf,
    flags: WriteFlags,
    limit: u64,
) -> io::Result<()> {
    let len = buf.len() as u64 / 512;
    let sector = copies.first().map_or(0, |c| c.sector);
    let range = sector..sector + len;
    let slots = a.slots();
    let (slow, fast): (Vec<Target>, Vec<Target>) = copies
        .iter()
        .flat_map(|c| slots.write_targets(c.member).map(move |m| (m.clone(), c.sector)))
        .partition(|(m, _)| m.has(flag::WRITE_MOSTLY));
    let core = a.arc();
    let (Some(core), Some(bm)) = (core, a.bitmap.as_ref()) else {
        after_behind_writes(a, sector, len).await;
        return mirror::write_copies(a, copies, &buf, flags).await;
    };
    if slow.is_empty() || !fast.iter().any(|(m, s)| m.readable_to(s + len)) {
        after_behind_writes(a, sector, len).await;
        return mirror::write_copies(a, copies, &buf, flags).await;
    }
    let ticket = a.behind.acquire(limit, range.clone(), buf.len() as u64).await;
    // The chunks are durable already (the request holds them): this only counts them again,
    // so they stay dirty until the behind write is done.
    if let Err(e) = bm.start_write(range.clone()).await {
        a.behind.complete(ticket, false);
        return Err(e);
    }
    let held = Held { slots: a.barrier.hold_write(&range), core: core.clone(), members: slow.clone() };
    a.gate.hold();
    for (m, _) in &slow {
        m.behind_started();
    }
    let data = buf.clone();
    tokio::spawn(async move {
        let core = held.core.clone();
        core.behind.wait_earlier_overlaps(ticket.seq, &range).await;
        let results = join_all(slow.iter().map(|(m, s)| core.member_write(m, *s, data.clone(), flags))).await;
        let ok = results.iter().all(|r| r.is_ok());
        if let Some(bm) = &core.bitmap {
            bm.end_write(range, ok);
        }
        drop(held);
        core.behind.complete(ticket, ok);
    });
    let results = join_all(fast.iter().map(|(m, s)| a.member_write(m, *s, buf.clone(), flags))).await;
    mirror::finish_writes(a, &fast, results, len)
}

/// What a behind write holds until it completes: its barrier slots, its count in the gate and
/// in its members.
struct Held {
    slots: Vec<usize>,
    core: Arc<ArrayCore>,
    members: Vec<Target>,
}

impl Drop for Held {
    fn drop(&mut self) {
        for (m, _) in &self.members {
            m.behind_done();
        }
        self.core.barrier.release_held(&self.slots);
        self.core.exit_write_gate();
    }
}
