//! `kind = "thin-pool"` and `kind = "thin"`: dm-thin pools and thin volumes (mdkit-thin's
//! runtime), kernel-compatible metadata.
//!
//! ```toml
//! [[volume]]
//! name = "pool0"
//! kind = "thin-pool"
//! metadata = "pool0.meta"       # path (relative to data_dir) or "volume:NAME" (an earlier volume)
//! metadata_size = "64MiB"       # create a missing metadata file sparse with this size
//! data = "volume:md0"           # e.g. an md array defined above
//! data_size = "100GiB"          # create a missing data file sparse with this size
//! create = true                 # format the metadata when it is blank (its first MiB all
//!                               # zeroes: a new device); default false: only ever open
//! block_size = "64KiB"          # data block size, 64 KiB..1 GiB, a multiple of 64 KiB; used to
//!                               # format (default 64 KiB), checked against an existing pool
//! options = ["error_if_no_space"]   # dm-thin features: skip_block_zeroing, error_if_no_space,
//!                               # no_discard_passdown, ignore_discard, read_only
//! no_space_timeout_s = 60       # queue writes this long when out of data space, then fail
//! low_water_blocks = 1024       # warn (log, status) when free data blocks are down to it
//! autoextend_threshold_percent = 80  # file data device: grow it once 80% is used
//! autoextend_step = "20%"       # by 20% of its size (or a size, "1GiB"), see thin_autoextend.rs
//! autoextend_max_size = "1TiB"  # never beyond this
//! commit_interval_ms = 1000     # commit at least this often when metadata changed
//! check_on_open = true          # check the metadata before opening read-write
//! direct = "auto"               # file devices: auto | require | off (O_DIRECT)
//! queue_depth = 128             # file devices: io_uring requests in flight
//!
//! [[volume]]
//! name = "vol0"
//! kind = "thin"
//! pool = "pool0"                # a thin-pool volume defined above
//! id = 0                        # thin device id (24 bits)
//! size = "10GiB"                # virtual size; may be omitted once recorded (see below)
//! create = true                 # create thin device `id` in the pool if it does not exist
//! external_origin = "base.img"  # unmapped blocks read this read-only volume (thin_origin.rs)
//! ```
//!
//! dm-thin metadata does not store a thin device's size. mdkit records every size it is given
//! (config, `mdkit thin create`) in `<data_dir>/thin-pools.json`, next to the pools and thin
//! volumes created at run time through `mdkit thin ...` (re-opened when the service starts).
//! A thin-pool volume is not a block device itself (its device has size 0); export its thin
//! volumes.

use std::any::Any;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use mdkit_io::{
    BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, IoFuture, IoOp, ReadResult, SharedBuf, Topology,
    WriteFlags, ZeroFlags, check_io,
};
use mdkit_thin::pool::{DiscardMode, ModeCause, OpenMode, Pool, PoolMode, PoolOptions, ThinVolume};
use serde::{Deserialize, Serialize};

use super::in_use::{Role, device_uses, refuse_in_use, refuse_repeated};
use super::thin_autoextend::{Autoextend, AutoextendParams, Policy};
use super::thin_inactive::InactivePool;
use super::thin_origin::open_origin;
use super::{BoxFuture, OpenContext, Volume, VolumeKind, Volumes};
use crate::config::{Config, Size, VolumeSpec, check_queue_depth, check_sector_multiple};

/// File (in the data directory) with thin sizes and run-time pools and volumes.
pub const STATE_FILE: &str = "thin-pools.json";
/// Data block size used to format blank metadata when none is configured.
pub const DEFAULT_BLOCK_BYTES: u64 = 64 << 10;

pub struct ThinPoolKind;
pub struct ThinKind;

#[derive(Deserialize, Serialize, Default, Clone, Copy, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Direct {
    #[default]
    Auto,
    Require,
    Off,
}

