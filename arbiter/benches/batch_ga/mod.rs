//! A genetic algorithm after Sun et al., built only to measure the shipped batch
//! search against (issue 18); it does not ship in the arbiter.
//!
//! An individual is an assignment (each request's GPU, or waiting), ranked by the
//! shipped search's own order (`Objective::better_than`: high-priority placed,
//! placed, queue order, total balanced cost). Each generation keeps the best
//! `ELITES`, and fills the rest with children of two tournament-selected parents:
//! uniform crossover, then mutation (a gene to a random GPU or to waiting), then
//! the repair that enforces every hard rule with the shipped `may_take`. The
//! first population is greedy's assignment and random ones; the clock is checked
//! before every child, and the best individual seen is returned.

use std::cmp::Ordering;
use std::time::{Duration, Instant};

use gpushare_arbiter::balance::{cost, Load, Weights};
use gpushare_arbiter::batch::{greedy, may_take, objective_of, BatchGpu, BatchRequest, Objective};
use gpushare_proto::Priority;

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

/// Individuals copied unchanged into the next generation.
const ELITES: usize = 2;
/// Each tournament picks the best of this many random individuals.
const TOURNAMENT: usize = 3;
/// Expected mutated genes per child.
const MUTATIONS_PER_CHILD: f64 = 2.0;
/// Of the mutated genes, the share set to waiting rather than a random GPU: it
/// lets a placed request make room for others (the repair then fills what fits).
const MUTATE_TO_WAITING: f64 = 0.2;

struct Individual {
    genes: Vec<Option<usize>>,
    objective: Objective,
}

struct Problem<'p> {
    gpus: &'p [BatchGpu<'p>],
    requests: &'p [BatchRequest<'p>],
    weights: Weights,
    greedy: Vec<Option<usize>>,
    /// Greedy placed it and it is high-priority: it never waits.
    pinned: Vec<bool>,
}

pub fn place_batch_ga(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
    limits: &GaLimits,
) -> GaResult {
    let deadline = Instant::now() + limits.budget;
    let greedy = greedy(gpus, requests, weights);
    let pinned = requests
        .iter()
        .zip(&greedy)
        .map(|(r, at)| at.is_some() && r.priority == Priority::High)
        .collect();
    let problem = Problem {
        gpus,
        requests,
        weights: *weights,
        greedy,
        pinned,
    };
    let mut rng = XorShift(limits.seed | 1);
    let greedy_objective = objective_of(gpus, requests, weights, &problem.greedy);
    let mut population = vec![problem.evaluate(problem.greedy.clone())];
    while !gpus.is_empty()
        && population.len() < limits.population.max(ELITES + 1)
        && Instant::now() < deadline
    {
        let mut genes: Vec<Option<usize>> = requests
            .iter()
            .map(|_| Some(rng.below(gpus.len())))
            .collect();
        problem.repair(&mut genes, &mut rng);
        population.push(problem.evaluate(genes));
    }
    let mut generations = 0;
    'evolve: while population.len() > ELITES && Instant::now() < deadline {
        population.sort_by(|a, b| rank(&b.objective, &a.objective));
        let mut next: Vec<Individual> = population[..ELITES.min(population.len())]
            .iter()
            .map(|i| Individual {
                genes: i.genes.clone(),
                objective: i.objective.clone(),
            })
            .collect();
        while next.len() < population.len() {
            if Instant::now() >= deadline {
                break 'evolve;
            }
            let a = tournament(&population, &mut rng);
            let b = tournament(&population, &mut rng);
            let mut genes: Vec<Option<usize>> = a
                .genes
                .iter()
                .zip(&b.genes)
                .map(|(x, y)| if rng.chance(0.5) { *x } else { *y })
                .collect();
            let rate = MUTATIONS_PER_CHILD / genes.len().max(1) as f64;
            for gene in genes.iter_mut() {
                if rng.chance(rate) {
                    *gene = if rng.chance(MUTATE_TO_WAITING) {
                        None
                    } else {
                        Some(rng.below(gpus.len()))
                    };
                }
            }
            problem.repair(&mut genes, &mut rng);
            next.push(problem.evaluate(genes));
        }
        population = next;
        generations += 1;
    }
    let best = population
        .into_iter()
        .reduce(|best, i| {
            if i.objective.better_than(&best.objective) {
                i
            } else {
                best
            }
        })
        .expect("the population holds greedy's assignment");
    GaResult {
        assignment: best.genes,
        objective: best.objective,
        greedy: greedy_objective,
        generations,
    }
}

