//! Modules and functions. No code runs on the simulated GPU, but images are checked like the
//! real driver checks them: `cuModuleLoadData` takes PTX text (e.g. `tests/simgpu/ptx/
//! spin.ptx`), and `cuModuleGetFunction` finds only the kernels (`.entry`) the image declares.
//! A function's duration comes from its first parameter (`gpushare_spin_ns`) or its name
//! (`sleep_2ms`; see `simgpu_model::kernel`).
//!
//! Module memory is loaded lazily, as CUDA does by default since 12.2 (CUDA_MODULE_LOADING=
//! LAZY): a module costs nothing on the device until the first launch of one of its kernels,
//! which charges `SIMGPU_MODULE_MEMORY` (and fails with `CUDA_ERROR_OUT_OF_MEMORY` when the
//! GPU cannot fit it); unloading the module or destroying its context gives it back.

use super::Handle;
use crate::driver::{driver, Function, Module};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_char, c_void};
use simgpu_model::kernel::{KernelDuration, ModuleImage};
use std::ffi::CStr;

/// Reads what `image` is: its first 4 bytes decide binary formats; text is read up to its NUL
/// (cuModuleLoadData requires PTX to be NUL-terminated).
///
/// # Safety
/// `image` must point at a module image per the cuModuleLoadData contract.
unsafe fn classify(image: *const c_void) -> ModuleImage {
    // SAFETY: every image format is at least 4 bytes long (a cubin's ELF header, a fatbin's
    // header) or NUL-terminated text; bytes are read one at a time and the scan stops at a NUL.
    let head: Vec<u8> = unsafe {
        let p = image as *const u8;
        (0..4)
            .map(|i| p.add(i).read())
            .take_while(|&b| b != 0)
            .collect()
    };
    if head.len() == 4 && matches!(ModuleImage::parse(&head), ModuleImage::Binary) {
        return ModuleImage::Binary;
    }
    // SAFETY: not a binary format, so NUL-terminated text per the contract.
    let text = unsafe { CStr::from_ptr(image as *const c_char) };
    ModuleImage::parse(text.to_bytes())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let ctx = d.current(&state)?;
        if image.is_null() || module.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: the caller's image per the API contract.
        let image = match unsafe { classify(image) } {
            ModuleImage::Binary => return Err(CudaError::NotSupported),
            ModuleImage::InvalidPtx => return Err(CudaError::InvalidPtx),
            ModuleImage::Invalid => return Err(CudaError::InvalidImage),
            image => image,
        };
        let h = state.modules.insert(Module {
            ctx,
            image,
            loaded_bytes: 0,
        });
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(module, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        d.unload_module(&mut state, module)
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
        let m = state.modules.get(module).ok_or(CudaError::InvalidHandle)?;
        if name.is_null() || function.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: a NUL-terminated name per the API contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| CudaError::NotFound)?;
        if !m.image.declares(name) {
            return Err(CudaError::NotFound);
        }
        let h = state.functions.insert(Function {
            duration: KernelDuration::from_function_name(name),
            module,
        });
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(function, h) }
    })
}
