//! The kernel's data placement for md arrays, forward (array sector → member sectors) and
//! reverse (member sector → array sector, or parity).
//!
//! All member sectors here are relative to the member's `data_offset` (add it before I/O).
//!
//! - [`raid0`]: striping over zones (single- and multi-zone, ORIG and ALT layouts).
//! - [`Raid1Geometry`]: every member holds everything.
//! - [`raid10`]: near / far / offset copies, including the far-set variants.
//! - [`parity`]: raid4, raid5 algorithms 0–5, raid6 algorithms 0–5, 8–10 (DDF), 16–20, with full
//!   stripe descriptions (P, Q, data order, Q-syndrome order).
//! - [`names`]: mdadm's level and layout names, both ways.
//!
//! Sources: drivers/md/raid0.c, raid10.c, raid5.c (raid5_compute_sector, raid5_compute_blocknr,
//! set_syndrome_sources); mdadm restripe.c, maps.c, util.c; formats.md section 3.

pub mod names;
pub mod parity;
pub mod raid0;
pub mod raid10;

pub use names::{LayoutError, format_layout, level_name, parse_layout, parse_level};
pub use parity::{ParityGeometry, ParityMapping, StripeBlock, StripeMap};
pub use raid0::{Raid0Geometry, Raid0Layout, Raid0Zone};
pub use raid10::Raid10Geometry;

/// A place on one member: which member (its role/slot in the array) and the sector relative to
/// that member's data offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct MemberSector {
    pub member: usize,
    pub sector: u64,
}

/// The md RAID levels mdkit implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Level {
    Raid0,
    Raid1,
    Raid4,
    Raid5,
    Raid6,
    Raid10,
}

impl Level {
    /// The superblock's `level` value.
    pub fn md_level(self) -> i32 {
        match self {
            Level::Raid0 => 0,
            Level::Raid1 => 1,
            Level::Raid4 => 4,
            Level::Raid5 => 5,
            Level::Raid6 => 6,
            Level::Raid10 => 10,
        }
    }

    pub fn from_md_level(level: i32) -> Option<Level> {
        match level {
            0 => Some(Level::Raid0),
            1 => Some(Level::Raid1),
            4 => Some(Level::Raid4),
            5 => Some(Level::Raid5),
            6 => Some(Level::Raid6),
            10 => Some(Level::Raid10),
            _ => None,
        }
    }

    /// "raid0", "raid1", ...
    pub fn name(self) -> &'static str {
        match self {
            Level::Raid0 => "raid0",
            Level::Raid1 => "raid1",
            Level::Raid4 => "raid4",
            Level::Raid5 => "raid5",
            Level::Raid6 => "raid6",
            Level::Raid10 => "raid10",
        }
    }

    /// Members that may fail without losing data (raid10: at least one per copy set).
    pub fn max_degraded(self) -> u32 {
        match self {
            Level::Raid0 => 0,
            Level::Raid4 | Level::Raid5 => 1,
            Level::Raid6 => 2,
            Level::Raid1 | Level::Raid10 => 1,
        }
    }

    /// Smallest `raid_disks` mdadm and the kernel accept for this level (raid10 also needs
    /// `copies <= raid_disks`).
    pub fn min_raid_disks(self) -> u32 {
        match self {
            Level::Raid0 | Level::Raid1 => 1,
            Level::Raid4 | Level::Raid5 | Level::Raid10 => 2,
            Level::Raid6 => 4,
        }
    }

    /// Whether this level stripes in chunks (raid1 has no chunk size).
    pub fn uses_chunks(self) -> bool {
        !matches!(self, Level::Raid1)
    }
}

/// raid1: every member holds the whole array at the same sector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raid1Geometry {
    pub raid_disks: u32,
    /// The superblock's `size`.
    pub member_size_sectors: u64,
}

impl Raid1Geometry {
    pub fn array_sectors(&self) -> u64 {
        self.member_size_sectors
    }

    /// Every copy of `array_sector`; `None` beyond the end of the array.
    pub fn map(&self, array_sector: u64) -> Option<Vec<MemberSector>> {
        (array_sector < self.member_size_sectors).then(|| {
            (0..self.raid_disks as usize).map(|member| MemberSector { member, sector: array_sector }).collect()
        })
    }

    /// The array sector a member sector holds.
    pub fn unmap(&self, member: usize, member_sector: u64) -> Option<u64> {
        (member < self.raid_disks as usize && member_sector < self.member_size_sectors).then_some(member_sector)
    }
}

