//! Which devices the volumes write, and the refusal of a second writer: one device written by
//! two volumes (two arrays, a pool and an array, a file volume and either) loses the writes of
//! one of them. "The same device" is [`DeviceKey::same`].
//!
//! Checked three times, with one rule:
//! - `serve --check-config`: [`check_config`] over the config's volumes;
//! - opening a volume (config order at start, remembered ones, control commands):
//!   [`refuse_in_use`] against the open volumes, before any file is created or opened, so the
//!   second user fails and the first keeps serving;
//! - within one volume: an md member given twice, a pool with one device as metadata and data
//!   ([`refuse_repeated`]).
//!
//! Two file volumes may share a file (two views of one image, e.g. one read-only): a file
//! volume is a plain window on its file, with no metadata of its own to lose.

use std::fmt;
use std::path::Path;

use anyhow::{Result, bail};

use super::device_key::DeviceKey;
use super::file::FileVolume;
use super::md::MdVolume;
use super::thin::{PoolParams, ThinPoolVolume};
use super::thin_inactive::InactivePool;
use super::{Volume, Volumes};
use crate::config::{Config, VolumeSpec};

/// What a volume uses a device as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A member of an md array.
    Member,
    /// A thin pool's metadata device.
    Metadata,
    /// A thin pool's data device.
    Data,
    /// The file of a `file` volume.
    File,
    /// The file of a read-only `file` volume: read, never written.
    ReadOnlyFile,
    /// A thin volume's external origin given as a path: read, never written (dm-thin's rule),
    /// and wrong as soon as anything else writes it.
    Origin,
}

impl Role {
    /// The word for messages: "member", "metadata", ...
    pub fn word(self) -> &'static str {
        match self {
            Role::Member => "member",
            Role::Metadata => "metadata",
            Role::Data => "data",
            Role::File | Role::ReadOnlyFile => "file",
            Role::Origin => "external origin",
        }
    }

    /// The kind of volume that uses a device in this role, for messages.
    pub fn owner(self) -> &'static str {
        match self {
            Role::Member => "md array",
            Role::Metadata | Role::Data => "thin pool",
            Role::File | Role::ReadOnlyFile => "file volume",
            Role::Origin => "thin volume",
        }
    }

    /// Whether the volume writes the device in this role.
    fn writes(self) -> bool {
        !matches!(self, Role::ReadOnlyFile | Role::Origin)
    }

    /// Whether two volumes may use one device in these roles: two file volumes (plain windows on
    /// the file), and readers beside each other; an external origin beside nothing that writes.
    fn may_share(self, other: Role) -> bool {
        let files = |r: Role| matches!(r, Role::File | Role::ReadOnlyFile);
        (files(self) && files(other)) || (!self.writes() && !other.writes())
    }
}

/// A device an open volume uses.
#[derive(Clone, Debug)]
pub struct DeviceUse {
    pub volume: String,
    pub role: Role,
    /// The device as the volume opened it: an absolute path, `volume:NAME` or an NBD URI.
    pub source: String,
}

/// The file of an external origin spec: a path, not `volume:NAME` (an origin that is a volume
/// is that volume's business, `users_of_volume`).
fn origin_file(spec: &str) -> Option<&str> {
    (!spec.starts_with("volume:")).then_some(spec)
}

