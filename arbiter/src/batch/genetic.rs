//! The genetic algorithm after Sun et al. that `place_batch` runs when requests
//! are left waiting after its local search (see the batch module comment for
//! the measurements that put it there), and that the bench runs alone as the
//! baseline.
//!
//! An individual is an assignment (each request's GPU, or waiting), ranked by
//! the batch search's one order (`Objective::better_than`). Each generation keeps
//! the best `ELITES` and fills the rest with children of two tournament-selected
//! parents: uniform crossover, mutation (a gene to a random GPU or to waiting),
//! then `repair`, which enforces every hard rule with `may_take` and keeps
//! greedy's placed high-priority requests placed. The first population is the
//! seeds given (greedy's assignment, the local search's best) and random
//! assignments. The clock is checked before every child, and evolution also
//! stops after `STALE_GENERATIONS` generations without a better individual, so
//! an unreached budget gives a deterministic result.
//!
//! The population lives in two buffers allocated once per call (this runs under
//! the arbiter's state lock): a generation overwrites the other buffer's genes
//! and objectives in place.

use std::cmp::Ordering;
use std::time::Instant;

use gpushare_proto::Priority;

use super::{may_take, objective_of, BatchGpu, BatchRequest, Objective, SplitMix64};
use crate::balance::{cost, Load, Weights};

/// Individuals copied unchanged into the next generation.
const ELITES: usize = 2;
/// Each tournament picks the best of this many random individuals.
const TOURNAMENT: usize = 3;
/// Expected mutated genes per child.
const MUTATIONS_PER_CHILD: f64 = 2.0;
/// Of the mutated genes, the share set to waiting rather than a random GPU: it
/// lets a placed request make room for others (the repair then fills what fits).
const MUTATE_TO_WAITING: f64 = 0.2;
/// Evolution ends after this many generations in a row without a better
/// individual in `place_batch` (so an unreached budget gives a deterministic
/// result). At 64 × 16 a generation of 16 takes about 40 µs, so on the bench's
/// tight mix the budget ends it first in 197 of 200 calls; 100 placed +2.48
/// over greedy there, 300 +2.50.
pub const STALE_GENERATIONS: u32 = 300;
/// Population size: measured on the bench's tight mix (GA alone, 10 ms),
/// 8 placed +2.51 over greedy, 16 +2.52, 32 +2.50, 64 +2.21.
pub const POPULATION: usize = 16;

/// One batch to evolve assignments for.
pub struct Genetic<'p> {
    pub gpus: &'p [BatchGpu<'p>],
    pub requests: &'p [BatchRequest<'p>],
    pub weights: Weights,
    /// Greedy's assignment: where the pinned go when the repair cannot fit
    /// them all elsewhere.
    pub greedy: &'p [Option<usize>],
    /// Greedy placed it and it is high-priority: it never waits.
    pub pinned: &'p [bool],
}

/// What evolution reached.
#[derive(Debug, Clone, PartialEq)]
pub struct Evolved {
    pub assignment: Vec<Option<usize>>,
    pub objective: Objective,
    pub generations: u32,
    /// The deadline ended it (rather than `STALE_GENERATIONS`).
    pub budget_spent: bool,
}

#[derive(Clone)]
struct Individual {
    genes: Vec<Option<usize>>,
    objective: Objective,
}

/// The GPUs' loads as a repair places requests one by one.
pub(super) struct Fill {
    loads: Vec<Load>,
    highs: Vec<u32>,
}

