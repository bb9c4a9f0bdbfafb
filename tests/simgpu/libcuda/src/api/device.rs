//! Initialisation, versions and device queries.

use super::CuDevice;
use crate::driver::{self, driver};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_char, c_int, c_uint};
use simgpu_model::SimConfig;

/// The name every simulated GPU reports.
pub const DEVICE_NAME: &str = "NVIDIA Simulated GPU (simgpu)";

/// The CUDA version the driver reports: the stored configuration's once attached, the
/// environment's before `cuInit` (cuDriverGetVersion works without initialisation).
pub fn driver_version() -> i32 {
    match driver() {
        Ok(d) => d.config.cuda_version as i32,
        Err(_) => SimConfig::from_env()
            .map(|c| c.cuda_version)
            .unwrap_or(SimConfig::default().cuda_version),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CudaError::InvalidValue);
        }
        driver::init().map(|_| ())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: out-parameter per the API contract.
    guard(|| unsafe { write_out(version, driver_version()) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: out-parameter per the API contract.
    guard(|| unsafe { write_out(count, driver()?.gpu_count() as c_int) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CuDevice, ordinal: c_int) -> CUresult {
    guard(|| {
        driver()?.check_gpu(ordinal)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(device, ordinal as CuDevice) }
    })
}

/// Copies `text` into a caller buffer of `len` bytes, truncating and NUL-terminating.
///
/// # Safety
/// `buf` must be valid for `len` bytes of writes.
pub unsafe fn write_c_string(buf: *mut c_char, len: c_int, text: &str) -> Result<(), CudaError> {
    if buf.is_null() || len <= 0 {
        return Err(CudaError::InvalidValue);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: buf holds `len` bytes per the contract; we write n + 1 <= len of them.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, n);
        *buf.add(n) = 0;
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CuDevice) -> CUresult {
    guard(|| {
        driver()?.check_gpu(dev)?;
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe { write_c_string(name, len, DEVICE_NAME) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    bus_id: *mut c_char,
    len: c_int,
    dev: CuDevice,
) -> CUresult {
    guard(|| {
        let gpu = driver()?.check_gpu(dev)?;
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe { write_c_string(bus_id, len, &format!("00000000:{:02X}:00.0", 0x10 + gpu)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CuDevice) -> CUresult {
    guard(|| {
        let gpu = driver()?.check_gpu(dev)?;
        // SAFETY: CUuuid is 16 bytes; out-parameter per the API contract.
        unsafe { write_out(uuid, simgpu_model::gpu_uuid_bytes(gpu)) }
    })
}

/// Same answer: `_v2` differs from the original only for MIG instances, which simgpu lacks.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CuDevice) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CuDevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.check_gpu(dev)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(bytes, d.config.memory_bytes as usize) }
    })
}

/// `CUdevice_attribute` values the simulated device answers; others in range read 0.
pub fn attribute_value(attribute: c_int, sms: u32, gpu: u32) -> Option<c_int> {
    let value = match attribute {
        1 => 1024,                 // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,             // MAX_BLOCK_DIM_X, _Y
        4 => 64,                   // MAX_BLOCK_DIM_Z
        5 => i32::MAX,             // MAX_GRID_DIM_X
        6 | 7 => 65535,            // MAX_GRID_DIM_Y, _Z
        8 => 48 * 1024,            // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 64 * 1024,            // TOTAL_CONSTANT_MEMORY
        10 => 32,                  // WARP_SIZE
        11 => i32::MAX,            // MAX_PITCH
        12 => 65536,               // MAX_REGISTERS_PER_BLOCK
        13 => 1_410_000,           // CLOCK_RATE (kHz)
        14 => 512,                 // TEXTURE_ALIGNMENT
        15 => 1,                   // GPU_OVERLAP
        16 => sms as c_int,        // MULTIPROCESSOR_COUNT
        17 | 18 => 0,              // KERNEL_EXEC_TIMEOUT, INTEGRATED
        19 => 1,                   // CAN_MAP_HOST_MEMORY
        20 => 0,                   // COMPUTE_MODE: default
        31 => 1,                   // CONCURRENT_KERNELS
        33 => 0x10 + gpu as c_int, // PCI_BUS_ID
        36 => 1_215_000,           // MEMORY_CLOCK_RATE (kHz)
        37 => 5120,                // GLOBAL_MEMORY_BUS_WIDTH
        38 => 40 * 1024 * 1024,    // L2_CACHE_SIZE
        39 => 2048,                // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 3,                   // ASYNC_ENGINE_COUNT
        41 => 1,                   // UNIFIED_ADDRESSING
        75 => 8,                   // COMPUTE_CAPABILITY_MAJOR
        76 => 0,                   // COMPUTE_CAPABILITY_MINOR
        81 => 164 * 1024,          // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        83 => 1,                   // MANAGED_MEMORY
        89 => 1,                   // CONCURRENT_MANAGED_ACCESS
        90 => 1,                   // COMPUTE_PREEMPTION_SUPPORTED
        95 => 1,                   // COOPERATIVE_LAUNCH
        97 => 163 * 1024,          // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        102 => 1,                  // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        115 => 1,                  // MEMORY_POOLS_SUPPORTED
        a if (1..150).contains(&a) => 0,
        _ => return None,
    };
    Some(value)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    dev: CuDevice,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let v = attribute_value(attribute, d.config.sms, gpu).ok_or(CudaError::InvalidValue)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(value, v) }
    })
}
