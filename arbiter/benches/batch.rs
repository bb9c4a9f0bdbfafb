//! The batch placement search (issue 18) on the admission queue's worst case: 64
//! waiting single-GPU requests on 16 GPUs of 80 GiB (sizes 1-40 GiB, expected
//! demand 0.05-0.95 GPU, a quarter high-priority, half the GPUs partly loaded and
//! a few already running a high-priority lease), many instances from fixed seeds.
//!
//! For each instance: greedy (a spent budget returns it), the local search alone
//! (no kicks), and the default search (kicks, `placement.batch_budget_us`' default
//! 10 ms), on a tight mix (1-40 GiB: more than fits), a light one (1-16 GiB:
//! everything fits, so only the cost differs) and a small batch (8 requests on 4
//! GPUs, where the exact search runs). Reports the time per call (median, p99,
//! max; wall and this thread's CPU time) and the objective reached
//! against greedy: extra requests placed, and, over the instances where the
//! search placed as many as greedy, how much lower its balanced cost is.
//!
//! `GPUSHARE_BENCH_RESULTS=dir` writes the figures to `dir/batch.json`;
//! `GPUSHARE_BENCH_N` overrides the number of instances (default 200).

use std::time::{Duration, Instant};

use gpushare_arbiter::balance::{Demand, Load, Weights};
use gpushare_arbiter::batch::{place_batch, Batch, BatchGpu, BatchRequest, SearchLimits};
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
}

fn run(n: u64, case: Case, limits: SearchLimits) -> Figures {
    let mut figures = Figures {
        micros: Vec::new(),
        cpu_micros: Vec::new(),
        placed_over_greedy: Vec::new(),
        cost_reduction_percent: Vec::new(),
        budget_spent: 0,
    };
    for seed in 0..n {
        let (gpus, requests) = instance(seed, case);
        let cpu_start = thread_cpu();
        let start = Instant::now();
        let batch: Batch = place_batch(&gpus, &requests, &WEIGHTS, &limits);
        figures.micros.push(start.elapsed().as_secs_f64() * 1e6);
        figures
            .cpu_micros
            .push((thread_cpu() - cpu_start).as_secs_f64() * 1e6);
        figures
            .placed_over_greedy
            .push(batch.objective.placed as f64 - batch.greedy.placed as f64);
        // Placing more requests adds cost: the costs compare only where both
        // placed as many.
        if batch.objective.placed == batch.greedy.placed {
            figures
                .cost_reduction_percent
                .push(100.0 * (batch.greedy.cost - batch.objective.cost) / batch.greedy.cost);
        }
        figures.budget_spent += usize::from(batch.budget_spent);
        assert!(batch.objective.high_placed >= batch.greedy.high_placed);
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

fn thread_cpu() -> Duration {
    let now = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).expect("thread CPU clock");
    Duration::from(now)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() {
    let n: u64 = std::env::var("GPUSHARE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let default = SearchLimits::with_budget(BUDGET);
    let patient = |patience| SearchLimits {
        patience,
        ..default
    };
    // The local search alone, and kicks with growing patience: how much the kicks
    // add, and for how much time.
    let modes = [
        ("local_search", patient(0)),
        ("default", default),
        ("patience_50", patient(50)),
        ("patience_200", patient(200)),
    ];
    println!("batch search, {n} instances a case, budget {BUDGET:?}");
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>14} {:>6} {:>14} {:>14} {:>7}",
        "mode",
        "p50 µs",
        "p99 µs",
        "max µs",
        "cpu p99",
        "cpu max",
        "+placed mean",
        "same",
        "cost -% mean",
        "cost -% min",
        "spent"
    );
    let mut json = serde_json::Map::new();
    let runs = CASES
        .into_iter()
        .flat_map(|case| modes.iter().map(move |mode| (case, *mode)));
    for (case, (mode, limits)) in runs {
        let name = format!("{}/{mode}", case.name);
        let f = run(n, case, limits);
        let (p50, p99, max) = (
            percentile(&f.micros, 50.0),
            percentile(&f.micros, 99.0),
            *f.micros.last().unwrap(),
        );
        let (cpu_p99, cpu_max) = (
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
            "{name:<22} {p50:>9.0} {p99:>9.0} {max:>9.0} {cpu_p99:>9.0} {cpu_max:>9.0} {placed:>14.2} {same_count:>6} {reduction:>14.2} {worst:>14.2} {:>7}",
            f.budget_spent
        );
        json.insert(
            name.clone(),
            serde_json::json!({
                "instances": n,
                "gpus": case.gpus,
                "requests": case.requests,
                "largest_request_gib": case.largest_gib,
                "patience": limits.patience,
                "budget_us": BUDGET.as_micros() as u64,
                "p50_us": p50,
                "p99_us": p99,
                "max_us": max,
                "cpu_p99_us": cpu_p99,
                "cpu_max_us": cpu_max,
                "placed_over_greedy_mean": placed,
                "instances_placing_as_many_as_greedy": same_count,
                "cost_reduction_percent_mean": reduction,
                "cost_reduction_percent_min": worst,
                "budget_spent": f.budget_spent,
            }),
        );
    }
    write_results("batch", serde_json::Value::Object(json));
}
