//! The GPUs this node may hand out, and what they are doing.
//!
//! NVML (`nvml-wrapper`, loaded at run time from `arbiter.nvml_library`) when it
//! loads and reports GPUs; otherwise the configuration's declared devices. Both
//! sit behind `GpuBackend`, so placement and the watchdog are tested without a
//! driver, and the simulated GPU's own `libnvidia-ml.so.1` exercises the real
//! NVML path.
//!
//! A GPU gpushare cannot share is set aside at inventory ([`survey`]): compute mode
//! EXCLUSIVE_PROCESS (one context in the whole system: the second container's CUDA
//! fails to create one) or PROHIBITED (no context at all), MIG enabled (the GPU
//! runs no CUDA work itself; its instances are separate devices with their own
//! UUIDs), or a running MPS control daemon (clients then share one MPS server
//! context, outside the per-process accounting and gating gpushare relies on). Each
//! breaks sharing silently, so such a GPU gets no leases, is listed with its reason
//! in status, and a request that names it is refused with what to change.

use std::collections::VecDeque;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpushare_config::ArbiterConfig;
use gpushare_proto::GpuSelector;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// NVML's total: the physical memory, more than CUDA can ever allocate.
    pub memory_total: u64,
    /// What CUDA can allocate on it, shared out as quotas ([`allocatable`]).
    pub memory_allocatable: u64,
}

/// What CUDA can allocate on a GPU of `total` bytes (NVML's total), of which the driver and
/// firmware reserve `reserved` (`nvmlDeviceGetMemoryInfo_v2`; None where NVML does not report
/// it, drivers before R510: then `fallback_fraction` of the total stands in for it).
///
/// NVML's total is the physical memory; the reserved part never reaches `cuMemAlloc` (an
/// H100 80GB shows 81,559 MiB in NVML and about 81,008 MiB in `cuMemGetInfo`). Packing
/// quotas up to the total would leave the last process of a full GPU a driver
/// out-of-memory below its quota.
pub fn allocatable(total: u64, reserved: Option<u64>, fallback_fraction: f64) -> u64 {
    let reserved = reserved
        .unwrap_or_else(|| (total as f64 * fallback_fraction.clamp(0.0, 1.0)).ceil() as u64);
    total.saturating_sub(reserved)
}

/// One reading of a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSample {
    /// 0–1 over the driver's last sampling period.
    pub utilization: f64,
    pub memory_used: u64,
}

/// A process NVML sees on a GPU (host pid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    /// None when the driver cannot tell.
    pub memory_used: Option<u64>,
}

/// What one process did on a GPU over the driver's sampling periods since a timestamp
/// (`nvmlDeviceGetProcessUtilization`: one sample per process that was busy at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessUtilization {
    pub pid: u32,
    /// When its latest sample was taken: wall-clock microseconds (the driver's CPU
    /// timestamp), what the next query passes as "since".
    pub timestamp_us: u64,
    /// Percent of the covered periods its kernels ran (`smUtil`).
    pub sm_percent: u32,
    /// Percent of the covered periods it used the memory (copies, memsets: `memUtil`).
    pub memory_percent: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error("arbiter.shared_gpus names {0:?}, which is not a GPU of this node")]
    UnknownSharedGpu(String),
    #[error("NVML: {what}: {message}")]
    Nvml { what: String, message: String },
}

