//! Kernel compatibility both ways, in the lab (`/work/shared/lab`: Debian's 6.1 kernel under
//! qemu). mdkit formats and populates a pool (writing the data blocks itself), the kernel's
//! dm-thin activates it and must read the expected contents of a volume and of its snapshot;
//! the kernel then writes (provisioning, breaking sharing), creates devices and sets the
//! transaction id, and mdkit must open what the kernel wrote and find all of it.
//!
//! Skips loudly (prints "SKIP: ...") when the lab cannot be built or booted, or with
//! MDKIT_SKIP_LAB=1. Environment: MDKIT_LAB_DIR (default ../shared/lab or /work/shared/lab).

use crate::common;

use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::Arc;

use common::*;
use mdkit_thin::meta::{CheckOptions, FileMetaIo, FormatOptions, MetaIo, ThinMetadata, check};

const BLOCK_SECTORS: u32 = 128;
const BLOCK_BYTES: u64 = BLOCK_SECTORS as u64 * 512;
const NR_DATA_BLOCKS: u64 = 512;
const VOLUME_BLOCKS: u64 = 64;

use crate::pool_util::{lab, sha256};

fn pattern(dev: u64, vblock: u64, generation: u32) -> Vec<u8> {
    let line = format!("mdkit dev={dev} vblock={vblock} gen={generation}\n");
    line.bytes().cycle().take(BLOCK_BYTES as usize).collect()
}

fn read_block(data: &std::fs::File, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK_BYTES as usize];
    data.read_exact_at(&mut v, b * BLOCK_BYTES).unwrap();
    v
}

