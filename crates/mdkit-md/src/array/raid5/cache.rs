//! The stripe cache: one entry per stripe that has work in flight, in a sharded table (no global
//! lock), at most `stripe_cache_size` entries at once (md's stripe heads).
//!
//! An entry serialises everything that reads or changes a stripe's parity: batches of user
//! writes, degraded reads (reconstruction must not see half an update) and sync work. Writes to
//! a busy stripe queue as *pending* pieces; whoever holds the stripe next takes every pending
//! piece into one batch (conflicting updates serialise, and writes that arrive together are
//! merged — that is how sequential small writes become full-stripe writes). Independent
//! stripes proceed in parallel.
//!
//! ```text
//!   write piece ─► enqueue ─┬─ stripe idle: this task leads ─► [hold] ─► take batch ─► execute ─► release
//!                           └─ stripe busy: wait ─┬─ done (a leader executed it)
//!                                                 └─ lead (handed over on release)
//!   degraded read / sync ─► exclusive ─► work ─► release
//! ```
//!
//! Leadership passes on release to the first live waiter (FIFO); no task is spawned and no
//! thread waits. Entries are created with a permit from a [`Reservation`] (all permits a
//! request needs are taken at once, so requests never hold some permits while waiting for
//! others) and return it when they go idle.
//!
//! Gathering bookkeeping lives here too: pieces in flight and pieces in held batches, so a
//! holding leader can tell when every write in flight is waiting on gathering (the queue has
//! drained: holding longer cannot help).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

use super::plan::Seg;
use crate::array::errors::MdError;

/// Shards of the entry table.
const SHARDS: usize = 256;

/// A batch result every piece of the batch gets (io::Error is not Clone).
pub(crate) type BatchResult = Result<(), BatchError>;

/// A batch's failure, handed to every write it carried (so it must clone): the md runtime's
/// typed error when it was one, else the error's kind and text.
#[derive(Clone, Debug)]
pub(crate) enum BatchError {
    Md(MdError),
    Plain(io::ErrorKind, String),
}

impl BatchError {
    pub fn plain(kind: io::ErrorKind, msg: &str) -> BatchError {
        BatchError::Plain(kind, msg.to_string())
    }
}

impl From<io::Error> for BatchError {
    fn from(e: io::Error) -> BatchError {
        match MdError::of(&e) {
            Some(md) => BatchError::Md(md.clone()),
            None => BatchError::Plain(e.kind(), e.to_string()),
        }
    }
}

pub(crate) fn to_io(r: BatchResult) -> io::Result<()> {
    r.map_err(|e| match e {
        BatchError::Md(md) => md.into(),
        BatchError::Plain(k, m) => io::Error::new(k, m),
    })
}

/// One user write's part in one stripe, waiting to be batched.
pub(crate) struct PendingWrite {
    id: u64,
    pub segs: Vec<Seg>,
    pub fua: bool,
    /// The piece ends a sequential write in the middle of its stripe: worth holding briefly.
    pub hold_worthy: bool,
    done: oneshot::Sender<BatchResult>,
}

enum Waiter {
    Write { id: u64, lead: oneshot::Sender<()> },
    Exclusive { lead: oneshot::Sender<()> },
}

#[derive(Default)]
struct EntryState {
    /// Someone holds the stripe (a leader, a degraded read, sync work).
    busy: bool,
    /// The leader is holding the batch open for more pieces.
    holding: bool,
    pending: Vec<PendingWrite>,
    queue: VecDeque<Waiter>,
}

/// One stripe with work in flight.
pub(crate) struct StripeEntry {
    pub stripe: u64,
    state: Mutex<EntryState>,
    /// Notified when a piece joins or an exclusive user queues (a holding leader re-checks).
    pub changed: Notify,
}

/// One shard of the stripe cache: stripe number to its entry.
type Shard = Mutex<HashMap<u64, Arc<StripeEntry>>>;

