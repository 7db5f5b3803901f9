//! `FileDevice`: a member backed by a regular file or a block device, driven through io_uring,
//! with O_DIRECT whenever the filesystem really does direct I/O.
//!
//! ```text
//!   caller task ──permit (Semaphore, queue_depth)──► Box<InFlight{buffer, reply, permit}>
//!        │                                                   │ user_data = pointer
//!        │  SQ push + io_uring_enter (short per-device lock)  ▼
//!        │                                              kernel I/O
//!        │                                                   │ CQE + eventfd signal
//!        ◄──── oneshot reply (result, buffer) ◄──── reaper task (AsyncFd on the eventfd)
//! ```
//!
//! * **Bounded.** At most `queue_depth` requests are in flight per device: every request holds a
//!   semaphore permit, and the permit lives in the in-flight record, so it is released when the
//!   kernel completes the request, not when a caller gives up waiting. The ring is sized so that
//!   neither the SQ nor the CQ can overflow.
//! * **No thread per request.** One reaper task per device, woken through an eventfd registered
//!   with the ring, drains the CQ and answers each waiter through a oneshot channel. Block-device
//!   discard/zero-out ioctls, which io_uring cannot issue, run on the blocking pool (still under a
//!   permit).
//! * **Cancellation-safe.** The buffer of a request lives in its in-flight record until the CQE
//!   arrives. A caller future dropped mid-flight only drops the receiving end; the reaper then
//!   frees the buffer after the kernel is done with it.
//! * **Clean shutdown.** Dropping the device tells the reaper to finish; it keeps reaping until no
//!   request is in flight and then releases the ring. If the runtime is gone first, the ring's
//!   owner drains the remaining completions synchronously before unmapping it.
//!
//! Semantics per operation:
//!
//! | op            | regular file                               | block device               |
//! |---------------|--------------------------------------------|----------------------------|
//! | write + FUA   | IORING_OP_WRITE with RWF_DSYNC              | same (REQ_FUA or emulated) |
//! | flush         | IORING_OP_FSYNC, DATASYNC                   | same (cache flush)         |
//! | discard       | fallocate(PUNCH_HOLE\|KEEP_SIZE); a no-op where unsupported | BLKDISCARD |
//! | write_zeroes  | PUNCH_HOLE (or ZERO_RANGE with `no_unmap`), falling back to writing zeroes | BLKZEROOUT |
//!
//! Short transfers are completed by resubmitting the remainder; EINTR/EAGAIN are retried.
//!
//! **Direct I/O.** With [`DirectMode::Auto`] the file is opened with O_DIRECT; where the
//! filesystem refuses it (ramfs, some FUSE/overlay setups) or only emulates it through the page
//! cache (tmpfs accepts O_DIRECT since Linux 6.6 but copies through the page cache), the device
//! falls back to buffered I/O, logs a warning naming the path, and still honours FUA (RWF_DSYNC)
//! and flush (fdatasync) — so durability semantics are identical, only the cache differs. One
//! difference the device hides: buffered writes fail at writeback, which the kernel reports to
//! one `fdatasync` only, so a failed flush is remembered (every later flush and FUA write fails
//! until the device is reopened; see `Sticky`), in every mode.
//! [`DirectMode::Require`] turns that fallback into an error; [`DirectMode::Off`] never tries.
//!
//! **Memory-backed files.** A buffered file on tmpfs or ramfs has no device behind it, and these
//! filesystems do not do non-blocking buffered I/O (RWF_NOWAIT gives EOPNOTSUPP), so io_uring
//! hands every read, write and fsync of theirs to an io-wq worker thread and back: two thread
//! wake-ups for a memory copy. There, reads and writes up to [`INLINE_COPY_MAX_BYTES`] and
//! flushes are done with `pread`/`pwritev2`/`fdatasync` on the caller's thread instead (nothing
//! to wait for but the copy; nothing is in flight afterwards). Larger transfers still go through
//! the ring, where io-wq can copy them on another core.
//!
//! **Topology.** Block devices: BLKGETSIZE64, BLKSSZGET, BLKPBSZGET, BLKIOOPT (optimal I/O never
//! below 4096), cache/FUA/discard/rotational from sysfs when present. Regular files: size from
//! the inode (rounded down to the logical block), logical block = the O_DIRECT offset alignment
//! (statx STATX_DIOALIGN, else probed with a 512-byte direct read, else 4096), physical and
//! optimal I/O 4096; buffered files use 512-byte logical blocks.
//!
//! The reaper task runs on the tokio runtime that called [`FileDevice::open`]; that runtime must
//! keep running while the device is used (from any runtime or thread). Requests issued after it
//! shut down fail with `BrokenPipe` naming the cause instead of waiting forever.

use std::cell::RefCell;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::{Mutex, MutexGuard};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, oneshot};

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io};
use crate::error::{DeviceError, IoErrorKind};
use crate::extent::{Extent, ExtentFlags, check_status_range, seek_extents};
use crate::flush::{FlushBatcher, FlushStats};
use crate::lock::{DeviceLock, LockMode};
use crate::plug::{self, PlugTarget};

/// Default number of requests in flight per device.
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;
/// Largest accepted queue depth (bounds the ring and the in-flight records).
pub const MAX_QUEUE_DEPTH: u32 = 4096;
/// Largest single read/write (bytes).
const MAX_IO_BYTES: u32 = 32 << 20;
/// Bound on EINTR/EAGAIN resubmissions of one request before it fails.
const MAX_RETRIES: u32 = 1000;
/// `io_uring_enter` flag: also reap (and, on a DEFER_TASKRUN ring, post) completions
/// (include/uapi/linux/io_uring.h; the io-uring crate keeps its `sys` module private).
const IORING_ENTER_GETEVENTS: u32 = 1 << 0;
/// Chunk used when zeroes have to be written because fallocate is unsupported.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// Largest read or write a memory-backed file (tmpfs, ramfs; see the module documentation)
/// copies on the caller's thread instead of through io_uring.
pub const INLINE_COPY_MAX_BYTES: usize = 64 << 10;

// Block-device ioctls not exported by the libc crate for every target.
#[cfg(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
))]
const BLKGETSIZE64: libc::Ioctl = 0x4008_1272;
#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
)))]
const BLKGETSIZE64: libc::Ioctl = 0x8008_1272;
#[cfg(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
))]
const BLKDISCARD: libc::Ioctl = 0x2000_1277;
#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
)))]
const BLKDISCARD: libc::Ioctl = 0x1277;
#[cfg(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
))]
const BLKZEROOUT: libc::Ioctl = 0x2000_127f;
#[cfg(not(any(
    target_arch = "powerpc",
    target_arch = "powerpc64",
    target_arch = "mips",
    target_arch = "mips64",
    target_arch = "sparc64"
)))]
const BLKZEROOUT: libc::Ioctl = 0x127f;

const RAMFS_MAGIC: i64 = 0x8584_58f6;

//------------------------------------------------------------------------------------------------

/// Whether to use O_DIRECT.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectMode {
    /// O_DIRECT where the filesystem really does direct I/O; otherwise buffered I/O with a
    /// warning (durability semantics unchanged).
    #[default]
    Auto,
    /// O_DIRECT or an error.
    Require,
    /// Buffered I/O (page cache); FUA and flush still reach stable storage.
    Off,
}

/// How to open a [`FileDevice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileOptions {
    /// Open O_RDONLY; writes, discards and write-zeroes fail with `PermissionDenied`.
    pub read_only: bool,
    pub direct: DirectMode,
    /// Requests in flight at most (1..=[`MAX_QUEUE_DEPTH`]).
    pub queue_depth: u32,
    /// Flush batching ([`FlushBatcher`]): one `fdatasync` serves every flush that arrived
    /// before it started, instead of one per request. For a device whose flushes come from
    /// many clients at once (a volume served over NBD); md members leave it off, the array
    /// batches above them (and its `flush_batching = 0` comparison must reach the members
    /// unbatched).
    pub flush_batching: bool,
    /// Hold the device's lock ([`DeviceLock`]) while open: another process that opens it with
    /// this option (or an offline tool that writes it) is refused. Ignored with `read_only`
    /// unless `lock_read_only`.
    pub exclusive: bool,
    /// With `exclusive`, take the lock shared ([`LockMode::Shared`]): other shared holders
    /// (another service's file volume on the same image) are let in, exclusive ones are not.
    pub shared_lock: bool,
    /// With `exclusive` and `read_only`: take the lock shared all the same, for a reader that
    /// must not see the device change under it (a thin volume's external origin): arrays,
    /// pools and offline writers of other processes are refused while it is open.
    pub lock_read_only: bool,
}