/// The keys of a `thin-pool` volume (also the arguments of `thin.pool-create`).
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct PoolParams {
    pub metadata: String,
    pub data: String,
    pub metadata_size: Option<Size>,
    pub data_size: Option<Size>,
    pub block_size: Option<Size>,
    /// Config pools: format the metadata device when it is blank (a new device). Never
    /// formats a device holding anything, a pool whose superblock was lost included.
    #[serde(default)]
    pub create: bool,
    #[serde(default)]
    pub options: Vec<String>,
    pub no_space_timeout_s: Option<u64>,
    pub low_water_blocks: Option<u64>,
    pub commit_interval_ms: Option<u64>,
    pub check_on_open: Option<bool>,
    pub mapping_cache_entries: Option<usize>,
    #[serde(default)]
    pub direct: Direct,
    pub queue_depth: Option<u32>,
    /// Flush batching on the pool's own device files (default on): one `fdatasync` of the data
    /// file serves every volume flush that arrived before it started.
    pub flush_batching: Option<bool>,
    pub autoextend_threshold_percent: Option<u64>,
    pub autoextend_step: Option<String>,
    pub autoextend_max_size: Option<Size>,
}

/// dm-thin feature words accepted in `options`.
pub const FEATURES: [&str; 5] =
    ["skip_block_zeroing", "error_if_no_space", "no_discard_passdown", "ignore_discard", "read_only"];

impl PoolParams {
    pub fn pool_options(&self) -> Result<PoolOptions> {
        let mut o = PoolOptions::default();
        for f in &self.options {
            match f.as_str() {
                "skip_block_zeroing" => o.zero_new_blocks = false,
                "error_if_no_space" => o.error_if_no_space = true,
                "no_discard_passdown" => o.discard = DiscardMode::NoPassdown,
                "ignore_discard" => o.discard = DiscardMode::Ignore,
                "read_only" => o.read_only = true,
                other => bail!("unknown thin-pool option {other:?} (known: {})", FEATURES.join(", ")),
            }
        }
        if let Some(s) = self.no_space_timeout_s {
            if s == 0 || s > 86_400 {
                bail!("no_space_timeout_s {s}: must be 1..=86400 (a pool never queues writes forever)");
            }
            o.no_space_timeout = Duration::from_secs(s);
        }
        if let Some(b) = self.low_water_blocks {
            o.low_water_blocks = b;
        }
        if let Some(ms) = self.commit_interval_ms {
            if ms == 0 || ms > 3_600_000 {
                bail!("commit_interval_ms {ms}: must be 1..=3600000");
            }
            o.commit_interval = Duration::from_millis(ms);
        }
        if let Some(c) = self.check_on_open {
            o.check_on_open = c;
        }
        if let Some(n) = self.mapping_cache_entries {
            o.mapping_cache_entries = n.max(1024);
        }
        Ok(o)
    }

    fn block_bytes(&self) -> Option<u64> {
        self.block_size.map(Size::bytes)
    }

    /// Checks every key without opening anything (`serve --check-config`, `thin.pool-create`
    /// before it creates a file). Metadata and data on one device is refused where the data
    /// directory is at hand: `in_use::check_config` and [`open_pool`].
    pub fn check(&self, pool_name: &str) -> Result<()> {
        for dev in [&self.metadata, &self.data] {
            if dev.strip_prefix("volume:") == Some(pool_name) {
                bail!("{dev:?}: a thin pool cannot be stored on itself");
            }
        }
        check_sector_multiple("metadata_size", self.metadata_size)?;
        check_sector_multiple("data_size", self.data_size)?;
        check_queue_depth(self.queue_depth)?;
        if let Some(b) = self.block_bytes() {
            let sectors = u32::try_from(b / 512).unwrap_or(u32::MAX);
            if !b.is_multiple_of(512) || mdkit_thin::meta::superblock::check_data_block_size(sectors).is_err() {
                bail!("block_size = {b} bytes: must be a multiple of 64 KiB between 64 KiB and 1 GiB");
            }
        }
        self.pool_options()?;
        self.autoextend_policy()?;
        Ok(())
    }

    /// The autoextend policy, validated (`None` when not configured).
    pub fn autoextend_policy(&self) -> Result<Option<Policy>> {
        let a = AutoextendParams {
            autoextend_threshold_percent: self.autoextend_threshold_percent,
            autoextend_step: self.autoextend_step.clone(),
            autoextend_max_size: self.autoextend_max_size,
        };
        Policy::from_params(&a, !self.data.starts_with("volume:"), self.low_water_blocks)
    }
}

