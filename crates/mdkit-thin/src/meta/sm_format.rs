//! On-disk space-map structures (persistent-data dm-space-map-common.h).
//!
//! ```text
//! sm root (32 bytes, at the start of a 128-byte superblock field)
//!   0 nr_blocks u64 | 8 nr_allocated u64 | 16 bitmap_root u64 | 24 ref_count_root u64
//! bitmap block (salt 240779)
//!   0 csum u32 | 4 not_used u32 | 8 blocknr u64 | 16 510 x u64 words = 16320 2-bit entries
//!   entry i: word i/32, bits 2(i%32) (value 2) and 2(i%32)+1 (value 1); 3 = see ref-count tree
//! index entry (16 bytes)
//!   0 blocknr u64 (bitmap block) | 8 nr_free u32 | 12 none_free_before u32
//! metadata index block (salt 160478)
//!   0 csum u32 | 4 padding u32 | 8 blocknr u64 | 16 255 x index entry
//! ```

use crate::meta::block::{BLOCK_SIZE, BlockBuf, get_u32, get_u64, put_u32, put_u64};

/// Bytes of the bitmap block header.
pub const BITMAP_HEADER_BYTES: usize = 16;
/// 2-bit reference-count entries per bitmap block.
pub const ENTRIES_PER_BITMAP: u64 = ((BLOCK_SIZE - BITMAP_HEADER_BYTES) / 8 * 32) as u64;
/// Index entries in the metadata space map's single index block.
pub const MAX_METADATA_BITMAPS: usize = 255;
/// Largest metadata device the metadata space map can describe (about 15.9 GiB).
pub const MAX_METADATA_BLOCKS: u64 = MAX_METADATA_BITMAPS as u64 * ENTRIES_PER_BITMAP;
/// Packed size of an index entry.
pub const INDEX_ENTRY_BYTES: usize = 16;
/// Offset of the entries in the metadata index block.
pub const INDEX_BLOCK_HEADER_BYTES: usize = 16;
/// Packed size of a space-map root.
pub const SM_ROOT_BYTES: usize = 32;

const _: () = assert!(ENTRIES_PER_BITMAP == 16320);
const _: () = assert!(INDEX_BLOCK_HEADER_BYTES + MAX_METADATA_BITMAPS * INDEX_ENTRY_BYTES <= BLOCK_SIZE);

/// The packed root of a space map, stored in the superblock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmRoot {
    pub nr_blocks: u64,
    pub nr_allocated: u64,
    pub bitmap_root: u64,
    pub ref_count_root: u64,
}

impl SmRoot {
    pub fn unpack(b: &[u8]) -> SmRoot {
        assert!(b.len() >= SM_ROOT_BYTES, "sm root field is 128 bytes");
        SmRoot {
            nr_blocks: get_u64(b, 0),
            nr_allocated: get_u64(b, 8),
            bitmap_root: get_u64(b, 16),
            ref_count_root: get_u64(b, 24),
        }
    }

    pub fn pack(&self, b: &mut [u8]) {
        assert!(b.len() >= SM_ROOT_BYTES, "sm root field is 128 bytes");
        put_u64(b, 0, self.nr_blocks);
        put_u64(b, 8, self.nr_allocated);
        put_u64(b, 16, self.bitmap_root);
        put_u64(b, 24, self.ref_count_root);
    }
}

/// Where a bitmap block is and how full it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexEntry {
    pub blocknr: u64,
    /// Kernel semantics: ENTRIES_PER_BITMAP minus allocated entries, not truncated to the
    /// space map's end for the last bitmap.
    pub nr_free: u32,
    /// Hint: no free entry before this index.
    pub none_free_before: u32,
}

impl IndexEntry {
    pub fn unpack(b: &[u8]) -> IndexEntry {
        IndexEntry { blocknr: get_u64(b, 0), nr_free: get_u32(b, 8), none_free_before: get_u32(b, 12) }
    }

    /// Why the entry cannot be (counts beyond what one bitmap holds), if so.
    pub fn impossible(&self) -> Option<String> {
        let max = ENTRIES_PER_BITMAP as u32;
        (self.nr_free > max || self.none_free_before > max).then(|| {
            format!(
                "impossible index entry (nr_free {}, none_free_before {}; a bitmap holds {max})",
                self.nr_free, self.none_free_before
            )
        })
    }

    pub fn pack(&self, b: &mut [u8]) {
        put_u64(b, 0, self.blocknr);
        put_u32(b, 8, self.nr_free);
        put_u32(b, 12, self.none_free_before);
    }

    pub fn to_bytes(&self) -> [u8; INDEX_ENTRY_BYTES] {
        let mut v = [0u8; INDEX_ENTRY_BYTES];
        self.pack(&mut v);
        v
    }
}

/// Reference count code of entry `i` (0, 1, 2, or 3 = overflow).
#[inline]
pub fn bitmap_get(buf: &BlockBuf, i: u32) -> u8 {
    let w = get_u64(buf, BITMAP_HEADER_BYTES + (i as usize / 32) * 8);
    let shift = (i % 32) * 2;
    let hi = (w >> shift) & 1;
    let lo = (w >> (shift + 1)) & 1;
    ((hi << 1) | lo) as u8
}

