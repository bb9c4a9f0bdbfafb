//! Where a device plugin's memory grant is held: the pure decision.
//!
//! kube-scheduler admitted the pod by node totals of pooled units, so the node
//! alone picks the GPU, and `Allocate` must never fail for fragmentation (a failed
//! `Allocate` kills the pod). A grant is placed at once on the shared GPU with the
//! most free memory that can hold it (worst fit: it leaves the largest holes for
//! the grants that follow), or, when none can, recorded as waiting and placed as
//! soon as a release makes room.

use gpushare_proto::grant::GrantAmount;

use crate::placement::GpuView;

/// The resource a grant holds, as its `gpushare.io/` name ends (logs, errors and
/// metric labels).
pub fn resource_name(amount: &GrantAmount) -> &'static str {
    match amount {
        GrantAmount::Memory { .. } => "memory",
        GrantAmount::High => "high",
        GrantAmount::Compute { .. } => "compute",
    }
}

/// The GPU a memory grant of `bytes` is held on: an index into `gpus`, or None
/// (the grant waits). A GPU's `memory_leased` must already count the grants held
/// on it that no live lease uses yet (a bound grant's room is its lease's quota).
///
/// Drained GPUs take no new grants. GPUs reserved for a tenant take none either:
/// `Allocate` does not say which pod it is for, so the tenant is not known yet.
pub fn place_memory_grant(bytes: u64, gpus: &[GpuView]) -> Option<usize> {
    gpus.iter()
        .enumerate()
        .filter(|(_, g)| !g.drained && g.reserved_for.is_none() && g.memory_free() >= bytes)
        // Most free memory first; among equals the lowest index, so a decision
        // repeats exactly.
        .max_by_key(|(_, g)| (g.memory_free(), std::cmp::Reverse(g.index)))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, total_gib: u64, leased_gib: u64) -> GpuView<'static> {
        GpuView {
            index,
            uuid: "GPU-x",
            memory_allocatable: total_gib * GIB,
            memory_leased: leased_gib * GIB,
            lending: None,
            high_leases: 0,
            low_leases: 0,
            ungated_leases: 0,
            utilization: 0.0,
            drained: false,
            reserved_for: None,
        }
    }

    #[test]
    fn a_grant_goes_where_the_most_memory_is_free() {
        let gpus = [gpu(0, 80, 10), gpu(1, 80, 40), gpu(2, 80, 0)];
        assert_eq!(place_memory_grant(4 * GIB, &gpus), Some(2));
    }

    #[test]
    fn equal_holes_take_the_lowest_index() {
        let gpus = [gpu(0, 80, 20), gpu(1, 80, 20)];
        assert_eq!(place_memory_grant(GIB, &gpus), Some(0));
    }

    #[test]
    fn a_grant_no_single_gpu_can_hold_waits_though_the_node_total_could() {
        // 30 GiB free in all, 15 on each: a 20 GiB grant fits the node's total
        // (what kube-scheduler counted) but no GPU.
        let gpus = [gpu(0, 80, 65), gpu(1, 80, 65)];
        assert_eq!(place_memory_grant(20 * GIB, &gpus), None);
        assert_eq!(place_memory_grant(15 * GIB, &gpus), Some(0));
    }

    #[test]
    fn drained_and_reserved_gpus_take_no_grant() {
        let mut drained = gpu(0, 80, 0);
        drained.drained = true;
        let mut reserved = gpu(1, 80, 0);
        reserved.reserved_for = Some("team-a");
        let open = gpu(2, 80, 70);
        assert_eq!(
            place_memory_grant(GIB, &[drained.clone(), reserved.clone(), open]),
            Some(2)
        );
        assert_eq!(place_memory_grant(GIB, &[drained, reserved]), None);
    }
}
