use super::*;

#[test]
fn a_page_is_initialised_and_sealed_against_writable_mappings() {
    let (mapping, fd) = PageMapping::create(ClockOffset::default()).unwrap();
    assert_eq!(
        mapping.page().magic.load(Ordering::Relaxed),
        gpushare_proto::token::TOKEN_PAGE_MAGIC
    );
    let seals = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GET_SEALS).unwrap();
    assert_ne!(seals & libc::F_SEAL_SHRINK, 0);
    assert_ne!(seals & libc::F_SEAL_GROW, 0);
    if seals & libc::F_SEAL_FUTURE_WRITE != 0 {
        // SAFETY: probing a fresh mapping; unmapped right away if it succeeds.
        let writable = unsafe {
            nix::sys::mman::mmap(
                None,
                NonZeroUsize::new(TOKEN_PAGE_SIZE).unwrap(),
                nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        };
        assert!(writable.is_err(), "a client could map the page writable");
    }
    assert!(mapping.apply(&Action::Grant {
        client: 1,
        deadline_ns: 42,
        launch_ahead: 3,
    }));
    let page = mapping.page();
    assert_eq!(page.deadline_ns.load(Ordering::Acquire), 42);
    assert_eq!(page.launch_ahead.load(Ordering::Relaxed), 3);
    assert_eq!(page.grants.load(Ordering::Relaxed), 1);
    assert_eq!(page.seq.load(Ordering::Relaxed), 1);
    // Reports leave the page alone: an overdue client is neither woken nor flagged.
    assert!(!mapping.apply(&Action::Overdue { client: 1 }));
    assert_eq!(page.seq.load(Ordering::Relaxed), 1);
    assert_eq!(page.deadline_ns.load(Ordering::Acquire), 42);
    mapping.cut_off();
    assert_eq!(page.deadline_ns.load(Ordering::Acquire), NOT_HELD);
    assert_eq!(page.flags.load(Ordering::Relaxed), FLAG_CUT_OFF);
}

/// A client whose clock runs ten minutes behind reads its deadline and window in
/// its own clock: as long as they are on the arbiter's.
#[test]
fn a_shifted_clients_page_shows_instants_in_its_own_clock() {
    const BEHIND: i64 = -600_000_000_000;
    let (mapping, _fd) = PageMapping::create(ClockOffset(BEHIND)).unwrap();
    let page = mapping.page();
    let at = 700_000_000_000;
    mapping.apply(&Action::SetFitBy {
        client: 1,
        fit_by_ns: at + 5_000_000,
    });
    mapping.apply(&Action::Grant {
        client: 1,
        deadline_ns: at + 20_000_000,
        launch_ahead: 1,
    });
    assert_eq!(
        page.deadline_ns.load(Ordering::Acquire),
        100_000_000_000 + 20_000_000
    );
    assert_eq!(
        page.fit_by_ns.load(Ordering::Acquire),
        100_000_000_000 + 5_000_000
    );
    mapping.apply(&Action::SetFitBy {
        client: 1,
        fit_by_ns: gpushare_proto::token::FIT_UNBOUNDED,
    });
    assert_eq!(
        page.fit_by_ns.load(Ordering::Acquire),
        gpushare_proto::token::FIT_UNBOUNDED
    );
    mapping.apply(&Action::Revoke { client: 1 });
    assert_eq!(page.deadline_ns.load(Ordering::Acquire), NOT_HELD);
}

/// A client whose `Release` makes the policy step panic (0: none): stands in for
/// a bug no socket can reach, to show what a failed token thread does.
static PANIC_AT_RELEASE_OF: AtomicU64 = AtomicU64::new(0);

pub(super) fn maybe_inject_panic(event: &Event) {
    if let Event::Release { client, .. } = *event {
        if PANIC_AT_RELEASE_OF
            .compare_exchange(client, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            panic!("injected: a policy step fails while serving client {client}");
        }
    }
}

/// A token client of `service` on `lease`, through a lease socket's opening (as
/// `lease_connection` serves it) on a socket in `dir` (one per client).
fn token_client(
    service: &Arc<TokenService>,
    dir: &std::path::Path,
    lease: &str,
) -> gpushare_proto::token_client::TokenConnection {
    token_client_on(service, dir, lease, "GPU-0")
}

