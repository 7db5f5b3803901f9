//! SIGTERM / SIGINT with requests in flight: the service stops accepting, answers what it has
//! read, flushes every volume and exits 0; every acknowledged write is in the member file.

use crate::common;

use std::time::Duration;

use common::raw::*;
use common::{Server, pattern, read_file_at};

const CONFIG: &str = r#"
[[volume]]
name = "vol0"
kind = "file"
path = "vol0.img"
size = "64MiB"
[[export]]
name = "default"
volume = "vol0"
"#;

#[test]
fn sigterm_with_writes_in_flight_exits_zero_with_acknowledged_data_in_the_file() {
    sigterm_keeps_every_acknowledged_write(CONFIG);
}

/// The same volume answering plain writes once they are queued (`write_back = true`): what it
/// acknowledged is still in flight on the member when the signal lands, and the shutdown flush
/// must wait for it.
#[test]
fn sigterm_on_a_write_back_volume_keeps_every_acknowledged_write() {
    let config = CONFIG.replace("size = \"64MiB\"\n", "size = \"64MiB\"\nwrite_back = true\n");
    assert!(config.contains("write_back = true"));
    sigterm_keeps_every_acknowledged_write(&config);
}

fn sigterm_keeps_every_acknowledged_write(config: &str) {
    let mut srv = Server::start(config);
    let mut c = Raw::open(&srv.tcp, "default", false, true);
    const N: u64 = 96;
    const LEN: usize = 256 << 10;
    for i in 0..N {
        c.request(0, CMD_WRITE, i, i * LEN as u64, LEN as u32, &pattern(i, LEN));
    }
    // At least one answered, so the server is mid-stream when the signal lands.
    let (err, first) = c.simple_reply();
    assert_eq!(err, 0);
    let mut acked = vec![first];
    // SAFETY: kill(2) on our child's pid.
    assert_eq!(unsafe { libc::kill(srv.pid(), libc::SIGTERM) }, 0);
    // Every reply that does arrive must be a success; then the server closes.
    c.s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    loop {
        let mut hdr = [0u8; 16];
        match std::io::Read::read_exact(&mut c.s, &mut hdr) {
            Ok(()) => {
                assert_eq!(u32::from_be_bytes(hdr[0..4].try_into().unwrap()), SIMPLE_MAGIC);
                assert_eq!(u32::from_be_bytes(hdr[4..8].try_into().unwrap()), 0, "in-flight write failed at shutdown");
                acked.push(u64::from_be_bytes(hdr[8..16].try_into().unwrap()));
            }
            Err(_) => break,
        }
    }
    let status = srv.wait(Duration::from_secs(30));
    assert!(status.success(), "exit status {status}; log:\n{}", srv.log_text());
    let log = srv.log_text();
    assert!(log.contains("shutdown complete: every volume flushed"), "{log}");
    for i in &acked {
        let got = read_file_at(&srv.path("vol0.img"), i * LEN as u64, LEN);
        assert!(got == pattern(*i, LEN), "acknowledged write {i} is not in the member file");
    }
    eprintln!("{} of {N} writes acknowledged before shutdown", acked.len());
}

#[test]
fn sigint_on_an_idle_server_exits_zero_and_removes_its_sockets() {
    let mut srv = Server::start(CONFIG);
    let control = srv.control.clone();
    let unix = srv.unix.clone();
    let status = srv.signal_and_wait(libc::SIGINT, Duration::from_secs(30));
    assert!(status.success(), "exit status {status}; log:\n{}", srv.log_text());
    assert!(!control.exists(), "control socket left behind");
    assert!(!unix.exists(), "NBD unix socket left behind");
}

#[test]
fn stuck_clients_do_not_hold_up_shutdown_beyond_the_grace_period() {
    let mut srv = Server::start_opts("shutdown_grace_ms = 500", CONFIG);
    // A write header whose payload never arrives: the server stops waiting for it at once.
    let mut mid_payload = Raw::open(&srv.tcp, "default", false, false);
    mid_payload.request(0, CMD_WRITE, 1, 0, 4096, &[1; 10]);
    // A client that floods 1 MiB reads and never reads a reply: the reply writer blocks on a
    // full socket, so this connection can only be cut when the grace period ends.
    let mut deaf = Raw::open(&srv.tcp, "default", false, false);
    for i in 0..64u64 {
        deaf.request(0, CMD_READ, i, 0, 1 << 20, &[]);
    }
    // Both connections are in transmission and every read of the deaf one was answered (its
    // replies now wait on a full socket).
    let t = std::time::Instant::now();
    loop {
        let st = srv.status();
        let export = st["exports"].as_array().unwrap().iter().find(|e| e["name"] == "default").unwrap().clone();
        if export["connections"].as_u64() >= Some(2) && export["stats"]["reads"].as_u64() >= Some(64) {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the clients never got their requests in: {export}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Without the grace period the deaf client would hold the shutdown forever: the 20 s limit
    // is a hang guard (not a timing assertion), the log line proves the grace period cut it.
    let status = srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(20));
    assert!(status.success(), "exit status {status}; log:\n{}", srv.log_text());
    assert!(srv.log_text().contains("grace period over"), "the deaf client should have been cut:\n{}", srv.log_text());
    assert_eq!(
        read_file_at(&srv.path("vol0.img"), 0, 4096),
        vec![0u8; 4096],
        "a partial payload must never be written"
    );
}
