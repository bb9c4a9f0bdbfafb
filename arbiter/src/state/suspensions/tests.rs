use super::*;
use crate::lease_connection::ShareChange;
use crate::process::tests::FakeProcs;
use crate::state::tests::{config, open_with_probe, request, SharedProbe};

const GI: u64 = 1 << 30;

/// One 8 GiB GPU; `reclaim` sets `[memory] reclaim`.
pub(crate) struct Node {
    pub dir: tempfile::TempDir,
    pub arbiter: Arbiter,
    procs: Arc<FakeProcs>,
    next_pid: u32,
}

impl Node {
    pub fn new(reclaim: bool, overcommit: f64) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let procs = Arc::new(FakeProcs::default());
        let mut arbiter =
            open_with_probe(config(dir.path()), 1, Box::new(SharedProbe(procs.clone())));
        arbiter.set_memory_config(gpushare_config::MemoryConfig {
            reclaim,
            low_overcommit: overcommit,
            // Restores are looked at as soon as the tests free memory.
            restore_delay_ms: 0,
            ..Default::default()
        });
        Node {
            dir,
            arbiter,
            procs,
            next_pid: 100,
        }
    }

    /// A confirmed lease with one attached process, pid `connection + 1`.
    pub fn lease(
        &mut self,
        name: &str,
        memory: &str,
        priority: Priority,
    ) -> Result<(LeaseId, u64), StateError> {
        // Admission order is the creation time in ms: keep the leases apart in it.
        std::thread::sleep(Duration::from_millis(3));
        let granted = self.arbiter.reserve_now(request(name, memory, priority))?;
        let pid = self.next_pid;
        self.next_pid += 10;
        let cgroup = format!("/{name}");
        let mut procs = self.procs.0.lock().unwrap();
        procs.insert(pid, (1, "pid:[9]".into(), cgroup.clone()));
        procs.insert(pid + 1, (1, "pid:[9]".into(), cgroup));
        drop(procs);
        self.arbiter.confirm(name, pid).unwrap();
        let id = granted.lease.id;
        let connection = u64::from(pid);
        self.arbiter
            .lease_attach(&id, connection, pid + 1, 0)
            .unwrap();
        Ok((id, connection))
    }

    pub fn charge(&mut self, lease: &(LeaseId, u64), bytes: u64) -> ChargeDecision {
        self.arbiter
            .lease_charge_on_gpu(&lease.0, lease.1, bytes)
            .unwrap()
    }
}

/// A low lease holding 4 GiB, a high one 4 GiB, and the plan for 2 GiB more of it.
fn one_low_full_and_a_high_short() -> (Node, (LeaseId, u64), (LeaseId, u64), ReclaimPlan) {
    let mut node = Node::new(true, 1.0);
    let a = node.lease("a", "4Gi", Priority::Low).unwrap();
    let h = node.lease("h", "6Gi", Priority::High).unwrap();
    assert!(granted(node.charge(&a, 4 * GI)));
    assert!(granted(node.charge(&h, 4 * GI)));
    let ChargeDecision::Reclaim(plan) = node.charge(&h, 2 * GI) else {
        panic!("a reclaim was expected");
    };
    (node, a, h, plan)
}

/// Finishes `plan` with `victim` suspended, as the reclaimer reports a checkpoint that worked.
fn suspended(node: &mut Node, plan: &ReclaimPlan, victim: &LeaseId) -> Charge {
    node.arbiter
        .finish_reclaim(
            plan,
            &[(victim.clone(), SuspendOutcome::Suspended)],
            ReclaimTimes::default(),
        )
        .unwrap()
}

fn granted(decision: ChargeDecision) -> bool {
    match decision {
        ChargeDecision::Done(c) => c.granted,
        ChargeDecision::Reclaim(plan) => panic!("a reclaim was planned: {plan:?}"),
    }
}

