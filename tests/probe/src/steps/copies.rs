//! The `copies` step: device-to-device copies and memsets through each entry point.

use crate::{fatal, num, Cuda, Probe, Ptr, H, R};
use std::ffi::{c_uint, c_void};
use std::time::Instant;

/// `sizeof(CUmemcpyAttributes)` (cuda.h: an access order, two `CUmemLocation`s, flags).
const MEMCPY_ATTRIBUTES_BYTES: usize = 24;

/// A `CUDA_MEMCPY3D_BATCH_OP` (cuda.h, 112 bytes) copying `bytes` from device pointer
/// `src` to `dst`: two pointer operands (type `CU_MEMCPY_OPERAND_TYPE_POINTER` = 1, then
/// the pointer; 40 bytes each), the extent `bytes × 1 × 1` at offset 80.
fn memcpy_3d_op(dst: Ptr, src: Ptr, bytes: usize) -> [u8; 112] {
    let mut op = [0u8; 112];
    let mut put = |offset: usize, value: u64| {
        op[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    };
    put(0, 1);
    put(8, src);
    put(40, 1);
    put(48, dst);
    put(80, bytes as u64);
    put(88, 1);
    put(96, 1);
    op
}

pub(crate) fn copies(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // `copies sync|async|memset|memset-async N B`: N device-to-device copies of B
    // bytes between two fresh buffers (cuMemcpyDtoD, or cuMemcpyDtoDAsync on the
    // legacy stream and a synchronisation), or N memsets of one (cuMemsetD32, or
    // cuMemsetD32Async and a synchronisation), then the buffers freed.
    let c = &p.cuda;
    let mode = args
        .next()
        .unwrap_or_else(|| fatal("copies sync|async N B"));
    let (n, bytes) = (num(args), num(args) as usize);
    let alloc: unsafe extern "C" fn(*mut Ptr, usize) -> R = c.get("cuMemAlloc");
    let free: unsafe extern "C" fn(Ptr) -> R = c.get("cuMemFree");
    let (mut a, mut b) = (0, 0);
    // SAFETY: cuMemAlloc_v2, given live CUdeviceptrs to write.
    let mut rc = unsafe { alloc(&mut a, bytes).max(alloc(&mut b, bytes)) };
    let start = Instant::now();
    if rc == 0 {
        rc = match mode.as_str() {
            "sync" => sync_copies(c, n, a, b, bytes),
            "async" => async_copies(c, n, a, b, bytes),
            "memset" => memsets(c, n, b, bytes),
            "memset-async" => async_memsets(c, n, b, bytes),
            "attributes" => attribute_copies(c, n, a, b, bytes),
            "attributes-3d" => attribute_3d_copies(c, n, a, b, bytes),
            other => fatal(&format!(
                "copies sync|async|memset|memset-async|attributes|attributes-3d, not {other}"
            )),
        };
    }
    let ms = start.elapsed().as_millis();
    // SAFETY: cuMemFree_v2 of the buffers allocated above, each once (freeing 0,
    // a failed allocation's, is the driver's to refuse).
    let _ = unsafe { free(a).max(free(b)) };
    p.report("copies", rc, &format!("mode={mode} copies={n} ms={ms}"));
}

/// Device-to-device copies (`cuMemcpyDtoD`).
fn sync_copies(c: &Cuda, n: u64, a: Ptr, b: Ptr, bytes: usize) -> R {
    let copy: unsafe extern "C" fn(Ptr, Ptr, usize) -> R = c.get("cuMemcpyDtoD");
    (0..n)
        // SAFETY: cuMemcpyDtoD_v2 between the two live device buffers of
        // `bytes` that `copies` allocated (no host memory involved).
        .map(|_| unsafe { copy(b, a, bytes) })
        .max()
        .unwrap_or(0)
}

/// Device-to-device copies queued on the legacy stream (`cuMemcpyDtoDAsync`), then a
/// synchronisation.
fn async_copies(c: &Cuda, n: u64, a: Ptr, b: Ptr, bytes: usize) -> R {
    let copy: unsafe extern "C" fn(Ptr, Ptr, usize, H) -> R = c.get("cuMemcpyDtoDAsync");
    let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
    let queued = (0..n)
        // SAFETY: cuMemcpyDtoDAsync_v2 between the two live device
        // buffers of `bytes`, on the legacy stream.
        .map(|_| unsafe { copy(b, a, bytes, 0) })
        .max();
    // SAFETY: cuCtxSynchronize takes no arguments.
    let synced = unsafe { sync() };
    queued.unwrap_or(0).max(synced)
}

/// Memsets of `b` (`cuMemsetD32`).
fn memsets(c: &Cuda, n: u64, b: Ptr, bytes: usize) -> R {
    let set: unsafe extern "C" fn(Ptr, c_uint, usize) -> R = c.get("cuMemsetD32");
    (0..n)
        // SAFETY: cuMemsetD32_v2 of bytes/4 words of the live device
        // buffer `b` of `bytes`.
        .map(|_| unsafe { set(b, 7, bytes / 4) })
        .max()
        .unwrap_or(0)
}

/// Memsets of `b` queued on the legacy stream (`cuMemsetD32Async`), then a
/// synchronisation.
fn async_memsets(c: &Cuda, n: u64, b: Ptr, bytes: usize) -> R {
    let set: unsafe extern "C" fn(Ptr, c_uint, usize, H) -> R = c.get("cuMemsetD32Async");
    let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
    let queued = (0..n)
        // SAFETY: cuMemsetD32Async of bytes/4 words of the live device
        // buffer `b` of `bytes`, on the legacy stream.
        .map(|_| unsafe { set(b, 7, bytes / 4, 0) })
        .max();
    // SAFETY: cuCtxSynchronize takes no arguments.
    let synced = unsafe { sync() };
    queued.unwrap_or(0).max(synced)
}

/// Copies with attributes queued on the legacy stream (`cuMemcpyWithAttributesAsync`),
/// then a synchronisation.
fn attribute_copies(c: &Cuda, n: u64, a: Ptr, b: Ptr, bytes: usize) -> R {
    // CUDA 13.2 (run with --cuda-version 13020): the pointers decide
    // the direction; the attributes are required, zeroed is valid.
    let copy: unsafe extern "C" fn(Ptr, Ptr, usize, *mut c_void, H) -> R =
        c.get("cuMemcpyWithAttributesAsync");
    // cuCtxSynchronize is cuCtxSynchronize_v2 (a context argument) for 13.0+.
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let mut attributes = [0u8; MEMCPY_ATTRIBUTES_BYTES];
    let queued = (0..n)
        // SAFETY: cuMemcpyWithAttributesAsync between the two live device
        // buffers of `bytes`, with a live zeroed CUmemcpyAttributes, on
        // the legacy stream.
        .map(|_| unsafe { copy(b, a, bytes, attributes.as_mut_ptr().cast(), 0) })
        .max();
    // SAFETY: cuStreamSynchronize of the legacy stream.
    let synced = unsafe { sync(0) };
    queued.unwrap_or(0).max(synced)
}

/// One-operation 3D copies with attributes queued on the legacy stream
/// (`cuMemcpy3DWithAttributesAsync`), then a synchronisation.
fn attribute_3d_copies(c: &Cuda, n: u64, a: Ptr, b: Ptr, bytes: usize) -> R {
    let copy: unsafe extern "C" fn(*mut c_void, u64, H) -> R =
        c.get("cuMemcpy3DWithAttributesAsync");
    // cuCtxSynchronize is cuCtxSynchronize_v2 (a context argument) for 13.0+.
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let mut op = memcpy_3d_op(b, a, bytes);
    let queued = (0..n)
        // SAFETY: cuMemcpy3DWithAttributesAsync of one operation between
        // the two live device buffers of `bytes` (pointer operands, a
        // bytes × 1 × 1 extent), on the legacy stream.
        .map(|_| unsafe { copy(op.as_mut_ptr().cast(), 0, 0) })
        .max();
    // SAFETY: cuStreamSynchronize of the legacy stream.
    let synced = unsafe { sync(0) };
    queued.unwrap_or(0).max(synced)
}
