//! The backstop no LD_PRELOAD-only system has: compare what NVML sees on the
//! shared GPUs with the processes that registered through lease sockets, and with
//! the time each process held its GPU's time-slice token.
//!
//! Pure: the caller gathers NVML's process lists and per-process utilisation, the
//! registered clients and the token holdings, and decides what to do with the
//! findings (log, report, kill by policy). The state carried between passes (who
//! has been unregistered since when, recent busy and held times) lives in
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
//!
//! Ungated means a registered process was busy on a GPU whose time is scheduled for
//! much longer than its token connections held the token (or with no token
//! connection at all), over [`Timing::ungated_window`]: see [`Watchdog::audit`].

use std::collections::{BTreeMap, VecDeque};

use gpushare_config::{SchedulerConfig, SchedulingPolicy};
use gpushare_proto::{LeaseId, Priority, Violation, ViolationKind};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::inventory::{GpuBackend, GpuProcess, ProcessUtilization};
use crate::state::{list_processes, ArbiterHandle};
use crate::tokens::{Holding, TokenService};

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

// The view is the watchdog's: the state hands out plain data and knows nothing of it.
impl crate::state::WatchdogInput {
    pub fn views(&self) -> Vec<LeaseView<'_>> {
        self.leases
            .iter()
            .map(|(id, gpus, quota, pids)| LeaseView {
                id,
                gpus,
                memory_quota: *quota,
                client_pids: pids.clone(),
            })
            .collect()
    }
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
pub fn owner<'l, 'a>(
    leases: &'l [LeaseView<'a>],
    gpu: &str,
    pid: u32,
) -> Option<&'l LeaseView<'a>> {
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
/// NVML's sampling period is 1/6 s to 1 s depending on the GPU (`nvidia-smi -q -d
/// UTILIZATION`); busy time is known only per period, so up to one period of it can
/// be counted next to token time of the pass before or after. The slack for that.
pub const SAMPLE_PERIOD_MAX: Duration = Duration::from_secs(1);
/// Busy and held times are compared over the last passes spanning at least this
/// long, so one pass's sampling edges do not decide alone.
pub const UNGATED_WINDOW: Duration = Duration::from_secs(5);

/// The watchdog's graces, from its pass interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a process must be seen unregistered, continuously, before it is
    /// reported: [`UNREGISTERED_GRACE`] or two passes, whichever is longer (one pass
    /// could see a context an instant before its attach lands).
    pub unregistered_grace: Duration,
    /// Nothing is reported unregistered or ungated this soon after the arbiter
    /// started: [`RESTART_GRACE`] or three passes, whichever is longer.
    pub restart_grace: Duration,
    /// The span busy and held times are compared over: [`UNGATED_WINDOW`] or three
    /// passes, whichever is longer.
    pub ungated_window: Duration,
}

impl Timing {
    pub fn for_interval(interval: Duration) -> Timing {
        Timing {
            unregistered_grace: UNREGISTERED_GRACE.max(interval * 2),
            restart_grace: RESTART_GRACE.max(interval * 3),
            ungated_window: UNGATED_WINDOW.max(interval * 3),
        }
    }
}

/// How GPU time is scheduled on this node (`[scheduler]`), as the ungated check
/// needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduling {
    pub policy: SchedulingPolicy,
    /// `scheduler.revoke_grace_ms`: how long a revoked holder may drain.
    pub revoke_grace: Duration,
}

impl Scheduling {
    pub fn from_config(config: &SchedulerConfig) -> Scheduling {
        Scheduling {
            policy: config.policy,
            revoke_grace: Duration::from_millis(config.revoke_grace_ms),
        }
    }
}

// ----- what the GPUs and the token did between two passes -----

/// A process's token connections on one GPU: its priority and nanoseconds holding
/// the token (cumulative, or over a pass once differenced).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub priority: Priority,
    pub held_ns: u64,
}

/// Cumulative token time per (GPU, pid), summed over its connections. Connections
/// whose peer pid is unknown cannot be matched with NVML's pids and are left out.
pub fn token_totals(holdings: &[Holding]) -> BTreeMap<Place, Held> {
    let mut totals: BTreeMap<Place, Held> = BTreeMap::new();
    for h in holdings {
        let Some(pid) = h.pid else { continue };
        let entry = totals.entry((h.gpu.clone(), pid)).or_insert(Held {
            priority: h.priority,
            held_ns: 0,
        });
        entry.held_ns = entry.held_ns.saturating_add(h.held_ns);
        if h.priority == Priority::High {
            entry.priority = Priority::High;
        }
    }
    totals
}

