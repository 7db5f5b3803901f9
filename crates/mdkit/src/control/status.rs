//! `status`: volumes, exports, listeners, connections and per-export counters.

use std::sync::Arc;

use anyhow::Result;
use serde_json::{Value, json};

use super::Registry;
use crate::service::Service;

pub fn register(r: &mut Registry) {
    r.register("status", "volumes (kind, size, state), exports with counters, listeners, connections", |svc, _args| {
        Box::pin(async move { status(svc).await })
    });
}

pub async fn status(svc: Arc<Service>) -> Result<Value> {
    let volumes = svc.volumes.read().await;
    let vols: Vec<Value> = volumes
        .iter()
        .map(|v| {
            let t = v.device().topology();
            json!({
                "name": v.name(),
                "kind": v.kind(),
                "size_bytes": t.size_bytes,
                "logical_block_bytes": t.logical_block_bytes,
                "state": v.state(),
                "details": v.details(),
            })
        })
        .collect();
    let stats = svc.nbd.export_stats();
    let exports: Vec<Value> = svc
        .exports
        .read()
        .await
        .iter()
        .map(|e| {
            let s = stats.iter().find(|(n, _)| n == &e.name).map(|(_, s)| s.clone()).unwrap_or_default();
            let size = volumes.get(&e.volume).map(|v| v.device().topology().size_bytes).unwrap_or(0);
            json!({
                "name": e.name,
                "volume": e.volume,
                "read_only": e.read_only,
                "size_bytes": size,
                "connections": s.connections,
                "stats": {
                    "reads": s.reads, "writes": s.writes, "flushes": s.flushes, "trims": s.trims,
                    "write_zeroes": s.write_zeroes, "read_bytes": s.read_bytes,
                    "written_bytes": s.written_bytes, "errors": s.errors, "in_flight": s.in_flight,
                    "rmw_cycles": s.rmw_cycles,
                },
            })
        })
        .collect();
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
        "volumes": vols,
        "exports": exports,
    }))
}
