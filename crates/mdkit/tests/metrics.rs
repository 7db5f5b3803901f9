//! The Prometheus endpoint end to end: `mdkit serve` with `[metrics] listen` on, an md raid1
//! under a thin pool with an exported thin volume, some NBD I/O, then one scrape parsed by a
//! real OpenMetrics parser (Python `prometheus_client`, Debian `python3-prometheus-client`)
//! whose values must equal `mdkit status --json`, `mdkit detail --json` and
//! `mdkit thin status --json` for the same volumes.

use crate::common;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const PARSER: &str = "/usr/bin/python3";

/// Reads OpenMetrics text on stdin, prints one JSON object per sample (strict parser: a
/// malformed exposition, a missing `# EOF` or a bad type/name raises and fails the test).
const PARSE_SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        print(json.dumps({"family": family.name, "type": family.type, "name": s.name, "labels": s.labels, "value": s.value}))
"#;

const CONFIG: &str = r#"
[metrics]
listen = "127.0.0.1:0"

[[volume]]
name = "md0"
kind = "md"
members = ["md0-a.img", "md0-b.img"]
member_size = "64MiB"
create = true
level = "raid1"
[volume.attributes]
sync_speed_max = "2000000"

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
size = "32MiB"
create = true

[[export]]
name = "vol0"
volume = "vol0"
"#;

struct Sample {
    family_type: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Samples by sample name (`..._total` for counters).
struct Scrape(BTreeMap<String, Vec<Sample>>);

impl Scrape {
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let samples = self.0.get(name).unwrap_or_else(|| panic!("no metric {name} in the scrape"));
        let hits: Vec<&Sample> = samples
            .iter()
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
            .collect();
        assert_eq!(hits.len(), 1, "{name}{labels:?}: {} matching samples", hits.len());
        hits[0].value
    }

    fn type_of(&self, name: &str) -> &str {
        &self.0[name][0].family_type
    }
}

