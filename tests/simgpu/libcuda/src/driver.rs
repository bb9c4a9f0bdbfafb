//! The process-local side of the simulated driver: handles, the per-thread context stack,
//! streams and what each object is charged, on top of the shared device model.
//!
//! Lock order: the process-local `State` mutex, then the shared device mutex. Nobody sleeps
//! while holding either: waiting for the GPU happens after both are released.

use crate::handles::{Kind, Slab};
use crate::result::{CuResult, CudaError};
use simgpu_model::contents::{DeviceImage, ImageError};
use simgpu_model::device::{ContextId, ProcessId, Waiter};
use simgpu_model::kernel::{KernelDuration, ModuleImage};
use simgpu_model::shared::{StoredConfig, MAX_GPUS, NO_EVENT};
use simgpu_model::{Device, DeviceError, SimConfig};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

/// `CU_STREAM_LEGACY`: the legacy default stream, whatever the compilation mode.
pub const STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub const STREAM_PER_THREAD: usize = 0x2;
/// First device address handed out; an arbitrary, recognisable range like the real driver's.
const VA_BASE: u64 = 0x7f10_0000_0000;

/// Where device address `ptr` (a valid one, at or above [`VA_BASE`]) lives in the process's
/// memory image: addresses are per process, linear and never reused, so one offset each.
pub fn image_offset(ptr: u64) -> u64 {
    ptr - VA_BASE
}

/// A memory image that cannot be read or written: the call fails as the driver's own
/// failures do, and the reason goes to stderr (the CUDA result cannot carry it).
pub fn image_failed(e: ImageError) -> CudaError {
    eprintln!("simgpu: {e}");
    CudaError::Unknown
}
const ALLOC_ALIGN: u64 = 512;

pub struct Context {
    pub id: ContextId,
    pub gpu: u32,
    pub flags: u32,
    pub primary: bool,
    /// Completion count of the last operation on the legacy default stream.
    pub legacy_last: u64,
}

#[derive(Default, Clone, Copy)]
pub struct Primary {
    pub handle: usize,
    pub retains: u32,
    pub flags: u32,
}

/// `CU_STREAM_NON_BLOCKING`: a stream that does not synchronise with the legacy stream.
pub const STREAM_NON_BLOCKING: u32 = 0x1;

/// `CU_CTX_SCHED_MASK` and `CU_CTX_SCHED_BLOCKING_SYNC` of a context's flags.
const CTX_SCHED_MASK: u32 = 0x7;
const CTX_SCHED_BLOCKING_SYNC: u32 = 0x4;
/// `CU_EVENT_BLOCKING_SYNC`.
pub const EVENT_BLOCKING_SYNC: u32 = 0x1;

/// How a synchronisation waits, as the real driver decides it (cuda.h `cuCtxCreate`,
/// `cuEventCreate`): a thread blocks (sleeps) when the context was made with
/// `CU_CTX_SCHED_BLOCKING_SYNC` or, in `cuEventSynchronize`, when the event was created with
/// `CU_EVENT_BLOCKING_SYNC`; otherwise (`AUTO`, the default, `SPIN`, `YIELD`) it spins or
/// yields, on the CPU for the whole wait. `event_flags` is `None` for a stream or context
/// synchronisation.
pub fn waiter_for(ctx_flags: u32, event_flags: Option<u32>) -> Waiter {
    let blocking_context = ctx_flags & CTX_SCHED_MASK == CTX_SCHED_BLOCKING_SYNC;
    let blocking_event = event_flags.is_some_and(|f| f & EVENT_BLOCKING_SYNC != 0);
    if blocking_context || blocking_event {
        Waiter::Block
    } else {
        Waiter::Spin
    }
}

/// `CUstreamCaptureMode`: how a capture restricts "potentially unsafe" API calls
/// (cuda.h, `cuStreamBeginCapture` / `cuThreadExchangeStreamCaptureMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// Unsafe calls are prohibited in the capturing thread and, in every thread whose own
    /// interaction mode is GLOBAL, while any GLOBAL capture is under way in the process.
    Global = 0,
    /// Unsafe calls are prohibited only in the thread that began the capture.
    ThreadLocal = 1,
    /// Nothing is prohibited (the caller promises it knows what it does).
    Relaxed = 2,
}

impl CaptureMode {
    pub fn from_raw(raw: i32) -> CuResult<CaptureMode> {
        match raw {
            0 => Ok(CaptureMode::Global),
            1 => Ok(CaptureMode::ThreadLocal),
            2 => Ok(CaptureMode::Relaxed),
            _ => Err(CudaError::InvalidValue),
        }
    }
}

/// A stream capture sequence, as seen from one of its streams: the stream that began it (the
/// origin) or one it joined through `cuStreamWaitEvent` on an event recorded in it (fork/join
/// capture); they share the graph and the id.
#[derive(Clone)]
pub struct Capture {
    /// The graph it records into.
    pub graph: usize,
    /// `cuStreamGetCaptureInfo`'s id: unique per process.
    pub id: u64,
    pub mode: CaptureMode,
    /// The thread that called `cuStreamBeginCapture`.
    pub thread: ThreadId,
    /// An illegal operation broke it: everything on the stream now fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` until `cuStreamEndCapture`, which returns no
    /// graph.
    pub invalidated: bool,
    /// The stream that began the sequence (only there can it end).
    pub origin: bool,
    /// How much of each stream's captured work this stream's next node comes after: stream
    /// handle → the number of nodes that stream had added (a stream's own entry counts its
    /// own nodes). It grows by a node added here and by waiting for an event recorded in the
    /// capture; the sequence is joined when its origin comes after every joined stream's
    /// last node (else `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` at its end).
    pub follows: BTreeMap<usize, u64>,
}

