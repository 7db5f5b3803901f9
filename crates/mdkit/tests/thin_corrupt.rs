//! Thin pools in the service: the README's `mdkit thin` command lines work as written, and a
//! pool whose metadata is damaged is refused without being written to or formatted, while the
//! service keeps serving everything else.
//! - `thin pool-create / create / snapshot / status / list / delete / check` exactly as README.md
//!   shows them (relative paths, `--block-size 64K`), then thin_check accepts the metadata;
//!   `pool-create` on a device a running pool uses is refused, even with `--force`;
//! - a run-time pool with a damaged btree node, then with its superblock zeroed: after a restart
//!   it is not opened (the log names the block and thin_restore), the other export still
//!   serves, neither pool file changed; pool-create refuses the lost pool unless `--force`;
//! - a config pool (`create = true`) whose superblock was zeroed is never formatted anew: its
//!   files stay byte for byte the same and the error names block 0.

use crate::common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    MDKIT, Server, expect_err, expect_ok, nbd_read, nbd_write_at, pattern, read_file_at, require_tool, restart, run,
    sha256,
};
use serde_json::Value;

/// `mdkit ARGS --socket ...` run from the data directory (README paths are relative).
fn mdkit_in_dir(srv: &Server, args: &[&str]) -> Output {
    Command::new(MDKIT).args(args).arg("--socket").arg(&srv.control).current_dir(srv.dir.path()).output().unwrap()
}

fn ok(srv: &Server, args: &[&str]) -> String {
    expect_ok(srv, args, mdkit_in_dir(srv, args))
}

fn err(srv: &Server, args: &[&str]) -> String {
    expect_err(args, mdkit_in_dir(srv, args))
}

fn json(srv: &Server, args: &[&str]) -> Value {
    serde_json::from_str(&ok(srv, args)).unwrap()
}

fn thin_check_clean(meta: &Path) {
    let chk = Command::new("thin_check").arg(meta).output().unwrap();
    assert!(
        chk.status.success(),
        "thin_check {}: {}{}",
        meta.display(),
        String::from_utf8_lossy(&chk.stdout),
        String::from_utf8_lossy(&chk.stderr)
    );
}

fn zero_superblock(meta: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(meta).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(&[0u8; 4096]).unwrap();
    f.sync_all().unwrap();
}

fn flip_byte(path: &Path, offset: u64) {
    use std::io::{Seek, SeekFrom, Write};
    let b = read_file_at(path, offset, 1)[0];
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&[b ^ 0x5a]).unwrap();
    f.sync_all().unwrap();
}

/// Starts a stopped server again on its directory and config.
fn start_again(mut srv: Server) -> Server {
    let dir = std::mem::replace(&mut srv.dir, tempfile::tempdir().unwrap());
    let cfg = srv.config_path.clone();
    drop(srv);
    Server::start_with_config(dir, cfg)
}

fn stop(srv: &mut Server) {
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
}

/// Another volume, exported, that must keep serving whatever happens to the pool.
const OTHER_EXPORT: &str = r#"
[[volume]]
name = "plain"
kind = "file"
path = "plain.img"
size = "4MiB"

[[export]]
name = "plain"
volume = "plain"
"#;

const POOL_CREATE: [&str; 13] = [
    "thin",
    "pool-create",
    "tp",
    "--metadata",
    "tp.meta",
    "--data",
    "tp.data",
    "--block-size",
    "64K",
    "--metadata-size",
    "8M",
    "--data-size",
    "64M",
];

