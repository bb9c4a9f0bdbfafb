//! The lease sockets' connection budget: how many connections one lease and the
//! whole node may hold, counting every kind (ledger and token connections alike).
//!
//! Why both bounds: a container is untrusted and may open connections without end.
//! The first version bounded only the async ledger connections of a lease; a
//! connection that asked to be scheduled left that count for a thread of its own,
//! and one container opened 3,000 of them (3,007 threads, 6,017 descriptors) until
//! the arbiter could no longer accept another container's reserve. Now a permit is
//! taken at accept and travels with the connection whatever it becomes, so one lease
//! can never hold more than `per_lease`, nor all leases together more than `total`,
//! and `total` leaves descriptors for the control socket and the arbiter's own files.
//!
//! Why a floor: the two bounds alone are first come, first served. Containers that
//! each stay within `per_lease` can together fill `total` (four at a 2,048-descriptor
//! limit, 64 at the shipped bounds), and then a new container's process, however
//! high its priority, is refused. So every live lease (one whose socket is served)
//! is guaranteed a floor of connections whatever the others do, and one floor more
//! is kept for the next lease to start: [`fair_floor`]. The rest of `total` is shared
//! first come, first served, but a lease may take a connection from it only while
//! every live lease's unused floor stays free ([`decide`]), so a lease beyond its
//! floor is refused first when the node fills. A lease that starts while the shared
//! part is overcommitted gets its floor as others' connections close: existing
//! connections are never cut.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpushare_proto::{ConnectionStatus, LeaseId};

/// One connection per CUDA process of the container (ledger and token: two per
/// process); far above any real container, low enough that one container cannot
/// exhaust the arbiter's descriptors or memory.
pub const MAX_CONNECTIONS_PER_LEASE: usize = 256;

/// Descriptors kept out of the lease sockets' reach: the control socket and its
/// connections (bounded separately), one listener per lease, the lease store's
/// files, NVML, the metrics listener and the runtime's own.
pub const DESCRIPTOR_HEADROOM: u64 = 1024;

/// The node-wide bound even where the descriptor limit is far higher: each
/// connection costs a task or a reactor slot and a page of memory, and no node runs
/// a thousand CUDA processes on its shared GPUs.
pub const MAX_CONNECTIONS_TOTAL: usize = 16_384;

/// The limits one admission decision is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub per_lease: usize,
    pub total: usize,
    /// The configured floor (`arbiter.lease_connection_floor`), before it is
    /// narrowed to what the node can give every live lease.
    pub floor: usize,
}

/// The node's connections when one more of a lease is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Connections the asking lease holds.
    pub own: usize,
    /// Whether the asking lease's socket is served (and so has a floor).
    pub own_live: bool,
    /// Connections open on the node, every lease together.
    pub open: usize,
    /// Floors not yet used: each live lease's floor less its connections (none
    /// below zero), plus one floor for the next lease.
    pub unused_floors: usize,
}

/// The floor each live lease is guaranteed: the configured floor, narrowed so
/// that the live leases' floors and one more (for the next lease to start) fit in
/// the node's bound, and never above the per-lease bound.
pub fn fair_floor(limits: Limits, live_leases: usize) -> usize {
    let shares = live_leases.saturating_add(1);
    limits
        .floor
        .min(limits.per_lease)
        .min(limits.total / shares)
}

/// Whether one more connection of a lease is admitted. A lease below its floor
/// is (its floor is kept free for it); beyond it, only while what is left keeps
/// every unused floor free, so the node never fills against a lease's floor.
pub fn decide(limits: Limits, floor: usize, at: Occupancy) -> Result<(), Refusal> {
    if at.own >= limits.per_lease {
        return Err(Refusal::LeaseLimit);
    }
    if at.open >= limits.total {
        return Err(Refusal::TotalLimit);
    }
    if at.own_live && at.own < floor {
        return Ok(());
    }
    if at.open + 1 + at.unused_floors > limits.total {
        return Err(Refusal::FairShare);
    }
    Ok(())
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    LeaseLimit,
    TotalLimit,
    /// The lease is beyond its floor and the rest of the node's bound is kept
    /// for other leases' floors.
    FairShare,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_lease: HashMap<LeaseId, usize>,
    /// Leases whose socket is served, each with how many serve it (a reopened
    /// socket's new loop may start before the old one is gone).
    live: HashMap<LeaseId, usize>,
}

