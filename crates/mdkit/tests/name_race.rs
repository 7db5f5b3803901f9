//! Two requests creating one volume name at once. The "a volume named X already exists" check
//! only looked at the registry, where a volume appears once it is made: a second request for X
//! passed it while the first was still opening members, and wrote its superblocks (formatted
//! its pool, created its thin device) before the registry refused it, or won. The same for an
//! export name and a member device a request in progress holds, and for what a deactivated
//! pool needs to come back; and a request waiting on a remote member holds up no other.
//!
//! Deterministic: the first `md create` has a remote member on a socket the test holds, so it
//! waits in its connect, with everything before it done, until the test lets go. Every other
//! request for the name is made meanwhile; each must be refused and leave its devices as they
//! were. Then the first fails (the test closes the connection) and the name is free again.

use crate::common;

use std::os::unix::net::UnixListener;

use common::{SMALL_POOL, Server, mdkit, mdkit_err, mdkit_json, mdkit_ok, sha256, still_open};

const BUSY: &str = "a volume named \"x\" is being created by another request";

/// Stands for the remote member, in [`while_a_create_waits`]'s arguments, that the test holds.
const HELD: &str = "{held}";

/// Runs `mdkit ARGS` (with [`HELD`] for a remote member on a socket the test holds, so the
/// request waits in its connect with everything before it done) and `meanwhile` while it waits;
/// then lets go, and the request fails (no server behind its member).
fn while_a_create_waits(srv: &Server, args: &[&str], meanwhile: impl FnOnce()) {
    let gate = srv.path("gate.sock");
    let listener = UnixListener::bind(&gate).unwrap();
    let uri = format!("nbd+unix:///held?socket={}", gate.display());
    let args: Vec<&str> = args.iter().map(|a| if *a == HELD { uri.as_str() } else { a }).collect();
    std::thread::scope(|s| {
        let first = s.spawn(|| mdkit(srv, &args));
        let (held, _) = listener.accept().unwrap();
        meanwhile();
        assert!(still_open(&held), "the first request gave up before the others were answered (connect timeout?)");
        drop(held);
        assert!(!first.join().unwrap().status.success(), "the first request had no server behind its member");
    });
    std::fs::remove_file(&gate).unwrap();
}

#[test]
fn a_name_being_created_is_refused_to_every_other_request_before_it_touches_a_device() {
    let srv = Server::start(SMALL_POOL);
    let p = |f: &str| srv.path(f).display().to_string();
    // The members of a stopped array, for the assemble case.
    mdkit_ok(&srv, &["create", "old", "--level", "raid1", "--member-size", "8M", &p("c1"), &p("c2")]);
    mdkit_ok(&srv, &["stop", "old"]);
    let stopped = [sha256(&srv.path("c1")), sha256(&srv.path("c2"))];

    let first = ["create", "x", "--level", "raid1", "--member-size", "8M", HELD, &p("a1")];
    while_a_create_waits(&srv, &first, || refused_while_held(&srv, &stopped));
    assert!(!srv.path("a1").exists(), "the failed create left a member file");
    // The claim went with the failed request.
    mdkit_ok(&srv, &["create", "x", "--level", "raid1", "--member-size", "8M", &p("b1"), &p("b2")]);
}

