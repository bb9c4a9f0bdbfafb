//! The launch gate: every kernel-submitting entry point (`cuLaunchKernel`, `…Ex`,
//! `…CooperativeKernel`, `cuGraphLaunch`, the legacy `cuLaunch*`, each `_ptsz`)
//! passes [`admit`] before it reaches the driver.
//!
//! Shape, for the time-slice scheduler that fills it: the process holds the GPU's
//! token until `TOKEN_DEADLINE_NS` (CLOCK_MONOTONIC). A launch while holding it costs
//! one atomic load and, when the token can expire, one vDSO clock read — no system
//! call, lock or allocation. Only an expired token takes the cold path, which is
//! where the scheduler's IPC (hand-off, revocation) will go. Today no scheduler
//! exists, so the token is held for ever and the clock is never read.

use std::sync::atomic::{AtomicU64, Ordering};

/// The deadline of a token that is never revoked.
pub const HELD_FOREVER: u64 = u64::MAX;

static TOKEN_DEADLINE_NS: AtomicU64 = AtomicU64::new(HELD_FOREVER);

/// What is being submitted (for the scheduler's accounting). Launches made while
/// their stream is being captured pass here too, though they run nothing until
/// their graph is launched: the scheduler's slow path must let them through
/// (`cuStreamIsCapturing`) and gate the `cuGraphLaunch` instead. The fast path
/// never asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    Kernel,
    Cooperative,
    Graph,
    Legacy,
}

/// Returns when the process may submit GPU work.
#[inline(always)]
pub fn admit(launch: Launch) {
    let deadline = TOKEN_DEADLINE_NS.load(Ordering::Acquire);
    if deadline == HELD_FOREVER {
        return;
    }
    if monotonic_ns() < deadline {
        return;
    }
    wait_for_token(launch);
}

/// The scheduler's slow path: today nothing can expire a token, so nothing waits.
#[cold]
#[inline(never)]
fn wait_for_token(_launch: Launch) {}

/// CLOCK_MONOTONIC in nanoseconds (vDSO: no system call).
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A forked child holds no token: its parent's belongs to the parent.
pub fn reset_after_fork() {
    TOKEN_DEADLINE_NS.store(HELD_FOREVER, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_child_gives_up_its_parents_token_state() {
        // A parent whose token had a deadline (expired long ago)...
        TOKEN_DEADLINE_NS.store(1, Ordering::Release);
        reset_after_fork();
        // ...leaves the child with the no-scheduler state, not the parent's deadline.
        assert_eq!(TOKEN_DEADLINE_NS.load(Ordering::Acquire), HELD_FOREVER);
    }

    #[test]
    fn the_gate_clock_is_monotonic_nanoseconds() {
        let before = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let elapsed = monotonic_ns() - before;
        assert!(elapsed >= 2_000_000, "{elapsed} ns for a 2 ms sleep");
        assert!(elapsed < 10_000_000_000, "{elapsed} ns: not nanoseconds");
    }
}
