use super::*;
use crate::process::tests::FakeProcs;
use crate::store::StoreOptions;
use gpushare_proto::{Fraction, GpuSelector};

const GI: u64 = 1 << 30;

pub(crate) struct SharedProbe(pub Arc<FakeProcs>);
impl ProcessProbe for SharedProbe {
    fn start_time(&self, pid: u32) -> Option<u64> {
        self.0.start_time(pid)
    }
    fn pid_namespace(&self, pid: u32) -> Option<String> {
        self.0.pid_namespace(pid)
    }
    fn cgroup(&self, pid: u32) -> Option<String> {
        self.0.cgroup(pid)
    }
}

pub(crate) fn config(dir: &std::path::Path) -> ArbiterConfig {
    ArbiterConfig {
        run_dir: dir.join("run"),
        state_dir: dir.join("state"),
        admission_wait_ms: 30_000,
        reconcile_grace_ms: 5_000,
        ..Default::default()
    }
}

fn open_with(config: ArbiterConfig, gpus: usize, procs: Arc<FakeProcs>) -> Arbiter {
    open_with_probe(config, gpus, Box::new(SharedProbe(procs)))
}

/// An arbiter on `config`'s directories with `gpus` 8 GiB GPUs, lease directories
/// only (no sockets), and `probe` for /proc.
pub(crate) fn open_with_probe(
    config: ArbiterConfig,
    gpus: usize,
    probe: Box<dyn ProcessProbe>,
) -> Arbiter {
    let (store, table) = LeaseStore::open(&config.state_dir, StoreOptions::default()).unwrap();
    let inventory = Inventory {
        gpus: (0..gpus)
            .map(|i| Gpu {
                index: i as u32,
                uuid: format!("GPU-{i}"),
                name: "t".into(),
                memory_total: 8 * GI,
                memory_allocatable: 8 * GI,
            })
            .collect(),
        source: "declared",
        cuda_driver_version: None,
    };
    let endpoints = Box::new(LeaseDirs {
        run_dir: config.run_dir.clone(),
    });
    Arbiter::open(config, inventory, Arc::new(store), table, endpoints, probe).unwrap()
}

fn setup() -> (tempfile::TempDir, Arbiter, Arc<FakeProcs>) {
    let dir = tempfile::tempdir().unwrap();
    let procs = Arc::new(FakeProcs::default());
    let arbiter = open_with(config(dir.path()), 1, procs.clone());
    (dir, arbiter, procs)
}

pub(crate) fn request(container: &str, memory: &str, priority: Priority) -> ReserveRequest {
    ReserveRequest {
        container_id: container.into(),
        namespace: None,
        sandbox_id: None,
        priority,
        memory: Some(memory.parse().unwrap()),
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        gpu: GpuSelector::Count(1),
        tenant: None,
        pod: None,
    }
}

fn durable(arbiter: &Arbiter, ticket: Option<Ticket>) {
    if let Some(t) = ticket {
        arbiter.store().wait_blocking(t).unwrap();
    }
}

fn reopen(dir: &std::path::Path, arbiter: Arbiter, procs: Arc<FakeProcs>) -> Arbiter {
    let config = arbiter.config.clone();
    drop(arbiter);
    let _ = dir;
    open_with(config, 1, procs)
}

#[test]
fn reserve_confirm_persist_and_survive_reopen() {
    let (dir, mut arbiter, procs) = setup();
    procs
        .0
        .lock()
        .unwrap()
        .insert(42, (7, "pid:[1]".into(), "/ctr/x".into()));
    let g = arbiter
        .reserve_now(request("c1", "1Gi", Priority::Low))
        .unwrap();
    durable(&arbiter, g.ticket);
    assert_eq!(g.lease.gpus, vec!["GPU-0".to_string()]);
    assert!(dir.path().join("run/leases").join(&g.lease.id.0).is_dir());
    let t = arbiter.confirm("c1", 42).unwrap();
    durable(&arbiter, t);
    let reopened = reopen(dir.path(), arbiter, procs);
    let status = reopened.status();
    assert_eq!(status.leases.len(), 1);
    assert_eq!(status.leases[0].pid, Some(42));
    assert_eq!(status.leases[0].state, LeaseState::Confirmed);
    assert_eq!(status.usage[0].cgroup.as_deref(), Some("/ctr/x"));
    assert_eq!(status.gpus[0].memory_leased, GI);
}

