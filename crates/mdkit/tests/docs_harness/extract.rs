//! Finds the fenced code blocks of a Markdown file and the commands in them.
//!
//! A block is a *shell* block when its language is `sh`, `bash` or `shell`: every
//! command in it runs (or is excepted). A block without a language is looked at line by line:
//! when every line starts with a command (`mdkit`, a tool on PATH, an executable under the
//! repository) or continues one, it is a shell block too, unless it shows grammar (`[--opt]`,
//! `A|B`, `...`, `NAME` placeholders), which makes it a usage *synopsis*: recognised, counted,
//! not run here (`synopsis` checks its verbs and flags against `--help`). A `toml` block is a
//! *config*: the service is started on it. `rust`, `json`, `text`, `diff` blocks and plain
//! blocks of anything else (layout trees, benchmark tables) are *text*; a language the harness
//! does not know fails the file.

use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Shell,
    Synopsis,
    Config,
    Text,
    /// A language the harness does not know (`console`, `zsh`, ...): it might hold commands,
    /// so it fails the file until the harness learns it.
    Unknown,
}

/// One fenced block; `first_line` is the 1-based line of its opening fence.
#[derive(Debug)]
pub struct Block {
    pub first_line: usize,
    pub kind: BlockKind,
    pub commands: Vec<DocCommand>,
    /// The block's text, for config blocks.
    pub text: String,
}

/// One command as printed: its lines joined by newlines (continuations kept), the 1-based
/// line it starts on, and its text without a trailing comment (what the exception list names).
#[derive(Debug, Clone)]
pub struct DocCommand {
    pub line: usize,
    pub printed: String,
    pub key: String,
}

impl DocCommand {
    /// The command ends with `&`: the docs start it in the background.
    pub fn is_background(&self) -> bool {
        self.key.ends_with('&') && !self.key.ends_with("&&")
    }
}

struct RawBlock {
    first_line: usize,
    lang: String,
    lines: Vec<(usize, String)>,
}

/// Every fenced block of `markdown`, classified, with its commands.
pub fn blocks(markdown: &str, repo_root: &Path) -> Vec<Block> {
    raw_blocks(markdown)
        .into_iter()
        .map(|raw| {
            let kind = classify(&raw, repo_root);
            let commands = match kind {
                BlockKind::Shell | BlockKind::Synopsis => commands(&raw.lines),
                BlockKind::Config | BlockKind::Text | BlockKind::Unknown => Vec::new(),
            };
            let text = if kind == BlockKind::Config { raw_text(&raw.lines) } else { String::new() };
            Block { first_line: raw.first_line, kind, commands, text }
        })
        .collect()
}

fn raw_blocks(markdown: &str) -> Vec<RawBlock> {
    let mut out = Vec::new();
    let mut open: Option<RawBlock> = None;
    for (idx, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(lang)) => {
                open = Some(RawBlock { first_line: idx + 1, lang: lang.trim().to_string(), lines: Vec::new() })
            }
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some(b), None) => b.lines.push((idx + 1, line.to_string())),
            (None, None) => {}
        }
    }
    out
}

fn classify(raw: &RawBlock, repo_root: &Path) -> BlockKind {
    match raw.lang.as_str() {
        "sh" | "bash" | "shell" => return BlockKind::Shell,
        "toml" => return BlockKind::Config,
        "" => {}
        "rust" | "json" | "text" | "diff" => return BlockKind::Text,
        _ => return BlockKind::Unknown,
    }
    let lines: Vec<&str> = raw.lines.iter().map(|(_, l)| l.as_str()).filter(|l| !l.trim().is_empty()).collect();
    let all_commands =
        !lines.is_empty() && lines.iter().all(|l| is_continuation(l) || starts_with_command(l, repo_root));
    if !all_commands {
        BlockKind::Text
    } else if lines.iter().any(|l| shows_grammar(strip_comment(l))) {
        BlockKind::Synopsis
    } else {
        BlockKind::Shell
    }
}

