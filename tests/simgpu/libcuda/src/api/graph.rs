//! Graphs from stream capture: a captured launch is recorded, not run; launching the
//! instantiated graph queues everything it recorded (one launch: one host cost, one launch
//! latency) and makes its allocation nodes' memory from the graph memory pool.

use super::Handle;
use crate::driver::driver;
use crate::handles::{Kind, TAG_SHIFT};
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

// ----- node queries -----
//
// A graph's nodes, as `cuGraphGetNodes` lists them: its work (kernel nodes), then its memory
// allocation nodes, then its memory free nodes. A node handle names its graph and its place
// in that list, so it is valid exactly while its graph is.

/// `CUgraphNodeType` values simgpu's graphs hold.
const NODE_TYPE_KERNEL: u32 = 0;
const NODE_TYPE_MEM_ALLOC: u32 = 10;
const NODE_TYPE_MEM_FREE: u32 = 11;

/// A node handle: the `GraphNode` tag, its graph's slab index and its own place, each
/// counted from 1 in `NODE_INDEX_BITS` bits.
const NODE_INDEX_BITS: u32 = 20;
const NODE_INDEX_MASK: Handle = (1 << NODE_INDEX_BITS) - 1;

fn node_handle(graph: Handle, index: usize) -> Handle {
    ((Kind::GraphNode as Handle) << TAG_SHIFT)
        | ((graph & NODE_INDEX_MASK) << NODE_INDEX_BITS)
        | (index + 1)
}

/// The graph a node handle names.
fn node_graph(handle: Handle) -> Handle {
    ((Kind::Graph as Handle) << TAG_SHIFT) | ((handle >> NODE_INDEX_BITS) & NODE_INDEX_MASK)
}

/// What a node handle names: its type, and for an allocation node its (address, bytes).
fn node(handle: Handle) -> Result<(u32, Option<(u64, u64)>), CudaError> {
    if handle >> TAG_SHIFT != Kind::GraphNode as Handle {
        return Err(CudaError::InvalidValue);
    }
    let graph = node_graph(handle);
    let index = (handle & NODE_INDEX_MASK)
        .checked_sub(1)
        .ok_or(CudaError::InvalidValue)?;
    let d = driver()?;
    let state = d.state();
    let g = state.graphs.get(graph).ok_or(CudaError::InvalidValue)?;
    let (work, allocs) = (g.nodes.len(), g.allocs.len());
    if index < work {
        Ok((NODE_TYPE_KERNEL, None))
    } else if index < work + allocs {
        Ok((NODE_TYPE_MEM_ALLOC, Some(g.allocs[index - work])))
    } else if index < work + allocs + g.frees.len() {
        Ok((NODE_TYPE_MEM_FREE, None))
    } else {
        Err(CudaError::InvalidValue)
    }
}

/// `cuGraphGetNodes`: with `nodes` NULL, the number of nodes; else up to `*count` handles,
/// and `*count` becomes how many were written.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphGetNodes(
    graph: Handle,
    nodes: *mut Handle,
    count: *mut usize,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let total = {
            let state = d.state();
            let g = state.graphs.get(graph).ok_or(CudaError::InvalidValue)?;
            g.nodes.len() + g.allocs.len() + g.frees.len()
        };
        if count.is_null() {
            return Err(CudaError::InvalidValue);
        }
        if nodes.is_null() {
            // SAFETY: checked non-null; out-parameter per the API contract.
            return unsafe { write_out(count, total) };
        }
        // SAFETY: checked non-null; in/out-parameter per the API contract.
        let room = unsafe { *count };
        let written = room.min(total);
        for i in 0..written {
            // SAFETY: the caller's array holds `*count` handles.
            unsafe { nodes.add(i).write(node_handle(graph, i)) };
        }
        // SAFETY: as above.
        unsafe { write_out(count, written) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphNodeGetType(node_handle: Handle, kind: *mut u32) -> CUresult {
    guard(|| {
        let (t, _) = node(node_handle)?;
        // SAFETY: out-parameter per the API contract (NULL rejected).
        unsafe { write_out(kind, t) }
    })
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1): the pool properties (`CUmemPoolProps`, 88 bytes),
/// the access descriptors, the size and the address the node allocates at.
#[repr(C)]
pub struct MemAllocNodeParams {
    pub alloc_type: u32,
    pub handle_types: u32,
    pub location_type: u32,
    pub location_id: i32,
    pub win32_security_attributes: *mut libc::c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
    pub access_descs: *const libc::c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: u64,
}

/// `CU_MEM_ALLOCATION_TYPE_PINNED` on `CU_MEM_LOCATION_TYPE_DEVICE`.
const ALLOCATION_TYPE_PINNED: u32 = 1;
const LOCATION_TYPE_DEVICE: u32 = 1;

/// `cuGraphMemAllocNodeGetParams`: only an allocation node has them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphMemAllocNodeGetParams(
    node_handle: Handle,
    params: *mut MemAllocNodeParams,
) -> CUresult {
    guard(|| {
        let (_, Some((dptr, bytes))) = node(node_handle)? else {
            return Err(CudaError::InvalidValue);
        };
        let gpu = {
            driver()?
                .state()
                .graphs
                .get(node_graph(node_handle))
                .and_then(|g| g.gpu)
        };
        let value = MemAllocNodeParams {
            alloc_type: ALLOCATION_TYPE_PINNED,
            handle_types: 0,
            location_type: LOCATION_TYPE_DEVICE,
            location_id: gpu.unwrap_or(0) as i32,
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
            access_descs: std::ptr::null(),
            access_desc_count: 0,
            bytesize: bytes as usize,
            dptr,
        };
        // SAFETY: out-parameter per the API contract (NULL rejected).
        unsafe { write_out(params, value) }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn alloc_node_params_have_cuda_h_layout() {
        assert_eq!(std::mem::size_of::<super::MemAllocNodeParams>(), 120);
        assert_eq!(
            std::mem::offset_of!(super::MemAllocNodeParams, access_descs),
            88
        );
        assert_eq!(
            std::mem::offset_of!(super::MemAllocNodeParams, bytesize),
            104
        );
    }
}
