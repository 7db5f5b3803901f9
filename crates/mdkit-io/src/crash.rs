//! Crash recorder: simulated disks that can show what a power cut would leave behind, at any
//! moment, across several devices at once.
//!
//! # Model
//!
//! A [`CrashGroup`] is one power domain: a shared event clock and log for the devices wrapped
//! into it ([`CrashGroup::wrap`] → [`CrashDevice`]; RAID members, a thin pool's metadata and
//! data devices). Every request on any member appends events to the group's log:
//!
//! ```text
//!   write / write_zeroes / discard : Issued(member, range, data) ... Completed
//!   flush                          : Issued(member) ............... Completed
//! ```
//!
//! A [`CrashPoint`] `p` is a position in that log: "the power failed after the first `p` events".
//! Point 0 is before anything, [`CrashGroup::now`] after everything so far. Because the clock is
//! shared, one point is one instant for every member of the group.
//!
//! Durability at point `p`, per member (the [`BlockDevice`] contract, exactly):
//!
//! * a **FUA** write is durable once its completion is before `p`;
//! * a **flush** whose completion is before `p` makes durable every write of that member whose
//!   completion is before the flush's *issue* — writes that complete while a flush is running
//!   are not covered by it;
//! * every other write issued before `p` is **volatile**: it may have reached the medium fully,
//!   partly or not at all. Writes issued after `p` never happened.
//!
//! [`CrashGroup::image_at`] builds one [`MemDevice`] per member (in wrap order) for a point and a
//! [`CrashPolicy`] for the volatile writes: `KeepAll` (the cache reached the medium), `LoseAll`
//! (nothing volatile survived), `RandomSubset` (each volatile write survives whole or not at all,
//! with probability 1/2) or `RandomTear` (each 512-byte sector of each volatile write survives
//! independently, probability 1/2 — the torn-write case). Surviving writes are applied in issue
//! order over the durable contents, so for each 512-byte sector the image holds either its
//! durable value (the last durable write to it, or the initial contents) or the value of a write
//! to it issued before the point — never anything else. The result is deterministic for a given
//! point, policy and [`Rng`] state.
//!
//! **Discard.** With [`DiscardModel::Zeroes`] (default) a discard is recorded exactly like a
//! write-zeroes (volatile until flushed, zeroes once durable) and the live device reads zeroes;
//! with [`DiscardModel::Ignore`] it is a no-op, as a disk that ignores discards behaves (old
//! data stays, live and in every image). Layers above must not read discarded blocks expecting
//! either; both models are allowed by the contract ("content undefined until rewritten").
//!
//! **In-flight windows.** A member's live contents are a [`MemDevice`] that completes at once. So
//! that writes can be in flight across other requests (issued but not completed, and so
//! volatile even when FUA), each request yields to the runtime once between issue and
//! completion when [`CrashOptions::yield_inside_io`] is set (default). A request future dropped
//! after its first poll still completes (its completion is recorded when it is dropped), as the
//! contract requires; one never polled was never issued.
//!
//! **Bounded memory.** The log keeps, per member, the writes not yet folded into the member's
//! durable base image. [`CrashGroup::forget_before`] folds every write durable at a point into
//! the base and drops older events (points before it can no longer be imaged);
//! [`CrashOptions::retain_flush_points`] does so automatically, keeping only the last N flush
//! points. Reads are not recorded.
//!
//! ```no_run
//! # use mdkit_io::*;
//! # async fn demo() -> std::io::Result<()> {
//! let group = CrashGroup::new();
//! let m0 = group.wrap("m0", MemDevice::new("m0", 1 << 20));
//! let m1 = group.wrap("m1", MemDevice::new("m1", 1 << 20));
//! // ... run the array over m0, m1 ...
//! for point in group.flush_points() {
//!     let images = group.image_at(point, &mut Rng::new(7), CrashPolicy::RandomTear)?;
//!     // reassemble the array from `images`, check it
//! }
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io};
use crate::mem::MemDevice;
use crate::rng::Rng;

const SECTOR_BYTES: u64 = 512;

/// A position in a group's event log: the power fails after the first `.0` events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CrashPoint(pub u64);

