//! Per-process overhead: what NVML says each lease's processes hold beyond their
//! explicit allocations, measured and recorded in the ledger.

use super::*;

impl Arbiter {
    /// The overhead charged for a process until it is measured, and the least a
    /// lease's quota must exceed (0 when overhead is not accounted).
    pub fn overhead_estimate(&self) -> u64 {
        match self.memory_probe {
            Some(_) => self.config.context_memory_estimate.0,
            None => 0,
        }
    }

    /// What a measurement of `lease` (every lease: None) needs: the probe and the
    /// GPUs to list. None when overhead is not measured.
    pub fn measurement(
        &self,
        lease: Option<&LeaseId>,
    ) -> Option<(Arc<dyn GpuBackend>, Vec<String>)> {
        let probe = self.memory_probe.clone()?;
        let gpus = match lease {
            Some(id) => self.leases.get(id)?.lease.gpus.clone(),
            None => self.inventory.gpus.iter().map(|g| g.uuid.clone()).collect(),
        };
        Some((probe, gpus))
    }

    /// Whether `lease` was measured less than `fresh` ago.
    pub fn measured_within(&self, lease: &LeaseId, now: Instant, fresh: Duration) -> bool {
        self.telemetry.measured_within(lease, now, fresh)
    }

    /// Whether some registered process is still charged the estimate.
    pub fn has_unmeasured_clients(&self) -> bool {
        self.memory_probe.is_some()
            && self
                .leases
                .keys()
                .any(|id| self.ledger.get(id).is_some_and(|l| l.has_unmeasured()))
    }

    /// Records NVML's process lists (per GPU UUID) in the ledger: each lease's
    /// processes' usage on the lease's GPUs sets their overhead. A lease with a GPU
    /// missing from the lists (its listing failed) is left as it was: a partial
    /// listing would read as processes without a context.
    pub fn record_process_memory(&mut self, processes: &ProcessTable, now: Instant) {
        for record in self.leases.values() {
            let l = &record.lease;
            if l.gpus.is_empty() || !l.gpus.iter().all(|g| processes.contains_key(g)) {
                continue;
            }
            let mut usage: BTreeMap<u32, u64> = BTreeMap::new();
            for gpu in &l.gpus {
                for p in processes.get(gpu).into_iter().flatten() {
                    if let Some(bytes) = p.memory_used {
                        let u = usage.entry(p.pid).or_default();
                        *u = u.saturating_add(bytes);
                    }
                }
            }
            self.ledger.record_usage(&l.id, &usage);
            // The container's processes that have not attached (re-attaching after a
            // restart, or bypassing the interposer) hold memory the lease must count;
            // one attached to any lease is counted there.
            let unattached = usage
                .iter()
                .filter(|(&pid, _)| !self.ledger.is_attached(pid))
                .filter(|(&pid, _)| {
                    check_peer(self.probe.as_ref(), pid, l.pid, record.cgroup.as_deref())
                        == PeerCheck::Accepted
                })
                .map(|(&pid, &bytes)| (pid, bytes))
                .collect();
            self.ledger.record_unattached(&l.id, unattached);
            self.telemetry.mark_measured(&l.id, now);
        }
    }
}

/// NVML's processes on `gpus`; None when the backend cannot list them.
pub fn list_processes(backend: &dyn GpuBackend, gpus: Vec<String>) -> Option<ProcessTable> {
    let mut table = ProcessTable::new();
    for uuid in gpus {
        match backend.processes(&uuid) {
            Ok(Some(list)) => {
                table.insert(uuid, list);
            }
            Ok(None) => return None,
            Err(e) => tracing::warn!(error = %e, gpu = %uuid, "listing GPU processes failed"),
        }
    }
    Some(table)
}
