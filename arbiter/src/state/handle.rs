//! The only way into the arbiter's state from the daemon's tasks: a cloneable
//! handle whose methods lock, act, drop the guard and only then wait (for a
//! change to be durable, for NVML, for a queued reserve), so no caller holds
//! the lock across an await and none can forget to wait before answering.
//!
//! The lock is a plain mutex: every critical section is short and synchronous
//! (the store's fsync happens on its writer thread, NVML on the blocking pool).

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

use gpushare_proto::{Lease, LeaseId, Quota, ReserveRequest, StatusReport};

use super::*;
use crate::ledger::Charge;

/// A change counts as acknowledged only once this resolves.
async fn durable(store: Arc<LeaseStore>, ticket: Option<Ticket>) -> Result<(), StateError> {
    match ticket {
        Some(t) => store.wait(t).await.map_err(StateError::from),
        None => Ok(()),
    }
}

/// A charge re-measures its lease unless it was measured this recently: NVML's
/// process listing is one driver call per GPU, and a program allocating in a loop (or
/// probing for the largest allocation that fits) charges in a tight loop.
pub const MEASURE_FRESH: Duration = Duration::from_millis(100);

#[derive(Clone)]
pub struct ArbiterHandle {
    state: Arc<Mutex<Arbiter>>,
    /// Memory reclaim's driver side, set at start when `memory.reclaim` is on.
    reclaimer: Arc<std::sync::OnceLock<Arc<dyn MemoryReclaim>>>,
}

/// Memory reclaim's driver side as the charge path needs it (the daemon's reclaimer,
/// which calls the driver; set once at start when `memory.reclaim` is on).
pub trait MemoryReclaim: Send + Sync {
    /// Suspends `plan`'s victims and answers its charge.
    fn reclaim<'a>(
        &'a self,
        arbiter: &'a ArbiterHandle,
        plan: ReclaimPlan,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Charge, StateError>> + Send + 'a>>;
    /// Memory may have come free: suspended leases may fit back.
    fn memory_freed(&self);
}

impl ArbiterHandle {
    pub fn new(mut arbiter: Arbiter) -> ArbiterHandle {
        arbiter.set_batch_search_off_the_lock(tokio::runtime::Handle::try_current().is_ok());
        let tokens = arbiter.tokens();
        let handle = ArbiterHandle {
            state: Arc::new(Mutex::new(arbiter)),
            reclaimer: Arc::default(),
        };
        if let Some(tokens) = tokens {
            // Weak: the token service lives inside the state it would keep alive.
            let state = Arc::downgrade(&handle.state);
            tokens.set_namer(Box::new(move |lease| {
                let state = state.upgrade()?;
                let arbiter = state.lock().unwrap_or_else(|p| p.into_inner());
                arbiter.lease(lease).map(|l| arbiter.container_name(l))
            }));
            let state = Arc::downgrade(&handle.state);
            tokens.set_reporter(Box::new(move |violation| {
                if let Some(state) = state.upgrade() {
                    let mut arbiter = state.lock().unwrap_or_else(|p| p.into_inner());
                    arbiter.record_token_violation(violation);
                }
            }));
        }
        handle
    }

    /// Who held each GPU's token when (empty without time-slice tokens).
    pub fn timeline(&self, since_ms: Option<u64>) -> gpushare_proto::TimelineReport {
        let (tokens, reclaims) = {
            let arbiter = self.lock();
            let reclaims = arbiter
                .reclaim_status()
                .map(|r| r.recent)
                .unwrap_or_default();
            (arbiter.tokens(), reclaims)
        };
        let mut report = tokens
            .map(|t| t.timeline(since_ms.map(|ms| ms.saturating_mul(1_000_000))))
            .unwrap_or_default();
        report.reclaims = reclaims;
        report
    }

