//! Steps about streams: a created stream, launch-ahead across two streams, a green
//! context's stream, and the per-thread default stream.

use crate::{entry, num, Cuda, Launch11, Probe, H, PTDS, R};
use std::ffi::{c_int, c_uint, c_void};
use std::time::Instant;

/// `sizeof(CUdevResource)` (cuda.h, CUDA 12.4).
const DEV_RESOURCE_BYTES: usize = 144;

/// A non-blocking stream of a new green context on all of `dev`'s SMs (CUDA 12.5), with
/// the green context's `CUcontext` made current (events and the stream share it): the
/// worst result and the stream.
fn green_stream_current(c: &Cuda, dev: c_int) -> (R, H) {
    let get_resource: unsafe extern "C" fn(c_int, *mut c_void, c_int) -> R =
        c.get("cuDeviceGetDevResource");
    let generate: unsafe extern "C" fn(*mut H, *const c_void, c_uint) -> R =
        c.get("cuDevResourceGenerateDesc");
    let create: unsafe extern "C" fn(*mut H, H, c_int, c_uint) -> R = c.get("cuGreenCtxCreate");
    let create_stream: unsafe extern "C" fn(*mut H, H, c_uint, c_int) -> R =
        c.get("cuGreenCtxStreamCreate");
    let mut resource = [0u8; DEV_RESOURCE_BYTES];
    let (mut desc, mut green, mut stream) = (0, 0, 0);
    // SAFETY: each with live out-parameters of the types it writes; the SM resource type
    // (1), CU_GREEN_CTX_DEFAULT_STREAM (1) and CU_STREAM_NON_BLOCKING (1) as cuda.h
    // requires; the resource array is the one filled just before.
    let rc = unsafe {
        get_resource(dev, resource.as_mut_ptr().cast(), 1)
            .max(generate(&mut desc, resource.as_ptr().cast(), 1))
            .max(create(&mut green, desc, dev, 1))
            .max(create_stream(&mut stream, green, 1, 0))
    };
    let from_green: unsafe extern "C" fn(*mut H, H) -> R = c.get("cuCtxFromGreenCtx");
    let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
    let mut green_ctx = 0;
    // SAFETY: a live CUcontext to write and the green context created above.
    let rc = rc.max(unsafe { from_green(&mut green_ctx, green) });
    // SAFETY: cuCtxSetCurrent of a context the driver just named.
    (rc.max(unsafe { set_current(green_ctx) }), stream)
}

pub(crate) fn stream_create(p: &mut Probe) {
    // One stream (default flags), kept: the first stream a CUDA runtime creates.
    p.new_stream(0);
    p.report("stream-create", 0, "");
}

pub(crate) fn green_launch_ahead(
    p: &mut Probe,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
    ctx: H,
) {
    // CUDA 12.5 (run with --cuda-version 12050): a stream of a green context on
    // all of the device's SMs, a kernel of N ms on it, then how long a second
    // launch into that stream took (a launch-ahead bound of 1 waits for the first).
    let c = &p.cuda;
    let ms = num(args);
    let (rc, stream) = green_stream_current(c, dev);
    let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
    let f: Launch11 = c.get("cuLaunchKernel");
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let first = p.kernel_on(f, ms * 1_000_000, stream);
    let start = Instant::now();
    let second = p.kernel_on(f, 1000, stream);
    let same_us = start.elapsed().as_micros();
    // SAFETY: cuStreamSynchronize of the stream created above.
    let synced = unsafe { sync(stream) };
    // SAFETY: cuCtxSetCurrent of the probe's primary context, current before.
    let restored = unsafe { set_current(ctx) };
    p.report(
        "green-launch-ahead",
        rc.max(first).max(second).max(synced).max(restored),
        &format!("same_stream_launch_us={same_us}"),
    );
}

pub(crate) fn green_kernel_ms(
    p: &mut Probe,
    args: &mut impl Iterator<Item = String>,
    dev: c_int,
    ctx: H,
) {
    // CUDA 12.5 (run with --cuda-version 12050): a kernel of N ms on a green
    // context's stream, left running (no synchronisation): work only that
    // non-blocking stream, in the green context's own CUcontext, holds.
    let c = &p.cuda;
    let ms = num(args);
    let (rc, stream) = green_stream_current(c, dev);
    let set_current: unsafe extern "C" fn(H) -> R = c.get("cuCtxSetCurrent");
    let f: Launch11 = c.get("cuLaunchKernel");
    let launched = p.kernel_on(f, ms * 1_000_000, stream);
    // SAFETY: cuCtxSetCurrent of the probe's primary context, current before.
    let restored = unsafe { set_current(ctx) };
    p.report("green-kernel-ms", rc.max(launched).max(restored), "");
}

pub(crate) fn two_streams(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // A kernel of N ms on one stream, then a short one on another: how long the
    // second launch call took (a process-wide launch-ahead bound waits for the first).
    let c = &p.cuda;
    let ms = num(args);
    let f: Launch11 = c.get("cuLaunchKernel");
    let sync: unsafe extern "C" fn() -> R = c.get("cuCtxSynchronize");
    let (a, b) = (p.new_stream(1), p.new_stream(1));
    let first = p.kernel_on(f, ms * 1_000_000, a);
    let start = Instant::now();
    let second = p.kernel_on(f, 1000, b);
    let second_us = start.elapsed().as_micros();
    let start = Instant::now();
    let third = p.kernel_on(f, 1000, a);
    let same_us = start.elapsed().as_micros();
    // SAFETY: cuCtxSynchronize takes no arguments.
    let synced = unsafe { sync() };
    p.report(
        "two-streams",
        first.max(second).max(third).max(synced),
        &format!("second_launch_us={second_us} same_stream_launch_us={same_us}"),
    );
}

/// A kernel on this thread's stream, then both streams queried: with the per-thread
/// default stream, the legacy stream is idle and the thread's own is busy.
pub(crate) fn ptsz_check(p: &mut Probe) {
    let launch: Launch11 = p.cuda.get("cuLaunchKernel");
    let (_, legacy_query) = p.cuda.lookup("cuStreamQuery", 12040, 0);
    let (_, ptsz_query) = p.cuda.lookup("cuStreamQuery", 12040, PTDS);
    // SAFETY: both are cuStreamQuery (legacy and per-thread), CUresult(CUstream); entry
    // refuses a null one.
    let legacy_query: unsafe extern "C" fn(H) -> R =
        unsafe { entry(legacy_query, "cuStreamQuery") };
    // SAFETY: as above.
    let ptsz_query: unsafe extern "C" fn(H) -> R =
        unsafe { entry(ptsz_query, "cuStreamQuery_ptsz") };
    let rc = p.kernel(launch, 300_000_000);
    // SAFETY: cuStreamQuery of the default stream (0), a value.
    let (legacy, own) = unsafe { (legacy_query(0), ptsz_query(0)) };
    let sync: unsafe extern "C" fn() -> R = p.cuda.get("cuCtxSynchronize");
    // SAFETY: cuCtxSynchronize takes no arguments.
    unsafe { sync() };
    p.report(
        "ptsz-check",
        rc,
        &format!("legacy={} per_thread={}", p.name(legacy), p.name(own)),
    );
}
