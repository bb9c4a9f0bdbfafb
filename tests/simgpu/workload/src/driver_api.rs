//! The driver, obtained the way the CUDA runtime obtains it: `dlopen("libcuda.so.1")`,
//! `dlsym(handle, "cuGetProcAddress_v2")`, then every other entry point through it. Nothing
//! links against libcuda, so an interposer is exercised on the path real programs take.

use libc::{c_char, c_int, c_uint, c_void};
use std::ffi::CString;

/// The CUDA version this program was "built" against: the ABI of every pointer it asks for.
pub const CUDA_VERSION: c_int = 12040;
/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

pub type CuResult = c_int;
/// `simgpuEventTimestampNs`: the simulated driver's extension (absent from real drivers).
pub type EventTimestampNs = unsafe extern "C" fn(usize, *mut u64) -> CuResult;
type GetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("dlopen(libcuda.so.1) failed: {0}")]
    Open(String),
    #[error("libcuda.so.1 has no cuGetProcAddress_v2")]
    NoGetProcAddress,
    #[error("cuGetProcAddress_v2({name}) failed with {code} (status {status})")]
    Missing {
        name: &'static str,
        code: c_int,
        status: c_int,
    },
}

/// The entry points the workload uses, with the signatures of CUDA 12.4's cudaTypedefs.h.
pub struct Driver {
    pub init: unsafe extern "C" fn(c_uint) -> CuResult,
    pub device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    pub primary_ctx_retain: unsafe extern "C" fn(*mut usize, c_int) -> CuResult,
    pub ctx_set_current: unsafe extern "C" fn(usize) -> CuResult,
    pub ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    pub module_load_data: unsafe extern "C" fn(*mut usize, *const c_void) -> CuResult,
    pub module_get_function: unsafe extern "C" fn(*mut usize, usize, *const c_char) -> CuResult,
    pub mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    pub mem_alloc_managed: unsafe extern "C" fn(*mut u64, usize, c_uint) -> CuResult,
    pub mem_free: unsafe extern "C" fn(u64) -> CuResult,
    pub launch_kernel: unsafe extern "C" fn(
        usize,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        usize,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    pub stream_synchronize: unsafe extern "C" fn(usize) -> CuResult,
    pub event_create: unsafe extern "C" fn(*mut usize, c_uint) -> CuResult,
    pub event_record: unsafe extern "C" fn(usize, usize) -> CuResult,
    pub event_synchronize: unsafe extern "C" fn(usize) -> CuResult,
    pub event_destroy: unsafe extern "C" fn(usize) -> CuResult,
    pub get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// Streams, capture and graphs: resolved only for `--graph` (older drivers lack some).
    pub graph: Option<GraphApi>,
    /// Found with `dlsym` on the library's handle: `cuGetProcAddress` never hands it out.
    pub event_timestamp_ns: Option<EventTimestampNs>,
}

/// What `--graph` needs: a created stream, stream capture, instantiation and launch.
pub struct GraphApi {
    pub stream_create: unsafe extern "C" fn(*mut usize, c_uint) -> CuResult,
    pub stream_destroy: unsafe extern "C" fn(usize) -> CuResult,
    /// `cuStreamBeginCapture_v2(stream, CUstreamCaptureMode)`.
    pub stream_begin_capture: unsafe extern "C" fn(usize, c_int) -> CuResult,
    pub stream_end_capture: unsafe extern "C" fn(usize, *mut usize) -> CuResult,
    /// `cuGraphInstantiateWithFlags(exec, graph, flags)`: unlike `cuGraphInstantiate`, whose
    /// signature changed in CUDA 12, the same ABI at every version.
    pub graph_instantiate: unsafe extern "C" fn(*mut usize, usize, u64) -> CuResult,
    pub graph_launch: unsafe extern "C" fn(usize, usize) -> CuResult,
    pub graph_exec_destroy: unsafe extern "C" fn(usize) -> CuResult,
    pub graph_destroy: unsafe extern "C" fn(usize) -> CuResult,
}

impl Driver {
    // Each transmute's target is the struct field it initialises, which spells the signature.
    #[allow(clippy::missing_transmute_annotations)]
    pub fn load(per_thread_default_stream: bool, graph: bool) -> Result<Driver, LoadError> {
        let name = CString::new("libcuda.so.1").expect("no NUL");
        // SAFETY: dlopen/dlsym with valid NUL-terminated strings; the handle is never closed, so
        // every pointer obtained through it stays valid for the life of the process. The
        // extension's signature is the one tests/simgpu/README.md documents.
        let (get_proc, event_timestamp_ns): (GetProcAddress, Option<EventTimestampNs>) = unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
            if handle.is_null() {
                let err = libc::dlerror();
                let text = if err.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(err).to_string_lossy().into()
                };
                return Err(LoadError::Open(text));
            }
            let sym = libc::dlsym(handle, c"cuGetProcAddress_v2".as_ptr());
            if sym.is_null() {
                return Err(LoadError::NoGetProcAddress);
            }
            let extension = libc::dlsym(handle, c"simgpuEventTimestampNs".as_ptr());
            (
                std::mem::transmute::<*mut c_void, GetProcAddress>(sym),
                (!extension.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, EventTimestampNs>(extension)),
            )
        };
        let flags = if per_thread_default_stream {
            PER_THREAD_DEFAULT_STREAM
        } else {
            0
        };
        let resolve = |name: &'static str| -> Result<*mut c_void, LoadError> {
            let c = CString::new(name).expect("no NUL");
            let (mut pfn, mut status) = (std::ptr::null_mut(), -1);
            // SAFETY: cuGetProcAddress_v2 with valid out-pointers.
            let code = unsafe { get_proc(c.as_ptr(), &mut pfn, CUDA_VERSION, flags, &mut status) };
            if code != 0 || pfn.is_null() {
                return Err(LoadError::Missing { name, code, status });
            }
            Ok(pfn)
        };
        macro_rules! entry {
            ($name:literal) => {
                // SAFETY: the driver returned the entry point for CUDA_VERSION, whose ABI is the
                // field's type (cudaTypedefs.h's PFN_<name>_v<version>).
                unsafe { std::mem::transmute::<*mut c_void, _>(resolve($name)?) }
            };
        }
        Ok(Driver {
            init: entry!("cuInit"),
            device_get: entry!("cuDeviceGet"),
            primary_ctx_retain: entry!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: entry!("cuCtxSetCurrent"),
            ctx_synchronize: entry!("cuCtxSynchronize"),
            module_load_data: entry!("cuModuleLoadData"),
            module_get_function: entry!("cuModuleGetFunction"),
            mem_alloc: entry!("cuMemAlloc"),
            mem_alloc_managed: entry!("cuMemAllocManaged"),
            mem_free: entry!("cuMemFree"),
            launch_kernel: entry!("cuLaunchKernel"),
            stream_synchronize: entry!("cuStreamSynchronize"),
            event_create: entry!("cuEventCreate"),
            event_record: entry!("cuEventRecord"),
            event_synchronize: entry!("cuEventSynchronize"),
            event_destroy: entry!("cuEventDestroy"),
            get_error_name: entry!("cuGetErrorName"),
            graph: if graph {
                Some(GraphApi {
                    stream_create: entry!("cuStreamCreate"),
                    stream_destroy: entry!("cuStreamDestroy"),
                    stream_begin_capture: entry!("cuStreamBeginCapture"),
                    stream_end_capture: entry!("cuStreamEndCapture"),
                    graph_instantiate: entry!("cuGraphInstantiateWithFlags"),
                    graph_launch: entry!("cuGraphLaunch"),
                    graph_exec_destroy: entry!("cuGraphExecDestroy"),
                    graph_destroy: entry!("cuGraphDestroy"),
                })
            } else {
                None
            },
            event_timestamp_ns,
        })
    }

    /// `CUDA_ERROR_...` for a code.
    pub fn error_name(&self, code: CuResult) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string (or NULL).
        if unsafe { (self.get_error_name)(code, &mut p) } != 0 || p.is_null() {
            return format!("CUDA_ERROR_{code}");
        }
        // SAFETY: non-null static NUL-terminated string from the driver.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}
