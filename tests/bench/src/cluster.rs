//! Scenario `e2` (Wang et al., Table 4): training-like jobs arriving over the run on several
//! simulated GPUs, all low priority; makespan, job completion time and the GPUs' mean
//! utilisation sampled every second through NVML. Also the multi-GPU machinery `scaling`
//! shares: an arbiter over N simulated GPUs, jobs pinned to a GPU by UUID.
//!
//! Modes:
//! - `exclusive`: what Kubernetes does natively. The harness's own FIFO queue hands each job a
//!   whole GPU (at most one job per GPU; a job waits for a free one) and pins it with
//!   `NVIDIA_VISIBLE_DEVICES`. No arbiter and no interposer: nothing of gpushare runs.
//! - `wang`, `balanced`, `batch`: each job reserves a lease through the arbiter's
//!   control socket when it arrives, runs pinned to the lease's GPU under the interposer with
//!   the priority scheduler, and its lease is released when it ends. The lease is placed by
//!   Algorithm 1 (`placement.policy = "wang"`, what E2 called `gpushare` before the
//!   balanced policy existed), the balanced policy, or the balanced policy with
//!   `placement.batch = true`.
//! - `uncontrolled`: the balanced placement and the interposer, `scheduler.policy = "off"`
//!   (device time slicing).
//!
//! [`run_jobs`] runs any list of [`ArrivingJob`]s in a mode; E2-mixed (`e2_mixed`) uses it too.
//!
//! Every figure is simulated.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::{ControlClient, Lease, Priority};
use gpushare_testkit::config::{Config, PlacementPolicy, SchedulingPolicy};
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

    /// The cluster every mode runs on.
    pub fn cluster(&self) -> ClusterSetup {
        ClusterSetup {
            gpus: self.gpus,
            gpu_util_limit: self.gpu_util_limit,
            low_nums_limit: self.low_nums_limit,
            nvml_sample_interval_s: self.nvml_sample_interval_s,
        }
    }

    /// Each job's arrival (seconds after the first) and `simgpu-workload` arguments; all low
    /// priority.
    pub fn jobs(&self) -> Vec<ArrivingJob> {
        let arrivals = poisson_arrivals(self.seed, self.jobs, self.mean_interarrival_s);
        arrivals
            .into_iter()
            .enumerate()
            .map(|(i, arrival_s)| {
                let shape = self.shapes[i % self.shapes.len()];
                ArrivingJob {
                    arrival_s,
                    name: format!("{}-{i}", shape.name),
                    high: false,
                    args: shape.args(self.work_scale, self.seed + i as u64),
                }
            })
            .collect()
    }
}

impl Shape {
    /// `simgpu-workload`'s arguments for this shape with its iterations scaled by `scale`
    /// (at least one) and kernel durations drawn from `seed`.
    pub fn args(&self, scale: f64, seed: u64) -> Vec<String> {
        let iterations = ((self.iterations as f64 * scale).round() as u64).max(1);
        [
            "--kernels",
            &self.kernels.to_string(),
            "--kernel",
            self.kernel,
            "--gap",
            &format!("{}us", self.gap_us),
            "--sync",
            "event",
            "--seed",
            &seed.to_string(),
            "--iterations",
            &iterations.to_string(),
        ]
        .map(String::from)
        .to_vec()
    }
}

/// `n` arrival times (seconds) of a seeded Poisson process of mean gap `mean_gap_s`, the
/// first at 0: the same in every mode.
pub fn poisson_arrivals(seed: u64, n: usize, mean_gap_s: f64) -> Vec<f64> {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut at = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                at += -mean_gap_s * (1.0 - uniform()).ln();
            }
            at
        })
        .collect()
}

/// One job of an arrival experiment.
#[derive(Debug, Clone, PartialEq)]
pub struct ArrivingJob {
    /// Seconds after the run's start.
    pub arrival_s: f64,
    pub name: String,
    /// High priority (else low): its lease's priority in the arbiter's modes.
    pub high: bool,
    pub args: Vec<String>,
}

