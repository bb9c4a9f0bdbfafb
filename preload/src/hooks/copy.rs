//! Copy and memset wrappers: GPU work like a kernel (the copy engines and the memory
//! bandwidth are the GPU's, and a device-to-device copy runs on the SMs), so each
//! passes the same gate as a launch (`gate::admit` before, `gate::launched` after).
//! Without it a low-priority process kept the GPU busy with copies while a
//! high-priority job held the token (in an adversarial test, 40 device-to-device copies
//! of 256 MiB ran unhindered). A host-synchronous copy waits for the token like a launch,
//! then runs (its return already waits for the copy).
//!
//! Each copy carries its estimated duration (bytes over the bandwidth of its path) for
//! the admission windows, in place of a measured one. This is the hot path too: nothing
//! here but the gate's own loads, a multiplication and a division (and, for 2D/3D
//! copies, two or three loads from the caller's descriptor).

use libc::c_void;

use super::real_fn;
use crate::cuda::*;
use crate::gate::estimate::What;
use crate::gate::{self, Target};

/// Host ↔ device: PCIe 4.0 ×16 in practice, 25 GB/s (bytes per nanosecond).
const HOST_BYTES_PER_NS: u64 = 25;
/// Device ↔ device and memsets: device memory bandwidth, 900 GB/s, on the low side of
/// current data-centre GPUs (a short estimate admits too much, a long one holds too much
/// back).
const DEVICE_BYTES_PER_NS: u64 = 900;

/// A division by a constant (a multiplication once compiled): this runs on every copy.
#[inline(always)]
fn duration_ns(bytes: usize, bytes_per_ns: u64) -> u64 {
    bytes as u64 / bytes_per_ns
}

#[inline(always)]
fn host(bytes: usize) -> What {
    What::Copy(duration_ns(bytes, HOST_BYTES_PER_NS))
}

#[inline(always)]
fn device(bytes: usize) -> What {
    What::Copy(duration_ns(bytes, DEVICE_BYTES_PER_NS))
}

/// A copy whose direction the pointers decide (unified addressing, descriptors): the
/// slower path, so the estimate errs long.
#[inline(always)]
fn unified(bytes: usize) -> What {
    host(bytes)
}

/// `WidthInBytes × Height` of a `CUDA_MEMCPY2D` (offsets 112 and 120, cuda.h); 0 for a
/// null descriptor, which the driver refuses.
#[inline(always)]
fn copy_2d_bytes(copy: *const c_void) -> usize {
    descriptor_product(copy, &[112, 120])
}

/// `WidthInBytes × Height × Depth` of a `CUDA_MEMCPY3D` or `CUDA_MEMCPY3D_PEER` (the
/// same layout: offsets 176, 184 and 192).
#[inline(always)]
fn copy_3d_bytes(copy: *const c_void) -> usize {
    descriptor_product(copy, &[176, 184, 192])
}

#[inline(always)]
fn descriptor_product(copy: *const c_void, offsets: &[usize]) -> usize {
    if copy.is_null() {
        return 0;
    }
    offsets.iter().fold(1usize, |product, &offset| {
        // SAFETY: the caller hands the driver a descriptor of this type, which it
        // reads too; each offset is a size_t field inside it (cuda.h).
        let field = unsafe {
            copy.cast::<u8>()
                .add(offset)
                .cast::<usize>()
                .read_unaligned()
        };
        product.saturating_mul(field)
    })
}

/// A batch whose sizes are not read here (3D batches: each operation's extent sits in
/// its own descriptor): a millisecond, the order of a large copy.
const UNSIZED_BATCH_NS: u64 = 1_000_000;

/// The sum of a batch's `count` sizes (0 for a null array, which the driver refuses).
#[inline(always)]
fn batch_bytes(sizes: *const usize, count: usize) -> usize {
    if sizes.is_null() {
        return 0;
    }
    (0..count).fold(0usize, |sum, i| {
        // SAFETY: the caller hands the driver `count` sizes there, which it reads too.
        sum.saturating_add(unsafe { sizes.add(i).read_unaligned() })
    })
}

