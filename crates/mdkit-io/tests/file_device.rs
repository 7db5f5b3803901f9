//! `FileDevice` on real files: the O_DIRECT path (a file under the cargo target directory, which
//! lives on the repository's disk), the buffered fallback (/dev/shm, tmpfs), a loop block device
//! (root only; skipped loudly otherwise), durability-call semantics, a concurrent verifying
//! stress, futures dropped mid-flight, and bad requests.

use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mdkit_io::{
    BlockDevice, BlockDeviceExt, DirectMode, FileDevice, FileOptions, INLINE_COPY_MAX_BYTES, IoBuf, Rng, SharedBuf,
    WriteFlags, ZeroFlags,
};

const MIB: u64 = 1 << 20;

fn target_tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir under the cargo target dir")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

fn direct_options() -> FileOptions {
    FileOptions { direct: DirectMode::Require, ..FileOptions::default() }
}

fn open_direct(path: &Path) -> FileDevice {
    FileDevice::open(path, direct_options())
        .unwrap_or_else(|e| panic!("O_DIRECT must work on the cargo target dir (ext4/xfs/btrfs expected): {e}"))
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[tokio::test]
async fn direct_file_roundtrip_topology_and_persistence() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, 8 * MIB).unwrap();
    assert_eq!(
        FileDevice::create_sparse(&path, 8 * MIB).unwrap_err().kind(),
        io::ErrorKind::AlreadyExists,
        "create_sparse must never overwrite"
    );
    assert_eq!(allocated_bytes(&path), 0, "freshly created member file is sparse");
    {
        let dev = open_direct(&path);
        assert!(dev.is_direct());
        assert_eq!(dev.direct_fallback_reason(), None);
        assert_eq!(dev.name(), path.display().to_string());
        let t = dev.topology();
        assert_eq!(t.size_bytes, 8 * MIB);
        assert!(t.logical_block_bytes == 512 || t.logical_block_bytes == 4096, "{t:?}");
        assert_eq!((t.physical_block_bytes, t.optimal_io_bytes), (4096, 4096));
        assert!(t.supports_fua && t.supports_discard && t.supports_write_zeroes && t.volatile_cache);

        assert_eq!(dev.read_vec(0, 65536).await.unwrap(), vec![0u8; 65536], "holes read as zero");
        let a = pattern(1, 4096);
        let b = pattern(2, 1 << 20);
        let c = pattern(3, 8192);
        dev.write_slice(0, &a, WriteFlags::NONE).await.unwrap();
        dev.write_slice(MIB, &b, WriteFlags::FUA).await.unwrap();
        dev.write_slice(8 * MIB - 8192, &c, WriteFlags::NONE).await.unwrap();
        dev.flush().await.unwrap();
        assert_eq!(dev.read_vec(0, 4096).await.unwrap(), a);
        assert_eq!(dev.read_vec(MIB, 1 << 20).await.unwrap(), b);
        assert_eq!(dev.read_vec(8 * MIB - 8192, 8192).await.unwrap(), c);
    }
    // A new device on the same file sees the data (it reached the file, not a private cache).
    let dev = open_direct(&path);
    assert_eq!(dev.read_vec(MIB, 1 << 20).await.unwrap(), pattern(2, 1 << 20));
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[..4096], &pattern(1, 4096)[..]);
}

/// A file grown under the open device (`truncate`) is taken by `refresh_size`; `grow_file`
/// grows it; neither ever shrinks the device, and I/O past the old end works only after.
/// A member file truncated under the open device: a write past the new end extends the file
/// again as a hole that reads zeros, so a flush must not report the writes durable. It fails
/// (EIO, saying why), and md fails such a member instead of keeping it in sync.
#[tokio::test]
async fn a_flush_fails_once_the_file_was_truncated_under_it() {
    let dir = target_tmp();
    let path = dir.path().join("cut.img");
    std::fs::File::create(&path).unwrap().set_len(4 * MIB).unwrap();
    let dev = open_direct(&path);
    dev.write_slice(0, &pattern(1, 4096), WriteFlags::NONE).await.unwrap();
    dev.flush().await.expect("a flush of the whole file");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(MIB).unwrap();
    dev.write_slice(3 * MIB, &pattern(2, 4096), WriteFlags::NONE).await.unwrap();
    let e = dev.flush().await.unwrap_err();
    assert!(e.to_string().contains("truncated to 3149824 bytes"), "{e}");
    let kind = mdkit_io::DeviceError::of(&e).map(|d| d.kind);
    assert_eq!(kind, Some(mdkit_io::IoErrorKind::Eio), "{e}");
    // Remembered: the file at its old size again does not make the lost data come back, so
    // flushes keep failing, and reads (the hole at 0 would read zeros) and writes fail too.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4 * MIB).unwrap();
    let e = dev.flush().await.unwrap_err();
    assert!(e.to_string().contains("an earlier flush failed") && e.to_string().contains("truncated"), "{e}");
    let e = dev.read_vec(0, 4096).await.unwrap_err();
    assert!(e.to_string().contains("an earlier flush failed"), "{e}");
    dev.write_slice(0, &pattern(3, 4096), WriteFlags::NONE).await.unwrap_err();
}

