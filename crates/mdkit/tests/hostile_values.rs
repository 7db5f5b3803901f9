//! Hostile config values and CLI arguments. Each must be refused with an error naming the key
//! (or flag) and the value, before anything is created on disk, and never with a panic. The
//! cases pinned here were accepted by `--check-config` (and then created member files, wrote a
//! thin device or an md superblock before failing the open), or named no value:
//! `size = -1` said "data did not match any variant of untagged enum Size"; `members = ["a",
//! "a"]` created a raid1 with one file as both members; a thin-pool volume's keys were not
//! checked at all.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::common::*;

/// `mdkit serve --check-config` on `body` in a fresh directory: (success, stderr, files left).
fn check_config(body: &str) -> (bool, String, Vec<String>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("c.toml");
    std::fs::write(&config, format!("data_dir = \"{}\"\n{body}\n", dir.path().display())).expect("config");
    let out = Command::new(MDKIT).args(["serve", "--check-config", "--config"]).arg(&config).output().expect("mdkit");
    let mut files: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    files.retain(|f| f != "c.toml");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned(), files)
}

const FILE: &str = "[[volume]]\nname = \"v\"\nkind = \"file\"\npath = \"v.img\"\n";
const MD: &str = "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmember_size = \"4MiB\"\ncreate = true\n";
const POOL: &str =
    "[[volume]]\nname = \"pool\"\nkind = \"thin-pool\"\nmetadata_size = \"4MiB\"\ndata_size = \"16MiB\"\n";
const ATTRS: &str = "[volume.attributes]\n";
const POOL_OK: &str = "[[volume]]\nname = \"pool\"\nkind = \"thin-pool\"\nmetadata = \"m\"\ndata = \"d\"\n";

#[test]
fn check_config_names_the_key_and_value_of_every_hostile_value() {
    let thin = |kv: &str| format!("{POOL_OK}[[volume]]\nname = \"t\"\nkind = \"thin\"\npool = \"pool\"\n{kv}");
    let cases: Vec<(String, &[&str])> = vec![
        (format!("{FILE}size = -1"), &["size -1: must not be negative", "`size`"]),
        (format!("{FILE}size = \"-1\""), &["size \"-1\"", "`size`"]),
        (format!("{FILE}size = \"999999999999T\""), &["\"999999999999T\" overflows 64 bits"]),
        (format!("{FILE}size = \"1e30\""), &["size \"1e30\""]),
        (format!("{FILE}size = 1.5"), &["floating point `1.5`", "`size`"]),
        (format!("{FILE}size = 0"), &["size = 0 bytes: must be a non-zero multiple of 512"]),
        (format!("{FILE}size = \"0B\""), &["size = 0 bytes"]),
        (format!("{FILE}size = \"1000\""), &["size = 1000 bytes"]),
        (format!("{FILE}size = \"1M\"\nqueue_depth = 0"), &["queue_depth = 0: use 1..=4096"]),
        (format!("{FILE}size = \"1M\"\nqueue_depth = 1000000"), &["queue_depth = 1000000"]),
        ("[[volume]]\nname = \"m\"\nkind = \"mem\"\nsize = \"8EiB\"".into(), &["unknown unit \"EiB\""]),
        ("[[volume]]\nname = \"m\"\nkind = \"mem\"\nsize = \"1M\"\nlogical_block_bytes = 4097".into(), &["4097"]),
        (format!("{MD}members = []\nlevel = \"raid1\""), &["members = []"]),
        (format!("{MD}members = [\"a\", \"./a\"]\nlevel = \"raid1\""), &["member \"./a\" is the same device as member \"a\""]),
        (format!("{MD}members = [\"volume:md0\", \"b\"]\nlevel = \"raid1\""), &["\"volume:md0\"", "itself"]),
        (format!("{MD}members = [\"volume:later\", \"b\"]\nlevel = \"raid1\""), &["\"later\"", "not defined before"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nraid_devices = 0"), &["raid_devices = 0"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nraid_devices = 4000000000"), &["4000000000"]),
        (format!("{MD}members = [\"a\", \"b\", \"c\"]\nlevel = \"raid5\"\nchunk = \"3K\""), &["chunk = 3 KiB"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nbitmap_chunk = 1"), &["bitmap_chunk = 1 bytes"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nqueue_depth = 0"), &["queue_depth = 0"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nwrite_mostly = [\"c\"]"), &["write_mostly \"c\""]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nmember_size = 1000"), &["member_size = 1000"]),
        (format!("{MD}members = [\"a\", \"b\", \"c\"]\nlevel = \"raid5\"\nraid_devices = 1"), &["raid5 needs at least 2"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid0\"\nbitmap = \"internal\""), &["bitmap", "raid0"]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\n{ATTRS}sync_speed_max = \"100O0\""), &["sync_speed_max", "\"100O0\""]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\n{ATTRS}sync_sped_max = \"1000\""), &["no attribute \"sync_sped_max\""]),
        (format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\n{ATTRS}stripe_cache_size = \"512\""), &["stripe_cache_size"]),
        (format!("{POOL}metadata = \"p\"\ndata = \"./p\""), &["metadata and data are both"]),
        (format!("{POOL}metadata = \"volume:pool\"\ndata = \"d\""), &["\"volume:pool\"", "itself"]),
        (format!("{POOL}metadata = \"m\"\ndata = \"d\"\nblock_size = \"3K\""), &["block_size = 3072 bytes"]),
        (format!("{POOL}metadata = \"m\"\ndata = \"d\"\nbogus = 1"), &["unknown field `bogus`"]),
        (format!("{POOL}metadata = \"m\"\ndata = \"d\"\nqueue_depth = 0"), &["queue_depth = 0"]),
        (format!("{POOL}metadata = \"m\"\ndata = \"d\"\nmetadata_size = 1000"), &["metadata_size = 1000"]),
        (format!("{POOL}metadata = \"m\"\ndata = \"d\"\nautoextend_threshold_percent = 0"), &["percent 0"]),
        (thin("id = 16777216\nsize = \"1M\""), &["id = 16777216"]),
        (thin("id = 1\nsize = \"1000\""), &["size = 1000 bytes"]),
        (thin("id = -1"), &["`-1`", "`id`"]),
        ("[[volume]]\nname = \"t\"\nkind = \"thin\"\npool = \"t\"\nid = 0".into(), &["pool = \"t\"", "own pool"]),
        ("[[volume]]\nname = \"t\"\nkind = \"thin\"\npool = \"p\"\nid = 0\n[[volume]]\nname = \"p\"\nkind = \"thin-pool\"\nmetadata = \"m\"\ndata = \"volume:t\"".into(), &["\"p\", which is not defined before"]),
    ];
    for (body, wants) in &cases {
        let (ok, err, files) = check_config(body);
        assert!(!ok, "accepted:\n{body}");
        assert!(!err.contains("panicked"), "{body}:\n{err}");
        for w in *wants {
            assert!(err.contains(w), "{body}:\nmissing {w:?} in:\n{err}");
        }
        assert!(files.is_empty(), "{body}: --check-config created {files:?}");
    }
}

