//! Opening a pool never formats it, and damaged metadata never gets written to.
//!
//! - A pool whose superblock was zeroed is refused by every mode that is not an explicit
//!   overwrite (`Open`, `OpenOrCreate`, `Create`), with an error naming the device, block 0 and
//!   the way back (thin_restore); nothing is written to either device.
//! - A blank device is formatted only when asked (`Create`, `OpenOrCreate`); `Open` refuses it.
//! - `Create` refuses a device holding a pool or anything else; `Overwrite` (`--force`) formats.
//! - A corruption matrix: superblock fields, btree node headers, space-map index and bitmap
//!   blocks (all re-sealed with valid checksums, so the structural checks are what catches
//!   them), and a truncated metadata device. Each open fails with an error naming a block, does
//!   not panic, and leaves both devices byte for byte as they were — with the default options,
//!   with `check_on_open = false`, and read-only.

use crate::pool_util;

use std::sync::Arc;

use mdkit_io::{DeviceRef, IoOp, MemDevice, Tracer};
use mdkit_thin::meta::Superblock;
use mdkit_thin::meta::block::{BLOCK_SIZE, BlockBuf, BlockKind, get_u64, put_u32, put_u64, seal};
use mdkit_thin::pool::{DeviceContents, ModeCause, OpenMode, Pool, PoolErrorKind, PoolMode, PoolOptions};
use pool_util::*;

const DATA_BLOCKS: u64 = 512;
const VOL_BLOCKS: u64 = 300;

/// A pool with a volume big enough for a two-level mapping tree, and a small one.
async fn make_pool() -> (Vec<u8>, Arc<MemDevice>) {
    let meta = Arc::new(MemDevice::new("meta", 4 << 20));
    let data = Arc::new(MemDevice::new("data", DATA_BLOCKS * BLOCK_BYTES));
    let pool = Pool::create("p", meta.clone(), data.clone(), BLOCK_BYTES, quiet_opts()).await.unwrap();
    pool.create_thin(0).await.unwrap();
    pool.create_thin(1).await.unwrap();
    let m = pool.metadata();
    // Mappings straight in the engine: many blocks without writing 300 data blocks.
    std::thread::spawn(move || {
        let mut md = m.write();
        for vb in 0..VOL_BLOCKS {
            md.provision(0, vb * 2).unwrap();
        }
        md.provision(1, 0).unwrap();
        md.commit().unwrap();
    })
    .join()
    .unwrap();
    pool.close().await.unwrap();
    (meta.to_image(), data)
}

fn block_of(img: &[u8], b: u64) -> Box<BlockBuf> {
    let mut out = Box::new([0u8; BLOCK_SIZE]);
    out.copy_from_slice(&img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE]);
    out
}

/// Applies `f` to block `b` of `img` and re-seals it as `kind` (valid checksum).
fn edit(img: &mut [u8], b: u64, kind: BlockKind, f: impl FnOnce(&mut BlockBuf)) {
    let mut blk = block_of(img, b);
    f(&mut blk);
    seal(&mut blk, kind, b);
    img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(&blk[..]);
}

fn superblock(img: &[u8]) -> Superblock {
    Superblock::unpack(&block_of(img, 0))
}

struct Outcome {
    result: Result<Pool, mdkit_thin::pool::PoolError>,
    meta_after: Vec<u8>,
    /// Writes, flushes, discards and write-zeroes the data device got.
    data_changes: u64,
}

/// Starts a pool on a copy of the metadata image and a snapshot of the data device; returns
/// what the metadata holds afterwards and what was sent to the data device (the pool, if it
/// opened, is closed).
fn start(meta_img: &[u8], data: &MemDevice, opts: PoolOptions, mode: OpenMode) -> Outcome {
    let rt = rt();
    let meta = Arc::new(MemDevice::from_image("meta", meta_img));
    let tracer = Tracer::new(16);
    let (m, d): (DeviceRef, DeviceRef) = (meta.clone(), Arc::new(tracer.wrap(data.snapshot("data"))));
    let result = rt.block_on(Pool::start("p", m, d, opts, mode));
    let data_changes = tracer.snapshot().devices.iter().map(changes).sum();
    if let Ok(p) = &result {
        rt.block_on(p.close()).unwrap();
    }
    Outcome { result, meta_after: meta.to_image(), data_changes }
}

