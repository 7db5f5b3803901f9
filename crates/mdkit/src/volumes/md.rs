//! `kind = "md"`: an md array (raid0/1/4/5/6/10) assembled
//! from member files, block devices or other volumes — or created on them when asked and no
//! member carries a superblock yet.
//!
//! ```toml
//! [[volume]]
//! name = "md0"
//! kind = "md"
//! members = ["md0-a.img", "md0-b.img"]   # relative to data_dir; "volume:NAME" = another volume;
//!                           # "nbd://HOST[:PORT]/EXPORT", "nbd+unix:///EXPORT?socket=PATH" = remote
//!                           # TESTING ONLY: { path = "md0-b.img", faults = { read_error_ppm = 500,
//!                           #   short_read_ppm = 200, write_error_ppm = 100, seed = 1 } }
//!                           #   injects random member errors (see faults.rs)
//! write_mostly = []         # members (as in `members`) that reads avoid while another copy is in sync
//! member_size = "1GiB"      # create missing member files sparse with this size
//! create = true             # no member has a superblock yet: create the array (else assemble)
//! level = "raid1"           # create: raid0 raid1 raid4 raid5 raid6 raid10
//! raid_devices = 2          # create: default = number of members (the rest become spares)
//! chunk = "512KiB"          # create: chunk size (raid0/10), default 512 KiB
//! layout = "n2"             # create: raid0 original/alternate, raid10 nN/fN/oN, raid5/6 left-symmetric ...
//! bitmap = "internal"       # create: internal | none (default internal for redundant levels)
//! assume_clean = false      # create: skip the initial resync (default: true only when mdkit
//!                           # created every member file just now — they are all zeroes)
//! metadata = "1.2"          # create: 1.0 | 1.1 | 1.2
//! uuid = "..."              # assemble: only this array
//! force = false             # assemble: take stale members back / start dirty degraded parity
//! direct = "auto"           # member files: auto | require | off (O_DIRECT)
//! queue_depth = 128         # member files: io_uring requests in flight per member
//! remote_timeout_ms = 30000 # remote members: an unanswered request fails the member
//! remote_queue_depth = 64   # remote members: requests in flight per member (default 64,
//!                           # or write_behind when larger, up to 1024)
//! [volume.attributes]       # md attributes set after start (sync_speed_max = 100000, ...)
//! ```

use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use mdkit_io::nbd_client::NbdClientOptions;
use mdkit_io::{BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, NbdDevice, is_nbd_uri};
use mdkit_md::array::{Array, AssembleOptions, CreateOptions, MemberDev, assemble, create, read_superblock};
use mdkit_md::format::bitmap::COUNTER_MAX as WRITE_BEHIND_MAX;
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::format::parse_uuid;
use mdkit_md::format::superblock::MetadataVersion;
use mdkit_md::layout::{Level, parse_layout, parse_level};
use serde::Deserialize;
use tokio::sync::RwLock;

use super::device_claim::DeviceClaim;
use super::device_key::DeviceKey;
use super::faults::{self, FaultSpec};
use super::in_use::{Role, refuse_in_use, refuse_repeated};
use super::md_remote::{RemoteLinks, RemoteMember, spawn_watch, unreachable_reason};
use super::{BoxFuture, OpenContext, Volume, VolumeKind, Volumes};
use crate::config::{Size, VolumeSpec, check_queue_depth, check_sector_multiple};

pub struct MdKind;

#[derive(Deserialize, Default, Clone, Copy, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Direct {
    #[default]
    Auto,
    Require,
    Off,
}

/// One `members` entry: a path / `volume:NAME`, or (testing only) a table with fault injection.
#[derive(Deserialize)]
#[serde(untagged)]
enum MemberEntry {
    Spec(String),
    Faulty { path: String, faults: FaultSpec },
}

