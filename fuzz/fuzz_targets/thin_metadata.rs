//! The whole dm-thin metadata engine over damaged metadata: the input is a list of byte edits
//! applied to a small valid pool image (each edited block optionally re-sealed with a valid
//! checksum so the damage reaches the structural checks). Opening, walking, looking up,
//! modifying, committing and checking must return errors, never panic.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use mdkit_thin::meta::block::{BLOCK_SIZE, BlockBuf, identify, seal};
use mdkit_thin::meta::{CheckOptions, FormatOptions, MemMetaIo, MetaIo, ThinMetadata, check};

fn good_image() -> &'static Vec<u8> {
    static IMG: OnceLock<Vec<u8>> = OnceLock::new();
    IMG.get_or_init(|| {
        let mem = Arc::new(MemMetaIo::new("seed", 256));
        let io: Arc<dyn MetaIo> = mem.clone();
        let mut md = ThinMetadata::format(
            io,
            FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 20_000, metadata_nr_blocks: None },
        )
        .unwrap();
        md.create_thin(0).unwrap();
        for vb in 0..400 {
            md.provision(0, vb * 2).unwrap();
        }
        md.create_snap(1, 0).unwrap();
        for vb in 0..40 {
            md.provision(1, vb * 3).unwrap();
        }
        md.create_thin(2).unwrap();
        md.commit().unwrap();
        mem.to_image()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut img = good_image().clone();
    let nr_blocks = img.len() / BLOCK_SIZE;
    let used: Vec<usize> =
        (0..nr_blocks).filter(|b| img[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE].iter().any(|&x| x != 0)).collect();
    let mut touched = Vec::new();
    for edit in data.chunks_exact(5) {
        let b = used[usize::from(edit[0]) % used.len()];
        let off = usize::from(u16::from_le_bytes([edit[1], edit[2]])) % BLOCK_SIZE;
        img[b * BLOCK_SIZE + off] = edit[3];
        if edit[4] & 1 == 1 {
            touched.push(b);
        }
    }
    for b in touched {
        let blk: &mut BlockBuf = (&mut img[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE]).try_into().unwrap();
        if let Some(kind) = identify(&good_image()[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE].try_into().unwrap()) {
            seal(blk, kind, b as u64);
        }
    }
    let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::from_image("fuzz", &img));
    let _ = check(&*io, &CheckOptions::default());
    let Ok(mut md) = ThinMetadata::open(io.clone()) else { return };
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
});