impl Counts {
    fn occupancy(&self, lease: &LeaseId, floor: usize) -> Occupancy {
        let unused: usize = self
            .live
            .keys()
            .map(|l| floor.saturating_sub(self.by_lease.get(l).copied().unwrap_or(0)))
            .sum();
        Occupancy {
            own: self.by_lease.get(lease).copied().unwrap_or(0),
            own_live: self.live.contains_key(lease),
            open: self.total,
            unused_floors: unused + floor,
        }
    }
}

/// The counts behind every lease socket; cheap to share.
#[derive(Debug)]
pub struct ConnectionBudget {
    limits: Limits,
    counts: Mutex<Counts>,
    refused_lease_limit: AtomicU64,
    refused_total_limit: AtomicU64,
    refused_fair_share: AtomicU64,
    refused_peer: AtomicU64,
}

/// A lease's socket being served: the lease has a floor while this lives.
#[derive(Debug)]
pub struct LiveLease {
    budget: Arc<ConnectionBudget>,
    lease: LeaseId,
}

impl Drop for LiveLease {
    fn drop(&mut self) {
        count_down(&mut self.budget.lock().live, &self.lease);
    }
}

/// One less for `lease`; a lease counted down to nothing is forgotten.
fn count_down(counts: &mut HashMap<LeaseId, usize>, lease: &LeaseId) {
    if let Some(n) = counts.get_mut(lease) {
        *n -= 1;
        if *n == 0 {
            counts.remove(lease);
        }
    }
}

/// A connection's place in the budget, given back when it is dropped.
#[derive(Debug)]
pub struct Permit {
    budget: Arc<ConnectionBudget>,
    lease: LeaseId,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut counts = self.budget.lock();
        counts.total -= 1;
        count_down(&mut counts.by_lease, &self.lease);
    }
}

impl ConnectionBudget {
    /// A budget without floors: first come, first served within both bounds.
    pub fn new(per_lease: usize, total: usize) -> Arc<ConnectionBudget> {
        ConnectionBudget::with_limits(Limits {
            per_lease,
            total,
            floor: 0,
        })
    }

    pub fn with_limits(limits: Limits) -> Arc<ConnectionBudget> {
        Arc::new(ConnectionBudget {
            limits,
            counts: Mutex::new(Counts::default()),
            refused_lease_limit: AtomicU64::new(0),
            refused_total_limit: AtomicU64::new(0),
            refused_fair_share: AtomicU64::new(0),
            refused_peer: AtomicU64::new(0),
        })
    }

    /// The budget for this process: the soft descriptor limit is raised to the hard
    /// one first (a daemon that serves untrusted clients should not stop at 1,024
    /// when the system allows more), and the total leaves [`DESCRIPTOR_HEADROOM`];
    /// each live lease's floor is the default `arbiter.lease_connection_floor`.
    pub fn for_this_process() -> Arc<ConnectionBudget> {
        ConnectionBudget::for_this_process_with_floor(
            gpushare_config::ArbiterConfig::default().lease_connection_floor,
        )
    }

