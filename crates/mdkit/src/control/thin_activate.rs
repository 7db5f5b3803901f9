//! Thin lifecycle commands: open an existing thin device as a volume (what `lvchange -ay`
//! does), close it again, and grow a running pool.
//!
//! | command            | args                                                             |
//! |--------------------|------------------------------------------------------------------|
//! | `thin.activate`    | pool, id, size (default: the recorded size), name (default       |
//! |                    | POOL.ID), export (default the name; "" = none), external_origin  |
//! |                    | (a path or volume:NAME read where the device is unmapped)        |
//! | `thin.deactivate`  | pool, id                                                         |
//! | `thin.pool-resize` | pool, data_size, metadata_size: a size or "max" (the device's    |
//! |                    | current size); both default to "max" when neither is given       |
//!
//! Activated devices are remembered in `<data_dir>/thin-pools.json` like the ones `thin.create`
//! makes, and opened again when the service starts; deactivation forgets them (the size stays
//! recorded). Resizing never shrinks, as dm-thin never does.

use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Registry;
use super::thin::register_thin;
use crate::config::{Size, parse_size};
use crate::service::Service;
use crate::volumes::Volume;
use crate::volumes::thin::{ThinPoolVolume, ThinVolumeVol, load_state, size_key, update_state};
use crate::volumes::thin_inactive::InactivePool;
use crate::volumes::thin_origin::refresh_origins;
use mdkit_thin::meta::sm_format::MAX_METADATA_BLOCKS;

pub fn register(r: &mut Registry) {
    r.register("thin.activate", "open an existing thin device as a volume and export it", |svc, args| {
        Box::pin(async move { activate(svc, args).await })
    });
    r.register("thin.deactivate", "flush a thin device's run-time volume and remove it and its export", |svc, args| {
        Box::pin(async move { deactivate(svc, args).await })
    });
    r.register("thin.pool-resize", "grow a running pool's data and metadata to their devices' sizes", |svc, args| {
        Box::pin(async move { pool_resize(svc, args).await })
    });
}

/// The pool volume `name`, with a clear error for every way it can be missing (an inactive
/// pool included).
pub(super) async fn pool_volume(svc: &Service, name: &str) -> Result<Arc<dyn Volume>> {
    let vols = svc.volumes.read().await;
    if let Some(f) = vols.get_failed(name) {
        bail!("{} {name:?} failed to open: {}", f.kind, f.error);
    }
    let v = vols.get(name).ok_or_else(|| anyhow!("no thin pool named {name:?} (`mdkit status` lists the volumes)"))?;
    if let Some(i) = v.as_any().downcast_ref::<InactivePool>() {
        bail!("{}", i.refusal());
    }
    if v.as_any().downcast_ref::<ThinPoolVolume>().is_none() {
        bail!("volume {name:?} is a {} volume, not a thin-pool", v.kind());
    }
    Ok(v.clone())
}

pub(super) fn as_pool(v: &Arc<dyn Volume>) -> &ThinPoolVolume {
    v.as_any().downcast_ref::<ThinPoolVolume>().expect("checked by pool_volume")
}

