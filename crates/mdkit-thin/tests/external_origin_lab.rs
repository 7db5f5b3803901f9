//! External origins against the kernel's dm-thin, in the lab (`/work/shared/lab`; skips loudly
//! without it, or with MDKIT_SKIP_LAB=1). One boot:
//! 1. mdkit's runtime makes a pool and writes through a thin volume over an origin file
//!    (partial and whole-block writes inside the origin, in the block it ends in, past it, a
//!    discard);
//! 2. the kernel activates the device with the same origin (the `thin` target's fourth
//!    argument) and reads what mdkit read; then it writes (partial and whole blocks over the
//!    origin, past it, into a mapped block) and discards;
//! 3. mdkit's runtime, given the origin again, reads what the kernel read.
//!
//! The origin file is byte-identical at the end and the metadata passes thin_check.

use crate::common;
use crate::external_origin::origin_file;
use crate::pool_util;

use std::sync::Arc;

use common::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, FileDevice, FileOptions, WriteFlags};
use mdkit_thin::pool::{Pool, PoolOptions};
use pool_util::*;

const VOL_BYTES: u64 = 16 * BLOCK_BYTES;

async fn read_with_origin(pool: &Pool, origin: &std::path::Path) -> Vec<u8> {
    let o = FileDevice::open(origin, FileOptions { read_only: true, ..FileOptions::default() }).unwrap();
    let v = pool.thin(0, VOL_BYTES).await.unwrap().with_external_origin(Arc::new(o)).unwrap();
    v.read_vec(0, VOL_BYTES as usize).await.unwrap()
}

fn sha_line(text: &str, prefix: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{text}"))
        .trim()
        .to_string()
}

#[test]
fn kernel_and_runtime_agree_on_an_external_origin_thin() {
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIP: kernel lab unavailable: {why}");
            return;
        }
    };
    let meta = fresh_file("xo-lab.meta", 4 << 20);
    let data = fresh_file("xo-lab.data", 64 * BLOCK_BYTES);
    let (origin_path, origin) = origin_file("xo-lab.origin");
    let rt = rt();

    let mdkit_sha = rt.block_on(async {
        let pool = Pool::create("xo-lab", file_dev(&meta), file_dev(&data), BLOCK_BYTES, PoolOptions::default())
            .await
            .unwrap();
        pool.create_thin(0).await.unwrap();
        let o = FileDevice::open(&origin_path, FileOptions { read_only: true, ..FileOptions::default() }).unwrap();
        let v = pool.thin(0, VOL_BYTES).await.unwrap().with_external_origin(Arc::new(o)).unwrap();
        v.write_slice(2 * BLOCK_BYTES + 4096, &pattern(1, 0, 4096), WriteFlags::NONE).await.unwrap();
        v.write_slice(4 * BLOCK_BYTES, &pattern(2, 0, BLOCK_BYTES as usize), WriteFlags::NONE).await.unwrap();
        v.write_slice(10 * BLOCK_BYTES + 32768, &pattern(3, 0, 4096), WriteFlags::NONE).await.unwrap();
        v.write_slice(12 * BLOCK_BYTES + 512, &pattern(4, 0, 1024), WriteFlags::NONE).await.unwrap();
        v.write_slice(5 * BLOCK_BYTES, &pattern(5, 0, 8192), WriteFlags::NONE).await.unwrap();
        v.discard(5 * BLOCK_BYTES, BLOCK_BYTES).await.unwrap();
        v.flush().await.unwrap();
        drop(v);
        let sha = sha256(&read_with_origin(&pool, &origin_path).await);
        pool.close().await.unwrap();
        sha
    });
    assert_thin_check_clean(&meta, "pool with an external-origin thin, written by mdkit");

    let vol_sectors = VOL_BYTES / 512;
    let script = format!(
        r#"#!/bin/bash
set -e
sz=$(blockdev --getsz /dev/vdb)
dmsetup create pool --table "0 $sz thin-pool /dev/vda /dev/vdb 128 0"
dmsetup create thin0 --table "0 {vol_sectors} thin /dev/mapper/pool 0 /dev/vdc"
dmsetup table thin0
sha() {{ echo "$1 $(dd if=$2 bs=64k iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"; }}
sha mdkit-made /dev/mapper/thin0
yes 'written by the kernel' | head -c 131072 > /tmp/k
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=$((7*16+3)) count=1 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/thin0 bs=64k seek=8 count=1 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=$((14*16+1)) count=1 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=$((2*16+10)) count=2 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=$((10*16+1)) count=1 oflag=direct conv=fsync 2>/dev/null
blkdiscard -o $((4*65536)) -l 65536 /dev/mapper/thin0
sync
sha kernel-after /dev/mapper/thin0
dmsetup status thin0
dmsetup remove thin0
dmsetup remove pool
sha origin /dev/vdc
echo "=== done"
"#
    );
    let disks = [meta.as_path(), data.as_path(), origin_path.as_path()];
    let Some(text) = run_lab(&lab, &disks, &script, "xo-lab.sh") else { return };
    assert_eq!(sha_line(&text, "mdkit-made "), mdkit_sha, "the kernel reads what mdkit wrote over the origin");
    assert_eq!(sha_line(&text, "origin "), sha256(&origin), "the kernel read the same origin");
    let kernel_after = sha_line(&text, "kernel-after ");
    assert_thin_check_clean(&meta, "pool after the kernel wrote over the origin");

    rt.block_on(async {
        let pool = Pool::open("xo-lab", file_dev(&meta), file_dev(&data), PoolOptions::default()).await.unwrap();
        let mapped: Vec<u64> = pool.mappings(0).await.unwrap().into_iter().map(|(vb, _)| vb).collect();
        assert_eq!(mapped, [2, 7, 8, 10, 12, 14], "the kernel's provisions and discard");
        assert_eq!(
            sha256(&read_with_origin(&pool, &origin_path).await),
            kernel_after,
            "mdkit reads what the kernel read"
        );
        pool.close().await.unwrap();
    });
    assert!(std::fs::read(&origin_path).unwrap() == origin, "the origin file is unchanged");
    for p in [&meta, &data, &origin_path] {
        let _ = std::fs::remove_file(p);
    }
}
