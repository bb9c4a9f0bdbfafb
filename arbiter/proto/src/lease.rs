//! A lease: what the arbiter granted one container.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::quantity::{Fraction, Priority};

/// Opaque, unique across arbiter restarts (random), safe as a directory name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseId(pub String);

impl LeaseId {
    /// Lease ids become directory names and annotation values: only `[a-z0-9-]`, bounded length.
    pub fn is_well_formed(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

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
}
