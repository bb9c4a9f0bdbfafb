//! The one configuration file every gpushare component reads:
//! `/etc/gpushare/config.toml`, or the file named by `GPUSHARE_CONFIG`.
//!
//! Every field has a default, so a node works with no file at all. Unknown keys
//! and wrong types are errors that name the key and the file: a typo in a
//! production node's configuration must not silently fall back to a default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpushare_types::layout::{CONTROL_SOCKET, LEASES_DIR};
use gpushare_types::{ByteSize, LossPolicy};
use serde::{Deserialize, Serialize};

pub mod check;
pub mod installation;
pub mod keys;
pub mod problems;
#[cfg(feature = "schema")]
mod schema;

pub use problems::Problem;

pub const DEFAULT_PATH: &str = "/etc/gpushare/config.toml";
/// Read from the environment of the *runtime* process (dockerd, containerd, the
/// test harness), never from a container's spec.
pub const PATH_ENV: &str = "GPUSHARE_CONFIG";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read gpushare configuration {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Every problem the file has, each naming its key, value and fix.
    #[error("invalid gpushare configuration {path}: {}", problems::joined(.problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

impl ConfigError {
    /// The file that could not be read or was refused.
    pub fn path(&self) -> &Path {
        match self {
            ConfigError::Read { path, .. } | ConfigError::Invalid { path, .. } => path,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Config {
    pub arbiter: ArbiterConfig,
    pub requests: RequestPolicy,
    pub runtime: RuntimeConfig,
    pub scheduler: SchedulerConfig,
    pub kubernetes: KubernetesConfig,
    pub placement: PlacementConfig,
    pub memory: MemoryConfig,
}

/// Which placement policy places a lease on a GPU.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum PlacementPolicy {
    /// Wang et al.'s Algorithm 1 (`arbiter.gpu_util_limit`, `arbiter.low_nums_limit`):
    /// co-locates low-priority jobs before opening an empty GPU. Kept so the paper's
    /// behaviour can still be measured.
    Wang,
    /// Balanced multi-resource placement: spreads while empty GPUs exist,
    /// weighs memory, compute and job count (Sun et al.), sees load over a short window.
    #[default]
    Balanced,
}

/// The `[placement]` table: the placement policy and its weights.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PlacementConfig {
    /// Which placement policy places a lease on a GPU.
    pub policy: PlacementPolicy,
    /// Place several waiting requests together with a search over assignments
    /// (bounded by `batch_budget_us`, greedy order as the fallback).
    pub batch: bool,
    /// Weight of a GPU's memory load (its quotas over its memory) in the balanced
    /// score, Sun et al.'s weighted resource scores; from 0 to 1000.
    pub memory_weight: f64,
    /// Weight of a GPU's compute load (its leases' expected demand, in GPUs) in the
    /// balanced score; from 0 to 1000.
    pub compute_weight: f64,
    /// Weight of a GPU's job count (over 4 jobs as a full load) in the balanced
    /// score; from 0 to 1000.
    pub jobs_weight: f64,
    /// The utilisation window the balanced policy sees load over: seconds, not
    /// Algorithm 1's minute, so load a short run creates is visible.
    pub utilization_window_ms: u64,
    /// The batch search's time bound.
    pub batch_budget_us: u64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            policy: PlacementPolicy::Balanced,
            batch: false,
            memory_weight: 1.0,
            compute_weight: 1.0,
            jobs_weight: 1.0,
            utilization_window_ms: 5_000,
            batch_budget_us: 10_000,
        }
    }
}

impl PlacementConfig {
    fn validate(&self, problems: &mut Vec<Problem>) {
        for (key, value) in [
            ("placement.memory_weight", self.memory_weight),
            ("placement.compute_weight", self.compute_weight),
            ("placement.jobs_weight", self.jobs_weight),
        ] {
            if !(value.is_finite() && (0.0..=1000.0).contains(&value)) {
                problems.push(Problem::at(key, value, "must be a number from 0 to 1000"));
            }
        }
        check_duration(
            problems,
            "placement.utilization_window_ms",
            self.utilization_window_ms,
            100,
            HOUR_MS,
        );
        check_duration(
            problems,
            "placement.batch_budget_us",
            self.batch_budget_us,
            1,
            10_000_000,
        );
    }
}

/// The `[memory]` table: memory that follows priority. Off by default: the reclaim
/// checkpoints low-priority processes through the driver's checkpoint API (r570+), and
/// its latency has been measured on the simulated driver only.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct MemoryConfig {
    /// Low-priority leases may be admitted beyond the memory high-priority leases leave;
    /// a high-priority allocation that needs their memory checkpoints them off the GPU
    /// (and they are restored when it fits again).
    pub reclaim: bool,
    /// With `reclaim`: how far low-priority quotas may add up beyond the GPU's memory that
    /// guaranteed leases (high priority, and low ones that cannot be checkpointed) leave,
    /// as a ratio (1.0: not beyond it; 2.0: twice it).
    pub low_overcommit: f64,
    /// The driver library whose `cuCheckpointProcess*` the reclaim calls.
    pub cuda_library: String,
    /// The device-to-host bandwidth a checkpoint is expected to reach, in GB/s: what the
    /// reclaim's time bound is computed from. 25 is an estimate (a copy to host memory
    /// is no faster than PCIe 4.0 x16) until a GPU measures it (`make gpu-check`).
    pub checkpoint_gbps: f64,
    /// The bound's floor: a reclaim may always take this long (locking waits for the
    /// victims' submitted work).
    pub reclaim_floor_ms: u64,
    /// How long after a reclaim on a GPU its suspended leases stay off it even if they
    /// fit again. A bursty high-priority job frees its memory between requests and takes
    /// it again within a second: restoring in between made it pay a checkpoint at nearly
    /// every request (simulated: p99 request latency 1.0 s against 0.11 s without reclaim).
    pub restore_delay_ms: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            reclaim: false,
            low_overcommit: 1.0,
            cuda_library: "libcuda.so.1".into(),
            checkpoint_gbps: 25.0,
            reclaim_floor_ms: 250,
            restore_delay_ms: 2_000,
        }
    }
}

/// The most `memory.low_overcommit` may be: beyond it nearly every low-priority job
/// would be checkpointed whenever the high one grows.
pub const MAX_LOW_OVERCOMMIT: f64 = 8.0;

impl MemoryConfig {
    /// How long reclaiming `bytes` may take: the floor, or 1.5 times the copy at the
    /// expected bandwidth.
    pub fn reclaim_bound(&self, bytes: u64) -> std::time::Duration {
        let copy_s = bytes as f64 / (self.checkpoint_gbps.max(0.001) * 1e9);
        std::time::Duration::from_millis(self.reclaim_floor_ms)
            .max(std::time::Duration::from_secs_f64(1.5 * copy_s))
    }

    fn validate(&self, placement: &PlacementConfig, problems: &mut Vec<Problem>) {
        if !(self.low_overcommit.is_finite()
            && (1.0..=MAX_LOW_OVERCOMMIT).contains(&self.low_overcommit))
        {
            problems.push(Problem::at(
                "memory.low_overcommit",
                self.low_overcommit,
                format!("must be a ratio from 1.0 (no over-commitment) to {MAX_LOW_OVERCOMMIT}"),
            ));
        }
        if !(self.checkpoint_gbps.is_finite() && (0.1..=10_000.0).contains(&self.checkpoint_gbps)) {
            problems.push(Problem::at(
                "memory.checkpoint_gbps",
                self.checkpoint_gbps,
                "must be a bandwidth in GB/s from 0.1 to 10000",
            ));
        }
        check_duration(
            problems,
            "memory.reclaim_floor_ms",
            self.reclaim_floor_ms,
            1,
            60_000,
        );
        check_duration(
            problems,
            "memory.restore_delay_ms",
            self.restore_delay_ms,
            0,
            HOUR_MS,
        );
        if self.cuda_library.is_empty() {
            problems.push(Problem::at(
                "memory.cuda_library",
                "\"\"",
                "name the CUDA driver library (e.g. \"libcuda.so.1\")",
            ));
        }
        if self.reclaim && placement.batch {
            problems.push(Problem::at(
                "memory.reclaim",
                true,
                "cannot be on with placement.batch = true yet (the batch search does not count lent memory); turn one of them off",
            ));
        }
    }
}

/// The `[kubernetes]` table: the device plugin `gpushare-kube`.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct KubernetesConfig {
    /// One unit of `gpushare.io/memory`. 1 GiB: Sun et al.'s granularity, and fine
    /// enough that a 24 GiB job wastes under 1 GiB to rounding; every unit is a
    /// device kubelet tracks, so 80 GiB GPUs × 8 stay at 640 devices.
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::byte_size"))]
    pub memory_unit: ByteSize,
    /// kubelet's device plugin directory: its registration socket `kubelet.sock`
    /// and the plugin's own sockets live here.
    pub device_plugin_dir: PathBuf,
    /// kubelet's PodResources API, which says which pods hold which devices:
    /// grants no pod holds any more are collected through it.
    pub pod_resources_socket: PathBuf,
    /// How often the plugin reads the arbiter's GPUs (drained, failed) and checks
    /// that kubelet still has its socket (a kubelet restart deletes it).
    pub poll_interval_ms: u64,
    /// How often grants are compared with PodResources.
    pub collect_interval_ms: u64,
    /// A grant younger than this is never collected: kubelet records an allocation
    /// only after `Allocate` returns, so a new grant is briefly held by no pod.
    pub collect_grace_ms: u64,
    /// Refuse a pod's container (one the CRI runtime names a pod for) that asks for
    /// a GPU share without a memory grant from `gpushare-kube`: with the device plugin
    /// deployed, kube-scheduler counts only what was granted, so a share taken by
    /// annotations alone would land on nodes the scheduler thinks are free. Off by
    /// default, so a RuntimeClass without the device plugin works as before.
    pub require_grant: bool,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            memory_unit: ByteSize(1 << 30),
            device_plugin_dir: PathBuf::from("/var/lib/kubelet/device-plugins"),
            pod_resources_socket: PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"),
            poll_interval_ms: 1000,
            collect_interval_ms: 10_000,
            collect_grace_ms: 60_000,
            require_grant: false,
        }
    }
}

