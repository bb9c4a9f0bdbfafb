//! `make gpu-check`: the interposer and the arbiter on a real NVIDIA GPU.
//!
//! Everything else in the repository runs on the simulated GPU (tests/simgpu). This
//! program runs the same probe and workload — their kernel is the PTX spin kernel of
//! tests/simgpu/ptx/spin.ptx, which the real driver JIT-compiles — against the
//! machine's own `libcuda.so.1` and NVML, with a private arbiter, and writes what it
//! measured to a results file (Markdown and JSON). It needs nothing from a package
//! registry: only the binaries `make build` (or `cargo build`) produced. Where PyTorch
//! is installed it also captures a CUDA graph through it.
//!
//! Without an NVIDIA driver it says so and exits 0: CI and development machines have
//! no GPU.
//!
//! Checks (each PASS or FAIL with what was seen):
//! 1. the probe alone on the driver: the PTX kernel, a captured graph;
//! 2. memory quota: an allocation beyond the lease's quota is refused, within it granted;
//! 3. capture: a high-priority holder idles during a GLOBAL capture, and a low-priority
//!    holder is revoked during one — both captures complete;
//! 4. a low-priority job of 2 s kernels beside a high-priority job finishes and is never
//!    cut off;
//! 5. the priority pair: a high-priority workload alone and beside a saturating
//!    low-priority one (the slowdown is reported, not judged).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output, Stdio};
use std::time::{Duration, Instant};

use gpushare_proto::{
    ControlClient, Fraction, GpuSelector, MemoryRequest, Priority, ReserveRequest,
};
use gpushare_testkit::config::{ArbiterConfig, RuntimeConfig};
use gpushare_testkit::{binaries, Arbiter};

const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);

struct Check {
    name: &'static str,
    passed: bool,
    detail: String,
}

/// Why the machine has no driver to check, if it has none.
fn no_driver() -> Option<String> {
    if !Path::new("/proc/driver/nvidia/version").exists() {
        return Some("/proc/driver/nvidia/version is absent (no NVIDIA kernel driver)".into());
    }
    // SAFETY: dlopen with a NUL-terminated name; the handle is closed right away.
    let handle =
        unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Some("libcuda.so.1 cannot be loaded".into());
    }
    // SAFETY: a handle dlopen just returned.
    unsafe { libc::dlclose(handle) };
    None
}

/// Where the programs are, found as the test kit finds them (`GPUSHARE_BIN_DIR`,
/// `GPUSHARE_PRELOAD_LIB`).
struct Bins {
    dir: PathBuf,
    preload: PathBuf,
}

impl Bins {
    fn locate() -> Result<Bins, String> {
        let (dir, preload) = (binaries::bin_dir(), binaries::preload_library());
        for path in [
            binaries::arbiter(None),
            dir.join("gpushare-cuda-probe"),
            dir.join("simgpu-workload"),
            preload.clone(),
        ] {
            if !path.exists() {
                return Err(format!(
                    "{} is missing: build first (make build), or set GPUSHARE_BIN_DIR",
                    path.display()
                ));
            }
        }
        Ok(Bins { dir, preload })
    }
}

/// A private arbiter (the test kit's) on the machine's own GPUs, through the driver's NVML,
/// its low-priority holders revoked after `revoke_grace_ms`.
fn start_arbiter(dir: &Path, revoke_grace_ms: u64) -> Result<Arbiter, String> {
    Arbiter::builder_in(dir)
        .configure(|c| {
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
        .map_err(|e| e.to_string())
}

fn control(arbiter: &Arbiter) -> Result<ControlClient, String> {
    ControlClient::connect(&arbiter.control_socket(), CONTROL_TIMEOUT).map_err(|e| e.to_string())
}

/// Reserves and confirms a lease on GPU 0; its id and socket.
fn lease(
    arbiter: &Arbiter,
    name: &str,
    priority: Priority,
    memory: u64,
) -> Result<(String, PathBuf), String> {
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
    // The jobs are this program's children: confirming with its own pid puts them
    // inside "the container" (pid namespace and cgroup), as lease sockets require.
    control
        .confirm(container_id, std::process::id())
        .map_err(|e| format!("confirming {name}: {e}"))?;
    let socket = arbiter.lease_socket(&lease.id.0);
    Ok((lease.id.0, socket))
}

/// `cmd` as a process of `lease`'s container: the interposer preloaded, the lease named.
fn interposed<'a>(
    bins: &Bins,
    cmd: &'a mut Command,
    (id, socket): &(String, PathBuf),
) -> &'a mut Command {
    cmd.env("LD_PRELOAD", &bins.preload)
        .env("GPUSHARE_LEASE", id)
        .env("GPUSHARE_SOCKET", socket)
}

/// One of the built programs with `args`, its output captured, under `lease` if given.
fn program(bins: &Bins, name: &str, lease: Option<&(String, PathBuf)>, args: &[&str]) -> Command {
    let mut cmd = Command::new(bins.dir.join(name));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(lease) = lease {
        interposed(bins, &mut cmd, lease);
    }
    cmd
}