#[tokio::test]
async fn grown_files_are_taken_and_never_shrink() {
    let dir = target_tmp();
    let path = dir.path().join("grow");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let dev = open_direct(&path);
    let past_end = dev.write_slice(MIB, &[7u8; 4096], WriteFlags::NONE).await.unwrap_err();
    assert_eq!(past_end.kind(), io::ErrorKind::InvalidInput);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(2 * MIB).unwrap();
    assert_eq!(dev.topology().size_bytes, MIB, "not taken before refresh_size");
    assert_eq!(dev.refresh_size().unwrap(), 2 * MIB);
    dev.write_slice(MIB, &[7u8; 4096], WriteFlags::NONE).await.unwrap();
    assert_eq!(dev.grow_file(4 * MIB).unwrap(), 4 * MIB);
    assert_eq!((dev.topology().size_bytes, std::fs::metadata(&path).unwrap().len()), (4 * MIB, 4 * MIB));
    assert_eq!(dev.grow_file(3 * MIB).unwrap_err().kind(), io::ErrorKind::InvalidInput, "grow_file never shrinks");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(2 * MIB).unwrap();
    let e = dev.refresh_size().unwrap_err();
    assert!(e.to_string().contains("shrank"), "{e}");
    assert_eq!(dev.topology().size_bytes, 4 * MIB, "the device keeps its size");
}

#[tokio::test]
async fn buffer_views_at_512_byte_offsets_are_served() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let dev = open_direct(&path);
    let lbs = dev.topology().logical_block_bytes as usize;
    // Views that start 512 bytes into their allocation (what striping produces) must work even
    // where the dio memory alignment is larger: the device bounces them through an aligned copy.
    let data = pattern(9, 3 * 4096);
    let whole = SharedBuf::from_slice(&data);
    let view = whole.slice(512..512 + 2 * 4096);
    if lbs == 512 {
        dev.write(4096, view, WriteFlags::NONE).await.unwrap();
        assert_eq!(dev.read_vec(4096, 8192).await.unwrap(), &data[512..512 + 8192]);
    }
    dev.write_slice(0, &data, WriteFlags::NONE).await.unwrap();
    if lbs == 512 {
        let mut buf = IoBuf::zeroed(3 * 4096);
        let mut part = buf.split_off(512);
        part.truncate(8192);
        let (part, r) = dev.read(0, part).await;
        r.unwrap();
        assert_eq!(part.as_slice(), &data[..8192], "read into a view 512 bytes into its allocation");
    }
}

#[derive(Clone, Default)]
struct Capture(Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn shm_path(tag: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/mdkit-io-test-{}-{tag}", std::process::id()))
}

struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A sparse 4 MiB file on /dev/shm (removed when the guard drops) and a current-thread runtime.
fn shm_member(tag: &str) -> (PathBuf, RemoveOnDrop, tokio::runtime::Runtime) {
    let path = shm_path(tag);
    let cleanup = RemoveOnDrop(path.clone());
    FileDevice::create_sparse(&path, 4 * MIB).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    (path, cleanup, rt)
}

#[test]
fn tmpfs_falls_back_to_buffered_io_with_a_warning() {
    let (path, _cleanup, rt) = shm_member("fallback");
    let capture = Capture::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer({
            let c = capture.clone();
            move || c.clone()
        })
        .finish();
    let dev = rt.block_on(async {
        tracing::subscriber::with_default(subscriber, || FileDevice::open(&path, FileOptions::default()))
    });
    let dev = dev.expect("Auto falls back instead of failing");
    let log = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("WARN"), "a warning is logged: {log:?}");
    assert!(log.contains(&path.display().to_string()), "the warning names the path: {log:?}");
    assert!(!dev.is_direct());
    assert!(dev.direct_fallback_reason().is_some());
    assert_eq!(dev.topology().logical_block_bytes, 512);

    rt.block_on(async {
        let a = pattern(4, 512);
        let b = pattern(5, 3 * 4096);
        dev.write_slice(512, &a, WriteFlags::FUA).await.unwrap();
        dev.write_slice(3 * MIB, &b, WriteFlags::NONE).await.unwrap();
        dev.flush().await.unwrap();
        assert_eq!(dev.read_vec(512, 512).await.unwrap(), a);
        assert_eq!(dev.read_vec(3 * MIB, b.len()).await.unwrap(), b);
        // tmpfs has no FALLOC_FL_ZERO_RANGE: no_unmap zeroing takes the punch+allocate path.
        dev.write_zeroes(3 * MIB, 4096, ZeroFlags { fua: true, no_unmap: true }).await.unwrap();
        dev.discard(3 * MIB + 4096, 4096).await.unwrap();
        let v = dev.read_vec(3 * MIB, b.len()).await.unwrap();
        assert_eq!(&v[..8192], &[0u8; 8192][..]);
        assert_eq!(&v[8192..], &b[8192..]);
    });
    drop(dev);
    let on_shm = std::fs::read(&path).unwrap();
    assert_eq!(&on_shm[512..1024], &pattern(4, 512)[..]);

    let required = rt.block_on(async { FileDevice::open(&path, direct_options()) });
    let err = required.expect_err("Require refuses tmpfs");
    assert_eq!(err.kind(), io::ErrorKind::Unsupported);
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
}