impl fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "point {}", self.0)
    }
}

/// What happens to volatile (not yet durable) writes in a crash image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPolicy {
    /// Every issued write reached the medium.
    KeepAll,
    /// No volatile write survived.
    LoseAll,
    /// Each volatile write survived whole or not at all (probability 1/2 each).
    RandomSubset,
    /// Each 512-byte sector of each volatile write survived independently (probability 1/2).
    RandomTear,
}

impl CrashPolicy {
    pub const ALL: [CrashPolicy; 4] =
        [CrashPolicy::KeepAll, CrashPolicy::LoseAll, CrashPolicy::RandomSubset, CrashPolicy::RandomTear];
}

/// How a discard is modelled (see the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DiscardModel {
    /// Like write-zeroes: zeroes once durable.
    #[default]
    Zeroes,
    /// A no-op: the old data stays.
    Ignore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrashOptions {
    /// Yield to the runtime between issue and completion of every request (in-flight windows).
    pub yield_inside_io: bool,
    pub discard: DiscardModel,
    /// Keep only the last N flush points; older history is folded automatically.
    pub retain_flush_points: Option<usize>,
}

impl Default for CrashOptions {
    fn default() -> CrashOptions {
        CrashOptions { yield_inside_io: true, discard: DiscardModel::Zeroes, retain_flush_points: None }
    }
}

/// What an event was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashEventKind {
    /// A write, write-zeroes (`zeroes`) or discard modelled as zeroes was issued.
    WriteIssued {
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
        zeroes: bool,
    },
    /// The write issued at event `issued` completed.
    WriteCompleted {
        issued: u64,
    },
    FlushIssued,
    /// The flush issued at event `issued` completed.
    FlushCompleted {
        issued: u64,
    },
}

/// One entry of a group's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrashEvent {
    pub index: u64,
    /// Member index (wrap order).
    pub member: usize,
    pub kind: CrashEventKind,
}

enum WriteData {
    Bytes(SharedBuf),
    Zeroes,
}

struct WriteRec {
    issue: u64,
    complete: Option<u64>,
    fua: bool,
    offset_bytes: u64,
    len_bytes: u64,
    data: WriteData,
    /// Per sector: superseded by a later durable write already folded into the base.
    dead: Option<Vec<bool>>,
}

impl WriteRec {
    fn sectors(&self) -> usize {
        (self.len_bytes / SECTOR_BYTES) as usize
    }

    fn overlaps(&self, other: &WriteRec) -> bool {
        self.offset_bytes < other.offset_bytes + other.len_bytes
            && other.offset_bytes < self.offset_bytes + self.len_bytes
    }

    fn is_durable(&self, point: u64, horizon: Option<u64>) -> bool {
        match self.complete {
            Some(c) if c < point => self.fua || horizon.is_some_and(|h| c < h),
            _ => false,
        }
    }

    /// Copies the sectors selected by `keep` (and not dead) into `img`, in contiguous runs.
    fn apply(&self, img: &MemDevice, keep: impl Fn(usize) -> bool) {
        let n = self.sectors();
        let live = |i: usize| keep(i) && self.dead.as_ref().is_none_or(|d| !d[i]);
        let mut i = 0;
        while i < n {
            if !live(i) {
                i += 1;
                continue;
            }
            let start = i;
            while i < n && live(i) {
                i += 1;
            }
            let (from, to) = (start as u64 * SECTOR_BYTES, i as u64 * SECTOR_BYTES);
            match &self.data {
                WriteData::Bytes(b) => {
                    img.write_bytes(self.offset_bytes + from, &b.as_slice()[from as usize..to as usize])
                }
                WriteData::Zeroes => img.zero_bytes(self.offset_bytes + from, to - from),
            }
        }
    }

    /// Marks dead the sectors of `self` that `later` covers.
    fn kill_overlap(&mut self, later: &WriteRec) {
        let start = self.offset_bytes.max(later.offset_bytes);
        let end = (self.offset_bytes + self.len_bytes).min(later.offset_bytes + later.len_bytes);
        if start >= end {
            return;
        }
        let n = self.sectors();
        let dead = self.dead.get_or_insert_with(|| vec![false; n]);
        let first = ((start - self.offset_bytes) / SECTOR_BYTES) as usize;
        let last = ((end - self.offset_bytes) / SECTOR_BYTES) as usize;
        dead[first..last].iter_mut().for_each(|d| *d = true);
    }
}

