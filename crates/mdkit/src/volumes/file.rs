//! `kind = "file"`: a plain volume over one member file (or block device), through
//! `mdkit_io::FileDevice` (io_uring, O_DIRECT where the filesystem does it).
//!
//! ```toml
//! [[volume]]
//! name = "vol0"
//! kind = "file"
//! path = "vol0.img"      # relative to data_dir; a regular file or a block device
//! size = "1GiB"          # created sparse with this size if missing; checked if present
//! direct = "auto"        # auto (O_DIRECT where real, else buffered + warning) | require | off
//! queue_depth = 128      # io_uring requests in flight on the member
//! read_only = false
//! write_back = false     # true: answer plain writes once queued on the member (flush makes them durable)
//! ```

use std::any::Any;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use mdkit_io::{
    BlockDevice, DeviceRef, DirectMode, FileDevice, FileOptions, WriteBackDevice, WriteBackHandle, WriteBackOptions,
};
use serde::Deserialize;

use super::in_use::{Role, refuse_in_use};
use super::{BoxFuture, OpenContext, Volume, VolumeKind};
use crate::config::{Size, VolumeSpec, check_queue_depth, check_sector_multiple};

pub struct FileKind;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileParams {
    path: std::path::PathBuf,
    size: Option<Size>,
    #[serde(default)]
    direct: Direct,
    queue_depth: Option<u32>,
    #[serde(default)]
    read_only: bool,
    /// One `fdatasync` serves every flush that arrived before it started (default on).
    flush_batching: Option<bool>,
    /// Answer plain (non-FUA) writes once they are queued on the member (`WriteBackDevice`).
    #[serde(default)]
    write_back: bool,
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Direct {
    #[default]
    Auto,
    Require,
    Off,
}

impl VolumeKind for FileKind {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        let p: FileParams = spec.parse_params()?;
        check_sector_multiple("size", p.size)?;
        check_queue_depth(p.queue_depth)
    }

    fn open<'a>(&'a self, spec: &'a VolumeSpec, ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
        Box::pin(async move {
            let p: FileParams = spec.parse_params()?;
            let path = ctx.resolve(&p.path);
            // Before the file is created or opened: a pool's or an array's device written
            // through a plain export loses their metadata.
            let role = if p.read_only { Role::ReadOnlyFile } else { Role::File };
            refuse_in_use(ctx.volumes, role, &[&path.display().to_string()], ctx.data_dir)?;
            let want = p.size.map(Size::bytes);
            if !path.exists() {
                let Some(size) = want else {
                    bail!("{} does not exist and no `size` is configured to create it", path.display());
                };
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                }
                FileDevice::create_sparse(&path, size)?;
                tracing::info!(volume = %spec.name, path = %path.display(), size_bytes = size, "created sparse member file");
            }
            let mut opts = FileOptions {
                read_only: p.read_only,
                flush_batching: p.flush_batching.unwrap_or(true),
                // Read-write: no array, pool or offline tool of another process writes the
                // file meanwhile; another service's file volume may serve it too (a plain
                // window on the file, as two file volumes of one service may). A read-only
                // volume takes no lock.
                exclusive: true,
                shared_lock: true,
                ..FileOptions::default()
            };
            opts.direct = match p.direct {
                Direct::Auto => DirectMode::Auto,
                Direct::Require => DirectMode::Require,
                Direct::Off => DirectMode::Off,
            };
            if let Some(qd) = p.queue_depth {
                opts.queue_depth = qd;
            }
            let dev = FileDevice::open(&path, opts)?;
            let have = dev.topology().size_bytes;
            if let Some(size) = want
                && have != size
            {
                bail!(
                    "{} is {have} bytes but the config says size = {size}; fix the config or the file",
                    path.display()
                );
            }
            if let Some(why) = dev.direct_fallback_reason() {
                tracing::warn!(volume = %spec.name, path = %path.display(), "not using O_DIRECT: {why}");
            }
            let dev = Arc::new(dev);
            let (device, write_back): (DeviceRef, _) = if p.write_back && !p.read_only {
                let wb = WriteBackDevice::from_arc(dev.clone(), WriteBackOptions::default());
                let handle = wb.handle();
                (Arc::new(wb), Some(handle))
            } else {
                (dev.clone(), None)
            };
            Ok(Arc::new(FileVolume { name: spec.name.clone(), dev, device, write_back, read_only: p.read_only })
                as Arc<dyn Volume>)
        })
    }
}

pub struct FileVolume {
    name: String,
    dev: Arc<FileDevice>,
    /// What is exported: `dev`, or `dev` behind the write-back window.
    device: DeviceRef,
    write_back: Option<WriteBackHandle>,
    read_only: bool,
}

impl FileVolume {
    /// Whether the volume only reads its file (`read_only = true`).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The file (or block device) as opened.
    pub fn path(&self) -> &std::path::Path {
        self.dev.path()
    }
}

impl Volume for FileVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "file"
    }
    fn device(&self) -> DeviceRef {
        self.device.clone()
    }
    fn state(&self) -> String {
        // An acknowledged write failed on the member: flushes fail until the volume reopens.
        if self.write_back.as_ref().is_some_and(|h| h.lost_write().is_some()) {
            "lost-write".into()
        } else {
            "active".into()
        }
    }
    fn error(&self) -> Option<String> {
        let lost = self.write_back.as_ref()?.lost_write()?;
        Some(format!("an acknowledged write was lost ({lost}); flushes fail until the volume reopens"))
    }
    fn details(&self) -> serde_json::Value {
        serde_json::json!({
            "path": self.dev.path().display().to_string(),
            "direct_io": self.dev.is_direct(),
            "block_device": self.dev.is_block_device(),
            "queue_depth": self.dev.queue_depth(),
            "member_in_flight": self.dev.in_flight(),
            "flush_batching": self.dev.flush_batcher().is_some_and(|b| b.batching()),
            "flush_requests": self.dev.flush_stats().map_or(0, |s| s.requests),
            "flush_rounds": self.dev.flush_stats().map_or(0, |s| s.rounds),
            "write_back": self.write_back.as_ref().map(|h| {
                let s = h.stats();
                serde_json::json!({
                    "max_writes": h.options().max_writes,
                    "max_bytes": h.options().max_bytes,
                    "acknowledged_early": s.acknowledged_early,
                    "written_through": s.written_through,
                    "waits": s.waits,
                    "pending_writes": s.pending_writes,
                    "lost_writes": s.lost_writes,
                    "lost_write": h.lost_write(),
                })
            }),
        })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(
            async move { self.device.flush().await.with_context(|| format!("flushing {}", self.dev.path().display())) },
        )
    }
}
