//! Loading a bitmap and what it tells resync and recovery (md_bitmap_load rules), and bitmap
//! I/O errors:
//! - after an unclean shutdown only dirty chunks from `resync_offset` on need sync; after a
//!   clean one none do (the bits just clear lazily); `end_sync` hands chunks back to clearing;
//! - a stale bitmap (events behind the array) makes every chunk needed and is rewritten so;
//! - degraded at load: every dirty chunk is kept needed for a re-add unless
//!   `events_cleared == events`;
//! - load takes the union of the members' bits and rewrites members that differ or whose copy
//!   is damaged; no valid copy, or a foreign uuid everywhere, is refused with the reason;
//! - a bitmap write error fails that member through the callback and the round completes on the
//!   others; when no member takes it, `start_write` fails and holds nothing; a flush error
//!   during a clear sweep fails the member and clears nothing.

use crate::bitmap_support;

use std::sync::Arc;
use std::time::Duration;

use bitmap_support::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FaultyDevice, MemDevice, OpMask};
use mdkit_md::array::bitmap::{BitmapCreate, WriteIntentBitmap};
use mdkit_md::format::bitmap::{BitmapGeometry, BitmapSuper, count_dirty, set_bit, test_bit};

const CHUNK_BYTES: u32 = 64 << 10;
const CHUNKS: u64 = 1000;

fn geo() -> BitmapGeometry {
    BitmapGeometry::new(CHUNK_BYTES, CHUNKS * chunk_sectors(CHUNK_BYTES)).unwrap()
}

fn mems(n: usize) -> Vec<DeviceRef> {
    (0..n).map(|i| Arc::new(MemDevice::new(format!("m{i}"), device_bytes(CHUNKS))) as DeviceRef).collect()
}

fn members_of(devs: &[DeviceRef]) -> Vec<mdkit_md::array::bitmap::BitmapMember> {
    devs.iter().enumerate().map(|(i, d)| member(i as u32, d.clone(), 64 << 10)).collect()
}

/// A bitmap with `dirty` chunks written and left dirty (a crash: dropped without shutdown).
async fn crashed_with(devs: &[DeviceRef], dirty: &[u64]) {
    let params = BitmapCreate { all_dirty: false, ..BitmapCreate::new(CHUNK_BYTES) };
    let bm = WriteIntentBitmap::create(
        members_of(devs),
        array_info(CHUNKS, CHUNK_BYTES),
        params,
        Failures::default().callback(),
    )
    .await
    .unwrap();
    for &c in dirty {
        bm.start_write(chunk_range(c, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(c, CHUNK_BYTES), true);
    }
}

async fn area(dev: &DeviceRef) -> Vec<u8> {
    dev.read_vec(BITMAP_OFFSET, 4096).await.unwrap()
}

fn cs() -> u64 {
    chunk_sectors(CHUNK_BYTES)
}

#[test]
fn unclean_load_needs_only_dirty_chunks_from_resync_offset() {
    paused_runtime().block_on(async {
        let devs = mems(2);
        crashed_with(&devs, &[1, 50, 900]).await;
        let mut info = array_info(CHUNKS, CHUNK_BYTES);
        info.resync_offset_sectors = 0;
        let bm =
            WriteIntentBitmap::load(members_of(&devs), info.clone(), Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks(), vec![1, 50, 900]);
        assert!(bm.chunk_needs_sync(50 * cs() + 3));
        assert!(!bm.chunk_needs_sync(51 * cs()));
        assert!(!bm.chunk_needs_sync(CHUNKS * cs() + 8), "beyond the bitmap");
        // Resync of chunk 50 only half done: still needed; whole: handed back to clearing.
        bm.end_sync(50 * cs()..50 * cs() + cs() / 2);
        assert!(bm.chunk_needs_sync(50 * cs()));
        bm.end_sync(0..100 * cs());
        assert_eq!(bm.needed_chunks(), vec![900]);
        assert_eq!(bm.sweep_now().await.unwrap(), 2, "1 and 50 clear; 900 is still needed");
        assert_eq!(bm.dirty_chunks(), vec![900]);
        drop(bm);
        // resync_offset in the middle: only chunks ending at or after it (kernel rule).
        info.resync_offset_sectors = 60 * cs();
        let bm =
            WriteIntentBitmap::load(members_of(&devs), info.clone(), Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks(), vec![900]);
        drop(bm);
        // Clean: nothing needed, the bits clear lazily.
        info.resync_offset_sectors = u64::MAX;
        let bm = WriteIntentBitmap::load(members_of(&devs), info, Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks(), Vec::<u64>::new());
        assert_eq!(bm.dirty_chunks(), vec![900]);
        bm.set_attribute("time_base", "1").unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new());
        assert_eq!(count_dirty(&area(&devs[0]).await, &geo()), 0);
    });
}

