//! Fault isolation and CLI hygiene, end to end with the real binary:
//! - `serve` with a good md array, a file volume, an md volume whose members carry a corrupt
//!   superblock and one whose member files are missing: it starts, the good exports serve
//!   writes and reads, `status` lists the bad volumes and their exports as failed with the
//!   reason, `stop` forgets a failed volume; a CLI `assemble` on the corrupt members fails
//!   with exit code 1; a raid0 that loses a member at run time reports why in `status`;
//! - a remembered (run-time) array whose members are corrupted between restarts: the service
//!   comes up, lists it failed (still remembered, not retried in a loop), serves the rest;
//!   `stop` forgets it for good;
//! - a config volume or remembered array whose open killed a start (left in
//!   `open-guard.json`) is not opened again at later starts, until `stop` forgets it;
//! - output into a closed pipe (`examine | head -c1`, `status`) ends without a panic;
//! - an event count at 2^64-2 saturates at 2^64-1 through writes and a stop (no wrap to 0).

use crate::common;

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{MDKIT, Server, mdkit, mdkit_ok, nbd_read, pattern, require_tool, run};
use serde_json::Value;

/// v1.2 superblocks live 4 KiB into the member.
const SB_OFFSET_BYTES: u64 = 4096;
const MD_SB_MAGIC: u32 = 0xa92b_4efc;

fn nbd_write(srv: &Server, export: &str, data: &[u8]) {
    let f = srv.path(&format!("{export}.src"));
    std::fs::write(&f, data).unwrap();
    run(Command::new("nbdcopy").arg(&f).arg(srv.uri(export)));
}

/// Overwrites the v1.2 superblock of `path` with the md magic followed by garbage (creating a
/// 16 MiB file if needed): it looks like a member but nothing in it can be trusted.
fn corrupt_superblock(path: &Path, seed: u64) {
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).unwrap();
    if f.metadata().unwrap().len() == 0 {
        f.set_len(16 << 20).unwrap();
    }
    let mut block = pattern(seed, 4096);
    block[0..4].copy_from_slice(&MD_SB_MAGIC.to_le_bytes());
    block[4..8].copy_from_slice(&1u32.to_le_bytes());
    f.write_all_at(&block, SB_OFFSET_BYTES).unwrap();
}

fn status_entry(st: &Value, list: &str, name: &str) -> Value {
    st[list].as_array().unwrap().iter().find(|v| v["name"] == name).cloned().unwrap_or(Value::Null)
}

fn remembered_names(srv: &Server) -> Vec<String> {
    let state: Value = serde_json::from_slice(&std::fs::read(srv.path("md-arrays.json")).unwrap()).unwrap();
    state["arrays"].as_array().unwrap().iter().map(|a| a["name"].as_str().unwrap().to_string()).collect()
}

/// `nbdinfo` on an export: whether the server offers it.
fn exported(srv: &Server, export: &str) -> bool {
    Command::new("nbdinfo").arg(srv.uri(export)).output().unwrap().status.success()
}

const MIXED_VOLUMES: &str = r#"
[[volume]]
name = "good"
kind = "md"
members = ["good-a.img", "good-b.img"]
member_size = "16MiB"
create = true
level = "raid1"

[[volume]]
name = "corrupt"
kind = "md"
members = ["corrupt-a.img", "corrupt-b.img"]

[[volume]]
name = "missing"
kind = "md"
members = ["nowhere-a.img", "nowhere-b.img"]

[[volume]]
name = "plain"
kind = "file"
path = "plain.img"
size = "16MiB"

[[export]]
name = "good"
volume = "good"
[[export]]
name = "corrupt"
volume = "corrupt"
[[export]]
name = "plain"
volume = "plain"
"#;

