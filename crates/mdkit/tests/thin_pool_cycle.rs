//! One writer per device across processes, and the way back for one failed pool without a
//! service restart (QA's repro-5):
//! - a pool whose metadata file system fills up fails (NEEDS_CHECK). While the service holds it,
//!   offline writers (`thin check --clear-needs-check`, an offline md create) are refused
//!   naming the device, and write nothing; read-only tools still work. `thin pool-deactivate`
//!   refuses while a thin volume is open, `--force` closes it and the failed pool (without its
//!   final commit), releasing the devices; the offline check then clears NEEDS_CHECK and
//!   `thin pool-activate` brings the pool back read-write with its thin volume and export, the
//!   data flushed before the failure intact — all while another volume of the same service
//!   kept serving one NBD connection that never dropped;
//! - a second `mdkit serve` (its own data directory) configured on a running pool's device
//!   files fails that pool with the in-use error and writes nothing to them.
//!
//! The metadata file system is a loop-mounted ext4 image (root only: skipped loudly
//! otherwise), filled to the last block: the pool's next commit needs a block there and fails
//! (ENOSPC), deterministically. Waits poll conditions with a hang guard; nothing asserts on
//! wall-clock time.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::Raw;
use common::{
    SMALL_POOL, Server, is_root, mdkit_err, mdkit_json, mdkit_ok, nbd_read, offline, pattern, require_tool, run,
    sha256, status_entry, wait_thin_status,
};
use serde_json::Value;

/// Hang guard for every wait (a guard only: no test checks how long anything took).
const HANG_GUARD: Duration = Duration::from_secs(120);

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Unmounts the metadata file system even when the test fails half-way.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A small ext4 (no blocks reserved for root: the service runs as root) mounted at `dir/mfs`.
fn mount_small_fs(dir: &Path) -> Mounted {
    let img = dir.join("mfs.img");
    let mnt = dir.join("mfs");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::File::create(&img).unwrap().set_len(32 << 20).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&img));
    run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt));
    Mounted(mnt)
}

/// Fills the file system of `dir` to its last block.
fn fill(dir: &Path) -> PathBuf {
    let filler = dir.join("filler");
    // dd fails with ENOSPC at the end: that is the point.
    let _ = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", filler.display()))
        .args(["bs=64k", "status=none"])
        .status()
        .unwrap();
    run(&mut Command::new("sync"));
    filler
}

/// `qemu-io` write of `data` at `offset` and a flush; whether both succeeded.
fn write_and_flush(srv: &Server, export: &str, offset: u64, data: &[u8]) -> bool {
    let f = srv.path(&format!("{export}-{offset}.src"));
    std::fs::write(&f, data).unwrap();
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -s {} {offset} {}", f.display(), data.len()))
        .args(["-c", "flush"])
        .arg(srv.uri(export))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out.status.success() && !text.contains("failed")
}

