//! Data-path threads: one current-thread tokio runtime per thread, where NBD connections run.
//!
//! ```text
//!   main runtime (multi-thread)          connection threads (one per core)
//!   accept ──► detach socket ──────────► thread k: current-thread runtime
//!   control socket, md daemons             connection task(s), and for every member it
//!                                          touches an io_uring of its own (SINGLE_ISSUER,
//!                                          DEFER_TASKRUN) whose reaper runs right here
//! ```
//!
//! A connection, its requests, their member I/O submissions and completions all stay on one
//! thread: no work stealing, no wake-up crossing threads, no lock contended (the shared-nothing
//! per-queue layout of SPDK reactors and ublk queues). Several connections (NBD multi-conn) are
//! dealt round-robin over the threads, so the server scales with cores. Measured on a 2-vCPU VM
//! at queue depth 32 (4 KiB random reads): a multi-thread runtime with 2 workers spent about
//! twice the CPU per request of a single-threaded one, mostly waking and parking workers.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The data-path threads; see the module documentation. Dropping stops them: each runtime ends
/// (dropping whatever tasks it still has) and each thread is joined.
pub struct ConnectionThreads {
    handles: Vec<Handle>,
    stops: Vec<oneshot::Sender<()>>,
    joins: Vec<JoinHandle<()>>,
}

impl ConnectionThreads {
    /// Starts `count` threads (at least one), named `mdkit-conn-<k>`, with no idle polling.
    pub fn start(count: usize) -> io::Result<ConnectionThreads> {
        ConnectionThreads::start_with(count, Duration::ZERO)
    }

    /// Starts `count` threads; each polls its sockets and rings for up to `idle_poll` before it
    /// sleeps (see [`idle_poll`]; zero = sleep at once).
    pub fn start_with(count: usize, idle_poll_budget: Duration) -> io::Result<ConnectionThreads> {
        let mut t = ConnectionThreads { handles: Vec::new(), stops: Vec::new(), joins: Vec::new() };
        for k in 0..count.max(1) {
            let (handle_tx, handle_rx) = std::sync::mpsc::sync_channel::<io::Result<Handle>>(1);
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            let join = std::thread::Builder::new().name(format!("mdkit-conn-{k}")).spawn(move || {
                let mut builder = tokio::runtime::Builder::new_current_thread();
                builder.enable_all();
                if !idle_poll_budget.is_zero() {
                    builder.on_thread_park(move || idle_poll(idle_poll_budget));
                }
                let rt = match builder.build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                        return;
                    }
                };
                // Members used from here get an io_uring owned by this thread.
                mdkit_io::file::enable_thread_rings();
                IDLE_SOCKETS.with(|s| s.borrow_mut().enabled = true);
                let _ = handle_tx.send(Ok(rt.handle().clone()));
                rt.block_on(async {
                    let _ = stop_rx.await;
                });
                // Dropping the runtime here (on its own thread) ends its tasks and lets the
                // thread rings drain their in-flight I/O on the thread that owns them.
                drop(rt);
            })?;
            let handle = handle_rx
                .recv()
                .map_err(|_| io::Error::other(format!("connection thread {k} exited during start-up")))??;
            t.handles.push(handle);
            t.stops.push(stop_tx);
            t.joins.push(join);
        }
        Ok(t)
    }

    /// Runtime handles, one per thread (give them to [`crate::NbdServer::set_connection_runtimes`]).
    pub fn handles(&self) -> Vec<Handle> {
        self.handles.clone()
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }
}

impl Drop for ConnectionThreads {
    fn drop(&mut self) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        for j in self.joins.drain(..) {
            if j.join().is_err() {
                tracing::error!("a connection thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for ConnectionThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionThreads").field("threads", &self.handles.len()).finish()
    }
}

//------------------------------------------------------------------------------------------------
// Idle polling

/// The sockets of the connections a connection thread serves, for [`idle_poll`].
struct IdleSockets {
    /// Set on connection threads only.
    enabled: bool,
    fds: Vec<libc::pollfd>,
}

thread_local! {
    static IDLE_SOCKETS: RefCell<IdleSockets> = const { RefCell::new(IdleSockets { enabled: false, fds: Vec::new() }) };
}

/// Keeps a connection's socket in its thread's idle-poll set while alive.
pub(crate) struct SocketWatch(RawFd);

/// Adds `fd` to the calling thread's idle-poll set (on a connection thread; `None` elsewhere).
pub(crate) fn watch_socket(fd: RawFd) -> Option<SocketWatch> {
    IDLE_SOCKETS.with(|s| {
        let mut s = s.try_borrow_mut().ok()?;
        if !s.enabled {
            return None;
        }
        s.fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        Some(SocketWatch(fd))
    })
}

impl Drop for SocketWatch {
    fn drop(&mut self) {
        IDLE_SOCKETS.with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && let Some(i) = s.fds.iter().position(|p| p.fd == self.0)
            {
                s.fds.swap_remove(i);
            }
        });
    }
}

