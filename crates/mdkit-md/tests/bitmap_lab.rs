//! The runtime bitmap and the Linux kernel (lab: Debian 6.1 + mdadm 4.2 under qemu), both ways,
//! in one boot:
//!
//! 1. mdkit -> kernel: a raid1 planned as `mdadm --create --bitmap=internal --bitmap-chunk=64K`
//!    does it; the runtime loads it on io_uring file members, clears every bit, writes chunks
//!    2, 17 and 500 and stops without clearing them (a crash). In the guest `mdadm -X` sees
//!    exactly 3 dirty chunks; the kernel assembles the array with that bitmap
//!    (`bitmap: 1/1 pages [4KB], 64KB chunk`) and, the array being clean, clears them itself.
//! 2. kernel -> mdkit: the kernel runs the array degraded (one member failed) and writes
//!    chunks 5, 77 and 300; degraded, it never clears them; after `mdadm --stop` the runtime
//!    loads the surviving member's bitmap: the same 3 dirty chunks `mdadm -X` reports, all
//!    needed for the failed member's re-add.
//!
//! Skips loudly (SKIP: ...) when the lab cannot be built or booted.

use crate::bitmap_support;
use crate::common;

use std::sync::Arc;

use bitmap_support::Failures;
use common::images::{MemberImage, write_plan};
use common::lab::RunOptions;
use mdkit_io::{DeviceRef, FileDevice, FileOptions};
use mdkit_md::array::bitmap::{BitmapArrayInfo, BitmapMember, WriteIntentBitmap};
use mdkit_md::format::bitmap::kernel_sync_size_sectors;
use mdkit_md::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};
use mdkit_md::format::superblock::Superblock;
use mdkit_md::layout::Level;

const MIB_SECTORS: u64 = 2048;
const MDKIT_DIRTY: [u64; 3] = [2, 17, 500];
const KERNEL_DIRTY: [u64; 3] = [5, 77, 300];

fn dirty_count(x: &str) -> Option<u64> {
    let line = x.lines().find(|l| l.trim_start().starts_with("Bitmap :"))?;
    let after = line.split("(chunks),").nth(1)?;
    after.split_whitespace().next()?.parse().ok()
}

fn info(sb: &Superblock, array_sectors: u64, degraded: bool) -> BitmapArrayInfo {
    BitmapArrayInfo {
        name: "md-lab".into(),
        set_uuid: sb.set_uuid,
        events: sb.events,
        resync_offset_sectors: sb.resync_offset_sectors,
        sync_size_sectors: kernel_sync_size_sectors(1, sb.size_sectors, array_sectors),
        degraded,
    }
}

fn open(images: &[&MemberImage]) -> Vec<(DeviceRef, Superblock)> {
    images
        .iter()
        .map(|m| {
            let dev: DeviceRef = Arc::new(FileDevice::open(&m.path, FileOptions::default()).unwrap());
            (dev, m.find_superblock().unwrap())
        })
        .collect()
}

