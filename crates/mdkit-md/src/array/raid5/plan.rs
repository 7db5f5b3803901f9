//! Planning one stripe's batch of writes: which member I/Os to issue, per unit, and how runs of
//! units merge into large member I/Os. Pure (no I/O), so every decision is unit-tested.
//!
//! A batch is a set of [`Seg`]s (pieces of user writes) in one stripe. The stripe's chunk-high
//! member range is cut into *units* of `stripe_size` (md's stripe head: the unit of parity work
//! and of member I/O for partial-stripe writes; the last unit of a chunk may be shorter). For
//! every unit the batch touches:
//!
//! - **full**: every data member is overwritten in the unit → nothing is read; P/Q come from
//!   the new data (missing data members are folded into parity, missing parity is skipped);
//! - otherwise md's choice by member reads ([`Mode::Rmw`]: read the written data members and
//!   the parity, fold old ^ new into it; [`Mode::Rcw`]: read the data members not overwritten,
//!   recompute parity), ties going to reconstruct-write unless `rmw_level` is 2
//!   (md's PARITY_PREFER_RMW); `rmw_level` 0 disables read-modify-write;
//! - when neither works because a member the choice needs is missing, [`Mode::Reconstruct`]
//!   reads every available block and rebuilds the missing old data from parity first.
//!
//! Consecutive units with the same decision form one [`Run`]: one member I/O per member, so a
//! full-stripe portion is written in chunk-sized member writes whatever `stripe_size` is, and
//! `stripe_size` only bounds the unit that partial writes are widened to.

use mdkit_io::SharedBuf;

use super::stripe::StripeShape;

/// A set of member roles (or of data indices), one bit each; arrays are limited to
/// [`MAX_ROLES`] members.
pub(crate) type RoleSet = u128;
pub(crate) const MAX_ROLES: usize = 128;

pub(crate) fn has(set: RoleSet, i: usize) -> bool {
    set & (1u128 << i) != 0
}

pub(crate) fn bit(i: usize) -> RoleSet {
    1u128 << i
}

pub(crate) fn members(set: RoleSet) -> impl Iterator<Item = usize> {
    (0..MAX_ROLES).filter(move |i| has(set, *i))
}

/// A piece of a user write inside one stripe: data index `dd`, chunk-relative sectors
/// `[lo, hi)`, its data. Later segs of a batch win where they overlap earlier ones.
#[derive(Clone, Debug)]
pub(crate) struct Seg {
    pub dd: usize,
    pub lo: u64,
    pub hi: u64,
    pub data: SharedBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Mode {
    Full,
    Rmw,
    Rcw,
    Reconstruct,
}

/// Consecutive units of one stripe handled the same way: chunk-relative sectors `[lo, hi)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub lo: u64,
    pub hi: u64,
    pub mode: Mode,
    /// Roles read before writing.
    pub reads: RoleSet,
    /// Data indices the batch writes in the run.
    pub written: RoleSet,
    /// Parity roles (P, Q) that get new contents (those with somewhere to write to).
    pub parity_out: RoleSet,
}

/// Coverage of one data member by the batch: merged chunk-relative sector ranges.
fn coverage(segs: &[Seg], dd: usize) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = segs.iter().filter(|s| s.dd == dd).map(|s| (s.lo, s.hi)).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (lo, hi) in v {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

fn covered_in(cov: &[(u64, u64)], lo: u64, hi: u64) -> u64 {
    cov.iter().map(|&(a, b)| b.min(hi).saturating_sub(a.max(lo))).sum()
}

/// What the planner needs to know about the members (for one stripe).
pub(crate) struct Members<'a> {
    /// Whether `role` has a member holding valid data up to chunk-relative sector `end`.
    pub readable: &'a dyn Fn(usize, u64) -> bool,
    /// Whether `role` has any working member to write to.
    pub has_targets: &'a dyn Fn(usize) -> bool,
}

