//! Kernel compatibility in the lab (Debian 6.1 kernel + mdadm 4.2 under qemu), in one boot:
//!
//! 1. mdkit -> kernel: member regions whose superblocks (and bitmaps) mdkit's create planning
//!    wrote (data area zero) are assembled by `mdadm --assemble` for every level and layout;
//!    the array size the kernel reports equals mdkit's; a pseudo-random pattern is written
//!    through the kernel (the whole array; the first 4 MiB for the raid5/raid6 layout
//!    matrix); `echo check > sync_action` ends with mismatch_cnt 0 (not repeated for the
//!    matrix, whose every P and Q block the host compares with mdkit's parity); after
//!    `mdadm --stop` the kernel's superblock rewrite decodes in mdkit with the events mdadm
//!    reports, and reading the members back through mdkit's layouts returns the pattern with
//!    every mirror copy equal and every P and Q block equal to mdkit's own parity (so the
//!    placement, the data order and the RAID6 syndrome order all match the kernel's).
//! 2. kernel -> mdkit: `mdadm --create` on the same kind of regions (host md is unavailable
//!    here, so this runs in the guest); mdkit decodes every superblock and bitmap and its own
//!    plan for the same parameters matches field by field (data offset, data size, size, bitmap
//!    offset/chunk/sync size, bad-block log, layout, roles).
//! 3. The kernel-made reference images of `examples/md-raid.sh` decode, and their first 16 MiB
//!    read back through mdkit's layouts is the pattern the example wrote.
//!
//! Skips loudly (SKIP: ...) when qemu or the lab are unavailable.

use crate::common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use common::images::{MemberImage, write_plan};
use common::lab::{GuestPartitions, RunOptions, two_at_a_time};
use common::verify::ArrayView;
use mdkit_md::format::create::{BitmapRequest, CreateRequest, InitialSync, plan};
use mdkit_md::format::examine::render_text;
use mdkit_md::format::superblock::{MetadataVersion, Superblock, feature};
use mdkit_md::layout::{Level, parse_layout};

const MIB: u64 = 1 << 20;

/// A region of the big members file; in the guest, the partition `dev` of /dev/vda.
#[derive(Clone)]
struct Region {
    offset: u64,
    size: u64,
    dev: String,
}

struct Regions {
    next: u64,
    partitions: GuestPartitions,
}

impl Regions {
    /// The first region starts at 1 MiB, after the GPT header and its entries.
    fn new() -> Regions {
        Regions { next: MIB, partitions: GuestPartitions::default() }
    }

    fn take(&mut self, size: u64) -> Region {
        let dev = self.partitions.add(self.next, size);
        let r = Region { offset: self.next, size, dev };
        self.next += size + MIB; // 1 MiB gap between members
        r
    }
}

/// An array mdkit creates and the kernel assembles.
struct MkCase {
    name: String,
    req: CreateRequest,
    regions: Vec<Region>,
    md: u32,
    pattern_offset: u64,
    /// One of the raid5/raid6 layout-matrix arrays: the kernel writes a few rotations of
    /// stripes (not the whole array) and runs no `check`, since the host verifies every P and
    /// Q block it wrote against mdkit's parity, which `check` would only repeat in the guest.
    layout_matrix: bool,
}

/// What the kernel writes into a layout-matrix array: 16 stripes or more of 4 data members,
/// several turns of every parity rotation.
const MATRIX_WRITE_BYTES: u64 = 4 * MIB;

/// An array mdadm creates in the guest and mdkit decodes.
struct MaCase {
    name: String,
    level: Level,
    metadata: MetadataVersion,
    chunk_kib: Option<u32>,
    layout: Option<&'static str>,
    bitmap: Option<Option<&'static str>>, // None = --bitmap=none, Some(None) = internal, Some(Some(c)) = internal + chunk
    regions: Vec<Region>,
    md: u32,
}

