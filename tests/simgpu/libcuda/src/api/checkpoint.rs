//! CUDA checkpointing (cuda.h "CUDA Checkpointing", CUDA 12.8 / r570): another process locks,
//! checkpoints, restores and unlocks a CUDA process by pid. The model does the work
//! (`simgpu_model::checkpoint`); this maps arguments and errors as cuda.h documents them.

use crate::driver::driver;
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_uint, c_void};
use simgpu_model::checkpoint::CheckpointError;
use simgpu_model::{Device, DeviceError};

/// `CUcheckpointLockArgs`.
#[repr(C)]
pub struct CUcheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` and `CUcheckpointUnlockArgs`: reserved, must be zeroed.
#[repr(C)]
pub struct CUcheckpointReservedArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointRestoreArgs`.
#[repr(C)]
pub struct CUcheckpointRestoreArgs {
    pub gpu_pairs: *mut c_void,
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 52 - std::mem::size_of::<*mut c_void>()],
    pub reserved1: u64,
}

fn cuda_error(e: CheckpointError) -> CudaError {
    match e {
        // The process is gone, or never was one of this driver's: the docs list
        // CUDA_ERROR_INVALID_VALUE for a bad argument and nothing more specific.
        CheckpointError::NoSuchProcess(_) | CheckpointError::Device(DeviceError::StaleProcess) => {
            CudaError::InvalidValue
        }
        CheckpointError::IllegalState { .. } => CudaError::IllegalState,
        // The only error cuCheckpointProcessLock lists beyond the others.
        CheckpointError::LockTimeout { .. } => CudaError::NotReady,
        CheckpointError::Unsupported => CudaError::NotSupported,
        CheckpointError::OutOfMemory { .. } => CudaError::OutOfMemory,
        CheckpointError::Device(_) => CudaError::Unknown,
        // The memory image could not be moved (a file system failure): nothing changed.
        CheckpointError::Image(e) => crate::driver::image_failed(e),
    }
}

fn target(pid: c_int) -> Result<u32, CudaError> {
    driver()?;
    u32::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .ok_or(CudaError::InvalidValue)
}

/// Reads optional arguments whose reserved bytes must all be zero.
///
/// # Safety
/// `args` is NULL or points to a readable `T`.
unsafe fn zeroed_reserved<T>(args: *const T, reserved: impl Fn(&T) -> bool) -> CuResult {
    // SAFETY: per this function's contract.
    match unsafe { args.as_ref() } {
        Some(a) if !reserved(a) => Err(CudaError::InvalidValue),
        _ => Ok(()),
    }
}

type CuResult = Result<(), CudaError>;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_int) -> CUresult {
    guard(|| {
        let pid = target(pid)?;
        let s = driver()?.device.process_state(pid).map_err(cuda_error)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(state, s as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessLock(
    pid: c_int,
    args: *const CUcheckpointLockArgs,
) -> CUresult {
    guard(|| {
        let pid = target(pid)?;
        // SAFETY: optional arguments per the API contract.
        unsafe {
            zeroed_reserved(args, |a| {
                a.reserved0 == 0 && a.reserved1.iter().all(|&r| r == 0)
            })?
        };
        // SAFETY: as above.
        let timeout_ms = unsafe { args.as_ref() }.map_or(0, |a| a.timeout_ms);
        driver()?
            .device
            .lock_process(pid, timeout_ms)
            .map_err(cuda_error)
    })
}

/// An operation whose arguments (`CUcheckpointCheckpointArgs`, `CUcheckpointUnlockArgs`) are
/// optional and all reserved.
///
/// # Safety
/// `args` is NULL or points to a readable `CUcheckpointReservedArgs`.
unsafe fn with_reserved_args(
    pid: c_int,
    args: *const CUcheckpointReservedArgs,
    op: impl FnOnce(&Device, u32) -> Result<(), CheckpointError>,
) -> CUresult {
    guard(|| {
        let pid = target(pid)?;
        // SAFETY: per this function's contract.
        unsafe { zeroed_reserved(args, |a| a.reserved.iter().all(|&r| r == 0))? };
        op(&driver()?.device, pid).map_err(cuda_error)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(
    pid: c_int,
    args: *const CUcheckpointReservedArgs,
) -> CUresult {
    // SAFETY: optional arguments per the API contract.
    unsafe { with_reserved_args(pid, args, |d, pid| d.checkpoint_process(pid).map(|_| ())) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessRestore(
    pid: c_int,
    args: *const CUcheckpointRestoreArgs,
) -> CUresult {
    guard(|| {
        let pid = target(pid)?;
        // SAFETY: optional arguments per the API contract.
        unsafe {
            zeroed_reserved(args, |a| {
                a.reserved.iter().all(|&r| r == 0) && a.reserved1 == 0
            })?
        };
        // SAFETY: as above. Remapping onto other GPUs is not modelled.
        if unsafe { args.as_ref() }.is_some_and(|a| a.gpu_pairs_count != 0) {
            return Err(CudaError::NotSupported);
        }
        driver()?
            .device
            .restore_process(pid)
            .map(|_| ())
            .map_err(cuda_error)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(
    pid: c_int,
    args: *const CUcheckpointReservedArgs,
) -> CUresult {
    // SAFETY: optional arguments per the API contract.
    unsafe { with_reserved_args(pid, args, |d, pid| d.unlock_process(pid)) }
}

/// simgpu runs no restore thread: it answers the process's main thread (whose id is its pid)
/// for any process of the driver.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(
    pid: c_int,
    tid: *mut c_int,
) -> CUresult {
    guard(|| {
        let pid = target(pid)?;
        driver()?.device.process_state(pid).map_err(cuda_error)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(tid, pid as c_int) }
    })
}