//------------------------------------------------------------------------------------------------
// State file

/// A pool created at run time (`mdkit thin pool-create`), opened again at start-up.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct RememberedPool {
    pub name: String,
    /// The `thin-pool` keys as given (paths made absolute by the CLI).
    pub params: serde_json::Value,
}

/// A thin volume registered at run time (`mdkit thin create` / `snapshot`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct RememberedThin {
    pub name: String,
    pub pool: String,
    pub id: u64,
    #[serde(default)]
    pub export: Option<String>,
    /// The external origin it was activated with (see `thin_origin.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_origin: Option<String>,
}

#[derive(Serialize, Deserialize, Default, Debug)]
pub struct ThinState {
    /// "POOL/ID" → virtual size in bytes.
    #[serde(default)]
    pub sizes: BTreeMap<String, u64>,
    #[serde(default)]
    pub pools: Vec<RememberedPool>,
    #[serde(default)]
    pub volumes: Vec<RememberedThin>,
}

pub fn size_key(pool: &str, id: u64) -> String {
    format!("{pool}/{id}")
}

/// Serialises read-modify-write of the state file inside this process.
static STATE_LOCK: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

pub fn load_state(data_dir: &Path) -> Result<ThinState> {
    let p = data_dir.join(STATE_FILE);
    match std::fs::read(&p) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ThinState::default()),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

/// Applies `f` to the state file atomically (temp file, fsync, rename).
pub fn update_state<R>(data_dir: &Path, f: impl FnOnce(&mut ThinState) -> R) -> Result<R> {
    let _g = STATE_LOCK.lock();
    let mut st = load_state(data_dir)?;
    let r = f(&mut st);
    std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
    let p = data_dir.join(STATE_FILE);
    let tmp = p.with_extension("json.tmp");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        file.write_all(&serde_json::to_vec_pretty(&st)?)?;
        file.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, &p).with_context(|| format!("renaming to {}", p.display()))?;
    Ok(r)
}

//------------------------------------------------------------------------------------------------
// Volumes built on volumes

/// The volume built on volume `name` (a pool or an array on `volume:NAME`, a thin volume
/// with it as external origin), described for a message; `None` when nothing is.
pub fn stacked_on(volumes: &Volumes, name: &str) -> Option<String> {
    let spec = format!("volume:{name}");
    for v in volumes.iter() {
        if let Some(u) = device_uses(v.as_ref()).into_iter().find(|u| u.source == spec) {
            return Some(format!("{} {:?} (as its {})", u.role.owner(), u.volume, u.role.word()));
        }
        let thin = v.as_any().downcast_ref::<ThinVolumeVol>();
        if thin.is_some_and(|t| t.origin_spec() == Some(spec.as_str())) {
            return Some(format!("thin volume {:?} (as its external origin)", v.name()));
        }
    }
    None
}

/// Refuses an export of a thin-pool volume: its device serves no blocks (export its thin
/// volumes). Checked by `serve --check-config` and before the service starts.
pub fn check_config_exports(config: &Config) -> Result<()> {
    for e in &config.exports {
        if config.volumes.iter().any(|v| v.name == e.volume && v.kind == "thin-pool") {
            bail!(
                "export {:?}: volume {:?} is a thin pool, which serves no blocks of its own \
                 (export one of its thin volumes)",
                e.name,
                e.volume
            );
        }
    }
    Ok(())
}

//------------------------------------------------------------------------------------------------
// Opening pools

