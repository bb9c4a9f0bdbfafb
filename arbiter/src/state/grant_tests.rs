//! The grant table through the state: placement, waiting, superseding, the room
//! ordinary leases may not take, durability, and reserving against grants.

use gpushare_proto::grant::{Grant, GrantAmount, GrantId, GrantRequest, PodBinding};
use gpushare_proto::{Fraction, GpuSelector};

use super::tests::{config, open_with_probe, request};
use super::*;
use crate::process::tests::FakeProcs;

const GI: u64 = 1 << 30;

/// An arbiter with `gpus` 8 GiB GPUs.
fn setup(gpus: usize) -> (tempfile::TempDir, Arbiter) {
    let dir = tempfile::tempdir().unwrap();
    let arbiter = open_with_probe(config(dir.path()), gpus, Box::new(FakeProcs::default()));
    (dir, arbiter)
}

fn reopen(arbiter: Arbiter, gpus: usize) -> Arbiter {
    let config = arbiter.config.clone();
    if let Some(t) = arbiter.last_ticket {
        arbiter.store().wait_blocking(t).unwrap();
    }
    drop(arbiter);
    open_with_probe(config, gpus, Box::new(FakeProcs::default()))
}

fn memory(gib: u64, device: &str) -> GrantRequest {
    GrantRequest {
        amount: GrantAmount::Memory { bytes: gib * GI },
        device_ids: vec![device.to_owned()],
    }
}

fn grant(arbiter: &mut Arbiter, request: GrantRequest) -> Grant {
    let (g, ticket) = arbiter.make_grant(request).unwrap();
    arbiter.store().wait_blocking(ticket.unwrap()).unwrap();
    g
}

fn leased(arbiter: &Arbiter) -> Vec<u64> {
    arbiter
        .status()
        .gpus
        .iter()
        .map(|g| g.memory_leased / GI)
        .collect()
}

/// A reserve as the runtime sends it for a Kubernetes container.
fn pod_request(container: &str, grants: &[&GrantId]) -> ReserveRequest {
    let mut r = request(container, "1Gi", Priority::Low);
    r.memory = None;
    r.pod = Some(PodBinding {
        namespace: Some("default".into()),
        name: Some("pod-a".into()),
        container: Some("main".into()),
        grants: grants.iter().map(|g| (*g).clone()).collect(),
    });
    r
}

// ----- making grants -----

#[test]
fn a_memory_grant_goes_to_the_gpu_with_the_most_room_and_takes_it() {
    let (_dir, mut arbiter) = setup(2);
    arbiter
        .reserve_now(request("outside", "3Gi", Priority::Low))
        .unwrap();
    let g = grant(&mut arbiter, memory(2, "memory-0"));
    assert!(GrantId::is_well_formed(&g.id.0), "{}", g.id);
    assert!(g.id.0.starts_with("g-"), "{}", g.id);
    let outside_gpu = arbiter.list()[0].gpus[0].clone();
    assert_ne!(
        g.gpu.as_ref(),
        Some(&outside_gpu),
        "worst fit: the empty GPU"
    );
    let mut room = leased(&arbiter);
    room.sort();
    assert_eq!(room, vec![2, 3], "the grant's room counts as leased");
    assert_eq!(arbiter.grants(), vec![g]);
}

#[test]
fn a_grant_no_gpu_can_hold_waits_and_is_placed_when_a_release_makes_room() {
    let (_dir, mut arbiter) = setup(1);
    let lease = arbiter
        .reserve_now(request("outside", "6Gi", Priority::Low))
        .unwrap();
    let waiting = grant(&mut arbiter, memory(4, "memory-0"));
    assert_eq!(waiting.gpu, None, "never an error for want of room");
    let younger = grant(&mut arbiter, memory(1, "memory-1"));
    assert_eq!(
        younger.gpu.as_deref(),
        Some("GPU-0"),
        "a smaller one fits now"
    );
    arbiter.release(&lease.lease.id).unwrap();
    assert_eq!(
        arbiter.grant(&waiting.id).unwrap().gpu.as_deref(),
        Some("GPU-0"),
        "placed at the release's admission pass"
    );
    assert_eq!(leased(&arbiter), vec![5]);
}

