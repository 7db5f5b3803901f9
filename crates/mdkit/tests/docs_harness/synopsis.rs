//! Usage synopses cannot run as printed, but what they name must exist: for every `mdkit ...`
//! line (with its indented continuation lines), `mdkit <verbs> --help` must succeed and list
//! every `--flag` the line shows.

use std::process::Command;

use super::extract::{Block, strip_comment};

/// Problems of one synopsis block, each naming file:line.
pub fn check(file: &str, block: &Block) -> Vec<String> {
    entries(block)
        .into_iter()
        .filter_map(|(line, text)| check_entry(&text).err().map(|e| format!("{file}:{line}: `{text}`: {e}")))
        .collect()
}

/// `mdkit` lines with their continuation lines appended; lines naming another program are
/// left alone.
fn entries(block: &Block) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut in_mdkit = false;
    for cmd in &block.commands {
        let text = strip_comment(&cmd.key).to_string();
        if text.starts_with("mdkit ") {
            out.push((cmd.line, text));
            in_mdkit = true;
        } else if text.starts_with(['[', '-']) && in_mdkit {
            if let Some(last) = out.last_mut() {
                last.1.push(' ');
                last.1.push_str(&text);
            }
        } else {
            in_mdkit = false;
        }
    }
    out
}

fn check_entry(text: &str) -> Result<(), String> {
    let verbs: Vec<&str> = text
        .split_whitespace()
        .skip(1)
        .take_while(|w| !w.starts_with('-') && w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .collect();
    let out = Command::new(env!("CARGO_BIN_EXE_mdkit"))
        .args(&verbs)
        .arg("--help")
        .output()
        .map_err(|e| format!("running mdkit --help: {e}"))?;
    let help = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("`mdkit {} --help` failed: {}", verbs.join(" "), String::from_utf8_lossy(&out.stderr)));
    }
    let missing: Vec<&str> = flags(text).filter(|flag| !lists_flag(&help, flag)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("`mdkit {} --help` does not know {missing:?}", verbs.join(" ")))
    }
}

fn flags(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.len() > 2 && w.starts_with("--") && w.as_bytes()[2].is_ascii_alphabetic())
}

fn lists_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let next = help[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}
