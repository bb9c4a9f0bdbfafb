//! A stream of a green context (`cuGreenCtxStreamCreate`, CUDA 12.5) is the process's
//! work like any created stream: registered when created, so its launches are bounded
//! per stream from the first one.

mod common;

use common::*;
use gpushare_proto::Priority;

/// With a launch-ahead bound of 1, a second launch into a green context's stream waits
/// for the stream's 500 ms kernel: the stream is known to the gate (an unknown stream
/// has no ring, and its launches are not bounded at all).
#[test]
fn a_green_context_stream_is_bounded_like_any_created_stream() {
    let mut m = Machine::start_with(|c| c.scheduler.launch_ahead = 1);
    let lease = m.lease_of("1Gi", Priority::Low);
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "--cuda-version",
            "12050",
            "launch",
            "1",
            "green-launch-ahead",
            "500",
        ],
    ));
    assert_eq!(
        s.result("green-launch-ahead", 0),
        "CUDA_SUCCESS",
        "{}",
        s.stderr
    );
    let same_us = s.number("green-launch-ahead", 0, "same_stream_launch_us");
    assert!(
        same_us >= 250_000,
        "a launch behind the green stream's 500 ms kernel went after {same_us} µs: the stream was not registered, no bound: {}",
        s.stderr
    );
}

/// A low-priority holder that launched a 3 s kernel into a green context's stream while
/// it held the token unbounded (no high-priority job yet: the launch took the fast path,
/// so only the stream's creation could have recorded it) is revoked: its drain waits for
/// that kernel, so it is still draining past the (shortened) grace and reported overdue.
/// A drain that did not know the stream — non-blocking, in the green context's own
/// `CUcontext` — would wait only for the primary context's legacy stream and release at
/// once, the green kernel still running beside the high job's.
#[test]
fn a_revoked_holder_drains_a_green_context_stream_it_launched_into_unbounded() {
    let mut m = Machine::start_with(|c| {
        c.scheduler.revoke_grace_ms = 200;
        c.scheduler.idle_us = 1_000_000;
    });
    let Revoked {
        high: h,
        low: s,
        token,
    } = revoke_mid_work(
        &mut m,
        "1Gi",
        &["--cuda-version", "12050"],
        &["green-kernel-ms", "3000"],
    );
    assert_eq!(h.result("launch", 0), "CUDA_SUCCESS", "{}", h.stderr);
    assert_eq!(
        s.result("green-kernel-ms", 0),
        "CUDA_SUCCESS",
        "{}",
        s.stderr
    );
    assert!(
        token.revocations >= 1,
        "no revocation: the test proves nothing: {token:?}"
    );
    assert!(
        token.overdue >= 1,
        "the revoked holder released with its green stream's 3 s kernel still running: {token:?}\nlow: {}",
        s.stderr
    );
}
