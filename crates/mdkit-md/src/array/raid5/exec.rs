//! Executing one stripe's batch of writes: plan ([`super::plan`]), read what the plan needs,
//! rebuild missing old data, build the new data and parity, write every target, and judge the
//! outcome against the level's redundancy.
//!
//! Member reads of one batch run concurrently, then its member writes. A read error marks the
//! role unreadable for this batch and the batch is re-planned without it (reconstructing its
//! old contents from parity when needed); the block is then rewritten with its correct
//! contents (md's read-error correction), and a member whose rewrite fails is failed by the
//! core's write wrapper. A failed member write fails the member (core wrapper); the batch still
//! succeeds while the array can run, because the data of a failed member is in the parity
//! written alongside it.

use std::io;
use std::sync::Arc;

use mdkit_io::{IoBuf, SharedBuf, WriteFlags};

use super::Raid5;
use super::plan::{self, Members, Mode, RoleSet, Run, Seg, bit, has, members};
use super::stripe::StripeShape;
use crate::array::core::ArrayCore;
use crate::array::errors::{MdError, MdErrorKind};
use crate::array::io::join_all;
use crate::array::member::Member;

const SECTOR: u64 = 512;

/// A member write of a batch: which role it serves, the member and where.
pub(crate) struct Target {
    pub role: usize,
    pub member: Arc<Member>,
    pub sector: u64,
    pub data: SharedBuf,
    /// Rewrites a block whose read failed (counted as a corrected read when it succeeds).
    pub fixes_read: bool,
}