fn changes(dev: &mdkit_io::DeviceTraceStats) -> u64 {
    [IoOp::Write, IoOp::Flush, IoOp::Discard, IoOp::WriteZeroes].into_iter().map(|op| dev.ops.get(op).requests).sum()
}

fn assert_refused_untouched(
    case: &str,
    meta_img: &[u8],
    data: &MemDevice,
    opts: PoolOptions,
    mode: OpenMode,
) -> String {
    let out = start(meta_img, data, opts, mode);
    let e = match out.result {
        Ok(_) => panic!("{case}: opened ({mode:?}, {opts:?})"),
        Err(e) => e,
    };
    let msg = e.to_string();
    let block = e.corrupt_block().unwrap_or_else(|| panic!("{case}: the error names no block: {msg}"));
    assert!(msg.contains(&format!("block {block}")), "{case}: {msg}");
    assert!(msg.contains("meta"), "{case}: the error names the device: {msg}");
    assert!(out.meta_after == meta_img, "{case}: the metadata device was written");
    assert_eq!(out.data_changes, 0, "{case}: the data device was written");
    msg
}

#[test]
fn a_zeroed_superblock_is_never_formatted_over() {
    let (mut meta, data) = rt().block_on(make_pool());
    meta[..BLOCK_SIZE].fill(0);
    for mode in [OpenMode::Open, OpenMode::OpenOrCreate { data_block_bytes: BLOCK_BYTES }] {
        let msg = assert_refused_untouched("zeroed superblock", &meta, &data, quiet_opts(), mode);
        assert!(msg.contains("block 0") && msg.contains("all zeroes") && msg.contains("thin_restore"), "{msg}");
        assert!(msg.contains("superblock of a pool was lost"), "{msg}");
    }
    let e = start(&meta, &data, quiet_opts(), OpenMode::Create { data_block_bytes: BLOCK_BYTES }).result.unwrap_err();
    assert!(matches!(&e.kind, PoolErrorKind::NotBlank { contents: DeviceContents::ZeroSuperblock { .. }, .. }), "{e}");
}

#[test]
fn only_create_modes_format_a_blank_device_and_only_overwrite_formats_a_pool() {
    let blank = vec![0u8; 4 << 20];
    let data = MemDevice::new("data", DATA_BLOCKS * BLOCK_BYTES);
    let msg = assert_refused_untouched("blank", &blank, &data, quiet_opts(), OpenMode::Open);
    assert!(msg.contains("blank") && msg.contains("pool-create"), "{msg}");
    for mode in
        [OpenMode::Create { data_block_bytes: BLOCK_BYTES }, OpenMode::OpenOrCreate { data_block_bytes: BLOCK_BYTES }]
    {
        let out = start(&blank, &data, quiet_opts(), mode);
        assert!(out.result.is_ok(), "{mode:?}: {:?}", out.result.err());
        assert!(superblock(&out.meta_after).data_sm_root.nr_blocks == DATA_BLOCKS, "{mode:?} formatted");
    }

    let (pool_img, data) = rt().block_on(make_pool());
    let e =
        start(&pool_img, &data, quiet_opts(), OpenMode::Create { data_block_bytes: BLOCK_BYTES }).result.unwrap_err();
    assert!(matches!(&e.kind, PoolErrorKind::NotBlank { contents: DeviceContents::Pool { .. }, .. }), "{e}");
    assert!(e.to_string().contains("--force"), "{e}");
    // OpenOrCreate opens the existing pool (its devices are there).
    let out = start(&pool_img, &data, quiet_opts(), OpenMode::OpenOrCreate { data_block_bytes: BLOCK_BYTES });
    assert!(out.result.is_ok() && out.meta_after == pool_img, "{:?}", out.result.err());
    let rt = rt();
    // Overwrite formats a fresh pool: no devices any more.
    let meta = Arc::new(MemDevice::from_image("meta", &pool_img));
    let data_dev = Arc::new(data.snapshot("data"));
    rt.block_on(async {
        let p = Pool::start(
            "p",
            meta.clone(),
            data_dev.clone(),
            quiet_opts(),
            OpenMode::Overwrite { data_block_bytes: 2 * BLOCK_BYTES },
        )
        .await
        .unwrap();
        assert!(p.devices().await.unwrap().is_empty());
        assert_eq!(p.data_block_bytes(), 2 * BLOCK_BYTES);
        p.close().await.unwrap();
    });
}

