//! `libcuda.so.1` of the simulated GPU.
//!
//! The CUDA driver API subset that real programs and the gpushare interposer use, executing on
//! the shared device model of `simgpu-model`. Built with soname `libcuda.so.1` and
//! `-Bsymbolic` (see build.rs), so its internal calls never go through the dynamic linker, like
//! the real driver's. Everything measured on it is *simulated*.
#![allow(non_snake_case)]

pub mod api;
pub mod driver;
pub mod handles;
pub mod procaddr;
pub mod result;

use api::{checkpoint::*, cig::*, green::*, pool::*, stream::*, vmm::*};
use api::{
    context::*, copy::*, device::*, entry::*, event::*, graph::*, launch::*, memory::*, module::*,
};

/// Declares the exported entry points once, as the name -> address map `cuGetProcAddress` uses.
macro_rules! exports {
    ($($name:ident),* $(,)?) => {
        /// The address of the exported function `symbol` (an exact, versioned name).
        pub fn export_address(symbol: &str) -> Option<*mut libc::c_void> {
            match symbol {
                $(stringify!($name) => Some($name as *mut libc::c_void),)*
                _ => None,
            }
        }

        #[cfg(test)]
        pub const EXPORTED: &[&str] = &[$(stringify!($name)),*];
    };
}

