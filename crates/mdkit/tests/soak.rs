//! Soak (not in the default suite: `#[ignore]`, run by `scripts/soak [MINUTES]`): raid1, raid5,
//! raid6 and raid10 arrays served by `mdkit serve`, each under a verifying writer over NBD, while
//! some members inject random faults (the test-only `faults` member table of docs/CONFIG.md:
//! read EIO, short reads, write EIO), at random times a fault-injecting member is failed, removed
//! and re-added (bitmap rebuild under load), the service is stopped with SIGTERM or killed with
//! SIGKILL and started again, and `check` runs at quiet points. Every block carries its array,
//! block number, generation and a checksum; a read must return the last acknowledged generation
//! (after SIGTERM too), or after SIGKILL any generation between the last flushed and the last
//! acknowledged one. No request may fail, mismatch_cnt must be 0.
//!
//! Faults stay within redundancy: one fault-injecting member per raid1/raid5/raid10 set, two
//! for raid6, and only those members are ever failed on purpose. A member md's error policy
//! fails (write error, too many read errors) is removed and re-added by the soak, as an operator
//! would. Seeded: MDKIT_SOAK_SEED (default: the clock), printed; MDKIT_SOAK_MINUTES
//! (default 30).

use crate::common;

use std::time::{Duration, Instant};

use common::raw::Raw;
use common::{Server, mdkit, mdkit_ok};
use serde_json::Value;

const BLOCK_BYTES: usize = 4096;
/// Blocks each writer uses (the first 8 MiB of each array).
const BLOCKS: u64 = 2048;
const MAGIC: u64 = 0x534f_414b_424c_4b31;
const CMD_FLUSH: u16 = 3;

struct ArraySpec {
    name: &'static str,
    level: &'static str,
    members: usize,
    /// Members that inject faults (within the level's redundancy).
    faulty: &'static [usize],
}

const ARRAYS: [ArraySpec; 4] = [
    ArraySpec { name: "r1", level: "raid1", members: 2, faulty: &[1] },
    ArraySpec { name: "r5", level: "raid5", members: 3, faulty: &[2] },
    ArraySpec { name: "r6", level: "raid6", members: 4, faulty: &[1, 3] },
    // near-2 on 4: copies on (0,1) and (2,3); one faulty member.
    ArraySpec { name: "r10", level: "raid10", members: 4, faulty: &[0] },
];

/// Per-request fault rates of a fault-injecting member, parts per million.
const READ_ERROR_PPM: u32 = 2000;
const SHORT_READ_PPM: u32 = 1000;
const WRITE_ERROR_PPM: u32 = 300;

fn config(seed: u64) -> String {
    let mut c = String::new();
    for (ai, a) in ARRAYS.iter().enumerate() {
        let members: Vec<String> = (0..a.members)
            .map(|i| {
                let path = format!("\"{}-{i}.img\"", a.name);
                if a.faulty.contains(&i) {
                    format!(
                        "{{ path = {path}, faults = {{ read_error_ppm = {READ_ERROR_PPM}, short_read_ppm = \
                         {SHORT_READ_PPM}, write_error_ppm = {WRITE_ERROR_PPM}, seed = {} }} }}",
                        seed.wrapping_add((ai * 16 + i) as u64)
                    )
                } else {
                    path
                }
            })
            .collect();
        c += &format!(
            "[[volume]]\nname = \"{n}\"\nkind = \"md\"\nmembers = [{m}]\nmember_size = \"32MiB\"\ncreate = true\n\
             level = \"{l}\"\nassume_clean = true\n[volume.attributes]\nsync_speed_min = \"1000000\"\n\
             [[export]]\nname = \"{n}\"\nvolume = \"{n}\"\n",
            n = a.name,
            m = members.join(", "),
            l = a.level
        );
    }
    c
}

/// xorshift64*: the whole run follows from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// Block `block` of array `array` at generation `gen`: header, then bytes derived from them.
fn block_image(array: usize, block: u64, gen_no: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_BYTES];
    let mut x = (gen_no << 20) ^ (block << 4) ^ array as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in b[32..].chunks_mut(8) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&(block | (array as u64) << 48).to_le_bytes());
    b[16..24].copy_from_slice(&gen_no.to_le_bytes());
    let sum = fnv(&b[32..]);
    b[24..32].copy_from_slice(&sum.to_le_bytes());
    b
}

