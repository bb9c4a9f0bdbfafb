//! simgpu-workload: a program shaped like a deep-learning job (bursts of kernels, CPU gaps,
//! synchronisation, allocations) that prints one JSON report. Its kernel is the portable PTX
//! `gpushare_spin_ns` (tests/simgpu/ptx/spin.ptx), so it runs on the simulated driver and on a
//! real `libcuda.so.1` alike. Figures it reports on the simulated GPU are *simulated*.

mod driver_api;
mod options;

use driver_api::Driver;
use options::{Distribution, Options, SyncStyle};
use serde_json::json;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// The portable kernel, `gpushare_spin_ns(u64 ns)`: PTX that spins on `%globaltimer` for its
/// parameter's duration on a real GPU, and whose parameter is the duration in the simulator.
/// cuModuleLoadData wants PTX text NUL-terminated.
const SPIN_PTX: &str = concat!(include_str!("../../ptx/spin.ptx"), "\0");

/// xorshift64*: deterministic per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn duration(&mut self, d: Distribution) -> u64 {
        match d {
            Distribution::Fixed(ns) => ns,
            Distribution::Uniform { low, high } => low + (self.unit() * (high - low) as f64) as u64,
            Distribution::LogNormal { median, sigma } => {
                // Box-Muller for one standard normal.
                let (u1, u2) = (self.unit().max(f64::MIN_POSITIVE), self.unit());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (median as f64 * (sigma * z).exp()) as u64
            }
        }
    }
}

#[derive(Default)]
struct Report {
    errors: BTreeMap<String, u64>,
    alloc_requested: u64,
    alloc_ok: u64,
    alloc_failed: u64,
    alloc_last_error: Option<String>,
}

impl Report {
    fn check(&mut self, driver: &Driver, what: &str, code: driver_api::CuResult) -> bool {
        if code != 0 {
            *self
                .errors
                .entry(format!("{what}: {}", driver.error_name(code)))
                .or_default() += 1;
        }
        code == 0
    }
}

/// What it takes to learn when an iteration's first kernel started running.
struct StartProbe {
    /// Recorded right after the first kernel: it completes when that kernel does.
    event: usize,
    /// `CLOCK_MONOTONIC` just before the first launch.
    requested_ns: u64,
    first_kernel_ns: u64,
}

/// One iteration whose completion has not been observed yet.
struct InFlight {
    began: Instant,
    event: usize,
    start: Option<StartProbe>,
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is handed.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let options = match Options::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("simgpu-workload: {e}");
            std::process::exit(2);
        }
    };
    let (report, ok) = run(&options);
    println!("{report}");
    std::process::exit(if ok { 0 } else { 1 });
}

