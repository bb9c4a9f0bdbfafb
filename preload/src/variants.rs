//! The one declaration of every wrapped driver variant. Both tables the library needs
//! are expanded from it, so they cannot disagree: the exported names and real-pointer
//! slots (`symbols::Hook`) and, in the front door, the wrapper each variant hands out
//! and the `cuGetProcAddress` requests that select it (`front::procaddr`).
//!
//! One line per variant:
//!
//! ```text
//! exported_name: Library (base_name since_version stream) => wrapper,
//! ```
//!
//! - `(base_name since_version stream)`: a `cuGetProcAddress(base_name, version, flags)`
//!   request selects this variant when `version >= since_version` and no variant of the
//!   same base name and stream has a larger `since_version` that also fits. The
//!   thresholds are the driver's own (cudaTypedefs.h: `PFN_cuMemAlloc_v3020` is
//!   `cuMemAlloc_v2`), so a caller built for an older CUDA never gets a newer ABI.
//!   `PerThread`: what a per-thread-default-stream request gets (the driver's `_ptsz` /
//!   `_ptds` function); a base name with no `PerThread` line takes no stream, the flag
//!   changes nothing. `()`: not reached through `cuGetProcAddress` (NVML, and the
//!   export-only `cuGetProcAddress_v2_ptsz`).
//! - `wrapper`: a path resolved where the list is expanded with it (the front door,
//!   which sees every layer); this module itself names nothing above it.
//!
//! A layer expands the list by passing the name of its own `macro_rules!` to
//! `for_each_variant!`, which calls it with every line.