impl MemberEntry {
    fn spec(&self) -> &str {
        match self {
            MemberEntry::Spec(s) => s,
            MemberEntry::Faulty { path, .. } => path,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MdParams {
    members: Vec<MemberEntry>,
    member_size: Option<Size>,
    #[serde(default)]
    create: bool,
    level: Option<String>,
    raid_devices: Option<u32>,
    chunk: Option<Size>,
    layout: Option<String>,
    bitmap: Option<String>,
    bitmap_chunk: Option<Size>,
    assume_clean: Option<bool>,
    metadata: Option<String>,
    uuid: Option<String>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    direct: Direct,
    queue_depth: Option<u32>,
    /// Remote members: a request unanswered this long fails the member (failfast).
    remote_timeout_ms: Option<u64>,
    /// Remote members: requests on the wire at once.
    remote_queue_depth: Option<u32>,
    /// Members (as written in `members`) that reads avoid while another copy is in sync.
    #[serde(default)]
    write_mostly: Vec<String>,
    /// mdadm `--write-behind` (raid1 with a bitmap): written at create, and set (persisted)
    /// at every start when the array's value differs.
    write_behind: Option<u32>,
    #[serde(default)]
    attributes: BTreeMap<String, toml::Value>,
}

/// How member devices are opened.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemberOpen {
    pub direct: Direct,
    pub queue_depth: Option<u32>,
    /// Create missing member files sparse with this size.
    pub create_size_bytes: Option<u64>,
    /// NBD client settings of remote (URI) members.
    pub remote: NbdClientOptions,
    /// A remote member whose server cannot be reached is left out (listed in
    /// [`OpenedMembers::remote`] as missing) instead of failing the open: assembly decides
    /// whether the array can start without it.
    pub allow_unreachable: bool,
}

/// Opened members: devices with their names, where each came from, and whether mdkit created
/// every one of them just now (fresh zero files).
pub struct OpenedMembers {
    pub devs: Vec<MemberDev>,
    pub sources: Vec<String>,
    pub all_created: bool,
    /// The member files this call created (removed again by [`OpenedMembers::discard`]).
    pub created_files: Vec<PathBuf>,
    /// The remote members, opened or (with `allow_unreachable`) missing.
    pub remote: Vec<RemoteMember>,
    pub remote_options: NbdClientOptions,
    /// The members' claim against other requests (`device_claim.rs`), from
    /// [`open_members_in_service`]: the caller takes it ([`OpenedMembers::take_claim`]) and
    /// holds it until the array using the members is registered.
    claim: Option<DeviceClaim>,
}

/// Member names for messages and `dev-NAME` attributes: the file name when unique in the
/// array, else the whole path.
fn member_names(specs: &[String]) -> Vec<String> {
    let base: Vec<String> = specs
        .iter()
        .map(|s| match s.strip_prefix("volume:") {
            Some(v) => v.to_string(),
            None if is_nbd_uri(s) => s.clone(),
            None => Path::new(s).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| s.clone()),
        })
        .collect();
    base.iter()
        .zip(specs)
        .map(|(b, s)| if base.iter().filter(|x| *x == b).count() > 1 { s.clone() } else { b.clone() })
        .collect()
}

/// Opens member specs: paths (relative to `data_dir`), `volume:NAME`, or NBD URIs
/// (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`: a member on a remote server,
/// named by its URI).
pub async fn open_members(
    specs: &[String],
    data_dir: &Path,
    volumes: &Volumes,
    how: MemberOpen,
) -> Result<OpenedMembers> {
    check_member_specs(specs, data_dir, volumes)?;
    let names = member_names(specs);
    let (remote_devs, remote) = connect_remote_members(specs, &names, how).await?;
    open_with_remote(specs, names, remote_devs, remote, data_dir, volumes, how)
}

/// [`open_members`] in the running service: the volume table is read-locked to check the specs
/// and to open the local members, never while a remote member connects (up to
/// `remote_timeout_ms`): a request waiting to change the table (an install) would otherwise
/// queue behind that connect, and every status request behind it.
pub async fn open_members_in_service(
    specs: &[String],
    data_dir: &Path,
    volumes: &RwLock<Volumes>,
    how: MemberOpen,
) -> Result<OpenedMembers> {
    let claim = {
        let vols = volumes.read().await;
        check_member_specs(specs, data_dir, &vols)?;
        vols.claim_devices(specs.iter().map(|s| DeviceKey::new(s, data_dir)).collect(), "a member")?
    };
    let names = member_names(specs);
    let (remote_devs, remote) = connect_remote_members(specs, &names, how).await?;
    let vols = volumes.read().await;
    // The table may have changed while the remote members connected.
    check_member_specs(specs, data_dir, &vols)?;
    let mut opened = open_with_remote(specs, names, remote_devs, remote, data_dir, &vols, how)?;
    opened.claim = Some(claim);
    Ok(opened)
}

/// Refuses, before any member file is created or opened and any remote member connected, a
/// member given twice (however spelt: a link, a loop device over the file) or written by
/// another volume.
fn check_member_specs(specs: &[String], data_dir: &Path, volumes: &Volumes) -> Result<()> {
    if specs.is_empty() {
        bail!("no members given");
    }
    let roles: Vec<(Role, &str)> = specs.iter().map(|s| (Role::Member, s.as_str())).collect();
    refuse_repeated(&roles, data_dir)?;
    let wanted: Vec<&str> = specs.iter().map(String::as_str).collect();
    refuse_in_use(volumes, Role::Member, &wanted, data_dir)?;
    Ok(())
}

/// Connects the remote members among `specs` (`None` in their places for the others, and for
/// remote members left out as unreachable), all at once: an unresponsive server costs one
/// connect timeout, not one per member. Remote members come first so that a bad URI or an
/// unreachable server leaves no member files created behind it.
async fn connect_remote_members(
    specs: &[String],
    names: &[String],
    how: MemberOpen,
) -> Result<(Vec<Option<Arc<NbdDevice>>>, Vec<RemoteMember>)> {
    let connecting: Vec<_> = specs
        .iter()
        .map(|spec| {
            let (spec, opts) = (spec.clone(), how.remote);
            is_nbd_uri(&spec).then(|| tokio::spawn(async move { open_remote(&spec, opts).await }))
        })
        .collect();
    let mut remote_devs: Vec<Option<Arc<NbdDevice>>> = Vec::with_capacity(specs.len());
    let mut remote = Vec::new();
    for ((spec, name), connect) in specs.iter().zip(names).zip(connecting) {
        let Some(connect) = connect else {
            remote_devs.push(None);
            continue;
        };
        let connected = connect.await.map_err(|e| anyhow!("connecting to {spec}: {e}"))?;
        match connected {
            Ok(dev) => {
                remote.push(RemoteMember::connected(spec, name, dev.clone()));
                remote_devs.push(Some(dev));
            }
            Err(e) => match unreachable_reason(&e).filter(|_| how.allow_unreachable) {
                Some(why) => {
                    tracing::warn!(member = %spec, "remote member left out: {why}");
                    remote.push(RemoteMember::missing(spec, name, why));
                    remote_devs.push(None);
                }
                None => return Err(anyhow::Error::new(e).context("opening a remote member")),
            },
        }
    }
    Ok((remote_devs, remote))
}

/// Opens the local members beside the remote ones connected already; a refusal removes the
/// member files it created.
fn open_with_remote(
    specs: &[String],
    names: Vec<String>,
    remote_devs: Vec<Option<Arc<NbdDevice>>>,
    remote: Vec<RemoteMember>,
    data_dir: &Path,
    volumes: &Volumes,
    how: MemberOpen,
) -> Result<OpenedMembers> {
    let mut created_files = Vec::new();
    let r = open_local_members(specs, names, remote_devs, data_dir, volumes, how, &mut created_files);
    let (devs, sources, all_created) = match r {
        Ok(v) => v,
        Err(e) => {
            remove_files(&created_files);
            return Err(e);
        }
    };
    Ok(OpenedMembers { devs, sources, all_created, created_files, remote, remote_options: how.remote, claim: None })
}

/// The local members of [`open_members`] (files, other volumes) beside the remote ones opened
/// already; the files it creates are added to `created_files` as it goes.
fn open_local_members(
    specs: &[String],
    names: Vec<String>,
    remote_devs: Vec<Option<Arc<NbdDevice>>>,
    data_dir: &Path,
    volumes: &Volumes,
    how: MemberOpen,
    created_files: &mut Vec<PathBuf>,
) -> Result<(Vec<MemberDev>, Vec<String>, bool)> {
    let mut devs = Vec::with_capacity(specs.len());
    let mut sources = Vec::with_capacity(specs.len());
    let mut all_created = true;
    for ((spec, name), remote_dev) in specs.iter().zip(names).zip(remote_devs) {
        if is_nbd_uri(spec) {
            if let Some(dev) = remote_dev {
                devs.push(MemberDev::new(name, dev as DeviceRef));
                sources.push(spec.clone());
            }
            all_created = false;
            continue;
        }
        if let Some(v) = spec.strip_prefix("volume:") {
            let dev = volumes.block_device(v, spec).context("md member")?;
            devs.push(MemberDev::new(name, dev));
            sources.push(spec.clone());
            all_created = false;
            continue;
        }
        let p = Path::new(spec);
        let path = if p.is_absolute() { p.to_path_buf() } else { data_dir.join(p) };
        let dev = open_member_file(&path, how, &mut all_created, created_files)?;
        devs.push(MemberDev::new(name, dev));
        sources.push(path.display().to_string());
    }
    Ok((devs, sources, all_created))
}

/// Removes files a refused request created (member files, pool files).
pub(crate) fn remove_files(paths: &[PathBuf]) {
    for p in paths {
        if let Err(e) = std::fs::remove_file(p) {
            tracing::warn!(path = %p.display(), "removing a file created for a refused request: {e}");
        }
    }
}

impl OpenedMembers {
    /// The members' claim against other requests, for the caller to hold until the array is
    /// registered (`None` outside the running service).
    pub fn take_claim(&mut self) -> Option<DeviceClaim> {
        self.claim.take()
    }

