//! Parity cross-checked with the real Linux md driver, both ways, in the kernel lab
//! (../shared/lab: Debian 6.1 under qemu, host files as member disks).
//!
//! Boot 1 (kernel -> mdkit): the kernel creates two RAID6 arrays (6 and 5 members) and a RAID5
//! array (4 members), writes random data in full stripes and then scattered 4 KiB writes
//! (read-modify-write / reconstruct-write paths), checks and stops them. On the host every
//! stripe's P (and Q) in the member files must equal what mdkit computes from the data chunks,
//! `pq_check` must call every stripe consistent, and mdkit must rebuild every pair of members of
//! a few stripes from the kernel's parity.
//!
//! Boot 2 (mdkit -> kernel): the host writes new data and mdkit's parity into every stripe, with
//! one deliberately wrong Q page in md1. The kernel's `check` must find 0 mismatches in md0/md2
//! and exactly 8 sectors (one 4 KiB stripe page) in md1; the array contents must read back
//! as written; and reads with two failed members (RAID6) or one (RAID5) -- the kernel rebuilding
//! from mdkit's P/Q -- must return the same bytes.
//!
//! Skips (loudly) when the lab cannot be built or qemu is missing, or with MDKIT_SKIP_LAB=1.
//! Takes 35-45 s (two TCG boots of the lab kernel).

use crate::common;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::TestRng;
use mdkit_parity::{Implementation, PqCheck};

const MEMBER_BYTES: u64 = 4 << 20;
/// md0: 6, md1: 5, md2: 4 members, in the guest script's disk order.
const MEMBER_COUNTS: [(&str, usize); 3] = [("md0", 6), ("md1", 5), ("md2", 4)];
/// The page of md1 whose Q the host corrupts on purpose: (stripe, byte offset in the chunk).
const CORRUPT_MD1_Q: (u64, usize) = (3, 4096 + 123);
/// The kernel counts mismatches in sectors of one stripe page (4 KiB).
const MISMATCH_SECTORS_PER_PAGE: u64 = 8;

//------------------------------------------------------------------------------------------------
// Lab plumbing

struct Lab {
    run_sh: PathBuf,
}

fn lab() -> Option<Lab> {
    if std::env::var_os("MDKIT_SKIP_LAB").is_some() {
        eprintln!("SKIP: MDKIT_SKIP_LAB is set; kernel parity cross-check not run");
        return None;
    }
    // Beside the workspace as in the lab's README, or at /work/shared/lab for a clone elsewhere
    // (the other crates' lab tests look in the same two places).
    let beside = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/lab");
    let dir = std::env::var_os("MDKIT_LAB_DIR").map(PathBuf::from).unwrap_or_else(|| {
        [beside, PathBuf::from("/work/shared/lab")].into_iter().find(|d| d.join("run.sh").exists()).unwrap_or_default()
    });
    let (build, run_sh) = (dir.join("build.sh"), dir.join("run.sh"));
    if !build.exists() || !run_sh.exists() {
        eprintln!("SKIP: kernel lab not found at {} (set MDKIT_LAB_DIR)", dir.display());
        return None;
    }
    if Command::new("qemu-system-x86_64").arg("--version").output().is_err() {
        eprintln!("SKIP: qemu-system-x86_64 not installed (scripts/test installs it)");
        return None;
    }
    match Command::new(&build).output() {
        Ok(out) if out.status.success() => Some(Lab { run_sh }),
        Ok(out) => {
            eprintln!("SKIP: {} failed ({}):\n{}", build.display(), out.status, String::from_utf8_lossy(&out.stderr));
            None
        }
        Err(e) => {
            eprintln!("SKIP: cannot run {}: {e}", build.display());
            None
        }
    }
}

