//! The data path's own view of one thin device's mappings, and the bio-prison equivalent.
//!
//! Every thin device that has an open [`ThinVolume`](super::ThinVolume) owns a `MappingTable`:
//! 64 shards (by virtual block), each a short `parking_lot` mutex over a hash map from virtual
//! block to an [`Entry`]. An entry is two things at once:
//!
//! ```text
//!   known     Unmapped | Mapped{data block, time, txn} | Unknown   (what the metadata says)
//!   cell      Some(..) while a slow-path operation owns the block    (dm-thin's bio prison cell)
//! ```
//!
//! Fast-path I/O in flight is counted per shard, not per entry, in two epochs (dm-thin's
//! all_io_ds deferred set, which is pool-wide, in finer grain): an I/O counts in the shard's
//! current epoch and its end decrements that count — the shard's own cache line, no second
//! lookup of the entry (which, with the table spread over a MiB of memory, cost a cache miss per
//! I/O). A slow-path operation that needs the I/O already in flight to finish flips the epoch
//! and waits for the old one to drain; I/O that starts later counts in the new epoch and cannot
//! touch the block (its cell is held), so the wait is bounded.
//!
//! * Fast path (no cell, mapped, unshared for a write): under the shard lock count the I/O in
//!   the current epoch, drop the lock, do the data I/O, end it (`end_io`). No metadata lock, no
//!   worker, no pool-wide state.
//! * Slow path (provision, break sharing, discard, or a lookup that missed): take the cell
//!   (creating an `Unknown` entry if needed), wait until the fast-path I/O of the shard that
//!   started before drains, do the work, then release the cell with the new `known` state;
//!   waiters queued on the cell retry.
//! * Every change of a mapping of this device goes through its cell, so a `Mapped` or `Unmapped`
//!   entry without a cell is always what the metadata says (the invariant that makes the table a
//!   coherent cache, not a guess). The one thing that changes without cells is *sharing*: a
//!   snapshot of this device raises `snapshotted_time`; [`MappingTable::freeze`] stops and drains
//!   writes first (dm-thin requires the origin to be suspended for `create_snap`).
//! * Bounded: at most `capacity_entries` entries; entries without a cell are evicted and
//!   reloaded from the metadata on the next access (I/O still in flight on an evicted entry is
//!   counted by its shard, so a slow path that re-creates the entry still waits for it).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

/// Shards per table (a power of two: sequential blocks land on different shards).
pub(crate) const SHARDS: usize = 64;

/// A mapping as the data path caches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cached {
    pub data_block: u64,
    /// 24-bit mapping time (shared iff the device's snapshotted time is greater).
    pub time: u32,
    /// Pool transaction the mapping was made in; committed iff `txn <= committed_txn`
    /// (0 = known committed).
    pub txn: u64,
}

/// What the metadata says about one virtual block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// Not known (only while a cell is held, e.g. during a lookup).
    Unknown,
    Unmapped,
    Mapped(Cached),
}

/// A bio-prison cell: held by one slow-path operation; others queue on it.
#[derive(Default)]
struct Cell {
    waiters: Vec<oneshot::Sender<()>>,
}

struct Entry {
    known: Known,
    cell: Option<Box<Cell>>,
}

/// Fast-path I/O in flight in one shard, in two epochs (see the module documentation).
#[derive(Default)]
struct Inflight {
    /// The epoch new fast-path I/O counts in (0 or 1).
    epoch: u8,
    active: [u32; 2],
    /// Drainers waiting for `active[e]` to reach zero.
    waiting: [Vec<oneshot::Sender<()>>; 2],
    /// Drainers that came while the other epoch was still draining: the epoch flips for them
    /// once it has drained, and they then wait for the epoch they started in.
    pending_flip: Vec<oneshot::Sender<()>>,
}

impl Inflight {
    fn begin(&mut self) -> u8 {
        self.active[usize::from(self.epoch)] += 1;
        self.epoch
    }

