//! `FaultyDevice`: deterministic fault injection over any [`BlockDevice`].
//!
//! A [`FaultHandle`] (cheap to clone, usable while I/O runs) holds an ordered list of
//! [`FaultRule`]s plus a "pulled disk" switch:
//!
//! * **I/O errors on byte ranges**, per operation kind ([`OpMask`]): a request fails when its
//!   kind is in the rule's mask and its range overlaps the rule's range (a rule without a range
//!   matches every request of its kinds, flushes included; flushes have no range, so only such
//!   rules match them).
//! * **Errors after N operations**: `skip_first` lets the first N matching requests through, then
//!   the rule fires; `max_fires` limits how often it fires (transient vs. persistent faults).
//! * **A pulled disk**: from [`FaultHandle::pull`] on, every request fails (`EIO` by default, as
//!   a vanished member does) until [`FaultHandle::reinsert`].
//! * **Silently dropped writes**: the request reports success but never reaches the inner
//!   device (a lying disk); in a range or everywhere, for writes, discards and write-zeroes.
//! * **Short reads**: the read reports success but its buffer comes back holding only the first
//!   half of what was asked (rounded down to 512 bytes) — a backend that returns fewer bytes
//!   than asked. ([`crate::FileDevice`] itself resubmits short transfers and reports a read
//!   that ends early as an `UnexpectedEof` error; a consumer must treat both as read errors.)
//!
//! Evaluation order per request: the request is validated first ([`check_io`]; bad requests get
//! `InvalidInput`, never an injected fault, and do not count), then the pulled switch, then the
//! rules in insertion order — the first rule that matches *and* is armed fires; every matching
//! rule counts the request towards its `skip_first`. A rule may fire with a probability
//! ([`FaultRule::per_million`]), drawn from the handle's seeded [`Rng`]
//! ([`FaultHandle::seeded`]), so a random fault schedule repeats from its seed. Injected errors
//! carry the errno (default `EIO`) in a [`DeviceError`] marked `injected`, naming device,
//! operation, offset and length; use [`injected_errno`] to recognise them. [`FaultStats`] counts what was injected, per operation.
//!
//! The rule list sits behind one short lock per device; this is a test tool, not a data path.

use std::io;
use std::ops::{BitOr, Range};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, PerOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io};
use crate::error::DeviceError;
use crate::rng::Rng;

/// A set of operation kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpMask(u8);

impl OpMask {
    pub const NONE: OpMask = OpMask(0);
    pub const READ: OpMask = OpMask(1 << 0);
    pub const WRITE: OpMask = OpMask(1 << 1);
    pub const FLUSH: OpMask = OpMask(1 << 2);
    pub const DISCARD: OpMask = OpMask(1 << 3);
    pub const WRITE_ZEROES: OpMask = OpMask(1 << 4);
    /// Everything that changes contents: write, discard, write-zeroes.
    pub const MODIFY: OpMask = OpMask(Self::WRITE.0 | Self::DISCARD.0 | Self::WRITE_ZEROES.0);
    pub const ANY: OpMask = OpMask(0x1f);

    pub fn of(op: IoOp) -> OpMask {
        match op {
            IoOp::Read => Self::READ,
            IoOp::Write => Self::WRITE,
            IoOp::Flush => Self::FLUSH,
            IoOp::Discard => Self::DISCARD,
            IoOp::WriteZeroes => Self::WRITE_ZEROES,
        }
    }

    pub fn contains(self, op: IoOp) -> bool {
        self.0 & Self::of(op).0 != 0
    }
}

impl BitOr for OpMask {
    type Output = OpMask;
    fn bitor(self, rhs: OpMask) -> OpMask {
        OpMask(self.0 | rhs.0)
    }
}

/// What a firing rule does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Fail the request with this errno.
    Error { errno: i32 },
    /// Report success without passing a modifying request on (reads and flushes pass through).
    DropWrite,
    /// Reads only: report success with the buffer cut to half its length (see the module
    /// documentation).
    ShortRead,
}

