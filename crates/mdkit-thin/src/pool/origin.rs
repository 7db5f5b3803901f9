//! External origins (dm-thin's `thin <pool> <id> <origin>`): a read-only volume under a thin
//! device, the golden-image case. Nothing about it is stored in the pool metadata; whoever opens
//! the thin device names the origin (every time, as dm-thin's table line does).
//!
//! Rules (kernel `dm-thin.c`: `process_cell`, `provision_block`, `schedule_external_copy`):
//! * an unmapped virtual block reads from the origin at the same offset, as far as the origin
//!   reaches; past its end it reads zeroes;
//! * a write to an unmapped block provisions it; a partial write first copies the origin's part
//!   of the block into the new data block (the rest of the block is zeroed; dm-thin leaves it
//!   stale when zeroing is off); a whole-block write copies nothing;
//! * a discard unmaps, so the block reads the origin again; write-zeroes over origin-backed
//!   blocks writes zeroes (provisioning) instead of unmapping;
//! * the origin is never written: the service opens it read-only, and this module only reads it.
//!
//! Its size is taken when the volume is opened and again on [`Origin::refresh`] (dm-thin
//! samples it at every resume; the service refreshes on `pool-resize` and after the origin
//! volume grew), never per request: a block's contents change only when asked.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

use mdkit_io::{DeviceRef, IoBuf, ReadResult};

/// A read-only volume whose contents show through a thin device's unmapped blocks.
pub(crate) struct Origin {
    pub dev: DeviceRef,
    /// The origin's size as last sampled (at open, then by [`Origin::refresh`]).
    size_bytes: AtomicU64,
}

impl Origin {
    pub fn new(dev: DeviceRef) -> Origin {
        let size_bytes = AtomicU64::new(dev.topology().size_bytes);
        Origin { dev, size_bytes }
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Samples the origin's size again (a file grown with truncate, an md array that grew) and
    /// returns (old, new) in bytes. Unmapped blocks between the two ends then read the origin
    /// instead of zeroes, as dm-thin's do after a resume. The size only grows here: a device
    /// that reports less keeps its sampled size (mapped data never moves under it).
    pub fn refresh(&self) -> io::Result<(u64, u64)> {
        let now = self.dev.refresh_size()?;
        let old = self.size_bytes.fetch_max(now, Ordering::AcqRel);
        Ok((old, old.max(now)))
    }

    /// Whether any byte of virtual block `vblock` (of `block_bytes`) lies on the origin.
    pub fn covers(&self, vblock: u64, block_bytes: u64) -> bool {
        vblock.saturating_mul(block_bytes) < self.size_bytes()
    }

    /// Reads `buf.len()` bytes at `pos` (the thin device's offset): the origin's bytes as far as
    /// it reaches, zeroes beyond.
    pub async fn read(&self, pos: u64, mut buf: IoBuf) -> ReadResult {
        let len = buf.len() as u64;
        let avail = self.size_bytes().saturating_sub(pos).min(len);
        if avail == len {
            return self.dev.read(pos, buf).await;
        }
        buf.as_mut_slice().fill(0);
        if avail == 0 {
            return (buf, Ok(()));
        }
        let (part, r) = self.dev.read(pos, IoBuf::uninit_contents(avail as usize)).await;
        if let Err(e) = r {
            return (buf, Err(e));
        }
        buf.as_mut_slice()[..avail as usize].copy_from_slice(part.as_slice());
        (buf, Ok(()))
    }

    /// The error of a failed origin read, naming the thin device, block and origin.
    pub fn error(&self, e: io::Error, thin: &str, op: &str, vblock: u64) -> io::Error {
        io::Error::new(
            e.kind(),
            format!("{thin}: {op} of virtual block {vblock} from external origin {}: {e}", self.dev.name()),
        )
    }
}