    fn end(&mut self, epoch: u8) {
        let e = usize::from(epoch & 1);
        debug_assert!(self.active[e] > 0, "fast-path I/O ended twice (epoch {e})");
        self.active[e] = self.active[e].saturating_sub(1);
        if self.active[e] != 0 {
            return;
        }
        for w in self.waiting[e].drain(..) {
            let _ = w.send(());
        }
        let cur = usize::from(self.epoch);
        if e != cur && !self.pending_flip.is_empty() {
            if self.active[cur] == 0 {
                for w in self.pending_flip.drain(..) {
                    let _ = w.send(());
                }
            } else {
                self.epoch = e as u8;
                let pending = std::mem::take(&mut self.pending_flip);
                self.waiting[cur].extend(pending);
            }
        }
    }

    /// A receiver that fires once every fast-path I/O begun so far has ended (`None`: none is
    /// in flight).
    fn drain(&mut self) -> Option<oneshot::Receiver<()>> {
        let cur = usize::from(self.epoch);
        let old = cur ^ 1;
        if self.active[cur] == 0 && self.active[old] == 0 {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        if self.active[old] == 0 {
            // Everything in flight is in `cur`: new I/O goes to the other epoch from now on.
            self.epoch = old as u8;
            self.waiting[cur].push(tx);
        } else {
            self.pending_flip.push(tx);
        }
        Some(rx)
    }
}

/// Cheap, well-mixed hash for block numbers (keys of one shard share their low 6 bits).
#[derive(Default)]
pub(crate) struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        let p = u128::from(v ^ self.0) * 0x9e37_79b9_7f4a_7c15_u128;
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

type BlockMap<V> = HashMap<u64, V, BuildHasherDefault<BlockHasher>>;

/// Counters kept under the shard locks (no shared cache line on the fast path).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableCounters {
    pub fast_reads: u64,
    pub fast_writes: u64,
    pub zero_reads: u64,
    pub slow_ops: u64,
    pub cell_waits: u64,
    pub evictions: u64,
}

impl TableCounters {
    fn add(&mut self, o: &TableCounters) {
        self.fast_reads += o.fast_reads;
        self.fast_writes += o.fast_writes;
        self.zero_reads += o.zero_reads;
        self.slow_ops += o.slow_ops;
        self.cell_waits += o.cell_waits;
        self.evictions += o.evictions;
    }
}

#[derive(Default)]
struct Shard {
    map: BlockMap<Entry>,
    inflight: Inflight,
    /// Writes (fast or slow) that passed the freeze gate and have not finished.
    writes: u32,
    frozen: bool,
    counters: TableCounters,
}

/// One cache line per shard so shards do not share lines.
#[repr(align(128))]
#[derive(Default)]
struct PaddedShard(Mutex<Shard>);

/// Decision for a read of one virtual block.
pub(crate) enum ReadDecision {
    /// Read the data block; the I/O was counted in `epoch` (end it with `end_io`).
    Mapped { data_block: u64, epoch: u8 },
    /// Unmapped: the block reads as zeroes.
    Zeroes,
    /// A slow-path operation holds the block: wait, then decide again.
    Wait(oneshot::Receiver<()>),
    /// The caller now holds the cell and must resolve the mapping (wait for `drained` first).
    Resolve { drained: Option<oneshot::Receiver<()>> },
}

/// Decision for a write of one virtual block.
pub(crate) enum WriteDecision {
    /// Mapped and unshared: write in place; the I/O was counted in `epoch` (end it with
    /// `end_io`).
    InPlace {
        data_block: u64,
        txn: u64,
        epoch: u8,
    },
    Wait(oneshot::Receiver<()>),
    /// Writes are frozen for a snapshot of this device: wait for the thaw, then decide again.
    Frozen,
    /// The caller holds the cell (and a write reference): provision, break sharing, or resolve.
    Slow {
        known: Known,
        drained: Option<oneshot::Receiver<()>>,
    },
}

/// Decision when taking a cell for a non-write slow-path operation (discard, lookup).
pub(crate) enum AcquireDecision {
    Acquired { known: Known, drained: Option<oneshot::Receiver<()>> },
    Wait(oneshot::Receiver<()>),
}

