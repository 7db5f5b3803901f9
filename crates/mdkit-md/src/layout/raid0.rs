//! raid0: striping in zones (drivers/md/raid0.c create_strip_zones, find_zone, map_sector).
//!
//! Each member's data size is rounded down to a whole chunk. Zone 0 stripes over all members up
//! to the smallest; each following zone stripes over the members that still have room, from
//! where the previous zone ended on them (`dev_start`) up to the next smallest size.
//!
//! Within a zone of `k` members, for array sector `s` in the zone (`rel = s - zone_start`):
//! - member sector = `rel / (k*chunk) * chunk + rel % chunk + dev_start`;
//! - member = zone member number `(X / chunk) % k`, with `X = s` for the ORIGINAL layout
//!   (kernels < 3.14) and `X = rel` for the ALTERNATE layout (3.14..5.3). Single-zone arrays,
//!   and arrays whose second zone has one member, are the same under both.

use super::MemberSector;
use super::names::{LayoutError, RAID0_ALT_MULTIZONE_LAYOUT, RAID0_ORIG_LAYOUT};

/// The two multi-zone raid0 layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Raid0Layout {
    /// RAID0_ORIG_LAYOUT (1): member chosen from the absolute array chunk.
    Original,
    /// RAID0_ALT_MULTIZONE_LAYOUT (2): member chosen from the zone-relative chunk.
    Alternate,
}

impl Raid0Layout {
    pub fn from_md(layout: u32) -> Option<Raid0Layout> {
        match layout {
            RAID0_ORIG_LAYOUT => Some(Raid0Layout::Original),
            RAID0_ALT_MULTIZONE_LAYOUT => Some(Raid0Layout::Alternate),
            _ => None,
        }
    }

    pub fn md_value(self) -> u32 {
        match self {
            Raid0Layout::Original => RAID0_ORIG_LAYOUT,
            Raid0Layout::Alternate => RAID0_ALT_MULTIZONE_LAYOUT,
        }
    }
}

/// One strip zone.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Raid0Zone {
    /// First array sector of the zone.
    pub start_sector: u64,
    /// One past the last array sector of the zone.
    pub end_sector: u64,
    /// Member sector (data-offset relative) where the zone starts on each of its members.
    pub dev_start_sector: u64,
    /// The zone's members (array slots), in slot order.
    pub members: Vec<usize>,
}

impl Raid0Zone {
    /// Sectors the zone occupies on each of its members.
    pub fn member_sectors(&self) -> u64 {
        (self.end_sector - self.start_sector) / self.members.len() as u64
    }
}

/// A raid0 array's zones and layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Raid0Geometry {
    chunk_sectors: u64,
    layout: Raid0Layout,
    zones: Vec<Raid0Zone>,
}

impl Raid0Geometry {
    /// Builds the zones from each member's usable data size (the superblock's `data_size`, in
    /// slot order) and the chunk. `layout` is the superblock layout when the RAID0_LAYOUT
    /// feature is set, else `None`: like the kernel (without raid0.default_layout), a
    /// multi-zone array without a layout is refused.
    pub fn new(
        member_data_sectors: &[u64],
        chunk_sectors: u32,
        layout: Option<Raid0Layout>,
    ) -> Result<Raid0Geometry, LayoutError> {
        let invalid = |reason: String| LayoutError::Invalid { level: "raid0", reason };
        if member_data_sectors.is_empty() {
            return Err(invalid("no members".into()));
        }
        if chunk_sectors == 0 {
            return Err(invalid("chunk size is 0".into()));
        }
        let chunk = u64::from(chunk_sectors);
        let sizes: Vec<u64> = member_data_sectors.iter().map(|s| s - s % chunk).collect();
        if let Some(m) = sizes.iter().position(|s| *s == 0) {
            return Err(invalid(format!("member {m} holds less than one {chunk}-sector chunk")));
        }
        let mut distinct: Vec<u64> = sizes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let mut zones = Vec::with_capacity(distinct.len());
        let mut dev_start = 0u64;
        let mut array_pos = 0u64;
        for zone_top in distinct {
            let members: Vec<usize> = (0..sizes.len()).filter(|m| sizes[*m] > dev_start).collect();
            let per_member = zone_top - dev_start;
            let len = per_member
                .checked_mul(members.len() as u64)
                .ok_or_else(|| invalid("array size overflows 64 bits".into()))?;
            let end = array_pos.checked_add(len).ok_or_else(|| invalid("array size overflows 64 bits".into()))?;
            zones.push(Raid0Zone { start_sector: array_pos, end_sector: end, dev_start_sector: dev_start, members });
            array_pos = end;
            dev_start = zone_top;
        }
        let effective = if zones.len() == 1 || zones[1].members.len() == 1 {
            Raid0Layout::Original
        } else {
            layout.ok_or_else(|| {
                invalid("multi-zone array without RAID0_LAYOUT: the layout (original or alternate) is unknown".into())
            })?
        };
        Ok(Raid0Geometry { chunk_sectors: chunk, layout: effective, zones })
    }

