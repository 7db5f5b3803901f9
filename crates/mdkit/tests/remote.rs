//! md arrays with a member on a remote NBD server, end to end with the real binary:
//! - raid1 of a local file and an nbdkit export (Unix socket, nbdkit's log filter counting the
//!   requests that reach it): data written through the array is on both sides; the server is
//!   killed under a verifying write load: the remote member is failed, the array keeps serving
//!   with zero client-visible errors and the bitmap records the writes; with the server back,
//!   `manage --remove` + `--re-add URI` copies only the dirty chunks (counted on the server
//!   side), `check` reports 0 mismatches and `mdadm --examine` accepts both members;
//! - a config volume mirroring a local file to a qemu-nbd export over TCP loopback: data on
//!   the remote file, check 0, assembled again after a restart, mdadm --examine agrees;
//! - an nbdkit export added with `manage --add --write-mostly`: rebuilt, flagged write-mostly
//!   in its superblock (mdadm agrees, the next assembly too), and reads through the array never
//!   reach it while the local copy is in sync;
//! - a server that hangs (SIGSTOP) fails the member after `remote_timeout_ms` while writes
//!   through the array go on;
//! - bad member URIs and unreachable servers are refused with errors naming the URI (no member
//!   file created), and `--check-config` checks URIs and the remote keys.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Server, mdkit_err, mdkit_json, mdkit_ok, pattern, require_tool, run};
use mdkit_io::{BlockDevice, BlockDeviceExt, NbdDevice, SharedBuf, WriteFlags};
use serde_json::Value;

/// A server process, killed on drop.
pub(crate) struct Peer {
    pub(crate) child: Option<Child>,
}

impl Peer {
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ready() {
        assert!(t.elapsed() < limit, "{what}: not reached within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// nbdkit serving `file` on `socket`, every request logged to `log`.
pub(crate) fn nbdkit(file: &Path, socket: &Path, log: &Path) -> Peer {
    require_tool("nbdkit", "nbdkit");
    let _ = std::fs::remove_file(socket);
    let child = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(socket)
        .args(["--filter=log", "file"])
        .arg(file)
        .arg(format!("logfile={}", log.display()))
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn nbdkit");
    wait_until("nbdkit socket", Duration::from_secs(20), || std::os::unix::net::UnixStream::connect(socket).is_ok());
    Peer { child: Some(child) }
}

/// (offset, count) of every request of kind `what` ("Write", "Read") in an nbdkit log.
pub(crate) fn logged(log: &Path, what: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let field = |line: &str, key: &str| {
        let v = line.split_whitespace().find_map(|w| w.strip_prefix(key))?;
        u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()
    };
    let tag = format!(" {what} id=");
    text.lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| Some((field(l, "offset=")?, field(l, "count=")?)))
        .collect()
}

pub(crate) fn sparse(path: &Path, size: u64) {
    std::fs::File::create(path).unwrap().set_len(size).unwrap();
}

pub(crate) fn detail(srv: &Server, name: &str) -> Value {
    mdkit_json(srv, &["detail", name, "--json"])
}

pub(crate) fn member<'a>(d: &'a Value, name: &str) -> &'a Value {
    d["members"].as_array().unwrap().iter().find(|m| m["name"] == name).unwrap_or_else(|| panic!("{name} in {d:#}"))
}

pub(crate) fn has_state(m: &Value, word: &str) -> bool {
    m["state"].as_array().is_some_and(|s| s.iter().any(|w| w == word))
}

pub(crate) fn wait_settled(srv: &Server, name: &str) -> Value {
    let mut last = Value::Null;
    wait_until("array settled", Duration::from_secs(120), || {
        last = detail(srv, name);
        last["sync"]["action"] == "idle" && last["degraded"] == 0 && last["sync"]["resync_start"].is_null()
    });
    last
}

pub(crate) fn check(srv: &Server, name: &str) -> u64 {
    mdkit_ok(srv, &["attr", name, "sync_action=check"]);
    let mut last = Value::Null;
    wait_until("check finished", Duration::from_secs(120), || {
        last = detail(srv, name);
        last["sync"]["action"] == "idle" && last["sync"]["last_error"].is_null()
    });
    last["sync"]["mismatch_cnt"].as_u64().unwrap()
}

