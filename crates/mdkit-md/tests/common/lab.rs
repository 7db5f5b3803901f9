//! The kernel lab (`/work/shared/lab`): boots Debian's 6.1 kernel under qemu with host files as
//! virtio disks, runs one shell script inside as root and returns its output.
//!
//! ```no_run
//! let lab = match Lab::get() { Ok(l) => l, Err(why) => { eprintln!("SKIP: {why}"); return; } };
//! let run = lab.run(&RunOptions::with_disks(vec![img]), "cat /proc/mdstat")?;
//! assert_eq!(run.exit_code, 0, "{}", run.output);
//! ```
//! Or use [`lab_or_skip!`] in a `#[test]`, which prints "SKIP: ..." and returns when the lab
//! cannot be built or booted. Boots cost about 5 s each (TCG), so batch work into one script.
//!
//! Environment: `MDKIT_LAB_DIR` (the lab directory, default `<workspace>/../shared/lab`, then
//! `/work/shared/lab`), `LAB_CACHE` (passed through, default `/var/tmp/mdlab`),
//! `MDKIT_SKIP_LAB=1` (skip every lab test).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A built, usable lab.
#[derive(Debug)]
pub struct Lab {
    pub dir: PathBuf,
    pub cache: PathBuf,
}

/// How to boot the guest for one script.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Host files attached as /dev/vda, /dev/vdb, ... in order (paths without commas).
    pub disks: Vec<PathBuf>,
    /// Extra files copied into the guest as /lab/files/NAME.
    pub files: Vec<PathBuf>,
    pub mem_mb: u32,
    pub timeout_secs: u64,
}

impl RunOptions {
    pub fn with_disks(disks: Vec<PathBuf>) -> RunOptions {
        RunOptions { disks, files: Vec::new(), mem_mb: 2048, timeout_secs: 600 }
    }
}

/// What a guest script did.
#[derive(Clone, Debug)]
pub struct LabRun {
    /// The script's exit code (124 = timeout, 125 = the guest died, see lab README).
    pub exit_code: i32,
    /// The script's stdout and stderr, interleaved as the guest wrote them.
    pub output: String,
    pub elapsed: Duration,
}

impl LabRun {
    /// Lines after a marker line `=== NAME` up to the next `=== ` marker (for scripts that
    /// print several sections).
    pub fn section(&self, name: &str) -> Option<String> {
        let marker = format!("=== {name}");
        let mut lines = self.output.lines().skip_while(|l| l.trim_end() != marker);
        lines.next()?;
        Some(lines.take_while(|l| !l.starts_with("=== ")).map(|l| format!("{l}\n")).collect())
    }
}

static LAB: OnceLock<Result<Lab, String>> = OnceLock::new();

fn lab_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("MDKIT_LAB_DIR") {
        return Some(PathBuf::from(d));
    }
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    [workspace.join("../shared/lab"), PathBuf::from("/work/shared/lab")].into_iter().find(|d| d.join("run.sh").exists())
}

fn which(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().map(|o| o.status.success()).unwrap_or(false)
}

