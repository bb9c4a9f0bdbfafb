use super::*;
use crate::process::ProcFs;
use crate::state::tests::{config, open_with_probe, request};
use gpushare_config::SchedulerConfig;
use gpushare_proto::{ContainerRef, Priority};

const GI: u64 = 1 << 30;

/// An arbiter with one lease of 1 GiB, reserved for container "c".
async fn reserved_lease() -> (tempfile::TempDir, ArbiterHandle, Arc<TokenService>, LeaseId) {
    let dir = tempfile::tempdir().unwrap();
    let arbiter = ArbiterHandle::new(open_with_probe(config(dir.path()), 1, Box::new(ProcFs)));
    let lease = arbiter
        .reserve(request("c", "1Gi", Priority::Low), std::future::pending())
        .await
        .unwrap()
        .unwrap();
    let tokens = TokenService::new(SchedulerConfig::default());
    (dir, arbiter, tokens, lease.id)
}

/// The lease confirmed by this test process, so the test's own connections
/// are inside "the container".
async fn confirmed_lease() -> (tempfile::TempDir, ArbiterHandle, Arc<TokenService>, LeaseId) {
    let (dir, arbiter, tokens, lease) = reserved_lease().await;
    let me = ContainerRef::id("c".into());
    arbiter.confirm(&me, std::process::id()).await.unwrap();
    (dir, arbiter, tokens, lease)
}

/// Admits and serves one connection of `lease` as the accept loop does, and
/// returns the client's end.
fn connect(arbiter: &ArbiterHandle, tokens: &Arc<TokenService>, lease: &LeaseId) -> UnixStream {
    let (client, served) = UnixStream::pair().unwrap();
    if let Ok(admitted) = admit_connection(served, lease, arbiter, tokens.budget()) {
        let (arbiter, tokens, lease) = (arbiter.clone(), tokens.clone(), lease.clone());
        tokio::spawn(async move {
            let _ = handle_lease_connection(admitted, &lease, &arbiter, &tokens).await;
        });
    }
    client
}

async fn exchange(client: &mut UnixStream, request: &LeaseRequest) -> LeaseResponse {
    write_frame(client, request).await.unwrap();
    read_frame(client).await.unwrap()
}

async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

fn hello() -> LeaseRequest {
    LeaseRequest::Hello {
        protocol: PROTOCOL_VERSION,
    }
}

/// The error's kind, or "ok" for any other answer.
fn kind(response: &LeaseResponse) -> String {
    match response {
        LeaseResponse::Error { kind, .. } => format!("{kind:?}"),
        _ => "ok".into(),
    }
}

#[tokio::test]
async fn a_connection_follows_the_rules_and_a_broken_rule_closes_it() {
    let (_dir, arbiter, tokens, lease) = confirmed_lease().await;
    let attach = LeaseRequest::Attach { memory_held: 0 };
    let charge = |bytes| LeaseRequest::Charge { bytes };
    let other_version = LeaseRequest::Hello {
        protocol: PROTOCOL_VERSION + 1,
    };
    // (what, the requests, each one's answer kind, closed after the last)
    let protocol = "Protocol";
    let scripts: Vec<(&str, Vec<LeaseRequest>, Vec<&str>, bool)> = vec![
        (
            "the ledger's order",
            vec![
                hello(),
                LeaseRequest::Query,
                attach.clone(),
                charge(GI),
                LeaseRequest::Credit { bytes: GI },
            ],
            vec!["ok"; 5],
            false,
        ),
        (
            "hello first",
            vec![LeaseRequest::Query],
            vec![protocol],
            true,
        ),
        (
            "another version is answered, then closed",
            vec![other_version],
            vec!["ok"],
            true,
        ),
        (
            "hello once",
            vec![hello(), hello()],
            vec!["ok", protocol],
            true,
        ),
        (
            "attach before charging",
            vec![hello(), charge(1)],
            vec!["ok", protocol],
            true,
        ),
        (
            "attach once",
            vec![hello(), attach.clone(), attach.clone()],
            vec!["ok", "ok", protocol],
            true,
        ),
        (
            "schedule not on the ledger's connection",
            vec![hello(), attach.clone(), LeaseRequest::Schedule],
            vec!["ok", "ok", protocol],
            true,
        ),
    ];
    for (what, requests, answers, closed) in scripts {
        let mut client = connect(&arbiter, &tokens, &lease);
        for (request, want) in requests.iter().zip(&answers) {
            let got = exchange(&mut client, request).await;
            assert_eq!(kind(&got), *want, "{what}: {request:?} got {got:?}");
        }
        write_frame(&mut client, &LeaseRequest::Query).await.ok();
        let after: Result<LeaseResponse, _> = read_frame(&mut client).await;
        assert_eq!(
            after.is_err(),
            closed,
            "{what}: closed afterwards? {after:?}"
        );
    }
}

