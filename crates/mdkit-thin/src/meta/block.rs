//! Metadata blocks: 4096 bytes each, every one starting with a crc32c checksum (salted by block
//! type) over bytes `[4..4096)` and carrying its own location at byte 8.
//!
//! ```text
//!   0      4        8            16
//!   +------+--------+------------+---------------------------------------------+
//!   | csum | (type) | blocknr    | type-specific payload ...                   |
//!   +------+--------+------------+---------------------------------------------+
//!   csum = crc32c_kernel(seed ~0, bytes[4..4096)) ^ salt       (no final inversion)
//! ```
//! Salts (kernel dm-thin-metadata.c, persistent-data/*): superblock 160774, btree node 121107,
//! space-map bitmap 240779, metadata space-map index 160478.

use crate::meta::error::Corruption;

/// Size of every metadata block in bytes.
pub const BLOCK_SIZE: usize = 4096;
/// Metadata block size in 512-byte sectors (the superblock's `metadata_block_size`).
pub const BLOCK_SECTORS: u32 = (BLOCK_SIZE / 512) as u32;
/// Offset of the self-location field common to every block type.
pub const BLOCKNR_OFFSET: usize = 8;

/// One metadata block.
pub type BlockBuf = [u8; BLOCK_SIZE];

/// A zero-filled block on the heap.
pub fn zeroed_block() -> Box<BlockBuf> {
    Box::new([0u8; BLOCK_SIZE])
}

/// What a block is; decides the checksum salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    Superblock,
    Node,
    Bitmap,
    Index,
}

impl BlockKind {
    pub const fn salt(self) -> u32 {
        match self {
            BlockKind::Superblock => 160_774,
            BlockKind::Node => 121_107,
            BlockKind::Bitmap => 240_779,
            BlockKind::Index => 160_478,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            BlockKind::Superblock => "superblock",
            BlockKind::Node => "btree node",
            BlockKind::Bitmap => "space-map bitmap",
            BlockKind::Index => "metadata space-map index",
        }
    }

    pub const ALL: [BlockKind; 4] = [BlockKind::Superblock, BlockKind::Node, BlockKind::Bitmap, BlockKind::Index];
}

impl std::fmt::Display for BlockKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The checksum a block of `kind` must carry.
pub fn checksum(kind: BlockKind, buf: &BlockBuf) -> u32 {
    // crc32c::crc32c is the standard CRC-32C (init ~0, final ~0); the kernel's variant has no
    // final inversion, so undo it.
    crc32c::crc32c(&buf[4..]) ^ 0xffff_ffff ^ kind.salt()
}

/// Stamps location and checksum into `buf` (done right before every write).
pub fn seal(buf: &mut BlockBuf, kind: BlockKind, location: u64) {
    put_u64(buf, BLOCKNR_OFFSET, location);
    let csum = checksum(kind, buf);
    put_u32(buf, 0, csum);
    debug_assert!(verify(buf, kind, location).is_ok());
}

/// Verifies checksum and self-location (done right after every read).
pub fn verify(buf: &BlockBuf, kind: BlockKind, location: u64) -> Result<(), Corruption> {
    let stored = get_u32(buf, 0);
    let computed = checksum(kind, buf);
    if stored != computed {
        return Err(Corruption::ChecksumMismatch { kind, stored, computed, looks_like: identify(buf) });
    }
    let found = get_u64(buf, BLOCKNR_OFFSET);
    if found != location {
        return Err(Corruption::WrongBlockNumber { kind, found });
    }
    Ok(())
}

/// Which block type's salt makes the checksum match, if any.
pub fn identify(buf: &BlockBuf) -> Option<BlockKind> {
    let stored = get_u32(buf, 0);
    let raw = crc32c::crc32c(&buf[4..]) ^ 0xffff_ffff;
    BlockKind::ALL.into_iter().find(|k| raw ^ k.salt() == stored)
}

//------------------------------------------------------------------------------------------------
// Maps keyed by block number. Keys are trusted integers, so a cheap mixing hash replaces
// SipHash on the lookup path (every node access goes through one or two of these maps).

/// Hasher for `u64` block numbers (splitmix64 finaliser).
#[derive(Clone, Copy, Default)]
pub struct BlockHasher(u64);

impl std::hash::Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &x in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(x);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

pub type BuildBlockHasher = std::hash::BuildHasherDefault<BlockHasher>;
/// `HashMap` keyed by block number.
pub type BlockMap<V> = std::collections::HashMap<u64, V, BuildBlockHasher>;
/// `HashSet` of block numbers.
pub type BlockSet = std::collections::HashSet<u64, BuildBlockHasher>;

//------------------------------------------------------------------------------------------------
// Little-endian field access. Offsets are constants of the formats, always in bounds for a
// 4096-byte block; slices shorter than the field are an internal invariant violation.

#[inline]
pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4-byte field inside the block"))
}

#[inline]
pub fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8-byte field inside the block"))
}

#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_verify_identify_roundtrip() {
        for kind in BlockKind::ALL {
            let mut b = zeroed_block();
            b[100] = 7;
            seal(&mut b, kind, 42);
            assert_eq!(verify(&b, kind, 42), Ok(()));
            assert_eq!(identify(&b), Some(kind));
            assert!(matches!(verify(&b, kind, 43), Err(Corruption::WrongBlockNumber { found: 42, .. })));
            for other in BlockKind::ALL.into_iter().filter(|&k| k != kind) {
                assert!(matches!(verify(&b, other, 42), Err(Corruption::ChecksumMismatch { .. })));
            }
            b[200] ^= 1;
            assert!(matches!(verify(&b, kind, 42), Err(Corruption::ChecksumMismatch { .. })));
        }
    }

    #[test]
    fn checksum_matches_kernel_definition() {
        // Kernel: dm_bm_checksum(data, len, xor) = crc32c(~0, data, len) ^ xor, where the
        // kernel crc32c() has no final inversion. Compute that bitwise here, independently.
        fn crc32c_kernel(seed: u32, data: &[u8]) -> u32 {
            let mut crc = seed;
            for &byte in data {
                crc ^= u32::from(byte);
                for _ in 0..8 {
                    crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
                }
            }
            crc
        }
        let mut b = zeroed_block();
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 31 % 251) as u8;
        }
        let expect = crc32c_kernel(0xffff_ffff, &b[4..]) ^ BlockKind::Node.salt();
        assert_eq!(checksum(BlockKind::Node, &b), expect);
    }
}
