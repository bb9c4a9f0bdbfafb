//! The configured placement policy as the state applies it.

use super::tests::{config, open_with_probe, request};
use super::*;
use crate::process::tests::FakeProcs;
use gpushare_config::{PlacementConfig, PlacementPolicy};
use gpushare_proto::Fraction;

fn arbiter(dir: &std::path::Path, gpus: usize, policy: PlacementPolicy) -> Arbiter {
    let mut arbiter = open_with_probe(config(dir), gpus, Box::new(FakeProcs::default()));
    arbiter.set_placement(PlacementConfig {
        policy,
        ..Default::default()
    });
    arbiter
}

fn gpu_of(arbiter: &mut Arbiter, name: &str, request: ReserveRequest) -> String {
    let mut r = request;
    r.container_id = name.into();
    arbiter.reserve_now(r).unwrap().lease.gpus[0].clone()
}

#[test]
fn wang_co_locates_two_low_jobs_and_balanced_spreads_them() {
    for (policy, second_on) in [
        (PlacementPolicy::Wang, "GPU-0"),
        (PlacementPolicy::Balanced, "GPU-1"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut a = arbiter(dir.path(), 2, policy);
        let low = request("x", "2Gi", Priority::Low);
        assert_eq!(gpu_of(&mut a, "a", low.clone()), "GPU-0", "{policy:?}");
        assert_eq!(gpu_of(&mut a, "b", low), second_on, "{policy:?}");
    }
}

#[test]
fn balanced_sees_utilisation_over_the_short_window() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 2, PlacementPolicy::Balanced);
    let busy = GpuSample {
        utilization: 0.95,
        memory_used: 0,
    };
    a.record_samples(Instant::now(), &[("GPU-0".into(), busy)]);
    let low = request("x", "2Gi", Priority::Low);
    assert_eq!(gpu_of(&mut a, "a", low), "GPU-1");
}

#[test]
fn balanced_counts_an_unmeasured_lease_by_its_compute_request() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 2, PlacementPolicy::Balanced);
    let mut heavy = request("x", "2Gi", Priority::Low);
    heavy.compute_request = Fraction::new(0.9).unwrap();
    heavy.gpu = gpushare_proto::GpuSelector::Index(vec![0]);
    let mut light = request("x", "2Gi", Priority::Low);
    light.compute_request = Fraction::new(0.1).unwrap();
    light.gpu = gpushare_proto::GpuSelector::Index(vec![1]);
    assert_eq!(gpu_of(&mut a, "heavy", heavy), "GPU-0");
    assert_eq!(gpu_of(&mut a, "light", light), "GPU-1");
    // Both unmeasured: without the requests each would count 0.5, and the tie go to GPU 0.
    let low = request("x", "2Gi", Priority::Low);
    assert_eq!(gpu_of(&mut a, "next", low), "GPU-1");
}

#[test]
fn a_wait_for_memory_split_across_gpus_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 2, PlacementPolicy::Balanced);
    for (name, gpu) in [("a", 0), ("b", 1)] {
        let mut r = request(name, "5Gi", Priority::Low);
        r.gpu = gpushare_proto::GpuSelector::Index(vec![gpu]);
        a.reserve_now(r).unwrap();
    }
    // 3 GiB free on each GPU: 4 GiB waits although 6 GiB are free in all.
    let _fragmented = a.submit(request("c", "4Gi", Priority::Low), Instant::now());
    assert_eq!(a.waits_fragmented(), 1);
    a.record_samples(Instant::now(), &[]);
    assert_eq!(a.waits_fragmented(), 1, "a request counts once");
    // 7 GiB would not fit even in one hole of all the free memory: not fragmentation.
    let _too_big = a.submit(request("d", "7Gi", Priority::Low), Instant::now());
    assert_eq!(a.waits_fragmented(), 1);
    let status = a.status();
    assert_eq!(status.placement_waits_fragmented, 1);
    let holes: Vec<u64> = status
        .placement
        .iter()
        .map(|h| h.largest_free_hole)
        .collect();
    assert_eq!(holes, vec![3 << 30, 3 << 30]);
    let demand: Vec<f64> = status.placement.iter().map(|h| h.expected_demand).collect();
    assert_eq!(
        demand,
        vec![
            crate::placement::balanced::UNMEASURED_LOW_DEMAND,
            crate::placement::balanced::UNMEASURED_LOW_DEMAND
        ]
    );
}

/// One 8 GiB GPU filled, then 5, 4 and 4 GiB waiting; the filler released.
/// Returns which of the three were granted in the admission pass that followed.
fn after_release(batch: bool) -> Vec<bool> {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_with_probe(config(dir.path()), 1, Box::new(FakeProcs::default()));
    a.set_placement(PlacementConfig {
        batch,
        ..Default::default()
    });
    let filler = a
        .reserve_now(request("filler", "8Gi", Priority::Low))
        .unwrap();
    let mut replies: Vec<_> = [("five", "5Gi"), ("four", "4Gi"), ("four-too", "4Gi")]
        .into_iter()
        .map(|(name, memory)| a.submit(request(name, memory, Priority::Low), Instant::now()))
        .collect();
    assert!(
        replies.iter_mut().all(|r| r.try_recv().is_err()),
        "all wait"
    );
    a.release(&filler.lease.id).unwrap();
    replies
        .iter_mut()
        .map(|r| matches!(r.try_recv(), Ok(Ok(_))))
        .collect()
}

#[test]
fn the_batch_search_places_two_waiters_where_one_at_a_time_places_one() {
    assert_eq!(after_release(false), vec![true, false, false]);
    assert_eq!(after_release(true), vec![false, true, true]);
}

