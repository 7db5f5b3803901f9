//! External origins (dm-thin's `thin <pool> <id> <origin>`): a thin volume whose unmapped blocks
//! read from a read-only file. Checked against a byte model of the volume:
//! - reads of unmapped blocks come from the origin, past its end (which is not block-aligned
//!   here) zeroes; reads across mapped and unmapped blocks join both;
//! - a partial write to an unmapped block copies the origin's block first; a whole-block write
//!   reads nothing from the origin (counted by a tracer around it); writes past the origin
//!   and into the block the origin ends in;
//! - discard unmaps (the origin shows again), write-zeroes over the origin writes zeroes;
//! - block status reports everything below the origin's end as data;
//! - a snapshot opened with the same origin reads the same; the reopened pool too, and
//!   without the origin its unmapped blocks read zeroes (the origin is not in the metadata);
//! - the origin file is byte-identical afterwards and the metadata passes thin_check.
//!
//! The kernel side is in `external_origin_lab.rs`.

use crate::common;
use crate::pool_util;

use std::sync::Arc;

use common::*;
use mdkit_io::{
    BlockDevice, BlockDeviceExt, DeviceRef, ExtentFlags, FileDevice, FileOptions, IoOp, Tracer, WriteFlags, ZeroFlags,
};
use mdkit_thin::pool::Pool;
use pool_util::*;

const VOL_BLOCKS: u64 = 16;
const VOL_BYTES: u64 = VOL_BLOCKS * BLOCK_BYTES;
/// Ten blocks and 8 KiB: block 10 straddles the origin's end.
const ORIGIN_BYTES: u64 = 10 * BLOCK_BYTES + 8192;

/// The origin file, filled with a pattern (tag 9).
pub fn origin_file(name: &str) -> (std::path::PathBuf, Vec<u8>) {
    let path = scratch_path(name);
    let content = pattern(9, 0, ORIGIN_BYTES as usize);
    std::fs::write(&path, &content).unwrap();
    (path, content)
}

fn read_only(path: &std::path::Path) -> FileDevice {
    FileDevice::open(path, FileOptions { read_only: true, ..FileOptions::default() }).unwrap()
}

/// The volume's expected bytes: the origin, zeroes past it.
fn origin_view(origin: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; VOL_BYTES as usize];
    v[..origin.len()].copy_from_slice(origin);
    v
}

async fn write(v: &impl BlockDevice, model: &mut [u8], offset: u64, data: &[u8]) {
    v.write_slice(offset, data, WriteFlags::NONE).await.unwrap();
    model[offset as usize..offset as usize + data.len()].copy_from_slice(data);
}

async fn mapped_blocks(pool: &Pool) -> Vec<u64> {
    pool.mappings(0).await.unwrap().into_iter().map(|(vb, _)| vb).collect()
}

