//! Restripes across mdkit and the Linux kernel (lab: Debian kernel + mdadm under qemu), both
//! ways, one boot per test: raid5 and raid6 4 -> 5 members; raid5 chunk 64 -> 128 KiB and raid6
//! left-symmetric-6 (Q on the last member) -> left-symmetric over the same four members, and
//! raid10 near-2 4 -> 5 members with an internal bitmap (resized to the new array when the
//! reshape starts); backwards to fewer members, raid5 and raid10 near-2 5 -> 4 (the array cut
//! to the smaller size first; the kernel's members get room after the data with `--size`,
//! without which mdadm 4.2 asks for a backup file); raid0 3 -> 4 members through raid4 with
//! the parity role empty (mdadm's path), each side taking the other's stopped raid4 reshape
//! to the end and back to raid0; and a raid5 chunk change the kernel runs backwards (its
//! members have room after the data only), finished by mdkit.
//!
//! 1. mdkit -> kernel: mdkit creates the array on four 64 MiB files (64 KiB chunks), writes a
//!    pattern at 0 and high up (160 MiB for raid5, 96 MiB for raid6), starts the `grow`
//!    throttled by `sync_speed_max` and stops the array mid-way. The kernel assembles it,
//!    finishes the reshape (`mdadm --wait`), shows the new member count, chunk and layout,
//!    both patterns read back and its check finds 0 mismatches.
//! 2. kernel -> mdkit: the kernel creates the same array, writes the patterns, starts `mdadm
//!    --grow` throttled by sync_speed_max and is stopped mid-way; mdkit assembles it (reshape
//!    in progress), finishes the reshape, the patterns read back and mdkit's check finds 0
//!    mismatches.
//!
//! What the kernel reads is copied to a dump disk and compared on the host. Skips loudly
//! (SKIP: ...) when the lab cannot be built or booted.

use std::sync::Arc;
use std::time::Duration;

use common::lab::RunOptions;
use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, WriteFlags};
use mdkit_md::array::{AssembleOptions, GrowChange, MemberDev, assemble, create, read_superblock};
use mdkit_md::format::superblock::feature;
use mdkit_md::layout::Level;

use crate::array_util::{MIB, check, cut_for_fewer_members, fast_sync, opts};
use crate::common;
use common::lab::detail_field as after;

const PATTERN_BYTES: u64 = 8 * MIB;

