//! Time-slice token latencies through the real daemon (`gpushare-arbiter`, a separate
//! process), with raw `TokenConnection` clients in threads of this process:
//!
//! - handoff: A holds, B is blocked in a futex wait; A sends `Release { again: false }`
//!   at t0, B observes its grant at t1 (both CLOCK_MONOTONIC);
//! - death: A holds and B waits; A's connection closes at t0 (as a killed process's
//!   does); B observes its grant at t1;
//! - preemption signal: a high-priority client sends `Want` at t0; the low-priority
//!   holder's page shows deadline 0 at t1, observed by a reader blocked in a futex
//!   wait on the page (an upper bound: a launching client sees the store on its next
//!   launch without the wake-up). A spinning reader was tried and rejected: on a
//!   2-core machine it starves the arbiter's own thread.
//!
//! `GPUSHARE_BENCH_OUT=path` also writes the results as JSON, and
//! `GPUSHARE_BENCH_RESULTS=dir` writes them to `dir/token-handoff.json`. `GPUSHARE_BENCH_N`
//! overrides the sample count (default 2000).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::token::NOT_HELD;
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{Fraction, GpuSelector, Lease, Priority, ReserveRequest, TokenRequest};
use gpushare_testkit::clock::monotonic_ns;
use gpushare_testkit::results::write_results;
use gpushare_testkit::stats::percentile;
use gpushare_testkit::Arbiter;

const T: Duration = Duration::from_secs(10);

/// A private arbiter whose slices are long: only the clients' own requests move the token.
fn start_daemon() -> Arbiter {
    Arbiter::builder()
        .program(env!("CARGO_BIN_EXE_gpushare-arbiter"))
        .declared_gpus(1, "16Gi")
        .configure(|c| {
            c.scheduler.slice_ms = 10_000;
            c.scheduler.max_slice_ms = 10_000;
            c.scheduler.window_ms = 20_000;
            c.scheduler.revoke_grace_ms = 60_000;
        })
        .env("GPUSHARE_LOG", "warn")
        .start()
}

fn reserve(daemon: &Arbiter, container: &str, priority: Priority) -> Lease {
    let mut c = daemon.client();
    let lease = c
        .reserve(ReserveRequest {
            container_id: container.into(),
            namespace: None,
            sandbox_id: None,
            priority,
            memory: Some("1Gi".parse().unwrap()),
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            gpu: GpuSelector::Count(1),
            tenant: None,
            pod: None,
        })
        .unwrap();
    // The clients are this process's threads: it stands in for the container.
    c.confirm(container.into(), std::process::id()).unwrap();
    lease
}

fn open(daemon: &Arbiter, lease: &Lease) -> TokenConnection {
    TokenConnection::open(&daemon.lease_socket(&lease.id.0), T).unwrap()
}

/// Blocks (futex) until the page's grant counter passes `seen`; returns the new count.
fn wait_for_grant(c: &TokenConnection, seen: u64) -> u64 {
    let start = Instant::now();
    loop {
        let seq = c.page().seq.load(Ordering::Acquire);
        let grants = c.page().grants.load(Ordering::Acquire);
        if grants > seen {
            return grants;
        }
        assert!(start.elapsed() < T, "no grant within {T:?}");
        c.wait_for_change(seq, Duration::from_millis(100));
    }
}

fn handoff(n: usize) -> Vec<u64> {
    let daemon = start_daemon();
    let a = Arc::new(open(&daemon, &reserve(&daemon, "a", Priority::Low)));
    let b = Arc::new(open(&daemon, &reserve(&daemon, "b", Priority::Low)));
    let released_at = Arc::new(AtomicU64::new(0));
    a.send(TokenRequest::Want).unwrap();
    wait_for_grant(&a, 0);
    // Each thread: wait for its grant, record the handoff, let the other block in its
    // futex wait, then hand the token back and ask again.
    let player = |me: Arc<TokenConnection>, first: bool, rounds: usize| {
        let released_at = released_at.clone();
        std::thread::spawn(move || {
            let mut samples = Vec::with_capacity(rounds);
            let mut grants = me.page().grants.load(Ordering::Acquire);
            if !first {
                me.send(TokenRequest::Want).unwrap();
            }
            for round in 0..rounds {
                if !(first && round == 0) {
                    grants = wait_for_grant(&me, grants);
                    let t1 = monotonic_ns();
                    samples.push(t1 - released_at.load(Ordering::Acquire));
                }
                // The other side has sent Want and is (by now) asleep in the kernel.
                std::thread::sleep(Duration::from_micros(300));
                released_at.store(monotonic_ns(), Ordering::Release);
                me.send(TokenRequest::Release { again: false }).unwrap();
                me.send(TokenRequest::Want).unwrap();
            }
            samples
        })
    };
    let rounds = n / 2 + 1;
    let ta = player(a.clone(), true, rounds);
    let tb = player(b.clone(), false, rounds);
    let mut samples = ta.join().unwrap();
    samples.extend(tb.join().unwrap());
    samples
}