    pub fn zones(&self) -> &[Raid0Zone] {
        &self.zones
    }

    /// The layout in effect (single-zone arrays are always `Original`).
    pub fn layout(&self) -> Raid0Layout {
        self.layout
    }

    pub fn chunk_sectors(&self) -> u64 {
        self.chunk_sectors
    }

    pub fn is_multi_zone(&self) -> bool {
        self.zones.len() > 1
    }

    /// Array size: the sum of the chunk-rounded member sizes.
    pub fn array_sectors(&self) -> u64 {
        self.zones.last().map_or(0, |z| z.end_sector)
    }

    /// The member and member sector holding `array_sector`; `None` beyond the end.
    pub fn map(&self, array_sector: u64) -> Option<MemberSector> {
        let zone = self.zones.iter().find(|z| array_sector < z.end_sector)?;
        let k = zone.members.len() as u64;
        let rel = array_sector - zone.start_sector;
        let x = match self.layout {
            Raid0Layout::Original => array_sector,
            Raid0Layout::Alternate => rel,
        };
        let c = self.chunk_sectors;
        let member = zone.members[((x / c) % k) as usize];
        let sector = rel / (k * c) * c + x % c + zone.dev_start_sector;
        Some(MemberSector { member, sector })
    }

    /// The array sector stored at `member_sector` of `member`; `None` for space past the
    /// member's chunk-rounded size or an unknown member.
    pub fn unmap(&self, member: usize, member_sector: u64) -> Option<u64> {
        let zone = self.zones.iter().find(|z| {
            member_sector >= z.dev_start_sector
                && member_sector < z.dev_start_sector + z.member_sectors()
                && z.members.contains(&member)
        })?;
        let k = zone.members.len() as u64;
        let idx = zone.members.iter().position(|m| *m == member)? as u64;
        let c = self.chunk_sectors;
        let o = member_sector - zone.dev_start_sector;
        let row = o / c;
        let base_chunk = match self.layout {
            Raid0Layout::Original => zone.start_sector / c + row * k,
            Raid0Layout::Alternate => row * k,
        };
        let j = (idx + k - base_chunk % k) % k;
        Some(zone.start_sector + (row * k + j) * c + o % c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_zone_is_plain_striping() {
        let g = Raid0Geometry::new(&[1000, 1000, 1000], 8, None).unwrap();
        assert_eq!(g.array_sectors(), 3 * 1000);
        assert_eq!(g.map(0), Some(MemberSector { member: 0, sector: 0 }));
        assert_eq!(g.map(8), Some(MemberSector { member: 1, sector: 0 }));
        assert_eq!(g.map(16 + 3), Some(MemberSector { member: 2, sector: 3 }));
        assert_eq!(g.map(24), Some(MemberSector { member: 0, sector: 8 }));
        assert_eq!(g.map(3000), None);
    }

    #[test]
    fn multi_zone_original_vs_alternate() {
        // Sizes 16, 32, 32 sectors with 8-sector chunks: zone 0 = 3 x 16, zone 1 = 2 x 16.
        let sizes = [16, 32, 32];
        assert!(Raid0Geometry::new(&sizes, 8, None).is_err());
        let orig = Raid0Geometry::new(&sizes, 8, Some(Raid0Layout::Original)).unwrap();
        assert_eq!(orig.zones().len(), 2);
        assert_eq!(orig.zones()[1].members, vec![1, 2]);
        assert_eq!(orig.array_sectors(), 80);
        // Zone 1 starts at array chunk 6; ORIG picks member (6 % 2) = slot 0 of the zone = 1,
        // ALT picks (0 % 2) too. Chunk 7: ORIG 7 % 2 = 1 -> member 2; ALT 1 -> member 2. Same
        // here because zone 0 has an even number of chunks; shift with 3 chunks in zone 0:
        let sizes = [8, 24, 24];
        let orig = Raid0Geometry::new(&sizes, 8, Some(Raid0Layout::Original)).unwrap();
        let alt = Raid0Geometry::new(&sizes, 8, Some(Raid0Layout::Alternate)).unwrap();
        // zone 0: chunks 0..3 (one row), zone 1 starts at array sector 24 (chunk 3).
        assert_eq!(orig.map(24), Some(MemberSector { member: 2, sector: 8 }));
        assert_eq!(alt.map(24), Some(MemberSector { member: 1, sector: 8 }));
        for g in [&orig, &alt] {
            for s in 0..g.array_sectors() {
                let m = g.map(s).unwrap();
                assert_eq!(g.unmap(m.member, m.sector), Some(s));
            }
        }
    }

    #[test]
    fn second_zone_with_one_member_needs_no_layout() {
        let g = Raid0Geometry::new(&[16, 16, 40], 8, None).unwrap();
        assert!(g.is_multi_zone());
        assert_eq!(g.layout(), Raid0Layout::Original);
        assert_eq!(g.map(48), Some(MemberSector { member: 2, sector: 16 }));
        assert_eq!(g.unmap(2, 39), Some(71));
        assert_eq!(g.unmap(2, 40), None);
        assert_eq!(g.unmap(0, 16), None);
    }
}
