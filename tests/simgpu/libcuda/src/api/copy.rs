//! Copies take time proportional to their bytes (PCIe bandwidth for host copies, device
//! bandwidth for device-to-device). No data moves: the simulated device stores none.
//!
//! Synchronous copies go through the legacy default stream (the thread's default stream for the
//! `_ptds` forms) and return once the copy has completed, as the real ones do. Memsets
//! (`cuMemsetD8`/`D32`, each `Async`) write device memory at device bandwidth, in stream order.

use super::{DevicePtr, Handle};
use crate::driver::driver;
use crate::result::{guard, CUresult, CudaError};
use libc::c_void;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// Nanoseconds to move `bytes` at `bytes_per_s`.
pub fn copy_duration_ns(bytes: u64, bytes_per_s: u64) -> u64 {
    ((bytes as u128 * 1_000_000_000) / bytes_per_s.max(1) as u128) as u64
}

fn copy(
    dir: Direction,
    device_ptrs: &[DevicePtr],
    host: *const c_void,
    bytes: usize,
    stream: Handle,
    per_thread: bool,
    synchronous: bool,
) -> Result<(), CudaError> {
    let d = driver()?;
    {
        let mut state = d.state();
        if bytes > 0 && dir != Direction::DeviceToDevice && host.is_null() {
            return Err(CudaError::InvalidValue);
        }
        if device_ptrs
            .iter()
            .any(|p| !state.is_device_range(*p, bytes as u64))
        {
            return Err(CudaError::InvalidValue);
        }
        if synchronous {
            // A synchronous copy waits for the GPU: unsafe during capture.
            d.check_unsafe_call(&mut state)?;
        }
    }
    let bandwidth = match dir {
        Direction::DeviceToDevice => d.config.device_copy_bytes_per_s,
        _ => d.config.host_copy_bytes_per_s,
    };
    d.enqueue(
        stream,
        per_thread,
        &[copy_duration_ns(bytes as u64, bandwidth)],
        false,
    )?;
    if synchronous {
        let (id, last) = {
            let state = d.state();
            let target = d.resolve_stream(&state, stream, per_thread)?;
            d.stream_last(&state, target)?
        };
        d.wait(id, last)?;
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
) -> CUresult {
    guard(|| copy(Direction::HostToDevice, &[dst], src, bytes, 0, false, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2_ptds(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
) -> CUresult {
    guard(|| copy(Direction::HostToDevice, &[dst], src, bytes, 0, true, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
) -> CUresult {
    guard(|| copy(Direction::DeviceToHost, &[src], dst, bytes, 0, false, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2_ptds(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
) -> CUresult {
    guard(|| copy(Direction::DeviceToHost, &[src], dst, bytes, 0, true, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: DevicePtr, src: DevicePtr, bytes: usize) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToDevice,
            &[dst, src],
            std::ptr::null(),
            bytes,
            0,
            false,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2_ptds(dst: DevicePtr, src: DevicePtr, bytes: usize) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToDevice,
            &[dst, src],
            std::ptr::null(),
            bytes,
            0,
            true,
            true,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::HostToDevice,
            &[dst],
            src,
            bytes,
            stream,
            false,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2_ptsz(
    dst: DevicePtr,
    src: *const c_void,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::HostToDevice,
            &[dst],
            src,
            bytes,
            stream,
            true,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToHost,
            &[src],
            dst,
            bytes,
            stream,
            false,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2_ptsz(
    dst: *mut c_void,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToHost,
            &[src],
            dst,
            bytes,
            stream,
            true,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToDevice,
            &[dst, src],
            std::ptr::null(),
            bytes,
            stream,
            false,
            false,
        )
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| {
        copy(
            Direction::DeviceToDevice,
            &[dst, src],
            std::ptr::null(),
            bytes,
            stream,
            true,
            false,
        )
    })
}

/// A memset of `bytes` (`count` elements) at `dst`: device memory written at device
/// bandwidth, in stream order. The synchronous forms are asynchronous to the host for
/// device memory (cuda.h): they return once queued on the legacy (or per-thread) stream.
fn memset(dst: DevicePtr, bytes: u64, stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    if !d.state().is_device_range(dst, bytes) {
        return Err(CudaError::InvalidValue);
    }
    d.enqueue(
        stream,
        per_thread,
        &[copy_duration_ns(bytes, d.config.device_copy_bytes_per_s)],
        false,
    )?;
    Ok(())
}

/// Defines a 1D memset: `name(per_thread, element type)`, with a stream argument when
/// `async`.
macro_rules! memset_1d {
    ($name:ident, $per_thread:expr, $ty:ty) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(dst: DevicePtr, _value: $ty, count: usize) -> CUresult {
            guard(|| {
                let bytes = (count as u64).saturating_mul(std::mem::size_of::<$ty>() as u64);
                memset(dst, bytes, 0, $per_thread)
            })
        }
    };
    ($name:ident, $per_thread:expr, $ty:ty, async) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(
            dst: DevicePtr,
            _value: $ty,
            count: usize,
            stream: Handle,
        ) -> CUresult {
            guard(|| {
                let bytes = (count as u64).saturating_mul(std::mem::size_of::<$ty>() as u64);
                memset(dst, bytes, stream, $per_thread)
            })
        }
    };
}

memset_1d!(cuMemsetD8_v2, false, u8);
memset_1d!(cuMemsetD8_v2_ptds, true, u8);
memset_1d!(cuMemsetD32_v2, false, u32);
memset_1d!(cuMemsetD32_v2_ptds, true, u32);
memset_1d!(cuMemsetD8Async, false, u8, async);
memset_1d!(cuMemsetD8Async_ptsz, true, u8, async);
memset_1d!(cuMemsetD32Async, false, u32, async);
memset_1d!(cuMemsetD32Async_ptsz, true, u32, async);

#[cfg(test)]
mod tests {
    #[test]
    fn copy_time_is_proportional_to_bytes() {
        assert_eq!(
            super::copy_duration_ns(25_000_000_000, 25_000_000_000),
            1_000_000_000
        );
        assert_eq!(super::copy_duration_ns(1 << 20, 25_000_000_000), 41_943);
        assert_eq!(super::copy_duration_ns(0, 1), 0);
    }
}