pub(crate) struct MappingTable {
    shards: Box<[PaddedShard]>,
    /// The device's snapshotted time: a mapping is shared iff this is greater than its time.
    snapshotted_time: AtomicU32,
    capacity_per_shard: usize,
    /// Set while a freeze is in progress (mirrors the shards' flags, for a cheap check).
    freezing: AtomicBool,
    thawed: Notify,
    drained: Notify,
}

impl MappingTable {
    pub fn new(snapshotted_time: u32, capacity_entries: usize) -> MappingTable {
        MappingTable {
            shards: (0..SHARDS).map(|_| PaddedShard::default()).collect(),
            snapshotted_time: AtomicU32::new(snapshotted_time),
            capacity_per_shard: (capacity_entries / SHARDS).max(16),
            freezing: AtomicBool::new(false),
            thawed: Notify::new(),
            drained: Notify::new(),
        }
    }

    fn shard(&self, vblock: u64) -> &Mutex<Shard> {
        &self.shards[(vblock % SHARDS as u64) as usize].0
    }

    pub fn is_shared(&self, c: &Cached) -> bool {
        self.snapshotted_time.load(Ordering::Acquire) > c.time
    }

    /// Decides a read. `max_valid_txn`: cached mappings of later transactions are not trusted
    /// (after a failed commit the metadata went back to the last commit).
    pub fn begin_read(&self, vblock: u64, max_valid_txn: u64) -> ReadDecision {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        match s.map.get_mut(&vblock) {
            Some(e) if e.cell.is_some() => {
                s.counters.cell_waits += 1;
                ReadDecision::Wait(queue_on(e))
            }
            Some(Entry { known: Known::Unmapped, .. }) => {
                s.counters.zero_reads += 1;
                ReadDecision::Zeroes
            }
            Some(e) if matches!(e.known, Known::Mapped(c) if c.txn <= max_valid_txn) => {
                let Known::Mapped(c) = e.known else { unreachable!("matched Mapped above") };
                s.counters.fast_reads += 1;
                ReadDecision::Mapped { data_block: c.data_block, epoch: s.inflight.begin() }
            }
            Some(e) => {
                // Unknown without a cell, or an untrusted mapping: resolve again.
                e.known = Known::Unknown;
                let drained = take_cell(e, &mut s.inflight);
                s.counters.slow_ops += 1;
                ReadDecision::Resolve { drained }
            }
            None => {
                // An evicted entry may still have fast-path I/O in flight: drain like any cell.
                s.map.insert(vblock, Entry { known: Known::Unknown, cell: Some(Box::default()) });
                s.counters.slow_ops += 1;
                ReadDecision::Resolve { drained: s.inflight.drain() }
            }
        }
    }

    /// Decides a write: in place (mapped, unshared), or the slow path with the cell held.
    pub fn begin_write(&self, vblock: u64) -> WriteDecision {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        if s.frozen {
            return WriteDecision::Frozen;
        }
        // Read under the shard lock: `thaw` stores the new time before it unfreezes the shards
        // (under their locks), so a writer that passes the gate after a snapshot sees it.
        let snap_time = self.snapshotted_time.load(Ordering::Acquire);
        match s.map.get_mut(&vblock) {
            Some(e) if e.cell.is_some() => {
                s.counters.cell_waits += 1;
                WriteDecision::Wait(queue_on(e))
            }
            Some(e) if matches!(e.known, Known::Mapped(c) if snap_time <= c.time) => {
                let Known::Mapped(c) = e.known else { unreachable!("matched Mapped above") };
                s.writes += 1;
                s.counters.fast_writes += 1;
                WriteDecision::InPlace { data_block: c.data_block, txn: c.txn, epoch: s.inflight.begin() }
            }
            Some(e) => {
                let known = e.known;
                let drained = take_cell(e, &mut s.inflight);
                s.writes += 1;
                s.counters.slow_ops += 1;
                WriteDecision::Slow { known, drained }
            }
            None => {
                s.map.insert(vblock, Entry { known: Known::Unknown, cell: Some(Box::default()) });
                s.writes += 1;
                s.counters.slow_ops += 1;
                WriteDecision::Slow { known: Known::Unknown, drained: s.inflight.drain() }
            }
        }
    }