impl Capture {
    /// Merges what an event recorded in the same capture came after (a join).
    pub fn follow(&mut self, event: &BTreeMap<usize, u64>) {
        for (&stream, &nodes) in event {
            let entry = self.follows.entry(stream).or_default();
            *entry = (*entry).max(nodes);
        }
    }
}

pub struct Stream {
    pub ctx: usize,
    pub last: u64,
    pub flags: u32,
    pub priority: i32,
    /// The capture sequence under way on this stream.
    pub capture: Option<Capture>,
}

pub struct Event {
    pub ctx: usize,
    pub slot: u32,
    pub flags: u32,
    /// The capture (its id) the event was last recorded in: such an event is a graph node, not
    /// a point in a stream, and cannot be queried or waited for.
    pub captured: Option<u64>,
    /// What the recording stream's capture came after then (see [`Capture::follows`]).
    pub capture_follows: BTreeMap<usize, u64>,
}

pub struct Module {
    pub ctx: usize,
    pub image: ModuleImage,
    /// Device memory charged for the module's lazily loaded code (0 until its first launch).
    pub loaded_bytes: u64,
}

pub struct Function {
    pub duration: KernelDuration,
    pub module: usize,
}

/// What a captured stream recorded: the durations of its operations, in order, and its memory
/// allocation nodes (`cuMemAllocAsync` during the capture).
#[derive(Clone, Default)]
pub struct Graph {
    pub nodes: Vec<u64>,
    /// (address, bytes) of each allocation node.
    pub allocs: Vec<(u64, u64)>,
    /// Addresses the graph frees itself (a `cuMemFreeAsync` node).
    pub frees: Vec<u64>,
    /// The GPU its allocation nodes live on, and the context that captured it.
    pub gpu: Option<u32>,
    pub ctx: usize,
}

/// The graph memory pool of one GPU (`cuDeviceGetGraphMemAttribute`): allocation nodes draw
/// from it when their graph is launched, and memory the pool reserved stays reserved (charged
/// to the process) after the launch until `cuDeviceGraphMemTrim` or the end of the context.
#[derive(Default, Clone, Copy)]
pub struct GraphPool {
    pub reserved: u64,
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocKind {
    Device,
    Managed,
    /// From a memory pool (`cuMemAllocAsync` / `cuMemAllocFromPoolAsync`).
    Pool(usize),
    /// Made by an allocation node of a launched graph, from the GPU's graph memory pool.
    Graph,
}

#[derive(Debug, Clone, Copy)]
pub struct Allocation {
    pub size: u64,
    pub gpu: u32,
    pub ctx: usize,
    pub kind: AllocKind,
}

/// Device memory held by an array or mipmapped array.
pub struct Charge {
    pub gpu: u32,
    pub bytes: u64,
    pub ctx: usize,
}

/// A stream-ordered memory pool. Freed blocks stay reserved (charged to the device) until a
/// synchronisation trims the pool to its release threshold, as the real pools do.
pub struct Pool {
    pub gpu: u32,
    pub reserved: u64,
    pub used: u64,
    pub release_threshold: u64,
    pub reserved_high: u64,
    pub used_high: u64,
}

/// A physical allocation of the virtual memory management API (`cuMemCreate`).
pub struct Physical {
    /// `None` for host-located memory, which the device does not charge.
    pub gpu: Option<u32>,
    pub size: u64,
    pub released: bool,
    pub mappings: u32,
    /// `CUmemAllocationProp::requestedHandleTypes`: what it may be exported as.
    pub handle_types: u32,
    /// Registered in the shared model once exported or imported: the model then keeps the
    /// bytes charged to the exporter until every process's reference is gone.
    pub shared: Option<simgpu_model::device::SharedAllocId>,
}

pub struct Mapping {
    pub size: u64,
    pub physical: u64,
}

pub struct State {
    pub contexts: Slab<Context>,
    pub primary: [Primary; MAX_GPUS],
    pub streams: Slab<Stream>,
    pub events: Slab<Event>,
    pub modules: Slab<Module>,
    pub functions: Slab<Function>,
    pub graphs: Slab<Graph>,
    pub graph_execs: Slab<Graph>,
    pub allocations: BTreeMap<u64, Allocation>,
    pub arrays: Slab<Charge>,
    pub mipmapped: Slab<Charge>,
    pub pools: Slab<Pool>,
    pub default_pools: [usize; MAX_GPUS],
    pub current_pools: [usize; MAX_GPUS],
    pub physical: BTreeMap<u64, Physical>,
    pub next_physical: u64,
    pub reservations: BTreeMap<u64, u64>,
    pub mappings: BTreeMap<u64, Mapping>,
    pub graph_pools: [GraphPool; MAX_GPUS],
    next_va: u64,
    next_capture_id: u64,
}

impl State {
    fn new() -> State {
        State {
            contexts: Slab::new(Kind::Context),
            primary: [Primary::default(); MAX_GPUS],
            streams: Slab::new(Kind::Stream),
            events: Slab::new(Kind::Event),
            modules: Slab::new(Kind::Module),
            functions: Slab::new(Kind::Function),
            graphs: Slab::new(Kind::Graph),
            graph_execs: Slab::new(Kind::GraphExec),
            allocations: BTreeMap::new(),
            arrays: Slab::new(Kind::Array),
            mipmapped: Slab::new(Kind::MipmappedArray),
            pools: Slab::new(Kind::MemPool),
            default_pools: [0; MAX_GPUS],
            current_pools: [0; MAX_GPUS],
            physical: BTreeMap::new(),
            next_physical: 1,
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            graph_pools: [GraphPool::default(); MAX_GPUS],
            next_va: VA_BASE,
            next_capture_id: 1,
        }
    }

    pub fn next_capture_id(&mut self) -> u64 {
        let id = self.next_capture_id;
        self.next_capture_id += 1;
        id
    }

