//! Graph memory nodes, charged before the launch that reserves their memory.
//!
//! A graph's allocation nodes (`cuGraphAddMemAllocNode`, or `cuMemAllocAsync` captured
//! into it) take their memory from the device's graph memory pool when the graph is
//! *launched*: the pool grows inside `cuGraphLaunch`, and nothing afterwards can refuse
//! it. So what an executable graph's allocation nodes need is read once, when it is
//! instantiated (`cuGraphGetNodes`, `cuGraphNodeGetType`, `cuGraphMemAllocNodeGetParams`),
//! and before each launch of it the pool's growth (what the nodes need beyond what the
//! pool holds unused) is charged, the launch refused with `CUDA_ERROR_OUT_OF_MEMORY`
//! over the quota.
//!
//! The table of executable graphs with allocation nodes is a fixed array of atomics: a
//! launch of a graph without memory nodes, the common hot path, reads one counter and
//! takes no lock. A program with more such graphs alive than the table holds gets the
//! rest charged after their launch only (logged once).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::accounts::{GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, GRAPH_MEM_ATTR_USED_MEM_CURRENT};
use crate::cuda::*;

/// Executable graphs with allocation nodes the table follows at once.
const SLOTS: usize = 128;
/// A slot being written (never a handle the driver gives: handles are addresses or
/// small indices).
const WRITING: usize = usize::MAX;

static EXECS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static NEEDS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
/// How many slots hold a graph: zero keeps every launch off the table.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static FULL_LOGGED: AtomicBool = AtomicBool::new(false);

/// What `exec`'s allocation nodes need, if it has any (no lock, no allocation).
#[inline(always)]
pub fn needs(exec: Handle) -> Option<u64> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    needs_in_table(exec)
}

#[cold]
#[inline(never)]
fn needs_in_table(exec: Handle) -> Option<u64> {
    (0..SLOTS)
        .find(|&i| EXECS[i].load(Ordering::Acquire) == exec)
        .map(|i| NEEDS[i].load(Ordering::Relaxed))
}

/// Follows `exec` (just instantiated) when its allocation nodes need memory.
fn follow(exec: Handle, bytes: u64) {
    forget(exec);
    if bytes == 0 || exec == 0 || exec == WRITING {
        return;
    }
    for i in 0..SLOTS {
        if EXECS[i]
            .compare_exchange(0, WRITING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            NEEDS[i].store(bytes, Ordering::Relaxed);
            EXECS[i].store(exec, Ordering::Release);
            LIVE.fetch_add(1, Ordering::AcqRel);
            return;
        }
    }
    if !FULL_LOGGED.swap(true, Ordering::Relaxed) {
        crate::log_info!(
            "more than {SLOTS} executable graphs with memory nodes: the rest are charged after their launch"
        );
    }
}