/// Run by a connection thread's runtime each time it is about to sleep: for up to `budget`, polls
/// the thread's own member rings ([`mdkit_io::poll_thread_rings`]) and its connection sockets
/// without blocking, and returns as soon as either has something. A completion found this way
/// is answered here (its task runs without the thread sleeping); a readable socket makes the
/// runtime's own poll return at once. Only when nothing arrived within `budget` does the thread
/// sleep in epoll.
///
/// Why: at queue depth 1 a request's round trip is mostly wake-ups. On a VM, waking a vCPU that
/// halted costs tens of microseconds (measured on the 2-vCPU dev VM: `mem` volume QD1 reads
/// 10k IOPS across vCPUs, 36k with client and server on one), and so does the eventfd → epoll →
/// reaper hop after a member completion. Spinning briefly keeps this thread's vCPU awake for the
/// next event, the way SPDK reactors and the kernel's `net.core.busy_poll` do, bounded so that an
/// idle server sleeps. A thread with no connection does not poll.
pub fn idle_poll(budget: Duration) {
    let start = Instant::now();
    idle_poll_until(budget, || start.elapsed());
}

/// [`idle_poll`] with the time spent so far read from `elapsed` (tests count polls with it).
fn idle_poll_until(budget: Duration, mut elapsed: impl FnMut() -> Duration) {
    let empty = IDLE_SOCKETS.with(|s| s.try_borrow().map_or(true, |s| s.fds.is_empty()));
    if empty {
        return;
    }
    loop {
        if mdkit_io::poll_thread_rings() > 0 {
            return;
        }
        let ready = IDLE_SOCKETS.with(|s| {
            let Ok(mut s) = s.try_borrow_mut() else { return -1 };
            if s.fds.is_empty() {
                return -1;
            }
            // SAFETY: poll(2) on our own array of `fds.len()` pollfds, zero timeout.
            unsafe { libc::poll(s.fds.as_mut_ptr(), s.fds.len() as libc::nfds_t, 0) }
        });
        if ready != 0 || elapsed() >= budget {
            return;
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// A clock that moves one millisecond each time it is read, and counts the reads: how many
    /// times idle_poll looked at its sockets, whatever the machine's speed.
    fn ticking() -> (impl FnMut() -> Duration, std::rc::Rc<std::cell::Cell<u64>>) {
        let reads = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let r = reads.clone();
        let clock = move || {
            r.set(r.get() + 1);
            Duration::from_millis(r.get())
        };
        (clock, reads)
    }

    /// On a connection thread: with no socket, idle_poll returns at once; with a quiet socket it
    /// polls for its whole budget; data already waiting ends it at the first look; a dropped
    /// watch takes the socket out of the set. Elsewhere sockets are not watched at all.
    #[test]
    fn idle_poll_ends_on_socket_data_or_after_its_budget() {
        assert!(watch_socket(0).is_none(), "not a connection thread");
        std::thread::spawn(|| {
            IDLE_SOCKETS.with(|s| s.borrow_mut().enabled = true);
            let (clock, reads) = ticking();
            idle_poll_until(Duration::from_millis(30), clock);
            assert_eq!(reads.get(), 0, "no socket: no polling");

            let (a, mut b) = UnixStream::pair().unwrap();
            let watch = watch_socket(a.as_raw_fd()).expect("connection thread");
            let (clock, reads) = ticking();
            idle_poll_until(Duration::from_millis(30), clock);
            assert_eq!(reads.get(), 30, "a quiet socket: polled until the budget was spent");

            b.write_all(b"x").unwrap();
            let (clock, reads) = ticking();
            idle_poll_until(Duration::from_millis(30), clock);
            assert_eq!(reads.get(), 0, "data waiting: the first poll ends it");

            drop(watch);
            assert!(IDLE_SOCKETS.with(|s| s.borrow().fds.is_empty()));
            let (clock, reads) = ticking();
            idle_poll_until(Duration::from_millis(30), clock);
            assert_eq!(reads.get(), 0, "watch dropped: nothing to poll");
        })
        .join()
        .unwrap();
    }
}
