//! What raid1 and raid10 share: choosing a copy to read (least busy; the first copy where a
//! resync has not yet made the copies equal), read-error handling (try the other copies, then
//! rewrite the bad one from a good one under the region barrier and read it back — md's
//! fix_read_error — or fail it), writing every copy, and the per-range sync work on a set of
//! copies (resync, recovery, check, repair with md's mismatch counting).
//!
//! A *copy* is a [`MemberSector`]: the role (`member`) and member sector holding one replica of
//! an array range; all copies of a range have the same length.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use mdkit_io::{IoBuf, ReadResult, SharedBuf, WriteFlags, ZeroFlags};

use super::core::ArrayCore;
use super::errors::{MdError, MdErrorKind};
use super::io::join_all;
use super::member::{Member, flag};
use super::personality::{SyncMode, SyncOutcome};
use super::slots::SlotTable;
use crate::layout::MemberSector;

/// md compares mirrors in 64 KiB units (RESYNC_BLOCK_SIZE); a differing unit counts whole.
pub const COMPARE_UNIT_SECTORS: u64 = 128;

const SECTOR: usize = 512;

fn eio(msg: String) -> io::Error {
    io::Error::other(msg)
}

/// No copy of sync-domain range `domain` could be read: the request fails, no member is failed
/// for it (md returns the error when the only usable copy fails); the unreadable blocks are
/// recorded in the copies' bad-block logs where there is room ([`read_blockwise`]).
fn unrecoverable(a: &ArrayCore, domain: &Range<u64>, detail: String) -> io::Error {
    let detail = format!("sync-domain sectors {}..{}: {detail}", domain.start, domain.end);
    a.note_unrecoverable_read();
    MdError::new(MdErrorKind::Unrecoverable, a.name(), "read", domain.start, detail).into()
}

/// Whether member sectors `[sector, sector + len)` touch a known bad block.
fn has_bad_block(m: &Member, sector: u64, len: u64) -> bool {
    !m.bad_blocks().is_empty() && m.bad_blocks().first_overlap(m.data_offset_sectors + sector, len).is_some()
}

/// The readable copies of a range, in the order reads should try them: copies without a known
/// bad block in the range first (md's read_balance).
pub fn read_order(
    a: &ArrayCore,
    slots: &SlotTable,
    copies: &[MemberSector],
    len: u64,
    domain_end: u64,
) -> Vec<(Arc<Member>, u64)> {
    let mut v: Vec<(Arc<Member>, u64)> =
        copies.iter().filter_map(|c| slots.readable(c.member, c.sector + len).map(|m| (m.clone(), c.sector))).collect();
    if v.len() > 1 && !a.may_be_unsynced(domain_end) {
        // Least busy first; write-mostly members last; ties rotate per MiB so parallel
        // streams spread over the copies.
        let n = v.len();
        let rot = ((copies.first().map_or(0, |c| c.sector) >> 11) % n as u64) as usize;
        type Keyed = ((bool, bool, u32, usize), (Arc<Member>, u64));
        let mut keyed: Vec<Keyed> = v
            .into_iter()
            .enumerate()
            .map(|(i, (m, s))| {
                let bad = has_bad_block(&m, s, len);
                ((bad, m.has(flag::WRITE_MOSTLY), m.in_flight(), (i + n - rot) % n), (m, s))
            })
            .collect();
        keyed.sort_by_key(|(k, _)| *k);
        v = keyed.into_iter().map(|(_, x)| x).collect();
    } else {
        // Copies may differ: every reader (and resync) uses the same first copy, a member that
        // is not write-mostly when there is one (md's raid1 resync source rule; a write-mostly
        // member may lag under write-behind).
        v.sort_by_key(|(m, _)| m.has(flag::WRITE_MOSTLY));
    }
    v
}

