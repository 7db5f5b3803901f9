//! The metadata space map, held in memory.
//!
//! The kernel keeps the metadata space map on disk and solves the recursion (changing a count
//! shadows a bitmap, which allocates a block, which changes a count, ...) with a queue of
//! deferred ref-count operations. This engine uses an equivalent that is easier to reason
//! about: the metadata device is at most 255 x 16320 blocks, so all reference counts fit in
//! memory (one byte per block, <= 4 MiB, plus a map for counts >= 3). During a transaction every
//! allocation and count change is a plain memory update. Only at commit are the bitmaps, the
//! ref-count btree and the index block written, by [`crate::meta::tm::Tm::flush_metadata_sm`]:
//!
//! 1. counts >= 3 that changed are written into the ref-count btree (its nodes are never shared,
//!    so updating it only moves counts between 0 and 1 and never recurses into itself);
//! 2. the index block and every bitmap whose entries changed get a new location (allocation and
//!    release of the old one change more counts, possibly touching more bitmaps; this reaches a
//!    fixed point after at most 255 steps because each bitmap moves at most once per
//!    transaction);
//! 3. bitmaps and the index block are encoded from the final counts.
//!
//! Blocks freed in a transaction are not reused before it commits: a block is allocatable only
//! if its count is 0 now *and* was 0 at the last commit (the kernel's "free in both the old and
//! the current space map"), tracked by `txn_old`, the count each touched block had at the
//! start of the transaction.

use std::collections::{BTreeSet, HashMap};

use crate::meta::block::BlockMap;

use crate::meta::sm_format::{ENTRIES_PER_BITMAP, IndexEntry, MAX_METADATA_BLOCKS, nr_bitmaps};

pub(crate) struct MetadataSm {
    nr_blocks: u64,
    /// 0, 1, 2, or 3 = look in `overflow`.
    codes: Vec<u8>,
    overflow: HashMap<u64, u32>,
    nr_allocated: u64,
    allocated_per_bitmap: Vec<u32>,
    cursor: u64,
    /// Count at the start of the transaction of every block touched since.
    txn_old: BlockMap<u32>,
    /// Blocks whose count is 0 now but was not at the start of the transaction: free, yet
    /// not allocatable before the transaction commits.
    nr_freed_this_txn: u64,
    /// Bitmaps with changed entries this transaction.
    pub dirty_bitmaps: BTreeSet<usize>,
    /// Blocks whose count is or was >= 3 and changed this transaction.
    pub overflow_dirty: BTreeSet<u64>,
    /// On-disk locations (0 = not yet allocated).
    pub index_block: u64,
    pub bitmap_blocks: Vec<u64>,
    pub ref_count_root: u64,
}

impl MetadataSm {
    /// An empty space map of `nr_blocks` (capped at the format's maximum).
    pub fn new(nr_blocks: u64) -> MetadataSm {
        let nr_blocks = nr_blocks.min(MAX_METADATA_BLOCKS);
        let nb = nr_bitmaps(nr_blocks) as usize;
        MetadataSm {
            nr_blocks,
            codes: vec![0; nr_blocks as usize],
            overflow: HashMap::new(),
            nr_allocated: 0,
            allocated_per_bitmap: vec![0; nb],
            cursor: 0,
            txn_old: BlockMap::default(),
            nr_freed_this_txn: 0,
            dirty_bitmaps: (0..nb).collect(),
            overflow_dirty: BTreeSet::new(),
            index_block: 0,
            bitmap_blocks: vec![0; nb],
            ref_count_root: 0,
        }
    }

    /// Loads decoded on-disk state. `codes` holds one code per block; `overflow` the ref-count
    /// tree. Returns an error message if they disagree.
    pub fn from_disk(
        codes: Vec<u8>,
        overflow: HashMap<u64, u32>,
        index_block: u64,
        bitmap_blocks: Vec<u64>,
        ref_count_root: u64,
    ) -> Result<MetadataSm, String> {
        let nr_blocks = codes.len() as u64;
        let nb = nr_bitmaps(nr_blocks) as usize;
        if bitmap_blocks.len() != nb {
            return Err(format!("{} bitmaps for {nr_blocks} blocks, expected {nb}", bitmap_blocks.len()));
        }
        let mut allocated_per_bitmap = vec![0u32; nb];
        let mut nr_allocated = 0;
        for (b, &c) in codes.iter().enumerate() {
            if c != 0 {
                allocated_per_bitmap[b / ENTRIES_PER_BITMAP as usize] += 1;
                nr_allocated += 1;
            }
            if c == 3 && !overflow.contains_key(&(b as u64)) {
                return Err(format!("block {b} has overflow code 3 but no ref-count tree entry"));
            }
        }
        for (&b, &v) in &overflow {
            if b >= nr_blocks || codes[b as usize] != 3 {
                return Err(format!("ref-count tree entry for block {b} (count {v}) without overflow code"));
            }
            if v < 3 {
                return Err(format!("ref-count tree entry for block {b} holds count {v} < 3"));
            }
        }
        Ok(MetadataSm {
            nr_blocks,
            codes,
            overflow,
            nr_allocated,
            allocated_per_bitmap,
            cursor: 0,
            txn_old: BlockMap::default(),
            nr_freed_this_txn: 0,
            dirty_bitmaps: BTreeSet::new(),
            overflow_dirty: BTreeSet::new(),
            index_block,
            bitmap_blocks,
            ref_count_root,
        })
    }

    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    pub fn nr_allocated(&self) -> u64 {
        self.nr_allocated
    }