#[tokio::test]
async fn an_attached_connection_charges_the_ledger_until_it_closes() {
    let (_dir, arbiter, tokens, lease) = confirmed_lease().await;
    let mut client = connect(&arbiter, &tokens, &lease);
    exchange(&mut client, &hello()).await;
    let LeaseResponse::Attached { pid, .. } =
        exchange(&mut client, &LeaseRequest::Attach { memory_held: 0 }).await
    else {
        panic!("not attached");
    };
    assert_eq!(pid, std::process::id(), "the pid comes from SO_PEERCRED");
    let over = exchange(&mut client, &LeaseRequest::Charge { bytes: GI + 1 }).await;
    assert!(
        matches!(over, LeaseResponse::Charged { granted: false, .. }),
        "{over:?}"
    );
    exchange(&mut client, &LeaseRequest::Charge { bytes: GI }).await;
    assert_eq!(arbiter.status().usage[0].memory_used, GI);
    drop(client);
    eventually("the detach credits the ledger", || {
        arbiter.status().usage[0].memory_used == 0
    })
    .await;
}

#[tokio::test]
async fn a_peer_outside_the_container_is_refused_before_anything() {
    // Reserved, never confirmed: nobody can be inside its container yet.
    let (_dir, arbiter, tokens, lease) = reserved_lease().await;
    let mut client = connect(&arbiter, &tokens, &lease);
    let answer: LeaseResponse = read_frame(&mut client).await.unwrap();
    assert_eq!(kind(&answer), "PermissionDenied", "{answer:?}");
    assert_eq!(tokens.budget().status().refused_peer, 1);
    // It never held one of the lease's places.
    assert_eq!(tokens.budget().status().open, 0);
}

#[tokio::test]
async fn sockets_opened_by_the_state_are_served_and_closed_through_the_channel() {
    let (dir, arbiter, tokens, lease) = confirmed_lease().await;
    let (mut endpoints, events) = SocketEndpoints::new(
        dir.path().join("sockets"),
        tokio::runtime::Handle::current(),
        tokens.clone(),
    );
    endpoints.open(&lease).unwrap();
    endpoints.open(&lease).unwrap();
    let path = dir
        .path()
        .join("sockets/leases")
        .join(&lease.0)
        .join(LEASE_SOCKET);
    // Connected before anything serves the socket: it waits in the backlog.
    let mut early = UnixStream::connect(&path).await.unwrap();
    tokio::spawn(serve_lease_sockets(events, arbiter.clone(), tokens.clone()));
    let answer = exchange(&mut early, &hello()).await;
    assert!(matches!(answer, LeaseResponse::Hello { .. }), "{answer:?}");
    endpoints.close(&lease);
    assert!(!path.exists(), "the directory goes with the lease");
    let after: Result<LeaseResponse, _> =
        tokio::time::timeout(Duration::from_secs(5), read_frame(&mut early))
            .await
            .unwrap();
    assert!(after.is_err(), "its connections are closed: {after:?}");
}

#[test]
fn a_refused_flood_is_logged_once_per_interval_with_its_count() {
    let t = Instant::now();
    let mut log = RefusalLog::default();
    let at = |ms| t + Duration::from_millis(ms);
    let rows = [
        (0, Some(1)),
        (1, None),
        (9_999, None),
        (10_000, Some(3)),
        (10_001, None),
        (30_000, Some(2)),
    ];
    for (ms, want) in rows {
        assert_eq!(log.due(at(ms)), want, "at {ms} ms");
    }
}
