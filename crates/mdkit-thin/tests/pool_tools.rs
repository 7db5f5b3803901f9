//! The pool runtime against thin-provisioning-tools (host binaries): metadata the runtime
//! writes through thin volumes (provisioning, snapshots of volumes and of snapshots, breaking
//! sharing, discards, deletes, transaction id, a held metadata snapshot) passes `thin_check`,
//! and `thin_dump` shows exactly the devices, mappings and times the runtime reports, with the
//! data file holding what the volumes read. A pool made by `thin_restore` from an XML (many
//! volumes, snapshot chains, shared blocks) opens in the runtime and its volumes read back the
//! data the test put at the XML's data blocks.

use crate::common;
use crate::pool_util;

use std::os::unix::fs::FileExt;

use common::*;
use mdkit_io::{BlockDevice, BlockDeviceExt, Rng, WriteFlags, ZeroFlags};
use mdkit_thin::meta::{XmlDevice, XmlMapping, XmlMetadata};
use mdkit_thin::pool::{Pool, PoolOptions};
use pool_util::*;

const NR_DATA_BLOCKS: u64 = 512;
const VOL_BLOCKS: u64 = 48;

#[test]
fn runtime_metadata_passes_thin_check_and_thin_dump_matches_what_it_reports() {
    let seed = 0x7001_u64;
    eprintln!("seed {seed:#x}");
    let meta_path = fresh_file("pool-tools.meta", 8 << 20);
    let data_path = fresh_file("pool-tools.data", NR_DATA_BLOCKS * BLOCK_BYTES);
    let rt = rt();
    let (model, contents) = rt.block_on(async {
        let pool =
            Pool::create("tools", file_dev(&meta_path), file_dev(&data_path), BLOCK_BYTES, quiet_opts()).await.unwrap();
        let vol_bytes = VOL_BLOCKS * BLOCK_BYTES;
        let mut rng = Rng::new(seed);
        let mut contents: std::collections::BTreeMap<u64, Vec<u8>> = Default::default();
        for id in [0u64, 1] {
            pool.create_thin(id).await.unwrap();
            contents.insert(id, vec![0u8; vol_bytes as usize]);
        }
        let mut tag = 1u64;
        // Snapshot ids start after the two volumes: round r creates snapshot 2 + r.
        for (next_id, round) in (2u64..).zip(0..6) {
            let ids: Vec<u64> = contents.keys().copied().collect();
            for &id in &ids {
                let v = pool.thin(id, vol_bytes).await.unwrap();
                for _ in 0..25 {
                    let off = rng.below(vol_bytes / 4096) * 4096;
                    let len = ((1 + rng.below(40)) * 4096).min(vol_bytes - off);
                    let data = pattern(tag, off, len as usize);
                    tag += 1;
                    let flags = if rng.chance(1, 4) { WriteFlags::FUA } else { WriteFlags::NONE };
                    v.write_slice(off, &data, flags).await.unwrap();
                    contents.get_mut(&id).unwrap()[off as usize..(off + len) as usize].copy_from_slice(&data);
                }
                if rng.chance(1, 2) {
                    let b = rng.below(VOL_BLOCKS);
                    let n = 1 + rng.below(4).min(VOL_BLOCKS - b - 1);
                    v.discard(b * BLOCK_BYTES, n * BLOCK_BYTES).await.unwrap();
                    contents.get_mut(&id).unwrap()[(b * BLOCK_BYTES) as usize..((b + n) * BLOCK_BYTES) as usize]
                        .fill(0);
                }
                if rng.chance(1, 3) {
                    let off = rng.below(vol_bytes / 4096 - 20) * 4096;
                    v.write_zeroes(off, 20 * 4096, ZeroFlags::default()).await.unwrap();
                    contents.get_mut(&id).unwrap()[off as usize..(off + 20 * 4096) as usize].fill(0);
                }
            }
            // Snapshots of volumes and of snapshots.
            let origin = ids[rng.below(ids.len() as u64) as usize];
            pool.create_snapshot(next_id, origin).await.unwrap();
            let c = contents[&origin].clone();
            contents.insert(next_id, c);
            if round == 3 {
                let victim = ids[0];
                pool.delete_thin(victim).await.unwrap();
                contents.remove(&victim);
            }
        }
        pool.set_transaction_id(0, 42).await.unwrap();
        let held = pool.reserve_metadata_snap().await.unwrap();
        // More writes after the metadata snapshot (the live trees diverge from the held ones).
        let id = *contents.keys().next().unwrap();
        let v = pool.thin(id, vol_bytes).await.unwrap();
        let data = pattern(tag, 0, 8192);
        v.write_slice(0, &data, WriteFlags::FUA).await.unwrap();
        contents.get_mut(&id).unwrap()[..8192].copy_from_slice(&data);
        drop(v);
        for (&id, want) in &contents {
            let v = pool.thin(id, vol_bytes).await.unwrap();
            assert!(v.read_vec(0, want.len()).await.unwrap() == *want, "volume {id} reads back wrong before close");
        }
        let st = pool.status().await.unwrap();
        eprintln!("status: {st}");
        assert_eq!(st.held_root, Some(held));
        assert!(st.to_string().starts_with("42 "), "{st}");
        let model = model_of_pool(&pool).await;
        pool.close().await.unwrap();
        (model, contents)
    });
    drop(rt);
    assert_thin_check_clean(&meta_path, "metadata written by the pool runtime");
    assert_dump_matches(&meta_path, &model, "runtime");
    // The data file holds, at thin_dump's mappings, what the volumes read.
    let x = thin_dump(&meta_path);
    let data = std::fs::File::open(&data_path).unwrap();
    let table = x.mapping_table();
    for (&id, want) in &contents {
        for vb in 0..VOL_BLOCKS {
            let range = (vb * BLOCK_BYTES) as usize..((vb + 1) * BLOCK_BYTES) as usize;
            match table.get(&(id, vb)) {
                Some(&(b, _)) => {
                    let mut got = vec![0u8; BLOCK_BYTES as usize];
                    data.read_exact_at(&mut got, b * BLOCK_BYTES).unwrap();
                    assert!(
                        got[..] == want[range],
                        "volume {id} block {vb} (data block {b}) differs from the data file"
                    );
                }
                None => assert!(want[range].iter().all(|&b| b == 0), "volume {id} block {vb} unmapped but written"),
            }
        }
    }
    // The held root dumps too.
    let out = std::process::Command::new("thin_dump").arg("-m").arg(&meta_path).output().unwrap();
    assert!(out.status.success(), "thin_dump -m: {}", String::from_utf8_lossy(&out.stderr));
    let _ = (std::fs::remove_file(&meta_path), std::fs::remove_file(&data_path));
}