fn mk_cases(regions: &mut Regions) -> Vec<MkCase> {
    type Tweak = Box<dyn Fn(&mut CreateRequest)>;
    let mut v: Vec<(String, Level, Vec<u64>, Tweak)> = vec![
        ("r0-single".into(), Level::Raid0, vec![8; 3], Box::new(|_| {})),
        ("r0-orig".into(), Level::Raid0, vec![8, 10, 10, 12], Box::new(|r| r.layout = Some(1))),
        ("r0-alt".into(), Level::Raid0, vec![8, 10, 10, 12], Box::new(|r| r.layout = Some(2))),
        (
            "r1-bm".into(),
            Level::Raid1,
            vec![8; 2],
            Box::new(|r| r.bitmap = BitmapRequest::Internal { chunk_bytes: None }),
        ),
        (
            "r1-v10-bm".into(),
            Level::Raid1,
            vec![8; 2],
            Box::new(|r| {
                r.metadata = MetadataVersion::V1_0;
                r.bitmap = BitmapRequest::Internal { chunk_bytes: Some(1 << 20) };
            }),
        ),
        ("r4".into(), Level::Raid4, vec![8; 3], Box::new(|_| {})),
        (
            "r5-v11".into(),
            Level::Raid5,
            vec![8; 3],
            Box::new(|r| {
                r.metadata = MetadataVersion::V1_1;
                r.bitmap = BitmapRequest::Internal { chunk_bytes: None };
            }),
        ),
        ("r5-recover".into(), Level::Raid5, vec![8; 4], Box::new(|r| r.sync = InitialSync::MdadmDefault)),
        (
            "r6-resync".into(),
            Level::Raid6,
            vec![8; 4],
            Box::new(|r| {
                r.sync = InitialSync::Resync;
                r.bitmap = BitmapRequest::Internal { chunk_bytes: None };
            }),
        ),
        (
            "r10-n2".into(),
            Level::Raid10,
            vec![8; 4],
            Box::new(|r| r.bitmap = BitmapRequest::Internal { chunk_bytes: None }),
        ),
        ("r10-f2".into(), Level::Raid10, vec![8; 4], Box::new(|r| r.layout = Some(0x201))),
        ("r10-o2".into(), Level::Raid10, vec![8; 3], Box::new(|r| r.layout = Some(0x10201))),
        ("r10-n3".into(), Level::Raid10, vec![8; 3], Box::new(|r| r.layout = Some(0x103))),
        ("r10-f2-odd".into(), Level::Raid10, vec![8; 3], Box::new(|r| r.layout = Some(0x201))),
    ];
    for alg in 0..=5u32 {
        v.push((
            format!("r5-alg{alg}"),
            Level::Raid5,
            vec![8; 4],
            Box::new(move |r| {
                r.layout = Some(alg);
                if alg % 3 == 2 {
                    r.bitmap = BitmapRequest::Internal { chunk_bytes: None };
                }
            }),
        ));
    }
    for alg in [0u32, 1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 20] {
        v.push((
            format!("r6-alg{alg}"),
            Level::Raid6,
            vec![8; 5],
            Box::new(move |r| {
                r.layout = Some(alg);
                if alg == 2 || alg == 9 {
                    r.bitmap = BitmapRequest::Internal { chunk_bytes: None };
                }
            }),
        ));
    }
    v.into_iter()
        .enumerate()
        .map(|(i, (name, level, sizes, f))| {
            let regs: Vec<Region> = sizes.iter().map(|m| regions.take(m * MIB)).collect();
            let mut uuid = [0u8; 16];
            for (j, b) in uuid.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(29) ^ (j as u8).wrapping_mul(101) ^ 0x3c;
            }
            let mut req =
                CreateRequest::new(level, regs.iter().map(|r| r.size / 512).collect(), uuid, 1_790_000_000 + i as u64);
            req.name = name.clone();
            req.homehost = Some("mdkit".into());
            req.sync = InitialSync::AssumeClean;
            if level != Level::Raid1 {
                req.chunk_kib = Some(64);
            }
            f(&mut req);
            let layout_matrix = name.starts_with("r5-alg") || name.starts_with("r6-alg");
            MkCase { name, req, regions: regs, md: 1 + i as u32, pattern_offset: 0, layout_matrix }
        })
        .collect()
}

