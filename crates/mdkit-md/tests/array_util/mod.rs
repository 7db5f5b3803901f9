//! Shared helpers for the array runtime tests (`tests/array_*.rs`), reusable by every
//! personality (raid4/5/6 too): simulated members (RAM, fault-injecting, crash-recording),
//! creating and re-assembling arrays on them, a byte-exact model of the array contents with a
//! random workload of odd request shapes, and waiting for sync work / running a check.
#![allow(dead_code)] // each test binary uses a different subset

pub mod durable;
pub mod held;

use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{
    BlockDevice, BlockDeviceExt, CrashDevice, CrashGroup, DeviceRef, FaultHandle, FaultyDevice, IoBuf, MemDevice, Rng,
    SharedBuf, WriteFlags,
};
use mdkit_md::array::{Array, AssembleOptions, CreateOptions, MemberDev, assemble, create};
use mdkit_md::format::create::BitmapRequest;
use mdkit_md::format::superblock::Superblock;
use mdkit_md::layout::Level;

pub const MIB: u64 = 1 << 20;

/// The superblock on a RAM member (1.2 metadata: 4 KiB into the device).
pub fn sb_of(m: &SimMember) -> Superblock {
    let mut b = vec![0u8; 4096];
    m.mem.as_ref().expect("RAM member").read_bytes(4096, &mut b);
    Superblock::decode(&b, 8).expect("superblock")
}

/// Waits until every member's superblock says clean (`resync_offset` MaxSector). The array
/// marks itself clean `safe_mode_delay` after its last write, so a test that cuts an array
/// (drops it without a stop) and expects a clean assembly waits for this first, whatever the
/// machine's speed.
pub async fn wait_clean_on_disk(ms: &[SimMember]) {
    let started = std::time::Instant::now();
    loop {
        let offsets: Vec<u64> = ms.iter().map(|m| sb_of(m).resync_offset_sectors).collect();
        if offsets.iter().all(|&o| o == u64::MAX) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "never marked clean on disk: resync_offset {offsets:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The seed for randomized tests: `MDKIT_TEST_SEED` or `default`, printed for replay.
pub fn seed(test: &str, default: u64) -> u64 {
    let s = std::env::var("MDKIT_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    eprintln!("{test}: seed {s} (replay with MDKIT_TEST_SEED={s})");
    s
}

/// One simulated member: the device handed to the array, plus handles to reach below it.
#[derive(Clone)]
pub struct SimMember {
    pub name: String,
    pub dev: DeviceRef,
    pub mem: Option<Arc<MemDevice>>,
    pub fault: Option<FaultHandle>,
}

impl SimMember {
    pub fn member_dev(&self) -> MemberDev {
        MemberDev::new(self.name.clone(), self.dev.clone())
    }
}

pub fn member_devs(ms: &[SimMember]) -> Vec<MemberDev> {
    ms.iter().map(SimMember::member_dev).collect()
}

/// `n` RAM members of `size` bytes.
pub fn mem_members(prefix: &str, n: usize, size: u64) -> Vec<SimMember> {
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), size));
            SimMember { name, dev: mem.clone(), mem: Some(mem), fault: None }
        })
        .collect()
}

/// `n` RAM members behind fault injectors.
pub fn faulty_members(prefix: &str, n: usize, size: u64) -> Vec<SimMember> {
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let mem = Arc::new(MemDevice::new(name.clone(), size));
            let f = FaultyDevice::new(mem.clone() as DeviceRef);
            let h = f.handle();
            SimMember { name, dev: Arc::new(f), mem: Some(mem), fault: Some(h) }
        })
        .collect()
}

/// `n` members recorded by one crash group (one power domain).
pub fn crash_members(group: &CrashGroup, prefix: &str, n: usize, size: u64) -> Vec<(SimMember, Arc<CrashDevice>)> {
    (0..n)
        .map(|i| {
            let name = format!("{prefix}{i}");
            let dev = Arc::new(group.wrap(name.clone(), MemDevice::new(name.clone(), size)));
            (SimMember { name, dev: dev.clone(), mem: None, fault: None }, dev)
        })
        .collect()
}

/// Members over images (e.g. a crash image), named like the originals.
pub fn image_members(names: &[String], images: Vec<MemDevice>) -> Vec<SimMember> {
    names
        .iter()
        .zip(images)
        .map(|(n, img)| {
            let mem = Arc::new(img);
            SimMember { name: n.clone(), dev: mem.clone(), mem: Some(mem), fault: None }
        })
        .collect()
}

