//! A pod through containerd's real CRI plugin (Debian 12's containerd 1.6), with
//! the test playing kubelet over the CRI gRPC API (tests/cri): no kubelet and no
//! cri-tools can be installed here. For both ways gpushare plugs into containerd
//! (the shim as the handler's runtime; gpushare-runc as runc's BinaryName) the
//! pod's pause container must get no lease and no GPU, its app container must,
//! and stopping and removing the pod must leave nothing behind.

use std::collections::HashMap;
use std::time::Duration;

use gpushare_cri::{api, CONTAINER_TYPE_ANNOTATION};
use gpushare_e2e::containerd::processes_with;
use gpushare_e2e::cri::{annotation, env, CriNode, Entry, HANDLER, IMAGE};
use gpushare_e2e::*;
use gpushare_proto::{GrantAmount, GrantRequest};
use gpushare_types::kubernetes::GRANT_MEMORY_ANNOTATION;

fn pause_container_gets_no_lease(entry: Entry) {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions {
            simulated_driver: Some("12020"),
            ..Default::default()
        },
    );
    let node = CriNode::start(entry, dir.path(), &arbiter.config_path);
    let (cri, ctr) = (&node.cri, &node.ctr);

    // Kubernetes users ask on the pod: kubelet hands the pod's annotations to the
    // CRI, and pod_annotations copies them into the spec of every container of the
    // pod, the pause container's too. That is why the pause container would be
    // leased if nothing told it apart.
    let pod_config = gpushare_cri::host_network_pod(
        "gpu-pod",
        "default",
        "c6a3c9a2-0001-4000-8000-000000000001",
        HashMap::from([("gpushare.io/memory".to_owned(), "1Gi".to_owned())]),
    );
    let pod = cri
        .run_pod_sandbox(&pod_config, HANDLER)
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}{}", node.log()));
    let app_config = gpushare_cri::container("app", IMAGE, &["/bin/sleep", "3600"]);
    let app = cri
        .create_container(&pod, &app_config, &pod_config)
        .unwrap_or_else(|e| panic!("CreateContainer: {e}{}", ctr.log_tail()));
    cri.start_container(&app)
        .unwrap_or_else(|e| panic!("StartContainer: {e}{}", ctr.log_tail()));
    let status = cri.container_status(&app).unwrap();
    assert_eq!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );

    // Which shim serves the pod: without this, a configuration containerd ignores
    // would test plain runc.
    for id in [&pod, &app] {
        node.assert_served_by(id, entry);
    }

    let pause = node.spec(&pod);
    assert_eq!(
        annotation(&pause, CONTAINER_TYPE_ANNOTATION),
        Some("sandbox")
    );
    assert_eq!(
        annotation(&pause, "gpushare.io/memory"),
        Some("1Gi"),
        "the pause container carries the pod's request (else this test proves nothing)"
    );
    assert_eq!(
        annotation(&pause, "gpushare.io/lease"),
        None,
        "{entry:?}: the pause container was leased: {}",
        pause["annotations"]
    );
    assert_eq!(
        env(&pause, "NVIDIA_VISIBLE_DEVICES"),
        None,
        "{entry:?}: the pause container was given a GPU: {}",
        pause["process"]["env"]
    );

    let spec = node.spec(&app);
    assert_eq!(
        annotation(&spec, CONTAINER_TYPE_ANNOTATION),
        Some("container")
    );
    let lease_id = annotation(&spec, "gpushare.io/lease")
        .unwrap_or_else(|| panic!("{entry:?}: the app has no lease: {}", spec["annotations"]));
    assert_eq!(
        env(&spec, "NVIDIA_VISIBLE_DEVICES"),
        Some(sim_uuid(0).as_str())
    );

    let leases = arbiter.leases();
    assert_eq!(
        leases.len(),
        1,
        "{entry:?}: one lease, the app's: {leases:#?}"
    );
    assert_eq!(leases[0]["container_id"], app.as_str(), "{leases:#?}");
    assert_eq!(leases[0]["sandbox_id"], pod.as_str(), "{leases:#?}");
    assert_eq!(leases[0]["id"], lease_id, "{leases:#?}");
    assert_eq!(
        leases[0]["gpus"],
        serde_json::json!([sim_uuid(0)]),
        "{leases:#?}"
    );
    // requests.tenant_from = auto: the tenant is the namespace the CRI plugin
    // recorded for the pod, not anything the pod wrote.
    assert_eq!(leases[0]["tenant"], "default", "{leases:#?}");

    // What kubelet does when the pod is deleted.
    cri.stop_container(&app, Duration::ZERO).unwrap();
    cri.remove_container(&app).unwrap();
    cri.stop_pod_sandbox(&pod).unwrap();
    cri.remove_pod_sandbox(&pod).unwrap();
    assert!(cri.list_containers(None).unwrap().is_empty());
    assert!(cri.list_pod_sandboxes().unwrap().is_empty());
    wait_until("the lease to be released", Duration::from_secs(10), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(arbiter.lease_dirs(), 0, "lease directories left");
    let address = ctr.address.to_string_lossy().into_owned();
    wait_until("the pod's shims to exit", Duration::from_secs(10), || {
        processes_with(&address)
            .iter()
            .all(|(_, cmd)| !cmd.contains("containerd-shim"))
    });
    // Dropped in reverse order: the pods (already gone), containerd, the arbiter.
}

