//! Memory that follows priority, the doing: takes low-priority leases off their GPU for
//! a high-priority charge (revoke their token, lock their processes with a timeout,
//! checkpoint them), brings them back when their memory fits again (restore, unlock,
//! resume their token), oldest first, and after a restart finishes or undoes whatever a
//! killed arbiter left half done. The decisions are the state's (`state::suspensions`)
//! and pure (`reclaim`); the driver calls run on the blocking pool, without the lock,
//! each step written to the journal (`reclaim::journal`) before it is taken.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checkpoint::{CheckpointDriver, DriverError, ProcessState};
use crate::reclaim::journal;
use crate::state::{
    ArbiterHandle, MemoryReclaim, ReclaimPlan, ReclaimTimes, SuspendOutcome, Suspension,
    SuspensionPhase,
};

/// How often suspended leases are looked at when nothing wakes the restorer: a memory
/// release wakes it at once; this catches processes that exited.
const RESTORE_POLL: Duration = Duration::from_millis(250);

/// Where a test kills the arbiter (`GPUSHARE_FAULT_RECLAIM=<point>[:<file>]`; with a
/// file, only the first time, the one that creates it): the fault tests SIGKILL it at
/// each step of a reclaim and a restore. Unset in production.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// The journal lists the victims; nothing is locked yet.
    Suspending,
    /// The first victim's processes are locked, none checkpointed.
    Locked,
    /// The first victim's processes are checkpointed.
    Checkpointed,
    /// Every victim is suspended and recorded; the charge is not answered yet.
    Suspended,
    /// A restore brought a lease's processes back; they are still locked.
    Restored,
}

/// A fault point and, if it fires only once, the file whose creation arms it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub point: FaultPoint,
    pub once: Option<PathBuf>,
}

impl Fault {
    pub fn from_env() -> Option<Fault> {
        let value = std::env::var("GPUSHARE_FAULT_RECLAIM").ok()?;
        let (point, once) = match value.split_once(':') {
            Some((point, file)) => (point.to_owned(), Some(PathBuf::from(file))),
            None => (value, None),
        };
        let point = match point.as_str() {
            "suspending" => FaultPoint::Suspending,
            "locked" => FaultPoint::Locked,
            "checkpointed" => FaultPoint::Checkpointed,
            "suspended" => FaultPoint::Suspended,
            "restored" => FaultPoint::Restored,
            other => {
                tracing::warn!(
                    point = other,
                    "GPUSHARE_FAULT_RECLAIM names no fault point: ignored"
                );
                return None;
            }
        };
        Some(Fault { point, once })
    }

    /// Whether to die at `point` now.
    fn fires_at(&self, point: FaultPoint) -> bool {
        self.point == point
            && self.once.as_ref().is_none_or(|file| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(file)
                    .is_ok()
            })
    }
}

impl MemoryReclaim for Reclaimer {
    fn reclaim<'a>(
        &'a self,
        arbiter: &'a ArbiterHandle,
        plan: ReclaimPlan,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<
                    Output = Result<crate::ledger::Charge, crate::state::StateError>,
                > + Send
                + 'a,
        >,
    > {
        Box::pin(Reclaimer::reclaim(self, arbiter, plan))
    }

    fn memory_freed(&self) {
        self.wake.notify_one();
    }
}

