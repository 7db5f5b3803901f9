//! Warnings for requests a device failed, rate-limited per export.
//!
//! A device error (EIO, ENOSPC, a failed pool, ...) must reach the operator's log without
//! debug logging, but a failing device under a busy client fails thousands of requests a
//! second: each export logs at most [`LINES_PER_WINDOW`] failures per [`WINDOW`], and the first
//! line of the next window says how many it left out. Refused requests (bad offsets, flags a
//! client should not send) are the client's fault and stay at debug level in the connection.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Length of one logging window.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Failure lines an export logs per window.
pub const LINES_PER_WINDOW: u32 = 10;

/// One export's failure log.
#[derive(Debug, Default)]
pub struct FailureLog {
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    logged: u32,
    left_out: u64,
}

/// Whether a failure is logged, and how many the previous window left out.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    Log { left_out_before: u64 },
    LeaveOut,
}

impl FailureLog {
    /// Logs (at warn) a request the device failed, unless this window's lines are used up.
    pub fn failed(&self, export: &str, command: &str, offset_bytes: u64, len_bytes: u64, errno: u32, msg: &str) {
        let Admit::Log { left_out_before } = self.admit(Instant::now()) else {
            return;
        };
        if left_out_before > 0 {
            tracing::warn!(
                export,
                "{left_out_before} more failed requests were not logged in the last {} s",
                WINDOW.as_secs()
            );
        }
        tracing::warn!(export, command, offset_bytes, len_bytes, errno, "request failed: {msg}");
    }

    /// The decision for a failure at `now`.
    pub fn admit(&self, now: Instant) -> Admit {
        let mut w = self.window.lock();
        let expired = w.start.is_none_or(|s| now.saturating_duration_since(s) >= WINDOW);
        if expired {
            let left_out_before = std::mem::take(&mut w.left_out);
            *w = Window { start: Some(now), logged: 1, left_out: 0 };
            return Admit::Log { left_out_before };
        }
        if w.logged < LINES_PER_WINDOW {
            w.logged += 1;
            return Admit::Log { left_out_before: 0 };
        }
        w.left_out += 1;
        Admit::LeaveOut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_logs_its_lines_then_counts_and_the_next_says_how_many_it_left_out() {
        let log = FailureLog::default();
        let t0 = Instant::now();
        for i in 0..LINES_PER_WINDOW {
            assert_eq!(log.admit(t0 + Duration::from_millis(u64::from(i))), Admit::Log { left_out_before: 0 });
        }
        for _ in 0..5 {
            assert_eq!(log.admit(t0 + Duration::from_secs(9)), Admit::LeaveOut);
        }
        assert_eq!(log.admit(t0 + WINDOW), Admit::Log { left_out_before: 5 });
        assert_eq!(log.admit(t0 + WINDOW + Duration::from_secs(1)), Admit::Log { left_out_before: 0 });
        // A quiet spell: the next failure opens a new window with nothing left out.
        assert_eq!(log.admit(t0 + WINDOW * 5), Admit::Log { left_out_before: 0 });
    }
}
