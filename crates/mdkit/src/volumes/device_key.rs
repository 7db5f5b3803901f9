//! One notion of "the same device" for every check that refuses one device used twice: md
//! members given twice, a member or pool device another volume writes, a file volume on a
//! pool's or an array's file, and `manage --fail PATH` finding the member it names.
//!
//! A device spec is what the config or a control command gives:
//!
//! | spec                                 | the same device as                                    |
//! |--------------------------------------|-------------------------------------------------------|
//! | `volume:NAME`                        | `volume:NAME`                                         |
//! | `nbd://HOST[:PORT]/EXPORT`,          | the same server address and export, however spelt     |
//! | `nbd+unix:///EXPORT?socket=PATH`     | (`nbd://h/x` = `nbd+tcp://H:10809/x`)                  |
//! | a path (relative to the data dir)    | the same normalised path, or, when the file exists,   |
//! |                                      | the same (device, inode): `./a`, `/data/a`, a hard or |
//! |                                      | symbolic link, `/dev/loopN` over the file             |
//!
//! Relative paths resolve against the service's data directory, never the process's current
//! directory. A path and a `volume:` or NBD spec are never the same device.

use std::path::{Path, PathBuf};

use mdkit_io::nbd_client::NbdAddress;
use mdkit_io::{NbdUri, is_nbd_uri};

use crate::config::normalize;

/// A device spec in a form two specs can be compared in ([`DeviceKey::same`]).
#[derive(Clone, Debug)]
pub struct DeviceKey {
    spec: String,
    target: Target,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Volume(String),
    Remote {
        address: NbdAddress,
        export: String,
    },
    /// An NBD URI that does not parse (refused when opened): only its own text matches it.
    BadUri(String),
    File {
        path: PathBuf,
        identity: Option<FileIdentity>,
    },
}

/// What a file or block device is, whatever path reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// The file system's device number, or [`BLOCK_DEVICE_IDENTITY`] for a block device.
    dev: u64,
    /// The inode, or the block device's device number.
    ino: u64,
}

impl DeviceKey {
    /// The key of `spec`; a relative path resolves against `data_dir`.
    pub fn new(spec: &str, data_dir: &Path) -> DeviceKey {
        let target = if let Some(name) = spec.strip_prefix("volume:") {
            Target::Volume(name.to_string())
        } else if is_nbd_uri(spec) {
            remote_target(spec)
        } else {
            let path = resolve(spec, data_dir);
            let identity = file_identity(&path);
            Target::File { path, identity }
        };
        DeviceKey { spec: spec.to_string(), target }
    }

    /// The spec as given.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// Whether both keys name one device.
    pub fn same(&self, other: &DeviceKey) -> bool {
        match (&self.target, &other.target) {
            (Target::File { path: a, identity: ia }, Target::File { path: b, identity: ib }) => {
                a == b || (ia.is_some() && ia == ib)
            }
            (a, b) => a == b,
        }
    }
}

/// The target of an NBD URI: its address (host names compare without case) and export.
fn remote_target(spec: &str) -> Target {
    match NbdUri::parse(spec) {
        Ok(uri) => {
            let address = match uri.address {
                NbdAddress::Tcp { host, port } => NbdAddress::Tcp { host: host.to_ascii_lowercase(), port },
                NbdAddress::Unix { socket } => NbdAddress::Unix { socket: normalize(&socket) },
            };
            Target::Remote { address, export: uri.export }
        }
        Err(_) => Target::BadUri(spec.to_string()),
    }
}

/// A path spec as the service opens it: absolute stays, relative goes inside `data_dir`;
/// `.` and `..` components removed.
pub fn resolve(spec: &str, data_dir: &Path) -> PathBuf {
    normalize(&data_dir.join(spec))
}

/// The identity of an existing file or block device (`None` when it does not exist). A loop
/// device stores its data in its backing file: the file and the loop device over it are one
/// device. Any other block device is known by its device number.
pub fn file_identity(path: &Path) -> Option<FileIdentity> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(path).ok()?;
    if !m.file_type().is_block_device() {
        return Some(FileIdentity { dev: m.dev(), ino: m.ino() });
    }
    match mdkit_io::loopdev::loop_backing_file(m.rdev()) {
        Some(file) => std::fs::metadata(file).ok().map(|f| FileIdentity { dev: f.dev(), ino: f.ino() }),
        None => Some(FileIdentity { dev: BLOCK_DEVICE_IDENTITY, ino: m.rdev() }),
    }
}

/// The first half of a block device's identity (no file system has this device number).
const BLOCK_DEVICE_IDENTITY: u64 = u64::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: &str, b: &str, data_dir: &Path) -> bool {
        DeviceKey::new(a, data_dir).same(&DeviceKey::new(b, data_dir))
    }

    #[test]
    fn paths_resolve_against_the_data_dir_and_links_are_their_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("m3"), b"x").unwrap();
        std::os::unix::fs::symlink("m3", d.join("sym")).unwrap();
        std::fs::hard_link(d.join("m3"), d.join("hard")).unwrap();
        let abs = d.join("m3").display().to_string();
        for other in ["./m3", abs.as_str(), "sym", "hard", "sub/../m3"] {
            assert!(same("m3", other, d), "m3 vs {other}");
        }
        // Not yet created: the normalised path alone.
        assert!(same("new", "./new", d) && !same("new", "m3", d));
        // The process's current directory plays no part.
        assert!(!same("m3", "volume:m3", d) && !same("volume:m3", "volume:m4", d));
    }

    #[test]
    fn nbd_uris_compare_by_address_and_export() {
        let d = Path::new("/nonexistent");
        assert!(same("nbd://Host/x", "nbd+tcp://host:10809/x", d));
        assert!(!same("nbd://host/x", "nbd://host/y", d) && !same("nbd://host/x", "nbd://host:10810/x", d));
        assert!(same("nbd+unix:///x?socket=/run/s", "nbd+unix:///x?socket=/run/./s", d));
        assert!(same("nbds://host/x", "nbds://host/x", d) && !same("nbds://host/x", "nbd://host/x", d));
        assert!(!same("nbd://host/x", "host/x", d));
    }
}
