//! Parity arithmetic over one stripe, in terms of member roles: which role holds which block,
//! P/Q generation from data in array order, read-modify-write updates, reconstruction of any
//! missing blocks the level's redundancy covers, and the scrub verdict (RAID6 names the wrong
//! member with `pq_check`).
//!
//! Data blocks are given in *array order* (`data[i]` is logical data chunk `i` of the stripe,
//! held by `map.data_members[i]`); this module translates to the Q-syndrome order
//! (`map.syndrome_sources`, DDF zero slots included) that `mdkit-parity` works in.

use mdkit_io::IoBuf;
use mdkit_parity::PqCheck;

use crate::layout::{StripeBlock, StripeMap};

/// One stripe's roles and orders, derived once from its [`StripeMap`].
#[derive(Clone, Debug)]
pub(crate) struct StripeShape {
    pub map: StripeMap,
    pub raid6: bool,
    /// What each member role holds in this stripe.
    pub block: Vec<StripeBlock>,
    /// Q position → data index (array order); `None` for a DDF zero slot. Empty for raid4/5.
    pub qsrc: Vec<Option<usize>>,
    /// Data index → Q position (raid6 only).
    pub qpos: Vec<usize>,
}

impl StripeShape {
    pub fn new(map: StripeMap, raid_disks: usize) -> StripeShape {
        let raid6 = map.q_member.is_some();
        let block: Vec<StripeBlock> = (0..raid_disks)
            .map(|r| map.block_of(r).expect("every member of a parity stripe holds data, P or Q"))
            .collect();
        let mut qsrc = Vec::new();
        let mut qpos = vec![0; map.data_members.len()];
        if raid6 {
            for (pos, src) in map.syndrome_sources.iter().enumerate() {
                let dd = src.and_then(|m| map.data_members.iter().position(|d| *d == m));
                if let Some(dd) = dd {
                    qpos[dd] = pos;
                }
                qsrc.push(dd);
            }
        }
        StripeShape { map, raid6, block, qsrc, qpos }
    }

    pub fn data_disks(&self) -> usize {
        self.map.data_members.len()
    }

    pub fn p_role(&self) -> usize {
        self.map.p_member
    }

    pub fn q_role(&self) -> Option<usize> {
        self.map.q_member
    }

