//! Lists of source blocks as the kernels see them: an ordered list of data blocks where a block
//! may be absent, and an absent block counts as all zeroes (the kernel's
//! `raid6_empty_zero_page`, without needing a zero page as long as the longest block).

//------------------------------------------------------------------------------------------------

/// An ordered list of source blocks (index = position in Q order).
pub(crate) trait Blocks {
    /// Number of positions, present or absent.
    fn count(&self) -> usize;
    /// The block at `index`, or `None` when it is to be treated as zeroes.
    fn block(&self, index: usize) -> Option<&[u8]>;
}

impl Blocks for [&[u8]] {
    #[inline(always)]
    fn count(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn block(&self, index: usize) -> Option<&[u8]> {
        Some(self[index])
    }
}

impl Blocks for [Option<&[u8]>] {
    #[inline(always)]
    fn count(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn block(&self, index: usize) -> Option<&[u8]> {
        self[index]
    }
}

/// `base` with the hole at `index` filled by `block` (used to recompute Q once a missing data
/// block is known, and to XOR P in place of the missing block, without building a new list).
pub(crate) struct Filled<'a> {
    pub base: &'a [Option<&'a [u8]>],
    pub index: usize,
    pub block: &'a [u8],
}

impl Blocks for Filled<'_> {
    #[inline(always)]
    fn count(&self) -> usize {
        self.base.len()
    }
    #[inline(always)]
    fn block(&self, index: usize) -> Option<&[u8]> {
        if index == self.index { Some(self.block) } else { self.base[index] }
    }
}

/// Asserts that every present block covers `[offset_bytes, offset_bytes + len_bytes)`.
/// The kernels rely on this before they touch memory through raw pointers.
pub(crate) fn assert_cover<B: Blocks + ?Sized>(blocks: &B, offset_bytes: usize, len_bytes: usize) {
    let end_bytes = offset_bytes.checked_add(len_bytes).expect("block range overflows usize");
    for index in 0..blocks.count() {
        if let Some(block) = blocks.block(index) {
            assert!(
                block.len() >= end_bytes,
                "source block {index} is {} bytes, shorter than the {end_bytes} bytes needed",
                block.len()
            );
        }
    }
}
