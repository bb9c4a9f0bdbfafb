//! Scenario `cluster`, **simulated**: what kube-scheduler's node-total counting of
//! `gpushare.io/memory` costs on a large cluster, against whole-GPU allocation
//! (`nvidia.com/gpu: 1`) and against a GPU-aware scheduler (an oracle).
//!
//! A deterministic discrete-event simulation: no arbiter, no GPU, no Kubernetes runs. The
//! decisions it models are kube-scheduler's filter, score and select ([`kube`]) and the
//! arbiter's own grant placement, the real [`gpushare_arbiter::grants::place_memory_grant`]
//! ([`shared`]). One seeded trace per load level ([`trace`]); every mode runs the same trace.

pub mod drive;
pub mod events;
pub mod kube;
pub mod meter;
pub mod report;
pub mod rng;
pub mod shared;
pub mod trace;
pub mod whole_gpu;

use std::path::Path;
use std::time::Instant;

use gpushare_testkit::stats::percentile;
use serde::Serialize;
use serde_json::{json, Value};

use drive::{drive, Timing};
use kube::{KubeScheduler, Scoring};
use meter::{Gauges, Meter};
use rng::SplitMix64;
use shared::{NodeFilter, SharedCluster};
use trace::{Pod, PodMix};
use whole_gpu::WholeGpuCluster;

pub const JSON_FILE: &str = "cluster.json";
pub const MARKDOWN_FILE: &str = "cluster.md";
/// Where `make bench` (a run of every scenario into `results/`) puts this scenario's files.
pub const RESULTS_SUBDIR: &str = "cluster-issue-17";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterMode {
    /// kube-scheduler on node totals, the arbiter places each grant (or it waits on the node).
    Gpushare,
    /// The same with MostAllocated scoring (nodes packed by their totals).
    GpushareMostAllocated,
    /// `nvidia.com/gpu: 1`: a whole GPU per pod, a FIFO queue for the cluster.
    WholeGpu,
    /// A scheduler that sees each GPU's largest free hole (the upper bound).
    GpuAware,
}

impl ClusterMode {
    pub const ALL: [ClusterMode; 4] = [
        Self::Gpushare,
        Self::GpushareMostAllocated,
        Self::GpuAware,
        Self::WholeGpu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Gpushare => "gpushare",
            Self::GpushareMostAllocated => "gpushare-most-allocated",
            Self::WholeGpu => "whole-gpu",
            Self::GpuAware => "gpu-aware",
        }
    }
}

/// Everything a run depends on; the results record it.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterParameters {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub gpu_memory_gib: u32,
    pub mix: PodMix,
    /// Offered load: the GPU memory the arriving pods ask for, on average, as a share of the
    /// cluster's.
    pub loads: Vec<f64>,
    /// Pods arrive from 0 until this time; the run goes on until the last has ended.
    pub arrival_horizon_h: f64,
    /// The steady window is [warm_up_h, arrival_horizon_h].
    pub warm_up_h: f64,
    /// The gauges' samples (`series`): every `sample_every_min` until `sample_until_h`.
    pub sample_every_min: f64,
    pub sample_until_h: f64,
    pub seed: u64,
}

impl ClusterParameters {
    /// 1,000 nodes of 8 × 80 GiB over 8 hours of arrivals; `quick`: 50 nodes over 3 hours
    /// (checks the harness in a debug build).
    pub fn new(quick: bool, seed: u64) -> Self {
        Self {
            nodes: if quick { 50 } else { 1_000 },
            gpus_per_node: 8,
            gpu_memory_gib: 80,
            mix: PodMix::typical(),
            loads: vec![0.1, 0.5, 0.7, 0.9],
            arrival_horizon_h: if quick { 3.0 } else { 8.0 },
            warm_up_h: if quick { 1.0 } else { 2.0 },
            sample_every_min: 15.0,
            sample_until_h: if quick { 4.0 } else { 12.0 },
            seed,
        }
    }

    pub fn total_memory_gib(&self) -> f64 {
        (self.nodes * self.gpus_per_node) as f64 * f64::from(self.gpu_memory_gib)
    }

    pub fn total_gpus(&self) -> f64 {
        (self.nodes * self.gpus_per_node) as f64
    }

