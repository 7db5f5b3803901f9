//! Bad-block logs between the Linux kernel (Debian 6.1 md under qemu, `../shared/lab`) and
//! mdkit, in two boots:
//!
//! 1. The kernel creates a raid1 and a raid5 (`mdadm --create`), writes a pattern, records a
//!    64-sector bad block on one member of each through md's sysfs `dev-*/bad_blocks`, writes
//!    once more so md_update_sb writes the log, stops them, and zeroes those members' data under
//!    the bad range. On the host mdkit assembles both, lists the kernel's entry, and reads the
//!    pattern exactly (never the zeroed sectors). Then a write error injected under the raid1's
//!    other member makes mdkit record a bad block there; host `mdadm --examine-badblocks` lists
//!    it.
//! 2. The kernel assembles both arrays: it lists mdkit's entry in sysfs and with
//!    `mdadm --examine-badblocks`, keeps the member in sync, reads back exactly what mdkit
//!    wrote, and its check of the raid5 finds 0 mismatches.
//!
//! Skips loudly (SKIP: ...) when the lab cannot be built or booted.

use crate::array_util;
use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use array_util::*;
use common::lab::{LabRun, RunOptions};
use mdkit_io::{BlockDevice, BlockDeviceExt, DeviceRef, FaultRule, FaultyDevice, FileDevice, FileOptions, OpMask, Rng};
use mdkit_io::{SharedBuf, WriteFlags};
use mdkit_md::array::{Array, AssembleOptions, MemberDev, assemble};

const MEMBER_BYTES: u64 = 64 * MIB;
const PATTERN_BYTES: u64 = 8 * MIB;
/// Where mdkit's write lands in the raid1 (array bytes), over its injected write error.
const WRITE_AT: u64 = 2 * MIB;
const WRITE_LEN: u64 = 64 << 10;

const BOOT1: &str = r#"set -u
modprobe raid1; modprobe raid456
C="--run --metadata=1.2 --assume-clean --bitmap=none --homehost=lab"
mdadm --create /dev/md0 $C --name=bb1 --level=1 --raid-devices=2 /dev/vda /dev/vdb 2>&1 | sed 's/^/  | /'; echo create0=${PIPESTATUS[0]}
mdadm --create /dev/md1 $C --name=bb5 --level=5 --raid-devices=3 --chunk=64 /dev/vdc /dev/vdd /dev/vde 2>&1 | sed 's/^/  | /'; echo create1=${PIPESTATUS[0]}
for md in md0 md1; do dd if=/dev/vdf of=/dev/$md bs=1M count=8 oflag=direct status=none; echo write_$md=$?; done
off0=$(cat /sys/block/md0/md/dev-vda/offset); off1=$(cat /sys/block/md1/md/dev-vdc/offset)
echo off0=$off0; echo off1=$off1
echo "$((off0 + 2048)) 64" > /sys/block/md0/md/dev-vda/bad_blocks; echo bb0=$?
echo "$((off1 + 2048)) 64" > /sys/block/md1/md/dev-vdc/bad_blocks; echo bb1=$?
# Let both arrays go clean, then write: the clean->active superblock update writes the logs.
sleep 1
for md in md0 md1; do dd if=/dev/vdf of=/dev/$md bs=4k count=1 oflag=direct status=none; echo touch_$md=$?; done
sleep 1
mdadm --stop /dev/md0 /dev/md1 2>&1 | sed 's/^/  | /'; echo stop=${PIPESTATUS[0]}
echo '=== examine'
mdadm --examine-badblocks /dev/vda /dev/vdc
echo '=== end'
dd if=/dev/zero of=/dev/vda bs=512 seek=$((off0 + 2048)) count=64 oflag=direct conv=notrunc status=none; echo zero0=$?
dd if=/dev/zero of=/dev/vdc bs=512 seek=$((off1 + 2048)) count=64 oflag=direct conv=notrunc status=none; echo zero1=$?
"#;

