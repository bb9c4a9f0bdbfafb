//! The bypass check: while a high-priority job is active on a GPU, a low-priority
//! process busy there beyond its own token time is taking the high job's time right
//! now, through launches the interposer never gated (the driver's own entry points
//! called directly, or work left queued after its release). The watchdog's ungated
//! check sees that too, but over a window of seconds sized for any GPU's sampling; this
//! one looks only where it matters — GPUs with an active high-priority job — every
//! [`CHECK_INTERVAL`], on the arbiter's own measurements (NVML's per-process
//! utilisation and the token service's account of each client's holds), never on what
//! a client says.
//!
//! A process found bypassing is reported `ungated` at once, its lease penalised as for
//! an overrun, and, with `scheduler.pause_bypassing`, stopped (SIGSTOP) until no
//! high-priority job is active on its GPU, then continued: a penalty alone does not stop
//! launches that never ask for the token. Stopped processes are written to
//! `<run_dir>/paused`, so an arbiter killed meanwhile continues them when it starts
//! again; a clean stop continues them before it exits.
//!
//! Pure: [`BypassCheck`] judges, [`Pauses`] decides whom to stop and continue; the
//! loop ([`run`]) measures and signals through [`Signals`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::{LeaseId, Priority};
use serde::{Deserialize, Serialize};

use crate::inventory::GpuBackend;
use crate::process::{ProcFs, ProcessProbe};
use crate::state::ArbiterHandle;
use crate::tokens::{Holding, TokenService};
use crate::watchdog::{
    busy_from_samples, held_between, owner, token_totals, wall_clock_us, Held, LeaseView, Place,
    RESTART_GRACE,
};

/// How often GPUs with an active high-priority job are measured. NVML keeps one
/// utilisation sample per process per sampling period (1/6 s on data-centre GPUs; the
/// simulated GPU's is 100 ms) and a query returns those ended since the last one: asked
/// more often than it samples, most queries would see nothing new.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Busy and token time are compared over the last second of intervals.
pub const WINDOW: Duration = Duration::from_secs(1);
/// How much busy time beyond its token time a process may show over the window. A
/// gated process's kernels run inside its holds (a drain after a revocation counts as
/// held, a drain past the grace is an overrun, judged by the token service), so what
/// remains is the measurement's edges: a sampling period's busy time is counted in the
/// first interval whose query sees the period ended, up to one interval after the hold
/// it belongs to — which [`BypassCheck::judge`] allows for by counting the token time of
/// the interval before the window too — and NVML's rounding to whole percents. 200 ms
/// is two intervals' worth; a 200 ms kernel launched past the gate beside a high job
/// passes it within a second.
pub const TOLERANCE: Duration = Duration::from_millis(200);

/// A process found busy past the gate beside an active high-priority job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bypass {
    pub gpu: String,
    pub pid: u32,
    pub lease: LeaseId,
    /// Its busy time beyond its token time over the window (ns).
    pub excess_ns: u64,
    /// The measurements it was found on, oldest first: for the log, so that a finding
    /// can be checked by whoever reads it.
    pub intervals: Vec<Measured>,
}

/// One interval's measurements of one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// How long before the finding the interval ended (ms).
    pub ended_ms_before: u64,
    /// Its busy time as NVML reported it (ms), and its token time (ms).
    pub busy_ms: u64,
    pub held_ms: u64,
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "-{}ms busy {} held {}",
            self.ended_ms_before, self.busy_ms, self.held_ms
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct Interval {
    at: Instant,
    busy_ns: u64,
    held_ns: u64,
}

/// The intervals of the last [`WINDOW`] per process on a GPU with an active high job.
pub struct BypassCheck {
    started: Instant,
    /// The leases the arbiter recovered when it started.
    recovered: BTreeSet<LeaseId>,
    recent: BTreeMap<Place, VecDeque<Interval>>,
}

impl BypassCheck {
    /// `started`: when the arbiter started; `recovered`: the leases it recovered then.
    /// For [`RESTART_GRACE`] after the start their processes are re-attaching and
    /// reopening their token connections: none of them is judged. A lease made since
    /// has no process from before.
    pub fn new(started: Instant, recovered: BTreeSet<LeaseId>) -> BypassCheck {
        BypassCheck {
            started,
            recovered,
            recent: BTreeMap::new(),
        }
    }

