//! The data path's own view of one thin device's mappings, and the bio-prison equivalent.
//!
//! Every thin device that has an open [`ThinVolume`](super::ThinVolume) owns a `MappingTable`:
//! 64 shards (by virtual block), each a short `parking_lot` mutex over
//!
//! ```text
//!   sets      cached mappings: Unmapped | Mapped{data block, time, txn}  (what the metadata says)
//!   cells     blocks a slow-path operation owns now       (dm-thin's bio prison cells)
//!   inflight  fast-path I/O in flight, counted in two epochs
//! ```
//!
//! **Made for one cache miss per lookup.** The mappings are a 2-way set-associative cache
//! indexed by the virtual block (`vblock / 64`, so a dense volume fills every set before any
//! two blocks collide): one 64-byte line holds a set, two 32-byte slots, key and value inline.
//! The fast path touches two cache lines, the shard's first (its lock, the pointer to the sets
//! and every counter the fast path changes) and the block's set, where a `HashMap` touched five
//! (the lock, the map header, the control bytes, the bucket, the freeze flag): with the kernel's
//! I/O path running between two requests, each of those was a miss (a profile of 4 KiB QD32
//! requests put 83% of `begin_write`'s samples on the control-byte and bucket loads). A set
//! that is full loses its older slot (counted as an eviction); the next access reloads that
//! mapping from the metadata. Sets start small and double up to the configured capacity.
//!
//! Fast-path I/O in flight is counted per shard, not per entry, in two epochs (dm-thin's
//! all_io_ds deferred set, which is pool-wide, in finer grain): an I/O counts in the shard's
//! current epoch and its end decrements that count, in the shard's first line. A slow-path
//! operation that needs the I/O already in flight to finish flips the epoch and waits for the
//! old one to drain; I/O that starts later counts in the new epoch and cannot touch the block
//! (its cell is held), so the wait is bounded.
//!
//! * Fast path (no cell, mapped, unshared for a write): under the shard lock count the I/O in
//!   the current epoch, drop the lock, do the data I/O, end it (`end_io`). No metadata lock, no
//!   worker, no pool-wide state.
//! * Slow path (provision, break sharing, discard, or a lookup that missed): take the cell,
//!   wait until the fast-path I/O of the shard that started before drains, do the work, then
//!   release the cell with the new state, which goes into the sets; waiters queued on the cell
//!   retry.
//! * Every change of a mapping of this device goes through its cell, and a held cell shadows
//!   whatever the sets hold for its block, so a slot is always what the metadata says (the
//!   invariant that makes the table a coherent cache, not a guess). The one thing that changes
//!   without cells is *sharing*: a snapshot of this device raises `snapshotted_time`;
//!   [`MappingTable::freeze`] stops and drains writes first (dm-thin requires the origin to be
//!   suspended for `create_snap`).
//! * Bounded: at most `capacity_entries` cached mappings. I/O still in flight on an evicted
//!   mapping is counted by its shard, so a slow path that reloads it still waits for that I/O.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

/// Shards per table (a power of two: sequential blocks land on different shards).
pub(crate) const SHARDS: usize = 64;

/// Sets a shard starts with (2 slots each); they double as mappings are cached.
const INITIAL_SETS: usize = 4;

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

/// The key of an empty slot (no virtual block is this large).
const EMPTY: u64 = u64::MAX;

/// One cached mapping, key and value inline.
#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Virtual block, or `EMPTY`.
    vblock: u64,
    data_block: u64,
    txn: u64,
    time: u32,
    /// False: the block is unmapped (reads as zeroes).
    mapped: bool,
}

impl Slot {
    const EMPTY: Slot = Slot { vblock: EMPTY, data_block: 0, txn: 0, time: 0, mapped: false };

    /// A slot for `vblock`: mapped to `mapping`, or unmapped.
    fn new(vblock: u64, mapping: Option<Cached>) -> Slot {
        match mapping {
            Some(c) => Slot { vblock, data_block: c.data_block, txn: c.txn, time: c.time, mapped: true },
            None => Slot { vblock, ..Slot::EMPTY },
        }
    }

