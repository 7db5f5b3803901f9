//! A thin device the kernel made, opened through the service, in one boot of the lab
//! (`/work/shared/lab`; skips loudly without it, or with MDKIT_SKIP_LAB=1):
//! 1. the guest's dm-thin makes a pool on two host files, a thin device 0 with known data and
//!    a snapshot 1 of it (after which the origin moves on), records each device's sha256,
//!    removes the pool and waits;
//! 2. the host runs `mdkit serve` with a config that names the pool only (no volumes) and
//!    types what an operator types: `mdkit thin activate kpool ID --size 64M --export E` for
//!    the device and the snapshot; `nbdinfo` sees both exports and their mappings, `nbdcopy`
//!    reads them with the kernel's sha256; a write through each export (a partial write into
//!    blocks the snapshot shares, and one into blocks nobody mapped); a restart of the service
//!    brings both activations back; `mdkit thin deactivate` both, stop; `thin_check` passes;
//! 3. the guest runs thin_check, activates the pool again and reads mdkit's writes: each
//!    device's sha256 is the one the host read through NBD.
//!
//! The host and the guest meet through files in a shared directory (`run.sh --share`).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::lab_dir::lab;
use common::{Server, mdkit_ok, nbd_read, nbd_write_at, pattern, require_tool, restart, run, sha256};

const VOL_BYTES: usize = 64 << 20;

const GUEST: &str = r#"#!/bin/bash
set -e
vol=$((64 * 2048))
sz=$(blockdev --getsz /dev/vdb)
sha() { echo "$1 $2 $(dd if=/dev/mapper/thin$2 bs=1M iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1)"; }
dmsetup create pool --table "0 $sz thin-pool /dev/vda /dev/vdb 128 0"
dmsetup message pool 0 "create_thin 0"
dmsetup create thin0 --table "0 $vol thin /dev/mapper/pool 0"
yes 'made by dm-thin' | head -c 8388608 > /tmp/a
dd if=/tmp/a of=/dev/mapper/thin0 bs=1M count=8 oflag=direct conv=fsync 2>/dev/null
dd if=/tmp/a of=/dev/mapper/thin0 bs=1M seek=32 count=1 oflag=direct conv=fsync 2>/dev/null
dmsetup suspend thin0
dmsetup message pool 0 "create_snap 1 0"
dmsetup resume thin0
dmsetup create thin1 --table "0 $vol thin /dev/mapper/pool 1"
echo 'the origin moves on' | dd of=/dev/mapper/thin0 bs=4k seek=17 count=1 conv=sync,fsync oflag=direct 2>/dev/null
dmsetup message pool 0 "set_transaction_id 0 5"
for id in 0 1; do sha made $id; done | tee /host/made.tmp
for id in 0 1; do dmsetup remove thin$id; done
dmsetup remove pool
mv /host/made.tmp /host/made
for i in $(seq 1500); do [ -e /host/served ] && break; sleep 0.2; done
[ -e /host/served ] || { echo "the host never finished serving"; exit 1; }
thin_check /dev/vda
echo "guest thin_check: ok"
dmsetup create pool --table "0 $sz thin-pool /dev/vda /dev/vdb 128 0"
echo "after-status $(dmsetup status pool)"
for id in 0 1; do dmsetup create thin$id --table "0 $vol thin /dev/mapper/pool $id"; done
for id in 0 1; do sha after $id; done
for id in 0 1; do dmsetup remove thin$id; done
dmsetup remove pool
echo "=== done"
"#;

/// `PREFIX ID SHA` lines of the guest's output.
fn shas(text: &str, prefix: &str) -> Vec<(u64, String)> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.parse().ok()?, f.next()?.to_string()))
        })
        .collect()
}

