//! mdadm / md parity of the md verbs, end to end with the real binary:
//! - `create --bitmap-chunk` (mdadm's units) and the `bitmap_chunk` config key give the array
//!   that bitmap chunk, as `mdadm --examine-bitmap` reads it; bad sizes are refused;
//! - `--chunk` on raid1 is ignored with a warning (not an error);
//! - `attr NAME sync_action=VALUE` prints the new value; a recovery reads `recover` from the
//!   `manage --add` on; `last_sync_action` names the last action; raid0 refuses `check`.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, mdkit, mdkit_ok, require_tool, run};

const HANG_GUARD: Duration = Duration::from_secs(120);

fn members(srv: &Server, prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| srv.path(&format!("{prefix}-{i}.img")).display().to_string()).collect()
}

/// `mdadm --examine-bitmap` of a member: its "Chunksize : N UNIT" line. Through a read-only
/// loop device: mdadm 4.2 cannot find an internal bitmap on a plain file.
fn mdadm_bitmap_chunksize(member: &str) -> String {
    require_tool("mdadm", "mdadm");
    require_tool("losetup", "mount");
    let out = run(Command::new("losetup").args(["--read-only", "--find", "--show", member]));
    let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let x = Command::new("mdadm").args(["--examine-bitmap", &loopdev]).output().expect("run mdadm");
    let detached = Command::new("losetup").args(["-d", &loopdev]).status().is_ok_and(|s| s.success());
    let text = String::from_utf8_lossy(&x.stdout).into_owned();
    assert!(x.status.success(), "mdadm -X {member}: {text}{}", String::from_utf8_lossy(&x.stderr));
    assert!(detached, "losetup -d {loopdev} failed");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("Chunksize : "))
        .unwrap_or_else(|| panic!("no Chunksize in mdadm -X {member}:\n{text}"))
        .to_string()
}

fn attr(srv: &Server, name: &str, key: &str) -> String {
    mdkit_ok(srv, &["attr", name, key]).trim().to_string()
}