#[test]
fn waiting_grants_are_placed_oldest_first() {
    let (_dir, mut arbiter) = setup(1);
    let lease = arbiter
        .reserve_now(request("outside", "7Gi", Priority::Low))
        .unwrap();
    let older = grant(&mut arbiter, memory(5, "memory-0"));
    let younger = grant(&mut arbiter, memory(5, "memory-1"));
    assert!(older.created_unix_ms < younger.created_unix_ms);
    arbiter.release(&lease.lease.id).unwrap();
    assert_eq!(
        arbiter.grant(&older.id).unwrap().gpu.as_deref(),
        Some("GPU-0")
    );
    assert_eq!(arbiter.grant(&younger.id).unwrap().gpu, None);
}

#[test]
fn an_ordinary_reserve_cannot_take_the_room_of_a_grant() {
    let (_dir, mut arbiter) = setup(1);
    grant(&mut arbiter, memory(6, "memory-0"));
    let err = arbiter
        .reserve_now(request("outside", "4Gi", Priority::Low))
        .unwrap_err();
    assert!(matches!(err, StateError::QueueTimeout { .. }), "{err}");
    arbiter
        .reserve_now(request("outside-2", "2Gi", Priority::Low))
        .expect("the rest of the GPU is free");
}

#[test]
fn a_grant_of_the_same_devices_supersedes_the_older_one() {
    let (_dir, mut arbiter) = setup(1);
    let old = grant(&mut arbiter, memory(6, "memory-0"));
    let high = grant(
        &mut arbiter,
        GrantRequest {
            amount: GrantAmount::High,
            device_ids: vec!["memory-0".into()],
        },
    );
    let new = grant(
        &mut arbiter,
        GrantRequest {
            amount: GrantAmount::Memory { bytes: 6 * GI },
            device_ids: vec!["memory-5".into(), "memory-0".into()],
        },
    );
    assert_eq!(
        new.gpu.as_deref(),
        Some("GPU-0"),
        "the old grant's room is free again"
    );
    let ids: Vec<GrantId> = arbiter.grants().into_iter().map(|g| g.id).collect();
    assert_eq!(
        ids,
        vec![high.id, new.id],
        "another resource with the same id stays"
    );
    assert!(arbiter.grant(&old.id).is_none());
    assert_eq!(leased(&arbiter), vec![6]);
}

#[test]
fn releasing_a_grant_is_idempotent_and_frees_its_room() {
    let (_dir, mut arbiter) = setup(1);
    let g = grant(&mut arbiter, memory(6, "memory-0"));
    let waiting = grant(&mut arbiter, memory(4, "memory-1"));
    assert_eq!(waiting.gpu, None);
    assert!(arbiter.release_grant(&g.id).unwrap().0);
    assert!(!arbiter.release_grant(&g.id).unwrap().0);
    assert_eq!(
        arbiter.grant(&waiting.id).unwrap().gpu.as_deref(),
        Some("GPU-0")
    );
    assert_eq!(leased(&arbiter), vec![4]);
}