/// One fault rule; build with [`FaultRule::error`] / [`FaultRule::drop_writes`] and refine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    pub ops: OpMask,
    /// Byte range the request must overlap; `None` matches every request of `ops`.
    pub range: Option<Range<u64>>,
    pub action: FaultAction,
    /// Matching requests that pass before the rule is armed ("errors after N operations").
    pub skip_first: u64,
    /// How many times the rule fires at most; `None` = forever.
    pub max_fires: Option<u64>,
    /// Chance in parts per million that an armed rule fires for a matching request
    /// ([`PER_MILLION_ALWAYS`] = every time).
    pub per_million: u32,
}

/// [`FaultRule::per_million`] for a rule that always fires.
pub const PER_MILLION_ALWAYS: u32 = 1_000_000;

impl FaultRule {
    /// `EIO` on every request of `ops` overlapping `range` (`None` = anywhere).
    pub fn error(ops: OpMask, range: Option<Range<u64>>) -> FaultRule {
        FaultRule {
            ops,
            range,
            action: FaultAction::Error { errno: libc::EIO },
            skip_first: 0,
            max_fires: None,
            per_million: PER_MILLION_ALWAYS,
        }
    }

    /// Writes, discards and write-zeroes overlapping `range` (`None` = all) are acknowledged
    /// but dropped.
    pub fn drop_writes(range: Option<Range<u64>>) -> FaultRule {
        FaultRule {
            ops: OpMask::MODIFY,
            range,
            action: FaultAction::DropWrite,
            skip_first: 0,
            max_fires: None,
            per_million: PER_MILLION_ALWAYS,
        }
    }

    /// Reads overlapping `range` (`None` = all) come back short but "successful".
    pub fn short_reads(range: Option<Range<u64>>) -> FaultRule {
        FaultRule {
            ops: OpMask::READ,
            range,
            action: FaultAction::ShortRead,
            skip_first: 0,
            max_fires: None,
            per_million: PER_MILLION_ALWAYS,
        }
    }

    /// Use `errno` instead of `EIO` (no effect on drop rules).
    pub fn errno(mut self, errno: i32) -> FaultRule {
        if let FaultAction::Error { .. } = self.action {
            self.action = FaultAction::Error { errno };
        }
        self
    }

    /// Let the first `n` matching requests through.
    pub fn after(mut self, n: u64) -> FaultRule {
        self.skip_first = n;
        self
    }

    /// Fire at most `n` times.
    pub fn times(mut self, n: u64) -> FaultRule {
        self.max_fires = Some(n);
        self
    }

    /// Fire for a matching request only with probability `ppm` / 1,000,000 (capped at 1).
    pub fn per_million(mut self, ppm: u32) -> FaultRule {
        self.per_million = ppm.min(PER_MILLION_ALWAYS);
        self
    }

    fn matches(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> bool {
        if !self.ops.contains(op) {
            return false;
        }
        match &self.range {
            None => true,
            Some(_) if op == IoOp::Flush => false,
            Some(r) => offset_bytes < r.end && r.start < offset_bytes.saturating_add(len_bytes.max(1)),
        }
    }
}

/// Identifies an installed rule (for [`FaultHandle::remove`] and [`FaultHandle::fired`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleId(u64);

/// What was injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Valid requests seen (bad requests are not counted).
    pub requests: u64,
    /// Errors injected by rules or the pulled switch, per operation.
    pub errors: PerOp<u64>,
    /// Of those, errors caused by the pulled switch.
    pub pulled_errors: u64,
    /// Modifying requests acknowledged but dropped, per operation.
    pub dropped: PerOp<u64>,
    /// Reads answered short.
    pub short_reads: u64,
}

impl FaultStats {
    pub fn total_errors(&self) -> u64 {
        self.errors.iter().map(|(_, n)| n).sum()
    }

    pub fn total_dropped(&self) -> u64 {
        self.dropped.iter().map(|(_, n)| n).sum()
    }
}

/// The errno of an error produced by a [`FaultyDevice`] (anywhere below the caller).
pub fn injected_errno(e: &io::Error) -> Option<i32> {
    DeviceError::of(e).filter(|d| d.injected).and_then(|d| d.errno)
}

struct InstalledRule {
    id: RuleId,
    rule: FaultRule,
    seen: u64,
    fired: u64,
}

