//! Submission plugging: batch the io_uring submissions a thread makes during one poll into one
//! `io_uring_enter` per device, like the kernel's `blk_start_plug` / `blk_finish_plug`.
//!
//! ```text
//!   Plugged(conn task).poll()                 one io_uring_enter per device,
//!     ├─ request 1 polled → SQE pushed  ─┐    one virtio doorbell per batch
//!     ├─ request 2 polled → SQE pushed  ─┼──► Plug dropped / flush() ──► kernel
//!     └─ request n polled → SQE pushed  ─┘
//! ```
//!
//! Without a plug every [`FileDevice`](crate::FileDevice) request enters the kernel on its own
//! (one syscall and, on a virtio disk, one VM exit for the doorbell per request). A front end
//! that polls many requests in one go — the NBD connection task does, after reading every
//! request header the socket had — wraps that poll in a [`Plug`] (or the whole task in
//! [`plugged`]): devices then only queue SQEs and remember that they have something pending,
//! and the plug submits them all when it ends.
//!
//! * **No added latency.** A plug lives only inside one synchronous poll; the SQEs it holds are
//!   submitted before that poll returns, i.e. before the thread could sleep. A lone request
//!   (QD1) is submitted as soon as the task that issued it finishes its poll.
//! * **Bounded.** A device submits at once when [`PLUG_MAX_QUEUED_SQES`] entries are waiting
//!   (the kernel's plug has the same kind of limit), and a plug tracks at most
//!   [`PLUG_MAX_DEVICES`] devices before flushing.
//! * **Per thread, nestable.** The plug is thread-local state, so it batches across any stack
//!   of devices (an md array over several members: one `io_uring_enter` per member). Inner plugs
//!   do nothing; the outermost one submits. A panic unwinding through a plug still submits.
//! * **Dropped futures are safe.** An SQE belongs to its in-flight record the moment it is
//!   pushed; whether the future that pushed it is still alive when the plug flushes does not
//!   matter.

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// A device with queued submissions submits at once when this many SQEs wait under a plug.
pub const PLUG_MAX_QUEUED_SQES: usize = 32;
/// A plug flushes when this many distinct devices have queued submissions.
pub const PLUG_MAX_DEVICES: usize = 64;

/// Something with submissions queued in user space, waiting for a plug to end.
pub(crate) trait PlugTarget: Send + Sync {
    /// Submits everything queued. Must not block and must not touch the plug.
    fn submit_queued(&self);
    /// Identity, to keep one entry per device in a plug.
    fn plug_key(&self) -> usize;
}

struct PlugState {
    /// Number of live [`Plug`]s on this thread (nesting).
    depth: u32,
    /// Devices with queued SQEs, each once.
    pending: Vec<Arc<dyn PlugTarget>>,
    /// Statistics for tests and benchmarks: flushes that submitted something.
    flushes: u64,
}

thread_local! {
    static PLUG: RefCell<PlugState> = const {
        RefCell::new(PlugState { depth: 0, pending: Vec::new(), flushes: 0 })
    };
}

/// While alive, io_uring submissions made by this thread are queued and submitted together
/// when the (outermost) plug is dropped or [`flush`](Plug::flush)ed. Not `Send`: a plug must
/// not outlive the synchronous section it was made for (never hold one across an `.await`;
/// use [`plugged`] to plug every poll of a future instead).
pub struct Plug {
    _not_send: PhantomData<*const ()>,
}

impl Plug {
    pub fn new() -> Plug {
        PLUG.with(|p| p.borrow_mut().depth += 1);
        Plug { _not_send: PhantomData }
    }

    /// Submits what is queued so far (e.g. before a slow step such as a socket write, so the
    /// disk starts working meanwhile). The plug stays active.
    pub fn flush(&self) {
        flush_pending();
    }
}

impl Default for Plug {
    fn default() -> Plug {
        Plug::new()
    }
}

impl Drop for Plug {
    fn drop(&mut self) {
        let outermost = PLUG.with(|p| {
            let mut p = p.borrow_mut();
            debug_assert!(p.depth > 0, "plug depth underflow");
            p.depth -= 1;
            p.depth == 0
        });
        if outermost {
            flush_pending();
        }
    }
}

impl std::fmt::Debug for Plug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Plug")
    }
}

/// Submits what the current thread's plug has queued so far (no-op without a plug or with
/// nothing queued); the plug stays active. For code running under [`plugged`], which has no
/// [`Plug`] value at hand.
pub fn flush() {
    flush_pending();
}

/// True when a plug is active on this thread.
pub fn is_plugged() -> bool {
    PLUG.with(|p| p.borrow().depth > 0)
}

/// How many plug flushes on this thread submitted something (tests, benchmarks).
pub fn thread_flush_count() -> u64 {
    PLUG.with(|p| p.borrow().flushes)
}

