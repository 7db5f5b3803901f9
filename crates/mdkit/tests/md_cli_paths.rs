//! md CLI paths no other test runs, end to end with the real binary:
//! - `manage --replace M --with N` on raid1 and raid5 with data written over NBD first: N is
//!   rebuilt into M's role (not some other spare), M ends faulty and out of its role, the array
//!   is not degraded, the data reads back identical (and after a restart), check finds 0
//!   mismatches; `--replace M` alone takes the spare already in the array (mdadm);
//! - refusals (a member not in the array, `--with` a member in use, a spare as the member to
//!   replace, a member already being replaced) exit non-zero naming the member and leave the
//!   array as it was; the `--with` device of a refused replace can be used afterwards;
//! - `assemble --uuid U` assembles only that array and names the members of the other one it
//!   left out (never writing them); a UUID no member carries fails and writes nothing;
//! - `--timeout-s N` against a control socket that accepts and never answers: a non-zero exit
//!   with an error naming the timeout.

use crate::common;

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{MDKIT, Server, mdkit, mdkit_err, mdkit_json, mdkit_ok, nbd_read, nbd_write_at, pattern, sha256};
use common::{require_tool, restart, run};
use serde_json::Value;

/// Longest wait for a rebuild, check or CLI exit: a hang guard, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn detail(srv: &Server, name: &str) -> Value {
    mdkit_json(srv, &["detail", name, "--json"])
}

fn member<'a>(d: &'a Value, name: &str) -> &'a Value {
    let ms = d["members"].as_array().expect("members");
    ms.iter().find(|m| m["name"] == name).unwrap_or_else(|| panic!("no member {name} in {d:#}"))
}

/// Each member as (name, role, state words): what a refused request must leave unchanged.
fn shape(d: &Value) -> Vec<(String, Value, Value)> {
    let ms = d["members"].as_array().expect("members");
    ms.iter().map(|m| (m["name"].as_str().unwrap().to_string(), m["role"].clone(), m["state"].clone())).collect()
}

fn paths(srv: &Server, prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|i| srv.path(&format!("{prefix}-{i}.img")).display().to_string()).collect()
}

/// A sparse member file not yet in any array.
fn blank_member(path: &str, size_bytes: u64) {
    std::fs::File::create(path).unwrap().set_len(size_bytes).unwrap();
}

/// Creates `name` through the service on 32 MiB members (the first `active` in roles, the
/// rest spares), exported as `name`, with recovery unthrottled.
fn create(srv: &Server, name: &str, level: &str, active: usize, members: &[String]) {
    let active_text = active.to_string();
    let mut args = vec!["create", name, "--level", level, "--raid-devices", &active_text];
    args.extend(["--member-size", "32M", "--assume-clean", "--export", name]);
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(srv, &args);
    mdkit_ok(srv, &["attr", name, "sync_speed_min=1000000"]);
}

