//! Shared helpers: a plain in-memory model of a pool, random workloads, and the
//! thin-provisioning-tools binaries as oracles.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use mdkit_io::Rng;
use mdkit_thin::meta::{DeviceDetails, FileMetaIo, MetaError, MetaIo, ThinMetadata, XmlMetadata, parse_xml};

/// A pool as plain maps: what the engine must report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Model {
    pub time: u32,
    pub trans_id: u64,
    pub devices: BTreeMap<u64, ModelDev>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelDev {
    pub details: DeviceDetails,
    /// vblock -> (data block, time)
    pub map: BTreeMap<u64, (u64, u32)>,
}

impl Model {
    pub fn data_refs(&self) -> BTreeMap<u64, u32> {
        let mut refs = BTreeMap::new();
        for d in self.devices.values() {
            for (b, _) in d.map.values() {
                *refs.entry(*b).or_insert(0) += 1;
            }
        }
        refs
    }

    pub fn from_xml(x: &XmlMetadata) -> Model {
        let mut m = Model { time: x.time, trans_id: x.transaction, devices: BTreeMap::new() };
        for d in &x.devices {
            let mut map = BTreeMap::new();
            for r in &d.mappings {
                for i in 0..r.length {
                    map.insert(r.origin_begin + i, (r.data_begin + i, r.time));
                }
            }
            m.devices.insert(
                d.dev_id,
                ModelDev {
                    details: DeviceDetails {
                        mapped_blocks: d.mapped_blocks,
                        transaction_id: d.transaction,
                        creation_time: d.creation_time,
                        snapshotted_time: d.snap_time,
                    },
                    map,
                },
            );
        }
        m
    }
}

/// Reads everything the engine reports into a model.
pub fn model_of(md: &ThinMetadata) -> Model {
    let mut m = Model { time: md.time(), trans_id: md.transaction_id(), devices: BTreeMap::new() };
    for dev in md.devices() {
        let mut map = BTreeMap::new();
        md.for_each_mapping(dev, 0, u64::MAX, &mut |vb, mp| {
            map.insert(vb, (mp.data_block, mp.time));
            true
        })
        .unwrap();
        m.devices.insert(dev, ModelDev { details: md.device_details(dev).unwrap(), map });
    }
    m
}

/// Asserts the engine equals the model, including lookups, shared flags and data refcounts.
pub fn assert_matches(md: &ThinMetadata, model: &Model, what: &str) {
    let got = model_of(md);
    assert_eq!(got.time, model.time, "{what}: time");
    assert_eq!(got.trans_id, model.trans_id, "{what}: transaction id");
    assert_eq!(got.devices.keys().collect::<Vec<_>>(), model.devices.keys().collect::<Vec<_>>(), "{what}: devices");
    for (dev, d) in &model.devices {
        let g = &got.devices[dev];
        assert_eq!(g.details, d.details, "{what}: details of {dev}");
        assert_eq!(g.map.len(), d.map.len(), "{what}: mapping count of {dev}");
        assert!(g.map == d.map, "{what}: mappings of device {dev} differ");
        for (vb, (b, t)) in d.map.iter().step_by(17) {
            let m = md.lookup(*dev, *vb).unwrap().expect("mapped");
            assert_eq!((m.data_block, m.time), (*b, *t));
            assert_eq!(m.shared, d.details.snapshotted_time > *t, "{what}: shared flag {dev}:{vb}");
        }
    }
    // Counts are per referencing leaf *node*: a subtree shared by snapshots holds one
    // reference until it is copied. So a block mapped by n devices has 1..=n references
    // (exact node-level counts are verified by `check`).
    for (b, n) in model.data_refs() {
        let c = md.data_block_ref_count(b).unwrap();
        assert!((1..=n).contains(&c), "{what}: data block {b} mapped {n} times has refcount {c}");
    }
    assert_eq!(md.status().used_data_blocks, model.data_refs().len() as u64, "{what}: used data blocks");
}