/// Stops following `exec` (destroyed; or instantiated anew under a reused handle).
pub fn forget(exec: Handle) {
    for slot in EXECS.iter() {
        if slot
            .compare_exchange(exec, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            LIVE.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// How much the graph memory pool grows when allocation nodes needing `needed` bytes
/// run: what its reserve holds unused serves first.
pub fn pool_growth(needed: u64, reserved: u64, used: u64) -> u64 {
    needed.saturating_sub(reserved.saturating_sub(used))
}

/// After a successful instantiation of `graph` into `exec`: reads what its allocation
/// nodes need. A driver without the node queries (before CUDA 11.4) leaves the graph
/// to the settle after its launch.
pub fn instantiated(exec: Handle, graph: Handle) {
    if !crate::config::is_active() {
        return;
    }
    match alloc_node_bytes(graph) {
        Some(bytes) => follow(exec, bytes),
        None => forget(exec),
    }
}

/// Before a launch of a graph whose allocation nodes need `needed` bytes: charges the
/// graph pool's growth. `CUDA_ERROR_OUT_OF_MEMORY` over the quota (nothing launched).
pub fn reserve_before_launch(needed: u64) -> CUresult {
    let Some(device) = crate::driver::current_device() else {
        return CUDA_SUCCESS;
    };
    let (Some(reserved), Some(used)) = (
        crate::accounts::graph_mem_attribute(device, GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
        crate::accounts::graph_mem_attribute(device, GRAPH_MEM_ATTR_USED_MEM_CURRENT),
    ) else {
        return CUDA_SUCCESS;
    };
    let growth = pool_growth(needed, reserved, used);
    if growth == 0 {
        return CUDA_SUCCESS;
    }
    match crate::accounts::lock() {
        Some(mut a) => match a.reserve_graph_pool(device, reserved + growth) {
            Ok(()) => CUDA_SUCCESS,
            Err(rc) => rc,
        },
        None => CUDA_SUCCESS,
    }
}

/// `CU_GRAPH_NODE_TYPE_MEM_ALLOC`.
const NODE_TYPE_MEM_ALLOC: u32 = 10;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1): `CUmemPoolProps` (88 bytes), the access
/// descriptors and their count, the size, the address.
#[repr(C)]
struct MemAllocNodeParams {
    pool_props: [u64; 11],
    access_descs: *const libc::c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: CUdeviceptr,
}

static GET_NODES: AtomicPtr<libc::c_void> = AtomicPtr::new(std::ptr::null_mut());
static NODE_TYPE: AtomicPtr<libc::c_void> = AtomicPtr::new(std::ptr::null_mut());
static ALLOC_PARAMS: AtomicPtr<libc::c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The sum of `graph`'s allocation nodes' sizes (None: the driver cannot say).
fn alloc_node_bytes(graph: Handle) -> Option<u64> {
    type GetNodes = unsafe extern "C" fn(Handle, *mut Handle, *mut usize) -> CUresult;
    type NodeType = unsafe extern "C" fn(Handle, *mut u32) -> CUresult;
    type AllocParams = unsafe extern "C" fn(Handle, *mut MemAllocNodeParams) -> CUresult;
    let get_nodes = crate::accounts::driver_function(&GET_NODES, c"cuGraphGetNodes")?;
    let node_type = crate::accounts::driver_function(&NODE_TYPE, c"cuGraphNodeGetType")?;
    let alloc_params =
        crate::accounts::driver_function(&ALLOC_PARAMS, c"cuGraphMemAllocNodeGetParams")?;
    // SAFETY: the driver's own functions for these names (cuda.h signatures above).
    let (get_nodes, node_type, alloc_params) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, GetNodes>(get_nodes),
            std::mem::transmute::<*mut libc::c_void, NodeType>(node_type),
            std::mem::transmute::<*mut libc::c_void, AllocParams>(alloc_params),
        )
    };
    let mut count = 0usize;
    // SAFETY: a NULL node array asks for the count into a valid out-pointer.
    if unsafe { get_nodes(graph, std::ptr::null_mut(), &mut count) } != CUDA_SUCCESS {
        return None;
    }
    let mut nodes = vec![0 as Handle; count];
    // SAFETY: `nodes` holds `count` handles, as `count` tells the driver.
    if unsafe { get_nodes(graph, nodes.as_mut_ptr(), &mut count) } != CUDA_SUCCESS {
        return None;
    }
    nodes.truncate(count);
    let mut total = 0u64;
    for node in nodes {
        let mut kind = 0u32;
        // SAFETY: a node of `graph`, a valid out-pointer.
        if unsafe { node_type(node, &mut kind) } != CUDA_SUCCESS {
            return None;
        }
        if kind != NODE_TYPE_MEM_ALLOC {
            continue;
        }
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut params: MemAllocNodeParams = unsafe { std::mem::zeroed() };
        // SAFETY: an allocation node of `graph`, a valid out-pointer of the v1 layout.
        if unsafe { alloc_params(node, &mut params) } != CUDA_SUCCESS {
            return None;
        }
        total = total.saturating_add(params.bytesize as u64);
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_grows_by_what_its_unused_reserve_cannot_serve() {
        // (needed, reserved, used) -> growth
        for (needed, reserved, used, growth) in [
            (64, 0, 0, 64),    // an empty pool grows by all of it
            (64, 64, 0, 0),    // a launch before, freed inside: reserve reused
            (64, 100, 50, 14), // half the reserve is in use
            (64, 64, 64, 64),  // all of it in use: grows again
            (0, 0, 0, 0),      // no allocation nodes
            (10, 5, 9, 10),    // used above reserved (read between changes): no credit
        ] {
            assert_eq!(
                pool_growth(needed, reserved, used),
                growth,
                "needed {needed}, reserved {reserved}, used {used}"
            );
        }
    }

    #[test]
    fn the_table_follows_instantiated_graphs_until_they_are_destroyed() {
        assert_eq!(needs(0x5000), None);
        follow(0x5000, 64);
        follow(0x6000, 0);
        assert_eq!((needs(0x5000), needs(0x6000)), (Some(64), None));
        follow(0x5000, 32);
        assert_eq!(
            needs(0x5000),
            Some(32),
            "a reused handle: the new graph's need"
        );
        forget(0x5000);
        assert_eq!(needs(0x5000), None);
        assert_eq!(LIVE.load(Ordering::Acquire), 0);
    }
}
