//! Kernel launches: the duration comes from the function (its first parameter for
//! `gpushare_spin_ns`, or its name); the kernel occupies the GPU for that long once the model
//! schedules it. Each launch costs the calling thread `SIMGPU_LAUNCH_HOST_NS` of busy time in
//! the driver, and the kernel reaches the device `SIMGPU_LAUNCH_LATENCY_NS` after submission.
//! The first launch of a module's kernel loads the module (lazy loading: its memory is charged
//! then).

use super::Handle;
use crate::driver::driver;
use crate::result::{guard, CUresult, CudaError};
use libc::{c_uint, c_void};

fn launch(
    function: Handle,
    dims: [c_uint; 6],
    stream: Handle,
    per_thread: bool,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), CudaError> {
    if dims.contains(&0) {
        return Err(CudaError::InvalidValue);
    }
    let d = driver()?;
    // The driver's own CPU work for a launch (parameter marshalling, pushbuffer write).
    d.launch_host_cost();
    let duration = {
        let mut state = d.state();
        // SAFETY: params/extra are the launch's own arrays per the cuLaunchKernel contract.
        let duration = unsafe { d.kernel_duration(&state, function, params, extra)? };
        d.load_for_launch(&mut state, function)?;
        duration
    };
    d.enqueue(stream, per_thread, &[duration], true)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| {
        launch(
            f,
            [grid_x, grid_y, grid_z, block_x, block_y, block_z],
            stream,
            false,
            params,
            extra,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| {
        launch(
            f,
            [grid_x, grid_y, grid_z, block_x, block_y, block_z],
            stream,
            true,
            params,
            extra,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let null = std::ptr::null_mut();
    guard(|| {
        launch(
            f,
            [grid_x, grid_y, grid_z, block_x, block_y, block_z],
            stream,
            false,
            params,
            null,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: Handle,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_mem: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
) -> CUresult {
    let null = std::ptr::null_mut();
    guard(|| {
        launch(
            f,
            [grid_x, grid_y, grid_z, block_x, block_y, block_z],
            stream,
            true,
            params,
            null,
        )
    })
}

/// `CUlaunchConfig` (CUDA 11.8+).
#[repr(C)]
pub struct LaunchConfig {
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: Handle,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

fn launch_ex(
    config: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    per_thread: bool,
) -> Result<(), CudaError> {
    // SAFETY: a valid CUlaunchConfig per the API contract (NULL rejected).
    let c = unsafe { config.as_ref() }.ok_or(CudaError::InvalidValue)?;
    let [gx, gy, gz] = c.grid_dim;
    let [bx, by, bz] = c.block_dim;
    launch(
        f,
        [gx, gy, gz, bx, by, bz],
        c.stream,
        per_thread,
        params,
        extra,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| launch_ex(config, f, params, extra, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    guard(|| launch_ex(config, f, params, extra, true))
}

#[cfg(test)]
mod tests {
    #[test]
    fn launch_config_matches_the_c_layout() {
        // 7 unsigned ints, padding to 8, then the stream pointer, attrs pointer, numAttrs.
        assert_eq!(std::mem::offset_of!(super::LaunchConfig, stream), 32);
        assert_eq!(std::mem::offset_of!(super::LaunchConfig, attrs), 40);
        assert_eq!(std::mem::offset_of!(super::LaunchConfig, num_attrs), 48);
        assert_eq!(std::mem::size_of::<super::LaunchConfig>(), 56);
    }
}
