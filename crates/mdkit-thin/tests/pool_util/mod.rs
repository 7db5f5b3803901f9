//! Helpers shared by the pool runtime tests (`tests/pool_*.rs`): runtimes, file-backed
//! devices, data patterns, the kernel lab, and a conversion of what the runtime reports into
//! the metadata tests' `Model` (so thin_dump can be compared with it).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{DeviceRef, FileDevice, FileOptions};
use mdkit_thin::pool::{Pool, PoolOptions};

use crate::common::{Model, ModelDev};

pub const BLOCK_BYTES: u64 = 64 << 10;

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Options for tests: no periodic commit (commits only on flush/FUA/admin: deterministic).
pub fn quiet_opts() -> PoolOptions {
    PoolOptions { commit_interval: Duration::ZERO, ..PoolOptions::default() }
}

/// A path under the test directory, unique to this process (test runs may overlap).
pub fn scratch_path(name: &str) -> PathBuf {
    crate::common::tool_dir().join(format!("{}-{name}", std::process::id()))
}

/// A fresh file of `size_bytes` under the test directory (removed first).
pub fn fresh_file(name: &str, size_bytes: u64) -> PathBuf {
    let path = scratch_path(name);
    let _ = std::fs::remove_file(&path);
    FileDevice::create_sparse(&path, size_bytes).unwrap();
    path
}

/// Opens a file as an io_uring `FileDevice` (call inside the runtime).
pub fn file_dev(path: &Path) -> DeviceRef {
    Arc::new(FileDevice::open(path, FileOptions::default()).unwrap())
}

/// A 512-byte sector that names what wrote it: (tag, absolute byte offset).
pub fn sector_pattern(tag: u64, offset_bytes: u64) -> [u8; 512] {
    let mut s = [0u8; 512];
    for (i, w) in s.chunks_exact_mut(16).enumerate() {
        w[..8].copy_from_slice(&tag.to_le_bytes());
        w[8..].copy_from_slice(&(offset_bytes + i as u64 * 16).to_le_bytes());
    }
    s
}

/// `len` bytes of `sector_pattern(tag, ..)` starting at `offset_bytes` (512-aligned).
pub fn pattern(tag: u64, offset_bytes: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut off = offset_bytes;
    while v.len() < len {
        v.extend_from_slice(&sector_pattern(tag, off));
        off += 512;
    }
    v.truncate(len);
    v
}

/// The tag of a sector written with `sector_pattern`, `Some(0)` for zeroes, `None` for
/// anything else (torn inside a sector, garbage).
pub fn sector_tag(s: &[u8], offset_bytes: u64) -> Option<u64> {
    if s.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let tag = u64::from_le_bytes(s[..8].try_into().unwrap());
    (s == sector_pattern(tag, offset_bytes)).then_some(tag)
}

/// What the runtime reports (devices, details, mappings) as the metadata tests' model.
pub async fn model_of_pool(pool: &Pool) -> Model {
    let md = pool.metadata();
    let (time, trans_id) = {
        let m = md.read();
        (m.time(), m.transaction_id())
    };
    let mut model = Model { time, trans_id, devices: BTreeMap::new() };
    for dev in pool.devices().await.unwrap() {
        let st = pool.thin_status(dev).await.unwrap();
        let map = pool.mappings(dev).await.unwrap().into_iter().map(|(vb, m)| (vb, (m.data_block, m.time))).collect();
        model.devices.insert(dev, ModelDev { details: st.details, map });
    }
    model
}

//------------------------------------------------------------------------------------------------
// The kernel lab

mod lab_dir;

pub use lab_dir::lab;

/// Runs `script` in the lab with `disks`; returns the output, or None (after a loud SKIP)
/// when the guest did not run it.
pub fn run_lab(lab: &Path, disks: &[&Path], script: &str, name: &str) -> Option<String> {
    let script_path = crate::common::tool_dir().join(name);
    std::fs::write(&script_path, script).unwrap();
    let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/lab-slot"));
    cmd.arg(lab.join("run.sh"));
    for d in disks {
        cmd.arg("--disk").arg(d);
    }
    let out = cmd.arg("--timeout").arg("300").arg(&script_path).output().expect("run the lab");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    if matches!(out.status.code(), Some(124) | Some(125)) {
        eprintln!("SKIP: the lab guest did not run the script (exit {:?})", out.status.code());
        return None;
    }
    assert!(out.status.success(), "guest script failed:\n{text}");
    Some(text)
}

/// The SHA-256 of `data` (hex) by coreutils' `sha256sum`, fed on its standard input: a
/// temporary file named per process was shared by the lab tests running at once, and each
/// hashed the other's data now and then (two kernel labs failed together under CI load).
pub fn sha256(data: &[u8]) -> String {
    use std::io::Write;
    use std::process::Stdio;
    let mut child =
        Command::new("sha256sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("sha256sum runs");
    child.stdin.take().expect("stdin").write_all(data).expect("feed sha256sum");
    let out = child.wait_with_output().expect("sha256sum finishes");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().to_string()
}
