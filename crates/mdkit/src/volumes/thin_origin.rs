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

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use mdkit_io::{DeviceRef, FileDevice, FileOptions};

use super::Volumes;

/// Opens `spec` (a path, relative to `data_dir`, or `volume:NAME`) as an external origin:
/// files and block devices read-only.
pub fn open_origin(spec: &str, data_dir: &Path, volumes: &Volumes) -> Result<DeviceRef> {
    if let Some(v) = spec.strip_prefix("volume:") {
        let vol = volumes
            .get(v)
            .ok_or_else(|| anyhow!("external origin {spec:?}: no volume named {v:?} (volumes open in config order)"))?;
        return Ok(vol.device());
    }
    let path = Path::new(spec);
    let path = if path.is_absolute() { path.to_path_buf() } else { data_dir.join(path) };
    let dev = FileDevice::open(&path, FileOptions { read_only: true, ..FileOptions::default() })
        .with_context(|| format!("opening external origin {}", path.display()))?;
    Ok(std::sync::Arc::new(dev))
}