    /// Parity roles: P, then Q for raid6.
    pub fn parity_roles(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.map.p_member).chain(self.map.q_member)
    }

    pub fn data_role(&self, dd: usize) -> usize {
        self.map.data_members[dd]
    }

    /// Human-readable name of a role's block in this stripe ("data 2", "P", "Q").
    pub fn block_name(&self, role: usize) -> String {
        match self.block[role] {
            StripeBlock::Data(i) => format!("data {i}"),
            StripeBlock::P => "P".into(),
            StripeBlock::Q => "Q".into(),
        }
    }

    /// Computes P and/or Q from the data blocks (array order). Either output may be absent.
    pub fn gen_parity(&self, data: &[&[u8]], p: Option<&mut [u8]>, q: Option<&mut [u8]>) {
        debug_assert_eq!(data.len(), self.data_disks());
        match (p, q) {
            (None, None) => {}
            (Some(p), None) => mdkit_parity::xor_gen(data, p),
            (p, Some(q)) => {
                debug_assert!(self.raid6, "Q requested for a raid4/5 stripe");
                let mut scratch;
                let p = match p {
                    Some(p) => p,
                    None => {
                        scratch = vec![0u8; q.len()];
                        &mut scratch[..]
                    }
                };
                let ordered: Vec<Option<&[u8]>> = self.qsrc.iter().map(|s| s.map(|dd| data[dd])).collect();
                if self.map.ddf {
                    mdkit_parity::pq_gen_sparse(&ordered, p, q);
                } else {
                    let dense: Vec<&[u8]> =
                        ordered.into_iter().map(|b| b.expect("md layouts have no zero slots")).collect();
                    mdkit_parity::pq_gen(&dense, p, q);
                }
            }
        }
    }

    /// Read-modify-write of data block `dd`: folds `old ^ new` into P and/or Q.
    pub fn rmw_update(&self, dd: usize, old: &[u8], new: &[u8], p: Option<&mut [u8]>, q: Option<&mut [u8]>) {
        match (p, q) {
            (None, None) => {}
            (Some(p), None) => mdkit_parity::xor_into(p, &[old, new]),
            (p, Some(q)) => {
                let mut scratch;
                let p = match p {
                    Some(p) => p,
                    None => {
                        scratch = vec![0u8; q.len()];
                        &mut scratch[..]
                    }
                };
                mdkit_parity::pq_update(self.qpos[dd], old, new, p, q);
            }
        }
    }

    /// Rebuilds every missing block (roles whose entry is `None`) from the others. Returns the
    /// rebuilt blocks as `(role, contents)`, or why it cannot (more missing than the level
    /// covers).
    pub fn reconstruct(&self, blocks: &[Option<&[u8]>], len: usize) -> Result<Vec<(usize, IoBuf)>, String> {
        let missing: Vec<usize> = (0..blocks.len()).filter(|r| blocks[*r].is_none()).collect();
        if missing.is_empty() {
            return Ok(Vec::new());
        }
        let max = if self.raid6 { 2 } else { 1 };
        if missing.len() > max {
            let names: Vec<String> = missing.iter().map(|r| format!("member {r} ({})", self.block_name(*r))).collect();
            return Err(format!("{} blocks missing ({}), the level covers {max}", missing.len(), names.join(", ")));
        }
        if !self.raid6 {
            // raid4/5: the one missing block is the XOR of all the others.
            let mut out = IoBuf::zeroed(len);
            let others: Vec<&[u8]> = blocks.iter().flatten().copied().collect();
            mdkit_parity::xor_gen(&others, out.as_mut_slice());
            return Ok(vec![(missing[0], out)]);
        }
        let zero = if self.map.ddf { vec![0u8; len] } else { Vec::new() };
        let data: Vec<Option<&[u8]>> = self
            .qsrc
            .iter()
            .map(|s| match s {
                Some(dd) => blocks[self.data_role(*dd)],
                None => Some(&zero[..]),
            })
            .collect();
        let p = blocks[self.p_role()];
        let q = blocks[self.q_role().expect("raid6 has Q")];
        // Outputs in mdkit-parity's order: missing data by ascending Q position, then P, then Q.
        let mut order: Vec<usize> = missing.clone();
        order.sort_by_key(|r| match self.block[*r] {
            StripeBlock::Data(dd) => self.qpos[dd],
            StripeBlock::P => usize::MAX - 1,
            StripeBlock::Q => usize::MAX,
        });
        let mut outs: Vec<IoBuf> = order.iter().map(|_| IoBuf::zeroed(len)).collect();
        {
            let mut refs: Vec<&mut [u8]> = outs.iter_mut().map(IoBuf::as_mut_slice).collect();
            mdkit_parity::recover(&data, p, q, &mut refs).map_err(|e| e.to_string())?;
        }
        Ok(order.into_iter().zip(outs).collect())
    }

    /// Scrubs one unit whose blocks were all read (`blocks[role]`).
    pub fn check(&self, blocks: &[&[u8]]) -> Scrub {
        let len = blocks[0].len();
        let data: Vec<&[u8]> = self.map.data_members.iter().map(|r| blocks[*r]).collect();
        if !self.raid6 {
            let mut p = vec![0u8; len];
            mdkit_parity::xor_gen(&data, &mut p);
            return if p == blocks[self.p_role()] { Scrub::Consistent } else { Scrub::Mismatch { culprit: None } };
        }
        let zero = vec![0u8; if self.map.ddf { len } else { 0 }];
        let ordered: Vec<&[u8]> = self.qsrc.iter().map(|s| s.map_or(&zero[..], |dd| data[dd])).collect();
        let q_role = self.q_role().expect("raid6 has Q");
        match mdkit_parity::pq_check(&ordered, blocks[self.p_role()], blocks[q_role]) {
            PqCheck::Consistent => Scrub::Consistent,
            PqCheck::WrongP => Scrub::Mismatch { culprit: Some(self.p_role()) },
            PqCheck::WrongQ => Scrub::Mismatch { culprit: Some(q_role) },
            PqCheck::WrongData { index } => match self.qsrc.get(index).copied().flatten() {
                Some(dd) => Scrub::Mismatch { culprit: Some(self.data_role(dd)) },
                // A DDF zero slot cannot be wrong: more than one block is.
                None => Scrub::Mismatch { culprit: None },
            },
            PqCheck::MultipleWrong => Scrub::Mismatch { culprit: None },
        }
    }
}

