//! The token policy's vocabulary: the events it is told, the actions it answers with,
//! and the snapshot it shows of itself.

use super::*;

/// One token connection, numbered by the I/O layer.
pub type ClientId = u64;
/// The lease a connection belongs to, numbered by the I/O layer: its clients share one
/// overrun record.
pub type LeaseKey = u64;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// A connection became a token connection. `request`/`limit`: the lease's compute
    /// fractions (0..=1).
    Join {
        client: ClientId,
        lease: LeaseKey,
        priority: Priority,
        request: f64,
        limit: f64,
    },
    Want {
        client: ClientId,
    },
    Release {
        client: ClientId,
        again: bool,
    },
    Leave {
        client: ClientId,
    },
    /// The client's waiting launch needs this much GPU time to fit a window (0: none
    /// waits for one).
    Need {
        client: ClientId,
        need_ns: u64,
    },
    /// The arbiter measured a process of `lease` busy on the GPU beyond its token time
    /// while a high-priority client was active (launches past the gate): the lease is
    /// penalised as for an overrun.
    Bypassed {
        lease: LeaseKey,
    },
    /// The lease's processes are about to be locked by the driver (memory reclaim):
    /// a client of it holding the token is revoked at once and not waited for, and
    /// none of its clients is granted until `Resume`. Their wants stay queued. A
    /// lease with no client here, or already suspended, is left as it is.
    Suspend {
        lease: LeaseKey,
    },
    /// The lease's processes run again: its clients are scheduled as usual.
    Resume {
        lease: LeaseKey,
    },
    /// The time given by `next_wakeup` has come.
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Grant {
        client: ClientId,
        deadline_ns: u64,
        launch_ahead: u32,
    },
    Revoke {
        client: ClientId,
    },
    /// The holder's launch-ahead bound follows high-priority activity (it started, or
    /// the last active high client went quiet or left) within its slice.
    SetLaunchAhead {
        client: ClientId,
        n: u32,
    },
    /// The client's admission window ([`FIT_UNBOUNDED`]: none). Comes before the
    /// `Grant` it belongs to, so the page shows it with the grant.
    SetFitBy {
        client: ClientId,
        fit_by_ns: u64,
    },
    /// A revoked client has not released within the grace period: report it (once).
    /// Its page is unchanged (it is already revoked) and it stays connected; the
    /// policy no longer waits for it.
    Overdue {
        client: ClientId,
    },
    /// The client just went overdue after a revocation beside an active high-priority
    /// client: its drain from `from_ns` on is the high job's time (report it; its
    /// lease is penalised).
    Overrun {
        client: ClientId,
        lease: LeaseKey,
        from_ns: u64,
    },
    /// An overdue client released at last and is an ordinary client again: report it.
    Recovered {
        client: ClientId,
        /// From the revocation to the release.
        drained_ns: u64,
    },
}

/// Counters and the current holders, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySnapshot {
    pub holders: Vec<ClientId>,
    pub waiting: usize,
    pub clients: usize,
    pub grants: u64,
    pub revocations: u64,
    /// Revoked clients that passed the grace period without releasing (a total).
    pub overdue_total: u64,
    /// Revoked clients overdue now (still draining past the grace period).
    pub overdue: Vec<ClientId>,
    /// Admission windows published to low holders (a total).
    pub windows: u64,
    /// Times the high-priority job came back while a low holder's window was still
    /// open: the rhythm mis-predicted (a total).
    pub early_returns: u64,
    /// The high-priority job's recent gaps (ns), oldest first.
    pub high_gaps: Vec<u64>,
    /// Waiting clients whose next launch fits no window now: (client, need ns).
    pub needs: Vec<(ClientId, u64)>,
    /// Revoked low holders still draining beside an active high client after the
    /// grace (a total).
    pub overruns: u64,
    /// Leases whose overrun penalty runs now.
    pub penalized: Vec<LeaseKey>,
    /// Leases suspended now (none of their clients is granted).
    pub suspended: Vec<LeaseKey>,
}
