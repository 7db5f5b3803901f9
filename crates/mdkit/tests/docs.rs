//! Docs are tests. Every command README.md, docs/*.md and crates/*/README.md print in a shell
//! block runs exactly as printed against a scratch service in a private namespace (see
//! `docs_harness::session`), or is listed with its reason in docs/commands-excepted.toml;
//! usage synopses are recognised and counted. One test per doc file, so a failure names the
//! file and the line; files added later run in `other_doc_files`.

use crate::docs_harness;

use docs_harness::listing::Listing;
use docs_harness::{LISTING, check_file, doc_files, repo_root, stale_entries};

/// The doc files with a test of their own below.
const NAMED: &[&str] = &[
    "README.md",
    "docs/ARCHITECTURE.md",
    "docs/BENCHMARKS.md",
    "docs/CONFIG.md",
    "docs/DEVELOPING.md",
    "crates/mdkit/README.md",
    "crates/mdkit-nbd/README.md",
    "crates/mdkit-parity/README.md",
];

#[test]
fn readme() {
    let cov = check_file("README.md", true);
    assert!(cov.run >= 10, "README.md: expected its usage, md and thin sessions to run, ran {}", cov.run);
}

#[test]
fn docs_architecture() {
    check_file("docs/ARCHITECTURE.md", true);
}

#[test]
fn docs_benchmarks() {
    check_file("docs/BENCHMARKS.md", true);
}

#[test]
fn docs_config() {
    check_file("docs/CONFIG.md", true);
}

#[test]
fn docs_developing() {
    check_file("docs/DEVELOPING.md", true);
}

#[test]
fn crate_mdkit_readme() {
    check_file("crates/mdkit/README.md", true);
}

#[test]
fn crate_mdkit_nbd_readme() {
    check_file("crates/mdkit-nbd/README.md", true);
}

#[test]
fn crate_mdkit_parity_readme() {
    check_file("crates/mdkit-parity/README.md", true);
}

#[test]
fn other_doc_files() {
    for file in doc_files(&repo_root()).iter().filter(|f| !NAMED.contains(&f.as_str())) {
        check_file(file, true);
    }
}

/// Prints the coverage of every doc file; every exception and expectation must still name a
/// command the docs print.
#[test]
fn coverage_and_stale_exceptions() {
    let root = repo_root();
    let listing = Listing::load(&root.join(LISTING));
    for input in &listing.input {
        println!("input prepared in every session: {} ({})", input.path, input.reason);
    }
    println!("docs coverage (run = executed by the per-file tests):");
    for file in doc_files(&root) {
        check_file(&file, false);
    }
    for named in NAMED {
        assert!(doc_files(&root).iter().any(|f| f == named), "{named} is gone: drop it from NAMED");
    }
    let stale = stale_entries(&root, &listing);
    assert!(stale.is_empty(), "{LISTING} names commands no doc prints any more:\n{}", stale.join("\n"));
}
