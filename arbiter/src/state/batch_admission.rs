//! The batch search in the admission pass (`placement.batch = true`):
//! when more than one request waits, `batch::place_batch` assigns the single-GPU
//! `count:` requests together before the queue is walked; each waiter then takes
//! its assigned GPU (the hard rules are checked again there), or keeps waiting
//! when the search left it out. Requests the search does not handle (explicit
//! GPUs, several GPUs, memory grants) and any whose assigned GPU no longer takes
//! them are placed one at a time as without the batch. The queue's order still
//! holds: a blocked high-priority request holds back the low ones behind it.

use std::time::Duration;

use super::*;
use crate::balance::Demand;
use crate::batch::{place_batch, BatchGpu, BatchRequest, SearchLimits};
use crate::placement::balanced::{self, load_of, Balanced};

/// The search's answer for one waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum BatchPlan {
    /// Not part of a batch: placed one at a time.
    #[default]
    Alone,
    /// This GPU (index into the inventory).
    On(usize),
    /// The search placed others instead: it waits for this pass.
    Waits,
}

impl Arbiter {
    /// Runs the batch search over the waiters and records each one's plan.
    pub(super) fn plan_batch(&self) {
        let views = self.balanced_views();
        let expected = self.expected_per_gpu();
        let gpus: Vec<BatchGpu> = views
            .iter()
            .zip(&expected)
            .map(|(v, &e)| BatchGpu {
                load: load_of(v, e),
                drained: v.drained,
                reserved_for: v.reserved_for,
                has_high_lease: v.high_leases > 0,
                runs_multi_gpu_lease: v.ungated_leases > 0,
            })
            .collect();
        let smallest = views
            .iter()
            .map(|v| v.memory_allocatable)
            .min()
            .unwrap_or(0);
        let waiters: Vec<&Waiter> = self.queue.iter().map(|w| &w.item).collect();
        let requests: Vec<BatchRequest> = waiters
            .iter()
            .map(|w| {
                let r = &w.request;
                let with_grant = r.pod.as_ref().is_some_and(|p| !p.grants.is_empty());
                BatchRequest {
                    priority: r.priority,
                    demand: Demand {
                        memory: self.memory_request(r).resolve(smallest),
                        compute: balanced::expected_demand(
                            r.priority,
                            r.compute_request.get(),
                            None,
                        ),
                    },
                    tenant: r.tenant.as_deref(),
                    any_gpu: matches!(r.gpu, gpushare_proto::GpuSelector::Count(1))
                        && !with_grant
                        && !w.reply.is_closed(),
                }
            })
            .collect();
        let limits =
            SearchLimits::with_budget(Duration::from_micros(self.placement.batch_budget_us));
        let batch = place_batch(&gpus, &requests, &self.weights(), &limits);
        for ((w, r), at) in waiters.iter().zip(&requests).zip(&batch.assignment) {
            w.batch.set(match (r.any_gpu, at) {
                (false, _) => BatchPlan::Alone,
                (true, Some(gpu)) => BatchPlan::On(*gpu),
                (true, None) => BatchPlan::Waits,
            });
        }
    }

    /// Places `request` on inventory GPU `gpu`, under the hard rules.
    pub(super) fn decide_on(
        &self,
        request: &placement::Request,
        gpu: usize,
    ) -> Result<placement::Placement, PlacementError> {
        let views = self.views();
        let only = gpushare_proto::GpuSelector::Index(vec![views[gpu].index]);
        let pinned = placement::Request {
            gpu: &only,
            ..*request
        };
        let p = placement::place_balanced(
            &pinned,
            &views,
            &[],
            0.0,
            &Balanced {
                weights: self.weights(),
            },
        )?;
        Ok(placement::Placement {
            gpus: vec![gpu],
            memory_bytes: p.memory_bytes,
        })
    }
}
