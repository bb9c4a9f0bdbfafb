//! The batch placement search: places several waiting single-GPU
//! requests together, minimising the balanced score (`balance::cost` summed over
//! GPUs) that the balanced policy minimises one request at a time.
//!
//! # Objective
//!
//! Lexicographic, best first: (1) high-priority requests placed, (2) requests
//! placed, (3) queue order: at the first request in the queue that one assignment
//! places and the other leaves waiting, the one placing it wins, so a request never
//! waits only so that a later one runs more cheaply, (4) the total of
//! `balance::cost` over all GPUs after the assignment (lower is better). A placed
//! request is worth more than any cost difference, and a placed high-priority
//! request more than any number of low-priority ones. `Objective::better_than` is
//! this order, and the only one: the search, its never-worse-than-greedy guard
//! and the bench's comparison with a genetic algorithm all rank by it.
//!
//! # Priority order
//!
//! The greedy order (queue order, each request to the GPU where it adds the least
//! cost) is computed first. Every high-priority request it places is *pinned*: the
//! search may move it to another GPU but never leaves it waiting, so no low-priority
//! request can take the room a high-priority one had under greedy. On top of that,
//! objective (1) ranks any extra high-priority placement above every low one.
//!
//! # Method
//!
//! A hybrid of local search and Sun et al.'s genetic algorithm, chosen because
//! neither alone was best on every family the bench measures (below).
//!
//! 1. Greedy, then best-improvement local search over insertions (place a
//!    waiting request), promotions (a waiting high-priority request takes a
//!    low-priority one's place), ejection chains (move a placed request away so
//!    a waiting one fits), trades (one placed request waits so that more waiting
//!    ones fit) and cost moves (relocate one request, swap two), each evaluated
//!    in O(1) from the two GPUs it touches.
//! 2. If a count may still improve (`State::counts_may_improve`: a waiting
//!    request some GPU would take if it ran nothing of the batch) and the batch
//!    is not small, the genetic algorithm (`genetic`: population 16, tournament
//!    of 3, uniform crossover, about 2 mutated genes a child, a fifth of them to
//!    waiting, 2 elites, the repair by `may_take` that keeps greedy's placed
//!    highs placed and fills every waiting request that fits, in a random order,
//!    where it adds the least cost) starts from greedy's assignment, the local
//!    search's best and random ones, and evolves until a fortieth of the budget
//!    before the search's deadline or `STALE_GENERATIONS` generations without a
//!    better individual. Its best is polished by the local search (the cost
//!    moves above all) and kept if it beats the local search's best.
//! 3. Seeded random kicks (relocate a few placed requests), each followed by
//!    the local search and up to `ROOM_TRIES` make-room moves (a random waiting
//!    request takes a random GPU, evicting unpinned requests there in a random
//!    order until it fits; the evicted and the other waiting requests then go,
//!    in a random order, where they add the least cost), until `patience` kicks
//!    in a row found nothing better or the deadline. Where nothing can be
//!    placed more (the light mix), this is all the time goes to: there the
//!    genetic algorithm loses on cost in every instance measured.
//! 4. Batches small enough (at most a million assignments) are then searched
//!    exhaustively by branch and bound, with the best so far as the bound to
//!    beat, because on small batches local search measurably misses the optimum
//!    (see `EXACT_ASSIGNMENTS`).
//!
//! The score is convex and separable per GPU, so relocations and swaps reach a
//! good cost quickly; placing more requests needs several moves at once, which
//! is what the genetic algorithm's random-order refills and the make-room moves
//! are for (the cost-led moves keep the GPUs balanced, which leaves no GPU room
//! enough for a large request).
//!
//! # Measured
//!
//! `cargo bench -p gpushare-arbiter --bench batch`, release, commit b8af39f
//! with `STALE_GENERATIONS` 300 and the genetic algorithm stopping a fortieth of
//! the budget before the deadline (this commit): 200 instances a family, the
//! same instances and 10 ms budget for every mode, on a 2-core machine shared
//! with other work (load average 1.6 at the start, 1.5 at the end). Thread CPU
//! time is the figure for the bound. All figures are in
//! `tests/bench/results/batch.json`; "better"/"worse" count instances by the one
//! order (`Objective::better_than`). `kicks_only` is the search before the
//! hybrid (`SearchLimits::genetic` false, commit b428119); `ga_population_16` is
//! the genetic algorithm alone for the whole budget (`place_batch_genetic`).
//!
//! - Tight (64 requests on 16 GPUs, 1-40 GiB, more than fits): requests placed
//!   over greedy, a call on average: local search alone +1.36, kicks only
//!   +1.92, the hybrid +2.50, the GA alone +2.53 (16) and +2.46 (8). The hybrid
//!   against the GA (16): better in 125, worse in 75, never equal; 0.03 fewer
//!   requests placed a call; where both placed the same requests (72), its cost
//!   is 0.63 % lower. Against the kicks only: better in 167, worse in 27, +0.59
//!   placed a call. So on this mix the hybrid still places slightly fewer than
//!   the GA alone on average (0.03 a call, about 1 % of the gain over greedy),
//!   which has the whole 10 ms where the hybrid's GA has about 8.8 ms after the
//!   local search, and wins most instances on the cost. An earlier setting
//!   (100 stale generations, a twentieth left for the polish) placed +2.48
//!   (GA +2.53 in the same run, hybrid better in 120, worse in 80).
//!   The hybrid spends the budget here (CPU p50 9.80 ms, p99 9.81 ms, max
//!   9.82 ms; the kicks only: p50 3.6 ms, p99 9.8 ms): the admission pass waits
//!   that long whenever a request is left waiting that might fit.
//! - Light (1-16 GiB, everything fits but the highs beyond one a GPU, so only
//!   the cost differs): the genetic algorithm does not run; the hybrid equals
//!   the kicks only in 200 of 200 (cost 1.15 % below greedy's; CPU p50 2.9 ms,
//!   p99 6.6 ms, max 8.6 ms) and is better than the GA alone in 200 of 200
//!   (cost 0.28 % below the GA's (16), 0.25 % below the GA's (8)).
//! - Small (8 requests on 4 GPUs, so the exact search runs and the genetic
//!   algorithm does not): cost 3.68 % below greedy's (CPU p50 1.6 ms, p99
//!   4.4 ms, max 5.05 ms); against the GA (16) equal in 187 and better in 13,
//!   never worse (the exact optimum).
//!
//! The genetic algorithm's figures before it moved into the library (bench-only
//! at commit b428119, the same operators): +2.51 (8), +2.52 (16), +2.50 (32),
//! +2.21 (64) on the tight mix; about 3,300 children in 10 ms at 16 (3 µs a
//! child, O(requests) each), against the local search's passes that clone
//! states and rescan. Tried on the tight mix before the hybrid, without closing
//! the gap to the GA: ruin-and-recreate kicks, a smallest-first best-fit
//! restart, make-room moves before the kicks, more make-room tries a kick; and
//! for the hybrid, kicks first (up to 30 % of the budget) then the GA: +2.58
//! against +2.63 with the GA first (60 instances).
//!
//! # Bounds
//!
//! Greedy is the starting point and the fallback: the search only ever replaces
//! its best assignment with a better one, and the never-worse-than-greedy guard
//! is checked last, so the result is never worse than greedy. The search's own
//! deadline is a fiftieth of the budget inside it (`DEADLINE_MARGIN`); the clock
//! is checked before every genetic child, every kick, every make-room move,
//! every local-search pass, every row of the move scans and every 256 nodes of
//! the exact search, so the call ends inside the budget (the bench's largest
//! CPU time of a call, 9.82 ms of 10, in 600 calls), preemption aside. Given a
//! seed and a budget that is not reached (kicks stop after `patience` in a row
//! found nothing better, the genetic algorithm after `STALE_GENERATIONS`
//! generations without a better individual), the result is deterministic: the
//! genetic algorithm draws from its own SplitMix64 seeded with
//! `SearchLimits::seed` xor `GENETIC_SEED`, the kicks from one seeded with
//! `SearchLimits::seed`. Under a tight budget it depends on how far the search
//! got.

