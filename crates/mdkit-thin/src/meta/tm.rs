//! Transaction manager: copy-on-write shadowing with reference counts, the dirty-block set of
//! the open transaction, and the commit protocol.
//!
//! A block is *new* when it was allocated in the open transaction: it is not referenced by the
//! last commit, so it may be modified in place. Any other block is immutable; changing it means
//! shadowing it: allocate a new block, copy, drop one reference to the original. If the
//! original was shared (count > 1) the copy's children gain a reference each (the caller does
//! that, because only it knows what the values are).
//!
//! Commit: write every dirty block (each sealed: location + checksum, verified, nodes
//! structurally validated) -> flush -> write the superblock -> flush.

use std::sync::Arc;

use crate::meta::block::{BlockBuf, BlockKind, BlockMap, seal, verify, zeroed_block};
use crate::meta::btree::{self, NoRc};
use crate::meta::cache::BlockCache;
use crate::meta::error::{BlockPath, Corruption, MetaError, Result};
use crate::meta::io::MetaIo;
use crate::meta::msm::MetadataSm;
use crate::meta::sm_format::{SmRoot, bitmap_encode, index_block_encode};

/// Dirty blocks kept in memory before the open transaction writes some of them out early
/// (they are new blocks, invisible to the last commit, so that is safe).
pub const DEFAULT_WRITEBACK_THRESHOLD_BLOCKS: usize = 16384;

/// A borrowed or shared view of a block's contents.
pub(crate) enum BlockRef<'a> {
    Dirty(&'a BlockBuf),
    Clean(Arc<BlockBuf>),
}

impl std::ops::Deref for BlockRef<'_> {
    type Target = BlockBuf;
    fn deref(&self) -> &BlockBuf {
        match self {
            BlockRef::Dirty(b) => b,
            BlockRef::Clean(b) => b,
        }
    }
}

pub(crate) struct Tm {
    io: Arc<dyn MetaIo>,
    cache: Arc<BlockCache>,
    /// Contents of new blocks not yet written (or modified since written).
    dirty: BlockMap<Box<BlockBuf>>,
    /// Blocks allocated in the open transaction, with their type.
    new_this_txn: BlockMap<BlockKind>,
    pub msm: MetadataSm,
    writeback_threshold_blocks: usize,
}

impl Tm {
    pub fn new(io: Arc<dyn MetaIo>, cache: Arc<BlockCache>, msm: MetadataSm) -> Tm {
        Tm {
            io,
            cache,
            dirty: BlockMap::default(),
            new_this_txn: BlockMap::default(),
            msm,
            writeback_threshold_blocks: DEFAULT_WRITEBACK_THRESHOLD_BLOCKS,
        }
    }

    pub fn set_writeback_threshold(&mut self, blocks: usize) {
        self.writeback_threshold_blocks = blocks.max(16);
    }

    pub fn cache(&self) -> &Arc<BlockCache> {
        &self.cache
    }

    pub fn name(&self) -> &str {
        self.io.name()
    }

    pub fn corrupt(&self, block: u64, reason: Corruption) -> MetaError {
        MetaError::Corrupt { device: self.io.name().to_string(), block, path: BlockPath::default(), reason }
    }

    pub fn io_error(&self, op: &'static str, block: u64, source: std::io::Error) -> MetaError {
        MetaError::Io { device: self.io.name().to_string(), op, block, source }
    }

    pub fn nr_blocks(&self) -> u64 {
        self.msm.nr_blocks()
    }

    fn check_in_range(&self, b: u64) -> Result<()> {
        if b >= self.msm.nr_blocks() {
            return Err(self.corrupt(b, Corruption::BeyondDevice { target: b, nr_blocks: self.msm.nr_blocks() }));
        }
        Ok(())
    }

    //--------------------------------------------------------------------------------------------
    // Reading

