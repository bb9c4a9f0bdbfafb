//! Hostile clients on the lease sockets: a container that floods its own socket,
//! a host user and a foreign container that know a lease's id, and a client that
//! starts a frame and never finishes it. Each case asserts what the arbiter must do.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use gpushare_proto::frame::{encode, read_message, write_message};
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{
    LeaseClient, LeaseRequest, LeaseResponse, Priority, StatusReport, PROTOCOL_VERSION,
};
use gpushare_testkit::stats::median_duration;

const T: Duration = Duration::from_secs(10);
const HELPER_ENV: &str = "GPUSHARE_TEST_ABUSE_SOCKET";

/// The flood: one container opening this many connections.
const FLOOD: usize = 10_000;

/// The Done-when bound on `gpusharectl status` during and after a flood.
const STATUS_BOUND: Duration = Duration::from_millis(100);

fn status(d: &Arbiter) -> (StatusReport, Duration) {
    let start = Instant::now();
    let report = d.client().status().unwrap();
    (report, start.elapsed())
}

/// The arbiter's thread and descriptor counts, from /proc.
fn threads_and_descriptors(pid: u32) -> (usize, usize) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let threads = text
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (threads, fds)
}

/// Hello then Schedule: what made a token connection, and with it an arbiter
/// thread, before connections were bounded whatever they became.
fn schedule_frames() -> Vec<u8> {
    let mut bytes = encode(&LeaseRequest::Hello {
        protocol: PROTOCOL_VERSION,
    })
    .unwrap();
    bytes.extend(encode(&LeaseRequest::Schedule).unwrap());
    bytes
}