const BOOT2: &str = r#"set -u
modprobe raid1; modprobe raid456
mdadm --assemble /dev/md0 /dev/vda /dev/vdb 2>&1 | sed 's/^/  | /'; echo assemble0=${PIPESTATUS[0]}
mdadm --assemble /dev/md1 /dev/vdc /dev/vdd /dev/vde 2>&1 | sed 's/^/  | /'; echo assemble1=${PIPESTATUS[0]}
echo state0=$(cat /sys/block/md0/md/dev-vdb/state)
echo degraded0=$(cat /sys/block/md0/md/degraded)
echo sum0=$(dd if=/dev/md0 bs=1M count=8 iflag=direct status=none | sha256sum | cut -d' ' -f1)
echo want0=$(dd if=/dev/vdf bs=1M count=8 status=none | sha256sum | cut -d' ' -f1)
echo sum1=$(dd if=/dev/md1 bs=1M count=8 iflag=direct status=none | sha256sum | cut -d' ' -f1)
echo want1=$(dd if=/dev/vdg bs=1M count=8 status=none | sha256sum | cut -d' ' -f1)
echo check > /sys/block/md1/md/sync_action
t=0; while [ "$(cat /sys/block/md1/md/sync_action)" != idle ] && [ $t -lt 3000 ]; do sleep 0.1; t=$((t+1)); done
echo mismatch1=$(cat /sys/block/md1/md/mismatch_cnt)
echo '=== sysfs'
cat /sys/block/md0/md/dev-vdb/bad_blocks
echo '=== examine'
mdadm --examine-badblocks /dev/vdb
echo '=== end'
mdadm --stop /dev/md0 /dev/md1 >/dev/null 2>&1
"#;

/// `key=value` lines of a run.
fn values(run: &LabRun) -> HashMap<String, String> {
    run.output
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, v)| (k.trim().to_string(), v.trim().to_string())))
        .collect()
}

fn sparse(path: &Path, bytes: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(bytes).unwrap();
}