    /// Undoes what opening did on a request that is refused afterwards: closes the members and
    /// removes the files created for it, so a refused create leaves the disk as it was.
    pub fn discard(self) {
        let created = self.created_files.clone();
        drop(self);
        remove_files(&created);
    }
}

async fn open_remote(uri: &str, opts: NbdClientOptions) -> Result<Arc<NbdDevice>, mdkit_io::NbdClientError> {
    let dev = NbdDevice::connect(uri, opts).await?;
    tracing::info!(member = uri, size_bytes = dev.topology().size_bytes, "remote md member connected");
    Ok(Arc::new(dev))
}

/// The most requests `remote_queue_depth` allows on the wire per remote member.
const REMOTE_QUEUE_DEPTH_MAX: u32 = 1024;

/// The NBD client settings from `remote_timeout_ms` / `remote_queue_depth` (default: the
/// client's 64, or `write_behind` when that is larger).
fn remote_options(p: &MdParams) -> Result<NbdClientOptions> {
    let mut o = NbdClientOptions::default();
    if let Some(ms) = p.remote_timeout_ms {
        if !(100..=3_600_000).contains(&ms) {
            bail!("remote_timeout_ms = {ms}: use 100..=3600000");
        }
        o.request_timeout = std::time::Duration::from_millis(ms);
        // A server that accepts but never answers the handshake counts as silent too (at
        // least 1 s for the connect and handshake, at most the client's default).
        o.connect_timeout = o.request_timeout.max(std::time::Duration::from_secs(1)).min(o.connect_timeout);
    }
    if let Some(qd) = p.remote_queue_depth {
        if !(1..=REMOTE_QUEUE_DEPTH_MAX).contains(&qd) {
            bail!("remote_queue_depth = {qd}: use 1..={REMOTE_QUEUE_DEPTH_MAX}");
        }
        o.max_in_flight = qd;
    } else if let Some(n) = p.write_behind {
        // Behind writes are already held in memory up to this limit, and a long link carries
        // the local write rate only with about IOPS x RTT requests on the wire (bench/remote.sh
        // at 5 ms: write-behind 0.76x the local array at 64, 1.13x at 256).
        o.max_in_flight = o.max_in_flight.max(n.min(REMOTE_QUEUE_DEPTH_MAX));
    }
    Ok(o)
}

/// The member names of the `write_mostly` entries, each of which must be one of `members`.
/// A remote member left out as unreachable is skipped (its superblock keeps its flag; `devs`
/// holds only the opened members, so indexes into it skip the missing ones).
fn write_mostly_names(members: &[String], write_mostly: &[String], opened: &OpenedMembers) -> Result<Vec<String>> {
    let missing = |spec: &str| opened.remote.iter().any(|r| r.uri == spec && r.missing_reason().is_some());
    let mut names = Vec::new();
    for w in write_mostly {
        let i = members
            .iter()
            .position(|m| m == w)
            .ok_or_else(|| anyhow!("write_mostly {w:?} is not one of the members {members:?}"))?;
        if missing(w) {
            continue;
        }
        let skipped = members[..i].iter().filter(|m| missing(m)).count();
        let dev = opened.devs.get(i - skipped).ok_or_else(|| anyhow!("write_mostly {w:?}: member not opened"))?;
        names.push(dev.name.clone());
    }
    Ok(names)
}

/// Opens member file `path`, creating it (sparse, `O_EXCL`) when missing and a size is given;
/// a file it created is added to `created_files` (removed again if the request is refused),
/// never one that appeared meanwhile.
fn open_member_file(
    path: &Path,
    how: MemberOpen,
    all_created: &mut bool,
    created_files: &mut Vec<PathBuf>,
) -> Result<DeviceRef> {
    if !path.exists() {
        let Some(size) = how.create_size_bytes else {
            bail!("member {} does not exist (give a member size to create it)", path.display());
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        FileDevice::create_sparse(path, size)?;
        created_files.push(path.to_path_buf());
        tracing::info!(path = %path.display(), size_bytes = size, "created sparse md member file");
    } else {
        *all_created = false;
    }
    let direct = match how.direct {
        Direct::Auto => DirectMode::Auto,
        Direct::Require => DirectMode::Require,
        Direct::Off => DirectMode::Off,
    };
    // Exclusive: another process (a second service, an offline create) writing a member
    // loses the array's writes or its superblocks.
    let mut opts = FileOptions { direct, exclusive: true, ..FileOptions::default() };
    if let Some(qd) = how.queue_depth {
        opts.queue_depth = qd;
    }
    let dev = FileDevice::open(path, opts).with_context(|| format!("opening member {}", path.display()))?;
    if let Some(why) = dev.direct_fallback_reason() {
        tracing::warn!(path = %path.display(), "member not using O_DIRECT: {why}");
    }
    Ok(faults::wrap(path, Arc::new(dev)))
}

/// What `create` needs besides the members; parsed from config keys or CLI/control arguments.
#[derive(Clone, Debug, Default, Deserialize, serde::Serialize)]
pub struct CreateParams {
    pub level: String,
    pub raid_devices: Option<u32>,
    /// Chunk in KiB.
    pub chunk_kib: Option<u32>,
    pub layout: Option<String>,
    /// "internal" or "none"; default internal for raid1/10.
    pub bitmap: Option<String>,
    /// Write-intent bitmap chunk in bytes (mdadm --bitmap-chunk); default mdadm's choice.
    #[serde(default)]
    pub bitmap_chunk_bytes: Option<u32>,
    pub assume_clean: Option<bool>,
    pub metadata: Option<String>,
    /// mdadm `--write-behind` (raid1 with a bitmap): behind writes outstanding at most.
    #[serde(default)]
    pub write_behind: Option<u32>,
}

impl CreateParams {
    /// The runtime's create options for `members` members.
    pub fn to_options(&self, name: &str, members: usize, default_assume_clean: bool) -> Result<CreateOptions> {
        let level = parse_level(&self.level).map_err(|e| anyhow!("level {:?}: {e}", self.level))?;
        let mut o = CreateOptions::new(name, level, self.raid_devices.unwrap_or(members as u32));
        o.chunk_kib = self.chunk_kib;
        if let Some(l) = &self.layout {
            o.layout = Some(parse_layout(level, l).map_err(|e| anyhow!("layout {l:?}: {e}"))?);
        }
        let redundant = matches!(level, Level::Raid1 | Level::Raid10 | Level::Raid4 | Level::Raid5 | Level::Raid6);
        let chunk_bytes = self.bitmap_chunk_bytes;
        o.bitmap = match self.bitmap.as_deref() {
            None if redundant => BitmapRequest::Internal { chunk_bytes },
            None | Some("none") => BitmapRequest::None,
            Some("internal") => BitmapRequest::Internal { chunk_bytes },
            Some(other) => bail!("bitmap {other:?}: use internal or none"),
        };
        if let (Some(c), BitmapRequest::None) = (chunk_bytes, &o.bitmap) {
            bail!("bitmap chunk {c} bytes: the {} array gets no write-intent bitmap", level.name());
        }
        o.write_behind = self.write_behind.unwrap_or(0);
        if o.write_behind > 0 {
            if level != Level::Raid1 {
                bail!("write-behind is valid for raid1 only, not {}", level.name());
            }
            if o.bitmap == BitmapRequest::None {
                bail!("write-behind needs a write-intent bitmap");
            }
            if o.write_behind > WRITE_BEHIND_MAX {
                bail!("write-behind {}: must be between 0 and {WRITE_BEHIND_MAX}", o.write_behind);
            }
        }
        o.assume_clean = self.assume_clean.unwrap_or(default_assume_clean);
        if let Some(m) = &self.metadata {
            o.metadata = MetadataVersion::parse(m).ok_or_else(|| anyhow!("metadata {m:?}: use 1.0, 1.1 or 1.2"))?;
        }
        o.homehost = hostname();
        Ok(o)
    }
}

/// The host name mdadm would use as the home host.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Creates or assembles an array and returns it as a volume. `create`: create when no member
/// carries a superblock; otherwise always assemble.
pub async fn start_array(
    name: &str,
    opened: OpenedMembers,
    create_params: Option<&CreateParams>,
    uuid: Option<[u8; 16]>,
    force: bool,
) -> Result<Arc<MdVolume>> {
    let missing: Vec<String> = opened.remote.iter().filter_map(|m| m.missing_reason().map(str::to_string)).collect();
    let mut any_sb = false;
    for m in &opened.devs {
        if read_superblock(&m.dev).await.is_ok() {
            any_sb = true;
        }
    }
    let assembled = match create_params {
        Some(_) if !any_sb && !missing.is_empty() => {
            bail!("cannot create the array without every member: {}", missing.join("; "))
        }
        Some(p) if !any_sb => {
            for m in &opened.devs {
                if let Some(what) = super::signatures::probe(&*m.dev).await {
                    bail!(
                        "member {} holds {what}, not an md superblock: the array is not created over it \
                         (wipe it, or create the array with `mdkit create --force`)",
                        m.name
                    );
                }
            }
            let o = p.to_options(name, opened.devs.len(), opened.all_created)?;
            tracing::info!(
                array = name,
                level = o.level.name(),
                members = opened.devs.len(),
                assume_clean = o.assume_clean,
                "creating md array"
            );
            create(opened.devs.clone(), o).await?
        }
        _ => {
            let opts = AssembleOptions { name: name.to_string(), force, uuid, start_frozen: false };
            assemble(opened.devs.clone(), opts).await.map_err(|e| with_missing(e.into(), &missing))?
        }
    };
    for r in &assembled.refused {
        tracing::warn!(array = name, "member left out: {r}");
    }
    for n in &assembled.notes {
        tracing::info!(array = name, "{n}");
    }
    Ok(MdVolume::new(name, assembled.array, opened))
}

/// An assembly error, naming the remote members that could not be reached.
pub fn with_missing(e: anyhow::Error, missing: &[String]) -> anyhow::Error {
    if missing.is_empty() { e } else { e.context(format!("unreachable remote members: {}", missing.join("; "))) }
}

/// Applies `[volume.attributes]`-style settings.
pub fn apply_attributes(array: &Array, attrs: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in attrs {
        array.set_attribute(k, v).with_context(|| format!("attribute {k} = {v:?}"))?;
    }
    Ok(())
}

impl VolumeKind for MdKind {
    fn kind(&self) -> &'static str {
        "md"
    }

    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        let parsed = parse(spec)?;
        let p = &parsed.params;
        let members: Vec<&str> = p.members.iter().map(MemberEntry::spec).collect();
        if members.is_empty() {
            bail!("members = []: an array needs at least one member");
        }
        // A member given twice is refused with the data directory at hand: by
        // `in_use::check_config` (--check-config) and when the array opens.
        for m in &members {
            if m.strip_prefix("volume:") == Some(spec.name.as_str()) {
                bail!("member {m:?}: an array cannot be a member of itself");
            }
        }
        if let Some(w) = p.write_mostly.iter().find(|w| !members.contains(&w.as_str())) {
            bail!("write_mostly {w:?} is not one of the members {members:?}");
        }
        check_sector_multiple("member_size", p.member_size)?;
        check_queue_depth(p.queue_depth)?;
        if let Some(c) = &parsed.create {
            check_create_geometry(c, members.len())?;
            dry_run(&spec.name, c, members.len(), p.member_size.map(Size::bytes), &attributes(p))?;
        }
        remote_options(&parsed.params)?;
        for uri in parsed.params.members.iter().map(|m| m.spec()).filter(|m| is_nbd_uri(m)) {
            mdkit_io::NbdUri::parse(uri)?;
        }
        Ok(())
    }

