//! `make gpu-check`'s program: without a driver it says so in one line and exits 0; on the
//! simulated GPU (GPUSHARE_GPU_CHECK_ON_SIMGPU) every step runs, so what a GPU machine runs
//! has been run before; a failing or hanging step fails the run, named, and loses nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpushare_bench::gpu_check::{HANG_STEP_VAR, SIMULATED_VAR, STEPS, TIMEOUTS_VAR};
use gpushare_bench::setup::Binaries;
use gpushare_testkit::simgpu::SimMachine;

fn program(binaries: &Binaries) -> Command {
    let mut cmd = Command::new(binaries.program("gpushare-gpu-check"));
    cmd.env("GPUSHARE_BIN_DIR", &binaries.dir)
        .env("GPUSHARE_PRELOAD_LIB", &binaries.preload)
        .env_remove(SIMULATED_VAR)
        .env_remove(HANG_STEP_VAR)
        .env_remove(TIMEOUTS_VAR);
    cmd
}

fn binaries() -> Binaries {
    Binaries::locate().expect("built binaries (see GPUSHARE_BIN_DIR)")
}

/// A simulated GPU of 16 GiB in a fresh directory, and where the results go.
fn simulated() -> (tempfile::TempDir, SimMachine, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("gsg-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::create_dir_all(dir.path().join("simgpu")).unwrap();
    let machine = SimMachine::new(dir.path().join("simgpu"), 1, "16Gi");
    let results = dir.path().join("gpu-check.md");
    (dir, machine, results)
}

fn on_simgpu(machine: &SimMachine, results: &Path, args: &[&str]) -> Command {
    let mut cmd = program(&binaries());
    machine
        .apply(&mut cmd)
        .args(args)
        .arg(results)
        .env(SIMULATED_VAR, "1");
    cmd
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string()
}

/// The row of `step` in the Markdown report.
fn row<'r>(report: &'r str, step: &str) -> &'r str {
    report
        .lines()
        .find(|l| l.starts_with(&format!("| {step} |")))
        .unwrap_or_else(|| panic!("no {step} row:\n{report}"))
}

fn json_steps(results: &Path) -> Vec<serde_json::Value> {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(results.with_extension("json")).unwrap()).unwrap();
    json["steps"].as_array().cloned().unwrap_or_default()
}

#[test]
fn without_a_driver_it_says_so_in_one_line_and_exits_0() {
    // No libcuda.so.1 where the loader looks first; the decision is the driver's own answer
    // (dlopen, cuInit, a device, NVML), whatever /proc holds.
    let empty = tempfile::tempdir().unwrap();
    let results = empty.path().join("gpu-check.md");
    let out = program(&binaries())
        .env("LD_LIBRARY_PATH", empty.path())
        .arg(&results)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !stdout.contains("no NVIDIA driver") && !stdout.is_empty() {
        eprintln!(
            "this machine's loader finds a real libcuda.so.1: make gpu-check runs for real here"
        );
        return;
    }
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.contains("libcuda.so.1 cannot be loaded"),
        "says why: {stdout}"
    );
    assert!(!results.exists(), "no results without a GPU");
    assert!(!results.with_extension("json").exists());
}

#[test]
fn every_step_passes_or_skips_on_the_simulated_gpu() {
    let (_dir, machine, results) = simulated();
    // A CUDA 13.0 driver: the test kernel must load there too.
    let machine = machine.set("SIMGPU_CUDA_VERSION", 13000);
    let out = on_simgpu(&machine, &results, &[]).output().unwrap();
    let report = std::fs::read_to_string(&results).unwrap_or_default();
    assert!(report.contains("SIMULATED GPU"), "{report}\n{}", text(&out));
    assert!(
        report.contains("Binaries: "),
        "names its binaries: {report}"
    );
    let torch = python_has("torch");
    for step in STEPS {
        let line = row(&report, step.name);
        let framework = match step.name {
            "torch-eager" | "torch-graphs" => Some(("torch", torch)),
            "cupy" => Some(("cupy", python_has("cupy"))),
            "triton" => Some(("torch", torch && python_has("triton"))),
            _ => None,
        };
        match framework {
            Some((module, false)) => assert!(
                line.contains("| SKIP |") && line.contains(&format!("{module} not installed")),
                "{line}"
            ),
            _ => assert!(line.contains("| PASS |"), "{line}"),
        }
    }
    // simgpu implements cuCheckpointProcess*, its copies at a modelled bandwidth.
    for facts in ["memory-facts", "timeslice", "checkpoint"] {
        assert!(row(&report, facts).contains("(simulated)"), "{report}");
    }
    assert_eq!(json_steps(&results).len(), STEPS.len());
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_failing_step_fails_the_run_and_is_named_last() {
    let (_dir, machine, results) = simulated();
    // A real failure: the driver cannot fit the kernel's module at its first launch, so the
    // probe's kernel never runs (allocations still do).
    let machine = machine.set("SIMGPU_MODULE_MEMORY", "64Gi");
    let out = on_simgpu(&machine, &results, &["--steps", "probe-alone,memory-quota"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(
        last_line(&out),
        format!(
            "gpu-check: FAILED: probe-alone (results in {})",
            results.display()
        )
    );
    let report = std::fs::read_to_string(&results).unwrap();
    let failed = row(&report, "probe-alone");
    assert!(
        failed.contains("| FAIL |") && failed.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{failed}"
    );
    assert!(
        row(&report, "memory-quota").contains("| PASS |"),
        "{report}"
    );
    let steps = json_steps(&results);
    let names: Vec<&str> = steps.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["probe-alone", "memory-quota"]);
}

#[test]
fn a_hanging_step_is_killed_at_its_timeout_and_the_run_goes_on() {
    let (_dir, machine, results) = simulated();
    let mut run = on_simgpu(&machine, &results, &["--steps", "memory-quota,probe-alone"]);
    let mut child = run
        .env(HANG_STEP_VAR, "probe-alone")
        .env(TIMEOUTS_VAR, "probe-alone=10")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first step's row is on disk while the second still hangs: results are written
    // as each step ends, not at the end.
    let end = Instant::now() + Duration::from_secs(120);
    let written = loop {
        let report = std::fs::read_to_string(&results).unwrap_or_default();
        if report.contains("| memory-quota |") || Instant::now() > end {
            break report;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        row(&written, "memory-quota").contains("| PASS |"),
        "{written}"
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "still running: the hanging step has 10 s"
    );
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    let report = std::fs::read_to_string(&results).unwrap();
    let hung = row(&report, "probe-alone");
    assert!(
        hung.contains("| FAIL |") && hung.contains("timed out after 10 s"),
        "{hung}"
    );
    assert_eq!(
        last_line(&out),
        format!(
            "gpu-check: FAILED: probe-alone (results in {})",
            results.display()
        )
    );
}

fn python_has(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success())
}
