//! Kernels and graphs of any length run to completion with exact timing and nothing in the
//! driver times out; a full push buffer (QUEUE_DEPTH operations queued) blocks the submitting
//! thread until the GPU has made room, as a real pushbuffer does. Figures are simulated.

mod common;
use common::{Launch, Lib, Sim, P1, P2, P3};
use libc::{c_int, c_uint, c_void};
use simgpu_model::shared::QUEUE_DEPTH;
use std::ffi::CString;
use std::time::Instant;

const NOT_READY: c_int = 600;

#[test]
fn long_kernels_and_graphs_complete_exactly_and_a_full_queue_blocks_the_submitter() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1")]);
    let lib = Lib::open(&sim);
    // SAFETY: every call passes live out-pointers of the types cuda.h specifies.
    unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        let mut ctx = 0usize;
        assert_eq!(
            lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut ctx, 0, 0),
            0
        );
        let names = ["sleep_20ms", "sleep_50ms", "sleep_1s", "sleep_2s"];
        let image = CString::new(simgpu_model::kernel::ptx_with_entries(&names)).unwrap();
        let mut module = 0usize;
        assert_eq!(
            lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast()
            ),
            0
        );
        let function = |name: &str| {
            let (mut f, name) = (0usize, CString::new(name).unwrap());
            assert_eq!(
                lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
                    &mut f,
                    module,
                    name.as_ptr()
                ),
                0
            );
            f
        };
        let (k20ms, k50ms, k1s, k2s) = (
            function("sleep_20ms"),
            function("sleep_50ms"),
            function("sleep_1s"),
            function("sleep_2s"),
        );
        let launch_fn: Launch = lib.f("cuLaunchKernel");
        let null = std::ptr::null_mut();
        let launch =
            |f: usize, stream: usize| launch_fn(f, 1, 1, 1, 32, 1, 1, 0, stream, null, null);
        let record: P2<usize, usize> = lib.f("cuEventRecord");
        let (mut start, mut end, mut stream) = (0usize, 0usize, 0usize);
        lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut start, 0);
        lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut end, 0);
        lib.f::<P2<*mut usize, c_uint>>("cuStreamCreate")(&mut stream, 0);
        // Events bracket the work; a kernel ahead of the start marker keeps the launch latency
        // and this thread's scheduling out of the measurement.
        let elapsed_ms = |work: &dyn Fn()| {
            assert_eq!(launch(k20ms, stream), 0);
            assert_eq!(record(start, stream), 0);
            work();
            assert_eq!(record(end, stream), 0);
            assert_eq!(lib.f::<P1<usize>>("cuStreamQuery")(stream), NOT_READY);
            assert_eq!(
                lib.f::<P1<usize>>("cuEventSynchronize")(end),
                0,
                "no timeout"
            );
            let mut ms = 0f32;
            assert_eq!(
                lib.f::<P3<*mut f32, usize, usize>>("cuEventElapsedTime")(&mut ms, start, end),
                0
            );
            ms
        };

        // One 2 s kernel: a real training kernel's length, which no driver timeout cuts short.
        let waited = Instant::now();
        let ms = elapsed_ms(&|| assert_eq!(launch(k2s, stream), 0));
        assert!((ms - 2000.0).abs() < 0.01, "a 2 s kernel took {ms} ms");
        assert!(waited.elapsed().as_secs_f64() >= 2.0);

        // Captured graphs of 50 ms and of 2 s: each is one launch, run to its end.
        let capture = |kernels: &[usize]| {
            let (mut graph, mut exec) = (0usize, 0usize);
            assert_eq!(
                lib.f::<P2<usize, c_int>>("cuStreamBeginCapture_v2")(stream, 0),
                0
            );
            for &k in kernels {
                assert_eq!(launch(k, stream), 0);
            }
            assert_eq!(
                lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph),
                0
            );
            assert_eq!(
                lib.f::<P3<*mut usize, usize, u64>>("cuGraphInstantiateWithFlags")(
                    &mut exec, graph, 0
                ),
                0
            );
            exec
        };
        let graph_launch: P2<usize, usize> = lib.f("cuGraphLaunch");
        // 2 s: a 1 s kernel and 25 kernels of 20-50 ms.
        let mut two_seconds = vec![k1s];
        two_seconds.extend([k50ms; 10]);
        two_seconds.extend([k20ms; 25]);
        for (kernels, want_ms) in [(vec![k50ms], 50.0), (two_seconds, 2000.0)] {
            let exec = capture(&kernels);
            let ms = elapsed_ms(&|| assert_eq!(graph_launch(exec, stream), 0));
            assert!(
                (ms - want_ms).abs() < 0.01,
                "a {want_ms} ms graph took {ms} ms"
            );
        }

        // The push buffer: QUEUE_DEPTH launches are accepted at once, the next ones wait for
        // the GPU to complete work (20 ms per kernel here).
        let t0 = Instant::now();
        for _ in 0..QUEUE_DEPTH {
            assert_eq!(launch(k20ms, stream), 0);
        }
        let queued = t0.elapsed();
        for _ in 0..5 {
            assert_eq!(launch(k20ms, stream), 0);
        }
        let blocked = t0.elapsed();
        eprintln!(
            "simulated: {QUEUE_DEPTH} launches in {queued:?}, 5 more returned after {blocked:?}"
        );
        // The fifth extra launch needs five completions: 100 ms of GPU time after the first
        // kernel started (which was after t0).
        assert!(blocked.as_secs_f64() >= 0.1, "returned after {blocked:?}");
        let model = sim.model();
        let snap = model.lock().unwrap().snapshot(0).unwrap();
        let c = snap
            .contexts
            .iter()
            .find(|c| c.pid == std::process::id())
            .unwrap();
        assert!(c.submitted - c.completed <= QUEUE_DEPTH as u64);
        // Destroying the context drops the ~20 s still queued.
        assert_eq!(lib.f::<P1<usize>>("cuCtxDestroy_v2")(ctx), 0);
    }
}

#[test]
fn each_launch_costs_the_calling_thread_its_host_time() {
    // 1 ms per launch (the default is 2 µs): 20 launches of 1 µs kernels take 20 ms of CPU.
    let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_LAUNCH_HOST_NS", "1000000")]);
    let started = Instant::now();
    let report = sim.run(&[
        "--kernel",
        "fixed:1us",
        "--kernels",
        "20",
        "--iterations",
        "1",
    ]);
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    let elapsed = common::f(&report, "elapsed_s");
    assert!(
        elapsed >= 0.020,
        "20 launches at 1 ms each took {elapsed} s ({:?} with start-up)",
        started.elapsed()
    );
}
