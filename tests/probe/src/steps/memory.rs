//! Steps that allocate device memory (linear, pitched, managed, arrays, pools, virtual
//! memory) and free all of it again.

use crate::{entry, num, who, Held, Probe, Ptr, H, R};
use std::ffi::{c_int, c_uint, c_void};

#[repr(C)]
struct ArrayDesc {
    w: usize,
    h: usize,
    format: c_uint,
    channels: c_uint,
}
#[repr(C)]
struct Array3DDesc {
    w: usize,
    h: usize,
    d: usize,
    format: c_uint,
    channels: c_uint,
    flags: c_uint,
}
#[repr(C)]
struct AllocProp {
    kind: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}
#[repr(C)]
struct PoolProps {
    kind: c_uint,
    handle_types: c_uint,
    location_type: c_uint,
    location_id: c_int,
    win32: *mut c_void,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
}

pub(crate) fn alloc(p: &mut Probe, step: &str, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let bytes = num(args) as usize;
    let mut ptr = 0;
    let rc = if step == "alloc" {
        let f: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
        // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr (u64) to write.
        unsafe { f(&mut ptr, bytes) }
    } else {
        let f: unsafe extern "C" fn(*mut Ptr, usize, c_uint) -> R = c.get("cuMemAllocManaged");
        // SAFETY: cuMemAllocManaged, given a live CUdeviceptr to write and
        // CU_MEM_ATTACH_GLOBAL.
        unsafe { f(&mut ptr, bytes, 1) }
    };
    if rc == 0 {
        p.held.push(Held::Device(ptr));
        p.last_alloc = Some((ptr, bytes));
    }
    p.report(step, rc, &format!("bytes={bytes}"));
}

pub(crate) fn linked_alloc(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // What a program linked with -lcuda does: its `cuMemAlloc_v2` reference is
    // bound through the global scope, where the preloaded library comes first.
    let bytes = num(args) as usize;
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()) };
    // SAFETY: cuMemAlloc_v2's cuda.h signature (entry refuses a null symbol).
    let f: unsafe extern "C" fn(*mut Ptr, usize) -> R = unsafe { entry(sym, "cuMemAlloc_v2") };
    let mut ptr = 0;
    // SAFETY: cuMemAlloc_v2, given a live CUdeviceptr to write.
    let rc = unsafe { f(&mut ptr, bytes) };
    if rc == 0 {
        p.held.push(Held::Device(ptr));
    }
    p.report(
        "linked-alloc",
        rc,
        &format!("bytes={bytes} via={}", who(sym)),
    );
}

pub(crate) fn pitch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let (w, h) = (num(args) as usize, num(args) as usize);
    let f: unsafe extern "C" fn(*mut Ptr, *mut usize, usize, usize, c_uint) -> R =
        c.get("cuMemAllocPitch");
    let (mut ptr, mut pitch) = (0, 0);
    // SAFETY: cuMemAllocPitch_v2, given a live CUdeviceptr and a live size_t to
    // write; 4 is a valid element size.
    let rc = unsafe { f(&mut ptr, &mut pitch, w, h, 4) };
    if rc == 0 {
        p.held.push(Held::Device(ptr));
    }
    p.report("pitch", rc, &format!("pitch={pitch} bytes={}", pitch * h));
}

pub(crate) fn array(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let (w, h) = (num(args) as usize, num(args) as usize);
    let mut handle = 0;
    let f: unsafe extern "C" fn(*mut H, *const ArrayDesc) -> R = c.get("cuArrayCreate");
    // SAFETY: cuArrayCreate_v2, given a live CUarray to write and a
    // CUDA_ARRAY_DESCRIPTOR (ArrayDesc is its repr(C) layout) that
    // lives until the call returns.
    let rc = unsafe {
        f(
            &mut handle,
            &ArrayDesc {
                w,
                h,
                format: 0x20,
                channels: 1,
            },
        )
    };
    keep_array(p, "array", rc, Held::Array(handle));
}

pub(crate) fn array3d(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let (w, h) = (num(args) as usize, num(args) as usize);
    let mut handle = 0;
    let d = num(args) as usize;
    let f: unsafe extern "C" fn(*mut H, *const Array3DDesc) -> R = c.get("cuArray3DCreate");
    // SAFETY: cuArray3DCreate_v2, given a live CUarray to write and a
    // CUDA_ARRAY3D_DESCRIPTOR (Array3DDesc is its repr(C) layout) that
    // lives until the call returns.
    let rc = unsafe {
        f(
            &mut handle,
            &Array3DDesc {
                w,
                h,
                d,
                format: 0x20,
                channels: 1,
                flags: 0,
            },
        )
    };
    keep_array(p, "array3d", rc, Held::Array(handle));
}