/// What the arbiter needs from the driver.
pub trait GpuBackend: Send + Sync {
    /// "nvml" or "declared".
    fn source(&self) -> &'static str;
    /// Every GPU of the node, in index order.
    fn gpus(&self) -> Vec<Gpu>;
    /// `nvmlSystemGetCudaDriverVersion`: 12040 for CUDA 12.4.
    fn cuda_driver_version(&self) -> Option<u32>;
    /// None when this backend cannot measure (declared devices).
    fn sample(&self, uuid: &str) -> Result<Option<GpuSample>, InventoryError>;
    /// None when this backend cannot see processes (declared devices).
    fn processes(&self, uuid: &str) -> Result<Option<Vec<GpuProcess>>, InventoryError>;
    /// The modes that decide whether the GPU can be shared; unknown (the default)
    /// where this backend cannot tell.
    fn modes(&self, _uuid: &str) -> GpuModes {
        GpuModes::default()
    }
    /// Per-process GPU utilisation over the sampling periods after `since_us`
    /// (wall-clock µs; 0: everything the driver keeps): only processes that were busy
    /// at all are listed. None (the default) where this backend cannot measure it.
    fn process_utilization(
        &self,
        _uuid: &str,
        _since_us: u64,
    ) -> Result<Option<Vec<ProcessUtilization>>, InventoryError> {
        Ok(None)
    }
    /// Why the declared devices stand in for NVML (it is not configured, does not
    /// load, or reports no GPU); None for NVML itself or when nothing fell back.
    fn fallback_reason(&self) -> Option<&str> {
        None
    }
}

// ----- can a GPU be shared? -----

/// `nvmlComputeMode_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeMode {
    Default,
    /// Removed from current drivers; one context used by one thread.
    ExclusiveThread,
    Prohibited,
    ExclusiveProcess,
}

impl ComputeMode {
    /// As `nvidia-smi` names it.
    pub fn name(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveThread => "EXCLUSIVE_THREAD",
            ComputeMode::Prohibited => "PROHIBITED",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

/// What the driver says about one GPU; None: it could not tell (declared devices,
/// a driver without the call, NOT_SUPPORTED — MIG on GPUs that have no MIG).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuModes {
    pub compute_mode: Option<ComputeMode>,
    /// MIG mode currently enabled (not the mode pending a reset).
    pub mig_enabled: Option<bool>,
}

/// Why a GPU cannot be shared; the text names what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unshareable {
    ComputeMode(ComputeMode),
    Mig,
    /// `evidence`: what showed that MPS runs.
    Mps {
        evidence: String,
    },
}

impl fmt::Display for Unshareable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unshareable::ComputeMode(mode) => write!(
                f,
                "it is in compute mode {}; set it to DEFAULT with `nvidia-smi -i <uuid> -c DEFAULT`",
                mode.name()
            ),
            Unshareable::Mig => write!(
                f,
                "MIG mode is enabled (its MIG instances are separate devices gpushare does not share); disable it with `nvidia-smi -i <uuid> -mig 0`"
            ),
            Unshareable::Mps { evidence } => write!(
                f,
                "an MPS control daemon is running ({evidence}); stop it with `echo quit | nvidia-cuda-mps-control` (gpushare shares the GPU itself)"
            ),
        }
    }
}

/// Whether a GPU can be shared: every reason it cannot, none when it can. Unknown
/// modes count as shareable: refusing a GPU on a guess would be worse than the
/// silent failure this check exists to catch.
pub fn shareability(modes: &GpuModes, mps: Option<&str>) -> Vec<Unshareable> {
    let mut reasons = Vec::new();
    match modes.compute_mode {
        None | Some(ComputeMode::Default) => {}
        Some(mode) => reasons.push(Unshareable::ComputeMode(mode)),
    }
    if modes.mig_enabled == Some(true) {
        reasons.push(Unshareable::Mig);
    }
    if let Some(evidence) = mps {
        reasons.push(Unshareable::Mps {
            evidence: evidence.to_owned(),
        });
    }
    reasons
}

/// Whether an MPS control daemon runs on this node (the I/O behind [`shareability`]).
pub trait MpsProbe {
    /// What shows that it runs (a process, its pipe), or None.
    fn running(&self) -> Option<String>;
}