/// Data block `b` of the restored pool holds this.
fn block_contents(b: u64) -> Vec<u8> {
    pattern(0xb10c_0000 + b, b * BLOCK_BYTES, BLOCK_BYTES as usize)
}

fn restored_xml() -> XmlMetadata {
    let m = |origin_begin, data_begin, length, time| XmlMapping { origin_begin, data_begin, length, time };
    let dev = |dev_id, transaction, creation_time, snap_time, mappings: Vec<XmlMapping>| XmlDevice {
        dev_id,
        mapped_blocks: mappings.iter().map(|r| r.length).sum(),
        transaction,
        creation_time,
        snap_time,
        mappings,
    };
    // Volume 1 (time 0); snapshot 2 of 1 at time 1, both rewrote some blocks after; snapshot 3
    // of 2 at time 2 with its own writes; volume 5 with scattered singles; snapshot 9 of 5 at
    // time 3; volume 12 empty. Shared blocks carry times below both sharers' snap_time.
    let devices = vec![
        dev(1, 0, 0, 1, vec![m(0, 0, 30, 0), m(30, 200, 4, 1), m(40, 40, 10, 0)]),
        dev(2, 1, 1, 2, vec![m(0, 0, 10, 0), m(10, 210, 5, 1), m(15, 15, 15, 0), m(40, 40, 10, 0)]),
        dev(3, 2, 2, 2, vec![m(0, 0, 10, 0), m(10, 210, 5, 1), m(15, 220, 3, 2), m(18, 18, 12, 0), m(40, 40, 10, 0)]),
        dev(5, 3, 0, 3, vec![m(3, 100, 1, 0), m(17, 101, 1, 0), m(60, 102, 2, 0), m(90, 104, 1, 0)]),
        dev(9, 4, 3, 3, vec![m(3, 100, 1, 0), m(17, 101, 1, 0), m(60, 102, 2, 0), m(90, 104, 1, 0), m(91, 230, 1, 3)]),
        dev(12, 5, 3, 3, vec![]),
    ];
    XmlMetadata {
        uuid: String::new(),
        time: 3,
        transaction: 6,
        flags: 0,
        version: 2,
        data_block_size: (BLOCK_BYTES / 512) as u32,
        nr_data_blocks: 256,
        metadata_snap: None,
        devices,
    }
}

