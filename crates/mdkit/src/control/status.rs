//! `status`: volumes, exports, listeners, connections and per-export counters.
//!
//! Volumes that failed to open are listed with `"state": "failed"` and `"error"`; exports of
//! a failed volume with `"state": "failed"` and the reason (served ones: `"serving"`). A volume
//! that failed at run time keeps its state word (`broken`, `needs-check`, `lost-write`) and
//! gets an `"error"` too.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use anyhow::Result;
use serde_json::{Value, json};

use super::Registry;
use crate::config::ExportSpec;
use crate::service::{FailedExport, Service};
use crate::volumes::Volume;
use crate::volumes::failed::panic_message;
use mdkit_nbd::ExportStatsSnapshot;

pub fn register(r: &mut Registry) {
    r.register("status", "volumes (kind, size, state), exports with counters, listeners, connections", |svc, args| {
        Box::pin(async move {
            super::no_args("status", &args)?;
            status(svc).await
        })
    });
}

/// One open volume's entry; a panic in the volume's reporting shows as a failed entry instead
/// of failing the whole `status`.
fn volume_json(v: &Arc<dyn Volume>) -> Value {
    let entry = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let t = v.device().topology();
        let mut entry = json!({
            "name": v.name(),
            "kind": v.kind(),
            "size_bytes": t.size_bytes,
            "logical_block_bytes": t.logical_block_bytes,
            "state": v.state(),
            "details": v.details(),
        });
        if let Some(error) = v.error() {
            entry["error"] = json!(error);
        }
        entry
    }));
    entry.unwrap_or_else(|payload| {
        let error = format!("reporting its status panicked: {}", panic_message(payload.as_ref()));
        tracing::error!(volume = v.name(), "{error}");
        json!({ "name": v.name(), "kind": v.kind(), "size_bytes": 0, "state": "failed", "error": error })
    })
}

fn export_json(e: &ExportSpec, s: &ExportStatsSnapshot, size_bytes: u64) -> Value {
    json!({
        "name": e.name,
        "volume": e.volume,
        "read_only": e.read_only,
        "state": "serving",
        "size_bytes": size_bytes,
        "connections": s.connections,
        "stats": {
            "reads": s.reads, "writes": s.writes, "flushes": s.flushes, "trims": s.trims,
            "write_zeroes": s.write_zeroes, "block_status": s.block_status, "read_bytes": s.read_bytes,
            "written_bytes": s.written_bytes, "errors": s.errors, "in_flight": s.in_flight,
            "rmw_cycles": s.rmw_cycles,
        },
    })
}

fn failed_export_json(f: &FailedExport) -> Value {
    json!({
        "name": f.spec.name,
        "volume": f.spec.volume,
        "read_only": f.spec.read_only,
        "state": "failed",
        "error": f.error,
        "size_bytes": 0,
        "connections": 0,
        "stats": {},
    })
}

pub async fn status(svc: Arc<Service>) -> Result<Value> {
    let volumes = svc.volumes.read().await;
    let mut vols: Vec<Value> = volumes.iter().map(volume_json).collect();
    vols.extend(volumes.failed().map(|f| f.status_json()));
    let stats = svc.nbd.export_stats();
    let mut exports: Vec<Value> = svc
        .exports
        .read()
        .await
        .iter()
        .map(|e| {
            let s = stats.iter().find(|(n, _)| n == &e.name).map(|(_, s)| s.clone()).unwrap_or_default();
            let size = volumes.get(&e.volume).map(|v| v.device().topology().size_bytes).unwrap_or(0);
            export_json(e, &s, size)
        })
        .collect();
    exports.extend(svc.failed_exports.read().await.iter().map(failed_export_json));
    Ok(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "uptime_s": svc.started.elapsed().as_secs(),
        "config": svc.config.source,
        "data_dir": svc.config.data_dir.display().to_string(),
        "control_socket": svc.config.control_socket.display().to_string(),
        "listeners": svc.nbd.listeners().iter().map(|l| l.to_string()).collect::<Vec<_>>(),
        "default_export": svc.default_export,
        "connections": svc.nbd.connection_count(),
        "connections_accepted": svc.nbd.connections_accepted(),
        "admission": admission_json(&svc.nbd.admission_stats()),
        "payload_budget": budget_json(&svc.nbd.payload_budget()),
        "control": control_json(&svc.control_clients.lock().stats()),
        "volumes": vols,
        "exports": exports,
    }))
}

/// What the connection limits (`[nbd] max_connections`, `max_connections_per_peer`,
/// `max_handshakes`, `handshake_timeout_ms`) did since start: how many connections they closed.
fn admission_json(a: &mdkit_nbd::AdmissionSnapshot) -> Value {
    json!({
        "refused_full": a.refused_total,
        "refused_per_peer": a.refused_per_peer,
        "handshakes_evicted": a.handshakes_evicted,
        "handshakes_timed_out": a.handshakes_timed_out,
    })
}

/// The control socket's clients now, and how many its limits closed since start
/// (`control/admission.rs`).
fn control_json(c: &super::admission::ControlStats) -> Value {
    json!({
        "clients": c.connected,
        "clients_max": super::admission::CLIENTS_MAX,
        "cut_idle": c.cut_idle,
        "cut_streams": c.cut_streams,
        "refused": c.refused,
        "idle_timeouts": c.idle_timeouts,
    })
}

/// The server-wide READ/WRITE payload budget (`[nbd] payload_budget_bytes`).
fn budget_json(b: &mdkit_nbd::BudgetSnapshot) -> Value {
    json!({
        "limit_bytes": b.limit_bytes,
        "used_bytes": b.used_bytes,
        "peak_bytes": b.peak_bytes,
        "waits": b.waits,
    })
}
