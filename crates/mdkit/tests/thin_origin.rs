//! External-origin thin volumes through the real `mdkit serve`, qemu-io, nbdcopy and nbdinfo:
//! - a config volume with `external_origin` reads the origin file where it is unmapped and
//!   zeroes past it; a partial write keeps the rest of the origin's block;
//! - `mdkit thin create --external-origin` does the same at run time, block status reports the
//!   origin's range as data, a snapshot of it gets the same origin, and both are remembered
//!   across a restart;
//! - an origin that cannot be opened is refused before the thin device exists;
//! - the origin file is never written.

use crate::common;

use std::process::Command;

use common::{Server, mdkit_err, mdkit_json, mdkit_ok, nbd_read, nbd_write_at, pattern, require_tool, restart, run};

const MIB: usize = 1 << 20;

fn config(dir: &std::path::Path) -> String {
    format!(
        r#"data_dir = "{}"
[nbd]
listen = ["127.0.0.1:0", "unix:nbd.sock"]

[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "4MiB"
data = "pool0.data"
data_size = "32MiB"
create = true

[[volume]]
name = "vm1"
kind = "thin"
pool = "pool0"
id = 1
size = "16MiB"
create = true
external_origin = "golden.img"

[[export]]
name = "vm1"
volume = "vm1"
"#,
        dir.display()
    )
}

/// The origin's bytes, then zeroes up to `len`.
fn over_origin(golden: &[u8], len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    v[..golden.len()].copy_from_slice(golden);
    v
}

#[test]
fn thin_volumes_over_an_external_origin_file() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdinfo", "libnbd-bin");
    let base = if std::path::Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in(base).unwrap();
    let golden = pattern(3, 4 * MIB);
    std::fs::write(dir.path().join("golden.img"), &golden).unwrap();
    let cfg = dir.path().join("mdkit.toml");
    std::fs::write(&cfg, config(dir.path())).unwrap();
    let srv = Server::start_with_config(dir, cfg);
    let golden_path = srv.path("golden.img");

    // Config volume: the origin, zeroes past it; a partial write keeps the rest of its block.
    let mut vm1 = over_origin(&golden, 16 * MIB);
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == vm1, "unwritten vm1 reads the origin");
    let w = pattern(4, 4096);
    nbd_write_at(&srv, "vm1", MIB as u64 + 4096, &w);
    vm1[MIB + 4096..MIB + 8192].copy_from_slice(&w);
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == vm1, "after a partial write");

    // Run time: create over the origin, block status, a snapshot inherits the origin.
    let e = mdkit_err(&srv, &["thin", "create", "pool0", "4", "--size", "8M", "--external-origin", "/nonexistent.img"]);
    assert!(e.contains("external origin /nonexistent.img"), "{e}");
    let st = mdkit_json(&srv, &["thin", "status", "pool0", "--json"]);
    assert!(st["thins"].as_array().unwrap().iter().all(|t| t["id"] != 4), "no device 4 was created: {st:#}");
    let g = golden_path.to_str().unwrap();
    let out =
        mdkit_ok(&srv, &["thin", "create", "pool0", "2", "--size", "8M", "--external-origin", g, "--export", "vm2"]);
    assert!(out.contains(&format!("over external origin {g}")), "{out}");
    let mut vm2 = over_origin(&golden, 8 * MIB);
    let w = pattern(5, 64 << 10);
    nbd_write_at(&srv, "vm2", 5 * MIB as u64, &w);
    vm2[5 * MIB..5 * MIB + w.len()].copy_from_slice(&w);
    assert!(nbd_read(&srv, "vm2", 8 * MIB) == vm2);
    let map = String::from_utf8(run(Command::new("nbdinfo").args(["--map", &srv.uri("vm2")])).stdout).unwrap();
    let rows: Vec<Vec<&str>> = map.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0][..3], ["0", "4194304", "0"], "the origin's range is data:\n{map}");
    assert!(rows.iter().any(|r| r[..3] == ["5242880", "65536", "0"]), "the written block is data:\n{map}");
    mdkit_ok(&srv, &["thin", "snapshot", "pool0", "3", "2"]);
    assert!(nbd_read(&srv, "pool0.3", 8 * MIB) == vm2, "the snapshot reads through the same origin");

    let srv = restart(srv);
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == vm1, "vm1 after restart");
    assert!(nbd_read(&srv, "vm2", 8 * MIB) == vm2, "vm2 remembers its origin");
    assert!(nbd_read(&srv, "pool0.3", 8 * MIB) == vm2, "so does the snapshot");
    let vols = srv.status()["volumes"].clone();
    let v2 = vols.as_array().unwrap().iter().find(|v| v["name"] == "pool0.2").expect("volume pool0.2");
    assert_eq!(v2["details"]["external_origin"]["size_bytes"], 4 * MIB, "{v2:#}");
    assert!(std::fs::read(&golden_path).unwrap() == golden, "the origin file is unchanged");
}

