//! raid4/5/6: parity placement and data order (drivers/md/raid5.c raid5_compute_sector,
//! raid5_compute_blocknr, raid6_d0/raid6_idx_to_slot/set_syndrome_sources).
//!
//! For array sector `r` with chunk `C` and `D = n - max_degraded` data members:
//! `chunk = r / C`, stripe `s = chunk / D`, logical data index `dd = chunk % D`, member sector
//! `s*C + r%C`. Which member holds data `dd`, P and Q depends on the algorithm and `s`.
//!
//! Q syndrome order (formats.md 3.3): for md layouts, walk the members starting right after Q
//! (or at member 0 when Q is the last member), wrapping, skipping P and Q; the i-th data member
//! met is D_i (coefficient g^i). For the DDF layouts (8, 9, 10) the syndrome runs over all n
//! member slots in member order with P and Q counted as zero blocks (D_i = member index).

use super::names::{LayoutError, algorithm as alg};
use super::{Level, MemberSector};

/// What a member holds in one stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StripeBlock {
    /// Logical data chunk `index` of the stripe (array order).
    Data(usize),
    /// Parity P (XOR).
    P,
    /// RAID6 syndrome Q.
    Q,
}

/// Full description of one stripe: where P and Q live, the data members in array order and in
/// Q-syndrome order.
#[derive(Clone, Debug, PartialEq, Eq, Default, serde::Serialize)]
pub struct StripeMap {
    pub stripe: u64,
    pub p_member: usize,
    pub q_member: Option<usize>,
    /// `data_members[i]` holds logical data chunk `i` of the stripe.
    pub data_members: Vec<usize>,
    /// Q = Σ g^i · syndrome_sources[i] (None: a zero block, the P/Q slots of DDF layouts).
    /// Empty for raid4/5.
    pub syndrome_sources: Vec<Option<usize>>,
    /// The algorithm orders Q like DDF (member index = coefficient).
    pub ddf: bool,
}

impl StripeMap {
    /// What `member` holds in this stripe; `None` for a member outside the array.
    pub fn block_of(&self, member: usize) -> Option<StripeBlock> {
        if member == self.p_member {
            return Some(StripeBlock::P);
        }
        if Some(member) == self.q_member {
            return Some(StripeBlock::Q);
        }
        self.data_members.iter().position(|m| *m == member).map(StripeBlock::Data)
    }
}

/// Forward mapping of one array sector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ParityMapping {
    pub stripe: u64,
    /// Logical data index within the stripe.
    pub data_index: usize,
    /// Member and member sector holding the data.
    pub data: MemberSector,
    pub p_member: usize,
    pub q_member: Option<usize>,
}

/// Reverse mapping of one member sector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum MemberBlock {
    Data { array_sector: u64, stripe: u64, data_index: usize },
    P { stripe: u64 },
    Q { stripe: u64 },
}

/// raid4/5/6 geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParityGeometry {
    level: Level,
    raid_disks: u64,
    algorithm: u32,
    chunk_sectors: u64,
}

impl ParityGeometry {
    /// Validates like raid5.c setup_conf: raid5 algorithms 0–5, raid6 0–5, 8–10, 16–20
    /// (raid4 ignores the layout), chunk a power of two >= 4 KiB, enough members.
    pub fn new(
        level: Level,
        raid_disks: u32,
        algorithm: u32,
        chunk_sectors: u32,
    ) -> Result<ParityGeometry, LayoutError> {
        let invalid = |reason: String| LayoutError::Invalid { level: level.name(), reason };
        match level {
            Level::Raid4 => {}
            Level::Raid5 if algorithm <= alg::PARITY_N => {}
            Level::Raid6
                if algorithm <= alg::PARITY_N || (8..=10).contains(&algorithm) || (16..=20).contains(&algorithm) => {}
            Level::Raid5 | Level::Raid6 => return Err(invalid(format!("unsupported parity algorithm {algorithm}"))),
            _ => return Err(invalid("not a parity level".into())),
        }
        if raid_disks < level.min_raid_disks() {
            return Err(invalid(format!("{raid_disks} devices, need at least {}", level.min_raid_disks())));
        }
        if chunk_sectors < 8 || !chunk_sectors.is_power_of_two() {
            return Err(invalid(format!("chunk {chunk_sectors} sectors must be a power of 2 and at least 4 KiB")));
        }
        Ok(ParityGeometry {
            level,
            raid_disks: u64::from(raid_disks),
            algorithm,
            chunk_sectors: u64::from(chunk_sectors),
        })
    }

