//! Entry points of the thin fuzz targets in `fuzz/` (and of the corpus replay test in
//! `tests/fuzz_corpus.rs`): the real metadata decoders, checker, engine and XML restore, fed
//! from a byte string. Each must return (errors are fine), never panic, hang or allocate from a
//! size the input chose.
//!
//! Built for speed (the campaign runs 10^7 inputs per target on two cores): the valid pool the
//! metadata target damages is formatted once per process, only its used blocks are copied per
//! input, and every device is RAM.

use std::sync::{Arc, OnceLock};

use crate::meta::block::{BLOCK_SIZE, BlockBuf, BlockKind, identify, seal, verify};
use crate::meta::sm_format::{ENTRIES_PER_BITMAP, bitmap_decode, index_block_decode};
use crate::meta::{
    CheckOptions, FormatOptions, MemMetaIo, MetaIo, NodeView, OpenOptions, Superblock, ThinMetadata, calc_max_entries,
    check, dump_xml, parse_xml, restore_xml, validate_node,
};

/// Metadata device of the damaged pool, in 4 KiB blocks: the pool uses 21, and the checker
/// compares every block's count with the space map twice per input.
const POOL_META_BLOCKS: u64 = 128;
/// Data blocks of the damaged pool: part of one space-map bitmap, since the checker compares
/// every data block's count (twice per input), which dominated at 20,000 blocks; 340 are
/// mapped, which leaves room for the input's provisions.
const POOL_DATA_BLOCKS: u64 = 512;
/// Mappings of the pool's first thin device: two leaves under an internal root (a leaf holds
/// at most 254); its snapshot rewrites the first leaf and shares the second. Every input walks
/// all mappings several times (checker, engine), so there are no more than that shape needs.
const POOL_DEV0_MAPPINGS: u64 = 300;
/// Clean-block cache of the engine under test: small, so eviction runs too.
const CACHE_BLOCKS: usize = 64;
/// Bytes of one edit in [`metadata`]'s input.
pub const EDIT_BYTES: usize = 5;

/// `thin_node`: one 4 KiB block through the btree node validator and reader, the superblock,
/// space-map bitmap and index decoders, block identification and sealing; a block that
/// validates must be fully readable with ordered keys, and a sealed block must verify. Half the inputs get
/// a plausible node header so the key and value checks are reached.
pub fn node(data: &[u8]) {
    let mut block = Box::new([0u8; BLOCK_SIZE]);
    let n = data.len().min(BLOCK_SIZE);
    block[..n].copy_from_slice(&data[..n]);
    if data.first().is_some_and(|b| b & 1 == 1) {
        let vs: u32 = [8, 24, 16, 4][usize::from(data.get(1).copied().unwrap_or(0) & 3)];
        let max = calc_max_entries(vs as usize);
        let nr = u32::from(data.get(2).copied().unwrap_or(0)) % (max + 1);
        block[4..8].copy_from_slice(&(1 + u32::from(data.get(3).copied().unwrap_or(0) & 1)).to_le_bytes());
        block[16..20].copy_from_slice(&nr.to_le_bytes());
        block[20..24].copy_from_slice(&max.to_le_bytes());
        block[24..28].copy_from_slice(&vs.to_le_bytes());
    }
    if validate_node(&block).is_ok() {
        let node = NodeView::new(&block);
        let mut prev = None;
        for i in 0..node.nr_entries() as usize {
            let k = node.key(i);
            assert!(prev.is_none_or(|p| p < k), "validated node with unordered keys");
            prev = Some(k);
            let _ = node.value(i);
        }
        let _ = node.lower_bound(u64::from_le_bytes(block[32..40].try_into().unwrap()));
    }
    let _ = Superblock::unpack(&block).validate();
    // A space-map bitmap of as many entries as the last input byte says (64 per unit, up to
    // the whole block): decoding all 16320 every time would dominate this target's cost.
    let entries = ((usize::from(data.last().copied().unwrap_or(0)) + 1) * 64).min(ENTRIES_PER_BITMAP as usize);
    let mut codes = vec![0u8; entries];
    bitmap_decode(&block, &mut codes);
    let _ = index_block_decode(&block, 255);
    let _ = identify(&block);
    seal(&mut block, BlockKind::Node, 7);
    assert!(verify(&block, BlockKind::Node, 7).is_ok());
}

/// The valid pool [`metadata`] damages: its non-zero blocks and what each one is.
struct Pool {
    blocks: Vec<(u64, Box<BlockBuf>, Option<BlockKind>)>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let mem = Arc::new(MemMetaIo::new("seed", POOL_META_BLOCKS));
        let io: Arc<dyn MetaIo> = mem.clone();
        let fo =
            FormatOptions { data_block_size_sectors: 128, nr_data_blocks: POOL_DATA_BLOCKS, metadata_nr_blocks: None };
        let mut md = ThinMetadata::format(io, fo).expect("the seed pool formats");
        md.create_thin(0).unwrap();
        for vb in 0..POOL_DEV0_MAPPINGS {
            md.provision(0, vb * 2).unwrap();
        }
        md.create_snap(1, 0).unwrap();
        for vb in 0..40 {
            md.provision(1, vb * 3).unwrap();
        }
        md.create_thin(2).unwrap();
        md.commit().unwrap();
        let blocks = (0..POOL_META_BLOCKS)
            .map(|b| (b, mem.peek(b)))
            .filter(|(_, blk)| blk.iter().any(|&x| x != 0))
            .map(|(b, blk)| {
                let kind = identify(&blk);
                (b, blk, kind)
            })
            .collect();
        Pool { blocks }
    })
}