/// Waits until `new` holds `role` in sync and the array is idle and not degraded.
fn wait_replaced(srv: &Server, name: &str, new: &str, role: u64) -> Value {
    let t = Instant::now();
    loop {
        let d = detail(srv, name);
        let m = member(&d, new);
        let done = m["role"] == role && m["state"][0] == "in_sync" && m["replacement"] == false;
        if done && d["sync"]["action"] == "idle" && d["degraded"] == 0 {
            return d;
        }
        assert!(t.elapsed() < HANG_GUARD, "{new} never replaced role {role} of {name}: {d:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// After a finished replacement: `new` in `role`, `old` faulty and in no role (md fails the
/// member it replaced), the array not degraded.
fn assert_replaced(d: &Value, new: &str, old: &str, role: u64) {
    assert_eq!(member(d, new)["role"], role, "{d:#}");
    assert_eq!(member(d, new)["state"], serde_json::json!(["in_sync"]), "{d:#}");
    assert_eq!(member(d, old)["role"], Value::Null, "{old} still holds a role: {d:#}");
    assert_eq!(member(d, old)["state"][0], "faulty", "{d:#}");
    assert_eq!(d["degraded"], 0, "{d:#}");
    assert!(!d["state"].as_str().unwrap().contains("degraded"), "{d:#}");
    assert_eq!(d["active_devices"], d["raid_disks"], "{d:#}");
}

/// Runs `check` to the end; the mismatch count.
fn check_mismatches(srv: &Server, name: &str) -> u64 {
    mdkit_ok(srv, &["attr", name, "sync_action=check"]);
    let t = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let d = detail(srv, name);
        let checked = mdkit_ok(srv, &["attr", name, "last_sync_action"]).trim() == "check";
        if checked && d["sync"]["action"] == "idle" {
            return d["sync"]["mismatch_cnt"].as_u64().unwrap();
        }
        assert!(t.elapsed() < HANG_GUARD, "check of {name} did not finish: {d:#}");
    }
}

/// A refused `manage`: non-zero exit, the message names `names`, the members are as before.
fn assert_refused(srv: &Server, array: &str, args: &[&str], names: &str) {
    let before = shape(&detail(srv, array));
    let err = mdkit_err(srv, args);
    assert!(err.contains(names), "{args:?}: the refusal does not name {names}: {err}");
    assert_eq!(shape(&detail(srv, array)), before, "{args:?} changed the array");
}

#[test]
fn replace_with_on_raid1_rebuilds_the_new_member_and_fails_the_old() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let ms = paths(&srv, "r1", 2);
    create(&srv, "r1", "raid1", 2, &ms);
    let data = pattern(21, 8 << 20);
    nbd_write_at(&srv, "r1", 0, &data);
    let new = srv.path("r1-new.img").display().to_string();
    blank_member(&new, 32 << 20);

    assert_refused(&srv, "r1", &["manage", "r1", "--replace", "r1-9.img", "--with", &new], "r1-9.img");
    assert_refused(&srv, "r1", &["manage", "r1", "--replace", "r1-0.img", "--with", &ms[1]], "r1-1.img");
    let out = mdkit_ok(&srv, &["manage", "r1", "--replace", "r1-0.img", "--with", &new]);
    assert!(out.contains("replace r1-0.img: done"), "{out}");
    let d = wait_replaced(&srv, "r1", "r1-new.img", 0);
    assert_replaced(&d, "r1-new.img", "r1-0.img", 0);
    assert_eq!(nbd_read(&srv, "r1", data.len()), data);
    assert_eq!(check_mismatches(&srv, "r1"), 0);

    // The superblocks say the same: after a restart the new member holds role 0 in sync.
    let srv = restart(srv);
    let d = detail(&srv, "r1");
    assert_eq!(member(&d, "r1-new.img")["role"], 0, "{d:#}");
    assert_eq!((d["degraded"].as_u64(), d["raid_disks"].as_u64()), (Some(0), Some(2)), "{d:#}");
    assert_eq!(nbd_read(&srv, "r1", data.len()), data, "data after restart");
}

#[test]
fn replace_on_raid5_with_a_new_member_then_with_the_spare() {
    require_tool("qemu-io", "qemu-utils");
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    // Roles 0..2 and one spare (r5-3.img).
    let ms = paths(&srv, "r5", 4);
    create(&srv, "r5", "raid5", 3, &ms);
    let data = pattern(22, 12 << 20);
    nbd_write_at(&srv, "r5", 0, &data);
    let new = srv.path("r5-new.img").display().to_string();
    blank_member(&new, 32 << 20);

    assert_refused(&srv, "r5", &["manage", "r5", "--replace", "nosuch.img", "--with", &new], "nosuch.img");
    assert_refused(&srv, "r5", &["manage", "r5", "--replace", "r5-1.img", "--with", &ms[0]], "r5-0.img");
    // A spare holds no role: nothing to replace.
    assert_refused(&srv, "r5", &["manage", "r5", "--replace", "r5-3.img", "--with", &new], "r5-3.img");

    // --with: that device is the replacement, not the spare the array already has. Throttled,
    // so the rebuild is still running for a second --replace of the same member (refused).
    mdkit_ok(&srv, &["attr", "r5", "sync_speed_max=1000"]);
    mdkit_ok(&srv, &["manage", "r5", "--replace", "r5-1.img", "--with", &new]);
    let d = detail(&srv, "r5");
    assert_eq!(
        (member(&d, "r5-new.img")["role"].as_u64(), member(&d, "r5-new.img")["replacement"].as_bool()),
        (Some(1), Some(true)),
        "{d:#}"
    );
    assert_eq!(member(&d, "r5-1.img")["state"], serde_json::json!(["in_sync", "want_replacement"]), "{d:#}");
    let other = srv.path("r5-other.img").display().to_string();
    blank_member(&other, 32 << 20);
    let again = ["manage", "r5", "--replace", "r5-1.img", "--with", &other];
    assert_refused(&srv, "r5", &again, "r5-1.img is already being replaced");
    mdkit_ok(&srv, &["attr", "r5", "sync_speed_max=system"]);
    let d = wait_replaced(&srv, "r5", "r5-new.img", 1);
    assert_replaced(&d, "r5-new.img", "r5-1.img", 1);
    assert_eq!(member(&d, "r5-3.img")["state"], serde_json::json!(["spare"]), "{d:#}");
    assert_eq!(nbd_read(&srv, "r5", data.len()), data);

    // No --with: the spare in the array becomes the replacement (mdadm).
    mdkit_ok(&srv, &["manage", "r5", "--replace", "r5-2.img"]);
    let d = wait_replaced(&srv, "r5", "r5-3.img", 2);
    assert_replaced(&d, "r5-3.img", "r5-2.img", 2);
    assert_eq!(member(&d, "r5-0.img")["role"], 0, "{d:#}");
    assert_eq!(nbd_read(&srv, "r5", data.len()), data);
    assert_eq!(check_mismatches(&srv, "r5"), 0);
}

//------------------------------------------------------------------------------------------------
// assemble --uuid

/// Writes a raid1 on `members` with the offline `mdkit create`; its UUID.
fn create_offline(name: &str, members: &[String]) -> String {
    let mut cmd = Command::new(MDKIT);
    cmd.args(["create", name, "--level", "raid1", "--member-size", "8M", "--socket", "/nonexistent/mdkit.sock"]);
    run(cmd.args(members));
    let out = run(Command::new(MDKIT).args(["examine", "--json"]).arg(&members[0]));
    let uuid = serde_json::from_slice::<Value>(&out.stdout).unwrap()["array_uuid"].as_str().unwrap().to_string();
    assert_eq!(uuid.len(), 35, "{uuid}");
    uuid
}

fn shas(members: &[String]) -> Vec<String> {
    members.iter().map(|m| sha256(Path::new(m))).collect()
}

/// Assembles `name` with `--uuid uuid` from `members`: the array has that UUID, holds
/// `mine` in sync, and names each of `others` left out as belonging to a different array.
fn assemble_by_uuid(srv: &Server, name: &str, uuid: &str, members: &[String], mine: &[&str], others: &[&str]) {
    let mut args = vec!["assemble", name, "--uuid", uuid, "--export", name];
    args.extend(members.iter().map(String::as_str));
    let out = mdkit(srv, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}\n{}", srv.log_text());
    let d = detail(srv, name);
    assert_eq!((d["uuid"].as_str(), d["degraded"].as_u64()), (Some(uuid), Some(0)), "{d:#}");
    let mut in_array: Vec<&str> =
        d["members"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    in_array.sort_unstable();
    assert_eq!(in_array, mine, "{d:#}");
    for o in others {
        assert!(stderr.contains(&format!("member {o} left out: belongs to a different array")), "{o}: {stderr}");
        let named = d["left_out"].as_array().unwrap().iter().any(|r| r["member"] == *o);
        assert!(named, "{o} not in left_out: {d:#}");
    }
}

#[test]
fn assemble_uuid_takes_only_that_array() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let a = paths(&srv, "ua", 2);
    let b = paths(&srv, "ub", 2);
    let uuid_a = create_offline("ua", &a);
    let uuid_b = create_offline("ub", &b);
    assert_ne!(uuid_a, uuid_b);
    // Interleaved, so neither array's members come first.
    let mixed: Vec<String> = vec![b[0].clone(), a[0].clone(), b[1].clone(), a[1].clone()];
    let before = shas(&mixed);
    let b_before = shas(&b);

    // A UUID nothing carries: refused by name, no volume, nothing written.
    let absent = "01234567:89abcdef:01234567:89abcdef";
    let mut args = vec!["assemble", "ux", "--uuid", absent];
    args.extend(mixed.iter().map(String::as_str));
    let err = mdkit_err(&srv, &args);
    assert!(err.contains(&format!("no member belongs to array uuid {absent}")), "{err}");
    let err = mdkit_err(&srv, &["assemble", "ux", "--uuid", "not-a-uuid", &a[0], &a[1]]);
    assert!(err.contains("not-a-uuid") && err.contains("32 hex digits"), "{err}");
    assert!(srv.status()["volumes"].as_array().unwrap().is_empty(), "{:#}", srv.status());
    assert_eq!(shas(&mixed), before, "a refused assemble wrote to a member");

    assemble_by_uuid(&srv, "ua", &uuid_a, &mixed, &["ua-0.img", "ua-1.img"], &["ub-0.img", "ub-1.img"]);
    let data = pattern(23, 2 << 20);
    nbd_write_at(&srv, "ua", 0, &data);
    assert_eq!(nbd_read(&srv, "ua", data.len()), data);
    mdkit_ok(&srv, &["stop", "ua"]);
    assert_eq!(shas(&b), b_before, "array ub was written");

    let a_after = shas(&a);
    assemble_by_uuid(&srv, "ub", &uuid_b, &mixed, &["ub-0.img", "ub-1.img"], &["ua-0.img", "ua-1.img"]);
    mdkit_ok(&srv, &["stop", "ub"]);
    assert_eq!(shas(&a), a_after, "array ua was written");
    let state = std::fs::read_to_string(srv.path("md-arrays.json")).unwrap();
    assert!(!state.contains("ux"), "the refused array was remembered: {state}");
}

//------------------------------------------------------------------------------------------------
// --timeout-s

/// A control socket that accepts one connection and never answers; the thread returns what
/// the client sent once it hung up.
fn silent_socket(path: &Path) -> std::thread::JoinHandle<Vec<u8>> {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        // Until the client closes: the connection stays open, the request unanswered.
        let _ = conn.read_to_end(&mut got);
        got
    })
}

/// Runs `mdkit ARGS`, killing it (and failing) if it outlives the hang guard.
fn run_guarded(args: &[&str], socket: &Path) -> std::process::Output {
    let mut child = Command::new(MDKIT)
        .args(args)
        .arg("--socket")
        .arg(socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > HANG_GUARD {
            let _ = child.kill();
            panic!("mdkit {args:?} still waiting on a silent socket after {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn timeout_s_gives_up_on_a_silent_control_socket() {
    let dir = tempfile::tempdir().unwrap();
    for (k, args) in [vec!["status", "--timeout-s", "1"], vec!["detail", "md0", "--timeout-s", "1"]].iter().enumerate()
    {
        let socket: PathBuf = dir.path().join(format!("silent-{k}.sock"));
        let server = silent_socket(&socket);
        let out = run_guarded(args, &socket);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded against a silent socket");
        assert!(stderr.contains("timed out") && stderr.contains("1 s") && stderr.contains("--timeout-s"), "{stderr}");
        let sent = String::from_utf8(server.join().unwrap()).unwrap();
        assert!(sent.contains(&format!("\"cmd\":\"{}\"", if k == 0 { "status" } else { "md.detail" })), "{sent}");
    }
}
