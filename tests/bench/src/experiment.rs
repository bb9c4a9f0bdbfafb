//! The compute-isolation experiments: which jobs run together, under which arbiter policy, and
//! how one case is run (a fresh simulated GPU and a fresh arbiter each, so no case inherits
//! another's state).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_proto::{ControlClient, Lease, LeaseId, Priority, ViolationKind};
use gpushare_testkit::config::{SchedulerConfig, SchedulingPolicy};
use gpushare_testkit::simgpu::SimMachine;
use gpushare_testkit::Arbiter;
use serde_json::Value;

use crate::setup::{self, Binaries, SetupError};

#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("{0}")]
    Usage(String),
    #[error("{job} ({mode}) failed: {why}")]
    Job {
        job: String,
        mode: String,
        why: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// How the GPU is shared in a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The high-priority job with nobody else (the baseline).
    Alone,
    /// `policy = "off"`: nothing but the device's own time slicing.
    Uncontrolled,
    /// `policy = "round-robin"` with a fixed slice: the baseline scheduler, no priorities.
    RoundRobin { slice_ms: u64 },
    /// `policy = "priority"`: gpushare's token scheduler.
    Gpushare,
    /// gpushare with duration-aware admission switched off
    /// (`admit_by_duration = false`): the scheduler as it was before, for comparison.
    GpushareBefore,
    /// `policy = "off"` and a TGS-style AIMD limiter on the low jobs (see `crate::tgs`).
    Tgs,
}

impl Mode {
    pub fn name(self) -> String {
        match self {
            Mode::Alone => "alone".into(),
            Mode::Uncontrolled => "uncontrolled".into(),
            Mode::RoundRobin { slice_ms } => format!("round-robin-{slice_ms}ms"),
            Mode::Gpushare => "gpushare".into(),
            Mode::GpushareBefore => "gpushare-before".into(),
            Mode::Tgs => "tgs".into(),
        }
    }

    /// The arbiter's `[scheduler]` policy and slice for this mode.
    pub fn policy(self) -> (SchedulingPolicy, Option<u64>) {
        match self {
            // The high job alone is measured under gpushare's own default.
            Mode::Alone => (SchedulingPolicy::Priority, None),
            Mode::Uncontrolled => (SchedulingPolicy::Off, None),
            Mode::RoundRobin { slice_ms } => (SchedulingPolicy::RoundRobin, Some(slice_ms)),
            Mode::Gpushare | Mode::GpushareBefore => (SchedulingPolicy::Priority, None),
            Mode::Tgs => (SchedulingPolicy::Off, None),
        }
    }

    /// The arbiter's `[scheduler]` table for this mode: its policy, then for both gpushare
    /// modes the `--gpushare-set` lines, and for `gpushare-before` the switch that turns
    /// duration-aware admission off (over any `--gpushare-set` of that key).
    pub fn scheduler(self, gpushare_settings: &[String]) -> Result<SchedulerConfig, SetupError> {
        let (policy, slice_ms) = self.policy();
        let mut scheduler = setup::scheduler_config(policy, slice_ms);
        match self {
            Mode::Gpushare => setup::apply_settings(&mut scheduler, gpushare_settings)?,
            Mode::GpushareBefore => {
                setup::apply_settings(&mut scheduler, gpushare_settings)?;
                scheduler.admit_by_duration = false;
            }
            _ => {}
        }
        Ok(scheduler)
    }

    /// `alone`, `uncontrolled`, `round-robin` (one mode per slice), `gpushare`,
    /// `gpushare-before`, `tgs`.
    pub fn parse_list(text: &str, slices_ms: &[u64]) -> Result<Vec<Mode>, String> {
        let mut modes = Vec::new();
        for name in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "alone" => modes.push(Mode::Alone),
                "uncontrolled" => modes.push(Mode::Uncontrolled),
                "round-robin" => modes.extend(
                    slices_ms
                        .iter()
                        .map(|&slice_ms| Mode::RoundRobin { slice_ms }),
                ),
                "gpushare" => modes.push(Mode::Gpushare),
                "gpushare-before" => modes.push(Mode::GpushareBefore),
                "tgs" => modes.push(Mode::Tgs),
                other => {
                    return Err(format!(
                        "--modes: unknown mode {other:?}; accepted: alone, uncontrolled, round-robin, gpushare, gpushare-before, tgs"
                    ))
                }
            }
        }
        Ok(modes)
    }
}