impl Default for FileOptions {
    fn default() -> FileOptions {
        FileOptions {
            read_only: false,
            direct: DirectMode::Auto,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            flush_batching: false,
            exclusive: false,
            shared_lock: false,
            lock_read_only: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RegularFile,
    BlockDevice,
}

/// What the kernel holds while a request is in flight: the buffer stays here until the CQE.
enum Keep {
    None,
    Read(IoBuf),
    Write(SharedBuf),
}

struct InFlight {
    keep: Keep,
    reply: oneshot::Sender<(i32, Keep)>,
    _permit: OwnedSemaphorePermit,
}

/// Submission counters of one device, all its rings together.
#[derive(Default)]
struct Counters {
    enter_calls: AtomicU64,
    sqes_submitted: AtomicU64,
}

/// Cumulative statistics of a device's submission path (tests, benchmarks, metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubmitStats {
    /// `io_uring_enter` calls that submitted SQEs.
    pub enter_calls: u64,
    /// SQEs those calls submitted (`sqes_submitted / enter_calls` = the batch size).
    pub sqes_submitted: u64,
    /// SQEs queued in user space right now and not yet submitted (held by a plug).
    pub queued_sqes: u64,
    /// Live io_uring instances: the device's shared ring plus one per thread that called
    /// [`enable_thread_rings`] and used the device.
    pub rings: usize,
}

/// The device: the file and what every ring shares.
struct Shared {
    /// Process-unique id (keys the per-thread ring table; addresses can be reused).
    id: u64,
    name: String,
    kind: Kind,
    file: File,
    /// Topology at open; `size_bytes` is superseded by `size_bytes` below.
    topology: Topology,
    /// Current size: grows when [`FileDevice::refresh_size`] sees a grown file or device.
    size_bytes: AtomicU64,
    direct: bool,
    /// Buffered file on tmpfs/ramfs: small reads and writes and flushes are done on the
    /// caller's thread (module documentation, "Memory-backed files").
    inline_copy: bool,
    /// Required alignment of buffer addresses for O_DIRECT (1 when buffered).
    mem_align_bytes: usize,
    read_only: bool,
    queue_depth: u32,
    /// Bounds the requests in flight on all rings together.
    permits: Arc<Semaphore>,
    /// The ring created at open; its reaper runs on the opening runtime.
    default_ring: Arc<Ring>,
    /// Rings of threads that enabled thread rings (kept alive by their reapers).
    thread_rings: Mutex<Vec<Weak<Ring>>>,
    counters: Arc<Counters>,
    /// Present when opened with `flush_batching`.
    flusher: Option<FlushBatcher>,
    /// Failures that outlive the request that met them (see [`Sticky`]).
    sticky: Sticky,
    /// Held while the device is open when opened `exclusive` (released with the last request).
    _lock: Option<DeviceLock>,
}

/// Failures the device remembers until it is closed, because the kernel does not.
///
/// * **A failed flush.** The kernel reports a writeback error to `fdatasync` once per open
///   file: the next `fdatasync` succeeds although the pages it lost never reached the device
///   (PostgreSQL's "fsyncgate"; qemu marks its file `page_cache_inconsistent` for the same
///   reason). So once a flush fails, every later flush fails too, naming the first failure:
///   nothing written before it can be promised durable any more. Reopening the device (a
///   service restart) clears it.
/// * **A truncated file** (found at a flush): the data past the cut is gone and the holes read
///   zeros, so reads and writes fail from then on instead of serving them.
#[derive(Default)]
struct Sticky {
    flush_failed: AtomicBool,
    truncated: AtomicBool,
    /// The first failure, for the later errors.
    first: Mutex<Option<String>>,
}

impl Sticky {
    /// Records a failed flush (not a shut-down runtime: that is no device failure).
    fn flush_failed(&self, e: &io::Error) {
        if DeviceError::kind_of(e) == IoErrorKind::Closed {
            return;
        }
        self.first.lock().get_or_insert_with(|| e.to_string());
        self.flush_failed.store(true, Ordering::Release);
    }

    fn truncated(&self, e: &io::Error) {
        self.flush_failed(e);
        self.truncated.store(true, Ordering::Release);
    }

    /// The error for an operation refused because of an earlier failure.
    fn refusal(&self, name: &str, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Error {
        let first = self.first.lock().clone().unwrap_or_default();
        DeviceError::new(IoErrorKind::Eio, name, op, offset_bytes, len_bytes)
            .detail(format!(
                "an earlier flush failed ({first}); data written before it may not be on the device, so every \
                 later flush fails too until the device is reopened"
            ))
            .into()
    }

    /// Flushes, and FUA writes (a promise of durability too), after a failed flush.
    fn check_durable(&self, name: &str, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        if self.flush_failed.load(Ordering::Acquire) {
            return Err(self.refusal(name, op, offset_bytes, len_bytes));
        }
        Ok(())
    }

    /// Reads and writes after the file was found truncated.
    fn check_io(&self, name: &str, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        if self.truncated.load(Ordering::Acquire) {
            return Err(self.refusal(name, op, offset_bytes, len_bytes));
        }
        Ok(())
    }
}

/// One io_uring with the device's file registered, its completion reaper and eventfd.
struct Ring {
    name: String,
    ring: IoUring,
    /// SINGLE_ISSUER + DEFER_TASKRUN: completions are posted only when the owner thread enters
    /// the kernel with GETEVENTS (no task-work interrupts); submissions come from that thread.
    deferred_taskrun: bool,
    /// The only thread that submits to a thread ring.
    owner: Option<ThreadId>,
    /// Serialises access to the submission queue ring.
    sq_lock: Mutex<()>,
    /// Serialises access to the completion queue ring.
    cq_lock: Mutex<()>,
    /// Requests pushed to the ring and not yet reaped.
    inflight: AtomicUsize,
    closing: AtomicBool,
    /// Set when an `io_uring_enter` could not submit everything (EAGAIN, EBUSY, ...): the reaper
    /// retries with a back-off, so no caller has to wait in a synchronous path.
    submit_retry: AtomicBool,
    /// Failed submission attempts (rate-limits the log).
    enter_failures: AtomicUsize,
    /// False once the reaper task ended (device dropped, or its runtime shut down).
    reaper_alive: AtomicBool,
    /// Wakes the reaper for shutdown or a submission retry.
    wake_reaper: Notify,
    counters: Arc<Counters>,
}

/// A member on a regular file or block device, asynchronous through io_uring.
/// See the module documentation for the exact semantics.
pub struct FileDevice {
    shared: Arc<Shared>,
    path: PathBuf,
    fallback_reason: Option<String>,
}

fn errno() -> io::Error {
    io::Error::last_os_error()
}

fn with_context(e: io::Error, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

//------------------------------------------------------------------------------------------------
// Opening

impl FileDevice {
    /// Opens `path` (a regular file or a block device). Must be called inside a tokio runtime with
    /// the I/O driver enabled; the device's completion reaper runs on that runtime.
    pub fn open(path: impl AsRef<Path>, options: FileOptions) -> io::Result<FileDevice> {
        let path = path.as_ref();
        let name = path.display().to_string();
        if options.queue_depth == 0 || options.queue_depth > MAX_QUEUE_DEPTH {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: queue_depth {} outside 1..={MAX_QUEUE_DEPTH}", options.queue_depth),
            ));
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other(format!("{name}: FileDevice::open must be called inside a tokio runtime")))?;
        let (file, direct, fallback_reason) = open_file(path, &name, &options)?;
        // Before anything reads the device for its topology: a device another process writes is
        // refused as it is.
        let lock_mode = if options.shared_lock || options.read_only { LockMode::Shared } else { LockMode::Exclusive };
        let locks = options.exclusive && (!options.read_only || options.lock_read_only);
        let lock = locks.then(|| DeviceLock::take(&file, &name, lock_mode)).transpose()?;
        let meta = file.metadata().map_err(|e| with_context(e, &name))?;
        let kind = if meta.file_type().is_block_device() {
            Kind::BlockDevice
        } else if meta.file_type().is_file() {
            Kind::RegularFile
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: not a regular file or block device"),
            ));
        };
        let (topology, mem_align_bytes) = match kind {
            Kind::BlockDevice => block_topology(&file, &name, &meta, direct, options.read_only)?,
            Kind::RegularFile => file_topology(&file, &meta, direct, options.read_only)?,
        };
        let inline_copy = !direct && kind == Kind::RegularFile && on_memory_fs(&file);
        let counters = Arc::new(Counters::default());
        let default_ring =
            Ring::start(name.clone(), file.as_raw_fd(), options.queue_depth, false, &runtime, counters.clone())?;
        static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(Shared {
            id: NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed),
            name,
            kind,
            file,
            size_bytes: AtomicU64::new(topology.size_bytes),
            topology,
            direct,
            inline_copy,
            mem_align_bytes,
            read_only: options.read_only,
            queue_depth: options.queue_depth,
            permits: Arc::new(Semaphore::new(options.queue_depth as usize)),
            default_ring,
            thread_rings: Mutex::new(Vec::new()),
            counters,
            flusher: options.flush_batching.then(FlushBatcher::new),
            sticky: Sticky::default(),
            _lock: lock,
        });
        Ok(FileDevice { shared, path: path.to_path_buf(), fallback_reason })
    }

    /// Creates a new sparse file of `size_bytes` (a non-zero multiple of 512) at `path`; fails
    /// with `AlreadyExists` rather than overwrite anything, and leaves no file behind when it fails.
    pub fn create_sparse(path: impl AsRef<Path>, size_bytes: u64) -> io::Result<()> {
        let path = path.as_ref();
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: sparse size {size_bytes} bytes is not a non-zero multiple of 512", path.display()),
            ));
        }
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| with_context(e, format!("{}: creating sparse member file", path.display())))?;
        if let Err(e) = file.set_len(size_bytes) {
            // A failed create leaves nothing behind (the file is this call's: create_new).
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(with_context(e, format!("{}: setting size to {size_bytes} bytes", path.display())));
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True when the device really does O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.shared.direct
    }

    /// Why direct I/O is not used when it was asked for (`DirectMode::Auto` fallback).
    pub fn direct_fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    pub fn is_block_device(&self) -> bool {
        self.shared.kind == Kind::BlockDevice
    }

    /// Reads the size of the file or block device again (after `truncate`, or a grown device)
    /// and returns it. The device only grows: a smaller size is an error and the device keeps
    /// its size (a thin pool or array on it must not lose its end under it).
    pub fn refresh_size(&self) -> io::Result<u64> {
        let s = &self.shared;
        let raw = match s.kind {
            Kind::BlockDevice => ioctl_u64(&s.file, &s.name, BLKGETSIZE64, "BLKGETSIZE64")?,
            Kind::RegularFile => s.file.metadata().map_err(|e| with_context(e, &s.name))?.len(),
        };
        let size_bytes = raw - raw % u64::from(s.topology.logical_block_bytes.max(1));
        let old = s.size_bytes.load(Ordering::Acquire);
        if size_bytes < old {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: shrank from {old} to {size_bytes} bytes under the open device; size kept", s.name),
            ));
        }
        s.size_bytes.fetch_max(size_bytes, Ordering::AcqRel);
        Ok(size_bytes)
    }

    /// Grows a regular file to `size_bytes` (rounded down to the logical block) and takes the
    /// new size. Never shrinks: a smaller size is an error. Block devices cannot be grown here.
    pub fn grow_file(&self, size_bytes: u64) -> io::Result<u64> {
        let s = &self.shared;
        if s.kind != Kind::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: a block device is grown by its owner, not by mdkit", s.name),
            ));
        }
        if s.read_only {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("{}: opened read-only", s.name)));
        }
        let size_bytes = size_bytes - size_bytes % u64::from(s.topology.logical_block_bytes.max(1));
        let old = self.refresh_size()?;
        if size_bytes < old {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: cannot shrink from {old} to {size_bytes} bytes", s.name),
            ));
        }
        if size_bytes > old {
            s.file
                .set_len(size_bytes)
                .map_err(|e| with_context(e, format!("{}: growing to {size_bytes} bytes", s.name)))?;
        }
        self.refresh_size()
    }

    pub fn queue_depth(&self) -> u32 {
        self.shared.queue_depth
    }

    /// Requests currently submitted to the kernel and not yet completed (all rings).
    pub fn in_flight(&self) -> usize {
        self.shared.rings().iter().map(|r| r.inflight.load(Ordering::Acquire)).sum()
    }

    /// Flush batching counters (requests and `fdatasync` rounds); `None` when opened without
    /// `flush_batching`.
    pub fn flush_stats(&self) -> Option<FlushStats> {
        self.shared.flusher.as_ref().map(FlushBatcher::stats)
    }

    /// The flush batcher, when opened with `flush_batching` (its switch and attributes).
    pub fn flush_batcher(&self) -> Option<&FlushBatcher> {
        self.shared.flusher.as_ref()
    }

    /// Submission statistics (batching: `sqes_submitted / enter_calls`).
    pub fn submit_stats(&self) -> SubmitStats {
        let rings = self.shared.rings();
        SubmitStats {
            enter_calls: self.shared.counters.enter_calls.load(Ordering::Relaxed),
            sqes_submitted: self.shared.counters.sqes_submitted.load(Ordering::Relaxed),
            queued_sqes: rings.iter().map(|r| r.queued_sqes() as u64).sum(),
            rings: rings.len(),
        }
    }
}

