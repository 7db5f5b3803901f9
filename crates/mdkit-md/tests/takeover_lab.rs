//! Level changes (md takeovers) across mdkit and the Linux kernel (lab: Debian kernel + mdadm
//! under qemu), both ways, one boot, 32 MiB members:
//!
//! 1. mdkit -> kernel:
//!    - a 2-mirror raid1 with a pattern at 0 becomes raid5 (`grow --level raid5`); the kernel
//!      assembles a 2-device raid5 with mdkit's chunk, reads the pattern, its check finds 0
//!      mismatches;
//!    - a 3-member raid5 with patterns at 0 and 40 MiB becomes raid6 (`--layout preserve
//!      --add`); mdkit is stopped while Q is recovered onto the added member (throttled by
//!      sync_speed_max, stopped once the member's recovery offset moved). The kernel assembles
//!      a raid6 left-symmetric-6, finishes the recovery, reads both patterns, check finds 0.
//!    - a 3-member raid0 with both patterns becomes raid4 (`--add`, parity-last), stopped while
//!      parity is recovered; the kernel finishes it, reads both patterns, check finds 0;
//!    - a 4-member raid4 with both patterns becomes raid0 (`grow --level raid0`: the parity
//!      member is failed and removed first); the kernel assembles a 3-device raid0 of the same
//!      size from the data members and reads both patterns.
//! 2. kernel -> mdkit:
//!    - the kernel's raid1 with the pattern, `mdadm --grow --level=5`: mdkit assembles a
//!      2-member raid5 with the kernel's chunk, reads the pattern, check finds 0;
//!    - the kernel's raid5 with both patterns and a spare, `mdadm --grow --level=6
//!      --raid-devices=4 --layout=preserve`, stopped mid-recovery: mdkit assembles the raid6,
//!      finishes the recovery, reads both patterns, check finds 0;
//!    - the kernel's raid0 with both patterns, `mdadm --grow --level=4` and a spare added,
//!      stopped mid-recovery: mdkit assembles the raid4, finishes it, patterns, check 0;
//!    - the kernel's raid4 with both patterns, `mdadm --grow --level=0`: mdkit assembles a
//!      3-member raid0 of the same size and reads both patterns.
//!
//! What the kernel reads is copied to a dump disk and compared on the host. Skips loudly
//! (SKIP: ...) when the lab cannot be built or booted.

use std::sync::Arc;
use std::time::Duration;

use common::lab::RunOptions;
use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, WriteFlags};
use mdkit_md::array::{AssembleOptions, GrowChange, LayoutChoice, MemberDev, assemble, create, read_superblock};
use mdkit_md::format::superblock::feature;
use mdkit_md::layout::Level;

use crate::array_util::{MIB, check, fast_sync, opts};
use crate::common;
use common::lab::detail_field as after;

const PATTERN_BYTES: u64 = 8 * MIB;
const HIGH: u64 = 40 * MIB;

fn member(path: &std::path::Path) -> MemberDev {
    let dev: DeviceRef = Arc::new(FileDevice::open(path, FileOptions::default()).unwrap());
    MemberDev::new(path.file_name().unwrap().to_string_lossy().into_owned(), dev)
}

/// mdkit's raid1 -> raid5: returns the chunk it chose (KiB).
async fn mdkit_mirror_to_raid5(paths: &[std::path::PathBuf], pattern: &[u8]) -> u32 {
    let a = create(paths.iter().map(|p| member(p)).collect(), opts(Level::Raid1, 2, None, None, true, true))
        .await
        .unwrap()
        .array;
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    a.grow(GrowChange::Level { level: Level::Raid5, layout: LayoutChoice::Default }, vec![]).await.unwrap();
    assert_eq!(a.info().level, Level::Raid5);
    let chunk_kib = a.info().chunk_sectors / 2;
    a.stop().await.unwrap();
    chunk_kib
}