/// Token time per (GPU, pid) between two readings of [`token_totals`]. A total that
/// went down (a connection closed, another opened) counts from zero.
pub fn held_between(
    before: &BTreeMap<Place, Held>,
    after: &BTreeMap<Place, Held>,
) -> BTreeMap<Place, Held> {
    after
        .iter()
        .map(|(place, now)| {
            let was = before.get(place).map_or(0, |b| b.held_ns);
            let held_ns = if now.held_ns >= was {
                now.held_ns - was
            } else {
                now.held_ns
            };
            (
                place.clone(),
                Held {
                    priority: now.priority,
                    held_ns,
                },
            )
        })
        .collect()
}

/// Busy nanoseconds per (GPU, pid) over `span` from NVML's per-process samples
/// since the previous pass: the larger of its SM and memory utilisation (kernels;
/// copies and memsets), as a share of the span.
pub fn busy_from_samples(
    samples: &BTreeMap<String, Vec<ProcessUtilization>>,
    span: Duration,
) -> BTreeMap<Place, u64> {
    let span_ns = span.as_nanos().min(u64::MAX as u128) as u64;
    let mut busy: BTreeMap<Place, u64> = BTreeMap::new();
    for (gpu, list) in samples {
        for s in list {
            let percent = s.sm_percent.max(s.memory_percent).min(100) as u128;
            let ns = (span_ns as u128 * percent / 100) as u64;
            let entry = busy.entry((gpu.clone(), s.pid)).or_default();
            *entry = entry.saturating_add(ns).min(span_ns);
        }
    }
    busy
}

/// What the GPUs and the token did between the previous pass and this one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassActivity {
    pub span: Duration,
    /// NVML: busy nanoseconds per (GPU, pid); processes not listed were idle.
    pub busy: BTreeMap<Place, u64>,
    /// The token: per (GPU, pid) with a token connection, its time holding it.
    pub held: BTreeMap<Place, Held>,
}

/// One pass of one process, kept for the window.
#[derive(Debug, Clone, Copy)]
struct Recorded {
    at: Instant,
    span_ns: u64,
    busy_ns: u64,
    held_ns: u64,
    /// Its priority, when it had a token connection in that pass.
    priority: Option<Priority>,
}

/// Busy and held time of one process over the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UngatedUse {
    pub span_ns: u64,
    pub busy_ns: u64,
    pub held_ns: u64,
    pub tolerance_ns: u64,
}

/// The watchdog's memory between passes.
#[derive(Debug)]
pub struct Watchdog {
    started: Instant,
    timing: Timing,
    scheduling: Scheduling,
    /// Since when each (GPU, pid) has been seen unregistered, pass after pass.
    unregistered_since: BTreeMap<Place, Instant>,
    /// Recent passes per (GPU, pid), oldest first, within the window.
    recent: BTreeMap<Place, VecDeque<Recorded>>,
}