struct FlushRec {
    issue: u64,
    complete: Option<u64>,
}

struct Member {
    name: String,
    live: Arc<MemDevice>,
    /// Durable contents as of the group's `forgotten_before`.
    base: MemDevice,
    /// Writes not folded into `base`, in issue order.
    writes: VecDeque<WriteRec>,
    /// Flushes not folded, in issue order.
    flushes: VecDeque<FlushRec>,
    /// Largest issue index of a folded (completed) flush.
    horizon_base: Option<u64>,
}

impl Member {
    /// Largest issue index of a flush that completed before `point`.
    fn horizon(&self, point: u64) -> Option<u64> {
        let recent = self.flushes.iter().filter(|f| f.complete.is_some_and(|c| c < point)).map(|f| f.issue).max();
        recent.max(self.horizon_base)
    }

    fn image(&self, point: u64, rng: &mut Rng, policy: CrashPolicy) -> MemDevice {
        let img = self.base.snapshot(self.name.clone());
        let horizon = self.horizon(point);
        for w in self.writes.iter().take_while(|w| w.issue < point) {
            if w.is_durable(point, horizon) {
                w.apply(&img, |_| true);
                continue;
            }
            match policy {
                CrashPolicy::KeepAll => w.apply(&img, |_| true),
                CrashPolicy::LoseAll => {}
                CrashPolicy::RandomSubset => {
                    if rng.chance(1, 2) {
                        w.apply(&img, |_| true);
                    }
                }
                CrashPolicy::RandomTear => {
                    let keep: Vec<bool> = (0..w.sectors()).map(|_| rng.chance(1, 2)).collect();
                    w.apply(&img, |i| keep[i]);
                }
            }
        }
        img
    }

    /// Folds every write durable at `point` into the base (see `CrashGroup::forget_before`).
    fn fold(&mut self, point: u64) {
        let horizon = self.horizon(point);
        let mut kept: VecDeque<WriteRec> = VecDeque::with_capacity(self.writes.len());
        for w in std::mem::take(&mut self.writes) {
            if w.is_durable(point, horizon) {
                w.apply(&self.base, |_| true);
                // Earlier volatile writes can no longer show through where this one landed.
                for earlier in kept.iter_mut().filter(|e| e.overlaps(&w)) {
                    earlier.kill_overlap(&w);
                }
            } else {
                kept.push_back(w);
            }
        }
        self.writes = kept;
        self.horizon_base = horizon;
        self.flushes.retain(|f| f.complete.is_none_or(|c| c >= point));
    }
}

struct GroupState {
    next_event: u64,
    forgotten_before: u64,
    members: Vec<Member>,
    events: VecDeque<CrashEvent>,
    options: CrashOptions,
}

impl GroupState {
    fn log(&mut self, member: usize, kind: CrashEventKind) -> u64 {
        let index = self.next_event;
        self.next_event += 1;
        self.events.push_back(CrashEvent { index, member, kind });
        index
    }

    fn flush_points(&self) -> Vec<CrashPoint> {
        self.events
            .iter()
            .filter(|e| matches!(e.kind, CrashEventKind::FlushCompleted { .. }))
            .map(|e| CrashPoint(e.index + 1))
            .collect()
    }

    fn forget_before(&mut self, point: u64) {
        for m in &mut self.members {
            m.fold(point);
        }
        while self.events.front().is_some_and(|e| e.index < point) {
            self.events.pop_front();
        }
        self.forgotten_before = point;
    }

    fn check_point(&self, point: CrashPoint) -> io::Result<()> {
        if point.0 < self.forgotten_before || point.0 > self.next_event {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "crash group: {point} outside the recorded history [{}, {}]",
                    self.forgotten_before, self.next_event
                ),
            ));
        }
        Ok(())
    }
}

