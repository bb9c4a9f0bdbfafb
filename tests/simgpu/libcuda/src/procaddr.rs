//! Which versioned entry point `cuGetProcAddress` hands out, as a pure function.
//!
//! Callers ask for a base name ("cuMemAlloc"), the CUDA version whose ABI they were compiled
//! against, and flags. The answer is the newest variant introduced at or before that version
//! (cudaTypedefs.h names them: `PFN_cuMemAlloc_v3020` is `cuMemAlloc_v2`), and with
//! `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM` the `_ptsz`/`_ptds` variant where one exists.
//! Handing out a newer variant than asked is handing out a different ABI (HAMi-core#57, #320).
//! The thresholds below are those of the real driver's table for the entry points simgpu has.

/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`, `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const FLAG_LEGACY_STREAM: u64 = 1 << 0;
pub const FLAG_PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

/// `CUdriverProcAddressQueryResult`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum SymbolStatus {
    Success = 0,
    SymbolNotFound = 1,
    VersionNotSufficient = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Found(&'static str),
    VersionNotSufficient,
    SymbolNotFound,
    /// Unknown flags, or a version newer than the driver's.
    InvalidRequest,
}

type Variants = &'static [(i32, &'static str)];

/// (base name, variants by minimum version newest first, per-thread-default-stream variants).
/// An empty per-thread list means the function takes no stream: the flag changes nothing.
#[rustfmt::skip]
pub const TABLE: &[(&str, Variants, Variants)] = &[
    ("cuInit", &[(2000, "cuInit")], &[]),
    ("cuDriverGetVersion", &[(2020, "cuDriverGetVersion")], &[]),
    ("cuDeviceGet", &[(2000, "cuDeviceGet")], &[]),
    ("cuDeviceGetCount", &[(2000, "cuDeviceGetCount")], &[]),
    ("cuDeviceGetName", &[(2000, "cuDeviceGetName")], &[]),
    ("cuDeviceGetPCIBusId", &[(4010, "cuDeviceGetPCIBusId")], &[]),
    ("cuDeviceGetUuid", &[(11040, "cuDeviceGetUuid_v2"), (9020, "cuDeviceGetUuid")], &[]),
    ("cuDeviceTotalMem", &[(3020, "cuDeviceTotalMem_v2")], &[]),
    ("cuDeviceGetAttribute", &[(2000, "cuDeviceGetAttribute")], &[]),
    ("cuDevicePrimaryCtxRetain", &[(7000, "cuDevicePrimaryCtxRetain")], &[]),
    ("cuDevicePrimaryCtxRelease", &[(11000, "cuDevicePrimaryCtxRelease_v2"), (7000, "cuDevicePrimaryCtxRelease")], &[]),
    ("cuDevicePrimaryCtxReset", &[(11000, "cuDevicePrimaryCtxReset_v2"), (7000, "cuDevicePrimaryCtxReset")], &[]),
    ("cuDevicePrimaryCtxSetFlags", &[(11000, "cuDevicePrimaryCtxSetFlags_v2"), (7000, "cuDevicePrimaryCtxSetFlags")], &[]),
    ("cuDevicePrimaryCtxGetState", &[(7000, "cuDevicePrimaryCtxGetState")], &[]),
    ("cuCtxCreate", &[(12050, "cuCtxCreate_v4"), (11040, "cuCtxCreate_v3"), (3020, "cuCtxCreate_v2")], &[]),
    ("cuCtxDestroy", &[(4000, "cuCtxDestroy_v2")], &[]),
    ("cuCtxGetCurrent", &[(4000, "cuCtxGetCurrent")], &[]),
    ("cuCtxSetCurrent", &[(4000, "cuCtxSetCurrent")], &[]),
    ("cuCtxPushCurrent", &[(4000, "cuCtxPushCurrent_v2")], &[]),
    ("cuCtxPopCurrent", &[(4000, "cuCtxPopCurrent_v2")], &[]),
    ("cuCtxSynchronize", &[(13000, "cuCtxSynchronize_v2"), (2000, "cuCtxSynchronize")], &[]),
    ("cuCtxGetDevice", &[(13000, "cuCtxGetDevice_v2"), (2000, "cuCtxGetDevice")], &[]),
    ("cuModuleLoadData", &[(2000, "cuModuleLoadData")], &[]),
    ("cuModuleUnload", &[(2000, "cuModuleUnload")], &[]),
    ("cuModuleGetFunction", &[(2000, "cuModuleGetFunction")], &[]),
    ("cuStreamCreate", &[(2000, "cuStreamCreate")], &[]),
    ("cuStreamCreateWithPriority", &[(5050, "cuStreamCreateWithPriority")], &[]),
    ("cuStreamDestroy", &[(4000, "cuStreamDestroy_v2")], &[]),
    ("cuStreamSynchronize", &[(2000, "cuStreamSynchronize")], &[(7000, "cuStreamSynchronize_ptsz")]),
    ("cuStreamQuery", &[(2000, "cuStreamQuery")], &[(7000, "cuStreamQuery_ptsz")]),
    ("cuStreamWaitEvent", &[(3020, "cuStreamWaitEvent")], &[(7000, "cuStreamWaitEvent_ptsz")]),
    ("cuStreamIsCapturing", &[(10000, "cuStreamIsCapturing")], &[(10000, "cuStreamIsCapturing_ptsz")]),
    ("cuStreamBeginCapture", &[(10010, "cuStreamBeginCapture_v2"), (10000, "cuStreamBeginCapture")], &[(10010, "cuStreamBeginCapture_v2_ptsz"), (10000, "cuStreamBeginCapture_ptsz")]),
    ("cuThreadExchangeStreamCaptureMode", &[(10010, "cuThreadExchangeStreamCaptureMode")], &[]),
    ("cuStreamGetCaptureInfo", &[(12030, "cuStreamGetCaptureInfo_v3"), (11030, "cuStreamGetCaptureInfo_v2"), (10010, "cuStreamGetCaptureInfo")], &[(12030, "cuStreamGetCaptureInfo_v3_ptsz"), (11030, "cuStreamGetCaptureInfo_v2_ptsz"), (10010, "cuStreamGetCaptureInfo_ptsz")]),
    ("cuStreamGetCtx", &[(12050, "cuStreamGetCtx_v2"), (9020, "cuStreamGetCtx")], &[(12050, "cuStreamGetCtx_v2_ptsz"), (9020, "cuStreamGetCtx_ptsz")]),
    ("cuStreamBeginCaptureToCig", &[(13020, "cuStreamBeginCaptureToCig")], &[(13020, "cuStreamBeginCaptureToCig_ptsz")]),
    ("cuStreamEndCaptureToCig", &[(13020, "cuStreamEndCaptureToCig")], &[(13020, "cuStreamEndCaptureToCig_ptsz")]),
    ("cuStreamEndCapture", &[(10000, "cuStreamEndCapture")], &[(10000, "cuStreamEndCapture_ptsz")]),
    ("cuEventCreate", &[(2000, "cuEventCreate")], &[]),
    ("cuEventDestroy", &[(4000, "cuEventDestroy_v2")], &[]),
    ("cuEventRecord", &[(2000, "cuEventRecord")], &[(7000, "cuEventRecord_ptsz")]),
    ("cuEventRecordWithFlags", &[(11010, "cuEventRecordWithFlags")], &[(11010, "cuEventRecordWithFlags_ptsz")]),
    ("cuEventSynchronize", &[(2000, "cuEventSynchronize")], &[]),
    ("cuEventQuery", &[(2000, "cuEventQuery")], &[]),
    ("cuEventElapsedTime", &[(12080, "cuEventElapsedTime_v2"), (2000, "cuEventElapsedTime")], &[]),
    ("cuMemAlloc", &[(3020, "cuMemAlloc_v2")], &[]),
    ("cuMemAllocPitch", &[(3020, "cuMemAllocPitch_v2")], &[]),
    ("cuMemAllocManaged", &[(6000, "cuMemAllocManaged")], &[]),
    ("cuMemFree", &[(3020, "cuMemFree_v2")], &[]),
    ("cuMemGetInfo", &[(3020, "cuMemGetInfo_v2")], &[]),
    ("cuMemAllocAsync", &[(11020, "cuMemAllocAsync")], &[(11020, "cuMemAllocAsync_ptsz")]),
    ("cuMemAllocFromPoolAsync", &[(11020, "cuMemAllocFromPoolAsync")], &[(11020, "cuMemAllocFromPoolAsync_ptsz")]),
    ("cuMemFreeAsync", &[(11020, "cuMemFreeAsync")], &[(11020, "cuMemFreeAsync_ptsz")]),
    ("cuDeviceGetDefaultMemPool", &[(11020, "cuDeviceGetDefaultMemPool")], &[]),
    ("cuDeviceGetMemPool", &[(11020, "cuDeviceGetMemPool")], &[]),
    ("cuDeviceSetMemPool", &[(11020, "cuDeviceSetMemPool")], &[]),
    ("cuMemPoolCreate", &[(11020, "cuMemPoolCreate")], &[]),
    ("cuMemPoolDestroy", &[(11020, "cuMemPoolDestroy")], &[]),
    ("cuMemPoolTrimTo", &[(11020, "cuMemPoolTrimTo")], &[]),
    ("cuMemPoolSetAttribute", &[(11020, "cuMemPoolSetAttribute")], &[]),
    ("cuMemPoolGetAttribute", &[(11020, "cuMemPoolGetAttribute")], &[]),
    ("cuMemCreate", &[(10020, "cuMemCreate")], &[]),
    ("cuMemRelease", &[(10020, "cuMemRelease")], &[]),
    ("cuMemAddressReserve", &[(10020, "cuMemAddressReserve")], &[]),
    ("cuMemAddressFree", &[(10020, "cuMemAddressFree")], &[]),
    ("cuMemMap", &[(10020, "cuMemMap")], &[]),
    ("cuMemUnmap", &[(10020, "cuMemUnmap")], &[]),
    ("cuMemSetAccess", &[(10020, "cuMemSetAccess")], &[]),
    ("cuMemGetAllocationGranularity", &[(10020, "cuMemGetAllocationGranularity")], &[]),
    ("cuMemExportToShareableHandle", &[(10020, "cuMemExportToShareableHandle")], &[]),
    ("cuMemImportFromShareableHandle", &[(10020, "cuMemImportFromShareableHandle")], &[]),
    ("cuDeviceGetGraphMemAttribute", &[(11040, "cuDeviceGetGraphMemAttribute")], &[]),
    ("cuDeviceSetGraphMemAttribute", &[(11040, "cuDeviceSetGraphMemAttribute")], &[]),
    ("cuDeviceGraphMemTrim", &[(11040, "cuDeviceGraphMemTrim")], &[]),
    ("cuArrayCreate", &[(3020, "cuArrayCreate_v2")], &[]),
    ("cuArray3DCreate", &[(3020, "cuArray3DCreate_v2")], &[]),
    ("cuArrayDestroy", &[(2000, "cuArrayDestroy")], &[]),
    ("cuMipmappedArrayCreate", &[(5000, "cuMipmappedArrayCreate")], &[]),
    ("cuMipmappedArrayDestroy", &[(5000, "cuMipmappedArrayDestroy")], &[]),
    ("cuMemcpyHtoD", &[(3020, "cuMemcpyHtoD_v2")], &[(7000, "cuMemcpyHtoD_v2_ptds")]),
    ("cuMemcpyDtoH", &[(3020, "cuMemcpyDtoH_v2")], &[(7000, "cuMemcpyDtoH_v2_ptds")]),
    ("cuMemcpyDtoD", &[(3020, "cuMemcpyDtoD_v2")], &[(7000, "cuMemcpyDtoD_v2_ptds")]),
    ("cuMemcpyHtoDAsync", &[(3020, "cuMemcpyHtoDAsync_v2")], &[(7000, "cuMemcpyHtoDAsync_v2_ptsz")]),
    ("cuMemcpyDtoHAsync", &[(3020, "cuMemcpyDtoHAsync_v2")], &[(7000, "cuMemcpyDtoHAsync_v2_ptsz")]),
    ("cuMemcpyDtoDAsync", &[(3020, "cuMemcpyDtoDAsync_v2")], &[(7000, "cuMemcpyDtoDAsync_v2_ptsz")]),
    ("cuMemcpyWithAttributesAsync", &[(13020, "cuMemcpyWithAttributesAsync")], &[(13020, "cuMemcpyWithAttributesAsync_ptsz")]),
    ("cuMemcpy3DWithAttributesAsync", &[(13020, "cuMemcpy3DWithAttributesAsync")], &[(13020, "cuMemcpy3DWithAttributesAsync_ptsz")]),
    ("cuMemsetD8", &[(3020, "cuMemsetD8_v2")], &[(7000, "cuMemsetD8_v2_ptds")]),
    ("cuMemsetD32", &[(3020, "cuMemsetD32_v2")], &[(7000, "cuMemsetD32_v2_ptds")]),
    ("cuMemsetD8Async", &[(3020, "cuMemsetD8Async")], &[(7000, "cuMemsetD8Async_ptsz")]),
    ("cuMemsetD32Async", &[(3020, "cuMemsetD32Async")], &[(7000, "cuMemsetD32Async_ptsz")]),
    ("cuLaunchKernel", &[(4000, "cuLaunchKernel")], &[(7000, "cuLaunchKernel_ptsz")]),
    ("cuLaunchKernelEx", &[(11060, "cuLaunchKernelEx")], &[(11060, "cuLaunchKernelEx_ptsz")]),
    ("cuLaunchCooperativeKernel", &[(9000, "cuLaunchCooperativeKernel")], &[(9000, "cuLaunchCooperativeKernel_ptsz")]),
    ("cuGraphInstantiate", &[(11000, "cuGraphInstantiate_v2")], &[]),
    ("cuGraphInstantiateWithFlags", &[(11040, "cuGraphInstantiateWithFlags")], &[]),
    ("cuGraphLaunch", &[(10000, "cuGraphLaunch")], &[(10000, "cuGraphLaunch_ptsz")]),
    ("cuGraphDestroy", &[(10000, "cuGraphDestroy")], &[]),
    ("cuGraphExecDestroy", &[(10000, "cuGraphExecDestroy")], &[]),
    ("cuDeviceGetDevResource", &[(12040, "cuDeviceGetDevResource")], &[]),
    ("cuDevResourceGenerateDesc", &[(12040, "cuDevResourceGenerateDesc")], &[]),
    ("cuGreenCtxCreate", &[(12040, "cuGreenCtxCreate")], &[]),
    ("cuCheckpointProcessGetState", &[(12080, "cuCheckpointProcessGetState")], &[]),
    ("cuCheckpointProcessLock", &[(12080, "cuCheckpointProcessLock")], &[]),
    ("cuCheckpointProcessCheckpoint", &[(12080, "cuCheckpointProcessCheckpoint")], &[]),
    ("cuCheckpointProcessRestore", &[(12080, "cuCheckpointProcessRestore")], &[]),
    ("cuCheckpointProcessUnlock", &[(12080, "cuCheckpointProcessUnlock")], &[]),
    ("cuCheckpointProcessGetRestoreThreadId", &[(12080, "cuCheckpointProcessGetRestoreThreadId")], &[]),
    ("cuGreenCtxDestroy", &[(12040, "cuGreenCtxDestroy")], &[]),
    ("cuCtxFromGreenCtx", &[(12040, "cuCtxFromGreenCtx")], &[]),
    ("cuGreenCtxStreamCreate", &[(12050, "cuGreenCtxStreamCreate")], &[]),
    ("cuGetExportTable", &[(3000, "cuGetExportTable")], &[]),
    ("cuGraphGetNodes", &[(10000, "cuGraphGetNodes")], &[]),
    ("cuGraphNodeGetType", &[(10000, "cuGraphNodeGetType")], &[]),
    ("cuGraphMemAllocNodeGetParams", &[(11040, "cuGraphMemAllocNodeGetParams")], &[]),
    ("cuGetErrorString", &[(6000, "cuGetErrorString")], &[]),
    ("cuGetErrorName", &[(6000, "cuGetErrorName")], &[]),
    // The resolver takes no stream: a per-thread request gets the plain resolver, as in the
    // real driver's table. cuGetProcAddress_v2_ptsz is reached only through its export
    // (cuda.h declares it for per-thread default stream builds).
    ("cuGetProcAddress", &[(12000, "cuGetProcAddress_v2"), (11030, "cuGetProcAddress")], &[]),
];

