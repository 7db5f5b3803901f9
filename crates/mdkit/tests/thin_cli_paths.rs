//! `mdkit thin` flags no other test ran, end to end with the real binary, qemu-io and
//! thin-provisioning-tools as the oracle:
//! - `thin pool-create --low-water-blocks B --no-space-timeout-s S`: the printed config keeps
//!   both; at B + 1 free data blocks nothing is reported, one block more (B free, dm-thin's
//!   `free <= mark`) and `thin status` says "free data blocks are down to the low-water mark (B)", the pool logs its warning and the
//!   service raises `LowWater`; out of data space a write queues (counted), then fails with
//!   ENOSPC instead of hanging, the pool reports `out_of_data_space` and raises
//!   `OutOfDataSpace`; after a restart the remembered pool has the same mark and timeout, and a
//!   write still fails rather than hangs;
//! - `thin repair --transaction-id N --nr-data-blocks M`: the repaired superblock carries
//!   them when they are above what was salvaged (mdkit's and thin_dump's XML agree), values
//!   below change nothing (every mapping kept), and `--nr-data-blocks` brings back the
//!   mappings of a superblock whose data space map lost its size.
//!
//! Waits poll with generous hang guards; nothing asserts on wall-clock time.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    SMALL_POOL as POOL, Server, mdkit_json as json, mdkit_ok, nbd_write_at, offline_ok, pattern, require_tool, restart,
    run, wait_thin_status as wait_status,
};
use mdkit_thin::meta::Superblock;
use mdkit_thin::meta::block::{BlockKind, seal};
use serde_json::Value;

