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

use crate::hooks::{copy, info, launch, memory, work};
use crate::{loader, procaddr};

/// Which library an entry point lives in (where a lazy lookup searches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    Cuda,
    Nvml,
}

macro_rules! hook_table {
    ($( $library:ident : $name:ident => $wrapper:path ),* $(,)?) => {
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

            /// Address of this variant's exported wrapper.
            pub fn wrapper(self) -> *mut c_void {
                match self { $(Hook::$name => $wrapper as *const () as *mut c_void),* }
            }

            pub fn library(self) -> Library {
                match self { $(Hook::$name => Library::$library),* }
            }
        }
    };
}

hook_table! {
    Cuda: cuGetProcAddress => procaddr::cuGetProcAddress,
    Cuda: cuGetProcAddress_v2 => procaddr::cuGetProcAddress_v2,
    Cuda: cuGetProcAddress_v2_ptsz => procaddr::cuGetProcAddress_v2_ptsz,
    // Launches: one gate.
    Cuda: cuLaunchKernel => launch::cuLaunchKernel,
    Cuda: cuLaunchKernel_ptsz => launch::cuLaunchKernel_ptsz,
    Cuda: cuLaunchKernelEx => launch::cuLaunchKernelEx,
    Cuda: cuLaunchKernelEx_ptsz => launch::cuLaunchKernelEx_ptsz,
    Cuda: cuLaunchCooperativeKernel => launch::cuLaunchCooperativeKernel,
    Cuda: cuLaunchCooperativeKernel_ptsz => launch::cuLaunchCooperativeKernel_ptsz,
    Cuda: cuGraphLaunch => launch::cuGraphLaunch,
    Cuda: cuGraphLaunch_ptsz => launch::cuGraphLaunch_ptsz,
    Cuda: cuLaunch => launch::cuLaunch,
    Cuda: cuLaunchGrid => launch::cuLaunchGrid,
    Cuda: cuLaunchGridAsync => launch::cuLaunchGridAsync,
    // Copies and memsets: GPU work, the same gate.
    Cuda: cuMemcpy => copy::cuMemcpy,
    Cuda: cuMemcpy_ptds => copy::cuMemcpy_ptds,
    Cuda: cuMemcpyHtoD_v2 => copy::cuMemcpyHtoD_v2,
    Cuda: cuMemcpyHtoD_v2_ptds => copy::cuMemcpyHtoD_v2_ptds,
    Cuda: cuMemcpyDtoH_v2 => copy::cuMemcpyDtoH_v2,
    Cuda: cuMemcpyDtoH_v2_ptds => copy::cuMemcpyDtoH_v2_ptds,
    Cuda: cuMemcpyDtoD_v2 => copy::cuMemcpyDtoD_v2,
    Cuda: cuMemcpyDtoD_v2_ptds => copy::cuMemcpyDtoD_v2_ptds,
    Cuda: cuMemcpyDtoA_v2 => copy::cuMemcpyDtoA_v2,
    Cuda: cuMemcpyDtoA_v2_ptds => copy::cuMemcpyDtoA_v2_ptds,
    Cuda: cuMemcpyAtoD_v2 => copy::cuMemcpyAtoD_v2,
    Cuda: cuMemcpyAtoD_v2_ptds => copy::cuMemcpyAtoD_v2_ptds,
    Cuda: cuMemcpyHtoA_v2 => copy::cuMemcpyHtoA_v2,
    Cuda: cuMemcpyHtoA_v2_ptds => copy::cuMemcpyHtoA_v2_ptds,
    Cuda: cuMemcpyAtoH_v2 => copy::cuMemcpyAtoH_v2,
    Cuda: cuMemcpyAtoH_v2_ptds => copy::cuMemcpyAtoH_v2_ptds,
    Cuda: cuMemcpyAtoA_v2 => copy::cuMemcpyAtoA_v2,
    Cuda: cuMemcpyAtoA_v2_ptds => copy::cuMemcpyAtoA_v2_ptds,
    Cuda: cuMemcpyPeer => copy::cuMemcpyPeer,
    Cuda: cuMemcpyPeer_ptds => copy::cuMemcpyPeer_ptds,
    Cuda: cuMemcpy2D_v2 => copy::cuMemcpy2D_v2,
    Cuda: cuMemcpy2D_v2_ptds => copy::cuMemcpy2D_v2_ptds,
    Cuda: cuMemcpy2DUnaligned_v2 => copy::cuMemcpy2DUnaligned_v2,
    Cuda: cuMemcpy2DUnaligned_v2_ptds => copy::cuMemcpy2DUnaligned_v2_ptds,
    Cuda: cuMemcpy3D_v2 => copy::cuMemcpy3D_v2,
    Cuda: cuMemcpy3D_v2_ptds => copy::cuMemcpy3D_v2_ptds,
    Cuda: cuMemcpy3DPeer => copy::cuMemcpy3DPeer,
    Cuda: cuMemcpy3DPeer_ptds => copy::cuMemcpy3DPeer_ptds,
    Cuda: cuMemcpyAsync => copy::cuMemcpyAsync,
    Cuda: cuMemcpyAsync_ptsz => copy::cuMemcpyAsync_ptsz,
    Cuda: cuMemcpyHtoDAsync_v2 => copy::cuMemcpyHtoDAsync_v2,
    Cuda: cuMemcpyHtoDAsync_v2_ptsz => copy::cuMemcpyHtoDAsync_v2_ptsz,
    Cuda: cuMemcpyDtoHAsync_v2 => copy::cuMemcpyDtoHAsync_v2,
    Cuda: cuMemcpyDtoHAsync_v2_ptsz => copy::cuMemcpyDtoHAsync_v2_ptsz,
    Cuda: cuMemcpyDtoDAsync_v2 => copy::cuMemcpyDtoDAsync_v2,
    Cuda: cuMemcpyDtoDAsync_v2_ptsz => copy::cuMemcpyDtoDAsync_v2_ptsz,
    Cuda: cuMemcpyHtoAAsync_v2 => copy::cuMemcpyHtoAAsync_v2,
    Cuda: cuMemcpyHtoAAsync_v2_ptsz => copy::cuMemcpyHtoAAsync_v2_ptsz,
    Cuda: cuMemcpyAtoHAsync_v2 => copy::cuMemcpyAtoHAsync_v2,
    Cuda: cuMemcpyAtoHAsync_v2_ptsz => copy::cuMemcpyAtoHAsync_v2_ptsz,
    Cuda: cuMemcpyPeerAsync => copy::cuMemcpyPeerAsync,
    Cuda: cuMemcpyPeerAsync_ptsz => copy::cuMemcpyPeerAsync_ptsz,
    Cuda: cuMemcpy2DAsync_v2 => copy::cuMemcpy2DAsync_v2,
    Cuda: cuMemcpy2DAsync_v2_ptsz => copy::cuMemcpy2DAsync_v2_ptsz,
    Cuda: cuMemcpy3DAsync_v2 => copy::cuMemcpy3DAsync_v2,
    Cuda: cuMemcpy3DAsync_v2_ptsz => copy::cuMemcpy3DAsync_v2_ptsz,
    Cuda: cuMemcpy3DPeerAsync => copy::cuMemcpy3DPeerAsync,
    Cuda: cuMemcpy3DPeerAsync_ptsz => copy::cuMemcpy3DPeerAsync_ptsz,
    Cuda: cuMemsetD8_v2 => copy::cuMemsetD8_v2,
    Cuda: cuMemsetD8_v2_ptds => copy::cuMemsetD8_v2_ptds,
    Cuda: cuMemsetD16_v2 => copy::cuMemsetD16_v2,
    Cuda: cuMemsetD16_v2_ptds => copy::cuMemsetD16_v2_ptds,
    Cuda: cuMemsetD32_v2 => copy::cuMemsetD32_v2,
    Cuda: cuMemsetD32_v2_ptds => copy::cuMemsetD32_v2_ptds,
    Cuda: cuMemsetD2D8_v2 => copy::cuMemsetD2D8_v2,
    Cuda: cuMemsetD2D8_v2_ptds => copy::cuMemsetD2D8_v2_ptds,
    Cuda: cuMemsetD2D16_v2 => copy::cuMemsetD2D16_v2,
    Cuda: cuMemsetD2D16_v2_ptds => copy::cuMemsetD2D16_v2_ptds,
    Cuda: cuMemsetD2D32_v2 => copy::cuMemsetD2D32_v2,
    Cuda: cuMemsetD2D32_v2_ptds => copy::cuMemsetD2D32_v2_ptds,
    Cuda: cuMemsetD8Async => copy::cuMemsetD8Async,
    Cuda: cuMemsetD8Async_ptsz => copy::cuMemsetD8Async_ptsz,
    Cuda: cuMemsetD16Async => copy::cuMemsetD16Async,
    Cuda: cuMemsetD16Async_ptsz => copy::cuMemsetD16Async_ptsz,
    Cuda: cuMemsetD32Async => copy::cuMemsetD32Async,
    Cuda: cuMemsetD32Async_ptsz => copy::cuMemsetD32Async_ptsz,
    Cuda: cuMemsetD2D8Async => copy::cuMemsetD2D8Async,
    Cuda: cuMemsetD2D8Async_ptsz => copy::cuMemsetD2D8Async_ptsz,
    Cuda: cuMemsetD2D16Async => copy::cuMemsetD2D16Async,
    Cuda: cuMemsetD2D16Async_ptsz => copy::cuMemsetD2D16Async_ptsz,
    Cuda: cuMemsetD2D32Async => copy::cuMemsetD2D32Async,
    Cuda: cuMemsetD2D32Async_ptsz => copy::cuMemsetD2D32Async_ptsz,
    Cuda: cuMemcpyBatchAsync => copy::cuMemcpyBatchAsync,
    Cuda: cuMemcpyBatchAsync_ptsz => copy::cuMemcpyBatchAsync_ptsz,
    Cuda: cuMemcpyBatchAsync_v2 => copy::cuMemcpyBatchAsync_v2,
    Cuda: cuMemcpyBatchAsync_v2_ptsz => copy::cuMemcpyBatchAsync_v2_ptsz,
    Cuda: cuMemcpy3DBatchAsync => copy::cuMemcpy3DBatchAsync,
    Cuda: cuMemcpy3DBatchAsync_ptsz => copy::cuMemcpy3DBatchAsync_ptsz,
    Cuda: cuMemcpy3DBatchAsync_v2 => copy::cuMemcpy3DBatchAsync_v2,
    Cuda: cuMemcpy3DBatchAsync_v2_ptsz => copy::cuMemcpy3DBatchAsync_v2_ptsz,
    // Memory: charged before, credited after.
    Cuda: cuMemAlloc_v2 => memory::cuMemAlloc_v2,
    Cuda: cuMemAllocPitch_v2 => memory::cuMemAllocPitch_v2,
    Cuda: cuMemAllocManaged => memory::cuMemAllocManaged,
    Cuda: cuMemFree_v2 => memory::cuMemFree_v2,
    Cuda: cuArrayCreate_v2 => memory::cuArrayCreate_v2,
    Cuda: cuArray3DCreate_v2 => memory::cuArray3DCreate_v2,
    Cuda: cuArrayDestroy => memory::cuArrayDestroy,
    Cuda: cuMipmappedArrayCreate => memory::cuMipmappedArrayCreate,
    Cuda: cuMipmappedArrayDestroy => memory::cuMipmappedArrayDestroy,
    Cuda: cuMemAllocAsync => memory::cuMemAllocAsync,
    Cuda: cuMemAllocAsync_ptsz => memory::cuMemAllocAsync_ptsz,
    Cuda: cuMemAllocFromPoolAsync => memory::cuMemAllocFromPoolAsync,
    Cuda: cuMemAllocFromPoolAsync_ptsz => memory::cuMemAllocFromPoolAsync_ptsz,
    Cuda: cuMemFreeAsync => memory::cuMemFreeAsync,
    Cuda: cuMemFreeAsync_ptsz => memory::cuMemFreeAsync_ptsz,
    Cuda: cuMemPoolCreate => memory::cuMemPoolCreate,
    Cuda: cuMemPoolDestroy => memory::cuMemPoolDestroy,
    Cuda: cuMemPoolTrimTo => memory::cuMemPoolTrimTo,
    Cuda: cuMemCreate => memory::cuMemCreate,
    Cuda: cuMemRelease => memory::cuMemRelease,
    Cuda: cuMemMap => memory::cuMemMap,
    Cuda: cuMemUnmap => memory::cuMemUnmap,
    Cuda: cuMemExportToShareableHandle => memory::cuMemExportToShareableHandle,
    // The gate's record of the process's work: contexts, streams, captures.
    Cuda: cuStreamCreate => work::cuStreamCreate,
    Cuda: cuStreamCreateWithPriority => work::cuStreamCreateWithPriority,
    Cuda: cuStreamDestroy_v2 => work::cuStreamDestroy_v2,
    Cuda: cuStreamBeginCapture => work::cuStreamBeginCapture,
    Cuda: cuStreamBeginCapture_ptsz => work::cuStreamBeginCapture_ptsz,
    Cuda: cuStreamBeginCapture_v2 => work::cuStreamBeginCapture_v2,
    Cuda: cuStreamBeginCapture_v2_ptsz => work::cuStreamBeginCapture_v2_ptsz,
    Cuda: cuStreamBeginCaptureToGraph => work::cuStreamBeginCaptureToGraph,
    Cuda: cuStreamBeginCaptureToGraph_ptsz => work::cuStreamBeginCaptureToGraph_ptsz,
    Cuda: cuStreamEndCapture => work::cuStreamEndCapture,
    Cuda: cuStreamEndCapture_ptsz => work::cuStreamEndCapture_ptsz,
    Cuda: cuDevicePrimaryCtxRetain => work::cuDevicePrimaryCtxRetain,
    Cuda: cuDevicePrimaryCtxRelease => work::cuDevicePrimaryCtxRelease,
    Cuda: cuDevicePrimaryCtxRelease_v2 => work::cuDevicePrimaryCtxRelease_v2,
    Cuda: cuDevicePrimaryCtxReset => work::cuDevicePrimaryCtxReset,
    Cuda: cuDevicePrimaryCtxReset_v2 => work::cuDevicePrimaryCtxReset_v2,
    Cuda: cuCtxCreate_v2 => work::cuCtxCreate_v2,
    Cuda: cuCtxCreate_v3 => work::cuCtxCreate_v3,
    Cuda: cuCtxCreate_v4 => work::cuCtxCreate_v4,
    Cuda: cuCtxDestroy_v2 => work::cuCtxDestroy_v2,
    Cuda: cuGreenCtxCreate => work::cuGreenCtxCreate,
    // Virtualised answers.
    Cuda: cuMemGetInfo_v2 => info::cuMemGetInfo_v2,
    Cuda: cuDeviceTotalMem_v2 => info::cuDeviceTotalMem_v2,
    Nvml: nvmlDeviceGetMemoryInfo => info::nvmlDeviceGetMemoryInfo,
    Nvml: nvmlDeviceGetMemoryInfo_v2 => info::nvmlDeviceGetMemoryInfo_v2,
}

