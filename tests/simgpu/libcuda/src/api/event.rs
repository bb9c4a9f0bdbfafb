//! Events: markers in the context's FIFO whose completion time the model records exactly.

use super::Handle;
use crate::driver::{driver, waiter_for, Event};
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::c_uint;
use simgpu_model::DeviceError;

/// `CU_EVENT_DISABLE_TIMING`.
const EVENT_DISABLE_TIMING: c_uint = 0x2;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut Handle, flags: c_uint) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let ctx = d.current(&state)?;
        if event.is_null() {
            return Err(CudaError::InvalidValue);
        }
        let slot = d.device.lock()?.create_event(state.context(ctx)?.id)?;
        let h = state.events.insert(Event {
            ctx,
            slot,
            flags,
            captured: None,
            capture_follows: Default::default(),
        });
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(event, h) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(event: Handle) -> CUresult {
    guard(|| {
        let d = driver()?;
        let mut state = d.state();
        let e = state.events.remove(event).ok_or(CudaError::InvalidHandle)?;
        if let Ok(ctx) = state.context(e.ctx) {
            let _ = d.device.lock()?.destroy_event(ctx.id, e.slot);
        }
        Ok(())
    })
}

fn record(event: Handle, stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    let (target, id, slot) = {
        let mut state = d.state();
        let e = state.events.get(event).ok_or(CudaError::InvalidHandle)?;
        let ctx = e.ctx;
        let target = d.resolve_stream(&state, stream, per_thread)?;
        if let Some(c) = d.capturing(&state, target) {
            if c.invalidated {
                return Err(CudaError::StreamCaptureInvalidated);
            }
            // A captured event record becomes a node of the graph (the graph's own ordering
            // already covers it in the simulated device); the event now stands for that node.
            let (capture, follows) = (c.id, c.follows.clone());
            let e = state.events.get_mut(event).expect("looked up above");
            e.captured = Some(capture);
            e.capture_follows = follows;
            return Ok(());
        }
        d.check_legacy_work(&mut state, target)?;
        if d.target_context(&state, target)? != ctx {
            return Err(CudaError::InvalidHandle);
        }
        state
            .events
            .get_mut(event)
            .expect("looked up above")
            .captured = None;
        (target, state.context(ctx)?.id, e_slot(&state, event)?)
    };
    let count = loop {
        let result = d.device.lock()?.record_event(id, slot);
        match result {
            Ok(count) => break count,
            Err(DeviceError::QueueFull { completed }) => {
                d.device.wait_until_completed(id, completed)?
            }
            Err(e) => return Err(e.into()),
        }
    };
    d.note_submitted(&mut d.state(), target, count);
    Ok(())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(event: Handle, stream: Handle) -> CUresult {
    guard(|| record(event, stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord_ptsz(event: Handle, stream: Handle) -> CUresult {
    guard(|| record(event, stream, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags(
    event: Handle,
    stream: Handle,
    _flags: c_uint,
) -> CUresult {
    guard(|| record(event, stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags_ptsz(
    event: Handle,
    stream: Handle,
    _flags: c_uint,
) -> CUresult {
    guard(|| record(event, stream, true))
}

fn e_slot(state: &crate::driver::State, event: Handle) -> Result<u32, CudaError> {
    Ok(state
        .events
        .get(event)
        .ok_or(CudaError::InvalidHandle)?
        .slot)
}

/// The checks of a synchronous query of or wait for `event`: one last recorded inside a
/// capture is a graph node, not something that completes (`CUDA_ERROR_STREAM_CAPTURE_
/// UNSUPPORTED` in every mode, and a capture still under way is invalidated); any other event
/// falls under the unsafe-call rule of the calling thread's capture mode.
fn check_event_wait(event: Handle) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let e = state.events.get(event).ok_or(CudaError::InvalidHandle)?;
    if let Some(capture) = e.captured {
        crate::driver::Driver::invalidate_ids(&mut state, &[capture]);
        return Err(CudaError::StreamCaptureUnsupported);
    }
    d.check_unsafe_call(&mut state)
}

fn event_state(
    event: Handle,
) -> Result<
    (
        simgpu_model::device::ContextId,
        simgpu_model::device::EventState,
        c_uint,
    ),
    CudaError,
> {
    let d = driver()?;
    let (id, slot, flags) = {
        let state = d.state();
        let e = state.events.get(event).ok_or(CudaError::InvalidHandle)?;
        (state.context(e.ctx)?.id, e.slot, e.flags)
    };
    let s = d.device.lock()?.event_state(id, slot)?;
    Ok((id, s, flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(event: Handle) -> CUresult {
    guard(|| {
        check_event_wait(event)?;
        let (_, s, _) = event_state(event)?;
        if !s.recorded || s.complete {
            Ok(())
        } else {
            Err(CudaError::NotReady)
        }
    })
}

/// Waits as the real driver does: asleep for an event created with `CU_EVENT_BLOCKING_SYNC`
/// or in a `CU_CTX_SCHED_BLOCKING_SYNC` context, else on the CPU for the whole wait.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(event: Handle) -> CUresult {
    guard(|| {
        check_event_wait(event)?;
        let (id, s, flags) = event_state(event)?;
        if !s.recorded {
            return Ok(());
        }
        let d = driver()?;
        let ctx_flags = {
            let state = d.state();
            let e = state.events.get(event).ok_or(CudaError::InvalidHandle)?;
            state.context(e.ctx)?.flags
        };
        d.wait_by(id, s.recorded_count, waiter_for(ctx_flags, Some(flags)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    guard(|| {
        let (_, a, fa) = event_state(start)?;
        let (_, b, fb) = event_state(end)?;
        if (fa | fb) & EVENT_DISABLE_TIMING != 0 || !a.recorded || !b.recorded {
            return Err(CudaError::InvalidHandle);
        }
        if !a.complete || !b.complete {
            return Err(CudaError::NotReady);
        }
        let elapsed = (b.completed_at_ns as f64 - a.completed_at_ns as f64) / 1e6;
        // SAFETY: out-parameter per the API contract.
        unsafe { write_out(ms, elapsed as f32) }
    })
}

/// CUDA 12.8: same signature; the simulated events never lose their timestamps.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Handle,
    end: Handle,
) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuEventElapsedTime(ms, start, end) }
}

/// simgpu-only extension, absent from real drivers (so `cuGetProcAddress` never hands it out;
/// benchmarks find it with `dlsym`): the instant, in ns on the caller's own `CLOCK_MONOTONIC`
/// (shifted by its time namespace, if any), at which a recorded event completed in the device
/// model. `CUDA_ERROR_NOT_READY` until it has; an event never
/// recorded has no instant (`CUDA_ERROR_INVALID_HANDLE`, as `cuEventElapsedTime` answers).
/// With the kernel durations it launched, a program learns when its work started running
/// on the simulated GPU, which a real driver would tell only through a profiler.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn simgpuEventTimestampNs(event: Handle, ns: *mut u64) -> CUresult {
    guard(|| {
        if ns.is_null() {
            return Err(CudaError::InvalidValue);
        }
        let (_, s, _) = event_state(event)?;
        if !s.recorded {
            return Err(CudaError::InvalidHandle);
        }
        if !s.complete {
            return Err(CudaError::NotReady);
        }
        // SAFETY: out-parameter per this function's contract.
        unsafe { write_out(ns, simgpu_model::clock::to_local_ns(s.completed_at_ns)) }
    })
}
