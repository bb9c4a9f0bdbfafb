//! The batch placement search on the admission queue's worst case: 64
//! waiting single-GPU requests on 16 GPUs of 80 GiB (sizes 1-40 GiB, expected
//! demand 0.05-0.95 GPU, a quarter high-priority, half the GPUs partly loaded and
//! a few already running a high-priority lease), many instances from fixed seeds.
//!
//! For each instance: greedy (a spent budget returns it), the local search alone
//! (no kicks), the search before the hybrid (`kicks_only`: kicks and make-room
//! moves, no genetic algorithm) and the shipped default (the hybrid,
//! `placement.batch_budget_us`' default 10 ms), on a tight mix (1-40 GiB: more
//! than fits), a light one (1-16 GiB: everything fits, so only the cost differs)
//! and a small batch (8 requests on 4 GPUs, where the exact search runs).
//! Reports the time per call (median, p99, max; wall and this thread's CPU
//! time) and the objective reached against greedy: extra requests placed, and,
//! over the instances where the search placed as many as greedy, how much lower
//! its balanced cost is.
//!
//! The same instances go to the genetic algorithm alone (`batch_ga`, the
//! library's `place_batch_genetic`: Sun et al.'s method, the whole budget) at
//! populations 8 and 16; `<case>/default_vs_<mode>` counts, instance by instance
//! and by the search's own order (`Objective::better_than`), how often the
//! shipped default is better, as good or worse than the GA alone and than
//! `kicks_only`.
//!
//! `GPUSHARE_BENCH_RESULTS=dir` writes the figures to `dir/batch.json`;
//! `GPUSHARE_BENCH_N` overrides the number of instances (default 200).

use std::time::{Duration, Instant};

use gpushare_arbiter::balance::{Demand, Load, Weights};
mod batch_ga;

use batch_ga::{place_batch_ga, GaLimits};
use gpushare_arbiter::batch::{
    greedy, may_take, place_batch, Batch, BatchGpu, BatchRequest, Objective, SearchLimits,
    DEFAULT_PATIENCE,
};
use gpushare_proto::Priority;
use gpushare_testkit::results::write_results;
use gpushare_testkit::stats::percentile;
use nix::time::{clock_gettime, ClockId};

const GIB: u64 = 1 << 30;

/// One kind of instance: GPUs, waiting requests, the largest request.
#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    gpus: usize,
    requests: usize,
    largest_gib: u64,
}

const CASES: [Case; 3] = [
    // 1-40 GiB overfills the GPUs' memory: not all fit.
    Case {
        name: "tight",
        gpus: 16,
        requests: 64,
        largest_gib: 40,
    },
    // 1-16 GiB: everything fits, only the cost differs.
    Case {
        name: "light",
        gpus: 16,
        requests: 64,
        largest_gib: 16,
    },
    // Small enough (5^8 assignments) for the exact search after the local one.
    Case {
        name: "small",
        gpus: 4,
        requests: 8,
        largest_gib: 40,
    },
];
const BUDGET: Duration = Duration::from_millis(10);
const WEIGHTS: Weights = Weights {
    memory: 1.0,
    compute: 1.0,
    jobs: 1.0,
};

/// Park and Miller's minimal standard generator: the instances only need to be
/// varied and the same on every run.
struct Lehmer(u64);

impl Lehmer {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0 * 48_271 % 0x7fff_ffff;
        self.0 % n
    }
}

