//! Real NBD clients against the real `mdkit serve`: nbdinfo, qemu-io, qemu-img, nbdcopy and
//! fio's nbd engine, over TCP and Unix sockets.

use crate::common;

use std::process::Command;

use common::{Server, pattern, require_tool, run, sha256};
use serde_json::Value;

const VOLUMES: &str = r#"
[[volume]]
name = "vol0"
kind = "file"
path = "vol0.img"
size = "64MiB"

[[export]]
name = "default"
volume = "vol0"
description = "test volume"

[[export]]
name = "ro"
volume = "vol0"
read_only = true
"#;

fn nbdinfo(uri: &str) -> Value {
    let out = run(Command::new("nbdinfo").args(["--json", uri]));
    let v: Value = serde_json::from_slice(&out.stdout).expect("nbdinfo --json output");
    v["exports"][0].clone()
}

#[test]
fn nbdinfo_reports_size_block_sizes_and_flags() {
    require_tool("nbdinfo", "libnbd-bin");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    let lbs = srv.status()["volumes"][0]["logical_block_bytes"].as_u64().unwrap();
    for uri in [srv.uri("default"), srv.unix_uri("default"), srv.uri("")] {
        let e = nbdinfo(&uri);
        assert_eq!(e["export-size"], 64u64 << 20, "{uri}: {e}");
        assert_eq!(e["export-name"], "default", "{uri}: the empty name maps to the default export");
        assert_eq!(e["description"], "test volume");
        assert_eq!(e["block_size_minimum"], lbs.max(512), "{uri}");
        assert_eq!(e["block_size_preferred"], 4096);
        assert_eq!(e["block_size_maximum"], 32u64 << 20);
        for flag in ["can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero", "can_multi_conn", "can_df"] {
            assert_eq!(e[flag], true, "{uri}: {flag} in {e}");
        }
        assert_eq!(e["is_read_only"], false);
        assert_eq!(e["is_rotational"], false);
    }
    let ro = nbdinfo(&srv.uri("ro"));
    assert_eq!(ro["is_read_only"], true, "{ro}");
    assert_eq!(ro["can_multi_conn"], true);
    assert_eq!(ro["can_trim"], false);

    let out = run(Command::new("nbdinfo").args(["--list", "--json", &srv.uri("")]));
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<&str> =
        list["exports"].as_array().unwrap().iter().map(|e| e["export-name"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["default", "ro"]);

    let bad = Command::new("nbdinfo").arg(srv.uri("nonexistent")).output().unwrap();
    assert!(!bad.status.success(), "unknown export must fail");
}

fn qemu_io(uri: &str, cmds: &[String]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri);
    let out = run(&mut c);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!text.contains("Pattern verification failed"), "{text}");
    assert!(!text.to_lowercase().contains("error"), "{text}");
    text
}

#[test]
fn qemu_io_patterns_at_odd_offsets_and_lengths_read_back() {
    require_tool("qemu-io", "qemu-utils");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    // (offset, length, pattern): unaligned starts and ends, crossing 512/4096 boundaries,
    // adjacent and overlapping writes (the later one wins).
    let writes: &[(u64, u64, u8)] = &[
        (1, 1, 0x11),
        (511, 2, 0x22),
        (4095, 4099, 0x33),
        (65537, 131071, 0x44),
        (1 << 20, 3 << 20, 0x55),
        ((1 << 20) + 777, 1000, 0x66),
        ((64 << 20) - 3, 3, 0x77),
    ];
    let w: Vec<String> = writes.iter().map(|(o, l, p)| format!("write -P {p:#x} {o} {l}")).collect();
    qemu_io(&srv.uri("default"), &w);
    // Read back on a new connection (Unix socket this time), checking each range.
    let mut r = vec![
        "read -P 0x11 1 1".to_string(),
        "read -P 0 0 1".to_string(),
        "read -P 0 2 509".to_string(),
        "read -P 0x22 511 2".to_string(),
        "read -P 0x33 4095 4099".to_string(),
        "read -P 0x44 65537 131071".to_string(),
        "read -P 0x55 1048576 777".to_string(),
        "read -P 0x66 1049353 1000".to_string(),
        format!("read -P 0x55 1050353 {}", (4u64 << 20) - 1_050_353),
        format!("read -P 0x77 {} 3", (64u64 << 20) - 3),
    ];
    r.push("read -P 0 196608 1000".to_string());
    qemu_io(&srv.unix_uri("default"), &r);
    // Zeroing and discarding through qemu-io.
    qemu_io(&srv.uri("default"), &["write -z 4095 4099".into(), "read -P 0 4095 4099".into(), "discard 0 4096".into()]);
}

