//! The GPU-memory ledger: per lease, across all of its processes.
//!
//! The interposer charges before every allocation and credits after every free;
//! a charge that would take the lease beyond its quota is refused and nothing
//! changes. Entries are per connection (one per process), so when a process
//! exits — its connection closes — its memory, which the driver frees, is
//! credited back. The ledger lives in memory: after an arbiter restart each
//! process re-attaches with what it still holds.

use std::collections::BTreeMap;

use gpushare_proto::LeaseId;

/// One lease-socket connection.
pub type ConnectionId = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    pub pid: u32,
    pub held: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseLedger {
    pub quota: u64,
    pub clients: BTreeMap<ConnectionId, Client>,
}

impl LeaseLedger {
    /// Saturating: `held` at attach is the client's own claim (after an arbiter
    /// restart), so a hostile claim must make its lease look full, never wrap
    /// around to look empty (or panic the daemon in a debug build).
    pub fn used(&self) -> u64 {
        self.clients
            .values()
            .fold(0u64, |sum, c| sum.saturating_add(c.held))
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LedgerError {
    #[error("lease {0} is not in the ledger (released?)")]
    UnknownLease(LeaseId),
    #[error("this connection has not attached")]
    NotAttached,
    #[error("this connection has already attached")]
    AlreadyAttached,
    #[error("credit of {asked} bytes exceeds the {held} bytes this process has charged")]
    CreditTooLarge { asked: u64, held: u64 },
}

/// The result of a charge: `granted` or not, and the lease's state after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    pub granted: bool,
    pub used: u64,
    pub quota: u64,
}

#[derive(Debug, Default)]
pub struct Ledger {
    leases: BTreeMap<LeaseId, LeaseLedger>,
}

impl Ledger {
    /// Opens (or re-opens, keeping its clients) a lease's account.
    pub fn open(&mut self, lease: &LeaseId, quota: u64) {
        self.leases.entry(lease.clone()).or_default().quota = quota;
    }

    /// Forgets a released lease; returns its clients, whose connections are now stale.
    pub fn close(&mut self, lease: &LeaseId) -> Vec<ConnectionId> {
        self.leases
            .remove(lease)
            .map(|l| l.clients.into_keys().collect())
            .unwrap_or_default()
    }

    pub fn get(&self, lease: &LeaseId) -> Option<&LeaseLedger> {
        self.leases.get(lease)
    }

    fn lease_mut(&mut self, lease: &LeaseId) -> Result<&mut LeaseLedger, LedgerError> {
        self.leases
            .get_mut(lease)
            .ok_or_else(|| LedgerError::UnknownLease(lease.clone()))
    }

    /// Registers a process. What it says it already holds (after an arbiter
    /// restart) is recorded even beyond the quota: that memory is allocated
    /// already, and refusing to count it would only hide it. The watchdog reports
    /// a lease over its quota.
    pub fn attach(
        &mut self,
        lease: &LeaseId,
        connection: ConnectionId,
        pid: u32,
        held: u64,
    ) -> Result<(), LedgerError> {
        let l = self.lease_mut(lease)?;
        if l.clients.contains_key(&connection) {
            return Err(LedgerError::AlreadyAttached);
        }
        l.clients.insert(connection, Client { pid, held });
        Ok(())
    }

    /// Credits everything the connection held; returns how much.
    pub fn detach(&mut self, lease: &LeaseId, connection: ConnectionId) -> u64 {
        self.leases
            .get_mut(lease)
            .and_then(|l| l.clients.remove(&connection))
            .map(|c| c.held)
            .unwrap_or(0)
    }

