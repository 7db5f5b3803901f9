//! A thin pool closed by `mdkit thin pool-deactivate` while the service runs (dm-thin's
//! `dmsetup remove` of one pool, LVM's `lvchange -an`): it keeps its name in the registry,
//! listed as `inactive`, with what `mdkit thin pool-activate` needs to open it again — its keys
//! and the thin volumes that were active, with their exports.
//!
//! While inactive, the pool's devices are closed and their exclusive locks released
//! (`mdkit_io::lock`), so offline tools may write them (`thin check --clear-needs-check`,
//! `thin repair`, `thin restore`); the other volumes of the service keep their devices and
//! clients. Within the service its devices stay reserved ([`super::in_use::device_uses`]):
//! no other volume may take them meanwhile.

use std::any::Any;

use anyhow::Result;
use mdkit_io::DeviceRef;

use super::thin::{NotABlockDevice, PoolOpen, PoolParams, ThinPoolVolume};
use super::{BoxFuture, Volume};
use crate::config::ExportSpec;

/// A thin volume of a deactivated pool, as it was open: opened again by `thin.pool-activate`.
#[derive(Clone, Debug)]
pub struct InactiveThin {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    /// Its external origin as given (path or `volume:NAME`).
    pub external_origin: Option<String>,
    /// Its exports, served again once it is open.
    pub exports: Vec<ExportSpec>,
}

/// The deactivated pool and thin volume that will serve export `name` again on activation
/// (such an export name stays taken meanwhile).
pub fn export_of_inactive(volumes: &super::Volumes, name: &str) -> Option<(String, String)> {
    let mut pools = volumes.iter().filter_map(|v| v.as_any().downcast_ref::<InactivePool>());
    pools.find_map(|p| {
        let thin = p.thins.iter().find(|t| t.exports.iter().any(|e| e.name == name))?;
        Some((p.name.clone(), thin.name.clone()))
    })
}

/// A deactivated thin pool in the registry (kind `thin-pool`, state `inactive`).
pub struct InactivePool {
    name: String,
    params: PoolParams,
    reopen: PoolOpen,
    sources: [String; 2],
    thins: Vec<InactiveThin>,
    placeholder: DeviceRef,
}

impl InactivePool {
    /// The entry that replaces `pool` once closed, with the thin volumes that were open on it.
    pub fn of(pool: &ThinPoolVolume, thins: Vec<InactiveThin>) -> InactivePool {
        let (params, reopen) = pool.reopen_with();
        let [m, d] = pool.sources();
        InactivePool {
            name: pool.name().to_string(),
            params: params.clone(),
            reopen,
            sources: [m.to_string(), d.to_string()],
            thins,
            placeholder: NotABlockDevice::pool(pool.name()),
        }
    }

    /// Its metadata and data devices, as the pool had them.
    pub fn sources(&self) -> [&str; 2] {
        [&self.sources[0], &self.sources[1]]
    }

    /// The keys and the way to open it again.
    pub fn reopen_with(&self) -> (&PoolParams, PoolOpen) {
        (&self.params, self.reopen)
    }

    /// The thin volumes to open again with it.
    pub fn thins(&self) -> &[InactiveThin] {
        &self.thins
    }

    /// The refusal of a command that needs the pool open.
    pub fn refusal(&self) -> String {
        format!(
            "thin pool {:?} is inactive (closed by `mdkit thin pool-deactivate`); `mdkit thin pool-activate {}` \
             opens it again",
            self.name, self.name
        )
    }
}

impl Volume for InactivePool {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "thin-pool"
    }
    fn device(&self) -> DeviceRef {
        self.placeholder.clone()
    }
    fn state(&self) -> String {
        "inactive".to_string()
    }
    fn details(&self) -> serde_json::Value {
        serde_json::json!({
            "metadata": self.sources[0],
            "data": self.sources[1],
            "inactive": true,
            "thins": self.thins.iter().map(|t| serde_json::json!({
                "volume": t.name, "id": t.id, "size_bytes": t.size_bytes,
                "exports": t.exports.iter().map(|e| e.name.clone()).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// Nothing is open.
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
}
