//! The pool runtime and the kernel's dm-thin, both ways, in the lab (`/work/shared/lab`:
//! Debian's 6.1 kernel under qemu; skips loudly without it, or with MDKIT_SKIP_LAB=1).
//!
//! 1. mdkit's runtime creates a pool on two files and writes through thin volumes: partial
//!    writes (zeroing), snapshots of a volume and of a snapshot, writes breaking sharing,
//!    discards, write-zeroes. The kernel activates the pool and reads every volume: same
//!    sha256 as mdkit read. The kernel then writes, snapshots, discards, creates a volume and
//!    sets the transaction id; mdkit's runtime opens the result and reads what the kernel read.
//! 2. The kernel formats a second pool from zeroes (128 KiB blocks) and populates it (volume,
//!    snapshot, broken sharing, discard, another volume); mdkit's runtime opens it and reads
//!    the same contents, and its status numbers equal `dmsetup status`.
//!
//! Every metadata device both sides wrote passes thin_check.

use crate::common;
use crate::pool_util;

use common::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, WriteFlags, ZeroFlags};
use mdkit_thin::pool::{Pool, PoolOptions};
use pool_util::*;

const VOL_BLOCKS: u64 = 64;
const VOL_BYTES: u64 = VOL_BLOCKS * BLOCK_BYTES;
const VOL_SECTORS: u64 = VOL_BYTES / 512;

fn shas(text: &str, prefix: &str) -> std::collections::BTreeMap<u64, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.parse().ok()?, f.next()?.to_string()))
        })
        .collect()
}

async fn read_all(pool: &Pool, id: u64, bytes: u64) -> Vec<u8> {
    pool.thin(id, bytes).await.unwrap().read_vec(0, bytes as usize).await.unwrap()
}

