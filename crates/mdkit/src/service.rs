//! `mdkit serve` at run time: open volumes, export them over NBD, answer the control socket,
//! and shut down cleanly on SIGINT/SIGTERM.
//!
//! ```text
//!   start:    config check → data dir → volumes (config order) → NBD exports → listeners →
//!             control socket
//!   SIGTERM:  control socket off → NBD: stop accepting, drain in-flight requests (bounded by
//!             nbd.shutdown_grace_ms), flush exports → volumes closed newest first (flush)
//! ```
//!
//! Fault isolation: a volume that fails to open is recorded as failed (`volumes/failed.rs`)
//! and the service starts with the others; an export of a failed volume is not served and is
//! listed as failed (with the reason) by `status`. Only config mistakes (unknown kind, bad
//! keys: [`crate::volumes::check_specs`]) and listener/control-socket errors stop start-up.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use mdkit_nbd::{Export, NbdServer};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::RwLock;

use crate::config::{Config, ExportSpec};
use crate::control::{self, ControlServer};
use crate::volumes::{FailedVolume, Volumes, catch_panic};

/// An export that is not served because its volume failed.
#[derive(Clone, Debug)]
pub struct FailedExport {
    pub spec: ExportSpec,
    pub error: String,
}

/// Everything the control commands can reach.
pub struct Service {
    pub config: Config,
    pub volumes: RwLock<Volumes>,
    pub exports: RwLock<Vec<ExportSpec>>,
    /// Exports not served because their volume failed.
    pub failed_exports: RwLock<Vec<FailedExport>>,
    /// Export names claimed by requests creating a volume with an export, from their check of
    /// the name until the export is added ([`control::check_new_export`]).
    pub export_claims: crate::volumes::name_claim::NameClaims,
    pub default_export: Option<String>,
    pub nbd: NbdServer,
    pub started: Instant,
    /// Events for `mdkit monitor` (`events.rs`).
    pub events: crate::events::EventBus,
    /// The control socket's clients (`control/admission.rs`).
    pub control_clients: Arc<parking_lot::Mutex<control::admission::ClientTable>>,
}

impl Service {
    /// Exports `spec` over NBD (also used by later commands that create volumes at run time).
    /// The export of a failed volume is not served but listed as failed (logged, `Ok`).
    pub async fn add_export(&self, spec: ExportSpec) -> Result<()> {
        let device = {
            let vols = self.volumes.read().await;
            if let Some(f) = vols.get_failed(&spec.volume) {
                let error = format!("volume {:?} failed: {}", f.name, f.error);
                tracing::error!(export = %spec.name, "export not served: {error}");
                self.failed_exports.write().await.push(FailedExport { spec, error });
                return Ok(());
            }
            let v = vols
                .get(&spec.volume)
                .ok_or_else(|| anyhow!("export {:?}: no volume named {:?}", spec.name, spec.volume))?;
            v.device()
        };
        self.nbd.add_export(Export {
            name: spec.name.clone(),
            description: spec.description.clone(),
            device,
            read_only: spec.read_only,
        })?;
        self.exports.write().await.push(spec);
        Ok(())
    }

    /// Records a volume that failed to open at run time (a remembered md array).
    pub async fn volume_failed(&self, f: FailedVolume) {
        self.volumes.write().await.insert_failed(f);
    }

    /// Forgets the failed volume `name` and its failed exports (`mdkit stop`). Returns the
    /// names of the exports forgotten, or `None` when `name` is not a failed volume.
    pub async fn forget_failed(&self, name: &str) -> Option<Vec<String>> {
        self.volumes.write().await.remove_failed(name)?;
        let mut failed = self.failed_exports.write().await;
        let exports = failed.iter().filter(|e| e.spec.volume == name).map(|e| e.spec.name.clone()).collect();
        failed.retain(|e| e.spec.volume != name);
        tracing::info!(volume = name, "failed volume forgotten");
        Some(exports)
    }
}