/// Called by a device right after it queued an SQE. Returns true when a plug on this thread
/// took over the submission; false when the caller must submit now (no plug, or a limit hit).
pub(crate) fn defer<T: PlugTarget + 'static>(target: &Arc<T>, queued_sqes: usize) -> bool {
    if queued_sqes >= PLUG_MAX_QUEUED_SQES {
        return false;
    }
    let taken = PLUG.with(|p| {
        let Ok(mut p) = p.try_borrow_mut() else {
            return Err(()); // inside a flush on this thread: submit directly
        };
        if p.depth == 0 {
            return Err(());
        }
        let key = target.plug_key();
        if p.pending.iter().any(|t| t.plug_key() == key) {
            return Ok(false);
        }
        p.pending.push(target.clone() as Arc<dyn PlugTarget>);
        Ok(p.pending.len() >= PLUG_MAX_DEVICES)
    });
    match taken {
        Err(()) => false,
        Ok(full) => {
            if full {
                flush_pending();
            }
            true
        }
    }
}

fn flush_pending() {
    let mut pending = PLUG.with(|p| match p.try_borrow_mut() {
        Ok(mut p) if !p.pending.is_empty() => {
            p.flushes += 1;
            std::mem::take(&mut p.pending)
        }
        _ => Vec::new(),
    });
    for t in pending.drain(..) {
        t.submit_queued();
    }
    // Give the (now empty) allocation back, unless a submission re-filled the list meanwhile.
    PLUG.with(|p| {
        if let Ok(mut p) = p.try_borrow_mut()
            && p.pending.is_empty()
        {
            p.pending = pending;
        }
    });
}

/// Polls `future` with a [`Plug`] active during every poll: the submissions of one poll go to
/// the kernel together, at the end of that poll.
pub fn plugged<F: Future>(future: F) -> Plugged<F> {
    Plugged { inner: future }
}

/// See [`plugged`].
#[derive(Debug)]
pub struct Plugged<F> {
    inner: F,
}

impl<F: Future> Future for Plugged<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _plug = Plug::new();
        // SAFETY: structural pinning of the only field; `Plugged` never moves it out.
        let inner = unsafe { self.map_unchecked_mut(|s| &mut s.inner) };
        inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counter {
        submits: AtomicUsize,
    }

    impl PlugTarget for Counter {
        fn submit_queued(&self) {
            self.submits.fetch_add(1, Ordering::SeqCst);
        }
        fn plug_key(&self) -> usize {
            self as *const Counter as usize
        }
    }

    fn counter() -> (Arc<Counter>, Arc<Counter>) {
        let c = Arc::new(Counter { submits: AtomicUsize::new(0) });
        (c.clone(), c)
    }

    #[test]
    fn without_a_plug_the_caller_submits() {
        let (c, t) = counter();
        assert!(!is_plugged());
        assert!(!defer(&t, 1));
        assert_eq!(c.submits.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn one_submit_per_device_when_the_outermost_plug_ends() {
        let (a, ta) = counter();
        let (b, tb) = counter();
        {
            let _outer = Plug::new();
            {
                let _inner = Plug::new();
                assert!(defer(&ta, 1));
                assert!(defer(&ta, 2));
                assert!(defer(&tb, 1));
            }
            assert_eq!(a.submits.load(Ordering::SeqCst), 0, "inner plug must not flush");
            assert!(defer(&ta, 3));
        }
        assert_eq!(a.submits.load(Ordering::SeqCst), 1);
        assert_eq!(b.submits.load(Ordering::SeqCst), 1);
        assert!(!is_plugged());
    }

    #[test]
    fn limits_force_submission() {
        let (a, ta) = counter();
        let _p = Plug::new();
        assert!(!defer(&ta, PLUG_MAX_QUEUED_SQES), "too many queued SQEs: submit now");
        let mut devices = Vec::new();
        for _ in 0..PLUG_MAX_DEVICES {
            let (c, t) = counter();
            assert!(defer(&t, 1));
            devices.push(c);
        }
        // The 64th device filled the plug: everything was submitted.
        assert!(devices.iter().all(|c| c.submits.load(Ordering::SeqCst) == 1));
        assert_eq!(a.submits.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn explicit_flush_keeps_the_plug_active() {
        let (a, ta) = counter();
        let p = Plug::new();
        assert!(defer(&ta, 1));
        p.flush();
        assert_eq!(a.submits.load(Ordering::SeqCst), 1);
        assert!(is_plugged());
        assert!(defer(&ta, 1));
        drop(p);
        assert_eq!(a.submits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_panic_inside_a_plug_still_submits() {
        let (a, ta) = counter();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _p = Plug::new();
            assert!(defer(&ta, 1));
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(a.submits.load(Ordering::SeqCst), 1);
        assert!(!is_plugged());
    }
}