exports!(
    cuInit,
    cuDriverGetVersion,
    cuDeviceGet,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDeviceGetPCIBusId,
    cuDeviceGetUuid,
    cuDeviceGetUuid_v2,
    cuDeviceTotalMem_v2,
    cuDeviceGetAttribute,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxRelease,
    cuDevicePrimaryCtxRelease_v2,
    cuDevicePrimaryCtxReset,
    cuDevicePrimaryCtxReset_v2,
    cuDevicePrimaryCtxSetFlags,
    cuDevicePrimaryCtxSetFlags_v2,
    cuDevicePrimaryCtxGetState,
    cuCtxCreate_v2,
    cuCtxCreate_v3,
    cuCtxCreate_v4,
    cuCtxDestroy_v2,
    cuCtxGetCurrent,
    cuCtxSetCurrent,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuCtxSynchronize,
    cuCtxSynchronize_v2,
    cuCtxGetDevice,
    cuCtxGetDevice_v2,
    cuModuleLoadData,
    cuModuleUnload,
    cuModuleGetFunction,
    cuStreamCreate,
    cuStreamCreateWithPriority,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuStreamSynchronize_ptsz,
    cuStreamQuery,
    cuStreamQuery_ptsz,
    cuStreamWaitEvent,
    cuStreamWaitEvent_ptsz,
    cuStreamIsCapturing,
    cuStreamIsCapturing_ptsz,
    cuStreamBeginCapture,
    cuStreamBeginCapture_ptsz,
    cuStreamBeginCapture_v2,
    cuStreamBeginCapture_v2_ptsz,
    cuStreamEndCapture,
    cuStreamEndCapture_ptsz,
    cuThreadExchangeStreamCaptureMode,
    cuStreamGetCaptureInfo,
    cuStreamGetCaptureInfo_ptsz,
    cuStreamGetCaptureInfo_v2,
    cuStreamGetCaptureInfo_v2_ptsz,
    cuStreamGetCaptureInfo_v3,
    cuStreamGetCaptureInfo_v3_ptsz,
    cuStreamGetCtx,
    cuStreamGetCtx_ptsz,
    cuStreamGetCtx_v2,
    cuStreamGetCtx_v2_ptsz,
    cuEventCreate,
    cuEventDestroy_v2,
    cuEventRecord,
    cuEventRecord_ptsz,
    cuEventRecordWithFlags,
    cuEventRecordWithFlags_ptsz,
    cuEventSynchronize,
    cuEventQuery,
    cuEventElapsedTime,
    cuEventElapsedTime_v2,
    cuMemAlloc_v2,
    cuMemAllocPitch_v2,
    cuMemAllocManaged,
    cuMemFree_v2,
    cuMemGetInfo_v2,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuDeviceGetDefaultMemPool,
    cuDeviceGetMemPool,
    cuDeviceSetMemPool,
    cuMemPoolCreate,
    cuMemPoolDestroy,
    cuMemPoolTrimTo,
    cuMemPoolSetAttribute,
    cuMemPoolGetAttribute,
    cuMemCreate,
    cuMemRelease,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemMap,
    cuMemUnmap,
    cuMemSetAccess,
    cuMemGetAllocationGranularity,
    cuMemExportToShareableHandle,
    cuMemImportFromShareableHandle,
    cuDeviceGetGraphMemAttribute,
    cuDeviceSetGraphMemAttribute,
    cuDeviceGraphMemTrim,
    cuArrayCreate_v2,
    cuArray3DCreate_v2,
    cuArrayDestroy,
    cuMipmappedArrayCreate,
    cuMipmappedArrayDestroy,
    cuMemcpyHtoD_v2,
    cuMemcpyHtoD_v2_ptds,
    cuMemcpyDtoH_v2,
    cuMemcpyDtoH_v2_ptds,
    cuMemcpyDtoD_v2,
    cuMemcpyDtoD_v2_ptds,
    cuMemcpyHtoDAsync_v2,
    cuMemcpyHtoDAsync_v2_ptsz,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyDtoHAsync_v2_ptsz,
    cuMemcpyDtoDAsync_v2,
    cuMemcpyDtoDAsync_v2_ptsz,
    cuMemcpyWithAttributesAsync,
    cuStreamBeginCaptureToCig,
    cuStreamBeginCaptureToCig_ptsz,
    cuStreamEndCaptureToCig,
    cuStreamEndCaptureToCig_ptsz,
    cuMemcpyWithAttributesAsync_ptsz,
    cuMemcpy3DWithAttributesAsync,
    cuMemcpy3DWithAttributesAsync_ptsz,
    cuMemsetD8_v2,
    cuMemsetD8_v2_ptds,
    cuMemsetD32_v2,
    cuMemsetD32_v2_ptds,
    cuMemsetD8Async,
    cuMemsetD8Async_ptsz,
    cuMemsetD32Async,
    cuMemsetD32Async_ptsz,
    cuLaunchKernel,
    cuLaunchKernel_ptsz,
    cuLaunchKernelEx,
    cuLaunchKernelEx_ptsz,
    cuLaunchCooperativeKernel,
    cuLaunchCooperativeKernel_ptsz,
    cuGraphInstantiate_v2,
    cuGraphInstantiateWithFlags,
    cuGraphLaunch,
    cuGraphLaunch_ptsz,
    cuGraphDestroy,
    cuGraphExecDestroy,
    cuGraphGetNodes,
    cuGraphNodeGetType,
    cuGraphMemAllocNodeGetParams,
    cuGetErrorString,
    cuGetErrorName,
    cuGetExportTable,
    cuDeviceGetDevResource,
    cuDevResourceGenerateDesc,
    cuGreenCtxCreate,
    cuCheckpointProcessGetState,
    cuCheckpointProcessLock,
    cuCheckpointProcessCheckpoint,
    cuCheckpointProcessRestore,
    cuCheckpointProcessUnlock,
    cuCheckpointProcessGetRestoreThreadId,
    cuGreenCtxDestroy,
    cuCtxFromGreenCtx,
    cuGreenCtxStreamCreate,
    cuGetProcAddress,
    cuGetProcAddress_v2,
    cuGetProcAddress_v2_ptsz,
);

#[cfg(test)]
mod tests {
    #[test]
    fn every_resolvable_symbol_is_exported() {
        for (name, default, per_thread) in crate::procaddr::TABLE {
            for (_, symbol) in default.iter().chain(per_thread.iter()) {
                assert!(
                    crate::export_address(symbol).is_some(),
                    "{name} -> {symbol} is not exported"
                );
            }
        }
        // cuda.h declares it for per-thread default stream builds; the driver's resolver never
        // hands it out (it answers per-thread requests for itself with cuGetProcAddress_v2).
        let only_exported = ["cuGetProcAddress_v2_ptsz"];
        for symbol in crate::EXPORTED
            .iter()
            .filter(|s| !only_exported.contains(s))
        {
            let resolvable = crate::procaddr::TABLE
                .iter()
                .any(|(_, d, p)| d.iter().chain(p.iter()).any(|(_, s)| s == symbol));
            assert!(
                resolvable,
                "{symbol} is exported but cuGetProcAddress never hands it out"
            );
        }
    }
}