    fn bases(&self, spec: &VolumeSpec) -> Vec<String> {
        parse(spec).map(|p| super::volume_refs(p.params.members.iter().map(MemberEntry::spec))).unwrap_or_default()
    }

    fn open<'a>(&'a self, spec: &'a VolumeSpec, ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
        Box::pin(async move {
            let Parsed { params: p, uuid, create } = parse(spec)?;
            let how = MemberOpen {
                direct: p.direct,
                queue_depth: p.queue_depth,
                create_size_bytes: p.member_size.map(Size::bytes),
                remote: remote_options(&p)?,
                allow_unreachable: true,
            };
            let specs: Vec<String> = p.members.iter().map(|m| m.spec().to_string()).collect();
            for m in &p.members {
                if let MemberEntry::Faulty { path, faults: f } = m {
                    let p = Path::new(path);
                    faults::register(&if p.is_absolute() { p.to_path_buf() } else { ctx.data_dir.join(p) }, *f);
                }
            }
            let opened = open_members(&specs, ctx.data_dir, ctx.volumes, how).await?;
            let write_mostly = write_mostly_names(&specs, &p.write_mostly, &opened)?;
            let vol = start_array(&spec.name, opened, create.as_ref(), uuid, p.force).await?;
            for name in write_mostly {
                vol.array.set_write_mostly(&name, true).await.with_context(|| format!("write_mostly {name}"))?;
            }
            if let Some(n) = p.write_behind
                && vol.array.core().bitmap.as_ref().map(|b| b.write_behind()) != Some(n)
            {
                vol.array.set_write_behind(n).await.with_context(|| format!("write_behind {n}"))?;
            }
            // A setting refused here (a tuning value) leaves the array serving, as a udev rule
            // that fails to write a sysfs attribute leaves a kernel array running.
            if let Err(e) = apply_attributes(&vol.array, &attributes(&p)) {
                tracing::error!(array = %spec.name, "[volume.attributes] not applied: {e:#}");
            }
            Ok(vol as Arc<dyn Volume>)
        })
    }
}

