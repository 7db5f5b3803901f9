//! `WriteBackDevice`: acknowledge a plain write once the device has it queued, not once it is
//! done — the volatile write cache every disk has and every NBD server offers (nbdkit's file
//! plugin and qemu-nbd write into the page cache and answer at once), bounded and in user space.
//!
//! ```text
//!   write (no FUA) ──► check ──► admit: room (max_writes, max_bytes), no overlap with a
//!                                pending write (the older one lands first) ──► pending set
//!                      └──► poll the inner write once: the request is queued on the member
//!                           (under the NBD connection's plug: in the kernel before the reply)
//!                             ├─ finished at once (inline copy, refused)  → its own result
//!                             └─ still running → a task finishes it; Ok now
//!   read / discard / write_zeroes / FUA write ──► wait for overlapping pending writes ──► inner
//!   flush ──► wait until every write acknowledged before it has completed
//!             ──► a lost acknowledged write?  yes → error   no → inner flush
//! ```
//!
//! Contract (the [`BlockDevice`] one, with "completed" read as "acknowledged"):
//! - a read returns the newest acknowledged data for every block it covers (it waits for the
//!   overlapping pending writes; it never sees an older write overtaking a newer one, because
//!   overlapping writes are issued one after the other);
//! - a flush completes only when every write acknowledged before it was issued is on the
//!   device and the device flushed; FUA writes are written through;
//! - errors a write can report before it is queued (bounds, a read-only member, a stopped
//!   device) come back from the write itself. An acknowledged write that fails later is a
//!   **lost write**: it is logged, counted, and every later flush fails, naming it, until the
//!   device is opened again — a flush never reports success over data the client was told it
//!   had;
//! - at most `max_writes` writes and `max_bytes` bytes are pending; a write beyond that waits
//!   for room, so the window of acknowledged but unflushed data — what a power cut may lose,
//!   as with a disk's cache — stays bounded. A request is handed to the kernel before its
//!   answer leaves, so a killed process loses only what the kernel had not started yet (an
//!   O_DIRECT write that io_uring punted to a worker, e.g. into a hole of a sparse file, is
//!   cancelled with the ring): unflushed data, which the NBD contract lets a server lose.
//!
//! Without a tokio runtime to finish the write in, a write is written through.

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io};

/// Limits of the write-back window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBackOptions {
    /// Acknowledged writes that may be pending on the device at once.
    pub max_writes: usize,
    /// Bytes those writes may carry; a larger single write is written through.
    pub max_bytes: u64,
}

impl Default for WriteBackOptions {
    /// 64 writes, 16 MiB: the queue depth of a fast SSD, a few milliseconds of its bandwidth.
    fn default() -> WriteBackOptions {
        WriteBackOptions { max_writes: 64, max_bytes: 16 << 20 }
    }
}

/// Counters of a [`WriteBackDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteBackStats {
    /// Writes acknowledged while still running on the device.
    pub acknowledged_early: u64,
    /// Writes that completed within their first poll or were written through (FUA, too large).
    pub written_through: u64,
    /// Requests that waited for room or for an overlapping pending write.
    pub waits: u64,
    /// Acknowledged writes that failed on the device (or never finished).
    pub lost_writes: u64,
    /// Writes pending right now.
    pub pending_writes: u64,
}

struct Pending {
    id: u64,
    start: u64,
    end: u64,
}

#[derive(Default)]
struct State {
    pending: Vec<Pending>,
    pending_bytes: u64,
    next_id: u64,
    /// The first lost write: what every later flush reports.
    lost: Option<String>,
}

impl State {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.pending.iter().any(|p| p.start < end && start < p.end)
    }
}

struct Shared {
    name: String,
    options: WriteBackOptions,
    state: Mutex<State>,
    /// Signalled whenever a pending write ends.
    changed: Notify,
    acknowledged_early: AtomicU64,
    written_through: AtomicU64,
    waits: AtomicU64,
    lost_writes: AtomicU64,
}

