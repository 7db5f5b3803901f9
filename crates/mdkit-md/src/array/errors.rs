//! The md runtime's typed errors and the member read-error policy (md-lifecycle.md section 5).
//!
//! [`MdError`] names what failed (a [`MdErrorKind`]), the array, the member (when one is to
//! blame), the sector and the operation. It travels inside an `io::Error` so every
//! `BlockDevice` signature stays as it is; callers recover it with [`MdError::of`].
//!
//! Read-error policy, as the kernel's:
//! - raid1/raid10 ([`DecayingReadErrors`]): every attempt to fix a read error counts; the count
//!   is halved for every full hour since the previous read error (raid1-10.c
//!   `check_decay_read_errors`); a member whose count exceeds `max_read_errors` (default 20) is
//!   failed instead of repaired (`exceed_read_errors`).
//! - raid4/5/6: every failed member read counts, every successful read resets the count; a
//!   member whose count exceeds the stripe cache size is failed at once ("too many read
//!   errors"), see [`crate::array::personality::Personality::read_error_limit`].
//!
//! Time comes from a [`Clock`] the array owns ([`ArrayCore::set_clock`]), so tests move it
//! by hand ([`ManualClock`]) instead of waiting hours.
//!
//! [`ArrayCore::set_clock`]: crate::array::core::ArrayCore::set_clock

use std::fmt;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mdkit_io::DeviceError;
use parking_lot::Mutex;

/// md's MD_DEFAULT_MAX_CORRECTED_READ_ERRORS.
pub const DEFAULT_MAX_READ_ERRORS: u64 = 20;

const SECS_PER_HOUR: u64 = 3600;

/// What went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MdErrorKind {
    /// A member returned an error for a read.
    MemberRead,
    /// A member returned fewer bytes than asked for (treated as a read error).
    ShortRead,
    /// A member returned an error for a write, write-zeroes, discard or flush.
    MemberWrite,
    /// No member holds a readable copy of the range (beyond the level's redundancy).
    Unrecoverable,
    /// The array lost a member it cannot run without: md's `broken`; writes are refused.
    Broken,
    /// The array's metadata could not be written: writes are refused until a check.
    NeedsCheck,
    /// A request outside a member's data area (a bug: never sent to the device).
    OutOfRange,
    /// A read of a range the member's bad-block log lists: not sent to the device (the data
    /// comes from redundancy or the read fails).
    KnownBadBlock,
    /// A member write failed and the range was recorded in its bad-block log instead of
    /// failing the member: the data is not on this member.
    BadBlockRecorded,
}

impl MdErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MdErrorKind::MemberRead => "member read error",
            MdErrorKind::ShortRead => "short read",
            MdErrorKind::MemberWrite => "member write error",
            MdErrorKind::Unrecoverable => "unrecoverable read error",
            MdErrorKind::Broken => "array broken",
            MdErrorKind::NeedsCheck => "array needs a check",
            MdErrorKind::OutOfRange => "outside the member's data area",
            MdErrorKind::KnownBadBlock => "known bad block",
            MdErrorKind::BadBlockRecorded => "write error recorded as a bad block",
        }
    }
}

/// A failure of the md runtime. See the module documentation.
#[derive(Clone, Debug)]
pub struct MdError {
    pub kind: MdErrorKind,
    pub array: String,
    pub member: Option<String>,
    /// Member sector when `member` is set, else the array (or sync-domain) sector.
    pub sector: u64,
    /// The operation: "read", "write", "flush", "check", ...
    pub op: &'static str,
    /// What the layer below said, or further detail.
    pub detail: String,
    /// The `io::ErrorKind` to present (the member's, or `Other`).
    pub io_kind: io::ErrorKind,
    /// The member device's typed error this one wraps (its `source()`).
    pub device: Option<Box<DeviceError>>,
}

impl MdError {
    pub fn new(kind: MdErrorKind, array: &str, op: &'static str, sector: u64, detail: impl Into<String>) -> MdError {
        MdError {
            kind,
            array: array.to_string(),
            member: None,
            sector,
            op,
            detail: detail.into(),
            io_kind: io::ErrorKind::Other,
            device: None,
        }
    }

    pub fn member(mut self, name: &str) -> MdError {
        self.member = Some(name.to_string());
        self
    }

    pub fn io_kind(mut self, kind: io::ErrorKind) -> MdError {
        self.io_kind = kind;
        self
    }

    /// Whether `e` is an `MdError` of kind `kind`.
    pub fn is(e: &io::Error, kind: MdErrorKind) -> bool {
        MdError::of(e).is_some_and(|m| m.kind == kind)
    }

    /// Keeps the member device's typed error, if `e` carries one.
    pub fn caused_by(mut self, e: &io::Error) -> MdError {
        self.device = DeviceError::of(e).cloned().map(Box::new);
        self
    }

