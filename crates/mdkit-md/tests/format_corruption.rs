//! Bad input: every reason the kernel refuses a superblock or bitmap is refused by mdkit with a
//! message that names it; every single-bit flip in the checksummed part of a superblock is
//! caught; random and mutated superblocks, bitmaps, bad-block logs and layout parameters never
//! make the decoders, the examine renderer or the geometry constructors panic (the same
//! inputs the cargo-fuzz targets in /fuzz feed, run here in the normal suite).

use mdkit_md::format::badblocks;
use mdkit_md::format::bitmap::{BitmapError, BitmapSuper};
use mdkit_md::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};
use mdkit_md::format::examine::{self, Examine};
use mdkit_md::format::superblock::{
    self, MAX_SECTOR, ROLE_JOURNAL, Superblock, SuperblockError, feature, off, sb_checksum,
};
use mdkit_md::layout::{Level, ParityGeometry, Raid0Geometry, Raid0Layout, Raid10Geometry};
use proptest::prelude::*;

const MIB: u64 = 2048;

fn valid_sb() -> Superblock {
    let mut req = CreateRequest::new(Level::Raid5, vec![64 * MIB; 4], [0x42; 16], 1_790_000_000);
    req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
    req.sync = InitialSync::AssumeClean;
    plan(&req).unwrap().members[1].superblock.clone()
}

fn valid_bytes() -> [u8; 4096] {
    valid_sb().encode().unwrap()
}

/// Re-seals an image after editing raw bytes, so deeper checks than the checksum are reached.
fn reseal(b: &mut [u8; 4096]) {
    let max_dev =
        u32::from_le_bytes(b[off::MAX_DEV..off::MAX_DEV + 4].try_into().unwrap()).min(superblock::MAX_DEV_ROLES);
    let c = sb_checksum(b, max_dev);
    b[off::SB_CSUM..off::SB_CSUM + 4].copy_from_slice(&c.to_le_bytes());
}

fn refused(sb: &Superblock) -> SuperblockError {
    Superblock::decode(&sb.encode_unchecked(), sb.super_offset_sectors).unwrap_err()
}

