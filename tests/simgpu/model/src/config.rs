//! The simulated machine's shape, read from `SIMGPU_*` environment variables.
//!
//! The first process to create the state directory fixes the configuration for everyone (it is
//! stored in the shared state); later processes' variables only choose the directory.

use std::path::PathBuf;

/// Default directory of the shared state; tests point `SIMGPU_DIR` at a temporary one.
pub const DEFAULT_DIR: &str = "/run/simgpu";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{var}={value:?}: {why}")]
    Invalid {
        var: &'static str,
        value: String,
        why: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Where the shared state file and the owner-lock file live.
    pub dir: PathBuf,
    pub gpus: u32,
    /// Physical memory per GPU: what NVML reports as `total`.
    pub memory_bytes: u64,
    /// The part of `memory_bytes` the driver and firmware keep for themselves: NVML v2's
    /// `reserved`; CUDA can never allocate it, so `cuMemGetInfo`'s total is the rest.
    pub reserved_memory_bytes: u64,
    pub sms: u32,
    /// Length of one hardware time slice when several contexts have work.
    pub slice_ns: u64,
    /// Cost of switching the GPU from one context to another.
    pub switch_ns: u64,
    /// Host<->device copy bandwidth (PCIe).
    pub host_copy_bytes_per_s: u64,
    /// Device-to-device copy bandwidth (device memory).
    pub device_copy_bytes_per_s: u64,
    /// Bandwidth at which `cuCheckpointProcessCheckpoint` moves a process's device memory to
    /// the host and `cuCheckpointProcessRestore` moves it back.
    pub checkpoint_copy_bytes_per_s: u64,
    /// Duration of a kernel whose name encodes none.
    pub default_kernel_ns: u64,
    /// What `cuDriverGetVersion` reports, 1000 * major + 10 * minor.
    pub cuda_version: i32,
    /// Device memory a context costs from creation to destruction, outside every allocation.
    pub context_memory_bytes: u64,
    /// Device memory a module costs once lazily loaded (its first launch) until unloaded.
    pub module_memory_bytes: u64,
    /// CPU time the calling thread spends inside the driver for each kernel launch.
    pub launch_host_ns: u64,
    /// Earliest a kernel can start on the device after its launch call submitted it.
    pub launch_latency_ns: u64,
}

/// Checkpoint and restore bandwidth: an estimate until a GPU measures it. The driver copies a
/// checkpointed process's device memory into host memory it manages, so the copy cannot beat
/// the host link; 25 GB/s is PCIe 4.0 x16's usable rate (the same as `SIMGPU_PCIE_GBPS`).
pub const DEFAULT_CHECKPOINT_BYTES_PER_S: u64 = 25_000_000_000;

/// Per-context overhead: PyTorch's maintainers measure "~300MB" of device memory for a CUDA
/// context with lazy module loading (CUDA >= 11.7), against ">1000MB" when every kernel was
/// loaded eagerly (pytorch/pytorch#107667, ptrblck, 2023; ~400 MB in #109888). That is what
/// `nvidia-smi` shows for a process before its first allocation; 300 MiB is the lower figure,
/// as a driver-API program loads fewer libraries than PyTorch.
pub const DEFAULT_CONTEXT_MEMORY: u64 = 300 << 20;
/// Per-module overhead once lazily loaded (CUDA_MODULE_LOADING=LAZY, the default on Linux since
/// CUDA 12.2): device memory is handed out in 2 MiB pages (the VMM granularity of current GPUs,
/// `cuMemGetAllocationGranularity`), and a loaded module needs at least one page for its code
/// and constant banks.
pub const DEFAULT_MODULE_MEMORY: u64 = 2 << 20;
/// The driver's reserved share of a GPU's memory, in parts per ten thousand: an ESTIMATE. An
/// H100 80GB shows 81,559 MiB in NVML (`nvidia-smi`) while CUDA reports a total of about
/// 81,008 MiB (`cuMemGetInfo`; PyTorch's "total capacity of 79.11 GiB"), some 551 MiB or
/// 0.68 % less; nvidia-smi -q lists that difference as "Reserved". Other GPUs differ, and
/// `make gpu-check` measures the real figure where a GPU is present.
pub const DEFAULT_RESERVED_PER_10K: u64 = 68;

/// The default reserved amount for a GPU of `memory_bytes`, whole MiB, rounded up.
pub fn default_reserved(memory_bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    let bytes = (memory_bytes as u128 * DEFAULT_RESERVED_PER_10K as u128 / 10_000) as u64;
    bytes.div_ceil(MIB) * MIB
}

