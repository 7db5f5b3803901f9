//! raid5 4 -> 5 reshape across mdkit and the Linux kernel (lab: Debian kernel + mdadm under
//! qemu), both ways, one boot:
//!
//! 1. mdkit -> kernel: mdkit creates a raid5 on four 64 MiB files (64 KiB chunks), writes a
//!    pattern at 0 and at 160 MiB, starts `grow --raid-devices 5 --add` throttled by
//!    `sync_speed_max` and stops the array mid-way. The kernel assembles it, finishes the
//!    reshape (`mdadm --wait`), shows 5 devices and the grown size, both patterns read back and
//!    its check finds 0 mismatches.
//! 2. kernel -> mdkit: the kernel creates the same array, writes the patterns, starts `mdadm
//!    --grow --raid-devices=5 --add` throttled by speed_limit_max and is stopped mid-way; mdkit
//!    assembles it (reshape in progress), finishes the reshape, the patterns read back and
//!    mdkit's check finds 0 mismatches.
//!
//! Skips loudly (SKIP: ...) when the lab cannot be built or booted.

use std::sync::Arc;
use std::time::Duration;

use common::lab::RunOptions;
use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, WriteFlags};
use mdkit_md::array::{AssembleOptions, GrowChange, MemberDev, assemble, create, read_superblock};
use mdkit_md::format::superblock::feature;
use mdkit_md::layout::Level;

use crate::array_util::{MIB, check, fast_sync, opts};
use crate::common;

const PATTERN_BYTES: u64 = 8 * MIB;
const HIGH: u64 = 160 * MIB;

fn member(path: &std::path::Path) -> MemberDev {
    let dev: DeviceRef = Arc::new(FileDevice::open(path, FileOptions::default()).unwrap());
    MemberDev::new(path.file_name().unwrap().to_string_lossy().into_owned(), dev)
}

/// mdkit's half of 1: returns the reshape position recorded at the stop.
async fn mdkit_starts(paths: &[std::path::PathBuf], pattern: &[u8]) -> u64 {
    let o = opts(Level::Raid5, 4, Some(64), None, false, true);
    let a = create(paths[..4].iter().map(|p| member(p)).collect(), o).await.unwrap().array;
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    a.write_slice(HIGH, pattern, WriteFlags::FUA).await.unwrap();
    a.set_attribute("sync_speed_max", "4000").unwrap();
    a.grow(GrowChange::RaidDevices(5), vec![member(&paths[4])]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    a.stop().await.unwrap();
    let sb = read_superblock(&member(&paths[0]).dev).await.unwrap();
    assert_ne!(sb.feature_map & feature::RESHAPE_ACTIVE, 0, "stopped mid-way");
    sb.reshape_position_sectors
}

/// mdkit's half of 2.
async fn mdkit_finishes(paths: &[std::path::PathBuf], pattern: &[u8]) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "kreshape".into(), ..Default::default() }).await.unwrap().array;
    let r = a.core().personality().reshape().map(|r| (r.position_sectors(), r.new_array_sectors()));
    eprintln!("mdkit assembled the kernel's reshape at (position, end) {r:?}");
    assert!(r.is_some_and(|(p, end)| p > 0 && p < end), "a reshape in progress: {r:?}");
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(HIGH, PATTERN_BYTES as usize).await.unwrap(), pattern);
    fast_sync(&a);
    a.wait_reshape().await.unwrap();
    assert_eq!(a.info().raid_disks, 5);
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(HIGH, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

fn after<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.trim_start().strip_prefix(key)).map(str::trim)
}

