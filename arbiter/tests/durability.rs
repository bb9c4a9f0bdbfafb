//! Durability and robustness of the control path, through the real daemon.
//!
//! - A full `state_dir` (a small tmpfs, filled and freed while workers reserve
//!   and release with short client timeouts): the arbiter refuses changes
//!   cleanly, leaves no lease directory behind, accepts changes again by itself
//!   once space returns, and after SIGKILL and restart every acknowledged,
//!   unreleased lease is there.
//! - A lease id in the state log that is not a plain name stops the start.
//! - The control socket: bounded connections, half frames dropped, a reserve
//!   whose client disconnects while queued withdrawn.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gpushare_proto::frame::{read_message, write_message};
use gpushare_proto::{
    ClientError, ControlClient, ControlRequest, ControlResponse, LeaseId, Priority,
    PROTOCOL_VERSION,
};

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A small tmpfs, unmounted (lazily: the arbiter may still hold files) on drop.
struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .status()
            .expect("run mount");
        assert!(status.success(), "mount -t tmpfs on {}", path.display());
        Tmpfs {
            path: path.to_owned(),
        }
    }

    /// Writes until the file system is full; returns the filler's path.
    fn fill(&self) -> PathBuf {
        let path = self.path.join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).is_ok() {}
        // The last few bytes a 4 KiB chunk did not fit.
        while f.write_all(&[0u8]).is_ok() {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

#[derive(Default)]
struct Book {
    /// Reserves acknowledged and not (acknowledged as) released: lease → container.
    held: BTreeMap<LeaseId, String>,
    /// Releases answered with an error or not answered: may or may not have
    /// happened (the lease left memory before its record was refused).
    in_doubt: BTreeSet<LeaseId>,
    /// Containers whose reserve was refused: they must hold no lease.
    refused_containers: BTreeSet<String>,
    acknowledged: usize,
    refused: usize,
    timed_out: usize,
}

const CLIENT_TIMEOUT: Duration = Duration::from_millis(100);

fn worker(socket: PathBuf, w: usize, book: Arc<Mutex<Book>>, stop: Arc<AtomicBool>) {
    let mut client: Option<ControlClient> = None;
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) && i < 150 {
        i += 1;
        // A connection whose call failed is never used again: after a timeout
        // its late answer would be read as the answer to the next call.
        let c = match client.as_mut() {
            Some(c) => c,
            None => match ControlClient::connect(&socket, CLIENT_TIMEOUT) {
                Ok(c) => client.insert(c),
                Err(_) => {
                    book.lock().unwrap().timed_out += 1;
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
            },
        };
        let container = format!("w{w}-{i}");
        let lease = match c.reserve(request(&container, "64Mi", Priority::Low)) {
            Ok(lease) => lease,
            Err(e) => {
                let mut b = book.lock().unwrap();
                match e {
                    ClientError::Refused { .. } => {
                        b.refused += 1;
                        b.refused_containers.insert(container);
                    }
                    _ => b.timed_out += 1,
                }
                client = None;
                continue;
            }
        };
        {
            let mut b = book.lock().unwrap();
            b.acknowledged += 1;
            b.held.insert(lease.id.clone(), container);
        }
        if i % 2 == 0 {
            let released = c.release(lease.id.clone());
            let mut b = book.lock().unwrap();
            b.held.remove(&lease.id);
            match released {
                Ok(_) => {}
                Err(e) => {
                    match e {
                        ClientError::Refused { .. } => b.refused += 1,
                        _ => b.timed_out += 1,
                    }
                    b.in_doubt.insert(lease.id);
                    client = None;
                }
            }
        }
    }
}

fn lease_ids(d: &Arbiter) -> BTreeSet<String> {
    d.client()
        .list()
        .unwrap()
        .into_iter()
        .map(|l| l.id.0)
        .collect()
}

/// Every lease directory belongs to a lease the arbiter lists.
fn no_directory_without_a_lease(d: &Arbiter) -> bool {
    let ids = lease_ids(d);
    d.lease_dirs().iter().all(|dir| ids.contains(dir))
}

#[test]
fn a_full_state_dir_refuses_cleanly_recovers_by_itself_and_loses_no_acknowledged_lease() {
    if !is_root() {
        eprintln!("skipped: mounting a tmpfs as state_dir needs root");
        return;
    }
    let mut d = daemon(2, "64Gi")
        .configure(|c| {
            c.arbiter.low_nums_limit = 100_000;
            c.arbiter.admission_wait_ms = 200;
            c.arbiter.reserved_timeout_ms = 600_000;
        })
        .start();
    d.kill();
    // Small, so it fills at once; large enough that the workers' own records
    // (at most 4 x 150 reserves and releases, ~250 KiB) never fill it alone.
    let fs = Tmpfs::mount(&d.dir().join("state"), "1m");
    d.restart();

    let book = Arc::new(Mutex::new(Book::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (socket, book, stop) = (d.control_socket(), book.clone(), stop.clone());
            std::thread::spawn(move || worker(socket, w, book, stop))
        })
        .collect();

    // Stopping the arbiter for longer than the clients' timeout makes calls in
    // flight time out on the client while the arbiter still carries them out.
    let pause = |d: &Arbiter| {
        let pid = d.pid() as i32;
        // SAFETY: signals to the arbiter this test started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(CLIENT_TIMEOUT * 2);
        // SAFETY: as above, the arbiter this test started and stopped.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    };
    for cycle in 0..3 {
        std::thread::sleep(Duration::from_millis(150));
        pause(&d);
        std::thread::sleep(Duration::from_millis(150));
        let filler = fs.fill();
        pause(&d);
        // Full: a reserve is refused, saying why, and not with "restart".
        let mut c = d.client();
        let mut attempt = 0;
        let mut refused = String::new();
        wait_until(
            "a reserve refused for the full disk",
            Duration::from_secs(5),
            || {
                attempt += 1;
                let container = format!("full-{cycle}-{attempt}");
                match c.reserve(request(&container, "64Mi", Priority::Low)) {
                    Err(ClientError::Refused { message, .. }) => {
                        assert!(
                            message.contains("lease store") && !message.contains("restart"),
                            "{message}"
                        );
                        refused = container;
                        true
                    }
                    Err(e) => panic!("cycle {cycle}: {e}"),
                    Ok(lease) => {
                        // Made durable before the disk filled up: it counts as held.
                        book.lock().unwrap().held.insert(lease.id, container);
                        false
                    }
                }
            },
        );
        // The operator sees why in status (the recovery may already have
        // succeeded by the time status is asked only if space came back: not here).
        let failing = d.client().status().unwrap().store_failure;
        assert!(
            failing.as_deref().is_some_and(|f| !f.is_empty()),
            "status does not say the store is failing"
        );
        std::thread::sleep(Duration::from_millis(300));
        wait_until(
            "refused reserves to leave no lease and no lease directory behind",
            Duration::from_secs(3),
            || {
                let listed = d.client().list().unwrap();
                let b = book.lock().unwrap();
                !listed.iter().any(|l| {
                    l.container_id == refused || b.refused_containers.contains(&l.container_id)
                }) && no_directory_without_a_lease(&d)
            },
        );
        pause(&d);
        std::fs::remove_file(filler).unwrap();
        // Space is back: reserves succeed again, with no restart.
        let probe = format!("probe-{cycle}");
        let started = Instant::now();
        let lease = loop {
            let mut c = d.client();
            match c.reserve(request(&probe, "64Mi", Priority::Low)) {
                Ok(lease) => break lease,
                Err(e) => {
                    assert!(
                        started.elapsed() < Duration::from_secs(3),
                        "cycle {cycle}: reserves still fail 3 s after space returned: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        book.lock().unwrap().held.insert(lease.id, probe);
        assert_eq!(d.client().status().unwrap().store_failure, None);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert!(no_directory_without_a_lease(&d));

    d.kill();
    d.restart();
    let leases = d.client().list().unwrap();
    let b = book.lock().unwrap();
    // Releases that failed on the client yet happened: what a test counting
    // them as "not released" would report as acknowledged leases lost.
    let happened = b
        .in_doubt
        .iter()
        .filter(|id| !leases.iter().any(|l| &l.id == *id))
        .count();
    eprintln!(
        "{} reserves acknowledged, {} held at the end, {} refused, {} timed out, {} releases in doubt ({happened} of them happened), {} leases after restart",
        b.acknowledged,
        b.held.len(),
        b.refused,
        b.timed_out,
        b.in_doubt.len(),
        leases.len()
    );
    assert!(b.refused > 0, "the disk was full at some point");
    assert!(b.timed_out > 0, "client timeouts were exercised");
    for (id, container) in &b.held {
        let lease = leases.iter().find(|l| &l.id == id);
        assert!(
            lease.is_some_and(|l| &l.container_id == container),
            "acknowledged lease {id} ({container}) lost across the restart; the log says:\n{}",
            d.log()
                .lines()
                .filter(|l| l.contains(&id.0) || l.contains(container.as_str()))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let ids: BTreeSet<String> = leases.iter().map(|l| l.id.0.clone()).collect();
    let dirs: BTreeSet<String> = d.lease_dirs().into_iter().collect();
    assert_eq!(dirs, ids, "a directory for every lease and no other");
    d.client()
        .reserve(request("after-restart", "64Mi", Priority::Low))
        .unwrap();
    drop(b);
    drop(fs);
}

/// With no change coming to try it, the store is retried every second: once
/// space returns the in-memory table is written as a snapshot and the log,
/// whose tail the failed write may have torn, is emptied.
#[test]
fn a_freed_state_dir_is_written_again_without_waiting_for_a_change() {
    if !is_root() {
        eprintln!("skipped: mounting a tmpfs as state_dir needs root");
        return;
    }
    let mut d = daemon(1, "16Gi")
        .configure(|c| c.arbiter.low_nums_limit = 100_000)
        .start();
    d.kill();
    let fs = Tmpfs::mount(&d.dir().join("state"), "256k");
    d.restart();
    let mut c = d.client();
    let kept = c.reserve(request("kept", "1Gi", Priority::Low)).unwrap();
    let filler = fs.fill();
    let mut i = 0;
    wait_until("a refused reserve", Duration::from_secs(5), || {
        i += 1;
        match c.reserve(request(&format!("refused-{i}"), "64Mi", Priority::Low)) {
            Ok(_) => false,
            Err(e) => {
                assert!(e.to_string().contains("lease store"), "{e}");
                true
            }
        }
    });
    std::fs::remove_file(filler).unwrap();
    let state = d.dir().join("state");
    wait_until(
        "the table written as a snapshot, and the log emptied",
        Duration::from_secs(3),
        || {
            std::fs::read_to_string(state.join("leases.json")).is_ok_and(|s| s.contains(&kept.id.0))
                && std::fs::metadata(state.join("leases.log")).is_ok_and(|m| m.len() == 0)
        },
    );
    d.kill();
    d.restart();
    let leases = d.client().list().unwrap();
    let names: BTreeSet<&str> = leases.iter().map(|l| l.container_id.as_str()).collect();
    assert!(names.contains("kept"), "{names:?}");
    assert!(names.len() <= 1 + i, "{names:?}");
    drop(fs);
}

#[test]
fn a_lease_id_that_is_not_a_plain_name_in_the_state_log_stops_the_start() {
    let mut d = daemon(1, "16Gi").start();
    let lease = d
        .client()
        .reserve(request("c", "1Gi", Priority::Low))
        .unwrap();
    d.kill();
    let log_path = d.dir().join("state/leases.log");
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains(&lease.id.0), "{log}");
    std::fs::write(&log_path, log.replace(&lease.id.0, "../../x")).unwrap();
    std::fs::remove_dir_all(d.run_dir().join("leases")).unwrap();

    let log = d.dir().join("refused-start.log");
    let mut child = Command::new(ARBITER)
        .arg("--config")
        .arg(d.config_path())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(15) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the arbiter must refuse to start ({status:?}):\n{stderr}"
    );
    for piece in [
        "leases.log",
        "line 1",
        "lease id \"../../x\"",
        "a-z, 0-9 and '-'",
    ] {
        assert!(stderr.contains(piece), "{piece:?} in:\n{stderr}");
    }
    assert!(!d.dir().join("x").exists(), "nothing made outside run_dir");
    assert!(
        d.lease_dirs().is_empty(),
        "no lease directory: {:?}",
        d.lease_dirs()
    );
}

/// Connects and says hello; the connection stays open until dropped.
fn greeted(socket: &Path) -> Result<UnixStream, String> {
    let mut s = UnixStream::connect(socket).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write_message(
        &mut s,
        &ControlRequest::Hello {
            protocol: PROTOCOL_VERSION,
        },
    )
    .map_err(|e| e.to_string())?;
    match read_message::<ControlResponse>(&mut s).map_err(|e| e.to_string())? {
        ControlResponse::Hello { .. } => Ok(s),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn control_connections_are_bounded_and_a_freed_slot_is_usable_again() {
    let d = daemon(1, "16Gi").start();
    let socket = d.control_socket();
    let mut held: Vec<UnixStream> = (0..512)
        .map(|i| greeted(&socket).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    let refused = greeted(&socket).unwrap_err();
    assert!(
        refused.contains("too many control connections"),
        "{refused}"
    );
    held.pop();
    wait_until("a freed slot", Duration::from_secs(5), || {
        greeted(&socket).is_ok()
    });
    drop(held);
    wait_until("every slot back", Duration::from_secs(5), || {
        (0..8).all(|_| greeted(&socket).is_ok())
    });
}

/// Reads until the arbiter closes the connection; how long that took.
fn closed_within(mut s: UnixStream, bound: Duration) -> Duration {
    let start = Instant::now();
    s.set_read_timeout(Some(bound)).unwrap();
    let mut sink = Vec::new();
    match s.read_to_end(&mut sink) {
        Ok(_) => start.elapsed(),
        Err(e) => panic!("still open after {:?}: {e}", start.elapsed()),
    }
}

#[test]
fn a_silent_or_half_sent_control_connection_is_dropped() {
    let d = daemon(1, "16Gi").start();
    let socket = d.control_socket();
    let silent = UnixStream::connect(&socket).unwrap();
    let mut half = greeted(&socket).unwrap();
    // A header announcing 100 bytes, then two of them, then nothing.
    half.write_all(&[0, 0, 0, 100, b'{', b'"']).unwrap();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| closed_within(silent, Duration::from_secs(9)));
        let b = s.spawn(|| closed_within(half, Duration::from_secs(9)));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a >= Duration::from_secs(4), "silent: dropped after {a:?}");
    assert!(
        b >= Duration::from_secs(4),
        "half frame: dropped after {b:?}"
    );
    // The arbiter still answers.
    d.client().status().unwrap();
}

#[test]
fn a_reserve_whose_client_disconnects_while_queued_is_withdrawn() {
    let d = daemon(1, "16Gi")
        .configure(|c| c.arbiter.admission_wait_ms = 60_000)
        .start();
    let mut c = d.client();
    let full = c.reserve(request("full", "16Gi", Priority::Low)).unwrap();
    let mut s = greeted(&d.control_socket()).unwrap();
    write_message(
        &mut s,
        &ControlRequest::Reserve(request("gone", "8Gi", Priority::Low)),
    )
    .unwrap();
    wait_until("the reserve to queue", Duration::from_secs(5), || {
        c.status().unwrap().queue.len() == 1
    });
    drop(s);
    wait_until(
        "the queued reserve to be withdrawn",
        Duration::from_secs(2),
        || c.status().unwrap().queue.is_empty(),
    );
    c.release(full.id).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let left: Vec<String> = c
        .list()
        .unwrap()
        .into_iter()
        .map(|l| l.container_id)
        .collect();
    assert!(left.is_empty(), "nobody holds a lease, yet: {left:?}");
    assert!(d.lease_dirs().is_empty(), "{:?}", d.lease_dirs());
}

/// Finding 5, "lost acknowledged leases": a release the client gave up on
/// (timeout) still happens once the arbiter gets to it, so a test that counts
/// it as not released finds the lease "lost". And the connection it timed out
/// on is out of step: its next call reads the late answer.
#[test]
fn a_release_that_timed_out_on_the_client_still_happens() {
    let d = daemon(1, "16Gi").start();
    let lease = d
        .client()
        .reserve(request("c", "1Gi", Priority::Low))
        .unwrap();
    let mut c = ControlClient::connect(&d.control_socket(), Duration::from_millis(300)).unwrap();
    let pid = d.pid() as i32;
    // SAFETY: signals to the child this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let answer = c.release(lease.id.clone());
    // SAFETY: as above, the child this test started and stopped.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(answer.is_err(), "timed out: {answer:?}");
    wait_until("the release to happen", Duration::from_secs(5), || {
        d.client().list().unwrap().is_empty()
    });
    let next = c.list();
    eprintln!("the next call on the timed-out connection: {next:?}");
    assert!(
        !matches!(&next, Ok(leases) if !leases.is_empty()),
        "{next:?}"
    );
}