/// See the module documentation.
pub(crate) struct StripeCache {
    shards: Box<[Shard]>,
    limit: AtomicUsize,
    /// Permits out: entries plus reserved-but-unused.
    used: AtomicUsize,
    entries: AtomicUsize,
    freed: Notify,
    next_id: AtomicU64,
    /// Write pieces enqueued and not yet completed.
    inflight_pieces: AtomicUsize,
    /// Pieces in batches whose leader is holding.
    held_pieces: AtomicUsize,
    /// Notified when a piece completes or a hold starts while some batch holds.
    pub drain: Notify,
}

impl StripeCache {
    pub fn new(limit: usize) -> StripeCache {
        StripeCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            limit: AtomicUsize::new(limit),
            used: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
            freed: Notify::new(),
            next_id: AtomicU64::new(1),
            inflight_pieces: AtomicUsize::new(0),
            held_pieces: AtomicUsize::new(0),
            drain: Notify::new(),
        }
    }

    fn shard(&self, stripe: u64) -> &Mutex<HashMap<u64, Arc<StripeEntry>>> {
        // Fibonacci hashing spreads sequential stripes over the shards.
        let h = stripe.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56;
        &self.shards[h as usize % SHARDS]
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
        self.freed.notify_waiters();
    }

    /// Stripes with work in flight (md's `stripe_cache_active`).
    pub fn active(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// Waits until `k` permits are free and takes them together (all or nothing). A request
    /// larger than the whole cache still proceeds when nothing else holds permits.
    pub async fn reserve(&self, k: usize) -> Reservation<'_> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let cur = self.used.load(Ordering::Acquire);
            if cur + k <= self.limit() || cur == 0 {
                if self.used.compare_exchange(cur, cur + k, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return Reservation { cache: self, left: k };
                }
                continue;
            }
            freed.await;
        }
    }

    fn release_permits(&self, k: usize) {
        if k > 0 {
            self.used.fetch_sub(k, Ordering::AcqRel);
            self.freed.notify_waiters();
        }
    }

    /// The entry for `stripe` (created with a permit from `res` when absent) and `f` run on its
    /// state, both under the shard lock so an entry never goes away between lookup and use.
    fn with_entry<R>(
        &self,
        stripe: u64,
        res: &mut Reservation<'_>,
        f: impl FnOnce(&Arc<StripeEntry>, &mut EntryState) -> R,
    ) -> (Arc<StripeEntry>, R) {
        let mut shard = self.shard(stripe).lock();
        let entry = shard
            .entry(stripe)
            .or_insert_with(|| {
                res.consume_one();
                self.entries.fetch_add(1, Ordering::Relaxed);
                Arc::new(StripeEntry { stripe, state: Mutex::new(EntryState::default()), changed: Notify::new() })
            })
            .clone();
        let r = {
            let mut st = entry.state.lock();
            f(&entry, &mut st)
        };
        (entry, r)
    }

    /// Queues a write piece on its stripe. The ticket says whether this task leads now.
    pub fn enqueue_write(
        &self,
        stripe: u64,
        segs: Vec<Seg>,
        fua: bool,
        hold_worthy: bool,
        res: &mut Reservation<'_>,
    ) -> WriteTicket<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done_tx, done_rx) = oneshot::channel();
        self.inflight_pieces.fetch_add(1, Ordering::AcqRel);
        let (entry, (lead_rx, holding)) = self.with_entry(stripe, res, |_, st| {
            st.pending.push(PendingWrite { id, segs, fua, hold_worthy, done: done_tx });
            if st.holding {
                self.held_pieces.fetch_add(1, Ordering::AcqRel);
            }
            let lead_rx = if st.busy {
                let (tx, rx) = oneshot::channel();
                st.queue.push_back(Waiter::Write { id, lead: tx });
                Some(rx)
            } else {
                st.busy = true;
                None
            };
            (lead_rx, st.holding)
        });
        if holding {
            entry.changed.notify_waiters();
        }
        let leads_now = lead_rx.is_none();
        WriteTicket { cache: self, entry, done: Some(done_rx), lead: lead_rx, leads_now, leading: false }
    }

    /// Exclusive use of a stripe (degraded reads, sync work); released when the guard drops.
    pub async fn exclusive(&self, stripe: u64) -> ExclusiveGuard<'_> {
        let mut res = self.reserve(1).await;
        let (entry, lead_rx) = self.with_entry(stripe, &mut res, |_, st| {
            if st.busy {
                let (tx, rx) = oneshot::channel();
                st.queue.push_back(Waiter::Exclusive { lead: tx });
                Some(rx)
            } else {
                st.busy = true;
                None
            }
        });
        drop(res);
        if let Some(rx) = lead_rx {
            entry.changed.notify_waiters();
            let mut wait = LeadWait { cache: self, entry: entry.clone(), rx: Some(rx) };
            wait.wait().await;
        }
        ExclusiveGuard { cache: self, entry }
    }

    /// Hands the stripe to the next live waiter, or retires the entry when there is none.
    pub(crate) fn release(&self, entry: &Arc<StripeEntry>) {
        let mut shard = self.shard(entry.stripe).lock();
        let mut st = entry.state.lock();
        debug_assert!(st.busy, "release of a stripe nobody holds");
        while let Some(w) = st.queue.pop_front() {
            match w {
                Waiter::Write { id, lead } => {
                    if st.pending.iter().any(|p| p.id == id) && lead.send(()).is_ok() {
                        return;
                    }
                }
                Waiter::Exclusive { lead } => {
                    if lead.send(()).is_ok() {
                        return;
                    }
                }
            }
        }
        // Nobody waits: pending pieces left belong to cancelled requests.
        let orphans = std::mem::take(&mut st.pending);
        st.busy = false;
        st.holding = false;
        drop(st);
        for p in orphans {
            self.complete(p, Err(BatchError::plain(io::ErrorKind::Interrupted, "write abandoned by its caller")));
        }
        if shard.get(&entry.stripe).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            shard.remove(&entry.stripe);
            self.entries.fetch_sub(1, Ordering::Relaxed);
            drop(shard);
            self.release_permits(1);
        }
    }

    /// Takes every pending piece of the stripe into a batch (the caller leads it).
    pub fn take_batch(&self, entry: &StripeEntry) -> Batch<'_> {
        let mut st = entry.state.lock();
        debug_assert!(!st.holding, "end the hold before taking the batch");
        Batch { cache: self, pieces: std::mem::take(&mut st.pending) }
    }

    /// Completes a piece: its owner gets `r`.
    pub fn complete(&self, p: PendingWrite, r: BatchResult) {
        let _ = p.done.send(r);
        self.inflight_pieces.fetch_sub(1, Ordering::AcqRel);
        if self.held_pieces.load(Ordering::Acquire) > 0 {
            self.drain.notify_waiters();
        }
    }

    /// What a holding leader looks at: the pending segs, whether any piece is worth holding
    /// for, and whether an exclusive user waits.
    pub fn peek(&self, entry: &StripeEntry) -> (Vec<Seg>, bool, bool) {
        let st = entry.state.lock();
        let segs = st.pending.iter().flat_map(|p| p.segs.iter().cloned()).collect();
        let worthy = st.pending.iter().any(|p| p.hold_worthy);
        let exclusive = st.queue.iter().any(|w| matches!(w, Waiter::Exclusive { .. }));
        (segs, worthy, exclusive)
    }

    pub fn start_hold(&self, entry: &StripeEntry) {
        let mut st = entry.state.lock();
        if !st.holding {
            st.holding = true;
            self.held_pieces.fetch_add(st.pending.len(), Ordering::AcqRel);
        }
        drop(st);
        self.drain.notify_waiters();
    }

    pub fn end_hold(&self, entry: &StripeEntry) {
        let mut st = entry.state.lock();
        if st.holding {
            st.holding = false;
            self.held_pieces.fetch_sub(st.pending.len(), Ordering::AcqRel);
        }
    }

    /// Every write piece in flight sits in a held batch: nothing else is coming soon.
    pub fn drained(&self) -> bool {
        let held = self.held_pieces.load(Ordering::Acquire);
        held > 0 && self.inflight_pieces.load(Ordering::Acquire) <= held
    }
}

