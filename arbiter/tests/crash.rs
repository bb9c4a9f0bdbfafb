//! kill -9 of the arbiter at any moment loses no acknowledged lease, duplicates
//! none and leaks none.
//!
//! Workers reserve, confirm (with real child processes as containers) and
//! release in a loop, and kill some of their containers, while the main thread
//! SIGKILLs the arbiter at a random moment and restarts it, several times. After
//! each restart: every acknowledged, unreleased lease is there, none twice, no
//! acknowledged release came back. At the end every container is killed and
//! every lease (and lease directory) must go away through reconciliation.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use gpushare_proto::{ControlClient, LeaseId, Priority};

#[derive(Default)]
struct Book {
    /// Acknowledged reserves not (acknowledged as) released: lease → container.
    held: BTreeMap<LeaseId, String>,
    /// Reserves, confirms or releases in flight when the arbiter died: may or may not have happened.
    uncertain: BTreeSet<String>,
    released: BTreeSet<LeaseId>,
    /// Leases whose container the test killed: reconciliation may release them any time.
    killed: BTreeSet<LeaseId>,
    children: Vec<Child>,
}

fn worker(
    socket: std::path::PathBuf,
    round: usize,
    w: usize,
    book: Arc<Mutex<Book>>,
    stop: Arc<AtomicBool>,
) {
    let Ok(mut c) = ControlClient::connect(&socket, Duration::from_secs(10)) else {
        return;
    };
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let container = format!("r{round}-w{w}-{i}");
        let child = container_process();
        let pid = child.id();
        book.lock().unwrap().children.push(child);
        book.lock().unwrap().uncertain.insert(container.clone());
        let lease = match c.reserve(request(&container, "64Mi", Priority::Low)) {
            Ok(l) => l,
            Err(_) => return,
        };
        {
            let mut b = book.lock().unwrap();
            b.held.insert(lease.id.clone(), container.clone());
        }
        if c.confirm(container.clone(), pid).is_err() {
            return;
        }
        book.lock().unwrap().uncertain.remove(&container);
        match i % 4 {
            // Release a quarter of them through the control socket.
            0 => {
                book.lock().unwrap().uncertain.insert(container.clone());
                if c.release(lease.id.clone()).is_err() {
                    return;
                }
                let mut b = book.lock().unwrap();
                b.uncertain.remove(&container);
                b.held.remove(&lease.id);
                b.released.insert(lease.id);
            }
            // Kill the container of another quarter: reconciliation must release them.
            1 => {
                let mut b = book.lock().unwrap();
                b.killed.insert(lease.id.clone());
                // Children are shared by the workers: find this one's by pid.
                let child = b.children.iter_mut().find(|c| c.id() == pid).unwrap();
                let _ = child.kill();
                let _ = child.wait();
            }
            _ => {}
        }
    }
}

fn pseudo_random(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

#[test]
fn sigkill_during_reserve_and_release_loses_duplicates_and_leaks_nothing() {
    let mut d = daemon(4, "64Gi")
        .configure(|c| {
            c.arbiter.low_nums_limit = 10_000;
            c.arbiter.reconcile_grace_ms = 300;
            c.arbiter.watchdog_interval_ms = 200;
            c.arbiter.reserved_timeout_ms = 2_000;
        })
        .start();
    let book = Arc::new(Mutex::new(Book::default()));
    let mut seed = 0x9e3779b97f4a7c15u64 ^ std::process::id() as u64;
    for round in 0..4 {
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..4)
            .map(|w| {
                let (socket, book, stop) = (d.control_socket(), book.clone(), stop.clone());
                std::thread::spawn(move || worker(socket, round, w, book, stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200 + pseudo_random(&mut seed) % 400));
        d.kill();
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join().unwrap();
        }
        d.restart();

        let leases = d.client().list().unwrap();
        let b = book.lock().unwrap();
        let ids: Vec<&LeaseId> = leases.iter().map(|l| &l.id).collect();
        let unique: BTreeSet<&LeaseId> = ids.iter().copied().collect();
        assert_eq!(
            unique.len(),
            ids.len(),
            "round {round}: a lease listed twice"
        );
        let containers: BTreeSet<&str> = leases.iter().map(|l| l.container_id.as_str()).collect();
        assert_eq!(
            containers.len(),
            leases.len(),
            "round {round}: a container with two leases"
        );
        for released in &b.released {
            assert!(
                !unique.contains(released),
                "round {round}: acknowledged release of {released} came back"
            );
        }
        let mut checked = 0;
        for (id, container) in &b.held {
            // Leases of killed containers may already be reconciled away, and an
            // unacknowledged confirm may leave a lease unconfirmed (and so expire).
            if b.killed.contains(id) || b.uncertain.contains(container) {
                continue;
            }
            checked += 1;
            let lease = leases.iter().find(|l| &l.id == id);
            assert!(
                lease.is_some(),
                "round {round}: acknowledged lease {id} ({container}) lost; the log says:\n{}",
                d.log()
                    .lines()
                    .filter(|l| l.contains(&id.0) || l.contains(container.as_str()))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            assert_eq!(&lease.unwrap().container_id, container);
            assert!(
                lease.unwrap().pid.is_some(),
                "round {round}: acknowledged confirm of {id} lost"
            );
        }
        assert!(
            checked > 0 || round == 0,
            "round {round}: the test exercised live leases"
        );
        eprintln!(
            "round {round}: {} leases after restart, {} acknowledged held, {} released, {} uncertain",
            leases.len(),
            b.held.len(),
            b.released.len(),
            b.uncertain.len()
        );
    }
    // Kill every container: all leases, confirmed or never confirmed, must go.
    {
        let mut b = book.lock().unwrap();
        for child in &mut b.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    let mut c = d.client();
    wait_until(
        "every lease to be reconciled away",
        Duration::from_secs(30),
        || c.list().unwrap().is_empty(),
    );
    wait_until(
        "every lease directory to go",
        Duration::from_secs(10),
        || d.lease_dirs().is_empty(),
    );
}

/// `gpusharectl list | head -1`: the reader goes away before gpusharectl writes.
/// Every command must then exit quietly (status 0, nothing on stderr), not panic.
#[test]
fn gpusharectl_exits_quietly_into_a_closed_pipe() {
    let d = daemon(1, "16Gi").start();
    let mut c = d.client();
    for i in 0..3 {
        c.reserve(request(&format!("c{i}"), "1Gi", Priority::Low))
            .unwrap();
    }
    for args in [
        &["list"][..],
        &["list", "--json"],
        &["status"],
        &["status", "--json"],
        &["release", "no-such-lease"],
        &["drain", "0"],
        &["undrain", "0"],
    ] {
        // The read end is closed before gpusharectl starts: its first write fails
        // with EPIPE every time, not only when it loses a race with `head`.
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let out = std::process::Command::new(ctl())
            .arg("--config")
            .arg(d.config_path())
            .args(args)
            .stdout(std::process::Stdio::from(write))
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "gpusharectl {args:?} into a closed pipe: {:?}\n{stderr}",
            out.status
        );
    }
}