/// One restripe: the array both sides create on four members (the second pattern's offset lies
/// inside it), mdkit's grow and mdadm's, and what `mdadm --detail` shows afterwards.
#[derive(Clone, Copy)]
struct Case {
    level: Level,
    /// mdkit's create layout and mdadm's `--layout=` (empty: the default).
    layout: Option<(u32, &'static str)>,
    high_bytes: u64,
    change: GrowChange,
    /// `mdadm --grow` arguments; `{spare}` is the fifth member when the restripe adds one.
    mdadm_grow: &'static str,
    /// (Raid Devices, Chunk Size, Layout) in `mdadm --detail` afterwards.
    detail: (&'static str, &'static str, &'static str),
    /// An internal write-intent bitmap on both sides (raid10's is resized to the new array
    /// when the reshape starts, by whichever side starts it).
    bitmap: bool,
    /// Members the array starts with.
    before: usize,
    /// The kernel's array gets little room before its data and some after it (`--data-offset
    /// 64K --size`), so mdadm restripes it backwards, the data moving up (a same-count
    /// restripe mdkit itself always runs forwards).
    kernel_room_after: bool,
}

impl Case {
    /// Members afterwards.
    fn members(&self) -> usize {
        match self.change {
            GrowChange::RaidDevices(n) => n as usize,
            _ => self.before,
        }
    }

    fn shrinks(&self) -> bool {
        self.members() < self.before
    }

    /// Member images each side needs.
    fn images(&self) -> usize {
        self.members().max(self.before)
    }
}

const GROW_CASES: [Case; 2] = [
    Case {
        level: Level::Raid5,
        layout: None,
        high_bytes: 160 * MIB,
        change: GrowChange::RaidDevices(5),
        mdadm_grow: "--raid-devices=5 --add {spare}",
        detail: ("5", "64K", "left-symmetric"),
        bitmap: false,
        before: 4,
        kernel_room_after: false,
    },
    Case {
        level: Level::Raid6,
        layout: None,
        high_bytes: 96 * MIB,
        change: GrowChange::RaidDevices(5),
        mdadm_grow: "--raid-devices=5 --add {spare}",
        detail: ("5", "64K", "left-symmetric"),
        bitmap: false,
        before: 4,
        kernel_room_after: false,
    },
];

const RESTRIPE_CASES: [Case; 3] = [
    Case {
        level: Level::Raid5,
        layout: None,
        high_bytes: 160 * MIB,
        change: GrowChange::Restripe { layout: None, chunk_sectors: Some(256) },
        mdadm_grow: "--chunk=128",
        detail: ("4", "128K", "left-symmetric"),
        bitmap: false,
        before: 4,
        kernel_room_after: false,
    },
    Case {
        level: Level::Raid6,
        layout: Some((18, "left-symmetric-6")),
        high_bytes: 96 * MIB,
        change: GrowChange::Restripe { layout: Some(2), chunk_sectors: None },
        mdadm_grow: "--layout=left-symmetric",
        detail: ("4", "64K", "left-symmetric"),
        bitmap: false,
        before: 4,
        kernel_room_after: false,
    },
    Case {
        level: Level::Raid10,
        layout: Some((0x102, "n2")),
        high_bytes: 96 * MIB,
        change: GrowChange::RaidDevices(5),
        mdadm_grow: "--raid-devices=5 --add {spare}",
        detail: ("5", "64K", "near=2"),
        bitmap: true,
        before: 4,
        kernel_room_after: false,
    },
];

/// Backwards to fewer members: raid5 and raid10 near-2 5 -> 4 (the array cut to the smaller
/// size first: mdkit's `grow --array-size`, mdadm's `--grow --array-size`).
const SHRINK_CASES: [Case; 2] = [
    Case {
        level: Level::Raid5,
        layout: None,
        high_bytes: 160 * MIB,
        change: GrowChange::RaidDevices(4),
        mdadm_grow: "--raid-devices=4",
        detail: ("4", "64K", "left-symmetric"),
        bitmap: false,
        before: 5,
        kernel_room_after: false,
    },
    Case {
        level: Level::Raid10,
        layout: Some((0x102, "n2")),
        high_bytes: 96 * MIB,
        change: GrowChange::RaidDevices(4),
        mdadm_grow: "--raid-devices=4",
        detail: ("4", "64K", "near=2"),
        bitmap: false,
        before: 5,
        kernel_room_after: false,
    },
];

/// raid0 3 -> 4 members, mdadm's way: raid4 with the parity role empty, restripe, raid0 again
/// (the kernel has no raid0 reshape). Stopped mid-way it is a raid4 reshape on disk; the side
/// that finishes it takes it back to raid0 (`mdadm --grow --level=0`, mdkit `grow --level
/// raid0`), since the step back lived in the stopped side's grow.
/// With it, raid5 chunk 64 -> 128 KiB where the kernel's side has room after the data only:
/// mdadm runs that restripe backwards (RESHAPE_BACKWARDS, the data moving up), and mdkit
/// finishes it.
const RAID0_AND_BACKWARDS_CASES: [Case; 2] = [
    Case {
        level: Level::Raid0,
        layout: None,
        high_bytes: 160 * MIB,
        change: GrowChange::RaidDevices(4),
        mdadm_grow: "--raid-devices=4 --add {spare}",
        detail: ("4", "64K", ""),
        bitmap: false,
        before: 3,
        kernel_room_after: false,
    },
    Case { kernel_room_after: true, ..RESTRIPE_CASES[0] },
];

fn member(path: &std::path::Path) -> MemberDev {
    let dev: DeviceRef = Arc::new(FileDevice::open(path, FileOptions::default()).unwrap());
    MemberDev::new(path.file_name().unwrap().to_string_lossy().into_owned(), dev)
}

/// mdkit's half of 1: returns the reshape position recorded at the stop and the array's size
/// before the reshape (sectors).
async fn mdkit_starts(case: Case, paths: &[std::path::PathBuf], pattern: &[u8]) -> (u64, u64) {
    let o = opts(case.level, case.before as u32, Some(64), case.layout.map(|l| l.0), case.bitmap, true);
    let a = create(paths[..case.before].iter().map(|p| member(p)).collect(), o).await.unwrap().array;
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    a.write_slice(case.high_bytes, pattern, WriteFlags::FUA).await.unwrap();
    let old_sectors = a.size_bytes() / 512;
    if case.shrinks() {
        let size = cut_for_fewer_members(&a, case.members() as u32).await;
        assert!(size >= case.high_bytes + PATTERN_BYTES, "the cut keeps the high pattern");
    }
    a.set_attribute("sync_speed_max", "4000").unwrap();
    a.grow(case.change, paths[case.before..].iter().map(|p| member(p)).collect()).await.unwrap();
    // Stop once a checkpoint is on disk: throttled, the rest takes most of a minute.
    for waited in 0.. {
        if a.core().personality().reshape().is_some_and(|r| r.completed().0 > 0) {
            break;
        }
        assert!(waited < 6000, "no reshape checkpoint after 6000 polls: {:?}", a.sync_status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.stop().await.unwrap();
    let sb = read_superblock(&member(&paths[0]).dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "stopped mid-way");
    (sb.reshape_position_sectors, old_sectors)
}

/// A raid10 reshape with a bitmap that the kernel finished after a restart: the kernel's
/// resync of the array's new tail (raid10_finish_reshape) goes by bitmap bits it marks needed
/// in memory only (md_bitmap_resize); reassembled clean, md_bitmap_load does not take the
/// on-disk bits as needed, so the tail's copies keep what the members held there (never
/// written through the array). mdkit's check on the members the kernel finished must find
/// exactly that: as many mismatched sectors as the kernel's, all in the tail.
async fn mismatches_only_in_the_new_tail(paths: &[std::path::PathBuf], old_sectors: u64, kernel: u64) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "ktail".into(), ..Default::default() }).await.unwrap().array;
    let found = check(&a).await;
    let st = a.sync_status();
    eprintln!("kernel mismatch_cnt {kernel}; mdkit's check: {found} sectors in {:?}", st.mismatch_ranges);
    assert_eq!(found, kernel, "mdkit's check and the kernel's agree");
    assert!(
        st.mismatch_ranges.iter().all(|r| r.start >= old_sectors),
        "only in the new tail: {:?}",
        st.mismatch_ranges
    );
    a.stop().await.unwrap();
}

/// mdkit's half of 2.
async fn mdkit_finishes(case: Case, paths: &[std::path::PathBuf], pattern: &[u8]) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "kreshape".into(), ..Default::default() }).await.unwrap().array;
    let raid0 = case.level == Level::Raid0;
    assert_eq!(a.info().level, if raid0 { Level::Raid4 } else { case.level }, "raid0 reshapes as raid4");
    for p in paths.iter().filter(|_| raid0) {
        // The member filling the old parity role: recovered up to the new geometry's
        // per-member position (the kernel's units are mdkit's).
        let sb = read_superblock(&member(p).dev).await.unwrap();
        let recovering = sb.feature_map & feature::RECOVERY_OFFSET != 0;
        let new_data = case.members() as u64;
        if u32::from(sb.raw_role()) == case.before as u32 {
            assert!(recovering && sb.recovery_offset_sectors == sb.reshape_position_sectors / new_data, "{sb:?}");
        } else {
            assert!(!recovering, "{}: in sync", p.display());
        }
    }
    let r = a.core().personality().reshape().map(|r| (r.position_sectors(), r.new_array_sectors()));
    eprintln!("mdkit assembled the kernel's reshape at (position, end) {r:?}");
    assert!(r.is_some_and(|(p, end)| p > 0 && p < end), "a reshape in progress: {r:?}");
    let backwards = a.core().personality().reshape().is_some_and(|r| r.state().backwards);
    assert_eq!(backwards, case.kernel_room_after || case.shrinks(), "the kernel's direction");
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(case.high_bytes, PATTERN_BYTES as usize).await.unwrap(), pattern);
    fast_sync(&a);
    a.wait_reshape().await.unwrap();
    if raid0 {
        let back = GrowChange::Level { level: Level::Raid0, layout: mdkit_md::format::takeover::LayoutChoice::Default };
        a.grow(back, Vec::new()).await.unwrap();
        assert_eq!(a.info().level, Level::Raid0);
    }
    assert_eq!(a.info().raid_disks, case.members() as u32);
    let (layout, chunk) = (a.info().layout, a.info().chunk_sectors);
    match case.change {
        GrowChange::Restripe { layout: l, chunk_sectors: c } => {
            assert_eq!((layout, chunk), (l.unwrap_or(layout), c.unwrap_or(chunk)), "the new geometry");
        }
        _ => assert_eq!(chunk, 128),
    }
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(case.high_bytes, PATTERN_BYTES as usize).await.unwrap(), pattern);
    if !raid0 {
        assert_eq!(check(&a).await, 0);
    }
    a.stop().await.unwrap();
}