/// `thin_metadata`: the whole metadata engine over damaged metadata. The input is a list of
/// [`EDIT_BYTES`]-byte edits (which used block, offset, new byte, re-seal) applied to a small
/// valid pool (3 devices, one a snapshot, 340 mappings); a re-sealed block gets a valid
/// checksum so the damage reaches the structural checks. Then: check, open, walk and look up
/// every device, provision/remove (as many as the input length mod 7), remove a range, take a
/// snapshot, delete a device, commit, and check again.
pub fn metadata(data: &[u8]) {
    let pool = pool();
    // Only edited blocks are copied here; `poke` copies every block once into the device.
    let mut edited: Vec<Option<(Box<BlockBuf>, bool)>> = vec![None; pool.blocks.len()];
    for edit in data.chunks_exact(EDIT_BYTES) {
        let i = usize::from(edit[0]) % pool.blocks.len();
        let at = usize::from(u16::from_le_bytes([edit[1], edit[2]])) % BLOCK_SIZE;
        let (blk, reseal) = edited[i].get_or_insert_with(|| (pool.blocks[i].1.clone(), false));
        blk[at] = edit[3];
        *reseal |= edit[4] & 1 == 1;
    }
    let mem = MemMetaIo::new("fuzz", POOL_META_BLOCKS);
    for ((b, original, kind), edit) in pool.blocks.iter().zip(edited.iter_mut()) {
        match edit {
            None => mem.poke(*b, original),
            Some((blk, reseal)) => {
                if let (true, Some(kind)) = (*reseal, kind) {
                    seal(blk, *kind, *b);
                }
                mem.poke(*b, blk);
            }
        }
    }
    let io: Arc<dyn MetaIo> = Arc::new(mem);
    let _ = check(&*io, &CheckOptions::default());
    let opts = OpenOptions { cache_blocks: CACHE_BLOCKS, ..OpenOptions::default() };
    let Ok(mut md) = ThinMetadata::open_with(io.clone(), opts) else { return };
    for dev in md.devices() {
        let _ = md.for_each_mapping(dev, 0, u64::MAX, &mut |_, _| true);
        let _ = md.lookup(dev, 10);
        let _ = md.lookup_cached(dev, 300);
    }
    let ops = data.len() % 7;
    for i in 0..ops as u64 {
        let _ = md.provision(i % 3, i * 5);
        let _ = md.remove(i % 3, i * 4);
    }
    let _ = md.remove_range(0, 100, 200);
    let _ = md.create_snap(5, 1);
    let _ = md.delete(2);
    if md.commit().is_ok() {
        let _ = check(&*io, &CheckOptions::default());
    }
}

/// `thin_xml`: the thin_dump XML parser on arbitrary text; small documents that parse are
/// restored (thin_restore) into a RAM metadata device, where errors are fine.
pub fn xml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(x) = parse_xml(text) else { return };
    let total: u64 = x.devices.iter().flat_map(|d| d.mappings.iter()).map(|m| m.length.min(1 << 20)).sum();
    if total > 10_000 || x.nr_data_blocks > 1 << 24 {
        return; // bounded work per input
    }
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("xml", 512));
    let _ = restore_xml(io, &x, OpenOptions { cache_blocks: CACHE_BLOCKS, ..OpenOptions::default() });
}

//------------------------------------------------------------------------------------------------
// Seeds (fuzz/corpus/thin_*): what mdkit's own encoders wrote.

/// `thin_node` seeds: every used block of the [`metadata`] pool (superblock, btree nodes,
/// space-map bitmaps and index), as the engine wrote it.
pub fn seed_nodes() -> Vec<Vec<u8>> {
    pool().blocks.iter().map(|(_, blk, _)| blk.to_vec()).collect()
}

/// `thin_metadata` seeds: the clean pool with one edit that rewrites the superblock's first
/// byte unchanged and re-seals it; one that changes a byte of the first node and re-seals it
/// (damage the checksum does not catch); one that changes the superblock without re-sealing.
pub fn seed_metadata_edits() -> Vec<Vec<u8>> {
    let pool = pool();
    let index_of = |kind: BlockKind| pool.blocks.iter().position(|(_, _, k)| *k == Some(kind)).unwrap_or(0) as u8;
    let (sb, node) = (index_of(BlockKind::Superblock), index_of(BlockKind::Node));
    let first = pool.blocks[usize::from(sb)].1[0];
    vec![vec![sb, 0, 0, first, 1], vec![node, 40, 0, 0x7f, 1], vec![sb, 32, 0, 0xff, 0]]
}

/// `thin_xml` seeds: thin_dump XML of a small pool (a thin device, a snapshot of it with its
/// own mappings, an empty device) and of an empty pool.
pub fn seed_xml() -> Vec<Vec<u8>> {
    let dump = |fill: bool| {
        let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("seed", 64));
        let fo = FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 256, metadata_nr_blocks: None };
        let mut md = ThinMetadata::format(io, fo).expect("the seed pool formats");
        if fill {
            md.create_thin(0).unwrap();
            for vb in [0, 1, 2, 3, 10, 11, 40] {
                md.provision(0, vb).unwrap();
            }
            md.create_snap(1, 0).unwrap();
            md.provision(1, 2).unwrap();
            md.create_thin(2).unwrap();
        }
        md.commit().unwrap();
        let mut out = Vec::new();
        dump_xml(&md, &mut out).expect("the seed pool dumps");
        out
    };
    vec![dump(true), dump(false)]
}
