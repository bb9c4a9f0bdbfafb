//! A low-priority holder that keeps the GPU busy past its window beside an active
//! high-priority job, through the real daemon with raw token clients: whatever its
//! interposer would have said, the arbiter sees a revoked holder that has not let go
//! after the grace. It is reported (a violation, within the watchdog's next second
//! or sooner: at once), and its lease — a fresh process of it included — is granted
//! only while no high-priority job is active.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use common::{open_token as open, reserve_here as reserve};
use gpushare_proto::token::NOT_HELD;
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{Lease, Priority, StatusReport, TokenRequest, ViolationKind};

/// Only to catch a hang.
const T: Duration = Duration::from_secs(10);
const GRACE_MS: u64 = 100;

fn granted(c: &TokenConnection) -> bool {
    c.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
}

/// Granted at least once since it connected (a grant revoked before anyone looked
/// counts: on a loaded machine both may land between two looks at the deadline).
fn ever_granted(c: &TokenConnection) -> bool {
    c.page().grants.load(Ordering::Acquire) > 0
}

/// Waits on the page until `done` holds or `timeout` passes; whether it held.
fn wait_page(
    c: &TokenConnection,
    timeout: Duration,
    done: impl Fn(&TokenConnection) -> bool,
) -> bool {
    let start = Instant::now();
    loop {
        let seen = c.page().seq.load(Ordering::Acquire);
        if done(c) {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        c.wait_for_change(seen, Duration::from_millis(20));
    }
}

/// A high-priority job of 5 ms bursts and 5 ms gaps, as a token client does it, until
/// dropped.
struct HighJob {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HighJob {
    fn start(client: TokenConnection) -> HighJob {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                client.send(TokenRequest::Want).unwrap();
                std::thread::sleep(Duration::from_millis(5));
                client.send(TokenRequest::Release { again: false }).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        HighJob {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

impl Drop for HighJob {
    fn drop(&mut self) {
        self.stop();
    }
}

fn overruns_of(status: &StatusReport, lease: &Lease) -> usize {
    status
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::Overrun && v.lease.as_ref() == Some(&lease.id))
        .count()
}

/// The liar's first process takes a window beside the running high job and keeps
/// "running" (does not release) for three graces after the high job took the GPU
/// back, then releases and exits. Returns when it has.
fn overrun_once(d: &Arbiter, liar: &Lease) {
    let first = open(d, liar);
    first.send(TokenRequest::Want).unwrap();
    assert!(wait_page(&first, T, ever_granted), "the liar's first grant");
    assert!(
        wait_page(&first, T, |c| !granted(c)),
        "the liar's revocation when the high job comes back"
    );
    std::thread::sleep(Duration::from_millis(3 * GRACE_MS));
    first.send(TokenRequest::Release { again: false }).unwrap();
    drop(first);
}

fn start_daemon() -> Arbiter {
    daemon(1, "16Gi")
        .configure(|c| {
            c.scheduler.revoke_grace_ms = GRACE_MS;
            // Long enough that only the high job going quiet can end it here.
            c.scheduler.overrun_penalty_ms = 60_000;
        })
        .start()
}

/// A holder whose work outlasts its window (kernels queued past the
/// gate) was only "overdue": nothing reported it.
#[test]
fn a_holder_running_past_the_grace_beside_an_active_high_job_is_reported_as_an_overrun() {
    let d = start_daemon();
    let liar = reserve(&d, "liar", Priority::Low);
    let _high = HighJob::start(open(&d, &reserve(&d, "high", Priority::High)));
    let revoked_plus_grace = Instant::now() + Duration::from_millis(GRACE_MS);
    overrun_once(&d, &liar);
    let start = Instant::now();
    let mut status = d.client().status().unwrap();
    while overruns_of(&status, &liar) == 0 && start.elapsed() < T {
        std::thread::sleep(Duration::from_millis(20));
        status = d.client().status().unwrap();
    }
    eprintln!(
        "overrun listed {:?} after the liar's release ({:?} after its grace could first end)",
        start.elapsed(),
        revoked_plus_grace.elapsed()
    );
    assert_eq!(
        overruns_of(&status, &liar),
        1,
        "the overrun is reported for the liar's lease: {:?}",
        status.violations
    );
    let token = &status.tokens[0];
    assert_eq!(token.admission.measured_overruns, 1, "{token:?}");
    assert_eq!(
        token.admission.penalized_leases,
        std::slice::from_ref(&liar.id)
    );
    assert!(
        token.admission.measured_overrun_ms >= 2 * GRACE_MS - GRACE_MS / 2,
        "the drain past the grace is counted as overrun: {token:?}"
    );
    assert!(d.log().contains("token client overran"), "{}", d.log());
    let text = String::from_utf8_lossy(&d.ctl(&["status", "--verbose"]).stdout).into_owned();
    assert!(
        text.contains("overruns: 1") && text.contains("penalised now: liar"),
        "{text}"
    );
}

/// A new process per kernel started with empty estimates each time
/// and was admitted into the high job's window every time.
#[test]
fn a_fresh_process_of_a_lease_that_overran_gets_the_gpu_only_once_the_high_job_is_quiet() {
    let d = start_daemon();
    let liar = reserve(&d, "liar", Priority::Low);
    let mut high = HighJob::start(open(&d, &reserve(&d, "high", Priority::High)));
    overrun_once(&d, &liar);
    // Its next process, and an honest low job beside it.
    let fresh = open(&d, &liar);
    let honest = open(&d, &reserve(&d, "honest", Priority::Low));
    fresh.send(TokenRequest::Want).unwrap();
    honest.send(TokenRequest::Want).unwrap();
    assert!(
        wait_page(&honest, T, ever_granted),
        "an honest lease still gets the high job's gaps"
    );
    honest.send(TokenRequest::Release { again: false }).unwrap();
    // Many of the high job's gaps pass (it runs 5 ms bursts, 5 ms gaps).
    let penalised = !wait_page(&fresh, Duration::from_secs(1), ever_granted);
    assert!(
        penalised,
        "a fresh process of the lease that overran was granted a window beside the active high job"
    );
    high.stop();
    assert!(
        wait_page(&fresh, T, ever_granted),
        "granted once the high job has gone quiet"
    );
}