#[test]
fn balanced_learns_each_leases_demand_from_its_held_token_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 2, PlacementPolicy::Balanced);
    let mut ids = Vec::new();
    for gpu in [0, 1] {
        let mut r = request(&format!("on-{gpu}"), "2Gi", Priority::Low);
        r.gpu = gpushare_proto::GpuSelector::Index(vec![gpu]);
        ids.push(a.reserve_now(r).unwrap().lease);
    }
    let holding = |lease: &Lease, held_ns: u64| crate::tokens::Holding {
        overran_ns: 0,
        gpu: lease.gpus[0].clone(),
        lease: lease.id.clone(),
        pid: Some(1),
        priority: Priority::Low,
        held_ns,
    };
    let t = Instant::now();
    a.record_holdings(t, vec![holding(&ids[0], 0), holding(&ids[1], 0)]);
    // Not watched for half the window yet: both still count the 0.5 assumed.
    let early = t + Duration::from_secs(1);
    a.record_holdings(
        early,
        vec![holding(&ids[0], 900_000_000), holding(&ids[1], 0)],
    );
    assert_eq!(a.status().placement[0].expected_demand, 0.5);
    // Over 3 s of a 5 s window: GPU 0's lease held the token 90 % of the time, GPU 1's 10 %.
    let later = t + Duration::from_secs(3);
    a.record_holdings(
        later,
        vec![
            holding(&ids[0], 2_700_000_000),
            holding(&ids[1], 300_000_000),
        ],
    );
    let demand: Vec<f64> = a
        .status()
        .placement
        .iter()
        .map(|h| h.expected_demand)
        .collect();
    assert!(
        (demand[0] - 0.9).abs() < 1e-9 && (demand[1] - 0.1).abs() < 1e-9,
        "{demand:?}"
    );
    // Unmeasured, the two would tie and GPU 0 (the lower index) win.
    let low = request("x", "2Gi", Priority::Low);
    assert_eq!(gpu_of(&mut a, "next", low), "GPU-1");
}

#[test]
fn each_placement_decision_and_batch_search_is_timed_in_the_status() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 2, PlacementPolicy::Balanced);
    gpu_of(&mut a, "a", request("x", "2Gi", Priority::Low));
    // 7 GiB fits nowhere (8 GiB GPUs less 2 GiB and 5 GiB): decided, and it waits.
    let mut held = request("x", "5Gi", Priority::Low);
    held.gpu = gpushare_proto::GpuSelector::Index(vec![1]);
    a.reserve_now(held).unwrap();
    let _waits = a.submit(request("big", "7Gi", Priority::Low), Instant::now());
    let times = a.status().placement_times;
    assert_eq!(times.decisions.count, 3, "{times:?}");
    assert!(times.decisions.max_ns > 0, "{times:?}");
    assert_eq!(
        times.decisions.counts.iter().sum::<u64>(),
        3,
        "every decision lands in a bucket: {times:?}"
    );
    assert_eq!(times.batch_searches.count, 0, "batch is off: {times:?}");
}

#[test]
fn a_batch_search_over_two_waiting_requests_is_timed() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = open_with_probe(config(dir.path()), 1, Box::new(FakeProcs::default()));
    a.set_placement(PlacementConfig {
        batch: true,
        ..Default::default()
    });
    a.reserve_now(request("a", "6Gi", Priority::Low)).unwrap();
    let _first = a.submit(request("b", "4Gi", Priority::Low), Instant::now());
    assert_eq!(
        a.status().placement_times.batch_searches.count,
        0,
        "one waiter: no search"
    );
    let _second = a.submit(request("c", "4Gi", Priority::Low), Instant::now());
    let times = a.status().placement_times;
    assert!(times.batch_searches.count >= 1, "{times:?}");
    assert!(times.batch_searches.max_ns > 0, "{times:?}");
}

/// NVML's total is more than CUDA can allocate: quotas, fractions included, are shared out
/// of the allocatable memory, so a GPU packed to its limit holds every quota.
#[test]
fn quotas_and_fractions_are_of_the_allocatable_memory_not_nvml_s_total() {
    const GI: u64 = 1 << 30;
    const ALLOCATABLE: u64 = 8 * GI - 512 * (1 << 20);
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 1, PlacementPolicy::Balanced);
    a.inventory.gpus[0].memory_allocatable = ALLOCATABLE;
    let mut quotas = 0;
    for name in ["a", "b", "c", "d"] {
        let mut r = request("x", "25%", Priority::Low);
        r.container_id = name.into();
        let lease = a.reserve_now(r).unwrap().lease;
        assert_eq!(
            lease.memory_bytes,
            ALLOCATABLE / 4,
            "a quarter of what CUDA can allocate"
        );
        quotas += lease.memory_bytes;
    }
    assert!(quotas <= ALLOCATABLE);
    let mut more = request("e", "1Mi", Priority::Low);
    more.container_id = "e".into();
    assert!(a.reserve_now(more).is_err(), "the GPU is full");
    let status = a.status();
    assert_eq!(
        (
            status.gpus[0].memory_total,
            status.gpus[0].memory_allocatable
        ),
        (8 * GI, ALLOCATABLE)
    );
    let dir = tempfile::tempdir().unwrap();
    let mut a = arbiter(dir.path(), 1, PlacementPolicy::Balanced);
    a.inventory.gpus[0].memory_allocatable = ALLOCATABLE;
    let err = a
        .reserve_now(request("whole", "8Gi", Priority::Low))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("more than any candidate GPU has (7680Mi at most)"),
        "NVML's total would never fit: {err}"
    );
}
