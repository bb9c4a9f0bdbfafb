//! The time-slice token through the real daemon: raw token clients
//! (`TokenConnection`) on lease sockets, observing their shared pages.

mod common;

use gpushare_testkit::clock::{monotonic_ns, shifted_clock_unavailable, SHIFTED_CLOCK};
use std::io::{BufRead, BufReader, Write};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use common::{open_token as open, reserve_here as reserve};
use gpushare_config::SchedulingPolicy;
use gpushare_proto::token::{FLAG_CUT_OFF, HELD_UNTIL_RELEASED, NOT_HELD};
use gpushare_proto::token_client::{TokenClientError, TokenConnection};
use gpushare_proto::{GpuSelector, Priority, TokenRequest, ViolationKind};

const T: Duration = Duration::from_secs(10);
const HELPER_ENV: &str = "GPUSHARE_TEST_TOKEN_HOLDER";

fn deadline(c: &TokenConnection) -> u64 {
    c.page().deadline_ns.load(Ordering::Acquire)
}

/// Waits on the page (futex) until `done` holds; panics after `timeout`.
fn wait_page(
    c: &TokenConnection,
    what: &str,
    timeout: Duration,
    done: impl Fn(&TokenConnection) -> bool,
) {
    let start = Instant::now();
    loop {
        let seen = c.page().seq.load(Ordering::Acquire);
        if done(c) {
            return;
        }
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        c.wait_for_change(seen, Duration::from_millis(20));
    }
}

fn granted(c: &TokenConnection) -> bool {
    deadline(c) != NOT_HELD
}

#[test]
fn a_lone_low_client_is_granted_a_slice() {
    let d = daemon(1, "16Gi").start();
    let lease = reserve(&d, "a", Priority::Low);
    let a = open(&d, &lease);
    assert_eq!(a.terms().gpu, sim_uuid(0));
    assert_eq!(a.terms().priority, Priority::Low);
    assert_eq!(a.terms().idle_ns, 300_000);
    assert!(!granted(&a), "nobody holds before asking");
    a.send(TokenRequest::Want).unwrap();
    wait_page(&a, "the grant", T, granted);
    let d_ns = deadline(&a);
    assert!(
        d_ns > monotonic_ns() && d_ns != HELD_UNTIL_RELEASED,
        "a finite slice: {d_ns}"
    );
    assert_eq!(a.page().grants.load(Ordering::Relaxed), 1);
    let status = d.client().status().unwrap();
    assert_eq!(status.tokens.len(), 1);
    assert_eq!(status.tokens[0].holders[0].lease, lease.id);
    let text = String::from_utf8_lossy(&d.ctl(&["status", "--verbose"]).stdout).into_owned();
    assert!(
        text.contains("token of GPU 0: policy=") && text.contains("grants=1"),
        "{text}"
    );
}

#[test]
fn a_second_low_client_waits_until_the_first_releases() {
    let d = daemon(1, "16Gi").start();
    let a = open(&d, &reserve(&d, "a", Priority::Low));
    let b = open(&d, &reserve(&d, "b", Priority::Low));
    a.send(TokenRequest::Want).unwrap();
    wait_page(&a, "A's grant", T, granted);
    b.send(TokenRequest::Want).unwrap();
    // A's slice ends (20 ms) and it is revoked, but B still waits: A's queued work
    // runs until A acknowledges.
    wait_page(&a, "A's revocation", T, |a| !granted(a));
    std::thread::sleep(Duration::from_millis(100));
    assert!(!granted(&b), "B must wait for A's release");
    a.send(TokenRequest::Release { again: false }).unwrap();
    wait_page(&b, "B's grant", T, granted);
    assert!(!granted(&a));
}

