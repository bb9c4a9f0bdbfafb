//! The pods that arrive: Poisson arrivals of a fixed mix of GPU-memory requests, a share of
//! them high priority, lognormal run times. One trace per load level, the same for every mode.

use serde::Serialize;

use super::rng::SplitMix64;

/// What the pods ask for and how long they run once on a GPU.
#[derive(Debug, Clone, Serialize)]
pub struct PodMix {
    /// GPU memory requests (GiB, one `gpushare.io/memory` unit each) and their weights.
    pub memory_gib: Vec<u32>,
    pub weights: Vec<f64>,
    /// The share of pods that also ask for `gpushare.io/high`.
    pub high_fraction: f64,
    /// Run time on the GPU: lognormal with this median and σ of its logarithm.
    pub duration_median_s: f64,
    pub duration_sigma: f64,
}

impl PodMix {
    /// Mostly small inference and notebook pods, some fine-tuning jobs, a few large trainers:
    /// 2/4/8/16/24/40 GiB at 20/25/25/15/10/5 % (mean 10.2 GiB); one in ten is a latency
    /// service that asks for a high slot (at 90 % of the memory, 56,000 pods run at once,
    /// 5,600 of them high, on 8,000 high slots: with a quarter high, the slots, one per GPU,
    /// would run out before the memory does); a median run of 30 minutes with σ = 1 (mean 49.5
    /// min, the longest of a million about 2 days).
    pub fn typical() -> Self {
        Self {
            memory_gib: vec![2, 4, 8, 16, 24, 40],
            weights: vec![0.20, 0.25, 0.25, 0.15, 0.10, 0.05],
            high_fraction: 0.10,
            duration_median_s: 1800.0,
            duration_sigma: 1.0,
        }
    }

    pub fn mean_memory_gib(&self) -> f64 {
        let total: f64 = self.weights.iter().sum();
        self.memory_gib
            .iter()
            .zip(&self.weights)
            .map(|(&m, &w)| f64::from(m) * w / total)
            .sum()
    }

    pub fn mean_duration_s(&self) -> f64 {
        self.duration_median_s * (self.duration_sigma.powi(2) / 2.0).exp()
    }

    /// Pods per second that keep `load` of `total_memory_gib` asked for on average (Little's
    /// law: rate × mean run time × mean request = load × total).
    pub fn arrival_rate_per_s(&self, load: f64, total_memory_gib: f64) -> f64 {
        load * total_memory_gib / (self.mean_memory_gib() * self.mean_duration_s())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pod {
    pub arrival_ms: u64,
    pub memory_gib: u32,
    pub high: bool,
    /// How long it runs once placed on a GPU (waiting does not count).
    pub duration_ms: u64,
}

/// Pods arriving at `rate_per_s` (Poisson) from time 0 until `horizon_s`, in arrival order.
pub fn generate(mix: &PodMix, rate_per_s: f64, horizon_s: f64, rng: &mut SplitMix64) -> Vec<Pod> {
    let mut pods = Vec::new();
    let mut t_s = rng.exponential(1.0 / rate_per_s);
    while t_s < horizon_s {
        let memory_gib = mix.memory_gib[rng.weighted(&mix.weights)];
        let high = rng.unit() < mix.high_fraction;
        let duration_s = rng.lognormal(mix.duration_median_s, mix.duration_sigma);
        pods.push(Pod {
            arrival_ms: (t_s * 1e3) as u64,
            memory_gib,
            high,
            duration_ms: ((duration_s * 1e3) as u64).max(1),
        });
        t_s += rng.exponential(1.0 / rate_per_s);
    }
    pods
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trace_offers_the_asked_load() {
        let mix = PodMix::typical();
        assert!((mix.mean_memory_gib() - 10.2).abs() < 1e-9);
        let total_gib = 64.0 * 80.0;
        let rate = mix.arrival_rate_per_s(0.7, total_gib);
        let horizon_s = 2_000.0 * mix.mean_duration_s();
        let pods = generate(&mix, rate, horizon_s, &mut SplitMix64::new(3));
        // Offered GiB·s over the horizon, against what 70 % of the memory holds.
        let offered: f64 = pods
            .iter()
            .map(|p| f64::from(p.memory_gib) * p.duration_ms as f64 / 1e3)
            .sum();
        let load = offered / (total_gib * horizon_s);
        assert!((load - 0.7).abs() < 0.02, "offered load {load}");
        let high = pods.iter().filter(|p| p.high).count() as f64 / pods.len() as f64;
        assert!((high - 0.10).abs() < 0.01, "{high}");
        assert!(pods.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
    }
}
