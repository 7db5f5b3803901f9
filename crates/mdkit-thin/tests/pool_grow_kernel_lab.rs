//! A pool grown by mdkit's runtime while it serves writes activates in the kernel's dm-thin
//! (the lab at `/work/shared/lab`: Debian's 6.1 kernel under qemu; skips loudly without it, or
//! with MDKIT_SKIP_LAB=1). One boot.
//!
//! The runtime formats a pool on a 2 MiB metadata file and a 64-block data file, fills most of
//! it, grows the data file to 256 blocks and the metadata file to 8 MiB (`grow_file` +
//! `resize_data_to` / `resize_metadata`), then writes past the old end and snapshots. thin_check
//! accepts the result; the kernel activates the pool with a table as long as the grown file,
//! reports 256 data blocks and 2048 metadata blocks, reads every volume as mdkit did and
//! provisions more blocks in the grown part; thin_check accepts what the kernel left.

use crate::common;
use crate::pool_util;

use std::sync::Arc;

use common::*;
use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, WriteFlags};
use mdkit_thin::pool::{Pool, PoolOptions, Resized};
use pool_util::*;

const VOL_BLOCKS: u64 = 300;
const VOL_BYTES: u64 = VOL_BLOCKS * BLOCK_BYTES;

fn open_file(path: &std::path::Path) -> Arc<FileDevice> {
    Arc::new(FileDevice::open(path, FileOptions::default()).unwrap())
}

#[test]
fn a_pool_grown_by_mdkit_activates_in_dm_thin() {
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIP: kernel lab unavailable: {why}");
            return;
        }
    };
    let meta = fresh_file("grow-lab.meta", 2 << 20);
    let data = fresh_file("grow-lab.data", 64 * BLOCK_BYTES);
    let rt = rt();

    let mdkit_shas = rt.block_on(async {
        let (meta_dev, data_dev) = (open_file(&meta), open_file(&data));
        let (m, d): (DeviceRef, DeviceRef) = (meta_dev.clone(), data_dev.clone());
        let pool = Pool::create("grow", m, d, BLOCK_BYTES, PoolOptions::default()).await.unwrap();
        pool.create_thin(0).await.unwrap();
        let v0 = pool.thin(0, VOL_BYTES).await.unwrap();
        v0.write_slice(0, &pattern(1, 0, (60 * BLOCK_BYTES) as usize), WriteFlags::NONE).await.unwrap();

        data_dev.grow_file(256 * BLOCK_BYTES).unwrap();
        let r = pool.resize_data_to(pool.data_device_blocks()).await.unwrap();
        assert_eq!(r, Resized { old_blocks: 64, new_blocks: 256 });
        meta_dev.grow_file(8 << 20).unwrap();
        let r = pool.resize_metadata(None).await.unwrap();
        assert_eq!(r, Resized { old_blocks: 512, new_blocks: 2048 });
        assert!(pool.resize_data_to(100).await.is_err(), "no shrinking");

        // Past the old end: 140 more blocks, then a snapshot and a write breaking sharing.
        v0.write_slice(60 * BLOCK_BYTES, &pattern(2, 0, (140 * BLOCK_BYTES) as usize), WriteFlags::FUA).await.unwrap();
        pool.create_snapshot(1, 0).await.unwrap();
        v0.write_slice(5 * BLOCK_BYTES, &pattern(3, 0, 4096), WriteFlags::FUA).await.unwrap();
        drop(v0);
        let st = pool.status().await.unwrap();
        assert_eq!((st.total_data_blocks, st.total_metadata_blocks, st.used_data_blocks), (256, 2048, 201));
        let mut shas = std::collections::BTreeMap::new();
        for id in 0..2 {
            let v = pool.thin(id, VOL_BYTES).await.unwrap();
            shas.insert(id, sha256(&v.read_vec(0, VOL_BYTES as usize).await.unwrap()));
        }
        pool.close().await.unwrap();
        shas
    });
    assert_thin_check_clean(&meta, "pool grown by the mdkit runtime");

    let vol_sectors = VOL_BYTES / 512;
    let script = format!(
        r#"#!/bin/bash
set -e
sz=$(blockdev --getsz /dev/vdb)
dmsetup create pool --table "0 $sz thin-pool /dev/vda /dev/vdb 128 0"
echo "status $(dmsetup status pool)"
for id in 0 1; do
  dmsetup create thin$id --table "0 {vol_sectors} thin /dev/mapper/pool $id"
  echo "sha $id $(dd if=/dev/mapper/thin$id bs=64k iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
done
yes 'kernel writes in the grown part' | head -c $((40*65536)) > /tmp/k
dd if=/tmp/k of=/dev/mapper/thin1 bs=64k seek=250 count=40 oflag=direct conv=fsync 2>/dev/null
echo "after $(dmsetup status pool)"
for id in 0 1; do dmsetup remove thin$id; done
dmsetup remove pool
echo "=== done"
"#
    );
    let Some(text) = run_lab(&lab, &[&meta, &data], &script, "grow-lab.sh") else { return };
    let field = |prefix: &str, i: usize| -> String {
        let line = text.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("{prefix} in {text}"));
        line.split_whitespace().nth(i).unwrap_or_default().to_string()
    };
    // "<start> <len> thin-pool <trans> <used>/<total meta> <used>/<total data> ..."
    assert!(field("status ", 4).ends_with("/2048"), "metadata blocks: {text}");
    assert_eq!(field("status ", 5), "201/256", "data blocks: {text}");
    assert_eq!(field("after ", 5), "241/256", "the kernel provisioned 40 blocks in the grown part: {text}");
    for (id, want) in &mdkit_shas {
        assert_eq!(&field(&format!("sha {id} "), 0), want, "the kernel reads volume {id} as mdkit did");
    }
    assert_thin_check_clean(&meta, "pool after the kernel used its grown part");
    for p in [&meta, &data] {
        let _ = std::fs::remove_file(p);
    }
}
