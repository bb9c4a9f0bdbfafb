//! Hostile clients against the running daemon: random byte streams on the
//! control socket and on a lease socket close only their own connection; a
//! well-behaved client on each socket keeps working throughout. Bounded: a
//! fixed number of cases, each a few hundred bytes.

mod common;

use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use gpushare_proto::token::{FitCounts, NOT_HELD};
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{
    frame, LeaseClient, LeaseRequest, LeaseResponse, Priority, ShareKey, TokenRequest,
    PROTOCOL_VERSION,
};
use proptest::prelude::*;

fn hostile_stream() -> impl Strategy<Value = Vec<u8>> {
    let hello = frame::encode(&LeaseRequest::Hello {
        protocol: PROTOCOL_VERSION,
    })
    .unwrap();
    prop_oneof![
        // Pure noise.
        proptest::collection::vec(any::<u8>(), 0..300),
        // A valid hello, then noise (exercises the post-greeting decoder).
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(move |mut noise| {
            let mut v = hello.clone();
            v.append(&mut noise);
            v
        }),
        // A plausible header and a JSON-ish body.
        ("[{}\\[\\]\":a-z0-9,_ ]{0,120}").prop_map(|body| {
            let mut v = (body.len() as u32).to_be_bytes().to_vec();
            v.extend_from_slice(body.as_bytes());
            v
        }),
    ]
}