/// One damaged image of the matrix.
struct Case {
    name: &'static str,
    image: Vec<u8>,
}

impl Case {
    /// Damage only the full check finds (reference counts): `check_on_open = false` opts out
    /// of finding it at open.
    fn needs_full_check(&self) -> bool {
        self.name.starts_with("metadata bitmap: counts")
    }
}

fn matrix(good: &[u8]) -> Vec<Case> {
    let sb = superblock(good);
    let mut cases = Vec::new();
    let mut case = |name: &'static str, f: &dyn Fn(&mut Vec<u8>)| {
        let mut image = good.to_vec();
        f(&mut image);
        assert!(image != good, "{name}: the damage changed nothing");
        cases.push(Case { name, image });
    };
    let sb_field =
        |off: usize, v: u64, width: usize| {
            move |img: &mut Vec<u8>| {
                edit(img, 0, BlockKind::Superblock, |b| {
                    if width == 8 { put_u64(b, off, v) } else { put_u32(b, off, v as u32) }
                })
            }
        };
    case("data space map larger than any device", &sb_field(64, u64::MAX / 2, 8));
    case("data space map of zero blocks", &sb_field(64, 0, 8));
    case("data space map allocates more than it has", &sb_field(72, u64::MAX, 8));
    case("data space-map index root beyond the device", &sb_field(80, 1 << 40, 8));
    case("metadata space map larger than the device", &sb_field(192, 1 << 30, 8));
    case("metadata space map of one block", &sb_field(192, 1, 8));
    case("metadata space-map index at block 0", &sb_field(208, 0, 8));
    case("metadata space-map index beyond the device", &sb_field(208, u64::MAX, 8));
    case("mapping root beyond the device", &sb_field(320, 1 << 33, 8));
    case("details root is the superblock", &sb_field(328, 0, 8));
    case("data block size of 3 sectors", &sb_field(336, 3, 4));
    case("metadata block size of 16 sectors", &sb_field(340, 16, 4));
    case("bad magic", &sb_field(32, 12345, 8));
    case("all-zero superblock", &|img| img[..BLOCK_SIZE].fill(0));
    case("superblock checksum", &|img| img[100] ^= 1);
    let mapping_root = sb.data_mapping_root;
    case("top-level node: nr_entries above max_entries", &|img| {
        edit(img, mapping_root, BlockKind::Node, |b| put_u32(b, 16, 100_000))
    });
    case("top-level node: max_entries above what fits", &|img| {
        edit(img, mapping_root, BlockKind::Node, |b| put_u32(b, 20, 4000))
    });
    case("top-level node: value size 0", &|img| edit(img, mapping_root, BlockKind::Node, |b| put_u32(b, 24, 0)));
    case("top-level node: no flags", &|img| edit(img, mapping_root, BlockKind::Node, |b| put_u32(b, 4, 0)));
    let details_root = sb.device_details_root;
    case("details node: keys out of order", &|img| {
        edit(img, details_root, BlockKind::Node, |b| {
            let k0 = get_u64(b, 32);
            put_u64(b, 40, k0);
        })
    });
    let msm_index = sb.metadata_sm_root.bitmap_root;
    case("metadata index: bitmap beyond the device", &|img| {
        edit(img, msm_index, BlockKind::Index, |b| put_u64(b, 16, 1 << 40))
    });
    case("metadata index: more free than entries", &|img| {
        edit(img, msm_index, BlockKind::Index, |b| put_u32(b, 24, u32::MAX))
    });
    let first_bitmap = get_u64(&block_of(good, msm_index)[..], 16);
    case("metadata bitmap: counts cleared", &|img| edit(img, first_bitmap, BlockKind::Bitmap, |b| b[16..].fill(0)));
    case("metadata bitmap: wrong self-location", &|img| {
        let mut blk = block_of(img, first_bitmap);
        seal(&mut blk, BlockKind::Bitmap, first_bitmap + 1);
        let at = first_bitmap as usize * BLOCK_SIZE;
        img[at..at + BLOCK_SIZE].copy_from_slice(&blk[..]);
    });
    let dsm_index_root = sb.data_sm_root.bitmap_root;
    case("data index node: nr_entries above max_entries", &|img| {
        edit(img, dsm_index_root, BlockKind::Node, |b| put_u32(b, 16, 1000))
    });
    case("metadata device truncated below the space map", &|img| img.truncate(8 * BLOCK_SIZE));
    case("metadata device empty", &|img| img.truncate(0));
    cases
}

