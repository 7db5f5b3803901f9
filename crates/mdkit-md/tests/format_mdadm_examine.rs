//! Host `mdadm --examine` (mdadm 4.2) reads the superblocks and bitmaps that mdkit's create
//! planning writes into sparse member files, for every level and layout, with and without an
//! internal bitmap, metadata 1.0/1.1/1.2: it reports "Checksum : ... - correct" and mdkit's own
//! examine text is identical to mdadm's, line for line (times in UTC). One case also goes
//! through `mdadm --examine-bitmap` on a read-only loop device (mdadm 4.2 cannot find an
//! internal bitmap on a plain file).

use crate::common;

use std::path::Path;
use std::process::Command;

use common::images::{MemberImage, write_plan};
use common::require_tool;
use mdkit_md::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};
use mdkit_md::format::examine::{self, render_bitmap_text, render_text};
use mdkit_md::format::superblock::MetadataVersion;
use mdkit_md::layout::Level;

const MIB: u64 = 2048; // sectors

/// One array to create.
#[derive(Clone)]
struct Case {
    name: &'static str,
    req: CreateRequest,
}

fn uuid(seed: u8) -> [u8; 16] {
    let mut u = [0u8; 16];
    for (i, b) in u.iter_mut().enumerate() {
        *b = seed.wrapping_mul(31).wrapping_add(i as u8 * 17) ^ 0xa5;
    }
    u
}

fn case(name: &'static str, level: Level, sizes_mib: &[u64], f: impl FnOnce(&mut CreateRequest)) -> Case {
    let seed = name.bytes().fold(7u8, |a, b| a.wrapping_mul(13).wrapping_add(b));
    let mut req = CreateRequest::new(
        level,
        sizes_mib.iter().map(|m| m * MIB).collect(),
        uuid(seed),
        1_790_000_000 + u64::from(seed),
    );
    req.name = name.to_string();
    req.sync = InitialSync::AssumeClean;
    f(&mut req);
    Case { name, req }
}

fn internal(req: &mut CreateRequest) {
    req.bitmap = BitmapRequest::Internal { chunk_bytes: None };
}

fn cases() -> Vec<Case> {
    let mut v = vec![
        case("r0-single", Level::Raid0, &[64, 64, 64], |_| {}),
        case("r0-multizone", Level::Raid0, &[64, 96, 96, 128], |_| {}),
        case("r0-alt", Level::Raid0, &[64, 96, 96], |r| r.layout = Some(2)),
        case("r0-chunk64", Level::Raid0, &[64, 64], |r| r.chunk_kib = Some(64)),
        case("r1", Level::Raid1, &[64, 64], |_| {}),
        case("r1-bitmap", Level::Raid1, &[64, 64, 64], internal),
        case("r1-sizes", Level::Raid1, &[64, 80], internal),
        case("r1-resync", Level::Raid1, &[64, 64], |r| r.sync = InitialSync::Resync),
        case("r1-spare", Level::Raid1, &[64, 64, 64], |r| r.raid_devices = 2),
        case("r1-v10", Level::Raid1, &[64, 64], |r| {
            r.metadata = MetadataVersion::V1_0;
            internal(r);
        }),
        case("r1-v11", Level::Raid1, &[64, 64], |r| {
            r.metadata = MetadataVersion::V1_1;
            internal(r);
        }),
        case("r5-v10", Level::Raid5, &[64, 64, 64], |r| r.metadata = MetadataVersion::V1_0),
        case("r4", Level::Raid4, &[64, 64, 64], |_| {}),
        case("r4-bitmap", Level::Raid4, &[64, 64, 64, 64], internal),
        case("r5-default-recover", Level::Raid5, &[64, 64, 64, 64], |r| r.sync = InitialSync::MdadmDefault),
        case("r5-bitmapchunk", Level::Raid5, &[64, 64, 64], |r| {
            r.bitmap = BitmapRequest::Internal { chunk_bytes: Some(1 << 20) }
        }),
        case("r6-resync", Level::Raid6, &[64, 64, 64, 64], |r| r.sync = InitialSync::Resync),
        case("r10-f2-odd", Level::Raid10, &[64, 64, 64], |r| r.layout = Some(0x201)),
        case("r10-spare", Level::Raid10, &[64, 64, 64, 64, 64], |r| {
            r.raid_devices = 4;
            internal(r);
        }),
        case("r5-size", Level::Raid5, &[64, 64, 64], |r| r.size_kib = Some(32 * 1024)),
        case("r6-chunk64", Level::Raid6, &[64, 64, 64, 64, 64], |r| r.chunk_kib = Some(64)),
    ];
    for alg in 0..=5u32 {
        for bitmap in [false, true] {
            let name: &'static str =
                Box::leak(format!("r5-alg{alg}{}", if bitmap { "-bm" } else { "" }).into_boxed_str());
            v.push(case(name, Level::Raid5, &[64, 64, 64, 64], |r| {
                r.layout = Some(alg);
                if bitmap {
                    internal(r);
                }
            }));
        }
    }
    for alg in [0u32, 1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 20] {
        let name: &'static str = Box::leak(format!("r6-alg{alg}").into_boxed_str());
        v.push(case(name, Level::Raid6, &[64, 64, 64, 64, 64], |r| {
            r.layout = Some(alg);
            if alg % 2 == 0 {
                internal(r);
            }
        }));
    }
    for (name, layout, n) in [
        ("r10-n2", 0x102u32, 4usize),
        ("r10-f2", 0x201, 4),
        ("r10-o2", 0x10201, 4),
        ("r10-n3", 0x103, 3),
        ("r10-o3", 0x10301, 5),
    ] {
        for bitmap in [false, true] {
            let name: &'static str = Box::leak(format!("{name}{}", if bitmap { "-bm" } else { "" }).into_boxed_str());
            v.push(case(name, Level::Raid10, &vec![64; n], |r| {
                r.layout = Some(layout);
                if bitmap {
                    internal(r);
                }
            }));
        }
    }
    v
}

