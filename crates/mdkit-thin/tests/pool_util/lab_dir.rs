//! Finding the kernel lab (`../shared/lab`, or MDKIT_LAB_DIR) for the thin lab tests. Shared by
//! mdkit-thin's suite (through `pool_util`) and mdkit's (`common::lab_dir`, by `#[path]`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The lab directory after `build.sh`, or why it cannot be used (the caller skips loudly).
pub fn lab() -> Result<PathBuf, String> {
    if std::env::var("MDKIT_SKIP_LAB").as_deref() == Ok("1") {
        return Err("MDKIT_SKIP_LAB=1".into());
    }
    let dir = match std::env::var("MDKIT_LAB_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => {
            let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            [ws.join("../shared/lab"), PathBuf::from("/work/shared/lab")]
                .into_iter()
                .find(|d| d.join("run.sh").exists())
                .ok_or("no kernel lab directory (set MDKIT_LAB_DIR)")?
        }
    };
    if Command::new("qemu-system-x86_64").arg("--version").output().is_err() {
        return Err("qemu-system-x86_64 is not installed".into());
    }
    let out = Command::new(dir.join("build.sh")).output().map_err(|e| format!("lab build.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!("lab build.sh failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(dir)
}
