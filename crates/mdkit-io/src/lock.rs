//! One writer per device across processes: an exclusive advisory lock (`flock(LOCK_EX |
//! LOCK_NB)`) held for as long as a device is open for writing.
//!
//! Why `flock`: it is the convention for block devices (udev and systemd take a BSD lock on a
//! device node to keep it out of their hands while a tool works on it, and `flock(1)` lets a
//! script take the same lock), it is released by the kernel when the process dies (no stale
//! lock files to clean up after a crash), and it applies to regular files as well. POSIX
//! `fcntl` locks would not do: closing *any* descriptor of the file drops every lock the process
//! holds on it, and the service opens its devices more than once (signature probes, reassembly).
//!
//! `flock` locks belong to an open file description, so a second `open` by this same process
//! would conflict with the first. Within one process a device may legitimately be opened twice
//! (an array assembled again after a reshape, two file volumes on one image, a pool resized
//! while open): the second user *shares* the lock the first took. Keeping one process from
//! writing a device twice is the business of the layer above (mdkit's `in_use` checks); this
//! lock keeps *other processes* out: a second `mdkit serve`, or an offline tool that writes
//! (`thin check --clear-needs-check`, `thin restore`, `thin repair -o`, offline md create).
//!
//! The lock is taken on the device as opened (its inode): two names of one file (links, a
//! relative and an absolute path) are one lock. A loop device stores its data in its backing
//! file, so locking a loop device locks its backing file too: a service writing through
//! `/dev/loopN` keeps an offline tool off the file, and the other way round. Read-only users
//! take no lock.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

/// The identity of a locked inode: (file system device, inode).
type Key = (u64, u64);

/// The locks this process holds: one locked descriptor per inode and how many users share it.
struct Held {
    /// A duplicate of the first user's descriptor: the lock lives on its open file description.
    file: File,
    users: usize,
}

static HELD: LazyLock<Mutex<HashMap<Key, Held>>> = LazyLock::new(Default::default);

/// How long a lock held elsewhere is waited for before the device is refused. A process that
/// used a device through io_uring lets go of it some time *after* it exited: the kernel tears
/// its rings down (and drops their file references, the last of which releases the lock)
/// asynchronously, so a service restarted at once would find its own devices still locked.
/// A device really in use is refused after this wait.
const RELEASE_WAIT_MAX: Duration = Duration::from_secs(3);
const RELEASE_POLL: Duration = Duration::from_millis(10);

/// How a device is locked against other processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// `LOCK_EX`: no other process holds the device at all (md members, pool devices, offline
    /// writers).
    Exclusive,
    /// `LOCK_SH`: other processes may hold it shared too, never exclusively. For a plain file
    /// volume, a window on its file with no metadata of its own: two services may serve one
    /// image (the benchmarks' A/A control does), but no array, pool or offline tool writes it
    /// meanwhile.
    Shared,
}

/// A lock on a device, shared by every user in this process; released when the last
/// [`DeviceLock`] of the device is dropped (or the process ends).
#[derive(Debug)]
pub struct DeviceLock {
    key: Key,
    /// The lock of a loop device's backing file, taken with it.
    backing: Option<Box<DeviceLock>>,
}

/// The error of a device another process holds: kind `ResourceBusy`, naming the device.
pub fn busy_error(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::ResourceBusy,
        format!(
            "{name} is in use by another process: a running mdkit service has it open read-write \
             (or an offline mdkit tool is writing it)"
        ),
    )
}

/// Whether `e` is the refusal of a device another process holds ([`busy_error`]).
pub fn is_busy(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::ResourceBusy
}

impl DeviceLock {
    /// Takes (or, in this process, shares) the exclusive lock of the device open as `file`;
    /// `name` is for the error. A device another process holds is refused with [`busy_error`]
    /// once it has stayed held for [`RELEASE_WAIT_MAX`] (blocking the calling thread; on a
    /// multi-threaded tokio runtime its worker hands its other tasks over first).
    pub fn exclusive(file: &File, name: &str) -> io::Result<DeviceLock> {
        DeviceLock::take(file, name, LockMode::Exclusive)
    }

    /// [`DeviceLock::exclusive`] in either [`LockMode`].
    pub fn take(file: &File, name: &str, mode: LockMode) -> io::Result<DeviceLock> {
        let meta = file.metadata().map_err(|e| io::Error::new(e.kind(), format!("{name}: {e}")))?;
        let backing = match loop_backing(&meta) {
            Some(path) => DeviceLock::take_backing(&path, name, mode)?.map(Box::new),
            None => None,
        };
        let mut lock = DeviceLock::take_inode(file, &meta, name, mode)?;
        lock.backing = backing;
        Ok(lock)
    }

