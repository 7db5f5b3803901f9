//! Bitmap I/O is whole, aligned 4 KiB blocks (upstream md lesson 1), checked with the tracer on
//! every member, in every kind of round (create, load rewrite, set, clear, superblock update,
//! a new member's full write, shutdown):
//! - a bitmap whose last page is partial is padded to 4 KiB when the reserved space allows;
//! - when it does not (the space ends inside the last 4 KiB block, e.g. a bad-block log right
//!   after the bits), the block is read, the bitmap's bytes are overlaid and the whole block is
//!   written back: never a sub-4K write, and the neighbour's bytes survive — also while the
//!   neighbour's owner rewrites them concurrently under `tail_block_guard`;
//! - placements mdkit cannot serve with whole aligned blocks are refused with a clear error.

use crate::bitmap_support;

use std::sync::Arc;
use std::time::Duration;

use bitmap_support::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, IoOp, MemDevice, Tracer, WriteFlags};
use mdkit_md::array::bitmap::{BitmapCreate, WriteIntentBitmap};
use mdkit_md::format::bitmap::{BitmapGeometry, count_dirty, test_bit};

const CHUNK_BYTES: u32 = 64 << 10;
/// Two pages; page 1 holds 1160 bytes of bits (storage 5256 bytes).
const CHUNKS: u64 = 40_000;

fn geo() -> BitmapGeometry {
    BitmapGeometry::new(CHUNK_BYTES, CHUNKS * chunk_sectors(CHUNK_BYTES)).unwrap()
}

/// Every request the tracer saw is whole aligned 4 KiB blocks; returns the bitmap writes.
fn assert_whole_blocks(tracer: &Tracer) -> usize {
    let snap = tracer.snapshot();
    assert_eq!(snap.events_overwritten, 0, "the ring holds every event");
    assert_eq!(tracer.writes_below_4k(), 0, "writes below 4 KiB");
    assert_eq!(tracer.writes_misaligned_4k(), 0, "writes not aligned to 4 KiB");
    let mut bitmap_writes = 0;
    for e in &snap.events {
        if matches!(e.op, IoOp::Read | IoOp::Write) {
            assert!(e.offset_bytes % 4096 == 0 && e.len_bytes % 4096 == 0 && e.len_bytes > 0, "{e:?}");
        }
        if e.op == IoOp::Write && e.offset_bytes < DATA_BASE {
            assert!(e.offset_bytes >= BITMAP_OFFSET && e.offset_bytes + e.len_bytes <= BITMAP_OFFSET + 8192, "{e:?}");
            bitmap_writes += 1;
        }
    }
    bitmap_writes
}

async fn exercise(bm: &WriteIntentBitmap, devs: &[DeviceRef]) {
    bm.set_attribute("time_base", "0.05").unwrap().unwrap();
    for round in 0..3u64 {
        for c in [0, 1, 30_719, 30_720, CHUNKS - 1, 12_345 + round] {
            bm.start_write(chunk_range(c, CHUNK_BYTES)).await.unwrap();
            data_write(devs, c, false).await.unwrap();
            bm.end_write(chunk_range(c, CHUNK_BYTES), true);
        }
        bm.update_superblock(11 + round).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await; // clears
    }
}

#[test]
fn padded_last_page_and_every_round_kind_write_whole_blocks() {
    paused_runtime().block_on(async {
        let tracer = Tracer::new(1 << 16);
        let devs: Vec<DeviceRef> = (0..3)
            .map(|i| Arc::new(tracer.wrap(MemDevice::new(format!("m{i}"), device_bytes(CHUNKS)))) as DeviceRef)
            .collect();
        // mdadm's placement: the area rounded to 4 KiB fits the space exactly.
        let space = geo().area_bytes();
        assert_eq!(space, 8192);
        let members: Vec<_> = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), space)).collect();
        let bm = WriteIntentBitmap::create(
            members[..2].to_vec(),
            array_info(CHUNKS, CHUNK_BYTES),
            BitmapCreate::new(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap();
        assert!(!bm.shares_tail_block());
        exercise(&bm, &devs[..2]).await;
        // A third member joins: every page is written to it.
        bm.set_members(members.clone());
        bm.sync_all_pages().await.unwrap();
        exercise(&bm, &devs).await;
        bm.shutdown().await.unwrap();
        drop(bm);
        let bm = WriteIntentBitmap::load(members, array_info(CHUNKS, CHUNK_BYTES), Failures::default().callback())
            .await
            .unwrap();
        bm.shutdown().await.unwrap();
        let writes = assert_whole_blocks(&tracer);
        assert!(writes > 30, "{writes} bitmap writes checked");
        assert_eq!(bm.stats().rmw_page_writes, 0);
        // The padding past the bits is written (whole page) and the space beyond untouched.
        for d in &devs {
            let area = d.read_vec(BITMAP_OFFSET, 3 * 4096).await.unwrap();
            assert_eq!(count_dirty(&area, &geo()), 0, "clean after shutdown: {}", d.name());
            assert!(area[8192..].iter().all(|&b| b == 0), "nothing written beyond the space of {}", d.name());
        }
    });
}

