//! Entry points of the md fuzz targets in `fuzz/` (and of the corpus replay test in
//! `tests/fuzz_corpus.rs`): the real superblock, bitmap and bad-block decoders, examine
//! rendering and multi-member assembly, fed from a byte string. Each must return (errors are
//! fine), never panic, hang or allocate from a size the input chose.
//!
//! Built for speed (the campaign runs 10^7 inputs per target on two cores): the arrays the
//! assembly target damages are created once per process, each input sees them through
//! copy-on-write members (`cow`), and one current-thread runtime per thread serves every input.

mod cow;

use std::sync::{Arc, OnceLock};

use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, MemDevice, WriteFlags};

use self::cow::CowDevice;
use crate::array::{AssembleOptions, CreateOptions, MemberDev, PartialStart, assemble_with, create};
use crate::format::badblocks;
use crate::format::bitmap::{self, BITMAP_MAGIC, BitmapSuper};
use crate::format::create::BitmapRequest;
use crate::format::examine::{self, Examine};
use crate::format::superblock::{self, MAX_DEV_ROLES, MD_SB_MAGIC, SB_BLOCK_BYTES, Superblock, off, sb_checksum};
use crate::layout::{self, Level};

/// `md_superblock`: arbitrary 4 KiB blocks through the v1 superblock decoder (strict and
/// lenient), examine rendering (text and JSON), the device-fit check and the array size from
/// the fields; anything that decodes must re-encode to the same superblock. Half the inputs
/// get a valid magic, version and max_dev (and half of those a valid checksum) so the field
/// checks are reached.
pub fn superblock(data: &[u8]) {
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
}

/// `md_bitmap`: the bitmap superblock decoder (strict and lenient), examine-bitmap rendering
/// over any area, the bit geometry built from the fields, and the bad-block log codec; what
/// decodes must round-trip. Inputs with an odd first byte get a valid magic and version.
pub fn bitmap(data: &[u8]) {
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
    if let Ok(list) = badblocks::decode(&data[..data.len().min(4096) & !7], shift)
        && let Ok(page) = badblocks::encode(&list, shift)
    {
        assert_eq!(badblocks::decode(&page, shift).unwrap(), list);
    }
}

//------------------------------------------------------------------------------------------------
// Assembly

/// Size of each template member (sparse: only metadata and the first data pages exist).
const MEMBER_BYTES: u64 = 4 << 20;
/// v1.2: the superblock's 4 KiB block starts 8 sectors into the member.
const SB_OFFSET_BYTES: usize = 4096;
/// Edits land in `[0, min(data offset, this))` of a member.
const EDIT_AREA_MAX_BYTES: usize = 64 << 10;
/// Bytes of one edit in [`assemble`]'s input.
pub const EDIT_BYTES: usize = 5;
/// The template arrays [`assemble`] picks from (its first byte, modulo the count).
pub const TEMPLATES: [(Level, u32); 6] =
    [(Level::Raid1, 2), (Level::Raid5, 3), (Level::Raid6, 4), (Level::Raid10, 5), (Level::Raid6, 6), (Level::Raid4, 3)];

/// One created array: its members' contents and the size of their metadata area.
struct Template {
    members: Vec<Arc<MemDevice>>,
    edit_area_bytes: usize,
}

fn runtime() -> &'static tokio::runtime::Runtime {
    thread_local! {
        static RT: &'static tokio::runtime::Runtime = Box::leak(Box::new(
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a current-thread runtime"),
        ));
    }
    RT.with(|rt| *rt)
}

fn make_template(level: Level, n: u32) -> Template {
    let members: Vec<Arc<MemDevice>> =
        (0..n).map(|i| Arc::new(MemDevice::new(format!("seed{i}"), MEMBER_BYTES))).collect();
    let devs: Vec<MemberDev> =
        members.iter().enumerate().map(|(i, m)| MemberDev::new(format!("seed{i}"), m.clone() as DeviceRef)).collect();
    let mut o = CreateOptions::new("fuzz", level, n);
    o.chunk_kib = if level.uses_chunks() { Some(64) } else { None };
    o.bitmap = BitmapRequest::Internal { chunk_bytes: Some(256 << 10) };
    o.assume_clean = true;
    o.uuid = Some([7; 16]);
    runtime().block_on(async {
        let a = create(devs, o).await.expect("the template array is created");
        a.array.write_slice(0, &[0x5a; 8192], WriteFlags::FUA).await.expect("template write");
        a.array.stop().await.expect("the template array stops");
    });
    let mut sb = [0u8; SB_BLOCK_BYTES];
    members[0].read_bytes(SB_OFFSET_BYTES as u64, &mut sb);
    let data_offset_sectors = u64::from_le_bytes(sb[off::DATA_OFFSET..off::DATA_OFFSET + 8].try_into().unwrap());
    let edit_area_bytes = usize::try_from(data_offset_sectors * 512).unwrap_or(usize::MAX).min(EDIT_AREA_MAX_BYTES);
    Template { members, edit_area_bytes }
}

fn templates() -> &'static Vec<Template> {
    static T: OnceLock<Vec<Template>> = OnceLock::new();
    T.get_or_init(|| TEMPLATES.iter().map(|&(level, n)| make_template(level, n)).collect())
}

