//! The balanced policy (`[placement] policy = "balanced"`): the GPU(s)
//! whose balanced score (`balance::added_cost`) grows least.
//!
//! The rules, in order (each has a table row below):
//!
//! 1. Narrowing as Algorithm 1: explicit GPUs (`index:`, `uuid:`, all-or-nothing,
//!    in the order named), tenant reservations, drained GPUs; a quota larger than
//!    every candidate GPU fails at once.
//! 2. The hard rules only (`hard_skip_reason`): the quota fits in the free memory;
//!    at most one high-priority lease per GPU; a multi-GPU (ungated) lease is never
//!    placed beside a high-priority job, nor a high-priority job beside one.
//!    Algorithm 1's guards (`gpu_util_limit` over the last minute,
//!    `low_nums_limit`) are not applied: the minute-long window could not see the
//!    load a short run creates, and the count limit co-located before it spread,
//!    which is what made Algorithm 1 lose to exclusive GPUs (E2).
//! 3. A GPU's compute load is the larger of its leases' expected demand (learnt
//!    from measured GPU time, `expected_demand`) and its short-window utilisation
//!    (`placement.utilization_window_ms`): the demand sees leases admitted but not
//!    yet running, the utilisation sees work the leases do not explain. Taking the
//!    larger does not count a measured lease twice.
//! 4. Each eligible GPU is scored by `added_cost(load, demand)`: memory (the quota
//!    on that GPU), compute (the request's expected demand) and one more job. The
//!    score is convex, so an empty GPU wins while one exists, and a GPU already
//!    past one GPU of demand is a worse choice than an empty one.
//! 5. Room for high-priority arrivals: for a low-priority request, a GPU that
//!    already runs a high-priority job and whose added cost is within
//!    `HIGH_ROOM_TOLERANCE` of the cheapest is taken first. The time-slice
//!    scheduler preempts the low job for the high one at once, so the high job
//!    loses little, and GPUs without a high job stay open to the next high arrival
//!    (one high job per GPU).
//! 6. Otherwise the cheapest first; equal costs by GPU index (deterministic).
//!    `count:n` takes the first n (each GPU carries the demand separately).

use std::cmp::Ordering;

use gpushare_proto::Priority;

use super::{hard_skip_reason, screen, GpuView, Placement, PlacementError, Request};
use crate::balance::{added_cost, Demand, Load, Weights};

/// A low-priority request takes a GPU with a high-priority job when its added
/// cost is at most this much (relative) above the cheapest GPU's.
pub const HIGH_ROOM_TOLERANCE: f64 = 0.10;

/// Expected demand, in GPUs, of a low-priority lease not yet measured and that
/// asked for no compute share: a batch job that computes about half the time
/// (data loading, host work between kernels).
pub const UNMEASURED_LOW_DEMAND: f64 = 0.5;
/// The same for a high-priority lease: assume it wants the whole GPU, so nothing
/// is co-located with it on the strength of a guess.
pub const UNMEASURED_HIGH_DEMAND: f64 = 1.0;

/// The balanced policy's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balanced {
    pub weights: Weights,
}

/// A lease's expected demand, in GPUs: its measured share of GPU time when there
/// is one, else its `compute_request` when it gave one, else an assumption by
/// priority (`UNMEASURED_LOW_DEMAND`, `UNMEASURED_HIGH_DEMAND`).
pub fn expected_demand(priority: Priority, compute_request: f64, measured: Option<f64>) -> f64 {
    match measured {
        Some(share) if share.is_finite() => share.clamp(0.0, 1.0),
        _ if compute_request > 0.0 => compute_request.min(1.0),
        _ => match priority {
            Priority::Low => UNMEASURED_LOW_DEMAND,
            Priority::High => UNMEASURED_HIGH_DEMAND,
        },
    }
}

/// The share of one GPU's time a lease held the time-slice token between two
/// readings of its cumulative held time `(seconds since some origin, held ns)`;
/// None when the readings span less than `min_span_s` (too short to tell) or the
/// held time went backwards (a client left and took its count with it).
pub fn held_share(first: (f64, u64), last: (f64, u64), min_span_s: f64) -> Option<f64> {
    let span = last.0 - first.0;
    if span < min_span_s || span <= 0.0 || last.1 < first.1 {
        return None;
    }
    Some(((last.1 - first.1) as f64 / 1e9 / span).clamp(0.0, 1.0))
}

