//! Time-weighted means of the cluster's gauges (memory granted, GPUs busy, ...), over the
//! whole run and over the steady window, and a sample of them at fixed intervals.

use serde::Serialize;

/// The gauges every mode reports after each event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Gauges {
    /// GiB on GPUs: granted to running pods (their requests).
    pub granted_gib: f64,
    /// GPUs with at least one running pod.
    pub busy_gpus: f64,
    /// GiB kube-scheduler counts as taken on a node whose pods wait there for a GPU.
    pub stranded_gib: f64,
    /// Pods kube-scheduler could not bind to any node.
    pub cluster_pending: f64,
    /// Pods bound to a node, waiting there for a GPU.
    pub node_waiting: f64,
}

impl Gauges {
    fn add_scaled(&mut self, other: &Gauges, by: f64) {
        self.granted_gib += other.granted_gib * by;
        self.busy_gpus += other.busy_gpus * by;
        self.stranded_gib += other.stranded_gib * by;
        self.cluster_pending += other.cluster_pending * by;
        self.node_waiting += other.node_waiting * by;
    }

    fn scaled(&self, by: f64) -> Gauges {
        let mut out = Gauges::default();
        out.add_scaled(self, by);
        out
    }
}

/// The gauges at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    pub t_h: f64,
    #[serde(flatten)]
    pub gauges: Gauges,
}

pub struct Meter {
    last_ms: u64,
    current: Gauges,
    area_run: Gauges,
    area_steady: Gauges,
    steady_ms: (u64, u64),
    sample_every_ms: u64,
    sample_until_ms: u64,
    next_sample_ms: u64,
    samples: Vec<Sample>,
}

impl Meter {
    /// `steady_ms`: the window the steady means cover (after the warm-up, until arrivals stop);
    /// a sample every `sample_every_ms` until `sample_until_ms`.
    pub fn new(steady_ms: (u64, u64), sample_every_ms: u64, sample_until_ms: u64) -> Self {
        Self {
            last_ms: 0,
            current: Gauges::default(),
            area_run: Gauges::default(),
            area_steady: Gauges::default(),
            steady_ms,
            sample_every_ms: sample_every_ms.max(1),
            sample_until_ms,
            next_sample_ms: 0,
            samples: Vec::new(),
        }
    }

    /// Time has reached `now_ms` with the gauges unchanged since the last call.
    pub fn advance(&mut self, now_ms: u64) {
        let now_ms = now_ms.max(self.last_ms);
        while self.next_sample_ms <= now_ms.min(self.sample_until_ms) {
            self.samples.push(Sample {
                t_h: self.next_sample_ms as f64 / 3.6e6,
                gauges: self.current,
            });
            self.next_sample_ms += self.sample_every_ms;
        }
        let current = self.current;
        self.area_run
            .add_scaled(&current, (now_ms - self.last_ms) as f64);
        let (from, to) = self.steady_ms;
        let overlap = now_ms.min(to).saturating_sub(self.last_ms.max(from));
        self.area_steady.add_scaled(&current, overlap as f64);
        self.last_ms = now_ms;
    }

    /// The gauges from now on (after the event at the last `advance`).
    pub fn set(&mut self, gauges: Gauges) {
        self.current = gauges;
    }

    /// Means over [0, the last advance].
    pub fn run_mean(&self) -> Gauges {
        self.area_run.scaled(1.0 / self.last_ms.max(1) as f64)
    }

    /// Means over the steady window (the part of it the run reached).
    pub fn steady_mean(&self) -> Gauges {
        let (from, to) = self.steady_ms;
        let covered = self.last_ms.min(to).saturating_sub(from).max(1);
        self.area_steady.scaled(1.0 / covered as f64)
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(gib: f64) -> Gauges {
        Gauges {
            granted_gib: gib,
            ..Gauges::default()
        }
    }

    #[test]
    fn means_weigh_each_value_by_how_long_it_held() {
        let mut m = Meter::new((100, 300), 100, 400);
        m.advance(0);
        m.set(granted(10.0)); // 10 over [0, 200)
        m.advance(200);
        m.set(granted(40.0)); // 40 over [200, 400)
        m.advance(400);
        assert_eq!(m.run_mean().granted_gib, 25.0);
        // Steady window [100, 300): half at 10, half at 40.
        assert_eq!(m.steady_mean().granted_gib, 25.0);
        let at: Vec<_> = m.samples().iter().map(|s| s.gauges.granted_gib).collect();
        // Samples at 0, 100, 200, 300, 400 hold the value in force just before each instant.
        assert_eq!(at, [0.0, 10.0, 10.0, 40.0, 40.0]);
    }

    #[test]
    fn the_steady_window_ignores_the_warm_up() {
        let mut m = Meter::new((100, 200), 1_000, 0);
        m.set(granted(100.0));
        m.advance(100);
        m.set(granted(0.0));
        m.advance(200);
        assert_eq!(m.steady_mean().granted_gib, 0.0);
        assert_eq!(m.run_mean().granted_gib, 50.0);
        assert_eq!(m.samples().len(), 1, "sampled only until 0");
    }
}
