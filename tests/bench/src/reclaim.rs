//! Memory reclaim on the simulated GPU (`[memory] reclaim = true`): how long a reclaim takes
//! against the bytes it moves, and a bursty high-priority inference job beside low-priority
//! training jobs, with a static partition of the GPU against over-committed low quotas.
//!
//! Latency: per size and number of low-priority leases holding it, a private arbiter on a
//! 24 GiB simulated GPU (no driver reserve, no context memory). The high-priority process
//! first fills the GPU but for [`MARGIN`] (the [`filler_bytes`]), then allocates the size:
//! the shortfall is the size less the margin, which only every low lease together covers.
//! It frees everything, the low leases are restored, and again, [`LatencyParameters::
//! repetitions`] times. Per repetition: the arbiter's own report of the reclaim (lock,
//! checkpoint, total, bound), the high process's `cuMemAlloc` as it saw it (probe `stamp`s
//! around it), and the restore: from the high process's free to each low process's next CUDA
//! call returning (the slowest low; the low waits for the free by polling a file every 5 ms,
//! so a restore faster than that reads as up to 5 ms), and to the arbiter's status listing
//! nothing suspended (polled every [`STATUS_POLL`]).
//!
//! Scenario: see [`ScenarioParameters`]. Every figure is simulated: the checkpoint copy is
//! simgpu's model (`SIMGPU_CHECKPOINT_GBPS`, default 25 GB/s, an estimate), not a device's.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::{ControlClient, Lease, Priority, ReclaimReport, StatusReport};
use gpushare_testkit::simgpu::SimMachine;
use gpushare_testkit::Arbiter;
use serde_json::{json, Value};

use crate::experiment::{self, finish_within, ExperimentError, Job};
use crate::liars::{probe_output, unix_us_now};
use crate::plot::{self, Figure, Panel};
use crate::setup::{self, Binaries};

/// Where the files go, under `--out`.
pub const RESULTS_SUBDIR: &str = "reclaim";
pub const JSON_FILE: &str = "reclaim.json";
pub const MARKDOWN_FILE: &str = "reclaim.md";
pub const LATENCY_CHART: &str = "reclaim-latency.svg";
pub const SCENARIO_CHART: &str = "reclaim-scenario.svg";

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The latency benchmark's GPU: room for the largest size twice over.
pub const LATENCY_GPU: &str = "24Gi";
/// What the high process leaves free beside its allocation: less than half the smallest
/// size, so that every low lease is needed.
pub const MARGIN: u64 = 64 * MIB;
/// A low lease's quota above what its process allocates.
const LOW_QUOTA_SLACK: u64 = 64 * MIB;
/// How often the arbiter's status is read while waiting for the low leases to come back.
pub const STATUS_POLL: Duration = Duration::from_millis(2);
/// Far beyond any reclaim or restore here (seconds, not a measurement bound): a step that
/// takes longer is a hang.
const STEP_LIMIT: Duration = Duration::from_secs(60);

/// The sizes measured: 256 MiB to 8 GiB.
pub const SIZES: [u64; 6] = [256 * MIB, 512 * MIB, GIB, 2 * GIB, 4 * GIB, 8 * GIB];

#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyParameters {
    pub gpu_memory: String,
    pub sizes_bytes: Vec<u64>,
    /// One series per count of low-priority leases that hold the size (in equal parts).
    pub victims: Vec<usize>,
    pub repetitions: usize,
    pub margin_bytes: u64,
}

impl LatencyParameters {
    pub fn new(quick: bool) -> LatencyParameters {
        LatencyParameters {
            gpu_memory: LATENCY_GPU.into(),
            sizes_bytes: if quick {
                vec![SIZES[0], SIZES[2]]
            } else {
                SIZES.to_vec()
            },
            victims: if quick { vec![2] } else { vec![1, 2] },
            repetitions: if quick { 3 } else { 20 },
            margin_bytes: MARGIN,
        }
    }
}

/// The scenario: on one simulated 16 GiB GPU, a high-priority inference job (Poisson
/// requests, each allocating a uniform 2–6 GiB, running its kernels, freeing it) beside two
/// low-priority training jobs (steady kernels, one steady allocation). `static`: reclaim
/// off, the quotas add up to the GPU, so each low job gets half of what the high job's peak
/// quota leaves. `reclaim`: reclaim on, `low_overcommit` [`Self::low_overcommit`], each low
/// job's quota [`Self::overcommitted_low_quota`]: the quotas together over-commit the GPU.
/// The same seeds in both.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScenarioParameters {
    pub gpu_memory: String,
    pub context_memory: String,
    pub duration_s: f64,
    pub seed: u64,
    pub high_quota_bytes: u64,
    pub requests_per_s: f64,
    pub request_memory: String,
    pub request_kernels: u32,
    pub request_kernel: String,
    pub lows: usize,
    pub low_kernels: u32,
    pub low_kernel: String,
    /// A low job allocates its quota less this (its context, and room to spare).
    pub low_quota_headroom_bytes: u64,
    pub static_low_quota_bytes: u64,
    pub overcommitted_low_quota: u64,
    pub low_overcommit: f64,
    pub memory_sample_ms: u64,
}

