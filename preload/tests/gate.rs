//! The launch gate against the strict simulated GPU and a real arbiter: CUDA graph
//! captures survive the token agent's drains, launch-ahead is bounded per stream, and
//! every entry point of the driver leads through the wrappers.

mod common;

use common::*;
use gpushare_proto::Priority;

/// Every capture mode a program may begin with (PyTorch's default is global).
const MODES: &[&str] = &["global", "thread-local", "relaxed"];

/// A high-priority holder goes idle while it captures a graph: the idle release must
/// neither drain with `cuCtxSynchronize` (which the driver refuses during a capture,
/// invalidating it) nor count the capture's time as idle.
#[test]
fn a_capture_survives_a_high_priority_holders_idle_time() {
    let mut m = Machine::start();
    let lease = m.lease_of("1Gi", Priority::High);
    for mode in MODES {
        let s = run(&mut m.probe(
            Some(&lease),
            &[
                "launch",
                "1",
                "capture-begin",
                mode,
                // ~170 idle thresholds (300 µs) with nothing launched.
                "sleep",
                "50",
                "capture-launch",
                "3",
                "sleep",
                "50",
                "capture-end",
            ],
        ));
        assert_eq!(s.result("capture-begin", 0), "CUDA_SUCCESS", "{mode}");
        assert_eq!(
            s.result("capture-launch", 0),
            "CUDA_SUCCESS",
            "{mode}: {}",
            s.stderr
        );
        assert_eq!(
            s.result("capture-end", 0),
            "CUDA_SUCCESS",
            "{mode}: the capture was invalidated: {}",
            s.stderr
        );
        assert_eq!(s.value("capture-end", 0, "graph_ran"), "0", "{mode}");
    }
}

/// A low-priority holder is revoked (a high-priority job wants the GPU) while it
/// captures: its agent drains around the capture and releases, the capture completes,
/// and nobody is left waiting.
#[test]
fn a_revoked_low_priority_holder_drains_around_its_capture() {
    let mut m = Machine::start();
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    for mode in MODES {
        let dir = tempfile::tempdir().unwrap();
        let (capturing, revoked) = (dir.path().join("capturing"), dir.path().join("revoked"));
        let (capturing, revoked) = (capturing.to_str().unwrap(), revoked.to_str().unwrap());
        let low_job = m
            .probe(
                Some(&low),
                &[
                    "launch",
                    "1",
                    "capture-begin",
                    mode,
                    "capture-launch",
                    "2",
                    "touch",
                    capturing,
                    "wait",
                    revoked,
                    "capture-launch",
                    "2",
                    "capture-end",
                    // Wants the token again afterwards, and gets it.
                    "launch",
                    "1",
                ],
            )
            .spawn()
            .unwrap();
        // The high job's first launch revokes the low holder mid-capture.
        let h = run(&mut m.probe(
            Some(&high),
            &[
                "wait", capturing, "launch", "1", "sleep", "100", "touch", revoked,
            ],
        ));
        assert_eq!(h.result("launch", 0), "CUDA_SUCCESS");
        let s = finish(low_job);
        assert_eq!(
            s.result("capture-end", 0),
            "CUDA_SUCCESS",
            "{mode}: the capture was invalidated: {}",
            s.stderr
        );
        assert_eq!(s.value("capture-end", 0, "graph_ran"), "0", "{mode}");
        assert_eq!(s.result("launch", 1), "CUDA_SUCCESS", "{mode}");
    }
}

/// With a launch-ahead bound of 1, a launch on one stream does not wait for another
/// stream's kernel: the bound is per stream, not a process-wide serialisation (which
/// loses copy/compute overlap and can deadlock producer/consumer streams).
#[test]
fn launch_ahead_is_bounded_per_stream() {
    let mut m = Machine::start_with(|c| c.scheduler.launch_ahead = 1);
    let lease = m.lease_of("1Gi", Priority::Low);
    let s = run(&mut m.probe(Some(&lease), &["launch", "1", "two-streams", "500"]));
    assert_eq!(s.result("two-streams", 0), "CUDA_SUCCESS", "{}", s.stderr);
    let waited_us = s.number("two-streams", 0, "second_launch_us");
    assert!(
        waited_us < 250_000,
        "the second stream's launch waited {waited_us} µs for the first stream's 500 ms kernel"
    );
    // The bound is in force: a second launch into the first stream waits for its kernel.
    let same_us = s.number("two-streams", 0, "same_stream_launch_us");
    assert!(
        same_us >= 250_000,
        "a launch behind the same stream's 500 ms kernel went after {same_us} µs: no bound"
    );
}