/// The devices `v` uses: a pool's metadata and data (an inactive pool's too: it comes
/// back), an array's members (not the ones assembly left out: nothing is written to them), a
/// file volume's file, a thin volume's external origin file (read only).
pub fn device_uses(v: &dyn Volume) -> Vec<DeviceUse> {
    let volume = v.name().to_string();
    let uses: Vec<(Role, String)> = if let Some(p) = v.as_any().downcast_ref::<ThinPoolVolume>() {
        let [m, d] = p.sources();
        vec![(Role::Metadata, m.to_string()), (Role::Data, d.to_string())]
    } else if let Some(md) = v.as_any().downcast_ref::<MdVolume>() {
        md.member_sources_in_use().into_iter().map(|s| (Role::Member, s)).collect()
    } else if let Some(p) = v.as_any().downcast_ref::<InactivePool>() {
        // Closed, but coming back: its devices stay reserved in this service, and so do its
        // thin volumes' origin files (they read them again on activation; named by the thin
        // volume).
        let [m, d] = p.sources();
        let origin_files = p.thins().iter().filter_map(|t| {
            let o = origin_file(t.external_origin.as_deref()?)?;
            let volume = format!("{} (pool {} inactive)", t.name, p.name());
            Some(DeviceUse { volume, role: Role::Origin, source: o.to_string() })
        });
        let pool = [(Role::Metadata, m.to_string()), (Role::Data, d.to_string())];
        let pool = pool.into_iter().map(|(role, source)| DeviceUse { volume: volume.clone(), role, source });
        return pool.chain(origin_files).collect();
    } else if let Some(f) = v.as_any().downcast_ref::<FileVolume>() {
        let role = if f.read_only() { Role::ReadOnlyFile } else { Role::File };
        vec![(role, f.path().display().to_string())]
    } else if let Some(t) = v.as_any().downcast_ref::<super::thin::ThinVolumeVol>() {
        let path = t.origin_spec().and_then(origin_file);
        path.map(|s| vec![(Role::Origin, s.to_string())]).unwrap_or_default()
    } else {
        Vec::new()
    };
    uses.into_iter().map(|(role, source)| DeviceUse { volume: volume.clone(), role, source }).collect()
}

/// The open volumes built on volume `name` (`volume:NAME` as a pool's metadata or data device,
/// an array's member, or a thin volume's external origin), for messages: "thin pool \"p\" (its
/// data device)".
pub fn users_of_volume(volumes: &Volumes, name: &str, data_dir: &Path) -> Vec<String> {
    let spec = format!("volume:{name}");
    let key = DeviceKey::new(&spec, data_dir);
    let mut users = Vec::new();
    for v in volumes.iter() {
        for u in device_uses(v.as_ref()) {
            if DeviceKey::new(&u.source, data_dir).same(&key) {
                users.push(format!("{} {:?} (its {} device)", u.role.owner(), u.volume, u.role.word()));
            }
        }
        let origin = v.as_any().downcast_ref::<super::thin::ThinVolumeVol>().and_then(|t| t.origin_spec());
        if origin == Some(spec.as_str()) {
            users.push(format!("thin volume {:?} (its external origin)", v.name()));
        }
    }
    users
}

/// A device asked for that an open volume already uses.
#[derive(Debug)]
pub struct InUse {
    pub role: Role,
    pub spec: String,
    pub user: DeviceUse,
}

impl fmt::Display for InUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let u = &self.user;
        write!(
            f,
            "{} {:?} is already used by {} {:?} (as its {} {}); one device written by two volumes loses data: \
             give another device, or stop {:?} first",
            self.role.word(),
            self.spec,
            u.role.owner(),
            u.volume,
            u.role.word(),
            u.source,
            u.volume
        )
    }
}

impl std::error::Error for InUse {}

/// Refuses `specs` (devices wanted in `role`, relative paths inside `data_dir`) when an open
/// volume uses one of them. Called before anything is created or opened.
pub fn refuse_in_use(volumes: &Volumes, role: Role, specs: &[&str], data_dir: &Path) -> Result<(), InUse> {
    let wanted: Vec<DeviceKey> = specs.iter().map(|s| DeviceKey::new(s, data_dir)).collect();
    for v in volumes.iter() {
        for user in device_uses(v.as_ref()).into_iter().filter(|u| !role.may_share(u.role)) {
            let key = DeviceKey::new(&user.source, data_dir);
            if let Some(w) = wanted.iter().find(|w| w.same(&key)) {
                return Err(InUse { role, spec: w.spec().to_string(), user });
            }
        }
    }
    Ok(())
}