#[test]
fn release_is_idempotent_and_removes_the_directory() {
    let (dir, mut arbiter, _) = setup();
    let g = arbiter
        .reserve_now(request("c1", "1Gi", Priority::Low))
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    let leases_mode = fs::metadata(dir.path().join("run/leases"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(
        leases_mode & 0o777,
        0o711,
        "lease ids must not be listable by host users"
    );
    assert!(arbiter.release(&g.lease.id).unwrap().0);
    assert!(!arbiter.release(&g.lease.id).unwrap().0);
    assert!(!dir.path().join("run/leases").join(&g.lease.id.0).exists());
    assert!(arbiter.status().leases.is_empty());
}

#[test]
fn same_container_gets_the_same_lease() {
    let (_dir, mut arbiter, _) = setup();
    let a = arbiter
        .reserve_now(request("c1", "1Gi", Priority::Low))
        .unwrap();
    let b = arbiter
        .reserve_now(request("c1", "1Gi", Priority::Low))
        .unwrap();
    assert_eq!(a.lease.id, b.lease.id);
    assert_eq!(arbiter.status().leases.len(), 1);
    assert!(arbiter.release_container("c1").unwrap().0);
    assert!(!arbiter.release_container("c1").unwrap().0);
}

/// Two engines or two containerd namespaces may use one container id
/// at once; keyed by the id alone, the second container was handed the first
/// one's lease (its socket, its quota).
#[test]
fn one_container_id_in_two_namespaces_gets_two_leases() {
    let (dir, mut arbiter, procs) = setup();
    procs
        .0
        .lock()
        .unwrap()
        .insert(42, (7, "pid:[1]".into(), "/ctr/x".into()));
    let in_ns = |ns: &str| ReserveRequest {
        namespace: Some(ns.into()),
        ..request("web", "1Gi", Priority::Low)
    };
    let first = arbiter.reserve_now(in_ns("a")).unwrap().lease;
    let second = arbiter.reserve_now(in_ns("b")).unwrap().lease;
    assert_ne!(first.id, second.id);
    // A retry in the same namespace still gets its own lease back.
    assert_eq!(arbiter.reserve_now(in_ns("a")).unwrap().lease.id, first.id);
    // The id alone no longer says which: refused, naming both namespaces.
    let err = arbiter.confirm("web", 42).unwrap_err().to_string();
    assert!(err.contains("a, b") || err.contains("b, a"), "{err}");
    // Named by its lease (what gpushare's edit put in the spec): only that one.
    let named = ContainerRef {
        container_id: "web".into(),
        namespace: None,
        lease: Some(second.id.clone()),
    };
    let t = arbiter.confirm_in(&named, 42).unwrap();
    durable(&arbiter, t);
    let lease = |a: &Arbiter, id: &LeaseId| a.lease(id).cloned().unwrap();
    assert_eq!(lease(&arbiter, &second.id).state, LeaseState::Confirmed);
    assert_eq!(lease(&arbiter, &first.id).state, LeaseState::Reserved);
    // A lease named for another container's id is not that container's.
    let forged = ContainerRef {
        container_id: "other".into(),
        namespace: None,
        lease: Some(first.id.clone()),
    };
    assert!(matches!(
        arbiter.confirm_in(&forged, 42),
        Err(StateError::NoLeaseForContainer(_))
    ));
    // The namespace survives a restart, and releasing by it releases only its own.
    let mut arbiter = reopen(dir.path(), arbiter, procs);
    let in_a = ContainerRef {
        container_id: "web".into(),
        namespace: Some("a".into()),
        lease: None,
    };
    let (existed, t) = arbiter.release_container_in(&in_a).unwrap();
    durable(&arbiter, t);
    assert!(existed);
    assert!(arbiter.lease(&first.id).is_none());
    assert!(arbiter.lease(&second.id).is_some());
    // One left: the id alone is enough again.
    assert!(arbiter.release_container("web").unwrap().0);
}

#[test]
fn only_a_pending_lease_can_be_bound_and_only_once() {
    let (_dir, mut arbiter, _) = setup();
    let victim = arbiter
        .reserve_now(request("victim", "1Gi", Priority::Low))
        .unwrap()
        .lease;
    let err = arbiter.bind(&victim.id, "attacker", 7).unwrap_err();
    assert!(matches!(err, StateError::NotPending(_)), "{err}");
    assert_eq!(arbiter.list()[0].container_id, "victim");

    let pending = arbiter
        .reserve_now(request("pending:5eed", "1Gi", Priority::Low))
        .unwrap()
        .lease;
    let err = arbiter.bind(&pending.id, "victim", 7).unwrap_err();
    assert!(
        matches!(err, StateError::AlreadyHoldsLease(_)),
        "one lease per container: {err}"
    );
    let _ = arbiter.bind(&pending.id, "podman-ctr", 42).unwrap();
    let bound = arbiter
        .list()
        .into_iter()
        .find(|l| l.id == pending.id)
        .unwrap();
    assert_eq!(
        (bound.container_id.as_str(), bound.pid, bound.state),
        ("podman-ctr", Some(42), LeaseState::Confirmed)
    );
    assert!(
        matches!(
            arbiter.bind(&pending.id, "other", 1),
            Err(StateError::NotPending(_))
        ),
        "bound once"
    );
    assert!(arbiter.release_container("podman-ctr").unwrap().0);
    assert!(!arbiter.release_container("pending:5eed").unwrap().0);
}

#[test]
fn a_request_that_does_not_fit_waits_and_is_admitted_on_release() {
    let (_dir, mut arbiter, _) = setup();
    let big = arbiter
        .reserve_now(request("c1", "6Gi", Priority::Low))
        .unwrap();
    let mut waiting = arbiter.submit(request("c2", "3Gi", Priority::Low), Instant::now());
    assert!(waiting.try_recv().is_err(), "no room: it waits");
    assert_eq!(arbiter.status().queue.len(), 1);
    arbiter.release(&big.lease.id).unwrap();
    let granted = waiting.try_recv().unwrap().unwrap();
    assert_eq!(granted.lease.container_id, "c2");
    assert!(arbiter.status().queue.is_empty());
}

#[test]
fn the_queue_gives_room_to_high_priority_first() {
    let (_dir, mut arbiter, _) = setup();
    let first = arbiter
        .reserve_now(request("c0", "7Gi", Priority::Low))
        .unwrap();
    let t = Instant::now();
    let mut low = arbiter.submit(request("low", "3Gi", Priority::Low), t);
    let mut high = arbiter.submit(request("high", "3Gi", Priority::High), t);
    let mut late_low = arbiter.submit(request("late-low", "1Gi", Priority::Low), t);
    assert!(
        late_low.try_recv().is_err(),
        "a later low request does not overtake the waiting high one"
    );
    arbiter.release(&first.lease.id).unwrap();
    assert_eq!(high.try_recv().unwrap().unwrap().lease.container_id, "high");
    assert_eq!(low.try_recv().unwrap().unwrap().lease.container_id, "low");
    assert_eq!(
        late_low.try_recv().unwrap().unwrap().lease.container_id,
        "late-low"
    );
}

#[test]
fn waiting_past_the_bound_fails_naming_the_request_and_what_is_free() {
    let (_dir, mut arbiter, _) = setup();
    arbiter
        .reserve_now(request("c1", "6Gi", Priority::Low))
        .unwrap();
    let t = Instant::now();
    let mut rx = arbiter.submit(request("c2", "3Gi", Priority::Low), t);
    arbiter.expire_waiters(t + Duration::from_secs(29));
    assert!(rx.try_recv().is_err());
    arbiter.expire_waiters(t + Duration::from_secs(30));
    let err = rx.try_recv().unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unplaceable);
    let text = err.to_string();
    assert!(text.contains("waited 30.0 s"), "{text}");
    assert!(text.contains("low-priority request for 3Gi now"), "{text}");
    assert!(
        text.contains("on the node: GPU 0 (8Gi): 1 low-priority lease, 0% busy"),
        "{text}"
    );
}

#[test]
fn impossible_requests_fail_at_once() {
    let (_dir, mut arbiter, _) = setup();
    let err = arbiter
        .reserve_now(request("c1", "9Gi", Priority::Low))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    let mut r = request("c2", "1Gi", Priority::Low);
    r.gpu = GpuSelector::Index(vec![3]);
    assert_eq!(
        arbiter.reserve_now(r).unwrap_err().kind(),
        ErrorKind::InvalidRequest
    );
    let err = arbiter
        .reserve_now(request("", "1Gi", Priority::Low))
        .unwrap_err();
    assert!(matches!(err, StateError::BadContainerId(_)));
}

#[test]
fn drain_blocks_new_leases_survives_restart_and_undrain_admits() {
    let (dir, mut arbiter, procs) = setup();
    let (uuid, t) = arbiter.drain("0", true).unwrap();
    arbiter.store().wait_blocking(t).unwrap();
    assert_eq!(uuid, "GPU-0");
    assert!(arbiter
        .drain("GPU-9", true)
        .unwrap_err()
        .to_string()
        .contains("0 (GPU-0)"));
    let mut arbiter = reopen(dir.path(), arbiter, procs);
    assert!(arbiter.status().gpus[0].drained);
    let mut rx = arbiter.submit(request("c1", "1Gi", Priority::High), Instant::now());
    assert!(rx.try_recv().is_err());
    let _ = arbiter.drain("GPU-0", false).unwrap();
    assert!(rx.try_recv().unwrap().is_ok());
}

#[test]
fn reconciliation_releases_dead_containers_after_the_grace_and_keeps_live_ones() {
    let (_dir, mut arbiter, procs) = setup();
    procs
        .0
        .lock()
        .unwrap()
        .insert(10, (1, "ns".into(), "/a".into()));
    procs
        .0
        .lock()
        .unwrap()
        .insert(11, (1, "ns".into(), "/b".into()));
    arbiter
        .reserve_now(request("live", "1Gi", Priority::Low))
        .unwrap();
    arbiter
        .reserve_now(request("dies", "1Gi", Priority::Low))
        .unwrap();
    arbiter
        .reserve_now(request("never-confirmed", "1Gi", Priority::Low))
        .unwrap();
    arbiter.confirm("live", 10).unwrap();
    arbiter.confirm("dies", 11).unwrap();
    procs.kill(11);
    let t = Instant::now();
    assert!(arbiter.reconcile(t).is_empty(), "grace starts");
    assert!(arbiter.reconcile(t + Duration::from_secs(4)).is_empty());
    let released = arbiter.reconcile(t + Duration::from_secs(5));
    assert_eq!(released.len(), 1);
    let left: Vec<String> = arbiter.list().into_iter().map(|l| l.container_id).collect();
    assert_eq!(left.len(), 2);
    assert!(left.contains(&"live".to_string()) && left.contains(&"never-confirmed".to_string()));
}

#[test]
fn ledger_through_the_state_with_peer_checks() {
    let (_dir, mut arbiter, procs) = setup();
    procs
        .0
        .lock()
        .unwrap()
        .insert(10, (1, "pid:[9]".into(), "/ctr".into()));
    procs
        .0
        .lock()
        .unwrap()
        .insert(20, (1, "pid:[9]".into(), "/ctr/app".into()));
    procs
        .0
        .lock()
        .unwrap()
        .insert(30, (1, "pid:[1]".into(), "/host".into()));
    let g = arbiter
        .reserve_now(request("c", "1Gi", Priority::High))
        .unwrap();
    arbiter.confirm("c", 10).unwrap();
    let id = g.lease.id;
    let q = arbiter.lease_attach(&id, 1, 20, 0).unwrap();
    assert_eq!((q.memory_quota, q.priority), (GI, Priority::High));
    let err = arbiter.lease_attach(&id, 2, 30, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert!(arbiter.lease_charge(&id, 1, GI).unwrap().granted);
    assert!(!arbiter.lease_charge(&id, 1, 1).unwrap().granted);
    assert_eq!(arbiter.status().usage[0].memory_used, GI);
    assert_eq!(arbiter.status().usage[0].clients[0].pid, 20);
    arbiter.lease_detach(&id, 1);
    assert_eq!(arbiter.status().usage[0].memory_used, 0);
    arbiter.release(&id).unwrap();
    assert_eq!(arbiter.lease_query(&id, 1).state, LeaseState::Released);
    assert_eq!(
        arbiter.lease_attach(&id, 3, 20, 0).unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

/// NVML as the watchdog and the overhead measurement see it: no processes
/// listed (the tests record their own tables).
struct ListingBackend;
impl GpuBackend for ListingBackend {
    fn source(&self) -> &'static str {
        "nvml"
    }
    fn gpus(&self) -> Vec<Gpu> {
        Vec::new()
    }
    fn cuda_driver_version(&self) -> Option<u32> {
        None
    }
    fn sample(&self, _: &str) -> Result<Option<GpuSample>, crate::inventory::InventoryError> {
        Ok(None)
    }
    fn processes(
        &self,
        _: &str,
    ) -> Result<Option<Vec<GpuProcess>>, crate::inventory::InventoryError> {
        Ok(Some(Vec::new()))
    }
}

#[test]
fn process_overhead_is_estimated_then_measured_and_a_quota_must_hold_one() {
    const MI: u64 = 1 << 20;
    let (_dir, mut arbiter, procs) = setup();
    procs
        .0
        .lock()
        .unwrap()
        .insert(10, (1, "pid:[9]".into(), "/ctr".into()));
    procs
        .0
        .lock()
        .unwrap()
        .insert(20, (1, "pid:[9]".into(), "/ctr/app".into()));
    assert_eq!(arbiter.overhead_estimate(), 0, "not accounted without NVML");
    arbiter.set_memory_probe(Arc::new(ListingBackend));
    assert_eq!(arbiter.overhead_estimate(), 300 * MI);
    let err = arbiter
        .reserve_now(request("tiny", "300Mi", Priority::Low))
        .unwrap_err();
    assert!(
        matches!(
            err,
            StateError::Placement(PlacementError::BelowProcessOverhead { .. })
        ),
        "{err}"
    );
    let g = arbiter
        .reserve_now(request("c", "1Gi", Priority::Low))
        .unwrap();
    arbiter.confirm("c", 10).unwrap();
    let id = g.lease.id;
    let q = arbiter.lease_attach(&id, 1, 20, 0).unwrap();
    assert_eq!(
        (q.memory_used, q.memory_overhead),
        (300 * MI, 300 * MI),
        "the estimate until measured"
    );
    assert!(arbiter.has_unmeasured_clients());
    let table = ProcessTable::from([(
        "GPU-0".to_string(),
        vec![GpuProcess {
            pid: 20,
            memory_used: Some(100 * MI),
        }],
    )]);
    arbiter.record_process_memory(&table, Instant::now());
    assert!(!arbiter.has_unmeasured_clients());
    assert!(arbiter.measured_within(&id, Instant::now(), Duration::from_secs(1)));
    assert_eq!(arbiter.lease_query(&id, 1).memory_used, 100 * MI);
    let c = arbiter.lease_charge(&id, 1, GI - 100 * MI).unwrap();
    assert!(c.granted);
    let c = arbiter.lease_charge(&id, 1, 1).unwrap();
    assert_eq!((c.granted, c.overhead), (false, 100 * MI));
    let usage = &arbiter.status().usage[0];
    assert_eq!(
        (usage.memory_used, usage.clients[0].memory_overhead),
        (GI, 100 * MI)
    );
    assert!(usage.clients[0].overhead_measured);
    // A partial listing (the lease's GPU missing) changes nothing.
    arbiter.record_process_memory(&ProcessTable::new(), Instant::now());
    assert_eq!(arbiter.lease_query(&id, 1).memory_used, GI);
}

#[test]
fn a_reserve_the_store_cannot_write_leaves_nothing_and_the_store_recovers_in_process() {
    let (dir, mut arbiter, procs) = setup();
    let leases = dir.path().join("run/leases");
    let kept = arbiter
        .reserve_now(request("kept", "4Gi", Priority::Low))
        .unwrap();
    durable(&arbiter, kept.ticket);
    arbiter.store().fail_writes(true);
    // Appended, then the write fails: the caller takes it back.
    let lost = arbiter
        .reserve_now(request("lost", "4Gi", Priority::Low))
        .unwrap();
    let err = arbiter
        .store()
        .wait_blocking(lost.ticket.unwrap())
        .unwrap_err();
    assert!(!err.to_string().contains("restart"), "{err}");
    arbiter.withdraw_reserve(&lost.lease.id);
    assert!(arbiter.lease(&lost.lease.id).is_none());
    assert!(
        !leases.join(&lost.lease.id.0).exists(),
        "its directory went"
    );
    // While the store still fails, a reserve is refused before anything is made.
    let err = arbiter
        .reserve_now(request("refused", "1Gi", Priority::Low))
        .unwrap_err();
    assert!(matches!(err, StateError::Store(_)), "{err}");
    assert_eq!(fs::read_dir(&leases).unwrap().count(), 1, "only kept's");
    assert!(arbiter.release(&kept.lease.id).is_err(), "releases too");
    // Space returns: the next change recovers the store, and the room the
    // lost reserve took is free again (4Gi + 4Gi of 8Gi).
    arbiter.store().fail_writes(false);
    let again = arbiter
        .reserve_now(request("again", "4Gi", Priority::Low))
        .unwrap();
    durable(&arbiter, again.ticket);
    let reopened = reopen(dir.path(), arbiter, procs);
    let mut names: Vec<String> = reopened
        .list()
        .into_iter()
        .map(|l| l.container_id)
        .collect();
    names.sort();
    assert_eq!(names, ["again", "kept"]);
}

#[test]
fn recovery_takes_back_reserves_whose_record_was_lost_even_if_nobody_did() {
    let (dir, mut arbiter, procs) = setup();
    arbiter.store().fail_writes(true);
    let lost = arbiter
        .reserve_now(request("lost", "1Gi", Priority::Low))
        .unwrap();
    assert!(arbiter.store().wait_blocking(lost.ticket.unwrap()).is_err());
    assert!(arbiter.recover_store().is_err(), "still full");
    assert!(
        arbiter.lease(&lost.lease.id).is_none(),
        "taken back at once"
    );
    arbiter.store().fail_writes(false);
    arbiter.recover_store().unwrap();
    assert!(arbiter.store().failure().is_none());
    let reopened = reopen(dir.path(), arbiter, procs);
    assert!(reopened.list().is_empty());
}

#[test]
fn a_waiter_whose_requester_went_away_takes_no_lease() {
    let (_dir, mut arbiter, _) = setup();
    let big = arbiter
        .reserve_now(request("big", "6Gi", Priority::Low))
        .unwrap();
    let gone = arbiter.submit(request("gone", "4Gi", Priority::High), Instant::now());
    let mut low = arbiter.submit(request("low", "1Gi", Priority::Low), Instant::now());
    assert!(low.try_recv().is_err(), "held back behind the high waiter");
    drop(gone);
    assert_eq!(arbiter.withdraw_abandoned(), 1);
    assert!(low.try_recv().unwrap().is_ok(), "no longer held back");
    // Gone between the check and the grant: the lease made for it is released.
    let mut raced = arbiter.submit(request("raced", "4Gi", Priority::Low), Instant::now());
    raced.close();
    arbiter.release(&big.lease.id).unwrap();
    let names: Vec<String> = arbiter.list().into_iter().map(|l| l.container_id).collect();
    assert_eq!(names, ["low"]);
}

#[test]
fn lease_dirs_refuse_ids_that_are_not_plain_names() {
    let dir = tempfile::tempdir().unwrap();
    let dirs = LeaseDirs {
        run_dir: dir.path().join("run"),
    };
    let err = dirs.create(&LeaseId("../../x".into())).unwrap_err();
    assert!(err.to_string().contains("\"../../x\""), "{err}");
    assert!(!dir.path().join("x").exists());
    assert!(dirs.create(&LeaseId("0123abcd".into())).is_ok());
}

#[test]
fn stale_lease_directories_are_removed_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path());
    fs::create_dir_all(config.run_dir.join("leases/deadbeef")).unwrap();
    let arbiter = open_with(config, 1, Arc::new(FakeProcs::default()));
    assert!(!dir.path().join("run/leases/deadbeef").exists());
    drop(arbiter);
}

/// A fraction as a client can send it: serde takes any number, so the control
/// socket can carry values no `Fraction::new` would make.
fn raw_fraction(value: f64) -> Fraction {
    serde_json::from_value(serde_json::json!(value)).unwrap()
}

#[test]
fn a_reserve_with_compute_shares_outside_zero_to_one_is_refused_naming_the_field() {
    let cases: &[(f64, f64, &str)] = &[
        (-5.0, 1.0, "compute_request"),
        (1.5, 1.0, "compute_request"),
        (0.0, -0.1, "compute_limit"),
        (0.0, 7.0, "compute_limit"),
        (0.6, 0.3, "compute_limit"),
    ];
    for &(asked, limit, field) in cases {
        let (_dir, mut arbiter, _) = setup();
        let mut r = request("c", "1Gi", Priority::Low);
        r.compute_request = raw_fraction(asked);
        r.compute_limit = raw_fraction(limit);
        let err = match arbiter.reserve_now(r) {
            Ok(g) => panic!(
                "request {asked} limit {limit}: granted lease {}",
                g.lease.id
            ),
            Err(e) => e,
        };
        assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
        let message = err.to_string();
        assert!(message.contains(field), "{asked}/{limit}: {message}");
        assert!(arbiter.status().leases.is_empty());
    }
    // The edges are accepted.
    let (_dir, mut arbiter, _) = setup();
    let mut r = request("c", "1Gi", Priority::Low);
    r.compute_request = raw_fraction(1.0);
    r.compute_limit = raw_fraction(1.0);
    arbiter.reserve_now(r).unwrap();
}

#[test]
fn attach_refuses_a_held_memory_claim_beyond_the_leases_quota() {
    let (_dir, mut arbiter, procs) = setup();
    for pid in [10, 20, 21] {
        procs
            .0
            .lock()
            .unwrap()
            .insert(pid, (1, "pid:[9]".into(), "/ctr".into()));
    }
    let g = arbiter
        .reserve_now(request("c", "1Gi", Priority::Low))
        .unwrap();
    arbiter.confirm("c", 10).unwrap();
    let id = g.lease.id;
    let err = arbiter.lease_attach(&id, 1, 20, u64::MAX).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    assert!(err.to_string().contains("memory_held"), "{err}");
    assert_eq!(arbiter.status().usage[0].memory_used, 0, "nothing counted");
    // What a process re-attaching after a restart honestly holds is kept...
    arbiter.lease_attach(&id, 1, 20, GI / 2).unwrap();
    // ...and two processes cannot claim more than the quota between them.
    let err = arbiter.lease_attach(&id, 2, 21, GI / 2 + 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    arbiter.lease_attach(&id, 2, 21, GI / 2).unwrap();
    assert_eq!(arbiter.status().usage[0].memory_used, GI);
}

/// Pid 0 names no process: to kill(2) it is the caller's own process group, so a
/// lease confirmed with it would look alive for ever.
#[test]
fn a_confirm_with_pid_zero_is_refused_naming_the_pid() {
    let (_dir, mut arbiter, _) = setup();
    arbiter
        .reserve_now(request("c", "1Gi", Priority::Low))
        .unwrap();
    let err = arbiter.confirm("c", 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    assert!(err.to_string().contains("pid = 0"), "{err}");
    assert_eq!(arbiter.status().leases[0].state, LeaseState::Reserved);
}

#[test]
fn a_leases_refusals_and_readings_show_while_it_lives_and_go_with_it() {
    let (_dir, mut arbiter, _) = setup();
    let gone = arbiter
        .reserve_now(request("c1", "1Gi", Priority::Low))
        .unwrap()
        .lease;
    let kept = arbiter
        .reserve_now(request("c2", "1Gi", Priority::Low))
        .unwrap()
        .lease;
    arbiter.count_memory_refusal(&gone.id);
    arbiter.count_memory_refusal(&gone.id);
    arbiter.count_memory_refusal(&kept.id);
    let refusals = |arbiter: &Arbiter| -> Vec<(LeaseId, u64)> {
        let status = arbiter.status();
        status
            .usage
            .iter()
            .map(|u| (u.lease.clone(), u.memory_refusals))
            .collect()
    };
    let mut shown = refusals(&arbiter);
    shown.sort();
    let mut want = vec![(gone.id.clone(), 2), (kept.id.clone(), 1)];
    want.sort();
    assert_eq!(shown, want);
    let holding = |lease: &Lease| crate::tokens::Holding {
        gpu: lease.gpus[0].clone(),
        lease: lease.id.clone(),
        pid: Some(1),
        priority: Priority::Low,
        held_ns: 1,
        overran_ns: 0,
    };
    arbiter.record_holdings(Instant::now(), vec![holding(&gone), holding(&kept)]);

    arbiter.release(&gone.id).unwrap();
    // A refusal reported after the release is not kept for a lease no one shows.
    arbiter.count_memory_refusal(&gone.id);
    assert_eq!(arbiter.findings.memory_refusals(&gone.id), 0);
    assert!(arbiter.telemetry.held_span(&gone.id).is_none());
    assert_eq!(refusals(&arbiter), [(kept.id.clone(), 1)]);
    assert!(arbiter.telemetry.held_span(&kept.id).is_some());
}