/// One GPU's load as the balanced score sees it (rule 3).
pub fn load_of(gpu: &GpuView, expected: f64) -> Load {
    Load {
        memory_total: gpu.memory_allocatable,
        memory_leased: gpu.memory_leased,
        compute: expected.max(gpu.utilization),
        jobs: gpu.high_leases + gpu.low_leases,
    }
}

/// Places `request` with expected demand `demand` (GPUs): `expected[i]` is the
/// summed expected demand of the leases on `gpus[i]`, and `gpus[i].utilization`
/// its short-window utilisation.
pub fn place_balanced(
    request: &Request,
    gpus: &[GpuView],
    expected: &[f64],
    demand: f64,
    policy: &Balanced,
) -> Result<Placement, PlacementError> {
    let screened = screen(request, gpus, |gpu, spans, wanted| {
        hard_skip_reason(gpu, request.priority, spans, wanted)
    })?;
    let chosen = match screened.named() {
        Some(named) => named,
        None => {
            let scored: Vec<(usize, f64)> = screened
                .eligible
                .iter()
                .map(|&i| {
                    let load = load_of(&gpus[i], expected.get(i).copied().unwrap_or(0.0));
                    let add = Demand {
                        memory: request.memory.resolve(gpus[i].memory_allocatable),
                        compute: demand,
                    };
                    (i, added_cost(&load, add, &policy.weights))
                })
                .collect();
            order(request.priority, gpus, scored)
                .into_iter()
                .take(screened.wanted_count)
                .collect()
        }
    };
    screened.finish(request, gpus, chosen)
}

