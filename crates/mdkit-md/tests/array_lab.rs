//! The array runtime against the Linux kernel (Debian 6.1 md under qemu, `../shared/lab`), in two
//! boots:
//!
//! 1. The kernel creates arrays with `mdadm --create` (raid0 single- and multi-zone
//!    original/alternate, raid1 resynced by the kernel, raid10 n2/f2/o2), writes a pattern and
//!    stops them. On the host, mdkit assembles each one, reads exactly the kernel's data, finds 0
//!    mismatches with its own `check`, writes a second pattern and stops it clean. mdkit also
//!    creates its own arrays of the same levels and layouts (plus a raid1 and a raid10 that lose
//!    a member half way through the writes), resyncs them and writes the pattern.
//! 2. The kernel assembles every array: mdkit's (`mdadm --assemble --run`, the degraded ones
//!    degraded) and its own with mdkit's writes; each reads back exactly what was written (both
//!    patterns), and the kernel's `check` reports mismatch_cnt 0.
//!
//! Members are regions of one sparse file (GPT partitions in the guest). What the kernel reads
//! back is copied to a dump disk and compared on the host. Skips loudly (SKIP: ...) when the
//! lab cannot be built or booted.

use crate::array_util;
use crate::common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;

use array_util::*;
use common::lab::{GuestPartitions, LabRun, RunOptions, two_at_a_time};
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, SharedBuf, WriteFlags};
use mdkit_md::array::{Array, AssembleOptions, MemberDev, assemble, create};
use mdkit_md::layout::Level;

/// Bytes of the first pattern written to every array, and of the second (mdkit's writes to
/// kernel-made arrays, at offset PATTERN_BYTES).
const PATTERN_BYTES: u64 = 8 * MIB;
const PATTERN2_BYTES: u64 = 4 * MIB;

/// A region of the members file; in the guest, the partition `dev`.
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
    fn take(&mut self, mib: u64) -> Region {
        let dev = self.partitions.add(self.next, mib * MIB);
        let r = Region { offset: self.next, size: mib * MIB, dev };
        self.next += (mib + 1) * MIB;
        r
    }
}

fn devices(regions: &[Region]) -> String {
    regions.iter().map(|r| r.dev.as_str()).collect::<Vec<_>>().join(" ")
}

/// An array the kernel creates in boot 1.
struct KCase {
    name: &'static str,
    md: u32,
    args: &'static str,
    regions: Vec<Region>,
}

/// An array mdkit creates on the host.
struct MCase {
    name: &'static str,
    md: u32,
    level: Level,
    chunk_kib: Option<u32>,
    layout: Option<u32>,
    bitmap: bool,
    /// Fail this member half way through the writes.
    fail_member: Option<usize>,
    regions: Vec<Region>,
}

fn pattern_bytes(seed: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    Rng::new(seed).fill(&mut v);
    v
}

const PRELUDE: &str = r#"set -u
modprobe raid0; modprobe raid1; modprobe raid10
echo 1000000 > /proc/sys/dev/raid/speed_limit_min
echo 2000000 > /proc/sys/dev/raid/speed_limit_max
wait_idle() { local t=0; while [ "$(cat /sys/block/$1/md/sync_action 2>/dev/null || echo idle)" != idle ] && [ $t -lt 6000 ]; do sleep 0.1; t=$((t+1)); done; }
dump_at() { dd if=$1 of=/dev/vdc bs=1M skip=$2 count=$3 seek=$4 iflag=direct oflag=direct status=none && echo ok || echo failed; }
"#;

