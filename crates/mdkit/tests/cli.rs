//! The `mdkit` command line: default config, status output, config errors.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{MDKIT, Server, run};

#[test]
fn print_default_config_is_a_valid_config_with_the_default_export() {
    let out = run(Command::new(MDKIT).args(["serve", "--print-default-config"]));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("[[volume]]") && text.contains("name = \"default\""), "{text}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, &text).unwrap();
    let out = run(Command::new(MDKIT)
        .args(["serve", "--check-config", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.path()));
    let check = String::from_utf8(out.stdout).unwrap();
    assert!(check.contains("volume: md0 (kind md)") && check.contains("export: default -> volume md0"), "{check}");
    assert!(check.contains("listen: 127.0.0.1:10809"), "{check}");
}

#[test]
fn embedded_default_creates_its_member_file_and_serves_status() {
    let dir = tempfile::Builder::new().prefix("mdkit-default-").tempdir_in("/var/tmp").unwrap();
    // The data directory comes from the environment here (MDKIT_DATA_DIR), the port from --listen.
    let data = dir.path().join("data");
    let mut child = Command::new(MDKIT)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("MDKIT_DATA_DIR", &data)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let sock = data.join("mdkit.sock");
    let start = std::time::Instant::now();
    let status = loop {
        let out = Command::new(MDKIT).args(["status"]).env("MDKIT_DATA_DIR", &data).output().unwrap();
        if out.status.success() {
            break String::from_utf8(out.stdout).unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "not ready: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(sock.exists());
    assert!(status.contains("md0") && status.contains(" md ") && status.contains("default"), "{status}");
    for m in ["md0-0.img", "md0-1.img"] {
        let meta = std::fs::metadata(data.join(m)).unwrap();
        assert_eq!(meta.len(), 1 << 30);
        assert!(std::os::unix::fs::MetadataExt::blocks(&meta) < 4096, "member file {m} must stay sparse");
    }
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}

#[test]
fn status_json_has_volumes_exports_listeners_and_counters() {
    let srv = Server::start(
        "[[volume]]\nname = \"ram\"\nkind = \"mem\"\nsize = \"8MiB\"\n[[export]]\nname = \"r\"\nvolume = \"ram\"\n",
    );
    let mut c = common::raw::Raw::open(&srv.tcp, "r", false, false);
    assert_eq!(c.write(1, 0, &[7; 8192]), 0);
    assert!(c.read(2, 0, 4096).is_ok());
    let st = srv.status();
    assert_eq!(st["volumes"][0]["kind"], "mem");
    assert_eq!(st["volumes"][0]["size_bytes"], 8 << 20);
    assert_eq!(st["volumes"][0]["state"], "active");
    assert_eq!(st["exports"][0]["volume"], "ram");
    assert_eq!(st["default_export"], "r", "a single export is the default");
    assert_eq!(st["connections"], 1);
    let s = &st["exports"][0]["stats"];
    assert_eq!((s["writes"].as_u64(), s["written_bytes"].as_u64()), (Some(1), Some(8192)), "{s}");
    assert_eq!((s["reads"].as_u64(), s["read_bytes"].as_u64()), (Some(1), Some(4096)), "{s}");
    assert_eq!(s["in_flight"], 0);
    assert_eq!(st["listeners"].as_array().unwrap().len(), 2);
    // The control protocol itself: JSON lines; unknown commands and oversized or malformed
    // requests get an error, and the connection keeps working after an error.
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(&srv.control).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut ask = |line: &[u8]| -> serde_json::Value {
        s.write_all(line).unwrap();
        let mut resp = String::new();
        r.read_line(&mut resp).unwrap();
        serde_json::from_str(&resp).unwrap_or_else(|e| panic!("{e}: {resp:?}"))
    };
    let v = ask(b"{\"cmd\":\"bogus\"}\n");
    assert_eq!(v["ok"], false);
    let err = v["error"].as_str().unwrap();
    assert!(err.contains("unknown command \"bogus\"") && err.contains("status"), "{err}");
    let v = ask(b"not json\n");
    assert!(v["error"].as_str().unwrap().contains("malformed request"), "{v}");
    let v = ask(b"{\"cmd\":\"help\"}\n");
    assert!(v["result"]["status"].is_string(), "{v}");
    let v = ask(b"{\"cmd\":\"status\"}\n");
    assert_eq!(v["ok"], true);
    let mut big = vec![b' '; 70_000];
    big.push(b'\n');
    let v = ask(&big);
    assert!(v["error"].as_str().unwrap().contains("longer than"), "{v}");
}

#[test]
fn bad_configs_fail_with_clear_messages() {
    // Config mistakes stop `serve`; a volume that fails to open (a missing file without a
    // `size`) does not: it is listed as failed (tests/isolation.rs).
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[[volume]]\nname = \"v\"\nkind = \"raid9\"\n", "unknown volume kind \"raid9\""),
        ("[[volume]]\nname = \"v\"\nkind = \"mem\"\nsize = \"1M\"\ncolour = \"red\"\n", "unknown field `colour`"),
        ("[[export]]\nname = \"e\"\nvolume = \"v\"\n", "not defined"),
    ];
    for (i, (body, want)) in cases.iter().enumerate() {
        let cfg = dir.path().join(format!("c{i}.toml"));
        std::fs::write(
            &cfg,
            format!("data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\"]\n{body}", dir.path().display()),
        )
        .unwrap();
        for check in [&["serve"][..], &["serve", "--check-config"][..]] {
            let out = Command::new(MDKIT).args(check).arg("--config").arg(&cfg).output().unwrap();
            assert!(!out.status.success(), "{check:?}: {body} must fail");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(want), "{check:?}: {body}: expected {want:?} in:\n{err}");
        }
    }
    let out = Command::new(MDKIT).args(["status", "--socket", "/nonexistent/mdkit.sock"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is `mdkit serve` running?"));
}