/// The generation a block read back holds (0 = never written), or why it is not valid.
fn decode(array: usize, block: u64, b: &[u8]) -> Result<u64, String> {
    if b.iter().all(|x| *x == 0) {
        return Ok(0);
    }
    let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    if word(0) != MAGIC || word(1) != (block | (array as u64) << 48) || word(3) != fnv(&b[32..]) {
        return Err(format!("block {block}: bad header or checksum (magic {:#x}, id {:#x})", word(0), word(1)));
    }
    Ok(word(2))
}

/// What a writer knows about its array's blocks.
struct Model {
    acked: Vec<u64>,
    flushed: Vec<u64>,
}

#[derive(Default)]
struct Counts {
    writes: u64,
    reads_verified: u64,
    flushes: u64,
    member_faults: u64,
    sigterm_restarts: u64,
    sigkill_restarts: u64,
    checks: u64,
    /// Members md's error policy failed (or assembly left out) that the soak re-added.
    policy_readds: u64,
    /// Injected by the fault-injecting members (summed over service lifetimes).
    injected_read_errors: u64,
    injected_short_reads: u64,
    injected_write_errors: u64,
    /// Sectors md rewrote after read errors and read back: md's `corrected_reads` of the
    /// members as last seen (persisted in the superblocks, so not summed over lifetimes).
    corrected_sectors: u64,
}

struct Soak {
    srv: Server,
    conns: Vec<Raw>,
    models: Vec<Model>,
    rng: Rng,
    next_gen: u64,
    cookie: u64,
    counts: Counts,
}

impl Soak {
    fn connect(&mut self) {
        self.conns = ARRAYS.iter().map(|a| Raw::open(&self.srv.tcp, a.name, false, false)).collect();
    }

    fn write(&mut self, a: usize) {
        let block = self.rng.below(BLOCKS);
        self.next_gen += 1;
        self.cookie += 1;
        let img = block_image(a, block, self.next_gen);
        let err = self.conns[a].write(self.cookie, block * BLOCK_BYTES as u64, &img);
        assert_eq!(err, 0, "{}: write of block {block} failed with errno {err}", ARRAYS[a].name);
        self.models[a].acked[block as usize] = self.next_gen;
        self.counts.writes += 1;
    }

    fn flush(&mut self, a: usize) {
        self.cookie += 1;
        self.conns[a].request(0, CMD_FLUSH, self.cookie, 0, 0, &[]);
        let (err, _) = self.conns[a].simple_reply();
        assert_eq!(err, 0, "{}: flush failed with errno {err}", ARRAYS[a].name);
        let m = &mut self.models[a];
        m.flushed.copy_from_slice(&m.acked);
        self.counts.flushes += 1;
    }

    /// Reads `block` and checks it against the model: exactly the acknowledged generation, or
    /// (`after_kill`) any generation between the flushed and the acknowledged one, which then
    /// becomes what the block holds.
    fn verify(&mut self, a: usize, block: u64, after_kill: bool) {
        self.cookie += 1;
        let name = ARRAYS[a].name;
        let b = self.conns[a]
            .read(self.cookie, block * BLOCK_BYTES as u64, BLOCK_BYTES as u32)
            .unwrap_or_else(|e| panic!("{name}: read of block {block} failed with errno {e}"));
        let got = decode(a, block, &b).unwrap_or_else(|e| panic!("{name}: {e}"));
        let m = &mut self.models[a];
        let (lo, hi) = (m.flushed[block as usize], m.acked[block as usize]);
        if after_kill {
            assert!(lo <= got && got <= hi, "{name} block {block}: generation {got}, flushed {lo}, acked {hi}");
            m.acked[block as usize] = got;
        } else {
            assert_eq!(got, hi, "{name} block {block}: generation {got}, last acknowledged {hi}");
        }
        self.counts.reads_verified += 1;
    }

    fn verify_all(&mut self, after_kill: bool) {
        for a in 0..ARRAYS.len() {
            for block in 0..BLOCKS {
                self.verify(a, block, after_kill);
            }
        }
    }

    fn detail(&self, name: &str) -> Value {
        serde_json::from_str(&mdkit_ok(&self.srv, &["detail", name, "--json"])).unwrap()
    }

