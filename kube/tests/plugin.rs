//! gpushare-kube end to end: the real binary between a real arbiter (declared GPUs)
//! and the test kubelet (tests/cri), over real gRPC on unix sockets.

mod common;

use std::time::Duration;

use common::{plugin_dir, Node, GIB, WAIT};
use gpushare_kube::resource::Resource;
use gpushare_proto::grant::GrantAmount;
use gpushare_testkit::wait_until;
use gpushare_types::kubernetes::{
    COMPUTE_RESOURCE, GRANT_COMPUTE_ANNOTATION, GRANT_COMPUTE_ENV, GRANT_HIGH_ANNOTATION,
    GRANT_HIGH_ENV, GRANT_MEMORY_ANNOTATION, GRANT_MEMORY_ENV, HIGH_RESOURCE, MEMORY_RESOURCE,
};

#[test]
fn registers_the_three_resources_with_the_node_counts() {
    let node = Node::start(2, "8Gi", |k| k.memory_unit.0 = GIB);
    node.wait_healthy(MEMORY_RESOURCE, 16);
    assert_eq!(node.kubelet.devices(MEMORY_RESOURCE), (16, 0));
    assert_eq!(node.kubelet.devices(HIGH_RESOURCE), (2, 0));
    assert_eq!(node.kubelet.devices(COMPUTE_RESOURCE), (200, 0));
    for resource in Resource::ALL {
        assert!(plugin_dir(&node).join(resource.socket_name()).exists());
        assert_eq!(node.kubelet.registrations(resource.name()), 1);
    }
    let ids = node.kubelet.device_ids(MEMORY_RESOURCE);
    assert_eq!(ids.first().unwrap().0, "memory-0");
    assert_eq!(ids.last().unwrap().0, "memory-15");
}

#[test]
fn a_drained_gpu_turns_its_share_of_devices_unhealthy_until_undrained() {
    let node = Node::start(2, "8Gi", |_| {});
    node.wait_healthy(MEMORY_RESOURCE, 16);
    node.arbiter.client().drain("1".into(), true).unwrap();
    node.wait_healthy(MEMORY_RESOURCE, 8);
    node.wait_healthy(HIGH_RESOURCE, 1);
    node.wait_healthy(COMPUTE_RESOURCE, 100);
    assert_eq!(node.kubelet.devices(MEMORY_RESOURCE), (8, 8));
    assert_eq!(node.kubelet.devices(HIGH_RESOURCE), (1, 1));
    assert_eq!(node.kubelet.devices(COMPUTE_RESOURCE), (100, 100));
    // The top of the numbering went, whichever GPU was drained.
    let unhealthy: Vec<_> = node
        .kubelet
        .device_ids(HIGH_RESOURCE)
        .into_iter()
        .filter(|(_, healthy)| !healthy)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(unhealthy, ["high-1"]);
    node.arbiter.client().drain("1".into(), false).unwrap();
    node.wait_healthy(MEMORY_RESOURCE, 16);
    node.wait_healthy(HIGH_RESOURCE, 2);
    node.wait_healthy(COMPUTE_RESOURCE, 200);
}

#[test]
fn allocate_answers_with_arbiter_grants_per_resource() {
    let node = Node::start(2, "8Gi", |_| {});
    let allocation = node
        .kubelet
        .allocate(
            "uid-1",
            "team-a",
            "trainer",
            "main",
            &[
                (MEMORY_RESOURCE, 3),
                (HIGH_RESOURCE, 1),
                (COMPUTE_RESOURCE, 30),
            ],
        )
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
    for (annotation, env, expected) in [
        (
            GRANT_MEMORY_ANNOTATION,
            GRANT_MEMORY_ENV,
            GrantAmount::Memory { bytes: 3 * GIB },
        ),
        (GRANT_HIGH_ANNOTATION, GRANT_HIGH_ENV, GrantAmount::High),
        (
            GRANT_COMPUTE_ANNOTATION,
            GRANT_COMPUTE_ENV,
            GrantAmount::Compute { percent: 30 },
        ),
    ] {
        let id = &allocation.annotations[annotation];
        assert_eq!(&allocation.envs[env], id);
        let grant = node
            .grant(id)
            .unwrap_or_else(|| panic!("grant {id} of {annotation}"));
        assert_eq!(grant.amount, expected);
        assert_eq!(
            grant.device_ids.len(),
            match expected {
                GrantAmount::Memory { .. } => 3,
                GrantAmount::High => 1,
                GrantAmount::Compute { percent } => percent as usize,
            }
        );
    }
    let memory = node
        .grant(&allocation.annotations[GRANT_MEMORY_ANNOTATION])
        .unwrap();
    assert_eq!(memory.device_ids, allocation.devices[MEMORY_RESOURCE]);
    assert!(
        memory.gpu.is_some(),
        "a memory grant with room is placed at once: {memory:?}"
    );
    assert_eq!(node.grants().len(), 3);

    let mut config = gpushare_cri::container("main", "image", &["true"]);
    allocation.apply(&mut config);
    assert_eq!(
        config.annotations[GRANT_MEMORY_ANNOTATION],
        allocation.annotations[GRANT_MEMORY_ANNOTATION]
    );
    assert!(config.envs.iter().any(|kv| kv.key == GRANT_HIGH_ENV));
}

