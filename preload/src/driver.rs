//! Driver entry points the library calls for itself (never handed out): finding the
//! current device and its memory pool, reading pool attributes. Resolved once, cold,
//! from the loaded `libcuda.so.1`.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::{c_int, c_void};

use crate::cuda::*;
use crate::symbols::Library;

struct Lazy {
    name: &'static CStr,
    slot: AtomicPtr<c_void>,
}

impl Lazy {
    const fn new(name: &'static CStr) -> Lazy {
        Lazy {
            name,
            slot: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    fn get(&self) -> Option<*mut c_void> {
        let p = self.slot.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        let found = crate::loader::find_in_driver(Library::Cuda, self.name)?;
        self.slot.store(found, Ordering::Release);
        Some(found)
    }
}

static CTX_GET_DEVICE: Lazy = Lazy::new(c"cuCtxGetDevice");
static DEVICE_GET_MEM_POOL: Lazy = Lazy::new(c"cuDeviceGetMemPool");
static MEM_POOL_GET_ATTRIBUTE: Lazy = Lazy::new(c"cuMemPoolGetAttribute");

/// The current context's device.
pub fn current_device() -> Option<CUdevice> {
    let f = CTX_GET_DEVICE.get()?;
    let mut device: CUdevice = 0;
    // SAFETY: cuCtxGetDevice(CUdevice*) with a valid out-pointer.
    let rc = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut CUdevice) -> CUresult>(f)(
            &mut device,
        )
    };
    (rc == CUDA_SUCCESS).then_some(device)
}

/// The pool `cuMemAllocAsync` on `device` allocates from (its current pool).
pub fn current_pool(device: CUdevice) -> Option<Handle> {
    let f = DEVICE_GET_MEM_POOL.get()?;
    let mut pool: Handle = 0;
    // SAFETY: cuDeviceGetMemPool(CUmemoryPool*, CUdevice) with a valid out-pointer.
    let rc = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut Handle, CUdevice) -> CUresult>(
            f,
        )(&mut pool, device)
    };
    (rc == CUDA_SUCCESS && pool != 0).then_some(pool)
}

/// A pool's (reserved, used) bytes: what it holds from the device, and what of that
/// is handed out.
pub fn pool_usage(pool: Handle) -> Option<(u64, u64)> {
    let f = MEM_POOL_GET_ATTRIBUTE.get()?;
    type GetAttr = unsafe extern "C" fn(Handle, c_int, *mut c_void) -> CUresult;
    // SAFETY: cuMemPoolGetAttribute(pool, attr, void*): both attributes are cuuint64_t.
    let read = |attr: c_int| {
        let mut value: u64 = 0;
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, GetAttr>(f)(
                pool,
                attr,
                (&mut value as *mut u64).cast(),
            )
        };
        (rc == CUDA_SUCCESS).then_some(value)
    };
    Some((
        read(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        read(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
    ))
}

// The gate's helpers: the token agent drains the process's context, the launch-ahead
// bound records and waits on events, and captured launches are recognised.

static CTX_GET_CURRENT: Lazy = Lazy::new(c"cuCtxGetCurrent");
static CTX_SET_CURRENT: Lazy = Lazy::new(c"cuCtxSetCurrent");
static CTX_SYNCHRONIZE: Lazy = Lazy::new(c"cuCtxSynchronize");
static STREAM_IS_CAPTURING: Lazy = Lazy::new(c"cuStreamIsCapturing");
static EVENT_CREATE: Lazy = Lazy::new(c"cuEventCreate");
static EVENT_RECORD: Lazy = Lazy::new(c"cuEventRecord");
static EVENT_SYNCHRONIZE: Lazy = Lazy::new(c"cuEventSynchronize");
static EVENT_DESTROY: Lazy = Lazy::new(c"cuEventDestroy_v2");

/// `CU_EVENT_DISABLE_TIMING`: the cheapest event, for completion only.
const CU_EVENT_DISABLE_TIMING: libc::c_uint = 0x2;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;

/// Calls a resolved driver function with the given C signature.
macro_rules! call {
    ($lazy:expr, fn($($ty:ty),*) $(, $arg:expr)*) => {
        match $lazy.get() {
            // SAFETY: the slot holds the driver's function of this name, whose C
            // signature (cuda.h) is the one given here.
            Some(f) => Some(unsafe {
                std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($ty),*) -> CUresult>(f)($($arg),*)
            }),
            None => None,
        }
    };
}

/// The calling thread's current context (0: none, or no driver).
pub fn current_context() -> Handle {
    let mut context: Handle = 0;
    match call!(CTX_GET_CURRENT, fn(*mut Handle), &mut context) {
        Some(CUDA_SUCCESS) => context,
        _ => 0,
    }
}

/// Makes `context` current on the calling thread.
pub fn set_current_context(context: Handle) -> bool {
    call!(CTX_SET_CURRENT, fn(Handle), context) == Some(CUDA_SUCCESS)
}

/// Waits until the current context's submitted work has completed.
pub fn synchronize_context() -> Option<CUresult> {
    call!(CTX_SYNCHRONIZE, fn())
}

/// Whether `stream` is being captured into a graph (an error counts as no: the
/// launch will meet the same error in the driver).
pub fn stream_is_capturing(stream: Handle) -> bool {
    let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
    call!(
        STREAM_IS_CAPTURING,
        fn(Handle, *mut c_int),
        stream,
        &mut status
    ) == Some(CUDA_SUCCESS)
        && status != CU_STREAM_CAPTURE_STATUS_NONE
}

/// A completion-only event in the current context.
pub fn create_event() -> Option<Handle> {
    let mut event: Handle = 0;
    let rc = call!(
        EVENT_CREATE,
        fn(*mut Handle, libc::c_uint),
        &mut event,
        CU_EVENT_DISABLE_TIMING
    );
    (rc == Some(CUDA_SUCCESS) && event != 0).then_some(event)
}

pub fn record_event(event: Handle, stream: Handle) -> bool {
    call!(EVENT_RECORD, fn(Handle, Handle), event, stream) == Some(CUDA_SUCCESS)
}

pub fn synchronize_event(event: Handle) {
    let _ = call!(EVENT_SYNCHRONIZE, fn(Handle), event);
}

pub fn destroy_event(event: Handle) {
    let _ = call!(EVENT_DESTROY, fn(Handle), event);
}
