//! Recovering from what went wrong: a lease store that could not be written,
//! and leases whose container is gone (reconciliation).

use super::*;

/// When a lease this process did not reserve (it was loaded from the store) was
/// reserved, on the monotonic clock: its wall-clock age, clamped to the reservation
/// bound, so a clock that jumped across a restart can at most expire it as the old
/// rule did, never date it into the future.
fn reserved_at_from_wall(record: &LeaseRecord, now: Instant, bound: Duration) -> Instant {
    let age = Duration::from_millis(unix_ms().saturating_sub(record.lease.created_unix_ms));
    now.checked_sub(age.min(bound)).unwrap_or(now)
}

impl Arbiter {
    // ----- write failures -----
    //
    // Recovered in process, not by exiting for the supervisor to restart us: the
    // in-memory table holds every acknowledged change (memory changes before its
    // record is appended, and is acknowledged only after the record is durable),
    // and the reserves that were never acknowledged are known by their tickets, so
    // writing the table minus those reserves as a snapshot is exactly the durable
    // state a restart would want. A restart would instead drop every lease-socket
    // connection on the node (every CUDA process re-attaches; low-priority clients
    // stall meanwhile) and would fail the same way while the disk stays full.

    /// Called before every change: while the store cannot be written, tries to
    /// recover it; refuses the change if that fails too, so nothing is half done.
    pub(super) fn ensure_writable(&mut self) -> Result<(), StateError> {
        if self.store.failure().is_some() {
            self.recover_store()?;
        }
        Ok(())
    }

    /// After a write failure: takes back every reserve whose record was lost
    /// (never acknowledged: its lease, socket, directory and room go), then makes
    /// the remaining table durable (`LeaseStore::recover`). The take-backs stand
    /// even if the store still cannot be written; call again later (the daemon
    /// does, every second, and so does each change). A no-op while writes work.
    pub fn recover_store(&mut self) -> Result<(), StateError> {
        if self.store.failure().is_none() {
            return Ok(());
        }
        let lost: Vec<LeaseId> = self
            .undurable
            .iter()
            .filter(|(_, t)| self.store.has_failed(**t))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &lost {
            self.take_back_lost(id);
        }
        let table = Table {
            leases: self.leases.clone(),
            drained: self.drained.clone(),
            grants: self.stored_grants(),
        };
        self.store.recover(&table)?;
        // Memory is the durable state now: nothing older is left to wait for.
        self.undurable.clear();
        self.last_ticket = None;
        if !lost.is_empty() {
            self.run_admission();
        }
        Ok(())
    }

    /// A reserve whose record the store failed to write (the caller saw its
    /// ticket fail): takes the lease back, unless a recovery already did or the
    /// record is durable after all (then someone may have been told; it stays).
    pub fn withdraw_reserve(&mut self, id: &LeaseId) {
        let lost = self
            .undurable
            .get(id)
            .is_some_and(|t| self.store.has_failed(*t));
        if lost {
            self.take_back_lost(id);
            self.run_admission();
        }
    }

    pub(super) fn take_back_lost(&mut self, id: &LeaseId) {
        if self.forget(id) {
            tracing::warn!(lease = %id, "took back a reserve the lease store could not make durable (it was never acknowledged)");
        }
    }

    /// Releases leases whose container is gone (after the grace period) or that
    /// were never confirmed; returns what it released and why.
    pub fn reconcile(&mut self, now: Instant) -> Vec<(LeaseId, String)> {
        let bounds = Bounds {
            grace: Duration::from_millis(self.config.reconcile_grace_ms),
            reserved_timeout: Duration::from_millis(self.config.reserved_timeout_ms),
        };
        let mut to_release = Vec::new();
        let mut still_suspect = Vec::new();
        for (id, record) in &self.leases {
            let presence = reconcile::presence(record, self.probe.as_ref());
            let reserved_at = *self
                .reserved_at
                .entry(id.clone())
                .or_insert_with(|| reserved_at_from_wall(record, now, bounds.reserved_timeout));
            let age = now.saturating_duration_since(reserved_at);
            let suspected_since = self.findings.suspected_since(id);
            match reconcile::decide(presence, suspected_since, now, age, &bounds) {
                Verdict::Keep => {}
                Verdict::Suspect => still_suspect.push(id.clone()),
                Verdict::Release(why) => to_release.push((id.clone(), why)),
            }
        }
        self.findings.set_suspects(still_suspect, now);
        let mut released = Vec::new();
        for (id, why) in to_release {
            match self.release(&id) {
                Ok(_) => {
                    tracing::info!(lease = %id, reason = %why, "released by reconciliation");
                    released.push((id, why));
                }
                Err(e) => {
                    tracing::error!(lease = %id, error = %e, "reconciliation could not release")
                }
            }
        }
        released
    }
}