#[test]
fn readme_thin_commands_then_a_lost_superblock_is_refused_and_the_rest_keeps_serving() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("thin_check", "thin-provisioning-tools");
    let srv = Server::start(OTHER_EXPORT);
    let plain = pattern(9, 1 << 20);
    nbd_write_at(&srv, "plain", 0, &plain);

    let out = ok(&srv, &POOL_CREATE);
    assert!(out.contains("created thin pool tp (64 KiB blocks)"), "{out}");
    let out = ok(&srv, &["thin", "create", "tp", "0", "--size", "16M"]);
    assert!(out.contains("volume tp.0") && out.contains("\"tp.0\""), "{out}");
    let a = pattern(1, 1 << 20);
    nbd_write_at(&srv, "tp.0", 0, &a);
    let out = ok(&srv, &["thin", "snapshot", "tp", "1", "0"]);
    assert!(out.contains("tp.1"), "{out}");
    ok(&srv, &["thin", "create", "tp", "2", "--size", "8M", "--name", "scratch", "--no-export"]);
    let text = ok(&srv, &["thin", "status", "tp"]);
    assert!(text.contains("16/1024") && text.contains(" rw "), "dmsetup-style line with 16 used of 1024: {text}");
    let st = json(&srv, &["thin", "status", "tp", "--json"]);
    assert_eq!((st["used_data_blocks"].as_u64(), st["mode"].as_str()), (Some(16), Some("rw")), "{st:#}");
    let text = ok(&srv, &["thin", "list", "tp"]);
    assert!(text.lines().count() == 4 && text.contains("scratch"), "{text}");
    let list = json(&srv, &["thin", "list", "tp", "--json"]);
    let rows = list["thins"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["mapped_blocks"].as_u64().unwrap()).collect::<Vec<_>>(), [16, 16, 0]);
    let out = ok(&srv, &["thin", "delete", "tp", "1"]);
    assert!(out.contains("deleted thin device 1") && out.contains("removed volume tp.1"), "{out}");
    assert!(nbd_read(&srv, "tp.0", 1 << 20) == a);

    // The metadata belongs to the running pool: pool-create refuses it, even with --force.
    let mut again = POOL_CREATE;
    again[2] = "tp2";
    let e = err(&srv, &again);
    assert!(e.contains("already used by thin pool \"tp\""), "{e}");
    let e = err(&srv, &[&again[..], &["--force"]].concat());
    assert!(e.contains("already used by thin pool \"tp\""), "--force: {e}");
    let bad_block = ["--metadata-size", "1M", "--data-size", "1M", "--block-size", "3K"];
    let e = err(
        &srv,
        &[&["thin", "pool-create", "tp3", "--metadata", "x.meta", "--data", "x.data"][..], &bad_block].concat(),
    );
    assert!(e.contains("3K") || e.contains("3072"), "{e}");
    assert!(!srv.path("x.meta").exists() && !srv.path("x.data").exists(), "a refused pool-create left its files");

    let mut srv = restart(srv);
    assert!(nbd_read(&srv, "tp.0", 1 << 20) == a, "run-time thin volume after a restart");
    stop(&mut srv);
    let meta = srv.path("tp.meta");
    thin_check_clean(&meta);
    run(Command::new(MDKIT).args(["thin", "check", "tp.meta"]).current_dir(srv.dir.path()));

    // A damaged btree node (the top-level mapping node, checksum broken): refused, named.
    let root = u64::from_le_bytes(read_file_at(&meta, 320, 8).try_into().unwrap());
    flip_byte(&meta, root * 4096 + 100);
    let hashes = (sha256(&meta), sha256(&srv.path("tp.data")));
    let mut srv = start_again(srv);
    assert!(nbd_read(&srv, "plain", 1 << 20) == plain, "the other export keeps serving");
    let log = srv.log_text();
    assert!(log.contains(&format!("block {root}: checksum mismatch")) && log.contains("thin_restore"), "{log}");
    stop(&mut srv);
    assert_eq!((sha256(&meta), sha256(&srv.path("tp.data"))), hashes, "pool files unchanged");
    flip_byte(&meta, root * 4096 + 100);

    // Lose the superblock: the next start must neither open nor format the pool.
    zero_superblock(&meta);
    let (meta_hash, data_hash) = (sha256(&meta), sha256(&srv.path("tp.data")));
    let mut srv = start_again(srv);
    assert!(nbd_read(&srv, "plain", 1 << 20) == plain, "the other export keeps serving");
    let st = srv.status();
    let open: Vec<&str> = st["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["state"] != "failed")
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert!(!open.contains(&"tp") && !open.contains(&"tp.0"), "{open:?}");
    let log = srv.log_text();
    assert!(log.contains("block 0") && log.contains("thin_restore") && log.contains("tp.meta"), "{log}");
    let e = err(&srv, &["thin", "status", "tp"]);
    assert!(e.contains("tp"), "{e}");
    // pool-create will not format over the lost pool either, unless forced.
    let e = err(&srv, &POOL_CREATE);
    assert!(e.contains("superblock of a pool was lost") && e.contains("--force"), "{e}");
    assert_eq!((sha256(&meta), sha256(&srv.path("tp.data"))), (meta_hash, data_hash), "pool files unchanged");
    let out = ok(&srv, &[&POOL_CREATE[..], &["--force"]].concat());
    assert!(out.contains("created thin pool tp"), "{out}");
    let list = json(&srv, &["thin", "list", "tp", "--json"]);
    assert_eq!(list["thins"].as_array().map(Vec::len), Some(0), "a fresh pool: {list:#}");
    stop(&mut srv);
    thin_check_clean(&meta);
}

