//! Copies take time proportional to their bytes (PCIe bandwidth for host copies, device
//! bandwidth for device-to-device), and move the bytes: device memory is the process's memory
//! image (`simgpu_model::contents`), at the address's offset. The bytes move when the call is
//! made, not when the copy reaches its turn on the GPU (a simplification for the
//! asynchronous forms: nothing on the simulated GPU reads or writes memory in between, as
//! kernels run no code). A copy or memset captured into a graph records its time only; a
//! graph launch moves no bytes. The 3D copies (`cuMemcpy3DWithAttributesAsync`) take their
//! time but move no bytes (the simulated driver does not model their pitched layout), nor do
//! host-to-host copies through the unified-addressing forms.
//!
//! Synchronous copies go through the legacy default stream (the thread's default stream for the
//! `_ptds` forms) and return once the copy has completed, as the real ones do. Memsets
//! (`cuMemsetD8`/`D32`, each `Async`) write device memory at device bandwidth, in stream order.

use super::{DevicePtr, Handle};
use crate::driver::{driver, image_failed, image_offset, Driver};
use crate::result::{guard, CUresult, CudaError};
use libc::c_void;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// Whether a copy moves bytes or only takes its time.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Data {
    Moved,
    /// The copies whose data the simulated driver does not model (see the module's notes).
    NotModelled,
}

/// Nanoseconds to move `bytes` at `bytes_per_s`.
pub fn copy_duration_ns(bytes: u64, bytes_per_s: u64) -> u64 {
    ((bytes as u128 * 1_000_000_000) / bytes_per_s.max(1) as u128) as u64
}

/// A copy: `device_ptrs` holds the device side (`[dst, src]` device to device), `host` the
/// host side.
///
/// # Safety
/// `host` is NULL or valid for `bytes` bytes: readable for a copy to the device, writable for
/// one from it (the caller's side of the CUDA API contract).
#[allow(clippy::too_many_arguments)]
unsafe fn copy(
    dir: Direction,
    device_ptrs: &[DevicePtr],
    host: *const c_void,
    bytes: usize,
    stream: Handle,
    per_thread: bool,
    synchronous: bool,
    data: Data,
) -> Result<(), CudaError> {
    let d = driver()?;
    let captured = {
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
        is_captured(d, &state, stream, per_thread)?
    };
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
    if data == Data::Moved && !captured && bytes > 0 {
        // SAFETY: per this function's contract.
        unsafe { move_bytes(d, dir, device_ptrs, host, bytes)? };
    }
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

/// Whether work for `stream` goes into a graph under capture rather than to the GPU.
fn is_captured(
    d: &Driver,
    state: &crate::driver::State,
    stream: Handle,
    per_thread: bool,
) -> Result<bool, CudaError> {
    let target = d.resolve_stream(state, stream, per_thread)?;
    Ok(d.capturing(state, target).is_some())
}

/// Moves a copy's bytes in the process's memory image.
///
/// # Safety
/// As [`copy`]: `host` is valid for `bytes` bytes in the copy's direction (non-null, checked
/// by the caller, when the copy involves the host).
unsafe fn move_bytes(
    d: &Driver,
    dir: Direction,
    device_ptrs: &[DevicePtr],
    host: *const c_void,
    bytes: usize,
) -> Result<(), CudaError> {
    let image = d.device_image()?;
    let device = image_offset(device_ptrs[0]);
    match dir {
        Direction::HostToDevice => {
            // SAFETY: the caller's source buffer of `bytes` bytes, per this function's contract.
            let src = unsafe { std::slice::from_raw_parts(host.cast::<u8>(), bytes) };
            image.write(device, src)
        }
        Direction::DeviceToHost => {
            // SAFETY: the caller's destination buffer of `bytes` bytes, per this function's
            // contract; nothing else refers to it during the call.
            let dst =
                unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>().cast_mut(), bytes) };
            image.read(device, dst)
        }
        Direction::DeviceToDevice => image.copy(device, image_offset(device_ptrs[1]), bytes as u64),
    }
    .map_err(image_failed)
}

/// Defines a host copy export: `name(parameters), direction, device pointer, host pointer,
/// byte count, stream, per-thread default stream, synchronous`.
macro_rules! host_copy {
    (
        $name:ident($($arg:ident: $ty:ty),*), $dir:ident, $device:ident, $host:ident,
        $bytes:ident, $stream:expr, $per_thread:expr, $synchronous:expr
    ) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            // SAFETY: the host buffer holds (to the device) or has room for (from it) `bytes`
            // bytes, per the API contract.
            guard(|| unsafe {
                copy(
                    Direction::$dir,
                    &[$device],
                    $host as *const c_void,
                    $bytes,
                    $stream,
                    $per_thread,
                    $synchronous,
                    Data::Moved,
                )
            })
        }
    };
}