#[test]
fn more_than_one_high_slot_per_container_is_refused_by_name_and_value() {
    let node = Node::start(2, "8Gi", |_| {});
    let e = node
        .kubelet
        .allocate("uid-1", "ns", "p", "c", &[(HIGH_RESOURCE, 2)])
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    let message = e.to_string();
    assert!(
        message.contains(HIGH_RESOURCE) && message.contains('2'),
        "{message}"
    );
    assert!(node.grants().is_empty());
}

/// Kubelet only hands out ids the plugin advertised, each once; anything else is
/// not kubelet's (or a kubelet gone wrong), and a grant made of it would hold more
/// than kube-scheduler counted on the node.
#[test]
fn ids_never_advertised_repeated_or_beyond_the_node_are_refused_by_name() {
    let node = Node::start(2, "8Gi", |k| k.memory_unit.0 = GIB);
    node.wait_healthy(MEMORY_RESOURCE, 16);
    let ids = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let beyond: Vec<String> = (0..5_000).map(|n| format!("memory-{n}")).collect();
    for (resource, asked, named) in [
        (MEMORY_RESOURCE, ids(&["memory-0", "bogus"]), "bogus"),
        (MEMORY_RESOURCE, ids(&["high-0"]), "high-0"),
        (MEMORY_RESOURCE, ids(&["memory-3", "memory-3"]), "memory-3"),
        (MEMORY_RESOURCE, beyond, "memory-16"),
        (HIGH_RESOURCE, ids(&["high-7"]), "high-7"),
        (COMPUTE_RESOURCE, ids(&["compute-200"]), "compute-200"),
    ] {
        let e = node
            .kubelet
            .allocate_ids(resource, asked)
            .map(|granted| format!("granted {granted:?}"))
            .unwrap_err();
        let gpushare_cri::kubelet::KubeletError::Allocate { status, .. } = &e else {
            panic!("{resource} {named}: {e}");
        };
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(status.message().contains(named), "{named}: {e}");
        assert!(status.message().contains(resource), "{named}: {e}");
    }
    assert!(node.grants().is_empty(), "{:?}", node.grants());
    // What kubelet really sends is still granted.
    node.kubelet
        .allocate_ids(MEMORY_RESOURCE, ids(&["memory-15", "memory-0"]))
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
    assert_eq!(node.grants().len(), 1);
}

#[test]
fn a_fragmented_memory_grant_waits_rather_than_failing() {
    let node = Node::start(2, "4Gi", |_| {});
    let mut placed = Vec::new();
    for pod in ["a", "b"] {
        let allocation = node
            .kubelet
            .allocate(pod, "ns", pod, "c", &[(MEMORY_RESOURCE, 3)])
            .unwrap();
        placed.push(
            node.grant(&allocation.annotations[GRANT_MEMORY_ANNOTATION])
                .unwrap(),
        );
    }
    // Worst fit: one on each GPU, 1 GiB left on each.
    assert!(placed.iter().all(|g| g.gpu.is_some()), "{placed:?}");
    assert_ne!(placed[0].gpu, placed[1].gpu);
    // kubelet sees 2 units free, no GPU has 2 GiB: Allocate succeeds, the grant waits.
    let fragmented = node
        .kubelet
        .allocate("c", "ns", "c", "c", &[(MEMORY_RESOURCE, 2)])
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
    let waiting = node
        .grant(&fragmented.annotations[GRANT_MEMORY_ANNOTATION])
        .unwrap();
    assert_eq!(waiting.gpu, None, "{waiting:?}");
}