/// Rules 5 and 6 over `(gpu, added cost)`.
fn order(priority: Priority, gpus: &[GpuView], mut scored: Vec<(usize, f64)>) -> Vec<usize> {
    let cheapest = scored.iter().map(|&(_, c)| c).fold(f64::INFINITY, f64::min);
    let near_cheapest = |c: f64| c <= cheapest + cheapest.abs() * HIGH_ROOM_TOLERANCE + 1e-12;
    let beside_high_first =
        |i: usize, c: f64| priority == Priority::Low && gpus[i].high_leases > 0 && near_cheapest(c);
    scored.sort_by(|&(a, ca), &(b, cb)| {
        beside_high_first(b, cb)
            .cmp(&beside_high_first(a, ca))
            .then(ca.partial_cmp(&cb).unwrap_or(Ordering::Equal))
            .then(gpus[a].index.cmp(&gpus[b].index))
    });
    scored.into_iter().map(|(i, _)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{GpuSelector, MemoryRequest};
    use Priority::{High, Low};

    const GI: u64 = 1 << 30;
    const UUIDS: [&str; 4] = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"];
    const EVEN: Balanced = Balanced {
        weights: Weights {
            memory: 1.0,
            compute: 1.0,
            jobs: 1.0,
        },
    };
    const ONE: GpuSelector = GpuSelector::Count(1);

    /// A GPU of 16 GiB: `(high leases, low leases, GiB leased, short-window
    /// utilisation, expected demand of its leases)`.
    type Row = (u32, u32, u64, f64, f64);

    fn gpus(rows: &[Row]) -> (Vec<GpuView<'static>>, Vec<f64>) {
        let views = rows
            .iter()
            .enumerate()
            .map(|(i, &(high, low, leased, util, _))| GpuView {
                index: i as u32,
                uuid: UUIDS[i],
                memory_allocatable: 16 * GI,
                memory_leased: leased * GI,
                lending: None,
                high_leases: high,
                low_leases: low,
                ungated_leases: 0,
                utilization: util,
                drained: false,
                reserved_for: None,
            })
            .collect();
        (views, rows.iter().map(|r| r.4).collect())
    }

    fn req(priority: Priority, gib: u64, selector: &GpuSelector) -> Request<'_> {
        Request {
            priority,
            memory: MemoryRequest::Bytes(gib * GI),
            gpu: selector,
            tenant: None,
        }
    }

    #[test]
    fn each_rule_in_a_table() {
        #[allow(clippy::type_complexity)]
        let rows: &[(&str, &[Row], Priority, u64, f64, Option<usize>)] = &[
            // rule 4: spread while an empty GPU exists (Algorithm 1 co-locates here).
            (
                "low: an empty GPU beats one running a low job",
                &[(0, 1, 4, 0.5, 0.5), (0, 0, 0, 0.0, 0.0)],
                Low,
                4,
                0.5,
                Some(1),
            ),
            (
                "low: all in use: beside the lightest load",
                &[
                    (0, 1, 4, 0.9, 0.9),
                    (0, 1, 4, 0.2, 0.2),
                    (0, 2, 8, 0.6, 0.6),
                ],
                Low,
                4,
                0.5,
                Some(1),
            ),
            // rule 3: the short window and the expected demand each show load.
            (
                "low: a GPU busy with work no lease explains is worse than an empty one",
                &[(0, 0, 0, 0.95, 0.0), (0, 0, 0, 0.0, 0.0)],
                Low,
                4,
                0.5,
                Some(1),
            ),
            (
                "low: a lease admitted but not yet running counts by its expected demand",
                &[(0, 1, 2, 0.0, 1.0), (0, 1, 2, 0.3, 0.3)],
                Low,
                2,
                0.5,
                Some(1),
            ),
            (
                "low: over one GPU of demand is worse than an empty GPU even with less memory left",
                &[(0, 2, 2, 1.0, 1.2), (0, 0, 10, 0.0, 0.0)],
                Low,
                2,
                0.5,
                Some(1),
            ),
            // rule 2: no Algorithm 1 guards.
            (
                "low: no low_nums_limit: a fifth light job may share",
                &[(0, 4, 4, 0.2, 0.2)],
                Low,
                1,
                0.05,
                Some(0),
            ),
            (
                "low: no gpu_util_limit: a busy GPU is still used when it is the only one",
                &[(0, 1, 4, 0.95, 0.95)],
                Low,
                1,
                0.5,
                Some(0),
            ),
            // rule 2: the hard rules.
            (
                "low: too little free memory",
                &[(0, 0, 14, 0.0, 0.0), (0, 3, 8, 0.9, 1.5)],
                Low,
                4,
                0.5,
                Some(1),
            ),
            (
                "high: never beside another high job, even on the only roomy GPU",
                &[(1, 0, 2, 0.1, 0.1), (0, 3, 12, 0.9, 1.5)],
                High,
                4,
                1.0,
                Some(1),
            ),
            (
                "high: nothing fits",
                &[(1, 0, 2, 0.1, 0.1), (0, 1, 14, 0.1, 0.1)],
                High,
                4,
                1.0,
                None,
            ),
            // rule 5: keep GPUs without a high job open for high arrivals.
            (
                "low: within tolerance, beside a high job rather than beside a low one",
                &[(0, 1, 2, 0.3, 0.3), (1, 0, 2, 0.3, 0.3)],
                Low,
                2,
                0.3,
                Some(1),
            ),
            (
                "low: beside a high job only within tolerance: an empty GPU is much cheaper",
                &[(1, 0, 8, 1.0, 1.0), (0, 0, 0, 0.0, 0.0)],
                Low,
                2,
                0.5,
                Some(1),
            ),
            (
                "high: the tolerance rule is for low-priority requests only",
                &[(0, 1, 2, 0.3, 0.3), (0, 0, 0, 0.0, 0.0)],
                High,
                2,
                1.0,
                Some(1),
            ),
            // rule 6: ties by index.
            (
                "equal costs: the lowest index",
                &[(0, 0, 0, 0.0, 0.0), (0, 0, 0, 0.0, 0.0)],
                Low,
                2,
                0.5,
                Some(0),
            ),
        ];
        for (what, loads, priority, gib, demand, want) in rows {
            let (views, expected) = gpus(loads);
            let got = place_balanced(
                &req(*priority, *gib, &ONE),
                &views,
                &expected,
                *demand,
                &EVEN,
            );
            match want {
                Some(i) => assert_eq!(got.map(|p| p.gpus), Ok(vec![*i]), "{what}"),
                None => assert!(
                    matches!(&got, Err(e) if e.is_transient()),
                    "{what}: {got:?}"
                ),
            }
        }
    }

    #[test]
    fn multi_gpu_requests_take_the_cheapest_and_never_sit_beside_a_high_job() {
        let (views, expected) = gpus(&[
            (1, 0, 2, 0.1, 0.1),
            (0, 1, 4, 0.5, 0.5),
            (0, 0, 0, 0.0, 0.0),
            (0, 0, 0, 0.0, 0.0),
        ]);
        let two = GpuSelector::Count(2);
        let p = place_balanced(&req(Low, 2, &two), &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![2, 3]);
        let three = GpuSelector::Count(3);
        let p = place_balanced(&req(Low, 2, &three), &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![2, 3, 1], "GPU 0 runs a high job");
        let four = GpuSelector::Count(4);
        let err = place_balanced(&req(Low, 2, &four), &views, &expected, 0.5, &EVEN).unwrap_err();
        assert!(
            err.is_transient() && err.to_string().contains("runs a high-priority job"),
            "{err}"
        );
    }

    #[test]
    fn a_high_request_skips_a_gpu_running_a_multi_gpu_lease() {
        let (mut views, expected) = gpus(&[(0, 1, 2, 0.0, 0.0), (0, 1, 8, 0.9, 0.9)]);
        views[0].ungated_leases = 1;
        let p = place_balanced(&req(High, 2, &ONE), &views, &expected, 1.0, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![1]);
    }

    #[test]
    fn narrowing_is_algorithm_1s() {
        let (mut views, expected) = gpus(&[
            (0, 0, 0, 0.0, 0.0),
            (0, 0, 0, 0.0, 0.0),
            (0, 2, 8, 0.9, 1.0),
        ]);
        views[0].reserved_for = Some("inference");
        views[1].drained = true;
        // Neither the reserved nor the drained GPU, although both are empty.
        let p = place_balanced(&req(Low, 2, &ONE), &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![2]);
        let mut mine = req(Low, 2, &ONE);
        mine.tenant = Some("inference");
        let p = place_balanced(&mine, &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![0], "the tenant's own empty GPU");
        // Explicit GPUs: the named one even though an emptier one exists.
        let named = GpuSelector::Index(vec![2]);
        let p = place_balanced(&req(Low, 2, &named), &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(p.gpus, vec![2]);
        let err = place_balanced(&req(Low, 17, &ONE), &views, &expected, 0.5, &EVEN).unwrap_err();
        assert!(!err.is_transient(), "{err}");
    }

    #[test]
    fn memory_weight_alone_picks_the_roomiest() {
        let memory_only = Balanced {
            weights: Weights {
                memory: 1.0,
                compute: 0.0,
                jobs: 0.0,
            },
        };
        let (views, expected) = gpus(&[(0, 1, 8, 0.0, 0.0), (0, 3, 2, 1.0, 1.5)]);
        let p = place_balanced(&req(Low, 2, &ONE), &views, &expected, 0.5, &memory_only).unwrap();
        assert_eq!(p.gpus, vec![1]);
        let p = place_balanced(&req(Low, 2, &ONE), &views, &expected, 0.5, &EVEN).unwrap();
        assert_eq!(
            p.gpus,
            vec![0],
            "with compute and jobs weighed, the idle one"
        );
    }

    #[test]
    fn expected_demand_prefers_measurement_then_request_then_assumption() {
        let table: &[(Priority, f64, Option<f64>, f64)] = &[
            (Low, 0.0, Some(0.3), 0.3),
            (Low, 0.8, Some(0.3), 0.3),
            (High, 0.0, Some(0.0), 0.0),
            (Low, 0.0, Some(1.7), 1.0),
            (Low, 0.4, None, 0.4),
            (Low, 0.0, None, UNMEASURED_LOW_DEMAND),
            (High, 0.0, None, UNMEASURED_HIGH_DEMAND),
            (Low, 0.0, Some(f64::NAN), UNMEASURED_LOW_DEMAND),
        ];
        for &(priority, request, measured, want) in table {
            assert_eq!(
                expected_demand(priority, request, measured),
                want,
                "{priority} {request} {measured:?}"
            );
        }
    }

    #[test]
    fn held_share_over_a_window() {
        // (first, last, minimum span, share)
        type Reading = (f64, u64);
        let table: &[(Reading, Reading, f64, Option<f64>)] = &[
            ((0.0, 0), (4.0, 2_000_000_000), 2.0, Some(0.5)),
            ((1.0, 0), (2.0, 1_000_000_000), 2.0, None),
            ((0.0, 5), (4.0, 1), 2.0, None),
            ((0.0, 0), (2.0, 9_000_000_000), 2.0, Some(1.0)),
            ((0.0, 7), (3.0, 7), 2.0, Some(0.0)),
        ];
        for &(first, last, min_span, want) in table {
            assert_eq!(
                held_share(first, last, min_span),
                want,
                "{first:?} {last:?}"
            );
        }
    }
}
