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
//! [`Volume`] trait. A volume whose open fails (or panics) becomes a [`FailedVolume`] and the
//! service carries on without it (see `failed.rs`); only config mistakes found by
//! [`VolumeKind::check`] (unknown kind, bad keys) stop `mdkit serve` from starting.
//! Kind-specific control commands reach their volume through [`Volume::as_any`] and downcast.

pub mod device_claim;
pub mod device_key;
pub mod failed;
pub mod faults;
pub mod file;
pub mod in_use;
pub mod md;
pub mod md_remote;
pub mod mem;
pub mod name_claim;
pub mod open_guard;
pub mod signatures;
pub mod thin;
pub mod thin_autoextend;
pub mod thin_inactive;
pub mod thin_origin;

use std::any::Any;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use mdkit_io::DeviceRef;

use crate::config::VolumeSpec;
pub use failed::{FailedVolume, Origin, catch_panic};
use name_claim::{NameBusy, NameClaim, NameClaims};
use open_guard::OpenGuard;

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

    /// Checks the config keys without opening anything (`serve --check-config`, and before
    /// start-up: a mistake here stops `mdkit serve`, while an open that fails only marks the
    /// volume failed).
    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        let _ = spec;
        Ok(())
    }

    /// The volumes `spec` is built on (`"volume:NAME"` devices, a thin volume's pool), for
    /// [`check_specs`]: each must be defined before it. Called after [`VolumeKind::check`].
    fn bases(&self, spec: &VolumeSpec) -> Vec<String> {
        let _ = spec;
        Vec::new()
    }

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
    /// Why the volume failed at run time (`None` while it works), shown by `status` next to
    /// the state word. A volume failed at run time stays registered and exported (its
    /// clients get I/O errors rather than a vanished export) until it is stopped or repaired.
    fn error(&self) -> Option<String> {
        None
    }
    /// Kind-specific details for `mdkit status --json` (members, paths, progress, ...).
    fn details(&self) -> serde_json::Value;
    /// For kind-specific control commands: `vol.as_any().downcast_ref::<MdVolume>()`.
    #[allow(dead_code, reason = "used by kind-specific control commands (md attributes, thin)")]
    fn as_any(&self) -> &dyn Any;
    /// Makes everything durable and stops background work; called once at shutdown, after
    /// every export using the volume has stopped.
    fn close(&self) -> BoxFuture<'_, Result<()>>;
}

/// Checks every spec's kind and keys (see [`VolumeKind::check`]), and that every volume it is
/// built on is defined before it (volumes open in config order, so this also refuses cycles).
pub fn check_specs(specs: &[VolumeSpec]) -> Result<()> {
    for (i, spec) in specs.iter().enumerate() {
        let kind = kind_for(&spec.kind).map_err(|e| anyhow!("volume {:?}: {e}", spec.name))?;
        kind.check(spec).map_err(|e| anyhow!("volume {:?} (kind {}): {e:#}", spec.name, spec.kind))?;
        for base in kind.bases(spec) {
            if !specs[..i].iter().any(|s| s.name == base) {
                bail!(
                    "volume {:?} (kind {}) is built on volume {base:?}, which is not defined before it \
                     (volumes open in config order)",
                    spec.name,
                    spec.kind
                );
            }
        }
    }
    Ok(())
}

/// The volume names of `"volume:NAME"` device specs.
pub fn volume_refs<'a>(devices: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    devices.into_iter().filter_map(|d| d.strip_prefix("volume:")).map(str::to_string).collect()
}

/// Opens one volume; an error or a panic in the kind's open becomes an error naming the volume.
async fn open_one(kind: &dyn VolumeKind, spec: &VolumeSpec, ctx: &OpenContext<'_>) -> Result<Arc<dyn Volume>> {
    match catch_panic(kind.open(spec, ctx)).await {
        Ok(r) => r.map_err(|e| anyhow!("opening volume {:?} (kind {}): {e:#}", spec.name, spec.kind)),
        Err(panic) => Err(anyhow!("opening volume {:?} (kind {}) panicked: {panic}", spec.name, spec.kind)),
    }
}

/// Opened volumes by name, in opening order, the volumes that failed to open, and the names
/// claimed by volumes being created (`name_claim.rs`).
#[derive(Default)]
pub struct Volumes {
    list: Vec<Arc<dyn Volume>>,
    failed: Vec<FailedVolume>,
    claims: NameClaims,
    device_claims: device_claim::DeviceClaims,
}

impl Volumes {
    /// Claims `name` for a volume a control command creates, before it opens or writes any
    /// device; refused while another request holds it. The command then checks that no volume
    /// has the name, and inserts its volume before it drops the claim.
    pub fn claim(&self, name: &str) -> Result<NameClaim, NameBusy> {
        self.claims.claim(name)
    }

    /// Claims devices a request opens for a new volume (`what`: "a member", "a pool device"),
    /// until the volume is registered (see `device_claim.rs`); refused while another request
    /// holds one of them.
    pub fn claim_devices(
        &self,
        keys: Vec<device_key::DeviceKey>,
        what: &'static str,
    ) -> Result<device_claim::DeviceClaim, device_claim::DeviceBusy> {
        self.device_claims.claim(keys, what)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Volume>> {
        self.list.iter().find(|v| v.name() == name)
    }

    /// The block device of volume `name` for use under another volume (`spec` as given, for
    /// messages). A thin pool serves no blocks of its own: using it is refused.
    pub fn block_device(&self, name: &str, spec: &str) -> Result<DeviceRef> {
        let vol = self
            .get(name)
            .ok_or_else(|| anyhow!("{spec:?}: no volume named {name:?} (volumes open in config order)"))?;
        if vol.kind() == "thin-pool" {
            bail!("{spec:?}: {name:?} is a thin pool, not a block device (use one of its thin volumes)");
        }
        Ok(vol.device())
    }

    /// Whether `name` is taken, by an open or a failed volume.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some() || self.get_failed(name).is_some()
    }