#[test]
fn an_unpaddable_tail_is_read_modified_and_written_whole() {
    paused_runtime().block_on(async {
        let tracer = Tracer::new(1 << 16);
        let mems: Vec<Arc<MemDevice>> =
            (0..2).map(|i| Arc::new(MemDevice::new(format!("m{i}"), device_bytes(CHUNKS)))).collect();
        let devs: Vec<DeviceRef> = mems.iter().map(|m| Arc::new(tracer.wrap(m.clone())) as DeviceRef).collect();
        // The space ends at the first 512-byte boundary after the bits: a "bad-block log"
        // occupies the rest of the last 4 KiB block.
        let storage = geo().storage_bytes();
        let space = storage.next_multiple_of(512);
        assert_eq!((storage, space), (5256, 5632));
        let neighbour = BITMAP_OFFSET + space..BITMAP_OFFSET + 8192;
        for m in &mems {
            m.write_bytes(neighbour.start, &vec![0xbb; (neighbour.end - neighbour.start) as usize]);
        }
        let members: Vec<_> = devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), space)).collect();
        let bm = Arc::new(
            WriteIntentBitmap::create(
                members,
                array_info(CHUNKS, CHUNK_BYTES),
                BitmapCreate::new(CHUNK_BYTES),
                Failures::default().callback(),
            )
            .await
            .unwrap(),
        );
        assert!(bm.shares_tail_block());
        // The neighbour's owner keeps rewriting its bytes (whole block, under the guard) while
        // the bitmap sets and clears bits in the same block.
        let owner = {
            let (bm, devs) = (bm.clone(), devs.clone());
            tokio::spawn(async move {
                for generation in 1..=40u8 {
                    for (slot, d) in devs.iter().enumerate() {
                        let _g = bm.tail_block_guard(slot as u32).await.expect("this member shares its tail block");
                        let mut block = d.read_vec(BITMAP_OFFSET + 4096, 4096).await.unwrap();
                        block[(space - 4096) as usize..].fill(generation);
                        d.write_slice(BITMAP_OFFSET + 4096, &block, WriteFlags::FUA).await.unwrap();
                    }
                    tokio::time::sleep(Duration::from_millis(7)).await;
                }
            })
        };
        exercise(&bm, &devs).await;
        owner.await.unwrap();
        bm.update_superblock(20).await.unwrap();
        let st = bm.stats();
        assert!(st.rmw_page_writes > 5, "{st:?}");
        assert_whole_blocks(&tracer);
        for m in &mems {
            let mut tail = vec![0u8; (neighbour.end - neighbour.start) as usize];
            m.read_bytes(neighbour.start, &mut tail);
            assert!(tail.iter().all(|&b| b == 40), "{}: the neighbour's last write survived", m.name());
        }
        // The bits themselves: set and cleared correctly in the shared block.
        bm.start_write(chunk_range(CHUNKS - 1, CHUNK_BYTES)).await.unwrap();
        for d in &devs {
            let area = d.read_vec(BITMAP_OFFSET, 8192).await.unwrap();
            assert_eq!(test_bit(&area, &geo(), CHUNKS - 1), Some(true));
            assert_eq!(count_dirty(&area[..storage as usize], &geo()), 1);
        }
        bm.end_write(chunk_range(CHUNKS - 1, CHUNK_BYTES), true);
    });
}

#[test]
fn placements_without_whole_aligned_blocks_are_refused() {
    paused_runtime().block_on(async {
        let dev: DeviceRef = Arc::new(MemDevice::new("m0", device_bytes(CHUNKS)));
        let info = array_info(CHUNKS, CHUNK_BYTES);
        let mut m = member(0, dev.clone(), 1 << 20);
        m.bitmap_offset_bytes = BITMAP_OFFSET + 1024; // a legacy placement inside a 4 KiB block
        let e = WriteIntentBitmap::create(
            vec![m],
            info.clone(),
            BitmapCreate::new(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("m0") && e.to_string().contains("not a multiple of 4 KiB"), "{e}");
        let m = member(0, dev.clone(), 4096); // the bits need 5256 bytes
        let e = WriteIntentBitmap::create(
            vec![m],
            info.clone(),
            BitmapCreate::new(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("needs 5256 bytes") && e.to_string().contains("m0"), "{e}");
        let small: DeviceRef = Arc::new(MemDevice::new("tiny", 12 * 1024));
        let m = member(0, small, 8192 - 512);
        let e =
            WriteIntentBitmap::create(vec![m], info, BitmapCreate::new(CHUNK_BYTES), Failures::default().callback())
                .await
                .unwrap_err();
        assert!(e.to_string().contains("beyond the device"), "{e}");
    });
}
