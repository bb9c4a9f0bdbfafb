//! Container start time: `docker run --rm IMAGE true` through gpushare-runc (with a
//! request, so a lease is reserved, the spec edited, hooks run) vs plain runc, in
//! one private dockerd. Runs alternate between the two so drift on a shared
//! machine hits both alike. Prints medians and the ratio (target ≤ 1.25×).

use std::time::Instant;

use gpushare_e2e::*;

const RUNS: usize = 20;

fn main() {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let docker = Dockerd::start(dir.path(), arbiter.config_path());
    let plain = ["run", "--rm", "--runtime", "runc", IMAGE, "true"];
    let shared = [
        "run",
        "--rm",
        "--runtime",
        "gpushare",
        "-e",
        "GPUSHARE_MEMORY=1Gi",
        IMAGE,
        "true",
    ];
    for _ in 0..3 {
        docker.ok(&plain);
        docker.ok(&shared);
    }
    let (mut runc_ms, mut gpushare_ms) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        for (args, out) in [(&plain[..], &mut runc_ms), (&shared[..], &mut gpushare_ms)] {
            let start = Instant::now();
            docker.ok(args);
            out.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    assert!(arbiter.leases().is_empty(), "every lease released");
    let (r, g) = (median(runc_ms), median(gpushare_ms));
    println!("container start, docker 20.10, median of {RUNS} `docker run --rm … true`:");
    println!("  runc            {r:8.1} ms");
    println!("  gpushare-runc   {g:8.1} ms");
    println!("  ratio           {:8.3}x (target <= 1.25x)", g / r);
    write_results(
        "start-overhead",
        serde_json::json!({
            "engine": "docker 20.10",
            "runs": RUNS,
            "median_ms": {"runc": r, "gpushare": g},
            "runtimes": {"runc": "runc", "gpushare": "gpushare-runc"},
            "ratio": g / r,
        }),
    );
}
