//! thin_delta, thin_dump -m, thin_repair and thinp 1.x XML against thin-provisioning-tools
//! (host binaries): mdkit's delta is byte-for-byte thin_delta's (simple and verbose, live and
//! through the metadata snapshot); mdkit's snapshot dump equals `thin_dump -m` except for
//! nr_data_blocks (documented: thin_dump -m prints 0); `<def>`/`<ref>` XML restores; repair of
//! metadata damaged in known ways (zeroed mapping leaf, zeroed details leaf, broken space maps,
//! a held snapshot) writes metadata that passes thin_check, holds exactly the mappings that were
//! reachable, and leaves its input unchanged.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::*;
use mdkit_io::Rng;
use mdkit_thin::meta::block::BLOCK_SIZE;
use mdkit_thin::meta::delta::{self, DeltaHeader};
use mdkit_thin::meta::repair::{RepairOptions, repair};
use mdkit_thin::meta::{
    FileMetaIo, FormatOptions, MetaIo, NodeView, OpenOptions, Superblock, ThinMetadata, parse_xml, restore_xml,
    snapshot_xml_metadata, to_xml_metadata,
};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn thin_delta(path: &Path, l: u64, r: u64, extra: &[&str]) -> String {
    run(Command::new("thin_delta").args(extra).args(["--snap1", &l.to_string(), "--snap2", &r.to_string()]).arg(path))
}

/// A pool with volumes, snapshot chains, rewrites and discards (random, seeded).
fn busy_pool(name: &str, seed: u64) -> (std::path::PathBuf, Arc<dyn MetaIo>, ThinMetadata, Model) {
    let (path, io) = meta_file(name, 16 << 20);
    let mut md = ThinMetadata::format(
        io.clone(),
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 100_000, metadata_nr_blocks: None },
    )
    .unwrap();
    let mut model = Model::default();
    let mut rng = Rng::new(seed);
    for _ in 0..6000 {
        random_op(&mut md, &mut model, &mut rng, 8, 4000);
    }
    md.commit().unwrap();
    (path, io, md, model)
}

#[test]
fn delta_is_byte_for_byte_thin_delta_live_and_through_the_metadata_snapshot() {
    let (path, _io, mut md, model) = busy_pool("delta.meta", 0xde17a);
    let devs: Vec<u64> = model.devices.keys().copied().collect();
    assert!(devs.len() >= 3, "{devs:?}");
    let mut pairs = 0;
    for &l in &devs {
        for &r in &devs {
            let segs = delta::compare(&delta::device_runs(&md, l).unwrap(), &delta::device_runs(&md, r).unwrap());
            let h = DeltaHeader::of(&md);
            assert_eq!(delta::delta_xml(&h, l, r, &segs, false), thin_delta(&path, l, r, &[]), "delta {l} {r}");
            assert_eq!(
                delta::delta_xml(&h, l, r, &segs, true),
                thin_delta(&path, l, r, &["--verbose"]),
                "verbose delta {l} {r}"
            );
            pairs += 1;
        }
    }
    // Through a held metadata snapshot, while the live trees move on.
    md.reserve_metadata_snap().unwrap();
    let mut model2 = model.clone();
    let mut rng = Rng::new(77);
    for _ in 0..2000 {
        random_op(&mut md, &mut model2, &mut rng, 8, 4000);
    }
    md.commit().unwrap();
    let snap_devs: Vec<u64> = md.metadata_snap_devices().unwrap().into_iter().map(|(d, _)| d).collect();
    assert_eq!(snap_devs, devs);
    let sb = md.metadata_snap_superblock().unwrap();
    for w in devs.windows(2) {
        let (l, r) = (w[0], w[1]);
        let segs = delta::compare(&delta::snap_device_runs(&md, l).unwrap(), &delta::snap_device_runs(&md, r).unwrap());
        // thin_delta -m prints the snapshot superblock's (zero) data space map size.
        let h = DeltaHeader {
            time: sb.time,
            transaction: sb.trans_id,
            data_block_size: sb.data_block_size_sectors,
            nr_data_blocks: 0,
        };
        assert_eq!(delta::delta_xml(&h, l, r, &segs, false), thin_delta(&path, l, r, &["-m"]), "delta -m {l} {r}");
    }
    eprintln!("{pairs} pairs compared");
}

