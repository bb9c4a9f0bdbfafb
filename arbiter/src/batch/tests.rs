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
