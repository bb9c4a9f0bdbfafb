//! A captured graph's nodes as the real driver lists them (cuda.h `cuGraphGetNodes`,
//! `cuGraphNodeGetType`, `cuGraphMemAllocNodeGetParams`): every captured operation is a
//! node, a captured `cuMemAllocAsync` an allocation node whose parameters give its size
//! and address, and only an allocation node has allocation parameters. The interposer
//! reads these at instantiation to charge a graph's memory nodes before its launch.

mod common;
use common::{Lib, Sim, P1, P2, P3};
use libc::{c_int, c_uint};

const MI: usize = 1 << 20;
/// `CUgraphNodeType`.
const MEM_ALLOC: u32 = 10;
const MEM_FREE: u32 = 11;
const INVALID_VALUE: c_int = 1;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` v1: `CUmemPoolProps` (88 bytes), access descriptors and
/// their count, size, address.
#[repr(C)]
#[derive(Default)]
struct AllocParams {
    pool_props: [u64; 11],
    access_descs: usize,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

#[test]
fn a_captured_graph_lists_its_allocation_nodes_with_their_sizes() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1")]);
    let lib = Lib::open(&sim);
    let get_nodes = lib.f::<P3<usize, *mut usize, *mut usize>>("cuGraphGetNodes");
    let node_type = lib.f::<P2<usize, *mut u32>>("cuGraphNodeGetType");
    let alloc_params = lib.f::<P2<usize, *mut AllocParams>>("cuGraphMemAllocNodeGetParams");
    let (mut ctx, mut stream, mut graph, mut a, mut b) = (0usize, 0usize, 0usize, 0u64, 0u64);
    // SAFETY: every call passes live out-pointers of the types cuda.h specifies.
    unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        assert_eq!(
            lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut ctx, 0, 0),
            0
        );
        assert_eq!(
            lib.f::<P2<*mut usize, c_uint>>("cuStreamCreate")(&mut stream, 1),
            0
        );
        assert_eq!(
            lib.f::<P2<usize, c_int>>("cuStreamBeginCapture_v2")(stream, 2),
            0
        );
        let alloc = lib.f::<P3<*mut u64, usize, usize>>("cuMemAllocAsync");
        assert_eq!(alloc(&mut a, MI, stream), 0);
        assert_eq!(alloc(&mut b, 2 * MI, stream), 0);
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemFreeAsync")(a, stream), 0);
        assert_eq!(
            lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph),
            0
        );
    }
    let mut count = 0usize;
    // SAFETY: a NULL array asks for the count.
    let rc = unsafe { get_nodes(graph, std::ptr::null_mut(), &mut count) };
    assert_eq!(rc, 0);
    assert_eq!(count, 3, "two allocation nodes and a free node");
    let mut nodes = vec![0usize; count + 2];
    let mut room = nodes.len();
    // SAFETY: `room` handles of space.
    let rc = unsafe { get_nodes(graph, nodes.as_mut_ptr(), &mut room) };
    assert_eq!(rc, 0);
    assert_eq!(room, 3, "the count becomes how many were written");
    let mut allocations = Vec::new();
    let mut frees = 0;
    for &node in &nodes[..room] {
        let mut kind = u32::MAX;
        // SAFETY: live out-pointers.
        assert_eq!(unsafe { node_type(node, &mut kind) }, 0);
        let mut params = AllocParams::default();
        // SAFETY: as above.
        let rc = unsafe { alloc_params(node, &mut params) };
        match kind {
            MEM_ALLOC => {
                assert_eq!(rc, 0);
                allocations.push((params.dptr, params.bytesize));
            }
            MEM_FREE => {
                frees += 1;
                assert_eq!(
                    rc, INVALID_VALUE,
                    "a free node has no allocation parameters"
                );
            }
            other => panic!("node type {other}"),
        }
    }
    allocations.sort();
    let mut expected = vec![(a, MI), (b, 2 * MI)];
    expected.sort();
    assert_eq!((allocations, frees), (expected, 1));
    let mut one = [0usize; 1];
    let mut room = 1;
    // SAFETY: one handle of space.
    assert_eq!(unsafe { get_nodes(graph, one.as_mut_ptr(), &mut room) }, 0);
    assert_eq!(room, 1, "no more than the room given");
    let mut kind = 0;
    // SAFETY: live out-pointer.
    let rc = unsafe { node_type(graph, &mut kind) };
    assert_eq!(rc, INVALID_VALUE, "a graph is not a node");
}
