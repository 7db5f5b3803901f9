//! Runs the commands of one doc block as printed, in a private mount, network and PID
//! namespace: `lo` up, scratch directories bound over /var/lib/mdkit and /mnt, the working
//! directory a scratch directory, `mdkit` on PATH the binary under test, and a scratch
//! `mdkit serve` started the way `scripts/serve` starts it (`mdkit serve` on the embedded
//! default, from the directory that holds `./mdkit-data`). Port 10809 is the namespace's own,
//! so nothing clashes with other tests and nothing on the host is touched. When the commands
//! are done, background jobs the docs started are stopped, then the service gets SIGTERM and
//! must exit 0 (README: "Ctrl-C or SIGTERM stops the service cleanly ... exit status 0").

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::extract::DocCommand;
use super::listing::{Input, Listing};

/// Hang guard for one session; sessions take a few seconds.
const SESSION_LIMIT: Duration = Duration::from_secs(180);

pub struct Session<'a> {
    pub file: &'a str,
    pub block_line: usize,
    pub commands: Vec<&'a DocCommand>,
    /// A config from the docs: the service runs on it (`mdkit serve --config doc-config.toml`)
    /// instead of the embedded default.
    pub config: Option<String>,
}

impl Session<'_> {
    /// Runs the session; `Err` is a report naming every failing command by file:line.
    pub fn run(&self, listing: &Listing) -> Result<(), String> {
        let scratch = tempfile::Builder::new().prefix("mdkit-docs-").tempdir_in(scratch_base()).expect("scratch dir");
        let s = scratch.path();
        for dir in ["bin", "cwd", "varlib", "mnt", "out"] {
            std::fs::create_dir(s.join(dir)).expect("scratch subdirectory");
        }
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_mdkit"), s.join("bin/mdkit")).expect("mdkit symlink");
        for input in &listing.input {
            prepare_input(s, input);
        }
        if let Some(config) = &self.config {
            std::fs::write(s.join("cwd").join(CONFIG_FILE), config).expect("doc config");
        }
        std::fs::write(s.join("session.sh"), self.script(listing)).expect("session script");
        let harness_out = run_namespaced(s);
        self.report(s, listing, &harness_out)
    }

    fn script(&self, listing: &Listing) -> String {
        let config_args = if self.config.is_some() { format!("--config {CONFIG_FILE}") } else { String::new() };
        let mut sh = format!("config_args=\"{config_args}\"\n{PROLOGUE}");
        if self.config.is_some() {
            // A documented config whose volumes do not open is a broken example, although the
            // service itself starts (a failed volume is isolated).
            sh.push_str(CONFIG_VOLUMES_OPEN);
        }
        for (i, cmd) in self.commands.iter().enumerate() {
            let ready_path = listing.ready_path(self.file, &cmd.key);
            let _ = writeln!(sh, "# {}:{}", self.file, cmd.line);
            let _ = writeln!(sh, "{{\n{}\n}} >\"$S/out/{i}.stdout\" 2>\"$S/out/{i}.stderr\"", cmd.printed);
            let _ = writeln!(sh, "rc=$?");
            if cmd.is_background() {
                let _ = writeln!(sh, "bg_jobs=\"$bg_jobs {i}:$!\"");
                if let Some(path) = ready_path {
                    let _ = writeln!(sh, "wait_ready {path:?} $! || rc=$?");
                }
            }
            let _ = writeln!(sh, "echo $rc >\"$S/out/{i}.rc\"\n[ $rc = 0 ] || finish");
        }
        sh.push_str("finish\n");
        sh
    }

    fn report(&self, s: &Path, listing: &Listing, harness_out: &str) -> Result<(), String> {
        let mut failures = String::new();
        for (i, cmd) in self.commands.iter().enumerate() {
            if let Some(problem) = command_problem(s, i, cmd, self.file, listing) {
                let _ = writeln!(failures, "{}:{}: `{}`: {problem}", self.file, cmd.line, cmd.printed);
                let _ = writeln!(failures, "  stdout: {}", tail(&read(&s.join(format!("out/{i}.stdout")))));
                let _ = writeln!(failures, "  stderr: {}", tail(&read(&s.join(format!("out/{i}.stderr")))));
                break;
            }
        }
        if failures.is_empty() && read(&s.join("out/serve.rc")).trim() != "0" {
            let _ = writeln!(
                failures,
                "the scratch `mdkit serve` did not start, or did not exit 0 on SIGTERM (harness and serve log below)"
            );
        }
        if failures.is_empty() {
            return Ok(());
        }
        Err(format!(
            "block at {}:{}:\n{failures}  harness: {}\n  serve log: {}",
            self.file,
            self.block_line,
            tail(harness_out),
            tail(&read(&s.join("serve.log")))
        ))
    }
}

const CONFIG_FILE: &str = "doc-config.toml";

const CONFIG_VOLUMES_OPEN: &str = r#"if mdkit status $config_args --json | grep -q '"state": "failed"'; then
    fail "a volume of the documented config did not open: $(mdkit status $config_args | grep -i -A1 failed)"