#[test]
fn without_reclaim_quotas_are_a_static_partition() {
    let mut node = Node::new(false, 1.0);
    node.lease("a", "4Gi", Priority::Low).unwrap();
    node.lease("b", "4Gi", Priority::Low).unwrap();
    let err = node.lease("h", "6Gi", Priority::High).unwrap_err();
    assert!(err.to_string().contains("admission queue"), "waits: {err}");
}

#[test]
fn a_high_lease_is_admitted_over_lent_memory_and_lows_within_the_overcommit() {
    let mut node = Node::new(true, 1.5);
    // 8 GiB guaranteed to nobody yet: lows may take 1.5 x 8 = 12 GiB of quotas.
    node.lease("a", "6Gi", Priority::Low).unwrap();
    node.lease("b", "6Gi", Priority::Low).unwrap();
    let err = node.lease("c", "1Gi", Priority::Low).unwrap_err();
    assert!(err.to_string().contains("admission queue"), "waits: {err}");
    // The high quota needs only memory no guaranteed lease holds.
    node.lease("h", "6Gi", Priority::High).unwrap();
    // Now 2 GiB is left unguaranteed: lows may hold 3 GiB of quotas, they hold 12.
    let err = node.lease("d", "1Gi", Priority::Low).unwrap_err();
    assert!(err.to_string().contains("admission queue"), "waits: {err}");
}

#[test]
fn a_high_charge_that_needs_lent_memory_suspends_the_fewest_youngest_lows_and_they_come_back() {
    let mut node = Node::new(true, 1.0);
    let a = node.lease("a", "4Gi", Priority::Low).unwrap();
    let b = node.lease("b", "4Gi", Priority::Low).unwrap();
    let h = node.lease("h", "6Gi", Priority::High).unwrap();
    assert!(granted(node.charge(&a, 3 * GI)));
    assert!(granted(node.charge(&b, 3 * GI)));
    assert!(granted(node.charge(&h, GI)), "7 GiB of 8 in use");
    // 3 + 3 + 1 + 3 = 10 GiB: 2 GiB short; one low lease covers it, the youngest.
    let ChargeDecision::Reclaim(plan) = node.charge(&h, 3 * GI) else {
        panic!("a reclaim was expected");
    };
    assert_eq!(plan.shortfall, 2 * GI);
    assert_eq!(plan.victims.len(), 1);
    assert_eq!(
        plan.victims[0].lease, b.0,
        "the younger of two equal leases"
    );
    assert_eq!(plan.victims[0].bytes, 3 * GI);
    assert!(plan.victims[0].pids.contains(&(b.1 as u32 + 1)));
    assert_eq!(
        plan.bound,
        Duration::from_millis(250),
        "3 GiB at 25 GB/s: the floor"
    );
    assert_eq!(
        node.arbiter.suspension(&b.0).unwrap().phase,
        SuspensionPhase::Suspending
    );
    // While it is suspended, a low charge that does not fit is refused at once.
    assert!(!granted(node.charge(&a, GI)), "the GPU is full");
    let charge = suspended(&mut node, &plan, &b.0);
    assert!(charge.granted);
    assert_eq!(node.arbiter.gpu_memory_in_use("GPU-0"), 7 * GI);
    let status = node.arbiter.reclaim_status().unwrap();
    assert_eq!(status.suspended.len(), 1);
    assert_eq!((status.reclaims, status.reclaims_failed), (1, 0));
    assert_eq!(status.recent[0].bytes, 3 * GI);
    // Nothing fits back until the high job frees memory.
    assert!(node.arbiter.take_restorable().is_empty());
    node.arbiter.lease_credit(&h.0, h.1, 3 * GI).unwrap();
    let back = node.arbiter.take_restorable();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].lease, b.0);
    node.arbiter.finish_restore(&b.0, true);
    assert!(node.arbiter.suspension(&b.0).is_none());
    assert_eq!(node.arbiter.gpu_memory_in_use("GPU-0"), 7 * GI);
}