pub(crate) fn mdadm_examine(path: &Path) -> String {
    let out = run(Command::new("mdadm").arg("--examine").arg(path).env("TZ", "UTC"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Verifying writers through the array's export: each owns every `writers`-th 4 KiB block of
/// the first `span_bytes` and remembers the seed it last wrote there. [`Load::pause`] parks
/// them between writes (nothing of theirs in flight) until [`Load::resume`].
pub(crate) struct Load {
    dev: Arc<NbdDevice>,
    writes: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    parked: Arc<AtomicU64>,
    writers: u64,
    tasks: Vec<tokio::task::JoinHandle<HashMap<u64, u64>>>,
}

const BLOCK: u64 = 4096;

impl Load {
    pub(crate) fn start(rt: &tokio::runtime::Runtime, uri: &str, writers: u64, span_bytes: u64) -> Load {
        let dev = Arc::new(rt.block_on(NbdDevice::connect(uri, Default::default())).expect("connect to the export"));
        let (writes, errors, stop) = (Arc::default(), Arc::default(), Arc::new(AtomicBool::new(false)));
        let (paused, parked): (Arc<AtomicBool>, Arc<AtomicU64>) = (Arc::default(), Arc::default());
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (dev, writes, errors, stop): (Arc<NbdDevice>, Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicBool>) =
                (dev.clone(), Arc::clone(&writes), Arc::clone(&errors), stop.clone());
            let (paused, parked) = (paused.clone(), parked.clone());
            tasks.push(rt.spawn(async move {
                let mut model = HashMap::new();
                let blocks = span_bytes / BLOCK / writers;
                let mut seed = w << 32;
                while !stop.load(Ordering::Relaxed) {
                    if paused.load(Ordering::Acquire) {
                        parked.fetch_add(1, Ordering::AcqRel);
                        while paused.load(Ordering::Acquire) && !stop.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        parked.fetch_sub(1, Ordering::AcqRel);
                        continue;
                    }
                    seed += 1;
                    let block = (seed.wrapping_mul(0x9e37_79b9) % blocks) * writers + w;
                    let data = SharedBuf::from_slice(&pattern(seed, BLOCK as usize));
                    match dev.write(block * BLOCK, data, WriteFlags::NONE).await {
                        Ok(()) => {
                            model.insert(block, seed);
                            writes.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            eprintln!("client-visible write error: {e}");
                            errors.fetch_add(1, Ordering::Relaxed);
                            return model;
                        }
                    }
                }
                model
            }));
        }
        Load { dev, writes, errors, stop, paused, parked, writers, tasks }
    }

    pub(crate) fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    pub(crate) fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Parks every writer between two writes; returns once all are parked.
    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::Release);
        wait_until("writers parked", Duration::from_secs(120), || {
            self.parked.load(Ordering::Acquire) == self.writers || self.errors() > 0
        });
    }

    pub(crate) fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Stops the writers and verifies every block they wrote; returns the block count.
    pub(crate) fn finish(self, rt: &tokio::runtime::Runtime) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        rt.block_on(async {
            let mut model = HashMap::new();
            for t in self.tasks {
                model.extend(t.await.unwrap());
            }
            assert_eq!(self.errors.load(Ordering::Relaxed), 0, "client-visible errors");
            self.dev.flush().await.unwrap();
            for (block, seed) in &model {
                let got = self.dev.read_vec(block * BLOCK, BLOCK as usize).await.unwrap();
                assert!(got == pattern(*seed, BLOCK as usize), "block {block} lost its last write");
            }
            model.len()
        })
    }
}

pub(crate) const SIZE: u64 = 64 << 20;
pub(crate) const BITMAP_CHUNK: u64 = 1 << 20;

