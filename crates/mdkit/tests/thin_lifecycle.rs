//! Thin pools that live on, end to end with the real binary, qemu-io, nbdcopy and thin_check:
//! - `mdkit thin deactivate` flushes a device's volume and removes it and its export;
//!   `mdkit thin activate` opens it again under a new export, and both are remembered across
//!   restarts; unknown pool, unknown id, already active and a taken export name are refused
//!   and change nothing;
//! - `mdkit thin pool-resize` takes a data file grown with truncate, grows the data file and
//!   the metadata while a writer keeps writing through NBD past the pool's original size, and
//!   refuses to shrink; the metadata passes thin_check afterwards;
//! - autoextend: a pool on a 4 MiB data file takes a 20 MiB write because each low-water
//!   event grows the file (counted in `thin status --json`), up to its cap; `thin pool-create`
//!   flags set the same policy, remembered across restarts.

use crate::common;

use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use common::{
    Server, mdkit_err, mdkit_json as json, mdkit_ok, nbd_read, nbd_write_at, pattern, require_tool, restart, run,
};

fn pool_config(data_size: &str, extra: &str) -> String {
    format!(
        r#"
[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "4MiB"
data = "pool0.data"
data_size = "{data_size}"
block_size = "64KiB"
create = true
{extra}
"#
    )
}

fn export_names(srv: &Server) -> Vec<String> {
    srv.status()["exports"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str().map(str::to_string)).collect()
}

fn volume_names(srv: &Server) -> Vec<String> {
    srv.status()["volumes"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str().map(str::to_string)).collect()
}

fn file_len(srv: &Server, name: &str) -> u64 {
    std::fs::metadata(srv.path(name)).unwrap().len()
}

fn assert_thin_check_clean(srv: &Server, meta: &str) {
    let chk = Command::new("thin_check").arg(srv.path(meta)).output().unwrap();
    assert!(
        chk.status.success(),
        "thin_check: {}{}",
        String::from_utf8_lossy(&chk.stdout),
        String::from_utf8_lossy(&chk.stderr)
    );
}

#[test]
fn activate_and_deactivate_are_remembered_and_refuse_clearly() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start(&pool_config("32MiB", ""));
    mdkit_ok(&srv, &["thin", "create", "pool0", "1", "--size", "8M", "--export", "a"]);
    let data = pattern(7, 3 << 20);
    nbd_write_at(&srv, "a", 1 << 20, &data);
    let mut expect = vec![0u8; 8 << 20];
    expect[1 << 20..4 << 20].copy_from_slice(&data);

    let out = mdkit_ok(&srv, &["thin", "deactivate", "pool0", "1"]);
    assert!(out.contains("removed volume pool0.1") && out.contains("removed export a"), "{out}");
    assert!(!export_names(&srv).contains(&"a".to_string()) && !volume_names(&srv).contains(&"pool0.1".into()));
    let e = mdkit_err(&srv, &["thin", "deactivate", "pool0", "1"]);
    assert!(e.contains("not active"), "{e}");

    // Refusals name what is wrong and change nothing.
    let e = mdkit_err(&srv, &["thin", "activate", "nopool", "1"]);
    assert!(e.contains("no thin pool named \"nopool\""), "{e}");
    let e = mdkit_err(&srv, &["thin", "activate", "pool0", "9"]);
    assert!(e.contains("no thin device 9") && e.contains("it has: 1"), "{e}");
    mdkit_ok(&srv, &["thin", "create", "pool0", "2", "--size", "4M", "--export", "b"]);
    let e = mdkit_err(&srv, &["thin", "activate", "pool0", "2"]);
    assert!(e.contains("already active as volume \"pool0.2\""), "{e}");
    let e = mdkit_err(&srv, &["thin", "activate", "pool0", "1", "--export", "b"]);
    assert!(e.contains("export name \"b\" is taken"), "{e}");
    assert!(!volume_names(&srv).contains(&"pool0.1".into()), "a refused activate opened nothing");

    let out = mdkit_ok(&srv, &["thin", "activate", "pool0", "1", "--export", "again"]);
    assert!(out.contains("volume pool0.1") && out.contains("\"again\""), "{out}");
    assert!(nbd_read(&srv, "again", 8 << 20) == expect, "activated device reads back");
    mdkit_ok(&srv, &["thin", "deactivate", "pool0", "2"]);

    // Device 1 comes back active under its new export; device 2 stays inactive.
    let srv = restart(srv);
    assert!(nbd_read(&srv, "again", 8 << 20) == expect, "after restart");
    let vols = volume_names(&srv);
    assert!(vols.contains(&"pool0.1".into()) && !vols.contains(&"pool0.2".into()), "{vols:?}");
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    let ids: Vec<u64> = st["thins"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1, 2], "{st:#}");

    mdkit_ok(&srv, &["thin", "deactivate", "pool0", "1"]);
    let srv = restart(srv);
    assert!(!volume_names(&srv).contains(&"pool0.1".into()), "deactivation is remembered");
    mdkit_ok(&srv, &["thin", "activate", "pool0", "1"]);
    assert!(nbd_read(&srv, "pool0.1", 8 << 20) == expect, "default export is the volume name");
}

