//! `cuGetProcAddress` / `_v2`: the way the CUDA runtime (11.3+) obtains every entry
//! point. The request names a *base* name, the CUDA version the caller was built
//! against, and flags; the driver answers with the variant of that ABI. We forward
//! the request, and when the variant is one we wrap, record the driver's pointer and
//! answer with our wrapper for exactly that variant.
//!
//! The variant is selected here from the same thresholds the driver uses
//! (cudaTypedefs.h: `PFN_cuMemAlloc_v3020` is `cuMemAlloc_v2`), so a caller built
//! for an older CUDA never gets a newer ABI, and a per-thread-default-stream request
//! gets the `_ptsz` wrapper that calls the driver's `_ptsz` function. A request this
//! table cannot place (an older ABI than any variant we wrap) keeps the driver's own
//! answer. Which answers are wrapped is `wraps_answer`: the driver's export of the
//! variant and anything from outside the driver (another interposer, a tracer), never
//! a driver function the table does not know. The resolver itself is wrapped like any
//! variant, whatever the flags of the request for it, so nothing resolved later escapes.

use libc::{c_char, c_int, c_void};
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use crate::cuda::*;
use crate::symbols::{self, Hook};
use crate::variants::Stream;

/// A `cuGetProcAddress` request that selects a variant: its base name, the first CUDA
/// version whose request selects it, and the stream its flags ask for.
#[derive(Debug, Clone, Copy)]
struct Selects {
    base: &'static str,
    since: c_int,
    stream: Stream,
    hook: Hook,
}

macro_rules! define_requests {
    ($( $name:ident : $library:ident ( $($base:ident $since:literal $stream:ident)? ) => $wrapper:path ),* $(,)?) => {
        /// Every variant `cuGetProcAddress` hands out, from the one declaration
        /// (`variants`).
        const TABLE: &[Selects] = &[
            $($(Selects { base: stringify!($base), since: $since, stream: Stream::$stream, hook: Hook::$name },)?)*
        ];
    };
}

crate::for_each_variant!(define_requests);

/// The variant a request selects, if it is one we wrap: of the variants of that base
/// name for the stream the flags ask for (the legacy ones if the function takes no
/// stream), the newest whose threshold the caller's version reaches.
pub fn select(name: &[u8], cuda_version: c_int, flags: u64) -> Option<Hook> {
    let of_name = || TABLE.iter().filter(|s| s.base.as_bytes() == name);
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0
        && of_name().any(|s| s.stream == Stream::PerThread);
    let stream = if per_thread {
        Stream::PerThread
    } else {
        Stream::Legacy
    };
    of_name()
        .filter(|s| s.stream == stream && s.since <= cuda_version)
        .max_by_key(|s| s.since)
        .map(|s| s.hook)
}

/// Whether `name` is a base name some variant is selected by.
fn is_wrapped_base(name: &[u8]) -> bool {
    TABLE.iter().any(|s| s.base.as_bytes() == name)
}

/// The flags a `cuGetProcAddress_v2_ptsz` request means: cuda.h defines
/// `CU_GET_PROC_ADDRESS_DEFAULT` as the per-thread-default-stream search in code
/// compiled for per-thread default streams, which is what calls this variant.
pub fn per_thread_build_flags(flags: u64) -> u64 {
    if flags == CU_GET_PROC_ADDRESS_DEFAULT {
        CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
    } else {
        flags
    }
}

/// Whether the driver's answer to a request that selects a wrapped variant is wrapped.
/// The driver's own export of that variant is. A function elsewhere in the driver
/// library is not: the variant is computed from documented thresholds, so it is one
/// this library does not know (a newer ABI), and calling it through the old variant's
/// wrapper would use the wrong ABI. A function outside the driver is another
/// interposer or a tracer answering for the driver: it has the ABI the request
/// selects, and passing it through would let everything behind it go ungated and
/// uncharged (a resolver answered that way would let every later lookup escape).
pub fn wraps_answer(is_the_drivers_export: bool, in_driver_library: bool) -> bool {
    is_the_drivers_export || !in_driver_library
}