    /// A fresh, aligned device address range of `size` bytes (never reused in a process).
    pub fn take_va(&mut self, size: u64, align: u64) -> u64 {
        let align = align.max(ALLOC_ALIGN).next_power_of_two();
        let base = self.next_va.div_ceil(align) * align;
        self.next_va = base + size.max(1) + ALLOC_ALIGN;
        base
    }

    pub fn context(&self, handle: usize) -> CuResult<&Context> {
        self.contexts.get(handle).ok_or(CudaError::InvalidContext)
    }

    /// Whether `[ptr, ptr + len)` lies inside memory this process can address on the device.
    pub fn is_device_range(&self, ptr: u64, len: u64) -> bool {
        let end = ptr.saturating_add(len);
        let inside = |base: u64, size: u64| ptr >= base && end <= base + size;
        self.allocations
            .range(..=ptr)
            .next_back()
            .is_some_and(|(b, a)| inside(*b, a.size))
            || self
                .mappings
                .range(..=ptr)
                .next_back()
                .is_some_and(|(b, m)| inside(*b, m.size))
    }
}

/// Where an operation goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamTarget {
    Legacy(usize),
    PerThread(usize),
    Created(usize),
}

pub struct Driver {
    pub device: Device,
    pub process: ProcessId,
    pub config: StoredConfig,
    /// Model GPU index of each device ordinal (see `visible_gpus`).
    visible: Vec<u32>,
    state: Mutex<State>,
    /// This process's device memory image, open, with the model's `images_moved` count it was
    /// opened at (a checkpoint and a restore move it: reopened by name afterwards).
    image: Mutex<Option<(u64, Arc<DeviceImage>)>>,
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

thread_local! {
    /// The thread's context stack; the top is the current context.
    static CONTEXT_STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// Completion count of the last operation on this thread's default stream, per context.
    static PER_THREAD_LAST: RefCell<Vec<(usize, u64)>> = const { RefCell::new(Vec::new()) };
    /// This thread's capture interaction mode (`cuThreadExchangeStreamCaptureMode`); CUDA
    /// starts every thread in GLOBAL.
    static THREAD_CAPTURE_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// Swaps the calling thread's capture interaction mode, returning the previous one.
pub fn exchange_thread_capture_mode(mode: CaptureMode) -> CaptureMode {
    THREAD_CAPTURE_MODE.with(|m| m.replace(mode))
}

pub fn thread_capture_mode() -> CaptureMode {
    THREAD_CAPTURE_MODE.with(|m| m.get())
}

/// `cuInit`: attach to the shared device once per process. A failure is remembered, as the real
/// driver remembers it.
pub fn init() -> CuResult<&'static Driver> {
    DRIVER.get_or_init(Driver::attach).as_ref().map_err(|e| *e)
}

/// The driver, if `cuInit` succeeded.
pub fn driver() -> CuResult<&'static Driver> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        _ => Err(CudaError::NotInitialized),
    }
}

