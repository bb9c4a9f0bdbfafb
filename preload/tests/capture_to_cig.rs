//! CUDA 13.2's capture into a graphics command list (`cuStreamBeginCaptureToCig`) is a
//! capture to the gate: a high-priority holder's idle release must not synchronise the
//! capturing context (the driver invalidates the capture) while it lasts.

mod common;

use common::*;
use gpushare_proto::Priority;

#[test]
fn a_capture_to_cig_survives_a_high_priority_holders_idle_time() {
    let mut m = Machine::start();
    let lease = m.lease_of("1Gi", Priority::High);
    for stream in [None, Some("--ptds")] {
        let mut args = vec!["--cuda-version", "13020"];
        args.extend(stream);
        args.extend([
            "launch",
            "1",
            "cig-capture-begin",
            // ~170 idle thresholds (300 µs) with nothing launched.
            "sleep",
            "50",
            "capture-launch",
            "3",
            "sleep",
            "50",
            "cig-capture-end",
        ]);
        let s = run(m
            .probe(Some(&lease), &args)
            .env("SIMGPU_CUDA_VERSION", "13020"));
        assert_eq!(
            s.result("cig-capture-begin", 0),
            "CUDA_SUCCESS",
            "{stream:?}: {}",
            s.stderr
        );
        assert_eq!(s.result("capture-launch", 0), "CUDA_SUCCESS", "{stream:?}");
        assert_eq!(
            s.result("cig-capture-end", 0),
            "CUDA_SUCCESS",
            "{stream:?}: the capture was invalidated (the agent synchronised it): {}",
            s.stderr
        );
    }
}