    /// Polls (hang guard: 5 minutes) until no sync work runs and nothing is degraded; members
    /// md's policy failed meanwhile (or that assembly left out) are removed and re-added.
    fn wait_settled(&mut self, name: &str) {
        let t = Instant::now();
        loop {
            let d = self.detail(name);
            if d["sync"]["action"] == "idle" && d["degraded"] == 0 && d["sync"]["resync_start"].is_null() {
                return;
            }
            self.readd_failed(name, &d);
            assert!(t.elapsed() < Duration::from_secs(300), "{name} did not settle: {d:#}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Removes and re-adds every member of `name` that is faulty or missing from the array.
    fn readd_failed(&mut self, name: &str, d: &Value) {
        assert!(d["broken"].is_null() && d["needs_check"].is_null(), "{name}: faults went beyond redundancy: {d:#}");
        let spec = ARRAYS.iter().find(|a| a.name == name).unwrap();
        let members = d["members"].as_array().cloned().unwrap_or_default();
        for i in 0..spec.members {
            let file = format!("{name}-{i}.img");
            let path = self.srv.path(&file).display().to_string();
            let shown = members.iter().find(|m| m["name"] == file.as_str() || m["name"] == path.as_str());
            let faulty = shown.is_some_and(|m| m["state"].as_array().is_some_and(|s| s.iter().any(|w| w == "faulty")));
            if shown.is_some() && !faulty {
                continue;
            }
            if let Some(m) = shown {
                eprintln!("soak: {name}: {file} failed ({}): remove and re-add", m["fail_reason"]);
                mdkit_ok(&self.srv, &["manage", name, "--remove", m["name"].as_str().unwrap()]);
            } else {
                eprintln!("soak: {name}: {file} is not in the array: re-add");
            }
            mdkit_ok(&self.srv, &["manage", name, "--re-add", &path]);
            self.counts.policy_readds += 1;
        }
    }

    /// Adds what this service lifetime injected and corrected to the counts.
    fn collect_fault_counts(&mut self) {
        let mut corrected = 0;
        for a in &ARRAYS {
            let d = self.detail(a.name);
            if let Some(inj) = d["injected_faults"].as_object() {
                for v in inj.values() {
                    self.counts.injected_read_errors += v["read_errors"].as_u64().unwrap_or(0);
                    self.counts.injected_short_reads += v["short_reads"].as_u64().unwrap_or(0);
                    self.counts.injected_write_errors += v["write_errors"].as_u64().unwrap_or(0);
                }
            }
            for m in d["members"].as_array().cloned().unwrap_or_default() {
                corrected += m["corrected_reads"].as_u64().unwrap_or(0);
            }
        }
        self.counts.corrected_sectors = corrected;
    }

    fn check(&mut self, name: &str) {
        let t = Instant::now();
        loop {
            self.wait_settled(name);
            // md's policy may fail a member between the two commands: settle and try again.
            let out = mdkit(&self.srv, &["attr", name, "sync_action=check"]);
            if out.status.success() {
                break;
            }
            eprintln!("soak: {name}: check not started: {}", String::from_utf8_lossy(&out.stderr).trim());
            assert!(t.elapsed() < Duration::from_secs(300), "{name}: check never started");
        }
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let d = self.detail(name);
            if d["sync"]["action"] == "idle" {
                assert_eq!(d["sync"]["mismatch_cnt"], 0, "{name}: mismatches after check: {d:#}");
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(300), "{name}: check did not finish");
        }
        self.counts.checks += 1;
    }

    /// Fails a random fault-injecting member, removes it and re-adds it: rebuilt (from the
    /// bitmap) while the writers continue.
    fn member_fault(&mut self) {
        let a = &ARRAYS[self.rng.below(ARRAYS.len() as u64) as usize];
        let member = format!("{}-{}.img", a.name, a.faulty[self.rng.below(a.faulty.len() as u64) as usize]);
        eprintln!("soak: fail, remove and re-add {member}");
        self.wait_settled(a.name);
        mdkit_ok(&self.srv, &["manage", a.name, "--fail", &member]);
        mdkit_ok(&self.srv, &["manage", a.name, "--remove", &member]);
        let path = self.srv.path(&member).display().to_string();
        mdkit_ok(&self.srv, &["manage", a.name, "--re-add", &path]);
        self.counts.member_faults += 1;
    }

    fn restart(&mut self, kill: bool) {
        for a in &ARRAYS {
            self.wait_settled(a.name);
        }
        self.collect_fault_counts();
        self.conns.clear();
        let sig = if kill { libc::SIGKILL } else { libc::SIGTERM };
        eprintln!("soak: restart after {}", if kill { "SIGKILL" } else { "SIGTERM" });
        let st = self.srv.signal_and_wait(sig, Duration::from_secs(60));
        if kill {
            self.counts.sigkill_restarts += 1;
        } else {
            assert!(st.success(), "mdkit serve after SIGTERM: {st}; log:\n{}", self.srv.log_text());
            // A clean stop flushes: everything acknowledged must survive.
            for m in &mut self.models {
                m.flushed.copy_from_slice(&m.acked);
            }
            self.counts.sigterm_restarts += 1;
        }
        let dir = std::mem::replace(&mut self.srv.dir, tempfile::tempdir().unwrap());
        let cfg = self.srv.config_path.clone();
        let old = std::mem::replace(&mut self.srv, Server::start_with_config(dir, cfg));
        drop(old);
        self.connect();
        for a in &ARRAYS {
            self.wait_settled(a.name);
        }
        self.verify_all(kill);
        for a in 0..ARRAYS.len() {
            self.flush(a);
        }
    }

    fn event(&mut self) {
        match self.rng.below(10) {
            0..=4 => self.member_fault(),
            5 | 6 => self.restart(false),
            7 | 8 => self.restart(true),
            _ => {
                let a = ARRAYS[self.rng.below(ARRAYS.len() as u64) as usize].name;
                self.check(a);
            }
        }
    }

    fn step(&mut self) {
        let a = self.rng.below(ARRAYS.len() as u64) as usize;
        match self.rng.below(16) {
            0..=8 => self.write(a),
            9..=14 => {
                let block = self.rng.below(BLOCKS);
                self.verify(a, block, false);
            }
            _ => self.flush(a),
        }
    }
}

#[test]
#[ignore = "soak: run with scripts/soak [MINUTES]"]
fn soak_mixed_load_with_member_faults_and_restarts() {
    let minutes: u64 = std::env::var("MDKIT_SOAK_MINUTES").ok().and_then(|m| m.parse().ok()).unwrap_or(30);
    let seed: u64 = std::env::var("MDKIT_SOAK_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("soak: seed {seed} (MDKIT_SOAK_SEED={seed} to repeat), {minutes} minutes");
    let models =
        ARRAYS.iter().map(|_| Model { acked: vec![0; BLOCKS as usize], flushed: vec![0; BLOCKS as usize] }).collect();
    let mut s = Soak {
        srv: Server::start(&config(seed)),
        conns: Vec::new(),
        models,
        rng: Rng(seed | 1),
        next_gen: 0,
        cookie: 0,
        counts: Counts::default(),
    };
    s.connect();
    let end = Instant::now() + Duration::from_secs(minutes * 60);
    while Instant::now() < end {
        for _ in 0..200 + s.rng.below(800) {
            s.step();
        }
        s.event();
    }
    for a in &ARRAYS {
        s.check(a.name);
    }
    s.verify_all(false);
    s.collect_fault_counts();
    let c = &s.counts;
    eprintln!(
        "soak: seed {seed}: {} writes, {} reads verified, {} flushes, {} member faults (fail/remove/re-add), \
         {} SIGTERM and {} SIGKILL restarts, {} checks with mismatch_cnt 0; injected {} read EIO, {} short reads, \
         {} write EIO; {} sectors corrected, {} members failed by md's policy re-added; zero client-visible errors, \
         zero verify errors",
        c.writes,
        c.reads_verified,
        c.flushes,
        c.member_faults,
        c.sigterm_restarts,
        c.sigkill_restarts,
        c.checks,
        c.injected_read_errors,
        c.injected_short_reads,
        c.injected_write_errors,
        c.corrected_sectors,
        c.policy_readds
    );
    assert!(
        c.injected_read_errors + c.injected_short_reads + c.injected_write_errors > 0,
        "the fault-injecting members injected nothing"
    );
}
