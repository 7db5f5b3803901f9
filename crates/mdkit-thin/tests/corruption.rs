//! Corrupt metadata gets a clear error that names the block, from the engine and from the
//! checker, and nothing is written because of it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use mdkit_thin::meta::block::{BLOCK_SIZE, BlockBuf, BlockKind, get_u64, put_u32, put_u64, seal};
use mdkit_thin::meta::{
    CheckOptions, Corruption, FormatOptions, MemMetaIo, MetaError, MetaIo, NodeView, OpenOptions, Superblock,
    ThinMetadata, check,
};

const META_BLOCKS: u64 = 2048;

/// A pool with device 1 (2000 mappings: an internal root over leaves) and device 2 (a few).
fn build() -> Vec<u8> {
    let mem = Arc::new(MemMetaIo::new("good.meta", META_BLOCKS));
    let io: Arc<dyn MetaIo> = mem.clone();
    let mut md = ThinMetadata::format(
        io,
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 10_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(1).unwrap();
    md.create_thin(2).unwrap();
    for vb in 0..2000 {
        md.provision(1, vb * 3).unwrap();
    }
    for vb in 0..5 {
        md.provision(2, vb).unwrap();
    }
    md.commit().unwrap();
    mem.to_image()
}

fn block(img: &[u8], b: u64) -> Box<BlockBuf> {
    let mut out = Box::new([0u8; BLOCK_SIZE]);
    out.copy_from_slice(&img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE]);
    out
}

fn put_block(img: &mut [u8], b: u64, data: &BlockBuf) {
    img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(data);
}

/// Root of device `dev`'s mapping tree (top-level tree is a single leaf here).
fn device_root(img: &[u8], dev: u64) -> u64 {
    let sb = Superblock::unpack(&block(img, 0));
    let top = block(img, sb.data_mapping_root);
    let n = NodeView::new(&top);
    let i = n.lower_bound(dev).unwrap();
    assert_eq!(n.key(i), dev);
    n.value_u64(i)
}

/// (internal root of device 1, its second child: a leaf)
fn internal_and_leaf(img: &[u8]) -> (u64, u64) {
    let root = device_root(img, 1);
    let r = block(img, root);
    let n = NodeView::new(&r);
    assert!(!n.is_leaf(), "device 1 has a two-level tree");
    (root, n.value_u64(1))
}

struct Case {
    name: &'static str,
    image: Vec<u8>,
    block: u64,
    is_reason: fn(&Corruption) -> bool,
}

fn cases(good: &[u8]) -> Vec<Case> {
    let (root, leaf) = internal_and_leaf(good);
    let mut out = Vec::new();
    let mut edit = |name, b: u64, is_reason: fn(&Corruption) -> bool, f: &dyn Fn(&mut BlockBuf)| {
        let mut img = good.to_vec();
        let mut blk = block(&img, b);
        f(&mut blk);
        put_block(&mut img, b, &blk);
        out.push(Case { name, image: img, block: b, is_reason });
    };
    edit("checksum", leaf, |c| matches!(c, Corruption::ChecksumMismatch { .. }), &|blk| blk[100] ^= 0x40);
    edit("wrong block number", leaf, |c| matches!(c, Corruption::WrongBlockNumber { .. }), &|blk| {
        seal(blk, BlockKind::Node, leaf + 1000)
    });
    edit("keys out of order", leaf, |c| matches!(c, Corruption::KeysOutOfOrder { .. }), &|blk| {
        let (k0, k1) = (get_u64(&blk[..], 32), get_u64(&blk[..], 40));
        put_u64(&mut blk[..], 32, k1);
        put_u64(&mut blk[..], 40, k0);
        seal(blk, BlockKind::Node, leaf);
    });
    edit("bad value size", leaf, |c| matches!(c, Corruption::ValueSizeMismatch { expected: 8, found: 16 }), &|blk| {
        put_u32(&mut blk[..], 20, 168); // max_entries consistent with 16-byte values
        put_u32(&mut blk[..], 24, 16);
        put_u32(&mut blk[..], 16, 100);
        seal(blk, BlockKind::Node, leaf);
    });
    edit("cycle", root, |c| matches!(c, Corruption::Cycle | Corruption::TooDeep { .. }), &|blk| {
        let n = NodeView::new(blk);
        let off = 32 + 8 * n.max_entries() as usize + 8; // value 1
        put_u64(&mut blk[..], off, root);
        seal(blk, BlockKind::Node, root);
    });
    edit("reference beyond the device", root, |c| matches!(c, Corruption::BeyondDevice { .. }), &|blk| {
        let n = NodeView::new(blk);
        let off = 32 + 8 * n.max_entries() as usize + 8;
        put_u64(&mut blk[..], off, 1 << 40);
        seal(blk, BlockKind::Node, root);
    });
    out
}