/// [`token_client`] on the token of `gpu`.
fn token_client_on(
    service: &Arc<TokenService>,
    dir: &std::path::Path,
    lease: &str,
    gpu: &str,
) -> gpushare_proto::token_client::TokenConnection {
    static SOCKETS: AtomicU64 = AtomicU64::new(0);
    let socket = SOCKETS.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("{lease}-{socket}.sock"));
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let served = service.clone();
    let lease = TokenLease {
        lease: LeaseId(lease.into()),
        gpu: gpu.into(),
        priority: Priority::Low,
        request: 0.0,
        limit: 1.0,
    };
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let hello: gpushare_proto::LeaseRequest = frame::read_message(&mut stream).unwrap();
        assert!(matches!(hello, gpushare_proto::LeaseRequest::Hello { .. }));
        let answer = LeaseResponse::Hello {
            protocol: gpushare_proto::PROTOCOL_VERSION,
        };
        frame::write_message(&mut stream, &answer).unwrap();
        let schedule: gpushare_proto::LeaseRequest = frame::read_message(&mut stream).unwrap();
        assert_eq!(schedule, gpushare_proto::LeaseRequest::Schedule);
        let permit = served.budget().admit(&lease.lease).unwrap();
        served.serve(stream, lease, None, permit);
    });
    let client =
        gpushare_proto::token_client::TokenConnection::open(&path, Duration::from_secs(10))
            .unwrap();
    server.join().unwrap();
    client
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A panic in the GPU's I/O thread drops only the connection it was serving; the
/// thread starts again, the other clients are granted as before, and the failure
/// shows in status (and so in the metrics and `/healthz`).
#[test]
fn a_token_thread_that_fails_is_restarted_and_shown_and_the_others_are_granted() {
    let dir = tempfile::tempdir().unwrap();
    let service = TokenService::new(SchedulerConfig::default());
    let a = token_client(&service, dir.path(), "a");
    let b = token_client(&service, dir.path(), "b");
    let held = |c: &gpushare_proto::token_client::TokenConnection| {
        c.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
    };
    a.send(TokenRequest::Want).unwrap();
    wait_for("a's grant", || held(&a));
    b.send(TokenRequest::Want).unwrap();
    wait_for("b waiting", || service.status()[0].waiting == 1);
    assert!(!held(&b));
    // Connections are numbered from 1 in the order they joined.
    PANIC_AT_RELEASE_OF.store(1, Ordering::SeqCst);
    a.send(TokenRequest::Release { again: false }).unwrap();
    wait_for("b's grant after the failure", || held(&b));
    wait_for("a dropped", || a.is_closed());
    let status = &service.status()[0];
    assert_eq!(status.thread_restarts, 1);
    assert!(status.thread_failed_recently);
    assert_eq!(status.clients, 1, "only the connection it was serving went");
    // And the restarted thread goes on serving.
    b.send(TokenRequest::Release { again: false }).unwrap();
    wait_for("b's release", || !held(&b));
    let c = token_client(&service, dir.path(), "c");
    c.send(TokenRequest::Want).unwrap();
    wait_for("a new client's grant", || held(&c));
}

/// A connection as the I/O thread holds it, with the peer's end.
fn connection() -> (Connection, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    let permit = ConnectionBudget::new(1, 1)
        .admit(&LeaseId("l".into()))
        .unwrap();
    (Connection::new(Arc::new(ours), permit), theirs)
}

fn pump(connection: &mut Connection) -> (Vec<TokenRequest>, Result<(), TokenError>) {
    let mut seen = Vec::new();
    let result = connection.pump(|r| seen.push(r));
    (seen, result)
}

#[test]
fn token_frames_are_bounded_and_must_be_requests() {
    for (bytes, expect) in [
        (
            frame::encode(&TokenRequest::Release { again: true }).unwrap(),
            "ok",
        ),
        (
            {
                let mut b = (1000u32).to_be_bytes().to_vec();
                b.extend([b'x'; 8]);
                b
            },
            "1004-byte",
        ),
        (frame::encode(&"hello").unwrap(), "not a token request"),
    ] {
        let (mut connection, mut theirs) = connection();
        theirs.write_all(&bytes).unwrap();
        match pump(&mut connection) {
            (seen, Ok(())) => {
                assert_eq!(expect, "ok");
                assert_eq!(seen, [TokenRequest::Release { again: true }]);
            }
            (_, Err(e)) => assert!(e.to_string().contains(expect), "{e}"),
        }
    }
}

