//! Modules and functions. No code runs on the simulated GPU: any image loads, and a function's
//! name says how long its kernel takes (see `simgpu_model::kernel`).

use super::Handle;
use crate::driver::{driver, Function};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_char, c_void};
use simgpu_model::kernel::KernelDuration;
use std::ffi::CStr;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        d.current(&state)?;
        if image.is_null() {
            return Err(CudaError::InvalidValue);
        }
        let h = state.modules.insert(());
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(module, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    guard(|| {
        driver()?
            .state()
            .modules
            .remove(module)
            .ok_or(CudaError::InvalidHandle)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        state.modules.get(module).ok_or(CudaError::InvalidHandle)?;
        if name.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: a NUL-terminated name per the API contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| CudaError::NotFound)?;
        let h = state.functions.insert(Function {
            duration: KernelDuration::from_function_name(name),
        });
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(function, h) }
    })
}