fn ma_cases(regions: &mut Regions) -> Vec<MaCase> {
    const GIB: u64 = 1024;
    // (name, level, metadata, member MiB, chunk KiB, --layout, bitmap: None = none,
    // Some(None) = internal, Some(Some(chunk)) = internal with --bitmap-chunk)
    type MaRow = (
        &'static str,
        Level,
        MetadataVersion,
        Vec<u64>,
        Option<u32>,
        Option<&'static str>,
        Option<Option<&'static str>>,
    );
    let list: Vec<MaRow> = vec![
        ("ma-r1", Level::Raid1, MetadataVersion::V1_2, vec![16, 16], None, None, Some(None)),
        ("ma-r1-nobm", Level::Raid1, MetadataVersion::V1_2, vec![16, 16], None, None, None),
        ("ma-r1-sizes", Level::Raid1, MetadataVersion::V1_2, vec![16, 20], None, None, Some(None)),
        ("ma-r1-bmchunk", Level::Raid1, MetadataVersion::V1_2, vec![16, 16], None, None, Some(Some("256K"))),
        ("ma-r5", Level::Raid5, MetadataVersion::V1_2, vec![16; 4], None, None, Some(None)),
        ("ma-r5-la-c64", Level::Raid5, MetadataVersion::V1_2, vec![16; 4], Some(64), Some("la"), None),
        (
            "ma-r6-c128",
            Level::Raid6,
            MetadataVersion::V1_2,
            vec![16; 5],
            Some(128),
            Some("ddf-N-continue"),
            Some(Some("1M")),
        ),
        ("ma-r4", Level::Raid4, MetadataVersion::V1_2, vec![16; 3], Some(32), None, Some(None)),
        ("ma-r10-n2", Level::Raid10, MetadataVersion::V1_2, vec![16; 4], None, None, Some(None)),
        ("ma-r10-f2", Level::Raid10, MetadataVersion::V1_2, vec![16; 4], Some(64), Some("f2"), None),
        ("ma-r10-o2", Level::Raid10, MetadataVersion::V1_2, vec![16; 3], Some(64), Some("o2"), Some(None)),
        ("ma-r0", Level::Raid0, MetadataVersion::V1_2, vec![16; 3], None, None, None),
        ("ma-r0-zones", Level::Raid0, MetadataVersion::V1_2, vec![16, 20, 24], Some(64), None, None),
        ("ma-v10-r1", Level::Raid1, MetadataVersion::V1_0, vec![16, 16], None, None, Some(None)),
        ("ma-v10-r5", Level::Raid5, MetadataVersion::V1_0, vec![16; 3], Some(64), None, Some(None)),
        ("ma-v11-r5", Level::Raid5, MetadataVersion::V1_1, vec![16; 3], None, None, Some(None)),
        ("ma-big-r1", Level::Raid1, MetadataVersion::V1_2, vec![10 * GIB; 2], None, None, Some(None)),
        ("ma-big-r6", Level::Raid6, MetadataVersion::V1_2, vec![GIB; 4], None, None, Some(None)),
        ("ma-huge-r5", Level::Raid5, MetadataVersion::V1_2, vec![210 * GIB; 3], None, None, Some(None)),
    ];
    list.into_iter()
        .enumerate()
        .map(|(i, (name, level, metadata, sizes, chunk_kib, layout, bitmap))| MaCase {
            name: name.into(),
            level,
            metadata,
            chunk_kib,
            layout,
            bitmap,
            regions: sizes.iter().map(|m| regions.take(m * MIB)).collect(),
            md: 100 + i as u32,
        })
        .collect()
}

/// The pattern written into mdkit-created arrays: 512-byte pseudo-random blocks.
fn pattern(offset: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    for (i, block) in out.chunks_mut(512).enumerate() {
        let mut rng = common::Rng::new(offset / 512 + i as u64);
        rng.fill(block);
    }
    out
}

/// Bytes of data in one full stripe (the unit the pattern is written in).
fn stripe_bytes(p: &mdkit_md::format::create::CreatePlan) -> u64 {
    let chunk = u64::from(p.chunk_sectors.max(128)) * 512;
    let data = match p.level {
        Level::Raid0 => p.raid_disks,
        Level::Raid1 => 1,
        Level::Raid10 => p.raid_disks,
        l => p.raid_disks - l.max_degraded(),
    };
    let stripe = chunk * u64::from(data);
    // The array must be a whole number of stripes; otherwise fall back to one chunk.
    if (p.array_sectors * 512).is_multiple_of(stripe) { stripe } else { chunk }
}

/// Bytes of the pattern the guest writes from the array's start: whole stripes, the whole
/// array except for the layout matrix.
fn written_bytes(c: &MkCase, p: &mdkit_md::format::create::CreatePlan) -> u64 {
    let stripe = stripe_bytes(p);
    let all = p.array_sectors * 512 / stripe;
    let n = if c.layout_matrix { all.min(MATRIX_WRITE_BYTES.div_ceil(stripe)) } else { all };
    n * stripe
}

