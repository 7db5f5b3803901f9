//! Close one thin pool and open it again while the service and every other volume keep
//! running: dm-thin's `dmsetup remove` / `dmsetup create` of one pool table (LVM's
//! `lvchange -an` / `-ay` of a thin pool). The way back for a pool that failed (NEEDS_CHECK)
//! without restarting the service: deactivate it, run `mdkit thin check --clear-needs-check`
//! (or `thin repair`) on its metadata offline, activate it.
//!
//! | command                | args                                                         |
//! |------------------------|--------------------------------------------------------------|
//! | `thin.pool-deactivate` | pool, force (close its open thin volumes first)              |
//! | `thin.pool-activate`   | pool                                                         |
//!
//! Deactivation refuses while thin volumes of the pool are open, unless `force`: then each is
//! flushed (a failed pool's flush fails: logged, it is closed anyway), its exports removed and
//! the volume closed. It still refuses while NBD clients are connected to those exports, or
//! another volume is built on one of them. The pool is then closed (its final commit; a failed
//! pool has none: logged) and replaced in the registry by an `inactive` entry
//! (`volumes/thin_inactive.rs`); the answer comes once its device files are closed and their
//! exclusive locks released. Activation opens the pool as it was opened before (never
//! formatting) and then the thin volumes that were open, with their exports. Neither changes
//! `thin-pools.json`: a restart opens the pool as usual.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use mdkit_io::FileDevice;
use mdkit_thin::pool::PoolMode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::Registry;
use crate::config::ExportSpec;
use crate::service::Service;
use crate::volumes::thin::{OriginArg, ThinPoolVolume, ThinVolumeVol, open_pool, open_thin, stacked_on};
use crate::volumes::thin_inactive::{InactivePool, InactiveThin};
use crate::volumes::{FailedVolume, Origin, Volume};

/// How long deactivation waits for the last user of a pool device file to let go (in-flight
/// requests of closed connections) before it answers that the device is still held.
const RELEASE_WAIT_MAX: Duration = Duration::from_secs(10);