/// Write-behind: a read of a range with a behind write in flight never goes to a lagging
/// member (write-mostly, or with behind writes outstanding: it may still hold the older data).
/// Lagging copies go last; the range returned, when there is one, must be waited for
/// (`wait_earlier_overlaps`) before a lagging copy is read (md's wait_behind_writes).
fn avoid_behind(a: &ArrayCore, order: &mut [(Arc<Member>, u64)], len: u64) -> Option<Range<u64>> {
    if !a.behind.any() || !order.iter().any(|(m, _)| m.lags()) {
        return None;
    }
    let sector = order.first().map(|(_, s)| *s)?;
    let range = sector..sector + len;
    if !a.behind.overlaps(&range) {
        return None;
    }
    order.sort_by_key(|(m, _)| m.lags());
    Some(range)
}

/// Reads one range from a copy, handling read errors (see the module documentation).
/// `domain` is the range's sync-domain extent (for the barrier and the unsynced check);
/// `barrier_held` when the caller already raised the barrier there (sync work).
pub async fn read_copies(
    a: &ArrayCore,
    copies: &[MemberSector],
    len: u64,
    mut buf: IoBuf,
    domain: Range<u64>,
    barrier_held: bool,
) -> ReadResult {
    let slots = a.slots();
    let mut order = read_order(a, &slots, copies, len, domain.end);
    let behind = avoid_behind(a, &mut order, len);
    if order.is_empty() {
        let e = unrecoverable(a, &domain, "no readable copy (degraded beyond redundancy)".into());
        return (buf, Err(e));
    }
    let mut failed: Vec<BadCopy> = Vec::new();
    let mut last_err = None;
    for (m, sector) in &order {
        if let Some(r) = behind.as_ref().filter(|_| m.lags()) {
            a.behind.wait_earlier_overlaps(u64::MAX, r).await;
        }
        let (b, r) = a.member_read(m, *sector, buf).await;
        buf = b;
        match r {
            Ok(()) => {
                if !failed.is_empty() {
                    repair_copies(a, &failed, (m, *sector), len, domain, barrier_held).await;
                }
                return (buf, Ok(()));
            }
            Err(e) => {
                let known_bad = MdError::is(&e, MdErrorKind::KnownBadBlock);
                if !known_bad {
                    tracing::warn!(array = a.name(), member = m.name(), sector, "read error, trying another copy: {e}");
                }
                failed.push(BadCopy { member: m.clone(), sector: *sector, known_bad });
                last_err = Some(e);
            }
        }
    }
    // Every copy failed for the whole range: assemble it block by block from whatever copy
    // can read each 4 KiB block.
    match read_blockwise(a, &order, len, &mut buf).await {
        Ok(()) => (buf, Ok(())),
        Err(e) => {
            let msg = match last_err {
                Some(le) => format!("{le}; block by block: {e}"),
                None => e.to_string(),
            };
            (buf, Err(unrecoverable(a, &domain, msg)))
        }
    }
}

async fn read_blockwise(a: &ArrayCore, order: &[(Arc<Member>, u64)], len: u64, buf: &mut IoBuf) -> io::Result<()> {
    const BLOCK_SECTORS: u64 = 8;
    let mut s = 0;
    while s < len {
        let n = BLOCK_SECTORS.min(len - s);
        let mut ok = false;
        for (m, sector) in order {
            if m.is_faulty() {
                continue;
            }
            let (b, r) = a.member_read(m, sector + s, IoBuf::uninit_contents(n as usize * SECTOR)).await;
            if r.is_ok() {
                let at = s as usize * SECTOR;
                buf.as_mut_slice()[at..at + b.len()].copy_from_slice(b.as_slice());
                ok = true;
                break;
            }
        }
        if !ok {
            // md's fix_read_error: "Cannot read from anywhere - mark it bad".
            let mut recorded = 0;
            for (m, sector) in order {
                recorded += usize::from(a.record_unreadable(m, sector + s, n).await);
            }
            if recorded > 0 {
                tracing::warn!(
                    array = a.name(),
                    sectors = s,
                    recorded,
                    "unreadable on every copy: bad blocks recorded"
                );
            }
            return Err(eio(format!(
                "{}: sectors {}..{} of the range are unreadable on every copy",
                a.name(),
                s,
                s + n
            )));
        }
        s += n;
    }
    Ok(())
}

/// A copy whose read failed: a device error, or a range its bad-block log lists.
struct BadCopy {
    member: Arc<Member>,
    sector: u64,
    known_bad: bool,
}

