//! A bounded set of request futures polled inside the connection task.
//!
//! A connection's requests run concurrently but not as tasks of their own: the connection task
//! owns them, polls a request only when its waker fired, and so can submit the device I/O of
//! every request it just parsed under one [`mdkit_io::Plug`], and write every reply that became
//! ready with one `writev`. Compared with a task per request this saves a spawn, a cross-task
//! channel and a wake-up per request, and it keeps a connection's work on one thread.
//!
//! ```text
//!   slots:  [fut][fut][ -- ][fut] ...  (≤ capacity, allocations reused)
//!   wake(slot i) ──► ready list (each slot at most once) ──► wakes the connection task once
//!   poll_next()  ──► polls only the ready slots, returns one output at a time
//! ```
//!
//! The future storage of a slot is allocated once and reused for later requests, so a
//! connection in steady state allocates nothing here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use parking_lot::Mutex;

/// Shared between the set and the wakers of its slots.
struct ReadyList {
    /// Slots whose waker fired since the set last collected them.
    ready: Vec<u32>,
    /// `queued[i]`: slot `i` is in `ready` (keeps each slot in the list at most once).
    queued: Vec<bool>,
    /// The task that polls the set.
    parent: Option<Waker>,
    /// The parent was woken since it last polled: further slot wakes need not wake it again.
    parent_woken: bool,
}

struct SlotWaker {
    index: u32,
    list: Arc<Mutex<ReadyList>>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let parent = {
            let mut l = self.list.lock();
            let i = self.index as usize;
            if !l.queued[i] {
                l.queued[i] = true;
                l.ready.push(self.index);
            }
            if l.parent_woken {
                None
            } else {
                l.parent_woken = true;
                l.parent.clone()
            }
        };
        // Woken outside the lock: waking may take scheduler locks or a syscall.
        if let Some(w) = parent {
            w.wake();
        }
    }
}

struct Slot<F> {
    future: Pin<Box<Option<F>>>,
    waker: Waker,
}

/// See the module documentation. Holds at most `capacity` futures.
pub(crate) struct RequestSet<F: Future> {
    slots: Vec<Slot<F>>,
    free: Vec<u32>,
    list: Arc<Mutex<ReadyList>>,
    /// Ready slots taken from the shared list, still to be polled (in order).
    local: Vec<u32>,
    local_next: usize,
    len: usize,
    capacity: usize,
}