/// Plans a batch (see the module documentation). `Err` names why the batch cannot be written
/// (more members missing than the level covers).
pub(crate) fn plan(
    shape: &StripeShape,
    chunk_sectors: u64,
    unit_sectors: u64,
    segs: &[Seg],
    m: &Members<'_>,
    rmw_level: u8,
) -> Result<Vec<Run>, String> {
    let d = shape.data_disks();
    let n = shape.block.len();
    assert!(n <= MAX_ROLES, "raid_disks is limited to {MAX_ROLES} at assembly");
    let unit = unit_sectors.clamp(1, chunk_sectors);
    let cov: Vec<Vec<(u64, u64)>> = (0..d).map(|dd| coverage(segs, dd)).collect();
    // Units touched by any data member, ascending.
    let mut units: Vec<u64> = Vec::new();
    for c in &cov {
        for &(lo, hi) in c {
            units.extend(lo / unit..hi.div_ceil(unit));
        }
    }
    units.sort_unstable();
    units.dedup();
    let parity_out: RoleSet = shape.parity_roles().filter(|r| (m.has_targets)(*r)).fold(0, |s, r| s | bit(r));
    let max_missing = if shape.raid6 { 2 } else { 1 };
    let mut runs: Vec<Run> = Vec::new();
    for k in units {
        let (ulo, uhi) = (k * unit, ((k + 1) * unit).min(chunk_sectors));
        let mut written: RoleSet = 0;
        let mut full: RoleSet = 0;
        for (dd, c) in cov.iter().enumerate() {
            let n_cov = covered_in(c, ulo, uhi);
            if n_cov > 0 {
                written |= bit(dd);
            }
            if n_cov == uhi - ulo {
                full |= bit(dd);
            }
        }
        let avail = |role: usize| (m.readable)(role, uhi);
        let all_data: RoleSet = if d == MAX_ROLES { RoleSet::MAX } else { bit(d) - 1 };
        let (mode, reads) = if full == all_data {
            (Mode::Full, 0)
        } else if parity_out == 0 {
            // No parity left to update: only partial data members need their old contents.
            let partial = written & !full;
            let reads = members(partial).fold(0, |s, dd| s | bit(shape.data_role(dd)));
            if members(partial).any(|dd| !avail(shape.data_role(dd))) {
                return Err(format!(
                    "stripe {}: no parity member and a partially written data member is missing",
                    shape.map.stripe
                ));
            }
            (Mode::Rcw, reads)
        } else {
            let rmw_reads = members(written).fold(parity_out, |s, dd| s | bit(shape.data_role(dd)));
            let rmw_ok = rmw_level > 0 && members(rmw_reads).all(avail);
            let rcw_reads = members(all_data & !full).fold(0, |s, dd| s | bit(shape.data_role(dd)));
            let rcw_ok = members(rcw_reads).all(avail);
            let (rmw_n, rcw_n) = (rmw_reads.count_ones(), rcw_reads.count_ones());
            if rmw_ok && (!rcw_ok || rmw_n < rcw_n || (rmw_n == rcw_n && rmw_level >= 2)) {
                (Mode::Rmw, rmw_reads)
            } else if rcw_ok {
                (Mode::Rcw, rcw_reads)
            } else {
                let available: RoleSet = (0..n).filter(|r| avail(*r)).fold(0, |s, r| s | bit(r));
                let missing = n - available.count_ones() as usize;
                if missing > max_missing {
                    return Err(format!(
                        "stripe {}: {missing} of {n} members cannot be read at chunk sector {ulo}, the level covers {max_missing}",
                        shape.map.stripe
                    ));
                }
                (Mode::Reconstruct, available)
            }
        };
        match runs.last_mut() {
            Some(r)
                if r.hi == ulo
                    && r.mode == mode
                    && r.reads == reads
                    && r.written == written
                    && r.parity_out == parity_out =>
            {
                r.hi = uhi
            }
            _ => runs.push(Run { lo: ulo, hi: uhi, mode, reads, written, parity_out }),
        }
    }
    Ok(runs)
}

/// The contents of data member `dd` over `[lo, hi)` after the batch, when one seg supplies all
/// of it (no later seg overlaps): a zero-copy slice of the user's buffer.
pub(crate) fn single_source(segs: &[Seg], dd: usize, lo: u64, hi: u64) -> Option<SharedBuf> {
    let last = segs.iter().rposition(|s| s.dd == dd && s.lo < hi && s.hi > lo)?;
    let s = &segs[last];
    if s.lo > lo || s.hi < hi {
        return None;
    }
    let at = ((lo - s.lo) * 512) as usize;
    Some(s.data.slice(at..at + ((hi - lo) * 512) as usize))
}

