//! `--report-start`: how long an iteration's first kernel waited before it ran, from the
//! simulated driver's event timestamps. Figures are simulated.

mod common;
use common::{f, Sim};

#[test]
fn start_latency_is_small_alone_and_grows_behind_a_saturating_neighbour() {
    // 1 ms slices: a neighbour that always has work makes the job wait up to a slice per start.
    let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_SLICE_US", "1000")]);
    let job = [
        "--kernel",
        "fixed:100us",
        "--kernels",
        "5",
        "--gap",
        "2ms",
        "--sync",
        "event",
        "--iterations",
        "100",
        "--report-start",
    ];
    let alone = sim.run(&job);
    assert_eq!(alone["errors"], serde_json::json!({}), "{alone}");
    let start = &alone["start_latency_us"];
    assert_eq!(start["n"], 100, "{alone}");
    let alone_p50 = f(start, "p50");
    assert!(
        alone_p50 < 500.0,
        "alone the first kernel starts at once; p50 {alone_p50} us"
    );

    let mut neighbour = sim
        .workload(&[
            "--kernel",
            "fixed:2ms",
            "--kernels",
            "2",
            "--sync",
            "event",
            "--pipeline",
            "2",
            "--duration",
            "5s",
        ])
        .spawn()
        .unwrap();
    let shared = sim.run(&job);
    let _ = neighbour.kill();
    let _ = neighbour.wait();
    let shared_p50 = f(&shared["start_latency_us"], "p50");
    eprintln!("simulated p50 start latency: alone {alone_p50} us, shared {shared_p50} us");
    // Behind a neighbour holding the GPU, the job waits for the rest of its slice (up to 1 ms
    // plus the switch): on a median, well above the alone case.
    assert!(
        shared_p50 > 200.0 && shared_p50 > 4.0 * alone_p50,
        "p50 start latency {shared_p50} us shared vs {alone_p50} us alone"
    );

    let without = sim.run(&job[..job.len() - 1]);
    assert!(
        without.get("start_latency_us").is_none(),
        "only asked for: {without}"
    );
}
