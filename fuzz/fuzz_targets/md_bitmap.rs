//! md bitmap superblock decoder and bit geometry: arbitrary bytes must never panic; anything
//! that decodes must round-trip; the examine-bitmap renderer must cope with any area.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdkit_md::format::bitmap::{self, BITMAP_MAGIC, BitmapSuper};
use mdkit_md::format::{badblocks, examine};

fuzz_target!(|data: &[u8]| {
    let mut area = data.to_vec();
    if area.len() >= 8 && area[0] & 1 == 1 {
        area[0..4].copy_from_slice(&BITMAP_MAGIC.to_le_bytes());
        area[4..8].copy_from_slice(&4u32.to_le_bytes());
    }
    if let Ok(b) = BitmapSuper::decode_lenient(&area) {
        let _ = examine::render_bitmap_text(&b, "fuzz", Some(&area));
        let _ = examine::bitmap_json(&b, Some(&area));
        if let Ok(g) = b.geometry() {
            let last = g.chunks().saturating_sub(1);
            let _ =
                (g.area_bytes(), g.bit_location(last), g.chunk_range(last), g.chunks_for_range(u64::MAX / 2, u64::MAX));
            let _ = bitmap::test_bit(&area, &g, last);
            let mut copy = area.clone();
            let _ = bitmap::set_bit(&mut copy, &g, last, true);
            let _ = bitmap::count_dirty(
                &area[..area.len().min(4096)],
                &bitmap::BitmapGeometry::new(g.chunk_bytes, g.sync_size_sectors.min(1 << 20)).unwrap(),
            );
        }
    }
    if let Ok(b) = BitmapSuper::decode(&area) {
        assert_eq!(BitmapSuper::decode(&b.encode().unwrap()).unwrap(), b);
    }
    let shift = data.first().copied().unwrap_or(0);
    if let Ok(list) = badblocks::decode(&data[..data.len().min(4096) & !7], shift) {
        if let Ok(page) = badblocks::encode(&list, shift) {
            assert_eq!(badblocks::decode(&page, shift).unwrap(), list);
        }
    }
});
