//! The batch search in the admission pass (`placement.batch = true`):
//! when more than one request waits, `batch::place_batch` assigns the single-GPU
//! `count:` requests together before the queue is walked; each waiter then takes
//! its assigned GPU (the hard rules are checked again there), or keeps waiting
//! when the search left it out. Requests the search does not handle (explicit
//! GPUs, several GPUs, memory grants) and any whose assigned GPU no longer takes
//! them are placed one at a time as without the batch. The queue's order still
//! holds: a blocked high-priority request holds back the low ones behind it.
//!
//! The search takes up to `placement.batch_budget_us` (10 ms by default) of CPU:
//! under the state's lock, every memory charge on the node would wait for it. So
//! behind an `ArbiterHandle` it runs off the lock: the admission pass copies its
//! inputs out (`BatchSearchJob`, owned and `Send`) and lets the queue wait; the
//! handle runs the job on the blocking pool and brings the outcome back under the
//! lock, where it is applied only if the leases and the waiters it was computed on
//! are still the same (`SearchBasis`), else searched again. After
//! `STALE_SEARCHES_APPLIED` stale outcomes in a row (a node whose leases change
//! faster than a search ends) the last one is applied anyway: it is only advice,
//! since every placement it suggests is checked against the hard rules again.
//! Without a runtime to search on (unit tests, tools) the search runs in place.

use std::time::{Duration, Instant};

use super::*;
use crate::balance::{Demand, Weights};
use crate::batch::{place_batch, BatchGpu, BatchRequest, SearchLimits};
use crate::placement::balanced::{self, load_of, Balanced};

/// After this many outcomes in a row found stale, the next one is applied as it is.
const STALE_SEARCHES_APPLIED: u32 = 3;

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

/// What a search was computed on: the last lease change recorded, and the waiters
/// (by queue ticket). Utilisation samples are left out: they move the balanced
/// cost a little every second and would make every outcome stale.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SearchBasis {
    last_change: Option<Ticket>,
    waiters: Vec<u64>,
}

/// Where the off-the-lock search stands.
#[derive(Debug, Default)]
pub(super) struct BatchSearch {
    /// Searches run off the lock (set by the handle when a runtime is there).
    off_the_lock: bool,
    /// An admission pass is waiting for a search.
    wanted: bool,
    /// A job is out (taken by `batch_search_to_start`, not finished yet).
    running: bool,
    /// Outcomes found stale in a row.
    stale_in_a_row: u32,
    /// A finished search's outcome, for the next admission pass.
    ready: Option<BatchOutcome>,
}

/// A waiter's part in the search, owned.
#[derive(Debug, Clone)]
struct JobRequest {
    priority: Priority,
    demand: Demand,
    tenant: Option<String>,
    any_gpu: bool,
}

/// A GPU's part in the search, owned.
#[derive(Debug, Clone)]
struct JobGpu {
    gpu: BatchGpu<'static>,
    reserved_for: Option<String>,
}

/// The batch search's inputs, copied out of the state: it runs without the lock.
#[derive(Debug, Clone)]
pub struct BatchSearchJob {
    basis: SearchBasis,
    gpus: Vec<JobGpu>,
    requests: Vec<JobRequest>,
    weights: Weights,
    limits: SearchLimits,
}

/// A finished search: each waiter's plan, by queue ticket.
#[derive(Debug, Clone)]
pub struct BatchOutcome {
    basis: SearchBasis,
    plans: Vec<(u64, BatchPlan)>,
    took: Duration,
}

impl BatchSearchJob {
    /// The search itself: pure CPU, no state.
    pub fn run(self) -> BatchOutcome {
        let started = Instant::now();
        let gpus: Vec<BatchGpu> = self
            .gpus
            .iter()
            .map(|g| BatchGpu {
                reserved_for: g.reserved_for.as_deref(),
                ..g.gpu
            })
            .collect();
        let requests: Vec<BatchRequest> = self
            .requests
            .iter()
            .map(|r| BatchRequest {
                priority: r.priority,
                demand: r.demand,
                tenant: r.tenant.as_deref(),
                any_gpu: r.any_gpu,
            })
            .collect();
        let batch = place_batch(&gpus, &requests, &self.weights, &self.limits);
        let plans = self
            .basis
            .waiters
            .iter()
            .zip(&self.requests)
            .zip(&batch.assignment)
            .map(|((&seq, r), at)| {
                let plan = match (r.any_gpu, at) {
                    (false, _) => BatchPlan::Alone,
                    (true, Some(gpu)) => BatchPlan::On(*gpu),
                    (true, None) => BatchPlan::Waits,
                };
                (seq, plan)
            })
            .collect();
        BatchOutcome {
            basis: self.basis,
            plans,
            took: started.elapsed(),
        }
    }
}