impl KubernetesConfig {
    fn validate(&self, problems: &mut Vec<Problem>) {
        if self.memory_unit.0 < (1 << 20) {
            problems.push(Problem::at(
                "kubernetes.memory_unit",
                self.memory_unit,
                "must be at least 1 MiB (each unit is a device kubelet tracks)",
            ));
        }
        for (key, path) in [
            ("kubernetes.device_plugin_dir", &self.device_plugin_dir),
            (
                "kubernetes.pod_resources_socket",
                &self.pod_resources_socket,
            ),
        ] {
            if !path.is_absolute() {
                problems.push(Problem::at(
                    key,
                    format!("{path:?}"),
                    "must be an absolute path",
                ));
            }
        }
        for (key, value, min) in [
            ("kubernetes.poll_interval_ms", self.poll_interval_ms, 1),
            (
                "kubernetes.collect_interval_ms",
                self.collect_interval_ms,
                1,
            ),
            ("kubernetes.collect_grace_ms", self.collect_grace_ms, 0),
        ] {
            check_duration(problems, key, value, min, HOUR_MS);
        }
    }
}

/// The `[arbiter]` table: the node daemon's sockets, state, GPUs and placement limits.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ArbiterConfig {
    /// Holds the control socket and one directory per lease (mounted into that
    /// container as /run/gpushare). A tmpfs: it is rebuilt from `state_dir` after a reboot.
    pub run_dir: PathBuf,
    /// Durable lease records. Must survive an arbiter restart.
    pub state_dir: PathBuf,
    /// Root-only control socket; default `<run_dir>/control.sock`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_socket: Option<PathBuf>,
    /// GPUs to use when NVML cannot be loaded (no driver, or the simulated GPU in tests).
    pub devices: Vec<DeclaredDevice>,
    /// UUIDs of the GPUs gpushare may hand out; empty means all of them.
    pub shared_gpus: Vec<String>,
    /// Memory quota for a container that asks for a share but names no amount.
    /// A quarter of the GPU keeps four default-sized jobs per GPU, the paper's low-priority cap.
    /// A fraction (here and in requests: `25%`, `0.25`) is of the memory CUDA can allocate on
    /// the GPU, NVML's total less what the driver reserves, so quotas that add up to a whole
    /// GPU fit in it.
    #[cfg_attr(
        feature = "schema",
        schemars(schema_with = "crate::schema::memory_request")
    )]
    pub default_memory: gpushare_types::MemoryRequest,
    /// How long the client tools wait for the arbiter before failing a container start.
    pub client_timeout_ms: u64,
    /// The NVML library the arbiter loads at run time for inventory, utilisation and
    /// the watchdog. Default `libnvidia-ml.so.1`, the soname the driver installs, found
    /// by the dynamic linker like any CUDA program would; tests point it at the
    /// simulated GPU's library. An empty string skips NVML and uses `devices`.
    pub nvml_library: String,
    /// Wang et al.: a low-priority job is not placed on a GPU whose utilisation over
    /// the last minute is above this. 0.8 is the paper's value.
    pub gpu_util_limit: f64,
    /// Wang et al.: at most this many low-priority leases per GPU. 4 matches the
    /// default quota of a quarter of a GPU.
    pub low_nums_limit: u32,
    /// Sun et al.: how long a request that fits nowhere waits in the admission queue
    /// before it fails. 30 s rides out a container restart's release/reserve gap
    /// without holding a container start for long.
    pub admission_wait_ms: u64,
    /// Xiao et al.: GPUs reserved for one tenant are offered to that tenant's
    /// requests only. None by default: every GPU is in the common pool.
    pub reservations: Vec<TenantReservation>,
    /// How often the watchdog compares NVML's processes with the registered clients
    /// and reconciliation looks for vanished containers. 2 s: "every few seconds",
    /// cheap (one NVML call per GPU) yet quick to notice a bypassing process.
    pub watchdog_interval_ms: u64,
    /// Kill processes the watchdog reports (unregistered on a shared GPU, or in a
    /// lease over its quota). Off by default: killing is a policy an operator opts into.
    pub watchdog_kill: bool,
    /// The device memory a CUDA process uses outside its explicit allocations
    /// (context, lazily loaded modules, local memory, device heap) is charged to its
    /// lease: measured from NVML's per-process usage at attach, before a charge whenever
    /// the lease's last measurement is over 100 ms old (a lazily loaded module counts
    /// before the next grant), and on each watchdog pass. Until a process is first
    /// measured (NVML does not list it yet) this estimate is charged for it, and a
    /// lease's quota must exceed it. 300 MiB: a CUDA 12 context with lazy module
    /// loading measures about 250–500 MiB on current datacenter GPUs (more with eager
    /// loading or cuBLAS / cuDNN loaded); the low end, because a measurement replaces
    /// it within one reconcile tick. Not charged at all without NVML (declared
    /// devices), where nothing could ever measure it. 0 disables the estimate
    /// (measurement stays).
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::byte_size"))]
    pub context_memory_estimate: ByteSize,
    /// Quotas are shared out of the memory CUDA can allocate on a GPU: NVML's total (the
    /// physical memory) less what the driver and firmware reserve, which
    /// `nvmlDeviceGetMemoryInfo_v2` reports (an H100 80GB: 81,559 MiB in NVML, about
    /// 81,008 MiB in `cuMemGetInfo`, 0.68 % less). Drivers without that call (before R510)
    /// do not report it; there this fraction of the total is taken as reserved. 0.01 (1 %)
    /// covers the H100's share with room; from 0 to 0.5. Declared devices are taken as
    /// their declared `memory`, what CUDA can allocate on them.
    pub driver_reserved_fraction: f64,
    /// A lease whose container is gone is released only after this long, so the
    /// runtime's own poststop release (the normal path) goes first. 5 s.
    pub reconcile_grace_ms: u64,
    /// A lease reserved but never confirmed (the wrapper died before `runc create`)
    /// is released after this long. 5 min is far beyond any container creation.
    pub reserved_timeout_ms: u64,
    /// `host:port` of the Prometheus text endpoint (`GET /metrics`). Off by default:
    /// an operator chooses to expose it (normally on loopback, e.g. `127.0.0.1:9447`; not 9400, dcgm-exporter's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_address: Option<String>,
    /// Connections to the metrics endpoint served at once; one beyond it is
    /// answered 503 and closed. Anyone who can reach the address may connect, so
    /// without a cap a flood could take the descriptors the control socket needs.
    /// 64: a scrape or health check is one short connection every few seconds.
    pub metrics_max_connections: usize,
    /// Lease-socket connections every served lease is guaranteed whatever other
    /// containers hold (narrowed where the node's bound cannot give every lease
    /// that many, and never above the per-lease bound of 256). 64: 32 CUDA
    /// processes (a ledger and a token connection each). 0 shares the node's
    /// bound first come, first served.
    pub lease_connection_floor: usize,
}

/// GPUs set aside for one tenant.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TenantReservation {
    /// The tenant whose requests alone may be placed on these GPUs.
    pub tenant: String,
    /// The reserved GPUs' UUIDs.
    pub gpus: Vec<String>,
}

impl Default for ArbiterConfig {
    fn default() -> Self {
        ArbiterConfig {
            run_dir: PathBuf::from("/run/gpushare"),
            state_dir: PathBuf::from("/var/lib/gpushare"),
            control_socket: None,
            devices: Vec::new(),
            shared_gpus: Vec::new(),
            default_memory: gpushare_types::MemoryRequest::Fraction(
                gpushare_types::Fraction::new(0.25).expect("0.25 is a fraction"),
            ),
            client_timeout_ms: 10_000,
            nvml_library: "libnvidia-ml.so.1".into(),
            gpu_util_limit: 0.8,
            low_nums_limit: 4,
            admission_wait_ms: 30_000,
            reservations: Vec::new(),
            watchdog_interval_ms: 2_000,
            watchdog_kill: false,
            context_memory_estimate: ByteSize(300 << 20),
            driver_reserved_fraction: 0.01,
            reconcile_grace_ms: 5_000,
            reserved_timeout_ms: 300_000,
            metrics_address: None,
            metrics_max_connections: 64,
            lease_connection_floor: 64,
        }
    }
}

impl ArbiterConfig {
    pub fn control_socket(&self) -> PathBuf {
        self.control_socket
            .clone()
            .unwrap_or_else(|| self.run_dir.join(CONTROL_SOCKET))
    }

    /// The control socket when the file is refused (`error`), so that `gpusharectl`
    /// still reaches the arbiter, which keeps running on the last file it read:
    /// the file's own `arbiter.control_socket` or `arbiter.run_dir` where those keys
    /// alone still read as paths, else the default.
    pub fn control_socket_despite(error: &ConfigError) -> PathBuf {
        std::fs::read_to_string(error.path())
            .ok()
            .and_then(|text| control_socket_in(&text))
            .unwrap_or_else(|| ArbiterConfig::default().control_socket())
    }

    /// The directory a lease's container sees as /run/gpushare.
    pub fn lease_dir(&self, lease: &gpushare_types::LeaseId) -> PathBuf {
        self.run_dir.join(LEASES_DIR).join(&lease.0)
    }

