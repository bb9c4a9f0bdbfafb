//! The genetic algorithm after Sun et al. alone, the bench's
//! baseline: the library's own (`batch::place_batch_genetic`, the one the
//! shipped hybrid runs after its local search), started from greedy's
//! assignment and random ones and evolving for the whole budget.

use std::time::Duration;

use gpushare_arbiter::balance::Weights;
use gpushare_arbiter::batch::{
    greedy, objective_of, place_batch_genetic, BatchGpu, BatchRequest, Objective,
};

/// How long, and how, to evolve.
#[derive(Clone, Copy)]
pub struct GaLimits {
    pub budget: Duration,
    pub population: usize,
    pub seed: u64,
}

pub struct GaResult {
    /// For each request, its GPU's index, or `None` (it waits).
    pub assignment: Vec<Option<usize>>,
    pub objective: Objective,
    pub greedy: Objective,
    pub generations: u32,
}

pub fn place_batch_ga(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
    limits: &GaLimits,
) -> GaResult {
    let evolved = place_batch_genetic(
        gpus,
        requests,
        weights,
        limits.budget,
        limits.population,
        limits.seed,
    );
    let greedy = objective_of(gpus, requests, weights, &greedy(gpus, requests, weights));
    GaResult {
        assignment: evolved.assignment,
        objective: evolved.objective,
        greedy,
        generations: evolved.generations,
    }
}
