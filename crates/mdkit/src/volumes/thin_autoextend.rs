//! Autoextend of a thin pool whose data device is a file (LVM's `thin_pool_autoextend_*`):
//! when used data passes `autoextend_threshold_percent` the data file grows by
//! `autoextend_step` (bytes or a percentage of its size) up to `autoextend_max_size`, and the
//! pool takes the new blocks — while its volumes keep serving I/O.
//!
//! ```toml
//! autoextend_threshold_percent = 80   # 1..=99: grow when more than this much data is used
//! autoextend_step = "20%"             # "20%" of the current size, or a size ("1GiB")
//! autoextend_max_size = "100GiB"      # never grow the data file beyond this (default: no cap)
//! ```
//!
//! Driven by the pool's low-water event: the policy sets the pool's low-water mark to
//! `total × (100 − threshold) / 100` free blocks; each crossing below it wakes the task here,
//! which grows until free space is above the mark again (or the cap is reached). Writes that
//! found no space meanwhile queue (up to `no_space_timeout_s`) and proceed once it grew. The
//! number of extensions and the last error show in `mdkit thin status POOL --json`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use mdkit_io::FileDevice;
use mdkit_thin::pool::Pool;

use crate::config::{Size, parse_size};

/// The autoextend keys of a `thin-pool` volume (fields of `PoolParams`, which cannot flatten
/// them: serde's `flatten` does not combine with `deny_unknown_fields`).
#[derive(Clone, Debug, Default)]
pub struct AutoextendParams {
    pub autoextend_threshold_percent: Option<u64>,
    pub autoextend_step: Option<String>,
    pub autoextend_max_size: Option<Size>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Percent(u64),
    Bytes(u64),
}

/// A validated autoextend policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    threshold_percent: u64,
    step: Step,
    max_bytes: Option<u64>,
}

impl Policy {
    /// `None` when no autoextend key is set. `file_backed`: the data device is a file;
    /// `low_water_blocks`: the pool's configured mark (the threshold replaces it).
    pub fn from_params(
        p: &AutoextendParams,
        file_backed: bool,
        low_water_blocks: Option<u64>,
    ) -> Result<Option<Policy>> {
        let Some(threshold_percent) = p.autoextend_threshold_percent else {
            if p.autoextend_step.is_some() || p.autoextend_max_size.is_some() {
                bail!("autoextend_step and autoextend_max_size need autoextend_threshold_percent");
            }
            return Ok(None);
        };
        if !(1..=99).contains(&threshold_percent) {
            bail!("autoextend_threshold_percent {threshold_percent}: must be 1..=99");
        }
        if !file_backed {
            bail!(
                "autoextend needs a file as data device (a block device or volume is grown by its owner; then run `mdkit thin pool-resize`)"
            );
        }
        if low_water_blocks.is_some() {
            bail!(
                "low_water_blocks and autoextend_threshold_percent are both set: the threshold sets the low-water mark"
            );
        }
        let step = parse_step(p.autoextend_step.as_deref().unwrap_or("20%"))?;
        Ok(Some(Policy { threshold_percent, step, max_bytes: p.autoextend_max_size.map(Size::bytes) }))
    }

    /// The pool's low-water mark: it must grow when free data blocks are down to this (the
    /// pool's `free <= mark`), i.e. once threshold% of `total_blocks` is used.
    pub fn low_water_blocks(&self, total_blocks: u64) -> u64 {
        (total_blocks * (100 - self.threshold_percent) / 100).max(1)
    }

    /// The size after one step from `cur_bytes` (capped), or `None` at the cap.
    fn next_bytes(&self, cur_bytes: u64, block_bytes: u64) -> Option<u64> {
        let step = match self.step {
            Step::Percent(p) => cur_bytes * p / 100,
            Step::Bytes(b) => b,
        }
        .max(block_bytes);
        let mut next = cur_bytes.saturating_add(step);
        if let Some(max) = self.max_bytes {
            next = next.min(max);
        }
        next -= next % block_bytes;
        (next > cur_bytes).then_some(next)
    }
}

fn parse_step(s: &str) -> Result<Step> {
    if let Some(p) = s.trim().strip_suffix('%') {
        let p: u64 = p.trim().parse().with_context(|| format!("autoextend_step {s:?}: expected N% or a size"))?;
        if !(1..=1000).contains(&p) {
            bail!("autoextend_step {s:?}: the percentage must be 1..=1000");
        }
        return Ok(Step::Percent(p));
    }
    let b = parse_size(s).map_err(|e| anyhow::anyhow!("autoextend_step: {e}"))?;
    if b == 0 {
        bail!("autoextend_step {s:?}: must be more than zero");
    }
    Ok(Step::Bytes(b))
}

