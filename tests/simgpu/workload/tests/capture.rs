//! Stream-capture rules as the real driver enforces them (cuda.h `cuStreamBeginCapture`,
//! `cuThreadExchangeStreamCaptureMode`; CUDA Programming Guide, "Stream Capture"): capture
//! modes, "potentially unsafe" calls from the capturing thread and from other threads,
//! context-wide synchronisation, the legacy stream's implicit dependency, invalidation.
//! The old simulator ignored every one of these: a drain's cuCtxSynchronize from another thread
//! succeeded in the middle of an application's capture. Everything runs in one test function
//! because capture rules are process-wide (a GLOBAL capture restricts every thread).

mod common;
use common::{Launch, Lib, Sim, P0, P1, P2, P3, P6};
use libc::{c_int, c_uint, c_void};
use std::ffi::CString;

const UNSUPPORTED: c_int = 900;
const INVALIDATED: c_int = 901;
const IMPLICIT: c_int = 906;
const WRONG_THREAD: c_int = 908;
const UNJOINED: c_int = 904;
/// `CU_STREAM_LEGACY`.
const LEGACY: usize = 0x1;
const GLOBAL: c_int = 0;
const THREAD_LOCAL: c_int = 1;
const RELAXED: c_int = 2;
/// `CU_STREAM_CAPTURE_STATUS_*`.
const ACTIVE: c_int = 1;
const STATUS_INVALIDATED: c_int = 2;

struct Api<'l> {
    lib: &'l Lib,
    ctx: usize,
    kernel: usize,
}

impl Api<'_> {
    fn stream(&self, flags: c_uint) -> usize {
        let mut s = 0usize;
        // SAFETY: cuStreamCreate with a live out-pointer.
        let rc = unsafe { self.lib.f::<P2<*mut usize, c_uint>>("cuStreamCreate")(&mut s, flags) };
        assert_eq!(rc, 0);
        s
    }
    fn event(&self) -> usize {
        let mut e = 0usize;
        // SAFETY: cuEventCreate with a live out-pointer.
        let rc = unsafe { self.lib.f::<P2<*mut usize, c_uint>>("cuEventCreate")(&mut e, 0) };
        assert_eq!(rc, 0);
        e
    }
    fn launch(&self, stream: usize) -> c_int {
        let null = std::ptr::null_mut();
        // SAFETY: a kernel without parameters.
        unsafe {
            self.lib.f::<Launch>("cuLaunchKernel")(
                self.kernel,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                stream,
                null,
                null,
            )
        }
    }
    fn begin(&self, stream: usize, mode: c_int) {
        // SAFETY: plain values.
        let rc = unsafe { self.lib.f::<P2<usize, c_int>>("cuStreamBeginCapture_v2")(stream, mode) };
        assert_eq!(rc, 0, "begin capture");
    }
    fn status(&self, stream: usize) -> c_int {
        let mut status = -1;
        // SAFETY: live out-pointer.
        unsafe { self.lib.f::<P2<usize, *mut c_int>>("cuStreamIsCapturing")(stream, &mut status) };
        status
    }
    /// cuStreamEndCapture's result and graph.
    fn end(&self, stream: usize) -> (c_int, usize) {
        let mut graph = usize::MAX;
        // SAFETY: live out-pointer.
        let rc = unsafe {
            self.lib.f::<P2<usize, *mut usize>>("cuStreamEndCapture")(stream, &mut graph)
        };
        (rc, graph)
    }
    fn exchange_mode(&self, mode: c_int) -> c_int {
        let mut m = mode;
        // SAFETY: live in/out pointer.
        let rc = unsafe {
            self.lib
                .f::<P1<*mut c_int>>("cuThreadExchangeStreamCaptureMode")(&mut m)
        };
        assert_eq!(rc, 0);
        m
    }
    fn ctx_sync(&self) -> c_int {
        // SAFETY: no arguments.
        unsafe { self.lib.f::<P0>("cuCtxSynchronize")() }
    }
    fn event_query(&self, e: usize) -> c_int {
        // SAFETY: plain handle.
        unsafe { self.lib.f::<P1<usize>>("cuEventQuery")(e) }
    }
    fn event_sync(&self, e: usize) -> c_int {
        // SAFETY: plain handle.
        unsafe { self.lib.f::<P1<usize>>("cuEventSynchronize")(e) }
    }
    fn record(&self, e: usize, stream: usize) -> c_int {
        // SAFETY: plain handles.
        unsafe { self.lib.f::<P2<usize, usize>>("cuEventRecord")(e, stream) }
    }
    fn stream_query(&self, s: usize) -> c_int {
        // SAFETY: plain handle.
        unsafe { self.lib.f::<P1<usize>>("cuStreamQuery")(s) }
    }
    fn alloc_free(&self) -> c_int {
        let mut p = 0u64;
        // SAFETY: live out-pointer; the allocation is freed at once.
        unsafe {
            let rc = self.lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut p, 1 << 20);
            if rc == 0 {
                assert_eq!(self.lib.f::<P1<u64>>("cuMemFree_v2")(p), 0);
            }
            rc
        }
    }
    /// Runs `body` on another thread with this context current there (and its own capture
    /// interaction mode, GLOBAL by default, as every new thread's).
    fn on_other_thread<R: Send>(&self, body: impl FnOnce(&Api) -> R + Send) -> R {
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: plain handle.
                let rc = unsafe { self.lib.f::<P1<usize>>("cuCtxSetCurrent")(self.ctx) };
                assert_eq!(rc, 0);
                body(self)
            })
            .join()
            .unwrap()
        })
    }
}

