//! Experiment E3: an inference-style high-priority job (Poisson requests of 50 kernels of
//! ~100 µs, each answered before the next is served) next to one saturating low-priority job.
//! Per mode: the high job's p50 and p99 request latency against the same job alone, and the
//! GPU share the low job got. Every figure is simulated.

use gpushare_proto::Priority;
use serde_json::{json, Map, Value};

use crate::e1::RunCase;
use crate::experiment::{ExperimentError, Job, Mode, Parameters};
use crate::metrics::{gpu_fraction, number, slowdown_percent, MetricsError};

pub const KERNELS_PER_REQUEST: u32 = 50;
pub const KERNEL: &str = "lognormal:100us:0.3";
/// 50 kernels of ~105 µs mean are ~5.2 ms of GPU time per request: 75 requests/s keep the GPU
/// ~40 % busy with this job alone (0.39 from the kernel times; launch costs add a little).
pub const REQUESTS_PER_S: f64 = 75.0;

/// The inference job: high priority, Poisson arrivals from `seed`.
pub fn inference_job(seed: u64, duration_ms: u64) -> Job {
    Job {
        name: "inference-high".into(),
        priority: Priority::High,
        compute_request: 0.0,
        compute_limit: 1.0,
        args: [
            "--requests-per-s",
            &REQUESTS_PER_S.to_string(),
            "--kernels",
            &KERNELS_PER_REQUEST.to_string(),
            "--kernel",
            KERNEL,
        ]
        .map(String::from)
        .into_iter()
        .chain(crate::profiles::synced_run(seed, duration_ms))
        .collect(),
    }
}

/// Request latency against the job alone, and the GPU shares.
pub fn latency_metrics(
    alone: &Value,
    high: &Value,
    low: Option<&Value>,
) -> Result<Value, MetricsError> {
    let alone_p50 = number("inference (alone)", alone, "request_latency_ms/p50")?;
    let alone_p99 = number("inference (alone)", alone, "request_latency_ms/p99")?;
    let p50 = number("inference", high, "request_latency_ms/p50")?;
    let p99 = number("inference", high, "request_latency_ms/p99")?;
    Ok(json!({
        "high_p50_ms": p50,
        "high_p50_slowdown_percent": slowdown_percent(alone_p50, p50),
        "high_p99_ms": p99,
        "high_p99_slowdown_percent": slowdown_percent(alone_p99, p99),
        "high_max_ms": number("inference", high, "request_latency_ms/max")?,
        "high_gpu_fraction": gpu_fraction("inference", high)?,
        "low_gpu_fraction": low.map(|l| gpu_fraction("low", l)).transpose()?.unwrap_or(0.0),
    }))
}

/// Runs E3: the inference job alone (the baseline, whatever `modes` holds), then with one
/// saturating low job (the `priority` scenario's, [`Parameters::low_job`]) in every other mode.
pub fn run(
    modes: &[Mode],
    parameters: &Parameters,
    duration_ms: u64,
    case: RunCase,
) -> Result<Value, ExperimentError> {
    let mut shortened = parameters.clone();
    shortened.duration_s = duration_ms as f64 / 1e3;
    let alone = case(Mode::Alone, &[inference_job(parameters.seed, duration_ms)])?.remove(0);
    let mut by_mode = Map::new();
    by_mode.insert(
        Mode::Alone.name(),
        json!({"metrics": latency_metrics(&alone, &alone, None)?, "jobs": [alone.clone()]}),
    );
    for &mode in modes.iter().filter(|&&m| m != Mode::Alone) {
        let reports = case(
            mode,
            &[
                inference_job(parameters.seed, duration_ms),
                shortened.low_job(0, 0.0, 1.0),
            ],
        )?;
        by_mode.insert(
            mode.name(),
            json!({
                "metrics": latency_metrics(&alone, &reports[0], Some(&reports[1]))?,
                "jobs": reports,
            }),
        );
    }
    Ok(json!({
        "duration_ms": duration_ms,
        "kernels_per_request": KERNELS_PER_REQUEST,
        "kernel": KERNEL,
        "requests_per_s": REQUESTS_PER_S,
        "modes": by_mode,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_against_the_job_alone() {
        let report = |p50: f64, p99: f64| {
            json!({
                "request_latency_ms": {"p50": p50, "p99": p99, "max": p99 * 2.0},
                "kernel_time_s": 0.4,
                "elapsed_s": 1.0,
            })
        };
        let low = json!({"kernel_time_s": 0.5, "elapsed_s": 1.0});
        let m = latency_metrics(&report(5.0, 8.0), &report(6.0, 16.0), Some(&low)).unwrap();
        let get = |k: &str| m[k].as_f64().unwrap();
        assert!((get("high_p50_slowdown_percent") - 20.0).abs() < 1e-9);
        assert!((get("high_p99_slowdown_percent") - 100.0).abs() < 1e-9);
        assert_eq!((get("high_max_ms"), get("low_gpu_fraction")), (32.0, 0.5));
        assert!(latency_metrics(&report(5.0, 8.0), &json!({}), None).is_err());
        let job = inference_job(4, 1000).args.join(" ");
        assert!(
            job.contains("--requests-per-s 75 --kernels 50") && job.contains("--seed 4"),
            "{job}"
        );
    }
}