    pub fn client_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.client_timeout_ms)
    }

    pub fn admission_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.admission_wait_ms)
    }

    /// The tenant a GPU is reserved for, if any.
    pub fn reserved_for(&self, uuid: &str) -> Option<&str> {
        self.reservations
            .iter()
            .find(|r| r.gpus.iter().any(|g| g == uuid))
            .map(|r| r.tenant.as_str())
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DeclaredDevice {
    /// The GPU's UUID (`GPU-…`), as NVML and `NVIDIA_VISIBLE_DEVICES` name it.
    pub uuid: String,
    /// The name shown for it (status, metrics); default "declared GPU".
    #[serde(default = "DeclaredDevice::default_name")]
    pub name: String,
    /// The memory CUDA can allocate on it: what its quotas are shared out of.
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::byte_size"))]
    pub memory: ByteSize,
}

impl DeclaredDevice {
    fn default_name() -> String {
        "declared GPU".to_string()
    }
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum Unrequested {
    /// Pass the container through unchanged, so gpushare can be a node's default runtime.
    #[default]
    Untouched,
    /// Force `NVIDIA_VISIBLE_DEVICES=void`, so images that bake in `=all` see no GPU.
    Void,
}

/// Where a container's tenant comes from (`requests.tenant_from`).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum TenantSource {
    /// The pod's namespace where the CRI runtime records one (as
    /// `KubernetesNamespace`), and the request's tenant elsewhere. Why that is sound:
    /// outside Kubernetes whoever starts a container talks to the engine's socket
    /// (docker, containerd, podman as root), which is root on the node already, so
    /// naming a tenant gains them nothing; a pod's author is not.
    #[default]
    Auto,
    /// `gpushare.io/tenant` or `GPUSHARE_TENANT`: whoever writes the container's
    /// spec chooses it, so `high_priority_tenants` keeps out only the honest.
    Request,
    /// The Kubernetes namespace of the pod, as the CRI runtime records it
    /// (`io.kubernetes.cri.sandbox-namespace` from containerd,
    /// `io.kubernetes.pod.namespace` from CRI-O), which a pod's author cannot choose
    /// beyond the namespaces Kubernetes lets them create pods in; a request naming a
    /// tenant is refused. Containers started outside Kubernetes have no tenant.
    KubernetesNamespace,
}

/// The `[requests]` table: what a container's annotations and environment may ask for.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RequestPolicy {
    /// Accept `GPUSHARE_*` environment variables as requests (docker 20.10 has no annotations).
    pub accept_env: bool,
    /// What happens to a container that asks for no GPU share.
    pub unrequested: Unrequested,
    /// Tenants allowed to ask for high priority; `None` (the key absent) allows everyone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub high_priority_tenants: Option<Vec<String>>,
    /// Where the tenant comes from; see [`TenantSource`].
    pub tenant_from: TenantSource,
    /// `GPUSHARE_*` variables other tools put in containers, which the runtime would
    /// otherwise refuse as misspelt requests (with `accept_env`): names, or prefixes
    /// ending in `*` (`"GPUSHARE_MYTOOL_*"`; `"GPUSHARE_*"` lets every name through).
    pub allowed_env: Vec<String>,
    /// The environment is written by the image as much as by the container's creator,
    /// and the runtime cannot tell the two apart; so by default a `GPUSHARE_*` request
    /// may ask only what the node grants any container: low priority, no tenant,
    /// memory up to `env_memory_ceiling` and a compute request up to
    /// `env_compute_request_ceiling`. `true` reads the environment as annotations
    /// are read, for nodes where whoever starts a container is trusted with its image.
    pub trust_environment: bool,
    /// The most memory an environment request may ask for; absent: the arbiter's
    /// `default_memory`, what a container gets that names no amount.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schemars(schema_with = "crate::schema::memory_request")
    )]
    pub env_memory_ceiling: Option<gpushare_types::MemoryRequest>,
    /// The largest compute request an environment request may make. 0.25: at the
    /// shipped `arbiter.low_nums_limit` of 4, the guarantees of the low-priority
    /// containers on one GPU then add up to the whole GPU at most.
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::fraction"))]
    pub env_compute_request_ceiling: gpushare_types::Fraction,
}

/// What an `allowed_env` entry may be, for its error.
pub const ALLOWED_ENV_FORMS: &str =
    "a GPUSHARE_* variable name (letters, digits, _), or a prefix of one ending in * (\"GPUSHARE_MYTOOL_*\")";

impl RequestPolicy {
    /// Whether `requests.allowed_env` lets the variable `name` through.
    pub fn allows_env(&self, name: &str) -> bool {
        self.allowed_env
            .iter()
            .any(|entry| match entry.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => name == entry,
            })
    }

    fn validate(&self, problems: &mut Vec<Problem>) {
        let ceiling = self.env_compute_request_ceiling.get();
        if gpushare_types::Fraction::new(ceiling).is_none() {
            problems.push(Problem::at(
                "requests.env_compute_request_ceiling",
                ceiling,
                "must be a fraction from 0 to 1",
            ));
        }
        for entry in &self.allowed_env {
            let name = entry.strip_suffix('*').unwrap_or(entry);
            let is_ours = name
                .get(..ENV_PREFIX.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX));
            let well_formed = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !is_ours || !well_formed {
                problems.push(Problem::about(
                    "requests.allowed_env",
                    format!("entry {entry:?}: expected {ALLOWED_ENV_FORMS}"),
                ));
            }
        }
    }
}

/// The prefix of the variables gpushare reads from a container's environment.
pub const ENV_PREFIX: &str = "GPUSHARE_";

impl Default for RequestPolicy {
    fn default() -> Self {
        RequestPolicy {
            accept_env: true,
            unrequested: Unrequested::Untouched,
            high_priority_tenants: None,
            tenant_from: TenantSource::Auto,
            allowed_env: Vec::new(),
            trust_environment: false,
            env_memory_ceiling: None,
            env_compute_request_ceiling: gpushare_types::Fraction::new(0.25)
                .expect("a quarter is a fraction"),
        }
    }
}

/// The `[runtime]` table: what gpushare-runc, the hook and the shim hand over to and
/// put into a container.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RuntimeConfig {
    /// The runtime `gpushare-runc` hands over to: the first one found. The NVIDIA
    /// runtime comes first so device nodes and driver libraries are still injected.
    pub runtimes: Vec<String>,
    /// Where the interposer lives on the host. Default: `<prefix>/lib/gpushare/libgpushare.so`,
    /// the prefix being where the running program is installed ([`install_prefix`]).
    pub library: PathBuf,
    /// Where it appears inside containers (bind-mounted read-only).
    pub container_library: PathBuf,
    /// Absolute path of gpushare-hook, written into each spec's hooks. Default:
    /// `<prefix>/bin/gpushare-hook`.
    pub hook: PathBuf,
    /// runc runs hooks without any timeout unless the spec sets one.
    pub hook_timeout_seconds: u32,
    /// Also mount an /etc/ld.so.preload naming the library: covers entrypoints
    /// that reset the environment and exec sessions (glibc only).
    pub ld_so_preload: bool,
    /// What the operator grants the containers an engine starts through a runtime
    /// entry naming a profile (`gpushare-runc --gpushare-profile NAME`: docker's
    /// `runtimeArgs`), by name; see [`RuntimeProfile`].
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub profiles: BTreeMap<String, RuntimeProfile>,
}

/// A runtime profile (`[runtime.profiles.NAME]`): engines without annotations
/// (docker 20.10) have no other way to say what the container's creator, rather
/// than its image, asks for; a second runtime entry only the operator can add
/// names the profile. Each term is what a container started through it gets
/// when it asks nothing else, and the most its environment may ask for; a
/// container started through it asks for a share even when it names nothing.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RuntimeProfile {
    /// Absent: low.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::priority"))]
    pub priority: Option<gpushare_types::Priority>,
    /// Absent: `arbiter.default_memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schemars(schema_with = "crate::schema::memory_request")
    )]
    pub memory: Option<gpushare_types::MemoryRequest>,
    /// Absent: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Absent: 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(schema_with = "crate::schema::fraction"))]
    pub compute_request: Option<gpushare_types::Fraction>,
}

/// What a profile's name may be: it is written into docker's runtime names
/// (`gpushare-NAME`) and command lines.
pub const PROFILE_NAME_FORMS: &str = "1 to 32 characters from a-z, 0-9 and '-'";

pub fn is_profile_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

impl RuntimeConfig {
    fn validate_profiles(&self, problems: &mut Vec<Problem>) {
        for (name, profile) in &self.profiles {
            let key = format!("runtime.profiles.{name}");
            if !is_profile_name(name) {
                problems.push(Problem::about(
                    "runtime.profiles",
                    format!("profile name {name:?}: expected {PROFILE_NAME_FORMS}"),
                ));
            }
            if let Some(tenant) = &profile.tenant {
                let well_formed = (1..=63).contains(&tenant.len())
                    && tenant.bytes().all(|b| {
                        b.is_ascii_lowercase()
                            || b.is_ascii_digit()
                            || matches!(b, b'-' | b'_' | b'.')
                    });
                if !well_formed {
                    problems.push(Problem::at(
                        &format!("{key}.tenant"),
                        format!("{tenant:?}"),
                        "expected a name of 1 to 63 characters from a-z, 0-9, '-', '_' and '.'",
                    ));
                }
            }
            if let Some(share) = profile.compute_request {
                if gpushare_types::Fraction::new(share.get()).is_none() {
                    problems.push(Problem::at(
                        &format!("{key}.compute_request"),
                        share.get(),
                        "must be a fraction from 0 to 1",
                    ));
                }
            }
        }
    }
}

/// `make install`'s default prefix, and the one assumed where the running program is
/// not installed under a prefix (a development build runs from `target/`).
pub const DEFAULT_PREFIX: &str = "/usr/local";

/// The installation prefix of a program at `exe`: the directory above its `bin/` or
/// `sbin/` (`/usr` for the Debian package's `/usr/bin/gpushare-runc`, `/opt/gpushare`
/// for `make install PREFIX=/opt/gpushare`); None elsewhere.
pub fn prefix_of(exe: &Path) -> Option<PathBuf> {
    let dir = exe.parent()?;
    let name = dir.file_name()?.to_str()?;
    matches!(name, "bin" | "sbin")
        .then(|| dir.parent().map(Path::to_path_buf))
        .flatten()
}