/// The simulated cluster an arrival experiment runs on, and the arbiter's Algorithm 1 limits
/// (used by the `wang` mode only).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ClusterSetup {
    pub gpus: usize,
    pub gpu_util_limit: f64,
    pub low_nums_limit: u32,
    pub nvml_sample_interval_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E2Mode {
    Exclusive,
    Uncontrolled,
    Wang,
    Balanced,
    Batch,
}

/// What an arbiter mode configures: the scheduler's policy and the placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArbiterMode {
    pub scheduling: SchedulingPolicy,
    pub placement: PlacementPolicy,
    pub batch: bool,
}

impl E2Mode {
    pub fn name(self) -> &'static str {
        match self {
            E2Mode::Exclusive => "exclusive",
            E2Mode::Uncontrolled => "uncontrolled",
            E2Mode::Wang => "wang",
            E2Mode::Balanced => "balanced",
            E2Mode::Batch => "batch",
        }
    }
    pub const ALL: [E2Mode; 5] = [
        E2Mode::Exclusive,
        E2Mode::Uncontrolled,
        E2Mode::Wang,
        E2Mode::Balanced,
        E2Mode::Batch,
    ];

    /// The arbiter's settings in this mode; `None`: no arbiter (exclusive GPUs).
    pub fn arbiter(self) -> Option<ArbiterMode> {
        let priority = |placement, batch| ArbiterMode {
            scheduling: SchedulingPolicy::Priority,
            placement,
            batch,
        };
        match self {
            E2Mode::Exclusive => None,
            E2Mode::Uncontrolled => Some(ArbiterMode {
                scheduling: SchedulingPolicy::Off,
                placement: PlacementPolicy::Balanced,
                batch: false,
            }),
            E2Mode::Wang => Some(priority(PlacementPolicy::Wang, false)),
            E2Mode::Balanced => Some(priority(PlacementPolicy::Balanced, false)),
            E2Mode::Batch => Some(priority(PlacementPolicy::Balanced, true)),
        }
    }
}

/// The arbiter's configuration in an arbiter mode: Algorithm 1's limits, the mode's
/// scheduler policy (its other settings the defaults) and placement.
pub fn arbiter_config(config: &mut Config, cluster: &ClusterSetup, mode: ArbiterMode) {
    let scheduler = setup::scheduler_config(mode.scheduling, None);
    setup::multi_gpu_config(
        config,
        cluster.gpu_util_limit,
        cluster.low_nums_limit,
        scheduler,
    );
    config.placement.policy = mode.placement;
    config.placement.batch = mode.batch;
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
    reserve_ms: Option<f64>,
    lease: Option<Lease>,
    child: Child,
}

