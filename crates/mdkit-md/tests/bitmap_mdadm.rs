//! Host `mdadm --examine-bitmap` (through a read-only loop device: mdadm 4.2 cannot find an
//! internal bitmap on a plain file) reads the bitmap the runtime leaves on a member: an array
//! planned as `mdadm --create --bitmap=internal --bitmap-chunk=64K` does it (every bit set),
//! loaded by the runtime on io_uring file members, every bit cleared by a sweep, three chunks
//! written and left dirty, the superblock events moved on. mdadm reports exactly those three
//! dirty chunks and the same header fields, line for line as mdkit renders it, and both members
//! carry the same bits.

use crate::bitmap_support;
use crate::common;

use std::process::Command;
use std::sync::Arc;

use bitmap_support::Failures;
use common::images::{MemberImage, write_plan};
use common::require_tool;
use mdkit_io::{DeviceRef, FileDevice, FileOptions};
use mdkit_md::array::bitmap::{BitmapArrayInfo, BitmapMember, WriteIntentBitmap};
use mdkit_md::format::bitmap::{count_dirty, kernel_sync_size_sectors, test_bit};
use mdkit_md::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};
use mdkit_md::format::examine::render_bitmap_text;
use mdkit_md::layout::Level;

const MIB_SECTORS: u64 = 2048;
const DIRTY: [u64; 3] = [2, 17, 500];

#[test]
fn mdadm_examine_bitmap_reads_the_runtime_bitmap() {
    require_tool("mdadm");
    require_tool("losetup");
    let dir = tempfile::tempdir().unwrap();
    let mut req = CreateRequest::new(Level::Raid1, vec![64 * MIB_SECTORS; 2], [0x42; 16], 1_790_000_000);
    req.name = "bm-x".into();
    req.sync = InitialSync::AssumeClean;
    req.bitmap = BitmapRequest::Internal { chunk_bytes: Some(64 << 10) };
    let p = plan(&req).unwrap();
    let images: Vec<MemberImage> = (0..2)
        .map(|i| MemberImage::sparse_file(&dir.path().join(format!("m{i}.img")), 64 * MIB_SECTORS * 512))
        .collect();
    write_plan(&p, &images);
    let sb = images[0].find_superblock().unwrap();
    let events = sb.events;

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let chunks = rt.block_on(async {
        let devs: Vec<DeviceRef> = images
            .iter()
            .map(|m| Arc::new(FileDevice::open(&m.path, FileOptions::default()).unwrap()) as DeviceRef)
            .collect();
        let members: Vec<BitmapMember> = devs
            .iter()
            .zip(&images)
            .enumerate()
            .map(|(i, (d, m))| {
                BitmapMember::from_superblock(i as u32, d.clone(), &m.find_superblock().unwrap()).unwrap()
            })
            .collect();
        assert_eq!(members[0].bitmap_offset_bytes, 8192);
        let info = BitmapArrayInfo {
            name: "bm-x".into(),
            set_uuid: sb.set_uuid,
            events,
            resync_offset_sectors: sb.resync_offset_sectors,
            sync_size_sectors: kernel_sync_size_sectors(1, sb.size_sectors, p.array_sectors),
            degraded: false,
        };
        let bm = WriteIntentBitmap::load(members, info, Failures::default().callback()).await.unwrap();
        let chunks = bm.geometry().chunks();
        assert_eq!(bm.dirty_chunks().len() as u64, chunks, "mdadm creates every bit set");
        assert_eq!(bm.needed_chunks(), Vec::<u64>::new(), "--assume-clean: nothing to resync");
        assert_eq!(bm.sweep_now().await.unwrap(), chunks);
        let cs = bm.geometry().chunk_sectors();
        for c in DIRTY {
            bm.start_write(c * cs..c * cs + 8).await.unwrap();
            bm.end_write(c * cs..c * cs + 8, true);
        }
        bm.update_superblock(events + 1).await.unwrap();
        // Dropped without shutdown: the bits stay, as after a crash.
        chunks
    });

    let out = Command::new("losetup").args(["--read-only", "--find", "--show"]).arg(&images[0].path).output().unwrap();
    assert!(
        out.status.success(),
        "losetup --read-only failed (needs root and the loop driver): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let x = Command::new("mdadm").env("TZ", "UTC").arg("--examine-bitmap").arg(&loopdev).output().unwrap();
    let detach = Command::new("losetup").arg("-d").arg(&loopdev).status();
    let text = String::from_utf8_lossy(&x.stdout).into_owned();
    assert!(x.status.success(), "mdadm -X {loopdev}: {text}{}", String::from_utf8_lossy(&x.stderr));
    assert!(detach.map(|s| s.success()).unwrap_or(false), "losetup -d {loopdev} failed");
    eprintln!("{text}");
    assert!(text.contains(&format!("Bitmap : {chunks} bits (chunks), 3 dirty (0.3%)")), "{text}");
    assert!(text.contains(&format!("Events : {}", events + 1)), "{text}");
    let (bms, area) = images[0].bitmap(&images[0].find_superblock().unwrap()).unwrap();
    assert_eq!(render_bitmap_text(&bms, &loopdev, Some(&area)), text);
    let geo = bms.geometry().unwrap();
    assert_eq!(count_dirty(&area, &geo), 3);
    let (_, other) = images[1].bitmap(&images[1].find_superblock().unwrap()).unwrap();
    assert_eq!(area, other, "the same bitmap on every member");
    for c in DIRTY {
        assert_eq!(test_bit(&area, &geo, c), Some(true));
    }
}
