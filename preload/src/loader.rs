//! Dynamic loading: glibc's own `dlsym`, and the driver's definitions of the entry
//! points the library calls or forwards to. The lowest layer above the ABI types: it
//! knows libraries and names, nothing about what is wrapped.
//!
//! Constraints (the front door's `dlsym` calls `real_dlsym_address` on every lookup in
//! the process, often before `main`): no allocation, no lock, no panic, and no
//! dependence on the library having been initialised.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::{c_char, c_void};

use crate::variants::Library;

pub type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// glibc's `dlsym`: the 2.34 version where it exists (libc.so.6), else the 2.2.5 one
/// (libdl.so.2 on older glibc, the compat alias on newer). `dlvsym` is not hooked.
pub extern "C" fn real_dlsym_address() -> *mut c_void {
    let known = REAL_DLSYM.load(Ordering::Acquire);
    if !known.is_null() {
        return known;
    }
    let mut found = std::ptr::null_mut();
    for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
        // SAFETY: dlvsym with NUL-terminated literals; RTLD_NEXT from this library
        // finds glibc's definition, never ours.
        found = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
        if !found.is_null() {
            break;
        }
    }
    if found.is_null() {
        // Cannot happen with glibc; answer "not found" rather than jump to NULL.
        found = no_symbol as *const () as *mut c_void;
    }
    REAL_DLSYM.store(found, Ordering::Release);
    found
}

/// Resolves glibc's `dlsym` ahead of any lookup (called from the constructor).
pub fn resolve_real_dlsym() {
    real_dlsym_address();
}

extern "C" fn no_symbol(_: *mut c_void, _: *const c_char) -> *mut c_void {
    std::ptr::null_mut()
}

/// Calls glibc's `dlsym` from this library (so `RTLD_NEXT` means "after libgpushare").
///
/// # Safety
/// `handle` is a handle from `dlopen` or a pseudo-handle (`RTLD_NEXT`, `RTLD_DEFAULT`).
pub unsafe fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    // SAFETY: real_dlsym_address returns glibc's dlsym (or a stub with its signature).
    let f: DlsymFn = unsafe { std::mem::transmute(real_dlsym_address()) };
    // SAFETY: a valid handle or pseudo-handle, and a NUL-terminated name.
    unsafe { f(handle, name.as_ptr()) }
}

/// Finds the driver's own definition of `name`, for a wrapper called before anyone
/// looked the variant up (programs linked against libcuda call the export directly)
/// and for the helper entry points the library uses itself. Searches the loaded
/// driver library first, then the objects after libgpushare.
#[cold]
pub fn find_in_driver(library: Library, name: &CStr) -> Option<*mut c_void> {
    let soname = match library {
        Library::Cuda => c"libcuda.so.1",
        Library::Nvml => c"libnvidia-ml.so.1",
    };
    // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library (adding a
    // reference we never drop: the driver stays loaded for the process's life anyway).
    let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    let mut found = std::ptr::null_mut();
    if !handle.is_null() {
        // SAFETY: a handle dlopen just returned.
        found = unsafe { real_dlsym(handle, name) };
    }
    if found.is_null() {
        // SAFETY: RTLD_NEXT is a pseudo-handle.
        found = unsafe { real_dlsym(libc::RTLD_NEXT, name) };
    }
    (!found.is_null() && !in_this_library(found)).then_some(found)
}

/// Whether `address` lies in libgpushare itself: a lookup that found one of our own
/// exports (our wrapper of that very name) did not find the driver, and forwarding to
/// it would make the wrapper call itself. Cold (`dladdr` takes the loader's lock).
fn in_this_library(address: *mut c_void) -> bool {
    let ours = object_base(in_this_library as *const c_void);
    ours.is_some() && object_base(address) == ours
}

/// Whether `address` lies in the loaded driver library itself (not in another object
/// that interposes on it). Cold, like `in_this_library`.
pub fn in_driver_library(library: Library, address: *mut c_void) -> bool {
    let (soname, anchor) = match library {
        Library::Cuda => (c"libcuda.so.1", c"cuGetProcAddress"),
        Library::Nvml => (c"libnvidia-ml.so.1", c"nvmlInit_v2"),
    };
    // SAFETY: as in find_in_driver: RTLD_NOLOAD only finds an already loaded library.
    let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: a handle dlopen just returned; a lookup through it finds the library's
    // own definition first.
    let inside = unsafe { real_dlsym(handle, anchor) };
    let driver = object_base(inside);
    !inside.is_null() && driver.is_some() && object_base(address) == driver
}

/// The load address of the object `p` lies in, if any.
fn object_base(p: *const c_void) -> Option<*mut c_void> {
    // SAFETY: Dl_info is plain data, zeroed is a valid "nothing found".
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads `p` as an address and fills `info`.
    let found = unsafe { libc::dladdr(p, &mut info) } != 0;
    found.then_some(info.dli_fbase)
}
