//! Low-priority jobs that lie to the interposer's admission, beside a running
//! high-priority job on the simulated GPU and a real arbiter: a fresh process per long
//! kernel (each starts with no estimates, so its kernel is admitted blind into the high
//! job's window), and a process that takes the token with one gated launch and then
//! queues long kernels through the driver's own `cuLaunchKernel`. The arbiter measures
//! what they do on its own clock — a revoked holder still running past the window it
//! was given beside the active high job — reports it, and stops granting that lease
//! windows.

mod common;

use std::time::{Duration, Instant};

use common::*;
use gpushare_proto::{Priority, StatusReport, ViolationKind};

/// Only to catch a hang.
const T: Duration = Duration::from_secs(20);

/// The shipped grace (500 ms) is longer than a 200 ms kernel or drain: what catches these
/// liars is the release past the window they were given
/// (`scheduler.window_overrun_grace_ms`), and the arbiter's own measurement of each
/// process's GPU time through NVML (the bypass check).
fn machine() -> Machine {
    Machine::start_measured_with(|c| {
        assert!(c.scheduler.revoke_grace_ms > 200, "the shipped grace");
        // Longer than the test: only the high job going quiet ends it here.
        c.scheduler.overrun_penalty_ms = 60_000;
        c.scheduler.bypass_check = true;
    })
}

/// The high job: 5 ms kernels with 5 ms gaps, `iterations` times; `started` is touched
/// after the first 50 (its rhythm is known by then), and it stamps its end.
fn high_job_args(started: &str, iterations: usize) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    let iteration = ["kernel-ms", "5", "sync", "sleep", "5"];
    for i in 0..iterations {
        if i == 50 {
            args.extend(["touch", started].map(String::from));
        }
        args.extend(iteration.map(String::from));
    }
    args.push("stamp".into());
    args
}

/// A low-priority lease (the liar) and a running high-priority job.
struct Scene {
    m: Machine,
    liar: String,
    high_job: std::process::Child,
    /// Touched once the high job's rhythm is known.
    started: String,
    _dir: tempfile::TempDir,
}

fn beside_a_high_job() -> Scene {
    let mut m = machine();
    let liar = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started").to_str().unwrap().to_owned();
    let high_args = high_job_args(&started, 300);
    let high_refs: Vec<&str> = high_args.iter().map(String::as_str).collect();
    let high_job = m.probe(Some(&high), &high_refs).spawn().unwrap();
    Scene {
        m,
        liar,
        high_job,
        started,
        _dir: dir,
    }
}

fn overruns_of(status: &StatusReport, lease: &str) -> usize {
    status
        .violations
        .iter()
        .filter(|v| {
            v.kind == ViolationKind::Overrun
                && v.lease.as_ref().map(|l| l.0.as_str()) == Some(lease)
        })
        .count()
}

