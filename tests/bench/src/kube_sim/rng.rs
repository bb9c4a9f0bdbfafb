//! The simulation's random numbers: SplitMix64 (Steele, Lea and Flood 2014), seeded, so a
//! seed names one trace and one run of every mode exactly.

/// SplitMix64: 64 bits of state, passes BigCrush, and needs no dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A generator of its own whose numbers do not overlap this one's in practice: the
    /// trace and each mode's tie-breaks draw from separate streams, so a mode that draws more
    /// tie-breaks does not change the pods another mode sees.
    pub fn split(&mut self) -> Self {
        Self::new(self.next_u64())
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (Lemire's multiply-shift; the bias is below 2^-40 for any n here).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    pub fn exponential(&mut self, mean: f64) -> f64 {
        // 1 - unit() lies in (0, 1]: the logarithm is finite.
        -mean * (1.0 - self.unit()).ln()
    }

    /// Standard normal (Box–Muller, one of the pair).
    pub fn standard_normal(&mut self) -> f64 {
        let radius = (-2.0 * (1.0 - self.unit()).ln()).sqrt();
        radius * (std::f64::consts::TAU * self.unit()).cos()
    }

    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.standard_normal()).exp()
    }

    /// An index into `weights`, each drawn with its share of their sum.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // The reference implementation's first outputs for seed 0 and 1234567.
        let mut zero = SplitMix64::new(0);
        assert_eq!(zero.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(zero.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut other = SplitMix64::new(1_234_567);
        assert_eq!(other.next_u64(), 6_457_827_717_110_365_317);
    }

    #[test]
    fn the_same_seed_gives_the_same_numbers_and_another_seed_others() {
        let draw = |seed| {
            let mut r = SplitMix64::new(seed);
            (0..5).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn samples_have_the_asked_moments() {
        let mut r = SplitMix64::new(42);
        let n = 200_000;
        let exp_mean = (0..n).map(|_| r.exponential(3.0)).sum::<f64>() / n as f64;
        assert!((exp_mean - 3.0).abs() < 0.05, "{exp_mean}");
        let mut logs: Vec<f64> = (0..n).map(|_| r.lognormal(10.0, 1.0)).collect();
        logs.sort_by(f64::total_cmp);
        let median = logs[n / 2];
        assert!((median - 10.0).abs() < 0.2, "{median}");
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[r.weighted(&[0.5, 0.3, 0.2])] += 1;
        }
        let share = counts[1] as f64 / n as f64;
        assert!((share - 0.3).abs() < 0.01, "{counts:?}");
        assert!((0..1000).all(|_| r.below(7) < 7));
    }
}
