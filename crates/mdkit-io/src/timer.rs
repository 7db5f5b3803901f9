//! Microsecond sleeps for simulated devices, without a thread and without spinning.
//!
//! tokio's timer wheel has millisecond resolution, far too coarse for a flash model whose
//! latencies are tens of microseconds. A [`MicroTimer`] keeps its sleepers in a min-heap and arms
//! one `timerfd` (CLOCK_MONOTONIC, an hrtimer — no timer slack, no millisecond rounding) for the
//! earliest deadline. A small driver task on the runtime waits on the timerfd through tokio's
//! reactor (`AsyncFd`), wakes every expired sleeper and re-arms for the next deadline. The CPU
//! sleeps in between; precision is the runtime's wake-up latency (typically 5–50 µs), and a sleep
//! never ends before its deadline.
//!
//! Outside a tokio runtime with I/O enabled (where the timerfd cannot be registered) sleeps fall
//! back to `std::thread::sleep`, which blocks the calling thread; a warning is logged once.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, oneshot};

struct Sleeper {
    deadline: Instant,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Sleeper {
    fn eq(&self, other: &Self) -> bool {
        (self.deadline, self.seq) == (other.deadline, other.seq)
    }
}
impl Eq for Sleeper {}
impl PartialOrd for Sleeper {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Sleeper {
    // Reversed: BinaryHeap is a max-heap, we want the earliest deadline on top.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.deadline, other.seq).cmp(&(self.deadline, self.seq))
    }
}

#[derive(Default)]
struct TimerState {
    heap: BinaryHeap<Sleeper>,
    next_seq: u64,
    /// Deadline the timerfd is currently armed for.
    armed: Option<Instant>,
}

struct TimerShared {
    tfd: AsyncFd<OwnedFd>,
    state: Mutex<TimerState>,
    shutdown: Notify,
    /// False once the driver task ended (timer dropped, or its runtime shut down).
    driver_alive: AtomicBool,
}

/// Marks the driver dead when its task ends or is dropped with its runtime.
struct DriverAlive(Arc<TimerShared>);

impl Drop for DriverAlive {
    fn drop(&mut self) {
        self.0.driver_alive.store(false, Ordering::Release);
    }
}

impl TimerShared {
    /// Arms the timerfd to fire at `deadline` (at once if already past).
    fn arm(&self, deadline: Instant) {
        let rel = deadline.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec {
                tv_sec: rel.as_secs() as libc::time_t,
                tv_nsec: rel.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: timerfd_settime on our own timerfd with a valid itimerspec.
        let r = unsafe { libc::timerfd_settime(self.tfd.get_ref().as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        debug_assert_eq!(r, 0, "timerfd_settime on a valid timerfd");
    }

    /// Wakes every sleeper whose deadline passed and re-arms for the next one.
    fn fire_expired(&self) {
        let mut s = self.state.lock();
        let now = Instant::now();
        while s.heap.peek().is_some_and(|t| t.deadline <= now) {
            if let Some(t) = s.heap.pop() {
                let _ = t.wake.send(());
            }
        }
        s.armed = s.heap.peek().map(|t| t.deadline);
        if let Some(d) = s.armed {
            self.arm(d);
        }
    }
}

/// `alive` is an argument so that it is dropped with the task even if never polled.
async fn drive(shared: Arc<TimerShared>, alive: DriverAlive) {
    let _alive = alive;
    loop {
        tokio::select! {
            ready = shared.tfd.readable() => {
                let Ok(mut guard) = ready else { return };
                let mut expirations = [0u8; 8];
                // SAFETY: reading 8 bytes from a non-blocking timerfd into a local buffer.
                let _ = unsafe { libc::read(shared.tfd.get_ref().as_raw_fd(), expirations.as_mut_ptr().cast(), 8) };
                // Edge-triggered: the next expiry is a new event. Cleared before firing, and only
                // if no newer event arrived, so no expiry is missed.
                guard.clear_ready();
                shared.fire_expired();
            }
            _ = shared.shutdown.notified() => return,
        }
    }
}

struct TimerHandle {
    shared: Arc<TimerShared>,
}

impl Drop for TimerHandle {
    fn drop(&mut self) {
        self.shared.shutdown.notify_one();
    }
}

/// A microsecond-resolution sleep service (see the module documentation). Clone freely; the
/// driver stops when the last clone is dropped.
#[derive(Clone)]
pub struct MicroTimer {
    handle: Arc<TimerHandle>,
}

impl MicroTimer {
    /// Creates the timer and its driver task on the current tokio runtime (needs the I/O driver).
    pub fn new() -> io::Result<MicroTimer> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other("MicroTimer::new must be called inside a tokio runtime"))?;
        // SAFETY: timerfd_create with valid flags; the result is checked.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the OwnedFd keeps the descriptor open and unchanged for the AsyncFd's life.
        let tfd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        let shared = Arc::new(TimerShared {
            tfd,
            state: Mutex::new(TimerState::default()),
            shutdown: Notify::new(),
            driver_alive: AtomicBool::new(true),
        });
        runtime.spawn(drive(shared.clone(), DriverAlive(shared.clone())));
        Ok(MicroTimer { handle: Arc::new(TimerHandle { shared }) })
    }

    /// Sleeps for at least `duration`.
    pub async fn sleep(&self, duration: Duration) {
        if duration.is_zero() {
            return;
        }
        let deadline = Instant::now() + duration;
        let (wake, rx) = oneshot::channel();
        {
            let shared = &self.handle.shared;
            let mut s = shared.state.lock();
            let seq = s.next_seq;
            s.next_seq += 1;
            s.heap.push(Sleeper { deadline, seq, wake });
            if s.armed.is_none_or(|a| deadline < a) {
                s.armed = Some(deadline);
                shared.arm(deadline);
            }
        }
        let _ = rx.await;
        // Guard against early wake-ups (never end before the deadline).
        let now = Instant::now();
        if now < deadline {
            Box::pin(self.sleep(deadline - now)).await;
        }
    }
}

/// A timer created on first use — and again whenever the runtime that drove the previous one
/// has shut down (a device may outlive one test runtime and be used from the next) — with a
/// blocking fallback where none can be created.
#[derive(Default)]
pub(crate) struct LazyTimer {
    timer: Mutex<Option<MicroTimer>>,
    warned: AtomicBool,
}

impl LazyTimer {
    pub(crate) async fn sleep(&self, duration: Duration) {
        if duration.is_zero() {
            return;
        }
        let timer = {
            let mut t = self.timer.lock();
            if t.as_ref().is_none_or(|t| !t.handle.shared.driver_alive.load(Ordering::Acquire)) {
                *t = match MicroTimer::new() {
                    Ok(new) => Some(new),
                    Err(e) => {
                        if !self.warned.swap(true, Ordering::Relaxed) {
                            tracing::warn!("microsecond timer unavailable ({e}); simulated latencies block the thread");
                        }
                        None
                    }
                };
            }
            t.clone()
        };
        match timer {
            Some(t) => t.sleep(duration).await,
            None => std::thread::sleep(duration),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps_never_end_early_and_order_by_deadline() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let t = MicroTimer::new().expect("timer");
            let mut waits = Vec::new();
            for us in [50u64, 200, 1000, 75] {
                let start = Instant::now();
                t.sleep(Duration::from_micros(us)).await;
                let took = start.elapsed();
                assert!(took >= Duration::from_micros(us), "{us} µs sleep took {took:?}");
                waits.push(took);
            }
            // Concurrent sleepers: all wake, each after its own deadline.
            let start = Instant::now();
            let order = Arc::new(Mutex::new(Vec::new()));
            let mut hs = Vec::new();
            for us in [300u64, 100, 200] {
                let (t, order) = (t.clone(), order.clone());
                hs.push(tokio::spawn(async move {
                    t.sleep(Duration::from_micros(us)).await;
                    assert!(start.elapsed() >= Duration::from_micros(us));
                    order.lock().push(us);
                }));
            }
            for h in hs {
                h.await.expect("sleeper");
            }
            assert_eq!(*order.lock(), vec![100, 200, 300]);
            eprintln!("micro timer: requested 50/200/1000/75 µs, took {waits:?}");
        });
    }

    #[test]
    fn lazy_timer_outlives_the_runtime_that_created_it() {
        let lazy = LazyTimer::default();
        for _ in 0..3 {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let start = Instant::now();
                let slept = tokio::time::timeout(Duration::from_secs(5), lazy.sleep(Duration::from_micros(200))).await;
                assert!(slept.is_ok(), "sleep on a timer whose runtime is gone never ends");
                assert!(start.elapsed() >= Duration::from_micros(200));
            });
            drop(rt); // the driver dies with its runtime; the next sleep makes a new timer
        }
    }
}