/// `wraps_answer` for the pointer `found` that a request selecting `hook` got (cold:
/// `dladdr` when it is not the export).
fn wraps(hook: Hook, found: *mut c_void) -> bool {
    let is_the_export = driver_export(hook) == Some(found);
    wraps_answer(
        is_the_export,
        !is_the_export && crate::loader::in_driver_library(hook.library(), found),
    )
}

const HOOKS: usize = Hook::ALL.len();
/// Per variant: the driver's export, once looked up (`NO_EXPORT`: it has none).
static DRIVER_EXPORT: [AtomicPtr<c_void>; HOOKS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; HOOKS];
const NO_EXPORT: *mut c_void = usize::MAX as *mut c_void;
/// Per variant: a mismatch was logged already (once is enough to see it).
static MISMATCH_LOGGED: [AtomicBool; HOOKS] = [const { AtomicBool::new(false) }; HOOKS];

fn driver_export(hook: Hook) -> Option<*mut c_void> {
    let slot = &DRIVER_EXPORT[hook as usize];
    let known = slot.load(Ordering::Acquire);
    if known == NO_EXPORT {
        return None;
    }
    if !known.is_null() {
        return Some(known);
    }
    let found = crate::loader::find_in_driver(hook.library(), hook.name());
    slot.store(found.unwrap_or(NO_EXPORT), Ordering::Release);
    found
}

/// Logs, once per variant, that a request's answer was passed through unwrapped.
fn log_passed_through_once(hook: Hook, name: &CStr, cuda_version: c_int, flags: u64) {
    if !MISMATCH_LOGGED[hook as usize].swap(true, Ordering::Relaxed) {
        crate::log_error!(
            "cuGetProcAddress({}, {cuda_version}, {flags}) answered a driver function that is not its {}: passed through unwrapped (this variant is neither gated nor charged)",
            name.to_string_lossy(),
            hook.name().to_string_lossy()
        );
    }
}

/// After a successful real lookup: swap in the wrapper for the selected variant.
fn substitute(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() || !crate::config::is_active() {
        return;
    }
    // SAFETY: the driver accepted the request, so `symbol` is a NUL-terminated name and
    // `pfn` points at the pointer it wrote.
    let (name, found) = unsafe { (CStr::from_ptr(symbol), *pfn) };
    if found.is_null() {
        return;
    }
    match select(name.to_bytes(), cuda_version, flags) {
        Some(hook) if !wraps(hook, found) => {
            log_passed_through_once(hook, name, cuda_version, flags);
        }
        Some(hook) => {
            super::record_real(hook, found);
            crate::log_debug!(
                "cuGetProcAddress({}, {cuda_version}, {flags}) -> {}",
                name.to_string_lossy(),
                hook.name().to_string_lossy()
            );
            // SAFETY: as above.
            unsafe { *pfn = super::wrapper(hook) };
        }
        None if is_wrapped_base(name.to_bytes()) => {
            crate::log_info!(
                "cuGetProcAddress({}, {cuda_version}): an ABI older than any wrapped variant; passed through",
                name.to_string_lossy()
            );
        }
        None => {}
    }
}

/// CUDA 11.3–11.8 form.
///
/// # Safety
/// The driver's contract for `cuGetProcAddress`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    crate::guard::cuda(|| {
        let Some(real) = symbols::real(Hook::cuGetProcAddress) else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the driver's cuGetProcAddress, called with the caller's arguments.
        let result = unsafe {
            std::mem::transmute::<*mut c_void, GetProcAddressFn>(real)(
                symbol,
                pfn,
                cuda_version,
                flags,
            )
        };
        if result == CUDA_SUCCESS {
            substitute(symbol, pfn, cuda_version, flags);
        }
        result
    })
}