pub(crate) fn mipmap(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let (w, h) = (num(args) as usize, num(args) as usize);
    let mut handle = 0;
    let levels = num(args) as c_uint;
    let f: unsafe extern "C" fn(*mut H, *const Array3DDesc, c_uint) -> R =
        c.get("cuMipmappedArrayCreate");
    // SAFETY: cuMipmappedArrayCreate, given a live
    // CUmipmappedArray to write and a CUDA_ARRAY3D_DESCRIPTOR that
    // lives until the call returns.
    let rc = unsafe {
        f(
            &mut handle,
            &Array3DDesc {
                w,
                h,
                d: 0,
                format: 0x20,
                channels: 1,
                flags: 0,
            },
            levels,
        )
    };
    keep_array(p, "mipmap", rc, Held::Mipmapped(handle));
}

/// Holds an array `step` created (when `rc` says it did) for `free-all`, and reports.
fn keep_array(p: &mut Probe, step: &str, rc: R, array: Held) {
    if rc == 0 {
        p.held.push(array);
    }
    p.report(step, rc, "");
}

pub(crate) fn alloc_async(
    p: &mut Probe,
    step: &str,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
) {
    let c = &p.cuda;
    let bytes = num(args) as usize;
    let mut ptr = 0;
    let rc = if step == "async" {
        let f: unsafe extern "C" fn(*mut Ptr, usize, H) -> R = c.get("cuMemAllocAsync");
        // SAFETY: cuMemAllocAsync, given a live CUdeviceptr to write, on the
        // legacy stream (0).
        unsafe { f(&mut ptr, bytes, 0) }
    } else {
        let pool = match p.pool {
            Some(pool) => pool,
            None => {
                let create: unsafe extern "C" fn(*mut H, *const PoolProps) -> R =
                    c.get("cuMemPoolCreate");
                let props = PoolProps {
                    kind: 1,
                    handle_types: 0,
                    location_type: 1,
                    location_id: dev,
                    win32: std::ptr::null_mut(),
                    max_size: 0,
                    usage: 0,
                    reserved: [0; 54],
                };
                let mut pool = 0;
                // SAFETY: cuMemPoolCreate, given a live CUmemoryPool to write and
                // CUmemPoolProps (PoolProps is its repr(C) layout, the reserved
                // bytes zero) that live until the call returns.
                let rc = unsafe { create(&mut pool, &props) };
                if rc != 0 {
                    return p.report(step, rc, "pool-create");
                }
                p.pool = Some(pool);
                pool
            }
        };
        let f: unsafe extern "C" fn(*mut Ptr, usize, H, H) -> R = c.get("cuMemAllocFromPoolAsync");
        // SAFETY: cuMemAllocFromPoolAsync, given a live CUdeviceptr to write, a
        // pool the driver made, and the legacy stream.
        unsafe { f(&mut ptr, bytes, pool, 0) }
    };
    if rc == 0 {
        p.held.push(Held::Pooled(ptr));
    }
    p.report(step, rc, &format!("bytes={bytes}"));
}

