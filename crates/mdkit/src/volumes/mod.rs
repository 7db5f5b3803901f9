//! Volumes: the block devices the service builds from `[[volume]]` tables and exports.
//!
//! A volume *kind* knows how to open one volume from its config keys. Kinds are listed in
//! [`kinds()`]; volumes are opened in config order into a [`Volumes`] registry, so a volume can
//! stack on volumes defined before it (a thin volume on a thin pool, a pool on an md array) by
//! looking them up by name in [`OpenContext::volumes`].
//!
//! Adding a kind (e.g. `kind = "md"`):
//! 1. create `volumes/md.rs` with a unit struct implementing [`VolumeKind`] (parse your keys
//!    with `spec.parse_params::<MdParams>()`, open members, build the array) and a type
//!    implementing [`Volume`] (device, state, status JSON, close);
//! 2. add `pub mod md;` below and `Box::new(md::MdKind)` to [`kinds()`].
//!
//! Nothing else changes: config parsing, exports, `mdkit status` and shutdown work on the
//! [`Volume`] trait. Kind-specific control commands reach their volume through
//! [`Volume::as_any`] and downcast.

pub mod file;
pub mod md;
pub mod mem;
pub mod thin;

use std::any::Any;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use mdkit_io::DeviceRef;

use crate::config::VolumeSpec;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Every volume kind the service knows. Add new kinds here.
pub fn kinds() -> Vec<Box<dyn VolumeKind>> {
    vec![
        Box::new(file::FileKind),
        Box::new(mem::MemKind),
        Box::new(md::MdKind),
        Box::new(thin::ThinPoolKind),
        Box::new(thin::ThinKind),
    ]
}

/// Finds the kind for `kind = "..."`.
pub fn kind_for(name: &str) -> Result<Box<dyn VolumeKind>> {
    let all = kinds();
    let known: Vec<&str> = all.iter().map(|k| k.kind()).collect();
    let known = known.join(", ");
    all.into_iter().find(|k| k.kind() == name).ok_or_else(|| anyhow!("unknown volume kind {name:?} (known: {known})"))
}

/// How to build volumes of one kind.
pub trait VolumeKind: Send + Sync {
    /// The `kind = "..."` string.
    fn kind(&self) -> &'static str;

    /// Opens the volume described by `spec`, creating its backing storage if the kind and the
    /// config say so. Volumes defined earlier in the config are in `ctx.volumes`.
    fn open<'a>(&'a self, spec: &'a VolumeSpec, ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>>;
}

/// What a kind may use while opening a volume.
pub struct OpenContext<'a> {
    /// The data directory; relative member paths resolve inside it.
    pub data_dir: &'a Path,
    /// Volumes opened so far (earlier in the config).
    #[allow(dead_code, reason = "for kinds that stack on other volumes (thin on thin-pool, pool on md)")]
    pub volumes: &'a Volumes,
}

impl OpenContext<'_> {
    /// Absolute paths stay, relative paths go inside the data directory.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() { p.to_path_buf() } else { self.data_dir.join(p) }
    }
}

/// An opened volume.
pub trait Volume: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn kind(&self) -> &'static str;
    /// The block device that exports (and stacked volumes) use.
    fn device(&self) -> DeviceRef;
    /// One word for `mdkit status`: "active", "degraded", "resyncing", "needs-check", ...
    fn state(&self) -> String;
    /// Kind-specific details for `mdkit status --json` (members, paths, progress, ...).
    fn details(&self) -> serde_json::Value;
    /// For kind-specific control commands: `vol.as_any().downcast_ref::<MdVolume>()`.
    #[allow(dead_code, reason = "used by kind-specific control commands (md attributes, thin)")]
    fn as_any(&self) -> &dyn Any;
    /// Makes everything durable and stops background work; called once at shutdown, after
    /// every export using the volume has stopped.
    fn close(&self) -> BoxFuture<'_, Result<()>>;
}

/// Opened volumes by name, in opening order.
#[derive(Default)]
pub struct Volumes {
    list: Vec<Arc<dyn Volume>>,
}

impl Volumes {
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Volume>> {
        self.list.iter().find(|v| v.name() == name)
    }

    pub fn insert(&mut self, v: Arc<dyn Volume>) -> Result<()> {
        if self.get(v.name()).is_some() {
            bail!("volume {:?} is already open", v.name());
        }
        self.list.push(v);
        Ok(())
    }

    /// Removes a volume (e.g. `mdkit stop`); the caller must have removed its exports.
    #[allow(dead_code, reason = "for run-time stop/remove commands")]
    pub fn remove(&mut self, name: &str) -> Option<Arc<dyn Volume>> {
        let i = self.list.iter().position(|v| v.name() == name)?;
        Some(self.list.remove(i))
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Arc<dyn Volume>> {
        self.list.iter()
    }

    /// Opens every spec in order, each able to see the ones before it.
    pub async fn open_all(specs: &[VolumeSpec], data_dir: &Path) -> Result<Volumes> {
        let mut vols = Volumes::default();
        for spec in specs {
            let kind = kind_for(&spec.kind).map_err(|e| anyhow!("volume {:?}: {e}", spec.name))?;
            let v = {
                let ctx = OpenContext { data_dir, volumes: &vols };
                kind.open(spec, &ctx)
                    .await
                    .map_err(|e| anyhow!("opening volume {:?} (kind {}): {e:#}", spec.name, spec.kind))?
            };
            tracing::info!(
                volume = v.name(),
                kind = v.kind(),
                size_bytes = v.device().topology().size_bytes,
                "volume open"
            );
            vols.insert(v)?;
        }
        Ok(vols)
    }

    /// Closes every volume, most recently opened first (stacked volumes before their base).
    /// Returns the errors; every volume is attempted.
    pub async fn close_all(&self) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        for v in self.list.iter().rev() {
            match v.close().await {
                Ok(()) => tracing::info!(volume = v.name(), "volume flushed and closed"),
                Err(e) => {
                    tracing::error!(volume = v.name(), "closing volume failed: {e:#}");
                    errors.push(e.context(format!("closing volume {:?}", v.name())));
                }
            }
        }
        errors
    }
}