impl ScenarioParameters {
    pub fn new(quick: bool, seed: u64, duration_s: Option<f64>) -> ScenarioParameters {
        let gpu = 16 * GIB;
        let high_quota_bytes = 6 * GIB + 256 * MIB;
        let lows = 2;
        ScenarioParameters {
            gpu_memory: setup::GPU_MEMORY.into(),
            context_memory: "64Mi".into(),
            duration_s: duration_s.unwrap_or(if quick { 2.0 } else { 20.0 }),
            seed,
            high_quota_bytes,
            requests_per_s: 2.0,
            request_memory: "2Gi:6Gi".into(),
            request_kernels: 25,
            request_kernel: "lognormal:2ms:0.3".into(),
            lows,
            low_kernels: 10,
            low_kernel: "fixed:1ms".into(),
            low_quota_headroom_bytes: 256 * MIB,
            static_low_quota_bytes: static_low_quota(gpu, high_quota_bytes, lows),
            overcommitted_low_quota: 6 * GIB,
            low_overcommit: 1.5,
            memory_sample_ms: 100,
        }
    }

    fn duration_arg(&self) -> String {
        format!("{}ms", (self.duration_s * 1e3).round() as u64)
    }

    fn high_job(&self) -> Job {
        let args = flags(&[
            ("--requests-per-s", self.requests_per_s.to_string()),
            ("--request-memory", self.request_memory.clone()),
            ("--kernels", self.request_kernels.to_string()),
            ("--kernel", self.request_kernel.clone()),
            ("--sync", "event".into()),
            ("--seed", self.seed.to_string()),
            ("--duration", self.duration_arg()),
        ]);
        job("high", Priority::High, args)
    }

    fn low_job(&self, index: usize, quota: u64) -> Job {
        let memory = quota.saturating_sub(self.low_quota_headroom_bytes);
        let args = flags(&[
            ("--memory", memory.to_string()),
            ("--kernels", self.low_kernels.to_string()),
            ("--kernel", self.low_kernel.clone()),
            ("--sync", "event".into()),
            ("--pipeline", "2".into()),
            ("--seed", (self.seed + 1 + index as u64).to_string()),
            ("--duration", self.duration_arg()),
        ]);
        job(&format!("low-{index}"), Priority::Low, args)
    }
}

/// `simgpu-workload`'s command line from `(flag, value)` pairs.
fn flags(pairs: &[(&str, String)]) -> Vec<String> {
    pairs
        .iter()
        .flat_map(|(flag, value)| [flag.to_string(), value.clone()])
        .collect()
}

/// A job of the scenario: no compute request, the whole GPU as its limit.
fn job(name: &str, priority: Priority, args: Vec<String>) -> Job {
    Job {
        name: name.into(),
        priority,
        compute_request: 0.0,
        compute_limit: 1.0,
        args,
    }
}

/// A static partition: each of `lows` low jobs gets an equal part of what the high job's
/// quota leaves of the GPU, in whole MiB.
pub fn static_low_quota(gpu: u64, high_quota: u64, lows: usize) -> u64 {
    gpu.saturating_sub(high_quota) / lows.max(1) as u64 / MIB * MIB
}

/// What the high process allocates before the measured allocation, so that the GPU's
/// ledger is `margin` short of full beside the low leases' `size`: the measured allocation
/// of `size` is then `size - margin` over, which every low lease together must free.
pub fn filler_bytes(allocatable: u64, size: u64, margin: u64) -> Option<u64> {
    allocatable.checked_sub(size)?.checked_sub(margin)
}

/// The `p`-th percentile of `samples` (the nearest sample: with 20, p99 is the largest);
/// NaN for none.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    gpushare_testkit::stats::percentile(&sorted, p)
}

/// `{n, p50, p99, max}` of `samples`.
pub fn summary(samples: &[f64]) -> Value {
    json!({
        "n": samples.len(),
        "p50": percentile(samples, 50.0),
        "p99": percentile(samples, 99.0),
        "max": percentile(samples, 100.0),
    })
}

