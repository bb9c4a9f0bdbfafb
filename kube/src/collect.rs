//! Collection: grants that no live pod holds any more are released.
//!
//! kubelet tells a device plugin nothing when a pod ends; its PodResources API
//! says which pods hold which devices now. A grant is collected once it is older
//! than `collect_grace_ms` (kubelet records an allocation only after `Allocate`
//! returns, so a new grant is briefly held by nobody) and none of its device ids
//! is held. If PodResources cannot be read, nothing is collected: an unreadable
//! answer must never look like "no pod holds anything".

use std::collections::HashSet;

use gpushare_proto::grant::{Grant, GrantId};

use crate::api::podresources::ListPodResourcesResponse;
use crate::resource::Resource;

/// The device ids of gpushare's resources that live pods hold.
pub fn held_device_ids(answer: &ListPodResourcesResponse) -> HashSet<String> {
    answer
        .pod_resources
        .iter()
        .flat_map(|pod| &pod.containers)
        .flat_map(|container| &container.devices)
        .filter(|devices| Resource::from_name(&devices.resource_name).is_some())
        .flat_map(|devices| devices.device_ids.iter().cloned())
        .collect()
}

/// The grants to release now.
pub fn grants_to_collect(
    grants: &[Grant],
    held: &HashSet<String>,
    now_unix_ms: u64,
    grace_ms: u64,
) -> Vec<GrantId> {
    grants
        .iter()
        .filter(|g| now_unix_ms.saturating_sub(g.created_unix_ms) >= grace_ms)
        .filter(|g| !g.device_ids.iter().any(|id| held.contains(id)))
        .map(|g| g.id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::podresources::{ContainerDevices, ContainerResources, PodResources};
    use gpushare_proto::grant::GrantAmount;

    fn grant(id: &str, ids: &[&str], created_unix_ms: u64) -> Grant {
        Grant {
            id: GrantId(id.into()),
            amount: GrantAmount::High,
            device_ids: ids.iter().map(|&s| s.into()).collect(),
            gpu: None,
            lease: None,
            created_unix_ms,
        }
    }

    fn held(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|&s| s.into()).collect()
    }

    #[test]
    fn collects_old_grants_nobody_holds() {
        let grants = [
            grant("held", &["memory-0", "memory-1"], 0),
            grant("partly-held", &["memory-2", "memory-3"], 0),
            grant("free", &["memory-4"], 0),
            grant("young", &["memory-5"], 9_500),
            grant("just-old-enough", &["high-0"], 9_000),
            grant("from-the-future", &["compute-0"], 20_000),
        ];
        let held = held(&["memory-0", "memory-1", "memory-3"]);
        let collected = grants_to_collect(&grants, &held, 10_000, 1_000);
        let names: Vec<_> = collected.iter().map(|g| g.0.as_str()).collect();
        assert_eq!(names, ["free", "just-old-enough"]);
    }

    #[test]
    fn without_grace_every_unheld_grant_goes() {
        let grants = [grant("a", &["memory-0"], 5), grant("b", &["memory-1"], 5)];
        let collected = grants_to_collect(&grants, &held(&["memory-1"]), 5, 0);
        assert_eq!(collected, [GrantId("a".into())]);
    }

    #[test]
    fn held_ids_are_only_gpushare_resources_of_every_container() {
        let devices = |resource: &str, ids: &[&str]| ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|&s| s.into()).collect(),
            topology: None,
        };
        let answer = ListPodResourcesResponse {
            pod_resources: vec![
                PodResources {
                    name: "a".into(),
                    namespace: "ns".into(),
                    containers: vec![
                        ContainerResources {
                            name: "c1".into(),
                            devices: vec![
                                devices("gpushare.io/memory", &["memory-0"]),
                                devices("nvidia.com/gpu", &["GPU-x"]),
                            ],
                            ..Default::default()
                        },
                        ContainerResources {
                            name: "c2".into(),
                            devices: vec![devices("gpushare.io/high", &["high-1"])],
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                },
                PodResources {
                    name: "b".into(),
                    namespace: "ns".into(),
                    containers: vec![ContainerResources {
                        name: "c".into(),
                        devices: vec![devices("gpushare.io/compute", &["compute-7"])],
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ],
        };
        assert_eq!(
            held_device_ids(&answer),
            held(&["memory-0", "high-1", "compute-7"])
        );
    }
}