/// `better_than` as a total order (cost by `total_cmp`), for sorting.
fn rank(a: &Objective, b: &Objective) -> Ordering {
    (a.high_placed, a.placed)
        .cmp(&(b.high_placed, b.placed))
        .then_with(|| a.served.cmp(&b.served))
        .then_with(|| b.cost.total_cmp(&a.cost))
}

fn tournament<'i>(population: &'i [Individual], rng: &mut XorShift) -> &'i Individual {
    let mut best = &population[rng.below(population.len())];
    for _ in 1..TOURNAMENT {
        let other = &population[rng.below(population.len())];
        if other.objective.better_than(&best.objective) {
            best = other;
        }
    }
    best
}

impl Problem<'_> {
    fn evaluate(&self, genes: Vec<Option<usize>>) -> Individual {
        let objective = objective_of(self.gpus, self.requests, &self.weights, &genes);
        Individual { genes, objective }
    }

    /// Makes `genes` keep every hard rule: the pinned first (on their gene's GPU
    /// if it takes them, else the cheapest that does, else all of them where
    /// greedy had them), then the rest in queue order (a gene whose GPU no longer
    /// takes it moves to the cheapest that does, or waits), then every waiting
    /// request, in a random order, to the cheapest GPU that takes it.
    fn repair(&self, genes: &mut [Option<usize>], rng: &mut XorShift) {
        let mut fill = Fill::new(self);
        for (request, gene) in genes.iter_mut().enumerate() {
            if self.pinned[request] {
                *gene = fill.keep_or_cheapest(request, *gene);
            }
        }
        if (0..genes.len()).any(|r| self.pinned[r] && genes[r].is_none()) {
            fill = Fill::new(self);
            for (request, gene) in genes.iter_mut().enumerate() {
                if self.pinned[request] {
                    *gene = self.greedy[request];
                    fill.put(request, gene.expect("pinned requests are placed by greedy"));
                }
            }
        }
        for (request, gene) in genes.iter_mut().enumerate() {
            if !self.pinned[request] {
                *gene = match *gene {
                    Some(_) => fill.keep_or_cheapest(request, *gene),
                    None => None,
                };
            }
        }
        let mut waiting: Vec<usize> = (0..genes.len()).filter(|&r| genes[r].is_none()).collect();
        for i in (1..waiting.len()).rev() {
            waiting.swap(i, rng.below(i + 1));
        }
        for request in waiting {
            genes[request] = fill.keep_or_cheapest(request, None);
        }
    }
}

/// The GPUs' loads as a repair places requests one by one.
struct Fill<'f, 'p> {
    problem: &'f Problem<'p>,
    loads: Vec<Load>,
    highs: Vec<u32>,
}

impl<'f, 'p> Fill<'f, 'p> {
    fn new(problem: &'f Problem<'p>) -> Self {
        Fill {
            problem,
            loads: problem.gpus.iter().map(|g| g.load).collect(),
            highs: vec![0; problem.gpus.len()],
        }
    }

    fn takes(&self, request: usize, gpu: usize) -> bool {
        may_take(
            &self.problem.gpus[gpu],
            &self.loads[gpu],
            self.highs[gpu],
            &self.problem.requests[request],
        )
    }

    fn put(&mut self, request: usize, gpu: usize) {
        let r = &self.problem.requests[request];
        self.loads[gpu] = self.loads[gpu].with(r.demand);
        self.highs[gpu] += u32::from(r.priority == Priority::High);
    }

    /// `request` on `gene`'s GPU if it takes it, else on the one where it adds
    /// the least cost, else waiting.
    fn keep_or_cheapest(&mut self, request: usize, gene: Option<usize>) -> Option<usize> {
        let gpu = gene.filter(|&g| self.takes(request, g)).or_else(|| {
            let demand = self.problem.requests[request].demand;
            let weights = &self.problem.weights;
            (0..self.loads.len())
                .filter(|&g| self.takes(request, g))
                .map(|g| {
                    let added =
                        cost(&self.loads[g].with(demand), weights) - cost(&self.loads[g], weights);
                    (g, added)
                })
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(g, _)| g)
        })?;
        self.put(request, gpu);
        Some(gpu)
    }
}

/// Marsaglia's xorshift64: the GA only needs varied, reproducible draws.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}
