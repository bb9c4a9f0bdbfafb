use super::*;

const GI: u64 = 1 << 30;
const POLICY: Policy = Policy {
    gpu_util_limit: 0.8,
    low_nums_limit: 4,
};
const UUIDS: [&str; 4] = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"];

/// A GPU of 16 GiB: `(high leases, low leases, GiB leased, utilisation)`.
fn gpu(i: usize, (high, low, leased, util): (u32, u32, u64, f64)) -> GpuView<'static> {
    GpuView {
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
    }
}

fn gpus(loads: &[(u32, u32, u64, f64)]) -> Vec<GpuView<'static>> {
    loads.iter().enumerate().map(|(i, &l)| gpu(i, l)).collect()
}

fn req(priority: Priority, gib: u64, selector: &GpuSelector) -> Request<'_> {
    Request {
        priority,
        memory: MemoryRequest::Bytes(gib * GI),
        gpu: selector,
        tenant: None,
    }
}

const ONE: GpuSelector = GpuSelector::Count(1);
use Priority::{High, Low};

/// Each row: a node, a request, and the GPU it must land on (None: no fit now).
/// A multi-GPU lease runs ungated, so it never shares a GPU with a
/// high-priority job, whichever arrives first.
#[test]
fn multi_gpu_leases_and_high_priority_jobs_are_kept_apart() {
    let two = GpuSelector::Count(2);
    let pair = GpuSelector::Index(vec![0, 1]);
    let with_ungated = |loads: &[(u32, u32, u64, f64)], ungated: &[u32]| {
        let mut v = gpus(loads);
        for (g, n) in v.iter_mut().zip(ungated) {
            g.ungated_leases = *n;
        }
        v
    };
    #[allow(clippy::type_complexity)]
    let rows: &[(&str, Vec<GpuView>, Request, Result<Vec<usize>, &str>)] = &[
        (
            "a multi-GPU request passes over the GPU with a high job",
            gpus(&[(1, 0, 2, 0.1), (0, 1, 2, 0.1), (0, 0, 0, 0.0)]),
            req(Low, 1, &two),
            Ok(vec![1, 2]),
        ),
        (
            "a multi-GPU request that can only land beside a high job waits",
            gpus(&[(1, 0, 2, 0.1), (0, 1, 2, 0.1)]),
            req(Low, 1, &two),
            Err("runs a high-priority job, and a multi-GPU lease is not time-sliced"),
        ),
        (
            "named GPUs are all-or-nothing: one runs a high job",
            gpus(&[(0, 0, 0, 0.0), (1, 0, 2, 0.1)]),
            req(Low, 1, &pair),
            Err("multi-GPU lease is not time-sliced"),
        ),
        (
            "a high request passes over a GPU with a multi-GPU lease",
            with_ungated(&[(0, 1, 2, 0.1), (0, 1, 2, 0.1)], &[1, 0]),
            req(High, 1, &ONE),
            Ok(vec![1]),
        ),
        (
            "a high request with only multi-GPU-leased GPUs left waits",
            with_ungated(&[(0, 1, 2, 0.1)], &[1]),
            req(High, 1, &ONE),
            Err("runs a multi-GPU lease, which is not time-sliced"),
        ),
        (
            "a single-GPU low request may still share with a multi-GPU lease",
            with_ungated(&[(0, 1, 2, 0.1)], &[1]),
            req(Low, 1, &ONE),
            Ok(vec![0]),
        ),
        (
            "a multi-GPU request beside another multi-GPU lease is allowed",
            with_ungated(&[(0, 1, 2, 0.1), (0, 1, 2, 0.1)], &[1, 1]),
            req(Low, 1, &two),
            Ok(vec![0, 1]),
        ),
    ];
    for (what, view, request, expect) in rows {
        let got = place(request, view, &POLICY);
        match (expect, got) {
            (Ok(want), Ok(p)) => {
                let mut chosen = p.gpus.clone();
                chosen.sort();
                assert_eq!(&chosen, want, "{what}");
            }
            (Err(text), Err(e)) => {
                assert!(e.is_transient(), "{what}: {e}");
                assert!(e.to_string().contains(text), "{what}: {e}");
            }
            (want, got) => panic!("{what}: expected {want:?}, got {got:?}"),
        }
    }
}

