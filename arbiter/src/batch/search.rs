//! The batch search's working state: an assignment of the batch's requests to GPUs with
//! each GPU's load, cost and high-priority count kept up to date, and the moves the
//! searches make on it (greedy, local search, kicks, the exact search for small
//! batches); the seeded generator behind the kicks.

use super::*;

#[derive(Clone)]
pub(super) struct State<'s> {
    pub(super) gpus: &'s [BatchGpu<'s>],
    pub(super) requests: &'s [BatchRequest<'s>],
    pub(super) weights: Weights,
    pub(super) at: Vec<Option<usize>>,
    /// Greedy placed it and it is high-priority: it may move, never wait.
    pub(super) pinned: Vec<bool>,
    pub(super) loads: Vec<Load>,
    /// High-priority requests of this batch on each GPU.
    pub(super) highs: Vec<u32>,
    pub(super) costs: Vec<f64>,
}

/// `Objective` without `served`.
#[derive(Clone, Copy)]
pub(super) struct Tally {
    pub(super) high_placed: usize,
    pub(super) placed: usize,
    pub(super) cost: f64,
}

/// A GPU's load and batch high-priority count without one of its requests.
pub(super) struct Without {
    pub(super) load: Load,
    pub(super) highs: u32,
}

impl<'s> State<'s> {
    pub(super) fn new(
        gpus: &'s [BatchGpu<'s>],
        requests: &'s [BatchRequest<'s>],
        weights: Weights,
    ) -> Self {
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

    pub(super) fn objective(&self) -> Objective {
        objective_of(self.gpus, self.requests, &self.weights, &self.at)
    }

    /// The objective's counts and cost, without the allocation `served` needs:
    /// for the exhaustive search's every node and the trades' every trial.
    pub(super) fn tally(&self) -> Tally {
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
    pub(super) fn queue_order(&self, other: &State, upto: usize) -> Ordering {
        let placed =
            |at: &[Option<usize>]| at[..upto].iter().map(Option::is_some).collect::<Vec<_>>();
        placed(&self.at).cmp(&placed(&other.at))
    }

    pub(super) fn beats(&self, other: &State) -> bool {
        self.objective().better_than(&other.objective())
    }

    /// Whether another assignment might place more: a waiting low-priority
    /// request that some GPU would take if it ran nothing of the batch, or a
    /// waiting high-priority one while fewer of the batch's highs are placed
    /// than there are GPUs that may take one. Without it, a batch where every
    /// GPU already holds a high (the bench's light mix) would run the genetic
    /// algorithm for nothing.
    pub(super) fn counts_may_improve(&self) -> bool {
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
    pub(super) fn keeps_pinned(&self) -> bool {
        self.pinned
            .iter()
            .zip(&self.at)
            .all(|(pinned, at)| !pinned || at.is_some())
    }

    pub(super) fn is_high(&self, request: usize) -> bool {
        self.requests[request].priority == Priority::High
    }

    /// Whether `request` may go on `gpu` whose load (batch included) is `load`
    /// with `highs` of this batch's high-priority requests.
    pub(super) fn fits(&self, request: usize, gpu: usize, load: &Load, highs: u32) -> bool {
        may_take(&self.gpus[gpu], load, highs, &self.requests[request])
    }

    pub(super) fn fits_now(&self, request: usize, gpu: usize) -> bool {
        self.fits(request, gpu, &self.loads[gpu], self.highs[gpu])
    }

    pub(super) fn without(&self, request: usize, gpu: usize) -> Without {
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

    pub(super) fn cost_with(&self, request: usize, load: &Load) -> f64 {
        cost(&load.with(self.requests[request].demand), &self.weights)
    }

    /// Recomputes `gpu`'s load from scratch, so moves never accumulate rounding.
    pub(super) fn refresh(&mut self, gpu: usize) {
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

    pub(super) fn assign(&mut self, request: usize, to: Option<usize>) {
        let from = std::mem::replace(&mut self.at[request], to);
        for gpu in [from, to].into_iter().flatten() {
            self.refresh(gpu);
        }
    }

    /// The GPU where `request` adds the least cost now (lowest index on ties).
    pub(super) fn cheapest_gpu(&self, request: usize) -> Option<usize> {
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
    pub(super) fn branch_and_bound(
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
    pub(super) fn greedy(&mut self) {
        for request in 0..self.requests.len() {
            if let Some(gpu) = self.cheapest_gpu(request) {
                self.assign(request, Some(gpu));
            }
        }
    }

    /// Improves until no move helps; false if the deadline stopped it first.
    pub(super) fn local_search(&mut self, deadline: Instant) -> bool {
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
    pub(super) fn insert_waiting(&mut self) -> bool {
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
    pub(super) fn promote_high(&mut self) -> bool {
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
    pub(super) fn eject_to_insert(&mut self, deadline: Instant) -> bool {
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
    pub(super) fn trade_one_for_more(&mut self, deadline: Instant) -> bool {
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
    pub(super) fn best_cost_move(&mut self, deadline: Instant) -> bool {
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
    pub(super) fn make_room(&mut self, rng: &mut SplitMix64) -> bool {
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
    pub(super) fn kick(&mut self, rng: &mut SplitMix64) {
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

pub(super) fn shuffle(items: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

/// A small seeded generator (Steele, Lea and Flood's SplitMix64): the kicks only
/// need to be varied and reproducible, not strong.
pub(super) struct SplitMix64(pub(super) u64);

impl SplitMix64 {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True with probability `p`.
    pub(super) fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}