/// Waits for `path` to appear while the guest runs; false when the guest ended first.
fn wait_for(path: &Path, child: &mut std::process::Child) -> bool {
    let start = Instant::now();
    loop {
        if path.exists() {
            return true;
        }
        if child.try_wait().unwrap().is_some() || start.elapsed() > Duration::from_secs(500) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The config an operator writes for a pool the kernel made: the pool, no volumes.
fn pool_only_config(dir: &Path) -> PathBuf {
    let cfg = format!(
        r#"data_dir = "{}"
[nbd]
listen = ["127.0.0.1:0", "unix:nbd.sock"]

[[volume]]
name = "kpool"
kind = "thin-pool"
metadata = "meta"
data = "data"
"#,
        dir.display()
    );
    let path = dir.join("mdkit.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

/// `nbdinfo --map` of an export as (offset, length, type) rows.
fn map(srv: &Server, export: &str) -> Vec<(u64, u64, u32)> {
    let out = run(Command::new("nbdinfo").arg("--map").arg(srv.uri(export)));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<u64> = l.split_whitespace().take(3).map(|x| x.parse().unwrap()).collect();
            (f[0], f[1], f[2] as u32)
        })
        .collect()
}

/// Reads an export whole; returns its bytes and their sha256.
fn read_export(srv: &Server, export: &str) -> (Vec<u8>, String) {
    let bytes = nbd_read(srv, export, VOL_BYTES);
    (bytes, sha256(&srv.path(&format!("{export}.dst"))))
}

/// The host's part: serve the kernel's pool, activate, read, write, restart, deactivate.
/// Returns the sha256 each device should have when the kernel reads it again.
fn serve_kernel_pool(dir: tempfile::TempDir, made: &[(u64, String)]) -> (Server, Vec<(u64, String)>) {
    let cfg = pool_only_config(dir.path());
    let srv = Server::start_with_config(dir, cfg);
    for (id, export) in [(0, "kthin0"), (1, "ksnap1")] {
        let out = mdkit_ok(&srv, &["thin", "activate", "kpool", &id.to_string(), "--size", "64M", "--export", export]);
        assert!(out.contains(&format!("volume kpool.{id}")) && out.contains(export), "{out}");
        let size = run(Command::new("nbdinfo").arg("--size").arg(srv.uri(export))).stdout;
        assert_eq!(String::from_utf8_lossy(&size).trim(), VOL_BYTES.to_string());
    }
    // The snapshot maps what the kernel wrote before it: 8 MiB at 0 and 1 MiB at 32 MiB.
    let m = map(&srv, "ksnap1");
    assert_eq!(m, [(0, 8 << 20, 0), (8 << 20, 24 << 20, 3), (32 << 20, 1 << 20, 0), (33 << 20, 31 << 20, 3)]);
    let mut images = Vec::new();
    for (id, export) in [(0, "kthin0"), (1, "ksnap1")] {
        let (bytes, sha) = read_export(&srv, export);
        assert_eq!((id, sha), made[id as usize], "export {export} reads what the kernel wrote");
        images.push(bytes);
    }

    // A partial write into blocks the snapshot shares (copy on write), one into unmapped blocks.
    let (a, b) = (pattern(18, 100 << 10), pattern(81, 192 << 10));
    nbd_write_at(&srv, "kthin0", (1 << 20) + 4096, &a);
    nbd_write_at(&srv, "ksnap1", 40 << 20, &b);
    images[0][(1 << 20) + 4096..][..a.len()].copy_from_slice(&a);
    images[1][40 << 20..][..b.len()].copy_from_slice(&b);

    // Restart: both activations are remembered; the data is there.
    let mut srv = restart(srv);
    let mut expect = Vec::new();
    for (id, export) in [(0u64, "kthin0"), (1, "ksnap1")] {
        let (bytes, sha) = read_export(&srv, export);
        assert!(bytes == images[id as usize], "{export} after restart");
        expect.push((id, sha));
    }
    assert_ne!(expect[0].1, made[0].1, "the write changed device 0");
    for id in ["0", "1"] {
        let out = mdkit_ok(&srv, &["thin", "deactivate", "kpool", id]);
        assert!(out.contains(&format!("removed volume kpool.{id}")), "{out}");
    }
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    let chk = Command::new("thin_check").arg(srv.path("meta")).output().unwrap();
    assert!(chk.status.success(), "thin_check: {}", String::from_utf8_lossy(&chk.stderr));
    (srv, expect)
}

#[test]
fn kernel_made_thin_device_is_activated_served_and_given_back() {
    require_tool("thin_check", "thin-provisioning-tools");
    require_tool("nbdinfo", "libnbd-bin");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("qemu-io", "qemu-utils");
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => {
            eprintln!("SKIP: kernel lab unavailable: {why}");
            return;
        }
    };
    let base = if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-activate-lab-").tempdir_in(base).unwrap();
    // The share outlives `dir`, which the service takes: a failing host part still lets the
    // guest finish instead of waiting for its timeout.
    let share_dir = tempfile::Builder::new().prefix("mdkit-activate-share-").tempdir_in(base).unwrap();
    let share = share_dir.path().to_path_buf();
    let (meta, data) = (dir.path().join("meta"), dir.path().join("data"));
    for (p, size) in [(&meta, 8u64 << 20), (&data, 128 << 20)] {
        std::fs::File::create(p).unwrap().set_len(size).unwrap();
    }
    let script = dir.path().join("activate-lab.sh");
    std::fs::write(&script, GUEST).unwrap();
    let mut child = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/lab-slot"))
        .arg(lab.join("run.sh"))
        .arg("--disk")
        .arg(&meta)
        .arg("--disk")
        .arg(&data)
        .arg("--share")
        .arg(&share)
        .args(["--timeout", "500"])
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the lab");

    let made = wait_for(&share.join("made"), &mut child);
    let served = made.then(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let made = shas(&std::fs::read_to_string(share.join("made")).unwrap(), "made ");
            assert_eq!(made.len(), 2, "{made:?}");
            serve_kernel_pool(dir, &made)
        }))
    });
    std::fs::write(share.join("served"), b"").unwrap();
    let res = child.wait_with_output().unwrap();
    let served = served.map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)));
    let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
    eprintln!("{text}");
    if matches!(res.status.code(), Some(124) | Some(125)) && !made {
        eprintln!("SKIP: the lab guest did not run the script (exit {:?})", res.status.code());
        return;
    }
    assert!(res.status.success() && made, "guest script failed:\n{text}");
    let (_srv, expect) = served.unwrap();
    assert!(text.contains("guest thin_check: ok"), "{text}");
    assert!(text.contains(" thin-pool 5 "), "the kernel's transaction id is kept:\n{text}");
    assert_eq!(shas(&text, "after "), expect, "the kernel reads what mdkit wrote");
}
