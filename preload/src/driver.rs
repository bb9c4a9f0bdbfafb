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
    let read = |attr: c_int| {
        let mut value: u64 = 0;
        // SAFETY: cuMemPoolGetAttribute(pool, attr, void*): both attributes read here are
        // cuuint64_t, so a u64 is the out-value the driver writes.
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
static STREAM_IS_CAPTURING: Lazy = Lazy::new(c"cuStreamIsCapturing");
static EVENT_CREATE: Lazy = Lazy::new(c"cuEventCreate");
static EVENT_RECORD: Lazy = Lazy::new(c"cuEventRecord");
static EVENT_SYNCHRONIZE: Lazy = Lazy::new(c"cuEventSynchronize");
static EVENT_DESTROY: Lazy = Lazy::new(c"cuEventDestroy_v2");
static CTX_FROM_GREEN_CTX: Lazy = Lazy::new(c"cuCtxFromGreenCtx");

/// `CU_EVENT_DISABLE_TIMING`: the cheapest event, for completion only.
const CU_EVENT_DISABLE_TIMING: libc::c_uint = 0x2;
/// `CU_EVENT_BLOCKING_SYNC`: `cuEventSynchronize` sleeps until the event completes,
/// instead of spinning or yielding on a core for the whole wait (what every other wait
/// does under the default `CU_CTX_SCHED_AUTO`).
const CU_EVENT_BLOCKING_SYNC: libc::c_uint = 0x1;
/// `CU_STREAM_CAPTURE_STATUS_NONE`, `_ACTIVE`.
const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;

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

/// The `CUcontext` of green context `green` (CUDA 12.4); the current context if the
/// driver cannot say.
pub fn context_of_green(green: Handle) -> Handle {
    let mut context: Handle = 0;
    match call!(
        CTX_FROM_GREEN_CTX,
        fn(*mut Handle, Handle),
        &mut context,
        green
    ) {
        Some(CUDA_SUCCESS) if context != 0 => context,
        _ => current_context(),
    }
}

/// Makes `context` current on the calling thread.
pub fn set_current_context(context: Handle) -> bool {
    call!(CTX_SET_CURRENT, fn(Handle), context) == Some(CUDA_SUCCESS)
}

/// `CUstreamCaptureStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureStatus {
    None,
    Active,
    Invalidated,
}

