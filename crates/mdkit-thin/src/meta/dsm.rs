//! The data space map (kernel dm-space-map-disk): reference counts of data blocks in bitmap
//! blocks on the metadata device, indexed by a btree (key = bitmap index, value = 16-byte
//! index entry), with counts >= 3 in a ref-count btree (key = data block, value = u32).
//!
//! The index entries are small (16 bytes per 16320 data blocks: 1 MiB per ~1 PiB at 64 KiB
//! blocks) and are kept in memory; changed ones are written into the index btree at commit.
//! Bitmaps are shadowed through the transaction manager like any block, so they move on their
//! first change in a transaction. Data blocks freed in a transaction are not reused before it
//! commits: the last commit's mappings may still point at them after a crash.

use std::collections::BTreeSet;

use crate::meta::block::{BlockKind, BlockSet, get_u32};
use crate::meta::btree::{self, NoRc, ReadMode};
use crate::meta::error::{Corruption, MetaError, Result};
use crate::meta::sm_format::{
    ENTRIES_PER_BITMAP, INDEX_ENTRY_BYTES, IndexEntry, SmRoot, bitmap_find_free, bitmap_get, bitmap_set, nr_bitmaps,
};
use crate::meta::tm::Tm;

/// Largest data block number that fits the 40-bit block field of a mapping.
pub const MAX_DATA_BLOCKS: u64 = 1 << 40;

pub(crate) struct DataSm {
    nr_blocks: u64,
    nr_allocated: u64,
    index: Vec<IndexEntry>,
    index_dirty: BTreeSet<usize>,
    index_root: u64,
    ref_count_root: u64,
    cursor: u64,
    freed_this_txn: BlockSet,
}

impl DataSm {
    /// An empty space map of `nr_blocks` data blocks.
    pub fn create(tm: &mut Tm, nr_blocks: u64) -> Result<DataSm> {
        let index_root = btree::empty(tm, INDEX_ENTRY_BYTES)?;
        let ref_count_root = btree::empty(tm, 4)?;
        let mut sm = DataSm {
            nr_blocks: 0,
            nr_allocated: 0,
            index: Vec::new(),
            index_dirty: BTreeSet::new(),
            index_root,
            ref_count_root,
            cursor: 0,
            freed_this_txn: BlockSet::default(),
        };
        sm.extend(tm, nr_blocks)?;
        Ok(sm)
    }

    /// Opens the space map described by `root`.
    pub fn open(tm: &Tm, root: &SmRoot) -> Result<DataSm> {
        let nb = nr_bitmaps(root.nr_blocks);
        let mut index = Vec::new();
        let mut bad: Option<MetaError> = None;
        btree::walk_range(tm, root.bitmap_root, INDEX_ENTRY_BYTES, 0, u64::MAX, &mut |k, v| {
            let ie = IndexEntry::unpack(v);
            if k != index.len() as u64 || k >= nb {
                bad = Some(tm.corrupt(
                    root.bitmap_root,
                    Corruption::BadSpaceMap(format!(
                        "data space-map index has entry {k}, expected {} of {nb}",
                        index.len()
                    )),
                ));
                return Ok(false);
            }
            if ie.blocknr == 0 || ie.blocknr >= tm.msm.nr_blocks() {
                bad = Some(tm.corrupt(
                    ie.blocknr,
                    Corruption::BadSpaceMap(format!("data bitmap {k} at impossible block {}", ie.blocknr)),
                ));
                return Ok(false);
            }
            if let Some(why) = ie.impossible() {
                bad = Some(tm.corrupt(root.bitmap_root, Corruption::BadSpaceMap(format!("data bitmap {k}: {why}"))));
                return Ok(false);
            }
            index.push(ie);
            Ok(true)
        })?;
        if let Some(e) = bad {
            return Err(e);
        }
        if index.len() as u64 != nb {
            return Err(tm.corrupt(
                root.bitmap_root,
                Corruption::BadSpaceMap(format!("data space-map index has {} entries, expected {nb}", index.len())),
            ));
        }
        Ok(DataSm {
            nr_blocks: root.nr_blocks,
            nr_allocated: root.nr_allocated,
            index,
            index_dirty: BTreeSet::new(),
            index_root: root.bitmap_root,
            ref_count_root: root.ref_count_root,
            cursor: 0,
            freed_this_txn: BlockSet::default(),
        })
    }

    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    pub fn nr_allocated(&self) -> u64 {
        self.nr_allocated
    }

