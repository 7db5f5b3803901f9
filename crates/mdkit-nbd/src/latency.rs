//! Per-export request latency histograms: fixed buckets of relaxed atomic counters, one
//! histogram per request class, kept on cache lines of their own (away from the request
//! counters in `ExportStats`). Recording is an `Instant::now()` pair and three `fetch_add`s.
//!
//! Latency here is the service time: from the moment the request starts executing (after
//! admission) until its reply is ready; socket send time is not included.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets in microseconds; a last `+Inf` bucket follows.
pub const LATENCY_BUCKET_BOUNDS_US: [u64; 14] =
    [25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000];
const BUCKETS: usize = LATENCY_BUCKET_BOUNDS_US.len() + 1;

/// Which histogram a request is recorded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestClass {
    Read,
    Write,
    Flush,
    /// Trim and write-zeroes.
    Other,
}

impl RequestClass {
    pub const ALL: [RequestClass; 4] =
        [RequestClass::Read, RequestClass::Write, RequestClass::Flush, RequestClass::Other];

    pub fn name(self) -> &'static str {
        match self {
            RequestClass::Read => "read",
            RequestClass::Write => "write",
            RequestClass::Flush => "flush",
            RequestClass::Other => "other",
        }
    }
}

/// One histogram; aligned so two histograms (and the counters before them) never share a line.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct LatencyHistogram {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// A point-in-time copy: per-bucket (not cumulative) counts, the last one `+Inf`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    pub bucket_counts: Vec<u64>,
    pub sum_ns: u64,
    pub count: u64,
}

impl LatencyHistogram {
    pub fn record(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BUCKET_BOUNDS_US.iter().position(|&b| us <= b).unwrap_or(BUCKETS - 1);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            bucket_counts: self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed),
        }
    }
}

/// The histograms of one export, one per [`RequestClass`].
#[derive(Debug, Default)]
pub struct ExportLatency {
    classes: [LatencyHistogram; 4],
}

impl ExportLatency {
    pub fn histogram(&self, class: RequestClass) -> &LatencyHistogram {
        &self.classes[class as usize]
    }

    /// Snapshots in [`RequestClass::ALL`] order.
    pub fn snapshot(&self) -> Vec<(RequestClass, LatencySnapshot)> {
        RequestClass::ALL.iter().map(|&c| (c, self.histogram(c).snapshot())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_land_in_the_first_bucket_that_holds_them() {
        let h = LatencyHistogram::default();
        h.record(Duration::from_micros(10));
        h.record(Duration::from_micros(25));
        h.record(Duration::from_micros(26));
        h.record(Duration::from_millis(3));
        h.record(Duration::from_secs(5));
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.bucket_counts.len(), BUCKETS);
        assert_eq!(s.bucket_counts[0], 2, "<= 25 us");
        assert_eq!(s.bucket_counts[1], 1, "<= 50 us");
        assert_eq!(s.bucket_counts[7], 1, "<= 5 ms");
        assert_eq!(s.bucket_counts[BUCKETS - 1], 1, "+Inf");
        assert_eq!(s.sum_ns, 10_000 + 25_000 + 26_000 + 3_000_000 + 5_000_000_000);
    }

    #[test]
    fn classes_are_separate_and_on_their_own_cache_lines() {
        let l = ExportLatency::default();
        l.histogram(RequestClass::Write).record(Duration::from_micros(1));
        let s = l.snapshot();
        assert_eq!(s.iter().map(|(_, s)| s.count).collect::<Vec<_>>(), [0, 1, 0, 0]);
        assert_eq!(std::mem::align_of::<LatencyHistogram>(), 128);
    }
}