/// Where the running program is installed ([`prefix_of`] its own path, symlinks
/// resolved), else [`DEFAULT_PREFIX`]: the defaults of the host-side paths follow it,
/// so a packaged node needs no path in its configuration.
pub fn install_prefix() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| prefix_of(&exe))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PREFIX))
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        let prefix = install_prefix();
        RuntimeConfig {
            runtimes: vec![
                "nvidia-container-runtime".into(),
                "runc".into(),
                "crun".into(),
            ],
            library: prefix.join("lib/gpushare/libgpushare.so"),
            // A path inside containers, the same on every node.
            container_library: PathBuf::from("/usr/local/gpushare/libgpushare.so"),
            hook: prefix.join("bin/gpushare-hook"),
            hook_timeout_seconds: 10,
            ld_so_preload: false,
            profiles: BTreeMap::new(),
        }
    }
}

impl RuntimeConfig {
    /// The runtimes a container is handed to when the file is refused (`error`), so
    /// that containers asking nothing of gpushare still start: the file's own
    /// `runtime.runtimes` where that key alone still reads as a list of names,
    /// else the defaults.
    pub fn runtimes_despite(error: &ConfigError) -> Vec<String> {
        std::fs::read_to_string(error.path())
            .ok()
            .and_then(|text| runtimes_in(&text))
            .unwrap_or_else(|| RuntimeConfig::default().runtimes)
    }
}

/// The control socket a file that may be refused for other keys names.
fn control_socket_in(text: &str) -> Option<PathBuf> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let arbiter = table.get("arbiter")?;
    let path = |key: &str| arbiter.get(key)?.as_str().map(PathBuf::from);
    path("control_socket").or_else(|| Some(path("run_dir")?.join(CONTROL_SOCKET)))
}

/// `runtime.runtimes` of a file that may be refused for other keys.
fn runtimes_in(text: &str) -> Option<Vec<String>> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let names: Vec<String> = table
        .get("runtime")?
        .get("runtimes")?
        .as_array()?
        .iter()
        .map(|name| name.as_str().map(str::to_owned))
        .collect::<Option<_>>()?;
    (!names.is_empty()).then_some(names)
}

/// Which scheduler hands out the per-GPU time-slice token.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum SchedulingPolicy {
    /// High priority preempts low at once; request/limit shares among equals; slices
    /// sized from each client's bursts.
    #[default]
    Priority,
    /// A baseline for benchmarks: no priority, fixed `slice_ms`, FIFO rotation.
    RoundRobin,
    /// No token at all: clients run ungated (uncontrolled co-location; memory quotas
    /// still hold).
    Off,
}

/// The `[scheduler]` table: how the arbiter gives each GPU to its containers in turns (the
/// time-slice token).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SchedulerConfig {
    /// "priority" by default: the project's policy; the others exist to compare against.
    pub policy: SchedulingPolicy,
    /// Slice while others wait. A handoff measured p50 21 µs, p99 96 µs on a 2-core VM
    /// (arbiter/benches/token_handoff.rs), so 20 ms keeps handoff overhead under 0.5 %
    /// while a waiter still gets the GPU within 20 ms.
    pub slice_ms: u64,
    /// Shortest slice a burst history may shrink to: below 2 ms the handoff cost (up to
    /// 0.3 ms) would eat more than a tenth of the slice.
    pub min_slice_ms: u64,
    /// Slice when nobody else wants the GPU ("slices grow"): 200 ms makes handoffs rare
    /// yet bounds how stale a forgotten holder's grant can get.
    pub max_slice_ms: u64,
    /// A holder that has launched nothing (and whose work completed) for this long
    /// returns the token. 300 µs: longer than the gap between launches inside a burst,
    /// shorter than a CPU phase (data loading, host-side logic). On the simulated
    /// training job (tests/bench), 100, 300 and 1000 µs gave the same high-priority
    /// slowdown (0.8–1.4 %) and idle capture (90–94 %): the holder drains before it
    /// releases, so the threshold only has to exceed the launch gaps of a burst.
    pub idle_us: u64,
    /// Launch-ahead depth of a low-priority holder while no high-priority client is
    /// active on the GPU (see `high_active_ms`). 0 = unbounded: with only equals, or a
    /// high-priority neighbour that is idle, there is nothing to preempt quickly.
    pub launch_ahead: u32,
    /// Launch-ahead depth of a low-priority holder while a high-priority client is
    /// active on the GPU (see `high_active_ms`): 1, so a preempted holder drains in
    /// about one kernel.
    /// Measured (tests/bench, simulated, 100 µs low kernels): depth 1 gave the
    /// high-priority job 0.8–1.0 % slowdown and a start latency p99 of 128 µs; depth 2
    /// gave 2.2–2.4 % and 355–435 µs, for 5 points more of the idle time captured.
    pub launch_ahead_with_high: u32,
    /// Sliding window over which each client's token time is measured for request/limit.
    /// 2 s: long enough to average over many slices, short enough to follow phase changes.
    pub window_ms: u64,
    /// A high-priority client counts as active (and bounds a low holder's launch-ahead
    /// to `launch_ahead_with_high`) while it holds the token and for this long after
    /// its latest want or release. 500 ms: a training loop's CPU gaps between bursts
    /// (data loading, logging, the optimiser's host side) are milliseconds to a few
    /// hundred (the simulated pairs in tests/bench: 3–6 ms), so a running high job
    /// stays active throughout; an idle inference server stops costing the low job
    /// anything half a second after its last request. Shorter risks an unbounded low
    /// queue in front of the next burst of a slow loop; longer keeps serialising the
    /// low job's launches for nothing.
    pub high_active_ms: u64,
    /// A revoked holder that has not released after this long is reported *overdue*
    /// (status, metric, one warning) and no longer waited for: the next low-priority
    /// waiter may be granted. Nothing else happens to it — a drain is only the GPU
    /// finishing work queued before the revocation (the interposer submits nothing
    /// new), and one kernel or CUDA graph may run for seconds. 500 ms: beyond a
    /// bounded queue of ordinary kernels, so an overdue report means a long kernel or
    /// graph, or a stuck agent, and other low waiters wait at most this long for it.
    pub revoke_grace_ms: u64,
    /// A low-priority holder revoked while a high-priority job is active that is still
    /// draining after `revoke_grace_ms` *overran* the high job's window: its work runs
    /// into the high job's time whatever its interposer said (a blind launch, a new
    /// process per kernel, launches that bypassed the gate). The arbiter reports it (a
    /// violation of kind `overrun`) and, for this long, grants that lease's clients
    /// the token only while no high-priority job is active. Per lease, not per process,
    /// so a fresh process inherits its lease's record. 10 000 ms: many high-job
    /// iterations, so a lease that overruns every time it is admitted gets a window at
    /// most once per penalty. 0: report only.
    pub overrun_penalty_ms: u64,
    /// A low-priority holder given an admission window, revoked beside an active
    /// high-priority job, whose release comes more than this long after the later of
    /// its window's end and its revocation (plus, when the high job came back early,
    /// the part of the window it took back: the admitted work then shares the GPU)
    /// also overran (reported and penalised as above): it ran work past the window its interposer was told to fit, which an
    /// honest interposer does only by an estimate's error and the release's own
    /// latency. This catches what the grace is too long to see: one blind 400 ms
    /// kernel per fresh process, or a clock that says every window is long. 10 ms: a
    /// few kernels' worth of estimate error and a release delayed by a busy machine's
    /// scheduler; a 20 ms kernel launched into a 5 ms gap is past it.
    pub window_overrun_grace_ms: u64,
    /// A low-priority process the arbiter measures busy on its GPU beyond its token
    /// time while a high-priority job is active there (launches past the gate: the
    /// driver's own entry points, or work left queued after a release) is reported
    /// `ungated` within about a second and its lease penalised as for an overrun; with
    /// this on it is also stopped (SIGSTOP) until no high-priority job is active on the
    /// GPU, then continued. A penalty alone does not stop launches that never ask for
    /// the token. `false`: report and penalise only.
    pub pause_bypassing: bool,
    /// Whether the arbiter runs that check at all (`bypass.rs`). `false` leaves such a
    /// process to the watchdog's slower `ungated` check (seconds, not one). The one false
    /// finding seen (an honest job's 2 s kernel, preempted between the gate and the driver
    /// while a revocation landed, ran on after its release) was the interposer's race, now
    /// closed; the check has not yet met a real GPU's NVML sampling.
    pub bypass_check: bool,
    /// Duration-aware admission: while a high-priority client is active, a
    /// low-priority holder submits a launch only if the interposer's estimate of how
    /// long it will occupy the GPU ends before the high-priority job is expected back
    /// (learned from its gaps between release and want); work that does not fit waits.
    /// `false` gives the behaviour before it: a launch-ahead bound only, so a
    /// returning high job waits for the rest of the low job's current kernel (measured
    /// +20 % slowdown beside 5 ms low kernels, simulated).
    pub admit_by_duration: bool,
    /// The risk, in percent, that the high-priority job returns while admitted low
    /// work still runs: the admission window ends at this percentile of the high job's
    /// recent gaps (those longer than the time already waited). 10: a periodic job's
    /// window is nearly its whole gap; a random (Poisson) one's is about a tenth of its
    /// mean gap.
    pub high_return_risk_percent: u32,
    /// High-priority clients keep running while the arbiter is unreachable: they never
    /// wait for a grant anyway, and an arbiter restart must not stall them.
    #[cfg_attr(
        feature = "schema",
        schemars(schema_with = "crate::schema::loss_policy")
    )]
    pub high_on_arbiter_loss: LossPolicy,
    /// Low-priority clients wait while the arbiter is unreachable: they only borrow
    /// time the high-priority job leaves idle, which nobody can vouch for then.
    #[cfg_attr(
        feature = "schema",
        schemars(schema_with = "crate::schema::loss_policy")
    )]
    pub low_on_arbiter_loss: LossPolicy,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: SchedulingPolicy::Priority,
            slice_ms: 20,
            min_slice_ms: 2,
            max_slice_ms: 200,
            idle_us: 300,
            launch_ahead: 0,
            launch_ahead_with_high: 1,
            window_ms: 2_000,
            high_active_ms: 500,
            revoke_grace_ms: 500,
            overrun_penalty_ms: 10_000,
            window_overrun_grace_ms: 10,
            pause_bypassing: true,
            bypass_check: true,
            admit_by_duration: true,
            high_return_risk_percent: 10,
            high_on_arbiter_loss: LossPolicy::Run,
            low_on_arbiter_loss: LossPolicy::Wait,
        }
    }
}

