//! The reclaim's driver side against a fake driver that keeps each process's state as
//! the real one does (cuda.h's transitions), with faults on demand.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use gpushare_proto::{LeaseId, Priority};

use super::*;
use crate::state::{ChargeDecision, ReclaimTestNode};

const GI: u64 = 1 << 30;

#[derive(Default)]
struct FakeDriver {
    states: Mutex<BTreeMap<u32, ProcessState>>,
    /// Checkpoints refused (`CUDA_ERROR_NOT_SUPPORTED`: IPC or managed memory).
    unsupported: Mutex<BTreeSet<u32>>,
    /// Locks that time out (`CUDA_ERROR_NOT_READY`).
    busy: Mutex<BTreeSet<u32>>,
    /// Restores refused for want of memory.
    no_room: Mutex<bool>,
    /// Checkpoints that fail and leave the process FAILED.
    failing: Mutex<BTreeSet<u32>>,
}

impl FakeDriver {
    fn with(pids: &[u32]) -> Arc<FakeDriver> {
        let d = FakeDriver::default();
        for &pid in pids {
            d.states.lock().unwrap().insert(pid, ProcessState::Running);
        }
        Arc::new(d)
    }

    fn state_of(&self, pid: u32) -> Option<ProcessState> {
        self.states.lock().unwrap().get(&pid).copied()
    }

    fn set(&self, pid: u32, state: ProcessState) {
        self.states.lock().unwrap().insert(pid, state);
    }

    fn step(&self, pid: u32, from: ProcessState, to: ProcessState) -> Result<(), DriverError> {
        let mut states = self.states.lock().unwrap();
        let state = states
            .get_mut(&pid)
            .ok_or(DriverError::NoSuchProcess(pid))?;
        if *state != from {
            return Err(DriverError::IllegalState);
        }
        *state = to;
        Ok(())
    }
}

impl CheckpointDriver for FakeDriver {
    fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        self.state_of(pid).ok_or(DriverError::NoSuchProcess(pid))
    }
    fn lock(&self, pid: u32, _timeout: Duration) -> Result<(), DriverError> {
        if self.busy.lock().unwrap().contains(&pid) {
            return Err(DriverError::LockTimeout);
        }
        self.step(pid, ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        if self.unsupported.lock().unwrap().contains(&pid) {
            return Err(DriverError::NotSupported);
        }
        if self.failing.lock().unwrap().contains(&pid) {
            self.set(pid, ProcessState::Failed);
            return Err(DriverError::Other {
                call: "cuCheckpointProcessCheckpoint",
                code: 999,
            });
        }
        self.step(pid, ProcessState::Locked, ProcessState::Checkpointed)
    }
    fn restore(&self, pid: u32) -> Result<(), DriverError> {
        if *self.no_room.lock().unwrap() {
            return Err(DriverError::OutOfMemory);
        }
        self.step(pid, ProcessState::Checkpointed, ProcessState::Locked)
    }
    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.step(pid, ProcessState::Locked, ProcessState::Running)
    }
}

/// Two low leases holding 3 GiB each and a high one holding 1 GiB of one 8 GiB GPU.
struct Setup {
    node: ReclaimTestNode,
    low: [(LeaseId, u64); 2],
    high: (LeaseId, u64),
}

impl Setup {
    fn new() -> Setup {
        let mut node = ReclaimTestNode::new(true, 1.0);
        let a = node.lease("a", "4Gi", Priority::Low).unwrap();
        let b = node.lease("b", "4Gi", Priority::Low).unwrap();
        let h = node.lease("h", "7Gi", Priority::High).unwrap();
        for (lease, bytes) in [(&a, 3 * GI), (&b, 3 * GI), (&h, GI)] {
            assert!(matches!(node.charge(lease, bytes), ChargeDecision::Done(c) if c.granted));
        }
        Setup {
            node,
            low: [a, b],
            high: h,
        }
    }

    /// The setup, its two low leases' pids and a driver that runs them.
    fn with_driver() -> (Setup, Vec<u32>, Arc<FakeDriver>) {
        let setup = Setup::new();
        let pids: Vec<u32> = setup.low.iter().map(Setup::pid).collect();
        let driver = FakeDriver::with(&pids);
        (setup, pids, driver)
    }