#[test]
fn unmapped_blocks_read_the_origin_and_writes_copy_it_as_dm_thin_does() {
    let meta = fresh_file("xo.meta", 4 << 20);
    let data = fresh_file("xo.data", 64 * BLOCK_BYTES);
    let (origin_path, origin) = origin_file("xo.origin");
    let rt = rt();
    let tracer = Tracer::new(0);
    rt.block_on(async {
        let pool = Pool::create("xo", file_dev(&meta), file_dev(&data), BLOCK_BYTES, quiet_opts()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let traced: DeviceRef = Arc::new(tracer.wrap(read_only(&origin_path)));
        let v = pool.thin(0, VOL_BYTES).await.unwrap().with_external_origin(traced).unwrap();
        assert_eq!(v.external_origin().map(|o| o.1), Some(ORIGIN_BYTES));
        let mut model = origin_view(&origin);
        assert!(v.read_vec(0, VOL_BYTES as usize).await.unwrap() == model, "unwritten: the origin, then zeroes");
        let origin_reads = || tracer.snapshot().total().ops.get(IoOp::Read).bytes;

        // Partial write to an unmapped block inside the origin: the rest of it is the origin's.
        write(&v, &mut model, 2 * BLOCK_BYTES + 4096, &pattern(1, 0, 4096)).await;
        // A whole-block write reads nothing from the origin.
        let before = origin_reads();
        write(&v, &mut model, 4 * BLOCK_BYTES, &pattern(2, 0, BLOCK_BYTES as usize)).await;
        assert_eq!(origin_reads(), before, "a whole-block write copies nothing");
        // The block the origin ends in, and a block past it.
        write(&v, &mut model, 10 * BLOCK_BYTES + 32768, &pattern(3, 0, 4096)).await;
        write(&v, &mut model, 12 * BLOCK_BYTES + 512, &pattern(4, 0, 1024)).await;
        // A write across mapped and unmapped blocks (3 and 4, 5).
        write(&v, &mut model, 3 * BLOCK_BYTES + 60 * 1024, &pattern(5, 0, 80 * 1024)).await;
        assert_eq!(mapped_blocks(&pool).await, [2, 3, 4, 5, 10, 12]);
        assert!(v.read_vec(0, VOL_BYTES as usize).await.unwrap() == model, "after writes");
        // An unaligned read across the origin's end.
        let (s, n) = (10 * BLOCK_BYTES - 4096, 3 * BLOCK_BYTES as usize);
        assert!(v.read_vec(s, n).await.unwrap() == model[s as usize..s as usize + n]);

        // Block status: data up to the origin's end, then the pool's mappings.
        let ext = v.block_status(0, VOL_BYTES, 64).await.unwrap();
        assert_eq!(ext.len(), 1, "{ext:?}");
        assert_eq!((ext[0].len_bytes, ext[0].flags), (ORIGIN_BYTES, ExtentFlags::DATA));
        let rest = v.block_status(ORIGIN_BYTES, VOL_BYTES - ORIGIN_BYTES, 64).await.unwrap();
        let flags: Vec<(u64, ExtentFlags)> = rest.iter().map(|e| (e.len_bytes, e.flags)).collect();
        assert_eq!(
            flags,
            [
                (BLOCK_BYTES - 8192, ExtentFlags::DATA),
                (BLOCK_BYTES, ExtentFlags::HOLE_ZERO),
                (BLOCK_BYTES, ExtentFlags::DATA),
                (3 * BLOCK_BYTES, ExtentFlags::HOLE_ZERO)
            ]
        );

        // Discard unmaps: the origin shows again. Write-zeroes over the origin writes zeroes.
        v.discard(2 * BLOCK_BYTES, BLOCK_BYTES).await.unwrap();
        let b2 = (2 * BLOCK_BYTES) as usize..(3 * BLOCK_BYTES) as usize;
        model[b2.clone()].copy_from_slice(&origin[b2]);
        v.write_zeroes(6 * BLOCK_BYTES, BLOCK_BYTES + 4096, ZeroFlags::default()).await.unwrap();
        model[(6 * BLOCK_BYTES) as usize..(7 * BLOCK_BYTES + 4096) as usize].fill(0);
        v.write_zeroes(12 * BLOCK_BYTES, BLOCK_BYTES, ZeroFlags::default()).await.unwrap();
        model[(12 * BLOCK_BYTES) as usize..(13 * BLOCK_BYTES) as usize].fill(0);
        assert!(v.read_vec(0, VOL_BYTES as usize).await.unwrap() == model, "after discard and write-zeroes");
        let mapped = mapped_blocks(&pool).await;
        assert_eq!(mapped, [3, 4, 5, 6, 7, 10], "zeroes over the origin are provisioned; past it unmapped");

        // A snapshot needs the same origin to read the same.
        pool.create_snapshot(1, 0).await.unwrap();
        let s = pool.thin(1, VOL_BYTES).await.unwrap().with_external_origin(Arc::new(read_only(&origin_path))).unwrap();
        assert!(s.read_vec(0, VOL_BYTES as usize).await.unwrap() == model, "snapshot with the origin");
        v.flush().await.unwrap();
        drop((v, s));
        pool.close().await.unwrap();

        // Reopened: the same with the origin; without it, unmapped blocks read zeroes.
        let pool = Pool::open("xo", file_dev(&meta), file_dev(&data), quiet_opts()).await.unwrap();
        let v = pool.thin(0, VOL_BYTES).await.unwrap().with_external_origin(Arc::new(read_only(&origin_path))).unwrap();
        assert!(v.read_vec(0, VOL_BYTES as usize).await.unwrap() == model, "reopened with the origin");
        let bare = pool.thin(1, VOL_BYTES).await.unwrap();
        let got = bare.read_vec(0, VOL_BYTES as usize).await.unwrap();
        assert!(got[..BLOCK_BYTES as usize].iter().all(|&b| b == 0), "no origin: unmapped block 0 reads zeroes");
        let b3 = (3 * BLOCK_BYTES) as usize..(4 * BLOCK_BYTES) as usize;
        assert!(got[b3.clone()] == model[b3], "no origin: mapped blocks read as before");
        drop((v, bare));
        pool.close().await.unwrap();
    });
    assert!(std::fs::read(&origin_path).unwrap() == origin, "the origin file is unchanged");
    assert_thin_check_clean(&meta, "pool with an external-origin thin");
    for p in [&meta, &data, &origin_path] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn an_origin_with_a_larger_logical_block_than_the_volume_size_allows_is_refused() {
    let rt = rt();
    rt.block_on(async {
        let mem = |name: &str, size: u64| -> DeviceRef { Arc::new(mdkit_io::MemDevice::new(name, size)) };
        let pool = Pool::create("xo-lbs", mem("m", 4 << 20), mem("d", 16 * BLOCK_BYTES), BLOCK_BYTES, quiet_opts())
            .await
            .unwrap();
        pool.create_thin(0).await.unwrap();
        let topology = mdkit_io::Topology { logical_block_bytes: 4096, ..mdkit_io::Topology::simple(1 << 20) };
        let origin: DeviceRef = Arc::new(mdkit_io::MemDevice::with_topology("origin", topology));
        let v = pool.thin(0, 4096 + 512).await.unwrap();
        let e = v.with_external_origin(origin).unwrap_err().to_string();
        assert!(e.contains("not a multiple of external origin") && e.contains("4096-byte"), "{e}");
        pool.close().await.unwrap();
    });
}
