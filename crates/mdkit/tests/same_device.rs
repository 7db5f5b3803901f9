//! One notion of "the same device" (`volumes/device_key.rs`) for every refusal of one device
//! used twice. Each case here was decided differently by the three checks there used to be
//! (the thin pools' device key, the control socket's `same_member`, md's repeated-member
//! check), and got through one of them:
//! - `--check-config` accepted two arrays sharing a member file (by absolute path or a
//!   symbolic link), one array given a member twice (`a` and its absolute path), and one
//!   remote member under two spellings of its URI;
//! - at start, an array after a pool (or another array) on its file opened it and wrote its
//!   superblock into the pool's data: only a pool was refused, and only when it came second;
//! - `manage --fail ./b` or `--remove LINK` found no member (paths were compared as strings,
//!   relative to the data directory without normalising);
//! - `thin pool-create` took one file as metadata and data when one name was a link.

use crate::common;

use common::{Server, check_config_in, mdkit, mdkit_err, mdkit_ok, offline, status_entry};

const MD0: &str = "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n";

/// An md volume `name` on `members` (TOML array items), created with 8 MiB member files.
fn md(name: &str, members: &str) -> String {
    format!(
        "[[volume]]\nname = \"{name}\"\nkind = \"md\"\nmembers = [{members}]\nmember_size = \"8MiB\"\ncreate = true\n\
         level = \"raid1\"\n"
    )
}

#[test]
fn check_config_refuses_one_device_however_it_is_spelt() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("b"), b"").unwrap();
    std::os::unix::fs::symlink("b", d.join("b-link")).unwrap();
    let b_abs = d.join("b").display().to_string();
    let a_abs = d.join("a").display().to_string();
    let cases: Vec<(String, &[&str])> = vec![
        (format!("{MD0}{}", md("md1", &format!("\"c\", {b_abs:?}"))), &["volumes \"md0\" and \"md1\" use one device"]),
        (format!("{MD0}{}", md("md1", "\"c\", \"b-link\"")), &["volumes \"md0\" and \"md1\" use one device", "b-link"]),
        (md("md1", &format!("\"a\", {a_abs:?}")), &["volume \"md1\"", "is the same device as member \"a\""]),
        (md("md1", "\"nbd://h/e\", \"nbd://H:10809/e\""), &["\"nbd://H:10809/e\" is the same device as member"]),
    ];
    for (body, wants) in &cases {
        let (ok, e) = check_config_in(d, body);
        assert!(!ok, "accepted:\n{body}");
        for w in *wants {
            assert!(e.contains(w), "{body}:\nmissing {w:?} in:\n{e}");
        }
    }
    let (ok, e) = check_config_in(d, &format!("{MD0}{}", md("md1", "\"c\", \"d\"")));
    assert!(ok, "two arrays on their own members: {e}");
}

#[test]
fn at_start_an_array_on_a_device_an_earlier_volume_uses_fails_and_writes_nothing() {
    let pool = "[[volume]]\nname = \"p\"\nkind = \"thin-pool\"\nmetadata = \"p.meta\"\nmetadata_size = \"4MiB\"\n\
                data = \"p.data\"\ndata_size = \"8MiB\"\ncreate = true\n";
    let srv = Server::start(&format!(
        "{pool}{MD0}{}{}",
        md("md1", "\"./p.data\", \"x.img\""),
        md("md2", "\"c.img\", \"./b\"")
    ));
    let st = srv.status();
    assert_eq!(status_entry(&st, "volumes", "p")["state"], "active", "{st:#}");
    assert_ne!(status_entry(&st, "volumes", "md0")["state"], "failed", "{st:#}");
    for (name, user, not_created) in [("md1", "thin pool \"p\"", "x.img"), ("md2", "md array \"md0\"", "c.img")] {
        let v = status_entry(&st, "volumes", name);
        let e = v["error"].as_str().unwrap_or_default();
        assert!(v["state"] == "failed" && e.contains(&format!("is already used by {user}")), "{name}: {st:#}");
        assert!(!srv.path(not_created).exists(), "{name}: the refused array created {not_created}");
    }
    let p_data = srv.path("p.data").display().to_string();
    let out = offline(&["examine", &p_data]);
    assert!(
        !out.status.success(),
        "an md superblock was written into the pool's data: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn manage_finds_a_member_however_its_path_is_spelt() {
    let srv = Server::start(MD0);
    std::os::unix::fs::symlink("b", srv.path("b-link")).unwrap();
    // As the CLI sends them for --fail / --remove: relative to the data directory.
    mdkit_ok(&srv, &["manage", "md0", "--fail", "./b"]);
    mdkit_ok(&srv, &["manage", "md0", "--remove", "b-link"]);
    let d = common::mdkit_json(&srv, &["detail", "md0", "--json"]);
    assert!(!d.to_string().contains("\"b\""), "b is still a member: {d:#}");
    let e = mdkit_err(&srv, &["manage", "md0", "--fail", "./nosuch"]);
    assert!(e.contains("no member \"./nosuch\""), "{e}");
    // The active member, reached through a link, is in use by its own array.
    std::os::unix::fs::symlink("a", srv.path("a-link")).unwrap();
    let e = mdkit_err(&srv, &["manage", "md0", "--add", &srv.path("a-link").display().to_string()]);
    assert!(e.contains("is already used by md array \"md0\""), "{e}");
}

#[test]
fn pool_create_refuses_one_file_as_metadata_and_data() {
    let srv = Server::start("");
    std::fs::write(srv.path("m"), vec![0u8; 8 << 20]).unwrap();
    std::os::unix::fs::symlink("m", srv.path("m-link")).unwrap();
    let (m, link) = (srv.path("m").display().to_string(), srv.path("m-link").display().to_string());
    let out = mdkit(&srv, &["thin", "pool-create", "tp", "--metadata", &m, "--data", &link]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("metadata and data are both"), "{e}");
    assert!(std::fs::read(srv.path("m")).unwrap().iter().all(|&b| b == 0), "the refused pool wrote its file");
}
