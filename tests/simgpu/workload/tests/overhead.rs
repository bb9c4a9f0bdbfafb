//! Memory the real driver uses outside explicit allocations, on the simulated device: the
//! context, lazily loaded modules, the graph memory pool; strict module images; VMM memory
//! shared through a file descriptor. None of it was charged by the old simulator, where a
//! context on a full GPU was created and a lazily loaded kernel always launched.

mod common;
use common::{Launch, Lib, Sim, P1, P2, P3, P4, P5};
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;

const MIB: u64 = 1 << 20;
const OUT_OF_MEMORY: c_int = 2;
const INVALID_IMAGE: c_int = 200;
const INVALID_PTX: c_int = 218;
const NOT_FOUND: c_int = 500;
const NOT_PERMITTED: c_int = 800;

#[test]
fn context_module_graph_and_shared_memory_are_charged_like_the_real_driver() {
    // Nothing reserved by the driver: the figures below are the overheads alone.
    let sim = Sim::new(&[
        ("SIMGPU_GPUS", "1"),
        ("SIMGPU_MEMORY", "1Gi"),
        ("SIMGPU_RESERVED_MEMORY", "0"),
    ]);
    let lib = Lib::open(&sim);
    // SAFETY: every call passes live out-pointers of the types cuda.h specifies.
    unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        let free = || {
            let (mut free, mut total) = (0usize, 0usize);
            assert_eq!(
                lib.f::<P2<*mut usize, *mut usize>>("cuMemGetInfo_v2")(&mut free, &mut total),
                0
            );
            free as u64
        };
        let mut ctx = 0usize;
        assert_eq!(
            lib.f::<P2<*mut usize, c_int>>("cuDevicePrimaryCtxRetain")(&mut ctx, 0),
            0
        );
        assert_eq!(lib.f::<P1<usize>>("cuCtxSetCurrent")(ctx), 0);
        assert_eq!(
            free(),
            1024 * MIB - 300 * MIB,
            "the primary context costs 300 MiB"
        );

        // Strict images: PTX with its kernels, nothing else.
        let load = |image: &[u8]| {
            let image = CString::new(image).unwrap();
            let mut module = 0usize;
            let rc = lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast(),
            );
            (rc, module)
        };
        assert_eq!(load(b"x").0, INVALID_IMAGE);
        assert_eq!(load(b".entry sleep_1ms() { ret; }").0, INVALID_PTX);
        let ptx = simgpu_model::kernel::ptx_with_entries(&["sleep_1ms"]);
        let (rc, module) = load(ptx.as_bytes());
        assert_eq!(rc, 0);
        let function = |module: usize, name: &std::ffi::CStr| {
            let mut f = 0usize;
            let rc = lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
                &mut f,
                module,
                name.as_ptr(),
            );
            (rc, f)
        };
        assert_eq!(function(module, c"sleep_2ms").0, NOT_FOUND, "not declared");
        let (rc, k1) = function(module, c"sleep_1ms");
        assert_eq!(rc, 0);
        let (rc, spin_module) = load(simgpu_model::kernel::SPIN_PTX.as_bytes());
        assert_eq!(rc, 0);
        let (rc, spin) = function(spin_module, c"gpushare_spin_ns");
        assert_eq!(rc, 0);

        // Lazy loading: a module costs nothing until its first launch, 2 MiB from then on.
        let null = std::ptr::null_mut();
        let launch: Launch = lib.f("cuLaunchKernel");
        let before = free();
        assert_eq!(launch(k1, 1, 1, 1, 32, 1, 1, 0, 0, null, null), 0);
        assert_eq!(free(), before - 2 * MIB, "charged at the first launch");
        assert_eq!(launch(k1, 1, 1, 1, 32, 1, 1, 0, 0, null, null), 0);
        assert_eq!(free(), before - 2 * MIB, "once per module");
        let mut ns = 50_000u64;
        let mut params = [&mut ns as *mut u64 as *mut c_void];
        assert_eq!(
            launch(spin, 1, 1, 1, 32, 1, 1, 0, 0, params.as_mut_ptr(), null),
            0
        );
        assert_eq!(free(), before - 4 * MIB);
        assert_eq!(lib.f::<P1<usize>>("cuModuleUnload")(module), 0);
        assert_eq!(lib.f::<P1<usize>>("cuModuleUnload")(spin_module), 0);
        assert_eq!(free(), before, "given back at unload");
        assert_eq!(
            launch(k1, 1, 1, 1, 32, 1, 1, 0, 0, null, null),
            400,
            "function unloaded"
        );

        // A full GPU: no room for another context (cuCtxCreate fails, nothing charged), and a
        // lazily loaded kernel cannot load.
        let mut big = 0u64;
        let fill = (free() - MIB) as usize;
        assert_eq!(
            lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut big, fill),
            0
        );
        let mut created = 0usize;
        assert_eq!(
            lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut created, 0, 0),
            OUT_OF_MEMORY
        );
        assert_eq!(free(), MIB);
        let (rc, module) = load(ptx.as_bytes());
        assert_eq!(rc, 0, "loading is lazy: nothing needed yet");
        let (_, k1) = function(module, c"sleep_1ms");
        assert_eq!(
            launch(k1, 1, 1, 1, 32, 1, 1, 0, 0, null, null),
            OUT_OF_MEMORY
        );
        assert_eq!(lib.f::<P1<u64>>("cuMemFree_v2")(big), 0);
        assert_eq!(launch(k1, 1, 1, 1, 32, 1, 1, 0, 0, null, null), 0);
        let baseline = free();

        // Graph memory nodes: cuMemAllocAsync in a capture records an allocation; launching
        // the graph reserves it in the graph memory pool, which keeps it after the launch.
        let graph_attr = |attr: c_int| {
            let mut v = u64::MAX;
            assert_eq!(
                lib.f::<P3<c_int, c_int, *mut u64>>("cuDeviceGetGraphMemAttribute")(
                    0, attr, &mut v
                ),
                0
            );
            v
        };
        let mut stream = 0usize;
        lib.f::<P2<*mut usize, c_uint>>("cuStreamCreate")(&mut stream, 0);
        assert_eq!(
            lib.f::<P2<usize, c_int>>("cuStreamBeginCapture_v2")(stream, 0),
            0
        );
        let (mut scratch, mut kept) = (0u64, 0u64);
        let alloc_async: P3<*mut u64, usize, usize> = lib.f("cuMemAllocAsync");
        assert_eq!(alloc_async(&mut scratch, (256 * MIB) as usize, stream), 0);
        assert_eq!(alloc_async(&mut kept, (128 * MIB) as usize, stream), 0);
        assert_eq!(launch(k1, 1, 1, 1, 32, 1, 1, 0, stream, null, null), 0);
        assert_eq!(
            lib.f::<P2<u64, usize>>("cuMemFreeAsync")(scratch, stream),
            0
        );
        let (mut graph, mut exec) = (0usize, 0usize);
        assert_eq!(
            lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph),
            0
        );
        assert_eq!(free(), baseline, "capturing allocates nothing");
        assert_eq!(
            lib.f::<P3<*mut usize, usize, u64>>("cuGraphInstantiateWithFlags")(&mut exec, graph, 0),
            0
        );
        assert_eq!(graph_attr(2), 0, "nothing reserved before the launch");
        assert_eq!(lib.f::<P2<usize, usize>>("cuGraphLaunch")(exec, stream), 0);
        assert_eq!(lib.f::<P1<usize>>("cuStreamSynchronize")(stream), 0);
        assert_eq!(graph_attr(2), 384 * MIB, "RESERVED_MEM_CURRENT");
        assert_eq!(
            graph_attr(0),
            128 * MIB,
            "USED_MEM_CURRENT: the allocation not freed"
        );
        assert_eq!(graph_attr(1), 384 * MIB, "USED_MEM_HIGH");
        assert_eq!(
            free(),
            baseline - 384 * MIB,
            "charged to the process, kept after the launch"
        );
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemFreeAsync")(kept, stream), 0);
        assert_eq!(graph_attr(0), 0);
        assert_eq!(
            free(),
            baseline - 384 * MIB,
            "freed into the pool, still reserved"
        );
        // A second launch reuses the reservation.
        assert_eq!(lib.f::<P2<usize, usize>>("cuGraphLaunch")(exec, stream), 0);
        assert_eq!(free(), baseline - 384 * MIB);
        assert_eq!(
            lib.f::<P2<usize, usize>>("cuGraphLaunch")(exec, stream),
            1,
            "still live"
        );
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemFreeAsync")(kept, stream), 0);
        assert_eq!(lib.f::<P1<c_int>>("cuDeviceGraphMemTrim")(0), 0);
        assert_eq!(
            (graph_attr(2), free()),
            (0, baseline),
            "trimmed back to the device"
        );

        // VMM sharing through a POSIX file descriptor.
        let mut prop: [u32; 8] = [1, 1, 1, 0, 0, 0, 0, 0]; // pinned, POSIX fd, device 0
        let mut granularity = 0usize;
        lib.f::<P3<*mut usize, *const u32, c_int>>("cuMemGetAllocationGranularity")(
            &mut granularity,
            prop.as_ptr(),
            0,
        );
        let size = 8 * granularity;
        let create: P4<*mut u64, usize, *const u32, u64> = lib.f("cuMemCreate");
        let export: P4<*mut c_int, u64, u32, u64> = lib.f("cuMemExportToShareableHandle");
        let import: P3<*mut u64, *mut c_void, u32> = lib.f("cuMemImportFromShareableHandle");
        let release: P1<u64> = lib.f("cuMemRelease");
        let mut exported = 0u64;
        assert_eq!(create(&mut exported, size, prop.as_ptr(), 0), 0);
        assert_eq!(free(), baseline - size as u64);
        let mut fd: c_int = -1;
        assert_eq!(export(&mut fd, exported, 1, 0), 0);
        assert!(
            fd >= 0 && libc::fcntl(fd, libc::F_GETFD) >= 0,
            "a real descriptor"
        );
        let mut imported = 0u64;
        assert_eq!(import(&mut imported, fd as usize as *mut c_void, 1), 0);
        assert_eq!(
            free(),
            baseline - size as u64,
            "one allocation, charged once"
        );
        let mut va = 0u64;
        assert_eq!(
            lib.f::<P5<*mut u64, usize, usize, u64, u64>>("cuMemAddressReserve")(
                &mut va, size, 0, 0, 0
            ),
            0
        );
        assert_eq!(
            lib.f::<P5<u64, usize, usize, u64, u64>>("cuMemMap")(va, size, 0, imported, 0),
            0
        );
        assert_eq!(release(exported), 0);
        assert_eq!(release(imported), 0);
        assert_eq!(
            free(),
            baseline - size as u64,
            "still mapped by the importer"
        );
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemUnmap")(va, size), 0);
        assert_eq!(free(), baseline, "the last reference gone");
        libc::close(fd);
        // Only a handle type requested at creation can be exported.
        prop[1] = 0;
        let mut private = 0u64;
        assert_eq!(create(&mut private, size, prop.as_ptr(), 0), 0);
        assert_eq!(export(&mut fd, private, 1, 0), NOT_PERMITTED);
        assert_eq!(release(private), 0);

        // The primary context's end gives its 300 MiB back.
        assert_eq!(
            lib.f::<P1<usize>>("cuCtxDestroy_v2")(created),
            201,
            "never created"
        );
        assert_eq!(lib.f::<P1<c_int>>("cuDevicePrimaryCtxRelease_v2")(0), 0);
        let model = sim.model();
        let snap = model.lock().unwrap().snapshot(0).unwrap();
        assert_eq!(
            snap.memory_used, 0,
            "context, module and graph pool released"
        );
    }
}
