//! Shared helpers for the acceptance tests: start the real `mdkit serve` binary with a temp
//! config, find its listeners through the control socket, run host tools, and a raw NBD
//! client for malformed-input tests.

#![allow(dead_code, reason = "each test binary uses a different subset of these helpers")]

pub mod raw;

/// The kernel lab finder shared with mdkit-thin's suite (one copy of the module per crate).
#[path = "../../../mdkit-thin/tests/pool_util/lab_dir.rs"]
pub mod lab_dir;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const MDKIT: &str = env!("CARGO_BIN_EXE_mdkit");

/// Fails the test with a message naming the tool and how to get it, if `tool` is missing.
pub fn require_tool(tool: &str, package: &str) {
    let found =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false);
    assert!(found, "`{tool}` not found: install the Debian package `{package}` (scripts/test installs it)");
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A running `mdkit serve`, killed on drop if still running.
pub struct Server {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    pub control: PathBuf,
    /// `127.0.0.1:PORT` of the TCP listener.
    pub tcp: String,
    /// Path of the Unix-socket listener.
    pub unix: PathBuf,
    pub log: PathBuf,
}

impl Server {
    /// Starts mdkit with `body` (volume/export tables) appended to a config that listens on
    /// an ephemeral TCP port and a Unix socket inside a fresh data directory.
    pub fn start(body: &str) -> Server {
        Server::start_opts("", body)
    }

    /// Like [`Server::start`] with extra keys for the `[nbd]` table.
    pub fn start_opts(nbd_extra: &str, body: &str) -> Server {
        // Not tmpfs: member files should get real O_DIRECT like in production.
        let base = if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
        let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in(base).expect("temp dir");
        let config = format!(
            "data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\", \"unix:nbd.sock\"]\n{nbd_extra}\n{body}",
            dir.path().display()
        );
        let config_path = dir.path().join("mdkit.toml");
        std::fs::write(&config_path, config).expect("write config");
        Server::start_with_config(dir, config_path)
    }

    pub fn start_with_config(dir: tempfile::TempDir, config_path: PathBuf) -> Server {
        Server::start_with_args(dir, config_path, &[])
    }

    /// Like [`Server::start_with_config`] with extra `mdkit serve` arguments.
    pub fn start_with_args(dir: tempfile::TempDir, config_path: PathBuf, serve_args: &[&str]) -> Server {
        let log = dir.path().join("mdkit.log");
        let child = Command::new(MDKIT)
            .args(["serve", "--config"])
            .arg(&config_path)
            .args(serve_args)
            .env("RUST_LOG", "info,mdkit_nbd=debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn mdkit serve");
        let control = dir.path().join("mdkit.sock");
        let mut s =
            Server { child: Some(child), dir, config_path, control, tcp: String::new(), unix: PathBuf::new(), log };
        let status = s.wait_ready(Duration::from_secs(30));
        for l in status["listeners"].as_array().expect("listeners") {
            let l = l.as_str().unwrap();
            match l.strip_prefix("unix:") {
                Some(p) => s.unix = PathBuf::from(p),
                None => s.tcp = l.to_string(),
            }
        }
        assert!(!s.tcp.is_empty(), "no TCP listener in {status}");
        s
    }

    fn wait_ready(&mut self, limit: Duration) -> Value {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("mdkit serve exited early with {st}; log:\n{}", self.log_text());
            }
            if self.control.exists()
                && let Ok(v) = self.try_status()
            {
                return v;
            }
            assert!(start.elapsed() < limit, "mdkit serve not ready after {limit:?}; log:\n{}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn try_status(&self) -> Result<Value, String> {
        let out = Command::new(MDKIT)
            .args(["status", "--json", "--socket"])
            .arg(&self.control)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    }

    /// `mdkit status --json`.
    pub fn status(&self) -> Value {
        self.try_status().unwrap_or_else(|e| panic!("mdkit status: {e}"))
    }

