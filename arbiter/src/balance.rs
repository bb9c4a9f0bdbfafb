//! The balanced score: how loaded a GPU is, as one number, after Sun et
//! al.'s weighted resource scores. Shared by the balanced placement policy (one
//! request at a time) and the batch search (several waiting requests together), so
//! both optimise the same thing.
//!
//! A GPU's cost is a weighted sum of squares of its loads: memory (quotas over the
//! GPU's memory), compute (the expected demand of its leases, in GPUs: learnt from
//! measured GPU time, or the requests until measured) and job count (over a
//! normalising count). Squares make the cost convex, so adding a job to a lightly
//! loaded GPU always costs less than adding it to a loaded one: the policy spreads
//! while empty GPUs exist and co-locates only where the added load is small, which
//! is exactly when co-location pays. Minimising the sum over GPUs balances them.

/// The weights of the three loads (`[placement]` `memory_weight`, `compute_weight`,
/// `jobs_weight`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub memory: f64,
    pub compute: f64,
    pub jobs: f64,
}

/// Jobs on one GPU that count as a full load for the job-count term: Algorithm 1's
/// default `low_nums_limit`, the paper's cap on low-priority jobs per GPU.
pub const JOBS_AT_FULL_LOAD: f64 = 4.0;

/// One GPU's load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Load {
    /// What CUDA can allocate on the GPU (placement's `memory_allocatable`).
    pub memory_total: u64,
    pub memory_leased: u64,
    /// Expected GPU demand of its leases, in GPUs (0.6 = 60 % of one GPU's time).
    pub compute: f64,
    pub jobs: u32,
}

/// What one request adds to a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Demand {
    pub memory: u64,
    /// Expected GPU demand, in GPUs.
    pub compute: f64,
}

impl Load {
    pub fn with(self, demand: Demand) -> Load {
        Load {
            memory_total: self.memory_total,
            memory_leased: self.memory_leased.saturating_add(demand.memory),
            compute: self.compute + demand.compute,
            jobs: self.jobs + 1,
        }
    }
}

/// The cost of one GPU's load: 0 when idle, convex in each load.
pub fn cost(load: &Load, weights: &Weights) -> f64 {
    let memory = if load.memory_total == 0 {
        0.0
    } else {
        load.memory_leased as f64 / load.memory_total as f64
    };
    let jobs = f64::from(load.jobs) / JOBS_AT_FULL_LOAD;
    weights.memory * memory * memory
        + weights.compute * load.compute * load.compute
        + weights.jobs * jobs * jobs
}

/// What placing `demand` on a GPU of `load` adds to the total cost.
pub fn added_cost(load: &Load, demand: Demand, weights: &Weights) -> f64 {
    cost(&load.with(demand), weights) - cost(load, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const EVEN: Weights = Weights {
        memory: 1.0,
        compute: 1.0,
        jobs: 1.0,
    };

    fn gpu(leased_gib: u64, compute: f64, jobs: u32) -> Load {
        Load {
            memory_total: 80 * GIB,
            memory_leased: leased_gib * GIB,
            compute,
            jobs,
        }
    }

    #[test]
    fn an_idle_gpu_costs_nothing() {
        assert_eq!(cost(&gpu(0, 0.0, 0), &EVEN), 0.0);
    }

    #[test]
    fn a_job_costs_less_on_an_empty_gpu_than_beside_another() {
        let job = Demand {
            memory: 20 * GIB,
            compute: 0.6,
        };
        let empty = added_cost(&gpu(0, 0.0, 0), job, &EVEN);
        let shared = added_cost(&gpu(20, 0.6, 1), job, &EVEN);
        assert!(empty < shared, "{empty} vs {shared}");
    }

    #[test]
    fn a_light_job_costs_less_beside_a_light_job_than_a_heavy_one() {
        let light = Demand {
            memory: 4 * GIB,
            compute: 0.1,
        };
        let beside_light = added_cost(&gpu(4, 0.1, 1), light, &EVEN);
        let beside_heavy = added_cost(&gpu(40, 0.9, 1), light, &EVEN);
        assert!(beside_light < beside_heavy);
    }

    #[test]
    fn a_zero_weight_ignores_its_load() {
        let memory_only = Weights {
            memory: 1.0,
            compute: 0.0,
            jobs: 0.0,
        };
        assert_eq!(
            cost(&gpu(40, 5.0, 9), &memory_only),
            cost(&gpu(40, 0.0, 0), &memory_only)
        );
    }
}
