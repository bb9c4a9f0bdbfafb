//! Hostile clients against the running daemon: random byte streams on the
//! control socket and on a lease socket close only their own connection; a
//! well-behaved client on each socket keeps working throughout. Bounded: a
//! fixed number of cases, each a few hundred bytes.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use gpushare_proto::{frame, LeaseClient, LeaseRequest, Priority, PROTOCOL_VERSION};
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