#[test]
fn a_high_client_preempts_a_low_holder_without_waiting_for_it() {
    let d = daemon(1, "16Gi").start();
    let low = open(&d, &reserve(&d, "low", Priority::Low));
    let high = open(&d, &reserve(&d, "high", Priority::High));
    low.send(TokenRequest::Want).unwrap();
    wait_page(&low, "the low grant", T, granted);
    assert_eq!(
        low.page().launch_ahead.load(Ordering::Relaxed),
        0,
        "a high client is registered but has never wanted the GPU: unbounded"
    );
    let start = Instant::now();
    high.send(TokenRequest::Want).unwrap();
    wait_page(&low, "the low holder's revocation", T, |l| !granted(l));
    let preempted = start.elapsed();
    wait_page(&high, "the high grant", T, granted);
    assert_eq!(deadline(&high), HELD_UNTIL_RELEASED);
    eprintln!("preemption signal observed after {preempted:?}");
    // Low acknowledges and still wants; it gets the token back when high is idle.
    low.send(TokenRequest::Release { again: true }).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!granted(&low), "no low grant while high holds");
    high.send(TokenRequest::Release { again: false }).unwrap();
    wait_page(&low, "the low grant after high went idle", T, granted);
    assert_eq!(
        low.page().launch_ahead.load(Ordering::Relaxed),
        1,
        "the high client was active a moment ago: bounded"
    );
    // Quiet for high_active_ms (500): the bound is lifted within the low slice.
    wait_page(&low, "the launch-ahead bound to be lifted", T, |l| {
        l.page().launch_ahead.load(Ordering::Acquire) == 0
    });
    assert!(granted(&low), "still the holder");
}

/// Not a test on its own: the token holder that `a_killed_holder_...` runs as a
/// child process and kills.
#[test]
#[ignore = "helper process for a_killed_holder_loses_the_token_at_once"]
fn token_holder_helper() {
    let socket = std::env::var(HELPER_ENV).expect("run by the killed-holder test");
    let c = TokenConnection::open(std::path::Path::new(&socket), T).unwrap();
    c.send(TokenRequest::Want).unwrap();
    wait_page(&c, "the helper's grant", T, granted);
    println!("granted");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_killed_holder_loses_the_token_at_once() {
    // Long slices and a long grace: only the death can pass the token on.
    let d = daemon(1, "16Gi")
        .configure(|c| {
            c.scheduler.slice_ms = 10_000;
            c.scheduler.max_slice_ms = 10_000;
            c.scheduler.window_ms = 20_000;
            c.scheduler.revoke_grace_ms = 60_000;
        })
        .start();
    let holder_lease = reserve(&d, "holder", Priority::Low);
    let waiter = open(&d, &reserve(&d, "waiter", Priority::Low));
    let mut handoffs = Vec::new();
    for trial in 0..5 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "token_holder_helper", "--nocapture"])
            .env(HELPER_ENV, d.lease_socket(&holder_lease.id.0))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(
            lines.any(|l| l.map(|l| l == "granted").unwrap_or(false)),
            "trial {trial}: the helper never held the token"
        );
        waiter.send(TokenRequest::Want).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!granted(&waiter), "trial {trial}: the helper holds");
        let start = Instant::now();
        child.kill().unwrap();
        let mut seen = waiter.page().seq.load(Ordering::Acquire);
        while !granted(&waiter) {
            assert!(
                start.elapsed() < Duration::from_secs(1),
                "trial {trial}: the token did not pass on within 1 s"
            );
            waiter.wait_for_change(seen, Duration::from_millis(100));
            seen = waiter.page().seq.load(Ordering::Acquire);
        }
        handoffs.push(start.elapsed());
        child.wait().unwrap();
        waiter.send(TokenRequest::Release { again: false }).unwrap();
        wait_page(&waiter, "the waiter's release", T, |w| !granted(w));
    }
    handoffs.sort();
    // How fast is for the benchmarks; the 1 s bound above catches a token that waits
    // for anything but the death.
    eprintln!("kill → grant: {handoffs:?}");
}

const SHIFTED_ENV: &str = "GPUSHARE_TEST_SHIFTED_CLIENT";

/// Not a test on its own: a token client that `a_client_with_a_clock_of_its_own_...`
/// runs in a time namespace whose monotonic clock is ten minutes behind. It prints
/// how long its grant lasts by its own clock.
#[test]
#[ignore = "helper process for a_client_with_a_clock_of_its_own_reads_its_slice_in_it"]
fn shifted_client_helper() {
    let socket = std::env::var(SHIFTED_ENV).expect("run by the shifted-clock test");
    let c = TokenConnection::open(std::path::Path::new(&socket), T).unwrap();
    c.send(TokenRequest::Want).unwrap();
    wait_page(&c, "the shifted client's grant", T, granted);
    let remaining = i128::from(deadline(&c)) - i128::from(monotonic_ns());
    println!("remaining_ns {remaining}");
    std::io::stdout().flush().unwrap();
    c.send(TokenRequest::Release { again: false }).unwrap();
}