#[test]
fn raid1_with_an_nbdkit_member_survives_the_server_dying_and_catches_up_from_the_bitmap() {
    require_tool("mdadm", "mdadm");
    let srv = Server::start("");
    let remote_file = srv.path("remote.img");
    sparse(&remote_file, SIZE);
    let sock = srv.path("remote.sock");
    let log = srv.path("nbdkit.log");
    let mut peer = nbdkit(&remote_file, &sock, &log);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let local = srv.path("local.img").display().to_string();
    let args = ["create", "r1", "--level", "raid1", "--member-size", "64M", "--assume-clean"];
    let out = mdkit_ok(&srv, &[&args[..], &["--bitmap-chunk", "1M", "--export", "r1", &local, &uri]].concat());
    assert!(out.contains("array r1 started (raid1, 2 members)"), "{out}");
    let d = detail(&srv, "r1");
    assert!(has_state(member(&d, &uri), "in_sync"), "{d:#}");
    let data_offset_bytes = member(&d, &uri)["data_offset_sectors"].as_u64().unwrap() * 512;

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let export = srv.unix_uri("r1");
    // Before the failure: writes reach the remote file at the member's data offset.
    rt.block_on(async {
        let c = NbdDevice::connect(&export, Default::default()).await.unwrap();
        c.write_slice(32 << 20, &pattern(7, 1 << 20), WriteFlags::FUA).await.unwrap();
    });
    assert_eq!(common::read_file_at(&remote_file, data_offset_bytes + (32 << 20), 1 << 20), pattern(7, 1 << 20));

    // Kill the server under a verifying write load over the first 8 MiB.
    let load = Load::start(&rt, &export, 4, 8 << 20);
    wait_until("writes before the kill", Duration::from_secs(60), || load.writes() >= 200);
    peer.kill();
    wait_until("remote member failed", Duration::from_secs(30), || {
        has_state(member(&detail(&srv, "r1"), &uri), "faulty")
    });
    let at_failure = load.writes();
    wait_until("writes after the failure", Duration::from_secs(60), || load.writes() >= at_failure + 200);
    let blocks = load.finish(&rt);
    assert!(blocks > 0);
    let d = detail(&srv, "r1");
    assert_eq!(d["degraded"], 1, "{d:#}");
    let m = member(&d, &uri);
    assert!(m["fail_reason"].as_str().unwrap_or("").contains("link down"), "{m:#}");
    let dirty = d["bitmap"]["needed_chunks"].as_u64().unwrap();
    assert!(
        (1..=9).contains(&dirty),
        "writes to the first 8 MiB (and one at 32 MiB) dirty at most 9 chunks of 1 MiB: {d:#}"
    );

    // The server returns; remove the failed member and re-add it: only dirty chunks are copied.
    let _ = std::fs::remove_file(&log);
    let _peer = nbdkit(&remote_file, &sock, &log);
    mdkit_ok(&srv, &["manage", "r1", "--remove", &uri]);
    mdkit_ok(&srv, &["manage", "r1", "--re-add", &uri]);
    let d = wait_settled(&srv, "r1");
    assert!(has_state(member(&d, &uri), "in_sync"), "{d:#}");
    let data_written: u64 =
        logged(&log, "Write").iter().filter(|(off, _)| *off >= data_offset_bytes).map(|(_, n)| n).sum();
    eprintln!("catch-up: {dirty} dirty chunks, {data_written} data bytes copied to the remote member");
    assert_eq!(data_written, dirty * BITMAP_CHUNK, "the catch-up copies exactly the chunks the bitmap needs");
    assert_eq!(check(&srv, "r1"), 0, "mismatches after the catch-up");

    mdkit_ok(&srv, &["stop", "r1"]);
    for f in [&remote_file, &PathBuf::from(&local)] {
        let ex = mdadm_examine(f);
        assert!(ex.contains("Raid Level : raid1") && ex.contains("Checksum") && ex.contains("correct"), "{ex}");
        assert!(ex.contains("State : clean"), "{ex}");
    }
}