    fn pid(lease: &(LeaseId, u64)) -> u32 {
        lease.1 as u32 + 1
    }

    /// The handle, with a reclaimer over `driver`; the plan of a 6 GiB charge of the
    /// high lease (3 + 3 + 1 + 6 = 13: both low leases are needed).
    fn start(self, driver: Arc<FakeDriver>) -> (ArbiterHandle, Arc<Reclaimer>, ReclaimPlan, Self) {
        let Setup {
            mut node,
            low,
            high,
        } = self;
        let ChargeDecision::Reclaim(plan) = node.charge(&high, 5 * GI) else {
            panic!("a reclaim was expected");
        };
        let state_dir = node.dir.path().join("state");
        let arbiter = std::mem::replace(
            &mut node.arbiter,
            crate::state::tests::open_with_probe(
                crate::state::tests::config(&node.dir.path().join("unused")),
                1,
                Box::new(crate::process::tests::FakeProcs::default()),
            ),
        );
        let handle = ArbiterHandle::new(arbiter);
        let reclaimer = Reclaimer::new(driver, &state_dir, None);
        handle.set_reclaimer(reclaimer.clone());
        (handle, reclaimer, plan, Setup { node, low, high })
    }
}

fn journal_of(node: &ReclaimTestNode) -> BTreeMap<LeaseId, Suspension> {
    journal::read(&journal::path(&node.dir.path().join("state"))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_checkpoints_both_victims_grants_the_charge_and_the_restorer_brings_them_back() {
    let (setup, pids, driver) = Setup::with_driver();
    let (handle, reclaimer, plan, setup) = setup.start(driver.clone());
    assert_eq!(plan.victims.len(), 2);
    let charge = reclaimer.reclaim(&handle, plan).await.unwrap();
    assert!(charge.granted);
    for &pid in &pids {
        assert_eq!(driver.state_of(pid), Some(ProcessState::Checkpointed));
    }
    let journal = journal_of(&setup.node);
    assert_eq!(journal.len(), 2);
    assert!(journal
        .values()
        .all(|s| s.phase == SuspensionPhase::Suspended));
    // Nothing fits back while the high lease holds its memory.
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(pids[0]), Some(ProcessState::Checkpointed));
    // It frees 2 GiB (4 GiB free): one low lease fits back, the older one.
    handle.credit(&setup.high.0, setup.high.1, 2 * GI).unwrap();
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(
        driver.state_of(pids[0]),
        Some(ProcessState::Running),
        "the older"
    );
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Checkpointed));
    handle.credit(&setup.high.0, setup.high.1, 3 * GI).unwrap();
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Running));
    assert!(journal_of(&setup.node).is_empty());
    assert!(handle.suspensions().is_empty());
    let status = handle.status().reclaim.unwrap();
    assert_eq!((status.reclaims, status.restores), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_the_driver_cannot_checkpoint_is_unlocked_never_chosen_again_and_the_charge_refused(
) {
    let (setup, pids, driver) = Setup::with_driver();
    driver.unsupported.lock().unwrap().insert(pids[0]);
    let (handle, reclaimer, plan, _setup) = setup.start(driver.clone());
    let charge = reclaimer.reclaim(&handle, plan).await.unwrap();
    assert!(!charge.granted, "one victim alone does not free enough");
    assert_eq!(
        driver.state_of(pids[0]),
        Some(ProcessState::Running),
        "undone"
    );
    let status = handle.status().reclaim.unwrap();
    assert_eq!(status.never_again.len(), 1);
    assert_eq!(status.reclaims_failed, 1);
    // The other was suspended for nothing: it comes back.
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Running));
    assert!(handle.suspensions().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_that_times_out_touches_nothing_and_may_be_tried_again() {
    let (setup, pids, driver) = Setup::with_driver();
    driver.busy.lock().unwrap().insert(pids[1]);
    let (handle, reclaimer, plan, _setup) = setup.start(driver.clone());
    let charge = reclaimer.reclaim(&handle, plan).await.unwrap();
    assert!(!charge.granted);
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Running));
    assert!(handle.status().reclaim.unwrap().never_again.is_empty());
    reclaimer.restore_what_fits(&handle).await;
    assert!(pids
        .iter()
        .all(|&p| driver.state_of(p) == Some(ProcessState::Running)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_keeps_what_is_checkpointed_unlocks_what_is_only_locked_and_reports_failed() {
    let (setup, _pids, driver) = Setup::with_driver();
    let (handle, reclaimer, plan, setup) = setup.start(driver.clone());
    // As a kill left it: the journal lists both victims as being suspended; the first
    // is checkpointed, the second only locked.
    let journal: BTreeMap<LeaseId, Suspension> = plan
        .victims
        .iter()
        .map(|v| {
            (
                v.lease.clone(),
                Suspension {
                    gpu: "GPU-0".into(),
                    pids: v.pids.clone(),
                    bytes: v.bytes,
                    phase: SuspensionPhase::Suspending,
                    since_unix_ms: 1,
                },
            )
        })
        .collect();
    let path = journal::path(&setup.node.dir.path().join("state"));
    journal::write(&path, &journal).unwrap();
    let first = Setup::pid(&setup.low[0]);
    let second = Setup::pid(&setup.low[1]);
    driver.set(first, ProcessState::Checkpointed);
    driver.set(second, ProcessState::Locked);
    handle
        .finish_reclaim(&plan, &[], ReclaimTimes::default())
        .unwrap();
    reclaimer.recover(&handle).unwrap();
    assert_eq!(
        driver.state_of(second),
        Some(ProcessState::Running),
        "unlocked"
    );
    assert_eq!(driver.state_of(first), Some(ProcessState::Checkpointed));
    let suspended = handle.suspensions();
    assert_eq!(suspended.len(), 1);
    assert_eq!(suspended[&setup.low[0].0].phase, SuspensionPhase::Suspended);
    assert_eq!(journal_of(&setup.node).len(), 1);
    // It fits: the restorer brings it back.
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(first), Some(ProcessState::Running));
    assert!(journal_of(&setup.node).is_empty());
    // A FAILED process is reported and its lease never chosen again.
    journal::write(&path, &journal).unwrap();
    driver.set(first, ProcessState::Failed);
    reclaimer.recover(&handle).unwrap();
    let status = handle.status().reclaim.unwrap();
    assert_eq!(status.never_again.len(), 1, "{status:?}");
    assert!(handle.suspensions().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_suspended_lease_is_restored_and_unlocked_whatever_it_holds() {
    let (setup, pids, driver) = Setup::with_driver();
    let (handle, reclaimer, plan, setup) = setup.start(driver.clone());
    assert!(reclaimer.reclaim(&handle, plan).await.unwrap().granted);
    handle.release(&setup.low[1].0).await.unwrap();
    // Memory for it is not free, yet its processes must not stay locked for ever.
    *driver.no_room.lock().unwrap() = true;
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Checkpointed));
    *driver.no_room.lock().unwrap() = false;
    reclaimer.restore_what_fits(&handle).await;
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Running));
    assert_eq!(
        driver.state_of(pids[0]),
        Some(ProcessState::Checkpointed),
        "still waits for room"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_that_fails_is_reported_and_its_lease_is_never_chosen_again() {
    let (setup, pids, driver) = Setup::with_driver();
    driver.failing.lock().unwrap().insert(pids[1]);
    let (handle, reclaimer, plan, setup) = setup.start(driver.clone());
    let charge = reclaimer.reclaim(&handle, plan).await.unwrap();
    assert!(!charge.granted);
    assert_eq!(driver.state_of(pids[1]), Some(ProcessState::Failed));
    let status = handle.status().reclaim.unwrap();
    assert_eq!(status.never_again.len(), 1, "{status:?}");
    assert!(status.never_again[0].1.contains("FAILED"), "{status:?}");
    reclaimer.restore_what_fits(&handle).await;
    // The same charge again: the failed lease is not tried; the other alone is not enough.
    let decision = handle
        .charge(&setup.high.0, setup.high.1, 5 * GI)
        .await
        .unwrap();
    assert!(!decision.granted);
    assert_eq!(
        handle.status().reclaim.unwrap().reclaims,
        1,
        "no second reclaim"
    );
}