impl std::fmt::Debug for FileDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDevice")
            .field("path", &self.path)
            .field("direct", &self.shared.direct)
            .field("queue_depth", &self.shared.queue_depth)
            .field("topology", &self.shared.topology)
            .finish()
    }
}

impl Drop for FileDevice {
    fn drop(&mut self) {
        for ring in self.shared.rings() {
            ring.closing.store(true, Ordering::Release);
            ring.wake_reaper.notify_one();
        }
    }
}

fn open_file(path: &Path, name: &str, options: &FileOptions) -> io::Result<(File, bool, Option<String>)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(!options.read_only);
        o.custom_flags(if direct { libc::O_DIRECT } else { 0 });
        o.open(path)
    };
    if options.direct == DirectMode::Off {
        let f = open(false).map_err(|e| with_context(e, format!("{name}: open")))?;
        return Ok((f, false, None));
    }
    let refused = match open(true) {
        // A block device node sits on devtmpfs; its O_DIRECT goes to the device itself.
        Ok(f) if f.metadata().is_ok_and(|m| m.file_type().is_block_device()) => return Ok((f, true, None)),
        Ok(f) => match emulated_direct_reason(&f) {
            None => match direct_offset_align(&f) {
                Ok(_) => return Ok((f, true, None)),
                Err(reason) => reason,
            },
            Some(reason) => reason,
        },
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => format!("O_DIRECT refused by the filesystem ({e})"),
        Err(e) => return Err(with_context(e, format!("{name}: open"))),
    };
    if options.direct == DirectMode::Require {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{name}: direct I/O required but unavailable: {refused}"),
        ));
    }
    tracing::warn!(
        path = %name,
        "{name}: {refused}; falling back to buffered I/O (flush and FUA use fdatasync semantics)"
    );
    let f = open(false).map_err(|e| with_context(e, format!("{name}: open")))?;
    Ok((f, false, Some(refused)))
}

/// Filesystems that accept O_DIRECT but serve it from the page cache.
fn emulated_direct_reason(file: &File) -> Option<String> {
    on_memory_fs(file).then(|| "tmpfs/ramfs has no direct I/O (O_DIRECT is served from the page cache)".to_string())
}

/// True for a file on tmpfs or ramfs (page cache only, no device behind it).
fn on_memory_fs(file: &File) -> bool {
    // SAFETY: fstatfs on a valid fd into a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    let magic = st.f_type as i64;
    magic == libc::TMPFS_MAGIC || magic == RAMFS_MAGIC
}

struct DioAlign {
    mem_bytes: u32,
    offset_bytes: u32,
}