host_copy!(cuMemcpyHtoD_v2(dst: DevicePtr, src: *const c_void, bytes: usize),
    HostToDevice, dst, src, bytes, 0, false, true);
host_copy!(cuMemcpyHtoD_v2_ptds(dst: DevicePtr, src: *const c_void, bytes: usize),
    HostToDevice, dst, src, bytes, 0, true, true);
host_copy!(cuMemcpyDtoH_v2(dst: *mut c_void, src: DevicePtr, bytes: usize),
    DeviceToHost, src, dst, bytes, 0, false, true);
host_copy!(cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: DevicePtr, bytes: usize),
    DeviceToHost, src, dst, bytes, 0, true, true);
host_copy!(cuMemcpyHtoDAsync_v2(dst: DevicePtr, src: *const c_void, bytes: usize, stream: Handle),
    HostToDevice, dst, src, bytes, stream, false, false);
host_copy!(cuMemcpyHtoDAsync_v2_ptsz(dst: DevicePtr, src: *const c_void, bytes: usize, stream: Handle),
    HostToDevice, dst, src, bytes, stream, true, false);
host_copy!(cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: DevicePtr, bytes: usize, stream: Handle),
    DeviceToHost, src, dst, bytes, stream, false, false);
host_copy!(cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: DevicePtr, bytes: usize, stream: Handle),
    DeviceToHost, src, dst, bytes, stream, true, false);