#[test]
fn corrupt_mapping_trees_name_the_block_and_write_nothing() {
    let good = build();
    for case in cases(&good) {
        let mem = Arc::new(MemMetaIo::from_image(format!("{}.meta", case.name), &case.image));
        let io: Arc<dyn MetaIo> = mem.clone();
        // The engine: opening works (device 1's tree is only read on demand); walking it fails.
        let mut md = ThinMetadata::open(io.clone()).unwrap_or_else(|e| panic!("{}: open: {e}", case.name));
        let err = md.for_each_mapping(1, 0, u64::MAX, &mut |_, _| true).unwrap_err();
        let text = err.to_string();
        match &err {
            MetaError::Corrupt { block, reason, .. } => {
                // A cycle shows up as a too-deep walk through the looping node or its child.
                assert!(*block == case.block || matches!(reason, Corruption::TooDeep { .. }), "{}: {text}", case.name);
                assert!((case.is_reason)(reason), "{}: unexpected reason: {text}", case.name);
            }
            e => panic!("{}: not a corruption error: {e}", case.name),
        }
        assert!(text.contains("good.meta") || text.contains(case.name), "{}: names the device: {text}", case.name);
        // A write into the damaged range fails too, poisons, and nothing reaches the device.
        // A key inside the damaged leaf's range: just above the root's key for child 1.
        let target = {
            let (root, _) = internal_and_leaf(&good);
            NodeView::new(&block(&good, root)).key(1)
        };
        let r = md.provision(1, target + 1);
        assert!(r.is_err(), "{}: provision into a corrupt tree must fail", case.name);
        assert!(md.commit().is_err(), "{}: commit of a poisoned transaction is refused", case.name);
        assert_eq!(mem.writes.load(Ordering::Relaxed), 0, "{}: nothing written", case.name);
        assert_eq!(mem.to_image(), case.image, "{}: image unchanged", case.name);
        // The other device still works read-only.
        assert!(md.lookup(2, 0).unwrap().is_some());
        // The checker reports it, naming the block.
        let r = check(&*io, &CheckOptions::default());
        assert!(!r.is_clean(), "{}: check missed it", case.name);
        assert!(
            r.errors.iter().any(|e| e.block == Some(case.block)),
            "{}: check does not name block {}:\n{r}",
            case.name,
            case.block
        );
        // thin_check agrees that the image is damaged.
        let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("corrupt-{}.meta", case.name.replace(' ', "-")));
        std::fs::write(&path, &case.image).unwrap();
        let tc =
            std::process::Command::new("thin_check").arg(&path).output().expect("thin_check (thin-provisioning-tools)");
        assert!(!tc.status.success(), "{}: thin_check accepted the damaged image", case.name);
        eprintln!("{}: {text}\n  check: {}", case.name, r.errors[0]);
    }
}

