//! Per-export request latency histograms (`mdkit_export_request_duration_seconds`) from the
//! NBD server's fixed-bucket atomics, encoded as one OpenMetrics histogram family.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;

use mdkit_nbd::{LATENCY_BUCKET_BOUNDS_US, LatencySnapshot};

type Labels = Vec<(String, String)>;

/// Histograms already counted elsewhere, one per label set.
#[derive(Debug, Default)]
pub struct HistogramFamily {
    series: Vec<(Labels, LatencySnapshot)>,
}

impl HistogramFamily {
    pub fn push(&mut self, labels: Labels, snapshot: LatencySnapshot) {
        self.series.push((labels, snapshot));
    }
}

/// `(upper bound in seconds, count in that bucket)`, the last bound `+Inf`.
fn buckets(s: &LatencySnapshot) -> Vec<(f64, u64)> {
    let bounds = LATENCY_BUCKET_BOUNDS_US.iter().map(|&us| us as f64 / 1e6).chain(std::iter::once(f64::INFINITY));
    bounds.zip(s.bucket_counts.iter().copied()).collect()
}

impl EncodeMetric for HistogramFamily {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (labels, s) in &self.series {
            let sum_seconds = s.sum_ns as f64 / 1e9;
            encoder.encode_family(labels)?.encode_histogram::<Labels>(sum_seconds, s.count, &buckets(s), None)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_end_with_inf_and_keep_counts() {
        let mut counts = vec![0; LATENCY_BUCKET_BOUNDS_US.len() + 1];
        counts[0] = 3;
        counts[LATENCY_BUCKET_BOUNDS_US.len()] = 1;
        let b = buckets(&LatencySnapshot { bucket_counts: counts, sum_ns: 0, count: 4 });
        assert_eq!(b.len(), LATENCY_BUCKET_BOUNDS_US.len() + 1);
        assert_eq!(b[0], (25e-6, 3));
        assert_eq!(b.last(), Some(&(f64::INFINITY, 1)));
    }
}