/// Waits until export `export` has no NBD client left (qemu-io's connection is closed by the
/// server after the client went).
fn wait_no_clients(srv: &Server, export: &str) {
    let start = Instant::now();
    let connections = || status_entry(&srv.status(), "exports", export)["connections"].as_u64();
    while connections() != Some(0) {
        assert!(start.elapsed() < HANG_GUARD, "clients of {export} never went: {:?}", connections());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One round trip on the long-lived connection to the other volume: a write, read back.
fn other_round_trip(c: &mut Raw, cookie: u64) {
    let data = pattern(cookie, 4096);
    assert_eq!(c.write(cookie, cookie * 4096, &data), 0, "write on the other volume's connection");
    assert_eq!(c.read(cookie + 1000, cookie * 4096, 4096), Ok(data), "read on the other volume's connection");
}

fn config(dir: &Path) -> PathBuf {
    let cfg = format!(
        r#"data_dir = "{d}"
[nbd]
listen = ["127.0.0.1:0", "unix:nbd.sock"]

[[volume]]
name = "other"
kind = "mem"
size = "16MiB"

[[export]]
name = "other"
volume = "other"

[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "{d}/mfs/pool0.meta"
metadata_size = "8MiB"
data = "pool0.data"
data_size = "64MiB"
block_size = "64KiB"
create = true

[[volume]]
name = "vol0"
kind = "thin"
pool = "pool0"
id = 0
size = "48MiB"
create = true

[[export]]
name = "vol0"
volume = "vol0"
"#,
        d = dir.display()
    );
    let path = dir.join("mdkit.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

#[test]
fn a_failed_pool_comes_back_by_deactivate_check_activate_while_another_volume_serves() {
    if !is_root() {
        eprintln!("SKIP: filling a loop-mounted file system under a pool's metadata needs root");
        return;
    }
    for (tool, package) in [("mkfs.ext4", "e2fsprogs"), ("qemu-io", "qemu-utils"), ("nbdcopy", "libnbd-bin")] {
        require_tool(tool, package);
    }
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in("/var/tmp").unwrap();
    let mounted = mount_small_fs(dir.path());
    let cfg = config(dir.path());
    let srv = Server::start_with_config(dir, cfg);
    let (meta, data) = (mounted.0.join("pool0.meta"), srv.path("pool0.data"));
    let mut other = Raw::open(&srv.tcp, "other", false, false);
    other_round_trip(&mut other, 1);

    // Flushed before the failure: must survive it.
    let before = pattern(51, 1 << 20);
    assert!(write_and_flush(&srv, "vol0", 0, &before), "{}", srv.log_text());
    let filler = fill(&mounted.0);
    // New mappings until a commit needs a metadata block the full file system cannot give.
    let mut offset = 1 << 20;
    while mdkit_json(&srv, &["thin", "status", "pool0", "--json"])["mode"] != "Fail" {
        assert!(offset < 48 << 20, "the pool never failed on a full file system:\n{}", srv.log_text());
        write_and_flush(&srv, "vol0", offset, &pattern(offset, 256 << 10));
        offset += 1 << 20;
    }
    let st = wait_thin_status(&srv, "pool0", "NEEDS_CHECK", |s| s["needs_check"] == true);
    assert_eq!(st["mode"], "Fail", "{st:#}");
    other_round_trip(&mut other, 2);

    // Offline writers are refused on the live pool's devices, and write nothing.
    let sums = (sha256(&meta), sha256(&data));
    let out = offline(&["thin", "check", p(&meta), "--clear-needs-check"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "check --clear-needs-check ran under the live pool: {e}");
    assert!(e.contains(&format!("{} is in use by another process", meta.display())), "{e}");
    assert!(e.contains("mdkit thin pool-deactivate POOL"), "{e}");
    let out = offline(&["create", "x", "--level", "raid1", "--force", p(&data), p(&meta)]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("is in use by another process"), "offline md create: {e}");
    assert_eq!((sha256(&meta), sha256(&data)), sums, "a refused offline writer changed a pool device");
    // Read-only tools still read it.
    let out = offline(&["thin", "check", p(&meta), "--json"]);
    let report: Value = serde_json::from_slice(&out.stdout).expect("check --json");
    assert_eq!(report["needs_check"], true, "{report:#}");
    assert!(offline(&["thin", "dump", p(&meta)]).status.success());

    // Deactivation: refused with the thin volume open, then forced.
    let e = mdkit_err(&srv, &["thin", "pool-deactivate", "pool0"]);
    assert!(e.contains("open thin volumes (vol0)") && e.contains("--force"), "{e}");
    std::fs::remove_file(&filler).unwrap();
    wait_no_clients(&srv, "vol0");
    let out = mdkit_ok(&srv, &["thin", "pool-deactivate", "pool0", "--force"]);
    assert!(out.contains("closed volume vol0") && out.contains("closed without its final commit"), "{out}");
    let st = srv.status();
    assert_eq!(status_entry(&st, "volumes", "pool0")["state"], "inactive", "{st:#}");
    assert!(st["volumes"].as_array().unwrap().iter().all(|v| v["name"] != "vol0"), "{st:#}");
    let ts = mdkit_json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(ts["mode"], "inactive", "{ts:#}");
    let e = mdkit_err(&srv, &["thin", "create", "pool0", "1", "--size", "4M"]);
    assert!(e.contains("is inactive") && e.contains("pool-activate pool0"), "{e}");
    other_round_trip(&mut other, 3);

    // The devices are free: the offline check clears NEEDS_CHECK.
    let out = offline(&["thin", "check", p(&meta), "--clear-needs-check"]);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));

    let out = mdkit_ok(&srv, &["thin", "pool-activate", "pool0"]);
    assert!(out.contains("opened volume vol0"), "{out}");
    let ts = mdkit_json(&srv, &["thin", "status", "pool0", "--json"]);
    assert!(ts["mode"] == "rw" && ts["needs_check"] == false, "{ts:#}");
    assert_eq!(nbd_read(&srv, "vol0", before.len()), before, "data flushed before the failure");
    let after = pattern(52, 1 << 20);
    assert!(write_and_flush(&srv, "vol0", 40 << 20, &after), "the activated pool takes writes:\n{}", srv.log_text());
    let ts = mdkit_json(&srv, &["thin", "status", "pool0", "--json"]);
    assert!(ts["mode"] == "rw", "{ts:#}");
    other_round_trip(&mut other, 4);
    assert!(srv.log_text().contains("closed without its final commit"), "the skipped commit is logged");
    drop(srv);
    drop(mounted);
}

#[test]
fn a_second_service_on_a_running_pools_files_fails_that_pool_and_writes_nothing() {
    let srv = Server::start(SMALL_POOL);
    let (meta, data) = (srv.path("pool0.meta"), srv.path("pool0.data"));
    let sums = (sha256(&meta), sha256(&data));
    let second = format!(
        r#"
[[volume]]
name = "ok"
kind = "mem"
size = "1MiB"

[[volume]]
name = "p2"
kind = "thin-pool"
metadata = "{}"
data = "{}"
create = true
"#,
        meta.display(),
        data.display()
    );
    let srv2 = Server::start(&second);
    let st = srv2.status();
    let p2 = status_entry(&st, "volumes", "p2");
    let e = p2["error"].as_str().unwrap_or_default();
    assert_eq!(p2["state"], "failed", "{st:#}");
    assert!(e.contains(&format!("{} is in use by another process", meta.display())), "{e}");
    assert_eq!(status_entry(&st, "volumes", "ok")["state"], "active", "{st:#}");
    assert_eq!((sha256(&meta), sha256(&data)), sums, "the second service wrote the first one's pool");
    drop(srv2);
    // Read-only offline tools still work on the live pool.
    let out = offline(&["thin", "check", p(&meta), "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ts = mdkit_json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(ts["mode"], "rw", "{ts:#}");
}

/// Two services may serve one image as file volumes (the benchmarks' A/A control runs two
/// identical services on one file): a file volume locks its file shared. A pool of another
/// service on that file is still refused, and so is a file volume on a running pool's file.
#[test]
fn file_volumes_of_two_services_share_an_image_and_keep_pools_out() {
    let srv = Server::start("[[volume]]\nname = \"f\"\nkind = \"file\"\npath = \"img\"\nsize = \"8MiB\"\n");
    let img = srv.path("img");
    let sum = sha256(&img);
    let srv2 = Server::start(&format!("[[volume]]\nname = \"f2\"\nkind = \"file\"\npath = \"{}\"\n", img.display()));
    assert_eq!(status_entry(&srv2.status(), "volumes", "f2")["state"], "active");
    let pool = format!(
        "[[volume]]\nname = \"p3\"\nkind = \"thin-pool\"\nmetadata = \"{}\"\ndata = \"p3.data\"\n\
         data_size = \"8MiB\"\ncreate = true\n",
        img.display()
    );
    let srv3 = Server::start(&pool);
    let p3 = status_entry(&srv3.status(), "volumes", "p3").clone();
    assert_eq!(p3["state"], "failed", "{p3}");
    assert!(p3["error"].as_str().unwrap_or_default().contains("is in use by another process"), "{p3}");
    assert_eq!(sha256(&img), sum, "the refused pool wrote nothing");
}