    /// One interval. `contested`: the GPUs where a high-priority job was active through
    /// it; `busy`: NVML's busy time per process over it; `held`: each token client's
    /// token time over it (overruns included: they are judged as overruns).
    ///
    /// Judged: a registered process of a single-GPU low-priority lease (multi-GPU leases
    /// run ungated by design; a high-priority job submits without waiting for a grant,
    /// and is never stopped for another's sake), with a low-priority token connection or
    /// none. `high_leases`: the high-priority leases. Found: busy beyond its token time by more
    /// than [`TOLERANCE`] over the window. A process found starts a new window, so it is
    /// found again only if it goes on.
    pub fn judge(
        &mut self,
        now: Instant,
        contested: &BTreeSet<String>,
        busy: &BTreeMap<Place, u64>,
        held: &BTreeMap<Place, Held>,
        leases: &[LeaseView],
        high_leases: &BTreeSet<LeaseId>,
    ) -> Vec<Bypass> {
        let in_window = |i: &Interval| now.saturating_duration_since(i.at) < WINDOW;
        self.recent.retain(|(gpu, _), intervals| {
            // The window, and the one interval before it (see below).
            while intervals.len() > 1 && !in_window(&intervals[1]) {
                intervals.pop_front();
            }
            contested.contains(gpu) && intervals.iter().any(in_window)
        });
        let re_attaching = |lease: &LeaseId| {
            now.saturating_duration_since(self.started) < RESTART_GRACE
                && self.recovered.contains(lease)
        };
        let places: BTreeSet<&Place> = busy
            .keys()
            .chain(held.keys())
            .filter(|(gpu, _)| contested.contains(gpu))
            .filter(|(gpu, pid)| !owner(leases, gpu, *pid).is_some_and(|l| re_attaching(l.id)))
            .collect();
        for place in places {
            self.recent
                .entry(place.clone())
                .or_default()
                .push_back(Interval {
                    at: now,
                    busy_ns: busy.get(place).copied().unwrap_or(0),
                    held_ns: held.get(place).map_or(0, |h| h.held_ns),
                });
        }
        let mut found = Vec::new();
        for ((gpu, pid), intervals) in &mut self.recent {
            let Some(lease) = owner(leases, gpu, *pid) else {
                continue; // unregistered: the watchdog reports it as such
            };
            let priority = held.get(&(gpu.clone(), *pid)).map(|h| h.priority);
            if lease.gpus.len() != 1
                || priority == Some(Priority::High)
                || high_leases.contains(lease.id)
            {
                continue;
            }
            // A sampling period's busy time is seen up to one interval after the token
            // time it belongs to, however long the intervals (a tick delayed on a loaded
            // node): the busy time of the window is set against the token time of the
            // window and of the interval before it.
            let busy_ns = intervals
                .iter()
                .filter(|i| in_window(i))
                .map(|i| i.busy_ns)
                .fold(0, u64::saturating_add);
            let held_ns = intervals
                .iter()
                .map(|i| i.held_ns)
                .fold(0, u64::saturating_add);
            let excess_ns = busy_ns.saturating_sub(held_ns);
            if excess_ns > TOLERANCE.as_nanos() as u64 {
                found.push(Bypass {
                    gpu: gpu.clone(),
                    pid: *pid,
                    lease: lease.id.clone(),
                    excess_ns,
                    intervals: intervals
                        .iter()
                        .map(|i| Measured {
                            ended_ms_before: now.saturating_duration_since(i.at).as_millis() as u64,
                            busy_ms: i.busy_ns / 1_000_000,
                            held_ms: i.held_ns / 1_000_000,
                        })
                        .collect(),
                });
                intervals.clear();
            }
        }
        found
    }
}

/// Token time per process for the bypass check: a hold's overrun part counts as held
/// here (the token service reported it as an overrun already).
pub fn token_time(holdings: &[Holding]) -> BTreeMap<Place, Held> {
    let counted: Vec<Holding> = holdings
        .iter()
        .map(|h| Holding {
            held_ns: h.held_ns.saturating_add(h.overran_ns),
            ..h.clone()
        })
        .collect();
    token_totals(&counted)
}

// ----- stopping and continuing -----