#[test]
fn every_superblock_refusal_names_its_reason() {
    let good = valid_bytes();
    assert!(Superblock::decode(&good, 8).is_ok());
    let mut cases: Vec<(&str, SuperblockError, &str)> = Vec::new();

    cases.push(("short buffer", Superblock::decode(&good[..1024], 8).unwrap_err(), "need 4096"));
    let mut b = good;
    b[0] = 0;
    cases.push(("magic", Superblock::decode(&b, 8).unwrap_err(), "bad magic"));
    let mut b = good;
    b[off::MAJOR_VERSION] = 2;
    cases.push(("major", Superblock::decode(&b, 8).unwrap_err(), "major_version 2"));
    let mut b = good;
    b[off::MAX_DEV..off::MAX_DEV + 4].copy_from_slice(&1921u32.to_le_bytes());
    cases.push(("max_dev", Superblock::decode(&b, 8).unwrap_err(), "max_dev 1921"));
    cases.push(("super_offset", Superblock::decode(&good, 0).unwrap_err(), "super_offset 8"));
    let mut sb = valid_sb();
    sb.feature_map |= 0x2000;
    cases.push(("features", refused(&sb), "unknown feature bits 0x2000"));
    let mut b = good;
    b[off::DEV_ROLES + 7] ^= 0x10;
    cases.push(("checksum", Superblock::decode(&b, 8).unwrap_err(), "bad checksum"));
    let mut sb = valid_sb();
    sb.data_size_sectors = 9;
    cases.push(("data_size", refused(&sb), "data_size 9 sectors"));
    let mut b = good;
    b[off::PAD0] = 1;
    reseal(&mut b);
    cases.push(("pad0", Superblock::decode(&b, 8).unwrap_err(), "pad0"));
    let mut b = good;
    b[off::PAD3 + 31] = 1;
    reseal(&mut b);
    cases.push(("pad3", Superblock::decode(&b, 8).unwrap_err(), "pad3"));
    let mut sb = valid_sb();
    sb.data_offset_sectors = 8; // the superblock occupies sector 8 (512 bytes with 128 roles)
    cases.push(("data overlap", refused(&sb), "overlaps the superblock"));
    let mut sb = valid_sb();
    sb.feature_map |= feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
    sb.new_offset_sectors = -(sb.data_offset_sectors as i32) + 4;
    cases.push(("new data overlap", refused(&sb), "reshape new data offset"));
    let mut sb = valid_sb();
    sb.feature_map |= feature::BAD_BLOCKS;
    sb.bblog_size_sectors = 16;
    cases.push(("bblog size", refused(&sb), "exceeds one 4 KiB page"));
    let mut sb = valid_sb();
    sb.feature_map |= feature::BAD_BLOCKS;
    sb.bblog_offset_sectors = 0;
    cases.push(("bblog offset", refused(&sb), "bblog_offset is 0"));
    let mut sb = valid_sb();
    sb.feature_map |= feature::RAID0_LAYOUT;
    cases.push(("raid0 layout", refused(&sb), "only raid0"));
    let mut sb = valid_sb();
    sb.feature_map |= feature::PPL;
    cases.push(("ppl+bitmap", refused(&sb), "internal bitmap"));
    let mut sb = valid_sb();
    sb.feature_map = feature::PPL | feature::MULTIPLE_PPLS;
    cases.push(("ppl+multiple", refused(&sb), "MULTIPLE_PPLS"));
    let mut sb = valid_sb();
    sb.feature_map = feature::PPL | feature::JOURNAL;
    cases.push(("ppl+journal", refused(&sb), "write journal"));
    let mut sb = valid_sb();
    let d = sb.dev_number as usize;
    sb.dev_roles[d] = ROLE_JOURNAL;
    cases.push(("journal role", refused(&sb), "journal"));
    let sb = valid_sb();
    cases.push(("device size", sb.check_fits_device(64 * MIB - 1).unwrap_err(), "larger than the"));

    for (what, err, needle) in &cases {
        let msg = err.to_string();
        assert!(msg.contains(needle), "{what}: message {msg:?} does not name the reason ({needle:?})");
        eprintln!("{what:>16}: {msg}");
    }
    // Each case is a distinct refusal.
    let mut kinds: Vec<String> = cases.iter().map(|(_, e, _)| format!("{:?}", std::mem::discriminant(e))).collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(kinds.len(), 16, "distinct refusal kinds");
}

#[test]
fn every_bitmap_refusal_names_its_reason() {
    let good = BitmapSuper::new([0x42; 16], 64 << 20, 131_072);
    let enc = |b: &BitmapSuper| BitmapSuper::decode(&b.encode_unchecked()).unwrap_err();
    let mut cases: Vec<(BitmapError, &str)> = vec![(BitmapSuper::decode(&[0u8; 255]).unwrap_err(), "need 256")];
    let mut raw = good.encode().unwrap();
    raw[3] = 0;
    cases.push((BitmapSuper::decode(&raw).unwrap_err(), "bad bitmap magic"));
    for (version, needle) in [(2, "unrecognized"), (5, "clustered"), (6, "lockless"), (7, "unrecognized")] {
        let mut b = good.clone();
        b.version = version;
        cases.push((enc(&b), needle));
    }
    let mut b = good.clone();
    b.chunk_bytes = 256;
    cases.push((enc(&b), "below the minimum"));
    b.chunk_bytes = 65 << 20;
    cases.push((enc(&b), "not a power of 2"));
    let mut b = good.clone();
    b.daemon_sleep_secs = 0;
    cases.push((enc(&b), "daemon_sleep"));
    let mut b = good.clone();
    b.write_behind = 16_384;
    cases.push((enc(&b), "write_behind 16384"));
    cases.push((good.check_against_array(&[1; 16], 0).unwrap_err(), "does not match the array uuid"));
    for (err, needle) in cases {
        assert!(err.to_string().contains(needle), "{err} should name {needle:?}");
    }
    assert!(BitmapSuper::decode(&good.encode().unwrap()).is_ok());
}

#[test]
fn every_single_bit_flip_is_caught() {
    let good = valid_bytes();
    let covered = 256 + 2 * valid_sb().max_dev() as usize;
    for byte in 0..covered {
        for bit in 0..8 {
            let mut b = good;
            b[byte] ^= 1 << bit;
            assert!(Superblock::decode(&b, 8).is_err(), "flip of byte {byte} bit {bit} was accepted");
        }
    }
    // Outside the checksummed roles the kernel does not look: flips there are harmless.
    let mut b = good;
    b[covered] ^= 0xff;
    assert!(Superblock::decode(&b, 8).is_ok());
}