/// A holder that dies: B waits; A's connection closes while it holds (as a killed
/// process's does) at t0; B observes its grant at t1. The arbiter acts on the end of the
/// connection, not on the dead holder's slice (10 s here) running out.
fn death(n: usize) -> Vec<u64> {
    let daemon = start_daemon();
    let a_lease = reserve(&daemon, "a", Priority::Low);
    let b = open(&daemon, &reserve(&daemon, "b", Priority::Low));
    b.send(TokenRequest::Want).unwrap();
    let mut b_grants = wait_for_grant(&b, 0);
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let a = open(&daemon, &a_lease);
        a.send(TokenRequest::Want).unwrap();
        // B hands the token to A and asks again: it waits behind A.
        std::thread::sleep(Duration::from_micros(300));
        b.send(TokenRequest::Release { again: true }).unwrap();
        wait_for_grant(&a, 0);
        // B is asleep in its futex wait by now.
        std::thread::sleep(Duration::from_micros(300));
        let t0 = monotonic_ns();
        drop(a);
        b_grants = wait_for_grant(&b, b_grants);
        samples.push(monotonic_ns() - t0);
    }
    samples
}

fn preemption(n: usize) -> Vec<u64> {
    let daemon = start_daemon();
    let low = open(&daemon, &reserve(&daemon, "low", Priority::Low));
    let high = open(&daemon, &reserve(&daemon, "high", Priority::High));
    low.send(TokenRequest::Want).unwrap();
    let mut grants = wait_for_grant(&low, 0);
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        std::thread::sleep(Duration::from_micros(300));
        let t0 = monotonic_ns();
        high.send(TokenRequest::Want).unwrap();
        let page = low.page();
        let start = Instant::now();
        loop {
            let seq = page.seq.load(Ordering::Acquire);
            if page.deadline_ns.load(Ordering::Acquire) == NOT_HELD {
                break;
            }
            assert!(start.elapsed() < T, "no preemption within {T:?}");
            low.wait_for_change(seq, Duration::from_millis(100));
        }
        samples.push(monotonic_ns() - t0);
        low.send(TokenRequest::Release { again: true }).unwrap();
        high.send(TokenRequest::Release { again: false }).unwrap();
        grants = wait_for_grant(&low, grants);
    }
    samples
}

fn main() {
    let n: usize = std::env::var("GPUSHARE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let mut results = Vec::new();
    for (name, samples) in [
        ("handoff", handoff(n)),
        ("preemption_signal", preemption(n)),
        // A connection per sample: fewer of them.
        ("death", death(n.div_ceil(10))),
    ] {
        let mut micros: Vec<f64> = samples.iter().map(|&ns| ns as f64 / 1_000.0).collect();
        micros.sort_by(f64::total_cmp);
        results.push((
            name,
            micros.len(),
            percentile(&micros, 50.0),
            percentile(&micros, 99.0),
            *micros.last().unwrap(),
        ));
    }
    println!("token latencies, real daemon, clients as threads of one process (µs)");
    println!(
        "{:<20} {:>6} {:>9} {:>9} {:>9}",
        "what", "n", "p50", "p99", "max"
    );
    for (name, count, p50, p99, max) in &results {
        println!("{name:<20} {count:>6} {p50:>9.1} {p99:>9.1} {max:>9.1}");
    }
    let json = serde_json::json!(results
        .iter()
        .map(|(name, count, p50, p99, max)| (
            name.to_string(),
            serde_json::json!({"n": count, "p50_us": p50, "p99_us": p99, "max_us": max})
        ))
        .collect::<serde_json::Map<_, _>>());
    if let Some(path) = std::env::var_os("GPUSHARE_BENCH_OUT") {
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    }
    write_results("token-handoff", json);
}
