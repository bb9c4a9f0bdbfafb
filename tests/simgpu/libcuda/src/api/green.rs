//! Green contexts (CUDA 12.4; streams in them 12.5): a context on a share of a device's
//! SMs. The simulated device runs one operation at a time, so the share is recorded
//! nowhere: a green context is a context of its own on the device (its own work queue),
//! and its streams are streams of that context.
//!
//! Checked as the driver checks them: SM resources only (`CU_DEV_RESOURCE_TYPE_SM`),
//! `cuGreenCtxCreate` requires `CU_GREEN_CTX_DEFAULT_STREAM`, and `cuGreenCtxStreamCreate`
//! requires `CU_STREAM_NON_BLOCKING` (cuda.h).

use super::{CuDevice, Handle};
use crate::driver::{driver, Stream};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_uint, c_void};

/// `CU_DEV_RESOURCE_TYPE_SM`.
const RESOURCE_TYPE_SM: c_int = 1;
/// `CUdevResource`: the type, 92 bytes of padding, then the union whose SM form starts
/// with `smCount`.
const RESOURCE_SM_COUNT_OFFSET: usize = 96;
/// `sizeof(CUdevResource)`: a resource array's stride.
const RESOURCE_BYTES: usize = 144;
/// `CU_GREEN_CTX_DEFAULT_STREAM`.
const GREEN_CTX_DEFAULT_STREAM: c_uint = 0x1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// The one resource descriptor handle: the simulation keeps no partition in it.
const WHOLE_DEVICE_DESC: Handle = 0x6d65_7363;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDevResource(
    dev: CuDevice,
    resource: *mut c_void,
    kind: c_int,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.check_gpu(dev)?;
        if resource.is_null() || kind != RESOURCE_TYPE_SM {
            return Err(CudaError::InvalidValue);
        }
        let mut sms: c_int = 0;
        // SAFETY: a live int for the attribute (16: CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).
        let rc = unsafe { super::device::cuDeviceGetAttribute(&mut sms, 16, dev) };
        if rc != 0 {
            return Err(CudaError::Unknown);
        }
        let bytes = resource.cast::<u8>();
        // SAFETY: the caller's CUdevResource (RESOURCE_BYTES long): zeroed, then its type
        // and SM count written.
        unsafe {
            std::ptr::write_bytes(bytes, 0, RESOURCE_BYTES);
            bytes.cast::<c_int>().write_unaligned(RESOURCE_TYPE_SM);
            bytes
                .add(RESOURCE_SM_COUNT_OFFSET)
                .cast::<c_uint>()
                .write_unaligned(sms as c_uint);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevResourceGenerateDesc(
    desc: *mut Handle,
    resources: *const c_void,
    count: c_uint,
) -> CUresult {
    guard(|| {
        driver()?;
        if desc.is_null() || resources.is_null() || count == 0 {
            return Err(CudaError::InvalidValue);
        }
        for i in 0..count as usize {
            // SAFETY: the caller's array of `count` CUdevResource.
            let kind = unsafe {
                resources
                    .cast::<u8>()
                    .add(i * RESOURCE_BYTES)
                    .cast::<c_int>()
                    .read_unaligned()
            };
            if kind != RESOURCE_TYPE_SM {
                return Err(CudaError::InvalidValue);
            }
        }
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(desc, WHOLE_DEVICE_DESC) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxCreate(
    green: *mut Handle,
    desc: Handle,
    dev: CuDevice,
    flags: c_uint,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        if green.is_null() || desc != WHOLE_DEVICE_DESC || flags != GREEN_CTX_DEFAULT_STREAM {
            return Err(CudaError::InvalidValue);
        }
        let mut state = d.state();
        let handle = d.create_context(&mut state, gpu, 0, false)?;
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(green, handle) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGreenCtxDestroy(green: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        d.destroy_context(&mut state, green)
    })
}

/// The green context as a `CUcontext` (the simulation's handles are the same value).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxFromGreenCtx(pctx: *mut Handle, green: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.state().context(green)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pctx, green) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxStreamCreate(
    stream: *mut Handle,
    green: Handle,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        state.context(green)?;
        if stream.is_null() || flags != STREAM_NON_BLOCKING {
            return Err(CudaError::InvalidValue);
        }
        let h = state.streams.insert(Stream {
            ctx: green,
            last: 0,
            flags,
            priority,
            capture: None,
        });
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(stream, h) }
    })
}
