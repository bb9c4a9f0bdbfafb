//! Messages on the arbiter's root-only control socket.

use serde::{Deserialize, Serialize};

use crate::grant::{Grant, GrantId, GrantRequest, PodBinding};
use crate::lease::{Lease, LeaseId};
use crate::quantity::{Fraction, GpuSelector, MemoryRequest, Priority};

/// What an entry point (wrapper, hook, shim) asks for on behalf of a container.
/// Container id of a lease reserved before its container had one (see `Bind`).
/// The suffix is random: knowing it is what entitles the binder.
pub const PENDING_PREFIX: &str = "pending:";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReserveRequest {
    pub container_id: String,
    /// The id space `container_id` belongs to, as the entry point learns it from its
    /// engine, never from the container's spec: the containerd namespace, or the OCI
    /// runtime's state root. Two engines, or two containerd namespaces, may use one
    /// id at once; a lease is keyed by both. None: the id alone (older clients).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub sandbox_id: Option<String>,
    pub priority: Priority,
    /// None: the configured default.
    pub memory: Option<MemoryRequest>,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
    pub gpu: GpuSelector,
    pub tenant: Option<String>,
    /// The container's pod, from the CRI runtime's annotations, and the grants
    /// named by its device plugin answers (`grant.gpushare.io/*`). With a memory
    /// grant the quota is the grant's and the GPU the grant's; a grant is used by
    /// one live lease at a time and only while it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodBinding>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// First message of every connection.
    Hello {
        protocol: u32,
    },
    /// May wait in the admission queue (up to the bound the hello answer names)
    /// when no GPU has room.
    Reserve(ReserveRequest),
    /// The container exists and this is its init pid (from the createRuntime hook).
    /// Keyed by the container id runc reports, never by an annotation the
    /// container's creator could have forged.
    Confirm {
        container_id: String,
        pid: u32,
        /// See `ReserveRequest::namespace`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        /// The lease gpushare's own spec edit named (`gpushare.io/lease`), where the
        /// caller has it: it tells apart two containers with one id in two
        /// namespaces. It must belong to `container_id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<LeaseId>,
    },
    /// Releasing is idempotent: an unknown lease is not an error.
    Release {
        lease: LeaseId,
    },
    /// Ties a lease reserved before its container had an id (podman's precreate
    /// hook sees only the spec) to the id runc reports. Refused unless the lease
    /// is still pending, so a forged lease annotation cannot take over another
    /// container's lease.
    Bind {
        lease: LeaseId,
        container_id: String,
        pid: u32,
    },
    /// Release whatever lease a container holds (for callers that know only the container).
    ReleaseContainer {
        container_id: String,
        /// See `ReserveRequest::namespace`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        /// As for `Confirm`: which of several same-id leases is meant.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<LeaseId>,
    },
    Status,
    /// The leases alone (cheaper than a status report).
    List,
    /// Stop (or resume) placing new leases on one GPU, named by UUID or index;
    /// leases already on it stay.
    Drain {
        gpu: String,
        drain: bool,
    },
    /// The device plugin's `Allocate`: placed at once (worst fit) or recorded as
    /// waiting; never refused for fragmentation.
    Grant(GrantRequest),
    /// Every grant the arbiter holds.
    Grants,
    /// Who held each GPU's time-slice token when: the token service's recent holds
    /// (bounded; see `TimelineReport`) and each lease's token time.
    Timeline {
        /// Only holds that ended within this many ms before now (None: all kept).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ms: Option<u64>,
    },
    /// Idempotent: an unknown grant is not an error. A lease reserved against it
    /// keeps running; only a new reserve can no longer use it.
    ReleaseGrant {
        id: GrantId,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ControlResponse {
    Hello {
        protocol: u32,
        /// How long a reserve may wait in the admission queue, so a client can
        /// keep its read timeout above it. Absent from arbiters that never queue.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        admission_wait_ms: Option<u64>,
    },
    Reserved {
        lease: Lease,
    },
    Confirmed,
    Released {
        existed: bool,
    },
    Status(Box<StatusReport>),
    Leases {
        leases: Vec<Lease>,
    },
    Drained {
        /// The GPU's UUID, whatever name the request used.
        gpu: String,
        drained: bool,
    },
    Granted {
        grant: Grant,
    },
    Grants {
        grants: Vec<Grant>,
    },
    GrantReleased {
        existed: bool,
    },
    Timeline(TimelineReport),
    Error {
        kind: ErrorKind,
        message: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (e.g. an index that does not exist).
    InvalidRequest,
    /// Valid, but nothing on this node can hold it (after waiting in the queue).
    Unplaceable,
    NotFound,
    /// The peer broke the protocol; the connection is closed after this.
    Protocol,
    Internal,
    /// The peer is not who the socket it came through belongs to.
    PermissionDenied,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// NVML's total: the physical memory.
    pub memory_total: u64,
    /// What CUDA can allocate (`memory_total` less what the driver reserves): what leases
    /// are placed within. 0 from an arbiter that did not report it.
    #[serde(default)]
    pub memory_allocatable: u64,
    /// Sum of the memory quotas of the leases on this GPU, plus the room held for
    /// memory grants placed here that no live lease uses yet (Kubernetes): both are
    /// promised, so neither is free.
    pub memory_leased: u64,
    /// Device memory in use as NVML reports it (None with declared devices).
    #[serde(default)]
    pub memory_used: Option<u64>,
    /// Mean GPU utilisation (0–1) over the last minute; None until sampled.
    #[serde(default)]
    pub utilization_last_minute: Option<f64>,
    /// No new leases are placed on a drained GPU.
    #[serde(default)]
    pub drained: bool,
    /// The tenant this GPU is reserved for, if any.
    #[serde(default)]
    pub reserved_for: Option<String>,
}

/// One process that registered through a lease socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    /// Host pid, from SO_PEERCRED.
    pub pid: u32,
    /// Bytes this process has charged and not credited.
    pub memory_held: u64,
    /// Its device memory beyond those charges (context, modules, ...), charged to
    /// the lease too: measured from NVML, or the estimate until then.
    #[serde(default)]
    pub memory_overhead: u64,
    /// Whether `memory_overhead` was measured (false: the estimate).
    #[serde(default)]
    pub overhead_measured: bool,
}

/// What the arbiter knows about a lease beyond the grant itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseUsage {
    pub lease: LeaseId,
    /// Sum of the ledger over all of the lease's processes: charges plus overhead.
    pub memory_used: u64,
    pub memory_quota: u64,
    pub clients: Vec<ClientStatus>,
    /// The container's cgroup, recorded at confirmation.
    pub cgroup: Option<String>,
    /// What a person calls the container (see [`Lease::display_name`]); empty from
    /// an older arbiter.
    #[serde(default)]
    pub container: String,
    /// Token time: how long the lease's token clients held the GPU's time-slice token
    /// (its turn on the GPU), summed over its GPUs and every client it ever had (gone
    /// ones included), in ms. Its kernels run only while it holds the token, so this
    /// bounds its GPU time (the time its kernels ran), which only the job itself sees.
    #[serde(default, alias = "gpu_time_ms")]
    pub token_time_ms: u64,
    /// Its token share: token time in the last 10 s and the last minute over the
    /// window's length (0–1 of one GPU). None without token clients.
    #[serde(default, alias = "gpu_share_10s")]
    pub token_share_10s: Option<f64>,
    #[serde(default, alias = "gpu_share_1m")]
    pub token_share_1m: Option<f64>,
    /// Allocations refused because they would have passed the memory quota.
    #[serde(default)]
    pub memory_refusals: u64,
    /// Times its token clients were revoked (a higher-priority job wanted the GPU,
    /// or the slice ran out), cut off (the lease ended while they were connected),
    /// and found overdue (revoked and not released within the grace period).
    #[serde(default)]
    pub token_revocations: u64,
    #[serde(default)]
    pub token_cut_offs: u64,
    #[serde(default)]
    pub token_overdue: u64,
}

/// A request waiting in the admission queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueuedRequest {
    pub container_id: String,
    pub priority: Priority,
    pub memory: Option<MemoryRequest>,
    pub gpu: GpuSelector,
    /// 0 is the next to be considered.
    pub position: usize,
    pub waited_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// A process uses a shared GPU without having registered through a lease socket
    /// (it bypassed the interposer).
    Unregistered,
    /// A lease's processes hold more GPU memory than its quota.
    OverQuota,
    /// A registered process was busy on a GPU whose time is scheduled for much longer
    /// than it held the time-slice token (or without a token connection at all): its
    /// work bypassed the interposer's gate.
    Ungated,
    /// A low-priority holder, revoked while a high-priority job was active, was still
    /// draining after `scheduler.revoke_grace_ms`: its work ran into the high job's
    /// time, measured on the arbiter's clock (whatever its interposer admitted or
    /// reported). Its lease loses window admission for `scheduler.overrun_penalty_ms`.
    Overrun,
    /// A token client runs in a time namespace of its own: its `CLOCK_MONOTONIC` is not
    /// the arbiter's, the clock its page's deadline and window are compared with. The
    /// arbiter writes its page in its clock, so the shift buys nothing; reported when it
    /// connects, since a job has no need of one (CRIU's restores are the known user).
    ShiftedClock,
}

