//! Docs are tests: every command README.md, docs/ and the crate READMEs print runs as printed
//! (see `session`), or is listed with its reason in docs/commands-excepted.toml. Usage
//! synopses are recognised and counted (see `extract`).

pub mod extract;
pub mod listing;
pub mod session;
pub mod synopsis;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use extract::{Block, BlockKind};
use listing::Listing;
use session::Session;

pub const LISTING: &str = "docs/commands-excepted.toml";

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// README.md, every Markdown file under docs/, and crates/*/README.md, relative to the root.
pub fn doc_files(root: &Path) -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    markdown_under(root, Path::new("docs"), &mut files);
    let crates = std::fs::read_dir(root.join("crates")).expect("crates/");
    for entry in crates.flatten() {
        let readme = Path::new("crates").join(entry.file_name()).join("README.md");
        if root.join(&readme).is_file() {
            files.push(readme.display().to_string());
        }
    }
    files.sort();
    files
}

fn markdown_under(root: &Path, dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(root.join(dir)).expect("docs directory").flatten() {
        let rel = dir.join(entry.file_name());
        if entry.path().is_dir() {
            markdown_under(root, &rel, out);
        } else if rel.extension().is_some_and(|e| e == "md") {
            out.push(rel.display().to_string());
        }
    }
}

pub fn blocks_of(root: &Path, file: &str) -> Vec<Block> {
    let text = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"));
    extract::blocks(&text, root)
}

/// What one file holds and what of it ran.
#[derive(Default)]
pub struct Coverage {
    pub blocks_shell: usize,
    pub blocks_synopsis: usize,
    pub blocks_config: usize,
    pub blocks_text: usize,
    pub commands: usize,
    pub run: usize,
    pub excepted: usize,
    pub synopsis_lines: usize,
}

impl Coverage {
    pub fn line(&self, file: &str) -> String {
        format!(
            "{file:<32} blocks: {} shell, {} synopsis, {} config (served), {} text; commands: {} found, {} run, {} excepted; {} synopsis lines",
            self.blocks_shell,
            self.blocks_synopsis,
            self.blocks_config,
            self.blocks_text,
            self.commands,
            self.run,
            self.excepted,
            self.synopsis_lines
        )
    }
}

/// Counts `file`'s blocks and commands; with `execute`, runs every shell block's commands that
/// are not excepted, one namespace session per block. Panics naming file:line on a failure.
pub fn check_file(file: &str, execute: bool) -> Coverage {
    let root = repo_root();
    let listing = Listing::load(&root.join(LISTING));
    let mut cov = Coverage::default();
    let mut failures = String::new();
    let mut last_full_config: Option<String> = None;
    for block in blocks_of(&root, file) {
        match block.kind {
            BlockKind::Config => {
                cov.blocks_config += 1;
                if let Err(report) = config_block(file, &block, &listing, execute, &mut last_full_config) {
                    let _ = writeln!(failures, "{report}");
                }
            }
            BlockKind::Text => cov.blocks_text += 1,
            BlockKind::Unknown => {
                let _ = writeln!(
                    failures,
                    "{file}:{}: a code block in a language the docs harness does not know (extract.rs): neither run nor excepted",
                    block.first_line
                );
            }
            BlockKind::Synopsis => {
                cov.blocks_synopsis += 1;
                cov.synopsis_lines += block.commands.len();
                if execute {
                    synopsis::check(file, &block).iter().for_each(|p| {
                        let _ = writeln!(failures, "usage synopsis at {file}:{}: {p}", block.first_line);
                    });
                }
            }
            BlockKind::Shell => {
                cov.blocks_shell += 1;
                if let Err(report) = shell_block(file, &block, &listing, execute, &mut cov) {
                    let _ = writeln!(failures, "{report}");
                }
            }
        }
    }
    println!("{}", cov.line(file));
    assert!(failures.is_empty(), "documented commands failed:\n{failures}");
    cov
}

/// Serves a config block: a complete one (with `data_dir` or `[[export]]`) as it is, a
/// fragment appended to the complete example before it, as the text around it reads.
fn config_block(
    file: &str,
    block: &Block,
    listing: &Listing,
    execute: bool,
    last_full: &mut Option<String>,
) -> Result<(), String> {
    let complete = block.text.contains("data_dir") || block.text.contains("[[export]]");
    let config = match (complete, last_full.as_ref()) {
        (true, _) => block.text.clone(),
        (false, Some(full)) => format!("{full}\n{}", block.text),
        (false, None) => {
            return Err(format!("{file}:{}: a config fragment with no example before it", block.first_line));
        }
    };
    // Fragments extend "the example at the top" (the docs' wording): the file's first complete
    // config, not a later complete one that shows something else.
    if complete && last_full.is_none() {
        *last_full = Some(block.text.clone());
    }
    if !execute {
        return Ok(());
    }
    println!(
        "  {file}:{} serve: the config block{}",
        block.first_line,
        if complete { "" } else { " after the example" }
    );
    Session { file, block_line: block.first_line, commands: Vec::new(), config: Some(config) }.run(listing)
}

fn shell_block(file: &str, block: &Block, listing: &Listing, execute: bool, cov: &mut Coverage) -> Result<(), String> {
    let mut to_run = Vec::new();
    for cmd in &block.commands {
        cov.commands += 1;
        match listing.exception(file, &cmd.key) {
            Some(reason) => {
                cov.excepted += 1;
                println!("  {file}:{} excepted: `{}` ({reason})", cmd.line, cmd.key);
            }
            None => to_run.push(cmd),
        }
    }
    cov.run += to_run.len();
    if to_run.is_empty() || !execute {
        return Ok(());
    }
    for cmd in &to_run {
        println!("  {file}:{} run: `{}`", cmd.line, cmd.key);
    }
    Session { file, block_line: block.first_line, commands: to_run, config: None }.run(listing)
}

/// Exceptions and expectations that name no command the docs still print.
pub fn stale_entries(root: &Path, listing: &Listing) -> Vec<String> {
    let files = doc_files(root);
    let keys_of = |file: &str| -> Vec<String> {
        if !files.iter().any(|f| f == file) {
            return Vec::new();
        }
        blocks_of(root, file)
            .into_iter()
            .filter(|b| b.kind == BlockKind::Shell)
            .flat_map(|b| b.commands.into_iter().map(|c| c.key))
            .collect()
    };
    let mut stale = Vec::new();
    for e in &listing.except {
        let keys = keys_of(&e.file);
        stale.extend(e.commands.iter().filter(|c| !keys.contains(c)).map(|c| format!("except {}: `{c}`", e.file)));
    }
    for e in &listing.expect {
        if !keys_of(&e.file).contains(&e.command) {
            stale.push(format!("expect {}: `{}`", e.file, e.command));
        }
    }
    stale
}