/// The guest's half for one case: disks (mdkit's n, then the kernel's n) from
/// disk index `first`, md device numbers `2k` and `2k + 1`, dump disk offset `slot` (MiB).
fn guest_case(k: usize, case: Case, first: usize, dump_slot_mib: u64) -> String {
    let n = case.images();
    let dev = |i: usize| common::lab::vd(first + i);
    let mine: Vec<String> = (0..n).map(dev).collect();
    let theirs: Vec<String> = (n..2 * n).map(dev).collect();
    let layout = case.layout.map_or(String::new(), |l| format!("--layout={}", l.1));
    let grow = case.mdadm_grow.replace("{spare}", theirs.get(case.before).map_or("", String::as_str));
    let before = case.before;
    // To fewer members mdadm wants the array cut to the smaller size first, and room after
    // the used size to move the data up into (without it, it asks for a backup file).
    let size = match (case.shrinks(), case.kernel_room_after) {
        (_, true) => "--size=61440 --data-offset=64K",
        (true, false) => "--size=61440",
        (false, false) => "",
    };
    let cut = if case.shrinks() {
        // The smaller array in component sizes: data members, or raid10's members / copies.
        let data = match case.level {
            Level::Raid10 => format!("{} / 2", case.members()),
            l => (case.members() - l.max_degraded() as usize).to_string(),
        };
        // mdadm 4.2 sets each member's (larger) new_offset before raid_disks, and the kernel
        // takes a larger offset only once the direction is backwards (md.c new_offset_store):
        // set it first, as mdadm does itself only for a same-count restripe.
        format!(
            "mdadm --grow /dev/md{m} --array-size=$(( $(cat /sys/block/md{m}/md/component_size) * {data} )) 2>&1\necho backwards > /sys/block/md{m}/md/reshape_direction",
            m = 2 * k + 1
        )
    } else {
        String::new()
    };
    let (m0, m1) = (2 * k, 2 * k + 1);
    let level = case.level.md_level();
    let high_mib = case.high_bytes / MIB;
    let bitmap = match (case.bitmap, case.level) {
        (true, _) => "--bitmap=internal",
        (false, Level::Raid0) => "", // mdadm: "bitmaps not meaningful with level raid0"
        (false, _) => "--bitmap=none",
    };
    // A raid0 restripe finishes as raid4 with the parity role empty; mdadm's takeover back.
    let back = if case.level == Level::Raid0 {
        format!("mdadm --grow /dev/md{} --level=0 2>&1; cat /proc/mdstat", 2 * k)
    } else {
        String::new()
    };
    format!(
        r#"
mdadm --assemble /dev/md{m0} {mine} 2>&1 || echo assemble_failed=1
mdadm --readwrite /dev/md{m0} 2>&1
cat /proc/mdstat
sleep 1; mdadm --wait /dev/md{m0}; sleep 1; mdadm --wait /dev/md{m0}
{back}
echo "=== detail{k}"; mdadm --detail /dev/md{m0}
dump /dev/md{m0} 0 {d_low}
dump /dev/md{m0} {high_mib} {d_high}
echo check > /sys/block/md{m0}/md/sync_action; sleep 1; mdadm --wait /dev/md{m0}
echo "=== mismatch{k}"; cat /sys/block/md{m0}/md/mismatch_cnt
echo "=== dmesg{k}"; dmesg -c 2>/dev/null | grep -E 'md{m0}\b|md/raid' | tail -40
mdadm --stop /dev/md{m0} 2>&1
mdadm --create /dev/md{m1} --run --metadata=1.2 --level={level} {layout} --chunk=64 --raid-devices={before} {size} --assume-clean {bitmap} {theirs_before} 2>&1
dd if=$pat of=/dev/md{m1} bs=1M oflag=direct status=none
dd if=$pat of=/dev/md{m1} bs=1M seek={high_mib} oflag=direct status=none
# raid0 has no sync_speed_max of its own (its reshape runs as raid4): the system-wide limit.
echo 3000 2>/dev/null > /sys/block/md{m1}/md/sync_speed_max || echo 3000 > /proc/sys/dev/raid/speed_limit_max
{cut}
mdadm --grow /dev/md{m1} {grow} 2>&1
p0=$(cat /sys/block/md{m1}/md/reshape_position)
# Until the kernel records a checkpoint: with room to spare beside the data it takes one only
# every 10 s (raid5.c reshape_request), so a restripe over the same members needs a while.
# (Forwards the position starts at 0, backwards at the end of the smaller array.)
for i in $(seq 1 60); do p=$(cat /sys/block/md{m1}/md/reshape_position); [ "$p" != 0 ] && [ "$p" != "$p0" ] && break; sleep 0.5; done
echo "=== reshape{k}"; cat /sys/block/md{m1}/md/sync_action /sys/block/md{m1}/md/reshape_position
# The stop stands for a crash of the kernel's side: its mdadm --grow background process (which
# for raid0 would take the array back afterwards) goes first. Left running, it raced the stop
# of a raid0 -> raid4 reshape under load: the kernel failed the new member and mdadm --stop hung.
killall mdadm 2>/dev/null; sleep 0.5
mdadm --stop /dev/md{m1} 2>&1
echo "=== examine{k}"; mdadm --examine {theirs_all} 2>&1 | grep -E '^/dev|Events|Device Role|Recovery Offset|Reshape pos|Array State'
echo 200000 > /proc/sys/dev/raid/speed_limit_max
"#,
        mine = mine.join(" "),
        theirs_before = theirs[..before].join(" "),
        theirs_all = theirs.join(" "),
        d_low = dump_slot_mib,
        d_high = dump_slot_mib + 8,
    )
}