/// Host cost of one `cuLaunchKernel`: NVIDIA's "Getting Started with CUDA Graphs" (A. Gray,
/// 2019, V100) measured 3.8 µs per back-to-back launch of a 2.9 µs kernel through the runtime
/// (`cudaLaunchKernel`, which adds its own bookkeeping to the driver call); recent measurements
/// (RTX 5070 Ti, CUDA 13) put the whole runtime+driver path at 4-6 µs. 2 µs is the driver's share.
pub const DEFAULT_LAUNCH_HOST_NS: u64 = 2_000;
/// Submission-to-start latency: the same blog measured 9.6 µs per kernel when each launch was
/// followed by a synchronisation (2.9 µs of kernel, ~3.8 µs of launch), leaving ~3-4 µs for
/// the doorbell, the front end fetching the work and the synchronisation noticing completion.
pub const DEFAULT_LAUNCH_LATENCY_NS: u64 = 4_000;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            dir: PathBuf::from(DEFAULT_DIR),
            gpus: 2,
            memory_bytes: 16 << 30,
            reserved_memory_bytes: default_reserved(16 << 30),
            sms: 108,
            slice_ns: 1_000_000,
            switch_ns: 25_000,
            host_copy_bytes_per_s: 25_000_000_000,
            device_copy_bytes_per_s: 900_000_000_000,
            checkpoint_copy_bytes_per_s: DEFAULT_CHECKPOINT_BYTES_PER_S,
            default_kernel_ns: 10_000,
            cuda_version: 12080,
            context_memory_bytes: DEFAULT_CONTEXT_MEMORY,
            module_memory_bytes: DEFAULT_MODULE_MEMORY,
            launch_host_ns: DEFAULT_LAUNCH_HOST_NS,
            launch_latency_ns: DEFAULT_LAUNCH_LATENCY_NS,
        }
    }
}

impl SimConfig {
    /// Reads the process environment.
    pub fn from_env() -> Result<SimConfig, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads variables through `lookup`, so parsing can be tested without touching the environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<SimConfig, ConfigError> {
        let mut config = SimConfig::default();
        if let Some(dir) = lookup("SIMGPU_DIR").filter(|d| !d.is_empty()) {
            config.dir = PathBuf::from(dir);
        }
        if let Some(v) = lookup("SIMGPU_GPUS") {
            config.gpus = parse_int("SIMGPU_GPUS", &v, 1, crate::shared::MAX_GPUS as u64)? as u32;
        }
        if let Some(v) = lookup("SIMGPU_MEMORY") {
            config.memory_bytes = parse_bytes("SIMGPU_MEMORY", &v)?;
        }
        // After SIMGPU_MEMORY: the default is a share of it.
        let reserved = lookup("SIMGPU_RESERVED_MEMORY");
        config.reserved_memory_bytes = match &reserved {
            Some(v) => parse_bytes_or_zero("SIMGPU_RESERVED_MEMORY", v)?,
            None => default_reserved(config.memory_bytes),
        };
        if config.reserved_memory_bytes >= config.memory_bytes {
            return Err(ConfigError::Invalid {
                var: "SIMGPU_RESERVED_MEMORY",
                value: reserved.unwrap_or_else(|| config.reserved_memory_bytes.to_string()),
                why: "must be less than the GPU's memory (SIMGPU_MEMORY)",
            });
        }
        if let Some(v) = lookup("SIMGPU_SMS") {
            config.sms = parse_int("SIMGPU_SMS", &v, 1, 10_000)? as u32;
        }
        if let Some(v) = lookup("SIMGPU_SLICE_US") {
            config.slice_ns = parse_int("SIMGPU_SLICE_US", &v, 1, 10_000_000)? * 1000;
        }
        if let Some(v) = lookup("SIMGPU_SWITCH_US") {
            config.switch_ns = parse_int("SIMGPU_SWITCH_US", &v, 0, 10_000_000)? * 1000;
        }
        if let Some(v) = lookup("SIMGPU_PCIE_GBPS") {
            config.host_copy_bytes_per_s =
                parse_int("SIMGPU_PCIE_GBPS", &v, 1, 100_000)? * 1_000_000_000;
        }
        if let Some(v) = lookup("SIMGPU_DEVICE_GBPS") {
            config.device_copy_bytes_per_s =
                parse_int("SIMGPU_DEVICE_GBPS", &v, 1, 1_000_000)? * 1_000_000_000;
        }
        if let Some(v) = lookup("SIMGPU_CHECKPOINT_GBPS") {
            config.checkpoint_copy_bytes_per_s =
                parse_int("SIMGPU_CHECKPOINT_GBPS", &v, 1, 100_000)? * 1_000_000_000;
        }
        if let Some(v) = lookup("SIMGPU_DEFAULT_KERNEL_US") {
            config.default_kernel_ns =
                parse_int("SIMGPU_DEFAULT_KERNEL_US", &v, 0, 1_000_000_000)? * 1000;
        }
        if let Some(v) = lookup("SIMGPU_CUDA_VERSION") {
            config.cuda_version = parse_int("SIMGPU_CUDA_VERSION", &v, 2000, 99_990)? as i32;
        }
        // 0 switches an overhead off (tests that pack allocations up to a quota use that).
        if let Some(v) = lookup("SIMGPU_CONTEXT_MEMORY") {
            config.context_memory_bytes = parse_bytes_or_zero("SIMGPU_CONTEXT_MEMORY", &v)?;
        }
        if let Some(v) = lookup("SIMGPU_MODULE_MEMORY") {
            config.module_memory_bytes = parse_bytes_or_zero("SIMGPU_MODULE_MEMORY", &v)?;
        }
        if let Some(v) = lookup("SIMGPU_LAUNCH_HOST_NS") {
            config.launch_host_ns = parse_int("SIMGPU_LAUNCH_HOST_NS", &v, 0, 1_000_000_000)?;
        }
        if let Some(v) = lookup("SIMGPU_LAUNCH_LATENCY_NS") {
            config.launch_latency_ns = parse_int("SIMGPU_LAUNCH_LATENCY_NS", &v, 0, 1_000_000_000)?;
        }
        Ok(config)
    }
}

