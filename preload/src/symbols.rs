//! The entry points the library wraps: one exported wrapper per driver *variant*
//! (`cuLaunchKernel` and `cuLaunchKernel_ptsz` are two), and for each the real
//! driver function it forwards to.
//!
//! A variant is what the driver's (name, CUDA version, flags) lookup selects, and it
//! fixes the ABI: `cuMemAlloc` for version ≥ 3.2 is `cuMemAlloc_v2` (64-bit sizes),
//! `cuLaunchKernel` with the per-thread-default-stream flag is `cuLaunchKernel_ptsz`.
//! So the real pointer is kept per variant: every (name, version, flags) request
//! that selects a variant gets that variant's wrapper, which calls the pointer the
//! driver handed out for it. Slots are atomics: filled from `dlsym` (where no lock
//! may be taken), read on every call.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::c_void;

pub use crate::variants::Library;

macro_rules! define_hooks {
    ($( $name:ident : $library:ident $proc_address:tt => $wrapper:path ),* $(,)?) => {
        /// Every wrapped variant, named exactly as the driver exports it.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Hook { $($name),* }

        impl Hook {
            pub const ALL: &'static [Hook] = &[$(Hook::$name),*];

            pub fn name(self) -> &'static CStr {
                match self {
                    $(Hook::$name => {
                        // SAFETY: a literal with exactly one NUL, at its end.
                        unsafe { CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) }
                    })*
                }
            }

            /// The variant exported under exactly this name (no allocation, no lock:
            /// `dlsym` calls it).
            #[inline]
            pub fn from_exact_name(name: &[u8]) -> Option<Hook> {
                // Nothing but cu* and nvml* names is wrapped: one comparison rejects
                // every other lookup.
                if !(name.starts_with(b"cu") || name.starts_with(b"nvml")) {
                    return None;
                }
                $(if name == stringify!($name).as_bytes() { return Some(Hook::$name); })*
                None
            }

            pub fn library(self) -> Library {
                match self { $(Hook::$name => Library::$library),* }
            }
        }
    };
}

crate::for_each_variant!(define_hooks);

const COUNT: usize = Hook::ALL.len();

static REAL: [AtomicPtr<c_void>; COUNT] = [const { AtomicPtr::new(std::ptr::null_mut()) }; COUNT];

/// Records the driver's function for `hook`. The first pointer wins: later ones for
/// the same variant are the same function reached another way. The caller has made
/// sure it is not our own wrapper (only the front door, which hands wrappers out,
/// can tell; storing one would make the wrapper call itself).
#[inline]
pub fn record_real(hook: Hook, real: *mut c_void) {
    if real.is_null() {
        return;
    }
    let _ = REAL[hook as usize].compare_exchange(
        std::ptr::null_mut(),
        real,
        Ordering::AcqRel,
        Ordering::Acquire,
    );
}

/// The driver's function for `hook`: one atomic load once known; the first call of a
/// variant nobody looked up (a program linked against libcuda) finds it in the
/// driver library, cold.
#[inline(always)]
pub fn real(hook: Hook) -> Option<*mut c_void> {
    let p = REAL[hook as usize].load(Ordering::Acquire);
    if !p.is_null() {
        return Some(p);
    }
    resolve_real(hook)
}

/// The recorded pointer for `hook`, without looking it up (tests).
#[cfg(test)]
pub fn real_if_known(hook: Hook) -> Option<*mut c_void> {
    let p = REAL[hook as usize].load(Ordering::Acquire);
    (!p.is_null()).then_some(p)
}

#[cold]
#[inline(never)]
fn resolve_real(hook: Hook) -> Option<*mut c_void> {
    let found = crate::loader::find_in_driver(hook.library(), hook.name());
    if let Some(p) = found {
        record_real(hook, p);
    }
    let p = REAL[hook as usize].load(Ordering::Acquire);
    (!p.is_null()).then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for &h in Hook::ALL {
            assert_eq!(Hook::from_exact_name(h.name().to_bytes()), Some(h));
        }
        assert_eq!(
            Hook::from_exact_name(b"cuMemAlloc"),
            None,
            "base names are not variants"
        );
        assert_eq!(Hook::from_exact_name(b"malloc"), None);
    }

    #[test]
    fn the_first_real_pointer_wins_and_null_is_ignored() {
        // A slot no other unit test fills.
        let slot = &REAL[Hook::cuMemUnmap as usize];
        record_real(Hook::cuMemUnmap, std::ptr::null_mut());
        assert!(slot.load(Ordering::Acquire).is_null());
        record_real(Hook::cuMemUnmap, 0x1000 as *mut c_void);
        record_real(Hook::cuMemUnmap, 0x2000 as *mut c_void);
        assert_eq!(slot.load(Ordering::Acquire), 0x1000 as *mut c_void);
    }
}