pub(crate) fn metrics_url(srv: &Server) -> String {
    let start = Instant::now();
    loop {
        let log = srv.log_text();
        if let Some(rest) = log.split("metrics endpoint: ").nth(1) {
            return rest.split_whitespace().next().unwrap().to_string();
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no metrics endpoint in the log:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn curl(url: &str) -> std::process::Output {
    Command::new("curl").args(["-s", "-i", "--max-time", "30", url]).output().expect("run curl")
}

fn scrape(url: &str) -> Scrape {
    let out = run(Command::new("curl").args(["-sf", "--max-time", "30", url]));
    let mut child = Command::new(PARSER)
        .args(["-c", PARSE_SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    child.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let parsed = child.wait_with_output().unwrap();
    assert!(
        parsed.status.success(),
        "the OpenMetrics parser refused the scrape: {}\n{}",
        String::from_utf8_lossy(&parsed.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let mut samples: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    for line in String::from_utf8(parsed.stdout).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let labels = v["labels"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()));
        samples.entry(v["name"].as_str().unwrap().to_string()).or_default().push(Sample {
            family_type: v["type"].as_str().unwrap().to_string(),
            labels: labels.collect(),
            value: v["value"].as_f64().unwrap(),
        });
    }
    Scrape(samples)
}

fn json(srv: &Server, args: &[&str]) -> Value {
    serde_json::from_str(&mdkit_ok(srv, args)).unwrap()
}

fn nbd_io(srv: &Server) {
    let src = srv.path("pattern.bin");
    std::fs::write(&src, pattern(7, 1 << 20)).unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -s {} 0 1M", src.display()))
        .args(["-c", "read 0 512k", "-c", "flush"])
        .arg(srv.uri("vol0")));
}

/// Waits (hang guard 60 s) until the array's initial resync is over, so the scrape and the
/// JSON see the same idle array.
fn wait_idle(srv: &Server) -> Value {
    let start = Instant::now();
    loop {
        let d = json(srv, &["detail", "md0", "--json"]);
        if d["sync"]["action"] == "idle" {
            return d;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "md0 still syncing: {d}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each volume's state in the scrape is the one `status` showed just before or just after it
/// (an md array turns from `active` to `clean` a moment after the last write).
fn check_volume_states(m: &Scrape, before: &Value, after: &Value) {
    for (b, a) in before["volumes"].as_array().unwrap().iter().zip(after["volumes"].as_array().unwrap()) {
        let volume = b["name"].as_str().unwrap();
        let states = m.0["mdkit_volume_state"].iter().filter(|s| s.labels["volume"] == volume);
        let states: Vec<&str> = states.map(|s| s.labels["state"].as_str()).collect();
        assert_eq!(states.len(), 1, "{volume}: {states:?}");
        assert!(states[0] == b["state"] || states[0] == a["state"], "{volume}: {states:?} vs {b} / {a}");
    }
}

fn check_exports(m: &Scrape, status: &Value) {
    let e = status["exports"].as_array().unwrap().iter().find(|e| e["name"] == "vol0").unwrap();
    let s = &e["stats"];
    let id = [("export", "vol0"), ("volume", "vol0")];
    for (metric, key) in [
        ("mdkit_export_reads_total", "reads"),
        ("mdkit_export_writes_total", "writes"),
        ("mdkit_export_flushes_total", "flushes"),
        ("mdkit_export_read_bytes_total", "read_bytes"),
        ("mdkit_export_written_bytes_total", "written_bytes"),
        ("mdkit_export_errors_total", "errors"),
    ] {
        assert_eq!(m.get(metric, &id), s[key].as_f64().unwrap(), "{metric} vs status {key}");
    }
    assert_eq!(m.type_of("mdkit_export_written_bytes_total"), "counter");
    // Latency histograms: one sample per request (no request failed here).
    for (op, key) in [("read", "reads"), ("write", "writes"), ("flush", "flushes")] {
        let id = [id[0], id[1], ("op", op)];
        let count = m.get("mdkit_export_request_duration_seconds_count", &id);
        assert_eq!(count, s[key].as_f64().unwrap(), "{op} latency samples vs status {key}");
        assert!(count >= 1.0, "{op}: no latency recorded");
        let le_inf = [id[0], id[1], id[2], ("le", "+Inf")];
        assert_eq!(m.get("mdkit_export_request_duration_seconds_bucket", &le_inf), count);
        assert!(m.get("mdkit_export_request_duration_seconds_sum", &id) > 0.0);
    }
    assert_eq!(m.type_of("mdkit_export_request_duration_seconds_count"), "histogram");
    assert!(m.get("mdkit_export_written_bytes_total", &id) >= f64::from(1u32 << 20), "the 1 MiB write is counted");
    assert!(m.get("mdkit_export_flushes_total", &id) >= 1.0);
    assert_eq!(m.get("mdkit_export_size_bytes", &id), e["size_bytes"].as_f64().unwrap());
    assert_eq!(m.get("mdkit_nbd_connections_accepted_total", &[]), status["connections_accepted"].as_f64().unwrap());
    for v in status["volumes"].as_array().unwrap() {
        let id = [("volume", v["name"].as_str().unwrap()), ("kind", v["kind"].as_str().unwrap())];
        assert_eq!(m.get("mdkit_volume_size_bytes", &id), v["size_bytes"].as_f64().unwrap(), "{v}");
    }
}

/// node_exporter's names and label values, so its RAID alert rules work unchanged.
fn check_md(m: &Scrape, d: &Value) {
    let dev = [("device", "md0")];
    assert_eq!(m.get("node_md_disks_required", &dev), d["raid_disks"].as_f64().unwrap());
    assert_eq!(m.get("node_md_disks", &[dev[0], ("state", "active")]), d["active_devices"].as_f64().unwrap());
    assert_eq!(m.get("node_md_disks", &[dev[0], ("state", "failed")]), d["failed_devices"].as_f64().unwrap());
    assert_eq!(m.get("node_md_disks", &[dev[0], ("state", "spare")]), d["spare_devices"].as_f64().unwrap());
    assert_eq!(m.get("node_md_degraded", &dev), d["degraded"].as_f64().unwrap());
    let blocks_kib = d["size_bytes"].as_f64().unwrap() / 1024.0;
    assert_eq!(m.get("node_md_blocks", &dev), blocks_kib);
    assert_eq!(m.get("node_md_blocks_synced", &dev), blocks_kib, "idle: synced equals blocks");
    for (state, want) in [("active", 1.0), ("inactive", 0.0), ("recovering", 0.0), ("resync", 0.0), ("check", 0.0)] {
        assert_eq!(m.get("node_md_state", &[dev[0], ("state", state)]), want, "node_md_state{{state={state}}}");
    }
    // NodeRAIDDegraded: required - active > 0 must not fire on a healthy array.
    assert_eq!(m.get("node_md_disks_required", &dev) - m.get("node_md_disks", &[dev[0], ("state", "active")]), 0.0);
    assert_eq!(m.get("mdkit_md_mismatch_sectors", &dev), d["sync"]["mismatch_cnt"].as_f64().unwrap());
    for member in d["members"].as_array().unwrap() {
        let id = [dev[0], ("member", member["name"].as_str().unwrap())];
        assert_eq!(m.get("mdkit_md_member_read_errors_total", &id), member["read_errors"].as_f64().unwrap());
        assert_eq!(m.get("mdkit_md_member_faulty", &id), 0.0);
    }
}

fn check_pool(m: &Scrape, t: &Value, status: &Value) {
    let id = [("pool", "pool0")];
    assert_eq!(m.get("mdkit_thin_pool_data_used_blocks", &id), t["used_data_blocks"].as_f64().unwrap());
    assert_eq!(m.get("mdkit_thin_pool_data_blocks", &id), t["total_data_blocks"].as_f64().unwrap());
    assert_eq!(m.get("mdkit_thin_pool_metadata_used_blocks", &id), t["used_metadata_blocks"].as_f64().unwrap());
    assert_eq!(m.get("mdkit_thin_pool_metadata_blocks", &id), t["total_metadata_blocks"].as_f64().unwrap());
    let v = status["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "pool0").unwrap();
    if let Some(requests) = v["details"]["data_flush_requests"].as_f64() {
        assert_eq!(m.get("mdkit_thin_pool_data_flush_requests_total", &id), requests);
    }
    let block_bytes = t["data_block_bytes"].as_f64().unwrap();
    assert_eq!(m.get("mdkit_thin_pool_data_used_bytes", &id), t["used_data_blocks"].as_f64().unwrap() * block_bytes);
    assert!(t["used_data_blocks"].as_u64().unwrap() >= 16, "the 1 MiB write allocated 64 KiB blocks: {t}");
}

#[test]
fn scrape_parses_and_matches_status_and_detail() {
    require_tool("curl", "curl");
    require_tool("qemu-io", "qemu-utils");
    assert!(
        Command::new(PARSER)
            .args(["-c", "import prometheus_client.openmetrics.parser"])
            .status()
            .is_ok_and(|s| s.success()),
        "{PARSER} cannot import prometheus_client: install the Debian package `python3-prometheus-client` (scripts/test installs it)"
    );
    let srv = Server::start(CONFIG);
    let url = metrics_url(&srv);
    nbd_io(&srv);
    let detail = wait_idle(&srv);
    let before = json(&srv, &["status", "--json"]);
    let m = scrape(&url);
    let status = json(&srv, &["status", "--json"]);
    check_volume_states(&m, &before, &status);
    let thin = json(&srv, &["thin", "status", "pool0", "--json"]);
    check_exports(&m, &status);
    check_md(&m, &detail);
    check_pool(&m, &thin, &status);

    // A failed member: the node-mixin rules NodeRAIDDiskFailure (failed > 0) and
    // NodeRAIDDegraded (required - active > 0) must fire on the scrape.
    mdkit_ok(&srv, &["manage", "md0", "--fail", "md0-b.img"]);
    let detail = json(&srv, &["detail", "md0", "--json"]);
    let m = scrape(&url);
    let dev = ("device", "md0");
    assert_eq!(m.get("node_md_disks", &[dev, ("state", "failed")]), 1.0);
    assert_eq!(m.get("node_md_disks", &[dev, ("state", "failed")]), detail["failed_devices"].as_f64().unwrap());
    assert_eq!(m.get("node_md_disks_required", &[dev]) - m.get("node_md_disks", &[dev, ("state", "active")]), 1.0);
    assert_eq!(m.get("node_md_degraded", &[dev]), 1.0);
    assert_eq!(m.get("mdkit_md_member_faulty", &[dev, ("member", "md0-b.img")]), 1.0);
    assert_eq!(m.get("mdkit_md_member_faulty", &[dev, ("member", "md0-a.img")]), 0.0);

    let other = curl(&url.replace("/metrics", "/"));
    assert!(String::from_utf8_lossy(&other.stdout).starts_with("HTTP/1.1 404"), "{other:?}");
    let post = Command::new("curl").args(["-s", "-i", "-X", "POST", "--max-time", "30", &url]).output().unwrap();
    assert!(String::from_utf8_lossy(&post.stdout).starts_with("HTTP/1.1 405"), "{post:?}");
}

#[test]
fn a_remote_metrics_address_needs_the_opt_in() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("mdkit.toml");
    std::fs::write(&cfg, format!("data_dir = \"{}\"\n[metrics]\nlisten = \"0.0.0.0:9108\"\n", dir.path().display()))
        .unwrap();
    let out = Command::new(MDKIT).args(["serve", "--check-config", "--config"]).arg(&cfg).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("metrics.allow_remote"), "{stderr}");
    std::fs::write(&cfg, format!("data_dir = \"{}\"\n[metrics]\nlisten = \"127.0.0.1:9108\"\n", dir.path().display()))
        .unwrap();
    let out = Command::new(MDKIT).args(["serve", "--check-config", "--config"]).arg(&cfg).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("metrics: http://127.0.0.1:9108/metrics"), "{stdout}");
}