#[test]
fn qemu_img_convert_round_trips_an_image() {
    require_tool("qemu-img", "qemu-utils");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    let src = srv.path("src.img");
    // Data with holes: qemu-img writes data runs and zeroes/skips the rest.
    let mut img = vec![0u8; 64 << 20];
    for (i, chunk) in img.chunks_mut(1 << 20).enumerate() {
        if i % 3 != 1 {
            let p = pattern(i as u64, chunk.len() / 2);
            chunk[..p.len()].copy_from_slice(&p);
        }
    }
    std::fs::write(&src, &img).unwrap();
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(srv.uri("default")));
    let back = srv.path("back.img");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw", &srv.uri("default")]).arg(&back));
    assert_eq!(sha256(&src), sha256(&back), "image changed on the way through mdkit");
    // The member file holds the same bytes (nothing cached only in the server).
    assert_eq!(sha256(&src), sha256(&srv.path("vol0.img")));
}

#[test]
fn nbdcopy_both_directions_with_multi_conn() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    let src = srv.path("src.img");
    let img = pattern(42, 64 << 20);
    std::fs::write(&src, &img).unwrap();
    // nbdcopy opens several connections when the server sets CAN_MULTI_CONN.
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(&src).arg(srv.uri("default")));
    let back = srv.path("back.img");
    run(Command::new("nbdcopy").args(["--connections=4"]).arg(srv.unix_uri("default")).arg(&back));
    assert_eq!(sha256(&src), sha256(&back));
    let st = srv.export_stats("default");
    assert!(st["writes"].as_u64().unwrap() > 0 && st["reads"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["errors"], 0, "{st}");
}

#[test]
fn fio_nbd_engine_verifies_on_four_connections() {
    require_tool("fio", "fio");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    // Four jobs, four connections, disjoint 16 MiB regions, random writes with crc32c headers,
    // then verification reads of everything written.
    let jobs = fio_verify(
        &srv,
        "verify",
        &[
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=16",
            "--numjobs=4",
            "--size=16M",
            "--offset_increment=16M",
            "--group_reporting=0",
        ],
    );
    assert_eq!(jobs.len(), 4);
    for j in &jobs {
        assert!(j["write"]["io_bytes"].as_u64().unwrap() >= 16 << 20, "{j}");
        assert!(j["read"]["io_bytes"].as_u64().unwrap() >= 16 << 20, "verify phase must read back: {j}");
    }
    assert_eq!(srv.export_stats("default")["errors"], 0);
}

