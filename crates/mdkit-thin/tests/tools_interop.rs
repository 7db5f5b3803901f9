//! Interoperability with thin-provisioning-tools (host binaries, version 0.9.0 here):
//! every metadata image mdkit writes must pass `thin_check`, and `thin_dump` must show exactly
//! the devices, mappings and times the engine reports; metadata made by `thin_restore` must
//! open in mdkit, match the XML, and stay clean after mdkit modifies it.

use crate::common;

use std::collections::BTreeMap;

use common::*;
use mdkit_io::Rng;
use mdkit_thin::meta::{
    CheckOptions, FormatOptions, ThinMetadata, XmlDevice, XmlMapping, XmlMetadata, check, parse_xml, to_xml_metadata,
};

/// mdkit's checker finds no error (tool-made metadata may carry hint differences, reported
/// as warnings: thin_restore 0.9.0 truncates nr_free of the last bitmap, the kernel does not).
fn assert_own_check_clean(io: &dyn mdkit_thin::meta::MetaIo, what: &str) {
    let r = check(io, &CheckOptions::default());
    assert!(r.is_clean(), "{what}: mdkit check:\n{r}");
}

/// Metadata written only by mdkit: not even a warning.
fn assert_own_check_pristine(io: &dyn mdkit_thin::meta::MetaIo, what: &str) {
    let r = check(io, &CheckOptions::default());
    assert!(r.is_clean() && r.warnings.is_empty(), "{what}: mdkit check:\n{r}");
}

#[test]
fn fresh_pool_passes_thin_check() {
    for (bs, nr_data, meta_bytes) in
        [(128u32, 1000u64, 4u64 << 20), (2_097_152, 5, 1 << 20), (1024, 3_000_000, 64 << 20)]
    {
        let (path, io) = meta_file(&format!("fresh-{bs}.meta"), meta_bytes);
        let md = ThinMetadata::format(
            io.clone(),
            FormatOptions { data_block_size_sectors: bs, nr_data_blocks: nr_data, metadata_nr_blocks: None },
        )
        .unwrap();
        assert_eq!(md.status().total_data_blocks, nr_data);
        drop(md);
        assert_thin_check_clean(&path, "fresh pool");
        assert_own_check_pristine(&*io, "fresh pool");
        let x = thin_dump(&path);
        assert_eq!((x.data_block_size, x.nr_data_blocks, x.devices.len()), (bs, nr_data, 0));
    }
}

#[test]
fn random_operations_pass_thin_check_and_dump_matches() {
    let seed = 0x5eed_0001;
    eprintln!("seed {seed:#x}");
    let (path, io) = meta_file("random-ops.meta", 16 << 20);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 200_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(seed);
    for round in 0..8 {
        for _ in 0..1500 {
            random_op(&mut md, &mut model, &mut rng, 12, 6000);
        }
        md.commit().unwrap();
        assert_matches(&md, &model, &format!("round {round}"));
        assert_thin_check_clean(&path, &format!("round {round}"));
        assert_own_check_pristine(&*io, &format!("round {round}"));
        assert_dump_matches(&path, &model, &format!("round {round}"));
    }
    // mdkit's own dump is byte-for-byte what thin_dump prints.
    let ours = to_xml_metadata(&md).unwrap().to_xml_string();
    let out = std::process::Command::new("thin_dump").arg(&path).output().unwrap();
    assert_eq!(ours, String::from_utf8_lossy(&out.stdout), "dump_xml differs from thin_dump");
    // Reopen from disk: the same state.
    drop(md);
    let md = ThinMetadata::open(io.clone()).unwrap();
    assert_matches(&md, &model, "reopened");
    let st = md.status();
    eprintln!(
        "status after random ops: {st:?}, {} devices, {} mappings",
        model.devices.len(),
        model.devices.values().map(|d| d.map.len()).sum::<usize>()
    );
}