/// Something the watchdog saw on a shared GPU that should not be there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Violation {
    pub kind: ViolationKind,
    pub gpu: String,
    pub pid: u32,
    pub lease: Option<LeaseId>,
    /// Memory NVML attributes to the process (or the lease, for over-quota).
    pub memory_used: u64,
    /// The lease's quota, for over-quota.
    pub memory_quota: Option<u64>,
    /// Whether the arbiter killed the process (configuration `watchdog_kill`).
    pub killed: bool,
}

/// `Default` so code (and tests) that build a report name only the fields they
/// care about: `StatusReport { leases, ..Default::default() }`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub gpus: Vec<GpuStatus>,
    pub leases: Vec<Lease>,
    /// The driver's CUDA version as NVML encodes it (12040 for 12.4); None without NVML.
    #[serde(default)]
    pub driver_cuda_version: Option<u32>,
    /// "nvml" or "declared".
    #[serde(default)]
    pub inventory_source: String,
    #[serde(default)]
    pub usage: Vec<LeaseUsage>,
    #[serde(default)]
    pub queue: Vec<QueuedRequest>,
    /// From the watchdog's latest pass.
    #[serde(default)]
    pub violations: Vec<Violation>,
    /// The time-slice token of each GPU that has token clients.
    #[serde(default)]
    pub tokens: Vec<TokenStatus>,
    /// GPUs of this node set aside at inventory because gpushare cannot share them
    /// (compute mode, MIG, MPS); not in `gpus`, no lease is placed on them.
    #[serde(default)]
    pub unshareable: Vec<UnshareableGpuStatus>,
    /// Lease-socket connections now, their bounds, and what was refused.
    #[serde(default)]
    pub connections: ConnectionStatus,
    /// Why the lease store cannot be written now (a full `state_dir`): new work
    /// is refused until a recovery succeeds. None while writes work.
    #[serde(default)]
    pub store_failure: Option<String>,
    /// The device plugin's grants (Kubernetes), placed and waiting.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<Grant>,
    /// Rebalancing hints, one per GPU of `gpus` (balanced placement). Beside `GpuStatus`
    /// rather than in it: other crates build `GpuStatus` field by field.
    #[serde(default)]
    pub placement: Vec<GpuPlacementHint>,
    /// Reserves that had to wait although the node's free memory, added over its
    /// open GPUs, would have held them: memory split into holes too small.
    #[serde(default)]
    pub placement_waits_fragmented: u64,
    /// How long placement decisions and batch searches took.
    #[serde(default)]
    pub placement_times: crate::timing::PlacementTimes,
    /// The short utilisation window of each GPU of `gpus`. Beside `GpuStatus`
    /// for the reason `placement` is.
    #[serde(default)]
    pub gpu_utilization: Vec<GpuUtilization>,
    /// Reserves refused after waiting out the admission bound, by priority, since
    /// the arbiter started (they never became leases, so they are counted here).
    #[serde(default)]
    pub admission_rejections: AdmissionRejections,
    /// How long ago the background loop last sampled the GPUs, in ms; None before
    /// the first sample. A stalled loop shows here (and fails `/healthz`).
    #[serde(default)]
    pub last_sample_age_ms: Option<u64>,
    /// Memory that follows priority (`[memory] reclaim`): None when it is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<Box<ReclaimStatus>>,
    /// Why `gpus` is empty (no usable driver, nothing declared, every GPU set aside as
    /// unshareable); None while a GPU is shared, and from an older arbiter.
    #[serde(default)]
    pub no_gpus_reason: Option<String>,
}

