//! Container start time through containerd-shim-gpushare-v2 (with a request, so
//! a lease is reserved, the spec edited, the runc shim started behind it and
//! every call forwarded) vs containerd's runc shim alone: `ctr run --rm … true`
//! in one private containerd 1.6. Runs alternate between the two so drift on a
//! shared machine hits both alike. Prints medians and the ratio (target ≤ 1.25×).
//! Measure release binaries: `GPUSHARE_BIN_DIR=target/release`.

use std::time::Instant;

use gpushare_e2e::containerd::{Containerd, ContainerdOptions, RUNC_RUNTIME, RUNTIME};
use gpushare_e2e::*;

const RUNS: usize = 20;

fn main() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let ctr = Containerd::start(
        dir.path(),
        arbiter.config_path(),
        ContainerdOptions::default(),
    );
    let plain = ctr.run_args(RUNC_RUNTIME, &["--rm"], "plain", &["/bin/true"]);
    let shared = ctr.run_args(
        RUNTIME,
        &["--rm", "--annotation", "gpushare.io/memory=1Gi"],
        "shared",
        &["/bin/true"],
    );
    for _ in 0..3 {
        ctr.ok(&plain);
        ctr.ok(&shared);
    }
    let (mut runc_ms, mut gpushare_ms) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        for (args, out) in [(&plain, &mut runc_ms), (&shared, &mut gpushare_ms)] {
            let start = Instant::now();
            ctr.ok(args);
            out.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    assert!(arbiter.leases().is_empty(), "every lease released");
    let (r, g) = (median(runc_ms), median(gpushare_ms));
    println!("container start, containerd 1.6, median of {RUNS} `ctr run --rm … true`:");
    println!("  io.containerd.runc.v2       {r:8.1} ms");
    println!("  io.containerd.gpushare.v2   {g:8.1} ms");
    println!(
        "  ratio                       {:8.3}x (target <= 1.25x)",
        g / r
    );
    write_results(
        "shim-start-overhead",
        serde_json::json!({
            "engine": "containerd 1.6",
            "runs": RUNS,
            "median_ms": {"runc": r, "gpushare": g},
            "runtimes": {"runc": "io.containerd.runc.v2", "gpushare": "io.containerd.gpushare.v2"},
            "ratio": g / r,
        }),
    );
}