    /// Takes the cell of `vblock` for a slow-path operation that is not a write.
    pub fn acquire(&self, vblock: u64) -> AcquireDecision {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        match s.map.get_mut(&vblock) {
            Some(e) if e.cell.is_some() => {
                s.counters.cell_waits += 1;
                AcquireDecision::Wait(queue_on(e))
            }
            Some(e) => {
                let known = e.known;
                let drained = take_cell(e, &mut s.inflight);
                AcquireDecision::Acquired { known, drained }
            }
            None => {
                s.map.insert(vblock, Entry { known: Known::Unknown, cell: Some(Box::default()) });
                AcquireDecision::Acquired { known: Known::Unknown, drained: s.inflight.drain() }
            }
        }
    }

    /// Ends a fast-path I/O started by `begin_read` (`write = false`) or `begin_write`, with the
    /// epoch its decision carried. Touches only the shard, not the entry.
    pub fn end_io(&self, vblock: u64, epoch: u8, write: bool) {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        s.inflight.end(epoch);
        if write {
            end_write(s, &self.drained);
        }
    }

    /// Releases the cell of `vblock` with what the metadata now says, waking every waiter.
    /// `write`: the cell was taken by `begin_write` (its write reference ends too).
    pub fn release(&self, vblock: u64, known: Known, write: bool) {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        let mut remove = false;
        if let Some(e) = s.map.get_mut(&vblock) {
            e.known = known;
            if let Some(c) = e.cell.take() {
                for w in c.waiters {
                    let _ = w.send(());
                }
            }
            remove = known == Known::Unknown;
        } else {
            debug_assert!(false, "release of block {vblock} that has no entry");
        }
        if remove {
            s.map.remove(&vblock);
        }
        if write {
            end_write(s, &self.drained);
        }
        if s.map.len() > self.capacity_per_shard {
            evict(s, self.capacity_per_shard);
        }
    }

    /// Stops new writes and waits until every write in flight has finished (fast and slow).
    /// The caller must `thaw` afterwards. Reads continue.
    pub async fn freeze(&self) {
        self.freezing.store(true, Ordering::Release);
        for sh in self.shards.iter() {
            sh.0.lock().frozen = true;
        }
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shards.iter().all(|sh| sh.0.lock().writes == 0) {
                return;
            }
            notified.await;
        }
    }

    /// Sets the snapshotted time (while frozen) and lets writes go again.
    pub fn thaw(&self, snapshotted_time: Option<u32>) {
        if let Some(t) = snapshotted_time {
            self.snapshotted_time.store(t, Ordering::Release);
        }
        for sh in self.shards.iter() {
            sh.0.lock().frozen = false;
        }
        self.freezing.store(false, Ordering::Release);
        self.thawed.notify_waiters();
    }

    /// Waits for a freeze to end (after `begin_write` said `Frozen`).
    pub async fn wait_thawed(&self) {
        let notified = self.thawed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if !self.freezing.load(Ordering::Acquire) {
            return;
        }
        notified.await;
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().map.len()).sum()
    }

    pub fn counters(&self) -> TableCounters {
        let mut c = TableCounters::default();
        for s in self.shards.iter() {
            let g = s.0.lock();
            c.add(&g.counters);
        }
        c
    }
}

fn queue_on(e: &mut Entry) -> oneshot::Receiver<()> {
    let (tx, rx) = oneshot::channel();
    e.cell.as_mut().expect("caller checked the cell is held").waiters.push(tx);
    rx
}

/// Takes the (free) cell of an entry; the receiver fires when the fast-path I/O in flight in
/// the shard has drained.
fn take_cell(e: &mut Entry, inflight: &mut Inflight) -> Option<oneshot::Receiver<()>> {
    debug_assert!(e.cell.is_none());
    e.cell = Some(Box::<Cell>::default());
    inflight.drain()
}