impl Shared {
    /// Waits until `ready` holds under the lock, then runs `then` under the same lock. The
    /// common case (ready at once) takes the lock once and never registers with `changed`.
    async fn wait_for<T>(&self, ready: impl Fn(&State) -> bool, then: impl FnOnce(&mut State) -> T) -> T {
        let mut then = Some(then);
        let mut attempt = |waited: bool| {
            let mut st = self.state.lock();
            if !ready(&st) {
                return None;
            }
            if waited {
                self.waits.fetch_add(1, Ordering::Relaxed);
            }
            then.take().map(|f| f(&mut st))
        };
        if let Some(t) = attempt(false) {
            return t;
        }
        loop {
            // Registered before the second look, so an end between the look and the await
            // still wakes this waiter.
            let mut notified = pin!(self.changed.notified());
            notified.as_mut().enable();
            if let Some(t) = attempt(true) {
                return t;
            }
            notified.await;
        }
    }

    async fn wait_no_overlap(&self, start: u64, len: u64) {
        let end = start + len;
        self.wait_for(|st| !st.overlaps(start, end), |_| ()).await
    }

    /// Reserves room for a write of `[start, start + len)`; returns its id.
    async fn admit(&self, start: u64, len: u64) -> u64 {
        let end = start + len;
        let o = self.options;
        self.wait_for(
            |st| st.pending.len() < o.max_writes && st.pending_bytes + len <= o.max_bytes && !st.overlaps(start, end),
            |st| {
                let id = st.next_id;
                st.next_id += 1;
                st.pending.push(Pending { id, start, end });
                st.pending_bytes += len;
                id
            },
        )
        .await
    }

    /// Ends pending write `id`; `lost` (under the same lock, so no flush can slip between)
    /// records why an acknowledged write did not reach the device.
    fn end(&self, id: u64, lost: Option<String>) {
        {
            let mut st = self.state.lock();
            if let Some(i) = st.pending.iter().position(|p| p.id == id) {
                let p = st.pending.swap_remove(i);
                st.pending_bytes -= p.end - p.start;
            }
            if let Some(why) = lost {
                self.lost_writes.fetch_add(1, Ordering::Relaxed);
                tracing::error!(device = %self.name, "{why}");
                st.lost.get_or_insert(why);
            }
        }
        self.changed.notify_waiters();
    }
}

/// One admitted write. Dropped without [`finish`](Self::finish): removed from the pending set,
/// and if it had been acknowledged, counted as lost (its outcome is unknown).
struct PendingGuard {
    shared: Arc<Shared>,
    id: u64,
    offset_bytes: u64,
    len_bytes: u64,
    acknowledged: bool,
    ended: bool,
}

impl PendingGuard {
    fn finish(mut self, result: &io::Result<()>) {
        self.ended = true;
        let lost = match result {
            Err(e) if self.acknowledged => Some(format!(
                "{}: lost write of {} bytes at offset {}, acknowledged before it failed: {e}; \
                 every flush fails from now on until the volume is opened again",
                self.shared.name, self.len_bytes, self.offset_bytes
            )),
            _ => None,
        };
        self.shared.end(self.id, lost);
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let lost = self.acknowledged.then(|| {
            format!(
                "{}: write of {} bytes at offset {} was acknowledged but abandoned before it completed \
                 (the service stopped under it); treating it as lost",
                self.shared.name, self.len_bytes, self.offset_bytes
            )
        });
        self.shared.end(self.id, lost);
    }
}

/// See the module documentation.
pub struct WriteBackDevice<D> {
    inner: Arc<D>,
    shared: Arc<Shared>,
}

/// A cheap handle to read a [`WriteBackDevice`]'s counters while it runs.
#[derive(Clone)]
pub struct WriteBackHandle {
    shared: Arc<Shared>,
}

impl WriteBackHandle {
    pub fn stats(&self) -> WriteBackStats {
        let s = &self.shared;
        WriteBackStats {
            acknowledged_early: s.acknowledged_early.load(Ordering::Relaxed),
            written_through: s.written_through.load(Ordering::Relaxed),
            waits: s.waits.load(Ordering::Relaxed),
            lost_writes: s.lost_writes.load(Ordering::Relaxed),
            pending_writes: s.state.lock().pending.len() as u64,
        }
    }

    /// Why flushes fail, once an acknowledged write was lost.
    pub fn lost_write(&self) -> Option<String> {
        self.shared.state.lock().lost.clone()
    }

