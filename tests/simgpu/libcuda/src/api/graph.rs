//! Graphs from stream capture: a captured launch is recorded, not run; launching the
//! instantiated graph queues everything it recorded (one launch: one host cost, one launch
//! latency) and makes its allocation nodes' memory from the graph memory pool.

use super::Handle;
use crate::driver::driver;
use crate::result::{guard, write_out, CUresult, CudaError};
use libc::c_char;

fn instantiate(exec: *mut Handle, graph: Handle) -> Result<(), CudaError> {
    let d = driver()?;
    let mut state = d.state();
    let g = state
        .graphs
        .get(graph)
        .ok_or(CudaError::InvalidHandle)?
        .clone();
    if exec.is_null() {
        return Err(CudaError::InvalidValue);
    }
    let h = state.graph_execs.insert(g);
    // SAFETY: out-parameter per the API contract.
    unsafe { write_out(exec, h) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    exec: *mut Handle,
    graph: Handle,
    _error_node: *mut Handle,
    _log: *mut c_char,
    _log_size: usize,
) -> CUresult {
    guard(|| instantiate(exec, graph))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut Handle,
    graph: Handle,
    _flags: u64,
) -> CUresult {
    guard(|| instantiate(exec, graph))
}

fn launch(exec: Handle, stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let d = driver()?;
    d.launch_host_cost();
    let graph = d
        .state()
        .graph_execs
        .get(exec)
        .ok_or(CudaError::InvalidHandle)?
        .clone();
    let captured = {
        let state = d.state();
        let target = d.resolve_stream(&state, stream, per_thread)?;
        d.capturing(&state, target).is_some()
    };
    // Launched into a capture, the graph becomes part of another graph: nothing runs yet.
    if !captured {
        d.run_graph_allocations(&graph)?;
    }
    // A graph reaches the device as one launch; its nodes then run back to back.
    d.enqueue(stream, per_thread, &graph.nodes, true)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(exec: Handle, stream: Handle) -> CUresult {
    guard(|| launch(exec, stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(exec: Handle, stream: Handle) -> CUresult {
    guard(|| launch(exec, stream, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphDestroy(graph: Handle) -> CUresult {
    guard(|| {
        driver()?
            .state()
            .graphs
            .remove(graph)
            .map(|_| ())
            .ok_or(CudaError::InvalidHandle)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphExecDestroy(exec: Handle) -> CUresult {
    guard(|| {
        driver()?
            .state()
            .graph_execs
            .remove(exec)
            .map(|_| ())
            .ok_or(CudaError::InvalidHandle)
    })
}