fn run(o: &Options) -> (serde_json::Value, bool) {
    let driver = match Driver::load(o.per_thread_default_stream, o.graph) {
        Ok(d) => d,
        Err(e) => return (json!({"simulated": true, "fatal": e.to_string()}), false),
    };
    let mut report = Report::default();
    let d = &driver;
    let mut ctx = 0usize;
    let mut dev = 0;
    let mut function = 0usize;
    // SAFETY: here and in every unsafe call below, the entry points come from
    // cuGetProcAddress_v2 for CUDA_VERSION, and every pointer argument points at a live
    // local of the right type.
    let setup = unsafe {
        report.check(d, "cuInit", (d.init)(0))
            && report.check(d, "cuDeviceGet", (d.device_get)(&mut dev, o.device))
            && report.check(
                d,
                "cuDevicePrimaryCtxRetain",
                (d.primary_ctx_retain)(&mut ctx, dev),
            )
            && report.check(d, "cuCtxSetCurrent", (d.ctx_set_current)(ctx))
            && {
                let mut module = 0usize;
                report.check(
                    d,
                    "cuModuleLoadData",
                    (d.module_load_data)(&mut module, SPIN_PTX.as_ptr().cast()),
                ) && report.check(
                    d,
                    "cuModuleGetFunction",
                    (d.module_get_function)(&mut function, module, c"gpushare_spin_ns".as_ptr()),
                )
            }
    };
    if !setup {
        return (
            json!({"simulated": true, "fatal": "setup failed", "errors": report.errors}),
            false,
        );
    }
    let mut allocations = Vec::new();
    let mut allocate = |report: &mut Report, bytes: u64| {
        if bytes == 0 {
            return;
        }
        let mut ptr = 0u64;
        report.alloc_requested += bytes;
        let code = if o.managed {
            // SAFETY: see above; CU_MEM_ATTACH_GLOBAL.
            unsafe { (d.mem_alloc_managed)(&mut ptr, bytes as usize, 1) }
        } else {
            // SAFETY: see above.
            unsafe { (d.mem_alloc)(&mut ptr, bytes as usize) }
        };
        if code == 0 {
            report.alloc_ok += 1;
            allocations.push(ptr);
        } else {
            report.alloc_failed += 1;
            report.alloc_last_error = Some(d.error_name(code));
        }
    };
    allocate(&mut report, o.memory);

    let mut rng = Rng(o.seed.max(1));
    // `--graph`: the iteration captured once, before the barrier, into a created stream.
    let graph = match d
        .graph
        .as_ref()
        .map(|api| capture(d, api, function, o, &mut rng))
    {
        None => None,
        Some(Ok(graph)) => Some(graph),
        Some(Err((what, code))) => {
            report.check(d, what, code);
            return (
                json!({"simulated": true, "fatal": "graph capture failed", "errors": report.errors}),
                false,
            );
        }
    };
    // Where the iterations' work, events and stream synchronisation go.
    let work_stream = graph.as_ref().map_or(0, |g| g.stream);

    if let Some(barrier) = &o.start_barrier {
        while !barrier.exists() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    let sync = |report: &mut Report, event: usize| {
        // SAFETY: see above.
        unsafe {
            match o.sync {
                SyncStyle::Context => report.check(d, "cuCtxSynchronize", (d.ctx_synchronize)()),
                SyncStyle::Stream => report.check(
                    d,
                    "cuStreamSynchronize",
                    (d.stream_synchronize)(work_stream),
                ),
                SyncStyle::Event => {
                    report.check(d, "cuEventSynchronize", (d.event_synchronize)(event))
                }
            }
        };
    };
    if let Some(rate) = o.requests_per_s {
        let mut json = serve_requests(d, function, o, rate, &mut report, &mut rng, &sync);
        for ptr in allocations {
            // SAFETY: see above.
            unsafe { report.check(d, "cuMemFree", (d.mem_free)(ptr)) };
        }
        json["allocations"] = json!({
            "requested_bytes": report.alloc_requested,
            "succeeded": report.alloc_ok,
            "failed": report.alloc_failed,
            "last_error": report.alloc_last_error,
        });
        json["errors"] = json!(report.errors);
        return (json, true);
    }
    let start = Instant::now();
    let deadline = o.duration_ns.map(|ns| start + Duration::from_nanos(ns));
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut latencies_ms = Vec::new();
    let mut start_latencies_us = Vec::new();
    // Only the simulated driver can say when a kernel ran; elsewhere the report omits it.
    let event_timestamp_ns = d.event_timestamp_ns.filter(|_| o.report_start);
    let (mut iterations, mut kernels, mut kernel_ns) = (0u64, 0u64, 0u64);
    let mut finish_oldest = |report: &mut Report, in_flight: &mut VecDeque<InFlight>| {
        let Some(done) = in_flight.pop_front() else {
            return;
        };
        sync(report, done.event);
        latencies_ms.push(done.began.elapsed().as_secs_f64() * 1e3);
        if let (Some(probe), Some(timestamp)) = (done.start, event_timestamp_ns) {
            let mut completed_ns = 0u64;
            // SAFETY: the extension with a live out-pointer; the event was recorded before the
            // iteration's own event, which has completed.
            let code = unsafe { timestamp(probe.event, &mut completed_ns) };
            if report.check(d, "simgpuEventTimestampNs", code) {
                let started_ns = completed_ns.saturating_sub(probe.first_kernel_ns);
                start_latencies_us.push(started_ns.saturating_sub(probe.requested_ns) as f64 / 1e3);
            }
            // SAFETY: see above.
            unsafe { (d.event_destroy)(probe.event) };
        }
        // SAFETY: see above.
        unsafe { (d.event_destroy)(done.event) };
    };
    // An iteration's period: from its start to the next one's, CPU gap included — the
    // iteration time a training job's user sees (`latency_ms` is only its GPU phase).
    let mut previous_start: Option<Instant> = None;
    let mut periods_ms: Vec<f64> = Vec::new();
    let run_began = start;
    loop {
        if o.iterations.is_some_and(|n| iterations >= n)
            || deadline.is_some_and(|t| Instant::now() >= t)
        {
            break;
        }
        allocate(&mut report, o.memory_growth);
        let began = Instant::now();
        if let Some(previous) = previous_start.replace(began) {
            periods_ms.push((began - previous).as_secs_f64() * 1e3);
        }
        let requested_ns = monotonic_ns();
        let mut start = None;
        if let Some(g) = &graph {
            // One launch: the graph's kernels reach the device together and run back to back.
            // SAFETY: see above; the graph was instantiated from a capture on this stream.
            let launched = unsafe { (g.api.graph_launch)(g.exec, g.stream) };
            if report.check(d, "cuGraphLaunch", launched) {
                kernels += g.kernels;
                kernel_ns += g.kernel_ns;
                if event_timestamp_ns.is_some() {
                    let mut event = 0usize;
                    // SAFETY: see above.
                    let recorded = unsafe {
                        report.check(d, "cuEventCreate", (d.event_create)(&mut event, 0))
                            && report.check(
                                d,
                                "cuEventRecord",
                                (d.event_record)(event, work_stream),
                            )
                    };
                    // Recorded after the whole graph, whose kernels run back to back: its
                    // first kernel started the graph's kernel time before this completed.
                    start = recorded.then_some(StartProbe {
                        event,
                        requested_ns,
                        first_kernel_ns: g.kernel_ns,
                    });
                }
            }
        }
        // Kernel lengths may change mid-run (`--then-kernel`).
        let distribution = match o.then_kernel {
            Some((after, later)) if run_began.elapsed() >= Duration::from_nanos(after) => later,
            _ => o.distribution,
        };
        for k in (0..o.kernels).filter(|_| graph.is_none()) {
            let duration = rng.duration(distribution);
            let launched = launch(d, function, duration);
            if report.check(d, "cuLaunchKernel", launched) {
                kernels += 1;
                kernel_ns += duration;
                if k == 0 && event_timestamp_ns.is_some() {
                    let mut event = 0usize;
                    // SAFETY: see above.
                    let recorded = unsafe {
                        report.check(d, "cuEventCreate", (d.event_create)(&mut event, 0))
                            && report.check(d, "cuEventRecord", (d.event_record)(event, 0))
                    };
                    start = recorded.then_some(StartProbe {
                        event,
                        requested_ns,
                        first_kernel_ns: duration,
                    });
                }
            }
            if o.launch_ahead > 0 && (k + 1) % o.launch_ahead == 0 && k + 1 < o.kernels {
                // SAFETY: see above.
                unsafe { report.check(d, "cuStreamSynchronize", (d.stream_synchronize)(0)) };
            }
        }
        let mut event = 0usize;
        // SAFETY: see above.
        unsafe {
            report.check(d, "cuEventCreate", (d.event_create)(&mut event, 0));
            report.check(d, "cuEventRecord", (d.event_record)(event, work_stream));
        }
        in_flight.push_back(InFlight {
            began,
            event,
            start,
        });
        while in_flight.len() >= o.pipeline as usize {
            finish_oldest(&mut report, &mut in_flight);
        }
        iterations += 1;
        if o.gap_ns > 0 {
            std::thread::sleep(Duration::from_nanos(o.gap_ns));
        }
    }
    while !in_flight.is_empty() {
        finish_oldest(&mut report, &mut in_flight);
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(g) = &graph {
        // SAFETY: see above; every launch of the graph has completed.
        unsafe {
            report.check(d, "cuGraphExecDestroy", (g.api.graph_exec_destroy)(g.exec));
            report.check(d, "cuGraphDestroy", (g.api.graph_destroy)(g.graph));
            report.check(d, "cuStreamDestroy", (g.api.stream_destroy)(g.stream));
        }
    }
    for ptr in allocations {
        // SAFETY: see above.
        unsafe { report.check(d, "cuMemFree", (d.mem_free)(ptr)) };
    }
    let mut sorted = latencies_ms;
    sorted.sort_by(f64::total_cmp);
    let mean = if sorted.is_empty() {
        0.0
    } else {
        sorted.iter().sum::<f64>() / sorted.len() as f64
    };
    start_latencies_us.sort_by(f64::total_cmp);
    let period_mean = if periods_ms.is_empty() {
        0.0
    } else {
        periods_ms.iter().sum::<f64>() / periods_ms.len() as f64
    };
    periods_ms.sort_by(f64::total_cmp);
    let kernel_s = kernel_ns as f64 / 1e9;
    let mut json = json!({
        // Only the simulated driver has the extension: elsewhere the figures are real.
        "simulated": d.event_timestamp_ns.is_some(),
        "pid": std::process::id(),
        "iterations": iterations,
        "kernels": kernels,
        "elapsed_s": elapsed,
        "kernel_time_s": kernel_s,
        "throughput_iters_per_s": iterations as f64 / elapsed,
        // What the kernel durations alone allow: the GPU busy all the time with this job.
        "predicted_iters_per_s": if kernel_s > 0.0 { iterations as f64 / kernel_s } else { 0.0 },
        "seed": o.seed,
        "latency_ms": {
            "n": sorted.len(),
            "mean": mean,
            "p50": percentile(&sorted, 50.0),
            "p99": percentile(&sorted, 99.0),
            "max": sorted.last().copied().unwrap_or(0.0),
        },
        "period_ms": {
            "n": periods_ms.len(),
            "mean": period_mean,
            "p50": percentile(&periods_ms, 50.0),
            "p99": percentile(&periods_ms, 99.0),
            "max": periods_ms.last().copied().unwrap_or(0.0),
        },
        "allocations": {
            "requested_bytes": report.alloc_requested,
            "succeeded": report.alloc_ok,
            "failed": report.alloc_failed,
            "last_error": report.alloc_last_error,
        },
        "errors": report.errors,
    });
    if let Some(g) = &graph {
        json["graph"] = json!({
            "kernels": g.kernels,
            "kernel_time_ms": g.kernel_ns as f64 / 1e6,
            "launches": iterations,
        });
    }
    if event_timestamp_ns.is_some() {
        // From just before an iteration's first launch until that kernel started running on
        // the (simulated) GPU: what a neighbour's work or a scheduler's gate cost it.
        json["start_latency_us"] = json!({
            "n": start_latencies_us.len(),
            "p50": percentile(&start_latencies_us, 50.0),
            "p99": percentile(&start_latencies_us, 99.0),
            "max": start_latencies_us.last().copied().unwrap_or(0.0),
        });
    }
    (json, true)
}

/// An instantiated graph of one iteration's kernels and the stream it was captured on.
struct Graph<'d> {
    api: &'d driver_api::GraphApi,
    stream: usize,
    graph: usize,
    exec: usize,
    kernels: u64,
    /// The captured kernels' durations, summed: the GPU time of one launch.
    kernel_ns: u64,
}

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`: what the CUDA runtime and PyTorch capture with.
const CAPTURE_MODE_GLOBAL: libc::c_int = 0;

/// Captures `o.kernels` launches (durations drawn from `rng`) on a new stream into a graph
/// and instantiates it. The launches' parameters are copied at capture, as CUDA does, so
/// every launch of the graph runs the durations drawn here.
fn capture<'d>(
    d: &Driver,
    api: &'d driver_api::GraphApi,
    function: usize,
    o: &Options,
    rng: &mut Rng,
) -> Result<Graph<'d>, (&'static str, driver_api::CuResult)> {
    let check = |what: &'static str, code: driver_api::CuResult| match code {
        0 => Ok(()),
        code => Err((what, code)),
    };
    let mut g = Graph {
        api,
        stream: 0,
        graph: 0,
        exec: 0,
        kernels: 0,
        kernel_ns: 0,
    };
    // SAFETY: the entry points come from cuGetProcAddress_v2 for CUDA_VERSION; every
    // out-pointer is a live local.
    unsafe {
        check("cuStreamCreate", (api.stream_create)(&mut g.stream, 0))?;
        check(
            "cuStreamBeginCapture",
            (api.stream_begin_capture)(g.stream, CAPTURE_MODE_GLOBAL),
        )?;
        for _ in 0..o.kernels {
            let duration = rng.duration(o.distribution);
            let launched = launch_on(d, function, duration, g.stream);
            if launched != 0 {
                // Ends the (now useless) capture so the stream can be destroyed.
                let mut graph = 0usize;
                (api.stream_end_capture)(g.stream, &mut graph);
                return Err(("cuLaunchKernel (capture)", launched));
            }
            g.kernels += 1;
            g.kernel_ns += duration;
        }
        check(
            "cuStreamEndCapture",
            (api.stream_end_capture)(g.stream, &mut g.graph),
        )?;
        check(
            "cuGraphInstantiateWithFlags",
            (api.graph_instantiate)(&mut g.exec, g.graph, 0),
        )?;
    }
    Ok(g)
}

/// Launches one `gpushare_spin_ns` of `duration` ns (one warp) on the default stream.
fn launch(d: &Driver, function: usize, duration: u64) -> driver_api::CuResult {
    launch_on(d, function, duration, 0)
}

/// Launches one `gpushare_spin_ns` of `duration` ns (one warp) on `stream`.
fn launch_on(
    d: &Driver,
    function: usize,
    mut duration: u64,
    stream: usize,
) -> driver_api::CuResult {
    let mut params = [&mut duration as *mut u64 as *mut libc::c_void];
    // SAFETY: the entry point comes from cuGetProcAddress_v2; params[0] points at the u64
    // duration gpushare_spin_ns takes, alive for the call (the driver copies its parameters).
    unsafe {
        (d.launch_kernel)(
            function,
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
        )
    }
}

/// `{n, p50, p99, max}` of unsorted samples.
fn summary(mut samples: Vec<f64>) -> serde_json::Value {
    samples.sort_by(f64::total_cmp);
    json!({
        "n": samples.len(),
        "p50": percentile(&samples, 50.0),
        "p99": percentile(&samples, 99.0),
        "max": samples.last().copied().unwrap_or(0.0),
    })
}

/// Inference mode: requests arrive as a Poisson process of `rate` per second (exponential
/// inter-arrival times from a generator seeded apart from the kernel durations', so the
/// kernels are those of the training mode with the same seed). One server: a request that
/// arrives while an earlier one runs waits, and its latency counts from its scheduled arrival.
fn serve_requests(
    d: &Driver,
    function: usize,
    o: &Options,
    rate: f64,
    report: &mut Report,
    rng: &mut Rng,
    sync: &dyn Fn(&mut Report, usize),
) -> serde_json::Value {
    let mut arrivals = Rng((o.seed ^ 0x9E37_79B9_7F4A_7C15).max(1));
    let start = Instant::now();
    let deadline = o.duration_ns.map(|ns| start + Duration::from_nanos(ns));
    let mut next_arrival = start;
    let (mut requests, mut kernels, mut kernel_ns) = (0u64, 0u64, 0u64);
    let mut latencies_ms = Vec::new();
    // Request sizes from a stream of their own: the same sizes whatever the kernels draw.
    let mut sizes = Rng((o.seed ^ 0x5851_F42D_4C95_7F2D).max(1));
    let mut memory = RequestMemory::default();
    loop {
        // Exponential inter-arrival time: -ln(U) / rate, U in (0, 1].
        let u = 1.0 - arrivals.unit();
        next_arrival += Duration::from_secs_f64(-u.ln() / rate);
        if o.iterations.is_some_and(|n| requests >= n)
            || deadline.is_some_and(|t| next_arrival >= t)
        {
            break;
        }
        let now = Instant::now();
        if next_arrival > now {
            std::thread::sleep(next_arrival - now);
        }
        let buffer = match o.request_memory {
            Some(range) => match memory.allocate(d, request_bytes(&mut sizes, range)) {
                Some(ptr) => Some(ptr),
                // A request without its memory fails: it runs nothing.
                None => {
                    latencies_ms.push(next_arrival.elapsed().as_secs_f64() * 1e3);
                    requests += 1;
                    continue;
                }
            },
            None => None,
        };
        for _ in 0..o.kernels {
            let duration = rng.duration(o.distribution);
            if report.check(d, "cuLaunchKernel", launch(d, function, duration)) {
                kernels += 1;
                kernel_ns += duration;
            }
        }
        let mut event = 0usize;
        // SAFETY: the entry points come from cuGetProcAddress_v2; the out-pointer is live.
        unsafe {
            report.check(d, "cuEventCreate", (d.event_create)(&mut event, 0));
            report.check(d, "cuEventRecord", (d.event_record)(event, 0));
        }
        sync(report, event);
        // SAFETY: as above; the event is ours and complete.
        unsafe { (d.event_destroy)(event) };
        if let Some(ptr) = buffer {
            // SAFETY: as above; the request's own allocation, its kernels done.
            unsafe { report.check(d, "cuMemFree", (d.mem_free)(ptr)) };
        }
        latencies_ms.push(next_arrival.elapsed().as_secs_f64() * 1e3);
        requests += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let kernel_s = kernel_ns as f64 / 1e9;
    json!({
        // Only the simulated driver has the extension: elsewhere the figures are real.
        "simulated": d.event_timestamp_ns.is_some(),
        "pid": std::process::id(),
        "iterations": requests,
        "requests": requests,
        "requests_per_s": rate,
        "kernels": kernels,
        "elapsed_s": elapsed,
        "kernel_time_s": kernel_s,
        "throughput_iters_per_s": requests as f64 / elapsed,
        "seed": o.seed,
        "request_latency_ms": summary(latencies_ms),
        "request_memory": o.request_memory.map(|(min, max)| json!({
            "min_bytes": min,
            "max_bytes": max,
            "allocated": memory.allocated,
            "failed": memory.failed,
            "last_error": memory.last_error,
            "alloc_latency_ms": summary(std::mem::take(&mut memory.alloc_latencies_ms)),
        })),
    })
}

/// A request's size: uniform over `[min, max]`, in whole MiB (at least `min`).
fn request_bytes(rng: &mut Rng, (min, max): (u64, u64)) -> u64 {
    const MIB: u64 = 1 << 20;
    let drawn = min + (rng.unit() * (max - min) as f64) as u64;
    (drawn / MIB * MIB).clamp(min, max)
}

/// The requests' own allocations (`--request-memory`): how many, how long each took as the
/// program saw it, and the failures.
#[derive(Default)]
struct RequestMemory {
    allocated: u64,
    failed: u64,
    last_error: Option<String>,
    alloc_latencies_ms: Vec<f64>,
}

impl RequestMemory {
    fn allocate(&mut self, d: &Driver, bytes: u64) -> Option<u64> {
        let mut ptr = 0u64;
        let began = Instant::now();
        // SAFETY: the entry point comes from cuGetProcAddress_v2; the out-pointer is live.
        let code = unsafe { (d.mem_alloc)(&mut ptr, bytes as usize) };
        self.alloc_latencies_ms
            .push(began.elapsed().as_secs_f64() * 1e3);
        if code == 0 {
            self.allocated += 1;
            Some(ptr)
        } else {
            self.failed += 1;
            self.last_error = Some(d.error_name(code));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_sizes_stay_in_range_in_whole_mib_and_repeat_per_seed() {
        const MIB: u64 = 1 << 20;
        let range = (2 << 30, 6 << 30);
        let draw = |seed: u64| {
            let mut rng = Rng(seed);
            (0..200)
                .map(|_| request_bytes(&mut rng, range))
                .collect::<Vec<_>>()
        };
        let sizes = draw(7);
        assert!(sizes
            .iter()
            .all(|&b| (range.0..=range.1).contains(&b) && b % MIB == 0));
        assert!(sizes.iter().any(|&b| b > 4 << 30) && sizes.iter().any(|&b| b < 4 << 30));
        assert_eq!(sizes, draw(7), "the same seed, the same sizes");
        let mut rng = Rng(3);
        assert_eq!(request_bytes(&mut rng, (5 << 20, 5 << 20)), 5 << 20);
        // A minimum that is not whole MiB is still the least a request gets.
        assert_eq!(request_bytes(&mut rng, (1000, 1000)), 1000);
    }
}
