//! Reading an array's contents back from member images through mdkit's layouts, verifying the
//! redundancy on the way (mirror copies equal, raid4/5/6 P = XOR of the data, raid6 Q = the GF(2^8)
//! syndrome in the stripe's syndrome order). Used to check mdkit's layout code against data the
//! kernel wrote.

use mdkit_md::format::superblock::{DeviceRole, Superblock};
use mdkit_md::layout::{ArrayGeometry, Level, ParityGeometry, Raid0Geometry, Raid1Geometry, Raid10Geometry};

use super::images::MemberImage;

enum Geo {
    Raid0(Raid0Geometry),
    Raid1(Raid1Geometry),
    Raid10(Raid10Geometry),
    Parity(ParityGeometry),
}

/// An assembled view of member images (active members, by role).
pub struct ArrayView {
    geo: Geo,
    members: Vec<MemberImage>,
    data_offsets_sectors: Vec<u64>,
    chunk_bytes: u64,
    array_sectors: u64,
}

/// Multiply by the generator {02} in GF(2^8) with polynomial 0x11d.
fn gf_mul2(x: u8) -> u8 {
    (x << 1) ^ if x & 0x80 != 0 { 0x1d } else { 0 }
}

impl ArrayView {
    /// Builds the view from every member's image and decoded superblock (any order; spares are
    /// ignored). Fails when a slot has no member.
    pub fn new(images: &[MemberImage], sbs: &[Superblock]) -> Result<ArrayView, String> {
        let sb0 = &sbs[0];
        let level = Level::from_md_level(sb0.level).ok_or(format!("level {} not supported", sb0.level))?;
        let n = sb0.raid_disks as usize;
        let mut slots: Vec<Option<(MemberImage, u64, u64)>> = vec![None; n];
        for (img, sb) in images.iter().zip(sbs) {
            if let DeviceRole::Active(r) = sb.role() {
                let slot = slots.get_mut(r as usize).ok_or(format!("role {r} beyond raid_disks {n}"))?;
                *slot = Some((img.clone(), sb.data_offset_sectors, sb.data_size_sectors));
            }
        }
        let slots: Vec<(MemberImage, u64, u64)> = slots
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or(format!("slot {i} has no active member")))
            .collect::<Result<_, _>>()?;
        let chunk = sb0.chunk_sectors;
        // Built the way the runtime builds it: from the superblock.
        let data_sizes: Vec<u64> = slots.iter().map(|s| s.2).collect();
        let geo = match ArrayGeometry::from_superblock(sb0, &data_sizes).map_err(|e| e.to_string())? {
            ArrayGeometry::Raid0(g) => Geo::Raid0(g),
            ArrayGeometry::Raid1(g) => Geo::Raid1(g),
            ArrayGeometry::Raid10(g) => Geo::Raid10(g),
            ArrayGeometry::Parity(g, _) => Geo::Parity(g),
        };
        let array_sectors =
            ArrayGeometry::from_superblock(sb0, &data_sizes).map_err(|e| e.to_string())?.array_sectors();
        let _ = level;
        Ok(ArrayView {
            geo,
            data_offsets_sectors: slots.iter().map(|s| s.1).collect(),
            members: slots.into_iter().map(|s| s.0).collect(),
            chunk_bytes: u64::from(chunk.max(8)) * 512,
            array_sectors,
        })
    }

    pub fn array_bytes(&self) -> u64 {
        self.array_sectors * 512
    }

    fn read_member(&self, member: usize, sector: u64, len: usize) -> Vec<u8> {
        self.members[member].read((self.data_offsets_sectors[member] + sector) * 512, len)
    }

    /// Reads `[offset_bytes, offset_bytes + len)` of the array (chunk-aligned offsets and
    /// lengths), verifying every copy and every parity block of the stripes it touches.
    pub fn read_verified(&self, offset_bytes: u64, len: u64) -> Result<Vec<u8>, String> {
        let c = self.chunk_bytes;
        assert!(offset_bytes.is_multiple_of(c) && len.is_multiple_of(c), "chunk-aligned reads only");
        let end = offset_bytes + len;
        if end > self.array_bytes() {
            return Err(format!("read to {end} beyond the array ({} bytes)", self.array_bytes()));
        }
        let mut out = Vec::with_capacity(len as usize);
        let mut pos = offset_bytes;
        while pos < end {
            let sector = pos / 512;
            match &self.geo {
                Geo::Raid0(g) => {
                    let m = g.map(sector).ok_or("raid0 map failed")?;
                    out.extend(self.read_member(m.member, m.sector, c as usize));
                    pos += c;
                }
                Geo::Raid1(g) => {
                    let copies = g.map(sector).ok_or("raid1 map failed")?;
                    out.extend(self.read_copies(&copies, c as usize, pos)?);
                    pos += c;
                }
                Geo::Raid10(g) => {
                    let copies = g.map(sector).ok_or("raid10 map failed")?;
                    out.extend(self.read_copies(&copies, c as usize, pos)?);
                    pos += c;
                }
                Geo::Parity(g) => {
                    let d = g.data_disks() as u64;
                    let stripe = sector / (g.chunk_sectors() * d);
                    let stripe_bytes = c * d;
                    let data = self.read_stripe_verified(g, stripe)?;
                    let first = stripe * stripe_bytes;
                    let from = (pos - first) as usize;
                    let to = ((end - first).min(stripe_bytes)) as usize;
                    out.extend_from_slice(&data[from..to]);
                    pos = first + to as u64;
                }
            }
        }
        Ok(out)
    }

    fn read_copies(&self, copies: &[mdkit_md::layout::MemberSector], len: usize, pos: u64) -> Result<Vec<u8>, String> {
        let first = self.read_member(copies[0].member, copies[0].sector, len);
        for cp in &copies[1..] {
            if self.read_member(cp.member, cp.sector, len) != first {
                return Err(format!(
                    "array byte {pos}: copy on member {} sector {} differs from member {}",
                    cp.member, cp.sector, copies[0].member
                ));
            }
        }
        Ok(first)
    }

    /// Reads one whole stripe, checks P (and Q), returns the data chunks in array order.
    fn read_stripe_verified(&self, g: &ParityGeometry, stripe: u64) -> Result<Vec<u8>, String> {
        let c = self.chunk_bytes as usize;
        let map = g.stripe_map(stripe);
        let member_sector = stripe * g.chunk_sectors();
        let blocks: Vec<Vec<u8>> = (0..g.raid_disks()).map(|m| self.read_member(m, member_sector, c)).collect();
        let mut p = vec![0u8; c];
        for m in &map.data_members {
            for (x, y) in p.iter_mut().zip(&blocks[*m]) {
                *x ^= y;
            }
        }
        if p != blocks[map.p_member] {
            return Err(format!(
                "stripe {stripe}: P on member {} is not the XOR of the data members {:?}",
                map.p_member, map.data_members
            ));
        }
        if let Some(qm) = map.q_member {
            // Horner: Q = (((D_{k-1} * g) + D_{k-2}) * g + ...) + D_0.
            let mut q = vec![0u8; c];
            for src in map.syndrome_sources.iter().rev() {
                for x in q.iter_mut() {
                    *x = gf_mul2(*x);
                }
                if let Some(m) = src {
                    for (x, y) in q.iter_mut().zip(&blocks[*m]) {
                        *x ^= y;
                    }
                }
            }
            if q != blocks[qm] {
                return Err(format!(
                    "stripe {stripe}: Q on member {qm} is not the syndrome over {:?} (ddf {})",
                    map.syndrome_sources, map.ddf
                ));
            }
        }
        Ok(map.data_members.iter().flat_map(|m| blocks[*m].clone()).collect())
    }
}