/// mdkit's takeover onto an added member (raid5 -> raid6 Q, raid0 -> raid4 parity), stopped
/// while that member is being recovered: returns the recovery offset its superblock records.
async fn mdkit_adds_redundancy(from: Level, to: GrowChange, paths: &[std::path::PathBuf], pattern: &[u8]) -> u64 {
    let o = opts(from, 3, Some(64), None, false, true);
    let a = create(paths[..3].iter().map(|p| member(p)).collect(), o).await.unwrap().array;
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    a.write_slice(HIGH, pattern, WriteFlags::FUA).await.unwrap();
    a.set_attribute("sync_speed_max", "2000").unwrap();
    a.grow(to, vec![member(&paths[3])]).await.unwrap();
    // Stop once the recovery moved: throttled, the rest takes most of a minute.
    for waited in 0.. {
        if a.core().slots().recovering().iter().any(|(_, m)| m.recovery_offset() > 0) {
            break;
        }
        assert!(waited < 6000, "no recovery progress after 6000 polls: {:?}", a.sync_status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.stop().await.unwrap();
    let sb = read_superblock(&member(&paths[3]).dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RECOVERY_OFFSET, 0, "stopped mid-recovery");
    sb.recovery_offset_sectors
}

/// mdkit's raid4 -> raid0: returns the array size (bytes), the same before and after.
async fn mdkit_drops_parity(paths: &[std::path::PathBuf], pattern: &[u8]) -> u64 {
    let o = opts(Level::Raid4, 4, Some(64), None, false, true);
    let a = create(paths.iter().map(|p| member(p)).collect(), o).await.unwrap().array;
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    a.write_slice(HIGH, pattern, WriteFlags::FUA).await.unwrap();
    let size = a.size_bytes();
    a.grow(GrowChange::Level { level: Level::Raid0, layout: LayoutChoice::Default }, vec![]).await.unwrap();
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid0, 3, size));
    a.stop().await.unwrap();
    size
}

/// mdkit's half of 2 for the kernel's raid4 -> raid0 (every former member given).
async fn mdkit_reads_kernel_raid0(paths: &[std::path::PathBuf], pattern: &[u8], kernel_size_bytes: u64) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let got = assemble(devs, AssembleOptions { name: "k0".into(), ..Default::default() }).await.unwrap();
    eprintln!("mdkit assembled the kernel's raid0 from raid4; left out: {:?}", got.refused);
    let a = got.array;
    assert_eq!((a.info().level, a.info().raid_disks, a.size_bytes()), (Level::Raid0, 3, kernel_size_bytes));
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(HIGH, PATTERN_BYTES as usize).await.unwrap(), pattern);
    a.stop().await.unwrap();
}

/// mdkit's half of 2 for the kernel's raid1 -> raid5.
async fn mdkit_reads_kernel_raid5(paths: &[std::path::PathBuf], pattern: &[u8], kernel_chunk_kib: u32) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "k5".into(), ..Default::default() }).await.unwrap().array;
    assert_eq!((a.info().level, a.info().raid_disks, a.info().layout), (Level::Raid5, 2, 2));
    assert_eq!(a.info().chunk_sectors / 2, kernel_chunk_kib);
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

