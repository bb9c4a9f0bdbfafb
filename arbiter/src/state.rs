//! The arbiter's state: leases, the admission queue, the memory ledger, drained
//! GPUs, utilisation and the watchdog's findings, behind one lock.
//!
//! Every lease change is appended to the store while the lock is held (so the
//! log's order is the order of the changes) and acknowledged only once the
//! returned ticket is durable; callers wait for it after dropping the lock, so
//! concurrent changes share one fsync. Lease sockets are opened and closed
//! through `LeaseEndpoints`, so unit tests run without sockets.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpushare_config::ArbiterConfig;
use gpushare_proto::lease::BadLeaseId;
use gpushare_proto::message::PENDING_PREFIX;
use gpushare_proto::{
    ByteSize, ClientStatus, ContainerRef, ErrorKind, GpuStatus, Lease, LeaseId, LeaseState,
    LeaseUsage, MemoryRequest, Priority, QueuedRequest, Quota, ReserveRequest, StatusReport,
    Violation, ViolationKind,
};
use tokio::sync::oneshot;

use crate::inventory::{Gpu, GpuBackend, GpuProcess, GpuSample, UtilizationWindow};
use crate::ledger::{Charge, ConnectionId, Ledger, LedgerError};
use crate::placement::{self, GpuView, PlacementError, Policy};
use crate::process::{check_peer, PeerCheck, ProcessProbe};
use crate::queue::{AdmissionQueue, Attempt};
use crate::reconcile::{self, Bounds, Verdict};
use crate::store::{LeaseRecord, LeaseStore, Record, StoreError, Table, Ticket};
use crate::watchdog::LeaseView;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("waited {waited_s}s in the admission queue: {reason}; the node has: {free}")]
    QueueTimeout {
        waited_s: u64,
        reason: String,
        free: String,
    },
    #[error("container id {0:?}: must be 1 to 1024 printable characters")]
    BadContainerId(String),
    #[error("container {0:?} holds no lease")]
    NoLeaseForContainer(String),
    #[error("container id {container:?} holds a lease in several namespaces ({namespaces}); name the namespace or the lease")]
    AmbiguousContainer {
        container: String,
        namespaces: String,
    },
    #[error("lease {0} is not waiting to be bound to a container")]
    NotPending(LeaseId),
    #[error("container {0:?} already holds a lease")]
    AlreadyHoldsLease(String),
    #[error("no shared GPU {asked:?}; this node shares: {available}")]
    UnknownGpu { asked: String, available: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("lease directory {path}: {source}")]
    LeaseDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lease {0} has been released")]
    LeaseReleased(LeaseId),
    #[error("refused: {0}")]
    PeerRefused(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    BadLeaseId(#[from] BadLeaseId),
    #[error("the requester disconnected while its reserve waited")]
    RequesterGone,
}

impl StateError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            StateError::QueueTimeout { .. } => ErrorKind::Unplaceable,
            StateError::Placement(PlacementError::NoFit { .. }) => ErrorKind::Unplaceable,
            StateError::Placement(_)
            | StateError::BadContainerId(_)
            | StateError::NotPending(_)
            | StateError::AlreadyHoldsLease(_)
            | StateError::AmbiguousContainer { .. } => ErrorKind::InvalidRequest,
            StateError::NoLeaseForContainer(_)
            | StateError::UnknownGpu { .. }
            | StateError::LeaseReleased(_) => ErrorKind::NotFound,
            StateError::Store(_) | StateError::LeaseDir { .. } => ErrorKind::Internal,
            StateError::PeerRefused(_) => ErrorKind::PermissionDenied,
            StateError::Ledger(LedgerError::CreditTooLarge { .. }) => ErrorKind::InvalidRequest,
            StateError::Ledger(LedgerError::UnknownLease(_)) => ErrorKind::NotFound,
            StateError::Ledger(_) => ErrorKind::Protocol,
            StateError::BadLeaseId(_) => ErrorKind::InvalidRequest,
            StateError::RequesterGone => ErrorKind::Internal,
        }
    }
}

/// Where a lease's socket lives: created when the lease is granted (or reloaded),
/// removed when it is released.
pub trait LeaseEndpoints: Send {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError>;
    fn close(&mut self, lease: &LeaseId);
}

/// Only the directory (unit tests, and what a socket is created in).
pub struct LeaseDirs {
    pub run_dir: PathBuf,
}

impl LeaseDirs {
    /// Refuses an id that is not a plain name: `../../x` would name a directory
    /// outside `run_dir` (ids are checked where they are read, and again here,
    /// where one becomes a path).
    pub fn path(&self, lease: &LeaseId) -> Result<PathBuf, StateError> {
        if !LeaseId::is_well_formed(&lease.0) {
            return Err(BadLeaseId {
                value: lease.0.clone(),
            }
            .into());
        }
        Ok(self.run_dir.join("leases").join(&lease.0))
    }

    pub fn create(&self, lease: &LeaseId) -> Result<PathBuf, StateError> {
        let path = self.path(lease)?;
        let err = |source| StateError::LeaseDir {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&path).map_err(err)?;
        // Searchable but not listable: a lease id is what entitles a pending lease
        // to be bound (podman's precreate), so host users must not be able to read
        // the ids off the directory. Containers see only their own lease directory.
        let leases = self.run_dir.join("leases");
        fs::set_permissions(&leases, fs::Permissions::from_mode(0o711)).map_err(|source| {
            StateError::LeaseDir {
                path: leases.clone(),
                source,
            }
        })?;
        // Containers may run as any user and must reach the lease socket inside.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(err)?;
        Ok(path)
    }