/// Runs `jobs` in `mode` on a fresh simulated cluster; returns `{metrics, jobs, schedule}`.
/// `label` names the experiment in errors.
pub fn run_jobs(
    binaries: &Binaries,
    libs: &Path,
    cluster: &ClusterSetup,
    mode: E2Mode,
    jobs: &[ArrivingJob],
    label: &str,
) -> Result<Value, ExperimentError> {
    let dir = tempfile::Builder::new()
        .prefix("gsb-e2-")
        .tempdir_in("/tmp")
        .map_err(|source| ExperimentError::Io {
            what: "a private directory".into(),
            source,
        })?;
    let (machine, env) = multi_gpu_machine(dir.path(), libs, cluster.gpus);
    let arbiter = match mode.arbiter() {
        None => None,
        Some(settings) => {
            let builder = setup::arbiter_on(dir.path(), &machine, &env)
                .configure(|c| arbiter_config(c, cluster, settings));
            Some(setup::start(builder)?)
        }
    };
    let interval = Duration::from_secs_f64(cluster.nvml_sample_interval_s);
    let sampler = Sampler::start(libs, &env, cluster.gpus, interval);
    let failed = |job: &str, why: String| ExperimentError::Job {
        job: job.to_owned(),
        mode: format!("{label} {}", mode.name()),
        why,
    };
    let start = Instant::now();
    let mut queue: std::collections::VecDeque<usize> = Default::default();
    let mut free: Vec<bool> = vec![true; cluster.gpus];
    let mut running: Vec<Running> = Vec::new();
    let mut done: Vec<Option<(Value, Value)>> = vec![None; jobs.len()];
    let mut arrived = 0;
    let limit = Duration::from_secs(600);
    while done.iter().any(Option::is_none) {
        if start.elapsed() > limit {
            for r in &mut running {
                let _ = r.child.kill();
            }
            return Err(failed(label, format!("unfinished after {limit:?}")));
        }
        let now = start.elapsed().as_secs_f64();
        while arrived < jobs.len() && jobs[arrived].arrival_s <= now {
            queue.push_back(arrived);
            arrived += 1;
        }
        // Place what can be placed, in arrival order.
        while let Some(&index) = queue.front() {
            let job = &jobs[index];
            let (gpu, lease, reserve_ms) = match &arbiter {
                None => match free.iter().position(|&f| f) {
                    Some(g) => {
                        free[g] = false;
                        (gpu_uuid(g as u32), None, None)
                    }
                    None => break,
                },
                Some(arbiter) => {
                    let priority = if job.high {
                        Priority::High
                    } else {
                        Priority::Low
                    };
                    let asked = Instant::now();
                    let lease = setup::reserve(arbiter, &job.name, priority, 0.0, 1.0)?;
                    let reserve_ms = asked.elapsed().as_secs_f64() * 1e3;
                    let gpu = lease.gpus.first().cloned().ok_or_else(|| {
                        failed(&job.name, format!("lease {} names no GPU", lease.id.0))
                    })?;
                    (gpu, Some(lease), Some(reserve_ms))
                }
            };
            queue.pop_front();
            let interposed = arbiter.as_ref().zip(lease.as_ref());
            let child = spawn_pinned(binaries, &env, &gpu, interposed, &job.args, None)?;
            running.push(Running {
                index,
                gpu,
                started: Instant::now(),
                reserve_ms,
                lease,
                child,
            });
        }
        let mut i = 0;
        while i < running.len() {
            let exited = running[i]
                .child
                .try_wait()
                .map_err(|e| failed(&jobs[running[i].index].name, e.to_string()))?;
            if exited.is_none() {
                i += 1;
                continue;
            }
            let r = running.swap_remove(i);
            let ended = Instant::now();
            let job = &jobs[r.index];
            let report = collect(r.child).map_err(|why| failed(&job.name, why))?;
            if let Some(lease) = &r.lease {
                if let Some(arbiter) = &arbiter {
                    release(arbiter, lease)?;
                }
            } else if let Some(g) = (0..cluster.gpus).find(|&g| gpu_uuid(g as u32) == r.gpu) {
                free[g] = true;
            }
            let started_s = (r.started - start).as_secs_f64();
            let ended_s = (ended - start).as_secs_f64();
            let entry = json!({
                "job": job.name,
                "priority": if job.high { "high" } else { "low" },
                "gpu": r.gpu,
                "arrival_s": job.arrival_s,
                "start_s": started_s,
                "end_s": ended_s,
                "queue_s": started_s - job.arrival_s,
                "run_s": ended_s - started_s,
                "completion_s": ended_s - job.arrival_s,
                "reserve_ms": r.reserve_ms,
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
    // What the arbiter says it placed with, beside what the mode configured: a run whose
    // arbiter ignored its [placement] table must not pass for the policy it names.
    let placement = arbiter.as_ref().zip(mode.arbiter()).map(|(arbiter, asked)| {
        let logged = placement_logged(&arbiter.log());
        json!({
            "logged": logged.as_ref().map(|(policy, batch)| json!({"policy": policy, "batch": batch})),
            "as_configured": logged == Some((policy_name(asked.placement).to_owned(), asked.batch)),
        })
    });
    let mut metrics = schedule_metrics(&schedule);
    if let Some(arbiter) = &arbiter {
        let times = setup::placement_times(arbiter)
            .map_err(|why| failed("the arbiter's status", why.to_string()))?;
        for (count_key, key, h) in [
            (
                "placement_decisions",
                "placement_decision",
                &times.decisions,
            ),
            ("batch_searches", "batch_search", &times.batch_searches),
        ] {
            metrics.insert(count_key.into(), json!(h.count));
            if let Some(mean) = h.mean() {
                metrics.insert(format!("{key}_mean_us"), json!(mean.as_secs_f64() * 1e6));
                metrics.insert(format!("{key}_max_us"), json!(h.max_ns as f64 / 1e3));
            }
        }
    }
    metrics.insert("makespan_s".into(), json!((finished - start).as_secs_f64()));
    metrics.insert(
        "mean_gpu_utilisation_percent".into(),
        json!(mean_utilisation(&samples, start, finished)),
    );
    Ok(json!({
        "metrics": metrics,
        "jobs": reports,
        "schedule": schedule,
        "nvml_samples": samples.len(),
        "placement": placement,
    }))
}

/// The placement policy's name as the configuration writes it.
pub fn policy_name(policy: PlacementPolicy) -> &'static str {
    match policy {
        PlacementPolicy::Wang => "wang",
        PlacementPolicy::Balanced => "balanced",
    }
}

/// The placement the arbiter logged at start (`placement policy=Balanced batch=false ...`),
/// as `(policy in lower case, batch)`; `None` when its log has no such line.
pub fn placement_logged(log: &str) -> Option<(String, bool)> {
    let line = log
        .lines()
        .find(|l| l.contains(": placement ") && l.contains("policy="))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(key))
            .map(str::to_owned)
    };
    let policy = field("policy=")?.to_lowercase();
    let batch = field("batch=")?.parse().ok()?;
    Some((policy, batch))
}

/// A Markdown warning naming the modes whose arbiter logged another placement than the
/// mode configured (or none), or nothing when every mode ran what it names.
pub fn placement_warning(modes: &serde_json::Map<String, Value>) -> String {
    let off: Vec<String> = modes
        .iter()
        .filter(|(_, case)| case["placement"]["as_configured"] == false)
        .map(|(mode, case)| {
            let logged = &case["placement"]["logged"];
            match logged["policy"].as_str() {
                Some(policy) => format!("`{mode}` ran `{policy}` (batch {})", logged["batch"]),
                None => format!("`{mode}` logged no placement"),
            }
        })
        .collect();
    if off.is_empty() {
        return String::new();
    }
    format!(
        "**Not the placement these modes name**: the arbiter did not run the configured \
         `[placement]` table: {}.\n\n",
        off.join(", ")
    )
}

/// The figures a run's schedule gives (every job's `completion_s`, `queue_s`, `priority`,
/// `gpu`, `reserve_ms`): completion times overall and by priority (mean, median, p95),
/// queueing, GPUs used, and the reserve round trip the harness saw (connect, reserve,
/// confirm; the arbiter's own decision time is read from its status, see `run_jobs`). A
/// priority with no job has no keys, so every value is finite.
pub fn schedule_metrics(schedule: &[Value]) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    let values = |key: &str, priority: Option<&str>| -> Vec<f64> {
        schedule
            .iter()
            .filter(|s| priority.is_none_or(|p| s["priority"] == p))
            .filter_map(|s| s[key].as_f64())
            .collect()
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let p95 = |v: &[f64]| {
        let mut sorted = v.to_vec();
        sorted.sort_by(f64::total_cmp);
        stats::percentile(&sorted, 95.0)
    };
    let completions = values("completion_s", None);
    if !completions.is_empty() {
        m.insert("mean_completion_s".into(), json!(mean(&completions)));
        m.insert(
            "median_completion_s".into(),
            json!(stats::median(completions.iter().copied())),
        );
        m.insert("p95_completion_s".into(), json!(p95(&completions)));
    }
    let queued = values("queue_s", None);
    if !queued.is_empty() {
        m.insert("mean_queue_s".into(), json!(mean(&queued)));
    }
    for priority in ["high", "low"] {
        let c = values("completion_s", Some(priority));
        if c.is_empty() {
            continue;
        }
        m.insert(format!("{priority}_mean_completion_s"), json!(mean(&c)));
        m.insert(format!("{priority}_p95_completion_s"), json!(p95(&c)));
        let q = values("queue_s", Some(priority));
        m.insert(format!("{priority}_mean_queue_s"), json!(mean(&q)));
    }
    let reserve = values("reserve_ms", None);
    if !reserve.is_empty() {
        m.insert("mean_reserve_ms".into(), json!(mean(&reserve)));
        m.insert(
            "max_reserve_ms".into(),
            json!(reserve.iter().copied().fold(0.0, f64::max)),
        );
    }
    let gpus_used: std::collections::BTreeSet<&str> =
        schedule.iter().filter_map(|s| s["gpu"].as_str()).collect();
    m.insert("gpus_used".into(), json!(gpus_used.len() as f64));
    m
}

/// Adds to each mode's metrics how it compares with `exclusive`: its mean completion time's
/// change in percent (negative: shorter) and its utilisation's in points. Nothing without an
/// exclusive mode.
pub fn compare_with_exclusive(by_mode: &mut serde_json::Map<String, Value>) {
    let metric = |case: &Value, key: &str| case["metrics"][key].as_f64();
    let Some(exclusive) = by_mode.get("exclusive").cloned() else {
        return;
    };
    let (Some(jct), Some(util)) = (
        metric(&exclusive, "mean_completion_s"),
        metric(&exclusive, "mean_gpu_utilisation_percent"),
    ) else {
        return;
    };
    for case in by_mode.values_mut() {
        let (Some(mode_jct), Some(mode_util)) = (
            metric(case, "mean_completion_s"),
            metric(case, "mean_gpu_utilisation_percent"),
        ) else {
            continue;
        };
        if let Some(m) = case["metrics"].as_object_mut() {
            m.insert(
                "mean_completion_vs_exclusive_percent".into(),
                json!((mode_jct / jct - 1.0) * 100.0),
            );
            m.insert(
                "utilisation_vs_exclusive_points".into(),
                json!(mode_util - util),
            );
        }
    }
}

/// Runs every E2 mode; the `scenarios.e2` object.
pub fn run_all(
    binaries: &Binaries,
    libs: &Path,
    p: &E2Parameters,
    modes: &[E2Mode],
) -> Result<Value, ExperimentError> {
    let mut by_mode = serde_json::Map::new();
    let jobs = p.jobs();
    for &mode in modes {
        eprintln!(
            "gpushare-bench: e2, {} jobs on {} GPUs with {} (simulated)",
            p.jobs,
            p.gpus,
            mode.name()
        );
        let case = run_jobs(binaries, libs, &p.cluster(), mode, &jobs, "e2")?;
        by_mode.insert(mode.name().into(), case);
    }
    compare_with_exclusive(&mut by_mode);
    Ok(json!({"parameters": p, "modes": Value::Object(by_mode)}))
}

/// A table cell: `metrics[key]` with `decimals` decimals, or a dash where it is absent.
pub fn fixed(metrics: &Value, key: &str, decimals: usize) -> String {
    metrics[key]
        .as_f64()
        .map_or("–".into(), |x| format!("{x:.decimals$}"))
}

/// A table cell: `metrics[key]` signed, one decimal, then `unit`; a dash where it is absent.
pub fn signed(metrics: &Value, key: &str, unit: &str) -> String {
    metrics[key]
        .as_f64()
        .map_or("–".into(), |x| format!("{x:+.1}{unit}"))
}

/// The Markdown table of `scenarios.e2`, or nothing.
pub fn markdown(results: &Value) -> String {
    let e2 = &results["scenarios"]["e2"];
    let Some(modes) = e2["modes"].as_object() else {
        return String::new();
    };
    let p = &e2["parameters"];
    let warning = placement_warning(modes);
    let mut md = format!(
        "## Scenario `e2`: jobs arriving on a cluster (simulated)\n\n\
         {} training-like jobs of fixed work (shapes in the JSON), all low priority, arriving \
         as a seeded Poisson process (mean gap {} s) on {} simulated GPUs. `exclusive`: a FIFO \
         queue, one job per GPU (no gpushare); the other modes a lease per job: `wang` placed \
         by Algorithm 1 (gpu_util_limit {}, low_nums_limit {}), `balanced` by the balanced \
         policy, `batch` by the balanced policy with the batch search, all three under the \
         priority scheduler; `uncontrolled` balanced placement, no scheduler. Utilisation: \
         NVML, every second, mean over GPUs and the makespan. vs excl.: the change of mean JCT \
         (%) and of utilisation (points) against `exclusive`. Placement: the time the arbiter \
         took to place each request (its own clock, from its status).\n\n\
         | mode | makespan s | mean JCT s | vs excl. | median / p95 JCT s | mean queue s | \
         mean GPU util | vs excl. | GPUs used | placement µs mean / max |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        p["jobs"], p["mean_interarrival_s"], p["gpus"], p["gpu_util_limit"], p["low_nums_limit"],
    );
    for (mode, case) in modes {
        let m = &case["metrics"];
        let f = |k: &str, d: usize| fixed(m, k, d);
        let signed = |k: &str, unit: &str| signed(m, k, unit);
        md += &format!(
            "| {mode} | {} | {} | {} | {} / {} | {} | {}% | {} | {} | {} / {} |\n",
            f("makespan_s", 2),
            f("mean_completion_s", 2),
            signed("mean_completion_vs_exclusive_percent", "%"),
            f("median_completion_s", 2),
            f("p95_completion_s", 2),
            f("mean_queue_s", 2),
            f("mean_gpu_utilisation_percent", 1),
            signed("utilisation_vs_exclusive_points", " pt"),
            f("gpus_used", 0),
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
    fn arrivals_are_seeded_increasing_and_fixed_work() {
        let p = E2Parameters::new(false, 3);
        let jobs = p.jobs();
        assert_eq!(jobs.len(), 12);
        assert_eq!(jobs[0].arrival_s, 0.0);
        assert!(jobs.windows(2).all(|w| w[1].arrival_s >= w[0].arrival_s));
        assert_eq!(jobs, E2Parameters::new(false, 3).jobs());
        assert_ne!(jobs, E2Parameters::new(false, 4).jobs());
        assert!(
            jobs.iter().all(|j| !j.high),
            "E2's jobs are all low priority"
        );
        assert!(jobs[1].args.join(" ").contains("--iterations 1200"));
        assert!(jobs[1].args.join(" ").contains("--seed 4"));
        let quick = E2Parameters::new(true, 3).jobs();
        assert!(quick[0].args.join(" ").contains("--iterations 60"));
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

    #[test]
    fn each_mode_configures_the_arbiter_it_names() {
        use PlacementPolicy::{Balanced, Wang};
        use SchedulingPolicy::{Off, Priority};
        let table = [
            (E2Mode::Exclusive, None),
            (E2Mode::Uncontrolled, Some((Off, Balanced, false))),
            (E2Mode::Wang, Some((Priority, Wang, false))),
            (E2Mode::Balanced, Some((Priority, Balanced, false))),
            (E2Mode::Batch, Some((Priority, Balanced, true))),
        ];
        for (mode, expected) in table {
            let got = mode.arbiter().map(|a| (a.scheduling, a.placement, a.batch));
            assert_eq!(got, expected, "{}", mode.name());
        }
        let cluster = E2Parameters::new(false, 1).cluster();
        let mut config = Config::default();
        arbiter_config(&mut config, &cluster, E2Mode::Batch.arbiter().unwrap());
        assert_eq!(
            (config.arbiter.gpu_util_limit, config.arbiter.low_nums_limit),
            (0.8, 4)
        );
        let toml = config.to_toml().unwrap();
        assert!(
            toml.contains("policy = \"balanced\"") && toml.contains("batch = true"),
            "{toml}"
        );
    }

    #[test]
    fn schedule_metrics_by_priority_and_without_a_priority() {
        let entry = |priority: &str, gpu: &str, queue: f64, completion: f64, reserve: Value| {
            json!({"priority": priority, "gpu": gpu, "queue_s": queue,
                   "completion_s": completion, "reserve_ms": reserve})
        };
        let schedule = [
            entry("high", "GPU-0", 0.0, 6.0, json!(1.0)),
            entry("high", "GPU-1", 1.0, 8.0, json!(3.0)),
            entry("low", "GPU-0", 2.0, 10.0, json!(2.0)),
            entry("low", "GPU-0", 4.0, 20.0, json!(2.0)),
        ];
        let m = schedule_metrics(&schedule);
        let f = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k} in {m:?}"));
        assert_eq!(f("mean_completion_s"), 11.0);
        assert_eq!(f("median_completion_s"), 9.0);
        assert_eq!(f("p95_completion_s"), 20.0);
        assert_eq!(f("mean_queue_s"), 1.75);
        assert_eq!(f("high_mean_completion_s"), 7.0);
        assert_eq!(f("high_p95_completion_s"), 8.0);
        assert_eq!(f("high_mean_queue_s"), 0.5);
        assert_eq!(f("low_mean_completion_s"), 15.0);
        assert_eq!(f("low_mean_queue_s"), 3.0);
        assert_eq!(f("mean_reserve_ms"), 2.0);
        assert_eq!(f("max_reserve_ms"), 3.0);
        assert_eq!(f("gpus_used"), 2.0);
        // Exclusive GPUs: no reserve; all low: no high keys, so every value stays finite.
        let lows = [entry("low", "GPU-0", 0.0, 5.0, Value::Null)];
        let m = schedule_metrics(&lows);
        assert!(!m.contains_key("high_mean_completion_s"), "{m:?}");
        assert!(!m.contains_key("mean_reserve_ms"), "{m:?}");
        assert!(m.values().all(|v| v.as_f64().is_some_and(f64::is_finite)));
    }

    #[test]
    fn comparison_with_exclusive_in_percent_and_points() {
        let case = |jct: f64, util: f64| json!({"metrics": {"mean_completion_s": jct, "mean_gpu_utilisation_percent": util}});
        let mut by_mode = serde_json::Map::new();
        by_mode.insert("exclusive".into(), case(20.0, 50.0));
        by_mode.insert("balanced".into(), case(15.0, 68.0));
        compare_with_exclusive(&mut by_mode);
        let m = &by_mode["balanced"]["metrics"];
        assert_eq!(m["mean_completion_vs_exclusive_percent"], -25.0);
        assert_eq!(m["utilisation_vs_exclusive_points"], 18.0);
        assert_eq!(
            by_mode["exclusive"]["metrics"]["mean_completion_vs_exclusive_percent"],
            0.0
        );
        let mut alone = serde_json::Map::new();
        alone.insert("balanced".into(), case(15.0, 68.0));
        compare_with_exclusive(&mut alone);
        assert!(alone["balanced"]["metrics"]
            .get("utilisation_vs_exclusive_points")
            .is_none());
    }

    #[test]
    fn the_placement_the_arbiter_logged_and_a_warning_when_it_is_not_the_mode_s() {
        let log = "2026-11-24T09:00:00.1Z  INFO gpushare_arbiter::state::demand: placement \
                   policy=Balanced batch=false window_ms=5000\n\
                   2026-11-24T09:00:00.2Z  INFO gpushare_arbiter: lease table recovered";
        assert_eq!(placement_logged(log), Some(("balanced".into(), false)));
        assert_eq!(placement_logged("INFO lease table recovered"), None);
        let mut modes = serde_json::Map::new();
        modes.insert("exclusive".into(), json!({"placement": null}));
        modes.insert(
            "balanced".into(),
            json!({"placement": {"as_configured": true, "logged": {"policy": "balanced", "batch": false}}}),
        );
        assert_eq!(placement_warning(&modes), "");
        modes.insert(
            "wang".into(),
            json!({"placement": {"as_configured": false, "logged": {"policy": "balanced", "batch": false}}}),
        );
        let warning = placement_warning(&modes);
        assert!(
            warning.contains("`wang` ran `balanced` (batch false)")
                && !warning.contains("exclusive"),
            "{warning}"
        );
        assert_eq!(policy_name(PlacementPolicy::Wang), "wang");
    }
}