    /// The memory the trace's pods would hold in the steady window, on average, had every one
    /// started on arrival, as a share of the cluster's: what a scheduler with no waits reaches.
    pub fn offered_in_steady_window(&self, pods: &[Pod]) -> f64 {
        let (from, to) = (self.warm_up_h * 3.6e6, self.arrival_horizon_h * 3.6e6);
        let gib_ms: f64 = pods
            .iter()
            .map(|pod| {
                let (start, end) = (
                    pod.arrival_ms as f64,
                    (pod.arrival_ms + pod.duration_ms) as f64,
                );
                f64::from(pod.memory_gib) * (end.min(to) - start.max(from)).max(0.0)
            })
            .sum();
        gib_ms / ((to - from) * self.total_memory_gib())
    }

    /// The trace of one load level: the same for every mode.
    pub fn trace(&self, load_index: usize) -> Vec<Pod> {
        let load = self.loads[load_index];
        let mut rng = SplitMix64::new(self.seed ^ (load_index as u64).wrapping_mul(0x5851_F42D));
        let rate = self.mix.arrival_rate_per_s(load, self.total_memory_gib());
        trace::generate(&self.mix, rate, self.arrival_horizon_h * 3600.0, &mut rng)
    }
}

/// One mode over one trace: each pod's timing, the gauges' means and samples, the end.
pub struct RunOutcome {
    pub timings: Vec<Timing>,
    pub meter: Meter,
    pub end_ms: u64,
}

pub fn simulate(p: &ClusterParameters, mode: ClusterMode, pods: &[Pod]) -> RunOutcome {
    let h_ms = |h: f64| (h * 3.6e6) as u64;
    let mut meter = Meter::new(
        (h_ms(p.warm_up_h), h_ms(p.arrival_horizon_h)),
        (p.sample_every_min * 60e3) as u64,
        h_ms(p.sample_until_h),
    );
    // Tie-breaks of their own: the trace is the same whatever a mode draws.
    let kube = KubeScheduler::new(SplitMix64::new(p.seed.wrapping_add(0x6B75_6265)));
    let (timings, end_ms) = match mode {
        ClusterMode::WholeGpu => {
            let mut c = WholeGpuCluster::new(p.nodes, p.gpus_per_node, kube, pods);
            drive(&mut c, pods, &mut meter)
        }
        shared => {
            let (filter, scoring) = match shared {
                ClusterMode::GpuAware => (NodeFilter::LargestGpuHole, Scoring::LeastAllocated),
                ClusterMode::GpushareMostAllocated => {
                    (NodeFilter::NodeTotals, Scoring::MostAllocated)
                }
                _ => (NodeFilter::NodeTotals, Scoring::LeastAllocated),
            };
            let mut c = SharedCluster::new(
                p.nodes,
                p.gpus_per_node,
                p.gpu_memory_gib,
                filter,
                scoring,
                kube,
                pods,
            );
            drive(&mut c, pods, &mut meter)
        }
    };
    RunOutcome {
        timings,
        meter,
        end_ms,
    }
}

/// Count, mean and percentiles of `seconds` (nulls when there are none).
pub fn distribution(mut seconds: Vec<f64>) -> Value {
    if seconds.is_empty() {
        return json!({"count": 0, "mean": null, "p50": null, "p95": null, "p99": null, "max": null});
    }
    seconds.sort_by(f64::total_cmp);
    let mean = seconds.iter().sum::<f64>() / seconds.len() as f64;
    json!({
        "count": seconds.len(),
        "mean": mean,
        "p50": percentile(&seconds, 50.0),
        "p95": percentile(&seconds, 95.0),
        "p99": percentile(&seconds, 99.0),
        "max": seconds[seconds.len() - 1],
    })
}

fn shares(g: &Gauges, p: &ClusterParameters) -> Value {
    json!({
        "memory_utilisation": g.granted_gib / p.total_memory_gib(),
        "gpu_occupancy": g.busy_gpus / p.total_gpus(),
        "stranded_memory": g.stranded_gib / p.total_memory_gib(),
        "cluster_pending_pods": g.cluster_pending,
        "node_waiting_pods": g.node_waiting,
    })
}