#[test]
fn a_lease_sharing_memory_is_never_chosen_and_a_shortfall_it_alone_could_cover_is_refused() {
    let mut node = Node::new(true, 1.0);
    let ipc = node.lease("ipc", "4Gi", Priority::Low).unwrap();
    let b = node.lease("b", "4Gi", Priority::Low).unwrap();
    let h = node.lease("h", "6Gi", Priority::High).unwrap();
    assert!(granted(node.charge(&ipc, 3 * GI)));
    node.arbiter
        .lease_share(
            &ipc.0,
            ipc.1,
            ShareChange::Share {
                key: gpushare_proto::ShareKey { dev: 1, ino: 2 },
                bytes: 3 * GI,
                same_as: None,
            },
        )
        .unwrap();
    assert!(granted(node.charge(&b, GI)));
    // 3 + 1 + 3 = 7: fits.
    assert!(granted(node.charge(&h, 3 * GI)));
    // 2 GiB short: b holds 1 GiB, the IPC lease cannot be checkpointed.
    match node.charge(&h, 3 * GI) {
        ChargeDecision::Done(c) => assert!(!c.granted, "refused"),
        ChargeDecision::Reclaim(plan) => panic!("{plan:?}"),
    }
    assert!(node.arbiter.suspensions().is_empty(), "nothing was touched");
    // 1 GiB short: b alone, never the IPC lease.
    let ChargeDecision::Reclaim(plan) = node.charge(&h, 2 * GI) else {
        panic!("a reclaim was expected");
    };
    assert_eq!(plan.victims.len(), 1);
    assert_eq!(plan.victims[0].lease, b.0);
}

#[test]
fn a_reclaim_that_frees_too_little_takes_the_charge_back_and_marks_what_the_driver_refused() {
    let (mut node, a, h, plan) = one_low_full_and_a_high_short();
    let charge = node
        .arbiter
        .finish_reclaim(
            &plan,
            &[(
                a.0.clone(),
                SuspendOutcome::Undone {
                    why: "managed memory".into(),
                    never_again: true,
                },
            )],
            ReclaimTimes::default(),
        )
        .unwrap();
    assert!(!charge.granted);
    assert_eq!(charge.used, 4 * GI, "the charge was taken back");
    assert!(node.arbiter.suspensions().is_empty());
    // Never chosen again.
    match node.charge(&h, 2 * GI) {
        ChargeDecision::Done(c) => assert!(!c.granted),
        ChargeDecision::Reclaim(plan) => panic!("{plan:?}"),
    }
    let status = node.arbiter.reclaim_status().unwrap();
    assert_eq!(status.never_again.len(), 1);
    assert_eq!(status.reclaims_failed, 1);
}

#[test]
fn a_released_suspended_lease_leaves_its_processes_to_the_restorer() {
    let (mut node, a, _h, plan) = one_low_full_and_a_high_short();
    suspended(&mut node, &plan, &a.0);
    node.arbiter.release(&a.0).unwrap();
    assert!(node.arbiter.suspensions().is_empty());
    assert_eq!(
        node.arbiter.take_orphans(),
        vec![plan.victims[0].pids.clone()]
    );
}

#[test]
fn suspended_leases_stay_off_the_gpu_for_the_restore_delay_after_a_reclaim() {
    let (mut node, a, h, plan) = one_low_full_and_a_high_short();
    node.arbiter
        .set_memory_config(gpushare_config::MemoryConfig {
            reclaim: true,
            restore_delay_ms: 3_600_000,
            ..Default::default()
        });
    suspended(&mut node, &plan, &a.0);
    node.arbiter.lease_credit(&h.0, h.1, 6 * GI).unwrap();
    assert!(
        node.arbiter.take_restorable().is_empty(),
        "it fits, but the high job may take the memory again"
    );
    node.arbiter
        .set_memory_config(gpushare_config::MemoryConfig {
            reclaim: true,
            restore_delay_ms: 0,
            ..Default::default()
        });
    assert_eq!(node.arbiter.take_restorable().len(), 1);
}