/// A process the check stopped: which GPU it bypassed on, and its start time (so a
/// reused pid is never continued or stopped by mistake).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paused {
    pub pid: u32,
    pub start_time: u64,
    pub gpu: String,
}

/// Sends the signals, and tells a process's start time.
pub trait Signals: Send {
    /// The process's start time; None when it is gone.
    fn start_time(&self, pid: u32) -> Option<u64>;
    fn stop(&self, pid: u32) -> std::io::Result<()>;
    fn resume(&self, pid: u32) -> std::io::Result<()>;
}

/// The host's processes.
pub struct HostSignals;

impl Signals for HostSignals {
    fn start_time(&self, pid: u32) -> Option<u64> {
        ProcFs.start_time(pid)
    }

    fn stop(&self, pid: u32) -> std::io::Result<()> {
        signal(pid, nix::sys::signal::Signal::SIGSTOP)
    }

    fn resume(&self, pid: u32) -> std::io::Result<()> {
        signal(pid, nix::sys::signal::Signal::SIGCONT)
    }
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) -> std::io::Result<()> {
    let pid = i32::try_from(pid)
        .ok()
        .filter(|&p| p > 1)
        .ok_or_else(|| std::io::Error::other(format!("pid {pid} is never signalled")))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).map_err(std::io::Error::from)
}

/// The processes stopped now, kept in a file so that a later arbiter continues them.
pub struct Pauses<S: Signals> {
    signals: S,
    file: PathBuf,
    paused: Vec<Paused>,
}

impl<S: Signals> Pauses<S> {
    /// Continues what the file lists (an arbiter killed while it had processes
    /// stopped), then starts empty.
    pub fn recover(signals: S, file: PathBuf) -> Pauses<S> {
        let left: Vec<Paused> = std::fs::read(&file)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        let mut pauses = Pauses {
            signals,
            file,
            paused: left,
        };
        if !pauses.paused.is_empty() {
            tracing::warn!(
                processes = pauses.paused.len(),
                "continuing processes a previous arbiter stopped for bypassing the gate"
            );
        }
        pauses.resume_where(|_| true);
        pauses
    }

    pub fn paused(&self) -> &[Paused] {
        &self.paused
    }

    /// Stops `pid` (found bypassing on `gpu`), unless it is stopped already or gone.
    pub fn pause(&mut self, pid: u32, gpu: &str) {
        if self.paused.iter().any(|p| p.pid == pid) {
            return;
        }
        let Some(start_time) = self.signals.start_time(pid) else {
            return;
        };
        // Listed before it is stopped: a kill between the two leaves a continue that
        // finds a running process, never a stopped one nobody will continue.
        self.paused.push(Paused {
            pid,
            start_time,
            gpu: gpu.to_owned(),
        });
        self.save();
        match self.signals.stop(pid) {
            Ok(()) => {
                tracing::warn!(pid, gpu, "stopped a process that bypassed the gate beside an active high-priority job, until no high-priority job is active on its GPU (scheduler.pause_bypassing)");
            }
            Err(e) => {
                tracing::warn!(pid, error = %e, "could not stop a process that bypassed the gate");
                self.paused.retain(|p| p.pid != pid);
                self.save();
            }
        }
    }

    /// Continues every stopped process whose GPU has no active high-priority job.
    pub fn resume_where_not(&mut self, contested: &BTreeSet<String>) {
        self.resume_where(|p| !contested.contains(&p.gpu));
    }

    /// Continues every stopped process.
    pub fn resume_all(&mut self) {
        self.resume_where(|_| true);
    }

    fn resume_where(&mut self, due: impl Fn(&Paused) -> bool) {
        let before = self.paused.len();
        let signals = &self.signals;
        self.paused.retain(|p| {
            if !due(p) {
                // Gone (killed, exited): nothing to continue.
                return signals.start_time(p.pid) == Some(p.start_time);
            }
            if signals.start_time(p.pid) == Some(p.start_time) {
                match signals.resume(p.pid) {
                    Ok(()) => tracing::info!(pid = p.pid, gpu = %p.gpu, "continued a process stopped for bypassing the gate"),
                    Err(e) => tracing::warn!(pid = p.pid, error = %e, "could not continue a stopped process"),
                }
            }
            false
        });
        if self.paused.len() != before {
            self.save();
        }
    }