/// One power domain: the shared clock and log of its [`CrashDevice`]s. Clone freely.
#[derive(Clone)]
pub struct CrashGroup {
    state: Arc<Mutex<GroupState>>,
}

impl Default for CrashGroup {
    fn default() -> CrashGroup {
        CrashGroup::new()
    }
}

impl CrashGroup {
    pub fn new() -> CrashGroup {
        CrashGroup::with_options(CrashOptions::default())
    }

    pub fn with_options(options: CrashOptions) -> CrashGroup {
        CrashGroup {
            state: Arc::new(Mutex::new(GroupState {
                next_event: 0,
                forgotten_before: 0,
                members: Vec::new(),
                events: VecDeque::new(),
                options,
            })),
        }
    }

    /// Adds a member whose initial (durable) contents are `image`; `image` becomes the member's
    /// live contents.
    pub fn wrap(&self, name: impl Into<String>, image: MemDevice) -> CrashDevice {
        let name = name.into();
        let topology = image.topology();
        let live = Arc::new(image);
        let mut s = self.state.lock();
        let member = s.members.len();
        s.members.push(Member {
            name: name.clone(),
            live: live.clone(),
            base: live.snapshot(name.clone()),
            writes: VecDeque::new(),
            flushes: VecDeque::new(),
            horizon_base: None,
        });
        CrashDevice { group: self.clone(), member, live, name, topology }
    }

    /// The point after everything recorded so far.
    pub fn now(&self) -> CrashPoint {
        CrashPoint(self.state.lock().next_event)
    }

    /// Every point that can still be imaged, in order (`forgotten horizon ..= now`).
    pub fn points(&self) -> Vec<CrashPoint> {
        let s = self.state.lock();
        (s.forgotten_before..=s.next_event).map(CrashPoint).collect()
    }

    /// The point just after each completed flush on any member, in order.
    pub fn flush_points(&self) -> Vec<CrashPoint> {
        self.state.lock().flush_points()
    }

    /// Member names in wrap order (the order of [`CrashGroup::image_at`]'s result).
    pub fn members(&self) -> Vec<String> {
        self.state.lock().members.iter().map(|m| m.name.clone()).collect()
    }

    /// The retained log (events from the forgotten horizon on).
    pub fn events(&self) -> Vec<CrashEvent> {
        self.state.lock().events.iter().cloned().collect()
    }

    /// Writes still held in the log (not yet folded), over all members.
    pub fn retained_writes(&self) -> usize {
        self.state.lock().members.iter().map(|m| m.writes.len()).sum()
    }

    /// "point N: after m1 flush completed" — for failure messages.
    pub fn describe(&self, point: CrashPoint) -> String {
        let s = self.state.lock();
        if point.0 == 0 {
            return format!("{point}: before any I/O");
        }
        match s.events.iter().find(|e| e.index + 1 == point.0) {
            None => format!("{point}"),
            Some(e) => {
                let m = s.members.get(e.member).map_or("?", |m| m.name.as_str());
                let what = match e.kind {
                    CrashEventKind::WriteIssued { offset_bytes, len_bytes, fua, zeroes } => format!(
                        "{m} {} of {len_bytes} bytes at {offset_bytes} issued",
                        match (zeroes, fua) {
                            (true, _) => "zeroing",
                            (false, true) => "FUA write",
                            (false, false) => "write",
                        }
                    ),
                    CrashEventKind::WriteCompleted { issued } => {
                        format!("{m} write issued at event {issued} completed")
                    }
                    CrashEventKind::FlushIssued => format!("{m} flush issued"),
                    CrashEventKind::FlushCompleted { issued } => {
                        format!("{m} flush issued at event {issued} completed")
                    }
                };
                format!("{point}: after {what}")
            }
        }
    }

    /// The members' contents after a power cut at `point`, one image per member in wrap order,
    /// volatile writes treated per `policy` (random choices drawn from `rng`).
    pub fn image_at(&self, point: CrashPoint, rng: &mut Rng, policy: CrashPolicy) -> io::Result<Vec<MemDevice>> {
        let s = self.state.lock();
        s.check_point(point)?;
        Ok(s.members.iter().map(|m| m.image(point.0, rng, policy)).collect())
    }