fn probe(bins: &Bins, lease: Option<&(String, PathBuf)>, args: &[&str]) -> Command {
    program(bins, "gpushare-cuda-probe", lease, args)
}

/// Runs `high` to completion while `low` runs; returns both outputs and how long `low`
/// went on after `high` had finished.
fn beside(mut low: Command, mut high: Command) -> Result<(Output, Output, Duration), String> {
    let low = low.spawn().map_err(|e| e.to_string())?;
    let high = run(&mut high);
    let high_done = Instant::now();
    let low = low.wait_with_output().map_err(|e| e.to_string())?;
    Ok((low, high, high_done.elapsed()))
}

/// The probe's `<step> <result> …` lines, and whether every step of `steps` succeeded.
fn results(out: &Output) -> (bool, String) {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let ok = out.status.success()
        && text
            .lines()
            .all(|l| l.split_whitespace().nth(1) == Some("CUDA_SUCCESS"));
    (
        ok,
        format!(
            "{}{}",
            text.trim(),
            if ok {
                String::new()
            } else {
                format!(" | stderr: {}", String::from_utf8_lossy(&out.stderr).trim())
            }
        ),
    )
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
        stdout: Vec::new(),
        stderr: e.to_string().into_bytes(),
    })
}

fn checks(bins: &Bins, dir: &Path) -> Result<Vec<Check>, String> {
    let mut found = Vec::new();
    let (ok, detail) = results(&run(&mut probe(
        bins,
        None,
        &[
            "launch",
            "10",
            "kernel-ms",
            "100",
            "capture-begin",
            "global",
            "capture-launch",
            "3",
            "capture-end",
        ],
    )));
    found.push(Check {
        name: "probe alone (PTX kernel, captured graph)",
        passed: ok,
        detail,
    });

    let arbiter = start_arbiter(dir, 500)?;
    let gi = 1u64 << 30;
    let small = lease(&arbiter, "memory", Priority::Low, 2 * gi)?;
    let out = run(&mut probe(
        bins,
        Some(&small),
        &["meminfo", "alloc", "1Gi", "meminfo", "alloc", "1Gi"],
    ));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let allocs: Vec<&str> = text.lines().filter(|l| l.starts_with("alloc ")).collect();
    let passed = allocs.len() == 2
        && allocs[0].contains("CUDA_SUCCESS")
        && allocs[1].contains("CUDA_ERROR_OUT_OF_MEMORY");
    found.push(Check {
        name: "memory quota (2 GiB lease incl. context: 1 GiB granted, a second refused)",
        passed,
        detail: text.trim().replace('\n', "; "),
    });

    let high = lease(&arbiter, "high", Priority::High, 4 * gi)?;
    let low = lease(&arbiter, "low", Priority::Low, 4 * gi)?;
    let (ok, detail) = results(&run(&mut probe(
        bins,
        Some(&high),
        &[
            "launch",
            "1",
            "capture-begin",
            "global",
            "sleep",
            "50",
            "capture-launch",
            "3",
            "sleep",
            "50",
            "capture-end",
        ],
    )));
    found.push(Check {
        name: "capture across a high-priority holder's idle time (GLOBAL mode)",
        passed: ok,
        detail,
    });

    let (capturing, revoked) = (dir.join("capturing"), dir.join("revoked"));
    let low_job = probe(
        bins,
        Some(&low),
        &[
            "launch",
            "1",
            "capture-begin",
            "global",
            "capture-launch",
            "2",
            "touch",
            capturing.to_str().unwrap_or(""),
            "wait",
            revoked.to_str().unwrap_or(""),
            "capture-launch",
            "2",
            "capture-end",
            "launch",
            "1",
        ],
    );
    let high_job = probe(
        bins,
        Some(&high),
        &[
            "wait",
            capturing.to_str().unwrap_or(""),
            "launch",
            "1",
            "sleep",
            "100",
            "touch",
            revoked.to_str().unwrap_or(""),
        ],
    );
    let (low_out, _, _) = beside(low_job, high_job)?;
    let (ok, detail) = results(&low_out);
    found.push(Check {
        name: "capture across a low-priority holder's revocation (GLOBAL mode)",
        passed: ok,
        detail,
    });

    let started = dir.join("long-started");
    let long = probe(
        bins,
        Some(&low),
        &[
            "launch",
            "1",
            "kernel-ms",
            "2000",
            "touch",
            started.to_str().unwrap_or(""),
            "kernel-ms",
            "2000",
            "kernel-ms",
            "2000",
            "sync",
        ],
    );
    let high_job = probe(
        bins,
        Some(&high),
        &[
            "wait",
            started.to_str().unwrap_or(""),
            "launch",
            "20",
            "sleep",
            "200",
        ],
    );
    let (long_out, _, after_high) = beside(long, high_job)?;
    let (ok, detail) = results(&long_out);
    let status = control(&arbiter)?.status().map_err(|e| e.to_string())?;
    // Finishing every step is the proof it was not stranded (a cut-off client waited
    // for ever); how often its drain outlasted the grace is reported.
    let overdue: u64 = status.tokens.iter().map(|t| t.overdue).sum();
    found.push(Check {
        name: "2 s kernels beside a high-priority job: finished, never cut off",
        passed: ok,
        detail: format!(
            "{detail}; reported overdue {overdue} times; finished {:.1} s after the high job left",
            after_high.as_secs_f64()
        ),
    });

    let workload = |lease: &(String, PathBuf), args: &[&str]| {
        program(bins, "simgpu-workload", Some(lease), args)
    };
    let high_args = [
        "--kernel",
        "fixed:100us",
        "--kernels",
        "50",
        "--gap",
        "3300us",
        "--duration",
        "10s",
    ];
    let alone = run(&mut workload(&high, &high_args));
    let low_args = [
        "--kernel",
        "fixed:1ms",
        "--kernels",
        "20",
        "--duration",
        "12s",
    ];
    let (low_out, shared, _) = beside(workload(&low, &low_args), workload(&high, &high_args))?;
    let throughput = |out: &Output| {
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|v| v["throughput_iters_per_s"].as_f64())
    };
    let (a, s, l) = (
        throughput(&alone),
        throughput(&shared),
        throughput(&low_out),
    );
    found.push(Check {
        name: "priority pair (high: 50 × 100 µs + 3.3 ms gap; low: saturating 1 ms kernels)",
        passed: a.is_some() && s.is_some() && l.is_some(),
        detail: match (a, s) {
            (Some(a), Some(s)) => format!(
                "high alone {a:.1} it/s, beside low {s:.1} it/s: slowdown {:.1} %; low {:.1} it/s",
                (1.0 - s / a) * 100.0,
                l.unwrap_or(0.0)
            ),
            _ => format!(
                "no report: {} / {}",
                String::from_utf8_lossy(&alone.stderr).trim(),
                String::from_utf8_lossy(&shared.stderr).trim()
            ),
        },
    });

    if Command::new("python3")
        .args(["-c", "import torch; assert torch.cuda.is_available()"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        let script = "import torch, time\n\
            x = torch.randn(1024, 1024, device='cuda')\n\
            g = torch.cuda.CUDAGraph()\n\
            s = torch.cuda.Stream()\n\
            s.wait_stream(torch.cuda.current_stream())\n\
            with torch.cuda.stream(s):\n    y = x @ x\n\
            torch.cuda.current_stream().wait_stream(s)\n\
            with torch.cuda.graph(g):\n    time.sleep(0.05)\n    y = x @ x\n    time.sleep(0.05)\n\
            g.replay(); torch.cuda.synchronize(); print('graph replayed')\n";
        let out = run(interposed(
            bins,
            Command::new("python3").args(["-c", script]),
            &high,
        ));
        found.push(Check {
            name: "PyTorch CUDA graph capture (torch.cuda.graph, GLOBAL mode, idle inside the capture)",
            passed: out.status.success(),
            detail: format!("{} {}", String::from_utf8_lossy(&out.stdout).trim(), String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")),
        });
    }
    Ok(found)
}

fn main() -> ExitCode {
    let out = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("results/gpu-check.md"));
    // GPUSHARE_GPU_CHECK_ON_SIMGPU=1 (with LD_LIBRARY_PATH at the simulated driver) runs
    // the checks on the simulated GPU: how this program itself is tested here.
    let simulated = std::env::var_os("GPUSHARE_GPU_CHECK_ON_SIMGPU").is_some();
    if let Some(why) = no_driver().filter(|_| !simulated) {
        println!("gpu-check: no NVIDIA driver on this machine ({why}); nothing to check");
        return ExitCode::SUCCESS;
    }
    let bins = match Bins::locate() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = match tempfile::Builder::new().prefix("gpu-check-").tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let found = match checks(&bins, dir.path()) {
        Ok(found) => found,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gpu = Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let kind = if simulated {
        "SIMULATED GPU, not a real one"
    } else {
        "real GPU"
    };
    let mut md =
        format!("# gpu-check ({kind})\n\nGPU: {gpu}\n\n| check | result | seen |\n|---|---|---|\n");
    for c in &found {
        md += &format!(
            "| {} | {} | {} |\n",
            c.name,
            if c.passed { "PASS" } else { "FAIL" },
            c.detail.replace('|', "/").replace('\n', "; ")
        );
    }
    let json = serde_json::json!({
        "gpu": gpu,
        "checks": found.iter().map(|c| serde_json::json!({"name": c.name, "passed": c.passed, "detail": c.detail})).collect::<Vec<_>>(),
    });
    print!("{md}");
    let written = std::fs::write(&out, &md).and_then(|()| {
        std::fs::write(
            out.with_extension("json"),
            serde_json::to_vec_pretty(&json).unwrap_or_default(),
        )
    });
    if let Err(e) = written {
        eprintln!("gpu-check: writing {}: {e}", out.display());
    }
    if found.iter().all(|c| c.passed) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