#[inline]
pub fn bitmap_set(buf: &mut BlockBuf, i: u32, code: u8) {
    debug_assert!(code <= 3);
    let off = BITMAP_HEADER_BYTES + (i as usize / 32) * 8;
    let shift = (i % 32) * 2;
    let mut w = get_u64(buf, off);
    w &= !(0b11u64 << shift);
    let hi = u64::from((code >> 1) & 1);
    let lo = u64::from(code & 1);
    w |= (hi << shift) | (lo << (shift + 1));
    put_u64(buf, off, w);
}

/// All entries of a bitmap as codes.
pub fn bitmap_decode(buf: &BlockBuf, out: &mut [u8]) {
    assert!(out.len() as u64 <= ENTRIES_PER_BITMAP);
    for (i, o) in out.iter_mut().enumerate() {
        *o = bitmap_get(buf, i as u32);
    }
}

/// Builds bitmap contents (header left zero) from codes.
pub fn bitmap_encode(codes: &[u8], buf: &mut BlockBuf) {
    assert!(codes.len() as u64 <= ENTRIES_PER_BITMAP);
    buf[BITMAP_HEADER_BYTES..].fill(0);
    for (word_index, chunk) in codes.chunks(32).enumerate() {
        let mut w = 0u64;
        for (j, &code) in chunk.iter().enumerate() {
            let hi = u64::from((code >> 1) & 1);
            let lo = u64::from(code & 1);
            w |= (hi << (2 * j)) | (lo << (2 * j + 1));
        }
        put_u64(buf, BITMAP_HEADER_BYTES + word_index * 8, w);
    }
}

/// First entry in `[begin, end)` whose code is 0 and for which `usable(i)` holds.
pub fn bitmap_find_free(buf: &BlockBuf, begin: u32, end: u32, usable: impl Fn(u32) -> bool) -> Option<u32> {
    const LOW_BITS: u64 = 0x5555_5555_5555_5555;
    let end = end.min(ENTRIES_PER_BITMAP as u32);
    let mut i = begin;
    while i < end {
        let word_index = i / 32;
        let w = get_u64(buf, BITMAP_HEADER_BYTES + word_index as usize * 8);
        // A pair is free when both of its bits are clear.
        let mut free = !(w | (w >> 1)) & LOW_BITS;
        let first_in_word = i % 32;
        free &= !0u64 << (first_in_word * 2);
        while free != 0 {
            let pair = free.trailing_zeros() / 2;
            let e = word_index * 32 + pair;
            if e >= end {
                return None;
            }
            if usable(e) {
                return Some(e);
            }
            free &= free - 1;
        }
        i = (word_index + 1) * 32;
    }
    None
}

/// Decodes `nr` entries of a metadata index block.
pub fn index_block_decode(buf: &BlockBuf, nr: usize) -> Vec<IndexEntry> {
    assert!(nr <= MAX_METADATA_BITMAPS);
    (0..nr).map(|i| IndexEntry::unpack(&buf[INDEX_BLOCK_HEADER_BYTES + i * INDEX_ENTRY_BYTES..])).collect()
}

/// Encodes index entries into a metadata index block (header left zero).
pub fn index_block_encode(entries: &[IndexEntry], buf: &mut BlockBuf) {
    assert!(entries.len() <= MAX_METADATA_BITMAPS);
    buf.fill(0);
    for (i, e) in entries.iter().enumerate() {
        e.pack(&mut buf[INDEX_BLOCK_HEADER_BYTES + i * INDEX_ENTRY_BYTES..]);
    }
}

/// Number of bitmaps needed for `nr_blocks` entries.
pub fn nr_bitmaps(nr_blocks: u64) -> u64 {
    nr_blocks.div_ceil(ENTRIES_PER_BITMAP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::block::zeroed_block;

    #[test]
    fn bitmap_bit_order_matches_kernel() {
        // Kernel sm_set_bitmap: value 1 sets bit 2i+1, value 2 sets bit 2i.
        let mut b = zeroed_block();
        bitmap_set(&mut b, 0, 1);
        assert_eq!(get_u64(&b[..], 16), 0b10);
        bitmap_set(&mut b, 0, 2);
        assert_eq!(get_u64(&b[..], 16), 0b01);
        bitmap_set(&mut b, 33, 3);
        assert_eq!(get_u64(&b[..], 24), 0b1100);
        assert_eq!(bitmap_get(&b, 33), 3);
        assert_eq!(bitmap_get(&b, 0), 2);
    }

    #[test]
    fn encode_decode_find_free() {
        let codes: Vec<u8> = (0..ENTRIES_PER_BITMAP as usize).map(|i| ((i * 7) % 4) as u8).collect();
        let mut b = zeroed_block();
        bitmap_encode(&codes, &mut b);
        let mut out = vec![0u8; codes.len()];
        bitmap_decode(&b, &mut out);
        assert_eq!(out, codes);
        for i in 0..codes.len() as u32 {
            assert_eq!(bitmap_get(&b, i), codes[i as usize]);
        }
        let first = codes.iter().position(|&c| c == 0).unwrap() as u32;
        assert_eq!(bitmap_find_free(&b, 0, 16320, |_| true), Some(first));
        let second = codes.iter().enumerate().skip(first as usize + 1).find(|(_, c)| **c == 0).unwrap().0 as u32;
        assert_eq!(bitmap_find_free(&b, 0, 16320, |i| i != first), Some(second));
        assert_eq!(bitmap_find_free(&b, 0, first, |_| true), None);
        let full = vec![1u8; 16320];
        bitmap_encode(&full, &mut b);
        assert_eq!(bitmap_find_free(&b, 0, 16320, |_| true), None);
    }
}
