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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    LeaseLimit,
    TotalLimit,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_lease: HashMap<LeaseId, usize>,
}

/// The counts behind every lease socket; cheap to share.
#[derive(Debug)]
pub struct ConnectionBudget {
    per_lease: usize,
    total: usize,
    counts: Mutex<Counts>,
    refused_lease_limit: AtomicU64,
    refused_total_limit: AtomicU64,
    refused_peer: AtomicU64,
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
        if let Some(n) = counts.by_lease.get_mut(&self.lease) {
            *n -= 1;
            if *n == 0 {
                counts.by_lease.remove(&self.lease);
            }
        }
    }
}

impl ConnectionBudget {
    pub fn new(per_lease: usize, total: usize) -> Arc<ConnectionBudget> {
        Arc::new(ConnectionBudget {
            per_lease,
            total,
            counts: Mutex::new(Counts::default()),
            refused_lease_limit: AtomicU64::new(0),
            refused_total_limit: AtomicU64::new(0),
            refused_peer: AtomicU64::new(0),
        })
    }

    /// The budget for this process: the soft descriptor limit is raised to the hard
    /// one first (a daemon that serves untrusted clients should not stop at 1,024
    /// when the system allows more), and the total leaves [`DESCRIPTOR_HEADROOM`].
    pub fn for_this_process() -> Arc<ConnectionBudget> {
        let total = descriptor_limit()
            .map(total_for_descriptors)
            .unwrap_or(MAX_CONNECTIONS_TOTAL);
        ConnectionBudget::new(MAX_CONNECTIONS_PER_LEASE, total)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        // Counts are changed in one step each; a panic cannot leave them half-changed.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more connection of `lease`, or why there is none.
    pub fn admit(self: &Arc<Self>, lease: &LeaseId) -> Result<Permit, Refusal> {
        let mut counts = self.lock();
        let of_lease = counts.by_lease.get(lease).copied().unwrap_or(0);
        let refusal = if of_lease >= self.per_lease {
            Some((Refusal::LeaseLimit, &self.refused_lease_limit))
        } else if counts.total >= self.total {
            Some((Refusal::TotalLimit, &self.refused_total_limit))
        } else {
            None
        };
        if let Some((why, counter)) = refusal {
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

    /// A peer from outside the lease's container was turned away.
    pub fn refused_peer(&self) {
        self.refused_peer.fetch_add(1, Ordering::Relaxed);
    }

    pub fn status(&self) -> ConnectionStatus {
        ConnectionStatus {
            open: self.lock().total,
            per_lease_limit: self.per_lease,
            total_limit: self.total,
            refused_lease_limit: self.refused_lease_limit.load(Ordering::Relaxed),
            refused_total_limit: self.refused_total_limit.load(Ordering::Relaxed),
            refused_peer: self.refused_peer.load(Ordering::Relaxed),
        }
    }
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

    #[test]
    fn a_lease_with_no_connections_left_is_forgotten() {
        let budget = ConnectionBudget::new(4, 8);
        drop(budget.admit(&id("a")).unwrap());
        assert!(budget.lock().by_lease.is_empty());
        assert_eq!(budget.status().open, 0);
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