/// Create options for the common cases.
pub fn opts(
    level: Level,
    raid_devices: u32,
    chunk_kib: Option<u32>,
    layout: Option<u32>,
    bitmap: bool,
    assume_clean: bool,
) -> CreateOptions {
    let mut o = CreateOptions::new("md-test", level, raid_devices);
    o.chunk_kib = if level.uses_chunks() { chunk_kib } else { None };
    o.layout = layout;
    o.bitmap = if bitmap { BitmapRequest::Internal { chunk_bytes: Some(1 << 20) } } else { BitmapRequest::None };
    o.assume_clean = assume_clean;
    o
}

pub async fn create_array(ms: &[SimMember], o: CreateOptions) -> Array {
    let a = create(member_devs(ms), o).await.unwrap_or_else(|e| panic!("create: {e}"));
    a.array
}

pub async fn assemble_array(ms: &[SimMember]) -> Array {
    let a = assemble(member_devs(ms), AssembleOptions { name: "md-test".into(), ..AssembleOptions::default() })
        .await
        .unwrap_or_else(|e| panic!("assemble: {e}"));
    a.array
}

/// Runs `check` to the end and returns mismatch_cnt.
pub async fn check(a: &Array) -> u64 {
    a.wait_sync_idle().await;
    let before = a.sync_status().runs;
    a.request_sync("check").expect("request check");
    loop {
        a.wait_sync_idle().await;
        let st = a.sync_status();
        if st.runs > before {
            assert_eq!(
                st.last_run.map(|(m, done)| (m.as_str(), done)),
                Some(("check", true)),
                "check did not complete: {st:?}"
            );
            return st.mismatch_sectors;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The size a refused reshape to fewer members asks for: the `grow --array-size NK` its
/// message names, in bytes.
pub fn asked_array_size(refusal: &str) -> u64 {
    let at = refusal.find("--array-size ").unwrap_or_else(|| panic!("no --array-size in: {refusal}"));
    let digits: String = refusal[at + 13..].chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse::<u64>().unwrap_or_else(|e| panic!("{e}: {refusal}")) * 1024
}

/// Cuts the array to the size a reshape to `members` needs (`grow --array-size` first, as
/// mdadm asks): the refusal without it names the size. Returns it (bytes).
pub async fn cut_for_fewer_members(a: &Array, members: u32) -> u64 {
    let e = a.grow(mdkit_md::array::GrowChange::RaidDevices(members), Vec::new()).await.unwrap_err().to_string();
    assert!(e.contains("cut it first"), "{e}");
    let size = asked_array_size(&e);
    assert_eq!(a.set_array_size(Some(size)).unwrap(), size);
    size
}

/// Raises the sync speed limits so background work finishes quickly in tests.
pub fn fast_sync(a: &Array) {
    a.set_attribute("sync_speed_min", "10000000").unwrap();
    a.set_attribute("sync_speed_max", "10000000").unwrap();
}

//------------------------------------------------------------------------------------------------

/// What the array should hold: a byte image of the whole array.
pub struct Model {
    pub data: Vec<u8>,
}

impl Model {
    pub fn new(size: u64) -> Model {
        Model { data: vec![0; size as usize] }
    }

    pub fn apply(&mut self, off: u64, bytes: &[u8]) {
        self.data[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
    }

    pub fn zero(&mut self, off: u64, len: u64) {
        self.data[off as usize..(off + len) as usize].fill(0);
    }

    pub fn slice(&self, off: u64, len: u64) -> &[u8] {
        &self.data[off as usize..(off + len) as usize]
    }
}

/// A random request: offset and length in 4 KiB blocks, biased toward odd shapes (chunk
/// crossings, single blocks, long runs, the last block).
pub fn random_extent(rng: &mut Rng, size: u64, max_blocks: u64) -> (u64, u64) {
    let blocks = size / 4096;
    let len = match rng.below(4) {
        0 => 1,
        1 => 1 + rng.below(8),
        2 => 1 + rng.below(max_blocks),
        _ => max_blocks.min(blocks),
    }
    .min(blocks);
    let start = match rng.below(8) {
        0 => blocks - len,
        1 => 0,
        _ => rng.below(blocks - len + 1),
    };
    (start * 4096, len * 4096)
}

/// Writes random data at a random extent, into the array and the model.
pub async fn random_write(a: &dyn BlockDevice, m: &mut Model, rng: &mut Rng, max_blocks: u64) -> (u64, u64) {
    let (off, len) = random_extent(rng, m.data.len() as u64, max_blocks);
    let mut buf = IoBuf::zeroed(len as usize);
    rng.fill(buf.as_mut_slice());
    let fua = rng.below(8) == 0;
    m.apply(off, buf.as_slice());
    a.write(off, buf.freeze(), if fua { WriteFlags::FUA } else { WriteFlags::NONE })
        .await
        .unwrap_or_else(|e| panic!("write {off}+{len}: {e}"));
    (off, len)
}

/// Reads a random extent and compares it with the model.
pub async fn random_verify(a: &dyn BlockDevice, m: &Model, rng: &mut Rng, max_blocks: u64) {
    let (off, len) = random_extent(rng, m.data.len() as u64, max_blocks);
    verify_range(a, m, off, len).await;
}

pub async fn verify_range(a: &dyn BlockDevice, m: &Model, off: u64, len: u64) {
    let got = a.read_vec(off, len as usize).await.unwrap_or_else(|e| panic!("read {off}+{len}: {e}"));
    if got != m.slice(off, len) {
        let first = got.iter().zip(m.slice(off, len)).position(|(x, y)| x != y).unwrap_or(0);
        panic!("{}: data differs from the model at byte {} (read {off}+{len})", a.name(), off + first as u64);
    }
}

/// Reads the whole array in large pieces and compares it with the model.
pub async fn verify_all(a: &dyn BlockDevice, m: &Model) {
    let size = m.data.len() as u64;
    let step = 4 * MIB;
    let mut off = 0;
    while off < size {
        let len = step.min(size - off);
        verify_range(a, m, off, len).await;
        off += len;
    }
}

/// Fills the array with random data through large writes.
pub async fn fill(a: &dyn BlockDevice, m: &mut Model, rng: &mut Rng) {
    let size = m.data.len() as u64;
    let step = 2 * MIB;
    let mut off = 0;
    while off < size {
        let len = step.min(size - off);
        let mut buf = vec![0u8; len as usize];
        rng.fill(&mut buf);
        m.apply(off, &buf);
        a.write(off, SharedBuf::from_slice(&buf), WriteFlags::NONE).await.unwrap_or_else(|e| panic!("fill {off}: {e}"));
        off += len;
    }
}

//------------------------------------------------------------------------------------------------

/// A byte range of another device as a device of its own (members that are regions of one big
/// file, as the kernel lab attaches them with `losetup --offset --sizelimit`).
pub struct RegionDevice {
    name: String,
    inner: DeviceRef,
    offset_bytes: u64,
    topology: mdkit_io::Topology,
}

impl RegionDevice {
    pub fn new(name: impl Into<String>, inner: DeviceRef, offset_bytes: u64, size_bytes: u64) -> RegionDevice {
        let mut topology = inner.topology();
        assert!(offset_bytes.is_multiple_of(4096) && size_bytes.is_multiple_of(4096), "regions are 4 KiB aligned");
        assert!(offset_bytes + size_bytes <= topology.size_bytes, "region beyond the device");
        topology.size_bytes = size_bytes;
        RegionDevice { name: name.into(), inner, offset_bytes, topology }
    }
}

impl BlockDevice for RegionDevice {
    fn name(&self) -> &str {
        &self.name
    }
    fn topology(&self) -> mdkit_io::Topology {
        self.topology
    }
    fn read(&self, off: u64, buf: IoBuf) -> mdkit_io::IoFuture<'_, mdkit_io::ReadResult> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topology, mdkit_io::IoOp::Read, off, buf.len() as u64) {
            return Box::pin(std::future::ready((buf, Err(e))));
        }
        self.inner.read(self.offset_bytes + off, buf)
    }
    fn write(&self, off: u64, buf: SharedBuf, flags: WriteFlags) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topology, mdkit_io::IoOp::Write, off, buf.len() as u64) {
            return Box::pin(std::future::ready(Err(e)));
        }
        self.inner.write(self.offset_bytes + off, buf, flags)
    }
    fn flush(&self) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, off: u64, len: u64) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topology, mdkit_io::IoOp::Discard, off, len) {
            return Box::pin(std::future::ready(Err(e)));
        }
        self.inner.discard(self.offset_bytes + off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: mdkit_io::ZeroFlags) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        if let Err(e) = mdkit_io::check_io(&self.name, &self.topology, mdkit_io::IoOp::WriteZeroes, off, len) {
            return Box::pin(std::future::ready(Err(e)));
        }
        self.inner.write_zeroes(self.offset_bytes + off, len, f)
    }
}

