//! The token agent's drain against the strict simulated GPU and a real arbiter: a
//! multi-stream graph capture survives a revocation in its middle, and the drain waits
//! for long kernels asleep, not on a spinning core.

mod common;

use common::*;
use gpushare_proto::Priority;
use std::path::Path;
use std::time::{Duration, Instant};

/// A low-priority holder is revoked while it captures a graph that forks to a second
/// stream (the second stream joined the capture by waiting for an event recorded in
/// it: no capture wrapper saw it begin). The drain must leave both streams, and the
/// legacy stream the joined blocking stream forbids, alone: the capture completes, the
/// graph runs once the token comes back, and captures go on working while the token
/// churns between the two jobs.
#[test]
fn a_multi_stream_capture_survives_a_revocation_in_its_middle() {
    // No idle release (a loaded machine may pause the low job between its launch and
    // its capture): the low holder still holds the token when the high job arrives.
    let mut m = Machine::start_with(|c| c.scheduler.idle_us = 1_000_000);
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (joined, revoked) = (file("joined"), file("revoked"));
    let low_job = m
        .probe(
            Some(&low),
            &[
                // Holds the token when the capture begins.
                "launch",
                "1",
                "capture-join-at",
                "4",
                &joined,
                &revoked,
                // More captures and graph launches while the high job comes and goes.
                "capture-join",
                "8",
                "capture-join",
                "8",
                "launch",
                "1",
            ],
        )
        .spawn()
        .unwrap();
    // The high job's first launch revokes the low holder mid-capture, after the fork;
    // then it keeps coming back (each launch revokes whoever holds the token).
    let mut churn = vec![
        "wait", &joined, "launch", "1", "sleep", "100", "touch", &revoked,
    ];
    for _ in 0..10 {
        churn.extend(["launch", "1", "sleep", "10"]);
    }
    let h = run(&mut m.probe(Some(&high), &churn));
    assert_eq!(h.result("launch", 0), "CUDA_SUCCESS", "{}", h.stderr);
    let s = finish(low_job);
    let revocations = m.control().status().unwrap().tokens[0].revocations;
    assert!(revocations >= 1, "no revocation: the test proves nothing");
    assert_eq!(
        s.value("capture-join-at", 0, "joined"),
        "1",
        "the side stream did not join the capture: {:?}",
        s.lines
    );
    assert_eq!(
        s.result("capture-join-at", 0),
        "CUDA_SUCCESS",
        "the capture was broken by the drain ({:?}): {}",
        s.lines,
        s.stderr
    );
    assert_eq!(
        s.value("capture-join-at", 0, "graph_ran"),
        "0",
        "{:?}",
        s.lines
    );
    for n in 0..2 {
        assert_eq!(s.result("capture-join", n), "CUDA_SUCCESS", "{:?}", s.lines);
        assert_eq!(
            s.value("capture-join", n, "graph_ran"),
            "0",
            "{:?}",
            s.lines
        );
    }
    assert_eq!(s.result("launch", 1), "CUDA_SUCCESS", "{:?}", s.lines);
    // The premise: the agent drained while the capture was under way (the origin, the
    // joined stream and the legacy stream left alone).
    let left_alone = s
        .stderr
        .lines()
        .filter_map(|l| l.split_once("drained: ")?.1.split_once(" left alone"))
        .filter_map(|(counts, _)| counts.rsplit(' ').next()?.parse::<u32>().ok())
        .max();
    eprintln!("most streams left alone in one drain: {left_alone:?}");
    assert!(
        left_alone >= Some(2),
        "no drain during the capture: the test proves nothing: {}",
        s.stderr
    );
}

/// The probe's `capture-join` step (which `make gpu-check` runs on real GPUs) is a valid
/// capture under the strict simulated driver on its own: the side stream joins, the
/// capture ends joined, and the graph runs.
#[test]
fn the_capture_join_step_is_a_valid_capture_without_the_library() {
    let m = Machine::start();
    let s = run(&mut m.bare_probe(&["capture-join", "3"]));
    assert_eq!(s.result("capture-join", 0), "CUDA_SUCCESS", "{:?}", s.lines);
    assert_eq!(s.value("capture-join", 0, "joined"), "1", "{:?}", s.lines);
    assert_eq!(
        s.value("capture-join", 0, "graph_ran"),
        "0",
        "{:?}",
        s.lines
    );
}

/// The CPU time (user + system) a thread of `pid` has used, found by its name.
fn thread_cpu(pid: u32, name: &str) -> Duration {
    let tasks = Path::new("/proc").join(pid.to_string()).join("task");
    for task in std::fs::read_dir(&tasks).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.join("stat")).unwrap();
        // Fields after the command's closing parenthesis: state is the 3rd field of the
        // line, utime and stime the 14th and 15th.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<u64> = after
            .split(' ')
            .skip(11)
            .take(2)
            .map(|f| f.parse().unwrap())
            .collect();
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        return Duration::from_secs_f64((fields[0] + fields[1]) as f64 / ticks);
    }
    panic!("no thread {name} in process {pid}");
}

fn wait_for(file: &str) {
    let start = Instant::now();
    while !Path::new(file).exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{file} never appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A holder whose 2 s kernel is running and that launches nothing more returns the token
/// as idle, draining first, for as long as the kernel runs (a revocation drains the same
/// way). Under the default `CU_CTX_SCHED_AUTO` a `cuCtxSynchronize` or a plain event's
/// wait keeps a core busy all that time (the simulated driver spins as the real one does);
/// the agent waits on blocking-sync events instead, asleep.
#[test]
fn the_drain_waits_for_a_long_kernel_without_spinning() {
    let mut m = Machine::start();
    let low = m.lease_of("1Gi", Priority::Low);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (started, slept) = (file("started"), file("slept"));
    // Past the kernel's end its main thread is asleep, not waiting on the GPU.
    let steps =
        format!("launch 1 kernel-ms 2000 touch {started} sleep 2500 touch {slept} sleep 500");
    let job = m
        .probe(Some(&low), &steps.split(' ').collect::<Vec<_>>())
        .spawn()
        .unwrap();
    wait_for(&started);
    let pid = job.id();
    let (cpu_before, wall) = (thread_cpu(pid, "gpushare-token"), Instant::now());
    wait_for(&slept);
    let (cpu, wall) = (
        thread_cpu(pid, "gpushare-token") - cpu_before,
        wall.elapsed(),
    );
    let s = finish(job);
    assert_eq!(s.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", s.stderr);
    eprintln!("the agent used {cpu:?} of CPU in {wall:?} (simulated driver)");
    // Spinning costs the whole drain (most of this window) in CPU; asleep, next to
    // nothing. 30 % leaves room for a loaded machine.
    assert!(
        cpu.as_secs_f64() < 0.3 * wall.as_secs_f64(),
        "the agent used {cpu:?} of CPU in {wall:?}, while draining a 2 s kernel: it spins"
    );
    assert!(
        s.stderr.contains("drained"),
        "the agent did not drain: the test proves nothing: {}",
        s.stderr
    );
}
