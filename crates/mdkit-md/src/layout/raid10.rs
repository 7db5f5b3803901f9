//! raid10: near / far / offset copies (drivers/md/raid10.c setup_geo, calc_sectors,
//! __raid10_find_phys, raid10_find_virt, raid10_size).
//!
//! Layout word: bits 0-7 near copies, bits 8-15 far copies, bit 16 "offset" (far copies are
//! in the next chunk rows instead of the next far section), bits 17-18 far-set variant
//! (0: one far set of all devices; 1: sets of `raid_disks / far` devices, the old buggy
//! "improved" layout; 2: sets of `far * near` devices). Higher bits must be zero.

use super::MemberSector;
use super::names::LayoutError;

/// A raid10 array's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raid10Geometry {
    raid_disks: u64,
    near_copies: u64,
    far_copies: u64,
    far_offset: bool,
    far_set_size: u64,
    chunk_shift: u32,
    /// Per-member sectors actually used (kernel conf->dev_sectors).
    dev_sectors: u64,
    /// Distance between far copies on a member (sectors).
    stride_sectors: u64,
}

impl Raid10Geometry {
    /// Builds the geometry from the superblock: `raid_disks`, `layout`, `chunk_sectors` and
    /// `size` (per-member size). Refuses what the kernel refuses (setup_geo / setup_conf).
    pub fn new(
        raid_disks: u32,
        layout: u32,
        chunk_sectors: u32,
        member_size_sectors: u64,
    ) -> Result<Raid10Geometry, LayoutError> {
        let invalid = |reason: String| LayoutError::Invalid { level: "raid10", reason };
        if layout >> 19 != 0 {
            return Err(invalid(format!("layout {layout:#x} has unknown bits above bit 18")));
        }
        if chunk_sectors < 8 || !chunk_sectors.is_power_of_two() {
            return Err(invalid(format!("chunk {chunk_sectors} sectors must be a power of 2 and at least 4 KiB")));
        }
        let n = u64::from(raid_disks);
        let nc = u64::from(layout & 0xff);
        let fc = u64::from((layout >> 8) & 0xff);
        let fo = layout & (1 << 16) != 0;
        let copies = nc * fc;
        if copies < 2 || copies > n {
            return Err(invalid(format!(
                "layout {layout:#x} gives {copies} copies on {raid_disks} devices (need 2..=devices)"
            )));
        }
        let far_set_size = match layout >> 17 {
            0 => n,
            1 => n / fc,
            2 => fc * nc,
            v => return Err(invalid(format!("far-set variant {v} is not a valid layout"))),
        };
        if far_set_size == 0 || far_set_size > n {
            return Err(invalid(format!("far set of {far_set_size} devices does not fit {raid_disks} devices")));
        }
        let chunk_shift = chunk_sectors.trailing_zeros();
        let mut g = Raid10Geometry {
            raid_disks: n,
            near_copies: nc,
            far_copies: fc,
            far_offset: fo,
            far_set_size,
            chunk_shift,
            dev_sectors: 0,
            stride_sectors: 0,
        };
        g.calc_sectors(member_size_sectors);
        // Every address computed later is bounded by dev_sectors * raid_disks.
        if u128::from(g.dev_sectors) * u128::from(n) > u128::from(u64::MAX) {
            return Err(invalid(format!(
                "member size {member_size_sectors} sectors x {raid_disks} devices overflows 64 bits"
            )));
        }
        Ok(g)
    }

    /// calc_sectors: the sectors per member actually used and the far stride. (u128: the
    /// intermediate products of a corrupt superblock's `size` must not overflow.)
    fn calc_sectors(&mut self, size_sectors: u64) {
        let (n, nc, fc) = (u128::from(self.raid_disks), u128::from(self.near_copies), u128::from(self.far_copies));
        let array_chunks = u128::from(size_sectors >> self.chunk_shift) / fc * n / nc;
        let dev_chunks = (array_chunks * nc * fc).div_ceil(n);
        // dev_chunks <= size_sectors >> chunk_shift (copies <= raid_disks), so it fits.
        let dev_chunks = u64::try_from(dev_chunks).unwrap_or(u64::MAX >> self.chunk_shift);
        self.dev_sectors = dev_chunks << self.chunk_shift;
        self.stride_sectors =
            if self.far_offset { 1 << self.chunk_shift } else { (dev_chunks / self.far_copies) << self.chunk_shift };
    }

