//! The GPUs this node may hand out, and what they are doing.
//!
//! NVML (`nvml-wrapper`, loaded at run time from `arbiter.nvml_library`) when it
//! loads and reports GPUs; otherwise the configuration's declared devices. Both
//! sit behind `GpuBackend`, so placement and the watchdog are tested without a
//! driver, and the simulated GPU's own `libnvidia-ml.so.1` exercises the real
//! NVML path.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gpushare_config::ArbiterConfig;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
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
}

/// The configuration's devices: no measurements, no processes.
pub struct DeclaredBackend {
    gpus: Vec<Gpu>,
}

impl DeclaredBackend {
    pub fn new(config: &ArbiterConfig) -> Self {
        DeclaredBackend {
            gpus: config
                .devices
                .iter()
                .enumerate()
                .map(|(i, d)| Gpu {
                    index: i as u32,
                    uuid: d.uuid.clone(),
                    name: d.name.clone(),
                    memory_total: d.memory.0,
                })
                .collect(),
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

impl NvmlBackend {
    pub fn load(library: &str) -> Result<Self, InventoryError> {
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
            gpus.push(Gpu {
                index,
                uuid: device
                    .uuid()
                    .map_err(nvml_err(format!("GPU {index} UUID")))?,
                name: device.name().unwrap_or_else(|_| "NVIDIA GPU".into()),
                memory_total: device
                    .memory_info()
                    .map_err(nvml_err(format!("GPU {index} memory")))?
                    .total,
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
}

/// NVML when configured and it loads with at least one GPU; otherwise the declared devices.
pub fn open_backend(config: &ArbiterConfig) -> Box<dyn GpuBackend> {
    if config.nvml_library.is_empty() {
        tracing::info!("arbiter.nvml_library is empty: using the declared devices");
        return Box::new(DeclaredBackend::new(config));
    }
    match NvmlBackend::load(&config.nvml_library) {
        Ok(nvml) if !nvml.gpus.is_empty() => {
            tracing::info!(library = %config.nvml_library, gpus = nvml.gpus.len(), cuda_driver_version = ?nvml.cuda_driver_version, "NVML loaded");
            Box::new(nvml)
        }
        Ok(_) => {
            tracing::warn!(library = %config.nvml_library, declared = config.devices.len(), "NVML reports no GPUs; using the declared devices");
            Box::new(DeclaredBackend::new(config))
        }
        Err(e) => {
            tracing::warn!(library = %config.nvml_library, error = %e, declared = config.devices.len(), "NVML cannot be loaded; using the declared devices (no utilisation, no watchdog)");
            Box::new(DeclaredBackend::new(config))
        }
    }
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
mod tests {
    use super::*;
    use gpushare_config::DeclaredDevice;
    use gpushare_proto::ByteSize;

    fn config(shared: &[&str]) -> ArbiterConfig {
        ArbiterConfig {
            devices: ["GPU-a", "GPU-b"]
                .iter()
                .map(|u| DeclaredDevice {
                    uuid: u.to_string(),
                    name: "x".into(),
                    memory: ByteSize(1 << 30),
                })
                .collect(),
            shared_gpus: shared.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn all_devices_when_no_shared_list() {
        let gpus = from_declared(&config(&[])).unwrap();
        assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn shared_list_narrows_and_keeps_indices() {
        let gpus = from_declared(&config(&["GPU-b"])).unwrap();
        assert_eq!(gpus.len(), 1);
        assert_eq!((gpus[0].index, gpus[0].uuid.as_str()), (1, "GPU-b"));
        assert_eq!(
            from_declared(&config(&["GPU-z"])),
            Err(InventoryError::UnknownSharedGpu("GPU-z".into()))
        );
    }

    #[test]
    fn unloadable_nvml_falls_back_to_declared_devices() {
        let mut c = config(&[]);
        c.nvml_library = "/nonexistent/libnvidia-ml.so.1".into();
        let backend = open_backend(&c);
        assert_eq!(backend.source(), "declared");
        assert_eq!(backend.gpus().len(), 2);
        assert_eq!(backend.cuda_driver_version(), None);
        assert_eq!(backend.sample("GPU-a"), Ok(None));
        let err = NvmlBackend::load("/nonexistent/libnvidia-ml.so.1")
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
            "{err}"
        );
    }

    #[test]
    fn utilization_is_the_mean_of_the_last_minute() {
        let t = Instant::now();
        let mut w = UtilizationWindow::new(UtilizationWindow::LAST_MINUTE);
        assert_eq!(w.mean(t), None);
        w.record(t, 1.0);
        for s in 1..=60 {
            w.record(t + Duration::from_secs(s), 0.0);
        }
        // At t+60 the first sample is exactly a minute old and still counts.
        let mean = w.mean(t + Duration::from_secs(60)).unwrap();
        assert!((mean - 1.0 / 61.0).abs() < 1e-9, "{mean}");
        w.record(t + Duration::from_secs(61), 0.0);
        assert_eq!(w.mean(t + Duration::from_secs(61)), Some(0.0));
        assert_eq!(
            w.mean(t + Duration::from_secs(200)),
            None,
            "stale samples do not count"
        );
        w.record(t + Duration::from_secs(300), 7.0);
        assert_eq!(w.mean(t + Duration::from_secs(300)), Some(1.0), "clamped");
    }
}
