//! The control socket's client limit (QA repro-2): 64 connections that never send anything
//! used to take every slot for good, and each new client — `mdkit status` included — was
//! closed at once ("Broken pipe" / "Connection reset by peer"). Now a new client cuts the one
//! idle the longest, which gets an error line saying why; event streams (`monitor.stream`) are
//! cut only when every slot is one, oldest first. Reads have hang guards only.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{Server, mdkit_ok, still_open};
use serde_json::Value;

/// The control socket's client limit (`control::admission::CLIENTS_MAX`, docs/CONFIG.md).
const CLIENTS_MAX: usize = 64;
/// Hang guard for reads that must get a line.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn connect(srv: &Server) -> UnixStream {
    let s = UnixStream::connect(&srv.control).expect("connect control socket");
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    s
}

/// The next line from `s`, parsed.
fn read_json(s: &UnixStream) -> Value {
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).expect("a line (hang guard)");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

#[test]
fn control_socket_full_of_idle_clients_still_admits_the_cli() {
    let srv = Server::start("");
    // Connections are accepted in order: the CLI's comes after all of these. The last one has
    // run a command; the silent ones have been idle longer.
    let idle: Vec<UnixStream> = (0..CLIENTS_MAX - 1).map(|_| connect(&srv)).collect();
    let mut active = connect(&srv);
    active.write_all(b"{\"cmd\": \"help\"}\n").unwrap();
    assert_eq!(read_json(&active)["ok"], true);
    let out = mdkit_ok(&srv, &["status", "--json"]);
    serde_json::from_str::<Value>(&out).expect("status JSON");
    // The one idle the longest made room, and was told why.
    let v = read_json(&idle[0]);
    assert_eq!(v["ok"], false, "{v}");
    let err = v["error"].as_str().unwrap();
    assert!(err.contains("closed to make room") && err.contains("idle the longest"), "{err}");
    assert!(still_open(&idle[1]), "only one idle client is cut per new client");
    assert!(still_open(&active));
    let log = srv.log_text();
    assert!(log.contains("control socket full (64 clients): closed client"), "{log}");
    // Counted, asked on a client already admitted (a new one could cut again, depending on
    // whether the service has seen the CLI's close yet).
    active.write_all(b"{\"cmd\": \"status\"}\n").unwrap();
    let c = read_json(&active)["result"]["control"].clone();
    assert_eq!(
        (c["cut_idle"].as_u64(), c["cut_streams"].as_u64(), c["refused"].as_u64()),
        (Some(1), Some(0), Some(0)),
        "{c}"
    );
    assert_eq!(c["clients_max"].as_u64(), Some(64), "{c}");
}

#[test]
fn event_streams_are_cut_only_when_every_slot_streams() {
    let srv = Server::start("");
    let streams: Vec<UnixStream> = (0..CLIENTS_MAX)
        .map(|_| {
            let mut s = connect(&srv);
            s.write_all(b"{\"cmd\": \"monitor.stream\"}\n").unwrap();
            assert_eq!(read_json(&s)["result"]["streaming"], true);
            s
        })
        .collect();
    mdkit_ok(&srv, &["status"]);
    let v = read_json(&streams[0]);
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("this stream was the oldest"), "{v}");
    assert!(still_open(&streams[1]));
    // With an idle client among the streams, the idle one goes, not a stream.
    let idle = connect(&srv);
    mdkit_ok(&srv, &["status"]);
    assert_eq!(read_json(&idle)["ok"], false);
    assert!(still_open(&streams[1]) && still_open(&streams[2]));
}