    pub fn options(&self) -> WriteBackOptions {
        self.shared.options
    }
}

impl<D: BlockDevice> WriteBackDevice<D> {
    /// Wraps `inner`. Limits of zero are raised to one write / one maximum-size request.
    pub fn new(inner: D, options: WriteBackOptions) -> WriteBackDevice<D> {
        WriteBackDevice::from_arc(Arc::new(inner), options)
    }

    pub fn from_arc(inner: Arc<D>, options: WriteBackOptions) -> WriteBackDevice<D> {
        let options = WriteBackOptions { max_writes: options.max_writes.max(1), max_bytes: options.max_bytes.max(1) };
        let shared = Arc::new(Shared {
            name: inner.name().to_owned(),
            options,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            acknowledged_early: AtomicU64::new(0),
            written_through: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            lost_writes: AtomicU64::new(0),
        });
        WriteBackDevice { inner, shared }
    }

    pub fn handle(&self) -> WriteBackHandle {
        WriteBackHandle { shared: self.shared.clone() }
    }

    pub fn stats(&self) -> WriteBackStats {
        self.handle().stats()
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    async fn do_write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> io::Result<()> {
        let len_bytes = buf.len() as u64;
        check_io(self.name(), &self.inner.topology(), IoOp::Write, offset_bytes, len_bytes)?;
        let s = &self.shared;
        if flags.fua || len_bytes > s.options.max_bytes || tokio::runtime::Handle::try_current().is_err() {
            s.wait_no_overlap(offset_bytes, len_bytes).await;
            s.written_through.fetch_add(1, Ordering::Relaxed);
            return self.inner.write(offset_bytes, buf, flags).await;
        }
        let id = s.admit(offset_bytes, len_bytes).await;
        let mut guard =
            PendingGuard { shared: s.clone(), id, offset_bytes, len_bytes, acknowledged: false, ended: false };
        let inner = self.inner.clone();
        let mut write: Pin<Box<dyn Future<Output = io::Result<()>> + Send>> =
            Box::pin(async move { inner.write(offset_bytes, buf, flags).await });
        // The first poll queues the request on the device (and a plug around the caller sends
        // it to the kernel before the caller answers).
        match std::future::poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await {
            Poll::Ready(result) => {
                s.written_through.fetch_add(1, Ordering::Relaxed);
                guard.finish(&result);
                result
            }
            Poll::Pending => {
                guard.acknowledged = true;
                s.acknowledged_early.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let result = write.await;
                    guard.finish(&result);
                });
                Ok(())
            }
        }
    }

    async fn do_flush(&self) -> io::Result<()> {
        let s = &self.shared;
        let limit = s.state.lock().next_id;
        let lost = s.wait_for(|st| st.pending.iter().all(|p| p.id >= limit), |st| st.lost.clone()).await;
        if let Some(why) = lost {
            return Err(io::Error::other(why));
        }
        self.inner.flush().await
    }
}

impl<D: BlockDevice> BlockDevice for WriteBackDevice<D> {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn topology(&self) -> Topology {
        Topology { volatile_cache: true, ..self.inner.topology() }
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        Box::pin(async move {
            let len_bytes = buf.len() as u64;
            if let Err(e) = check_io(self.name(), &self.inner.topology(), IoOp::Read, offset_bytes, len_bytes) {
                return (buf, Err(e));
            }
            self.shared.wait_no_overlap(offset_bytes, len_bytes).await;
            self.inner.read(offset_bytes, buf).await
        })
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_write(offset_bytes, buf, flags))
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(self.do_flush())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            check_io(self.name(), &self.inner.topology(), IoOp::Discard, offset_bytes, len_bytes)?;
            self.shared.wait_no_overlap(offset_bytes, len_bytes).await;
            self.inner.discard(offset_bytes, len_bytes).await
        })
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            check_io(self.name(), &self.inner.topology(), IoOp::WriteZeroes, offset_bytes, len_bytes)?;
            self.shared.wait_no_overlap(offset_bytes, len_bytes).await;
            self.inner.write_zeroes(offset_bytes, len_bytes, flags).await
        })
    }
}