/// `cuGetProcAddress_v2_ptsz` — what cuda.h's `cuGetProcAddress` is in a
/// per-thread-default-stream build — leads to the wrappers like `_v2` does: an
/// allocation resolved through it is charged (and refused over the quota).
#[test]
fn the_per_thread_builds_get_proc_address_leads_to_the_wrappers() {
    let mut m = Machine::start();
    let lease = m.lease("1Gi");
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "ptsz-procaddr-alloc",
            "600Mi",
            "ptsz-procaddr-alloc",
            "600Mi",
        ],
    ));
    assert!(
        s.value("ptsz-procaddr-alloc", 0, "via")
            .starts_with("libgpushare"),
        "{:?}",
        s.lines
    );
    assert_eq!(
        s.result("ptsz-procaddr-alloc", 0),
        "CUDA_SUCCESS",
        "{}",
        s.stderr
    );
    assert_eq!(
        s.result("ptsz-procaddr-alloc", 1),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "uncharged: the allocation went around the quota"
    );
}

/// A high-priority process never waits for a grant, so it must not wait for an arbiter
/// that went away before its first launch either: the class its ledger learned lets it
/// run (its loss policy), where before the first launch waited until the arbiter came back.
#[test]
fn a_high_priority_first_launch_runs_while_the_arbiter_is_away() {
    let mut m = Machine::start();
    let lease = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let (ready, go) = (dir.path().join("ready"), dir.path().join("go"));
    let child = m
        .probe(
            Some(&lease),
            &[
                "alloc",
                "1Mi",
                "touch",
                ready.to_str().unwrap(),
                "wait",
                go.to_str().unwrap(),
                "launch",
                "1",
            ],
        )
        .spawn()
        .unwrap();
    wait_until(
        "the probe's ledger attached",
        std::time::Duration::from_secs(20),
        || ready.exists(),
    );
    m.kill_arbiter();
    std::fs::write(&go, b"").unwrap();
    let s = finish_within(
        child,
        std::time::Duration::from_secs(20),
        "the high-priority launch waited for the arbiter",
    );
    assert_eq!(s.result("launch", 0), "CUDA_SUCCESS", "{}", s.stderr);
}