fn statx_dio(file: &File) -> Option<DioAlign> {
    // SAFETY: statx with AT_EMPTY_PATH on a valid fd writes into the zeroed struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty = CString::new("").expect("empty C string has no NUL inside");
    // SAFETY: as above; pointers are valid for the call.
    let r =
        unsafe { libc::statx(file.as_raw_fd(), empty.as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if r != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some(DioAlign { mem_bytes: stx.stx_dio_mem_align, offset_bytes: stx.stx_dio_offset_align })
}

/// The O_DIRECT offset alignment of a regular file opened with O_DIRECT, or why there is none.
fn direct_offset_align(file: &File) -> Result<u32, String> {
    if let Some(dio) = statx_dio(file) {
        return match dio.offset_bytes {
            0 => Err("the filesystem reports no direct I/O support (statx DIOALIGN = 0)".to_string()),
            n if n <= 512 => Ok(512),
            n if n <= 4096 => Ok(n.next_power_of_two()),
            n => Err(format!("O_DIRECT needs {n}-byte alignment, more than the 4096 we support")),
        };
    }
    // No DIOALIGN (older kernel or filesystem): probe with a direct read at offset 0.
    for align in [512usize, 4096] {
        let mut buf = IoBuf::zeroed(align);
        // SAFETY: pread into a live buffer of `align` bytes.
        let r = unsafe { libc::pread(file.as_raw_fd(), buf.as_mut_ptr().cast(), align, 0) };
        if r >= 0 {
            return Ok(align as u32);
        }
        if errno().raw_os_error() != Some(libc::EINVAL) {
            return Ok(align as u32); // not an alignment problem; let real I/O report it
        }
    }
    Err("O_DIRECT reads fail even at 4096-byte alignment".to_string())
}

fn file_topology(
    file: &File,
    meta: &std::fs::Metadata,
    direct: bool,
    read_only: bool,
) -> io::Result<(Topology, usize)> {
    let (logical, mem_align) = if direct {
        let logical = direct_offset_align(file).unwrap_or(4096).max(512);
        let mem = statx_dio(file).map(|d| d.mem_bytes as usize).filter(|&m| m > 0).unwrap_or(logical as usize);
        (logical, mem)
    } else {
        (512, 1)
    };
    // SAFETY: fstatfs on a valid fd into a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let fs_block = if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0 { st.f_bsize as u32 } else { 4096 };
    let size_bytes = meta.len() - meta.len() % u64::from(logical);
    let topology = Topology {
        size_bytes,
        logical_block_bytes: logical,
        physical_block_bytes: 4096,
        optimal_io_bytes: 4096,
        max_io_bytes: MAX_IO_BYTES,
        supports_fua: true,
        volatile_cache: true,
        supports_discard: !read_only,
        supports_write_zeroes: !read_only,
        discard_granularity_bytes: if read_only { 0 } else { fs_block.clamp(logical, 1 << 20) },
        rotational: false,
    };
    Ok((topology, mem_align))
}

fn ioctl_u64(file: &File, name: &str, req: libc::Ioctl, what: &str) -> io::Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: `req` is a read ioctl writing one u64 into `v`.
    if unsafe { libc::ioctl(file.as_raw_fd(), req, &mut v) } != 0 {
        return Err(with_context(errno(), format!("{name}: ioctl {what}")));
    }
    Ok(v)
}

fn ioctl_u32(file: &File, name: &str, req: libc::Ioctl, what: &str) -> io::Result<u32> {
    let mut v: libc::c_int = 0;
    // SAFETY: `req` is a read ioctl writing one int into `v`.
    if unsafe { libc::ioctl(file.as_raw_fd(), req, &mut v) } != 0 {
        return Err(with_context(errno(), format!("{name}: ioctl {what}")));
    }
    Ok(v.max(0) as u32)
}

/// Reads `/sys/dev/block/MAJ:MIN/queue/<attr>` (or the parent's queue for a partition).
fn sysfs_queue_attr(meta: &std::fs::Metadata, attr: &str) -> Option<String> {
    let rdev = meta.rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    for dir in ["queue", "../queue"] {
        let p = format!("/sys/dev/block/{major}:{minor}/{dir}/{attr}");
        if let Ok(s) = std::fs::read_to_string(&p) {
            return Some(s.trim().to_string());
        }
    }
    None
}

fn block_topology(
    file: &File,
    name: &str,
    meta: &std::fs::Metadata,
    direct: bool,
    read_only: bool,
) -> io::Result<(Topology, usize)> {
    let size = ioctl_u64(file, name, BLKGETSIZE64, "BLKGETSIZE64")?;
    let logical = ioctl_u32(file, name, libc::BLKSSZGET, "BLKSSZGET")?.max(512);
    let physical = ioctl_u32(file, name, libc::BLKPBSZGET, "BLKPBSZGET")?.max(logical);
    let optimal = ioctl_u32(file, name, libc::BLKIOOPT, "BLKIOOPT")?.max(4096);
    let attr_u64 = |a: &str| sysfs_queue_attr(meta, a).and_then(|s| s.parse::<u64>().ok());
    let volatile_cache = sysfs_queue_attr(meta, "write_cache").is_none_or(|s| s != "write through");
    let supports_fua = attr_u64("fua").is_some_and(|v| v != 0);
    let discard_max = attr_u64("discard_max_bytes").unwrap_or(u64::from(u32::MAX));
    let discard_gran = attr_u64("discard_granularity").unwrap_or(u64::from(logical)) as u32;
    let rotational = attr_u64("rotational").is_some_and(|v| v != 0);
    let supports_discard = !read_only && discard_max > 0;
    let mem_align = if direct {
        statx_dio(file).map(|d| d.mem_bytes as usize).filter(|&m| m > 0).unwrap_or(logical as usize)
    } else {
        1
    };
    let topology = Topology {
        size_bytes: size - size % u64::from(logical),
        logical_block_bytes: logical,
        physical_block_bytes: physical,
        optimal_io_bytes: optimal,
        max_io_bytes: MAX_IO_BYTES,
        supports_fua,
        volatile_cache,
        supports_discard,
        supports_write_zeroes: !read_only,
        discard_granularity_bytes: if supports_discard { discard_gran.max(logical) } else { 0 },
        rotational,
    };
    Ok((topology, mem_align))
}

/// Builds a ring for `queue_depth` requests. A thread ring (`thread_owned`) first tries
/// SINGLE_ISSUER + DEFER_TASKRUN (6.1+), so completions never interrupt the owner thread; every
/// ring falls back step by step to what the kernel supports. Returns the ring and whether
/// completions are deferred.
fn build_ring(queue_depth: u32, thread_owned: bool) -> io::Result<(IoUring, bool)> {
    let entries = queue_depth.next_power_of_two();
    if thread_owned {
        let deferred = IoUring::builder()
            .dontfork()
            .setup_submit_all()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_cqsize(entries * 2)
            .build(entries);
        if let Ok(r) = deferred {
            return Ok((r, true));
        }
    }
    // SUBMIT_ALL (5.18+) keeps submitting after one bad SQE; fall back without it.
    let with_all = IoUring::builder().dontfork().setup_submit_all().setup_cqsize(entries * 2).build(entries);
    match with_all {
        Ok(r) => Ok((r, false)),
        Err(_) => IoUring::builder().dontfork().setup_cqsize(entries * 2).build(entries).map(|r| (r, false)),
    }
}

//------------------------------------------------------------------------------------------------
// Rings: the shared one, and one per thread that asked for it

/// Per-thread ring table: which devices have a ring owned by this thread.
struct ThreadRings {
    enabled: bool,
    /// (device id, its ring on this thread; `None` = creating one failed, use the shared ring).
    rings: Vec<(u64, Option<Weak<Ring>>)>,
}

thread_local! {
    static THREAD_RINGS: RefCell<ThreadRings> = const { RefCell::new(ThreadRings { enabled: false, rings: Vec::new() }) };
}

/// Gives every [`FileDevice`] used from the calling thread a ring of its own on this thread
/// (created on first use), instead of the ring shared by all threads.
///
/// For a thread that drives its own *current-thread* tokio runtime (a data-path shard, one per
/// core): its submissions, completions and reaper then stay on this thread — no lock is
/// contended, no wake-up crosses threads, and the ring runs with SINGLE_ISSUER +
/// DEFER_TASKRUN (completions are collected when the thread enters the kernel anyway instead
/// of interrupting it). The queue-depth bound stays per device, across all rings. Elsewhere
/// (multi-thread runtimes, plain threads) this has no effect: the shared ring is used.
pub fn enable_thread_rings() {
    THREAD_RINGS.with(|t| t.borrow_mut().enabled = true);
}

/// Answers the requests whose completions are waiting on the calling thread's own rings (see
/// [`enable_thread_rings`]), without blocking; returns how many were answered. Rings with
/// nothing in flight or nothing pending cost a few atomic loads and no system call.
///
/// For a data-path thread's idle hook ([`tokio::runtime::Builder::on_thread_park`]): a thread
/// that checks this (and its sockets) for a short while before it sleeps answers a completion
/// at once instead of after an eventfd wake-up through epoll and the reaper task.
pub fn poll_thread_rings() -> usize {
    THREAD_RINGS.with(|t| {
        let Ok(t) = t.try_borrow() else { return 0 };
        let mut answered = 0;
        for ring in t.rings.iter().filter_map(|(_, w)| w.as_ref()?.upgrade()) {
            if ring.inflight.load(Ordering::Acquire) == 0 || !ring.has_completions() {
                continue;
            }
            // The reaper task may hold the CQ; then it is answering them already.
            answered += ring.reap_nonblocking();
        }
        answered
    })
}

enum Lookup {
    Shared,
    Found(Option<Arc<Ring>>),
    Missing,
}

impl Shared {
    /// The topology with the current size.
    fn current_topology(&self) -> Topology {
        Topology { size_bytes: self.size_bytes.load(Ordering::Acquire), ..self.topology }
    }

    /// Every live ring of the device (the shared one first).
    fn rings(&self) -> Vec<Arc<Ring>> {
        let mut v = vec![self.default_ring.clone()];
        v.extend(self.thread_rings.lock().iter().filter_map(Weak::upgrade));
        v
    }

    /// The ring this thread submits to.
    fn ring(self: &Arc<Self>) -> Arc<Ring> {
        if !self.default_ring.reaper_alive.load(Ordering::Acquire) {
            // The opening runtime is gone: fail the documented way (see `op_error`).
            return self.default_ring.clone();
        }
        let lookup = THREAD_RINGS.with(|t| {
            let Ok(t) = t.try_borrow() else { return Lookup::Shared };
            if !t.enabled {
                return Lookup::Shared;
            }
            match t.rings.iter().find(|(id, _)| *id == self.id) {
                Some((_, Some(w))) => Lookup::Found(w.upgrade()),
                Some((_, None)) => Lookup::Shared,
                None => Lookup::Missing,
            }
        });
        match lookup {
            Lookup::Shared => self.default_ring.clone(),
            Lookup::Found(Some(r)) if r.reaper_alive.load(Ordering::Acquire) => r,
            Lookup::Found(_) | Lookup::Missing => self.start_thread_ring().unwrap_or_else(|| self.default_ring.clone()),
        }
    }

    /// Creates this thread's ring for the device (only on a current-thread runtime, whose
    /// reaper then runs on this very thread).
    fn start_thread_ring(self: &Arc<Self>) -> Option<Arc<Ring>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
            self.remember_thread_ring(None);
            return None;
        }
        let name = format!("{} (thread ring)", self.name);
        match Ring::start(name, self.file.as_raw_fd(), self.queue_depth, true, &runtime, self.counters.clone()) {
            Ok(ring) => {
                let mut all = self.thread_rings.lock();
                all.retain(|w| w.strong_count() > 0);
                all.push(Arc::downgrade(&ring));
                drop(all);
                self.remember_thread_ring(Some(Arc::downgrade(&ring)));
                Some(ring)
            }
            Err(e) => {
                tracing::warn!(device = %self.name, "no io_uring of its own for this thread, using the shared one: {e}");
                self.remember_thread_ring(None);
                None
            }
        }
    }

    fn remember_thread_ring(&self, ring: Option<Weak<Ring>>) {
        THREAD_RINGS.with(|t| {
            let Ok(mut t) = t.try_borrow_mut() else { return };
            // Forget rings that are gone (their device was dropped or their runtime ended).
            t.rings.retain(|(id, w)| *id != self.id && w.as_ref().is_none_or(|w| w.strong_count() > 0));
            t.rings.push((self.id, ring));
        });
    }

    /// Submits one SQE carrying `keep` and waits for its completion; returns the CQE result
    /// (bytes or -errno) and the buffer. `build` receives the buffer after it has moved into its
    /// in-flight record, so pointers taken from it stay valid until the CQE.
    ///
    /// The SQE goes to the kernel at once, or — when the calling thread holds a
    /// [`Plug`](crate::plug::Plug) — when that plug ends, together with the others queued
    /// meanwhile (one `io_uring_enter` for the batch).
    async fn submit(self: &Arc<Self>, keep: Keep, build: impl FnOnce(&Keep) -> squeue::Entry) -> (i32, Keep) {
        if !self.default_ring.reaper_alive.load(Ordering::Acquire) {
            // Nobody would ever reap the completion: fail instead of waiting forever.
            return (-libc::ESHUTDOWN, keep);
        }
        let permit = match self.permits.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) => return (-libc::ESHUTDOWN, keep), // the semaphore is never closed
        };
        // Chosen after the permit: the ring of the thread that pushes the SQE.
        let ring = self.ring();
        if !ring.reaper_alive.load(Ordering::Acquire) {
            return (-libc::ESHUTDOWN, keep);
        }
        let (reply, rx) = oneshot::channel();
        let record = Box::new(InFlight { keep, reply, _permit: permit });
        let entry = build(&record.keep);
        let ptr = Box::into_raw(record);
        let entry = entry.user_data(ptr as u64);
        ring.inflight.fetch_add(1, Ordering::AcqRel);
        let queued = {
            let _sq = ring.sq_lock.lock();
            // SAFETY: `sq_lock` is held, so this is the only SubmissionQueue in existence.
            let mut sq = unsafe { ring.ring.submission_shared() };
            // SAFETY: the entry's buffer lives in the in-flight record, which is freed only by
            // the reaper after the CQE (or by the drain in `Drop`).
            let r = unsafe { sq.push(&entry) };
            sq.sync();
            r.map(|()| sq.len())
        };
        let Ok(queued) = queued else {
            // Invariant: in-flight <= queue_depth <= SQ entries, so the push cannot fail.
            ring.inflight.fetch_sub(1, Ordering::AcqRel);
            // SAFETY: the entry was not pushed; we still own the record.
            let record = unsafe { Box::from_raw(ptr) };
            return (-libc::EBUSY, record.keep);
        };
        if !plug::defer(&ring, queued) {
            ring.submit_now();
        }
        drop(ring);
        // From here on the request belongs to the ring: dropping this future only drops `rx`.
        match rx.await {
            Ok(done) => done,
            Err(_) => (-libc::ESHUTDOWN, Keep::None),
        }
    }

    fn fd(&self) -> types::Fixed {
        types::Fixed(0)
    }

    /// `pread` until `buf` is full, on the caller's thread (memory-backed files only).
    fn read_inline(&self, offset_bytes: u64, buf: &mut [u8]) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        self.transfer_inline(IoOp::Read, offset_bytes, buf.len(), |done, pos| {
            // SAFETY: pread into the unfilled tail of a live, exclusively borrowed buffer.
            unsafe { libc::pread(fd, buf[done..].as_mut_ptr().cast(), buf.len() - done, pos as libc::off_t) }
        })
    }

    /// `pwritev2` (RWF_DSYNC for FUA) until all of `data` is written, on the caller's thread
    /// (memory-backed files only).
    fn write_inline(&self, offset_bytes: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let (fd, rw_flags) = (self.file.as_raw_fd(), if fua { libc::RWF_DSYNC } else { 0 });
        self.transfer_inline(IoOp::Write, offset_bytes, data.len(), |done, pos| {
            let iov = libc::iovec { iov_base: data[done..].as_ptr().cast_mut().cast(), iov_len: data.len() - done };
            // SAFETY: one iovec over the unwritten tail of a live buffer; the kernel only reads it.
            unsafe { libc::pwritev2(fd, &iov, 1, pos as libc::off_t, rw_flags) }
        })
    }

    /// Calls `step(done, position)` (one synchronous read or write of the remaining bytes) until
    /// `len` bytes moved, retrying EINTR/EAGAIN like the ring path.
    fn transfer_inline(
        &self,
        op: IoOp,
        offset_bytes: u64,
        len: usize,
        mut step: impl FnMut(usize, u64) -> isize,
    ) -> io::Result<()> {
        let (mut done, mut retries) = (0usize, 0);
        while done < len {
            match step(done, offset_bytes + done as u64) {
                n if n > 0 => done += n as usize,
                0 => return Err(self.no_progress_error(op, offset_bytes, len, done)),
                _ => {
                    let e = errno().raw_os_error().unwrap_or(libc::EIO);
                    if (e == libc::EINTR || e == libc::EAGAIN) && retries < MAX_RETRIES {
                        retries += 1;
                        continue;
                    }
                    return Err(self.op_error(op, offset_bytes, len as u64, -e));
                }
            }
        }
        Ok(())
    }

    /// A read that hit the end of the file, or a write that moved nothing, after `done` bytes.
    fn no_progress_error(&self, op: IoOp, offset_bytes: u64, len: usize, done: usize) -> io::Error {
        let (kind, what) = match op {
            IoOp::Read => (IoErrorKind::ShortRead, "end of file"),
            _ => (IoErrorKind::ShortWrite, "no progress"),
        };
        DeviceError::new(kind, &self.name, op, offset_bytes, len as u64)
            .detail(format!("{what} after {done} bytes"))
            .into()
    }

    /// `fdatasync` on the caller's thread (memory-backed files only).
    fn flush_inline(&self) -> io::Result<()> {
        let mut retries = 0;
        loop {
            // SAFETY: fdatasync on the device's own open fd.
            if unsafe { libc::fdatasync(self.file.as_raw_fd()) } == 0 {
                return Ok(());
            }
            let e = errno().raw_os_error().unwrap_or(libc::EIO);
            if e == libc::EINTR && retries < MAX_RETRIES {
                retries += 1;
                continue;
            }
            return Err(self.op_error(IoOp::Flush, 0, 0, -e));
        }
    }

    /// A regular file cut below the size it was opened with (someone truncated it): a flush
    /// fails, because the writes past the new end that the file took back as holes are not
    /// durable (a write there extends the file again; its hole reads zeros). Checked at each
    /// flush, one fstat.
    fn check_not_truncated(&self) -> io::Result<()> {
        if self.kind != Kind::RegularFile {
            return Ok(());
        }
        let expected = self.size_bytes.load(Ordering::Acquire);
        let now = self.file.metadata().map_err(|e| with_context(e, &self.name))?.len();
        if now >= expected {
            return Ok(());
        }
        Err(DeviceError::new(IoErrorKind::Eio, &self.name, IoOp::Flush, 0, 0)
            .detail(format!("the file was truncated to {now} bytes under the open device ({expected} expected)"))
            .into())
    }

    fn op_error(&self, op: IoOp, offset_bytes: u64, len_bytes: u64, res: i32) -> io::Error {
        if res == -libc::ESHUTDOWN && !self.default_ring.reaper_alive.load(Ordering::Acquire) {
            return DeviceError::new(IoErrorKind::Closed, &self.name, op, offset_bytes, len_bytes)
                .detail("the tokio runtime that opened the device has shut down (its completion reaper is gone)")
                .into();
        }
        DeviceError::errno(&self.name, op, offset_bytes, len_bytes, -res).into()
    }

    fn read_only_error(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Error {
        DeviceError::new(IoErrorKind::ReadOnly, &self.name, op, offset_bytes, len_bytes)
            .detail("device opened read-only")
            .into()
    }

    fn misaligned(&self, ptr: *const u8) -> bool {
        self.direct && !(ptr as usize).is_multiple_of(self.mem_align_bytes)
    }
}