/// Calls `$callback! { <every line> }`.
#[macro_export]
#[doc(hidden)]
macro_rules! for_each_variant {
    ($callback:ident) => {
        $callback! {
        // The resolver takes no stream: the driver answers a per-thread request for it
        // with cuGetProcAddress_v2. cuda.h declares cuGetProcAddress_v2_ptsz for
        // per-thread-default-stream builds, reachable only as an export.
        cuGetProcAddress: Cuda (cuGetProcAddress 11030 Legacy) => procaddr::cuGetProcAddress,
        cuGetProcAddress_v2: Cuda (cuGetProcAddress 12000 Legacy) => procaddr::cuGetProcAddress_v2,
        cuGetProcAddress_v2_ptsz: Cuda () => procaddr::cuGetProcAddress_v2_ptsz,
        // Launches: one gate.
        cuLaunchKernel: Cuda (cuLaunchKernel 4000 Legacy) => launch::cuLaunchKernel,
        cuLaunchKernel_ptsz: Cuda (cuLaunchKernel 7000 PerThread) => launch::cuLaunchKernel_ptsz,
        cuLaunchKernelEx: Cuda (cuLaunchKernelEx 11060 Legacy) => launch::cuLaunchKernelEx,
        cuLaunchKernelEx_ptsz: Cuda (cuLaunchKernelEx 11060 PerThread) => launch::cuLaunchKernelEx_ptsz,
        cuLaunchCooperativeKernel: Cuda (cuLaunchCooperativeKernel 9000 Legacy) => launch::cuLaunchCooperativeKernel,
        cuLaunchCooperativeKernel_ptsz: Cuda (cuLaunchCooperativeKernel 9000 PerThread) => launch::cuLaunchCooperativeKernel_ptsz,
        cuGraphLaunch: Cuda (cuGraphLaunch 10000 Legacy) => launch::cuGraphLaunch,
        cuGraphLaunch_ptsz: Cuda (cuGraphLaunch 10000 PerThread) => launch::cuGraphLaunch_ptsz,
        // Graph instantiation: what its memory nodes need, charged at each launch.
        cuGraphInstantiate_v2: Cuda (cuGraphInstantiate 11000 Legacy) => memory::cuGraphInstantiate_v2,
        cuGraphInstantiateWithFlags: Cuda (cuGraphInstantiateWithFlags 11040 Legacy) => memory::cuGraphInstantiateWithFlags,
        cuGraphExecDestroy: Cuda (cuGraphExecDestroy 10000 Legacy) => memory::cuGraphExecDestroy,
        cuLaunch: Cuda (cuLaunch 2000 Legacy) => launch::cuLaunch,
        cuLaunchGrid: Cuda (cuLaunchGrid 2000 Legacy) => launch::cuLaunchGrid,
        cuLaunchGridAsync: Cuda (cuLaunchGridAsync 2000 Legacy) => launch::cuLaunchGridAsync,
        // Copies and memsets: GPU work, the same gate. Synchronous ones have `_ptds`
        // variants, asynchronous ones `_ptsz`.
        cuMemcpy: Cuda (cuMemcpy 4000 Legacy) => copy::cuMemcpy,
        cuMemcpy_ptds: Cuda (cuMemcpy 7000 PerThread) => copy::cuMemcpy_ptds,
        cuMemcpyHtoD_v2: Cuda (cuMemcpyHtoD 3020 Legacy) => copy::cuMemcpyHtoD_v2,
        cuMemcpyHtoD_v2_ptds: Cuda (cuMemcpyHtoD 7000 PerThread) => copy::cuMemcpyHtoD_v2_ptds,
        cuMemcpyDtoH_v2: Cuda (cuMemcpyDtoH 3020 Legacy) => copy::cuMemcpyDtoH_v2,
        cuMemcpyDtoH_v2_ptds: Cuda (cuMemcpyDtoH 7000 PerThread) => copy::cuMemcpyDtoH_v2_ptds,
        cuMemcpyDtoD_v2: Cuda (cuMemcpyDtoD 3020 Legacy) => copy::cuMemcpyDtoD_v2,
        cuMemcpyDtoD_v2_ptds: Cuda (cuMemcpyDtoD 7000 PerThread) => copy::cuMemcpyDtoD_v2_ptds,
        cuMemcpyDtoA_v2: Cuda (cuMemcpyDtoA 3020 Legacy) => copy::cuMemcpyDtoA_v2,
        cuMemcpyDtoA_v2_ptds: Cuda (cuMemcpyDtoA 7000 PerThread) => copy::cuMemcpyDtoA_v2_ptds,
        cuMemcpyAtoD_v2: Cuda (cuMemcpyAtoD 3020 Legacy) => copy::cuMemcpyAtoD_v2,
        cuMemcpyAtoD_v2_ptds: Cuda (cuMemcpyAtoD 7000 PerThread) => copy::cuMemcpyAtoD_v2_ptds,
        cuMemcpyHtoA_v2: Cuda (cuMemcpyHtoA 3020 Legacy) => copy::cuMemcpyHtoA_v2,
        cuMemcpyHtoA_v2_ptds: Cuda (cuMemcpyHtoA 7000 PerThread) => copy::cuMemcpyHtoA_v2_ptds,
        cuMemcpyAtoH_v2: Cuda (cuMemcpyAtoH 3020 Legacy) => copy::cuMemcpyAtoH_v2,
        cuMemcpyAtoH_v2_ptds: Cuda (cuMemcpyAtoH 7000 PerThread) => copy::cuMemcpyAtoH_v2_ptds,
        cuMemcpyAtoA_v2: Cuda (cuMemcpyAtoA 3020 Legacy) => copy::cuMemcpyAtoA_v2,
        cuMemcpyAtoA_v2_ptds: Cuda (cuMemcpyAtoA 7000 PerThread) => copy::cuMemcpyAtoA_v2_ptds,
        cuMemcpyPeer: Cuda (cuMemcpyPeer 4000 Legacy) => copy::cuMemcpyPeer,
        cuMemcpyPeer_ptds: Cuda (cuMemcpyPeer 7000 PerThread) => copy::cuMemcpyPeer_ptds,
        cuMemcpy2D_v2: Cuda (cuMemcpy2D 3020 Legacy) => copy::cuMemcpy2D_v2,
        cuMemcpy2D_v2_ptds: Cuda (cuMemcpy2D 7000 PerThread) => copy::cuMemcpy2D_v2_ptds,
        cuMemcpy2DUnaligned_v2: Cuda (cuMemcpy2DUnaligned 3020 Legacy) => copy::cuMemcpy2DUnaligned_v2,
        cuMemcpy2DUnaligned_v2_ptds: Cuda (cuMemcpy2DUnaligned 7000 PerThread) => copy::cuMemcpy2DUnaligned_v2_ptds,
        cuMemcpy3D_v2: Cuda (cuMemcpy3D 3020 Legacy) => copy::cuMemcpy3D_v2,
        cuMemcpy3D_v2_ptds: Cuda (cuMemcpy3D 7000 PerThread) => copy::cuMemcpy3D_v2_ptds,
        cuMemcpy3DPeer: Cuda (cuMemcpy3DPeer 4000 Legacy) => copy::cuMemcpy3DPeer,
        cuMemcpy3DPeer_ptds: Cuda (cuMemcpy3DPeer 7000 PerThread) => copy::cuMemcpy3DPeer_ptds,
        cuMemcpyAsync: Cuda (cuMemcpyAsync 4000 Legacy) => copy::cuMemcpyAsync,
        cuMemcpyAsync_ptsz: Cuda (cuMemcpyAsync 7000 PerThread) => copy::cuMemcpyAsync_ptsz,
        cuMemcpyHtoDAsync_v2: Cuda (cuMemcpyHtoDAsync 3020 Legacy) => copy::cuMemcpyHtoDAsync_v2,
        cuMemcpyHtoDAsync_v2_ptsz: Cuda (cuMemcpyHtoDAsync 7000 PerThread) => copy::cuMemcpyHtoDAsync_v2_ptsz,
        cuMemcpyDtoHAsync_v2: Cuda (cuMemcpyDtoHAsync 3020 Legacy) => copy::cuMemcpyDtoHAsync_v2,
        cuMemcpyDtoHAsync_v2_ptsz: Cuda (cuMemcpyDtoHAsync 7000 PerThread) => copy::cuMemcpyDtoHAsync_v2_ptsz,
        cuMemcpyDtoDAsync_v2: Cuda (cuMemcpyDtoDAsync 3020 Legacy) => copy::cuMemcpyDtoDAsync_v2,
        cuMemcpyDtoDAsync_v2_ptsz: Cuda (cuMemcpyDtoDAsync 7000 PerThread) => copy::cuMemcpyDtoDAsync_v2_ptsz,
        cuMemcpyHtoAAsync_v2: Cuda (cuMemcpyHtoAAsync 3020 Legacy) => copy::cuMemcpyHtoAAsync_v2,
        cuMemcpyHtoAAsync_v2_ptsz: Cuda (cuMemcpyHtoAAsync 7000 PerThread) => copy::cuMemcpyHtoAAsync_v2_ptsz,
        cuMemcpyAtoHAsync_v2: Cuda (cuMemcpyAtoHAsync 3020 Legacy) => copy::cuMemcpyAtoHAsync_v2,
        cuMemcpyAtoHAsync_v2_ptsz: Cuda (cuMemcpyAtoHAsync 7000 PerThread) => copy::cuMemcpyAtoHAsync_v2_ptsz,
        cuMemcpyPeerAsync: Cuda (cuMemcpyPeerAsync 4000 Legacy) => copy::cuMemcpyPeerAsync,
        cuMemcpyPeerAsync_ptsz: Cuda (cuMemcpyPeerAsync 7000 PerThread) => copy::cuMemcpyPeerAsync_ptsz,
        cuMemcpy2DAsync_v2: Cuda (cuMemcpy2DAsync 3020 Legacy) => copy::cuMemcpy2DAsync_v2,
        cuMemcpy2DAsync_v2_ptsz: Cuda (cuMemcpy2DAsync 7000 PerThread) => copy::cuMemcpy2DAsync_v2_ptsz,
        cuMemcpy3DAsync_v2: Cuda (cuMemcpy3DAsync 3020 Legacy) => copy::cuMemcpy3DAsync_v2,
        cuMemcpy3DAsync_v2_ptsz: Cuda (cuMemcpy3DAsync 7000 PerThread) => copy::cuMemcpy3DAsync_v2_ptsz,
        cuMemcpy3DPeerAsync: Cuda (cuMemcpy3DPeerAsync 4000 Legacy) => copy::cuMemcpy3DPeerAsync,
        cuMemcpy3DPeerAsync_ptsz: Cuda (cuMemcpy3DPeerAsync 7000 PerThread) => copy::cuMemcpy3DPeerAsync_ptsz,
        cuMemsetD8_v2: Cuda (cuMemsetD8 3020 Legacy) => copy::cuMemsetD8_v2,
        cuMemsetD8_v2_ptds: Cuda (cuMemsetD8 7000 PerThread) => copy::cuMemsetD8_v2_ptds,
        cuMemsetD16_v2: Cuda (cuMemsetD16 3020 Legacy) => copy::cuMemsetD16_v2,
        cuMemsetD16_v2_ptds: Cuda (cuMemsetD16 7000 PerThread) => copy::cuMemsetD16_v2_ptds,
        cuMemsetD32_v2: Cuda (cuMemsetD32 3020 Legacy) => copy::cuMemsetD32_v2,
        cuMemsetD32_v2_ptds: Cuda (cuMemsetD32 7000 PerThread) => copy::cuMemsetD32_v2_ptds,
        cuMemsetD2D8_v2: Cuda (cuMemsetD2D8 3020 Legacy) => copy::cuMemsetD2D8_v2,
        cuMemsetD2D8_v2_ptds: Cuda (cuMemsetD2D8 7000 PerThread) => copy::cuMemsetD2D8_v2_ptds,
        cuMemsetD2D16_v2: Cuda (cuMemsetD2D16 3020 Legacy) => copy::cuMemsetD2D16_v2,
        cuMemsetD2D16_v2_ptds: Cuda (cuMemsetD2D16 7000 PerThread) => copy::cuMemsetD2D16_v2_ptds,
        cuMemsetD2D32_v2: Cuda (cuMemsetD2D32 3020 Legacy) => copy::cuMemsetD2D32_v2,
        cuMemsetD2D32_v2_ptds: Cuda (cuMemsetD2D32 7000 PerThread) => copy::cuMemsetD2D32_v2_ptds,
        cuMemsetD8Async: Cuda (cuMemsetD8Async 3020 Legacy) => copy::cuMemsetD8Async,
        cuMemsetD8Async_ptsz: Cuda (cuMemsetD8Async 7000 PerThread) => copy::cuMemsetD8Async_ptsz,
        cuMemsetD16Async: Cuda (cuMemsetD16Async 3020 Legacy) => copy::cuMemsetD16Async,
        cuMemsetD16Async_ptsz: Cuda (cuMemsetD16Async 7000 PerThread) => copy::cuMemsetD16Async_ptsz,
        cuMemsetD32Async: Cuda (cuMemsetD32Async 3020 Legacy) => copy::cuMemsetD32Async,
        cuMemsetD32Async_ptsz: Cuda (cuMemsetD32Async 7000 PerThread) => copy::cuMemsetD32Async_ptsz,
        cuMemsetD2D8Async: Cuda (cuMemsetD2D8Async 3020 Legacy) => copy::cuMemsetD2D8Async,
        cuMemsetD2D8Async_ptsz: Cuda (cuMemsetD2D8Async 7000 PerThread) => copy::cuMemsetD2D8Async_ptsz,
        cuMemsetD2D16Async: Cuda (cuMemsetD2D16Async 3020 Legacy) => copy::cuMemsetD2D16Async,
        cuMemsetD2D16Async_ptsz: Cuda (cuMemsetD2D16Async 7000 PerThread) => copy::cuMemsetD2D16Async_ptsz,
        cuMemsetD2D32Async: Cuda (cuMemsetD2D32Async 3020 Legacy) => copy::cuMemsetD2D32Async,
        cuMemsetD2D32Async_ptsz: Cuda (cuMemsetD2D32Async 7000 PerThread) => copy::cuMemsetD2D32Async_ptsz,
        // CUDA 12.8 batches; 13.0's _v2 drops failIdx.
        cuMemcpyBatchAsync: Cuda (cuMemcpyBatchAsync 12080 Legacy) => copy::cuMemcpyBatchAsync,
        cuMemcpyBatchAsync_ptsz: Cuda (cuMemcpyBatchAsync 12080 PerThread) => copy::cuMemcpyBatchAsync_ptsz,
        cuMemcpyBatchAsync_v2: Cuda (cuMemcpyBatchAsync 13000 Legacy) => copy::cuMemcpyBatchAsync_v2,
        cuMemcpyBatchAsync_v2_ptsz: Cuda (cuMemcpyBatchAsync 13000 PerThread) => copy::cuMemcpyBatchAsync_v2_ptsz,
        cuMemcpy3DBatchAsync: Cuda (cuMemcpy3DBatchAsync 12080 Legacy) => copy::cuMemcpy3DBatchAsync,
        cuMemcpy3DBatchAsync_ptsz: Cuda (cuMemcpy3DBatchAsync 12080 PerThread) => copy::cuMemcpy3DBatchAsync_ptsz,
        cuMemcpy3DBatchAsync_v2: Cuda (cuMemcpy3DBatchAsync 13000 Legacy) => copy::cuMemcpy3DBatchAsync_v2,
        cuMemcpy3DBatchAsync_v2_ptsz: Cuda (cuMemcpy3DBatchAsync 13000 PerThread) => copy::cuMemcpy3DBatchAsync_v2_ptsz,
        // CUDA 13.2: single copies with attributes.
        cuMemcpyWithAttributesAsync: Cuda (cuMemcpyWithAttributesAsync 13020 Legacy) => copy::cuMemcpyWithAttributesAsync,
        cuMemcpyWithAttributesAsync_ptsz: Cuda (cuMemcpyWithAttributesAsync 13020 PerThread) => copy::cuMemcpyWithAttributesAsync_ptsz,
        cuMemcpy3DWithAttributesAsync: Cuda (cuMemcpy3DWithAttributesAsync 13020 Legacy) => copy::cuMemcpy3DWithAttributesAsync,
        cuMemcpy3DWithAttributesAsync_ptsz: Cuda (cuMemcpy3DWithAttributesAsync 13020 PerThread) => copy::cuMemcpy3DWithAttributesAsync_ptsz,
        // Memory: charged before, credited after.
        cuMemAlloc_v2: Cuda (cuMemAlloc 3020 Legacy) => memory::cuMemAlloc_v2,
        cuMemAllocPitch_v2: Cuda (cuMemAllocPitch 3020 Legacy) => memory::cuMemAllocPitch_v2,
        cuMemAllocManaged: Cuda (cuMemAllocManaged 6000 Legacy) => memory::cuMemAllocManaged,
        cuMemFree_v2: Cuda (cuMemFree 3020 Legacy) => memory::cuMemFree_v2,
        cuArrayCreate_v2: Cuda (cuArrayCreate 3020 Legacy) => memory::cuArrayCreate_v2,
        cuArray3DCreate_v2: Cuda (cuArray3DCreate 3020 Legacy) => memory::cuArray3DCreate_v2,
        cuArrayDestroy: Cuda (cuArrayDestroy 2000 Legacy) => memory::cuArrayDestroy,
        cuMipmappedArrayCreate: Cuda (cuMipmappedArrayCreate 5000 Legacy) => memory::cuMipmappedArrayCreate,
        cuMipmappedArrayDestroy: Cuda (cuMipmappedArrayDestroy 5000 Legacy) => memory::cuMipmappedArrayDestroy,
        cuMemAllocAsync: Cuda (cuMemAllocAsync 11020 Legacy) => memory::cuMemAllocAsync,
        cuMemAllocAsync_ptsz: Cuda (cuMemAllocAsync 11020 PerThread) => memory::cuMemAllocAsync_ptsz,
        cuMemAllocFromPoolAsync: Cuda (cuMemAllocFromPoolAsync 11020 Legacy) => memory::cuMemAllocFromPoolAsync,
        cuMemAllocFromPoolAsync_ptsz: Cuda (cuMemAllocFromPoolAsync 11020 PerThread) => memory::cuMemAllocFromPoolAsync_ptsz,
        cuMemFreeAsync: Cuda (cuMemFreeAsync 11020 Legacy) => memory::cuMemFreeAsync,
        cuMemFreeAsync_ptsz: Cuda (cuMemFreeAsync 11020 PerThread) => memory::cuMemFreeAsync_ptsz,
        cuMemPoolCreate: Cuda (cuMemPoolCreate 11020 Legacy) => memory::cuMemPoolCreate,
        cuMemPoolDestroy: Cuda (cuMemPoolDestroy 11020 Legacy) => memory::cuMemPoolDestroy,
        cuMemPoolTrimTo: Cuda (cuMemPoolTrimTo 11020 Legacy) => memory::cuMemPoolTrimTo,
        cuMemCreate: Cuda (cuMemCreate 10020 Legacy) => memory::cuMemCreate,
        cuMemRelease: Cuda (cuMemRelease 10020 Legacy) => memory::cuMemRelease,
        cuMemMap: Cuda (cuMemMap 10020 Legacy) => memory::cuMemMap,
        cuMemUnmap: Cuda (cuMemUnmap 10020 Legacy) => memory::cuMemUnmap,
        cuMemExportToShareableHandle: Cuda (cuMemExportToShareableHandle 10020 Legacy) => memory::cuMemExportToShareableHandle,
        cuMemImportFromShareableHandle: Cuda (cuMemImportFromShareableHandle 10020 Legacy) => memory::cuMemImportFromShareableHandle,
        // The gate's record of the process's work: contexts, streams, captures.
        cuStreamCreate: Cuda (cuStreamCreate 2000 Legacy) => work::cuStreamCreate,
        cuStreamCreateWithPriority: Cuda (cuStreamCreateWithPriority 5050 Legacy) => work::cuStreamCreateWithPriority,
        cuStreamDestroy_v2: Cuda (cuStreamDestroy 4000 Legacy) => work::cuStreamDestroy_v2,
        cuStreamBeginCapture: Cuda (cuStreamBeginCapture 10000 Legacy) => work::cuStreamBeginCapture,
        cuStreamBeginCapture_ptsz: Cuda (cuStreamBeginCapture 10000 PerThread) => work::cuStreamBeginCapture_ptsz,
        cuStreamBeginCapture_v2: Cuda (cuStreamBeginCapture 10010 Legacy) => work::cuStreamBeginCapture_v2,
        cuStreamBeginCapture_v2_ptsz: Cuda (cuStreamBeginCapture 10010 PerThread) => work::cuStreamBeginCapture_v2_ptsz,
        cuStreamBeginCaptureToGraph: Cuda (cuStreamBeginCaptureToGraph 12030 Legacy) => work::cuStreamBeginCaptureToGraph,
        cuStreamBeginCaptureToGraph_ptsz: Cuda (cuStreamBeginCaptureToGraph 12030 PerThread) => work::cuStreamBeginCaptureToGraph_ptsz,
        cuStreamBeginCaptureToCig: Cuda (cuStreamBeginCaptureToCig 13020 Legacy) => work::cuStreamBeginCaptureToCig,
        cuStreamBeginCaptureToCig_ptsz: Cuda (cuStreamBeginCaptureToCig 13020 PerThread) => work::cuStreamBeginCaptureToCig_ptsz,
        cuStreamEndCaptureToCig: Cuda (cuStreamEndCaptureToCig 13020 Legacy) => work::cuStreamEndCaptureToCig,
        cuStreamEndCaptureToCig_ptsz: Cuda (cuStreamEndCaptureToCig 13020 PerThread) => work::cuStreamEndCaptureToCig_ptsz,
        cuStreamEndCapture: Cuda (cuStreamEndCapture 10000 Legacy) => work::cuStreamEndCapture,
        cuStreamEndCapture_ptsz: Cuda (cuStreamEndCapture 10000 PerThread) => work::cuStreamEndCapture_ptsz,
        cuDevicePrimaryCtxRetain: Cuda (cuDevicePrimaryCtxRetain 7000 Legacy) => work::cuDevicePrimaryCtxRetain,
        cuDevicePrimaryCtxRelease: Cuda (cuDevicePrimaryCtxRelease 7000 Legacy) => work::cuDevicePrimaryCtxRelease,
        cuDevicePrimaryCtxRelease_v2: Cuda (cuDevicePrimaryCtxRelease 11000 Legacy) => work::cuDevicePrimaryCtxRelease_v2,
        cuDevicePrimaryCtxReset: Cuda (cuDevicePrimaryCtxReset 7000 Legacy) => work::cuDevicePrimaryCtxReset,
        cuDevicePrimaryCtxReset_v2: Cuda (cuDevicePrimaryCtxReset 11000 Legacy) => work::cuDevicePrimaryCtxReset_v2,
        cuCtxCreate_v2: Cuda (cuCtxCreate 3020 Legacy) => work::cuCtxCreate_v2,
        cuCtxCreate_v3: Cuda (cuCtxCreate 11040 Legacy) => work::cuCtxCreate_v3,
        cuCtxCreate_v4: Cuda (cuCtxCreate 12050 Legacy) => work::cuCtxCreate_v4,
        cuCtxDestroy_v2: Cuda (cuCtxDestroy 4000 Legacy) => work::cuCtxDestroy_v2,
        cuGreenCtxCreate: Cuda (cuGreenCtxCreate 12040 Legacy) => work::cuGreenCtxCreate,
        cuGreenCtxStreamCreate: Cuda (cuGreenCtxStreamCreate 12050 Legacy) => work::cuGreenCtxStreamCreate,
        // Virtualised answers.
        cuMemGetInfo_v2: Cuda (cuMemGetInfo 3020 Legacy) => info::cuMemGetInfo_v2,
        cuDeviceTotalMem_v2: Cuda (cuDeviceTotalMem 3020 Legacy) => info::cuDeviceTotalMem_v2,
        nvmlDeviceGetMemoryInfo: Nvml () => info::nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetMemoryInfo_v2: Nvml () => info::nvmlDeviceGetMemoryInfo_v2,
        }
    };
}

/// Which stream a `cuGetProcAddress` request's flags ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// `CU_GET_PROC_ADDRESS_DEFAULT` / `_LEGACY_STREAM`.
    Legacy,
    /// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    PerThread,
}

/// Which library an entry point lives in (where a lazy lookup searches).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    Cuda,
    Nvml,
}