/// The agent waits for the work of every context the process made, not only the context
/// its first launching thread used: a 3 s kernel in a second context keeps a revoked
/// low-priority holder draining past the (shortened) grace, so it is reported overdue.
/// Draining only the first context released at once, with the kernel still running.
#[test]
fn a_revoked_holder_drains_every_context() {
    let mut m = Machine::start_with(|c| c.scheduler.revoke_grace_ms = 200);
    let Revoked {
        high: h,
        low: s,
        token,
    } = revoke_mid_work(&mut m, "2Gi", &[], &["ctx-create", "kernel-ms", "3000"]);
    assert_eq!(h.result("launch", 0), "CUDA_SUCCESS", "{}", h.stderr);
    assert_eq!(s.result("ctx-create", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(s.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert!(
        token.overdue >= 1,
        "the revoked holder released before its second context's 3 s kernel finished: {token:?}"
    );
}

/// A driver may answer `cuGetProcAddress` with a function other than its export of the
/// variant the interposer's table computes (a newer ABI variant the table does not know).
/// Calling it through the old variant's wrapper would use the wrong ABI, so the answer
/// passes through untouched and the mismatch is logged once. (The simulated driver's test
/// hook answers `cuMemAlloc` with a function that is not its `cuMemAlloc_v2`.)
#[test]
fn an_answer_that_is_not_the_drivers_export_passes_through() {
    let mut m = Machine::start();
    let lease = m.lease("1Gi");
    let s = run(&mut m.probe(Some(&lease), &["procaddr", "cuMemAlloc", "12040", "0"]));
    assert!(
        s.value("procaddr", 0, "via").starts_with("libgpushare"),
        "the driver's own export is wrapped: {:?}",
        s.lines
    );
    let s = run(m
        .probe(
            Some(&lease),
            &[
                "procaddr",
                "cuMemAlloc",
                "12040",
                "0",
                "procaddr",
                "cuMemAlloc",
                "12040",
                "0",
            ],
        )
        .env("SIMGPU_UNEXPORTED_VARIANT", "cuMemAlloc"));
    for n in 0..2 {
        let via = s.value("procaddr", n, "via");
        assert!(via.starts_with("libcuda"), "wrapped anyway: {via}");
    }
    assert_eq!(
        s.stderr.matches("passed through unwrapped").count(),
        1,
        "logged once: {}",
        s.stderr
    );
}

/// Copies used to go ungated — 40 device-to-device copies of 256 MiB
/// ran while a high-priority job held the token. Now a low-priority process's copies
/// (host-synchronous `cuMemcpyDtoD` and stream-ordered `cuMemcpyDtoDAsync`) and memsets
/// (`cuMemsetD32`, `cuMemsetD32Async`) wait for the token like its launches: none
/// completes while the high job's 1.5 s kernel holds it, and all of them run once it is
/// released.
#[test]
fn a_low_priority_processs_copies_wait_while_a_high_priority_job_holds_the_token() {
    let mut m = Machine::start();
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    for mode in ["sync", "async", "memset", "memset-async"] {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        let started = started.to_str().unwrap();
        let low_job = m
            .probe(
                Some(&low),
                &[
                    // Its gate connected (and the token released again) before the test.
                    "copies", mode, "1", "1Mi", "wait", started, "stamp", "copies", mode, "40",
                    "256Mi", "stamp",
                ],
            )
            .spawn()
            .unwrap();
        let h = run(&mut m.probe(
            Some(&high),
            &[
                "launch",
                "1",
                "sleep",
                "300",
                // Holds the token from this launch until its kernel ends and it goes idle.
                // The kernel ends at least 1.5 s after this stamp (a stamp taken after
                // `sync` returns can be later than the low job's, by the time its thread
                // takes to wake, while the agent releases the token as soon as it ends).
                "stamp",
                "kernel-ms",
                "1500",
                "touch",
                started,
                "sync",
            ],
        ));
        assert_eq!(h.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", h.stderr);
        let s = finish(low_job);
        assert_eq!(
            s.result("copies", 1),
            "CUDA_SUCCESS",
            "{mode}: {}",
            s.stderr
        );
        let high_done = h.number("stamp", 0, "unix_us") + 1_500_000;
        let (low_began, low_done) = (
            s.number("stamp", 0, "unix_us"),
            s.number("stamp", 1, "unix_us"),
        );
        eprintln!(
            "{mode}: the low job's copies began {} ms before the high job's kernel ended and finished {} ms after",
            high_done.saturating_sub(low_began) / 1000,
            low_done.saturating_sub(high_done) / 1000
        );
        assert!(
            low_done >= high_done,
            "{mode}: the low job's 40 copies finished {} ms before the high job's kernel ended (ungated)",
            (high_done - low_done) / 1000
        );
    }
}

/// The other way around the gate: a `cuLaunchKernel` taken straight from libcuda's
/// symbol table (`dlopen` + `dlsym`, no `cuGetProcAddress`) must not bypass the gate.
/// The exported `dlsym` hands out the wrapper for every wrapped `cu*` name, whatever the
/// handle: such launches of a low-priority process wait while a high-priority job holds
/// the token. (`dlvsym` finds no `cu*` symbol in a driver library with a version table,
/// as libcuda has: it asks for a version the unversioned exports do not have.)
#[test]
fn launches_resolved_with_dlsym_wait_for_the_token() {
    let mut m = Machine::start();
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let started = started.to_str().unwrap();
    let low_job = m
        .probe(
            Some(&low),
            &[
                "dlsym-launch",
                "1",
                "wait",
                started,
                "dlsym-launch",
                "20",
                "stamp",
            ],
        )
        .spawn()
        .unwrap();
    let h = run(&mut m.probe(
        Some(&high),
        &[
            "launch",
            "1",
            "sleep",
            "300",
            // Its kernel ends at least 1 s after this stamp.
            "stamp",
            "kernel-ms",
            "1000",
            "touch",
            started,
            "sync",
        ],
    ));
    let s = finish(low_job);
    assert_eq!(s.result("dlsym-launch", 1), "CUDA_SUCCESS", "{}", s.stderr);
    let (high_done, low_done) = (
        h.number("stamp", 0, "unix_us") + 1_000_000,
        s.number("stamp", 0, "unix_us"),
    );
    assert!(
        low_done >= high_done,
        "the low job's launches finished {} ms before the high job's kernel ended",
        (high_done - low_done) / 1000
    );
    assert!(
        s.value("dlsym-launch", 1, "via").starts_with("libgpushare"),
        "{:?}",
        s.lines
    );
}