impl<F: Future> RequestSet<F> {
    pub fn new(capacity: usize) -> RequestSet<F> {
        assert!(capacity > 0 && capacity <= u32::MAX as usize, "request set capacity {capacity}");
        let list = ReadyList {
            ready: Vec::with_capacity(capacity),
            queued: vec![false; capacity],
            parent: None,
            parent_woken: false,
        };
        RequestSet {
            slots: Vec::new(),
            free: Vec::new(),
            list: Arc::new(Mutex::new(list)),
            local: Vec::with_capacity(capacity),
            local_next: 0,
            len: 0,
            capacity,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds a future; it is first polled by the next [`poll_next`](Self::poll_next). Hands the
    /// future back when the set is full.
    pub fn push(&mut self, future: F) -> Result<(), F> {
        if self.len == self.capacity {
            return Err(future);
        }
        let index = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize].future.as_mut().set(Some(future));
                i
            }
            None => {
                let i = self.slots.len() as u32;
                let waker = Waker::from(Arc::new(SlotWaker { index: i, list: self.list.clone() }));
                self.slots.push(Slot { future: Box::pin(Some(future)), waker });
                i
            }
        };
        self.len += 1;
        self.local.push(index);
        Ok(())
    }

    /// Polls the futures that were woken (and the new ones) until one completes. `Ready(None)`
    /// when the set is empty; `Pending` when no woken future completed (the task is woken again
    /// when one of them makes progress).
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<F::Output>> {
        loop {
            if self.len == 0 {
                return Poll::Ready(None);
            }
            if self.local_next == self.local.len() {
                self.local.clear();
                self.local_next = 0;
                let mut guard = self.list.lock();
                let l = &mut *guard;
                for &i in &l.ready {
                    l.queued[i as usize] = false;
                }
                self.local.append(&mut l.ready);
                if !l.parent.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    l.parent = Some(cx.waker().clone());
                }
                l.parent_woken = false;
                if self.local.is_empty() {
                    return Poll::Pending;
                }
            }
            let index = self.local[self.local_next];
            self.local_next += 1;
            let slot = &mut self.slots[index as usize];
            // A slot can be listed twice (woken again meanwhile) or after it finished: skip then.
            let Some(future) = slot.future.as_mut().as_pin_mut() else { continue };
            let mut slot_cx = Context::from_waker(&slot.waker);
            if let Poll::Ready(out) = future.poll(&mut slot_cx) {
                slot.future.as_mut().set(None);
                self.free.push(index);
                self.len -= 1;
                return Poll::Ready(Some(out));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::oneshot;

    #[tokio::test]
    async fn completes_in_wake_order_and_polls_only_woken_futures() {
        let polls = Arc::new(AtomicUsize::new(0));
        let make = |i: u32, rx: oneshot::Receiver<u32>, polls: Arc<AtomicUsize>| async move {
            polls.fetch_add(1, Ordering::SeqCst);
            (i, rx.await.unwrap_or(0))
        };
        let mut set = RequestSet::new(4);
        let mut senders = Vec::new();
        for i in 0..4u32 {
            let (tx, rx) = oneshot::channel::<u32>();
            senders.push(tx);
            set.push(make(i, rx, polls.clone())).map_err(|_| ()).unwrap();
        }
        let (_tx, rx) = oneshot::channel::<u32>();
        assert!(set.push(make(9, rx, polls.clone())).is_err(), "full at capacity");
        // First poll: every new future runs once, none completes.
        assert!(std::future::poll_fn(|cx| Poll::Ready(set.poll_next(cx).is_pending())).await);
        assert_eq!(polls.load(Ordering::SeqCst), 4);
        let s3 = senders.pop().unwrap();
        let s2 = senders.pop().unwrap();
        s3.send(30).unwrap();
        s2.send(20).unwrap();
        let a = std::future::poll_fn(|cx| set.poll_next(cx)).await.unwrap();
        let b = std::future::poll_fn(|cx| set.poll_next(cx)).await.unwrap();
        assert_eq!((a, b), ((3, 30), (2, 20)));
        // Only the two woken futures were polled again (each completed on that poll).
        assert_eq!(polls.load(Ordering::SeqCst), 4);
        assert_eq!(set.len(), 2);
        // A slot freed by a finished future is reused for the next one.
        let (tx, rx) = oneshot::channel::<u32>();
        set.push(make(7, rx, polls.clone())).map_err(|_| ()).unwrap();
        assert_eq!(set.slots.len(), 4);
        tx.send(70).unwrap();
        assert_eq!(std::future::poll_fn(|cx| set.poll_next(cx)).await.unwrap(), (7, 70));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_from_other_threads_reach_the_owner_and_slots_are_reused() {
        let mut set = RequestSet::new(8);
        let mut done = 0u32;
        let mut next = 0u32;
        let total = 2000u32;
        while done < total {
            while next < total && set.len() < 8 {
                let n = next;
                set.push(async move {
                    // Completed by a timer on whichever worker runs the timer wheel.
                    tokio::time::sleep(Duration::from_micros(u64::from(n % 7) * 10)).await;
                    tokio::task::yield_now().await;
                    n
                })
                .map_err(|_| ())
                .unwrap();
                next += 1;
            }
            let got = tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(|cx| set.poll_next(cx)))
                .await
                .expect("a woken future must wake the owner")
                .unwrap();
            assert!(got < total);
            done += 1;
        }
        assert!(set.is_empty());
        assert!(set.slots.len() <= 8, "slot storage is reused, not grown");
        assert!(matches!(std::future::poll_fn(|cx| Poll::Ready(set.poll_next(cx))).await, Poll::Ready(None)));
    }

    #[test]
    fn dropping_the_set_drops_pending_futures() {
        struct Flag(Arc<AtomicUsize>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let mut set = RequestSet::new(3);
        for _ in 0..3 {
            let f = Flag(dropped.clone());
            set.push(async move {
                let _f = f;
                std::future::pending::<()>().await;
            })
            .map_err(|_| ())
            .unwrap();
        }
        drop(set);
        assert_eq!(dropped.load(Ordering::SeqCst), 3);
    }
}
