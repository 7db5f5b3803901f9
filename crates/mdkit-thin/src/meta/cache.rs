//! A bounded cache of clean, validated metadata blocks, shared by the writer and concurrent
//! readers. Sharded by block number, each shard a CLOCK ring behind a short mutex, so lookups
//! from many threads rarely contend and never wait for I/O.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::meta::block::{BlockBuf, BlockKind, BlockMap};

const SHARDS: usize = 16;

/// Default capacity: 8192 blocks = 32 MiB.
pub const DEFAULT_CACHE_BLOCKS: usize = 8192;

struct Slot {
    block: u64,
    kind: BlockKind,
    data: Arc<BlockBuf>,
    referenced: bool,
}

struct Shard {
    index: BlockMap<usize>,
    slots: Vec<Slot>,
    hand: usize,
    capacity: usize,
}

impl Shard {
    fn insert(&mut self, block: u64, kind: BlockKind, data: Arc<BlockBuf>) {
        if let Some(&i) = self.index.get(&block) {
            self.slots[i] = Slot { block, kind, data, referenced: true };
            return;
        }
        if self.slots.len() < self.capacity {
            self.index.insert(block, self.slots.len());
            self.slots.push(Slot { block, kind, data, referenced: false });
            return;
        }
        // CLOCK: sweep until an unreferenced slot; bounded by two turns of the ring.
        loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            if self.slots[i].referenced {
                self.slots[i].referenced = false;
                continue;
            }
            self.index.remove(&self.slots[i].block);
            self.index.insert(block, i);
            self.slots[i] = Slot { block, kind, data, referenced: false };
            return;
        }
    }

    fn remove(&mut self, block: u64) {
        let Some(i) = self.index.remove(&block) else { return };
        let last = self.slots.len() - 1;
        self.slots.swap_remove(i);
        if i != last {
            let moved = self.slots[i].block;
            self.index.insert(moved, i);
        }
        if self.hand >= self.slots.len() {
            self.hand = 0;
        }
    }
}

/// Shared block cache. Holds only blocks whose contents are on disk (or about to be, in the
/// same commit) and were checksum-verified or sealed.
pub struct BlockCache {
    shards: Vec<Mutex<Shard>>,
}

impl BlockCache {
    /// A cache of about `capacity_blocks` blocks (at least one per shard).
    pub fn new(capacity_blocks: usize) -> BlockCache {
        let per = capacity_blocks.div_ceil(SHARDS).max(1);
        BlockCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(Shard { index: BlockMap::default(), slots: Vec::new(), hand: 0, capacity: per }))
                .collect(),
        }
    }

    fn shard(&self, block: u64) -> &Mutex<Shard> {
        // Adjacent blocks land in different shards.
        &self.shards[(block as usize) % SHARDS]
    }

    pub fn get(&self, block: u64) -> Option<(BlockKind, Arc<BlockBuf>)> {
        let mut s = self.shard(block).lock();
        let i = *s.index.get(&block)?;
        let slot = &mut s.slots[i];
        slot.referenced = true;
        Some((slot.kind, slot.data.clone()))
    }

    pub fn insert(&self, block: u64, kind: BlockKind, data: Arc<BlockBuf>) {
        self.shard(block).lock().insert(block, kind, data);
    }

    pub fn remove(&self, block: u64) {
        self.shard(block).lock().remove(block);
    }

    pub fn clear(&self) {
        for s in &self.shards {
            let mut s = s.lock();
            s.index.clear();
            s.slots.clear();
            s.hand = 0;
        }
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().slots.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity_blocks(&self) -> usize {
        self.shards.iter().map(|s| s.lock().capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_evicts_unreferenced_first() {
        let c = BlockCache::new(SHARDS * 2);
        let blk = Arc::new([0u8; 4096]);
        // Shard 0 gets blocks 0, 16, 32.
        c.insert(0, BlockKind::Node, blk.clone());
        c.insert(16, BlockKind::Node, blk.clone());
        assert!(c.get(0).is_some()); // referenced
        c.insert(32, BlockKind::Node, blk.clone());
        assert!(c.get(0).is_some(), "referenced block survived");
        assert!(c.get(16).is_none(), "unreferenced block evicted");
        assert!(c.get(32).is_some());
        for b in 0..10_000u64 {
            c.insert(b, BlockKind::Bitmap, blk.clone());
        }
        assert!(c.len() <= c.capacity_blocks());
        c.remove(9_999);
        assert!(c.get(9_999).is_none());
        c.clear();
        assert!(c.is_empty());
    }
}