/// MPS processes in `/proc`, or the control pipe in `CUDA_MPS_PIPE_DIRECTORY`
/// (default `/tmp/nvidia-mps`): the pipe is what clients connect through, and it
/// is the only sign visible from an arbiter that does not share the host's pid
/// namespace.
pub struct HostMps {
    pub proc_root: PathBuf,
    pub pipe_dir: PathBuf,
}

/// The `comm` of both MPS processes, the control daemon (`nvidia-cuda-mps-control`)
/// and the server it starts (`nvidia-cuda-mps-server`): the kernel keeps 15 bytes.
const MPS_COMM: &str = "nvidia-cuda-mps";

impl HostMps {
    /// The pipe directory is read from the arbiter's own environment, as the MPS
    /// tools themselves do.
    pub fn from_env() -> HostMps {
        HostMps {
            proc_root: PathBuf::from("/proc"),
            pipe_dir: std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/tmp/nvidia-mps")),
        }
    }

    fn process(&self) -> Option<String> {
        let entries = std::fs::read_dir(&self.proc_root).ok()?;
        entries.flatten().find_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let comm = std::fs::read_to_string(entry.path().join("comm")).ok()?;
            if comm.trim_end() != MPS_COMM {
                return None;
            }
            // The full name, when the command line still has it.
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let argv0 = cmdline.split(|&b| b == 0).next().unwrap_or_default();
            let name = std::str::from_utf8(argv0)
                .ok()
                .and_then(|a| Path::new(a).file_name()?.to_str())
                .filter(|n| n.starts_with(MPS_COMM))
                .unwrap_or(MPS_COMM)
                .to_owned();
            Some(format!("process {name}, pid {pid}"))
        })
    }

    fn pipe(&self) -> Option<String> {
        use std::os::unix::fs::FileTypeExt;
        let control = self.pipe_dir.join("control");
        let meta = std::fs::symlink_metadata(&control).ok()?;
        meta.file_type()
            .is_fifo()
            .then(|| format!("its control pipe {} exists", control.display()))
    }
}

impl MpsProbe for HostMps {
    fn running(&self) -> Option<String> {
        self.process().or_else(|| self.pipe())
    }
}

/// A GPU set aside at inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnshareableGpu {
    pub gpu: Gpu,
    pub reasons: Vec<Unshareable>,
}

impl UnshareableGpu {
    /// "GPU 1 (GPU-…) cannot be shared: it is in compute mode …; set it …", with the
    /// GPU's UUID in the commands.
    pub fn describe(&self) -> String {
        format!(
            "GPU {} ({}) cannot be shared: {}; then restart gpushare-arbiter",
            self.gpu.index,
            self.gpu.uuid,
            self.reason()
        )
    }

    /// The reasons, with the GPU's UUID in the commands.
    pub fn reason(&self) -> String {
        self.reasons
            .iter()
            .map(|r| r.to_string().replace("<uuid>", &self.gpu.uuid))
            .collect::<Vec<_>>()
            .join("; and ")
    }

    pub fn status(&self) -> gpushare_proto::UnshareableGpuStatus {
        gpushare_proto::UnshareableGpuStatus {
            index: self.gpu.index,
            uuid: self.gpu.uuid.clone(),
            name: self.gpu.name.clone(),
            memory_total: self.gpu.memory_total,
            reason: self.reason(),
        }
    }
}

/// The node's GPUs after `arbiter.shared_gpus` and the shareability check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survey {
    pub shareable: Vec<Gpu>,
    pub unshareable: Vec<UnshareableGpu>,
}

/// Narrows to `shared` and sets aside the GPUs that cannot be shared.
pub fn survey(
    backend: &dyn GpuBackend,
    shared: &[String],
    mps: &dyn MpsProbe,
) -> Result<Survey, InventoryError> {
    let gpus = narrow_to_shared(backend.gpus(), shared)?;
    let mps = mps.running();
    let mut survey = Survey {
        shareable: Vec::new(),
        unshareable: Vec::new(),
    };
    for gpu in gpus {
        let reasons = shareability(&backend.modes(&gpu.uuid), mps.as_deref());
        if reasons.is_empty() {
            survey.shareable.push(gpu);
        } else {
            survey.unshareable.push(UnshareableGpu { gpu, reasons });
        }
    }
    Ok(survey)
}