impl Watchdog {
    /// `started`: when the arbiter started (the restart grace runs from it).
    pub fn new(started: Instant, interval: Duration, scheduling: Scheduling) -> Watchdog {
        Watchdog {
            started,
            timing: Timing::for_interval(interval),
            scheduling,
            unregistered_since: BTreeMap::new(),
            recent: BTreeMap::new(),
        }
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// How much GPU time beyond its token time a process may show over a window of
    /// `span_ns` and still be well-behaved. Its token time runs from the grant to its
    /// release, the drain after a revocation included, so a gated process's GPU work
    /// lies inside it but for the sampling edges: one NVML period
    /// ([`SAMPLE_PERIOD_MAX`]). On top: `scheduler.revoke_grace_ms`, a drain the
    /// scheduler itself lets run, should a client release before its last queued
    /// kernel ends; and a tenth of the window for the launch latency between a grant
    /// and the first kernel reaching the GPU, repeated at every grant. An ungated job
    /// beside a busy high-priority job gets about half the GPU, five times that.
    pub fn tolerance_ns(&self, span_ns: u64) -> u64 {
        (self.scheduling.revoke_grace + SAMPLE_PERIOD_MAX).as_nanos() as u64 + span_ns / 10
    }

    /// One pass. `activity`: what the GPUs and the token did since the previous
    /// pass (None on the first pass, or where NVML cannot measure per-process
    /// utilisation).
    ///
    /// Ungated: on a GPU whose time is scheduled (`scheduler.policy` not "off"), a
    /// registered process of a single-GPU lease (multi-GPU leases run ungated by
    /// design) that, over the window, was busy on the GPU for more than its token
    /// time plus [`Watchdog::tolerance_ns`] — with no token connection at all, or a
    /// low-priority one (any priority under round-robin; under the priority policy a
    /// high-priority job submits without waiting for a grant, so its busy time says
    /// nothing).
    pub fn audit(
        &mut self,
        now: Instant,
        processes: &BTreeMap<String, Vec<GpuProcess>>,
        leases: &[LeaseView],
        activity: Option<&PassActivity>,
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
        // Ungated.
        if self.scheduling.policy == SchedulingPolicy::Off {
            self.recent.clear();
            return found;
        }
        if let Some(activity) = activity.filter(|_| !in_restart_grace) {
            self.record(now, activity);
        }
        let window = self.timing.ungated_window;
        self.recent.retain(|_, passes| {
            passes.retain(|r| now.saturating_duration_since(r.at) < window);
            !passes.is_empty()
        });
        if in_restart_grace {
            return found;
        }
        for ((gpu, pid), passes) in &self.recent {
            let Some(lease) = owner(leases, gpu, *pid) else {
                continue; // unregistered: reported as such
            };
            let priority = passes.iter().rev().find_map(|r| r.priority);
            let checked = match priority {
                None => lease.gpus.len() == 1,
                Some(Priority::Low) => true,
                Some(Priority::High) => self.scheduling.policy == SchedulingPolicy::RoundRobin,
            };
            if !checked {
                continue;
            }
            let Some(used) = self.ungated_use(gpu, *pid) else {
                continue;
            };
            if used.busy_ns > used.held_ns.saturating_add(used.tolerance_ns) {
                let memory_used = processes
                    .get(gpu)
                    .and_then(|list| list.iter().find(|p| p.pid == *pid))
                    .and_then(|p| p.memory_used)
                    .unwrap_or(0);
                found.push(Violation {
                    kind: ViolationKind::Ungated,
                    gpu: gpu.clone(),
                    pid: *pid,
                    lease: Some(lease.id.clone()),
                    memory_used,
                    memory_quota: None,
                    killed: false,
                });
            }
        }
        found
    }

    fn record(&mut self, now: Instant, activity: &PassActivity) {
        let span_ns = activity.span.as_nanos().min(u64::MAX as u128) as u64;
        let mut places: Vec<&Place> = activity.busy.keys().collect();
        places.extend(activity.held.keys());
        places.sort();
        places.dedup();
        for place in places {
            let held = activity.held.get(place);
            self.recent
                .entry(place.clone())
                .or_default()
                .push_back(Recorded {
                    at: now,
                    span_ns,
                    busy_ns: activity.busy.get(place).copied().unwrap_or(0),
                    held_ns: held.map_or(0, |h| h.held_ns),
                    priority: held.map(|h| h.priority),
                });
        }
        // Passes of a process that was neither busy nor holding still count as time
        // in the window: busy 0, held 0.
        for (place, passes) in self.recent.iter_mut() {
            if !activity.busy.contains_key(place) && !activity.held.contains_key(place) {
                passes.push_back(Recorded {
                    at: now,
                    span_ns,
                    busy_ns: 0,
                    held_ns: 0,
                    priority: None,
                });
            }
        }
    }

    /// A process's busy and held time over the window, and the tolerance for it.
    pub fn ungated_use(&self, gpu: &str, pid: u32) -> Option<UngatedUse> {
        let passes = self.recent.get(&(gpu.to_owned(), pid))?;
        let sum = |f: fn(&Recorded) -> u64| passes.iter().map(f).fold(0u64, u64::saturating_add);
        let span_ns = sum(|r| r.span_ns);
        Some(UngatedUse {
            span_ns,
            busy_ns: sum(|r| r.busy_ns),
            held_ns: sum(|r| r.held_ns),
            tolerance_ns: self.tolerance_ns(span_ns),
        })
    }
}

/// Wall-clock microseconds: NVML's sample timestamps are on this clock.
pub fn wall_clock_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// What the previous pass measured, for the next one to difference against.
struct Baseline {
    at: Instant,
    /// When the previous utilisation query was made (the next one asks for samples
    /// after it).
    wall_us: u64,
    totals: BTreeMap<Place, Held>,
}

/// The periodic audit: reconcile, list NVML's processes and their utilisation, read
/// the token holdings, report (and, with `kill`, SIGKILL) what the audit finds.
pub async fn run(
    arbiter: ArbiterHandle,
    backend: Arc<dyn GpuBackend>,
    interval: Duration,
    kill: bool,
    tokens: Arc<TokenService>,
) {
    let scheduling = Scheduling::from_config(tokens.config());
    let mut watchdog = Watchdog::new(Instant::now(), interval, scheduling);
    let mut tick = tokio::time::interval(interval);
    let mut reported: Vec<Violation> = Vec::new();
    let mut previous: Option<Baseline> = None;
    // Overruns are reported by the token service when they happen; a pass lists those
    // of the last ungated window beside its own findings.
    let overrun_listing = watchdog.timing().ungated_window;
    loop {
        tick.tick().await;
        arbiter.reconcile(Instant::now());
        let input = arbiter.watchdog_input();
        let backend = backend.clone();
        let gpus = input.gpus.clone();
        let since_us = previous.as_ref().map(|p| p.wall_us);
        let scheduled = scheduling.policy != SchedulingPolicy::Off;
        let listing = tokio::task::spawn_blocking(move || {
            let processes = list_processes(backend.as_ref(), gpus.clone())?;
            let wall_us = wall_clock_us();
            let utilization = match since_us {
                Some(since) if scheduled => utilization(backend.as_ref(), &gpus, since),
                _ => None,
            };
            Some((processes, utilization, wall_us))
        })
        .await
        .ok()
        .flatten();
        let Some((processes, utilization, wall_us)) = listing else {
            continue;
        };
        let now = Instant::now();
        let totals = token_totals(&tokens.holdings());
        let activity = match (previous.take(), utilization) {
            (Some(before), Some(samples)) => {
                let span = now.saturating_duration_since(before.at);
                Some(PassActivity {
                    span,
                    busy: busy_from_samples(&samples, span),
                    held: held_between(&before.totals, &totals),
                })
            }
            _ => None,
        };
        previous = Some(Baseline {
            at: now,
            wall_us,
            totals,
        });
        // The same listing measures every process's overhead.
        arbiter.record_process_memory(&processes, Instant::now());
        let mut found = watchdog.audit(now, &processes, &input.views(), activity.as_ref());
        let listed_from = now.checked_sub(overrun_listing).unwrap_or(now);
        found.extend(tokens.overruns_since(listed_from));
        let own = std::process::id();
        for v in &mut found {
            let is_new = !reported
                .iter()
                .any(|r| r.kind == v.kind && r.pid == v.pid && r.gpu == v.gpu);
            if is_new && v.kind == ViolationKind::Ungated {
                let used = watchdog.ungated_use(&v.gpu, v.pid);
                let ms = |f: fn(&UngatedUse) -> u64| used.as_ref().map_or(0, |u| f(u) / 1_000_000);
                tracing::warn!(kind = ?v.kind, gpu = %v.gpu, pid = v.pid, lease = ?v.lease, busy_ms = ms(|u| u.busy_ns), token_held_ms = ms(|u| u.held_ns), over_ms = ms(|u| u.span_ns), "watchdog violation: busy on the GPU without holding its time-slice token (it bypassed the interposer's gate)");
            } else if is_new
                && !matches!(v.kind, ViolationKind::Overrun | ViolationKind::ShiftedClock)
            {
                // (An overrun or a shifted clock was logged by the token service when it
                // happened.)
                tracing::warn!(kind = ?v.kind, gpu = %v.gpu, pid = v.pid, lease = ?v.lease, memory = v.memory_used, quota = ?v.memory_quota, "watchdog violation");
            }
            // An overrun may be an honest long kernel measured for the first time: its
            // lease loses window admission, the process is not killed for it.
            // A shifted clock buys nothing (its page is written in its clock): reported only.
            let killable = !matches!(v.kind, ViolationKind::Overrun | ViolationKind::ShiftedClock);
            if kill && killable && v.pid > 1 && v.pid != own {
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
        arbiter.record_violations(found);
    }
}

/// Per GPU, NVML's per-process samples after `since_us`; None when the backend
/// cannot measure them (then nothing is checked for ungated work this pass).
fn utilization(
    backend: &dyn GpuBackend,
    gpus: &[String],
    since_us: u64,
) -> Option<BTreeMap<String, Vec<ProcessUtilization>>> {
    let mut samples = BTreeMap::new();
    for gpu in gpus {
        match backend.process_utilization(gpu, since_us) {
            Ok(Some(list)) => {
                samples.insert(gpu.clone(), list);
            }
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, gpu = %gpu, "reading per-process utilisation failed");
                return None;
            }
        }
    }
    Some(samples)
}

#[cfg(test)]
mod tests;
