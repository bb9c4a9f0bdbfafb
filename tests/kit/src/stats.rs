//! Summaries of measured samples, for benchmarks and the tests that compare timings.

use std::time::Duration;

/// The median: the middle sample, or the mean of the two middle ones for an even count.
/// Panics on no samples: a measurement that produced none is a broken measurement.
pub fn median(samples: impl IntoIterator<Item = f64>) -> f64 {
    let mut sorted: Vec<f64> = samples.into_iter().collect();
    assert!(!sorted.is_empty(), "median of nothing");
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    (sorted[n / 2] + sorted[(n - 1) / 2]) / 2.0
}

/// [`median`] of durations.
pub fn median_duration(samples: impl IntoIterator<Item = Duration>) -> Duration {
    Duration::from_secs_f64(median(samples.into_iter().map(|d| d.as_secs_f64())))
}

/// The `p`th percentile (0 to 100) of samples sorted ascending: the sample nearest to
/// that position, never one interpolated between two.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "percentile of nothing");
    debug_assert!(sorted.is_sorted_by(|a, b| a <= b), "samples not sorted");
    let position = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[position.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle_or_the_mean_of_the_two_middles() {
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(
            median_duration([Duration::from_millis(5), Duration::from_millis(1)]),
            Duration::from_millis(3)
        );
    }

    #[test]
    fn percentiles_are_the_nearest_sample() {
        let sorted: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 50.0), 51.0);
        assert_eq!(percentile(&sorted, 99.0), 100.0);
        assert_eq!(percentile(&sorted, 100.0), 101.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }
}
