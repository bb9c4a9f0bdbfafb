//! Decision-time histograms the arbiter reports (placement's time bounds: a decision
//! must stay within 100 µs on 16 GPUs × 64 leases, and a batch search within its
//! budget). Buckets are fixed so that a status report and the Prometheus
//! histogram built from it agree without carrying the bounds around.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Upper bounds (µs, inclusive) of the buckets; one more bucket counts the rest.
/// Dense around the 100 µs bound of a single decision and reaching past the
/// 10 ms default budget of a batch search.
pub const BUCKET_BOUNDS_US: [u64; 12] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000,
];

/// How long something took, each time it ran, since the arbiter started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurationHistogram {
    pub count: u64,
    pub sum_ns: u64,
    pub max_ns: u64,
    /// `counts[i]`: durations in bucket `i` of `BUCKET_BOUNDS_US` (not
    /// cumulative); the last entry counts those above every bound. Empty until
    /// the first record.
    pub counts: Vec<u64>,
}

impl DurationHistogram {
    pub fn record(&mut self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKET_BOUNDS_US.len() + 1];
        }
        let bucket = BUCKET_BOUNDS_US
            .iter()
            .position(|&bound_us| ns <= bound_us * 1_000)
            .unwrap_or(BUCKET_BOUNDS_US.len());
        self.counts[bucket] += 1;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    pub fn mean(&self) -> Option<Duration> {
        (self.count > 0).then(|| Duration::from_nanos(self.sum_ns / self.count))
    }

    /// The upper bound of the bucket holding the `q` quantile (0..=1): an upper
    /// estimate, as Prometheus' `histogram_quantile` would give at the bound;
    /// the maximum when it falls in the last bucket.
    pub fn quantile_bound(&self, q: f64) -> Option<Duration> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(match BUCKET_BOUNDS_US.get(i) {
                    Some(&us) => Duration::from_micros(us).min(Duration::from_nanos(self.max_ns)),
                    None => Duration::from_nanos(self.max_ns),
                });
            }
        }
        Some(Duration::from_nanos(self.max_ns))
    }
}

/// Placement's own timing, in the status report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementTimes {
    /// One request placed by the configured policy (the GPUs' view gathered and
    /// the decision made), whether it found a GPU or not.
    pub decisions: DurationHistogram,
    /// One batch search over the waiting requests (`placement.batch`).
    pub batch_searches: DurationHistogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(us: &[u64]) -> DurationHistogram {
        let mut h = DurationHistogram::default();
        for &u in us {
            h.record(Duration::from_micros(u));
        }
        h
    }

    #[test]
    fn records_into_the_bucket_whose_bound_holds_it() {
        let h = micros(&[5, 6, 100, 101, 30_000]);
        assert_eq!(h.count, 5);
        assert_eq!(h.counts[0], 1, "5 µs is in the 5 µs bucket (inclusive)");
        assert_eq!(h.counts[1], 1, "6 µs in the 10 µs bucket");
        assert_eq!(h.counts[4], 1, "100 µs in the 100 µs bucket");
        assert_eq!(h.counts[5], 1, "101 µs in the 250 µs bucket");
        assert_eq!(
            h.counts[BUCKET_BOUNDS_US.len()],
            1,
            "30 ms above every bound"
        );
        assert_eq!(h.max_ns, 30_000_000);
        assert_eq!(
            h.mean(),
            Some(Duration::from_nanos(
                (5 + 6 + 100 + 101 + 30_000) * 1000 / 5
            ))
        );
    }

    #[test]
    fn quantile_bounds_never_exceed_the_maximum() {
        let h = micros(&[3, 3, 3, 40]);
        // The median is in the 5 µs bucket: its bound, though the values were 3 µs.
        assert_eq!(h.quantile_bound(0.5), Some(Duration::from_micros(5)));
        // A bound above the largest value seen is capped by it.
        assert_eq!(
            micros(&[30, 40]).quantile_bound(0.5),
            Some(Duration::from_micros(40))
        );
        assert_eq!(h.quantile_bound(1.0), Some(Duration::from_micros(40)));
        assert_eq!(micros(&[]).quantile_bound(0.5), None);
        assert_eq!(
            micros(&[20_000, 40_000]).quantile_bound(0.99),
            Some(Duration::from_micros(40_000))
        );
    }
}
