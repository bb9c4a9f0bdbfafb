//! Virtual memory management: physical allocations (`cuMemCreate`) are charged when created,
//! device-located only; they are credited once released and no longer mapped.

use super::DevicePtr;
use crate::driver::{driver, Mapping, Physical};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::c_void;

/// Granularity of physical allocations and mappings (2 MiB, as on current GPUs).
pub const GRANULARITY: usize = 2 << 20;
/// `CUmemLocationType`: DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT.
const LOCATION_DEVICE: u32 = 1;
const LOCATION_HOST_FIRST: u32 = 2;
const LOCATION_HOST_LAST: u32 = 4;

/// `CUmemAllocationProp`.
#[repr(C)]
pub struct AllocationProp {
    pub alloc_type: u32,
    pub requested_handle_types: u32,
    pub location_type: u32,
    pub location_id: i32,
    pub win32_metadata: *mut c_void,
    pub alloc_flags: [u8; 8],
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const AllocationProp,
    _option: i32,
) -> CUresult {
    guard(|| {
        driver()?;
        if prop.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(granularity, GRANULARITY) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    _flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        // SAFETY: a valid CUmemAllocationProp per the API contract (NULL rejected).
        let prop = unsafe { prop.as_ref() }.ok_or(CudaError::InvalidValue)?;
        if size == 0 || !size.is_multiple_of(GRANULARITY) || handle.is_null() {
            return Err(CudaError::InvalidValue);
        }
        let gpu = match prop.location_type {
            LOCATION_DEVICE => Some(d.check_gpu(prop.location_id)?),
            LOCATION_HOST_FIRST..=LOCATION_HOST_LAST => None,
            _ => return Err(CudaError::InvalidValue),
        };
        if let Some(gpu) = gpu {
            d.charge(gpu, size as u64)?;
        }
        let mut state = d.state();
        let h = state.next_physical;
        state.next_physical += 1;
        state.physical.insert(
            h,
            Physical {
                gpu,
                size: size as u64,
                released: false,
                mappings: 0,
            },
        );
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(handle, h) }
    })
}

fn credit_if_unused(
    d: &crate::driver::Driver,
    state: &mut crate::driver::State,
    handle: u64,
) -> Result<(), CudaError> {
    let done = state
        .physical
        .get(&handle)
        .is_some_and(|p| p.released && p.mappings == 0);
    if done {
        let p = state.physical.remove(&handle).expect("checked above");
        if let Some(gpu) = p.gpu {
            d.credit(gpu, p.size)?;
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let p = state
            .physical
            .get_mut(&handle)
            .ok_or(CudaError::InvalidValue)?;
        if p.released {
            return Err(CudaError::InvalidValue);
        }
        p.released = true;
        credit_if_unused(d, &mut state, handle)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut DevicePtr,
    size: usize,
    alignment: usize,
    _addr: DevicePtr,
    _flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if size == 0 || !size.is_multiple_of(GRANULARITY) {
            return Err(CudaError::InvalidValue);
        }
        let mut state = d.state();
        let base = state.take_va(size as u64, alignment.max(GRANULARITY) as u64);
        state.reservations.insert(base, size as u64);
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(ptr, base) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: DevicePtr, size: usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        match state.reservations.get(&ptr) {
            Some(&s) if s == size as u64 => {
                state.reservations.remove(&ptr);
                Ok(())
            }
            _ => Err(CudaError::InvalidValue),
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: DevicePtr,
    size: usize,
    offset: usize,
    handle: u64,
    _flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let (size, end) = (
            size as u64,
            ptr.checked_add(size as u64)
                .ok_or(CudaError::InvalidValue)?,
        );
        let reserved = state
            .reservations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(b, s)| end <= b + s);
        let overlaps = state
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(b, m)| b + m.size > ptr);
        let p = state
            .physical
            .get_mut(&handle)
            .ok_or(CudaError::InvalidValue)?;
        if !reserved || overlaps || p.released || offset as u64 + size > p.size {
            return Err(CudaError::InvalidValue);
        }
        p.mappings += 1;
        state.mappings.insert(
            ptr,
            Mapping {
                size,
                physical: handle,
            },
        );
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: DevicePtr, size: usize) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let end = ptr.saturating_add(size as u64);
        let inside: Vec<u64> = state.mappings.range(ptr..end).map(|(b, _)| *b).collect();
        if inside.is_empty() {
            return Err(CudaError::InvalidValue);
        }
        for base in inside {
            let m = state.mappings.remove(&base).expect("listed above");
            if let Some(p) = state.physical.get_mut(&m.physical) {
                p.mappings -= 1;
            }
            credit_if_unused(d, &mut state, m.physical)?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: DevicePtr,
    size: usize,
    desc: *const c_void,
    count: usize,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if desc.is_null() || count == 0 || !d.state().is_device_range(ptr, size as u64) {
            return Err(CudaError::InvalidValue);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn allocation_prop_matches_the_c_layout() {
        assert_eq!(std::mem::offset_of!(super::AllocationProp, location_id), 12);
        assert_eq!(std::mem::offset_of!(super::AllocationProp, alloc_flags), 24);
        assert_eq!(std::mem::size_of::<super::AllocationProp>(), 32);
    }
}
