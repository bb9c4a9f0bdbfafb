//! Streams, stream capture, and the `_ptsz` forms (stream 0 = the thread's default stream).
//!
//! All streams of a context feed one FIFO on the simulated GPU (it runs one operation at a
//! time anyway), so cross-stream ordering is at least as strong as CUDA's; a stream's
//! synchronisation waits for its own last operation.

use super::Handle;
use crate::driver::{driver, Graph, Stream, StreamTarget};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::{c_int, c_uint};

/// `CU_STREAM_CAPTURE_STATUS_NONE` / `_ACTIVE`.
const CAPTURE_NONE: c_int = 0;
const CAPTURE_ACTIVE: c_int = 1;

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

fn synchronize(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let (id, last) = {
        let state = d.state();
        let target = d.resolve_stream(&state, stream, per_thread)?;
        if d.capturing(&state, target).is_some() {
            return Err(CudaError::StreamCaptureUnsupported);
        }
        d.stream_last(&state, target)?
    };
    d.wait(id, last)
}

fn query(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let (id, last) = {
        let state = d.state();
        let target = d.resolve_stream(&state, stream, per_thread)?;
        if d.capturing(&state, target).is_some() {
            return Err(CudaError::StreamCaptureUnsupported);
        }
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
    let state = d.state();
    d.resolve_stream(&state, stream, per_thread)?;
    state.events.get(event).ok_or(CudaError::InvalidHandle)?;
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

fn is_capturing(stream: Handle, status: *mut c_int, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let state = d.state();
    let target = d.resolve_stream(&state, stream, per_thread)?;
    let value = if d.capturing(&state, target).is_some() {
        CAPTURE_ACTIVE
    } else {
        CAPTURE_NONE
    };
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

fn begin_capture(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let StreamTarget::Created(h) = d.resolve_stream(&state, stream, per_thread)? else {
        // The legacy and per-thread default streams cannot be captured.
        return Err(CudaError::StreamCaptureUnsupported);
    };
    if state.streams.get(h).and_then(|s| s.capture).is_some() {
        return Err(CudaError::IllegalState);
    }
    let graph = state.graphs.insert(Graph::default());
    state
        .streams
        .get_mut(h)
        .ok_or(CudaError::InvalidHandle)?
        .capture = Some(graph);
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2(stream: Handle, _mode: c_int) -> CUresult {
    guard(|| begin_capture(stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: Handle, _mode: c_int) -> CUresult {
    guard(|| begin_capture(stream, true))
}

fn end_capture(stream: Handle, graph: *mut Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let StreamTarget::Created(h) = d.resolve_stream(&state, stream, per_thread)? else {
        return Err(CudaError::IllegalState);
    };
    let g = state
        .streams
        .get_mut(h)
        .and_then(|s| s.capture.take())
        .ok_or(CudaError::IllegalState)?;
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(graph, g) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(stream: Handle, graph: *mut Handle) -> CUresult {
    guard(|| end_capture(stream, graph, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(stream: Handle, graph: *mut Handle) -> CUresult {
    guard(|| end_capture(stream, graph, true))
}