/// A bad key stops `mdkit serve` before it creates anything; a volume whose open fails (the same
/// file twice through a hard link, a directory, /dev/null) is listed as failed with its reason,
/// leaves its member untouched, and the other volumes are served.
#[test]
fn serve_refuses_bad_keys_and_isolates_bad_members() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("c.toml");
    let body = format!("{MD}members = [\"a\", \"b\"]\nlevel = \"raid1\"\nraid_devices = 0");
    std::fs::write(&config, format!("data_dir = \"{}\"\n{body}\n", dir.path().display())).unwrap();
    let out = Command::new(MDKIT).args(["serve", "--config"]).arg(&config).output().expect("mdkit");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("raid_devices = 0") && !err.contains("panicked"), "{err}");
    assert!(!dir.path().join("a").exists() && !dir.path().join("b").exists(), "member files created");

    let base = if Path::new("/var/tmp").is_dir() { "/var/tmp" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("mdkit-test-").tempdir_in(base).unwrap();
    std::fs::write(dir.path().join("x.img"), pattern(7, 1 << 20)).unwrap();
    std::fs::hard_link(dir.path().join("x.img"), dir.path().join("y.img")).unwrap();
    std::fs::create_dir(dir.path().join("adir")).unwrap();
    let before = sha256(&dir.path().join("x.img"));
    let body = "[[volume]]\nname = \"twice\"\nkind = \"md\"\nmembers = [\"x.img\", \"y.img\"]\ncreate = true\nlevel = \"raid1\"\n\
         [[volume]]\nname = \"dirvol\"\nkind = \"file\"\npath = \"adir\"\n\
         [[volume]]\nname = \"null\"\nkind = \"md\"\nmembers = [\"/dev/null\", \"z.img\"]\nmember_size = \"4MiB\"\ncreate = true\nlevel = \"raid1\"\n\
         [[volume]]\nname = \"ram\"\nkind = \"mem\"\nsize = \"1MiB\"\n\
         [[export]]\nname = \"ram\"\nvolume = \"ram\"\n";
    let config = dir.path().join("mdkit.toml");
    let text = format!(
        "data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\", \"unix:nbd.sock\"]\n{body}",
        dir.path().display()
    );
    std::fs::write(&config, text).unwrap();
    let srv = Server::start_with_config(dir, config);
    let st = srv.status();
    let vol = |n: &str| -> Value {
        st["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("{n}: {st:#}"))
    };
    let twice = vol("twice");
    assert_eq!(twice["state"], "failed", "{st:#}");
    assert!(twice["error"].as_str().unwrap().contains("is the same device as member \"x.img\""), "{st:#}");
    assert!(vol("dirvol")["error"].as_str().unwrap().contains("adir: open: Is a directory"), "{st:#}");
    assert!(vol("null")["error"].as_str().unwrap().contains("/dev/null"), "{st:#}");
    assert_eq!(vol("ram")["state"], "active", "{st:#}");
    nbd_write_at(&srv, "ram", 4096, &pattern(1, 4096));
    assert_eq!(&nbd_read(&srv, "ram", 8192)[4096..], &pattern(1, 4096)[..]);
    assert_eq!(sha256(&srv.path("x.img")), before, "a refused member was written");
    assert!(!srv.path("z.img").exists() || std::fs::metadata(srv.path("z.img")).unwrap().len() == 4 << 20);
    assert!(!srv.log_text().contains("panicked"), "{}", srv.log_text());
}

/// CLI values: refused with the flag and the value, the array keeps serving.
#[test]
fn cli_values_are_refused_with_the_flag_and_value() {
    let srv = Server::start(
        "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n\
         [[export]]\nname = \"md0\"\nvolume = \"md0\"\n",
    );
    let cases: &[(&[&str], &str)] = &[
        (&["grow", "md0", "--size", "18446744073709551615"], "--size \"18446744073709551615\": not a number of KiB"),
        (&["grow", "md0", "--size", "999999999999T"], "overflows 64 bits"),
        (&["grow", "md0", "--array-size", "abc"], "--array-size: size \"abc\""),
        (&["grow", "md0", "--raid-devices", "4000000000"], "--raid-devices 4000000000 is out of range"),
        (&["attr", "md0", "sync_speed_max=-1"], "\"-1\""),
        (&["attr", "md0", "sync_speed_max=18446744073709551616"], "18446744073709551616"),
        (
            &[
                "thin",
                "pool-create",
                "p1",
                "--metadata",
                "pm",
                "--data",
                "pd",
                "--metadata-size",
                "4M",
                "--data-size",
                "16M",
                "--block-size",
                "3K",
            ],
            "block_size = 3072 bytes",
        ),
        (
            &[
                "thin",
                "pool-create",
                "p1",
                "--metadata",
                "pm",
                "--data",
                "pm",
                "--metadata-size",
                "4M",
                "--data-size",
                "16M",
            ],
            "metadata and data are both",
        ),
    ];
    for (args, want) in cases {
        let err = mdkit_err(&srv, args);
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(!srv.path("pm").exists() && !srv.path("pd").exists(), "refused pool-create created files");
    nbd_write_at(&srv, "md0", 0, &pattern(3, 4096));
    assert_eq!(nbd_read(&srv, "md0", 4096), pattern(3, 4096));
    assert!(!srv.log_text().contains("panicked"));
}

/// A loop device over a member file is that member: refused as a second member of one array
/// (the array would be degraded from birth) and as a spare of the array whose member it is
/// (a rebuild onto it overwrote the active member). Nothing is written to the file.
#[test]
fn a_loop_device_over_a_member_file_is_the_same_member() {
    if !is_root() {
        eprintln!("skipped: loop devices need root");
        return;
    }
    require_tool("losetup", "mount");
    let srv = Server::start(
        "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n",
    );
    let a = Loop::over(&srv.path("a"));
    let before = sha256(&srv.path("a"));
    let e = mdkit_err(&srv, &["manage", "md0", "--add", &a.0]);
    assert!(e.contains("is already used by md array \"md0\""), "{e}");
    std::fs::write(srv.path("c.img"), vec![0u8; 8 << 20]).unwrap();
    let c = Loop::over(&srv.path("c.img"));
    let file = srv.path("c.img").display().to_string();
    let e = mdkit_err(&srv, &["create", "md1", "--level", "raid1", &file, &c.0]);
    assert!(e.contains(&format!("is the same device as member {file:?}")), "{e}");
    assert_eq!(sha256(&srv.path("a")), before, "the active member was written");
    assert!(std::fs::read(srv.path("c.img")).unwrap().iter().all(|&b| b == 0), "the refused member was written");
    mdkit_ok(&srv, &["detail", "md0"]);
}

/// An attribute refused when the array is assembled from its members (no create keys for
/// `--check-config` to try it on) is logged; the array serves without it.
#[test]
fn an_attribute_refused_at_start_leaves_the_array_serving() {
    let md = "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\n";
    let export = "[[export]]\nname = \"md0\"\nvolume = \"md0\"\n";
    let srv = Server::start(&format!("{md}member_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n{export}"));
    nbd_write_at(&srv, "md0", 0, &pattern(3, 4096));
    let text = std::fs::read_to_string(&srv.config_path).unwrap();
    let text = text.replace(
        "member_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n",
        "[volume.attributes]\nstripe_cache_size = \"512\"\n",
    );
    std::fs::write(&srv.config_path, text).unwrap();
    let srv = restart(srv);
    let st = srv.status();
    let vol = st["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "md0").cloned().unwrap();
    assert_eq!(vol["state"], "clean", "{st:#}");
    assert_eq!(&nbd_read(&srv, "md0", 4096)[..], &pattern(3, 4096)[..]);
    let log = srv.log_text();
    assert!(log.contains("[volume.attributes] not applied") && log.contains("stripe_cache_size"), "{log}");
}

/// `create` does not format over a file system (mdadm asks first): the CLI refuses without
/// --force and names what it found, a config volume with create keys is listed as failed,
/// and the file is unchanged either way. With --force the CLI creates the array.
#[test]
fn create_refuses_a_member_holding_a_file_system() {
    require_tool("mkfs.ext4", "e2fsprogs");
    let srv = Server::start("");
    let fs = srv.path("fs.img");
    std::fs::write(&fs, vec![0u8; 8 << 20]).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&fs));
    let before = sha256(&fs);
    let other = srv.path("other.img").display().to_string();
    let path = fs.display().to_string();
    let e = mdkit_err(&srv, &["create", "md0", "--level", "raid1", "--member-size", "8M", &other, &path]);
    assert!(e.contains("holds an ext2/3/4 file system; use --force"), "{e}");
    assert_eq!(sha256(&fs), before, "a refused create wrote the file system's device");
    drop(srv);

    let md = "[[volume]]\nname = \"md1\"\nkind = \"md\"\nmembers = [\"fs.img\", \"b.img\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n";
    let dir = tempfile::tempdir().unwrap();
    let fs = dir.path().join("fs.img");
    std::fs::write(&fs, vec![0u8; 8 << 20]).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&fs));
    let before = sha256(&fs);
    let config = dir.path().join("mdkit.toml");
    let text =
        format!("data_dir = \"{}\"\n[nbd]\nlisten = [\"127.0.0.1:0\", \"unix:nbd.sock\"]\n{md}", dir.path().display());
    std::fs::write(&config, text).unwrap();
    let srv = Server::start_with_config(dir, config);
    let st = srv.status();
    let vol = st["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "md1").cloned().unwrap();
    assert_eq!(vol["state"], "failed", "{st:#}");
    assert!(vol["error"].as_str().unwrap().contains("holds an ext2/3/4 file system"), "{st:#}");
    assert_eq!(sha256(&fs), before, "a config create wrote over the file system");
    let path = fs.display().to_string();
    let other = srv.path("c.img").display().to_string();
    mdkit_ok(&srv, &["create", "md2", "--level", "raid1", "--member-size", "8M", "--force", &other, &path]);
    assert_ne!(sha256(&fs), before, "--force creates the array");
}

/// `--re-add` (or `--add`) of a member the array still holds as faulty says to remove it
/// first (it said "already used by md array"), and a bad block written through `attr` is in
/// the member's bad-block log when the command returns, as md's bad_blocks store does.
#[test]
fn re_add_of_a_faulty_member_and_an_attr_bad_block_say_and_do_what_md_does() {
    let srv = Server::start(
        "[[volume]]\nname = \"md0\"\nkind = \"md\"\nmembers = [\"a\", \"b\"]\nmember_size = \"8MiB\"\ncreate = true\nlevel = \"raid1\"\n",
    );
    mdkit_ok(&srv, &["manage", "md0", "--fail", "b"]);
    let b = srv.path("b").display().to_string();
    let e = mdkit_err(&srv, &["manage", "md0", "--re-add", &b]);
    assert!(e.contains("member b is still in the array (faulty); --remove it first"), "{e}");
    mdkit_ok(&srv, &["attr", "md0", "dev-a/bad_blocks=100 8"]);
    let a = srv.path("a").display().to_string();
    let text = offline_ok(&["examine", &a, "--badblocks"]);
    assert!(text.contains("100 for 8 sectors"), "{text}");
}