struct FaultState {
    next_id: u64,
    rules: Vec<InstalledRule>,
    pulled_errno: Option<i32>,
    stats: FaultStats,
    rng: Rng,
}

enum Verdict {
    Pass,
    Fail { errno: i32, pulled: bool },
    Drop,
    Short,
}

/// Controls and inspects a [`FaultyDevice`] while I/O runs. Clone freely.
#[derive(Clone)]
pub struct FaultHandle {
    state: Arc<Mutex<FaultState>>,
}

impl Default for FaultHandle {
    fn default() -> FaultHandle {
        FaultHandle::seeded(0)
    }
}

impl FaultHandle {
    pub fn new() -> FaultHandle {
        FaultHandle::default()
    }

    /// A handle whose probabilistic rules draw from a PRNG seeded with `seed`.
    pub fn seeded(seed: u64) -> FaultHandle {
        let state = FaultState {
            next_id: 0,
            rules: Vec::new(),
            pulled_errno: None,
            stats: FaultStats::default(),
            rng: Rng::new(seed),
        };
        FaultHandle { state: Arc::new(Mutex::new(state)) }
    }

    /// Installs `rule` after the existing ones.
    pub fn add(&self, rule: FaultRule) -> RuleId {
        let mut s = self.state.lock();
        let id = RuleId(s.next_id);
        s.next_id += 1;
        s.rules.push(InstalledRule { id, rule, seen: 0, fired: 0 });
        id
    }

    /// `EIO` on `ops` requests overlapping `[offset_bytes, offset_bytes + len_bytes)`.
    pub fn fail_range(&self, ops: OpMask, offset_bytes: u64, len_bytes: u64) -> RuleId {
        self.add(FaultRule::error(ops, Some(offset_bytes..offset_bytes.saturating_add(len_bytes))))
    }

    /// `EIO` on every `ops` request after the first `n`.
    pub fn fail_after(&self, ops: OpMask, n: u64) -> RuleId {
        self.add(FaultRule::error(ops, None).after(n))
    }

    /// Drop modifying requests in `[offset_bytes, offset_bytes + len_bytes)`, or all with `None`.
    pub fn drop_writes(&self, range: Option<(u64, u64)>) -> RuleId {
        self.add(FaultRule::drop_writes(range.map(|(off, len)| off..off.saturating_add(len))))
    }

    /// Removes a rule; false if it was not installed.
    pub fn remove(&self, id: RuleId) -> bool {
        let mut s = self.state.lock();
        let before = s.rules.len();
        s.rules.retain(|r| r.id != id);
        s.rules.len() != before
    }

    /// Removes every rule and re-inserts a pulled disk; counters are kept.
    pub fn clear(&self) {
        let mut s = self.state.lock();
        s.rules.clear();
        s.pulled_errno = None;
    }

    /// The disk is gone: every request fails with `EIO` from now on.
    pub fn pull(&self) {
        self.pull_with(libc::EIO);
    }

    pub fn pull_with(&self, errno: i32) {
        self.state.lock().pulled_errno = Some(errno);
    }

    pub fn reinsert(&self) {
        self.state.lock().pulled_errno = None;
    }

    pub fn is_pulled(&self) -> bool {
        self.state.lock().pulled_errno.is_some()
    }

    /// How often rule `id` fired (None if not installed).
    pub fn fired(&self, id: RuleId) -> Option<u64> {
        self.state.lock().rules.iter().find(|r| r.id == id).map(|r| r.fired)
    }

    pub fn stats(&self) -> FaultStats {
        self.state.lock().stats
    }

