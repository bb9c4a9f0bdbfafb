//! The liars scenario: the priority scenario's high job beside one low-priority job that lies
//! to the interposer's admission, once per way of lying, under gpushare with the shipped
//! scheduler defaults. Per variant: the low job's GPU time while the high job was active (the
//! device's busy time over the high job's run, less the high job's own kernels), the high
//! job's iteration slowdown against alone, the `overrun`, `ungated` and `shifted_clock`
//! violations the arbiter listed for the low lease, and how long after the first lie the first one was listed (the control socket's
//! status, polled every [`STATUS_POLL`]). Every figure is simulated.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpushare_proto::{ControlClient, Lease, LeaseId, Priority, StatusReport, ViolationKind};
use gpushare_testkit::Arbiter;
use serde_json::{json, Value};

use crate::experiment::{
    self, finish_within, run_case, spawn_job, spawn_job_under, under_interposer, CaseMachine,
    ExperimentError, Mode, Parameters,
};
use crate::metrics;
use crate::setup::{self, Binaries};

/// Where the scenario's files go, under `--out`.
pub const RESULTS_SUBDIR: &str = "liars";
pub const JSON_FILE: &str = "liars.json";
pub const MARKDOWN_FILE: &str = "liars.md";

/// How often the arbiter's status is read for the low lease's violations.
pub const STATUS_POLL: Duration = Duration::from_millis(20);

/// A long kernel, as the lying variants launch them (what the interposer cannot split).
const LONG_KERNEL_MS: u64 = 200;

pub use gpushare_testkit::clock::{shifted_clock_unavailable, SHIFTED_CLOCK};

/// How the low job behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The priority scenario's saturating low job.
    Honest,
    /// The same job with its `CLOCK_MONOTONIC` ten minutes behind ([`SHIFTED_CLOCK`]): every
    /// window the arbiter wrote in the arbiter's clock would look ten minutes long to it.
    Clock,
    /// A new process per long kernel: each starts with no estimates, so its kernel is
    /// admitted blind.
    FreshProcesses,
    /// One gated launch takes the token, then long kernels go straight to the driver's own
    /// `cuLaunchKernel`, past the interposer.
    RawLaunches,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::Honest,
        Variant::Clock,
        Variant::FreshProcesses,
        Variant::RawLaunches,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Variant::Honest => "honest",
            Variant::Clock => "clock",
            Variant::FreshProcesses => "fresh-processes",
            Variant::RawLaunches => "raw-launches",
        }
    }

    fn describe(self) -> String {
        match self {
            Variant::Honest => "the priority scenario's saturating low job".into(),
            Variant::Clock => format!("the same job run under `{}`", SHIFTED_CLOCK.join(" ")),
            Variant::FreshProcesses => format!(
                "a new gpushare-cuda-probe process per {LONG_KERNEL_MS} ms kernel \
                 (`stamp kernel-ms {LONG_KERNEL_MS} sync`), one after another for the case"
            ),
            Variant::RawLaunches => format!(
                "one gpushare-cuda-probe: `launch 1`, then `raw-launch 1 {LONG_KERNEL_MS} sync` \
                 repeated for the case (kernels past the interposer)"
            ),
        }
    }
}

/// What the low job did, whatever its shape.
#[derive(Debug, Default)]
struct LowOutcome {
    /// The workload's report (honest, clock).
    report: Option<Value>,
    /// Processes the low lease started.
    processes: u32,
    /// Wall-clock µs of the first lie (its `stamp`), where the variant lies.
    first_lie_unix_us: Option<u128>,
}

/// Wall-clock µs now, comparable with the probe's `stamp`s.
pub fn unix_us_now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// The `unix_us` of the probe's first `stamp` line (`stamp CUDA_SUCCESS unix_us=…`).
pub fn first_stamp_us(stdout: &str) -> Option<u128> {
    crate::reclaim::stamps_us(stdout).first().copied()
}