/// Why a request for `selector` is refused because of GPUs that cannot be shared:
/// it names one of them, or asks for more GPUs than can be shared. None: placement
/// decides as usual.
pub fn refusal(
    selector: &GpuSelector,
    shareable: &[Gpu],
    unshareable: &[UnshareableGpu],
) -> Option<String> {
    let named = |hit: &dyn Fn(&Gpu) -> bool| {
        unshareable
            .iter()
            .find(|u| hit(&u.gpu))
            .map(|u| format!("gpu {selector}: {}", u.describe()))
    };
    match selector {
        GpuSelector::Index(indices) => named(&|g| indices.contains(&g.index)),
        GpuSelector::Uuid(uuids) => named(&|g| uuids.contains(&g.uuid)),
        GpuSelector::Count(n) if (*n as usize) > shareable.len() && !unshareable.is_empty() => {
            Some(format!(
                "gpu {selector}: only {} GPU(s) on this node can be shared; {}",
                shareable.len(),
                unshareable
                    .iter()
                    .map(UnshareableGpu::describe)
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        }
        GpuSelector::Count(_) => None,
    }
}

/// The configuration's devices: no measurements, no processes.
pub struct DeclaredBackend {
    gpus: Vec<Gpu>,
    /// Why these stand in for NVML ([`GpuBackend::fallback_reason`]).
    fallback_reason: Option<String>,
}

impl DeclaredBackend {
    pub fn new(config: &ArbiterConfig) -> Self {
        DeclaredBackend {
            gpus: config
                .devices
                .iter()
                .enumerate()
                // A declared GPU's memory is what CUDA can allocate on it: nothing
                // measures a reserve there.
                .map(|(i, d)| Gpu {
                    index: i as u32,
                    uuid: d.uuid.clone(),
                    name: d.name.clone(),
                    memory_total: d.memory.0,
                    memory_allocatable: d.memory.0,
                })
                .collect(),
            fallback_reason: None,
        }
    }

    /// The declared devices, standing in for NVML because of `why`.
    pub fn instead_of_nvml(config: &ArbiterConfig, why: String) -> Self {
        DeclaredBackend {
            fallback_reason: Some(why),
            ..DeclaredBackend::new(config)
        }
    }
}

impl GpuBackend for DeclaredBackend {
    fn source(&self) -> &'static str {
        "declared"
    }
    fn gpus(&self) -> Vec<Gpu> {
        self.gpus.clone()
    }
    fn cuda_driver_version(&self) -> Option<u32> {
        None
    }
    fn sample(&self, _uuid: &str) -> Result<Option<GpuSample>, InventoryError> {
        Ok(None)
    }
    fn processes(&self, _uuid: &str) -> Result<Option<Vec<GpuProcess>>, InventoryError> {
        Ok(None)
    }
    fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }
}

/// The real driver (or the simulated GPU's NVML).
pub struct NvmlBackend {
    nvml: nvml_wrapper::Nvml,
    gpus: Vec<Gpu>,
    cuda_driver_version: Option<u32>,
}

fn nvml_err(
    what: impl Into<String>,
) -> impl FnOnce(nvml_wrapper::error::NvmlError) -> InventoryError {
    let what = what.into();
    move |e| InventoryError::Nvml {
        what,
        message: e.to_string(),
    }
}

/// nvml.h's NVML_ERROR_ARGUMENT_VERSION_MISMATCH: a driver that knows the call but not the
/// struct version nvml-wrapper asks for (nvml-wrapper has no name for it).
const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: u32 = 25;

