//! Sync work on one stripe part (the sync domain is member sectors): resync (recompute parity
//! where it does not match), recover (rebuild a member's data/P/Q onto a spare or replacement),
//! check (count mismatched units like md's `mismatch_cnt`; RAID6 names the wrong member with
//! `pq_check`) and repair (rewrite the wrong block: RAID6 the named member, RAID5 and RAID6
//! without a single culprit the parity). The caller holds the region barrier; this takes the
//! stripe exclusively so no write batch or degraded read sees half of it.
//!
//! Unreadable blocks met on the way are rebuilt from the others and rewritten (md's read-error
//! correction) in every mode.

use std::io;
use std::sync::Arc;

use mdkit_io::{IoBuf, SharedBuf, WriteFlags};

use super::Raid5;
use super::exec::{Target, write_targets};
use super::plan::{RoleSet, bit, has};
use super::stripe::{Scrub, StripeShape};
use crate::array::core::ArrayCore;
use crate::array::io::join_all;
use crate::array::member::{Member, flag};
use crate::array::personality::{SyncMode, SyncOutcome};

const SECTOR: u64 = 512;

/// Reads `roles` over chunk sectors `[lo, hi)` of the stripe at member sector `base`.
/// Returns the buffers and the members whose read failed.
async fn read_roles(
    a: &ArrayCore,
    r5: &Raid5,
    roles: &[(usize, Arc<Member>)],
    sector: u64,
    len: usize,
) -> (Vec<(usize, IoBuf)>, Vec<(usize, Arc<Member>)>) {
    r5.stats.sync_reads.add(roles.len() as u64);
    let results =
        join_all(roles.iter().map(|(_, m)| a.member_read(m, r5.at(m, sector), IoBuf::uninit_contents(len)))).await;
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for ((role, m), (buf, r)) in roles.iter().zip(results) {
        match r {
            Ok(()) => ok.push((*role, buf)),
            Err(e) => {
                tracing::warn!(array = a.name(), member = m.name(), "read error during sync work: {e}");
                bad.push((*role, m.clone()));
            }
        }
    }
    (ok, bad)
}

/// One unit of sync work on chunk sectors `[lo, hi)` of `stripe`.
pub(crate) async fn sync_stripe(
    a: &ArrayCore,
    r5: &Raid5,
    mode: SyncMode,
    stripe: u64,
    lo: u64,
    hi: u64,
) -> io::Result<SyncOutcome> {
    let _x = r5.cache.exclusive(stripe).await;
    let shape = StripeShape::new(r5.geo.stripe_map(stripe), r5.n);
    let base = stripe * r5.chunk_sectors;
    let slots = a.slots();
    let n = r5.n;
    let len = ((hi - lo) * SECTOR) as usize;
    let sector = base + lo;
    let targets: Vec<(usize, Arc<Member>)> = if mode == SyncMode::Recover {
        slots
            .recovering()
            .into_iter()
            .filter(|(_, m)| !m.has(flag::IN_SYNC) && m.recovery_offset() < base + hi)
            .collect()
    } else {
        Vec::new()
    };
    if mode == SyncMode::Recover && targets.is_empty() {
        return Ok(SyncOutcome::default());
    }
    // What can be read: a member holding valid data for each role (never a target itself).
    let mut excluded: RoleSet = 0;
    let mut fixes: Vec<(usize, Arc<Member>)> = Vec::new();
    let blocks: Vec<Option<IoBuf>> = loop {
        let sources: Vec<(usize, Arc<Member>)> = (0..n)
            .filter(|r| !has(excluded, *r))
            .filter_map(|r| {
                let m = slots.readable(r, base + hi)?;
                (!targets.iter().any(|(_, t)| Arc::ptr_eq(t, m))).then(|| (r, m.clone()))
            })
            .collect();
        let (ok, bad) = read_roles(a, r5, &sources, sector, len).await;
        if bad.is_empty() {
            let mut blocks: Vec<Option<IoBuf>> = (0..n).map(|_| None).collect();
            for (r, b) in ok {
                blocks[r] = Some(b);
            }
            break blocks;
        }
        for (r, m) in bad {
            excluded |= bit(r);
            fixes.push((r, m));
        }
    };
    let missing = blocks.iter().filter(|b| b.is_none()).count();
    let max_missing = if shape.raid6 { 2 } else { 1 };
    if missing > max_missing {
        return Err(io::Error::other(format!(
            "{}: {} stripe {stripe}: {missing} of {n} blocks cannot be read at member sector {sector}, the level covers {max_missing}",
            a.name(),
            mode.as_str()
        )));
    }
    let scrubbing = matches!(mode, SyncMode::Resync | SyncMode::Check | SyncMode::Repair);
    if scrubbing && missing > 0 && fixes.is_empty() {
        // A degraded array has nothing to compare parity against (md skips it too).
        return Ok(SyncOutcome::default());
    }
    // Rebuild what is missing (targets of a recovery, unreadable blocks).
    let mut blocks = blocks;
    if missing > 0 {
        let rebuilt = {
            let refs: Vec<Option<&[u8]>> = blocks.iter().map(|b| b.as_ref().map(IoBuf::as_slice)).collect();
            shape
                .reconstruct(&refs, len)
                .map_err(|e| io::Error::other(format!("{}: stripe {stripe}: {e}", a.name())))?
        };
        for (r, b) in rebuilt {
            blocks[r] = Some(b);
        }
    }
    let mut writes: Vec<Target> = Vec::new();
    for (role, m) in &targets {
        let data = SharedBuf::from_slice(blocks[*role].as_ref().expect("rebuilt").as_slice());
        writes.push(Target { role: *role, member: m.clone(), sector, data, fixes_read: false });
    }
    for (role, m) in &fixes {
        if !m.is_faulty() {
            let data = SharedBuf::from_slice(blocks[*role].as_ref().expect("rebuilt").as_slice());
            writes.push(Target { role: *role, member: m.clone(), sector, data, fixes_read: true });
        }
    }
    let mut out = SyncOutcome::default();
    if scrubbing && fixes.is_empty() {
        let all: Vec<&[u8]> = blocks.iter().map(|b| b.as_ref().expect("every block read").as_slice()).collect();
        compare(a, r5, &shape, mode, &all, base, lo, hi, &mut out, &mut writes);
    }
    r5.stats.sync_writes.add(writes.len() as u64);
    write_targets(a, r5, writes, WriteFlags::NONE).await?;
    Ok(out)
}

