//! Acceptance (issue 15, items 2 and 3) with the real binary: damaged members given to
//! `mdkit assemble` in a running `mdkit serve`, and to a config `kind = "md"` volume.
//!
//! - without `--run` assembly refuses and names the member and the field; with `--run` the
//!   array starts degraded, the CLI output (and `detail`) names the member left out and why;
//! - the refused member is byte-identical after the array ran and stopped; the healthy members
//!   carry a valid superblock; another array of the service keeps serving throughout;
//! - a member left out (damaged, or stale) can be added back with `manage --add` / `--re-add`.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{MDKIT, Server, mdkit, mdkit_ok, nbd_read, pattern, require_tool, run, sha256};
use mdkit_md::format::superblock::Superblock;
use serde_json::Value;

const KEEP_VOLUME: &str = r#"
[[volume]]
name = "keep"
kind = "md"
members = ["keep-a.img", "keep-b.img"]
member_size = "16MiB"
create = true
level = "raid1"
[[export]]
name = "keep"
volume = "keep"
"#;

fn detail(srv: &Server, name: &str) -> Value {
    serde_json::from_str(&mdkit_ok(srv, &["detail", name, "--json"])).unwrap()
}

fn nbd_write(srv: &Server, export: &str, data: &[u8]) {
    let f = srv.path(&format!("{export}.src"));
    std::fs::write(&f, data).unwrap();
    run(Command::new("nbdcopy").arg(&f).arg(srv.uri(export)));
}

