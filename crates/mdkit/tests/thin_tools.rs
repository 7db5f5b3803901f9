//! `mdkit thin dump | restore | repair | delta | reserve-/release-metadata-snap` with the real
//! binary, a running service and thin-provisioning-tools as the oracle:
//! - online, through a held metadata snapshot: `mdkit thin dump POOL -m` and `mdkit thin delta
//!   POOL A B -m` print what `thin_dump -m` / `thin_delta -m` print on the live metadata file
//!   (except nr_data_blocks, which the tools print as 0 for a snapshot);
//! - a transient snapshot (`mdkit thin dump POOL`) shows the committed pool;
//! - offline after a clean stop: `mdkit thin dump` and `mdkit thin delta --metadata` are
//!   byte-for-byte `thin_dump` and `thin_delta` (simple and --verbose);
//! - `mdkit thin restore` output passes thin_check and dumps back to the same XML; thin_restore
//!   output dumps in mdkit the same; restore refuses to overwrite metadata without --force;
//! - `mdkit thin repair` of metadata with broken space maps keeps every mapping and passes
//!   thin_check; it refuses to write over its input.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{SMALL_POOL as POOL, Server, mdkit_ok, nbd_write_at, offline, offline_ok, pattern, require_tool, run};

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).unwrap()
}