    pub fn near_copies(&self) -> u32 {
        self.near_copies as u32
    }

    pub fn far_copies(&self) -> u32 {
        self.far_copies as u32
    }

    pub fn far_offset(&self) -> bool {
        self.far_offset
    }

    /// Copies of every array sector (`near * far`).
    pub fn copies(&self) -> usize {
        (self.near_copies * self.far_copies) as usize
    }

    pub fn chunk_sectors(&self) -> u64 {
        1 << self.chunk_shift
    }

    /// Per-member sectors the kernel uses (it rewrites the superblock `size` to this).
    pub fn dev_sectors(&self) -> u64 {
        self.dev_sectors
    }

    /// Array size (raid10_size over the used member size).
    pub fn array_sectors(&self) -> u64 {
        ((self.dev_sectors >> self.chunk_shift) / self.far_copies * self.raid_disks / self.near_copies)
            << self.chunk_shift
    }

    /// Every copy of `array_sector`, in the kernel's slot order (near copies, each followed by
    /// its far copies). `None` beyond the end of the array.
    pub fn map(&self, array_sector: u64) -> Option<Vec<MemberSector>> {
        let mut out = Vec::with_capacity(self.copies());
        self.map_into(array_sector, &mut out).then_some(out)
    }

    /// Allocation-free [`Raid10Geometry::map`]: clears `out` and fills it; returns `false`
    /// (leaving `out` empty) beyond the end of the array.
    pub fn map_into(&self, array_sector: u64, out: &mut Vec<MemberSector>) -> bool {
        out.clear();
        if array_sector >= self.array_sectors() {
            return false;
        }
        let n = self.raid_disks;
        let last_far_set_start = (n / self.far_set_size - 1) * self.far_set_size;
        let last_far_set_size = self.far_set_size + n % self.far_set_size;
        let chunk_mask = (1u64 << self.chunk_shift) - 1;
        let chunk = (array_sector >> self.chunk_shift) * self.near_copies;
        let mut sector = array_sector & chunk_mask;
        let mut dev = chunk % n;
        let mut stripe = chunk / n;
        if self.far_offset {
            stripe *= self.far_copies;
        }
        sector += stripe << self.chunk_shift;
        for _ in 0..self.near_copies {
            let mut d = dev;
            let mut s = sector;
            out.push(MemberSector { member: d as usize, sector: s });
            for _ in 1..self.far_copies {
                let set = d / self.far_set_size;
                d += self.near_copies;
                if !n.is_multiple_of(self.far_set_size) && d > last_far_set_start {
                    d -= last_far_set_start;
                    d %= last_far_set_size;
                    d += last_far_set_start;
                } else {
                    d %= self.far_set_size;
                    d += self.far_set_size * set;
                }
                s += self.stride_sectors;
                out.push(MemberSector { member: d as usize, sector: s });
            }
            dev += 1;
            if dev >= n {
                dev = 0;
                sector += chunk_mask + 1;
            }
        }
        true
    }

