//! Thin-pool control commands (`mdkit thin ...`) and the restore of pools and thin volumes
//! created at run time.
//!
//! | command            | args                                                             |
//! |--------------------|------------------------------------------------------------------|
//! | `thin.pool-create` | name, force, metadata, data, block_size, options, metadata_size, |
//! |                    | data_size, no_space_timeout_s, low_water_blocks, ...             |
//! |                    | (formats a blank metadata device; `force` formats anything)      |
//! | `thin.status`      | pool                                                             |
//! | `thin.create`      | pool, id, size, name (default POOL.ID), export (default the name; |
//! |                    | "" = none), external_origin (path or volume:NAME, read-only)     |
//! | `thin.snapshot`    | pool, id, origin, size (default the origin's), name, export      |
//! |                    | (an active origin's external origin is the snapshot's too)       |
//! | `thin.delete`      | pool, id                                                         |
//! | `thin.list`        | pool                                                             |
//!
//! Pools and volumes made here are remembered in `<data_dir>/thin-pools.json` and opened again
//! (with their exports) when the service starts, after the configured volumes.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Registry;
use crate::config::ExportSpec;
use crate::service::Service;
use crate::volumes::device_key::DeviceKey;
use crate::volumes::name_claim::NameClaim;
use crate::volumes::open_guard::OpenGuard;
use crate::volumes::thin::{
    OriginArg, PoolOpen, PoolParams, RememberedPool, RememberedThin, STATE_FILE, ThinPoolVolume, ThinState,
    ThinVolumeVol, find_pool, load_state, open_pool, open_thin, size_key, stacked_on, update_state,
};
use crate::volumes::thin_inactive::InactivePool;
use crate::volumes::{FailedVolume, Origin, catch_panic};

pub fn register(r: &mut Registry) {
    r.register("thin.pool-create", "format a new thin pool on two devices and open it", |svc, args| {
        Box::pin(async move { pool_create(svc, args).await })
    });
    r.register("thin.status", "pool status (dmsetup status numbers) and every thin device's", |svc, args| {
        Box::pin(async move { status(svc, args).await })
    });
    r.register("thin.create", "create a thin device, open it as a volume and export it", |svc, args| {
        Box::pin(async move { create(svc, args).await })
    });
    r.register("thin.snapshot", "snapshot a thin device (O(1)), open it as a volume and export it", |svc, args| {
        Box::pin(async move { snapshot(svc, args).await })
    });
    r.register("thin.delete", "delete a thin device (its run-time volume and export go too)", |svc, args| {
        Box::pin(async move { delete(svc, args).await })
    });
    r.register("thin.list", "mapped, exclusive and shared blocks of every thin device", |svc, args| {
        Box::pin(async move { list(svc, args).await })
    });
}

/// `thin.pool-create` arguments: `name`, `force` and the `thin-pool` keys ([`PoolParams`],
/// which rejects unknown keys). Split by hand: serde's `flatten` cannot be combined with
/// `deny_unknown_fields`.
#[derive(Debug)]
struct PoolCreateArgs {
    name: String,
    force: bool,
    /// The `thin-pool` keys as given (remembered for the next start).
    params_json: serde_json::Map<String, Value>,
    params: PoolParams,
}

fn parse_pool_create(args: Value) -> Result<PoolCreateArgs> {
    let Value::Object(mut map) = args else { bail!("thin.pool-create: bad arguments: expected an object") };
    let name = match map.remove("name") {
        Some(Value::String(n)) if !n.is_empty() => n,
        _ => bail!("thin.pool-create: bad arguments: name (a non-empty string) is required"),
    };
    let force = match map.remove("force") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(v) => bail!("thin.pool-create: bad arguments: force must be true or false, not {v}"),
    };
    if map.contains_key("create") {
        bail!("thin.pool-create: bad arguments: `create` is a config-file key (pool-create always formats)");
    }
    let params: PoolParams = super::parse_args("thin.pool-create", Value::Object(map.clone()))?;
    Ok(PoolCreateArgs { name, force, params_json: map, params })
}

