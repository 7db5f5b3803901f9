//! Unit tests of the pool runtime on RAM devices (integration tests: `tests/pool_*.rs`).

use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{
    BlockDevice, BlockDeviceExt, DeviceRef, FaultyDevice, MemDevice, OpMask, SharedBuf, Tracer, WriteFlags, ZeroFlags,
};

use super::*;
use crate::meta::{CheckOptions, MemMetaIo, check};

const BS: u64 = 64 << 10;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn opts() -> PoolOptions {
    PoolOptions { commit_interval: Duration::ZERO, ..PoolOptions::default() }
}

struct Rig {
    pool: Pool,
    meta: Arc<MemDevice>,
    data: Arc<MemDevice>,
    tracer: Tracer,
}

async fn rig(data_blocks: u64, o: PoolOptions) -> Rig {
    let meta = Arc::new(MemDevice::new("meta", 4 << 20));
    let data = Arc::new(MemDevice::new("data", data_blocks * BS));
    let tracer = Tracer::new(64);
    let m: DeviceRef = Arc::new(tracer.wrap(meta.clone()));
    let d: DeviceRef = Arc::new(tracer.wrap(data.clone()));
    let pool = Pool::create("p", m, d, BS, o).await.unwrap();
    Rig { pool, meta, data, tracer }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mdkit_io::Rng::new(seed).fill(&mut v);
    v
}