impl SchedulerConfig {
    /// What a client of `priority` does while the arbiter is unreachable.
    pub fn on_arbiter_loss(&self, priority: gpushare_types::Priority) -> LossPolicy {
        match priority {
            gpushare_types::Priority::High => self.high_on_arbiter_loss,
            gpushare_types::Priority::Low => self.low_on_arbiter_loss,
        }
    }

    fn validate(&self, problems: &mut Vec<Problem>) {
        for (key, value, max) in [
            ("scheduler.slice_ms", self.slice_ms, HOUR_MS),
            ("scheduler.min_slice_ms", self.min_slice_ms, HOUR_MS),
            ("scheduler.max_slice_ms", self.max_slice_ms, HOUR_MS),
            ("scheduler.idle_us", self.idle_us, HOUR_MS * 1000),
            ("scheduler.window_ms", self.window_ms, HOUR_MS),
            ("scheduler.revoke_grace_ms", self.revoke_grace_ms, HOUR_MS),
            ("scheduler.high_active_ms", self.high_active_ms, HOUR_MS),
            (
                "scheduler.window_overrun_grace_ms",
                self.window_overrun_grace_ms,
                HOUR_MS,
            ),
        ] {
            check_duration(problems, key, value, 1, max);
        }
        // 0 turns the penalty off (overruns are still reported).
        check_duration(
            problems,
            "scheduler.overrun_penalty_ms",
            self.overrun_penalty_ms,
            0,
            HOUR_MS,
        );
        if !(1..=100).contains(&self.high_return_risk_percent) {
            problems.push(Problem::at(
                "scheduler.high_return_risk_percent",
                self.high_return_risk_percent,
                "must be 1 to 100",
            ));
        }
        if self.min_slice_ms > self.slice_ms {
            problems.push(Problem::at(
                "scheduler.min_slice_ms",
                self.min_slice_ms,
                format!("must not exceed scheduler.slice_ms = {}", self.slice_ms),
            ));
        }
        if self.slice_ms > self.max_slice_ms {
            problems.push(Problem::at(
                "scheduler.slice_ms",
                self.slice_ms,
                format!(
                    "must not exceed scheduler.max_slice_ms = {}",
                    self.max_slice_ms
                ),
            ));
        }
        if self.max_slice_ms > self.window_ms {
            problems.push(Problem::at(
                "scheduler.max_slice_ms",
                self.max_slice_ms,
                format!(
                    "must not exceed scheduler.window_ms = {} (a slice longer than the usage window defeats request/limit)",
                    self.window_ms
                ),
            ));
        }
    }
}

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;
/// Past half a GPU the value is surely a percentage written as a whole number.
const MAX_DRIVER_RESERVED_FRACTION: f64 = 0.5;
/// The arbiter's per-lease connection bound: no floor can exceed it.
const MAX_LEASE_CONNECTION_FLOOR: usize = 256;
/// Far beyond any set of scrapers, well inside the arbiter's descriptor headroom.
const MAX_METRICS_CONNECTIONS: usize = 512;

/// Durations become `Instant + Duration` deadlines, which panic on overflow: a
/// value like 18446744073709551615 must be refused here, naming the key, rather
/// than crash the arbiter at its first reserve. The bounds are far beyond any
/// sensible setting, so they only catch mistakes.
fn check_duration(problems: &mut Vec<Problem>, key: &str, value: u64, min: u64, max: u64) {
    if (min..=max).contains(&value) {
        return;
    }
    let human = |v: u64| {
        let unit_ms = if key.ends_with("_us") { 1000 } else { 1 };
        match v / unit_ms {
            ms if ms % DAY_MS == 0 => format!("{} d", ms / DAY_MS),
            ms => format!("{} h", ms / HOUR_MS),
        }
    };
    let low = if min == 0 {
        "at least 0".to_string()
    } else {
        format!("at least {min}")
    };
    problems.push(Problem::at(
        key,
        value,
        format!("must be {low} and at most {max} ({})", human(max)),
    ));
}

impl Config {
    /// The file named by `GPUSHARE_CONFIG`, else `/etc/gpushare/config.toml`;
    /// a missing default file means all defaults, a missing named file is an error.
    pub fn load_default() -> Result<(Config, Option<PathBuf>), ConfigError> {
        match std::env::var_os(PATH_ENV) {
            Some(path) => {
                let path = PathBuf::from(path);
                Ok((Config::load(&path)?, Some(path)))
            }
            None => Config::load_if_present(Path::new(DEFAULT_PATH)),
        }
    }