#[test]
fn frames_split_across_reads_or_sharing_one_are_each_read_once() {
    let (mut connection, mut theirs) = connection();
    let want = frame::encode(&TokenRequest::Want).unwrap();
    let release = frame::encode(&TokenRequest::Release { again: false }).unwrap();
    // Half a frame: nothing yet, and the connection stays.
    theirs.write_all(&want[..3]).unwrap();
    assert!(matches!(pump(&mut connection), (seen, Ok(())) if seen.is_empty()));
    // Its rest and a whole second frame in one write.
    let mut rest = want[3..].to_vec();
    rest.extend(&release);
    theirs.write_all(&rest).unwrap();
    let (seen, result) = pump(&mut connection);
    assert!(result.is_ok());
    assert_eq!(
        seen,
        [TokenRequest::Want, TokenRequest::Release { again: false }]
    );
    assert_eq!(connection.filled, 0);
    // The peer closing ends it.
    drop(theirs);
    assert!(matches!(
        pump(&mut connection),
        (_, Err(TokenError::Frame(FrameError::Closed)))
    ));
}

fn held(c: &gpushare_proto::token_client::TokenConnection) -> bool {
    c.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
}

fn lease_time(service: &TokenService, lease: &LeaseId) -> LeaseTime {
    service
        .lease_times()
        .into_iter()
        .find(|t| &t.lease == lease)
        .unwrap()
}

/// Each GPU's token lists its own account of each lease (status, and so the metrics'
/// per-GPU series); the lease's token time is their sum.
#[test]
fn each_gpus_status_lists_its_own_account_of_a_lease_on_two_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let service = TokenService::new(SchedulerConfig::default());
    let lease = LeaseId("a".into());
    let on_0 = token_client_on(&service, dir.path(), "a", "GPU-0");
    let on_1 = token_client_on(&service, dir.path(), "a", "GPU-1");
    // GPU-0's token is held a while, GPU-1's briefly.
    on_0.send(TokenRequest::Want).unwrap();
    wait_for("the grant on GPU-0", || held(&on_0));
    std::thread::sleep(Duration::from_millis(50));
    on_0.send(TokenRequest::Release { again: false }).unwrap();
    on_1.send(TokenRequest::Want).unwrap();
    wait_for("the grant on GPU-1", || held(&on_1));
    on_1.send(TokenRequest::Release { again: false }).unwrap();
    let ended = |gpu: usize| service.status()[gpu].holders.is_empty();
    wait_for("both releases", || ended(0) && ended(1));
    let status = service.status();
    let accounts: Vec<(&str, Vec<&LeaseId>)> = status
        .iter()
        .map(|s| (s.gpu.as_str(), s.leases.iter().map(|a| &a.lease).collect()))
        .collect();
    assert_eq!(accounts, [("GPU-0", vec![&lease]), ("GPU-1", vec![&lease])]);
    let (time_0, time_1) = (
        status[0].leases[0].token_time_ms,
        status[1].leases[0].token_time_ms,
    );
    assert!(
        time_0 >= 50,
        "GPU-0 held 50 ms or more, its account says {time_0} ms"
    );
    // The sum is the lease's (not each account the whole repeated); ms are truncated
    // per account, so within a ms each.
    let total_ms = lease_time(&service, &lease).held_ns / 1_000_000;
    assert!(
        (time_0 + time_1..=time_0 + time_1 + 2).contains(&total_ms),
        "{time_0} + {time_1} ms against {total_ms} ms"
    );
}

