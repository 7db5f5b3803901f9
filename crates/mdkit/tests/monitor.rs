//! `mdkit monitor` against a running service, with mdadm's event names:
//! - a raid1 member failed under write load raises `Fail` (with the member) and
//!   `DegradedArray`; the `--program` hook gets `EVENT VOLUME MEMBER` as arguments;
//! - `--oneshot` then reports the degraded array, `--test --oneshot` a `TestMessage`;
//! - a member added in its place raises `RebuildStarted`, `SpareActive`, `RebuildFinished`;
//! - filling a thin pool raises `LowWater` and `OutOfDataSpace`.
//!
//! The streaming monitor is started with `--test`: its `TestMessage` lines prove it is
//! subscribed before the test changes anything. Waits have generous hang guards only.

use crate::common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use common::{MDKIT, Server, mdkit_ok, require_tool};
use serde_json::Value;

/// Hang guard for every wait.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// A streaming `mdkit monitor --json --test`, killed on drop; its events arrive on `rx`.
struct Monitor {
    child: Child,
    rx: Receiver<Value>,
    seen: Vec<Value>,
}

impl Monitor {
    fn start(srv: &Server, extra: &[&str]) -> Monitor {
        let mut child = Command::new(MDKIT)
            .args(["monitor", "--json", "--test"])
            .args(extra)
            .arg("--socket")
            .arg(&srv.control)
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn mdkit monitor");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        Monitor { child, rx, seen: Vec::new() }
    }

    /// Waits for an event named `event` on `volume`; returns it.
    fn wait_for(&mut self, srv: &Server, event: &str, volume: &str) -> Value {
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            if let Some(e) = self.seen.iter().find(|e| e["event"] == event && e["volume"] == volume) {
                return e.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(v) => self.seen.push(v),
                Err(e) => panic!("no {event} on {volume} ({e}); seen: {:#?}\nlog:\n{}", self.seen, srv.log_text()),
            }
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `path` until it contains `want` (hang guard only).
fn wait_file_contains(path: &Path, want: &str) -> String {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(want) {
            return text;
        }
        assert!(Instant::now() < deadline, "{} never got {want:?}: {text:?}", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

const RAID1: &str = r#"
[[volume]]
name = "md0"
kind = "md"
members = ["md0-a.img", "md0-b.img"]
member_size = "32MiB"
create = true
level = "raid1"
[[export]]
name = "md0"
volume = "md0"
"#;

#[test]
fn member_failure_under_load_raises_fail_and_degraded_and_runs_the_program() {
    require_tool("qemu-io", "qemu-utils");
    let srv = Server::start(RAID1);
    let hook = srv.path("hook.sh");
    let hook_out = srv.path("hook.out");
    std::fs::write(&hook, format!("#!/bin/sh\necho \"$@\" >> '{}'\n", hook_out.display())).unwrap();
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut mon = Monitor::start(&srv, &["--program", hook.to_str().unwrap()]);
    mon.wait_for(&srv, "TestMessage", "md0");

    let uri = srv.uri("md0");
    let load = std::thread::spawn(move || {
        Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 0 16M"]).arg(uri).output().expect("qemu-io")
    });
    mdkit_ok(&srv, &["manage", "md0", "--fail", "md0-b.img"]);
    let fail = mon.wait_for(&srv, "Fail", "md0");
    assert_eq!(fail["member"], "md0-b.img", "{fail}");
    mon.wait_for(&srv, "DegradedArray", "md0");
    let out = load.join().unwrap();
    assert!(out.status.success(), "writes go on on the degraded mirror: {}", String::from_utf8_lossy(&out.stderr));

    let hook_text = wait_file_contains(&hook_out, "Fail md0 md0-b.img");
    assert!(hook_text.contains("TestMessage md0\n"), "{hook_text}");

    let oneshot = mdkit_ok(&srv, &["monitor", "--oneshot"]);
    assert!(oneshot.contains("DegradedArray event detected on md device md0"), "{oneshot}");
    let test = mdkit_ok(&srv, &["monitor", "--oneshot", "--test", "--json"]);
    let names: Vec<Value> = test.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["event"].clone()).collect();
    assert_eq!(names, ["TestMessage", "DegradedArray"], "{test}");

    // A new member is rebuilt: the rebuild is announced, and the spare becomes active. The
    // speed limit keeps the rebuild longer than a few watcher polls.
    mdkit_ok(&srv, &["attr", "md0", "sync_speed_max=16000"]);
    mdkit_ok(&srv, &["manage", "md0", "--remove", "md0-b.img"]);
    // The new member lives in the test's directory; a relative path would be taken from the
    // test's working directory (the crate's source tree).
    let spare = srv.path("md0-c.img");
    mdkit_ok(&srv, &["manage", "md0", "--add", spare.to_str().unwrap(), "--member-size", "32M"]);
    mon.wait_for(&srv, "RebuildStarted", "md0");
    let active = mon.wait_for(&srv, "SpareActive", "md0");
    assert_eq!(active["member"], "md0-c.img", "{active}");
    mon.wait_for(&srv, "RebuildFinished", "md0");
    let hook_text = wait_file_contains(&hook_out, "RebuildFinished md0");
    assert!(hook_text.contains("SpareActive md0 md0-c.img"), "{hook_text}");
}

const SMALL_POOL: &str = r#"
[[volume]]
name = "pool0"
kind = "thin-pool"
metadata = "pool0.meta"
metadata_size = "8MiB"
data = "pool0.data"
data_size = "4MiB"
block_size = "64KiB"
create = true
low_water_blocks = 16
options = ["error_if_no_space"]

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

#[test]
fn filling_a_thin_pool_raises_low_water_and_out_of_data_space() {
    require_tool("qemu-io", "qemu-utils");
    let srv = Server::start(SMALL_POOL);
    let mut mon = Monitor::start(&srv, &[]);
    mon.wait_for(&srv, "TestMessage", "pool0");
    let oneshot = mdkit_ok(&srv, &["monitor", "--oneshot"]);
    assert_eq!(oneshot, "", "a fresh pool has nothing to report");

    // 8 MiB of writes into 4 MiB of data space: the tail fails with ENOSPC.
    let out =
        Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x33 0 8M"]).arg(srv.uri("vol0")).output().unwrap();
    assert!(!out.status.success(), "the pool cannot hold 8 MiB");
    mon.wait_for(&srv, "LowWater", "pool0");
    mon.wait_for(&srv, "OutOfDataSpace", "pool0");
    let oneshot = mdkit_ok(&srv, &["monitor", "--oneshot"]);
    assert!(oneshot.contains("OutOfDataSpace event detected on thin pool pool0"), "{oneshot}");
}

#[test]
fn mail_without_sendmail_is_a_clear_error() {
    if Path::new("/usr/sbin/sendmail").exists() {
        eprintln!("SKIP: /usr/sbin/sendmail exists; the missing-sendmail error cannot be shown");
        return;
    }
    let out = Command::new(MDKIT)
        .args(["monitor", "--oneshot", "--mail", "root", "--socket", "/nonexistent"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/usr/sbin/sendmail not found"), "{err}");
}
