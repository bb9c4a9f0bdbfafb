//! The backstop no LD_PRELOAD-only system has: compare what NVML sees on the
//! shared GPUs with the processes that registered through lease sockets.
//!
//! Pure: the caller gathers NVML's process lists and the registered clients, and
//! decides what to do with the findings (log, report, kill by policy). The state
//! carried between passes (who has been unregistered since when) lives in
//! [`Watchdog`]; the clock is an argument.
//!
//! Over quota means what the ledger means: the lease's processes' NVML usage
//! (contexts and modules included, as the ledger now charges them) summed over all
//! of the lease's GPUs, against the ledger's quota for the lease. A process that
//! stayed within what its ledger granted therefore stays within this threshold.
//!
//! Unregistered means NVML lists the process on a shared GPU and no lease on that
//! GPU registered it, continuously for [`Timing::unregistered_grace`], and not
//! within [`Timing::restart_grace`] of the arbiter's start.

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

/// A process on a GPU: (GPU UUID, host pid).
pub type Place = (String, u32);

/// What one NVML listing shows at once, with no grace: processes no lease on their
/// GPU registered, and leases over their quota. `processes`: per shared GPU UUID,
/// what NVML reports running on it.
pub fn listing_findings(
    processes: &BTreeMap<String, Vec<GpuProcess>>,
    leases: &[LeaseView],
) -> Vec<Violation> {
    let mut found = Vec::new();
    // Per lease: NVML's usage over all of its GPUs, and where its processes are.
    let mut per_lease: BTreeMap<&LeaseId, LeaseUse> = BTreeMap::new();
    for (gpu, procs) in processes {
        for p in procs {
            match owner(leases, gpu, p.pid) {
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

/// The lease on `gpu` that registered `pid`.
fn owner<'l, 'a>(leases: &'l [LeaseView<'a>], gpu: &str, pid: u32) -> Option<&'l LeaseView<'a>> {
    leases
        .iter()
        .find(|l| l.gpus.iter().any(|g| g == gpu) && l.client_pids.contains(&pid))
}

// ----- timing -----

/// A process registers when the interposer attaches, at its context's creation: a
/// round trip on the lease socket, milliseconds after NVML can first list the
/// context. 2 s is far beyond that even on a loaded node (library loading, a
/// connection retried once), and still ends a bypassing process's unnoticed use
/// within seconds.
pub const UNREGISTERED_GRACE: Duration = Duration::from_secs(2);
/// After the arbiter (re)starts, every running CUDA process re-attaches and reopens
/// its token connection: the interposer does so within about 0.5 s of the new
/// lease socket appearing. 10 s covers a node with many processes re-attaching while
/// the arbiter recovers its leases, so an upgrade never gets a well-behaved process
/// reported or killed; a process that has not re-attached by then is treated like
/// any other.
pub const RESTART_GRACE: Duration = Duration::from_secs(10);
/// The watchdog's graces, from its pass interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a process must be seen unregistered, continuously, before it is
    /// reported: [`UNREGISTERED_GRACE`] or two passes, whichever is longer (one pass
    /// could see a context an instant before its attach lands).
    pub unregistered_grace: Duration,
    /// Nothing is reported unregistered this soon after the arbiter started:
    /// [`RESTART_GRACE`] or three passes, whichever is longer.
    pub restart_grace: Duration,
}

impl Timing {
    pub fn for_interval(interval: Duration) -> Timing {
        Timing {
            unregistered_grace: UNREGISTERED_GRACE.max(interval * 2),
            restart_grace: RESTART_GRACE.max(interval * 3),
        }
    }
}

/// The watchdog's memory between passes.
#[derive(Debug)]
pub struct Watchdog {
    started: Instant,
    timing: Timing,
    /// Since when each (GPU, pid) has been seen unregistered, pass after pass.
    unregistered_since: BTreeMap<Place, Instant>,
}

impl Watchdog {
    /// `started`: when the arbiter started (the restart grace runs from it).
    pub fn new(started: Instant, interval: Duration) -> Watchdog {
        Watchdog {
            started,
            timing: Timing::for_interval(interval),
            unregistered_since: BTreeMap::new(),
        }
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// One pass: what the listing shows, an unregistered process only once it has
    /// been so for the grace and the restart grace is over.
    pub fn audit(
        &mut self,
        now: Instant,
        processes: &BTreeMap<String, Vec<GpuProcess>>,
        leases: &[LeaseView],
    ) -> Vec<Violation> {
        let in_restart_grace =
            now.saturating_duration_since(self.started) < self.timing.restart_grace;
        let mut found = listing_findings(processes, leases);
        // Unregistered: only once seen so continuously for the grace.
        let seen: Vec<Place> = found
            .iter()
            .filter(|v| v.kind == ViolationKind::Unregistered)
            .map(|v| (v.gpu.clone(), v.pid))
            .collect();
        self.unregistered_since
            .retain(|place, _| seen.contains(place));
        for place in &seen {
            self.unregistered_since.entry(place.clone()).or_insert(now);
        }
        let grace = self.timing.unregistered_grace;
        let since = &self.unregistered_since;
        found.retain(|v| {
            v.kind != ViolationKind::Unregistered
                || (!in_restart_grace
                    && since
                        .get(&(v.gpu.clone(), v.pid))
                        .is_some_and(|s| now.saturating_duration_since(*s) >= grace))
        });
        found
    }
}

/// The periodic audit: reconcile, list NVML's processes, report (and, with
/// `kill`, SIGKILL) what the audit finds.
pub fn spawn(arbiter: SharedArbiter, backend: Arc<dyn GpuBackend>, interval: Duration, kill: bool) {
    tokio::spawn(async move {
        let mut watchdog = Watchdog::new(Instant::now(), interval);
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
            let mut found = watchdog.audit(Instant::now(), &processes, &input.views());
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
        assert!(
            listing_findings(&procs(&[("GPU-0", 10, 2), ("GPU-0", 11, 2)]), &leases).is_empty()
        );
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
        let found = listing_findings(&procs(&[("GPU-0", 99, 1), ("GPU-1", 10, 1)]), &leases);
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
        let found = listing_findings(&procs(&[("GPU-0", 10, 3), ("GPU-0", 11, 2)]), &leases);
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
        assert!(listing_findings(&table, &leases).is_empty());
        table.get_mut("GPU-0").unwrap()[0].memory_used = Some(GI + 1);
        assert_eq!(listing_findings(&table, &leases).len(), 1);
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
        assert!(
            listing_findings(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 2)]), &leases).is_empty()
        );
        let over = listing_findings(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 3)]), &leases);
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

    // ----- graces (finding 4) -----

    const SECOND: Duration = Duration::from_secs(1);

    /// Passes at the given seconds after `t0` with pid 99 on GPU-0 when `present`;
    /// whether each pass reported it unregistered.
    fn unregistered_passes(started_before_t0: Duration, passes: &[(f64, bool)]) -> Vec<bool> {
        let t0 = Instant::now() + Duration::from_secs(3600);
        let mut w = Watchdog::new(t0 - started_before_t0, SECOND);
        let id = LeaseId("a".into());
        let gpus = vec!["GPU-0".to_string()];
        let leases = [LeaseView {
            id: &id,
            gpus: &gpus,
            memory_quota: 4 * GI,
            client_pids: vec![10],
        }];
        passes
            .iter()
            .map(|&(at, present)| {
                let mut list = vec![("GPU-0", 10, 1)];
                if present {
                    list.push(("GPU-0", 99, 1));
                }
                let found = w.audit(t0 + Duration::from_secs_f64(at), &procs(&list), &leases);
                assert!(found.iter().all(|v| v.pid == 99), "{found:?}");
                !found.is_empty()
            })
            .collect()
    }

    #[test]
    fn an_unregistered_process_is_reported_once_seen_so_for_the_grace() {
        // Interval 1 s: the grace is 2 s (two passes would be less).
        assert_eq!(Timing::for_interval(SECOND).unregistered_grace, 2 * SECOND);
        assert_eq!(
            Timing::for_interval(3 * SECOND).unregistered_grace,
            6 * SECOND
        );
        let hour = Duration::from_secs(3600);
        for (passes, expected) in [
            // Seen at 0, 1, 2: reported at 2 s, and on.
            (
                vec![(0.0, true), (1.0, true), (2.0, true), (3.0, true)],
                vec![false, false, true, true],
            ),
            // Registered in time (gone from the unregistered list at 1 s): never.
            (
                vec![(0.0, true), (1.0, false), (2.0, false)],
                vec![false, false, false],
            ),
            // Continuity: a gap restarts the grace.
            (
                vec![
                    (0.0, true),
                    (1.5, false),
                    (2.0, true),
                    (3.0, true),
                    (4.0, true),
                ],
                vec![false, false, false, false, true],
            ),
        ] {
            assert_eq!(unregistered_passes(hour, &passes), expected, "{passes:?}");
        }
    }

    #[test]
    fn nothing_is_reported_unregistered_within_the_restart_grace() {
        assert_eq!(Timing::for_interval(SECOND).restart_grace, 10 * SECOND);
        // The arbiter started at t0; the process is there from the first pass on and
        // never registers: reported once the restart grace is over (it has been
        // unregistered far longer than the grace by then).
        let passes: Vec<(f64, bool)> = (0..13).map(|s| (s as f64 + 0.2, true)).collect();
        let reported = unregistered_passes(Duration::ZERO, &passes);
        let first = reported.iter().position(|r| *r).unwrap();
        assert_eq!(passes[first].0, 10.2, "{reported:?}");
        assert!(reported[first..].iter().all(|r| *r));
    }
}