pub(crate) fn vmm(p: &mut Probe, step: &str, args: &mut impl Iterator<Item = String>, dev: c_int) {
    let c = &p.cuda;
    let size = num(args) as usize;
    let create: unsafe extern "C" fn(*mut u64, usize, *const AllocProp, u64) -> R =
        c.get("cuMemCreate");
    let location_type = if step == "vmm-host" { 2 } else { 1 };
    // `vmm-export`: shareable as a POSIX descriptor (IPC memory, which the driver cannot
    // checkpoint), exported once created and kept exported.
    let exported = step == "vmm-export";
    let prop = AllocProp {
        kind: 1,
        handle_types: u32::from(exported),
        location_type,
        location_id: dev,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    };
    let mut handle = 0;
    // SAFETY: cuMemCreate, given a live CUmemGenericAllocationHandle (u64) to
    // write and CUmemAllocationProp (AllocProp is its repr(C) layout) that lives
    // until the call returns.
    let rc = unsafe { create(&mut handle, size, &prop, 0) };
    if rc != 0 || step == "vmm-host" {
        if rc == 0 {
            let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
            // SAFETY: cuMemRelease of the handle cuMemCreate just made, released once.
            unsafe { release(handle) };
        }
        return p.report(step, rc, &format!("bytes={size}"));
    }
    let mut fd: c_int = -1;
    if exported {
        let export: unsafe extern "C" fn(*mut c_void, u64, u32, u64) -> R =
            c.get("cuMemExportToShareableHandle");
        // SAFETY: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR writes an int: `fd` is a live
        // c_int; the handle is the one cuMemCreate just made.
        let rc = unsafe { export((&mut fd as *mut c_int).cast(), handle, 1, 0) };
        if rc != 0 {
            return p.report(step, rc, &format!("bytes={size}"));
        }
    }
    let reserve: unsafe extern "C" fn(*mut Ptr, usize, usize, Ptr, u64) -> R =
        c.get("cuMemAddressReserve");
    let map: unsafe extern "C" fn(Ptr, usize, usize, u64, u64) -> R = c.get("cuMemMap");
    let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
    let mut va = 0;
    // The usual idiom: map, then release the handle at once; the memory lives until unmapped.
    // SAFETY: cuMemAddressReserve, given a live CUdeviceptr to write.
    let reserved = unsafe { reserve(&mut va, size, 0, 0, 0) };
    // SAFETY: cuMemMap takes the range and handle as values, which the driver
    // checks; the probe never touches the memory from the host.
    let mapped = unsafe { map(va, size, 0, handle, 0) };
    // SAFETY: cuMemRelease of the handle cuMemCreate made, released once.
    let released = unsafe { release(handle) };
    let rc = reserved.max(mapped).max(released);
    p.held.push(Held::Mapped { va, size });
    p.report(step, rc, &format!("bytes={size} fd={fd}"));
}

pub(crate) fn free_all(p: &mut Probe) {
    p.last_alloc = None;
    let c = &p.cuda;
    let mut worst = 0;
    while let Some(h) = p.held.pop() {
        // SAFETY: each free function is looked up with its cuda.h signature and
        // given, once, what its allocation step stored in `held` (all values,
        // no host pointers), popped so it is never freed twice.
        let rc = unsafe {
            match h {
                Held::Device(ptr) => c.get::<unsafe extern "C" fn(Ptr) -> R>("cuMemFree")(ptr),
                Held::Array(a) => c.get::<unsafe extern "C" fn(H) -> R>("cuArrayDestroy")(a),
                Held::Mipmapped(a) => {
                    c.get::<unsafe extern "C" fn(H) -> R>("cuMipmappedArrayDestroy")(a)
                }
                Held::Pooled(ptr) => {
                    c.get::<unsafe extern "C" fn(Ptr, H) -> R>("cuMemFreeAsync")(ptr, 0)
                }
                Held::Mapped { va, size } => {
                    let unmap: unsafe extern "C" fn(Ptr, usize) -> R = c.get("cuMemUnmap");
                    let free: unsafe extern "C" fn(Ptr, usize) -> R = c.get("cuMemAddressFree");
                    unmap(va, size).max(free(va, size))
                }
            }
        };
        worst = worst.max(rc);
    }
    p.report("free-all", worst, "");
}

pub(crate) fn trim(p: &mut Probe, dev: c_int) {
    let c = &p.cuda;
    let trim: unsafe extern "C" fn(H, usize) -> R = c.get("cuMemPoolTrimTo");
    let get_pool: unsafe extern "C" fn(*mut H, c_int) -> R = c.get("cuDeviceGetMemPool");
    let mut default_pool = 0;
    // SAFETY: cuDeviceGetMemPool, given a live CUmemoryPool to write.
    let mut rc = unsafe { get_pool(&mut default_pool, dev) };
    for pool in [Some(default_pool), p.pool].into_iter().flatten() {
        // SAFETY: cuMemPoolTrimTo takes the pool as a value, which the driver checks.
        rc = rc.max(unsafe { trim(pool, 0) });
    }
    p.report("trim", rc, "");
}

pub(crate) fn pool_destroy(p: &mut Probe) {
    let c = &p.cuda;
    let Some(pool) = p.pool.take() else {
        return p.report("pool-destroy", 1, "no pool");
    };
    let f: unsafe extern "C" fn(H) -> R = c.get("cuMemPoolDestroy");
    // SAFETY: cuMemPoolDestroy of the pool this probe created, taken out of
    // `p.pool` so it is destroyed once.
    let rc = unsafe { f(pool) };
    p.report("pool-destroy", rc, "");
}