fn guest_script(regions: &Regions, mk: &[MkCase], ma: &[MaCase], pattern_disk_blocks: u64) -> String {
    let mut s = String::from(
        r#"set -u
wait_idle() { local t=0; while [ "$(cat /sys/block/$1/md/sync_action 2>/dev/null || echo idle)" != idle ] && [ $t -lt 6000 ]; do sleep 0.1; t=$((t+1)); done; echo "waited_tenths=$t"; }
events_of() { for l in "$@"; do echo "events=$(mdadm --examine $l 2>/dev/null | awk '/ Events :/ {print $3}')"; done; }
modprobe raid0; modprobe raid1; modprobe raid10; modprobe raid456
"#,
    );
    s.push_str(&regions.partitions.script());
    writeln!(s, "echo pattern_blocks=$(( $(blockdev --getsize64 /dev/vdb) / 65536 )) expected={pattern_disk_blocks}")
        .unwrap();
    s.push_str(&two_at_a_time(&mk.iter().map(|c| (format!("md{}", c.md), mk_steps(c))).collect::<Vec<_>>()));
    s.push_str(&two_at_a_time(&ma.iter().map(|c| (format!("md{}", c.md), ma_steps(c))).collect::<Vec<_>>()));
    s.push_str("echo '=== end'\n");
    s
}

/// Guest steps for an mdkit-made array: assemble, write the pattern, check, stop, examine.
fn mk_steps(c: &MkCase) -> String {
    let mut s = String::new();
    let md = format!("md{}", c.md);
    let list: Vec<String> = c.regions.iter().map(|r| r.dev.clone()).collect();
    let list = list.join(" ");
    let redundant = c.req.level != Level::Raid0;
    writeln!(s, "echo '=== mk {}'", c.name).unwrap();
    writeln!(s, "echo uptime=$(cut -d' ' -f1 /proc/uptime)").unwrap();
    writeln!(s, "mdadm --assemble /dev/{md} --run {list} 2>&1 | sed 's/^/  | /'; echo assemble=${{PIPESTATUS[0]}}")
        .unwrap();
    if redundant {
        writeln!(s, "wait_idle {md}").unwrap();
        writeln!(s, "echo degraded=$(cat /sys/block/{md}/md/degraded)").unwrap();
    }
    writeln!(s, "echo size_bytes=$(blockdev --getsize64 /dev/{md})").unwrap();
    // Whole-stripe writes (no read-modify-write): far faster under TCG.
    let plan = plan(&c.req).unwrap();
    let stripe = stripe_bytes(&plan);
    writeln!(
        s,
        "dd if=/dev/vdb of=/dev/{md} bs={stripe} skip={} count={} iflag=direct oflag=direct status=none; echo write=$?",
        c.pattern_offset / stripe,
        written_bytes(c, &plan) / stripe
    )
    .unwrap();
    if redundant && !c.layout_matrix {
        // sync_action reads "check" as soon as it is requested, so no settle delay.
        writeln!(s, "echo check > /sys/block/{md}/md/sync_action; wait_idle {md}").unwrap();
        writeln!(s, "echo mismatch=$(cat /sys/block/{md}/md/mismatch_cnt)").unwrap();
    }
    writeln!(s, "mdadm --stop /dev/{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
    // mdadm's view of the events after --stop (first member; the host checks the rest).
    writeln!(s, "events_of {}", c.regions[0].dev).unwrap();
    s
}

/// Guest steps for an array mdadm creates: create (no resync), size, stop.
fn ma_steps(c: &MaCase) -> String {
    let mut s = String::new();
    let md = format!("md{}", c.md);
    let list: Vec<String> = c.regions.iter().map(|r| r.dev.clone()).collect();
    let list = list.join(" ");
    writeln!(s, "echo '=== ma {}'", c.name).unwrap();
    writeln!(s, "echo uptime=$(cut -d' ' -f1 /proc/uptime)").unwrap();
    let mut args =
        format!("--metadata={} --level={} --raid-devices={}", c.metadata.as_str(), c.level.md_level(), c.regions.len());
    if let Some(k) = c.chunk_kib {
        write!(args, " --chunk={k}").unwrap();
    }
    if let Some(l) = c.layout {
        write!(args, " --layout={l}").unwrap();
    }
    match c.bitmap {
        None if c.level != Level::Raid0 => args.push_str(" --bitmap=none"),
        None => {}
        Some(None) => args.push_str(" --bitmap=internal"),
        Some(Some(chunk)) => write!(args, " --bitmap=internal --bitmap-chunk={chunk}").unwrap(),
    }
    writeln!(s, "mdadm --create /dev/{md} --run --assume-clean {args} {list} 2>&1 | sed 's/^/  | /'; echo create=${{PIPESTATUS[0]}}").unwrap();
    writeln!(s, "echo size_bytes=$(blockdev --getsize64 /dev/{md})").unwrap();
    writeln!(s, "mdadm --stop /dev/{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
    s
}

/// `key=value` lines of a section.
fn kv(section: &str) -> HashMap<String, Vec<String>> {
    let mut m: HashMap<String, Vec<String>> = HashMap::new();
    for l in section.lines() {
        if let Some((k, v)) = l.split_once('=')
            && !k.is_empty()
            && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        {
            m.entry(k.to_string()).or_default().push(v.trim().to_string());
        }
    }
    m
}

fn one<'a>(m: &'a HashMap<String, Vec<String>>, k: &str) -> &'a str {
    m.get(k).and_then(|v| v.first()).map(String::as_str).unwrap_or("<missing>")
}