    pub fn insert(&mut self, v: Arc<dyn Volume>) -> Result<()> {
        if self.get(v.name()).is_some() {
            bail!("volume {:?} is already open", v.name());
        }
        if self.get_failed(v.name()).is_some() {
            bail!("volume {:?} is listed as failed; `mdkit stop {}` forgets it", v.name(), v.name());
        }
        self.list.push(v);
        Ok(())
    }

    pub fn get_failed(&self, name: &str) -> Option<&FailedVolume> {
        self.failed.iter().find(|f| f.name == name)
    }

    /// Records a volume that failed to open (logged here). A name already taken keeps its entry.
    pub fn insert_failed(&mut self, f: FailedVolume) {
        tracing::error!(volume = %f.name, kind = %f.kind, origin = f.origin.as_str(), "volume failed: {}", f.error);
        if !self.contains(&f.name) {
            self.failed.push(f);
        }
    }

    /// Forgets a failed volume (`mdkit stop`).
    pub fn remove_failed(&mut self, name: &str) -> Option<FailedVolume> {
        let i = self.failed.iter().position(|f| f.name == name)?;
        Some(self.failed.remove(i))
    }

    pub fn failed(&self) -> impl Iterator<Item = &FailedVolume> {
        self.failed.iter()
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

    /// Opens every spec in order, each able to see the ones before it. A spec that fails to
    /// open (error or panic) is recorded as failed and the rest are still opened; a volume
    /// stacked on a failed one fails in turn (its base is not there). A volume whose open
    /// killed an earlier start is not opened again (`open_guard.rs`).
    pub async fn open_all(specs: &[VolumeSpec], data_dir: &Path) -> Volumes {
        let mut vols = Volumes::default();
        let mut guard = OpenGuard::load_or_empty(data_dir);
        for spec in specs {
            let opened = match kind_for(&spec.kind) {
                Ok(_) if guard.crashed(&spec.name) => {
                    Err(anyhow!("volume {:?}: {}", spec.name, OpenGuard::crashed_error()))
                }
                Ok(kind) => {
                    let ctx = OpenContext { data_dir, volumes: &vols };
                    guard.guarded(data_dir, &spec.name, open_one(kind.as_ref(), spec, &ctx)).await
                }
                Err(e) => Err(anyhow!("volume {:?}: {e}", spec.name)),
            };
            let inserted = opened.and_then(|v| {
                let size_bytes = v.device().topology().size_bytes;
                tracing::info!(volume = v.name(), kind = v.kind(), size_bytes, "volume open");
                vols.insert(v)
            });
            if let Err(e) = inserted {
                let error = format!("{e:#}");
                vols.insert_failed(FailedVolume {
                    name: spec.name.clone(),
                    kind: spec.kind.clone(),
                    origin: Origin::Config,
                    error,
                });
            }
        }
        vols
    }

    /// Closes every volume, most recently opened first (stacked volumes before their base).
    /// Returns the errors; every volume is attempted.
    pub async fn close_all(&self) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        for v in self.list.iter().rev() {
            let closed = catch_panic(v.close())
                .await
                .unwrap_or_else(|panic| Err(anyhow!("closing volume {:?} panicked: {panic}", v.name())));
            match closed {
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

#[cfg(test)]
mod tests {
    use super::*;

    struct PanicKind;

    impl VolumeKind for PanicKind {
        fn kind(&self) -> &'static str {
            "panic"
        }
        fn open<'a>(&'a self, spec: &'a VolumeSpec, _: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
            Box::pin(async move { panic!("superblock of {} says 2^60 devices", spec.name) })
        }
    }

    fn spec(toml_text: &str) -> VolumeSpec {
        let mut params: toml::Table = toml_text.parse().expect("test spec");
        let name = params.remove("name").and_then(|v| v.as_str().map(str::to_string)).expect("name");
        let kind = params.remove("kind").and_then(|v| v.as_str().map(str::to_string)).expect("kind");
        VolumeSpec { name, kind, params }
    }

    #[tokio::test]
    async fn a_panicking_open_is_an_error_naming_the_volume() {
        let dir = tempfile::tempdir().unwrap();
        let vols = Volumes::default();
        let ctx = OpenContext { data_dir: dir.path(), volumes: &vols };
        let s = spec("name = \"md9\"\nkind = \"panic\"");
        let e = open_one(&PanicKind, &s, &ctx).await.err().expect("open panicked");
        let e = format!("{e:#}");
        assert!(e.contains("\"md9\"") && e.contains("panicked") && e.contains("2^60 devices"), "{e}");
    }

    #[tokio::test]
    async fn a_failing_volume_does_not_stop_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [
            spec("name = \"ram0\"\nkind = \"mem\"\nsize = \"1MiB\""),
            spec("name = \"gone\"\nkind = \"file\"\npath = \"missing.img\""),
            spec("name = \"ram1\"\nkind = \"mem\"\nsize = \"1MiB\""),
        ];
        let vols = Volumes::open_all(&specs, dir.path()).await;
        assert!(vols.get("ram0").is_some() && vols.get("ram1").is_some());
        let f = vols.get_failed("gone").expect("listed as failed");
        assert!(f.error.contains("missing.img") && f.origin == Origin::Config, "{}", f.error);
        assert!(vols.contains("gone") && vols.get("gone").is_none());
        let mut vols = vols;
        assert!(vols.remove_failed("gone").is_some() && !vols.contains("gone"));
        assert!(vols.close_all().await.is_empty());
    }
}