/// A GPU's (total, reserved) memory: `nvmlDeviceGetMemoryInfo_v2` (what `memory_info`
/// calls), or the original call on drivers without it, which folds the reserved part into
/// `used` and so cannot tell it (None).
fn memory_report(
    nvml: &nvml_wrapper::Nvml,
    device: &nvml_wrapper::Device<'_>,
) -> Result<(u64, Option<u64>), nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::error::NvmlError;
    match device.memory_info() {
        Ok(m) => Ok((m.total, Some(m.reserved))),
        Err(
            NvmlError::FailedToLoadSymbol(_)
            | NvmlError::FunctionNotFound
            | NvmlError::NotSupported
            | NvmlError::UnexpectedVariant(NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
        ) => {
            let v1 = nvml
                .lib()
                .nvmlDeviceGetMemoryInfo
                .as_ref()
                .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
            // nvmlMemory_t (three integers), typed by the call below.
            let mut memory = std::mem::MaybeUninit::zeroed();
            // SAFETY: the driver's nvmlDeviceGetMemoryInfo (nvml.h: a device handle and an
            // nvmlMemory_t to fill), given the handle of a device of this same, live
            // library and a zeroed, writable nvmlMemory_t.
            let rc = unsafe { v1(device.handle(), memory.as_mut_ptr()) };
            nvml_wrapper::error::nvml_try(rc)?;
            // SAFETY: zeroed integers are a valid nvmlMemory_t, and the driver filled it.
            let memory = unsafe { memory.assume_init() };
            Ok((memory.total, None))
        }
        Err(e) => Err(e),
    }
}

impl NvmlBackend {
    /// Loads `library` and lists its GPUs; where the driver does not report the memory it
    /// reserves, `reserved_fallback` of each GPU's total is taken as reserved.
    pub fn load(library: &str, reserved_fallback: f64) -> Result<Self, InventoryError> {
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new(library))
            .init()
            .map_err(nvml_err(format!("loading {library}")))?;
        let count = nvml.device_count().map_err(nvml_err("device count"))?;
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = nvml
                .device_by_index(index)
                .map_err(nvml_err(format!("GPU {index}")))?;
            let (total, reserved) =
                memory_report(&nvml, &device).map_err(nvml_err(format!("GPU {index} memory")))?;
            let uuid = device
                .uuid()
                .map_err(nvml_err(format!("GPU {index} UUID")))?;
            if reserved.is_none() {
                tracing::warn!(uuid, total, fraction = reserved_fallback, "NVML does not report the memory the driver reserves (no nvmlDeviceGetMemoryInfo_v2): arbiter.driver_reserved_fraction of the total is taken as reserved");
            }
            gpus.push(Gpu {
                index,
                uuid,
                name: device.name().unwrap_or_else(|_| "NVIDIA GPU".into()),
                memory_total: total,
                memory_allocatable: allocatable(total, reserved, reserved_fallback),
            });
        }
        let cuda_driver_version = nvml
            .sys_cuda_driver_version()
            .ok()
            .and_then(|v| u32::try_from(v).ok());
        Ok(NvmlBackend {
            nvml,
            gpus,
            cuda_driver_version,
        })
    }

    fn device(&self, uuid: &str) -> Result<nvml_wrapper::Device<'_>, InventoryError> {
        self.nvml
            .device_by_uuid(uuid)
            .map_err(nvml_err(format!("GPU {uuid}")))
    }
}

