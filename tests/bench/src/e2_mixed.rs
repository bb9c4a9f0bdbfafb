//! Scenario `e2-mixed`: the setting of Wang et al.'s cluster experiment with mixed
//! priorities. Jobs of several lengths and busy fractions (E2's four shapes at three lengths),
//! a third of them high priority, arrive as a seeded Poisson process fast enough that a FIFO
//! queue of exclusive GPUs makes them wait; every E2 mode runs the same jobs on the same
//! seeds. Each high job's configuration also runs once alone on a GPU of its own: its
//! slowdown in a mode is its completion time there (queueing counts) over that run time.
//!
//! Every figure is simulated.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::cluster::{
    compare_with_exclusive, fixed, poisson_arrivals, run_jobs, signed, ArrivingJob, ClusterSetup,
    E2Mode, Shape, SHAPES,
};
use crate::experiment::ExperimentError;
use crate::setup::Binaries;

/// The key of the scenario in the results.
pub const SCENARIO: &str = "e2-mixed";

/// E2-mixed's parameters; written into the results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MixedParameters {
    pub jobs: usize,
    /// GPUs, Algorithm 1's limits (the paper's, for `wang`), NVML's sampling interval.
    #[serde(flatten)]
    pub cluster: ClusterSetup,
    /// Every `high_every`th job (the first included) is high priority.
    pub high_every: usize,
    pub mean_interarrival_s: f64,
    pub seed: u64,
    /// Job `i` runs shape `i % 4` scaled by `length_scales[(i / 4) % 3]` and by `work_scale`
    /// (1 full, 0.1 quick): shapes and lengths cross, so high and low jobs both get several.
    pub length_scales: Vec<f64>,
    pub work_scale: f64,
    /// Each shape's CPU gap between iterations is multiplied by this: 1 runs E2's shapes
    /// (0.33-0.8 busy alone), 3 lighter jobs (about 0.15-0.6), the small jobs that waste most
    /// of a GPU of their own. How much sharing can gain depends on it most (see
    /// `tests/bench/results/e2-issue-18/README.md`).
    pub gap_scale: f64,
    pub shapes: Vec<Shape>,
}

impl MixedParameters {
    pub fn new(quick: bool, seed: u64, gap_scale: f64) -> Self {
        MixedParameters {
            jobs: if quick { 4 } else { 12 },
            cluster: ClusterSetup {
                gpus: if quick { 2 } else { 4 },
                gpu_util_limit: 0.8,
                low_nums_limit: 4,
                nvml_sample_interval_s: 1.0,
            },
            high_every: 3,
            // A burst: twelve jobs of 3-9 s alone (E2's shapes) within about a second on 4
            // GPUs, so exclusive GPUs queue two jobs deep. A mean gap of 0.5 s queued them 2.4 s
            // on average: too little queueing for sharing to win much (measured at 4a7aa19).
            mean_interarrival_s: 0.1,
            seed,
            length_scales: vec![0.5, 1.0, 1.5],
            work_scale: if quick { 0.1 } else { 1.0 },
            gap_scale,
            shapes: SHAPES
                .iter()
                .map(|shape| Shape {
                    gap_us: (shape.gap_us as f64 * gap_scale).round() as u64,
                    ..*shape
                })
                .collect(),
        }
    }

    /// The jobs, in arrival order; the same in every mode.
    pub fn jobs(&self) -> Vec<ArrivingJob> {
        poisson_arrivals(self.seed, self.jobs, self.mean_interarrival_s)
            .into_iter()
            .enumerate()
            .map(|(i, arrival_s)| {
                let shape = self.shapes[i % self.shapes.len()];
                let length = self.length_scales[(i / self.shapes.len()) % self.length_scales.len()];
                let high = i % self.high_every == 0;
                ArrivingJob {
                    arrival_s,
                    name: format!(
                        "{}-{}-x{length}-{i}",
                        if high { "high" } else { "low" },
                        shape.name
                    ),
                    high,
                    args: shape.args(length * self.work_scale, self.seed + i as u64),
                }
            })
            .collect()
    }
}