#[test]
fn deep_snapshot_chains_and_shared_blocks_stay_clean() {
    let (path, io) = meta_file("snap-chain.meta", 8 << 20);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 256, nr_data_blocks: 50_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(42);
    md.create_thin(0).unwrap();
    model.devices.insert(0, ModelDev { details: md.device_details(0).unwrap(), map: BTreeMap::new() });
    for vb in 0..3000u64 {
        let m = md.provision(0, vb).unwrap();
        model.devices.get_mut(&0).unwrap().map.insert(vb, (m.data_block, 0));
    }
    model.devices.get_mut(&0).unwrap().details.mapped_blocks = 3000;
    md.commit().unwrap();
    // A chain: snapshot of snapshot of ... each followed by writes to the newest.
    let mut newest = 0u64;
    for s in 1..=20u64 {
        md.create_snap(s, newest).unwrap();
        model.time += 1;
        let t = model.time;
        let o = model.devices.get_mut(&newest).unwrap();
        o.details.snapshotted_time = t;
        let (map, mapped) = (o.map.clone(), o.details.mapped_blocks);
        model.devices.insert(
            s,
            ModelDev {
                details: mdkit_thin::meta::DeviceDetails {
                    mapped_blocks: mapped,
                    transaction_id: 0,
                    creation_time: t,
                    snapshotted_time: t,
                },
                map,
            },
        );
        newest = s;
        for _ in 0..150 {
            let vb = rng.below(3500);
            let m = md.provision(newest, vb).unwrap();
            let d = model.devices.get_mut(&newest).unwrap();
            if d.map.insert(vb, (m.data_block, t)).is_none() {
                d.details.mapped_blocks += 1;
            }
        }
        if s % 5 == 0 {
            md.commit().unwrap();
            assert_thin_check_clean(&path, &format!("chain {s}"));
        }
    }
    // Shared blocks with counts >= 3 exist now (in the data ref-count tree).
    assert!(model.data_refs().values().any(|&c| c >= 3));
    // Delete every other snapshot.
    for s in (1..=20u64).step_by(2) {
        md.delete(s).unwrap();
        model.devices.remove(&s);
    }
    md.commit().unwrap();
    assert_matches(&md, &model, "after deletes");
    assert_thin_check_clean(&path, "after deletes");
    assert_own_check_pristine(&*io, "after deletes");
    assert_dump_matches(&path, &model, "after deletes");
}

/// Builds an XML pool with many volumes, snapshot chains and shared blocks, as thin_dump
/// would show a busy kernel pool.
fn generated_xml(seed: u64) -> XmlMetadata {
    let mut rng = Rng::new(seed);
    let nr_data_blocks = 400_000u64;
    let mut next_block = 0u64;
    let mut devices: Vec<XmlDevice> = Vec::new();
    let mut time = 0u32;
    for v in 0..12u64 {
        let dev_id = v * 10;
        let mut map: BTreeMap<u64, (u64, u32)> = BTreeMap::new();
        let runs = 20 + rng.below(40);
        for _ in 0..runs {
            let start = rng.below(100_000);
            let len = 1 + rng.below(300);
            for i in 0..len {
                map.insert(start + i, (next_block, time));
                next_block += 1;
            }
        }
        let creation_time = time;
        devices.push(to_dev(dev_id, &map, creation_time, creation_time));
        // A chain of snapshots, each diverging a little.
        let mut origin_map = map;
        let mut origin_idx = devices.len() - 1;
        for s in 1..=(rng.below(5)) {
            time += 1;
            devices[origin_idx].snap_time = time;
            let mut snap_map = origin_map.clone();
            for _ in 0..rng.below(200) {
                let vb = rng.below(100_000);
                snap_map.insert(vb, (next_block, time));
                next_block += 1;
            }
            devices.push(to_dev(dev_id + s, &snap_map, time, time));
            origin_map = snap_map;
            origin_idx = devices.len() - 1;
        }
    }
    assert!(next_block < nr_data_blocks);
    devices.sort_by_key(|d| d.dev_id);
    XmlMetadata {
        uuid: String::new(),
        time,
        transaction: 17,
        flags: 0,
        version: 2,
        data_block_size: 128,
        nr_data_blocks,
        metadata_snap: None,
        devices,
    }
}

