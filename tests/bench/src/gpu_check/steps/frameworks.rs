//! What containers really run: PyTorch (eager training, CUDA graphs, torch.compile), CuPy
//! and Triton, each a process of a lease, through the CUDA runtime rather than the driver
//! API the probe uses. A framework that is not installed is a SKIP naming it.

use crate::gpu_check::jobs::{
    churn_while, lease, python, script_verdict, start_arbiter, start_arbiter_with, status, Lease,
    GIB,
};
use crate::gpu_check::{Outcome, StepEnv, Verdict};
use gpushare_arbiter::watchdog::{RESTART_GRACE, UNREGISTERED_GRACE};
use gpushare_proto::{Priority, ViolationKind};
use gpushare_testkit::Arbiter;
use std::process::Child;
use std::time::{Duration, Instant};

/// How long a script may take to initialise CUDA (importing torch is slow).
const INIT_WAIT: Duration = Duration::from_secs(40);
/// The torch-eager arbiter's watchdog pass.
const WATCHDOG_INTERVAL: Duration = Duration::from_millis(500);

/// PyTorch eager training under a 2 GiB quota. The script stops after `torch.cuda.init()`
/// and the first `current_stream()`, before any allocation, and this step checks that the
/// arbiter already lists its pid as a client of the lease (the CUDA runtime creates its
/// context without an exported creation call, so only an interposer that attaches at its
/// first intercepted call registers it here). At the end no watchdog report names it.
pub fn torch_eager(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        // A watchdog pass every half second, so that a process left unregistered while the
        // script waits is reported (after the watchdog's start-up grace) before it goes on.
        let arbiter = start_arbiter_with(env, 500, |c| {
            c.arbiter.watchdog_interval_ms = WATCHDOG_INTERVAL.as_millis() as u64
        })?;
        let started = Instant::now();
        let quota = 2 * GIB;
        let job = lease(&arbiter, "torch", Priority::Low, quota)?;
        let cmd = python(
            env,
            "torch_eager.py",
            &job,
            &[quota.to_string(), env.work.display().to_string()],
        );
        let mut child = match cmd {
            Ok(mut c) => c.spawn().map_err(|e| format!("starting python3: {e}"))?,
            Err(verdict) => return Ok(verdict),
        };
        let registration = registered_at_init(env, &arbiter, &job, &mut child, started)?;
        let out = child
            .wait_with_output()
            .map_err(|e| format!("waiting for python3: {e}"))?;
        let verdict = script_verdict(&out);
        if verdict.outcome == Outcome::Skip {
            return Ok(verdict);
        }
        let Some(InitCheck {
            pid,
            registered,
            unregistered,
        }) = registration
        else {
            return Ok(Verdict::fail(format!(
                "the script never reached its first allocation; {}",
                verdict.detail
            )));
        };
        let mut problems = Vec::new();
        if !registered {
            problems.push(format!(
                "pid {pid} was not a client of the lease after torch.cuda.init() and current_stream()"
            ));
        }
        if !unregistered.is_empty() {
            problems.push(format!(
                "the watchdog reports unregistered pids {unregistered:?}"
            ));
        }
        Ok(if problems.is_empty() {
            Verdict {
                detail: format!("registered at init; {}", verdict.detail),
                ..verdict
            }
        } else {
            Verdict::fail(format!(
                "{}; script: {}",
                problems.join("; "),
                verdict.detail
            ))
        })
    };
    run_it().unwrap_or_else(Verdict::fail)
}