    /// [`ConnectionBudget::for_this_process`] with the configured floor.
    pub fn for_this_process_with_floor(floor: usize) -> Arc<ConnectionBudget> {
        let total = descriptor_limit()
            .map(total_for_descriptors)
            .unwrap_or(MAX_CONNECTIONS_TOTAL);
        ConnectionBudget::with_limits(Limits {
            per_lease: MAX_CONNECTIONS_PER_LEASE,
            total,
            floor,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Counts are changed in one step each; a panic cannot leave them half-changed.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection of `lease`, or why there is none.
    pub fn admit(self: &Arc<Self>, lease: &LeaseId) -> Result<Permit, Refusal> {
        let mut counts = self.lock();
        let floor = fair_floor(self.limits, counts.live.len());
        if let Err(why) = decide(self.limits, floor, counts.occupancy(lease, floor)) {
            let counter = match why {
                Refusal::LeaseLimit => &self.refused_lease_limit,
                Refusal::TotalLimit => &self.refused_total_limit,
                Refusal::FairShare => &self.refused_fair_share,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            return Err(why);
        }
        counts.total += 1;
        *counts.by_lease.entry(lease.clone()).or_insert(0) += 1;
        Ok(Permit {
            budget: self.clone(),
            lease: lease.clone(),
        })
    }

    /// Marks `lease`'s socket as served until the result is dropped: from then
    /// on the lease has a floor of its own.
    pub fn live(self: &Arc<Self>, lease: &LeaseId) -> LiveLease {
        *self.lock().live.entry(lease.clone()).or_insert(0) += 1;
        LiveLease {
            budget: self.clone(),
            lease: lease.clone(),
        }
    }

    /// The floor every served lease is guaranteed now.
    pub fn floor(&self) -> usize {
        fair_floor(self.limits, self.lock().live.len())
    }

    /// A peer from outside the lease's container was turned away.
    pub fn refused_peer(&self) {
        self.refused_peer.fetch_add(1, Ordering::Relaxed);
    }

    pub fn status(&self) -> ConnectionStatus {
        let counts = self.lock();
        ConnectionStatus {
            open: counts.total,
            per_lease_limit: self.limits.per_lease,
            total_limit: self.limits.total,
            refused_lease_limit: self.refused_lease_limit.load(Ordering::Relaxed),
            refused_total_limit: self.refused_total_limit.load(Ordering::Relaxed),
            refused_fair_share: self.refused_fair_share.load(Ordering::Relaxed),
            refused_peer: self.refused_peer.load(Ordering::Relaxed),
        }
    }
}

/// How long an accept loop waits after its `failures`-th failed accept in a row:
/// out of descriptors (EMFILE, ENFILE) or memory, accepting again at once would
/// spin on the same error, and waiting long would leave the backlog unserved
/// once descriptors are free again. Doubles from 10 ms up to 1 s.
pub fn accept_retry_wait(failures: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(10);
    const LONGEST: Duration = Duration::from_secs(1);
    FIRST
        .saturating_mul(1 << failures.saturating_sub(1).min(10))
        .min(LONGEST)
}

/// An accept loop's failures: how long to wait after each, logged at most once
/// per interval (a descriptor shortage fails every accept of every socket).
#[derive(Debug, Default)]
pub struct AcceptFailures {
    in_a_row: u32,
    logged: Option<Instant>,
}

impl AcceptFailures {
    const LOG_INTERVAL: Duration = Duration::from_secs(10);

    /// Waits after a failed accept on `socket`.
    pub async fn wait_after(
        &mut self,
        socket: &(impl std::fmt::Display + Sync),
        error: &io::Error,
    ) {
        self.in_a_row = self.in_a_row.saturating_add(1);
        let now = Instant::now();
        if self
            .logged
            .is_none_or(|t| now.duration_since(t) >= Self::LOG_INTERVAL)
        {
            self.logged = Some(now);
            tracing::warn!(%socket, %error, failures = self.in_a_row, "accept failed; waiting before the next");
        }
        tokio::time::sleep(accept_retry_wait(self.in_a_row)).await;
    }

    pub fn accepted(&mut self) {
        self.in_a_row = 0;
    }
}

/// Whether an accept failed for want of a descriptor (the process's or the
/// system's), which only a closed descriptor can cure.
pub fn out_of_descriptors(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Tells a refused client why in one non-blocking write, then closes: never a
/// wait on a client that does not read. An empty socket buffer takes a short
/// message whole; where it cannot, the client sees the close alone.
pub fn say_and_close(mut socket: impl io::Write, message: &[u8]) {
    let _ = socket.write(message);
}

/// The node-wide bound for a soft descriptor limit: what is left after the headroom,
/// and at least half of a small limit (1,024 where the hard limit cannot be raised).
pub fn total_for_descriptors(soft_limit: u64) -> usize {
    let usable = soft_limit
        .saturating_sub(DESCRIPTOR_HEADROOM)
        .max(soft_limit / 2);
    usize::try_from(usable)
        .unwrap_or(usize::MAX)
        .min(MAX_CONNECTIONS_TOTAL)
}

/// Raises the soft RLIMIT_NOFILE to the hard limit and returns the soft limit now in
/// force (None when it cannot be read).
fn descriptor_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> LeaseId {
        LeaseId(s.into())
    }

    #[test]
    fn each_lease_is_bounded_and_the_node_as_a_whole() {
        let budget = ConnectionBudget::new(2, 3);
        let a1 = budget.admit(&id("a")).unwrap();
        let _a2 = budget.admit(&id("a")).unwrap();
        assert_eq!(budget.admit(&id("a")).unwrap_err(), Refusal::LeaseLimit);
        let _b1 = budget.admit(&id("b")).unwrap();
        assert_eq!(budget.admit(&id("b")).unwrap_err(), Refusal::TotalLimit);
        // A closed connection gives its place back, to its lease and to the node.
        drop(a1);
        assert_eq!(budget.lock().by_lease[&id("a")], 1);
        let _b2 = budget.admit(&id("b")).unwrap();
        let status = budget.status();
        assert_eq!(status.open, 3);
        assert_eq!(status.refused_lease_limit, 1);
        assert_eq!(status.refused_total_limit, 1);
    }

    const LIMITS: Limits = Limits {
        per_lease: 256,
        total: 1_024,
        floor: 64,
    };

    #[test]
    fn the_floor_fits_every_live_lease_and_one_more() {
        for (limits, live, floor) in [
            // The configured floor where the node has room for it.
            (LIMITS, 0, 64),
            (LIMITS, 4, 64),
            (LIMITS, 14, 64),
            // Narrowed so that every live lease's floor and the next one's fit.
            (LIMITS, 15, 64),
            (LIMITS, 16, 60),
            (LIMITS, 1_023, 1),
            (LIMITS, 1_024, 0),
            // Never above the per-lease bound.
            (
                Limits {
                    floor: 1_000,
                    ..LIMITS
                },
                0,
                256,
            ),
            // No floor configured: first come, first served.
            (Limits { floor: 0, ..LIMITS }, 3, 0),
        ] {
            assert_eq!(
                fair_floor(limits, live),
                floor,
                "{limits:?} with {live} live"
            );
        }
    }

    #[test]
    fn a_lease_below_its_floor_is_admitted_and_one_beyond_it_only_from_what_is_left() {
        let at = |own, own_live, open, unused_floors| Occupancy {
            own,
            own_live,
            open,
            unused_floors,
        };
        for (occupancy, decision) in [
            // The bounds come first.
            (at(256, true, 300, 64), Err(Refusal::LeaseLimit)),
            (at(0, true, 1_024, 64), Err(Refusal::TotalLimit)),
            // Within its floor, even when the shared part is used up.
            (at(0, true, 960, 128), Ok(())),
            (at(63, true, 1_000, 64), Ok(())),
            // Beyond it, only while every unused floor stays free.
            (at(64, true, 959, 64), Ok(())),
            (at(64, true, 960, 64), Err(Refusal::FairShare)),
            (at(200, true, 900, 200), Err(Refusal::FairShare)),
            // A lease whose socket is no longer served has no floor.
            (at(0, false, 960, 64), Err(Refusal::FairShare)),
            (at(0, false, 100, 64), Ok(())),
        ] {
            assert_eq!(decide(LIMITS, 64, occupancy), decision, "{occupancy:?}");
        }
    }

    #[test]
    fn leases_that_fill_the_node_leave_a_floor_for_the_next() {
        let budget = ConnectionBudget::with_limits(Limits {
            per_lease: 8,
            total: 12,
            floor: 2,
        });
        let _a = budget.live(&id("a"));
        let _b = budget.live(&id("b"));
        let mut held = Vec::new();
        for lease in ["a", "b"] {
            while let Ok(p) = budget.admit(&id(lease)) {
                held.push(p);
            }
        }
        // a took what b's floor and the next lease's left; b got its floor.
        assert_eq!(budget.lock().by_lease[&id("a")], 8);
        assert_eq!(budget.lock().by_lease[&id("b")], 2);
        assert_eq!(budget.status().refused_fair_share, 1);
        // The next lease gets the floor kept for it, though the node is full.
        let _c = budget.live(&id("c"));
        let c1 = budget.admit(&id("c")).unwrap();
        let _c2 = budget.admit(&id("c")).unwrap();
        assert_eq!(budget.admit(&id("c")).unwrap_err(), Refusal::TotalLimit);
        assert_eq!(budget.status().open, 12);
        // A lease gone from service has no floor left to claim.
        drop(c1);
        drop(_c);
        assert_eq!(budget.lock().live.len(), 2);
        assert_eq!(budget.admit(&id("d")).unwrap_err(), Refusal::FairShare);
    }

    #[test]
    fn a_lease_with_no_connections_left_is_forgotten() {
        let budget = ConnectionBudget::new(4, 8);
        drop(budget.admit(&id("a")).unwrap());
        assert!(budget.lock().by_lease.is_empty());
        assert_eq!(budget.status().open, 0);
    }

    #[test]
    fn a_failing_accept_waits_longer_each_time_up_to_a_second() {
        for (failures, wait_ms) in [
            (0, 10),
            (1, 10),
            (2, 20),
            (5, 160),
            (7, 640),
            (8, 1_000),
            (u32::MAX, 1_000),
        ] {
            assert_eq!(
                accept_retry_wait(failures),
                Duration::from_millis(wait_ms),
                "{failures} failures"
            );
        }
    }

    #[test]
    fn the_total_leaves_headroom_and_has_a_floor_and_a_ceiling() {
        for (soft, total) in [
            (1_024, 512),
            (4_096, 3_072),
            (65_536, MAX_CONNECTIONS_TOTAL),
            (u64::MAX, MAX_CONNECTIONS_TOTAL),
        ] {
            assert_eq!(total_for_descriptors(soft), total, "soft limit {soft}");
        }
    }
}