    pub fn level(&self) -> Level {
        self.level
    }

    pub fn raid_disks(&self) -> usize {
        self.raid_disks as usize
    }

    pub fn algorithm(&self) -> u32 {
        self.algorithm
    }

    pub fn chunk_sectors(&self) -> u64 {
        self.chunk_sectors
    }

    /// Data members per stripe (`n - 1` or `n - 2`).
    pub fn data_disks(&self) -> usize {
        (self.raid_disks - u64::from(self.level.max_degraded())) as usize
    }

    /// Whether Q is computed in DDF order.
    pub fn is_ddf(&self) -> bool {
        self.level == Level::Raid6 && (alg::ROTATING_ZERO_RESTART..=alg::ROTATING_N_CONTINUE).contains(&self.algorithm)
    }

    /// Array size for a per-member size (`size` rounded down to a chunk, times data members);
    /// `None` if it does not fit 64 bits.
    pub fn array_sectors(&self, member_size_sectors: u64) -> Option<u64> {
        (member_size_sectors - member_size_sectors % self.chunk_sectors).checked_mul(self.data_disks() as u64)
    }

    /// raid5_compute_sector for stripe `stripe` and logical data index `dd`:
    /// returns (data member, P member, Q member or n for none, ddf).
    fn place(&self, stripe: u64, dd: u64) -> (u64, u64, u64, bool) {
        let n = self.raid_disks;
        let data_disks = self.data_disks() as u64;
        let none = n;
        let mut dd = dd;
        let (pd, qd, ddf);
        match self.level {
            Level::Raid4 => {
                pd = data_disks;
                qd = none;
                ddf = false;
            }
            Level::Raid5 => {
                qd = none;
                ddf = false;
                match self.algorithm {
                    alg::LEFT_ASYMMETRIC => {
                        pd = data_disks - stripe % n;
                        if dd >= pd {
                            dd += 1;
                        }
                    }
                    alg::RIGHT_ASYMMETRIC => {
                        pd = stripe % n;
                        if dd >= pd {
                            dd += 1;
                        }
                    }
                    alg::LEFT_SYMMETRIC => {
                        pd = data_disks - stripe % n;
                        dd = (pd + 1 + dd) % n;
                    }
                    alg::RIGHT_SYMMETRIC => {
                        pd = stripe % n;
                        dd = (pd + 1 + dd) % n;
                    }
                    alg::PARITY_0 => {
                        pd = 0;
                        dd += 1;
                    }
                    _ => {
                        // PARITY_N (validated in new()).
                        pd = data_disks;
                    }
                }
            }
            _ => {
                // raid6
                let asym = |pd: u64, dd: &mut u64| -> u64 {
                    if pd == n - 1 {
                        *dd += 1; // Q D D D P
                        0
                    } else {
                        if *dd >= pd {
                            *dd += 2; // D D P Q D
                        }
                        pd + 1
                    }
                };
                match self.algorithm {
                    alg::LEFT_ASYMMETRIC => {
                        pd = n - 1 - stripe % n;
                        qd = asym(pd, &mut dd);
                        ddf = false;
                    }
                    alg::RIGHT_ASYMMETRIC => {
                        pd = stripe % n;
                        qd = asym(pd, &mut dd);
                        ddf = false;
                    }
                    alg::LEFT_SYMMETRIC => {
                        pd = n - 1 - stripe % n;
                        qd = (pd + 1) % n;
                        dd = (pd + 2 + dd) % n;
                        ddf = false;
                    }
                    alg::RIGHT_SYMMETRIC => {
                        pd = stripe % n;
                        qd = (pd + 1) % n;
                        dd = (pd + 2 + dd) % n;
                        ddf = false;
                    }
                    alg::PARITY_0 => {
                        pd = 0;
                        qd = 1;
                        dd += 2;
                        ddf = false;
                    }
                    alg::PARITY_N => {
                        pd = data_disks;
                        qd = data_disks + 1;
                        ddf = false;
                    }
                    alg::ROTATING_ZERO_RESTART => {
                        pd = stripe % n;
                        qd = asym(pd, &mut dd);
                        ddf = true;
                    }
                    alg::ROTATING_N_RESTART => {
                        pd = n - 1 - (stripe + 1) % n;
                        qd = asym(pd, &mut dd);
                        ddf = true;
                    }
                    alg::ROTATING_N_CONTINUE => {
                        pd = n - 1 - stripe % n;
                        qd = (pd + n - 1) % n;
                        dd = (pd + 1 + dd) % n;
                        ddf = true;
                    }
                    alg::LEFT_ASYMMETRIC_6 => {
                        pd = data_disks - stripe % (n - 1);
                        if dd >= pd {
                            dd += 1;
                        }
                        qd = n - 1;
                        ddf = false;
                    }
                    alg::RIGHT_ASYMMETRIC_6 => {
                        pd = stripe % (n - 1);
                        if dd >= pd {
                            dd += 1;
                        }
                        qd = n - 1;
                        ddf = false;
                    }
                    alg::LEFT_SYMMETRIC_6 => {
                        pd = data_disks - stripe % (n - 1);
                        dd = (pd + 1 + dd) % (n - 1);
                        qd = n - 1;
                        ddf = false;
                    }
                    alg::RIGHT_SYMMETRIC_6 => {
                        pd = stripe % (n - 1);
                        dd = (pd + 1 + dd) % (n - 1);
                        qd = n - 1;
                        ddf = false;
                    }
                    _ => {
                        // PARITY_0_6 (validated in new()).
                        pd = 0;
                        dd += 1;
                        qd = n - 1;
                        ddf = false;
                    }
                }
            }
        }
        (dd, pd, qd, ddf)
    }