/// What the guest copied to the dump disk at `slot_mib`.
fn dumped(dump: &std::path::Path, slot_mib: u64) -> Vec<u8> {
    common::lab::read_dump(dump, slot_mib * MIB, PATTERN_BYTES as usize)
}

/// For a failure message: what mdkit reads at `at` (bytes) of the array on `paths`, against
/// `pattern` (whether the kernel left the data on disk wrong or only read it wrong).
async fn mdkit_reads_back(paths: &[std::path::PathBuf], at: u64, pattern: &[u8]) -> String {
    let devs = paths.iter().map(|p| member(p)).collect();
    let opts = AssembleOptions { name: "kdone".into(), start_frozen: true, ..Default::default() };
    let a = match assemble(devs, opts).await {
        Ok(a) => a.array,
        Err(e) => return format!("assembly failed: {e}"),
    };
    let text = match a.read_vec(at, pattern.len()).await {
        Ok(got) => common::lab::describe_difference(&got, pattern),
        Err(e) => format!("read failed: {e}"),
    };
    let _ = a.stop().await;
    text
}

/// With MDKIT_LAB_KEEP set, a failed run's member images and dump disk stay for a look.
fn keep_on_failure(dir: tempfile::TempDir) {
    if std::env::var_os("MDKIT_LAB_KEEP").is_some() {
        eprintln!("kept {}", dir.keep().display());
    }
}