    /// The array sector stored at `member_sector` of `member` (raid10_find_virt); `None` for
    /// an unknown member, space past the used size, or the unused tail of the last row.
    pub fn unmap(&self, member: usize, member_sector: u64) -> Option<u64> {
        let n = self.raid_disks;
        let mut dev = member as u64;
        if dev >= n || member_sector >= self.dev_sectors {
            return None;
        }
        let mut far_set_start = (dev / self.far_set_size) * self.far_set_size;
        let mut far_set_size = self.far_set_size;
        if !n.is_multiple_of(self.far_set_size) {
            let last_far_set_start = (n / self.far_set_size - 1) * self.far_set_size;
            if dev >= last_far_set_start {
                far_set_size = self.far_set_size + n % self.far_set_size;
                far_set_start = last_far_set_start;
            }
        }
        let chunk_mask = (1u64 << self.chunk_shift) - 1;
        let offset = member_sector & chunk_mask;
        let chunk;
        if self.far_offset {
            let c = member_sector >> self.chunk_shift;
            let fc = c % self.far_copies;
            chunk = c / self.far_copies;
            // dev -= fc * near, wrapping within the far set.
            let back = fc * self.near_copies;
            dev = if dev >= far_set_start + back { dev - back } else { dev + far_set_size - back };
        } else {
            let mut sector = member_sector;
            while sector >= self.stride_sectors {
                sector -= self.stride_sectors;
                if dev < self.near_copies + far_set_start {
                    dev += far_set_size - self.near_copies;
                } else {
                    dev -= self.near_copies;
                }
            }
            chunk = sector >> self.chunk_shift;
        }
        let vchunk = (chunk * n + dev) / self.near_copies;
        let array_sector = (vchunk << self.chunk_shift) + offset;
        (array_sector < self.array_sectors()).then_some(array_sector)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n2_on_four_is_mirrored_pairs() {
        let g = Raid10Geometry::new(4, 0x102, 8, 800).unwrap();
        assert_eq!(g.array_sectors(), 1600);
        assert_eq!(
            g.map(0).unwrap(),
            vec![MemberSector { member: 0, sector: 0 }, MemberSector { member: 1, sector: 0 }]
        );
        assert_eq!(
            g.map(8).unwrap(),
            vec![MemberSector { member: 2, sector: 0 }, MemberSector { member: 3, sector: 0 }]
        );
        assert_eq!(
            g.map(16).unwrap(),
            vec![MemberSector { member: 0, sector: 8 }, MemberSector { member: 1, sector: 8 }]
        );
        assert_eq!(g.unmap(3, 9), Some(25));
    }

    #[test]
    fn f2_puts_the_second_copy_in_the_far_half() {
        let g = Raid10Geometry::new(2, 0x201, 8, 800).unwrap();
        assert_eq!(g.dev_sectors(), 800);
        assert_eq!(g.array_sectors(), 800);
        // chunk 0 on member 0 at 0, far copy on member 1 at stride 400.
        assert_eq!(
            g.map(0).unwrap(),
            vec![MemberSector { member: 0, sector: 0 }, MemberSector { member: 1, sector: 400 }]
        );
        assert_eq!(
            g.map(8).unwrap(),
            vec![MemberSector { member: 1, sector: 0 }, MemberSector { member: 0, sector: 400 }]
        );
        assert_eq!(g.unmap(0, 400), Some(8));
    }

    #[test]
    fn o2_puts_the_second_copy_in_the_next_row() {
        let g = Raid10Geometry::new(3, 0x10201, 8, 960).unwrap();
        assert_eq!(
            g.map(0).unwrap(),
            vec![MemberSector { member: 0, sector: 0 }, MemberSector { member: 1, sector: 8 }]
        );
        assert_eq!(
            g.map(8).unwrap(),
            vec![MemberSector { member: 1, sector: 0 }, MemberSector { member: 2, sector: 8 }]
        );
        assert_eq!(
            g.map(16).unwrap(),
            vec![MemberSector { member: 2, sector: 0 }, MemberSector { member: 0, sector: 8 }]
        );
        assert_eq!(g.map(24).unwrap()[0], MemberSector { member: 0, sector: 16 });
    }

    #[test]
    fn refusals() {
        assert!(Raid10Geometry::new(2, 0x103, 8, 100).is_err());
        assert!(Raid10Geometry::new(4, 0x101, 8, 100).is_err());
        assert!(Raid10Geometry::new(4, 0x102, 12, 100).is_err());
        assert!(Raid10Geometry::new(4, 0x102 | (3 << 17), 8, 100).is_err());
        assert!(Raid10Geometry::new(4, 0x102 | (1 << 19), 8, 100).is_err());
    }
}