    fn judge(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> Verdict {
        let mut s = self.state.lock();
        s.stats.requests += 1;
        if let Some(errno) = s.pulled_errno {
            *s.stats.errors.get_mut(op) += 1;
            s.stats.pulled_errors += 1;
            return Verdict::Fail { errno, pulled: true };
        }
        let mut verdict = Verdict::Pass;
        let FaultState { rules, rng, .. } = &mut *s;
        for r in rules.iter_mut() {
            if !r.rule.matches(op, offset_bytes, len_bytes) {
                continue;
            }
            if r.rule.action == FaultAction::DropWrite && !op.modifies() {
                continue;
            }
            if r.rule.action == FaultAction::ShortRead && op != IoOp::Read {
                continue;
            }
            r.seen += 1;
            let armed = r.seen > r.rule.skip_first && r.rule.max_fires.is_none_or(|m| r.fired < m);
            if armed
                && matches!(verdict, Verdict::Pass)
                && (r.rule.per_million >= PER_MILLION_ALWAYS
                    || rng.chance(u64::from(r.rule.per_million), u64::from(PER_MILLION_ALWAYS)))
            {
                r.fired += 1;
                verdict = match r.rule.action {
                    FaultAction::Error { errno } => Verdict::Fail { errno, pulled: false },
                    FaultAction::DropWrite => Verdict::Drop,
                    FaultAction::ShortRead => Verdict::Short,
                };
            }
        }
        match verdict {
            Verdict::Fail { .. } => *s.stats.errors.get_mut(op) += 1,
            Verdict::Drop => *s.stats.dropped.get_mut(op) += 1,
            Verdict::Short => s.stats.short_reads += 1,
            Verdict::Pass => {}
        }
        verdict
    }
}

/// A device that fails or drops requests as its [`FaultHandle`] says.
pub struct FaultyDevice<D> {
    inner: D,
    handle: FaultHandle,
}

impl<D: BlockDevice> FaultyDevice<D> {
    /// Wraps `inner` with a fresh handle (no faults until rules are added).
    pub fn new(inner: D) -> FaultyDevice<D> {
        FaultyDevice::with_handle(inner, FaultHandle::new())
    }

    /// Wraps `inner` controlled by an existing handle (one handle may drive several devices).
    pub fn with_handle(inner: D, handle: FaultHandle) -> FaultyDevice<D> {
        FaultyDevice { inner, handle }
    }

    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    pub fn into_inner(self) -> D {
        self.inner
    }

    fn error(&self, op: IoOp, offset_bytes: u64, len_bytes: u64, errno: i32, pulled: bool) -> io::Error {
        let e = DeviceError::errno(self.inner.name(), op, offset_bytes, len_bytes, errno).injected();
        if pulled { e.detail("pulled disk").into() } else { e.into() }
    }

    /// Validation then judgement; `Err` means: answer with this error now.
    fn admit(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Result<Verdict> {
        if op != IoOp::Flush {
            check_io(self.inner.name(), &self.inner.topology(), op, offset_bytes, len_bytes)?;
        }
        match self.handle.judge(op, offset_bytes, len_bytes) {
            Verdict::Fail { errno, pulled } => Err(self.error(op, offset_bytes, len_bytes, errno, pulled)),
            v => Ok(v),
        }
    }
}

impl<D: BlockDevice> BlockDevice for FaultyDevice<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn topology(&self) -> Topology {
        self.inner.topology()
    }

