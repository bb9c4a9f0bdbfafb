//! Scenario `e2` (Wang et al., Table 4): training-like jobs arriving over the run on several
//! simulated GPUs, all low priority; makespan, job completion time and the GPUs' mean
//! utilisation sampled every second through NVML. Also the multi-GPU machinery `scaling`
//! shares: an arbiter over N simulated GPUs, jobs pinned to a GPU by UUID.
//!
//! Modes:
//! - `exclusive`: what Kubernetes does natively. The harness's own FIFO queue hands each job a
//!   whole GPU (at most one job per GPU; a job waits for a free one) and pins it with
//!   `NVIDIA_VISIBLE_DEVICES`. No arbiter and no interposer: nothing of gpushare runs.
//! - `gpushare`: each job reserves a lease through the arbiter's control socket when it arrives
//!   (Algorithm 1 places it), runs pinned to the lease's GPU under the interposer with the
//!   priority scheduler, and its lease is released when it ends.
//! - `uncontrolled`: the same placement and interposer, `policy = "off"` (device time slicing).
//!
//! Every figure is simulated.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::{ControlClient, Lease, Priority};
use gpushare_testkit::config::SchedulingPolicy;
use gpushare_testkit::simgpu::{gpu_uuid, SimMachine};
use gpushare_testkit::{stats, Arbiter};
use serde_json::{json, Value};

use crate::experiment::{collect, simgpu_env, ExperimentError};
use crate::setup::{self, Binaries};

/// A simulated machine of `gpus` GPUs, its state under `dir/simgpu`, and its processes'
/// environment ([`simgpu_env`]).
pub fn multi_gpu_machine(
    dir: &Path,
    libs: &Path,
    gpus: usize,
) -> (SimMachine, Vec<(String, String)>) {
    let machine = setup::sim_machine(dir, gpus, SIMGPU_SLICE_US, SIMGPU_SWITCH_US);
    let env = simgpu_env(&machine, libs);
    (machine, env)
}

/// Starts a private arbiter in `dir` over `machine`'s GPUs (found through the simulated
/// NVML), with Algorithm 1's two placement limits and `policy`'s default `[scheduler]`.
pub fn start_multi_gpu_arbiter(
    dir: &Path,
    machine: &SimMachine,
    env: &[(String, String)],
    gpu_util_limit: f64,
    low_nums_limit: u32,
    policy: SchedulingPolicy,
) -> Result<Arbiter, ExperimentError> {
    let scheduler = setup::scheduler_config(policy, None);
    let builder = setup::arbiter_on(dir, machine, env)
        .configure(|c| setup::multi_gpu_config(c, gpu_util_limit, low_nums_limit, scheduler));
    Ok(setup::start(builder)?)
}

const SIMGPU_SLICE_US: u64 = 1_000;
const SIMGPU_SWITCH_US: u64 = 25;

/// Starts `simgpu-workload` with `args`, pinned to GPU `uuid`; under the interposer on `lease`
/// when one is given. With `barrier`, it waits for that file before its first iteration.
pub fn spawn_pinned(
    binaries: &Binaries,
    env: &[(String, String)],
    uuid: &str,
    interposed: Option<(&Arbiter, &Lease)>,
    args: &[String],
    barrier: Option<&Path>,
) -> Result<Child, ExperimentError> {
    let mut command = Command::new(binaries.program("simgpu-workload"));
    command
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("NVIDIA_VISIBLE_DEVICES", uuid)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(barrier) = barrier {
        command.arg("--start-barrier").arg(barrier);
    }
    if let Some((arbiter, lease)) = interposed {
        command
            .env("LD_PRELOAD", &binaries.preload)
            .env("GPUSHARE_LEASE", &lease.id.0)
            .env("GPUSHARE_SOCKET", setup::lease_socket(arbiter, lease));
    }
    command.spawn().map_err(|source| ExperimentError::Io {
        what: "starting simgpu-workload".into(),
        source,
    })
}

