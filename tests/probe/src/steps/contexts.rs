//! Steps on contexts: synchronising, a second context, the primary context reset.

use crate::{Probe, H, R, SPIN_PTX};
use std::ffi::{c_char, c_int, c_uint, c_void};

pub(crate) fn sync(p: &mut Probe) {
    let c = &p.cuda;
    let f: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
    // SAFETY: cuCtxSynchronize takes no arguments.
    let rc = unsafe { f() };
    p.report("sync", rc, "");
}

pub(crate) fn ctx_create(p: &mut Probe, dev: c_int) {
    // A second context on the device, made current (pushed) like cuCtxCreate does;
    // the probe's kernels then run in it (the module is loaded there too).
    // CUDA 11.4–12.4 resolve cuCtxCreate to cuCtxCreate_v3 (execution affinity).
    let c = &p.cuda;
    let create: unsafe extern "C" fn(*mut H, *mut c_void, c_int, c_uint, c_int) -> R =
        c.get("cuCtxCreate");
    let load_module: unsafe extern "C" fn(*mut H, *const c_void) -> R = c.get("cuModuleLoadData");
    let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
        c.get("cuModuleGetFunction");
    let (mut context, mut module, mut function) = (0, 0, 0);
    // SAFETY: cuCtxCreate_v3 (no affinity parameters: null, 0), cuModuleLoadData and
    // cuModuleGetFunction, given live locals of the handle types they write and a
    // NUL-terminated image and name that outlive the calls.
    let rc = unsafe {
        create(&mut context, std::ptr::null_mut(), 0, 0, dev)
            .max(load_module(&mut module, SPIN_PTX.as_ptr().cast()))
            .max(get_function(
                &mut function,
                module,
                c"gpushare_spin_ns".as_ptr(),
            ))
    };
    if rc == 0 {
        p.function = function;
    }
    p.report("ctx-create", rc, "");
}

pub(crate) fn reset(p: &mut Probe, dev: c_int) {
    // cuDevicePrimaryCtxReset: everything made in the primary context is gone (its
    // allocations forgotten here); the context is retained again, made current and
    // the kernel loaded again, so later steps run in the fresh one.
    let c = &p.cuda;
    let reset: unsafe extern "C" fn(c_int) -> R = c.get("cuDevicePrimaryCtxReset");
    let retain: unsafe extern "C" fn(*mut H, c_int) -> R = c.get("cuDevicePrimaryCtxRetain");
    let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
    let load_module: unsafe extern "C" fn(*mut H, *const c_void) -> R = c.get("cuModuleLoadData");
    let get_function: unsafe extern "C" fn(*mut H, H, *const c_char) -> R =
        c.get("cuModuleGetFunction");
    let (mut context, mut module, mut function) = (0, 0, 0);
    // SAFETY: cuDevicePrimaryCtxReset takes a device ordinal, which the driver
    // checks. Nothing the probe uses later lives in the old context: `held` is
    // cleared and the kernel loaded again below.
    let rc = unsafe { reset(dev) };
    // SAFETY: each function has its cuda.h signature, given live locals of the
    // handle types it writes and a NUL-terminated image and name.
    let again = unsafe {
        retain(&mut context, dev)
            .max(set_current(context))
            .max(load_module(&mut module, SPIN_PTX.as_ptr().cast()))
            .max(get_function(
                &mut function,
                module,
                c"gpushare_spin_ns".as_ptr(),
            ))
    };
    p.held.clear();
    if again == 0 {
        p.function = function;
    }
    p.report("reset", rc, &format!("again={}", p.name(again)));
}