impl<'p> Genetic<'p> {
    /// Evolves from `seeds` (at least one: greedy's assignment; each must keep
    /// every hard rule and the pins) plus
    /// random assignments, `population` individuals, until `deadline` or
    /// `stale` generations in a row without a better individual; returns the
    /// best individual seen (never worse than the best seed).
    pub fn evolve(
        &self,
        seeds: &[&[Option<usize>]],
        population: usize,
        stale_limit: u32,
        deadline: Instant,
        rng: &mut SplitMix64,
    ) -> Evolved {
        let size = population.max(ELITES + 1).max(seeds.len());
        let n = self.requests.len();
        let blank = || Individual {
            genes: vec![None; n],
            objective: Objective {
                high_placed: 0,
                placed: 0,
                served: vec![false; n],
                cost: 0.0,
            },
        };
        let mut current: Vec<Individual> = (0..size).map(|_| blank()).collect();
        let mut next: Vec<Individual> = (0..size).map(|_| blank()).collect();
        let mut order: Vec<usize> = Vec::with_capacity(size);
        let mut fill = Fill {
            loads: Vec::with_capacity(self.gpus.len()),
            highs: Vec::with_capacity(self.gpus.len()),
        };
        let mut waiting = Vec::with_capacity(n);
        let mut filled = 0;
        for seed in seeds {
            current[filled].genes.copy_from_slice(seed);
            current[filled].objective = objective_of(self.gpus, self.requests, &self.weights, seed);
            filled += 1;
        }
        let mut best = current[0].clone();
        for seed in &current[1..filled] {
            if seed.objective.better_than(&best.objective) {
                best.clone_from(seed);
            }
        }
        let mut budget_spent = false;
        while !self.gpus.is_empty() && filled < size {
            if Instant::now() >= deadline {
                budget_spent = true;
                break;
            }
            let child = &mut current[filled];
            for gene in child.genes.iter_mut() {
                *gene = Some(rng.below(self.gpus.len()));
            }
            self.repair(&mut child.genes, &mut fill, &mut waiting, rng);
            self.score(child, &fill);
            if child.objective.better_than(&best.objective) {
                best.clone_from(child);
            }
            filled += 1;
        }
        let mut generations = 0;
        let mut stale = 0;
        'evolve: while !budget_spent && filled > ELITES && stale < stale_limit {
            order.clear();
            order.extend(0..filled);
            order.sort_by(|&a, &b| rank(&current[b].objective, &current[a].objective));
            for (slot, &elite) in order[..ELITES].iter().enumerate() {
                next[slot].clone_from(&current[elite]);
            }
            let mut improved = false;
            for child in &mut next[ELITES..filled] {
                if Instant::now() >= deadline {
                    budget_spent = true;
                    break 'evolve;
                }
                let a = tournament(&current[..filled], rng);
                let b = tournament(&current[..filled], rng);
                for (gene, (x, y)) in child
                    .genes
                    .iter_mut()
                    .zip(current[a].genes.iter().zip(&current[b].genes))
                {
                    *gene = if rng.chance(0.5) { *x } else { *y };
                }
                self.mutate(&mut child.genes, rng);
                self.repair(&mut child.genes, &mut fill, &mut waiting, rng);
                self.score(child, &fill);
                if child.objective.better_than(&best.objective) {
                    best.clone_from(child);
                    improved = true;
                }
            }
            std::mem::swap(&mut current, &mut next);
            generations += 1;
            stale = if improved { 0 } else { stale + 1 };
        }
        // The cost in queue order, as every other objective of the batch is
        // summed (the repair's order differs by rounding only).
        let objective = objective_of(self.gpus, self.requests, &self.weights, &best.genes);
        Evolved {
            assignment: best.genes,
            objective,
            generations,
            budget_spent,
        }
    }

    fn mutate(&self, genes: &mut [Option<usize>], rng: &mut SplitMix64) {
        let rate = MUTATIONS_PER_CHILD / genes.len().max(1) as f64;
        for gene in genes.iter_mut() {
            if rng.chance(rate) {
                *gene = if rng.chance(MUTATE_TO_WAITING) {
                    None
                } else {
                    Some(rng.below(self.gpus.len()))
                };
            }
        }
    }

    /// The objective of `individual`'s genes, from the loads its repair left.
    fn score(&self, individual: &mut Individual, fill: &Fill) {
        let objective = &mut individual.objective;
        objective.high_placed = 0;
        objective.placed = 0;
        for ((served, gene), request) in objective
            .served
            .iter_mut()
            .zip(&individual.genes)
            .zip(self.requests)
        {
            *served = gene.is_some();
            if gene.is_some() {
                objective.placed += 1;
                objective.high_placed += usize::from(request.priority == Priority::High);
            }
        }
        objective.cost = fill.loads.iter().map(|l| cost(l, &self.weights)).sum();
    }

    /// Makes `genes` keep every hard rule: the pinned first (on their gene's
    /// GPU if it takes them, else the cheapest that does; if one fits nowhere,
    /// all of them where greedy had them), then the rest in queue order (a gene
    /// whose GPU no longer takes it moves to the cheapest that does, or waits),
    /// then every waiting request, in a random order, to the cheapest GPU that
    /// takes it. `fill` is left holding the result's loads.
    pub(super) fn repair(
        &self,
        genes: &mut [Option<usize>],
        fill: &mut Fill,
        waiting: &mut Vec<usize>,
        rng: &mut SplitMix64,
    ) {
        self.reset(fill);
        for (request, gene) in genes.iter_mut().enumerate() {
            if self.pinned[request] {
                *gene = self.keep_or_cheapest(fill, request, *gene);
            }
        }
        if (0..genes.len()).any(|r| self.pinned[r] && genes[r].is_none()) {
            self.reset(fill);
            for (request, gene) in genes.iter_mut().enumerate() {
                if self.pinned[request] {
                    *gene = self.greedy[request];
                    let gpu = gene.expect("pinned requests are placed by greedy");
                    self.put(fill, request, gpu);
                }
            }
        }
        for (request, gene) in genes.iter_mut().enumerate() {
            if !self.pinned[request] && gene.is_some() {
                *gene = self.keep_or_cheapest(fill, request, *gene);
            }
        }
        waiting.clear();
        waiting.extend((0..genes.len()).filter(|&r| genes[r].is_none()));
        for i in (1..waiting.len()).rev() {
            waiting.swap(i, rng.below(i + 1));
        }
        for &request in waiting.iter() {
            genes[request] = self.keep_or_cheapest(fill, request, None);
        }
    }

    fn reset(&self, fill: &mut Fill) {
        fill.loads.clear();
        fill.loads.extend(self.gpus.iter().map(|g| g.load));
        fill.highs.clear();
        fill.highs.resize(self.gpus.len(), 0);
    }

    fn takes(&self, fill: &Fill, request: usize, gpu: usize) -> bool {
        may_take(
            &self.gpus[gpu],
            &fill.loads[gpu],
            fill.highs[gpu],
            &self.requests[request],
        )
    }

    fn put(&self, fill: &mut Fill, request: usize, gpu: usize) {
        let r = &self.requests[request];
        fill.loads[gpu] = fill.loads[gpu].with(r.demand);
        fill.highs[gpu] += u32::from(r.priority == Priority::High);
    }

    /// `request` on `gene`'s GPU if it takes it, else on the one where it adds
    /// the least cost (lowest index on ties), else waiting.
    fn keep_or_cheapest(
        &self,
        fill: &mut Fill,
        request: usize,
        gene: Option<usize>,
    ) -> Option<usize> {
        let gpu = gene
            .filter(|&g| g < self.gpus.len() && self.takes(fill, request, g))
            .or_else(|| {
                let demand = self.requests[request].demand;
                let mut best: Option<(usize, f64)> = None;
                for g in 0..fill.loads.len() {
                    if !self.takes(fill, request, g) {
                        continue;
                    }
                    let load = &fill.loads[g];
                    let added = cost(&load.with(demand), &self.weights) - cost(load, &self.weights);
                    if best.is_none_or(|(_, b)| added < b) {
                        best = Some((g, added));
                    }
                }
                best.map(|(g, _)| g)
            })?;
        self.put(fill, request, gpu);
        Some(gpu)
    }
}

impl Fill {
    #[cfg(test)]
    pub(super) fn new() -> Fill {
        Fill {
            loads: Vec::new(),
            highs: Vec::new(),
        }
    }
}

/// `better_than` as a total order (cost by `total_cmp`), for sorting.
fn rank(a: &Objective, b: &Objective) -> Ordering {
    (a.high_placed, a.placed)
        .cmp(&(b.high_placed, b.placed))
        .then_with(|| a.served.cmp(&b.served))
        .then_with(|| b.cost.total_cmp(&a.cost))
}

/// The index of the best of `TOURNAMENT` random individuals.
fn tournament(population: &[Individual], rng: &mut SplitMix64) -> usize {
    let mut best = rng.below(population.len());
    for _ in 1..TOURNAMENT {
        let other = rng.below(population.len());
        if population[other]
            .objective
            .better_than(&population[best].objective)
        {
            best = other;
        }
    }
    best
}