#[test]
fn kernel_and_runtime_read_each_others_bitmaps() {
    let lab = crate::lab_or_skip!("bitmap_lab");
    let dir = lab.scratch_dir("bitmap");
    let mut req = CreateRequest::new(Level::Raid1, vec![128 * MIB_SECTORS; 2], [0x4b; 16], 1_790_000_000);
    req.name = "bmlab".into();
    req.sync = InitialSync::AssumeClean;
    req.bitmap = BitmapRequest::Internal { chunk_bytes: Some(64 << 10) };
    let p = plan(&req).unwrap();
    let images: Vec<MemberImage> = (0..2)
        .map(|i| MemberImage::sparse_file(&dir.path().join(format!("m{i}.img")), 128 * MIB_SECTORS * 512))
        .collect();
    write_plan(&p, &images);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    // 1. mdkit writes bits.
    let chunks = rt.block_on(async {
        let opened = open(&images.iter().collect::<Vec<_>>());
        let members: Vec<BitmapMember> = opened
            .iter()
            .enumerate()
            .map(|(i, (d, sb))| BitmapMember::from_superblock(i as u32, d.clone(), sb).unwrap())
            .collect();
        let bm = WriteIntentBitmap::load(
            members,
            info(&opened[0].1, p.array_sectors, false),
            Failures::default().callback(),
        )
        .await
        .unwrap();
        bm.sweep_now().await.unwrap();
        let cs = bm.geometry().chunk_sectors();
        for c in MDKIT_DIRTY {
            bm.start_write(c * cs..(c + 1) * cs).await.unwrap();
            bm.end_write(c * cs..(c + 1) * cs, true);
        }
        assert_eq!(bm.dirty_chunks(), MDKIT_DIRTY.to_vec());
        bm.geometry().chunks()
    });

    // 2. The kernel reads them, runs the array, then writes its own bits degraded.
    let seeks: Vec<String> = KERNEL_DIRTY.iter().map(|c| (c * 16).to_string()).collect();
    let script = format!(
        r#"
x() {{ blockdev --flushbufs /dev/vda; echo 3 > /proc/sys/vm/drop_caches; mdadm -X /dev/vda; }}
echo "=== x-before"; x
mdadm --assemble /dev/md0 /dev/vda /dev/vdb 2>&1 || echo assemble_failed=1
echo "=== mdstat"; cat /proc/mdstat
echo "=== chunksize"; cat /sys/block/md0/md/bitmap/chunksize
echo 1 > /sys/block/md0/md/bitmap/time_base
sleep 6
echo "=== x-cleared"; x
mdadm /dev/md0 --fail /dev/vdb 2>&1
for s in {seeks}; do dd if=/dev/urandom of=/dev/md0 bs=4096 count=1 seek=$s oflag=direct conv=notrunc status=none; done
sleep 4
echo "=== x-degraded"; x
mdadm --stop /dev/md0 2>&1
echo "=== x-stopped"; x
echo "=== end"
"#,
        seeks = seeks.join(" ")
    );
    let paths: Vec<_> = images.iter().map(|m| m.path.clone()).collect();
    let run = lab.run(&RunOptions::with_disks(paths), &script).unwrap_or_else(|e| panic!("lab: {e}"));
    assert_eq!(run.exit_code, 0, "{}", run.output);
    assert!(!run.output.contains("assemble_failed"), "{}", run.output);
    let section = |n: &str| run.section(n).unwrap_or_else(|| panic!("no section {n}:\n{}", run.output));
    assert_eq!(dirty_count(&section("x-before")), Some(3), "the kernel's mdadm sees mdkit's bits:\n{}", run.output);
    assert!(section("x-before").contains(&format!("{chunks} bits")), "{}", run.output);
    assert!(section("mdstat").contains("bitmap: 1/1 pages [4KB], 64KB chunk"), "{}", run.output);
    assert_eq!(section("chunksize").trim(), "65536");
    assert_eq!(dirty_count(&section("x-cleared")), Some(0), "the kernel cleared them itself:\n{}", run.output);
    assert_eq!(dirty_count(&section("x-degraded")), Some(3), "{}", run.output);
    assert_eq!(dirty_count(&section("x-stopped")), Some(3), "degraded: the kernel kept its bits:\n{}", run.output);

    // 3. mdkit loads the kernel's bitmap from the surviving member.
    let loaded = rt.block_on(async {
        let opened = open(&[&images[0]]);
        let sb = &opened[0].1;
        assert_eq!(sb.dev_roles.get(1).copied(), Some(0xfffe), "the kernel recorded the failed member");
        let members = vec![BitmapMember::from_superblock(0, opened[0].0.clone(), sb).unwrap()];
        let bm = WriteIntentBitmap::load(members, info(sb, p.array_sectors, true), Failures::default().callback())
            .await
            .unwrap();
        (bm.dirty_chunks(), bm.needed_chunks(), bm.events_cleared(), sb.events)
    });
    eprintln!(
        "mdkit loaded the kernel's bitmap: dirty {:?}, needed {:?}, events_cleared {}, events {}",
        loaded.0, loaded.1, loaded.2, loaded.3
    );
    assert_eq!(loaded.0, KERNEL_DIRTY.to_vec());
    assert_eq!(loaded.1, KERNEL_DIRTY.to_vec(), "kept needed for the failed member's re-add");
    assert!(loaded.2 < loaded.3, "the kernel did not advance events_cleared while degraded");
}
