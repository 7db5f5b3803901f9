//! Running out of metadata space. A transaction that shadows much of a mapping tree (random
//! overwrites within one commit interval) frees as many blocks as it allocates, and the freed
//! ones are not reusable before the commit. The engine used to count them as free, so its
//! reserve check passed while the allocation after it found nothing: the operation failed
//! half-way, poisoned the transaction and failed the pool (NEEDS_CHECK) with half of the
//! metadata free. Now:
//! - the engine refuses an operation up front (nothing changed, not poisoned) once only the
//!   reserve is allocatable, counting blocks freed this transaction as in use until commit;
//! - the pool commits to reuse the freed blocks and retries; only when the metadata is really
//!   full does it go read-only (out of metadata space, no NEEDS_CHECK), and growing the
//!   metadata makes it read-write again. thin_check accepts the metadata throughout.

use crate::common;
use crate::pool_util;

use std::sync::Arc;

use common::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, WriteFlags};
use mdkit_thin::meta::{CheckOptions, FormatOptions, MetaError, OpenOptions, ThinMetadata, check};
use mdkit_thin::pool::{Pool, PoolMode, PoolOptions};
use pool_util::*;

const SEED: u64 = 0x5eed_0003;

/// Random provision / overwrite / unmap churn over a wide range with a commit every
/// `ops_per_commit` operations, until an operation is refused even right after a commit.
/// Every refusal must be `OutOfMetadataSpace` with the transaction intact.
fn churn_until_full(md: &mut ThinMetadata, rng: &mut Rng, vblocks: u64, ops_per_commit: u64) -> u64 {
    let mut ops = 0u64;
    let mut since_commit = 0u64;
    loop {
        let vb = rng.below(vblocks);
        let r = match rng.below(10) {
            0 => md.remove(0, vb).map(|_| ()),
            _ => md.provision(0, vb).map(|_| ()),
        };
        match r {
            Ok(()) => {
                ops += 1;
                since_commit += 1;
            }
            Err(MetaError::OutOfMetadataSpace { .. }) => {
                assert!(md.is_poisoned().is_none(), "op {ops}: refused up front, yet poisoned: {:?}", md.is_poisoned());
                if since_commit == 0 {
                    return ops;
                }
                // Blocks freed by this transaction become allocatable at commit.
                md.commit().unwrap();
                since_commit = 0;
                continue;
            }
            Err(e) => panic!("op {ops} (seed {SEED:#x}): {e}; status {:?}", md.status()),
        }
        if since_commit >= ops_per_commit {
            md.commit().unwrap();
            since_commit = 0;
        }
    }
}

#[test]
fn engine_refuses_up_front_when_freed_blocks_fill_the_transaction() {
    // 2 MiB of metadata used (512 blocks), on a 4 MiB file so it can grow; 64 GiB of data.
    let (path, io) = meta_file("metadata-space.meta", 4 << 20);
    let mut md = ThinMetadata::format_with(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1 << 20, metadata_nr_blocks: Some(512) },
        OpenOptions::default(),
    )
    .unwrap();
    md.create_thin(0).unwrap();
    md.commit().unwrap();
    let mut rng = Rng::new(SEED);
    let ops = churn_until_full(&mut md, &mut rng, 1 << 20, 3000);
    let st = md.status();
    eprintln!("{ops} operations until full; status {st:?}");
    assert_eq!(md.free_metadata_blocks(), 0, "refused only at the reserve");
    assert!(
        st.allocated_metadata_blocks * 100 >= st.total_metadata_blocks * 85,
        "full at {} of {} metadata blocks: blocks were lost to the accounting",
        st.allocated_metadata_blocks,
        st.total_metadata_blocks
    );
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    assert_thin_check_clean(&path, "metadata refused at the reserve");

    // Growing the metadata makes room again.
    md.resize_metadata(1024).unwrap();
    md.commit().unwrap();
    let before = md.device_details(0).unwrap().mapped_blocks;
    for _ in 0..500 {
        md.provision(0, rng.below(1 << 20)).unwrap();
    }
    md.commit().unwrap();
    assert!(md.device_details(0).unwrap().mapped_blocks > before);
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    assert_thin_check_clean(&path, "metadata grown after running out");
}