#[test]
fn corrupt_superblock_and_space_maps_refuse_to_open() {
    let good = build();
    let sb = Superblock::unpack(&block(&good, 0));
    let reseal_sb = |f: &dyn Fn(&mut Superblock)| {
        let mut img = good.clone();
        let mut s = sb.clone();
        f(&mut s);
        let mut blk = Box::new([0u8; BLOCK_SIZE]);
        s.pack(&mut blk);
        seal(&mut blk, BlockKind::Superblock, 0);
        put_block(&mut img, 0, &blk);
        img
    };
    let open = |img: &[u8], ro: bool| {
        let io: Arc<dyn MetaIo> = Arc::new(MemMetaIo::from_image("bad.meta", img));
        ThinMetadata::open_with(io, OpenOptions { read_only: ro, ..Default::default() })
    };
    let mut flipped = good.clone();
    flipped[500] ^= 1;
    let e = open(&flipped, false).unwrap_err();
    assert!(matches!(e, MetaError::Corrupt { block: 0, reason: Corruption::ChecksumMismatch { .. }, .. }), "{e}");

    let e = open(&reseal_sb(&|s| s.magic = 1), false).unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
    let e = open(&reseal_sb(&|s| s.version = 3), false).unwrap_err();
    assert!(matches!(e, MetaError::Unsupported { .. }) && e.to_string().contains("version 3"), "{e}");
    let e = open(&reseal_sb(&|s| s.incompat_flags = 2), false).unwrap_err();
    assert!(matches!(e, MetaError::Unsupported { .. }) && e.to_string().contains("incompat"), "{e}");
    let ro_img = reseal_sb(&|s| s.compat_ro_flags = 1);
    let e = open(&ro_img, false).unwrap_err();
    assert!(e.to_string().contains("compat_ro"), "{e}");
    let mut md = open(&ro_img, true).expect("compat_ro opens read-only");
    assert!(matches!(md.create_thin(9), Err(MetaError::ReadOnly(_))));
    assert_eq!(md.devices(), vec![1, 2]);
    let e = open(&reseal_sb(&|s| s.data_block_size_sectors = 100), false).unwrap_err();
    assert!(e.to_string().contains("data_block_size"), "{e}");
    let e = open(&vec![0u8; good.len()], false).unwrap_err();
    assert!(e.to_string().contains("never formatted"), "{e}");
    // Version 1 metadata is accepted.
    open(&reseal_sb(&|s| s.version = 1), false).unwrap();

    // A metadata space-map bitmap with a bad checksum.
    let io = MemMetaIo::from_image("x", &good);
    let index = mdkit_thin::meta::sm_format::index_block_decode(&io.peek(sb.metadata_sm_root.bitmap_root), 1);
    let mut img = good.clone();
    let bm = index[0].blocknr;
    img[bm as usize * BLOCK_SIZE + 4000] ^= 1;
    let e = open(&img, false).unwrap_err();
    assert!(
        matches!(e, MetaError::Corrupt { block, reason: Corruption::ChecksumMismatch { kind: BlockKind::Bitmap, .. }, .. } if block == bm),
        "{e}"
    );
    let r = check(&MemMetaIo::from_image("bad.meta", &img), &CheckOptions::default());
    assert!(r.errors.iter().any(|i| i.block == Some(bm)), "{r}");

    // A leaked metadata block: counted 0, marked 1.
    let mut img = good.clone();
    let mut blk = block(&img, bm);
    let free = (0..META_BLOCKS).rev().find(|b| mdkit_thin::meta::sm_format::bitmap_get(&blk, *b as u32) == 0).unwrap();
    mdkit_thin::meta::sm_format::bitmap_set(&mut blk, free as u32, 1);
    seal(&mut blk, BlockKind::Bitmap, bm);
    put_block(&mut img, bm, &blk);
    let r = check(&MemMetaIo::from_image("leak.meta", &img), &CheckOptions::default());
    assert!(
        r.errors.iter().any(|i| i.message.contains(&format!("metadata block {free}:")) && i.message.contains("leaked")),
        "{r}"
    );
}

