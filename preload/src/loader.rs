//! The `dlsym` hook: how the CUDA runtime's lookups reach our wrappers.
//!
//! The runtime `dlopen`s `libcuda.so.1` and calls `dlsym(handle, "cuGetProcAddress_v2")`;
//! NVML users do the same with `libnvidia-ml.so.1`. Exporting `cu*` names is not
//! enough for them, so `dlsym` itself is exported: it asks the real `dlsym`, and when
//! the answer is a variant we wrap, records the driver's pointer and hands out the
//! wrapper instead.
//!
//! Constraints (every process calls this, often before `main`, and Rust's std calls
//! `dlsym` itself when it spawns a thread): no allocation, no lock, no panic, and no
//! dependence on the library having been initialised.
//!
//! `RTLD_NEXT` is special: glibc resolves it relative to the *caller's* object, found
//! from the return address. Forwarding it from Rust would make every
//! `dlsym(RTLD_NEXT, …)` in the process search after libgpushare instead of after its
//! real caller. So on x86_64 `dlsym` is a naked function that *jumps* to the real
//! `dlsym` for `RTLD_NEXT`, leaving the caller's return address in place.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::{c_char, c_void};

use crate::symbols::{self, Hook, Library};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// glibc's `dlsym`: the 2.34 version where it exists (libc.so.6), else the 2.2.5 one
/// (libdl.so.2 on older glibc, the compat alias on newer). `dlvsym` is not hooked.
extern "C" fn real_dlsym_address() -> *mut c_void {
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

/// `dlsym` for every handle but `RTLD_NEXT`: the real lookup, then the substitution.
extern "C" fn dlsym_substituting(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: real_dlsym_address returns glibc's dlsym (or a stub with its signature).
    let real: DlsymFn = unsafe { std::mem::transmute(real_dlsym_address()) };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let found = unsafe { real(handle, symbol) };
    if found.is_null() || symbol.is_null() || !crate::config::is_active() {
        return found;
    }
    crate::guard::or(found, || {
        // SAFETY: non-null, and NUL-terminated per dlsym's contract.
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        match Hook::from_exact_name(name) {
            Some(hook) => {
                symbols::record_real(hook, found);
                hook.wrapper()
            }
            None => found,
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod export {
    use super::*;

    /// The exported `dlsym`. Unversioned: glibc accepts an unversioned definition for
    /// both `dlsym@GLIBC_2.2.5` and `dlsym@GLIBC_2.34` references, so programs built
    /// against any glibc bind here.
    ///
    /// `RTLD_NEXT` ((void *)-1): save the arguments, fetch the real `dlsym`, restore
    /// and jump (the stack is as the caller left it, so glibc sees the caller's return
    /// address). Anything else: tail-jump to the substituting lookup.
    ///
    /// # Safety
    /// glibc's contract for `dlsym`.
    #[unsafe(no_mangle)]
    #[unsafe(naked)]
    pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
        core::arch::naked_asm!(
            // A landing pad for indirect-branch tracking (a no-op without CET).
            "endbr64",
            "cmp rdi, -1",
            "je 2f",
            "jmp {substituting}",
            "2:",
            "push rdi",
            "push rsi",
            // Entry rsp is 8 mod 16; after two pushes and 8 more it is 16-aligned for the call.
            "sub rsp, 8",
            "call {real}",
            "add rsp, 8",
            "pop rsi",
            "pop rdi",
            "jmp rax",
            substituting = sym dlsym_substituting,
            real = sym real_dlsym_address,
        )
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod export {
    use super::*;

    /// Portable fallback: `RTLD_NEXT` lookups made through it search after
    /// libgpushare instead of after their caller.
    ///
    /// # Safety
    /// glibc's contract for `dlsym`.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
        dlsym_substituting(handle, symbol)
    }
}

pub use export::dlsym;

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
    let ours = Hook::from_exact_name(name.to_bytes()).map(Hook::wrapper);
    (!found.is_null() && Some(found) != ours).then_some(found)
}
