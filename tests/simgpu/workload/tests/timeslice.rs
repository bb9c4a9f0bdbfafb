//! The hardware-like time slicing, measured end to end with real processes. All figures are
//! simulated GPU time.
//!
//! Tolerances: the model itself is exact (its slicing is table-tested in simgpu-model); what
//! varies on a loaded 2-core machine is only when processes get the CPU. The workloads keep two
//! iterations queued (`--pipeline 2 --sync event`), so the GPU never waits for a late CPU unless
//! a process is descheduled for more than one whole iteration (10 ms alone, 20 ms shared); the
//! remaining error is the start skew behind the barrier (~1 ms) and the last iteration's drain
//! (<= 20 ms) over a 2 s run: about 1 %.

mod common;
use common::{f, Sim};
use std::time::Duration;

const JOB: &[&str] = common::SATURATING_JOB;

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    JOB.iter().copied().chain(extra.iter().copied()).collect()
}

#[test]
fn one_alone_gets_its_predicted_throughput_and_two_get_about_half_each() {
    // Slices of 1 ms with a 25 us switch: two saturating contexts each get 1/2 * 1000/1025.
    let sim = Sim::new(&[
        ("SIMGPU_GPUS", "1"),
        ("SIMGPU_SLICE_US", "1000"),
        ("SIMGPU_SWITCH_US", "25"),
    ]);

    let alone = sim.run(&args(&["--duration", "2s"]));
    assert_eq!(alone["errors"], serde_json::json!({}), "{alone}");
    let alone_tp = f(&alone, "throughput_iters_per_s");
    // 5 x 2 ms per iteration: 100 iterations/s is what the kernel durations allow.
    assert_eq!(f(&alone, "predicted_iters_per_s"), 100.0);
    let ratio = alone_tp / 100.0;
    assert!(
        (ratio - 1.0).abs() <= 0.03,
        "alone: {alone_tp:.2} it/s, {:.2} % off the prediction",
        (ratio - 1.0) * 100.0
    );

    let barrier = sim.dir.path().join("go");
    let barrier_arg = barrier.to_str().unwrap();
    let a = sim
        .workload(&args(&["--duration", "2s", "--start-barrier", barrier_arg]))
        .spawn()
        .unwrap();
    let b = sim
        .workload(&args(&["--duration", "2s", "--start-barrier", barrier_arg]))
        .spawn()
        .unwrap();
    // Start both only once both hold a context on the GPU (seen through NVML).
    let nvml = sim.nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    let both = common::eventually(Duration::from_secs(20), || {
        gpu.running_compute_processes()
            .map(|p| p.len() == 2)
            .unwrap_or(false)
    });
    std::fs::write(&barrier, b"").unwrap();
    let (a, b) = (common::wait_for_child(a), common::wait_for_child(b));
    assert!(both, "the two workloads never appeared in NVML");
    assert_eq!(
        (&a["errors"], &b["errors"]),
        (&serde_json::json!({}), &serde_json::json!({}))
    );

    let expected_share = 0.5 * 1000.0 / 1025.0;
    let (share_a, share_b) = (
        f(&a, "throughput_iters_per_s") / alone_tp,
        f(&b, "throughput_iters_per_s") / alone_tp,
    );
    eprintln!("simulated: alone {alone_tp:.2} it/s; together {share_a:.3} and {share_b:.3} of it (model: {expected_share:.3})");
    for share in [share_a, share_b] {
        assert!(
            (share - expected_share).abs() <= 0.03,
            "share {share:.3}, expected {expected_share:.3}"
        );
    }
    // The GPU stays busy: together they get all of it but the switch cost.
    assert!(
        (share_a + share_b - 2.0 * expected_share).abs() <= 0.03,
        "{share_a} + {share_b}"
    );
}
