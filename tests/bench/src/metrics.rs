//! What the experiments conclude from the workloads' reports: pure arithmetic on their JSON,
//! table-tested. Every figure is simulated GPU time.

use serde_json::{json, Value};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MetricsError {
    #[error("the report of {job} has no number at {key}: {report}")]
    MissingNumber {
        job: String,
        key: String,
        report: String,
    },
}

/// A number at a `/`-separated path of a workload's report.
pub fn number(job: &str, report: &Value, key: &str) -> Result<f64, MetricsError> {
    let pointer = format!("/{key}");
    report
        .pointer(&pointer)
        .and_then(Value::as_f64)
        .filter(|v| v.is_finite())
        .ok_or_else(|| MetricsError::MissingNumber {
            job: job.to_owned(),
            key: key.to_owned(),
            report: report.to_string(),
        })
}

/// The fraction of the GPU a job kept busy: the kernel time it launched over its run (the
/// workload drains its queue before it reports, so every launched kernel ran).
pub fn gpu_fraction(job: &str, report: &Value) -> Result<f64, MetricsError> {
    let kernel = number(job, report, "kernel_time_s")?;
    let elapsed = number(job, report, "elapsed_s")?;
    Ok(if elapsed > 0.0 { kernel / elapsed } else { 0.0 })
}

/// Percent by which `shared` exceeds `alone` (0 when alone is 0).
pub fn slowdown_percent(alone: f64, shared: f64) -> f64 {
    if alone > 0.0 {
        (shared / alone - 1.0) * 100.0
    } else {
        0.0
    }
}

/// How much of the GPU time the high-priority job leaves idle the low-priority jobs used, in
/// percent: `low_fraction / (1 − high_busy_alone)`.
pub fn idle_captured_percent(high_busy_alone: f64, low_fraction: f64) -> f64 {
    let idle = 1.0 - high_busy_alone;
    if idle > 0.0 {
        low_fraction / idle * 100.0
    } else {
        0.0
    }
}

/// The high job's figures in one case of the priority scenario, against the same job alone.
///
/// Its iteration time is the period from one iteration's start to the next (GPU burst and
/// CPU gap: what a training job's user waits for); the GPU phase alone (first launch until
/// its completion is seen) is reported beside it, a stricter figure since every delay
/// falls into it while the gap is fixed.
pub fn priority_case(alone: &Value, high: &Value, lows: &[Value]) -> Result<Value, MetricsError> {
    let alone_mean = number("high (alone)", alone, "period_ms/mean")?;
    let alone_p99 = number("high (alone)", alone, "period_ms/p99")?;
    let alone_phase_mean = number("high (alone)", alone, "latency_ms/mean")?;
    let alone_phase_p99 = number("high (alone)", alone, "latency_ms/p99")?;
    let alone_busy = gpu_fraction("high (alone)", alone)?;
    let mean = number("high", high, "period_ms/mean")?;
    let p99 = number("high", high, "period_ms/p99")?;
    let phase_mean = number("high", high, "latency_ms/mean")?;
    let phase_p99 = number("high", high, "latency_ms/p99")?;
    let mut low_fraction = 0.0;
    for (i, low) in lows.iter().enumerate() {
        low_fraction += gpu_fraction(&format!("low {i}"), low)?;
    }
    Ok(json!({
        "high_mean_ms": mean,
        "high_mean_slowdown_percent": slowdown_percent(alone_mean, mean),
        "high_p99_ms": p99,
        "high_p99_slowdown_percent": slowdown_percent(alone_p99, p99),
        "high_gpu_phase_mean_ms": phase_mean,
        "high_gpu_phase_slowdown_percent": slowdown_percent(alone_phase_mean, phase_mean),
        "high_gpu_phase_p99_slowdown_percent": slowdown_percent(alone_phase_p99, phase_p99),
        "high_gpu_fraction": gpu_fraction("high", high)?,
        "high_start_p50_us": number("high", high, "start_latency_us/p50")?,
        "high_start_p99_us": number("high", high, "start_latency_us/p99")?,
        "low_gpu_fraction": low_fraction,
        "idle_left_by_high_alone": 1.0 - alone_busy,
        "idle_captured_percent": idle_captured_percent(alone_busy, low_fraction),
    }))
}

