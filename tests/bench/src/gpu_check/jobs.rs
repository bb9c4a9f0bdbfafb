//! What the steps share: a private arbiter on the machine's GPU, leases, the built programs
//! and Python scripts as processes of a lease, and reading the probe's answers.

use super::{StepEnv, Verdict};
use gpushare_proto::{
    ControlClient, Fraction, GpuSelector, MemoryRequest, Priority, ReserveRequest, StatusReport,
};
use gpushare_testkit::config::{ArbiterConfig, RuntimeConfig};
use gpushare_testkit::Arbiter;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
pub const GIB: u64 = 1 << 30;

/// A lease: its id and its socket.
pub type Lease = (String, PathBuf);

/// A private arbiter (the test kit's) in the step's directory, on the machine's own GPUs
/// through the driver's NVML, its low-priority holders revoked after `revoke_grace_ms`.
pub fn start_arbiter(env: &StepEnv, revoke_grace_ms: u64) -> Result<Arbiter, String> {
    start_arbiter_with(env, revoke_grace_ms, |_| {})
}

/// [`start_arbiter`] with one more change to its configuration.
pub fn start_arbiter_with(
    env: &StepEnv,
    revoke_grace_ms: u64,
    edit: impl FnOnce(&mut gpushare_testkit::config::Config),
) -> Result<Arbiter, String> {
    Arbiter::builder_in(&env.work)
        .configure(|c| {
            edit(c);
            // The kit declares GPUs without NVML; here NVML is the real driver's (or, on the
            // simulated GPU, whichever libnvidia-ml.so.1 LD_LIBRARY_PATH finds first).
            c.arbiter.nvml_library = ArbiterConfig::default().nvml_library;
            // No runtime runs here: only the interposer the kit points at is this build's.
            c.runtime = RuntimeConfig {
                library: c.runtime.library.clone(),
                ..RuntimeConfig::default()
            };
            c.scheduler.revoke_grace_ms = revoke_grace_ms;
        })
        .try_start()
        .map_err(|e| format!("starting the arbiter: {e}"))
}

pub fn control(arbiter: &Arbiter) -> Result<ControlClient, String> {
    ControlClient::connect(&arbiter.control_socket(), CONTROL_TIMEOUT).map_err(|e| e.to_string())
}

pub fn status(arbiter: &Arbiter) -> Result<StatusReport, String> {
    control(arbiter)?
        .status()
        .map_err(|e| format!("arbiter status: {e}"))
}

/// Reserves and confirms a lease of `memory` bytes on GPU 0.
pub fn lease(
    arbiter: &Arbiter,
    name: &str,
    priority: Priority,
    memory: u64,
) -> Result<Lease, String> {
    let mut control = control(arbiter)?;
    let container_id = format!("gpu-check-{name}");
    let lease = control
        .reserve(ReserveRequest {
            container_id: container_id.clone(),
            namespace: None,
            sandbox_id: None,
            priority,
            memory: Some(MemoryRequest::Bytes(memory)),
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            gpu: GpuSelector::Index(vec![0]),
            tenant: None,
            pod: None,
        })
        .map_err(|e| format!("reserving {name}: {e}"))?;
    // The jobs are this process's children: confirming with its own pid puts them inside
    // "the container" (pid namespace and cgroup), as lease sockets require.
    control
        .confirm(container_id, std::process::id())
        .map_err(|e| format!("confirming {name}: {e}"))?;
    let socket = arbiter.lease_socket(&lease.id.0);
    Ok((lease.id.0, socket))
}

/// `cmd` as a process of `lease`'s container: the interposer preloaded, the lease named.
pub fn interposed<'a>(
    env: &StepEnv,
    cmd: &'a mut Command,
    (id, socket): &Lease,
) -> &'a mut Command {
    cmd.env("LD_PRELOAD", &env.bins.preload)
        .env("GPUSHARE_LEASE", id)
        .env("GPUSHARE_SOCKET", socket)
}

/// One of the built programs with `args`, its output captured, under `lease` if given.
pub fn program(env: &StepEnv, name: &str, lease: Option<&Lease>, args: &[&str]) -> Command {
    let mut cmd = Command::new(env.bins.dir.join(name));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(lease) = lease {
        interposed(env, &mut cmd, lease);
    }
    cmd
}