fn open_device(
    spec: &str,
    size: Option<Size>,
    p: &PoolParams,
    data_dir: &Path,
    volumes: &Volumes,
) -> Result<(DeviceRef, String, Option<Arc<FileDevice>>)> {
    if let Some(v) = spec.strip_prefix("volume:") {
        // Not `block_device`'s "config order" hint: a remembered pool's base is remembered too.
        if let Some(f) = volumes.get_failed(v) {
            bail!("{spec:?}: volume {v:?} failed to open: {}", f.error);
        }
        if volumes.get(v).is_none() {
            bail!("{spec:?}: no volume named {v:?} is open");
        }
        return Ok((volumes.block_device(v, spec)?, spec.to_string(), None));
    }
    let path = Path::new(spec);
    let path = if path.is_absolute() { path.to_path_buf() } else { data_dir.join(path) };
    if !path.exists() {
        let Some(size) = size else {
            bail!("{} does not exist (give metadata_size / data_size to create it)", path.display());
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        FileDevice::create_sparse(&path, size.bytes())?;
        tracing::info!(path = %path.display(), size_bytes = size.bytes(), "created sparse thin-pool device file");
    }
    let direct = match p.direct {
        Direct::Auto => DirectMode::Auto,
        Direct::Require => DirectMode::Require,
        Direct::Off => DirectMode::Off,
    };
    // Exclusive: an offline tool writing the metadata under the running pool (a second
    // writer) loses commits of one or the other; it is refused while the pool is open.
    let mut opts = FileOptions {
        direct,
        flush_batching: p.flush_batching.unwrap_or(true),
        exclusive: true,
        ..FileOptions::default()
    };
    if let Some(qd) = p.queue_depth {
        opts.queue_depth = qd;
    }
    let dev = FileDevice::open(&path, opts).with_context(|| format!("opening {}", path.display()))?;
    if let Some(why) = dev.direct_fallback_reason() {
        tracing::warn!(path = %path.display(), "not using O_DIRECT: {why}");
    }
    let dev = Arc::new(dev);
    Ok((dev.clone(), path.display().to_string(), Some(dev)))
}

/// What opening a pool may do to its metadata device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolOpen {
    /// A config pool: open; format only a blank device and only with `create = true`.
    Config,
    /// A pool remembered from `thin.pool-create`: open, never format.
    Remembered,
    /// `thin.pool-create`: format a blank device; `force` formats whatever is there.
    Format { force: bool },
}

impl PoolOpen {
    /// How a pool opened this way opens again (`thin.pool-activate`): as before, except that a
    /// pool formatted by `thin.pool-create` is opened as a remembered one, never formatted again.
    fn reopen(self) -> PoolOpen {
        match self {
            PoolOpen::Format { .. } => PoolOpen::Remembered,
            other => other,
        }
    }

    fn mode(self, p: &PoolParams) -> OpenMode {
        let data_block_bytes = p.block_bytes().unwrap_or(DEFAULT_BLOCK_BYTES);
        match self {
            PoolOpen::Format { force: true } => OpenMode::Overwrite { data_block_bytes },
            PoolOpen::Format { force: false } => OpenMode::Create { data_block_bytes },
            PoolOpen::Config if p.create => OpenMode::OpenOrCreate { data_block_bytes },
            PoolOpen::Config | PoolOpen::Remembered => OpenMode::Open,
        }
    }
}

/// Opens (or, as `how` allows, formats) a pool and wraps it as a volume.
pub async fn open_pool(
    name: &str,
    p: &PoolParams,
    how: PoolOpen,
    data_dir: &Path,
    volumes: &Volumes,
) -> Result<Arc<ThinPoolVolume>> {
    p.check(name).with_context(|| format!("thin pool {name}"))?;
    let opts = p.pool_options()?;
    let autoextend = p.autoextend_policy().with_context(|| format!("thin pool {name}"))?;
    // Before a file is created or opened: one device written by two pools (or a pool and an
    // array or a file volume) loses the commits of one of them.
    let devices = [(Role::Metadata, p.metadata.as_str()), (Role::Data, p.data.as_str())];
    refuse_repeated(&devices, data_dir).with_context(|| format!("thin pool {name}"))?;
    for (role, spec) in devices {
        refuse_in_use(volumes, role, &[spec], data_dir).with_context(|| format!("thin pool {name}"))?;
    }
    let (meta, meta_src, meta_file) = open_device(&p.metadata, p.metadata_size, p, data_dir, volumes)?;
    let (data, data_src, data_file) = open_device(&p.data, p.data_size, p, data_dir, volumes)?;
    let pool = Pool::start(name, meta, data, opts, how.mode(p)).await?;
    if let Some(bs) = p.block_bytes()
        && bs != pool.data_block_bytes()
    {
        let found = pool.data_block_bytes();
        pool.close().await?;
        bail!("thin pool {name}: its data block size is {found} bytes, not the configured block_size {bs}");
    }
    if pool.mode() != PoolMode::ReadWrite {
        tracing::warn!(pool = name, "thin pool is {:?}: {}", pool.mode(), pool.mode_reason());
    }
    let autoextend = match (autoextend, &data_file) {
        (Some(_), Some(f)) if f.is_block_device() => {
            pool.close().await?;
            bail!("thin pool {name}: autoextend needs a file as data device; {data_src} is a block device");
        }
        (Some(policy), Some(f)) => match Autoextend::start(name, pool.clone(), f.clone(), policy).await {
            Ok(a) => Some(a),
            Err(e) => {
                pool.close().await?;
                return Err(e.context(format!("thin pool {name}: starting autoextend")));
            }
        },
        _ => None,
    };
    Ok(Arc::new(ThinPoolVolume {
        name: name.to_string(),
        params: p.clone(),
        reopen: how.reopen(),
        pool,
        meta_src,
        data_src,
        files: PoolFiles { meta: meta_file, data: data_file },
        autoextend,
        placeholder: NotABlockDevice::pool(name),
    }))
}