    /// Blocks `alloc` can hand out before the next commit: free now *and* at the last commit
    /// (the kernel's `sm_metadata_get_nr_free` is as strict). Blocks freed in the open
    /// transaction are not counted: counting them let the reserve check pass while the
    /// allocation that followed found nothing, failing the operation half-way.
    pub fn nr_free(&self) -> u64 {
        self.nr_blocks - self.nr_allocated - self.nr_freed_this_txn
    }

    /// Blocks freed in the open transaction: allocatable again once it commits.
    pub fn nr_freed_this_txn(&self) -> u64 {
        self.nr_freed_this_txn
    }

    pub fn get(&self, b: u64) -> u32 {
        match self.codes.get(b as usize) {
            Some(3) => self.overflow.get(&b).copied().unwrap_or(3),
            Some(&c) => u32::from(c),
            None => 0,
        }
    }

    fn set(&mut self, b: u64, n: u32) {
        let old = self.get(b);
        if old == n {
            return;
        }
        let was_old = *self.txn_old.entry(b).or_insert(old);
        if was_old != 0 {
            // Freed this transaction when it drops to 0, back in use when it leaves 0.
            if n == 0 {
                self.nr_freed_this_txn += 1;
            } else if old == 0 {
                self.nr_freed_this_txn -= 1;
            }
        }
        let bm = (b / ENTRIES_PER_BITMAP) as usize;
        self.dirty_bitmaps.insert(bm);
        if old >= 3 || n >= 3 {
            self.overflow_dirty.insert(b);
        }
        if n >= 3 {
            self.overflow.insert(b, n);
        } else {
            self.overflow.remove(&b);
        }
        self.codes[b as usize] = n.min(3) as u8;
        if old == 0 {
            self.nr_allocated += 1;
            self.allocated_per_bitmap[bm] += 1;
        } else if n == 0 {
            self.nr_allocated -= 1;
            self.allocated_per_bitmap[bm] -= 1;
        }
    }

    pub fn inc(&mut self, b: u64) -> Result<(), String> {
        if b >= self.nr_blocks {
            return Err(format!("increment of block {b} beyond the {} metadata blocks", self.nr_blocks));
        }
        let c = self.get(b);
        if c == 0 {
            return Err(format!("increment of free metadata block {b}"));
        }
        let n = c.checked_add(1).ok_or_else(|| format!("reference count of metadata block {b} overflows"))?;
        self.set(b, n);
        Ok(())
    }

    /// Drops one reference; returns the new count.
    pub fn dec(&mut self, b: u64) -> Result<u32, String> {
        if b >= self.nr_blocks {
            return Err(format!("decrement of block {b} beyond the {} metadata blocks", self.nr_blocks));
        }
        let c = self.get(b);
        if c == 0 {
            return Err(format!("decrement of free metadata block {b}"));
        }
        self.set(b, c - 1);
        Ok(c - 1)
    }

    /// Sets the count of a free block to 1 (format only: the superblock).
    pub fn claim(&mut self, b: u64) {
        assert_eq!(self.get(b), 0, "claiming an allocated block");
        self.set(b, 1);
    }

    fn usable(&self, b: u64) -> bool {
        self.codes[b as usize] == 0 && self.txn_old.get(&b).is_none_or(|&old| old == 0)
    }

    fn find_free(&self, begin: u64, end: u64) -> Option<u64> {
        let mut b = begin;
        while b < end {
            let bm = (b / ENTRIES_PER_BITMAP) as usize;
            let bm_end = ((bm as u64 + 1) * ENTRIES_PER_BITMAP).min(end);
            let bm_len = ((bm as u64 + 1) * ENTRIES_PER_BITMAP).min(self.nr_blocks) - bm as u64 * ENTRIES_PER_BITMAP;
            if u64::from(self.allocated_per_bitmap[bm]) < bm_len {
                let mut i = b;
                while i < bm_end {
                    match self.codes[i as usize..bm_end as usize].iter().position(|&c| c == 0) {
                        None => break,
                        Some(p) => {
                            let cand = i + p as u64;
                            if self.usable(cand) {
                                return Some(cand);
                            }
                            i = cand + 1;
                        }
                    }
                }
            }
            b = bm_end;
        }
        None
    }