#[test]
fn tmpfs_small_io_is_copied_on_the_callers_thread_and_large_io_uses_the_ring() {
    let (path, _cleanup, rt) = shm_member("inline");
    let dev = rt.block_on(async { FileDevice::open(&path, FileOptions::default()) }).unwrap();
    assert!(!dev.is_direct());
    let small = INLINE_COPY_MAX_BYTES;
    rt.block_on(async {
        // Small reads, writes (FUA or not, odd 512-byte offsets) and flushes: no io_uring
        // submission at all, and the data round-trips.
        let a = pattern(11, 512);
        let b = pattern(12, small);
        dev.write_slice(512 * 7, &a, WriteFlags::FUA).await.unwrap();
        dev.write_slice(MIB + 512, &b, WriteFlags::NONE).await.unwrap();
        dev.flush().await.unwrap();
        assert_eq!(dev.read_vec(512 * 7, 512).await.unwrap(), a);
        assert_eq!(dev.read_vec(MIB + 512, small).await.unwrap(), b);
        // A read across written and never-written bytes.
        let v = dev.read_vec(MIB, 4096).await.unwrap();
        assert_eq!(&v[..512], &[0u8; 512][..]);
        assert_eq!(&v[512..], &b[..4096 - 512]);
        assert_eq!(dev.submit_stats().enter_calls, 0, "small I/O on tmpfs never enters io_uring");
        assert_eq!(dev.in_flight(), 0);

        // Above the limit the ring is used (io-wq copies on another core).
        let c = pattern(13, small + 4096);
        dev.write_slice(2 * MIB, &c, WriteFlags::NONE).await.unwrap();
        assert_eq!(dev.read_vec(2 * MIB, c.len()).await.unwrap(), c);
        assert!(dev.submit_stats().enter_calls >= 2, "{:?}", dev.submit_stats());
    });

    // The file shrank behind the device's back: the inline read reports the short file clearly.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(3 * MIB).unwrap();
    let err = rt.block_on(async { dev.read_vec(3 * MIB, 4096).await }).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    drop(dev);
    let on_shm = std::fs::read(&path).unwrap();
    assert_eq!(&on_shm[512 * 7..512 * 8], &pattern(11, 512)[..]);
}

#[tokio::test]
async fn discard_and_write_zeroes_semantics() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, 4 * MIB).unwrap();
    let dev = open_direct(&path);
    let data = pattern(7, 2 << 20);
    dev.write_slice(0, &data, WriteFlags::FUA).await.unwrap();
    let before = allocated_bytes(&path);
    assert!(before >= 2 * MIB, "written range is allocated ({before})");

    // Discard on a file punches a hole: zeroes, and space is returned.
    dev.discard(0, MIB).await.unwrap();
    assert_eq!(dev.read_vec(0, MIB as usize).await.unwrap(), vec![0u8; MIB as usize]);
    let after_discard = allocated_bytes(&path);
    assert!(after_discard <= before - MIB, "{after_discard} vs {before}");

    // write_zeroes with no_unmap keeps the range allocated (ZERO_RANGE).
    dev.write_zeroes(MIB, 512 * 1024, ZeroFlags { fua: false, no_unmap: true }).await.unwrap();
    assert_eq!(allocated_bytes(&path), after_discard, "no_unmap must not deallocate");
    // write_zeroes without no_unmap may punch (space returned).
    dev.write_zeroes(MIB + 512 * 1024, 256 * 1024, ZeroFlags { fua: true, no_unmap: false }).await.unwrap();
    assert!(allocated_bytes(&path) < after_discard);
    let v = dev.read_vec(MIB, MIB as usize).await.unwrap();
    assert!(v[..768 * 1024].iter().all(|&b| b == 0));
    assert_eq!(&v[768 * 1024..], &data[(MIB as usize + 768 * 1024)..2 * MIB as usize]);
    // Zero-length operations are valid no-ops.
    dev.discard(4096, 0).await.unwrap();
    dev.write_zeroes(4096, 0, ZeroFlags::default()).await.unwrap();
    dev.write(4096, SharedBuf::zeroed(0), WriteFlags::FUA).await.unwrap();
}

