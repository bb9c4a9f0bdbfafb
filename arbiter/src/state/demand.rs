//! What the balanced policy sees: each GPU's utilisation over the
//! short window `placement.utilization_window_ms`, and each lease's expected
//! demand, learnt from the time its clients held the time-slice token. The
//! decision itself is `placement::place_balanced` (pure); this gathers its input.

use gpushare_config::{PlacementConfig, PlacementPolicy};

use super::*;
use crate::balance::Weights;
use crate::placement::balanced::{self, Balanced};

/// A lease's held time must have been watched for this share of the window
/// before it counts as measured: a share over a second or two of a 5 s window
/// says more about when the job started than about what it needs.
const MEASURED_AFTER_WINDOW_SHARE: f64 = 0.5;

impl Arbiter {
    /// Which placement policy decides, with its weights and window.
    pub fn set_placement(&mut self, placement: PlacementConfig) {
        let window = Duration::from_millis(placement.utilization_window_ms);
        self.telemetry.set_recent_window(window);
        tracing::info!(policy = ?placement.policy, batch = placement.batch, window_ms = placement.utilization_window_ms, "placement");
        self.placement = placement;
    }

    pub fn placement(&self) -> &PlacementConfig {
        &self.placement
    }

    fn window(&self) -> Duration {
        Duration::from_millis(self.placement.utilization_window_ms)
    }

    /// Reads every lease's held token time (called with each NVML sample).
    pub(super) fn record_held_time(&mut self, now: Instant) {
        if let Some(tokens) = self.tokens.clone() {
            self.record_holdings(now, tokens.holdings());
        }
    }

    /// Takes one reading of each lease's held time, summed over its clients;
    /// leases with no token client any more are forgotten.
    pub(super) fn record_holdings(&mut self, now: Instant, holdings: Vec<crate::tokens::Holding>) {
        let window = self.window();
        self.telemetry.record_holdings(now, holdings, window);
    }

    /// The lease's share of a GPU's time over the window, once watched long enough.
    fn measured_share(&self, lease: &Lease) -> Option<f64> {
        let span = self.telemetry.held_span(&lease.id)?;
        let min_span = self.window().as_secs_f64() * MEASURED_AFTER_WINDOW_SHARE;
        // Held time summed over the lease's GPUs: per GPU, as placement counts it.
        let gpus = lease.gpus.len().max(1) as u64;
        balanced::held_share(
            (0.0, span.first_ns / gpus),
            (span.watched.as_secs_f64(), span.last_ns / gpus),
            min_span,
        )
    }

    /// The lease's expected demand, in GPUs (see `balanced::expected_demand`).
    pub(super) fn expected_demand(&self, lease: &Lease) -> f64 {
        balanced::expected_demand(
            lease.priority,
            lease.compute_request.get(),
            self.measured_share(lease),
        )
    }

    /// Expected demand of the leases on each GPU, in inventory order.
    pub(super) fn expected_per_gpu(&self) -> Vec<f64> {
        let mut expected = vec![0.0; self.inventory.gpus.len()];
        for record in self.leases.values() {
            let demand = self.expected_demand(&record.lease);
            for uuid in &record.lease.gpus {
                if let Some(i) = self.inventory.gpus.iter().position(|g| &g.uuid == uuid) {
                    expected[i] += demand;
                }
            }
        }
        expected
    }

    /// Whether `request`, which cannot be placed now, waits for memory that is
    /// free on the node but split across GPUs (the fragmentation metric).
    pub(super) fn waits_for_fragmented_memory(&self, request: &ReserveRequest) -> bool {
        let memory = match self.granted_memory(request) {
            Some(bytes) => MemoryRequest::Bytes(bytes),
            None => self.memory_request(request),
        };
        let views = self.views();
        let open: Vec<&GpuView> = views
            .iter()
            .filter(|v| {
                !v.drained
                    && (v.reserved_for.is_none() || v.reserved_for == request.tenant.as_deref())
            })
            .collect();
        let Some(smallest) = open.iter().map(|v| v.memory_allocatable).min() else {
            return false;
        };
        let free: Vec<u64> = open.iter().map(|v| v.memory_free()).collect();
        placement::memory_fragmented(&free, memory.resolve(smallest), request.gpu.gpu_count())
    }

    pub fn waits_fragmented(&self) -> u64 {
        self.admission_record.waits_fragmented()
    }

    /// Rebalancing hints for status: each GPU's expected demand and largest hole.
    pub(super) fn placement_hints(&self) -> Vec<gpushare_proto::message::GpuPlacementHint> {
        let expected = self.expected_per_gpu();
        self.views()
            .iter()
            .zip(expected)
            .enumerate()
            .map(
                |(i, (v, expected_demand))| gpushare_proto::message::GpuPlacementHint {
                    uuid: v.uuid.to_owned(),
                    expected_demand,
                    largest_free_hole: largest_free_hole(
                        v.memory_allocatable,
                        v.memory_leased,
                        self.telemetry.memory_used(i),
                    ),
                },
            )
            .collect()
    }

    /// Places one request with the configured policy.
    pub(super) fn decide(
        &self,
        request: &placement::Request,
        compute_request: f64,
    ) -> Result<placement::Placement, PlacementError> {
        match self.placement.policy {
            PlacementPolicy::Wang => placement::place(request, &self.views(), &self.policy()),
            PlacementPolicy::Balanced => placement::place_balanced(
                request,
                &self.balanced_views(),
                &self.expected_per_gpu(),
                balanced::expected_demand(request.priority, compute_request, None),
                &Balanced {
                    weights: self.weights(),
                },
            ),
        }
    }

    /// The GPUs as the balanced policy sees them: utilisation over the short window.
    pub(super) fn balanced_views(&self) -> Vec<GpuView<'_>> {
        let now = Instant::now();
        let mut views = self.views();
        for (i, view) in views.iter_mut().enumerate() {
            view.utilization = self.telemetry.recent_utilization(i, now).unwrap_or(0.0);
        }
        views
    }

    pub(super) fn weights(&self) -> Weights {
        Weights {
            memory: self.placement.memory_weight,
            compute: self.placement.compute_weight,
            jobs: self.placement.jobs_weight,
        }
    }
}

/// The largest quota a new lease could get on a GPU: memory no lease or grant
/// was promised, less anything NVML sees in use beyond the promises (processes
/// outside gpushare, or a driver's own reservation).
fn largest_free_hole(total: u64, leased: u64, used: Option<u64>) -> u64 {
    let unpromised = total.saturating_sub(leased);
    match used {
        Some(used) => unpromised.min(total.saturating_sub(used)),
        None => unpromised,
    }
}

#[cfg(test)]
mod tests {
    use super::largest_free_hole;

    #[test]
    fn the_largest_hole_is_unpromised_and_unused() {
        // (total, leased, used, hole)
        let table: &[(u64, u64, Option<u64>, u64)] = &[
            (16, 4, None, 12),
            (16, 4, Some(2), 12),
            (16, 4, Some(10), 6),
            (16, 20, Some(1), 0),
            (16, 0, Some(17), 0),
        ];
        for &(total, leased, used, want) in table {
            assert_eq!(
                largest_free_hole(total, leased, used),
                want,
                "{total} {leased} {used:?}"
            );
        }
    }
}