#[test]
fn after_a_kubelet_restart_the_plugin_registers_again_and_allocates() {
    let mut node = Node::start(2, "8Gi", |_| {});
    node.kubelet.restart().unwrap();
    for resource in Resource::ALL {
        node.kubelet
            .wait_registered(resource.name(), WAIT)
            .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
        assert_eq!(node.kubelet.registrations(resource.name()), 2);
        assert!(plugin_dir(&node).join(resource.socket_name()).exists());
    }
    node.wait_healthy(MEMORY_RESOURCE, 16);
    let allocation = node
        .kubelet
        .allocate("uid-1", "ns", "p", "c", &[(MEMORY_RESOURCE, 2)])
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
    assert!(node
        .grant(&allocation.annotations[GRANT_MEMORY_ANNOTATION])
        .is_some());
    assert!(
        node.plugin_log().contains("registering again"),
        "{}",
        node.plugin_log()
    );
}

#[test]
fn collection_releases_the_grants_of_removed_pods_only() {
    let node = Node::start(2, "8Gi", |k| {
        k.collect_interval_ms = 100;
        k.collect_grace_ms = 0;
    });
    let gone = node
        .kubelet
        .allocate(
            "uid-gone",
            "ns",
            "gone",
            "c",
            &[(MEMORY_RESOURCE, 2), (HIGH_RESOURCE, 1)],
        )
        .unwrap();
    let live = node
        .kubelet
        .allocate(
            "uid-live",
            "ns",
            "live",
            "c",
            &[(MEMORY_RESOURCE, 2), (COMPUTE_RESOURCE, 10)],
        )
        .unwrap();
    node.kubelet.remove_pod("uid-gone");
    wait_until("the removed pod's grants to be collected", WAIT, || {
        let grants = node.grants();
        !gone
            .annotations
            .values()
            .any(|id| grants.iter().any(|g| &g.id.0 == id))
    });
    // Several passes later the live pod's grants are all still there.
    std::thread::sleep(Duration::from_millis(500));
    for id in live.annotations.values() {
        assert!(
            node.grant(id).is_some(),
            "live grant {id} collected:\n{}",
            node.plugin_log()
        );
    }
    assert!(node.plugin_log().contains("released a grant no pod holds"));
}

#[test]
fn a_young_grant_is_not_collected_before_its_grace() {
    let node = Node::start(1, "8Gi", |k| {
        k.collect_interval_ms = 100;
        k.collect_grace_ms = 3_600_000;
    });
    let allocation = node
        .kubelet
        .allocate("uid-1", "ns", "p", "c", &[(MEMORY_RESOURCE, 1)])
        .unwrap();
    node.kubelet.remove_pod("uid-1");
    std::thread::sleep(Duration::from_millis(500));
    assert!(node
        .grant(&allocation.annotations[GRANT_MEMORY_ANNOTATION])
        .is_some());
}

#[test]
fn ids_allocated_again_supersede_the_old_grant() {
    let node = Node::start(1, "8Gi", |_| {});
    let old = node
        .kubelet
        .allocate("uid-old", "ns", "old", "c", &[(MEMORY_RESOURCE, 2)])
        .unwrap();
    node.kubelet.remove_pod("uid-old");
    let new = node
        .kubelet
        .allocate("uid-new", "ns", "new", "c", &[(MEMORY_RESOURCE, 2)])
        .unwrap();
    assert_eq!(old.devices[MEMORY_RESOURCE], new.devices[MEMORY_RESOURCE]);
    let ids: Vec<_> = node.grants().into_iter().map(|g| g.id.0).collect();
    assert_eq!(ids, [new.annotations[GRANT_MEMORY_ANNOTATION].clone()]);
}

#[test]
fn an_unreachable_arbiter_keeps_the_devices_and_makes_allocate_unavailable() {
    let mut node = Node::start(2, "8Gi", |_| {});
    node.wait_healthy(MEMORY_RESOURCE, 16);
    node.arbiter.stop();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(node.kubelet.devices(MEMORY_RESOURCE), (16, 0));
    let e = node
        .kubelet
        .allocate("uid-1", "ns", "p", "c", &[(MEMORY_RESOURCE, 1)])
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::Unavailable), "{e}");
    assert!(e.to_string().contains("unreachable"), "{e}");
}

#[test]
fn allocate_works_again_once_a_restarted_arbiter_answers() {
    // No polls between the calls: the first call the plugin makes after the
    // restart is Allocate's.
    let mut node = Node::start(2, "8Gi", |k| k.poll_interval_ms = 3_600_000);
    node.kubelet
        .allocate("uid-1", "ns", "p", "c", &[(MEMORY_RESOURCE, 1)])
        .unwrap();
    node.arbiter.restart();
    let allocation = node
        .kubelet
        .allocate("uid-2", "ns", "q", "c", &[(MEMORY_RESOURCE, 1)])
        .unwrap_or_else(|e| panic!("{e}\nplugin log:\n{}", node.plugin_log()));
    assert!(node
        .grant(&allocation.annotations[GRANT_MEMORY_ANNOTATION])
        .is_some());
}