fn meta_check_clean(meta: &MemDevice) {
    let io = MemMetaIo::from_image("img", &meta.to_image());
    let r = check(&io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
}

#[test]
fn provision_read_back_and_zeroes() {
    rt().block_on(async {
        let r = rig(64, opts()).await;
        r.pool.create_thin(1).await.unwrap();
        let v = r.pool.thin(1, 16 * BS).await.unwrap();
        assert_eq!(v.read_vec(0, 8192).await.unwrap(), vec![0u8; 8192], "unmapped reads zeroes");
        let a = pattern(1, 4096);
        v.write_slice(BS + 8192, &a, WriteFlags::NONE).await.unwrap();
        let got = v.read_vec(BS, BS as usize).await.unwrap();
        assert!(got[..8192].iter().all(|&b| b == 0), "zeroed before the write");
        assert_eq!(&got[8192..12288], &a[..]);
        assert!(got[12288..].iter().all(|&b| b == 0), "zeroed after the write");
        // A write spanning three blocks (two partial, one whole).
        let big = pattern(2, (2 * BS) as usize);
        v.write_slice(3 * BS + 4096, &big, WriteFlags::NONE).await.unwrap();
        assert_eq!(v.read_vec(3 * BS + 4096, big.len()).await.unwrap(), big);
        let st = r.pool.thin_status(1).await.unwrap();
        assert_eq!(st.mapped_blocks, 4);
        assert_eq!(st.highest_mapped_sector, Some(6 * 128 - 1));
        assert_eq!(st.to_string(), format!("{} {}", 4 * 128, 6 * 128 - 1));
        r.pool.flush().await.unwrap();
        meta_check_clean(&r.meta);
        r.pool.close().await.unwrap();
    });
}

#[test]
fn fua_to_committed_mapping_is_a_plain_fua_write() {
    rt().block_on(async {
        let r = rig(64, opts()).await;
        r.pool.create_thin(1).await.unwrap();
        let v = r.pool.thin(1, 16 * BS).await.unwrap();
        v.write_slice(0, &pattern(3, BS as usize), WriteFlags::NONE).await.unwrap();
        // The mapping is not committed: a FUA write to it commits.
        let before = r.pool.status().await.unwrap().counters.commits;
        v.write_slice(4096, &pattern(4, 4096), WriteFlags::FUA).await.unwrap();
        let after = r.pool.status().await.unwrap().counters.commits;
        assert_eq!(after, before + 1, "FUA to an uncommitted mapping commits");
        // Now committed: FUA writes touch nothing but the data device.
        r.tracer.reset();
        for i in 0..50u64 {
            v.write_slice(i * 512 * 8 % BS, &pattern(i, 4096), WriteFlags::FUA).await.unwrap();
        }
        let snap = r.tracer.snapshot();
        let meta = snap.devices.iter().find(|d| d.name == "meta").unwrap();
        let data = snap.devices.iter().find(|d| d.name == "data").unwrap();
        assert_eq!(meta.ops.write.requests + meta.ops.flush.requests, 0, "no metadata I/O on the fast path");
        assert_eq!(data.fua_writes, 50);
        assert_eq!(data.ops.flush.requests, 0);
        assert_eq!(r.pool.status().await.unwrap().counters.commits, after, "no commit on the fast path");
        assert!(v.counters().fast_writes >= 50);
    });
}

#[test]
fn snapshots_share_and_break_sharing() {
    rt().block_on(async {
        let r = rig(128, opts()).await;
        r.pool.create_thin(0).await.unwrap();
        let v0 = r.pool.thin(0, 8 * BS).await.unwrap();
        let g0 = pattern(10, (8 * BS) as usize);
        v0.write_slice(0, &g0, WriteFlags::NONE).await.unwrap();
        r.pool.create_snapshot(1, 0).await.unwrap();
        let used = r.pool.status().await.unwrap().used_data_blocks;
        assert_eq!(used, 8, "O(1) snapshot: no data copied");
        // Partial overwrite of the origin breaks sharing: copy + overlay.
        let p = pattern(11, 4096);
        v0.write_slice(2 * BS + 4096, &p, WriteFlags::NONE).await.unwrap();
        let v1 = r.pool.thin(1, 8 * BS).await.unwrap();
        assert_eq!(v1.read_vec(0, g0.len()).await.unwrap(), g0, "the snapshot keeps the old contents");
        let mut want0 = g0.clone();
        want0[(2 * BS + 4096) as usize..(2 * BS + 8192) as usize].copy_from_slice(&p);
        assert_eq!(v0.read_vec(0, want0.len()).await.unwrap(), want0);
        // Snapshot of the snapshot, then write the middle one.
        r.pool.create_snapshot(2, 1).await.unwrap();
        v1.write_slice(0, &pattern(12, BS as usize), WriteFlags::NONE).await.unwrap();
        let v2 = r.pool.thin(2, 8 * BS).await.unwrap();
        assert_eq!(v2.read_vec(0, g0.len()).await.unwrap(), g0);
        let st = r.pool.status().await.unwrap();
        assert_eq!(st.used_data_blocks, 10);
        assert_eq!(st.counters.sharing_breaks, 2);
        let list = r.pool.list().await.unwrap();
        let l0 = list.iter().find(|u| u.id == 0).unwrap();
        assert_eq!((l0.mapped_blocks, l0.exclusive_blocks, l0.shared_blocks), (8, 1, 7));
        let l2 = list.iter().find(|u| u.id == 2).unwrap();
        assert_eq!((l2.exclusive_blocks, l2.shared_blocks), (0, 8));
        assert!(matches!(r.pool.delete_thin(2).await.unwrap_err().kind, PoolErrorKind::Busy(_)));
        drop(v2);
        r.pool.delete_thin(2).await.unwrap();
        r.pool.flush().await.unwrap();
        meta_check_clean(&r.meta);
    });
}

#[test]
fn discard_unmaps_and_passes_down_after_commit() {
    rt().block_on(async {
        let r = rig(64, opts()).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        v.write_slice(0, &pattern(20, (8 * BS) as usize), WriteFlags::NONE).await.unwrap();
        r.pool.flush().await.unwrap();
        let allocated = r.data.allocated_bytes();
        assert_eq!(allocated, 8 * BS);
        // Partial blocks are ignored; blocks 2..6 are unmapped.
        v.discard(BS + 4096, 5 * BS).await.unwrap();
        assert_eq!(r.pool.thin_status(0).await.unwrap().mapped_blocks, 4);
        assert!(v.read_vec(2 * BS, (4 * BS) as usize).await.unwrap().iter().all(|&b| b == 0));
        assert_eq!(r.data.allocated_bytes(), allocated, "nothing passed down before the commit");
        r.pool.flush().await.unwrap();
        assert_eq!(r.data.allocated_bytes(), allocated - 4 * BS, "passed down after the commit");
        assert_eq!(r.pool.status().await.unwrap().counters.passdown_blocks, 4);
        // A block shared with a snapshot is unmapped but not passed down.
        r.pool.create_snapshot(1, 0).await.unwrap();
        v.discard(0, BS).await.unwrap();
        r.pool.flush().await.unwrap();
        assert_eq!(r.data.allocated_bytes(), allocated - 4 * BS);
        let v1 = r.pool.thin(1, 16 * BS).await.unwrap();
        assert_eq!(v1.read_vec(0, 4096).await.unwrap(), pattern(20, 4096));
        // write_zeroes: whole blocks unmap, partial blocks get zeroes.
        v1.write_zeroes(BS - 4096, BS + 4096, ZeroFlags::default()).await.unwrap();
        let z = v1.read_vec(0, (2 * BS) as usize).await.unwrap();
        assert_eq!(&z[..(BS - 4096) as usize], &pattern(20, (BS - 4096) as usize)[..]);
        assert!(z[(BS - 4096) as usize..].iter().all(|&b| b == 0));
        r.pool.flush().await.unwrap();
        meta_check_clean(&r.meta);
    });
}

#[test]
fn out_of_space_errors_or_queues_with_timeout() {
    rt().block_on(async {
        let r = rig(4, PoolOptions { error_if_no_space: true, ..opts() }).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        for i in 0..4 {
            v.write_slice(i * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
        }
        let e = v.write_slice(5 * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::StorageFull, "{e}");
        let st = r.pool.status().await.unwrap();
        assert!(st.to_string().contains(" out_of_data_space discard_passdown error_if_no_space - "), "{st}");
        // Writes to mapped blocks still work.
        v.write_slice(0, &[2u8; 4096], WriteFlags::FUA).await.unwrap();
        r.pool.close().await.unwrap();

        let r = rig(4, PoolOptions { no_space_timeout: Duration::from_millis(300), ..opts() }).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        v.write_slice(0, &vec![1u8; (4 * BS) as usize], WriteFlags::NONE).await.unwrap();
        let t = std::time::Instant::now();
        let e = v.write_slice(5 * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::StorageFull);
        assert!(t.elapsed() >= Duration::from_millis(300), "queued for the timeout");
        // Queued, then space comes back (discard + commit): the write completes.
        let v2 = v.clone();
        let waiter = tokio::spawn(async move { v2.write_slice(6 * BS, &[3u8; 4096], WriteFlags::NONE).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        v.discard(0, BS).await.unwrap();
        r.pool.flush().await.unwrap();
        waiter.await.unwrap().unwrap();
        assert_eq!(&v.read_vec(6 * BS, 4096).await.unwrap()[..], &[3u8; 4096][..]);
        let c = r.pool.status().await.unwrap().counters;
        assert_eq!((c.no_space_waits, c.no_space_errors), (2, 1));
    });
}

#[test]
fn low_water_shows_in_status_once_crossed_and_clears_when_space_returns() {
    rt().block_on(async {
        let r = rig(8, PoolOptions { low_water_blocks: 3, ..opts() }).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        let reached = |st: &super::PoolStatus| (st.low_water_blocks, st.low_water_reached);
        for i in 0..4 {
            v.write_slice(i * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
        }
        // 4 blocks free: above the mark.
        assert_eq!(reached(&r.pool.status().await.unwrap()), (3, false));
        v.write_slice(4 * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
        assert_eq!(reached(&r.pool.status().await.unwrap()), (3, true), "3 free <= 3, as dm-thin");
        // Freed and committed: above the mark again.
        v.discard(0, 2 * BS).await.unwrap();
        r.pool.flush().await.unwrap();
        let st = r.pool.status().await.unwrap();
        assert_eq!((st.used_data_blocks, reached(&st)), (3, (3, false)), "{st}");
        r.pool.close().await.unwrap();
    });
}

#[test]
fn low_water_events_count_crossings_and_resizes_refuse_what_dm_thin_refuses() {
    rt().block_on(async {
        let r = rig(8, PoolOptions { low_water_blocks: 3, ..opts() }).await;
        let mut ev = r.pool.low_water_events();
        assert_eq!(*ev.borrow_and_update(), 0);
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        for i in 0..6 {
            v.write_slice(i * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
        }
        assert_eq!(*ev.borrow_and_update(), 1, "one event for one crossing (3 free <= 3, then 2)");
        // A lower mark is evaluated at once (2 free, above 1) and re-arms the event.
        r.pool.set_low_water_blocks(1).await.unwrap();
        assert!(!r.pool.low_water_reached());
        v.write_slice(6 * BS, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
        assert_eq!(*ev.borrow_and_update(), 2);
        assert_eq!(r.pool.status().await.unwrap().low_water_blocks, 1);

        // A RAM device does not grow: beyond it, and shrinking, are refused; equal is a no-op.
        let e = r.pool.resize_data_to(9).await.unwrap_err().to_string();
        assert!(e.contains("holds 8 blocks"), "{e}");
        let e = r.pool.resize_data_to(4).await.unwrap_err().to_string();
        assert!(e.contains("cannot shrink"), "{e}");
        assert_eq!(r.pool.resize_data_to(8).await.unwrap(), Resized { old_blocks: 8, new_blocks: 8 });
        let total = r.pool.status().await.unwrap().total_metadata_blocks;
        assert_eq!(r.pool.resize_metadata(None).await.unwrap(), Resized { old_blocks: total, new_blocks: total });
        assert!(r.pool.resize_metadata(Some(total + 1)).await.is_err(), "beyond the device");
        assert!(r.pool.resize_metadata(Some(total - 1)).await.is_err(), "no shrinking");
        assert_eq!(r.pool.mode(), PoolMode::ReadWrite, "refusals change nothing");
        drop(v);
        r.pool.close().await.unwrap();
        meta_check_clean(&r.meta);
    });
}

#[test]
fn out_of_range_io_is_refused_and_changes_nothing() {
    rt().block_on(async {
        let r = rig(16, opts()).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 4 * BS).await.unwrap();
        let before = (r.meta.to_image(), r.data.to_image());
        for (off, len) in [(4 * BS, 512u64), (4 * BS - 512, 1024), (100, 512), (0, 100)] {
            let e = v.write_slice(off, &vec![1u8; len as usize], WriteFlags::NONE).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{off}+{len}: {e}");
            let e = v.read_vec(off, len as usize).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        }
        assert_eq!(v.discard(4 * BS, BS).await.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(
            v.write_zeroes(u64::MAX - 511, 512, ZeroFlags::default()).await.unwrap_err().kind(),
            std::io::ErrorKind::InvalidInput
        );
        r.pool.flush().await.unwrap();
        assert!(before.0 == r.meta.to_image() && before.1 == r.data.to_image(), "nothing changed");
        assert!(r.pool.thin(9, BS).await.is_err(), "no such device");
        assert!(r.pool.thin(0, 1000).await.is_err(), "size not a multiple of the logical block");
    });
}

#[test]
fn metadata_write_error_fails_the_pool_and_sets_needs_check() {
    rt().block_on(async {
        let meta = Arc::new(MemDevice::new("meta", 4 << 20));
        let data: DeviceRef = Arc::new(MemDevice::new("data", 32 * BS));
        let faulty = FaultyDevice::new(meta.clone());
        let fh = faulty.handle();
        let pool = Pool::create("p", Arc::new(faulty), data, BS, opts()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v = pool.thin(0, 8 * BS).await.unwrap();
        let a = pattern(30, BS as usize);
        v.write_slice(0, &a, WriteFlags::FUA).await.unwrap();
        v.write_slice(BS, &a, WriteFlags::NONE).await.unwrap();
        // Every metadata write except the superblock's fails: the commit fails, the pool
        // fails, and NEEDS_CHECK still reaches the superblock.
        let id = fh.fail_range(OpMask::WRITE, 4096, 1 << 40);
        let e = v.flush().await.unwrap_err();
        assert!(e.to_string().contains("metadata"), "{e}");
        assert_eq!(pool.mode(), PoolMode::Failed);
        let e = v.write_slice(0, &a, WriteFlags::NONE).await.unwrap_err();
        assert!(e.to_string().contains("needs_check"), "{e}");
        assert_eq!(v.read_vec(0, a.len()).await.unwrap(), a, "committed data still reads");
        let st = pool.status().await.unwrap();
        assert_eq!(st.to_string(), "Fail");
        assert!(st.needs_check, "{st:?}");
        fh.remove(id);
        drop(v);
        assert!(pool.close().await.is_err(), "the final commit of a failed pool fails");
        let data: DeviceRef = Arc::new(MemDevice::new("data", 32 * BS));
        let p2 = Pool::open("p", meta.clone(), data, opts()).await.unwrap();
        assert_eq!(p2.mode(), PoolMode::ReadOnly, "NEEDS_CHECK on disk: read-only");
        let v = p2.thin(0, 8 * BS).await.unwrap();
        assert_eq!(v.read_vec(0, a.len()).await.unwrap(), vec![0u8; a.len()], "data device was replaced by zeroes");
        assert_eq!(p2.thin_status(0).await.unwrap().mapped_blocks, 1, "only the committed mapping");
    });
}

/// A data-device flush that fails once (QA: a buffered data device whose writeback failed;
/// the kernel then reports the error to one fdatasync only): the mappings of the open
/// transaction may point at data that never reached the device, so they are never committed.
/// As dm-thin's failed pre-commit flush: the transaction is aborted, NEEDS_CHECK set, the pool
/// fails, and a later flush (which the device would now pass) does not commit it after all.
#[test]
fn a_failed_data_flush_fails_the_pool_and_never_commits_the_transaction() {
    rt().block_on(async {
        let meta = Arc::new(MemDevice::new("meta", 4 << 20));
        let faulty = FaultyDevice::new(MemDevice::new("data", 32 * BS));
        let fh = faulty.handle();
        let pool = Pool::create("p", meta.clone(), Arc::new(faulty), BS, opts()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v = pool.thin(0, 8 * BS).await.unwrap();
        let a = pattern(31, BS as usize);
        v.write_slice(0, &a, WriteFlags::FUA).await.unwrap();
        v.write_slice(BS, &a, WriteFlags::NONE).await.unwrap();
        let id = fh.add(mdkit_io::FaultRule::error(OpMask::FLUSH, None).times(1));
        let e = v.flush().await.unwrap_err();
        assert!(e.to_string().contains("data device") && e.to_string().contains("flush failed"), "{e}");
        assert_eq!(fh.fired(id), Some(1));
        assert_eq!(pool.mode(), PoolMode::Failed, "{}", pool.mode_reason());
        assert!(pool.mode_reason().contains("flush failed"), "{}", pool.mode_reason());
        v.flush().await.expect_err("a failed pool commits nothing");
        assert_eq!(v.read_vec(0, a.len()).await.unwrap(), a, "committed data still reads");
        drop(v);
        assert!(pool.close().await.is_err(), "the final commit of a failed pool fails");
        let data: DeviceRef = Arc::new(MemDevice::new("data", 32 * BS));
        let p2 = Pool::open("p", meta.clone(), data, opts()).await.unwrap();
        assert_eq!(p2.mode(), PoolMode::ReadOnly, "NEEDS_CHECK on disk: read-only");
        assert_eq!(p2.thin_status(0).await.unwrap().mapped_blocks, 1, "only the mapping committed before");
    });
}

#[test]
fn needs_check_pool_opens_read_only_with_a_clear_status() {
    rt().block_on(async {
        let r = rig(16, opts()).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 4 * BS).await.unwrap();
        v.write_slice(0, &pattern(40, 4096), WriteFlags::FUA).await.unwrap();
        drop(v);
        let md = r.pool.metadata();
        // Metadata I/O runs on plain threads (the engine refuses runtime threads).
        std::thread::spawn(move || md.write().set_needs_check()).join().unwrap().unwrap();
        r.pool.close().await.unwrap();
        let data: DeviceRef = r.data.clone();
        let p = Pool::open("p", r.meta.clone(), data, opts()).await.unwrap();
        assert_eq!(p.mode(), PoolMode::ReadOnly);
        let st = p.status().await.unwrap();
        assert!(st.needs_check && st.mode_reason.contains("NEEDS_CHECK"), "{st:?}");
        assert!(st.to_string().contains(" ro discard_passdown queue_if_no_space needs_check "), "{st}");
        let v = p.thin(0, 4 * BS).await.unwrap();
        assert_eq!(v.read_vec(0, 4096).await.unwrap(), pattern(40, 4096));
        let e = v.write_slice(0, &[0u8; 512], WriteFlags::NONE).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ReadOnlyFilesystem);
        assert!(p.create_thin(5).await.is_err());
    });
}

#[test]
fn create_refuses_an_existing_pool_and_open_refuses_a_blank_device() {
    rt().block_on(async {
        let r = rig(16, opts()).await;
        r.pool.close().await.unwrap();
        let e = Pool::create("p", r.meta.clone(), r.data.clone(), BS, opts()).await.unwrap_err();
        assert!(e.to_string().contains("already holds a thin pool"), "{e}");
        let blank: DeviceRef = Arc::new(MemDevice::new("blank", 1 << 20));
        let e = Pool::open("p", blank, r.data.clone(), opts()).await.unwrap_err();
        assert_eq!(e.corrupt_block(), Some(0), "{e}");
        let e = Pool::create("p", Arc::new(MemDevice::new("m", 1 << 20)), r.data.clone(), 96 << 10, opts())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("multiple of 64 KiB"), "{e}");
    });
}

#[test]
fn concurrent_first_writes_to_one_block_allocate_once() {
    rt().block_on(async {
        let r = rig(64, opts()).await;
        r.pool.create_thin(0).await.unwrap();
        let v = r.pool.thin(0, 16 * BS).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..16u64 {
            let v = v.clone();
            tasks.push(tokio::spawn(async move {
                v.write(i * 4096, SharedBuf::from_slice(&[i as u8 + 1; 4096]), WriteFlags::NONE).await
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let got = v.read_vec(0, BS as usize).await.unwrap();
        for i in 0..16usize {
            assert!(got[i * 4096..(i + 1) * 4096].iter().all(|&b| b == i as u8 + 1), "sector {i} lost");
        }
        let st = r.pool.status().await.unwrap();
        assert_eq!(st.used_data_blocks, 1);
        assert_eq!(st.counters.provisions, 1);
    });
}
