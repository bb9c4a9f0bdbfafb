//! A clean stop: SIGTERM (or SIGINT) stops the arbiter at once, with every
//! acknowledged change folded into the snapshot, and the next start finds every
//! lease as a kill would have left it.

mod common;

use std::time::{Duration, Instant};

use common::{confirm_here, container_process, daemon, request, Arbiter};
use gpushare_proto::{LeaseClient, LeaseState, Priority};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

const T: Duration = Duration::from_secs(10);
const GI: u64 = 1 << 30;
/// Far more than a clean stop needs (milliseconds), far less than any timer in the
/// arbiter (the watchdog's pass, the store's retry, the hello timeout).
const PROMPTLY: Duration = Duration::from_secs(3);

/// Sends `signal` and reaps the arbiter: its exit status and how long it took,
/// or None when it was still running after `PROMPTLY` (then it is killed).
fn stop(d: &mut Arbiter, signal: Signal) -> Option<(WaitStatus, Duration)> {
    let pid = Pid::from_raw(d.pid() as i32);
    let sent = Instant::now();
    kill(pid, signal).unwrap();
    let mut stopped = None;
    while stopped.is_none() && sent.elapsed() < PROMPTLY {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)).unwrap() {
            WaitStatus::StillAlive => std::thread::sleep(Duration::from_millis(10)),
            status => stopped = Some((status, sent.elapsed())),
        }
    }
    // Reaped here or not, the kit forgets it (and kills it if it is still running).
    d.kill();
    stopped
}

#[test]
fn sigterm_stops_promptly_with_everything_durable_and_restart_finds_every_lease() {
    let mut d = daemon(2, "16Gi").start();
    let mut c = d.client();
    let reserved = c
        .reserve(request("reserved", "1Gi", Priority::Low))
        .unwrap();
    let confirmed = c
        .reserve(request("confirmed", "2Gi", Priority::High))
        .unwrap();
    let mut init = container_process();
    c.confirm("confirmed".into(), init.id()).unwrap();
    let attached = c
        .reserve(request("attached", "4Gi", Priority::Low))
        .unwrap();
    confirm_here(&mut c, "attached");
    let drained = c.drain("1".into(), true).unwrap();
    let mut client = LeaseClient::connect(&d.lease_socket(&attached.id.0), T).unwrap();
    client.attach(0).unwrap();
    assert!(client.charge(GI).unwrap().granted);
    drop(c);

    let stopped = stop(&mut d, Signal::SIGTERM);
    let log = d.log();
    let (status, took) = stopped.unwrap_or_else(|| {
        panic!("still running {PROMPTLY:?} after SIGTERM (killed); its log:\n{log}")
    });
    assert!(
        matches!(status, WaitStatus::Exited(_, 0)),
        "exit {status:?} after {took:?}; its log:\n{log}"
    );
    assert!(
        !d.control_socket().exists(),
        "the control socket is removed"
    );
    assert_eq!(
        d.lease_dirs().len(),
        3,
        "lease directories stay: containers hold them mounted"
    );
    assert!(
        client.query().is_err(),
        "the attached client's connection was closed"
    );

    // Flushed: the log is folded into the snapshot, which holds every lease.
    let state = d.config().arbiter.state_dir.clone();
    let log_len = std::fs::metadata(state.join("leases.log")).unwrap().len();
    assert_eq!(log_len, 0, "the lease log was not folded into the snapshot");
    let snapshot = std::fs::read_to_string(state.join("leases.json")).unwrap();
    for lease in [&reserved, &confirmed, &attached] {
        assert!(
            snapshot.contains(&lease.id.0),
            "{} missing from {snapshot}",
            lease.id
        );
    }

    d.restart();
    let mut c = d.client();
    let mut leases = c.list().unwrap();
    leases.sort_by(|a, b| a.container_id.cmp(&b.container_id));
    let found: Vec<(&str, LeaseState, Option<u32>)> = leases
        .iter()
        .map(|l| (l.container_id.as_str(), l.state, l.pid))
        .collect();
    assert_eq!(
        found,
        [
            ("attached", LeaseState::Confirmed, Some(std::process::id())),
            ("confirmed", LeaseState::Confirmed, Some(init.id())),
            ("reserved", LeaseState::Reserved, None),
        ]
    );
    let status = c.status().unwrap();
    assert!(
        status.gpus.iter().any(|g| g.uuid == drained && g.drained),
        "GPU {drained} is still drained"
    );
    // The client re-attaches with what it holds, and the ledger counts it again.
    let mut client = LeaseClient::connect(&d.lease_socket(&attached.id.0), T).unwrap();
    let (_, quota) = client.attach(GI).unwrap();
    assert_eq!(quota.memory_used, GI);
    assert!(!client.charge(3 * GI + 1).unwrap().granted, "4Gi quota");
    let _ = init.kill();
    let _ = init.wait();
}

#[test]
fn sigint_stops_it_too() {
    let mut d = daemon(1, "16Gi").start();
    d.client()
        .reserve(request("kept", "1Gi", Priority::Low))
        .unwrap();
    let stopped = stop(&mut d, Signal::SIGINT);
    let log = d.log();
    let (status, _) =
        stopped.unwrap_or_else(|| panic!("still running after SIGINT; its log:\n{log}"));
    assert!(
        matches!(status, WaitStatus::Exited(_, 0)),
        "{status:?}; log:\n{log}"
    );
}