/// While another request holds the name "x", every request for it is refused and creates or
/// writes nothing.
fn refused_while_held(srv: &Server, stopped: &[String; 2]) {
    let p = |f: &str| srv.path(f).display().to_string();
    let e = mdkit_err(srv, &["create", "x", "--level", "raid1", "--member-size", "8M", &p("b1"), &p("b2")]);
    assert!(e.contains(BUSY), "{e}");
    assert!(!srv.path("b1").exists() && !srv.path("b2").exists(), "the refused create made its members");
    let e = mdkit_err(srv, &["assemble", "x", &p("c1"), &p("c2")]);
    assert!(e.contains(BUSY), "{e}");
    assert_eq!([sha256(&srv.path("c1")), sha256(&srv.path("c2"))], *stopped, "the refused assemble wrote");
    let pool = ["thin", "pool-create", "x", "--metadata", &p("x.meta"), "--metadata-size", "4M"];
    let e = mdkit_err(srv, &[&pool[..], &["--data", &p("x.data"), "--data-size", "64M"]].concat());
    assert!(e.contains(BUSY), "{e}");
    assert!(!srv.path("x.meta").exists() && !srv.path("x.data").exists(), "the refused pool made its files");
    let e = mdkit_err(srv, &["thin", "create", "pool0", "7", "--size", "8M", "--name", "x"]);
    assert!(e.contains(BUSY), "{e}");
    let e = mdkit_err(srv, &["thin", "snapshot", "pool0", "8", "0", "--name", "x"]);
    assert!(e.contains(BUSY), "{e}");
    let ids: Vec<u64> = mdkit_json(srv, &["thin", "list", "pool0", "--json"])["thins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [0], "a refused thin create or snapshot made its device");
}

/// A create whose remote member is still connecting (up to `remote_timeout_ms`) holds up no
/// other request: it used to keep the volume table read-locked through the connect, so the
/// next create queued its install (a write lock) behind it, and every status behind that.
#[test]
fn a_remote_member_connecting_holds_up_no_other_request() {
    let srv = Server::start(SMALL_POOL);
    let p = |f: &str| srv.path(f).display().to_string();
    let first = ["create", "x", "--level", "raid1", "--member-size", "8M", HELD, &p("a1")];
    while_a_create_waits(&srv, &first, || {
        mdkit_ok(&srv, &["create", "y", "--level", "raid1", "--member-size", "8M", &p("y1"), &p("y2")]);
        let st = mdkit_json(&srv, &["status", "--json"]);
        assert!(st.to_string().contains("\"y\""), "{st}");
        mdkit_ok(&srv, &["stop", "y"]);
    });
}

/// An export name is claimed like a volume name: a second request creating a volume with the
/// export name a create in progress asked for is refused before it touches a device (both
/// passed the check before, and the second volume came up without the export it asked for,
/// yet remembered with it).
#[test]
fn an_export_name_being_taken_is_refused_to_every_other_request() {
    let srv = Server::start(SMALL_POOL);
    let p = |f: &str| srv.path(f).display().to_string();
    let first = ["create", "x", "--level", "raid1", "--member-size", "8M", "--export", "shared", HELD, &p("a1")];
    let busy = "export name \"shared\" is being taken by another request";
    while_a_create_waits(&srv, &first, || {
        let y = ["create", "y", "--level", "raid1", "--member-size", "8M", "--export", "shared", &p("y1"), &p("y2")];
        let e = mdkit_err(&srv, &y);
        assert!(e.contains(busy), "{e}");
        assert!(!srv.path("y1").exists(), "the refused create made its members");
        let e = mdkit_err(&srv, &["thin", "create", "pool0", "7", "--size", "8M", "--export", "shared"]);
        assert!(e.contains(busy), "{e}");
    });
    // Released with the failed request.
    mdkit_ok(
        &srv,
        &["create", "y", "--level", "raid1", "--member-size", "8M", "--export", "shared", &p("y1"), &p("y2")],
    );
    let st = mdkit_json(&srv, &["status", "--json"]);
    assert!(st["exports"].to_string().contains("\"shared\""), "{st}");
}

/// A member device is claimed like a name while its request opens it: a second create naming
/// it (however spelt), or a pool on it, is refused before it touches anything. Both creates used to pass the
/// in-use check (it sees registered arrays only) and write their superblocks to one file.
#[test]
fn a_member_being_opened_is_refused_to_every_other_request() {
    let srv = Server::start(SMALL_POOL);
    let p = |f: &str| srv.path(f).display().to_string();
    let first = ["create", "x", "--level", "raid1", "--member-size", "8M", HELD, &p("s.img")];
    while_a_create_waits(&srv, &first, || {
        let y = ["create", "y", "--level", "raid1", "--member-size", "8M", &p("./s.img"), &p("t.img")];
        let e = mdkit_err(&srv, &y);
        assert!(e.contains("s.img\" is being opened as a member by another request"), "{e}");
        assert!(!srv.path("t.img").exists(), "the refused create made its members");
        // A pool on it too (pools and arrays share the claims).
        let pool = ["thin", "pool-create", "tp", "--metadata", &p("tp.meta"), "--metadata-size", "4M"];
        let e = mdkit_err(&srv, &[&pool[..], &["--data", &p("s.img"), "--data-size", "8M"]].concat());
        assert!(e.contains("s.img\" is being opened as a member by another request"), "{e}");
        assert!(!srv.path("tp.meta").exists(), "the refused pool made its files");
    });
    assert!(!srv.path("s.img").exists(), "the failed create left a member file");
    mdkit_ok(&srv, &["create", "y", "--level", "raid1", "--member-size", "8M", &p("s.img"), &p("t.img")]);
}

/// A deactivated pool keeps what it needs to come back: its thin volumes' export names (a
/// create took one and pool-activate then left the thin volume registered without it, both
/// state files giving the export to different volumes) and their origin files (an md create
/// wrote one, and the reactivated thin volume read the md superblock).
#[test]
fn a_deactivated_pool_keeps_its_exports_and_origin_files() {
    let srv = Server::start(SMALL_POOL);
    let p = |f: &str| srv.path(f).display().to_string();
    std::fs::write(srv.path("gold.img"), vec![7u8; 8 << 20]).unwrap();
    let gold = p("gold.img");
    mdkit_ok(&srv, &["thin", "create", "pool0", "5", "--size", "8M", "--external-origin", &gold, "--export", "e5"]);
    mdkit_ok(&srv, &["thin", "pool-deactivate", "pool0", "--force"]);
    let e = mdkit_err(&srv, &["create", "m", "--level", "raid1", "--member-size", "8M", "--export", "e5", &p("m1")]);
    assert!(e.contains("export name \"e5\" is taken") && e.contains("deactivated pool \"pool0\""), "{e}");
    let e = mdkit_err(&srv, &["create", "m", "--level", "raid1", "--member-size", "8M", &p("m1"), &gold]);
    assert!(e.contains("thin volume \"pool0.5 (pool pool0 inactive)\" (as its external origin"), "{e}");
    assert!(!srv.path("m1").exists(), "a refused create made its members");
    assert!(std::fs::read(srv.path("gold.img")).unwrap().iter().all(|&b| b == 7), "the origin was written");
    mdkit_ok(&srv, &["thin", "pool-activate", "pool0"]);
    let st = mdkit_json(&srv, &["status", "--json"]);
    assert!(st["exports"].to_string().contains("\"e5\""), "{st}");
}