#[test]
fn pool_resize_grows_data_and_metadata_under_nbd_writes() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("thin_check", "thin-provisioning-tools");
    // 8 MiB of data (128 blocks); the volume is written far past that while the pool grows.
    let srv = Server::start(&pool_config("8MiB", ""));
    mdkit_ok(&srv, &["thin", "create", "pool0", "1", "--size", "64M", "--export", "v"]);
    let chunk = 1usize << 20;
    const CHUNKS: usize = 40;

    let (started_tx, started_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let uri_srv = &srv;
    let written = std::thread::scope(|s| {
        let writer = s.spawn(move || {
            // Writes chunk after chunk; the resize happens between the first and the last.
            for i in 0..CHUNKS {
                nbd_write_at(uri_srv, "v", (i * chunk) as u64, &pattern(100 + i as u64, chunk));
                if i == 0 {
                    started_tx.send(()).unwrap();
                }
                if i >= 8 && done_rx.try_recv().is_ok() {
                    return i + 1;
                }
            }
            CHUNKS
        });
        started_rx.recv().unwrap();
        // The data file grew behind the service's back (`truncate -s 24M`): take it.
        std::fs::OpenOptions::new().write(true).open(srv.path("pool0.data")).unwrap().set_len(24 << 20).unwrap();
        let v = json(&srv, &["thin", "pool-resize", "pool0", "--json"]);
        assert_eq!(
            (v["data_blocks"]["old"].as_u64(), v["data_blocks"]["new"].as_u64()),
            (Some(128), Some(384)),
            "{v:#}"
        );
        // The metadata file too, then grow both to given sizes (the service grows the files).
        std::fs::OpenOptions::new().write(true).open(srv.path("pool0.meta")).unwrap().set_len(6 << 20).unwrap();
        let v = json(&srv, &["thin", "pool-resize", "pool0", "--metadata-size", "max", "--json"]);
        assert_eq!(v["metadata_blocks"]["new"], 1536, "{v:#}");
        assert!(v["data_blocks"].is_null(), "only the metadata was asked for: {v:#}");
        let out = mdkit_ok(&srv, &["thin", "pool-resize", "pool0", "--data-size", "48M", "--metadata-size", "8M"]);
        assert!(out.contains("data: grown to 768 blocks (was 384)"), "{out}");
        assert!(out.contains("metadata: grown to 2048 blocks (was 1536)"), "{out}");
        done_tx.send(()).unwrap();
        writer.join().unwrap()
    });
    assert!(written > 8, "the writer ran across the resizes ({written} chunks)");
    assert_eq!(file_len(&srv, "pool0.data"), 48 << 20);
    assert_eq!(file_len(&srv, "pool0.meta"), 8 << 20);

    let mut expect = vec![0u8; 64 << 20];
    for i in 0..written {
        expect[i * chunk..(i + 1) * chunk].copy_from_slice(&pattern(100 + i as u64, chunk));
    }
    assert!(nbd_read(&srv, "v", 64 << 20) == expect, "every chunk reads back");
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!((st["total_data_blocks"].as_u64(), st["total_metadata_blocks"].as_u64()), (Some(768), Some(2048)));
    assert_eq!(st["used_data_blocks"].as_u64(), Some(16 * written as u64), "{st:#}");
    assert_eq!(st["mode"], "rw");

    // Shrinking is refused, as dm-thin refuses it; nothing changes.
    let e = mdkit_err(&srv, &["thin", "pool-resize", "pool0", "--data-size", "16M"]);
    assert!(e.contains("shrinking") && e.contains("refused"), "{e}");
    let e = mdkit_err(&srv, &["thin", "pool-resize", "pool0", "--metadata-size", "1M"]);
    assert!(e.contains("shrinking") && e.contains("refused"), "{e}");
    let e = mdkit_err(&srv, &["thin", "pool-resize", "nopool"]);
    assert!(e.contains("no thin pool named"), "{e}");
    assert_eq!(file_len(&srv, "pool0.data"), 48 << 20);

    // The grown pool opens again at its new size, and the tools accept its metadata.
    let mut srv = restart(srv);
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!((st["total_data_blocks"].as_u64(), st["total_metadata_blocks"].as_u64()), (Some(768), Some(2048)));
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    assert_thin_check_clean(&srv, "pool0.meta");
    let dump = String::from_utf8(run(Command::new("thin_dump").arg(srv.path("pool0.meta"))).stdout).unwrap();
    assert!(dump.contains("nr_data_blocks=\"768\""), "{dump}");
}

