//! dm-thin btree node decoder: arbitrary 4 KiB blocks must never panic; a block that
//! validates must be fully readable, and sealing it must produce a block that verifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdkit_thin::meta::block::{BLOCK_SIZE, BlockKind, identify, seal, verify};
use mdkit_thin::meta::sm_format::{bitmap_decode, index_block_decode};
use mdkit_thin::meta::{NodeView, Superblock, validate_node};

fuzz_target!(|data: &[u8]| {
    let mut block = Box::new([0u8; BLOCK_SIZE]);
    let n = data.len().min(BLOCK_SIZE);
    block[..n].copy_from_slice(&data[..n]);
    // Half the inputs get a plausible header so the key/value checks are reached.
    if data.first().is_some_and(|b| b & 1 == 1) {
        let vs: u32 = [8, 24, 16, 4][usize::from(data.get(1).copied().unwrap_or(0) & 3)];
        let max = mdkit_thin::meta::calc_max_entries(vs as usize);
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
    let mut codes = vec![0u8; 16320];
    bitmap_decode(&block, &mut codes);
    let _ = index_block_decode(&block, 255);
    let _ = identify(&block);
    seal(&mut block, BlockKind::Node, 7);
    assert!(verify(&block, BlockKind::Node, 7).is_ok());
});