    pub fn nr_free(&self) -> u64 {
        self.nr_blocks.saturating_sub(self.nr_allocated)
    }

    /// Grows to `new_nr_blocks` (shrinking is refused).
    pub fn extend(&mut self, tm: &mut Tm, new_nr_blocks: u64) -> Result<()> {
        if new_nr_blocks < self.nr_blocks {
            return Err(MetaError::InvalidArgument(format!(
                "data space map cannot shrink from {} to {new_nr_blocks} blocks",
                self.nr_blocks
            )));
        }
        if new_nr_blocks > MAX_DATA_BLOCKS {
            return Err(MetaError::InvalidArgument(format!("{new_nr_blocks} data blocks exceed the 2^40 limit")));
        }
        let old_nb = self.index.len();
        let nb = nr_bitmaps(new_nr_blocks) as usize;
        for i in old_nb..nb {
            let b = tm.new_block(BlockKind::Bitmap)?;
            self.index.push(IndexEntry { blocknr: b, nr_free: ENTRIES_PER_BITMAP as u32, none_free_before: 0 });
            self.index_dirty.insert(i);
        }
        self.nr_blocks = new_nr_blocks;
        Ok(())
    }

    fn check_block(&self, tm: &Tm, b: u64) -> Result<()> {
        if b >= self.nr_blocks {
            return Err(MetaError::InvalidArgument(format!(
                "{}: data block {b} is beyond the {} data blocks",
                tm.name(),
                self.nr_blocks
            )));
        }
        Ok(())
    }

    /// Reference count of data block `b`.
    pub fn get(&self, tm: &Tm, b: u64) -> Result<u32> {
        self.check_block(tm, b)?;
        let ie = self.index[(b / ENTRIES_PER_BITMAP) as usize];
        let code = bitmap_get(&*tm.read(ie.blocknr, BlockKind::Bitmap)?, (b % ENTRIES_PER_BITMAP) as u32);
        if code < 3 {
            return Ok(u32::from(code));
        }
        match btree::lookup(tm, self.ref_count_root, b, 4, ReadMode::MayRead)? {
            Some(v) => Ok(get_u32(v.as_slice(), 0)),
            None => Err(tm.corrupt(
                self.ref_count_root,
                Corruption::BadSpaceMap(format!("data block {b} marked >= 3 but missing from the ref-count tree")),
            )),
        }
    }

    fn set(&mut self, tm: &mut Tm, b: u64, old: u32, n: u32) -> Result<()> {
        let bm = (b / ENTRIES_PER_BITMAP) as usize;
        let entry = (b % ENTRIES_PER_BITMAP) as u32;
        let ie = &mut self.index[bm];
        let (loc, _) = tm.shadow(ie.blocknr, BlockKind::Bitmap)?;
        if loc != ie.blocknr {
            ie.blocknr = loc;
            self.index_dirty.insert(bm);
        }
        bitmap_set(tm.get_mut(loc)?, entry, n.min(3) as u8);
        // Saturating: index hints and nr_allocated come from disk and may be off.
        if old == 0 && n > 0 {
            ie.nr_free = ie.nr_free.saturating_sub(1);
            if entry == ie.none_free_before {
                ie.none_free_before += 1;
            }
            self.nr_allocated = (self.nr_allocated + 1).min(self.nr_blocks);
            self.index_dirty.insert(bm);
        } else if old > 0 && n == 0 {
            ie.nr_free = (ie.nr_free + 1).min(ENTRIES_PER_BITMAP as u32);
            ie.none_free_before = ie.none_free_before.min(entry);
            self.nr_allocated = self.nr_allocated.saturating_sub(1);
            self.index_dirty.insert(bm);
            self.freed_this_txn.insert(b);
        }
        if n >= 3 {
            self.ref_count_root = btree::insert(tm, &mut NoRc, self.ref_count_root, b, &n.to_le_bytes())?.0;
        } else if old >= 3 {
            self.ref_count_root = btree::remove(tm, &mut NoRc, self.ref_count_root, b)?.0;
        }
        Ok(())
    }