fn instance(seed: u64, case: Case) -> (Vec<BatchGpu<'static>>, Vec<BatchRequest<'static>>) {
    let mut rng = Lehmer(seed + 1);
    let gpus = (0..case.gpus)
        .map(|i| {
            let loaded = i % 2 == 0;
            BatchGpu {
                load: Load {
                    memory_total: 80 * GIB,
                    memory_leased: if loaded { rng.below(40) * GIB } else { 0 },
                    compute: if loaded {
                        rng.below(60) as f64 / 100.0
                    } else {
                        0.0
                    },
                    jobs: if loaded { 1 + rng.below(2) as u32 } else { 0 },
                },
                has_high_lease: loaded && rng.below(4) == 0,
                ..BatchGpu::default()
            }
        })
        .collect();
    let requests = (0..case.requests)
        .map(|i| BatchRequest {
            // Queue order: the first quarter is high-priority.
            priority: if i < case.requests / 4 {
                Priority::High
            } else {
                Priority::Low
            },
            demand: Demand {
                memory: (1 + rng.below(case.largest_gib)) * GIB,
                compute: 0.05 + rng.below(90) as f64 / 100.0,
            },
            tenant: None,
            any_gpu: true,
        })
        .collect();
    (gpus, requests)
}

struct Figures {
    micros: Vec<f64>,
    /// This thread's CPU time per call: on a shared machine the wall time also
    /// holds the time the scheduler gave other processes (a 4 ms tick at a time).
    cpu_micros: Vec<f64>,
    placed_over_greedy: Vec<f64>,
    cost_reduction_percent: Vec<f64>,
    budget_spent: usize,
    generations: Vec<f64>,
    /// Each instance's result, in seed order, for the head-to-head.
    objectives: Vec<Objective>,
}

/// What one call of a search reached.
struct Outcome {
    objective: Objective,
    greedy: Objective,
    budget_spent: bool,
    /// The GA's generations (0 for the shipped search).
    generations: u32,
}

fn shipped(limits: SearchLimits) -> impl Fn(&[BatchGpu], &[BatchRequest]) -> Outcome {
    move |gpus, requests| {
        let batch: Batch = place_batch(gpus, requests, &WEIGHTS, &limits);
        Outcome {
            objective: batch.objective,
            greedy: batch.greedy,
            budget_spent: batch.budget_spent,
            generations: 0,
        }
    }
}

fn genetic(limits: GaLimits) -> impl Fn(&[BatchGpu], &[BatchRequest]) -> Outcome {
    move |gpus, requests| {
        let start = Instant::now();
        let ga = place_batch_ga(gpus, requests, &WEIGHTS, &limits);
        let budget_spent = start.elapsed() >= limits.budget;
        assert_keeps_every_rule(gpus, requests, &ga.assignment);
        Outcome {
            objective: ga.objective,
            greedy: ga.greedy,
            budget_spent,
            generations: ga.generations,
        }
    }
}

/// Replays `assignment` in queue order through the shipped hard rules (memory
/// fits at every step iff it fits at the end; a second high-priority request on
/// a GPU is refused when it comes), and checks greedy's placed high-priority
/// requests are still placed.
fn assert_keeps_every_rule(
    gpus: &[BatchGpu],
    requests: &[BatchRequest],
    assignment: &[Option<usize>],
) {
    let mut loads: Vec<Load> = gpus.iter().map(|g| g.load).collect();
    let mut highs = vec![0; gpus.len()];
    for (request, at) in requests.iter().zip(assignment) {
        if let Some(gpu) = *at {
            assert!(may_take(&gpus[gpu], &loads[gpu], highs[gpu], request));
            loads[gpu] = loads[gpu].with(request.demand);
            highs[gpu] += u32::from(request.priority == Priority::High);
        }
    }
    let greedy = greedy(gpus, requests, &WEIGHTS);
    for ((request, greedy), at) in requests.iter().zip(&greedy).zip(assignment) {
        if request.priority == Priority::High && greedy.is_some() {
            assert!(at.is_some(), "a high-priority request greedy placed waits");
        }
    }
}

