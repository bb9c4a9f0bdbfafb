//! The backstop no LD_PRELOAD-only system has: compare what NVML sees on the
//! shared GPUs with the processes that registered through lease sockets.
//!
//! Pure: the caller gathers NVML's process lists and the registered clients,
//! and decides what to do with the findings (log, report, kill by policy).
//!
//! Over quota means what the ledger means: the lease's processes' NVML usage
//! (contexts and modules included, as the ledger now charges them) summed over all
//! of the lease's GPUs, against the ledger's quota for the lease. A process that
//! stayed within what its ledger granted therefore stays within this threshold.

use std::collections::BTreeMap;

use gpushare_proto::{LeaseId, Violation, ViolationKind};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::inventory::{GpuBackend, GpuProcess};
use crate::server::{list_processes, lock, SharedArbiter};

/// A lease as the watchdog sees it.
#[derive(Debug, Clone)]
pub struct LeaseView<'a> {
    pub id: &'a LeaseId,
    pub gpus: &'a [String],
    /// The ledger's quota: the lease's memory on each GPU × its GPUs.
    pub memory_quota: u64,
    /// Host pids registered through the lease's socket.
    pub client_pids: Vec<u32>,
}

/// A lease's NVML usage summed over its GPUs, where its processes are (GPU, pid),
/// and its quota.
type LeaseUse<'a> = (u64, Vec<(&'a String, u32)>, u64);

/// `processes`: per shared GPU UUID, what NVML reports running on it.
pub fn audit(
    processes: &BTreeMap<String, Vec<GpuProcess>>,
    leases: &[LeaseView],
) -> Vec<Violation> {
    let mut found = Vec::new();
    // Per lease: NVML's usage over all of its GPUs, and where its processes are.
    let mut per_lease: BTreeMap<&LeaseId, LeaseUse> = BTreeMap::new();
    for (gpu, procs) in processes {
        let owner = |pid: u32| {
            leases
                .iter()
                .find(|l| l.gpus.contains(gpu) && l.client_pids.contains(&pid))
        };
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
                    entry.0 = entry.0.saturating_add(p.memory_used.unwrap_or(0));
                    entry.1.push((gpu, p.pid));
                }
            }
        }
    }
    for (lease, (used, places, quota)) in per_lease {
        if used > quota {
            found.extend(places.into_iter().map(|(gpu, pid)| Violation {
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
    found
}

/// The periodic audit: reconcile, list NVML's processes, report (and, with
/// `kill`, SIGKILL) what the audit finds.
pub fn spawn(arbiter: SharedArbiter, backend: Arc<dyn GpuBackend>, interval: Duration, kill: bool) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        let mut reported: Vec<Violation> = Vec::new();
        loop {
            tick.tick().await;
            lock(&arbiter).reconcile(Instant::now());
            let input = lock(&arbiter).watchdog_input();
            let backend = backend.clone();
            let gpus = input.gpus.clone();
            let processes =
                tokio::task::spawn_blocking(move || list_processes(backend.as_ref(), gpus))
                    .await
                    .ok()
                    .flatten();
            let Some(processes) = processes else { continue };
            // The same listing measures every process's overhead.
            lock(&arbiter).record_process_memory(&processes, Instant::now());
            let mut found = audit(&processes, &input.views());
            let own = std::process::id();
            for v in &mut found {
                let is_new = !reported
                    .iter()
                    .any(|r| r.kind == v.kind && r.pid == v.pid && r.gpu == v.gpu);
                if is_new {
                    tracing::warn!(kind = ?v.kind, gpu = %v.gpu, pid = v.pid, lease = ?v.lease, memory = v.memory_used, quota = ?v.memory_quota, "watchdog violation");
                }
                if kill && v.pid > 1 && v.pid != own {
                    match nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(v.pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    ) {
                        Ok(()) => {
                            v.killed = true;
                            tracing::warn!(pid = v.pid, gpu = %v.gpu, "watchdog killed the process");
                        }
                        Err(e) => {
                            tracing::warn!(pid = v.pid, error = %e, "watchdog could not kill")
                        }
                    }
                }
            }
            reported = found.clone();
            lock(&arbiter).record_violations(found);
        }
    });
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

    #[test]
    fn a_process_with_its_context_up_to_the_quota_is_not_over() {
        // 1 GiB quota; the process's context (300 MiB) was charged, so it could
        // allocate only 724 MiB: NVML shows exactly the quota.
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: GI,
            client_pids: vec![10],
        }];
        let mut table = procs(&[]);
        table.insert(
            "GPU-0".into(),
            vec![GpuProcess {
                pid: 10,
                memory_used: Some(GI),
            }],
        );
        assert!(audit(&table, &leases).is_empty());
        table.get_mut("GPU-0").unwrap()[0].memory_used = Some(GI + 1);
        assert_eq!(audit(&table, &leases).len(), 1);
    }

    #[test]
    fn a_multi_gpu_lease_is_measured_against_its_whole_quota() {
        // 2 GPUs × 4 GiB: the ledger grants 8 GiB across them, used unevenly.
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string(), "GPU-1".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: 8 * GI,
            client_pids: vec![10],
        }];
        assert!(audit(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 2)]), &leases).is_empty());
        let over = audit(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 3)]), &leases);
        let summary: Vec<_> = over
            .iter()
            .map(|v| (v.kind, v.gpu.as_str(), v.memory_used, v.memory_quota))
            .collect();
        assert_eq!(
            summary,
            [
                (ViolationKind::OverQuota, "GPU-0", 9 * GI, Some(8 * GI)),
                (ViolationKind::OverQuota, "GPU-1", 9 * GI, Some(8 * GI)),
            ]
        );
    }
}