pub fn register(r: &mut Registry) {
    r.register(
        "thin.pool-deactivate",
        "close a thin pool (and with force its thin volumes); the service runs on",
        |svc, args| Box::pin(async move { pool_deactivate(svc, args).await }),
    );
    r.register(
        "thin.pool-activate",
        "open a deactivated thin pool again, with the thin volumes it had open",
        |svc, args| Box::pin(async move { pool_activate(svc, args).await }),
    );
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeactivateArgs {
    pool: String,
    #[serde(default)]
    force: bool,
}

/// The open thin volumes of pool `pool`, in registry order.
async fn thin_volumes(svc: &Service, pool: &str) -> Vec<Arc<dyn Volume>> {
    let vols = svc.volumes.read().await;
    let of_pool =
        |v: &&Arc<dyn Volume>| v.as_any().downcast_ref::<ThinVolumeVol>().is_some_and(|t| t.pool_name() == pool);
    vols.iter().filter(of_pool).cloned().collect()
}

/// The exports of volume `name`.
async fn exports_of(svc: &Service, name: &str) -> Vec<ExportSpec> {
    svc.exports.read().await.iter().filter(|e| e.volume == name).cloned().collect()
}

/// Refuses when the thin volumes cannot be closed: without `force`, or with clients connected
/// to them or volumes built on them.
async fn refuse_open_thins(svc: &Service, pool: &str, thins: &[Arc<dyn Volume>], force: bool) -> Result<()> {
    if thins.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = thins.iter().map(|t| t.name()).collect();
    if !force {
        bail!(
            "thin pool {pool:?} has open thin volumes ({}); deactivate them first (`mdkit thin deactivate {pool} ID`) \
             or give --force to close them with the pool (`mdkit thin pool-activate` opens them again)",
            names.join(", ")
        );
    }
    let stats = svc.nbd.export_stats();
    for t in thins {
        if let Some(user) = stacked_on(&*svc.volumes.read().await, t.name()) {
            bail!("thin volume {:?} of pool {pool:?} is used by {user}; stop that first", t.name());
        }
        for e in exports_of(svc, t.name()).await {
            let connected = stats.iter().find(|(n, _)| *n == e.name).map_or(0, |(_, s)| s.connections);
            if connected > 0 {
                bail!(
                    "export {:?} of thin volume {:?} has {connected} NBD client(s) connected; disconnect them first",
                    e.name,
                    t.name()
                );
            }
        }
    }
    Ok(())
}

async fn pool_deactivate(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: DeactivateArgs = super::parse_args("thin.pool-deactivate", args)?;
    let pv = super::thin_activate::pool_volume(&svc, &a.pool).await?;
    let pool = super::thin_activate::as_pool(&pv).pool().clone();
    let thins = thin_volumes(&svc, &a.pool).await;
    refuse_open_thins(&svc, &a.pool, &thins, a.force).await?;
    // Held while the thin volumes are out of the registry: no other request takes a name.
    let _claims = {
        let vols = svc.volumes.read().await;
        thins.iter().map(|t| vols.claim(t.name())).collect::<Result<Vec<_>, _>>()?
    };
    // And their export names, until the inactive pool (which keeps them taken) is registered.
    let mut _export_claims = Vec::new();
    for t in &thins {
        for e in exports_of(&svc, t.name()).await {
            _export_claims.push(svc.export_claims.claim_export(&e.name)?);
        }
    }
    // Flush first, still exported: a healthy pool whose flush fails is left as it was.
    for t in &thins {
        if let Err(e) = t.close().await {
            if pool.mode() != PoolMode::Failed {
                return Err(e.context(format!("thin pool {:?}: nothing was deactivated", a.pool)));
            }
            tracing::warn!(pool = %a.pool, volume = t.name(), "failed pool: thin volume closed without its flush: {e:#}");
        }
    }
    let mut saved = Vec::with_capacity(thins.len());
    let mut exports_removed = Vec::new();
    for t in &thins {
        let exports = exports_of(&svc, t.name()).await;
        for e in &exports {
            svc.nbd.remove_export(&e.name);
            exports_removed.push(e.name.clone());
        }
        svc.exports.write().await.retain(|e| e.volume != t.name());
        svc.volumes.write().await.remove(t.name());
        let tv = t.as_any().downcast_ref::<ThinVolumeVol>().expect("filtered by thin_volumes");
        saved.push(InactiveThin {
            name: t.name().to_string(),
            id: tv.id(),
            size_bytes: t.device().topology().size_bytes,
            external_origin: tv.origin_spec().map(str::to_string),
            exports,
        });
    }
    let volumes_removed: Vec<String> = saved.iter().map(|t| t.name.clone()).collect();
    drop(thins);
    let was_failed = pool.mode() == PoolMode::Failed;
    let files = release_watch(super::thin_activate::as_pool(&pv));
    {
        let mut vols = svc.volumes.write().await;
        vols.remove(&a.pool);
        vols.insert(Arc::new(InactivePool::of(super::thin_activate::as_pool(&pv), saved)))?;
    }
    let final_commit = match pv.close().await {
        Ok(()) => {
            tracing::info!(pool = %a.pool, "thin pool deactivated: committed and closed");
            Value::Null
        }
        Err(e) if was_failed => {
            tracing::warn!(pool = %a.pool, "failed thin pool deactivated: closed without its final commit ({e:#})");
            json!(format!("{e:#}"))
        }
        Err(e) => {
            tracing::error!(pool = %a.pool, "thin pool deactivated, but its final commit failed: {e:#}");
            json!(format!("{e:#}"))
        }
    };
    drop((pv, pool));
    let released = wait_released(&files).await;
    if !released {
        tracing::warn!(pool = %a.pool, "thin pool deactivated, but a device file is still held after {RELEASE_WAIT_MAX:?}");
    }
    Ok(json!({
        "pool": a.pool,
        "was_failed": was_failed,
        "final_commit_error": final_commit,
        "volumes_removed": volumes_removed,
        "exports_removed": exports_removed,
        "devices_released": released,
    }))
}

/// The pool's device files, to see them closed.
fn release_watch(p: &ThinPoolVolume) -> Vec<Weak<FileDevice>> {
    let f = p.files();
    [&f.meta, &f.data].into_iter().flatten().map(Arc::downgrade).collect()
}

/// Waits (at most [`RELEASE_WAIT_MAX`]) until no one holds the files: closed, their locks
/// released. Whether they were.
async fn wait_released(files: &[Weak<FileDevice>]) -> bool {
    let start = Instant::now();
    while files.iter().any(|f| f.strong_count() > 0) {
        if start.elapsed() > RELEASE_WAIT_MAX {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActivateArgs {
    pool: String,
}

async fn pool_activate(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: ActivateArgs = super::parse_args("thin.pool-activate", args)?;
    // Held while the pool is out of the registry (being opened): no other request takes the name.
    let _claim = svc.volumes.read().await.claim(&a.pool)?;
    let inactive = {
        let mut vols = svc.volumes.write().await;
        let v = vols
            .get(&a.pool)
            .ok_or_else(|| anyhow!("no thin pool named {:?} (`mdkit status` lists the volumes)", a.pool))?;
        if v.as_any().downcast_ref::<ThinPoolVolume>().is_some() {
            bail!("thin pool {:?} is active", a.pool);
        }
        if v.as_any().downcast_ref::<InactivePool>().is_none() {
            bail!("volume {:?} is a {} volume, not a deactivated thin pool", a.pool, v.kind());
        }
        vols.remove(&a.pool).expect("found above")
    };
    let ip = inactive.as_any().downcast_ref::<InactivePool>().expect("checked above");
    let (params, how) = ip.reopen_with();
    let opened = {
        let vols = svc.volumes.read().await;
        open_pool(&a.pool, params, how, &svc.config.data_dir, &vols).await
    };
    let vol = match opened {
        Ok(v) => v,
        Err(e) => {
            // Still inactive: fix what the error says and activate again.
            svc.volumes.write().await.insert(inactive.clone())?;
            return Err(e.context(format!("thin pool {:?} stays inactive", a.pool)));
        }
    };
    let pool = vol.pool().clone();
    svc.volumes.write().await.insert(vol)?;
    tracing::info!(pool = %a.pool, mode = ?pool.mode(), "thin pool activated");
    let mut volumes_opened = Vec::new();
    let mut errors = Vec::new();
    for t in ip.thins() {
        match reopen_thin(&svc, &a.pool, &pool, t).await {
            Ok(()) => volumes_opened.push(t.name.clone()),
            Err(e) => {
                let error = format!("thin volume of pool {:?} not opened again: {e:#}", a.pool);
                errors.push(json!({ "volume": t.name, "error": error }));
                let origin = if crate::volumes::thin::load_state(&svc.config.data_dir)
                    .is_ok_and(|st| st.volumes.iter().any(|r| r.name == t.name))
                {
                    Origin::RememberedThin
                } else {
                    Origin::Config
                };
                svc.volume_failed(FailedVolume { name: t.name.clone(), kind: "thin".into(), origin, error }).await;
            }
        }
    }
    let st = pool.status().await?;
    Ok(json!({
        "pool": a.pool,
        "status": st.to_string(),
        "mode": st.mode_str(),
        "needs_check": st.needs_check,
        "volumes_opened": volumes_opened,
        "errors": errors,
    }))
}

/// Opens thin volume `t` of the activated pool again, with its exports.
async fn reopen_thin(
    svc: &Arc<Service>,
    pool_name: &str,
    pool: &mdkit_thin::pool::Pool,
    t: &InactiveThin,
) -> Result<()> {
    let _claim = svc.volumes.read().await.claim(&t.name)?;
    if svc.volumes.read().await.contains(&t.name) {
        bail!("the name {:?} was taken while the pool was inactive", t.name);
    }
    // Its exports before anything is registered: a thin volume is served with all of them or
    // not opened (no other request may take one meanwhile).
    let mut _export_claims = Vec::new();
    for e in &t.exports {
        _export_claims.push(svc.export_claims.claim_export(&e.name)?);
        if let Some(other) = svc.exports.read().await.iter().find(|x| x.name == e.name) {
            bail!("export {:?} was taken by volume {:?} while the pool was inactive", e.name, other.volume);
        }
    }
    let origin = OriginArg::open(t.external_origin.as_deref(), &svc.config.data_dir, &*svc.volumes.read().await)?;
    let vol = open_thin(&t.name, pool_name, pool, t.id, Some(t.size_bytes), origin, &svc.config.data_dir).await?;
    svc.volumes.write().await.insert(vol)?;
    for e in &t.exports {
        svc.add_export(e.clone()).await.with_context(|| format!("export {:?}", e.name))?;
    }
    Ok(())
}