#[test]
fn dump_equals_thin_dump_and_snapshot_dump_equals_thin_dump_m() {
    let (path, _io, mut md, model) = busy_pool("dump-snap.meta", 0xd0);
    let before = to_xml_metadata(&md).unwrap();
    md.reserve_metadata_snap().unwrap();
    let mut model2 = model.clone();
    let mut rng = Rng::new(5);
    for _ in 0..2000 {
        random_op(&mut md, &mut model2, &mut rng, 8, 4000);
    }
    md.commit().unwrap();
    // Live view: thin_dump's text exactly (mdkit's CLI leaves metadata_snap out, as thin_dump).
    let mut live = to_xml_metadata(&md).unwrap();
    assert!(live.metadata_snap.is_some());
    live.metadata_snap = None;
    assert_eq!(live.to_xml_string(), run(Command::new("thin_dump").arg(&path)));
    // Snapshot view: thin_dump -m's text except nr_data_blocks (0 there).
    let mut snap = snapshot_xml_metadata(&md).unwrap();
    assert_eq!(snap.devices, before.devices, "the snapshot shows the pool as it was");
    assert_eq!(snap.nr_data_blocks, md.nr_data_blocks());
    snap.metadata_snap = None;
    snap.nr_data_blocks = 0;
    assert_eq!(snap.to_xml_string(), run(Command::new("thin_dump").arg("-m").arg(&path)));
}

/// thinp >= 1.0 writes leaf runs shared by several devices once (`<def>`) and refers to them.
#[test]
fn thinp_1x_def_ref_xml_restores_and_passes_thin_check() {
    let text = r#"<superblock uuid="" time="1" transaction="2" version="2" data_block_size="128" nr_data_blocks="1024">
  <def name="17">
    <range_mapping origin_begin="0" data_begin="0" length="3" time="0"/>
  </def>
  <def name="18">
    <range_mapping origin_begin="4" data_begin="4" length="4" time="0"/>
  </def>
  <device dev_id="1" mapped_blocks="8" transaction="0" creation_time="0" snap_time="1">
    <ref name="17"/>
    <single_mapping origin_block="3" data_block="8" time="1"/>
    <ref name="18"/>
  </device>
  <device dev_id="2" mapped_blocks="9" transaction="1" creation_time="1" snap_time="1">
    <ref name="17"/>
    <single_mapping origin_block="3" data_block="3" time="0"/>
    <ref name="18"/>
    <single_mapping origin_block="20" data_block="9" time="1"/>
  </device>
</superblock>
"#;
    let x = parse_xml(text).unwrap();
    assert_eq!(x.mapping_table().len(), 17);
    assert!(
        parse_xml(&text.replace(
            "<ref name=\"18\"/>\n    <single_mapping origin_block=\"20\"",
            "<ref name=\"99\"/>\n    <single_mapping origin_block=\"20\""
        ))
        .is_err()
    );
    let (path, io) = meta_file("def-ref.meta", 4 << 20);
    drop(restore_xml(io, &x, OpenOptions::default()).unwrap());
    assert_thin_check_clean(&path, "restored from def/ref XML");
    assert_eq!(thin_dump(&path).mapping_table(), x.mapping_table());
    // And the reference's thin_delta answer (thin-lifecycle.md §3.3).
    assert_eq!(
        thin_delta(&path, 2, 1, &[]),
        "<superblock uuid=\"\" time=\"1\" transaction=\"2\" data_block_size=\"128\" nr_data_blocks=\"1024\">\n  <diff left=\"2\" right=\"1\">\n    <same begin=\"0\" length=\"3\"/>\n    <different begin=\"3\" length=\"1\"/>\n    <same begin=\"4\" length=\"4\"/>\n    <left_only begin=\"20\" length=\"1\"/>\n  </diff>\n</superblock>\n"
    );
}

//------------------------------------------------------------------------------------------------
// repair

fn read_block(path: &Path, b: u64) -> Vec<u8> {
    let img = std::fs::read(path).unwrap();
    img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].to_vec()
}

