//! md v1 superblock decoder: arbitrary 4 KiB blocks must never panic; anything that decodes
//! must re-encode to a block that decodes to the same superblock; examine rendering and the
//! geometry built from the fields must not panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdkit_md::format::examine::{self, Examine};
use mdkit_md::format::superblock::{self, MD_SB_MAGIC, SB_BLOCK_BYTES, Superblock, off};
use mdkit_md::layout::{self, Level};

fuzz_target!(|data: &[u8]| {
    // Half the inputs get a valid magic/version/max_dev so the deeper checks are reached.
    let mut block = [0u8; SB_BLOCK_BYTES];
    let n = data.len().min(SB_BLOCK_BYTES);
    block[..n].copy_from_slice(&data[..n]);
    if data.first().is_some_and(|b| b & 1 == 1) {
        block[0..4].copy_from_slice(&MD_SB_MAGIC.to_le_bytes());
        block[4..8].copy_from_slice(&1u32.to_le_bytes());
        let max_dev = u32::from_le_bytes(block[off::MAX_DEV..off::MAX_DEV + 4].try_into().unwrap())
            % (superblock::MAX_DEV_ROLES + 1);
        block[off::MAX_DEV..off::MAX_DEV + 4].copy_from_slice(&max_dev.to_le_bytes());
        if data.get(1).is_some_and(|b| b & 1 == 1) {
            let c = superblock::sb_checksum(&block, max_dev);
            block[off::SB_CSUM..off::SB_CSUM + 4].copy_from_slice(&c.to_le_bytes());
        }
    }
    let _ = Superblock::decode(data, 8);
    if let Ok(l) = Superblock::decode_lenient(&block) {
        let sb = &l.superblock;
        let ex = Examine { computed_checksum: Some(l.computed_checksum), ..Examine::new(sb, None, 1 << 30) };
        let _ = examine::render(&ex);
        let _ = examine::render_json_with(&ex);
        let _ = sb.check_fits_device(1 << 30);
        if let Some(level) = Level::from_md_level(sb.level) {
            let _ = layout::array_sectors(level, sb.raid_disks, sb.layout, sb.chunk_sectors, sb.size_sectors);
        }
        if let Ok(good) = Superblock::decode(&block, sb.super_offset_sectors) {
            let again = good.encode().expect("a decoded superblock re-encodes");
            assert_eq!(Superblock::decode(&again, good.super_offset_sectors).unwrap(), good);
        }
    }
});
