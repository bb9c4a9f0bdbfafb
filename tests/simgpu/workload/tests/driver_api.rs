//! The rest of the driver API, called in-process through dlopen/dlsym as an interposer would
//! see it: events and their exact timing, stream capture and graph launch, memory pools, VMM,
//! arrays, memory info. Figures are simulated.

mod common;
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;

struct Lib(*mut c_void);

impl Lib {
    /// The exported function `name`, typed by the caller.
    fn f<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap();
        // SAFETY: dlsym on a live handle; the caller names the C signature of that export.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        // SAFETY: T is a function pointer type of the export's signature (size checked above).
        unsafe { std::mem::transmute_copy(&p) }
    }
}

type P0 = unsafe extern "C" fn() -> c_int;
type P1<A> = unsafe extern "C" fn(A) -> c_int;
type P2<A, B> = unsafe extern "C" fn(A, B) -> c_int;
type P3<A, B, C> = unsafe extern "C" fn(A, B, C) -> c_int;
type P4<A, B, C, D> = unsafe extern "C" fn(A, B, C, D) -> c_int;
type P5<A, B, C, D, E> = unsafe extern "C" fn(A, B, C, D, E) -> c_int;
type Launch = unsafe extern "C" fn(
    usize,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    usize,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

const MS: f32 = 1.0;
const GIB: u64 = 1 << 30;

#[test]
fn events_capture_pools_vmm_and_arrays() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_MEMORY", "8Gi")]);
    for (k, v) in &sim.vars {
        std::env::set_var(k, v);
    }
    let path = CString::new(common::libs_dir().join("libcuda.so.1").to_str().unwrap()).unwrap();
    // SAFETY: dlopen of our own library; never closed.
    let lib = Lib(unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) });
    assert!(!lib.0.is_null());
    // SAFETY: every call below passes live out-pointers of the types cuda.h specifies.
    unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        let mut ctx = 0usize;
        assert_eq!(
            lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut ctx, 0, 0),
            0
        );
        let mut current = 0usize;
        lib.f::<P1<*mut usize>>("cuCtxGetCurrent")(&mut current);
        assert_eq!(current, ctx, "a created context is current");

        let mut module = 0usize;
        let image = CString::new(simgpu_model::kernel::ptx_with_entries(&["sleep_20ms"])).unwrap();
        assert_eq!(
            lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast(),
            ),
            0
        );
        let mut k20 = 0usize;
        lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
            &mut k20,
            module,
            c"sleep_20ms".as_ptr(),
        );
        let launch: Launch = lib.f("cuLaunchKernel");
        let null = std::ptr::null_mut();

        // Events bracket two 20 ms kernels: elapsed is exactly 40 ms of simulated time.
        let (mut start, mut end, mut stream) = (0usize, 0usize, 0usize);
        lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut start, 0);
        lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut end, 0);
        lib.f::<P2<*mut usize, c_uint>>("cuStreamCreate")(&mut stream, 0);
        // A kernel ahead of the start marker: the marker completes when it ends, by which
        // time the bracketed kernels are queued. Recorded on an idle stream, the marker
        // completed at once, and a test thread descheduled for over 10 µs before its next
        // launch (a loaded CI machine) measured more than 40 ms.
        assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 0);
        lib.f::<P2<usize, usize>>("cuEventRecord")(start, stream);
        assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 0);
        assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 0);
        lib.f::<P2<usize, usize>>("cuEventRecord")(end, stream);
        assert_eq!(
            lib.f::<P1<usize>>("cuEventQuery")(end),
            600,
            "CUDA_ERROR_NOT_READY while running"
        );
        assert_eq!(lib.f::<P1<usize>>("cuStreamQuery")(stream), 600);
        assert_eq!(lib.f::<P1<usize>>("cuEventSynchronize")(end), 0);
        assert_eq!(lib.f::<P1<usize>>("cuEventQuery")(end), 0);
        let mut ms = 0f32;
        assert_eq!(
            lib.f::<P3<*mut f32, usize, usize>>("cuEventElapsedTime")(&mut ms, start, end),
            0
        );
        assert!((ms - 40.0 * MS).abs() < 0.01, "elapsed {ms} ms");

        // Stream capture records instead of running; the graph launch runs it.
        let begin: P2<usize, c_int> = lib.f("cuStreamBeginCapture_v2");
        let is_capturing = |stream| {
            let mut status = -1;
            lib.f::<P2<usize, *mut c_int>>("cuStreamIsCapturing")(stream, &mut status);
            status
        };
        // Synchronising a capturing stream is illegal: it fails and breaks the capture, which
        // then ends without a graph (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED).
        assert_eq!(begin(stream, 0), 0);
        assert_eq!(is_capturing(stream), 1);
        assert_eq!(
            lib.f::<P1<usize>>("cuStreamSynchronize")(stream),
            900,
            "sync while capturing"
        );
        assert_eq!(
            is_capturing(stream),
            2,
            "CU_STREAM_CAPTURE_STATUS_INVALIDATED"
        );
        assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 901);
        let (mut graph, mut exec) = (usize::MAX, 0usize);
        assert_eq!(
            lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph),
            901
        );
        assert_eq!(
            (graph, is_capturing(stream)),
            (0, 0),
            "no graph, capture over"
        );

        assert_eq!(begin(stream, 0), 0);
        for _ in 0..3 {
            assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 0);
        }
        assert_eq!(
            lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph),
            0
        );
        // Nothing was queued: three 20 ms kernels would keep the stream busy for 60 ms.
        assert_eq!(
            lib.f::<P1<usize>>("cuStreamQuery")(stream),
            0,
            "captured launches did not run"
        );
        assert_eq!(
            lib.f::<P3<*mut usize, usize, u64>>("cuGraphInstantiateWithFlags")(&mut exec, graph, 0),
            0
        );
        // As above, a kernel ahead of the start marker keeps the launch latency and the test
        // thread's scheduling out of the measurement.
        assert_eq!(launch(k20, 1, 1, 1, 1, 1, 1, 0, stream, null, null), 0);
        lib.f::<P2<usize, usize>>("cuEventRecord")(start, stream);
        assert_eq!(lib.f::<P2<usize, usize>>("cuGraphLaunch")(exec, stream), 0);
        lib.f::<P2<usize, usize>>("cuEventRecord")(end, stream);
        assert_eq!(lib.f::<P1<usize>>("cuStreamSynchronize")(stream), 0);
        lib.f::<P3<*mut f32, usize, usize>>("cuEventElapsedTime")(&mut ms, start, end);
        assert!(
            (ms - 60.0 * MS).abs() < 0.01,
            "graph of three 20 ms kernels took {ms} ms"
        );

        let used = || {
            let (mut free, mut total) = (0usize, 0usize);
            assert_eq!(
                lib.f::<P2<*mut usize, *mut usize>>("cuMemGetInfo_v2")(&mut free, &mut total),
                0
            );
            (total - free) as u64
        };
        // Before any allocation, the device already holds the context (300 MiB) and the module
        // its kernels lazily loaded (2 MiB): the defaults, as nvidia-smi would show them.
        let overhead = used();
        assert_eq!(overhead, (300 << 20) + (2 << 20));
        let mem_info = || used() - overhead;
        assert_eq!(mem_info(), 0);

        // Pools: freed blocks stay charged until a synchronisation trims to the threshold.
        let mut p = 0u64;
        assert_eq!(
            lib.f::<P3<*mut u64, usize, usize>>("cuMemAllocAsync")(&mut p, GIB as usize, stream),
            0
        );
        assert_eq!(mem_info(), GIB);
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemFreeAsync")(p, stream), 0);
        assert_eq!(mem_info(), GIB, "cached in the pool");
        let mut pool = 0usize;
        lib.f::<P2<*mut usize, c_int>>("cuDeviceGetDefaultMemPool")(&mut pool, 0);
        let mut reserved = 0u64;
        lib.f::<P3<usize, c_int, *mut c_void>>("cuMemPoolGetAttribute")(
            pool,
            5,
            (&mut reserved as *mut u64).cast(),
        );
        assert_eq!(reserved, GIB);
        lib.f::<P1<usize>>("cuStreamSynchronize")(stream);
        assert_eq!(mem_info(), 0, "released at synchronisation (threshold 0)");

        // VMM: physical memory is charged at cuMemCreate, credited after release and unmap.
        let prop: [u32; 8] = [1, 0, 1, 0, 0, 0, 0, 0]; // pinned, device 0
        let mut granularity = 0usize;
        lib.f::<P3<*mut usize, *const u32, c_int>>("cuMemGetAllocationGranularity")(
            &mut granularity,
            prop.as_ptr(),
            0,
        );
        let (mut handle, mut va) = (0u64, 0u64);
        let size = 4 * granularity;
        assert_eq!(
            lib.f::<P4<*mut u64, usize, *const u32, u64>>("cuMemCreate")(
                &mut handle,
                size,
                prop.as_ptr(),
                0
            ),
            0
        );
        assert_eq!(mem_info(), size as u64);
        assert_eq!(
            lib.f::<P5<*mut u64, usize, usize, u64, u64>>("cuMemAddressReserve")(
                &mut va, size, 0, 0, 0
            ),
            0
        );
        assert_eq!(
            lib.f::<P5<u64, usize, usize, u64, u64>>("cuMemMap")(va, size, 0, handle, 0),
            0
        );
        assert_eq!(lib.f::<P1<u64>>("cuMemRelease")(handle), 0);
        assert_eq!(mem_info(), size as u64, "still mapped");
        assert_eq!(lib.f::<P2<u64, usize>>("cuMemUnmap")(va, size), 0);
        assert_eq!(mem_info(), 0);

        // Arrays: width x height x channels x element size.
        let desc: (usize, usize, c_uint, c_uint) = (1024, 1024, 0x20, 4); // float4
        let mut array = 0usize;
        assert_eq!(
            lib.f::<P2<*mut usize, *const c_void>>("cuArrayCreate_v2")(
                &mut array,
                &desc as *const _ as *const c_void
            ),
            0
        );
        assert_eq!(mem_info(), 1024 * 1024 * 16);
        assert_eq!(lib.f::<P1<usize>>("cuArrayDestroy")(array), 0);

        // Out of memory leaves nothing charged.
        let mut d = 0u64;
        assert_eq!(
            lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut d, (9 * GIB) as usize),
            2
        );
        assert_eq!(mem_info(), 0);
        assert_eq!(
            lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut d, GIB as usize),
            0
        );
        assert_eq!(lib.f::<P1<u64>>("cuMemFree_v2")(d), 0);
        assert_eq!(
            lib.f::<P1<u64>>("cuMemFree_v2")(d),
            1,
            "double free is CUDA_ERROR_INVALID_VALUE"
        );
        assert_eq!(lib.f::<P0>("cuCtxSynchronize")(), 0);
        assert_eq!(lib.f::<P1<usize>>("cuCtxDestroy_v2")(ctx), 0);
        assert_eq!(
            lib.f::<P0>("cuCtxSynchronize")(),
            201,
            "no current context left"
        );
    }
}

use common::Sim;