/// Flush batching on a file volume: four fio connections each sending an NBD FLUSH after
/// every write (`--fsync=1`, 16 deep) get every flush answered, while the member file sees
/// far fewer `fdatasync` rounds than flush requests (status: `flush_requests`,
/// `flush_rounds`). The data written reads back verified.
#[test]
fn concurrent_nbd_flushes_share_fdatasync_rounds() {
    require_tool("fio", "fio");
    let srv = Server::start_opts("default_export = \"default\"", VOLUMES);
    fio_verify(
        &srv,
        "flushers",
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--fsync=1",
            "--iodepth=16",
            "--numjobs=4",
            "--size=8M",
            "--offset_increment=8M",
            "--number_ios=1000",
        ],
    );
    let flushes = srv.export_stats("default")["flushes"].as_u64().unwrap();
    assert!(flushes >= 4 * 500, "fio sent a flush after every write: {flushes}");
    let vol = volume_status(&srv, "vol0")["details"].clone();
    assert_eq!(vol["flush_batching"], true, "{vol}");
    let (requests, rounds) = (vol["flush_requests"].as_u64().unwrap(), vol["flush_rounds"].as_u64().unwrap());
    eprintln!("{flushes} NBD flushes, {requests} flush requests, {rounds} fdatasync rounds");
    assert!(requests >= flushes, "every NBD flush reached the member's batcher: {vol} vs {flushes}");
    assert!(rounds >= 1 && rounds * 2 <= requests, "concurrent flushes must share rounds: {vol}");
    assert_eq!(srv.export_stats("default")["errors"], 0);
}

/// A file volume with `write_back = true`: fio's nbd engine on four connections writes with
/// crc32c headers (a flush every 16 writes) and verifies everything it wrote; plain writes were
/// answered while still running on the member, none was lost, and `mdkit status` says so.
#[test]
fn write_back_volume_verifies_under_fio_and_reports_its_window() {
    require_tool("fio", "fio");
    let volumes = VOLUMES.replace("size = \"64MiB\"\n", "size = \"64MiB\"\nwrite_back = true\n");
    assert!(volumes.contains("write_back = true"));
    let srv = Server::start_opts("default_export = \"default\"", &volumes);
    let jobs = fio_verify(
        &srv,
        "wb",
        &[
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=8",
            "--numjobs=4",
            "--size=8M",
            "--offset_increment=16M",
            "--fsync=16",
        ],
    );
    for j in &jobs {
        assert!(j["read"]["io_bytes"].as_u64().unwrap() >= 8 << 20, "verify phase must read back: {j}");
    }
    assert_eq!(srv.export_stats("default")["errors"], 0);
    let vol = volume_status(&srv, "vol0");
    let wb = &vol["details"]["write_back"];
    eprintln!("write-back: {wb}");
    assert_eq!(vol["state"], "active", "{vol}");
    assert_eq!(wb["lost_writes"], 0, "{wb}");
    assert_eq!(wb["max_writes"], 64, "{wb}");
    let early = wb["acknowledged_early"].as_u64().unwrap();
    let through = wb["written_through"].as_u64().unwrap();
    assert!(early + through >= 4 * 256, "every write passed the window: {wb}");
    // On a member doing real asynchronous I/O most writes are answered early; on tmpfs the
    // member copies small writes inline, so they complete within their first poll.
    if vol["details"]["direct_io"] == true {
        assert!(early > through, "O_DIRECT member: writes should be answered while running: {wb}");
    }
}

/// Runs fio's nbd engine on the server's `default` export with crc32c verification of
/// everything it writes (`job_args`: the workload), in the server's directory (fio drops verify
/// state files into its working directory); returns fio's per-job JSON, each checked for errors.
fn fio_verify(srv: &Server, name: &str, job_args: &[&str]) -> Vec<Value> {
    let out_json = srv.path(&format!("fio-{name}.json"));
    run(Command::new("fio")
        .arg(format!("--name={name}"))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={}", srv.uri("default")))
        .args(job_args)
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--output-format=json"])
        .arg(format!("--output={}", out_json.display()))
        .current_dir(srv.dir.path()));
    let v: Value = serde_json::from_slice(&std::fs::read(&out_json).unwrap()).unwrap();
    let jobs = v["jobs"].as_array().unwrap().clone();
    for j in &jobs {
        assert_eq!(j["error"], 0, "{j}");
    }
    jobs
}

/// The `mdkit status` entry of volume `name`.
fn volume_status(srv: &Server, name: &str) -> Value {
    srv.status()["volumes"].as_array().unwrap().iter().find(|v| v["name"] == name).unwrap().clone()
}
