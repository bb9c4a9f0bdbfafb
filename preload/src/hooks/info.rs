//! Virtualised memory answers: inside the container the GPU is as large as the
//! lease's share (clamped to the physical GPU), and what is free is what is left of
//! the share (and physically free), so frameworks size their caches to the share.

use super::real_fn;
use crate::accounts;
use crate::cuda::*;
use crate::lease_link::QuotaView;

/// (free, total) as the container should see them, from the physical answer and
/// the lease's share. With no share known (arbiter unreachable since the start),
/// nothing is free: allocations would be refused anyway.
pub fn virtual_free_total(
    physical_free: u64,
    physical_total: u64,
    view: Option<QuotaView>,
) -> (u64, u64) {
    match view {
        None => (0, physical_total),
        Some(v) => {
            let total = v.per_gpu().min(physical_total);
            let free = if v.released {
                0
            } else {
                v.remaining().min(total).min(physical_free)
            };
            (free, total)
        }
    }
}

/// # Safety
/// The driver's contract for `cuMemGetInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(free, total) };
        if rc != CUDA_SUCCESS || free.is_null() || total.is_null() {
            return rc;
        }
        let Some(mut a) = accounts::lock() else {
            return rc;
        };
        let view = a.view();
        drop(a);
        // SAFETY: non-null out-parameters the driver just wrote.
        unsafe {
            let (f, t) = virtual_free_total(*free as u64, *total as u64, view);
            *free = f as usize;
            *total = t as usize;
        }
        rc
    })
}

/// # Safety
/// The driver's contract for `cuDeviceTotalMem_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    crate::guard::cuda(|| {
        let real = real_fn!(cuDeviceTotalMem_v2: fn(*mut usize, CUdevice) -> CUresult);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(bytes, device) };
        if rc != CUDA_SUCCESS || bytes.is_null() {
            return rc;
        }
        let Some(mut a) = accounts::lock() else {
            return rc;
        };
        let view = a.link.known_quota();
        drop(a);
        // SAFETY: a non-null out-parameter the driver just wrote.
        unsafe {
            let physical = *bytes as u64;
            *bytes = view.map_or(physical, |v| v.per_gpu().min(physical)) as usize;
        }
        rc
    })
}

/// NVML's (total, free, used): the share, what is left of it, the rest used.
fn nvml_view(physical_free: u64, physical_total: u64) -> Option<(u64, u64, u64)> {
    let mut a = accounts::lock()?;
    let view = a.view();
    drop(a);
    let (free, total) = virtual_free_total(physical_free, physical_total, view);
    Some((total, free, total - free))
}

macro_rules! nvml_real {
    ($hook:ident, $ty:ty) => {
        match crate::symbols::real(crate::symbols::Hook::$hook) {
            // SAFETY: the slot holds NVML's own function of this name and signature.
            Some(p) => unsafe {
                std::mem::transmute::<
                    *mut libc::c_void,
                    unsafe extern "C" fn(NvmlDevice, *mut $ty) -> NvmlReturn,
                >(p)
            },
            None => return NVML_ERROR_FUNCTION_NOT_FOUND,
        }
    };
}

/// # Safety
/// NVML's contract for `nvmlDeviceGetMemoryInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    crate::guard::or(NVML_ERROR_UNKNOWN, || {
        let real = nvml_real!(nvmlDeviceGetMemoryInfo, NvmlMemory);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(device, memory) };
        if rc != NVML_SUCCESS || memory.is_null() {
            return rc;
        }
        // SAFETY: a non-null out-parameter NVML just wrote.
        let m = unsafe { &mut *memory };
        if let Some((total, free, used)) = nvml_view(m.free, m.total) {
            (m.total, m.free, m.used) = (total, free, used);
        }
        rc
    })
}

/// # Safety
/// NVML's contract for `nvmlDeviceGetMemoryInfo_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    crate::guard::or(NVML_ERROR_UNKNOWN, || {
        let real = nvml_real!(nvmlDeviceGetMemoryInfo_v2, NvmlMemoryV2);
        // SAFETY: the caller's arguments, forwarded.
        let rc = unsafe { real(device, memory) };
        if rc != NVML_SUCCESS || memory.is_null() {
            return rc;
        }
        // SAFETY: a non-null out-parameter NVML just wrote.
        let m = unsafe { &mut *memory };
        if let Some((total, free, used)) = nvml_view(m.free, m.total) {
            (m.total, m.reserved, m.free, m.used) = (total, 0, free, used);
        }
        rc
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    #[test]
    fn share_clamped_to_physical() {
        let v = QuotaView {
            quota: GI,
            used: GI / 4,
            overhead: 0,
            gpus: 1,
            released: false,
        };
        assert_eq!(
            virtual_free_total(15 * GI, 16 * GI, Some(v)),
            (3 * GI / 4, GI)
        );
        let big = QuotaView {
            quota: 32 * GI,
            used: 0,
            overhead: 0,
            gpus: 1,
            released: false,
        };
        assert_eq!(
            virtual_free_total(2 * GI, 16 * GI, Some(big)),
            (2 * GI, 16 * GI)
        );
        let two = QuotaView {
            quota: 8 * GI,
            used: 0,
            overhead: 0,
            gpus: 2,
            released: false,
        };
        assert_eq!(
            virtual_free_total(16 * GI, 16 * GI, Some(two)),
            (4 * GI, 4 * GI)
        );
        assert_eq!(virtual_free_total(16 * GI, 16 * GI, None), (0, 16 * GI));
        let gone = QuotaView {
            released: true,
            ..v
        };
        assert_eq!(virtual_free_total(16 * GI, 16 * GI, Some(gone)).0, 0);
    }
}