    /// Counters of one export from `status`.
    pub fn export_stats(&self, export: &str) -> Value {
        let st = self.status();
        st["exports"].as_array().unwrap().iter().find(|e| e["name"] == export).expect("export in status")["stats"]
            .clone()
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.tcp)
    }

    pub fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.unix.display())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// Sends `sig` and waits for the process to exit.
    pub fn signal_and_wait(&mut self, sig: i32, limit: Duration) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
        self.wait(limit)
    }

    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return st;
            }
            if start.elapsed() > limit {
                let _ = self.child.as_mut().unwrap().kill();
                panic!("mdkit did not exit within {limit:?}; log:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A thin pool on two new files of the data directory (8 MiB metadata, 64 MiB data, 64 KiB
/// blocks) with thin device 0 of 16 MiB as volume and export `vol0`.
pub const SMALL_POOL: &str = r#"
[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "8MiB"
data = "pool0.data"
data_size = "64MiB"
block_size = "64KiB"
create = true

[[volume]]
name = "vol0"
kind = "thin"
pool = "pool0"
id = 0
size = "16MiB"
create = true

[[export]]
name = "vol0"
volume = "vol0"
"#;

/// `mdkit serve --check-config` on `body` (volume and export tables) with `dir` as data
/// directory: (success, stderr).
pub fn check_config_in(dir: &Path, body: &str) -> (bool, String) {
    let config = dir.join("c.toml");
    std::fs::write(&config, format!("data_dir = \"{}\"\n{body}\n", dir.display())).expect("config");
    let out = Command::new(MDKIT).args(["serve", "--check-config", "--config"]).arg(&config).output().expect("mdkit");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The entry `name` of list `list` ("volumes", "exports") of a `status --json` answer
/// (`Null` when it is not there).
pub fn status_entry<'a>(status: &'a Value, list: &str, name: &str) -> &'a Value {
    status[list].as_array().unwrap().iter().find(|v| v["name"] == name).unwrap_or(&Value::Null)
}

/// A loop device detached when dropped.
pub struct Loop(pub String);

impl Loop {
    pub fn over(file: &Path) -> Loop {
        let out = run(Command::new("losetup").args(["--find", "--show"]).arg(file));
        Loop(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// `s` is still open and has nothing to read.
pub fn still_open(s: &std::os::unix::net::UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let r = (&*s).read(&mut [0u8; 1]);
    s.set_nonblocking(false).unwrap();
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// `mdkit ARGS` without a control socket (offline verbs).
pub fn offline(args: &[&str]) -> Output {
    Command::new(MDKIT).args(args).output().expect("run mdkit")
}

/// Like [`offline`], asserting success; its stdout.
pub fn offline_ok(args: &[&str]) -> String {
    let out = offline(args);
    assert!(
        out.status.success(),
        "mdkit {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Reads `len` bytes of a file at `offset`.
pub fn read_file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut v = vec![0u8; len];
    f.read_exact(&mut v).unwrap();
    v
}

/// sha256 of a file via coreutils' sha256sum.
pub fn sha256(path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().to_string()
}

/// `mdkit ARGS --socket <the server's control socket>`.
pub fn mdkit(srv: &Server, args: &[&str]) -> Output {
    Command::new(MDKIT).args(args).arg("--socket").arg(&srv.control).output().expect("run mdkit")
}

/// Like [`mdkit`], asserting success; returns stdout.
pub fn mdkit_ok(srv: &Server, args: &[&str]) -> String {
    expect_ok(srv, args, mdkit(srv, args))
}

/// Like [`mdkit`], asserting failure; returns stderr.
pub fn mdkit_err(srv: &Server, args: &[&str]) -> String {
    expect_err(args, mdkit(srv, args))
}

/// Like [`mdkit_ok`], parsing stdout as JSON.
pub fn mdkit_json(srv: &Server, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&mdkit_ok(srv, args)).expect("mdkit printed JSON")
}

/// `out` of `mdkit ARGS` succeeded (else panics with its output and the service log); its stdout.
pub fn expect_ok(srv: &Server, args: &[&str], out: Output) -> String {
    assert!(
        out.status.success(),
        "mdkit {args:?} failed:\n{}{}\nlog:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        srv.log_text()
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `out` of `mdkit ARGS` failed (else panics with its stdout); its stderr.
pub fn expect_err(args: &[&str], out: Output) -> String {
    assert!(!out.status.success(), "mdkit {args:?} should fail: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Writes `data` at `offset` of an export with qemu-io (the data staged in a file of the test dir).
pub fn nbd_write_at(srv: &Server, export: &str, offset: u64, data: &[u8]) {
    let f = srv.path(&format!("{export}-{offset}.src"));
    std::fs::write(&f, data).unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c"])
        .arg(format!("write -s {} {offset} {}", f.display(), data.len()))
        .arg(srv.uri(export)));
}

/// Reads the first `len` bytes of an export with nbdcopy.
pub fn nbd_read(srv: &Server, export: &str, len: usize) -> Vec<u8> {
    let f = srv.path(&format!("{export}.dst"));
    run(Command::new("nbdcopy").arg(srv.uri(export)).arg(&f));
    let mut v = std::fs::read(&f).unwrap();
    v.truncate(len);
    v
}

/// Stops the server with SIGTERM (it must exit cleanly) and starts it again on the same data
/// directory and config.
pub fn restart(mut srv: Server) -> Server {
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    let dir = std::mem::replace(&mut srv.dir, tempfile::tempdir().unwrap());
    let cfg = srv.config_path.clone();
    drop(srv);
    Server::start_with_config(dir, cfg)
}

/// Polls `thin status POOL --json` until `done` holds; panics with the last status and the
/// service log when it has not after two minutes (a hang guard: no test checks how long it took).
pub fn wait_thin_status(srv: &Server, pool: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let st = mdkit_json(srv, &["thin", "status", pool, "--json"]);
        if done(&st) {
            return st;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no {what}: {st:#}\nlog:\n{}", srv.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}
