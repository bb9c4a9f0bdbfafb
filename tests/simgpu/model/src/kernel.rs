//! How a launch says how long its kernel runs.
//!
//! The simulated GPU runs no code, so the duration travels in the launch itself: in the function
//! name (`sleep_250us`, `sleep_2ms`, `sleep_1500ns`, `sleep_1s`) or, for programs that draw
//! durations from a distribution, as the first kernel parameter (a `u64` of nanoseconds) of a
//! function named `simgpu_kernel`.

/// The name of the function whose first parameter is its duration in nanoseconds.
pub const PARAM_KERNEL_NAME: &str = "simgpu_kernel";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelDuration {
    /// Fixed by the function name.
    Fixed(u64),
    /// Read from the first kernel parameter at launch.
    FirstParam,
    /// The name encodes nothing: the configured default applies.
    Default,
}

impl KernelDuration {
    pub fn from_function_name(name: &str) -> KernelDuration {
        if name == PARAM_KERNEL_NAME {
            return KernelDuration::FirstParam;
        }
        match name.strip_prefix("sleep_").and_then(parse_duration) {
            Some(ns) => KernelDuration::Fixed(ns),
            None => KernelDuration::Default,
        }
    }
}

/// Parses `250us`, `2ms`, `1500ns`, `1s`.
pub fn parse_duration(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let mult = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_encode_durations() {
        let table = [
            ("sleep_250us", KernelDuration::Fixed(250_000)),
            ("sleep_2ms", KernelDuration::Fixed(2_000_000)),
            ("sleep_1500ns", KernelDuration::Fixed(1_500)),
            ("sleep_1s", KernelDuration::Fixed(1_000_000_000)),
            ("simgpu_kernel", KernelDuration::FirstParam),
            ("gemm_kernel", KernelDuration::Default),
            ("sleep_", KernelDuration::Default),
            ("sleep_5", KernelDuration::Default),
            ("sleep_5h", KernelDuration::Default),
            ("sleep_ms", KernelDuration::Default),
        ];
        for (name, want) in table {
            assert_eq!(KernelDuration::from_function_name(name), want, "{name}");
        }
    }
}
