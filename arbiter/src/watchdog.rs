//! The backstop no LD_PRELOAD-only system has: compare what NVML sees on the
//! shared GPUs with the processes that registered through lease sockets.
//!
//! Pure: the caller gathers NVML's process lists and the registered clients,
//! and decides what to do with the findings (log, report, kill by policy).

use std::collections::BTreeMap;

use gpushare_proto::{LeaseId, Violation, ViolationKind};

use crate::inventory::GpuProcess;

/// A lease as the watchdog sees it.
#[derive(Debug, Clone)]
pub struct LeaseView<'a> {
    pub id: &'a LeaseId,
    pub gpus: &'a [String],
    /// Per GPU.
    pub memory_quota: u64,
    /// Host pids registered through the lease's socket.
    pub client_pids: Vec<u32>,
}

/// `processes`: per shared GPU UUID, what NVML reports running on it.
pub fn audit(
    processes: &BTreeMap<String, Vec<GpuProcess>>,
    leases: &[LeaseView],
) -> Vec<Violation> {
    let mut found = Vec::new();
    for (gpu, procs) in processes {
        let owner = |pid: u32| {
            leases
                .iter()
                .find(|l| l.gpus.contains(gpu) && l.client_pids.contains(&pid))
        };
        let mut per_lease: BTreeMap<&LeaseId, (u64, Vec<u32>, u64)> = BTreeMap::new();
        for p in procs {
            match owner(p.pid) {
                None => found.push(Violation {
                    kind: ViolationKind::Unregistered,
                    gpu: gpu.clone(),
                    pid: p.pid,
                    lease: None,
                    memory_used: p.memory_used.unwrap_or(0),
                    memory_quota: None,
                    killed: false,
                }),
                Some(lease) => {
                    let entry =
                        per_lease
                            .entry(lease.id)
                            .or_insert((0, Vec::new(), lease.memory_quota));
                    entry.0 += p.memory_used.unwrap_or(0);
                    entry.1.push(p.pid);
                }
            }
        }
        for (lease, (used, pids, quota)) in per_lease {
            if used > quota {
                found.extend(pids.into_iter().map(|pid| Violation {
                    kind: ViolationKind::OverQuota,
                    gpu: gpu.clone(),
                    pid,
                    lease: Some(lease.clone()),
                    memory_used: used,
                    memory_quota: Some(quota),
                    killed: false,
                }));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn procs(list: &[(&str, u32, u64)]) -> BTreeMap<String, Vec<GpuProcess>> {
        let mut m: BTreeMap<String, Vec<GpuProcess>> = BTreeMap::new();
        for &(gpu, pid, gib) in list {
            m.entry(gpu.into()).or_default().push(GpuProcess {
                pid,
                memory_used: Some(gib * GI),
            });
        }
        m
    }

    #[test]
    fn registered_processes_within_quota_are_fine() {
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: 4 * GI,
            client_pids: vec![10, 11],
        }];
        assert!(audit(&procs(&[("GPU-0", 10, 2), ("GPU-0", 11, 2)]), &leases).is_empty());
    }

    #[test]
    fn unregistered_and_wrong_gpu_processes_are_reported() {
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: 4 * GI,
            client_pids: vec![10],
        }];
        let found = audit(&procs(&[("GPU-0", 99, 1), ("GPU-1", 10, 1)]), &leases);
        let summary: Vec<_> = found
            .iter()
            .map(|v| (v.kind, v.gpu.as_str(), v.pid))
            .collect();
        assert_eq!(
            summary,
            [
                (ViolationKind::Unregistered, "GPU-0", 99),
                (ViolationKind::Unregistered, "GPU-1", 10),
            ],
            "a registered process on a GPU its lease does not hold bypassed the interposer"
        );
    }

    #[test]
    fn a_lease_over_quota_on_a_gpu_reports_each_of_its_processes_there() {
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: 4 * GI,
            client_pids: vec![10, 11],
        }];
        let found = audit(&procs(&[("GPU-0", 10, 3), ("GPU-0", 11, 2)]), &leases);
        assert_eq!(found.len(), 2);
        for v in &found {
            assert_eq!(v.kind, ViolationKind::OverQuota);
            assert_eq!((v.memory_used, v.memory_quota), (5 * GI, Some(4 * GI)));
            assert_eq!(v.lease.as_ref(), Some(&id));
        }
    }
}