/// The figures of one mode on one trace.
pub fn metrics(p: &ClusterParameters, pods: &[Pod], run: &RunOutcome) -> Value {
    let s = |ms: u64| ms as f64 / 1e3;
    let waited: Vec<&Timing> = run.timings.iter().filter(|t| t.waited_on_node()).collect();
    let steady = (p.warm_up_h * 3.6e6, p.arrival_horizon_h * 3.6e6);
    let started_steady = run
        .timings
        .iter()
        .filter(|t| (steady.0..steady.1).contains(&(t.start_ms as f64)))
        .count();
    json!({
        "pods": pods.len(),
        "high_pods": pods.iter().filter(|p| p.high).count(),
        "admitted_where_no_gpu_fits": {
            "pods": waited.len(),
            "fraction": waited.len() as f64 / pods.len().max(1) as f64,
            "node_wait_s": distribution(waited.iter().map(|t| s(t.start_ms - t.bound_ms)).collect()),
        },
        "pending_s": distribution(run.timings.iter().zip(pods)
            .map(|(t, p)| s(t.start_ms - p.arrival_ms)).collect()),
        "cluster_queue_s": distribution(run.timings.iter().zip(pods)
            .map(|(t, p)| s(t.bound_ms - p.arrival_ms)).collect()),
        "steady": shares(&run.meter.steady_mean(), p),
        "run": shares(&run.meter.run_mean(), p),
        "makespan_h": run.end_ms as f64 / 3.6e6,
        "started_per_h_steady": started_steady as f64 / (p.arrival_horizon_h - p.warm_up_h),
        "arrivals_per_h": pods.len() as f64 / p.arrival_horizon_h,
        "series": run.meter.samples(),
    })
}