#[test]
fn random_streams_close_only_their_connection() {
    let d = daemon(1, "16Gi").start();
    let control = std::cell::RefCell::new(d.client());
    let lease = control
        .borrow_mut()
        .reserve(request("fuzzed", "1Gi", Priority::Low))
        .unwrap();
    confirm_here(&mut control.borrow_mut(), "fuzzed");
    let lease_path = d.lease_socket(&lease.id.0);
    let tenant = std::cell::RefCell::new(
        LeaseClient::connect(&lease_path, Duration::from_secs(10)).unwrap(),
    );
    tenant.borrow_mut().attach(0).unwrap();
    let charged = std::cell::Cell::new(0u64);
    let control_path = d.control_socket();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &(hostile_stream(), any::<bool>()),
            |(bytes, on_lease_socket)| {
                let path = if on_lease_socket {
                    &lease_path
                } else {
                    &control_path
                };
                let mut s = UnixStream::connect(path).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let _ = s.write_all(&bytes);
                let _ = s.shutdown(std::net::Shutdown::Write);
                // The arbiter answers what it can and closes: read_to_end returns.
                let mut sink = Vec::new();
                // Closed with unread bytes still queued reads as a reset: closed all the same.
                let closed = match s.read_to_end(&mut sink) {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                };
                prop_assert!(closed, "the arbiter must close a hostile connection");
                prop_assert_eq!(control.borrow_mut().list().unwrap().len(), 1);
                prop_assert!(tenant.borrow_mut().charge(1).unwrap().granted);
                charged.set(charged.get() + 1);
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(
        tenant.borrow_mut().query().unwrap().memory_used,
        charged.get()
    );
}

/// Every kind of lease-socket request, well formed, with the values a liar would pick.
fn lease_request() -> impl Strategy<Value = LeaseRequest> {
    let key = || (any_u64(), any_u64()).prop_map(|(dev, ino)| ShareKey { dev, ino });
    prop_oneof![
        any::<u32>().prop_map(|protocol| LeaseRequest::Hello { protocol }),
        any_u64().prop_map(|memory_held| LeaseRequest::Attach { memory_held }),
        Just(LeaseRequest::Query),
        any_u64().prop_map(|bytes| LeaseRequest::Charge { bytes }),
        any_u64().prop_map(|bytes| LeaseRequest::Credit { bytes }),
        (key(), any_u64(), proptest::option::of(key())).prop_map(|(key, bytes, same_as)| {
            LeaseRequest::Share {
                key,
                bytes,
                same_as,
            }
        }),
        key().prop_map(|key| LeaseRequest::Hold { key }),
        key().prop_map(|key| LeaseRequest::Unhold { key }),
    ]
}

/// A greeted lease-socket connection sends a run of requests of every kind with
/// extreme values (more than the quota, less than nothing held, keys nobody shared)
/// and goes: nothing it did outlives it, and the lease's honest process is charged
/// exactly what it asked for throughout.
#[test]
fn every_lease_request_kind_with_hostile_values_leaves_the_lease_as_it_was() {
    let d = daemon(1, "16Gi").start();
    let mut control = d.client();
    let lease = control
        .reserve(request("fuzzed", "1Gi", Priority::Low))
        .unwrap();
    confirm_here(&mut control, "fuzzed");
    let lease_path = d.lease_socket(&lease.id.0);
    let tenant = std::cell::RefCell::new(LeaseClient::connect(&lease_path, T).unwrap());
    tenant.borrow_mut().attach(0).unwrap();
    let quota = tenant.borrow_mut().query().unwrap().memory_quota;
    let charged = std::cell::Cell::new(0u64);
    let served = std::cell::Cell::new(0usize);
    let hello = frame::encode(&LeaseRequest::Hello {
        protocol: PROTOCOL_VERSION,
    })
    .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(
            &proptest::collection::vec(lease_request(), 1..12),
            |requests| {
                let mut s = UnixStream::connect(&lease_path).unwrap();
                s.set_read_timeout(Some(T)).unwrap();
                let mut bytes = hello.clone();
                for r in &requests {
                    bytes.extend(frame::encode(r).unwrap());
                }
                let _ = s.write_all(&bytes);
                let _ = s.shutdown(std::net::Shutdown::Write);
                let mut answers = Vec::new();
                let closed = match s.read_to_end(&mut answers) {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                };
                prop_assert!(closed, "the arbiter must close the connection when it goes");
                drop(s);
                // It was served, not turned away: the greeting and its first request
                // were answered.
                let mut answered = &answers[..];
                let mut kinds = Vec::new();
                while let Ok(answer) = frame::read_message::<LeaseResponse>(&mut answered) {
                    kinds.push(answer);
                }
                prop_assert!(kinds.len() >= 2, "{:?} answered with {:?}", requests, kinds);
                served.set(served.get() + kinds.len());
                prop_assert!(tenant.borrow_mut().charge(1).unwrap().granted);
                charged.set(charged.get() + 1);
                let charged = charged.get();
                // Its disconnect is handled on the arbiter's own time: wait for it.
                let start = Instant::now();
                let used = loop {
                    let used = tenant.borrow_mut().query().unwrap().memory_used;
                    if used == charged || start.elapsed() > T {
                        break used;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                };
                prop_assert_eq!(used, charged, "what the hostile connection did outlived it");
                prop_assert!(used <= quota);
                let status = d.client().status().unwrap();
                prop_assert_eq!(status.leases.len(), 1);
                Ok(())
            },
        )
        .unwrap();
    eprintln!("{} answers to hostile requests", served.get());
}

// ----- token connections -----

const T: Duration = Duration::from_secs(10);

fn token_client(d: &Arbiter, container: &str, priority: Priority) -> TokenConnection {
    let mut c = d.client();
    let lease = c.reserve(request(container, "1Gi", priority)).unwrap();
    confirm_here(&mut c, container);
    TokenConnection::open(&d.lease_socket(&lease.id.0), T).unwrap()
}

fn granted(c: &TokenConnection) -> bool {
    c.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
}

/// Asks for the token and waits on the page (futex) until `c` holds it, as the
/// interposer does: a grant revoked before it was seen (a high-priority client came
/// and went in between) is still answered with a release, or the arbiter waits for
/// that drain and grants nobody else. Panics after `T`.
fn want_and_wait(c: &TokenConnection, what: &str) {
    let grants = || c.page().grants.load(Ordering::Acquire);
    let mut answered = grants();
    c.send(TokenRequest::Want).unwrap();
    let start = Instant::now();
    loop {
        let seen = c.page().seq.load(Ordering::Acquire);
        if granted(c) {
            return;
        }
        if grants() != answered {
            answered = grants();
            c.send(TokenRequest::Release { again: true }).unwrap();
        }
        assert!(start.elapsed() < T, "timed out waiting for {what}");
        c.wait_for_change(seen, Duration::from_millis(20));
    }
}

/// The token moves between two honest clients: `a` takes it, `b` waits, `a` gives it
/// back, `b` is granted.
fn token_moves(a: &TokenConnection, b: &TokenConnection) {
    want_and_wait(a, "the first honest client's grant");
    let (b_done, a_released) = std::thread::scope(|scope| {
        let b_waits = scope.spawn(|| {
            want_and_wait(
                b,
                "the second honest client's grant after the first released",
            )
        });
        // b's want reaches the arbiter before a's release, or b is simply granted
        // the free token: either way it must be granted.
        std::thread::sleep(Duration::from_millis(1));
        let released = a.send(TokenRequest::Release { again: false });
        (b_waits.join(), released)
    });
    a_released.unwrap();
    if let Err(panic) = b_done {
        std::panic::resume_unwind(panic);
    }
    b.send(TokenRequest::Release { again: false }).unwrap();
}

fn fit(fitted: u64) -> TokenRequest {
    TokenRequest::Fit {
        need_ns: 0,
        counts: FitCounts {
            fitted,
            ..FitCounts::default()
        },
    }
}

#[test]
fn admission_counts_that_overflow_the_gpus_total_do_not_stop_its_token() {
    let d = daemon(1, "16Gi").start();
    let a = token_client(&d, "a", Priority::Low);
    let b = token_client(&d, "b", Priority::Low);
    // Each count is cumulative per connection; summed over both they pass u64::MAX.
    a.send(fit(1)).unwrap();
    b.send(fit(u64::MAX)).unwrap();
    token_moves(&a, &b);
    let status = d.client().status().unwrap();
    assert_eq!(
        status.tokens[0].admission.launches.fitted,
        u64::MAX,
        "the GPU's total saturates"
    );
    assert_eq!(status.tokens[0].thread_restarts, 0, "nothing panicked");
}

/// The fuzzer's smallest case: a high-priority client that wants the token and goes,
/// again and again, while two low clients pass it on. A low client may be granted and
/// revoked before it looks; it answers the revocation and is granted again.
#[test]
fn a_high_client_that_wants_and_goes_leaves_the_token_moving() {
    let d = daemon(1, "16Gi").start();
    let a = token_client(&d, "a", Priority::Low);
    let b = token_client(&d, "b", Priority::Low);
    token_moves(&a, &b);
    let mut control = d.client();
    let lease = control
        .reserve(request("high", "1Gi", Priority::High))
        .unwrap();
    confirm_here(&mut control, "high");
    let socket = d.lease_socket(&lease.id.0);
    for _ in 0..20 {
        let high = TokenConnection::open(&socket, T).unwrap();
        high.send(TokenRequest::Want).unwrap();
        drop(high);
        token_moves(&a, &b);
    }
}

fn any_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1 << 63),
        any::<u64>()
    ]
}