/// The high jobs' slowdown in one mode against their run time alone, in percent:
/// `(mean, max)` of `completion / alone - 1` over the schedule's high jobs; `None` when it
/// has none or one lacks a baseline.
pub fn high_slowdown(schedule: &[Value], alone_s: &BTreeMap<String, f64>) -> Option<(f64, f64)> {
    let slowdowns: Vec<f64> = schedule
        .iter()
        .filter(|s| s["priority"] == "high")
        .map(|s| {
            let alone = alone_s.get(s["job"].as_str()?)?;
            Some((s["completion_s"].as_f64()? / alone - 1.0) * 100.0)
        })
        .collect::<Option<_>>()?;
    if slowdowns.is_empty() {
        return None;
    }
    let mean = slowdowns.iter().sum::<f64>() / slowdowns.len() as f64;
    Some((mean, slowdowns.iter().copied().fold(f64::MIN, f64::max)))
}

/// Runs each high job alone, then every mode; the `scenarios["e2-mixed"]` object.
pub fn run_all(
    binaries: &Binaries,
    libs: &Path,
    p: &MixedParameters,
    modes: &[E2Mode],
) -> Result<Value, ExperimentError> {
    let jobs = p.jobs();
    let alone_cluster = ClusterSetup {
        gpus: 1,
        ..p.cluster
    };
    let (mut alone, mut alone_s) = (Map::new(), BTreeMap::new());
    for job in jobs.iter().filter(|j| j.high) {
        eprintln!("gpushare-bench: e2-mixed, {} alone (simulated)", job.name);
        let solo = ArrivingJob {
            arrival_s: 0.0,
            ..job.clone()
        };
        let case = run_jobs(
            binaries,
            libs,
            &alone_cluster,
            E2Mode::Exclusive,
            &[solo],
            "e2-mixed alone",
        )?;
        let run_s = case["schedule"][0]["run_s"].as_f64().ok_or_else(|| {
            ExperimentError::Usage(format!("{}: no run time alone in {case}", job.name))
        })?;
        alone_s.insert(job.name.clone(), run_s);
        alone.insert(
            job.name.clone(),
            json!({"run_s": run_s, "jobs": case["jobs"]}),
        );
    }
    let mut by_mode = Map::new();
    for &mode in modes {
        eprintln!(
            "gpushare-bench: e2-mixed, {} jobs ({} high) on {} GPUs with {} (simulated)",
            p.jobs,
            jobs.iter().filter(|j| j.high).count(),
            p.cluster.gpus,
            mode.name()
        );
        let mut case = run_jobs(binaries, libs, &p.cluster, mode, &jobs, SCENARIO)?;
        let slowdown = case["schedule"]
            .as_array()
            .and_then(|s| high_slowdown(s, &alone_s));
        if let (Some((mean, max)), Some(m)) = (slowdown, case["metrics"].as_object_mut()) {
            m.insert("high_mean_slowdown_percent".into(), json!(mean));
            m.insert("high_max_slowdown_percent".into(), json!(max));
        }
        by_mode.insert(mode.name().into(), case);
    }
    compare_with_exclusive(&mut by_mode);
    Ok(json!({"parameters": p, "alone": alone, "modes": Value::Object(by_mode)}))
}