/// Overlays every seg of data member `dd` onto `out`, which holds chunk sectors `[lo, hi)`,
/// in batch order (later segs win).
pub(crate) fn overlay(segs: &[Seg], dd: usize, lo: u64, hi: u64, out: &mut [u8]) {
    for s in segs.iter().filter(|s| s.dd == dd && s.lo < hi && s.hi > lo) {
        let a = s.lo.max(lo);
        let b = s.hi.min(hi);
        let src = &s.data.as_slice()[((a - s.lo) * 512) as usize..((b - s.lo) * 512) as usize];
        out[((a - lo) * 512) as usize..((b - lo) * 512) as usize].copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Level, ParityGeometry};

    fn seg(dd: usize, lo: u64, hi: u64) -> Seg {
        Seg { dd, lo, hi, data: SharedBuf::zeroed(((hi - lo) * 512) as usize) }
    }

    fn shape(level: Level, n: u32) -> StripeShape {
        StripeShape::new(ParityGeometry::new(level, n, 2, 128).unwrap().stripe_map(0), n as usize)
    }

    fn healthy<'a>() -> Members<'a> {
        Members { readable: &|_, _| true, has_targets: &|_| true }
    }

    #[test]
    fn aligned_full_stripe_reads_nothing_and_is_one_run() {
        // raid5 n=4, 64 KiB chunk: stripe 0 data on 0,1,2, P on 3.
        let sh = shape(Level::Raid5, 4);
        let segs = vec![seg(0, 0, 128), seg(1, 0, 128), seg(2, 0, 128)];
        for unit in [8, 64, 128] {
            let runs = plan(&sh, 128, unit, &segs, &healthy(), 1).unwrap();
            assert_eq!(runs.len(), 1, "unit {unit}");
            assert_eq!((runs[0].mode, runs[0].reads, runs[0].lo, runs[0].hi), (Mode::Full, 0, 0, 128));
        }
    }

    #[test]
    fn small_write_uses_the_cheaper_of_rmw_and_rcw() {
        // raid6 n=6 (4 data): one 4 KiB block: rmw reads data+P+Q = 3, rcw reads 3 others: tie
        // -> rcw; rmw_level 2 prefers rmw.
        let sh = shape(Level::Raid6, 6);
        let segs = vec![seg(1, 16, 24)];
        let runs = plan(&sh, 128, 8, &segs, &healthy(), 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads.count_ones(), runs[0].lo, runs[0].hi), (Mode::Rcw, 3, 16, 24));
        let runs = plan(&sh, 128, 8, &segs, &healthy(), 2).unwrap();
        assert_eq!(runs[0].mode, Mode::Rmw);
        // raid5 n=6 (5 data): rmw 2 reads < rcw 4 reads.
        let sh = shape(Level::Raid5, 6);
        let runs = plan(&sh, 128, 8, &segs, &healthy(), 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads.count_ones()), (Mode::Rmw, 2));
        // rmw_level 0 never reads-modifies-writes.
        let runs = plan(&sh, 128, 8, &segs, &healthy(), 0).unwrap();
        assert_eq!(runs[0].mode, Mode::Rcw);
    }

    #[test]
    fn stripe_size_widens_partial_writes_only() {
        let sh = shape(Level::Raid5, 4);
        // A 4 KiB write at chunk sector 40 with 64 KiB units: the unit [0,128) is worked on.
        let runs = plan(&sh, 128, 128, &[seg(0, 40, 48)], &healthy(), 1).unwrap();
        assert_eq!((runs.len(), runs[0].lo, runs[0].hi), (1, 0, 128));
        // With 4 KiB units just the block.
        let runs = plan(&sh, 128, 8, &[seg(0, 40, 48)], &healthy(), 1).unwrap();
        assert_eq!((runs[0].lo, runs[0].hi), (40, 48));
        // A 12 KiB unit (not a power of two): units [0,24) [24,48) ...; last unit of a chunk
        // shorter.
        let runs = plan(&sh, 128, 24, &[seg(0, 120, 128)], &healthy(), 1).unwrap();
        assert_eq!((runs[0].lo, runs[0].hi), (120, 128));
        // Full part + partial part of one batch: two runs, the full one reads nothing.
        let segs = vec![seg(0, 0, 128), seg(1, 0, 128), seg(2, 0, 64)];
        let runs = plan(&sh, 128, 8, &segs, &healthy(), 1).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].mode, runs[0].lo, runs[0].hi), (Mode::Full, 0, 64));
        assert_eq!((runs[1].mode, runs[1].lo, runs[1].hi, runs[1].reads), (Mode::Rcw, 64, 128, bit(2)));
    }

    #[test]
    fn degraded_choices() {
        let sh = shape(Level::Raid5, 4); // stripe 0: data 0,1,2 on roles 0,1,2; P on 3
        // A missing data member written in full: folded into parity by rcw, nothing read of it.
        let gone1 = Members { readable: &|r, _| r != 1, has_targets: &|r| r != 1 };
        let runs = plan(&sh, 128, 8, &[seg(1, 0, 8)], &gone1, 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads), (Mode::Rcw, bit(0) | bit(2)));
        // A write to another member when 1 is missing: rmw (data + P) works.
        let runs = plan(&sh, 128, 8, &[seg(0, 0, 8)], &gone1, 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads), (Mode::Rmw, bit(0) | bit(3)));
        // ... and with rmw disabled it must reconstruct member 1 first.
        let runs = plan(&sh, 128, 8, &[seg(0, 0, 8)], &gone1, 0).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads), (Mode::Reconstruct, bit(0) | bit(2) | bit(3)));
        // P missing: no parity out; a full-block write reads nothing, a partial unit its old data.
        let gone_p = Members { readable: &|r, _| r != 3, has_targets: &|r| r != 3 };
        let runs = plan(&sh, 128, 8, &[seg(0, 0, 8)], &gone_p, 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads, runs[0].parity_out), (Mode::Rcw, 0, 0));
        let runs = plan(&sh, 128, 16, &[seg(0, 0, 8)], &gone_p, 1).unwrap();
        assert_eq!(runs[0].reads, bit(0));
        // Two missing on raid5: a write that needs either is refused.
        let gone2 = Members { readable: &|r, _| r > 1, has_targets: &|r| r > 1 };
        assert!(plan(&sh, 128, 8, &[seg(0, 0, 4)], &gone2, 1).is_err());
        // raid6 with two data members missing: a partial write to one of them reconstructs.
        let sh6 = shape(Level::Raid6, 6);
        let r0 = sh6.data_role(0);
        let r1 = sh6.data_role(1);
        let gone = move |r: usize| r != r0 && r != r1;
        let m6 = Members { readable: &|r, _| gone(r), has_targets: &gone };
        let runs = plan(&sh6, 128, 8, &[seg(0, 0, 4)], &m6, 1).unwrap();
        assert_eq!((runs[0].mode, runs[0].reads.count_ones()), (Mode::Reconstruct, 4));
        // A recovering member (has targets, not readable yet) is written but not read.
        let rec = Members { readable: &|r, end| r != 2 || end <= 64, has_targets: &|_| true };
        // Below its recovery offset it can be read (rcw ties rmw and wins); above, rmw.
        let runs = plan(&sh, 128, 8, &[seg(0, 56, 72)], &rec, 1).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].mode, runs[0].lo, runs[0].hi), (Mode::Rcw, 56, 64));
        assert_eq!((runs[1].mode, runs[1].lo, runs[1].hi), (Mode::Rmw, 64, 72));
    }

    #[test]
    fn segs_compose_in_order() {
        let mk = |dd, lo, hi, byte: u8| Seg {
            dd,
            lo,
            hi,
            data: SharedBuf::from_slice(&vec![byte; ((hi - lo) * 512) as usize]),
        };
        let segs = vec![mk(0, 0, 16, 1), mk(0, 8, 24, 2)];
        assert!(single_source(&segs, 0, 0, 16).is_none());
        assert_eq!(single_source(&segs, 0, 8, 24).unwrap().as_slice()[0], 2);
        assert!(single_source(&segs, 1, 0, 8).is_none());
        let mut out = vec![0u8; 32 * 512];
        overlay(&segs, 0, 0, 32, &mut out);
        assert_eq!((out[0], out[8 * 512], out[24 * 512]), (1, 2, 0));
    }
}