    /// The `MdError` inside an `io::Error`, if it carries one.
    pub fn of(e: &io::Error) -> Option<&MdError> {
        e.get_ref().and_then(|inner| inner.downcast_ref::<MdError>())
    }
}

impl fmt::Display for MdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.member {
            Some(m) => write!(f, "{}: member {m}: {} at member sector {}", self.array, self.op, self.sector)?,
            None => write!(f, "{}: {} at sector {}", self.array, self.op, self.sector)?,
        }
        write!(f, ": {}", self.kind.as_str())?;
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for MdError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.device.as_deref().map(|d| d as _)
    }
}

impl From<MdError> for io::Error {
    fn from(e: MdError) -> io::Error {
        io::Error::new(e.io_kind, e)
    }
}

//------------------------------------------------------------------------------------------------
// Clock

/// Time for the error policy (seconds matter, nothing finer).
pub trait Clock: Send + Sync {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock.
pub struct MonotonicClock {
    origin: Instant,
}

impl Default for MonotonicClock {
    fn default() -> MonotonicClock {
        MonotonicClock { origin: Instant::now() }
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to (tests).
#[derive(Default)]
pub struct ManualClock {
    now: Mutex<Duration>,
}

impl ManualClock {
    pub fn new() -> Arc<ManualClock> {
        Arc::new(ManualClock::default())
    }

    pub fn advance(&self, by: Duration) {
        let mut g = self.now.lock();
        *g = g.saturating_add(by);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        *self.now.lock()
    }
}

//------------------------------------------------------------------------------------------------
// raid1/raid10 read-error counter

/// md's `rdev->read_errors` for raid1/raid10 with `last_read_error`.
#[derive(Default)]
pub struct DecayingReadErrors {
    /// (count, seconds of the previous read error; `None` before the first).
    state: Mutex<(u64, Option<u64>)>,
    count: AtomicU64,
}

impl DecayingReadErrors {
    /// Counts one fix attempt at `now_secs` after decaying the count (halved per full hour since
    /// the previous error); returns the new count.
    pub fn note(&self, now_secs: u64) -> u64 {
        let mut g = self.state.lock();
        let (count, last) = *g;
        let hours = last.map_or(0, |l| now_secs.saturating_sub(l) / SECS_PER_HOUR);
        let decayed = if hours >= u64::from(u64::BITS) { 0 } else { count >> hours };
        let new = decayed.saturating_add(1);
        *g = (new, Some(now_secs));
        self.count.store(new, Ordering::Relaxed);
        new
    }

    /// The count as of the last error (no decay applied until the next one, as md).
    pub fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_errors_halve_per_full_hour() {
        let c = DecayingReadErrors::default();
        for i in 1..=20 {
            assert_eq!(c.note(100), i);
        }
        // 59 minutes later: no decay.
        assert_eq!(c.note(100 + 3599), 21);
        // Two full hours after the previous error: 21 >> 2 = 5, plus this one.
        assert_eq!(c.note(100 + 3599 + 2 * 3600 + 10), 6);
        // Half a century later: gone.
        assert_eq!(c.note(u64::MAX / 2), 1);
        assert_eq!(c.get(), 1);
    }

    #[test]
    fn errors_render_and_downcast() {
        let e: io::Error = MdError::new(MdErrorKind::MemberRead, "md0", "read", 2048, "EIO")
            .member("sda")
            .io_kind(io::ErrorKind::Other)
            .into();
        assert_eq!(e.to_string(), "md0: member sda: read at member sector 2048: member read error: EIO");
        let md = MdError::of(&e).expect("typed");
        assert_eq!(
            (md.kind, md.member.as_deref(), md.sector, md.op),
            (MdErrorKind::MemberRead, Some("sda"), 2048, "read")
        );
        let plain = io::Error::other("x");
        assert!(MdError::of(&plain).is_none());
    }

    #[test]
    fn the_member_device_error_stays_reachable() {
        use mdkit_io::{IoErrorKind, IoOp};
        let dev: io::Error = DeviceError::errno("sda", IoOp::Write, 8192, 4096, 28 /* ENOSPC */).into();
        let e: io::Error = MdError::new(MdErrorKind::MemberWrite, "md0", "write", 16, dev.to_string())
            .member("sda")
            .io_kind(dev.kind())
            .caused_by(&dev)
            .into();
        assert_eq!(DeviceError::kind_of(&e), IoErrorKind::NoSpace, "{e}");
        assert_eq!(DeviceError::of(&e).map(|d| d.offset_bytes), Some(8192));
        assert_eq!(MdError::of(&e).map(|m| m.kind), Some(MdErrorKind::MemberWrite));
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new();
        assert_eq!(c.now(), Duration::ZERO);
        c.advance(Duration::from_secs(7200));
        assert_eq!(c.now().as_secs(), 7200);
    }
}