/// A time namespace shifts CLOCK_MONOTONIC, the clock a client compares its page's
/// deadline and window with; unprivileged users may make one in a user namespace of
/// their own. A client ten minutes behind must still read a slice of the arbiter's
/// length, not one ten minutes longer.
#[test]
fn a_client_with_a_clock_of_its_own_reads_its_slice_in_it() {
    let d = daemon(1, "16Gi").start();
    let lease = reserve(&d, "shifted", Priority::Low);
    let unshare: Vec<String> = SHIFTED_CLOCK.map(String::from).to_vec();
    if let Some(why) = shifted_clock_unavailable() {
        eprintln!(
            "SKIPPED: this kernel does not let a test create a time namespace in a user \
             namespace ({why}); the translation is tested in the arbiter's unit tests only"
        );
        return;
    }
    let out = helper_command(&unshare, "shifted_client_helper")
        .env(SHIFTED_ENV, d.lease_socket(&lease.id.0))
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the shifted client failed: {stdout}");
    let remaining: i128 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("remaining_ns "))
        .unwrap_or_else(|| panic!("no remaining_ns in {stdout:?}"))
        .parse()
        .unwrap();
    // A lone client's grown slice is max_slice_ms; a minute is far more than load
    // can add, and far less than the ten minutes an untranslated deadline shows.
    let slice = i128::from(d.config().scheduler.max_slice_ms) * 1_000_000;
    assert!(
        remaining <= slice + 60_000_000_000,
        "the shifted client reads {} s left of a {} ms slice: its page is on the \
         arbiter's clock, not its own",
        remaining / 1_000_000_000,
        slice / 1_000_000
    );
    // The shift bought nothing, and it is reported all the same.
    let status = d.client().status().unwrap();
    assert!(
        status
            .violations
            .iter()
            .any(|v| v.kind == ViolationKind::ShiftedClock && v.lease.as_ref() == Some(&lease.id)),
        "no shifted_clock violation listed: {:?}",
        status.violations
    );
}

/// A revoked holder whose queued work outlasts the grace (a long kernel or CUDA
/// graph) is reported overdue, not cut off: it stays connected, others are granted,
/// and it is scheduled as usual once it releases.
#[test]
fn a_holder_draining_past_the_grace_is_overdue_stays_connected_and_is_granted_again() {
    let d = daemon(1, "16Gi")
        .configure(|c| c.scheduler.revoke_grace_ms = 100)
        .start();
    let a_lease = reserve(&d, "a", Priority::Low);
    let a = open(&d, &a_lease);
    let b = open(&d, &reserve(&d, "b", Priority::Low));
    a.send(TokenRequest::Want).unwrap();
    wait_page(&a, "A's grant", T, granted);
    b.send(TokenRequest::Want).unwrap();
    wait_page(&a, "A's revocation", T, |a| !granted(a));
    let revoked = Instant::now();
    // A does not release (its "kernel" is still running): B is granted after the grace.
    wait_page(&b, "B's grant once A is overdue", T, granted);
    assert!(
        revoked.elapsed() >= Duration::from_millis(80),
        "not before the grace: {:?}",
        revoked.elapsed()
    );
    let status = d.client().status().unwrap();
    let token = &status.tokens[0];
    assert_eq!(
        (token.overdue, token.cut_offs, token.revocations),
        (1, 0, 1)
    );
    assert_eq!(token.overdue_clients.len(), 1, "{token:?}");
    assert_eq!(token.overdue_clients[0].lease, a_lease.id);
    assert_eq!(token.clients, 2, "A is still a client");
    let text = String::from_utf8_lossy(&d.ctl(&["status", "--verbose"]).stdout).into_owned();
    assert!(
        text.contains("overdue=1")
            && text.contains("overdue on GPU 0: a (pid ")
            && text.contains("was revoked and still runs past scheduler.revoke_grace_ms"),
        "{text}"
    );
    assert!(d.log().contains("token client overdue"), "{}", d.log());
    assert!(!a.is_closed(), "an overdue client stays connected");
    assert_eq!(a.page().flags.load(Ordering::Acquire) & FLAG_CUT_OFF, 0);
    // A's drain ends; it still wants the GPU and gets it when B is done.
    a.send(TokenRequest::Release { again: true }).unwrap();
    b.send(TokenRequest::Release { again: false }).unwrap();
    wait_page(&a, "A's grant after its release", T, granted);
    let status = d.client().status().unwrap();
    let token = &status.tokens[0];
    assert_eq!(
        (token.overdue, token.overdue_clients.len(), token.cut_offs),
        (1, 0, 0)
    );
    assert!(!a.is_closed());
}

