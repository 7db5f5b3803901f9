//! md on-disk formats (pure encode/decode, no I/O).
//!
//! ```text
//!  member device (metadata 1.2, the mdadm default)
//!  0        4 KiB            8 KiB                 bblog            data_offset
//!  |  (free) | superblock 4K | bitmap sb + bits ... | bad-block log | data ...
//!            ^ super_offset = 8 sectors
//!                            ^ super_offset + bitmap_offset (8)
//! ```
//!
//! - [`superblock`]: `struct mdp_superblock_1` (256 bytes + 2 bytes per device role), its
//!   checksum, the kernel's load rules and event-count freshness rules.
//! - [`bitmap`]: `bitmap_super_t` (256 bytes) and the on-disk bit geometry, mdadm's sizing rules.
//! - [`badblocks`]: the bad-block log entries.
//! - [`create`]: plan a new array exactly as `mdadm --create` (4.x) does.
//! - [`consistency`]: which members of an array agree, and the reference at assembly.
//! - [`validate`]: the field limits checked before anything is sized from a superblock.
//! - [`examine`]: render a member the way `mdadm --examine` does, or as JSON.
//!
//! Offsets and sizes follow `/work/shared/reference/formats.md` sections 1 and 2, checked
//! against the kernel (md.c, md-bitmap.c) and mdadm (super1.c, bitmap.c).

pub mod badblocks;
pub mod bitmap;
pub mod consistency;
pub mod create;
pub mod examine;
pub mod grow;
pub mod reshape;
pub mod superblock;
pub mod takeover;
pub mod validate;

/// Bytes per sector: every md sector count is in 512-byte units.
pub const SECTOR_BYTES: u64 = 512;

/// Smallest unit mdkit ever writes to a member (upstream md lesson 1): superblocks, bitmap pages
/// and bad-block logs are read and written as whole 4 KiB blocks.
pub const METADATA_BLOCK_BYTES: usize = 4096;

// Little-endian field access on buffers whose length the caller has already checked. Every
// caller validates `buf.len()` against the largest offset it touches before calling these, so
// the slice indexing below cannot go out of bounds (invariant, not input-dependent).

pub(crate) fn le_u16(buf: &[u8], offset: usize) -> u16 {
    u16::from_le_bytes([buf[offset], buf[offset + 1]])
}

pub(crate) fn le_u32(buf: &[u8], offset: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[offset..offset + 4]);
    u32::from_le_bytes(b)
}

pub(crate) fn le_u64(buf: &[u8], offset: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[offset..offset + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn put_u16(buf: &mut [u8], offset: usize, v: u16) {
    buf[offset..offset + 2].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u32(buf: &mut [u8], offset: usize, v: u32) {
    buf[offset..offset + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(buf: &mut [u8], offset: usize, v: u64) {
    buf[offset..offset + 8].copy_from_slice(&v.to_le_bytes());
}

/// Formats a 16-byte UUID the way mdadm prints it: four groups of 8 hex digits separated by ':'.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let mut s = String::with_capacity(35);
    for (i, b) in uuid.iter().enumerate() {
        if i > 0 && i % 4 == 0 {
            s.push(':');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Parses a UUID written as 32 hex digits with any of ':', '-', '.', ' ' as separators (mdadm
/// accepts all of these). Returns `None` when it is not exactly 16 bytes of hex.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text.bytes().filter(|c| !matches!(c, b':' | b'-' | b'.' | b' ')).collect();
    if digits.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in digits.chunks(2).enumerate() {
        let hi = (pair[0] as char).to_digit(16)?;
        let lo = (pair[1] as char).to_digit(16)?;
        out[i] = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trip() {
        let u = [0xdf, 0x68, 0x54, 0xfe, 0x0e, 0xbb, 0xdd, 0xad, 0x18, 0x44, 0xf5, 0xba, 0xb1, 0x7e, 0xfb, 0x9b];
        let s = format_uuid(&u);
        assert_eq!(s, "df6854fe:0ebbddad:1844f5ba:b17efb9b");
        assert_eq!(parse_uuid(&s), Some(u));
        assert_eq!(parse_uuid("df6854fe-0ebb-ddad-1844-f5bab17efb9b"), Some(u));
        assert_eq!(parse_uuid("df6854fe"), None);
        assert_eq!(parse_uuid("zz6854fe:0ebbddad:1844f5ba:b17efb9b"), None);
    }
}