/// Releases `lease` through the arbiter's control socket.
pub fn release(arbiter: &Arbiter, lease: &Lease) -> Result<(), ExperimentError> {
    ControlClient::connect(&arbiter.control_socket(), Duration::from_secs(5))
        .and_then(|mut c| c.release(lease.id.clone()))
        .map(|_| ())
        .map_err(|e| ExperimentError::Usage(format!("releasing lease {}: {e}", lease.id.0)))
}

/// One kernel/gap shape of a training-like job: `kernels` launches per iteration, each drawn
/// from `kernel`, then a CPU gap (data loading), for a fixed number of iterations so every job
/// has fixed work. Four shapes spanning GPU-bound to input-bound steps (alone, busy fraction
/// roughly 0.8, 0.6, 0.65, 0.35).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    pub name: &'static str,
    pub kernels: u32,
    pub kernel: &'static str,
    pub gap_us: u64,
    /// Iterations of a full-length job (about 6 s alone); `--quick` runs a tenth.
    pub iterations: u32,
}

pub const SHAPES: [Shape; 4] = [
    Shape {
        name: "conv-heavy",
        kernels: 40,
        kernel: "lognormal:200us:0.3",
        gap_us: 2_000,
        iterations: 600,
    },
    Shape {
        name: "small-kernels",
        kernels: 100,
        kernel: "fixed:30us",
        gap_us: 2_000,
        iterations: 1_200,
    },
    Shape {
        name: "large-batch",
        kernels: 10,
        kernel: "lognormal:1ms:0.2",
        gap_us: 5_000,
        iterations: 400,
    },
    Shape {
        name: "input-bound",
        kernels: 20,
        kernel: "lognormal:100us:0.5",
        gap_us: 4_000,
        iterations: 1_000,
    },
];

/// E2's parameters; written into the results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct E2Parameters {
    pub jobs: usize,
    pub gpus: usize,
    /// Mean of the seeded exponential inter-arrival times (a Poisson arrival process); the
    /// first job arrives at 0. The same arrivals and kernels in every mode.
    pub mean_interarrival_s: f64,
    pub seed: u64,
    /// Each shape's iterations are multiplied by this (1 full, 0.1 quick).
    pub work_scale: f64,
    /// Algorithm 1's limits in the gpushare and uncontrolled modes: the configuration's
    /// defaults, the paper's values.
    pub gpu_util_limit: f64,
    pub low_nums_limit: u32,
    pub nvml_sample_interval_s: f64,
    pub shapes: Vec<Shape>,
    pub simgpu_slice_us: u64,
    pub simgpu_switch_us: u64,
}

impl E2Parameters {
    pub fn new(quick: bool, seed: u64) -> Self {
        E2Parameters {
            jobs: if quick { 4 } else { 12 },
            gpus: if quick { 2 } else { 4 },
            mean_interarrival_s: if quick { 0.2 } else { 1.5 },
            seed,
            work_scale: if quick { 0.1 } else { 1.0 },
            gpu_util_limit: 0.8,
            low_nums_limit: 4,
            nvml_sample_interval_s: 1.0,
            shapes: SHAPES.to_vec(),
            simgpu_slice_us: SIMGPU_SLICE_US,
            simgpu_switch_us: SIMGPU_SWITCH_US,
        }
    }