fn mdadm_examine(path: &Path) -> String {
    let out = Command::new("mdadm").env("TZ", "UTC").arg("--examine").arg(path).output().expect("run mdadm");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mdadm --examine {} failed: {}{}",
        path.display(),
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// mdadm's field value for a label ("Raid Level" -> "raid5").
fn field<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(" : ")?;
        (k.trim() == label).then(|| v.trim())
    })
}

#[test]
fn mdadm_examine_agrees_with_mdkit() {
    require_tool("mdadm");
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for c in cases() {
        let p = plan(&c.req).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let members: Vec<MemberImage> = c
            .req
            .member_sizes_sectors
            .iter()
            .enumerate()
            .map(|(i, s)| MemberImage::sparse_file(&dir.path().join(format!("{}-{i}.img", c.name)), s * 512))
            .collect();
        write_plan(&p, &members);
        for (i, m) in members.iter().enumerate() {
            let theirs = mdadm_examine(&m.path);
            let sb = m.find_superblock().unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_eq!(sb, p.members[i].superblock, "{}: decoded superblock differs from the plan", c.name);
            let bitmap = sb.bitmap_sector().map(|_| m.bitmap(&sb).unwrap().0);
            let ours = render_text(&sb, bitmap.as_ref(), m.size_sectors());
            let theirs_body: String = theirs.lines().skip(1).map(|l| format!("{l}\n")).collect();
            assert!(theirs.starts_with(&format!("{}:\n", m.path.display())));
            assert!(field(&theirs, "Checksum").unwrap().ends_with("- correct"), "{}: {theirs}", c.name);
            assert_eq!(
                ours, theirs_body,
                "{} member {i}: mdkit examine text differs from mdadm's\n--- mdkit\n{ours}--- mdadm\n{theirs_body}",
                c.name
            );
            // Spot-check the facts the acceptance names, independently of the text equality.
            assert_eq!(field(&theirs, "Raid Level"), Some(c.req.level.name()), "{}", c.name);
            assert_eq!(field(&theirs, "Raid Devices").unwrap(), c.req.raid_devices.to_string(), "{}", c.name);
            let json = examine::render_json(&sb, bitmap.as_ref(), m.size_sectors());
            assert_eq!(json["checksum_correct"], true);
            assert_eq!(json["events"], 0);
            checked += 1;
        }
    }
    eprintln!("mdadm --examine agreed with mdkit on {checked} members");
}

#[test]
fn mdadm_examine_bitmap_on_loop_device() {
    require_tool("mdadm");
    require_tool("losetup");
    let dir = tempfile::tempdir().unwrap();
    let c = case("r5-bitmap-x", Level::Raid5, &[64, 64, 64], internal);
    let p = plan(&c.req).unwrap();
    let members: Vec<MemberImage> =
        (0..3).map(|i| MemberImage::sparse_file(&dir.path().join(format!("x{i}.img")), 64 * MIB * 512)).collect();
    write_plan(&p, &members);
    let out = Command::new("losetup").args(["--read-only", "--find", "--show"]).arg(&members[0].path).output().unwrap();
    if !out.status.success() {
        // Loop devices are part of the host set-up (scripts/test); say exactly what failed.
        panic!("losetup --read-only failed (needs root and the loop driver): {}", String::from_utf8_lossy(&out.stderr));
    }
    let loopdev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let x = Command::new("mdadm").env("TZ", "UTC").arg("--examine-bitmap").arg(&loopdev).output().unwrap();
    let detach = Command::new("losetup").arg("-d").arg(&loopdev).status();
    let text = String::from_utf8_lossy(&x.stdout).into_owned();
    assert!(x.status.success(), "mdadm -X {loopdev}: {text}{}", String::from_utf8_lossy(&x.stderr));
    assert!(detach.map(|s| s.success()).unwrap_or(false), "losetup -d {loopdev} failed");
    let sb = members[0].find_superblock().unwrap();
    let (bms, area) = members[0].bitmap(&sb).unwrap();
    let ours = render_bitmap_text(&bms, &loopdev, Some(&area));
    assert_eq!(ours, text, "--- mdkit\n{ours}--- mdadm\n{text}");
    assert_eq!(field(&text, "Chunksize"), Some("64 MB"));
    assert!(field(&text, "Bitmap").unwrap().contains("dirty (100.0%)"), "mdadm's create writes every bit set");
}