impl Lab {
    /// Boots the guest with `disks`, runs the guest script in `mode`, returns its stdout.
    fn run(&self, disks: &[PathBuf], mode: &str) -> String {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/lab/md-parity-guest.sh");
        // scripts/lab-slot: at most two lab guests on the machine at once.
        let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/lab-slot"));
        cmd.arg(&self.run_sh);
        cmd.args(["--timeout", "300"]);
        for disk in disks {
            cmd.arg("--disk").arg(disk);
        }
        let out = cmd.arg(&script).arg(mode).output().expect("run.sh starts");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "guest `{mode}` failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }
}

/// Lines `KEYWORD NAME VALUE` of the guest output, as (NAME -> VALUE).
fn keyword_values(output: &str, keyword: &str) -> HashMap<String, String> {
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some(keyword))
                .then(|| (words.next().unwrap_or("").to_string(), words.next().unwrap_or("").to_string()))
        })
        .collect()
}

//------------------------------------------------------------------------------------------------
// Arrays and the left-symmetric layout (formats.md 3.2 / 3.3)

#[derive(Debug)]
struct Array {
    name: String,
    level: u32,
    members: Vec<PathBuf>,
    chunk_bytes: usize,
    data_offset_bytes: u64,
    stripes: u64,
    array_bytes: u64,
}

impl Array {
    fn parse(name: &str, members: Vec<PathBuf>, output: &str) -> Array {
        let line = output
            .lines()
            .find(|l| l.starts_with(&format!("MDINFO {name} ")))
            .unwrap_or_else(|| panic!("no MDINFO line for {name} in guest output:\n{output}"));
        let fields: HashMap<&str, u64> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.parse().unwrap_or_else(|_| panic!("{name}: bad {k}={v}"))))
            .collect();
        let get = |k: &str| *fields.get(k).unwrap_or_else(|| panic!("{name}: MDINFO lacks {k}"));
        assert_eq!(get("layout"), 2, "{name}: expected left-symmetric");
        assert_eq!(get("raid_disks") as usize, members.len(), "{name}: member count");
        let chunk_bytes = get("chunk_bytes") as usize;
        Array {
            name: name.to_string(),
            level: get("level") as u32,
            members,
            chunk_bytes,
            data_offset_bytes: get("data_offset_sectors") * 512,
            stripes: get("component_kib") * 1024 / chunk_bytes as u64,
            array_bytes: get("array_bytes"),
        }
    }

    /// (P disk, Q disk, data disks in Q order) of a stripe. For left-symmetric the Q order
    /// (walk from the disk after Q, skipping P/Q) is the logical chunk order.
    fn roles(&self, stripe: u64) -> (usize, Option<usize>, Vec<usize>) {
        let n = self.members.len();
        let k = (stripe % n as u64) as usize;
        let p_disk = n - 1 - k;
        if self.level == 6 {
            let q_disk = (p_disk + 1) % n;
            let data = (0..n - 2).map(|dd| (p_disk + 2 + dd) % n).collect();
            (p_disk, Some(q_disk), data)
        } else {
            let data = (0..n - 1).map(|dd| (p_disk + 1 + dd) % n).collect();
            (p_disk, None, data)
        }
    }

    fn chunk_offset(&self, stripe: u64) -> u64 {
        self.data_offset_bytes + stripe * self.chunk_bytes as u64
    }

    fn read_stripe(&self, files: &[File], stripe: u64) -> Vec<Vec<u8>> {
        files
            .iter()
            .enumerate()
            .map(|(disk, f)| {
                let mut chunk = vec![0u8; self.chunk_bytes];
                f.read_exact_at(&mut chunk, self.chunk_offset(stripe))
                    .unwrap_or_else(|e| panic!("{} disk {disk} stripe {stripe}: {e}", self.name));
                chunk
            })
            .collect()
    }

    fn open(&self, write: bool) -> Vec<File> {
        self.members.iter().map(|m| OpenOptions::new().read(true).write(write).open(m).expect("member file")).collect()
    }
}

//------------------------------------------------------------------------------------------------
// Direction 1: parity the kernel wrote == parity mdkit computes