    /// Folds everything durable at `point` into the members' base images and forgets older
    /// events; afterwards only points `>= point` can be imaged (with the same results as before).
    pub fn forget_before(&self, point: CrashPoint) -> io::Result<()> {
        let mut s = self.state.lock();
        s.check_point(point)?;
        s.forget_before(point.0);
        Ok(())
    }

    fn issue_write(&self, member: usize, offset_bytes: u64, len_bytes: u64, data: WriteData, fua: bool) -> Completion {
        let mut s = self.state.lock();
        let zeroes = matches!(data, WriteData::Zeroes);
        let issue = s.log(member, CrashEventKind::WriteIssued { offset_bytes, len_bytes, fua, zeroes });
        let m = &mut s.members[member];
        match &data {
            WriteData::Bytes(b) => m.live.write_bytes(offset_bytes, b.as_slice()),
            WriteData::Zeroes => m.live.zero_bytes(offset_bytes, len_bytes),
        }
        m.writes.push_back(WriteRec { issue, complete: None, fua, offset_bytes, len_bytes, data, dead: None });
        Completion { group: self.clone(), member, issue, flush: false }
    }

    fn issue_flush(&self, member: usize) -> Completion {
        let mut s = self.state.lock();
        let issue = s.log(member, CrashEventKind::FlushIssued);
        s.members[member].flushes.push_back(FlushRec { issue, complete: None });
        Completion { group: self.clone(), member, issue, flush: true }
    }

    fn complete(&self, member: usize, issue: u64, flush: bool) {
        let mut s = self.state.lock();
        if flush {
            let index = s.log(member, CrashEventKind::FlushCompleted { issued: issue });
            if let Some(f) = s.members[member].flushes.iter_mut().find(|f| f.issue == issue) {
                f.complete = Some(index);
            }
            if let Some(keep) = s.options.retain_flush_points {
                let points = s.flush_points();
                let keep = keep.max(1);
                if points.len() > keep {
                    // Cut just after the newest flush point not kept: `keep` points remain listed.
                    let at = points[points.len() - keep - 1];
                    s.forget_before(at.0);
                }
            }
        } else {
            let index = s.log(member, CrashEventKind::WriteCompleted { issued: issue });
            let writes = &mut s.members[member].writes;
            // Writes are in issue order: binary search by issue index.
            if let Ok(i) = writes.binary_search_by_key(&issue, |w| w.issue) {
                writes[i].complete = Some(index);
            }
        }
    }

    fn yield_inside_io(&self) -> bool {
        self.state.lock().options.yield_inside_io
    }

    fn discard_model(&self) -> DiscardModel {
        self.state.lock().options.discard
    }
}

/// Records the completion of a request when dropped: at the end of the request, or when its
/// future is dropped mid-flight (the I/O "runs to completion" regardless).
struct Completion {
    group: CrashGroup,
    member: usize,
    issue: u64,
    flush: bool,
}

impl Drop for Completion {
    fn drop(&mut self) {
        self.group.complete(self.member, self.issue, self.flush);
    }
}

/// A member of a [`CrashGroup`]: reads and writes its live [`MemDevice`], records every
/// modification and flush in the group's log.
pub struct CrashDevice {
    group: CrashGroup,
    member: usize,
    live: Arc<MemDevice>,
    name: String,
    topology: Topology,
}

impl CrashDevice {
    pub fn group(&self) -> CrashGroup {
        self.group.clone()
    }

    /// Index of this member in the group (its position in `image_at` results).
    pub fn member_index(&self) -> usize {
        self.member
    }

    /// The live contents (what reads return now).
    pub fn live(&self) -> &MemDevice {
        &self.live
    }

    async fn in_flight(&self, completion: Completion) {
        if self.group.yield_inside_io() {
            tokio::task::yield_now().await;
        }
        drop(completion);
    }

