//! Crash-loop breaker for the arrays restored at start-up.
//!
//! The panic guard turns a panicking assembly into a failed volume, but some failures end the
//! process outright (an allocation the allocator refuses aborts, the OOM killer, a signal).
//! Restarted by a supervisor, the service would assemble the same remembered array and die
//! again, forever. So the restore writes the name of the array it is about to assemble into
//! `<data_dir>/md-restore.json` and clears it when the assembly returned: a name still there
//! at the next start belongs to an array that killed the process, and it is moved to the
//! `crashed` list. Arrays on that list are not assembled again: they are listed as failed
//! until `mdkit stop NAME` forgets them (after which `mdkit assemble` may try again).
//!
//! Writes go through a temporary file and a rename, so a crash leaves the old or the new
//! state, never a torn one; they are not fsynced (only a process crash, not a power cut, has
//! to be survived: the page cache outlives the process).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The guard file in the data directory.
pub const GUARD_FILE: &str = "md-restore.json";

#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RestoreGuard {
    /// The array being assembled right now (left behind only by a start that died).
    #[serde(default)]
    pub assembling: Option<String>,
    /// Arrays whose assembly killed an earlier start: not assembled again.
    #[serde(default)]
    pub crashed: Vec<String>,
}

fn guard_path(data_dir: &Path) -> PathBuf {
    data_dir.join(GUARD_FILE)
}

impl RestoreGuard {
    /// Loads the guard at start-up, moving a name left in `assembling` to `crashed` (saved).
    pub fn load(data_dir: &Path) -> Result<RestoreGuard> {
        let p = guard_path(data_dir);
        let mut g: RestoreGuard = match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b).with_context(|| format!("parsing {}", p.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => RestoreGuard::default(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        if let Some(name) = g.assembling.take() {
            tracing::error!(array = %name, "the previous start died while assembling this array; not assembling it again");
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

    /// Records that `name` is being assembled (`Some`) or that the assembly returned (`None`).
    pub fn set_assembling(&mut self, data_dir: &Path, name: Option<&str>) -> Result<()> {
        self.assembling = name.map(str::to_string);
        self.save(data_dir)
    }

    /// Forgets that `name` crashed a start (`mdkit stop NAME`).
    pub fn clear_crashed(data_dir: &Path, name: &str) -> Result<()> {
        if !guard_path(data_dir).exists() {
            return Ok(());
        }
        let mut g = RestoreGuard::load(data_dir)?;
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
    fn a_name_left_assembling_is_crashed_at_the_next_load_until_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let mut g = RestoreGuard::load(dir.path()).unwrap();
        g.set_assembling(dir.path(), Some("ok")).unwrap();
        g.set_assembling(dir.path(), None).unwrap();
        g.set_assembling(dir.path(), Some("boom")).unwrap();
        // The process "dies" here; the next start loads the guard.
        let g = RestoreGuard::load(dir.path()).unwrap();
        assert!(g.crashed("boom") && !g.crashed("ok") && g.assembling.is_none());
        let again = RestoreGuard::load(dir.path()).unwrap();
        assert_eq!(again, g, "the move to crashed was saved");
        RestoreGuard::clear_crashed(dir.path(), "boom").unwrap();
        assert!(!RestoreGuard::load(dir.path()).unwrap().crashed("boom"));
    }
}
