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
        (array_sector < self.member_size_sectors)
            .then(|| (0..self.raid_disks as usize).map(|member| MemberSector { member, sector: array_sector }).collect())
    }

    /// The array sector a member sector holds.
    pub fn unmap(&self, member: usize, member_sector: u64) -> Option<u64> {
        (member < self.raid_disks as usize && member_sector < self.member_size_sectors).then_some(member_sector)
    }
}

/// Array size in sectors for raid1/4/5/6/10 from the superblock fields (`size` is the
/// per-member used size). raid0's size depends on every member and comes from
/// [`Raid0Geometry::array_sectors`]. Returns `None` for an invalid geometry.
pub fn array_sectors(level: Level, raid_disks: u32, layout: u32, chunk_sectors: u32, member_size_sectors: u64) -> Option<u64> {
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
        Level::Raid10 => Raid10Geometry::new(raid_disks, layout, chunk_sectors, member_size_sectors).ok().map(|g| g.array_sectors()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
