//! `mdkit examine` of a member on an NBD server: the service takes remote members
//! (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`), so an operator examines
//! one by the same spec, read through mdkit's NBD client, and sees what the file shows. It
//! used to open the URI as a file path ("No such file or directory").

use crate::common;
use crate::remote::{logged, nbdkit};

use std::time::Duration;

use common::{Server, mdkit_ok, offline, offline_ok};
use serde_json::Value;

/// The examine JSON without its `device` (the file's path or the URI).
fn without_device(text: &str) -> (Value, Value) {
    let mut v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let device = v.as_object_mut().unwrap().remove("device").unwrap_or(Value::Null);
    (v, device)
}

#[test]
fn examine_reads_a_member_on_an_nbd_server_as_it_reads_the_file() {
    let mut srv = Server::start(
        "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n",
    );
    mdkit_ok(&srv, &["attr", "md0", "dev-a/bad_blocks=100 8"]);
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());
    let file = srv.path("a").display().to_string();
    let (socket, log) = (srv.path("a.sock"), srv.path("a.nbdkit.log"));
    let _server = nbdkit(&srv.path("a"), &socket, &log);
    let uri = format!("nbd+unix:///?socket={}", socket.display());

    let (local, _) = without_device(&offline_ok(&["examine", "--json", &file]));
    let (remote, device) = without_device(&offline_ok(&["examine", "--json", &uri]));
    assert_eq!(remote, local, "the same member through NBD");
    assert_eq!(device, Value::String(uri.clone()));
    assert!(!logged(&log, "Read").is_empty(), "nothing was read from the server");
    let text = offline_ok(&["examine", &uri]);
    let local_text = offline_ok(&["examine", &file]);
    assert_eq!(text.strip_prefix(&uri), local_text.strip_prefix(&file), "{text}");
    let bad = offline_ok(&["examine", "--badblocks", &uri]);
    assert!(bad.contains("100 for 8 sectors"), "{bad}");

    let gone = format!("nbd+unix:///?socket={}", srv.path("nosuch.sock").display());
    let out = offline(&["examine", &gone]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains(&gone) && e.contains("NBD server"), "{e}");
}
