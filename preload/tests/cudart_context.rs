//! A process whose primary context comes from the CUDA runtime's private driver table
//! (`cuGetExportTable`'s CUDART_INTERFACE, as cudart's lazy initialisation does) never
//! calls an exported context-creation function. It still attaches to its lease at its
//! first intercepted GPU call, not only at its first allocation.

mod common;

use std::time::Duration;

use common::*;

/// The ledger's processes of `lease`, by pid.
fn client_pids(m: &Machine, lease: &str) -> Vec<u32> {
    let report = m.control().status().unwrap();
    report
        .usage
        .into_iter()
        .find(|u| u.lease.0 == lease)
        .map_or_else(Vec::new, |u| u.clients.iter().map(|c| c.pid).collect())
}

#[test]
fn a_cudart_like_process_is_registered_from_its_first_launch() {
    let mut m = Machine::start();
    let lease = m.lease("1Gi");
    let dir = tempfile::tempdir().unwrap();
    let (ready, go) = (dir.path().join("ready"), dir.path().join("go"));
    let probe = m
        .probe(
            Some(&lease),
            &[
                "--cudart-like",
                "launch",
                "1",
                "touch",
                ready.to_str().unwrap(),
                "wait",
                go.to_str().unwrap(),
            ],
        )
        .spawn()
        .unwrap();
    let pid = probe.id();
    wait_until("the probe's first launch", Duration::from_secs(30), || {
        ready.exists()
    });
    // Attaching is the watcher's job once started; give it the time a loaded machine needs.
    let mut listed = false;
    wait_until_or_not(Duration::from_secs(10), || {
        listed = client_pids(&m, &lease).contains(&pid);
        listed
    });
    std::fs::write(&go, "").unwrap();
    let s = finish(probe);
    assert_eq!(s.result("launch", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert!(
        listed,
        "pid {pid} launched without allocating and is not a client of its lease: {}",
        s.stderr
    );
}

/// Polls `done` until it holds or `limit` passes (no failure: the caller asserts).
fn wait_until_or_not(limit: Duration, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(50));
    }
}
