//! The lease sockets' ledger clients: peer checks, attach, charge, credit,
//! detach and queries.

use super::*;
use crate::lease_connection::ShareChange;

impl Arbiter {
    // ----- lease sockets -----

    pub(super) fn quota(
        &self,
        id: &LeaseId,
        connection: ConnectionId,
    ) -> Result<Quota, StateError> {
        let record = self
            .leases
            .get(id)
            .ok_or_else(|| StateError::LeaseReleased(id.clone()))?;
        let l = &record.lease;
        let ledger = self.ledger.get(id);
        Ok(Quota {
            lease: id.clone(),
            state: l.state,
            gpus: l.gpus.clone(),
            priority: l.priority,
            memory_quota: ledger_quota(l),
            memory_used: ledger.map(|x| x.used()).unwrap_or(0),
            memory_held: ledger
                .and_then(|x| x.clients.get(&connection))
                .map(|c| c.held)
                .unwrap_or(0),
            memory_overhead: ledger.map(|x| x.overhead()).unwrap_or(0),
            shares: true,
            compute_request: l.compute_request,
            compute_limit: l.compute_limit,
        })
    }

    /// A released lease answers with state `released` rather than an error, so
    /// a client can tell "revoked" from "broken".
    pub fn lease_query(&self, id: &LeaseId, connection: ConnectionId) -> Quota {
        self.quota(id, connection).unwrap_or_else(|_| Quota {
            lease: id.clone(),
            state: LeaseState::Released,
            gpus: Vec::new(),
            priority: Priority::Low,
            memory_quota: 0,
            memory_used: 0,
            memory_held: 0,
            memory_overhead: 0,
            shares: true,
            compute_request: gpushare_proto::Fraction::ZERO,
            compute_limit: gpushare_proto::Fraction::ZERO,
        })
    }

    /// Registers a process (pid from SO_PEERCRED), after checking that it belongs
    /// to the lease's container where that can be told.
    /// Whether `peer_pid` may speak on lease `id`'s socket at all: it must be
    /// inside the lease's confirmed container (its pid namespace and cgroup). A
    /// lease id alone entitles nothing: ids are visible to host users (the lease
    /// directory is a bind mount listed in every container process's mountinfo),
    /// so an unconfirmed lease, or a peer whose /proc cannot be read, is refused.
    pub fn lease_peer(&self, id: &LeaseId, peer_pid: u32) -> Result<(), StateError> {
        let record = self
            .leases
            .get(id)
            .ok_or_else(|| StateError::LeaseReleased(id.clone()))?;
        self.verify_peer(id, record, peer_pid)
    }

    pub(super) fn verify_peer(
        &self,
        id: &LeaseId,
        record: &LeaseRecord,
        peer_pid: u32,
    ) -> Result<(), StateError> {
        match check_peer(
            self.probe.as_ref(),
            peer_pid,
            record.lease.pid,
            record.cgroup.as_deref(),
        ) {
            PeerCheck::Accepted => Ok(()),
            PeerCheck::Unverified(why) | PeerCheck::Refused(why) => {
                tracing::warn!(lease = %id, pid = peer_pid, why, "lease client refused");
                Err(StateError::PeerRefused(why))
            }
        }
    }

    pub fn lease_attach(
        &mut self,
        id: &LeaseId,
        connection: ConnectionId,
        peer_pid: u32,
        held: u64,
    ) -> Result<Quota, StateError> {
        let record = self
            .leases
            .get(id)
            .ok_or_else(|| StateError::LeaseReleased(id.clone()))?;
        self.verify_peer(id, record, peer_pid)?;
        let estimate = self.overhead_estimate();
        self.ledger
            .attach(id, connection, peer_pid, held, estimate)?;
        tracing::info!(lease = %id, pid = peer_pid, held, overhead_estimate = estimate, "lease client attached");
        self.quota(id, connection)
    }

    pub fn lease_charge(
        &mut self,
        id: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<Charge, StateError> {
        let charge = self.ledger.charge(id, connection, bytes)?;
        if !charge.granted {
            tracing::info!(lease = %id, bytes, used = charge.used, overhead = charge.overhead, quota = charge.quota, "charge refused: over quota (used includes the processes' overhead)");
        }
        Ok(charge)
    }

    pub fn lease_credit(
        &mut self,
        id: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<u64, StateError> {
        Ok(self.ledger.credit(id, connection, bytes)?)
    }

    /// An exported allocation's charge moves from `connection` to the lease (see
    /// `Ledger::share`), or its holders change (`hold`, `unhold`).
    pub fn lease_share(
        &mut self,
        id: &LeaseId,
        connection: ConnectionId,
        change: ShareChange,
    ) -> Result<Quota, StateError> {
        match change {
            ShareChange::Share {
                key,
                bytes,
                same_as,
            } => {
                self.ledger.share(id, connection, key, bytes, same_as)?;
                tracing::debug!(lease = %id, ?key, bytes, "exported allocation shared");
            }
            ShareChange::Hold { key } => self.ledger.hold(connection, key),
            ShareChange::Unhold { key } => self.ledger.unhold(connection, key),
        }
        self.quota(id, connection)
    }

    pub fn lease_detach(&mut self, id: &LeaseId, connection: ConnectionId) {
        let credited = self.ledger.detach(id, connection);
        if self.ledger.get(id).is_some_and(|l| l.clients.is_empty()) {
            self.telemetry.forget_measurement(id);
        }
        tracing::debug!(lease = %id, credited, "lease client detached");
    }
}
