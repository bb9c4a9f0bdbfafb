//! The ledger watcher: one thread per process, started at its first attach (or first
//! context creation), that re-attaches the process to its lease as soon as the
//! arbiter is back after a restart — without waiting for the process's next CUDA
//! call. An idle process holding memory would otherwise be missing from the new
//! arbiter's ledger until it allocated again: its memory unaccounted (a sibling could
//! over-allocate), and the process itself reported, or killed, by the watchdog as
//! unregistered (what an upgrade of the arbiter does to every idle process).
//!
//! It waits, unlocked, in `poll` on the ledger connection for the peer's hang-up
//! (`POLLRDHUP`: the arbiter never writes unasked on a ledger connection, so plain
//! `POLLIN` would only be an answer another thread is about to read) and on an
//! eventfd that the link signals when it drops a connection itself. Then it runs one
//! step it was started with (the accounts' `reattach_step`: under their lock, drop a
//! closed connection, one attach attempt with what the process holds) and lets go; while the arbiter is
//! away it retries after 50 ms, doubling to a 400 ms ceiling. It never waits on
//! anything while holding the lock, and a CUDA call that holds the accounts (a
//! synchronising free) only delays it.
//!
//! Fork: the child has no watcher thread; its handler marks the watcher not started
//! and closes its copy of the eventfd (no lock, no allocation), and the child's own
//! first attach starts its own.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

/// What one re-attach step of the watcher found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reattach {
    /// Attached, on this descriptor.
    Open(RawFd),
    /// The arbiter cannot be reached (it is restarting).
    Away,
    /// It answered, and refused.
    Refused,
}

/// One re-attach step under the accounts' lock (`None`: the library went inert).
/// A plain function, so the watcher names nothing above it.
pub type Step = fn() -> Option<Reattach>;

/// The first retry after the arbiter went away (a restart takes about a second).
const FIRST_RETRY: Duration = Duration::from_millis(50);
/// The ceiling while it stays away: a restarted arbiter is seen within this.
const MAX_RETRY: Duration = Duration::from_millis(400);
/// After a refusal (the arbiter is there and said no: the lease is gone, or this peer
/// is not its container's): try again rarely, each try costs the arbiter a log line.
const AFTER_REFUSAL: Duration = Duration::from_secs(5);
/// An upper bound on one wait, should a wake-up ever be missed.
const SAFETY_NET_MS: libc::c_int = 10_000;

static STARTED: AtomicBool = AtomicBool::new(false);
/// The eventfd the link signals when it drops its connection (-1: none).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

/// Whether this process's watcher runs (or is starting).
pub fn started() -> bool {
    STARTED.load(Ordering::Acquire)
}

/// Starts the watcher once per process (again in a fork child), running `step`. Inert
/// in the unit tests, whose links come and go with their stand-in arbiters.
pub fn start(step: Step) {
    if cfg!(test) || !crate::config::is_active() || STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: eventfd with valid flags; the descriptor is ours.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    WAKE_FD.store(fd, Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("gpushare-ledger".into())
        .spawn(move || run(step));
    if let Err(e) = spawned {
        crate::log_error!(
            "cannot start the ledger watcher ({e}): after an arbiter restart this process re-attaches at its next allocation"
        );
    }
}

/// The link dropped its connection: re-attach now rather than at the next call.
pub fn wake() {
    let fd = WAKE_FD.load(Ordering::Acquire);
    if fd >= 0 {
        let one: u64 = 1;
        // SAFETY: 8 bytes from a valid u64 to our eventfd (non-blocking; a full
        // counter only means a wake-up is pending already).
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

/// Fork child: no watcher thread exists here; forget the parent's (async-signal-safe).
pub fn forget_after_fork() {
    STARTED.store(false, Ordering::Release);
    let fd = WAKE_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: the child's copy of the parent's eventfd, never used here again.
        unsafe { libc::close(fd) };
    }
}

fn run(step: Step) {
    let mut retry = FIRST_RETRY;
    loop {
        // One step under the lock, released before any wait.
        let Some(found) = step() else { return };
        match found {
            Reattach::Open(fd) => {
                retry = FIRST_RETRY;
                wait_for_hang_up(fd);
            }
            Reattach::Away => {
                std::thread::sleep(retry);
                retry = (retry * 2).min(MAX_RETRY);
            }
            Reattach::Refused => {
                retry = FIRST_RETRY;
                std::thread::sleep(AFTER_REFUSAL);
            }
        }
    }
}

/// Waits until the connection on `fd` is closed by the arbiter, or the link signals
/// that it dropped it. `fd` may be closed by another thread meanwhile: the next step
/// under the lock finds out what the link holds now.
fn wait_for_hang_up(fd: RawFd) {
    let wake = WAKE_FD.load(Ordering::Acquire);
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let count = if wake >= 0 { 2 } else { 1 };
    // SAFETY: `count` valid pollfds.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), count, SAFETY_NET_MS) };
    if rc > 0 && wake >= 0 && fds[1].revents & libc::POLLIN != 0 {
        let mut value: u64 = 0;
        // SAFETY: reads the eventfd's 8-byte counter into a valid u64 (resets it).
        unsafe { libc::read(wake, (&mut value as *mut u64).cast(), 8) };
    }
    if rc > 0 && fds[0].revents & libc::POLLNVAL != 0 {
        // Closed under us: the link's current connection is looked at next, after a
        // pause so that a descriptor closed for good cannot make this loop spin.
        std::thread::sleep(FIRST_RETRY);
    }
}