fn run(n: u64, case: Case, search: &dyn Fn(&[BatchGpu], &[BatchRequest]) -> Outcome) -> Figures {
    let mut figures = Figures {
        micros: Vec::new(),
        cpu_micros: Vec::new(),
        placed_over_greedy: Vec::new(),
        cost_reduction_percent: Vec::new(),
        budget_spent: 0,
        objectives: Vec::new(),
        generations: Vec::new(),
    };
    for seed in 0..n {
        let (gpus, requests) = instance(seed, case);
        let cpu_start = thread_cpu();
        let start = Instant::now();
        let outcome = search(&gpus, &requests);
        figures.micros.push(start.elapsed().as_secs_f64() * 1e6);
        figures
            .cpu_micros
            .push((thread_cpu() - cpu_start).as_secs_f64() * 1e6);
        let (found, greedy) = (&outcome.objective, &outcome.greedy);
        figures
            .placed_over_greedy
            .push(found.placed as f64 - greedy.placed as f64);
        // Placing more requests adds cost: the costs compare only where both
        // placed as many.
        if found.placed == greedy.placed {
            figures
                .cost_reduction_percent
                .push(100.0 * (greedy.cost - found.cost) / greedy.cost);
        }
        figures.budget_spent += usize::from(outcome.budget_spent);
        assert!(found.high_placed >= greedy.high_placed);
        assert!(!greedy.better_than(found), "seed {seed}: lost to greedy");
        figures.generations.push(f64::from(outcome.generations));
        figures.objectives.push(outcome.objective);
    }
    for v in [
        &mut figures.micros,
        &mut figures.cpu_micros,
        &mut figures.placed_over_greedy,
        &mut figures.cost_reduction_percent,
    ] {
        v.sort_by(f64::total_cmp);
    }
    figures
}

/// Per instance, by the search's own order: how often `a` is better than, as
/// good as, or worse than `b`, and by how much where the counts differ or only
/// the cost does.
fn head_to_head(a: &[Objective], b: &[Objective]) -> serde_json::Value {
    let (mut better, mut equal, mut worse) = (0, 0, 0);
    let mut placed_difference = Vec::new();
    let mut cost_below_percent = Vec::new();
    for (a, b) in a.iter().zip(b) {
        if a.better_than(b) {
            better += 1;
        } else if b.better_than(a) {
            worse += 1;
        } else {
            equal += 1;
        }
        placed_difference.push(a.placed as f64 - b.placed as f64);
        if (a.high_placed, a.placed, &a.served) == (b.high_placed, b.placed, &b.served) {
            cost_below_percent.push(100.0 * (b.cost - a.cost) / b.cost);
        }
    }
    serde_json::json!({
        "shipped_better": better,
        "equal": equal,
        "shipped_worse": worse,
        "placed_over_other_mean": mean(&placed_difference),
        "instances_placing_the_same_requests": cost_below_percent.len(),
        "cost_below_other_percent_mean": mean(&cost_below_percent),
    })
}

fn thread_cpu() -> Duration {
    let now = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).expect("thread CPU clock");
    Duration::from(now)
}

/// The 1-, 5- and 15-minute load averages, as /proc/loadavg has them.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// The GA's population sizes tried (each for the whole budget): 16 is the
/// hybrid's; 8, 32 and 64 did no better alone (commit 59d8245's batch.json).
const GA_POPULATIONS: [usize; 2] = [8, 16];
/// The search before the hybrid (local search, kicks, make-room moves, no
/// genetic algorithm).
const PREVIOUS: &str = "kicks_only";