/// Runs the service until SIGINT/SIGTERM. Returns an error if start-up or the final flush failed.
/// NBD connections run on `connection_runtimes` (round robin; empty = this runtime).
pub async fn run(config: Config, connection_runtimes: Vec<tokio::runtime::Handle>) -> Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;

    crate::volumes::check_specs(&config.volumes)?;
    crate::volumes::thin::check_config_exports(&config)?;
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
    tracing::info!(config = %config.source, data_dir = %config.data_dir.display(), "starting mdkit {}", env!("CARGO_PKG_VERSION"));
    let volumes = Volumes::open_all(&config.volumes, &config.data_dir).await;
    let failed = volumes.failed().count();
    if failed > 0 {
        tracing::warn!(failed, "starting without the volumes that failed (`mdkit status` lists them)");
    }

    let default_export = config
        .nbd
        .default_export
        .clone()
        .or_else(|| (config.exports.len() == 1).then(|| config.exports[0].name.clone()));
    let nbd = NbdServer::new(config.nbd.server.clone());
    nbd.set_connection_runtimes(connection_runtimes);
    nbd.set_default_export(default_export.clone());
    let svc = Arc::new(Service {
        config: config.clone(),
        volumes: RwLock::new(volumes),
        exports: RwLock::new(Vec::new()),
        failed_exports: RwLock::new(Vec::new()),
        export_claims: Default::default(),
        default_export,
        nbd: nbd.clone(),
        started: Instant::now(),
        events: Default::default(),
        control_clients: Arc::new(parking_lot::Mutex::new(control::admission::ClientTable::new(
            control::admission::CLIENTS_MAX,
        ))),
    });

    let control = match start(&svc).await {
        Ok(c) => c,
        Err(e) => {
            let _ = nbd.shutdown(config.nbd.shutdown_grace).await;
            svc.volumes.read().await.close_all().await;
            return Err(e);
        }
    };
    let watcher = crate::events::spawn_watcher(svc.clone());
    let metrics = match config.metrics.listen {
        Some(addr) => match crate::metrics_http::MetricsServer::start(addr, svc.clone()).await {
            Ok(m) => Some(m),
            Err(e) => {
                watcher.abort();
                control.stop();
                let _ = nbd.shutdown(config.nbd.shutdown_grace).await;
                svc.volumes.read().await.close_all().await;
                return Err(e);
            }
        },
        None => None,
    };
    tracing::info!(listeners = ?nbd.listeners().iter().map(|l| l.to_string()).collect::<Vec<_>>(), "mdkit ready");
    crate::notify::notify(&ready_status(&svc).await);

    let which = tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    };
    tracing::info!("{which}: shutting down (grace {} ms)", config.nbd.shutdown_grace.as_millis());
    // A second signal means "now": exit without waiting for the drain.
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => {},
            _ = sigint.recv() => {},
        }
        tracing::error!("second signal during shutdown: exiting immediately");
        std::process::exit(1);
    });

    crate::notify::notify(&format!("STOPPING=1\nSTATUS=stopping ({which})"));
    drop(metrics);
    control.stop();
    watcher.abort();
    let report = nbd.shutdown(config.nbd.shutdown_grace).await;
    let mut errors: Vec<anyhow::Error> =
        report.flush_errors.into_iter().map(|(name, e)| anyhow!("flushing export {name:?}: {e}")).collect();
    errors.extend(svc.volumes.read().await.close_all().await);
    if report.connections_aborted > 0 {
        tracing::warn!(connections = report.connections_aborted, "connections cut at the end of the grace period");
    }
    if errors.is_empty() {
        tracing::info!("shutdown complete: every volume flushed");
        Ok(())
    } else {
        let msg: Vec<String> = errors.iter().map(|e| format!("{e:#}")).collect();
        Err(anyhow!("shutdown finished with errors: {}", msg.join("; ")))
    }
}

/// sd_notify message once serving: `READY=1` and a one-line summary for `systemctl status`.
async fn ready_status(svc: &Service) -> String {
    let volumes = svc.volumes.read().await;
    let failed = volumes.failed().count();
    let open = volumes.iter().count();
    let exports = svc.exports.read().await.len();
    format!("READY=1\nSTATUS=serving {exports} exports; {open} volumes open, {failed} failed")
}

async fn start(svc: &Arc<Service>) -> Result<ControlServer> {
    for spec in &svc.config.exports {
        svc.add_export(spec.clone()).await?;
    }
    // md arrays created or assembled at run time earlier (md-arrays.json). Each array is
    // guarded inside; this guard is for the rest of the restore.
    if let Err(panic) = catch_panic(control::md::restore(svc)).await {
        tracing::error!("restoring md arrays panicked: {panic}; starting without the rest of them");
    }
    // Thin pools and volumes created at run time earlier (thin-pools.json), after md arrays.
    if let Err(panic) = catch_panic(control::thin::restore(svc)).await {
        tracing::error!("restoring thin pools panicked: {panic}; starting without the rest of them");
    }
    for addr in &svc.config.nbd.listen {
        svc.nbd.listen(addr).await.with_context(|| format!("NBD listener {addr}"))?;
    }
    ControlServer::start(&svc.config.control_socket, svc.clone(), control::registry()).await
}