#[test]
fn ten_thousand_connections_from_one_container_leave_the_arbiter_responsive() {
    raise_descriptor_limit(FLOOD as u64 + 1_000);
    let d = daemon(2, "16Gi").start();
    let mut c = d.client();
    let flood_lease = c.reserve(request("flood", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "flood");
    let path = d.lease_socket(&flood_lease.id.0);
    let frames = schedule_frames();
    // The baseline: the GPU's token threads exist once one client was scheduled.
    let first = TokenConnection::open(&path, T).unwrap();
    let (threads_before, _) = threads_and_descriptors(d.pid());

    let mut held = Vec::with_capacity(FLOOD);
    let mut during = Vec::new();
    for i in 0..FLOOD {
        // A failed connect (the backlog filled faster than the arbiter accepted) is
        // a refusal too, and the container's own problem; so is a failed write on a
        // connection the arbiter refused and closed under us.
        if let Ok(mut s) = UnixStream::connect(&path) {
            let _ = s.write_all(&frames);
            held.push(s);
        }
        if i % 1_000 == 999 {
            during.push(status(&d).1);
        }
    }
    // Every connection is either served (a token connection) or refused.
    let offered = held.len() as u64 + 1;
    wait_until("the flood to be sorted", T, || {
        let c = status(&d).0.connections;
        c.open as u64 + c.refused_lease_limit >= offered
    });
    for _ in 0..5 {
        during.push(status(&d).1);
    }
    let (report, _) = status(&d);
    let (threads, fds) = threads_and_descriptors(d.pid());
    let cap = report.connections.per_lease_limit;
    assert_eq!(
        cap,
        gpushare_arbiter::connections::MAX_CONNECTIONS_PER_LEASE
    );
    assert!(
        report.connections.open <= cap,
        "{} connections open, over the per-lease bound {cap}",
        report.connections.open
    );
    assert!(
        report.connections.refused_lease_limit >= (held.len() - cap) as u64,
        "refusals counted: {:?} of {} connections",
        report.connections,
        held.len()
    );
    // No thread per connection: the flood's hundreds of token connections share
    // their GPU's one I/O thread.
    assert!(
        threads <= threads_before + 8,
        "{threads} arbiter threads with {cap} token connections ({threads_before} with one)"
    );
    assert!(
        fds < cap + 200,
        "{fds} arbiter descriptors with {cap} connections"
    );
    let token_clients: usize = report.tokens.iter().map(|t| t.clients).sum();
    assert!(token_clients <= cap, "{token_clients} token clients");

    // Another container starts and is scheduled as usual, during the flood.
    let lease = c.reserve(request("quiet", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "quiet");
    let quiet_socket = d.lease_socket(&lease.id.0);
    let mut ledger = LeaseClient::connect(&quiet_socket, T).unwrap();
    ledger.attach(0).unwrap();
    assert!(ledger.charge(1 << 20).unwrap().granted);
    let token = TokenConnection::open(&quiet_socket, T).unwrap();
    assert_eq!(token.terms().priority, Priority::Low);

    drop(held);
    drop(first);
    wait_until("the flood's connections to close", T, || {
        status(&d).0.connections.open == 2
    });
    let after: Vec<Duration> = (0..5).map(|_| status(&d).1).collect();
    let (threads_after, _) = threads_and_descriptors(d.pid());
    assert!(
        threads_after <= threads_before + 8,
        "{threads_after} threads after the flood ({threads_before} before)"
    );
    eprintln!(
        "status during the flood: median {:?}, max {:?}; after: median {:?}",
        median_duration(during.clone()),
        during.iter().max().unwrap(),
        median_duration(after.clone())
    );
    assert!(
        median_duration(during) < STATUS_BOUND,
        "status answered slower than {STATUS_BOUND:?} during the flood"
    );
    assert!(
        median_duration(after) < STATUS_BOUND,
        "status answered slower than {STATUS_BOUND:?} after the flood"
    );
    drop(token);
}

/// Every request a lease socket serves, each sent (after a hello) on a
/// connection of its own.
fn every_request() -> Vec<(&'static str, LeaseRequest)> {
    vec![
        (
            "hello",
            LeaseRequest::Hello {
                protocol: PROTOCOL_VERSION,
            },
        ),
        ("attach", LeaseRequest::Attach { memory_held: 0 }),
        ("query", LeaseRequest::Query),
        ("charge", LeaseRequest::Charge { bytes: 1 << 20 }),
        ("credit", LeaseRequest::Credit { bytes: 1 }),
        ("schedule", LeaseRequest::Schedule),
    ]
}

/// What the arbiter answers to each request: the first answer on the connection
/// (for all but hello, after a hello) and whether the connection was then closed.
fn try_every_request(socket: &Path) -> Vec<String> {
    every_request()
        .into_iter()
        .map(|(name, request)| {
            let Ok(mut s) = UnixStream::connect(socket) else {
                return format!("{name}: cannot connect");
            };
            s.set_read_timeout(Some(T)).unwrap();
            let hello = LeaseRequest::Hello {
                protocol: PROTOCOL_VERSION,
            };
            let _ = write_message(&mut s, &hello);
            if name != "hello" {
                let _ = write_message(&mut s, &request);
            }
            let answer = match read_message::<LeaseResponse>(&mut s) {
                Ok(LeaseResponse::Error { kind, .. }) => format!("error {kind:?}"),
                Ok(other) => format!("answered {other:?}"),
                Err(e) => format!("no answer ({e})"),
            };
            // A refused connection is closed at once; a served one stays open.
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut rest = Vec::new();
            // Closed: EOF, or a reset where the arbiter closed with our frame unread.
            let closed = match s.read_to_end(&mut rest) {
                Ok(_) => true,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            };
            format!("{name}: {answer}, closed {closed}")
        })
        .collect()
}

/// Not a test on its own: the outsider that the trust tests run as another user
/// or inside another container, trying every request on a lease socket.
#[test]
#[ignore = "helper process for the lease-socket trust tests"]
fn outsider_helper() {
    let socket = std::env::var(HELPER_ENV).expect("run by a trust test");
    for line in try_every_request(Path::new(&socket)) {
        println!("{line}");
    }
    std::io::stdout().flush().unwrap();
}

/// Runs [`outsider_helper`] through `command` (a prefix such as nsenter) or as
/// `uid`, and returns its lines.
fn outsider(socket: &Path, prefix: &[String], uid: Option<u32>) -> Vec<String> {
    let mut command = helper_command(prefix, "outsider_helper");
    command
        .env(HELPER_ENV, socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    let output = command.output().unwrap();
    BufReader::new(output.stdout.as_slice())
        .lines()
        .map_while(Result::ok)
        .filter(|l| every_request().iter().any(|(n, _)| l.starts_with(n)))
        .collect()
}

/// Lets other users reach the lease sockets, as a careless `run_dir` mode would:
/// the peer check alone must then stop them.
fn open_up(run_dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut dir = Some(run_dir);
    while let Some(d) = dir {
        if d == Path::new("/") || d == Path::new("/tmp") {
            break;
        }
        let mode = std::fs::metadata(d).unwrap().permissions().mode();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o711)).unwrap();
        dir = d.parent();
    }
}

fn assert_all_refused(who: &str, lines: &[String]) {
    assert_eq!(lines.len(), every_request().len(), "{who}: {lines:?}");
    for line in lines {
        assert!(
            line.contains("error PermissionDenied") && line.contains("closed true"),
            "{who} was not refused: {line}"
        );
    }
}

#[test]
fn only_the_leases_own_container_can_use_its_socket() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let owner = NamespacedContainer::start();
    let lease = c.reserve(request("owner", "1Gi", Priority::High)).unwrap();
    c.confirm("owner".into(), owner.init).unwrap();
    let socket = d.lease_socket(&lease.id.0);
    open_up(socket.parent().unwrap());

    // A host user who read the id from a container process's mountinfo.
    let nobody = outsider(&socket, &[], Some(65534));
    assert_all_refused("a host user (uid 65534)", &nobody);
    // Root on the host, outside the container, is no better.
    assert_all_refused("a host process", &try_every_request(&socket));
    // Another container.
    let foreign = NamespacedContainer::start();
    let inside_foreign = vec![
        "nsenter".to_owned(),
        "--target".to_owned(),
        foreign.init.to_string(),
        "--pid".to_owned(),
        "--".to_owned(),
    ];
    assert_all_refused(
        "a foreign container",
        &outsider(&socket, &inside_foreign, None),
    );

    let report = d.client().status().unwrap();
    let usage = report.usage.iter().find(|u| u.lease == lease.id).unwrap();
    assert!(usage.clients.is_empty(), "nobody attached: {usage:?}");
    assert!(
        report.tokens.iter().all(|t| t.clients == 0),
        "nobody was scheduled: {:?}",
        report.tokens
    );
    assert!(report.connections.refused_peer >= 3 * every_request().len() as u64);

    // The check is not "refuse everyone": the lease's own container is served.
    let inside_owner = vec![
        "nsenter".to_owned(),
        "--target".to_owned(),
        owner.init.to_string(),
        "--pid".to_owned(),
        "--".to_owned(),
    ];
    let own = outsider(&socket, &inside_owner, None);
    assert_eq!(own.len(), every_request().len(), "{own:?}");
    for line in &own {
        assert!(
            !line.contains("PermissionDenied"),
            "the owner was refused: {line}"
        );
        // Charge and credit before an attach are out of order, as for anyone.
        let in_order = ["hello", "attach", "query", "schedule"]
            .iter()
            .any(|n| line.starts_with(n));
        if in_order {
            assert!(
                line.contains("answered"),
                "the owner was not served: {line}"
            );
        }
    }
    drop(foreign);
    drop(owner);
}