fn verify_kernel_parity(array: &Array, imp: &Implementation) {
    let files = array.open(false);
    for stripe in 0..array.stripes {
        let chunks = array.read_stripe(&files, stripe);
        let (p_disk, q_disk, data_disks) = array.roles(stripe);
        let data: Vec<&[u8]> = data_disks.iter().map(|&d| chunks[d].as_slice()).collect();
        let ctx = format!("{} stripe {stripe} ({imp:?})", array.name);
        let mut p = vec![0u8; array.chunk_bytes];
        match q_disk {
            Some(q_disk) => {
                let mut q = vec![0u8; array.chunk_bytes];
                imp.pq_gen(&data, &mut p, &mut q);
                assert!(p == chunks[p_disk], "{ctx}: P differs from the kernel's (disk {p_disk})");
                assert!(q == chunks[q_disk], "{ctx}: Q differs from the kernel's (disk {q_disk})");
                let verdict = imp.pq_check(&data, &chunks[p_disk], &chunks[q_disk]);
                assert_eq!(verdict, PqCheck::Consistent, "{ctx}");
            }
            None => {
                imp.xor_gen(&data, &mut p);
                assert!(p == chunks[p_disk], "{ctx}: P differs from the kernel's (disk {p_disk})");
            }
        }
    }
}

/// mdkit rebuilds every pair of members of the first stripes of a RAID6 array from the
/// kernel's P/Q.
fn recover_from_kernel_parity(array: &Array, stripes: u64) {
    let files = array.open(false);
    for stripe in 0..stripes.min(array.stripes) {
        let chunks = array.read_stripe(&files, stripe);
        let (p_disk, Some(q_disk), data_disks) = array.roles(stripe) else { panic!("{} is not RAID6", array.name) };
        let n = array.members.len();
        for a in 0..n {
            for b in a + 1..n {
                let lost = [a, b];
                let data: Vec<Option<&[u8]>> =
                    data_disks.iter().map(|d| (!lost.contains(d)).then_some(chunks[*d].as_slice())).collect();
                let p = (!lost.contains(&p_disk)).then_some(chunks[p_disk].as_slice());
                let q = (!lost.contains(&q_disk)).then_some(chunks[q_disk].as_slice());
                // Output order: missing data in Q order, then P, then Q.
                let mut order: Vec<usize> = data_disks.iter().copied().filter(|d| lost.contains(d)).collect();
                order.extend([p_disk, q_disk].into_iter().filter(|d| lost.contains(d)));
                let mut outs = vec![vec![0u8; array.chunk_bytes]; 2];
                let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                mdkit_parity::recover(&data, p, q, &mut out_refs).expect("two missing");
                for (out, disk) in outs.iter().zip(&order) {
                    assert!(*out == chunks[*disk], "{} stripe {stripe}: rebuilt disk {disk} differs", array.name);
                }
            }
        }
    }
}

//------------------------------------------------------------------------------------------------
// Direction 2: the host writes data + mdkit parity; returns the array's logical contents

fn write_mdkit_parity(array: &Array, rng: &mut TestRng, corrupt_q: Option<(u64, usize)>) -> Vec<u8> {
    let files = array.open(true);
    let mut logical = Vec::with_capacity(array.array_bytes as usize);
    for stripe in 0..array.stripes {
        let (p_disk, q_disk, data_disks) = array.roles(stripe);
        let data: Vec<Vec<u8>> = data_disks.iter().map(|_| rng.bytes(array.chunk_bytes)).collect();
        let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        let mut p = vec![0u8; array.chunk_bytes];
        let offset = array.chunk_offset(stripe);
        if let Some(q_disk) = q_disk {
            let mut q = vec![0u8; array.chunk_bytes];
            mdkit_parity::pq_gen(&refs, &mut p, &mut q);
            if let Some((bad_stripe, at)) = corrupt_q
                && bad_stripe == stripe
            {
                q[at] ^= 0x01;
            }
            files[q_disk].write_all_at(&q, offset).expect("write Q");
        } else {
            mdkit_parity::xor_gen(&refs, &mut p);
        }
        files[p_disk].write_all_at(&p, offset).expect("write P");
        for (block, &disk) in data.iter().zip(&data_disks) {
            files[disk].write_all_at(block, offset).expect("write data");
            logical.extend_from_slice(block);
        }
    }
    for f in &files {
        f.sync_all().expect("sync member");
    }
    assert_eq!(logical.len() as u64, array.array_bytes, "{}: stripes x data chunks = array size", array.name);
    logical
}

