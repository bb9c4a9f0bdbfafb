//! kubelet's `Allocate` through gpushare-kube: the test kubelet (tests/cri) calls the
//! real plugin over gRPC on its unix socket, the plugin asks a real arbiter (a
//! separate process, declared GPUs) for a grant and answers. Timed: the whole
//! `allocate` call as kubelet makes it (choosing ids, the gRPC round trip, the
//! plugin's arbiter connection and grant). Between calls, untimed, the pod is
//! removed and its grant released, so the GPU never fills. For comparison, the
//! same grant asked of the arbiter directly (its own share of the time), and what
//! the new arbiter connection the plugin opens per call costs.
//!
//! Target: p99 ≤ 5 ms (kubelet admits a pod's containers one Allocate at a time).
//! `GPUSHARE_BENCH_RESULTS=dir` writes the figures to `dir/kube-allocate.json`;
//! `GPUSHARE_BENCH_N` overrides the sample count (default 1000).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{Node, GIB};
use gpushare_proto::grant::{GrantAmount, GrantId, GrantRequest};
use gpushare_proto::ControlClient;
use gpushare_testkit::results::write_results;
use gpushare_testkit::stats::percentile;
use gpushare_types::kubernetes::{GRANT_MEMORY_ANNOTATION, MEMORY_RESOURCE};

/// Units per Allocate: a typical small job's memory.
const UNITS: usize = 4;
const TARGET_P99_MS: f64 = 5.0;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    // `cargo bench` passes `--bench`; a filter that is not this bench skips it.
    if let Some(filter) = std::env::args().skip(1).find(|a| !a.starts_with("--")) {
        if !"allocate".contains(&filter) {
            return;
        }
    }
    let samples: usize = std::env::var("GPUSHARE_BENCH_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    let node = Node::start_logging(2, "16Gi", "warn", |_| {});
    node.wait_healthy(MEMORY_RESOURCE, 32);
    let mut arbiter = node.arbiter.client();
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let pod = format!("uid-{i}");
        let start = Instant::now();
        let allocation = node
            .kubelet
            .allocate(&pod, "bench", &pod, "main", &[(MEMORY_RESOURCE, UNITS)])
            .unwrap_or_else(|e| panic!("Allocate {i}: {e}\nplugin log:\n{}", node.plugin_log()));
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        node.kubelet.remove_pod(&pod);
        let grant = GrantId(allocation.annotations[GRANT_MEMORY_ANNOTATION].clone());
        assert!(arbiter.release_grant(grant).unwrap());
    }
    let allocate = summary(ms);
    // The arbiter's own share: the same grant asked directly on one kept
    // connection, so the plugin's and gRPC's part is the difference.
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let request = GrantRequest {
            amount: GrantAmount::Memory {
                bytes: UNITS as u64 * GIB,
            },
            device_ids: (0..UNITS).map(|u| format!("memory-{u}")).collect(),
        };
        let start = Instant::now();
        let grant = arbiter
            .grant(request)
            .unwrap_or_else(|e| panic!("grant {i}: {e}"));
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        assert!(arbiter.release_grant(grant.id).unwrap());
    }
    let arbiter_grant = summary(ms);
    // What the plugin's connection per arbiter call adds.
    let mut ms = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = Instant::now();
        let client = ControlClient::connect(&node.arbiter.control_socket(), CONNECT_TIMEOUT);
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        drop(client.unwrap());
    }
    let connect = summary(ms);
    println!(
        "kube allocate ({samples} × {UNITS} units of {MEMORY_RESOURCE}) through kubelet's gRPC and the plugin: {allocate}"
    );
    println!("  of which the arbiter's grant, asked directly: {arbiter_grant}");
    println!("  of which a new arbiter connection (connect and hello): {connect}");
    println!("  target: p99 ≤ {TARGET_P99_MS} ms");
    write_results(
        "kube-allocate",
        serde_json::json!({
            "samples": samples,
            "units": UNITS,
            "p50_ms": allocate.p50,
            "p99_ms": allocate.p99,
            "max_ms": allocate.max,
            "target_p99_ms": TARGET_P99_MS,
            "arbiter_grant": {
                "p50_ms": arbiter_grant.p50,
                "p99_ms": arbiter_grant.p99,
                "max_ms": arbiter_grant.max,
            },
            "arbiter_connect": {
                "p50_ms": connect.p50,
                "p99_ms": connect.p99,
                "max_ms": connect.max,
            },
        }),
    );
}

struct Summary {
    p50: f64,
    p99: f64,
    max: f64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            self.p50, self.p99, self.max
        )
    }
}

fn summary(mut ms: Vec<f64>) -> Summary {
    ms.sort_by(f64::total_cmp);
    Summary {
        p50: percentile(&ms, 50.0),
        p99: percentile(&ms, 99.0),
        max: ms[ms.len() - 1],
    }
}