/// The pieces one leader writes together. Pieces still in it when it drops (the leader was
/// cancelled) complete with an error, so their owners and the drain accounting never hang.
pub(crate) struct Batch<'a> {
    cache: &'a StripeCache,
    pieces: Vec<PendingWrite>,
}

impl Batch<'_> {
    /// Every seg of the batch, in arrival order (later segs win where they overlap).
    pub fn segs(&self) -> Vec<Seg> {
        self.pieces.iter().flat_map(|p| p.segs.iter().cloned()).collect()
    }

    pub fn fua(&self) -> bool {
        self.pieces.iter().any(|p| p.fua)
    }

    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn complete_all(mut self, r: BatchResult) {
        for p in std::mem::take(&mut self.pieces) {
            self.cache.complete(p, r.clone());
        }
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        for p in std::mem::take(&mut self.pieces) {
            self.cache.complete(p, Err(BatchError::plain(io::ErrorKind::Interrupted, "stripe batch cancelled")));
        }
    }
}

/// Permits taken by [`StripeCache::reserve`]; what is not consumed by new entries returns when
/// it drops.
pub(crate) struct Reservation<'a> {
    cache: &'a StripeCache,
    left: usize,
}

impl Reservation<'_> {
    fn consume_one(&mut self) {
        // An entry always has a permit: a reservation is made for every stripe a request may
        // create, so this cannot run dry; if it did, the entry borrows one (counted in `used`).
        if self.left > 0 {
            self.left -= 1;
        } else {
            self.cache.used.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.cache.release_permits(self.left);
    }
}