    /// Each job's arrival (seconds after the first) and `simgpu-workload` arguments.
    pub fn jobs(&self) -> Vec<(f64, String, Vec<String>)> {
        let mut rng = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = || {
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut at = 0.0;
        (0..self.jobs)
            .map(|i| {
                if i > 0 {
                    at += -self.mean_interarrival_s * (1.0 - uniform()).ln();
                }
                let shape = self.shapes[i % self.shapes.len()];
                let iterations =
                    ((shape.iterations as f64 * self.work_scale).round() as u64).max(1);
                let args = [
                    "--kernels",
                    &shape.kernels.to_string(),
                    "--kernel",
                    shape.kernel,
                    "--gap",
                    &format!("{}us", shape.gap_us),
                    "--sync",
                    "event",
                    "--seed",
                    &(self.seed + i as u64).to_string(),
                    "--iterations",
                    &iterations.to_string(),
                ]
                .map(String::from)
                .to_vec();
                (at, format!("{}-{i}", shape.name), args)
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E2Mode {
    Exclusive,
    Gpushare,
    Uncontrolled,
}

impl E2Mode {
    pub fn name(self) -> &'static str {
        match self {
            E2Mode::Exclusive => "exclusive",
            E2Mode::Gpushare => "gpushare",
            E2Mode::Uncontrolled => "uncontrolled",
        }
    }
    pub const ALL: [E2Mode; 3] = [E2Mode::Exclusive, E2Mode::Uncontrolled, E2Mode::Gpushare];
}

/// Samples every GPU's NVML utilisation (busy time over the last second) each `interval`
/// through the simulated `libnvidia-ml.so.1`, loaded with `nvml-wrapper`, until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<Samples, String>>,
}

/// When each sample was taken, and every GPU's utilisation in percent.
type Samples = Vec<(Instant, Vec<u32>)>;

impl Sampler {
    /// The simulated NVML reads `SIMGPU_*` from the environment at `nvmlInit`: they are set
    /// in this process first (callers run no other threads at this point).
    fn start(libs: &Path, env: &[(String, String)], gpus: usize, interval: Duration) -> Self {
        for (k, v) in env.iter().filter(|(k, _)| k.starts_with("SIMGPU_")) {
            std::env::set_var(k, v);
        }
        let lib = libs.join("libnvidia-ml.so.1");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let nvml = nvml_wrapper::Nvml::builder()
                .lib_path(lib.as_os_str())
                .init()
                .map_err(|e| format!("NVML init: {e}"))?;
            let mut samples = Vec::new();
            let mut next = Instant::now() + interval;
            while !stopped.load(Ordering::Relaxed) {
                let now = Instant::now();
                if now < next {
                    std::thread::sleep((next - now).min(Duration::from_millis(20)));
                    continue;
                }
                next += interval;
                let mut row = Vec::with_capacity(gpus);
                for i in 0..gpus {
                    let util = nvml
                        .device_by_index(i as u32)
                        .and_then(|d| d.utilization_rates())
                        .map_err(|e| format!("NVML GPU {i}: {e}"))?;
                    row.push(util.gpu);
                }
                samples.push((Instant::now(), row));
            }
            Ok(samples)
        });
        Sampler { stop, thread }
    }

    fn finish(self) -> Result<Samples, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the NVML sampler panicked".to_string())?
    }
}

