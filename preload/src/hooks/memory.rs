//! Allocation wrappers: charge the container's ledger before the driver allocates,
//! credit it after the driver frees. Inert library: straight to the driver.

use libc::{c_int, c_uint, c_void};

use super::real_fn;
use crate::accounts::{self, Accounts};
use crate::cuda::*;
use crate::symbols::{self, Hook};

/// The row alignment `cuMemAllocPitch` uses on current GPUs: the estimate charged
/// before the driver reveals the real pitch.
const PITCH_ESTIMATE_ALIGN: u64 = 512;

/// Reads an out-parameter the driver has just written.
fn written<T: Copy>(out: *const T) -> Option<T> {
    // SAFETY: the driver returned success, so a non-null out-pointer holds its answer.
    (!out.is_null()).then(|| unsafe { *out })
}

/// Runs `with_accounts` when the library is active, else the plain driver call.
fn accounted(
    plain: impl FnOnce() -> CUresult,
    with_accounts: impl FnOnce(&mut Accounts) -> CUresult,
) -> CUresult {
    match accounts::lock() {
        Some(mut a) => with_accounts(&mut a),
        None => plain(),
    }
}

fn result<T>(rc: CUresult, value: impl FnOnce() -> Option<T>) -> Result<T, CUresult> {
    if rc != CUDA_SUCCESS {
        return Err(rc);
    }
    value().ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// # Safety
/// The driver's contract for `cuMemAlloc_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemAlloc_v2: fn(*mut CUdeviceptr, usize) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(dptr, bytes) },
            |a| {
                a.allocate_device(bytes as u64, "cuMemAlloc", || {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    result(unsafe { real(dptr, bytes) }, || written(dptr))
                })
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemAllocManaged`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemAllocManaged: fn(*mut CUdeviceptr, usize, c_uint) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(dptr, bytes, flags) },
            |a| {
                a.allocate_device(bytes as u64, "cuMemAllocManaged", || {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    result(unsafe { real(dptr, bytes, flags) }, || written(dptr))
                })
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemAllocPitch_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_bytes: usize,
    height: usize,
    element_bytes: c_uint,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemAllocPitch_v2: fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(dptr, pitch, width_bytes, height, element_bytes) },
            |a| {
                let estimate = (width_bytes as u64)
                    .div_ceil(PITCH_ESTIMATE_ALIGN)
                    .saturating_mul(PITCH_ESTIMATE_ALIGN)
                    .saturating_mul(height as u64);
                a.allocate_pitched(
                    estimate,
                    || {
                        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                        let rc = unsafe { real(dptr, pitch, width_bytes, height, element_bytes) };
                        result(rc, || {
                            Some((
                                written(dptr)?,
                                (written(pitch)? as u64).saturating_mul(height as u64),
                            ))
                        })
                    },
                    free_device,
                )
            },
        )
    })
}

/// Gives back an allocation the accounts refused after the fact.
fn free_device(ptr: CUdeviceptr) {
    if let Some(p) = symbols::real(Hook::cuMemFree_v2) {
        // SAFETY: the driver's cuMemFree_v2 on a pointer it just allocated.
        unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(CUdeviceptr) -> CUresult>(p)(
                ptr,
            )
        };
    }
}

/// # Safety
/// The driver's contract for `cuMemFree_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemFree_v2: fn(CUdeviceptr) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(dptr) },
            |a| {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(dptr) };
                if rc == CUDA_SUCCESS {
                    a.freed(dptr);
                }
                rc
            },
        )
    })
}

// ----- arrays -----