    /// The lock of loop device `name`'s backing file `path`; `None` when this process cannot
    /// open that path (the kernel names it as the process that set the loop device up saw it:
    /// inside a container, another mount namespace's path may not exist here).
    fn take_backing(path: &std::path::Path, name: &str, mode: LockMode) -> io::Result<Option<DeviceLock>> {
        let what = format!("{name} (backing file {})", path.display());
        let f = match File::open(path) {
            Ok(f) => f,
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied) => return Ok(None),
            Err(e) => return Err(io::Error::new(e.kind(), format!("{what}: {e}"))),
        };
        let meta = f.metadata().map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))?;
        DeviceLock::take_inode(&f, &meta, &what, mode).map(Some)
    }

    /// The lock of the inode open as `file` (`meta` its metadata).
    fn take_inode(file: &File, meta: &std::fs::Metadata, name: &str, mode: LockMode) -> io::Result<DeviceLock> {
        let key = (meta.dev(), meta.ino());
        let dup = file.try_clone().map_err(|e| io::Error::new(e.kind(), format!("{name}: {e}")))?;
        if DeviceLock::try_take(key, &dup, name, mode)? {
            return Ok(DeviceLock { key, backing: None });
        }
        blocking(|| {
            let start = Instant::now();
            loop {
                if start.elapsed() >= RELEASE_WAIT_MAX {
                    return Err(busy_error(name));
                }
                std::thread::sleep(RELEASE_POLL);
                if DeviceLock::try_take(key, &dup, name, mode)? {
                    return Ok(DeviceLock { key, backing: None });
                }
            }
        })
    }

    /// Shares this process's lock of `key`, or takes it on `dup`; `false` while another process
    /// holds it.
    fn try_take(key: Key, dup: &File, name: &str, mode: LockMode) -> io::Result<bool> {
        // The table stays locked across the flock: a user dropping the last share of this key
        // unlocks inside the table lock too, so the two never interleave.
        let mut held = HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(h) = held.get_mut(&key) {
            h.users += 1;
            return Ok(true);
        }
        let how = if mode == LockMode::Shared { libc::LOCK_SH } else { libc::LOCK_EX };
        // SAFETY: flock on a descriptor the caller owns, no memory involved.
        let r = unsafe { libc::flock(dup.as_raw_fd(), how | libc::LOCK_NB) };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Ok(false);
            }
            return Err(io::Error::new(e.kind(), format!("{name}: taking its lock: {e}")));
        }
        let file = dup.try_clone().map_err(|e| io::Error::new(e.kind(), format!("{name}: {e}")))?;
        held.insert(key, Held { file, users: 1 });
        Ok(true)
    }
}

/// The backing file of the loop device `meta` describes (`None` for anything else).
fn loop_backing(meta: &std::fs::Metadata) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    if !meta.file_type().is_block_device() {
        return None;
    }
    crate::loopdev::loop_backing_file(meta.rdev())
}