/// Recomputes a member's superblock checksum after its edits (max_dev clamped for the sum).
fn reseal(dev: &CowDevice) {
    let mut block = [0u8; SB_BLOCK_BYTES];
    dev.read_bytes(SB_OFFSET_BYTES as u64, &mut block);
    let max_dev = u32::from_le_bytes(block[off::MAX_DEV..off::MAX_DEV + 4].try_into().unwrap());
    let c = sb_checksum(&block, max_dev.min(MAX_DEV_ROLES));
    dev.write_bytes((SB_OFFSET_BYTES + off::SB_CSUM) as u64, &c.to_le_bytes());
}

/// `md_assemble`: multi-member assembly over damaged metadata. Input: `[pick, order, flags,
/// edits...]`. `pick` chooses one of [`TEMPLATES`] (valid arrays with an internal write-intent
/// bitmap, created once); each [`EDIT_BYTES`]-byte edit (member, offset, byte, re-seal) changes
/// one byte of a member's metadata area (superblock and bitmap, everything before the data
/// offset), optionally re-sealing that member's superblock checksum so the edit reaches the
/// field checks; bit i of `order` leaves member i out and its top two bits rotate the member
/// list; `flags` bit 0 is `--force`, bit 1 `--run`. Assembly must return an error or a running
/// array, which then serves a read, a write and a flush and stops.
pub fn assemble(data: &[u8]) {
    let [pick, order, flags, edits @ ..] = data else { return };
    let t = &templates()[usize::from(*pick) % templates().len()];
    let n = t.members.len();
    let copies: Vec<Arc<CowDevice>> =
        t.members.iter().enumerate().map(|(i, m)| Arc::new(CowDevice::new(format!("m{i}"), m.clone()))).collect();
    let mut resealed = vec![false; n];
    for e in edits.chunks_exact(EDIT_BYTES) {
        let m = usize::from(e[0]) % n;
        let at = usize::from(u16::from_le_bytes([e[1], e[2]])) % t.edit_area_bytes;
        copies[m].write_bytes(at as u64, &[e[3]]);
        resealed[m] |= e[4] & 1 == 1;
    }
    for (m, r) in resealed.iter().enumerate() {
        if *r {
            reseal(&copies[m]);
        }
    }
    let mut devs: Vec<MemberDev> = (0..n)
        .filter(|i| order & (1 << i) == 0 || n <= 2)
        .map(|i| MemberDev::new(format!("m{i}"), copies[i].clone() as DeviceRef))
        .collect();
    if !devs.is_empty() {
        let by = usize::from(order >> 6) % devs.len();
        devs.rotate_left(by);
    }
    let opts = AssembleOptions { name: "fuzz".into(), force: flags & 1 == 1, uuid: None, start_frozen: true };
    let partial = if flags & 2 == 2 { PartialStart::Allowed } else { PartialStart::NeedsRun };
    runtime().block_on(async {
        let Ok(a) = assemble_with(devs, opts, partial).await else { return };
        let _ = a.array.read_vec(0, 8192).await;
        let _ = a.array.write_slice(4096, &[0xa5; 4096], WriteFlags::NONE).await;
        let _ = a.array.flush().await;
        let _ = a.array.stop().await;
    });
}

//------------------------------------------------------------------------------------------------
// Seeds (fuzz/corpus/md_superblock, fuzz/corpus/md_bitmap): what mdkit's own create wrote.

/// One superblock block per assembly template (member 0 of each, as `create` wrote it).
/// Last: the raid5 template's superblock in the middle of a 3 -> 4 member reshape (so the
/// fuzzer starts from valid RESHAPE_ACTIVE / NEW_OFFSET fields).
pub fn seed_superblocks() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> =
        templates().iter().map(|t| read_member(&t.members[0], SB_OFFSET_BYTES as u64, SB_BLOCK_BYTES)).collect();
    let mut sb = Superblock::decode(&seeds[1], (SB_OFFSET_BYTES / 512) as u64).expect("the raid5 template");
    sb.feature_map |= superblock::feature::RESHAPE_ACTIVE | superblock::feature::NEW_OFFSET;
    sb.raid_disks += 1;
    sb.delta_disks = 1;
    sb.new_level = sb.level;
    sb.new_layout = sb.layout;
    sb.new_chunk_sectors = sb.chunk_sectors;
    sb.new_offset_sectors = -(sb.chunk_sectors as i32);
    sb.reshape_position_sectors = u64::from(sb.chunk_sectors) * 3 * 2;
    seeds.push(sb.encode().expect("a valid reshape superblock").to_vec());
    seeds
}

/// The internal bitmap (superblock and first bits, 4 KiB) of every assembly template's member
/// 0, and one bad-block log page (first byte 0: shift 0, and not a bitmap).
pub fn seed_bitmaps() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> = templates()
        .iter()
        .map(|t| {
            let sb_bytes = read_member(&t.members[0], SB_OFFSET_BYTES as u64, SB_BLOCK_BYTES);
            let sb = Superblock::decode(&sb_bytes, (SB_OFFSET_BYTES / 512) as u64).expect("a template superblock");
            let at = sb.bitmap_sector().expect("templates have an internal bitmap") * 512;
            read_member(&t.members[0], at, 4096)
        })
        .collect();
    let bad =
        [(2048, 1), (4096, 8), (1 << 20, 64)].map(|(s, l)| badblocks::BadBlock { start_sector: s, len_sectors: l });
    seeds.push(badblocks::encode(&bad, 0).expect("a small log encodes").to_vec());
    seeds
}

fn read_member(dev: &MemDevice, offset_bytes: u64, len_bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; len_bytes];
    dev.read_bytes(offset_bytes, &mut v);
    v
}
