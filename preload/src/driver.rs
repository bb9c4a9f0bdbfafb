//! Driver entry points the library calls for itself (never handed out): finding the
//! current device and its memory pool, reading pool attributes. Resolved once, cold,
//! from the loaded `libcuda.so.1`.

use std::ffi::CStr;
use std::sync::atomic::{AtomicPtr, Ordering};

use libc::{c_int, c_void};

use crate::cuda::*;
use crate::symbols::Library;

struct Lazy {
    name: &'static CStr,
    slot: AtomicPtr<c_void>,
}

impl Lazy {
    const fn new(name: &'static CStr) -> Lazy {
        Lazy {
            name,
            slot: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    fn get(&self) -> Option<*mut c_void> {
        let p = self.slot.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        let found = crate::loader::find_in_driver(Library::Cuda, self.name)?;
        self.slot.store(found, Ordering::Release);
        Some(found)
    }
}

static CTX_GET_DEVICE: Lazy = Lazy::new(c"cuCtxGetDevice");
static DEVICE_GET_MEM_POOL: Lazy = Lazy::new(c"cuDeviceGetMemPool");
static MEM_POOL_GET_ATTRIBUTE: Lazy = Lazy::new(c"cuMemPoolGetAttribute");

/// The current context's device.
pub fn current_device() -> Option<CUdevice> {
    let f = CTX_GET_DEVICE.get()?;
    let mut device: CUdevice = 0;
    // SAFETY: cuCtxGetDevice(CUdevice*) with a valid out-pointer.
    let rc = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut CUdevice) -> CUresult>(f)(
            &mut device,
        )
    };
    (rc == CUDA_SUCCESS).then_some(device)
}

/// The pool `cuMemAllocAsync` on `device` allocates from (its current pool).
pub fn current_pool(device: CUdevice) -> Option<Handle> {
    let f = DEVICE_GET_MEM_POOL.get()?;
    let mut pool: Handle = 0;
    // SAFETY: cuDeviceGetMemPool(CUmemoryPool*, CUdevice) with a valid out-pointer.
    let rc = unsafe {
        std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut Handle, CUdevice) -> CUresult>(
            f,
        )(&mut pool, device)
    };
    (rc == CUDA_SUCCESS && pool != 0).then_some(pool)
}

/// A pool's (reserved, used) bytes: what it holds from the device, and what of that
/// is handed out.
pub fn pool_usage(pool: Handle) -> Option<(u64, u64)> {
    let f = MEM_POOL_GET_ATTRIBUTE.get()?;
    type GetAttr = unsafe extern "C" fn(Handle, c_int, *mut c_void) -> CUresult;
    // SAFETY: cuMemPoolGetAttribute(pool, attr, void*): both attributes are cuuint64_t.
    let read = |attr: c_int| {
        let mut value: u64 = 0;
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, GetAttr>(f)(
                pool,
                attr,
                (&mut value as *mut u64).cast(),
            )
        };
        (rc == CUDA_SUCCESS).then_some(value)
    };
    Some((
        read(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        read(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
    ))
}