/// The probe's steps that did not succeed (`<step> <result> …` lines whose result is not
/// `CUDA_SUCCESS`).
pub fn failed_steps(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| {
            let mut fields = l.split_whitespace();
            fields.next().is_some() && fields.next().is_some_and(|r| r != "CUDA_SUCCESS")
        })
        .map(str::to_owned)
        .collect()
}

/// The violations the arbiter lists for `lease` that a lie earns: `overrun` (the token
/// service's judgement of a drain or a window), `ungated` (the bypass check's, or the
/// watchdog's, measurement of GPU time beyond token time) and `shifted_clock` (a token
/// client in a time namespace of its own).
pub fn lies_listed(status: &StatusReport, lease: &LeaseId) -> usize {
    status
        .violations
        .iter()
        .filter(|v| {
            matches!(
                v.kind,
                ViolationKind::Overrun | ViolationKind::Ungated | ViolationKind::ShiftedClock
            )
        })
        .filter(|v| v.lease.as_ref() == Some(lease))
        .count()
}

/// The simulated GPU's total busy time (its executed operations), in ns.
fn device_busy_ns(simgpu_env: &[(String, String)]) -> Result<u64, String> {
    let lookup = |name: &str| {
        simgpu_env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let config = simgpu_model::SimConfig::from_lookup(lookup).map_err(|e| e.to_string())?;
    let device = simgpu_model::Device::open(&config).map_err(|e| e.to_string())?;
    let mut locked = device.lock().map_err(|e| e.to_string())?;
    Ok(locked.snapshot(0).map_err(|e| e.to_string())?.busy_ns)
}

/// A probe run to completion: its stdout, or why it failed.
pub fn probe_output(child: Child) -> Result<String, String> {
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let failed = failed_steps(&stdout);
    if !out.status.success() || !failed.is_empty() {
        return Err(format!(
            "probe exit {}, failed steps {failed:?}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(stdout)
}

/// What a case needs to start a process of the low lease.
struct LowLease<'a> {
    binaries: &'a Binaries,
    simgpu_env: &'a [(String, String)],
    arbiter: &'a Arbiter,
    lease: &'a Lease,
}

impl LowLease<'_> {
    fn probe(&self, steps: &[String]) -> Result<Child, String> {
        let mut command = Command::new(self.binaries.program("gpushare-cuda-probe"));
        command.args(steps);
        under_interposer(
            &mut command,
            self.binaries,
            self.simgpu_env,
            self.arbiter,
            self.lease,
        )
        .spawn()
        .map_err(|e| format!("starting gpushare-cuda-probe: {e}"))
    }
}

/// Runs one variant's case: the high job and the low job on a fresh simulated GPU under a
/// fresh arbiter (gpushare, shipped defaults but for `--gpushare-set`).
fn run_variant(
    binaries: &Binaries,
    libs: &Path,
    parameters: &Parameters,
    variant: Variant,
) -> Result<Value, ExperimentError> {
    let failed = |why: String| ExperimentError::Job {
        job: format!("low ({})", variant.name()),
        mode: Mode::Gpushare.name(),
        why,
    };
    // The shipped defaults (the bypass check included), unless --gpushare-set says otherwise.
    let scheduler = Mode::Gpushare.scheduler(&parameters.gpushare_settings)?;
    let graces = json!({
        "revoke_grace_ms": scheduler.revoke_grace_ms,
        "window_overrun_grace_ms": scheduler.window_overrun_grace_ms,
        "overrun_penalty_ms": scheduler.overrun_penalty_ms,
        "pause_bypassing": scheduler.pause_bypassing,
        "bypass_check": scheduler.bypass_check,
    });
    let CaseMachine {
        arbiter,
        simgpu_env,
        dir,
    } = CaseMachine::start(libs, parameters, Mode::Gpushare)?;
    let barrier = dir.path().join("go");
    let high_job = parameters.high_job();
    let high_lease = setup::reserve(&arbiter, "high", Priority::High, 0.0, 1.0)?;
    let low_lease = setup::reserve(&arbiter, "low", Priority::Low, 0.0, 1.0)?;
    let high = spawn_job(
        binaries,
        &simgpu_env,
        &arbiter,
        &high_lease,
        &high_job,
        &barrier,
    )?;
    let low_workload = match variant {
        Variant::Honest | Variant::Clock => {
            let wrapper: &[&str] = match variant {
                Variant::Clock => &SHIFTED_CLOCK,
                _ => &[],
            };
            let job = parameters.low_job(0, 0.0, 1.0);
            Some(spawn_job_under(
                wrapper,
                binaries,
                &simgpu_env,
                &arbiter,
                &low_lease,
                &job,
                &barrier,
            )?)
        }
        Variant::FreshProcesses | Variant::RawLaunches => None,
    };
    let low = LowLease {
        binaries,
        simgpu_env: &simgpu_env,
        arbiter: &arbiter,
        lease: &low_lease,
    };
    let duration = Duration::from_secs_f64(parameters.duration_s);
    let kernels_in_case = (duration.as_millis() as u64)
        .div_ceil(LONG_KERNEL_MS)
        .max(1);
    let raw_prober = match variant {
        Variant::RawLaunches => {
            let mut steps: Vec<String> = ["wait", barrier.to_str().unwrap_or_default()]
                .map(String::from)
                .to_vec();
            steps.extend(["launch", "1", "stamp"].map(String::from));
            for _ in 0..kernels_in_case {
                steps.extend(
                    ["raw-launch", "1", &LONG_KERNEL_MS.to_string(), "sync"].map(String::from),
                );
            }
            Some(low.probe(&steps).map_err(failed)?)
        }
        _ => None,
    };
    std::thread::sleep(experiment::SETTLE);
    let limit = duration + Duration::from_secs(60);
    let busy_before = device_busy_ns(&simgpu_env).map_err(failed)?;
    std::fs::write(&barrier, b"").map_err(|source| ExperimentError::Io {
        what: "opening the start barrier".into(),
        source,
    })?;
    let opened = Instant::now();
    let opened_unix_us = unix_us_now();
    let env_for_high = simgpu_env.clone();
    let high_thread = std::thread::spawn(move || {
        let report = experiment::collect_within(high, limit);
        let busy_after = device_busy_ns(&env_for_high);
        (report, busy_after, opened.elapsed())
    });
    let low_done = Arc::new(AtomicBool::new(false));
    let mut best_listed = 0usize;
    let mut first_report_unix_us = None;
    let mut client = ControlClient::connect(&arbiter.control_socket(), Duration::from_secs(5))
        .map_err(|e| failed(format!("connecting to the control socket: {e}")))?;
    let low_outcome = std::thread::scope(|scope| -> Result<LowOutcome, String> {
        let done = low_done.clone();
        let low = &low;
        let low_thread = scope.spawn(move || -> Result<LowOutcome, String> {
            let outcome = match (variant, low_workload, raw_prober) {
                (_, Some(workload), _) => Ok(LowOutcome {
                    report: Some(experiment::collect_within(workload, limit)?),
                    processes: 1,
                    first_lie_unix_us: (variant == Variant::Clock).then_some(opened_unix_us),
                }),
                (_, _, Some(prober)) => {
                    let stdout = finish_within(prober, limit + duration, probe_output)?;
                    Ok(LowOutcome {
                        first_lie_unix_us: first_stamp_us(&stdout),
                        processes: 1,
                        report: None,
                    })
                }
                _ => {
                    let mut outcome = LowOutcome::default();
                    let steps = ["stamp", "kernel-ms", &LONG_KERNEL_MS.to_string(), "sync"]
                        .map(String::from);
                    while opened.elapsed() < duration {
                        let stdout = finish_within(low.probe(&steps)?, limit, probe_output)?;
                        outcome.processes += 1;
                        outcome.first_lie_unix_us =
                            outcome.first_lie_unix_us.or(first_stamp_us(&stdout));
                    }
                    Ok(outcome)
                }
            };
            done.store(true, Ordering::SeqCst);
            outcome
        });
        while !(low_done.load(Ordering::SeqCst) && high_thread.is_finished()) {
            if let Ok(status) = client.status() {
                let listed = lies_listed(&status, &low_lease.id);
                if listed > 0 && first_report_unix_us.is_none() {
                    first_report_unix_us = Some(unix_us_now());
                }
                best_listed = best_listed.max(listed);
            }
            std::thread::sleep(STATUS_POLL);
        }
        low_thread
            .join()
            .unwrap_or_else(|_| Err("the low job's thread panicked".into()))
    });
    let final_listed = client
        .status()
        .map(|s| lies_listed(&s, &low_lease.id))
        .unwrap_or(0);
    let (high_report, busy_after, high_active) = high_thread
        .join()
        .map_err(|_| failed("the high job's thread panicked".into()))?;
    let with_log = |why: String| {
        failed(format!(
            "{why}\narbiter log:\n{}",
            setup::log_tail(&arbiter)
        ))
    };
    let low_outcome = low_outcome.map_err(with_log)?;
    let high_report = high_report.map_err(with_log)?;
    let busy_after = busy_after.map_err(failed)?;
    let high_gpu_s = metrics::number("high", &high_report, "kernel_time_s")?;
    let high_active_s = high_active.as_secs_f64();
    let low_gpu_s = ((busy_after.saturating_sub(busy_before)) as f64 / 1e9 - high_gpu_s).max(0.0);
    let first_report_after_lie_ms = match (low_outcome.first_lie_unix_us, first_report_unix_us) {
        (Some(lie), Some(report)) => Some(report.saturating_sub(lie) as f64 / 1e3),
        _ => None,
    };
    Ok(json!({
        "variant": variant.name(),
        "low_job": variant.describe(),
        "scheduler": graces,
        "high_active_s": high_active_s,
        "high_gpu_s": high_gpu_s,
        "low_gpu_s_while_high_active": low_gpu_s,
        "low_gpu_fraction_while_high_active": low_gpu_s / high_active_s,
        "low_processes": low_outcome.processes,
        "violations_listed": best_listed.max(final_listed),
        "first_lie_unix_us": low_outcome.first_lie_unix_us.map(|v| v as u64),
        "first_report_unix_us": first_report_unix_us.map(|v| v as u64),
        "first_report_after_lie_ms": first_report_after_lie_ms,
        "high": high_report,
        "low": low_outcome.report,
    }))
}

/// Runs the high job alone (the baseline), then every variant; the scenario's results.
pub fn run(
    binaries: &Binaries,
    libs: &Path,
    parameters: &Parameters,
    variants: &[Variant],
) -> Result<Value, ExperimentError> {
    eprintln!(
        "gpushare-bench: liars: high alone ({} s, simulated)",
        parameters.duration_s
    );
    let alone = run_case(
        binaries,
        libs,
        parameters,
        Mode::Alone,
        &[parameters.high_job()],
    )?
    .remove(0);
    let mut cases = serde_json::Map::new();
    for &variant in variants {
        eprintln!(
            "gpushare-bench: liars: high + {} ({} s, gpushare, simulated)",
            variant.name(),
            parameters.duration_s
        );
        if variant == Variant::Clock {
            if let Some(why) = shifted_clock_unavailable() {
                eprintln!("gpushare-bench: liars: SKIPPED {}: {why}", variant.name());
                cases.insert(
                    variant.name().into(),
                    json!({"skipped": why, "low_job": variant.describe()}),
                );
                continue;
            }
        }
        let mut case = run_variant(binaries, libs, parameters, variant)?;
        let figures = metrics::priority_case(&alone, &case["high"], &[])?;
        case["high_mean_slowdown_percent"] = figures["high_mean_slowdown_percent"].clone();
        case["high_p99_slowdown_percent"] = figures["high_p99_slowdown_percent"].clone();
        cases.insert(variant.name().into(), case);
    }
    let honest = cases
        .get(Variant::Honest.name())
        .and_then(|c| c["low_gpu_s_while_high_active"].as_f64());
    if let Some(honest) = honest {
        for case in cases.values_mut().filter(|c| c.get("skipped").is_none()) {
            let own = case["low_gpu_s_while_high_active"].as_f64().unwrap_or(0.0);
            case["low_gpu_s_over_honest"] = json!(own - honest);
        }
    }
    Ok(json!({
        "alone": {"metrics": metrics::alone_case(&alone)?, "jobs": [alone]},
        "variants": cases,
    }))
}

/// The scenario's Markdown table.
pub fn markdown(results: &Value, command: &str) -> String {
    let scenario = &results["scenarios"]["liars"];
    let mut md = String::from("# Liars beside a high-priority job (simulated)\n\n");
    md.push_str(&format!(
        "Every figure is *simulated* (the simgpu device model, not a GPU). Produced by:\n\n    {command}\n\n\
         with the {} programs in `{}` and the interposer `{}`.\n\n",
        results["binaries"]["profile"].as_str().unwrap_or("?"),
        results["binaries"]["dir"].as_str().unwrap_or("?"),
        results["binaries"]["preload"].as_str().unwrap_or("?"),
    ));
    md.push_str(
        "The priority scenario's high job beside one low-priority job, under gpushare with the \
         shipped scheduler defaults, once per way the low job lies. *Low GPU time* is the \
         device's busy time while the high job ran, less the high job's own kernels; \
         *first report* is the time from the first lie to the first `overrun`, `ungated` or `shifted_clock` the arbiter's \
         status listed for the low lease (polled every 20 ms).\n\n",
    );
    md.push_str(
        "| variant | low GPU s while high active (simulated) | share of high's run (simulated) | over honest, s (simulated) | high mean slowdown % (simulated) | high p99 slowdown % (simulated) | violations listed (overrun, ungated, shifted_clock) | first report after lie, ms (simulated) |\n",
    );
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    let empty = serde_json::Map::new();
    let variants = scenario["variants"].as_object().unwrap_or(&empty);
    let num = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or("–".to_string(), |x| format!("{x:.digits$}"))
    };
    for (name, case) in variants {
        if let Some(why) = case["skipped"].as_str() {
            md.push_str(&format!("| {name} | skipped: {why} | | | | | | |\n"));
            continue;
        }
        md.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} | {} |\n",
            num(&case["low_gpu_s_while_high_active"], 3),
            num(&case["low_gpu_fraction_while_high_active"], 3),
            num(&case["low_gpu_s_over_honest"], 3),
            num(&case["high_mean_slowdown_percent"], 1),
            num(&case["high_p99_slowdown_percent"], 1),
            case["violations_listed"],
            num(&case["first_report_after_lie_ms"], 0),
        ));
    }
    md.push_str("\nThe low jobs:\n\n");
    for (name, case) in variants {
        md.push_str(&format!(
            "- **{name}**: {}\n",
            case["low_job"].as_str().unwrap_or("")
        ));
    }
    if let Some(scheduler) = variants.values().find_map(|c| c.get("scheduler")) {
        md.push_str(&format!("\nScheduler settings: {scheduler}\n"));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_output_gives_the_first_stamp_and_the_failed_steps() {
        let out = "launch CUDA_SUCCESS n=1\nstamp CUDA_SUCCESS unix_us=1700\n\
                   raw-launch CUDA_SUCCESS via=libcuda\nstamp CUDA_SUCCESS unix_us=1900\n";
        assert_eq!(first_stamp_us(out), Some(1700));
        assert!(failed_steps(out).is_empty());
        assert_eq!(first_stamp_us("sync CUDA_SUCCESS\n"), None);
        let out = "kernel-ms CUDA_ERROR_LAUNCH_FAILED\nsync CUDA_SUCCESS\n";
        assert_eq!(failed_steps(out), ["kernel-ms CUDA_ERROR_LAUNCH_FAILED"]);
    }

    #[test]
    fn variants_have_distinct_names() {
        let names: std::collections::BTreeSet<_> = Variant::ALL.iter().map(|v| v.name()).collect();
        assert_eq!(names.len(), Variant::ALL.len());
    }
}