fn zero_block(path: &Path, b: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&[0u8; BLOCK_SIZE], b * BLOCK_SIZE as u64).unwrap();
}

fn node(path: &Path, b: u64) -> Box<[u8; BLOCK_SIZE]> {
    let v = read_block(path, b);
    let mut out = Box::new([0u8; BLOCK_SIZE]);
    out.copy_from_slice(&v);
    out
}

/// The mapping-tree root of `dev` (the top-level tree is one leaf in these pools).
fn device_root(path: &Path, dev: u64) -> u64 {
    let sb = Superblock::unpack(&node(path, 0));
    let top = node(path, sb.data_mapping_root);
    let n = NodeView::new(&top);
    assert!(n.is_leaf());
    let i = n.lower_bound(dev).unwrap();
    assert_eq!(n.key(i), dev);
    n.value_u64(i)
}

/// Device 1: 3000 mappings (internal root over leaves); snapshot 2 of it with 200 rewrites;
/// device 3: 10 mappings. Committed; returns the model.
fn repair_source(name: &str) -> (std::path::PathBuf, Model) {
    let (path, io) = meta_file(name, 8 << 20);
    let mut md = ThinMetadata::format(
        io,
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 20_000, metadata_nr_blocks: None },
    )
    .unwrap();
    md.create_thin(1).unwrap();
    for vb in 0..3000 {
        md.provision(1, vb).unwrap();
    }
    md.create_snap(2, 1).unwrap();
    for vb in (0..3000).step_by(15) {
        md.provision(2, vb).unwrap();
    }
    md.create_thin(3).unwrap();
    for vb in 0..10 {
        md.provision(3, vb * 7).unwrap();
    }
    md.commit().unwrap();
    let model = model_of(&md);
    drop(md);
    assert_thin_check_clean(&path, "repair source");
    (path, model)
}

struct Repaired {
    report: mdkit_thin::meta::repair::RepairReport,
    model: Model,
}

/// Repairs `input` into a new file; asserts the input is unchanged and the output passes
/// thin_check and mdkit's own checker.
fn repair_file(input: &Path, out_name: &str) -> Repaired {
    let before = std::fs::read(input).unwrap();
    let (out_path, out_io) = meta_file(out_name, 8 << 20);
    let in_io = FileMetaIo::open(input, false).unwrap();
    let report = repair(&in_io, out_io.clone(), RepairOptions::default()).unwrap();
    eprintln!("{out_name}:\n{report}");
    assert!(std::fs::read(input).unwrap() == before, "repair wrote to its input");
    assert_thin_check_clean(&out_path, out_name);
    let r = mdkit_thin::meta::check(&*out_io, &Default::default());
    assert!(r.is_clean(), "{out_name}: mdkit check:\n{r}");
    let md = ThinMetadata::open(out_io).unwrap();
    let model = model_of(&md);
    assert_eq!(Model::from_xml(&thin_dump(&out_path)).devices.len(), model.devices.len());
    Repaired { report, model }
}

fn maps(m: &Model) -> BTreeMap<u64, BTreeMap<u64, (u64, u32)>> {
    m.devices.iter().map(|(k, d)| (*k, d.map.clone())).collect()
}

#[test]
fn repair_of_intact_metadata_changes_nothing_but_the_space_maps() {
    let (path, model) = repair_source("repair-intact.meta");
    let r = repair_file(&path, "repair-intact.out");
    assert!(r.report.is_complete(), "{}", r.report);
    assert_eq!(r.model, model);
}

#[test]
fn repair_with_broken_space_maps_keeps_every_mapping() {
    let (path, model) = repair_source("repair-sm.meta");
    let sb = Superblock::unpack(&node(&path, 0));
    zero_block(&path, sb.metadata_sm_root.bitmap_root);
    zero_block(&path, sb.data_sm_root.bitmap_root);
    let (ok, text) = thin_check(&path);
    assert!(!ok, "thin_check accepted broken space maps:\n{text}");
    assert!(ThinMetadata::open(Arc::new(FileMetaIo::open(&path, false).unwrap())).is_err());
    let r = repair_file(&path, "repair-sm.out");
    assert!(r.report.is_complete(), "{}", r.report);
    assert_eq!(r.model, model);
    // thin_repair makes the same pool.
    let (tool_out, _) = meta_file("repair-sm.thin_repair.out", 8 << 20);
    run(Command::new("thin_repair").arg("-i").arg(&path).arg("-o").arg(&tool_out));
    assert_eq!(Model::from_xml(&thin_dump(&tool_out)), model);
}