/// Memory reclaim's state: the leases checkpointed off their GPU and the last reclaims.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReclaimStatus {
    pub low_overcommit: f64,
    /// The bound: max(`floor_ms`, 1.5 x bytes / `checkpoint_gbps`).
    pub floor_ms: u64,
    pub checkpoint_gbps: f64,
    pub suspended: Vec<SuspendedLease>,
    /// Leases never suspended again (the driver could not checkpoint them, or failed),
    /// with why.
    pub never_again: Vec<(String, String)>,
    /// The last reclaims, oldest first.
    pub recent: Vec<ReclaimReport>,
    /// Totals since the arbiter started.
    pub reclaims: u64,
    pub reclaims_failed: u64,
    pub restores: u64,
    pub reclaimed_bytes: u64,
}

/// A low-priority lease checkpointed off its GPU (or being suspended or restored).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SuspendedLease {
    pub lease: String,
    pub name: String,
    pub gpu: String,
    pub bytes: u64,
    /// "suspending", "suspended" or "restoring".
    pub phase: String,
    pub since_unix_ms: u64,
}

/// One reclaim: a high-priority lease needed `shortfall` more on `gpu`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReclaimReport {
    pub lease: String,
    pub gpu: String,
    pub shortfall: u64,
    /// What the suspended victims held.
    pub bytes: u64,
    pub victims: Vec<String>,
    pub succeeded: bool,
    /// The longest lock among the victims' processes, the checkpoints' time, the whole.
    pub lock_ms: f64,
    pub checkpoint_ms: f64,
    pub total_ms: f64,
    pub bound_ms: f64,
    pub at_unix_ms: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionRejections {
    pub high: u64,
    pub low: u64,
}

