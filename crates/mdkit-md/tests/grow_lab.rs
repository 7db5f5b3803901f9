//! `grow` and the Linux kernel (lab: Debian 6.1 + mdadm 4.2 under qemu), both ways, one boot:
//!
//! 1. mdkit -> kernel: a raid1 created by mdkit on two 64 MiB files with a 64 KiB-chunk bitmap
//!    gets a pattern at 0, the files grow to 128 MiB, `grow --size max` (bitmap resized, new
//!    part resynced), a pattern at 96 MiB, `grow --raid-devices 3 --add` (the spare is
//!    recovered), `--bitmap none` then `--bitmap internal` (a bitmap added by mdkit). The
//!    kernel assembles it: `mdadm --detail` shows the new size, 3 devices and the bitmap, both
//!    patterns read back, and its check finds 0 mismatches.
//! 2. kernel -> mdkit: the kernel creates a raid1 with `--size 32M` and no bitmap, writes the
//!    pattern, `mdadm --grow --size max`, the pattern at 96 MiB, `--raid-devices 3 --add`,
//!    `--bitmap=internal`; mdkit assembles the result with 3 mirrors, the bitmap and the size
//!    mdadm reported, the patterns read back and mdkit's check finds 0 mismatches.
//!
//! Skips loudly (SKIP: ...) when the lab cannot be built or booted.

use std::sync::Arc;

use common::lab::RunOptions;
use mdkit_io::{BlockDeviceExt, DeviceRef, FileDevice, FileOptions, Rng, WriteFlags};
use mdkit_md::array::{
    AssembleOptions, BitmapChange, CreateOptions, GrowChange, GrowSize, MemberDev, assemble, create,
};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::layout::Level;

use crate::array_util::{MIB, check, fast_sync};
use crate::common;
use common::lab::detail_field as after;

const PATTERN_BYTES: u64 = 8 * MIB;
const HIGH: u64 = 96 * MIB;

fn member(path: &std::path::Path) -> MemberDev {
    let dev: DeviceRef = Arc::new(FileDevice::open(path, FileOptions::default()).unwrap());
    MemberDev::new(path.file_name().unwrap().to_string_lossy().into_owned(), dev)
}

fn sized(path: &std::path::Path, bytes: u64) {
    std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(path).unwrap().set_len(bytes).unwrap();
}

/// mdkit's half of 1: returns the per-member size in KiB.
async fn mdkit_grows(paths: &[std::path::PathBuf], pattern: &[u8]) -> u64 {
    let mut o = CreateOptions::new("growlab", Level::Raid1, 2);
    o.bitmap = BitmapRequest::Internal { chunk_bytes: Some(64 << 10) };
    o.assume_clean = true;
    let a = create(paths[..2].iter().map(|p| member(p)).collect(), o).await.unwrap().array;
    fast_sync(&a);
    a.write_slice(0, pattern, WriteFlags::FUA).await.unwrap();
    for p in &paths[..2] {
        sized(p, 128 * MIB);
    }
    let r = a.grow(GrowChange::Size { size: GrowSize::Max, assume_clean: false }, vec![]).await.unwrap();
    eprintln!("mdkit grow: {r:?}");
    a.write_slice(HIGH, pattern, WriteFlags::FUA).await.unwrap();
    a.grow(GrowChange::RaidDevices(3), vec![member(&paths[2])]).await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!(a.core().degraded(), 0);
    a.grow(GrowChange::Bitmap(BitmapChange::None), vec![]).await.unwrap();
    a.grow(GrowChange::Bitmap(BitmapChange::Internal { chunk_bytes: None }), vec![]).await.unwrap();
    a.wait_sync_idle().await;
    assert_eq!(check(&a).await, 0);
    let kib = a.info().member_size_sectors / 2;
    a.stop().await.unwrap();
    kib
}

/// mdkit's half of 2.
async fn mdkit_assembles(paths: &[std::path::PathBuf], pattern: &[u8], kernel_kib: u64) {
    let devs = paths.iter().map(|p| member(p)).collect();
    let a = assemble(devs, AssembleOptions { name: "kgrown".into(), ..Default::default() }).await.unwrap().array;
    fast_sync(&a);
    assert_eq!(a.info().raid_disks, 3);
    assert!(a.core().bitmap.is_some(), "the bitmap mdadm --grow added");
    assert_eq!(a.info().member_size_sectors / 2, kernel_kib, "the size mdadm --grow --size max gave");
    assert_eq!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(a.read_vec(HIGH, PATTERN_BYTES as usize).await.unwrap(), pattern);
    assert_eq!(check(&a).await, 0);
    a.stop().await.unwrap();
}

