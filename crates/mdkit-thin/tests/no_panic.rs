//! Random and mutated input never panics: block decoders, the XML parser, and the whole engine
//! (open, walk, look up, modify, commit, check) over metadata images with damaged blocks —
//! including damage re-sealed with a valid checksum, so it reaches the structural checks.

use std::sync::Arc;

use mdkit_io::Rng;
use mdkit_thin::meta::block::{BLOCK_SIZE, BlockBuf, identify, seal};
use mdkit_thin::meta::sm_format::{SmRoot, bitmap_decode, index_block_decode};
use mdkit_thin::meta::{
    CheckOptions, FormatOptions, MemMetaIo, MetaIo, NodeView, OpenOptions, Superblock, ThinMetadata, check, parse_xml,
    restore_xml, validate_node,
};
use proptest::prelude::*;

fn to_block(v: &[u8]) -> Box<BlockBuf> {
    let mut b = Box::new([0u8; BLOCK_SIZE]);
    let n = v.len().min(BLOCK_SIZE);
    b[..n].copy_from_slice(&v[..n]);
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn block_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), BLOCK_SIZE), small in 0u32..400) {
        let mut b = to_block(&bytes);
        // Bias towards plausible headers so decoding goes deeper.
        b[4..8].copy_from_slice(&(1 + small % 2).to_le_bytes());
        b[16..20].copy_from_slice(&small.to_le_bytes());
        b[20..24].copy_from_slice(&252u32.to_le_bytes());
        b[24..28].copy_from_slice(&8u32.to_le_bytes());
        for blk in [to_block(&bytes), b] {
            if validate_node(&blk).is_ok() {
                let n = NodeView::new(&blk);
                for i in 0..n.nr_entries() as usize {
                    let _ = (n.key(i), n.value(i));
                }
                let _ = n.lower_bound(small as u64);
            }
            let sb = Superblock::unpack(&blk);
            let _ = sb.validate();
            let _ = SmRoot::unpack(&blk[64..]);
            let mut codes = vec![0u8; 16320];
            bitmap_decode(&blk, &mut codes);
            let _ = index_block_decode(&blk, 255);
            let _ = identify(&blk);
        }
    }

    #[test]
    fn xml_parser_never_panics(s in "\\PC{0,300}") {
        let _ = parse_xml(&s);
    }

    #[test]
    fn mutated_xml_never_panics(pos in 0usize..400, byte in any::<u8>(), cut in 0usize..400) {
        let good = "<superblock uuid=\"\" time=\"1\" transaction=\"2\" flags=\"0\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"100\">\n  <device dev_id=\"0\" mapped_blocks=\"3\" transaction=\"0\" creation_time=\"0\" snap_time=\"1\">\n    <range_mapping origin_begin=\"0\" data_begin=\"10\" length=\"2\" time=\"0\"/>\n    <single_mapping origin_block=\"7\" data_block=\"9\" time=\"1\"/>\n  </device>\n</superblock>\n";
        let mut v = good.as_bytes().to_vec();
        let p = pos % v.len();
        v[p] = byte;
        v.truncate(cut.max(1).min(v.len()));
        if let Ok(s) = String::from_utf8(v)
            && let Ok(x) = parse_xml(&s) {
                let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::new("x", 256));
                let _ = restore_xml(io, &x, OpenOptions::default());
            }
    }
}

/// A small but non-trivial pool image (two-level trees, snapshots, shared blocks).
fn pool_image() -> Vec<u8> {
    let mem = Arc::new(MemMetaIo::new("good", 512));
    let io: Arc<dyn MetaIo> = mem.clone();
    let mut md = ThinMetadata::format(
        io,
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 40_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    for vb in 0..600 {
        md.provision(0, vb * 2).unwrap();
    }
    md.create_snap(1, 0).unwrap();
    for vb in 0..50 {
        md.provision(1, vb * 5).unwrap();
    }
    md.create_thin(2).unwrap();
    for _ in 0..3 {
        md.inc_data_block(3).unwrap();
    }
    md.commit().unwrap();
    mem.to_image()
}

/// Everything the engine can be asked to do with an image; errors are fine, panics are not.
fn exercise(image: &[u8], rng: &mut Rng) {
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::from_image("mutated", image));
    let _ = check(&*io, &CheckOptions::default());
    let Ok(mut md) = ThinMetadata::open(io.clone()) else { return };
    for dev in md.devices() {
        let _ = md.for_each_mapping(dev, 0, u64::MAX, &mut |_, _| true);
        let _ = md.highest_mapped(dev);
        for _ in 0..5 {
            let _ = md.lookup(dev, rng.below(1500));
            let _ = md.lookup_cached(dev, rng.below(1500));
        }
    }
    let _ = md.data_block_ref_count(rng.below(40_000));
    for _ in 0..20 {
        let dev = rng.below(4);
        let r = match rng.below(6) {
            0 => md.provision(dev, rng.below(1500)).map(|_| ()),
            1 => md.remove(dev, rng.below(1500)).map(|_| ()),
            2 => md.remove_range(dev, rng.below(1500), rng.below(1500)).map(|_| ()),
            3 => md.create_snap(rng.below(8), dev),
            4 => md.delete(dev),
            _ => md.commit(),
        };
        if r.is_err() && md.is_poisoned().is_some() {
            let _ = md.abort();
        }
    }
    let _ = md.commit();
    let _ = check(&*io, &CheckOptions::default());
}

#[test]
fn engine_never_panics_on_damaged_metadata() {
    let good = pool_image();
    let nr_blocks = good.len() / BLOCK_SIZE;
    let used: Vec<usize> =
        (0..nr_blocks).filter(|b| good[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE].iter().any(|&x| x != 0)).collect();
    let mut rng = Rng::new(std::env::var("MDKIT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0xbad_b10c));
    let rounds: u64 = std::env::var("MDKIT_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    for round in 0..rounds {
        let mut img = good.clone();
        for _ in 0..(1 + rng.below(3)) {
            let b = used[rng.below(used.len() as u64) as usize];
            let blk = &mut img[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
            let kind = identify(<&BlockBuf>::try_from(&*blk).expect("4096-byte block"));
            for _ in 0..(1 + rng.below(8)) {
                // Header fields, keys and values are where structure lives.
                let off = if rng.chance(1, 2) { rng.below(64) } else { rng.below(BLOCK_SIZE as u64) } as usize;
                blk[off] = match rng.below(4) {
                    0 => 0,
                    1 => 0xff,
                    2 => blk[off].wrapping_add(1),
                    _ => rng.next_u64() as u8,
                };
            }
            // Usually re-seal so the damage passes the checksum.
            if let Some(kind) = kind
                && rng.chance(3, 4)
            {
                seal((&mut *blk).try_into().unwrap(), kind, b as u64);
            }
        }
        exercise(&img, &mut rng);
        if round % 100 == 0 {
            eprintln!("round {round}");
        }
    }
}
