//! Member images for tests: sparse host files (or byte ranges of one shared sparse file) that
//! plans are written into and superblocks are read back from.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use mdkit_md::format::bitmap::BitmapSuper;
use mdkit_md::format::create::CreatePlan;
use mdkit_md::format::superblock::{MetadataVersion, SB_BLOCK_BYTES, Superblock, superblock_locations};

/// One member device: `size_bytes` at `offset_bytes` of `path` (offset 0 for a whole file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberImage {
    pub path: PathBuf,
    pub offset_bytes: u64,
    pub size_bytes: u64,
}

impl MemberImage {
    /// A fresh sparse file of `size_bytes` (truncated if it exists).
    pub fn sparse_file(path: &Path, size_bytes: u64) -> MemberImage {
        let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        f.set_len(size_bytes).unwrap_or_else(|e| panic!("set_len {}: {e}", path.display()));
        MemberImage { path: path.to_path_buf(), offset_bytes: 0, size_bytes }
    }

    /// A byte range of an existing file (a member the lab exposes with `losetup -o`).
    pub fn region(path: &Path, offset_bytes: u64, size_bytes: u64) -> MemberImage {
        MemberImage { path: path.to_path_buf(), offset_bytes, size_bytes }
    }

    pub fn size_sectors(&self) -> u64 {
        self.size_bytes / 512
    }

    pub fn read(&self, offset_bytes: u64, len: usize) -> Vec<u8> {
        assert!(offset_bytes + len as u64 <= self.size_bytes, "{}: read beyond the member", self.path.display());
        let f = File::open(&self.path).unwrap_or_else(|e| panic!("open {}: {e}", self.path.display()));
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, self.offset_bytes + offset_bytes)
            .unwrap_or_else(|e| panic!("{}: read {len} at {offset_bytes}: {e}", self.path.display()));
        buf
    }

    pub fn write(&self, offset_bytes: u64, data: &[u8]) {
        assert!(
            offset_bytes + data.len() as u64 <= self.size_bytes,
            "{}: write beyond the member",
            self.path.display()
        );
        assert_eq!(offset_bytes % 4096, 0, "member writes are 4 KiB aligned");
        assert_eq!(data.len() % 4096, 0, "member writes are whole 4 KiB blocks");
        let f = OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.path.display()));
        f.write_all_at(data, self.offset_bytes + offset_bytes)
            .unwrap_or_else(|e| panic!("{}: write {} at {offset_bytes}: {e}", self.path.display(), data.len()));
    }

    /// Decodes the superblock at the given version's location.
    pub fn superblock_at(&self, v: MetadataVersion) -> Result<Superblock, String> {
        let off = v.sb_offset_sectors(self.size_sectors()).ok_or("device too small")?;
        let bytes = self.read(off * 512, SB_BLOCK_BYTES);
        let sb =
            Superblock::decode(&bytes, off).map_err(|e| format!("{} @ {}: {e}", self.path.display(), off * 512))?;
        sb.check_fits_device(self.size_sectors()).map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(sb)
    }

    /// Finds the (single) valid v1 superblock on the member.
    pub fn find_superblock(&self) -> Result<Superblock, String> {
        let mut found = Vec::new();
        for (v, _) in superblock_locations(self.size_sectors()) {
            if let Ok(sb) = self.superblock_at(v) {
                found.push(sb);
            }
        }
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(format!("{} (+{}): no valid md v1 superblock", self.path.display(), self.offset_bytes)),
            n => Err(format!("{}: {n} superblocks found", self.path.display())),
        }
    }

    /// Decodes the internal bitmap superblock and reads its whole area.
    pub fn bitmap(&self, sb: &Superblock) -> Result<(BitmapSuper, Vec<u8>), String> {
        let sector = sb.bitmap_sector().ok_or("no internal bitmap")?;
        let head = self.read(sector * 512, 4096);
        let bms = BitmapSuper::decode(&head)
            .map_err(|e| format!("{}: bitmap @ {}: {e}", self.path.display(), sector * 512))?;
        let len = bms.geometry().map_err(|e| e.to_string())?.area_bytes() as usize;
        Ok((bms.clone(), self.read(sector * 512, len)))
    }
}

/// Writes every member's metadata from a plan (4 KiB blocks only).
pub fn write_plan(plan: &CreatePlan, members: &[MemberImage]) {
    assert_eq!(plan.members.len(), members.len());
    for (i, m) in members.iter().enumerate() {
        for (off, bytes) in plan.member_writes(i) {
            m.write(off, bytes);
        }
    }
}

/// Zeroes the first and last MiB of a member region (stale metadata from an earlier run must
/// not be found by the kernel or mdadm).
pub fn wipe_metadata_areas(m: &MemberImage) {
    let zero = vec![0u8; 1 << 20];
    let tail = m.size_bytes.saturating_sub(1 << 20) & !4095;
    m.write(0, &zero[..(m.size_bytes.min(1 << 20) as usize) & !4095]);
    m.write(tail, &zero[..((m.size_bytes - tail) as usize) & !4095]);
}