/// Kills the daemon at `point` where the fault tests asked for it.
fn die_at(fault: Option<&Fault>, point: FaultPoint) {
    if fault.is_some_and(|f| f.fires_at(point)) {
        tracing::error!(?point, "fault injection: the arbiter kills itself here");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// Why a lease's suspension was undone.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    why: String,
    never_again: bool,
}

pub struct Reclaimer {
    driver: Arc<dyn CheckpointDriver>,
    journal: PathBuf,
    /// One reclaim or restore at a time: each works from figures the other changes.
    gate: tokio::sync::Mutex<()>,
    wake: tokio::sync::Notify,
    fault: Option<Fault>,
}

impl Reclaimer {
    pub fn new(
        driver: Arc<dyn CheckpointDriver>,
        state_dir: &std::path::Path,
        fault: Option<Fault>,
    ) -> Arc<Reclaimer> {
        Arc::new(Reclaimer {
            driver,
            journal: journal::path(state_dir),
            gate: tokio::sync::Mutex::new(()),
            wake: tokio::sync::Notify::new(),
            fault,
        })
    }

    fn fault(&self, point: FaultPoint) {
        die_at(self.fault.as_ref(), point);
    }

    fn write_journal(&self, arbiter: &ArbiterHandle) {
        if let Err(e) = journal::write(&self.journal, &arbiter.suspensions()) {
            tracing::error!(error = %e, file = %self.journal.display(), "cannot write the reclaim journal");
        }
    }

    /// Suspends `plan`'s victims until enough memory is free for its charge, within its
    /// bound, and answers the charge.
    pub async fn reclaim(
        &self,
        arbiter: &ArbiterHandle,
        plan: ReclaimPlan,
    ) -> Result<crate::ledger::Charge, crate::state::StateError> {
        let _gate = self.gate.lock().await;
        let start = Instant::now();
        self.write_journal(arbiter);
        self.fault(FaultPoint::Suspending);
        let tokens = arbiter.tokens();
        let mut outcomes = Vec::new();
        let mut times = ReclaimTimes::default();
        for (n, victim) in plan.victims.iter().enumerate() {
            let left = plan.bound.saturating_sub(start.elapsed());
            if left.is_zero() {
                tracing::warn!(lease = %victim.lease, "the reclaim's bound passed before this victim");
                break;
            }
            if let Some(t) = &tokens {
                t.suspend_lease(&victim.lease);
            }
            let driver = self.driver.clone();
            let pids = victim.pids.clone();
            let fault = self.fault.clone().filter(|_| n == 0);
            let result = tokio::task::spawn_blocking(move || {
                suspend_processes(driver.as_ref(), &pids, left, fault.as_ref())
            })
            .await
            .unwrap_or_else(|e| {
                Err(Refusal {
                    why: format!("the suspension panicked: {e}"),
                    never_again: false,
                })
            });
            let outcome = match result {
                Ok((lock, checkpoint, any)) => {
                    times.lock = times.lock.max(lock);
                    times.checkpoint += checkpoint;
                    if any {
                        SuspendOutcome::Suspended
                    } else {
                        SuspendOutcome::Gone
                    }
                }
                Err(Refusal { why, never_again }) => {
                    tracing::warn!(lease = %victim.lease, why, "suspension undone");
                    SuspendOutcome::Undone { why, never_again }
                }
            };
            if outcome != SuspendOutcome::Suspended {
                if let Some(t) = &tokens {
                    t.resume_lease(&victim.lease);
                }
            }
            outcomes.push((victim.lease.clone(), outcome));
        }
        times.total = start.elapsed();
        let charge = arbiter.finish_reclaim(&plan, &outcomes, times);
        self.write_journal(arbiter);
        self.fault(FaultPoint::Suspended);
        if !charge.as_ref().is_ok_and(|c| c.granted) {
            // What was suspended for nothing may come back.
            self.memory_freed();
        }
        charge
    }

    /// Brings suspended leases back while they fit, oldest first; runs until the
    /// daemon stops.
    pub async fn restore_loop(self: Arc<Self>, arbiter: ArbiterHandle) {
        loop {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(RESTORE_POLL) => {}
            }
            self.restore_what_fits(&arbiter).await;
        }
    }

    /// One pass of the restorer (the tests call it directly).
    pub async fn restore_what_fits(self: &Arc<Self>, arbiter: &ArbiterHandle) {
        let _gate = self.gate.lock().await;
        for pids in arbiter.take_orphans() {
            let driver = self.driver.clone();
            let me = self.clone();
            let restored = tokio::task::spawn_blocking(move || {
                me.restore_processes(driver.as_ref(), &pids)
                    .map_err(|e| (e, pids))
            })
            .await;
            if let Ok(Err((why, pids))) = restored {
                // Its memory does not fit yet: try again at the next pass.
                tracing::warn!(
                    why,
                    "a released lease's suspended processes are not back yet"
                );
                arbiter.return_orphan(pids);
            }
        }
        let back = arbiter.take_restorable();
        if back.is_empty() {
            return;
        }
        self.write_journal(arbiter);
        let tokens = arbiter.tokens();
        for victim in back {
            let driver = self.driver.clone();
            let pids = victim.pids.clone();
            let me = self.clone();
            let result =
                tokio::task::spawn_blocking(move || me.restore_processes(driver.as_ref(), &pids))
                    .await
                    .unwrap_or_else(|e| Err(format!("the restore panicked: {e}")));
            match result {
                Ok(()) => {
                    arbiter.finish_restore(&victim.lease, true);
                    if let Some(t) = &tokens {
                        t.resume_lease(&victim.lease);
                    }
                    tracing::info!(lease = %victim.lease, bytes = victim.bytes, "suspended lease restored");
                }
                Err(why) => {
                    tracing::warn!(lease = %victim.lease, why, "restore deferred");
                    arbiter.finish_restore(&victim.lease, false);
                }
            }
        }
        self.write_journal(arbiter);
    }

    /// Restores every checkpointed process, then unlocks every locked one (a lease's
    /// processes come back together). Where a process stands is asked, not assumed: after
    /// a restart some may be running already, some gone.
    fn restore_processes(&self, driver: &dyn CheckpointDriver, pids: &[u32]) -> Result<(), String> {
        let mut to_unlock = Vec::new();
        for &pid in pids {
            match driver.state(pid) {
                Ok(ProcessState::Checkpointed) => match driver.restore(pid) {
                    Ok(()) => to_unlock.push(pid),
                    Err(e) => {
                        // Put back what came back, so the lease stays whole.
                        for &done in &to_unlock {
                            let _ = driver.checkpoint(done);
                        }
                        return Err(format!("restoring pid {pid}: {e}"));
                    }
                },
                Ok(ProcessState::Locked) => to_unlock.push(pid),
                Ok(ProcessState::Running) | Err(DriverError::NoSuchProcess(_)) => {}
                Ok(ProcessState::Failed) => {
                    tracing::error!(
                        pid,
                        "a suspended process is FAILED in the driver: it cannot be restored"
                    );
                }
                Err(e) => return Err(format!("pid {pid}: {e}")),
            }
        }
        if !to_unlock.is_empty() {
            self.fault(FaultPoint::Restored);
        }
        for pid in to_unlock {
            if let Err(e) = driver.unlock(pid) {
                tracing::error!(pid, error = %e, "unlocking a restored process failed");
            }
        }
        Ok(())
    }

    /// At start, before any client is served: every lease the journal lists is looked
    /// up in the driver. A lease with a process still checkpointed stays suspended (the
    /// restorer brings it back when it fits); otherwise whatever is locked is unlocked
    /// and the lease runs on. A FAILED process is reported and its lease never chosen
    /// again.
    pub fn recover(&self, arbiter: &ArbiterHandle) -> Result<(), String> {
        let listed = journal::read(&self.journal)?;
        let tokens = arbiter.tokens();
        for (lease, mut suspension) in listed {
            let states: Vec<(u32, Result<ProcessState, DriverError>)> = suspension
                .pids
                .iter()
                .map(|&pid| (pid, self.driver.state(pid)))
                .collect();
            for (pid, state) in &states {
                if *state == Ok(ProcessState::Failed) {
                    tracing::error!(lease = %lease, pid, "a process the reclaim suspended is FAILED in the driver");
                    arbiter.mark_never_again(&lease, format!("pid {pid} is FAILED in the driver"));
                }
            }
            let checkpointed = states
                .iter()
                .any(|(_, s)| *s == Ok(ProcessState::Checkpointed));
            let kept = checkpointed && arbiter.lease(&lease).is_some();
            if kept {
                suspension.phase = SuspensionPhase::Suspended;
                if let Some(t) = &tokens {
                    t.suspend_lease(&lease);
                }
                tracing::info!(lease = %lease, "recovered a suspended lease: it is restored when it fits");
                arbiter.recover_suspension(&lease, Some(suspension));
                continue;
            }
            for (pid, state) in &states {
                if *state == Ok(ProcessState::Locked) {
                    if let Err(e) = self.driver.unlock(*pid) {
                        tracing::error!(pid, error = %e, "unlocking a process left locked failed");
                    }
                }
                if *state == Ok(ProcessState::Checkpointed) {
                    // Its lease is gone: bring the process back so it can end.
                    let _ = self.driver.restore(*pid);
                    let _ = self.driver.unlock(*pid);
                }
            }
            tracing::info!(lease = %lease, "a reclaim cut short by a restart was undone");
            arbiter.recover_suspension(&lease, None::<Suspension>);
        }
        self.write_journal(arbiter);
        Ok(())
    }
}