#[test]
fn pool_made_by_thin_restore_opens_and_reads_back_the_data() {
    let x = restored_xml();
    let xml_path = scratch_path("pool-restore.xml");
    std::fs::write(&xml_path, x.to_xml_string()).unwrap();
    let meta_path = fresh_file("pool-restore.meta", 4 << 20);
    thin_restore(&xml_path, &meta_path);
    let data_path = fresh_file("pool-restore.data", 256 * BLOCK_BYTES);
    {
        let f = std::fs::OpenOptions::new().write(true).open(&data_path).unwrap();
        let mut used: Vec<u64> = x.mapping_table().values().map(|v| v.0).collect();
        used.sort_unstable();
        used.dedup();
        for b in used {
            f.write_all_at(&block_contents(b), b * BLOCK_BYTES).unwrap();
        }
        f.sync_all().unwrap();
    }
    let table = x.mapping_table();
    let vol_blocks = 100u64;
    let rt = rt();
    rt.block_on(async {
        let pool =
            Pool::open("restored", file_dev(&meta_path), file_dev(&data_path), PoolOptions::default()).await.unwrap();
        let st = pool.status().await.unwrap();
        assert_eq!((st.transaction_id, st.total_data_blocks), (6, 256), "{st}");
        assert_eq!(pool.devices().await.unwrap(), vec![1, 2, 3, 5, 9, 12]);
        for d in &x.devices {
            let v = pool.thin(d.dev_id, vol_blocks * BLOCK_BYTES).await.unwrap();
            let got = v.read_vec(0, (vol_blocks * BLOCK_BYTES) as usize).await.unwrap();
            for vb in 0..vol_blocks {
                let part = &got[(vb * BLOCK_BYTES) as usize..((vb + 1) * BLOCK_BYTES) as usize];
                match table.get(&(d.dev_id, vb)) {
                    Some(&(b, _)) => {
                        assert!(part == block_contents(b), "device {} block {vb} should read data block {b}", d.dev_id)
                    }
                    None => assert!(part.iter().all(|&x| x == 0), "device {} block {vb} is unmapped", d.dev_id),
                }
            }
            let ts = pool.thin_status(d.dev_id).await.unwrap();
            assert_eq!(ts.mapped_blocks, d.mapped_blocks);
        }
        let list = pool.list().await.unwrap();
        let u1 = list.iter().find(|u| u.id == 1).unwrap();
        // Device 1: blocks 10..15 (2 and 3 remapped them) and 30..34 are its own; the other
        // 35 are shared with 2 and/or 3.
        assert_eq!((u1.mapped_blocks, u1.exclusive_blocks, u1.shared_blocks), (44, 9, 35));
        // Writing into a shared block of snapshot 3 breaks sharing: 1 and 2 keep their data.
        let v3 = pool.thin(3, vol_blocks * BLOCK_BYTES).await.unwrap();
        let new = pattern(77, 4096, 4096);
        v3.write_slice(4096, &new, WriteFlags::FUA).await.unwrap();
        let mut want = block_contents(0);
        want[4096..8192].copy_from_slice(&new);
        assert!(v3.read_vec(0, BLOCK_BYTES as usize).await.unwrap() == want);
        for id in [1, 2] {
            let v = pool.thin(id, vol_blocks * BLOCK_BYTES).await.unwrap();
            assert!(
                v.read_vec(0, BLOCK_BYTES as usize).await.unwrap() == block_contents(0),
                "device {id} block 0 changed"
            );
        }
        // A volume of the restored pool provisions new blocks as usual.
        let v12 = pool.thin(12, vol_blocks * BLOCK_BYTES).await.unwrap();
        v12.write_slice(5 * BLOCK_BYTES, &pattern(78, 0, 512), WriteFlags::FUA).await.unwrap();
        assert_eq!(pool.thin_status(12).await.unwrap().mapped_blocks, 1);
        assert_eq!(pool.status().await.unwrap().counters.sharing_breaks, 1);
        pool.close().await.unwrap();
    });
    drop(rt);
    assert_thin_check_clean(&meta_path, "restored pool after runtime writes");
    let _ = (std::fs::remove_file(&meta_path), std::fs::remove_file(&data_path), std::fs::remove_file(&xml_path));
}