#[test]
fn a_lease_that_is_not_confirmed_serves_nobody() {
    let d = daemon(1, "16Gi").start();
    let lease = d
        .client()
        .reserve(request("unconfirmed", "1Gi", Priority::Low))
        .unwrap();
    let Err(err) = LeaseClient::connect(&d.lease_socket(&lease.id.0), T) else {
        panic!("an unconfirmed lease's socket answered");
    };
    let text = err.to_string();
    assert!(text.contains("not confirmed"), "{text}");
}

#[test]
fn a_frame_begun_and_never_finished_is_dropped() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let lease = c.reserve(request("slow", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "slow");
    let mut s = UnixStream::connect(d.lease_socket(&lease.id.0)).unwrap();
    write_message(
        &mut s,
        &LeaseRequest::Hello {
            protocol: PROTOCOL_VERSION,
        },
    )
    .unwrap();
    let _: LeaseResponse = read_message(&mut s).unwrap();
    // Two bytes of a four-byte header, then silence.
    s.write_all(&[0, 0]).unwrap();
    let bound = gpushare_arbiter::server::FRAME_TIMEOUT * 3;
    s.set_read_timeout(Some(bound)).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest)
        .expect("the arbiter closes a connection whose frame never completes");
    assert!(
        d.client().status().unwrap().connections.open == 0,
        "its place in the budget is given back"
    );
    // An idle connection between frames is not dropped: a ledger connection waits
    // for its process's next allocation for as long as that takes.
    let mut idle = LeaseClient::connect(&d.lease_socket(&lease.id.0), T).unwrap();
    idle.attach(0).unwrap();
    std::thread::sleep(gpushare_arbiter::server::FRAME_TIMEOUT + Duration::from_secs(1));
    assert!(idle.query().is_ok(), "an idle connection was dropped");
}