fn parse_int(var: &'static str, value: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    let n: u64 = value.trim().parse().map_err(|_| ConfigError::Invalid {
        var,
        value: value.to_string(),
        why: "not a whole number",
    })?;
    if n < min || n > max {
        return Err(ConfigError::Invalid {
            var,
            value: value.to_string(),
            why: "out of range",
        });
    }
    Ok(n)
}

/// Parses `16Gi`, `512Mi`, `8G`, `1024` (bytes).
pub fn parse_bytes(var: &'static str, value: &str) -> Result<u64, ConfigError> {
    let v = value.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (digits, unit) = v.split_at(split);
    let bad = |why| ConfigError::Invalid {
        var,
        value: value.to_string(),
        why,
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| bad("expected a number of bytes such as 16Gi"))?;
    let mult: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return Err(bad("unit must be one of Ki Mi Gi Ti K M G T")),
    };
    n.checked_mul(mult)
        .filter(|b| *b > 0)
        .ok_or(bad("zero or too large"))
}

/// [`parse_bytes`], with `0` allowed (an overhead switched off).
pub fn parse_bytes_or_zero(var: &'static str, value: &str) -> Result<u64, ConfigError> {
    if value.trim() == "0" {
        return Ok(0);
    }
    parse_bytes(var, value)
}

/// The GPUs a process sees, as model indices, from `NVIDIA_VISIBLE_DEVICES`.
///
/// On a real node the NVIDIA container toolkit reads that variable and exposes
/// only the named devices to the container, so the driver inside enumerates just
/// those, renumbered from 0. The simulated driver applies the same rule itself:
/// unset, empty or `all` → every GPU; `void` or `none` → none; otherwise a
/// comma-separated list of indices or UUIDs, in that order.
pub fn visible_gpus(gpus: u32, spec: Option<&str>) -> Result<Vec<u32>, String> {
    let spec = spec.map(str::trim).unwrap_or("");
    match spec {
        "" | "all" => return Ok((0..gpus).collect()),
        "void" | "none" => return Ok(Vec::new()),
        _ => {}
    }
    let mut visible = Vec::new();
    for item in spec.split(',').map(str::trim) {
        let gpu = match item.parse::<u32>() {
            Ok(index) if index < gpus => index,
            Ok(_) => {
                return Err(format!(
                    "NVIDIA_VISIBLE_DEVICES names GPU index {item}, which does not exist"
                ))
            }
            Err(_) => (0..gpus)
                .find(|&i| crate::gpu_uuid(i) == item)
                .ok_or_else(|| {
                    format!("NVIDIA_VISIBLE_DEVICES names {item:?}, which is not a simulated GPU")
                })?,
        };
        if !visible.contains(&gpu) {
            visible.push(gpu);
        }
    }
    Ok(visible)
}

#[cfg(test)]
mod tests {
    #[test]
    fn visible_gpus_follow_nvidia_visible_devices() {
        use super::visible_gpus;
        assert_eq!(visible_gpus(3, None).unwrap(), vec![0, 1, 2]);
        assert_eq!(visible_gpus(3, Some("all")).unwrap(), vec![0, 1, 2]);
        assert_eq!(visible_gpus(3, Some("void")).unwrap(), Vec::<u32>::new());
        assert_eq!(visible_gpus(3, Some("2,0")).unwrap(), vec![2, 0]);
        let uuid = crate::gpu_uuid(1);
        assert_eq!(visible_gpus(3, Some(&uuid)).unwrap(), vec![1]);
        assert!(visible_gpus(3, Some("3")).is_err());
        assert!(visible_gpus(3, Some("GPU-nope")).is_err());
    }