/// Hang guard for every wait (a guard only: the tests never check how long anything took).
const HANG_GUARD: Duration = Duration::from_secs(120);
const BLOCK_BYTES: usize = 64 << 10;

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Polls the service log until it contains `want`.
fn wait_log(srv: &Server, want: &str) -> String {
    let start = Instant::now();
    loop {
        let log = srv.log_text();
        if log.contains(want) {
            return log;
        }
        assert!(start.elapsed() < HANG_GUARD, "{want:?} never logged:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `qemu-io write` of `len_bytes` at `offset_bytes`, expected to fail; its stdout and stderr.
/// The hang guard kills a write that never completes (the bug the timeout exists for).
fn nbd_write_failing(srv: &Server, export: &str, offset_bytes: u64, len_bytes: usize) -> String {
    let mut child = Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -P 0x5a {offset_bytes} {len_bytes}"))
        .arg(srv.uri(export))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > HANG_GUARD {
            let _ = child.kill();
            panic!("a write out of data space hangs: no_space_timeout_s did not fail it\nlog:\n{}", srv.log_text());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out: Output = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "the write should fail: {text}");
    text
}

/// The pool's options as `pool-create` set them: mark 16 blocks, 1 s timeout, queueing.
fn assert_pool_options(st: &Value) {
    assert_eq!(st["low_water_blocks"], 16, "{st:#}");
    assert_eq!(st["no_space_timeout_ms"], 1000, "{st:#}");
    assert_eq!(st["error_if_no_space"], false, "{st:#}");
    assert_eq!(st["total_data_blocks"], 64, "4 MiB of 64 KiB blocks: {st:#}");
}

#[test]
fn pool_create_low_water_and_no_space_timeout_take_effect_and_survive_restart() {
    require_tool("qemu-io", "qemu-utils");
    let srv = Server::start("");
    // Absolute paths: the CLI resolves relative ones against its own working directory.
    let (meta, data) = (srv.path("pool0.meta"), srv.path("pool0.data"));
    let args = ["--metadata-size", "4M", "--data-size", "4M", "--low-water-blocks", "16", "--no-space-timeout-s", "1"];
    let create = [&["thin", "pool-create", "pool0", "--metadata", p(&meta), "--data", p(&data)][..], &args].concat();
    let out = mdkit_ok(&srv, &create);
    assert!(
        out.contains("low_water_blocks = 16") && out.contains("no_space_timeout_s = 1"),
        "equivalent config: {out}"
    );
    assert_pool_options(&json(&srv, &["thin", "status", "pool0", "--json"]));
    mdkit_ok(&srv, &["thin", "create", "pool0", "1", "--size", "16M", "--export", "v"]);

    // 47 of 64 blocks used: 17 free is above the mark.
    nbd_write_at(&srv, "v", 0, &pattern(1, 47 * BLOCK_BYTES));
    let st = wait_status(&srv, "pool0", "47 used blocks", |st| st["used_data_blocks"] == 47);
    assert_eq!(st["low_water_reached"], false, "{st:#}");
    let text = mdkit_ok(&srv, &["thin", "status", "pool0"]);
    assert!(!text.contains("low-water"), "{text}");
    // One block more: 16 free, the mark reached (dm-thin: free_blocks <= low_water_blocks).
    nbd_write_at(&srv, "v", 47 * BLOCK_BYTES as u64, &pattern(2, BLOCK_BYTES));
    let st = wait_status(&srv, "pool0", "low water", |st| st["low_water_reached"] == true);
    assert_eq!(st["used_data_blocks"], 48, "{st:#}");
    let text = mdkit_ok(&srv, &["thin", "status", "pool0"]);
    assert!(text.contains("free data blocks are down to the low-water mark (16)"), "{text}");
    // dm-thin's "reached low water mark for data device: sending event", and the event.
    let log = wait_log(&srv, "LowWater event detected on thin pool pool0");
    assert!(log.contains("thin pool data space reached the low-water mark"), "{log}");

    // 2 MiB needs 32 blocks, 15 are free: the rest queues, then fails after the timeout.
    let failed = nbd_write_failing(&srv, "v", 4 << 20, 2 << 20);
    assert!(failed.contains("No space left on device"), "ENOSPC: {failed}");
    let st = wait_status(&srv, "pool0", "out_of_data_space", |st| st["mode"] == "out_of_data_space");
    assert_eq!(st["used_data_blocks"], 64, "{st:#}");
    assert!(st["status"].as_str().unwrap().contains("queue_if_no_space"), "{st:#}");
    let c = &st["counters"];
    assert!(c["no_space_waits"].as_u64() >= Some(1) && c["no_space_errors"].as_u64() >= Some(1), "queued: {st:#}");
    let log = wait_log(&srv, "OutOfDataSpace event detected on thin pool pool0");
    assert!(log.contains("out of data space: queueing writes for up to 1 s"), "{log}");

    // The pool is remembered with its mark and timeout.
    let srv = restart(srv);
    let st = wait_status(&srv, "pool0", "low water after restart", |st| st["low_water_reached"] == true);
    assert_pool_options(&st);
    assert_eq!(st["mode"], "out_of_data_space", "{st:#}");
    let text = mdkit_ok(&srv, &["thin", "status", "pool0"]);
    assert!(text.contains("free data blocks are down to the low-water mark (16)"), "{text}");
    let failed = nbd_write_failing(&srv, "v", 8 << 20, BLOCK_BYTES);
    assert!(failed.contains("No space left on device"), "ENOSPC after restart: {failed}");
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    let c = &st["counters"];
    assert!(c["no_space_waits"].as_u64() >= Some(1) && c["no_space_errors"].as_u64() >= Some(1), "queued: {st:#}");
}

//------------------------------------------------------------------------------------------------
// repair

/// `transaction` and `nr_data_blocks` of the `<superblock>` element of thin_dump XML.
fn superblock_values(xml: &str) -> (u64, u64) {
    let line = xml.lines().next().unwrap();
    assert!(line.starts_with("<superblock "), "{xml}");
    let attr = |name: &str| {
        let start = line.find(&format!(" {name}=\"")).unwrap_or_else(|| panic!("no {name} in {line}")) + name.len() + 3;
        let len = line[start..].find('"').unwrap();
        line[start..start + len].parse::<u64>().unwrap()
    };
    (attr("transaction"), attr("nr_data_blocks"))
}

/// Everything below the `<superblock>` line: devices and mappings.
fn devices_xml(xml: &str) -> &str {
    &xml[xml.find('\n').unwrap()..]
}

/// mdkit's and thin_dump's XML of `meta` (the same text); thin_check accepts `meta`.
fn dump_both(meta: &Path) -> String {
    run(Command::new("thin_check").arg(meta));
    let ours = offline_ok(&["thin", "dump", p(meta)]);
    let tool = String::from_utf8(run(Command::new("thin_dump").arg(meta)).stdout).unwrap();
    assert_eq!(ours, tool, "mdkit thin dump and thin_dump of {}", meta.display());
    ours
}

fn repair_json(input: &Path, output: &Path, extra: &[&str]) -> Value {
    let args = [&["thin", "repair", "-i", p(input), "-o", p(output), "--json"][..], extra].concat();
    serde_json::from_str(&offline_ok(&args)).unwrap()
}

fn rewrite_block(path: &Path, b: u64, edit: impl FnOnce(&mut [u8; 4096])) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut buf = [0u8; 4096];
    f.read_exact_at(&mut buf, b * 4096).unwrap();
    edit(&mut buf);
    f.write_all_at(&buf, b * 4096).unwrap();
}

/// A copy of `meta` whose space maps are broken (both bitmap roots zeroed), as thin_tools.rs.
fn broken_space_maps(meta: &Path, copy: &Path) {
    std::fs::copy(meta, copy).unwrap();
    let sb = superblock(copy);
    for b in [sb.metadata_sm_root.bitmap_root, sb.data_sm_root.bitmap_root] {
        rewrite_block(copy, b, |buf| buf.fill(0));
    }
    assert!(!Command::new("thin_check").arg(copy).output().unwrap().status.success(), "damaged");
}

fn superblock(meta: &Path) -> Superblock {
    let mut buf = Box::new([0u8; 4096]);
    std::fs::File::open(meta).unwrap().read_exact_at(&mut buf[..], 0).unwrap();
    Superblock::unpack(&buf)
}

/// Metadata made by the service: device 0 and its snapshot 1, 64 data blocks in use.
fn pool_metadata() -> Server {
    require_tool("qemu-io", "qemu-utils");
    let mut srv = Server::start(POOL);
    nbd_write_at(&srv, "vol0", 0, &pattern(1, 2 << 20));
    nbd_write_at(&srv, "vol0", 8 << 20, &pattern(2, 1 << 20));
    mdkit_ok(&srv, &["thin", "snapshot", "pool0", "1", "0"]);
    nbd_write_at(&srv, "vol0", 0, &pattern(3, 1 << 20));
    assert!(srv.signal_and_wait(libc::SIGTERM, HANG_GUARD).success(), "{}", srv.log_text());
    srv
}

#[test]
fn repair_transaction_id_and_nr_data_blocks_only_raise_the_salvaged_values() {
    require_tool("thin_dump", "thin-provisioning-tools");
    let srv = pool_metadata();
    let meta = srv.path("pool0.meta");
    let dump = dump_both(&meta);
    let (txn, nr_data_blocks) = superblock_values(&dump);
    assert_eq!(nr_data_blocks, 1024, "64 MiB of 64 KiB blocks: {dump}");
    let bad = srv.path("bad.meta");
    broken_space_maps(&meta, &bad);

    // Above what the superblock says: the new metadata carries them, every mapping is kept.
    let up = srv.path("up.meta");
    let (up_txn, up_blocks) = (txn + 7, nr_data_blocks + 512);
    let r =
        repair_json(&bad, &up, &["--transaction-id", &up_txn.to_string(), "--nr-data-blocks", &up_blocks.to_string()]);
    assert_eq!((r["transaction_id"].as_u64(), r["nr_data_blocks"].as_u64()), (Some(up_txn), Some(up_blocks)), "{r:#}");
    assert_eq!(r["complete"], true, "{r:#}");
    let repaired = dump_both(&up);
    assert_eq!(superblock_values(&repaired), (up_txn, up_blocks), "{repaired}");
    assert_eq!(devices_xml(&repaired), devices_xml(&dump));

    // Below it: "at least" — nothing is lowered, no mapping beyond block 16 is dropped.
    let low = srv.path("low.meta");
    let r = repair_json(&bad, &low, &["--transaction-id", "0", "--nr-data-blocks", "16"]);
    assert_eq!((r["transaction_id"].as_u64(), r["nr_data_blocks"].as_u64()), (Some(txn), Some(1024)), "{r:#}");
    assert_eq!((&r["complete"], &r["mappings_dropped"]), (&Value::from(true), &Value::from(0)), "{r:#}");
    assert_eq!(dump_both(&low), dump);
}

#[test]
fn repair_nr_data_blocks_restores_mappings_of_a_superblock_that_lost_its_data_size() {
    require_tool("thin_dump", "thin-provisioning-tools");
    let srv = pool_metadata();
    let meta = srv.path("pool0.meta");
    let dump = dump_both(&meta);
    // A superblock (checksum intact) whose data space map claims 16 blocks: mappings to the
    // blocks above look impossible.
    let shrunk = srv.path("shrunk.meta");
    std::fs::copy(&meta, &shrunk).unwrap();
    let mut sb = superblock(&shrunk);
    sb.data_sm_root.nr_blocks = 16;
    sb.data_sm_root.nr_allocated = sb.data_sm_root.nr_allocated.min(16);
    rewrite_block(&shrunk, 0, |buf| {
        sb.pack(buf);
        seal(buf, BlockKind::Superblock, 0);
    });

    let lossy = srv.path("lossy.meta");
    let r = repair_json(&shrunk, &lossy, &[]);
    assert_eq!(r["nr_data_blocks"], 16, "{r:#}");
    assert!(r["mappings_dropped"].as_u64() > Some(0) && r["complete"] == false, "{r:#}");

    let fixed = srv.path("fixed.meta");
    let r = repair_json(&shrunk, &fixed, &["--nr-data-blocks", "1024"]);
    assert_eq!((&r["nr_data_blocks"], &r["mappings_dropped"]), (&Value::from(1024), &Value::from(0)), "{r:#}");
    assert_eq!(r["complete"], true, "{r:#}");
    assert_eq!(dump_both(&fixed), dump, "every mapping is back");
}