impl Arbiter {
    /// Whether the batch search runs off the lock (the handle's choice; see the module doc).
    pub fn set_batch_search_off_the_lock(&mut self, off: bool) {
        self.batch_search.off_the_lock = off;
    }

    fn search_basis(&self) -> SearchBasis {
        SearchBasis {
            last_change: self.last_ticket,
            waiters: self.queue.iter().map(|w| w.seq).collect(),
        }
    }

    /// Copies the search's inputs out of the state.
    pub(super) fn batch_search_job(&self) -> BatchSearchJob {
        let views = self.balanced_views();
        let expected = self.expected_per_gpu();
        let gpus = views
            .iter()
            .zip(&expected)
            .map(|(v, &e)| JobGpu {
                gpu: BatchGpu {
                    load: load_of(v, e),
                    drained: v.drained,
                    reserved_for: None,
                    has_high_lease: v.high_leases > 0,
                    runs_multi_gpu_lease: v.ungated_leases > 0,
                },
                reserved_for: v.reserved_for.map(str::to_owned),
            })
            .collect();
        let smallest = views
            .iter()
            .map(|v| v.memory_allocatable)
            .min()
            .unwrap_or(0);
        let requests = self
            .queue
            .iter()
            .map(|w| {
                let r = &w.item.request;
                let with_grant = r.pod.as_ref().is_some_and(|p| !p.grants.is_empty());
                JobRequest {
                    priority: r.priority,
                    demand: Demand {
                        memory: self.memory_request(r).resolve(smallest),
                        compute: balanced::expected_demand(
                            r.priority,
                            r.compute_request.get(),
                            None,
                        ),
                    },
                    tenant: r.tenant.clone(),
                    any_gpu: matches!(r.gpu, gpushare_proto::GpuSelector::Count(1))
                        && !with_grant
                        && !w.item.reply.is_closed(),
                }
            })
            .collect();
        BatchSearchJob {
            basis: self.search_basis(),
            gpus,
            requests,
            weights: self.weights(),
            limits: SearchLimits::with_budget(Duration::from_micros(
                self.placement.batch_budget_us,
            )),
        }
    }

    /// Gives each waiter its plan for this admission pass. False when the plan is
    /// being searched for off the lock: the queue waits for it.
    pub(super) fn plan_batch(&mut self) -> bool {
        if !self.batch_search.off_the_lock {
            let outcome = self.batch_search_job().run();
            self.apply_batch(outcome);
            return true;
        }
        let search = &mut self.batch_search;
        match search.ready.take() {
            Some(outcome)
                if search.stale_in_a_row >= STALE_SEARCHES_APPLIED
                    || outcome.basis == self.search_basis() =>
            {
                self.batch_search.stale_in_a_row = 0;
                self.apply_batch(outcome);
                true
            }
            Some(_) => {
                self.batch_search.stale_in_a_row += 1;
                self.batch_search.wanted = true;
                false
            }
            None => {
                self.batch_search.wanted = true;
                false
            }
        }
    }

    fn apply_batch(&mut self, outcome: BatchOutcome) {
        self.admission_record.batch_searched(outcome.took);
        for waiting in self.queue.iter() {
            let plan = outcome
                .plans
                .iter()
                .find(|(seq, _)| *seq == waiting.seq)
                .map_or(BatchPlan::Alone, |(_, plan)| *plan);
            waiting.item.batch.set(plan);
        }
    }

    /// The search an admission pass is waiting for, once: the caller runs it
    /// without the lock and hands the outcome to `finish_batch_search`.
    pub fn batch_search_to_start(&mut self) -> Option<BatchSearchJob> {
        let search = &mut self.batch_search;
        if !search.wanted || search.running {
            return None;
        }
        search.wanted = false;
        search.running = true;
        Some(self.batch_search_job())
    }

    /// A search's outcome (None: it could not run; from then on the search runs in
    /// place, as without a runtime), and the admission pass that waited for it.
    pub fn finish_batch_search(&mut self, outcome: Option<BatchOutcome>) {
        let search = &mut self.batch_search;
        search.running = false;
        search.wanted = false;
        match outcome {
            Some(outcome) => search.ready = Some(outcome),
            None => search.off_the_lock = false,
        }
        self.run_admission();
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

#[cfg(test)]
mod tests;