/// Any array's geometry, built from its superblock: the one value the runtime needs to place
/// I/O.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArrayGeometry {
    Raid0(Raid0Geometry),
    Raid1(Raid1Geometry),
    Raid10(Raid10Geometry),
    /// raid4/5/6 and the per-member size they use.
    Parity(ParityGeometry, u64),
}

impl ArrayGeometry {
    /// Builds the geometry from a member's superblock (any member: the array fields are the
    /// same on all). `member_data_sectors` is each slot's `data_size` (raid0 zones depend on
    /// them; ignored by the other levels). raid0 without the RAID0_LAYOUT feature has an
    /// unknown layout, which the kernel (and this) refuses for multi-zone arrays.
    pub fn from_superblock(
        sb: &crate::format::superblock::Superblock,
        member_data_sectors: &[u64],
    ) -> Result<ArrayGeometry, LayoutError> {
        use crate::format::superblock::feature;
        let level = Level::from_md_level(sb.level).ok_or_else(|| LayoutError::Invalid {
            level: "md",
            reason: format!("level {} is not supported", sb.level),
        })?;
        Ok(match level {
            Level::Raid0 => {
                let layout =
                    if sb.feature_map & feature::RAID0_LAYOUT != 0 { Raid0Layout::from_md(sb.layout) } else { None };
                if member_data_sectors.len() != sb.raid_disks as usize {
                    return Err(LayoutError::Invalid {
                        level: "raid0",
                        reason: format!("{} member sizes for {} raid disks", member_data_sectors.len(), sb.raid_disks),
                    });
                }
                ArrayGeometry::Raid0(Raid0Geometry::new(member_data_sectors, sb.chunk_sectors, layout)?)
            }
            Level::Raid1 => {
                ArrayGeometry::Raid1(Raid1Geometry { raid_disks: sb.raid_disks, member_size_sectors: sb.size_sectors })
            }
            Level::Raid10 => {
                ArrayGeometry::Raid10(Raid10Geometry::new(sb.raid_disks, sb.layout, sb.chunk_sectors, sb.size_sectors)?)
            }
            _ => ArrayGeometry::Parity(
                ParityGeometry::new(level, sb.raid_disks, sb.layout, sb.chunk_sectors)?,
                sb.size_sectors,
            ),
        })
    }

    pub fn level(&self) -> Level {
        match self {
            ArrayGeometry::Raid0(_) => Level::Raid0,
            ArrayGeometry::Raid1(_) => Level::Raid1,
            ArrayGeometry::Raid10(_) => Level::Raid10,
            ArrayGeometry::Parity(g, _) => g.level(),
        }
    }

    /// Array size (sectors); 0 if it would not fit 64 bits.
    pub fn array_sectors(&self) -> u64 {
        match self {
            ArrayGeometry::Raid0(g) => g.array_sectors(),
            ArrayGeometry::Raid1(g) => g.array_sectors(),
            ArrayGeometry::Raid10(g) => g.array_sectors(),
            ArrayGeometry::Parity(g, size) => g.array_sectors(*size).unwrap_or(0),
        }
    }
}

/// Array size in sectors for raid1/4/5/6/10 from the superblock fields (`size` is the
/// per-member used size). raid0's size depends on every member and comes from
/// [`Raid0Geometry::array_sectors`]. Returns `None` for an invalid geometry.
pub fn array_sectors(
    level: Level,
    raid_disks: u32,
    layout: u32,
    chunk_sectors: u32,
    member_size_sectors: u64,
) -> Option<u64> {
    match level {
        Level::Raid0 => None,
        Level::Raid1 => Some(member_size_sectors),
        Level::Raid4 | Level::Raid5 | Level::Raid6 => {
            let data_disks = raid_disks.checked_sub(level.max_degraded()).filter(|d| *d > 0)?;
            let chunk = u64::from(chunk_sectors);
            if chunk == 0 {
                return None;
            }
            Some((member_size_sectors - member_size_sectors % chunk).checked_mul(u64::from(data_disks))?)
        }
        Level::Raid10 => {
            Raid10Geometry::new(raid_disks, layout, chunk_sectors, member_size_sectors).ok().map(|g| g.array_sectors())
        }
    }
}