/// Locks every process (each within `timeout`), then checkpoints each; any failure
/// undoes what was done. Ok: (the longest lock, the checkpoints' time, whether any
/// process was there at all).
fn suspend_processes(
    driver: &dyn CheckpointDriver,
    pids: &[u32],
    timeout: Duration,
    fault: Option<&Fault>,
) -> Result<(Duration, Duration, bool), Refusal> {
    let mut locked = Vec::new();
    let mut lock_time = Duration::ZERO;
    for &pid in pids {
        let t = Instant::now();
        match driver.lock(pid, timeout) {
            Ok(()) => locked.push(pid),
            // It exited (or never created a context): nothing of it is on the GPU.
            Err(DriverError::NoSuchProcess(_)) => {}
            Err(e) => {
                undo(driver, &locked, &[]);
                return Err(Refusal {
                    never_again: e == DriverError::NotSupported,
                    why: format!("locking pid {pid}: {e}"),
                });
            }
        }
        lock_time = lock_time.max(t.elapsed());
    }
    die_at(fault, FaultPoint::Locked);
    let t = Instant::now();
    let mut checkpointed = Vec::new();
    for &pid in &locked {
        match driver.checkpoint(pid) {
            Ok(()) => checkpointed.push(pid),
            Err(DriverError::NoSuchProcess(_)) => {}
            Err(e) => {
                let failed = driver.state(pid) == Ok(ProcessState::Failed);
                undo(driver, &locked, &checkpointed);
                return Err(Refusal {
                    never_again: failed || e == DriverError::NotSupported,
                    why: format!(
                        "checkpointing pid {pid}: {e}{}",
                        if failed {
                            " (the process is FAILED)"
                        } else {
                            ""
                        }
                    ),
                });
            }
        }
    }
    die_at(fault, FaultPoint::Checkpointed);
    Ok((lock_time, t.elapsed(), !locked.is_empty()))
}

/// Puts back what a suspension did: restores the checkpointed processes, unlocks the
/// locked ones.
fn undo(driver: &dyn CheckpointDriver, locked: &[u32], checkpointed: &[u32]) {
    for &pid in checkpointed {
        if let Err(e) = driver.restore(pid) {
            tracing::error!(pid, error = %e, "restoring a process while undoing its suspension failed");
        }
    }
    for &pid in locked {
        if let Err(e) = driver.unlock(pid) {
            tracing::error!(pid, error = %e, "unlocking a process while undoing its suspension failed");
        }
    }
}

#[cfg(test)]
mod tests;
