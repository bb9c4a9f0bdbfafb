//! The inference mode (`--requests-per-s`): Poisson arrivals at the asked rate, latencies from
//! each request's scheduled arrival. All figures are simulated GPU time.
//!
//! Tolerances: the arrival times are drawn from the seeded generator, so the number of requests
//! scheduled within the run is fixed by the seed; over 3 s at 200/s (600 expected, Poisson
//! standard deviation 24.5, 4 %) it must land within 12 % (3 sigma) of the rate. Latency can
//! only exceed the kernels' own time; the CPU load of a shared machine only adds to it.

mod common;
use common::{f, Sim};

const SIM: &[(&str, &str)] = &[
    ("SIMGPU_GPUS", "1"),
    ("SIMGPU_SLICE_US", "1000"),
    ("SIMGPU_SWITCH_US", "25"),
];

#[test]
fn poisson_requests_arrive_at_the_rate_and_wait_at_least_their_kernels() {
    let sim = Sim::new(SIM);
    let run = sim.run(&[
        "--requests-per-s",
        "200",
        "--kernels",
        "2",
        "--kernel",
        "fixed:200us",
        "--duration",
        "3s",
        "--seed",
        "5",
    ]);
    assert_eq!(run["errors"], serde_json::json!({}), "{run}");
    let requests = f(&run, "requests");
    assert!(
        (requests / 600.0 - 1.0).abs() <= 0.12,
        "{requests} requests in 3 s at 200/s"
    );
    assert_eq!(f(&run, "iterations"), requests);
    assert_eq!(f(&run, "kernels"), 2.0 * requests);
    let latency = &run["request_latency_ms"];
    assert_eq!(f(latency, "n"), requests, "{run}");
    // Two 200 µs kernels per request: no request completes sooner than 0.4 ms.
    let (p50, p99, max) = (f(latency, "p50"), f(latency, "p99"), f(latency, "max"));
    assert!(p50 >= 0.4, "p50 {p50} ms below the kernels' 0.4 ms");
    assert!(p50 <= p99 && p99 <= max, "{latency}");

    // Another seed draws other arrivals, at the same rate.
    let other = sim.run(&[
        "--requests-per-s",
        "200",
        "--kernels",
        "2",
        "--kernel",
        "fixed:200us",
        "--duration",
        "3s",
        "--seed",
        "6",
    ]);
    let other_requests = f(&other, "requests");
    assert!((other_requests / 600.0 - 1.0).abs() <= 0.12, "{other}");
    assert_ne!(
        other_requests, requests,
        "the seed should move the arrivals"
    );
}

#[test]
fn a_request_count_bounds_the_run() {
    let sim = Sim::new(SIM);
    let run = sim.run(&[
        "--requests-per-s",
        "1000",
        "--kernels",
        "3",
        "--kernel",
        "fixed:100us",
        "--iterations",
        "20",
    ]);
    assert_eq!(run["errors"], serde_json::json!({}), "{run}");
    assert_eq!(f(&run, "requests"), 20.0);
    assert_eq!(f(&run["request_latency_ms"], "n"), 20.0);
    assert!(f(&run["request_latency_ms"], "p50") >= 0.3, "{run}");
}
