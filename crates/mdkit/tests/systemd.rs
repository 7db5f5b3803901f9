//! Running under systemd: the shipped unit (contrib/systemd/mdkit.service) passes
//! `systemd-analyze verify` and keeps io_uring allowed; `mdkit serve` speaks sd_notify
//! (READY=1 once it serves, STOPPING=1 on SIGTERM) to the socket in $NOTIFY_SOCKET.

use crate::common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const UNIT: &str = include_str!("../../../contrib/systemd/mdkit.service");

fn unit_values(key: &str) -> Vec<&'static str> {
    UNIT.lines().filter_map(|l| l.strip_prefix(key)?.strip_prefix('=')).collect()
}

#[test]
fn unit_is_notify_and_keeps_io_uring_allowed() {
    assert_eq!(unit_values("Type"), ["notify"]);
    let allowed: Vec<&str> = unit_values("SystemCallFilter").iter().flat_map(|v| v.split_whitespace()).collect();
    for syscall in ["io_uring_setup", "io_uring_enter", "io_uring_register"] {
        assert!(allowed.contains(&syscall), "SystemCallFilter blocks {syscall}: {allowed:?}");
    }
    assert_eq!(unit_values("ReadWritePaths"), ["/var/lib/mdkit"]);
    assert_eq!(unit_values("ProtectSystem"), ["strict"]);
}

#[test]
fn unit_passes_systemd_analyze_verify() {
    if !Path::new("/usr/bin/systemd-analyze").exists() {
        eprintln!("SKIP: systemd-analyze not installed (Debian package `systemd`)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // verify checks that ExecStart is executable: point it at the binary under test.
    let unit = dir.path().join("mdkit.service");
    std::fs::write(&unit, UNIT.replace("/usr/local/bin/mdkit", MDKIT)).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&unit).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Unknown keys and bad values are only warnings (exit 0): any output is a failure.
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {}\n{stderr}", out.status);
}

fn recv_text(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).expect("no sd_notify message within the hang guard");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn serve_notifies_ready_then_stopping_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let config = dir.path().join("mdkit.toml");
    let body = "[nbd]\nlisten = [\"127.0.0.1:0\"]\n[[volume]]\nname = \"m\"\nkind = \"mem\"\nsize = \"16MiB\"\n\
                [[export]]\nname = \"m\"\nvolume = \"m\"\n";
    std::fs::write(&config, format!("data_dir = \"{}\"\n{body}", dir.path().display())).unwrap();
    let log = dir.path().join("mdkit.log");
    let mut child = Command::new(MDKIT)
        .args(["serve", "--config"])
        .arg(&config)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("JOURNAL_STREAM", "8:12345")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let ready = recv_text(&sock);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(ready.lines().any(|l| l.starts_with("STATUS=serving 1 exports")), "{ready:?}");
    // READY means serving: the control socket answers at once.
    let status = Command::new(MDKIT).args(["status", "--json", "--socket"]).arg(dir.path().join("mdkit.sock")).output();
    assert!(status.unwrap().status.success(), "control socket not up at READY=1");

    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let stopping = recv_text(&sock);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
    let exit = child.wait().unwrap();
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert!(exit.success(), "{exit}\n{log_text}");
    assert!(!log_text.contains('\u{1b}'), "ANSI escapes in a journald log:\n{log_text}");
}
