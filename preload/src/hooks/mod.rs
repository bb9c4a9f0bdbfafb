//! The exported wrappers, one per wrapped driver variant (see `symbols`).
//!
//! Each catches panics, forwards to the driver function recorded for its variant,
//! and does its one job around the call: gate a launch, copy or memset, charge an allocation,
//! virtualise a memory answer, or record the process's contexts, streams and
//! captures for the gate.

pub mod copy;
pub mod info;
pub mod launch;
pub mod memory;
pub mod work;

/// The driver's function for a variant, typed with that variant's signature; an
/// unresolvable one makes the wrapper answer `CUDA_ERROR_NOT_FOUND`.
macro_rules! real_fn {
    ($hook:ident : fn($($arg:ty),*) -> $ret:ty) => {
        match $crate::symbols::real($crate::symbols::Hook::$hook) {
            // SAFETY: the slot holds the driver's function for exactly this variant
            // (symbols.rs), whose C signature this is (cuda.h / nvml.h).
            Some(p) => unsafe {
                std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn($($arg),*) -> $ret>(p)
            },
            None => return $crate::cuda::CUDA_ERROR_NOT_FOUND,
        }
    };
}
pub(crate) use real_fn;
