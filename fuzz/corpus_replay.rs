//! Replays the committed fuzz corpus (fuzz/corpus/<target>/: seeds `seed-*` and crash
//! regressions `crash-*`, `oom-*`, `timeout-*`, `leak-*`, `slow-unit-*`) through the entry
//! function a cargo-fuzz target calls, so the normal suite keeps fixed crashes fixed without
//! cargo-fuzz. Included by the suites of mdkit-md, mdkit-thin and mdkit-nbd (`#[path]` module).

use std::path::{Path, PathBuf};

/// The committed inputs of `target` (files the fuzzer adds locally are skipped: they are not
/// in the repository).
fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let prefixes = ["seed-", "crash-", "oom-", "timeout-", "leak-", "slow-unit-"];
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a readable corpus directory").path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| prefixes.iter().any(|x| n.starts_with(x))))
        .collect();
    files.sort();
    files
}

/// Runs every committed input of `target` through `entry`; returns how many there were.
pub fn replay(target: &str, entry: fn(&[u8])) -> usize {
    let files = corpus(target);
    for f in &files {
        let data = std::fs::read(f).unwrap();
        eprintln!("{target}: {}", f.display());
        entry(&data);
    }
    files.len()
}
