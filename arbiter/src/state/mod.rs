//! The arbiter's state: leases, the admission queue, the memory ledger, drained
//! GPUs, the device plugin's grants, what was measured (`Telemetry`: GPU samples,
//! held token time, process measurements) and what was found wrong (`Findings`:
//! violations, quota refusals, suspected leases) and what admission did
//! (`AdmissionRecord`: placement times, fragmented waits, queue timeouts), behind
//! one lock.
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
    ByteSize, ClientStatus, ContainerRef, ErrorKind, GpuStatus, GpuUtilization, Lease, LeaseId,
    LeaseState, LeaseUsage, MemoryRequest, Priority, QueuedRequest, Quota, ReserveRequest,
    StatusReport, Violation,
};
use tokio::sync::oneshot;

use crate::inventory::{Gpu, GpuBackend, GpuProcess, GpuSample};
use crate::ledger::{Charge, ConnectionId, Ledger, LedgerError};
use crate::placement::{self, GpuView, PlacementError, Policy};
use crate::process::{check_peer, PeerCheck, ProcessProbe};
use crate::queue::{AdmissionQueue, Attempt};
use crate::reconcile::{self, Bounds, Verdict};
use crate::store::{LeaseRecord, LeaseStore, Record, StoreError, Table, Ticket};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("waited {:.1} s in the admission queue: {reason}; on the node: {free}", *waited_ms as f64 / 1000.0)]
    QueueTimeout {
        waited_ms: u64,
        reason: String,
        free: String,
    },
    #[error("container id {0:?}: must be 1 to 1024 printable characters")]
    BadContainerId(String),
    /// A number the control socket carried that no honest client sends.
    #[error("{request} request {field} = {value}: {accepted}")]
    BadRequest {
        request: &'static str,
        field: &'static str,
        value: String,
        accepted: &'static str,
    },
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
    /// The GPU asked for is set aside (`inventory::refusal` says why and what to ask).
    #[error("{0}")]
    Unshareable(String),
    #[error("the reserve was dropped")]
    ReserveDropped,
    #[error(transparent)]
    Grant(#[from] GrantError),
}

impl StateError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            StateError::QueueTimeout { .. } => ErrorKind::Unplaceable,
            StateError::Placement(PlacementError::NoFit { .. }) => ErrorKind::Unplaceable,
            StateError::Placement(_)
            | StateError::BadContainerId(_)
            | StateError::BadRequest { .. }
            | StateError::NotPending(_)
            | StateError::AlreadyHoldsLease(_)
            | StateError::AmbiguousContainer { .. } => ErrorKind::InvalidRequest,
            StateError::NoLeaseForContainer(_)
            | StateError::UnknownGpu { .. }
            | StateError::LeaseReleased(_) => ErrorKind::NotFound,
            StateError::Store(_) | StateError::LeaseDir { .. } => ErrorKind::Internal,
            StateError::PeerRefused(_) => ErrorKind::PermissionDenied,
            StateError::Ledger(
                LedgerError::CreditTooLarge { .. } | LedgerError::HeldBeyondQuota { .. },
            ) => ErrorKind::InvalidRequest,
            StateError::Ledger(LedgerError::UnknownLease(_)) => ErrorKind::NotFound,
            StateError::Ledger(_) => ErrorKind::Protocol,
            StateError::BadLeaseId(_) => ErrorKind::InvalidRequest,
            StateError::RequesterGone | StateError::ReserveDropped => ErrorKind::Internal,
            StateError::Unshareable(_) => ErrorKind::InvalidRequest,
            StateError::Grant(e) => e.kind(),
        }
    }
}

mod admission_record;
mod batch_admission;
mod clients;
mod demand;
mod drain;
mod endpoints;
mod findings;
#[cfg(test)]
mod grant_tests;
mod grants;
mod handle;
mod lifecycle;
mod memory;
#[cfg(test)]
mod placement_tests;
mod recovery;
mod reserve;
mod status;
mod suspensions;
mod telemetry;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
pub(crate) use suspensions::tests::Node as ReclaimTestNode;

pub use crate::reclaim::{Suspension, SuspensionPhase};
pub use batch_admission::{BatchOutcome, BatchSearchJob};
pub use endpoints::{LeaseDirs, LeaseEndpoints};
use findings::Findings;
pub use grants::GrantError;
pub use handle::{ArbiterHandle, MemoryReclaim, MEASURE_FRESH};
pub use memory::list_processes;
use suspensions::Suspensions;
pub use suspensions::{ChargeDecision, ReclaimPlan, ReclaimTimes, SuspendOutcome, Victim};
use telemetry::Telemetry;

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
    /// Already counted in `waits_fragmented` (a request counts once however often it waits).
    counted_fragmented: std::cell::Cell<bool>,
    /// What the batch search planned for it in this admission pass.
    batch: std::cell::Cell<batch_admission::BatchPlan>,
}