/// Waits for leadership; if the wait is dropped after leadership was handed over, the stripe
/// is released so it does not stay busy forever.
struct LeadWait<'a> {
    cache: &'a StripeCache,
    entry: Arc<StripeEntry>,
    rx: Option<oneshot::Receiver<()>>,
}

impl LeadWait<'_> {
    async fn wait(&mut self) {
        if let Some(rx) = self.rx.as_mut() {
            // The sender is only dropped after a successful hand-over elsewhere, never for us.
            let _ = rx.await;
            self.rx = None;
        }
    }
}

impl Drop for LeadWait<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take()
            && rx.try_recv().is_ok()
        {
            self.cache.release(&self.entry);
        }
    }
}

/// Exclusive use of a stripe until dropped.
pub(crate) struct ExclusiveGuard<'a> {
    cache: &'a StripeCache,
    entry: Arc<StripeEntry>,
}

impl Drop for ExclusiveGuard<'_> {
    fn drop(&mut self) {
        self.cache.release(&self.entry);
    }
}

/// A queued write piece. [`WriteTicket::wait`] resolves to either the piece's result (another
/// task's batch carried it) or leadership of the stripe.
pub(crate) struct WriteTicket<'a> {
    cache: &'a StripeCache,
    pub entry: Arc<StripeEntry>,
    done: Option<oneshot::Receiver<BatchResult>>,
    lead: Option<oneshot::Receiver<()>>,
    leads_now: bool,
    /// Set once this task took leadership (the leader releases, not the ticket).
    leading: bool,
}

pub(crate) enum Turn {
    Done(BatchResult),
    Lead,
}