/// md's fix_read_error: each bad copy's fix attempt is counted first (a member past
/// `max_read_errors` is failed instead); then, under the barrier, the good copy is re-read and
/// written over each bad copy, which is read back. A copy that cannot be corrected is failed.
/// A copy skipped for a known bad block is rewritten too (healing the entry, as raid5's
/// R5_ReadError does) unless the member has had a write error (md's WriteErrorSeen: it would
/// fail again); that is not a read error, so it is not counted.
async fn repair_copies(
    a: &ArrayCore,
    bad: &[BadCopy],
    good: (&Arc<Member>, u64),
    len: u64,
    domain: Range<u64>,
    barrier_held: bool,
) {
    let bad: Vec<(&Arc<Member>, u64)> = bad
        .iter()
        .filter(|c| {
            let fix = if c.known_bad { !c.member.has(flag::WRITE_ERROR_SEEN) } else { a.may_fix_read_error(&c.member) };
            !c.member.is_faulty() && fix
        })
        .map(|c| (&c.member, c.sector))
        .collect();
    if bad.is_empty() {
        return;
    }
    let _b = if barrier_held { None } else { Some(a.barrier.raise(domain.clone()).await) };
    let (data, r) = a.member_read(good.0, good.1, IoBuf::uninit_contents(len as usize * SECTOR)).await;
    if let Err(e) = r {
        tracing::warn!(array = a.name(), "read-error repair: the good copy failed on re-read: {e}");
        return;
    }
    let data = data.freeze();
    for (m, sector) in bad {
        rewrite_and_verify(a, m, sector, &data).await;
    }
}

/// Writes `data` over a copy whose read failed and reads it back: counts the corrected sectors,
/// or fails the member when the copy still cannot be read (md's "unable to read back corrected
/// sectors"). A failed write already failed the member.
async fn rewrite_and_verify(a: &ArrayCore, m: &Member, sector: u64, data: &SharedBuf) {
    if m.is_faulty() || a.member_write(m, sector, data.clone(), WriteFlags::NONE).await.is_err() {
        return;
    }
    let sectors = data.len() as u64 / SECTOR as u64;
    let (chk, r) = a.member_read(m, sector, IoBuf::uninit_contents(data.len())).await;
    if r.is_ok() && chk.as_slice() == data.as_slice() {
        m.note_corrected_sectors(sectors);
        tracing::info!(
            array = a.name(),
            member = m.name(),
            sector,
            sectors,
            "read error corrected by rewriting from another copy"
        );
    } else {
        a.fail_member_on_error(m, &format!("read error at member sector {sector} could not be corrected by rewriting"));
    }
}

/// Writes `buf` to every working holder/replacement of every copy. Succeeds when at least one
/// member that holds valid data for the range took it.
pub async fn write_copies(
    a: &ArrayCore,
    copies: &[MemberSector],
    buf: &SharedBuf,
    flags: WriteFlags,
) -> io::Result<()> {
    let len = buf.len() as u64 / SECTOR as u64;
    let slots = a.slots();
    let targets: Vec<(Arc<Member>, u64)> =
        copies.iter().flat_map(|c| slots.write_targets(c.member).map(move |m| (m.clone(), c.sector))).collect();
    if targets.is_empty() {
        return Err(eio(format!("{}: no working member to write to", a.name())));
    }
    let results = join_all(targets.iter().map(|(m, s)| a.member_write(m, *s, buf.clone(), flags))).await;
    finish_writes(a, &targets, results, len)
}

/// Write-zeroes on every copy (raid1/10 discards become write-zeroes so the copies stay equal).
pub async fn zero_copies(a: &ArrayCore, copies: &[MemberSector], len: u64, flags: ZeroFlags) -> io::Result<()> {
    let slots = a.slots();
    let targets: Vec<(Arc<Member>, u64)> =
        copies.iter().flat_map(|c| slots.write_targets(c.member).map(move |m| (m.clone(), c.sector))).collect();
    if targets.is_empty() {
        return Err(eio(format!("{}: no working member to write to", a.name())));
    }
    let results = join_all(targets.iter().map(|(m, s)| a.member_write_zeroes(m, *s, len, flags))).await;
    finish_writes(a, &targets, results, len)
}