/// `[volume.attributes]` as the strings `set_attribute` takes.
fn attributes(p: &MdParams) -> BTreeMap<String, String> {
    p.attributes
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())))
        .collect()
}

/// The size of each in-memory member of [`dry_run`] when the config gives none (sparse).
const DRY_RUN_MEMBER_BYTES: u64 = 1 << 30;

/// `--check-config` for an array the config creates: the array is created with the same
/// options on sparse in-memory members and `[volume.attributes]` are set on it, so a level,
/// bitmap or attribute the real start would refuse is refused here, before any file is
/// touched. Member-specific attributes (`dev-*`) and `sync_action` are left to the start.
fn dry_run(
    name: &str,
    c: &CreateParams,
    members: usize,
    member_bytes: Option<u64>,
    attrs: &BTreeMap<String, String>,
) -> Result<()> {
    let mut opts = c.to_options(name, members, true)?;
    opts.assume_clean = true;
    let member_bytes = member_bytes.unwrap_or(DRY_RUN_MEMBER_BYTES);
    let attrs: BTreeMap<String, String> = attrs
        .iter()
        .filter(|(k, _)| !k.starts_with("dev-") && *k != "sync_action")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let run = async move {
        let devs: Vec<MemberDev> = (0..members)
            .map(|i| {
                let n = format!("dry{i}");
                MemberDev::new(n.clone(), Arc::new(mdkit_io::MemDevice::new(n, member_bytes)) as DeviceRef)
            })
            .collect();
        let created = create(devs, opts).await.map_err(|e| anyhow!("{e}"))?;
        let applied = apply_attributes(&created.array, &attrs);
        let _ = created.array.stop().await;
        applied
    };
    // Its own thread and runtime: this runs from synchronous config checks, inside or outside
    // a runtime.
    std::thread::scope(|s| {
        s.spawn(|| {
            // Quiet: the scratch array's start and stop are not the real array's.
            let _quiet = tracing::subscriber::set_default(tracing::subscriber::NoSubscriber::default());
            tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run)
        })
        .join()
        .unwrap_or_else(|_| Err(anyhow!("the check of the create keys panicked")))
    })
}