/// A leaf that device 1 shares with its snapshot, device 2, damaged (re-sealed) to claim
/// 1-byte values: writes that would copy it (taking a reference to each data block it maps)
/// or delete the last device holding it (releasing its data blocks) must refuse it as corrupt
/// instead of decoding 1-byte values as data blocks (found by the thin_metadata fuzz target:
/// a slice-bounds panic in the reference counting), and so must a remove (whose lookup
/// refuses it before anything changes, so that transaction is not poisoned).
#[test]
fn shared_leaf_with_a_wrong_value_size_is_refused_by_every_write() {
    let mem = Arc::new(MemMetaIo::new("shared.meta", 256));
    let io: Arc<dyn MetaIo> = mem.clone();
    let fo = FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1000, metadata_nr_blocks: None };
    let mut md = ThinMetadata::format(io, fo).unwrap();
    md.create_thin(1).unwrap();
    for vb in 0..400 {
        md.provision(1, vb * 2).unwrap();
    }
    md.create_snap(2, 1).unwrap();
    md.commit().unwrap();
    let good = mem.to_image();
    let (_, leaf) = internal_and_leaf(&good);
    let key = NodeView::new(&block(&good, leaf)).key(0);
    let mut img = good.clone();
    let mut blk = block(&img, leaf);
    put_u32(&mut blk[..], 24, 1); // value_size; max_entries stays valid for 1-byte values
    seal(&mut blk, BlockKind::Node, leaf);
    put_block(&mut img, leaf, &blk);

    type Write = fn(&mut ThinMetadata, u64) -> Result<(), MetaError>;
    let writes: [(&str, bool, Write); 4] = [
        ("provision in the snapshot", true, |md, key| md.provision(2, key + 1).map(|_| ())),
        ("provision in the origin", true, |md, key| md.provision(1, key + 1).map(|_| ())),
        ("remove", false, |md, key| md.remove(1, key).map(|_| ())),
        ("delete both devices", true, |md, _| md.delete(1).and_then(|_| md.delete(2))),
    ];
    for (name, poisons, write) in writes {
        let mem = Arc::new(MemMetaIo::from_image("bad.meta", &img));
        let mut md = ThinMetadata::open(mem.clone()).unwrap();
        let err = write(&mut md, key).unwrap_err();
        assert!(
            matches!(err, MetaError::Corrupt { block, reason: Corruption::ValueSizeMismatch { expected: 8, found: 1 }, .. } if block == leaf),
            "{name}: {err}"
        );
        assert_eq!(md.is_poisoned().is_some(), poisons, "{name}: {err}");
        if poisons {
            assert!(md.commit().is_err(), "{name}: commit of a poisoned transaction is refused");
        }
        assert_eq!(mem.writes.load(Ordering::Relaxed), 0, "{name}: nothing written");
        assert_eq!(mem.to_image(), img, "{name}: image unchanged");
    }
}

/// The metadata space map marks the superblock or one of its own blocks (its bitmap, its
/// index) free: it would hand the block out as a new one, and for the bitmap a commit would
/// allocate the block as its own new home and free it as the old one, forever (found by the
/// thin_metadata fuzz target as a hang in commit). Opening refuses it as corrupt, naming the
/// block, and writes nothing.
#[test]
fn metadata_space_map_marking_its_own_blocks_free_is_refused_at_open() {
    let good = build();
    let sb = Superblock::unpack(&block(&good, 0));
    let index_loc = sb.metadata_sm_root.bitmap_root;
    let bitmap_loc = mdkit_thin::meta::sm_format::index_block_decode(&block(&good, index_loc), 1)[0].blocknr;
    for (name, free) in [("bitmap", bitmap_loc), ("index", index_loc), ("superblock", 0)] {
        let mut img = good.clone();
        let mut blk = block(&img, bitmap_loc);
        mdkit_thin::meta::sm_format::bitmap_set(&mut blk, free as u32, 0);
        seal(&mut blk, BlockKind::Bitmap, bitmap_loc);
        put_block(&mut img, bitmap_loc, &blk);
        let mem = Arc::new(MemMetaIo::from_image("sm.meta", &img));
        let err = ThinMetadata::open(mem.clone()).err().unwrap_or_else(|| panic!("{name}: opened"));
        assert!(
            matches!(err, MetaError::Corrupt { block, reason: Corruption::BadSpaceMap(_), .. } if block == free),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("marks it free"), "{name}: {err}");
        assert_eq!(mem.writes.load(Ordering::Relaxed), 0, "{name}: nothing written");
    }
}
