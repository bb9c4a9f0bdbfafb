//! Which leases no longer have a container: pure decisions over what the
//! process probe says, the clock and the configured bounds.
//!
//! The runtime's own poststop release is the normal path; reconciliation is the
//! backstop for containers that died while the arbiter was down, runtimes that
//! crashed, and reservations whose container was never created.

use std::time::{Duration, Instant};

use crate::process::ProcessProbe;
use crate::store::LeaseRecord;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// The confirmed pid is alive and is the same process.
    Alive,
    /// The confirmed pid is dead, a zombie, or reused by another process.
    Gone,
    /// Never confirmed: no pid to look at.
    Unconfirmed,
}

pub fn presence(record: &LeaseRecord, probe: &dyn ProcessProbe) -> Presence {
    let Some(pid) = record.lease.pid else {
        return Presence::Unconfirmed;
    };
    match (probe.start_time(pid), record.pid_start_time) {
        (None, _) => Presence::Gone,
        (Some(now), Some(recorded)) if now != recorded => Presence::Gone,
        _ => Presence::Alive,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// Looks gone: keep for the grace period, remembering since when.
    Suspect,
    Release(String),
}

pub struct Bounds {
    pub grace: Duration,
    pub reserved_timeout: Duration,
}

/// `suspect_since`: when this lease was first seen gone (None: not seen yet).
/// `age`: time since the lease was reserved (monotonic while the arbiter runs; see
/// `Arbiter::reconcile`).
pub fn decide(
    presence: Presence,
    suspect_since: Option<Instant>,
    now: Instant,
    age: Duration,
    bounds: &Bounds,
) -> Verdict {
    match presence {
        Presence::Alive => Verdict::Keep,
        Presence::Gone => match suspect_since {
            Some(since) if now.duration_since(since) >= bounds.grace => {
                Verdict::Release("its container is gone".into())
            }
            _ => Verdict::Suspect,
        },
        Presence::Unconfirmed if age >= bounds.reserved_timeout => Verdict::Release(format!(
            "reserved {}s ago and never confirmed",
            age.as_secs()
        )),
        Presence::Unconfirmed => Verdict::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::tests::FakeProcs;
    use gpushare_proto::{Fraction, Lease, LeaseId, LeaseState, Priority};

    fn record(pid: Option<u32>, start: Option<u64>) -> LeaseRecord {
        LeaseRecord {
            lease: Lease {
                id: LeaseId("l".into()),
                container_id: "c".into(),
                namespace: None,
                sandbox_id: None,
                gpus: vec![],
                priority: Priority::Low,
                memory_bytes: 0,
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                tenant: None,
                state: if pid.is_some() {
                    LeaseState::Confirmed
                } else {
                    LeaseState::Reserved
                },
                pid,
                created_unix_ms: 0,
                pod: None,
            },
            cgroup: None,
            pid_start_time: start,
        }
    }

    #[test]
    fn presence_from_the_confirmed_pid() {
        let procs = FakeProcs::default().with(10, 500, "ns", "/");
        assert_eq!(
            presence(&record(Some(10), Some(500)), &procs),
            Presence::Alive
        );
        assert_eq!(presence(&record(Some(10), None), &procs), Presence::Alive);
        assert_eq!(
            presence(&record(Some(10), Some(499)), &procs),
            Presence::Gone,
            "same pid, another process: reused"
        );
        assert_eq!(presence(&record(Some(11), Some(1)), &procs), Presence::Gone);
        assert_eq!(presence(&record(None, None), &procs), Presence::Unconfirmed);
    }

    #[test]
    fn verdicts() {
        let t = Instant::now();
        let bounds = Bounds {
            grace: Duration::from_secs(5),
            reserved_timeout: Duration::from_secs(300),
        };
        let young = Duration::from_secs(1);
        let s = |secs| t + Duration::from_secs(secs);
        let rows = [
            (
                "alive is kept",
                Presence::Alive,
                None,
                t,
                young,
                Verdict::Keep,
            ),
            (
                "alive again clears suspicion",
                Presence::Alive,
                Some(t),
                s(60),
                young,
                Verdict::Keep,
            ),
            (
                "gone: first sight starts the grace",
                Presence::Gone,
                None,
                t,
                young,
                Verdict::Suspect,
            ),
            (
                "gone within the grace: wait",
                Presence::Gone,
                Some(t),
                s(4),
                young,
                Verdict::Suspect,
            ),
            (
                "gone past the grace: release",
                Presence::Gone,
                Some(t),
                s(5),
                young,
                Verdict::Release("its container is gone".into()),
            ),
            (
                "unconfirmed and young: keep",
                Presence::Unconfirmed,
                None,
                t,
                Duration::from_secs(299),
                Verdict::Keep,
            ),
            (
                "unconfirmed too long: release",
                Presence::Unconfirmed,
                None,
                t,
                Duration::from_secs(300),
                Verdict::Release("reserved 300s ago and never confirmed".into()),
            ),
        ];
        for (what, presence, since, now, age, want) in rows {
            assert_eq!(decide(presence, since, now, age, &bounds), want, "{what}");
        }
    }
}