/// The create keys that do not depend on the members' sizes, checked before any member file
/// is created (`create` itself checks them again against the real members).
fn check_create_geometry(c: &CreateParams, members: usize) -> Result<()> {
    if let Some(n) = c.raid_devices
        && (n == 0 || n as usize > members)
    {
        bail!("raid_devices = {n}: use 1..={members} (the number of members)");
    }
    if let Some(kib) = c.chunk_kib
        && (kib < 4 || !kib.is_power_of_two())
    {
        bail!("chunk = {kib} KiB: must be a power of two of at least 4 KiB");
    }
    if let Some(b) = c.bitmap_chunk_bytes
        && (b < 512 || !b.is_power_of_two())
    {
        bail!("bitmap_chunk = {b} bytes: must be a power of two from 512 bytes to 2 GiB");
    }
    Ok(())
}

/// An md volume's keys, with the uuid and the create parameters parsed.
struct Parsed {
    params: MdParams,
    uuid: Option<[u8; 16]>,
    create: Option<CreateParams>,
}

fn parse(spec: &VolumeSpec) -> Result<Parsed> {
    let p: MdParams = spec.parse_params()?;
    for m in &p.members {
        if let MemberEntry::Faulty { path, faults: f } = m {
            if path.starts_with("volume:") {
                bail!("member {path:?}: fault injection applies to member files and block devices, not volumes");
            }
            f.check().with_context(|| format!("member {path:?}"))?;
        }
    }
    let uuid = match &p.uuid {
        Some(u) => Some(parse_uuid(u).ok_or_else(|| anyhow!("uuid {u:?} is not 32 hex digits"))?),
        None => None,
    };
    let create = if p.create {
        let level = p.level.clone().ok_or_else(|| anyhow!("create = true needs `level`"))?;
        let chunk_kib = match p.chunk {
            Some(c) if c.bytes() % 1024 != 0 || c.bytes() == 0 => {
                bail!("chunk {} bytes is not a whole number of KiB", c.bytes())
            }
            Some(c) => Some(u32::try_from(c.bytes() / 1024).map_err(|_| anyhow!("chunk too large"))?),
            None => None,
        };
        let bitmap_chunk_bytes = p
            .bitmap_chunk
            .map(|c| u32::try_from(c.bytes()).map_err(|_| anyhow!("bitmap_chunk {} bytes is above 2 GiB", c.bytes())))
            .transpose()?;
        Some(CreateParams {
            level,
            raid_devices: p.raid_devices,
            chunk_kib,
            layout: p.layout.clone(),
            bitmap: p.bitmap.clone(),
            bitmap_chunk_bytes,
            assume_clean: p.assume_clean,
            metadata: p.metadata.clone(),
            write_behind: p.write_behind,
        })
    } else {
        None
    };
    Ok(Parsed { params: p, uuid, create })
}