fn file_dev(path: &Path) -> DeviceRef {
    Arc::new(FileDevice::open(path, FileOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

async fn assemble_files(name: &str, members: Vec<MemberDev>) -> Array {
    let r = assemble(members, AssembleOptions { name: name.into(), ..Default::default() })
        .await
        .unwrap_or_else(|e| panic!("{name}: mdkit cannot assemble the kernel's array with bad blocks: {e}"));
    assert!(r.refused.is_empty(), "{name}: {:?}", r.refused);
    r.array
}

fn member_bad_blocks(a: &Array, member: &str) -> u64 {
    let d = a.detail();
    let m = d["members"].as_array().unwrap().iter().find(|m| m["name"] == member).cloned();
    m.unwrap_or_else(|| panic!("{d}"))["bad_blocks"].as_u64().unwrap()
}

fn host_examine_badblocks(path: &Path) -> String {
    let out = std::process::Command::new("mdadm").arg("--examine-badblocks").arg(path).output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => format!("mdadm not runnable: {e}"),
    }
}

#[test]
fn kernel_and_mdkit_bad_block_logs_interoperate() {
    let lab = crate::lab_or_skip!("kernel_and_mdkit_bad_block_logs_interoperate");
    let dir = lab.scratch_dir("badblocks");
    let names = ["r1-0", "r1-1", "r5-0", "r5-1", "r5-2"];
    let imgs: Vec<PathBuf> = names.iter().map(|n| dir.path().join(format!("{n}.img"))).collect();
    for p in &imgs {
        sparse(p, MEMBER_BYTES);
    }
    let pat = {
        let mut v = vec![0u8; PATTERN_BYTES as usize];
        Rng::new(seed("badblocks_lab", 17)).fill(&mut v);
        v
    };
    let pat_file = dir.path().join("pattern.img");
    std::fs::write(&pat_file, &pat).unwrap();
    let mut disks = imgs.clone();
    disks.push(pat_file.clone());
    let run1 = lab.run(&RunOptions::with_disks(disks), BOOT1).unwrap_or_else(|e| panic!("lab boot 1: {e}"));
    eprintln!("lab: boot 1 took {:.1} s", run1.elapsed.as_secs_f64());
    let v = values(&run1);
    for k in ["create0", "create1", "write_md0", "write_md1", "bb0", "bb1", "touch_md0", "touch_md1", "stop"] {
        assert_eq!(v.get(k).map(String::as_str), Some("0"), "boot 1: {k}:\n{}", run1.output);
    }
    let off0: u64 = v["off0"].parse().unwrap();
    let off1: u64 = v["off1"].parse().unwrap();
    let kernel_list = run1.section("examine").unwrap_or_default();
    assert!(kernel_list.contains(&format!("{} for 64 sectors", off0 + 2048)), "kernel log:\n{kernel_list}");
    assert!(kernel_list.contains(&format!("{} for 64 sectors", off1 + 2048)), "kernel log:\n{kernel_list}");

    let mut want = pat.clone();
    let mut rng = Rng::new(23);
    let mut new_data = vec![0u8; WRITE_LEN as usize];
    rng.fill(&mut new_data);
    want[WRITE_AT as usize..(WRITE_AT + WRITE_LEN) as usize].copy_from_slice(&new_data);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // mdkit honours the kernel's entries: the zeroed sectors are never returned.
        let r1: Vec<MemberDev> = (0..2).map(|i| MemberDev::new(names[i], file_dev(&imgs[i]))).collect();
        let a = assemble_files("bb1", r1).await;
        assert_eq!(member_bad_blocks(&a, "r1-0"), 1, "the kernel's entry is loaded");
        assert_eq!(a.get_attribute("dev-r1-0/bad_blocks").unwrap(), format!("{} 64\n", off0 + 2048));
        assert!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap() == pat, "raid1: mdkit reads the pattern");
        a.stop().await.unwrap();
        drop(a);
        let r5: Vec<MemberDev> = (2..5).map(|i| MemberDev::new(names[i], file_dev(&imgs[i]))).collect();
        let a = assemble_files("bb5", r5).await;
        assert_eq!(member_bad_blocks(&a, "r5-0"), 1);
        assert!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap() == pat, "raid5: mdkit reads the pattern");
        a.stop().await.unwrap();
        drop(a);

        // mdkit records a bad block for a write error on r1-1 instead of failing it.
        let inner = file_dev(&imgs[1]);
        let faulty = FaultyDevice::new(inner);
        let h = faulty.handle();
        let at = (off0 + WRITE_AT / 512) * 512;
        h.add(FaultRule::error(OpMask::WRITE, Some(at..at + 4096)));
        let r1 = vec![MemberDev::new(names[0], file_dev(&imgs[0])), MemberDev::new(names[1], Arc::new(faulty))];
        let a = assemble_files("bb1", r1).await;
        a.write(WRITE_AT, SharedBuf::from_slice(&new_data), WriteFlags::FUA).await.unwrap();
        assert_eq!(a.get_attribute("dev-r1-1/state").unwrap(), "in_sync,write_error");
        assert_eq!(a.get_attribute("dev-r1-1/bad_blocks").unwrap(), format!("{} 8\n", off0 + 4096));
        assert!(a.read_vec(0, PATTERN_BYTES as usize).await.unwrap() == want, "raid1: read after the write error");
        a.stop().await.unwrap();
    });
    let host = host_examine_badblocks(&imgs[1]);
    assert!(host.contains(&format!("{:>20} for 8 sectors", off0 + 4096)), "host mdadm --examine-badblocks:\n{host}");

    let want_file = dir.path().join("want.img");
    std::fs::write(&want_file, &want).unwrap();
    let mut disks = imgs.clone();
    disks.push(want_file);
    disks.push(pat_file);
    let run2 = lab.run(&RunOptions::with_disks(disks), BOOT2).unwrap_or_else(|e| panic!("lab boot 2: {e}"));
    eprintln!("lab: boot 2 took {:.1} s", run2.elapsed.as_secs_f64());
    let v = values(&run2);
    for k in ["assemble0", "assemble1", "degraded0", "mismatch1"] {
        assert_eq!(v.get(k).map(String::as_str), Some("0"), "boot 2: {k}:\n{}", run2.output);
    }
    assert_eq!(v.get("state0").map(String::as_str), Some("in_sync"), "{}", run2.output);
    assert_eq!(v.get("sum0"), v.get("want0"), "the kernel reads mdkit's raid1 data:\n{}", run2.output);
    assert_eq!(v.get("sum1"), v.get("want1"), "the kernel reads the raid5 pattern:\n{}", run2.output);
    let sysfs = run2.section("sysfs").unwrap_or_default();
    assert_eq!(sysfs.trim(), format!("{} 8", off0 + 4096), "kernel sysfs bad_blocks:\n{}", run2.output);
    let listed = run2.section("examine").unwrap_or_default();
    assert!(listed.contains(&format!("{:>20} for 8 sectors", off0 + 4096)), "guest mdadm:\n{}", run2.output);
}
