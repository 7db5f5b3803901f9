//! The Prometheus exposition of `mdkit serve` (OpenMetrics text, `prometheus-client` crate).
//!
//! Every scrape builds a fresh registry from the same JSON `mdkit status --json` and
//! `mdkit detail --json` print (plus `thin.status` numbers for pools), so the two views never
//! disagree and nothing is added to the data path. Names:
//!
//! - md arrays use node_exporter's md collector names and labels (`node_md_state{device,state}`,
//!   `node_md_disks{device,state}`, `node_md_disks_required`, `node_md_blocks`,
//!   `node_md_blocks_synced`, `node_md_degraded`, `node_md_raid_disks`), `device` = volume
//!   name, so the node-mixin RAID alert rules work unchanged;
//! - everything else is `mdkit_*` with the unit in the name (counters get `_total`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::{Context, Result};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;

use crate::service::Service;

/// `Content-Type` of [`render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// node_exporter's `node_md_state` label values, in its order.
const MD_ACTIVITIES: [&str; 5] = ["active", "inactive", "recovering", "resync", "check"];

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// A registry whose metric families are created on first use.
#[derive(Default)]
struct Sink {
    registry: Registry,
    gauges: BTreeMap<&'static str, Family<Labels, FloatGauge>>,
    counters: BTreeMap<&'static str, Family<Labels, Counter<u64>>>,
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

impl Sink {
    fn gauge(&mut self, name: &'static str, help: &str, pairs: &[(&str, &str)], value: f64) {
        let family = self.gauges.entry(name).or_insert_with(|| {
            let f = Family::<Labels, FloatGauge>::default();
            self.registry.register(name, help, f.clone());
            f
        });
        family.get_or_create(&labels(pairs)).set(value);
    }

    /// `name` without `_total`: the encoder appends it.
    fn counter(&mut self, name: &'static str, help: &str, pairs: &[(&str, &str)], value: u64) {
        let family = self.counters.entry(name).or_insert_with(|| {
            let f = Family::<Labels, Counter<u64>>::default();
            self.registry.register(name, help, f.clone());
            f
        });
        family.get_or_create(&labels(pairs)).inc_by(value);
    }