    pub fn inc(&mut self, tm: &mut Tm, b: u64) -> Result<()> {
        let old = self.get(tm, b)?;
        if old == 0 {
            return Err(tm.corrupt(0, Corruption::BadSpaceMap(format!("reference added to free data block {b}"))));
        }
        let n = old
            .checked_add(1)
            .ok_or_else(|| tm.corrupt(0, Corruption::BadSpaceMap(format!("count of data block {b} overflows"))))?;
        self.set(tm, b, old, n)
    }

    /// Adds a reference to `b` whatever its count (restore, tests).
    pub fn inc_any(&mut self, tm: &mut Tm, b: u64) -> Result<()> {
        let old = self.get(tm, b)?;
        self.set(tm, b, old, old + 1)
    }

    /// Drops a reference; returns the new count.
    pub fn dec(&mut self, tm: &mut Tm, b: u64) -> Result<u32> {
        let old = self.get(tm, b)?;
        if old == 0 {
            return Err(tm.corrupt(0, Corruption::BadSpaceMap(format!("reference dropped from free data block {b}"))));
        }
        self.set(tm, b, old, old - 1)?;
        Ok(old - 1)
    }

    fn usable(&self, b: u64) -> bool {
        !self.freed_this_txn.contains(&b)
    }

    fn find_free(&self, tm: &Tm, begin: u64, end: u64) -> Result<Option<u64>> {
        let mut b = begin;
        while b < end {
            let bm = (b / ENTRIES_PER_BITMAP) as usize;
            let base = bm as u64 * ENTRIES_PER_BITMAP;
            let bm_end = (base + ENTRIES_PER_BITMAP).min(end);
            let ie = self.index[bm];
            if ie.nr_free > 0 {
                let from = ((b - base) as u32).max(ie.none_free_before);
                let blk = tm.read(ie.blocknr, BlockKind::Bitmap)?;
                if let Some(e) =
                    bitmap_find_free(&blk, from, (bm_end - base) as u32, |e| self.usable(base + u64::from(e)))
                {
                    return Ok(Some(base + u64::from(e)));
                }
            }
            b = bm_end;
        }
        Ok(None)
    }

    /// Allocates a free data block (count 0 -> 1) from the moving cursor.
    pub fn alloc(&mut self, tm: &mut Tm) -> Result<u64> {
        let found = match self.find_free(tm, self.cursor, self.nr_blocks)? {
            Some(b) => Some(b),
            None => self.find_free(tm, 0, self.cursor.min(self.nr_blocks))?,
        };
        let Some(b) = found else { return Err(MetaError::OutOfDataSpace { nr_blocks: self.nr_blocks }) };
        self.set(tm, b, 0, 1)?;
        self.cursor = b + 1;
        Ok(b)
    }

    /// True when at least one block can be allocated right now (cheap, conservative).
    pub fn may_have_free(&self) -> bool {
        self.nr_allocated < self.nr_blocks
    }

    /// Writes changed index entries into the index btree; returns the root for the superblock.
    pub fn flush(&mut self, tm: &mut Tm) -> Result<SmRoot> {
        let dirty: Vec<usize> = std::mem::take(&mut self.index_dirty).into_iter().collect();
        for bm in dirty {
            let v = self.index[bm].to_bytes();
            self.index_root = btree::insert(tm, &mut NoRc, self.index_root, bm as u64, &v)?.0;
        }
        Ok(self.root())
    }

    pub fn root(&self) -> SmRoot {
        SmRoot {
            nr_blocks: self.nr_blocks,
            nr_allocated: self.nr_allocated,
            bitmap_root: self.index_root,
            ref_count_root: self.ref_count_root,
        }
    }

    pub fn end_transaction(&mut self) {
        self.freed_this_txn.clear();
    }
}