    /// Describes stripe `stripe`.
    pub fn stripe_map(&self, stripe: u64) -> StripeMap {
        let mut m = StripeMap::default();
        self.fill_stripe_map(stripe, &mut m);
        m
    }

    /// Allocation-reusing [`ParityGeometry::stripe_map`].
    pub fn fill_stripe_map(&self, stripe: u64, out: &mut StripeMap) {
        let n = self.raid_disks;
        out.stripe = stripe;
        out.data_members.clear();
        out.syndrome_sources.clear();
        let (_, pd, qd, ddf) = self.place(stripe, 0);
        for dd in 0..self.data_disks() as u64 {
            out.data_members.push(self.place(stripe, dd).0 as usize);
        }
        out.p_member = pd as usize;
        out.q_member = (qd < n).then_some(qd as usize);
        out.ddf = ddf;
        if self.level != Level::Raid6 {
            return;
        }
        if ddf {
            for i in 0..n {
                out.syndrome_sources.push((i != pd && i != qd).then_some(i as usize));
            }
        } else {
            let d0 = if qd == n - 1 { 0 } else { qd + 1 };
            let mut i = d0;
            loop {
                if i != pd && i != qd {
                    out.syndrome_sources.push(Some(i as usize));
                }
                i = (i + 1) % n;
                if i == d0 {
                    break;
                }
            }
        }
    }

    /// Where `array_sector` lives.
    pub fn map(&self, array_sector: u64) -> ParityMapping {
        let c = self.chunk_sectors;
        let chunk = array_sector / c;
        let d = self.data_disks() as u64;
        let stripe = chunk / d;
        let dd = chunk % d;
        let (member, pd, qd, _) = self.place(stripe, dd);
        ParityMapping {
            stripe,
            data_index: dd as usize,
            data: MemberSector { member: member as usize, sector: stripe * c + array_sector % c },
            p_member: pd as usize,
            q_member: (qd < self.raid_disks).then_some(qd as usize),
        }
    }