    fn save(&self) {
        let result = if self.paused.is_empty() {
            match std::fs::remove_file(&self.file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        } else {
            crate::files::write_atomically(
                &self.file,
                &serde_json::to_vec(&self.paused).unwrap_or_default(),
            )
        };
        if let Err(e) = result {
            tracing::warn!(file = %self.file.display(), error = %e, "could not record the processes stopped for bypassing the gate");
        }
    }
}

impl<S: Signals> Drop for Pauses<S> {
    /// A clean stop (or the task's end) leaves no process stopped.
    fn drop(&mut self) {
        self.resume_all();
    }
}

/// Where the stopped processes are listed.
pub fn paused_file(run_dir: &Path) -> PathBuf {
    run_dir.join("paused")
}

// ----- the loop -----

/// What the previous interval measured.
struct Previous {
    at: Instant,
    wall_us: u64,
    contested: BTreeSet<String>,
    totals: BTreeMap<Place, Held>,
}

/// Every [`CHECK_INTERVAL`] while a high-priority job is active on some GPU: measure,
/// judge, report, and (with `pause`) stop the processes found; continue them once no
/// high-priority job is active on their GPU.
pub async fn run(
    arbiter: ArbiterHandle,
    backend: Arc<dyn GpuBackend>,
    tokens: Arc<TokenService>,
    pause: bool,
    run_dir: PathBuf,
) {
    let mut pauses = Pauses::recover(HostSignals, paused_file(&run_dir));
    let recovered = arbiter
        .watchdog_input()
        .leases
        .into_iter()
        .map(|(id, ..)| id)
        .collect();
    let mut check = BypassCheck::new(Instant::now(), recovered);
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut previous: Option<Previous> = None;
    loop {
        tick.tick().await;
        let contested = tokens.high_active_gpus();
        pauses.resume_where_not(&contested);
        if contested.is_empty() {
            previous = None;
            continue;
        }
        let since = previous.as_ref().map(|p| p.wall_us);
        let measured: Vec<String> = match &previous {
            Some(p) => contested.intersection(&p.contested).cloned().collect(),
            None => Vec::new(),
        };
        let sampler = backend.clone();
        let samples = tokio::task::spawn_blocking(move || {
            let wall_us = wall_clock_us();
            let mut samples = BTreeMap::new();
            if let Some(since) = since {
                for gpu in measured {
                    match sampler.process_utilization(&gpu, since) {
                        Ok(Some(list)) => {
                            samples.insert(gpu, list);
                        }
                        Ok(None) => return None,
                        Err(e) => {
                            tracing::debug!(error = %e, gpu = %gpu, "reading per-process utilisation failed");
                        }
                    }
                }
            }
            Some((samples, wall_us))
        })
        .await
        .ok()
        .flatten();
        let Some((samples, wall_us)) = samples else {
            // The backend cannot measure per-process utilisation: nothing to judge.
            return;
        };
        let now = Instant::now();
        let totals = token_time(&tokens.holdings());
        if let Some(before) = previous.take() {
            let span = now.saturating_duration_since(before.at);
            let busy = busy_from_samples(&samples, span);
            let held = held_between(&before.totals, &totals);
            let both: BTreeSet<String> =
                contested.intersection(&before.contested).cloned().collect();
            let input = arbiter.watchdog_input();
            let high_leases: BTreeSet<LeaseId> = arbiter
                .list()
                .into_iter()
                .filter(|l| l.priority == Priority::High)
                .map(|l| l.id)
                .collect();
            for found in check.judge(now, &both, &busy, &held, &input.views(), &high_leases) {
                let measured: Vec<String> = found.intervals.iter().map(|m| m.to_string()).collect();
                tracing::warn!(gpu = %found.gpu, pid = found.pid, lease = %found.lease, excess_ms = found.excess_ns / 1_000_000, intervals = %measured.join(", "), "process busy on the GPU beyond its token time beside an active high-priority job: it launched past its time-slice gate; reported ungated, its lease penalised");
                tokens.report_bypass(&found.gpu, &found.lease, found.pid);
                if pause {
                    pauses.pause(found.pid, &found.gpu);
                }
            }
        }
        previous = Some(Previous {
            at: now,
            wall_us,
            contested,
            totals,
        });
    }
}

#[cfg(test)]
mod tests;