/// # Safety
/// The driver's contract for `cuArrayCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut Handle,
    desc: *const ArrayDescriptor,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuArrayCreate_v2: fn(*mut Handle, *const ArrayDescriptor) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(array, desc) },
            |a| {
                let Some(d) = written(desc) else {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    return unsafe { real(array, desc) };
                };
                let bytes = array_charge(d.width, d.height, 0, d.format, d.num_channels, 1);
                a.allocate_array(false, bytes, || {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    result(unsafe { real(array, desc) }, || written(array))
                })
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuArray3DCreate_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut Handle,
    desc: *const Array3DDescriptor,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuArray3DCreate_v2: fn(*mut Handle, *const Array3DDescriptor) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(array, desc) },
            |a| {
                let Some(d) = written(desc) else {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    return unsafe { real(array, desc) };
                };
                let bytes = array_charge(d.width, d.height, d.depth, d.format, d.num_channels, 1);
                a.allocate_array(false, bytes, || {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    result(unsafe { real(array, desc) }, || written(array))
                })
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMipmappedArrayCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut Handle,
    desc: *const Array3DDescriptor,
    levels: c_uint,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMipmappedArrayCreate: fn(*mut Handle, *const Array3DDescriptor, c_uint) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(array, desc, levels) },
            |a| {
                let Some(d) = written(desc) else {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    return unsafe { real(array, desc, levels) };
                };
                let bytes =
                    array_charge(d.width, d.height, d.depth, d.format, d.num_channels, levels);
                a.allocate_array(true, bytes, || {
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    result(unsafe { real(array, desc, levels) }, || written(array))
                })
            },
        )
    })
}

/// Bytes charged for an array. A format whose size is not known is charged as 4
/// bytes per channel, the largest channel there is: overcharging an exotic format
/// is better than leaving it uncharged.
fn array_charge(
    width: usize,
    height: usize,
    depth: usize,
    format: c_uint,
    channels: c_uint,
    levels: c_uint,
) -> u64 {
    let format = if array_format_bytes(format).is_some() {
        format
    } else {
        0x03
    };
    array_bytes(width, height, depth, format, channels, levels).unwrap_or(u64::MAX)
}

/// # Safety
/// The driver's contract for `cuArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(array: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuArrayDestroy: fn(Handle) -> CUresult);
        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
        let rc = unsafe { real(array) };
        if rc == CUDA_SUCCESS {
            if let Some(mut a) = accounts::lock() {
                a.array_destroyed(false, array);
            }
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuMipmappedArrayDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayDestroy(array: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMipmappedArrayDestroy: fn(Handle) -> CUresult);
        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
        let rc = unsafe { real(array) };
        if rc == CUDA_SUCCESS {
            if let Some(mut a) = accounts::lock() {
                a.array_destroyed(true, array);
            }
        }
        rc
    })
}

// ----- stream-ordered allocation and pools -----

type FreeAsyncFn = unsafe extern "C" fn(CUdeviceptr, Handle) -> CUresult;
type TrimFn = unsafe extern "C" fn(Handle, usize) -> CUresult;

/// Gives a block back to its pool and trims the pool to `keep` bytes (the charge
/// before the allocation that overshot).
fn give_back(ptr: CUdeviceptr, stream: Handle, pool: Handle, keep: u64) {
    if let Some(p) = symbols::real(Hook::cuMemFreeAsync) {
        // SAFETY: the driver's cuMemFreeAsync on a block it just allocated on `stream`.
        unsafe { std::mem::transmute::<*mut c_void, FreeAsyncFn>(p)(ptr, stream) };
    }
    if let Some(p) = symbols::real(Hook::cuMemPoolTrimTo) {
        // SAFETY: the driver's cuMemPoolTrimTo on a live pool.
        unsafe { std::mem::transmute::<*mut c_void, TrimFn>(p)(pool, keep as usize) };
    }
}

/// `pool`: `None` for `cuMemAllocAsync` (the current pool of the current device).
fn allocate_async(
    a: &mut Accounts,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Option<Handle>,
    stream: Handle,
    allocate: impl FnOnce() -> CUresult,
) -> CUresult {
    let pool =
        pool.or_else(|| crate::driver::current_device().and_then(crate::driver::current_pool));
    let Some(pool) = pool else {
        // No pool to watch: charge the block itself.
        return a.allocate_device(bytes as u64, "cuMemAllocAsync", || {
            result(allocate(), || written(dptr))
        });
    };
    a.allocate_from_pool(
        pool,
        bytes as u64,
        || crate::driver::pool_usage(pool),
        || result(allocate(), || written(dptr)),
        |ptr, keep| give_back(ptr, stream, pool, keep),
    )
}