/// What the low job of one case of the kernels scenario launches per iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowKernels {
    /// Plain launches of kernels of this many µs (about 2 ms of them per iteration).
    Plain { kernel_us: u64 },
    /// One `cuGraphLaunch` of a graph of `kernels` kernels of `kernel_us` µs each, captured
    /// once at start.
    Graph { kernels: u32, kernel_us: u64 },
}

impl LowKernels {
    /// What one launch keeps the GPU busy for, in µs: a kernel, or a whole graph.
    pub fn launch_us(self) -> u64 {
        match self {
            LowKernels::Plain { kernel_us } => kernel_us,
            LowKernels::Graph { kernels, kernel_us } => kernels as u64 * kernel_us,
        }
    }

    /// The case's key in the results (`scenarios.kernels.low_kernel_us`): the launch length
    /// in µs, with `-graph` for a graph (`"100"`, `"50000-graph"`).
    pub fn key(self) -> String {
        match self {
            LowKernels::Plain { kernel_us } => kernel_us.to_string(),
            LowKernels::Graph { .. } => format!("{}-graph", self.launch_us()),
        }
    }

    /// What the results say about the case (`scenarios.kernels.lows[key]`).
    pub fn describe(self) -> serde_json::Value {
        match self {
            LowKernels::Plain { kernel_us } => serde_json::json!({
                "launch_us": kernel_us, "kernel_us": kernel_us, "graph": false,
                "label": format!("{} ms kernels", kernel_us as f64 / 1e3),
            }),
            LowKernels::Graph { kernels, kernel_us } => serde_json::json!({
                "launch_us": self.launch_us(), "kernel_us": kernel_us, "graph": true,
                "graph_kernels": kernels,
                "label": format!(
                    "{} ms graphs ({kernels} × {} ms)",
                    self.launch_us() as f64 / 1e3,
                    kernel_us as f64 / 1e3
                ),
            }),
        }
    }
}

/// One workload process: its lease terms and its `simgpu-workload` arguments.
#[derive(Debug, Clone)]
pub struct Job {
    pub name: String,
    pub priority: Priority,
    pub compute_request: f64,
    pub compute_limit: f64,
    pub args: Vec<String>,
}

/// Everything the experiments are parameterised by; written into the results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Parameters {
    pub duration_s: f64,
    pub seed: u64,
    pub high_kernels_per_iteration: u32,
    pub high_kernel: String,
    pub high_gap_us: u64,
    pub low_kernel_us: u64,
    pub low_kernels_per_iteration: u32,
    pub low_pipeline: u32,
    pub low_job_counts: Vec<usize>,
    pub round_robin_slices_ms: Vec<u64>,
    pub simgpu_slice_us: u64,
    pub simgpu_switch_us: u64,
    /// Extra `key = value` lines of the gpushare mode's `[scheduler]` table (none: the
    /// arbiter's defaults, which is what ships).
    pub gpushare_settings: Vec<String>,
}

impl Parameters {
    pub fn new(
        duration_s: f64,
        seed: u64,
        slices_ms: Vec<u64>,
        gpushare_settings: Vec<String>,
    ) -> Self {
        Parameters {
            duration_s,
            seed,
            high_kernels_per_iteration: 50,
            high_kernel: "lognormal:100us:0.3".into(),
            // 50 kernels of ~105 µs mean are ~5.2 ms of GPU time: a 3.3 ms CPU gap keeps the
            // job ~60 % busy alone, like a training step with data loading between bursts.
            high_gap_us: 3_300,
            low_kernel_us: 100,
            low_kernels_per_iteration: 10,
            low_pipeline: 2,
            low_job_counts: vec![1, 2, 3],
            round_robin_slices_ms: slices_ms,
            simgpu_slice_us: 1_000,
            simgpu_switch_us: 25,
            gpushare_settings,
        }
    }

