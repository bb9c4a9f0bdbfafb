//! What the arbiter last measured: each GPU's utilisation over three windows and
//! its memory in use (NVML's samples), each lease's held token time (the token
//! service's readings) and when each lease's processes were last measured. Status
//! shows it, the balanced policy places by it; nothing here decides anything.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use gpushare_proto::LeaseId;

use crate::inventory::{GpuSample, UtilizationWindow};
use crate::tokens::Holding;

/// Status shows utilisation over this span beside the minute's, which lags.
const SHORT_WINDOW: Duration = Duration::from_secs(10);

/// The GPUs' and leases' latest readings, GPUs by inventory index.
#[derive(Debug)]
pub(super) struct Telemetry {
    /// Utilisation over the last minute: Algorithm 1's view, and status's.
    last_minute: Vec<UtilizationWindow>,
    /// Utilisation over `SHORT_WINDOW`, for status.
    short: Vec<UtilizationWindow>,
    /// Utilisation over `placement.utilization_window_ms`: the balanced policy's view.
    recent: Vec<UtilizationWindow>,
    /// Memory NVML last saw in use on each GPU (None before the first sample).
    memory_used: Vec<Option<u64>>,
    /// When a GPU sample was last recorded (for `/healthz`).
    last_sample: Option<Instant>,
    /// Each lease's held token time, read with each sample.
    held: HashMap<LeaseId, HeldReadings>,
    /// When each lease's processes were last measured (their memory overhead).
    measured_at: HashMap<LeaseId, Instant>,
}

/// Readings of one lease's cumulative held token time, within the window.
#[derive(Debug, Default)]
struct HeldReadings(VecDeque<(Instant, u64)>);

/// A lease's held token time at the first and the last reading kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct HeldSpan {
    /// Time between the two readings.
    pub watched: Duration,
    /// Cumulative nanoseconds held at the first reading.
    pub first_ns: u64,
    /// Cumulative nanoseconds held at the last reading.
    pub last_ns: u64,
}

impl Telemetry {
    /// Nothing measured yet on `gpus` GPUs; `recent_window` is the balanced policy's.
    pub fn new(gpus: usize, recent_window: Duration) -> Self {
        Telemetry {
            last_minute: vec![UtilizationWindow::new(UtilizationWindow::LAST_MINUTE); gpus],
            short: vec![UtilizationWindow::new(SHORT_WINDOW); gpus],
            recent: vec![UtilizationWindow::new(recent_window); gpus],
            memory_used: vec![None; gpus],
            last_sample: None,
            held: HashMap::new(),
            measured_at: HashMap::new(),
        }
    }

    /// Starts the balanced policy's window afresh with a new span.
    pub fn set_recent_window(&mut self, window: Duration) {
        self.recent = vec![UtilizationWindow::new(window); self.last_minute.len()];
    }

    /// Records NVML's sample of the GPU at inventory index `gpu` in every window.
    pub fn record_sample(&mut self, gpu: usize, now: Instant, sample: &GpuSample) {
        self.last_minute[gpu].record(now, sample.utilization);
        self.recent[gpu].record(now, sample.utilization);
        self.short[gpu].record(now, sample.utilization);
        self.memory_used[gpu] = Some(sample.memory_used);
        self.last_sample = Some(now);
    }

    /// The GPU's mean utilisation over the last minute (None without a sample).
    pub fn utilization_last_minute(&self, gpu: usize, now: Instant) -> Option<f64> {
        self.last_minute[gpu].mean(now)
    }

    /// The GPU's mean utilisation over the last 10 s (None without a sample).
    pub fn utilization_last_10s(&self, gpu: usize, now: Instant) -> Option<f64> {
        self.short[gpu].mean(now)
    }

    /// The GPU's mean utilisation over the balanced policy's window.
    pub fn recent_utilization(&self, gpu: usize, now: Instant) -> Option<f64> {
        self.recent[gpu].mean(now)
    }

    /// Memory in use on the GPU at its last sample.
    pub fn memory_used(&self, gpu: usize) -> Option<u64> {
        self.memory_used[gpu]
    }

    /// How long ago the last GPU sample was recorded (None before the first).
    pub fn last_sample_age(&self, now: Instant) -> Option<Duration> {
        self.last_sample.map(|at| now.saturating_duration_since(at))
    }

    /// Takes one reading of each lease's held time, summed over its clients, keeping
    /// the readings of the last `window`; leases with no token client any more are
    /// forgotten.
    pub fn record_holdings(&mut self, now: Instant, holdings: Vec<Holding>, window: Duration) {
        let mut held: HashMap<LeaseId, u64> = HashMap::new();
        for h in holdings {
            *held.entry(h.lease).or_default() += h.held_ns;
        }
        self.held.retain(|id, _| held.contains_key(id));
        for (id, ns) in held {
            let readings = &mut self.held.entry(id).or_default().0;
            readings.push_back((now, ns));
            // Keep one reading at or beyond the window's start, so the share spans it.
            while readings.len() > 2 && now.duration_since(readings[1].0) >= window {
                readings.pop_front();
            }
        }
    }

    /// The lease's held time over the readings kept (None before its first).
    pub fn held_span(&self, lease: &LeaseId) -> Option<HeldSpan> {
        let readings = &self.held.get(lease)?.0;
        let (first, last) = (readings.front()?, readings.back()?);
        Some(HeldSpan {
            watched: last.0.duration_since(first.0),
            first_ns: first.1,
            last_ns: last.1,
        })
    }

    /// The lease's processes were measured at `now`.
    pub fn mark_measured(&mut self, lease: &LeaseId, now: Instant) {
        self.measured_at.insert(lease.clone(), now);
    }

    /// Whether `lease` was measured less than `fresh` before `now`.
    pub fn measured_within(&self, lease: &LeaseId, now: Instant, fresh: Duration) -> bool {
        self.measured_at
            .get(lease)
            .is_some_and(|at| now.saturating_duration_since(*at) < fresh)
    }

    /// The lease's last measurement no longer stands (its last client left).
    pub fn forget_measurement(&mut self, lease: &LeaseId) {
        self.measured_at.remove(lease);
    }

    /// Drops everything read about a lease that is gone.
    pub fn forget(&mut self, lease: &LeaseId) {
        self.measured_at.remove(lease);
        self.held.remove(lease);
    }
}

#[cfg(test)]
mod tests;