mod genetic;

use std::cmp::Ordering;
use std::time::{Duration, Instant};

use gpushare_proto::Priority;

use crate::balance::{cost, Demand, Load, Weights};
pub use genetic::{Evolved, POPULATION, STALE_GENERATIONS};

/// What the search needs to know about one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchGpu<'a> {
    pub load: Load,
    pub drained: bool,
    /// Only this tenant's requests may go here.
    pub reserved_for: Option<&'a str>,
    /// It already runs a high-priority lease (at most one per GPU).
    pub has_high_lease: bool,
    /// It runs a multi-GPU lease, which is not time-sliced: nothing would protect
    /// a high-priority job placed beside it.
    pub runs_multi_gpu_lease: bool,
}

/// One waiting request, in queue order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchRequest<'a> {
    pub priority: Priority,
    /// Its memory quota (bytes) and expected compute demand.
    pub demand: Demand,
    pub tenant: Option<&'a str>,
    /// A single-GPU `count:1` request that may go on any GPU. Others (explicit
    /// GPUs, several GPUs) are left to the greedy path: the search never places
    /// them.
    pub any_gpu: bool,
}

/// How long, and how, to search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchLimits {
    /// `placement.batch_budget_us`.
    pub budget: Duration,
    pub seed: u64,
    /// Stop after this many kicks in a row that found nothing better (0: the
    /// local search alone).
    pub patience: u32,
    /// Run the genetic algorithm when requests are left waiting after the
    /// local search (the default; false: the local search with kicks alone,
    /// the search before the hybrid, kept for the bench's comparison).
    pub genetic: bool,
}

/// Measured on the bench (64 × 16): 20 reaches nearly all that 50 or 200 do
/// (see the module comment) and mostly finishes well inside the 10 ms budget,
/// which the admission pass waits for.
pub const DEFAULT_PATIENCE: u32 = 20;
const DEFAULT_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

impl SearchLimits {
    pub fn with_budget(budget: Duration) -> SearchLimits {
        SearchLimits {
            budget,
            seed: DEFAULT_SEED,
            patience: DEFAULT_PATIENCE,
            genetic: true,
        }
    }
}

/// The lexicographic objective (see the module comment), with all it needs to
/// rank two assignments of the same batch: `better_than` is the search's one
/// order.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub high_placed: usize,
    pub placed: usize,
    /// For each request in queue order, whether it is placed: between equal
    /// counts, the assignment placing the first request the other leaves waiting
    /// wins, whatever the cost.
    pub served: Vec<bool>,
    /// The total of `balance::cost` over every GPU, batch included.
    pub cost: f64,
}

/// Cost differences below this are rounding, not improvement: without it two
/// assignments of equal cost could swap forever.
const COST_EPSILON: f64 = 1e-9;

impl Objective {
    /// Counts (high-priority placed, then placed), then queue order (`served`),
    /// then cost. Only objectives of the same batch compare meaningfully.
    pub fn better_than(&self, other: &Objective) -> bool {
        let counts = (self.high_placed, self.placed);
        let others = (other.high_placed, other.placed);
        match counts
            .cmp(&others)
            .then_with(|| self.served.cmp(&other.served))
        {
            Ordering::Greater => true,
            Ordering::Less => false,
            Ordering::Equal => self.cost < other.cost - COST_EPSILON,
        }
    }
}

/// The objective of any assignment of `requests` (for each, in queue order, its
/// GPU's index or `None`), without checking the hard rules (`may_take` does):
/// for comparing another search with this one.
pub fn objective_of(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
    assignment: &[Option<usize>],
) -> Objective {
    let mut loads: Vec<Load> = gpus.iter().map(|g| g.load).collect();
    let mut objective = Objective {
        high_placed: 0,
        placed: 0,
        served: assignment.iter().map(Option::is_some).collect(),
        cost: 0.0,
    };
    for (request, at) in requests.iter().zip(assignment) {
        if let Some(gpu) = *at {
            loads[gpu] = loads[gpu].with(request.demand);
            objective.placed += 1;
            objective.high_placed += usize::from(request.priority == Priority::High);
        }
    }
    objective.cost = loads.iter().map(|l| cost(l, weights)).sum();
    objective
}

/// The greedy order's assignment (queue order, each request to the GPU where it
/// adds the least cost): where `place_batch` starts and what it never does worse
/// than. Its placed high-priority requests are the ones the search never leaves
/// waiting.
pub fn greedy(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
) -> Vec<Option<usize>> {
    let mut state = State::new(gpus, requests, *weights);
    state.greedy();
    state.at
}

/// The hard rules: whether `gpu`, whose load (batch included) is `load` with
/// `batch_highs` of the batch's high-priority requests on it, may take `request`.
pub fn may_take(gpu: &BatchGpu, load: &Load, batch_highs: u32, request: &BatchRequest) -> bool {
    if !request.any_gpu || gpu.drained {
        return false;
    }
    if gpu.reserved_for.is_some() && gpu.reserved_for != request.tenant {
        return false;
    }
    if request.priority == Priority::High
        && (gpu.has_high_lease || gpu.runs_multi_gpu_lease || batch_highs > 0)
    {
        return false;
    }
    load.memory_leased
        .checked_add(request.demand.memory)
        .is_some_and(|m| m <= load.memory_total)
}

/// The search's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// For each request, in the order given, its GPU's index, or `None` (it waits).
    pub assignment: Vec<Option<usize>>,
    pub objective: Objective,
    /// What the greedy order reached, for comparison.
    pub greedy: Objective,
    /// The budget ran out before the search finished its kicks.
    pub budget_spent: bool,
}

/// Places `requests` on `gpus` within `limits.budget` (see the module comment).
pub fn place_batch(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
    limits: &SearchLimits,
) -> Batch {
    let start = Instant::now();
    let deadline = start
        + limits
            .budget
            .saturating_sub(limits.budget / DEADLINE_MARGIN);
    let mut state = State::new(gpus, requests, *weights);
    state.greedy();
    let greedy = state.objective();
    for (request, at) in state.at.iter().enumerate() {
        state.pinned[request] = at.is_some() && requests[request].priority == Priority::High;
    }
    let greedy_state = state.clone();
    let mut budget_spent = !state.local_search(deadline);
    if !state.keeps_pinned() || greedy.better_than(&state.objective()) {
        state.clone_from(&greedy_state);
    }
    let mut best = state.clone();
    let mut rng = SplitMix64(limits.seed);
    // Small batches get the exact search below; where no count can improve,
    // the genetic algorithm measurably loses to the kicks on cost.
    if limits.genetic
        && !budget_spent
        && !is_small(gpus.len(), requests)
        && best.counts_may_improve()
    {
        let polish_from = deadline
            .checked_sub(limits.budget / POLISH_SHARE)
            .unwrap_or(deadline);
        let evolved = genetic::Genetic {
            gpus,
            requests,
            weights: *weights,
            greedy: &greedy_state.at,
            pinned: &greedy_state.pinned,
        }
        .evolve(
            &[&greedy_state.at, &best.at],
            POPULATION,
            STALE_GENERATIONS,
            polish_from,
            &mut SplitMix64(limits.seed ^ GENETIC_SEED),
        );
        state.clone_from(&greedy_state);
        for (request, at) in evolved.assignment.iter().enumerate() {
            state.assign(request, *at);
        }
        budget_spent = !state.local_search(deadline);
        if state.keeps_pinned() && state.beats(&best) {
            best.clone_from(&state);
        }
        state.clone_from(&best);
    }
    if !budget_spent {
        budget_spent = kick_until(&mut state, &mut best, &mut rng, limits.patience, deadline);
    }
    if !budget_spent && is_small(gpus.len(), requests) {
        let mut exact = State::new(gpus, requests, *weights);
        exact.pinned.clone_from(&best.pinned);
        let mut nodes = 0;
        budget_spent = !exact.branch_and_bound(0, &mut best, deadline, &mut nodes);
    }
    // The guarantee, checked last and by the search's whole order (counts, then
    // queue order, then cost): never return less than greedy's result.
    if !best.keeps_pinned() || greedy_state.beats(&best) {
        best = greedy_state;
    }
    Batch {
        objective: best.objective(),
        assignment: best.at,
        greedy,
        budget_spent,
    }
}

