//! The real daemon, driven through its sockets.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use gpushare_proto::frame::{read_message, write_message};
use gpushare_proto::{
    ClientError, ControlRequest, ControlResponse, ErrorKind, LeaseClient, LeaseRequest,
    LeaseResponse, LeaseState, Priority, PROTOCOL_VERSION,
};

const GI: u64 = 1 << 30;
const T: Duration = Duration::from_secs(10);

#[test]
fn reserve_confirm_list_status_and_release_through_the_control_socket() {
    let d = daemon(2, "16Gi").start();
    let mut c = d.client();
    let mut child = container_process();
    let lease = c.reserve(request("c1", "4Gi", Priority::High)).unwrap();
    assert_eq!(lease.memory_bytes, 4 * GI);
    assert_eq!(lease.state, LeaseState::Reserved);
    let socket = d.lease_socket(&lease.id.0);
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666, "any uid in the container may connect");
    c.confirm("c1".into(), child.id()).unwrap();
    let leases = c.list().unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].pid, Some(child.id()));
    let status = c.status().unwrap();
    assert_eq!(status.inventory_source, "declared");
    assert_eq!(status.driver_cuda_version, None);
    assert_eq!(
        status.gpus.iter().map(|g| g.memory_leased).sum::<u64>(),
        4 * GI
    );
    assert!(
        status.usage[0].cgroup.is_some(),
        "cgroup recorded at confirmation"
    );

    let text = d.ctl(&["status"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.lines().any(|l| l
            .split_whitespace()
            .take(3)
            .eq(["c1", lease.id.0.as_str(), "high"])),
        "{text}"
    );
    assert!(text.contains("WAITING: nothing waiting"), "{text}");

    assert!(c.release(lease.id.clone()).unwrap());
    assert!(!c.release(lease.id.clone()).unwrap(), "idempotent");
    assert!(!c.release_container("c1".into()).unwrap());
    assert!(!socket.exists());
    assert!(d.lease_dirs().is_empty());
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn a_reserve_that_does_not_fit_waits_and_is_admitted_when_a_release_makes_room() {
    let d = daemon(1, "16Gi")
        .configure(|c| c.arbiter.admission_wait_ms = 60_000)
        .start();
    let mut c = d.client();
    let big = c.reserve(request("big", "12Gi", Priority::Low)).unwrap();
    let socket = d.control_socket();
    let waiter = std::thread::spawn(move || {
        // A short client timeout: the reserve must still wait for the queue.
        let mut c =
            gpushare_proto::ControlClient::connect(&socket, Duration::from_secs(1)).unwrap();
        c.reserve(request("waiting", "8Gi", Priority::Low))
    });
    wait_until("the request to queue", T, || {
        c.status().unwrap().queue.len() == 1
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        !waiter.is_finished(),
        "still waiting after the client's own timeout"
    );
    let queued = &c.status().unwrap().queue[0];
    assert_eq!(
        (queued.container_id.as_str(), queued.position),
        ("waiting", 0)
    );
    c.release(big.id).unwrap();
    let lease = waiter.join().unwrap().unwrap();
    assert_eq!(lease.container_id, "waiting");
    assert!(c.status().unwrap().queue.is_empty());
}

#[test]
fn waiting_past_the_bound_fails_with_what_was_asked_and_what_is_free() {
    let d = daemon(1, "16Gi")
        .configure(|c| c.arbiter.admission_wait_ms = 500)
        .start();
    let mut c = d.client();
    c.reserve(request("big", "12Gi", Priority::Low)).unwrap();
    let err = c
        .reserve(request("late", "8Gi", Priority::Low))
        .unwrap_err();
    let ClientError::Refused { kind, message } = err else {
        panic!("{err}")
    };
    assert_eq!(kind, ErrorKind::Unplaceable);
    assert!(
        message.contains("low-priority request for 8Gi now"),
        "{message}"
    );
    assert!(
        message.contains("4Gi free, 8Gi wanted") && message.contains("GPU 0 (16Gi)"),
        "{message}"
    );
    // A request that can never fit fails at once, not after the bound.
    let err = c
        .reserve(request("huge", "17Gi", Priority::Low))
        .unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                kind: ErrorKind::InvalidRequest,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn lease_socket_attach_query_charge_credit() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let lease = c.reserve(request("c1", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "c1");
    let path = d.lease_socket(&lease.id.0);
    let mut a = LeaseClient::connect(&path, T).unwrap();
    let q = a.query().unwrap();
    assert_eq!(
        (q.memory_quota, q.memory_used, q.state),
        (GI, 0, LeaseState::Confirmed)
    );
    let (pid, q) = a.attach(0).unwrap();
    assert_eq!(pid, std::process::id(), "the pid comes from SO_PEERCRED");
    assert_eq!(
        q.lease, lease.id,
        "the lease comes from the socket, not the client"
    );
    let mut b = LeaseClient::connect(&path, T).unwrap();
    b.attach(0).unwrap();
    assert!(a.charge(GI / 2).unwrap().granted);
    let refused = b.charge(GI / 2 + 1).unwrap();
    assert_eq!(
        (refused.granted, refused.memory_used, refused.memory_quota),
        (false, GI / 2, GI)
    );
    assert!(b.charge(GI / 2).unwrap().granted, "exactly the quota");
    let status = c.status().unwrap();
    assert_eq!(status.usage[0].memory_used, GI);
    assert_eq!(status.usage[0].clients.len(), 2);
    // A process cannot credit what another charged.
    let err = b.credit(GI).unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Refused {
                kind: ErrorKind::InvalidRequest,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(b.credit(GI / 4).unwrap(), GI * 3 / 4);
    // A process that goes away gives its memory back.
    drop(a);
    wait_until("the closed connection's credit", T, || {
        c.status().unwrap().usage[0].memory_used == GI / 4
    });
    // A released lease's socket goes away and its clients are cut off.
    c.release(lease.id.clone()).unwrap();
    assert!(!path.exists());
    assert!(
        b.query().is_err(),
        "connections of a released lease are closed"
    );
}

#[test]
fn a_peer_from_another_pid_namespace_is_refused() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    // The "container": a process in its own pid namespace.
    let container = NamespacedContainer::start();
    let lease = c.reserve(request("ns", "1Gi", Priority::Low)).unwrap();
    c.confirm("ns".into(), container.init).unwrap();
    // Refused before it is answered anything, even its hello.
    let Err(err) = LeaseClient::connect(&d.lease_socket(&lease.id.0), T) else {
        panic!("a peer in another pid namespace was answered");
    };
    assert!(
        matches!(&err, ClientError::Refused { kind: ErrorKind::PermissionDenied, message } if message.contains("pid namespace")),
        "{err}"
    );
    drop(container);
}

/// Sends raw bytes, then reads until the arbiter closes the connection;
/// returns the frames it answered with.
fn poke(path: &std::path::Path, bytes: &[u8]) -> Vec<u8> {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    answer
}

fn hello_frame() -> Vec<u8> {
    gpushare_proto::frame::encode(&ControlRequest::Hello {
        protocol: PROTOCOL_VERSION,
    })
    .unwrap()
}

#[test]
fn bad_messages_close_only_their_connection_on_both_sockets() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let lease = c.reserve(request("c1", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "c1");
    let lease_path = d.lease_socket(&lease.id.0);
    let mut tenant = LeaseClient::connect(&lease_path, T).unwrap();
    tenant.attach(0).unwrap();
    assert!(tenant.charge(100).unwrap().granted);

    let oversized = ((gpushare_proto::frame::MAX_FRAME_BYTES + 1) as u32)
        .to_be_bytes()
        .to_vec();
    // Within the general bound, but far beyond any lease request: a container cannot make
    // the arbiter buffer it.
    let mut over_lease_bound = hello_frame();
    over_lease_bound
        .extend(((gpushare_proto::lease_socket::MAX_LEASE_REQUEST_BYTES + 1) as u32).to_be_bytes());
    over_lease_bound.extend(vec![
        b' ';
        gpushare_proto::lease_socket::MAX_LEASE_REQUEST_BYTES
            + 1
    ]);
    let mut garbage = 5u32.to_be_bytes().to_vec();
    garbage.extend_from_slice(b"{]]]}");
    let mut unknown_op = Vec::new();
    let body = br#"{"op":"format_disk"}"#;
    unknown_op.extend_from_slice(&(body.len() as u32).to_be_bytes());
    unknown_op.extend_from_slice(body);
    let status_first = gpushare_proto::frame::encode(&ControlRequest::Status).unwrap();
    let charge_first = gpushare_proto::frame::encode(&LeaseRequest::Charge { bytes: 1 }).unwrap();
    let mut charge_before_attach = hello_frame();
    charge_before_attach.extend(charge_first.clone());
    let mut double_hello = hello_frame();
    double_hello.extend(hello_frame());

    for (socket, name, bytes) in [
        (d.control_socket(), "oversized", oversized.clone()),
        (d.control_socket(), "garbage", garbage.clone()),
        (d.control_socket(), "unknown op", unknown_op.clone()),
        (d.control_socket(), "status before hello", status_first),
        (d.control_socket(), "hello twice", double_hello.clone()),
        (lease_path.clone(), "oversized", oversized),
        (
            lease_path.clone(),
            "over the lease request bound",
            over_lease_bound,
        ),
        (lease_path.clone(), "garbage", garbage),
        (lease_path.clone(), "unknown op", unknown_op),
        (lease_path.clone(), "charge before hello", charge_first),
        (
            lease_path.clone(),
            "charge before attach",
            charge_before_attach,
        ),
        (lease_path.clone(), "hello twice", double_hello),
    ] {
        let answer = poke(&socket, &bytes);
        // The connection was closed (read_to_end returned), with a protocol error as its last word.
        let mut frames = answer.as_slice();
        let mut last = None;
        while !frames.is_empty() {
            last = Some(read_message::<serde_json::Value>(&mut frames).unwrap());
        }
        let last = last.unwrap_or_else(|| panic!("{name}: no answer"));
        assert_eq!(
            last["kind"],
            "protocol",
            "{name} on {}: {last}",
            socket.display()
        );
        // Everyone else carries on.
        assert_eq!(
            c.list().unwrap().len(),
            1,
            "{name}: control client still served"
        );
        assert!(
            tenant.charge(1).unwrap().granted,
            "{name}: lease client still served"
        );
    }
    // A truncated frame then silence: the connection is dropped, nothing else.
    let answer = poke(&d.control_socket(), &[0, 0, 0, 9, b'{']);
    assert!(answer.is_empty() || read_message::<ControlResponse>(&mut answer.as_slice()).is_ok());
    assert_eq!(tenant.query().unwrap().memory_used, 100 + 12);
}

#[test]
fn a_lease_connection_that_never_says_hello_is_closed() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let lease = c.reserve(request("c1", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "c1");
    let mut silent = UnixStream::connect(d.lease_socket(&lease.id.0)).unwrap();
    // Far beyond the bound, so only a connection the arbiter closes ends this read.
    silent
        .set_read_timeout(Some(gpushare_proto::lease_socket::HELLO_TIMEOUT * 6))
        .unwrap();
    let mut answer = Vec::new();
    silent
        .read_to_end(&mut answer)
        .expect("the arbiter closes a silent connection");
    let last: serde_json::Value = read_message(&mut answer.as_slice()).unwrap();
    assert_eq!(last["kind"], "protocol", "{last}");
    assert!(
        last["message"].as_str().unwrap().contains("no hello"),
        "{last}"
    );
}

#[test]
fn another_protocol_version_is_told_ours_and_closed() {
    let d = daemon(1, "16Gi").start();
    let mut s = UnixStream::connect(d.control_socket()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write_message(&mut s, &ControlRequest::Hello { protocol: 99 }).unwrap();
    match read_message::<ControlResponse>(&mut s).unwrap() {
        ControlResponse::Hello { protocol, .. } => assert_eq!(protocol, PROTOCOL_VERSION),
        other => panic!("{other:?}"),
    }
    let mut rest = Vec::new();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "closed");
    let mut c = d.client();
    let lease = c.reserve(request("c", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "c");
    let mut s = UnixStream::connect(d.lease_socket(&lease.id.0)).unwrap();
    write_message(&mut s, &LeaseRequest::Hello { protocol: 99 }).unwrap();
    assert_eq!(
        read_message::<LeaseResponse>(&mut s).unwrap(),
        LeaseResponse::Hello {
            protocol: PROTOCOL_VERSION
        }
    );
}

#[test]
fn drain_and_undrain_from_gpusharectl() {
    let d = daemon(2, "16Gi").start();
    let out = d.ctl(&["drain", "0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("drained {}", sim_uuid(0))
    );
    let mut c = d.client();
    for i in 0..3 {
        let lease = c
            .reserve(request(&format!("c{i}"), "1Gi", Priority::Low))
            .unwrap();
        assert_eq!(
            lease.gpus,
            vec![sim_uuid(1)],
            "a drained GPU takes no new lease"
        );
    }
    let out = d.ctl(&["drain", "7"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no shared GPU \"7\""));
    let json: serde_json::Value =
        serde_json::from_slice(&d.ctl(&["status", "--json"]).stdout).unwrap();
    assert_eq!(json["gpus"][0]["drained"], true);
    assert!(d.ctl(&["undrain", &sim_uuid(0)]).status.success());
    let mut on_gpu0 = request("after", "1Gi", Priority::High);
    on_gpu0.gpu = gpushare_proto::GpuSelector::Index(vec![0]);
    let lease = c.reserve(on_gpu0).unwrap();
    assert_eq!(lease.gpus, vec![sim_uuid(0)], "GPU 0 takes leases again");
}

#[test]
fn a_second_arbiter_on_the_same_state_refuses_to_start() {
    let d = daemon(1, "16Gi").start();
    let out = std::process::Command::new(ARBITER)
        .arg("--config")
        .arg(d.config_path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another gpushare-arbiter"), "{err}");
    assert_eq!(
        d.client().list().unwrap().len(),
        0,
        "the first one is untouched"
    );
}

#[test]
fn restart_reloads_leases_recreates_sockets_and_releases_dead_containers() {
    let mut d = daemon(2, "16Gi")
        .configure(|c| {
            c.arbiter.reconcile_grace_ms = 500;
            c.arbiter.watchdog_interval_ms = 200;
        })
        .start();
    let mut c = d.client();
    let mut live = container_process();
    let mut doomed = container_process();
    let kept = c.reserve(request("live", "2Gi", Priority::High)).unwrap();
    c.confirm("live".into(), live.id()).unwrap();
    let gone = c.reserve(request("doomed", "2Gi", Priority::Low)).unwrap();
    c.confirm("doomed".into(), doomed.id()).unwrap();
    let mut tenant = LeaseClient::connect(&d.lease_socket(&kept.id.0), T).unwrap();
    tenant.attach(0).unwrap();
    assert!(tenant.charge(GI).unwrap().granted);

    d.kill();
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    d.restart();

    let mut c = d.client();
    // The live container's client reconnects to its re-created socket and re-attaches
    // with what it holds, so the ledger is whole again.
    let mut tenant = LeaseClient::connect(&d.lease_socket(&kept.id.0), T).unwrap();
    let (_, q) = tenant.attach(GI).unwrap();
    assert_eq!((q.memory_used, q.state), (GI, LeaseState::Confirmed));
    assert!(!tenant.charge(GI * 2).unwrap().granted);
    wait_until(
        "the dead container's lease to be released",
        Duration::from_secs(20),
        || c.list().unwrap().len() == 1,
    );
    let leases = c.list().unwrap();
    assert_eq!(leases[0].id, kept.id);
    assert_eq!(leases[0].pid, Some(live.id()));
    assert_eq!(d.lease_dirs(), vec![kept.id.0.clone()]);
    assert!(!d.lease_socket(&gone.id.0).exists());
    assert!(d.log().contains("released by reconciliation"));
    live.kill().unwrap();
    live.wait().unwrap();
    wait_until(
        "the live one after it dies too",
        Duration::from_secs(20),
        || c.list().unwrap().is_empty(),
    );
}

#[test]
fn metrics_endpoint_serves_prometheus_text() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let d = daemon(1, "16Gi")
        .configure(|c| c.arbiter.metrics_address = Some(format!("127.0.0.1:{port}")))
        .start();
    d.client()
        .reserve(request("m", "1Gi", Priority::High))
        .unwrap();
    let get = |path: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    };
    let text = get("/metrics");
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\n"),
        "{text}"
    );
    assert!(
        text.contains("gpushare_leases{priority=\"high\",state=\"reserved\"} 1"),
        "{text}"
    );
    assert!(text.contains(&format!(
        "gpushare_gpu_memory_leased_bytes{{gpu=\"{}\",gpu_index=\"0\"}} {}",
        sim_uuid(0),
        GI
    )));
    assert!(get("/").starts_with("HTTP/1.1 404"));
}

/// A container that opens connection after connection on its own lease socket is
/// cut off at the cap; other leases and the control socket keep working.
#[test]
fn a_flood_of_connections_on_one_lease_socket_is_capped() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    let flooded = c.reserve(request("flood", "1Gi", Priority::Low)).unwrap();
    let other = c.reserve(request("quiet", "1Gi", Priority::Low)).unwrap();
    confirm_here(&mut c, "flood");
    confirm_here(&mut c, "quiet");
    let path = d.lease_socket(&flooded.id.0);
    let cap = gpushare_arbiter::connections::MAX_CONNECTIONS_PER_LEASE;
    // Held open: each accepted connection waits for its hello.
    let held: Vec<UnixStream> = (0..cap + 20)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    let mut probe = UnixStream::connect(&path).unwrap();
    probe.set_read_timeout(Some(T)).unwrap();
    let mut byte = [0u8; 1];
    // The arbiter closes connections beyond the cap at once: EOF, not a timeout.
    assert_eq!(
        probe.read(&mut byte).unwrap(),
        0,
        "a connection past the cap is closed"
    );
    let mut quiet = LeaseClient::connect(&d.lease_socket(&other.id.0), T).unwrap();
    quiet.attach(0).unwrap();
    assert!(
        quiet.charge(GI / 2).unwrap().granted,
        "other leases are unaffected"
    );
    assert_eq!(
        c.status().unwrap().leases.len(),
        2,
        "the control socket is unaffected"
    );
    drop(held);
}

/// Under systemd (`Type=notify`) the arbiter says READY=1 only once its control socket
/// answers, so the engines ordered after it find a socket that serves; and STOPPING=1
/// when asked to stop.
#[test]
fn the_arbiter_tells_systemd_it_is_ready_once_its_control_socket_answers() {
    use std::os::unix::net::UnixDatagram;
    let builder = daemon(1, "16Gi");
    let dir = builder.dir().to_owned();
    let config = builder.config().clone();
    let config_path = dir.join("notify-config.toml");
    std::fs::write(&config_path, config.to_toml().unwrap()).unwrap();
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(T)).unwrap();
    let mut arbiter = std::process::Command::new(ARBITER)
        .arg("--config")
        .arg(&config_path)
        .env("NOTIFY_SOCKET", &notify_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut message = [0u8; 256];
    let n = notify
        .recv(&mut message)
        .unwrap_or_else(|e| panic!("no readiness within {T:?}: {e}"));
    let said = String::from_utf8_lossy(&message[..n]).into_owned();
    assert!(said.lines().any(|l| l == "READY=1"), "{said:?}");
    // At once, with no retry: the socket it announced serves.
    let stream = UnixStream::connect(config.arbiter.control_socket())
        .expect("the control socket accepts once READY=1 is sent");
    drop(stream);
    let status = gpushare_proto::ControlClient::connect(&config.arbiter.control_socket(), T)
        .unwrap()
        .status()
        .unwrap();
    assert_eq!(status.gpus.len(), 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(arbiter.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let n = notify.recv(&mut message).expect("STOPPING=1 at the stop");
    assert!(String::from_utf8_lossy(&message[..n])
        .lines()
        .any(|l| l == "STOPPING=1"));
    assert!(arbiter.wait().unwrap().success());
}