fn exercise_superblock(bytes: &[u8]) {
    // Nothing may panic; whatever decodes must re-encode to an image that decodes the same.
    if let Ok(l) = Superblock::decode_lenient(bytes) {
        let ex = Examine { computed_checksum: Some(l.computed_checksum), ..Examine::new(&l.superblock, None, 1 << 40) };
        let text = examine::render(&ex);
        assert!(text.contains("Checksum :"));
        let _ = examine::render_json_with(&ex);
        let _ = l.superblock.check_fits_device(u64::MAX);
        let _ = l.superblock.bitmap_sector();
        let _ = l.superblock.role();
        let sb = &l.superblock;
        if let Some(level) = Level::from_md_level(sb.level) {
            let _ = mdkit_md::layout::array_sectors(level, sb.raid_disks, sb.layout, sb.chunk_sectors, sb.size_sectors);
        }
    }
    if let Ok(sb) = Superblock::decode(
        bytes,
        u64::from_le_bytes(bytes[off::SUPER_OFFSET..off::SUPER_OFFSET + 8].try_into().unwrap()),
    ) {
        let again = sb.encode().expect("a decoded superblock re-encodes");
        assert_eq!(Superblock::decode(&again, sb.super_offset_sectors).unwrap(), sb);
    }
}

fn exercise_bitmap(bytes: &[u8]) {
    if let Ok(b) = BitmapSuper::decode_lenient(bytes) {
        let _ = examine::render_bitmap_text(&b, "fuzz", Some(bytes));
        let _ = examine::bitmap_json(&b, Some(bytes));
        if let Ok(g) = b.geometry() {
            let _ = (g.chunks(), g.area_bytes(), g.bit_location(g.chunks().saturating_sub(1)));
            let _ = mdkit_md::format::bitmap::test_bit(bytes, &g, u64::MAX);
            let _ = g.chunks_for_range(u64::MAX - 3, 10);
        }
        let _ = b.check_against_array(&[0; 16], u64::MAX);
    }
    if let Ok(b) = BitmapSuper::decode(bytes) {
        assert_eq!(BitmapSuper::decode(&b.encode().unwrap()).unwrap(), b);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn random_superblocks_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 4096), magic in any::<bool>()) {
        if magic {
            // Get past the first checks so the deeper paths are exercised too.
            bytes[0..4].copy_from_slice(&superblock::MD_SB_MAGIC.to_le_bytes());
            bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
            let max_dev = u32::from_le_bytes(bytes[off::MAX_DEV..off::MAX_DEV + 4].try_into().unwrap()) % 1921;
            bytes[off::MAX_DEV..off::MAX_DEV + 4].copy_from_slice(&max_dev.to_le_bytes());
        }
        exercise_superblock(&bytes);
    }

    #[test]
    fn mutated_superblocks_never_panic(edits in proptest::collection::vec((0usize..4096, any::<u8>()), 1..12), seal in any::<bool>()) {
        let mut b = valid_bytes();
        for (pos, val) in edits {
            b[pos] = val;
        }
        if seal {
            reseal(&mut b);
        }
        exercise_superblock(&b);
    }

    #[test]
    fn mutated_field_values_never_panic(field in 0usize..64, value in any::<u64>()) {
        // Overwrite one 4- or 8-byte field with an arbitrary value and re-seal.
        const FIELDS: [(usize, usize); 22] = [
            (off::FEATURE_MAP, 4), (off::LEVEL, 4), (off::LAYOUT, 4), (off::SIZE, 8), (off::CHUNKSIZE, 4),
            (off::RAID_DISKS, 4), (off::BITMAP_OFFSET, 4), (off::NEW_LEVEL, 4), (off::RESHAPE_POSITION, 8),
            (off::DELTA_DISKS, 4), (off::NEW_LAYOUT, 4), (off::NEW_CHUNK, 4), (off::NEW_OFFSET, 4),
            (off::DATA_OFFSET, 8), (off::DATA_SIZE, 8), (off::SUPER_OFFSET, 8), (off::DEV_NUMBER, 4),
            (off::BBLOG_OFFSET, 4), (off::UTIME, 8), (off::EVENTS, 8), (off::RESYNC_OFFSET, 8), (off::MAX_DEV, 4),
        ];
        let (pos, len) = FIELDS[field % FIELDS.len()];
        let mut b = valid_bytes();
        b[pos..pos + len].copy_from_slice(&value.to_le_bytes()[..len]);
        reseal(&mut b);
        exercise_superblock(&b);
    }

    #[test]
    fn random_bitmaps_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), magic in any::<bool>()) {
        let mut bytes = bytes;
        if magic && bytes.len() >= 8 {
            bytes[0..4].copy_from_slice(&mdkit_md::format::bitmap::BITMAP_MAGIC.to_le_bytes());
            bytes[4] = 4;
        }
        exercise_bitmap(&bytes);
    }

    #[test]
    fn random_badblock_logs_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4200), shift in any::<u8>()) {
        if let Ok(list) = badblocks::decode(&bytes, shift)
            && let Ok(page) = badblocks::encode(&list, shift) {
                prop_assert_eq!(badblocks::decode(&page, shift).unwrap(), list);
            }
    }

    #[test]
    fn random_geometries_never_panic(
        level in 0usize..6, n in 0u32..300, layout in any::<u32>(), chunk in any::<u32>(),
        size in any::<u64>(), sector in any::<u64>(), member in 0usize..300,
    ) {
        let level = [Level::Raid0, Level::Raid1, Level::Raid4, Level::Raid5, Level::Raid6, Level::Raid10][level];
        let _ = mdkit_md::layout::array_sectors(level, n, layout, chunk, size);
        if let Ok(g) = Raid10Geometry::new(n, layout, chunk, size) {
            if let Some(copies) = g.map(sector % g.array_sectors().max(1)) {
                prop_assert_eq!(copies.len(), g.copies());
            }
            let _ = g.unmap(member, sector);
        }
        if let Ok(g) = ParityGeometry::new(level, n, layout % 24, chunk) {
            let _ = g.array_sectors(size);
            let _ = g.map(sector);
            let _ = g.unmap(member, sector);
            let _ = g.stripe_map(sector);
        }
        let sizes: Vec<u64> = (0..(n % 9)).map(|i| size.rotate_left(i * 7) >> (i % 40)).collect();
        for lay in [None, Some(Raid0Layout::Original), Some(Raid0Layout::Alternate)] {
            if let Ok(g) = Raid0Geometry::new(&sizes, chunk, lay) {
                let _ = g.map(sector);
                let _ = g.unmap(member, sector);
            }
        }
    }

    #[test]
    fn random_create_requests_never_panic(
        level in 0usize..6, sizes in proptest::collection::vec(0u64..(1 << 34), 0..10), chunk in proptest::option::of(0u32..(1 << 20)),
        layout in proptest::option::of(any::<u32>()), bitmap in any::<bool>(), offset in proptest::option::of(any::<u64>()),
        raid in 0u32..12, size in proptest::option::of(0u64..(1 << 40)), v in 0u32..3,
    ) {
        let level = [Level::Raid0, Level::Raid1, Level::Raid4, Level::Raid5, Level::Raid6, Level::Raid10][level];
        let mut req = CreateRequest::new(level, sizes, [9; 16], 0);
        req.raid_devices = raid;
        req.chunk_kib = chunk;
        req.layout = layout;
        req.data_offset_sectors = offset;
        req.size_kib = size;
        req.metadata = mdkit_md::format::superblock::MetadataVersion::from_minor(v).unwrap();
        if bitmap {
            req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
        }
        if let Ok(p) = plan(&req) {
            // Whatever is planned is valid on its members.
            for (i, m) in p.members.iter().enumerate() {
                let decoded = Superblock::decode(&m.superblock_block, m.superblock.super_offset_sectors).unwrap();
                prop_assert_eq!(&decoded, &m.superblock);
                decoded.check_fits_device(req.member_sizes_sectors[i]).unwrap();
                prop_assert!(decoded.resync_offset_sectors == 0 || decoded.resync_offset_sectors == MAX_SECTOR);
            }
        }
    }
}