/// A GPU's utilisation over the short window, which follows a change within
/// seconds where `GpuStatus::utilization_last_minute` takes a minute.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuUtilization {
    pub uuid: String,
    /// Mean NVML utilisation (0–1) over the last 10 s; None until sampled.
    pub last_10s: Option<f64>,
}

/// What placement sees of one GPU, to tell where load could be moved.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuPlacementHint {
    pub uuid: String,
    /// The expected demand of its leases, in GPUs (1.0 = one GPU's whole time):
    /// measured token time, else the requests, else an assumption by priority.
    pub expected_demand: f64,
    /// The largest quota a new lease could be given on it now: memory not
    /// promised to a lease or grant, and (where NVML reports it) not in use.
    pub largest_free_hole: u64,
}

/// The lease sockets' connections (token connections included): how many are open,
/// the bounds, and how many were refused since the arbiter started, by reason.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectionStatus {
    pub open: usize,
    pub per_lease_limit: usize,
    pub total_limit: usize,
    /// Refused because their lease already had `per_lease_limit` connections.
    pub refused_lease_limit: u64,
    /// Refused because the node had `total_limit` connections.
    pub refused_total_limit: u64,
    /// Refused because their lease was beyond its floor while the rest of the
    /// node's bound was kept for other leases' floors.
    #[serde(default)]
    pub refused_fair_share: u64,
    /// Refused because the peer is not inside the lease's confirmed container.
    pub refused_peer: u64,
}

/// A GPU gpushare cannot share, and why.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UnshareableGpuStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    /// What is wrong and what to change ("it is in compute mode EXCLUSIVE_PROCESS;
    /// set it to DEFAULT with `nvidia-smi -i GPU-… -c DEFAULT`").
    pub reason: String,
}