impl Lab {
    /// The lab, running `build.sh` once per test process (idempotent, ~2 s when up to date).
    /// `Err` says why it cannot be used; callers skip loudly.
    pub fn get() -> Result<&'static Lab, String> {
        LAB.get_or_init(Lab::init).as_ref().map_err(Clone::clone)
    }

    fn init() -> Result<Lab, String> {
        if std::env::var("MDKIT_SKIP_LAB").is_ok_and(|v| v == "1") {
            return Err("MDKIT_SKIP_LAB=1".into());
        }
        let dir = lab_dir().ok_or("no lab directory (set MDKIT_LAB_DIR)")?;
        if !which("qemu-system-x86_64") {
            return Err("qemu-system-x86_64 is not installed".into());
        }
        let cache = PathBuf::from(std::env::var("LAB_CACHE").unwrap_or_else(|_| "/var/tmp/mdlab".into()));
        let t = Instant::now();
        let out = Command::new(dir.join("build.sh"))
            .env("LAB_CACHE", &cache)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}/build.sh: {e}", dir.display()))?;
        if !out.status.success() {
            let log = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            return Err(format!(
                "build.sh failed ({}): {}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ));
        }
        eprintln!("lab: built/checked in {:.1} s ({})", t.elapsed().as_secs_f64(), dir.display());
        Ok(Lab { dir, cache })
    }

    /// Reference images made by `examples/md-raid.sh` ($LAB_CACHE/images).
    pub fn images_dir(&self) -> PathBuf {
        self.cache.join("images")
    }

    /// A fresh directory on a disk-backed filesystem for member images (not tmpfs: the lab
    /// attaches disks with O_DIRECT). Removed when the returned guard drops.
    pub fn scratch_dir(&self, name: &str) -> tempfile::TempDir {
        let base = self.cache.join("scratch");
        std::fs::create_dir_all(&base).unwrap_or_else(|e| panic!("mkdir {}: {e}", base.display()));
        tempfile::Builder::new().prefix(&format!("mdkit-{name}-")).tempdir_in(&base).expect("scratch dir")
    }

    /// Boots the guest and runs `script` (bash) in it.
    pub fn run(&self, opts: &RunOptions, script: &str) -> Result<LabRun, String> {
        let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/lab-slot"));
        cmd.arg(self.dir.join("run.sh"));
        cmd.env("LAB_CACHE", &self.cache)
            .arg("--mem")
            .arg(opts.mem_mb.to_string())
            .arg("--timeout")
            .arg(opts.timeout_secs.to_string());
        for d in &opts.disks {
            let s = d.to_string_lossy();
            if s.contains(',') {
                return Err(format!("disk path {s} contains a comma (qemu option syntax)"));
            }
            cmd.arg("--disk").arg(d);
        }
        for f in &opts.files {
            cmd.arg("--file").arg(f);
        }
        let script_file =
            tempfile::Builder::new().prefix("mdkit-lab-").suffix(".sh").tempfile().map_err(|e| e.to_string())?;
        std::fs::write(script_file.path(), format!("#!/bin/bash\n{script}\n")).map_err(|e| e.to_string())?;
        cmd.arg(script_file.path()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let t = Instant::now();
        let mut child = cmd.spawn().map_err(|e| format!("cannot run {}/run.sh: {e}", self.dir.display()))?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        // Stream the guest's output so long runs can be followed (MDKIT_LAB_VERBOSE=1).
        let verbose = std::env::var("MDKIT_LAB_VERBOSE").is_ok_and(|v| v == "1");
        let mut output = String::new();
        let stdout = child.stdout.take().expect("stdout is piped");
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            if verbose {
                eprintln!("lab| {line}");
            }
            output.push_str(&line);
            output.push('\n');
        }
        let status = child.wait().map_err(|e| format!("waiting for run.sh: {e}"))?;
        let err_text = err_reader.join().unwrap_or_default();
        if !err_text.is_empty() {
            output.push_str("\n--- run.sh stderr ---\n");
            output.push_str(&err_text);
        }
        let exit_code = status.code().unwrap_or(-1);
        if exit_code == 124 || exit_code == 125 {
            return Err(format!("guest timed out or died (exit {exit_code}):\n{output}"));
        }
        Ok(LabRun { exit_code, output, elapsed: t.elapsed() })
    }
}

/// Member regions of the guest's first disk as GPT partitions: one `sfdisk` call and a
/// rescan (about 3 s under TCG for 180 partitions) instead of a `losetup` per member (about
/// 90 ms each, and `losetup --find` cannot run concurrently). Regions must be whole MiB, not
/// overlap, and leave the disk's first and last MiB free for the GPT.
#[derive(Default)]
pub struct GuestPartitions {
    /// (offset, size) in bytes, in partition order.
    regions: Vec<(u64, u64)>,
}

impl GuestPartitions {
    const MIB: u64 = 1 << 20;

    /// Adds a region; returns its device in the guest.
    pub fn add(&mut self, offset_bytes: u64, size_bytes: u64) -> String {
        assert!(offset_bytes >= Self::MIB, "the first MiB holds the GPT");
        assert!(offset_bytes.is_multiple_of(Self::MIB) && size_bytes.is_multiple_of(Self::MIB), "whole MiB");
        self.regions.push((offset_bytes, size_bytes));
        assert!(self.regions.len() < 256, "the kernel allows 255 partitions per disk");
        format!("/dev/vda{}", self.regions.len())
    }

    /// Guest commands that write the table and make the kernel read it; they print
    /// `sfdisk=RC` and `rereadpt=RC` ([`LabRun::assert_partitioned`]).
    pub fn script(&self) -> String {
        use std::fmt::Write as _;
        let entries = self.regions.len().div_ceil(4).max(32) * 4;
        let mut s = format!(
            "sfdisk -q --wipe never --wipe-partitions never --no-reread --no-tell-kernel /dev/vda >/dev/null <<'EOF'\n\
             label: gpt\ntable-length: {entries}\n"
        );
        for (offset, size) in &self.regions {
            writeln!(s, "start={}, size={}", offset / 512, size / 512).unwrap();
        }
        s.push_str("EOF\necho sfdisk=$?\nblockdev --rereadpt /dev/vda; echo rereadpt=$?\n");
        s
    }
}