/// The Markdown of `scenarios["e2-mixed"]`, or nothing.
pub fn markdown(results: &Value) -> String {
    let s = &results["scenarios"][SCENARIO];
    let Some(modes) = s["modes"].as_object() else {
        return String::new();
    };
    let p = &s["parameters"];
    let warning = crate::cluster::placement_warning(modes);
    let mut md = format!(
        "## Scenario `e2-mixed`: mixed-priority jobs arriving on a cluster (simulated)\n\n\
         {} jobs (one in {} high priority, the first included) of E2's shapes (their CPU \
         gaps × {}) at lengths {} of E2's, arriving as a seeded Poisson process (mean gap {} s) on {} simulated \
         GPUs; modes as in `e2`. JCT: completion time from arrival (queueing counts); \
         slowdown: a high job's JCT over its run time alone on a GPU of its own. Placement: \
         the time the arbiter took to place each request (its own clock, from its status). \
         vs excl.: the change of mean JCT (%) and of utilisation (points) \
         against `exclusive`.\n\n\
         | mode | makespan s | mean JCT s | vs excl. | high mean / p95 JCT s | low mean / p95 \
         JCT s | mean queue s | high slowdown mean / max | GPU util | vs excl. | placement \
         µs mean / max |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        p["jobs"],
        p["high_every"],
        p["gap_scale"],
        p["length_scales"],
        p["mean_interarrival_s"],
        p["gpus"],
    );
    for (mode, case) in modes {
        let m = &case["metrics"];
        let f = |k: &str, d: usize| fixed(m, k, d);
        let signed = |k: &str, unit: &str| signed(m, k, unit);
        md += &format!(
            "| {mode} | {} | {} | {} | {} / {} | {} / {} | {} | {}% / {}% | {}% | {} | {} / {} |\n",
            f("makespan_s", 2),
            f("mean_completion_s", 2),
            signed("mean_completion_vs_exclusive_percent", "%"),
            f("high_mean_completion_s", 2),
            f("high_p95_completion_s", 2),
            f("low_mean_completion_s", 2),
            f("low_p95_completion_s", 2),
            f("mean_queue_s", 2),
            f("high_mean_slowdown_percent", 1),
            f("high_max_slowdown_percent", 1),
            f("mean_gpu_utilisation_percent", 1),
            signed("utilisation_vs_exclusive_points", " pt"),
            f("placement_decision_mean_us", 1),
            f("placement_decision_max_us", 1),
        );
    }
    md + "\n" + &warning
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_third_high_several_lengths_and_arrivals_that_queue_exclusive_gpus() {
        let p = MixedParameters::new(false, 1, 1.0);
        let jobs = p.jobs();
        assert_eq!(jobs.len(), 12);
        let high: Vec<usize> = (0..12).filter(|&i| jobs[i].high).collect();
        assert_eq!(high, [0, 3, 6, 9]);
        assert_eq!(jobs, MixedParameters::new(false, 1, 1.0).jobs(), "seeded");
        // Job 9: the small-kernels shape (1,200 iterations in E2) at 1.5 times E2's length.
        assert!(jobs[9].args.join(" ").contains("--iterations 1800"));
        assert!(jobs[0].args.join(" ").contains("--iterations 300"));
        assert!(
            jobs[9].name.starts_with("high-small-kernels"),
            "{}",
            jobs[9].name
        );
        // All twelve arrive within about a second: three jobs for each GPU at once.
        assert!(jobs[11].arrival_s < 3.0, "{}", jobs[11].arrival_s);
        assert!(
            jobs[0].args.join(" ").contains("--gap 2000us"),
            "E2's gaps at scale 1"
        );
        let light = MixedParameters::new(false, 1, 3.0).jobs();
        assert!(
            light[0].args.join(" ").contains("--gap 6000us"),
            "{:?}",
            light[0].args
        );
        assert_eq!(light[5].arrival_s, jobs[5].arrival_s, "the same arrivals");
        let quick = MixedParameters::new(true, 1, 1.0).jobs();
        assert_eq!(quick.iter().filter(|j| j.high).count(), 2);
    }

    #[test]
    fn slowdown_against_alone_counts_high_jobs_only() {
        let schedule = [
            json!({"job": "h1", "priority": "high", "completion_s": 6.0}),
            json!({"job": "h2", "priority": "high", "completion_s": 12.0}),
            json!({"job": "l1", "priority": "low", "completion_s": 100.0}),
        ];
        let alone = BTreeMap::from([("h1".to_string(), 5.0), ("h2".to_string(), 8.0)]);
        let (mean, max) = high_slowdown(&schedule, &alone).unwrap();
        assert!((mean - 35.0).abs() < 1e-9, "{mean}");
        assert!((max - 50.0).abs() < 1e-9, "{max}");
        let missing = BTreeMap::from([("h1".to_string(), 5.0)]);
        assert_eq!(high_slowdown(&schedule, &missing), None);
        assert_eq!(high_slowdown(&schedule[2..], &alone), None);
    }

    #[test]
    fn markdown_has_a_row_per_mode_and_says_simulated() {
        let results = json!({"scenarios": {"e2-mixed": {
            "parameters": {"jobs": 12, "high_every": 3, "gap_scale": 3.0, "length_scales": [0.5, 1.0, 1.5],
                           "mean_interarrival_s": 0.5, "gpus": 4},
            "modes": {
                "exclusive": {"metrics": {"makespan_s": 30.0, "high_mean_slowdown_percent": 40.0}},
                "balanced": {"metrics": {"makespan_s": 22.0, "mean_completion_vs_exclusive_percent": -26.0}},
            },
        }}});
        let md = markdown(&results);
        assert!(md.contains("(simulated)"), "{md}");
        assert!(md.contains("CPU gaps × 3.0"), "{md}");
        assert!(md.contains("| exclusive | 30.00 |"), "{md}");
        assert!(md.contains("| balanced | 22.00 | – | -26.0% |"), "{md}");
        assert!(md.contains("40.0% / –%"), "{md}");
        assert_eq!(markdown(&json!({"scenarios": {}})), "");
    }
}
