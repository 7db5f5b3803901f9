//! The benchmark scripts that have a SMALL mode run here in it (seconds), so they keep
//! working between the runs that produce the numbers in docs/BENCHMARKS.md:
//! - `SMALL=1 bench/thin_delta.sh` with this build's binary: `mdkit thin delta` prints what
//!   `thin_delta` prints on the same metadata, and `nbdinfo --map` of a 16 GiB thin volume
//!   through mdkit equals the map of a sparse file with the same data through nbdkit (the
//!   script fails otherwise); both comparisons print a ratio and an A/A control.

use crate::common;

use std::path::Path;
use std::process::Command;

use common::{MDKIT, require_tool};

#[test]
fn thin_delta_bench_small_mode_runs_and_compares() {
    for (tool, pkg) in [
        ("thin_restore", "thin-provisioning-tools"),
        ("thin_delta", "thin-provisioning-tools"),
        ("nbdinfo", "libnbd-bin"),
        ("nbdkit", "nbdkit"),
        ("qemu-io", "qemu-utils"),
        ("python3", "python3"),
    ] {
        require_tool(tool, pkg);
    }
    let base = if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-bench-smoke-").tempdir_in(base).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/thin_delta.sh");
    let out = Command::new(script)
        .env("SMALL", "1")
        .env("MDKIT", MDKIT)
        .env("WORKDIR", dir.path().join("work"))
        .output()
        .expect("run bench/thin_delta.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench/thin_delta.sh SMALL=1 failed:\n{text}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("20000 mapped blocks per device, 200 different and 1 right_only runs"), "{stdout}");
    assert!(stdout.contains("64 runs of 64 KiB, 128 map rows (identical)"), "{stdout}");
    assert_eq!(stdout.matches("A/A control").count(), 2, "{stdout}");
}