    pub fn remove(&self, lease: &LeaseId) {
        let path = match self.path(lease) {
            Ok(path) => path,
            Err(e) => {
                tracing::error!(error = %e, "not removing a lease directory");
                return;
            }
        };
        if let Err(e) = fs::remove_dir_all(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "could not remove lease directory");
            }
        }
    }
}

impl LeaseEndpoints for LeaseDirs {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError> {
        self.create(lease).map(|_| ())
    }
    fn close(&mut self, lease: &LeaseId) {
        self.remove(lease)
    }
}

/// A granted lease and the ticket to wait for before telling anyone.
#[derive(Debug)]
pub struct Granted {
    pub lease: Lease,
    pub ticket: Option<Ticket>,
    /// Created for this request; false when a retry got its container's existing
    /// lease (which someone else may have been told about: never take that back).
    pub fresh: bool,
}

pub type ReserveReply = oneshot::Receiver<Result<Granted, StateError>>;

pub struct Waiter {
    request: ReserveRequest,
    reply: oneshot::Sender<Result<Granted, StateError>>,
}

/// What the watchdog needs from the state, copied out so NVML is called without the lock.
pub struct WatchdogInput {
    pub gpus: Vec<String>,
    /// (lease, its GPUs, its ledger quota (all GPUs together), its registered pids).
    pub leases: Vec<(LeaseId, Vec<String>, u64, Vec<u32>)>,
}

impl WatchdogInput {
    pub fn views(&self) -> Vec<LeaseView<'_>> {
        self.leases
            .iter()
            .map(|(id, gpus, quota, pids)| LeaseView {
                id,
                gpus,
                memory_quota: *quota,
                client_pids: pids.clone(),
            })
            .collect()
    }
}

pub struct Inventory {
    pub gpus: Vec<Gpu>,
    pub source: &'static str,
    pub cuda_driver_version: Option<u32>,
}

pub struct Arbiter {
    config: ArbiterConfig,
    inventory: Inventory,
    utilization: Vec<UtilizationWindow>,
    memory_used: Vec<Option<u64>>,
    leases: BTreeMap<LeaseId, LeaseRecord>,
    by_container: HashMap<ContainerKey, LeaseId>,
    drained: BTreeSet<String>,
    queue: AdmissionQueue<Waiter>,
    ledger: Ledger,
    suspects: HashMap<LeaseId, Instant>,
    /// When each lease was reserved, on the monotonic clock: reconciliation's age of an
    /// unconfirmed lease. The wall clock may jump (NTP correcting a clock that was
    /// days off): a forward jump would release every lease mid-create as "never
    /// confirmed", a backward one keep abandoned ones for the jump's length.
    reserved_at: HashMap<LeaseId, Instant>,
    violations: Vec<Violation>,
    violation_totals: BTreeMap<&'static str, u64>,
    store: Arc<LeaseStore>,
    last_ticket: Option<Ticket>,
    /// Leases granted whose creating record is not known durable yet: if the
    /// store loses that record, the lease was never acknowledged and is taken back.
    undurable: BTreeMap<LeaseId, Ticket>,
    endpoints: Box<dyn LeaseEndpoints>,
    probe: Box<dyn ProcessProbe>,
    /// The time-slice tokens, for status (served by the lease sockets).
    tokens: Option<Arc<crate::tokens::TokenService>>,
    /// GPUs set aside at inventory (not in `inventory`): for status and refusals.
    unshareable: Vec<crate::inventory::UnshareableGpu>,
    /// Where per-process GPU memory is read (NVML), once the backend showed it can;
    /// None: overhead is neither measured nor charged (see `overhead_estimate`).
    memory_probe: Option<Arc<dyn GpuBackend>>,
    /// When each lease's processes were last measured.
    measured_at: HashMap<LeaseId, Instant>,
}

/// When a lease this process did not reserve (it was loaded from the store) was
/// reserved, on the monotonic clock: its wall-clock age, clamped to the reservation
/// bound, so a clock that jumped across a restart can at most expire it as the old
/// rule did, never date it into the future.
fn reserved_at_from_wall(record: &LeaseRecord, now: Instant, bound: Duration) -> Instant {
    let age = Duration::from_millis(unix_ms().saturating_sub(record.lease.created_unix_ms));
    now.checked_sub(age.min(bound)).unwrap_or(now)
}

/// A container's id space and id: two namespaces may each hold a container "web".
type ContainerKey = (Option<String>, String);

