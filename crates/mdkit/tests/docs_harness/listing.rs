//! `docs/commands-excepted.toml`: the commands the suite does not run as printed (with the
//! reason), the inputs the docs assume and the harness prepares, and the outputs it checks.

use std::path::Path;

use serde::Deserialize;

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct Listing {
    #[serde(default)]
    pub except: Vec<Exception>,
    #[serde(default)]
    pub input: Vec<Input>,
    #[serde(default)]
    pub expect: Vec<Expectation>,
}

/// Commands of `file` (exact text, without a trailing comment) that are not run, and why.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Exception {
    pub file: String,
    pub commands: Vec<String>,
    pub reason: String,
}

/// A file (or, with `dir = true`, a directory) that every doc session finds in place.
/// Relative paths are in the session's working directory; absolute ones under the scratch
/// directories that stand in for /var/lib/mdkit and /mnt.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Input {
    pub path: String,
    #[serde(default)]
    pub size_bytes: u64,
    #[serde(default)]
    pub dir: bool,
    pub reason: String,
}

/// Text that a command's standard output must contain; for a command the docs start in the
/// background, a path that must appear (e.g. a FUSE file) before the next command runs.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    pub file: String,
    pub command: String,
    #[serde(default)]
    pub stdout_contains: Vec<String>,
    pub ready_path: Option<String>,
}

impl Listing {
    pub fn load(path: &Path) -> Listing {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The reason `command` of `file` is excepted, if it is.
    pub fn exception(&self, file: &str, command: &str) -> Option<&str> {
        self.except
            .iter()
            .find(|e| e.file == file && e.commands.iter().any(|c| c == command))
            .map(|e| e.reason.as_str())
    }

    pub fn ready_path(&self, file: &str, command: &str) -> Option<&str> {
        self.expect.iter().find(|e| e.file == file && e.command == command).and_then(|e| e.ready_path.as_deref())
    }

    pub fn expectations<'a>(&'a self, file: &'a str, command: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.expect
            .iter()
            .filter(move |e| e.file == file && e.command == command)
            .flat_map(|e| e.stdout_contains.iter().map(String::as_str))
    }
}