    pub fn charge(
        &mut self,
        lease: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<Charge, LedgerError> {
        let l = self.lease_mut(lease)?;
        let used = l.used();
        let quota = l.quota;
        let client = l
            .clients
            .get_mut(&connection)
            .ok_or(LedgerError::NotAttached)?;
        let fits = used.checked_add(bytes).is_some_and(|after| after <= quota);
        if !fits {
            return Ok(Charge {
                granted: false,
                used,
                quota,
            });
        }
        client.held += bytes;
        Ok(Charge {
            granted: true,
            used: used + bytes,
            quota,
        })
    }

    /// Returns the lease's use after the credit.
    pub fn credit(
        &mut self,
        lease: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<u64, LedgerError> {
        let l = self.lease_mut(lease)?;
        let client = l
            .clients
            .get_mut(&connection)
            .ok_or(LedgerError::NotAttached)?;
        if bytes > client.held {
            return Err(LedgerError::CreditTooLarge {
                asked: bytes,
                held: client.held,
            });
        }
        client.held -= bytes;
        Ok(l.used())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> LeaseId {
        LeaseId("l1".into())
    }

    fn ledger(quota: u64) -> Ledger {
        let mut l = Ledger::default();
        l.open(&lease(), quota);
        l
    }

    #[test]
    fn charges_up_to_the_quota_across_processes_and_refuses_beyond() {
        let mut l = ledger(100);
        l.attach(&lease(), 1, 10, 0).unwrap();
        l.attach(&lease(), 2, 11, 0).unwrap();
        let c = l.charge(&lease(), 1, 60).unwrap();
        assert_eq!((c.granted, c.used, c.quota), (true, 60, 100));
        let c = l.charge(&lease(), 2, 41).unwrap();
        assert_eq!((c.granted, c.used), (false, 60), "refused: nothing changes");
        let c = l.charge(&lease(), 2, 40).unwrap();
        assert_eq!(
            (c.granted, c.used),
            (true, 100),
            "exactly the quota is allowed"
        );
        assert!(!l.charge(&lease(), 1, 1).unwrap().granted);
        assert!(
            !l.charge(&lease(), 1, u64::MAX).unwrap().granted,
            "no overflow"
        );
    }

    #[test]
    fn credits_return_room_and_cannot_exceed_what_the_process_holds() {
        let mut l = ledger(100);
        l.attach(&lease(), 1, 10, 0).unwrap();
        l.attach(&lease(), 2, 11, 0).unwrap();
        l.charge(&lease(), 1, 70).unwrap();
        assert_eq!(
            l.credit(&lease(), 2, 1),
            Err(LedgerError::CreditTooLarge { asked: 1, held: 0 }),
            "a process cannot credit another's memory"
        );
        assert_eq!(l.credit(&lease(), 1, 30), Ok(40));
        assert!(l.charge(&lease(), 2, 60).unwrap().granted);
    }

    #[test]
    fn a_closed_connection_credits_everything_it_held() {
        let mut l = ledger(100);
        l.attach(&lease(), 1, 10, 0).unwrap();
        l.charge(&lease(), 1, 100).unwrap();
        assert_eq!(l.detach(&lease(), 1), 100);
        assert_eq!(l.get(&lease()).unwrap().used(), 0);
        assert_eq!(l.detach(&lease(), 1), 0, "twice is harmless");
    }

    #[test]
    fn reattach_after_restart_records_what_is_held_even_over_quota() {
        let mut l = ledger(100);
        l.attach(&lease(), 7, 10, 120).unwrap();
        assert_eq!(l.get(&lease()).unwrap().used(), 120);
        assert!(!l.charge(&lease(), 7, 1).unwrap().granted);
        assert_eq!(
            l.attach(&lease(), 7, 10, 0),
            Err(LedgerError::AlreadyAttached)
        );
    }

    #[test]
    fn hostile_held_claims_saturate_instead_of_wrapping() {
        let mut l = ledger(100);
        l.attach(&lease(), 1, 10, u64::MAX).unwrap();
        l.attach(&lease(), 2, 11, u64::MAX).unwrap();
        assert_eq!(
            l.get(&lease()).unwrap().used(),
            u64::MAX,
            "no wrap-around to a small number"
        );
        l.attach(&lease(), 3, 12, 0).unwrap();
        let charge = l.charge(&lease(), 3, 1).unwrap();
        assert!(
            !charge.granted,
            "a lease that claims everything has no room left"
        );
    }

    #[test]
    fn order_and_unknown_leases() {
        let mut l = ledger(100);
        assert_eq!(l.charge(&lease(), 1, 1), Err(LedgerError::NotAttached));
        assert_eq!(l.credit(&lease(), 1, 1), Err(LedgerError::NotAttached));
        let other = LeaseId("nope".into());
        assert!(matches!(
            l.attach(&other, 1, 1, 0),
            Err(LedgerError::UnknownLease(_))
        ));
        l.attach(&lease(), 1, 10, 0).unwrap();
        l.open(&lease(), 200);
        assert_eq!(
            l.get(&lease()).unwrap().clients.len(),
            1,
            "reopen keeps clients"
        );
        assert_eq!(l.close(&lease()), vec![1]);
        assert!(l.get(&lease()).is_none());
    }
}