/// The genetic algorithm alone, as Sun et al. use it: greedy's assignment and
/// random ones to start, `population` individuals, evolving until `budget` is
/// spent (no stop on stale generations). Not what `place_batch` runs: the
/// bench's baseline.
pub fn place_batch_genetic(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    weights: &Weights,
    budget: Duration,
    population: usize,
    seed: u64,
) -> Evolved {
    let deadline = Instant::now() + budget;
    let greedy = greedy(gpus, requests, weights);
    let pinned: Vec<bool> = requests
        .iter()
        .zip(&greedy)
        .map(|(r, at)| at.is_some() && r.priority == Priority::High)
        .collect();
    genetic::Genetic {
        gpus,
        requests,
        weights: *weights,
        greedy: &greedy,
        pinned: &pinned,
    }
    .evolve(
        &[&greedy],
        population,
        u32::MAX,
        deadline,
        &mut SplitMix64(seed),
    )
}

/// Seeded random kicks, each followed by local search and make-room moves,
/// from `best`, until `patience` kicks in a row found nothing better or `until`;
/// `best` is the best assignment seen. True if the clock stopped it.
fn kick_until<'s>(
    state: &mut State<'s>,
    best: &mut State<'s>,
    rng: &mut SplitMix64,
    patience: u32,
    until: Instant,
) -> bool {
    let mut fruitless = 0;
    while fruitless < patience {
        if Instant::now() >= until {
            return true;
        }
        state.kick(rng);
        let mut spent = !state.local_search(until);
        let mut improved = state.keeps_pinned() && state.beats(best);
        if improved {
            best.clone_from(state);
        }
        for _ in 0..ROOM_TRIES {
            if spent || Instant::now() >= until {
                spent = true;
                break;
            }
            state.clone_from(best);
            if state.make_room(rng) && state.beats(best) {
                spent = !state.local_search(until);
                if state.keeps_pinned() {
                    best.clone_from(state);
                    improved = true;
                }
                break;
            }
        }
        state.clone_from(best);
        if spent {
            return true;
        }
        if improved {
            fruitless = 0;
        } else {
            fruitless += 1;
        }
    }
    false
}

/// The search stops this share of the budget early (a fiftieth: 200 µs of
/// 10 ms), so that the last clock check's row, the exact search's last 256
/// nodes and the guard after it end inside the budget.
const DEADLINE_MARGIN: u32 = 50;

/// The genetic algorithm stops this share of the budget (a fortieth: 250 µs of
/// 10 ms) before the search's deadline, leaving it to the local search that
/// polishes its best and the kicks. Measured on the tight mix with 300 stale
/// generations, against a twentieth with 100: +2.50 placed over greedy against
/// +2.48 (the module comment).
const POLISH_SHARE: u32 = 40;

/// Mixed into `SearchLimits::seed` for the genetic algorithm's own generator,
/// so its draws differ from the kicks'.
const GENETIC_SEED: u64 = 0x2545_f491_4f6c_dd1d;

/// Batches whose every assignment (each request on a GPU or waiting) number at
/// most this are searched exhaustively after the local search, with its result as
/// the bound to beat. Measured against exhaustive search on 300 instances of 6
/// requests × 3 GPUs, the local search with kicks alone placed fewer than the
/// optimum in 8 and missed its cost in 74 more (2.1 % above it on average over
/// the instances where it placed as many); with this, none.
const EXACT_ASSIGNMENTS: f64 = 1e6;

/// Make-room attempts after each kick (until one finds something better).
/// Measured on the bench's tight mix (30 instances): 16 placed +2.23 over
/// greedy, 64 +2.13 (fewer kicks in the budget).
const ROOM_TRIES: usize = 16;

fn is_small(gpus: usize, requests: &[BatchRequest]) -> bool {
    let free = requests.iter().filter(|r| r.any_gpu).count();
    (gpus as f64 + 1.0).powi(free as i32) <= EXACT_ASSIGNMENTS
}

#[derive(Clone)]
struct State<'s> {
    gpus: &'s [BatchGpu<'s>],
    requests: &'s [BatchRequest<'s>],
    weights: Weights,
    at: Vec<Option<usize>>,
    /// Greedy placed it and it is high-priority: it may move, never wait.
    pinned: Vec<bool>,
    loads: Vec<Load>,
    /// High-priority requests of this batch on each GPU.
    highs: Vec<u32>,
    costs: Vec<f64>,
}

/// `Objective` without `served`.
#[derive(Clone, Copy)]
struct Tally {
    high_placed: usize,
    placed: usize,
    cost: f64,
}

/// A GPU's load and batch high-priority count without one of its requests.
struct Without {
    load: Load,
    highs: u32,
}

