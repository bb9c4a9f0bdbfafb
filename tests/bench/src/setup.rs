//! The machinery around an experiment: the built binaries (found as the test kit finds
//! them), the simulated GPU, and a private `gpushare-arbiter` (the kit's) whose configuration
//! is the typed `gpushare_config::Config`, each mode's `[scheduler]` a typed
//! [`SchedulerConfig`].

use std::path::{Path, PathBuf};

use gpushare_proto::{
    ControlClient, Fraction, GpuSelector, Lease, MemoryRequest, Priority, ReserveRequest,
};
use gpushare_testkit::config::{Config, DeclaredDevice, SchedulerConfig, SchedulingPolicy};
use gpushare_testkit::simgpu::{self, SimMachine};
use gpushare_testkit::{binaries, config_edit, Arbiter, ArbiterBuilder, StartError};

/// The simulated GPUs' memory, each.
pub const GPU_MEMORY: &str = "16Gi";
/// Each lease's memory: the workloads allocate nothing, so any amount that fits four times.
const LEASE_MEMORY_BYTES: u64 = 1 << 30;
/// Lines of the arbiter's log an error quotes.
const LOG_TAIL_LINES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{path} is missing: build it first (cargo build --release -p simgpu-libcuda -p simgpu-libnvml -p simgpu-workload -p gpushare-arbiter -p gpushare-preload), or point GPUSHARE_BIN_DIR / GPUSHARE_PRELOAD_LIB at the build")]
    Missing { path: PathBuf },
    #[error("installing the simulated GPU: {0}")]
    Install(String),
    /// A `--gpushare-set` line the typed `[scheduler]` table refuses (an unknown key, a value
    /// of the wrong type), found before any case runs.
    #[error("--gpushare-set {0}")]
    BadSetting(#[from] config_edit::SettingError),
    #[error("the arbiter refused its configuration {config}: {log_tail}")]
    ConfigRefused { config: PathBuf, log_tail: String },
    #[error("the arbiter did not start: {0}")]
    ArbiterSilent(String),
    #[error("reserving a lease for {job}: {source}")]
    Reserve {
        job: String,
        source: gpushare_proto::ClientError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl From<StartError> for SetupError {
    fn from(e: StartError) -> SetupError {
        match e {
            StartError::Exited {
                config, log_tail, ..
            } => SetupError::ConfigRefused { config, log_tail },
            StartError::Io { what, source } => SetupError::Io { what, source },
            other => SetupError::ArbiterSilent(other.to_string()),
        }
    }
}

/// Where the programs an experiment runs were built (recorded in the results).
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
    pub preload: PathBuf,
    /// `debug` or `release`: which simgpu libraries are installed.
    pub profile: String,
}

impl Binaries {
    /// The test kit's `GPUSHARE_BIN_DIR` (else this program's profile directory) and
    /// `GPUSHARE_PRELOAD_LIB` (else `libgpushare.so` there). Builds nothing.
    pub fn locate() -> Result<Binaries, SetupError> {
        let dir = binaries::bin_dir();
        let dir = dir
            .canonicalize()
            .map_err(|_| SetupError::Missing { path: dir.clone() })?;
        let binaries = Binaries {
            dir,
            preload: binaries::preload_library(),
            profile: binaries::profile().into(),
        };
        for path in [
            binaries.program("gpushare-arbiter"),
            binaries.program("simgpu-workload"),
            binaries.dir.join("libcuda.so"),
            binaries.dir.join("libnvidia_ml.so"),
            binaries.preload.clone(),
        ] {
            if !path.exists() {
                return Err(SetupError::Missing { path });
            }
        }
        Ok(binaries)
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// The directory of the simulated `libcuda.so.1` and `libnvidia-ml.so.1`, installed once for
/// the whole run by the test kit.
pub fn simgpu_libs() -> Result<&'static Path, SetupError> {
    simgpu::try_libs().map_err(SetupError::Install)
}

/// A case's simulated machine: `gpus` GPUs of [`GPU_MEMORY`], their state under `dir/simgpu`,
/// hardware slices of `slice_us` and context switches of `switch_us`.
pub fn sim_machine(dir: &Path, gpus: usize, slice_us: u64, switch_us: u64) -> SimMachine {
    SimMachine::new(dir.join("simgpu"), gpus as u32, GPU_MEMORY)
        .set("SIMGPU_SLICE_US", slice_us)
        .set("SIMGPU_SWITCH_US", switch_us)
}

/// The `[scheduler]` table of a policy: the shipped defaults but for the policy, and with
/// `slice_ms` a fixed slice. Pure, so the configuration each mode runs under is table-tested.
pub fn scheduler_config(policy: SchedulingPolicy, slice_ms: Option<u64>) -> SchedulerConfig {
    let mut scheduler = SchedulerConfig {
        policy,
        ..SchedulerConfig::default()
    };
    if let Some(ms) = slice_ms {
        // A fixed slice: the shortest one the arbiter may cut it to is the slice itself.
        scheduler.slice_ms = ms;
        scheduler.min_slice_ms = ms;
        // And the longest: the arbiter requires slice_ms <= max_slice_ms (default 200), which
        // a Gemini-like 250 ms quota exceeds. Round-robin never grows a slice, so there this
        // only satisfies the check; under the priority policy it keeps slices from growing
        // past the fixed one (200 ms, as faults.rs asks, is the default anyway).
        scheduler.max_slice_ms = ms;
    }
    scheduler
}

/// Applies `--gpushare-set` lines (`key = value`) to a `[scheduler]` table, in order.
pub fn apply_settings(
    scheduler: &mut SchedulerConfig,
    settings: &[String],
) -> Result<(), SetupError> {
    for setting in settings {
        config_edit::apply(scheduler, setting)?;
    }
    Ok(())
}

/// The arbiter's configuration for one case on one simulated GPU: every job goes on it,
/// whatever its recent utilisation, and it is also declared (by its simulated UUID).
pub fn single_gpu_config(config: &mut Config, scheduler: SchedulerConfig) {
    config.arbiter.gpu_util_limit = 1.0;
    config.arbiter.low_nums_limit = 8;
    config.arbiter.devices = vec![DeclaredDevice {
        uuid: simgpu::gpu_uuid(0),
        name: "simulated GPU 0".into(),
        memory: GPU_MEMORY.parse().expect("GPU_MEMORY is a size"),
    }];
    config.scheduler = scheduler;
}

/// The arbiter's configuration over several simulated GPUs (found through the simulated
/// NVML), with Algorithm 1's two placement limits.
pub fn multi_gpu_config(
    config: &mut Config,
    gpu_util_limit: f64,
    low_nums_limit: u32,
    scheduler: SchedulerConfig,
) {
    config.arbiter.gpu_util_limit = gpu_util_limit;
    config.arbiter.low_nums_limit = low_nums_limit;
    config.scheduler = scheduler;
}

/// A private arbiter in `dir` on `machine`, its environment `env` (the workloads'), not
/// started yet: [`start`] starts it.
pub fn arbiter_on(dir: &Path, machine: &SimMachine, env: &[(String, String)]) -> ArbiterBuilder {
    env.iter()
        .fold(Arbiter::builder_in(dir).simulated(machine), |b, (k, v)| {
            b.env(k, v)
        })
}

/// Starts the arbiter; a configuration it refuses is [`SetupError::ConfigRefused`].
pub fn start(builder: ArbiterBuilder) -> Result<Arbiter, SetupError> {
    Ok(builder.try_start()?)
}

/// The last lines of the arbiter's log, for an error.
pub fn log_tail(arbiter: &Arbiter) -> String {
    arbiter.log_tail(LOG_TAIL_LINES)
}

/// Reserves a lease on one GPU of `arbiter`, as an entry point would for a container.
pub fn reserve(
    arbiter: &Arbiter,
    job: &str,
    priority: Priority,
    compute_request: f64,
    compute_limit: f64,
) -> Result<Lease, SetupError> {
    reserve_with_memory(
        arbiter,
        job,
        priority,
        (compute_request, compute_limit),
        LEASE_MEMORY_BYTES,
    )
}

/// [`reserve`] with a memory quota of `memory_bytes` (the memory-reclaim benchmark's leases
/// hold what they allocate).
pub fn reserve_with_memory(
    arbiter: &Arbiter,
    job: &str,
    priority: Priority,
    (compute_request, compute_limit): (f64, f64),
    memory_bytes: u64,
) -> Result<Lease, SetupError> {
    let fraction = |v: f64| Fraction::new(v).unwrap_or(Fraction::ONE);
    let reserve = || -> Result<Lease, gpushare_proto::ClientError> {
        let mut client =
            ControlClient::connect(&arbiter.control_socket(), std::time::Duration::from_secs(5))?;
        let lease = client.reserve(ReserveRequest {
            container_id: format!("bench-{job}"),
            namespace: None,
            sandbox_id: None,
            priority,
            memory: Some(MemoryRequest::Bytes(memory_bytes)),
            compute_request: fraction(compute_request),
            compute_limit: fraction(compute_limit),
            gpu: GpuSelector::Count(1),
            tenant: None,
            pod: None,
        })?;
        // The jobs are this process's children: confirming with its own pid puts
        // them inside "the container" (pid namespace and cgroup), as lease sockets
        // require of every peer.
        client.confirm(format!("bench-{job}"), std::process::id())?;
        Ok(lease)
    };
    reserve().map_err(|source| SetupError::Reserve {
        job: job.to_owned(),
        source,
    })
}

/// The arbiter's own timing of its placement decisions and batch searches.
pub fn placement_times(
    arbiter: &Arbiter,
) -> Result<gpushare_proto::timing::PlacementTimes, gpushare_proto::ClientError> {
    let mut client =
        ControlClient::connect(&arbiter.control_socket(), std::time::Duration::from_secs(5))?;
    Ok(client.status()?.placement_times)
}

/// The socket a lease's interposer talks to (what the runtime mounts in a container).
pub fn lease_socket(arbiter: &Arbiter, lease: &Lease) -> PathBuf {
    arbiter.lease_socket(&lease.id.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_tables_per_policy() {
        assert_eq!(
            scheduler_config(SchedulingPolicy::Priority, None),
            SchedulerConfig::default()
        );
        let off = scheduler_config(SchedulingPolicy::Off, None);
        assert_eq!(
            off,
            SchedulerConfig {
                policy: SchedulingPolicy::Off,
                ..SchedulerConfig::default()
            }
        );
        let rr = scheduler_config(SchedulingPolicy::RoundRobin, Some(1));
        assert_eq!(
            (rr.policy, rr.slice_ms, rr.min_slice_ms, rr.max_slice_ms),
            (SchedulingPolicy::RoundRobin, 1, 1, 1)
        );
        let quota = scheduler_config(SchedulingPolicy::RoundRobin, Some(250));
        assert_eq!(
            (quota.slice_ms, quota.min_slice_ms, quota.max_slice_ms),
            (250, 250, 250)
        );
    }

    #[test]
    fn settings_are_typed_and_an_unknown_key_is_refused_by_name() {
        let mut scheduler = SchedulerConfig::default();
        apply_settings(&mut scheduler, &["idle_us = 100".into()]).unwrap();
        assert_eq!(scheduler.idle_us, 100);
        let err = apply_settings(&mut scheduler, &["idle_usec = 5".into()]).unwrap_err();
        assert!(matches!(err, SetupError::BadSetting(_)), "{err}");
        assert!(err.to_string().contains("idle_usec"), "{err}");
    }

    #[test]
    fn single_gpu_config_names_the_simulated_gpu_and_the_scheduler() {
        let mut config = Config::default();
        single_gpu_config(&mut config, scheduler_config(SchedulingPolicy::Off, None));
        assert_eq!(config.arbiter.devices.len(), 1);
        assert_eq!(
            config.arbiter.devices[0].uuid,
            "GPU-51a6d0e0-0000-4000-8000-000000000000"
        );
        assert_eq!(
            (config.arbiter.gpu_util_limit, config.arbiter.low_nums_limit),
            (1.0, 8)
        );
        assert_eq!(config.scheduler.policy, SchedulingPolicy::Off);
        let toml = config.to_toml().unwrap();
        assert!(toml.contains("policy = \"off\""), "{toml}");
    }
}
