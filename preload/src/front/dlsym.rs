//! The exported `dlsym`: how the CUDA runtime's lookups reach our wrappers.
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

use libc::{c_char, c_void};

use crate::loader::{real_dlsym_address, DlsymFn};
use crate::symbols::Hook;

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
                super::record_real(hook, found);
                super::wrapper(hook)
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