    /// Reads a block of the given type, verified. Never returns stale data for new blocks.
    pub fn read(&self, b: u64, kind: BlockKind) -> Result<BlockRef<'_>> {
        match self.read_cached(b, kind)? {
            Some(r) => Ok(r),
            None => Ok(BlockRef::Clean(self.load(b, kind)?)),
        }
    }

    /// Like `read`, but `None` instead of touching the device.
    pub fn read_cached(&self, b: u64, kind: BlockKind) -> Result<Option<BlockRef<'_>>> {
        self.check_in_range(b)?;
        if let Some(data) = self.dirty.get(&b) {
            let have = self.new_this_txn.get(&b).copied();
            if have != Some(kind) {
                return Err(self.corrupt(
                    b,
                    Corruption::ReferencedTwice(format!(
                        "block is a new {} in this transaction but is referenced as a {kind}",
                        have.map_or("?", |k| k.name())
                    )),
                ));
            }
            return Ok(Some(BlockRef::Dirty(data)));
        }
        if let Some((have, data)) = self.cache.get(b) {
            if have == kind {
                return Ok(Some(BlockRef::Clean(data)));
            }
            // Validated as another type: this reference is wrong; report why.
            verify(&data, kind, b).map_err(|c| self.corrupt(b, c))?;
            return Err(
                self.corrupt(b, Corruption::ReferencedTwice(format!("block is a {have}, referenced as a {kind}")))
            );
        }
        Ok(None)
    }

    fn load(&self, b: u64, kind: BlockKind) -> Result<Arc<BlockBuf>> {
        let mut buf = zeroed_block();
        self.io.read_block(b, &mut buf).map_err(|e| self.io_error("read", b, e))?;
        verify(&buf, kind, b).map_err(|c| self.corrupt(b, c))?;
        if kind == BlockKind::Node {
            btree::validate_node(&buf).map_err(|c| self.corrupt(b, c))?;
        }
        let data: Arc<BlockBuf> = Arc::from(buf);
        self.cache.insert(b, kind, data.clone());
        Ok(data)
    }

    //--------------------------------------------------------------------------------------------
    // Reference counts and allocation

    pub fn is_new(&self, b: u64) -> bool {
        self.new_this_txn.contains_key(&b)
    }

    pub fn ref_count(&self, b: u64) -> u32 {
        self.msm.get(b)
    }

    pub fn inc(&mut self, b: u64) -> Result<()> {
        self.msm.inc(b).map_err(|m| self.corrupt(b, Corruption::BadSpaceMap(m)))
    }

    pub fn dec(&mut self, b: u64) -> Result<()> {
        let left = self.msm.dec(b).map_err(|m| self.corrupt(b, Corruption::BadSpaceMap(m)))?;
        if left == 0 {
            self.new_this_txn.remove(&b);
            self.dirty.remove(&b);
            self.cache.remove(b);
        }
        Ok(())
    }

    fn out_of_space(&self) -> MetaError {
        MetaError::OutOfMetadataSpace {
            free_blocks: self.msm.nr_free(),
            total_blocks: self.msm.nr_blocks(),
            reserve_blocks: 0,
        }
    }

    /// A new zero-filled block of `kind` with count 1.
    pub fn new_block(&mut self, kind: BlockKind) -> Result<u64> {
        let b = self.msm.alloc().ok_or_else(|| self.out_of_space())?;
        self.new_this_txn.insert(b, kind);
        self.dirty.insert(b, zeroed_block());
        self.cache.remove(b);
        Ok(b)
    }

    /// Returns a writable location holding `b`'s contents, and whether `b` was shared (then
    /// the caller must add a reference to everything the copy points to).
    pub fn shadow(&mut self, b: u64, kind: BlockKind) -> Result<(u64, bool)> {
        let count = self.msm.get(b);
        if let Some(&have) = self.new_this_txn.get(&b) {
            if have != kind {
                return Err(self
                    .corrupt(b, Corruption::ReferencedTwice(format!("block is a new {have}, shadowed as a {kind}"))));
            }
            // New in this transaction and referenced once: writable in place. A new block
            // that has been shared since (a snapshot taken in this transaction) is copied.
            if count == 1 {
                return Ok((b, false));
            }
        }
        if count == 0 {
            self.check_in_range(b)?;
            return Err(self.corrupt(b, Corruption::BadSpaceMap(format!("{kind} in use but its reference count is 0"))));
        }
        let copy: Box<BlockBuf> = Box::new(*self.read(b, kind)?);
        let n = self.msm.alloc().ok_or_else(|| self.out_of_space())?;
        self.new_this_txn.insert(n, kind);
        self.dirty.insert(n, copy);
        self.cache.remove(n);
        self.dec(b)?;
        Ok((n, count > 1))
    }

    /// Mutable contents of a new block.
    pub fn get_mut(&mut self, b: u64) -> Result<&mut BlockBuf> {
        let Some(&kind) = self.new_this_txn.get(&b) else {
            return Err(self.corrupt(b, Corruption::BadSpaceMap("write to a block that was not shadowed".into())));
        };
        if !self.dirty.contains_key(&b) {
            // Written back early; bring it back.
            let data = match self.cache.get(b) {
                Some((k, d)) if k == kind => d,
                _ => self.load(b, kind)?,
            };
            self.dirty.insert(b, Box::new(*data));
        }
        Ok(self.dirty.get_mut(&b).expect("inserted above").as_mut())
    }

    //--------------------------------------------------------------------------------------------
    // Writing

    /// Seals and validates a dirty block for writing; refuses to write an invalid node.
    fn prepare_for_write(&mut self, b: u64) -> Result<()> {
        let kind = *self.new_this_txn.get(&b).expect("dirty blocks are new");
        let name = self.io.name().to_string();
        let buf = self.dirty.get_mut(&b).expect("caller iterates dirty");
        if kind == BlockKind::Node {
            btree::validate_node(buf).map_err(|reason| MetaError::Corrupt {
                device: name.clone(),
                block: b,
                path: BlockPath::default(),
                reason,
            })?;
        }
        seal(buf, kind, b);
        verify(buf, kind, b).map_err(|reason| MetaError::Corrupt {
            device: name,
            block: b,
            path: BlockPath::default(),
            reason,
        })
    }

    fn write_dirty(&mut self) -> Result<Vec<u64>> {
        let mut blocks: Vec<u64> = self.dirty.keys().copied().collect();
        blocks.sort_unstable();
        for &b in &blocks {
            debug_assert!(self.msm.get(b) > 0, "dirty block {b} is free");
            self.prepare_for_write(b)?;
        }
        let refs: Vec<(u64, &BlockBuf)> = blocks.iter().map(|b| (*b, &*self.dirty[b])).collect();
        let first = blocks.first().copied().unwrap_or(0);
        self.io.write_blocks(&refs).map_err(|e| self.io_error("write", first, e))?;
        Ok(blocks)
    }

    fn move_dirty_to_cache(&mut self, blocks: &[u64]) {
        for b in blocks {
            if let Some(data) = self.dirty.remove(b) {
                let kind = self.new_this_txn[b];
                self.cache.insert(*b, kind, Arc::from(data));
            }
        }
    }

    /// Writes out all dirty blocks early when there are too many (no flush, no superblock).
    pub fn writeback_if_needed(&mut self) -> Result<()> {
        if self.dirty.len() <= self.writeback_threshold_blocks {
            return Ok(());
        }
        let written = self.write_dirty()?;
        self.move_dirty_to_cache(&written);
        Ok(())
    }

    /// Writes the metadata space map's own structures and returns its root (module docs of
    /// `msm` describe the fixed point).
    pub fn flush_metadata_sm(&mut self) -> Result<SmRoot> {
        // 1. Counts >= 3 into the ref-count tree.
        let mut steps = 0usize;
        while let Some(b) = self.msm.overflow_dirty.pop_first() {
            steps += 1;
            if steps > 1 + 4 * self.msm.nr_blocks() as usize {
                return Err(
                    self.corrupt(b, Corruption::BadSpaceMap("metadata ref-count tree flush does not converge".into()))
                );
            }
            let count = self.msm.get(b);
            let root = self.msm.ref_count_root;
            let new_root = if count >= 3 {
                btree::insert(self, &mut NoRc, root, b, &count.to_le_bytes())?.0
            } else {
                btree::remove(self, &mut NoRc, root, b)?.0
            };
            self.msm.ref_count_root = new_root;
        }
        // 2. The index block moves every transaction.
        let old_index = self.msm.index_block;
        if old_index == 0 || !self.is_new(old_index) {
            let n = self.new_block(BlockKind::Index)?;
            self.msm.index_block = n;
            if old_index != 0 {
                self.dec(old_index)?;
            }
        }
        // 3. Every changed bitmap moves once; moving changes counts -> repeat to a fixed point.
        // Each round moves at least one bitmap that is not new yet, and a moved bitmap stays
        // new: its old block is counted in use (checked at open), so the new block is another
        // one, never freed again. A bound all the same, so damage can never make this spin.
        let mut rounds = 0usize;
        loop {
            let todo: Vec<usize> = self
                .msm
                .dirty_bitmaps
                .iter()
                .copied()
                .filter(|&bm| {
                    let loc = self.msm.bitmap_blocks[bm];
                    loc == 0 || !self.is_new(loc)
                })
                .collect();
            if todo.is_empty() {
                break;
            }
            rounds += 1;
            if rounds > self.msm.bitmap_blocks.len() + 1 {
                let b = self.msm.bitmap_blocks[todo[0]];
                return Err(self.corrupt(b, Corruption::BadSpaceMap("metadata bitmap moves do not converge".into())));
            }
            for bm in todo {
                let n = self.new_block(BlockKind::Bitmap)?;
                let old = std::mem::replace(&mut self.msm.bitmap_blocks[bm], n);
                if old != 0 {
                    self.dec(old)?;
                }
            }
        }
        if let Some(&b) = self.msm.overflow_dirty.first() {
            // Only possible if a space-map block was also referenced elsewhere (corruption).
            return Err(self
                .corrupt(b, Corruption::BadSpaceMap("moving space-map blocks changed a shared block's count".into())));
        }
        // 4. Encode from the final counts.
        let dirty: Vec<usize> = self.msm.dirty_bitmaps.iter().copied().collect();
        for bm in dirty {
            let loc = self.msm.bitmap_blocks[bm];
            let codes = self.msm.bitmap_codes(bm).to_vec();
            let buf = self.get_mut(loc)?;
            bitmap_encode(&codes, buf);
        }
        let entries: Vec<_> = (0..self.msm.bitmap_blocks.len()).map(|bm| self.msm.index_entry(bm)).collect();
        let index_loc = self.msm.index_block;
        index_block_encode(&entries, self.get_mut(index_loc)?);
        Ok(SmRoot {
            nr_blocks: self.msm.nr_blocks(),
            nr_allocated: self.msm.nr_allocated(),
            bitmap_root: self.msm.index_block,
            ref_count_root: self.msm.ref_count_root,
        })
    }

    /// The commit protocol: dirty blocks, flush, superblock (block 0), flush.
    pub fn commit(&mut self, superblock: &mut BlockBuf) -> Result<()> {
        let written = self.write_dirty()?;
        self.io.flush().map_err(|e| self.io_error("flush", 0, e))?;
        seal(superblock, BlockKind::Superblock, 0);
        verify(superblock, BlockKind::Superblock, 0).map_err(|c| self.corrupt(0, c))?;
        self.io.write_blocks(&[(0, superblock)]).map_err(|e| self.io_error("write", 0, e))?;
        self.io.flush().map_err(|e| self.io_error("flush", 0, e))?;
        self.move_dirty_to_cache(&written);
        // Early-written blocks are already in the cache.
        self.new_this_txn.clear();
        self.msm.end_transaction();
        self.cache.insert(0, BlockKind::Superblock, Arc::new(*superblock));
        Ok(())
    }

    /// Drops cached copies of blocks written in the open transaction (before re-reading the
    /// last commit on abort).
    pub fn forget_transaction(&mut self) {
        for b in self.new_this_txn.keys() {
            self.cache.remove(*b);
        }
        self.cache.remove(0);
        self.dirty.clear();
        self.new_this_txn.clear();
    }

    pub fn nr_dirty(&self) -> usize {
        self.dirty.len()
    }

    pub fn nr_new(&self) -> usize {
        self.new_this_txn.len()
    }
}
