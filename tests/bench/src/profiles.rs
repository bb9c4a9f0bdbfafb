//! Five training-like job profiles for experiment E1, standing in for VGG11, VGG16, VGG19,
//! MobileNet and SqueezeNet as in Wang et al. (Fig 4/5).
//!
//! **These are stand-ins, not measurements of those networks.** Each is a `simgpu-workload`
//! shape (kernels per iteration, kernel duration distribution, CPU gap between iterations)
//! chosen from the networks' relative structure only: the VGGs are few wide layers, so few
//! long kernels, more of them as the network deepens (GPU time per iteration VGG11 < VGG16 <
//! VGG19); MobileNet and SqueezeNet are many narrow layers (depthwise/pointwise convolutions,
//! fire modules), so many short kernels. The CPU gap stands for data loading and host-side
//! work between steps; with it each profile keeps the (simulated) GPU between ~40 % and ~80 %
//! busy when it runs alone, the figure each profile's doc gives (from the mean kernel time,
//! `median * exp(sigma^2 / 2)` for a lognormal, over mean kernel time plus gap; launch costs
//! are left out, so the measured busy fraction is a little lower).

/// One training-like job shape.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Profile {
    pub name: &'static str,
    pub kernels_per_iteration: u32,
    /// A `simgpu-workload --kernel` distribution.
    pub kernel: &'static str,
    pub gap_us: u64,
    /// The busy fraction alone the profile is tuned to (GPU time over iteration time).
    pub busy_alone: f64,
}

/// VGG11: 8 convolution and 3 dense layers; forward and backward make ~20 long kernels.
/// 20 × ~420 µs (lognormal median 400 µs, sigma 0.3) = 8.4 ms of GPU time, 5 ms gap: ~63 % busy.
pub const VGG11: Profile = Profile {
    name: "vgg11",
    kernels_per_iteration: 20,
    kernel: "lognormal:400us:0.3",
    gap_us: 5_000,
    busy_alone: 0.63,
};

/// VGG16: 13 convolution layers, deeper than VGG11 at the same widths: more and slightly
/// longer kernels. 26 × ~470 µs (median 450 µs) = 12.2 ms, 5 ms gap: ~71 % busy.
pub const VGG16: Profile = Profile {
    name: "vgg16",
    kernels_per_iteration: 26,
    kernel: "lognormal:450us:0.3",
    gap_us: 5_000,
    busy_alone: 0.71,
};

/// VGG19: 16 convolution layers, the deepest VGG: the most GPU time per iteration.
/// 32 × ~520 µs (median 500 µs) = 16.7 ms, 5 ms gap: ~77 % busy.
pub const VGG19: Profile = Profile {
    name: "vgg19",
    kernels_per_iteration: 32,
    kernel: "lognormal:500us:0.3",
    gap_us: 5_000,
    busy_alone: 0.77,
};

/// MobileNet: ~28 thin depthwise-separable layers, each several small kernels: many short,
/// varied kernels. 120 × ~45 µs (median 40 µs, sigma 0.5) = 5.4 ms, 6 ms gap: ~47 % busy.
pub const MOBILENET: Profile = Profile {
    name: "mobilenet",
    kernels_per_iteration: 120,
    kernel: "lognormal:40us:0.5",
    gap_us: 6_000,
    busy_alone: 0.47,
};

/// SqueezeNet: 8 fire modules (squeeze and two expand convolutions each): many short kernels,
/// fewer than MobileNet. 80 × ~63 µs (median 60 µs, sigma 0.4) = 5.0 ms, 4 ms gap: ~56 % busy.
pub const SQUEEZENET: Profile = Profile {
    name: "squeezenet",
    kernels_per_iteration: 80,
    kernel: "lognormal:60us:0.4",
    gap_us: 4_000,
    busy_alone: 0.56,
};

/// `--sync event --seed S --duration Dms`: how every E1 and E3 job waits for its work, draws
/// its kernels and how long it runs.
pub fn synced_run(seed: u64, duration_ms: u64) -> Vec<String> {
    vec![
        "--sync".into(),
        "event".into(),
        "--seed".into(),
        seed.to_string(),
        "--duration".into(),
        format!("{duration_ms}ms"),
    ]
}

pub const ALL: [Profile; 5] = [VGG11, VGG16, VGG19, MOBILENET, SQUEEZENET];

impl Profile {
    /// `simgpu-workload` arguments for this profile with `seed`, running `duration_ms`.
    pub fn args(&self, seed: u64, duration_ms: u64) -> Vec<String> {
        [
            "--kernels",
            &self.kernels_per_iteration.to_string(),
            "--kernel",
            self.kernel,
            "--gap",
            &format!("{}us", self.gap_us),
        ]
        .map(String::from)
        .into_iter()
        .chain(synced_run(seed, duration_ms))
        .collect()
    }

    /// Mean GPU time per iteration (µs) the distribution gives, launch costs left out.
    pub fn gpu_us_per_iteration(&self) -> f64 {
        let parts: Vec<&str> = self.kernel.split(':').collect();
        let us = |t: &str| t.trim_end_matches("us").parse::<f64>().unwrap_or(0.0);
        let mean = match parts.as_slice() {
            ["lognormal", median, sigma] => {
                us(median) * (sigma.parse::<f64>().unwrap_or(0.0).powi(2) / 2.0).exp()
            }
            ["fixed", d] => us(d),
            _ => 0.0,
        };
        mean * f64::from(self.kernels_per_iteration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_keep_their_documented_shape() {
        // VGG GPU time grows with depth.
        assert!(VGG11.gpu_us_per_iteration() < VGG16.gpu_us_per_iteration());
        assert!(VGG16.gpu_us_per_iteration() < VGG19.gpu_us_per_iteration());
        for p in ALL {
            let gpu = p.gpu_us_per_iteration();
            let busy = gpu / (gpu + p.gap_us as f64);
            assert!(
                (busy - p.busy_alone).abs() < 0.015,
                "{}: busy {busy:.3} vs documented {}",
                p.name,
                p.busy_alone
            );
            assert!((0.4..=0.8).contains(&busy), "{}: {busy}", p.name);
        }
        // Mobile networks: many short kernels, more than any VGG.
        for small in [MOBILENET, SQUEEZENET] {
            for vgg in [VGG11, VGG16, VGG19] {
                assert!(small.kernels_per_iteration > vgg.kernels_per_iteration);
            }
        }
        let args = VGG16.args(3, 1000).join(" ");
        assert!(
            args.contains("--kernels 26")
                && args.contains("--seed 3")
                && args.contains("--duration 1000ms"),
            "{args}"
        );
    }
}