/// Whether `role` holds only parity in every stripe (raid5.c `only_parity`): raid4's last
/// role; raid5/6 parity-first (PARITY_0) the first `max_degraded` roles, parity-last (PARITY_N)
/// the last `max_degraded`; raid6 PARITY_0_6 the first and the last; the raid6 layouts that
/// are a raid5 layout with Q on the last role (`*_6`, what `grow --level raid6 --layout
/// preserve` makes) the last. A member there that is missing or not yet rebuilt leaves no data
/// to rebuild from parity, so an unclean shutdown does not make the array's data suspect.
pub fn holds_only_parity(level: Level, layout: u32, raid_disks: u32, role: u32) -> bool {
    use names::algorithm::*;
    let parity_roles = level.max_degraded();
    match (level, layout) {
        (Level::Raid4, _) => role + 1 == raid_disks,
        (Level::Raid5 | Level::Raid6, PARITY_0) => role < parity_roles,
        (Level::Raid5 | Level::Raid6, PARITY_N) => role + parity_roles >= raid_disks && role < raid_disks,
        (Level::Raid6, PARITY_0_6) => role == 0 || role + 1 == raid_disks,
        (Level::Raid6, LEFT_ASYMMETRIC_6 | RIGHT_ASYMMETRIC_6 | LEFT_SYMMETRIC_6 | RIGHT_SYMMETRIC_6) => {
            role + 1 == raid_disks
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_parity_roles_are_raid5_cs_only_parity() {
        use names::algorithm::*;
        let roles = |level, layout, n| (0..n).filter(|r| holds_only_parity(level, layout, n, *r)).collect::<Vec<u32>>();
        assert_eq!(roles(Level::Raid4, 0, 5), [4]);
        assert_eq!(roles(Level::Raid5, PARITY_N, 4), [3]);
        assert_eq!(roles(Level::Raid6, PARITY_N, 6), [4, 5]);
        assert_eq!(roles(Level::Raid5, PARITY_0, 4), [0]);
        assert_eq!(roles(Level::Raid6, PARITY_0, 6), [0, 1]);
        assert_eq!(roles(Level::Raid6, PARITY_0_6, 5), [0, 4]);
        for layout in [LEFT_ASYMMETRIC_6, RIGHT_ASYMMETRIC_6, LEFT_SYMMETRIC_6, RIGHT_SYMMETRIC_6] {
            assert_eq!(roles(Level::Raid6, layout, 4), [3], "Q last of layout {layout}");
        }
        assert!(roles(Level::Raid5, LEFT_SYMMETRIC, 4).is_empty(), "parity rotates");
        assert!(roles(Level::Raid6, LEFT_SYMMETRIC, 6).is_empty(), "P and Q rotate");
        assert!(roles(Level::Raid10, 0x102, 4).is_empty());
    }

    #[test]
    fn sizes_match_the_lab_arrays() {
        // mdadm/kernel on 4 x 256 MiB: raid5 780288 KiB, raid6 520192 KiB, raid10 n2 520192 KiB.
        assert_eq!(array_sectors(Level::Raid5, 4, 2, 1024, 520_192), Some(780_288 * 2));
        assert_eq!(array_sectors(Level::Raid6, 4, 2, 1024, 520_192), Some(520_192 * 2));
        assert_eq!(array_sectors(Level::Raid10, 4, 0x102, 1024, 520_192), Some(520_192 * 2));
        assert_eq!(array_sectors(Level::Raid1, 2, 0, 0, 522_240), Some(522_240));
        assert_eq!(array_sectors(Level::Raid5, 4, 2, 0, 520_192), None);
        for l in [0, 1, 4, 5, 6, 10] {
            assert_eq!(Level::from_md_level(l).map(Level::md_level), Some(l));
        }
    }

    #[test]
    fn geometry_from_superblocks() {
        use crate::format::create::{CreateRequest, plan};
        use crate::format::superblock::feature;
        let p = plan(&CreateRequest::new(Level::Raid6, vec![1 << 17; 5], [1; 16], 0)).unwrap();
        let sb = &p.members[0].superblock;
        let g = ArrayGeometry::from_superblock(sb, &[]).unwrap();
        assert_eq!((g.level(), g.array_sectors()), (Level::Raid6, p.array_sectors));
        let p = plan(&CreateRequest::new(Level::Raid0, vec![1 << 17, 1 << 18], [1; 16], 0)).unwrap();
        let sizes: Vec<u64> = p.members.iter().map(|m| m.superblock.data_size_sectors).collect();
        let mut sb = p.members[0].superblock.clone();
        let g = ArrayGeometry::from_superblock(&sb, &sizes).unwrap();
        assert_eq!(g.array_sectors(), p.array_sectors);
        // Without RAID0_LAYOUT a multi-zone layout is unknown: refused, as the kernel does.
        sb.feature_map &= !feature::RAID0_LAYOUT;
        let mut three = sizes.clone();
        three.push(1 << 18);
        sb.raid_disks = 3;
        assert!(ArrayGeometry::from_superblock(&sb, &three).is_err());
        assert!(ArrayGeometry::from_superblock(&sb, &sizes).is_err(), "member count must match raid_disks");
    }
}