/// Polls `thin status` until `done` holds (autoextend runs beside the writes that trigger it).
fn wait_status(srv: &Server, what: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let start = std::time::Instant::now();
    loop {
        let st = json(srv, &["thin", "status", "pool0", "--json"]);
        if done(&st) {
            return st;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no {what} after 120 s: {st:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn autoextend_grows_the_data_file_on_low_water_events() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("thin_check", "thin-provisioning-tools");
    let cfg = pool_config(
        "4MiB",
        "autoextend_threshold_percent = 80\nautoextend_step = \"4MiB\"\nautoextend_max_size = \"40MiB\"",
    );
    let mut srv = Server::start(&cfg);
    let st = json(&srv, &["thin", "status", "pool0", "--json"]);
    assert_eq!(st["low_water_blocks"], 12, "20% of 64 blocks free: {st:#}");
    assert_eq!(st["autoextend"]["extensions"], 0, "{st:#}");
    mdkit_ok(&srv, &["thin", "create", "pool0", "1", "--size", "64M", "--export", "v"]);

    // 20 MiB (320 blocks) into a pool of 4 MiB: writes that find no space queue until
    // autoextend grew it. It grows by 64 blocks until no more than 80% is used: 448 blocks.
    let a = pattern(9, 20 << 20);
    nbd_write_at(&srv, "v", 0, &a);
    let st = wait_status(&srv, "end of growth", |st| st["low_water_reached"] == false);
    assert_eq!(st["used_data_blocks"], 320, "{st:#}");
    assert_eq!(st["total_data_blocks"], 448, "{st:#}");
    assert_eq!(st["low_water_blocks"], 89, "the mark follows the size: {st:#}");
    assert_eq!(st["autoextend"]["extensions"], 6, "one per 4 MiB step: {st:#}");
    assert!(st["autoextend"]["last_error"].is_null(), "{st:#}");
    assert_eq!(file_len(&srv, "pool0.data"), 28 << 20, "the pool uses the whole grown file");

    // 14 MiB more (544 blocks used) would need 680 blocks: it stops at the 40 MiB cap and
    // says so in status.
    let b = pattern(10, 14 << 20);
    nbd_write_at(&srv, "v", 20 << 20, &b);
    let st = wait_status(&srv, "cap error", |st| st["autoextend"]["last_error"].is_string());
    assert_eq!(st["total_data_blocks"], 640, "{st:#}");
    assert!(st["autoextend"]["last_error"].as_str().unwrap().contains("autoextend_max_size"), "{st:#}");
    assert_eq!(file_len(&srv, "pool0.data"), 40 << 20);
    let mut expect = vec![0u8; 34 << 20];
    expect[..20 << 20].copy_from_slice(&a);
    expect[20 << 20..].copy_from_slice(&b);
    assert!(nbd_read(&srv, "v", 34 << 20) == expect, "everything written reads back");

    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    assert_thin_check_clean(&srv, "pool0.meta");
}

/// A step the metadata cannot map (16 TiB of 64 KiB blocks needs ~16,000 space-map blocks; the
/// metadata has 1,024) is refused before the data file grows, says why in status, and leaves
/// the pool serving.
#[test]
fn autoextend_step_the_metadata_cannot_map_grows_nothing() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("thin_check", "thin-provisioning-tools");
    let cfg = pool_config(
        "4MiB",
        "autoextend_threshold_percent = 80\nautoextend_step = \"16TiB\"\nautoextend_max_size = \"32TiB\"\noptions = [\"error_if_no_space\"]",
    );
    let srv = Server::start(&cfg);
    mdkit_ok(&srv, &["thin", "create", "pool0", "1", "--size", "64M", "--export", "v"]);
    let a = pattern(11, 56 * 65536);
    nbd_write_at(&srv, "v", 0, &a);
    let st = wait_status(&srv, "autoextend error", |st| st["autoextend"]["last_error"].is_string());
    let e = st["autoextend"]["last_error"].as_str().unwrap();
    assert!(e.contains("metadata"), "names the metadata as the reason: {st:#}");
    assert_eq!(st["autoextend"]["extensions"], 0, "{st:#}");
    assert_eq!((st["total_data_blocks"].as_u64(), st["mode"].as_str()), (Some(64), Some("rw")), "{st:#}");
    assert_eq!(file_len(&srv, "pool0.data"), 4 << 20, "the data file did not grow");
    assert!(nbd_read(&srv, "v", a.len()) == a, "what was written reads back");
    // The pool still takes writes into the space it has.
    let b = pattern(12, 4 * 65536);
    nbd_write_at(&srv, "v", a.len() as u64, &b);
    assert!(nbd_read(&srv, "v", a.len() + b.len())[a.len()..] == b[..]);
}

#[test]
fn pool_create_flags_set_the_autoextend_policy() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let (meta, data) = (srv.path("p.meta"), srv.path("p.data"));
    let (meta, data) = (meta.to_str().unwrap(), data.to_str().unwrap());
    let e =
        mdkit_err(&srv, &["thin", "pool-create", "p", "--metadata", meta, "--data", data, "--autoextend-step", "4M"]);
    assert!(e.contains("--autoextend-threshold-percent"), "a step needs a threshold: {e}");
    let out = mdkit_ok(
        &srv,
        &[
            "thin",
            "pool-create",
            "p",
            "--metadata",
            meta,
            "--metadata-size",
            "4M",
            "--data",
            data,
            "--data-size",
            "4M",
            "--autoextend-threshold-percent",
            "80",
            "--autoextend-step",
            "4M",
            "--autoextend-max-size",
            "12M",
        ],
    );
    assert!(
        out.contains("autoextend_threshold_percent = 80") && out.contains("autoextend_max_size = \"12M\""),
        "{out}"
    );
    let st = json(&srv, &["thin", "status", "p", "--json"]);
    assert_eq!(st["low_water_blocks"], 12, "the threshold sets the mark: {st:#}");
    let policy = &st["autoextend"];
    assert_eq!(
        (&policy["threshold_percent"], &policy["step"], &policy["max_bytes"]),
        (&80.into(), &"4194304".into(), &(12u64 << 20).into())
    );

    // 10 MiB into the 4 MiB pool: the policy grows the data file to its 12 MiB cap.
    mdkit_ok(&srv, &["thin", "create", "p", "1", "--size", "16M", "--export", "v"]);
    let a = pattern(11, 10 << 20);
    nbd_write_at(&srv, "v", 0, &a);
    let start = std::time::Instant::now();
    while file_len(&srv, "p.data") < 12 << 20 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no growth: {:#}",
            json(&srv, &["thin", "status", "p", "--json"])
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(nbd_read(&srv, "v", 10 << 20) == a);
    let srv = restart(srv);
    let st = json(&srv, &["thin", "status", "p", "--json"]);
    assert_eq!(st["autoextend"]["threshold_percent"], 80, "remembered: {st:#}");
    assert_eq!(st["total_data_blocks"], 192, "{st:#}");
}
