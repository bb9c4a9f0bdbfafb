//! Virtual memory management: physical allocations (`cuMemCreate`) are charged when created,
//! device-located only; they are credited once released and no longer mapped.
//!
//! Sharing: `cuMemExportToShareableHandle` (POSIX file descriptor) hands out a real descriptor,
//! a memfd naming the allocation in the shared device model, which any process that receives it
//! (SCM_RIGHTS, pidfd_getfd) imports with `cuMemImportFromShareableHandle`. As on the real
//! driver, the memory stays allocated, and charged to the exporting process (as `nvidia-smi`
//! shows it), until every handle of every process is released and every mapping is gone; an
//! exporter's exit does not free it while another process holds it.

use super::DevicePtr;
use crate::driver::{driver, Mapping, Physical};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_void};
use simgpu_model::device::SharedAllocId;

/// Granularity of physical allocations and mappings (2 MiB, as on current GPUs).
pub const GRANULARITY: usize = 2 << 20;
/// `CUmemLocationType`: DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT.
const LOCATION_DEVICE: u32 = 1;
const LOCATION_HOST_FIRST: u32 = 2;
const LOCATION_HOST_LAST: u32 = 4;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_TYPE_POSIX_FD: u32 = 0x1;

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
                handle_types: prop.requested_handle_types,
                shared: None,
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
        match (p.shared, p.gpu) {
            // Shared: this process's reference goes; the model credits the exporter when the
            // last reference of any process does.
            (Some(id), _) => {
                let _ = d.device.lock()?.release_shared(d.process, id);
            }
            (None, Some(gpu)) => d.credit(gpu, p.size)?,
            (None, None) => {}
        }
    }
    Ok(())
}

/// The bytes of an exported handle's memfd: the model's slot and generation.
fn encode(id: SharedAllocId) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..4].copy_from_slice(&id.slot.to_le_bytes());
    bytes[8..].copy_from_slice(&id.generation.to_le_bytes());
    bytes
}

fn decode(bytes: &[u8; 16]) -> SharedAllocId {
    SharedAllocId {
        slot: u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
        generation: u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    handle_type: u32,
    flags: u64,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if shareable.is_null() || flags != 0 {
            return Err(CudaError::InvalidValue);
        }
        if handle_type != HANDLE_TYPE_POSIX_FD {
            return Err(CudaError::NotSupported);
        }
        let mut state = d.state();
        let p = state
            .physical
            .get_mut(&handle)
            .ok_or(CudaError::InvalidValue)?;
        // Only a type requested at cuMemCreate can be exported.
        if p.handle_types & HANDLE_TYPE_POSIX_FD == 0 {
            return Err(CudaError::NotPermitted);
        }
        let gpu = p.gpu.ok_or(CudaError::NotSupported)?;
        let id = match p.shared {
            Some(id) => id,
            None => {
                let id = d.device.lock()?.share_allocation(d.process, gpu, p.size)?;
                p.shared = Some(id);
                id
            }
        };
        let bytes = encode(id);
        // SAFETY: memfd_create with a static NUL-terminated name; pwrite of a local buffer to
        // the descriptor just created (closed again if the write fails).
        let fd = unsafe {
            let fd = libc::memfd_create(c"simgpu-vmm".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(CudaError::OutOfMemory);
            }
            if libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len(), 0) != bytes.len() as isize {
                libc::close(fd);
                return Err(CudaError::Unknown);
            }
            fd
        };
        // SAFETY: for a POSIX descriptor the shareable handle is an int, per the API contract.
        unsafe { write_out(shareable as *mut c_int, fd) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    handle_type: u32,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        if handle.is_null() {
            return Err(CudaError::InvalidValue);
        }
        if handle_type != HANDLE_TYPE_POSIX_FD {
            return Err(CudaError::NotSupported);
        }
        // For a POSIX descriptor the OS handle is the descriptor's value, cast to a pointer.
        let fd = os_handle as usize as c_int;
        let mut bytes = [0u8; 16];
        // SAFETY: pread into a local buffer of its length from a descriptor the caller owns.
        let read = unsafe { libc::pread(fd, bytes.as_mut_ptr().cast(), bytes.len(), 0) };
        if read != bytes.len() as isize {
            return Err(CudaError::InvalidValue);
        }
        let id = decode(&bytes);
        let (gpu, size) = d
            .device
            .lock()?
            .import_allocation(d.process, id)
            .map_err(|_| CudaError::InvalidValue)?;
        let mut state = d.state();
        let h = state.next_physical;
        state.next_physical += 1;
        state.physical.insert(
            h,
            Physical {
                gpu: Some(gpu),
                size,
                released: false,
                mappings: 0,
                handle_types: HANDLE_TYPE_POSIX_FD,
                shared: Some(id),
            },
        );
        // SAFETY: checked non-null; out-parameter per the API contract.
        unsafe { write_out(handle, h) }
    })
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
