//! External origins of thin volumes (dm-thin's `thin <pool> <id> <origin>`, the golden-image
//! case): a thin volume whose unmapped blocks read from a read-only volume. The rules are
//! mdkit-thin's (`pool/origin.rs`); this file opens the origin.
//!
//! ```toml
//! [[volume]]
//! name = "vm1"
//! kind = "thin"
//! pool = "pool0"
//! id = 1
//! size = "20GiB"
//! external_origin = "/images/debian.raw"   # a file or block device (opened read-only), or
//!                                          # "volume:NAME" (a volume defined above)
//! ```
//! `mdkit thin activate POOL ID --external-origin PATH` does the same at run time (remembered).
//! dm-thin keeps nothing about the origin in the pool metadata, so every activation of the
//! device (and of its snapshots) must name the same origin, or its unmapped blocks read zeroes.
//!
//! The origin's size is sampled when the volume opens and again by `mdkit thin pool-resize`
//! (every volume of the pool) and after `mdkit grow` of an origin volume, as dm-thin samples
//! it at each resume: never behind the operator's back, since unmapped blocks past the old end
//! change from zeroes to the origin's data.

use std::path::Path;

use anyhow::{Context, Result};
use mdkit_io::{DeviceRef, FileDevice, FileOptions};

use super::in_use::{Role, refuse_in_use};
use super::thin::ThinVolumeVol;
use super::{Volume, Volumes};

/// Opens `spec` (a path, relative to `data_dir`, or `volume:NAME`) as an external origin:
/// files and block devices read-only.
pub fn open_origin(spec: &str, data_dir: &Path, volumes: &Volumes) -> Result<DeviceRef> {
    if let Some(v) = spec.strip_prefix("volume:") {
        return volumes.block_device(v, spec).context("external origin");
    }
    let path = Path::new(spec);
    let path = if path.is_absolute() { path.to_path_buf() } else { data_dir.join(path) };
    // A device another volume writes changes under the thin volume's unmapped blocks.
    refuse_in_use(volumes, Role::Origin, &[&path.display().to_string()], data_dir).context("external origin")?;
    // Locked shared: no other process's array, pool or offline tool writes it while it is read.
    let opts = FileOptions { read_only: true, exclusive: true, lock_read_only: true, ..FileOptions::default() };
    let dev = FileDevice::open(&path, opts).with_context(|| format!("opening external origin {}", path.display()))?;
    Ok(std::sync::Arc::new(dev))
}

/// Samples again the external origin of every open thin volume that `pick` selects (dm-thin
/// takes an origin's size at each resume; see above). One JSON entry per volume
/// with an origin: `{volume, old_bytes, new_bytes}`, or `{volume, error}`.
pub fn refresh_origins(vols: &Volumes, pick: impl Fn(&ThinVolumeVol) -> bool) -> Vec<serde_json::Value> {
    let thins = vols.iter().filter_map(|v| v.as_any().downcast_ref::<ThinVolumeVol>()).filter(|t| pick(t));
    thins
        .filter_map(|t| match t.refresh_origin() {
            Ok(None) => None,
            Ok(Some((old, new))) => {
                if new != old {
                    tracing::info!(
                        volume = t.name(),
                        old,
                        new,
                        "external origin grew: unmapped blocks read it up to byte {new}"
                    );
                }
                Some(serde_json::json!({ "volume": t.name(), "old_bytes": old, "new_bytes": new }))
            }
            Err(e) => Some(serde_json::json!({ "volume": t.name(), "error": e.to_string() })),
        })
        .collect()
}