#[test]
fn grown_arrays_cross_between_mdkit_and_the_kernel() {
    let lab = crate::lab_or_skip!("grow_lab");
    let dir = lab.scratch_dir("grow");
    let mut pattern = vec![0u8; PATTERN_BYTES as usize];
    Rng::new(0x6772).fill(&mut pattern);
    let pat_path = dir.path().join("pat");
    std::fs::write(&pat_path, &pattern).unwrap();
    let mine: Vec<_> = (0..3).map(|i| dir.path().join(format!("a{i}.img"))).collect();
    let theirs: Vec<_> = (0..3).map(|i| dir.path().join(format!("b{i}.img"))).collect();
    for (i, p) in mine.iter().enumerate() {
        sized(p, if i < 2 { 64 * MIB } else { 128 * MIB });
    }
    for p in &theirs {
        sized(p, 128 * MIB);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let my_kib = rt.block_on(mdkit_grows(&mine, &pattern));

    let script = r#"
set -u
pat=/lab/files/pat
sum() { dd if=$1 bs=1M skip=$2 count=8 iflag=direct status=none | md5sum | cut -d' ' -f1; }
echo "=== pattern"; md5sum $pat | cut -d' ' -f1
mdadm --assemble /dev/md0 /dev/vda /dev/vdb /dev/vdc 2>&1 || echo assemble_failed=1
echo "=== detail0"; mdadm --detail /dev/md0
echo "=== low0"; sum /dev/md0 0
echo "=== high0"; sum /dev/md0 96
echo check > /sys/block/md0/md/sync_action; sleep 1; mdadm --wait /dev/md0
echo "=== mismatch0"; cat /sys/block/md0/md/mismatch_cnt
mdadm --stop /dev/md0 2>&1
mdadm --create /dev/md1 --run --metadata=1.2 --level=1 --raid-devices=2 --bitmap=none --size=32M /dev/vdd /dev/vde 2>&1
mdadm --wait /dev/md1
dd if=$pat of=/dev/md1 bs=1M oflag=direct status=none
mdadm --grow /dev/md1 --size=max 2>&1; sleep 1; mdadm --wait /dev/md1
dd if=$pat of=/dev/md1 bs=1M seek=96 oflag=direct status=none
mdadm --grow /dev/md1 --raid-devices=3 --add /dev/vdf 2>&1; sleep 1; mdadm --wait /dev/md1
mdadm --grow /dev/md1 --bitmap=internal 2>&1
echo "=== detail1"; mdadm --detail /dev/md1
mdadm --stop /dev/md1 2>&1
echo "=== end"
"#;
    let mut opts = RunOptions::with_disks(mine.iter().chain(&theirs).cloned().collect());
    opts.files.push(pat_path);
    let run = lab.run(&opts, script).unwrap_or_else(|e| panic!("lab: {e}"));
    assert_eq!(run.exit_code, 0, "{}", run.output);
    assert!(!run.output.contains("assemble_failed"), "{}", run.output);
    let section = |n: &str| run.section(n).unwrap_or_else(|| panic!("no section {n}:\n{}", run.output));
    let want = section("pattern").lines().next().unwrap_or_default().to_string();
    let detail0 = section("detail0");
    assert_eq!(after(&detail0, "Raid Devices :"), Some("3"), "{detail0}");
    assert_eq!(after(&detail0, "Intent Bitmap :"), Some("Internal"), "{detail0}");
    let size0 = after(&detail0, "Array Size :").and_then(|s| s.split_whitespace().next()).and_then(|s| s.parse().ok());
    assert_eq!(size0, Some(my_kib), "{detail0}");
    assert_eq!(section("low0").trim(), want.trim(), "pattern written before the grow:\n{}", run.output);
    assert_eq!(section("high0").trim(), want.trim(), "pattern in the grown part:\n{}", run.output);
    assert_eq!(section("mismatch0").lines().next().map(str::trim), Some("0"), "{}", run.output);
    assert_eq!(after(&detail0, "Update Time :").map(|t| t.contains("2106")), Some(false), "whole seconds: {detail0}");
    let detail1 = section("detail1");
    assert_eq!(after(&detail1, "Raid Devices :"), Some("3"), "{detail1}");
    assert_eq!(after(&detail1, "Intent Bitmap :"), Some("Internal"), "{detail1}");
    let kernel_kib: u64 = after(&detail1, "Array Size :")
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{detail1}"));
    assert!(kernel_kib > 100 * 1024, "{detail1}");
    rt.block_on(mdkit_assembles(&theirs, &pattern, kernel_kib));
}
