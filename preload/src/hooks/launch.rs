//! Launch wrappers: the gate, then the driver. Nothing else happens here — this is
//! the hot path (no allocation, lock, logging or system call).

use libc::{c_int, c_uint, c_void};

use super::real_fn;
use crate::cuda::*;
use crate::gate::{self, Launch};

type Params = *mut *mut c_void;

/// Defines a gated wrapper: `name(kind; arg: type, ...)`.
macro_rules! gated {
    ($(#[$doc:meta])* $name:ident ($kind:expr; $($arg:ident : $ty:ty),*)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            crate::guard::cuda(|| {
                gate::admit($kind);
                let real = real_fn!($name: fn($($ty),*) -> CUresult);
                // SAFETY: the caller's arguments, forwarded unchanged.
                unsafe { real($($arg),*) }
            })
        }
    };
}

gated!(cuLaunchKernel(Launch::Kernel; f: Handle, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
    block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint, stream: Handle,
    params: Params, extra: Params));
gated!(cuLaunchKernel_ptsz(Launch::Kernel; f: Handle, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint,
    block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint, stream: Handle,
    params: Params, extra: Params));
gated!(cuLaunchKernelEx(Launch::Kernel; config: *const LaunchConfig, f: Handle, params: Params,
    extra: Params));
gated!(cuLaunchKernelEx_ptsz(Launch::Kernel; config: *const LaunchConfig, f: Handle,
    params: Params, extra: Params));
gated!(cuLaunchCooperativeKernel(Launch::Cooperative; f: Handle, grid_x: c_uint, grid_y: c_uint,
    grid_z: c_uint, block_x: c_uint, block_y: c_uint, block_z: c_uint, shared_mem: c_uint,
    stream: Handle, params: Params));
gated!(cuLaunchCooperativeKernel_ptsz(Launch::Cooperative; f: Handle, grid_x: c_uint,
    grid_y: c_uint, grid_z: c_uint, block_x: c_uint, block_y: c_uint, block_z: c_uint,
    shared_mem: c_uint, stream: Handle, params: Params));
gated!(
    /// Graphs are gated when launched; the launches captured into them ran nothing.
    cuGraphLaunch(Launch::Graph; exec: Handle, stream: Handle));
gated!(cuGraphLaunch_ptsz(Launch::Graph; exec: Handle, stream: Handle));
gated!(
    /// Pre-4.0 launch API (block shape and parameters set beforehand).
    cuLaunch(Launch::Legacy; f: Handle));
gated!(cuLaunchGrid(Launch::Legacy; f: Handle, grid_width: c_int, grid_height: c_int));
gated!(cuLaunchGridAsync(Launch::Legacy; f: Handle, grid_width: c_int, grid_height: c_int,
    stream: Handle));
