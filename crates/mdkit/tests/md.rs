//! md arrays in the service and the md verbs, end to end with the real binary and nbdcopy:
//! - a `kind = "md"` raid1 volume is created on first start, serves data over NBD, reports
//!   through `status`/`detail`/`attr`, and is assembled again (same data) after a restart;
//! - `mdkit create` through the service (raid10 f2, exported), `manage --fail/--remove/--add`
//!   with a rebuild to 0 mismatches, the array remembered across a restart, `stop` forgets it;
//! - `mdkit create` without a service writes superblocks only; `examine` reads them like
//!   `mdadm --examine` (and mdadm agrees); `assemble` starts the array in the service;
//! - bad input: an existing superblock without --force, an unknown level, a missing member,
//!   an unknown level, stopping an unknown array — clear errors, nothing changed.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{MDKIT, Server, mdkit, mdkit_err, mdkit_ok, nbd_read, pattern, require_tool, restart, run};
use serde_json::Value;

fn detail(srv: &Server, name: &str) -> Value {
    serde_json::from_str(&mdkit_ok(srv, &["detail", name, "--json"])).unwrap()
}

/// Waits until the array has no sync work and is not degraded.
fn wait_settled(srv: &Server, name: &str) -> Value {
    let t = Instant::now();
    loop {
        let d = detail(srv, name);
        if d["sync"]["action"] == "idle" && d["degraded"] == 0 && d["sync"]["resync_start"].is_null() {
            return d;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "array {name} did not settle: {d:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn check(srv: &Server, name: &str) -> u64 {
    let runs_before = detail(srv, name)["sync"]["mismatch_cnt"].clone();
    let _ = runs_before;
    mdkit_ok(srv, &["attr", name, "sync_action=check"]);
    let t = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let d = detail(srv, name);
        if d["sync"]["action"] == "idle" {
            return d["sync"]["mismatch_cnt"].as_u64().unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "check did not finish");
    }
}

fn nbd_write(srv: &Server, export: &str, data: &[u8]) {
    let f = srv.path(&format!("{export}.src"));
    std::fs::write(&f, data).unwrap();
    run(Command::new("nbdcopy").arg(&f).arg(srv.uri(export)));
}

const RAID1_VOLUME: &str = r#"
[[volume]]
name = "md0"
kind = "md"
members = ["md0-a.img", "md0-b.img"]
member_size = "64MiB"
create = true
level = "raid1"
[volume.attributes]
sync_speed_max = "2000000"
[[export]]
name = "md0"
volume = "md0"
"#;

#[test]
fn config_volume_created_served_and_reassembled() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start(RAID1_VOLUME);
    let st = srv.status();
    let vol = &st["volumes"][0];
    assert_eq!((vol["kind"].as_str(), vol["state"].as_str()), (Some("md"), Some("clean")), "{st:#}");
    assert_eq!(mdkit_ok(&srv, &["attr", "md0", "sync_speed_max"]).trim(), "2000000");
    let data = pattern(1, 5 << 20);
    nbd_write(&srv, "md0", &data);
    assert_eq!(nbd_read(&srv, "md0", data.len()), data);
    let d = detail(&srv, "md0");
    assert_eq!((d["level"].as_str(), d["raid_disks"].as_u64()), (Some("raid1"), Some(2)));
    let text = mdkit_ok(&srv, &["detail", "md0"]);
    assert!(text.contains("Raid Level : raid1") && text.contains("md0-a.img") && text.contains("in_sync"), "{text}");
    let srv = restart(srv);
    assert_eq!(nbd_read(&srv, "md0", data.len()), data, "data after restart");
    assert_eq!(check(&srv, "md0"), 0);
    let d = detail(&srv, "md0");
    assert!(d["events"].as_u64().unwrap() > 0);
}