impl<'s> State<'s> {
    fn new(gpus: &'s [BatchGpu<'s>], requests: &'s [BatchRequest<'s>], weights: Weights) -> Self {
        let loads: Vec<Load> = gpus.iter().map(|g| g.load).collect();
        let costs = loads.iter().map(|l| cost(l, &weights)).collect();
        State {
            gpus,
            requests,
            weights,
            at: vec![None; requests.len()],
            pinned: vec![false; requests.len()],
            loads,
            highs: vec![0; gpus.len()],
            costs,
        }
    }

    fn objective(&self) -> Objective {
        objective_of(self.gpus, self.requests, &self.weights, &self.at)
    }

    /// The objective's counts and cost, without the allocation `served` needs:
    /// for the exhaustive search's every node and the trades' every trial.
    fn tally(&self) -> Tally {
        let mut tally = Tally {
            high_placed: 0,
            placed: 0,
            cost: self.costs.iter().sum(),
        };
        for (request, at) in self.at.iter().enumerate() {
            if at.is_some() {
                tally.placed += 1;
                tally.high_placed += usize::from(self.is_high(request));
            }
        }
        tally
    }

    /// Which of two assignments serves the queue first among the first `upto`
    /// requests: at the first request placed by one and waiting in the other,
    /// the one that places it is `Greater`.
    fn queue_order(&self, other: &State, upto: usize) -> Ordering {
        let placed =
            |at: &[Option<usize>]| at[..upto].iter().map(Option::is_some).collect::<Vec<_>>();
        placed(&self.at).cmp(&placed(&other.at))
    }

    fn beats(&self, other: &State) -> bool {
        self.objective().better_than(&other.objective())
    }

    /// Whether another assignment might place more: a waiting low-priority
    /// request that some GPU would take if it ran nothing of the batch, or a
    /// waiting high-priority one while fewer of the batch's highs are placed
    /// than there are GPUs that may take one. Without it, a batch where every
    /// GPU already holds a high (the bench's light mix) would run the genetic
    /// algorithm for nothing.
    fn counts_may_improve(&self) -> bool {
        let high_gpus = (0..self.gpus.len())
            .filter(|&g| {
                self.requests.iter().any(|r| {
                    r.priority == Priority::High
                        && may_take(&self.gpus[g], &self.gpus[g].load, 0, r)
                })
            })
            .count();
        let high_placed = self.tally().high_placed;
        self.requests.iter().zip(&self.at).any(|(r, at)| {
            at.is_none()
                && (0..self.gpus.len()).any(|g| may_take(&self.gpus[g], &self.gpus[g].load, 0, r))
                && (r.priority == Priority::Low || high_placed < high_gpus)
        })
    }

    /// Every request greedy placed with high priority is still placed.
    fn keeps_pinned(&self) -> bool {
        self.pinned
            .iter()
            .zip(&self.at)
            .all(|(pinned, at)| !pinned || at.is_some())
    }

    fn is_high(&self, request: usize) -> bool {
        self.requests[request].priority == Priority::High
    }

    /// Whether `request` may go on `gpu` whose load (batch included) is `load`
    /// with `highs` of this batch's high-priority requests.
    fn fits(&self, request: usize, gpu: usize, load: &Load, highs: u32) -> bool {
        may_take(&self.gpus[gpu], load, highs, &self.requests[request])
    }

    fn fits_now(&self, request: usize, gpu: usize) -> bool {
        self.fits(request, gpu, &self.loads[gpu], self.highs[gpu])
    }

    fn without(&self, request: usize, gpu: usize) -> Without {
        let load = self.loads[gpu];
        let demand = self.requests[request].demand;
        Without {
            load: Load {
                memory_total: load.memory_total,
                memory_leased: load.memory_leased.saturating_sub(demand.memory),
                compute: load.compute - demand.compute,
                jobs: load.jobs.saturating_sub(1),
            },
            highs: self.highs[gpu] - u32::from(self.is_high(request)),
        }
    }

    fn cost_with(&self, request: usize, load: &Load) -> f64 {
        cost(&load.with(self.requests[request].demand), &self.weights)
    }

    /// Recomputes `gpu`'s load from scratch, so moves never accumulate rounding.
    fn refresh(&mut self, gpu: usize) {
        let mut load = self.gpus[gpu].load;
        let mut highs = 0;
        for (request, at) in self.at.iter().enumerate() {
            if *at == Some(gpu) {
                load = load.with(self.requests[request].demand);
                highs += u32::from(self.is_high(request));
            }
        }
        self.loads[gpu] = load;
        self.highs[gpu] = highs;
        self.costs[gpu] = cost(&load, &self.weights);
    }

    fn assign(&mut self, request: usize, to: Option<usize>) {
        let from = std::mem::replace(&mut self.at[request], to);
        for gpu in [from, to].into_iter().flatten() {
            self.refresh(gpu);
        }
    }

    /// The GPU where `request` adds the least cost now (lowest index on ties).
    fn cheapest_gpu(&self, request: usize) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for gpu in 0..self.gpus.len() {
            if !self.fits_now(request, gpu) {
                continue;
            }
            let added = self.cost_with(request, &self.loads[gpu]) - self.costs[gpu];
            if best.is_none_or(|(_, b)| added < b) {
                best = Some((gpu, added));
            }
        }
        best.map(|(gpu, _)| gpu)
    }

    /// Depth-first over requests `from..`, each on every GPU that takes it (cheapest
    /// first) or waiting (unless pinned), pruning where even placing every
    /// remaining request cannot beat `best` (cost only grows as requests are
    /// added). False if the deadline stopped it.
    fn branch_and_bound(
        &mut self,
        from: usize,
        best: &mut State<'s>,
        deadline: Instant,
        nodes: &mut u64,
    ) -> bool {
        *nodes += 1;
        if nodes.is_multiple_of(256) && Instant::now() >= deadline {
            return false;
        }
        let now = self.tally();
        let rest = &self.requests[from..];
        let could_place = rest.iter().filter(|r| r.any_gpu).count();
        let could_place_high = rest
            .iter()
            .filter(|r| r.any_gpu && r.priority == Priority::High)
            .count();
        let ceiling = (now.high_placed + could_place_high, now.placed + could_place);
        let to_beat = best.tally();
        let best_counts = (to_beat.high_placed, to_beat.placed);
        // At the ceiling every remaining request is placed, so a prefix equal to
        // the best's means the same placed set, where only the cost can differ.
        let prefix = self.queue_order(best, from);
        if ceiling < best_counts
            || (ceiling == best_counts
                && (prefix == Ordering::Less
                    || (prefix == Ordering::Equal && now.cost >= to_beat.cost - COST_EPSILON)))
        {
            return true;
        }
        if from == self.requests.len() {
            if self.beats(best) {
                best.clone_from(self);
            }
            return true;
        }
        let mut gpus: Vec<(usize, f64)> = (0..self.gpus.len())
            .filter(|&gpu| self.fits_now(from, gpu))
            .map(|gpu| {
                (
                    gpu,
                    self.cost_with(from, &self.loads[gpu]) - self.costs[gpu],
                )
            })
            .collect();
        gpus.sort_by(|a, b| a.1.total_cmp(&b.1));
        for (gpu, _) in gpus {
            self.assign(from, Some(gpu));
            let finished = self.branch_and_bound(from + 1, best, deadline, nodes);
            self.assign(from, None);
            if !finished {
                return false;
            }
        }
        if self.pinned[from] {
            return true;
        }
        self.branch_and_bound(from + 1, best, deadline, nodes)
    }

    /// Queue order, each request to its lowest-added-cost GPU.
    fn greedy(&mut self) {
        for request in 0..self.requests.len() {
            if let Some(gpu) = self.cheapest_gpu(request) {
                self.assign(request, Some(gpu));
            }
        }
    }

    /// Improves until no move helps; false if the deadline stopped it first.
    fn local_search(&mut self, deadline: Instant) -> bool {
        loop {
            if Instant::now() >= deadline {
                return false;
            }
            let improved = self.insert_waiting()
                || self.promote_high()
                || self.eject_to_insert(deadline)
                || self.trade_one_for_more(deadline)
                || self.best_cost_move(deadline);
            if !improved {
                return true;
            }
        }
    }

    /// A waiting request that fits somewhere now goes there (high first: queue
    /// order within the batch).
    fn insert_waiting(&mut self) -> bool {
        let mut order: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r].is_none())
            .collect();
        order.sort_by_key(|&r| !self.is_high(r));
        for request in order {
            if let Some(gpu) = self.cheapest_gpu(request) {
                self.assign(request, Some(gpu));
                return true;
            }
        }
        false
    }

    /// A waiting high-priority request takes a placed low-priority one's place.
    fn promote_high(&mut self) -> bool {
        for high in 0..self.requests.len() {
            if self.at[high].is_some() || !self.is_high(high) {
                continue;
            }
            for low in 0..self.requests.len() {
                let Some(gpu) = self.at[low] else { continue };
                if self.is_high(low) {
                    continue;
                }
                let without = self.without(low, gpu);
                if self.fits(high, gpu, &without.load, without.highs) {
                    self.assign(low, None);
                    self.assign(high, Some(gpu));
                    return true;
                }
            }
        }
        false
    }

    /// A waiting request fits on `gpu` once a placed one moves from there to
    /// another GPU: one more placed request.
    fn eject_to_insert(&mut self, deadline: Instant) -> bool {
        for waiting in 0..self.requests.len() {
            if self.at[waiting].is_some() || !self.requests[waiting].any_gpu {
                continue;
            }
            if Instant::now() >= deadline {
                return false;
            }
            for moved in 0..self.requests.len() {
                let Some(gpu) = self.at[moved] else { continue };
                let without = self.without(moved, gpu);
                if !self.fits(waiting, gpu, &without.load, without.highs) {
                    continue;
                }
                let target = (0..self.gpus.len())
                    .filter(|&other| other != gpu && self.fits_now(moved, other))
                    .min_by(|&a, &b| {
                        let added =
                            |g: usize| self.cost_with(moved, &self.loads[g]) - self.costs[g];
                        added(a).total_cmp(&added(b))
                    });
                if let Some(target) = target {
                    self.assign(moved, Some(target));
                    self.assign(waiting, Some(gpu));
                    return true;
                }
            }
        }
        false
    }

    /// A placed request waits so that more waiting ones (or more high-priority
    /// ones) fit. Only the counts decide: a request never waits for one behind it
    /// in the queue merely to lower the cost, and the pinned never wait.
    fn trade_one_for_more(&mut self, deadline: Instant) -> bool {
        let waiting: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r].is_none() && self.requests[r].any_gpu)
            .collect();
        if waiting.is_empty() {
            return false;
        }
        let now = self.tally();
        let counts = |t: &Tally| (t.high_placed, t.placed);
        for dropped in 0..self.requests.len() {
            let Some(gpu) = self.at[dropped] else {
                continue;
            };
            if self.pinned[dropped] {
                continue;
            }
            if Instant::now() >= deadline {
                return false;
            }
            // Insertion already failed everywhere: only the GPU it leaves changes.
            let without = self.without(dropped, gpu);
            if !waiting
                .iter()
                .any(|&w| self.fits(w, gpu, &without.load, without.highs))
            {
                continue;
            }
            let mut trial = self.clone();
            trial.assign(dropped, None);
            for &request in &waiting {
                if let Some(gpu) = trial.cheapest_gpu(request) {
                    trial.assign(request, Some(gpu));
                }
            }
            if counts(&trial.tally()) > counts(&now) {
                *self = trial;
                return true;
            }
        }
        false
    }

    /// The relocation or swap of placed requests that lowers the cost most (of
    /// those seen before the deadline).
    fn best_cost_move(&mut self, deadline: Instant) -> bool {
        enum Move {
            Relocate(usize, usize),
            Swap(usize, usize),
        }
        let mut best: Option<(Move, f64)> = None;
        let n = self.requests.len();
        for request in 0..n {
            // A row is at most requests + GPUs evaluations (a few microseconds at
            // 64 × 16): the finest check that costs nothing measurable.
            if Instant::now() >= deadline {
                break;
            }
            let Some(from) = self.at[request] else {
                continue;
            };
            let without = self.without(request, from);
            let freed = cost(&without.load, &self.weights) - self.costs[from];
            for to in 0..self.gpus.len() {
                if to == from || !self.fits_now(request, to) {
                    continue;
                }
                let delta = freed + self.cost_with(request, &self.loads[to]) - self.costs[to];
                if delta < -COST_EPSILON && best.as_ref().is_none_or(|(_, b)| delta < *b) {
                    best = Some((Move::Relocate(request, to), delta));
                }
            }
            for other in request + 1..n {
                let Some(other_gpu) = self.at[other] else {
                    continue;
                };
                if other_gpu == from {
                    continue;
                }
                let other_without = self.without(other, other_gpu);
                if !self.fits(request, other_gpu, &other_without.load, other_without.highs)
                    || !self.fits(other, from, &without.load, without.highs)
                {
                    continue;
                }
                let delta = self.cost_with(other, &without.load) - self.costs[from]
                    + self.cost_with(request, &other_without.load)
                    - self.costs[other_gpu];
                if delta < -COST_EPSILON && best.as_ref().is_none_or(|(_, b)| delta < *b) {
                    best = Some((Move::Swap(request, other), delta));
                }
            }
        }
        match best {
            Some((Move::Relocate(request, to), _)) => self.assign(request, Some(to)),
            Some((Move::Swap(a, b), _)) => {
                let (gpu_a, gpu_b) = (self.at[a], self.at[b]);
                self.at[a] = gpu_b;
                self.at[b] = gpu_a;
                for gpu in [gpu_a, gpu_b].into_iter().flatten() {
                    self.refresh(gpu);
                }
            }
            None => return false,
        }
        true
    }

    /// A random waiting request goes on a random GPU, evicting unpinned
    /// requests there (in a random order) until it fits; then the evicted and
    /// every other waiting request, in a random order, go where they add the
    /// least cost, if anywhere. False if the GPU could not be made to take it.
    fn make_room(&mut self, rng: &mut SplitMix64) -> bool {
        let waiting: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r].is_none() && self.requests[r].any_gpu)
            .collect();
        if waiting.is_empty() || self.gpus.is_empty() {
            return false;
        }
        let request = waiting[rng.below(waiting.len())];
        let gpu = rng.below(self.gpus.len());
        let mut there: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r] == Some(gpu) && !self.pinned[r])
            .collect();
        shuffle(&mut there, rng);
        while !self.fits_now(request, gpu) {
            let Some(evicted) = there.pop() else {
                return false;
            };
            self.assign(evicted, None);
        }
        self.assign(request, Some(gpu));
        let mut waiting: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r].is_none() && self.requests[r].any_gpu)
            .collect();
        shuffle(&mut waiting, rng);
        for request in waiting {
            if let Some(gpu) = self.cheapest_gpu(request) {
                self.assign(request, Some(gpu));
            }
        }
        true
    }

    /// Moves one to three placed requests to random GPUs that take them.
    fn kick(&mut self, rng: &mut SplitMix64) {
        let placed: Vec<usize> = (0..self.requests.len())
            .filter(|&r| self.at[r].is_some())
            .collect();
        if placed.is_empty() {
            return;
        }
        for _ in 0..1 + rng.below(3) {
            let request = placed[rng.below(placed.len())];
            let from = self.at[request];
            let targets: Vec<usize> = (0..self.gpus.len())
                .filter(|&g| Some(g) != from && self.fits_now(request, g))
                .collect();
            if !targets.is_empty() {
                self.assign(request, Some(targets[rng.below(targets.len())]));
            }
        }
    }
}

