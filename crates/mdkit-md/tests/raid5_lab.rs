//! raid4/5/6 between the mdkit runtime and the Linux kernel (lab: Debian 6.1 + mdadm 4.2 under
//! qemu), both ways, in two boots. Members are byte ranges of one host file (GPT partitions in
//! the guest, a slice device over an io_uring FileDevice on the host).
//!
//! Boot 1:
//! - **mdkit → kernel.** Arrays mdkit created through the runtime (raid4; raid5 left-symmetric
//!   with a bitmap, right-asymmetric, left-asymmetric; raid6 left-symmetric with a bitmap,
//!   DDF rotating-N-continue, left-symmetric-6; a raid5 that lost one member and a raid6 that
//!   lost two, both written while degraded) and wrote with full-stripe and partial-stripe
//!   (read-modify-write / reconstruct-write) writes, at stripe_size 4 KiB and 64 KiB: the
//!   kernel assembles each, reads exactly what mdkit wrote (the whole array, copied to a dump
//!   disk and hashed on the host), and its `check` reports mismatch_cnt 0 (healthy arrays).
//! - **kernel-made arrays.** mdadm creates raid4/5/6 arrays (the kernel runs the initial
//!   resync/recovery), dd writes known data (whole stripes and odd partial writes), `check`
//!   says 0.
//!
//! Host: mdkit assembles the kernel's arrays and reads exactly the kernel's data, its own check
//! agrees (0), then writes to them (partial-stripe RMW/RCW writes and full stripes) and stops.
//!
//! Boot 2: the kernel assembles those arrays again, reads exactly what mdkit wrote, and its
//! `check` reports 0.
//!
//! Skips loudly (SKIP: ...) when the lab cannot be built or booted.

use crate::array_util;
use crate::common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use array_util::{MIB, Model, fast_sync, random_write, verify_all};
use common::lab::{GuestPartitions, RunOptions, two_at_a_time};
use mdkit_io::{
    BlockDevice, DeviceRef, FileDevice, FileOptions, IoBuf, IoFuture, ReadResult, Rng, SharedBuf, Topology, WriteFlags,
    ZeroFlags,
};
use mdkit_md::array::{Array, AssembleOptions, CreateOptions, MemberDev, assemble, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::layout::Level;

const REGION: u64 = 16 * MIB;

/// Where region `r` of the members file starts: after a MiB for the GPT that makes the regions
/// partitions in the guest.
fn region_offset(r: u64) -> u64 {
    MIB + r * REGION
}

/// Region `r` in the guest (partition r + 1 of /dev/vda, see [`partitions`]).
fn region_dev(r: u64) -> String {
    format!("/dev/vda{}", r + 1)
}

/// The guest steps that make regions `0..n` partitions (numbered as [`region_dev`]).
fn partitions(n: u64) -> String {
    let mut p = GuestPartitions::default();
    for r in 0..n {
        assert_eq!(p.add(region_offset(r), REGION), region_dev(r));
    }
    p.script()
}
const PATTERN_BYTES: u64 = 8 * MIB;

/// A byte range of the shared members file, as a member device.
struct Slice {
    name: String,
    inner: DeviceRef,
    offset: u64,
    topo: Topology,
}

impl Slice {
    fn member(inner: &DeviceRef, name: String, offset: u64) -> MemberDev {
        let mut topo = inner.topology();
        topo.size_bytes = REGION;
        let d: DeviceRef = Arc::new(Slice { name: name.clone(), inner: inner.clone(), offset, topo });
        MemberDev::new(name, d)
    }
}

impl BlockDevice for Slice {
    fn name(&self) -> &str {
        &self.name
    }
    fn topology(&self) -> Topology {
        self.topo
    }
    fn read(&self, off: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topo, mdkit_io::IoOp::Read, off, buf.len() as u64) {
            return Box::pin(std::future::ready((buf, Err(e))));
        }
        self.inner.read(self.offset + off, buf)
    }
    fn write(&self, off: u64, buf: SharedBuf, f: WriteFlags) -> IoFuture<'_, std::io::Result<()>> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topo, mdkit_io::IoOp::Write, off, buf.len() as u64) {
            return Box::pin(std::future::ready(Err(e)));
        }
        self.inner.write(self.offset + off, buf, f)
    }
    fn flush(&self) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, off: u64, len: u64) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.discard(self.offset + off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: ZeroFlags) -> IoFuture<'_, std::io::Result<()>> {
        self.inner.write_zeroes(self.offset + off, len, f)
    }
}