impl VolumeKind for ThinPoolKind {
    fn kind(&self) -> &'static str {
        "thin-pool"
    }

    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        spec.parse_params::<PoolParams>()?.check(&spec.name)
    }

    fn bases(&self, spec: &VolumeSpec) -> Vec<String> {
        let p = spec.parse_params::<PoolParams>();
        p.map(|p| super::volume_refs([p.metadata.as_str(), p.data.as_str()])).unwrap_or_default()
    }

    fn open<'a>(&'a self, spec: &'a VolumeSpec, ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
        Box::pin(async move {
            let p: PoolParams = spec.parse_params()?;
            let v = open_pool(&spec.name, &p, PoolOpen::Config, ctx.data_dir, ctx.volumes).await?;
            Ok(v as Arc<dyn Volume>)
        })
    }
}

/// A thin pool in the volume registry.
pub struct ThinPoolVolume {
    name: String,
    /// The keys it was opened with, and how to open it again (`thin.pool-activate`).
    params: PoolParams,
    reopen: PoolOpen,
    pool: Pool,
    meta_src: String,
    data_src: String,
    files: PoolFiles,
    autoextend: Option<Arc<Autoextend>>,
    placeholder: DeviceRef,
}

/// The pool's devices when it opened them as files (flush counters, growth).
pub struct PoolFiles {
    pub meta: Option<Arc<FileDevice>>,
    pub data: Option<Arc<FileDevice>>,
}

impl ThinPoolVolume {
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Its metadata and data devices: a file's path, or `volume:NAME`.
    pub fn sources(&self) -> [&str; 2] {
        [&self.meta_src, &self.data_src]
    }

    pub fn files(&self) -> &PoolFiles {
        &self.files
    }

    pub fn autoextend(&self) -> Option<&Arc<Autoextend>> {
        self.autoextend.as_ref()
    }

    /// The keys it was opened with and how to open it again: never formatting a device.
    pub fn reopen_with(&self) -> (&PoolParams, PoolOpen) {
        (&self.params, self.reopen)
    }
}

fn mode_state(pool: &Pool) -> String {
    state_word(pool.mode(), pool.mode_cause()).to_string()
}

/// Why a pool failed at run time (`mdkit status` prints it beside the state word); `None`
/// while it serves, read-only included.
fn failure(pool: &Pool) -> Option<String> {
    (pool.mode() == PoolMode::Failed).then(|| pool.mode_reason())
}

/// The volume state shown by `mdkit status`, from the pool's typed mode and cause.
fn state_word(mode: PoolMode, cause: ModeCause) -> &'static str {
    match (mode, cause) {
        (PoolMode::ReadWrite, _) => "active",
        (PoolMode::ReadOnly, ModeCause::NeedsCheck) => "needs-check",
        (PoolMode::ReadOnly, _) => "read-only",
        (PoolMode::Failed, _) => "failed",
    }
}