macro_rules! alloc_async {
    ($name:ident) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: *mut CUdeviceptr, bytes: usize, stream: Handle) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(*mut CUdeviceptr, usize, Handle) -> CUresult);
                accounted(
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    || unsafe { real(dptr, bytes, stream) },
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    |a| allocate_async(a, dptr, bytes, None, stream, || unsafe { real(dptr, bytes, stream) }),
                )
            })
        }
    };
}
alloc_async!(cuMemAllocAsync);
alloc_async!(cuMemAllocAsync_ptsz);

macro_rules! alloc_from_pool_async {
    ($name:ident) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytes: usize,
            pool: Handle,
            stream: Handle,
        ) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(*mut CUdeviceptr, usize, Handle, Handle) -> CUresult);
                accounted(
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    || unsafe { real(dptr, bytes, pool, stream) },
                    |a| {
                        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                        allocate_async(a, dptr, bytes, Some(pool), stream, || unsafe {
                            real(dptr, bytes, pool, stream)
                        })
                    },
                )
            })
        }
    };
}
alloc_from_pool_async!(cuMemAllocFromPoolAsync);
alloc_from_pool_async!(cuMemAllocFromPoolAsync_ptsz);

macro_rules! free_async {
    ($name:ident) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, stream: Handle) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(CUdeviceptr, Handle) -> CUresult);
                accounted(
                    // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                    || unsafe { real(dptr, stream) },
                    |a| {
                        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                        let rc = unsafe { real(dptr, stream) };
                        if rc == CUDA_SUCCESS {
                            a.freed_to_pool(dptr);
                        }
                        rc
                    },
                )
            })
        }
    };
}
free_async!(cuMemFreeAsync);
free_async!(cuMemFreeAsync_ptsz);

/// # Safety
/// The driver's contract for `cuMemPoolCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut Handle,
    props: *const AllocationPropHead,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuMemPoolCreate: fn(*mut Handle, *const AllocationPropHead) -> CUresult);
        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
        let rc = unsafe { real(pool, props) };
        if rc == CUDA_SUCCESS {
            if let (Some(mut a), Some(p), Some(props)) =
                (accounts::lock(), written(pool), written(props))
            {
                a.pool_created(p, props.location_type != CU_MEM_LOCATION_TYPE_DEVICE);
            }
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuMemPoolDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemPoolDestroy: fn(Handle) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(pool) },
            |a| {
                let used = crate::driver::pool_usage(pool).map(|(_, used)| used);
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(pool) };
                if rc == CUDA_SUCCESS {
                    a.pool_destroyed(pool, used);
                }
                rc
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemPoolTrimTo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemPoolTrimTo: fn(Handle, usize) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(pool, keep) },
            |a| {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(pool, keep) };
                if rc == CUDA_SUCCESS {
                    a.pool_trimmed(pool);
                }
                rc
            },
        )
    })
}

// ----- virtual memory management -----

/// # Safety
/// The driver's contract for `cuMemCreate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut PhysicalHandle,
    bytes: usize,
    prop: *const AllocationPropHead,
    flags: u64,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemCreate: fn(*mut PhysicalHandle, usize, *const AllocationPropHead, u64) -> CUresult);
        let on_device =
            written(prop).is_some_and(|p| p.location_type == CU_MEM_LOCATION_TYPE_DEVICE);
        // Host-located physical memory (HOST, HOST_NUMA) takes nothing from the GPU.
        match accounts::lock() {
            Some(mut a) if on_device => a.create_physical(bytes as u64, || {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                result(unsafe { real(handle, bytes, prop, flags) }, || {
                    written(handle)
                })
            }),
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            _ => unsafe { real(handle, bytes, prop, flags) },
        }
    })
}

