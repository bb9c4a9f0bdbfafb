//! Leases and usage for the text views' tests: only what a test varies is a parameter.

use gpushare_proto::{Fraction, Lease, LeaseId, LeaseState, LeaseUsage, Priority};

/// A confirmed lease of 4 GiB on `gpu`.
pub fn lease(id: &str, container_id: &str, gpu: &str, priority: Priority) -> Lease {
    Lease {
        id: LeaseId(id.into()),
        container_id: container_id.into(),
        namespace: None,
        sandbox_id: None,
        gpus: vec![gpu.into()],
        priority,
        memory_bytes: 4 << 30,
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        tenant: None,
        state: LeaseState::Confirmed,
        pid: None,
        created_unix_ms: 0,
        pod: None,
    }
}

/// The usage of lease `id` (quota 4 GiB) whose container the arbiter calls `container`:
/// `used` bytes, `token_ms` of token time, its token shares (10 s, 1 min) if it had
/// token clients.
pub fn usage(
    id: &str,
    container: &str,
    used: u64,
    token_ms: u64,
    shares: Option<(f64, f64)>,
) -> LeaseUsage {
    LeaseUsage {
        lease: LeaseId(id.into()),
        memory_used: used,
        memory_quota: 4 << 30,
        clients: vec![],
        cgroup: None,
        container: container.into(),
        token_time_ms: token_ms,
        token_share_10s: shares.map(|s| s.0),
        token_share_1m: shares.map(|s| s.1),
        memory_refusals: 0,
        token_revocations: 0,
        token_cut_offs: 0,
        token_overdue: 0,
    }
}