/// What runs once a reshape finished (see [`MdVolume::on_reshape_done`]).
pub type ReshapeDone = Box<dyn FnOnce() + Send>;

/// A running md array as a volume.
pub struct MdVolume {
    pub name: String,
    pub array: Arc<Array>,
    /// Member name → where it came from (path or `volume:NAME`).
    pub sources: parking_lot::Mutex<Vec<(String, String)>>,
    /// Its remote members (link state, automatic re-add).
    pub remote: RemoteLinks,
    /// Run once a reshape and what follows it (`Array::wait_reshape`) finished.
    reshape_done: Arc<parking_lot::Mutex<Option<ReshapeDone>>>,
}

impl MdVolume {
    /// The volume of a started array on `opened` members; remote members unreachable at the
    /// start stay listed as sources (and missing), and the link watch starts.
    pub fn new(name: &str, array: Array, opened: OpenedMembers) -> Arc<MdVolume> {
        let mut sources: Vec<(String, String)> =
            opened.devs.iter().zip(&opened.sources).map(|(d, s)| (d.name.clone(), s.clone())).collect();
        for m in opened.remote.iter().filter(|m| m.missing_reason().is_some()) {
            sources.push((m.name.clone(), m.uri.clone()));
        }
        let vol = Arc::new(MdVolume {
            name: name.to_string(),
            array: Arc::new(array),
            sources: parking_lot::Mutex::new(sources),
            remote: RemoteLinks::new(opened.remote_options, opened.remote),
            reshape_done: Arc::new(parking_lot::Mutex::new(None)),
        });
        spawn_watch(&vol);
        vol.finish_reshape_in_background();
        vol
    }

    /// A reshape in progress: once it is done the array is assembled again at its new size
    /// (new NBD connections see it).
    pub fn finish_reshape_in_background(&self) {
        if self.array.core().personality().reshape().is_none() {
            return;
        }
        let array = self.array.clone();
        let done = self.reshape_done.clone();
        tokio::spawn(async move {
            match array.wait_reshape().await {
                Err(e) if array.is_stopped() => {
                    tracing::info!(
                        array = array.name(),
                        "stopped while finishing the reshape (the next start goes on): {e}"
                    )
                }
                Err(e) => tracing::error!(array = array.name(), "finishing the reshape: {e}"),
                Ok(()) => {
                    if let Some(done) = done.lock().take() {
                        done();
                    }
                }
            }
        });
    }

    /// `done` runs once the reshape (and the level change after it) finished.
    pub fn on_reshape_done(&self, done: ReshapeDone) {
        *self.reshape_done.lock() = Some(done);
    }

    /// A member re-added by the link watch is listed among the sources again.
    pub fn note_member_source(&self, name: &str) {
        let mut src = self.sources.lock();
        if !src.iter().any(|(n, _)| n == name)
            && let Some(uri) = self.remote.uri_of(name)
        {
            src.push((name.to_string(), uri));
        }
    }

    /// The member sources in array order (for the state file).
    pub fn member_sources(&self) -> Vec<String> {
        self.sources.lock().iter().map(|(_, s)| s.clone()).collect()
    }

    /// The members assembly left out: not part of the array, nothing is written to them.
    pub fn left_out_names(&self) -> Vec<String> {
        let core = self.array.core();
        let in_array: Vec<String> = core.slots().all_members().iter().map(|m| m.name().to_string()).collect();
        self.array.left_out().into_iter().map(|r| r.member).filter(|n| !in_array.contains(n)).collect()
    }