impl GpuBackend for NvmlBackend {
    fn source(&self) -> &'static str {
        "nvml"
    }
    fn gpus(&self) -> Vec<Gpu> {
        self.gpus.clone()
    }
    fn cuda_driver_version(&self) -> Option<u32> {
        self.cuda_driver_version
    }
    fn sample(&self, uuid: &str) -> Result<Option<GpuSample>, InventoryError> {
        let device = self.device(uuid)?;
        let utilization = device
            .utilization_rates()
            .map_err(nvml_err(format!("GPU {uuid} utilisation")))?;
        let memory = device
            .memory_info()
            .map_err(nvml_err(format!("GPU {uuid} memory")))?;
        Ok(Some(GpuSample {
            utilization: f64::from(utilization.gpu.min(100)) / 100.0,
            memory_used: memory.used,
        }))
    }
    fn modes(&self, uuid: &str) -> GpuModes {
        use nvml_wrapper::enum_wrappers::device::ComputeMode as Nvml;
        let Ok(device) = self.device(uuid) else {
            return GpuModes::default();
        };
        let compute_mode = match device.compute_mode() {
            Ok(Nvml::Default) => Some(ComputeMode::Default),
            Ok(Nvml::ExclusiveThread) => Some(ComputeMode::ExclusiveThread),
            Ok(Nvml::Prohibited) => Some(ComputeMode::Prohibited),
            Ok(Nvml::ExclusiveProcess) => Some(ComputeMode::ExclusiveProcess),
            Err(e) => {
                tracing::debug!(uuid, error = %e, "compute mode unknown");
                None
            }
        };
        // NVML_DEVICE_MIG_ENABLE = 1; GPUs without MIG answer NOT_SUPPORTED.
        let mig_enabled = match device.mig_mode() {
            Ok(mode) => Some(mode.current == 1),
            Err(e) => {
                tracing::debug!(uuid, error = %e, "MIG mode unknown");
                None
            }
        };
        GpuModes {
            compute_mode,
            mig_enabled,
        }
    }
    fn processes(&self, uuid: &str) -> Result<Option<Vec<GpuProcess>>, InventoryError> {
        let device = self.device(uuid)?;
        let processes = device
            .running_compute_processes()
            .map_err(nvml_err(format!("GPU {uuid} processes")))?;
        Ok(Some(
            processes
                .into_iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    memory_used: match p.used_gpu_memory {
                        nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                        nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect(),
        ))
    }
    fn process_utilization(
        &self,
        uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessUtilization>>, InventoryError> {
        self.utilization_samples(uuid, since_us)
            .map_err(nvml_err(format!("GPU {uuid} process utilisation")))
    }
}

impl NvmlBackend {
    fn utilization_samples(
        &self,
        uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessUtilization>>, nvml_wrapper::error::NvmlError> {
        use nvml_wrapper::error::NvmlError;
        let device = self.nvml.device_by_uuid(uuid)?;
        // A process that became busy between the size query and the read makes the
        // driver answer INSUFFICIENT_SIZE: ask once more.
        let mut samples = device.process_utilization_stats(since_us);
        if let Err(NvmlError::InsufficientSize(_)) = samples {
            samples = device.process_utilization_stats(since_us);
        }
        match samples {
            Ok(samples) => Ok(Some(
                samples
                    .into_iter()
                    .map(|s| ProcessUtilization {
                        pid: s.pid,
                        timestamp_us: s.timestamp,
                        sm_percent: s.sm_util.min(100),
                        memory_percent: s.mem_util.min(100),
                    })
                    .collect(),
            )),
            // The driver's answer when nobody was busy since `since_us`.
            Err(NvmlError::NotFound) => Ok(Some(Vec::new())),
            // An old driver or a GPU without per-process sampling.
            Err(
                NvmlError::NotSupported
                | NvmlError::FunctionNotFound
                | NvmlError::FailedToLoadSymbol(_),
            ) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// NVML when configured and it loads with at least one GPU; otherwise the declared devices.
pub fn open_backend(config: &ArbiterConfig) -> Box<dyn GpuBackend> {
    if config.nvml_library.is_empty() {
        tracing::info!("arbiter.nvml_library is empty: using the declared devices");
        return Box::new(DeclaredBackend::instead_of_nvml(
            config,
            "arbiter.nvml_library is empty (no driver is asked)".into(),
        ));
    }
    match NvmlBackend::load(&config.nvml_library, config.driver_reserved_fraction) {
        Ok(nvml) if !nvml.gpus.is_empty() => {
            tracing::info!(library = %config.nvml_library, gpus = nvml.gpus.len(), cuda_driver_version = ?nvml.cuda_driver_version, "NVML loaded");
            Box::new(nvml)
        }
        Ok(_) => {
            tracing::warn!(library = %config.nvml_library, declared = config.devices.len(), "NVML reports no GPUs; using the declared devices");
            Box::new(DeclaredBackend::instead_of_nvml(
                config,
                format!("NVML ({}) reports no GPU", config.nvml_library),
            ))
        }
        Err(e) => {
            tracing::warn!(library = %config.nvml_library, error = %e, declared = config.devices.len(), "NVML cannot be loaded; using the declared devices (no utilisation, no watchdog)");
            Box::new(DeclaredBackend::instead_of_nvml(
                config,
                format!("no usable NVIDIA driver: {e}"),
            ))
        }
    }
}

/// Pure: why this node shares no GPU, for status (else only the log would say); None
/// when it shares one. `source` and `fallback` are the backend's, `declared` the number
/// of `arbiter.devices`.
pub fn no_gpus_reason(
    survey: &Survey,
    source: &str,
    fallback: Option<&str>,
    declared: usize,
) -> Option<String> {
    if !survey.shareable.is_empty() {
        return None;
    }
    if !survey.unshareable.is_empty() {
        return Some(format!(
            "every GPU of this node ({}) is set aside as unshareable: {}",
            survey.unshareable.len(),
            survey
                .unshareable
                .iter()
                .map(|u| format!("GPU {}: {}", u.gpu.index, u.reason()))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Some(match (source, fallback, declared) {
        ("declared", Some(why), 0) => format!("{why}, and arbiter.devices declares none"),
        ("declared", None, 0) => "arbiter.devices declares none".into(),
        (source, _, _) => format!("the inventory ({source}) lists no GPU"),
    })
}

/// `all` narrowed to `shared` (UUIDs) when that list is non-empty; indices are kept.
pub fn narrow_to_shared(all: Vec<Gpu>, shared: &[String]) -> Result<Vec<Gpu>, InventoryError> {
    if shared.is_empty() {
        return Ok(all);
    }
    if let Some(missing) = shared.iter().find(|u| !all.iter().any(|g| &g.uuid == *u)) {
        return Err(InventoryError::UnknownSharedGpu(missing.clone()));
    }
    Ok(all
        .into_iter()
        .filter(|g| shared.contains(&g.uuid))
        .collect())
}

/// Declared devices in order, narrowed to `shared_gpus`.
pub fn from_declared(config: &ArbiterConfig) -> Result<Vec<Gpu>, InventoryError> {
    narrow_to_shared(DeclaredBackend::new(config).gpus(), &config.shared_gpus)
}

/// Utilisation samples of the last `span`; Algorithm 1 looks at the last minute.
#[derive(Debug, Clone)]
pub struct UtilizationWindow {
    span: Duration,
    samples: VecDeque<(Instant, f64)>,
}

impl UtilizationWindow {
    pub const LAST_MINUTE: Duration = Duration::from_secs(60);

    pub fn new(span: Duration) -> Self {
        UtilizationWindow {
            span,
            samples: VecDeque::new(),
        }
    }

    pub fn record(&mut self, now: Instant, utilization: f64) {
        self.samples.push_back((now, utilization.clamp(0.0, 1.0)));
        while let Some(&(t, _)) = self.samples.front() {
            if now.duration_since(t) > self.span {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    /// Mean of the samples within `span` of `now`; None without any.
    pub fn mean(&self, now: Instant) -> Option<f64> {
        let recent: Vec<f64> = self
            .samples
            .iter()
            .filter(|(t, _)| now.duration_since(*t) <= self.span)
            .map(|&(_, u)| u)
            .collect();
        (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64)
    }
}

#[cfg(test)]
mod tests;
