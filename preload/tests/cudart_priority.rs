//! A high-priority process whose primary context the CUDA runtime made past every
//! wrapper (the driver's private CUDART_INTERFACE table) is high priority from its very
//! first launch: the low-priority holder beside it is revoked for that launch.

mod common;

use std::time::Duration;

use common::*;
use gpushare_proto::{Priority, TokenStatus};

fn token(m: &Machine) -> TokenStatus {
    m.control()
        .status()
        .unwrap()
        .tokens
        .into_iter()
        .next()
        .unwrap()
}

#[test]
fn a_cudart_like_high_priority_process_revokes_the_low_holder_at_its_first_launch() {
    // The low job holds the token through its long kernel and the idle time after it.
    let mut m = Machine::start_with(|c| c.scheduler.idle_us = 1_000_000);
    let low = m.lease_of("1Gi", Priority::Low);
    let high = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (holds, launched, go) = (file("holds"), file("launched"), file("go"));
    let low_job = m
        .probe(
            Some(&low),
            &[
                "launch",
                "1",
                "touch",
                &holds,
                "kernel-ms",
                "4000",
                "sleep",
                "500",
            ],
        )
        .spawn()
        .unwrap();
    wait_until(
        "the low job's first launch",
        Duration::from_secs(30),
        || std::path::Path::new(&holds).exists(),
    );
    let before = token(&m);
    assert!(
        before.holders.iter().any(|h| h.lease.0 == low),
        "the low job does not hold the token: the test proves nothing: {before:?}"
    );
    let high_job = m
        .probe(
            Some(&high),
            &[
                "--cudart-like",
                "launch",
                "1",
                "touch",
                &launched,
                "wait",
                &go,
            ],
        )
        .spawn()
        .unwrap();
    wait_until(
        "the high job's first launch",
        Duration::from_secs(30),
        || std::path::Path::new(&launched).exists(),
    );
    // The revocation follows the high job's `Want`, sent once its launch is queued.
    let mut after = token(&m);
    let start = std::time::Instant::now();
    while after.revocations == before.revocations && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
        after = token(&m);
    }
    std::fs::write(&go, "").unwrap();
    let h = finish(high_job);
    let s = finish(low_job);
    assert_eq!(h.result("launch", 0), "CUDA_SUCCESS", "{}", h.stderr);
    assert_eq!(s.result("kernel-ms", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert!(
        after.revocations > before.revocations,
        "the high job's first launch did not revoke the low holder (its class was not known): {after:?}\nhigh: {}",
        h.stderr
    );
}

/// The class a cudart-like process learns at its first stream creation (its first
/// intercepted call: no creation wrapper saw its context) lets its first launch run
/// while the arbiter is away, as a high-priority process's launch does; a process that
/// never attached does not know its class and waits for the arbiter to come back.
#[test]
fn a_cudart_like_high_priority_first_launch_runs_while_the_arbiter_is_away() {
    let mut m = Machine::start();
    let lease = m.lease_of("1Gi", Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (ready, go) = (file("ready"), file("go"));
    let child = m
        .probe(
            Some(&lease),
            &[
                "--cudart-like",
                "stream-create",
                "touch",
                &ready,
                "wait",
                &go,
                "launch",
                "1",
            ],
        )
        .spawn()
        .unwrap();
    wait_until("the probe's first stream", Duration::from_secs(30), || {
        std::path::Path::new(&ready).exists()
    });
    m.kill_arbiter();
    std::fs::write(&go, b"").unwrap();
    let s = finish_within(
        child,
        Duration::from_secs(20),
        "the first launch waited for the arbiter (class unknown)",
    );
    assert_eq!(s.result("stream-create", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(s.result("launch", 0), "CUDA_SUCCESS", "{}", s.stderr);
}
