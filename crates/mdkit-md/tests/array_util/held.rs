//! `HeldWrites`: a member whose data writes wait until the test releases them — a far,
//! lagging member (write-behind tests) whose timing the test controls without clocks.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mdkit_io::{BlockDevice, DeviceRef, IoBuf, IoFuture, ReadResult, SharedBuf, Topology, WriteFlags, ZeroFlags};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

/// See the module documentation. Writes at or beyond [`HeldWrites::hold_from`] wait (metadata
/// below it passes); reads, flushes and everything else pass through.
pub struct HeldWrites {
    inner: DeviceRef,
    from_bytes: AtomicU64,
    waiting: Mutex<Vec<(u64, oneshot::Sender<()>)>>,
    arrived: Notify,
}

impl HeldWrites {
    pub fn new(inner: DeviceRef) -> Arc<HeldWrites> {
        Arc::new(HeldWrites {
            inner,
            from_bytes: AtomicU64::new(u64::MAX),
            waiting: Mutex::new(Vec::new()),
            arrived: Notify::new(),
        })
    }

    /// Holds writes at byte `from` and beyond (`u64::MAX`: none; releases nothing).
    pub fn hold_from(&self, from: u64) {
        self.from_bytes.store(from, Ordering::SeqCst);
    }

    /// Stops holding and lets every waiting write go.
    pub fn open(&self) {
        self.hold_from(u64::MAX);
        for (_, tx) in self.waiting.lock().drain(..) {
            let _ = tx.send(());
        }
    }

    /// Writes waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.lock().len()
    }

    /// Offsets of the waiting writes, in arrival order.
    pub fn waiting_offsets(&self) -> Vec<u64> {
        self.waiting.lock().iter().map(|(o, _)| *o).collect()
    }

    /// Lets the most recent waiting write go (a member that reorders).
    pub fn release_last(&self) -> bool {
        let tx = self.waiting.lock().pop();
        tx.map(|(_, tx)| tx.send(())).is_some()
    }

    /// Waits until at least `n` writes are waiting.
    pub async fn wait_for(&self, n: usize) {
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.waiting() >= n {
                return;
            }
            notified.await;
        }
    }
}

impl BlockDevice for HeldWrites {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn read(&self, off: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.inner.read(off, buf)
    }
    fn write(&self, off: u64, buf: SharedBuf, f: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            if off >= self.from_bytes.load(Ordering::SeqCst) {
                let (tx, rx) = oneshot::channel();
                self.waiting.lock().push((off, tx));
                self.arrived.notify_waiters();
                let _ = rx.await;
            }
            self.inner.write(off, buf, f).await
        })
    }
    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        self.inner.flush()
    }
    fn discard(&self, off: u64, len: u64) -> IoFuture<'_, io::Result<()>> {
        self.inner.discard(off, len)
    }
    fn write_zeroes(&self, off: u64, len: u64, f: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        self.inner.write_zeroes(off, len, f)
    }
}