impl Volume for ThinPoolVolume {
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
        mode_state(&self.pool)
    }
    fn error(&self) -> Option<String> {
        failure(&self.pool)
    }
    fn details(&self) -> serde_json::Value {
        serde_json::json!({
            "metadata": self.meta_src,
            "data": self.data_src,
            "data_block_bytes": self.pool.data_block_bytes(),
            "mode_reason": self.pool.mode_reason(),
            "data_flush_requests": self.files.data.as_ref().and_then(|f| f.flush_stats()).map(|s| s.requests),
            "data_flush_rounds": self.files.data.as_ref().and_then(|f| f.flush_stats()).map(|s| s.rounds),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            if let Some(a) = &self.autoextend {
                a.stop();
            }
            self.pool.close().await.map_err(anyhow::Error::from)
        })
    }
}

//------------------------------------------------------------------------------------------------
// Thin volumes

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ThinParams {
    pool: String,
    id: u64,
    size: Option<Size>,
    #[serde(default)]
    create: bool,
    external_origin: Option<String>,
}

/// Finds the pool volume `name` in the registry.
pub fn find_pool(volumes: &Volumes, name: &str) -> Result<Pool> {
    if let Some(f) = volumes.get_failed(name) {
        bail!("{} {name:?} failed to open: {}", f.kind, f.error);
    }
    let v =
        volumes.get(name).ok_or_else(|| anyhow!("no thin pool named {name:?} (`mdkit status` lists the volumes)"))?;
    if let Some(i) = v.as_any().downcast_ref::<InactivePool>() {
        bail!("{}", i.refusal());
    }
    let p = v
        .as_any()
        .downcast_ref::<ThinPoolVolume>()
        .ok_or_else(|| anyhow!("volume {name:?} is a {} volume, not a thin-pool", v.kind()))?;
    Ok(p.pool.clone())
}

/// An external origin: as given (path or `volume:NAME`) and opened.
pub struct OriginArg {
    pub spec: String,
    pub dev: DeviceRef,
}

impl OriginArg {
    /// Opens `spec` (see `thin_origin.rs`); `None` stays `None`.
    pub fn open(spec: Option<&str>, data_dir: &Path, volumes: &Volumes) -> Result<Option<OriginArg>> {
        spec.map(|s| Ok(OriginArg { spec: s.to_string(), dev: open_origin(s, data_dir, volumes)? })).transpose()
    }
}

/// Opens thin device `id` of `pool` as volume `name`; the size comes from `size` or the state
/// file (and is recorded there).
pub async fn open_thin(
    name: &str,
    pool_name: &str,
    pool: &Pool,
    id: u64,
    size: Option<u64>,
    origin: Option<OriginArg>,
    data_dir: &Path,
) -> Result<Arc<ThinVolumeVol>> {
    let key = size_key(pool_name, id);
    let size = match size {
        Some(s) => s,
        None => load_state(data_dir)?.sizes.get(&key).copied().ok_or_else(|| {
            anyhow!("thin device {id} of pool {pool_name:?}: no size configured and none recorded in {STATE_FILE}")
        })?,
    };
    let mut vol = pool.thin(id, size).await?;
    let origin_spec = origin.as_ref().map(|o| o.spec.clone());
    if let Some(o) = origin {
        vol = vol.with_external_origin(o.dev)?;
    }
    update_state(data_dir, |st| {
        st.sizes.insert(key, size);
    })?;
    Ok(Arc::new(ThinVolumeVol {
        name: name.to_string(),
        pool_name: pool_name.to_string(),
        pool: pool.clone(),
        vol: Arc::new(vol),
        origin_spec,
    }))
}