/// What a scrub of one unit found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scrub {
    Consistent,
    /// The blocks disagree; `culprit` is the one member role that explains it (RAID6), or
    /// `None` when no single member does (RAID5 cannot tell; RAID6 with several bad blocks).
    Mismatch {
        culprit: Option<usize>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Level, ParityGeometry};

    fn fill(seed: u64, len: usize) -> Vec<u8> {
        let mut r = mdkit_io::Rng::new(seed);
        let mut v = vec![0u8; len];
        r.fill(&mut v);
        v
    }

    /// Every stripe of every layout: full blocks from data, then every missing set the level
    /// covers is rebuilt exactly, and scrub names a corrupted block (RAID6).
    #[test]
    fn generate_reconstruct_and_scrub_every_layout() {
        let cases: Vec<(Level, Vec<u32>, Vec<u32>)> = vec![
            (Level::Raid4, vec![0], vec![2, 3, 5]),
            (Level::Raid5, vec![0, 1, 2, 3, 4, 5], vec![2, 3, 5]),
            (Level::Raid6, vec![0, 1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 20], vec![4, 5, 7]),
        ];
        let len = 64;
        for (level, algs, sizes) in cases {
            for alg in algs {
                for &n in &sizes {
                    let g = ParityGeometry::new(level, n, alg, 8).unwrap();
                    for s in 0..(2 * u64::from(n)) {
                        let shape = StripeShape::new(g.stripe_map(s), n as usize);
                        let d = shape.data_disks();
                        let data: Vec<Vec<u8>> = (0..d).map(|i| fill(s * 100 + i as u64, len)).collect();
                        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                        let mut p = vec![0u8; len];
                        let mut q = vec![0u8; len];
                        shape.gen_parity(&refs, Some(&mut p), shape.raid6.then_some(&mut q[..]));
                        let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); n as usize];
                        for (i, b) in data.iter().enumerate() {
                            blocks[shape.data_role(i)] = b.clone();
                        }
                        blocks[shape.p_role()] = p.clone();
                        if let Some(qr) = shape.q_role() {
                            blocks[qr] = q.clone();
                        }
                        let all: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
                        assert_eq!(shape.check(&all), Scrub::Consistent, "{level:?} alg {alg} n {n} stripe {s}");
                        // Every single and (raid6) double loss.
                        let mut sets: Vec<Vec<usize>> = (0..n as usize).map(|r| vec![r]).collect();
                        if shape.raid6 {
                            for a in 0..n as usize {
                                for b in a + 1..n as usize {
                                    sets.push(vec![a, b]);
                                }
                            }
                        }
                        for lost in sets {
                            let have: Vec<Option<&[u8]>> =
                                (0..n as usize).map(|r| (!lost.contains(&r)).then(|| all[r])).collect();
                            let got = shape.reconstruct(&have, len).unwrap();
                            assert_eq!(got.len(), lost.len());
                            for (r, b) in got {
                                assert_eq!(b.as_slice(), all[r], "{level:?} alg {alg} n {n} stripe {s} lost {lost:?}");
                            }
                        }
                        // RMW of each data block equals regeneration.
                        for dd in 0..d {
                            let new = fill(9999 + dd as u64, len);
                            let (mut p2, mut q2) = (p.clone(), q.clone());
                            shape.rmw_update(dd, &data[dd], &new, Some(&mut p2), shape.raid6.then_some(&mut q2[..]));
                            let mut refs2 = refs.clone();
                            refs2[dd] = &new;
                            let (mut p3, mut q3) = (vec![0u8; len], vec![0u8; len]);
                            shape.gen_parity(&refs2, Some(&mut p3), shape.raid6.then_some(&mut q3[..]));
                            assert_eq!(p2, p3);
                            if shape.raid6 {
                                assert_eq!(q2, q3);
                            }
                        }
                        // Scrub names a corrupted member on RAID6.
                        if shape.raid6 {
                            for r in 0..n as usize {
                                let mut bad = blocks.clone();
                                bad[r][7] ^= 0x5a;
                                let refs: Vec<&[u8]> = bad.iter().map(Vec::as_slice).collect();
                                assert_eq!(shape.check(&refs), Scrub::Mismatch { culprit: Some(r) }, "alg {alg} n {n}");
                            }
                        } else {
                            let mut bad = blocks.clone();
                            bad[0][3] ^= 1;
                            let refs: Vec<&[u8]> = bad.iter().map(Vec::as_slice).collect();
                            assert_eq!(shape.check(&refs), Scrub::Mismatch { culprit: None });
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn too_many_missing_is_an_error() {
        let g = ParityGeometry::new(Level::Raid5, 4, 2, 8).unwrap();
        let shape = StripeShape::new(g.stripe_map(0), 4);
        let b = vec![0u8; 8];
        let e = shape.reconstruct(&[None, None, Some(&b), Some(&b)], 8).unwrap_err();
        assert!(e.contains("2 blocks missing"), "{e}");
    }
}