/// Names of the volumes that have thin device `id` of `pool` open.
async fn volumes_of(svc: &Service, pool: &str, id: u64) -> Vec<String> {
    svc.volumes
        .read()
        .await
        .iter()
        .filter(|v| v.as_any().downcast_ref::<ThinVolumeVol>().is_some_and(|t| t.pool_name() == pool && t.id() == id))
        .map(|v| v.name().to_string())
        .collect()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActivateArgs {
    pool: String,
    id: u64,
    size: Option<Size>,
    name: Option<String>,
    export: Option<String>,
    external_origin: Option<String>,
}

async fn activate(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: ActivateArgs = super::parse_args("thin.activate", args)?;
    let pv = pool_volume(&svc, &a.pool).await?;
    let pool = as_pool(&pv).pool().clone();
    let ids = pool.devices().await?;
    if !ids.contains(&a.id) {
        let list: Vec<String> = ids.iter().map(u64::to_string).collect();
        bail!(
            "pool {:?} has no thin device {} (it has: {})",
            a.pool,
            a.id,
            if list.is_empty() { "none".to_string() } else { list.join(", ") }
        );
    }
    if let Some(v) = volumes_of(&svc, &a.pool, a.id).await.first() {
        bail!("thin device {} of pool {:?} is already active as volume {v:?}", a.id, a.pool);
    }
    let (claim, _export_claim) =
        super::thin::check_new_thin(&svc, &a.pool, a.id, a.name.as_deref(), a.export.as_deref()).await?;
    let name = a.name.clone().unwrap_or_else(|| format!("{}.{}", a.pool, a.id));
    let export = a.export.clone().unwrap_or_else(|| name.clone());
    if !export.is_empty() {
        if let Some(e) = svc.exports.read().await.iter().find(|e| e.name == export) {
            bail!("export name {export:?} is taken (volume {:?}); give another --export", e.volume);
        }
        if let Some(e) = svc.failed_exports.read().await.iter().find(|e| e.spec.name == export) {
            bail!("export name {export:?} is taken (failed volume {:?}); give another --export", e.spec.volume);
        }
    }
    let size = match a.size {
        Some(s) => s.bytes(),
        None => load_state(&svc.config.data_dir)?.sizes.get(&size_key(&a.pool, a.id)).copied().ok_or_else(|| {
            anyhow!(
                "thin device {} of pool {:?}: its size is not recorded (dm-thin metadata holds no sizes; a device made by the kernel or LVM has none here): give --size",
                a.id,
                a.pool
            )
        })?,
    };
    register_thin(&svc, &claim, &a.pool, a.id, Some(size), Some(export), a.external_origin).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeactivateArgs {
    pool: String,
    id: u64,
}

async fn deactivate(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: DeactivateArgs = super::parse_args("thin.deactivate", args)?;
    pool_volume(&svc, &a.pool).await?;
    let users = volumes_of(&svc, &a.pool, a.id).await;
    if users.is_empty() {
        bail!("thin device {} of pool {:?} is not active", a.id, a.pool);
    }
    let remembered = load_state(&svc.config.data_dir)?.volumes;
    if let Some(n) = users.iter().find(|n| !remembered.iter().any(|r| &r.name == *n)) {
        bail!("thin device {} is volume {n:?} of the config file; remove it from the config instead", a.id);
    }
    let mut exports_removed = Vec::new();
    for n in &users {
        // Flush first, still exported: a failing flush leaves everything as it was.
        let vol = svc.volumes.read().await.get(n).cloned();
        if let Some(v) = &vol {
            v.close().await?;
        }
        let exports: Vec<String> =
            svc.exports.read().await.iter().filter(|e| &e.volume == n).map(|e| e.name.clone()).collect();
        for e in exports {
            svc.nbd.remove_export(&e);
            svc.exports.write().await.retain(|x| x.name != e);
            exports_removed.push(e);
        }
        svc.volumes.write().await.remove(n);
    }
    update_state(&svc.config.data_dir, |s| s.volumes.retain(|v| !(v.pool == a.pool && v.id == a.id)))?;
    Ok(json!({ "pool": a.pool, "id": a.id, "volumes_removed": users, "exports_removed": exports_removed }))
}

/// A requested size: "max" (the device's current size) or bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Max,
    Bytes(u64),
}

fn target(s: Option<&str>, what: &str) -> Result<Option<Target>> {
    match s.map(str::trim) {
        None => Ok(None),
        Some("max") => Ok(Some(Target::Max)),
        Some(t) => Ok(Some(Target::Bytes(parse_size(t).map_err(|e| anyhow!("{what}: {e}"))?))),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResizeArgs {
    pool: String,
    data_size: Option<String>,
    metadata_size: Option<String>,
}

async fn pool_resize(svc: Arc<Service>, args: Value) -> Result<Value> {
    let a: ResizeArgs = super::parse_args("thin.pool-resize", args)?;
    let mut data = target(a.data_size.as_deref(), "data_size")?;
    let mut meta = target(a.metadata_size.as_deref(), "metadata_size")?;
    if data.is_none() && meta.is_none() {
        (data, meta) = (Some(Target::Max), Some(Target::Max));
    }
    let pv = pool_volume(&svc, &a.pool).await?;
    let pv = as_pool(&pv);
    let mut out = json!({ "pool": a.pool });
    // Metadata first: a pool out of metadata space is read-only and cannot take data growth.
    if let Some(t) = meta {
        let (old, new) = grow_metadata(pv, t).await?;
        out["metadata_blocks"] = json!({ "old": old, "new": new });
    }
    if let Some(t) = data {
        let (old, new) = grow_data(pv, t).await?;
        out["data_blocks"] = json!({ "old": old, "new": new });
    }
    if let Some(ae) = pv.autoextend() {
        ae.rearm(pv.pool()).await?;
    }
    // A resume in dm-thin terms: external origins (an md array that reshaped, a grown file)
    // are sampled again.
    let origins = refresh_origins(&*svc.volumes.read().await, |t| t.pool_name() == a.pool);
    if !origins.is_empty() {
        out["external_origins"] = json!(origins);
    }
    out["status"] = json!(pv.pool().status().await?.to_string());
    Ok(out)
}

const METADATA_BLOCK_BYTES: u64 = 4096;

async fn grow_metadata(pv: &ThinPoolVolume, t: Target) -> Result<(u64, u64)> {
    let pool = pv.pool();
    let file = pv.files().meta.as_ref();
    let nr_blocks = match t {
        Target::Max => {
            if let Some(f) = file {
                f.refresh_size()?;
            }
            None
        }
        Target::Bytes(b) => {
            let total = pool.status().await?.total_metadata_blocks;
            let nr = b / METADATA_BLOCK_BYTES;
            if nr < total {
                bail!(
                    "metadata of pool {:?} is {} bytes ({total} blocks); shrinking to {b} bytes is refused (dm-thin refuses it too)",
                    pool.name(),
                    total * METADATA_BLOCK_BYTES
                );
            }
            // Refused before the file grows: a refused resize leaves the device as it was.
            if nr > MAX_METADATA_BLOCKS {
                bail!(
                    "metadata_size {b} bytes: dm-thin metadata maps at most {MAX_METADATA_BLOCKS} blocks ({} bytes)",
                    MAX_METADATA_BLOCKS * METADATA_BLOCK_BYTES
                );
            }
            if let Some(f) = file {
                f.grow_file(b.max(f.refresh_size()?))?;
            }
            Some(nr)
        }
    };
    let r = pool.resize_metadata(nr_blocks).await?;
    Ok((r.old_blocks, r.new_blocks))
}

async fn grow_data(pv: &ThinPoolVolume, t: Target) -> Result<(u64, u64)> {
    let pool = pv.pool();
    let file = pv.files().data.as_ref();
    let nr_blocks = match t {
        Target::Max => {
            if let Some(f) = file {
                f.refresh_size()?;
            }
            pool.data_device_blocks()
        }
        Target::Bytes(b) => {
            let total = pool.total_data_blocks();
            let bs = pool.data_block_bytes();
            let nr = b / bs;
            if nr < total {
                bail!(
                    "pool {:?} has {} bytes of data space ({total} blocks of {bs}); shrinking to {b} bytes is refused (dm-thin refuses it too)",
                    pool.name(),
                    total * bs
                );
            }
            // Refused before the file grows: a refused resize leaves the device as it was.
            pool.check_data_growth(nr).await?;
            if let Some(f) = file {
                f.grow_file(b.max(f.refresh_size()?))?;
            }
            nr
        }
    };
    let r = pool.resize_data_to(nr_blocks).await?;
    Ok((r.old_blocks, r.new_blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_targets() {
        assert_eq!(target(None, "x").unwrap(), None);
        assert_eq!(target(Some("max"), "x").unwrap(), Some(Target::Max));
        assert_eq!(target(Some("64M"), "x").unwrap(), Some(Target::Bytes(64 << 20)));
        assert!(target(Some("lots"), "data_size").unwrap_err().to_string().contains("data_size"));
    }
}