/// `len` bytes at `offset` of a dump disk: lab scripts copy what the guest reads there (direct
/// I/O `dd`) and the host compares, since hashing inside a TCG guest costs more than the copy.
/// The guest's name of virtio disk `index` (0: `/dev/vda`, 25: `/dev/vdz`, 26: `/dev/vdaa`),
/// as the kernel's virtblk names them.
pub fn vd(index: usize) -> String {
    let letter = |i: usize| char::from(b'a' + (i % 26) as u8);
    if index < 26 {
        format!("/dev/vd{}", letter(index))
    } else {
        format!("/dev/vd{}{}", letter(index / 26 - 1), letter(index))
    }
}

pub fn read_dump(dump: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut bytes = vec![0u8; len];
    let f = std::fs::File::open(dump).unwrap_or_else(|e| panic!("dump disk {}: {e}", dump.display()));
    f.read_exact_at(&mut bytes, offset).unwrap_or_else(|e| panic!("dump disk {} at {offset}: {e}", dump.display()));
    bytes
}

/// Where `got` differs from `want`, for a failure message: the differing 4 KiB blocks (count,
/// first, last) and, for the first few, where in `want` their content belongs (a misplaced
/// block), or that they hold zeros.
pub fn describe_difference(got: &[u8], want: &[u8]) -> String {
    const BLOCK: usize = 4096;
    if got.len() != want.len() {
        return format!("{} bytes, {} wanted", got.len(), want.len());
    }
    let differing: Vec<usize> = (0..got.len().div_ceil(BLOCK))
        .filter(|&b| got[b * BLOCK..].iter().take(BLOCK).ne(want[b * BLOCK..].iter().take(BLOCK)))
        .collect();
    let (Some(first), Some(last)) = (differing.first(), differing.last()) else { return "identical".into() };
    let mut text = format!("{} of {} 4 KiB blocks differ, blocks {first}..={last}", differing.len(), got.len() / BLOCK);
    for &b in differing.iter().take(4) {
        let block = &got[b * BLOCK..(b * BLOCK + BLOCK).min(got.len())];
        let from = if block.iter().all(|&x| x == 0) {
            "zeros".to_string()
        } else {
            match want.chunks(BLOCK).position(|w| w == block) {
                Some(w) => format!("wanted block {w}"),
                None => "unknown data".to_string(),
            }
        };
        text += &format!("; block {b} holds {from}");
    }
    text
}

/// The value after `key` on the first line of `text` that starts with it once indented:
/// `mdadm --detail`'s `   Raid Level : raid5` lines (`detail_field(text, "Raid Level :")`).
pub fn detail_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| l.trim_start().strip_prefix(key)).map(str::trim)
}

/// Guest script text that runs each `(name, body)` as a shell function, two at a time (one
/// case's waits, for a resync or a check, overlap the other's work), each writing to its own
/// log, then prints the logs in the given order so every case's `=== ` section stays whole.
/// Bodies must not share devices or md numbers.
pub fn two_at_a_time(cases: &[(String, String)]) -> String {
    let mut s = String::new();
    for (name, body) in cases {
        s.push_str(&format!("case_{name}() {{\n{body}}}\n"));
        s.push_str(&format!(
            "while [ $(jobs -rp | wc -l) -ge 2 ]; do wait -n; done; case_{name} >/tmp/case_{name}.log 2>&1 &\n"
        ));
    }
    s.push_str("wait\n");
    for (name, _) in cases {
        s.push_str(&format!("cat /tmp/case_{name}.log\n"));
    }
    s
}

impl LabRun {
    /// Panics unless the [`GuestPartitions::script`] steps succeeded.
    pub fn assert_partitioned(&self) {
        for step in ["sfdisk=0", "rereadpt=0"] {
            assert!(self.output.contains(step), "partitioning the members disk failed ({step}):\n{}", self.output);
        }
    }
}

/// Returns the lab, or prints `SKIP: <test>: ...` and returns from the calling test.
#[macro_export]
macro_rules! lab_or_skip {
    ($test:expr) => {
        match $crate::common::lab::Lab::get() {
            Ok(lab) => lab,
            Err(why) => {
                eprintln!("SKIP: {}: the kernel lab is unavailable: {}", $test, why);
                return;
            }
        }
    };
}