fn token_request() -> impl Strategy<Value = TokenRequest> {
    let counts = (any_u64(), any_u64(), any_u64(), any_u64(), any_u64()).prop_map(
        |(fitted, unestimated, held_back, overran, overran_ns)| FitCounts {
            fitted,
            unestimated,
            held_back,
            overran,
            overran_ns,
        },
    );
    prop_oneof![
        Just(TokenRequest::Want),
        any::<bool>().prop_map(|again| TokenRequest::Release { again }),
        (any_u64(), counts).prop_map(|(need_ns, counts)| TokenRequest::Fit { need_ns, counts }),
    ]
}

/// Frames a token client may send, valid ones and some mutated: a byte flipped in the
/// body, or the length prefix changed.
fn token_frames() -> impl Strategy<Value = Vec<u8>> {
    let frame = (token_request(), any::<u16>(), any::<u8>(), any::<u8>()).prop_map(
        |(request, at, byte, how)| {
            let mut bytes = frame::encode(&request).unwrap();
            let at = usize::from(at) % bytes.len();
            match how % 4 {
                0 => bytes[at] ^= byte,
                1 => bytes[at % 4] = byte,
                _ => {}
            }
            bytes
        },
    );
    proptest::collection::vec(frame, 1..8).prop_map(|frames| frames.concat())
}

#[test]
fn random_and_mutated_token_frames_never_stop_the_token() {
    let d = daemon(1, "16Gi").start();
    let honest_a = token_client(&d, "honest-a", Priority::Low);
    let honest_b = token_client(&d, "honest-b", Priority::Low);
    let mut control = d.client();
    let hostile = control
        .reserve(request("hostile", "1Gi", Priority::High))
        .unwrap();
    confirm_here(&mut control, "hostile");
    let hostile_socket = d.lease_socket(&hostile.id.0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&token_frames(), |bytes| {
            let c = TokenConnection::open(&hostile_socket, T).unwrap();
            // SAFETY: borrows the connection's open descriptor; ManuallyDrop leaves
            // closing it to the connection.
            let raw = ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(c.raw_fd()) });
            let _ = (&*raw).write_all(&bytes);
            drop(c);
            // Whatever it sent, the GPU's token still moves and nothing failed.
            token_moves(&honest_a, &honest_b);
            let status = d.client().status().unwrap();
            prop_assert_eq!(status.tokens[0].thread_restarts, 0);
            Ok(())
        })
        .unwrap();
}
