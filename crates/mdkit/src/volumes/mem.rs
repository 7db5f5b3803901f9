//! `kind = "mem"`: a sparse RAM disk (contents are lost at exit). For tests, benchmarks of the
//! protocol path, and scratch space.
//!
//! ```toml
//! [[volume]]
//! name = "ram0"
//! kind = "mem"
//! size = "1GiB"             # required
//! logical_block_bytes = 512  # 512 (default) or 4096
//! ```

use std::any::Any;
use std::sync::Arc;

use anyhow::{Result, bail};
use mdkit_io::{BlockDevice, DeviceRef, MemDevice, Topology};
use serde::Deserialize;

use super::{BoxFuture, OpenContext, Volume, VolumeKind};
use crate::config::{Size, VolumeSpec};

pub struct MemKind;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MemParams {
    size: Size,
    #[serde(default = "default_lbs")]
    logical_block_bytes: u32,
}

fn default_lbs() -> u32 {
    512
}

impl VolumeKind for MemKind {
    fn kind(&self) -> &'static str {
        "mem"
    }

    fn check(&self, spec: &VolumeSpec) -> Result<()> {
        parse(spec).map(|_| ())
    }

    fn open<'a>(&'a self, spec: &'a VolumeSpec, _ctx: &'a OpenContext<'a>) -> BoxFuture<'a, Result<Arc<dyn Volume>>> {
        Box::pin(async move {
            let p = parse(spec)?;
            let size = p.size.bytes();
            let mut topo = Topology::simple(size);
            topo.logical_block_bytes = p.logical_block_bytes;
            let dev = Arc::new(MemDevice::with_topology(format!("mem:{}", spec.name), topo));
            Ok(Arc::new(MemVolume { name: spec.name.clone(), dev }) as Arc<dyn Volume>)
        })
    }
}

/// The keys, checked: block size 512 or 4096, size a non-zero multiple of it.
fn parse(spec: &VolumeSpec) -> Result<MemParams> {
    let p: MemParams = spec.parse_params()?;
    if !matches!(p.logical_block_bytes, 512 | 4096) {
        bail!("logical_block_bytes must be 512 or 4096, not {}", p.logical_block_bytes);
    }
    let size = p.size.bytes();
    if size == 0 || !size.is_multiple_of(u64::from(p.logical_block_bytes)) {
        bail!("size {size} bytes is not a non-zero multiple of {} bytes", p.logical_block_bytes);
    }
    Ok(p)
}

struct MemVolume {
    name: String,
    dev: Arc<MemDevice>,
}

impl Volume for MemVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn kind(&self) -> &'static str {
        "mem"
    }
    fn device(&self) -> DeviceRef {
        self.dev.clone()
    }
    fn state(&self) -> String {
        "active".into()
    }
    fn details(&self) -> serde_json::Value {
        serde_json::json!({ "allocated_bytes": self.dev.allocated_bytes() })
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { Ok(self.dev.flush().await?) })
    }
}