fn host_examine_region(file: &Path, r: &Region) -> Option<String> {
    let out = Command::new("losetup")
        .args([
            "--read-only",
            "--find",
            "--show",
            "--offset",
            &r.offset.to_string(),
            "--sizelimit",
            &r.size.to_string(),
        ])
        .arg(file)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let ex = Command::new("mdadm").env("TZ", "UTC").arg("--examine").arg(&dev).output();
    let _ = Command::new("losetup").arg("-d").arg(&dev).status();
    let ex = ex.ok()?;
    ex.status.success().then(|| String::from_utf8_lossy(&ex.stdout).lines().skip(1).map(|l| format!("{l}\n")).collect())
}

#[test]
fn kernel_assembles_mdkit_arrays_and_mdkit_reads_mdadm_arrays() {
    let lab = crate::lab_or_skip!("kernel_assembles_mdkit_arrays_and_mdkit_reads_mdadm_arrays");
    let dir = lab.scratch_dir("format-lab");
    let members_file = dir.path().join("members.img");
    let pattern_file = dir.path().join("pattern.img");
    let mut regions = Regions::new();
    let mk = mk_cases(&mut regions);
    let ma = ma_cases(&mut regions);
    std::fs::File::create(&members_file).unwrap().set_len(regions.next + MIB).unwrap();

    // Write mdkit's metadata into the mk regions.
    let mut plans = Vec::new();
    let mut max_array = 0;
    let mut mk = mk;
    let mut next_pattern = 0u64;
    for c in &mut mk {
        // Each array gets its own slice of the pattern disk, aligned to its stripe size.
        let p = plan(&c.req).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let stripe = stripe_bytes(&p);
        c.pattern_offset = next_pattern.div_ceil(stripe) * stripe;
        next_pattern = c.pattern_offset + 3 * MIB / 2;
    }
    for c in &mk {
        let p = plan(&c.req).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let images: Vec<MemberImage> =
            c.regions.iter().map(|r| MemberImage::region(&members_file, r.offset, r.size)).collect();
        write_plan(&p, &images);
        max_array = max_array.max(c.pattern_offset + p.array_sectors * 512);
        plans.push((p, images));
    }
    let pattern_len = max_array.div_ceil(MIB) * MIB;
    std::fs::write(&pattern_file, pattern(0, pattern_len)).unwrap();

    let script = guest_script(&regions, &mk, &ma, pattern_len / 65536);
    let mut opts = RunOptions::with_disks(vec![members_file.clone(), pattern_file.clone()]);
    opts.timeout_secs = 1500;
    let run = lab.run(&opts, &script).unwrap_or_else(|e| panic!("lab run failed: {e}"));
    eprintln!(
        "lab: guest ran {} mdkit-made and {} mdadm-made arrays in {:.1} s",
        mk.len(),
        ma.len(),
        run.elapsed.as_secs_f64()
    );
    assert_eq!(run.exit_code, 0, "guest script failed:\n{}", run.output);
    assert!(run.output.contains("=== end"), "guest did not finish:\n{}", run.output);
    run.assert_partitioned();

    let mut failures = Vec::new();
    for (c, (p, images)) in mk.iter().zip(&plans) {
        if let Err(e) = check_mk(c, p, images, &run, &members_file) {
            failures.push(format!("{}: {e}", c.name));
        }
    }
    for c in &ma {
        if let Err(e) = check_ma(c, &run, &members_file) {
            failures.push(format!("{}: {e}", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}\n\nguest output:\n{}",
        failures.len(),
        failures.join("\n"),
        run.output
    );
}

fn check_mk(
    c: &MkCase,
    p: &mdkit_md::format::create::CreatePlan,
    images: &[MemberImage],
    run: &common::lab::LabRun,
    file: &Path,
) -> Result<(), String> {
    let section = run.section(&format!("mk {}", c.name)).ok_or("no guest output")?;
    let m = kv(&section);
    for key in ["assemble", "write", "stop"] {
        if one(&m, key) != "0" {
            return Err(format!("{key} failed ({}):\n{section}", one(&m, key)));
        }
    }
    if c.req.level != Level::Raid0 {
        if !c.layout_matrix && one(&m, "mismatch") != "0" {
            return Err(format!("check found mismatch_cnt {}", one(&m, "mismatch")));
        }
        if one(&m, "degraded") != "0" {
            return Err(format!("array degraded after initial sync ({})", one(&m, "degraded")));
        }
    }
    let size: u64 = one(&m, "size_bytes").parse().map_err(|_| format!("bad size line:\n{section}"))?;
    if size != p.array_sectors * 512 {
        return Err(format!("kernel array size {size} bytes, mdkit planned {}", p.array_sectors * 512));
    }
    // The kernel's superblock rewrite decodes, with the events mdadm reports after --stop.
    let guest_events: u64 = one(&m, "events").parse().map_err(|_| format!("no events line:\n{section}"))?;
    let mut sbs = Vec::new();
    for (i, img) in images.iter().enumerate() {
        let sb = img.superblock_at(c.req.metadata)?;
        let planned = &p.members[i].superblock;
        // raid0 has nothing to mark dirty: the kernel may never rewrite its superblocks.
        let rewritten = sb.events > 0 || c.req.level == Level::Raid0;
        if sb.set_uuid != planned.set_uuid || sb.events != guest_events || !rewritten {
            return Err(format!(
                "member {i}: uuid/events {} (mdadm in the guest: {guest_events}) after the kernel rewrite",
                sb.events
            ));
        }
        if !sb.is_clean() {
            return Err(format!("member {i}: not clean after stop (resync_offset {})", sb.resync_offset_sectors));
        }
        if (sb.data_offset_sectors, sb.data_size_sectors, sb.level, sb.chunk_sectors, sb.raid_disks)
            != (
                planned.data_offset_sectors,
                planned.data_size_sectors,
                planned.level,
                planned.chunk_sectors,
                planned.raid_disks,
            )
        {
            return Err(format!("member {i}: kernel changed the geometry: {sb:?}"));
        }
        if let Some(off) = planned.bitmap_offset_sectors() {
            if sb.bitmap_offset_sectors() != Some(off) {
                return Err(format!("member {i}: bitmap offset {:?} != {off}", sb.bitmap_offset_sectors()));
            }
            let (bms, _) = img.bitmap(&sb)?;
            if bms.events != sb.events || bms.uuid != sb.set_uuid || bms.state != 0 {
                return Err(format!(
                    "member {i}: bitmap events {} state {} vs sb events {}",
                    bms.events, bms.state, sb.events
                ));
            }
        }
        sbs.push(sb);
    }
    // Every slot is active after assembly/recovery.
    let mut roles: Vec<u16> = sbs.iter().map(Superblock::raw_role).collect();
    roles.sort_unstable();
    if roles != (0..c.req.raid_devices as u16).collect::<Vec<_>>() {
        return Err(format!("roles after the kernel run: {roles:?}"));
    }
    // mdkit reads the kernel-written data through its layouts and verifies all redundancy.
    let view = ArrayView::new(images, &sbs)?;
    let data = view.read_verified(0, view.array_bytes())?;
    let mut expected = pattern(c.pattern_offset, written_bytes(c, p));
    expected.resize(data.len(), 0); // never written: the zero data area mdkit's plan left
    if data != expected {
        let first = data.iter().zip(&expected).position(|(a, b)| a != b).unwrap_or(0);
        return Err(format!("array data read through mdkit's layout differs from the pattern at byte {first}"));
    }
    // mdkit's examine text matches host mdadm on the kernel-written superblock.
    if let Some(theirs) = host_examine_region(file, &c.regions[0]) {
        let bitmap = sbs[0].bitmap_sector().map(|_| images[0].bitmap(&sbs[0]).map(|b| b.0)).transpose()?;
        let ours = render_text(&sbs[0], bitmap.as_ref(), images[0].size_sectors());
        if ours != theirs {
            return Err(format!("examine text differs\n--- mdkit\n{ours}--- mdadm\n{theirs}"));
        }
    }
    Ok(())
}

fn check_ma(c: &MaCase, run: &common::lab::LabRun, file: &Path) -> Result<(), String> {
    let section = run.section(&format!("ma {}", c.name)).ok_or("no guest output")?;
    let m = kv(&section);
    if one(&m, "create") != "0" || one(&m, "stop") != "0" {
        return Err(format!("mdadm --create/--stop failed:\n{section}"));
    }
    let images: Vec<MemberImage> = c.regions.iter().map(|r| MemberImage::region(file, r.offset, r.size)).collect();
    let mut sbs = Vec::new();
    let mut bitmaps = Vec::new();
    for img in &images {
        let sb = img.superblock_at(c.metadata)?;
        bitmaps.push(sb.bitmap_sector().map(|_| img.bitmap(&sb)).transpose()?.map(|b| b.0));
        sbs.push(sb);
    }
    // mdkit's plan for the same request.
    let sb0 = &sbs[0];
    let mut req = CreateRequest::new(c.level, images.iter().map(|i| i.size_sectors()).collect(), sb0.set_uuid, 0);
    req.metadata = c.metadata;
    req.sync = InitialSync::AssumeClean;
    req.chunk_kib = c.chunk_kib;
    req.layout = c.layout.map(|l| parse_layout(c.level, l).unwrap());
    req.bitmap = match c.bitmap {
        None => BitmapRequest::None,
        Some(None) => BitmapRequest::Internal { chunk_bytes: None },
        Some(Some(chunk)) => {
            let bytes = chunk.trim_end_matches(['K', 'M']).parse::<u32>().unwrap()
                << if chunk.ends_with('M') { 20 } else { 10 };
            BitmapRequest::Internal { chunk_bytes: Some(bytes) }
        }
    };
    let p = plan(&req).map_err(|e| format!("mdkit cannot plan what mdadm created: {e}"))?;
    let size: u64 = one(&m, "size_bytes").parse().map_err(|_| format!("bad size line:\n{section}"))?;
    if size != p.array_sectors * 512 {
        return Err(format!("kernel array size {size} bytes, mdkit computes {}", p.array_sectors * 512));
    }
    let mut diffs = Vec::new();
    for (i, (sb, mine)) in sbs.iter().zip(&p.members).enumerate() {
        let mine = &mine.superblock;
        let fields: [(&str, i128, i128); 17] = [
            ("level", sb.level.into(), mine.level.into()),
            ("layout", sb.layout.into(), mine.layout.into()),
            ("chunk_sectors", sb.chunk_sectors.into(), mine.chunk_sectors.into()),
            ("raid_disks", sb.raid_disks.into(), mine.raid_disks.into()),
            ("size_sectors", sb.size_sectors.into(), mine.size_sectors.into()),
            ("data_offset_sectors", sb.data_offset_sectors.into(), mine.data_offset_sectors.into()),
            ("data_size_sectors", sb.data_size_sectors.into(), mine.data_size_sectors.into()),
            ("super_offset_sectors", sb.super_offset_sectors.into(), mine.super_offset_sectors.into()),
            (
                "feature BITMAP_OFFSET",
                (sb.feature_map & feature::BITMAP_OFFSET).into(),
                (mine.feature_map & feature::BITMAP_OFFSET).into(),
            ),
            (
                "feature RAID0_LAYOUT",
                (sb.feature_map & feature::RAID0_LAYOUT).into(),
                (mine.feature_map & feature::RAID0_LAYOUT).into(),
            ),
            (
                "bitmap_offset",
                sb.bitmap_offset_sectors().unwrap_or(0).into(),
                mine.bitmap_offset_sectors().unwrap_or(0).into(),
            ),
            ("bblog_offset_sectors", sb.bblog_offset_sectors.into(), mine.bblog_offset_sectors.into()),
            ("bblog_size_sectors", sb.bblog_size_sectors.into(), mine.bblog_size_sectors.into()),
            ("max_dev", sb.max_dev().into(), mine.max_dev().into()),
            ("dev_number", sb.dev_number.into(), mine.dev_number.into()),
            ("role", sb.raw_role().into(), mine.raw_role().into()),
            ("devflags", sb.devflags.into(), mine.devflags.into()),
        ];
        for (name, theirs, ours) in fields {
            if theirs != ours {
                diffs.push(format!("member {i} {name}: mdadm {theirs}, mdkit {ours}"));
            }
        }
        if sb.dev_roles != mine.dev_roles {
            diffs.push(format!("member {i} dev_roles differ"));
        }
        match (&bitmaps[i], &p.bitmap) {
            (Some(theirs), Some(ours)) => {
                let pairs = [
                    ("bitmap chunk_bytes", u64::from(theirs.chunk_bytes), u64::from(ours.chunk_bytes)),
                    ("bitmap sync_size_sectors", theirs.sync_size_sectors, ours.sync_size_sectors),
                    ("bitmap daemon_sleep", theirs.daemon_sleep_secs.into(), ours.daemon_sleep_secs.into()),
                    ("bitmap write_behind", theirs.write_behind.into(), ours.write_behind.into()),
                    ("bitmap version", theirs.version.into(), ours.version.into()),
                ];
                for (name, t, o) in pairs {
                    if t != o {
                        diffs.push(format!("member {i} {name}: mdadm {t}, mdkit {o}"));
                    }
                }
                if theirs.uuid != sb.set_uuid {
                    diffs.push(format!("member {i}: bitmap uuid differs from the array uuid"));
                }
            }
            (None, None) => {}
            (t, o) => diffs.push(format!("member {i}: bitmap mdadm {} mdkit {}", t.is_some(), o.is_some())),
        }
    }
    if diffs.is_empty() { Ok(()) } else { Err(diffs.join("\n")) }
}

/// The reference images made by the lab's md-raid.sh example.
#[test]
fn kernel_reference_images_decode_and_read_back() {
    let lab = crate::lab_or_skip!("kernel_reference_images_decode_and_read_back");
    let dir = lab.images_dir();
    let mut groups = 0;
    for level in ["raid1", "raid5", "raid6", "raid10"] {
        let images: Vec<MemberImage> = (0..8)
            .map(|i| dir.join(format!("{level}-{i}.img")))
            .take_while(|p| p.exists())
            .map(|p| {
                let len = std::fs::metadata(&p).unwrap().len();
                MemberImage::region(&p, 0, len)
            })
            .collect();
        if images.is_empty() {
            eprintln!(
                "SKIP: {level}: no reference images in {} (run {}/examples/md-raid.sh)",
                dir.display(),
                lab.dir.display()
            );
            continue;
        }
        let sbs: Vec<Superblock> =
            images.iter().map(|i| i.find_superblock().unwrap_or_else(|e| panic!("{level}: {e}"))).collect();
        let events = sbs[0].events;
        for (i, sb) in sbs.iter().enumerate() {
            assert_eq!(sb.set_uuid, sbs[0].set_uuid, "{level} member {i}: uuid");
            assert_eq!(sb.events, events, "{level} member {i}: events");
            assert!(sb.is_clean(), "{level} member {i}: stopped clean");
            assert_eq!(sb.metadata_version(), MetadataVersion::V1_2);
            let (bms, area) = images[i].bitmap(sb).unwrap_or_else(|e| panic!("{level} member {i}: {e}"));
            assert_eq!(bms.events, events, "{level} member {i}: bitmap events");
            assert_eq!(bms.uuid, sb.set_uuid);
            assert_eq!(
                mdkit_md::format::bitmap::count_dirty(&area, &bms.geometry().unwrap()),
                0,
                "{level}: bits clear after a clean stop"
            );
        }
        // md-raid.sh wrote 16 MiB of `yes 'mdlab reference pattern 0123456789abcdef'`.
        let line = b"mdlab reference pattern 0123456789abcdef\n";
        let want: Vec<u8> = line.iter().copied().cycle().take(16 << 20).collect();
        let view = ArrayView::new(&images, &sbs).unwrap_or_else(|e| panic!("{level}: {e}"));
        let got = view.read_verified(0, 16 << 20).unwrap_or_else(|e| panic!("{level}: {e}"));
        assert!(got == want, "{level}: the first 16 MiB read through mdkit's layout are not the example's pattern");
        groups += 1;
    }
    eprintln!("decoded and read back {groups} kernel-made reference arrays");
}