/// Memory reclaim suspends a lease whose client holds the token and will not release
/// it (its process is about to be locked): the token passes to another lease's waiter
/// at once, whatever the grace; the lease's clients, one joining meanwhile included,
/// get nothing until it is resumed, and then take their turn.
#[test]
fn a_suspended_lease_loses_the_token_at_once_and_takes_its_turn_again_after_resumption() {
    let dir = tempfile::tempdir().unwrap();
    // A grace of a minute: only the suspension can pass the token on within the test.
    let service = TokenService::new(SchedulerConfig {
        revoke_grace_ms: 60_000,
        ..SchedulerConfig::default()
    });
    let lease_a = LeaseId("a".into());
    let a = token_client(&service, dir.path(), "a");
    let b = token_client(&service, dir.path(), "b");
    a.send(TokenRequest::Want).unwrap();
    wait_for("a's grant", || held(&a));
    b.send(TokenRequest::Want).unwrap();
    wait_for("b waiting", || service.status()[0].waiting == 1);
    service.suspend_lease(&lease_a);
    service.suspend_lease(&lease_a);
    // a never releases: its page says revoked, and b holds.
    assert!(!held(&a), "the suspended holder's page must say revoked");
    wait_for("b's grant", || held(&b));
    assert_eq!(service.suspended_leases(), vec![lease_a.clone()]);
    // Its hold ended at the suspension: its lease's account of token time stands still.
    // Until it releases, what its GPU may still be finishing counts as the client's
    // holding for the watchdog (the lock waits for that work), and that grows.
    let account = || lease_time(&service, &lease_a).held_ns;
    let holding = || -> u64 {
        service
            .holdings()
            .iter()
            .filter(|h| h.lease == lease_a)
            .map(|h| h.held_ns)
            .sum()
    };
    let (account_then, holding_then) = (account(), holding());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(account(), account_then);
    assert!(holding() > holding_then);
    // A new process of the suspended lease is suspended too.
    let a2 = token_client(&service, dir.path(), "a");
    a2.send(TokenRequest::Want).unwrap();
    wait_for("a2 waiting", || service.status()[0].waiting == 2);
    b.send(TokenRequest::Release { again: false }).unwrap();
    wait_for("b's release", || service.status()[0].holders.is_empty());
    let status = &service.status()[0];
    assert_eq!(status.waiting, 2, "a's and a2's wants are kept");
    assert!(!held(&a) && !held(&a2));
    assert_eq!((status.revocations, status.overdue), (1, 0));
    b.send(TokenRequest::Want).unwrap();
    wait_for("b's grant while a's lease is suspended", || held(&b));
    service.resume_lease(&lease_a);
    assert_eq!(service.suspended_leases(), Vec::<LeaseId>::new());
    // a's lease waits its turn: b's slice ends (b is revoked) and b drains.
    wait_for("b's revocation", || !held(&b));
    // The drain ended with the suspension: a's holding stands still now.
    let holding_resumed = holding();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(holding(), holding_resumed);
    b.send(TokenRequest::Release { again: false }).unwrap();
    // Both clients of the lease get their turn (which first depends on their usage
    // within the window, so on how long this test took).
    wait_for("a grant to the lease after the resumption", || {
        held(&a) || held(&a2)
    });
    let (first, second) = if held(&a) { (&a, &a2) } else { (&a2, &a) };
    first.send(TokenRequest::Release { again: false }).unwrap();
    wait_for("the other client's grant", || held(second));
    let a_time = lease_time(&service, &lease_a);
    assert_eq!(
        (a_time.revocations, a_time.overdue, a_time.overruns),
        (1, 0, 0)
    );
}

/// Suspensions are kept by lease for clients joining later, on any GPU, and end with
/// a resumption or with the lease.
#[test]
fn a_suspension_outlives_the_leases_clients_and_ends_with_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let service = TokenService::new(SchedulerConfig::default());
    let lease = LeaseId("a".into());
    // No client has joined yet: kept for the first one.
    service.suspend_lease(&lease);
    let a = token_client(&service, dir.path(), "a");
    a.send(TokenRequest::Want).unwrap();
    wait_for("a's want", || held(&a) || service.status()[0].waiting == 1);
    assert!(!held(&a), "a client of a suspended lease was granted");
    // Its only client goes and another comes: still suspended.
    drop(a);
    wait_for("a gone", || service.status()[0].clients == 0);
    let a2 = token_client(&service, dir.path(), "a");
    a2.send(TokenRequest::Want).unwrap();
    wait_for("a2's want", || {
        held(&a2) || service.status()[0].waiting == 1
    });
    assert!(!held(&a2), "a client of a suspended lease was granted");
    service.close_lease(&lease);
    assert_eq!(service.suspended_leases(), Vec::<LeaseId>::new());
    // Resuming a lease that is no longer suspended changes nothing.
    service.resume_lease(&lease);
    assert!(service.suspended_leases().is_empty());
}