/// One random operation applied to both engine and model. Returns a short description.
pub fn random_op(md: &mut ThinMetadata, model: &mut Model, rng: &mut Rng, max_dev: u64, max_vblock: u64) -> String {
    let devs: Vec<u64> = model.devices.keys().copied().collect();
    let roll = rng.below(1000);
    if devs.is_empty() || roll < 8 {
        let dev = rng.below(max_dev);
        if model.devices.contains_key(&dev) {
            assert!(matches!(md.create_thin(dev), Err(MetaError::DeviceExists(_))));
            return format!("create_thin {dev} (exists)");
        }
        md.create_thin(dev).unwrap();
        let t = model.time;
        model.devices.insert(
            dev,
            ModelDev {
                details: DeviceDetails {
                    mapped_blocks: 0,
                    transaction_id: model.trans_id,
                    creation_time: t,
                    snapshotted_time: t,
                },
                map: BTreeMap::new(),
            },
        );
        return format!("create_thin {dev}");
    }
    let dev = devs[rng.below(devs.len() as u64) as usize];
    if roll < 20 {
        let snap = rng.below(max_dev);
        if model.devices.contains_key(&snap) {
            return "create_snap skipped".into();
        }
        md.create_snap(snap, dev).unwrap();
        model.time += 1;
        let t = model.time;
        let o = model.devices.get_mut(&dev).unwrap();
        o.details.snapshotted_time = t;
        let map = o.map.clone();
        let mapped = o.details.mapped_blocks;
        model.devices.insert(
            snap,
            ModelDev {
                details: DeviceDetails {
                    mapped_blocks: mapped,
                    transaction_id: model.trans_id,
                    creation_time: t,
                    snapshotted_time: t,
                },
                map,
            },
        );
        return format!("create_snap {snap} of {dev}");
    }
    if roll < 26 && devs.len() > 1 {
        md.delete(dev).unwrap();
        model.devices.remove(&dev);
        return format!("delete {dev}");
    }
    if roll < 29 {
        let a = rng.below(max_vblock);
        let b = a + rng.below(200);
        let d = model.devices.get_mut(&dev).unwrap();
        let keys: Vec<u64> = d.map.range(a..b).map(|(k, _)| *k).collect();
        let n = if rng.chance(1, 2) {
            md.remove_range(dev, a, b).unwrap()
        } else {
            let gone = md.remove_range_mappings(dev, a, b).unwrap();
            let want: Vec<(u64, (u64, u32))> = d.map.range(a..b).map(|(k, v)| (*k, *v)).collect();
            let got: Vec<(u64, (u64, u32))> = gone.iter().map(|(k, m)| (*k, (m.data_block, m.time))).collect();
            assert_eq!(got, want, "remove_range_mappings {dev} {a}..{b}");
            gone.len() as u64
        };
        assert_eq!(n, keys.len() as u64, "remove_range count");
        for k in keys {
            d.map.remove(&k);
        }
        d.details.mapped_blocks -= n;
        return format!("remove_range {dev} {a}..{b}");
    }
    if roll < 30 {
        let t = rng.below(1 << 20);
        let cur = model.trans_id;
        md.set_transaction_id(cur, t).unwrap();
        model.trans_id = t;
        return "set_transaction_id".into();
    }
    let vb = rng.below(max_vblock);
    if roll < 330 {
        let had = model.devices[&dev].map.get(&vb).copied();
        let old = md.remove(dev, vb).unwrap();
        assert_eq!(old.map(|m| (m.data_block, m.time)), had, "remove {dev}:{vb}");
        let d = model.devices.get_mut(&dev).unwrap();
        if d.map.remove(&vb).is_some() {
            d.details.mapped_blocks -= 1;
        }
        return format!("remove {dev}:{vb}");
    }
    // Write: provision, or break sharing, or overwrite in place (no metadata change).
    let cur = md.lookup(dev, vb).unwrap();
    let d = model.devices.get_mut(&dev).unwrap();
    match cur {
        Some(m) if !m.shared => "write in place".into(),
        _ => match md.provision(dev, vb) {
            Ok(m) => {
                if d.map.insert(vb, (m.data_block, model.time)).is_none() {
                    d.details.mapped_blocks += 1;
                }
                format!("provision {dev}:{vb} -> {}", m.data_block)
            }
            Err(MetaError::OutOfDataSpace { .. }) => "out of data space".into(),
            Err(e) => panic!("provision: {e}"),
        },
    }
}

//------------------------------------------------------------------------------------------------
// Host tools

pub fn tool_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mdkit-thin");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A metadata file on a real filesystem (the tools use O_DIRECT).
pub fn meta_file(name: &str, size_bytes: u64) -> (PathBuf, Arc<dyn MetaIo>) {
    let path = tool_dir().join(name);
    let _ = std::fs::remove_file(&path);
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    f.set_len(size_bytes).unwrap();
    drop(f);
    let io: Arc<dyn MetaIo> = Arc::new(FileMetaIo::open(&path, true).unwrap());
    (path, io)
}

fn require(tool: &str) {
    if Command::new(tool).arg("-V").output().is_err() {
        panic!("{tool} not found: install thin-provisioning-tools (scripts/test installs it)");
    }
}

/// Runs thin_check; returns (clean, combined output).
pub fn thin_check(path: &Path) -> (bool, String) {
    require("thin_check");
    let out = Command::new("thin_check").arg(path).output().expect("run thin_check");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

pub fn assert_thin_check_clean(path: &Path, what: &str) {
    let (ok, text) = thin_check(path);
    assert!(ok, "{what}: thin_check failed on {}:\n{text}", path.display());
}

/// Runs thin_dump and parses its XML.
pub fn thin_dump(path: &Path) -> XmlMetadata {
    require("thin_dump");
    let out = Command::new("thin_dump").arg(path).output().expect("run thin_dump");
    assert!(out.status.success(), "thin_dump failed: {}", String::from_utf8_lossy(&out.stderr));
    parse_xml(&String::from_utf8_lossy(&out.stdout)).expect("parse thin_dump output")
}

/// Runs thin_restore from an XML file.
pub fn thin_restore(xml: &Path, out: &Path) {
    require("thin_restore");
    let o = Command::new("thin_restore").arg("-i").arg(xml).arg("-o").arg(out).output().expect("run thin_restore");
    assert!(
        o.status.success(),
        "thin_restore failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Asserts thin_dump's view of the file equals the model.
pub fn assert_dump_matches(path: &Path, model: &Model, what: &str) {
    let x = thin_dump(path);
    let got = Model::from_xml(&x);
    assert_eq!(got.time, model.time, "{what}: thin_dump time");
    assert_eq!(got.trans_id, model.trans_id, "{what}: thin_dump transaction");
    assert_eq!(got.devices.len(), model.devices.len(), "{what}: thin_dump device count");
    for (dev, d) in &model.devices {
        let g = got.devices.get(dev).unwrap_or_else(|| panic!("{what}: thin_dump lacks device {dev}"));
        assert_eq!(g.details, d.details, "{what}: thin_dump details of {dev}");
        assert!(g.map == d.map, "{what}: thin_dump mappings of {dev} differ ({} vs {})", g.map.len(), d.map.len());
    }
}