    use super::*;

    fn lookup<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn defaults_without_variables() {
        let c = SimConfig::from_lookup(|_| None).unwrap();
        assert_eq!(c, SimConfig::default());
        assert_eq!(c.gpus, 2);
        assert_eq!(c.dir, PathBuf::from("/run/simgpu"));
    }

    #[test]
    fn variables_override() {
        let c = SimConfig::from_lookup(lookup(&[
            ("SIMGPU_GPUS", "4"),
            ("SIMGPU_MEMORY", "8Gi"),
            ("SIMGPU_SMS", "80"),
            ("SIMGPU_SWITCH_US", "0"),
            ("SIMGPU_SLICE_US", "2000"),
            ("SIMGPU_DIR", "/tmp/x"),
        ]))
        .unwrap();
        assert_eq!((c.gpus, c.memory_bytes, c.sms), (4, 8 << 30, 80));
        assert_eq!((c.switch_ns, c.slice_ns), (0, 2_000_000));
        assert_eq!(c.dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn byte_units() {
        let table = [
            ("1024", 1024),
            ("512Mi", 512 << 20),
            ("8G", 8_000_000_000),
            ("2Ki", 2048),
        ];
        for (text, want) in table {
            assert_eq!(parse_bytes("V", text), Ok(want), "{text}");
        }
        for bad in ["", "Gi", "12Q", "0", "-1", "99999999999Ti"] {
            assert!(parse_bytes("V", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn overheads_default_on_and_switch_off_with_zero() {
        let c = SimConfig::from_lookup(|_| None).unwrap();
        assert_eq!(c.context_memory_bytes, 300 << 20);
        assert_eq!(c.module_memory_bytes, 2 << 20);
        let c = SimConfig::from_lookup(lookup(&[
            ("SIMGPU_CONTEXT_MEMORY", "0"),
            ("SIMGPU_MODULE_MEMORY", "4Mi"),
            ("SIMGPU_LAUNCH_HOST_NS", "0"),
            ("SIMGPU_LAUNCH_LATENCY_NS", "7000"),
        ]))
        .unwrap();
        assert_eq!(c.context_memory_bytes, 0);
        assert_eq!(c.module_memory_bytes, 4 << 20);
        assert_eq!((c.launch_host_ns, c.launch_latency_ns), (0, 7000));
        assert!(SimConfig::from_lookup(lookup(&[("SIMGPU_CONTEXT_MEMORY", "-1")])).is_err());
    }

    #[test]
    fn reserved_memory_is_an_estimated_share_unless_set() {
        let c = SimConfig::from_lookup(|_| None).unwrap();
        // 0.68 % of 16 GiB, rounded up to a whole MiB.
        assert_eq!(c.reserved_memory_bytes, 112 << 20);
        let c = SimConfig::from_lookup(lookup(&[("SIMGPU_MEMORY", "81559Mi")])).unwrap();
        assert_eq!(c.reserved_memory_bytes, 555 << 20, "an H100's ~551 MiB");
        let c = SimConfig::from_lookup(lookup(&[
            ("SIMGPU_MEMORY", "1Gi"),
            ("SIMGPU_RESERVED_MEMORY", "0"),
        ]))
        .unwrap();
        assert_eq!(c.reserved_memory_bytes, 0);
        let c = SimConfig::from_lookup(lookup(&[("SIMGPU_RESERVED_MEMORY", "64Mi")])).unwrap();
        assert_eq!(c.reserved_memory_bytes, 64 << 20);
        for bad in ["1Gi", "2Gi", "-1", "lots"] {
            let err = SimConfig::from_lookup(lookup(&[
                ("SIMGPU_MEMORY", "1Gi"),
                ("SIMGPU_RESERVED_MEMORY", bad),
            ]))
            .unwrap_err();
            assert!(err.to_string().contains("SIMGPU_RESERVED_MEMORY"), "{err}");
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn rejects_bad_counts() {
        assert!(SimConfig::from_lookup(lookup(&[("SIMGPU_GPUS", "0")])).is_err());
        assert!(SimConfig::from_lookup(lookup(&[("SIMGPU_GPUS", "two")])).is_err());
        assert!(SimConfig::from_lookup(lookup(&[("SIMGPU_GPUS", "999")])).is_err());
    }
}
