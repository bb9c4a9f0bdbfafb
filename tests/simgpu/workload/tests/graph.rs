//! `--graph`: an iteration captured once into a CUDA graph, then one `cuGraphLaunch` per
//! iteration. The graph's kernels run on the (simulated) GPU and count in the kernel time.
//! Figures are simulated.
//!
//! Tolerances: kernel time and counts are exact (the captured durations are fixed); the
//! elapsed time and latencies are lower bounds only (the kernels run back to back on an
//! otherwise idle simulated GPU; a loaded machine only adds to them).

mod common;
use common::{f, Sim};

const SIM: &[(&str, &str)] = &[
    ("SIMGPU_GPUS", "1"),
    ("SIMGPU_SLICE_US", "1000"),
    ("SIMGPU_SWITCH_US", "25"),
];

#[test]
fn graph_launches_run_the_captured_kernels() {
    let sim = Sim::new(SIM);
    for sync in ["event", "stream", "context"] {
        let run = sim.run(&[
            "--graph",
            "--kernels",
            "5",
            "--kernel",
            "fixed:2ms",
            "--iterations",
            "6",
            "--sync",
            sync,
            "--pipeline",
            "2",
            "--report-start",
        ]);
        assert_eq!(run["errors"], serde_json::json!({}), "{sync}: {run}");
        assert_eq!(f(&run, "iterations"), 6.0, "{run}");
        assert_eq!(f(&run, "kernels"), 30.0, "{run}");
        // Six launches of a 10 ms graph: 60 ms of kernels.
        assert!((f(&run, "kernel_time_s") - 0.060).abs() < 1e-9, "{run}");
        let graph = &run["graph"];
        assert_eq!(
            (f(graph, "kernels"), f(graph, "launches")),
            (5.0, 6.0),
            "{run}"
        );
        assert!((f(graph, "kernel_time_ms") - 10.0).abs() < 1e-9, "{run}");
        // The kernels did run: the GPU needs 60 ms for them, and an iteration waits for its
        // own graph's 10 ms at least.
        assert!(f(&run, "elapsed_s") >= 0.060, "{sync}: {run}");
        assert!(f(&run["latency_ms"], "p50") >= 10.0, "{sync}: {run}");
        // The start probe (recorded after the graph, less the graph's kernel time) has a
        // sample per launch.
        let start = &run["start_latency_us"];
        assert_eq!(f(start, "n"), 6.0, "{run}");
        assert!(f(start, "p50") >= 0.0, "{run}");
    }
}

#[test]
fn a_graph_run_matches_the_plain_run_in_kernel_time() {
    let sim = Sim::new(SIM);
    let args = [
        "--kernels",
        "4",
        "--kernel",
        "fixed:500us",
        "--iterations",
        "10",
    ];
    let plain = sim.run(&args);
    let mut with_graph = vec!["--graph"];
    with_graph.extend(args);
    let graph = sim.run(&with_graph);
    for run in [&plain, &graph] {
        assert_eq!(run["errors"], serde_json::json!({}), "{run}");
    }
    assert_eq!(f(&plain, "kernels"), f(&graph, "kernels"));
    assert_eq!(f(&plain, "kernel_time_s"), f(&graph, "kernel_time_s"));
    assert!(plain["graph"].is_null() && graph["graph"].is_object());
}
