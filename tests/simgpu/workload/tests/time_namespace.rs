//! A process in a time namespace of its own (its `CLOCK_MONOTONIC` shifted, as any process may
//! do inside a user namespace) shares the simulated GPU like any other: the device's time is
//! its own, as a real GPU's is. Figures are simulated.

mod common;
use common::{f, Sim};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Ten minutes behind the machine's clock.
const SHIFT: &[&str] = &[
    "unshare",
    "--user",
    "--map-root-user",
    "--time",
    "--monotonic=-600",
    "--fork",
];

/// Only to catch a hang: each job runs 2 s.
const HANG: Duration = Duration::from_secs(60);

fn time_namespaces_available() -> Result<(), String> {
    let out = Command::new(SHIFT[0])
        .args(&SHIFT[1..])
        .args(["cat", "/proc/self/timens_offsets"])
        .output()
        .map_err(|e| format!("running unshare: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && text.contains("-600") {
        Ok(())
    } else {
        Err(format!(
            "unshare cannot make a shifted time namespace here ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn wait_or_kill(mut child: Child, name: &str) -> serde_json::Value {
    let finished = common::eventually(HANG, || child.try_wait().unwrap().is_some());
    if !finished {
        child.kill().unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        finished,
        "the {name} workload did not finish within {HANG:?} (killed); stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::report(&out.stdout, &out.stderr)
}

#[test]
fn a_workload_with_a_shifted_clock_shares_the_device_timeline() {
    if let Err(why) = time_namespaces_available() {
        println!("SKIPPED: {why}");
        return;
    }
    let sim = Sim::new(&[("SIMGPU_GPUS", "1")]);
    let barrier = sim.dir.path().join("go");
    let mut job = common::SATURATING_JOB.to_vec();
    job.extend(["--report-start", "--duration", "2s", "--start-barrier"]);
    job.push(barrier.to_str().unwrap());
    let plain = sim.workload(&job).spawn().unwrap();
    let shifted = sim.workload_under(SHIFT, &job).spawn().unwrap();
    // Both hold a context on the GPU before either starts.
    let model = sim.model();
    let both_attached = common::eventually(HANG, || {
        model
            .lock()
            .ok()
            .and_then(|mut l| l.snapshot(0).ok())
            .is_some_and(|s| s.contexts.len() == 2)
    });
    std::fs::write(&barrier, b"").unwrap();
    let opened = Instant::now();
    let plain = wait_or_kill(plain, "plain");
    let shifted = wait_or_kill(shifted, "shifted");
    let span_s = opened.elapsed().as_secs_f64();
    assert!(both_attached, "the two workloads never both held a context");
    for (name, report) in [("plain", &plain), ("shifted", &shifted)] {
        assert_eq!(report["errors"], serde_json::json!({}), "{name}: {report}");
        assert!(
            f(report, "iterations") > 0.0,
            "{name} ran nothing: {report}"
        );
        // The event timestamps come in the workload's own clock: no start can lie further
        // back than the run itself.
        let latest_start_s = f(&report["start_latency_us"], "max") / 1e6;
        assert!(
            latest_start_s <= f(report, "elapsed_s"),
            "{name}: a kernel started {latest_start_s} s after it was launched in a run of {} s: {report}",
            f(report, "elapsed_s")
        );
    }
    // One device runs one context at a time: together they got no more GPU time than passed.
    let gpu_s = f(&plain, "kernel_time_s") + f(&shifted, "kernel_time_s");
    assert!(
        gpu_s <= span_s,
        "{gpu_s} s of kernels ran in {span_s} s on one GPU:\nplain {plain}\nshifted {shifted}"
    );
}