pub fn probe(env: &StepEnv, lease: Option<&Lease>, args: &[&str]) -> Command {
    program(env, "gpushare-cuda-probe", lease, args)
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
        stdout: Vec::new(),
        stderr: e.to_string().into_bytes(),
    })
}

/// Runs `high` to completion while `low` runs; both outputs and how long `low` went on
/// after `high` had finished.
pub fn beside(mut low: Command, mut high: Command) -> Result<(Output, Output, Duration), String> {
    let low = low.spawn().map_err(|e| e.to_string())?;
    let high = run(&mut high);
    let high_done = Instant::now();
    let low = low.wait_with_output().map_err(|e| e.to_string())?;
    Ok((low, high, high_done.elapsed()))
}

/// Runs short high-priority probes one after another on `high` until `job` ends: the
/// token moves to the high job and back many times while `job` works. The job's output
/// and how many churn rounds ran.
pub fn churn_while(env: &StepEnv, high: &Lease, job: Child) -> Result<(Output, u32), String> {
    let mut job = job;
    let mut rounds = 0;
    let churn: Vec<&str> = ["launch", "1", "sleep", "20"].repeat(10);
    while job.try_wait().map_err(|e| e.to_string())?.is_none() {
        run(&mut probe(env, Some(high), &churn));
        rounds += 1;
    }
    Ok((job.wait_with_output().map_err(|e| e.to_string())?, rounds))
}

/// The probe's `<step> <result> …` lines: PASS when it exited 0 and every step returned
/// CUDA_SUCCESS, with those lines (and stderr on failure) as the detail.
pub fn probe_verdict(out: &Output) -> Verdict {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let ok = out.status.success()
        && text
            .lines()
            .all(|l| l.split_whitespace().nth(1) == Some("CUDA_SUCCESS"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let detail = if ok {
        text.trim().replace('\n', "; ")
    } else {
        format!(
            "{} / stderr: {}",
            text.trim().replace('\n', "; "),
            stderr.trim()
        )
    };
    Verdict::judged(ok, detail)
}

/// `key=value` of the first line of step `step` in the probe's output.
pub fn probe_value(out: &Output, step: &str, key: &str) -> Option<u64> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.split_whitespace().next() == Some(step))?
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?
        .parse()
        .ok()
}

/// The Python scripts of the framework steps, carried inside this program so that a GPU
/// machine needs only the binary directory.
pub const SCRIPTS: [(&str, &str); 5] = [
    (
        "gpu_check_common.py",
        include_str!("../../gpu-check/gpu_check_common.py"),
    ),
    (
        "torch_eager.py",
        include_str!("../../gpu-check/torch_eager.py"),
    ),
    (
        "torch_graphs.py",
        include_str!("../../gpu-check/torch_graphs.py"),
    ),
    (
        "cupy_kernels.py",
        include_str!("../../gpu-check/cupy_kernels.py"),
    ),
    (
        "triton_add.py",
        include_str!("../../gpu-check/triton_add.py"),
    ),
];

/// `python3 SCRIPT args…` under `lease`, its output captured; SKIP's reason when there is
/// no python3.
pub fn python(
    env: &StepEnv,
    script: &str,
    lease: &Lease,
    args: &[String],
) -> Result<Command, Verdict> {
    assert!(
        SCRIPTS.iter().any(|(name, _)| *name == script),
        "{script} is not one of SCRIPTS"
    );
    let has_python = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_python {
        return Err(Verdict::skip("python3 not found"));
    }
    for (name, text) in SCRIPTS {
        std::fs::write(env.work.join(name), text)
            .map_err(|e| Verdict::fail(format!("writing {name}: {e}")))?;
    }
    let mut cmd = Command::new("python3");
    cmd.arg(env.work.join(script))
        .args(args)
        .current_dir(&env.work)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    interposed(env, &mut cmd, lease);
    Ok(cmd)
}

/// A script's verdict: its last stdout line is `{"outcome": …, "detail": …}`.
pub fn script_verdict(out: &Output) -> Verdict {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    match serde_json::from_str::<Verdict>(last) {
        Ok(v) if out.status.success() => v,
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            Verdict::fail(format!(
                "the script ended ({}) without a verdict: {}",
                out.status,
                tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
            ))
        }
    }
}

/// Waits up to `timeout` for `path` to exist.
pub fn wait_for(path: &Path, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}