/// The high job alone: the baseline every other case of the priority scenario is set against.
pub fn alone_case(alone: &Value) -> Result<Value, MetricsError> {
    Ok(json!({
        "high_mean_ms": number("high", alone, "period_ms/mean")?,
        "high_p99_ms": number("high", alone, "period_ms/p99")?,
        "high_gpu_phase_mean_ms": number("high", alone, "latency_ms/mean")?,
        "high_gpu_fraction": gpu_fraction("high", alone)?,
        "high_start_p50_us": number("high", alone, "start_latency_us/p50")?,
        "high_start_p99_us": number("high", alone, "start_latency_us/p99")?,
    }))
}

/// Two saturating jobs with different compute requests: their shares and the ratio of the
/// larger request's share to the smaller's (2.0 is what requests 0.6 and 0.3 ask for).
pub fn share_pair(small: &Value, large: &Value) -> Result<Value, MetricsError> {
    let (s, l) = (gpu_fraction("small", small)?, gpu_fraction("large", large)?);
    Ok(json!({
        "small_share": s,
        "large_share": l,
        "share_ratio": if s > 0.0 { l / s } else { 0.0 },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(mean: f64, p99: f64, kernel: f64, elapsed: f64) -> Value {
        json!({
            "period_ms": {"mean": mean, "p99": p99},
            "latency_ms": {"mean": mean / 2.0, "p99": p99 / 2.0},
            "kernel_time_s": kernel,
            "elapsed_s": elapsed,
            "start_latency_us": {"p50": 5.0, "p99": 40.0},
        })
    }

    #[test]
    fn slowdown_and_idle_capture() {
        for (alone, shared, expected) in [(10.0, 12.0, 20.0), (10.0, 10.0, 0.0), (0.0, 5.0, 0.0)] {
            assert!((slowdown_percent(alone, shared) - expected).abs() < 1e-9);
        }
        for (busy, low, expected) in [(0.6, 0.4, 100.0), (0.6, 0.2, 50.0), (1.0, 0.3, 0.0)] {
            assert!((idle_captured_percent(busy, low) - expected).abs() < 1e-9);
        }
    }

    #[test]
    fn a_priority_case_against_the_job_alone() {
        let alone = report(5.0, 6.0, 0.6, 1.0);
        let high = report(6.0, 9.0, 0.5, 1.0);
        let lows = [report(1.0, 1.0, 0.2, 1.0), report(1.0, 1.0, 0.1, 1.0)];
        let case = priority_case(&alone, &high, &lows).unwrap();
        let get = |k: &str| case[k].as_f64().unwrap();
        assert!((get("high_mean_slowdown_percent") - 20.0).abs() < 1e-9);
        assert!((get("high_p99_slowdown_percent") - 50.0).abs() < 1e-9);
        assert!((get("low_gpu_fraction") - 0.3).abs() < 1e-9);
        assert!((get("idle_captured_percent") - 75.0).abs() < 1e-9);
        assert_eq!(get("high_start_p99_us"), 40.0);
    }

    #[test]
    fn shares_and_missing_numbers() {
        let pair = share_pair(&report(0.0, 0.0, 0.3, 1.0), &report(0.0, 0.0, 0.6, 1.0)).unwrap();
        assert!((pair["share_ratio"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        let err = alone_case(&json!({"period_ms": {"mean": 1.0}})).unwrap_err();
        assert!(
            matches!(err, MetricsError::MissingNumber { ref key, .. } if key == "period_ms/p99")
        );
    }
}
