//! `libnvidia-ml.so.1` of the simulated GPU: device identity, memory, utilisation and the
//! per-process usage (with host pids) from the same shared model `libcuda.so.1` drives.
//!
//! Only the functions the project uses (through the `nvml-wrapper` crate) exist; `nvml-wrapper`
//! loads each symbol lazily, so the rest simply report "function not found" there.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use libc::{c_char, c_int, c_uint};
use simgpu_model::pidns::resolve_pid;
use simgpu_model::{Device, SimConfig};
use std::ffi::CStr;
use std::sync::{Mutex, MutexGuard};

pub type NvmlReturn = c_int;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlDevice_t`: a tagged GPU index, never dereferenced.
pub type NvmlDevice = usize;
const DEVICE_TAG: usize = 0x5147_0000;

#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`.
pub const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<NvmlMemoryV2>() as c_uint) | (2 << 24);

#[repr(C)]
pub struct NvmlUtilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlProcessInfo_t` of the `_v2`/`_v3` calls.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_v1_t` of the original call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessInfoV1 {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessUtilizationSample_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlProcessUtilizationSample {
    pub pid: c_uint,
    /// CPU timestamp in microseconds (wall clock) of the latest sample it was busy in.
    pub time_stamp: u64,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

/// Not a MIG instance.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

struct Library {
    device: Device,
    modes: Modes,
    init_count: u32,
}

/// `nvmlComputeMode_t`.
pub const NVML_COMPUTEMODE_DEFAULT: c_int = 0;
pub const NVML_COMPUTEMODE_EXCLUSIVE_THREAD: c_int = 1;
pub const NVML_COMPUTEMODE_PROHIBITED: c_int = 2;
pub const NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: c_int = 3;
/// `NVML_DEVICE_MIG_DISABLE` / `NVML_DEVICE_MIG_ENABLE`.
pub const NVML_DEVICE_MIG_DISABLE: c_uint = 0;
pub const NVML_DEVICE_MIG_ENABLE: c_uint = 1;

/// Device modes the real driver would report, from the environment read at `nvmlInit`
/// (so a test can present a GPU gpushare must not share):
/// `SIMGPU_COMPUTE_MODE="1:exclusive_process,2:prohibited"` (GPU index: mode; every
/// other GPU is `default`) and `SIMGPU_MIG="0,3"` (GPUs with MIG enabled; the others
/// report it disabled, like a MIG-capable GPU).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modes {
    compute: Vec<(u32, c_int)>,
    mig: Vec<u32>,
}

const COMPUTE_MODES: [(&str, c_int); 4] = [
    ("default", NVML_COMPUTEMODE_DEFAULT),
    ("exclusive_thread", NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
    ("prohibited", NVML_COMPUTEMODE_PROHIBITED),
    ("exclusive_process", NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
];

impl Modes {
    /// `compute`/`mig`: the variables' values (None or empty: unset). An error names
    /// the variable, its value and what is accepted.
    pub fn parse(compute: Option<&str>, mig: Option<&str>, gpus: u32) -> Result<Modes, String> {
        let index = |var: &str, value: &str, text: &str| -> Result<u32, String> {
            match text.trim().parse::<u32>() {
                Ok(i) if i < gpus => Ok(i),
                _ => Err(format!(
                    "{var}={value:?}: {text:?} is not a GPU index (0 to {}, SIMGPU_GPUS={gpus})",
                    gpus.saturating_sub(1)
                )),
            }
        };
        let mut modes = Modes::default();
        let compute = compute.unwrap_or_default();
        for item in compute.split(',').filter(|i| !i.trim().is_empty()) {
            let accepted = "expected GPU:MODE pairs separated by commas, MODE one of default, exclusive_thread, prohibited, exclusive_process (e.g. \"1:exclusive_process\")";
            let (gpu, mode) = item
                .split_once(':')
                .ok_or_else(|| format!("SIMGPU_COMPUTE_MODE={compute:?}: {accepted}"))?;
            let gpu = index("SIMGPU_COMPUTE_MODE", compute, gpu)?;
            let (_, mode) = COMPUTE_MODES
                .iter()
                .find(|(name, _)| *name == mode.trim())
                .ok_or_else(|| {
                    format!("SIMGPU_COMPUTE_MODE={compute:?}: mode {mode:?}: {accepted}")
                })?;
            modes.compute.push((gpu, *mode));
        }
        let mig = mig.unwrap_or_default();
        for item in mig.split(',').filter(|i| !i.trim().is_empty()) {
            modes.mig.push(index("SIMGPU_MIG", mig, item)?);
        }
        Ok(modes)
    }

    fn from_env(gpus: u32) -> Result<Modes, String> {
        let compute = std::env::var("SIMGPU_COMPUTE_MODE").ok();
        let mig = std::env::var("SIMGPU_MIG").ok();
        Modes::parse(compute.as_deref(), mig.as_deref(), gpus)
    }

    pub fn compute_mode(&self, gpu: u32) -> c_int {
        self.compute
            .iter()
            .rev()
            .find(|(g, _)| *g == gpu)
            .map_or(NVML_COMPUTEMODE_DEFAULT, |(_, m)| *m)
    }

    pub fn mig(&self, gpu: u32) -> c_uint {
        if self.mig.contains(&gpu) {
            NVML_DEVICE_MIG_ENABLE
        } else {
            NVML_DEVICE_MIG_DISABLE
        }
    }
}

/// The attached model while initialised. Dropped at the last `nvmlShutdown`, so a later
/// `nvmlInit` reads `SIMGPU_DIR` again.
static LIBRARY: Mutex<Option<Library>> = Mutex::new(None);

fn library() -> MutexGuard<'static, Option<Library>> {
    LIBRARY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs an export's body; a panic becomes NVML_ERROR_UNKNOWN instead of unwinding into C.
fn guard(body: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

fn with_device<T>(f: impl FnOnce(&Device) -> Result<T, NvmlReturn>) -> Result<T, NvmlReturn> {
    let lib = library();
    let lib = lib.as_ref().ok_or(NVML_ERROR_UNINITIALIZED)?;
    f(&lib.device)
}

fn gpu_of(device: NvmlDevice, d: &Device) -> Result<u32, NvmlReturn> {
    let index = device
        .checked_sub(DEVICE_TAG)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)?;
    u32::try_from(index)
        .ok()
        .filter(|i| *i < d.config().gpus)
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

/// # Safety
/// `ptr` must be NULL or valid for a write of `T`.
unsafe fn write_out<T>(ptr: *mut T, value: T) -> Result<(), NvmlReturn> {
    if ptr.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid per the contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// # Safety
/// `buf` must be valid for `len` bytes.
unsafe fn write_string(buf: *mut c_char, len: c_uint, text: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (len as usize) < text.len() + 1 {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds len >= text.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(())
}

/// The driver branch matching the simulated CUDA version (12.8 ships with 570).
fn driver_version_string(cuda_version: i64) -> String {
    let branch = match cuda_version {
        v if v >= 13000 => 580,
        v if v >= 12080 => 570,
        v if v >= 12040 => 550,
        _ => 535,
    };
    format!("{branch}.0.0")
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    nvmlInitWithFlags(0)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    nvmlInitWithFlags(0)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    guard(|| {
        let mut lib = library();
        match lib.as_mut() {
            Some(l) => l.init_count += 1,
            None => {
                let config = SimConfig::from_env().map_err(|_| NVML_ERROR_DRIVER_NOT_LOADED)?;
                // A wrong mode variable is a broken test setup: say so, and load nothing.
                let modes = Modes::from_env(config.gpus).map_err(|message| {
                    eprintln!("simgpu libnvidia-ml: {message}");
                    NVML_ERROR_DRIVER_NOT_LOADED
                })?;
                let device = Device::open(&config).map_err(|_| NVML_ERROR_DRIVER_NOT_LOADED)?;
                *lib = Some(Library {
                    device,
                    modes,
                    init_count: 1,
                });
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    guard(|| {
        let mut lib = library();
        let l = lib.as_mut().ok_or(NVML_ERROR_UNINITIALIZED)?;
        l.init_count -= 1;
        if l.init_count == 0 {
            *lib = None;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let text: &'static [u8] = match result {
        NVML_SUCCESS => b"Success\0",
        NVML_ERROR_UNINITIALIZED => b"Uninitialized\0",
        NVML_ERROR_INVALID_ARGUMENT => b"Invalid Argument\0",
        NVML_ERROR_NOT_FOUND => b"Not Found\0",
        NVML_ERROR_INSUFFICIENT_SIZE => b"Insufficient Size\0",
        NVML_ERROR_DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH => b"Argument Version Mismatch\0",
        _ => b"Unknown Error\0",
    };
    text.as_ptr() as *const c_char
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    guard(|| {
        let text = with_device(|d| Ok(driver_version_string(d.config().cuda_version)))?;
        // SAFETY: caller buffer of `len` bytes.
        unsafe { write_string(version, len, &text) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, len: c_uint) -> NvmlReturn {
    guard(|| {
        let text = with_device(|d| {
            Ok(format!(
                "12.{}",
                driver_version_string(d.config().cuda_version)
            ))
        })?;
        // SAFETY: caller buffer of `len` bytes.
        unsafe { write_string(version, len, &text) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> NvmlReturn {
    guard(|| {
        let v = with_device(|d| Ok(d.config().cuda_version as c_int))?;
        // SAFETY: out-parameter.
        unsafe { write_out(version, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlSystemGetCudaDriverVersion(version) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let n = with_device(|d| Ok(d.config().gpus))?;
        // SAFETY: out-parameter.
        unsafe { write_out(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    guard(|| {
        let handle = with_device(|d| {
            gpu_of(DEVICE_TAG + index as usize, d).map(|g| DEVICE_TAG + g as usize)
        })?;
        // SAFETY: out-parameter.
        unsafe { write_out(device, handle) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    guard(|| {
        if uuid.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: NUL-terminated string per the API contract.
        let wanted = unsafe { CStr::from_ptr(uuid) }
            .to_str()
            .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)?;
        let gpus = with_device(|d| Ok(d.config().gpus))?;
        let gpu = (0..gpus)
            .find(|i| simgpu_model::gpu_uuid(*i) == wanted)
            .ok_or(NVML_ERROR_NOT_FOUND)?;
        // SAFETY: out-parameter.
        unsafe { write_out(device, DEVICE_TAG + gpu as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    guard(|| {
        let gpu = with_device(|d| gpu_of(device, d))?;
        // SAFETY: out-parameter.
        unsafe { write_out(index, gpu) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: NvmlDevice,
    uuid: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    guard(|| {
        let gpu = with_device(|d| gpu_of(device, d))?;
        // SAFETY: caller buffer of `len` bytes.
        unsafe { write_string(uuid, len, &simgpu_model::gpu_uuid(gpu)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: NvmlDevice,
    name: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    guard(|| {
        with_device(|d| gpu_of(device, d))?;
        // SAFETY: caller buffer of `len` bytes.
        unsafe { write_string(name, len, "NVIDIA Simulated GPU (simgpu)") }
    })
}

fn modes<T>(device: NvmlDevice, read: impl FnOnce(&Modes, u32) -> T) -> Result<T, NvmlReturn> {
    let lib = library();
    let lib = lib.as_ref().ok_or(NVML_ERROR_UNINITIALIZED)?;
    let gpu = gpu_of(device, &lib.device)?;
    Ok(read(&lib.modes, gpu))
}

/// `SIMGPU_COMPUTE_MODE`; `default` unless set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: NvmlDevice,
    mode: *mut c_int,
) -> NvmlReturn {
    guard(|| {
        let m = modes(device, |m, gpu| m.compute_mode(gpu))?;
        // SAFETY: out-parameter.
        unsafe { write_out(mode, m) }
    })
}

/// `SIMGPU_MIG`; the pending mode is the current one (no reset pending).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: NvmlDevice,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    guard(|| {
        let m = modes(device, |m, gpu| m.mig(gpu))?;
        // SAFETY: out-parameters.
        unsafe {
            write_out(current, m)?;
            write_out(pending, m)
        }
    })
}

fn snapshot(device: NvmlDevice) -> Result<simgpu_model::device::GpuSnapshot, NvmlReturn> {
    with_device(|d| {
        let gpu = gpu_of(device, d)?;
        let mut locked = d.lock().map_err(|_| NVML_ERROR_UNKNOWN)?;
        locked.snapshot(gpu).map_err(|_| NVML_ERROR_UNKNOWN)
    })
}

/// NVML's two views of one GPU's memory, as nvml.h defines them: v1's `used` is the "sum of
/// reserved and allocated" memory; v2 reports the reserved part on its own and `used` without it.
/// `free` is the same in both, what nothing holds. `total` is the physical memory in both: more
/// than CUDA can ever allocate (`cuMemGetInfo`'s total leaves out the reserved part).
fn memory_views(s: &simgpu_model::device::GpuSnapshot) -> (NvmlMemory, NvmlMemoryV2) {
    let free = s
        .memory_total
        .saturating_sub(s.memory_reserved)
        .saturating_sub(s.memory_used);
    let v1 = NvmlMemory {
        total: s.memory_total,
        free,
        used: s.memory_reserved + s.memory_used,
    };
    let v2 = NvmlMemoryV2 {
        version: MEMORY_V2_VERSION,
        total: s.memory_total,
        reserved: s.memory_reserved,
        free,
        used: s.memory_used,
    };
    (v1, v2)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    guard(|| {
        let (v1, _) = memory_views(&snapshot(device)?);
        // SAFETY: out-parameter.
        unsafe { write_out(memory, v1) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    guard(|| {
        // Test hook: a driver before R510, which has only the original call.
        if std::env::var_os("SIMGPU_NVML_WITHOUT_MEMORY_V2").is_some() {
            return Err(NVML_ERROR_FUNCTION_NOT_FOUND);
        }
        // SAFETY: a caller-initialised nvmlMemory_v2_t per the API contract (NULL rejected).
        let version = unsafe { memory.as_ref() }
            .ok_or(NVML_ERROR_INVALID_ARGUMENT)?
            .version;
        if version != MEMORY_V2_VERSION {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let (_, v2) = memory_views(&snapshot(device)?);
        // SAFETY: out-parameter.
        unsafe { write_out(memory, v2) }
    })
}

/// GPU utilisation is the model's busy time over the last second; memory-bandwidth
/// utilisation is not modelled and reads 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: NvmlDevice,
    util: *mut NvmlUtilization,
) -> NvmlReturn {
    guard(|| {
        let s = snapshot(device)?;
        // SAFETY: out-parameter.
        unsafe {
            write_out(
                util,
                NvmlUtilization {
                    gpu: s.utilization_percent,
                    memory: 0,
                },
            )
        }
    })
}

/// The processes with a context or memory on `device`, with pids as the caller's namespace
/// sees them (host pids when NVML runs on the host).
fn running_processes(device: NvmlDevice) -> Result<Vec<NvmlProcessInfo>, NvmlReturn> {
    let s = snapshot(device)?;
    Ok(s.processes
        .iter()
        .map(|p| NvmlProcessInfo {
            pid: resolve_pid(p.ns, p.pid).unwrap_or(p.pid),
            used_gpu_memory: p.memory_bytes,
            gpu_instance_id: NO_INSTANCE,
            compute_instance_id: NO_INSTANCE,
        })
        .collect())
}

/// NVML's two-call protocol: too small a buffer (or NULL) reports the needed count with
/// NVML_ERROR_INSUFFICIENT_SIZE.
///
/// # Safety
/// `count` must be valid; `infos` must hold `*count` entries or be NULL.
unsafe fn fill<T>(count: *mut c_uint, infos: *mut T, items: Vec<T>) -> Result<(), NvmlReturn> {
    if count.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: valid per the contract.
    unsafe {
        let room = *count as usize;
        *count = items.len() as c_uint;
        if items.is_empty() {
            return Ok(());
        }
        if infos.is_null() || room < items.len() {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        for (i, item) in items.into_iter().enumerate() {
            infos.add(i).write(item);
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: the caller's buffers per the API contract.
    guard(|| unsafe { fill(count, infos, running_processes(device)?) })
}

/// Same layout as `_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfoV1,
) -> NvmlReturn {
    guard(|| {
        let v1 = running_processes(device)?
            .into_iter()
            .map(|p| NvmlProcessInfoV1 {
                pid: p.pid,
                used_gpu_memory: p.used_gpu_memory,
            })
            .collect();
        // SAFETY: the caller's buffers per the API contract.
        unsafe { fill(count, infos, v1) }
    })
}

/// Nanoseconds to add to the device's time to get the wall clock (CLOCK_REALTIME) now: the
/// model keeps monotonic time (`simgpu_model::clock`, the same in every time namespace, as
/// CLOCK_REALTIME is), NVML's sample timestamps are wall-clock microseconds.
fn wall_offset_ns() -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec we hand it.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    let wall = ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128;
    wall - simgpu_model::now_ns() as i128
}

/// Rounded percent of `part` in `whole`, at most 100.
fn percent(part: u64, whole: u64) -> c_uint {
    if whole == 0 {
        return 0;
    }
    ((part as u128 * 100 + whole as u128 / 2) / whole as u128).min(100) as c_uint
}

/// One sample per process that ran anything on `device` in the sampling periods (the model's
/// 100 ms utilisation buckets) whose timestamps are greater than `last_seen` (µs, wall
/// clock; 0: every period still kept): its utilisation averaged over those periods, kernels
/// as `smUtil`, copies and memsets as `memUtil`, stamped with the end of the latest period
/// it was busy in. The period in progress is not sampled yet.
fn process_samples(
    device: NvmlDevice,
    last_seen: u64,
) -> Result<Vec<NvmlProcessUtilizationSample>, NvmlReturn> {
    let offset = wall_offset_ns();
    // A period ending at monotonic `end` is stamped floor((end + offset) / 1000) µs, which is
    // greater than `last_seen` exactly when end > (last_seen + 1) * 1000 - offset - 1.
    let since_ns = if last_seen == 0 {
        0
    } else {
        ((last_seen as i128 + 1) * 1000 - offset - 1).clamp(0, u64::MAX as i128) as u64
    };
    let activity = with_device(|d| {
        let gpu = gpu_of(device, d)?;
        let mut locked = d.lock().map_err(|_| NVML_ERROR_UNKNOWN)?;
        locked
            .process_activity(gpu, since_ns)
            .map_err(|_| NVML_ERROR_UNKNOWN)
    })?;
    Ok(activity
        .into_iter()
        .map(|a| NvmlProcessUtilizationSample {
            pid: resolve_pid(a.ns, a.pid).unwrap_or(a.pid),
            time_stamp: ((a.last_active_end_ns as i128 + offset).max(0) / 1000) as u64,
            sm_util: percent(a.kernel_ns, a.period_ns),
            mem_util: percent(a.copy_ns, a.period_ns),
            enc_util: 0,
            dec_util: 0,
        })
        .collect())
}

/// As the driver: NVML_ERROR_NOT_FOUND when no process has a sample since `last_seen`; with
/// `utilization` NULL or `*count` too small, NVML_ERROR_INSUFFICIENT_SIZE and the count
/// needed in `*count`; otherwise the samples, and how many in `*count`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: NvmlDevice,
    utilization: *mut NvmlProcessUtilizationSample,
    count: *mut c_uint,
    last_seen: u64,
) -> NvmlReturn {
    guard(|| {
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let samples = process_samples(device, last_seen)?;
        // SAFETY: `count` is valid per the API contract; `utilization` holds `*count`
        // entries when it is not NULL.
        unsafe {
            if samples.is_empty() {
                *count = 0;
                return Err(NVML_ERROR_NOT_FOUND);
            }
            let room = *count as usize;
            *count = samples.len() as c_uint;
            if utilization.is_null() || room < samples.len() {
                return Err(NVML_ERROR_INSUFFICIENT_SIZE);
            }
            for (i, sample) in samples.into_iter().enumerate() {
                utilization.add(i).write(sample);
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_nvml_h() {
        assert_eq!(std::mem::size_of::<NvmlMemoryV2>(), 40);
        assert_eq!(MEMORY_V2_VERSION, 40 | (2 << 24));
        assert_eq!(std::mem::size_of::<NvmlProcessInfo>(), 24);
        assert_eq!(std::mem::size_of::<NvmlProcessInfoV1>(), 16);
        assert_eq!(std::mem::size_of::<NvmlProcessUtilizationSample>(), 32);
    }

    /// nvml.h: v1's `used` includes the reserved memory, v2 lists it apart; `free` and
    /// `total` agree, and `total` is more than CUDA can allocate whenever memory is reserved.
    #[test]
    fn memory_views_follow_nvml_h() {
        const MI: u64 = 1 << 20;
        let snapshot = |total, reserved, used| simgpu_model::device::GpuSnapshot {
            index: 0,
            memory_total: total,
            memory_reserved: reserved,
            memory_used: used,
            busy_ns: 0,
            utilization_percent: 0,
            switches: 0,
            now_ns: 0,
            processes: Vec::new(),
            contexts: Vec::new(),
        };
        // (total, reserved, used) -> v1 (free, used), v2 (reserved, free, used)
        let table = [
            (
                (81559 * MI, 551 * MI, 0),
                (81008 * MI, 551 * MI),
                (551 * MI, 81008 * MI, 0),
            ),
            (
                (1024 * MI, 24 * MI, 300 * MI),
                (700 * MI, 324 * MI),
                (24 * MI, 700 * MI, 300 * MI),
            ),
            ((1024 * MI, 0, 1024 * MI), (0, 1024 * MI), (0, 0, 1024 * MI)),
        ];
        for ((total, reserved, used), (v1_free, v1_used), (v2_reserved, v2_free, v2_used)) in table
        {
            let (v1, v2) = memory_views(&snapshot(total, reserved, used));
            assert_eq!((v1.total, v1.free, v1.used), (total, v1_free, v1_used));
            assert_eq!(
                (v2.version, v2.total, v2.reserved, v2.free, v2.used),
                (MEMORY_V2_VERSION, total, v2_reserved, v2_free, v2_used)
            );
            assert_eq!(v1.free + v1.used, v1.total, "v1: free + used = total");
            assert_eq!(v2.free + v2.reserved + v2.used, v2.total);
        }
    }

    fn wall_us() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    }

    /// The two-call protocol, NOT_FOUND without samples, wall-clock µs timestamps that work
    /// as `lastSeenTimeStamp`, kernels in `smUtil` and copies in `memUtil`.
    #[test]
    fn process_utilization_behaves_like_the_driver() {
        let dir = std::env::temp_dir().join(format!("simgpu-nvml-test-{}", std::process::id()));
        // The only test here that initialises the library or reads these variables.
        std::env::set_var("SIMGPU_DIR", &dir);
        std::env::set_var("SIMGPU_GPUS", "2");
        std::env::set_var("SIMGPU_LAUNCH_LATENCY_NS", "0");
        assert_eq!(nvmlInit_v2(), NVML_SUCCESS);
        let mut gpu0: NvmlDevice = 0;
        let mut gpu1: NvmlDevice = 0;
        // SAFETY: the out-pointers are locals of this frame; the library was initialised above.
        unsafe {
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(0, &mut gpu0), NVML_SUCCESS);
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(1, &mut gpu1), NVML_SUCCESS);
        }
        let query = |device: NvmlDevice, buffer: Option<usize>, last_seen: u64| {
            let mut samples = vec![NvmlProcessUtilizationSample::default(); buffer.unwrap_or(0)];
            let mut count = buffer.unwrap_or(0) as c_uint;
            let pointer = match buffer {
                Some(_) => samples.as_mut_ptr(),
                None => std::ptr::null_mut(),
            };
            // SAFETY: a buffer of `count` entries, or NULL.
            let result =
                unsafe { nvmlDeviceGetProcessUtilization(device, pointer, &mut count, last_seen) };
            samples.truncate(count as usize);
            (result, count, samples)
        };
        assert_eq!(
            query(gpu0, None, 0).0,
            NVML_ERROR_NOT_FOUND,
            "nothing ran yet"
        );

        let config = SimConfig::from_env().unwrap();
        let model = Device::open(&config).unwrap();
        let before = wall_us();
        {
            let mut l = model.lock().unwrap();
            let p = l.attach_process().unwrap();
            let ctx = l.create_context(p, 0).unwrap();
            l.submit_kernel(ctx, 150_000_000).unwrap();
            l.submit(ctx, 100_000_000, simgpu_model::shared::NO_EVENT)
                .unwrap();
        }
        // The work ends 250 ms on; its sampling period within 350 ms.
        std::thread::sleep(std::time::Duration::from_millis(450));
        let (result, needed, _) = query(gpu0, None, before);
        assert_eq!(
            (result, needed),
            (NVML_ERROR_INSUFFICIENT_SIZE, 1),
            "size query"
        );
        let (result, needed, _) = query(gpu0, Some(0), before);
        assert_eq!(
            (result, needed),
            (NVML_ERROR_INSUFFICIENT_SIZE, 1),
            "no room"
        );
        let (result, count, samples) = query(gpu0, Some(4), before);
        assert_eq!((result, count), (NVML_SUCCESS, 1));
        let s = samples[0];
        assert_eq!(s.pid, std::process::id());
        assert!(
            s.time_stamp > before + 250_000 && s.time_stamp <= wall_us(),
            "{s:?}"
        );
        // 150 ms of kernels and 100 ms of copies over 3 to 5 periods of 100 ms.
        // (More periods if this thread overslept; the 3:2 ratio stays.)
        assert!((15..=50).contains(&s.sm_util), "{s:?}");
        assert!((10..=34).contains(&s.mem_util), "{s:?}");
        assert!((2 * s.sm_util).abs_diff(3 * s.mem_util) <= 5, "{s:?}");
        assert_eq!((s.enc_util, s.dec_util), (0, 0));
        assert_eq!(
            query(gpu0, Some(4), s.time_stamp).0,
            NVML_ERROR_NOT_FOUND,
            "nothing newer than the sample's own timestamp"
        );
        assert_eq!(
            query(gpu1, Some(4), 0).0,
            NVML_ERROR_NOT_FOUND,
            "GPU 1 idle"
        );
        // SAFETY: a NULL count is what is being refused.
        let null_count = unsafe {
            nvmlDeviceGetProcessUtilization(gpu0, std::ptr::null_mut(), std::ptr::null_mut(), 0)
        };
        assert_eq!(null_count, NVML_ERROR_INVALID_ARGUMENT);
        assert_eq!(nvmlShutdown(), NVML_SUCCESS);
        drop(model);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn modes_come_from_the_environment_and_errors_name_variable_value_and_forms() {
        let modes = Modes::parse(Some("1:exclusive_process, 2:prohibited"), Some("0"), 3).unwrap();
        assert_eq!(
            (0..3).map(|g| modes.compute_mode(g)).collect::<Vec<_>>(),
            vec![
                NVML_COMPUTEMODE_DEFAULT,
                NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
                NVML_COMPUTEMODE_PROHIBITED
            ]
        );
        assert_eq!(
            (0..3).map(|g| modes.mig(g)).collect::<Vec<_>>(),
            vec![
                NVML_DEVICE_MIG_ENABLE,
                NVML_DEVICE_MIG_DISABLE,
                NVML_DEVICE_MIG_DISABLE
            ]
        );
        assert_eq!(Modes::parse(None, Some(""), 1).unwrap(), Modes::default());
        for (compute, mig, pieces) in [
            (
                "1:exclusive",
                "",
                [
                    "SIMGPU_COMPUTE_MODE=\"1:exclusive\"",
                    "\"exclusive\"",
                    "exclusive_process",
                ],
            ),
            (
                "exclusive_process",
                "",
                ["SIMGPU_COMPUTE_MODE", "GPU:MODE", "default"],
            ),
            ("5:default", "", ["SIMGPU_COMPUTE_MODE", "\"5\"", "0 to 1"]),
            ("", "0,x", ["SIMGPU_MIG=\"0,x\"", "\"x\"", "SIMGPU_GPUS=2"]),
        ] {
            let err = Modes::parse(Some(compute), Some(mig), 2).unwrap_err();
            for piece in pieces {
                assert!(
                    err.contains(piece),
                    "{compute:?} {mig:?}: {err} lacks {piece:?}"
                );
            }
        }
    }
}
