//! A `file` volume on a thin pool's metadata or data file, or on an md member, is a second
//! writer of that device: its clients overwrite the pool's metadata or the array's
//! superblocks and data. Refused like a device two pools or arrays share (only pools and
//! arrays were): by `--check-config` naming both volumes, at start where the volume that opens
//! second fails without creating or opening anything, and on the control socket when an array
//! or a pool would be built on a file volume's file (by path, link or loop device). Two file
//! volumes may share a file. A thin volume's external origin file is read only, and wrong as
//! soon as anything writes it: no array, pool or writable file volume may use it, and no thin
//! volume takes a device another volume writes as its origin; read-only file volumes and other
//! thin volumes may read it too.

use crate::common;

use common::{Loop, Server, check_config_in, is_root, mdkit_err, status_entry};

const POOL_P: &str = "[[volume]]\nname = \"p\"\nkind = \"thin-pool\"\nmetadata = \"p.meta\"\nmetadata_size = \"4MiB\"\n\
                      data = \"p.data\"\ndata_size = \"8MiB\"\ncreate = true\n";

/// A file volume `name` on `path`, created with `size` when missing.
fn file(name: &str, path: &str, size: &str) -> String {
    format!("[[volume]]\nname = \"{name}\"\nkind = \"file\"\npath = \"{path}\"\nsize = \"{size}\"\n")
}

fn all_zero(path: &std::path::Path) -> bool {
    std::fs::read(path).unwrap().iter().all(|&b| b == 0)
}

#[test]
fn check_config_refuses_a_file_volume_on_a_pool_or_array_device() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("p.data"), b"").unwrap();
    std::os::unix::fs::symlink("p.data", d.join("data-link")).unwrap();
    let md = "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"./m0\", \"m1\"]\n";
    let cases = [
        (format!("{POOL_P}{}", file("f", "p.meta", "4MiB")), "\"p.meta\" (metadata of \"p\")"),
        (format!("{POOL_P}{}", file("f", "data-link", "8MiB")), "\"p.data\" (data of \"p\")"),
        (format!("{}{md}", file("f", "m0", "8MiB")), "(file of \"f\") and \"./m0\" (member of \"md0\")"),
    ];
    for (body, want) in &cases {
        let (ok, e) = check_config_in(d, body);
        assert!(!ok && e.contains("one device written by two volumes loses data") && e.contains(want), "{body}:\n{e}");
    }
    let (ok, e) = check_config_in(d, &format!("{}{}", file("f", "img", "8MiB"), file("g", "./img", "8MiB")));
    assert!(ok, "two file volumes on one file: {e}");
}

#[test]
fn at_start_the_second_writer_of_a_file_fails_without_touching_it() {
    let md = "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"./m0.img\", \"m1.img\"]\n\
              member_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n";
    let pool_q = "[[volume]]\nname = \"q\"\nkind = \"thin-pool\"\nmetadata = \"q.meta\"\ndata = \"q.data\"\n\
                  data_size = \"8MiB\"\ncreate = true\n";
    let body = [
        POOL_P.to_string(),
        file("f", "p.meta", "4MiB"),
        file("g", "m0.img", "8MiB"),
        md.to_string(),
        file("h", "q.meta", "4MiB"),
        pool_q.to_string(),
    ];
    let srv = Server::start(&body.concat());
    let st = srv.status();
    for name in ["p", "g", "h"] {
        assert_eq!(status_entry(&st, "volumes", name)["state"], "active", "{name}: {st:#}");
    }
    let refused = [
        ("f", "thin pool \"p\"", None),
        ("md0", "file volume \"g\"", Some("m1.img")),
        ("q", "file volume \"h\"", Some("q.data")),
    ];
    for (name, user, not_created) in refused {
        let v = status_entry(&st, "volumes", name);
        let e = v["error"].as_str().unwrap_or_default();
        assert!(v["state"] == "failed" && e.contains(&format!("is already used by {user}")), "{name}: {st:#}");
        if let Some(f) = not_created {
            assert!(!srv.path(f).exists(), "{name}: the refused volume created {f}");
        }
    }
    assert!(all_zero(&srv.path("m0.img")) && all_zero(&srv.path("q.meta")), "a refused volume wrote a file");
}