#[test]
fn a_stale_bitmap_needs_everything() {
    paused_runtime().block_on(async {
        let devs = mems(2);
        crashed_with(&devs, &[7]).await; // bitmap events 10
        let mut info = array_info(CHUNKS, CHUNK_BYTES);
        info.events = 12; // md superblocks went ahead without the bitmap
        let bm = WriteIntentBitmap::load(members_of(&devs), info, Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks().len() as u64, CHUNKS);
        assert_eq!(bm.events_cleared(), 12);
        for d in &devs {
            let a = area(d).await;
            assert_eq!(count_dirty(&a, &geo()), CHUNKS, "every bit written set on {}", d.name());
            let h = BitmapSuper::decode(&a).unwrap();
            assert_eq!((h.events, h.events_cleared), (12, 12));
        }
        assert_eq!(bm.sweep_now().await.unwrap(), 0, "needed chunks are never cleared");
    });
}

#[test]
fn degraded_load_keeps_dirty_chunks_for_a_re_add() {
    paused_runtime().block_on(async {
        let devs = mems(2);
        crashed_with(&devs, &[3, 4]).await;
        // events 10, events_cleared 10 on disk. A degraded array whose md events moved on.
        let mut info = array_info(CHUNKS, CHUNK_BYTES);
        info.degraded = true;
        info.events = 10;
        let bm = WriteIntentBitmap::load(members_of(&devs[..1]), info.clone(), Failures::default().callback())
            .await
            .unwrap();
        assert_eq!(bm.needed_chunks(), Vec::<u64>::new(), "events_cleared == events: the clean rule applies");
        drop(bm);
        // The bitmap header says events 10: write a newer one (events 11, cleared 10).
        let bm = WriteIntentBitmap::load(members_of(&devs[..1]), info.clone(), Failures::default().callback())
            .await
            .unwrap();
        bm.update_superblock(11).await.unwrap();
        drop(bm);
        info.events = 11;
        let bm = WriteIntentBitmap::load(members_of(&devs[..1]), info, Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks(), vec![3, 4], "kept for the missing member");
        assert!(bm.can_readd(10) && !bm.can_readd(9));
        assert_eq!(bm.sweep_now().await.unwrap(), 0, "degraded: nothing clears");
    });
}

#[test]
fn load_takes_the_union_and_repairs_members() {
    paused_runtime().block_on(async {
        let devs = mems(3);
        crashed_with(&devs, &[]).await;
        // A crash between the members' page writes: m0 has chunk 5, m1 chunk 7; m2's copy is
        // destroyed.
        let mut a0 = area(&devs[0]).await;
        set_bit(&mut a0, &geo(), 5, true);
        devs[0].write_slice(BITMAP_OFFSET, &a0, mdkit_io::WriteFlags::FUA).await.unwrap();
        let mut a1 = area(&devs[1]).await;
        set_bit(&mut a1, &geo(), 7, true);
        devs[1].write_slice(BITMAP_OFFSET, &a1, mdkit_io::WriteFlags::FUA).await.unwrap();
        devs[2].write_slice(BITMAP_OFFSET, &[0u8; 4096], mdkit_io::WriteFlags::FUA).await.unwrap();
        let mut info = array_info(CHUNKS, CHUNK_BYTES);
        info.resync_offset_sectors = 0;
        let bm =
            WriteIntentBitmap::load(members_of(&devs), info.clone(), Failures::default().callback()).await.unwrap();
        assert_eq!(bm.needed_chunks(), vec![5, 7]);
        for d in &devs {
            let a = area(d).await;
            assert!(BitmapSuper::decode(&a).is_ok(), "{} repaired", d.name());
            assert_eq!((test_bit(&a, &geo(), 5), test_bit(&a, &geo(), 7)), (Some(true), Some(true)), "{}", d.name());
        }
        drop(bm);
        // No valid copy anywhere.
        for d in &devs {
            d.write_slice(BITMAP_OFFSET, &[0u8; 4096], mdkit_io::WriteFlags::FUA).await.unwrap();
        }
        let e =
            WriteIntentBitmap::load(members_of(&devs), info.clone(), Failures::default().callback()).await.unwrap_err();
        assert!(
            e.to_string().contains("no member holds a valid bitmap") && e.to_string().contains("bad bitmap magic"),
            "{e}"
        );
        // A bitmap of another array.
        let other = devs[..1].to_vec();
        let mut foreign = array_info(CHUNKS, CHUNK_BYTES);
        foreign.set_uuid = [9; 16];
        WriteIntentBitmap::create(
            members_of(&other),
            foreign,
            BitmapCreate::new(CHUNK_BYTES),
            Failures::default().callback(),
        )
        .await
        .unwrap();
        let e = WriteIntentBitmap::load(members_of(&other), info, Failures::default().callback()).await.unwrap_err();
        assert!(e.to_string().contains("does not match the array uuid"), "{e}");
    });
}