//------------------------------------------------------------------------------------------------
// Submission and completion on one ring

impl Ring {
    /// Creates a ring with the file registered and an eventfd for completions, and spawns its
    /// reaper on `runtime`.
    fn start(
        name: String,
        fd: RawFd,
        queue_depth: u32,
        thread_owned: bool,
        runtime: &tokio::runtime::Handle,
        counters: Arc<Counters>,
    ) -> io::Result<Arc<Ring>> {
        let (ring, deferred_taskrun) =
            build_ring(queue_depth, thread_owned).map_err(|e| with_context(e, format!("{name}: io_uring setup")))?;
        ring.submitter()
            .register_files(&[fd])
            .map_err(|e| with_context(e, format!("{name}: io_uring register_files")))?;
        // SAFETY: eventfd(2) with valid flags; the result is checked before use.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(with_context(errno(), format!("{name}: eventfd")));
        }
        // SAFETY: `efd` is a fresh descriptor owned by nobody else.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        ring.submitter()
            .register_eventfd(efd.as_raw_fd())
            .map_err(|e| with_context(e, format!("{name}: io_uring register_eventfd")))?;
        let efd = {
            let _enter = runtime.enter();
            // SAFETY: `efd` is an OwnedFd, so its descriptor stays open and unchanged for the
            // AsyncFd's whole life.
            unsafe { AsyncFd::register_with_interest(efd, tokio::io::Interest::READABLE) }.map_err(|e| {
                with_context(e.into_parts().1, format!("{name}: registering the completion eventfd with tokio"))
            })?
        };
        let ring = Arc::new(Ring {
            name,
            ring,
            deferred_taskrun,
            owner: thread_owned.then(|| std::thread::current().id()),
            sq_lock: Mutex::new(()),
            cq_lock: Mutex::new(()),
            inflight: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            submit_retry: AtomicBool::new(false),
            enter_failures: AtomicUsize::new(0),
            reaper_alive: AtomicBool::new(true),
            wake_reaper: Notify::new(),
            counters,
        });
        runtime.spawn(reap_loop(ring.clone(), efd, ReaperAlive(ring.clone())));
        Ok(ring)
    }

    /// SQEs pushed and not yet consumed by the kernel.
    fn queued_sqes(&self) -> usize {
        let _sq = self.sq_lock.lock();
        // SAFETY: `sq_lock` is held, so this is the only SubmissionQueue in existence.
        unsafe { self.ring.submission_shared() }.len()
    }

    /// Flags for an `io_uring_enter` that submits: on a deferred ring also GETEVENTS (with no
    /// minimum), so the same syscall posts whatever completed meanwhile.
    fn enter_flags(&self) -> u32 {
        if self.deferred_taskrun { IORING_ENTER_GETEVENTS } else { 0 }
    }

    /// Submits every queued SQE with `io_uring_enter`, without blocking. Whatever cannot be
    /// submitted now (EAGAIN/EBUSY, or an unexpected error) is left in the SQ and handed to the
    /// reaper, which retries with a back-off; the requests stay in flight either way.
    fn submit_now(&self) {
        // Bounded: each round either submits something or hands over to the reaper.
        for _ in 0..8 {
            let to_submit = self.queued_sqes();
            if to_submit == 0 {
                return;
            }
            // SAFETY: io_uring_enter on our own ring, no minimum wait, no argument pointer.
            let r =
                unsafe { self.ring.submitter().enter::<libc::sigset_t>(to_submit as u32, 0, self.enter_flags(), None) };
            match r {
                Ok(n) if n > 0 => {
                    self.counters.enter_calls.fetch_add(1, Ordering::Relaxed);
                    self.counters.sqes_submitted.fetch_add(n as u64, Ordering::Relaxed);
                    if n >= to_submit {
                        return;
                    }
                    // Without SUBMIT_ALL, an SQE failing at submit ends the batch; go again.
                }
                Ok(_) => return self.hand_submission_to_reaper(None),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return self.hand_submission_to_reaper(Some(e)),
            }
        }
        if self.queued_sqes() > 0 {
            self.hand_submission_to_reaper(None);
        }
    }

    fn hand_submission_to_reaper(&self, error: Option<io::Error>) {
        let n = self.enter_failures.fetch_add(1, Ordering::Relaxed);
        if let Some(e) = error {
            let transient = matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY));
            if !transient && n.is_power_of_two() {
                tracing::error!(device = %self.name, failures = n + 1, "io_uring_enter failed: {e}; retrying");
            }
        }
        self.submit_retry.store(true, Ordering::Release);
        self.wake_reaper.notify_one();
    }

    /// Reaps the CQ if completions are waiting and nobody else is reaping: used after a plugged
    /// submission, so requests that finished meanwhile are answered without waiting for the
    /// reaper task's wake-up.
    fn reap_if_ready(&self) {
        if let Some(cq) = self.cq_lock.try_lock() {
            self.reap_locked(cq);
        }
    }

    /// Posts deferred completions (deferred rings only; on the owner thread), then drains the
    /// CQ, answering every waiter. Returns how many completions were reaped.
    fn reap(&self) -> usize {
        self.reap_holding(self.cq_lock.lock())
    }

    /// Deferred rings: whether completions wait as task work (IORING_SQ_TASKRUN, which the
    /// kernel sets because the ring was set up with IORING_SETUP_TASKRUN_FLAG and clears when the
    /// work ran) — when not, a GETEVENTS enter would find nothing, and the system call is saved.
    fn taskrun_pending(&self) -> bool {
        let _sq = self.sq_lock.lock();
        // SAFETY: `sq_lock` is held, so this is the only SubmissionQueue in existence.
        unsafe { self.ring.submission_shared() }.taskrun()
    }

    /// Whether completions are waiting: posted in the CQ, or (deferred rings) held as task work
    /// that the owner's next GETEVENTS enter posts (IORING_SQ_TASKRUN, set through
    /// IORING_SETUP_TASKRUN_FLAG). Reads the rings' shared flags and indices only.
    /// `false` when another caller holds a queue (it is submitting or reaping right now).
    fn has_completions(&self) -> bool {
        {
            let Some(_cq) = self.cq_lock.try_lock() else { return false };
            // SAFETY: `cq_lock` is held, so this is the only CompletionQueue in existence.
            if !unsafe { self.ring.completion_shared() }.is_empty() {
                return true;
            }
        }
        if !self.deferred_taskrun {
            return false;
        }
        let Some(_sq) = self.sq_lock.try_lock() else { return false };
        // SAFETY: `sq_lock` is held, so this is the only SubmissionQueue in existence.
        unsafe { self.ring.submission_shared() }.taskrun()
    }

    /// `reap`, unless another caller is reaping this ring right now.
    fn reap_nonblocking(&self) -> usize {
        self.cq_lock.try_lock().map_or(0, |cq| self.reap_holding(cq))
    }

    /// `reap` with the CQ already held.
    fn reap_holding(&self, cq: MutexGuard<'_, ()>) -> usize {
        if self.deferred_taskrun && self.taskrun_pending() {
            self.run_deferred_completions();
        }
        self.reap_locked(cq)
    }

    fn run_deferred_completions(&self) {
        if self.owner != Some(std::thread::current().id()) {
            // Only the owner may run them; its own enters and reaper will.
            return;
        }
        for _ in 0..4 {
            // SAFETY: io_uring_enter(0, 0, GETEVENTS) on our own ring: runs deferred task work.
            match unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 0, IORING_ENTER_GETEVENTS, None) } {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => tracing::debug!(device = %self.name, "io_uring_enter(GETEVENTS): {e}"),
                Ok(_) => {}
            }
            return;
        }
    }

    fn reap_locked(&self, _cq: MutexGuard<'_, ()>) -> usize {
        // SAFETY: `cq_lock` is held (`_cq`), so this is the only CompletionQueue in existence.
        let mut cq = unsafe { self.ring.completion_shared() };
        let mut n = 0;
        loop {
            cq.sync();
            let Some(cqe) = cq.next() else { break };
            n += 1;
            // SAFETY: every SQE we push carries a pointer from `Box::into_raw(InFlight)`, and
            // each CQE is seen exactly once.
            let record = unsafe { Box::from_raw(cqe.user_data() as *mut InFlight) };
            let InFlight { keep, reply, _permit } = *record;
            // Count the request done and free its queue slot before waking the waiter: whoever
            // sees the completion must also see `in_flight()` without it.
            self.inflight.fetch_sub(1, Ordering::AcqRel);
            drop(_permit);
            // A dropped waiter drops the buffer here, after the kernel is done with it.
            let _ = reply.send((cqe.result(), keep));
        }
        n
    }

    /// io_uring_enter until the SQ is empty, retrying transient errors (the reaper's retry path).
    async fn enter(&self) -> io::Result<()> {
        for attempt in 0..MAX_RETRIES {
            match self.ring.submit() {
                Ok(n) => {
                    if n > 0 {
                        self.counters.enter_calls.fetch_add(1, Ordering::Relaxed);
                        self.counters.sqes_submitted.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    if self.queued_sqes() == 0 {
                        return Ok(());
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                    // EBUSY: the CQ must be drained before the kernel takes more.
                    self.reap();
                    if attempt > 10 {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    } else {
                        tokio::task::yield_now().await;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(io::ErrorKind::TimedOut, "io_uring_enter kept returning EAGAIN/EBUSY"))
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The reaper is gone (it held an Arc). Wait for whatever the kernel still owns.
        let mut stuck = 0;
        while self.inflight.load(Ordering::Acquire) > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => {
                    stuck += 1;
                    if stuck > 100 {
                        // Leaking the in-flight records is memory-safe; freeing them is not.
                        tracing::error!(device = %self.name, "giving up draining io_uring on close: {e}");
                        return;
                    }
                }
            }
            self.reap_locked(self.cq_lock.lock());
        }
    }
}

/// Marks the reaper dead when its task ends or is dropped with its runtime.
struct ReaperAlive(Arc<Ring>);

impl Drop for ReaperAlive {
    fn drop(&mut self) {
        self.0.reaper_alive.store(false, Ordering::Release);
    }
}

impl PlugTarget for Ring {
    fn submit_queued(&self) {
        self.submit_now();
        self.reap_if_ready();
    }

    fn plug_key(&self) -> usize {
        self as *const Ring as usize
    }
}

/// `alive` is an argument (not created inside) so that it is dropped with the task even when the
/// runtime shuts down before the task was ever polled.
async fn reap_loop(ring: Arc<Ring>, efd: AsyncFd<OwnedFd>, alive: ReaperAlive) {
    let _alive = alive;
    if ring.owner.is_some_and(|o| o != std::thread::current().id()) {
        tracing::error!(device = %ring.name, "thread ring reaper runs on another thread than its owner");
    }
    let mut retry_backoff_ms = 0u64;
    loop {
        ring.reap();
        if ring.submit_retry.swap(false, Ordering::AcqRel) {
            match ring.enter().await {
                Ok(()) => retry_backoff_ms = 0,
                Err(e) => {
                    retry_backoff_ms = (retry_backoff_ms * 2).clamp(1, 100);
                    tracing::error!(device = %ring.name, "io_uring_enter: {e}; retrying in {retry_backoff_ms} ms");
                    ring.submit_retry.store(true, Ordering::Release);
                }
            }
        }
        if ring.closing.load(Ordering::Acquire) {
            if ring.inflight.load(Ordering::Acquire) == 0 {
                return;
            }
            // A waiter dropped between push and io_uring_enter may have left an SQE behind.
            let _ = ring.ring.submit();
        }
        let retry = ring.submit_retry.load(Ordering::Acquire);
        tokio::select! {
            ready = efd.readable() => {
                let Ok(mut guard) = ready else {
                    tracing::error!(device = %ring.name, "completion eventfd failed; stopping the reaper");
                    return;
                };
                // The eventfd is registered edge-triggered: every signal from the ring is a new
                // event, whether or not its counter was read, so the counter is never read (one
                // syscall less per wake-up; it cannot overflow in practice, 2^64 signals). The
                // readiness is cleared *before* the CQ is drained at the top of the loop, and only
                // if no newer event arrived, so no completion can be missed.
                guard.clear_ready();
            }
            _ = ring.wake_reaper.notified() => {}
            _ = tokio::time::sleep(std::time::Duration::from_millis(retry_backoff_ms)), if retry => {}
        }
    }
}

//------------------------------------------------------------------------------------------------
// Operations

impl FileDevice {
    async fn do_read(&self, offset_bytes: u64, buf: IoBuf) -> ReadResult {
        let s = &self.shared;
        let len = buf.len();
        let checked = check_io(&s.name, &s.current_topology(), IoOp::Read, offset_bytes, len as u64)
            .and_then(|()| s.sticky.check_io(&s.name, IoOp::Read, offset_bytes, len as u64));
        if let Err(e) = checked {
            return (buf, Err(e));
        }
        if len == 0 {
            return (buf, Ok(()));
        }
        if s.inline_copy && len <= INLINE_COPY_MAX_BYTES {
            let mut buf = buf;
            let r = s.read_inline(offset_bytes, buf.as_mut_slice());
            return (buf, r);
        }
        let (mut work, original) =
            if s.misaligned(buf.as_slice().as_ptr()) { (IoBuf::uninit_contents(len), Some(buf)) } else { (buf, None) };
        let mut done = 0usize;
        let mut retries = 0;
        let result = loop {
            let pos = offset_bytes + done as u64;
            let want = (len - done) as u32;
            let (res, keep) = s
                .submit(Keep::Read(work), |k| {
                    let Keep::Read(b) = k else { unreachable!("read keeps an IoBuf") };
                    // SAFETY: `done < len`, inside the buffer.
                    let p = unsafe { b.as_slice().as_ptr().add(done) }.cast_mut();
                    opcode::Read::new(s.fd(), p, want).offset(pos).build()
                })
                .await;
            work = match keep {
                Keep::Read(b) => b,
                _ => IoBuf::zeroed(len),
            };
            match res {
                n if n > 0 => {
                    done += n as usize;
                    if done >= len {
                        break Ok(());
                    }
                }
                0 => break Err(s.no_progress_error(IoOp::Read, offset_bytes, len, done)),
                e if (e == -libc::EINTR || e == -libc::EAGAIN) && retries < MAX_RETRIES => retries += 1,
                e => break Err(s.op_error(IoOp::Read, offset_bytes, len as u64, e)),
            }
        };
        match original {
            Some(mut orig) => {
                if result.is_ok() {
                    orig.as_mut_slice().copy_from_slice(work.as_slice());
                }
                (orig, result)
            }
            None => (work, result),
        }
    }

    async fn do_write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> io::Result<()> {
        let s = &self.shared;
        let len = buf.len();
        check_io(&s.name, &s.current_topology(), IoOp::Write, offset_bytes, len as u64)?;
        s.sticky.check_io(&s.name, IoOp::Write, offset_bytes, len as u64)?;
        if flags.fua {
            s.sticky.check_durable(&s.name, IoOp::Write, offset_bytes, len as u64)?;
        }
        if s.read_only {
            return Err(s.read_only_error(IoOp::Write, offset_bytes, len as u64));
        }
        if len == 0 {
            return if flags.fua { self.do_flush().await } else { Ok(()) };
        }
        let written = self.write_checked(offset_bytes, buf, flags).await;
        if flags.fua
            && let Err(e) = &written
        {
            // Its RWF_DSYNC may have taken (and so cleared) the file's writeback error.
            s.sticky.flush_failed(e);
        }
        written
    }

    /// [`FileDevice::do_write`] of a validated, non-empty request.
    async fn write_checked(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> io::Result<()> {
        let s = &self.shared;
        let len = buf.len();
        if s.inline_copy && len <= INLINE_COPY_MAX_BYTES {
            return s.write_inline(offset_bytes, buf.as_slice(), flags.fua);
        }
        let mut work = if s.misaligned(buf.as_ptr()) { IoBuf::from_slice(buf.as_slice()).freeze() } else { buf };
        let rw_flags = if flags.fua { libc::RWF_DSYNC } else { 0 };
        let mut done = 0usize;
        let mut retries = 0;
        loop {
            let pos = offset_bytes + done as u64;
            let want = (len - done) as u32;
            let (res, keep) = s
                .submit(Keep::Write(work), |k| {
                    let Keep::Write(b) = k else { unreachable!("write keeps a SharedBuf") };
                    // SAFETY: `done < len`, inside the buffer.
                    let p = unsafe { b.as_ptr().add(done) };
                    opcode::Write::new(s.fd(), p, want).offset(pos).rw_flags(rw_flags).build()
                })
                .await;
            work = match keep {
                Keep::Write(b) => b,
                _ => return Err(s.op_error(IoOp::Write, offset_bytes, len as u64, res.min(-1))),
            };
            match res {
                n if n > 0 => {
                    done += n as usize;
                    if done >= len {
                        return Ok(());
                    }
                }
                0 => return Err(s.no_progress_error(IoOp::Write, offset_bytes, len, done)),
                e if (e == -libc::EINTR || e == -libc::EAGAIN) && retries < MAX_RETRIES => retries += 1,
                e => return Err(s.op_error(IoOp::Write, offset_bytes, len as u64, e)),
            }
        }
    }

    async fn do_flush(&self) -> io::Result<()> {
        let s = &self.shared;
        s.sticky.check_durable(&s.name, IoOp::Flush, 0, 0)?;
        let flushed = match &s.flusher {
            Some(b) => b.flush(|| self.flush_once()).await,
            None => self.flush_once().await,
        };
        if let Err(e) = flushed {
            s.sticky.flush_failed(&e);
            return Err(e);
        }
        s.check_not_truncated().inspect_err(|e| s.sticky.truncated(e))
    }

    /// One `fdatasync` of the file (or a block device's cache flush).
    async fn flush_once(&self) -> io::Result<()> {
        let s = &self.shared;
        if s.inline_copy {
            return s.flush_inline();
        }
        let mut retries = 0;
        loop {
            let (res, _) =
                s.submit(Keep::None, |_| opcode::Fsync::new(s.fd()).flags(types::FsyncFlags::DATASYNC).build()).await;
            match res {
                r if r >= 0 => return Ok(()),
                e if (e == -libc::EINTR || e == -libc::EAGAIN) && retries < MAX_RETRIES => retries += 1,
                e => return Err(s.op_error(IoOp::Flush, 0, 0, e)),
            }
        }
    }

    async fn fallocate(&self, offset_bytes: u64, len_bytes: u64, mode: i32) -> Result<(), i32> {
        let s = &self.shared;
        let mut retries = 0;
        loop {
            let (res, _) = s
                .submit(Keep::None, |_| {
                    opcode::Fallocate::new(s.fd(), len_bytes).offset(offset_bytes).mode(mode).build()
                })
                .await;
            match res {
                r if r >= 0 => return Ok(()),
                e if (e == -libc::EINTR || e == -libc::EAGAIN) && retries < MAX_RETRIES => retries += 1,
                e => return Err(e),
            }
        }
    }

    /// Runs a block-device ioctl taking a `[start, len]` range on the blocking pool, under a
    /// queue permit.
    async fn range_ioctl(&self, op: IoOp, req: libc::Ioctl, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        let s = self.shared.clone();
        let permit = s
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| s.op_error(op, offset_bytes, len_bytes, -libc::ESHUTDOWN))?;
        let s2 = s.clone();
        let res = tokio::task::spawn_blocking(move || {
            // The permit stays with the ioctl even if the caller stops waiting.
            let _permit = permit;
            let range: [u64; 2] = [offset_bytes, len_bytes];
            // SAFETY: BLKDISCARD/BLKZEROOUT read a `[u64; 2]` range from the pointer.
            let r = unsafe { libc::ioctl(s2.file.as_raw_fd(), req, range.as_ptr()) };
            if r == 0 { 0 } else { -errno().raw_os_error().unwrap_or(libc::EIO) }
        })
        .await
        .unwrap_or(-libc::EIO);
        if res == 0 { Ok(()) } else { Err(s.op_error(op, offset_bytes, len_bytes, res)) }
    }

    async fn do_discard(&self, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        let s = &self.shared;
        check_io(&s.name, &s.current_topology(), IoOp::Discard, offset_bytes, len_bytes)?;
        if s.read_only {
            return Err(s.read_only_error(IoOp::Discard, offset_bytes, len_bytes));
        }
        if len_bytes == 0 {
            return Ok(());
        }
        match s.kind {
            Kind::BlockDevice => {
                if !s.topology.supports_discard {
                    return Ok(()); // advisory: nothing to do on a device without discard
                }
                match self.range_ioctl(IoOp::Discard, BLKDISCARD, offset_bytes, len_bytes).await {
                    Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
                    r => r,
                }
            }
            Kind::RegularFile => {
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                match self.fallocate(offset_bytes, len_bytes, mode).await {
                    Ok(()) => Ok(()),
                    // Discard is advisory: a filesystem that cannot punch keeps the data.
                    Err(e) if e == -libc::EOPNOTSUPP => Ok(()),
                    Err(e) => Err(s.op_error(IoOp::Discard, offset_bytes, len_bytes, e)),
                }
            }
        }
    }

    async fn do_write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> io::Result<()> {
        let s = &self.shared;
        check_io(&s.name, &s.current_topology(), IoOp::WriteZeroes, offset_bytes, len_bytes)?;
        if s.read_only {
            return Err(s.read_only_error(IoOp::WriteZeroes, offset_bytes, len_bytes));
        }
        if len_bytes > 0 {
            match s.kind {
                Kind::BlockDevice => self.range_ioctl(IoOp::WriteZeroes, BLKZEROOUT, offset_bytes, len_bytes).await?,
                Kind::RegularFile => self.zero_file_range(offset_bytes, len_bytes, flags.no_unmap).await?,
            }
        }
        if flags.fua { self.do_flush().await } else { Ok(()) }
    }

    async fn zero_file_range(&self, offset_bytes: u64, len_bytes: u64, no_unmap: bool) -> io::Result<()> {
        let s = &self.shared;
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        let punch = libc::FALLOC_FL_PUNCH_HOLE | keep;
        let zero_range = libc::FALLOC_FL_ZERO_RANGE | keep;
        let unsupported = |e: i32| e == -libc::EOPNOTSUPP || e == -libc::EINVAL;
        let first = if no_unmap { zero_range } else { punch };
        match self.fallocate(offset_bytes, len_bytes, first).await {
            Ok(()) => return Ok(()),
            Err(e) if unsupported(e) => {}
            Err(e) => return Err(s.op_error(IoOp::WriteZeroes, offset_bytes, len_bytes, e)),
        }
        // tmpfs and others lack ZERO_RANGE: punch, then re-allocate to honour no_unmap.
        if no_unmap
            && self.fallocate(offset_bytes, len_bytes, punch).await.is_ok()
            && self.fallocate(offset_bytes, len_bytes, keep).await.is_ok()
        {
            return Ok(());
        }
        // Last resort: write zeroes.
        let zeroes = SharedBuf::zeroed(ZERO_CHUNK_BYTES);
        let mut pos = offset_bytes;
        let end = offset_bytes + len_bytes;
        while pos < end {
            let n = (end - pos).min(ZERO_CHUNK_BYTES as u64) as usize;
            self.do_write(pos, zeroes.slice(0..n), WriteFlags::NONE).await?;
            pos += n as u64;
        }
        Ok(())
    }
}

impl BlockDevice for FileDevice {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn topology(&self) -> Topology {
        self.shared.current_topology()
    }

    fn refresh_size(&self) -> io::Result<u64> {
        FileDevice::refresh_size(self)
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        Box::pin(self.do_read(offset_bytes, buf))
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_write(offset_bytes, buf, flags))
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_flush())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_discard(offset_bytes, len_bytes))
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_write_zeroes(offset_bytes, len_bytes, flags))
    }

    /// Regular files: holes by SEEK_DATA/SEEK_HOLE, in logical blocks, on the blocking pool
    /// (the filesystem may read its extent tree). Block devices cannot tell: all data.
    fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent>>> {
        let s = self.shared.clone();
        Box::pin(async move {
            check_status_range(&s.name, s.topology.size_bytes, offset_bytes, len_bytes)?;
            if s.kind != Kind::RegularFile || len_bytes == 0 {
                let all = if len_bytes == 0 { vec![] } else { vec![Extent { len_bytes, flags: ExtentFlags::DATA }] };
                return Ok(all);
            }
            let g = u64::from(s.topology.logical_block_bytes);
            let s2 = s.clone();
            tokio::task::spawn_blocking(move || {
                seek_extents(&s2.name, s2.file.as_raw_fd(), offset_bytes, len_bytes, g, max_extents)
            })
            .await
            .map_err(|e| io::Error::other(format!("{}: block status task failed: {e}", s.name)))?
        })
    }
}