const COUNT: usize = Hook::ALL.len();

static REAL: [AtomicPtr<c_void>; COUNT] = [const { AtomicPtr::new(std::ptr::null_mut()) }; COUNT];

/// Records the driver's function for `hook`, unless it is our own wrapper (a lookup
/// through `RTLD_DEFAULT` or our own handle finds the wrapper first: storing it would
/// make the wrapper call itself). The first pointer wins: later ones for the same
/// variant are the same function reached another way.
#[inline]
pub fn record_real(hook: Hook, real: *mut c_void) {
    if real.is_null() || real == hook.wrapper() {
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

#[cold]
#[inline(never)]
fn resolve_real(hook: Hook) -> Option<*mut c_void> {
    let found = loader::find_in_driver(hook.library(), hook.name());
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
    fn names_round_trip_and_wrappers_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for &h in Hook::ALL {
            assert_eq!(Hook::from_exact_name(h.name().to_bytes()), Some(h));
            assert!(seen.insert(h.wrapper()), "{h:?} shares a wrapper");
        }
        assert_eq!(
            Hook::from_exact_name(b"cuMemAlloc"),
            None,
            "base names are not variants"
        );
        assert_eq!(Hook::from_exact_name(b"malloc"), None);
    }

    #[test]
    fn own_wrapper_is_never_recorded_as_real() {
        // A slot no other unit test fills.
        record_real(Hook::cuMemUnmap, Hook::cuMemUnmap.wrapper());
        assert!(REAL[Hook::cuMemUnmap as usize]
            .load(Ordering::Acquire)
            .is_null());
    }
}