/// Polls an attribute until it reads `want` (a hang guard, not a timing assertion).
fn wait_attr(srv: &Server, name: &str, key: &str, want: &str) {
    let t = Instant::now();
    while attr(srv, name, key) != want {
        assert!(t.elapsed() < HANG_GUARD, "{name} {key} never became {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn create_takes_bitmap_chunk_and_ignores_chunk_on_raid1() {
    let srv = Server::start("");
    let m = members(&srv, "r1", 2);
    let mut args = vec!["create", "r1", "--level", "raid1", "--chunk", "64K", "--bitmap-chunk", "4M"];
    args.extend(["--member-size", "32M"]);
    args.extend(m.iter().map(String::as_str));
    let out = mdkit(&srv, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "create failed: {stderr}");
    assert!(stderr.contains("--chunk not meaningful with raid1 level"), "{stderr}");
    assert_eq!(attr(&srv, "r1", "bitmap/chunksize"), (4u32 << 20).to_string());
    assert_eq!(attr(&srv, "r1", "chunk_size"), "0");
    mdkit_ok(&srv, &["stop", "r1"]);
    assert_eq!(mdadm_bitmap_chunksize(&m[0]), "4 MB");

    // Offline (no service): a plain number is KiB, as in mdadm.
    let m5 = members(&srv, "r5", 3);
    let mut args = vec!["create", "r5", "--level", "5", "--bitmap-chunk", "512", "--member-size", "16M"];
    args.extend(["--socket", "/nonexistent/mdkit.sock"]);
    args.extend(m5.iter().map(String::as_str));
    run(Command::new(common::MDKIT).args(&args));
    assert_eq!(mdadm_bitmap_chunksize(&m5[1]), "512 KB");

    for (bad, why) in [("48K", "not a power of two"), ("4T", "above the 2 GiB"), ("1.5M", "invalid bitmap chunksize")] {
        let m = members(&srv, &format!("bad{}", bad.len()), 2);
        let mut args = vec!["create", "bad", "--level", "1", "--bitmap-chunk", bad, "--member-size", "16M"];
        args.extend(m.iter().map(String::as_str));
        let out = mdkit(&srv, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(why), "--bitmap-chunk {bad}: {stderr}");
    }
    let mut args = vec!["create", "bad", "--level", "1", "--bitmap", "none", "--bitmap-chunk", "4M"];
    args.extend(["--member-size", "16M"]);
    args.extend(m.iter().map(String::as_str));
    args.push("--force");
    let out = mdkit(&srv, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("no write-intent bitmap"), "{stderr}");
}

const BITMAP_CHUNK_VOLUME: &str = r#"
[[volume]]
name = "cfg"
kind = "md"
members = ["cfg-a.img", "cfg-b.img", "cfg-c.img"]
member_size = "32MiB"
create = true
level = "raid5"
bitmap_chunk = "2MiB"
"#;

#[test]
fn config_bitmap_chunk_creates_the_array_with_it() {
    let srv = Server::start(BITMAP_CHUNK_VOLUME);
    assert_eq!(attr(&srv, "cfg", "bitmap/chunksize"), (2u32 << 20).to_string());
    assert_eq!(mdadm_bitmap_chunksize(&srv.path("cfg-b.img").display().to_string()), "2 MB");
}

#[test]
fn attr_prints_the_new_sync_action_and_levels_follow_the_kernel() {
    let srv = Server::start("");
    let m = members(&srv, "a", 3);
    let mut args = vec!["create", "a", "--level", "raid1", "--raid-devices", "2", "--member-size", "32M"];
    args.extend(m[..2].iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    assert_eq!(attr(&srv, "a", "last_sync_action"), "idle");
    // 1 KiB/s: a started check or recovery cannot finish during the test.
    mdkit_ok(&srv, &["attr", "a", "sync_speed_max=1"]);
    assert_eq!(mdkit_ok(&srv, &["attr", "a", "sync_action=check"]).trim(), "check");
    wait_attr(&srv, "a", "last_sync_action", "check");
    assert_eq!(mdkit_ok(&srv, &["attr", "a", "sync_action=idle"]).trim(), "idle");
    assert_eq!(mdkit_ok(&srv, &["attr", "a", "sync_action=frozen"]).trim(), "frozen");
    assert_eq!(mdkit_ok(&srv, &["attr", "a", "sync_action=idle"]).trim(), "idle", "idle unfreezes, as md");
    assert_eq!(mdkit_ok(&srv, &["attr", "a", "sync_action=recover"]).trim(), "idle", "nothing to recover");
    // A spare added to the degraded array: `recover` from the add on.
    mdkit_ok(&srv, &["manage", "a", "--fail", "a-1.img"]);
    mdkit_ok(&srv, &["manage", "a", "--remove", "a-1.img"]);
    assert_eq!(attr(&srv, "a", "sync_action"), "idle");
    mdkit_ok(&srv, &["manage", "a", "--add", &m[2], "--member-size", "32M"]);
    assert_eq!(attr(&srv, "a", "sync_action"), "recover");
    wait_attr(&srv, "a", "last_sync_action", "recover");
    mdkit_ok(&srv, &["attr", "a", "sync_speed_max=system"]);
    wait_attr(&srv, "a", "sync_action", "idle");
    assert_eq!(attr(&srv, "a", "degraded"), "0");

    let r0 = members(&srv, "z", 2);
    let mut args = vec!["create", "z", "--level", "raid0", "--member-size", "16M"];
    args.extend(r0.iter().map(String::as_str));
    mdkit_ok(&srv, &args);
    let out = mdkit(&srv, &["attr", "z", "sync_action=check"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("raid0 has no redundancy"), "{stderr}");
    assert_eq!(attr(&srv, "z", "sync_action"), "idle");
}