impl VolumeKind for ThinKind {
    fn kind(&self) -> &'static str {
        "thin"
    }

    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        let p: ThinParams = spec.parse_params()?;
        if p.pool == spec.name {
            bail!("pool = {:?}: a thin volume cannot be its own pool", p.pool);
        }
        if p.id > mdkit_thin::meta::MAX_DEVICE_ID {
            bail!("id = {}: a thin device id has 24 bits (0..={})", p.id, mdkit_thin::meta::MAX_DEVICE_ID);
        }
        check_sector_multiple("size", p.size)
    }

    fn bases(&self, spec: &VolumeSpec) -> Vec<String> {
        let Ok(p) = spec.parse_params::<ThinParams>() else { return Vec::new() };
        let mut bases = super::volume_refs(p.external_origin.as_deref());
        bases.push(p.pool);
        bases
    }

    fn open<'a>(&'a self, spec: &'a VolumeSpec, ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
        Box::pin(async move {
            let p: ThinParams = spec.parse_params()?;
            let pool = find_pool(ctx.volumes, &p.pool)?;
            if !pool.devices().await?.contains(&p.id) {
                if !p.create {
                    bail!("thin device {} does not exist in pool {:?} (set create = true to create it)", p.id, p.pool);
                }
                pool.create_thin(p.id).await?;
                tracing::info!(pool = %p.pool, id = p.id, "created thin device");
            }
            let origin = OriginArg::open(p.external_origin.as_deref(), ctx.data_dir, ctx.volumes)?;
            let v = open_thin(&spec.name, &p.pool, &pool, p.id, p.size.map(Size::bytes), origin, ctx.data_dir).await?;
            Ok(v as Arc<dyn Volume>)
        })
    }
}

/// A thin volume in the registry.
pub struct ThinVolumeVol {
    name: String,
    pool_name: String,
    pool: Pool,
    vol: Arc<ThinVolume>,
    /// The external origin as given, if any.
    origin_spec: Option<String>,
}

impl ThinVolumeVol {
    pub fn pool_name(&self) -> &str {
        &self.pool_name
    }
    pub fn id(&self) -> u64 {
        self.vol.id()
    }
    /// The external origin as given (path or `volume:NAME`), if any.
    pub fn origin_spec(&self) -> Option<&str> {
        self.origin_spec.as_deref()
    }
    /// Samples the external origin's size again: `Some((old, new))` bytes, `None` without one.
    pub fn refresh_origin(&self) -> std::io::Result<Option<(u64, u64)>> {
        self.vol.refresh_external_origin()
    }
}

impl Volume for ThinVolumeVol {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "thin"
    }
    fn device(&self) -> DeviceRef {
        self.vol.clone()
    }
    fn state(&self) -> String {
        mode_state(&self.pool)
    }
    fn error(&self) -> Option<String> {
        failure(&self.pool).map(|why| format!("thin pool {} failed: {why}", self.pool_name))
    }
    fn details(&self) -> serde_json::Value {
        let c = self.vol.counters();
        serde_json::json!({
            "pool": self.pool_name,
            "id": self.vol.id(),
            "fast_reads": c.fast_reads,
            "fast_writes": c.fast_writes,
            "zero_reads": c.zero_reads,
            "slow_ops": c.slow_ops,
            "cell_waits": c.cell_waits,
            "cached_mappings": self.vol.cached_mappings(),
            "external_origin": self.vol.external_origin().map(|(device, size_bytes)| serde_json::json!({
                "spec": self.origin_spec, "device": device, "size_bytes": size_bytes,
            })),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { self.vol.flush().await.with_context(|| format!("flushing thin volume {}", self.name)) })
    }
}

//------------------------------------------------------------------------------------------------

/// The device of a thin-pool volume: size 0; every request fails (export the thin volumes).
pub(super) struct NotABlockDevice {
    name: String,
}

impl NotABlockDevice {
    /// The placeholder device of pool `name`.
    pub(super) fn pool(name: &str) -> DeviceRef {
        Arc::new(NotABlockDevice { name: format!("thin-pool:{name}") })
    }

    fn refuse(&self, op: IoOp) -> std::io::Error {
        let t = self.topology();
        check_io(&self.name, &t, op, 0, 512).err().unwrap_or_else(|| std::io::Error::other("unreachable"))
    }
}