#[test]
fn a_grown_origin_is_taken_at_pool_resize_not_before() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let base = if std::path::Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in(base).unwrap();
    let mut golden = pattern(5, 4 * MIB);
    std::fs::write(dir.path().join("golden.img"), &golden).unwrap();
    let cfg = dir.path().join("mdkit.toml");
    std::fs::write(&cfg, config(dir.path())).unwrap();
    let srv = Server::start_with_config(dir, cfg);
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == over_origin(&golden, 16 * MIB));

    // The golden image grows by 4 MiB: vm1 keeps reading zeroes there until the pool is
    // resized (dm-thin samples the origin's size at resume, not per request).
    let before = over_origin(&golden, 16 * MIB);
    golden.extend_from_slice(&pattern(6, 4 * MIB));
    std::fs::write(srv.path("golden.img"), &golden).unwrap();
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == before, "the size is not sampled behind the operator's back");

    let out = mdkit_ok(&srv, &["thin", "pool-resize", "pool0"]);
    assert!(out.contains("vm1 external origin: grown to 8388608 bytes (was 4194304)"), "{out}");
    assert!(nbd_read(&srv, "vm1", 16 * MIB) == over_origin(&golden, 16 * MIB), "vm1 reads the grown origin");
    let st = srv.status();
    let vm1 = st["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "vm1").unwrap();
    assert_eq!(vm1["details"]["external_origin"]["size_bytes"], 8 * MIB, "{vm1:#}");
    let out = mdkit_ok(&srv, &["thin", "pool-resize", "pool0"]);
    assert!(out.contains("vm1 external origin: unchanged at 8388608 bytes"), "{out}");
}

#[test]
fn an_md_origin_grown_with_mdkit_grow_is_taken_at_once() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start(
        r#"
[[volume]]
name = "md0"
kind = "md"
members = ["m0.img", "m1.img"]
member_size = "8MiB"
create = true
level = "raid1"

[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "4MiB"
data = "pool0.data"
data_size = "32MiB"
create = true

[[volume]]
name = "vm1"
kind = "thin"
pool = "pool0"
id = 1
size = "32MiB"
create = true
external_origin = "volume:md0"

[[export]]
name = "md0"
volume = "md0"

[[export]]
name = "vm1"
volume = "vm1"
"#,
    );
    let md_bytes = |srv: &Server| {
        let out = run(Command::new("nbdinfo").arg("--size").arg(srv.uri("md0"))).stdout;
        String::from_utf8_lossy(&out).trim().parse::<usize>().unwrap()
    };
    let old = md_bytes(&srv);
    nbd_write_at(&srv, "md0", 0, &pattern(7, MIB));
    assert!(nbd_read(&srv, "vm1", 32 * MIB) == over_origin(&nbd_read(&srv, "md0", old), 32 * MIB));

    for m in ["m0.img", "m1.img"] {
        std::fs::OpenOptions::new().write(true).open(srv.path(m)).unwrap().set_len(16 << 20).unwrap();
    }
    let out = mdkit_ok(&srv, &["grow", "md0", "--size", "max", "--assume-clean"]);
    let new = md_bytes(&srv);
    assert!(new > old + 4 * MIB, "md0 grew from {old} to {new}");
    assert!(out.contains(&format!("thin volume vm1 reads its external origin up to byte {new}")), "{out}");
    // Data in the grown part of the array shows through vm1's unmapped blocks.
    nbd_write_at(&srv, "md0", old as u64, &pattern(8, 2 * MIB));
    let md0 = nbd_read(&srv, "md0", new);
    assert!(nbd_read(&srv, "vm1", 32 * MIB) == over_origin(&md0, 32 * MIB), "vm1 reads the grown md0");
}
