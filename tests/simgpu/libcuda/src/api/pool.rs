//! Stream-ordered allocation and memory pools. A pool keeps freed blocks reserved (still charged
//! to the device) until a synchronisation trims it to its release threshold (default 0) or
//! `cuMemPoolTrimTo` is called: exactly the growth an interposer must account for.

use super::{CuDevice, DevicePtr, Handle};
use crate::driver::{driver, AllocKind, Pool};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::c_void;

/// `CUmemPool_attribute` values.
const ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
const ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: i32 = 3;
const ATTR_RELEASE_THRESHOLD: i32 = 4;
const ATTR_RESERVED_MEM_CURRENT: i32 = 5;
const ATTR_RESERVED_MEM_HIGH: i32 = 6;
const ATTR_USED_MEM_CURRENT: i32 = 7;
const ATTR_USED_MEM_HIGH: i32 = 8;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_DEVICE: u32 = 1;

/// The leading fields of `CUmemPoolProps` (the rest is reserved space the driver ignores).
#[repr(C)]
pub struct PoolPropsHead {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location_type: u32,
    pub location_id: i32,
}

fn alloc_async(
    dptr: *mut DevicePtr,
    size: usize,
    pool: Option<Handle>,
    stream: Handle,
    per_thread: bool,
) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    let ctx = d.target_context(&state, target)?;
    if dptr.is_null() || size == 0 {
        return Err(CudaError::InvalidValue);
    }
    if let Some(c) = d.capturing(&state, target) {
        // Captured, it becomes a memory allocation node: the address is fixed now, the memory
        // comes from the graph memory pool when the graph is launched.
        if c.invalidated {
            return Err(CudaError::StreamCaptureInvalidated);
        }
        let graph = c.graph;
        let ptr = state.take_va(size as u64, 512);
        state
            .graphs
            .get_mut(graph)
            .ok_or(CudaError::StreamCaptureInvalidated)?
            .allocs
            .push((ptr, size as u64));
        // SAFETY: checked non-null; out-parameter per the API contract.
        return unsafe { write_out(dptr, ptr) };
    }
    let pool = match pool {
        Some(p) => p,
        None => {
            let gpu = state.context(ctx)?.gpu;
            d.default_pool(&mut state, gpu);
            state.current_pools[gpu as usize]
        }
    };
    let ptr = d.allocate_from_pool(&mut state, ctx, pool, size as u64)?;
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(dptr, ptr) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut DevicePtr,
    size: usize,
    stream: Handle,
) -> CUresult {
    guard(|| alloc_async(dptr, size, None, stream, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut DevicePtr,
    size: usize,
    stream: Handle,
) -> CUresult {
    guard(|| alloc_async(dptr, size, None, stream, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut DevicePtr,
    size: usize,
    pool: Handle,
    stream: Handle,
) -> CUresult {
    guard(|| alloc_async(dptr, size, Some(pool), stream, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut DevicePtr,
    size: usize,
    pool: Handle,
    stream: Handle,
) -> CUresult {
    guard(|| alloc_async(dptr, size, Some(pool), stream, true))
}

fn free_async(dptr: DevicePtr, stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    if let Some(c) = d.capturing(&state, target) {
        // A memory free node: it may free only what an allocation node of the same graph
        // allocated, or a live graph allocation.
        if c.invalidated {
            return Err(CudaError::StreamCaptureInvalidated);
        }
        let graph = c.graph;
        let live_graph_alloc = state
            .allocations
            .get(&dptr)
            .is_some_and(|a| a.kind == AllocKind::Graph);
        let g = state
            .graphs
            .get_mut(graph)
            .ok_or(CudaError::StreamCaptureInvalidated)?;
        if g.allocs.iter().any(|(p, _)| *p == dptr) {
            g.frees.push(dptr);
            return Ok(());
        }
        if live_graph_alloc {
            // Freed when the graph runs; simgpu frees it now (the graph can only run after).
            return d.free_to_pool(&mut state, dptr).map(|_| ());
        }
        return Err(CudaError::InvalidValue);
    }
    d.free_to_pool(&mut state, dptr).map(|_| ())
}

/// `CUgraphMem_attribute`.
const GRAPH_MEM_USED_CURRENT: i32 = 0;
const GRAPH_MEM_USED_HIGH: i32 = 1;
const GRAPH_MEM_RESERVED_CURRENT: i32 = 2;
const GRAPH_MEM_RESERVED_HIGH: i32 = 3;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(
    dev: CuDevice,
    attr: i32,
    value: *mut c_void,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let pool = d.state().graph_pools[gpu as usize];
        let v = match attr {
            GRAPH_MEM_USED_CURRENT => pool.used,
            GRAPH_MEM_USED_HIGH => pool.used_high,
            GRAPH_MEM_RESERVED_CURRENT => pool.reserved,
            GRAPH_MEM_RESERVED_HIGH => pool.reserved_high,
            _ => return Err(CudaError::InvalidValue),
        };
        // SAFETY: a cuuint64_t out-parameter per the API contract.
        unsafe { write_out(value as *mut u64, v) }
    })
}

/// Only the high-water marks can be set, and only to 0 (a reset to the current value).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceSetGraphMemAttribute(
    dev: CuDevice,
    attr: i32,
    value: *mut c_void,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        if value.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: a cuuint64_t per the API contract (checked non-null).
        if unsafe { *(value as *const u64) } != 0 {
            return Err(CudaError::InvalidValue);
        }
        let mut state = d.state();
        let pool = &mut state.graph_pools[gpu as usize];
        match attr {
            GRAPH_MEM_USED_HIGH => pool.used_high = pool.used,
            GRAPH_MEM_RESERVED_HIGH => pool.reserved_high = pool.reserved,
            _ => return Err(CudaError::InvalidValue),
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGraphMemTrim(dev: CuDevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        d.trim_graph_pool(&mut d.state(), gpu)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: DevicePtr, stream: Handle) -> CUresult {
    guard(|| free_async(dptr, stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: DevicePtr, stream: Handle) -> CUresult {
    guard(|| free_async(dptr, stream, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(pool: *mut Handle, dev: CuDevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let h = d.default_pool(&mut d.state(), gpu);
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pool, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut Handle, dev: CuDevice) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let mut state = d.state();
        d.default_pool(&mut state, gpu);
        let h = state.current_pools[gpu as usize];
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pool, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceSetMemPool(dev: CuDevice, pool: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let gpu = d.check_gpu(dev)?;
        let mut state = d.state();
        if state.pools.get(pool).ok_or(CudaError::InvalidValue)?.gpu != gpu {
            return Err(CudaError::InvalidValue);
        }
        state.current_pools[gpu as usize] = pool;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut Handle,
    props: *const PoolPropsHead,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        // SAFETY: a valid CUmemPoolProps per the API contract (NULL rejected).
        let props = unsafe { props.as_ref() }.ok_or(CudaError::InvalidValue)?;
        if props.location_type != LOCATION_DEVICE {
            return Err(CudaError::NotSupported);
        }
        let gpu = d.check_gpu(props.location_id)?;
        let h = d.state().pools.insert(Pool {
            gpu,
            reserved: 0,
            used: 0,
            release_threshold: 0,
            reserved_high: 0,
            used_high: 0,
        });
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(pool, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolDestroy(pool: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        if state.default_pools.contains(&pool) {
            return Err(CudaError::InvalidValue);
        }
        // Cached bytes go back now; blocks still allocated are credited when freed.
        d.trim_pool(&mut state, pool, 0)?;
        state.pools.remove(pool);
        for current in state.current_pools.iter_mut() {
            if *current == pool {
                *current = 0;
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemPoolTrimTo(pool: Handle, keep: usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        d.trim_pool(&mut d.state(), pool, keep as u64)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: Handle,
    attr: i32,
    value: *mut c_void,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let p = state.pools.get_mut(pool).ok_or(CudaError::InvalidValue)?;
        if value.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: the attribute's value type (int or cuuint64_t) per the API contract.
        unsafe {
            match attr {
                ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {}
                ATTR_RELEASE_THRESHOLD => p.release_threshold = *(value as *const u64),
                // Only resetting the high-water marks is allowed (value 0).
                ATTR_RESERVED_MEM_HIGH => p.reserved_high = p.reserved,
                ATTR_USED_MEM_HIGH => p.used_high = p.used,
                _ => return Err(CudaError::InvalidValue),
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: Handle,
    attr: i32,
    value: *mut c_void,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let state = d.state();
        let p = state.pools.get(pool).ok_or(CudaError::InvalidValue)?;
        // SAFETY: the attribute's value type (int or cuuint64_t) per the API contract.
        unsafe {
            match attr {
                ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                    write_out(value as *mut i32, 1)
                }
                ATTR_RELEASE_THRESHOLD => write_out(value as *mut u64, p.release_threshold),
                ATTR_RESERVED_MEM_CURRENT => write_out(value as *mut u64, p.reserved),
                ATTR_RESERVED_MEM_HIGH => write_out(value as *mut u64, p.reserved_high),
                ATTR_USED_MEM_CURRENT => write_out(value as *mut u64, p.used),
                ATTR_USED_MEM_HIGH => write_out(value as *mut u64, p.used_high),
                _ => Err(CudaError::InvalidValue),
            }
        }
    })
}