fn wait_not_degraded(srv: &Server, name: &str) {
    let t = Instant::now();
    loop {
        let d = detail(srv, name);
        if d["sync"]["action"] == "idle" && d["degraded"] == 0 {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "{name} did not recover: {d:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes `members` as a new array with the offline `mdkit create` (no service behind the
/// socket given).
fn create_offline(name: &str, level: &str, members: &[PathBuf]) {
    let mut cmd = Command::new(MDKIT);
    cmd.args(["create", name, "--level", level, "--member-size", "8M"]);
    if level != "raid1" {
        cmd.args(["--chunk", "64"]);
    }
    cmd.args(["--socket", "/nonexistent/mdkit.sock"]).args(members);
    run(&mut cmd);
}

/// Rewrites a member's 1.2 superblock with `edit` applied (checksum recomputed, or left stale
/// when `reseal` is false).
fn edit_superblock(path: &Path, edit: fn(&mut Superblock), reseal: bool) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut block = vec![0u8; 4096];
    f.read_exact_at(&mut block, 4096).unwrap();
    let mut sb = Superblock::decode(&block, 8).unwrap();
    let csum = sb.sb_csum;
    edit(&mut sb);
    let mut out = sb.encode_unchecked();
    if !reseal {
        out[216..220].copy_from_slice(&csum.to_le_bytes());
    }
    f.write_all_at(&out, 4096).unwrap();
}

/// Overwrites the bitmap superblock's `chunksize` of a member.
fn zero_bitmap_chunk(path: &Path) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut block = vec![0u8; 4096];
    f.read_exact_at(&mut block, 4096).unwrap();
    let sb = Superblock::decode(&block, 8).unwrap();
    let at = sb.bitmap_sector().unwrap() * 512 + mdkit_md::format::bitmap::off::CHUNKSIZE as u64;
    f.write_all_at(&[0u8; 4], at).unwrap();
}

type Corrupt = fn(&Path);

fn corruptions() -> Vec<(&'static str, &'static str, Corrupt)> {
    vec![
        ("dev_number all ones", "dev_number", |p| edit_superblock(p, |s| s.dev_number = u32::MAX, true)),
        ("raid_disks huge", "raid_disks", |p| edit_superblock(p, |s| s.raid_disks = 0x7fff_ffff, true)),
        ("chunk differs", "chunksize", |p| edit_superblock(p, |s| s.chunk_sectors *= 2, true)),
        ("bad checksum", "checksum", |p| edit_superblock(p, |s| s.events += 7, false)),
        ("bitmap chunk zero", "chunksize", zero_bitmap_chunk),
    ]
}

fn paths(srv: &Server, prefix: &str, n: usize) -> Vec<PathBuf> {
    (0..n).map(|i| srv.path(&format!("{prefix}-{i}.img"))).collect()
}

fn strs(p: &[PathBuf]) -> Vec<&str> {
    p.iter().map(|p| p.to_str().unwrap()).collect()
}

#[test]
fn assemble_names_left_out_members_and_never_writes_them() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start(KEEP_VOLUME);
    let keep_data = pattern(7, 1 << 20);
    nbd_write(&srv, "keep", &keep_data);
    // A raid5 with data on it, stopped cleanly: the pristine members every case copies.
    let pristine = paths(&srv, "p", 4);
    create_offline("p", "raid5", &pristine);
    let mut args = vec!["assemble", "p", "--export", "p"];
    args.extend(strs(&pristine));
    mdkit_ok(&srv, &args);
    let data = pattern(8, 3 << 20);
    nbd_write(&srv, "p", &data);
    mdkit_ok(&srv, &["stop", "p"]);
    let out = run(Command::new(MDKIT).args(["examine", "--json"]).arg(&pristine[1]));
    let pristine_events = serde_json::from_slice::<Value>(&out.stdout).unwrap()["events"].as_u64().unwrap();

    for (k, (what, field, corrupt)) in corruptions().into_iter().enumerate() {
        let name = format!("c{k}");
        let ms = paths(&srv, &name, 4);
        for (from, to) in pristine.iter().zip(&ms) {
            std::fs::copy(from, to).unwrap();
        }
        corrupt(&ms[0]);
        let victim_sha = sha256(&ms[0]);
        let victim = format!("{name}-0.img");
        let mut args = vec!["assemble", name.as_str()];
        args.extend(strs(&ms));
        let out = mdkit(&srv, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: started without --run");
        assert!(err.contains(&victim) && err.contains(field) && err.contains("--run"), "{what}: {err}");
        args.extend(["--run", "--export", name.as_str()]);
        let out = mdkit(&srv, &args);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{what}: {stdout}{stderr}\n{}", srv.log_text());
        assert!(stderr.contains(&format!("member {victim} left out: ")) && stderr.contains(field), "{what}: {stderr}");
        assert!(stdout.contains("left out") && stdout.contains(&victim), "{what}: {stdout}");
        let d = detail(&srv, &name);
        assert_eq!(d["left_out"][0]["member"], victim.as_str(), "{what}: {d:#}");
        assert_eq!(d["degraded"], 1, "{what}");
        assert_eq!(nbd_read(&srv, &name, data.len()), data, "{what}: data");
        mdkit_ok(&srv, &["stop", &name]);
        assert_eq!(sha256(&ms[0]), victim_sha, "{what}: the left-out member was written to");
        // The healthy members: valid, and all at the same (newer) event count, none stale.
        let events: Vec<u64> = ms[1..]
            .iter()
            .map(|m| {
                let out = run(Command::new(MDKIT).args(["examine", "--json"]).arg(m));
                serde_json::from_slice::<Value>(&out.stdout).unwrap()["events"].as_u64().unwrap()
            })
            .collect();
        assert!(events.windows(2).all(|w| w[0] == w[1]) && events[0] > pristine_events, "{what}: {events:?}");
    }
    assert_eq!(nbd_read(&srv, "keep", keep_data.len()), keep_data, "the other array kept serving");

    // A damaged member left out can be added back (full rebuild).
    let ms = paths(&srv, "c4", 4);
    let mut args = vec!["assemble", "back", "--run"];
    args.extend(strs(&ms));
    mdkit_ok(&srv, &args);
    mdkit_ok(&srv, &["attr", "back", "sync_speed_min=1000000"]);
    mdkit_ok(&srv, &["manage", "back", "--add", ms[0].to_str().unwrap()]);
    wait_not_degraded(&srv, "back");
    assert_eq!(detail(&srv, "back")["left_out"], Value::Array(vec![]));
    mdkit_ok(&srv, &["stop", "back"]);
}

#[test]
fn stale_member_left_out_then_re_added() {
    require_tool("nbdcopy", "libnbd-bin");
    let srv = Server::start("");
    let ms = paths(&srv, "s", 4);
    create_offline("s", "raid5", &ms);
    // Run without member 3 (needs --run: all four were active) and write: member 3 is stale.
    let mut args = vec!["assemble", "s", "--export", "s"];
    args.extend(strs(&ms[..3]));
    let out = mdkit(&srv, &args);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--run"));
    args.push("--run");
    mdkit_ok(&srv, &args);
    let data = pattern(9, 2 << 20);
    nbd_write(&srv, "s", &data);
    mdkit_ok(&srv, &["stop", "s"]);
    // All four: the three that were active suffice without --run; member 3 is left out.
    let mut args = vec!["assemble", "s", "--export", "s"];
    args.extend(strs(&ms));
    let out = mdkit(&srv, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("member s-3.img left out: stale"), "{stderr}");
    mdkit_ok(&srv, &["attr", "s", "sync_speed_min=1000000"]);
    let out = mdkit_ok(&srv, &["manage", "s", "--re-add", ms[3].to_str().unwrap()]);
    assert!(!out.contains("left out"), "{out}");
    wait_not_degraded(&srv, "s");
    assert_eq!(nbd_read(&srv, "s", data.len()), data);
    mdkit_ok(&srv, &["stop", "s"]);
}

#[test]
fn config_volume_starts_without_the_damaged_member() {
    require_tool("nbdcopy", "libnbd-bin");
    let base = if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in(base).unwrap();
    let ms: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("cfg-{i}.img"))).collect();
    create_offline("cfg", "raid1", &ms);
    edit_superblock(&ms[0], |s| s.raid_disks = 0x7fff_ffff, true);
    let victim_sha = sha256(&ms[0]);
    let config = format!(
        "data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\", \"unix:nbd.sock\"]\n{KEEP_VOLUME}\n{}",
        dir.path().display(),
        r#"
[[volume]]
name = "cfg"
kind = "md"
members = ["cfg-0.img", "cfg-1.img", "cfg-2.img"]
[[export]]
name = "cfg"
volume = "cfg"
"#
    );
    let config_path = dir.path().join("mdkit.toml");
    std::fs::write(&config_path, config).unwrap();
    let mut srv = Server::start_with_config(dir, config_path);
    let d = detail(&srv, "cfg");
    assert_eq!(d["left_out"][0]["member"], "cfg-0.img", "{d:#}");
    assert!(d["left_out"][0]["reason"].as_str().unwrap().contains("raid_disks"), "{d:#}");
    let text = mdkit_ok(&srv, &["detail", "cfg"]);
    assert!(text.contains("left out") && text.contains("cfg-0.img: "), "{text}");
    let data = pattern(10, 1 << 20);
    nbd_write(&srv, "cfg", &data);
    assert_eq!(nbd_read(&srv, "cfg", data.len()), data);
    nbd_write(&srv, "keep", &data);
    assert_eq!(nbd_read(&srv, "keep", data.len()), data);
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    assert_eq!(sha256(&ms[0]), victim_sha, "the left-out member was written to");
}