/// Resolves `name` for a caller built against `cuda_version`, on a driver of `driver_version`.
pub fn resolve(name: &str, cuda_version: i32, flags: u64, driver_version: i32) -> Resolution {
    if flags & !(FLAG_LEGACY_STREAM | FLAG_PER_THREAD_DEFAULT_STREAM) != 0
        || cuda_version > driver_version
    {
        return Resolution::InvalidRequest;
    }
    let Some((_, default, per_thread)) = TABLE.iter().find(|(n, _, _)| *n == name) else {
        return Resolution::SymbolNotFound;
    };
    let variants = if flags & FLAG_PER_THREAD_DEFAULT_STREAM != 0 && !per_thread.is_empty() {
        per_thread
    } else {
        default
    };
    variants
        .iter()
        .find(|(min, _)| *min <= cuda_version)
        .map_or(Resolution::VersionNotSufficient, |(_, symbol)| {
            Resolution::Found(symbol)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Resolution::*;

    const DRIVER: i32 = 13000;
    const PTDS: u64 = FLAG_PER_THREAD_DEFAULT_STREAM;

    #[test]
    fn version_and_flags_pick_the_variant() {
        let table: &[(&str, i32, u64, Resolution)] = &[
            ("cuMemAlloc", 12040, 0, Found("cuMemAlloc_v2")),
            ("cuMemAlloc", 3020, 0, Found("cuMemAlloc_v2")),
            ("cuMemAlloc", 3010, 0, VersionNotSufficient),
            ("cuMemAlloc", 12040, PTDS, Found("cuMemAlloc_v2")),
            ("cuCtxCreate", 3020, 0, Found("cuCtxCreate_v2")),
            ("cuCtxCreate", 11040, 0, Found("cuCtxCreate_v3")),
            ("cuCtxCreate", 12040, 0, Found("cuCtxCreate_v3")),
            ("cuCtxCreate", 12050, 0, Found("cuCtxCreate_v4")),
            ("cuCtxSynchronize", 12080, 0, Found("cuCtxSynchronize")),
            ("cuCtxSynchronize", 13000, 0, Found("cuCtxSynchronize_v2")),
            ("cuLaunchKernel", 12000, 0, Found("cuLaunchKernel")),
            (
                "cuLaunchKernel",
                12000,
                FLAG_LEGACY_STREAM,
                Found("cuLaunchKernel"),
            ),
            ("cuLaunchKernel", 12000, PTDS, Found("cuLaunchKernel_ptsz")),
            ("cuLaunchKernel", 6050, PTDS, VersionNotSufficient),
            ("cuMemcpyHtoD", 12000, PTDS, Found("cuMemcpyHtoD_v2_ptds")),
            (
                "cuMemcpyHtoDAsync",
                12000,
                PTDS,
                Found("cuMemcpyHtoDAsync_v2_ptsz"),
            ),
            (
                "cuStreamBeginCapture",
                12000,
                PTDS,
                Found("cuStreamBeginCapture_v2_ptsz"),
            ),
            ("cuGetProcAddress", 11030, 0, Found("cuGetProcAddress")),
            ("cuGetProcAddress", 12000, 0, Found("cuGetProcAddress_v2")),
            (
                "cuGetProcAddress",
                12000,
                PTDS,
                Found("cuGetProcAddress_v2"),
            ),
            ("cuGetProcAddress", 11030, PTDS, Found("cuGetProcAddress")),
            (
                "cuStreamBeginCapture",
                10000,
                0,
                Found("cuStreamBeginCapture"),
            ),
            (
                "cuStreamGetCaptureInfo",
                11020,
                0,
                Found("cuStreamGetCaptureInfo"),
            ),
            (
                "cuStreamGetCaptureInfo",
                12020,
                0,
                Found("cuStreamGetCaptureInfo_v2"),
            ),
            (
                "cuStreamGetCaptureInfo",
                12040,
                0,
                Found("cuStreamGetCaptureInfo_v3"),
            ),
            (
                "cuStreamGetCaptureInfo",
                12040,
                PTDS,
                Found("cuStreamGetCaptureInfo_v3_ptsz"),
            ),
            ("cuStreamGetCtx", 12040, 0, Found("cuStreamGetCtx")),
            ("cuStreamGetCtx", 12050, 0, Found("cuStreamGetCtx_v2")),
            (
                "cuThreadExchangeStreamCaptureMode",
                12040,
                PTDS,
                Found("cuThreadExchangeStreamCaptureMode"),
            ),
            ("cuDeviceGetUuid", 11040, 0, Found("cuDeviceGetUuid_v2")),
            ("cuDeviceGetUuid", 11030, 0, Found("cuDeviceGetUuid")),
            ("cuNotAFunction", 12000, 0, SymbolNotFound),
            ("cuMemAlloc_v2", 12000, 0, SymbolNotFound),
            ("cuMemAlloc", 12000, 4, InvalidRequest),
            ("cuMemAlloc", 13010, 0, InvalidRequest),
        ];
        for &(name, version, flags, want) in table {
            assert_eq!(
                resolve(name, version, flags, DRIVER),
                want,
                "{name} {version} {flags}"
            );
        }
    }

    #[test]
    fn copies_with_attributes_need_a_13_2_caller_and_driver() {
        let name = "cuMemcpyWithAttributesAsync";
        assert_eq!(resolve(name, 13000, 0, 13000), VersionNotSufficient);
        assert_eq!(resolve(name, 13020, 0, 13000), InvalidRequest);
        assert_eq!(
            resolve(name, 13020, PTDS, 13020),
            Found("cuMemcpyWithAttributesAsync_ptsz")
        );
        assert_eq!(
            resolve("cuMemcpy3DWithAttributesAsync", 13020, 0, 13020),
            Found("cuMemcpy3DWithAttributesAsync")
        );
    }

    #[test]
    fn variants_are_listed_newest_first() {
        for (name, default, per_thread) in TABLE {
            for list in [default, per_thread] {
                assert!(list.windows(2).all(|w| w[0].0 > w[1].0), "{name}");
            }
        }
    }
}
