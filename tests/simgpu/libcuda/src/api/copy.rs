//! Copies take time proportional to their bytes (PCIe bandwidth for host copies, device
//! bandwidth for device-to-device). No data moves: the simulated device stores none.
//!
//! Synchronous copies go through the legacy default stream (the thread's default stream for the
//! `_ptds` forms) and return once the copy has completed, as the real ones do.

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