fn container_key(lease: &Lease) -> ContainerKey {
    (lease.namespace.clone(), lease.container_id.clone())
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Arbiter {
    /// Takes the durable table (from `LeaseStore::open`), re-opens every lease's
    /// endpoint and removes lease directories no lease owns (left by a crash
    /// between creating one and persisting its lease).
    pub fn open(
        config: ArbiterConfig,
        inventory: Inventory,
        store: Arc<LeaseStore>,
        table: Table,
        endpoints: Box<dyn LeaseEndpoints>,
        probe: Box<dyn ProcessProbe>,
    ) -> Result<Self, StateError> {
        let n = inventory.gpus.len();
        let mut arbiter = Arbiter {
            utilization: vec![UtilizationWindow::new(UtilizationWindow::LAST_MINUTE); n],
            memory_used: vec![None; n],
            by_container: table
                .leases
                .values()
                .map(|r| (container_key(&r.lease), r.lease.id.clone()))
                .collect(),
            leases: table.leases,
            drained: table.drained,
            queue: AdmissionQueue::default(),
            ledger: Ledger::default(),
            suspects: HashMap::new(),
            reserved_at: HashMap::new(),
            violations: Vec::new(),
            violation_totals: BTreeMap::new(),
            store,
            last_ticket: None,
            undurable: BTreeMap::new(),
            endpoints,
            probe,
            tokens: None,
            unshareable: Vec::new(),
            memory_probe: None,
            measured_at: HashMap::new(),
            config,
            inventory,
        };
        let dirs = arbiter.config.run_dir.join("leases");
        if let Ok(entries) = fs::read_dir(&dirs) {
            for entry in entries.flatten() {
                let id = LeaseId(entry.file_name().to_string_lossy().into_owned());
                if !arbiter.leases.contains_key(&id) {
                    tracing::info!(lease = %id, "removing the directory of a lease that was never acknowledged");
                    let _ = fs::remove_dir_all(entry.path());
                }
            }
        }
        let records: Vec<(LeaseId, u64)> = arbiter
            .leases
            .values()
            .map(|r| (r.lease.id.clone(), ledger_quota(&r.lease)))
            .collect();
        for (id, quota) in records {
            arbiter.endpoints.open(&id)?;
            arbiter.ledger.open(&id, quota);
        }
        for record in arbiter.leases.values() {
            for gpu in &record.lease.gpus {
                if !arbiter.inventory.gpus.iter().any(|g| &g.uuid == gpu) {
                    tracing::warn!(lease = %record.lease.id, gpu, "a reloaded lease names a GPU this node no longer shares");
                }
            }
        }
        Ok(arbiter)
    }

    pub fn config(&self) -> &ArbiterConfig {
        &self.config
    }

    /// Lets status report the time-slice tokens.
    pub fn set_tokens(&mut self, tokens: Arc<crate::tokens::TokenService>) {
        self.tokens = Some(tokens);
    }

    /// The time-slice tokens, for the watchdog (None until they are set).
    pub fn tokens(&self) -> Option<Arc<crate::tokens::TokenService>> {
        self.tokens.clone()
    }

    /// The GPUs set aside at inventory (`inventory::survey`).
    pub fn set_unshareable(&mut self, gpus: Vec<crate::inventory::UnshareableGpu>) {
        self.unshareable = gpus;
    }

    /// Why a request for `selector` is refused because of a GPU that cannot be shared.
    pub fn unshareable_refusal(&self, selector: &gpushare_proto::GpuSelector) -> Option<String> {
        crate::inventory::refusal(selector, &self.inventory.gpus, &self.unshareable)
    }

    /// Turns on overhead accounting: `backend` lists per-process memory (NVML).
    /// Without it (declared devices) nothing could ever replace the estimate, so no
    /// overhead is charged at all: the quota then covers explicit allocations only,
    /// as the startup log says.
    pub fn set_memory_probe(&mut self, backend: Arc<dyn GpuBackend>) {
        self.memory_probe = Some(backend);
    }

    /// The overhead charged for a process until it is measured, and the least a
    /// lease's quota must exceed (0 when overhead is not accounted).
    pub fn overhead_estimate(&self) -> u64 {
        match self.memory_probe {
            Some(_) => self.config.context_memory_estimate.0,
            None => 0,
        }
    }

    /// What a measurement of `lease` (every lease: None) needs: the probe and the
    /// GPUs to list. None when overhead is not measured.
    pub fn measurement(
        &self,
        lease: Option<&LeaseId>,
    ) -> Option<(Arc<dyn GpuBackend>, Vec<String>)> {
        let probe = self.memory_probe.clone()?;
        let gpus = match lease {
            Some(id) => self.leases.get(id)?.lease.gpus.clone(),
            None => self.inventory.gpus.iter().map(|g| g.uuid.clone()).collect(),
        };
        Some((probe, gpus))
    }

    /// Whether `lease` was measured less than `fresh` ago.
    pub fn measured_within(&self, lease: &LeaseId, now: Instant, fresh: Duration) -> bool {
        self.measured_at
            .get(lease)
            .is_some_and(|at| now.saturating_duration_since(*at) < fresh)
    }

    /// Whether some registered process is still charged the estimate.
    pub fn has_unmeasured_clients(&self) -> bool {
        self.memory_probe.is_some()
            && self
                .leases
                .keys()
                .any(|id| self.ledger.get(id).is_some_and(|l| l.has_unmeasured()))
    }

    /// Records NVML's process lists (per GPU UUID) in the ledger: each lease's
    /// processes' usage on the lease's GPUs sets their overhead. A lease with a GPU
    /// missing from the lists (its listing failed) is left as it was: a partial
    /// listing would read as processes without a context.
    pub fn record_process_memory(&mut self, processes: &ProcessTable, now: Instant) {
        for record in self.leases.values() {
            let l = &record.lease;
            if l.gpus.is_empty() || !l.gpus.iter().all(|g| processes.contains_key(g)) {
                continue;
            }
            let mut usage: BTreeMap<u32, u64> = BTreeMap::new();
            for gpu in &l.gpus {
                for p in processes.get(gpu).into_iter().flatten() {
                    if let Some(bytes) = p.memory_used {
                        let u = usage.entry(p.pid).or_default();
                        *u = u.saturating_add(bytes);
                    }
                }
            }
            self.ledger.record_usage(&l.id, &usage);
            // The container's processes that have not attached (re-attaching after a
            // restart, or bypassing the interposer) hold memory the lease must count;
            // one attached to any lease is counted there.
            let unattached = usage
                .iter()
                .filter(|(&pid, _)| !self.ledger.is_attached(pid))
                .filter(|(&pid, _)| {
                    check_peer(self.probe.as_ref(), pid, l.pid, record.cgroup.as_deref())
                        == PeerCheck::Accepted
                })
                .fold(0u64, |sum, (_, &bytes)| sum.saturating_add(bytes));
            self.ledger.record_unattached(&l.id, unattached);
            self.measured_at.insert(l.id.clone(), now);
        }
    }

    /// The lease as recorded (None once released).
    pub fn lease(&self, id: &LeaseId) -> Option<&Lease> {
        self.leases.get(id).map(|r| &r.lease)
    }

    fn append(&mut self, record: Record) -> Result<Ticket, StateError> {
        let ticket = self.store.append(record)?;
        self.last_ticket = Some(ticket);
        Ok(ticket)
    }

    pub fn store(&self) -> &Arc<LeaseStore> {
        &self.store
    }

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
    fn ensure_writable(&mut self) -> Result<(), StateError> {
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

    fn take_back_lost(&mut self, id: &LeaseId) {
        if self.forget(id) {
            tracing::warn!(lease = %id, "took back a reserve the lease store could not make durable (it was never acknowledged)");
        }
    }

    /// Drops a lease from memory with everything that hangs off it (no record).
    fn forget(&mut self, id: &LeaseId) -> bool {
        self.undurable.remove(id);
        self.reserved_at.remove(id);
        let Some(record) = self.leases.remove(id) else {
            return false;
        };
        let key = container_key(&record.lease);
        if self.by_container.get(&key) == Some(id) {
            self.by_container.remove(&key);
        }
        self.ledger.close(id);
        self.measured_at.remove(id);
        self.suspects.remove(id);
        self.endpoints.close(id);
        true
    }

    // ----- requesters that went away -----

    /// Removes the waiters whose requester disconnected (its control connection
    /// dropped the reply), so they take no lease nobody would be told about.
    /// Returns how many.
    pub fn withdraw_abandoned(&mut self) -> usize {
        let gone: Vec<u64> = self
            .queue
            .iter()
            .filter(|w| w.item.reply.is_closed())
            .map(|w| w.seq)
            .collect();
        for seq in &gone {
            if let Some(w) = self.queue.remove(*seq) {
                tracing::info!(container = %w.item.request.container_id, waited_ms = w.arrived.elapsed().as_millis() as u64, "withdrew a queued reserve: its requester disconnected");
            }
        }
        if !gone.is_empty() {
            // A withdrawn high-priority waiter may have held back low ones.
            self.run_admission();
        }
        gone.len()
    }

    /// A grant whose requester disconnected as it was made: nobody was told, so
    /// a lease created for it is released. A retry's existing lease is not touched.
    pub fn take_back_grant(&mut self, granted: &Granted) {
        if !granted.fresh {
            return;
        }
        let id = &granted.lease.id;
        if self
            .undurable
            .get(id)
            .is_some_and(|t| self.store.has_failed(*t))
        {
            self.take_back_lost(id);
            self.run_admission();
            return;
        }
        match self.release(id) {
            Ok(_) => {
                tracing::info!(lease = %id, container = %granted.lease.container_id, "released a lease granted as its requester disconnected")
            }
            Err(e) => {
                tracing::warn!(lease = %id, error = %e, "could not release a lease whose requester disconnected; reconciliation will")
            }
        }
    }

    // ----- reserve, confirm, release -----

    /// Validates and queues a reserve, then runs an admission pass: the reply
    /// arrives at once when the request fits (or can never fit), else when a
    /// release makes room or the admission bound passes.
    pub fn submit(&mut self, request: ReserveRequest, now: Instant) -> ReserveReply {
        let (tx, rx) = oneshot::channel();
        let id_ok = !request.container_id.is_empty()
            && request.container_id.len() <= 1024
            && !request.container_id.chars().any(char::is_control);
        if !id_ok {
            let _ = tx.send(Err(StateError::BadContainerId(request.container_id)));
            return rx;
        }
        let priority = request.priority;
        let bound = self.config.admission_wait();
        self.queue
            .push(priority, now, bound, Waiter { request, reply: tx });
        self.run_admission();
        rx
    }

    /// Blocking convenience for tests and tools: submit, then take the answer
    /// if it came at once.
    pub fn reserve_now(&mut self, request: ReserveRequest) -> Result<Granted, StateError> {
        let mut rx = self.submit(request, Instant::now());
        match rx.try_recv() {
            Ok(answer) => answer,
            Err(_) => Err(StateError::QueueTimeout {
                waited_s: 0,
                reason: "the request is waiting in the admission queue".into(),
                free: self.free_summary(),
            }),
        }
    }

    fn run_admission(&mut self) {
        loop {
            if self.queue.is_empty() {
                return;
            }
            let mut queue = std::mem::take(&mut self.queue);
            let left = queue.admit(|w: &Waiter| {
                if w.reply.is_closed() {
                    // Its requester is gone: nobody would be told of a lease.
                    return Attempt::Failed(StateError::RequesterGone);
                }
                match self.try_grant(&w.request) {
                    Ok(granted) => Attempt::Admitted(granted),
                    Err(StateError::Placement(e)) if e.is_transient() => Attempt::Wait,
                    Err(e) => Attempt::Failed(e),
                }
            });
            self.queue = queue;
            let mut untold = Vec::new();
            for (waiter, answer) in left {
                if let Ok(g) = &answer {
                    tracing::info!(lease = %g.lease.id, container = %g.lease.container_id, gpus = ?g.lease.gpus, memory = g.lease.memory_bytes, priority = %g.lease.priority, waited_ms = waiter.arrived.elapsed().as_millis() as u64, "reserved");
                }
                // The requester went away after the check above: take a lease
                // created for it back (a retry's existing lease stays).
                if let Err(Ok(granted)) = waiter.item.reply.send(answer) {
                    if granted.fresh {
                        untold.push(granted.lease.id);
                    }
                }
            }
            if untold.is_empty() {
                return;
            }
            for id in &untold {
                // Not through release: that would recurse into admission.
                match self.release_quietly(id) {
                    Ok(()) => {
                        tracing::info!(lease = %id, "released a lease granted as its requester disconnected")
                    }
                    Err(e) => {
                        tracing::warn!(lease = %id, error = %e, "could not release a lease whose requester disconnected; reconciliation will")
                    }
                }
            }
            // The room released may admit others: go round again.
        }
    }

    fn views(&self) -> Vec<GpuView<'_>> {
        let now = Instant::now();
        let mut views: Vec<GpuView> = self
            .inventory
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| GpuView {
                index: g.index,
                uuid: &g.uuid,
                memory_total: g.memory_total,
                memory_leased: 0,
                high_leases: 0,
                low_leases: 0,
                ungated_leases: 0,
                utilization: self.utilization[i].mean(now).unwrap_or(0.0),
                drained: self.drained.contains(&g.uuid),
                reserved_for: self.config.reserved_for(&g.uuid),
            })
            .collect();
        for record in self.leases.values() {
            let l = &record.lease;
            for uuid in &l.gpus {
                if let Some(v) = views.iter_mut().find(|v| v.uuid == uuid) {
                    v.memory_leased += l.memory_bytes;
                    match l.priority {
                        Priority::High => v.high_leases += 1,
                        Priority::Low => v.low_leases += 1,
                    }
                    if l.gpus.len() > 1 {
                        v.ungated_leases += 1;
                    }
                }
            }
        }
        views
    }

    fn policy(&self) -> Policy {
        Policy {
            gpu_util_limit: self.config.gpu_util_limit,
            low_nums_limit: self.config.low_nums_limit,
        }
    }

    fn memory_request(&self, request: &ReserveRequest) -> MemoryRequest {
        request.memory.unwrap_or(self.config.default_memory)
    }

    /// Places and records one lease (not yet durable: see `Granted::ticket`).
    fn try_grant(&mut self, request: &ReserveRequest) -> Result<Granted, StateError> {
        // A retried reserve for the same container (a wrapper that timed out after
        // the arbiter answered) gets its existing lease, not a second one.
        let key = (request.namespace.clone(), request.container_id.clone());
        if let Some(id) = self.by_container.get(&key) {
            return Ok(Granted {
                lease: self.leases[id].lease.clone(),
                ticket: self.last_ticket,
                fresh: false,
            });
        }
        // Before anything is created: a change the store cannot write leaves nothing.
        self.ensure_writable()?;
        let memory = self.memory_request(request);
        let chosen = {
            let views = self.views();
            let r = placement::Request {
                priority: request.priority,
                memory,
                gpu: &request.gpu,
                tenant: request.tenant.as_deref(),
            };
            let p = placement::place(&r, &views, &self.policy())?;
            placement::holds_a_process(p.memory_bytes, self.overhead_estimate())?;
            placement::Placement {
                gpus: p.gpus,
                memory_bytes: p.memory_bytes,
            }
        };
        let lease = Lease {
            id: new_lease_id(),
            container_id: request.container_id.clone(),
            namespace: request.namespace.clone(),
            sandbox_id: request.sandbox_id.clone(),
            gpus: chosen
                .gpus
                .iter()
                .map(|&i| self.inventory.gpus[i].uuid.clone())
                .collect(),
            priority: request.priority,
            memory_bytes: chosen.memory_bytes,
            compute_request: request.compute_request,
            compute_limit: request.compute_limit,
            tenant: request.tenant.clone(),
            state: LeaseState::Reserved,
            pid: None,
            created_unix_ms: unix_ms(),
        };
        let record = LeaseRecord {
            lease: lease.clone(),
            cgroup: None,
            pid_start_time: None,
        };
        self.endpoints.open(&lease.id)?;
        let ticket = match self.append(Record::Put {
            lease: Box::new(record.clone()),
        }) {
            Ok(t) => t,
            Err(e) => {
                self.endpoints.close(&lease.id);
                return Err(e);
            }
        };
        self.ledger.open(&lease.id, ledger_quota(&lease));
        self.reserved_at.insert(lease.id.clone(), Instant::now());
        self.by_container
            .insert(container_key(&lease), lease.id.clone());
        self.leases.insert(lease.id.clone(), record);
        let store = self.store.clone();
        self.undurable.retain(|_, t| !store.is_durable(*t));
        self.undurable.insert(lease.id.clone(), ticket);
        Ok(Granted {
            lease,
            ticket: Some(ticket),
            fresh: true,
        })
    }

    /// The lease `container` names, if any: by the lease it names (which must be
    /// that container's), by its namespace and id, or by the id alone where only one
    /// namespace holds that id (a caller that knows no namespace: podman's hooks).
    pub fn lease_of(&self, container: &ContainerRef) -> Result<Option<LeaseId>, StateError> {
        if let Some(lease) = &container.lease {
            return Ok(self
                .leases
                .get(lease)
                .filter(|r| r.lease.container_id == container.container_id)
                .map(|r| r.lease.id.clone()));
        }
        if container.namespace.is_some() {
            let key = (container.namespace.clone(), container.container_id.clone());
            return Ok(self.by_container.get(&key).cloned());
        }
        let mut holders = self
            .by_container
            .iter()
            .filter(|((_, id), _)| *id == container.container_id);
        match (holders.next(), holders.next()) {
            (None, _) => Ok(None),
            (Some((_, lease)), None) => Ok(Some(lease.clone())),
            (Some(_), Some(_)) => Err(StateError::AmbiguousContainer {
                container: container.container_id.clone(),
                namespaces: self
                    .by_container
                    .keys()
                    .filter(|(_, id)| *id == container.container_id)
                    .map(|(ns, _)| ns.as_deref().unwrap_or("none").to_owned())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// Records the container's init pid (and, from /proc, its start time and cgroup).
    pub fn confirm(&mut self, container_id: &str, pid: u32) -> Result<Option<Ticket>, StateError> {
        self.confirm_in(&ContainerRef::id(container_id.to_owned()), pid)
    }

    pub fn confirm_in(
        &mut self,
        container: &ContainerRef,
        pid: u32,
    ) -> Result<Option<Ticket>, StateError> {
        let id = self
            .lease_of(container)?
            .ok_or_else(|| StateError::NoLeaseForContainer(container.container_id.clone()))?;
        let mut record = self.leases[&id].clone();
        if record.lease.state == LeaseState::Confirmed && record.lease.pid == Some(pid) {
            return Ok(self.last_ticket);
        }
        self.ensure_writable()?;
        record.lease.state = LeaseState::Confirmed;
        record.lease.pid = Some(pid);
        record.pid_start_time = self.probe.start_time(pid);
        record.cgroup = self.probe.cgroup(pid);
        let ticket = self.append(Record::Put {
            lease: Box::new(record.clone()),
        })?;
        self.suspects.remove(&id);
        self.leases.insert(id, record);
        Ok(Some(ticket))
    }

    /// Binds a pending lease (reserved by podman's precreate hook, which sees no
    /// container id) to its container, and confirms it.
    pub fn bind(
        &mut self,
        id: &LeaseId,
        container_id: &str,
        pid: u32,
    ) -> Result<Option<Ticket>, StateError> {
        let pending = self
            .leases
            .get(id)
            .is_some_and(|r| r.lease.container_id.starts_with(PENDING_PREFIX));
        if !pending {
            return Err(StateError::NotPending(id.clone()));
        }
        let namespace = self.leases[id].lease.namespace.clone();
        if self
            .by_container
            .contains_key(&(namespace.clone(), container_id.to_owned()))
        {
            return Err(StateError::AlreadyHoldsLease(container_id.to_owned()));
        }
        self.ensure_writable()?;
        let mut record = self.leases[id].clone();
        let pending_name =
            std::mem::replace(&mut record.lease.container_id, container_id.to_owned());
        record.lease.state = LeaseState::Confirmed;
        record.lease.pid = Some(pid);
        record.pid_start_time = self.probe.start_time(pid);
        record.cgroup = self.probe.cgroup(pid);
        let ticket = self.append(Record::Put {
            lease: Box::new(record.clone()),
        })?;
        self.by_container.remove(&(namespace.clone(), pending_name));
        self.by_container
            .insert((namespace, container_id.to_owned()), id.clone());
        self.suspects.remove(id);
        self.leases.insert(id.clone(), record);
        Ok(Some(ticket))
    }

    /// Idempotent: returns whether the lease existed.
    pub fn release(&mut self, id: &LeaseId) -> Result<(bool, Option<Ticket>), StateError> {
        if !self.leases.contains_key(id) {
            return Ok((false, self.last_ticket));
        }
        let ticket = self.release_record(id)?;
        self.run_admission();
        Ok((true, Some(ticket)))
    }

    /// Release without an admission pass (for admission itself).
    fn release_quietly(&mut self, id: &LeaseId) -> Result<(), StateError> {
        if self.leases.contains_key(id) {
            // Nobody was told of this lease, so nobody waits for its release.
            let _ = self.release_record(id)?;
        }
        Ok(())
    }

    fn release_record(&mut self, id: &LeaseId) -> Result<Ticket, StateError> {
        self.ensure_writable()?;
        let ticket = self.append(Record::Delete { id: id.clone() })?;
        self.forget(id);
        Ok(ticket)
    }

    pub fn release_container(
        &mut self,
        container_id: &str,
    ) -> Result<(bool, Option<Ticket>), StateError> {
        self.release_container_in(&ContainerRef::id(container_id.to_owned()))
    }

    pub fn release_container_in(
        &mut self,
        container: &ContainerRef,
    ) -> Result<(bool, Option<Ticket>), StateError> {
        match self.lease_of(container)? {
            Some(id) => self.release(&id),
            None => Ok((false, self.last_ticket)),
        }
    }

    /// `gpu`: a UUID or an index of a shared GPU.
    pub fn drain(&mut self, gpu: &str, drain: bool) -> Result<(String, Ticket), StateError> {
        let uuid = self
            .inventory
            .gpus
            .iter()
            .find(|g| g.uuid == gpu || g.index.to_string() == gpu)
            .map(|g| g.uuid.clone())
            .ok_or_else(|| StateError::UnknownGpu {
                asked: gpu.to_owned(),
                available: self
                    .inventory
                    .gpus
                    .iter()
                    .map(|g| format!("{} ({})", g.index, g.uuid))
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        self.ensure_writable()?;
        let ticket = self.append(Record::Drain {
            gpu: uuid.clone(),
            drained: drain,
        })?;
        if drain {
            self.drained.insert(uuid.clone());
        } else {
            self.drained.remove(&uuid);
            self.run_admission();
        }
        Ok((uuid, ticket))
    }

    // ----- periodic work -----

    /// Fails the waiters whose bound has passed, saying what they asked for and
    /// what the node has.
    pub fn expire_waiters(&mut self, now: Instant) {
        for w in self.queue.take_expired(now) {
            let memory = self.memory_request(&w.item.request);
            let r = &w.item.request;
            let reason = {
                let views = self.views();
                let req = placement::Request {
                    priority: r.priority,
                    memory,
                    gpu: &r.gpu,
                    tenant: r.tenant.as_deref(),
                };
                match placement::place(&req, &views, &self.policy()) {
                    Err(e) => e.to_string(),
                    Ok(_) => format!(
                        "{} was held back behind a waiting high-priority request",
                        placement::describe(&req)
                    ),
                }
            };
            let err = StateError::QueueTimeout {
                waited_s: now.duration_since(w.arrived).as_secs(),
                reason,
                free: self.free_summary(),
            };
            tracing::warn!(container = %r.container_id, error = %err, "admission timed out");
            let _ = w.item.reply.send(Err(err));
        }
    }

    /// One line per GPU: free memory, jobs, utilisation, drained/reserved.
    pub fn free_summary(&self) -> String {
        self.views()
            .iter()
            .map(|v| {
                let mut s = format!(
                    "GPU {} ({}) {} of {} free, {} high + {} low, {:.0}% busy",
                    v.index,
                    v.uuid,
                    ByteSize(v.memory_free()),
                    ByteSize(v.memory_total),
                    v.high_leases,
                    v.low_leases,
                    v.utilization * 100.0
                );
                if v.drained {
                    s += ", drained";
                }
                if let Some(t) = v.reserved_for {
                    s += &format!(", reserved for {t:?}");
                }
                s
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub fn record_samples(&mut self, now: Instant, samples: &[(String, GpuSample)]) {
        for (uuid, sample) in samples {
            if let Some(i) = self.inventory.gpus.iter().position(|g| &g.uuid == uuid) {
                self.utilization[i].record(now, sample.utilization);
                self.memory_used[i] = Some(sample.memory_used);
            }
        }
        // Utilisation falling may open a GPU to a waiting low-priority request.
        self.run_admission();
    }

    /// Releases leases whose container is gone (after the grace period) or that
    /// were never confirmed; returns what it released and why.
    pub fn reconcile(&mut self, now: Instant) -> Vec<(LeaseId, String)> {
        let bounds = Bounds {
            grace: Duration::from_millis(self.config.reconcile_grace_ms),
            reserved_timeout: Duration::from_millis(self.config.reserved_timeout_ms),
        };
        let mut to_release = Vec::new();
        let mut still_suspect = HashMap::new();
        for (id, record) in &self.leases {
            let presence = reconcile::presence(record, self.probe.as_ref());
            let reserved_at = *self
                .reserved_at
                .entry(id.clone())
                .or_insert_with(|| reserved_at_from_wall(record, now, bounds.reserved_timeout));
            let age = now.saturating_duration_since(reserved_at);
            match reconcile::decide(presence, self.suspects.get(id).copied(), now, age, &bounds) {
                Verdict::Keep => {}
                Verdict::Suspect => {
                    still_suspect.insert(id.clone(), self.suspects.get(id).copied().unwrap_or(now));
                }
                Verdict::Release(why) => to_release.push((id.clone(), why)),
            }
        }
        self.suspects = still_suspect;
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

    pub fn watchdog_input(&self) -> WatchdogInput {
        WatchdogInput {
            gpus: self.inventory.gpus.iter().map(|g| g.uuid.clone()).collect(),
            leases: self
                .leases
                .values()
                .map(|r| {
                    let pids = self
                        .ledger
                        .get(&r.lease.id)
                        .map(|l| l.clients.values().map(|c| c.pid).collect())
                        .unwrap_or_default();
                    (
                        r.lease.id.clone(),
                        r.lease.gpus.clone(),
                        ledger_quota(&r.lease),
                        pids,
                    )
                })
                .collect(),
        }
    }

    pub fn record_violations(&mut self, violations: Vec<Violation>) {
        for v in &violations {
            let kind = match v.kind {
                ViolationKind::Unregistered => "unregistered",
                ViolationKind::OverQuota => "over_quota",
                ViolationKind::Ungated => "ungated",
            };
            *self.violation_totals.entry(kind).or_default() += 1;
        }
        self.violations = violations;
    }

    pub fn violation_totals(&self) -> &BTreeMap<&'static str, u64> {
        &self.violation_totals
    }

    // ----- lease sockets -----

    fn quota(&self, id: &LeaseId, connection: ConnectionId) -> Result<Quota, StateError> {
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

    fn verify_peer(
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

    pub fn lease_detach(&mut self, id: &LeaseId, connection: ConnectionId) {
        let credited = self.ledger.detach(id, connection);
        if self.ledger.get(id).is_some_and(|l| l.clients.is_empty()) {
            self.measured_at.remove(id);
        }
        tracing::debug!(lease = %id, credited, "lease client detached");
    }

    // ----- reports -----

    pub fn list(&self) -> Vec<Lease> {
        self.leases.values().map(|r| r.lease.clone()).collect()
    }

    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    pub fn status(&self) -> StatusReport {
        let now = Instant::now();
        let views = self.views();
        StatusReport {
            gpus: self
                .inventory
                .gpus
                .iter()
                .zip(&views)
                .enumerate()
                .map(|(i, (g, v))| GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_total: g.memory_total,
                    memory_leased: v.memory_leased,
                    memory_used: self.memory_used[i],
                    utilization_last_minute: self.utilization[i].mean(now),
                    drained: v.drained,
                    reserved_for: v.reserved_for.map(str::to_owned),
                })
                .collect(),
            leases: self.list(),
            driver_cuda_version: self.inventory.cuda_driver_version,
            inventory_source: self.inventory.source.to_owned(),
            usage: self
                .leases
                .values()
                .map(|r| {
                    let ledger = self.ledger.get(&r.lease.id);
                    LeaseUsage {
                        lease: r.lease.id.clone(),
                        memory_used: ledger.map(|l| l.used()).unwrap_or(0),
                        memory_quota: ledger_quota(&r.lease),
                        clients: ledger
                            .map(|l| {
                                l.clients
                                    .values()
                                    .map(|c| ClientStatus {
                                        pid: c.pid,
                                        memory_held: c.held,
                                        memory_overhead: c.overhead,
                                        overhead_measured: c.measured.is_some(),
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        cgroup: r.cgroup.clone(),
                    }
                })
                .collect(),
            queue: self
                .queue
                .iter()
                .enumerate()
                .map(|(position, w)| QueuedRequest {
                    container_id: w.item.request.container_id.clone(),
                    priority: w.priority,
                    memory: w.item.request.memory,
                    gpu: w.item.request.gpu.clone(),
                    position,
                    waited_ms: now.duration_since(w.arrived).as_millis() as u64,
                })
                .collect(),
            violations: self.violations.clone(),
            tokens: self.tokens.as_ref().map(|t| t.status()).unwrap_or_default(),
            unshareable: self.unshareable.iter().map(|u| u.status()).collect(),
            connections: self
                .tokens
                .as_ref()
                .map(|t| t.budget().status())
                .unwrap_or_default(),
            store_failure: self.store.failure().map(|f| f.to_string()),
        }
    }
}

/// The ledger's quota: the lease's memory on each of its GPUs.
fn ledger_quota(lease: &Lease) -> u64 {
    lease
        .memory_bytes
        .saturating_mul(lease.gpus.len().max(1) as u64)
}

/// Helper for the watchdog tick: NVML's processes per GPU.
pub type ProcessTable = BTreeMap<String, Vec<GpuProcess>>;

/// 64 random bits: unique across restarts without coordinating with the store.
fn new_lease_id() -> LeaseId {
    let mut bytes = [0u8; 8];
    let random = fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if random.is_err() {
        // /dev/urandom is always there on Linux; fall back to time + pid rather than fail a container.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = ((nanos as u64) ^ ((std::process::id() as u64) << 40)).to_le_bytes();
    }
    LeaseId(format!("{:016x}", u64::from_le_bytes(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::tests::FakeProcs;
    use crate::store::StoreOptions;
    use gpushare_proto::{Fraction, GpuSelector};

    const GI: u64 = 1 << 30;

    struct SharedProbe(Arc<FakeProcs>);
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

    fn config(dir: &std::path::Path) -> ArbiterConfig {
        ArbiterConfig {
            run_dir: dir.join("run"),
            state_dir: dir.join("state"),
            admission_wait_ms: 30_000,
            reconcile_grace_ms: 5_000,
            ..Default::default()
        }
    }

    fn open_with(config: ArbiterConfig, gpus: usize, procs: Arc<FakeProcs>) -> Arbiter {
        let (store, table) = LeaseStore::open(&config.state_dir, StoreOptions::default()).unwrap();
        let inventory = Inventory {
            gpus: (0..gpus)
                .map(|i| Gpu {
                    index: i as u32,
                    uuid: format!("GPU-{i}"),
                    name: "t".into(),
                    memory_total: 8 * GI,
                })
                .collect(),
            source: "declared",
            cuda_driver_version: None,
        };
        let endpoints = Box::new(LeaseDirs {
            run_dir: config.run_dir.clone(),
        });
        Arbiter::open(
            config,
            inventory,
            Arc::new(store),
            table,
            endpoints,
            Box::new(SharedProbe(procs)),
        )
        .unwrap()
    }

    fn setup() -> (tempfile::TempDir, Arbiter, Arc<FakeProcs>) {
        let dir = tempfile::tempdir().unwrap();
        let procs = Arc::new(FakeProcs::default());
        let arbiter = open_with(config(dir.path()), 1, procs.clone());
        (dir, arbiter, procs)
    }

    fn request(container: &str, memory: &str, priority: Priority) -> ReserveRequest {
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

    /// Issue 15: two engines or two containerd namespaces may use one container id
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
        assert!(text.contains("waited 30s"), "{text}");
        assert!(
            text.contains("low-priority request for 3Gi on count:1"),
            "{text}"
        );
        assert!(
            text.contains("GPU 0 (GPU-0) 2Gi of 8Gi free, 0 high + 1 low"),
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
        assert!(
            left.contains(&"live".to_string()) && left.contains(&"never-confirmed".to_string())
        );
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
}
