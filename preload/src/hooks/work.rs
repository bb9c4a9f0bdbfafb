//! Wrappers that keep the gate's record of the process's work (`gate::work`): which
//! contexts and streams exist, and which streams are being captured into a graph.
//! Each forwards the call unchanged and records what the driver did; a created or
//! retained context also attaches the process to its lease (`accounts`), once. None of
//! them is on a launch path.

use libc::{c_int, c_uint, c_void};

use super::real_fn;
use crate::cuda::*;
use crate::gate;

/// Records only for an armed library: an inert one forwards and nothing else.
fn armed() -> bool {
    crate::config::is_active()
}

fn created_stream(stream: *mut Handle, flags: c_uint, rc: CUresult) {
    created_stream_in(stream, crate::driver::current_context, flags, rc);
}

/// Records a stream the driver created in the context `context` names.
fn created_stream_in(
    stream: *mut Handle,
    context: impl FnOnce() -> Handle,
    flags: c_uint,
    rc: CUresult,
) {
    if rc != CUDA_SUCCESS || stream.is_null() || !armed() {
        return;
    }
    // SAFETY: the driver wrote the new stream's handle there.
    let handle = unsafe { *stream };
    // A stream means a context, maybe one no creation wrapper saw (the CUDA runtime's).
    crate::accounts::attach_after_context_creation();
    gate::work().stream_created(handle, context(), flags);
}

/// # Safety
/// The driver's contract for `cuStreamCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Handle, flags: c_uint) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuStreamCreate: fn(*mut Handle, c_uint) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(stream, flags) };
        created_stream(stream, flags, rc);
        rc
    })
}

/// # Safety
/// The driver's contract for `cuStreamCreateWithPriority`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Handle,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuStreamCreateWithPriority: fn(*mut Handle, c_uint, c_int) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(stream, flags, priority) };
        created_stream(stream, flags, rc);
        rc
    })
}

/// # Safety
/// The driver's contract for `cuStreamDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuStreamDestroy_v2: fn(Handle) -> CUresult);
        // SAFETY: the caller's argument, forwarded.
        let rc = unsafe { real(stream) };
        if rc == CUDA_SUCCESS && armed() {
            gate::work().stream_destroyed(stream);
        }
        rc
    })
}

/// Defines a capture-begin wrapper: counted (and made to wait for a context
/// synchronisation the agent has in progress) before the driver sees it.
macro_rules! begin_capture {
    ($name:ident ($per_thread:expr; stream: Handle $(, $arg:ident : $ty:ty)*)) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle $(, $arg: $ty)*) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(Handle $(, $ty)*) -> CUresult);
                if !armed() {
                    // SAFETY: the caller's arguments, forwarded.
                    return unsafe { real(stream $(, $arg)*) };
                }
                let work = gate::work();
                work.capture_begins(stream, $per_thread);
                // SAFETY: the caller's arguments, forwarded.
                let rc = unsafe { real(stream $(, $arg)*) };
                work.capture_begun(stream, $per_thread, rc);
                rc
            })
        }
    };
}

begin_capture!(cuStreamBeginCapture(false; stream: Handle));
begin_capture!(cuStreamBeginCapture_ptsz(true; stream: Handle));
begin_capture!(cuStreamBeginCapture_v2(false; stream: Handle, mode: c_int));
begin_capture!(cuStreamBeginCapture_v2_ptsz(true; stream: Handle, mode: c_int));
// CUDA 12.3: capture into an existing graph, after the given nodes.
begin_capture!(cuStreamBeginCaptureToGraph(false; stream: Handle, graph: Handle,
    dependencies: *const Handle, edge_data: *const c_void, dependency_count: usize, mode: c_int));
begin_capture!(cuStreamBeginCaptureToGraph_ptsz(true; stream: Handle, graph: Handle,
    dependencies: *const Handle, edge_data: *const c_void, dependency_count: usize, mode: c_int));

macro_rules! end_capture {
    ($name:ident ($per_thread:expr)) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle, graph: *mut Handle) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(Handle, *mut Handle) -> CUresult);
                // SAFETY: the caller's arguments, forwarded.
                let rc = unsafe { real(stream, graph) };
                if armed() {
                    // Success or not (an invalidated capture ends here too).
                    gate::work().capture_ended(stream, $per_thread);
                }
                rc
            })
        }
    };
}

end_capture!(cuStreamEndCapture(false));
end_capture!(cuStreamEndCapture_ptsz(true));

/// # Safety
/// The driver's contract for `cuDevicePrimaryCtxRetain`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut Handle,
    device: CUdevice,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuDevicePrimaryCtxRetain: fn(*mut Handle, CUdevice) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(context, device) };
        if rc == CUDA_SUCCESS {
            crate::accounts::attach_after_context_creation();
        }
        if rc == CUDA_SUCCESS && !context.is_null() && armed() {
            // SAFETY: the driver wrote the context's handle there.
            gate::work().context_created(unsafe { *context }, Some(device));
        }
        rc
    })
}