fn shuffle(items: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// A small seeded generator (Steele, Lea and Flood's SplitMix64): the kicks only
/// need to be varied and reproducible, not strong.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;
    const EVEN: Weights = Weights {
        memory: 1.0,
        compute: 1.0,
        jobs: 1.0,
    };
    const COMPUTE_ONLY: Weights = Weights {
        memory: 0.0,
        compute: 1.0,
        jobs: 0.0,
    };
    const AMPLE: Duration = Duration::from_secs(30);

    fn gpu(leased_gib: u64, compute: f64, jobs: u32) -> BatchGpu<'static> {
        BatchGpu {
            load: Load {
                memory_total: 80 * GIB,
                memory_leased: leased_gib * GIB,
                compute,
                jobs,
            },
            ..BatchGpu::default()
        }
    }

    fn empty() -> BatchGpu<'static> {
        gpu(0, 0.0, 0)
    }

    fn request(priority: Priority, gib: u64, compute: f64) -> BatchRequest<'static> {
        BatchRequest {
            priority,
            demand: Demand {
                memory: gib * GIB,
                compute,
            },
            tenant: None,
            any_gpu: true,
        }
    }

    fn high(gib: u64) -> BatchRequest<'static> {
        request(Priority::High, gib, 0.5)
    }

    fn low(gib: u64) -> BatchRequest<'static> {
        request(Priority::Low, gib, 0.5)
    }

    fn place(gpus: &[BatchGpu], requests: &[BatchRequest], weights: &Weights) -> Batch {
        let batch = place_batch(gpus, requests, weights, &SearchLimits::with_budget(AMPLE));
        assert_eq!(rule_broken(gpus, requests, &batch.assignment), None);
        batch
    }

    /// The first hard rule `assignment` breaks, independently of the search's code.
    fn rule_broken(
        gpus: &[BatchGpu],
        requests: &[BatchRequest],
        assignment: &[Option<usize>],
    ) -> Option<String> {
        for (i, g) in gpus.iter().enumerate() {
            let on: Vec<&BatchRequest> = requests
                .iter()
                .zip(assignment)
                .filter(|(_, at)| **at == Some(i))
                .map(|(r, _)| r)
                .collect();
            let memory: u64 = on.iter().map(|r| r.demand.memory).sum();
            let highs = on.iter().filter(|r| r.priority == Priority::High).count();
            if g.load.memory_leased + memory > g.load.memory_total {
                return Some(format!("gpu {i}: memory over"));
            }
            if g.drained && !on.is_empty() {
                return Some(format!("gpu {i}: drained but given work"));
            }
            if highs + usize::from(g.has_high_lease) > 1 && highs > 0 {
                return Some(format!("gpu {i}: two high-priority leases"));
            }
            if g.runs_multi_gpu_lease && highs > 0 {
                return Some(format!("gpu {i}: high beside a multi-GPU lease"));
            }
            if g.reserved_for.is_some() && on.iter().any(|r| r.tenant != g.reserved_for) {
                return Some(format!("gpu {i}: another tenant on a reserved GPU"));
            }
            if on.iter().any(|r| !r.any_gpu) {
                return Some(format!("gpu {i}: a request not for the batch placed"));
            }
        }
        None
    }

    #[test]
    fn a_request_goes_only_where_its_memory_fits() {
        let gpus = [gpu(70, 0.0, 1), gpu(50, 0.9, 3), gpu(79, 0.0, 0)];
        let batch = place(&gpus, &[low(20), low(81)], &EVEN);
        assert_eq!(batch.assignment, [Some(1), None]);
    }

    #[test]
    fn a_gpu_takes_at_most_one_high_priority_lease_counting_existing_ones() {
        let mut busy = empty();
        busy.has_high_lease = true;
        let batch = place(&[busy, empty()], &[high(1), high(1), low(1)], &EVEN);
        assert_eq!(batch.assignment[0], Some(1));
        assert_eq!(batch.assignment[1], None, "the second high waits");
        assert!(batch.assignment[2].is_some(), "a low may join either GPU");
    }

    #[test]
    fn no_high_priority_request_goes_beside_a_multi_gpu_lease() {
        let mut ungated = empty();
        ungated.runs_multi_gpu_lease = true;
        let mut loaded = gpu(60, 0.9, 3);
        loaded.has_high_lease = false;
        let batch = place(&[ungated, loaded], &[high(10), low(1)], &EVEN);
        assert_eq!(batch.assignment[0], Some(1), "high goes to the loaded GPU");
        assert_eq!(
            batch.assignment[1],
            Some(0),
            "low may share the ungated one"
        );
    }

    #[test]
    fn a_reserved_gpu_takes_only_its_tenants_requests() {
        let mut reserved = empty();
        reserved.reserved_for = Some("alice");
        let busy = gpu(10, 0.9, 2);
        let mut alices = low(5);
        alices.tenant = Some("alice");
        let mut bobs = low(5);
        bobs.tenant = Some("bob");
        let anyones = low(5);
        let batch = place(&[reserved, busy], &[alices, bobs, anyones], &EVEN);
        assert_eq!(batch.assignment, [Some(0), Some(1), Some(1)]);
    }

    #[test]
    fn a_drained_gpu_takes_nothing() {
        let mut drained = empty();
        drained.drained = true;
        let batch = place(&[drained, gpu(75, 0.9, 3)], &[low(4), low(4)], &EVEN);
        assert_eq!(batch.assignment, [Some(1), None]);
    }

    #[test]
    fn requests_not_for_any_gpu_are_left_to_the_greedy_path() {
        let mut explicit = low(1);
        explicit.any_gpu = false;
        let batch = place(&[empty()], &[explicit, low(1)], &EVEN);
        assert_eq!(batch.assignment, [None, Some(0)]);
    }

    #[test]
    fn a_high_priority_request_greedy_placed_is_never_traded_for_more_low_ones() {
        // Two lows would be more requests placed than one high, but the high came
        // first in the queue and greedy placed it.
        let batch = place(&[empty()], &[high(60), low(30), low(30)], &EVEN);
        assert_eq!(batch.assignment, [Some(0), None, None]);
        assert_eq!(batch.objective.high_placed, 1);
    }

    #[test]
    fn a_high_priority_request_greedy_left_waiting_takes_a_low_ones_place() {
        // Adversarial queue order (a low ahead of a high): greedy fills the only
        // GPU with the low; the search must not let that delay the high.
        let batch = place(&[empty()], &[low(50), high(50)], &EVEN);
        assert_eq!(batch.greedy.high_placed, 0);
        assert_eq!(batch.assignment, [None, Some(0)]);
    }

    #[test]
    fn lows_never_crowd_out_a_high_even_when_moving_them_would_fit_more() {
        // Greedy spreads the two highs over the empty GPUs; one low fits on the
        // third. Dropping the second high would let two lows share its GPU (four
        // placed instead of three): the search must not.
        let gpus = [empty(), empty(), gpu(40, 0.2, 1)];
        let requests = [high(50), high(50), low(40), low(40), low(40)];
        let batch = place(&gpus, &requests, &EVEN);
        assert!(batch.assignment[0].is_some() && batch.assignment[1].is_some());
        assert_eq!(batch.objective.placed, 3);
        assert_eq!(
            batch.assignment.iter().filter(|at| **at == Some(2)).count(),
            1
        );
    }

    #[test]
    fn moving_a_placed_request_lets_a_waiting_one_fit() {
        // Greedy puts the 30 GiB job on the empty GPU, then the 60 GiB job fits
        // nowhere; moving the first to the half-full GPU makes room.
        let gpus = [gpu(50, 0.0, 0), empty()];
        let batch = place(&gpus, &[low(30), low(60)], &EVEN);
        assert_eq!(batch.greedy.placed, 1);
        assert_eq!(batch.assignment, [Some(0), Some(1)]);
    }

    #[test]
    fn a_placed_low_waits_when_that_lets_two_fit() {
        // Greedy places the 41 GiB job first; neither 40 GiB job then fits.
        let batch = place(&[empty()], &[low(41), low(40), low(40)], &EVEN);
        assert_eq!(batch.greedy.placed, 1);
        assert_eq!(batch.assignment, [None, Some(0), Some(0)]);
    }

    #[test]
    fn a_placed_low_never_waits_only_to_lower_the_cost() {
        // Swapping the queued-first heavy job for the light one behind it would
        // cost less, but places no more: the first stays.
        let requests = [
            request(Priority::Low, 60, 0.9),
            request(Priority::Low, 60, 0.1),
        ];
        let batch = place(&[empty()], &requests, &EVEN);
        assert_eq!(batch.assignment, [Some(0), None]);
    }

    #[test]
    fn the_search_lowers_the_cost_greedy_leaves() {
        // Greedy spreads the two small jobs, then the big one joins a small one:
        // compute 0.9 + 0.1 (cost 0.82); the big one alone and the small ones
        // together: 0.8 + 0.2 (cost 0.68).
        let requests = [
            request(Priority::Low, 1, 0.1),
            request(Priority::Low, 1, 0.1),
            request(Priority::Low, 1, 0.8),
        ];
        let batch = place(&[empty(), empty()], &requests, &COMPUTE_ONLY);
        assert!(
            (batch.greedy.cost - 0.82).abs() < 1e-9,
            "{:?}",
            batch.greedy
        );
        assert!(
            (batch.objective.cost - 0.68).abs() < 1e-9,
            "{:?}",
            batch.objective
        );
        assert_eq!(batch.assignment[0], batch.assignment[1]);
        assert_ne!(batch.assignment[0], batch.assignment[2]);
    }

    fn objective(high_placed: usize, served: &[bool], cost: f64) -> Objective {
        Objective {
            high_placed,
            placed: served.iter().filter(|s| **s).count(),
            served: served.to_vec(),
            cost,
        }
    }

    #[test]
    fn better_than_ranks_high_placed_then_placed_then_queue_order_then_cost() {
        let rows = [
            (
                "one more high beats any number of lows, at any cost",
                objective(1, &[true, false, false, false], 9.0),
                objective(0, &[false, true, true, true], 0.1),
            ),
            (
                "one more placed beats a lower cost",
                objective(0, &[true, true, false], 2.0),
                objective(0, &[true, false, false], 1.0),
            ),
            (
                "an earlier request placed beats a later one placed more cheaply",
                objective(0, &[true, false], 2.0),
                objective(0, &[false, true], 1.0),
            ),
            (
                "the same requests placed: the lower cost wins",
                objective(0, &[true, false], 1.0),
                objective(0, &[true, false], 2.0),
            ),
        ];
        for (rule, better, worse) in rows {
            assert!(better.better_than(&worse), "{rule}");
            assert!(!worse.better_than(&better), "{rule} (reversed)");
        }
        let same = objective(0, &[true, false], 1.0);
        let rounding = objective(0, &[true, false], 1.0 + COST_EPSILON / 2.0);
        assert!(!same.better_than(&rounding) && !rounding.better_than(&same));
        assert!(!same.better_than(&same), "strict: nothing beats itself");
    }

    #[test]
    fn may_take_refuses_what_each_hard_rule_forbids() {
        let mut drained = empty();
        drained.drained = true;
        let mut alices = empty();
        alices.reserved_for = Some("alice");
        let mut with_high = empty();
        with_high.has_high_lease = true;
        let mut ungated = empty();
        ungated.runs_multi_gpu_lease = true;
        let mut not_for_the_batch = low(1);
        not_for_the_batch.any_gpu = false;
        let mut alices_request = low(1);
        alices_request.tenant = Some("alice");
        let rows: [(&str, BatchGpu, u32, BatchRequest, bool); 13] = [
            ("an empty GPU takes a low", empty(), 0, low(1), true),
            ("an empty GPU takes a high", empty(), 0, high(1), true),
            ("memory exactly full", gpu(40, 0.0, 1), 0, low(40), true),
            ("memory one GiB over", gpu(41, 0.0, 1), 0, low(40), false),
            ("drained", drained, 0, low(1), false),
            ("reserved for another tenant", alices, 0, low(1), false),
            ("reserved for its tenant", alices, 0, alices_request, true),
            ("a high beside a high lease", with_high, 0, high(1), false),
            ("a low beside a high lease", with_high, 0, low(1), true),
            ("a high beside the batch's high", empty(), 1, high(1), false),
            (
                "a high beside a multi-GPU lease",
                ungated,
                0,
                high(1),
                false,
            ),
            ("a low beside a multi-GPU lease", ungated, 0, low(1), true),
            (
                "a request not for the batch",
                empty(),
                0,
                not_for_the_batch,
                false,
            ),
        ];
        for (rule, gpu, batch_highs, request, takes) in rows {
            assert_eq!(
                may_take(&gpu, &gpu.load, batch_highs, &request),
                takes,
                "{rule}"
            );
        }
    }

    #[test]
    fn an_extra_high_placement_beats_any_number_of_lows() {
        // Greedy fills the GPU with two lows queued first; the high behind them
        // fits only alone: one high placed beats two lows.
        let batch = place(&[empty()], &[low(30), low(30), high(60)], &EVEN);
        assert_eq!(batch.greedy.placed, 2);
        assert_eq!(batch.greedy.high_placed, 0);
        assert_eq!(batch.assignment, [None, None, Some(0)]);
    }

    #[test]
    fn an_earlier_request_never_waits_so_that_a_later_one_runs_more_cheaply() {
        // Either request fits alone on the loaded GPU's free room; the later one
        // is lighter (cheaper), but the earlier one is served.
        let gpus = [gpu(40, 0.5, 2)];
        let requests = [
            request(Priority::Low, 30, 0.9),
            request(Priority::Low, 30, 0.05),
        ];
        let batch = place(&gpus, &requests, &EVEN);
        assert_eq!(batch.assignment, [Some(0), None]);
        let later = objective_of(&gpus, &requests, &EVEN, &[None, Some(0)]);
        assert!(
            later.cost < batch.objective.cost,
            "the later one is cheaper"
        );
        assert!(batch.objective.better_than(&later));
    }

    #[test]
    fn the_result_is_never_worse_than_greedy_by_the_one_order() {
        // Fixed instances of the bench's kind, each small and large, tight and
        // not: greedy's assignment, ranked by `better_than`, never beats the
        // search's.
        for (seed, gpus, requests) in [(1, 1, 4), (2, 2, 8), (3, 3, 6), (4, 4, 12), (5, 8, 24)] {
            let (gpus, requests) = instance(seed, gpus, requests);
            let batch = place(&gpus, &requests, &EVEN);
            let greedy = greedy(&gpus, &requests, &EVEN);
            let greedy = objective_of(&gpus, &requests, &EVEN, &greedy);
            assert_eq!(greedy, batch.greedy, "seed {seed}");
            assert!(!greedy.better_than(&batch.objective), "seed {seed}");
        }
    }

    #[test]
    fn a_low_never_takes_the_room_a_high_had_under_greedy_even_for_a_lower_cost() {
        // The big low fits only where greedy put the high, and the high has
        // nowhere else to go (the other GPU runs a high lease): two placed would
        // need the high to wait, so the low waits instead.
        let mut loaded = gpu(10, 0.5, 1);
        loaded.has_high_lease = true;
        let batch = place(&[empty(), loaded], &[high(50), low(75)], &EVEN);
        assert_eq!(batch.assignment, [Some(0), None]);
    }

    #[test]
    fn a_spent_budget_still_returns_the_greedy_assignment() {
        let gpus = [gpu(10, 0.2, 1), empty(), gpu(70, 0.5, 2)];
        let requests = [high(20), low(5), low(30), low(8), high(9)];
        let batch = place_batch(
            &gpus,
            &requests,
            &EVEN,
            &SearchLimits::with_budget(Duration::ZERO),
        );
        assert!(batch.budget_spent);
        assert_eq!(batch.objective, batch.greedy);
        assert_eq!(rule_broken(&gpus, &requests, &batch.assignment), None);
        assert_eq!(batch.objective.placed, 5);
    }

    /// The bench's kind of instance, smaller: mixed sizes, some GPUs loaded.
    fn instance(
        seed: u64,
        gpus: usize,
        requests: usize,
    ) -> (Vec<BatchGpu<'static>>, Vec<BatchRequest<'static>>) {
        let mut rng = SplitMix64(seed);
        let gpus = (0..gpus)
            .map(|_| {
                let mut g = gpu(
                    rng.below(50) as u64,
                    rng.below(80) as f64 / 100.0,
                    rng.below(3) as u32,
                );
                g.has_high_lease = rng.below(4) == 0;
                g.runs_multi_gpu_lease = rng.below(10) == 0;
                g.drained = rng.below(16) == 0;
                g
            })
            .collect();
        let mut requests: Vec<BatchRequest> = (0..requests)
            .map(|_| {
                let priority = if rng.below(4) == 0 {
                    Priority::High
                } else {
                    Priority::Low
                };
                request(
                    priority,
                    1 + rng.below(40) as u64,
                    rng.below(90) as f64 / 100.0 + 0.05,
                )
            })
            .collect();
        requests.sort_by_key(|r| r.priority != Priority::High);
        (gpus, requests)
    }

    #[test]
    fn the_same_seed_gives_the_same_assignment() {
        let (gpus, requests) = instance(7, 8, 24);
        let limits = SearchLimits {
            budget: AMPLE,
            seed: 42,
            patience: 50,
            genetic: true,
        };
        let first = place_batch(&gpus, &requests, &EVEN, &limits);
        let second = place_batch(&gpus, &requests, &EVEN, &limits);
        assert!(!first.budget_spent);
        assert_eq!(first, second);
    }

    /// The genetic algorithm of `greedy`'s batch: greedy's assignment and pins.
    fn genetic_of<'s>(
        gpus: &'s [BatchGpu<'s>],
        requests: &'s [BatchRequest<'s>],
        greedy: &'s [Option<usize>],
        pinned: &'s [bool],
    ) -> genetic::Genetic<'s> {
        genetic::Genetic {
            gpus,
            requests,
            weights: EVEN,
            greedy,
            pinned,
        }
    }

    fn pins(requests: &[BatchRequest], greedy: &[Option<usize>]) -> Vec<bool> {
        requests
            .iter()
            .zip(greedy)
            .map(|(r, at)| at.is_some() && r.priority == Priority::High)
            .collect()
    }

    #[test]
    fn the_repair_keeps_every_hard_rule_and_the_pins_and_fills_what_fits() {
        // Genes of every kind the operators make: all on one GPU (far over its
        // memory and its one high), all waiting, random GPUs or waiting.
        for (seed, gpus, requests) in [(1, 2, 8), (2, 4, 16), (3, 8, 32), (4, 16, 64)] {
            let (gpus, requests) = instance(seed, gpus, requests);
            let greedy = greedy(&gpus, &requests, &EVEN);
            let pinned = pins(&requests, &greedy);
            let ga = genetic_of(&gpus, &requests, &greedy, &pinned);
            let mut rng = SplitMix64(seed);
            let mut fill = genetic::Fill::new();
            let mut waiting = Vec::new();
            let n = requests.len();
            let rows: [(&str, Vec<Option<usize>>); 3] = [
                ("all on GPU 0", vec![Some(0); n]),
                ("all waiting", vec![None; n]),
                (
                    "random",
                    (0..n)
                        .map(|_| rng.below(gpus.len() + 1).checked_sub(1))
                        .collect(),
                ),
            ];
            for (genes_are, mut genes) in rows {
                ga.repair(&mut genes, &mut fill, &mut waiting, &mut rng);
                let case = format!("seed {seed}, {genes_are}");
                assert_eq!(rule_broken(&gpus, &requests, &genes), None, "{case}");
                for r in 0..n {
                    assert!(!pinned[r] || genes[r].is_some(), "{case}: pinned {r} waits");
                }
                let mut state = State::new(&gpus, &requests, EVEN);
                for (r, at) in genes.iter().enumerate() {
                    state.assign(r, *at);
                }
                for r in (0..n).filter(|&r| genes[r].is_none()) {
                    assert_eq!(state.cheapest_gpu(r), None, "{case}: {r} waits but fits");
                }
            }
        }
    }

    #[test]
    fn the_repair_puts_the_pinned_back_where_greedy_had_them_when_one_fits_nowhere_else() {
        // Greedy: the small high on the half-full idle GPU, the big one on the
        // busy empty GPU. Genes putting both on the busy GPU leave the big high
        // nowhere (one high a GPU, no memory on the other): greedy's places.
        let gpus = [gpu(0, 0.9, 3), gpu(60, 0.0, 0)];
        let requests = [high(10), high(70)];
        let greedy = greedy(&gpus, &requests, &EVEN);
        assert_eq!(greedy, [Some(1), Some(0)], "the case's premise");
        let pinned = pins(&requests, &greedy);
        let ga = genetic_of(&gpus, &requests, &greedy, &pinned);
        let mut genes = vec![Some(0), Some(0)];
        ga.repair(
            &mut genes,
            &mut genetic::Fill::new(),
            &mut Vec::new(),
            &mut SplitMix64(1),
        );
        assert_eq!(genes, greedy);
    }

    #[test]
    fn evolution_keeps_every_rule_never_loses_to_its_seeds_and_repeats_given_a_seed() {
        for (seed, gpus, requests) in [(5, 3, 10), (6, 8, 32), (7, 16, 64)] {
            let (gpus, requests) = instance(seed, gpus, requests);
            let greedy = greedy(&gpus, &requests, &EVEN);
            let pinned = pins(&requests, &greedy);
            let ga = genetic_of(&gpus, &requests, &greedy, &pinned);
            // Greedy as the one seed, 20 stale generations: ends before the
            // ample deadline, so the result depends on the seed alone.
            let evolve = || {
                ga.evolve(
                    &[&greedy],
                    POPULATION,
                    20,
                    Instant::now() + AMPLE,
                    &mut SplitMix64(seed),
                )
            };
            let evolved = evolve();
            assert!(!evolved.budget_spent, "seed {seed}");
            assert_eq!(
                rule_broken(&gpus, &requests, &evolved.assignment),
                None,
                "seed {seed}"
            );
            for (pinned, at) in pinned.iter().zip(&evolved.assignment) {
                assert!(!pinned || at.is_some(), "seed {seed}");
            }
            let greedy_objective = objective_of(&gpus, &requests, &EVEN, &greedy);
            assert!(
                !greedy_objective.better_than(&evolved.objective),
                "seed {seed}"
            );
            assert_eq!(
                evolved.objective,
                objective_of(&gpus, &requests, &EVEN, &evolved.assignment),
                "seed {seed}: the reported objective is the assignment's"
            );
            assert_eq!(evolve(), evolved, "seed {seed}: same seed, same result");
        }
    }

    #[test]
    fn a_child_never_beats_greedy_by_breaking_a_rule() {
        // Everything on the first GPU places all requests if no rule is
        // checked; repaired, the child holds only what the rules let it.
        let (gpus, requests) = instance(8, 4, 16);
        let greedy = greedy(&gpus, &requests, &EVEN);
        let pinned = pins(&requests, &greedy);
        let ga = genetic_of(&gpus, &requests, &greedy, &pinned);
        let mut genes = vec![Some(0); requests.len()];
        assert!(
            rule_broken(&gpus, &requests, &genes).is_some(),
            "the premise"
        );
        ga.repair(
            &mut genes,
            &mut genetic::Fill::new(),
            &mut Vec::new(),
            &mut SplitMix64(8),
        );
        assert_eq!(rule_broken(&gpus, &requests, &genes), None);
        let child = objective_of(&gpus, &requests, &EVEN, &genes);
        assert!(child.placed < requests.len());
    }

    /// The best assignment by exhaustive search, under the same rules and pins.
    fn optimum<'s>(gpus: &'s [BatchGpu<'s>], requests: &'s [BatchRequest<'s>]) -> State<'s> {
        let mut greedy = State::new(gpus, requests, EVEN);
        greedy.greedy();
        let pinned: Vec<bool> = (0..requests.len())
            .map(|r| greedy.at[r].is_some() && requests[r].priority == Priority::High)
            .collect();
        let choices = gpus.len() + 1;
        let mut best = greedy.clone();
        let mut assignment = vec![None; requests.len()];
        for code in 0..choices.pow(requests.len() as u32) {
            let mut rest = code;
            for at in assignment.iter_mut() {
                *at = (rest % choices).checked_sub(1);
                rest /= choices;
            }
            if rule_broken(gpus, requests, &assignment).is_some()
                || pinned
                    .iter()
                    .zip(&assignment)
                    .any(|(p, at)| *p && at.is_none())
            {
                continue;
            }
            let mut state = State::new(gpus, requests, EVEN);
            for (r, at) in assignment.iter().enumerate() {
                state.assign(r, *at);
            }
            if state.beats(&best) {
                best = state;
            }
        }
        best
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn the_search_keeps_every_rule_and_never_loses_to_greedy(seed in any::<u64>(), gpus in 1usize..6, requests in 0usize..14) {
            let (gpus, requests) = instance(seed, gpus, requests);
            let limits = SearchLimits { budget: AMPLE, seed, patience: 20, genetic: true };
            let batch = place_batch(&gpus, &requests, &EVEN, &limits);
            prop_assert_eq!(rule_broken(&gpus, &requests, &batch.assignment), None);
            // Never worse than greedy by the search's whole order: counts, then
            // queue order, then cost (a result may cost more than greedy's where
            // it serves earlier requests: an order without the queue said it
            // lost; seed 18301406361728218447).
            let mut greedy = State::new(&gpus, &requests, EVEN);
            greedy.greedy();
            let mut found = State::new(&gpus, &requests, EVEN);
            for (r, at) in batch.assignment.iter().enumerate() {
                found.assign(r, *at);
            }
            prop_assert!(!greedy.beats(&found), "greedy {:?} beats {:?}", greedy.at, found.at);
            // Greedy's placed highs are all placed by the search too.
            for (r, at) in greedy.at.iter().enumerate() {
                if at.is_some() && requests[r].priority == Priority::High {
                    prop_assert!(batch.assignment[r].is_some(), "high {} dropped", r);
                }
            }
        }

        #[test]
        fn a_small_batch_reaches_the_exhaustive_optimum(seed in any::<u64>(), gpus in 1usize..4, requests in 0usize..7) {
            let (gpus, requests) = instance(seed, gpus, requests);
            let batch = place_batch(&gpus, &requests, &EVEN, &SearchLimits::with_budget(AMPLE));
            let best = optimum(&gpus, &requests);
            let mut found = State::new(&gpus, &requests, EVEN);
            for (r, at) in batch.assignment.iter().enumerate() {
                found.assign(r, *at);
            }
            prop_assert!(!best.beats(&found), "{:?} beats {:?}", best.at, found.at);
        }
    }
}