/// Both ways for each case, one boot.
fn cross(name: &str, cases: &[Case]) {
    let lab = crate::lab_or_skip!(name);
    let dir = lab.scratch_dir(name);
    let mut pattern = vec![0u8; PATTERN_BYTES as usize];
    Rng::new(0x7265).fill(&mut pattern);
    let pat_path = dir.path().join("pat");
    std::fs::write(&pat_path, &pattern).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut disks = Vec::new();
    let mut theirs = Vec::new();
    let mut mine_all = Vec::new();
    let mut old_sectors = Vec::new();
    let mut script = String::from(
        "set -u\npat=/lab/files/pat\ndump() { dd if=$1 of=$dumpdev bs=1M skip=$2 seek=$3 count=8 iflag=direct oflag=direct status=none || echo dump_failed=1; }\n",
    );
    let mut body = String::new();
    for (k, case) in cases.iter().enumerate() {
        let tag = format!("{}-{k}", case.level.name());
        let n = case.images();
        let mine: Vec<_> = (0..n).map(|i| dir.path().join(format!("{tag}-a{i}.img"))).collect();
        let them: Vec<_> = (0..n).map(|i| dir.path().join(format!("{tag}-b{i}.img"))).collect();
        for p in mine.iter().chain(&them) {
            std::fs::File::create(p).unwrap().set_len(64 * MIB).unwrap();
        }
        let (stopped_at, old_array) = rt.block_on(mdkit_starts(*case, &mine, &pattern));
        old_sectors.push(old_array);
        mine_all.push(mine.clone());
        eprintln!("{tag}: mdkit stopped its reshape at array sector {stopped_at}");
        assert!(stopped_at > 0);
        body += &guest_case(k, *case, disks.len(), 16 * k as u64);
        disks.extend(mine.into_iter().chain(them.iter().cloned()));
        theirs.push(them);
    }
    script += &format!("dumpdev={}\n", common::lab::vd(disks.len()));
    script += &body;
    script += "echo \"=== end\"\n";
    let dump_path = dir.path().join("dump.img");
    std::fs::File::create(&dump_path).unwrap().set_len(16 * cases.len() as u64 * MIB).unwrap();
    disks.push(dump_path.clone());
    assert!(disks.len() <= 28, "qemu's pc machine takes 28 virtio disks");
    let mut opts = RunOptions::with_disks(disks);
    opts.files.push(pat_path);
    let run = lab.run(&opts, &script).unwrap_or_else(|e| panic!("lab: {e}"));
    eprintln!("{}", run.output);
    assert_eq!(run.exit_code, 0, "{}", run.output);
    assert!(!run.output.contains("assemble_failed") && !run.output.contains("dump_failed"), "{}", run.output);
    let section = |n: &str| run.section(n).unwrap_or_else(|| panic!("no section {n}:\n{}", run.output));
    let mine = mine_all;
    for (k, case) in cases.iter().enumerate() {
        let name = case.level.name();
        let detail = section(&format!("detail{k}"));
        assert_eq!(after(&detail, "Raid Level :"), Some(name), "{detail}");
        assert_eq!(after(&detail, "Raid Devices :"), Some(case.detail.0), "{detail}");
        assert_eq!(after(&detail, "Chunk Size :"), Some(case.detail.1), "{detail}");
        if case.level != Level::Raid0 {
            assert_eq!(after(&detail, "Layout :"), Some(case.detail.2), "{detail}");
        }
        assert!(!detail.contains("Reshape Status"), "{name}: the kernel finished the reshape: {detail}");
        let bitmap = if case.bitmap { Some("Internal") } else { None };
        assert_eq!(after(&detail, "Intent Bitmap :"), bitmap, "{name}: the bitmap: {detail}");
        for (slot, what) in [(0, "the pattern at 0"), (8, "the high pattern")] {
            let got = dumped(&dump_path, 16 * k as u64 + slot);
            if got != pattern {
                let at = if slot == 0 { 0 } else { case.high_bytes };
                let mdkit_reads = rt.block_on(mdkit_reads_back(&mine[k], at, &pattern));
                keep_on_failure(dir);
                panic!(
                    "{name}: the kernel reads {what}: {}; mdkit reads the array the kernel finished: {mdkit_reads}\n{}",
                    common::lab::describe_difference(&got, &pattern),
                    run.section(&format!("dmesg{k}")).unwrap_or_default()
                );
            }
        }
        let kernel_mismatches: u64 =
            section(&format!("mismatch{k}")).lines().next().and_then(|l| l.trim().parse().ok()).unwrap_or(u64::MAX);
        if case.level == Level::Raid0 {
            // raid0 has nothing to check.
        } else if case.bitmap {
            rt.block_on(mismatches_only_in_the_new_tail(mine[k].as_slice(), old_sectors[k], kernel_mismatches));
        } else {
            assert_eq!(kernel_mismatches, 0, "{name}: the kernel's check: {}", run.output);
        }
        let reshape = section(&format!("reshape{k}"));
        assert!(reshape.contains("reshape"), "{name}: the kernel was reshaping when stopped: {reshape}");
    }
    for (case, them) in cases.iter().zip(&theirs) {
        rt.block_on(mdkit_finishes(*case, them, &pattern));
    }
}

#[test]
fn raid5_and_raid6_reshapes_cross_between_mdkit_and_the_kernel() {
    cross("reshape_lab", &GROW_CASES);
}

#[test]
fn reshapes_to_fewer_members_cross_between_mdkit_and_the_kernel() {
    cross("shrink_lab", &SHRINK_CASES);
}

#[test]
fn raid0_and_backwards_restripes_cross_between_mdkit_and_the_kernel() {
    cross("raid0_reshape_lab", &RAID0_AND_BACKWARDS_CASES);
}

#[test]
fn chunk_and_layout_restripes_cross_between_mdkit_and_the_kernel() {
    cross("restripe_lab", &RESTRIPE_CASES);
}
