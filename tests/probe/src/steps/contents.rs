//! Steps that write a known pattern into device memory and check it is still there (across
//! a checkpoint and restore of the probe by another process, say): `fill BYTE` and
//! `check BYTE`, on the most recent `alloc` or `managed` allocation.

use crate::pattern::{first_mismatch, pattern};
use crate::{fatal, num, Probe, Ptr, R};
use std::ffi::c_void;

/// Bytes per copy: an allocation of GiBs is filled and checked with 4 MiB of host memory.
const CHUNK: usize = 4 << 20;
/// The result `check` reports for memory that does not hold the pattern (the driver's own
/// failures are reported as their own result, without `mismatch_at`).
const MISMATCH: R = 999; // CUDA_ERROR_UNKNOWN

fn first_byte(args: &mut impl Iterator<Item = String>, step: &str) -> u8 {
    u8::try_from(num(args)).unwrap_or_else(|_| fatal(&format!("{step} BYTE: 0 to 255")))
}

/// `fill BYTE`: the pattern `(BYTE + i) mod 256` over the whole most recent allocation,
/// with `cuMemcpyHtoD`.
pub(crate) fn fill(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let first = first_byte(args, "fill");
    let Some((ptr, bytes)) = p.last_alloc else {
        return p.report("fill", 1, "no allocation");
    };
    let htod: unsafe extern "C" fn(Ptr, *const c_void, usize) -> R = p.cuda.get("cuMemcpyHtoD");
    let mut rc = 0;
    for from in (0..bytes).step_by(CHUNK) {
        let chunk = pattern(first, from, CHUNK.min(bytes - from));
        // SAFETY: cuMemcpyHtoD_v2 from `chunk` (its length copied) into the allocation,
        // inside its `bytes`.
        rc = unsafe { htod(ptr + from as Ptr, chunk.as_ptr().cast(), chunk.len()) };
        if rc != 0 {
            break;
        }
    }
    p.report("fill", rc, &format!("bytes={bytes}"));
}

/// `check BYTE`: reads the most recent allocation back with `cuMemcpyDtoH`; success when
/// it holds the pattern `fill BYTE` wrote, else `mismatch_at=OFFSET found=B expected=B`.
pub(crate) fn check(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let first = first_byte(args, "check");
    let Some((ptr, bytes)) = p.last_alloc else {
        return p.report("check", 1, "no allocation");
    };
    let dtoh: unsafe extern "C" fn(*mut c_void, Ptr, usize) -> R = p.cuda.get("cuMemcpyDtoH");
    let mut buf = vec![0u8; CHUNK.min(bytes)];
    for from in (0..bytes).step_by(CHUNK) {
        let chunk = &mut buf[..CHUNK.min(bytes - from)];
        // SAFETY: cuMemcpyDtoH_v2 into `chunk` (room for its length) from inside the
        // allocation.
        let rc = unsafe { dtoh(chunk.as_mut_ptr().cast(), ptr + from as Ptr, chunk.len()) };
        if rc != 0 {
            return p.report("check", rc, &format!("bytes={bytes} at={from}"));
        }
        if let Some((offset, found, expected)) = first_mismatch(first, from, chunk) {
            return p.report(
                "check",
                MISMATCH,
                &format!("bytes={bytes} mismatch_at={offset} found={found} expected={expected}"),
            );
        }
    }
    p.report("check", 0, &format!("bytes={bytes}"));
}