fn boot1_script(partitions: &GuestPartitions, k: &[KCase]) -> String {
    let mut cases = Vec::new();
    for c in k {
        let mut s = String::new();
        let list = devices(&c.regions);
        let md = format!("md{}", c.md);
        writeln!(s, "echo '=== {}'; echo uptime=$(cut -d' ' -f1 /proc/uptime)", c.name).unwrap();
        writeln!(
            s,
            "mdadm --create /dev/{md} --run --metadata=1.2 --homehost=lab --name={} {} {list} 2>&1 | sed 's/^/  | /'; echo create=${{PIPESTATUS[0]}}",
            c.name, c.args
        )
        .unwrap();
        writeln!(s, "wait_idle {md}").unwrap();
        writeln!(
            s,
            "dd if=/dev/vdb of=/dev/{md} bs=1M count={} oflag=direct status=none; echo write=$?",
            PATTERN_BYTES / MIB
        )
        .unwrap();
        writeln!(s, "sync; echo dump=$(dump_at /dev/{md} 0 {} {})", PATTERN_BYTES / MIB, dump_offset(c.md) / MIB)
            .unwrap();
        if !c.args.contains("raid0") {
            writeln!(s, "echo check > /sys/block/{md}/md/sync_action; wait_idle {md}; echo mismatch=$(cat /sys/block/{md}/md/mismatch_cnt)")
                .unwrap();
        }
        writeln!(s, "mdadm --stop /dev/{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
        cases.push((md, s));
    }
    script(partitions, &cases)
}

/// The prelude, the partitions, then the cases two at a time.
fn script(partitions: &GuestPartitions, cases: &[(String, String)]) -> String {
    let mut s = String::from(PRELUDE);
    s.push_str(&partitions.script());
    s.push_str(&two_at_a_time(cases));
    s.push_str("echo '=== end'\n");
    s
}

fn boot2_script(partitions: &GuestPartitions, k: &[KCase], m: &[MCase]) -> String {
    let mut cases: Vec<(&str, u32, bool, Vec<Region>, bool)> = Vec::new();
    for c in m {
        cases.push((c.name, c.md, c.level != Level::Raid0, c.regions.clone(), false));
    }
    for c in k {
        cases.push((c.name, c.md, !c.args.contains("raid0"), c.regions.clone(), true));
    }
    let (p1, p2) = (PATTERN_BYTES / MIB, PATTERN2_BYTES / MIB);
    let mut bodies = Vec::new();
    for (name, n, redundant, regions, second) in &cases {
        let mut s = String::new();
        let list = devices(regions);
        let md = format!("md{n}");
        writeln!(s, "echo '=== {name}'; echo uptime=$(cut -d' ' -f1 /proc/uptime)").unwrap();
        writeln!(s, "mdadm --assemble /dev/{md} --run {list} 2>&1 | sed 's/^/  | /'; echo assemble=${{PIPESTATUS[0]}}")
            .unwrap();
        if *redundant {
            writeln!(s, "wait_idle {md}; echo degraded=$(cat /sys/block/{md}/md/degraded)").unwrap();
        }
        let slot = dump_offset(*n) / MIB;
        writeln!(s, "echo dump=$(dump_at /dev/{md} 0 {p1} {slot})").unwrap();
        if *second {
            writeln!(s, "echo dump2=$(dump_at /dev/{md} {p1} {p2} {})", slot + p1).unwrap();
        }
        if *redundant {
            writeln!(s, "echo check > /sys/block/{md}/md/sync_action; wait_idle {md}; echo mismatch=$(cat /sys/block/{md}/md/mismatch_cnt)")
                .unwrap();
        }
        writeln!(s, "mdadm --stop /dev/{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
        bodies.push((md, s));
    }
    script(partitions, &bodies)
}

/// Where the guest copies what it reads from array `md` on the dump disk (/dev/vdc): the host
/// compares the copy with the pattern. Hashing in the guest (sha256sum under TCG) was most of
/// this test's guest time; a direct-I/O copy costs a fraction of that.
fn dump_offset(md: u32) -> u64 {
    u64::from(md) * 16 * MIB
}

/// Whether the guest's copy at `dump_offset(md) + at` (reported `ok` under `key`) equals `want`.
fn dumped_equals(s: &HashMap<String, String>, key: &str, dump: &Path, md: u32, at: u64, want: &[u8]) -> bool {
    s.get(key).map(String::as_str) == Some("ok")
        && common::lab::read_dump(dump, dump_offset(md) + at, want.len()) == want
}

/// `key=value` pairs of one section of the guest output.
fn section(run: &LabRun, name: &str) -> HashMap<String, String> {
    run.section(name)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with("  |"))
        .flat_map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter_map(|w| w.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

fn members(file: &DeviceRef, prefix: &str, regions: &[Region]) -> Vec<MemberDev> {
    regions
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let name = format!("{prefix}-{i}");
            MemberDev::new(name.clone(), Arc::new(RegionDevice::new(name, file.clone(), r.offset, r.size)) as DeviceRef)
        })
        .collect()
}

async fn write_pattern(a: &Array, at: u64, data: &[u8]) {
    for (i, chunk) in data.chunks(MIB as usize).enumerate() {
        a.write(at + i as u64 * MIB, SharedBuf::from_slice(chunk), WriteFlags::NONE).await.unwrap();
    }
}

#[test]
fn kernel_and_mdkit_read_each_others_arrays() {
    let lab = crate::lab_or_skip!("kernel_and_mdkit_read_each_others_arrays");
    let dir = lab.scratch_dir("array-lab");
    let members_file = dir.path().join("members.img");
    let pat_file = dir.path().join("pattern.img");
    let pat = pattern_bytes(1, PATTERN_BYTES);
    let pat2 = pattern_bytes(2, PATTERN2_BYTES);
    std::fs::write(&pat_file, &pat).unwrap();

    let mut regions = Regions { next: MIB, partitions: GuestPartitions::default() };
    let mut k: Vec<KCase> = Vec::new();
    let kdefs: Vec<(&str, &str, Vec<u64>)> = vec![
        // raid1 is resynced by the kernel; the others are created --assume-clean (faster under TCG).
        ("k-r0", "--level=raid0 --raid-devices=3 --chunk=64", vec![16; 3]),
        ("k-r0-orig", "--level=raid0 --raid-devices=3 --chunk=64 --layout=original", vec![12, 16, 20]),
        ("k-r0-alt", "--level=raid0 --raid-devices=3 --chunk=64 --layout=alternate", vec![12, 16, 20]),
        ("k-r1", "--level=raid1 --raid-devices=2 --bitmap=internal", vec![16; 2]),
        (
            "k-r10-n2",
            "--level=raid10 --raid-devices=4 --layout=n2 --chunk=64 --bitmap=internal --assume-clean",
            vec![16; 4],
        ),
        (
            "k-r10-f2",
            "--level=raid10 --raid-devices=4 --layout=f2 --chunk=64 --bitmap=none --assume-clean",
            vec![16; 4],
        ),
        (
            "k-r10-o2",
            "--level=raid10 --raid-devices=3 --layout=o2 --chunk=64 --bitmap=internal --assume-clean",
            vec![16; 3],
        ),
    ];
    for (i, (name, args, sizes)) in kdefs.into_iter().enumerate() {
        k.push(KCase { name, md: 100 + i as u32, args, regions: sizes.iter().map(|s| regions.take(*s)).collect() });
    }
    let mut m: Vec<MCase> = Vec::new();
    type MDef = (&'static str, Level, Vec<u64>, Option<u32>, Option<u32>, bool, Option<usize>);
    let mdefs: Vec<MDef> = vec![
        ("m-r0", Level::Raid0, vec![16; 3], Some(64), None, false, None),
        ("m-r0-orig", Level::Raid0, vec![12, 16, 20], Some(64), Some(1), false, None),
        ("m-r0-alt", Level::Raid0, vec![12, 16, 20], Some(64), Some(2), false, None),
        ("m-r1", Level::Raid1, vec![16; 2], None, None, true, None),
        ("m-r10-n2", Level::Raid10, vec![16; 4], Some(64), Some(0x102), true, None),
        ("m-r10-f2", Level::Raid10, vec![16; 4], Some(64), Some(0x201), false, None),
        ("m-r10-o2", Level::Raid10, vec![16; 3], Some(64), Some(0x10201), true, None),
        ("m-r1-degraded", Level::Raid1, vec![16; 2], None, None, true, Some(1)),
        ("m-r10-degraded", Level::Raid10, vec![16; 4], Some(64), Some(0x102), false, Some(2)),
    ];
    for (i, (name, level, sizes, chunk_kib, layout, bitmap, fail_member)) in mdefs.into_iter().enumerate() {
        let regs = sizes.iter().map(|s| regions.take(*s)).collect();
        m.push(MCase { name, md: 10 + i as u32, level, chunk_kib, layout, bitmap, fail_member, regions: regs });
    }
    let f = std::fs::File::create(&members_file).unwrap();
    f.set_len(regions.next + MIB).unwrap();
    drop(f);

    // Boot 1: the kernel creates and writes its arrays.
    let dump_file = dir.path().join("dump.img");
    std::fs::File::create(&dump_file).unwrap().set_len(dump_offset(120)).unwrap();
    let mut opts = RunOptions::with_disks(vec![members_file.clone(), pat_file.clone(), dump_file.clone()]);
    opts.timeout_secs = 1200;
    let run1 = lab.run(&opts, &boot1_script(&regions.partitions, &k)).unwrap_or_else(|e| panic!("lab boot 1: {e}"));
    eprintln!("lab: boot 1 (kernel creates {} arrays) took {:.1} s", k.len(), run1.elapsed.as_secs_f64());
    assert!(run1.output.contains("=== end"), "boot 1 did not finish:\n{}", run1.output);
    run1.assert_partitioned();
    for c in &k {
        let s = section(&run1, c.name);
        let ok = s.get("create").map(String::as_str) == Some("0")
            && s.get("write").map(String::as_str) == Some("0")
            && dumped_equals(&s, "dump", &dump_file, c.md, 0, &pat)
            && s.get("mismatch").is_none_or(|v| v == "0")
            && s.get("stop").map(String::as_str) == Some("0");
        assert!(ok, "{}: the kernel could not create/write its array:\n{}", c.name, run1.output);
    }

    // Host: mdkit reads the kernel's arrays and writes to them; creates its own.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let file: DeviceRef = Arc::new(FileDevice::open(&members_file, FileOptions::default()).unwrap());
        for c in &k {
            let r = assemble(
                members(&file, c.name, &c.regions),
                AssembleOptions { name: c.name.into(), ..Default::default() },
            )
            .await
            .unwrap_or_else(|e| panic!("{}: mdkit cannot assemble the kernel's array: {e}", c.name));
            assert!(r.refused.is_empty(), "{}: {:?}", c.name, r.refused);
            let a = r.array;
            let got = a.read_vec(0, PATTERN_BYTES as usize).await.unwrap();
            assert!(got == pat, "{}: mdkit reads different data than the kernel wrote", c.name);
            if a.info().level != Level::Raid0 {
                fast_sync(&a);
                assert_eq!(check(&a).await, 0, "{}: mdkit's check of the kernel's array", c.name);
            }
            write_pattern(&a, PATTERN_BYTES, &pat2).await;
            a.stop().await.unwrap();
        }
        for c in &m {
            let mut o = opts_for(c);
            o.name = c.name.to_string();
            let a = create(members(&file, c.name, &c.regions), o)
                .await
                .unwrap_or_else(|e| panic!("{}: create: {e}", c.name))
                .array;
            fast_sync(&a);
            let half = PATTERN_BYTES / 2;
            write_pattern(&a, 0, &pat[..half as usize]).await;
            if let Some(i) = c.fail_member {
                a.fail_member(&format!("{}-{i}", c.name)).await.unwrap();
            }
            write_pattern(&a, half, &pat[half as usize..]).await;
            a.wait_sync_idle().await;
            assert!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap() == pat, "{}: mdkit read-back", c.name);
            a.stop().await.unwrap();
        }
        file.flush().await.unwrap();
    });

    // Boot 2: the kernel assembles everything and checks it.
    let run2 = lab.run(&opts, &boot2_script(&regions.partitions, &k, &m)).unwrap_or_else(|e| panic!("lab boot 2: {e}"));
    eprintln!("lab: boot 2 (kernel assembles {} arrays) took {:.1} s", k.len() + m.len(), run2.elapsed.as_secs_f64());
    assert!(run2.output.contains("=== end"), "boot 2 did not finish:\n{}", run2.output);
    run2.assert_partitioned();
    let mut failures = Vec::new();
    for (name, md, degraded, redundant, second) in m
        .iter()
        .map(|c| (c.name, c.md, c.fail_member.is_some(), c.level != Level::Raid0, false))
        .chain(k.iter().map(|c| (c.name, c.md, false, !c.args.contains("raid0"), true)))
    {
        let s = section(&run2, name);
        let get = |key: &str| s.get(key).cloned().unwrap_or_else(|| "missing".into());
        let mut why = Vec::new();
        if get("assemble") != "0" {
            why.push(format!("assemble={}", get("assemble")));
        }
        if !dumped_equals(&s, "dump", &dump_file, md, 0, &pat) {
            why.push("data differs from what was written".to_string());
        }
        if second && !dumped_equals(&s, "dump2", &dump_file, md, PATTERN_BYTES, &pat2) {
            why.push("mdkit's writes to the kernel's array read back differently".to_string());
        }
        if redundant {
            let want = if degraded { "1" } else { "0" };
            if get("degraded") != want {
                why.push(format!("degraded={} (want {want})", get("degraded")));
            }
            if get("mismatch") != "0" {
                why.push(format!("mismatch_cnt={}", get("mismatch")));
            }
        }
        if !why.is_empty() {
            failures.push(format!("{name}: {}", why.join(", ")));
        }
    }
    assert!(failures.is_empty(), "{}\n\nguest output:\n{}", failures.join("\n"), run2.output);
    let _ = Path::new(&members_file);
}

fn opts_for(c: &MCase) -> mdkit_md::array::CreateOptions {
    let mut o = opts(c.level, c.regions.len() as u32, c.chunk_kib, c.layout, c.bitmap, false);
    o.homehost = Some("mdkit".into());
    o
}