    fn modify(
        &self,
        op: IoOp,
        offset_bytes: u64,
        len_bytes: u64,
        data: WriteData,
        fua: bool,
    ) -> IoFuture<'_, io::Result<()>> {
        if let Err(e) = check_io(&self.name, &self.topology, op, offset_bytes, len_bytes) {
            return Box::pin(std::future::ready(Err(e)));
        }
        Box::pin(async move {
            if len_bytes > 0 {
                let c = self.group.issue_write(self.member, offset_bytes, len_bytes, data, fua);
                self.in_flight(c).await;
            }
            Ok(())
        })
    }
}

impl BlockDevice for CrashDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.live.read(offset_bytes, buf)
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        let len = buf.len() as u64;
        self.modify(IoOp::Write, offset_bytes, len, WriteData::Bytes(buf), flags.fua)
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let c = self.group.issue_flush(self.member);
            self.in_flight(c).await;
            Ok(())
        })
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        if self.group.discard_model() == DiscardModel::Ignore {
            let r = check_io(&self.name, &self.topology, IoOp::Discard, offset_bytes, len_bytes);
            return Box::pin(std::future::ready(r));
        }
        self.modify(IoOp::Discard, offset_bytes, len_bytes, WriteData::Zeroes, false)
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        self.modify(IoOp::WriteZeroes, offset_bytes, len_bytes, WriteData::Zeroes, flags.fua)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BlockDeviceExt;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) {
        std::future::poll_fn(|cx| {
            let _ = std::pin::Pin::new(&mut *f).poll(cx);
            std::task::Poll::Ready(())
        })
        .await
    }

    fn sector(img: &MemDevice, off: u64) -> u8 {
        let mut b = [0u8; 512];
        img.read_bytes(off, &mut b);
        assert!(b.iter().all(|&x| x == b[0]), "sector at {off} is uniform");
        b[0]
    }

    #[test]
    fn flush_fua_and_volatile_writes() {
        block_on(async {
            let g = CrashGroup::new();
            let d = g.wrap("m0", MemDevice::new("m0", 1 << 20));
            d.write_slice(0, &[1u8; 512], WriteFlags::NONE).await.unwrap();
            let p_before_flush = g.now();
            d.flush().await.unwrap();
            let p_flushed = g.now();
            d.write_slice(512, &[2u8; 512], WriteFlags::FUA).await.unwrap();
            d.write_slice(1024, &[3u8; 512], WriteFlags::NONE).await.unwrap();
            d.write_slice(0, &[4u8; 512], WriteFlags::NONE).await.unwrap();
            let end = g.now();
            let img = |p, pol| g.image_at(p, &mut Rng::new(1), pol).unwrap().remove(0);
            // Before the flush, the first write is volatile.
            assert_eq!(sector(&img(p_before_flush, CrashPolicy::LoseAll), 0), 0);
            assert_eq!(sector(&img(p_before_flush, CrashPolicy::KeepAll), 0), 1);
            // After: durable.
            assert_eq!(sector(&img(p_flushed, CrashPolicy::LoseAll), 0), 1);
            let lost = img(end, CrashPolicy::LoseAll);
            assert_eq!((sector(&lost, 0), sector(&lost, 512), sector(&lost, 1024)), (1, 2, 0), "FUA durable");
            let kept = img(end, CrashPolicy::KeepAll);
            assert_eq!((sector(&kept, 0), sector(&kept, 512), sector(&kept, 1024)), (4, 2, 3));
            assert!(kept.same_contents(d.live()), "KeepAll at now == live contents");
            assert_eq!(g.flush_points(), vec![p_flushed]);
        });
    }

    #[test]
    fn writes_completing_during_a_flush_are_not_covered_by_it() {
        block_on(async {
            let g = CrashGroup::new();
            let d = g.wrap("m0", MemDevice::new("m0", 1 << 20));
            // Interleave: write issued, flush issued, write completes, flush completes.
            let mut w = d.write_slice(0, &[9u8; 512], WriteFlags::NONE);
            let mut f = d.flush();
            poll_once(&mut w).await;
            poll_once(&mut f).await;
            w.await.unwrap();
            f.await.unwrap();
            let ev: Vec<_> = g.events().into_iter().map(|e| e.kind).collect();
            assert!(matches!(ev[0], CrashEventKind::WriteIssued { .. }));
            assert!(matches!(ev[1], CrashEventKind::FlushIssued));
            assert!(matches!(ev[2], CrashEventKind::WriteCompleted { .. }));
            assert!(matches!(ev[3], CrashEventKind::FlushCompleted { .. }));
            let img = g.image_at(g.now(), &mut Rng::new(0), CrashPolicy::LoseAll).unwrap().remove(0);
            assert_eq!(sector(&img, 0), 0, "the write completed after the flush was issued");
            assert!(g.describe(g.now()).contains("flush issued at event 1 completed"), "{}", g.describe(g.now()));
        });
    }

    #[test]
    fn a_flush_on_one_member_does_not_cover_another() {
        block_on(async {
            let g = CrashGroup::new();
            let a = g.wrap("a", MemDevice::new("a", 1 << 20));
            let b = g.wrap("b", MemDevice::new("b", 1 << 20));
            a.write_slice(0, &[1u8; 512], WriteFlags::NONE).await.unwrap();
            b.write_slice(0, &[2u8; 512], WriteFlags::NONE).await.unwrap();
            a.flush().await.unwrap();
            let imgs = g.image_at(g.now(), &mut Rng::new(0), CrashPolicy::LoseAll).unwrap();
            assert_eq!((sector(&imgs[0], 0), sector(&imgs[1], 0)), (1, 0));
            assert_eq!(g.members(), vec!["a".to_string(), "b".to_string()]);
        });
    }

    #[test]
    fn dropped_future_still_completes() {
        block_on(async {
            let g = CrashGroup::new();
            let d = g.wrap("m0", MemDevice::new("m0", 1 << 20));
            let mut w = d.write_slice(0, &[5u8; 512], WriteFlags::FUA);
            tokio::select! { biased; _ = &mut w => panic!("yields once"), _ = std::future::ready(()) => {} }
            assert!(matches!(g.events().last().map(|e| e.kind), Some(CrashEventKind::WriteIssued { .. })));
            drop(w);
            assert!(matches!(g.events().last().map(|e| e.kind), Some(CrashEventKind::WriteCompleted { .. })));
            let img = g.image_at(g.now(), &mut Rng::new(0), CrashPolicy::LoseAll).unwrap().remove(0);
            assert_eq!(sector(&img, 0), 5, "completed FUA write is durable");
        });
    }

    #[test]
    fn discard_models() {
        block_on(async {
            for (model, expect) in [(DiscardModel::Zeroes, 0u8), (DiscardModel::Ignore, 7u8)] {
                let g = CrashGroup::with_options(CrashOptions { discard: model, ..CrashOptions::default() });
                let d = g.wrap("m0", MemDevice::new("m0", 1 << 20));
                d.write_slice(0, &[7u8; 4096], WriteFlags::FUA).await.unwrap();
                d.discard(0, 4096).await.unwrap();
                d.flush().await.unwrap();
                let img = g.image_at(g.now(), &mut Rng::new(0), CrashPolicy::LoseAll).unwrap().remove(0);
                assert_eq!(sector(&img, 0), expect, "{model:?}");
                assert_eq!(sector(d.live(), 0), expect, "{model:?} live");
            }
        });
    }

    #[test]
    fn bad_requests_and_points_are_rejected() {
        block_on(async {
            let g = CrashGroup::new();
            let d = g.wrap("m0", MemDevice::new("m0", 1 << 20));
            let e = d.write_slice(1 << 20, &[1u8; 512], WriteFlags::NONE).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert_eq!(g.now(), CrashPoint(0), "nothing recorded");
            assert!(g.image_at(CrashPoint(1), &mut Rng::new(0), CrashPolicy::KeepAll).is_err());
            d.write_slice(0, &[1u8; 512], WriteFlags::NONE).await.unwrap();
            d.flush().await.unwrap();
            g.forget_before(CrashPoint(2)).unwrap();
            assert!(g.image_at(CrashPoint(1), &mut Rng::new(0), CrashPolicy::KeepAll).is_err());
            assert!(g.image_at(CrashPoint(2), &mut Rng::new(0), CrashPolicy::KeepAll).is_ok());
        });
    }
}