#[test]
fn serve_starts_with_bad_volumes_and_serves_the_good_ones() {
    require_tool("nbdcopy", "libnbd-bin");
    require_tool("nbdinfo", "libnbd-bin");
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in("/var/tmp").unwrap();
    corrupt_superblock(&dir.path().join("corrupt-a.img"), 1);
    corrupt_superblock(&dir.path().join("corrupt-b.img"), 2);
    let config = format!(
        "data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\", \"unix:nbd.sock\"]\n{MIXED_VOLUMES}",
        dir.path().display()
    );
    let config_path = dir.path().join("mdkit.toml");
    std::fs::write(&config_path, config).unwrap();
    let srv = Server::start_with_config(dir, config_path);

    for (export, seed) in [("good", 3), ("plain", 4)] {
        let data = pattern(seed, 1 << 20);
        nbd_write(&srv, export, &data);
        assert_eq!(nbd_read(&srv, export, data.len()), data, "export {export}");
    }
    let st = srv.status();
    let good = status_entry(&st, "volumes", "good");
    // "active" until md's safe-mode delay marks it clean again after the writes.
    assert!(matches!(good["state"].as_str(), Some("clean" | "active")) && good["error"].is_null(), "{st:#}");
    assert_eq!(status_entry(&st, "volumes", "plain")["state"], "active", "{st:#}");
    let corrupt = status_entry(&st, "volumes", "corrupt");
    assert_eq!(corrupt["state"], "failed", "{st:#}");
    let why = corrupt["error"].as_str().unwrap();
    assert!(why.contains("\"corrupt\"") && why.contains("corrupt-"), "the reason names the volume and a member: {why}");
    let missing = status_entry(&st, "volumes", "missing");
    assert_eq!(missing["state"], "failed", "{st:#}");
    assert!(missing["error"].as_str().unwrap().contains("nowhere-a.img does not exist"), "{missing:#}");
    let e = status_entry(&st, "exports", "corrupt");
    assert_eq!(e["state"], "failed", "{st:#}");
    assert!(e["error"].as_str().unwrap().contains("volume \"corrupt\" failed"), "{e:#}");
    assert_eq!(status_entry(&st, "exports", "good")["state"], "serving");
    assert!(!exported(&srv, "corrupt"), "the export of a failed volume is not served");
    assert!(exported(&srv, "plain"));
    let text = mdkit_ok(&srv, &["status"]);
    assert!(text.contains("FAILED") && text.contains("volume corrupt:") && text.contains("volume missing:"), "{text}");
    assert!(srv.log_text().contains("volume failed"), "logged");

    // Forgetting a failed volume takes its failed export along; the rest is untouched.
    let out = mdkit_ok(&srv, &["stop", "corrupt"]);
    assert!(out.contains("stopped corrupt"), "{out}");
    let st = srv.status();
    assert!(status_entry(&st, "volumes", "corrupt").is_null() && status_entry(&st, "exports", "corrupt").is_null());
    assert_eq!(status_entry(&st, "volumes", "missing")["state"], "failed");
    assert_eq!(nbd_read(&srv, "good", 1 << 20), pattern(3, 1 << 20));
    // A CLI verb that trips over the same members fails with an exit code; nothing is remembered.
    let (a, b) = (srv.path("corrupt-a.img").display().to_string(), srv.path("corrupt-b.img").display().to_string());
    let out = mdkit(&srv, &["assemble", "again", &a, &b]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!srv.path("md-arrays.json").exists() || remembered_names(&srv).is_empty());
    // A volume failing at run time (raid0 losing a member) reports the error; the rest serve.
    let r0: Vec<String> = (0..2).map(|i| srv.path(&format!("r0-{i}.img")).display().to_string()).collect();
    mdkit_ok(&srv, &["create", "r0", "--level", "raid0", "--member-size", "16M", "--export", "r0", &r0[0], &r0[1]]);
    let _ = mdkit(&srv, &["manage", "r0", "--fail", &r0[0]]);
    let st = srv.status();
    let r0 = status_entry(&st, "volumes", "r0");
    assert_eq!(r0["state"], "broken", "{st:#}");
    assert!(r0["error"].as_str().is_some_and(|e| e.contains("without redundancy")), "{r0:#}");
    assert!(mdkit_ok(&srv, &["status"]).contains("volume r0 (broken)"));
    assert_eq!(nbd_read(&srv, "plain", 1 << 20), pattern(4, 1 << 20));
    // --check-config stays strict about config mistakes and opens nothing.
    let out = Command::new(MDKIT).args(["serve", "--check-config", "--config"]).arg(&srv.config_path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn remembered_array_corrupted_between_restarts_stays_listed_failed_until_stopped() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start(
        "[[volume]]\nname = \"keep\"\nkind = \"mem\"\nsize = \"8MiB\"\n[[export]]\nname = \"keep\"\nvolume = \"keep\"\n",
    );
    let members: Vec<String> = (0..2).map(|i| srv.path(&format!("r-{i}.img")).display().to_string()).collect();
    let mut args = vec!["create", "r1", "--level", "raid1", "--member-size", "16M", "--export", "r1"];
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    assert_eq!(remembered_names(&srv), ["r1"]);

    let mut srv = restart_with(srv, |_| {
        for (i, m) in members.iter().enumerate() {
            corrupt_superblock(Path::new(m), 10 + i as u64);
        }
    });
    // Twice: a remembered array that fails does not keep the service from coming up again.
    for round in 0..2 {
        if round > 0 {
            srv = restart_with(srv, |_| {});
        }
        let st = srv.status();
        let r1 = status_entry(&st, "volumes", "r1");
        assert_eq!((r1["state"].as_str(), r1["origin"].as_str()), (Some("failed"), Some("md-arrays.json")), "{st:#}");
        assert!(r1["error"].as_str().unwrap().contains("remembered md array not assembled"), "{r1:#}");
        assert_eq!(status_entry(&st, "exports", "r1")["state"], "failed", "{st:#}");
        assert_eq!(remembered_names(&srv), ["r1"], "still remembered until stopped");
        let out = mdkit(&srv, &["detail", "r1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("failed to open") && err.contains("mdkit stop r1"), "{err}");
        let data = pattern(5, 1 << 20);
        nbd_write(&srv, "keep", &data);
        assert_eq!(nbd_read(&srv, "keep", data.len()), data);
    }
    mdkit_ok(&srv, &["stop", "r1"]);
    assert!(remembered_names(&srv).is_empty(), "stop forgets the failed array");
    assert!(status_entry(&srv.status(), "volumes", "r1").is_null());
    let out = mdkit(&srv, &["stop", "r1"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no volume named \"r1\""));
}

/// Stops the server (cleanly), runs `between`, starts it again on the same data dir and config.
fn restart_with(mut srv: Server, between: impl FnOnce(&Path)) -> Server {
    assert!(srv.signal_and_wait(libc::SIGTERM, std::time::Duration::from_secs(30)).success(), "{}", srv.log_text());
    let dir = std::mem::replace(&mut srv.dir, tempfile::tempdir().unwrap());
    let cfg = srv.config_path.clone();
    drop(srv);
    between(dir.path());
    Server::start_with_config(dir, cfg)
}

#[test]
fn a_volume_whose_open_killed_a_start_is_not_opened_again_until_stopped() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("[[volume]]\nname = \"cfg\"\nkind = \"mem\"\nsize = \"8MiB\"\n");
    let members: Vec<String> = (0..2).map(|i| srv.path(&format!("k-{i}.img")).display().to_string()).collect();
    let mut create = vec!["create", "k", "--level", "raid1", "--member-size", "16M", "--export", "k"];
    create.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &create);
    let data = pattern(7, 1 << 20);
    nbd_write(&srv, "k", &data);
    // What starts that died (abort, OOM kill) while opening "cfg", then "k", leave behind.
    let srv = restart_with(srv, |dir| {
        std::fs::write(dir.join("open-guard.json"), r#"{"opening": "k", "crashed": ["cfg"]}"#).unwrap();
    });
    let assert_crashed = |srv: &Server| {
        let st = srv.status();
        for name in ["cfg", "k"] {
            let v = status_entry(&st, "volumes", name);
            assert_eq!(v["state"], "failed", "{name} not opened again: {st:#}");
            assert!(v["error"].as_str().unwrap().contains("died while opening"), "{v:#}");
        }
        assert_eq!(remembered_names(srv), ["k"]);
    };
    assert_crashed(&srv);
    let srv = restart_with(srv, |_| {});
    assert_crashed(&srv);
    // The operator forgets both: the config volume opens at the next start, the array is
    // assembled by hand (its data is there) and then at every start.
    mdkit_ok(&srv, &["stop", "cfg"]);
    mdkit_ok(&srv, &["stop", "k"]);
    let mut assemble = vec!["assemble", "k", "--export", "k"];
    assemble.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &assemble);
    assert_eq!(nbd_read(&srv, "k", data.len()), data);
    let srv = restart_with(srv, |_| {});
    let st = srv.status();
    assert_eq!(status_entry(&st, "volumes", "cfg")["state"], "active", "{st:#}");
    assert_eq!(nbd_read(&srv, "k", data.len()), data, "assembled again at start once forgotten and re-added");
}

/// Exit status of mdkit from a shell pipeline: 0 or death by SIGPIPE (141), never a panic (101).
fn assert_quiet_end(code: i32, stderr: &str, what: &str) {
    assert!(code == 0 || code == 128 + libc::SIGPIPE, "{what}: exit status {code}, stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

#[test]
fn output_into_a_closed_pipe_ends_without_a_panic() {
    let srv = Server::start("");
    let members: Vec<String> = (0..2).map(|i| srv.path(&format!("p-{i}.img")).display().to_string()).collect();
    run(Command::new(MDKIT)
        .args(["create", "p", "--level", "1", "--member-size", "16M", "--socket", "/nonexistent/mdkit.sock"])
        .args(&members));
    // 200 copies: far more output than a pipe buffer holds, so mdkit is still writing when
    // `head` has gone.
    let many = vec![members[0].as_str(); 200].join(" ");
    let (rc, err) = (srv.path("rc"), srv.path("err"));
    let script = format!(
        "{{ {MDKIT} examine {many} 2>{err}; echo $? >{rc}; }} | head -c1 >/dev/null",
        err = err.display(),
        rc = rc.display()
    );
    run(Command::new("sh").arg("-c").arg(&script));
    let code: i32 = std::fs::read_to_string(&rc).unwrap().trim().parse().unwrap();
    assert_quiet_end(code, &std::fs::read_to_string(&err).unwrap(), "examine | head -c1");

    // status into a pipe whose reader is already gone: the first write fails.
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills two fds we then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fds[0] and fds[1] are open and owned by nobody else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    for args in [&["status"][..], &["status", "--json"][..]] {
        let out = Command::new(MDKIT)
            .args(args)
            .arg("--socket")
            .arg(&srv.control)
            .stdout(Stdio::from(write_end.try_clone().unwrap()))
            .output()
            .unwrap();
        let code = out.status.code().unwrap_or_else(|| 128 + out.status.signal().unwrap());
        assert_quiet_end(code, &String::from_utf8_lossy(&out.stderr), &format!("{args:?} into a closed pipe"));
    }
}

/// The kernel's v1 superblock checksum (calc_sb_1_csum) over `sb` (the 4 KiB block).
fn sb_checksum(sb: &[u8]) -> u32 {
    let max_dev = u32::from_le_bytes(sb[220..224].try_into().unwrap()) as usize;
    let len = 256 + 2 * max_dev;
    let mut sum: u64 = 0;
    let mut i = 0;
    while i + 4 <= len {
        let word = if i == 216 { 0 } else { u32::from_le_bytes(sb[i..i + 4].try_into().unwrap()) };
        sum += u64::from(word);
        i += 4;
    }
    if len - i == 2 {
        sum += u64::from(u16::from_le_bytes(sb[i..i + 2].try_into().unwrap()));
    }
    ((sum & 0xffff_ffff) + (sum >> 32)) as u32
}

/// Sets the superblock's event count (offset 200) and fixes the checksum (offset 216).
fn set_events(member: &Path, events: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(member).unwrap();
    let mut sb = vec![0u8; 4096];
    f.read_exact_at(&mut sb, SB_OFFSET_BYTES).unwrap();
    assert_eq!(u32::from_le_bytes(sb[0..4].try_into().unwrap()), MD_SB_MAGIC);
    sb[200..208].copy_from_slice(&events.to_le_bytes());
    let csum = sb_checksum(&sb);
    sb[216..220].copy_from_slice(&csum.to_le_bytes());
    f.write_all_at(&sb, SB_OFFSET_BYTES).unwrap();
}

fn examined_events(member: &str) -> u64 {
    let out = run(Command::new(MDKIT).args(["examine", "--json", member]));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["events"].as_u64().unwrap_or_else(|| panic!("no events in {v:#}"))
}

#[test]
fn an_event_count_at_the_maximum_saturates_instead_of_wrapping() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let members: Vec<String> = (0..2).map(|i| srv.path(&format!("ev-{i}.img")).display().to_string()).collect();
    run(Command::new(MDKIT)
        .args(["create", "ev", "--level", "1", "--bitmap", "none", "--member-size", "16M"])
        .args(["--socket", "/nonexistent/mdkit.sock"])
        .args(&members));
    for m in &members {
        set_events(Path::new(m), u64::MAX - 1);
        assert_eq!(examined_events(m), u64::MAX - 1, "the patched superblock reads back");
    }
    let mut args = vec!["assemble", "ev", "--export", "ev"];
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    // Writes mark the array dirty (one round), the stop marks it clean (another): 2^64-1, 2^64.
    let data = pattern(6, 1 << 20);
    nbd_write(&srv, "ev", &data);
    assert_eq!(nbd_read(&srv, "ev", data.len()), data);
    mdkit_ok(&srv, &["stop", "ev"]);
    for m in &members {
        assert_eq!(examined_events(m), u64::MAX, "{m}: the event count saturates, it does not wrap to 0");
    }
    assert!(srv.log_text().contains("event count is at its maximum"), "{}", srv.log_text());
    // Still assembles (no member looks stale) with the data intact.
    let mut args = vec!["assemble", "ev", "--export", "ev"];
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    assert_eq!(nbd_read(&srv, "ev", data.len()), data);
}