/// A running autoextend task and what it did.
pub struct Autoextend {
    policy: Policy,
    extensions: AtomicU64,
    last_error: parking_lot::Mutex<Option<String>>,
    task: parking_lot::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Autoextend {
    /// Sets the pool's low-water mark from the policy and starts the task.
    pub async fn start(name: &str, pool: Pool, file: Arc<FileDevice>, policy: Policy) -> Result<Arc<Autoextend>> {
        pool.set_low_water_blocks(policy.low_water_blocks(pool.total_data_blocks())).await?;
        let ae = Arc::new(Autoextend {
            policy,
            extensions: AtomicU64::new(0),
            last_error: parking_lot::Mutex::new(None),
            task: parking_lot::Mutex::new(None),
        });
        let task = tokio::spawn(run(name.to_string(), pool, file, ae.clone()));
        *ae.task.lock() = Some(task);
        Ok(ae)
    }

    /// Re-derives the low-water mark after the pool was resized by hand.
    pub async fn rearm(&self, pool: &Pool) -> Result<()> {
        pool.set_low_water_blocks(self.policy.low_water_blocks(pool.total_data_blocks())).await?;
        Ok(())
    }

    pub fn stop(&self) {
        if let Some(t) = self.task.lock().take() {
            t.abort();
        }
    }

    /// For `thin status --json`: `extensions` counts the times the data file grew.
    pub fn json(&self) -> serde_json::Value {
        let step = match self.policy.step {
            Step::Percent(p) => format!("{p}%"),
            Step::Bytes(b) => b.to_string(),
        };
        serde_json::json!({
            "threshold_percent": self.policy.threshold_percent,
            "step": step,
            "max_bytes": self.policy.max_bytes,
            "extensions": self.extensions.load(Ordering::Acquire),
            "last_error": self.last_error.lock().clone(),
        })
    }
}

async fn run(name: String, pool: Pool, file: Arc<FileDevice>, ae: Arc<Autoextend>) {
    let mut events = pool.low_water_events();
    loop {
        let _ = events.borrow_and_update();
        while pool.low_water_reached() {
            match extend_once(&pool, &file, &ae).await {
                Ok(Some(bytes)) => {
                    *ae.last_error.lock() = None;
                    tracing::info!(pool = %name, data_bytes = bytes, "autoextend: data file grown");
                }
                Ok(None) => {
                    let e = "at autoextend_max_size; grow the data file or free space".to_string();
                    tracing::warn!(pool = %name, "autoextend: {e}");
                    *ae.last_error.lock() = Some(e);
                    break;
                }
                Err(e) => {
                    tracing::error!(pool = %name, "autoextend failed: {e:#}");
                    *ae.last_error.lock() = Some(format!("{e:#}"));
                    break;
                }
            }
        }
        if events.changed().await.is_err() {
            return;
        }
    }
}

/// One step: check the metadata can map it, grow the file, move the mark, extend the pool.
/// `None` at the cap. The count goes
/// up when the file grew, before writers waiting for space are woken (they may look at it).
///
/// The mark moves to its value for the new size before the pool grows, so no one ever sees
/// the new size beside the old mark (a reader of `thin status` between the two would see the
/// pool above a mark that is about to rise, and think the growth had settled).
async fn extend_once(pool: &Pool, file: &FileDevice, ae: &Autoextend) -> Result<Option<u64>> {
    let policy = &ae.policy;
    let cur = file.refresh_size()?;
    let Some(next) = policy.next_bytes(cur, pool.data_block_bytes()) else { return Ok(None) };
    // A step the metadata cannot map is refused before the file grows (it would stay grown).
    pool.check_data_growth(next / pool.data_block_bytes()).await?;
    let now = file.grow_file(next)?;
    ae.extensions.fetch_add(1, Ordering::AcqRel);
    let new_blocks = pool.data_device_blocks();
    pool.set_low_water_blocks(policy.low_water_blocks(new_blocks)).await?;
    if let Err(e) = pool.resize_data_to(new_blocks).await {
        pool.set_low_water_blocks(policy.low_water_blocks(pool.total_data_blocks())).await?;
        return Err(e.into());
    }
    Ok(Some(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: Option<u64>, step: Option<&str>, max: Option<u64>) -> AutoextendParams {
        AutoextendParams {
            autoextend_threshold_percent: t,
            autoextend_step: step.map(str::to_string),
            autoextend_max_size: max.map(Size::Bytes),
        }
    }

    #[test]
    fn policy_validation() {
        assert_eq!(Policy::from_params(&params(None, None, None), true, None).unwrap(), None);
        let e = |p, file, lw| Policy::from_params(&p, file, lw).unwrap_err().to_string();
        assert!(e(params(None, Some("10%"), None), true, None).contains("need autoextend_threshold_percent"));
        assert!(e(params(Some(100), None, None), true, None).contains("1..=99"));
        assert!(e(params(Some(80), None, None), false, None).contains("file"));
        assert!(e(params(Some(80), None, None), true, Some(5)).contains("low_water_blocks"));
        assert!(e(params(Some(80), Some("0"), None), true, None).contains("more than zero"));
        assert!(e(params(Some(80), Some("ten%"), None), true, None).contains("N%"));
    }

    #[test]
    fn low_water_and_steps() {
        let bs = 64 << 10;
        let p = Policy::from_params(&params(Some(75), Some("50%"), Some(10 << 20)), true, None).unwrap().unwrap();
        assert_eq!(p.low_water_blocks(64), 16, "grows once 48 of 64 blocks are used");
        assert_eq!(p.low_water_blocks(1), 1);
        assert_eq!(p.next_bytes(4 << 20, bs), Some(6 << 20));
        assert_eq!(p.next_bytes(8 << 20, bs), Some(10 << 20), "capped");
        assert_eq!(p.next_bytes(10 << 20, bs), None, "at the cap");
        let p = Policy::from_params(&params(Some(50), Some("1K"), None), true, None).unwrap().unwrap();
        assert_eq!(p.next_bytes(4 << 20, bs), Some((4 << 20) + bs), "at least one block");
    }
}