fn raw_text(lines: &[(usize, String)]) -> String {
    lines.iter().map(|(_, l)| format!("{l}\n")).collect()
}

fn is_continuation(line: &str) -> bool {
    line.starts_with(char::is_whitespace) && line.trim_start().starts_with(['[', '-'])
}

fn starts_with_command(line: &str, repo_root: &Path) -> bool {
    let mut words = line.split_whitespace().skip_while(|w| is_assignment(w));
    let Some(word) = words.next() else { return false };
    if word == "mdkit" {
        return true;
    }
    if word.contains('/') {
        return word.contains('*') || is_executable(&repo_root.join(word));
    }
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| is_executable(&d.join(word))))
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn shows_grammar(text: &str) -> bool {
    let placeholder = text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| {
        w.len() >= 2
            && w.chars().all(|c| c.is_ascii_uppercase() || c == '_')
            && w.chars().any(|c| c.is_ascii_uppercase())
    });
    text.contains("[-") || text.contains("...") || text.contains('|') || placeholder
}

/// The text before an unquoted ` #` (a shell comment), trimmed.
pub fn strip_comment(line: &str) -> &str {
    let (mut single, mut double, mut prev_space) = (false, false, true);
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev_space => return line[..i].trim(),
            _ => {}
        }
        prev_space = c.is_whitespace();
    }
    line.trim()
}

fn commands(lines: &[(usize, String)]) -> Vec<DocCommand> {
    let mut out = Vec::new();
    let mut current: Option<(usize, Vec<&str>)> = None;
    for (number, line) in lines {
        let text = line.as_str();
        if current.is_none() && (text.trim().is_empty() || text.trim_start().starts_with('#')) {
            continue;
        }
        let entry = current.get_or_insert((*number, Vec::new()));
        entry.1.push(text);
        if !strip_comment(text).ends_with('\\') {
            out.extend(current.take().map(|(n, ls)| command(n, &ls)));
        }
    }
    out.extend(current.take().map(|(n, ls)| command(n, &ls)));
    out
}

fn command(line: usize, lines: &[&str]) -> DocCommand {
    let printed = lines.join("\n");
    let key = lines.iter().map(|l| strip_comment(l)).collect::<Vec<_>>().join("\n");
    DocCommand { line, printed, key }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(md: &str) -> Vec<BlockKind> {
        blocks(md, Path::new("/nonexistent")).iter().map(|b| b.kind).collect()
    }

    #[test]
    fn plain_blocks_are_commands_synopses_or_text() {
        let md = "```\nmdkit status --json\nmdkit detail md0\n```\n\
                  ```\nmdkit stop NAME\nmdkit attr NAME [KEY[=VALUE]]\n    [--json]\n```\n\
                  ```\nworkload   raw   mdkit\nrandread 4k 1000 900\n```\n\
                  ```toml\ndata_dir = \"x\"\n```\n```rust\nfn main() {}\n```\n";
        assert_eq!(
            kinds(md),
            [BlockKind::Shell, BlockKind::Synopsis, BlockKind::Text, BlockKind::Config, BlockKind::Text]
        );
    }

    #[test]
    fn continuations_join_and_comments_are_not_part_of_the_key() {
        let md = "intro\n```sh\n# a comment line\nmdkit create a \\\n   b   # trailing\n\nqemu-io -c 'write #1' x # c\nnbdfuse /mnt/x u &  # bg\n```\n";
        let b = &blocks(md, Path::new("/"))[0];
        let keys: Vec<&str> = b.commands.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(keys, ["mdkit create a \\\nb", "qemu-io -c 'write #1' x", "nbdfuse /mnt/x u &"]);
        assert_eq!(b.commands.iter().map(|c| c.line).collect::<Vec<_>>(), [4, 7, 8]);
        assert_eq!(b.commands[0].printed, "mdkit create a \\\n   b   # trailing");
        assert!(b.commands[2].is_background() && !b.commands[0].is_background());
    }
}