/// Refuses one device given twice to one volume: `specs` are its devices with their roles, in
/// order (an array's members; a pool's metadata and data).
pub fn refuse_repeated(specs: &[(Role, &str)], data_dir: &Path) -> Result<()> {
    let keys: Vec<(Role, DeviceKey)> = specs.iter().map(|(r, s)| (*r, DeviceKey::new(s, data_dir))).collect();
    for (i, (role, key)) in keys.iter().enumerate() {
        if let Some((first_role, first)) = keys[..i].iter().find(|(_, k)| k.same(key)) {
            bail!("{}", repeated_message(*first_role, first.spec(), *role, key.spec()));
        }
    }
    Ok(())
}

/// The refusal of one device in two roles of one volume.
fn repeated_message(first_role: Role, first: &str, role: Role, spec: &str) -> String {
    match (first_role, role) {
        (Role::Member, Role::Member) => {
            format!("member {spec:?} is the same device as member {first:?}; each member must be given once")
        }
        _ => format!(
            "metadata and data are both {spec:?} (the {} {first:?} is the {} {spec:?}): a pool needs two devices",
            first_role.word(),
            role.word()
        ),
    }
}

//------------------------------------------------------------------------------------------------
// --check-config

/// `serve --check-config` across the config's volumes: no device is used twice, by two volumes
/// or twice by one (at start the second user fails to open instead, see [`refuse_in_use`]).
pub fn check_config(config: &Config) -> Result<()> {
    // (volume, role, key) of every device seen so far.
    let mut seen: Vec<(&str, Role, DeviceKey)> = Vec::new();
    for spec in &config.volumes {
        for (role, dev) in config_devices(spec, &config.data_dir) {
            let key = DeviceKey::new(&dev, &config.data_dir);
            let clash = seen.iter().find(|(_, other_role, k)| !role.may_share(*other_role) && k.same(&key));
            if let Some((other, other_role, k)) = clash {
                if *other == spec.name {
                    bail!("volume {other:?}: {}", repeated_message(*other_role, k.spec(), role, &dev));
                }
                bail!(
                    "volumes {other:?} and {:?} use one device: {:?} ({} of {other:?}) and {dev:?} ({} of {:?}); \
                     one device written by two volumes loses data",
                    spec.name,
                    k.spec(),
                    other_role.word(),
                    role.word(),
                    spec.name
                );
            }
            seen.push((&spec.name, role, key));
        }
    }
    Ok(())
}

/// The devices a volume of the config uses, from its keys (a spec whose keys do not parse
/// has none here: the kind's own check reports it).
fn config_devices(spec: &VolumeSpec, data_dir: &Path) -> Vec<(Role, String)> {
    match spec.kind.as_str() {
        "thin-pool" => match spec.parse_params::<PoolParams>() {
            Ok(p) => vec![(Role::Metadata, p.metadata), (Role::Data, p.data)],
            Err(_) => Vec::new(),
        },
        "md" => md_member_specs(spec).into_iter().map(|m| (Role::Member, m)).collect(),
        // Absolute: a file volume's path is never `volume:NAME` or a URI.
        "file" => {
            let read_only = spec.params.get("read_only").and_then(toml::Value::as_bool) == Some(true);
            let role = if read_only { Role::ReadOnlyFile } else { Role::File };
            let path = spec.params.get("path").and_then(toml::Value::as_str);
            path.map(|p| vec![(role, data_dir.join(p).display().to_string())]).unwrap_or_default()
        }
        "thin" => {
            let origin = spec.params.get("external_origin").and_then(toml::Value::as_str);
            let path = origin.and_then(origin_file);
            path.map(|p| vec![(Role::Origin, data_dir.join(p).display().to_string())]).unwrap_or_default()
        }
        _ => Vec::new(),
    }
}

/// The member specs of an `md` volume's config keys (paths, `volume:NAME`, URIs; a fault
/// injection table's `path`), without the md kind's own parsing.
fn md_member_specs(spec: &VolumeSpec) -> Vec<String> {
    let members = spec.params.get("members").and_then(toml::Value::as_array);
    let entry =
        |m: &toml::Value| m.as_str().or_else(|| m.get("path").and_then(toml::Value::as_str)).map(str::to_string);
    members.into_iter().flatten().filter_map(entry).collect()
}
