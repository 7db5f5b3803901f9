//! `mdkit status [--json]`.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use super::ControlArgs;

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub control: ControlArgs,
    /// Print the raw JSON answer.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: StatusArgs) -> Result<ExitCode> {
    let v = args.control.client()?.call("status", Value::Null)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", human(&v));
    }
    Ok(ExitCode::SUCCESS)
}

/// What the NBD connection limits and the payload budget did, when they did anything.
fn limits_line(v: &Value) -> String {
    let a = &v["admission"];
    let n = |k: &str| a[k].as_u64().unwrap_or(0);
    let (full, per_peer) = (n("refused_full"), n("refused_per_peer"));
    let (evicted, timed_out) = (n("handshakes_evicted"), n("handshakes_timed_out"));
    let waits = v["payload_budget"]["waits"].as_u64().unwrap_or(0);
    if full + per_peer + evicted + timed_out + waits == 0 {
        return String::new();
    }
    let b = &v["payload_budget"];
    format!(
        "limits: refused {full} (all slots established) + {per_peer} (per-peer limit); handshakes cut: {evicted} (max_handshakes), {timed_out} (timeout); payload budget: {} waits, peak {} of {}\n",
        waits,
        size(b["peak_bytes"].as_u64().unwrap_or(0)),
        size(b["limit_bytes"].as_u64().unwrap_or(0)),
    )
}

/// What the control socket's client limits did, when they did anything.
fn control_line(v: &Value) -> String {
    let c = &v["control"];
    let n = |k: &str| c[k].as_u64().unwrap_or(0);
    let (idle, streams, timeouts, refused) = (n("cut_idle"), n("cut_streams"), n("idle_timeouts"), n("refused"));
    if idle + streams + timeouts + refused == 0 {
        return String::new();
    }
    format!(
        "control socket: {} of {} clients; closed {idle} idle and {streams} event streams to make room, {timeouts} \
         after the idle timeout; refused {refused}\n",
        n("clients"),
        n("clients_max"),
    )
}

fn human(v: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("-").to_string();
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    let mut out = String::new();
    out += &format!(
        "mdkit {} (pid {}), up {} s, data dir {}\n",
        s(&v["version"]),
        u(&v["pid"]),
        u(&v["uptime_s"]),
        s(&v["data_dir"])
    );
    let listeners: Vec<String> = v["listeners"].as_array().map(|a| a.iter().map(&s).collect()).unwrap_or_default();
    out += &format!("listeners: {}\nconnections: {}\n", listeners.join(", "), u(&v["connections"]));
    out += &limits_line(v);
    out += &control_line(v);
    out += "\n";
    out += &format!("{:<16} {:<10} {:>12} {:<10}\n", "VOLUME", "KIND", "SIZE", "STATE");
    for vol in v["volumes"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<16} {:<10} {:>12} {:<10}\n",
            s(&vol["name"]),
            s(&vol["kind"]),
            size(u(&vol["size_bytes"])),
            s(&vol["state"])
        );
    }
    for vol in v["volumes"].as_array().into_iter().flatten() {
        if let Some(w) = super::md::write_behind_text(&vol["details"]["write_behind"]) {
            out += &format!("{:<16} write-behind {w}\n", s(&vol["name"]));
        }
    }
    out += &format!(
        "\n{:<16} {:<16} {:<4} {:>5} {:>10} {:>10} {:>10} {:>10} {:>7} {:>6}\n",
        "EXPORT", "VOLUME", "MODE", "CONNS", "READS", "WRITES", "READ", "WRITTEN", "ERRORS", "INFLT"
    );
    for e in v["exports"].as_array().into_iter().flatten().filter(|e| e["state"] != "failed") {
        let st = &e["stats"];
        out += &format!(
            "{:<16} {:<16} {:<4} {:>5} {:>10} {:>10} {:>10} {:>10} {:>7} {:>6}\n",
            s(&e["name"]),
            s(&e["volume"]),
            if e["read_only"].as_bool().unwrap_or(false) { "ro" } else { "rw" },
            u(&e["connections"]),
            u(&st["reads"]),
            u(&st["writes"]),
            size(u(&st["read_bytes"])),
            size(u(&st["written_bytes"])),
            u(&st["errors"]),
            u(&st["in_flight"]),
        );
    }
    out += &failures(v);
    out
}