fn end_write(s: &mut Shard, drained: &Notify) {
    debug_assert!(s.writes > 0);
    s.writes = s.writes.saturating_sub(1);
    if s.frozen && s.writes == 0 {
        drained.notify_waiters();
    }
}

/// Drops idle entries until the shard is at 7/8 of its capacity.
fn evict(s: &mut Shard, capacity: usize) {
    let target = capacity - capacity / 8;
    let mut excess = s.map.len().saturating_sub(target);
    let before = s.map.len();
    s.map.retain(|_, e| {
        if excess > 0 && e.cell.is_none() {
            excess -= 1;
            false
        } else {
            true
        }
    });
    s.counters.evictions += (before - s.map.len()) as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(b: u64, time: u32) -> Known {
        Known::Mapped(Cached { data_block: b, time, txn: 0 })
    }

    #[test]
    fn miss_then_fast_path_then_shared() {
        let t = MappingTable::new(0, 1 << 16);
        assert!(matches!(t.begin_read(5, u64::MAX), ReadDecision::Resolve { drained: None }));
        // A second reader queues on the cell.
        let ReadDecision::Wait(mut rx) = t.begin_read(5, u64::MAX) else { panic!("expected to wait") };
        t.release(5, mapped(9, 0), false);
        assert!(rx.try_recv().is_ok(), "the waiter is woken");
        assert!(matches!(t.begin_read(5, u64::MAX), ReadDecision::Mapped { data_block: 9, epoch: 0 }));
        t.end_io(5, 0, false);
        assert!(matches!(t.begin_write(5), WriteDecision::InPlace { data_block: 9, epoch: 0, .. }));
        t.end_io(5, 0, true);
        // A snapshot makes the mapping shared: writes take the slow path.
        t.thaw(Some(1));
        assert!(matches!(t.begin_write(5), WriteDecision::Slow { known, .. } if known == mapped(9, 0)));
        t.release(5, mapped(10, 1), true);
        assert!(matches!(t.begin_write(5), WriteDecision::InPlace { data_block: 10, epoch: 0, .. }));
        t.end_io(5, 0, true);
    }

    #[test]
    fn slow_path_waits_for_in_flight_io_to_drain() {
        let t = MappingTable::new(0, 1 << 16);
        let AcquireDecision::Acquired { .. } = t.acquire(3) else { panic!() };
        t.release(3, mapped(1, 0), false);
        assert!(matches!(t.begin_read(3, u64::MAX), ReadDecision::Mapped { epoch: 0, .. }));
        let AcquireDecision::Acquired { drained: Some(mut d), .. } = t.acquire(3) else {
            panic!("must wait for drain")
        };
        assert!(d.try_recv().is_err());
        t.end_io(3, 0, false);
        assert!(d.try_recv().is_ok());
        t.release(3, Known::Unmapped, false);
        assert!(matches!(t.begin_read(3, u64::MAX), ReadDecision::Zeroes));
    }

    /// A drainer waits for exactly the I/O begun before it, even while the shard stays busy:
    /// I/O begun later counts in the other epoch.
    #[test]
    fn drain_waits_for_earlier_io_only() {
        let mut f = Inflight::default();
        assert!(f.drain().is_none(), "nothing in flight");
        let a = f.begin();
        let mut d1 = f.drain().expect("a is in flight");
        let b = f.begin(); // after the flip
        assert_ne!(a, b);
        f.end(b);
        assert!(d1.try_recv().is_err(), "a is still in flight");
        let c = f.begin();
        f.end(a);
        assert!(d1.try_recv().is_ok(), "everything begun before the drain has ended");
        // c is in flight in the current epoch, nothing in the other: the next drain flips.
        let mut d2 = f.drain().expect("c is in flight");
        let e = f.begin();
        f.end(c);
        assert!(d2.try_recv().is_ok());
        f.end(e);
        assert!(f.drain().is_none());
    }

    /// A drain that comes while an earlier epoch is still draining waits for both: the old
    /// epoch first, then (after the flip) the one it started in.
    #[test]
    fn drain_during_a_drain_waits_for_both_epochs() {
        let mut f = Inflight::default();
        let a = f.begin();
        let mut d1 = f.drain().unwrap(); // flips: a is in the old epoch
        let b = f.begin(); // new epoch
        let mut d2 = f.drain().unwrap(); // cannot flip while a drains: pending
        let c = f.begin(); // still the epoch of b
        f.end(a);
        assert!(d1.try_recv().is_ok());
        assert!(d2.try_recv().is_err(), "b was begun before d2 and is in flight");
        let late = f.begin(); // after the flip for d2: the other epoch
        f.end(b);
        assert!(d2.try_recv().is_err(), "c was begun before d2");
        f.end(c);
        assert!(d2.try_recv().is_ok());
        f.end(late);
        assert!(f.drain().is_none());
        assert_eq!(f.active, [0, 0]);
    }

    /// An entry evicted while its I/O is in flight: the slow path that re-creates it still
    /// waits for that I/O.
    #[test]
    fn evicted_entry_with_io_in_flight_still_drains() {
        let t = MappingTable::new(0, 16 * SHARDS);
        let AcquireDecision::Acquired { .. } = t.acquire(0) else { panic!() };
        t.release(0, mapped(1, 0), false);
        let ReadDecision::Mapped { epoch, .. } = t.begin_read(0, u64::MAX) else { panic!() };
        // Fill shard 0 far beyond its capacity so block 0's entry is evicted.
        for k in 1..200u64 {
            let vb = k * SHARDS as u64;
            let AcquireDecision::Acquired { .. } = t.acquire(vb) else { panic!() };
            t.release(vb, Known::Unmapped, false);
        }
        let AcquireDecision::Acquired { known: Known::Unknown, drained: Some(mut d) } = t.acquire(0) else {
            panic!("block 0 was evicted and its read is still in flight")
        };
        assert!(d.try_recv().is_err());
        t.end_io(0, epoch, false);
        assert!(d.try_recv().is_ok());
    }

    #[test]
    fn untrusted_mappings_are_resolved_again() {
        let t = MappingTable::new(0, 1 << 16);
        let AcquireDecision::Acquired { .. } = t.acquire(1) else { panic!() };
        t.release(1, Known::Mapped(Cached { data_block: 4, time: 0, txn: 7 }), false);
        assert!(matches!(t.begin_read(1, 7), ReadDecision::Mapped { epoch: 0, .. }));
        t.end_io(1, 0, false);
        assert!(matches!(t.begin_read(1, 6), ReadDecision::Resolve { .. }));
    }

    #[test]
    fn freeze_blocks_writes_until_thaw_and_waits_for_drain() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let t = std::sync::Arc::new(MappingTable::new(0, 1 << 16));
            let AcquireDecision::Acquired { .. } = t.acquire(2) else { panic!() };
            t.release(2, mapped(3, 0), false);
            assert!(matches!(t.begin_write(2), WriteDecision::InPlace { epoch: 0, .. }));
            let t2 = t.clone();
            let freezer = tokio::spawn(async move { t2.freeze().await });
            tokio::task::yield_now().await;
            assert!(!freezer.is_finished(), "a write is still in flight");
            assert!(matches!(t.begin_write(7), WriteDecision::Frozen));
            t.end_io(2, 0, true);
            freezer.await.unwrap();
            t.thaw(Some(5));
            t.wait_thawed().await;
            assert!(matches!(t.begin_write(2), WriteDecision::Slow { .. }), "shared after the snapshot");
        });
    }

    #[test]
    fn idle_entries_are_evicted_beyond_capacity() {
        let t = MappingTable::new(0, 16 * SHARDS);
        for vb in 0..(64 * SHARDS as u64) {
            let AcquireDecision::Acquired { .. } = t.acquire(vb) else { panic!() };
            t.release(vb, Known::Unmapped, false);
        }
        assert!(t.len() <= 16 * SHARDS, "{}", t.len());
        assert!(t.counters().evictions > 0);
    }
}