#[tokio::test]
async fn bad_requests_return_invalid_input_and_change_nothing() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let dev = open_direct(&path);
    let lbs = u64::from(dev.topology().logical_block_bytes);
    dev.write_slice(0, &pattern(8, MIB as usize), WriteFlags::FUA).await.unwrap();
    let before = std::fs::read(&path).unwrap();
    let size = dev.topology().size_bytes;
    let bad: Vec<(u64, usize)> = vec![
        (1, 4096),
        (0, (lbs as usize) + 1),
        (size, 4096),
        (size - lbs, 2 * lbs as usize),
        (u64::MAX - (lbs - 1), lbs as usize),
    ];
    for &(off, len) in &bad {
        let e = dev.write_slice(off, &vec![0xaa; len], WriteFlags::FUA).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "write {off}+{len}: {e}");
        assert!(e.to_string().contains(&path.display().to_string()), "names the device: {e}");
        let (buf, r) = dev.read(off, IoBuf::zeroed(len)).await;
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(buf.len(), len, "the buffer comes back");
        let e = dev.discard(off, len as u64).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        let e = dev.write_zeroes(off, len as u64, ZeroFlags::default()).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
    let e = dev.write_slice(0, &vec![0u8; 64 << 20], WriteFlags::NONE).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "longer than max_io_bytes");
    assert_eq!(std::fs::read(&path).unwrap(), before, "bad requests changed nothing");

    // Read-only devices refuse every modification, naming the reason.
    let ro = FileDevice::open(&path, FileOptions { read_only: true, ..direct_options() }).unwrap();
    let e = ro.write_slice(0, &[0u8; 4096], WriteFlags::NONE).await.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(ro.discard(0, 4096).await.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
    ro.flush().await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

/// A read that crosses the end of a file truncated behind the device's back: the first
/// submission returns the bytes before EOF (a short read), the resubmitted remainder returns 0,
/// and the caller gets UnexpectedEof saying how far it got.
#[tokio::test]
async fn short_read_is_resubmitted_then_reports_eof() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let dev = open_direct(&path);
    dev.write_slice(MIB - 8192, &pattern(12, 8192), WriteFlags::FUA).await.unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(MIB - 4096).unwrap();
    let (buf, r) = dev.read(MIB - 8192, IoBuf::zeroed(8192)).await;
    let e = r.unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
    assert!(e.to_string().contains("after 4096 bytes"), "{e}");
    assert_eq!(&buf.as_slice()[..4096], &pattern(12, 8192)[..4096], "the part before EOF was read");
}

#[tokio::test]
async fn open_errors_are_clear() {
    let dir = target_tmp();
    let missing = dir.path().join("missing");
    let e = FileDevice::open(&missing, FileOptions::default()).err().unwrap();
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    assert!(e.to_string().contains("missing"), "{e}");
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let e = FileDevice::open(&path, FileOptions { queue_depth: 0, ..FileOptions::default() }).err().unwrap();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    let e = FileDevice::open(dir.path(), FileOptions::default()).err().unwrap();
    assert!(e.to_string().contains(&dir.path().display().to_string()), "{e}");
    assert_eq!(
        FileDevice::create_sparse(dir.path().join("odd"), 1000).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
}

#[test]
fn open_outside_a_runtime_is_an_error_not_a_panic() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let e = FileDevice::open(&path, FileOptions::default()).expect_err("needs a runtime");
    assert!(e.to_string().contains("tokio runtime"), "{e}");
}