/// mdkit's half of 2 for the kernel's raid5 -> raid6 and raid0 -> raid4, stopped mid-recovery.
async fn mdkit_finishes_kernel_recovery(paths: &[std::path::PathBuf], pattern: &[u8], want: (Level, u32)) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "kt".into(), ..Default::default() }).await.unwrap().array;
    assert_eq!((a.info().level, a.info().raid_disks, a.info().layout), (want.0, 4, want.1));
    let recovering = a.core().slots().recovering();
    eprintln!(
        "mdkit assembled the kernel's {:?}: recovering {:?}",
        want.0,
        recovering.iter().map(|(r, m)| (*r, m.recovery_offset())).collect::<Vec<_>>()
    );
    assert_eq!(recovering.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![3], "Q's or parity's member resumes");
    fast_sync(&a);
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0);
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(HIGH, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

/// Guest disks: vda-vdb mdkit's mirror, vdc-vdf mdkit's raid5 + Q, vdg-vdh the kernel's
/// mirror, vdi-vdl the kernel's raid5 + spare, vdm-vdp mdkit's raid0 + parity, vdq-vdt the
/// kernel's raid0 + spare, vdu the dump disk, vdv-vdx mdkit's raid0 from raid4 (its data
/// members), vdy-vdab the kernel's raid4 (28 disks: qemu's pc machine holds no more).
const SCRIPT: &str = r#"
set -u
pat=/lab/files/pat
dump() { dd if=$1 of=/dev/vdu bs=1M skip=$2 seek=$3 count=8 iflag=direct oflag=direct status=none || echo dump_failed=1; }
# assemble N DEVS...: mdkit's array as mdN, writable (a stopped recovery resumes), waited for
assemble() {
    md=/dev/md$1; shift
    mdadm --assemble $md "$@" 2>&1 || echo assemble_failed=1
    mdadm --readwrite $md 2>&1
    sleep 1; mdadm --wait $md; sleep 1; mdadm --wait $md
    echo "=== detail${md#/dev/md}"; mdadm --detail $md
}
# check_and_stop N: the kernel's check of mdN, its mismatch count, then stop
check_and_stop() {
    echo check > /sys/block/md$1/md/sync_action; sleep 1; mdadm --wait /dev/md$1
    echo "=== mismatch$1"; cat /sys/block/md$1/md/mismatch_cnt
    mdadm --stop /dev/md$1 2>&1
}
assemble 0 /dev/vda /dev/vdb
dump /dev/md0 0 0
check_and_stop 0
assemble 1 /dev/vdc /dev/vdd /dev/vde /dev/vdf
dump /dev/md1 0 8
dump /dev/md1 40 16
check_and_stop 1
mdadm --create /dev/md2 --run --metadata=1.2 --level=1 --raid-devices=2 --assume-clean --bitmap=none /dev/vdg /dev/vdh 2>&1
dd if=$pat of=/dev/md2 bs=1M oflag=direct status=none
mdadm --grow /dev/md2 --level=5 2>&1
echo "=== detail2"; mdadm --detail /dev/md2
mdadm --stop /dev/md2 2>&1
mdadm --create /dev/md3 --run --metadata=1.2 --level=5 --chunk=64 --raid-devices=3 --assume-clean --bitmap=none /dev/vdi /dev/vdj /dev/vdk 2>&1
dd if=$pat of=/dev/md3 bs=1M oflag=direct status=none
dd if=$pat of=/dev/md3 bs=1M seek=40 oflag=direct status=none
mdadm /dev/md3 --add /dev/vdl 2>&1
echo 2000 > /sys/block/md3/md/sync_speed_max
mdadm --grow /dev/md3 --level=6 --raid-devices=4 --layout=preserve 2>&1
sleep 3
echo "=== recovery3"; cat /sys/block/md3/md/sync_action /proc/mdstat; mdadm --detail /dev/md3
mdadm --stop /dev/md3 2>&1
assemble 4 /dev/vdm /dev/vdn /dev/vdo /dev/vdp
dump /dev/md4 0 24
dump /dev/md4 40 32
check_and_stop 4
mdadm --create /dev/md5 --run --metadata=1.2 --level=0 --chunk=64 --raid-devices=3 /dev/vdq /dev/vdr /dev/vds 2>&1
dd if=$pat of=/dev/md5 bs=1M oflag=direct status=none
dd if=$pat of=/dev/md5 bs=1M seek=40 oflag=direct status=none
mdadm --grow /dev/md5 --level=4 2>&1
echo 2000 > /sys/block/md5/md/sync_speed_max
mdadm /dev/md5 --add /dev/vdt 2>&1
sleep 3
echo "=== recovery5"; cat /sys/block/md5/md/sync_action /proc/mdstat; mdadm --detail /dev/md5
mdadm --stop /dev/md5 2>&1
mdadm --assemble /dev/md6 /dev/vdv /dev/vdw /dev/vdx 2>&1 || echo assemble_failed=1
echo "=== detail6"; mdadm --detail /dev/md6; echo "=== size6"; blockdev --getsize64 /dev/md6
dump /dev/md6 0 40
dump /dev/md6 40 48
mdadm --stop /dev/md6 2>&1
mdadm --create /dev/md7 --run --metadata=1.2 --level=4 --chunk=64 --raid-devices=4 --assume-clean --bitmap=none /dev/vdy /dev/vdz /dev/vdaa /dev/vdab 2>&1
dd if=$pat of=/dev/md7 bs=1M oflag=direct status=none
dd if=$pat of=/dev/md7 bs=1M seek=40 oflag=direct status=none
mdadm --grow /dev/md7 --level=0 2>&1
echo "=== detail7"; mdadm --detail /dev/md7; echo "=== size7"; blockdev --getsize64 /dev/md7
mdadm --stop /dev/md7 2>&1
echo "=== end"
"#;

#[test]
fn level_changes_cross_between_mdkit_and_the_kernel() {
    let lab = crate::lab_or_skip!("takeover_lab");
    let dir = lab.scratch_dir("takeover");
    let mut pattern = vec![0u8; PATTERN_BYTES as usize];
    Rng::new(0x746b).fill(&mut pattern);
    let pat_path = dir.path().join("pat");
    std::fs::write(&pat_path, &pattern).unwrap();
    let disk = |n: &str| {
        let p = dir.path().join(format!("{n}.img"));
        std::fs::File::create(&p).unwrap().set_len(32 * MIB).unwrap();
        p
    };
    let my_mirror: Vec<_> = ["a0", "a1"].map(disk).to_vec();
    let my_raid5: Vec<_> = ["b0", "b1", "b2", "b3"].map(disk).to_vec();
    let their_mirror: Vec<_> = ["c0", "c1"].map(disk).to_vec();
    let their_raid5: Vec<_> = ["d0", "d1", "d2", "d3"].map(disk).to_vec();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let my_chunk_kib = rt.block_on(mdkit_mirror_to_raid5(&my_mirror, &pattern));
    let my_raid0: Vec<_> = ["e0", "e1", "e2", "e3"].map(disk).to_vec();
    let their_raid0: Vec<_> = ["f0", "f1", "f2", "f3"].map(disk).to_vec();
    let to6 = GrowChange::Level { level: Level::Raid6, layout: LayoutChoice::Preserve };
    let offset = rt.block_on(mdkit_adds_redundancy(Level::Raid5, to6, &my_raid5, &pattern));
    eprintln!("mdkit stopped raid5 -> raid6 with Q recovered up to member sector {offset}");
    let to4 = GrowChange::Level { level: Level::Raid4, layout: LayoutChoice::Default };
    let offset = rt.block_on(mdkit_adds_redundancy(Level::Raid0, to4, &my_raid0, &pattern));
    eprintln!("mdkit stopped raid0 -> raid4 with parity recovered up to member sector {offset}");
    let my_raid4: Vec<_> = ["g0", "g1", "g2", "g3"].map(disk).to_vec();
    let my_raid0_size = rt.block_on(mdkit_drops_parity(&my_raid4, &pattern));
    let their_raid4: Vec<_> = ["h0", "h1", "h2", "h3"].map(disk).to_vec();
    let dump_path = dir.path().join("dump.img");
    std::fs::File::create(&dump_path).unwrap().set_len(56 * MIB).unwrap();
    let disks: Vec<_> = [
        my_mirror,
        my_raid5,
        their_mirror.clone(),
        their_raid5.clone(),
        my_raid0,
        their_raid0.clone(),
        vec![dump_path.clone()],
        my_raid4[..3].to_vec(),
        their_raid4.clone(),
    ]
    .concat();
    assert_eq!(disks.len(), 28, "vdu is the dump disk, the rest members");
    let mut opts = RunOptions::with_disks(disks);
    opts.files.push(pat_path);
    let run = lab.run(&opts, SCRIPT).unwrap_or_else(|e| panic!("lab: {e}"));
    eprintln!("{}", run.output);
    assert_eq!(run.exit_code, 0, "{}", run.output);
    assert!(!run.output.contains("assemble_failed") && !run.output.contains("dump_failed"), "{}", run.output);
    let section = |n: &str| run.section(n).unwrap_or_else(|| panic!("no section {n}:\n{}", run.output));
    let dumped = |slot_mib: u64| common::lab::read_dump(&dump_path, slot_mib * MIB, PATTERN_BYTES as usize);

    let d0 = section("detail0");
    assert_eq!((after(&d0, "Raid Level :"), after(&d0, "Raid Devices :")), (Some("raid5"), Some("2")), "{d0}");
    assert_eq!(after(&d0, "Chunk Size :"), Some(format!("{my_chunk_kib}K").as_str()), "{d0}");
    assert!(dumped(0) == pattern, "the kernel reads mdkit's raid5-from-raid1");
    assert_eq!(section("mismatch0").lines().next().map(str::trim), Some("0"), "{}", run.output);
    let d1 = section("detail1");
    assert_eq!((after(&d1, "Raid Level :"), after(&d1, "Raid Devices :")), (Some("raid6"), Some("4")), "{d1}");
    assert_eq!(after(&d1, "Layout :"), Some("left-symmetric-6"), "{d1}");
    assert_eq!(after(&d1, "Failed Devices :"), Some("0"), "{d1}");
    assert!(!d1.contains("degraded") && !d1.contains("Rebuild Status"), "the kernel finished Q's recovery: {d1}");
    assert!(dumped(8) == pattern && dumped(16) == pattern, "the kernel reads mdkit's raid6-from-raid5");
    assert_eq!(section("mismatch1").lines().next().map(str::trim), Some("0"), "{}", run.output);

    let d2 = section("detail2");
    assert_eq!(after(&d2, "Raid Level :"), Some("raid5"), "mdadm --grow --level=5: {d2}");
    let kernel_chunk_kib: u32 = after(&d2, "Chunk Size :")
        .and_then(|c| c.strip_suffix('K'))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{d2}"));
    let r3 = section("recovery3");
    assert!(r3.contains("recover"), "the kernel was recovering Q when stopped: {r3}");
    rt.block_on(mdkit_reads_kernel_raid5(&their_mirror, &pattern, kernel_chunk_kib));
    rt.block_on(mdkit_finishes_kernel_recovery(&their_raid5, &pattern, (Level::Raid6, 18)));

    let d4 = section("detail4");
    assert_eq!((after(&d4, "Raid Level :"), after(&d4, "Raid Devices :")), (Some("raid4"), Some("4")), "{d4}");
    assert_eq!(after(&d4, "Failed Devices :"), Some("0"), "{d4}");
    assert!(!d4.contains("degraded") && !d4.contains("Rebuild Status"), "the kernel finished the recovery: {d4}");
    assert!(dumped(24) == pattern && dumped(32) == pattern, "the kernel reads mdkit's raid4-from-raid0");
    assert_eq!(section("mismatch4").lines().next().map(str::trim), Some("0"), "{}", run.output);
    let r5 = section("recovery5");
    assert!(r5.contains("recover"), "the kernel was recovering parity when stopped: {r5}");
    rt.block_on(mdkit_finishes_kernel_recovery(&their_raid0, &pattern, (Level::Raid4, 5)));

    let d6 = section("detail6");
    assert_eq!((after(&d6, "Raid Level :"), after(&d6, "Raid Devices :")), (Some("raid0"), Some("3")), "{d6}");
    let size6 = section("size6").lines().next().and_then(|l| l.trim().parse::<u64>().ok());
    assert_eq!(size6, Some(my_raid0_size), "the kernel's raid0 from mdkit's raid4 keeps the size");
    assert!(dumped(40) == pattern && dumped(48) == pattern, "the kernel reads mdkit's raid0-from-raid4");
    let d7 = section("detail7");
    assert_eq!((after(&d7, "Raid Level :"), after(&d7, "Raid Devices :")), (Some("raid0"), Some("3")), "{d7}");
    let size7 = section("size7").lines().next().and_then(|l| l.trim().parse::<u64>().ok()).unwrap();
    rt.block_on(mdkit_reads_kernel_raid0(&their_raid4, &pattern, size7));
}
