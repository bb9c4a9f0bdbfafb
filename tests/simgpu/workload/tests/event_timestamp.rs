//! The simgpu-only `simgpuEventTimestampNs` extension, and how promptly a synchronisation
//! returns once the model says the work completed. Figures are simulated.

mod common;
use common::Sim;
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;

type P1<A> = unsafe extern "C" fn(A) -> c_int;
type P2<A, B> = unsafe extern "C" fn(A, B) -> c_int;
type P3<A, B, C> = unsafe extern "C" fn(A, B, C) -> c_int;
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

const NOT_READY: c_int = 600;
const INVALID_HANDLE: c_int = 400;
/// Kernels timed for the wake-up lateness, as the benchmark does: short ones, synced
/// one at a time, where a late wake-up is a large fraction of the iteration.
const LATENESS_SAMPLES: usize = 400;

struct Lib(*mut c_void);

impl Lib {
    fn f<T: Copy>(&self, name: &str) -> T {
        let c = CString::new(name).unwrap();
        // SAFETY: dlsym on a live handle; the caller names the C signature of that export.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        // SAFETY: T is a function pointer type of the export's signature.
        unsafe { std::mem::transmute_copy(&p) }
    }
}

/// The device model's clock (CLOCK_MONOTONIC), which its event timestamps use.
use simgpu_model::now_ns as monotonic_ns;

#[test]
fn event_timestamps_are_exact_and_synchronisation_returns_promptly() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1")]);
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
        let mut module = 0usize;
        let image = CString::new(simgpu_model::kernel::ptx_with_entries(&[
            "sleep_20ms",
            "sleep_100us",
        ]))
        .unwrap();
        assert_eq!(
            lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast(),
            ),
            0
        );
        let function = |name: &std::ffi::CStr| {
            let mut f = 0usize;
            lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
                &mut f,
                module,
                name.as_ptr(),
            );
            f
        };
        let (k20ms, k100us) = (function(c"sleep_20ms"), function(c"sleep_100us"));
        let launch: Launch = lib.f("cuLaunchKernel");
        let timestamp: P2<usize, *mut u64> = lib.f("simgpuEventTimestampNs");
        let record: P2<usize, usize> = lib.f("cuEventRecord");
        let null = std::ptr::null_mut();
        let mut event = 0usize;
        lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut event, 0);
        let mut ns = 0u64;
        assert_eq!(timestamp(event, &mut ns), INVALID_HANDLE, "never recorded");

        let requested = monotonic_ns();
        assert_eq!(launch(k20ms, 1, 1, 1, 1, 1, 1, 0, 0, null, null), 0);
        record(event, 0);
        assert_eq!(
            timestamp(event, &mut ns),
            NOT_READY,
            "while the kernel runs"
        );
        assert_eq!(lib.f::<P1<usize>>("cuEventSynchronize")(event), 0);
        assert_eq!(timestamp(event, &mut ns), 0);
        let after_start = ns - requested;
        // Never earlier than the launch's own cost in the driver (2 µs) plus the launch latency
        // (4 µs): the defaults of SIMGPU_LAUNCH_HOST_NS / SIMGPU_LAUNCH_LATENCY_NS.
        assert!(
            (20_006_000..21_000_000).contains(&after_start),
            "a 20 ms kernel launched on an idle GPU completed {after_start} ns after the launch"
        );

        // Lateness: how long after the model's completion instant the synchronisation returns.
        let stream_synchronize: P1<usize> = lib.f("cuStreamSynchronize");
        let mut lateness_ns = Vec::with_capacity(LATENESS_SAMPLES);
        for _ in 0..LATENESS_SAMPLES {
            assert_eq!(launch(k100us, 1, 1, 1, 1, 1, 1, 0, 0, null, null), 0);
            record(event, 0);
            assert_eq!(stream_synchronize(0), 0);
            let returned = monotonic_ns();
            assert_eq!(timestamp(event, &mut ns), 0);
            lateness_ns.push(returned - ns);
        }
        lateness_ns.sort_unstable();
        let p50 = lateness_ns[LATENESS_SAMPLES / 2];
        let p99 = lateness_ns[LATENESS_SAMPLES * 99 / 100];
        eprintln!("simulated sync lateness after 100 us kernels: p50 {p50} ns, p99 {p99} ns");
        // The default 50 µs timer slack alone made the median about 50 µs; generous on a
        // shared, loaded machine, but well below that.
        assert!(
            p50 < 25_000,
            "cuStreamSynchronize returned a median {p50} ns after the work completed"
        );
    }
}