fn to_dev(dev_id: u64, map: &BTreeMap<u64, (u64, u32)>, creation_time: u32, snap_time: u32) -> XmlDevice {
    let mut mappings: Vec<XmlMapping> = Vec::new();
    for (&vb, &(b, t)) in map {
        match mappings.last_mut() {
            Some(r) if r.origin_begin + r.length == vb && r.data_begin + r.length == b && r.time == t => r.length += 1,
            _ => mappings.push(XmlMapping { origin_begin: vb, data_begin: b, length: 1, time: t }),
        }
    }
    XmlDevice { dev_id, mapped_blocks: map.len() as u64, transaction: 0, creation_time, snap_time, mappings }
}

#[test]
fn thin_restore_pool_opens_matches_and_survives_modification() {
    let x = generated_xml(99);
    let xml_path = tool_dir().join("generated.xml");
    std::fs::write(&xml_path, x.to_xml_string()).unwrap();
    let (path, io) = meta_file("restored-by-tools.meta", 64 << 20);
    thin_restore(&xml_path, &path);
    assert_thin_check_clean(&path, "thin_restore output");
    // mdkit's checker agrees with thin_check on tool-made metadata.
    assert_own_check_clean(&*io, "thin_restore output");

    let mut md = ThinMetadata::open(io.clone()).unwrap();
    let mut model = Model::from_xml(&x);
    assert_matches(&md, &model, "opened thin_restore output");
    assert_eq!(to_xml_metadata(&md).unwrap().mapping_table(), x.mapping_table());

    // Modify: writes (breaking sharing), discards, new snapshots, deletes.
    let mut rng = Rng::new(5);
    for round in 0..4 {
        for _ in 0..2000 {
            random_op(&mut md, &mut model, &mut rng, 130, 100_000);
        }
        md.commit().unwrap();
        assert_thin_check_clean(&path, &format!("modified round {round}"));
        assert_own_check_clean(&*io, &format!("modified round {round}"));
        assert_dump_matches(&path, &model, &format!("modified round {round}"));
    }
}

#[test]
fn mdkit_restore_matches_thin_restore() {
    let x = generated_xml(7);
    let (path, io) = meta_file("restored-by-mdkit.meta", 64 << 20);
    let md = mdkit_thin::meta::restore_xml(io.clone(), &x, Default::default()).unwrap();
    assert_matches(&md, &Model::from_xml(&x), "mdkit restore");
    drop(md);
    assert_thin_check_clean(&path, "mdkit restore");
    let dumped = thin_dump(&path);
    assert_eq!(dumped, parse_xml(&x.to_xml_string()).unwrap(), "thin_dump of mdkit's restore equals the input XML");
}

/// Runs `thin_dump -m` (the metadata snapshot) and parses it.
fn thin_dump_snap(path: &std::path::Path) -> XmlMetadata {
    let out = std::process::Command::new("thin_dump").arg("-m").arg(path).output().expect("run thin_dump -m");
    assert!(out.status.success(), "thin_dump -m failed: {}", String::from_utf8_lossy(&out.stderr));
    parse_xml(&String::from_utf8_lossy(&out.stdout)).expect("parse thin_dump -m output")
}

