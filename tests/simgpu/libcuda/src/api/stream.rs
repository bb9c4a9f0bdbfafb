//! Streams, stream capture, and the `_ptsz` forms (stream 0 = the thread's default stream).
//!
//! All streams of a context feed one FIFO on the simulated GPU (it runs one operation at a
//! time anyway), so cross-stream ordering is at least as strong as CUDA's; a stream's
//! synchronisation waits for its own last operation.

use super::Handle;
use crate::driver::{self, driver, Capture, CaptureMode, Driver, Graph, Stream, StreamTarget};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_uint};

/// `CU_STREAM_CAPTURE_STATUS_NONE` / `_ACTIVE` / `_INVALIDATED`.
const CAPTURE_NONE: c_int = 0;
const CAPTURE_ACTIVE: c_int = 1;
const CAPTURE_INVALIDATED: c_int = 2;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut Handle, flags: c_uint) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuStreamCreateWithPriority(stream, flags, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut Handle,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let ctx = d.current(&state)?;
        if stream.is_null() {
            return Err(CudaError::InvalidValue);
        }
        let h = state.streams.insert(Stream {
            ctx,
            last: 0,
            flags,
            priority,
            capture: None,
        });
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(stream, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CUresult {
    // Work already queued still runs, as on the real device.
    guard(|| {
        driver()?
            .state()
            .streams
            .remove(stream)
            .map(|_| ())
            .ok_or(CudaError::InvalidHandle)
    })
}

/// Waits for the stream's work: on the CPU, unless its context was made with
/// `CU_CTX_SCHED_BLOCKING_SYNC`.
fn synchronize(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let (id, last, flags) = {
        let mut state = d.state();
        let target = d.resolve_stream(&state, stream, per_thread)?;
        d.check_stream_wait(&mut state, target)?;
        let (id, last) = d.stream_last(&state, target)?;
        let flags = state.context(d.target_context(&state, target)?)?.flags;
        (id, last, flags)
    };
    d.wait_by(id, last, driver::waiter_for(flags, None))
}

fn query(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let (id, last) = {
        let mut state = d.state();
        let target = d.resolve_stream(&state, stream, per_thread)?;
        d.check_stream_wait(&mut state, target)?;
        d.stream_last(&state, target)?
    };
    if d.device.lock()?.completed_count(id)? >= last {
        Ok(())
    } else {
        Err(CudaError::NotReady)
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(stream: Handle) -> CUresult {
    guard(|| synchronize(stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize_ptsz(stream: Handle) -> CUresult {
    guard(|| synchronize(stream, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(stream: Handle) -> CUresult {
    guard(|| query(stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery_ptsz(stream: Handle) -> CUresult {
    guard(|| query(stream, true))
}

fn wait_event(stream: Handle, event: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    let e = state.events.get(event).ok_or(CudaError::InvalidHandle)?;
    let (captured, follows) = (e.captured, e.capture_follows.clone());
    // Waiting for an event recorded in an ongoing capture joins the waiting stream to that
    // capture (fork/join capture, as multi-stream graph capture in PyTorch does): its work is
    // recorded into the same graph until the capture ends.
    let ongoing = captured.and_then(|id| {
        state
            .streams
            .iter()
            .filter_map(|(_, s)| s.capture.as_ref())
            .find(|c| c.id == id && c.origin)
            .cloned()
    });
    if let (Some(origin), StreamTarget::Created(h)) = (ongoing, target) {
        let s = state.streams.get_mut(h).ok_or(CudaError::InvalidHandle)?;
        match &mut s.capture {
            None => {
                s.capture = Some(Capture {
                    origin: false,
                    follows,
                    ..origin
                })
            }
            Some(c) if c.id == origin.id => c.follow(&follows),
            // Two capture sequences cannot be merged (CUDA_ERROR_STREAM_CAPTURE_MERGE).
            Some(_) => {
                Driver::invalidate(&mut state, &[h]);
                return Err(CudaError::StreamCaptureMerge);
            }
        }
    }
    // Within a context the single FIFO already orders the stream after the event's work.
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(stream: Handle, event: Handle, _flags: c_uint) -> CUresult {
    guard(|| wait_event(stream, event, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent_ptsz(
    stream: Handle,
    event: Handle,
    _flags: c_uint,
) -> CUresult {
    guard(|| wait_event(stream, event, true))
}

fn capture_status(capture: Option<&Capture>) -> c_int {
    match capture {
        None => CAPTURE_NONE,
        Some(c) if c.invalidated => CAPTURE_INVALIDATED,
        Some(_) => CAPTURE_ACTIVE,
    }
}

fn is_capturing(stream: Handle, status: *mut c_int, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    // The legacy stream encompasses every blocking stream of its context: asked while one of
    // them captures, the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the status is
    // unspecified) and, this being a query, leaves the capture alone (cuda.h).
    if let StreamTarget::Legacy(ctx) = target {
        let blocking_capture = state.streams.iter().any(|(_, s)| {
            s.ctx == ctx && s.flags & driver::STREAM_NON_BLOCKING == 0 && s.capture.is_some()
        });
        if blocking_capture {
            return Err(CudaError::StreamCaptureImplicit);
        }
    }
    let value = capture_status(d.capturing(&state, target));
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(status, value) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: Handle, status: *mut c_int) -> CUresult {
    guard(|| is_capturing(stream, status, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(stream: Handle, status: *mut c_int) -> CUresult {
    guard(|| is_capturing(stream, status, true))
}

pub(crate) fn begin_capture(
    stream: Handle,
    mode: c_int,
    per_thread: bool,
) -> Result<(), CudaError> {
    let d = driver()?;
    let mode = CaptureMode::from_raw(mode)?;
    let mut state = d.state();
    let StreamTarget::Created(h) = d.resolve_stream(&state, stream, per_thread)? else {
        // The legacy and per-thread default streams cannot be captured here.
        return Err(CudaError::StreamCaptureUnsupported);
    };
    if state.streams.get(h).is_some_and(|s| s.capture.is_some()) {
        return Err(CudaError::IllegalState);
    }
    let ctx = state.streams.get(h).ok_or(CudaError::InvalidHandle)?.ctx;
    let gpu = state.context(ctx)?.gpu;
    let graph = state.graphs.insert(Graph {
        gpu: Some(gpu),
        ctx,
        ..Graph::default()
    });
    let id = state.next_capture_id();
    state
        .streams
        .get_mut(h)
        .ok_or(CudaError::InvalidHandle)?
        .capture = Some(Capture {
        graph,
        id,
        mode,
        thread: std::thread::current().id(),
        invalidated: false,
        origin: true,
        follows: Default::default(),
    });
    Ok(())
}

/// CUDA 10.0 form, before the mode argument: a GLOBAL capture.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture(stream: Handle) -> CUresult {
    guard(|| begin_capture(stream, CaptureMode::Global as c_int, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_ptsz(stream: Handle) -> CUresult {
    guard(|| begin_capture(stream, CaptureMode::Global as c_int, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(stream: Handle, mode: c_int) -> CUresult {
    guard(|| begin_capture(stream, mode, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Handle, mode: c_int) -> CUresult {
    guard(|| begin_capture(stream, mode, true))
}

pub(crate) fn end_capture(
    stream: Handle,
    graph: *mut Handle,
    per_thread: bool,
) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    if graph.is_null() {
        return Err(CudaError::InvalidValue);
    }
    let StreamTarget::Created(h) = d.resolve_stream(&state, stream, per_thread)? else {
        return Err(CudaError::IllegalState);
    };
    let s = state.streams.get_mut(h).ok_or(CudaError::InvalidHandle)?;
    let c = s.capture.as_ref().ok_or(CudaError::IllegalState)?;
    // A non-relaxed capture belongs to the thread that began it (cuStreamEndCapture:
    // CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD).
    if c.mode != CaptureMode::Relaxed && c.thread != std::thread::current().id() {
        return Err(CudaError::StreamCaptureWrongThread);
    }
    // Only the stream that began the sequence ends it (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    // ending it ends it on every stream it joined.
    if !c.origin {
        return Err(CudaError::StreamCaptureUnmatched);
    }
    let c = s.capture.take().expect("checked above");
    let joined: Vec<usize> = state
        .streams
        .iter()
        .filter(|(_, s)| s.capture.as_ref().is_some_and(|j| j.id == c.id))
        .map(|(h, _)| h)
        .collect();
    // Every stream forked into the sequence must be joined back into the origin: its last
    // node must come before the origin's end (cuStreamEndCapture:
    // CUDA_ERROR_STREAM_CAPTURE_UNJOINED, and no graph).
    let mut unjoined = false;
    for j in joined {
        if let Some(joined) = state.streams.get_mut(j).and_then(|s| s.capture.take()) {
            let added = joined.follows.get(&j).copied().unwrap_or(0);
            unjoined |= added > c.follows.get(&j).copied().unwrap_or(0);
        }
    }
    if unjoined && !c.invalidated {
        state.graphs.remove(c.graph);
        // SAFETY: checked non-null; out-parameter per the API contract (NULL graph).
        unsafe { write_out(graph, 0)? };
        return Err(CudaError::StreamCaptureUnjoined);
    }
    if c.invalidated {
        state.graphs.remove(c.graph);
        // SAFETY: checked non-null; out-parameter per the API contract (NULL graph).
        unsafe { write_out(graph, 0)? };
        return Err(CudaError::StreamCaptureInvalidated);
    }
    // SAFETY: checked non-null; out-parameter per the API contract.
    unsafe { write_out(graph, c.graph) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Handle, graph: *mut Handle) -> CUresult {
    guard(|| end_capture(stream, graph, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: Handle, graph: *mut Handle) -> CUresult {
    guard(|| end_capture(stream, graph, true))
}

/// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture interaction mode to
/// `*mode` and returns the previous one in `*mode` (the idiom is exchange, unsafe call,
/// exchange back).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    guard(|| {
        driver()?;
        if mode.is_null() {
            return Err(CudaError::InvalidValue);
        }
        // SAFETY: checked non-null; in/out parameter per the API contract.
        let wanted = CaptureMode::from_raw(unsafe { *mode })?;
        let previous = driver::exchange_thread_capture_mode(wanted);
        // SAFETY: as above.
        unsafe { write_out(mode, previous as c_int) }
    })
}

/// The dependency set `cuStreamGetCaptureInfo_v2/_v3` report: simgpu's captures are linear, so
/// at most one node, whose handle is not one simgpu hands out (NULL), with default edge data.
static NO_NODES: [usize; 1] = [0];
static DEFAULT_EDGES: [u64; 1] = [0];

/// Writes what the `cuStreamGetCaptureInfo` family reports about `stream`; every output but
/// `status` is optional (NULL: not wanted), and the graph, id and dependencies are written only
/// while a capture is under way.
///
/// # Safety
/// Each pointer must be NULL or valid for a write of its type.
#[allow(clippy::too_many_arguments)]
unsafe fn capture_info(
    stream: Handle,
    per_thread: bool,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const usize,
    edges: *mut *const u64,
    num_deps: *mut usize,
) -> Result<(), CudaError> {
    let d = driver()?;
    let state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    let capture = d.capturing(&state, target);
    // SAFETY: out-parameters per this function's contract.
    unsafe {
        write_out(status, capture_status(capture))?;
        let Some(c) = capture else {
            return Ok(());
        };
        let dependencies = state
            .graphs
            .get(c.graph)
            .map_or(0, |g| g.nodes.len().min(1));
        let outputs = [
            (id.cast::<u64>(), c.id),
            (graph.cast(), if c.invalidated { 0 } else { c.graph as u64 }),
            (deps.cast(), NO_NODES.as_ptr() as u64),
            (edges.cast(), DEFAULT_EDGES.as_ptr() as u64),
            (num_deps.cast(), dependencies as u64),
        ];
        // Handles, pointers and counts are all 64-bit on the platforms simgpu runs on.
        for (out, value) in outputs {
            if !out.is_null() {
                out.write(value);
            }
        }
    }
    Ok(())
}

/// CUDA 10.1: status and id.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
) -> CUresult {
    let null = std::ptr::null_mut::<usize>();
    // SAFETY: out-parameters per the API contract; the others are not wanted.
    guard(|| unsafe {
        capture_info(
            stream,
            false,
            status,
            id,
            null.cast(),
            null.cast(),
            null.cast(),
            null,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_ptsz(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
) -> CUresult {
    let null = std::ptr::null_mut::<usize>();
    // SAFETY: out-parameters per the API contract; the others are not wanted.
    guard(|| unsafe {
        capture_info(
            stream,
            true,
            status,
            id,
            null.cast(),
            null.cast(),
            null.cast(),
            null,
        )
    })
}

/// CUDA 11.3: also the graph being built and the stream's current dependencies.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const usize,
    num_deps: *mut usize,
) -> CUresult {
    let edges = std::ptr::null_mut();
    // SAFETY: out-parameters per the API contract.
    guard(|| unsafe { capture_info(stream, false, status, id, graph, deps, edges, num_deps) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2_ptsz(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const usize,
    num_deps: *mut usize,
) -> CUresult {
    let edges = std::ptr::null_mut();
    // SAFETY: out-parameters per the API contract.
    guard(|| unsafe { capture_info(stream, true, status, id, graph, deps, edges, num_deps) })
}

/// CUDA 12.3: with the dependencies' edge data (all default in simgpu).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const usize,
    edges: *mut *const u64,
    num_deps: *mut usize,
) -> CUresult {
    // SAFETY: out-parameters per the API contract.
    guard(|| unsafe { capture_info(stream, false, status, id, graph, deps, edges, num_deps) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3_ptsz(
    stream: Handle,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const usize,
    edges: *mut *const u64,
    num_deps: *mut usize,
) -> CUresult {
    // SAFETY: out-parameters per the API contract.
    guard(|| unsafe { capture_info(stream, true, status, id, graph, deps, edges, num_deps) })
}

fn stream_context(stream: Handle, per_thread: bool) -> Result<Handle, CudaError> {
    let d = driver()?;
    let state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    d.target_context(&state, target)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(stream: Handle, ctx: *mut Handle) -> CUresult {
    // SAFETY: out-parameter per the API contract.
    guard(|| unsafe { write_out(ctx, stream_context(stream, false)?) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx_ptsz(stream: Handle, ctx: *mut Handle) -> CUresult {
    // SAFETY: out-parameter per the API contract.
    guard(|| unsafe { write_out(ctx, stream_context(stream, true)?) })
}

/// CUDA 12.5: also the green context (simgpu has none: NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx_v2(
    stream: Handle,
    ctx: *mut Handle,
    green: *mut Handle,
) -> CUresult {
    guard(|| {
        let c = stream_context(stream, false)?;
        // SAFETY: out-parameters per the API contract.
        unsafe {
            write_out(ctx, c)?;
            write_out(green, 0)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx_v2_ptsz(
    stream: Handle,
    ctx: *mut Handle,
    green: *mut Handle,
) -> CUresult {
    guard(|| {
        let c = stream_context(stream, true)?;
        // SAFETY: out-parameters per the API contract.
        unsafe {
            write_out(ctx, c)?;
            write_out(green, 0)
        }
    })
}