/// The failed volumes and the exports not served because of them, with the reasons.
fn failures(v: &Value) -> String {
    let s = |v: &Value| v.as_str().unwrap_or("-").to_string();
    let failed = |list: &Value| -> Vec<Value> {
        list.as_array().into_iter().flatten().filter(|x| x["state"] == "failed").cloned().collect()
    };
    let (vols, exports) = (failed(&v["volumes"]), failed(&v["exports"]));
    // Volumes failed at run time keep their own state word and carry an error.
    let at_run_time: Vec<&Value> = v["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| x["state"] != "failed" && x["error"].is_string())
        .collect();
    if vols.is_empty() && exports.is_empty() && at_run_time.is_empty() {
        return String::new();
    }
    let mut out = String::from("\nFAILED\n");
    for f in &vols {
        out += &format!("volume {}: {}\n", s(&f["name"]), s(&f["error"]));
    }
    for f in at_run_time {
        out += &format!("volume {} ({}): {}\n", s(&f["name"]), s(&f["state"]), s(&f["error"]));
    }
    for e in &exports {
        out += &format!("export {} (not served): {}\n", s(&e["name"]), s(&e["error"]));
    }
    out
}

/// "1.0 GiB" style, for people.
fn size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i < UNITS.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{b} B") } else { format!("{x:.1} {}", UNITS[i]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(1 << 30), "1.0 GiB");
        assert_eq!(size(1536 << 20), "1.5 GiB");
    }

    #[test]
    fn human_output_lists_volumes_and_exports() {
        let v = serde_json::json!({
            "version": "0.1.0", "pid": 1, "uptime_s": 2, "data_dir": "/d", "listeners": ["127.0.0.1:10809"],
            "connections": 1,
            "volumes": [{"name": "vol0", "kind": "file", "size_bytes": 1u64 << 30, "state": "active"}],
            "exports": [{"name": "default", "volume": "vol0", "read_only": false, "connections": 1,
                         "stats": {"reads": 3, "writes": 4, "read_bytes": 4096, "written_bytes": 8192, "errors": 0, "in_flight": 0}}]
        });
        let h = human(&v);
        assert!(h.contains("vol0") && h.contains("1.0 GiB") && h.contains("active"), "{h}");
        assert!(h.contains("default") && h.contains("127.0.0.1:10809"), "{h}");
        assert!(!h.contains("FAILED"), "{h}");
        assert!(!h.contains("limits:"), "nothing refused, no limits line: {h}");
    }

    #[test]
    fn human_output_says_what_the_connection_limits_did() {
        let v = serde_json::json!({
            "admission": {"refused_full": 1, "refused_per_peer": 2, "handshakes_evicted": 3, "handshakes_timed_out": 4},
            "payload_budget": {"limit_bytes": 64u64 << 20, "used_bytes": 0, "peak_bytes": 32u64 << 20, "waits": 5},
        });
        let h = human(&v);
        assert!(
            h.contains("limits: refused 1 (all slots established) + 2 (per-peer limit); handshakes cut: 3 (max_handshakes), 4 (timeout); payload budget: 5 waits, peak 32.0 MiB of 64.0 MiB"),
            "{h}"
        );
        assert!(!h.contains("control socket:"), "{h}");
        let v = serde_json::json!({
            "control": {"clients": 64, "clients_max": 64, "cut_idle": 3, "cut_streams": 1, "refused": 2, "idle_timeouts": 5},
        });
        let h = human(&v);
        assert!(
            h.contains("control socket: 64 of 64 clients; closed 3 idle and 1 event streams to make room, 5 after the idle timeout; refused 2"),
            "{h}"
        );
    }

    #[test]
    fn human_output_lists_failed_volumes_and_exports_with_the_reason() {
        let v = serde_json::json!({
            "volumes": [{"name": "md1", "kind": "md", "size_bytes": 0, "state": "failed", "error": "bad superblock"},
                        {"name": "md2", "kind": "md", "size_bytes": 0, "state": "broken", "error": "member gone"}],
            "exports": [{"name": "e1", "volume": "md1", "state": "failed", "error": "volume \"md1\" failed"}]
        });
        let h = human(&v);
        assert!(h.contains("md1") && h.contains("failed") && h.contains("volume md1: bad superblock"), "{h}");
        assert!(h.contains("export e1 (not served)") && h.contains("volume md2 (broken): member gone"), "{h}");
        assert!(!h.lines().any(|l| l.starts_with("e1 ")), "a failed export is not in the served table: {h}");
    }
}