    /// What `member_sector` of `member` holds (raid5_compute_blocknr); `None` for a member
    /// outside the array or an array sector beyond 64 bits.
    pub fn unmap(&self, member: usize, member_sector: u64) -> Option<MemberBlock> {
        if member as u64 >= self.raid_disks {
            return None;
        }
        let c = self.chunk_sectors;
        let stripe = member_sector / c;
        let map = self.stripe_map(stripe);
        Some(match map.block_of(member)? {
            StripeBlock::P => MemberBlock::P { stripe },
            StripeBlock::Q => MemberBlock::Q { stripe },
            StripeBlock::Data(i) => MemberBlock::Data {
                array_sector: stripe
                    .checked_mul(self.data_disks() as u64)?
                    .checked_add(i as u64)?
                    .checked_mul(c)?
                    .checked_add(member_sector % c)?,
                stripe,
                data_index: i,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_example_raid5_ls_n4() {
        // formats.md 3.2: stripe 0 = data 0,1,2 on disks 0,1,2, P on 3; stripe 1 = P on 2,
        // data on 3,0,1; stripe 2 = P on 1, data on 2,3,0; stripe 3 = P on 0, data on 1,2,3.
        let g = ParityGeometry::new(Level::Raid5, 4, alg::LEFT_SYMMETRIC, 8).unwrap();
        let expect = [(3, [0, 1, 2]), (2, [3, 0, 1]), (1, [2, 3, 0]), (0, [1, 2, 3])];
        for (s, (p, data)) in expect.iter().enumerate() {
            let m = g.stripe_map(s as u64);
            assert_eq!(m.p_member, *p, "stripe {s}");
            assert_eq!(m.data_members, data.to_vec(), "stripe {s}");
            assert_eq!(m.q_member, None);
        }
        // array chunk 4 = stripe 1, data index 1, member 0, member chunk 1.
        let mp = g.map(4 * 8 + 5);
        assert_eq!(mp.data, MemberSector { member: 0, sector: 8 + 5 });
        assert_eq!(g.unmap(0, 13), Some(MemberBlock::Data { array_sector: 37, stripe: 1, data_index: 1 }));
        assert_eq!(g.unmap(2, 13), Some(MemberBlock::P { stripe: 1 }));
    }

    #[test]
    fn raid6_syndrome_orders() {
        // left-symmetric n=5, stripe 0: P=4, Q=0, data 1,2,3; walk from Q+1 = 1: 1,2,3.
        let g = ParityGeometry::new(Level::Raid6, 5, alg::LEFT_SYMMETRIC, 8).unwrap();
        let m = g.stripe_map(0);
        assert_eq!((m.p_member, m.q_member), (4, Some(0)));
        assert_eq!(m.data_members, vec![1, 2, 3]);
        assert_eq!(m.syndrome_sources, vec![Some(1), Some(2), Some(3)]);
        // left-asymmetric n=5, stripe 1: P=3, Q=4, data 0,1,2; walk from 0 (Q is last).
        let g = ParityGeometry::new(Level::Raid6, 5, alg::LEFT_ASYMMETRIC, 8).unwrap();
        let m = g.stripe_map(1);
        assert_eq!((m.p_member, m.q_member), (3, Some(4)));
        assert_eq!(m.syndrome_sources, vec![Some(0), Some(1), Some(2)]);
        // stripe 2: P=2, Q=3, data 0,1,4; walk from 4: 4,0,1 (a rotation of logical order).
        let m = g.stripe_map(2);
        assert_eq!(m.data_members, vec![0, 1, 4]);
        assert_eq!(m.syndrome_sources, vec![Some(4), Some(0), Some(1)]);
        // DDF zero-restart: all slots in member order, P/Q zero.
        let g = ParityGeometry::new(Level::Raid6, 5, alg::ROTATING_ZERO_RESTART, 8).unwrap();
        let m = g.stripe_map(1);
        assert!(m.ddf);
        assert_eq!((m.p_member, m.q_member), (1, Some(2)));
        assert_eq!(m.syndrome_sources, vec![Some(0), None, None, Some(3), Some(4)]);
        // parity-first-6: P on 0, Q on last, data 1..n-1.
        let g = ParityGeometry::new(Level::Raid6, 5, alg::PARITY_0_6, 8).unwrap();
        let m = g.stripe_map(7);
        assert_eq!((m.p_member, m.q_member, m.data_members.clone()), (0, Some(4), vec![1, 2, 3]));
    }

    #[test]
    fn raid4_parity_is_last() {
        let g = ParityGeometry::new(Level::Raid4, 3, 0, 8).unwrap();
        for s in 0..10 {
            let m = g.stripe_map(s);
            assert_eq!((m.p_member, m.data_members.clone()), (2, vec![0, 1]));
        }
        assert!(ParityGeometry::new(Level::Raid5, 4, 8, 8).is_err());
        assert!(ParityGeometry::new(Level::Raid6, 4, 11, 8).is_err());
        assert!(ParityGeometry::new(Level::Raid6, 3, 2, 8).is_err());
        assert!(ParityGeometry::new(Level::Raid5, 4, 2, 24).is_err());
    }
}
