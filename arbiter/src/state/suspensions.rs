//! Memory that follows priority, the state's side: which leases the reclaim took off
//! their GPU (suspended: locked and checkpointed through the driver) and the decisions
//! made under the lock, whether a charge needs memory lent to low-priority leases, which
//! of them to suspend (`reclaim::choose_victims`), which come back when memory is free
//! again (`reclaim::restore_order`). The driver calls happen without the lock
//! (the daemon's reclaimer), between a decision here and its outcome recorded here.
//!
//! Physical memory is what the ledger counts for the leases on the GPU that are not
//! suspended: their charges plus their processes' overhead. With reclaim off nothing here
//! runs: quotas add up to at most the GPU's allocatable memory, so every charge within a
//! quota fits.

use std::collections::BTreeMap;
use std::time::Duration;

use gpushare_proto::{ReclaimReport, SuspendedLease};

use super::*;
use crate::reclaim::{self, Suspendable, Suspension, SuspensionPhase, Victims};

/// How many finished reclaims status lists.
const RECENT_RECLAIMS: usize = 16;

/// One low-priority lease to take off the GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    pub lease: LeaseId,
    pub pids: Vec<u32>,
    pub bytes: u64,
}

/// A charge that fits only once `victims` are suspended. The charge is held in the
/// ledger meanwhile (so no other charge takes the memory being freed); the reclaim
/// either confirms it (`finish_reclaim`) or takes it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReclaimPlan {
    pub lease: LeaseId,
    pub connection: ConnectionId,
    pub bytes: u64,
    pub gpu: String,
    pub shortfall: u64,
    pub victims: Vec<Victim>,
    /// How long the reclaim may take (`memory.reclaim_floor_ms`, or 1.5 times the
    /// checkpoint's copy of the victims' memory at `memory.checkpoint_gbps`).
    pub bound: Duration,
}

/// What a charge needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeDecision {
    Done(Charge),
    Reclaim(ReclaimPlan),
}

/// How one victim's suspension ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuspendOutcome {
    Suspended,
    /// Undone (unlocked, restored): the lease runs on. `never_again`: the driver cannot
    /// checkpoint it (IPC, managed memory) or it failed; it is not chosen again.
    Undone {
        why: String,
        never_again: bool,
    },
    /// Every process of it exited meanwhile.
    Gone,
}

/// How long each part of a reclaim took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReclaimTimes {
    pub lock: Duration,
    pub checkpoint: Duration,
    pub total: Duration,
}

#[derive(Debug, Default)]
pub(super) struct Suspensions {
    by_lease: BTreeMap<LeaseId, Suspension>,
    /// Leases the driver would not checkpoint, or that failed: never chosen again.
    never_again: BTreeMap<LeaseId, String>,
    /// Processes of released leases that were suspended: restored and unlocked
    /// whatever they hold (their container is ending).
    orphans: Vec<Vec<u32>>,
    recent: std::collections::VecDeque<ReclaimReport>,
    /// When each GPU's last reclaim ended: its suspended leases wait
    /// `memory.restore_delay_ms` from then.
    last_reclaim: BTreeMap<String, Instant>,
    pub(super) reclaims: u64,
    pub(super) reclaims_failed: u64,
    pub(super) restores: u64,
    pub(super) reclaimed_bytes: u64,
}

impl Suspensions {
    /// The lease was released: a process of it that is still alive must not stay
    /// locked for ever, so it is handed to the restorer as an orphan.
    pub(super) fn forget(&mut self, id: &LeaseId) {
        if let Some(s) = self.by_lease.remove(id) {
            self.orphans.push(s.pids);
        }
        self.never_again.remove(id);
    }
}

impl Arbiter {
    pub fn memory_config(&self) -> &gpushare_config::MemoryConfig {
        &self.memory
    }

    /// Sets the `[memory]` table (reclaim on or off, the over-commitment).
    pub fn set_memory_config(&mut self, memory: gpushare_config::MemoryConfig) {
        self.memory = memory;
    }

    pub fn reclaim_enabled(&self) -> bool {
        self.memory.reclaim
    }

    /// The suspended leases as the journal keeps them.
    pub fn suspensions(&self) -> BTreeMap<LeaseId, Suspension> {
        self.suspensions.by_lease.clone()
    }

    pub fn suspension(&self, id: &LeaseId) -> Option<&Suspension> {
        self.suspensions.by_lease.get(id)
    }

    /// A lease whose memory is lent: low priority, on one GPU (a lease across GPUs runs
    /// ungated and is never suspended), not known to hold memory the driver cannot
    /// checkpoint.
    pub fn lends_memory(&self, lease: &Lease) -> bool {
        self.memory.reclaim
            && lease.priority == Priority::Low
            && lease.gpus.len() == 1
            && !self.ledger.shares_memory(&lease.id)
            && !self.suspensions.never_again.contains_key(&lease.id)
    }