/// What the watchdog needs from the state, copied out so NVML is called without the lock.
pub struct WatchdogInput {
    pub gpus: Vec<String>,
    /// (lease, its GPUs, its ledger quota (all GPUs together), its registered pids).
    pub leases: Vec<(LeaseId, Vec<String>, u64, Vec<u32>)>,
}

pub struct Inventory {
    pub gpus: Vec<Gpu>,
    pub source: &'static str,
    pub cuda_driver_version: Option<u32>,
}

pub struct Arbiter {
    config: ArbiterConfig,
    inventory: Inventory,
    /// GPU samples, held token time and process measurements (`telemetry.rs`).
    telemetry: Telemetry,
    /// Violations, quota refusals and suspected leases (`findings.rs`).
    findings: Findings,
    /// Names the engine gave live leases' containers (docker's), found at confirmation.
    engine_names: HashMap<LeaseId, String>,
    placement: gpushare_config::PlacementConfig,
    /// What admission did, counted for status and metrics.
    admission_record: admission_record::AdmissionRecord,
    /// The batch search's progress when it runs off the lock (`batch_admission.rs`).
    batch_search: batch_admission::BatchSearch,
    leases: BTreeMap<LeaseId, LeaseRecord>,
    by_container: HashMap<ContainerKey, LeaseId>,
    drained: BTreeSet<String>,
    queue: AdmissionQueue<Waiter>,
    ledger: Ledger,
    /// When each lease was reserved, on the monotonic clock: reconciliation's age of an
    /// unconfirmed lease. The wall clock may jump (NTP correcting a clock that was
    /// days off): a forward jump would release every lease mid-create as "never
    /// confirmed", a backward one keep abandoned ones for the jump's length.
    reserved_at: HashMap<LeaseId, Instant>,
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
    /// Why the inventory has no GPU to share (`inventory::no_gpus_reason`), for status.
    no_gpus_reason: Option<String>,
    /// Where per-process GPU memory is read (NVML), once the backend showed it can;
    /// None: overhead is neither measured nor charged (see `overhead_estimate`).
    memory_probe: Option<Arc<dyn GpuBackend>>,
    /// The device plugin's grants (`grants.rs`), bound to their leases.
    grants: BTreeMap<gpushare_proto::grant::GrantId, gpushare_proto::grant::Grant>,
    /// The `[memory]` table: whether memory is lent to low-priority leases.
    memory: gpushare_config::MemoryConfig,
    /// Leases the memory reclaim took off their GPU (`suspensions.rs`).
    suspensions: Suspensions,
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
            telemetry: Telemetry::new(
                n,
                Duration::from_millis(
                    gpushare_config::PlacementConfig::default().utilization_window_ms,
                ),
            ),
            findings: Findings::default(),
            engine_names: HashMap::new(),
            placement: gpushare_config::PlacementConfig::default(),
            admission_record: Default::default(),
            batch_search: Default::default(),
            by_container: table
                .leases
                .values()
                .map(|r| (container_key(&r.lease), r.lease.id.clone()))
                .collect(),
            leases: table.leases,
            drained: table.drained,
            grants: table.grants,
            queue: AdmissionQueue::default(),
            ledger: Ledger::default(),
            reserved_at: HashMap::new(),
            store,
            last_ticket: None,
            undurable: BTreeMap::new(),
            endpoints,
            probe,
            tokens: None,
            unshareable: Vec::new(),
            no_gpus_reason: None,
            memory_probe: None,
            memory: Default::default(),
            suspensions: Default::default(),
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
        arbiter.bind_grants_from_leases();
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

    /// Why the inventory has no GPU to share, said by status (`inventory::no_gpus_reason`).
    pub fn set_no_gpus_reason(&mut self, why: Option<String>) {
        self.no_gpus_reason = why;
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
        self.suspensions.forget(id);
        self.telemetry.forget(id);
        self.findings.forget(id);
        self.endpoints.close(id);
        self.unbind_grants(id);
        true
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
                memory_allocatable: g.memory_allocatable,
                memory_leased: 0,
                lending: self.memory.reclaim.then_some(placement::Lending {
                    lent: 0,
                    overcommit: self.memory.low_overcommit,
                }),
                high_leases: 0,
                low_leases: 0,
                ungated_leases: 0,
                utilization: self
                    .telemetry
                    .utilization_last_minute(i, now)
                    .unwrap_or(0.0),
                drained: self.drained.contains(&g.uuid),
                reserved_for: self.config.reserved_for(&g.uuid),
            })
            .collect();
        for record in self.leases.values() {
            let l = &record.lease;
            for uuid in &l.gpus {
                if let Some(v) = views.iter_mut().find(|v| v.uuid == uuid) {
                    v.memory_leased += l.memory_bytes;
                    if let Some(lending) = v.lending.as_mut().filter(|_| self.lends_memory(l)) {
                        lending.lent += l.memory_bytes;
                    }
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
        // Room promised to a grant whose container has not started (or is
        // restarting) is taken, also for a container started outside Kubernetes.
        for (gpu, bytes) in self.unbound_grant_room() {
            if let Some(v) = views.iter_mut().find(|v| v.uuid == gpu) {
                v.memory_leased += bytes;
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
