//! The device lists gpushare-kube advertises, from the arbiter's GPUs: pure.
//!
//! kube-scheduler counts capacity as node totals, and the node alone chooses the
//! GPU, so device ids are plain numbers over the node and carry no placement
//! meaning: `memory-<n>` (`floor(memory_total / unit)` per GPU), `high-<n>` (one per
//! GPU), `compute-<n>` (100 per GPU). A GPU out of the pool (drained, reserved,
//! unshareable, gone) shrinks it by as many ids, taken from the top of the
//! numbering and reported unhealthy rather than dropped: kubelet then stops
//! counting them as allocatable, and a pod that holds one keeps running.

use std::collections::BTreeMap;

use gpushare_proto::message::StatusReport;

use crate::resource::{Resource, COMPUTE_PER_GPU};

/// One GPU as the pool sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGpu {
    pub index: u32,
    pub uuid: String,
    /// What grants may be placed within: the memory CUDA can allocate on a shared GPU.
    pub memory_total: u64,
    /// Whether grants may be placed on it now.
    pub open: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub healthy: bool,
}

/// What each resource's ListAndWatch sends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceLists {
    pub memory: Vec<Device>,
    pub high: Vec<Device>,
    pub compute: Vec<Device>,
}

impl DeviceLists {
    pub fn of(&self, resource: Resource) -> &[Device] {
        match resource {
            Resource::Memory => &self.memory,
            Resource::High => &self.high,
            Resource::Compute => &self.compute,
        }
    }

    /// (healthy, unhealthy) of one resource.
    pub fn counts(&self, resource: Resource) -> (usize, usize) {
        let devices = self.of(resource);
        let healthy = devices.iter().filter(|d| d.healthy).count();
        (healthy, devices.len() - healthy)
    }
}

/// `total` ids of `resource`, the top `closed` of them unhealthy.
fn numbered(resource: Resource, total: u64, closed: u64) -> Vec<Device> {
    (0..total)
        .map(|n| Device {
            id: format!("{}-{n}", resource.id_prefix()),
            healthy: n < total - closed,
        })
        .collect()
}