/// # Safety
/// The driver's contract for `cuMemRelease`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: PhysicalHandle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemRelease: fn(PhysicalHandle) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(handle) },
            |a| {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(handle) };
                if rc == CUDA_SUCCESS {
                    a.physical_released(handle);
                }
                rc
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemExportToShareableHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: PhysicalHandle,
    handle_type: c_uint,
    flags: u64,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemExportToShareableHandle: fn(*mut c_void, PhysicalHandle, c_uint, u64) -> CUresult);
        accounted(
            // SAFETY: the caller's arguments, forwarded.
            || unsafe { real(shareable, handle, handle_type, flags) },
            |a| {
                // SAFETY: the caller's arguments, forwarded.
                let rc = unsafe { real(shareable, handle, handle_type, flags) };
                if rc == CUDA_SUCCESS {
                    // An importer may map it after we release it, or after we exit.
                    let key = (handle_type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                        .then(|| written(shareable as *const c_int))
                        .flatten()
                        .and_then(descriptor_key);
                    a.physical_exported(handle, key);
                }
                rc
            },
        )
    })
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: the shareable handle is an `int`
/// descriptor (the other types, Win32 and fabric, are not tracked across processes).
const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_uint = 0x1;

/// What names an exported allocation in every process its descriptor reaches
/// (SCM_RIGHTS, pidfd_getfd, /proc/PID/fd): the descriptor's file, device and inode.
fn descriptor_key(fd: c_int) -> Option<gpushare_proto::ShareKey> {
    // SAFETY: all-zero is a valid `stat`; fstat writes it for a descriptor we were
    // handed (a bad one fails with EBADF, nothing else).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some(gpushare_proto::ShareKey {
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// # Safety
/// The driver's contract for `cuMemImportFromShareableHandle`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut PhysicalHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemImportFromShareableHandle: fn(*mut PhysicalHandle, *mut c_void, c_uint) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(handle, os_handle, handle_type) };
        if rc != CUDA_SUCCESS || handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return rc;
        }
        // For a descriptor the "pointer" is the descriptor's value (cuda.h).
        let key = descriptor_key(os_handle as usize as c_int);
        if let (Some(key), Some(imported)) = (key, written(handle)) {
            if let Some(mut a) = accounts::lock() {
                a.physical_imported(imported, key);
            }
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuMemMap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    address: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: PhysicalHandle,
    flags: u64,
) -> CUresult {
    crate::guard::cuda(|| {
        let real =
            real_fn!(cuMemMap: fn(CUdeviceptr, usize, usize, PhysicalHandle, u64) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(address, size, offset, handle, flags) },
            |a| {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(address, size, offset, handle, flags) };
                if rc == CUDA_SUCCESS {
                    a.mapped(address, size as u64, handle);
                }
                rc
            },
        )
    })
}

/// # Safety
/// The driver's contract for `cuMemUnmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(address: CUdeviceptr, size: usize) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemUnmap: fn(CUdeviceptr, usize) -> CUresult);
        accounted(
            // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
            || unsafe { real(address, size) },
            |a| {
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(address, size) };
                if rc == CUDA_SUCCESS {
                    a.unmapped(address, size as u64);
                }
                rc
            },
        )
    })
}

// ----- graph memory nodes -----

/// Instantiation reads what the graph's allocation nodes need (`graph_memory`), so
/// that each launch can charge the graph pool's growth before it runs.
macro_rules! instantiate {
    ($name:ident ($($arg:ident: $ty:ty),*)) => {
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(exec: *mut Handle, graph: Handle $(, $arg: $ty)*) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn(*mut Handle, Handle $(, $ty)*) -> CUresult);
                // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
                let rc = unsafe { real(exec, graph $(, $arg)*) };
                if rc == CUDA_SUCCESS {
                    if let Some(exec) = written(exec) {
                        crate::graph_memory::instantiated(exec, graph);
                    }
                }
                rc
            })
        }
    };
}

instantiate!(cuGraphInstantiate_v2(error_node: *mut Handle, log: *mut libc::c_char, log_size: usize));
instantiate!(cuGraphInstantiateWithFlags(flags: u64));

/// # Safety
/// The driver's contract for `cuGraphExecDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: Handle) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuGraphExecDestroy: fn(Handle) -> CUresult);
        // SAFETY: forwarded unchanged to the driver's function for this variant; the caller accepted its contract.
        let rc = unsafe { real(exec) };
        if rc == CUDA_SUCCESS {
            crate::graph_memory::forget(exec);
        }
        rc
    })
}