thread_local! {
    /// Exports this thread is inside (one may call another).
    static CALL_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// One export's run, as the real driver's API locks see it: while another process has this
/// one locked or checkpointed (`cuCheckpointProcessLock`), an export waits on entry until it
/// is unlocked; meanwhile it is counted in flight, so that a lock waits for it to leave. Only
/// the outermost export of a thread counts (an inner one must not wait for a lock that waits
/// for its caller).
pub struct ApiCall {
    counted: Option<&'static Driver>,
}

impl ApiCall {
    pub fn enter() -> ApiCall {
        let outermost = CALL_DEPTH.with(|d| {
            d.set(d.get() + 1);
            d.get() == 1
        });
        let counted = driver().ok().filter(|_| outermost);
        if let Some(d) = counted {
            d.device.enter_call(d.process);
        }
        ApiCall { counted }
    }
}

impl Drop for ApiCall {
    fn drop(&mut self) {
        if let Some(d) = self.counted {
            d.device.leave_call(d.process);
        }
        CALL_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

pub fn current_context() -> Option<usize> {
    CONTEXT_STACK.with(|s| s.borrow().last().copied())
}

pub fn set_current_context(ctx: Option<usize>) {
    CONTEXT_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if let Some(c) = ctx {
            s.push(c);
        }
    })
}

pub fn push_context(ctx: usize) {
    CONTEXT_STACK.with(|s| s.borrow_mut().push(ctx))
}

pub fn pop_context() -> Option<usize> {
    CONTEXT_STACK.with(|s| s.borrow_mut().pop())
}

/// Removes a destroyed context from this thread's stack (other threads find it invalid).
pub fn forget_context_on_this_thread(ctx: usize) {
    CONTEXT_STACK.with(|s| s.borrow_mut().retain(|c| *c != ctx));
}

fn per_thread_last(ctx: usize) -> u64 {
    PER_THREAD_LAST.with(|m| {
        m.borrow()
            .iter()
            .find(|(c, _)| *c == ctx)
            .map_or(0, |(_, n)| *n)
    })
}

fn set_per_thread_last(ctx: usize, count: u64) {
    PER_THREAD_LAST.with(|m| {
        let mut m = m.borrow_mut();
        match m.iter_mut().find(|(c, _)| *c == ctx) {
            Some(entry) => entry.1 = entry.1.max(count),
            None => m.push((ctx, count)),
        }
    })
}

impl Driver {
    fn attach() -> Result<Driver, CudaError> {
        let config = SimConfig::from_env().map_err(|_| CudaError::NotInitialized)?;
        let device = Device::open(&config).map_err(|_| CudaError::NoDevice)?;
        let process = device
            .lock()
            .and_then(|mut l| l.attach_process())
            .map_err(|_| CudaError::NoDevice)?;
        let config = device.config();
        let visible = simgpu_model::config::visible_gpus(
            config.gpus,
            std::env::var("NVIDIA_VISIBLE_DEVICES").ok().as_deref(),
        )
        .map_err(|_| CudaError::NoDevice)?;
        Ok(Driver {
            device,
            process,
            config,
            visible,
            state: Mutex::new(State::new()),
            image: Mutex::new(None),
        })
    }

    /// The process's device memory image (`simgpu_model::contents`), opened once and again
    /// after each checkpoint or restore moved it. Calls hold a reference only while they run,
    /// and a checkpoint lock waits for every call to leave, so no call straddles a move.
    pub fn device_image(&self) -> CuResult<Arc<DeviceImage>> {
        let moved = self.device.images_moved(self.process);
        let mut cached = self.image.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, image)) = cached.as_ref() {
            if *at == moved {
                return Ok(Arc::clone(image));
            }
        }
        let image = Arc::new(
            self.device
                .images()
                .open_device(self.process)
                .map_err(image_failed)?,
        );
        *cached = Some((moved, Arc::clone(&image)));
        Ok(image)
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding it (caught by the export guard) must not wedge the process.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn gpu_count(&self) -> u32 {
        self.visible.len() as u32
    }

    /// The model GPU behind a device ordinal (a `CUdevice` is its ordinal).
    pub fn check_gpu(&self, dev: i32) -> CuResult<u32> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.visible.get(d).copied())
            .ok_or(CudaError::InvalidDevice)
    }

    /// The device ordinal of a model GPU this process can see.
    pub fn ordinal_of(&self, gpu: u32) -> CuResult<i32> {
        self.visible
            .iter()
            .position(|&g| g == gpu)
            .map(|o| o as i32)
            .ok_or(CudaError::InvalidDevice)
    }

    /// The current context, or `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn current(&self, state: &State) -> CuResult<usize> {
        let ctx = current_context().ok_or(CudaError::InvalidContext)?;
        state.context(ctx)?;
        Ok(ctx)
    }

    /// Resolves a `CUstream` argument. `per_thread_default` is true for the `_ptsz`/`_ptds`
    /// entry points, where stream 0 means the calling thread's default stream.
    pub fn resolve_stream(
        &self,
        state: &State,
        raw: usize,
        per_thread_default: bool,
    ) -> CuResult<StreamTarget> {
        match raw {
            0 if per_thread_default => Ok(StreamTarget::PerThread(self.current(state)?)),
            0 | STREAM_LEGACY => Ok(StreamTarget::Legacy(self.current(state)?)),
            STREAM_PER_THREAD => Ok(StreamTarget::PerThread(self.current(state)?)),
            h => {
                let s = state.streams.get(h).ok_or(CudaError::InvalidHandle)?;
                state.context(s.ctx)?;
                Ok(StreamTarget::Created(h))
            }
        }
    }

    pub fn target_context(&self, state: &State, target: StreamTarget) -> CuResult<usize> {
        match target {
            StreamTarget::Legacy(c) | StreamTarget::PerThread(c) => Ok(c),
            StreamTarget::Created(h) => {
                Ok(state.streams.get(h).ok_or(CudaError::InvalidHandle)?.ctx)
            }
        }
    }

    /// The capture under way on `target`, if any (active or invalidated, until it ends).
    pub fn capturing<'s>(&self, state: &'s State, target: StreamTarget) -> Option<&'s Capture> {
        match target {
            StreamTarget::Created(h) => state.streams.get(h).and_then(|s| s.capture.as_ref()),
            _ => None,
        }
    }

    /// Invalidates the captures of the streams in `streams`.
    /// Invalidates the captures under way on `streams`: the whole capture sequence, on every
    /// stream it has joined.
    pub fn invalidate(state: &mut State, streams: &[usize]) {
        let ids: Vec<u64> = streams
            .iter()
            .filter_map(|&h| state.streams.get(h).and_then(|s| s.capture.as_ref()))
            .map(|c| c.id)
            .collect();
        Self::invalidate_ids(state, &ids);
    }

    pub fn invalidate_ids(state: &mut State, ids: &[u64]) {
        let streams: Vec<usize> = state.streams.iter().map(|(h, _)| h).collect();
        for h in streams {
            if let Some(c) = state.streams.get_mut(h).and_then(|s| s.capture.as_mut()) {
                if ids.contains(&c.id) {
                    c.invalidated = true;
                }
            }
        }
    }

    /// The rule for "potentially unsafe" API calls (memory allocation and free, synchronous
    /// queries and waits) during stream capture, as `cuStreamBeginCapture` documents it: a
    /// thread whose interaction mode is not RELAXED may not make them while a non-RELAXED
    /// capture it began itself is under way, nor, when its mode is GLOBAL, while any GLOBAL
    /// capture is under way in the process. Such a call fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the captures it conflicts with,
    /// so the application finds out at `cuStreamEndCapture` (the real driver's behaviour, and
    /// why an interposer that queries or synchronises from its own thread breaks a PyTorch
    /// capture in its default `capture_error_mode="global"`).
    pub fn check_unsafe_call(&self, state: &mut State) -> CuResult<()> {
        let mine = thread_capture_mode();
        if mine == CaptureMode::Relaxed {
            return Ok(());
        }
        let me = std::thread::current().id();
        let conflicts: Vec<usize> = state
            .streams
            .iter()
            .filter(|(_, s)| {
                s.capture.as_ref().is_some_and(|c| {
                    c.mode != CaptureMode::Relaxed
                        && (c.thread == me
                            || (c.mode == CaptureMode::Global && mine == CaptureMode::Global))
                })
            })
            .map(|(h, _)| h)
            .collect();
        if conflicts.is_empty() {
            return Ok(());
        }
        Self::invalidate(state, &conflicts);
        Err(CudaError::StreamCaptureUnsupported)
    }

    /// A context-wide synchronisation waits for every stream of the context, which a capturing
    /// stream cannot be waited for: it fails, and invalidates those captures, whatever the
    /// modes (`cuCtxSynchronize` during any capture of the context).
    pub fn check_context_sync(&self, state: &mut State, ctx: usize) -> CuResult<()> {
        let capturing: Vec<usize> = state
            .streams
            .iter()
            .filter(|(_, s)| s.ctx == ctx && s.capture.is_some())
            .map(|(h, _)| h)
            .collect();
        if capturing.is_empty() {
            return Ok(());
        }
        Self::invalidate(state, &capturing);
        Err(CudaError::StreamCaptureUnsupported)
    }

    /// Work on the legacy default stream waits for every blocking stream of its context; if
    /// one of them is capturing, in any mode ("the legacy stream is in an unusable state until
    /// the blocking stream capture is terminated", cuda.h `cuStreamIsCapturing`), that
    /// dependency cannot be captured: the work fails with `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`
    /// and the capture is invalidated.
    pub fn check_legacy_work(&self, state: &mut State, target: StreamTarget) -> CuResult<()> {
        let StreamTarget::Legacy(ctx) = target else {
            return Ok(());
        };
        let implicit: Vec<usize> = state
            .streams
            .iter()
            .filter(|(_, s)| {
                s.ctx == ctx && s.flags & STREAM_NON_BLOCKING == 0 && s.capture.is_some()
            })
            .map(|(h, _)| h)
            .collect();
        if implicit.is_empty() {
            return Ok(());
        }
        Self::invalidate(state, &implicit);
        Err(CudaError::StreamCaptureImplicit)
    }

    /// Synchronising or querying `target` itself while it captures is illegal in every mode
    /// and invalidates its capture; any other stream falls under the unsafe-call rule.
    pub fn check_stream_wait(&self, state: &mut State, target: StreamTarget) -> CuResult<()> {
        if let StreamTarget::Created(h) = target {
            if state.streams.get(h).is_some_and(|s| s.capture.is_some()) {
                Self::invalidate(state, &[h]);
                return Err(CudaError::StreamCaptureUnsupported);
            }
        }
        self.check_unsafe_call(state)
    }

    /// Busy time the calling thread spends in the driver per launch (see
    /// `simgpu_model::config::DEFAULT_LAUNCH_HOST_NS`): spun, not slept, as the driver's own
    /// work is CPU work.
    pub fn launch_host_cost(&self) {
        let cost = self.config.launch_host_ns;
        if cost == 0 {
            return;
        }
        let end = simgpu_model::now_ns() + cost;
        while simgpu_model::now_ns() < end {
            std::hint::spin_loop();
        }
    }

    /// Completion count `target` must reach for all its work so far to be done.
    pub fn stream_last(&self, state: &State, target: StreamTarget) -> CuResult<(ContextId, u64)> {
        let ctx = self.target_context(state, target)?;
        let id = state.context(ctx)?.id;
        let last = match target {
            StreamTarget::Legacy(c) => state.context(c)?.legacy_last,
            StreamTarget::PerThread(c) => per_thread_last(c),
            StreamTarget::Created(h) => state.streams.get(h).ok_or(CudaError::InvalidHandle)?.last,
        };
        Ok((id, last))
    }

    /// Queues operations on a stream (or records them into the graph it is capturing).
    /// Blocks while the context's queue is full, like a full pushbuffer.
    /// `kernels`: the operations are kernels (a launch, or a graph's nodes), which reach the
    /// device a launch latency after submission; copies start as soon as the GPU is free.
    pub fn enqueue(
        &self,
        raw_stream: usize,
        per_thread_default: bool,
        durations: &[u64],
        kernels: bool,
    ) -> CuResult<()> {
        let (target, ctx_id) = {
            let mut state = self.state();
            let target = self.resolve_stream(&state, raw_stream, per_thread_default)?;
            if let Some(c) = self.capturing(&state, target) {
                if c.invalidated {
                    return Err(CudaError::StreamCaptureInvalidated);
                }
                let graph = c.graph;
                let g = state
                    .graphs
                    .get_mut(graph)
                    .ok_or(CudaError::StreamCaptureInvalidated)?;
                g.nodes.extend_from_slice(durations);
                if let StreamTarget::Created(h) = target {
                    if let Some(c) = state.streams.get_mut(h).and_then(|s| s.capture.as_mut()) {
                        *c.follows.entry(h).or_default() += durations.len() as u64;
                    }
                }
                return Ok(());
            }
            self.check_legacy_work(&mut state, target)?;
            let ctx = self.target_context(&state, target)?;
            (target, state.context(ctx)?.id)
        };
        let mut last = 0;
        for &d in durations {
            last = self.submit_blocking(ctx_id, d, kernels)?;
        }
        if durations.is_empty() {
            return Ok(());
        }
        let mut state = self.state();
        self.note_submitted(&mut state, target, last);
        Ok(())
    }

    pub fn note_submitted(&self, state: &mut State, target: StreamTarget, count: u64) {
        match target {
            StreamTarget::Legacy(c) => {
                if let Some(ctx) = state.contexts.get_mut(c) {
                    ctx.legacy_last = ctx.legacy_last.max(count);
                }
            }
            StreamTarget::PerThread(c) => set_per_thread_last(c, count),
            StreamTarget::Created(h) => {
                if let Some(s) = state.streams.get_mut(h) {
                    s.last = s.last.max(count);
                }
            }
        }
    }

    pub fn submit_blocking(&self, ctx: ContextId, duration_ns: u64, kernel: bool) -> CuResult<u64> {
        loop {
            let result = {
                let mut locked = self.device.lock()?;
                if kernel {
                    locked.submit_kernel(ctx, duration_ns)
                } else {
                    locked.submit(ctx, duration_ns, NO_EVENT)
                }
            };
            match result {
                Ok(count) => return Ok(count),
                Err(DeviceError::QueueFull { completed }) => {
                    self.device.wait_until_completed(ctx, completed)?
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits for `count` operations of `ctx`, then lets memory pools give back what they cached
    /// (the release threshold applies at synchronisation points).
    pub fn wait(&self, ctx: ContextId, count: u64) -> CuResult<()> {
        self.wait_by(ctx, count, Waiter::Prompt)
    }

    /// [`Driver::wait`] for an API synchronisation, which waits as `waiter` says (see
    /// [`waiter_for`]).
    pub fn wait_by(&self, ctx: ContextId, count: u64, waiter: Waiter) -> CuResult<()> {
        self.device.wait_until_completed_by(ctx, count, waiter)?;
        self.trim_pools_to_threshold();
        Ok(())
    }

    pub fn trim_pools_to_threshold(&self) {
        let mut state = self.state();
        let handles: Vec<usize> = state.pools.iter().map(|(h, _)| h).collect();
        for h in handles {
            let keep = state.pools.get(h).map_or(0, |p| p.release_threshold);
            let _ = self.trim_pool(&mut state, h, keep);
        }
    }

    /// Releases cached (reserved but unused) bytes of a pool down to `keep` reserved bytes.
    pub fn trim_pool(&self, state: &mut State, pool: usize, keep: u64) -> CuResult<()> {
        let p = state.pools.get_mut(pool).ok_or(CudaError::InvalidValue)?;
        let target = keep.max(p.used);
        if p.reserved > target {
            let release = p.reserved - target;
            p.reserved = target;
            let gpu = p.gpu;
            self.device
                .lock()?
                .release_memory(self.process, gpu, release)?;
        }
        Ok(())
    }

    /// Charges device memory and hands out an address.
    pub fn allocate(
        &self,
        state: &mut State,
        ctx: usize,
        size: u64,
        kind: AllocKind,
    ) -> CuResult<u64> {
        if size == 0 {
            return Err(CudaError::InvalidValue);
        }
        let gpu = state.context(ctx)?.gpu;
        self.device
            .lock()?
            .reserve_memory(self.process, gpu, size)?;
        let ptr = state.take_va(size, ALLOC_ALIGN);
        state.allocations.insert(
            ptr,
            Allocation {
                size,
                gpu,
                ctx,
                kind,
            },
        );
        Ok(ptr)
    }

    pub fn free(&self, state: &mut State, ptr: u64) -> CuResult<Allocation> {
        let a = *state.allocations.get(&ptr).ok_or(CudaError::InvalidValue)?;
        if let AllocKind::Pool(_) | AllocKind::Graph = a.kind {
            // Pool memory goes back through cuMemFreeAsync; the real driver also accepts
            // cuMemFree here, synchronising first.
            return self.free_to_pool(state, ptr);
        }
        state.allocations.remove(&ptr);
        self.device
            .lock()?
            .release_memory(self.process, a.gpu, a.size)?;
        Ok(a)
    }

    pub fn free_to_pool(&self, state: &mut State, ptr: u64) -> CuResult<Allocation> {
        let a = state
            .allocations
            .remove(&ptr)
            .ok_or(CudaError::InvalidValue)?;
        if a.kind == AllocKind::Graph {
            // Back to the graph memory pool, which keeps it reserved.
            let pool = &mut state.graph_pools[a.gpu as usize];
            pool.used = pool.used.saturating_sub(a.size);
            return Ok(a);
        }
        let AllocKind::Pool(pool) = a.kind else {
            state.allocations.insert(ptr, a);
            return self.free(state, ptr);
        };
        if let Some(p) = state.pools.get_mut(pool) {
            p.used = p.used.saturating_sub(a.size);
        } else {
            // The pool was destroyed under a live allocation: release directly.
            self.device
                .lock()?
                .release_memory(self.process, a.gpu, a.size)?;
        }
        Ok(a)
    }

    /// Allocates from a pool, reusing its cached bytes before charging the device for more.
    pub fn allocate_from_pool(
        &self,
        state: &mut State,
        ctx: usize,
        pool: usize,
        size: u64,
    ) -> CuResult<u64> {
        if size == 0 {
            return Err(CudaError::InvalidValue);
        }
        let p = state.pools.get(pool).ok_or(CudaError::InvalidValue)?;
        let gpu = p.gpu;
        let cached = p.reserved - p.used;
        let grow = size.saturating_sub(cached);
        if grow > 0 {
            self.device
                .lock()?
                .reserve_memory(self.process, gpu, grow)?;
        }
        let p = state.pools.get_mut(pool).ok_or(CudaError::InvalidValue)?;
        p.reserved += grow;
        p.used += size;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
        let ptr = state.take_va(size, ALLOC_ALIGN);
        state.allocations.insert(
            ptr,
            Allocation {
                size,
                gpu,
                ctx,
                kind: AllocKind::Pool(pool),
            },
        );
        Ok(ptr)
    }

    /// A launched graph's allocation nodes: memory comes from the GPU's graph memory pool,
    /// which grows (charging the device; `CUDA_ERROR_OUT_OF_MEMORY` if it cannot) when what it
    /// has reserved and not in use is not enough, and keeps what it reserved afterwards. An
    /// allocation the graph also frees is back in the pool when the launch returns; one it does
    /// not free stays allocated (a live address) until `cuMemFree(Async)`.
    pub fn run_graph_allocations(&self, g: &Graph) -> CuResult<()> {
        let Some(gpu) = g.gpu else {
            return Ok(());
        };
        if g.allocs.is_empty() {
            return Ok(());
        }
        let mut state = self.state();
        // The previous launch's allocations must have been freed first (the real driver
        // refuses to launch a graph whose allocations are still live).
        if g.allocs
            .iter()
            .any(|(p, _)| state.allocations.contains_key(p))
        {
            return Err(CudaError::InvalidValue);
        }
        let total: u64 = g.allocs.iter().map(|(_, size)| size).sum();
        let pool = state.graph_pools[gpu as usize];
        let grow = total.saturating_sub(pool.reserved - pool.used);
        if grow > 0 {
            self.charge(gpu, grow)?;
        }
        let freed_inside: u64 = g
            .allocs
            .iter()
            .filter(|(p, _)| g.frees.contains(p))
            .map(|(_, size)| size)
            .sum();
        let pool = &mut state.graph_pools[gpu as usize];
        pool.reserved += grow;
        pool.used += total;
        pool.reserved_high = pool.reserved_high.max(pool.reserved);
        pool.used_high = pool.used_high.max(pool.used);
        pool.used -= freed_inside;
        for &(ptr, size) in g.allocs.iter().filter(|(p, _)| !g.frees.contains(p)) {
            state.allocations.insert(
                ptr,
                Allocation {
                    size,
                    gpu,
                    ctx: g.ctx,
                    kind: AllocKind::Graph,
                },
            );
        }
        Ok(())
    }

    /// `cuDeviceGraphMemTrim`: the graph pool gives back what it reserved and does not use.
    pub fn trim_graph_pool(&self, state: &mut State, gpu: u32) -> CuResult<()> {
        let pool = &mut state.graph_pools[gpu as usize];
        let release = pool.reserved - pool.used;
        pool.reserved = pool.used;
        if release > 0 {
            self.credit(gpu, release)?;
        }
        Ok(())
    }

    pub fn default_pool(&self, state: &mut State, gpu: u32) -> usize {
        let slot = &mut state.default_pools[gpu as usize];
        if *slot == 0 {
            *slot = state.pools.insert(Pool {
                gpu,
                reserved: 0,
                used: 0,
                release_threshold: 0,
                reserved_high: 0,
                used_high: 0,
            });
        }
        let pool = state.default_pools[gpu as usize];
        if state.current_pools[gpu as usize] == 0 {
            state.current_pools[gpu as usize] = pool;
        }
        pool
    }

    pub fn charge(&self, gpu: u32, bytes: u64) -> CuResult<()> {
        Ok(self
            .device
            .lock()?
            .reserve_memory(self.process, gpu, bytes)?)
    }

    pub fn credit(&self, gpu: u32, bytes: u64) -> CuResult<()> {
        Ok(self
            .device
            .lock()?
            .release_memory(self.process, gpu, bytes)?)
    }

    /// Unloads a module: its lazily loaded memory goes back, its functions become invalid.
    pub fn unload_module(&self, state: &mut State, module: usize) -> CuResult<()> {
        let m = state
            .modules
            .remove(module)
            .ok_or(CudaError::InvalidHandle)?;
        let functions: Vec<usize> = state
            .functions
            .iter()
            .filter(|(_, f)| f.module == module)
            .map(|(h, _)| h)
            .collect();
        for f in functions {
            state.functions.remove(f);
        }
        if m.loaded_bytes > 0 {
            if let Ok(c) = state.context(m.ctx) {
                self.credit(c.gpu, m.loaded_bytes)?;
            }
        }
        Ok(())
    }

    /// The lazy loading of a function's module at its first launch: charges the module's
    /// memory to the device, or fails with `CUDA_ERROR_OUT_OF_MEMORY` as a real lazily loaded
    /// launch does on a full GPU.
    pub fn load_for_launch(&self, state: &mut State, function: usize) -> CuResult<()> {
        let module = state
            .functions
            .get(function)
            .ok_or(CudaError::InvalidHandle)?
            .module;
        let m = state.modules.get(module).ok_or(CudaError::InvalidHandle)?;
        let bytes = self.config.module_memory_bytes;
        if m.loaded_bytes > 0 || bytes == 0 {
            return Ok(());
        }
        let gpu = state.context(m.ctx)?.gpu;
        self.charge(gpu, bytes)?;
        state
            .modules
            .get_mut(module)
            .expect("looked up above")
            .loaded_bytes = bytes;
        Ok(())
    }

    /// Destroys a context: its queued work is dropped and the memory allocated in it freed.
    pub fn destroy_context(&self, state: &mut State, ctx: usize) -> CuResult<()> {
        let c = state
            .contexts
            .remove(ctx)
            .ok_or(CudaError::InvalidContext)?;
        let _ = self.device.lock()?.destroy_context(c.id);
        let modules: Vec<usize> = state
            .modules
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(h, _)| h)
            .collect();
        for m in modules {
            if let Some(m) = state.modules.remove(m) {
                if m.loaded_bytes > 0 {
                    self.credit(c.gpu, m.loaded_bytes)?;
                }
            }
        }
        let owned: Vec<u64> = state
            .allocations
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(p, _)| *p)
            .collect();
        for ptr in owned {
            if let Some(a) = state.allocations.remove(&ptr) {
                match a.kind {
                    AllocKind::Pool(pool) if state.pools.get(pool).is_some() => {
                        if let Some(p) = state.pools.get_mut(pool) {
                            p.used = p.used.saturating_sub(a.size);
                        }
                    }
                    AllocKind::Graph => {
                        let pool = &mut state.graph_pools[a.gpu as usize];
                        pool.used = pool.used.saturating_sub(a.size);
                    }
                    _ => self.credit(a.gpu, a.size)?,
                }
            }
        }
        for slab in [&mut state.arrays, &mut state.mipmapped] {
            let owned: Vec<usize> = slab
                .iter()
                .filter(|(_, c)| c.ctx == ctx)
                .map(|(h, _)| h)
                .collect();
            for h in owned {
                if let Some(c) = slab.remove(h) {
                    self.credit(c.gpu, c.bytes)?;
                }
            }
        }
        let streams: Vec<usize> = state
            .streams
            .iter()
            .filter(|(_, s)| s.ctx == ctx)
            .map(|(h, _)| h)
            .collect();
        for h in streams {
            state.streams.remove(h);
        }
        let events: Vec<usize> = state
            .events
            .iter()
            .filter(|(_, e)| e.ctx == ctx)
            .map(|(h, _)| h)
            .collect();
        for h in events {
            state.events.remove(h);
        }
        // The graph memory pool's reservation lasts until the context ends.
        let still_used = state.contexts.iter().any(|(_, other)| other.gpu == c.gpu);
        if !still_used {
            let pool = std::mem::take(&mut state.graph_pools[c.gpu as usize]);
            if pool.reserved > 0 {
                self.credit(c.gpu, pool.reserved)?;
            }
        }
        forget_context_on_this_thread(ctx);
        Ok(())
    }

    pub fn create_context(
        &self,
        state: &mut State,
        gpu: u32,
        flags: u32,
        primary: bool,
    ) -> CuResult<usize> {
        let id = self.device.lock()?.create_context(self.process, gpu)?;
        Ok(state.contexts.insert(Context {
            id,
            gpu,
            flags,
            primary,
            legacy_last: 0,
        }))
    }

    /// Duration of a launch of `function` with `kernel_params` (the `void**` of cuLaunchKernel)
    /// or `extra` (the packed-buffer form).
    ///
    /// # Safety
    /// `kernel_params` and `extra` must be NULL or follow the cuLaunchKernel contract.
    pub unsafe fn kernel_duration(
        &self,
        state: &State,
        function: usize,
        kernel_params: *mut *mut libc::c_void,
        extra: *mut *mut libc::c_void,
    ) -> CuResult<u64> {
        let f = state
            .functions
            .get(function)
            .ok_or(CudaError::InvalidHandle)?;
        match f.duration {
            KernelDuration::Fixed(ns) => Ok(ns),
            KernelDuration::Default => Ok(self.config.default_kernel_ns),
            // SAFETY: the caller passes the launch's own parameter arrays.
            KernelDuration::FirstParam => unsafe { first_u64_param(kernel_params, extra) },
        }
    }
}

/// `CU_LAUNCH_PARAM_END`, `CU_LAUNCH_PARAM_BUFFER_POINTER`, `CU_LAUNCH_PARAM_BUFFER_SIZE`.
const LAUNCH_PARAM_END: usize = 0;
const LAUNCH_PARAM_BUFFER_POINTER: usize = 1;
const LAUNCH_PARAM_BUFFER_SIZE: usize = 2;

/// The first kernel parameter as a `u64`, from either the `kernelParams` array (each entry
/// points at one argument) or the `extra` packed buffer.
///
/// # Safety
/// Both must be NULL or laid out as cuLaunchKernel specifies.
unsafe fn first_u64_param(
    kernel_params: *mut *mut libc::c_void,
    extra: *mut *mut libc::c_void,
) -> CuResult<u64> {
    // SAFETY: per the cuLaunchKernel contract, kernelParams[0] points at the first argument,
    // which for gpushare_spin_ns is a u64; `extra` is a (key, value) list ending with
    // CU_LAUNCH_PARAM_END whose buffer holds the packed arguments.
    unsafe {
        if !kernel_params.is_null() {
            let first = *kernel_params;
            if first.is_null() {
                return Err(CudaError::InvalidValue);
            }
            return Ok((first as *const u64).read_unaligned());
        }
        if !extra.is_null() {
            let (mut buffer, mut size) = (std::ptr::null::<u8>(), 0usize);
            let mut i = 0;
            loop {
                let key = *extra.add(i) as usize;
                match key {
                    LAUNCH_PARAM_END => break,
                    LAUNCH_PARAM_BUFFER_POINTER => buffer = *extra.add(i + 1) as *const u8,
                    LAUNCH_PARAM_BUFFER_SIZE => size = *(*extra.add(i + 1) as *const usize),
                    _ => return Err(CudaError::InvalidValue),
                }
                i += 2;
            }
            if !buffer.is_null() && size >= 8 {
                return Ok((buffer as *const u64).read_unaligned());
            }
        }
    }
    Err(CudaError::InvalidValue)
}

impl From<simgpu_model::lock::LockError> for CudaError {
    fn from(_: simgpu_model::lock::LockError) -> CudaError {
        CudaError::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synchronisation_blocks_only_where_the_context_or_the_event_asks_for_it() {
        // (context flags, event flags, waiter)
        let cases = [
            (0x0, None, Waiter::Spin),        // CU_CTX_SCHED_AUTO
            (0x1, None, Waiter::Spin),        // CU_CTX_SCHED_SPIN
            (0x2, None, Waiter::Spin),        // CU_CTX_SCHED_YIELD
            (0x4, None, Waiter::Block),       // CU_CTX_SCHED_BLOCKING_SYNC
            (0x4 | 0x8, None, Waiter::Block), // ... with CU_CTX_MAP_HOST
            (0x8, None, Waiter::Spin),        // CU_CTX_MAP_HOST alone: AUTO
            (0x0, Some(0x0), Waiter::Spin),   // a default event
            (0x0, Some(0x2), Waiter::Spin),   // CU_EVENT_DISABLE_TIMING
            (0x0, Some(0x1), Waiter::Block),  // CU_EVENT_BLOCKING_SYNC
            (0x0, Some(0x3), Waiter::Block),  // ... | CU_EVENT_DISABLE_TIMING
            (0x4, Some(0x0), Waiter::Block),  // a blocking context
        ];
        for (ctx, event, want) in cases {
            assert_eq!(
                waiter_for(ctx, event),
                want,
                "context {ctx:#x}, event {event:?}"
            );
        }
    }
}