/// Runs `f`, which blocks its thread for a while: on a worker of a multi-threaded tokio runtime
/// the worker's other tasks move to another thread first (`block_in_place`), so a device open
/// waiting out another process's lock stalls no connection or request that shares the worker.
/// Elsewhere (a plain thread, a current-thread runtime) it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl Drop for DeviceLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(h) = held.get_mut(&self.key) else { return };
        h.users -= 1;
        if h.users == 0 {
            let h = held.remove(&self.key).expect("present above");
            // Unlocked explicitly: the description may outlive `h.file` in another descriptor
            // (the device's own, until its last in-flight request is reaped).
            // SAFETY: flock on a descriptor owned by `h`, no memory involved.
            unsafe { libc::flock(h.file.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `path` locked (`how`: LOCK_EX or LOCK_SH) on an open file description of its own, as
    /// another process would hold it; `None` when it cannot be locked.
    fn lock_elsewhere(path: &std::path::Path, how: i32) -> Option<File> {
        let f = File::open(path).unwrap();
        // SAFETY: flock on a descriptor owned here, no memory involved.
        let r = unsafe { libc::flock(f.as_raw_fd(), how | libc::LOCK_NB) };
        (r == 0).then_some(f)
    }

    /// Whether another process could lock `path` exclusively now.
    fn flock_nb(path: &std::path::Path) -> bool {
        lock_elsewhere(path, libc::LOCK_EX).is_some()
    }

    /// `path` locked (`how`) by "another process" (asserted free before).
    fn held_elsewhere(path: &std::path::Path, how: i32) -> File {
        lock_elsewhere(path, how).expect("the lock was free")
    }

    #[test]
    fn users_in_one_process_share_the_lock_and_the_last_releases_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        std::fs::write(&p, b"x").unwrap();
        let (a, b) = (File::open(&p).unwrap(), File::open(&p).unwrap());
        let la = DeviceLock::exclusive(&a, "dev").unwrap();
        let lb = DeviceLock::exclusive(&b, "dev").expect("a second open in this process shares the lock");
        assert!(!flock_nb(&p), "held against other open file descriptions");
        drop(la);
        drop(a);
        assert!(!flock_nb(&p), "still held by the second user");
        drop(lb);
        assert!(flock_nb(&p), "released with the last user");
    }

    #[test]
    fn a_device_locked_elsewhere_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        std::fs::write(&p, b"x").unwrap();
        // Another "process": a description locked outside the table.
        let other = held_elsewhere(&p, libc::LOCK_EX);
        let e = DeviceLock::exclusive(&File::open(&p).unwrap(), "/x/dev").unwrap_err();
        assert!(is_busy(&e) && e.to_string().contains("/x/dev is in use"), "{e}");
        drop(other);
        assert!(DeviceLock::exclusive(&File::open(&p).unwrap(), "dev").is_ok());
    }

    /// Waiting out a lock held elsewhere (up to RELEASE_WAIT_MAX) does not hold up the other
    /// tasks of the runtime worker that opens the device: with one worker, a task that needs
    /// it runs while the open still waits.
    #[test]
    fn waiting_for_a_lock_held_elsewhere_leaves_the_worker_to_other_tasks() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        std::fs::write(&p, b"x").unwrap();
        let other = held_elsewhere(&p, libc::LOCK_EX);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (started, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (s, d) = (started.clone(), done.clone());
        let ran_while_waiting = rt.block_on(async move {
            let other_task = tokio::spawn(async move {
                while !s.load(Ordering::Acquire) {
                    tokio::task::yield_now().await;
                }
                !d.load(Ordering::Acquire)
            });
            let (s, d) = (started.clone(), done.clone());
            let opener = tokio::spawn(async move {
                s.store(true, Ordering::Release);
                let r = DeviceLock::exclusive(&File::open(&p).unwrap(), "dev");
                d.store(true, Ordering::Release);
                r.map(drop)
            });
            let e = opener.await.unwrap().unwrap_err();
            assert!(is_busy(&e), "{e}");
            other_task.await.unwrap()
        });
        assert!(ran_while_waiting, "the other task ran only after the open gave up");
        drop(other);
    }

    /// A loop device's lock holds its backing file too, both ways.
    #[test]
    fn a_loop_device_and_its_backing_file_are_one_lock() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: loop devices need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
        let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(&p).output().unwrap();
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let detach = || drop(std::process::Command::new("losetup").args(["-d", &dev]).status());
        let lock = DeviceLock::exclusive(&File::open(&dev).unwrap(), &dev).unwrap();
        let held = !flock_nb(&p);
        drop(lock);
        let released = flock_nb(&p);
        // Another "process" holds the backing file: the loop device is refused, naming both.
        let other = held_elsewhere(&p, libc::LOCK_EX);
        let refused = DeviceLock::exclusive(&File::open(&dev).unwrap(), &dev);
        drop(other);
        // A backing path this process cannot open (renamed here; another mount namespace's
        // path in a container): the loop device is locked without it.
        std::fs::rename(&p, dir.path().join("moved")).unwrap();
        let unreachable_backing = DeviceLock::exclusive(&File::open(&dev).unwrap(), &dev).map(drop);
        detach();
        assert!(held, "locking {dev} left its backing file free for another process");
        assert!(released, "the backing file stayed locked after {dev}'s lock went");
        let e = refused.unwrap_err();
        assert!(is_busy(&e) && e.to_string().contains("backing file"), "{e}");
        unreachable_backing.expect("a loop device whose backing path is gone");
    }

    /// Shared holders (file volumes of two services on one image) let each other in and keep
    /// exclusive ones (an array, a pool, an offline writer) out; an exclusive holder keeps
    /// shared ones out.
    #[test]
    fn shared_locks_admit_each_other_and_refuse_exclusive_ones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("img");
        std::fs::write(&p, b"x").unwrap();
        let other = held_elsewhere(&p, libc::LOCK_SH);
        let f = File::open(&p).unwrap();
        let shared = DeviceLock::take(&f, "img", LockMode::Shared).expect("shared beside shared");
        assert!(!flock_nb(&p), "an exclusive lock elsewhere is refused");
        drop(shared);
        drop(other);
        let _other = held_elsewhere(&p, libc::LOCK_EX);
        let e = DeviceLock::take(&File::open(&p).unwrap(), "img", LockMode::Shared).unwrap_err();
        assert!(is_busy(&e), "{e}");
    }
}
