//! Thin pools and volumes in the service, end to end with the real binary, nbdcopy and
//! thin-provisioning-tools:
//! - a `kind = "thin-pool"` over an md raid1 (`data = "volume:md0"`) with a configured thin
//!   volume: formatted on first start (`create = true`, blank metadata), serves data over NBD;
//! - `mdkit thin snapshot/create/list/status` at run time: the snapshot keeps the point-in-time
//!   data while the origin is overwritten, the new volumes are exported;
//! - after a restart everything (configured and run-time volumes) reads back the same;
//! - after a clean stop `thin_check` accepts the metadata and `thin_dump` lists the devices with
//!   the mappings the service reported; `mdkit thin check` agrees;
//! - bad requests (duplicate id, unknown origin/pool, deleting a configured volume) get clear
//!   errors and change nothing; `thin delete` of a run-time volume frees its blocks.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::{
    MDKIT, Server, mdkit_err, mdkit_json as json, mdkit_ok, nbd_read, nbd_write_at, pattern, require_tool, restart, run,
};

const POOL_ON_MD: &str = r#"
[[volume]]
name = "md0"
kind = "md"
members = ["md0-a.img", "md0-b.img"]
member_size = "96MiB"
create = true
level = "raid1"

[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "8MiB"
data = "volume:md0"
block_size = "64KiB"
create = true

[[volume]]
name = "vol0"
kind = "thin"
pool = "pool0"
id = 0
size = "64MiB"
create = true

[[export]]
name = "vol0"
volume = "vol0"
"#;

#[test]
fn thin_pool_on_md_through_the_service_and_the_tools() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("qemu-io", "qemu-utils");
    require_tool("thin_check", "thin-provisioning-tools");
    let srv = Server::start(POOL_ON_MD);
    let st = srv.status();
    let names: Vec<&str> = st["volumes"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(names, ["md0", "pool0", "vol0"], "{st:#}");

    // Origin: 4 MiB at offset 0 and 1 MiB at 40 MiB; the rest stays unprovisioned.
    let a = pattern(1, 4 << 20);
    let b = pattern(2, 1 << 20);
    nbd_write_at(&srv, "vol0", 0, &a);
    nbd_write_at(&srv, "vol0", 40 << 20, &b);
    let mut expect_origin = vec![0u8; 64 << 20];
    expect_origin[..a.len()].copy_from_slice(&a);
    expect_origin[40 << 20..(40 << 20) + b.len()].copy_from_slice(&b);
    assert!(nbd_read(&srv, "vol0", 64 << 20) == expect_origin, "origin reads back");

    // Snapshot, then overwrite part of the origin: the snapshot keeps the old data.
    let out = mdkit_ok(&srv, &["thin", "snapshot", "pool0", "1", "0"]);
    assert!(out.contains("pool0.1"), "{out}");
    let c = pattern(3, 1 << 20);
    nbd_write_at(&srv, "vol0", 1 << 20, &c);
    let mut expect_new = expect_origin.clone();
    expect_new[1 << 20..2 << 20].copy_from_slice(&c);
    assert!(nbd_read(&srv, "vol0", 64 << 20) == expect_new, "origin after overwrite");
    assert!(nbd_read(&srv, "pool0.1", 64 << 20) == expect_origin, "snapshot keeps the point in time");

    // A fresh thin device through the CLI.
    mdkit_ok(&srv, &["thin", "create", "pool0", "2", "--size", "16M", "--export", "scratch"]);
    let d = pattern(4, 2 << 20);
    nbd_write_at(&srv, "scratch", 8 << 20, &d);

    let list = json(&srv, &["thin", "list", "pool0", "--json"]);
    let rows = list["thins"].as_array().unwrap();
    let row = |id: u64| rows.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("id {id} in {list:#}"));
    // 64 KiB blocks: origin 4 MiB + 1 MiB = 80 blocks mapped; 16 of them were broken away from
    // the snapshot by the overwrite. Device 2: 32 blocks.
    assert_eq!(row(0)["mapped_blocks"], 80, "{list:#}");
    assert_eq!(row(0)["exclusive_blocks"], 16, "{list:#}");
    assert_eq!(row(1)["mapped_blocks"], 80, "{list:#}");
    assert_eq!(row(2)["mapped_blocks"], 32, "{list:#}");
    let status = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(status["used_data_blocks"], 80 + 16 + 32, "{status:#}");
    assert_eq!(status["mode"], "rw", "{status:#}");
    assert_eq!(status["needs_check"], false);
    let text = mdkit_ok(&srv, &["thin", "status", "pool0"]);
    assert!(text.contains(&format!("{}/", 80 + 16 + 32)), "dmsetup-style status line: {text}");

    // Bad requests: clear errors, nothing changed.
    let e = mdkit_err(&srv, &["thin", "create", "pool0", "2", "--size", "16M"]);
    assert!(e.contains('2') && (e.contains("exist") || e.contains("in use")), "{e}");
    let e = mdkit_err(&srv, &["thin", "snapshot", "pool0", "7", "5"]);
    assert!(e.contains('5'), "{e}");
    let e = mdkit_err(&srv, &["thin", "create", "nopool", "3", "--size", "16M"]);
    assert!(e.contains("nopool"), "{e}");
    let e = mdkit_err(&srv, &["thin", "delete", "pool0", "0"]);
    assert!(e.contains("config"), "{e}");
    let after = json(&srv, &["thin", "list", "pool0", "--json"]);
    assert_eq!(after["thins"].as_array().unwrap().len(), 3, "{after:#}");

    // Everything comes back after a restart: configured and run-time volumes, exports, data.
    let srv = restart(srv);
    assert!(nbd_read(&srv, "vol0", 64 << 20) == expect_new, "origin after restart");
    assert!(nbd_read(&srv, "pool0.1", 64 << 20) == expect_origin, "snapshot after restart");
    let scratch = nbd_read(&srv, "scratch", 16 << 20);
    assert!(scratch[8 << 20..10 << 20] == d[..] && scratch[..8 << 20].iter().all(|x| *x == 0));

    // Delete the run-time device: its blocks are free again.
    mdkit_ok(&srv, &["thin", "delete", "pool0", "2"]);
    let status = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(status["used_data_blocks"], 80 + 16, "{status:#}");

    // Clean stop, then the real tools read the metadata.
    let mut srv = srv;
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    let meta = srv.path("pool0.meta");
    let chk = Command::new("thin_check").arg(&meta).output().unwrap();
    assert!(
        chk.status.success(),
        "thin_check: {}{}",
        String::from_utf8_lossy(&chk.stdout),
        String::from_utf8_lossy(&chk.stderr)
    );
    let dump = String::from_utf8(run(Command::new("thin_dump").arg(&meta)).stdout).unwrap();
    assert_eq!(dump.matches("<device dev_id=").count(), 2, "{dump}");
    assert!(
        dump.contains("dev_id=\"0\" mapped_blocks=\"80\"") && dump.contains("dev_id=\"1\" mapped_blocks=\"80\""),
        "{dump}"
    );
    assert!(dump.contains("data_block_size=\"128\""), "{dump}");
    let ours = Command::new(MDKIT).args(["thin", "check"]).arg(&meta).output().unwrap();
    assert!(ours.status.success(), "mdkit thin check: {}", String::from_utf8_lossy(&ours.stderr));
}

/// QA round 3: `grow md0 --array-size` (what a shrink refusal tells the operator to do first)
/// under a live pool cut the pool's data device; after the reshape and a restart the pool failed
/// for good ("data device holds 2012 blocks but the metadata maps 3024"). Making an array that a
/// volume is built on smaller is refused, naming that volume, and changes nothing; growing it
/// back to max, or any size at or above the current one, still works.
#[test]
fn an_array_under_a_pool_is_not_made_smaller() {
    let srv = Server::start(POOL_ON_MD);
    let size = srv.status()["volumes"][0]["size_bytes"].as_u64().unwrap();
    let half = format!("{}K", size / 2 / 1024);
    let e = mdkit_err(&srv, &["grow", "md0", "--array-size", &half]);
    assert!(e.contains("thin pool \"pool0\" (its data device)") && e.contains("nothing was changed"), "{e}");
    let e = mdkit_err(&srv, &["grow", "md0", "--size", &half]);
    assert!(e.contains("--size would make the array smaller"), "{e}");
    assert_eq!(srv.status()["volumes"][0]["size_bytes"].as_u64(), Some(size), "unchanged");
    mdkit_ok(&srv, &["grow", "md0", "--array-size", "max"]);
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(st["mode"], "rw", "{st:#}");
}