    fn known(&self) -> Known {
        if self.mapped {
            Known::Mapped(Cached { data_block: self.data_block, time: self.time, txn: self.txn })
        } else {
            Known::Unmapped
        }
    }
}

/// Two slots in one cache line; way 0 holds the mapping cached last.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
struct Set([Slot; 2]);

const _: () = assert!(std::mem::size_of::<Slot>() == 32);
const _: () = assert!(std::mem::size_of::<Set>() == 64);

impl Set {
    const EMPTY: Set = Set([Slot::EMPTY; 2]);

    fn way(&self, vblock: u64) -> Option<usize> {
        if self.0[0].vblock == vblock {
            Some(0)
        } else if self.0[1].vblock == vblock {
            Some(1)
        } else {
            None
        }
    }
}

/// Fast-path I/O in flight in one shard, in two epochs (see the module documentation). Lives
/// in the shard's first cache line; the drainers waiting on it live in [`Drainers`].
#[repr(C)]
#[derive(Default)]
struct Inflight {
    active: [u32; 2],
    /// The epoch new fast-path I/O counts in (0 or 1).
    epoch: u8,
    /// Some drainer is waiting (so `end` only looks at `Drainers` when it must).
    draining: bool,
}

/// Slow-path operations waiting for a shard's fast-path I/O to drain.
#[derive(Default)]
struct Drainers {
    /// Drainers waiting for `active[e]` to reach zero.
    waiting: [Vec<oneshot::Sender<()>>; 2],
    /// Drainers that came while the other epoch was still draining: the epoch flips for them
    /// once it has drained, and they then wait for the epoch they started in.
    pending_flip: Vec<oneshot::Sender<()>>,
}

impl Drainers {
    fn is_empty(&self) -> bool {
        self.waiting[0].is_empty() && self.waiting[1].is_empty() && self.pending_flip.is_empty()
    }
}

impl Inflight {
    fn begin(&mut self) -> u8 {
        self.active[usize::from(self.epoch)] += 1;
        self.epoch
    }

    fn end(&mut self, epoch: u8, d: &mut Drainers) {
        let e = usize::from(epoch & 1);
        debug_assert!(self.active[e] > 0, "fast-path I/O ended twice (epoch {e})");
        self.active[e] = self.active[e].saturating_sub(1);
        if self.active[e] != 0 || !self.draining {
            return;
        }
        for w in d.waiting[e].drain(..) {
            let _ = w.send(());
        }
        let cur = usize::from(self.epoch);
        if e != cur && !d.pending_flip.is_empty() {
            if self.active[cur] == 0 {
                for w in d.pending_flip.drain(..) {
                    let _ = w.send(());
                }
            } else {
                self.epoch = e as u8;
                let pending = std::mem::take(&mut d.pending_flip);
                d.waiting[cur].extend(pending);
            }
        }
        self.draining = !d.is_empty();
    }

