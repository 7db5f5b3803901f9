//! Crash-loop breaker for the volumes opened at start-up (config volumes, remembered arrays).
//!
//! The panic guard turns a panicking open into a failed volume, but some failures end the
//! process outright (an allocation the allocator refuses aborts, the OOM killer, a signal).
//! Restarted by a supervisor, the service would open the same volume and die again, forever.
//! So the start writes the name of the volume it is about to open into
//! `<data_dir>/open-guard.json` and clears it when the open returned: a name still there at the
//! next start belongs to a volume that killed the process, and it is moved to the `crashed`
//! list. Volumes on that list are not opened again: they are listed as failed until
//! `mdkit stop NAME` forgets them (a config volume is then tried again at the next start, a
//! remembered array is forgotten and may be assembled by hand).
//!
//! The guard is best effort: when the file cannot be written (read-only data directory) the
//! volume is opened anyway, with a warning.
//!
//! Writes go through a temporary file and a rename, so a crash leaves the old or the new
//! state, never a torn one; they are not fsynced (only a process crash, not a power cut, has
//! to be survived: the page cache outlives the process).

use std::future::Future;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The guard file in the data directory.
pub const GUARD_FILE: &str = "open-guard.json";

#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OpenGuard {
    /// The volume being opened right now (left behind only by a start that died).
    #[serde(default)]
    pub opening: Option<String>,
    /// Volumes whose open killed an earlier start: not opened again.
    #[serde(default)]
    pub crashed: Vec<String>,
}

fn guard_path(data_dir: &Path) -> PathBuf {
    data_dir.join(GUARD_FILE)
}

impl OpenGuard {
    /// Loads the guard at start-up, moving a name left in `opening` to `crashed` (saved). An
    /// unreadable guard is logged and treated as empty.
    pub fn load_or_empty(data_dir: &Path) -> OpenGuard {
        OpenGuard::load(data_dir).unwrap_or_else(|e| {
            tracing::warn!("crash-loop guard unusable, opening every volume: {e:#}");
            OpenGuard::default()
        })
    }

    /// Like [`OpenGuard::load_or_empty`], with the error.
    pub fn load(data_dir: &Path) -> Result<OpenGuard> {
        let p = guard_path(data_dir);
        let mut g: OpenGuard = match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => OpenGuard::default(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        if let Some(name) = g.opening.take() {
            tracing::error!(volume = %name, "the previous start died while opening this volume; not opening it again");
            if !g.crashed.contains(&name) {
                g.crashed.push(name);
            }
            g.save(data_dir)?;
        }
        Ok(g)
    }

    pub fn crashed(&self, name: &str) -> bool {
        self.crashed.iter().any(|c| c == name)
    }

    /// Records that `name` is being opened (`Some`) or that the open returned (`None`); a
    /// failed write is logged (best effort).
    pub fn set_opening(&mut self, data_dir: &Path, name: Option<&str>) {
        self.opening = name.map(str::to_string);
        if let Err(e) = self.save(data_dir) {
            tracing::warn!("crash-loop guard not updated: {e:#}");
        }
    }

    /// Runs `open` for the volume `name` with the guard noting it.
    pub async fn guarded<T>(&mut self, data_dir: &Path, name: &str, open: impl Future<Output = T>) -> T {
        self.set_opening(data_dir, Some(name));
        let r = open.await;
        self.set_opening(data_dir, None);
        r
    }

    /// The error of a volume not opened because it crashed an earlier start.
    pub fn crashed_error() -> anyhow::Error {
        anyhow::anyhow!("an earlier start of mdkit died while opening it ({GUARD_FILE}); not opened again")
    }

    /// Forgets that `name` crashed a start (`mdkit stop NAME`).
    pub fn clear_crashed(data_dir: &Path, name: &str) -> Result<()> {
        if !guard_path(data_dir).exists() {
            return Ok(());
        }
        let mut g = OpenGuard::load(data_dir)?;
        let before = g.crashed.len();
        g.crashed.retain(|c| c != name);
        if g.crashed.len() != before { g.save(data_dir) } else { Ok(()) }
    }

    fn save(&self, data_dir: &Path) -> Result<()> {
        let p = guard_path(data_dir);
        let tmp = p.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("renaming to {}", p.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_left_opening_is_crashed_at_the_next_load_until_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let mut g = OpenGuard::load(dir.path()).unwrap();
        g.set_opening(dir.path(), Some("ok"));
        g.set_opening(dir.path(), None);
        g.set_opening(dir.path(), Some("boom"));
        // The process "dies" here; the next start loads the guard.
        let g = OpenGuard::load(dir.path()).unwrap();
        assert!(g.crashed("boom") && !g.crashed("ok") && g.opening.is_none());
        let again = OpenGuard::load(dir.path()).unwrap();
        assert_eq!(again, g, "the move to crashed was saved");
        OpenGuard::clear_crashed(dir.path(), "boom").unwrap();
        assert!(!OpenGuard::load(dir.path()).unwrap().crashed("boom"));
    }
}