#[test]
fn algorithm_1_walkthrough() {
    #[allow(clippy::type_complexity)]
    let rows: &[(&str, &[(u32, u32, u64, f64)], Priority, u64, Option<usize>)] = &[
        // --- high priority ---
        (
            "high: skips a GPU with too little free memory",
            &[(0, 1, 14, 0.1), (0, 1, 4, 0.1)],
            High,
            4,
            Some(1),
        ),
        (
            "high: skips a GPU that already has a high-priority lease",
            &[(1, 0, 2, 0.1), (0, 3, 6, 0.1)],
            High,
            4,
            Some(1),
        ),
        (
            "high: utilisation does not matter",
            &[(0, 1, 2, 0.99), (0, 0, 0, 0.0)],
            High,
            4,
            Some(0),
        ),
        (
            "high: the low-priority count limit does not matter",
            &[(0, 4, 4, 0.1)],
            High,
            4,
            Some(0),
        ),
        (
            "high: prefers fewest low-priority jobs (worst fit)",
            &[(0, 3, 3, 0.1), (0, 1, 8, 0.1), (0, 2, 2, 0.1)],
            High,
            2,
            Some(1),
        ),
        (
            "high: same number of low jobs: most free memory",
            &[(0, 2, 8, 0.1), (0, 2, 3, 0.1)],
            High,
            2,
            Some(1),
        ),
        (
            "high: a GPU running only low-priority work beats an unused one",
            &[(0, 0, 0, 0.0), (0, 3, 9, 0.5)],
            High,
            2,
            Some(1),
        ),
        (
            "high: nothing in use fits: an unused GPU of the pool",
            &[(1, 0, 2, 0.1), (0, 0, 0, 0.0)],
            High,
            2,
            Some(1),
        ),
        (
            "high: nothing fits at all",
            &[(1, 0, 2, 0.1), (0, 1, 15, 0.1)],
            High,
            2,
            None,
        ),
        // --- low priority ---
        (
            "low: skips a GPU with too little free memory",
            &[(0, 1, 15, 0.1), (0, 2, 4, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: skips a GPU busier than gpu_util_limit over the last minute",
            &[(0, 1, 2, 0.81), (0, 2, 4, 0.3)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: exactly at the limit is allowed",
            &[(0, 1, 2, 0.8), (0, 2, 4, 0.3)],
            Low,
            2,
            Some(0),
        ),
        (
            "low: skips a GPU with low_nums_limit low-priority leases",
            &[(0, 4, 4, 0.1), (0, 3, 12, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: a high-priority lease alone does not exclude a GPU",
            &[(1, 0, 4, 0.5)],
            Low,
            2,
            Some(0),
        ),
        (
            "low: prefers only-low-priority GPUs over ones with a high job",
            &[(1, 0, 2, 0.1), (0, 2, 10, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: among only-low GPUs, fewest low-priority jobs",
            &[(0, 3, 3, 0.1), (0, 1, 10, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: same count, most free memory",
            &[(0, 2, 9, 0.1), (0, 2, 5, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: among GPUs with a high job, fewest low-priority jobs",
            &[(1, 2, 4, 0.1), (1, 1, 8, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: a GPU with a high job beats an unused one",
            &[(0, 0, 0, 0.0), (1, 0, 4, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: nothing in use fits: an unused GPU of the pool",
            &[(0, 4, 4, 0.1), (0, 0, 0, 0.0)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: unused GPUs are taken roomiest first, then by index",
            &[(0, 4, 4, 0.1), (0, 0, 0, 0.0), (0, 0, 0, 0.0)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: an unused GPU that is busy (someone else's work) is skipped",
            &[(0, 0, 0, 0.95), (0, 0, 0, 0.1)],
            Low,
            2,
            Some(1),
        ),
        (
            "low: nothing fits at all",
            &[(0, 4, 4, 0.1), (0, 1, 2, 0.9)],
            Low,
            2,
            None,
        ),
    ];
    for (what, loads, priority, gib, want) in rows {
        let views = gpus(loads);
        let got = place(&req(*priority, *gib, &ONE), &views, &POLICY);
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
fn skip_reasons_name_each_rule() {
    let busy = gpu(0, (0, 1, 1, 0.9));
    assert_eq!(
        skip_reason(&busy, Low, 1, GI, &POLICY),
        Some(Skip::Busy {
            utilization: 0.9,
            limit: 0.8
        })
    );
    let full = gpu(0, (0, 4, 4, 0.1));
    assert_eq!(
        skip_reason(&full, Low, 1, GI, &POLICY),
        Some(Skip::TooManyLowPriorityLeases {
            leases: 4,
            limit: 4
        })
    );
    assert_eq!(skip_reason(&full, High, 1, GI, &POLICY), None);
    let with_high = gpu(0, (1, 0, 4, 0.1));
    assert_eq!(
        skip_reason(&with_high, High, 1, GI, &POLICY),
        Some(Skip::HasHighPriorityLease)
    );
    assert_eq!(
        skip_reason(&with_high, Low, 1, 13 * GI, &POLICY),
        Some(Skip::TooLittleMemory {
            wanted: 13 * GI,
            free: 12 * GI
        })
    );
    let mut drained = gpu(0, (0, 0, 0, 0.0));
    drained.drained = true;
    assert_eq!(
        skip_reason(&drained, High, 1, GI, &POLICY),
        Some(Skip::Drained)
    );
}

#[test]
fn no_fit_error_says_what_was_asked_and_what_is_free() {
    let views = gpus(&[(1, 0, 2, 0.1), (0, 1, 15, 0.1)]);
    let err = place(&req(High, 2, &ONE), &views, &POLICY).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("high-priority request for 2Gi now"), "{text}");
    assert!(
        text.contains("GPU 0 (GPU-0): already runs a high-priority job"),
        "{text}"
    );
    assert!(
        text.contains("GPU 1 (GPU-1): 1Gi free, 2Gi wanted"),
        "{text}"
    );
}

#[test]
fn count_n_takes_the_n_best_in_worst_fit_order_then_the_pool() {
    let views = gpus(&[
        (0, 0, 0, 0.0),
        (0, 2, 4, 0.1),
        (0, 1, 4, 0.1),
        (1, 0, 2, 0.1),
    ]);
    let two = GpuSelector::Count(2);
    let p = place(&req(Low, 2, &two), &views, &POLICY).unwrap();
    assert_eq!(p.gpus, vec![2, 1]);
    let three = GpuSelector::Count(3);
    let p = place(&req(High, 2, &three), &views, &POLICY).unwrap();
    assert_eq!(p.gpus, vec![2, 1, 0], "in use first, then the unused GPU");
    let four = GpuSelector::Count(4);
    let err = place(&req(High, 2, &four), &views, &POLICY).unwrap_err();
    assert!(err.is_transient(), "GPU 3 has a high job: wait, {err}");
}

#[test]
fn explicit_requests_narrow_first_and_are_all_or_nothing() {
    let views = gpus(&[(0, 0, 0, 0.0), (0, 1, 15, 0.1), (0, 0, 0, 0.0)]);
    let idx = GpuSelector::Index(vec![2, 0]);
    let p = place(&req(Low, 2, &idx), &views, &POLICY).unwrap();
    assert_eq!(p.gpus, vec![2, 0], "the named GPUs, in the order named");
    let idx = GpuSelector::Index(vec![0, 1]);
    let err = place(&req(Low, 2, &idx), &views, &POLICY).unwrap_err();
    assert!(err.is_transient(), "{err}");
    let by_uuid = GpuSelector::Uuid(vec!["GPU-1".into()]);
    let err = place(&req(Low, 2, &by_uuid), &views, &POLICY).unwrap_err();
    assert!(err.to_string().contains("GPU 1 (GPU-1): 1Gi free"), "{err}");
    // An explicit choice is not widened to another GPU even if one is free.
    let by_uuid = GpuSelector::Uuid(vec!["GPU-1".into()]);
    assert!(place(&req(Low, 1, &by_uuid), &views, &POLICY).is_ok());
}

#[test]
fn unknown_gpus_and_impossible_requests_fail_at_once() {
    let views = gpus(&[(0, 0, 0, 0.0), (0, 0, 0, 0.0)]);
    let err = place(&req(Low, 1, &GpuSelector::Index(vec![7])), &views, &POLICY).unwrap_err();
    assert_eq!(
        err.to_string(),
        "gpu index:7: this node has no GPU with index 7"
    );
    let uuid = GpuSelector::Uuid(vec!["GPU-x".into()]);
    let err = place(&req(Low, 1, &uuid), &views, &POLICY).unwrap_err();
    assert!(err.to_string().contains("GPU-x") && !err.is_transient());
    let err = place(&req(Low, 1, &GpuSelector::Count(3)), &views, &POLICY).unwrap_err();
    assert!(matches!(
        err,
        PlacementError::TooFewGpus {
            wanted: 3,
            available: 2,
            ..
        }
    ));
    let err = place(&req(Low, 17, &ONE), &views, &POLICY).unwrap_err();
    assert_eq!(
        err,
        PlacementError::NeverFits {
            wanted: 17 * GI,
            largest: 16 * GI
        }
    );
    assert!(!err.is_transient());
}

#[test]
fn tenant_reservations() {
    let mut views = gpus(&[(0, 0, 0, 0.0), (0, 0, 0, 0.0)]);
    views[0].reserved_for = Some("inference");
    // Others never land on a reserved GPU, even when it is the only one with room.
    let p = place(&req(Low, 2, &ONE), &views, &POLICY).unwrap();
    assert_eq!(p.gpus, vec![1]);
    views[1].memory_leased = 15 * GI;
    views[1].low_leases = 1;
    let err = place(&req(Low, 2, &ONE), &views, &POLICY).unwrap_err();
    assert!(
        err.is_transient() && !err.to_string().contains("GPU-0"),
        "{err}"
    );
    // The tenant may use its reserved GPU (and the common pool).
    let mut r = req(Low, 2, &ONE);
    r.tenant = Some("inference");
    assert_eq!(place(&r, &views, &POLICY).unwrap().gpus, vec![0]);
    // Naming another tenant's GPU explicitly is refused outright.
    let idx = GpuSelector::Index(vec![0]);
    let err = place(&req(Low, 1, &idx), &views, &POLICY).unwrap_err();
    assert!(matches!(err, PlacementError::ReservedGpu { .. }), "{err}");
    // count beyond the GPUs open to this requester can never succeed.
    let two = GpuSelector::Count(2);
    let err = place(&req(Low, 1, &two), &views, &POLICY).unwrap_err();
    assert!(
        matches!(err, PlacementError::TooFewGpus { available: 1, .. }),
        "{err}"
    );
}

#[test]
fn drained_gpus_are_skipped_but_the_request_may_wait() {
    let mut views = gpus(&[(0, 0, 0, 0.0), (0, 1, 2, 0.0)]);
    views[1].drained = true;
    assert_eq!(
        place(&req(Low, 2, &ONE), &views, &POLICY).unwrap().gpus,
        vec![0]
    );
    views[0].drained = true;
    let err = place(&req(Low, 2, &ONE), &views, &POLICY).unwrap_err();
    assert!(
        err.is_transient() && err.to_string().contains("drained"),
        "{err}"
    );
}

#[test]
fn fractions_resolve_against_each_gpu_and_the_smallest_chosen() {
    let mut views = gpus(&[(0, 0, 0, 0.0), (0, 0, 0, 0.0)]);
    views[1].memory_allocatable = 8 * GI;
    let quarter: MemoryRequest = "25%".parse().unwrap();
    let one = GpuSelector::Count(1);
    let r = Request {
        priority: Low,
        memory: quarter,
        gpu: &one,
        tenant: None,
    };
    assert_eq!(place(&r, &views, &POLICY).unwrap().memory_bytes, 4 * GI);
    let both = GpuSelector::Count(2);
    let r = Request { gpu: &both, ..r };
    assert_eq!(place(&r, &views, &POLICY).unwrap().memory_bytes, 2 * GI);
}

#[test]
fn fragmentation_is_enough_free_memory_in_holes_too_small() {
    // (free per open GPU in GiB, wanted GiB, count, fragmented)
    let table: &[(&[u64], u64, usize, bool)] = &[
        (&[3, 3], 4, 1, true),
        (&[3, 3], 7, 1, false),
        (&[4, 1], 4, 1, false),
        (&[4, 3, 2], 4, 2, true),
        (&[4, 4], 4, 2, false),
        (&[2, 1], 4, 1, false),
        (&[], 1, 1, false),
    ];
    for &(free, wanted, count, want) in table {
        let free: Vec<u64> = free.iter().map(|g| g * GI).collect();
        assert_eq!(
            memory_fragmented(&free, wanted * GI, count),
            want,
            "{free:?} {wanted} x{count}"
        );
    }
}

#[test]
fn a_quota_must_hold_more_than_one_process_overhead() {
    const MI: u64 = 1 << 20;
    // (quota, estimated overhead, accepted)
    let table: &[(u64, u64, bool)] = &[
        (64 * MI, 0, true), // overhead not accounted (no NVML)
        (300 * MI, 300 * MI, false),
        (200 * MI, 300 * MI, false),
        (301 * MI, 300 * MI, true),
        (4 << 30, 300 * MI, true),
    ];
    for &(quota, overhead, ok) in table {
        let r = holds_a_process(quota, overhead);
        assert_eq!(r.is_ok(), ok, "{quota} {overhead}");
        if let Err(e) = r {
            assert!(!e.is_transient());
            let text = e.to_string();
            assert!(
                text.contains("arbiter.context_memory_estimate") && text.contains("300Mi"),
                "{text}"
            );
        }
    }
}
