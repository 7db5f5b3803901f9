//! Bad input to the pool runtime. Damaged metadata: every corrupted live metadata block makes
//! a read-write open fail with an error naming a damaged block, and nothing is written to the
//! metadata or data device; a read-only open of a pool damaged deep in a mapping tree serves
//! the undamaged volumes and fails reads that need the damaged block, naming it. Metadata that
//! is not a pool, or uses unknown features, is refused. Out-of-range and misaligned thin I/O
//! fails with InvalidInput and changes nothing.

use crate::pool_util;

use std::sync::Arc;

use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, IoOp, MemDevice, Rng, Tracer, WriteFlags, ZeroFlags};
use mdkit_thin::meta::{CheckOptions, MemMetaIo, check};
use mdkit_thin::pool::{Pool, PoolOptions};
use pool_util::*;

const VOL_BLOCKS: u64 = 600;

/// A pool with two volumes (one big enough for a multi-level mapping tree) and a snapshot.
async fn make_pool() -> (Arc<MemDevice>, Arc<MemDevice>) {
    let meta = Arc::new(MemDevice::new("meta", 4 << 20));
    let data = Arc::new(MemDevice::new("data", 2048 * BLOCK_BYTES));
    let pool = Pool::create("bad", meta.clone(), data.clone(), BLOCK_BYTES, quiet_opts()).await.unwrap();
    pool.create_thin(0).await.unwrap();
    pool.create_thin(1).await.unwrap();
    let v0 = pool.thin(0, VOL_BLOCKS * BLOCK_BYTES).await.unwrap();
    let v1 = pool.thin(1, 4 * BLOCK_BYTES).await.unwrap();
    for vb in 0..VOL_BLOCKS {
        v0.write_slice(vb * BLOCK_BYTES, &pattern(vb, vb * BLOCK_BYTES, 4096), WriteFlags::NONE).await.unwrap();
    }
    v1.write_slice(0, &pattern(1, 0, 4096), WriteFlags::NONE).await.unwrap();
    drop((v0, v1));
    pool.create_snapshot(2, 0).await.unwrap();
    pool.close().await.unwrap();
    (meta, data)
}

fn traced(tracer: &Tracer, dev: &MemDevice, name: &str) -> DeviceRef {
    Arc::new(tracer.wrap(dev.snapshot(name)))
}

#[test]
fn damaged_metadata_is_refused_naming_the_block_and_nothing_is_written() {
    let rt = rt();
    let (meta, data) = rt.block_on(make_pool());
    let image = meta.to_image();
    let nr_blocks = image.len() / 4096;
    let mut rng = Rng::new(0xbad);
    let (mut live, mut dead) = (0, 0);
    for b in 0..nr_blocks {
        let blk = &image[b * 4096..(b + 1) * 4096];
        if blk.iter().all(|&x| x == 0) {
            continue;
        }
        // Flip one byte past the checksum field.
        let mut bad = image.clone();
        let at = b * 4096 + 8 + rng.below(4088) as usize;
        bad[at] ^= 0x5a;
        let report = check(&MemMetaIo::from_image("bad", &bad), &CheckOptions::default());
        if report.is_clean() {
            dead += 1; // a block the last commit no longer references
            continue;
        }
        live += 1;
        let named: Vec<u64> = report.errors.iter().filter_map(|e| e.block).collect();
        let tracer = Tracer::new(16);
        let bad_meta = MemDevice::from_image("meta", &bad);
        let (m, d) = (traced(&tracer, &bad_meta, "meta"), traced(&tracer, &data, "data"));
        let err = rt
            .block_on(Pool::open("bad", m, d, PoolOptions::default()))
            .expect_err("damaged metadata must not open read-write");
        let msg = err.to_string();
        let block = err.corrupt_block().unwrap_or_else(|| panic!("block {b}: the error names no block: {msg}"));
        assert!(
            named.contains(&block) || block == b as u64,
            "block {b}: error names block {block}, check found {named:?}: {msg}"
        );
        assert!(msg.contains(&format!("block {block}")), "{msg}");
        let snap = tracer.snapshot();
        for dev in &snap.devices {
            for op in [IoOp::Write, IoOp::Flush, IoOp::Discard, IoOp::WriteZeroes] {
                assert_eq!(dev.ops.get(op).requests, 0, "block {b}: {} got a {}", dev.name, op.as_str());
            }
        }
    }
    eprintln!("{live} live metadata blocks corrupted one at a time (each refused), {dead} dead blocks skipped");
    assert!(live >= 10, "{live}");
}