#[test]
fn pool_out_of_metadata_space_goes_read_only_and_recovers_after_growth() {
    const META_BYTES: u64 = 512 << 10;
    const DATA_BLOCKS: u64 = 65_536;
    let meta = fresh_file("metadata-space-pool.meta", META_BYTES);
    let data = fresh_file("metadata-space-pool.data", DATA_BLOCKS * BLOCK_BYTES);
    let rt = rt();
    rt.block_on(async {
        let meta_dev = Arc::new(FileDevice::open(&meta, FileOptions::default()).unwrap());
        let (m, d): (DeviceRef, DeviceRef) = (meta_dev.clone(), file_dev(&data));
        // No periodic commit: only the flushes below and the pool's own reaction to the
        // metadata filling up commit, so the run is deterministic.
        let opts = PoolOptions { zero_new_blocks: false, ..quiet_opts() };
        let pool = Pool::create("oms", m, d, BLOCK_BYTES, opts).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v = pool.thin(0, DATA_BLOCKS * BLOCK_BYTES).await.unwrap();
        let mut rng = Rng::new(SEED);
        let mut written = 0u64;
        let err = loop {
            let vb = rng.below(DATA_BLOCKS);
            match v.write_slice(vb * BLOCK_BYTES, &pattern(vb, vb * BLOCK_BYTES, 4096), WriteFlags::NONE).await {
                Ok(()) => written += 1,
                Err(e) => break e,
            }
            // A client's flush now and then: the next writes shadow a committed tree.
            if written.is_multiple_of(1500)
                && let Err(e) = v.flush().await
            {
                break e;
            }
            assert!(written < DATA_BLOCKS, "the metadata never filled up");
        };
        let st = pool.status().await.unwrap();
        eprintln!("{written} writes, then: {err}; status {st:?}");
        assert_eq!(st.mode, PoolMode::ReadOnly, "out of metadata space, not failed: {}", st.mode_reason);
        assert!(!st.needs_check, "running out of metadata space is not damage");
        let allocated = pool.metadata().read().status().allocated_metadata_blocks;
        assert!(
            allocated * 100 >= st.total_metadata_blocks * 85,
            "read-only with {allocated} of {} metadata blocks allocated",
            st.total_metadata_blocks
        );
        assert!(v.write_slice(0, &pattern(1, 0, 4096), WriteFlags::NONE).await.is_err(), "read-only");

        meta_dev.grow_file(4 * META_BYTES).unwrap();
        pool.resize_metadata(None).await.unwrap();
        let st = pool.status().await.unwrap();
        assert_eq!(st.mode, PoolMode::ReadWrite, "{}", st.mode_reason);
        for _ in 0..200 {
            let vb = rng.below(DATA_BLOCKS);
            v.write_slice(vb * BLOCK_BYTES, &pattern(vb, vb * BLOCK_BYTES, 4096), WriteFlags::NONE).await.unwrap();
        }
        v.flush().await.unwrap();
        drop(v);
        pool.close().await.unwrap();
    });
    let io = mdkit_thin::meta::FileMetaIo::open(&meta, false).unwrap();
    let r = check(&io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    assert_thin_check_clean(&meta, "pool after running out of metadata space and growing");
}

#[test]
fn format_refuses_a_data_device_its_metadata_cannot_map_before_writing() {
    use mdkit_thin::meta::MemMetaIo;
    use mdkit_thin::meta::sm_format::MAX_METADATA_BLOCKS;
    use std::sync::atomic::{AtomicU64, Ordering};
    // (metadata blocks, data blocks): 64 GiB of data in 64 KiB blocks needs 66 bitmap blocks,
    // beyond a 64-block metadata device; an 8 PiB data device needs ~8.5M, beyond the largest
    // metadata device (unchecked, that one allocated GiBs of RAM building them: it goes last).
    for (meta_blocks, data_blocks) in [(64, 1u64 << 20), (MAX_METADATA_BLOCKS + 1000, 1 << 37)] {
        let mem = Arc::new(MemMetaIo::new("too-small.meta", meta_blocks));
        let writes = Arc::new(AtomicU64::new(0));
        let w = writes.clone();
        mem.set_hook(Some(Box::new(move |_| {
            w.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })));
        let r = ThinMetadata::format(
            mem.clone(),
            FormatOptions { data_block_size_sectors: 128, nr_data_blocks: data_blocks, metadata_nr_blocks: None },
        );
        let e = r.expect_err("formatted a pool whose data space map cannot fit");
        eprintln!("{meta_blocks} metadata blocks, {data_blocks} data blocks: {e}");
        assert!(matches!(e, MetaError::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("too-small.meta"), "names the device: {e}");
        assert_eq!(writes.load(Ordering::SeqCst), 0, "nothing written");
    }
}

/// Provisions in flight when the metadata fills up: the commit that drops and retakes their
/// data-block reservations must neither lose one nor drop one twice (that failed the pool
/// with "reference dropped from free data block").
#[test]
fn pool_with_writes_in_flight_runs_out_of_metadata_space_cleanly() {
    const DATA_BLOCKS: u64 = 65_536;
    const WRITERS: u64 = 32;
    let meta = fresh_file("metadata-space-inflight.meta", 512 << 10);
    let data = fresh_file("metadata-space-inflight.data", DATA_BLOCKS * BLOCK_BYTES);
    let rt = rt();
    rt.block_on(async {
        let meta_dev = Arc::new(FileDevice::open(&meta, FileOptions::default()).unwrap());
        let (m, d): (DeviceRef, DeviceRef) = (meta_dev.clone(), file_dev(&data));
        // Commits while provisions are in flight, as the periodic commit makes them.
        let opts = PoolOptions {
            zero_new_blocks: false,
            commit_interval: std::time::Duration::from_millis(2),
            ..PoolOptions::default()
        };
        let pool = Pool::create("oms2", m, d, BLOCK_BYTES, opts).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v = pool.thin(0, DATA_BLOCKS * BLOCK_BYTES).await.unwrap();
        let mut tasks = Vec::new();
        for t in 0..WRITERS {
            let v = v.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(SEED + t);
                for n in 1u64.. {
                    let vb = rng.below(DATA_BLOCKS);
                    let w = v.write_slice(vb * BLOCK_BYTES, &pattern(vb, vb * BLOCK_BYTES, 4096), WriteFlags::NONE);
                    if w.await.is_err() || (t == 0 && n.is_multiple_of(200) && v.flush().await.is_err()) {
                        return n;
                    }
                }
                unreachable!()
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let st = pool.status().await.unwrap();
        assert_eq!(st.mode, PoolMode::ReadOnly, "out of metadata space, not failed: {}", st.mode_reason);
        assert!(!st.needs_check);
        meta_dev.grow_file(2 << 20).unwrap();
        pool.resize_metadata(None).await.unwrap();
        assert_eq!(pool.status().await.unwrap().mode, PoolMode::ReadWrite);
        v.write_slice(0, &pattern(1, 0, 4096), WriteFlags::FUA).await.unwrap();
        drop(v);
        pool.close().await.unwrap();
    });
    let io = mdkit_thin::meta::FileMetaIo::open(&meta, false).unwrap();
    let r = check(&io, &CheckOptions::default());
    assert!(r.is_clean(), "{r}");
    assert_thin_check_clean(&meta, "pool after running out of metadata space with writes in flight");
}