impl WriteTicket<'_> {
    pub async fn wait(&mut self) -> Turn {
        if self.leads_now {
            self.leads_now = false;
            self.leading = true;
            return Turn::Lead;
        }
        let (Some(done), Some(lead)) = (self.done.as_mut(), self.lead.as_mut()) else {
            return Turn::Done(Err(BatchError::plain(io::ErrorKind::Other, "write ticket used twice")));
        };
        tokio::select! {
            biased;
            r = done => {
                self.done = None;
                Turn::Done(r.unwrap_or_else(|_| Err(BatchError::plain(io::ErrorKind::Interrupted, "stripe batch abandoned"))))
            }
            r = lead => {
                self.lead = None;
                match r {
                    Ok(()) => {
                        self.leading = true;
                        Turn::Lead
                    }
                    // Never dropped without a send while our piece is pending; be safe.
                    Err(_) => Turn::Done(Err(BatchError::plain(io::ErrorKind::Other, "stripe leadership lost"))),
                }
            }
        }
    }

    /// The piece's own result after this task led the batch that carried it.
    pub async fn own_result(&mut self) -> BatchResult {
        match self.done.take() {
            Some(rx) => rx
                .await
                .unwrap_or_else(|_| Err(BatchError::plain(io::ErrorKind::Interrupted, "stripe batch abandoned"))),
            None => Err(BatchError::plain(io::ErrorKind::Other, "write ticket used twice")),
        }
    }
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        // Leadership handed to a ticket whose task went away must not strand the stripe.
        if self.leads_now {
            self.cache.release(&self.entry);
        } else if let Some(mut rx) = self.lead.take()
            && rx.try_recv().is_ok()
        {
            self.cache.release(&self.entry);
        }
    }
}

/// Leadership of a stripe: released (handed over) when dropped, even if the leader's future is
/// cancelled mid-batch.
pub(crate) struct Leadership<'a> {
    pub cache: &'a StripeCache,
    pub entry: Arc<StripeEntry>,
}