#[test]
fn repair_with_a_zeroed_mapping_leaf_keeps_what_was_reachable() {
    let (path, model) = repair_source("repair-leaf.meta");
    // Device 1's tree is private to it now (snapshot 2 was rewritten in places, so it copied
    // its own path); zero the second leaf of device 1.
    let root = device_root(&path, 1);
    let r = node(&path, root);
    let n = NodeView::new(&r);
    assert!(!n.is_leaf());
    let (lost_begin, lost_end) = (n.key(1), n.key(2));
    let leaf = n.value_u64(1);
    zero_block(&path, leaf);
    let (ok, _) = thin_check(&path);
    assert!(!ok, "thin_check accepted a zeroed leaf");
    let rep = repair_file(&path, "repair-leaf.out");
    assert!(!rep.report.is_complete());
    assert_eq!(rep.report.lost.len(), 1, "{}", rep.report);
    let l = &rep.report.lost[0];
    assert_eq!((l.tree.as_str(), l.block, l.key_begin, l.key_end), ("device 1", leaf, lost_begin, lost_end));
    let mut want = maps(&model);
    want.get_mut(&1).unwrap().retain(|vb, _| !(lost_begin..lost_end).contains(vb));
    assert_eq!(maps(&rep.model), want);
    assert_eq!(rep.model.devices[&1].details.mapped_blocks, want[&1].len() as u64);
    assert_eq!(rep.model.devices[&2].details, model.devices[&2].details);
}

#[test]
fn repair_with_lost_device_details_synthesizes_them_as_all_shared() {
    let (path, model) = repair_source("repair-details.meta");
    let sb = Superblock::unpack(&node(&path, 0));
    let details = node(&path, sb.device_details_root);
    assert!(NodeView::new(&details).is_leaf());
    zero_block(&path, sb.device_details_root);
    let rep = repair_file(&path, "repair-details.out");
    assert_eq!(maps(&rep.model), maps(&model), "every mapping is kept");
    assert!(rep.report.devices.iter().all(|d| !d.details_found));
    for d in rep.model.devices.values() {
        // Every mapping is older than the device's snapshot time: the next write copies it.
        assert!(d.map.values().all(|&(_, t)| t < d.details.snapshotted_time));
        assert_eq!(d.details.mapped_blocks, d.map.len() as u64);
    }
    assert!(rep.model.time >= rep.model.devices.values().map(|d| d.details.snapshotted_time).max().unwrap());
}

#[test]
fn repair_drops_a_held_metadata_snapshot_and_a_device_whose_root_is_lost() {
    let (path, io) = meta_file("repair-held.meta", 8 << 20);
    let mut md = ThinMetadata::format(
        io,
        FormatOptions { data_block_size_sectors: 128, nr_data_blocks: 5000, metadata_nr_blocks: None },
    )
    .unwrap();
    for dev in [4, 5] {
        md.create_thin(dev).unwrap();
        for vb in 0..300 {
            md.provision(dev, vb).unwrap();
        }
    }
    let held = md.reserve_metadata_snap().unwrap();
    md.provision(4, 1000).unwrap();
    md.commit().unwrap();
    let model = model_of(&md);
    drop(md);
    // Device 5's tree root (a leaf: 300 mappings fit in two leaves under a root) is zeroed.
    let root5 = device_root(&path, 5);
    zero_block(&path, root5);
    let rep = repair_file(&path, "repair-held.out");
    assert_eq!(rep.report.held_root_dropped, Some(held));
    assert_eq!(rep.model.devices[&4].map, model.devices[&4].map);
    // Device 5 lost its whole tree: dropped, not written as an empty volume.
    assert!(!rep.model.devices.contains_key(&5));
    assert_eq!(rep.report.devices_dropped, vec![5]);
    assert!(rep.report.lost.iter().any(|l| l.tree == "device 5" && l.block == root5));
}
