//! Growing a pool while it runs, and its low-water event.
//!
//! dm-thin grows a pool on resume after a table reload (thin-lifecycle.md §5): the data space
//! map to the new table length, the metadata space map to the metadata device's size. Here the
//! same happens on request, through the metadata worker, while thin volumes keep serving I/O
//! (the fast path never touches the worker; provisioning writes queue behind the resize for
//! one commit). Shrinking is refused, as the kernel refuses it. Growing the metadata of a pool
//! that went read-only for lack of metadata space returns it to read-write, as the kernel does.

use std::sync::atomic::Ordering;

use tokio::sync::watch;

use super::worker::Worker;
use super::{ModeCause, Pool, PoolError, PoolErrorKind, PoolMode};

/// Sizes before and after a resize (data blocks or metadata blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    pub old_blocks: u64,
    pub new_blocks: u64,
}

impl Pool {
    /// Data blocks the pool maps now.
    pub fn total_data_blocks(&self) -> u64 {
        self.inner.state.total_data_blocks.load(Ordering::Acquire)
    }

    /// Data blocks the data device holds at its current size.
    pub fn data_device_blocks(&self) -> u64 {
        self.inner.data.topology().size_bytes / self.inner.state.block_bytes
    }

    /// Whether the metadata can map `nr_data_blocks` data blocks (see
    /// [`crate::meta::ThinMetadata::check_data_growth`]); nothing changes. For a caller that
    /// must grow the data device first.
    pub async fn check_data_growth(&self, nr_data_blocks: u64) -> Result<(), PoolError> {
        let name = self.name().to_string();
        self.inner
            .call(move |w| w.md.read().check_data_growth(nr_data_blocks))
            .await?
            .map_err(|e| PoolError::new(&name, PoolErrorKind::InvalidArgument(e.to_string())))
    }

    /// Grows the pool to `nr_data_blocks` (at most what the data device holds now). A size
    /// equal to the current one changes nothing; a smaller one is refused.
    pub async fn resize_data_to(&self, nr_data_blocks: u64) -> Result<Resized, PoolError> {
        let _g = self.inner.admin.lock().await;
        let name = self.name().to_string();
        let old_blocks = self.total_data_blocks();
        let device_blocks = self.data_device_blocks();
        if nr_data_blocks > device_blocks {
            return Err(PoolError::new(
                &name,
                PoolErrorKind::InvalidArgument(format!(
                    "data device {} holds {device_blocks} blocks of {} bytes, fewer than the {nr_data_blocks} asked for",
                    self.inner.data.name(),
                    self.inner.state.block_bytes
                )),
            ));
        }
        if nr_data_blocks < old_blocks {
            return Err(PoolError::new(
                &name,
                PoolErrorKind::InvalidArgument(format!(
                    "the pool maps {old_blocks} data blocks; it cannot shrink to {nr_data_blocks} (dm-thin refuses it too)"
                )),
            ));
        }
        if nr_data_blocks == old_blocks {
            return Ok(Resized { old_blocks, new_blocks: old_blocks });
        }
        let r = self.admin(move |md| md.resize_data(nr_data_blocks)).await;
        self.inner.call(|w| w.refresh_space()).await?;
        self.inner.state.wake_space_waiters();
        r?;
        tracing::info!(pool = %name, from = old_blocks, to = nr_data_blocks, "data space grown");
        Ok(Resized { old_blocks, new_blocks: nr_data_blocks })
    }

    /// Grows the metadata space map to `nr_blocks` (default: the metadata device's current size,
    /// capped at the format maximum) and commits.
    pub async fn resize_metadata(&self, nr_blocks: Option<u64>) -> Result<Resized, PoolError> {
        let _g = self.inner.admin.lock().await;
        let r = self.inner.call(move |w| grow_metadata(w, nr_blocks)).await?;
        self.inner.state.wake_space_waiters();
        r
    }

    /// Changes the low-water mark (data blocks) and re-evaluates it at once.
    pub async fn set_low_water_blocks(&self, blocks: u64) -> Result<(), PoolError> {
        self.inner.state.low_water_blocks.store(blocks, Ordering::Release);
        self.inner.call(|w| w.check_low_water()).await
    }

    /// The low-water event: the value counts crossings below the mark since the pool opened
    /// (a crossing re-arms once free space is back above the mark).
    pub fn low_water_events(&self) -> watch::Receiver<u64> {
        self.inner.state.low_water_events.subscribe()
    }

    /// True while free data blocks are down to the low-water mark (free <= mark).
    pub fn low_water_reached(&self) -> bool {
        self.inner.state.low_water_reached.load(Ordering::Acquire)
    }
}

fn grow_metadata(w: &mut Worker, nr_blocks: Option<u64>) -> Result<Resized, PoolError> {
    let name = w.state.name.clone();
    let was_exhausted = match (w.state.mode(), w.state.mode_cause()) {
        (PoolMode::Failed, _) => return Err(PoolError::new(&name, PoolErrorKind::Failed(w.state.mode_reason()))),
        (PoolMode::ReadOnly, ModeCause::MetadataSpaceExhausted) => true,
        (PoolMode::ReadOnly, _) => {
            return Err(PoolError::new(&name, PoolErrorKind::ReadOnly(w.state.mode_reason())));
        }
        (PoolMode::ReadWrite, _) => false,
    };
    let (old_blocks, usable) = {
        let md = w.md.read();
        (md.status().total_metadata_blocks, md.usable_metadata_blocks())
    };
    let new_blocks = nr_blocks.unwrap_or(usable);
    if new_blocks == old_blocks {
        return Ok(Resized { old_blocks, new_blocks });
    }
    if let Err(e) = w.md.write().resize_metadata(new_blocks) {
        return Err(PoolError::new(&name, PoolErrorKind::Meta(e)));
    }
    w.state.meta_dirty.store(true, Ordering::Release);
    w.commit_round().map_err(|c| {
        PoolError::new(
            &name,
            PoolErrorKind::Io { what: "commit after growing the metadata".into(), source: c.into_io() },
        )
    })?;
    if was_exhausted {
        w.state.set_mode(PoolMode::ReadWrite, ModeCause::None, "");
        tracing::info!(pool = %name, "metadata space grown: back to read-write");
    }
    tracing::info!(pool = %name, from = old_blocks, to = new_blocks, "metadata space grown");
    Ok(Resized { old_blocks, new_blocks })
}
