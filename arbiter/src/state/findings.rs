//! What the arbiter found wrong: the watchdog's and the token service's
//! violations (listed for status, counted by kind for the metrics), allocations
//! refused for a lease's quota, and leases suspected of being abandoned
//! (reconciliation releases them once the grace has passed).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use gpushare_proto::{LeaseId, Violation, ViolationKind};

#[derive(Debug, Default)]
pub(super) struct Findings {
    /// The violations status lists: the watchdog's last pass and those reported since.
    violations: Vec<Violation>,
    /// Violations counted since start, by kind (the metric's label).
    totals: BTreeMap<&'static str, u64>,
    /// Allocations refused for the quota, per live lease.
    memory_refusals: HashMap<LeaseId, u64>,
    /// Leases whose container looked gone, since when (`reconcile::decide`).
    suspects: HashMap<LeaseId, Instant>,
}

impl Findings {
    /// The watchdog's pass found `violations`: they replace those listed, and each
    /// is counted, except overruns (counted once, when the token service reports
    /// them; the watchdog's passes only keep them listed for a while).
    pub fn record_watchdog_pass(&mut self, violations: Vec<Violation>) {
        for v in &violations {
            let kind = match v.kind {
                ViolationKind::Unregistered => "unregistered",
                ViolationKind::OverQuota => "over_quota",
                ViolationKind::Ungated => "ungated",
                ViolationKind::ShiftedClock => "shifted_clock",
                ViolationKind::Overrun => continue,
            };
            self.count(kind);
        }
        self.violations = violations;
    }

    /// A violation measured outside the watchdog's passes (the token service's
    /// overruns, the bypass check): counted and listed at once.
    pub fn record_at_once(&mut self, violation: Violation) {
        let kind = match violation.kind {
            ViolationKind::Ungated => "ungated",
            ViolationKind::ShiftedClock => "shifted_clock",
            _ => "overrun",
        };
        self.count(kind);
        self.violations.push(violation);
    }

    fn count(&mut self, kind: &'static str) {
        *self.totals.entry(kind).or_default() += 1;
    }

    /// The violations listed now.
    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    /// Violations counted since start, by kind.
    pub fn totals(&self) -> &BTreeMap<&'static str, u64> {
        &self.totals
    }

    /// An allocation of `lease` was refused for its quota.
    pub fn count_memory_refusal(&mut self, lease: &LeaseId) {
        *self.memory_refusals.entry(lease.clone()).or_default() += 1;
    }

    /// Allocations of `lease` refused for its quota so far.
    pub fn memory_refusals(&self, lease: &LeaseId) -> u64 {
        self.memory_refusals.get(lease).copied().unwrap_or(0)
    }

    /// Since when `lease` has been suspected of being abandoned (None: it is not).
    pub fn suspected_since(&self, lease: &LeaseId) -> Option<Instant> {
        self.suspects.get(lease).copied()
    }

    /// After a reconciliation pass: exactly `suspected` are suspects, each since it
    /// was first suspected (`now` for the new ones).
    pub fn set_suspects(&mut self, suspected: Vec<LeaseId>, now: Instant) {
        let mut still = HashMap::new();
        for id in suspected {
            let since = self.suspected_since(&id).unwrap_or(now);
            still.insert(id, since);
        }
        self.suspects = still;
    }

    /// The lease's container showed up (confirmed): no longer a suspect.
    pub fn clear_suspicion(&mut self, lease: &LeaseId) {
        self.suspects.remove(lease);
    }

    /// Drops what was found about a lease that is gone. The violations listed stay
    /// until the watchdog's next pass: they happened.
    pub fn forget(&mut self, lease: &LeaseId) {
        self.memory_refusals.remove(lease);
        self.suspects.remove(lease);
    }
}

#[cfg(test)]
mod tests;