/// The text with `nr_data_blocks="N"` replaced by `nr_data_blocks="0"` (what the tools print
/// for a metadata snapshot, whose superblock copy has no space maps).
fn zero_nr_data_blocks(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(p) = rest.find("nr_data_blocks=\"") {
        let start = p + "nr_data_blocks=\"".len();
        let end = start + rest[start..].find('"').unwrap();
        out.push_str(&rest[..start]);
        out.push('0');
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn thin_tools_online_offline_and_against_thin_provisioning_tools() {
    require_tool("thin_dump", "thin-provisioning-tools");
    require_tool("qemu-io", "qemu-utils");
    let mut srv = Server::start(POOL);
    let meta = srv.path("pool0.meta");
    nbd_write_at(&srv, "vol0", 0, &pattern(1, 2 << 20));
    nbd_write_at(&srv, "vol0", 8 << 20, &pattern(2, 1 << 20));
    mdkit_ok(&srv, &["thin", "snapshot", "pool0", "1", "0"]);
    // Diverge: the origin rewrites 1 MiB (16 blocks) and maps 512 KiB more.
    nbd_write_at(&srv, "vol0", 1 << 20, &pattern(3, 1 << 20));
    nbd_write_at(&srv, "vol0", 12 << 20, &pattern(4, 512 << 10));

    // Online, through a held metadata snapshot, against the tools on the live file.
    let out = mdkit_ok(&srv, &["thin", "reserve-metadata-snap", "pool0"]);
    assert!(out.contains("held at block"), "{out}");
    let ours = mdkit_ok(&srv, &["thin", "delta", "pool0", "1", "0", "--metadata-snap"]);
    let tool = stdout(Command::new("thin_delta").args(["-m", "--snap1", "1", "--snap2", "0"]).arg(&meta));
    assert_eq!(zero_nr_data_blocks(&ours), tool, "online delta -m");
    assert!(ours.contains("<different begin=\"16\" length=\"16\"/>"), "{ours}");
    assert!(ours.contains("<right_only begin=\"192\" length=\"8\"/>"), "{ours}");
    let ours = mdkit_ok(&srv, &["thin", "dump", "pool0", "--metadata-snap"]);
    let tool = stdout(Command::new("thin_dump").arg("-m").arg(&meta));
    assert_eq!(zero_nr_data_blocks(&ours), tool, "online dump -m");
    let err = common::mdkit_err(&srv, &["thin", "reserve-metadata-snap", "pool0"]);
    assert!(err.contains("already exists"), "{err}");
    let err = common::mdkit_err(&srv, &["thin", "dump", "pool0"]);
    assert!(err.contains("already exists") && err.contains("--metadata-snap"), "{err}");
    let json = common::mdkit_json(&srv, &["thin", "delta", "pool0", "1", "0", "-m", "--json"]);
    assert_eq!(json["totals_blocks"]["different"], 16, "{json:#}");
    assert_eq!(json["totals_blocks"]["right_only"], 8, "{json:#}");
    assert_eq!(json["totals_blocks"]["same"], 32, "{json:#}");
    assert_eq!(json["data_block_bytes"], 65536);
    mdkit_ok(&srv, &["thin", "release-metadata-snap", "pool0"]);
    assert!(common::mdkit_json(&srv, &["thin", "status", "pool0", "--json"])["held_root"].is_null());
    let err = common::mdkit_err(&srv, &["thin", "release-metadata-snap", "pool0"]);
    assert!(err.contains("no metadata snapshot"), "{err}");
    // A transient snapshot: the committed pool, nothing held afterwards.
    let online = mdkit_ok(&srv, &["thin", "dump", "pool0"]);
    let online_delta = mdkit_ok(&srv, &["thin", "delta", "pool0", "1", "0"]);
    assert!(common::mdkit_json(&srv, &["thin", "status", "pool0", "--json"])["held_root"].is_null());
    assert!(srv.signal_and_wait(libc::SIGTERM, Duration::from_secs(30)).success(), "{}", srv.log_text());

    // Offline: byte-for-byte the tools.
    let dump = offline_ok(&["thin", "dump", p(&meta)]);
    assert_eq!(dump, stdout(Command::new("thin_dump").arg(&meta)), "offline dump");
    assert_eq!(online, dump, "the online dump showed the committed pool");
    for extra in [&[][..], &["--verbose"][..]] {
        let ours = offline_ok(&[&["thin", "delta", "--metadata", p(&meta), "1", "0"][..], extra].concat());
        let tool = stdout(Command::new("thin_delta").args(extra).args(["--snap1", "1", "--snap2", "0"]).arg(&meta));
        assert_eq!(ours, tool, "offline delta {extra:?}");
    }
    assert_eq!(online_delta, offline_ok(&["thin", "delta", "--metadata", p(&meta), "1", "0"]));

    // Restore: ours passes thin_check and dumps back the same; thin_restore's dumps the same in mdkit.
    let xml = srv.path("pool0.xml");
    offline_ok(&["thin", "dump", p(&meta), "-o", p(&xml)]);
    let copy = srv.path("copy.meta");
    let out = offline_ok(&["thin", "restore", "-i", p(&xml), "-o", p(&copy), "--size", "8M"]);
    assert!(out.contains("restored 2 devices"), "{out}");
    run(Command::new("thin_check").arg(&copy));
    assert_eq!(stdout(Command::new("thin_dump").arg(&copy)), dump);
    let err = offline(&["thin", "restore", "-i", p(&xml), "-o", p(&copy)]);
    assert!(!err.status.success() && String::from_utf8_lossy(&err.stderr).contains("--force"), "{err:?}");
    offline_ok(&["thin", "restore", "-i", p(&xml), "-o", p(&copy), "--force"]);
    // A refused --force restore (a mapping beyond the data blocks) leaves the old metadata
    // byte-identical, not an empty pool; a file it would have made is not left behind.
    let text = std::fs::read_to_string(&xml).unwrap();
    let nr_data: u64 = text.split("nr_data_blocks=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
    let bad_xml = srv.path("bad.xml");
    let bad_text = text.replacen(
        "</device>",
        &format!("  <single_mapping origin_block=\"999999\" data_block=\"{nr_data}\" time=\"0\"/>\n</device>"),
        1,
    );
    std::fs::write(&bad_xml, bad_text).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let err = offline(&["thin", "restore", "-i", p(&bad_xml), "-o", p(&copy), "--force"]);
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(!err.status.success() && stderr.contains("beyond the"), "{err:?}");
    assert!(std::fs::read(&copy).unwrap() == before, "a refused restore changed the metadata");
    assert_eq!(stdout(Command::new("thin_dump").arg(&copy)), dump);
    let never = srv.path("never.meta");
    assert!(!offline(&["thin", "restore", "-i", p(&bad_xml), "-o", p(&never), "--size", "8M"]).status.success());
    assert!(!never.exists(), "a refused restore left the file it made");
    let tools_copy = srv.path("tools.meta");
    std::fs::File::create(&tools_copy).unwrap().set_len(8 << 20).unwrap();
    run(Command::new("thin_restore").arg("-i").arg(&xml).arg("-o").arg(&tools_copy));
    assert_eq!(offline_ok(&["thin", "dump", p(&tools_copy)]), dump);

    // Repair: broken space maps (both index roots zeroed); every mapping is kept.
    let bad = srv.path("bad.meta");
    std::fs::copy(&meta, &bad).unwrap();
    let sb = mdkit_thin::meta::Superblock::unpack(&block(&bad, 0));
    zero_block(&bad, sb.metadata_sm_root.bitmap_root);
    zero_block(&bad, sb.data_sm_root.bitmap_root);
    assert!(!Command::new("thin_check").arg(&bad).output().unwrap().status.success());
    let err = offline(&["thin", "repair", "-i", p(&bad), "-o", p(&bad)]);
    assert!(String::from_utf8_lossy(&err.stderr).contains("same device"), "{err:?}");
    let fixed = srv.path("fixed.meta");
    let before = std::fs::read(&bad).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&offline_ok(&["thin", "repair", "-i", p(&bad), "-o", p(&fixed), "--json"])).unwrap();
    assert!(std::fs::read(&bad).unwrap() == before, "repair wrote to its input");
    assert_eq!(report["complete"], true, "{report:#}");
    run(Command::new("thin_check").arg(&fixed));
    assert_eq!(stdout(Command::new("thin_dump").arg(&fixed)), dump);
}

fn block(path: &Path, b: u64) -> Box<[u8; 4096]> {
    use std::os::unix::fs::FileExt;
    let mut out = Box::new([0u8; 4096]);
    std::fs::File::open(path).unwrap().read_exact_at(&mut out[..], b * 4096).unwrap();
    out
}

fn zero_block(path: &Path, b: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&[0u8; 4096], b * 4096).unwrap();
}