/// Defines a primary-context release or reset: afterwards the context may be gone
/// (always, for a reset), and a handle the agent kept would be stale — it could even
/// be reused for an unrelated context. A context that is gone took its memory with it:
/// credited (`Accounts::context_gone`).
macro_rules! release_primary {
    ($name:ident, $reset:expr) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: CUdevice) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(CUdevice) -> CUresult);
                // The device's primary context as the wrappers saw it retained, looked
                // up before the driver can hand its handle to another context.
                let primaries: Vec<Handle> = if armed() {
                    gate::work()
                        .contexts()
                        .iter()
                        .filter(|c| c.primary_of == Some(device))
                        .map(|c| c.handle)
                        .collect()
                } else {
                    Vec::new()
                };
                // SAFETY: the caller's argument, forwarded.
                let rc = unsafe { real(device) };
                if rc == CUDA_SUCCESS && armed() {
                    let active = !$reset
                        && crate::driver::primary_context_active(device).unwrap_or(false);
                    gate::work().primary_released(device, active);
                    if !active {
                        if let Some(mut a) = crate::accounts::lock() {
                            for context in primaries {
                                a.context_gone(context, Some(device), $reset);
                            }
                        }
                    }
                }
                rc
            })
        }
    };
}

release_primary!(cuDevicePrimaryCtxRelease, false);
release_primary!(cuDevicePrimaryCtxRelease_v2, false);
release_primary!(cuDevicePrimaryCtxReset, true);
release_primary!(cuDevicePrimaryCtxReset_v2, true);

fn created_context(context: *mut Handle, rc: CUresult) {
    if rc == CUDA_SUCCESS {
        crate::accounts::attach_after_context_creation();
    }
    if rc == CUDA_SUCCESS && !context.is_null() && armed() {
        // SAFETY: the driver wrote the new context's handle there.
        gate::work().context_created(unsafe { *context }, None);
    }
}

/// # Safety
/// The driver's contract for `cuCtxCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    context: *mut Handle,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuCtxCreate_v2: fn(*mut Handle, c_uint, CUdevice) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(context, flags, device) };
        created_context(context, rc);
        rc
    })
}

/// # Safety
/// The driver's contract for `cuCtxCreate_v3` (CUDA 11.4: execution affinity).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    context: *mut Handle,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuCtxCreate_v3: fn(*mut Handle, *mut c_void, c_int, c_uint, CUdevice) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(context, params, num_params, flags, device) };
        created_context(context, rc);
        rc
    })
}

/// # Safety
/// The driver's contract for `cuCtxCreate_v4` (CUDA 12.5: creation parameters).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    context: *mut Handle,
    params: *mut c_void,
    flags: c_uint,
    device: CUdevice,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuCtxCreate_v4: fn(*mut Handle, *mut c_void, c_uint, CUdevice) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(context, params, flags, device) };
        created_context(context, rc);
        rc
    })
}

/// # Safety
/// The driver's contract for `cuGreenCtxCreate` (CUDA 12.4). The driver retains the
/// device's primary context itself (not through `cuDevicePrimaryCtxRetain`): the
/// process has a context from here on, so it attaches like any other creation.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxCreate(
    green: *mut Handle,
    desc: Handle,
    device: CUdevice,
    flags: c_uint,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuGreenCtxCreate: fn(*mut Handle, Handle, CUdevice, c_uint) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(green, desc, device, flags) };
        if rc == CUDA_SUCCESS {
            crate::accounts::attach_after_context_creation();
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuCtxDestroy_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(context: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuCtxDestroy_v2: fn(Handle) -> CUresult);
        // SAFETY: the caller's argument, forwarded.
        let rc = unsafe { real(context) };
        if rc == CUDA_SUCCESS && armed() {
            gate::work().context_destroyed(context);
            // Its allocations went with it.
            if let Some(mut a) = crate::accounts::lock() {
                a.context_gone(context, None, false);
            }
        }
        rc
    })
}

// CUDA 13.2: capture into a graphics command list (CUDA-in-Graphics). A capture like any
// other while it lasts: the agent must not synchronise the capturing stream.
begin_capture!(cuStreamBeginCaptureToCig(false; stream: Handle, params: *mut c_void));
begin_capture!(cuStreamBeginCaptureToCig_ptsz(true; stream: Handle, params: *mut c_void));

/// Defines the end of a CIG capture (no graph comes back: the work went into the
/// caller's command list).
macro_rules! end_capture_to_cig {
    ($name:ident ($per_thread:expr)) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(stream: Handle) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(Handle) -> CUresult);
                // SAFETY: the caller's argument, forwarded.
                let rc = unsafe { real(stream) };
                if armed() {
                    // Success or not, as for cuStreamEndCapture.
                    gate::work().capture_ended(stream, $per_thread);
                }
                rc
            })
        }
    };
}

end_capture_to_cig!(cuStreamEndCaptureToCig(false));
end_capture_to_cig!(cuStreamEndCaptureToCig_ptsz(true));

/// # Safety
/// The driver's contract for `cuGreenCtxStreamCreate` (CUDA 12.5). A green context's
/// stream is recorded when created, like `cuStreamCreate`'s, so its launches are bounded
/// per stream from the first one, under the green context's own `CUcontext` (not the
/// calling thread's current one): events waited on for it must be of that context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGreenCtxStreamCreate(
    stream: *mut Handle,
    green: Handle,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuGreenCtxStreamCreate: fn(*mut Handle, Handle, c_uint, c_int) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(stream, green, flags, priority) };
        created_stream_in(stream, || crate::driver::context_of_green(green), flags, rc);
        rc
    })
}