/// An array mdkit makes: name, level, members, chunk KiB, layout, bitmap, members it loses.
type MkSpec = (&'static str, Level, usize, u32, Option<u32>, bool, Vec<usize>);
/// An array the kernel makes: name, level, members, chunk KiB, mdadm --layout, bitmap.
type KmSpec = (&'static str, Level, usize, u32, Option<&'static str>, bool);

/// An array mdkit makes for the kernel.
struct Mk {
    name: &'static str,
    level: Level,
    n: usize,
    chunk_kib: u32,
    layout: Option<u32>,
    bitmap: bool,
    /// Members failed (and removed) half-way through the writes.
    lose: Vec<usize>,
    md: u32,
    first_region: u64,
    md5: String,
    size_bytes: u64,
}

/// An array the kernel makes for mdkit.
struct Km {
    name: &'static str,
    level: Level,
    n: usize,
    chunk_kib: u32,
    layout: Option<&'static str>,
    bitmap: bool,
    md: u32,
    first_region: u64,
    /// dd writes in order: (array 4 KiB block, pattern 4 KiB block, blocks).
    writes: Vec<(u64, u64, u64)>,
    md5_after_mdkit: String,
}

fn md5(bytes: &[u8]) -> String {
    let mut child = Command::new("md5sum").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("run md5sum");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or("").to_string()
}

fn members_of(file: &DeviceRef, first_region: u64, n: usize, prefix: &str) -> Vec<MemberDev> {
    (0..n).map(|i| Slice::member(file, format!("{prefix}{i}"), region_offset(first_region + i as u64))).collect()
}

fn kv(section: &str) -> HashMap<String, String> {
    section
        .lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit()))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

const GUEST_PRELUDE: &str = r#"set -u
wait_idle() { local t=0; while [ "$(cat /sys/block/$1/md/sync_action 2>/dev/null || echo idle)" != idle ] && [ $t -lt 6000 ]; do sleep 0.1; t=$((t+1)); done; }
modprobe raid456
"#;

fn devices(first_region: u64, members: &[usize]) -> String {
    members.iter().map(|i| region_dev(first_region + *i as u64)).collect::<Vec<_>>().join(" ")
}

/// Where array `md`'s contents go on the dump disk: the guest copies each array there and the
/// host hashes it. Hashing in the guest (md5sum under TCG) took most of this test's guest
/// time, about 60% of the second boot; a direct-I/O copy costs a fraction of that.
fn dump_offset(md: u32) -> u64 {
    u64::from(md) * DUMP_SLOT
}

/// Room for one array on the dump disk: the largest array has fewer than 6 regions of data.
const DUMP_SLOT: u64 = 6 * REGION;

/// md5 of what the guest copied from array `md` to the dump disk (`size` bytes, as the guest
/// reported it), or a marker when the size is missing.
fn dumped_md5(dump: &Path, md: u32, size: Option<&String>) -> String {
    let Some(size) = size.and_then(|s| s.parse::<usize>().ok()) else {
        return "<no size>".into();
    };
    md5(&common::lab::read_dump(dump, dump_offset(md), size))
}