/// One GPU's time-slice token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenStatus {
    pub gpu: String,
    /// "priority" or "round-robin".
    pub policy: String,
    /// Who holds it now (several high-priority clients may hold at once).
    pub holders: Vec<TokenHolder>,
    /// Token connections on this GPU.
    pub clients: usize,
    /// Clients that want the token and wait for it.
    pub waiting: usize,
    pub grants: u64,
    pub revocations: u64,
    /// Always 0, kept so that readers of the old report still parse it: this counted
    /// clients cut off for a slow drain, and nobody is cut off for that now (see
    /// `overdue`). A lease that ends still flags its clients cut off, which is routine
    /// (its processes are gone or going) and not counted.
    pub cut_offs: u64,
    /// Revoked clients that had not released after `scheduler.revoke_grace_ms`: a
    /// total. Such a client is no longer waited for but stays connected.
    #[serde(default)]
    pub overdue: u64,
    /// The clients overdue now (revoked, past the grace period, still draining).
    #[serde(default)]
    pub overdue_clients: Vec<TokenHolder>,
    /// Duration-aware admission on this GPU (totals since the arbiter started).
    #[serde(default)]
    pub admission: AdmissionStatus,
    /// Times one of this GPU's token threads failed (panicked) and was restarted.
    #[serde(default)]
    pub thread_restarts: u64,
    /// A token thread of this GPU failed within the last minute: `/healthz` fails.
    #[serde(default)]
    pub thread_failed_recently: bool,
    /// The token's account of each lease that had token clients on this GPU (live
    /// leases, and ended ones the timeline still shows): the per-GPU parts of which
    /// `LeaseUsage`'s token time, token shares and token counts are the sums.
    #[serde(default)]
    pub leases: Vec<LeaseTokenAccount>,
}

/// One lease's token account on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseTokenAccount {
    pub lease: LeaseId,
    /// Token time on this GPU: how long the lease's token clients held its token,
    /// gone clients included, in ms.
    pub token_time_ms: u64,
    /// Token share on this GPU over the last 10 s and the last minute (0–1).
    pub token_share_10s: f64,
    pub token_share_1m: f64,
    /// Times its clients here were revoked, cut off (the lease ended while they were
    /// connected) and found overdue (revoked, not released within the grace).
    pub revocations: u64,
    pub cut_offs: u64,
    pub overdue: u64,
}

/// What duration-aware admission did on one GPU: the arbiter's side (windows, the
/// high-priority job's rhythm and its mis-predictions) and the interposers' (launches
/// admitted, held back, and measured past their window's end).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionStatus {
    /// Admission windows published to low-priority holders.
    pub windows: u64,
    /// Times the high-priority job came back while a window was still open.
    pub early_returns: u64,
    /// The high-priority job's recent gaps between bursts, in µs, oldest first.
    pub high_gaps_us: Vec<u64>,
    /// The interposers' counts, summed over every client that reported (including
    /// clients gone since).
    #[serde(flatten)]
    pub launches: crate::token::FitCounts,
    /// Clients waiting for a window their next launch fits.
    pub waiting_for_window: Vec<WindowWaiter>,
    /// Low-priority holders revoked beside an active high-priority job and still
    /// draining after `scheduler.revoke_grace_ms`, as the arbiter measured them (the
    /// interposers' own `overran` counts are what they admit to).
    pub measured_overruns: u64,
    /// GPU time those drains took past the grace, on the arbiter's clock (ms, ended
    /// drains only).
    pub measured_overrun_ms: u64,
    /// Leases that overran recently: granted only while no high-priority job is active.
    pub penalized_leases: Vec<LeaseId>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowWaiter {
    pub lease: LeaseId,
    pub pid: Option<u32>,
    /// The estimated GPU time of its waiting launch, in µs.
    pub need_us: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenHolder {
    pub lease: LeaseId,
    pub pid: Option<u32>,
    pub priority: Priority,
}

/// `ControlResponse::Timeline`: which lease held each GPU's token when. The shape
/// is a script's interface (`gpusharectl timeline --json`): fields are only added.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimelineReport {
    pub gpus: Vec<GpuTimeline>,
    /// Every lease that appears in a hold or still has token clients.
    pub leases: Vec<LeaseTokenTime>,
    /// The last memory reclaims (`[memory] reclaim`), oldest first; absent from an older
    /// arbiter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reclaims: Vec<ReclaimReport>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuTimeline {
    /// The GPU's UUID.
    pub gpu: String,
    /// Oldest first; a hold still going ends now.
    pub holds: Vec<TokenHold>,
}

/// One client's hold of a GPU's token, from its grant to its release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenHold {
    pub lease: LeaseId,
    /// The container's display name (see [`Lease::display_name`]).
    pub container: String,
    pub priority: Priority,
    pub start_unix_ms: u64,
    pub end_unix_ms: u64,
}

/// A lease's token time, summed over its GPUs and clients (gone ones included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseTokenTime {
    pub lease: LeaseId,
    pub container: String,
    pub priority: Priority,
    #[serde(alias = "gpu_time_ms")]
    pub token_time_ms: u64,
}