/// Every load level in every mode: the results document.
pub fn run_all(p: &ClusterParameters) -> Value {
    let mut levels = Vec::new();
    for (i, &load) in p.loads.iter().enumerate() {
        let pods = p.trace(i);
        // The modes are independent runs over one trace: one thread each.
        let figures: Vec<Value> = std::thread::scope(|scope| {
            let runs: Vec<_> = ClusterMode::ALL
                .iter()
                .map(|&mode| {
                    let pods = &pods;
                    scope.spawn(move || {
                        let started = Instant::now();
                        let run = simulate(p, mode, pods);
                        let mut figures = metrics(p, pods, &run);
                        let wall_s = started.elapsed().as_secs_f64();
                        figures["simulation_wall_s"] = json!(wall_s);
                        eprintln!(
                            "gpushare-bench: cluster load {:.0} % {}: {} pods in {wall_s:.1} s \
                             (simulated)",
                            load * 100.0,
                            mode.name(),
                            pods.len(),
                        );
                        figures
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("a simulation thread panicked"))
                .collect()
        });
        let modes: serde_json::Map<String, Value> = ClusterMode::ALL
            .iter()
            .map(|m| m.name().to_owned())
            .zip(figures)
            .collect();
        levels.push(json!({
            "offered_load": load,
            "offered_in_steady_window": p.offered_in_steady_window(&pods),
            "modes": modes,
        }));
    }
    json!({
        "simulated": true,
        "note": "Simulated: a discrete-event model of kube-scheduler and of the arbiter's grant \
                 placement (the real place_memory_grant); no cluster, arbiter or GPU ran.",
        "machine": crate::report::machine(),
        "parameters": p,
        "modes": ClusterMode::ALL.iter().map(|m| m.name()).collect::<Vec<_>>(),
        "levels": levels,
    })
}

/// Runs every level and writes `cluster.json`, `cluster.md` and `cluster.svg` into `dir`.
pub fn run_and_write(dir: &Path, p: &ClusterParameters) -> std::io::Result<Value> {
    let results = run_all(p);
    report::write(dir, &results)?;
    Ok(results)
}

/// Re-writes `cluster.md` and `cluster.svg` in `dir` from its `cluster.json`, which stays as
/// it was measured.
pub fn rerender(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(JSON_FILE);
    let text = std::fs::read(&path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading {}: {e}", path.display())))?;
    let results: Value = serde_json::from_slice(&text).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a cluster results document: {e}", path.display()),
        )
    })?;
    report::write_rendered(dir, &results)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(seed: u64) -> ClusterParameters {
        ClusterParameters {
            nodes: 12,
            loads: vec![0.8],
            arrival_horizon_h: 2.0,
            warm_up_h: 0.5,
            ..ClusterParameters::new(true, seed)
        }
    }

    /// The figures without the wall-clock time and the machine, which differ between runs.
    fn simulated_part(mut results: Value) -> Value {
        results["machine"] = Value::Null;
        for level in results["levels"].as_array_mut().unwrap() {
            for (_, m) in level["modes"].as_object_mut().unwrap() {
                m["simulation_wall_s"] = Value::Null;
            }
        }
        results
    }

    #[test]
    fn the_files_are_written_labelled_simulated_and_rerendered_from_the_json() {
        let dir = tempfile::tempdir().unwrap();
        let results = run_and_write(dir.path(), &small(1)).unwrap();
        let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
        let json: Value = serde_json::from_str(&read(JSON_FILE)).unwrap();
        // Floats may read back a last digit off: compare what is whole.
        let pods = |v: &Value| v["levels"][0]["modes"]["gpushare"]["pods"].as_u64();
        assert_eq!(pods(&json), pods(&results));
        assert!(pods(&json).unwrap() > 0);
        assert_eq!(json["modes"], results["modes"]);
        assert_eq!(json["simulated"], true);
        let md = read(MARKDOWN_FILE);
        assert!(
            md.contains("simulated") && md.contains("| gpushare |"),
            "{md}"
        );
        assert!(
            md.contains("(cluster.svg)") && md.contains(report::SERIES_SVG),
            "{md}"
        );
        for svg in ["cluster.svg", report::SERIES_SVG] {
            let text = read(svg);
            assert!(
                text.contains("<svg") && text.contains("cluster (simulated)"),
                "{svg}"
            );
        }
        std::fs::remove_file(dir.path().join(MARKDOWN_FILE)).unwrap();
        rerender(dir.path()).unwrap();
        assert_eq!(read(MARKDOWN_FILE), md);
        let missing = rerender(&dir.path().join("absent")).unwrap_err();
        assert!(missing.to_string().contains("cluster.json"), "{missing}");
    }

    #[test]
    fn a_seed_names_one_result_and_another_seed_another() {
        let a = simulated_part(run_all(&small(4)));
        assert_eq!(a, simulated_part(run_all(&small(4))));
        assert_ne!(a, simulated_part(run_all(&small(5))));
    }

    #[test]
    fn every_pod_runs_and_the_gpu_aware_scheduler_strands_none() {
        let p = small(9);
        let pods = p.trace(0);
        for mode in ClusterMode::ALL {
            let run = simulate(&p, mode, &pods);
            assert!(
                run.timings
                    .iter()
                    .zip(&pods)
                    .all(|(t, pod)| pod.arrival_ms <= t.bound_ms
                        && t.bound_ms <= t.start_ms
                        && t.start_ms < u64::MAX),
                "{mode:?}"
            );
            let m = metrics(&p, &pods, &run);
            let stranded = m["admitted_where_no_gpu_fits"]["pods"].as_u64().unwrap();
            match mode {
                ClusterMode::Gpushare | ClusterMode::GpushareMostAllocated => {
                    assert!(stranded > 0, "{mode:?}: 80 % load fragments the GPUs")
                }
                _ => assert_eq!(stranded, 0, "{mode:?}"),
            }
            let util = m["steady"]["memory_utilisation"].as_f64().unwrap();
            assert!(util > 0.0 && util <= 1.0, "{mode:?}: {util}");
            // A mode where no pod waited holds, in the window, just what the trace offers it:
            // the meter and the offered load agree.
            let never_waited = m["pending_s"]["max"].as_f64().unwrap() == 0.0;
            if mode == ClusterMode::GpuAware {
                assert!(
                    never_waited,
                    "12 nodes take every pod of this trace on arrival"
                );
            }
            if never_waited {
                let offered = p.offered_in_steady_window(&pods);
                assert!(
                    (util - offered).abs() < 1e-9,
                    "{mode:?}: {util} != {offered}"
                );
            }
        }
    }
}