    /// The sources of the members the array writes (not the ones it left out).
    pub fn member_sources_in_use(&self) -> Vec<String> {
        let left_out = self.left_out_names();
        self.sources.lock().iter().filter(|(n, _)| !left_out.contains(n)).map(|(_, s)| s.clone()).collect()
    }
}

/// One word for `mdkit status`.
pub fn state_word(array: &Array) -> String {
    let core = array.core();
    if core.needs_check().is_some() {
        return "needs-check".into();
    }
    if core.is_broken() {
        return "broken".into();
    }
    let st = array.sync_status();
    if let Some(m) = st.running {
        return match m.as_str() {
            "resync" => "resyncing",
            "recover" => "recovering",
            "check" => "checking",
            _ => "repairing",
        }
        .into();
    }
    if st.action == "reshape" {
        return "reshaping".into();
    }
    if core.degraded() > 0 {
        return "degraded".into();
    }
    array.get_attribute("array_state").unwrap_or_else(|_| "active".into())
}

impl Volume for MdVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "md"
    }
    fn device(&self) -> DeviceRef {
        self.array.clone()
    }
    fn state(&self) -> String {
        state_word(&self.array)
    }
    fn error(&self) -> Option<String> {
        let core = self.array.core();
        if let Some(why) = core.needs_check() {
            return Some(why);
        }
        core.is_broken().then(|| {
            let why = core.broken_reason().unwrap_or_else(|| "a member the array cannot run without failed".into());
            format!("array broken, writes fail: {why}")
        })
    }
    fn details(&self) -> serde_json::Value {
        let mut d = self.array.detail();
        let (links, missing) = self.remote.json(&self.array);
        d["remote_members"] = links;
        d["missing"] = missing;
        let sources = self.sources.lock();
        d["member_sources"] = serde_json::json!(
            sources.iter().map(|(n, s)| serde_json::json!({"name": n, "source": s})).collect::<Vec<_>>()
        );
        let injected: serde_json::Map<String, serde_json::Value> =
            sources.iter().filter_map(|(n, s)| Some((n.clone(), faults::stats_json(Path::new(s))?))).collect();
        if !injected.is_empty() {
            // Testing only (faults.rs): what the fault-injecting members made up so far.
            d["injected_faults"] = serde_json::Value::Object(injected);
        }
        d
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.remote.stop();
            self.array.stop().await.with_context(|| format!("stopping md array {}", self.name))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_queue_depth_defaults_to_the_write_behind_limit_when_larger() {
        let depth = |extra: &str| {
            let p: MdParams = toml::from_str(&format!("members = [\"a.img\"]\n{extra}")).unwrap();
            remote_options(&p).map(|o| o.max_in_flight)
        };
        assert_eq!(depth("").unwrap(), 64);
        assert_eq!(depth("write_behind = 16").unwrap(), 64);
        assert_eq!(depth("write_behind = 256").unwrap(), 256);
        assert_eq!(depth("write_behind = 16383").unwrap(), 1024);
        assert_eq!(depth("write_behind = 256\nremote_queue_depth = 32").unwrap(), 32, "the key wins");
        assert!(depth("remote_queue_depth = 1025").is_err());
    }

    #[test]
    fn member_names_are_file_names_unless_ambiguous() {
        let specs = vec!["a/x.img".to_string(), "b/x.img".to_string(), "c/y.img".to_string(), "volume:v0".to_string()];
        assert_eq!(member_names(&specs), vec!["a/x.img", "b/x.img", "y.img", "v0"]);
    }

    #[test]
    fn create_params_parse_md_spellings() {
        let p = CreateParams { level: "mirror".into(), ..Default::default() };
        let o = p.to_options("md0", 2, true).unwrap();
        assert_eq!(o.level, Level::Raid1);
        assert!(o.assume_clean);
        assert!(matches!(o.bitmap, BitmapRequest::Internal { .. }));
        let p = CreateParams {
            level: "10".into(),
            layout: Some("f2".into()),
            bitmap: Some("none".into()),
            ..Default::default()
        };
        let o = p.to_options("md0", 4, false).unwrap();
        assert_eq!((o.layout, o.bitmap), (Some(0x201), BitmapRequest::None));
        assert!(CreateParams { level: "raid7".into(), ..Default::default() }.to_options("x", 2, false).is_err());
        let p = CreateParams { level: "raid5".into(), bitmap_chunk_bytes: Some(1 << 20), ..Default::default() };
        let o = p.to_options("md0", 3, false).unwrap();
        assert_eq!(o.bitmap, BitmapRequest::Internal { chunk_bytes: Some(1 << 20) });
        for (level, bitmap) in [("raid0", None), ("raid1", Some("none"))] {
            let p = CreateParams {
                level: level.into(),
                bitmap: bitmap.map(str::to_string),
                bitmap_chunk_bytes: Some(1 << 20),
                ..Default::default()
            };
            let e = p.to_options("md0", 2, false).unwrap_err().to_string();
            assert!(e.contains("no write-intent bitmap"), "{level}: {e}");
        }
        assert!(
            CreateParams { level: "raid1".into(), bitmap: Some("x".into()), ..Default::default() }
                .to_options("x", 2, false)
                .is_err()
        );
    }
}