#[test]
fn capture_modes_decide_which_calls_fail_and_invalidate_the_capture() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1")]);
    let lib = Lib::open(&sim);
    // SAFETY: every call passes live out-pointers of the types cuda.h specifies.
    let api = unsafe {
        assert_eq!(lib.f::<P1<c_uint>>("cuInit")(0), 0);
        let mut ctx = 0usize;
        assert_eq!(
            lib.f::<P3<*mut usize, c_uint, c_int>>("cuCtxCreate_v2")(&mut ctx, 0, 0),
            0
        );
        let image = CString::new(simgpu_model::kernel::ptx_with_entries(&["sleep_1ms"])).unwrap();
        let mut module = 0usize;
        assert_eq!(
            lib.f::<P2<*mut usize, *const c_void>>("cuModuleLoadData")(
                &mut module,
                image.as_ptr().cast()
            ),
            0
        );
        let mut kernel = 0usize;
        assert_eq!(
            lib.f::<P3<*mut usize, usize, *const i8>>("cuModuleGetFunction")(
                &mut kernel,
                module,
                c"sleep_1ms".as_ptr()
            ),
            0
        );
        Api {
            lib: &lib,
            ctx,
            kernel,
        }
    };
    let (capturing, other, side) = (api.stream(0), api.stream(0), api.stream(1));
    let done = api.event(); // recorded outside any capture
    assert_eq!(api.launch(other), 0);
    assert_eq!(api.record(done, other), 0);
    assert_eq!(api.event_sync(done), 0, "no capture yet: allowed");

    // A drain from another thread during a GLOBAL capture: cuCtxSynchronize fails with
    // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the application's capture is invalidated.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.launch(capturing), 0);
    assert_eq!(api.on_other_thread(|a| a.ctx_sync()), UNSUPPORTED);
    assert_eq!(api.status(capturing), STATUS_INVALIDATED);
    assert_eq!(api.launch(capturing), INVALIDATED);
    assert_eq!(api.end(capturing), (INVALIDATED, 0), "no graph");
    assert_eq!(api.status(capturing), 0, "the capture is over");

    // Another thread in GLOBAL mode may not even query an unrelated event.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.on_other_thread(|a| a.event_query(done)), UNSUPPORTED);
    assert_eq!(api.end(capturing).0, INVALIDATED);
    api.begin(capturing, GLOBAL);
    assert_eq!(api.on_other_thread(|a| a.stream_query(other)), UNSUPPORTED);
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // In RELAXED mode it may: queries, waits and allocations of what is not being captured.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.launch(capturing), 0);
    let relaxed = api.on_other_thread(|a| {
        assert_eq!(a.exchange_mode(RELAXED), GLOBAL, "threads start in GLOBAL");
        let results = [
            a.event_query(done),
            a.event_sync(done),
            a.stream_query(other),
            a.alloc_free(),
        ];
        assert_eq!(a.exchange_mode(GLOBAL), RELAXED);
        results
    });
    assert_eq!(relaxed, [0, 0, 0, 0]);
    assert_eq!(api.status(capturing), ACTIVE, "undisturbed");
    let (rc, graph) = api.end(capturing);
    assert_eq!(rc, 0);
    assert_ne!(graph, 0);
    // ...but a context-wide synchronisation conflicts with any capture of the context.
    api.begin(capturing, RELAXED);
    let rc = api.on_other_thread(|a| {
        a.exchange_mode(RELAXED);
        a.ctx_sync()
    });
    assert_eq!(
        rc, UNSUPPORTED,
        "cuCtxSynchronize during a capture, whatever the modes"
    );
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // THREAD_LOCAL isolates other threads; the capturing thread itself is still restricted.
    api.begin(capturing, THREAD_LOCAL);
    let others =
        api.on_other_thread(|a| [a.event_query(done), a.alloc_free(), a.stream_query(other)]);
    assert_eq!(others, [0, 0, 0]);
    assert_eq!(api.status(capturing), ACTIVE);
    assert_eq!(
        api.alloc_free(),
        UNSUPPORTED,
        "cuMemAlloc in the capturing thread"
    );
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // A RELAXED capture restricts nobody, its own thread included.
    api.begin(capturing, RELAXED);
    assert_eq!(api.alloc_free(), 0);
    assert_eq!(api.on_other_thread(|a| a.event_sync(done)), 0);
    assert_eq!(api.end(capturing).0, 0);

    // The capturing stream itself cannot be synchronised or queried, in any mode.
    api.begin(capturing, RELAXED);
    assert_eq!(api.stream_query(capturing), UNSUPPORTED);
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // An event last recorded inside a capture is a graph node: never queryable, even relaxed.
    let captured = api.event();
    api.begin(capturing, RELAXED);
    assert_eq!(api.record(captured, capturing), 0);
    assert_eq!(api.end(capturing).0, 0);
    api.exchange_mode(RELAXED);
    assert_eq!(api.event_query(captured), UNSUPPORTED);
    assert_eq!(api.event_sync(captured), UNSUPPORTED);
    api.exchange_mode(GLOBAL);
    assert_eq!(api.record(captured, other), 0);
    assert_eq!(
        api.event_sync(captured),
        0,
        "re-recorded outside: an ordinary event again"
    );

    // Work on the legacy stream would wait for a capturing blocking stream: IMPLICIT, in
    // every mode.
    for mode in [GLOBAL, RELAXED] {
        api.begin(capturing, mode);
        assert_eq!(api.launch(0), IMPLICIT, "mode {mode}");
        assert_eq!(api.status(capturing), STATUS_INVALIDATED);
        assert_eq!(api.end(capturing).0, INVALIDATED);
    }
    // A non-blocking stream has no such dependency.
    api.begin(side, GLOBAL);
    assert_eq!(api.launch(0), 0);
    assert_eq!(api.end(side).0, 0);

    // Fork/join: waiting for an event recorded in the capture joins another stream to it;
    // the sequence ends only on its origin, and on every stream at once.
    let forked = api.stream(0);
    let (fork, join) = (api.event(), api.event());
    let wait: P3<usize, usize, c_uint> = lib.f("cuStreamWaitEvent");
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    assert_eq!(api.status(forked), ACTIVE, "joined the capture");
    assert_eq!(api.launch(forked), 0);
    assert_eq!(
        api.end(forked).0,
        903,
        "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"
    );
    assert_eq!(api.record(join, forked), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(capturing, join, 0) }, 0);
    assert_eq!(api.end(capturing).0, 0);
    assert_eq!(api.status(forked), 0, "ended everywhere");
    // A drain during a multi-stream capture breaks all of it.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    assert_eq!(api.on_other_thread(|a| a.ctx_sync()), UNSUPPORTED);
    assert_eq!(api.status(forked), STATUS_INVALIDATED);
    assert_eq!(api.end(capturing).0, INVALIDATED);
    assert_eq!(api.status(forked), 0);

    // A fork whose work is never joined back into the origin: cuStreamEndCapture fails with
    // CUDA_ERROR_STREAM_CAPTURE_UNJOINED, returns no graph, and ends it on every stream.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    assert_eq!(api.launch(forked), 0);
    assert_eq!(api.launch(capturing), 0);
    assert_eq!(api.end(capturing), (UNJOINED, 0));
    assert_eq!(api.status(forked), 0, "ended everywhere");
    // Joined back before the fork's last node is not joined either.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    assert_eq!(api.launch(forked), 0);
    assert_eq!(api.record(join, forked), 0);
    assert_eq!(api.launch(forked), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(capturing, join, 0) }, 0);
    assert_eq!(api.end(capturing).0, UNJOINED);
    // A joined stream that added nothing needs no join; and a join through a third stream
    // counts (the origin follows what the third stream followed).
    let relay = api.stream(1);
    let relayed = api.event();
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(relay, fork, 0) }, 0);
    assert_eq!(api.launch(relay), 0);
    assert_eq!(api.record(relayed, relay), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, relayed, 0) }, 0);
    assert_eq!(api.launch(forked), 0);
    assert_eq!(api.record(join, forked), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(capturing, join, 0) }, 0);
    let (rc, graph) = api.end(capturing);
    assert_eq!(rc, 0, "joined through the relay");
    assert_ne!(graph, 0);

    // Recording an event into a joined stream makes it part of the capture: waiting for it
    // (what a drain that took the joined stream for an idle one would do) fails in every
    // mode and invalidates the whole sequence.
    let drained = api.event();
    api.begin(capturing, GLOBAL);
    assert_eq!(api.record(fork, capturing), 0);
    // SAFETY: plain handles.
    assert_eq!(unsafe { wait(forked, fork, 0) }, 0);
    let rc = api.on_other_thread(|a| {
        a.exchange_mode(RELAXED);
        [a.record(drained, forked), a.event_sync(drained)]
    });
    assert_eq!(rc, [0, UNSUPPORTED]);
    assert_eq!(api.status(capturing), STATUS_INVALIDATED);
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // Asked about the legacy stream while a blocking stream of its context captures (in any
    // mode), cuStreamIsCapturing answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and leaves the
    // capture alone; while only a non-blocking stream captures, it answers NONE.
    for mode in [GLOBAL, RELAXED] {
        api.begin(capturing, mode);
        let mut status = -1;
        // SAFETY: live out-pointer.
        let rc =
            unsafe { lib.f::<P2<usize, *mut c_int>>("cuStreamIsCapturing")(LEGACY, &mut status) };
        assert_eq!(rc, IMPLICIT, "mode {mode}");
        assert_eq!(api.status(capturing), ACTIVE, "not invalidated");
        assert_eq!(api.end(capturing).0, 0);
    }
    api.begin(side, GLOBAL);
    assert_eq!(api.status(LEGACY), 0);
    assert_eq!(api.end(side).0, 0);

    // A GLOBAL capture ends in the thread that began it.
    api.begin(capturing, GLOBAL);
    assert_eq!(api.on_other_thread(|a| a.end(capturing).0), WRONG_THREAD);
    assert_eq!(api.end(capturing).0, 0);

    // The CUDA 10.0 entry point, without a mode, captures in GLOBAL mode.
    // SAFETY: plain handle.
    let rc = unsafe { lib.f::<P1<usize>>("cuStreamBeginCapture")(capturing) };
    assert_eq!(rc, 0);
    assert_eq!(api.on_other_thread(|a| a.event_query(done)), UNSUPPORTED);
    assert_eq!(api.end(capturing).0, INVALIDATED);

    // cuStreamGetCaptureInfo(_v2) and cuStreamGetCtx, as an interposer asks before draining.
    let info = |stream: usize| {
        let (mut status, mut id, mut graph) = (-1, 0u64, 0usize);
        let (mut deps, mut n) = (std::ptr::null::<usize>(), usize::MAX);
        // SAFETY: live out-pointers of the CUDA 11.3 signature.
        let rc = unsafe {
            lib.f::<P6<usize, *mut c_int, *mut u64, *mut usize, *mut *const usize, *mut usize>>(
                "cuStreamGetCaptureInfo_v2",
            )(stream, &mut status, &mut id, &mut graph, &mut deps, &mut n)
        };
        assert_eq!(rc, 0);
        (status, id, graph, n)
    };
    assert_eq!(info(capturing).0, 0);
    api.begin(capturing, THREAD_LOCAL);
    let (status, first_id, graph, n) = info(capturing);
    assert_eq!((status, n), (ACTIVE, 0));
    assert!(first_id != 0 && graph != 0);
    assert_eq!(api.launch(capturing), 0);
    assert_eq!(info(capturing).3, 1, "one dependency after a node");
    let mut ctx = 0usize;
    // SAFETY: live out-pointer.
    let rc = unsafe { lib.f::<P2<usize, *mut usize>>("cuStreamGetCtx")(capturing, &mut ctx) };
    assert_eq!(rc, 0);
    assert_eq!(ctx, api.ctx);
    assert_eq!(api.end(capturing).0, 0);
    api.begin(capturing, THREAD_LOCAL);
    assert_ne!(info(capturing).1, first_id, "each capture has its own id");
    assert_eq!(api.end(capturing).0, 0);
    assert_eq!(api.ctx_sync(), 0, "no capture left");
}