#[test]
fn kernel_and_runtime_read_each_others_pools() {
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIP: kernel lab unavailable: {why}");
            return;
        }
    };
    let meta = fresh_file("pool-lab.meta", 8 << 20);
    let data = fresh_file("pool-lab.data", 512 * BLOCK_BYTES);
    let meta2 = fresh_file("pool-lab2.meta", 8 << 20);
    let data2 = fresh_file("pool-lab2.data", 256 * 2 * BLOCK_BYTES);
    let rt = rt();

    // 1. The runtime makes and populates a pool.
    let (mdkit_shas, mdkit_blocks) = rt.block_on(async {
        let pool =
            Pool::create("lab", file_dev(&meta), file_dev(&data), BLOCK_BYTES, PoolOptions::default()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v0 = pool.thin(0, VOL_BYTES).await.unwrap();
        v0.write_slice(0, &pattern(1, 0, (40 * BLOCK_BYTES) as usize), WriteFlags::NONE).await.unwrap();
        v0.write_slice(50 * BLOCK_BYTES + 4096, &pattern(2, 0, 8192), WriteFlags::FUA).await.unwrap(); // zeroing
        pool.create_snapshot(1, 0).await.unwrap();
        v0.write_slice(3 * BLOCK_BYTES + 512, &pattern(3, 0, 4096), WriteFlags::NONE).await.unwrap(); // breaks sharing
        v0.write_slice(10 * BLOCK_BYTES, &pattern(4, 0, BLOCK_BYTES as usize), WriteFlags::NONE).await.unwrap();
        pool.create_snapshot(2, 1).await.unwrap();
        let v2 = pool.thin(2, VOL_BYTES).await.unwrap();
        v2.write_slice(20 * BLOCK_BYTES + 8192, &pattern(5, 0, 4096), WriteFlags::FUA).await.unwrap();
        v0.discard(30 * BLOCK_BYTES, 4 * BLOCK_BYTES + 4096).await.unwrap();
        v2.write_zeroes(5 * BLOCK_BYTES + 4096, 8192, ZeroFlags::default()).await.unwrap();
        v2.write_zeroes(6 * BLOCK_BYTES, 2 * BLOCK_BYTES, ZeroFlags::default()).await.unwrap();
        drop((v0, v2));
        let mut out = std::collections::BTreeMap::new();
        let mut blocks = std::collections::BTreeMap::new();
        for id in 0..3 {
            let all = read_all(&pool, id, VOL_BYTES).await;
            out.insert(id, sha256(&all));
            for (b, block) in all.chunks(BLOCK_BYTES as usize).enumerate() {
                blocks.insert(format!("{id} {b}"), sha256(block)[..16].to_string());
            }
        }
        eprintln!("mdkit status before the kernel: {}", pool.status().await.unwrap());
        pool.close().await.unwrap();
        (out, blocks)
    });
    assert_thin_check_clean(&meta, "pool written by the mdkit runtime");

    let last_block = VOL_BLOCKS - 1;
    let script = format!(
        r#"#!/bin/bash
set -e
vol={VOL_SECTORS}
sz=$(blockdev --getsz /dev/vdb)
dmsetup create pool --table "0 $sz thin-pool /dev/vda /dev/vdb 128 0"
for id in 0 1 2; do dmsetup create thin$id --table "0 $vol thin /dev/mapper/pool $id"; done
dmsetup status pool
sha() {{ echo "$1 $2 $(dd if=/dev/mapper/thin$2 bs=64k iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"; }}
for id in 0 1 2; do sha mdkit-made $id; done
# Per block too, so a difference names the blocks.
for id in 0 1 2; do for b in $(seq 0 {last_block}); do
  echo "blk $id $b $(dd if=/dev/mapper/thin$id bs=64k skip=$b count=1 iflag=direct 2>/dev/null | sha256sum | cut -c1-16)"
done; done
yes 'written by the kernel' | head -c 196608 > /tmp/k
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=100 count=3 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/thin1 bs=64k seek=45 count=2 oflag=direct conv=fsync 2>/dev/null
dmsetup suspend thin0
dmsetup message pool 0 "create_snap 3 0"
dmsetup resume thin0
dmsetup create thin3 --table "0 $vol thin /dev/mapper/pool 3"
dd if=/tmp/k of=/dev/mapper/thin0 bs=4k seek=1 count=1 oflag=direct conv=fsync 2>/dev/null
blkdiscard -o $((8*65536)) -l $((4*65536)) /dev/mapper/thin2
dmsetup message pool 0 "create_thin 4"
dmsetup create thin4 --table "0 $vol thin /dev/mapper/pool 4"
dd if=/tmp/k of=/dev/mapper/thin4 bs=4k seek=33 count=5 oflag=direct conv=fsync 2>/dev/null
dmsetup message pool 0 "set_transaction_id 0 9"
for id in 0 1 2 3 4; do sha kernel-after $id; done
for id in 0 1 2 3 4; do dmsetup remove thin$id; done
dmsetup remove pool
echo "=== kernel formats pool2"
sz2=$(blockdev --getsz /dev/vdd)
dmsetup create pool2 --table "0 $sz2 thin-pool /dev/vdc /dev/vdd 256 0"
dmsetup message pool2 0 "create_thin 0"
dmsetup create thin0 --table "0 $vol thin /dev/mapper/pool2 0"
yes 'kernel pool two' | head -c 2097152 > /tmp/a
dd if=/tmp/a of=/dev/mapper/thin0 bs=1M count=2 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/a of=/dev/mapper/thin0 bs=4k seek=900 count=2 oflag=direct conv=fsync 2>/dev/null
dmsetup suspend thin0
dmsetup message pool2 0 "create_snap 1 0"
dmsetup resume thin0
dmsetup create thin1 --table "0 $vol thin /dev/mapper/pool2 1"
echo 'origin rewrites a shared block' | dd of=/dev/mapper/thin0 bs=4k seek=3 count=1 conv=sync,fsync oflag=direct 2>/dev/null
blkdiscard -o 0 -l $((2*131072)) /dev/mapper/thin0
dmsetup message pool2 0 "create_thin 5"
dmsetup create thin5 --table "0 $vol thin /dev/mapper/pool2 5"
dd if=/tmp/a of=/dev/mapper/thin5 bs=64k seek=7 count=3 oflag=direct conv=fsync 2>/dev/null
dmsetup message pool2 0 "set_transaction_id 0 3"
for id in 0 1 5; do sha kernel-pool2 $id; done
echo "pool2-status $(dmsetup status pool2)"
for id in 0 1 5; do dmsetup remove thin$id; done
dmsetup remove pool2
echo "=== done"
"#
    );
    let Some(text) = run_lab(&lab, &[&meta, &data, &meta2, &data2], &script, "pool-lab.sh") else { return };
    let kernel_read = shas(&text, "mdkit-made ");
    let differing: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("blk "))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(at, sha)| mdkit_blocks.get(*at).is_none_or(|m| m != sha))
        .map(|(at, sha)| format!("volume block {at}: kernel {sha}, mdkit {:?}", mdkit_blocks.get(at)))
        .collect();
    assert_eq!(kernel_read, mdkit_shas, "the kernel reads what mdkit's runtime wrote; differing: {differing:#?}");
    assert!(differing.is_empty(), "per block: {differing:#?}");
    let kernel_after = shas(&text, "kernel-after ");
    assert_eq!(kernel_after.len(), 5, "{text}");
    let kernel_pool2 = shas(&text, "kernel-pool2 ");
    assert_eq!(kernel_pool2.len(), 3, "{text}");
    assert_thin_check_clean(&meta, "pool 1 after the kernel");
    assert_thin_check_clean(&meta2, "pool 2 formatted by the kernel");

    // 2. The runtime opens what the kernel wrote and reads the same.
    rt.block_on(async {
        let pool = Pool::open("lab", file_dev(&meta), file_dev(&data), PoolOptions::default()).await.unwrap();
        assert_eq!(pool.devices().await.unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(pool.status().await.unwrap().transaction_id, 9);
        for (id, want) in &kernel_after {
            assert_eq!(
                &sha256(&read_all(&pool, *id, VOL_BYTES).await),
                want,
                "mdkit reads volume {id} as the kernel did"
            );
        }
        // And goes on: a write breaking sharing with the kernel's snapshot, a new snapshot.
        let v3 = pool.thin(3, VOL_BYTES).await.unwrap();
        v3.write_slice(0, &pattern(6, 0, 4096), WriteFlags::FUA).await.unwrap();
        pool.create_snapshot(7, 3).await.unwrap();
        drop(v3);
        pool.close().await.unwrap();

        let pool2 = Pool::open("lab2", file_dev(&meta2), file_dev(&data2), PoolOptions::default()).await.unwrap();
        assert_eq!(pool2.data_block_bytes(), 128 << 10);
        for (id, want) in &kernel_pool2 {
            assert_eq!(&sha256(&read_all(&pool2, *id, VOL_BYTES).await), want, "mdkit reads kernel pool 2 volume {id}");
        }
        let line = text.lines().find_map(|l| l.strip_prefix("pool2-status ")).expect("pool2 status");
        let f: Vec<&str> = line.split_whitespace().collect();
        let st = pool2.status().await.unwrap();
        let mine = st.to_string();
        let m: Vec<&str> = mine.split_whitespace().collect();
        // dmsetup: "<start> <len> thin-pool <trans> <meta> <data> ..."
        assert_eq!(&f[3..6], &m[0..3], "transaction id, metadata and data usage: kernel {line} / mdkit {mine}");
        pool2.close().await.unwrap();
    });
    assert_thin_check_clean(&meta, "pool 1 after the runtime again");
    for p in [&meta, &data, &meta2, &data2] {
        let _ = std::fs::remove_file(p);
    }
}