    fn lock(&self) -> Locked<'_> {
        // A panic mid-change never left memory ahead of the log's order (changes are
        // appended before they are applied), so the table is still usable.
        Locked {
            guard: self.state.lock().unwrap_or_else(|p| p.into_inner()),
            handle: self,
        }
    }

    /// Runs a batch search without the lock, then brings its outcome back.
    async fn search_off_the_lock(self, job: BatchSearchJob) {
        let outcome = tokio::task::spawn_blocking(move || job.run()).await;
        let mut arbiter = self.lock();
        match outcome {
            Ok(outcome) => arbiter.finish_batch_search(Some(outcome)),
            Err(e) => {
                tracing::error!(error = %e, "the batch search failed off the lock; it runs under the lock from now on");
                arbiter.finish_batch_search(None);
            }
        }
    }

    /// The benchmark's "before": the batch search under the lock, as it ran when
    /// it blocked every memory charge on the node for its budget.
    pub fn set_batch_search_off_the_lock(&self, off: bool) {
        self.lock().set_batch_search_off_the_lock(off);
    }

    /// Runs a change and waits, without the lock, until its record is durable.
    async fn change<T>(
        &self,
        act: impl FnOnce(&mut Arbiter) -> Result<(T, Option<Ticket>), StateError>,
    ) -> Result<T, StateError> {
        let (value, ticket, store) = {
            let mut arbiter = self.lock();
            let (value, ticket) = act(&mut arbiter)?;
            (value, ticket, arbiter.store.clone())
        };
        // A release, a drain, a grant given back: suspended leases may fit again.
        self.memory_freed();
        durable(store, ticket).await?;
        Ok(value)
    }

    // ----- the control socket -----

    pub fn admission_wait_ms(&self) -> u64 {
        self.lock().config.admission_wait_ms
    }

    /// Queues a reserve and answers once it is granted and durable. `requester_gone`
    /// resolves true when the requester hung up while it waited (then nothing is
    /// granted to it: Ok(None)), false when it spoke out of turn (keep waiting).
    pub async fn reserve(
        &self,
        request: ReserveRequest,
        requester_gone: impl Future<Output = bool>,
    ) -> Result<Option<Lease>, StateError> {
        let container = request.container_id.clone();
        let mut reply = {
            let mut arbiter = self.lock();
            if let Some(message) = arbiter.unshareable_refusal(&request.gpu) {
                tracing::warn!(container, "refused: {message}");
                return Err(StateError::Unshareable(message));
            }
            arbiter.submit(request, Instant::now())
        };
        let answer = tokio::select! {
            answer = &mut reply => answer,
            gone = requester_gone => {
                if gone {
                    // No more answers can arrive; one sent just before is taken back.
                    reply.close();
                    let mut arbiter = self.lock();
                    if let Ok(Ok(granted)) = reply.try_recv() {
                        arbiter.take_back_grant(&granted);
                    }
                    arbiter.withdraw_abandoned();
                    tracing::info!(container, "reserve withdrawn: the client disconnected while it waited");
                    return Ok(None);
                }
                // It spoke out of turn: just wait (its bytes are read afterwards).
                reply.await
            }
        };
        let granted = answer.map_err(|_| StateError::ReserveDropped)??;
        let store = self.lock().store.clone();
        match durable(store, granted.ticket).await {
            Ok(()) => Ok(Some(granted.lease)),
            Err(e) => {
                // Never acknowledged: its lease, directory and room go now, not when
                // the store recovers.
                self.lock().withdraw_reserve(&granted.lease.id);
                Err(e)
            }
        }
    }

    pub async fn confirm(&self, container: &ContainerRef, pid: u32) -> Result<(), StateError> {
        self.change(|a| Ok(((), a.confirm_in(container, pid)?)))
            .await?;
        self.learn_engine_name(&container.container_id, pid).await;
        Ok(())
    }

    /// Docker's or podman's name for the container (see `engine_names`), read off
    /// the runtime's threads and without the lock; nothing for other engines.
    async fn learn_engine_name(&self, container_id: &str, pid: u32) {
        let id = container_id.to_owned();
        let found =
            tokio::task::spawn_blocking(move || crate::engine_names::engine_name(pid, &id)).await;
        if let Ok(Some(name)) = found {
            self.lock().remember_engine_name(pid, name);
        }
    }

    /// Engine names live in memory only (they are for reading, not state): after a
    /// restart the arbiter looks them up again for every confirmed lease, as it did
    /// at confirmation, so status and metrics keep the names people know.
    pub async fn relearn_engine_names(&self) {
        let confirmed: Vec<(String, u32)> = self
            .list()
            .into_iter()
            .filter_map(|l| Some((l.container_id, l.pid?)))
            .collect();
        for (container_id, pid) in confirmed {
            self.learn_engine_name(&container_id, pid).await;
        }
    }

    pub async fn bind(
        &self,
        lease: &LeaseId,
        container_id: &str,
        pid: u32,
    ) -> Result<(), StateError> {
        self.change(|a| Ok(((), a.bind(lease, container_id, pid)?)))
            .await?;
        self.learn_engine_name(container_id, pid).await;
        Ok(())
    }

    /// Whether the lease existed.
    pub async fn release(&self, lease: &LeaseId) -> Result<bool, StateError> {
        self.change(|a| a.release(lease)).await
    }

    /// Whether the container held a lease.
    pub async fn release_container(&self, container: &ContainerRef) -> Result<bool, StateError> {
        self.change(|a| a.release_container_in(container)).await
    }

    /// Drains (or undrains) `gpu`, a UUID or an index; returns its UUID.
    pub async fn drain(&self, gpu: &str, drain: bool) -> Result<String, StateError> {
        self.change(|a| {
            let (uuid, ticket) = a.drain(gpu, drain)?;
            Ok((uuid, Some(ticket)))
        })
        .await
    }

    /// The device plugin's `Allocate`: the grant, placed or waiting, once durable.
    pub async fn grant(
        &self,
        request: gpushare_proto::grant::GrantRequest,
    ) -> Result<gpushare_proto::grant::Grant, StateError> {
        self.change(|a| a.make_grant(request)).await
    }

    pub fn grants(&self) -> Vec<gpushare_proto::grant::Grant> {
        self.lock().grants()
    }

    /// Whether the grant existed.
    pub async fn release_grant(
        &self,
        id: &gpushare_proto::grant::GrantId,
    ) -> Result<bool, StateError> {
        self.change(|a| a.release_grant(id)).await
    }

    pub fn status(&self) -> StatusReport {
        self.lock().status()
    }

    pub fn list(&self) -> Vec<Lease> {
        self.lock().list()
    }

    pub fn lease_count(&self) -> usize {
        self.lock().lease_count()
    }

    /// The Prometheus exposition, rendered after the lock is dropped.
    pub fn metrics(&self) -> String {
        let (report, totals) = {
            let arbiter = self.lock();
            (arbiter.status(), arbiter.violation_totals().clone())
        };
        crate::metrics::render(&report, &totals)
    }

    // ----- the lease sockets -----

    /// The lease as recorded (None once released).
    pub fn lease(&self, id: &LeaseId) -> Option<Lease> {
        self.lock().lease(id).cloned()
    }

    pub fn lease_peer(&self, lease: &LeaseId, peer_pid: u32) -> Result<(), StateError> {
        self.lock().lease_peer(lease, peer_pid)
    }

    /// Registers a client; the quota it is answered carries its measured overhead
    /// whenever NVML already lists the process, so the charges right after it are
    /// not judged against the estimate.
    pub async fn attach(
        &self,
        lease: &LeaseId,
        connection: ConnectionId,
        peer_pid: u32,
        held: u64,
    ) -> Result<Quota, StateError> {
        let quota = self
            .lock()
            .lease_attach(lease, connection, peer_pid, held)?;
        if self.measure_memory(Some(lease)).await {
            return Ok(self.query(lease, connection));
        }
        Ok(quota)
    }

    pub fn query(&self, lease: &LeaseId, connection: ConnectionId) -> Quota {
        self.lock().lease_query(lease, connection)
    }

    /// Every answer rests on a measurement of the lease's processes at most
    /// `MEASURE_FRESH` old. A refusal is final for the process: an estimate, or an
    /// overhead that shrank since (a trimmed graph pool), must not refuse memory that
    /// fits. A grant must not rest on an overhead that grew since: a lazily loaded
    /// module (cuBLAS, cuDNN: hundreds of MiB at their first use) the watchdog's next
    /// pass would see only seconds later would let the lease's processes hold more than
    /// its quota, and on a GPU packed to its allocatable memory a neighbour's driver
    /// would then fail below its own quota.
    pub async fn charge(
        &self,
        lease: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<Charge, StateError> {
        let stale = !self
            .lock()
            .measured_within(lease, Instant::now(), MEASURE_FRESH);
        if stale {
            self.measure_memory(Some(lease)).await;
        }
        let decision = self.lock().lease_charge_on_gpu(lease, connection, bytes)?;
        let charge = match decision {
            ChargeDecision::Done(charge) => charge,
            ChargeDecision::Reclaim(plan) => match self.reclaimer.get() {
                Some(reclaimer) => reclaimer.reclaim(self, plan).await?,
                None => {
                    // Reclaim is on in the configuration but its driver side was not
                    // started (a test without it): nothing can be freed.
                    let mut arbiter = self.lock();
                    arbiter.finish_reclaim(&plan, &[], ReclaimTimes::default())?
                }
            },
        };
        if !charge.granted {
            self.lock().count_memory_refusal(lease);
        }
        Ok(charge)
    }

    pub fn credit(
        &self,
        lease: &LeaseId,
        connection: ConnectionId,
        bytes: u64,
    ) -> Result<u64, StateError> {
        let used = self.lock().lease_credit(lease, connection, bytes)?;
        self.memory_freed();
        Ok(used)
    }

    // ----- memory reclaim -----

    /// Starts memory reclaim's driver side (once).
    pub fn set_reclaimer(&self, reclaimer: Arc<dyn MemoryReclaim>) {
        let _ = self.reclaimer.set(reclaimer);
    }

    /// Memory may have come free: suspended leases may fit back.
    pub fn memory_freed(&self) {
        if let Some(r) = self.reclaimer.get() {
            r.memory_freed();
        }
    }

    pub fn suspensions(&self) -> BTreeMap<LeaseId, Suspension> {
        self.lock().suspensions()
    }

    pub fn finish_reclaim(
        &self,
        plan: &ReclaimPlan,
        outcomes: &[(LeaseId, SuspendOutcome)],
        times: ReclaimTimes,
    ) -> Result<Charge, StateError> {
        self.lock().finish_reclaim(plan, outcomes, times)
    }

    pub fn take_restorable(&self) -> Vec<Victim> {
        self.lock().take_restorable()
    }

    pub fn take_orphans(&self) -> Vec<Vec<u32>> {
        self.lock().take_orphans()
    }

    pub fn return_orphan(&self, pids: Vec<u32>) {
        self.lock().return_orphan(pids)
    }

    pub fn finish_restore(&self, lease: &LeaseId, restored: bool) {
        self.lock().finish_restore(lease, restored)
    }

    pub fn recover_suspension(&self, lease: &LeaseId, suspension: Option<Suspension>) {
        self.lock().recover_suspension(lease, suspension)
    }

    pub fn mark_never_again(&self, lease: &LeaseId, why: String) {
        self.lock().mark_never_again(lease, why)
    }

    pub fn share(
        &self,
        lease: &LeaseId,
        connection: ConnectionId,
        change: crate::lease_connection::ShareChange,
    ) -> Result<Quota, StateError> {
        self.lock().lease_share(lease, connection, change)
    }

    pub fn detach(&self, lease: &LeaseId, connection: ConnectionId) {
        self.lock().lease_detach(lease, connection);
        self.memory_freed();
    }

    // ----- per-process memory -----

    /// Turns overhead accounting on (`backend` lists per-process memory); returns
    /// the estimate charged until a process is measured.
    pub fn enable_memory_measurement(&self, backend: Arc<dyn GpuBackend>) -> u64 {
        let mut arbiter = self.lock();
        arbiter.set_memory_probe(backend);
        arbiter.overhead_estimate()
    }

    pub fn has_unmeasured_clients(&self) -> bool {
        self.lock().has_unmeasured_clients()
    }

    /// Lists per-process memory on the GPUs of `lease` (every GPU: None) and records
    /// it in the ledger. False when overhead is not measured or NVML failed.
    pub async fn measure_memory(&self, lease: Option<&LeaseId>) -> bool {
        let Some((probe, gpus)) = self.lock().measurement(lease) else {
            return false;
        };
        let table = tokio::task::spawn_blocking(move || list_processes(probe.as_ref(), gpus))
            .await
            .ok()
            .flatten();
        match table {
            Some(table) => {
                self.record_process_memory(&table, Instant::now());
                true
            }
            None => false,
        }
    }

    pub fn record_process_memory(&self, processes: &ProcessTable, now: Instant) {
        self.lock().record_process_memory(processes, now)
    }

    // ----- periodic work -----

    pub fn config(&self) -> ArbiterConfig {
        self.lock().config.clone()
    }

    /// A configuration reload (SIGHUP, `daemon::reload_on_hangup`): `config` replaces
    /// the whole table, the reload having kept the running value of every key only a
    /// restart applies; `placement`, when it changed, replaces the placement policy.
    /// Leases stay as they are: the new values take part in the next decisions.
    pub fn reconfigure(
        &self,
        config: ArbiterConfig,
        placement: Option<gpushare_config::PlacementConfig>,
    ) {
        let mut arbiter = self.lock();
        arbiter.config = config;
        if let Some(placement) = placement {
            arbiter.set_placement(placement);
        }
    }

    pub fn tokens(&self) -> Option<Arc<crate::tokens::TokenService>> {
        self.lock().tokens()
    }

    pub fn expire_waiters(&self, now: Instant) {
        self.lock().expire_waiters(now)
    }

    pub fn record_samples(&self, now: Instant, samples: &[(String, GpuSample)]) {
        self.lock().record_samples(now, samples)
    }

    pub fn reconcile(&self, now: Instant) -> Vec<(LeaseId, String)> {
        self.lock().reconcile(now)
    }

    pub fn watchdog_input(&self) -> WatchdogInput {
        self.lock().watchdog_input()
    }

    pub fn record_violations(&self, violations: Vec<Violation>) {
        self.lock().record_violations(violations)
    }

    /// Tries a lease store that cannot be written again (a no-op while it can).
    pub fn retry_failed_store(&self) -> Result<(), StateError> {
        self.lock().recover_store()
    }

    /// A clean stop's last change: waits for every record appended, then folds the
    /// log into the snapshot (after a write failure: writes the table as it is in
    /// memory), so the next start reads one file. Call once nothing changes any more.
    pub async fn flush(&self) -> Result<(), StateError> {
        let (store, last) = {
            let arbiter = self.lock();
            (arbiter.store.clone(), arbiter.last_ticket)
        };
        // A failed ticket is dealt with below: recovery writes the table.
        let _ = durable(store.clone(), last).await;
        if store.failure().is_some() {
            return self.lock().recover_store();
        }
        Ok(store.compact()?)
    }
}

/// The state, locked. Dropping it starts the batch search an admission pass left
/// waiting (`batch_admission.rs`), off the lock on the runtime when there is one,
/// so every path into the state that can queue or free room is covered by one rule.
struct Locked<'a> {
    guard: MutexGuard<'a, Arbiter>,
    handle: &'a ArbiterHandle,
}

impl Deref for Locked<'_> {
    type Target = Arbiter;
    fn deref(&self) -> &Arbiter {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Arbiter {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        while let Some(job) = self.guard.batch_search_to_start() {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(self.handle.clone().search_off_the_lock(job));
                    return;
                }
                // No runtime to search on: here, and the admission pass that waited.
                Err(_) => {
                    let outcome = job.run();
                    self.guard.finish_batch_search(Some(outcome));
                }
            }
        }
    }
}