/// Polls the arbiter's status until the lease's overrun is listed; how long it took.
fn wait_for_overrun(m: &Machine, lease: &str) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < T {
        if overruns_of(&m.control().status().unwrap(), lease) > 0 {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// One gated 1 µs launch takes the token, then 10 × 20 ms kernels go
/// to the driver past the gate. The drain ran as the process's token time, so nothing
/// reported it.
#[test]
fn launches_past_the_gate_after_taking_the_token_are_reported_as_an_overrun() {
    let scene = beside_a_high_job();
    let (m, liar, started) = (&scene.m, scene.liar.as_str(), scene.started.as_str());
    let s = run(&mut m.probe(
        Some(liar),
        &[
            "wait",
            started,
            "launch",
            "1",
            "raw-launch",
            "10",
            "20",
            "sync",
        ],
    ));
    assert_eq!(s.result("raw-launch", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert!(
        s.value("raw-launch", 0, "via").contains("libcuda"),
        "the liar's launches must bypass the interposer: {:?}",
        s.lines
    );
    let listed = wait_for_overrun(m, liar);
    let h = finish(scene.high_job);
    assert_eq!(h.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", h.stderr);
    eprintln!("overrun listed {listed:?} after the liar's process ended");
    assert!(
        listed.is_some(),
        "no overrun reported for the liar's lease: {:?}",
        m.control().status().unwrap().violations
    );
}

/// A new process per 200 ms kernel; each started with no estimates, so
/// each kernel was admitted blind into the high job's window. After the first overran,
/// the next process of the lease waits for the high job to go quiet.
#[test]
fn a_fresh_process_per_long_kernel_runs_only_after_the_high_job_once_its_lease_overran() {
    let scene = beside_a_high_job();
    let (m, liar, started) = (&scene.m, scene.liar.as_str(), scene.started.as_str());
    let kernel = ["kernel-ms", "200", "sync", "stamp"];
    let first = run(&mut m.probe(
        Some(liar),
        &["wait", started, "kernel-ms", "200", "sync", "stamp"],
    ));
    assert_eq!(
        first.result("kernel-ms", 0),
        "CUDA_SUCCESS",
        "{}",
        first.stderr
    );
    let second_job = m.probe(Some(liar), &kernel).spawn().unwrap();
    let listed = wait_for_overrun(m, liar);
    let second = finish(second_job);
    let h = finish(scene.high_job);
    let (high_done, second_done) = (
        h.number("stamp", 0, "unix_us"),
        second.number("stamp", 0, "unix_us"),
    );
    assert!(
        second_done >= high_done,
        "the lease's next process ran its 200 ms kernel beside the active high job, \
         ending {} ms before the high job did",
        high_done.saturating_sub(second_done) / 1000
    );
    assert!(
        listed.is_some(),
        "the first process's blind kernel was not reported: {:?}",
        m.control().status().unwrap().violations
    );
}

/// The process's state letter in /proc/<pid>/stat ('T': stopped).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// One gated launch takes the token, which goes back once the process is idle; then
/// 200 ms kernels go to the driver past the gate with no token at all, so no drain or
/// window of its own is ever judged. Only the arbiter's own measurement sees them
/// (NVML's per-process busy time against the token's account): reported `ungated`
/// while the high job runs, and the process stopped until the high job is quiet.
#[test]
fn launches_past_the_gate_after_the_token_went_back_are_reported_and_stopped() {
    let scene = beside_a_high_job();
    let (m, liar, started) = (&scene.m, scene.liar.as_str(), scene.started.as_str());
    let mut steps = vec!["wait", started, "launch", "1", "sleep", "50", "stamp"];
    for _ in 0..10 {
        steps.extend(["raw-launch", "1", "200", "sync"]);
    }
    steps.push("stamp");
    let liar_job = m.probe(Some(liar), &steps).spawn().unwrap();
    let pid = liar_job.id();
    let start = Instant::now();
    let (mut reported, mut stopped) = (false, false);
    while !(reported && stopped) && start.elapsed() < T {
        reported |= m.control().status().unwrap().violations.iter().any(|v| {
            v.kind == ViolationKind::Ungated
                && v.pid == pid
                && v.lease.as_ref().map(|l| l.0.as_str()) == Some(liar)
        });
        stopped |= process_state(pid) == Some('T');
        std::thread::sleep(Duration::from_millis(10));
    }
    let h = finish(scene.high_job);
    let s = finish(liar_job);
    assert_eq!(h.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", h.stderr);
    assert!(
        reported,
        "the liar's launches past the gate were not reported: {:?}",
        m.control().status().unwrap().violations
    );
    assert!(stopped, "the liar was never stopped beside the high job");
    // Continued once the high job was quiet: it finished its kernels.
    assert_eq!(s.result("raw-launch", 9), "CUDA_SUCCESS", "{}", s.stderr);
    assert!(s.value("raw-launch", 0, "via").contains("libcuda"));
}