#[test]
fn metadata_snapshot_is_held_readable_and_released() {
    let (path, io) = meta_file("held-root.meta", 16 << 20);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 100_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(11);
    for _ in 0..3000 {
        random_op(&mut md, &mut model, &mut rng, 6, 5000);
    }
    let held = md.reserve_metadata_snap().unwrap();
    assert!(md.reserve_metadata_snap().is_err(), "only one metadata snapshot at a time");
    let at_snap = model.clone();
    for _ in 0..3000 {
        random_op(&mut md, &mut model, &mut rng, 6, 5000);
    }
    md.commit().unwrap();
    assert_eq!(md.metadata_snap(), Some(held));
    assert_eq!(md.status().held_root, Some(held));
    assert_thin_check_clean(&path, "with a metadata snapshot");
    assert_own_check_clean(&*io, "with a metadata snapshot");
    assert_dump_matches(&path, &model, "live view with a metadata snapshot");
    // (thin_dump 0.9.0 does not print the metadata_snap attribute; `-m` reads the snapshot.)
    // The snapshot shows the pool as it was when it was taken: to tools and to mdkit.
    let snap = Model::from_xml(&thin_dump_snap(&path));
    assert_eq!(snap.devices.keys().collect::<Vec<_>>(), at_snap.devices.keys().collect::<Vec<_>>());
    for (dev, d) in &at_snap.devices {
        assert!(snap.devices[dev].map == d.map, "thin_dump -m mappings of {dev}");
        let mut mine = BTreeMap::new();
        md.for_each_snap_mapping(*dev, &mut |vb, m| {
            mine.insert(vb, (m.data_block, m.time));
            true
        })
        .unwrap();
        assert!(mine == d.map, "mdkit's view of the metadata snapshot, device {dev}");
    }
    let reopened = ThinMetadata::open(io.clone()).unwrap();
    assert_eq!(reopened.metadata_snap(), Some(held));
    assert_eq!(reopened.metadata_snap_devices().unwrap().len(), at_snap.devices.len());
    drop(reopened);
    md.release_metadata_snap().unwrap();
    md.commit().unwrap();
    assert_eq!(md.metadata_snap(), None);
    assert_thin_check_clean(&path, "after releasing the metadata snapshot");
    assert_own_check_clean(&*io, "after releasing the metadata snapshot");
    assert_dump_matches(&path, &model, "after release");
}

#[test]
fn growing_data_and_metadata_devices_stays_clean() {
    let (path, io) = meta_file("resize.meta", 40_000 * 4096);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 1000, metadata_nr_blocks: Some(20_000) },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    for vb in 0..1000 {
        md.provision(0, vb).unwrap();
    }
    assert!(md.provision(0, 1000).is_err());
    md.commit().unwrap();
    assert!(md.resize_data(999).is_err(), "no shrinking");
    // Grow data across several bitmaps (16320 entries each) and metadata across two bitmaps.
    md.resize_data(40_000).unwrap();
    md.resize_metadata(40_000).unwrap();
    for vb in 1000..30_000 {
        md.provision(0, vb).unwrap();
    }
    md.commit().unwrap();
    let st = md.status();
    assert_eq!((st.total_data_blocks, st.used_data_blocks, st.total_metadata_blocks), (40_000, 30_000, 40_000));
    drop(md);
    assert_thin_check_clean(&path, "after growing");
    assert_own_check_pristine(&*io, "after growing");
    let md = ThinMetadata::open(io.clone()).unwrap();
    assert_eq!(md.status().total_metadata_blocks, 40_000);
    assert_eq!(md.device_details(0).unwrap().mapped_blocks, 30_000);
}

#[test]
fn metadata_blocks_shared_three_times_or_more_use_the_overflow_tree() {
    let (path, io) = meta_file("meta-overflow.meta", 8 << 20);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 10_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(0).unwrap();
    for vb in 0..2000 {
        md.provision(0, vb).unwrap();
    }
    // Five snapshots of an unchanged origin: its root is referenced six times, its children
    // once each until a write copies the root.
    for s in 1..=5 {
        md.create_snap(s, 0).unwrap();
    }
    md.commit().unwrap();
    let sb = ThinMetadata::read_superblock(&*io).unwrap();
    let mut blk = [0u8; 4096];
    io.read_block(sb.metadata_sm_root.ref_count_root, &mut blk).unwrap();
    assert!(mdkit_thin::meta::NodeView::new(&blk).nr_entries() > 0, "the metadata ref-count tree holds the root");
    assert_thin_check_clean(&path, "root shared 6 times");
    assert_own_check_pristine(&*io, "root shared 6 times");
    // Writes to three of them copy the root (children now shared 3-4 times), deletes drop some.
    for s in 1..=3 {
        md.provision(s, 5).unwrap();
    }
    md.delete(4).unwrap();
    md.commit().unwrap();
    assert_thin_check_clean(&path, "children shared >= 3 times");
    assert_own_check_pristine(&*io, "children shared >= 3 times");
    for s in [0, 1, 2, 3, 5] {
        md.delete(s).unwrap();
    }
    md.commit().unwrap();
    assert_eq!(md.status().used_data_blocks, 0);
    assert_thin_check_clean(&path, "everything deleted");
    assert_own_check_pristine(&*io, "everything deleted");
}