#[test]
fn config_volume_with_a_qemu_nbd_member_over_tcp() {
    require_tool("qemu-nbd", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("mdadm", "mdadm");
    let dir = tempfile::Builder::new().prefix("mdkit-remote-").tempdir_in("/var/tmp").unwrap();
    let remote_file = dir.path().join("remote.img");
    sparse(&remote_file, SIZE);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = Command::new("qemu-nbd")
        .args(["-f", "raw", "-x", "mirror", "-b", "127.0.0.1", "-p", &port.to_string(), "-t", "-e", "4"])
        .arg("--cache=none")
        .arg(&remote_file)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn qemu-nbd");
    let _peer = Peer { child: Some(child) };
    wait_until("qemu-nbd", Duration::from_secs(20), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    let uri = format!("nbd://127.0.0.1:{port}/mirror");
    let body = format!(
        r#"
[[volume]]
name = "q"
kind = "md"
members = ["q-local.img", "{uri}"]
member_size = "64MiB"
create = true
level = "raid1"
assume_clean = true
[[export]]
name = "q"
volume = "q"
"#
    );
    let srv = Server::start(&body);
    let d = detail(&srv, "q");
    assert!(has_state(member(&d, &uri), "in_sync"), "{d:#}");
    let data = pattern(11, 6 << 20);
    let src = srv.path("q.src");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(srv.uri("q")));
    assert_eq!(common::nbd_read(&srv, "q", data.len()), data);
    let off = member(&d, &uri)["data_offset_sectors"].as_u64().unwrap() * 512;
    assert_eq!(common::read_file_at(&remote_file, off, data.len()), data, "the remote file holds the data");
    assert_eq!(check(&srv, "q"), 0);
    // Assembled again from the same URI after a restart.
    let srv = common::restart(srv);
    assert_eq!(common::nbd_read(&srv, "q", data.len()), data);
    assert!(has_state(member(&detail(&srv, "q"), &uri), "in_sync"));
    drop(srv);
    let ex = mdadm_examine(&remote_file);
    assert!(ex.contains("Raid Level : raid1") && ex.contains("correct"), "{ex}");
}

#[test]
fn remote_member_added_write_mostly_is_rebuilt_and_never_read() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("mdadm", "mdadm");
    let srv = Server::start("");
    let remote_file = srv.path("remote.img");
    sparse(&remote_file, SIZE);
    let sock = srv.path("remote.sock");
    let log = srv.path("nbdkit.log");
    let _peer = nbdkit(&remote_file, &sock, &log);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let (a, b) = (srv.path("a.img").display().to_string(), srv.path("b.img").display().to_string());
    let args = ["create", "wm", "--level", "raid1", "--member-size", "64M", "--assume-clean", "--export", "wm"];
    mdkit_ok(&srv, &[&args[..], &[a.as_str(), b.as_str()]].concat());
    let data = pattern(5, 8 << 20);
    let src = srv.path("wm.src");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(srv.uri("wm")));
    // Replace b by the remote export, write-mostly.
    mdkit_ok(&srv, &["manage", "wm", "--fail", "b.img"]);
    mdkit_ok(&srv, &["manage", "wm", "--remove", "b.img"]);
    let e = mdkit_err(&srv, &["manage", "wm", "--fail", "b.img", "--write-mostly"]);
    assert!(e.contains("--write-mostly goes with --add or --re-add"), "{e}");
    mdkit_ok(&srv, &["manage", "wm", "--add", &uri, "--write-mostly"]);
    let d = wait_settled(&srv, "wm");
    let m = member(&d, &uri);
    assert!(has_state(m, "in_sync") && has_state(m, "write_mostly"), "{m:#}");
    let off = m["data_offset_sectors"].as_u64().unwrap() * 512;
    assert_eq!(common::read_file_at(&remote_file, off, data.len()), data, "rebuilt onto the remote file");
    // Reads through the array stay local.
    let reads_before = logged(&log, "Read").iter().filter(|(o, _)| *o >= off).count();
    for _ in 0..3 {
        assert_eq!(common::nbd_read(&srv, "wm", data.len()), data);
    }
    let reads_after = logged(&log, "Read").iter().filter(|(o, _)| *o >= off).count();
    assert_eq!(reads_after, reads_before, "data reads reached the write-mostly member");
    // Recorded in the superblock: mdadm sees it, and it survives a restart.
    mdkit_ok(&srv, &["stop", "wm"]);
    let ex = mdadm_examine(&remote_file);
    assert!(ex.contains("write-mostly"), "{ex}");
    mdkit_ok(&srv, &["assemble", "wm", &a, &uri, "--export", "wm"]);
    let d = detail(&srv, "wm");
    assert!(has_state(member(&d, &uri), "write_mostly"), "{d:#}");
    // Control: without the flag, reads do reach the remote copy (the log counts them).
    mdkit_ok(&srv, &["attr", "wm", &format!("dev-{uri}/state=-writemostly")]);
    assert!(!has_state(member(&detail(&srv, "wm"), &uri), "write_mostly"));
    let before = logged(&log, "Read").iter().filter(|(o, _)| *o >= off).count();
    let c = srv.path("wm.dst");
    run(Command::new("nbdcopy").args(["--requests=16", "--request-size=1048576"]).arg(srv.uri("wm")).arg(&c));
    let after = logged(&log, "Read").iter().filter(|(o, _)| *o >= off).count();
    assert!(after > before, "reads spread over both copies once the flag is cleared");
}