/// Issues `targets` concurrently and judges them: `Ok` when every write landed or the members
/// that failed were failed by the core (the array still runs without them).
pub(crate) async fn write_targets(
    a: &ArrayCore,
    r5: &Raid5,
    targets: Vec<Target>,
    flags: WriteFlags,
) -> io::Result<()> {
    r5.stats.member_writes.add(targets.len() as u64);
    let results =
        join_all(targets.iter().map(|t| a.member_write(&t.member, r5.at(&t.member, t.sector), t.data.clone(), flags)))
            .await;
    let mut first_err = None;
    let mut rewritten: Vec<&Target> = Vec::new();
    let mut recorded = 0usize;
    for (t, r) in targets.iter().zip(results) {
        match r {
            Ok(()) => {
                if t.fixes_read {
                    rewritten.push(t);
                }
            }
            // The wrapper failed the member: its data lives on in parity.
            Err(_) if t.member.is_faulty() => {}
            // Recorded as a bad block on a member that stays: for this stripe it is as good as
            // missing, which the parity covers while the stripe keeps enough members.
            Err(e) if MdError::is(&e, MdErrorKind::BadBlockRecorded) => {
                recorded += 1;
                if a.personality().degraded(&a.slots()) as usize + recorded > r5.max_degraded() {
                    first_err.get_or_insert(e);
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    verify_rewrites(a, r5, &rewritten).await;
    match first_err {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// md's read-error correction: a rewritten block is read back; a member that still cannot
/// return it is failed (the data lives on in the other members).
async fn verify_rewrites(a: &ArrayCore, r5: &Raid5, rewritten: &[&Target]) {
    let reads = join_all(
        rewritten
            .iter()
            .map(|t| a.member_read(&t.member, r5.at(&t.member, t.sector), IoBuf::uninit_contents(t.data.len()))),
    )
    .await;
    for (t, (buf, r)) in rewritten.iter().zip(reads) {
        if t.member.is_faulty() {
            continue;
        }
        if r.is_ok() && buf.as_slice() == t.data.as_slice() {
            // md counts a rewritten stripe page's sectors (STRIPE_SECTORS per 4 KiB).
            t.member.note_corrected_sectors(t.data.len() as u64 / SECTOR);
            tracing::info!(
                array = a.name(),
                member = t.member.name(),
                sector = t.sector,
                "read error corrected by rewriting the block from parity"
            );
        } else {
            a.fail_member_on_error(
                &t.member,
                &format!("read error at member sector {} could not be corrected by rewriting", t.sector),
            );
        }
    }
}

/// Role buffers read (or rebuilt) for one run.
type RoleBufs = Vec<Option<IoBuf>>;

/// Writes one batch of pieces to stripe `stripe` (see the module documentation).
pub(crate) async fn write_batch(
    a: &ArrayCore,
    r5: &Raid5,
    shape: &StripeShape,
    segs: &[Seg],
    unit_sectors: u64,
    fua: bool,
) -> io::Result<()> {
    let c = r5.chunk_sectors;
    let base = shape.map.stripe * c;
    let n = shape.block.len();
    let slots = a.slots();
    let mut bad: RoleSet = 0;
    let mut bad_members: Vec<Arc<Member>> = Vec::new();
    let rmw_level = r5.tunables.rmw_level();
    let (runs, old) = 'plan: loop {
        let readable = |role: usize, end: u64| !has(bad, role) && slots.readable(role, base + end).is_some();
        let has_targets = |role: usize| slots.write_targets(role).next().is_some();
        let runs = plan::plan(
            shape,
            c,
            unit_sectors,
            segs,
            &Members { readable: &readable, has_targets: &has_targets },
            rmw_level,
        )
        .map_err(|e| io::Error::other(format!("{}: write to {e}", a.name())))?;
        // Every read of every run, concurrently.
        let mut reads: Vec<(usize, usize, Arc<Member>)> = Vec::new();
        let mut vanished = false;
        for (i, run) in runs.iter().enumerate() {
            for role in members(run.reads) {
                // A member can fail between the plan and here (another request's error):
                // plan again without it rather than read from it.
                match slots.readable(role, base + run.hi) {
                    Some(m) => reads.push((i, role, m.clone())),
                    None => {
                        bad |= bit(role);
                        vanished = true;
                    }
                }
            }
        }
        if vanished {
            if bad.count_ones() as usize > n {
                return Err(io::Error::other(format!(
                    "{}: stripe {}: members keep failing",
                    a.name(),
                    shape.map.stripe
                )));
            }
            continue 'plan;
        }
        r5.stats.member_reads_during_writes.add(reads.len() as u64);
        let results = join_all(reads.iter().map(|(i, _, m)| {
            let run = &runs[*i];
            a.member_read(m, r5.at(m, base + run.lo), IoBuf::uninit_contents(((run.hi - run.lo) * SECTOR) as usize))
        }))
        .await;
        let mut old: Vec<RoleBufs> = runs.iter().map(|_| (0..n).map(|_| None).collect()).collect();
        let mut failed = false;
        for ((i, role, m), (buf, r)) in reads.into_iter().zip(results) {
            match r {
                Ok(()) => old[i][role] = Some(buf),
                Err(e) => {
                    tracing::warn!(
                        array = a.name(),
                        member = m.name(),
                        "read error during a stripe write, reconstructing: {e}"
                    );
                    bad |= bit(role);
                    bad_members.push(m);
                    failed = true;
                }
            }
        }
        if !failed {
            break 'plan (runs, old);
        }
        if bad.count_ones() as usize > n {
            return Err(io::Error::other(format!("{}: stripe {}: reads keep failing", a.name(), shape.map.stripe)));
        }
    };
    let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
    let mut targets: Vec<Target> = Vec::new();
    for (run, mut bufs) in runs.iter().zip(old) {
        r5.stats.count_run(run);
        build_run(a, shape, segs, run, &mut bufs)?;
        let new = new_contents(shape, segs, run, &bufs);
        let parity = run_parity(shape, run, &bufs, &new);
        let sector = base + run.lo;
        for (dd, data) in &new {
            let role = shape.data_role(*dd);
            for m in slots.write_targets(role) {
                let fixes_read = bad_members.iter().any(|b| Arc::ptr_eq(b, m));
                targets.push(Target { role, member: m.clone(), sector, data: data.clone(), fixes_read });
            }
        }
        for (role, data) in parity {
            for m in slots.write_targets(role) {
                let fixes_read = bad_members.iter().any(|b| Arc::ptr_eq(b, m));
                targets.push(Target { role, member: m.clone(), sector, data: data.clone(), fixes_read });
            }
        }
        // Unwritten blocks whose read failed get their (rebuilt) contents back.
        for role in members(bad) {
            let written = targets.iter().any(|t| t.role == role && t.sector == sector);
            if let (false, Some(b)) = (written, bufs[role].as_ref()) {
                let data = SharedBuf::from_slice(b.as_slice());
                for m in slots.write_targets(role) {
                    let fixes_read = bad_members.iter().any(|x| Arc::ptr_eq(x, m));
                    targets.push(Target { role, member: m.clone(), sector, data: data.clone(), fixes_read });
                }
            }
        }
    }
    write_targets(a, r5, targets, flags).await
}

/// Rebuilds the old contents of unreadable roles where the run's mode needs them.
fn build_run(a: &ArrayCore, shape: &StripeShape, segs: &[Seg], run: &Run, bufs: &mut RoleBufs) -> io::Result<()> {
    let _ = segs;
    if run.mode != Mode::Reconstruct {
        return Ok(());
    }
    let len = ((run.hi - run.lo) * SECTOR) as usize;
    let rebuilt = {
        let blocks: Vec<Option<&[u8]>> = bufs.iter().map(|b| b.as_ref().map(IoBuf::as_slice)).collect();
        shape
            .reconstruct(&blocks, len)
            .map_err(|e| io::Error::other(format!("{}: stripe {}: {e}", a.name(), shape.map.stripe)))?
    };
    for (role, b) in rebuilt {
        bufs[role] = Some(b);
    }
    Ok(())
}

/// The new contents of every data member the run writes: a slice of the user's buffer when one
/// piece supplies it all, else the old contents with the pieces laid over them.
fn new_contents(shape: &StripeShape, segs: &[Seg], run: &Run, bufs: &RoleBufs) -> Vec<(usize, SharedBuf)> {
    let len = ((run.hi - run.lo) * SECTOR) as usize;
    members(run.written)
        .map(|dd| {
            if let Some(s) = plan::single_source(segs, dd, run.lo, run.hi) {
                return (dd, s);
            }
            let mut b = match &bufs[shape.data_role(dd)] {
                Some(old) => IoBuf::from_slice(old.as_slice()),
                // Fully covered by several pieces (full and reconstruct-write modes).
                None => IoBuf::zeroed(len),
            };
            plan::overlay(segs, dd, run.lo, run.hi, b.as_mut_slice());
            (dd, b.freeze())
        })
        .collect()
}

/// The new parity blocks of the run: `(role, contents)` for every parity role it updates.
fn run_parity(shape: &StripeShape, run: &Run, bufs: &RoleBufs, new: &[(usize, SharedBuf)]) -> Vec<(usize, SharedBuf)> {
    if run.parity_out == 0 {
        return Vec::new();
    }
    let len = ((run.hi - run.lo) * SECTOR) as usize;
    let p_role = shape.p_role();
    let q_role = shape.q_role();
    let want_p = has(run.parity_out, p_role);
    let want_q = q_role.is_some_and(|q| has(run.parity_out, q));
    let new_of = |dd: usize| new.iter().find(|(d, _)| *d == dd).map(|(_, b)| b.as_slice());
    let (mut p, mut q) = if run.mode == Mode::Rmw {
        // Start from the old parity and fold each written block's change into it.
        let old_of = |role: usize| bufs[role].as_ref().map(|b| IoBuf::from_slice(b.as_slice()));
        let p = if want_p { old_of(p_role) } else { None };
        let q = if want_q { q_role.and_then(old_of) } else { None };
        (p, q)
    } else {
        (want_p.then(|| IoBuf::uninit_contents(len)), want_q.then(|| IoBuf::uninit_contents(len)))
    };
    if run.mode == Mode::Rmw {
        for dd in members(run.written) {
            let old = bufs[shape.data_role(dd)].as_ref().expect("rmw read every written data member");
            let new = new_of(dd).expect("every written member has new contents");
            shape.rmw_update(
                dd,
                old.as_slice(),
                new,
                p.as_mut().map(IoBuf::as_mut_slice),
                q.as_mut().map(IoBuf::as_mut_slice),
            );
        }
    } else {
        let data: Vec<&[u8]> = (0..shape.data_disks())
            .map(|dd| match new_of(dd) {
                Some(b) => b,
                None => bufs[shape.data_role(dd)].as_ref().expect("planned reads cover unwritten data").as_slice(),
            })
            .collect();
        shape.gen_parity(&data, p.as_mut().map(IoBuf::as_mut_slice), q.as_mut().map(IoBuf::as_mut_slice));
    }
    let mut out = Vec::new();
    if let Some(p) = p {
        out.push((p_role, p.freeze()));
    }
    if let (Some(q), Some(qr)) = (q, q_role) {
        out.push((qr, q.freeze()));
    }
    out
}