#[test]
fn kernel_reads_what_mdkit_wrote_and_mdkit_reads_what_the_kernel_wrote() {
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIP: kernel lab unavailable: {why}");
            return;
        }
    };
    // Metadata file twice the formatted size: the kernel grows the metadata space map.
    let (meta_path, io) = meta_file("lab.meta", 2048 * 4096);
    let data_path = tool_dir().join("lab.data");
    let data = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&data_path).unwrap();
    data.set_len(NR_DATA_BLOCKS * BLOCK_BYTES).unwrap();

    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions {
            data_block_size_sectors: BLOCK_SECTORS,
            nr_data_blocks: NR_DATA_BLOCKS,
            metadata_nr_blocks: Some(1024),
        },
    )
    .unwrap();
    // Volume 0: blocks 0..64 (gen 0); snapshot 1; volume 0 rewrites 0..16 (gen 1, breaking
    // sharing) and discards 60..64.
    md.create_thin(0).unwrap();
    let mut thin0 = vec![vec![0u8; BLOCK_BYTES as usize]; VOLUME_BLOCKS as usize];
    for vb in 0..VOLUME_BLOCKS {
        let m = md.provision(0, vb).unwrap();
        let p = pattern(0, vb, 0);
        data.write_all_at(&p, m.data_block * BLOCK_BYTES).unwrap();
        thin0[vb as usize] = p;
    }
    md.commit().unwrap();
    md.create_snap(1, 0).unwrap();
    let snap1 = thin0.clone();
    for vb in 0..16 {
        assert!(md.lookup(0, vb).unwrap().unwrap().shared);
        let m = md.provision(0, vb).unwrap();
        let p = pattern(0, vb, 1);
        data.write_all_at(&p, m.data_block * BLOCK_BYTES).unwrap();
        thin0[vb as usize] = p;
    }
    assert_eq!(md.remove_range(0, 60, 64).unwrap(), 4);
    for block in &mut thin0[60..64] {
        *block = vec![0u8; BLOCK_BYTES as usize];
    }
    md.commit().unwrap();
    data.sync_all().unwrap();
    drop(md);
    assert_thin_check_clean(&meta_path, "mdkit-made pool before the kernel");
    let want0 = sha256(&thin0.concat());
    let want1 = sha256(&snap1.concat());

    let script = format!(
        r#"#!/bin/bash
set -e
META=/dev/vda DATA=/dev/vdb
data_sz=$(blockdev --getsz $DATA)
dmsetup create pool --table "0 $data_sz thin-pool $META $DATA {bs} 16"
dmsetup create thin0 --table "0 {vol} thin /dev/mapper/pool 0"
dmsetup create snap1 --table "0 {vol} thin /dev/mapper/pool 1"
echo "=== status"; dmsetup status pool
echo "=== sha"
echo "thin0 $(dd if=/dev/mapper/thin0 bs=64k count={nb} iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "snap1 $(dd if=/dev/mapper/snap1 bs=64k count={nb} iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"
echo "=== kernel writes"
yes 'kernel wrote this block' | head -c 65536 > /tmp/k
dd if=/tmp/k of=/dev/mapper/thin0 bs=64k seek=62 count=1 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/k of=/dev/mapper/snap1 bs=64k seek=3 count=1 oflag=direct conv=fsync 2>/dev/null
dmsetup suspend snap1
dmsetup message pool 0 "create_snap 3 1"
dmsetup resume snap1
dmsetup message pool 0 "create_thin 2"
dmsetup message pool 0 "set_transaction_id 0 7"
dmsetup status pool
dmsetup remove snap1
dmsetup remove thin0
dmsetup remove pool
echo "=== kernel formats a pool"
d2=$(blockdev --getsz /dev/vdd)
dmsetup create pool2 --table "0 $d2 thin-pool /dev/vdc /dev/vdd {bs} 16"
dmsetup message pool2 0 "create_thin 0"
dmsetup create t2 --table "0 {vol} thin /dev/mapper/pool2 0"
yes 'kernel pool block A' | head -c 1048576 > /tmp/a
dd if=/tmp/a of=/dev/mapper/t2 bs=64k count=16 oflag=direct conv=fsync 2>/dev/null
dmsetup suspend t2
dmsetup message pool2 0 "create_snap 1 0"
dmsetup resume t2
yes 'kernel pool block B' | head -c 65536 > /tmp/b
dd if=/tmp/b of=/dev/mapper/t2 bs=64k seek=2 count=1 oflag=direct conv=fsync 2>/dev/null
dmsetup remove t2
dmsetup remove pool2
echo "=== done"
"#,
        bs = BLOCK_SECTORS,
        vol = VOLUME_BLOCKS * BLOCK_SECTORS as u64,
        nb = VOLUME_BLOCKS,
    );
    // A second, all-zero metadata device for the kernel to format itself.
    let (meta2_path, _) = meta_file("lab2.meta", 8 << 20);
    let data2_path = tool_dir().join("lab2.data");
    let data2 =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&data2_path).unwrap();
    data2.set_len(256 * BLOCK_BYTES).unwrap();
    let script_path = tool_dir().join("lab-thin.sh");
    std::fs::write(&script_path, script).unwrap();
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/lab-slot"))
        .arg(lab.join("run.sh"))
        .arg("--disk")
        .arg(&meta_path)
        .arg("--disk")
        .arg(&data_path)
        .arg("--disk")
        .arg(&meta2_path)
        .arg("--disk")
        .arg(&data2_path)
        .arg("--timeout")
        .arg("300")
        .arg(&script_path)
        .output()
        .expect("run the lab");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    if matches!(out.status.code(), Some(124) | Some(125)) {
        eprintln!("SKIP: the lab guest did not run the script (exit {:?})", out.status.code());
        return;
    }
    assert!(out.status.success(), "guest script failed:\n{text}");
    assert!(text.contains(&format!("thin0 {want0}")), "kernel read the wrong contents of volume 0 (want {want0})");
    assert!(text.contains(&format!("snap1 {want1}")), "kernel read the wrong contents of snapshot 1 (want {want1})");

    // mdkit reads what the kernel wrote.
    assert_thin_check_clean(&meta_path, "after the kernel");
    let io: Arc<dyn MetaIo> = Arc::new(FileMetaIo::open(&meta_path, true).unwrap());
    let r = check(&*io, &CheckOptions::default());
    assert!(r.is_clean(), "mdkit check of kernel-written metadata:\n{r}");
    let mut md = ThinMetadata::open(io.clone()).unwrap();
    // mdkit's status equals the kernel's `dmsetup status` after the last commit.
    let line = text.lines().find(|l| l.contains("thin-pool 7 ")).expect("status line after set_transaction_id");
    let f: Vec<&str> = line.split_whitespace().collect();
    let st = md.status();
    assert_eq!(
        f[4],
        format!("{}/{}", st.used_metadata_blocks, st.total_metadata_blocks),
        "metadata used/total: {line}"
    );
    assert_eq!(f[5], format!("{}/{}", st.used_data_blocks, st.total_data_blocks), "data used/total: {line}");
    assert_eq!(md.devices(), vec![0, 1, 2, 3]);
    assert_eq!(md.transaction_id(), 7);
    assert!(md.status().total_metadata_blocks > 1024, "the kernel grew the metadata space map");
    let kernel_block: Vec<u8> = "kernel wrote this block\n".bytes().cycle().take(BLOCK_BYTES as usize).collect();
    let m = md.lookup(0, 62).unwrap().expect("the kernel provisioned volume 0 block 62");
    assert!(read_block(&data, m.data_block) == kernel_block, "volume 0 block 62 has the wrong contents");
    let m1 = md.lookup(1, 3).unwrap().expect("snapshot block 3");
    assert!(read_block(&data, m1.data_block) == kernel_block, "the kernel broke sharing into a new block");
    assert_eq!(md.lookup(3, 3).unwrap().unwrap().data_block, m1.data_block, "snapshot 3 of 1 shares it");
    assert!(md.lookup(3, 3).unwrap().unwrap().shared);
    let m0 = md.lookup(0, 3).unwrap().unwrap();
    assert!(read_block(&data, m0.data_block) == pattern(0, 3, 1), "volume 0 keeps its own block");
    assert_eq!(md.device_details(2).unwrap().mapped_blocks, 0);
    for vb in 16..60 {
        let a = md.lookup(0, vb).unwrap().unwrap();
        assert!(read_block(&data, a.data_block) == pattern(0, vb, 0), "volume 0 block {vb} has the wrong contents");
    }
    // And mdkit can go on modifying it.
    md.provision(2, 5).unwrap();
    md.delete(3).unwrap();
    md.commit().unwrap();
    drop(md);
    assert_thin_check_clean(&meta_path, "mdkit after the kernel");

    // The pool the kernel formatted from zeroes (its own bootstrap layout).
    assert_thin_check_clean(&meta2_path, "kernel-formatted pool");
    let io2: Arc<dyn MetaIo> = Arc::new(FileMetaIo::open(&meta2_path, true).unwrap());
    let r = check(&*io2, &CheckOptions::default());
    assert!(r.is_clean(), "mdkit check of the kernel-formatted pool:\n{r}");
    let mut md2 = ThinMetadata::open(io2.clone()).unwrap();
    assert_eq!(md2.devices(), vec![0, 1]);
    assert_eq!(md2.status().total_data_blocks, 256);
    let b: Vec<u8> = "kernel pool block B\n".bytes().cycle().take(BLOCK_BYTES as usize).collect();
    for vb in 0..16 {
        let m1 = md2.lookup(1, vb).unwrap().expect("snapshot mapping");
        assert!(m1.shared, "every snapshot block is shared");
        // Block vb of the 1 MiB stream `yes 'kernel pool block A'` wrote.
        let block_a: Vec<u8> = "kernel pool block A\n"
            .bytes()
            .cycle()
            .skip((vb * BLOCK_BYTES) as usize)
            .take(BLOCK_BYTES as usize)
            .collect();
        assert!(read_block(&data2, m1.data_block) == block_a, "snapshot block {vb} has the wrong contents");
        let m0 = md2.lookup(0, vb).unwrap().expect("origin mapping");
        if vb == 2 {
            assert_ne!(m0.data_block, m1.data_block, "the kernel broke sharing");
            assert!(read_block(&data2, m0.data_block) == b, "origin block 2 has the wrong contents");
        } else {
            assert_eq!(m0.data_block, m1.data_block);
        }
    }
    assert_eq!(md2.device_details(0).unwrap().mapped_blocks, 16);
    md2.provision(1, 20).unwrap();
    md2.create_snap(7, 1).unwrap();
    md2.commit().unwrap();
    drop(md2);
    assert_thin_check_clean(&meta2_path, "mdkit after the kernel's own format");
}
