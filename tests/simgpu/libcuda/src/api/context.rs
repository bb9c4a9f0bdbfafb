//! Contexts: primary contexts, created contexts, the per-thread context stack, synchronisation.

use super::{CuDevice, Handle};
use crate::driver::{self, driver, Primary};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_uint, c_void};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CuDevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let mut state = d.state();
        let primary = state.primary[gpu as usize];
        let handle = if primary.handle != 0 && state.contexts.get(primary.handle).is_some() {
            primary.handle
        } else {
            let h = d.create_context(&mut state, gpu, primary.flags, true)?;
            state.primary[gpu as usize] = Primary {
                handle: h,
                retains: 0,
                flags: primary.flags,
            };
            h
        };
        state.primary[gpu as usize].retains += 1;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pctx, handle) }
    })
}

fn release_primary(dev: CuDevice, reset: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let gpu = d.check_gpu(dev)? as usize;
    let mut state = d.state();
    let primary = state.primary[gpu];
    if primary.handle == 0 || (primary.retains == 0 && !reset) {
        return if reset {
            Ok(())
        } else {
            Err(CudaError::InvalidContext)
        };
    }
    let retains = if reset { 0 } else { primary.retains - 1 };
    state.primary[gpu].retains = retains;
    if retains == 0 {
        // The primary context dies with its last retain; its memory and work go with it.
        d.destroy_context(&mut state, primary.handle)?;
        state.primary[gpu].handle = 0;
    }
    if reset {
        // "Destroys and cleans up all resources associated with the current device in the
        // current process" (cuda.h): the device's memory pools give back their cache too,
        // not only the blocks made in the context (a reserve kept here would stay
        // charged to the process after the reset).
        let pools: Vec<usize> = state
            .pools
            .iter()
            .filter(|(_, p)| p.gpu as usize == gpu)
            .map(|(h, _)| h)
            .collect();
        for pool in pools {
            d.trim_pool(&mut state, pool, 0)?;
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CuDevice) -> CUresult {
    guard(|| release_primary(dev, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: CuDevice) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CuDevice) -> CUresult {
    guard(|| release_primary(dev, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset(dev: CuDevice) -> CUresult {
    cuDevicePrimaryCtxReset_v2(dev)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CuDevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)? as usize;
        let state = d.state();
        let p = state.primary[gpu];
        // SAFETY: out-parameters per the API contract.
        unsafe {
            write_out(flags, p.flags)?;
            write_out(active, (p.handle != 0 && p.retains > 0) as c_int)
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CuDevice, flags: c_uint) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)? as usize;
        d.state().primary[gpu].flags = flags;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags(dev: CuDevice, flags: c_uint) -> CUresult {
    cuDevicePrimaryCtxSetFlags_v2(dev, flags)
}

fn create_and_push(pctx: *mut Handle, flags: c_uint, dev: CuDevice) -> Result<(), CudaError> {
    if pctx.is_null() {
        return Err(CudaError::InvalidValue);
    }
    let d = driver()?;
    let gpu = d.check_gpu(dev)?;
    let handle = d.create_context(&mut d.state(), gpu, flags, false)?;
    // A created context becomes current: it is pushed on the calling thread's stack.
    driver::push_context(handle);
    // SAFETY: checked non-null above; out-parameter per the API contract.
    unsafe { write_out(pctx, handle) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut Handle,
    flags: c_uint,
    dev: CuDevice,
) -> CUresult {
    guard(|| create_and_push(pctx, flags, dev))
}

/// CUDA 11.4: with execution-affinity parameters, which the simulated device ignores.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut Handle,
    _params: *mut c_void,
    _num_params: c_int,
    flags: c_uint,
    dev: CuDevice,
) -> CUresult {
    guard(|| create_and_push(pctx, flags, dev))
}

/// CUDA 12.5: with a `CUctxCreateParams*` (affinity, CIG), ignored by the simulated device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut Handle,
    _params: *mut c_void,
    flags: c_uint,
    dev: CuDevice,
) -> CUresult {
    guard(|| create_and_push(pctx, flags, dev))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        if state.context(ctx)?.primary {
            return Err(CudaError::InvalidContext);
        }
        d.destroy_context(&mut state, ctx)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    guard(|| {
        driver()?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pctx, driver::current_context().unwrap_or(0)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        if ctx == 0 {
            driver::set_current_context(None);
            return Ok(());
        }
        d.state().context(ctx)?;
        driver::set_current_context(Some(ctx));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    guard(|| {
        driver()?.state().context(ctx)?;
        driver::push_context(ctx);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut Handle) -> CUresult {
    guard(|| {
        driver()?;
        let ctx = driver::pop_context().ok_or(CudaError::InvalidContext)?;
        if !pctx.is_null() {
            // SAFETY: non-null out-parameter per the API contract.
            unsafe { write_out(pctx, ctx)? };
        }
        Ok(())
    })
}

fn context_or_current(ctx: Handle) -> Result<Handle, CudaError> {
    let d = driver()?;
    let state = d.state();
    if ctx == 0 {
        d.current(&state)
    } else {
        state.context(ctx)?;
        Ok(ctx)
    }
}

/// Waits for everything queued in `ctx` so far, on every stream: on the CPU, unless the
/// context was made with `CU_CTX_SCHED_BLOCKING_SYNC`.
fn synchronize(ctx: Handle) -> Result<(), CudaError> {
    let d = driver()?;
    let (id, flags) = {
        let mut state = d.state();
        let c = state.context(ctx)?;
        let (id, flags) = (c.id, c.flags);
        d.check_context_sync(&mut state, ctx)?;
        d.check_unsafe_call(&mut state)?;
        (id, flags)
    };
    let count = d.device.lock()?.submitted_count(id)?;
    d.wait_by(id, count, driver::waiter_for(flags, None))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    guard(|| synchronize(context_or_current(0)?))
}

/// CUDA 13.0: synchronises the given context (NULL: the current one).
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize_v2(ctx: Handle) -> CUresult {
    guard(|| synchronize(context_or_current(ctx)?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CuDevice) -> CUresult {
    // SAFETY: same contract as the _v2 form with the current context.
    unsafe { cuCtxGetDevice_v2(device, 0) }
}

/// CUDA 13.0: the device of the given context (NULL: the current one).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice_v2(device: *mut CuDevice, ctx: Handle) -> CUresult {
    guard(|| {
        let ctx = context_or_current(ctx)?;
        let d = driver()?;
        let gpu = d.state().context(ctx)?.gpu;
        let ordinal = d.ordinal_of(gpu)?;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(device, ordinal as CuDevice) }
    })
}
