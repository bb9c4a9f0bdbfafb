//! The token agent's decisions, as pure functions of what it observed (the page, the
//! launch counter, the clock, the waiting threads): table-tested here, executed by
//! `agent` (which does the I/O: draining, sending, reconnecting).

use gpushare_proto::token::{FLAG_CUT_OFF, HELD_UNTIL_RELEASED, NOT_HELD};
use gpushare_proto::TokenRequest;

/// The longest the agent sleeps without looking: bounds how late it notices a lost
/// connection (the arbiter's hang-up does not wake the futex).
pub const MAX_SLEEP_NS: u64 = 100_000_000;

/// The page's fields the agent reads, once per wake-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub deadline_ns: u64,
    pub grants: u64,
    pub flags: u32,
}

/// Everything one decision looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    pub page: Snapshot,
    /// The arbiter's end of the connection is gone.
    pub closed: bool,
    pub now_ns: u64,
    /// The process's launch counter.
    pub launches: u64,
    /// The process is busy though its launch counter stands still: a stream capture is
    /// under way (it is building a graph it will launch; releasing would also mean
    /// draining, which must not touch the capture), or a launching thread waits on the
    /// launch-ahead ring for its previous launch (a low kernel longer than the idle
    /// threshold, with the next one ready: releasing then cost a 1 ms-kernel job most
    /// of every window, simulated). Idle time that overlaps either does not count.
    pub busy: bool,
}

/// What the agent remembers between decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// `grants` as of the agent's last `Release`: a larger `grants` is a grant not yet
    /// answered (the token is, or was until a revocation, ours).
    pub answered_grants: u64,
    /// The grant whose idle clock runs (a new grant restarts it).
    pub seen_grant: u64,
    pub launches_seen: u64,
    /// When the launch counter last changed (or the grant began).
    pub launches_changed_ns: u64,
}

impl Memory {
    /// The state on a fresh page: nothing granted, nothing owed.
    pub fn fresh(grants: u64, launches: u64, now_ns: u64) -> Memory {
        Memory {
            answered_grants: grants,
            seen_grant: grants,
            launches_seen: launches,
            launches_changed_ns: now_ns,
        }
    }
}

/// Why the token goes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The arbiter revoked it (deadline 0 after a grant we had not answered).
    Revoked,
    /// The slice's deadline passed.
    Expired,
    /// Nothing was launched for the idle threshold.
    Idle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The connection is gone or cut off: apply the loss policy and reconnect.
    Lost { cut_off: bool },
    /// Drain the submitted work, then (see [`release_after_drain`]) release.
    Release(Reason),
    /// Nothing to do until the page changes or this many nanoseconds pass.
    Sleep { timeout_ns: u64 },
}

/// The agent's next step. Updates `memory`'s idle clock (a new grant or a changed
/// launch counter restarts it).
pub fn decide(seen: &Observation, memory: &mut Memory, idle_ns: u64) -> Action {
    let page = seen.page;
    if seen.closed || page.flags & FLAG_CUT_OFF != 0 {
        return Action::Lost {
            cut_off: page.flags & FLAG_CUT_OFF != 0,
        };
    }
    if page.grants != memory.seen_grant || seen.launches != memory.launches_seen || seen.busy {
        memory.seen_grant = page.grants;
        memory.launches_seen = seen.launches;
        memory.launches_changed_ns = seen.now_ns;
    }
    let owed = page.grants != memory.answered_grants;
    let held = page.deadline_ns == HELD_UNTIL_RELEASED || seen.now_ns < page.deadline_ns;
    let idle_sleep = Action::Sleep {
        timeout_ns: MAX_SLEEP_NS,
    };
    if page.deadline_ns == NOT_HELD {
        return if owed {
            Action::Release(Reason::Revoked)
        } else {
            idle_sleep
        };
    }
    if !held {
        return if owed {
            Action::Release(Reason::Expired)
        } else {
            idle_sleep
        };
    }
    if !owed {
        // Released already; the arbiter has not written its answer yet.
        return idle_sleep;
    }
    let idle_for = seen.now_ns.saturating_sub(memory.launches_changed_ns);
    if idle_for >= idle_ns {
        return Action::Release(Reason::Idle);
    }
    let mut timeout_ns = (idle_ns - idle_for).min(MAX_SLEEP_NS);
    if page.deadline_ns != HELD_UNTIL_RELEASED {
        timeout_ns = timeout_ns.min(page.deadline_ns - seen.now_ns);
    }
    Action::Sleep { timeout_ns }
}