/// Forwards a `cuGetProcAddress_v2`-shaped request to the driver's `hook` variant, then
/// substitutes the wrapper for the variant that `substituted_flags` select.
///
/// # Safety
/// The driver's contract for `cuGetProcAddress_v2`.
unsafe fn forward_v2(
    hook: Hook,
    (symbol, pfn, cuda_version, flags, status): (
        *const c_char,
        *mut *mut c_void,
        c_int,
        u64,
        *mut c_int,
    ),
    substituted_flags: u64,
) -> CUresult {
    crate::guard::cuda(|| {
        let Some(real) = symbols::real(hook) else {
            return CUDA_ERROR_NOT_FOUND;
        };
        // SAFETY: the driver's function for `hook` (cuGetProcAddress_v2's signature, as is
        // its _ptsz form), called with the caller's arguments.
        let result = unsafe {
            std::mem::transmute::<*mut c_void, GetProcAddressV2Fn>(real)(
                symbol,
                pfn,
                cuda_version,
                flags,
                status,
            )
        };
        if result == CUDA_SUCCESS {
            substitute(symbol, pfn, cuda_version, substituted_flags);
        }
        result
    })
}

/// CUDA 12.0+ form (`cuGetProcAddress` in 12.x headers is a macro for it).
///
/// # Safety
/// The driver's contract for `cuGetProcAddress_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let request = (symbol, pfn, cuda_version, flags, status);
    // SAFETY: the caller's contract, passed on.
    unsafe { forward_v2(Hook::cuGetProcAddress_v2, request, flags) }
}