pub(crate) fn finish_writes(
    a: &ArrayCore,
    targets: &[(Arc<Member>, u64)],
    results: Vec<io::Result<()>>,
    len: u64,
) -> io::Result<()> {
    let mut first_err = None;
    let mut good = 0;
    for ((m, s), r) in targets.iter().zip(results) {
        match r {
            Ok(()) if m.readable_to(s + len) => good += 1,
            Ok(()) => {}
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if good > 0 {
        return Ok(());
    }
    Err(first_err.unwrap_or_else(|| eio(format!("{}: no in-sync member accepted the write", a.name()))))
}

/// One unit of sync work on the copies of one range (see [`SyncMode`]). `domain` is the range in
/// the sync domain (mismatch ranges are reported there). The caller holds the barrier.
pub async fn sync_copies(
    a: &ArrayCore,
    mode: SyncMode,
    copies: &[MemberSector],
    len: u64,
    domain: Range<u64>,
) -> io::Result<SyncOutcome> {
    let slots = a.slots();
    match mode {
        SyncMode::Resync | SyncMode::Recover => {
            // Targets: for recovery the rebuilding members (not in sync, not yet past this range);
            // for resync every working member except the source.
            let recovering: Vec<(Arc<Member>, u64)> = copies
                .iter()
                .flat_map(|c| slots.write_targets(c.member).map(move |m| (m.clone(), c.sector)))
                .filter(|(m, s)| !m.has(flag::IN_SYNC) && m.recovery_offset() < s + len)
                .collect();
            if mode == SyncMode::Recover && recovering.is_empty() {
                return Ok(SyncOutcome::default());
            }
            // Sources: in-sync copies, write-mostly ones last (md: resync reads a member that
            // is not write-mostly first).
            let mut sources: Vec<MemberSector> =
                copies.iter().copied().filter(|c| slots.in_sync(c.member).is_some()).collect();
            sources.sort_by_key(|c| slots.in_sync(c.member).is_some_and(|m| m.has(flag::WRITE_MOSTLY)));
            let (data, r) = if mode == SyncMode::Resync {
                // Resync reads the first in-sync copy so every reader sees what it saw.
                read_first(a, &slots, &sources, len).await
            } else {
                let (b, r) =
                    read_copies(a, &sources, len, IoBuf::uninit_contents(len as usize * SECTOR), domain.clone(), true)
                        .await;
                (b, r.map(|()| sources.first().map(|c| c.member)))
            };
            let src_role = r?;
            let data = data.freeze();
            let targets: Vec<(Arc<Member>, u64)> = if mode == SyncMode::Recover {
                recovering
            } else {
                copies
                    .iter()
                    .flat_map(|c| slots.write_targets(c.member).map(move |m| (m.clone(), c.sector, c.member)))
                    .filter(|(_, _, role)| Some(*role) != src_role)
                    .map(|(m, s, _)| (m, s))
                    .collect()
            };
            let results =
                join_all(targets.iter().map(|(m, s)| a.member_write(m, *s, data.clone(), WriteFlags::NONE))).await;
            if mode == SyncMode::Recover && results.iter().all(|r| r.is_err()) {
                let e = results.into_iter().find_map(|r| r.err());
                return Err(e.unwrap_or_else(|| eio(format!("{}: recovery write failed", a.name()))));
            }
            Ok(SyncOutcome::default())
        }
        SyncMode::Check | SyncMode::Repair => check_copies(a, &slots, mode, copies, len, domain).await,
    }
}

/// Reads the first in-sync copy that can be read; returns which role it came from.
async fn read_first(
    a: &ArrayCore,
    slots: &SlotTable,
    sources: &[MemberSector],
    len: u64,
) -> (IoBuf, io::Result<Option<usize>>) {
    let mut buf = IoBuf::uninit_contents(len as usize * SECTOR);
    let mut last = None;
    for c in sources {
        let Some(m) = slots.in_sync(c.member) else { continue };
        let (b, r) = a.member_read(m, c.sector, buf).await;
        buf = b;
        match r {
            Ok(()) => return (buf, Ok(Some(c.member))),
            Err(e) => last = Some(e),
        }
    }
    (buf, Err(last.unwrap_or_else(|| eio(format!("{}: no in-sync copy to resync from", a.name())))))
}

async fn check_copies(
    a: &ArrayCore,
    slots: &SlotTable,
    mode: SyncMode,
    copies: &[MemberSector],
    len: u64,
    domain: Range<u64>,
) -> io::Result<SyncOutcome> {
    let readers: Vec<(Arc<Member>, u64)> =
        copies.iter().filter_map(|c| slots.in_sync(c.member).map(|m| (m.clone(), c.sector))).collect();
    let reads =
        join_all(readers.iter().map(|(m, s)| a.member_read(m, *s, IoBuf::uninit_contents(len as usize * SECTOR))))
            .await;
    let mut good: Vec<(usize, IoBuf)> = Vec::new();
    let mut unreadable: Vec<(usize, bool)> = Vec::new();
    for (i, (b, r)) in reads.into_iter().enumerate() {
        match r {
            Ok(()) => good.push((i, b)),
            Err(e) if MdError::is(&e, MdErrorKind::KnownBadBlock) => unreadable.push((i, true)),
            Err(e) => {
                tracing::warn!(
                    array = a.name(),
                    member = readers[i].0.name(),
                    "read error during {}: {e}",
                    mode.as_str()
                );
                unreadable.push((i, false));
            }
        }
    }
    let mut out = SyncOutcome::default();
    let Some((ref_idx, reference)) = good.first() else {
        return Err(eio(format!(
            "{}: no copy of sync-domain sectors {}..{} could be read",
            a.name(),
            domain.start,
            domain.end
        )));
    };
    let reference = IoBuf::from_slice(reference.as_slice()).freeze();
    let _ = ref_idx;
    // Units that differ, and which copies differ in each.
    let units = len.div_ceil(COMPARE_UNIT_SECTORS);
    let mut rewrite: Vec<(usize, Range<u64>)> = Vec::new();
    for u in 0..units {
        let from = u * COMPARE_UNIT_SECTORS;
        let to = (from + COMPARE_UNIT_SECTORS).min(len);
        let bytes = from as usize * SECTOR..to as usize * SECTOR;
        let differing: Vec<usize> = good
            .iter()
            .skip(1)
            .filter(|(_, b)| b.as_slice()[bytes.clone()] != reference.as_slice()[bytes.clone()])
            .map(|(i, _)| *i)
            .collect();
        if !differing.is_empty() {
            out.add_mismatch_copies(domain.start + from..domain.start + to, differing.len() as u64);
            if mode == SyncMode::Repair {
                rewrite.extend(differing.into_iter().map(|i| (i, from..to)));
            }
        }
    }
    // Unreadable copies are fixed in either mode (md treats them as read errors to fix); known
    // bad ranges are rewritten to heal them unless the member has had write errors (md's
    // resync writes to bad blocks of members without WriteErrorSeen), and are not counted.
    for (i, known_bad) in &unreadable {
        let m = &readers[*i].0;
        let fix = if *known_bad { !m.has(flag::WRITE_ERROR_SEEN) } else { a.may_fix_read_error(m) };
        if fix {
            rewrite_and_verify(a, m, readers[*i].1, &reference).await;
        }
    }
    let writes = join_all(rewrite.iter().map(|(i, r)| {
        let (m, s) = &readers[*i];
        let data = reference.slice(r.start as usize * SECTOR..r.end as usize * SECTOR);
        a.member_write(m, s + r.start, data, WriteFlags::NONE)
    }))
    .await;
    for ((i, r), w) in rewrite.iter().zip(writes) {
        let m = &readers[*i].0;
        match w {
            Ok(()) => tracing::debug!(array = a.name(), member = m.name(), sectors = ?r, "mismatch repaired"),
            Err(e) => {
                tracing::warn!(array = a.name(), member = m.name(), "rewrite during {} failed: {e}", mode.as_str())
            }
        }
    }
    Ok(out)
}