/// Many tasks write random non-overlapping extents concurrently (queue depth 8 < tasks, so the
/// bound is exercised), then read them all back concurrently and verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_verifying_stress() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    let size = 32 * MIB;
    FileDevice::create_sparse(&path, size).unwrap();
    let dev = Arc::new(FileDevice::open(&path, FileOptions { queue_depth: 8, ..direct_options() }).unwrap());
    // Cut the device into 4 KiB-aligned extents of 4 KiB..128 KiB, shuffle, deal out to tasks.
    let mut rng = Rng::new(0x5eed);
    let mut extents = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let len = ((1 + rng.below(32)) * 4096).min(size - pos);
        extents.push((pos, len as usize));
        pos += len;
    }
    for i in (1..extents.len()).rev() {
        extents.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let tasks = 48;
    let mut handles = Vec::new();
    for t in 0..tasks {
        let dev = dev.clone();
        let mine: Vec<(u64, usize)> = extents.iter().copied().skip(t).step_by(tasks).collect();
        handles.push(tokio::spawn(async move {
            for (i, &(off, len)) in mine.iter().enumerate() {
                let flags = if i % 7 == 0 { WriteFlags::FUA } else { WriteFlags::NONE };
                dev.write_slice(off, &pattern(off, len), flags).await.unwrap();
                assert!(dev.in_flight() <= 8, "queue depth bound");
            }
            mine
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    dev.flush().await.unwrap();
    assert_eq!(all.len(), extents.len());
    let mut handles = Vec::new();
    for chunk in all.chunks(all.len().div_ceil(tasks)) {
        let dev = dev.clone();
        let chunk = chunk.to_vec();
        handles.push(tokio::spawn(async move {
            for (off, len) in chunk {
                assert_eq!(dev.read_vec(off, len).await.unwrap(), pattern(off, len), "extent at {off}");
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    assert_eq!(dev.in_flight(), 0);
}

/// Polls each request once (so it is submitted) and drops it: the I/O still runs to completion
/// with its buffer alive, nothing crashes, and the data written is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn futures_dropped_mid_flight_complete_safely() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, 16 * MIB).unwrap();
    let dev = FileDevice::open(&path, FileOptions { queue_depth: 16, ..direct_options() }).unwrap();
    let n = 64u64;
    for i in 0..n {
        let off = i * 256 * 1024;
        let mut w = dev.write(off, SharedBuf::from_slice(&pattern(off, 256 * 1024)), WriteFlags::NONE);
        let mut r = dev.read(off + 128 * 1024, IoBuf::zeroed(128 * 1024));
        // Poll once, then drop both (biased select: the futures are polled, then `ready` wins).
        tokio::select! { biased; _ = &mut w => {}, _ = std::future::ready(()) => {} }
        tokio::select! { biased; _ = &mut r => {}, _ = std::future::ready(()) => {} }
        drop(w);
        drop(r);
    }
    // Dropping the device with requests still in flight is a clean shutdown.
    drop(dev);
    let dev = open_direct(&path);
    dev.flush().await.unwrap();
    // The first request found the queue empty, so its first poll submitted it: it must be whole.
    assert_eq!(dev.read_vec(0, 256 * 1024).await.unwrap(), pattern(0, 256 * 1024));
    for i in 0..n {
        let off = i * 256 * 1024;
        let got = dev.read_vec(off, 256 * 1024).await.unwrap();
        // A write whose first poll submitted it runs to completion; one dropped while waiting
        // for a queue slot never started. Either way it is never torn.
        let want = pattern(off, 256 * 1024);
        assert!(got == want || got.iter().all(|&b| b == 0), "extent {i} is torn");
    }
}

/// Runtime shut down while requests are in flight: the ring owner drains the kernel's work
/// before freeing buffers.
#[test]
fn runtime_shutdown_with_requests_in_flight() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, 16 * MIB).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dev = Arc::new(rt.block_on(async { open_direct(&path) }));
    for i in 0..32u64 {
        let dev = dev.clone();
        rt.spawn(async move {
            let off = i * 512 * 1024;
            dev.write_slice(off, &pattern(off, 512 * 1024), WriteFlags::NONE).await.unwrap();
        });
    }
    drop(rt);
    drop(dev);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let dev = open_direct(&path);
        for i in 0..32u64 {
            let off = i * 512 * 1024;
            let got = dev.read_vec(off, 512 * 1024).await.unwrap();
            let torn_free = got == pattern(off, 512 * 1024) || got.iter().all(|&b| b == 0);
            assert!(torn_free, "extent {i}");
        }
    });
}

/// A device used after the runtime that opened it shut down fails clearly instead of hanging.
#[test]
fn use_after_the_opening_runtime_is_gone_is_an_error() {
    let dir = target_tmp();
    let path = dir.path().join("m0");
    FileDevice::create_sparse(&path, MIB).unwrap();
    let first = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dev = first.block_on(async { open_direct(&path) });
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    second.block_on(async {
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), dev.read_vec(0, 4096)).await;
        let e = r.expect("fails, does not hang").unwrap_err();
        assert!(e.to_string().contains("runtime that opened the device"), "{e}");
        assert!(dev.flush().await.is_err());
    });
}

//------------------------------------------------------------------------------------------------
// Block device (loop) — needs root and losetup.

struct Loop {
    dev: PathBuf,
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

fn setup_loop(backing: &Path) -> Option<Loop> {
    let out = std::process::Command::new("losetup").args(["--find", "--show", "--direct-io=on"]).arg(backing).output();
    match out {
        Ok(o) if o.status.success() => {
            Some(Loop { dev: PathBuf::from(String::from_utf8_lossy(&o.stdout).trim().to_string()) })
        }
        Ok(o) => {
            eprintln!("SKIP: loop block-device test: losetup failed: {}", String::from_utf8_lossy(&o.stderr).trim());
            None
        }
        Err(e) => {
            eprintln!("SKIP: loop block-device test: cannot run losetup (util-linux; scripts/test installs it): {e}");
            None
        }
    }
}

/// nbdkit's `memory` plugin behind its error filter, exposed as a file by nbdfuse and as a block
/// device by a loop device: a disk whose writes fail while `trigger` exists. Cleans up on drop.
struct FailingDisk {
    trigger: PathBuf,
    fuse_dir: PathBuf,
    nbdkit: std::process::Child,
    nbdfuse: std::process::Child,
    lo: Option<Loop>,
}

impl Drop for FailingDisk {
    fn drop(&mut self) {
        self.lo.take();
        // Lazily: the loop device lets go of the file only after its detach completes.
        let _ = std::process::Command::new("fusermount3").args(["-u", "-z"]).arg(&self.fuse_dir).status();
        for c in [&mut self.nbdfuse, &mut self.nbdkit] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn failing_disk(dir: &Path) -> Option<FailingDisk> {
    let tools = ["nbdkit", "nbdfuse", "fusermount3", "losetup"];
    let missing: Vec<&str> = tools.iter().copied().filter(|t| which(t).is_none()).collect();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !missing.is_empty() || !Path::new("/dev/fuse").exists() || !root {
        eprintln!("SKIP: failing-disk test needs root, /dev/fuse and {tools:?} (missing {missing:?})");
        return None;
    }
    let (sock, trigger, fuse_dir) = (dir.join("nbdkit.sock"), dir.join("fail-writes"), dir.join("fuse"));
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let spawn = |c: &mut std::process::Command| c.spawn().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let nbdkit = spawn(std::process::Command::new("nbdkit").arg("-f").arg("-U").arg(&sock).args([
        "--filter=error",
        "memory",
        "16M",
        "error=EIO",
        "error-pwrite-rate=1",
        &format!("error-file={}", trigger.display()),
    ]));
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let started = std::time::Instant::now();
    while !sock.exists() {
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "nbdkit did not listen");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let nbdfuse = spawn(std::process::Command::new("nbdfuse").arg(&fuse_dir).arg(&uri));
    let mut disk = FailingDisk { trigger, fuse_dir: fuse_dir.clone(), nbdkit, nbdfuse, lo: None };
    let file = fuse_dir.join("nbd");
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != 16 * MIB {
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "nbdfuse did not expose {}", file.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = std::process::Command::new("losetup").args(["--find", "--show"]).arg(&file).output().unwrap();
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    disk.lo = Some(Loop { dev: PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string()) });
    Some(disk)
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(tool)).find(|p| p.exists())
}

/// A buffered device whose writeback fails: the kernel reports the lost pages to one
/// `fdatasync` and then forgets them, so a second flush would succeed with the data gone (what
/// QA saw: a file volume read the old data back after a successful flush). Every flush after a
/// failed one fails, and the device still reads.
#[tokio::test]
async fn a_failed_flush_is_remembered_because_the_kernel_reports_a_writeback_error_once() {
    let dir = target_tmp();
    let Some(disk) = failing_disk(dir.path()) else { return };
    let lo = disk.lo.as_ref().unwrap();
    let opts = FileOptions { direct: DirectMode::Off, ..FileOptions::default() };
    let dev = FileDevice::open(&lo.dev, opts).unwrap();
    dev.write_slice(0, &pattern(1, 65536), WriteFlags::NONE).await.unwrap();
    dev.flush().await.expect("a healthy flush");
    std::fs::write(&disk.trigger, b"").unwrap();
    // Into the page cache: the failure shows at writeback.
    dev.write_slice(0, &pattern(2, 65536), WriteFlags::NONE).await.unwrap();
    let first = dev.flush().await.expect_err("writeback of the failed write");
    std::fs::remove_file(&disk.trigger).unwrap();
    let again = dev.flush().await.expect_err("a flush after a failed one");
    assert!(again.to_string().contains("an earlier flush failed"), "{again}");
    assert!(again.to_string().contains(&first.to_string()), "names the first failure: {again}");
    let e = dev.write_slice(4096, &pattern(3, 4096), WriteFlags::FUA).await.unwrap_err();
    assert!(e.to_string().contains("an earlier flush failed"), "a FUA write flushes too: {e}");
    dev.read_vec(65536, 4096).await.expect("reads still work");
}

#[tokio::test]
async fn block_device_ioctls_topology_and_io() {
    let dir = target_tmp();
    let backing = dir.path().join("backing");
    FileDevice::create_sparse(&backing, 16 * MIB).unwrap();
    let Some(lo) = setup_loop(&backing) else { return };
    let dev = FileDevice::open(&lo.dev, FileOptions::default()).unwrap();
    assert!(dev.is_block_device());
    assert!(dev.is_direct());
    let t = dev.topology();
    assert_eq!(t.size_bytes, 16 * MIB, "BLKGETSIZE64");
    assert_eq!(t.logical_block_bytes, 512, "BLKSSZGET");
    assert!(t.physical_block_bytes >= 512, "BLKPBSZGET");
    assert!(t.optimal_io_bytes >= 4096, "BLKIOOPT never below 4096");
    let data = pattern(11, MIB as usize);
    dev.write_slice(MIB, &data, WriteFlags::FUA).await.unwrap();
    dev.flush().await.unwrap();
    assert_eq!(dev.read_vec(MIB, data.len()).await.unwrap(), data);
    dev.write_zeroes(MIB, 64 * 1024, ZeroFlags { fua: true, no_unmap: true }).await.unwrap();
    let v = dev.read_vec(MIB, 128 * 1024).await.unwrap();
    assert!(v[..64 * 1024].iter().all(|&b| b == 0), "BLKZEROOUT");
    assert_eq!(&v[64 * 1024..], &data[64 * 1024..128 * 1024]);
    if t.supports_discard {
        dev.discard(2 * MIB - 64 * 1024, 64 * 1024).await.unwrap();
    }
    drop(dev);
    let bytes = std::fs::read(&backing).unwrap();
    assert_eq!(&bytes[(MIB as usize + 64 * 1024)..(MIB as usize + 128 * 1024)], &data[64 * 1024..128 * 1024]);
}

/// Threads that called `enable_thread_rings` and drive a current-thread runtime get an io_uring
/// of their own per device (the data-path layout of `mdkit serve`): several such threads and the
/// opening runtime's shared ring write disjoint ranges concurrently, every byte reads back from
/// every ring, flushes work on each, the queue-depth bound holds across rings, and a thread whose
/// runtime ended leaves the device usable (its ring is gone, the shared one serves).
#[test]
fn thread_rings_serve_their_threads_and_agree_with_the_shared_ring() {
    let dir = target_tmp();
    let path = dir.path().join("rings");
    FileDevice::create_sparse(&path, 32 * MIB).unwrap();
    let main_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dev = Arc::new(main_rt.block_on(async { open_direct(&path) }));
    const THREADS: u64 = 3;
    const SLICE: u64 = 8 * MIB;
    let mut joins = Vec::new();
    for t in 0..THREADS {
        let dev = dev.clone();
        joins.push(std::thread::spawn(move || {
            mdkit_io::enable_thread_rings();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let base = t * SLICE;
                // 64 writes of 128 KiB in flight at once, then FUA, then flush.
                let data = pattern(t + 1, SLICE as usize);
                let writes = (0..64u64).map(|k| {
                    let dev = dev.clone();
                    let chunk =
                        SharedBuf::from_slice(&data[(k * 128 * 1024) as usize..((k + 1) * 128 * 1024) as usize]);
                    async move { dev.write(base + k * 128 * 1024, chunk, WriteFlags::NONE).await }
                });
                for r in futures_join_all(writes).await {
                    r.unwrap();
                }
                dev.write(base, SharedBuf::from_slice(&data[..4096]), WriteFlags::FUA).await.unwrap();
                dev.flush().await.unwrap();
                let back = dev.read_vec(base, SLICE as usize).await.unwrap();
                assert!(back == data, "thread {t} reads its own writes");
                let st = dev.submit_stats();
                assert!(st.rings >= 2, "this thread has a ring of its own: {st:?}");
            });
        }));
    }
    // Meanwhile the shared ring (multi-thread runtime) writes the last slice.
    let shared_data = pattern(99, SLICE as usize);
    main_rt.block_on(async {
        dev.write(THREADS * SLICE, SharedBuf::from_slice(&shared_data), WriteFlags::NONE).await.unwrap();
        dev.flush().await.unwrap();
    });
    for j in joins {
        j.join().expect("ring thread");
    }
    // Those threads' runtimes are gone; everything reads back through the shared ring.
    main_rt.block_on(async {
        for t in 0..THREADS {
            let back = dev.read_vec(t * SLICE, SLICE as usize).await.unwrap();
            assert!(back == pattern(t + 1, SLICE as usize), "slice {t} through the shared ring");
        }
        let back = dev.read_vec(THREADS * SLICE, SLICE as usize).await.unwrap();
        assert!(back == shared_data);
        assert_eq!(dev.in_flight(), 0);
        let st = dev.submit_stats();
        assert_eq!(st.queued_sqes, 0, "{st:?}");
        assert!(st.sqes_submitted >= THREADS * 66, "{st:?}");
    });
}

/// `poll_thread_rings` (the data-path threads' idle poll) answers a completion waiting on the
/// calling thread's own ring by itself: the request's future is ready although the ring's reaper
/// task never ran, the data is right, and nothing is left to answer afterwards. Rings of other
/// threads and idle rings are left alone (0 answered, no error).
#[test]
fn poll_thread_rings_answers_this_threads_completions_without_the_reaper() {
    let dir = target_tmp();
    let path = dir.path().join("idle-poll");
    FileDevice::create_sparse(&path, 8 * MIB).unwrap();
    // Not a ring thread: nothing to answer.
    assert_eq!(mdkit_io::poll_thread_rings(), 0);
    let path2 = path.clone();
    std::thread::spawn(move || {
        mdkit_io::enable_thread_rings();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let dev = open_direct(&path2);
            let data = pattern(7, 64 * 1024);
            dev.write_slice(MIB, &data, WriteFlags::NONE).await.unwrap();
            assert!(dev.submit_stats().rings >= 2, "this thread has a ring of its own");
            assert_eq!(mdkit_io::poll_thread_rings(), 0, "nothing in flight");
            // Submit a read and, without ever yielding to the runtime (so the reaper task cannot
            // run), answer it through poll_thread_rings.
            let mut read = dev.read_vec(MIB, data.len());
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(read.as_mut().poll(&mut cx).is_pending(), "the read is in flight");
            assert_eq!(dev.in_flight(), 1);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut answered = 0;
            while answered == 0 {
                assert!(std::time::Instant::now() < deadline, "the completion never showed up");
                answered += mdkit_io::poll_thread_rings();
                std::hint::spin_loop();
            }
            assert_eq!(answered, 1);
            assert_eq!(dev.in_flight(), 0);
            match read.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(r) => assert!(r.unwrap() == data, "read back through the idle poll"),
                std::task::Poll::Pending => panic!("answered but not ready"),
            }
            assert_eq!(mdkit_io::poll_thread_rings(), 0, "nothing left");
        });
    })
    .join()
    .expect("ring thread");
}