#[test]
fn a_member_that_fails_a_bitmap_write_is_failed_and_the_round_completes() {
    paused_runtime().block_on(async {
        let faulty: Vec<Arc<FaultyDevice<MemDevice>>> = (0..3)
            .map(|i| Arc::new(FaultyDevice::new(MemDevice::new(format!("m{i}"), device_bytes(CHUNKS)))))
            .collect();
        let devs: Vec<DeviceRef> = faulty.iter().map(|f| f.clone() as DeviceRef).collect();
        let failures = Failures::default();
        let params = BitmapCreate { all_dirty: false, ..BitmapCreate::new(CHUNK_BYTES) };
        let bm =
            WriteIntentBitmap::create(members_of(&devs), array_info(CHUNKS, CHUNK_BYTES), params, failures.callback())
                .await
                .unwrap();
        faulty[1].handle().fail_range(OpMask::WRITE, BITMAP_OFFSET, 4096);
        bm.start_write(chunk_range(9, CHUNK_BYTES)).await.expect("the other members took the round");
        assert_eq!(failures.slots(), vec![1]);
        assert!(failures.0.lock()[0].1.contains("bitmap page 0"), "{:?}", failures.0.lock());
        for i in [0, 2] {
            assert_eq!(test_bit(&area(&devs[i]).await, &geo(), 9), Some(true), "m{i}");
        }
        bm.start_write(chunk_range(10, CHUNK_BYTES)).await.unwrap();
        assert_eq!(failures.slots(), vec![1], "a failed member gets no more bitmap I/O (reported once)");
        // Everyone fails: start_write fails and holds nothing.
        for f in &faulty {
            f.handle().pull();
        }
        let e = bm.start_write(chunk_range(11, CHUNK_BYTES)).await.unwrap_err();
        assert!(e.to_string().contains("could not be written to any member"), "{e}");
        assert_eq!(failures.slots(), vec![1, 0, 2]);
        bm.end_write(chunk_range(9, CHUNK_BYTES), true);
        bm.end_write(chunk_range(10, CHUNK_BYTES), true);
        assert_eq!(bm.stats().idle_dirty_chunks, 2, "chunk 11 holds no pending write");
    });
}

#[test]
fn a_flush_error_in_a_sweep_fails_the_member_and_clears_nothing() {
    paused_runtime().block_on(async {
        let faulty: Vec<Arc<FaultyDevice<MemDevice>>> = (0..2)
            .map(|i| Arc::new(FaultyDevice::new(MemDevice::new(format!("m{i}"), device_bytes(CHUNKS)))))
            .collect();
        let devs: Vec<DeviceRef> = faulty.iter().map(|f| f.clone() as DeviceRef).collect();
        let failures = Failures::default();
        let params = BitmapCreate { all_dirty: false, ..BitmapCreate::new(CHUNK_BYTES) };
        let bm =
            WriteIntentBitmap::create(members_of(&devs), array_info(CHUNKS, CHUNK_BYTES), params, failures.callback())
                .await
                .unwrap();
        bm.start_write(chunk_range(2, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(2, CHUNK_BYTES), true);
        let rule = faulty[0].handle().fail_after(OpMask::FLUSH, 0);
        assert!(bm.sweep_now().await.is_err());
        assert_eq!(failures.slots(), vec![0]);
        assert_eq!(bm.dirty_chunks(), vec![2]);
        assert_eq!(test_bit(&area(&devs[1]).await, &geo(), 2), Some(true));
        faulty[0].handle().remove(rule);
        // The array fails member 0 and runs degraded: still nothing clears.
        bm.set_degraded(true);
        assert_eq!(bm.sweep_now().await.unwrap(), 0);
        assert_eq!(bm.dirty_chunks(), vec![2]);
    });
}

#[test]
fn shutdown_leaves_a_clean_bitmap_that_loads_clean() {
    paused_runtime().block_on(async {
        let devs = mems(2);
        let params = BitmapCreate::new(CHUNK_BYTES); // all dirty, as mdadm creates it
        let bm = WriteIntentBitmap::create(
            members_of(&devs),
            array_info(CHUNKS, CHUNK_BYTES),
            params,
            Failures::default().callback(),
        )
        .await
        .unwrap();
        assert_eq!(bm.dirty_chunks().len() as u64, CHUNKS);
        assert_eq!(bm.needed_chunks(), Vec::<u64>::new(), "created clean (resync_offset MAX): nothing needed");
        bm.start_write(chunk_range(1, CHUNK_BYTES)).await.unwrap();
        bm.end_write(chunk_range(1, CHUNK_BYTES), true);
        bm.update_superblock(11).await.unwrap();
        bm.shutdown().await.unwrap();
        for d in &devs {
            let a = area(d).await;
            assert_eq!(count_dirty(&a, &geo()), 0);
            assert_eq!(BitmapSuper::decode(&a).unwrap().events, 11);
        }
        let mut info = array_info(CHUNKS, CHUNK_BYTES);
        info.events = 11;
        info.resync_offset_sectors = 0;
        let bm = WriteIntentBitmap::load(members_of(&devs), info, Failures::default().callback()).await.unwrap();
        assert_eq!(bm.dirty_chunks(), Vec::<u64>::new());
    });
}