/// RAM-speed members made flash-like: tens of µs per I/O over many channels, so member I/O
/// really overlaps and concurrent writes to a stripe meet in its cache entry.
pub fn flash_like_model() -> mdkit_io::FlashModel {
    mdkit_io::FlashModel {
        read_latency_us: 40,
        write_latency_us: 25,
        rmw_latency_us: 0,
        channels: 64,
        ..mdkit_io::FlashModel::default()
    }
}

/// Host `mdadm --examine PATH` (TZ=UTC); panics with its output when it fails.
pub fn mdadm_examine(path: &std::path::Path) -> String {
    let out = std::process::Command::new("mdadm")
        .env("TZ", "UTC")
        .arg("--examine")
        .arg(path)
        .output()
        .expect("run mdadm --examine");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "mdadm --examine {} failed: {}{}",
        path.display(),
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The value of `key : value` in mdadm's examine text.
pub fn examine_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(" : ")?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// Dumps every RAM member's image into `dir`, runs mdadm --examine on each, and checks that
/// mdkit's own examine text equals mdadm's below the device line (members with a superblock).
pub fn mdadm_examine_all(dir: &std::path::Path, ms: &[SimMember]) -> Vec<String> {
    use mdkit_md::format::{bitmap::BitmapSuper, examine::render_text, superblock::Superblock};
    ms.iter()
        .map(|m| {
            let img = m.mem.as_ref().expect("RAM member").to_image();
            let path = dir.join(format!("{}.img", m.name));
            std::fs::write(&path, &img).expect("write image");
            let text = mdadm_examine(&path);
            if let Ok(sb) = Superblock::decode(&img[4096..8192], 8) {
                let bms = sb
                    .bitmap_sector()
                    .and_then(|s| BitmapSuper::decode(&img[(s * 512) as usize..(s * 512) as usize + 256]).ok());
                let ours = render_text(&sb, bms.as_ref(), img.len() as u64 / 512);
                let theirs: Vec<&str> = text.lines().skip(1).collect();
                assert_eq!(
                    ours.lines().collect::<Vec<_>>(),
                    theirs,
                    "{}: mdkit's examine text differs from mdadm's",
                    m.name
                );
            }
            text
        })
        .collect()
}

/// A window of an array as its own device (each worker of [`verifying_workload`] sees offsets
/// from 0).
pub struct Window {
    pub a: &'static Array,
    pub base: u64,
    pub size: u64,
}

impl BlockDevice for Window {
    fn name(&self) -> &str {
        self.a.name()
    }
    fn topology(&self) -> mdkit_io::Topology {
        let mut t = self.a.topology();
        t.size_bytes = self.size;
        t
    }
    fn read(&self, off: u64, buf: IoBuf) -> mdkit_io::IoFuture<'_, mdkit_io::ReadResult> {
        self.a.read(self.base + off, buf)
    }
    fn write(&self, off: u64, buf: SharedBuf, f: WriteFlags) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.a.write(self.base + off, buf, f)
    }
    fn flush(&self) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.a.flush()
    }
    fn discard(&self, off: u64, len: u64) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.a.discard(self.base + off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: mdkit_io::ZeroFlags) -> mdkit_io::IoFuture<'_, std::io::Result<()>> {
        self.a.write_zeroes(self.base + off, len, f)
    }
}