    /// A receiver that fires once every fast-path I/O begun so far has ended (`None`: none is
    /// in flight).
    fn drain(&mut self, d: &mut Drainers) -> Option<oneshot::Receiver<()>> {
        let cur = usize::from(self.epoch);
        let old = cur ^ 1;
        if self.active[cur] == 0 && self.active[old] == 0 {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        if self.active[old] == 0 {
            // Everything in flight is in `cur`: new I/O goes to the other epoch from now on.
            self.epoch = old as u8;
            d.waiting[cur].push(tx);
        } else {
            d.pending_flip.push(tx);
        }
        self.draining = true;
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

/// The counters the fast path does not change.
#[derive(Default)]
struct SlowCounters {
    zero_reads: u64,
    slow_ops: u64,
    cell_waits: u64,
    evictions: u64,
}

/// One shard. `repr(C)`, hot fields first: with the lock byte before it (parking_lot's
/// `Mutex` puts its state first) they all sit in the shard's first cache line (checked by a
/// test); the rest is only touched by the slow path.
#[repr(C)]
struct Shard {
    sets: Box<[Set]>,
    fast_reads: u64,
    fast_writes: u64,
    inflight: Inflight,
    /// Cells held in this shard (`cells.len()`, kept here so the fast path need not read the
    /// map's header, which is in another cache line).
    cells_held: u32,
    /// Writes (fast or slow) that passed the freeze gate and have not finished.
    writes: u32,
    frozen: bool,
    // --- cold ---
    cells: BlockMap<Cell>,
    drainers: Drainers,
    /// Occupied slots.
    used: usize,
    /// The most sets this shard grows to (a power of two).
    max_sets: usize,
    counters: SlowCounters,
}

impl Shard {
    fn new(max_sets: usize) -> Shard {
        Shard {
            sets: vec![Set::EMPTY; INITIAL_SETS.min(max_sets)].into_boxed_slice(),
            fast_reads: 0,
            fast_writes: 0,
            inflight: Inflight::default(),
            cells_held: 0,
            writes: 0,
            frozen: false,
            cells: BlockMap::default(),
            drainers: Drainers::default(),
            used: 0,
            max_sets,
            counters: SlowCounters::default(),
        }
    }

    /// See `MappingTable::set_hints`.
    fn set_hint(&self) -> usize {
        self.sets.as_ptr() as usize | self.sets.len().trailing_zeros() as usize
    }

    fn set_index(&self, vblock: u64) -> usize {
        (vblock / SHARDS as u64) as usize & (self.sets.len() - 1)
    }

    /// The cached mapping of `vblock` (shadowed by a held cell: check `cell` first).
    fn lookup(&self, vblock: u64) -> Option<&Slot> {
        let set = &self.sets[self.set_index(vblock)];
        set.way(vblock).map(|w| &set.0[w])
    }

    /// The cell of `vblock`, if one is held.
    fn cell(&mut self, vblock: u64) -> Option<&mut Cell> {
        if self.cells_held == 0 {
            return None;
        }
        self.cells.get_mut(&vblock)
    }

    /// Takes the (free) cell of `vblock`; the receiver fires when the fast-path I/O in flight
    /// in the shard has drained.
    fn take_cell(&mut self, vblock: u64) -> Option<oneshot::Receiver<()>> {
        let old = self.cells.insert(vblock, Cell::default());
        debug_assert!(old.is_none(), "cell of block {vblock} taken twice");
        self.cells_held = self.cells.len() as u32;
        self.inflight.drain(&mut self.drainers)
    }

    /// Caches what the metadata says about `vblock` (`Unknown`: forget it).
    fn store(&mut self, vblock: u64, known: Known) {
        let mapping = match known {
            Known::Mapped(c) => Some(c),
            Known::Unmapped => None,
            Known::Unknown => return self.forget(vblock),
        };
        let slot = Slot::new(vblock, mapping);
        let i = self.set_index(vblock);
        if let Some(w) = self.sets[i].way(vblock) {
            self.sets[i].0[w] = slot;
            return;
        }
        if self.used * 4 >= self.sets.len() * 2 * 3 && self.sets.len() < self.max_sets {
            self.grow();
        }
        let i = self.set_index(vblock);
        let set = &mut self.sets[i];
        if set.0[0].vblock == EMPTY {
            set.0[0] = slot;
            self.used += 1;
        } else {
            if set.0[1].vblock == EMPTY {
                self.used += 1;
            } else {
                self.counters.evictions += 1;
            }
            set.0[1] = set.0[0];
            set.0[0] = slot;
        }
    }

    /// Drops the cached mapping of `vblock`, if any.
    fn forget(&mut self, vblock: u64) {
        let i = self.set_index(vblock);
        let set = &mut self.sets[i];
        if let Some(w) = set.way(vblock) {
            if w == 0 {
                set.0[0] = set.0[1];
            }
            set.0[1] = Slot::EMPTY;
            self.used -= 1;
        }
    }

    /// Doubles the sets. Set `i` splits into `i` and `i + n`, so nothing is lost.
    fn grow(&mut self) {
        let n = self.sets.len();
        let mut sets = vec![Set::EMPTY; n * 2].into_boxed_slice();
        let mut fill = vec![0u8; n * 2];
        for set in self.sets.iter() {
            for slot in set.0.iter().filter(|s| s.vblock != EMPTY) {
                let i = (slot.vblock / SHARDS as u64) as usize & (n * 2 - 1);
                sets[i].0[usize::from(fill[i])] = *slot;
                fill[i] += 1;
            }
        }
        self.sets = sets;
    }
}

/// One cache line per shard so shards do not share lines.
#[repr(align(64))]
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

/// `repr(align(64))`: the fields every lookup reads do not share a line with the reference
/// count of the `Arc<ThinDev>` that holds the table (changed by every request).
#[repr(align(64))]
pub(crate) struct MappingTable {
    shards: Box<[PaddedShard]>,
    /// Per shard: the address of its sets with log2 of their number in the low 6 bits (sets
    /// are 64-byte aligned). Only a hint for `prefetch`, written under the shard lock whenever
    /// the sets move; never dereferenced.
    set_hints: Box<[AtomicUsize]>,
    /// The device's snapshotted time: a mapping is shared iff this is greater than its time.
    snapshotted_time: AtomicU32,
    /// Set while a freeze is in progress (mirrors the shards' flags, for a cheap check).
    freezing: AtomicBool,
    thawed: Notify,
    drained: Notify,
}

impl MappingTable {
    pub fn new(snapshotted_time: u32, capacity_entries: usize) -> MappingTable {
        let per_shard = (capacity_entries / SHARDS).max(16);
        // The largest power of two of sets whose slots fit in the capacity.
        let max_sets = 1usize << (per_shard / 2).ilog2();
        let shards: Box<[PaddedShard]> = (0..SHARDS).map(|_| PaddedShard(Mutex::new(Shard::new(max_sets)))).collect();
        MappingTable {
            set_hints: shards.iter().map(|sh| AtomicUsize::new(sh.0.lock().set_hint())).collect(),
            shards,
            snapshotted_time: AtomicU32::new(snapshotted_time),
            freezing: AtomicBool::new(false),
            thawed: Notify::new(),
            drained: Notify::new(),
        }
    }

    fn shard(&self, vblock: u64) -> &Mutex<Shard> {
        &self.shards[(vblock % SHARDS as u64) as usize].0
    }

    /// Starts loading the two cache lines `begin_read`/`begin_write` of `vblock` will touch
    /// (its shard's first line and its set), so their misses overlap each other and whatever
    /// the caller does before the lookup, instead of the set's waiting for the shard's lock.
    #[inline]
    pub fn prefetch(&self, vblock: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            let i = (vblock % SHARDS as u64) as usize;
            let hint = self.set_hints[i].load(Ordering::Relaxed);
            let (base, log2) = (hint & !63, hint & 63);
            let index = (vblock / SHARDS as u64) as usize & ((1usize << log2) - 1);
            let shard = &self.shards[i] as *const PaddedShard as *const i8;
            let set = (base as *const i8).wrapping_add(index * std::mem::size_of::<Set>());
            // SAFETY: SSE is part of the x86_64 baseline, and PREFETCHT0 is only a hint: it
            // never faults and reads nothing the program sees (an address of sets already
            // freed by a growth is harmless).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(shard);
                _mm_prefetch::<_MM_HINT_T0>(set);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = vblock;
    }

    pub fn is_shared(&self, c: &Cached) -> bool {
        self.snapshotted_time.load(Ordering::Acquire) > c.time
    }

    /// Decides a read. `max_valid_txn`: cached mappings of later transactions are not trusted
    /// (after a failed commit the metadata went back to the last commit).
    pub fn begin_read(&self, vblock: u64, max_valid_txn: u64) -> ReadDecision {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        if let Some(c) = s.cell(vblock) {
            let rx = queue_on(c);
            s.counters.cell_waits += 1;
            return ReadDecision::Wait(rx);
        }
        match s.lookup(vblock) {
            Some(slot) if !slot.mapped => {
                s.counters.zero_reads += 1;
                ReadDecision::Zeroes
            }
            Some(slot) if slot.txn <= max_valid_txn => {
                let data_block = slot.data_block;
                s.fast_reads += 1;
                ReadDecision::Mapped { data_block, epoch: s.inflight.begin() }
            }
            // Not cached, or an untrusted mapping: resolve (again). An evicted mapping may
            // still have fast-path I/O in flight: the cell drains it like any other.
            _ => {
                s.counters.slow_ops += 1;
                ReadDecision::Resolve { drained: s.take_cell(vblock) }
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
        if let Some(c) = s.cell(vblock) {
            let rx = queue_on(c);
            s.counters.cell_waits += 1;
            return WriteDecision::Wait(rx);
        }
        let known = match s.lookup(vblock) {
            Some(slot) if slot.mapped && snap_time <= slot.time => {
                let (data_block, txn) = (slot.data_block, slot.txn);
                s.writes += 1;
                s.fast_writes += 1;
                return WriteDecision::InPlace { data_block, txn, epoch: s.inflight.begin() };
            }
            Some(slot) => slot.known(),
            None => Known::Unknown,
        };
        s.writes += 1;
        s.counters.slow_ops += 1;
        WriteDecision::Slow { known, drained: s.take_cell(vblock) }
    }

    /// Takes the cell of `vblock` for a slow-path operation that is not a write.
    pub fn acquire(&self, vblock: u64) -> AcquireDecision {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        if let Some(c) = s.cell(vblock) {
            let rx = queue_on(c);
            s.counters.cell_waits += 1;
            return AcquireDecision::Wait(rx);
        }
        let known = s.lookup(vblock).map_or(Known::Unknown, Slot::known);
        AcquireDecision::Acquired { known, drained: s.take_cell(vblock) }
    }

    /// Ends a fast-path I/O started by `begin_read` (`write = false`) or `begin_write`, with the
    /// epoch its decision carried. Touches only the shard's first line (and its drainers when
    /// one waits).
    pub fn end_io(&self, vblock: u64, epoch: u8, write: bool) {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        s.inflight.end(epoch, &mut s.drainers);
        if write {
            end_write(s, &self.drained);
        }
    }

    /// Releases the cell of `vblock` with what the metadata now says, waking every waiter.
    /// `write`: the cell was taken by `begin_write` (its write reference ends too).
    pub fn release(&self, vblock: u64, known: Known, write: bool) {
        let mut s = self.shard(vblock).lock();
        let s = &mut *s;
        match s.cells.remove(&vblock) {
            Some(c) => {
                s.cells_held = s.cells.len() as u32;
                for w in c.waiters {
                    let _ = w.send(());
                }
            }
            None => debug_assert!(false, "release of block {vblock} whose cell is not held"),
        }
        s.store(vblock, known);
        self.set_hints[(vblock % SHARDS as u64) as usize].store(s.set_hint(), Ordering::Relaxed);
        if write {
            end_write(s, &self.drained);
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

    /// Mappings cached now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().used).sum()
    }

    pub fn counters(&self) -> TableCounters {
        let mut c = TableCounters::default();
        for s in self.shards.iter() {
            let g = s.0.lock();
            c.add(&TableCounters {
                fast_reads: g.fast_reads,
                fast_writes: g.fast_writes,
                zero_reads: g.counters.zero_reads,
                slow_ops: g.counters.slow_ops,
                cell_waits: g.counters.cell_waits,
                evictions: g.counters.evictions,
            });
        }
        c
    }
}

fn queue_on(c: &mut Cell) -> oneshot::Receiver<()> {
    let (tx, rx) = oneshot::channel();
    c.waiters.push(tx);
    rx
}

fn end_write(s: &mut Shard, drained: &Notify) {
    debug_assert!(s.writes > 0);
    s.writes = s.writes.saturating_sub(1);
    if s.frozen && s.writes == 0 {
        drained.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(b: u64, time: u32) -> Known {
        Known::Mapped(Cached { data_block: b, time, txn: 0 })
    }

    /// An `Inflight` with its drainers, for the epoch tests.
    #[derive(Default)]
    struct Both {
        f: Inflight,
        d: Drainers,
    }

    impl Both {
        fn begin(&mut self) -> u8 {
            self.f.begin()
        }
        fn end(&mut self, epoch: u8) {
            self.f.end(epoch, &mut self.d)
        }
        fn drain(&mut self) -> Option<oneshot::Receiver<()>> {
            self.f.drain(&mut self.d)
        }
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
        let mut f = Both::default();
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
        let mut f = Both::default();
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
        assert_eq!(f.f.active, [0, 0]);
        assert!(!f.f.draining && f.d.is_empty());
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

    /// The fast path's fields share the lock's cache line: one line per shard per request.
    #[test]
    fn hot_fields_share_the_lock_cache_line() {
        let sh = PaddedShard(Mutex::new(Shard::new(8)));
        let base = &sh as *const PaddedShard as usize;
        assert_eq!(base % 64, 0);
        let g = sh.0.lock();
        let end = |p: usize, size: usize| p + size - base;
        let fields = [
            end(&g.sets as *const _ as usize, std::mem::size_of_val(&g.sets)),
            end(&g.fast_reads as *const _ as usize, 8),
            end(&g.fast_writes as *const _ as usize, 8),
            end(&g.inflight as *const _ as usize, std::mem::size_of::<Inflight>()),
            end(&g.cells_held as *const _ as usize, 4),
            end(&g.writes as *const _ as usize, 4),
            end(&g.frozen as *const _ as usize, 1),
        ];
        for (i, e) in fields.iter().enumerate() {
            assert!(*e <= 64, "hot field {i} ends at byte {e} of the shard");
        }
        // And the lock itself: its state byte is before the data, in the same line.
        assert!((&*g as *const Shard as usize) - base < 64);
    }

    /// A dense volume up to the capacity is cached without a single eviction, across the
    /// growth of the sets, and every mapping reads back.
    #[test]
    fn dense_blocks_fill_the_sets_without_evictions() {
        let cap = 4096 * SHARDS;
        let t = MappingTable::new(0, cap);
        for vb in 0..cap as u64 {
            let AcquireDecision::Acquired { known: Known::Unknown, .. } = t.acquire(vb) else { panic!() };
            t.release(vb, mapped(vb + 7, 0), false);
        }
        assert_eq!(t.len(), cap);
        assert_eq!(t.counters().evictions, 0);
        // The prefetch hints followed the sets through every growth.
        for (sh, hint) in t.shards.iter().zip(t.set_hints.iter()) {
            let g = sh.0.lock();
            assert_eq!(g.sets.len(), 2048);
            assert_eq!(hint.load(Ordering::Relaxed), g.set_hint());
        }
        for vb in 0..cap as u64 {
            match t.begin_read(vb, u64::MAX) {
                ReadDecision::Mapped { data_block, epoch } => {
                    assert_eq!(data_block, vb + 7);
                    t.end_io(vb, epoch, false);
                }
                _ => panic!("block {vb} is not cached"),
            }
        }
        // One more block per set than fits: each evicts the older slot of its set.
        let AcquireDecision::Acquired { .. } = t.acquire(cap as u64) else { panic!() };
        t.release(cap as u64, Known::Unmapped, false);
        assert_eq!(t.counters().evictions, 1);
        assert_eq!(t.len(), cap);
        assert!(matches!(t.begin_read(cap as u64, u64::MAX), ReadDecision::Zeroes));
    }

    /// Releasing a cell with `Unknown` forgets the mapping; a held cell shadows the slot.
    #[test]
    fn a_held_cell_shadows_the_cached_mapping_and_unknown_forgets_it() {
        let t = MappingTable::new(0, 1 << 16);
        let AcquireDecision::Acquired { .. } = t.acquire(70) else { panic!() };
        t.release(70, mapped(3, 0), false);
        let AcquireDecision::Acquired { known, drained: None } = t.acquire(70) else { panic!() };
        assert_eq!(known, mapped(3, 0));
        assert!(matches!(t.begin_read(70, u64::MAX), ReadDecision::Wait(_)));
        assert!(matches!(t.begin_write(70), WriteDecision::Wait(_)));
        t.release(70, Known::Unknown, false);
        assert_eq!(t.len(), 0);
        assert!(matches!(t.begin_read(70, u64::MAX), ReadDecision::Resolve { .. }));
    }
}