/// Defines a gated copy or memset:
/// `name(per_thread_default_stream, stream expression, estimate; arg: type, ...)`.
macro_rules! gated_copy {
    ($name:ident ($per_thread:expr, $stream:expr, $what:expr; $($arg:ident : $ty:ty),*)) => {
        /// Gated like a launch (module docs).
        ///
        /// # Safety
        /// The driver's contract for this entry point.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            crate::guard::cuda(|| {
                let real = real_fn!($name: fn($($ty),*) -> CUresult);
                let ticket = gate::admit(Target { stream: $stream, per_thread: $per_thread }, $what);
                // SAFETY: the caller's arguments, forwarded unchanged.
                let result = unsafe { real($($arg),*) };
                gate::launched(ticket, result);
                result
            })
        }
    };
}

gated_copy!(cuMemcpy(false, 0, unified(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpy_ptds(true, 0, unified(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyHtoD_v2(false, 0, host(bytes); dst: CUdeviceptr, src: *const c_void, bytes: usize));
gated_copy!(cuMemcpyHtoD_v2_ptds(true, 0, host(bytes); dst: CUdeviceptr, src: *const c_void, bytes: usize));
gated_copy!(cuMemcpyDtoH_v2(false, 0, host(bytes); dst: *mut c_void, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyDtoH_v2_ptds(true, 0, host(bytes); dst: *mut c_void, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyDtoD_v2(false, 0, device(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyDtoD_v2_ptds(true, 0, device(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyDtoA_v2(false, 0, device(bytes); dst: Handle, dst_offset: usize, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyDtoA_v2_ptds(true, 0, device(bytes); dst: Handle, dst_offset: usize, src: CUdeviceptr, bytes: usize));
gated_copy!(cuMemcpyAtoD_v2(false, 0, device(bytes); dst: CUdeviceptr, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyAtoD_v2_ptds(true, 0, device(bytes); dst: CUdeviceptr, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyHtoA_v2(false, 0, host(bytes); dst: Handle, dst_offset: usize, src: *const c_void, bytes: usize));
gated_copy!(cuMemcpyHtoA_v2_ptds(true, 0, host(bytes); dst: Handle, dst_offset: usize, src: *const c_void, bytes: usize));
gated_copy!(cuMemcpyAtoH_v2(false, 0, host(bytes); dst: *mut c_void, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyAtoH_v2_ptds(true, 0, host(bytes); dst: *mut c_void, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyAtoA_v2(false, 0, device(bytes); dst: Handle, dst_offset: usize, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyAtoA_v2_ptds(true, 0, device(bytes); dst: Handle, dst_offset: usize, src: Handle, src_offset: usize, bytes: usize));
gated_copy!(cuMemcpyPeer(false, 0, host(bytes); dst: CUdeviceptr, dst_context: Handle, src: CUdeviceptr, src_context: Handle, bytes: usize));
gated_copy!(cuMemcpyPeer_ptds(true, 0, host(bytes); dst: CUdeviceptr, dst_context: Handle, src: CUdeviceptr, src_context: Handle, bytes: usize));
gated_copy!(cuMemcpy2D_v2(false, 0, unified(copy_2d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy2D_v2_ptds(true, 0, unified(copy_2d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy2DUnaligned_v2(false, 0, unified(copy_2d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy2DUnaligned_v2_ptds(true, 0, unified(copy_2d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy3D_v2(false, 0, unified(copy_3d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy3D_v2_ptds(true, 0, unified(copy_3d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy3DPeer(false, 0, host(copy_3d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpy3DPeer_ptds(true, 0, host(copy_3d_bytes(copy)); copy: *const c_void));
gated_copy!(cuMemcpyAsync(false, stream, unified(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyAsync_ptsz(true, stream, unified(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyHtoDAsync_v2(false, stream, host(bytes); dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyHtoDAsync_v2_ptsz(true, stream, host(bytes); dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyDtoHAsync_v2(false, stream, host(bytes); dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyDtoHAsync_v2_ptsz(true, stream, host(bytes); dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyDtoDAsync_v2(false, stream, device(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyDtoDAsync_v2_ptsz(true, stream, device(bytes); dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyHtoAAsync_v2(false, stream, host(bytes); dst: Handle, dst_offset: usize, src: *const c_void, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyHtoAAsync_v2_ptsz(true, stream, host(bytes); dst: Handle, dst_offset: usize, src: *const c_void, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyAtoHAsync_v2(false, stream, host(bytes); dst: *mut c_void, src: Handle, src_offset: usize, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyAtoHAsync_v2_ptsz(true, stream, host(bytes); dst: *mut c_void, src: Handle, src_offset: usize, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyPeerAsync(false, stream, host(bytes); dst: CUdeviceptr, dst_context: Handle, src: CUdeviceptr, src_context: Handle, bytes: usize, stream: Handle));
gated_copy!(cuMemcpyPeerAsync_ptsz(true, stream, host(bytes); dst: CUdeviceptr, dst_context: Handle, src: CUdeviceptr, src_context: Handle, bytes: usize, stream: Handle));
gated_copy!(cuMemcpy2DAsync_v2(false, stream, unified(copy_2d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemcpy2DAsync_v2_ptsz(true, stream, unified(copy_2d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemcpy3DAsync_v2(false, stream, unified(copy_3d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemcpy3DAsync_v2_ptsz(true, stream, unified(copy_3d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemcpy3DPeerAsync(false, stream, host(copy_3d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemcpy3DPeerAsync_ptsz(true, stream, host(copy_3d_bytes(copy)); copy: *const c_void, stream: Handle));
gated_copy!(cuMemsetD8_v2(false, 0, device(count); dst: CUdeviceptr, value: u8, count: usize));
gated_copy!(cuMemsetD8_v2_ptds(true, 0, device(count); dst: CUdeviceptr, value: u8, count: usize));
gated_copy!(cuMemsetD16_v2(false, 0, device(count.saturating_mul(2)); dst: CUdeviceptr, value: u16, count: usize));
gated_copy!(cuMemsetD16_v2_ptds(true, 0, device(count.saturating_mul(2)); dst: CUdeviceptr, value: u16, count: usize));
gated_copy!(cuMemsetD32_v2(false, 0, device(count.saturating_mul(4)); dst: CUdeviceptr, value: u32, count: usize));
gated_copy!(cuMemsetD32_v2_ptds(true, 0, device(count.saturating_mul(4)); dst: CUdeviceptr, value: u32, count: usize));
gated_copy!(cuMemsetD2D8_v2(false, 0, device(width.saturating_mul(height)); dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize));
gated_copy!(cuMemsetD2D8_v2_ptds(true, 0, device(width.saturating_mul(height)); dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize));
gated_copy!(cuMemsetD2D16_v2(false, 0, device(width.saturating_mul(height).saturating_mul(2)); dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize));
gated_copy!(cuMemsetD2D16_v2_ptds(true, 0, device(width.saturating_mul(height).saturating_mul(2)); dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize));
gated_copy!(cuMemsetD2D32_v2(false, 0, device(width.saturating_mul(height).saturating_mul(4)); dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize));
gated_copy!(cuMemsetD2D32_v2_ptds(true, 0, device(width.saturating_mul(height).saturating_mul(4)); dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize));
gated_copy!(cuMemsetD8Async(false, stream, device(count); dst: CUdeviceptr, value: u8, count: usize, stream: Handle));
gated_copy!(cuMemsetD8Async_ptsz(true, stream, device(count); dst: CUdeviceptr, value: u8, count: usize, stream: Handle));
gated_copy!(cuMemsetD16Async(false, stream, device(count.saturating_mul(2)); dst: CUdeviceptr, value: u16, count: usize, stream: Handle));
gated_copy!(cuMemsetD16Async_ptsz(true, stream, device(count.saturating_mul(2)); dst: CUdeviceptr, value: u16, count: usize, stream: Handle));
gated_copy!(cuMemsetD32Async(false, stream, device(count.saturating_mul(4)); dst: CUdeviceptr, value: u32, count: usize, stream: Handle));
gated_copy!(cuMemsetD32Async_ptsz(true, stream, device(count.saturating_mul(4)); dst: CUdeviceptr, value: u32, count: usize, stream: Handle));
gated_copy!(cuMemsetD2D8Async(false, stream, device(width.saturating_mul(height)); dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize, stream: Handle));
gated_copy!(cuMemsetD2D8Async_ptsz(true, stream, device(width.saturating_mul(height)); dst: CUdeviceptr, pitch: usize, value: u8, width: usize, height: usize, stream: Handle));
gated_copy!(cuMemsetD2D16Async(false, stream, device(width.saturating_mul(height).saturating_mul(2)); dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize, stream: Handle));
gated_copy!(cuMemsetD2D16Async_ptsz(true, stream, device(width.saturating_mul(height).saturating_mul(2)); dst: CUdeviceptr, pitch: usize, value: u16, width: usize, height: usize, stream: Handle));
gated_copy!(cuMemsetD2D32Async(false, stream, device(width.saturating_mul(height).saturating_mul(4)); dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize, stream: Handle));
gated_copy!(cuMemsetD2D32Async_ptsz(true, stream, device(width.saturating_mul(height).saturating_mul(4)); dst: CUdeviceptr, pitch: usize, value: u32, width: usize, height: usize, stream: Handle));

// CUDA 12.8: batches of copies (CUDA 13.0's `_v2` forms drop `failIdx`).
gated_copy!(cuMemcpyBatchAsync(false, stream, unified(batch_bytes(sizes, count)); dsts: *mut c_void, srcs: *mut c_void, sizes: *const usize, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, fail_idx: *mut usize, stream: Handle));
gated_copy!(cuMemcpyBatchAsync_ptsz(true, stream, unified(batch_bytes(sizes, count)); dsts: *mut c_void, srcs: *mut c_void, sizes: *const usize, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, fail_idx: *mut usize, stream: Handle));
gated_copy!(cuMemcpyBatchAsync_v2(false, stream, unified(batch_bytes(sizes, count)); dsts: *mut c_void, srcs: *mut c_void, sizes: *const usize, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, stream: Handle));
gated_copy!(cuMemcpyBatchAsync_v2_ptsz(true, stream, unified(batch_bytes(sizes, count)); dsts: *mut c_void, srcs: *mut c_void, sizes: *const usize, count: usize, attrs: *mut c_void, attrs_idxs: *mut c_void, num_attrs: usize, stream: Handle));
gated_copy!(cuMemcpy3DBatchAsync(false, stream, What::Copy(UNSIZED_BATCH_NS); num_ops: usize, ops: *mut c_void, fail_idx: *mut usize, flags: u64, stream: Handle));
gated_copy!(cuMemcpy3DBatchAsync_ptsz(true, stream, What::Copy(UNSIZED_BATCH_NS); num_ops: usize, ops: *mut c_void, fail_idx: *mut usize, flags: u64, stream: Handle));
gated_copy!(cuMemcpy3DBatchAsync_v2(false, stream, What::Copy(UNSIZED_BATCH_NS); num_ops: usize, ops: *mut c_void, flags: u64, stream: Handle));
gated_copy!(cuMemcpy3DBatchAsync_v2_ptsz(true, stream, What::Copy(UNSIZED_BATCH_NS); num_ops: usize, ops: *mut c_void, flags: u64, stream: Handle));

// CUDA 13.2: one copy with its attributes (the pointers decide the direction), and one 3D
// operation (its extent sits in its descriptor, like a 3D batch's).
gated_copy!(cuMemcpyWithAttributesAsync(false, stream, unified(size); dst: CUdeviceptr, src: CUdeviceptr, size: usize, attr: *mut c_void, stream: Handle));
gated_copy!(cuMemcpyWithAttributesAsync_ptsz(true, stream, unified(size); dst: CUdeviceptr, src: CUdeviceptr, size: usize, attr: *mut c_void, stream: Handle));
gated_copy!(cuMemcpy3DWithAttributesAsync(false, stream, What::Copy(UNSIZED_BATCH_NS); op: *mut c_void, flags: u64, stream: Handle));
gated_copy!(cuMemcpy3DWithAttributesAsync_ptsz(true, stream, What::Copy(UNSIZED_BATCH_NS); op: *mut c_void, flags: u64, stream: Handle));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symbols::{record_real, Hook};
    use std::sync::atomic::{AtomicU64, Ordering};

    static SEEN: AtomicU64 = AtomicU64::new(0);
    /// Its own, for the test running beside the other.
    static BATCH_SEEN: AtomicU64 = AtomicU64::new(0);

    extern "C" fn dtod(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult {
        SEEN.store(dst * 100 + src * 10 + bytes as u64, Ordering::SeqCst);
        21
    }
    extern "C" fn memset_2d_async(
        dst: CUdeviceptr,
        pitch: usize,
        value: u32,
        width: usize,
        height: usize,
        stream: Handle,
    ) -> CUresult {
        SEEN.store(
            dst + (pitch + value as usize + width + height + stream) as u64 * 10,
            Ordering::SeqCst,
        );
        22
    }

    /// The wrappers reach their own variant's driver function with the caller's
    /// arguments and return its answer.
    #[test]
    #[allow(clippy::fn_to_numeric_cast_any)]
    fn copy_wrappers_forward_their_arguments() {
        let p = |f: *const ()| f as *mut c_void;
        record_real(Hook::cuMemcpyDtoD_v2_ptds, p(dtod as *const ()));
        record_real(
            Hook::cuMemsetD2D32Async_ptsz,
            p(memset_2d_async as *const ()),
        );
        // SAFETY: the stubs read nothing through pointers.
        unsafe {
            assert_eq!(
                (cuMemcpyDtoD_v2_ptds(1, 2, 3), SEEN.load(Ordering::SeqCst)),
                (21, 123)
            );
            assert_eq!(
                (
                    cuMemsetD2D32Async_ptsz(1, 2, 3, 4, 5, 6),
                    SEEN.load(Ordering::SeqCst)
                ),
                (22, 201)
            );
        }
    }

    #[test]
    fn estimates_follow_bytes_and_descriptors() {
        assert_eq!(host(25_000_000), What::Copy(1_000_000));
        assert_eq!(device(900_000_000), What::Copy(1_000_000));
        let mut d2 = [0u8; 128];
        d2[112..120].copy_from_slice(&1000usize.to_ne_bytes());
        d2[120..128].copy_from_slice(&30usize.to_ne_bytes());
        assert_eq!(copy_2d_bytes(d2.as_ptr().cast()), 30_000);
        let mut d3 = [0u8; 200];
        for (offset, v) in [(176, 10usize), (184, 20), (192, 3)] {
            d3[offset..offset + 8].copy_from_slice(&v.to_ne_bytes());
        }
        assert_eq!(copy_3d_bytes(d3.as_ptr().cast()), 600);
        assert_eq!(copy_3d_bytes(std::ptr::null()), 0);
        let sizes = [100usize, 200, 300];
        assert_eq!(batch_bytes(sizes.as_ptr(), 3), 600);
        assert_eq!(batch_bytes(std::ptr::null(), 3), 0);
    }

    extern "C" fn batch(
        _: *mut c_void,
        _: *mut c_void,
        sizes: *const usize,
        count: usize,
        _: *mut c_void,
        _: *mut c_void,
        _: usize,
        stream: Handle,
    ) -> CUresult {
        // SAFETY: the test passes one size.
        BATCH_SEEN.store(
            (unsafe { *sizes } + count * 10 + stream) as u64,
            Ordering::SeqCst,
        );
        23
    }

    /// CUDA 13.0's batch (no failIdx): the stream is its eighth argument.
    #[test]
    #[allow(clippy::fn_to_numeric_cast_any)]
    fn a_batch_reaches_its_variant() {
        record_real(
            Hook::cuMemcpyBatchAsync_v2,
            batch as *const () as *mut c_void,
        );
        let null = std::ptr::null_mut();
        let sizes = [100usize];
        // SAFETY: the stub reads one size.
        let rc = unsafe { cuMemcpyBatchAsync_v2(null, null, sizes.as_ptr(), 1, null, null, 0, 5) };
        assert_eq!((rc, BATCH_SEEN.load(Ordering::SeqCst)), (23, 115));
    }
}
