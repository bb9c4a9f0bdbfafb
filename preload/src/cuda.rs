//! The slice of the CUDA driver and NVML ABIs the interposer touches: result codes,
//! handle types and the descriptors whose sizes it must read. Layouts follow cuda.h
//! and nvml.h (x86_64).

use libc::{c_char, c_int, c_uint, c_void};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
/// Opaque driver handles (`CUstream`, `CUfunction`, `CUarray`, `CUmemoryPool`, ...).
pub type Handle = usize;
/// `CUmemGenericAllocationHandle`.
pub type PhysicalHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CUdriverProcAddress_flags`.
pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1 << 0;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// `CUmemLocationType`.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;

/// `CUmemPool_attribute`.
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: c_int = 7;

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Array3DDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// The leading fields of `CUmemAllocationProp` (`cuMemCreate`) and of
/// `CUmemPoolProps` (`cuMemPoolCreate`): both begin with the allocation type, the
/// handle types and a `CUmemLocation`, which is all the interposer reads.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AllocationPropHead {
    pub alloc_type: c_uint,
    pub handle_types: c_uint,
    pub location_type: c_uint,
    pub location_id: c_int,
}

/// `CUlaunchConfig` (the gate reads its stream).
#[repr(C)]
pub struct LaunchConfig {
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: Handle,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// Bytes of one channel of a `CUarray_format`; `None` for formats whose size the
/// interposer does not know (they are refused rather than left uncharged).
pub fn array_format_bytes(format: c_uint) -> Option<u64> {
    match format {
        0x01 | 0x08 => Some(1),        // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => Some(2), // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => Some(4), // (UN)SIGNED_INT32, FLOAT
        0x50..=0x5f => Some(1),        // 8-bit packed/normalised formats
        0x90..=0x97 => Some(2),        // 16-bit formats
        _ => None,
    }
}

/// Bytes an array occupies: the sum over its mip levels of
/// width × height × depth × element size (0 height/depth mean 1D/2D). The real
/// driver adds alignment the API does not reveal (before CUDA 11.6's
/// `cuArrayGetMemoryRequirements`), so this is a lower bound.
pub fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    levels: c_uint,
) -> Option<u64> {
    let element = array_format_bytes(format)?.checked_mul(u64::from(channels))?;
    let mut total = 0u64;
    for level in 0..levels.clamp(1, 64) {
        let shrink = |n: usize| {
            if n == 0 {
                1
            } else {
                ((n >> level) as u64).max(1)
            }
        };
        let level_bytes = shrink(width)
            .checked_mul(shrink(height))?
            .checked_mul(shrink(depth))?
            .checked_mul(element)?;
        total = total.checked_add(level_bytes)?;
    }
    Some(total)
}

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

pub type NvmlReturn = c_int;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub type NvmlDevice = *mut c_void;

/// `cuGetProcAddress` (CUDA 11.3–11.8) and `cuGetProcAddress_v2` (12.0+).
pub type GetProcAddressFn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
pub type GetProcAddressV2Fn =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_headers() {
        assert_eq!(std::mem::size_of::<ArrayDescriptor>(), 24);
        assert_eq!(std::mem::size_of::<Array3DDescriptor>(), 40);
        assert_eq!(std::mem::offset_of!(LaunchConfig, stream), 32);
        assert_eq!(std::mem::offset_of!(NvmlMemoryV2, total), 8);
        assert_eq!(std::mem::size_of::<NvmlMemoryV2>(), 40);
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4, 1), Some(16 * 1024));
        assert_eq!(array_bytes(64, 64, 8, 0x01, 1, 1), Some(64 * 64 * 8));
        assert_eq!(
            array_bytes(8, 8, 0, 0x20, 1, 4),
            Some((64 + 16 + 4 + 1) * 4)
        );
        assert_eq!(array_bytes(8, 8, 0, 0x77, 1, 1), None);
        assert_eq!(array_bytes(usize::MAX, 4, 4, 0x20, 4, 1), None, "overflow");
    }
}
