//! Device allocations and arrays: every byte is charged to the shared device, so a program that
//! allocates beyond the simulated capacity gets `CUDA_ERROR_OUT_OF_MEMORY` with nothing
//! allocated.

use super::{DevicePtr, Handle};
use crate::driver::{driver, AllocKind, Charge};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::c_uint;

/// Row pitch alignment `cuMemAllocPitch` rounds to (the texture pitch alignment).
const PITCH_ALIGN: usize = 512;
/// `CU_MEM_ATTACH_GLOBAL` / `CU_MEM_ATTACH_HOST`.
const MEM_ATTACH_GLOBAL: c_uint = 0x1;
const MEM_ATTACH_HOST: c_uint = 0x2;

fn allocate_current(dptr: *mut DevicePtr, size: usize, kind: AllocKind) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let ctx = d.current(&state)?;
    if dptr.is_null() {
        return Err(CudaError::InvalidValue);
    }
    // cuMemAlloc may synchronise (it can reuse memory the GPU still uses): unsafe in capture.
    d.check_unsafe_call(&mut state)?;
    let ptr = d.allocate(&mut state, ctx, size as u64, kind)?;
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(dptr, ptr) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, size: usize) -> CUresult {
    guard(|| allocate_current(dptr, size, AllocKind::Device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevicePtr,
    pitch: *mut usize,
    width_bytes: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    guard(|| {
        if !matches!(element_size, 4 | 8 | 16) || pitch.is_null() || width_bytes == 0 || height == 0
        {
            return Err(CudaError::InvalidValue);
        }
        let row = width_bytes.div_ceil(PITCH_ALIGN) * PITCH_ALIGN;
        let total = row.checked_mul(height).ok_or(CudaError::InvalidValue)?;
        allocate_current(dptr, total, AllocKind::Device)?;
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(pitch, row) }
    })
}

/// Managed memory is charged to the device like ordinary memory: the simulated GPU does not
/// model oversubscription or migration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevicePtr,
    size: usize,
    flags: c_uint,
) -> CUresult {
    guard(|| {
        if flags != MEM_ATTACH_GLOBAL && flags != MEM_ATTACH_HOST {
            return Err(CudaError::InvalidValue);
        }
        allocate_current(dptr, size, AllocKind::Managed)?;
        // The driver cannot checkpoint a process that holds managed memory.
        let d = driver()?;
        Ok(d.device
            .lock()?
            .refuse_checkpoint(d.process, simgpu_model::checkpoint::REFUSE_MANAGED)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        // cuMemFree synchronises the device before releasing: unsafe during capture.
        d.check_unsafe_call(&mut state)?;
        if dptr == 0 {
            return Ok(());
        }
        d.free(&mut state, dptr).map(|_| ())
    })
}

/// The memory CUDA can allocate: its total leaves out what the driver reserved
/// (`SIMGPU_RESERVED_MEMORY`), so it is less than NVML's total, as on a real GPU (an H100 80GB:
/// 81,559 MiB in NVML, about 81,008 MiB here); `free` is what nothing holds.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = {
            let state = d.state();
            state.context(d.current(&state)?)?.gpu
        };
        let (f, t) = d.device.lock()?.memory_info(gpu);
        // SAFETY: out-parameters per the API contract.
        unsafe {
            write_out(free, f as usize)?;
            write_out(total, t as usize)
        }
    })
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct ArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct Array3DDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_uint,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

/// Bytes of one channel of a `CUarray_format`.
pub fn format_bytes(format: c_uint) -> Option<u64> {
    match format {
        0x01 | 0x08 => Some(1), // UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 => Some(2), // UNSIGNED_INT16, SIGNED_INT16
        0x03 | 0x0a => Some(4), // UNSIGNED_INT32, SIGNED_INT32
        0x10 => Some(2),        // HALF
        0x20 => Some(4),        // FLOAT
        _ => None,
    }
}

/// Bytes of an array of `levels` mip levels (1 for a plain array); 0 height/depth mean 1D/2D.
pub fn array_bytes(
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    levels: u32,
) -> Option<u64> {
    let element = format_bytes(format)? * u64::from(channels);
    if !matches!(channels, 1 | 2 | 4) || width == 0 || levels == 0 {
        return None;
    }
    let mut total = 0u64;
    for level in 0..levels.min(64) {
        let shrink = |n: usize| {
            if n == 0 {
                1
            } else {
                (n >> level).max(1) as u64
            }
        };
        total = total.checked_add(
            shrink(width)
                .checked_mul(shrink(height))?
                .checked_mul(shrink(depth))?
                .checked_mul(element)?,
        )?;
    }
    Some(total)
}

fn create_array(handle: *mut Handle, bytes: Option<u64>, mipmapped: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let ctx = d.current(&state)?;
    let bytes = bytes.ok_or(CudaError::InvalidValue)?;
    if handle.is_null() {
        return Err(CudaError::InvalidValue);
    }
    let gpu = state.context(ctx)?.gpu;
    d.charge(gpu, bytes)?;
    let charge = Charge { gpu, bytes, ctx };
    let h = if mipmapped {
        state.mipmapped.insert(charge)
    } else {
        state.arrays.insert(charge)
    };
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(handle, h) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut Handle,
    desc: *const ArrayDescriptor,
) -> CUresult {
    guard(|| {
        // SAFETY: a valid descriptor per the API contract (NULL rejected).
        let desc = unsafe { desc.as_ref() }.ok_or(CudaError::InvalidValue)?;
        let bytes = array_bytes(
            desc.width,
            desc.height,
            0,
            desc.format,
            desc.num_channels,
            1,
        );
        create_array(array, bytes, false)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut Handle,
    desc: *const Array3DDescriptor,
) -> CUresult {
    guard(|| {
        // SAFETY: a valid descriptor per the API contract (NULL rejected).
        let desc = unsafe { desc.as_ref() }.ok_or(CudaError::InvalidValue)?;
        let bytes = array_bytes(
            desc.width,
            desc.height,
            desc.depth,
            desc.format,
            desc.num_channels,
            1,
        );
        create_array(array, bytes, false)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(array: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let c = d
            .state()
            .arrays
            .remove(array)
            .ok_or(CudaError::InvalidHandle)?;
        d.credit(c.gpu, c.bytes)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut Handle,
    desc: *const Array3DDescriptor,
    levels: c_uint,
) -> CUresult {
    guard(|| {
        // SAFETY: a valid descriptor per the API contract (NULL rejected).
        let desc = unsafe { desc.as_ref() }.ok_or(CudaError::InvalidValue)?;
        let bytes = array_bytes(
            desc.width,
            desc.height,
            desc.depth,
            desc.format,
            desc.num_channels,
            levels,
        );
        create_array(array, bytes, true)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMipmappedArrayDestroy(array: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let c = d
            .state()
            .mipmapped
            .remove(array)
            .ok_or(CudaError::InvalidHandle)?;
        d.credit(c.gpu, c.bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4, 1), Some(16 * 1024));
        assert_eq!(array_bytes(64, 64, 8, 0x01, 1, 1), Some(64 * 64 * 8));
        // 8x8, 4x4, 2x2, 1x1 floats.
        assert_eq!(
            array_bytes(8, 8, 0, 0x20, 1, 4),
            Some((64 + 16 + 4 + 1) * 4)
        );
        assert_eq!(array_bytes(8, 8, 0, 0x77, 1, 1), None, "unknown format");
        assert_eq!(array_bytes(8, 8, 0, 0x20, 3, 1), None, "three channels");
        assert_eq!(array_bytes(0, 8, 0, 0x20, 1, 1), None);
    }
}