/// The status entry of volume `name`.
fn volume_status(srv: &Server, name: &str) -> Value {
    let st = srv.status();
    let v = st["volumes"].as_array().unwrap().iter().find(|v| v["name"] == name).cloned();
    v.unwrap_or_else(|| panic!("volume {name} not in status: {st:#}"))
}

#[test]
fn a_remembered_pool_that_fails_at_start_is_listed_failed_and_its_verbs_say_why() {
    let mut srv = Server::start(OTHER_EXPORT);
    ok(&srv, &POOL_CREATE);
    ok(&srv, &["thin", "create", "tp", "0", "--size", "8M"]);
    assert_ne!(volume_status(&srv, "tp")["state"], "failed");
    stop(&mut srv);
    zero_superblock(&srv.path("tp.meta"));

    let srv = start_again(srv);
    assert!(nbd_read(&srv, "plain", 1 << 20).len() == 1 << 20, "the other export serves");
    let pool = volume_status(&srv, "tp");
    let error = pool["error"].as_str().unwrap_or_default();
    assert_eq!((pool["state"].as_str(), pool["kind"].as_str()), (Some("failed"), Some("thin-pool")), "{pool:#}");
    assert!(error.contains("block 0") && error.contains("tp.meta"), "the reason names the block: {pool:#}");
    assert_eq!(pool["origin"], "thin-pools.json", "{pool:#}");
    let thin = volume_status(&srv, "tp.0");
    assert_eq!(thin["state"], "failed", "its thin volume is failed too: {thin:#}");
    assert!(thin["error"].as_str().unwrap_or_default().contains("tp"), "{thin:#}");
    let st = srv.status();
    let export = st["exports"].as_array().unwrap().iter().find(|e| e["name"] == "tp.0").cloned().unwrap_or_default();
    assert_eq!(export["state"], "failed", "the thin volume's export is listed failed: {st:#}");
    for verb in [&["thin", "status", "tp"][..], &["thin", "list", "tp"], &["thin", "create", "tp", "5", "--size", "4M"]]
    {
        let e = err(&srv, verb);
        assert!(e.contains("failed to open") && e.contains("block 0"), "mdkit {verb:?} says why: {e}");
    }
}

const CONFIG_POOL: &str = r#"
[[volume]]
name = "cp"
kind = "thin-pool"
metadata = "cp.meta"
metadata_size = "8MiB"
data = "cp.data"
data_size = "32MiB"
create = true

[[volume]]
name = "cv"
kind = "thin"
pool = "cp"
id = 0
size = "8MiB"
create = true

[[export]]
name = "cv"
volume = "cv"
"#;

/// Starts `mdkit serve` on an existing directory and returns its log once it either exited
/// (a refused config volume may stop the whole service) or served and was stopped.
fn start_or_exit(dir: &Path, cfg: &Path) -> String {
    let log_path = dir.join("mdkit-2.log");
    let mut child = Command::new(MDKIT)
        .args(["serve", "--config"])
        .arg(cfg)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let control = dir.join("mdkit.sock");
    let _ = std::fs::remove_file(&control);
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return std::fs::read_to_string(&log_path).unwrap_or_default();
        }
        let ready = control.exists()
            && Command::new(MDKIT)
                .args(["status", "--socket"])
                .arg(&control)
                .output()
                .is_ok_and(|o| o.status.success());
        if ready {
            // SAFETY: kill(2) on our own child's pid.
            assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
            let _ = child.wait();
            return std::fs::read_to_string(&log_path).unwrap_or_default();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "mdkit neither served nor exited");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_config_pool_with_a_zeroed_superblock_is_never_formatted_anew() {
    require_tool("qemu-io", "qemu-utils");
    let srv = Server::start(CONFIG_POOL);
    nbd_write_at(&srv, "cv", 0, &pattern(5, 256 << 10));
    let mut srv = srv;
    stop(&mut srv);
    let meta = srv.path("cp.meta");
    zero_superblock(&meta);
    let hashes = (sha256(&meta), sha256(&srv.path("cp.data")));
    let log = start_or_exit(srv.dir.path(), &srv.config_path);
    let keep = srv.dir.path();
    assert!(
        log.contains("block 0") && log.contains("thin_restore") && log.contains("superblock of a pool was lost"),
        "{log}"
    );
    assert!(!log.contains("formatted a new thin pool"), "{log}");
    assert_eq!((sha256(&keep.join("cp.meta")), sha256(&keep.join("cp.data"))), hashes, "pool files unchanged");
}
