//! Experiment E1 (Wang et al., Fig 4/5): one high- and one low-priority training-like job on a
//! GPU, drawn from the five stand-in profiles of [`crate::profiles`]. Per pair and mode: the
//! high job's iteration time (`period_ms`, burst and CPU gap) against the same job alone
//! (exclusive: one job per GPU, as Kubernetes does natively), and the low job's throughput as
//! a fraction of its own exclusive throughput. Every figure is simulated.

use gpushare_proto::Priority;
use serde_json::{json, Map, Value};

use crate::experiment::{ExperimentError, Job, Mode};
use crate::metrics::{gpu_fraction, number, slowdown_percent, MetricsError};
use crate::profiles::{Profile, ALL, MOBILENET, SQUEEZENET, VGG11, VGG16, VGG19};

/// The fixed pairing (high, low): each profile is high once and low once, never with itself,
/// and every pair mixes shapes (a long-kernel VGG with a short-kernel network, or two VGGs of
/// different depth), so no pair is the same job twice.
pub const PAIRS: [(Profile, Profile); 5] = [
    (VGG11, MOBILENET),
    (VGG16, SQUEEZENET),
    (VGG19, VGG11),
    (MOBILENET, VGG19),
    (SQUEEZENET, VGG16),
];

/// A runner of one case: `mode` and the jobs, to each job's report in order.
pub type RunCase<'a> = &'a dyn Fn(Mode, &[Job]) -> Result<Vec<Value>, ExperimentError>;

/// A profile's seed: fixed per profile (not per role), so its exclusive run draws the very
/// kernels it draws in every pair.
fn seed_of(profile: &Profile, seed: u64) -> u64 {
    let index = ALL.iter().position(|p| p == profile).unwrap_or(0);
    seed + index as u64
}

fn job(profile: &Profile, priority: Priority, seed: u64, duration_ms: u64) -> Job {
    Job {
        name: format!(
            "{}-{}",
            profile.name,
            if priority == Priority::High {
                "high"
            } else {
                "low"
            }
        ),
        priority,
        compute_request: 0.0,
        compute_limit: 1.0,
        args: profile.args(seed_of(profile, seed), duration_ms),
    }
}

/// A pair's figures: the high job against its exclusive run, the low job's throughput over
/// its exclusive throughput.
pub fn pair_metrics(
    high_alone: &Value,
    low_alone: &Value,
    high: &Value,
    low: &Value,
) -> Result<Value, MetricsError> {
    let alone_mean = number("high (alone)", high_alone, "period_ms/mean")?;
    let alone_p99 = number("high (alone)", high_alone, "period_ms/p99")?;
    let mean = number("high", high, "period_ms/mean")?;
    let p99 = number("high", high, "period_ms/p99")?;
    let low_exclusive = number("low (alone)", low_alone, "throughput_iters_per_s")?;
    let low_tp = number("low", low, "throughput_iters_per_s")?;
    Ok(json!({
        "high_mean_ms": mean,
        "high_mean_slowdown_percent": slowdown_percent(alone_mean, mean),
        "high_p99_ms": p99,
        "high_p99_slowdown_percent": slowdown_percent(alone_p99, p99),
        "high_gpu_fraction": gpu_fraction("high", high)?,
        "low_iters_per_s": low_tp,
        "low_throughput_fraction": if low_exclusive > 0.0 { low_tp / low_exclusive } else { 0.0 },
        "low_gpu_fraction": gpu_fraction("low", low)?,
    }))
}

/// Runs E1: every profile alone once (its exclusive run, priority high, under no policy),
/// then each pair under every mode of `modes` but `alone`. `alone` in the results is the pair's
/// exclusive runs (slowdown 0, low fraction 1 by construction).
pub fn run(
    modes: &[Mode],
    seed: u64,
    duration_ms: u64,
    case: RunCase,
) -> Result<Value, ExperimentError> {
    let mut exclusive = Map::new();
    for profile in &ALL {
        let report = case(
            Mode::Alone,
            &[job(profile, Priority::High, seed, duration_ms)],
        )?
        .remove(0);
        exclusive.insert(profile.name.into(), report);
    }
    let mut pairs = Map::new();
    for (high_profile, low_profile) in &PAIRS {
        let high_alone = &exclusive[high_profile.name];
        let low_alone = &exclusive[low_profile.name];
        let mut by_mode = Map::new();
        by_mode.insert("high".into(), json!(high_profile.name));
        by_mode.insert("low".into(), json!(low_profile.name));
        by_mode.insert(
            Mode::Alone.name(),
            json!({
                "metrics": pair_metrics(high_alone, low_alone, high_alone, low_alone)?,
                "jobs": [high_alone, low_alone],
            }),
        );
        for &mode in modes.iter().filter(|&&m| m != Mode::Alone) {
            let reports = case(
                mode,
                &[
                    job(high_profile, Priority::High, seed, duration_ms),
                    job(low_profile, Priority::Low, seed, duration_ms),
                ],
            )?;
            by_mode.insert(
                mode.name(),
                json!({
                    "metrics": pair_metrics(high_alone, low_alone, &reports[0], &reports[1])?,
                    "jobs": reports,
                }),
            );
        }
        pairs.insert(
            format!("{}+{}", high_profile.name, low_profile.name),
            Value::Object(by_mode),
        );
    }
    Ok(json!({
        "duration_ms": duration_ms,
        "profiles": ALL,
        "pairs": pairs,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_profile_is_high_once_and_low_once_never_with_itself() {
        for p in ALL {
            assert_eq!(
                PAIRS.iter().filter(|(h, _)| *h == p).count(),
                1,
                "{}",
                p.name
            );
            assert_eq!(
                PAIRS.iter().filter(|(_, l)| *l == p).count(),
                1,
                "{}",
                p.name
            );
        }
        assert!(PAIRS.iter().all(|(h, l)| h != l));
        // Seeds follow the profile, not its role.
        assert_eq!(
            job(&VGG19, Priority::High, 10, 5).args,
            job(&VGG19, Priority::Low, 10, 5).args
        );
        assert_ne!(
            job(&VGG19, Priority::High, 10, 5).args,
            job(&VGG16, Priority::High, 10, 5).args
        );
    }

    #[test]
    fn pair_figures_against_the_exclusive_runs() {
        let report = |mean: f64, p99: f64, tp: f64| {
            json!({
                "period_ms": {"mean": mean, "p99": p99},
                "throughput_iters_per_s": tp,
                "kernel_time_s": 0.5,
                "elapsed_s": 1.0,
            })
        };
        let m = pair_metrics(
            &report(10.0, 12.0, 100.0),
            &report(8.0, 9.0, 50.0),
            &report(11.0, 18.0, 90.0),
            &report(20.0, 30.0, 20.0),
        )
        .unwrap();
        let get = |k: &str| m[k].as_f64().unwrap();
        assert!((get("high_mean_slowdown_percent") - 10.0).abs() < 1e-9);
        assert!((get("high_p99_slowdown_percent") - 50.0).abs() < 1e-9);
        assert!((get("low_throughput_fraction") - 0.4).abs() < 1e-9);
        assert!(pair_metrics(&json!({}), &report(1.0, 1.0, 1.0), &json!({}), &json!({})).is_err());
    }
}