/// Concurrent verifying workload: `workers` tasks each own a region of the array and keep a
/// model of it; two of three operations are random writes of up to `max_blocks` 4 KiB blocks,
/// the third verifies a random range. Any client-visible error or wrong byte panics.
pub async fn verifying_workload(
    a: &'static Array,
    seed: u64,
    workers: u64,
    ops: usize,
    max_blocks: u64,
    model: &mut Model,
) {
    let size = model.data.len() as u64;
    let region = size / workers / 4096 * 4096;
    let futs = (0..workers).map(|w| {
        let base = w * region;
        let mut local = Model { data: model.data[base as usize..(base + region) as usize].to_vec() };
        async move {
            let mut rng = Rng::new(seed * 1000 + w);
            let view = Window { a, base, size: region };
            for i in 0..ops {
                if i % 3 == 2 {
                    random_verify(&view, &local, &mut rng, max_blocks).await;
                } else {
                    random_write(&view, &mut local, &mut rng, max_blocks).await;
                }
            }
            (base, local)
        }
    });
    for (base, local) in mdkit_md::array::io::join_all(futs).await {
        model.apply(base, &local.data);
    }
}

/// Runs `work` with superblock rounds of the array's own beside it, every millisecond, as
/// clean/dirty transitions make them in service: a round in flight while the work changes
/// the superblocks (a reshape checkpoint, a grow) must not undo the change. A round is never
/// cut short (an abandoned round would skip an event count).
pub async fn with_rounds_beside<T>(a: &Array, work: impl std::future::Future<Output = T>) -> T {
    let stop = std::sync::atomic::AtomicBool::new(false);
    let rounds = async {
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            // Refused while the array is between two assemblies (a grow stopped it): fine.
            let _ = a.core().update_superblocks("a round beside the work").await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    let work = async {
        let out = work.await;
        stop.store(true, std::sync::atomic::Ordering::Release);
        out
    };
    tokio::join!(work, rounds).0
}