#[test]
fn runtime_array_lifecycle_through_the_cli() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let members: Vec<String> = (0..4).map(|i| srv.path(&format!("r10-{i}.img")).display().to_string()).collect();
    let mut args =
        vec!["create", "r10", "--level", "raid10", "--raid-devices", "4", "--layout", "f2", "--chunk", "64K"];
    args.extend(["--member-size", "32M", "--export", "r10"]);
    args.extend(members.iter().map(String::as_str));
    let out = mdkit_ok(&srv, &args);
    assert!(out.contains("array r10 started (raid10, 4 members)"), "{out}");
    let data = pattern(2, 12 << 20);
    nbd_write(&srv, "r10", &data);
    mdkit_ok(&srv, &["attr", "r10", "sync_speed_min=1000000"]);
    // Fail a member, remove it, add a spare: it is rebuilt.
    mdkit_ok(&srv, &["manage", "r10", "--fail", "r10-1.img"]);
    let d = detail(&srv, "r10");
    assert_eq!(d["degraded"], 1, "{d:#}");
    mdkit_ok(&srv, &["manage", "r10", "--remove", "r10-1.img"]);
    let spare = srv.path("spare.img").display().to_string();
    mdkit_ok(&srv, &["manage", "r10", "--add", &spare, "--member-size", "32M"]);
    let d = wait_settled(&srv, "r10");
    assert!(
        d["members"].as_array().unwrap().iter().any(|m| m["name"] == "spare.img" && m["state"][0] == "in_sync"),
        "{d:#}"
    );
    assert_eq!(check(&srv, "r10"), 0);
    assert_eq!(nbd_read(&srv, "r10", data.len()), data);
    // Remembered across a restart (members now include the spare), exported again.
    let srv = restart(srv);
    let st = srv.status();
    assert!(st["volumes"].as_array().unwrap().iter().any(|v| v["name"] == "r10"), "{st:#}");
    assert_eq!(nbd_read(&srv, "r10", data.len()), data);
    let state: Value = serde_json::from_slice(&std::fs::read(srv.path("md-arrays.json")).unwrap()).unwrap();
    assert_eq!(state["arrays"][0]["name"], "r10");
    mdkit_ok(&srv, &["stop", "r10"]);
    let state: Value = serde_json::from_slice(&std::fs::read(srv.path("md-arrays.json")).unwrap()).unwrap();
    assert_eq!(state["arrays"].as_array().unwrap().len(), 0, "stop forgets the array");
    assert!(srv.status()["volumes"].as_array().unwrap().is_empty());
}