fn main() {
    let n: u64 = std::env::var("GPUSHARE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let default = SearchLimits::with_budget(BUDGET);
    type Search = Box<dyn Fn(&[BatchGpu], &[BatchRequest]) -> Outcome>;
    // The local search alone; the search before the hybrid (kicks, no genetic
    // algorithm); the shipped hybrid; then the genetic algorithm alone on the
    // same instances and budget.
    let mut modes: Vec<(String, serde_json::Value, Search)> = vec![
        (
            "local_search".to_string(),
            serde_json::json!({ "patience": 0, "genetic": false }),
            Box::new(shipped(SearchLimits {
                patience: 0,
                genetic: false,
                ..default
            })),
        ),
        (
            PREVIOUS.to_string(),
            serde_json::json!({ "patience": DEFAULT_PATIENCE, "genetic": false }),
            Box::new(shipped(SearchLimits {
                genetic: false,
                ..default
            })),
        ),
        (
            "default".to_string(),
            serde_json::json!({ "patience": DEFAULT_PATIENCE, "genetic": true }),
            Box::new(shipped(default)),
        ),
    ];
    for population in GA_POPULATIONS {
        let limits = GaLimits {
            budget: BUDGET,
            population,
            seed: 0x2545_f491_4f6c_dd1d,
        };
        let search: Search = Box::new(genetic(limits));
        modes.push((
            format!("ga_population_{population}"),
            serde_json::json!({ "population": population }),
            search,
        ));
    }
    println!("batch search, {n} instances a case, budget {BUDGET:?}");
    println!(
        "{:<26} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>13} {:>5} {:>13} {:>12} {:>6}",
        "mode",
        "p50 µs",
        "p99 µs",
        "max µs",
        "cpu p50",
        "cpu p99",
        "cpu max",
        "+placed mean",
        "same",
        "cost -% mean",
        "cost -% min",
        "spent"
    );
    let mut json = serde_json::Map::new();
    // The machine is shared: the load says how much of the wall time is others'.
    json.insert("load_average_at_start".into(), load_average().into());
    for case in CASES {
        let mut reached: Vec<(String, Vec<Objective>)> = Vec::new();
        for (mode, parameters, search) in &modes {
            let name = format!("{}/{mode}", case.name);
            let f = run(n, case, search.as_ref());
            let (p50, p99, max) = (
                percentile(&f.micros, 50.0),
                percentile(&f.micros, 99.0),
                *f.micros.last().unwrap(),
            );
            let (cpu_p50, cpu_p99, cpu_max) = (
                percentile(&f.cpu_micros, 50.0),
                percentile(&f.cpu_micros, 99.0),
                *f.cpu_micros.last().unwrap(),
            );
            let placed = mean(&f.placed_over_greedy);
            let same_count = f.cost_reduction_percent.len();
            let reduction = mean(&f.cost_reduction_percent);
            let worst = f
                .cost_reduction_percent
                .first()
                .copied()
                .unwrap_or(f64::NAN);
            println!(
                "{name:<26} {p50:>8.0} {p99:>8.0} {max:>8.0} {cpu_p50:>8.0} {cpu_p99:>8.0} {cpu_max:>8.0} {placed:>13.2} {same_count:>5} {reduction:>13.2} {worst:>12.2} {:>6}",
                f.budget_spent
            );
            let mut figures = serde_json::json!({
                "instances": n,
                "gpus": case.gpus,
                "requests": case.requests,
                "largest_request_gib": case.largest_gib,
                "budget_us": BUDGET.as_micros() as u64,
                "p50_us": p50,
                "p99_us": p99,
                "max_us": max,
                "cpu_p50_us": cpu_p50,
                "cpu_p99_us": cpu_p99,
                "cpu_max_us": cpu_max,
                "placed_over_greedy_mean": placed,
                "instances_placing_as_many_as_greedy": same_count,
                "cost_reduction_percent_mean": reduction,
                "cost_reduction_percent_min": worst,
                "budget_spent": f.budget_spent,
            });
            if mode.starts_with("ga_") {
                figures["generations_mean"] = mean(&f.generations).into();
            }
            if let (Some(figures), Some(parameters)) =
                (figures.as_object_mut(), parameters.as_object())
            {
                figures.extend(parameters.clone());
            }
            json.insert(name, figures);
            reached.push((mode.clone(), f.objectives));
        }
        let default = &reached[2].1;
        for (mode, objectives) in reached
            .iter()
            .filter(|(m, _)| m.starts_with("ga_") || m == PREVIOUS)
        {
            let duel = head_to_head(default, objectives);
            println!("{}/default_vs_{mode}: {duel}", case.name);
            json.insert(format!("{}/default_vs_{mode}", case.name), duel);
        }
    }
    json.insert("load_average_at_end".into(), load_average().into());
    write_results("batch", serde_json::Value::Object(json));
}