fi
"#;

const PROLOGUE: &str = r#"set -u
fail() { echo "harness: $*" >&2; exit 90; }
command -v ip >/dev/null || fail "ip not found: install the Debian package iproute2"
ip link set lo up || fail "ip link set lo up"
if [ -d /var/lib/mdkit ]; then
    mount --bind "$S/varlib" /var/lib/mdkit || fail "bind /var/lib/mdkit"
else
    mount -t tmpfs tmpfs /var/lib && mkdir /var/lib/mdkit && mount --bind "$S/varlib" /var/lib/mdkit \
        || fail "scratch /var/lib/mdkit"
fi
mount --bind "$S/mnt" /mnt || fail "bind /mnt"
export PATH="$S/bin:$PATH"
unset MDKIT_DATA_DIR  # a new user's shell: the defaults the docs describe
cd "$S/cwd" || fail "cd"
# As scripts/serve does (after its build): `mdkit serve` from the directory of ./mdkit-data.
mdkit serve $config_args >"$S/serve.log" 2>&1 &
serve_pid=$!
ready=0
for _ in $(seq 600); do
    if mdkit status $config_args >/dev/null 2>&1; then ready=1; break; fi
    kill -0 $serve_pid 2>/dev/null || break
    sleep 0.05
done
[ $ready = 1 ] || fail "mdkit serve did not become ready"
bg_jobs=""
# A background job is ready when its path appears; it failed if it exits first (hang guard 30 s).
wait_ready() {
    for _ in $(seq 600); do
        [ -e "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || { echo "harness: background job exited before $1 appeared" >&2; return 1; }
        sleep 0.05
    done
    echo "harness: $1 did not appear" >&2
    return 1
}
finish() {
    for job in $bg_jobs; do
        i=${job%%:*}; pid=${job#*:}
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"; wait "$pid"
        else
            wait "$pid"; echo $? >"$S/out/$i.bgrc"
        fi
    done
    kill -TERM $serve_pid
    wait $serve_pid
    echo $? >"$S/out/serve.rc"
    exit 0
}
"#;

fn command_problem(s: &Path, i: usize, cmd: &DocCommand, file: &str, listing: &Listing) -> Option<String> {
    let rc = read(&s.join(format!("out/{i}.rc")));
    if rc.is_empty() {
        return Some("not run (the session stopped before it)".into());
    }
    if rc.trim() == "127" {
        return Some("command not found: a tool the docs use is missing (scripts/test installs them)".into());
    }
    if rc.trim() != "0" {
        return Some(format!("exit status {}", rc.trim()));
    }
    let bg_rc = read(&s.join(format!("out/{i}.bgrc")));
    if !bg_rc.is_empty() && bg_rc.trim() != "0" {
        return Some(format!("background job exited with status {}", bg_rc.trim()));
    }
    let stdout = read(&s.join(format!("out/{i}.stdout")));
    let missing: Vec<&str> = listing.expectations(file, &cmd.key).filter(|want| !stdout.contains(want)).collect();
    (!missing.is_empty()).then(|| format!("stdout lacks {missing:?}"))
}

fn run_namespaced(s: &Path) -> String {
    let log_path = s.join("harness.log");
    let log = std::fs::File::create(&log_path).expect("harness log");
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]);
    if !super::is_root() {
        cmd.arg("--map-root-user");
    }
    let mut child = cmd
        .arg("bash")
        .arg(s.join("session.sh"))
        .env("S", s)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log handle"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning unshare (util-linux; scripts/test installs it): {e}"));
    let start = Instant::now();
    while child.try_wait().expect("waiting for the session").is_none() {
        if start.elapsed() > SESSION_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return format!("session hung for {SESSION_LIMIT:?} and was killed; {}", read(&log_path));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    read(&log_path)
}

fn prepare_input(s: &Path, input: &Input) {
    let path = scratch_path(s, &input.path);
    if input.dir {
        std::fs::create_dir_all(&path).expect("input directory");
        return;
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).expect("input parent directory");
    }
    let len = usize::try_from(input.size_bytes).expect("input size fits memory");
    let bytes: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(31) >> 3) as u8).collect();
    std::fs::write(&path, bytes).expect("input file");
}

/// Where `doc_path` (as the docs print it) lives in the scratch directory.
pub fn scratch_path(s: &Path, doc_path: &str) -> PathBuf {
    if let Some(rest) = doc_path.strip_prefix("/var/lib/mdkit/") {
        s.join("varlib").join(rest)
    } else if let Some(rest) = doc_path.strip_prefix("/mnt/") {
        s.join("mnt").join(rest)
    } else {
        assert!(!doc_path.starts_with('/'), "input {doc_path}: only /var/lib/mdkit/ and /mnt/ are mapped");
        s.join("cwd").join(doc_path)
    }
}

fn scratch_base() -> &'static str {
    // Not tmpfs: member files get real O_DIRECT as in production.
    if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(25);
    let shown = lines[from..].join("\n    ");
    if shown.is_empty() { "(empty)".into() } else { format!("\n    {shown}") }
}