/// CUDA 12.0+ form as cuda.h names it under per-thread-default-stream compilation.
///
/// # Safety
/// The driver's contract for `cuGetProcAddress_v2_ptsz`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2_ptsz(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let request = (symbol, pfn, cuda_version, flags, status);
    // SAFETY: the caller's contract, passed on.
    unsafe {
        forward_v2(
            Hook::cuGetProcAddress_v2_ptsz,
            request,
            per_thread_build_flags(flags),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTDS: u64 = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    const LEGACY: u64 = CU_GET_PROC_ADDRESS_LEGACY_STREAM;

    #[test]
    fn version_and_flags_pick_the_variant() {
        let rows: &[(&str, c_int, u64, Option<Hook>)] = &[
            ("cuMemAlloc", 12040, 0, Some(Hook::cuMemAlloc_v2)),
            ("cuMemAlloc", 3020, PTDS, Some(Hook::cuMemAlloc_v2)),
            ("cuMemAlloc", 3010, 0, None),
            ("cuLaunchKernel", 12040, 0, Some(Hook::cuLaunchKernel)),
            ("cuLaunchKernel", 12040, LEGACY, Some(Hook::cuLaunchKernel)),
            (
                "cuLaunchKernel",
                12040,
                PTDS,
                Some(Hook::cuLaunchKernel_ptsz),
            ),
            ("cuLaunchKernel", 6050, PTDS, None),
            ("cuLaunchKernel", 6050, 0, Some(Hook::cuLaunchKernel)),
            ("cuLaunchKernelEx", 11050, 0, None),
            ("cuGraphLaunch", 12000, PTDS, Some(Hook::cuGraphLaunch_ptsz)),
            ("cuMemAllocAsync", 11010, 0, None),
            (
                "cuMemAllocAsync",
                11020,
                PTDS,
                Some(Hook::cuMemAllocAsync_ptsz),
            ),
            (
                "cuMemFreeAsync",
                12040,
                PTDS,
                Some(Hook::cuMemFreeAsync_ptsz),
            ),
            ("cuGetProcAddress", 11030, 0, Some(Hook::cuGetProcAddress)),
            (
                "cuGetProcAddress",
                11030,
                PTDS,
                Some(Hook::cuGetProcAddress),
            ),
            (
                "cuGetProcAddress",
                12040,
                PTDS,
                Some(Hook::cuGetProcAddress_v2),
            ),
            ("cuGetProcAddress", 11080, 0, Some(Hook::cuGetProcAddress)),
            (
                "cuGetProcAddress",
                12000,
                0,
                Some(Hook::cuGetProcAddress_v2),
            ),
            (
                "cuLaunchGridAsync",
                12000,
                PTDS,
                Some(Hook::cuLaunchGridAsync),
            ),
            ("cuMemAlloc_v2", 12040, 0, None),
            ("cuCtxCreate", 12040, 0, Some(Hook::cuCtxCreate_v3)),
            ("cuCtxCreate", 12050, 0, Some(Hook::cuCtxCreate_v4)),
            ("cuCtxGetCurrent", 12040, 0, None),
            ("cuMemcpyDtoD", 12040, 0, Some(Hook::cuMemcpyDtoD_v2)),
            (
                "cuMemcpyDtoD",
                12040,
                PTDS,
                Some(Hook::cuMemcpyDtoD_v2_ptds),
            ),
            ("cuMemcpyDtoD", 3010, 0, None),
            (
                "cuMemsetD32Async",
                12040,
                PTDS,
                Some(Hook::cuMemsetD32Async_ptsz),
            ),
            ("cuMemcpyWithAttributesAsync", 13000, 0, None),
            (
                "cuMemcpyWithAttributesAsync",
                13020,
                PTDS,
                Some(Hook::cuMemcpyWithAttributesAsync_ptsz),
            ),
            (
                "cuMemcpy3DWithAttributesAsync",
                13020,
                0,
                Some(Hook::cuMemcpy3DWithAttributesAsync),
            ),
            ("cuMemcpyBatchAsync", 12060, 0, None),
            (
                "cuMemcpyBatchAsync",
                12080,
                0,
                Some(Hook::cuMemcpyBatchAsync),
            ),
            (
                "cuMemcpyBatchAsync",
                13000,
                PTDS,
                Some(Hook::cuMemcpyBatchAsync_v2_ptsz),
            ),
        ];
        for &(name, version, flags, want) in rows {
            assert_eq!(
                select(name.as_bytes(), version, flags),
                want,
                "{name} {version} {flags}"
            );
        }
    }

    #[test]
    fn a_per_thread_build_defaults_to_per_thread_variants() {
        assert_eq!(per_thread_build_flags(0), PTDS);
        assert_eq!(per_thread_build_flags(LEGACY), LEGACY);
        assert_eq!(per_thread_build_flags(PTDS), PTDS);
        assert_eq!(
            select(b"cuLaunchKernel", 12040, per_thread_build_flags(0)),
            Some(Hook::cuLaunchKernel_ptsz)
        );
        // The resolver takes no stream: the driver answers with its plain _v2.
        assert_eq!(
            select(b"cuGetProcAddress", 12040, PTDS),
            Some(Hook::cuGetProcAddress_v2)
        );
    }

    #[test]
    fn an_unknown_driver_function_passes_through_and_a_foreign_answer_is_wrapped() {
        // (is the driver's export of the variant, lies in the driver library, wrapped)
        let rows: &[(bool, bool, bool)] = &[
            (true, true, true),
            // A driver function this table does not know (a newer ABI variant).
            (false, true, false),
            // Another interposer or a tracer answering for the driver.
            (false, false, true),
        ];
        for &(export, in_driver, wrap) in rows {
            assert_eq!(
                wraps_answer(export, in_driver),
                wrap,
                "{export} {in_driver}"
            );
        }
    }

    #[test]
    fn thresholds_are_unambiguous_and_every_driver_variant_is_reachable() {
        for s in TABLE {
            let same = TABLE
                .iter()
                .filter(|t| t.base == s.base && t.stream == s.stream && t.since == s.since);
            assert_eq!(same.count(), 1, "{} {:?} {}", s.base, s.stream, s.since);
        }
        for &hook in Hook::ALL {
            let reachable = TABLE.iter().any(|s| s.hook == hook);
            let export_only = hook.name().to_bytes().starts_with(b"nvml")
                || hook == Hook::cuGetProcAddress_v2_ptsz;
            assert!(
                reachable != export_only,
                "{hook:?}: every cu* variant but cuGetProcAddress_v2_ptsz is handed out by cuGetProcAddress, no NVML one"
            );
        }
    }
}
