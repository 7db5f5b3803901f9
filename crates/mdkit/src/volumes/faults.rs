//! **Testing only**: md members that fail on purpose.
//!
//! An md member given as `{ path = "...", faults = { ... } }` is opened as usual and wrapped in
//! mdkit-io's [`FaultyDevice`]: every read fails with `EIO` with probability
//! `read_error_ppm` / 10^6, comes back short with `short_read_ppm`, and every write, write-zeroes
//! or discard fails with `EIO` with `write_error_ppm` (flushes are never failed), drawn from a
//! PRNG seeded with `seed` so a run repeats. This exists so the soak and tests can drive md's
//! member error policy through the real service; a production config has no reason to use it,
//! and the service logs a warning for every member opened this way.
//!
//! The member's path is remembered for the life of the process, so the same file re-added at run
//! time (`manage --re-add PATH`) is wrapped again with the same injector, and `detail` /
//! `status --json` report what was injected per member (`injected_faults`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use mdkit_io::{DeviceRef, FaultHandle, FaultRule, FaultyDevice, OpMask};
use parking_lot::Mutex;
use serde::Deserialize;

/// The `faults = { ... }` table of a member.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    #[serde(default)]
    pub read_error_ppm: u32,
    #[serde(default)]
    pub short_read_ppm: u32,
    #[serde(default)]
    pub write_error_ppm: u32,
    #[serde(default)]
    pub seed: u64,
}

impl FaultSpec {
    /// Refuses rates above 10^6 per million.
    pub fn check(&self) -> anyhow::Result<()> {
        for (key, v) in [
            ("read_error_ppm", self.read_error_ppm),
            ("short_read_ppm", self.short_read_ppm),
            ("write_error_ppm", self.write_error_ppm),
        ] {
            if v > 1_000_000 {
                anyhow::bail!("faults.{key} = {v}: at most 1000000 (parts per million)");
            }
        }
        Ok(())
    }

    fn handle(&self) -> FaultHandle {
        let h = FaultHandle::seeded(self.seed);
        if self.read_error_ppm > 0 {
            h.add(FaultRule::error(OpMask::READ, None).per_million(self.read_error_ppm));
        }
        if self.short_read_ppm > 0 {
            h.add(FaultRule::short_reads(None).per_million(self.short_read_ppm));
        }
        if self.write_error_ppm > 0 {
            h.add(FaultRule::error(OpMask::MODIFY, None).per_million(self.write_error_ppm));
        }
        h
    }
}

struct Injector {
    spec: FaultSpec,
    handle: FaultHandle,
}

/// Canonical member path → its injector, for the life of the process.
static INJECTORS: LazyLock<Mutex<HashMap<PathBuf, Injector>>> = LazyLock::new(Default::default);

/// The file name inside its canonical directory (the file itself may not exist yet).
fn key(path: &Path) -> PathBuf {
    match (path.parent().and_then(|d| std::fs::canonicalize(d).ok()), path.file_name()) {
        (Some(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// Makes `path` a faulty member from now on (the injector is kept if the spec is unchanged).
pub fn register(path: &Path, spec: FaultSpec) {
    let mut g = INJECTORS.lock();
    let k = key(path);
    if g.get(&k).is_some_and(|i| i.spec == spec) {
        return;
    }
    tracing::warn!(path = %path.display(), ?spec, "TESTING ONLY: fault injection enabled on this md member");
    g.insert(k, Injector { spec, handle: spec.handle() });
}

/// `dev` opened from `path`, wrapped in its injector when `path` was registered.
pub fn wrap(path: &Path, dev: DeviceRef) -> DeviceRef {
    match INJECTORS.lock().get(&key(path)) {
        Some(i) => Arc::new(FaultyDevice::with_handle(dev, i.handle.clone())),
        None => dev,
    }
}

/// What was injected on the member opened from `path`, as JSON (None when not faulty).
pub fn stats_json(path: &Path) -> Option<serde_json::Value> {
    let g = INJECTORS.lock();
    let s = g.get(&key(path))?.handle.stats();
    Some(serde_json::json!({
        "read_errors": s.errors.read,
        "short_reads": s.short_reads,
        "write_errors": s.errors.write + s.errors.write_zeroes + s.errors.discard,
        "requests": s.requests,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_checked() {
        assert!(FaultSpec { read_error_ppm: 1_000_000, ..FaultSpec::default() }.check().is_ok());
        let e = FaultSpec { write_error_ppm: 1_000_001, ..FaultSpec::default() }.check().unwrap_err().to_string();
        assert!(e.contains("faults.write_error_ppm"), "{e}");
    }
}
