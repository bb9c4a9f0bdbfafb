//! CUDA 13.2's single copies with attributes (`cuMemcpyWithAttributesAsync`,
//! `cuMemcpy3DWithAttributesAsync`, each also `_ptsz`) are GPU work like the other
//! copies: a low-priority process's copies wait while a high-priority job holds the token.

mod common;

use common::*;
use gpushare_proto::Priority;

/// The CUDA version that has these entry points, for the probe and the simulated driver.
const CUDA_13_2: &str = "13020";

#[test]
fn a_low_priority_processs_copies_with_attributes_wait_for_the_token() {
    let mut m = Machine::start();
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    for (mode, stream) in [
        ("attributes", None),
        ("attributes", Some("--ptds")),
        ("attributes-3d", None),
        ("attributes-3d", Some("--ptds")),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        let started = started.to_str().unwrap();
        let mut args = vec!["--cuda-version", CUDA_13_2];
        args.extend(stream);
        // Its gate connected (and the token released again) before the high job starts.
        args.extend([
            "copies", mode, "1", "1Mi", "wait", started, "stamp", "copies", mode, "40", "256Mi",
            "stamp",
        ]);
        let low_job = m
            .probe(Some(&low), &args)
            .env("SIMGPU_CUDA_VERSION", CUDA_13_2)
            .spawn()
            .unwrap();
        let h = run(m
            .probe(
                Some(&high),
                &[
                    "launch",
                    "1",
                    "sleep",
                    "300", // holds the token from here
                    "stamp",
                    "kernel-ms",
                    "1500",
                    "touch",
                    started,
                    "sync",
                ],
            )
            .env("SIMGPU_CUDA_VERSION", CUDA_13_2));
        assert_eq!(h.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", h.stderr);
        let s = finish(low_job);
        let case = format!("{mode} {stream:?}");
        assert_eq!(
            s.result("copies", 1),
            "CUDA_SUCCESS",
            "{case}: {}",
            s.stderr
        );
        // The kernel ends at least 1.5 s after the high job's stamp.
        let high_done = h.number("stamp", 0, "unix_us") + 1_500_000;
        let low_done = s.number("stamp", 1, "unix_us");
        assert!(
            low_done >= high_done,
            "{case}: the low job's 40 copies finished {} ms before the high job's kernel ended (ungated)",
            (high_done - low_done) / 1000
        );
    }
}