#[test]
fn a_malformed_or_oversized_frame_closes_only_that_connection() {
    let d = daemon(1, "16Gi").start();
    let lease = reserve(&d, "a", Priority::Low);
    let a = open(&d, &lease);
    let b = open(&d, &lease);
    let c = open(&d, &lease);
    a.send(TokenRequest::Want).unwrap();
    wait_page(&a, "A's grant", T, granted);
    b.send(TokenRequest::Want).unwrap();
    let raw = |conn: &TokenConnection| {
        // SAFETY: borrows the connection's descriptor without taking ownership
        // (ManuallyDrop: never closed here).
        ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(conn.raw_fd()) })
    };
    // A 1000-byte frame on the holder's connection: closed, and its token passes on.
    let mut header = 1000u32.to_be_bytes().to_vec();
    header.extend([b'{'; 16]);
    raw(&a).write_all(&header).unwrap();
    wait_until("A's connection to close", T, || a.is_closed());
    wait_page(&b, "B's grant", T, granted);
    // Well-framed nonsense on another connection: closed too.
    raw(&c)
        .write_all(&gpushare_proto::frame::encode(&"hello").unwrap())
        .unwrap();
    wait_until("C's connection to close", T, || c.is_closed());
    assert!(!b.is_closed(), "B is untouched");
    b.send(TokenRequest::Release { again: false }).unwrap();
    let d2 = open(&d, &lease);
    d2.send(TokenRequest::Want).unwrap();
    wait_page(&d2, "a new client's grant", T, granted);
}

#[test]
fn schedule_is_refused_for_multi_gpu_leases_and_when_the_policy_is_off() {
    let d = daemon(2, "16Gi").start();
    let mut wide = request("wide", "1Gi", Priority::Low);
    wide.gpu = GpuSelector::Count(2);
    let mut c = d.client();
    let wide = c.reserve(wide).unwrap();
    confirm_here(&mut c, "wide");
    match TokenConnection::open(&d.lease_socket(&wide.id.0), T) {
        Err(TokenClientError::Refused { message, .. }) => {
            assert!(
                message.contains("2 GPUs") && message.contains("ungated"),
                "{message}"
            )
        }
        other => panic!("expected a refusal: {other:?}"),
    }
    drop(d);
    let d = daemon(1, "16Gi")
        .configure(|c| c.scheduler.policy = SchedulingPolicy::Off)
        .start();
    let lease = reserve(&d, "a", Priority::Low);
    match TokenConnection::open(&d.lease_socket(&lease.id.0), T) {
        Err(TokenClientError::Refused { message, .. }) => {
            assert!(
                message.contains("\"off\"") && message.contains("ungated"),
                "{message}"
            )
        }
        other => panic!("expected a refusal: {other:?}"),
    }
}

#[test]
fn releasing_the_lease_cuts_its_token_clients_off() {
    let d = daemon(1, "16Gi").start();
    let lease = reserve(&d, "a", Priority::Low);
    let a = open(&d, &lease);
    a.send(TokenRequest::Want).unwrap();
    wait_page(&a, "A's grant", T, granted);
    assert!(d.client().release(lease.id.clone()).unwrap());
    wait_page(&a, "the cut-off flag", T, |a| {
        a.page().flags.load(Ordering::Acquire) & FLAG_CUT_OFF != 0
    });
    assert!(!granted(&a));
    wait_until("A's connection to close", T, || a.is_closed());
    let status = d.client().status().unwrap();
    assert_eq!(
        (status.tokens[0].cut_offs, status.tokens[0].overdue),
        (0, 0),
        "a lease's end is routine: not counted"
    );
}
