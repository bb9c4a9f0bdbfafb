//! Messages on the arbiter's root-only control socket.

use serde::{Deserialize, Serialize};

use crate::lease::{Lease, LeaseId};
use crate::quantity::{Fraction, GpuSelector, MemoryRequest, Priority};

/// What an entry point (wrapper, hook, shim) asks for on behalf of a container.
/// Container id of a lease reserved before its container had one (see `Bind`).
/// The suffix is random: knowing it is what entitles the binder.
pub const PENDING_PREFIX: &str = "pending:";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReserveRequest {
    pub container_id: String,
    pub sandbox_id: Option<String>,
    pub priority: Priority,
    /// None: the configured default.
    pub memory: Option<MemoryRequest>,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
    pub gpu: GpuSelector,
    pub tenant: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// First message of every connection.
    Hello {
        protocol: u32,
    },
    Reserve(ReserveRequest),
    /// The container exists and this is its init pid (from the createRuntime hook).
    /// Keyed by the container id runc reports, never by an annotation the
    /// container's creator could have forged.
    Confirm {
        container_id: String,
        pid: u32,
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
    },
    Status,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ControlResponse {
    Hello { protocol: u32 },
    Reserved { lease: Lease },
    Confirmed,
    Released { existed: bool },
    Status(StatusReport),
    Error { kind: ErrorKind, message: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request itself is wrong (e.g. an index that does not exist).
    InvalidRequest,
    /// Valid, but nothing on this node can hold it.
    Unplaceable,
    NotFound,
    /// The peer broke the protocol; the connection is closed after this.
    Protocol,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    /// Sum of the memory quotas of the leases on this GPU.
    pub memory_leased: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub gpus: Vec<GpuStatus>,
    pub leases: Vec<Lease>,
}
