//! A lease: what the arbiter granted one container.

use serde::{Deserialize, Serialize};

use crate::quantity::{Fraction, Priority};
pub use gpushare_types::lease_id::{BadLeaseId, LeaseId, LEASE_ID_FORM};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Granted, container not yet started.
    Reserved,
    /// The runtime reported the container's pid.
    Confirmed,
    /// Given back (poststop, shim, reconciliation or an operator). The arbiter
    /// drops released leases from its table; a lease-socket client whose lease
    /// was released hears this state so it can stop using the GPU.
    Released,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    pub id: LeaseId,
    pub container_id: String,
    /// The id space of `container_id` (see `ReserveRequest::namespace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub sandbox_id: Option<String>,
    /// Always UUIDs: indices can change across driver reloads.
    pub gpus: Vec<String>,
    pub priority: Priority,
    /// Resolved to bytes at placement, even when the request was a fraction.
    pub memory_bytes: u64,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
    pub tenant: Option<String>,
    pub state: LeaseState,
    pub pid: Option<u32>,
    pub created_unix_ms: u64,
    /// The container's pod and the grants it was reserved against (Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<crate::grant::PodBinding>,
}