    /// What the processes of the leases on `gpu` hold there now, suspended leases
    /// left out (a lease across several GPUs counts its share of each).
    pub fn gpu_memory_in_use(&self, gpu: &str) -> u64 {
        self.leases
            .values()
            .filter(|r| r.lease.gpus.iter().any(|g| g == gpu))
            .filter(|r| {
                !self
                    .suspensions
                    .by_lease
                    .get(&r.lease.id)
                    .is_some_and(|s| s.phase == SuspensionPhase::Suspended)
            })
            .map(|r| {
                let used = self.ledger.get(&r.lease.id).map_or(0, |l| l.used());
                used / r.lease.gpus.len().max(1) as u64
            })
            .fold(0u64, u64::saturating_add)
    }

    fn allocatable(&self, gpu: &str) -> u64 {
        self.inventory
            .gpus
            .iter()
            .find(|g| g.uuid == gpu)
            .map_or(0, |g| g.memory_allocatable)
    }

    /// A charge within the lease's quota, judged against the GPU's memory too when
    /// memory is lent: a low-priority charge that does not fit is refused (the driver
    /// would refuse it anyway); a high-priority one that does not fit needs the lent
    /// memory back, from the fewest low-priority leases that free enough.
    pub fn lease_charge_on_gpu(
        &mut self,
        id: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<ChargeDecision, StateError> {
        let charge = self.lease_charge(id, connection, bytes)?;
        if !charge.granted || !self.memory.reclaim {
            return Ok(ChargeDecision::Done(charge));
        }
        let Some(lease) = self.lease(id).cloned() else {
            return Ok(ChargeDecision::Done(charge));
        };
        let [gpu] = lease.gpus.as_slice() else {
            return Ok(ChargeDecision::Done(charge));
        };
        let in_use = self.gpu_memory_in_use(gpu);
        let allocatable = self.allocatable(gpu);
        if in_use <= allocatable {
            return Ok(ChargeDecision::Done(charge));
        }
        let shortfall = in_use - allocatable;
        let refuse = |arbiter: &mut Arbiter, why: &str| -> Result<ChargeDecision, StateError> {
            let used = arbiter.lease_credit(id, connection, bytes)?;
            tracing::info!(lease = %id, bytes, shortfall, "charge refused: {why}");
            Ok(ChargeDecision::Done(Charge {
                granted: false,
                used,
                ..charge
            }))
        };
        if lease.priority == Priority::Low {
            return refuse(
                self,
                "the GPU's memory is taken (this lease's quota is lent memory)",
            );
        }
        let candidates: Vec<(&LeaseRecord, Suspendable)> = self
            .leases
            .values()
            .filter(|r| r.lease.gpus.len() == 1 && &r.lease.gpus[0] == gpu)
            .filter(|r| r.lease.priority == Priority::Low)
            .filter(|r| !self.suspensions.by_lease.contains_key(&r.lease.id))
            .map(|r| {
                let s = Suspendable {
                    bytes: self.ledger.get(&r.lease.id).map_or(0, |l| l.used()),
                    checkpointable: self.lends_memory(&r.lease),
                    admitted: r.lease.created_unix_ms,
                };
                (r, s)
            })
            .collect();
        let suspendable: Vec<Suspendable> = candidates.iter().map(|(_, s)| *s).collect();
        let chosen = match reclaim::choose_victims(shortfall, &suspendable) {
            Victims::Suspend(chosen) => chosen,
            Victims::NotEnough { reclaimable } => {
                let why = format!(
                    "{} more is needed on the GPU and only {} of it is held by low-priority leases that can be checkpointed",
                    gpushare_proto::ByteSize(shortfall),
                    gpushare_proto::ByteSize(reclaimable)
                );
                return refuse(self, &why);
            }
        };
        let victims: Vec<Victim> = chosen
            .into_iter()
            .map(|i| {
                let lease = candidates[i].0.lease.id.clone();
                Victim {
                    pids: self.ledger.pids(&lease),
                    bytes: candidates[i].1.bytes,
                    lease,
                }
            })
            .collect();
        let moved: u64 = victims.iter().map(|v| v.bytes).sum();
        let now = unix_ms();
        for v in &victims {
            self.suspensions.by_lease.insert(
                v.lease.clone(),
                Suspension {
                    gpu: gpu.clone(),
                    pids: v.pids.clone(),
                    bytes: v.bytes,
                    phase: SuspensionPhase::Suspending,
                    since_unix_ms: now,
                },
            );
        }
        Ok(ChargeDecision::Reclaim(ReclaimPlan {
            lease: id.clone(),
            connection,
            bytes,
            gpu: gpu.clone(),
            shortfall,
            victims,
            bound: self.memory.reclaim_bound(moved),
        }))
    }

    /// Records how each victim's suspension ended and answers the charge: granted if
    /// the GPU now has room for it, otherwise taken back (nothing was allocated).
    pub fn finish_reclaim(
        &mut self,
        plan: &ReclaimPlan,
        outcomes: &[(LeaseId, SuspendOutcome)],
        times: ReclaimTimes,
    ) -> Result<Charge, StateError> {
        for (lease, outcome) in outcomes {
            match outcome {
                SuspendOutcome::Suspended => {
                    if let Some(s) = self.suspensions.by_lease.get_mut(lease) {
                        s.phase = SuspensionPhase::Suspended;
                    }
                }
                SuspendOutcome::Undone { why, never_again } => {
                    self.suspensions.by_lease.remove(lease);
                    if *never_again {
                        tracing::warn!(lease = %lease, why, "this lease's memory is not reclaimed again");
                        self.suspensions
                            .never_again
                            .insert(lease.clone(), why.clone());
                    }
                }
                SuspendOutcome::Gone => {
                    self.suspensions.by_lease.remove(lease);
                }
            }
        }
        // Victims not in `outcomes` were never reached (an earlier one failed).
        for v in &plan.victims {
            if !outcomes.iter().any(|(l, _)| l == &v.lease) {
                self.suspensions.by_lease.remove(&v.lease);
            }
        }
        let fits = self.gpu_memory_in_use(&plan.gpu) <= self.allocatable(&plan.gpu);
        let suspended: Vec<String> = outcomes
            .iter()
            .filter(|(_, o)| *o == SuspendOutcome::Suspended)
            .map(|(l, _)| l.to_string())
            .collect();
        let freed: u64 = plan
            .victims
            .iter()
            .filter(|v| suspended.contains(&v.lease.to_string()))
            .map(|v| v.bytes)
            .sum();
        self.suspensions.reclaims += 1;
        self.suspensions.reclaimed_bytes += freed;
        self.suspensions
            .last_reclaim
            .insert(plan.gpu.clone(), Instant::now());
        if !fits {
            self.suspensions.reclaims_failed += 1;
        }
        self.record_reclaim(ReclaimReport {
            lease: plan.lease.to_string(),
            gpu: plan.gpu.clone(),
            shortfall: plan.shortfall,
            bytes: freed,
            victims: suspended,
            succeeded: fits,
            lock_ms: times.lock.as_secs_f64() * 1e3,
            checkpoint_ms: times.checkpoint.as_secs_f64() * 1e3,
            total_ms: times.total.as_secs_f64() * 1e3,
            bound_ms: plan.bound.as_secs_f64() * 1e3,
            at_unix_ms: unix_ms(),
        });
        let quota = self.lease_query(&plan.lease, plan.connection);
        if fits {
            tracing::info!(lease = %plan.lease, bytes = plan.bytes, freed, total_ms = times.total.as_millis() as u64, "memory reclaimed from low-priority leases");
            return Ok(Charge {
                granted: true,
                used: quota.memory_used,
                quota: quota.memory_quota,
                overhead: quota.memory_overhead,
            });
        }
        let used = self.lease_credit(&plan.lease, plan.connection, plan.bytes)?;
        tracing::warn!(lease = %plan.lease, bytes = plan.bytes, freed, "memory reclaim did not free enough: the allocation is refused");
        Ok(Charge {
            granted: false,
            used,
            quota: quota.memory_quota,
            overhead: quota.memory_overhead,
        })
    }

    fn record_reclaim(&mut self, report: ReclaimReport) {
        let recent = &mut self.suspensions.recent;
        if recent.len() == RECENT_RECLAIMS {
            recent.pop_front();
        }
        recent.push_back(report);
    }

    /// Suspended leases that fit back on their GPU now, oldest first, marked restoring;
    /// none on a GPU whose last reclaim is younger than `memory.restore_delay_ms`.
    pub fn take_restorable(&mut self) -> Vec<Victim> {
        let now = Instant::now();
        let delay = Duration::from_millis(self.memory.restore_delay_ms);
        let mut back = Vec::new();
        let gpus: BTreeSet<String> = self
            .suspensions
            .by_lease
            .values()
            .map(|s| s.gpu.clone())
            .collect();
        for gpu in gpus {
            if self
                .suspensions
                .by_lease
                .values()
                .any(|s| s.gpu == gpu && s.phase != SuspensionPhase::Suspended)
            {
                // A reclaim or restore is under way there: its figures are not final.
                continue;
            }
            if self
                .suspensions
                .last_reclaim
                .get(&gpu)
                .is_some_and(|at| now.duration_since(*at) < delay)
            {
                continue;
            }
            let free = self
                .allocatable(&gpu)
                .saturating_sub(self.gpu_memory_in_use(&gpu));
            let waiting: Vec<(LeaseId, reclaim::Suspended, Vec<u32>)> = self
                .suspensions
                .by_lease
                .iter()
                .filter(|(_, s)| s.gpu == gpu)
                .map(|(id, s)| {
                    let admitted = self.lease(id).map_or(0, |l| l.created_unix_ms);
                    // What it holds now: a process that exited meanwhile is credited.
                    // A lease none of whose processes has attached (after a restart: a
                    // checkpointed process cannot) needs what it held when suspended.
                    let bytes = match self.ledger.get(id) {
                        Some(l) if !l.clients.is_empty() => l.used().min(s.bytes),
                        _ => s.bytes,
                    };
                    (
                        id.clone(),
                        reclaim::Suspended { bytes, admitted },
                        s.pids.clone(),
                    )
                })
                .collect();
            let order: Vec<reclaim::Suspended> = waiting.iter().map(|w| w.1).collect();
            for i in reclaim::restore_order(free, &order) {
                let (lease, s, pids) = &waiting[i];
                if let Some(record) = self.suspensions.by_lease.get_mut(lease) {
                    record.phase = SuspensionPhase::Restoring;
                }
                back.push(Victim {
                    lease: lease.clone(),
                    pids: pids.clone(),
                    bytes: s.bytes,
                });
            }
        }
        back
    }

    /// Processes of released leases that were suspended (see `Suspensions::forget`).
    pub fn take_orphans(&mut self) -> Vec<Vec<u32>> {
        std::mem::take(&mut self.suspensions.orphans)
    }

    pub fn return_orphan(&mut self, pids: Vec<u32>) {
        self.suspensions.orphans.push(pids);
    }

    /// A restore ended: the lease runs again (`Ok`), or stays suspended to be tried
    /// again (its memory did not fit after all: something outside the leases took it).
    pub fn finish_restore(&mut self, lease: &LeaseId, restored: bool) {
        if restored {
            self.suspensions.by_lease.remove(lease);
            self.suspensions.restores += 1;
        } else if let Some(s) = self.suspensions.by_lease.get_mut(lease) {
            s.phase = SuspensionPhase::Suspended;
        }
    }

    /// After a restart: the leases the journal says were suspended or being suspended,
    /// as the driver reports their processes now (`reclaimer::recover`).
    pub fn recover_suspension(&mut self, lease: &LeaseId, suspension: Option<Suspension>) {
        match suspension {
            Some(s) if self.leases.contains_key(lease) => {
                self.suspensions.by_lease.insert(lease.clone(), s);
            }
            _ => {
                self.suspensions.by_lease.remove(lease);
            }
        }
    }

    /// A lease the driver failed on: reported, never chosen again.
    pub fn mark_never_again(&mut self, lease: &LeaseId, why: String) {
        self.suspensions.never_again.insert(lease.clone(), why);
    }

    /// For status: the suspended leases and the last reclaims.
    pub fn reclaim_status(&self) -> Option<gpushare_proto::ReclaimStatus> {
        if !self.memory.reclaim {
            return None;
        }
        let suspended = self
            .suspensions
            .by_lease
            .iter()
            .map(|(id, s)| SuspendedLease {
                lease: id.to_string(),
                name: self
                    .lease(id)
                    .map(|l| self.container_name(l))
                    .unwrap_or_default(),
                gpu: s.gpu.clone(),
                bytes: s.bytes,
                phase: format!("{:?}", s.phase).to_lowercase(),
                since_unix_ms: s.since_unix_ms,
            })
            .collect();
        Some(gpushare_proto::ReclaimStatus {
            low_overcommit: self.memory.low_overcommit,
            floor_ms: self.memory.reclaim_floor_ms,
            checkpoint_gbps: self.memory.checkpoint_gbps,
            suspended,
            never_again: self
                .suspensions
                .never_again
                .iter()
                .map(|(l, why)| (l.to_string(), why.clone()))
                .collect(),
            recent: self.suspensions.recent.iter().cloned().collect(),
            reclaims: self.suspensions.reclaims,
            reclaims_failed: self.suspensions.reclaims_failed,
            restores: self.suspensions.restores,
            reclaimed_bytes: self.suspensions.reclaimed_bytes,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests;