/// The frame to send once the drain for `reason` has completed, or `None` when an
/// idle holder launched again meanwhile (it keeps the token). `again`: threads are
/// waiting to launch.
pub fn release_after_drain(
    reason: Reason,
    launches_before_drain: u64,
    launches_now: u64,
    waiters: u32,
) -> Option<TokenRequest> {
    if reason == Reason::Idle && launches_now != launches_before_drain {
        return None;
    }
    Some(TokenRequest::Release { again: waiters > 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: u64 = 1_000;
    const NOW: u64 = 1_000_000;

    fn seen(deadline_ns: u64, grants: u64, launches: u64, now_ns: u64) -> Observation {
        Observation {
            page: Snapshot {
                deadline_ns,
                grants,
                flags: 0,
            },
            closed: false,
            now_ns,
            launches,
            busy: false,
        }
    }

    /// (what the page and counter show, what the agent remembers) → what it does.
    #[test]
    fn decisions() {
        let sleep = |timeout_ns| Action::Sleep { timeout_ns };
        // Memory: one grant answered, the launch counter at 5 since NOW - 100.
        let memory = Memory {
            answered_grants: 1,
            seen_grant: 1,
            launches_seen: 5,
            launches_changed_ns: NOW - 100,
        };
        let max = HELD_UNTIL_RELEASED;
        let table: &[(&str, Observation, Action)] = &[
            (
                "not held, nothing owed",
                seen(0, 1, 5, NOW),
                sleep(MAX_SLEEP_NS),
            ),
            (
                "a grant then a revocation",
                seen(0, 2, 5, NOW),
                Action::Release(Reason::Revoked),
            ),
            (
                "a slice that ran out",
                seen(NOW - 1, 2, 5, NOW),
                Action::Release(Reason::Expired),
            ),
            (
                "an expired slice already released",
                seen(NOW - 1, 1, 5, NOW),
                sleep(MAX_SLEEP_NS),
            ),
            // A new grant restarts the idle clock: a full threshold, capped by the deadline.
            (
                "new grant, deadline sooner than idle",
                seen(NOW + 300, 2, 5, NOW),
                sleep(300),
            ),
            (
                "new grant, held until released",
                seen(max, 2, 5, NOW),
                sleep(IDLE),
            ),
            (
                "held, released already, not yet answered",
                seen(max, 1, 5, NOW),
                sleep(MAX_SLEEP_NS),
            ),
        ];
        for (what, observation, expected) in table {
            let mut m = memory;
            assert_eq!(decide(observation, &mut m, IDLE), *expected, "{what}");
        }
    }

    #[test]
    fn a_holder_that_stops_launching_releases_after_the_idle_threshold() {
        let mut memory = Memory::fresh(0, 0, NOW);
        // Granted (grant 1, until released); launches keep the clock fresh.
        assert_eq!(
            decide(&seen(u64::MAX, 1, 0, NOW), &mut memory, IDLE),
            Action::Sleep { timeout_ns: IDLE }
        );
        assert_eq!(
            decide(&seen(u64::MAX, 1, 3, NOW + 900), &mut memory, IDLE),
            Action::Sleep { timeout_ns: IDLE }
        );
        assert_eq!(
            decide(&seen(u64::MAX, 1, 3, NOW + 1500), &mut memory, IDLE),
            Action::Sleep { timeout_ns: 400 },
            "idle since NOW + 900"
        );
        assert_eq!(
            decide(&seen(u64::MAX, 1, 3, NOW + 1900), &mut memory, IDLE),
            Action::Release(Reason::Idle)
        );
        // Huge idle thresholds never oversleep a loss check.
        let mut memory = Memory::fresh(0, 0, NOW);
        assert_eq!(
            decide(&seen(u64::MAX, 1, 0, NOW), &mut memory, u64::MAX),
            Action::Sleep {
                timeout_ns: MAX_SLEEP_NS
            }
        );
    }

    #[test]
    fn an_idle_period_that_overlaps_a_capture_does_not_count() {
        let mut memory = Memory::fresh(0, 0, NOW);
        let mut capturing = seen(u64::MAX, 1, 0, NOW + 5 * IDLE);
        capturing.busy = true;
        // Nothing launched for five idle thresholds, but a capture is under way.
        assert_eq!(
            decide(&capturing, &mut memory, IDLE),
            Action::Sleep { timeout_ns: IDLE }
        );
        // The capture ended: the idle clock runs from its last sighting.
        assert_eq!(
            decide(
                &seen(u64::MAX, 1, 0, NOW + 5 * IDLE + 400),
                &mut memory,
                IDLE
            ),
            Action::Sleep {
                timeout_ns: IDLE - 400
            }
        );
        assert_eq!(
            decide(&seen(u64::MAX, 1, 0, NOW + 6 * IDLE), &mut memory, IDLE),
            Action::Release(Reason::Idle)
        );
    }

    #[test]
    fn loss_and_cut_off_come_first() {
        let mut memory = Memory::fresh(0, 0, NOW);
        let mut closed = seen(u64::MAX, 1, 0, NOW);
        closed.closed = true;
        assert_eq!(
            decide(&closed, &mut memory, IDLE),
            Action::Lost { cut_off: false }
        );
        let mut cut = seen(0, 1, 0, NOW);
        cut.page.flags = FLAG_CUT_OFF;
        assert_eq!(
            decide(&cut, &mut memory, IDLE),
            Action::Lost { cut_off: true }
        );
    }

    #[test]
    fn releases_after_the_drain() {
        let release = |again| Some(TokenRequest::Release { again });
        let table: &[(Reason, u64, u64, u32, Option<TokenRequest>)] = &[
            (Reason::Revoked, 1, 1, 0, release(false)),
            (Reason::Revoked, 1, 1, 2, release(true)),
            (Reason::Expired, 1, 4, 1, release(true)),
            (Reason::Idle, 7, 7, 0, release(false)),
            // It launched while draining: not idle after all.
            (Reason::Idle, 7, 8, 0, None),
        ];
        for &(reason, before, now, waiters, expected) in table {
            assert_eq!(
                release_after_drain(reason, before, now, waiters),
                expected,
                "{reason:?} {before} {now} {waiters}"
            );
        }
    }
}