/// What the driver says of `stream`'s capture state (`Err`: its answer, e.g.
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` for the legacy stream while a blocking stream of
/// its context captures, which the query leaves intact). A stream that joined a capture
/// through `cuStreamWaitEvent` is capturing too. Legal from a RELAXED thread during any
/// capture.
pub fn capture_status(stream: Handle) -> Result<CaptureStatus, CUresult> {
    let mut status: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
    match call!(
        STREAM_IS_CAPTURING,
        fn(Handle, *mut c_int),
        stream,
        &mut status
    ) {
        Some(CUDA_SUCCESS) => Ok(match status {
            CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active,
            _ => CaptureStatus::Invalidated,
        }),
        Some(rc) => Err(rc),
        None => Err(CUDA_ERROR_NOT_FOUND),
    }
}

/// Whether `stream` is being captured into a graph (an error counts as no: the
/// launch will meet the same error in the driver).
pub fn stream_is_capturing(stream: Handle) -> bool {
    capture_status(stream).is_ok_and(|status| status != CaptureStatus::None)
}

/// A completion-only event in the current context whose waiters sleep: what the token
/// agent waits on, for as long as the process's kernels run, without burning a core.
pub fn create_blocking_event() -> Option<Handle> {
    create_event_with(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING)
}

/// An event that records a timestamp, for the launch-ahead ring to time launches
/// with (`elapsed_ns`).
pub fn create_timing_event() -> Option<Handle> {
    create_event_with(0)
}

fn create_event_with(flags: libc::c_uint) -> Option<Handle> {
    let mut event: Handle = 0;
    let rc = call!(
        EVENT_CREATE,
        fn(*mut Handle, libc::c_uint),
        &mut event,
        flags
    );
    (rc == Some(CUDA_SUCCESS) && event != 0).then_some(event)
}

static EVENT_ELAPSED_TIME: Lazy = Lazy::new(c"cuEventElapsedTime");

/// Nanoseconds between two completed timing events (the driver's resolution is about
/// half a microsecond); None when either lacks a timestamp or is not complete.
pub fn elapsed_ns(start: Handle, end: Handle) -> Option<u64> {
    let mut ms: f32 = 0.0;
    let rc = call!(
        EVENT_ELAPSED_TIME,
        fn(*mut f32, Handle, Handle),
        &mut ms,
        start,
        end
    );
    (rc == Some(CUDA_SUCCESS) && ms.is_finite() && ms >= 0.0).then_some((ms as f64 * 1e6) as u64)
}

pub fn record_event(event: Handle, stream: Handle) -> bool {
    call!(EVENT_RECORD, fn(Handle, Handle), event, stream) == Some(CUDA_SUCCESS)
}

pub fn synchronize_event(event: Handle) -> Option<CUresult> {
    call!(EVENT_SYNCHRONIZE, fn(Handle), event)
}

pub fn destroy_event(event: Handle) {
    let _ = call!(EVENT_DESTROY, fn(Handle), event);
}

// Capture-safe draining: the agent's calls must never conflict with a stream capture
// that another thread of the process has under way (see `gate::captures`).

static THREAD_EXCHANGE_CAPTURE_MODE: Lazy = Lazy::new(c"cuThreadExchangeStreamCaptureMode");
static STREAM_GET_CTX: Lazy = Lazy::new(c"cuStreamGetCtx");
static EVENT_QUERY: Lazy = Lazy::new(c"cuEventQuery");
static PRIMARY_CTX_GET_STATE: Lazy = Lazy::new(c"cuDevicePrimaryCtxGetState");

/// `CUstreamCaptureMode`.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `CU_STREAM_NON_BLOCKING`: a stream that does not synchronise with the legacy stream.
pub const CU_STREAM_NON_BLOCKING: libc::c_uint = 0x1;
/// `CU_STREAM_LEGACY`.
pub const CU_STREAM_LEGACY: Handle = 0x1;

/// Sets the calling thread's capture-interaction mode and returns the previous one
/// (`None`: a driver older than CUDA 10.1, which has no modes).
///
/// In the default GLOBAL mode a thread's event and stream queries are "potentially
/// unsafe" while any other thread captures in GLOBAL mode: the call fails and
/// invalidates that capture (PyTorch's default `capture_error_mode`). RELAXED lifts
/// that for the calling thread only.
pub fn exchange_capture_mode(mode: c_int) -> Option<c_int> {
    let mut value = mode;
    (call!(THREAD_EXCHANGE_CAPTURE_MODE, fn(*mut c_int), &mut value) == Some(CUDA_SUCCESS))
        .then_some(value)
}

/// The context `stream` belongs to.
pub fn stream_context(stream: Handle) -> Option<Handle> {
    let mut context: Handle = 0;
    (call!(
        STREAM_GET_CTX,
        fn(Handle, *mut Handle),
        stream,
        &mut context
    ) == Some(CUDA_SUCCESS)
        && context != 0)
        .then_some(context)
}

/// Whether a recorded event's work has completed (`Err`: the driver's answer).
pub fn query_event(event: Handle) -> Result<bool, CUresult> {
    const CUDA_ERROR_NOT_READY: CUresult = 600;
    match call!(EVENT_QUERY, fn(Handle), event) {
        Some(CUDA_SUCCESS) => Ok(true),
        Some(CUDA_ERROR_NOT_READY) => Ok(false),
        Some(rc) => Err(rc),
        None => Err(CUDA_ERROR_NOT_FOUND),
    }
}

/// Whether `device`'s primary context is alive (retained at least once).
pub fn primary_context_active(device: CUdevice) -> Option<bool> {
    let (mut flags, mut active): (libc::c_uint, c_int) = (0, 0);
    (call!(
        PRIMARY_CTX_GET_STATE,
        fn(CUdevice, *mut libc::c_uint, *mut c_int),
        device,
        &mut flags,
        &mut active
    ) == Some(CUDA_SUCCESS))
    .then_some(active != 0)
}