    /// Allocates a block (count 0 -> 1) from the moving cursor; `None` when full.
    pub fn alloc(&mut self) -> Option<u64> {
        let b = self.find_free(self.cursor, self.nr_blocks).or_else(|| self.find_free(0, self.cursor))?;
        self.set(b, 1);
        self.cursor = b + 1;
        Some(b)
    }

    /// Grows the space map (new bitmaps are allocated at the next flush).
    pub fn extend(&mut self, new_nr_blocks: u64) {
        let new_nr_blocks = new_nr_blocks.min(MAX_METADATA_BLOCKS);
        if new_nr_blocks <= self.nr_blocks {
            return;
        }
        let old_nb = self.bitmap_blocks.len();
        self.nr_blocks = new_nr_blocks;
        self.codes.resize(new_nr_blocks as usize, 0);
        let nb = nr_bitmaps(new_nr_blocks) as usize;
        self.allocated_per_bitmap.resize(nb, 0);
        self.bitmap_blocks.resize(nb, 0);
        // The last old bitmap may have gained entries; rewrite it with the new ones.
        if old_nb > 0 {
            self.dirty_bitmaps.insert(old_nb - 1);
        }
        self.dirty_bitmaps.extend(old_nb..nb);
    }

    /// Codes of bitmap `bm` (up to 16320 entries; fewer for the last one).
    pub fn bitmap_codes(&self, bm: usize) -> &[u8] {
        let start = bm * ENTRIES_PER_BITMAP as usize;
        let end = (start + ENTRIES_PER_BITMAP as usize).min(self.nr_blocks as usize);
        &self.codes[start..end]
    }

    /// Index entry for bitmap `bm` with kernel nr_free semantics.
    pub fn index_entry(&self, bm: usize) -> IndexEntry {
        let codes = self.bitmap_codes(bm);
        let none_free_before = codes.iter().position(|&c| c == 0).unwrap_or(codes.len()) as u32;
        IndexEntry {
            blocknr: self.bitmap_blocks[bm],
            nr_free: ENTRIES_PER_BITMAP as u32 - self.allocated_per_bitmap[bm],
            none_free_before,
        }
    }

    /// Forgets the transaction bookkeeping after a successful commit.
    pub fn end_transaction(&mut self) {
        self.txn_old.clear();
        self.nr_freed_this_txn = 0;
        self.dirty_bitmaps.clear();
        self.overflow_dirty.clear();
    }

    /// Every block with a non-zero count (tests).
    #[cfg(test)]
    pub fn allocated_blocks(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.codes.iter().enumerate().filter(|(_, c)| **c != 0).map(|(b, _)| (b as u64, self.get(b as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_overflow_and_no_reuse_before_commit() {
        let mut sm = MetadataSm::new(100);
        sm.end_transaction();
        let a = sm.alloc().unwrap();
        assert_eq!(a, 0);
        for _ in 0..5 {
            sm.inc(a).unwrap();
        }
        assert_eq!(sm.get(a), 6);
        assert!(sm.overflow_dirty.contains(&a));
        let b = sm.alloc().unwrap();
        sm.end_transaction(); // "commit"
        assert_eq!(sm.dec(b).unwrap(), 0);
        // b was allocated at commit: not reusable in this transaction.
        let mut got = Vec::new();
        while let Some(x) = sm.alloc() {
            got.push(x);
        }
        assert!(!got.contains(&b));
        assert_eq!(got.len(), 98);
        sm.end_transaction();
        assert_eq!(sm.alloc(), Some(b));
        assert!(sm.dec(99).is_ok());
        assert!(sm.inc(100).is_err());
        let mut fresh = MetadataSm::new(10);
        assert!(fresh.dec(3).is_err());
    }

    #[test]
    fn nr_free_counts_only_what_alloc_can_hand_out() {
        let mut sm = MetadataSm::new(10);
        let blocks: Vec<u64> = std::iter::from_fn(|| sm.alloc()).take(6).collect();
        sm.end_transaction();
        // Freed in this transaction: not allocatable before commit, so not free.
        sm.dec(blocks[0]).unwrap();
        sm.dec(blocks[1]).unwrap();
        // Allocated and freed in this transaction: allocatable at once.
        let c = sm.alloc().unwrap();
        sm.dec(c).unwrap();
        assert_eq!(sm.nr_free(), 4);
        assert_eq!(sm.nr_freed_this_txn(), 2);
        let got = std::iter::from_fn(|| sm.alloc()).count() as u64;
        assert_eq!(got, 4, "nr_free promised what alloc delivers");
        assert_eq!(sm.nr_free(), 0);
        sm.end_transaction();
        assert_eq!(sm.nr_free(), 2, "freed blocks are free after commit");
    }

    #[test]
    fn block_allocated_and_freed_in_one_transaction_is_reusable() {
        let mut sm = MetadataSm::new(3);
        sm.end_transaction();
        let a = sm.alloc().unwrap();
        sm.dec(a).unwrap();
        let mut got: Vec<u64> = std::iter::from_fn(|| sm.alloc()).collect();
        got.sort();
        assert_eq!(got, vec![0, 1, 2]);
    }
}