#[test]
fn read_only_open_of_a_damaged_pool_names_the_block_on_the_reads_that_need_it() {
    let rt = rt();
    let (meta, data) = rt.block_on(make_pool());
    // Find a mapping leaf of volume 0: a live block whose damage volume 1 does not notice.
    let image = meta.to_image();
    rt.block_on(async {
        for b in 1..image.len() / 4096 {
            let mut bad = image.clone();
            bad[b * 4096 + 100] ^= 0xff;
            let report = check(&MemMetaIo::from_image("bad", &bad), &CheckOptions::default());
            if report.is_clean() {
                continue;
            }
            let opts = PoolOptions { read_only: true, ..quiet_opts() };
            let Ok(pool) =
                Pool::open("ro", Arc::new(MemDevice::from_image("meta", &bad)), Arc::new(data.snapshot("data")), opts)
                    .await
            else {
                continue; // damage in a structure read at open: refused, fine
            };
            let v1 = pool.thin(1, 4 * BLOCK_BYTES).await.unwrap();
            let v0 = pool.thin(0, VOL_BLOCKS * BLOCK_BYTES).await.unwrap();
            let mut failed = None;
            for vb in 0..VOL_BLOCKS {
                if let Err(e) = v0.read_vec(vb * BLOCK_BYTES, 4096).await {
                    failed = Some(e);
                    break;
                }
            }
            let Some(e) = failed else { continue };
            assert!(e.to_string().contains(&format!("block {b}")), "the read error names damaged block {b}: {e}");
            // The undamaged volume still reads; nothing can be written.
            assert_eq!(v1.read_vec(0, 4096).await.unwrap(), pattern(1, 0, 4096));
            assert!(v1.write_slice(0, &[0u8; 4096], WriteFlags::NONE).await.is_err());
            drop((v0, v1));
            let _ = pool.close().await;
            return;
        }
        panic!("no damaged mapping leaf found");
    });
}

#[test]
fn not_a_pool_or_unknown_features_are_refused() {
    let rt = rt();
    let (meta, data) = rt.block_on(make_pool());
    rt.block_on(async {
        // Random bytes.
        let mut junk = vec![0u8; 1 << 20];
        Rng::new(3).fill(&mut junk);
        let e = Pool::open("junk", Arc::new(MemDevice::from_image("m", &junk)), data.clone(), quiet_opts())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not dm-thin metadata") && e.corrupt_block() == Some(0), "{e}");
        // Create refuses to overwrite junk too.
        let e =
            Pool::create("junk", Arc::new(MemDevice::from_image("m", &junk)), data.clone(), BLOCK_BYTES, quiet_opts())
                .await
                .unwrap_err();
        assert!(e.to_string().contains("refusing to overwrite"), "{e}");
        // Incompat feature flags: a valid superblock (checksum resealed) the engine must refuse.
        let mut img = meta.to_image();
        img[360..364].copy_from_slice(&1u32.to_le_bytes());
        reseal_superblock(&mut img);
        let e = Pool::open("incompat", Arc::new(MemDevice::from_image("m", &img)), data.clone(), quiet_opts())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("incompat"), "{e}");
        // A data device smaller than the metadata says.
        let small: DeviceRef = Arc::new(MemDevice::new("small", 16 * BLOCK_BYTES));
        let e = Pool::open("small", meta.clone(), small, quiet_opts()).await.unwrap_err();
        assert!(e.to_string().contains("too small"), "{e}");
    });
}

/// The superblock checksum: crc32c over bytes 4.. with the kernel's seed and salt 160774.
fn reseal_superblock(img: &mut [u8]) {
    let crc = crc32c_kernel(&img[4..4096]) ^ 160_774;
    img[..4].copy_from_slice(&crc.to_le_bytes());
}

fn crc32c_kernel(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    crc
}

#[test]
fn out_of_range_or_misaligned_thin_io_is_refused_and_changes_nothing() {
    let rt = rt();
    let (meta, data) = rt.block_on(make_pool());
    rt.block_on(async {
        let tracer = Tracer::new(16);
        let (m, d) = (traced(&tracer, &meta, "meta"), traced(&tracer, &data, "data"));
        let pool = Pool::open("oor", m, d, quiet_opts()).await.unwrap();
        let v = pool.thin(1, 4 * BLOCK_BYTES).await.unwrap();
        let before = pool.status().await.unwrap();
        tracer.reset();
        let size = 4 * BLOCK_BYTES;
        for (off, len) in [(size, 4096u64), (size - 512, 1024), (u64::MAX - 511, 512), (1, 512), (0, 100)] {
            let e = v.write_slice(off, &vec![9u8; len as usize], WriteFlags::FUA).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "write {off}+{len}: {e}");
            assert!(e.to_string().contains("bad/thin1") || e.to_string().contains("oor/thin1"), "{e}");
            let e = v.read_vec(off, len as usize).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            let e = v.discard(off, len).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
            let e = v.write_zeroes(off, len, ZeroFlags::default()).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        }
        let snap = tracer.snapshot();
        for dev in &snap.devices {
            assert_eq!(
                dev.ops.write.requests + dev.ops.discard.requests + dev.ops.write_zeroes.requests,
                0,
                "{}",
                dev.name
            );
        }
        let after = pool.status().await.unwrap();
        assert_eq!(
            (before.transaction_id, before.used_data_blocks, before.used_metadata_blocks),
            (after.transaction_id, after.used_data_blocks, after.used_metadata_blocks)
        );
        assert_eq!(v.read_vec(0, 4096).await.unwrap(), pattern(1, 0, 4096));
        drop(v);
        pool.close().await.unwrap();
    });
}