/// Waits for the script's `initialised` file (its pid), checks that the arbiter lists the
/// pid on `job`, holds the script there until the watchdog has had its passes, and lets it
/// go on (`checked`). None when the script ended first.
fn registered_at_init(
    env: &StepEnv,
    arbiter: &Arbiter,
    job: &Lease,
    child: &mut Child,
    arbiter_started: Instant,
) -> Result<Option<InitCheck>, String> {
    let (initialised, checked) = (env.work.join("initialised"), env.work.join("checked"));
    let end = Instant::now() + INIT_WAIT;
    while !initialised.exists() {
        if Instant::now() > end || child.try_wait().map_err(|e| e.to_string())?.is_some() {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Written before the file is renamed into place by the script: complete when seen.
    let pid: u32 = std::fs::read_to_string(&initialised)
        .map_err(|e| e.to_string())?
        .trim()
        .parse()
        .map_err(|e| format!("the script's pid: {e}"))?;
    let registered = status(arbiter)?
        .usage
        .iter()
        .filter(|u| u.lease.0 == job.0)
        .any(|u| u.clients.iter().any(|c| c.pid == pid));
    // The watchdog reports nothing during its start-up grace, then a process it has seen
    // unregistered for its grace: hold the script (before its first allocation) until the
    // first pass after both, so that a process still unregistered here is reported.
    let inited = Instant::now();
    let reported_by = (arbiter_started + RESTART_GRACE.max(WATCHDOG_INTERVAL * 3))
        .max(inited + UNREGISTERED_GRACE.max(WATCHDOG_INTERVAL * 2))
        + WATCHDOG_INTERVAL * 2;
    while Instant::now() < reported_by {
        std::thread::sleep(WATCHDOG_INTERVAL);
    }
    // The latest pass's report: read while the script is still alive and waiting.
    let unregistered = status(arbiter)?
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::Unregistered)
        .map(|v| v.pid)
        .collect();
    std::fs::write(&checked, "").map_err(|e| e.to_string())?;
    Ok(Some(InitCheck {
        pid,
        registered,
        unregistered,
    }))
}

/// What the arbiter knew of a framework process between its CUDA initialisation and its
/// first allocation.
struct InitCheck {
    pid: u32,
    /// The arbiter listed the pid as a client of its lease.
    registered: bool,
    /// The pids the watchdog reported unregistered.
    unregistered: Vec<u32>,
}

/// `torch.cuda.graph` capture and replay, and `torch.compile(mode="reduce-overhead")`
/// (CUDA graphs under the hood), as a low-priority job while a high-priority job churns the
/// token: every replay and compiled call gives the eager result.
pub fn torch_graphs(env: &StepEnv) -> Verdict {
    script_under_churn(env, "torch_graphs.py", 4 * GIB)
}

/// CuPy kernels and its memory pool under a 1 GiB quota.
pub fn cupy(env: &StepEnv) -> Verdict {
    script_under_lease(env, "cupy_kernels.py", GIB)
}

/// A Triton kernel (vector add) under a lease.
pub fn triton(env: &StepEnv) -> Verdict {
    script_under_lease(env, "triton_add.py", 2 * GIB)
}

fn script_under_lease(env: &StepEnv, script: &str, quota: u64) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let job = lease(&arbiter, "job", Priority::Low, quota)?;
        let mut cmd = match python(env, script, &job, &[quota.to_string()]) {
            Ok(c) => c,
            Err(verdict) => return Ok(verdict),
        };
        let out = cmd.output().map_err(|e| format!("running python3: {e}"))?;
        Ok(script_verdict(&out))
    };
    run_it().unwrap_or_else(Verdict::fail)
}

fn script_under_churn(env: &StepEnv, script: &str, quota: u64) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, GIB)?;
        let low = lease(&arbiter, "low", Priority::Low, quota)?;
        let mut cmd = match python(env, script, &low, &[quota.to_string()]) {
            Ok(c) => c,
            Err(verdict) => return Ok(verdict),
        };
        let child = cmd.spawn().map_err(|e| format!("starting python3: {e}"))?;
        let (out, rounds) = churn_while(env, &high, child)?;
        let verdict = script_verdict(&out);
        if verdict.outcome == Outcome::Skip {
            return Ok(verdict);
        }
        Ok(Verdict {
            detail: format!("{} ({rounds} churn rounds of the high job)", verdict.detail),
            ..verdict
        })
    };
    run_it().unwrap_or_else(Verdict::fail)
}