    fn encode(&self) -> Result<String> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).context("encoding metrics")?;
        Ok(text)
    }
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn count(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// The whole exposition for one scrape.
pub async fn render(svc: &Arc<Service>) -> Result<String> {
    let status = crate::control::status::status(svc.clone()).await?;
    let mut sink = Sink::default();
    service_metrics(&mut sink, &status);
    for v in status["volumes"].as_array().into_iter().flatten() {
        volume_metrics(&mut sink, v);
        if v["kind"] == "md" && v["state"] != "failed" {
            md_metrics(&mut sink, v["name"].as_str().unwrap_or(""), &v["details"]);
        }
        if v["kind"] == "thin-pool" {
            pool_flush_metrics(&mut sink, v["name"].as_str().unwrap_or(""), &v["details"]);
        }
    }
    for e in status["exports"].as_array().into_iter().flatten() {
        export_metrics(&mut sink, e);
    }
    latency_metrics(&mut sink, svc).await;
    thin_pool_metrics(&mut sink, svc).await;
    sink.encode()
}

/// The control socket's clients (status "control").
fn control_metrics(sink: &mut Sink, c: &Value) {
    sink.gauge("mdkit_control_clients", "control socket clients connected now", &[], num(&c["clients"]));
    let help = "control socket clients closed by its limits";
    for (reason, key) in [("cut_idle", "cut_idle"), ("cut_stream", "cut_streams"), ("idle_timeout", "idle_timeouts")] {
        sink.counter("mdkit_control_clients_closed", help, &[("reason", reason)], count(&c[key]));
    }
    let help = "control socket clients refused: every slot ran a command or streamed";
    sink.counter("mdkit_control_clients_refused", help, &[], count(&c["refused"]));
}

fn service_metrics(sink: &mut Sink, status: &Value) {
    let version = status["version"].as_str().unwrap_or("");
    sink.gauge("mdkit_build_info", "mdkit version (value 1)", &[("version", version)], 1.0);
    sink.gauge("mdkit_uptime_seconds", "seconds since mdkit serve started", &[], num(&status["uptime_s"]));
    sink.gauge("mdkit_nbd_connections", "NBD connections open now", &[], num(&status["connections"]));
    sink.counter(
        "mdkit_nbd_connections_accepted",
        "NBD connections accepted since start",
        &[],
        count(&status["connections_accepted"]),
    );
    let a = &status["admission"];
    for (reason, key) in [("full", "refused_full"), ("per_peer", "refused_per_peer")] {
        let help = "NBD connections closed at accept by the connection limits";
        sink.counter("mdkit_nbd_connections_refused", help, &[("reason", reason)], count(&a[key]));
    }
    for (reason, key) in [("max_handshakes", "handshakes_evicted"), ("timeout", "handshakes_timed_out")] {
        let help = "NBD connections cut before they finished the handshake";
        sink.counter("mdkit_nbd_handshakes_cut", help, &[("reason", reason)], count(&a[key]));
    }
    control_metrics(sink, &status["control"]);
    let b = &status["payload_budget"];
    sink.gauge(
        "mdkit_nbd_payload_budget_bytes",
        "READ/WRITE payload bytes allowed at once",
        &[],
        num(&b["limit_bytes"]),
    );
    sink.gauge("mdkit_nbd_payload_budget_used_bytes", "READ/WRITE payload bytes held now", &[], num(&b["used_bytes"]));
    sink.gauge(
        "mdkit_nbd_payload_budget_peak_bytes",
        "most READ/WRITE payload bytes held at once",
        &[],
        num(&b["peak_bytes"]),
    );
    sink.counter("mdkit_nbd_payload_budget_waits", "requests that waited for payload budget", &[], count(&b["waits"]));
}

fn volume_metrics(sink: &mut Sink, v: &Value) {
    let name = v["name"].as_str().unwrap_or("");
    let kind = v["kind"].as_str().unwrap_or("");
    let state = v["state"].as_str().unwrap_or("");
    let id = [("volume", name), ("kind", kind)];
    sink.gauge("mdkit_volume_size_bytes", "volume size", &id, num(&v["size_bytes"]));
    sink.gauge(
        "mdkit_volume_state",
        "1 for the volume's current state word (as in `mdkit status`)",
        &[("volume", name), ("kind", kind), ("state", state)],
        1.0,
    );
    sink.gauge(
        "mdkit_volume_failed",
        "1 when the volume failed to open or failed at run time",
        &id,
        f64::from(u8::from(v["error"].is_string())),
    );
}

fn export_metrics(sink: &mut Sink, e: &Value) {
    let name = e["name"].as_str().unwrap_or("");
    let volume = e["volume"].as_str().unwrap_or("");
    let id = [("export", name), ("volume", volume)];
    let serving = e["state"] == "serving";
    sink.gauge(
        "mdkit_export_serving",
        "1 when the export is served, 0 when its volume failed",
        &id,
        f64::from(u8::from(serving)),
    );
    sink.gauge("mdkit_export_size_bytes", "export size", &id, num(&e["size_bytes"]));
    sink.gauge("mdkit_export_connections", "NBD connections on this export now", &id, num(&e["connections"]));
    let s = &e["stats"];
    sink.gauge(
        "mdkit_export_in_flight_requests",
        "NBD requests dispatched, not yet answered",
        &id,
        num(&s["in_flight"]),
    );
    let counters: [(&'static str, &str, &str); 11] = [
        ("mdkit_export_reads", "NBD read requests", "reads"),
        ("mdkit_export_writes", "NBD write requests", "writes"),
        ("mdkit_export_flushes", "NBD flush requests", "flushes"),
        ("mdkit_export_trims", "NBD trim requests", "trims"),
        ("mdkit_export_write_zeroes", "NBD write-zeroes requests", "write_zeroes"),
        ("mdkit_export_block_status", "NBD block-status requests", "block_status"),
        ("mdkit_export_read_bytes", "bytes read by NBD clients", "read_bytes"),
        ("mdkit_export_written_bytes", "bytes written by NBD clients", "written_bytes"),
        ("mdkit_export_errors", "NBD requests answered with an error", "errors"),
        ("mdkit_export_rmw_cycles", "read-modify-write cycles for unaligned requests", "rmw_cycles"),
        ("mdkit_export_requests", "NBD requests of every kind", ""),
    ];
    for (metric, help, key) in counters {
        let value = if key.is_empty() {
            ["reads", "writes", "flushes", "trims", "write_zeroes", "block_status"].iter().map(|k| count(&s[*k])).sum()
        } else {
            count(&s[key])
        };
        sink.counter(metric, help, &id, value);
    }
}

/// Request service time per served export and request class.
async fn latency_metrics(sink: &mut Sink, svc: &Arc<Service>) {
    let stats = svc.nbd.export_stats();
    let mut family = crate::metrics_latency::HistogramFamily::default();
    for spec in svc.exports.read().await.iter() {
        let Some((_, s)) = stats.iter().find(|(n, _)| n == &spec.name) else { continue };
        for (class, snapshot) in &s.latency {
            family.push(
                labels(&[("export", &spec.name), ("volume", &spec.volume), ("op", class.name())]),
                snapshot.clone(),
            );
        }
    }
    sink.registry.register(
        "mdkit_export_request_duration_seconds",
        "NBD request service time, start of execution to reply ready (op: read, write, flush, other)",
        family,
    );
}

/// node_exporter's activity for `node_md_state`: `None` for a reshape (all five are 0 there).
fn md_activity(d: &Value) -> Option<&'static str> {
    match d["sync"]["action"].as_str().unwrap_or("idle") {
        "resync" => Some("resync"),
        "recover" => Some("recovering"),
        "check" | "repair" => Some("check"),
        "reshape" => None,
        _ => Some(if d["array_state"] == "inactive" { "inactive" } else { "active" }),
    }
}

fn md_metrics(sink: &mut Sink, device: &str, d: &Value) {
    let dev = [("device", device)];
    let activity = md_activity(d);
    for state in MD_ACTIVITIES {
        let on = f64::from(u8::from(activity == Some(state)));
        sink.gauge("node_md_state", "md array activity (node_exporter)", &[("device", device), ("state", state)], on);
    }
    for (state, key) in [("active", "active_devices"), ("failed", "failed_devices"), ("spare", "spare_devices")] {
        sink.gauge(
            "node_md_disks",
            "md members by state (node_exporter)",
            &[("device", device), ("state", state)],
            num(&d[key]),
        );
    }
    sink.gauge("node_md_disks_required", "members the array needs (raid_disks)", &dev, num(&d["raid_disks"]));
    sink.gauge("node_md_raid_disks", "raid_disks attribute", &dev, num(&d["raid_disks"]));
    sink.gauge("node_md_degraded", "missing or failed members", &dev, num(&d["degraded"]));
    let blocks_kib = num(&d["size_bytes"]) / 1024.0;
    sink.gauge("node_md_blocks", "array size in 1 KiB blocks", &dev, blocks_kib);
    let sync = &d["sync"];
    let running = !sync["percent"].is_null();
    let synced_kib = if running { num(&sync["done_sectors"]) / 2.0 } else { blocks_kib };
    sink.gauge(
        "node_md_blocks_synced",
        "1 KiB blocks done by the running sync; node_md_blocks when idle",
        &dev,
        synced_kib,
    );
    md_sync_metrics(sink, device, sync);
    for m in d["members"].as_array().into_iter().flatten() {
        member_metrics(sink, device, m);
    }
    for l in d["remote_members"].as_array().into_iter().flatten() {
        remote_metrics(sink, device, l);
    }
    write_behind_metrics(sink, device, &d["write_behind"]);
}

/// Write-behind (raid1 with a bitmap): the limit and the lag of the write-mostly members.
fn write_behind_metrics(sink: &mut Sink, device: &str, w: &Value) {
    if w.is_null() {
        return;
    }
    let dev = [("device", device)];
    sink.gauge(
        "mdkit_md_write_behind_limit",
        "write-behind: most writes outstanding (0 = off)",
        &dev,
        num(&w["limit"]),
    );
    sink.gauge(
        "mdkit_md_write_behind_outstanding_writes",
        "acknowledged writes not yet on the write-mostly members",
        &dev,
        num(&w["outstanding_writes"]),
    );
    sink.gauge(
        "mdkit_md_write_behind_outstanding_bytes",
        "bytes of those writes (how far the write-mostly members lag)",
        &dev,
        num(&w["outstanding_bytes"]),
    );
    sink.gauge(
        "mdkit_md_write_behind_peak_writes",
        "most behind writes outstanding at once",
        &dev,
        num(&w["peak_writes"]),
    );
    sink.counter(
        "mdkit_md_write_behind_failed_writes",
        "behind writes that failed (the member was failed)",
        &dev,
        count(&w["failed_writes"]),
    );
}

/// A remote (NBD) member's link.
fn remote_metrics(sink: &mut Sink, device: &str, l: &Value) {
    let id = [("device", device), ("member", l["name"].as_str().unwrap_or(""))];
    let up = f64::from(u8::from(l["link"] == "up"));
    sink.gauge("mdkit_md_remote_link_up", "1 while the remote member's NBD link is up", &id, up);
    sink.gauge(
        "mdkit_md_remote_last_contact_seconds",
        "when the remote member's server last answered (Unix time)",
        &id,
        num(&l["last_contact_unix_ms"]) / 1000.0,
    );
    sink.gauge(
        "mdkit_md_remote_outstanding_requests",
        "requests to the remote member waiting for a reply",
        &id,
        num(&l["outstanding_requests"]),
    );
    sink.gauge(
        "mdkit_md_remote_outstanding_bytes",
        "bytes of the requests outstanding to the remote member (its lag)",
        &id,
        num(&l["outstanding_bytes"]),
    );
    sink.counter("mdkit_md_remote_link_losses", "NBD links to the member lost", &id, count(&l["losses"]));
    sink.counter("mdkit_md_remote_reconnects", "NBD links to the member re-established", &id, count(&l["reconnects"]));
    sink.counter(
        "mdkit_md_remote_auto_readds",
        "times the member was re-added after its link returned",
        &id,
        count(&l["auto_readds"]),
    );
}

fn md_sync_metrics(sink: &mut Sink, device: &str, sync: &Value) {
    let dev = [("device", device)];
    let action = sync["action"].as_str().unwrap_or("");
    sink.gauge("mdkit_md_sync_action", "1 for the current sync_action", &[("device", device), ("action", action)], 1.0);
    sink.gauge("mdkit_md_sync_done_sectors", "sectors done by the running sync", &dev, num(&sync["done_sectors"]));
    sink.gauge("mdkit_md_sync_total_sectors", "sectors the running sync covers", &dev, num(&sync["total_sectors"]));
    let ratio = if sync["percent"].is_null() { 0.0 } else { num(&sync["percent"]) / 100.0 };
    sink.gauge("mdkit_md_sync_progress_ratio", "running sync progress, 0..1 (0 when idle)", &dev, ratio);
    sink.gauge("mdkit_md_sync_speed_bytes_per_second", "running sync speed", &dev, num(&sync["speed_kib"]) * 1024.0);
    sink.gauge("mdkit_md_mismatch_sectors", "mismatch_cnt of the last check/repair", &dev, num(&sync["mismatch_cnt"]));
    sink.gauge(
        "mdkit_md_sync_copied_bytes",
        "bytes copied by the current or last resync/recovery (bitmap-guided: the dirty chunks)",
        &dev,
        num(&sync["copied_bytes"]),
    );
}

fn member_metrics(sink: &mut Sink, device: &str, m: &Value) {
    let member = m["name"].as_str().unwrap_or("");
    let id = [("device", device), ("member", member)];
    // `state` is md's word list: ["in_sync"], ["faulty"], ["spare"], ...
    let faulty = m["state"].as_array().is_some_and(|words| words.iter().any(|w| w == "faulty"));
    sink.gauge("mdkit_md_member_faulty", "1 when the member is marked faulty", &id, f64::from(u8::from(faulty)));
    sink.gauge(
        "mdkit_md_member_rebuilding",
        "1 while the member is being rebuilt",
        &id,
        f64::from(u8::from(m["rebuilding"] == true)),
    );
    sink.gauge("mdkit_md_member_in_flight_requests", "member I/O in flight", &id, num(&m["in_flight"]));
    sink.counter("mdkit_md_member_read_errors", "read errors on the member", &id, count(&m["read_errors"]));
    sink.counter(
        "mdkit_md_member_corrected_reads",
        "read errors corrected by rewriting",
        &id,
        count(&m["corrected_reads"]),
    );
}

/// Flushes of a pool's data file (batched: several requests share one round).
fn pool_flush_metrics(sink: &mut Sink, pool: &str, d: &Value) {
    let id = [("pool", pool)];
    if d["data_flush_requests"].is_u64() {
        let requests = count(&d["data_flush_requests"]);
        sink.counter("mdkit_thin_pool_data_flush_requests", "flushes asked of the data file", &id, requests);
        let rounds = count(&d["data_flush_rounds"]);
        sink.counter("mdkit_thin_pool_data_flush_rounds", "fsyncs done for them (batched)", &id, rounds);
    }
}

/// Data and metadata usage of every open thin pool (`thin.status` numbers).
async fn thin_pool_metrics(sink: &mut Sink, svc: &Arc<Service>) {
    let pools: Vec<(String, mdkit_thin::pool::Pool)> = {
        let vols = svc.volumes.read().await;
        vols.iter()
            .filter(|v| v.kind() == "thin-pool")
            .filter_map(|v| crate::volumes::thin::find_pool(&vols, v.name()).ok().map(|p| (v.name().to_string(), p)))
            .collect()
    };
    for (name, pool) in pools {
        let st = match pool.status().await {
            Ok(st) => st,
            Err(e) => {
                tracing::warn!(pool = %name, "metrics: thin pool status failed: {e}");
                continue;
            }
        };
        let id = [("pool", name.as_str())];
        let block = st.data_block_bytes as f64;
        sink.gauge("mdkit_thin_pool_data_used_bytes", "data space allocated", &id, st.used_data_blocks as f64 * block);
        sink.gauge("mdkit_thin_pool_data_size_bytes", "data space", &id, st.total_data_blocks as f64 * block);
        sink.gauge("mdkit_thin_pool_data_used_blocks", "data blocks allocated", &id, st.used_data_blocks as f64);
        sink.gauge("mdkit_thin_pool_data_blocks", "data blocks", &id, st.total_data_blocks as f64);
        sink.gauge(
            "mdkit_thin_pool_metadata_used_blocks",
            "metadata blocks used (dmsetup status)",
            &id,
            st.used_metadata_blocks as f64,
        );
        sink.gauge("mdkit_thin_pool_metadata_blocks", "metadata blocks", &id, st.total_metadata_blocks as f64);
        sink.gauge(
            "mdkit_thin_pool_needs_check",
            "1 when the metadata needs thin_check",
            &id,
            f64::from(u8::from(st.needs_check)),
        );
        sink.gauge(
            "mdkit_thin_pool_mode",
            "1 for the pool mode",
            &[("pool", name.as_str()), ("mode", st.mode_str())],
            1.0,
        );
    }
}