#[test]
fn through_the_shim_the_pause_container_gets_no_lease() {
    pause_container_gets_no_lease(Entry::Shim);
}

#[test]
fn through_gpushare_runc_the_pause_container_gets_no_lease() {
    pause_container_gets_no_lease(Entry::RuncBinary);
}

/// A grant reaches a container only through its container-level CRI
/// annotations (kubelet's, carrying its device plugins' Allocate answers), which
/// the handler's container_annotations pass; the same key in the pod's own
/// annotations is dropped (pod_annotations = "gpushare.io/*" does not match it under
/// Go's path.Match), so a pod cannot name another pod's grant. The grants come
/// straight from the arbiter here; tests/kubernetes.rs obtains them through the
/// device plugin.
fn grants_reach_containers_from_kubelet_only(entry: Entry) {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions {
            simulated_driver: Some("12020"),
            ..Default::default()
        },
    );
    let grant = |gib: u64, first_device: u64| {
        arbiter
            .client()
            .grant(GrantRequest {
                amount: GrantAmount::Memory { bytes: gib << 30 },
                device_ids: (first_device..first_device + gib)
                    .map(|i| format!("memory-{i}"))
                    .collect(),
            })
            .unwrap()
            .id
            .0
    };
    let (granted, stolen) = (grant(2, 0), grant(4, 2));
    let node = CriNode::start(entry, dir.path(), &arbiter.config_path);
    let cri = &node.cri;

    let honest_config = gpushare_cri::host_network_pod(
        "honest",
        "team-a",
        "c6a3c9a2-0002-4000-8000-000000000001",
        HashMap::new(),
    );
    let honest = cri.run_pod_sandbox(&honest_config, HANDLER).unwrap();
    let mut app_config = gpushare_cri::container("app", IMAGE, &["/bin/sleep", "3600"]);
    app_config.annotations = HashMap::from([(GRANT_MEMORY_ANNOTATION.to_owned(), granted.clone())]);
    let app = cri
        .create_container(&honest, &app_config, &honest_config)
        .unwrap();
    cri.start_container(&app)
        .unwrap_or_else(|e| panic!("StartContainer: {e}{}", node.log()));
    let spec = node.spec(&app);
    assert_eq!(
        annotation(&spec, GRANT_MEMORY_ANNOTATION),
        Some(granted.as_str()),
        "{entry:?}: {}",
        spec["annotations"]
    );
    let leases = arbiter.leases();
    let lease = leases
        .iter()
        .find(|l| l["container_id"] == app.as_str())
        .unwrap_or_else(|| panic!("{entry:?}: no lease: {leases:#?}"));
    assert_eq!(
        lease["pod"],
        serde_json::json!({"namespace": "team-a", "name": "honest", "container": "app", "grants": [granted]}),
        "{entry:?}: {lease:#}"
    );
    assert_eq!(
        lease["memory_bytes"].as_u64(),
        Some(2 << 30),
        "{entry:?}: the quota is the grant's: {lease:#}"
    );

    let forger_config = gpushare_cri::host_network_pod(
        "forger",
        "team-b",
        "c6a3c9a2-0002-4000-8000-000000000002",
        HashMap::from([
            (GRANT_MEMORY_ANNOTATION.to_owned(), stolen.clone()),
            ("gpushare.io/memory".to_owned(), "1Gi".to_owned()),
        ]),
    );
    let forger = cri.run_pod_sandbox(&forger_config, HANDLER).unwrap();
    let plain = gpushare_cri::container("app", IMAGE, &["/bin/sleep", "3600"]);
    let forged = cri
        .create_container(&forger, &plain, &forger_config)
        .unwrap();
    cri.start_container(&forged)
        .unwrap_or_else(|e| panic!("StartContainer: {e}{}", node.log()));
    let spec = node.spec(&forged);
    assert_eq!(
        annotation(&spec, "gpushare.io/memory"),
        Some("1Gi"),
        "the pod's request arrives (else this test proves nothing)"
    );
    assert_eq!(
        annotation(&spec, GRANT_MEMORY_ANNOTATION),
        None,
        "{entry:?}: the pod's own grant key reached its container: {}",
        spec["annotations"]
    );
    let leases = arbiter.leases();
    let lease = leases
        .iter()
        .find(|l| l["container_id"] == forged.as_str())
        .unwrap_or_else(|| panic!("{entry:?}: no lease: {leases:#?}"));
    assert_eq!(lease["pod"]["grants"], serde_json::Value::Null, "{lease:#}");
    assert_eq!(lease["memory_bytes"].as_u64(), Some(1 << 30), "{lease:#}");
    let grants = arbiter.status()["grants"].clone();
    let stolen_grant = grants
        .as_array()
        .and_then(|g| g.iter().find(|g| g["id"] == stolen.as_str()))
        .unwrap_or_else(|| panic!("{grants:#}"));
    assert_eq!(stolen_grant["lease"], serde_json::Value::Null, "{grants:#}");
}

#[test]
fn through_the_shim_grants_reach_containers_from_kubelet_only() {
    grants_reach_containers_from_kubelet_only(Entry::Shim);
}

#[test]
fn through_gpushare_runc_grants_reach_containers_from_kubelet_only() {
    grants_reach_containers_from_kubelet_only(Entry::RuncBinary);
}