/// `grow --level` through the CLI: raid5 -> raid6 is refused without `--layout preserve` (and
/// says why), then takes the added member for Q, which is recovered; the data reads back over
/// NBD, check finds 0 mismatches, the service restarts into a raid6 with the added member, and
/// raid6 -> raid5 leaves that member a spare; then `grow --chunk` restripes it (bad values
/// refused first).
#[test]
fn level_change_through_the_cli() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let members: Vec<String> = (0..4).map(|i| srv.path(&format!("lv-{i}.img")).display().to_string()).collect();
    let mut args = vec!["create", "lv", "--level", "raid5", "--raid-devices", "3", "--chunk", "64K"];
    args.extend(["--member-size", "32M", "--assume-clean", "--export", "lv"]);
    args.extend(members[..3].iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    let data = pattern(3, 8 << 20);
    nbd_write(&srv, "lv", &data);
    let err = mdkit_err(&srv, &["grow", "lv", "--level", "raid6"]);
    assert!(err.contains("pass --layout preserve"), "{err}");
    std::fs::File::create(&members[3]).unwrap().set_len(32 << 20).unwrap();
    mdkit_ok(&srv, &["attr", "lv", "sync_speed_min=1000000"]);
    let out = mdkit_ok(&srv, &["grow", "lv", "--level", "raid6", "--layout", "preserve", "--add", &members[3]]);
    assert!(out.contains("level raid5 -> raid6, layout left-symmetric-6, chunk 64 KiB, raid-devices 3 -> 4"), "{out}");
    let d = wait_settled(&srv, "lv");
    assert_eq!((d["level"].as_str(), d["raid_disks"].as_u64()), (Some("raid6"), Some(4)), "{d:#}");
    assert_eq!(check(&srv, "lv"), 0);
    assert_eq!(nbd_read(&srv, "lv", data.len()), data);
    let srv = restart(srv);
    let d = detail(&srv, "lv");
    assert_eq!((d["level"].as_str(), d["degraded"].as_u64()), (Some("raid6"), Some(0)), "{d:#}");
    let out = mdkit_ok(&srv, &["grow", "lv", "--level", "5"]);
    assert!(out.contains("level raid6 -> raid5, layout left-symmetric"), "{out}");
    let d = detail(&srv, "lv");
    let spare = d["members"].as_array().unwrap().iter().find(|m| m["name"] == "lv-3.img").cloned();
    assert_eq!(spare.map(|m| m["state"][0].clone()), Some(Value::from("spare")), "{d:#}");
    assert_eq!(nbd_read(&srv, "lv", data.len()), data);
    // A restripe over the same members (`--chunk`): bad values are refused by name and change
    // nothing; a good one runs in the background and the array is assembled again with it.
    for (bad, says) in [("48", "power of 2"), ("abc", "--chunk"), ("0", "whole number of KiB")] {
        let err = mdkit_err(&srv, &["grow", "lv", "--chunk", bad]);
        assert!(err.contains(says), "--chunk {bad}: {err}");
    }
    let err = mdkit_err(&srv, &["grow", "lv", "--layout", "sideways"]);
    assert!(err.contains("--layout"), "{err}");
    let err = mdkit_err(&srv, &["grow", "lv", "--chunk", "128", "--size", "max"]);
    assert!(err.contains("one of"), "{err}");
    assert_eq!(detail(&srv, "lv")["chunk_kib"], 64);
    let out = mdkit_ok(&srv, &["grow", "lv", "--chunk", "128"]);
    assert!(out.contains("reshape chunk 64 -> 128 KiB started"), "{out}");
    let t = Instant::now();
    while detail(&srv, "lv")["chunk_kib"] != 128 || detail(&srv, "lv")["sync"]["action"] != "idle" {
        assert!(t.elapsed() < Duration::from_secs(120), "the restripe did not finish: {:#}", detail(&srv, "lv"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(nbd_read(&srv, "lv", data.len()), data);
    assert_eq!(check(&srv, "lv"), 0);
}

/// A reshape to fewer members through the CLI: refused until the array is cut (the refusal
/// names the size and changes nothing), a bad `--array-size` is refused, the cut and the
/// reshape run, the data read over NBD is intact, check finds 0 mismatches, the member left
/// over is a spare, and the service restarts into the smaller array.
#[test]
fn fewer_members_through_the_cli() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let members: Vec<String> = (0..4).map(|i| srv.path(&format!("sh-{i}.img")).display().to_string()).collect();
    let mut args = vec!["create", "sh", "--level", "raid5", "--raid-devices", "4", "--chunk", "64K"];
    args.extend(["--member-size", "32M", "--assume-clean", "--export", "sh"]);
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    let data = pattern(5, 8 << 20);
    nbd_write(&srv, "sh", &data);
    let before = detail(&srv, "sh")["size_bytes"].as_u64().unwrap();
    let err = mdkit_err(&srv, &["grow", "sh", "--raid-devices", "3"]);
    assert!(err.contains("cut it first with grow --array-size"), "{err}");
    let kib: String = err.split("--array-size ").nth(1).unwrap().chars().take_while(char::is_ascii_digit).collect();
    assert_eq!(detail(&srv, "sh")["raid_disks"], 4, "the refusal changed nothing");
    for bad in ["0", "3", "99G"] {
        let err = mdkit_err(&srv, &["grow", "sh", "--array-size", bad]);
        assert!(err.contains("array size"), "--array-size {bad}: {err}");
    }
    let out = mdkit_ok(&srv, &["grow", "sh", "--array-size", &format!("{kib}K")]);
    assert!(out.contains(&format!("array size {} KiB -> {kib} KiB", before / 1024)), "{out}");
    assert_eq!(mdkit_ok(&srv, &["attr", "sh", "array_size"]).trim(), kib);
    mdkit_ok(&srv, &["attr", "sh", "sync_speed_min=1000000"]);
    let out = mdkit_ok(&srv, &["grow", "sh", "--raid-devices", "3"]);
    assert!(out.contains("reshape 4 -> 3 members started (data offset moves up"), "{out}");
    let t = Instant::now();
    while detail(&srv, "sh")["raid_disks"] != 3 || detail(&srv, "sh")["sync"]["action"] != "idle" {
        assert!(t.elapsed() < Duration::from_secs(120), "the reshape did not finish: {:#}", detail(&srv, "sh"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(nbd_read(&srv, "sh", data.len()), data);
    assert_eq!(check(&srv, "sh"), 0);
    let d = detail(&srv, "sh");
    let spare = d["members"].as_array().unwrap().iter().find(|m| m["name"] == "sh-3.img").cloned();
    assert_eq!(spare.map(|m| m["state"][0].clone()), Some(Value::from("spare")), "{d:#}");
    let srv = restart(srv);
    let d = detail(&srv, "sh");
    assert_eq!(
        (d["raid_disks"].as_u64(), d["size_bytes"].as_u64()),
        (Some(3), Some(kib.parse::<u64>().unwrap() * 1024))
    );
    assert_eq!(nbd_read(&srv, "sh", data.len()), data);
}

/// raid0 onto more members through the CLI (mdadm's path: raid4 with the parity role empty,
/// restripe, raid0 again): the array serves throughout, ends as raid0 on 4 members with 4/3 of
/// the size, and says so again after a restart.
#[test]
fn raid0_more_members_through_the_cli() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let members: Vec<String> = (0..4).map(|i| srv.path(&format!("r0-{i}.img")).display().to_string()).collect();
    let mut args = vec!["create", "r0", "--level", "raid0", "--raid-devices", "3", "--chunk", "64K"];
    args.extend(["--member-size", "32M", "--export", "r0"]);
    args.extend(members[..3].iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    let data = pattern(9, 8 << 20);
    nbd_write(&srv, "r0", &data);
    let before = detail(&srv, "r0")["size_bytes"].as_u64().unwrap();
    let err = mdkit_err(&srv, &["grow", "r0", "--raid-devices", "4"]);
    assert!(err.contains("give exactly 1 new device(s) with --add"), "{err}");
    assert_eq!(detail(&srv, "r0")["level"], "raid0", "the refusal changed nothing: {:#}", detail(&srv, "r0"));
    std::fs::File::create(&members[3]).unwrap().set_len(32 << 20).unwrap();
    let out = mdkit_ok(&srv, &["grow", "r0", "--raid-devices", "4", "--add", &members[3]]);
    assert!(out.contains("raid0 -> raid4 (parity role empty), reshape 4 -> 5 members started"), "{out}");
    let t = Instant::now();
    while detail(&srv, "r0")["level"] != "raid0" || detail(&srv, "r0")["raid_disks"] != 4 {
        assert!(t.elapsed() < Duration::from_secs(120), "the restripe did not finish: {:#}", detail(&srv, "r0"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(detail(&srv, "r0")["size_bytes"].as_u64().unwrap(), before / 3 * 4);
    assert_eq!(nbd_read(&srv, "r0", data.len()), data);
    let srv = restart(srv);
    let d = detail(&srv, "r0");
    assert_eq!((d["level"].as_str(), d["raid_disks"].as_u64()), (Some("raid0"), Some(4)), "{d:#}");
    assert_eq!(nbd_read(&srv, "r0", data.len()), data);
    // Restarted in the middle of the next one (4 -> 5, throttled), it still ends as raid0: the
    // level to go back to is kept beside the array in md-arrays.json until it is reached.
    let fifth = srv.path("r0-4.img").display().to_string();
    std::fs::File::create(&fifth).unwrap().set_len(32 << 20).unwrap();
    mdkit_ok(&srv, &["attr", "r0", "sync_speed_max=1000"]);
    mdkit_ok(&srv, &["grow", "r0", "--raid-devices", "5", "--add", &fifth]);
    let state = || std::fs::read_to_string(srv.path("md-arrays.json")).unwrap();
    assert!(state().contains(r#""then_level": "raid0""#), "{}", state());
    assert_eq!(detail(&srv, "r0")["level"], "raid4", "reshaping as raid4");
    let srv = restart(srv);
    assert_eq!(detail(&srv, "r0")["sync"]["action"], "reshape", "{:#}", detail(&srv, "r0"));
    let t = Instant::now();
    while detail(&srv, "r0")["level"] != "raid0" {
        assert!(t.elapsed() < Duration::from_secs(120), "not back to raid0: {:#}", detail(&srv, "r0"));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(detail(&srv, "r0")["raid_disks"], 5);
    assert_eq!(nbd_read(&srv, "r0", data.len()), data);
    let t = Instant::now();
    while std::fs::read_to_string(srv.path("md-arrays.json")).unwrap().contains("then_level") {
        assert!(t.elapsed() < Duration::from_secs(30), "then_level not forgotten");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn offline_create_examine_then_assemble() {
    let srv = Server::start("");
    let dir = srv.dir.path();
    let members: Vec<String> = (0..2).map(|i| dir.join(format!("off-{i}.img")).display().to_string()).collect();
    // No service behind this socket: superblocks only.
    let out = run(Command::new(MDKIT)
        .args(["create", "off", "--level", "1", "--member-size", "16M", "--socket", "/nonexistent/mdkit.sock"])
        .args(&members));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("wrote 2 superblocks"), "{text}");
    let ex = String::from_utf8(run(Command::new(MDKIT).arg("examine").arg(&members[0])).stdout).unwrap();
    assert!(
        ex.contains("Raid Level : raid1") && ex.contains("- correct") && ex.contains("Device Role : Active device 0"),
        "{ex}"
    );
    let json: Value =
        serde_json::from_slice(&run(Command::new(MDKIT).args(["examine", "--json"]).arg(&members[1])).stdout).unwrap();
    assert_eq!(json["device"], members[1].as_str());
    assert_eq!(json["bad_blocks"], serde_json::json!([]));
    let bb =
        String::from_utf8(run(Command::new(MDKIT).args(["examine", "--badblocks"]).arg(&members[0])).stdout).unwrap();
    assert_eq!(bb, format!("Bad-blocks list is empty in {}\n", members[0]));
    if Command::new("mdadm").arg("--version").output().is_ok() {
        let m = run(Command::new("mdadm").arg("--examine").arg(&members[1]).env("TZ", "UTC"));
        let m = String::from_utf8_lossy(&m.stdout);
        assert!(m.contains("Raid Level : raid1") && m.contains("correct"), "{m}");
        let m = run(Command::new("mdadm").arg("--examine-badblocks").arg(&members[0]));
        assert_eq!(String::from_utf8_lossy(&m.stdout), bb, "mdadm --examine-badblocks agrees");
    }
    // Not an md member.
    let blank = dir.join("blank.img");
    std::fs::write(&blank, vec![0u8; 1 << 20]).unwrap();
    let out = Command::new(MDKIT).arg("examine").arg(&blank).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No md superblock detected"));
    let mut args = vec!["assemble", "off"];
    args.extend(members.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    let d = detail(&srv, "off");
    assert_eq!(d["level"], "raid1");
    assert_eq!(d["consistency_policy"], "bitmap");
    assert_eq!(d["members"][0]["bad_blocks"], 0, "{d}");
}

#[test]
fn bad_md_requests_get_clear_errors() {
    let srv = Server::start("");
    let m: Vec<String> = (0..2).map(|i| srv.path(&format!("b-{i}.img")).display().to_string()).collect();
    let err = |args: &[&str]| {
        let out = mdkit(&srv, args);
        assert!(!out.status.success(), "mdkit {args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = err(&["create", "x", "--level", "raid7", "--member-size", "16M", &m[0], &m[1]]);
    assert!(e.contains("raid7"), "{e}");
    let e = err(&["create", "x", "--level", "raid1", &m[0], &m[1]]);
    assert!(e.contains("does not exist"), "{e}");
    mdkit_ok(&srv, &["create", "x", "--level", "raid1", "--member-size", "16M", &m[0], &m[1]]);
    mdkit_ok(&srv, &["stop", "x"]);
    let e = err(&["create", "y", "--level", "raid1", &m[0], &m[1]]);
    assert!(e.contains("already holds an md superblock") && e.contains("--force"), "{e}");
    let e = err(&["stop", "nosuch"]);
    assert!(e.contains("no volume named \"nosuch\""), "{e}");
    let e = err(&["create", "z", "--level", "linear", "--member-size", "16M", "--force", &m[0], &m[1]]);
    assert!(e.contains("linear"), "{e}");
    assert!(Path::new(&m[0]).exists());
}