#[test]
fn raid5_reshape_crosses_between_mdkit_and_the_kernel() {
    let lab = crate::lab_or_skip!("reshape_lab");
    let dir = lab.scratch_dir("reshape");
    let mut pattern = vec![0u8; PATTERN_BYTES as usize];
    Rng::new(0x7265).fill(&mut pattern);
    let pat_path = dir.path().join("pat");
    std::fs::write(&pat_path, &pattern).unwrap();
    let mine: Vec<_> = (0..5).map(|i| dir.path().join(format!("a{i}.img"))).collect();
    let theirs: Vec<_> = (0..5).map(|i| dir.path().join(format!("b{i}.img"))).collect();
    for p in mine.iter().chain(&theirs) {
        std::fs::File::create(p).unwrap().set_len(64 * MIB).unwrap();
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let stopped_at = rt.block_on(mdkit_starts(&mine, &pattern));
    eprintln!("mdkit stopped its reshape at array sector {stopped_at}");
    assert!(stopped_at > 0);

    let script = r#"
set -u
pat=/lab/files/pat
sum() { dd if=$1 bs=1M skip=$2 count=8 iflag=direct status=none | md5sum | cut -d' ' -f1; }
echo "=== pattern"; md5sum $pat | cut -d' ' -f1
mdadm --assemble /dev/md0 /dev/vda /dev/vdb /dev/vdc /dev/vdd /dev/vde 2>&1 || echo assemble_failed=1
mdadm --readwrite /dev/md0 2>&1
cat /proc/mdstat
sleep 1; mdadm --wait /dev/md0; sleep 1; mdadm --wait /dev/md0
echo "=== detail0"; mdadm --detail /dev/md0
echo "=== low0"; sum /dev/md0 0
echo "=== high0"; sum /dev/md0 160
echo check > /sys/block/md0/md/sync_action; sleep 1; mdadm --wait /dev/md0
echo "=== mismatch0"; cat /sys/block/md0/md/mismatch_cnt
mdadm --stop /dev/md0 2>&1
mdadm --create /dev/md1 --run --metadata=1.2 --level=5 --chunk=64 --raid-devices=4 --assume-clean --bitmap=none /dev/vdf /dev/vdg /dev/vdh /dev/vdi 2>&1
dd if=$pat of=/dev/md1 bs=1M oflag=direct status=none
dd if=$pat of=/dev/md1 bs=1M seek=160 oflag=direct status=none
echo 1000 > /proc/sys/dev/raid/speed_limit_min
echo 3000 > /proc/sys/dev/raid/speed_limit_max
mdadm --grow /dev/md1 --raid-devices=5 --add /dev/vdj 2>&1
sleep 3
echo "=== reshape1"; cat /sys/block/md1/md/sync_action /sys/block/md1/md/reshape_position
mdadm --stop /dev/md1 2>&1
echo "=== end"
"#;
    let mut opts = RunOptions::with_disks(mine.iter().chain(&theirs).cloned().collect());
    opts.files.push(pat_path);
    let run = lab.run(&opts, script).unwrap_or_else(|e| panic!("lab: {e}"));
    eprintln!("{}", run.output);
    assert_eq!(run.exit_code, 0, "{}", run.output);
    assert!(!run.output.contains("assemble_failed"), "{}", run.output);
    let section = |n: &str| run.section(n).unwrap_or_else(|| panic!("no section {n}:\n{}", run.output));
    let want = section("pattern").lines().next().unwrap_or_default().to_string();
    let detail0 = section("detail0");
    assert_eq!(after(&detail0, "Raid Devices :"), Some("5"), "{detail0}");
    assert!(!detail0.contains("Reshape Status"), "the kernel finished the reshape: {detail0}");
    assert_eq!(section("low0").trim(), want.trim(), "pattern at 0:\n{}", run.output);
    assert_eq!(section("high0").trim(), want.trim(), "pattern at 160 MiB:\n{}", run.output);
    assert_eq!(section("mismatch0").lines().next().map(str::trim), Some("0"), "{}", run.output);
    let reshape1 = section("reshape1");
    assert!(reshape1.contains("reshape"), "the kernel was reshaping when stopped: {reshape1}");
    rt.block_on(mdkit_finishes(&theirs, &pattern));
}
