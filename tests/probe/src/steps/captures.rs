//! Steps that build CUDA graphs: stream capture in each mode (and into a graphics command
//! list), a capture forked and joined across two streams, the graphs launched.

use crate::{fatal, num, Launch11, Probe, H, R};
use std::ffi::{c_int, c_uint, c_void};
use std::time::{Duration, Instant};

/// Room for a `CUstreamCigCaptureParams` (cuda.h: a type and a pointer).
const CIG_CAPTURE_PARAMS_BYTES: usize = 16;

pub(crate) fn graph(p: &mut Probe) {
    let c = &p.cuda;
    let create: unsafe extern "C" fn(*mut H, c_uint) -> R = c.get("cuStreamCreate");
    let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
    let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
    let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
        c.get("cuGraphInstantiateWithFlags");
    let launch: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
    let launch_kernel: Launch11 = c.get("cuLaunchKernel");
    let (mut stream, mut graph, mut exec) = (0, 0, 0);
    let mut ns = 1000u64;
    let mut params = [&mut ns as *mut u64 as *mut c_void];
    // SAFETY: each function has its cuda.h signature; the out-pointers are live
    // locals of the handle types they write, the kernel's one parameter points at
    // the live local `ns`, and handles from a failed step are only values the
    // driver rejects.
    let rc = unsafe {
        create(&mut stream, 1)
            .max(begin(stream, 0))
            .max(launch_kernel(
                p.function,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ))
            .max(end(stream, &mut graph))
            .max(instantiate(&mut exec, graph, 0))
            .max(launch(exec, stream))
    };
    p.report("graph", rc, "");
}

pub(crate) fn capture_begin(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // `capture-begin global|thread-local|relaxed`: a non-blocking stream starts
    // capturing in that mode (PyTorch captures on such a stream, GLOBAL mode).
    let c = &p.cuda;
    let mode = match args.next().as_deref() {
        Some("global") => 0,
        Some("thread-local") => 1,
        Some("relaxed") => 2,
        other => fatal(&format!(
            "capture-begin global|thread-local|relaxed, not {other:?}"
        )),
    };
    let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
    let stream = p.new_stream(1);
    // SAFETY: a stream this probe created; the mode is one of CUstreamCaptureMode's values.
    let rc = unsafe { begin(stream, mode) };
    p.capture = Some((stream, 0));
    p.report("capture-begin", rc, &format!("mode={mode}"));
}

pub(crate) fn cig_capture_begin(p: &mut Probe) {
    // CUDA 13.2 (run with --cuda-version 13020): a non-blocking stream starts
    // capturing into a graphics command list (zeroed parameters: none of the
    // simulated driver's concern).
    let c = &p.cuda;
    let begin: unsafe extern "C" fn(H, *mut c_void) -> R = c.get("cuStreamBeginCaptureToCig");
    let stream = p.new_stream(1);
    let mut params = [0u8; CIG_CAPTURE_PARAMS_BYTES];
    // SAFETY: a stream this probe created and live CUstreamCigCaptureParams.
    let rc = unsafe { begin(stream, params.as_mut_ptr().cast()) };
    p.capture = Some((stream, 0));
    p.report("cig-capture-begin", rc, "");
}

pub(crate) fn cig_capture_end(p: &mut Probe) {
    let c = &p.cuda;
    let end: unsafe extern "C" fn(H) -> R = c.get("cuStreamEndCaptureToCig");
    let (stream, _) = p
        .capture
        .take()
        .unwrap_or_else(|| fatal("cig-capture-end before cig-capture-begin"));
    // SAFETY: cuStreamEndCaptureToCig of the stream this probe began capturing.
    let rc = unsafe { end(stream) };
    p.report("cig-capture-end", rc, "");
}

pub(crate) fn capture_launch(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let c = &p.cuda;
    let n = num(args);
    let f: Launch11 = c.get("cuLaunchKernel");
    let (stream, _) = p
        .capture
        .unwrap_or_else(|| fatal("capture-launch before capture-begin"));
    let rc = (0..n)
        .map(|_| p.kernel_on(f, 1000, stream))
        .max()
        .unwrap_or(0);
    p.report("capture-launch", rc, &format!("kernels={n}"));
}

pub(crate) fn capture_end(p: &mut Probe) {
    // Ends the capture; a valid graph is instantiated, launched and waited for.
    let c = &p.cuda;
    let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
    let is_capturing: unsafe extern "C" fn(H, *mut c_int) -> R = c.get("cuStreamIsCapturing");
    let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
        c.get("cuGraphInstantiateWithFlags");
    let launch: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let (stream, _) = p
        .capture
        .unwrap_or_else(|| fatal("capture-end before capture-begin"));
    let mut status = -1;
    // SAFETY: cuStreamIsCapturing, given a stream this probe created and a live
    // CUstreamCaptureStatus (an int) to write.
    unsafe { is_capturing(stream, &mut status) };
    let mut graph = 0;
    // SAFETY: cuStreamEndCapture, given that stream and a live CUgraph to write.
    let rc = unsafe { end(stream, &mut graph) };
    let mut ran = -1;
    if rc == 0 {
        let mut exec = 0;
        // SAFETY: cuGraphInstantiateWithFlags writes a live CUgraphExec; the graph
        // is the one the driver just returned and the stream the capture's.
        ran = unsafe {
            instantiate(&mut exec, graph, 0)
                .max(launch(exec, stream))
                .max(sync(stream))
        };
    }
    p.capture = None;
    p.report(
        "capture-end",
        rc,
        &format!("status_before={status} graph_ran={ran}"),
    );
}