    pub fn load_if_present(path: &Path) -> Result<(Config, Option<PathBuf>), ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok((Config::parse(&text, path)?, Some(path.to_owned()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Config::default(), None)),
            Err(source) => Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            }),
        }
    }

    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// The configuration as a file `parse` reads back to the same value: what test
    /// harnesses write for a private arbiter instead of formatting TOML by hand.
    pub fn to_toml(&self) -> Result<String, toml::ser::Error> {
        toml::to_string(self)
    }

    /// Reads a configuration file's text: every component reads its file through
    /// here, and so does `check-config`, so the two cannot disagree. A file that is
    /// refused is refused with every problem found (`problems::read`).
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        problems::read(text).map_err(|problems| ConfigError::Invalid {
            path: path.to_owned(),
            problems,
        })
    }

    /// Every problem of a well-typed configuration, in the file's order of tables.
    fn validate(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (key, path) in [
            ("runtime.library", &self.runtime.library),
            ("runtime.container_library", &self.runtime.container_library),
            ("runtime.hook", &self.runtime.hook),
            ("arbiter.run_dir", &self.arbiter.run_dir),
            ("arbiter.state_dir", &self.arbiter.state_dir),
        ] {
            if !path.is_absolute() {
                problems.push(Problem::at(
                    key,
                    format!("{path:?}"),
                    "must be an absolute path",
                ));
            }
        }
        if self.runtime.runtimes.is_empty() {
            problems.push(Problem::at(
                "runtime.runtimes",
                "[]",
                "name at least one OCI runtime (e.g. \"runc\")",
            ));
        }
        if self.runtime.hook_timeout_seconds == 0 {
            problems.push(Problem::at(
                "runtime.hook_timeout_seconds",
                0,
                "must be at least 1 (runc would otherwise wait forever)",
            ));
        }
        let a = &self.arbiter;
        if !(a.gpu_util_limit.is_finite() && (0.0..=1.0).contains(&a.gpu_util_limit)) {
            problems.push(Problem::at(
                "arbiter.gpu_util_limit",
                a.gpu_util_limit,
                "must be a fraction from 0 to 1",
            ));
        }
        if !(a.driver_reserved_fraction.is_finite()
            && (0.0..=MAX_DRIVER_RESERVED_FRACTION).contains(&a.driver_reserved_fraction))
        {
            problems.push(Problem::at(
                "arbiter.driver_reserved_fraction",
                a.driver_reserved_fraction,
                "must be a fraction of the GPU's memory from 0 to 0.5 (0.01 is 1 %)",
            ));
        }
        if a.low_nums_limit == 0 {
            problems.push(Problem::at(
                "arbiter.low_nums_limit",
                0,
                "must be at least 1 (0 would refuse every low-priority request)",
            ));
        }
        for (key, value, min, max) in [
            (
                "arbiter.watchdog_interval_ms",
                a.watchdog_interval_ms,
                1,
                HOUR_MS,
            ),
            ("arbiter.client_timeout_ms", a.client_timeout_ms, 1, HOUR_MS),
            // 0: a request that fits nowhere fails at once.
            ("arbiter.admission_wait_ms", a.admission_wait_ms, 0, HOUR_MS),
            (
                "arbiter.reconcile_grace_ms",
                a.reconcile_grace_ms,
                0,
                DAY_MS,
            ),
            (
                "arbiter.reserved_timeout_ms",
                a.reserved_timeout_ms,
                0,
                7 * DAY_MS,
            ),
        ] {
            check_duration(&mut problems, key, value, min, max);
        }
        if !(1..=MAX_METRICS_CONNECTIONS).contains(&a.metrics_max_connections) {
            problems.push(Problem::at(
                "arbiter.metrics_max_connections",
                a.metrics_max_connections.to_string(),
                format!("expected 1 to {MAX_METRICS_CONNECTIONS}"),
            ));
        }
        if a.lease_connection_floor > MAX_LEASE_CONNECTION_FLOOR {
            problems.push(Problem::at(
                "arbiter.lease_connection_floor",
                a.lease_connection_floor.to_string(),
                format!(
                    "expected 0 to {MAX_LEASE_CONNECTION_FLOOR} (a lease's own bound); 0 turns the floor off"
                ),
            ));
        }
        if let Some(address) = &a.metrics_address {
            if address.parse::<std::net::SocketAddr>().is_err() {
                problems.push(Problem::at(
                    "arbiter.metrics_address",
                    format!("{address:?}"),
                    "expected host:port, e.g. \"127.0.0.1:9447\"",
                ));
            }
        }
        self.requests.validate(&mut problems);
        self.runtime.validate_profiles(&mut problems);
        self.scheduler.validate(&mut problems);
        self.kubernetes.validate(&mut problems);
        self.placement.validate(&mut problems);
        self.memory.validate(&self.placement, &mut problems);
        let mut reserved = std::collections::BTreeSet::new();
        for r in &a.reservations {
            if r.tenant.is_empty() {
                problems.push(Problem::about(
                    "arbiter.reservations",
                    "tenant must not be empty",
                ));
            }
            for gpu in &r.gpus {
                if !reserved.insert(gpu) {
                    problems.push(Problem::about(
                        "arbiter.reservations",
                        format!("GPU {gpu:?} is reserved twice"),
                    ));
                }
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.arbiter.devices {
            if !seen.insert(&d.uuid) {
                problems.push(Problem::about(
                    "arbiter.devices",
                    format!("uuid {:?} is declared twice", d.uuid),
                ));
            }
            if d.memory.0 == 0 {
                problems.push(Problem::about(
                    "arbiter.devices",
                    format!("device {:?} has memory = 0", d.uuid),
                ));
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("/etc/gpushare/config.toml"))
    }

    #[test]
    fn memory_reclaim_is_off_by_default_and_its_keys_name_themselves_when_wrong() {
        let m = Config::default().memory;
        assert!(!m.reclaim);
        assert_eq!(m.low_overcommit, 1.0);
        let c = parse("[memory]\nreclaim = true\nlow_overcommit = 2.5\n").unwrap();
        assert!(c.memory.reclaim);
        assert_eq!(c.memory.low_overcommit, 2.5);
        for (text, key, accepted) in [
            ("low_overcommit = 0.5", "memory.low_overcommit", "from 1.0"),
            ("low_overcommit = 9", "memory.low_overcommit", "to 8"),
            ("checkpoint_gbps = 0", "memory.checkpoint_gbps", "GB/s"),
            (
                "reclaim_floor_ms = 0",
                "memory.reclaim_floor_ms",
                "at least 1",
            ),
            ("cuda_library = \"\"", "memory.cuda_library", "libcuda.so.1"),
        ] {
            let err = parse(&format!("[memory]\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key) && err.contains(accepted), "{text}: {err}");
        }
        let err = parse("[memory]\nreclaim = true\n[placement]\nbatch = true\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("memory.reclaim") && err.contains("placement.batch"),
            "{err}"
        );
    }

    #[test]
    fn the_reclaim_bound_is_the_floor_or_one_and_a_half_copies() {
        let m = MemoryConfig::default();
        assert_eq!(m.reclaim_bound(256 << 20).as_millis(), 250);
        // 8 GiB at 25 GB/s: 0.344 s; 1.5 times that.
        let bound = m.reclaim_bound(8 << 30).as_secs_f64();
        assert!(
            (bound - 1.5 * 8.0 * 1073741824.0 / 25e9).abs() < 1e-6,
            "{bound}"
        );
    }

    #[test]
    fn driver_reserved_fraction_is_a_small_fraction_and_names_itself_when_wrong() {
        assert_eq!(Config::default().arbiter.driver_reserved_fraction, 0.01);
        let c = parse("[arbiter]\ndriver_reserved_fraction = 0.007\n").unwrap();
        assert_eq!(c.arbiter.driver_reserved_fraction, 0.007);
        let c = parse("[arbiter]\ndriver_reserved_fraction = 0\n").unwrap();
        assert_eq!(c.arbiter.driver_reserved_fraction, 0.0);
        for bad in ["1", "0.6", "-0.01", "nan"] {
            let err = parse(&format!("[arbiter]\ndriver_reserved_fraction = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("arbiter.driver_reserved_fraction") && err.contains("from 0 to 0.5"),
                "{bad}: {err}"
            );
        }
        let err = parse("[arbiter]\ndriver_reserved_fraction = \"1%\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("driver_reserved_fraction"), "{err}");
    }

    #[test]
    fn context_memory_estimate_takes_a_size_and_names_itself_when_wrong() {
        assert_eq!(
            Config::default().arbiter.context_memory_estimate,
            ByteSize(300 << 20)
        );
        let c = parse("[arbiter]\ncontext_memory_estimate = \"512Mi\"\n").unwrap();
        assert_eq!(c.arbiter.context_memory_estimate, ByteSize(512 << 20));
        let c = parse("[arbiter]\ncontext_memory_estimate = 0\n").unwrap();
        assert_eq!(c.arbiter.context_memory_estimate, ByteSize(0));
        let err = parse("[arbiter]\ncontext_memory_estimate = \"big\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("context_memory_estimate") && err.contains("big"),
            "{err}"
        );
    }

    /// Every field away from its default, every enum variant, both kinds of memory
    /// request, sizes and durations: what `to_toml` writes, `parse` reads back unchanged.
    #[test]
    fn every_setting_survives_a_round_trip_through_toml() {
        let round_trip = |config: &Config| {
            let text = config.to_toml().unwrap();
            let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(&back, config, "{text}");
        };
        round_trip(&Config::default());
        let mut config = Config::default();
        let a = &mut config.arbiter;
        a.run_dir = PathBuf::from("/tmp/gs/run");
        a.state_dir = PathBuf::from("/tmp/gs/state");
        a.control_socket = Some(PathBuf::from("/tmp/gs/control.sock"));
        a.devices = vec![
            DeclaredDevice {
                uuid: "GPU-51a6d0e0-0000-4000-8000-000000000000".into(),
                name: "sim 0".into(),
                memory: ByteSize(16 << 30),
            },
            DeclaredDevice {
                uuid: "GPU-51a6d0e0-0000-4000-8000-000000000001".into(),
                name: "sim 1".into(),
                memory: ByteSize(1000),
            },
        ];
        a.shared_gpus = vec!["GPU-51a6d0e0-0000-4000-8000-000000000001".into()];
        a.default_memory = gpushare_types::MemoryRequest::Bytes(3 << 30);
        a.client_timeout_ms = 1234;
        a.nvml_library = String::new();
        a.gpu_util_limit = 0.35;
        a.low_nums_limit = 9;
        a.admission_wait_ms = 0;
        a.reservations = vec![TenantReservation {
            tenant: "team-a".into(),
            gpus: vec!["GPU-51a6d0e0-0000-4000-8000-000000000000".into()],
        }];
        a.watchdog_interval_ms = 150;
        a.watchdog_kill = true;
        a.context_memory_estimate = ByteSize(512 << 20);
        a.reconcile_grace_ms = 0;
        a.reserved_timeout_ms = 7 * DAY_MS;
        a.metrics_address = Some("127.0.0.1:9400".into());
        config.requests = RequestPolicy {
            accept_env: false,
            unrequested: Unrequested::Void,
            high_priority_tenants: Some(vec!["team-a".into(), String::new()]),
            tenant_from: TenantSource::KubernetesNamespace,
            allowed_env: vec!["GPUSHARE_MYTOOL_*".into(), "GPUSHARE_OTHER".into()],
            trust_environment: true,
            env_memory_ceiling: Some("6Gi".parse().unwrap()),
            env_compute_request_ceiling: gpushare_types::Fraction::new(0.5).unwrap(),
        };
        config.runtime = RuntimeConfig {
            runtimes: vec!["runc".into()],
            library: PathBuf::from("/opt/gs/libgpushare.so"),
            container_library: PathBuf::from("/gs/libgpushare.so"),
            hook: PathBuf::from("/opt/gs/gpushare-hook"),
            hook_timeout_seconds: 3,
            ld_so_preload: true,
            profiles: BTreeMap::from([
                (
                    "high".to_owned(),
                    RuntimeProfile {
                        priority: Some(gpushare_types::Priority::High),
                        memory: Some("100%".parse().unwrap()),
                        tenant: Some("inference".into()),
                        compute_request: Some(gpushare_types::Fraction::new(0.5).unwrap()),
                    },
                ),
                ("plain".to_owned(), RuntimeProfile::default()),
            ]),
        };
        config.scheduler = SchedulerConfig {
            policy: SchedulingPolicy::RoundRobin,
            slice_ms: 7,
            min_slice_ms: 1,
            max_slice_ms: 900,
            idle_us: 1,
            launch_ahead: 5,
            launch_ahead_with_high: 0,
            window_ms: 1000,
            high_active_ms: 3,
            revoke_grace_ms: HOUR_MS,
            overrun_penalty_ms: 0,
            window_overrun_grace_ms: 3,
            pause_bypassing: false,
            bypass_check: true,
            admit_by_duration: false,
            high_return_risk_percent: 100,
            high_on_arbiter_loss: LossPolicy::Wait,
            low_on_arbiter_loss: LossPolicy::Run,
        };
        round_trip(&config);
        // The variants the configuration above does not name.
        config.arbiter.default_memory = "0.5".parse().unwrap();
        config.requests.unrequested = Unrequested::Untouched;
        config.requests.tenant_from = TenantSource::Request;
        config.scheduler.policy = SchedulingPolicy::Off;
        round_trip(&config);
        config.requests.tenant_from = TenantSource::Auto;
        config.scheduler.policy = SchedulingPolicy::Priority;
        round_trip(&config);
    }

    #[test]
    fn empty_file_is_all_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(
            Config::default().arbiter.control_socket(),
            PathBuf::from("/run/gpushare/control.sock")
        );
    }

    #[test]
    fn shipped_example_parses_and_matches_defaults_where_it_says_so() {
        let text = include_str!("../config.toml");
        let config = parse(text).unwrap();
        assert_eq!(config.runtime, RuntimeConfig::default());
        assert_eq!(config.requests, RequestPolicy::default());
        assert_eq!(config.arbiter, ArbiterConfig::default());
        assert_eq!(config.scheduler, SchedulerConfig::default());
        assert_eq!(config.kubernetes, KubernetesConfig::default());
        assert_eq!(config.placement, PlacementConfig::default());
    }

    #[test]
    fn kubernetes_values_out_of_range_are_refused_by_name() {
        for (text, key) in [
            (
                "[kubernetes]\nmemory_unit = \"1Ki\"\n",
                "kubernetes.memory_unit",
            ),
            (
                "[kubernetes]\ndevice_plugin_dir = \"relative\"\n",
                "kubernetes.device_plugin_dir",
            ),
            (
                "[kubernetes]\npoll_interval_ms = 0\n",
                "kubernetes.poll_interval_ms",
            ),
            (
                "[kubernetes]\ncollect_grace_ms = 18446744073709551615\n",
                "kubernetes.collect_grace_ms",
            ),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
        let ok = parse("[kubernetes]\nmemory_unit = \"512Mi\"\nrequire_grant = true\n").unwrap();
        assert_eq!(ok.kubernetes.memory_unit, ByteSize(512 << 20));
        assert!(ok.kubernetes.require_grant);
    }

    #[test]
    fn the_host_side_defaults_follow_where_the_program_is_installed() {
        for (exe, prefix) in [
            ("/usr/bin/gpushare-runc", Some("/usr")),
            (
                "/usr/local/bin/containerd-shim-gpushare-v2",
                Some("/usr/local"),
            ),
            ("/opt/gpushare/sbin/gpushare-arbiter", Some("/opt/gpushare")),
            ("/bin/gpushare-hook", Some("/")),
            // A development build, a test binary: not installed under a prefix.
            ("/src/gpushare/target/debug/gpushare-runc", None),
            ("/src/gpushare/target/debug/deps/config-0123", None),
            ("gpushare-runc", None),
        ] {
            assert_eq!(
                prefix_of(Path::new(exe)),
                prefix.map(PathBuf::from),
                "{exe}"
            );
        }
        // This test runs from target/: the defaults are make install's.
        let runtime = RuntimeConfig::default();
        assert_eq!(
            runtime.library,
            Path::new(DEFAULT_PREFIX).join("lib/gpushare/libgpushare.so")
        );
        assert_eq!(
            runtime.hook,
            Path::new(DEFAULT_PREFIX).join("bin/gpushare-hook")
        );
    }

    #[test]
    fn scheduler_table_parses_every_key() {
        let config = parse(
            "[scheduler]\npolicy = \"round-robin\"\nslice_ms = 10\nmin_slice_ms = 1\nmax_slice_ms = 100\n\
             idle_us = 500\nlaunch_ahead = 8\nlaunch_ahead_with_high = 2\nwindow_ms = 1000\n\
             revoke_grace_ms = 50\nhigh_active_ms = 250\nhigh_on_arbiter_loss = \"wait\"\nlow_on_arbiter_loss = \"run\"\n\
             admit_by_duration = false\nhigh_return_risk_percent = 25\noverrun_penalty_ms = 0\n\
             window_overrun_grace_ms = 4\npause_bypassing = false\nbypass_check = true\n",
        )
        .unwrap();
        let s = &config.scheduler;
        assert_eq!(s.policy, SchedulingPolicy::RoundRobin);
        assert_eq!((s.slice_ms, s.min_slice_ms, s.max_slice_ms), (10, 1, 100));
        assert_eq!(
            (s.idle_us, s.launch_ahead, s.launch_ahead_with_high),
            (500, 8, 2)
        );
        assert_eq!(
            (s.window_ms, s.revoke_grace_ms, s.high_active_ms),
            (1000, 50, 250)
        );
        assert_eq!(
            (s.admit_by_duration, s.high_return_risk_percent),
            (false, 25)
        );
        assert_eq!(s.overrun_penalty_ms, 0);
        assert_eq!(s.window_overrun_grace_ms, 4);
        assert!(!s.pause_bypassing);
        assert!(s.bypass_check);
        assert_eq!(
            s.on_arbiter_loss(gpushare_types::Priority::High),
            LossPolicy::Wait
        );
        assert_eq!(
            s.on_arbiter_loss(gpushare_types::Priority::Low),
            LossPolicy::Run
        );
        assert_eq!(
            parse("[scheduler]\npolicy = \"off\"\n")
                .unwrap()
                .scheduler
                .policy,
            SchedulingPolicy::Off
        );
    }

    #[test]
    fn scheduler_errors_name_the_key_the_value_and_what_is_accepted() {
        for (text, expected) in [
            (
                "[scheduler]\npolicy = \"fifo\"\n",
                ["policy", "fifo", "round-robin"],
            ),
            (
                "[scheduler]\nslice_ms = 0\n",
                ["scheduler.slice_ms", "= 0", "at least 1"],
            ),
            (
                "[scheduler]\nhigh_active_ms = 0\n",
                ["scheduler.high_active_ms", "= 0", "at least 1"],
            ),
            (
                "[scheduler]\nwindow_ms = 0\n",
                ["scheduler.window_ms", "= 0", "at least 1"],
            ),
            (
                "[scheduler]\nhigh_return_risk_percent = 0\n",
                ["scheduler.high_return_risk_percent", "= 0", "1 to 100"],
            ),
            (
                "[scheduler]\nhigh_return_risk_percent = 101\n",
                ["scheduler.high_return_risk_percent", "= 101", "1 to 100"],
            ),
            (
                "[scheduler]\nmin_slice_ms = 30\n",
                [
                    "scheduler.min_slice_ms",
                    "30",
                    "must not exceed scheduler.slice_ms",
                ],
            ),
            (
                "[scheduler]\nslice_ms = 300\n",
                [
                    "scheduler.slice_ms",
                    "300",
                    "must not exceed scheduler.max_slice_ms",
                ],
            ),
            (
                "[scheduler]\nmax_slice_ms = 3000\n",
                ["scheduler.max_slice_ms", "3000", "scheduler.window_ms"],
            ),
            (
                "[scheduler]\nlow_on_arbiter_loss = \"panic\"\n",
                ["low_on_arbiter_loss", "panic", "wait"],
            ),
            (
                "[requests]\ntenant_from = \"annotation\"\n",
                ["tenant_from", "annotation", "kubernetes-namespace"],
            ),
            ("[scheduler]\nslice = 5\n", ["slice", "slice_ms", "line 2"]),
        ] {
            let err = parse(text).unwrap_err().to_string();
            for piece in expected {
                assert!(err.contains(piece), "{text:?}: {err} lacks {piece:?}");
            }
        }
    }

    #[test]
    fn durations_are_bounded_and_errors_name_the_key_the_value_and_the_range() {
        let huge = u64::MAX;
        for (text, expected) in [
            (
                format!("[arbiter]\nadmission_wait_ms = {huge}\n"),
                vec![
                    "arbiter.admission_wait_ms".to_string(),
                    format!("= {huge}"),
                    "at most 3600000 (1 h)".into(),
                ],
            ),
            (
                "[arbiter]\nadmission_wait_ms = 3600001\n".into(),
                vec!["arbiter.admission_wait_ms".into(), "at least 0".into()],
            ),
            (
                format!("[arbiter]\nclient_timeout_ms = {huge}\n"),
                vec!["arbiter.client_timeout_ms".into(), "at most 3600000".into()],
            ),
            (
                "[arbiter]\nclient_timeout_ms = 0\n".into(),
                vec![
                    "arbiter.client_timeout_ms".into(),
                    "= 0".into(),
                    "at least 1".into(),
                ],
            ),
            (
                format!("[arbiter]\nwatchdog_interval_ms = {huge}\n"),
                vec!["arbiter.watchdog_interval_ms".into()],
            ),
            (
                format!("[arbiter]\nreconcile_grace_ms = {huge}\n"),
                vec![
                    "arbiter.reconcile_grace_ms".into(),
                    "at most 86400000 (1 d)".into(),
                ],
            ),
            (
                format!("[arbiter]\nreserved_timeout_ms = {huge}\n"),
                vec![
                    "arbiter.reserved_timeout_ms".into(),
                    "at most 604800000 (7 d)".into(),
                ],
            ),
            (
                format!("[scheduler]\nwindow_ms = {huge}\n"),
                vec!["scheduler.window_ms".into(), "at most 3600000".into()],
            ),
            (
                format!("[scheduler]\nrevoke_grace_ms = {huge}\n"),
                vec!["scheduler.revoke_grace_ms".into()],
            ),
            (
                format!("[scheduler]\nhigh_active_ms = {huge}\n"),
                vec!["scheduler.high_active_ms".into()],
            ),
            (
                format!("[scheduler]\nidle_us = {huge}\n"),
                vec![
                    "scheduler.idle_us".into(),
                    "at most 3600000000 (1 h)".into(),
                ],
            ),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            for piece in &expected {
                assert!(
                    err.contains(piece.as_str()),
                    "{text:?}: {err} lacks {piece:?}"
                );
            }
        }
        // The bounds themselves are accepted.
        let c = parse("[arbiter]\nadmission_wait_ms = 3600000\nreconcile_grace_ms = 0\n").unwrap();
        assert_eq!(c.arbiter.admission_wait_ms, 3_600_000);
    }

    #[test]
    fn unknown_key_names_the_key_and_file() {
        let err = parse("[arbiter]\nrun_dri = \"/run/x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("run_dri"), "{err}");
        assert!(err.contains("/etc/gpushare/config.toml"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key_and_file() {
        let err = parse("[requests]\naccept_env = \"yes\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("accept_env"), "{err}");
        assert!(err.contains("/etc/gpushare/config.toml"), "{err}");
        let err = parse("[[arbiter.devices]]\nuuid = \"GPU-x\"\nmemory = \"lots\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory") && err.contains("lots"), "{err}");
    }

    #[test]
    fn declared_devices_and_units() {
        let config = parse(
            "[[arbiter.devices]]\nuuid = \"GPU-51a6d0e0-0000-4000-8000-000000000000\"\nmemory = \"16Gi\"\n\
             [[arbiter.devices]]\nuuid = \"GPU-51a6d0e0-0000-4000-8000-000000000001\"\nname = \"sim\"\nmemory = 1024\n",
        )
        .unwrap();
        assert_eq!(config.arbiter.devices[0].memory, ByteSize(16 << 30));
        assert_eq!(config.arbiter.devices[1].memory, ByteSize(1024));
        assert_eq!(config.arbiter.devices[1].name, "sim");
    }

    #[test]
    fn semantic_errors_name_the_key() {
        for (text, key) in [
            ("[runtime]\nlibrary = \"lib.so\"\n", "runtime.library"),
            ("[runtime]\nruntimes = []\n", "runtime.runtimes"),
            (
                "[runtime]\nhook_timeout_seconds = 0\n",
                "runtime.hook_timeout_seconds",
            ),
            ("[requests]\nunrequested = \"drop\"\n", "unrequested"),
            ("[arbiter]\ngpu_util_limit = 1.5\n", "arbiter.gpu_util_limit"),
            ("[arbiter]\nlow_nums_limit = 0\n", "arbiter.low_nums_limit"),
            (
                "[arbiter]\nmetrics_max_connections = 0\n",
                "arbiter.metrics_max_connections",
            ),
            (
                "[arbiter]\nlease_connection_floor = 257\n",
                "arbiter.lease_connection_floor",
            ),
            (
                "[arbiter]\nmetrics_address = \"localhost\"\n",
                "arbiter.metrics_address",
            ),
            (
                "[[arbiter.reservations]]\ntenant = \"a\"\ngpus = [\"GPU-1\"]\n[[arbiter.reservations]]\ntenant = \"b\"\ngpus = [\"GPU-1\"]\n",
                "reserved twice",
            ),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }

    #[test]
    fn the_environment_is_held_to_the_nodes_ceilings_by_default_and_profiles_are_read() {
        let defaults = Config::default().requests;
        assert!(!defaults.trust_environment);
        assert_eq!(defaults.env_memory_ceiling, None, "absent: default_memory");
        assert_eq!(defaults.env_compute_request_ceiling.get(), 0.25);
        let c = parse(
            "[requests]\nenv_memory_ceiling = \"8Gi\"\nenv_compute_request_ceiling = 0.5\n\
             [runtime.profiles.high]\npriority = \"high\"\nmemory = \"100%\"\ntenant = \"inference\"\n",
        )
        .unwrap();
        assert_eq!(c.requests.env_memory_ceiling, Some("8Gi".parse().unwrap()));
        let high = &c.runtime.profiles["high"];
        assert_eq!(high.priority, Some(gpushare_types::Priority::High));
        assert_eq!(high.tenant.as_deref(), Some("inference"));
        for (text, named) in [
            (
                "[requests]\nenv_compute_request_ceiling = 2\n",
                "requests.env_compute_request_ceiling",
            ),
            ("[runtime.profiles.High]\n", "\"High\""),
            (
                "[runtime.profiles.x]\ntenant = \"A B\"\n",
                "runtime.profiles.x.tenant",
            ),
            (
                "[runtime.profiles.x]\ncompute_request = 3\n",
                "runtime.profiles.x.compute_request",
            ),
            ("[runtime.profiles.x]\npriority = \"urgent\"\n", "priority"),
            ("[runtime.profiles.x]\nmemroy = \"1Gi\"\n", "memroy"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(named), "{text}: {err}");
        }
    }

    #[test]
    fn allowed_env_takes_names_and_prefixes_and_refuses_anything_else_by_name() {
        assert!(Config::default().requests.allowed_env.is_empty());
        let c = parse(
            "[requests]\nallowed_env = [\"GPUSHARE_MYTOOL_*\", \"GPUSHARE_OTHER\", \"gpushare_lower\"]\n",
        )
        .unwrap();
        let r = &c.requests;
        for (name, allowed) in [
            ("GPUSHARE_MYTOOL_", true),
            ("GPUSHARE_MYTOOL_X", true),
            ("GPUSHARE_OTHER", true),
            ("gpushare_lower", true),
            // Names match exactly, case included: the environment is case-sensitive.
            ("GPUSHARE_OTHER_X", false),
            ("GPUSHARE_OTHE", false),
            ("GPUSHARE_mytool_x", false),
            ("GPUSHARE_LOWER", false),
            ("GPUSHARE_MEMORY", false),
        ] {
            assert_eq!(r.allows_env(name), allowed, "{name}");
        }
        let everything = parse("[requests]\nallowed_env = [\"GPUSHARE_*\"]\n").unwrap();
        assert!(everything.requests.allows_env("GPUSHARE_ANYTHING"));
        assert!(!RequestPolicy::default().allows_env("GPUSHARE_ANYTHING"));
        for bad in [
            "MYTOOL_X",
            "",
            "*",
            "GPUSHARE",
            "GPUSHARE_A-B",
            "GPUSHARE_A*B",
            "GPUSHARE_**",
            "GPUSHARE_A B",
            "GPUSHARE_A=1",
            "XGPUSHARE_A",
            "GPUSHARE_É",
        ] {
            let text = format!("[requests]\nallowed_env = [{bad:?}]\n");
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.contains("requests.allowed_env")
                    && err.contains(&format!("{bad:?}"))
                    && err.contains(ALLOWED_ENV_FORMS),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn the_runtimes_of_a_refused_file_are_its_own_where_they_still_read() {
        let defaults = || Some(RuntimeConfig::default().runtimes);
        for (text, expected) in [
            (
                "[runtime]\nruntimes = [\"crun\"]\nlibary = \"/x\"\n",
                Some(vec!["crun".to_string()]),
            ),
            ("[runtime]\nruntimes = []\n", None),
            ("[runtime]\nruntimes = [1]\n", None),
            ("[runtime]\nlibary = \"/x\"\n", None),
            ("not toml at all = = =", None),
        ] {
            assert_eq!(runtimes_in(text), expected, "{text}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "[runtime]\nruntimes = [\"crun\"]\nlibary = 1\n").unwrap();
        let refused = Config::load(&path).unwrap_err();
        assert_eq!(RuntimeConfig::runtimes_despite(&refused), ["crun"]);
        let unreadable = Config::load(&dir.path().join("absent.toml")).unwrap_err();
        assert_eq!(
            Some(RuntimeConfig::runtimes_despite(&unreadable)),
            defaults()
        );
    }

    #[test]
    fn the_control_socket_of_a_refused_file_is_its_own_where_it_still_reads() {
        for (text, expected) in [
            (
                "[arbiter]\nrun_dir = \"/x/run\"\nwatchdog = 1\n",
                Some("/x/run/control.sock"),
            ),
            (
                "[arbiter]\nrun_dir = \"/x/run\"\ncontrol_socket = \"/y/c.sock\"\n",
                Some("/y/c.sock"),
            ),
            ("[arbiter]\nrun_dir = 3\n", None),
            ("[runtime]\nlibary = \"/x\"\n", None),
            ("not toml at all = = =", None),
        ] {
            assert_eq!(
                control_socket_in(text),
                expected.map(PathBuf::from),
                "{text}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "[arbiter]\nrun_dir = \"/x/run\"\nrun_dri = 1\n").unwrap();
        let refused = Config::load(&path).unwrap_err();
        assert_eq!(
            ArbiterConfig::control_socket_despite(&refused),
            PathBuf::from("/x/run/control.sock")
        );
        let unreadable = Config::load(&dir.path().join("absent.toml")).unwrap_err();
        assert_eq!(
            ArbiterConfig::control_socket_despite(&unreadable),
            ArbiterConfig::default().control_socket()
        );
    }

    #[test]
    fn missing_default_file_means_defaults_but_a_named_missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (config, used) = Config::load_if_present(&dir.path().join("absent.toml")).unwrap();
        assert_eq!(config, Config::default());
        assert!(used.is_none());
        assert!(Config::load(&dir.path().join("absent.toml")).is_err());
    }
}

/// The ready-made snippets users copy must stay well-formed and agree with the
/// defaults (install paths, runtime name, annotation patterns).
#[cfg(test)]
mod snippet_tests {
    use std::path::Path;

    fn read(rel: &str) -> String {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
    }

    #[test]
    fn containerd_snippets() {
        for (file, plugin) in [
            ("containerd/config-v2.toml", "io.containerd.grpc.v1.cri"),
            ("containerd/config-v3.toml", "io.containerd.cri.v1.runtime"),
        ] {
            let doc: toml::Value = toml::from_str(&read(file)).unwrap();
            let runtime = &doc["plugins"][plugin]["containerd"]["runtimes"]["gpushare"];
            assert_eq!(
                runtime["pod_annotations"][0].as_str(),
                Some("gpushare.io/*"),
                "{file}"
            );
            assert_eq!(
                runtime["container_annotations"][0].as_str(),
                Some("gpushare.io/*"),
                "{file}"
            );
            // gpushare-runc as runc's binary, on every containerd release. Never the
            // shim through runtime_path, which containerd < 1.6.21/1.7.2 drops without a
            // word (pods would bypass gpushare), and never neither.
            let binary = runtime
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(|b| b.as_str());
            assert_eq!(binary, Some("/usr/local/bin/gpushare-runc"), "{file}");
            assert!(runtime.get("runtime_path").is_none(), "{file}");
            assert_eq!(
                runtime["runtime_type"].as_str(),
                Some("io.containerd.runc.v2"),
                "{file}"
            );
        }
    }

    #[test]
    fn docker_and_hook_snippets() {
        let d20: serde_json::Value =
            serde_json::from_str(&read("docker/daemon-20.10.json")).unwrap();
        assert_eq!(
            d20["runtimes"]["gpushare"]["path"],
            "/usr/local/bin/gpushare-runc"
        );
        let d24: serde_json::Value = serde_json::from_str(&read("docker/daemon-24.json")).unwrap();
        assert_eq!(
            d24["runtimes"]["gpushare"]["options"]["BinaryName"],
            "/usr/local/bin/gpushare-runc"
        );
        let hook: serde_json::Value = serde_json::from_str(&read("hooks.d/gpushare.json")).unwrap();
        assert_eq!(
            hook["hook"]["path"],
            crate::RuntimeConfig::default().hook.to_str().unwrap()
        );
        assert!(
            hook["hook"]["timeout"].as_u64().unwrap() > 0,
            "runc-style hooks need a timeout"
        );
    }
}