/// Compares unit by unit (md counts a whole unit per mismatch); queues the rewrites resync and
/// repair do.
#[allow(clippy::too_many_arguments)]
fn compare(
    a: &ArrayCore,
    r5: &Raid5,
    shape: &StripeShape,
    mode: SyncMode,
    all: &[&[u8]],
    base: u64,
    lo: u64,
    hi: u64,
    out: &mut SyncOutcome,
    writes: &mut Vec<Target>,
) {
    let slots = a.slots();
    let unit = r5.tunables.unit_sectors(r5.chunk_sectors);
    let mut u_lo = lo;
    while u_lo < hi {
        let u_hi = ((u_lo / unit + 1) * unit).min(hi).min(r5.chunk_sectors);
        let at = ((u_lo - lo) * SECTOR) as usize..((u_hi - lo) * SECTOR) as usize;
        let unit_blocks: Vec<&[u8]> = all.iter().map(|b| &b[at.clone()]).collect();
        if let Scrub::Mismatch { culprit } = shape.check(&unit_blocks) {
            out.add_mismatch(base + u_lo..base + u_hi);
            let who = match culprit {
                Some(role) => {
                    let name = slots
                        .readable(role, base + u_hi)
                        .map_or_else(|| format!("role {role}"), |m| m.name().to_string());
                    format!("{name} (role {role}, {})", shape.block_name(role))
                }
                None if shape.raid6 => "several blocks".to_string(),
                None => "parity or data (raid5 cannot tell)".to_string(),
            };
            r5.note_mismatch(mode, base + u_lo, base + u_hi, shape.map.stripe, &who);
            if mode != SyncMode::Check {
                rewrite_unit(shape, mode, culprit, &unit_blocks, &slots, base + u_lo, writes);
            }
        }
        u_lo = u_hi;
    }
}

/// What resync and repair rewrite in a mismatched unit: the culprit RAID6 named (repair), or
/// the parity recomputed from the data.
fn rewrite_unit(
    shape: &StripeShape,
    mode: SyncMode,
    culprit: Option<usize>,
    blocks: &[&[u8]],
    slots: &crate::array::slots::SlotTable,
    sector: u64,
    writes: &mut Vec<Target>,
) {
    let len = blocks[0].len();
    let mut push = |role: usize, data: SharedBuf| {
        for m in slots.write_targets(role) {
            writes.push(Target { role, member: m.clone(), sector, data: data.clone(), fixes_read: false });
        }
    };
    if mode == SyncMode::Repair
        && shape.raid6
        && let Some(role) = culprit
        && !shape.parity_roles().any(|p| p == role)
    {
        // A wrong data block: rebuild it from the others.
        let others: Vec<Option<&[u8]>> = (0..blocks.len()).map(|r| (r != role).then_some(blocks[r])).collect();
        if let Ok(rebuilt) = shape.reconstruct(&others, len)
            && let Some((_, b)) = rebuilt.into_iter().find(|(r, _)| *r == role)
        {
            push(role, b.freeze());
        }
        return;
    }
    let data: Vec<&[u8]> = shape.map.data_members.iter().map(|r| blocks[*r]).collect();
    let mut p = IoBuf::uninit_contents(len);
    let mut q = IoBuf::uninit_contents(len);
    shape.gen_parity(&data, Some(p.as_mut_slice()), shape.raid6.then_some(q.as_mut_slice()));
    let only = if mode == SyncMode::Repair { culprit } else { None };
    if only.is_none_or(|r| r == shape.p_role()) {
        push(shape.p_role(), p.freeze());
    }
    if let Some(qr) = shape.q_role()
        && only.is_none_or(|r| r == qr)
    {
        push(qr, q.freeze());
    }
}