#[test]
fn corrupt_metadata_is_refused_naming_the_block_and_nothing_is_written() {
    let (good, data) = rt().block_on(make_pool());
    let option_sets = [
        ("default", quiet_opts()),
        ("check_on_open = false", PoolOptions { check_on_open: false, ..quiet_opts() }),
        ("read_only", PoolOptions { read_only: true, ..quiet_opts() }),
    ];
    let cases = matrix(&good);
    for c in &cases {
        for (opts_name, opts) in option_sets {
            if (!opts.check_on_open || opts.read_only) && c.needs_full_check() {
                continue;
            }
            let label = format!("{} ({opts_name})", c.name);
            assert_refused_untouched(&label, &c.image, &data, opts, OpenMode::Open);
        }
        let label = format!("{} (OpenOrCreate)", c.name);
        let grown = OpenMode::OpenOrCreate { data_block_bytes: BLOCK_BYTES };
        assert_refused_untouched(&label, &c.image, &data, quiet_opts(), grown);
    }
    eprintln!("{} damaged images refused with 4 option sets each", cases.len());
    // The undamaged image still opens read-write: the matrix is not refusing everything.
    let out = start(&good, &data, quiet_opts(), OpenMode::Open);
    let pool = out.result.unwrap();
    assert_eq!((pool.mode(), pool.mode_cause()), (PoolMode::ReadWrite, ModeCause::None));
}

#[test]
fn mode_cause_is_typed() {
    let (good, data) = rt().block_on(make_pool());
    let out = start(&good, &data, PoolOptions { read_only: true, ..quiet_opts() }, OpenMode::Open);
    let pool = out.result.unwrap();
    assert_eq!((pool.mode(), pool.mode_cause()), (PoolMode::ReadOnly, ModeCause::ReadOnlyOption));
    assert!(!pool.mode_cause().needs_check());
    let mut flagged = good.clone();
    edit(&mut flagged, 0, BlockKind::Superblock, |b| put_u32(b, 4, 1));
    let out = start(&flagged, &data, quiet_opts(), OpenMode::Open);
    let pool = out.result.unwrap();
    assert_eq!((pool.mode(), pool.mode_cause()), (PoolMode::ReadOnly, ModeCause::NeedsCheck));
    assert!(pool.mode_cause().needs_check());
    assert!(out.meta_after == flagged, "a NEEDS_CHECK pool opens without writing");
}