fn sha256_hex(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum (coreutils) runs");
    child.stdin.take().expect("stdin").write_all(bytes).expect("feed sha256sum");
    let out = child.wait_with_output().expect("sha256sum finishes");
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap_or("").to_string()
}

//------------------------------------------------------------------------------------------------

#[test]
fn kernel_md_parity_both_ways() {
    let Some(lab) = lab() else { return };
    // O_DIRECT member I/O needs a real filesystem (not tmpfs): /var/tmp, like the lab's cache.
    let dir = tempfile::Builder::new().prefix("mdkit-parity-lab-").tempdir_in("/var/tmp").expect("tempdir");
    let mut disks = Vec::new();
    let mut members_of: Vec<(String, Vec<PathBuf>)> = Vec::new();
    for (name, count) in MEMBER_COUNTS {
        let members: Vec<PathBuf> = (0..count).map(|i| dir.path().join(format!("{name}-{i}.img"))).collect();
        for m in &members {
            File::create(m).and_then(|f| f.set_len(MEMBER_BYTES)).expect("sparse member file");
        }
        disks.extend(members.iter().cloned());
        members_of.push((name.to_string(), members));
    }

    // Boot 1: the kernel writes; mdkit recomputes.
    let out = lab.run(&disks, "create");
    let kernel_check = keyword_values(&out, "MISMATCH");
    let arrays: Vec<Array> = members_of.into_iter().map(|(name, m)| Array::parse(&name, m, &out)).collect();
    for array in &arrays {
        assert_eq!(kernel_check.get(&array.name).map(String::as_str), Some("0"), "kernel check of {}", array.name);
        for imp in Implementation::available() {
            verify_kernel_parity(array, imp);
        }
        eprintln!("{}: {} stripes, kernel parity == mdkit parity", array.name, array.stripes);
    }
    recover_from_kernel_parity(&arrays[0], 6);
    recover_from_kernel_parity(&arrays[1], 5);

    // Boot 2: mdkit writes; the kernel checks, reads and rebuilds.
    let mut rng = TestRng::new(0x5eed_0ab2);
    let expected_sha: HashMap<String, String> = arrays
        .iter()
        .map(|a| {
            let corrupt = (a.name == "md1").then_some(CORRUPT_MD1_Q);
            (a.name.clone(), sha256_hex(&write_mdkit_parity(a, &mut rng, corrupt)))
        })
        .collect();
    let out = lab.run(&disks, "verify");
    let mismatches = keyword_values(&out, "MISMATCH");
    let shas = keyword_values(&out, "SHA");
    let degraded = keyword_values(&out, "SHA-DEGRADED");
    for array in &arrays {
        let expect_mismatch = if array.name == "md1" { MISMATCH_SECTORS_PER_PAGE } else { 0 };
        assert_eq!(
            mismatches.get(&array.name),
            Some(&expect_mismatch.to_string()),
            "kernel check of {} over mdkit parity\n{out}",
            array.name
        );
        assert_eq!(shas.get(&array.name), expected_sha.get(&array.name), "{} contents read by the kernel", array.name);
    }
    for name in ["md0", "md2"] {
        assert_eq!(
            degraded.get(name),
            expected_sha.get(name),
            "{name} degraded read (kernel rebuild from mdkit parity)"
        );
    }
    eprintln!("kernel accepted mdkit parity: check 0 mismatches, the planted bad Q page found, degraded reads correct");
}