#[test]
fn an_array_or_pool_on_a_file_volume_file_is_refused_on_the_control_socket() {
    let srv = Server::start(&file("f", "f.img", "8MiB"));
    let f = srv.path("f.img").display().to_string();
    let n = srv.path("n.img").display().to_string();
    let e = mdkit_err(&srv, &["create", "md9", "--level", "raid1", "--member-size", "8M", &n, &f]);
    assert!(e.contains("is already used by file volume \"f\""), "{e}");
    let data = srv.path("tp.data").display().to_string();
    let e = mdkit_err(&srv, &["thin", "pool-create", "tp", "--metadata", &f, "--data", &data, "--data-size", "8M"]);
    assert!(e.contains("is already used by file volume \"f\""), "{e}");
    if is_root() {
        common::require_tool("losetup", "mount");
        let l = Loop::over(&srv.path("f.img"));
        let e = mdkit_err(&srv, &["create", "md9", "--level", "raid1", "--member-size", "8M", &n, &l.0]);
        assert!(e.contains("is already used by file volume \"f\""), "{e}");
    } else {
        eprintln!("SKIP: the loop device case needs root");
    }
    assert!(!srv.path("n.img").exists() && !srv.path("tp.data").exists(), "a refused request created a file");
    assert!(all_zero(&srv.path("f.img")), "a refused request wrote the file volume's file");
}

#[test]
fn an_external_origin_file_is_read_by_readers_only() {
    let dir = tempfile::tempdir().unwrap();
    let thin = "[[volume]]\nname = \"t\"\nkind = \"thin\"\npool = \"p\"\nid = 0\nsize = \"8MiB\"\n\
                create = true\nexternal_origin = \"gold.img\"\n";
    let ro = "[[volume]]\nname = \"r\"\nkind = \"file\"\npath = \"gold.img\"\nread_only = true\n";
    std::fs::write(dir.path().join("gold.img"), vec![7u8; 8 << 20]).unwrap();
    let (ok, e) = check_config_in(dir.path(), &format!("{POOL_P}{thin}{}", file("w", "gold.img", "8MiB")));
    assert!(!ok && e.contains("(external origin of \"t\")"), "a writable file volume on an origin:\n{e}");
    let (ok, e) = check_config_in(dir.path(), &format!("{POOL_P}{thin}{ro}"));
    assert!(ok, "a read-only file volume on an origin: {e}");

    let srv = Server::start(&format!("{POOL_P}{ro}{}", file("w", "w.img", "8MiB")));
    std::fs::write(srv.path("gold.img"), vec![7u8; 8 << 20]).unwrap();
    let gold = srv.path("gold.img").display().to_string();
    let w = srv.path("w.img").display().to_string();
    // Readers beside each other: the read-only file volume and two thin volumes.
    for id in ["1", "2"] {
        common::mdkit_ok(&srv, &["thin", "create", "p", id, "--size", "8M", "--external-origin", &gold]);
    }
    let n = srv.path("n.img").display().to_string();
    let e = mdkit_err(&srv, &["create", "md9", "--level", "raid1", "--member-size", "8M", &n, &gold]);
    assert!(e.contains("is already used by thin volume \"p.1\" (as its external origin"), "{e}");
    let data = srv.path("tp.data").display().to_string();
    let e = mdkit_err(&srv, &["thin", "pool-create", "tp", "--metadata", &gold, "--data", &data, "--data-size", "8M"]);
    assert!(e.contains("is already used by thin volume"), "{e}");
    // The other way round: a file another volume writes is no origin.
    let e = mdkit_err(&srv, &["thin", "create", "p", "3", "--size", "8M", "--external-origin", &w]);
    assert!(e.contains("external origin") && e.contains("is already used by file volume \"w\""), "{e}");
    assert!(!srv.path("n.img").exists() && !srv.path("tp.data").exists(), "a refused request created a file");
    // Other processes too: an offline writer is refused while the thin volumes read it.
    let out = common::offline(&["create", "x", "--level", "raid1", "--force", &gold, &n]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("is in use by another process"), "offline md create: {e}");
    assert!(std::fs::read(srv.path("gold.img")).unwrap().iter().all(|&b| b == 7), "the origin was written");
}
