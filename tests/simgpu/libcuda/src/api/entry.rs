//! `cuGetProcAddress` / `_v2` and error strings.

use crate::procaddr::{resolve, Resolution, SymbolStatus};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_char, c_int, c_void};
use std::ffi::CStr;
use std::sync::OnceLock;

/// Test hook, off unless set: `SIMGPU_UNEXPORTED_VARIANT=cuMemAlloc` makes `cuGetProcAddress`
/// answer `cuMemAlloc` requests with a function that is *not* the driver's `cuMemAlloc_v2`
/// export, as a future driver may once it adds an ABI variant the caller's table does not
/// know. An interposer must then pass the answer through rather than call it through its
/// `cuMemAlloc_v2` wrapper. (The function behaves as `cuMemAlloc_v2`, so programs still work.)
fn unexported_variant_for(name: &str) -> Option<*mut c_void> {
    static NAMES: OnceLock<Vec<String>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        std::env::var("SIMGPU_UNEXPORTED_VARIANT")
            .map(|v| v.split(',').map(|n| n.trim().to_owned()).collect())
            .unwrap_or_default()
    });
    (name == "cuMemAlloc" && names.iter().any(|n| n == name))
        .then_some(unexported_mem_alloc as *mut c_void)
}

/// Not exported (no `no_mangle`): reachable only through `cuGetProcAddress` with the hook on.
extern "C" fn unexported_mem_alloc(dptr: *mut u64, size: usize) -> CUresult {
    // SAFETY: the same contract as cuMemAlloc_v2, which this stands for.
    unsafe { super::memory::cuMemAlloc_v2(dptr, size) }
}

fn get_proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut i32,
) -> Result<(), CudaError> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CudaError::InvalidValue);
    }
    // SAFETY: a NUL-terminated name per the API contract.
    let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
    let (address, outcome) =
        match resolve(name, cuda_version, flags, super::device::driver_version()) {
            Resolution::Found(s) => match unexported_variant_for(name).or(crate::export_address(s))
            {
                Some(a) => (a, SymbolStatus::Success),
                None => (std::ptr::null_mut(), SymbolStatus::SymbolNotFound),
            },
            Resolution::VersionNotSufficient => {
                (std::ptr::null_mut(), SymbolStatus::VersionNotSufficient)
            }
            Resolution::SymbolNotFound => (std::ptr::null_mut(), SymbolStatus::SymbolNotFound),
            Resolution::InvalidRequest => return Err(CudaError::InvalidValue),
        };
    // SAFETY: checked non-null; out-parameters per the API contract (symbolStatus is optional,
    // and the CUDA runtime does pass NULL).
    unsafe {
        write_out(pfn, address)?;
        if !status.is_null() {
            write_out(status, outcome as i32)?;
        }
    }
    // A NULL pointer comes with CUDA_ERROR_NOT_FOUND, as drivers in the field return it; callers
    // must check the pointer (and symbolStatus) either way.
    if outcome == SymbolStatus::Success {
        Ok(())
    } else {
        Err(CudaError::NotFound)
    }
}

/// CUDA 11.3–11.8 form, without `symbolStatus`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    guard(|| get_proc_address(symbol, pfn, cuda_version, flags, std::ptr::null_mut()))
}

/// CUDA 12.0+ form (`cuGetProcAddress` in 12.x headers is a macro for it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    guard(|| get_proc_address(symbol, pfn, cuda_version, flags, status))
}

/// What cuda.h's `cuGetProcAddress` macro becomes in a per-thread-default-stream build
/// (`--default-stream per-thread`, `CUDA_API_PER_THREAD_DEFAULT_STREAM`): the same call, except
/// that flags `CU_GET_PROC_ADDRESS_DEFAULT` (0) mean `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_
/// STREAM`, so the program gets the `_ptsz` variants its own compilation mode implies.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    let flags = if flags == 0 {
        crate::procaddr::FLAG_PER_THREAD_DEFAULT_STREAM
    } else {
        flags
    };
    guard(|| get_proc_address(symbol, pfn, cuda_version, flags, status))
}

/// `CUDART_INTERFACE`: the private table the CUDA runtime asks `cuGetExportTable` for (the
/// GUID as ZLUDA's dump of the real driver records it).
const CUDART_INTERFACE: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];
/// Its entries: the table's size in bytes first, then functions; entry 2 hands the runtime
/// a device's primary context without `cuDevicePrimaryCtxRetain` (what cudart's lazy
/// initialisation uses, so an interposer never sees the context created). The other
/// entries are not simulated (NULL).
const CUDART_INTERFACE_ENTRIES: usize = 10;
const CUDART_PRIMARY_CONTEXT_ENTRY: usize = 2;

/// The table, as pointer-sized words (a `usize` size, then function addresses).
struct ExportTable([usize; CUDART_INTERFACE_ENTRIES]);

static CUDART_TABLE: OnceLock<ExportTable> = OnceLock::new();

fn cudart_table() -> &'static ExportTable {
    CUDART_TABLE.get_or_init(|| {
        let mut entries = [0usize; CUDART_INTERFACE_ENTRIES];
        entries[0] = std::mem::size_of::<ExportTable>();
        entries[CUDART_PRIMARY_CONTEXT_ENTRY] = cudart_primary_context as *const () as usize;
        ExportTable(entries)
    })
}

/// Entry 2 of `CUDART_INTERFACE`: the device's primary context, retained (created if it
/// does not exist), written to `pctx`.
extern "C" fn cudart_primary_context(pctx: *mut usize, dev: libc::c_int) -> CUresult {
    // SAFETY: the runtime's contract: `pctx` is an out-parameter for a CUcontext.
    unsafe { super::context::cuDevicePrimaryCtxRetain(pctx, dev) }
}

/// `cuGetExportTable`: the driver's private interfaces by GUID. Only `CUDART_INTERFACE` is
/// simulated; any other GUID is `CUDA_ERROR_INVALID_VALUE`, as are NULL arguments.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetExportTable(table: *mut *const c_void, id: *const u8) -> CUresult {
    guard(|| {
        if table.is_null() || id.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: a CUuuid is 16 bytes, per the API contract.
        let id = unsafe { std::slice::from_raw_parts(id, 16) };
        if id != CUDART_INTERFACE {
            return Err(CudaError::InvalidValue);
        }
        let entries: *const c_void = cudart_table().0.as_ptr().cast();
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(table, entries) }
    })
}

fn error_text(error: CUresult, out: *mut *const c_char, name: bool) -> Result<(), CudaError> {
    let text: &'static [u8] = match (error, CudaError::from_code(error)) {
        (0, _) if name => b"CUDA_SUCCESS\0",
        (0, _) => b"no error\0",
        (_, Some(e)) if name => e.name(),
        (_, Some(e)) => e.description(),
        (_, None) => {
            // SAFETY: out-parameter per the API contract: NULL on an unknown code.
            unsafe { write_out(out, std::ptr::null())? };
            return Err(CudaError::InvalidValue);
        }
    };
    // SAFETY: out-parameter per the API contract; the string is static and NUL-terminated.
    unsafe { write_out(out, text.as_ptr() as *const c_char) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, out: *mut *const c_char) -> CUresult {
    guard(|| error_text(error, out, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, out: *mut *const c_char) -> CUresult {
    guard(|| error_text(error, out, true))
}