    fn refresh_size(&self) -> io::Result<u64> {
        self.inner.refresh_size()
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        match self.admit(IoOp::Read, offset_bytes, buf.len() as u64) {
            Err(e) => Box::pin(std::future::ready((buf, Err(e)))),
            Ok(Verdict::Short) => Box::pin(async move {
                let (mut buf, r) = self.inner.read(offset_bytes, buf).await;
                if r.is_ok() {
                    buf.truncate(buf.len() / 2 / 512 * 512);
                }
                (buf, r)
            }),
            Ok(_) => self.inner.read(offset_bytes, buf),
        }
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        match self.admit(IoOp::Write, offset_bytes, buf.len() as u64) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(Verdict::Drop) => Box::pin(std::future::ready(Ok(()))),
            Ok(_) => self.inner.write(offset_bytes, buf, flags),
        }
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        match self.admit(IoOp::Flush, 0, 0) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(_) => self.inner.flush(),
        }
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        match self.admit(IoOp::Discard, offset_bytes, len_bytes) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(Verdict::Drop) => Box::pin(std::future::ready(Ok(()))),
            Ok(_) => self.inner.discard(offset_bytes, len_bytes),
        }
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        match self.admit(IoOp::WriteZeroes, offset_bytes, len_bytes) {
            Err(e) => Box::pin(std::future::ready(Err(e))),
            Ok(Verdict::Drop) => Box::pin(std::future::ready(Ok(()))),
            Ok(_) => self.inner.write_zeroes(offset_bytes, len_bytes, flags),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BlockDeviceExt;
    use crate::mem::MemDevice;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    #[test]
    fn range_rules_fire_only_where_configured() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            let id = h.fail_range(OpMask::READ, 8192, 4096);
            // Writes anywhere pass; reads outside the range pass; reads overlapping fail.
            d.write_slice(8192, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
            d.read_vec(0, 8192).await.unwrap();
            d.read_vec(12288, 4096).await.unwrap();
            for (off, len) in [(8192u64, 4096usize), (4096, 8192), (12288 - 512, 512), (0, 1 << 20)] {
                let e = d.read_vec(off, len).await.unwrap_err();
                assert_eq!(e.raw_os_error(), None);
                assert_eq!(injected_errno(&e), Some(libc::EIO), "{off}+{len}");
                assert!(e.to_string().contains("m0: read of"), "{e}");
            }
            d.flush().await.unwrap();
            assert_eq!(h.fired(id), Some(4));
            let s = h.stats();
            assert_eq!((s.errors.read, s.errors.write, s.errors.flush, s.total_errors()), (4, 0, 0, 4));
            assert_eq!(s.requests, 8);
            assert!(h.remove(id));
            d.read_vec(8192, 4096).await.unwrap();
        });
    }

    #[test]
    fn fail_after_n_ops_and_times() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            h.add(FaultRule::error(OpMask::WRITE, None).after(3).times(2).errno(libc::ENOSPC));
            for i in 0..8u64 {
                let r = d.write_slice(i * 4096, &[7u8; 4096], WriteFlags::NONE).await;
                let expect_fail = i == 3 || i == 4;
                assert_eq!(r.is_err(), expect_fail, "write {i}");
                if let Err(e) = r {
                    assert_eq!(injected_errno(&e), Some(libc::ENOSPC));
                }
                d.read_vec(0, 512).await.unwrap(); // reads never count towards a write rule
            }
            assert_eq!(h.stats().errors.write, 2);
            // The two failed writes left the inner device untouched.
            let img = d.inner().to_image();
            assert!(img[3 * 4096..5 * 4096].iter().all(|&b| b == 0));
            assert!(img[5 * 4096..6 * 4096].iter().all(|&b| b == 7));
        });
    }

    #[test]
    fn pulled_disk_fails_everything_until_reinserted() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            h.pull();
            assert!(d.read_vec(0, 4096).await.is_err());
            assert!(d.write_slice(0, &[1u8; 512], WriteFlags::FUA).await.is_err());
            assert!(d.flush().await.is_err());
            assert!(d.discard(0, 4096).await.is_err());
            assert!(d.write_zeroes(0, 4096, ZeroFlags::default()).await.is_err());
            let s = h.stats();
            assert_eq!((s.total_errors(), s.pulled_errors), (5, 5));
            assert_eq!(d.inner().allocated_bytes(), 0);
            h.reinsert();
            d.write_slice(0, &[1u8; 512], WriteFlags::FUA).await.unwrap();
        });
    }

    #[test]
    fn dropped_writes_are_acknowledged_but_lost() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            h.drop_writes(Some((4096, 4096)));
            d.write_slice(0, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
            d.write_slice(4096, &[2u8; 4096], WriteFlags::FUA).await.unwrap();
            d.write_slice(8192, &[3u8; 4096], WriteFlags::NONE).await.unwrap();
            let v = d.read_vec(0, 12288).await.unwrap();
            assert!(v[..4096].iter().all(|&b| b == 1));
            assert!(v[4096..8192].iter().all(|&b| b == 0), "dropped");
            assert!(v[8192..].iter().all(|&b| b == 3));
            assert_eq!(h.stats().dropped.write, 1);
            h.clear();
            h.drop_writes(None);
            d.write_zeroes(0, 4096, ZeroFlags::default()).await.unwrap();
            d.flush().await.unwrap();
            assert!(d.read_vec(0, 4096).await.unwrap().iter().all(|&b| b == 1));
            assert_eq!(h.stats().total_dropped(), 2);
        });
    }

    #[test]
    fn short_reads_return_half_the_buffer() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            d.write_slice(0, &[5u8; 8192], WriteFlags::NONE).await.unwrap();
            h.add(FaultRule::short_reads(Some(4096..8192)).times(1));
            let (b, r) = d.read(0, IoBuf::zeroed(4096)).await;
            assert!(r.is_ok() && b.len() == 4096, "outside the range");
            let (b, r) = d.read(0, IoBuf::zeroed(8192)).await;
            assert!(r.is_ok());
            assert_eq!(b.len(), 4096, "half of what was asked");
            assert!(b.as_slice().iter().all(|&x| x == 5));
            let (b, _) = d.read(0, IoBuf::zeroed(8192)).await;
            assert_eq!(b.len(), 8192, "fired once");
            d.write_slice(4096, &[1u8; 4096], WriteFlags::NONE).await.unwrap();
            assert_eq!(h.stats().short_reads, 1);
        });
    }

    #[test]
    fn read_vec_types_short_reads_and_read_metadata_retries_once() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            d.write_slice(0, &[7u8; 8192], WriteFlags::NONE).await.unwrap();
            h.add(FaultRule::short_reads(None).times(1));
            let e = d.read_vec(0, 8192).await.expect_err("a short read is an error, not a shorter vector");
            assert_eq!(crate::DeviceError::kind_of(&e), crate::IoErrorKind::ShortRead, "{e}");
            h.add(FaultRule::short_reads(None).times(1));
            assert_eq!(d.read_metadata(0, 8192).await.unwrap(), vec![7u8; 8192], "retried once");
            h.add(FaultRule::error(OpMask::READ, None).times(1));
            assert_eq!(d.read_metadata(0, 8192).await.unwrap(), vec![7u8; 8192], "an EIO is retried too");
            h.add(FaultRule::error(OpMask::READ, None).times(2));
            let e = d.read_metadata(0, 8192).await.expect_err("only once");
            assert_eq!(crate::DeviceError::kind_of(&e), crate::IoErrorKind::Eio, "{e}");
        });
    }

    #[test]
    fn probabilistic_rules_fire_at_their_rate_and_repeat_from_the_seed() {
        block_on(async {
            let run = |seed: u64| async move {
                let d = FaultyDevice::with_handle(MemDevice::new("m0", 1 << 20), FaultHandle::seeded(seed));
                d.handle().add(FaultRule::error(OpMask::READ, None).per_million(100_000));
                let mut failed = Vec::new();
                for i in 0..2000u64 {
                    if d.read_vec((i % 256) * 4096, 4096).await.is_err() {
                        failed.push(i);
                    }
                }
                failed
            };
            let a = run(7).await;
            assert!((120..=280).contains(&a.len()), "about 10% of 2000: {}", a.len());
            assert_eq!(a, run(7).await, "same seed, same schedule");
            assert_ne!(a, run(8).await);
        });
    }

    #[test]
    fn bad_requests_are_invalid_input_not_faults() {
        block_on(async {
            let d = FaultyDevice::new(MemDevice::new("m0", 1 << 20));
            let h = d.handle();
            h.fail_after(OpMask::ANY, 0);
            let e = d.write_slice(1 << 20, &[0u8; 512], WriteFlags::NONE).await.unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert_eq!(injected_errno(&e), None);
            assert_eq!(h.stats().requests, 0);
        });
    }

    #[test]
    fn works_over_a_shared_dyn_device() {
        block_on(async {
            let inner: crate::device::DeviceRef = Arc::new(MemDevice::new("m0", 1 << 20));
            let d = FaultyDevice::new(inner.clone());
            d.handle().fail_range(OpMask::WRITE, 0, 512);
            assert!(d.write_slice(0, &[1u8; 512], WriteFlags::NONE).await.is_err());
            inner.write_slice(0, &[1u8; 512], WriteFlags::NONE).await.unwrap();
            assert_eq!(d.read_vec(0, 512).await.unwrap(), vec![1u8; 512]);
        });
    }
}