impl BlockDevice for NotABlockDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn topology(&self) -> Topology {
        Topology {
            supports_discard: false,
            supports_write_zeroes: false,
            discard_granularity_bytes: 0,
            ..Topology::simple(0)
        }
    }
    fn read(&self, _offset_bytes: u64, buf: mdkit_io::IoBuf) -> IoFuture<'_, ReadResult> {
        let e = self.refuse(IoOp::Read);
        Box::pin(std::future::ready((buf, Err(e))))
    }
    fn write(&self, _offset_bytes: u64, _buf: SharedBuf, _flags: WriteFlags) -> IoFuture<'_, std::io::Result<()>> {
        Box::pin(std::future::ready(Err(self.refuse(IoOp::Write))))
    }
    fn flush(&self) -> IoFuture<'_, std::io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }
    fn discard(&self, _offset_bytes: u64, _len_bytes: u64) -> IoFuture<'_, std::io::Result<()>> {
        Box::pin(std::future::ready(Err(self.refuse(IoOp::Discard))))
    }
    fn write_zeroes(
        &self,
        _offset_bytes: u64,
        _len_bytes: u64,
        _flags: ZeroFlags,
    ) -> IoFuture<'_, std::io::Result<()>> {
        Box::pin(std::future::ready(Err(self.refuse(IoOp::WriteZeroes))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(extra: &str) -> PoolParams {
        let t: toml::Table = toml::from_str(&format!("metadata = \"m\"\ndata = \"d\"\n{extra}")).unwrap();
        toml::Value::Table(t).try_into().unwrap()
    }

    #[test]
    fn options_map_to_dm_thin_features() {
        let o = params("options = [\"skip_block_zeroing\", \"error_if_no_space\", \"no_discard_passdown\"]\nno_space_timeout_s = 5")
            .pool_options()
            .unwrap();
        assert!(!o.zero_new_blocks && o.error_if_no_space && o.discard == DiscardMode::NoPassdown);
        assert_eq!(o.no_space_timeout, Duration::from_secs(5));
        let e = params("options = [\"bogus\"]").pool_options().unwrap_err().to_string();
        assert!(e.contains("unknown thin-pool option") && e.contains("skip_block_zeroing"), "{e}");
        assert!(params("no_space_timeout_s = 0").pool_options().is_err());
        assert_eq!(params("block_size = \"128KiB\"").block_bytes(), Some(128 << 10));
    }

    #[test]
    fn state_follows_the_typed_mode_cause() {
        assert_eq!(state_word(PoolMode::ReadOnly, ModeCause::NeedsCheck), "needs-check");
        assert_eq!(state_word(PoolMode::ReadOnly, ModeCause::ReadOnlyOption), "read-only");
        assert_eq!(state_word(PoolMode::ReadOnly, ModeCause::MetadataSpaceExhausted), "read-only");
        assert_eq!(state_word(PoolMode::Failed, ModeCause::MetadataFailure), "failed");
        assert_eq!(state_word(PoolMode::ReadWrite, ModeCause::None), "active");
    }

    #[test]
    fn config_pools_format_only_with_create_and_pool_create_only_overwrites_with_force() {
        let bs = DEFAULT_BLOCK_BYTES;
        assert_eq!(PoolOpen::Config.mode(&params("")), OpenMode::Open);
        assert_eq!(PoolOpen::Config.mode(&params("create = true")), OpenMode::OpenOrCreate { data_block_bytes: bs });
        assert_eq!(PoolOpen::Remembered.mode(&params("create = true")), OpenMode::Open);
        assert_eq!(PoolOpen::Format { force: false }.mode(&params("")), OpenMode::Create { data_block_bytes: bs });
        let forced = PoolOpen::Format { force: true }.mode(&params("block_size = \"128KiB\""));
        assert_eq!(forced, OpenMode::Overwrite { data_block_bytes: 128 << 10 });
        // Opened again (thin.pool-activate), a pool-create pool is never formatted.
        assert_eq!(PoolOpen::Format { force: true }.reopen(), PoolOpen::Remembered);
        assert_eq!(PoolOpen::Config.reopen(), PoolOpen::Config);
    }

    #[test]
    fn state_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        update_state(dir.path(), |st| {
            st.sizes.insert(size_key("p", 3), 1 << 30);
            st.volumes.push(RememberedThin {
                name: "p.3".into(),
                pool: "p".into(),
                id: 3,
                export: Some("p.3".into()),
                external_origin: None,
            });
        })
        .unwrap();
        let st = load_state(dir.path()).unwrap();
        assert_eq!(st.sizes["p/3"], 1 << 30);
        assert_eq!(st.volumes[0].id, 3);
    }
}