    fn duration_arg(&self) -> String {
        format!("{}ms", (self.duration_s * 1e3).round() as u64)
    }

    /// The high-priority training-like job.
    pub fn high_job(&self) -> Job {
        Job {
            name: "high".into(),
            priority: Priority::High,
            compute_request: 0.0,
            compute_limit: 1.0,
            args: [
                "--kernels",
                &self.high_kernels_per_iteration.to_string(),
                "--kernel",
                &self.high_kernel,
                "--gap",
                &format!("{}us", self.high_gap_us),
                "--sync",
                "event",
                "--report-start",
                "--seed",
                &self.seed.to_string(),
                "--duration",
                &self.duration_arg(),
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    /// A saturating low-priority job whose kernels last `kernel_us` (the kernel-length sweep):
    /// about 2 ms of kernels per iteration, at least one, two iterations queued.
    pub fn low_job_with_kernels_of(&self, kernel_us: u64) -> Job {
        let mut sweep = self.clone();
        sweep.low_kernel_us = kernel_us;
        sweep.low_kernels_per_iteration = (2_000 / kernel_us.max(1)).max(1) as u32;
        let mut job = sweep.low_job(0, 0.0, 1.0);
        job.name = format!("low-{kernel_us}us");
        job
    }

    /// A saturating low-priority job of the kernel-length sweep, plain kernels or graphs
    /// ([`Self::low_job_with_kernels_of`]; a graph job launches one graph per iteration).
    pub fn low_job_for(&self, low: LowKernels) -> Job {
        match low {
            LowKernels::Plain { kernel_us } => self.low_job_with_kernels_of(kernel_us),
            LowKernels::Graph { kernels, kernel_us } => {
                let mut sweep = self.clone();
                sweep.low_kernel_us = kernel_us;
                sweep.low_kernels_per_iteration = kernels;
                let mut job = sweep.low_job(0, 0.0, 1.0);
                job.args.insert(0, "--graph".into());
                job.name = format!("low-graph-{}us", low.launch_us());
                job
            }
        }
    }

    /// A saturating low-priority job (no gap, two iterations queued).
    pub fn low_job(&self, index: usize, compute_request: f64, compute_limit: f64) -> Job {
        Job {
            name: format!("low-{index}"),
            priority: Priority::Low,
            compute_request,
            compute_limit,
            args: [
                "--kernels",
                &self.low_kernels_per_iteration.to_string(),
                "--kernel",
                &format!("fixed:{}us", self.low_kernel_us),
                "--sync",
                "event",
                "--pipeline",
                &self.low_pipeline.to_string(),
                "--seed",
                &(self.seed + 1 + index as u64).to_string(),
                "--duration",
                &self.duration_arg(),
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}

/// How long the jobs get to load the driver and attach before the barrier opens.
pub const SETTLE: Duration = Duration::from_millis(400);

/// A case's fresh simulated GPU and fresh arbiter, in a private directory.
pub struct CaseMachine {
    /// Declared first: stopped before its directory goes.
    pub arbiter: Arbiter,
    /// The environment of every process on the simulated GPU ([`simgpu_env`]).
    pub simgpu_env: Vec<(String, String)>,
    pub dir: tempfile::TempDir,
}

impl CaseMachine {
    /// One simulated GPU of the parameters' slicing, and an arbiter on it in `mode`.
    pub fn start(
        libs: &Path,
        parameters: &Parameters,
        mode: Mode,
    ) -> Result<CaseMachine, ExperimentError> {
        let dir = tempfile::Builder::new()
            .prefix("gsb-")
            .tempdir_in("/tmp")
            .map_err(|source| ExperimentError::Io {
                what: "a private directory".into(),
                source,
            })?;
        let machine = setup::sim_machine(
            dir.path(),
            1,
            parameters.simgpu_slice_us,
            parameters.simgpu_switch_us,
        );
        let simgpu_env = simgpu_env(&machine, libs);
        let scheduler = mode.scheduler(&parameters.gpushare_settings)?;
        let arbiter = setup::start(
            setup::arbiter_on(dir.path(), &machine, &simgpu_env)
                .configure(|c| setup::single_gpu_config(c, scheduler)),
        )?;
        Ok(CaseMachine {
            arbiter,
            simgpu_env,
            dir,
        })
    }
}

/// Runs `jobs` together on a fresh simulated GPU under a fresh arbiter in `mode`; returns each
/// job's report, in order.
pub fn run_case(
    binaries: &Binaries,
    libs: &Path,
    parameters: &Parameters,
    mode: Mode,
    jobs: &[Job],
) -> Result<Vec<Value>, ExperimentError> {
    let CaseMachine {
        arbiter,
        simgpu_env,
        dir,
    } = CaseMachine::start(libs, parameters, mode)?;
    let barrier = dir.path().join("go");
    let mut children: Vec<(String, Child)> = Vec::new();
    let mut leases = Vec::new();
    let mut tgs_pids = (None, Vec::new());
    for job in jobs {
        let lease = setup::reserve(
            &arbiter,
            &job.name,
            job.priority,
            job.compute_request,
            job.compute_limit,
        )?;
        let child = spawn_job(binaries, &simgpu_env, &arbiter, &lease, job, &barrier)?;
        leases.push(lease.id.clone());
        match job.priority {
            Priority::High => tgs_pids.0 = Some(child.id()),
            Priority::Low => tgs_pids.1.push(child.id()),
        }
        children.push((job.name.clone(), child));
    }
    std::thread::sleep(SETTLE);
    std::fs::write(&barrier, b"").map_err(|source| ExperimentError::Io {
        what: "opening the start barrier".into(),
        source,
    })?;
    // TGS throttles low jobs against a high one: without one it has nothing to do.
    let tgs = match (mode, tgs_pids) {
        (Mode::Tgs, (Some(high), lows)) => Some(
            crate::tgs::Controller::start(&simgpu_env, high, lows, Default::default())
                .map_err(|e| ExperimentError::Usage(e.to_string()))?,
        ),
        _ => None,
    };
    let mut reports = Vec::new();
    let mut first_error = None;
    // Every job runs for the case's duration; a minute more is far beyond any drain.
    let limit = Duration::from_secs_f64(parameters.duration_s) + Duration::from_secs(60);
    for (name, child) in children {
        match collect_within(child, limit) {
            Ok(report) => reports.push(report),
            Err(why) => {
                first_error.get_or_insert(ExperimentError::Job {
                    job: name,
                    mode: mode.name(),
                    why: format!("{why}\narbiter log:\n{}", setup::log_tail(&arbiter)),
                });
            }
        }
    }
    let tgs = tgs.map(crate::tgs::Controller::finish);
    match first_error {
        Some(e) => Err(e),
        None => {
            // What the TGS controller did rides with the high job's report.
            let high = jobs.iter().position(|j| j.priority == Priority::High);
            if let (Some(tgs), Some(high)) = (tgs, high.and_then(|i| reports.get_mut(i))) {
                high["tgs"] = tgs;
            }
            record_violations(&arbiter, &leases, &mut reports);
            Ok(reports)
        }
    }
}

/// Adds to each job's report the violations the arbiter listed for its lease at the
/// case's end (`{"overrun": n, "ungated": n}`; the list keeps the last watchdog window, about
/// 6 s): an honest job is never reported.
fn record_violations(arbiter: &Arbiter, leases: &[LeaseId], reports: &mut [Value]) {
    let Ok(status) = ControlClient::connect(&arbiter.control_socket(), Duration::from_secs(5))
        .and_then(|mut c| c.status())
    else {
        return;
    };
    for (lease, report) in leases.iter().zip(reports.iter_mut()) {
        let count = |kind: ViolationKind| {
            status
                .violations
                .iter()
                .filter(|v| v.kind == kind && v.lease.as_ref() == Some(lease))
                .count()
        };
        report["violations"] = serde_json::json!({
            "overrun": count(ViolationKind::Overrun),
            "ungated": count(ViolationKind::Ungated),
        });
    }
}

/// The environment of every process on `machine` (the workloads, the arbiter, the TGS
/// controller's device): its `SIMGPU_*` variables, and its libraries in `libs` on
/// `LD_LIBRARY_PATH`.
pub fn simgpu_env(machine: &SimMachine, libs: &Path) -> Vec<(String, String)> {
    let mut env = machine.env().to_vec();
    env.push(("LD_LIBRARY_PATH".to_string(), libs.display().to_string()));
    env
}

/// Starts `job` under the interposer on `lease`; it waits for `barrier` to exist before its
/// first iteration. Its JSON report comes on stdout ([`collect`]).
pub fn spawn_job(
    binaries: &Binaries,
    simgpu_env: &[(String, String)],
    arbiter: &Arbiter,
    lease: &Lease,
    job: &Job,
    barrier: &Path,
) -> Result<Child, ExperimentError> {
    spawn_job_under(&[], binaries, simgpu_env, arbiter, lease, job, barrier)
}

/// [`spawn_job`], run by `wrapper` (a program and its arguments, e.g. `unshare …`, which runs
/// the rest of its command line as its own child); none: the workload itself.
pub fn spawn_job_under(
    wrapper: &[&str],
    binaries: &Binaries,
    simgpu_env: &[(String, String)],
    arbiter: &Arbiter,
    lease: &Lease,
    job: &Job,
    barrier: &Path,
) -> Result<Child, ExperimentError> {
    let workload = binaries.program("simgpu-workload");
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(workload);
            command
        }
        None => Command::new(workload),
    };
    command.args(&job.args).arg("--start-barrier").arg(barrier);
    under_interposer(&mut command, binaries, simgpu_env, arbiter, lease)
        .spawn()
        .map_err(|source| ExperimentError::Io {
            what: format!("starting simgpu-workload for {}", job.name),
            source,
        })
}

/// `command` as a process of `lease`'s container: on the simulated machine, under the
/// interposer, talking to the lease's socket, its output piped.
pub fn under_interposer<'c>(
    command: &'c mut Command,
    binaries: &Binaries,
    simgpu_env: &[(String, String)],
    arbiter: &Arbiter,
    lease: &Lease,
) -> &'c mut Command {
    command
        .envs(simgpu_env.iter().map(|(k, v)| (k, v)))
        .env("LD_PRELOAD", &binaries.preload)
        .env("GPUSHARE_LEASE", &lease.id.0)
        .env("GPUSHARE_SOCKET", setup::lease_socket(arbiter, lease))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// A finished workload's JSON report, or why there is none.
/// [`collect`], but a job still running after `limit` is killed and reported as such: a
/// wedged job (a scheduler bug, a lost token) fails its case instead of hanging the run.
pub fn collect_within(child: Child, limit: Duration) -> Result<Value, String> {
    finish_within(child, limit, collect)
}

/// `finish(child)` (which waits for it), but a child still running after `limit` is killed
/// and reported as such.
pub fn finish_within<T: Send + 'static>(
    child: Child,
    limit: Duration,
    finish: impl FnOnce(Child) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let pid = child.id();
    let (sender, receiver) = std::sync::mpsc::channel();
    let collector = std::thread::spawn(move || sender.send(finish(child)));
    let outcome = receiver.recv_timeout(limit);
    if outcome.is_err() {
        // SAFETY: kill(2) on our child, not reaped yet (the collector is still waiting for
        // it), so the pid is still its own.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
    let _ = collector.join();
    outcome.unwrap_or_else(|_| Err(format!("did not finish within {limit:?} (killed)")))
}

pub fn collect(child: Child) -> Result<Value, String> {
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "no JSON report ({e}): {}\nstderr: {stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    if !out.status.success() {
        return Err(format!("exit {}: {report}\nstderr: {stderr}", out.status));
    }
    if report["errors"].as_object().is_some_and(|e| !e.is_empty()) {
        return Err(format!("driver errors: {}", report["errors"]));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_map_to_scheduler_policies() {
        let modes = Mode::parse_list("alone, uncontrolled,round-robin,gpushare", &[1, 10]).unwrap();
        let names: Vec<String> = modes.iter().map(|m| m.name()).collect();
        assert_eq!(
            names,
            [
                "alone",
                "uncontrolled",
                "round-robin-1ms",
                "round-robin-10ms",
                "gpushare"
            ]
        );
        assert_eq!(Mode::Uncontrolled.policy(), (SchedulingPolicy::Off, None));
        assert_eq!(
            Mode::RoundRobin { slice_ms: 10 }.policy(),
            (SchedulingPolicy::RoundRobin, Some(10))
        );
        assert_eq!(Mode::Gpushare.policy(), (SchedulingPolicy::Priority, None));
        let before = Mode::parse_list("gpushare-before", &[1]).unwrap();
        assert_eq!(before, [Mode::GpushareBefore]);
        assert_eq!(before[0].name(), "gpushare-before");
        assert_eq!(before[0].policy(), (SchedulingPolicy::Priority, None));
        let err = Mode::parse_list("alone,fifo", &[1]).unwrap_err();
        assert!(
            err.contains("\"fifo\"") && err.contains("accepted"),
            "{err}"
        );
    }

    #[test]
    fn gpushare_modes_get_the_settings_and_before_switches_admission_off() {
        let set = vec![
            "idle_us = 100".to_string(),
            "admit_by_duration = true".to_string(),
        ];
        let defaults = SchedulerConfig::default();
        let gpushare = Mode::Gpushare.scheduler(&set).unwrap();
        assert_eq!((gpushare.idle_us, gpushare.admit_by_duration), (100, true));
        let before = Mode::GpushareBefore.scheduler(&set).unwrap();
        assert_eq!((before.idle_us, before.admit_by_duration), (100, false));
        let before = Mode::GpushareBefore.scheduler(&[]).unwrap();
        assert_eq!(
            before,
            SchedulerConfig {
                admit_by_duration: false,
                ..defaults.clone()
            }
        );
        for mode in [
            Mode::Alone,
            Mode::Uncontrolled,
            Mode::Tgs,
            Mode::RoundRobin { slice_ms: 1 },
        ] {
            let (policy, slice_ms) = mode.policy();
            assert_eq!(
                mode.scheduler(&set).unwrap(),
                setup::scheduler_config(policy, slice_ms),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn sweep_lows_plain_and_graph() {
        let p = Parameters::new(1.0, 1, vec![1], Vec::new());
        let plain = LowKernels::Plain { kernel_us: 1_000 };
        let graph = LowKernels::Graph {
            kernels: 10,
            kernel_us: 5_000,
        };
        assert_eq!(
            (plain.key(), plain.launch_us()),
            ("1000".to_string(), 1_000)
        );
        assert_eq!(
            (graph.key(), graph.launch_us()),
            ("50000-graph".to_string(), 50_000)
        );
        let job = p.low_job_for(plain).args.join(" ");
        assert!(
            job.contains("--kernels 2 --kernel fixed:1000us") && !job.contains("--graph"),
            "{job}"
        );
        let job = p.low_job_for(graph);
        assert_eq!(job.name, "low-graph-50000us");
        let args = job.args.join(" ");
        assert!(
            args.starts_with(
                "--graph --kernels 10 --kernel fixed:5000us --sync event --pipeline 2"
            ),
            "{args}"
        );
        assert_eq!(graph.describe()["label"], "50 ms graphs (10 × 5 ms)");
        assert_eq!(plain.describe()["label"], "1 ms kernels");
    }

    #[test]
    fn jobs_carry_the_seed_and_duration() {
        let p = Parameters::new(1.5, 7, vec![1], Vec::new());
        let high = p.high_job().args.join(" ");
        assert!(
            high.contains("--seed 7") && high.contains("--duration 1500ms"),
            "{high}"
        );
        assert!(
            high.contains("--report-start") && high.contains("--gap 3300us"),
            "{high}"
        );
        let low = p.low_job(1, 0.3, 1.0);
        assert!(low.args.join(" ").contains("--seed 9"));
        assert_eq!((low.compute_request, low.priority), (0.3, Priority::Low));
    }
}
