//! What the state reports (status, lists, the watchdog's input and findings)
//! and the samples it records for placement.

use super::*;

impl Arbiter {
    pub fn record_samples(&mut self, now: Instant, samples: &[(String, GpuSample)]) {
        for (uuid, sample) in samples {
            if let Some(i) = self.inventory.gpus.iter().position(|g| &g.uuid == uuid) {
                self.telemetry.record_sample(i, now, sample);
            }
        }
        self.record_held_time(now);
        // Utilisation falling may open a GPU to a waiting low-priority request.
        self.run_admission();
    }

    pub fn watchdog_input(&self) -> WatchdogInput {
        WatchdogInput {
            gpus: self.inventory.gpus.iter().map(|g| g.uuid.clone()).collect(),
            leases: self
                .leases
                .values()
                .map(|r| {
                    let pids = self
                        .ledger
                        .get(&r.lease.id)
                        .map(|l| l.clients.values().map(|c| c.pid).collect())
                        .unwrap_or_default();
                    (
                        r.lease.id.clone(),
                        r.lease.gpus.clone(),
                        ledger_quota(&r.lease),
                        pids,
                    )
                })
                .collect(),
        }
    }

    /// The watchdog's pass found `violations` (they replace those listed).
    pub fn record_violations(&mut self, violations: Vec<Violation>) {
        self.findings.record_watchdog_pass(violations);
    }

    /// A violation the token service measured on its own clock (an overrun) or the
    /// bypass check on NVML's (ungated beside an active high job): counted and listed
    /// at once, not at the watchdog's next pass.
    pub fn record_token_violation(&mut self, violation: Violation) {
        self.findings.record_at_once(violation);
    }

    pub fn violation_totals(&self) -> &BTreeMap<&'static str, u64> {
        self.findings.totals()
    }
    // ----- reports -----

    pub fn list(&self) -> Vec<Lease> {
        self.leases.values().map(|r| r.lease.clone()).collect()
    }

    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    pub fn status(&self) -> StatusReport {
        let now = Instant::now();
        let views = self.views();
        let token_times: HashMap<LeaseId, crate::tokens::LeaseTime> = self
            .tokens
            .as_ref()
            .map(|t| t.lease_times())
            .unwrap_or_default()
            .into_iter()
            .map(|t| (t.lease.clone(), t))
            .collect();
        StatusReport {
            gpus: self
                .inventory
                .gpus
                .iter()
                .zip(&views)
                .enumerate()
                .map(|(i, (g, v))| GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_total: g.memory_total,
                    memory_allocatable: g.memory_allocatable,
                    memory_leased: v.memory_leased,
                    memory_used: self.telemetry.memory_used(i),
                    utilization_last_minute: self.telemetry.utilization_last_minute(i, now),
                    drained: v.drained,
                    reserved_for: v.reserved_for.map(str::to_owned),
                })
                .collect(),
            leases: self.list(),
            driver_cuda_version: self.inventory.cuda_driver_version,
            inventory_source: self.inventory.source.to_owned(),
            usage: self
                .leases
                .values()
                .map(|r| {
                    let ledger = self.ledger.get(&r.lease.id);
                    let token_time = token_times.get(&r.lease.id);
                    LeaseUsage {
                        lease: r.lease.id.clone(),
                        memory_used: ledger.map(|l| l.used()).unwrap_or(0),
                        memory_quota: ledger_quota(&r.lease),
                        clients: ledger
                            .map(|l| {
                                l.clients
                                    .values()
                                    .map(|c| ClientStatus {
                                        pid: c.pid,
                                        memory_held: c.held,
                                        memory_overhead: c.overhead,
                                        overhead_measured: c.measured.is_some(),
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                        cgroup: r.cgroup.clone(),
                        container: self.container_name(&r.lease),
                        token_time_ms: token_time.map_or(0, |t| t.held_ns / 1_000_000),
                        token_share_10s: token_time.map(|t| t.share_short()),
                        token_share_1m: token_time.map(|t| t.share_long()),
                        memory_refusals: self.findings.memory_refusals(&r.lease.id),
                        token_revocations: token_time.map_or(0, |t| t.revocations),
                        token_cut_offs: token_time.map_or(0, |t| t.cut_offs),
                        token_overdue: token_time.map_or(0, |t| t.overdue),
                    }
                })
                .collect(),
            queue: self
                .queue
                .iter()
                .enumerate()
                .map(|(position, w)| QueuedRequest {
                    container_id: w.item.request.container_id.clone(),
                    priority: w.priority,
                    memory: w.item.request.memory,
                    gpu: w.item.request.gpu.clone(),
                    position,
                    waited_ms: now.duration_since(w.arrived).as_millis() as u64,
                })
                .collect(),
            violations: self.findings.violations().to_vec(),
            tokens: self.tokens.as_ref().map(|t| t.status()).unwrap_or_default(),
            unshareable: self.unshareable.iter().map(|u| u.status()).collect(),
            connections: self
                .tokens
                .as_ref()
                .map(|t| t.budget().status())
                .unwrap_or_default(),
            store_failure: self.store.failure().map(|f| f.to_string()),
            grants: self.grants(),
            placement: self.placement_hints(),
            placement_waits_fragmented: self.admission_record.waits_fragmented(),
            placement_times: self.admission_record.placement_times(),
            gpu_utilization: self
                .inventory
                .gpus
                .iter()
                .enumerate()
                .map(|(i, g)| GpuUtilization {
                    uuid: g.uuid.clone(),
                    last_10s: self.telemetry.utilization_last_10s(i, now),
                })
                .collect(),
            admission_rejections: self.admission_record.rejections(),
            last_sample_age_ms: self
                .telemetry
                .last_sample_age(now)
                .map(|age| age.as_millis() as u64),
            reclaim: self.reclaim_status().map(Box::new),
            no_gpus_reason: self.no_gpus_reason.clone(),
        }
    }

    /// What people call a lease's container: its pod's namespace/name/container, else
    /// the name its engine gave it (docker's), else its id shortened as docker does.
    pub fn container_name(&self, lease: &Lease) -> String {
        let has_pod_name = lease
            .pod
            .as_ref()
            .is_some_and(|p| p.namespace.is_some() && p.name.is_some());
        match self.engine_names.get(&lease.id) {
            Some(name) if !has_pod_name => name.clone(),
            _ => lease.display_name(),
        }
    }

    /// The lease of the container whose init is `pid` was named `name` by its engine.
    pub fn remember_engine_name(&mut self, pid: u32, name: String) {
        let leases = &self.leases;
        self.engine_names.retain(|id, _| leases.contains_key(id));
        if let Some(r) = self.leases.values().find(|r| r.lease.pid == Some(pid)) {
            self.engine_names.insert(r.lease.id.clone(), name);
        }
    }

    /// An allocation of `lease` was refused for its quota (counted for metrics).
    /// A refusal reported after the lease went is dropped: only live leases' are shown.
    pub fn count_memory_refusal(&mut self, lease: &LeaseId) {
        if self.leases.contains_key(lease) {
            self.findings.count_memory_refusal(lease);
        }
    }
}