/// The `unix_us` of every `stamp` line of a probe's output, in order.
pub fn stamps_us(stdout: &str) -> Vec<u128> {
    stdout
        .lines()
        .filter(|l| l.split_whitespace().next() == Some("stamp"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("unix_us="))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

fn ms_between(from_us: u128, to_us: u128) -> f64 {
    (to_us as f64 - from_us as f64) / 1e3
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> ExperimentError {
    move |source| ExperimentError::Io { what, source }
}

fn status(arbiter: &Arbiter) -> Result<StatusReport, String> {
    ControlClient::connect(&arbiter.control_socket(), Duration::from_secs(5))
        .and_then(|mut c| c.status())
        .map_err(|e| format!("reading the arbiter's status: {e}"))
}

/// Waits for `path` to exist, at most [`STEP_LIMIT`].
fn wait_for_file(path: &Path) -> Result<(), String> {
    let began = Instant::now();
    while !path.exists() {
        if began.elapsed() > STEP_LIMIT {
            return Err(format!("{} never appeared", path.display()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// A private arbiter with memory reclaim on, on `machine`, its checkpoint API the simulated
/// driver's.
fn reclaim_arbiter(
    dir: &Path,
    machine: &SimMachine,
    env: &[(String, String)],
    libs: &Path,
    edit: impl FnOnce(&mut gpushare_testkit::config::Config),
) -> Result<Arbiter, ExperimentError> {
    std::fs::create_dir_all(&machine.state_dir)
        .map_err(io(format!("creating {}", machine.state_dir.display())))?;
    let cuda_library = libs.join("libcuda.so.1").display().to_string();
    Ok(setup::start(
        setup::arbiter_on(dir, machine, env).configure(|c| {
            c.arbiter.gpu_util_limit = 1.0;
            c.arbiter.low_nums_limit = 8;
            c.memory.cuda_library = cuda_library;
            edit(c);
        }),
    )?)
}

fn probe(
    binaries: &Binaries,
    env: &[(String, String)],
    arbiter: &Arbiter,
    lease: &Lease,
    steps: &[String],
) -> Result<Child, String> {
    let mut command = Command::new(binaries.program("gpushare-cuda-probe"));
    command.args(steps);
    experiment::under_interposer(&mut command, binaries, env, arbiter, lease)
        .spawn()
        .map_err(|e| format!("starting gpushare-cuda-probe: {e}"))
}

fn steps(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// One measured repetition.
#[derive(Debug, Clone, serde::Serialize)]
struct Repetition {
    reclaim: ReclaimReport,
    high_alloc_ms: f64,
    /// From the high process's free to the slowest low process's next CUDA call returning.
    restore_ms: f64,
    /// From the high process's free to the status listing nothing suspended.
    restore_status_ms: f64,
}

/// One series: `size` held by `victims` low leases, reclaimed `repetitions` times.
fn latency_series(
    binaries: &Binaries,
    libs: &Path,
    p: &LatencyParameters,
    size: u64,
    victims: usize,
) -> Result<Value, ExperimentError> {
    let series = format!("reclaim of {size} bytes from {victims} lease(s)");
    let failed = |why: String| ExperimentError::Job {
        job: series.clone(),
        mode: "reclaim".into(),
        why,
    };
    let dir = tempfile::Builder::new()
        .prefix("gsb-reclaim-")
        .tempdir_in("/tmp")
        .map_err(io("a private directory".into()))?;
    let machine = SimMachine::new(dir.path().join("simgpu"), 1, &p.gpu_memory)
        .set("SIMGPU_RESERVED_MEMORY", 0)
        .set("SIMGPU_CONTEXT_MEMORY", 0)
        .set("SIMGPU_MODULE_MEMORY", 0);
    let env = experiment::simgpu_env(&machine, libs);
    let arbiter = reclaim_arbiter(dir.path(), &machine, &env, libs, |c| {
        c.memory.reclaim = true;
        // The mechanism's restore time: no hold-down before it (the scenario keeps the
        // default, a policy for bursty jobs).
        c.memory.restore_delay_ms = 0;
        // The simulated processes have no context memory: nothing to estimate.
        c.arbiter.context_memory_estimate = gpushare_proto::ByteSize(0);
    })?;
    let part = size / victims as u64;
    let lows: Vec<Lease> = (0..victims)
        .map(|k| {
            setup::reserve_with_memory(
                &arbiter,
                &format!("low-{k}"),
                Priority::Low,
                (0.0, 1.0),
                part + LOW_QUOTA_SLACK,
            )
        })
        .collect::<Result<_, _>>()?;
    let allocatable = status(&arbiter)
        .map_err(failed)?
        .gpus
        .first()
        .map(|g| g.memory_allocatable)
        .ok_or_else(|| failed("the arbiter lists no GPU".into()))?;
    let filler = filler_bytes(allocatable, size, p.margin_bytes).ok_or_else(|| {
        failed(format!(
            "{allocatable} allocatable bytes hold no {size} bytes twice over"
        ))
    })?;
    let high =
        setup::reserve_with_memory(&arbiter, "high", Priority::High, (0.0, 1.0), allocatable)?;
    let file = |name: String| dir.path().join(name).display().to_string();
    let mut low_children = Vec::new();
    for (k, lease) in lows.iter().enumerate() {
        let mut s = steps(&[
            "alloc",
            &part.to_string(),
            "touch",
            &file(format!("ready-{k}")),
        ]);
        for i in 0..p.repetitions {
            s.extend(steps(&[
                "wait",
                &file(format!("freed-{i}")),
                "sync",
                "stamp",
            ]));
        }
        low_children.push(probe(binaries, &env, &arbiter, lease, &s).map_err(&failed)?);
    }
    for k in 0..victims {
        wait_for_file(Path::new(&file(format!("ready-{k}")))).map_err(&failed)?;
    }
    let mut s = Vec::new();
    for i in 0..p.repetitions {
        s.extend(steps(&[
            "wait",
            &file(format!("go-{i}")),
            "alloc",
            &filler.to_string(),
            "stamp",
            "alloc",
            &size.to_string(),
            "stamp",
            "free-all",
            "stamp",
            "touch",
            &file(format!("freed-{i}")),
        ]));
    }
    let high_child = probe(binaries, &env, &arbiter, &high, &s).map_err(&failed)?;
    let mut reports = Vec::new();
    let mut restored_seen_us = Vec::new();
    for i in 0..p.repetitions {
        std::fs::write(file(format!("go-{i}")), b"").map_err(io(format!("go-{i}")))?;
        wait_for_file(Path::new(&file(format!("freed-{i}"))))
            .map_err(|e| failed(format!("{e}\narbiter log:\n{}", setup::log_tail(&arbiter))))?;
        let began = Instant::now();
        let report = loop {
            let s = status(&arbiter).map_err(&failed)?;
            let r = s.reclaim.unwrap_or_default();
            if r.reclaims as usize > i
                && r.suspended.is_empty()
                && r.restores as usize >= victims * (i + 1)
            {
                break r;
            }
            if began.elapsed() > STEP_LIMIT {
                return Err(failed(format!(
                    "repetition {i}: the low leases did not come back ({r:?})\narbiter log:\n{}",
                    setup::log_tail(&arbiter)
                )));
            }
            std::thread::sleep(STATUS_POLL);
        };
        restored_seen_us.push(unix_us_now());
        let last = report
            .recent
            .last()
            .cloned()
            .ok_or_else(|| failed(format!("repetition {i}: no reclaim listed")))?;
        if report.reclaims as usize != i + 1 || !last.succeeded || last.victims.len() != victims {
            return Err(failed(format!(
                "repetition {i}: expected one more successful reclaim of {victims} lease(s), the status lists {} (last {last:?})",
                report.reclaims
            )));
        }
        reports.push(last);
    }
    let high_out = finish_within(high_child, STEP_LIMIT, probe_output).map_err(&failed)?;
    let high_stamps = stamps_us(&high_out);
    let mut low_stamps = Vec::new();
    for child in low_children {
        low_stamps.push(stamps_us(
            &finish_within(child, STEP_LIMIT, probe_output).map_err(&failed)?,
        ));
    }
    if high_stamps.len() != 3 * p.repetitions || low_stamps.iter().any(|s| s.len() != p.repetitions)
    {
        return Err(failed(format!(
            "stamps: high {}, lows {:?}; expected {} and {} each",
            high_stamps.len(),
            low_stamps.iter().map(Vec::len).collect::<Vec<_>>(),
            3 * p.repetitions,
            p.repetitions
        )));
    }
    let repetitions: Vec<Repetition> = reports
        .into_iter()
        .enumerate()
        .map(|(i, reclaim)| {
            let (before, after, freed) = (
                high_stamps[3 * i],
                high_stamps[3 * i + 1],
                high_stamps[3 * i + 2],
            );
            let restored = low_stamps.iter().map(|s| s[i]).max().unwrap_or(freed);
            Repetition {
                reclaim,
                high_alloc_ms: ms_between(before, after),
                restore_ms: ms_between(freed, restored),
                restore_status_ms: ms_between(freed, restored_seen_us[i]),
            }
        })
        .collect();
    Ok(series_figures(size, victims, &repetitions))
}

/// A series' figures from its repetitions (pure).
fn series_figures(size: u64, victims: usize, reps: &[Repetition]) -> Value {
    let of = |f: &dyn Fn(&Repetition) -> f64| reps.iter().map(f).collect::<Vec<f64>>();
    let total = of(&|r| r.reclaim.total_ms);
    let bound_ms = reps.iter().map(|r| r.reclaim.bound_ms).fold(0.0, f64::max);
    let p99 = percentile(&total, 99.0);
    json!({
        "bytes": size,
        "victims": victims,
        "repetitions": reps.len(),
        "moved_bytes": summary(&of(&|r| r.reclaim.bytes as f64)),
        "reclaim_ms": summary(&total),
        "lock_ms": summary(&of(&|r| r.reclaim.lock_ms)),
        "checkpoint_ms": summary(&of(&|r| r.reclaim.checkpoint_ms)),
        "high_alloc_ms": summary(&of(&|r| r.high_alloc_ms)),
        "restore_ms": summary(&of(&|r| r.restore_ms)),
        "restore_status_ms": summary(&of(&|r| r.restore_status_ms)),
        "bound_ms": bound_ms,
        "p99_within_bound": p99 <= bound_ms,
        "samples": reps,
    })
}

/// Every series of the latency benchmark.
pub fn run_latency(
    binaries: &Binaries,
    libs: &Path,
    p: &LatencyParameters,
) -> Result<Value, ExperimentError> {
    let mut series = Vec::new();
    for &victims in &p.victims {
        for &size in &p.sizes_bytes {
            eprintln!(
                "gpushare-bench: reclaim of {} MiB from {victims} low lease(s), {} times (simulated)",
                size / MIB,
                p.repetitions
            );
            series.push(latency_series(binaries, libs, p, size, victims)?);
        }
    }
    Ok(json!({"parameters": p, "series": series}))
}

/// GPU memory in use on the simulated device, sampled every `every` until stopped.
struct MemorySampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<Vec<u64>, String>>,
}

impl MemorySampler {
    fn start(env: &[(String, String)], every: Duration) -> MemorySampler {
        let env = env.to_vec();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            let config = simgpu_model::SimConfig::from_lookup(lookup).map_err(|e| e.to_string())?;
            let device = simgpu_model::Device::open(&config).map_err(|e| e.to_string())?;
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let mut locked = device.lock().map_err(|e| e.to_string())?;
                samples.push(locked.snapshot(0).map_err(|e| e.to_string())?.memory_used);
                drop(locked);
                std::thread::sleep(every);
            }
            Ok(samples)
        });
        MemorySampler { stop, thread }
    }

    fn finish(self) -> Result<Vec<u64>, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the memory sampler panicked".to_string())?
    }
}

/// One configuration of the scenario: `reclaim` on (over-committed low quotas) or off (a
/// static partition).
fn scenario_case(
    binaries: &Binaries,
    libs: &Path,
    p: &ScenarioParameters,
    reclaim: bool,
) -> Result<Value, ExperimentError> {
    let mode = if reclaim { "reclaim" } else { "static" };
    let failed = |job: &str, why: String| ExperimentError::Job {
        job: job.into(),
        mode: mode.into(),
        why,
    };
    let dir = tempfile::Builder::new()
        .prefix("gsb-reclaim-")
        .tempdir_in("/tmp")
        .map_err(io("a private directory".into()))?;
    let machine = setup::sim_machine(dir.path(), 1, 1_000, 25)
        .set("SIMGPU_RESERVED_MEMORY", 0)
        .set("SIMGPU_CONTEXT_MEMORY", &p.context_memory);
    let env = experiment::simgpu_env(&machine, libs);
    let scheduler = experiment::Mode::Gpushare.scheduler(&[])?;
    let overcommit = p.low_overcommit;
    let context_memory: gpushare_proto::ByteSize = p.context_memory.parse().map_err(|e| {
        failed(
            "configuration",
            format!("context memory {}: {e}", p.context_memory),
        )
    })?;
    let arbiter = reclaim_arbiter(dir.path(), &machine, &env, libs, |c| {
        setup::single_gpu_config(c, scheduler);
        c.memory.reclaim = reclaim;
        // What each simulated process's context takes, charged from its start.
        c.arbiter.context_memory_estimate = context_memory;
        if reclaim {
            c.memory.low_overcommit = overcommit;
        }
    })?;
    let low_quota = if reclaim {
        p.overcommitted_low_quota
    } else {
        p.static_low_quota_bytes
    };
    let barrier = dir.path().join("go");
    // The low leases first: the high lease's quota is what they leave unguaranteed.
    let mut jobs: Vec<(Job, u64)> = (0..p.lows)
        .map(|i| (p.low_job(i, low_quota), low_quota))
        .collect();
    jobs.push((p.high_job(), p.high_quota_bytes));
    let mut children = Vec::new();
    for (job, quota) in &jobs {
        let lease =
            setup::reserve_with_memory(&arbiter, &job.name, job.priority, (0.0, 1.0), *quota)?;
        let child = experiment::spawn_job(binaries, &env, &arbiter, &lease, job, &barrier)?;
        children.push((job.name.clone(), child));
    }
    std::thread::sleep(experiment::SETTLE);
    let sampler = MemorySampler::start(&env, Duration::from_millis(p.memory_sample_ms));
    std::fs::write(&barrier, b"").map_err(io("opening the start barrier".into()))?;
    let limit = Duration::from_secs_f64(p.duration_s) + STEP_LIMIT;
    let mut reports = serde_json::Map::new();
    for (name, child) in children {
        let report = experiment::collect_within(child, limit).map_err(|why| {
            failed(
                &name,
                format!("{why}\narbiter log:\n{}", setup::log_tail(&arbiter)),
            )
        })?;
        reports.insert(name, report);
    }
    let samples = sampler.finish().map_err(|e| failed("memory sampler", e))?;
    let status = status(&arbiter).map_err(|e| failed("status", e))?;
    let r = status.reclaim.map(|r| *r).unwrap_or_default();
    Ok(scenario_figures(
        p, reclaim, low_quota, &reports, &samples, &r,
    ))
}

/// A configuration's figures (pure): the high job's failed request allocations (all below
/// its quota: the largest request fits it) and latency, the low jobs' throughput, the GPU
/// memory in use, the reclaims.
fn scenario_figures(
    p: &ScenarioParameters,
    reclaim: bool,
    low_quota: u64,
    reports: &serde_json::Map<String, Value>,
    memory_samples: &[u64],
    r: &gpushare_proto::ReclaimStatus,
) -> Value {
    let high = &reports["high"];
    let lows: serde_json::Map<String, Value> = reports
        .iter()
        .filter(|(name, _)| name.starts_with("low"))
        .map(|(name, report)| {
            (
                name.clone(),
                json!({
                    "iterations_per_s": report["throughput_iters_per_s"],
                    "iterations": report["iterations"],
                    "allocated_bytes": report["allocations"]["requested_bytes"],
                }),
            )
        })
        .collect();
    let gib = |b: f64| b / GIB as f64;
    let mean = memory_samples.iter().sum::<u64>() as f64 / memory_samples.len().max(1) as f64;
    let peak = memory_samples.iter().copied().max().unwrap_or(0) as f64;
    json!({
        "reclaim": reclaim,
        "low_quota_bytes": low_quota,
        "high_quota_bytes": p.high_quota_bytes,
        "quotas_over_gpu": (low_quota * p.lows as u64 + p.high_quota_bytes) as f64 / (16 * GIB) as f64,
        "high": {
            "requests": high["requests"],
            "oom_below_quota": high["request_memory"]["failed"],
            "last_error": high["request_memory"]["last_error"],
            "latency_ms": high["request_latency_ms"],
            "alloc_ms": high["request_memory"]["alloc_latency_ms"],
        },
        "lows": lows,
        "memory_used_gib": {"mean": gib(mean), "peak": gib(peak), "samples": memory_samples.len()},
        "reclaims": r.reclaims,
        "reclaims_failed": r.reclaims_failed,
        "restores": r.restores,
        "reclaimed_bytes": r.reclaimed_bytes,
        "still_suspended": r.suspended.len(),
        // The arbiter keeps the last 16: which leases, how many bytes, how long.
        "recent_reclaims": r.recent,
        "jobs": reports,
    })
}

/// Both configurations of the scenario, the same seeds.
pub fn run_scenario(
    binaries: &Binaries,
    libs: &Path,
    p: &ScenarioParameters,
) -> Result<Value, ExperimentError> {
    let mut cases = serde_json::Map::new();
    for reclaim in [false, true] {
        let mode = if reclaim { "reclaim" } else { "static" };
        eprintln!(
            "gpushare-bench: reclaim scenario, {mode} ({} s, simulated)",
            p.duration_s
        );
        cases.insert(mode.into(), scenario_case(binaries, libs, p, reclaim)?);
    }
    Ok(json!({"parameters": p, "configurations": cases}))
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The Markdown of a results document (`reclaim.json`).
pub fn markdown(results: &Value) -> String {
    let mut md = String::from(
        "# Memory reclaim (simulated)\n\nEvery figure is simulated: the checkpoint copy is simgpu's model \
         (`SIMGPU_CHECKPOINT_GBPS`, 25 GB/s by default, an estimate), not a device's.\n\n",
    );
    md += &format!(
        "Command: `{}`\n\n",
        results["command"].as_str().unwrap_or("")
    );
    if let Some(series) = results["latency"]["series"].as_array() {
        md += "## Reclaim latency against bytes\n\nA high-priority allocation that needs all the memory \
                of one or two low-priority leases; each size reclaimed and restored repeatedly. \
                Times in ms: the arbiter's (reclaim = lock + checkpoint of every victim), the high \
                process's `cuMemAlloc`, the restore (the high's free to the slowest low's next CUDA \
                call returning; the low notices the free within 5 ms; `memory.restore_delay_ms = 0` \
                here, so it is the mechanism's time alone).\n\n\
                | bytes | leases | n | reclaim p50 | reclaim p99 | lock p50 / p99 | checkpoint p50 / p99 | high alloc p50 / p99 | restore p50 / p99 | bound | p99 ≤ bound |\n\
                |---|---|---|---|---|---|---|---|---|---|---|\n";
        for s in series {
            let pair = |k: &str| format!("{:.1} / {:.1}", num(&s[k]["p50"]), num(&s[k]["p99"]));
            md += &format!(
                "| {} MiB | {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {:.0} | {} |\n",
                s["bytes"].as_u64().unwrap_or(0) / MIB,
                s["victims"],
                s["repetitions"],
                num(&s["reclaim_ms"]["p50"]),
                num(&s["reclaim_ms"]["p99"]),
                pair("lock_ms"),
                pair("checkpoint_ms"),
                pair("high_alloc_ms"),
                pair("restore_ms"),
                num(&s["bound_ms"]),
                if s["p99_within_bound"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "**no**"
                },
            );
        }
        md += &format!("\n![reclaim latency]({LATENCY_CHART})\n\n");
    }
    if let Some(cases) = results["scenario"]["configurations"].as_object() {
        let p = &results["scenario"]["parameters"];
        md += &format!(
            "## Bursty inference beside training: static partition against reclaim\n\n\
             One simulated {} GPU; the high-priority job serves Poisson requests ({}/s), each \
             allocating {} bytes (uniform), running {} kernels ({}), freeing it; {} low-priority \
             training jobs ({} × {} kernels per iteration) hold one allocation each (their quota less {} MiB). \
             `static`: reclaim off, quotas add up to the GPU. `reclaim`: reclaim on, \
             `low_overcommit = {}`, the other `[memory]` keys their defaults (suspended leases \
             stay off the GPU for `restore_delay_ms`, 2 s, after its last reclaim). {} s per \
             configuration, the same seeds.\n\n",
            p["gpu_memory"].as_str().unwrap_or(""),
            p["requests_per_s"],
            p["request_memory"].as_str().unwrap_or(""),
            p["request_kernels"],
            p["request_kernel"].as_str().unwrap_or(""),
            p["lows"],
            p["low_kernels"],
            p["low_kernel"].as_str().unwrap_or(""),
            p["low_quota_headroom_bytes"].as_u64().unwrap_or(0) / MIB,
            p["low_overcommit"],
            p["duration_s"],
        );
        let names: Vec<&String> = cases.keys().collect();
        md += &format!(
            "| | {} |\n|---|{}\n",
            names
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(" | "),
            "---|".repeat(names.len())
        );
        let row = |label: &str, f: &dyn Fn(&Value) -> String| {
            format!(
                "| {label} | {} |\n",
                names
                    .iter()
                    .map(|n| f(&cases[n.as_str()]))
                    .collect::<Vec<_>>()
                    .join(" | ")
            )
        };
        md += &row("low quota each (GiB)", &|c| {
            format!("{:.2}", num(&c["low_quota_bytes"]) / GIB as f64)
        });
        md += &row("quotas ÷ GPU", &|c| {
            format!("{:.2}", num(&c["quotas_over_gpu"]))
        });
        md += &row("high requests", &|c| c["high"]["requests"].to_string());
        md += &row("high OOM below quota", &|c| {
            c["high"]["oom_below_quota"].to_string()
        });
        md += &row("high latency p50 / p99 (ms)", &|c| {
            format!(
                "{:.1} / {:.1}",
                num(&c["high"]["latency_ms"]["p50"]),
                num(&c["high"]["latency_ms"]["p99"])
            )
        });
        md += &row("high cuMemAlloc p50 / p99 (ms)", &|c| {
            format!(
                "{:.1} / {:.1}",
                num(&c["high"]["alloc_ms"]["p50"]),
                num(&c["high"]["alloc_ms"]["p99"])
            )
        });
        for low in &low_names(cases) {
            md += &row(&format!("{low} iterations/s"), &|c| {
                format!("{:.1}", num(&c["lows"][low]["iterations_per_s"]))
            });
        }
        md += &row("GPU memory in use, mean / peak (GiB)", &|c| {
            format!(
                "{:.2} / {:.2}",
                num(&c["memory_used_gib"]["mean"]),
                num(&c["memory_used_gib"]["peak"])
            )
        });
        md += &row("reclaims (failed) / restores", &|c| {
            format!(
                "{} ({}) / {}",
                c["reclaims"], c["reclaims_failed"], c["restores"]
            )
        });
        md += &format!("\n![reclaim scenario]({SCENARIO_CHART})\n");
    }
    md
}

/// The latency chart: reclaim p50 and p99 per series and the bound, against bytes (log–log);
/// below, the high process's allocation and the restore, p99.
pub fn latency_chart(latency: &Value) -> Result<Option<String>, String> {
    let Some(series) = latency["series"].as_array().filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    let mut victims: Vec<u64> = series
        .iter()
        .filter_map(|s| s["victims"].as_u64())
        .collect();
    victims.dedup();
    let line = |v: u64, key: &str, stat: &str| -> Vec<(f64, f64)> {
        series
            .iter()
            .filter(|s| s["victims"].as_u64() == Some(v))
            .map(|s| (size_axis(num(&s["bytes"])), num(&s[key][stat])))
            .collect()
    };
    let mut top = Vec::new();
    let mut bottom = Vec::new();
    for &v in &victims {
        for (upper, label, key, stat) in [
            (true, "reclaim p50", "reclaim_ms", "p50"),
            (true, "reclaim p99", "reclaim_ms", "p99"),
            (false, "high cuMemAlloc p99", "high_alloc_ms", "p99"),
            (false, "restore p99", "restore_ms", "p99"),
        ] {
            let panel = if upper { &mut top } else { &mut bottom };
            panel.push((format!("{label}, {v} lease(s)"), line(v, key, stat)));
        }
    }
    let bound: Vec<(f64, f64)> = series
        .iter()
        .filter(|s| s["victims"].as_u64() == victims.first().copied())
        .map(|s| (size_axis(num(&s["bytes"])), num(&s["bound_ms"])))
        .collect();
    top.push(("bound".into(), bound));
    let panels = [
        ("Reclaim time against bytes (simulated)", top),
        ("High allocation and restore (simulated)", bottom),
    ];
    render_lines(&panels).map(Some)
}

/// Bytes on the charts' x axis: log2 of MiB, so that each size the benchmark measures
/// (a power of two) falls on a labelled tick.
fn size_axis(bytes: f64) -> f64 {
    (bytes / MIB as f64).log2()
}

/// The label of a tick of [`size_axis`]: the size where it is a whole power of two, else none.
fn size_label(x: f64) -> String {
    if (x - x.round()).abs() > 1e-6 || x < 0.0 {
        return String::new();
    }
    let mib = 1u64 << x.round() as u32;
    if mib >= 1024 {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

type Lines = Vec<(String, Vec<(f64, f64)>)>;

fn render_lines(panels: &[(&str, Lines)]) -> Result<String, String> {
    use plotters::prelude::*;
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (900, 420 * panels.len() as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        for ((title, lines), area) in panels.iter().zip(root.split_evenly((panels.len(), 1))) {
            let points = lines.iter().flat_map(|(_, l)| l.iter());
            let (x_lo, x_hi, y_hi) = points
                .fold((f64::MAX, f64::MIN, 0f64), |(a, b, c), &(x, y)| {
                    (a.min(x), b.max(x), if y.is_finite() { c.max(y) } else { c })
                });
            let y_lo = lines
                .iter()
                .flat_map(|(_, l)| l.iter().map(|p| p.1))
                .filter(|y| *y > 0.0)
                .fold(f64::MAX, f64::min)
                .min(1.0);
            let mut chart = ChartBuilder::on(&area)
                .caption(*title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(35)
                .y_label_area_size(60)
                .build_cartesian_2d(x_lo - 0.3..x_hi + 0.3, (y_lo * 0.5..y_hi * 3.0).log_scale())
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc("bytes reclaimed (log)")
                .x_labels(((x_hi - x_lo).round() as usize + 1) * 2)
                .x_label_formatter(&|x| size_label(*x))
                .y_desc("ms (log)")
                .draw()
                .map_err(|e| e.to_string())?;
            for (i, (name, line)) in lines.iter().enumerate() {
                let colour = Palette99::pick(i).to_rgba();
                let style = ShapeStyle::from(colour).stroke_width(2);
                let line: Vec<(f64, f64)> = line.iter().copied().filter(|p| p.1 > 0.0).collect();
                chart
                    .draw_series(std::iter::once(PathElement::new(line.clone(), style)))
                    .map_err(|e| e.to_string())?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
                chart
                    .draw_series(line.iter().map(|&p| Circle::new(p, 3, style.filled())))
                    .map_err(|e| e.to_string())?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The low jobs' names, as the first configuration lists them.
fn low_names(cases: &serde_json::Map<String, Value>) -> Vec<String> {
    cases
        .values()
        .next()
        .and_then(|c| c["lows"].as_object())
        .map(|l| l.keys().cloned().collect())
        .unwrap_or_default()
}

/// The scenario's chart: the two configurations side by side (bars).
pub fn scenario_figure(scenario: &Value) -> Option<Figure> {
    let cases = scenario["configurations"].as_object()?;
    let bars = |f: &dyn Fn(&Value) -> f64| -> Vec<(String, f64)> {
        cases.iter().map(|(mode, c)| (mode.clone(), f(c))).collect()
    };
    let lows = low_names(cases);
    let panels = vec![
        Panel {
            title: "High-priority request latency (simulated)".into(),
            y_label: "ms".into(),
            groups: vec![
                (
                    "p50".into(),
                    bars(&|c| num(&c["high"]["latency_ms"]["p50"])),
                ),
                (
                    "p99".into(),
                    bars(&|c| num(&c["high"]["latency_ms"]["p99"])),
                ),
            ],
        },
        Panel {
            title: "Low-priority throughput (simulated)".into(),
            y_label: "iterations/s".into(),
            groups: lows
                .iter()
                .map(|low| {
                    (
                        low.clone(),
                        bars(&|c| num(&c["lows"][low]["iterations_per_s"])),
                    )
                })
                .collect(),
        },
        Panel {
            title: "GPU memory in use (simulated)".into(),
            y_label: "GiB".into(),
            groups: vec![
                ("mean".into(), bars(&|c| num(&c["memory_used_gib"]["mean"]))),
                ("peak".into(), bars(&|c| num(&c["memory_used_gib"]["peak"]))),
            ],
        },
    ];
    Some(Figure {
        name: "reclaim-scenario".into(),
        panels,
    })
}

/// Writes `reclaim.json`, `reclaim.md` and the charts into `dir`.
pub fn write(dir: &Path, results: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let text = serde_json::to_string_pretty(results).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(JSON_FILE), text + "\n")?;
    write_rendered(dir, results)
}

/// Writes `reclaim.md` and the charts of `results` into `dir` (the JSON stays as it is).
pub fn write_rendered(dir: &Path, results: &Value) -> std::io::Result<()> {
    std::fs::write(dir.join(MARKDOWN_FILE), markdown(results))?;
    if let Some(svg) = latency_chart(&results["latency"]).map_err(std::io::Error::other)? {
        std::fs::write(dir.join(LATENCY_CHART), svg)?;
    }
    if let Some(fig) = scenario_figure(&results["scenario"]) {
        let svg = plot::render_svg(&fig).map_err(std::io::Error::other)?;
        std::fs::write(dir.join(fig.file_name()), svg)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filler_leaves_the_margin_and_the_shortfall_needs_every_lease() {
        let a = 24 * GIB;
        for (size, victims) in [(256 * MIB, 2u64), (GIB, 2), (8 * GIB, 2), (8 * GIB, 1)] {
            let filler = filler_bytes(a, size, MARGIN).unwrap();
            // The lows' size, the filler, then the size again: the GPU is over by this.
            let shortfall = size + filler + size - a;
            assert_eq!(shortfall, size - MARGIN);
            assert!(shortfall > size - size / victims, "{size} {victims}");
            assert!(filler + size <= a, "it fits once the lows are off the GPU");
        }
        assert_eq!(filler_bytes(GIB, GIB, MARGIN), None);
    }

    #[test]
    fn percentiles_of_unsorted_samples_and_of_none() {
        let twenty: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&twenty, 50.0), 11.0);
        assert_eq!(percentile(&twenty, 99.0), 20.0);
        assert_eq!(percentile(&[3.0], 50.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn stamps_in_order_and_nothing_else() {
        let out = "alloc CUDA_SUCCESS bytes=5\nstamp CUDA_SUCCESS unix_us=10\nsync CUDA_SUCCESS\nstamp CUDA_SUCCESS unix_us=25\n";
        assert_eq!(stamps_us(out), [10, 25]);
        assert!(stamps_us("wait CUDA_SUCCESS\n").is_empty());
    }

    #[test]
    fn a_static_partition_adds_up_to_the_gpu() {
        let p = ScenarioParameters::new(false, 1, None);
        assert!(p.static_low_quota_bytes * 2 + p.high_quota_bytes <= 16 * GIB);
        assert_eq!(static_low_quota(16 * GIB, 6 * GIB, 2), 5 * GIB);
        assert!(
            p.overcommitted_low_quota * 2 + p.high_quota_bytes > 16 * GIB,
            "reclaim's quotas over-commit the GPU"
        );
        let high = p.high_job().args.join(" ");
        assert!(high.contains("--request-memory 2Gi:6Gi"), "{high}");
        let low = p.low_job(1, 4 * GIB).args.join(" ");
        assert!(
            low.contains(&format!("--memory {}", 4 * GIB - 256 * MIB)),
            "{low}"
        );
        assert!(low.contains("--seed 3"), "{low}");
    }

    fn rep(total: f64, bound: f64) -> Repetition {
        Repetition {
            reclaim: ReclaimReport {
                total_ms: total,
                bound_ms: bound,
                bytes: GIB,
                ..ReclaimReport::default()
            },
            high_alloc_ms: total + 1.0,
            restore_ms: 2.0,
            restore_status_ms: 3.0,
        }
    }

    #[test]
    fn a_series_is_within_its_bound_only_when_its_p99_is() {
        let within: Vec<Repetition> = (0..20).map(|i| rep(100.0 + i as f64, 250.0)).collect();
        let figures = series_figures(GIB, 2, &within);
        assert_eq!(figures["p99_within_bound"], true);
        assert_eq!(figures["reclaim_ms"]["p99"], 119.0);
        assert_eq!(figures["high_alloc_ms"]["p50"], 111.0);
        let mut over = within.clone();
        over[7] = rep(251.0, 250.0);
        assert_eq!(series_figures(GIB, 2, &over)["p99_within_bound"], false);
    }

    #[test]
    fn the_size_axis_labels_powers_of_two() {
        assert_eq!(size_label(size_axis((256 * MIB) as f64)), "256 MiB");
        assert_eq!(size_label(size_axis((8 * GIB) as f64)), "8 GiB");
        assert_eq!(size_label(8.5), "");
    }

    #[test]
    fn the_markdown_and_charts_come_from_the_json() {
        let reps: Vec<Repetition> = (0..3).map(|i| rep(100.0 + i as f64, 250.0)).collect();
        let results = json!({
            "command": "gpushare-bench --scenario reclaim",
            "latency": {"series": [series_figures(GIB, 2, &reps), series_figures(2 * GIB, 2, &reps)]},
        });
        let md = markdown(&results);
        assert!(md.contains("| 1024 MiB | 2 | 3 | 101.0 | 102.0 |"), "{md}");
        let svg = latency_chart(&results["latency"]).unwrap().unwrap();
        assert!(svg.contains("<svg") && svg.contains("bound"), "{svg}");
        assert!(latency_chart(&json!({})).unwrap().is_none());
        assert!(scenario_figure(&json!({})).is_none());
    }
}