async fn pool_create(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a = parse_pool_create(args)?;
    super::check_name("thin pool name", &a.name)?;
    // Held until the pool is registered: a second request for the name is refused before it
    // creates or formats anything.
    let _claim = svc.volumes.read().await.claim(&a.name)?;
    {
        let vols = svc.volumes.read().await;
        if vols.get(&a.name).is_some() {
            bail!("a volume named {:?} already exists", a.name);
        }
        // A remembered pool that failed to open may be formatted anew (its files are guarded by
        // `force`); any other failed volume keeps its name until `mdkit stop` forgets it.
        if let Some(f) = vols.get_failed(&a.name).filter(|f| f.origin != Origin::RememberedThin) {
            bail!(
                "a volume named {:?} exists and failed to open ({}); `mdkit stop {}` forgets it",
                a.name,
                f.error,
                a.name
            );
        }
    }
    // Held until the pool is registered: no other request opens its devices meanwhile (two
    // creates on one file both passed the in-use check, which sees registered volumes only).
    let _devices = {
        let keys = [&a.params.metadata, &a.params.data].map(|s| DeviceKey::new(s, &svc.config.data_dir));
        svc.volumes.read().await.claim_devices(keys.into(), "a pool device")?
    };
    // A device another volume uses is refused by `open_pool` before any file is created.
    // Files the pool would be created on: removed again if it is refused.
    let new_files: Vec<PathBuf> = [&a.params.metadata, &a.params.data]
        .into_iter()
        .filter(|s| !s.starts_with("volume:"))
        .map(|s| svc.config.data_dir.join(s))
        .filter(|p| !p.exists())
        .collect();
    let opened = {
        let vols = svc.volumes.read().await;
        open_pool(&a.name, &a.params, PoolOpen::Format { force: a.force }, &svc.config.data_dir, &vols).await
    };
    let vol = opened.inspect_err(|_| {
        let made: Vec<PathBuf> = new_files.into_iter().filter(|p| p.exists()).collect();
        crate::volumes::md::remove_files(&made);
    })?;
    let st = vol.pool().status().await?;
    {
        let mut vols = svc.volumes.write().await;
        vols.remove_failed(&a.name);
        vols.insert(vol)?;
    }
    update_state(&svc.config.data_dir, |s| {
        s.pools.retain(|p| p.name != a.name);
        s.pools.push(RememberedPool { name: a.name.clone(), params: Value::Object(a.params_json) });
    })?;
    Ok(json!({ "pool": a.name, "status": st.to_string(), "data_block_bytes": st.data_block_bytes }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolArg {
    pool: String,
}

async fn status(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: PoolArg = super::parse_args("thin.status", args)?;
    if let Some(v) = inactive_status(&svc, &a.pool).await {
        return Ok(v);
    }
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let st = pool.status().await?;
    let sizes = load_state(&svc.config.data_dir)?.sizes;
    let mut thins = Vec::new();
    for id in pool.devices().await? {
        let t = pool.thin_status(id).await?;
        thins.push(json!({
            "id": id,
            "status": t.to_string(),
            "mapped_blocks": t.mapped_blocks,
            "mapped_sectors": t.mapped_sectors,
            "highest_mapped_sector": t.highest_mapped_sector,
            "size_bytes": sizes.get(&size_key(&a.pool, id)),
            "open": pool.is_open(id),
            "transaction_id": t.details.transaction_id,
            "creation_time": t.details.creation_time,
            "snapshotted_time": t.details.snapshotted_time,
        }));
    }
    let c = st.counters;
    Ok(json!({
        "pool": a.pool,
        "status": st.to_string(),
        "transaction_id": st.transaction_id,
        "used_metadata_blocks": st.used_metadata_blocks,
        "total_metadata_blocks": st.total_metadata_blocks,
        "used_data_blocks": st.used_data_blocks,
        "total_data_blocks": st.total_data_blocks,
        "held_root": st.held_root,
        "mode": st.mode_str(),
        "mode_reason": st.mode_reason,
        "discard": st.discard.as_str(),
        "error_if_no_space": st.error_if_no_space,
        "needs_check": st.needs_check,
        "metadata_low_water_blocks": st.metadata_low_water_blocks,
        "low_water_blocks": st.low_water_blocks,
        "low_water_reached": st.low_water_reached,
        "data_block_bytes": st.data_block_bytes,
        "zero_new_blocks": st.zero_new_blocks,
        "no_space_timeout_ms": st.no_space_timeout_ms,
        "metadata_device": st.metadata_device,
        "data_device": st.data_device,
        "counters": {
            "commits": c.commits, "commit_rounds": c.commit_rounds, "provisions": c.provisions,
            "sharing_breaks": c.sharing_breaks, "zeroed_blocks": c.zeroed_blocks,
            "discarded_blocks": c.discarded_blocks, "passdown_blocks": c.passdown_blocks,
            "passdown_errors": c.passdown_errors, "no_space_waits": c.no_space_waits,
            "no_space_errors": c.no_space_errors, "fast_reads": c.volumes.fast_reads,
            "fast_writes": c.volumes.fast_writes, "slow_ops": c.volumes.slow_ops,
        },
        "thins": thins,
        "autoextend": autoextend_json(&svc, &a.pool).await,
    }))
}

/// `thin.status` of a deactivated pool (`thin.pool-deactivate`): its devices and the thin
/// volumes it opens again; `None` for any other name.
async fn inactive_status(svc: &Service, pool: &str) -> Option<Value> {
    let vols = svc.volumes.read().await;
    let ip = vols.get(pool)?.as_any().downcast_ref::<InactivePool>()?;
    let [metadata, data] = ip.sources();
    Some(json!({
        "pool": pool,
        "status": "inactive",
        "mode": "inactive",
        "mode_reason": ip.refusal(),
        "metadata_device": metadata,
        "data_device": data,
        "inactive": true,
        "thins": ip.thins().iter().map(|t| json!({ "id": t.id, "volume": t.name, "size_bytes": t.size_bytes }))
            .collect::<Vec<_>>(),
    }))
}

/// The autoextend policy and what it did, `null` when the pool has none.
async fn autoextend_json(svc: &Service, pool: &str) -> Value {
    let vols = svc.volumes.read().await;
    let ae = vols.get(pool).and_then(|v| v.as_any().downcast_ref::<ThinPoolVolume>()).and_then(|p| p.autoextend());
    ae.map_or(Value::Null, |a| a.json())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateArgs {
    pool: String,
    id: u64,
    size: Option<crate::config::Size>,
    origin: Option<u64>,
    name: Option<String>,
    export: Option<String>,
    /// thin.create only: an external origin (path or volume:NAME).
    external_origin: Option<String>,
}

/// Claims the volume name a new thin volume would get and refuses it, or the export, when
/// taken, before its thin device is created: `name` defaults to POOL.ID, `export` to the name
/// ("" = none). The claims (name, and export unless none) are held until [`register_thin`]
/// registered the volume.
pub(super) async fn check_new_thin(
    svc: &Service,
    pool: &str,
    id: u64,
    name: Option<&str>,
    export: Option<&str>,
) -> Result<(NameClaim, Option<NameClaim>)> {
    let name = name.map_or_else(|| format!("{pool}.{id}"), str::to_string);
    super::check_name("volume name", &name)?;
    let claim = svc.volumes.read().await.claim(&name)?;
    if svc.volumes.read().await.get(&name).is_some() {
        bail!("a volume named {name:?} already exists (give another --name)");
    }
    let export_claim = match export {
        Some("") => None,
        Some(e) => Some(super::check_new_export(svc, e).await?),
        None => Some(super::check_new_export(svc, &name).await?),
    };
    Ok((claim, export_claim))
}

/// "pool P has no thin device N (it has: ...)".
pub(super) fn no_device(pool: &str, id: u64, ids: &[u64]) -> String {
    let list: Vec<String> = ids.iter().map(u64::to_string).collect();
    let list = if list.is_empty() { "none".to_string() } else { list.join(", ") };
    format!("pool {pool:?} has no thin device {id} (it has: {list})")
}

/// Refuses a new thin device id the pool already has.
async fn refuse_taken_id(pool: &mdkit_thin::pool::Pool, pool_name: &str, id: u64) -> Result<()> {
    if pool.devices().await?.contains(&id) {
        bail!(
            "thin device {id} already exists in pool {pool_name:?} (`mdkit thin list {pool_name}` shows the ids in use)"
        );
    }
    Ok(())
}

/// A thin device's virtual size: whole 512-byte sectors, at least one, and no more than a
/// block device can have (an `loff_t`).
fn check_thin_size(size: u64) -> Result<u64> {
    if size == 0 || !size.is_multiple_of(512) || size > i64::MAX as u64 {
        bail!("size {size} bytes: must be a non-zero multiple of 512 below 2^63");
    }
    Ok(size)
}

/// Opens `id` as a run-time volume named as `claim` says (and export), remembering it (with
/// its external origin, if given).
pub(super) async fn register_thin(
    svc: &Arc<Service>,
    claim: &NameClaim,
    pool_name: &str,
    id: u64,
    size: Option<u64>,
    export: Option<String>,
    external_origin: Option<String>,
) -> Result<Value> {
    let pool = find_pool(&*svc.volumes.read().await, pool_name)?;
    let name = claim.name().to_string();
    if svc.volumes.read().await.get(&name).is_some() {
        bail!("a volume named {name:?} already exists (give another --name)");
    }
    let origin = OriginArg::open(external_origin.as_deref(), &svc.config.data_dir, &*svc.volumes.read().await)?;
    let vol = open_thin(&name, pool_name, &pool, id, size, origin, &svc.config.data_dir).await?;
    svc.volumes.write().await.insert(vol)?;
    let export = match export {
        Some(e) if e.is_empty() => None,
        Some(e) => Some(e),
        None => Some(name.clone()),
    };
    if let Some(e) = &export {
        svc.add_export(ExportSpec {
            name: e.clone(),
            volume: name.clone(),
            read_only: false,
            description: format!("thin {id} of pool {pool_name}"),
        })
        .await?;
    }
    update_state(&svc.config.data_dir, |s| {
        s.volumes.retain(|v| v.name != name);
        s.volumes.push(RememberedThin {
            name: name.clone(),
            pool: pool_name.to_string(),
            id,
            export: export.clone(),
            external_origin: external_origin.clone(),
        });
    })?;
    Ok(json!({ "pool": pool_name, "id": id, "volume": name, "export": export, "external_origin": external_origin }))
}

async fn create(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: CreateArgs = super::parse_args("thin.create", args)?;
    if a.origin.is_some() {
        bail!("thin.create takes no origin (use thin.snapshot)");
    }
    let size = check_thin_size(a.size.ok_or_else(|| anyhow!("thin.create: size is required"))?.bytes())?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    refuse_taken_id(&pool, &a.pool, a.id).await?;
    let (claim, _export_claim) = check_new_thin(&svc, &a.pool, a.id, a.name.as_deref(), a.export.as_deref()).await?;
    // A bad origin is refused before the device exists.
    drop(OriginArg::open(a.external_origin.as_deref(), &svc.config.data_dir, &*svc.volumes.read().await)?);
    pool.create_thin(a.id).await?;
    update_state(&svc.config.data_dir, |s| {
        s.sizes.insert(size_key(&a.pool, a.id), size);
    })?;
    register_thin(&svc, &claim, &a.pool, a.id, Some(size), a.export, a.external_origin).await
}

/// The external origin an active volume of thin device `id` was opened with: a snapshot of
/// it needs the same one (its unmapped blocks would read zeroes otherwise).
async fn active_origin(svc: &Service, pool: &str, id: u64) -> Option<String> {
    let vols = svc.volumes.read().await;
    vols.iter()
        .filter_map(|v| v.as_any().downcast_ref::<ThinVolumeVol>())
        .find(|t| t.pool_name() == pool && t.id() == id && t.origin_spec().is_some())
        .and_then(|t| t.origin_spec().map(str::to_string))
}

async fn snapshot(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: CreateArgs = super::parse_args("thin.snapshot", args)?;
    let origin = a.origin.ok_or_else(|| anyhow!("thin.snapshot: origin is required"))?;
    if a.external_origin.is_some() {
        bail!("thin.snapshot takes no external_origin (a snapshot uses its origin's)");
    }
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let ids = pool.devices().await?;
    if !ids.contains(&origin) {
        bail!("origin: {}", no_device(&a.pool, origin, &ids));
    }
    refuse_taken_id(&pool, &a.pool, a.id).await?;
    let size = match a.size {
        Some(s) => check_thin_size(s.bytes())?,
        None => load_state(&svc.config.data_dir)?
            .sizes
            .get(&size_key(&a.pool, origin))
            .copied()
            .ok_or_else(|| anyhow!("the size of origin {origin} is not recorded in {STATE_FILE}; give --size"))?,
    };
    let (claim, _export_claim) = check_new_thin(&svc, &a.pool, a.id, a.name.as_deref(), a.export.as_deref()).await?;
    pool.create_snapshot(a.id, origin).await?;
    update_state(&svc.config.data_dir, |s| {
        s.sizes.insert(size_key(&a.pool, a.id), size);
    })?;
    let external_origin = active_origin(&svc, &a.pool, origin).await;
    register_thin(&svc, &claim, &a.pool, a.id, Some(size), a.export, external_origin).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteArgs {
    pool: String,
    id: u64,
}

async fn delete(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: DeleteArgs = super::parse_args("thin.delete", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    // Everything that can refuse is checked before anything is removed: a refused delete
    // leaves the volumes, their exports and the state file as they were.
    let ids = pool.devices().await?;
    if !ids.contains(&a.id) {
        bail!("{}", no_device(&a.pool, a.id, &ids));
    }
    let remembered = load_state(&svc.config.data_dir)?.volumes;
    // Volumes of this device: run-time ones are closed and removed; configured ones block.
    let users: Vec<RememberedThin> = {
        let vols = svc.volumes.read().await;
        let mut users = Vec::new();
        for v in vols.iter() {
            let Some(t) = v.as_any().downcast_ref::<ThinVolumeVol>() else { continue };
            if t.pool_name() != a.pool || t.id() != a.id {
                continue;
            }
            let Some(r) = remembered.iter().find(|r| r.name == v.name()) else {
                bail!(
                    "thin device {} is volume {:?} of the config file; remove it from the config first",
                    a.id,
                    v.name()
                );
            };
            if let Some(user) = stacked_on(&vols, v.name()) {
                bail!(
                    "thin device {} of pool {:?} is volume {:?}, which {user} uses; remove that first",
                    a.id,
                    a.pool,
                    v.name()
                );
            }
            users.push(r.clone());
        }
        users
    };
    for u in &users {
        refuse_connected(&svc, &a.pool, a.id, &u.name).await?;
    }
    // Held while the names are out of the registry: a refused delete registers them again,
    // and no other request may take one meanwhile.
    let claims: Vec<NameClaim> = {
        let vols = svc.volumes.read().await;
        users.iter().map(|u| vols.claim(&u.name)).collect::<Result<_, _>>()?
    };
    // Their export names too: a refused delete serves them again.
    let _export_claims: Vec<NameClaim> = {
        let exports = svc.exports.read().await;
        let theirs = exports.iter().filter(|e| users.iter().any(|u| u.name == e.volume));
        theirs.map(|e| svc.export_claims.claim_export(&e.name)).collect::<Result<_, _>>()?
    };
    for u in &users {
        // Flush first, still exported: a failing flush leaves everything as it was.
        let vol = svc.volumes.read().await.get(&u.name).cloned();
        if let Some(v) = vol {
            v.close().await?;
        }
        let exports: Vec<String> =
            svc.exports.read().await.iter().filter(|e| e.volume == u.name).map(|e| e.name.clone()).collect();
        for e in exports {
            svc.nbd.remove_export(&e);
            svc.exports.write().await.retain(|x| x.name != e);
        }
        svc.volumes.write().await.remove(&u.name);
    }
    if let Err(e) = pool.delete_thin(a.id).await {
        // A client that connected after the check still holds the device: open the volumes
        // and exports again, so the refusal changes nothing.
        for (u, claim) in users.iter().zip(&claims) {
            let export = Some(u.export.clone().unwrap_or_default());
            let again = register_thin(&svc, claim, &a.pool, a.id, None, export, u.external_origin.clone()).await;
            if let Err(r) = again {
                tracing::error!(volume = %u.name, "reopening after a refused thin delete failed: {r:#}");
            }
        }
        bail!("{e} (an NBD client may have connected meanwhile; nothing was deleted)");
    }
    update_state(&svc.config.data_dir, |s| {
        s.sizes.remove(&size_key(&a.pool, a.id));
        s.volumes.retain(|v| !(v.pool == a.pool && v.id == a.id));
    })?;
    let removed: Vec<String> = users.into_iter().map(|u| u.name).collect();
    Ok(json!({ "pool": a.pool, "deleted": a.id, "volumes_removed": removed }))
}

/// Refuses while NBD clients use an export of volume `name` (thin device `id` of `pool`).
async fn refuse_connected(svc: &Service, pool: &str, id: u64, name: &str) -> Result<()> {
    let exports: Vec<String> =
        svc.exports.read().await.iter().filter(|e| e.volume == name).map(|e| e.name.clone()).collect();
    for (export, stats) in svc.nbd.export_stats() {
        if exports.contains(&export) && stats.connections > 0 {
            bail!(
                "thin device {id} of pool {pool:?} is open: export {export:?} of volume {name:?} has {} NBD \
                 client(s) connected; disconnect them first",
                stats.connections
            );
        }
    }
    Ok(())
}

async fn list(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: PoolArg = super::parse_args("thin.list", args)?;
    let pool = find_pool(&*svc.volumes.read().await, &a.pool)?;
    let sizes = load_state(&svc.config.data_dir)?.sizes;
    let vols = svc.volumes.read().await;
    let names: Vec<(u64, String)> = vols
        .iter()
        .filter_map(|v| {
            v.as_any()
                .downcast_ref::<ThinVolumeVol>()
                .map(|t| (t.id(), t.pool_name().to_string(), v.name().to_string()))
        })
        .filter(|(_, p, _)| p == &a.pool)
        .map(|(id, _, n)| (id, n))
        .collect();
    drop(vols);
    let bs = pool.data_block_bytes();
    let rows: Vec<Value> = pool
        .list()
        .await?
        .into_iter()
        .map(|u| {
            json!({
                "id": u.id,
                "mapped_blocks": u.mapped_blocks,
                "exclusive_blocks": u.exclusive_blocks,
                "shared_blocks": u.shared_blocks,
                "mapped_bytes": u.mapped_blocks * bs,
                "size_bytes": sizes.get(&size_key(&a.pool, u.id)),
                "creation_time": u.details.creation_time,
                "snapshotted_time": u.details.snapshotted_time,
                "volumes": names.iter().filter(|(id, _)| *id == u.id).map(|(_, n)| n.clone()).collect::<Vec<_>>(),
            })
        })
        .collect();
    Ok(json!({ "pool": a.pool, "data_block_bytes": bs, "thins": rows }))
}

/// Opens the pools and thin volumes created at run time earlier (thin-pools.json), each after
/// the remembered volumes it is built on ([`open_order`]). A pool that fails to open (error or
/// panic, or it killed an earlier start) is listed as failed with the reason, and so are its
/// thin volumes, whose exports are listed as failed; the service starts without them and
/// `mdkit thin` verbs on the pool say why it is not there.
pub async fn restore(svc: &Arc<Service>) {
    let st = match load_state(&svc.config.data_dir) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("thin pools not restored: {e:#}");
            return;
        }
    };
    let mut guard = OpenGuard::load_or_empty(&svc.config.data_dir);
    for item in open_order(&st) {
        match item {
            Remembered::Pool(p) => restore_one_pool(svc, &mut guard, p).await,
            Remembered::Thin(v) => restore_one_thin(svc, v).await,
        }
    }
}

/// One entry of the state file.
#[derive(Clone, Copy, Debug)]
enum Remembered<'a> {
    Pool(&'a RememberedPool),
    Thin(&'a RememberedThin),
}

impl<'a> Remembered<'a> {
    fn name(&self) -> &'a str {
        match self {
            Remembered::Pool(p) => &p.name,
            Remembered::Thin(v) => &v.name,
        }
    }

    /// The volumes it is built on: a pool's `volume:NAME` devices, a thin volume's pool and
    /// `volume:NAME` external origin.
    fn bases(&self) -> Vec<String> {
        match self {
            Remembered::Pool(p) => {
                let dev = |k: &str| p.params.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
                crate::volumes::volume_refs([dev("metadata").as_str(), dev("data").as_str()])
            }
            Remembered::Thin(v) => {
                let mut bases = crate::volumes::volume_refs(v.external_origin.as_deref());
                bases.push(v.pool.clone());
                bases
            }
        }
    }
}

/// The state file's pools and thin volumes in an order that opens each after the remembered
/// ones it is built on, whatever their kind (a pool on thin volumes of another pool comes after
/// them); otherwise pools first, in file order. Entries in a cycle (a hand-edited file) come
/// last, where they fail to find their bases.
fn open_order(st: &ThinState) -> Vec<Remembered<'_>> {
    let mut pending: Vec<Remembered> =
        st.pools.iter().map(Remembered::Pool).chain(st.volumes.iter().map(Remembered::Thin)).collect();
    let remembered: Vec<String> = pending.iter().map(|r| r.name().to_string()).collect();
    let mut order: Vec<Remembered> = Vec::with_capacity(pending.len());
    while !pending.is_empty() {
        let opened = |b: &String| !remembered.contains(b) || order.iter().any(|o| o.name() == b);
        let next = pending.iter().position(|r| r.bases().iter().all(opened)).unwrap_or(0);
        order.push(pending.remove(next));
    }
    order
}

async fn restore_one_pool(svc: &Arc<Service>, guard: &mut OpenGuard, p: &RememberedPool) {
    if svc.volumes.read().await.contains(&p.name) {
        tracing::warn!(pool = %p.name, "remembered thin pool has the name of a configured volume; skipped");
        return;
    }
    let opened = if guard.crashed(&p.name) {
        Err(OpenGuard::crashed_error())
    } else {
        let open = catch_panic(restore_pool(svc, p));
        guard
            .guarded(&svc.config.data_dir, &p.name, open)
            .await
            .unwrap_or_else(|panic| Err(anyhow!("opening panicked: {panic}")))
    };
    match opened {
        Ok(()) => tracing::info!(pool = %p.name, "remembered thin pool opened"),
        Err(e) => {
            let error = format!("remembered thin pool not opened: {e:#}");
            svc.volume_failed(remembered_failed(&p.name, "thin-pool", error)).await;
        }
    }
}

async fn restore_one_thin(svc: &Arc<Service>, v: &RememberedThin) {
    if svc.volumes.read().await.contains(&v.name) {
        tracing::warn!(volume = %v.name, "remembered thin volume has the name of a configured volume; skipped");
        return;
    }
    match catch_panic(restore_thin(svc, v)).await.unwrap_or_else(|panic| Err(anyhow!("opening panicked: {panic}"))) {
        Ok(()) => tracing::info!(volume = %v.name, "remembered thin volume opened"),
        Err(e) => {
            let error = format!("remembered thin volume not opened: {e:#}");
            svc.volume_failed(remembered_failed(&v.name, "thin", error)).await;
        }
    }
    // Served when the volume opened, listed as failed with the volume's error otherwise.
    if let Some(e) = &v.export {
        let spec = ExportSpec {
            name: e.clone(),
            volume: v.name.clone(),
            read_only: false,
            description: format!("thin {} of pool {}", v.id, v.pool),
        };
        if let Err(err) = svc.add_export(spec).await {
            tracing::error!(volume = %v.name, "export {e:?} not added: {err:#}");
        }
    }
}

fn remembered_failed(name: &str, kind: &str, error: String) -> FailedVolume {
    FailedVolume { name: name.to_string(), kind: kind.to_string(), origin: Origin::RememberedThin, error }
}

async fn restore_pool(svc: &Arc<Service>, p: &RememberedPool) -> Result<()> {
    let params: PoolParams = serde_json::from_value(p.params.clone()).context("remembered parameters")?;
    let vol = {
        let vols = svc.volumes.read().await;
        open_pool(&p.name, &params, PoolOpen::Remembered, &svc.config.data_dir, &vols).await?
    };
    svc.volumes.write().await.insert(vol)
}

async fn restore_thin(svc: &Arc<Service>, v: &RememberedThin) -> Result<()> {
    let pool = find_pool(&*svc.volumes.read().await, &v.pool)?;
    let origin = OriginArg::open(v.external_origin.as_deref(), &svc.config.data_dir, &*svc.volumes.read().await)?;
    let vol = open_thin(&v.name, &v.pool, &pool, v.id, None, origin, &svc.config.data_dir).await?;
    svc.volumes.write().await.insert(vol)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_entries_open_after_the_ones_they_are_built_on() {
        let pool = |name: &str, meta: &str, data: &str| RememberedPool {
            name: name.into(),
            params: json!({ "metadata": meta, "data": data }),
        };
        let thin = |name: &str, pool: &str, origin: Option<&str>| RememberedThin {
            name: name.into(),
            pool: pool.into(),
            id: 0,
            export: None,
            external_origin: origin.map(str::to_string),
        };
        let st = ThinState {
            sizes: Default::default(),
            pools: vec![pool("nested", "volume:a.1", "volume:a.2"), pool("a", "/a.meta", "volume:md0")],
            volumes: vec![
                thin("nested.0", "nested", None),
                thin("a.1", "a", None),
                thin("a.2", "a", Some("volume:a.1")),
                thin("loop", "loop", None),
            ],
        };
        let order: Vec<&str> = open_order(&st).into_iter().map(|r| r.name()).collect();
        assert_eq!(order, ["a", "a.1", "a.2", "nested", "nested.0", "loop"]);
    }

    #[test]
    fn pool_create_arguments_as_the_cli_sends_them() {
        let a = parse_pool_create(json!({
            "name": "tp", "metadata": "/m", "data": "/d", "block_size": "64K", "options": ["skip_block_zeroing"],
            "metadata_size": "8M", "force": true,
        }))
        .unwrap();
        assert_eq!((a.name.as_str(), a.force, a.params.block_size.map(|s| s.bytes())), ("tp", true, Some(64 << 10)));
        assert!(!a.params_json.contains_key("name") && !a.params_json.contains_key("force"));
        let e = parse_pool_create(json!({ "name": "tp", "metadata": "/m", "data": "/d", "bogus": 1 })).unwrap_err();
        assert!(format!("{e:#}").contains("bogus"), "{e:#}");
        let e = parse_pool_create(json!({ "metadata": "/m", "data": "/d" })).unwrap_err();
        assert!(e.to_string().contains("name"), "{e}");
        let e = parse_pool_create(json!({ "name": "tp", "metadata": "/m", "data": "/d", "create": true })).unwrap_err();
        assert!(e.to_string().contains("config-file key"), "{e}");
    }
}