/// Guest steps for one existing array: assemble, a copy to the dump disk `dump_dev` (the host
/// hashes it), degraded, check (healthy), stop.
fn verify_in_guest(
    tag: &str,
    md: u32,
    first_region: u64,
    members: &[usize],
    healthy: bool,
    dump_dev: &str,
) -> (String, String) {
    let mut s = String::new();
    let list = devices(first_region, members);
    writeln!(s, "echo '=== {tag}'").unwrap();
    writeln!(s, "mdadm --assemble /dev/md{md} --run {list} 2>&1 | sed 's/^/  | /'; echo assemble=${{PIPESTATUS[0]}}")
        .unwrap();
    writeln!(s, "grep -A1 '^md{md} ' /proc/mdstat | sed 's/^/  | /'").unwrap();
    writeln!(s, "echo size_bytes=$(blockdev --getsize64 /dev/md{md})").unwrap();
    writeln!(s, "echo degraded=$(cat /sys/block/md{md}/md/degraded)").unwrap();
    writeln!(
        s,
        "dd if=/dev/md{md} of={dump_dev} bs=1M seek={} iflag=direct oflag=direct status=none; echo dump=$?",
        dump_offset(md) / MIB
    )
    .unwrap();
    if healthy {
        writeln!(s, "echo check > /sys/block/md{md}/md/sync_action; wait_idle md{md}").unwrap();
        writeln!(s, "echo mismatch=$(cat /sys/block/md{md}/md/mismatch_cnt)").unwrap();
    }
    writeln!(s, "mdadm --stop /dev/md{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
    (format!("md{md}"), s)
}

fn create_in_guest(k: &Km) -> (String, String) {
    let mut s = String::new();
    let all: Vec<usize> = (0..k.n).collect();
    let list = devices(k.first_region, &all);
    writeln!(s, "echo '=== km {}'", k.name).unwrap();
    let mut args =
        format!("--metadata=1.2 --level={} --raid-devices={} --chunk={}", k.level.md_level(), k.n, k.chunk_kib);
    if let Some(l) = k.layout {
        write!(args, " --layout={l}").unwrap();
    }
    args.push_str(if k.bitmap { " --bitmap=internal" } else { " --bitmap=none" });
    let md = k.md;
    writeln!(
        s,
        "mdadm --create /dev/md{md} --run {args} {list} 2>&1 | sed 's/^/  | /'; echo create=${{PIPESTATUS[0]}}"
    )
    .unwrap();
    writeln!(s, "sleep 0.5; mdadm --wait /dev/md{md} >/dev/null 2>&1; wait_idle md{md}").unwrap();
    writeln!(s, "echo degraded=$(cat /sys/block/md{md}/md/degraded)").unwrap();
    writeln!(s, "echo size_bytes=$(blockdev --getsize64 /dev/md{md})").unwrap();
    writeln!(s, "w=0").unwrap();
    for (b, p, n) in &k.writes {
        writeln!(
            s,
            "dd if=/dev/vdb of=/dev/md{md} bs=4096 skip={p} seek={b} count={n} iflag=direct oflag=direct status=none || w=1"
        )
        .unwrap();
    }
    writeln!(s, "echo write=$w").unwrap();
    writeln!(s, "echo check > /sys/block/md{md}/md/sync_action; wait_idle md{md}").unwrap();
    writeln!(s, "echo mismatch=$(cat /sys/block/md{md}/md/mismatch_cnt)").unwrap();
    writeln!(s, "mdadm --stop /dev/md{md} 2>&1 | sed 's/^/  | /'; echo stop=${{PIPESTATUS[0]}}").unwrap();
    (format!("md{md}"), s)
}

/// Writes through the runtime: whole-array fill (full stripes), then partial writes at
/// stripe_size 4 KiB and 64 KiB; `lose` members fail half-way (written degraded after).
async fn mdkit_workload(a: &Array, m: &mut Model, rng: &mut Rng, lose: &[String]) {
    array_util::fill(a, m, rng).await;
    for _ in 0..60 {
        random_write(a, m, rng, 24).await;
    }
    for name in lose {
        a.fail_member(name).await.unwrap();
        a.remove_member(name).await.unwrap();
    }
    a.set_attribute("stripe_size", "65536").unwrap();
    for _ in 0..60 {
        random_write(a, m, rng, 24).await;
    }
    a.set_attribute("stripe_size", "8192").unwrap();
    // A few full stripes among partial ones.
    let stripe = u64::from(a.topology().optimal_io_bytes);
    for k in 0..3 {
        let off = (k * 5 + 1) * stripe;
        if off + stripe <= a.size_bytes() {
            let mut b = vec![0u8; stripe as usize];
            rng.fill(&mut b);
            m.apply(off, &b);
            a.write(off, SharedBuf::from_slice(&b), WriteFlags::NONE).await.unwrap();
        }
        random_write(a, m, rng, 24).await;
    }
    verify_all(a, m).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_and_mdkit_share_raid456_arrays_both_ways() {
    let lab = crate::lab_or_skip!("kernel_and_mdkit_share_raid456_arrays_both_ways");
    let seed = array_util::seed("kernel_and_mdkit_share_raid456_arrays_both_ways", 91);
    let mut rng = Rng::new(seed);
    let dir = lab.scratch_dir("raid5-lab");
    let members_path = dir.path().join("members.img");
    let pattern_path = dir.path().join("pattern.img");

    let mut next_region = 0u64;
    let mut take = |n: usize| {
        let r = next_region;
        next_region += n as u64;
        r
    };
    let mk_spec: Vec<MkSpec> = vec![
        ("raid4", Level::Raid4, 3, 64, None, false, vec![]),
        ("raid5-ls-bitmap", Level::Raid5, 4, 64, None, true, vec![]),
        ("raid5-ra", Level::Raid5, 3, 128, Some(1), false, vec![]),
        ("raid5-la", Level::Raid5, 4, 32, Some(0), false, vec![]),
        ("raid6-ls-bitmap", Level::Raid6, 5, 64, None, true, vec![]),
        ("raid6-ddf-nc", Level::Raid6, 5, 32, Some(10), false, vec![]),
        ("raid6-ls6", Level::Raid6, 4, 64, Some(18), false, vec![]),
        ("raid5-degraded", Level::Raid5, 4, 64, None, true, vec![1]),
        ("raid6-degraded2", Level::Raid6, 5, 64, None, false, vec![0, 3]),
    ];
    let mut mk: Vec<Mk> = mk_spec
        .into_iter()
        .enumerate()
        .map(|(i, (name, level, n, chunk_kib, layout, bitmap, lose))| Mk {
            name,
            level,
            n,
            chunk_kib,
            layout,
            bitmap,
            lose,
            md: 10 + i as u32,
            first_region: take(n),
            md5: String::new(),
            size_bytes: 0,
        })
        .collect();
    let km_spec: Vec<KmSpec> = vec![
        ("raid5-ls", Level::Raid5, 4, 64, None, false),
        ("raid6-la-bitmap", Level::Raid6, 6, 32, Some("left-asymmetric"), true),
        ("raid4", Level::Raid4, 3, 64, None, false),
        ("raid6-rs", Level::Raid6, 4, 128, Some("right-symmetric"), false),
    ];
    let mut km: Vec<Km> = km_spec
        .into_iter()
        .enumerate()
        .map(|(i, (name, level, n, chunk_kib, layout, bitmap))| {
            // Writes: 3 MiB from the start (whole stripes and a partial tail), then odd ones.
            let mut writes = vec![(0, 0, 768)];
            for _ in 0..24 {
                let len = 1 + rng.below(12);
                writes.push((rng.below(6000), rng.below(PATTERN_BYTES / 4096 - len), len));
            }
            Km {
                name,
                level,
                n,
                chunk_kib,
                layout,
                bitmap,
                md: 30 + i as u32,
                first_region: take(n),
                writes,
                md5_after_mdkit: String::new(),
            }
        })
        .collect();
    // A free MiB after the last region for the backup GPT.
    std::fs::File::create(&members_path).unwrap().set_len(region_offset(next_region) + MIB).unwrap();
    let mut pattern = vec![0u8; PATTERN_BYTES as usize];
    rng.fill(&mut pattern);
    std::fs::write(&pattern_path, &pattern).unwrap();
    let file: DeviceRef = Arc::new(FileDevice::open(&members_path, FileOptions::default()).unwrap());

    // mdkit makes and writes its arrays.
    for m in &mut mk {
        let devs = members_of(&file, m.first_region, m.n, &format!("{}-", m.name));
        let mut o = CreateOptions::new(format!("mk-{}", m.name), m.level, m.n as u32);
        o.chunk_kib = Some(m.chunk_kib);
        o.layout = m.layout;
        o.bitmap = if m.bitmap { BitmapRequest::Internal { chunk_bytes: None } } else { BitmapRequest::None };
        let a = create(devs, o).await.unwrap_or_else(|e| panic!("{}: create: {e}", m.name)).array;
        fast_sync(&a);
        a.wait_sync_idle().await;
        assert_eq!(a.core().degraded(), 0, "{}: initial sync", m.name);
        let mut model = Model::new(a.size_bytes());
        let lose: Vec<String> = m.lose.iter().map(|i| format!("{}-{i}", m.name)).collect();
        mdkit_workload(&a, &mut model, &mut rng, &lose).await;
        assert_eq!(a.core().degraded() as usize, m.lose.len());
        a.stop().await.unwrap();
        m.md5 = md5(&model.data);
        m.size_bytes = a.size_bytes();
    }

    // Boot 1, two arrays at a time.
    let mut s = String::from(GUEST_PRELUDE);
    s.push_str(&partitions(next_region));
    let mut cases = Vec::new();
    for m in &mk {
        let present: Vec<usize> = (0..m.n).filter(|i| !m.lose.contains(i)).collect();
        let tag = format!("mk {}", m.name);
        cases.push(verify_in_guest(&tag, m.md, m.first_region, &present, m.lose.is_empty(), "/dev/vdc"));
    }
    cases.extend(km.iter().map(create_in_guest));
    s.push_str(&two_at_a_time(&cases));
    s.push_str("echo '=== end'\n");
    let dump_path = dir.path().join("dump.img");
    std::fs::File::create(&dump_path).unwrap().set_len(dump_offset(40)).unwrap();
    let mut opts = RunOptions::with_disks(vec![members_path.clone(), pattern_path.clone(), dump_path.clone()]);
    opts.timeout_secs = 1500;
    let run = tokio::task::block_in_place(|| lab.run(&opts, &s)).unwrap_or_else(|e| panic!("lab run failed: {e}"));
    eprintln!("lab boot 1: {:.1} s", run.elapsed.as_secs_f64());
    assert!(run.output.contains("=== end"), "guest did not finish:\n{}", run.output);
    run.assert_partitioned();
    let mut failures = Vec::new();
    for m in &mk {
        let sec = run.section(&format!("mk {}", m.name)).unwrap_or_default();
        let mut v = kv(&sec);
        v.insert("md5".into(), dumped_md5(&dump_path, m.md, v.get("size_bytes")));
        let get = |k: &str| v.get(k).map(String::as_str).unwrap_or("<missing>");
        let healthy = m.lose.is_empty();
        let mut bad = Vec::new();
        if get("assemble") != "0" || get("stop") != "0" {
            bad.push("assemble/stop failed".to_string());
        }
        if get("size_bytes") != m.size_bytes.to_string() {
            bad.push(format!("kernel size {} != mdkit {}", get("size_bytes"), m.size_bytes));
        }
        if get("md5") != m.md5 {
            bad.push(format!("kernel reads md5 {} != mdkit wrote {}", get("md5"), m.md5));
        }
        if get("degraded") != m.lose.len().to_string() {
            bad.push(format!("degraded {} != {}", get("degraded"), m.lose.len()));
        }
        if healthy && get("mismatch") != "0" {
            bad.push(format!("kernel check mismatch_cnt {}", get("mismatch")));
        }
        if !bad.is_empty() {
            failures.push(format!("mdkit-made {}: {}\n{sec}", m.name, bad.join("; ")));
        }
    }
    for k in &km {
        let sec = run.section(&format!("km {}", k.name)).unwrap_or_default();
        let v = kv(&sec);
        let get = |x: &str| v.get(x).map(String::as_str).unwrap_or("<missing>");
        if get("create") != "0"
            || get("write") != "0"
            || get("stop") != "0"
            || get("mismatch") != "0"
            || get("degraded") != "0"
        {
            failures.push(format!("kernel-made {}: create/write/check/stop failed:\n{sec}", k.name));
        }
    }
    assert!(failures.is_empty(), "boot 1:\n{}\n\nguest output:\n{}", failures.join("\n"), run.output);

    // mdkit reads the kernel's arrays exactly, checks them, writes to them.
    for k in &mut km {
        let devs = members_of(&file, k.first_region, k.n, &format!("{}-", k.name));
        let got = assemble(devs, AssembleOptions { name: format!("km-{}", k.name), ..Default::default() })
            .await
            .unwrap_or_else(|e| panic!("kernel-made {}: assemble: {e}", k.name));
        let a = got.array;
        assert_eq!(a.core().degraded(), 0, "{}: {:?}", k.name, got.notes);
        assert_eq!(a.info().level, k.level);
        let mut model = Model::new(a.size_bytes());
        for (b, p, n) in &k.writes {
            let (off, len) = (b * 4096, n * 4096);
            if off + len <= a.size_bytes() {
                model.apply(off, &pattern[(p * 4096) as usize..(p * 4096 + len) as usize]);
            }
        }
        // Exactly the kernel's data (verify_all panics naming the first differing byte).
        eprintln!("kernel-made {}: mdkit reads {} bytes and compares", k.name, a.size_bytes());
        verify_all(&a, &model).await;
        fast_sync(&a);
        assert_eq!(array_util::check(&a).await, 0, "kernel-made {}: mdkit's check of kernel parity", k.name);
        // Partial-stripe writes (RMW and RCW), at two stripe sizes, and a full stripe.
        let partial = |a: &Array| -> (u64, u64) {
            let g = |k: &str| a.get_attribute(k).unwrap().parse::<u64>().unwrap();
            (g("rmw_writes"), g("rcw_writes"))
        };
        let before = partial(&a);
        for (i, size) in ["4096", "65536"].into_iter().enumerate() {
            a.set_attribute("stripe_size", size).unwrap();
            a.set_attribute("rmw_level", if i == 0 { "2" } else { "1" }).unwrap();
            for _ in 0..40 {
                random_write(&a, &mut model, &mut rng, 16).await;
            }
        }
        let stripe = u64::from(a.topology().optimal_io_bytes);
        let mut b = vec![0u8; stripe as usize];
        rng.fill(&mut b);
        model.apply(2 * stripe, &b);
        a.write(2 * stripe, SharedBuf::from_slice(&b), WriteFlags::NONE).await.unwrap();
        let after = partial(&a);
        eprintln!("kernel-made {}: mdkit wrote {} rmw and {} rcw runs", k.name, after.0 - before.0, after.1 - before.1);
        assert!(after.1 > before.1, "{}: partial-stripe writes happened", k.name);
        let parity = k.level.max_degraded() as usize;
        if k.n - parity == 2 + parity {
            // One block written: rmw reads it and the parity, rcw the other data members; they
            // tie here and rmw_level 2 prefers rmw (the kernel then checks mdkit's P/Q deltas).
            assert!(after.0 > before.0, "{}: read-modify-writes happened", k.name);
        }
        verify_all(&a, &model).await;
        a.stop().await.unwrap();
        k.md5_after_mdkit = md5(&model.data);
    }

    // Boot 2: the kernel reads what mdkit wrote into its arrays, and checks them.
    let mut s = String::from(GUEST_PRELUDE);
    s.push_str(&partitions(next_region));
    let cases: Vec<_> = km
        .iter()
        .map(|k| {
            let all: Vec<usize> = (0..k.n).collect();
            verify_in_guest(&format!("km2 {}", k.name), k.md, k.first_region, &all, true, "/dev/vdb")
        })
        .collect();
    s.push_str(&two_at_a_time(&cases));
    s.push_str("echo '=== end'\n");
    let mut opts = RunOptions::with_disks(vec![members_path.clone(), dump_path.clone()]);
    opts.timeout_secs = 1500;
    let run = tokio::task::block_in_place(|| lab.run(&opts, &s)).unwrap_or_else(|e| panic!("lab run failed: {e}"));
    eprintln!("lab boot 2: {:.1} s", run.elapsed.as_secs_f64());
    assert!(run.output.contains("=== end"), "guest did not finish:\n{}", run.output);
    run.assert_partitioned();
    for k in &km {
        let sec = run.section(&format!("km2 {}", k.name)).unwrap_or_default();
        let mut v = kv(&sec);
        v.insert("md5".into(), dumped_md5(&dump_path, k.md, v.get("size_bytes")));
        let get = |x: &str| v.get(x).map(String::as_str).unwrap_or("<missing>");
        if get("assemble") != "0" || get("md5") != k.md5_after_mdkit || get("mismatch") != "0" || get("degraded") != "0"
        {
            failures.push(format!(
                "kernel-made {} after mdkit's writes: md5 {} (mdkit wrote {}), mismatch {}, degraded {}:\n{sec}",
                k.name,
                get("md5"),
                k.md5_after_mdkit,
                get("mismatch"),
                get("degraded")
            ));
        }
    }
    assert!(failures.is_empty(), "boot 2:\n{}\n\nguest output:\n{}", failures.join("\n"), run.output);
    drop(file);
    let _ = Path::new(&members_path).exists();
}