/// A device-to-device copy (no host memory involved).
fn copy_on_device(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
    per_thread: bool,
    synchronous: bool,
) -> Result<(), CudaError> {
    // SAFETY: no host pointer (NULL), which `copy` never dereferences.
    unsafe {
        copy(
            Direction::DeviceToDevice,
            &[dst, src],
            std::ptr::null(),
            bytes,
            stream,
            per_thread,
            synchronous,
            Data::Moved,
        )
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: DevicePtr, src: DevicePtr, bytes: usize) -> CUresult {
    guard(|| copy_on_device(dst, src, bytes, 0, false, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2_ptds(dst: DevicePtr, src: DevicePtr, bytes: usize) -> CUresult {
    guard(|| copy_on_device(dst, src, bytes, 0, true, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| copy_on_device(dst, src, bytes, stream, false, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2_ptsz(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    guard(|| copy_on_device(dst, src, bytes, stream, true, false))
}

/// A copy whose direction the pointers decide (unified addressing, CUDA 13.2's
/// `...WithAttributesAsync`): a pointer inside a device allocation is device memory, any
/// other non-null pointer host memory. Device to device at device bandwidth, anything
/// else at host bandwidth; stream-ordered. Host to host moves no bytes.
///
/// # Safety
/// A host pointer among `dst` and `src` is valid for `bytes` bytes (readable as the source,
/// writable as the destination), per the API contract.
unsafe fn copy_unified(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    stream: Handle,
    per_thread: bool,
    data: Data,
) -> Result<(), CudaError> {
    if dst == 0 || src == 0 {
        return Err(CudaError::InvalidValue);
    }
    let (dst_on_device, src_on_device) = {
        let d = driver()?;
        let state = d.state();
        (
            state.is_device_range(dst, bytes as u64),
            state.is_device_range(src, bytes as u64),
        )
    };
    let on_device: Vec<DevicePtr> = [(dst, dst_on_device), (src, src_on_device)]
        .iter()
        .filter(|(_, on)| *on)
        .map(|(p, _)| *p)
        .collect();
    let (dir, host) = match (dst_on_device, src_on_device) {
        (true, true) => (Direction::DeviceToDevice, std::ptr::null()),
        (true, false) => (Direction::HostToDevice, src as *const c_void),
        (false, _) => (Direction::DeviceToHost, dst as *const c_void),
    };
    let data = if on_device.is_empty() {
        Data::NotModelled
    } else {
        data
    };
    // SAFETY: the host pointer, if any, per this function's contract.
    unsafe {
        copy(
            dir, &on_device, host, bytes, stream, per_thread, false, data,
        )
    }
}

/// `cuMemcpyWithAttributesAsync`: one copy with its `CUmemcpyAttributes`, which the
/// driver requires (cuda.h: `attr` is not optional).
///
/// # Safety
/// As [`copy_unified`].
unsafe fn copy_with_attributes(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    attr: *const c_void,
    stream: Handle,
    per_thread: bool,
) -> Result<(), CudaError> {
    if attr.is_null() {
        return Err(CudaError::InvalidValue);
    }
    // SAFETY: per this function's contract.
    unsafe { copy_unified(dst, src, bytes, stream, per_thread, Data::Moved) }
}

/// # Safety
/// The driver's contract: a host pointer among `dst` and `src` is valid for `bytes` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyWithAttributesAsync(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    attr: *const c_void,
    stream: Handle,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    guard(|| unsafe { copy_with_attributes(dst, src, bytes, attr, stream, false) })
}

/// # Safety
/// As `cuMemcpyWithAttributesAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyWithAttributesAsync_ptsz(
    dst: DevicePtr,
    src: DevicePtr,
    bytes: usize,
    attr: *const c_void,
    stream: Handle,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    guard(|| unsafe { copy_with_attributes(dst, src, bytes, attr, stream, true) })
}

/// `CUmemcpy3DOperandType`'s `CU_MEMCPY_OPERAND_TYPE_POINTER`.
const OPERAND_POINTER: u32 = 1;
/// `CUDA_MEMCPY3D_BATCH_OP` (cuda.h): two 40-byte `CUmemcpy3DOperand`s (a 4-byte type, then
/// the union whose pointer form starts with the `CUdeviceptr`), then the `CUextent3D`.
const OP_SRC: usize = 0;
const OP_DST: usize = 40;
const OP_EXTENT: usize = 80;

/// `cuMemcpy3DWithAttributesAsync`: one 3D operation. The simulated driver supports pointer
/// operands (its arrays hold no layout); the copy takes the time of `width × height × depth`
/// bytes and moves none (pitched layouts are not modelled).
/// No flags are defined: any is refused, as the driver refuses unknown flags.
///
/// # Safety
/// `op` is null or a `CUDA_MEMCPY3D_BATCH_OP`.
unsafe fn copy_3d_with_attributes(
    op: *const c_void,
    flags: u64,
    stream: Handle,
    per_thread: bool,
) -> Result<(), CudaError> {
    if op.is_null() || flags != 0 {
        return Err(CudaError::InvalidValue);
    }
    let read = |offset: usize| {
        // SAFETY: a field inside the caller's CUDA_MEMCPY3D_BATCH_OP (offsets above).
        unsafe { op.cast::<u8>().add(offset).cast::<u64>().read_unaligned() }
    };
    let operand_type = |offset: usize| read(offset) as u32;
    if operand_type(OP_SRC) != OPERAND_POINTER || operand_type(OP_DST) != OPERAND_POINTER {
        return Err(CudaError::NotSupported);
    }
    let bytes = (0..3)
        .map(|i| read(OP_EXTENT + 8 * i))
        .fold(1u64, u64::saturating_mul);
    let bytes = usize::try_from(bytes).map_err(|_| CudaError::InvalidValue)?;
    // SAFETY: no bytes move, so no host pointer is dereferenced.
    unsafe {
        copy_unified(
            read(OP_DST + 8),
            read(OP_SRC + 8),
            bytes,
            stream,
            per_thread,
            Data::NotModelled,
        )
    }
}

/// # Safety
/// The driver's contract: `op` points at a `CUDA_MEMCPY3D_BATCH_OP`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3DWithAttributesAsync(
    op: *const c_void,
    flags: u64,
    stream: Handle,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    guard(|| unsafe { copy_3d_with_attributes(op, flags, stream, false) })
}

/// # Safety
/// As `cuMemcpy3DWithAttributesAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy3DWithAttributesAsync_ptsz(
    op: *const c_void,
    flags: u64,
    stream: Handle,
) -> CUresult {
    // SAFETY: the caller's contract, passed on.
    guard(|| unsafe { copy_3d_with_attributes(op, flags, stream, true) })
}

/// A memset of `count` elements `element` (its bytes in memory order) at `dst`: device memory
/// written at device bandwidth, in stream order. The synchronous forms are asynchronous to
/// the host for device memory (cuda.h): they return once queued on the legacy (or
/// per-thread) stream.
fn memset(
    dst: DevicePtr,
    element: &[u8],
    count: usize,
    stream: Handle,
    per_thread: bool,
) -> Result<(), CudaError> {
    let d = driver()?;
    let bytes = (count as u64).saturating_mul(element.len() as u64);
    let captured = {
        let state = d.state();
        if !state.is_device_range(dst, bytes) {
            return Err(CudaError::InvalidValue);
        }
        is_captured(d, &state, stream, per_thread)?
    };
    d.enqueue(
        stream,
        per_thread,
        &[copy_duration_ns(bytes, d.config.device_copy_bytes_per_s)],
        false,
    )?;
    if !captured && bytes > 0 {
        d.device_image()?
            .fill(image_offset(dst), bytes, element)
            .map_err(image_failed)?;
    }
    Ok(())
}

/// Defines a 1D memset: `name(per_thread, element type)`, with a stream argument when
/// `async`.
macro_rules! memset_1d {
    ($name:ident, $per_thread:expr, $ty:ty) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(dst: DevicePtr, value: $ty, count: usize) -> CUresult {
            guard(|| memset(dst, &value.to_ne_bytes(), count, 0, $per_thread))
        }
    };
    ($name:ident, $per_thread:expr, $ty:ty, async) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(
            dst: DevicePtr,
            value: $ty,
            count: usize,
            stream: Handle,
        ) -> CUresult {
            guard(|| memset(dst, &value.to_ne_bytes(), count, stream, $per_thread))
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