pub(crate) fn capture_join(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    let n = num(args);
    capture_fork_join(p, "capture-join", n, None);
}

pub(crate) fn capture_join_at(p: &mut Probe, args: &mut impl Iterator<Item = String>) {
    // `capture-join-at N TOUCH WAIT`: capture-join that touches TOUCH once the side
    // stream has joined and has work in the capture, and waits for WAIT before
    // joining back (tests revoke the token there).
    let n = num(args);
    let touch = args
        .next()
        .unwrap_or_else(|| fatal("capture-join-at N TOUCH WAIT"));
    let wait = args
        .next()
        .unwrap_or_else(|| fatal("capture-join-at N TOUCH WAIT"));
    capture_fork_join(p, "capture-join-at", n, Some((touch, wait)));
}

/// `capture-join N`: a multi-stream graph capture, as `torch.cuda.Stream.wait_stream`,
/// DDP's overlap and MoE side streams make one. A non-blocking stream begins a GLOBAL
/// capture (PyTorch's default) and launches; an event recorded there is waited for by a
/// second stream, which so joins the capture (fork); both launch N kernels in all; the
/// second stream's last event is waited for by the first (join); the capture ends, and the
/// graph is instantiated, launched and waited for. The side stream is a blocking one (what
/// `cuStreamCreate(…, 0)` and `cudaStreamCreate` make), so the legacy stream may not be
/// touched while it is joined.
///
/// Prints `capture-join <first failure> kernels=N joined=<cuStreamIsCapturing status of the
/// side stream after it joined> at=<the call that failed first, or none> graph_ran=<result>`.
fn capture_fork_join(p: &Probe, step: &str, n: u64, pause: Option<(String, String)>) {
    let c = &p.cuda;
    let begin: unsafe extern "C" fn(H, c_int) -> R = c.get("cuStreamBeginCapture");
    let end: unsafe extern "C" fn(H, *mut H) -> R = c.get("cuStreamEndCapture");
    let event_create: unsafe extern "C" fn(*mut H, c_uint) -> R = c.get("cuEventCreate");
    let record: unsafe extern "C" fn(H, H) -> R = c.get("cuEventRecord");
    let wait_event: unsafe extern "C" fn(H, H, c_uint) -> R = c.get("cuStreamWaitEvent");
    let is_capturing: unsafe extern "C" fn(H, *mut c_int) -> R = c.get("cuStreamIsCapturing");
    let instantiate: unsafe extern "C" fn(*mut H, H, u64) -> R =
        c.get("cuGraphInstantiateWithFlags");
    let launch_graph: unsafe extern "C" fn(H, H) -> R = c.get("cuGraphLaunch");
    let sync: unsafe extern "C" fn(H) -> R = c.get("cuStreamSynchronize");
    let launch: Launch11 = c.get("cuLaunchKernel");
    let (origin, side) = (p.new_stream(1), p.new_stream(0));
    let (mut fork, mut join) = (0, 0);
    // SAFETY: cuEventCreate, given live CUevent locals to write (CU_EVENT_DISABLE_TIMING).
    let created = unsafe { event_create(&mut fork, 2).max(event_create(&mut join, 2)) };
    if created != 0 {
        fatal(&format!("cuEventCreate: {}", p.name(created)));
    }
    let mut first = (0, "none");
    let mut check = |rc: R, what: &'static str| {
        if rc != 0 && first.0 == 0 {
            first = (rc, what);
        }
    };
    let mut joined = -1;
    // SAFETY: each call has its cuda.h signature and gets streams and events this probe
    // created and live locals to write; the kernel's parameter is set up by `kernel_on`.
    unsafe {
        check(begin(origin, 0), "cuStreamBeginCapture");
        check(p.kernel_on(launch, 1000, origin), "cuLaunchKernel(origin)");
        check(record(fork, origin), "cuEventRecord(fork)");
        check(wait_event(side, fork, 0), "cuStreamWaitEvent(fork)");
        check(is_capturing(side, &mut joined), "cuStreamIsCapturing(side)");
        check(p.kernel_on(launch, 1000, side), "cuLaunchKernel(side)");
    }
    if let Some((touch, wait)) = pause {
        std::fs::write(&touch, b"").unwrap_or_else(|e| fatal(&format!("{touch}: {e}")));
        let start = Instant::now();
        while !std::path::Path::new(&wait).exists() {
            if start.elapsed() > Duration::from_secs(60) {
                fatal(&format!("{wait} never appeared"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut graph = 0;
    // SAFETY: as above.
    unsafe {
        for _ in 1..n {
            check(p.kernel_on(launch, 1000, origin), "cuLaunchKernel(origin)");
            check(p.kernel_on(launch, 1000, side), "cuLaunchKernel(side)");
        }
        check(record(join, side), "cuEventRecord(join)");
        check(wait_event(origin, join, 0), "cuStreamWaitEvent(join)");
        check(end(origin, &mut graph), "cuStreamEndCapture");
    }
    let mut ran = -1;
    if first.0 == 0 {
        let mut exec = 0;
        // SAFETY: cuGraphInstantiateWithFlags writes a live CUgraphExec; the graph is the one
        // the driver just returned and the stream the capture's.
        ran = unsafe {
            instantiate(&mut exec, graph, 0)
                .max(launch_graph(exec, origin))
                .max(sync(origin))
        };
    }
    p.report(
        step,
        first.0,
        &format!("kernels={n} joined={joined} at={} graph_ran={ran}", first.1),
    );
}