#[test]
fn bad_member_uris_are_refused_naming_the_uri() {
    let srv = Server::start("");
    let a = srv.path("a.img").display().to_string();
    let sock = srv.path("nobody.sock");
    for (uri, why) in [
        ("nbds://127.0.0.1/x".to_string(), "TLS is not supported"),
        ("nbd+unix:///x".to_string(), "needs ?socket=PATH"),
        (format!("nbd+unix:///x?socket={}", sock.display()), "cannot connect"),
    ] {
        let e = mdkit_err(&srv, &["create", "bad", "--level", "raid1", "--member-size", "16M", &a, &uri]);
        assert!(e.contains(&uri) && e.contains(why), "{uri}: {e}");
    }
    assert!(srv.status()["volumes"].as_array().unwrap().is_empty());
    assert!(!Path::new(&a).exists(), "a refused remote member left a member file created");
}

#[test]
fn hung_server_fails_the_member_after_remote_timeout_ms_and_the_array_keeps_serving() {
    require_tool("nbdcopy", "libnbd-bin");
    let dir = tempfile::Builder::new().prefix("mdkit-remote-").tempdir_in("/var/tmp").unwrap();
    let remote_file = dir.path().join("remote.img");
    sparse(&remote_file, SIZE);
    let sock = dir.path().join("remote.sock");
    let peer = nbdkit(&remote_file, &sock, &dir.path().join("nbdkit.log"));
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let body = format!(
        r#"
[[volume]]
name = "h"
kind = "md"
members = ["h-local.img", "{uri}"]
member_size = "64MiB"
create = true
level = "raid1"
assume_clean = true
remote_timeout_ms = 500
[[export]]
name = "h"
volume = "h"
"#
    );
    let srv = Server::start(&body);
    let write = |seed: u64| {
        let data = pattern(seed, 2 << 20);
        let src = srv.path("h.src");
        std::fs::write(&src, &data).unwrap();
        run(Command::new("nbdcopy").arg(&src).arg(srv.uri("h")));
        data
    };
    write(1);
    // The remote side hangs (stopped, not dead: the socket stays open, nothing answers).
    let pid = peer.child.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let data = write(2);
    assert_eq!(common::nbd_read(&srv, "h", data.len()), data);
    let d = detail(&srv, "h");
    let m = member(&d, &uri);
    assert!(has_state(m, "faulty"), "{d:#}");
    assert!(m["fail_reason"].as_str().unwrap_or("").contains("no reply within 500ms"), "{m:#}");
    assert_eq!(d["degraded"], 1);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
}

#[test]
fn check_config_validates_member_uris_and_remote_keys() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, members, why) in [
        ("", r#"["a.img", "nbd+unix:///x"]"#, "needs ?socket=PATH"),
        ("remote_timeout_ms = 5", r#"["a.img", "nbd://h/x"]"#, "remote_timeout_ms = 5"),
        ("remote_queue_depth = 0", r#"["a.img", "nbd://h/x"]"#, "remote_queue_depth = 0"),
        ("write_mostly = [\"b.img\"]", r#"["a.img", "nbd://h/x"]"#, "write_mostly \"b.img\" is not one of the members"),
    ] {
        let cfg = dir.path().join("c.toml");
        let text = format!(
            "data_dir = \"{}\"\n[[volume]]\nname = \"m\"\nkind = \"md\"\nmembers = {members}\n{extra}\n",
            dir.path().display()
        );
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(common::MDKIT).args(["serve", "--check-config", "--config"]).arg(&cfg).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{extra}: {err}");
    }
}