#[test]
fn bad_grant_requests_name_the_field_the_value_and_what_is_accepted() {
    let (_dir, mut arbiter) = setup(1);
    let cases = [
        (memory(0, "memory-0"), "amount.bytes = 0"),
        (
            GrantRequest {
                amount: GrantAmount::Compute { percent: 101 },
                device_ids: vec!["compute-0".into()],
            },
            "amount.percent = 101: a compute grant holds 1 to 100 percent",
        ),
        (
            GrantRequest {
                amount: GrantAmount::Compute { percent: 0 },
                device_ids: vec!["compute-0".into()],
            },
            "amount.percent = 0",
        ),
        (
            GrantRequest {
                amount: GrantAmount::High,
                device_ids: vec![],
            },
            "device_ids = []: at least one",
        ),
        (memory(1, ""), "device_ids = \"\": each device id"),
        (memory(1, "a\nb"), "device_ids = \"a\\nb\""),
        (memory(1, &"x".repeat(129)), "1 to 128 printable"),
    ];
    for (request, wanted) in cases {
        let err = arbiter.make_grant(request.clone()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{request:?}");
        assert!(err.to_string().contains(wanted), "{request:?}: {err}");
    }
    assert!(arbiter.grants().is_empty());
    assert!(arbiter.make_grant(memory(1, &"x".repeat(128))).is_ok());
}

/// A memory grant is placed on one GPU: one larger than every GPU of the node
/// would wait for room for ever, holding kube-scheduler's count of the node.
#[test]
fn a_memory_grant_beyond_every_gpu_is_refused_naming_the_largest() {
    let (_dir, mut arbiter) = setup(2);
    for gib in [9, 5_000] {
        let err = arbiter.make_grant(memory(gib, "memory-0")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{gib} GiB: {err}");
        let message = err.to_string();
        assert!(
            message.contains("amount.bytes") && message.contains(&(gib * GI).to_string()),
            "{message}"
        );
        assert!(message.contains(&(8 * GI).to_string()), "{message}");
    }
    assert!(arbiter.grants().is_empty());
    assert!(grant(&mut arbiter, memory(8, "memory-0")).gpu.is_some());
}

// ----- durability -----

#[test]
fn grants_survive_a_reopen_with_their_placement_and_order() {
    let (_dir, mut arbiter) = setup(1);
    let placed = grant(&mut arbiter, memory(6, "memory-0"));
    let waiting = grant(&mut arbiter, memory(4, "memory-1"));
    let gone = grant(&mut arbiter, memory(1, "memory-2"));
    arbiter.release_grant(&gone.id).unwrap();
    let reopened = reopen(arbiter, 1);
    assert_eq!(reopened.grants(), vec![placed, waiting]);
    assert_eq!(leased(&reopened), vec![6]);
}

#[test]
fn a_grant_is_refused_while_the_store_cannot_be_written() {
    let (_dir, mut arbiter) = setup(1);
    let kept = grant(&mut arbiter, memory(1, "memory-0"));
    arbiter.store().fail_writes(true);
    // The first change finds writes failing only when its batch fails.
    let (_, ticket) = arbiter.make_grant(memory(1, "memory-1")).unwrap();
    assert!(arbiter.store().wait_blocking(ticket.unwrap()).is_err());
    let err = arbiter.make_grant(memory(1, "memory-2")).unwrap_err();
    assert!(matches!(err, StateError::Store(_)), "{err}");
    assert!(arbiter.release_grant(&kept.id).is_err());
    arbiter.store().fail_writes(false);
    let (g, ticket) = arbiter.make_grant(memory(1, "memory-3")).unwrap();
    arbiter.store().wait_blocking(ticket.unwrap()).unwrap();
    let reopened = reopen(arbiter, 1);
    let ids: Vec<GrantId> = reopened.grants().into_iter().map(|g| g.id).collect();
    assert!(ids.contains(&kept.id) && ids.contains(&g.id), "{ids:?}");
}

// ----- reserving against grants -----

fn high() -> GrantRequest {
    GrantRequest {
        amount: GrantAmount::High,
        device_ids: vec!["high-0".into()],
    }
}

fn compute(percent: u32) -> GrantRequest {
    GrantRequest {
        amount: GrantAmount::Compute { percent },
        device_ids: vec!["compute-0".into()],
    }
}

#[test]
fn a_lease_against_a_memory_grant_gets_its_bytes_its_gpu_and_binds_it() {
    let (_dir, mut arbiter) = setup(2);
    let g = grant(&mut arbiter, memory(3, "memory-0"));
    let request = pod_request("c1", &[&g.id]);
    let lease = arbiter.reserve_now(request.clone()).unwrap().lease;
    assert_eq!(lease.memory_bytes, 3 * GI, "the quota is the grant's");
    assert_eq!(lease.gpus, vec![g.gpu.clone().unwrap()]);
    assert_eq!(lease.pod, request.pod);
    assert_eq!(arbiter.grant(&g.id).unwrap().lease, Some(lease.id.clone()));
    let mut room = leased(&arbiter);
    room.sort();
    assert_eq!(
        room,
        vec![0, 3],
        "the grant's room became the lease's, once"
    );
}

#[test]
fn a_request_that_carries_a_pod_but_no_grant_is_placed_as_usual() {
    let (_dir, mut arbiter) = setup(1);
    let request = pod_request("c1", &[]);
    let lease = arbiter.reserve_now(request.clone()).unwrap().lease;
    assert_eq!(lease.pod, request.pod);
    assert_eq!(
        lease.memory_bytes,
        arbiter.config.default_memory.resolve(8 * GI)
    );
}

#[test]
fn a_memory_annotation_larger_than_the_grant_names_both() {
    let (_dir, mut arbiter) = setup(1);
    let g = grant(&mut arbiter, memory(4, "memory-0"));
    let mut request = pod_request("c1", &[&g.id]);
    request.memory = Some("8Gi".parse().unwrap());
    let err = arbiter.reserve_now(request.clone()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    let text = err.to_string();
    assert!(
        text.contains("gpushare.io/memory = 8Gi")
            && text.contains(&format!("grant {} holds (4Gi)", g.id)),
        "{text}"
    );
    // A fraction is resolved against the grant's GPU (8 GiB): 75 % is 6 GiB.
    request.memory = Some("75%".parse().unwrap());
    let err = arbiter.reserve_now(request.clone()).unwrap_err();
    assert!(err.to_string().contains("asks for more than"), "{err}");
    request.memory = Some("2Gi".parse().unwrap());
    let lease = arbiter.reserve_now(request).unwrap().lease;
    assert_eq!(
        lease.memory_bytes,
        4 * GI,
        "a smaller annotation gets the grant"
    );
}

#[test]
fn an_unknown_grant_is_refused_saying_its_allocation_is_gone() {
    let (_dir, mut arbiter) = setup(1);
    let g = grant(&mut arbiter, memory(1, "memory-0"));
    arbiter.release_grant(&g.id).unwrap();
    let err = arbiter
        .reserve_now(pod_request("c1", &[&g.id]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    let text = err.to_string();
    assert!(
        text.contains(&g.id.0) && text.contains("allocation is gone"),
        "{text}"
    );
    assert!(arbiter.list().is_empty());
}

#[test]
fn a_grant_backs_one_live_lease_and_a_restarted_container_reuses_it() {
    let (_dir, mut arbiter) = setup(2);
    let g = grant(&mut arbiter, memory(2, "memory-0"));
    let first = arbiter.reserve_now(pod_request("c1", &[&g.id])).unwrap();
    let retry = arbiter.reserve_now(pod_request("c1", &[&g.id])).unwrap();
    assert!(!retry.fresh, "a retry gets its container's lease");
    assert_eq!(retry.lease.id, first.lease.id);

    let err = arbiter
        .reserve_now(pod_request("c2", &[&g.id]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    let text = err.to_string();
    assert!(
        text.contains(&g.id.0) && text.contains("\"c1\"") && text.contains(&first.lease.id.0),
        "{text}"
    );

    arbiter.release(&first.lease.id).unwrap();
    let kept = arbiter.grant(&g.id).unwrap();
    assert_eq!(
        (kept.lease.clone(), kept.gpu.clone()),
        (None, g.gpu.clone())
    );
    assert_eq!(
        leased(&arbiter).iter().sum::<u64>(),
        2,
        "the room stays held"
    );
    let restarted = arbiter.reserve_now(pod_request("c2", &[&g.id])).unwrap();
    assert_eq!(restarted.lease.gpus, vec![g.gpu.clone().unwrap()]);
    assert_eq!(
        arbiter.grant(&g.id).unwrap().lease,
        Some(restarted.lease.id)
    );
}

#[test]
fn a_reserve_against_a_waiting_grant_waits_and_is_admitted_when_room_frees() {
    let (_dir, mut arbiter) = setup(1);
    let outside = arbiter
        .reserve_now(request("outside", "6Gi", Priority::Low))
        .unwrap();
    let g = grant(&mut arbiter, memory(4, "memory-0"));
    assert_eq!(g.gpu, None);
    let mut reply = arbiter.submit(pod_request("c1", &[&g.id]), Instant::now());
    assert!(reply.try_recv().is_err(), "it waits in the admission queue");
    arbiter.release(&outside.lease.id).unwrap();
    let lease = reply.try_recv().unwrap().unwrap().lease;
    assert_eq!(
        (lease.gpus, lease.memory_bytes),
        (vec!["GPU-0".into()], 4 * GI)
    );
    let placed = arbiter.grant(&g.id).unwrap();
    assert_eq!(placed.gpu.as_deref(), Some("GPU-0"));
    assert_eq!(placed.lease, Some(lease.id));
}

#[test]
fn a_reserve_that_waited_for_its_grant_too_long_says_what_the_grant_holds() {
    let (_dir, mut arbiter) = setup(1);
    arbiter
        .reserve_now(request("outside", "6Gi", Priority::Low))
        .unwrap();
    let g = grant(&mut arbiter, memory(5, "memory-0"));
    let start = Instant::now();
    let mut reply = arbiter.submit(pod_request("c1", &[&g.id]), start);
    arbiter.expire_waiters(start + Duration::from_secs(3600));
    let err = reply.try_recv().unwrap().unwrap_err();
    assert!(matches!(err, StateError::QueueTimeout { .. }), "{err}");
    assert!(err.to_string().contains("request for 5Gi"), "{err}");
}

#[test]
fn a_grant_on_a_gpu_that_cannot_take_the_lease_moves_to_one_that_can() {
    let (_dir, mut arbiter) = setup(2);
    let g = grant(&mut arbiter, memory(2, "memory-0"));
    assert_eq!(g.gpu.as_deref(), Some("GPU-0"));
    let mut outside = request("outside", "1Gi", Priority::High);
    outside.gpu = GpuSelector::Uuid(vec!["GPU-0".into()]);
    arbiter.reserve_now(outside).unwrap();
    let h = grant(&mut arbiter, high());
    let mut request = pod_request("c1", &[&g.id, &h.id]);
    request.priority = Priority::High;
    let lease = arbiter.reserve_now(request).unwrap().lease;
    assert_eq!(lease.gpus, vec!["GPU-1".to_string()]);
    assert_eq!(lease.priority, Priority::High);
    assert_eq!(arbiter.grant(&g.id).unwrap().gpu.as_deref(), Some("GPU-1"));
    assert_eq!(
        arbiter.grant(&h.id).unwrap().gpu.as_deref(),
        Some("GPU-1"),
        "a high grant names the GPU of its lease"
    );
    assert_eq!(
        leased(&arbiter),
        vec![1, 2],
        "GPU-0 holds nothing for it now"
    );
    let reopened = reopen(arbiter, 2);
    assert_eq!(reopened.grant(&g.id).unwrap().gpu.as_deref(), Some("GPU-1"));
    assert_eq!(leased(&reopened), vec![1, 2]);
}

#[test]
fn priority_high_needs_a_high_grant() {
    let (_dir, mut arbiter) = setup(1);
    let g = grant(&mut arbiter, memory(1, "memory-0"));
    let mut request = pod_request("c1", &[&g.id]);
    request.priority = Priority::High;
    let err = arbiter.reserve_now(request).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(
        err.to_string()
            .contains("priority high needs a gpushare.io/high grant"),
        "{err}"
    );
}

#[test]
fn a_compute_grant_sets_the_compute_request_and_caps_the_annotation() {
    let (_dir, mut arbiter) = setup(1);
    let m = grant(&mut arbiter, memory(1, "memory-0"));
    let c = grant(&mut arbiter, compute(30));
    let mut over = pod_request("c1", &[&m.id, &c.id]);
    over.compute_request = Fraction::new(0.5).unwrap();
    let err = arbiter.reserve_now(over).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(
        err.to_string().contains(&format!(
            "= 0.5 asks for more than grant {} holds (0.3)",
            c.id
        )),
        "{err}"
    );

    let mut without = pod_request("c2", &[&m.id]);
    without.compute_request = Fraction::new(0.1).unwrap();
    let err = arbiter.reserve_now(without).unwrap_err();
    assert!(
        err.to_string()
            .contains("needs a gpushare.io/compute grant"),
        "{err}"
    );

    let lease = arbiter
        .reserve_now(pod_request("c3", &[&m.id, &c.id]))
        .unwrap()
        .lease;
    assert_eq!(lease.compute_request, Fraction::new(0.3).unwrap());
}

#[test]
fn two_grants_of_one_kind_or_a_gpu_selector_beside_a_memory_grant_are_refused() {
    let (_dir, mut arbiter) = setup(2);
    let a = grant(&mut arbiter, memory(1, "memory-0"));
    let b = grant(&mut arbiter, memory(1, "memory-1"));
    let err = arbiter
        .reserve_now(pod_request("c1", &[&a.id, &b.id]))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(err.to_string().contains("both memory grants"), "{err}");

    let mut named_gpu = pod_request("c1", &[&a.id]);
    named_gpu.gpu = GpuSelector::Index(vec![1]);
    let err = arbiter.reserve_now(named_gpu).unwrap_err();
    assert!(err.to_string().contains("gpushare.io/gpu"), "{err}");
    assert!(arbiter.list().is_empty());
}

#[test]
fn a_binding_is_derived_again_at_open_and_survives_a_superseded_grant() {
    let (_dir, mut arbiter) = setup(1);
    let g = grant(&mut arbiter, memory(3, "memory-0"));
    let lease = arbiter
        .reserve_now(pod_request("c1", &[&g.id]))
        .unwrap()
        .lease;
    let mut arbiter = reopen(arbiter, 1);
    assert_eq!(arbiter.grant(&g.id).unwrap().lease, Some(lease.id.clone()));
    assert_eq!(leased(&arbiter), vec![3], "counted once after a reopen too");

    // kubelet allocated the devices again: the old grant goes, its lease stays.
    let newer = grant(&mut arbiter, memory(3, "memory-0"));
    assert!(arbiter.grant(&g.id).is_none());
    assert!(arbiter.lease(&lease.id).is_some());
    assert_eq!(newer.gpu.as_deref(), Some("GPU-0"));
    assert_eq!(leased(&arbiter), vec![6]);
}