impl Drop for Leadership<'_> {
    fn drop(&mut self) {
        self.cache.end_hold(&self.entry);
        self.cache.release(&self.entry);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pieces_batch_behind_a_leader_and_leadership_moves_on() {
        let c = StripeCache::new(17);
        let mut res = c.reserve(1).await;
        let mut t1 = c.enqueue_write(5, Vec::new(), false, false, &mut res);
        drop(res);
        assert!(matches!(t1.wait().await, Turn::Lead));
        assert_eq!(c.active(), 1);
        // Two more pieces queue while t1 leads.
        let mut res = c.reserve(2).await;
        let mut t2 = c.enqueue_write(5, Vec::new(), false, false, &mut res);
        let mut t3 = c.enqueue_write(5, Vec::new(), false, false, &mut res);
        drop(res);
        let l = Leadership { cache: &c, entry: t1.entry.clone() };
        let batch = c.take_batch(&l.entry);
        assert_eq!(batch.len(), 3, "the leader's batch carries every pending piece");
        batch.complete_all(Ok(()));
        drop(l);
        assert!(t1.own_result().await.is_ok());
        assert!(matches!(t2.wait().await, Turn::Done(Ok(()))));
        assert!(matches!(t3.wait().await, Turn::Done(Ok(()))));
        drop((t1, t2, t3));
        assert_eq!(c.active(), 0, "idle entries retire");
        assert_eq!(c.used.load(Ordering::Relaxed), 0, "permits come back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn exclusive_waits_for_the_leader_and_cancelled_waiters_do_not_strand_it() {
        let c = Arc::new(StripeCache::new(17));
        let mut res = c.reserve(1).await;
        let mut t1 = c.enqueue_write(9, Vec::new(), false, false, &mut res);
        drop(res);
        assert!(matches!(t1.wait().await, Turn::Lead));
        let l = Leadership { cache: &c, entry: t1.entry.clone() };
        // A cancelled exclusive waiter, then a live one.
        let c2 = c.clone();
        let cancelled = tokio::spawn(async move {
            let _g = c2.exclusive(9).await;
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        cancelled.abort();
        let _ = cancelled.await;
        let c3 = c.clone();
        let got = tokio::spawn(async move {
            let _g = c3.exclusive(9).await;
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!got.is_finished(), "exclusive waits while the stripe is led");
        c.take_batch(&l.entry).complete_all(Ok(()));
        drop(l);
        tokio::time::timeout(Duration::from_secs(5), got).await.unwrap().unwrap();
        drop(t1);
        assert_eq!(c.active(), 0);
    }

    /// Many tasks, few stripes, random delays: at most one holder per stripe at any time,
    /// every piece completes exactly once with its batch's result, nothing hangs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn stress_mutual_exclusion_and_hand_off() {
        use std::sync::atomic::AtomicU32;
        let c = Arc::new(StripeCache::new(17));
        let holders: Arc<Vec<AtomicU32>> = Arc::new((0..4).map(|_| AtomicU32::new(0)).collect());
        let completed = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for t in 0..24u64 {
            let (c, holders, completed) = (c.clone(), holders.clone(), completed.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = mdkit_io::Rng::new(t);
                for i in 0..300u64 {
                    let stripe = rng.below(4);
                    if rng.below(8) == 0 {
                        let _g = c.exclusive(stripe).await;
                        assert_eq!(holders[stripe as usize].fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        tokio::time::sleep(Duration::from_micros(rng.below(200))).await;
                        holders[stripe as usize].fetch_sub(1, Ordering::SeqCst);
                        continue;
                    }
                    // One or two pieces in different stripes, like a request crossing a stripe.
                    let stripes: Vec<u64> =
                        if rng.below(3) == 0 { vec![stripe, (stripe + 1) % 4] } else { vec![stripe] };
                    let mut res = c.reserve(stripes.len()).await;
                    let tickets: Vec<WriteTicket<'_>> = stripes
                        .iter()
                        .map(|s| c.enqueue_write(*s, Vec::new(), false, rng.below(2) == 0, &mut res))
                        .collect();
                    drop(res);
                    let delay = rng.below(300);
                    let runs = tickets.into_iter().map(|mut tk| {
                        let (c, holders, completed) = (c.clone(), holders.clone(), completed.clone());
                        async move {
                            match tk.wait().await {
                                Turn::Done(r) => r,
                                Turn::Lead => {
                                    let lead = Leadership { cache: &c, entry: tk.entry.clone() };
                                    let s = lead.entry.stripe as usize;
                                    assert_eq!(holders[s].fetch_add(1, Ordering::SeqCst), 0, "two holders");
                                    if delay.is_multiple_of(2) {
                                        tokio::time::sleep(Duration::from_micros(delay)).await;
                                    }
                                    let batch = c.take_batch(&lead.entry);
                                    completed.fetch_add(batch.len() as u64, Ordering::SeqCst);
                                    tokio::time::sleep(Duration::from_micros(delay / 2)).await;
                                    holders[s].fetch_sub(1, Ordering::SeqCst);
                                    batch.complete_all(Ok(()));
                                    drop(lead);
                                    tk.own_result().await
                                }
                            }
                        }
                    });
                    for r in crate::array::io::join_all(runs).await {
                        r.unwrap_or_else(|e| panic!("task {t} op {i}: {e:?}"));
                    }
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(60), t).await.expect("no hang").unwrap();
        }
        assert_eq!(c.active(), 0);
        assert_eq!(c.used.load(Ordering::SeqCst), 0);
        assert_eq!(c.inflight_pieces.load(Ordering::SeqCst), 0);
        assert!(completed.load(Ordering::SeqCst) > 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reservations_are_bounded_and_all_or_nothing() {
        let c = Arc::new(StripeCache::new(4));
        let r1 = c.reserve(3).await;
        let c2 = c.clone();
        let waiter = tokio::spawn(async move {
            let _r = c2.reserve(2).await;
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished(), "2 more do not fit in 4 with 3 out");
        drop(r1);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap();
        // A reservation larger than the cache proceeds when nothing else holds permits.
        drop(c.reserve(10).await);
        assert_eq!(c.used.load(Ordering::Relaxed), 0);
    }
}