/// The lists for `gpus` (any order) with memory units of `memory_unit` bytes.
pub fn device_lists(gpus: &[PoolGpu], memory_unit: u64) -> DeviceLists {
    let memory_unit = memory_unit.max(1);
    let mut gpus: Vec<&PoolGpu> = gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    let units = |g: &&PoolGpu| g.memory_total / memory_unit;
    let closed = || gpus.iter().filter(|g| !g.open);
    let all_units: u64 = gpus.iter().map(units).sum();
    let closed_units: u64 = closed().map(units).sum();
    let (all_gpus, closed_gpus) = (gpus.len() as u64, closed().count() as u64);
    let per_gpu = u64::from(COMPUTE_PER_GPU);
    DeviceLists {
        memory: numbered(Resource::Memory, all_units, closed_units),
        high: numbered(Resource::High, all_gpus, closed_gpus),
        compute: numbered(Resource::Compute, all_gpus * per_gpu, closed_gpus * per_gpu),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocatedIdError {
    #[error("{resource}: device id {id:?} was never advertised; accepted: ids of the plugin's list ({listed})")]
    NotAdvertised {
        resource: &'static str,
        id: String,
        listed: String,
    },
    #[error(
        "{resource}: device id {id:?} is named twice; accepted: each advertised id at most once"
    )]
    Repeated { resource: &'static str, id: String },
}

/// How the advertised ids read in an error: `memory-0 … memory-15`, or none.
fn listed(devices: &[Device]) -> String {
    match (devices.first(), devices.last()) {
        (Some(first), Some(last)) if devices.len() > 1 => format!("{} … {}", first.id, last.id),
        (Some(only), _) => only.id.clone(),
        _ => "none advertised now".into(),
    }
}

/// Pure: whether `asked`, the ids of one container's `Allocate`, are ids kubelet
/// could have handed out: each advertised (healthy or not: kubelet may allocate an
/// id just before the list that closed it reached it), and none twice. Together
/// they bound a grant by the node's capacity, as kube-scheduler counted it.
pub fn check_allocated(
    resource: Resource,
    asked: &[String],
    advertised: &[Device],
) -> Result<(), AllocatedIdError> {
    let known: std::collections::HashSet<&str> = advertised.iter().map(|d| d.id.as_str()).collect();
    let mut seen = std::collections::HashSet::with_capacity(asked.len());
    for id in asked {
        if !known.contains(id.as_str()) {
            return Err(AllocatedIdError::NotAdvertised {
                resource: resource.name(),
                id: id.clone(),
                listed: listed(advertised),
            });
        }
        if !seen.insert(id.as_str()) {
            return Err(AllocatedIdError::Repeated {
                resource: resource.name(),
                id: id.clone(),
            });
        }
    }
    Ok(())
}

/// The GPUs the plugin has seen, so one that disappears from the arbiter's report
/// (failed, removed) still counts, closed, rather than renumbering every id kubelet
/// may have handed out.
#[derive(Debug, Default, Clone)]
pub struct Inventory {
    known: BTreeMap<String, PoolGpu>,
}

impl Inventory {
    /// Takes in one arbiter report; returns the pool as it stands now.
    pub fn observe(&mut self, report: &StatusReport) -> Vec<PoolGpu> {
        for gpu in self.known.values_mut() {
            gpu.open = false;
        }
        // The arbiter places no grant on a drained GPU, nor on one reserved for a
        // tenant (grants carry none): advertising either would let the scheduler
        // send pods that wait for room forever.
        // Units of what the arbiter places leases within: the memory CUDA can allocate (an
        // older arbiter reports only the total).
        let shared = report.gpus.iter().map(|g| {
            (
                g.index,
                &g.uuid,
                match g.memory_allocatable {
                    0 => g.memory_total,
                    allocatable => allocatable,
                },
                !g.drained && g.reserved_for.is_none(),
            )
        });
        let unshareable = report
            .unshareable
            .iter()
            .map(|g| (g.index, &g.uuid, g.memory_total, false));
        for (index, uuid, memory_total, open) in shared.chain(unshareable) {
            let gpu = PoolGpu {
                index,
                uuid: uuid.clone(),
                memory_total,
                open,
            };
            self.known.insert(uuid.clone(), gpu);
        }
        self.known.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_advertised_ids_each_once_are_allocatable() {
        let lists = device_lists(
            &[PoolGpu {
                index: 0,
                uuid: "GPU-0".into(),
                memory_total: 4,
                open: false,
            }],
            1,
        );
        let ids = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let not_advertised = |id: &str| {
            Err(AllocatedIdError::NotAdvertised {
                resource: Resource::Memory.name(),
                id: id.into(),
                listed: "memory-0 … memory-3".into(),
            })
        };
        let beyond: Vec<String> = (0..5_000).map(|n| format!("memory-{n}")).collect();
        for (asked, want) in [
            (ids(&["memory-0"]), Ok(())),
            // Unhealthy (its GPU closed) but advertised: kubelet may have raced it.
            (ids(&["memory-3", "memory-1"]), Ok(())),
            (ids(&["memory-4"]), not_advertised("memory-4")),
            (ids(&["memory-0", "bogus"]), not_advertised("bogus")),
            (ids(&["high-0"]), not_advertised("high-0")),
            (ids(&[""]), not_advertised("")),
            (beyond, not_advertised("memory-4")),
            (
                ids(&["memory-2", "memory-2"]),
                Err(AllocatedIdError::Repeated {
                    resource: Resource::Memory.name(),
                    id: "memory-2".into(),
                }),
            ),
        ] {
            assert_eq!(
                check_allocated(Resource::Memory, &asked, lists.of(Resource::Memory)),
                want,
                "{asked:?}"
            );
        }
        let none = check_allocated(Resource::High, &ids(&["high-0"]), &[]).unwrap_err();
        assert!(none.to_string().contains("none advertised now"), "{none}");
    }
    use gpushare_proto::message::{GpuStatus, UnshareableGpuStatus};

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, memory_gib: u64, open: bool) -> PoolGpu {
        PoolGpu {
            index,
            uuid: format!("GPU-{index}"),
            memory_total: memory_gib * GIB,
            open,
        }
    }

    fn unhealthy_ids(devices: &[Device]) -> Vec<&str> {
        devices
            .iter()
            .filter(|d| !d.healthy)
            .map(|d| d.id.as_str())
            .collect()
    }

    #[test]
    fn counts_per_resource() {
        // (gpus, unit, memory (healthy, unhealthy), high, compute)
        type Case = (
            Vec<PoolGpu>,
            u64,
            (usize, usize),
            (usize, usize),
            (usize, usize),
        );
        let cases: Vec<Case> = vec![
            (vec![], GIB, (0, 0), (0, 0), (0, 0)),
            (
                vec![gpu(0, 8, true), gpu(1, 8, true)],
                GIB,
                (16, 0),
                (2, 0),
                (200, 0),
            ),
            (
                vec![gpu(0, 8, true), gpu(1, 8, false)],
                GIB,
                (8, 8),
                (1, 1),
                (100, 100),
            ),
            // A partial unit is not advertised: 7.5 GiB of 1 GiB units is 7.
            (
                vec![PoolGpu {
                    memory_total: 15 * GIB / 2,
                    ..gpu(0, 0, true)
                }],
                GIB,
                (7, 0),
                (1, 0),
                (100, 0),
            ),
            (
                vec![gpu(0, 80, true), gpu(1, 24, true)],
                2 * GIB,
                (52, 0),
                (2, 0),
                (200, 0),
            ),
            (
                vec![gpu(0, 80, false), gpu(1, 24, true)],
                2 * GIB,
                (12, 40),
                (1, 1),
                (100, 100),
            ),
            (vec![gpu(0, 8, false)], GIB, (0, 8), (0, 1), (0, 100)),
        ];
        for (gpus, unit, memory, high, compute) in cases {
            let lists = device_lists(&gpus, unit);
            assert_eq!(lists.counts(Resource::Memory), memory, "{gpus:?}");
            assert_eq!(lists.counts(Resource::High), high, "{gpus:?}");
            assert_eq!(lists.counts(Resource::Compute), compute, "{gpus:?}");
        }
    }

    #[test]
    fn ids_are_numbered_over_the_node_and_closed_ones_are_the_top() {
        let lists = device_lists(&[gpu(1, 2, true), gpu(0, 2, false)], GIB);
        let ids: Vec<_> = lists.memory.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["memory-0", "memory-1", "memory-2", "memory-3"]);
        assert_eq!(unhealthy_ids(&lists.memory), ["memory-2", "memory-3"]);
        assert_eq!(unhealthy_ids(&lists.high), ["high-1"]);
        assert_eq!(lists.compute.first().unwrap().id, "compute-0");
        assert_eq!(unhealthy_ids(&lists.compute).first(), Some(&"compute-100"));
        assert_eq!(lists.compute.last().unwrap().id, "compute-199");
    }

    #[test]
    fn reopening_restores_the_same_ids_healthy() {
        let open = device_lists(&[gpu(0, 4, true), gpu(1, 4, true)], GIB);
        let drained = device_lists(&[gpu(0, 4, true), gpu(1, 4, false)], GIB);
        assert_ne!(open, drained);
        let ids = |l: &DeviceLists| l.memory.iter().map(|d| d.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&open), ids(&drained));
        assert_eq!(device_lists(&[gpu(0, 4, true), gpu(1, 4, true)], GIB), open);
    }

    fn status(index: u32, drained: bool, reserved: Option<&str>) -> GpuStatus {
        GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            name: "declared".into(),
            memory_total: 8 * GIB,
            memory_allocatable: 8 * GIB,
            memory_leased: 0,
            memory_used: None,
            utilization_last_minute: None,
            drained,
            reserved_for: reserved.map(Into::into),
        }
    }

    fn report(gpus: Vec<GpuStatus>, unshareable: Vec<UnshareableGpuStatus>) -> StatusReport {
        StatusReport {
            gpus,
            unshareable,
            ..StatusReport::default()
        }
    }

    #[test]
    fn the_inventory_closes_drained_reserved_unshareable_and_vanished_gpus() {
        let mut inventory = Inventory::default();
        let pool = inventory.observe(&report(
            vec![status(0, false, None), status(1, false, None)],
            vec![],
        ));
        assert!(pool.iter().all(|g| g.open), "{pool:?}");
        let pool = inventory.observe(&report(
            vec![status(0, true, None), status(1, false, None)],
            vec![],
        ));
        assert_eq!(
            pool.iter().map(|g| g.open).collect::<Vec<_>>(),
            [false, true]
        );
        let pool = inventory.observe(&report(
            vec![status(0, false, Some("team-a")), status(1, false, None)],
            vec![],
        ));
        assert_eq!(
            pool.iter().map(|g| g.open).collect::<Vec<_>>(),
            [false, true]
        );
        // GPU 1 vanished: still counted, closed, so no id is renumbered.
        let pool = inventory.observe(&report(vec![status(0, false, None)], vec![]));
        assert_eq!(
            pool.iter().map(|g| g.open).collect::<Vec<_>>(),
            [true, false]
        );
        let unshareable = UnshareableGpuStatus {
            index: 1,
            uuid: "GPU-1".into(),
            name: "mig".into(),
            memory_total: 8 * GIB,
            reason: "MIG".into(),
        };
        let pool = inventory.observe(&report(vec![status(0, false, None)], vec![unshareable]));
        assert_eq!(pool.len(), 2);
        assert_eq!(
            pool.iter().map(|g| g.open).collect::<Vec<_>>(),
            [true, false]
        );
        let pool = inventory.observe(&report(
            vec![status(0, false, None), status(1, false, None)],
            vec![],
        ));
        assert!(pool.iter().all(|g| g.open), "{pool:?}");
    }
}