async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let handles: Vec<_> = fs.map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    // Poll all together: a tiny join_all (the crate has no futures dependency).
    let mut pending: Vec<Option<std::pin::Pin<Box<F>>>> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (i, slot) in pending.iter_mut().enumerate() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => all = false,
                }
            }
        }
        if all { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
    })
    .await;
    out.extend(results.into_iter().map(Option::unwrap));
    out
}

/// `flush_batching`: flushes issued together share `fdatasync` rounds (one round serves every
/// flush that arrived before it started; the rule itself is unit-tested in `mdkit_io::flush`),
/// and each round is exactly one fsync SQE. Switched off, every flush is its own round. Without
/// the option there is no batcher at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_batching_serves_concurrent_flushes_with_few_fdatasyncs() {
    let dir = target_tmp();
    let path = dir.path().join("batched");
    FileDevice::create_sparse(&path, 8 * MIB).unwrap();
    assert!(open_direct(&path).flush_stats().is_none(), "off by default");
    let dev = Arc::new(FileDevice::open(&path, FileOptions { flush_batching: true, ..direct_options() }).unwrap());
    const N: u64 = 64;
    let barrier = Arc::new(tokio::sync::Barrier::new(N as usize));
    let sqes_before = dev.submit_stats().sqes_submitted;
    let tasks: Vec<_> = (0..N)
        .map(|k| {
            let (dev, barrier) = (dev.clone(), barrier.clone());
            tokio::spawn(async move {
                dev.write(k * 4096, SharedBuf::from_slice(&pattern(k, 4096)), WriteFlags::NONE).await.unwrap();
                // Every write completed before any flush is issued: the flushes arrive together.
                barrier.wait().await;
                dev.flush().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let st = dev.flush_stats().unwrap();
    assert_eq!(st.requests, N);
    assert!(st.rounds >= 1 && st.rounds <= N / 4, "{N} flushes issued together must share rounds: {st:?}");
    assert_eq!(dev.submit_stats().sqes_submitted - sqes_before, N + st.rounds, "one fdatasync per round: {st:?}");
    dev.flush_batcher().unwrap().set_batching(false);
    for _ in 0..8 {
        dev.flush().await.unwrap();
    }
    let off = dev.flush_stats().unwrap();
    assert_eq!((off.requests, off.rounds), (st.requests + 8, st.rounds + 8), "unbatched: a round per flush");
    for k in 0..N {
        assert_eq!(dev.read_vec(k * 4096, 4096).await.unwrap(), pattern(k, 4096));
    }
}