/// Mean of the samples taken within `[from, to]` over every GPU, in percent (samples cover the
/// second before them: the first counted is one interval after `from`).
pub fn mean_utilisation(samples: &[(Instant, Vec<u32>)], from: Instant, to: Instant) -> f64 {
    let values: Vec<f64> = samples
        .iter()
        .filter(|(at, _)| *at > from && *at <= to)
        .flat_map(|(_, row)| row.iter().map(|&u| f64::from(u)))
        .collect();
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

struct Running {
    index: usize,
    gpu: String,
    started: Instant,
    lease: Option<Lease>,
    child: Child,
}

/// Runs E2 in `mode` on a fresh simulated node; returns `{metrics, jobs, schedule}`.
pub fn run_e2(
    binaries: &Binaries,
    libs: &Path,
    p: &E2Parameters,
    mode: E2Mode,
) -> Result<Value, ExperimentError> {
    let dir = tempfile::Builder::new()
        .prefix("gsb-e2-")
        .tempdir_in("/tmp")
        .map_err(|source| ExperimentError::Io {
            what: "a private directory".into(),
            source,
        })?;
    let (machine, env) = multi_gpu_machine(dir.path(), libs, p.gpus);
    let arbiter = match mode {
        E2Mode::Exclusive => None,
        E2Mode::Gpushare | E2Mode::Uncontrolled => {
            let policy = if mode == E2Mode::Gpushare {
                SchedulingPolicy::Priority
            } else {
                SchedulingPolicy::Off
            };
            Some(start_multi_gpu_arbiter(
                dir.path(),
                &machine,
                &env,
                p.gpu_util_limit,
                p.low_nums_limit,
                policy,
            )?)
        }
    };
    let interval = Duration::from_secs_f64(p.nvml_sample_interval_s);
    let sampler = Sampler::start(libs, &env, p.gpus, interval);
    let jobs = p.jobs();
    let failed = |job: &str, why: String| ExperimentError::Job {
        job: job.to_owned(),
        mode: format!("e2 {}", mode.name()),
        why,
    };
    let start = Instant::now();
    let mut queue: std::collections::VecDeque<usize> = Default::default();
    let mut free: Vec<bool> = vec![true; p.gpus];
    let mut running: Vec<Running> = Vec::new();
    let mut done: Vec<Option<(Value, Value)>> = vec![None; jobs.len()];
    let mut arrived = 0;
    let limit = Duration::from_secs(600);
    while done.iter().any(Option::is_none) {
        if start.elapsed() > limit {
            for r in &mut running {
                let _ = r.child.kill();
            }
            return Err(failed("e2", format!("unfinished after {limit:?}")));
        }
        let now = start.elapsed().as_secs_f64();
        while arrived < jobs.len() && jobs[arrived].0 <= now {
            queue.push_back(arrived);
            arrived += 1;
        }
        // Place what can be placed, in arrival order.
        while let Some(&index) = queue.front() {
            let (_, name, args) = &jobs[index];
            let (gpu, lease) = match &arbiter {
                None => match free.iter().position(|&f| f) {
                    Some(g) => {
                        free[g] = false;
                        (gpu_uuid(g as u32), None)
                    }
                    None => break,
                },
                Some(arbiter) => {
                    let lease = setup::reserve(arbiter, name, Priority::Low, 0.0, 1.0)?;
                    let gpu = lease.gpus.first().cloned().ok_or_else(|| {
                        failed(name, format!("lease {} names no GPU", lease.id.0))
                    })?;
                    (gpu, Some(lease))
                }
            };
            queue.pop_front();
            let interposed = arbiter.as_ref().zip(lease.as_ref());
            let child = spawn_pinned(binaries, &env, &gpu, interposed, args, None)?;
            running.push(Running {
                index,
                gpu,
                started: Instant::now(),
                lease,
                child,
            });
        }
        let mut i = 0;
        while i < running.len() {
            let exited = running[i]
                .child
                .try_wait()
                .map_err(|e| failed(&jobs[running[i].index].1, e.to_string()))?;
            if exited.is_none() {
                i += 1;
                continue;
            }
            let r = running.swap_remove(i);
            let ended = Instant::now();
            let name = &jobs[r.index].1;
            let report = collect(r.child).map_err(|why| failed(name, why))?;
            if let Some(lease) = &r.lease {
                if let Some(arbiter) = &arbiter {
                    release(arbiter, lease)?;
                }
            } else if let Some(g) = (0..p.gpus).find(|&g| gpu_uuid(g as u32) == r.gpu) {
                free[g] = true;
            }
            let arrival = jobs[r.index].0;
            let entry = json!({
                "job": name,
                "gpu": r.gpu,
                "arrival_s": arrival,
                "start_s": (r.started - start).as_secs_f64(),
                "end_s": (ended - start).as_secs_f64(),
                "completion_s": (ended - start).as_secs_f64() - arrival,
            });
            done[r.index] = Some((report, entry));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let finished = Instant::now();
    let samples = sampler
        .finish()
        .map_err(|why| failed("NVML sampler", why))?;
    let (reports, schedule): (Vec<Value>, Vec<Value>) = done.into_iter().flatten().unzip();
    let completions: Vec<f64> = schedule
        .iter()
        .filter_map(|s| s["completion_s"].as_f64())
        .collect();
    let mean_completion = completions.iter().sum::<f64>() / completions.len().max(1) as f64;
    let gpus_used: std::collections::BTreeSet<&str> =
        schedule.iter().filter_map(|s| s["gpu"].as_str()).collect();
    Ok(json!({
        "metrics": {
            "makespan_s": (finished - start).as_secs_f64(),
            "mean_completion_s": mean_completion,
            "median_completion_s": stats::median(completions),
            "mean_gpu_utilisation_percent": mean_utilisation(&samples, start, finished),
            "gpus_used": gpus_used.len() as f64,
        },
        "jobs": reports,
        "schedule": schedule,
        "nvml_samples": samples.len(),
    }))
}

/// Runs every E2 mode; the `scenarios.e2` object.
pub fn run_all(
    binaries: &Binaries,
    libs: &Path,
    p: &E2Parameters,
    modes: &[E2Mode],
) -> Result<Value, ExperimentError> {
    let mut by_mode = serde_json::Map::new();
    for &mode in modes {
        eprintln!(
            "gpushare-bench: e2, {} jobs on {} GPUs with {} (simulated)",
            p.jobs,
            p.gpus,
            mode.name()
        );
        by_mode.insert(mode.name().into(), run_e2(binaries, libs, p, mode)?);
    }
    Ok(json!({"parameters": p, "modes": Value::Object(by_mode)}))
}

/// The Markdown table of `scenarios.e2`, or nothing.
pub fn markdown(results: &Value) -> String {
    let e2 = &results["scenarios"]["e2"];
    let Some(modes) = e2["modes"].as_object() else {
        return String::new();
    };
    let p = &e2["parameters"];
    let mut md = format!(
        "## Scenario `e2`: jobs arriving on a cluster (simulated)\n\n\
         {} training-like jobs of fixed work (shapes in the JSON), all low priority, arriving \
         as a seeded Poisson process (mean gap {} s) on {} simulated GPUs. `exclusive`: a FIFO \
         queue, one job per GPU (no gpushare); `gpushare`/`uncontrolled`: a lease per job \
         placed by Algorithm 1 (gpu_util_limit {}, low_nums_limit {}), priority scheduler or \
         none. Utilisation: NVML, every second, mean over GPUs and the makespan.\n\n\
         | mode | makespan s | mean JCT s | median JCT s | mean GPU util | GPUs used |\n\
         |---|---|---|---|---|---|\n",
        p["jobs"], p["mean_interarrival_s"], p["gpus"], p["gpu_util_limit"], p["low_nums_limit"],
    );
    for (mode, case) in modes {
        let m = &case["metrics"];
        let f = |k: &str, d: usize| m[k].as_f64().map_or("–".into(), |x| format!("{x:.d$}"));
        md += &format!(
            "| {mode} | {} | {} | {} | {}% | {} |\n",
            f("makespan_s", 2),
            f("mean_completion_s", 2),
            f("median_completion_s", 2),
            f("mean_gpu_utilisation_percent", 1),
            f("gpus_used", 0),
        );
    }
    md + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_are_seeded_increasing_and_fixed_work() {
        let p = E2Parameters::new(false, 3);
        let jobs = p.jobs();
        assert_eq!(jobs.len(), 12);
        assert_eq!(jobs[0].0, 0.0);
        assert!(jobs.windows(2).all(|w| w[1].0 >= w[0].0));
        assert_eq!(
            jobs.iter().map(|j| j.0).collect::<Vec<_>>(),
            E2Parameters::new(false, 3)
                .jobs()
                .iter()
                .map(|j| j.0)
                .collect::<Vec<_>>()
        );
        assert!(jobs[1].2.join(" ").contains("--iterations 1200"));
        let quick = E2Parameters::new(true, 3).jobs();
        assert!(quick[0].2.join(" ").contains("--iterations 60"));
        // The schedule records GPUs by the simulated device's own UUIDs.
        assert_eq!(gpu_uuid(3), "GPU-51a6d0e0-0000-4000-8000-000000000003");
    }

    #[test]
    fn utilisation_counts_samples_inside_the_window_only() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let samples = vec![
            (at(0), vec![100, 100]),
            (at(1000), vec![50, 100]),
            (at(2000), vec![0, 50]),
            (at(3000), vec![100, 100]),
        ];
        assert_eq!(mean_utilisation(&samples, at(0), at(2000)), 50.0);
        assert_eq!(mean_utilisation(&samples, at(5000), at(6000)), 0.0);
        // The median completion time of an even number of jobs is the mean of the middle two.
        assert_eq!(stats::median([3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
