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
