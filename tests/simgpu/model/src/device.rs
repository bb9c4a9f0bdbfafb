//! Operations on the shared device model: processes, contexts, queues, events, memory.
//!
//! Every operation takes the shared mutex, reads the clock, and advances the GPU it touches to
//! that instant before acting, so the model is exact whatever the callers' timing.

use crate::contents::Images;
use crate::liveness::{LivenessError, OwnerLocks};
use crate::lock::Acquired;
use crate::pidns::PidNamespace;
use crate::shared::{
    EventSlot, GpuState, Queue, QueuedOp, Region, SharedError, SharedState, StoredConfig,
    UtilBucket, EVENTS_PER_CONTEXT, MAX_CONTEXTS, MAX_PROCESSES, MAX_SHARED_ALLOCS, NO_EVENT,
    OP_COPY, OP_KERNEL, QUEUE_DEPTH, SLOT_FREE, SLOT_LIVE, UTIL_BUCKETS, UTIL_BUCKET_NS,
};
use crate::timeslice::{self, Cursor, OpSource, Progress, SliceParams};
use crate::{now_ns, SimConfig};
use std::sync::atomic::{AtomicU64, Ordering};

/// How often any process checks for dead owners on its own.
const REAP_INTERVAL_NS: u64 = 100_000_000;
/// Longest a waiter sleeps before looking again (new work or a dead neighbour can change the
/// prediction).
pub(crate) const MAX_WAIT_SLICE_NS: u64 = 5_000_000;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Shared(#[from] SharedError),
    #[error(transparent)]
    Liveness(#[from] LivenessError),
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
    #[error("no free {0} slot in the simulated device")]
    NoFreeSlot(&'static str),
    #[error("GPU {0} does not exist")]
    InvalidGpu(u32),
    #[error("the context was destroyed or its process died")]
    StaleContext,
    #[error("the process slot is no longer ours")]
    StaleProcess,
    #[error("out of device memory: {requested} bytes requested, {free} free")]
    OutOfMemory { requested: u64, free: u64 },
    #[error("the context's queue is full until {completed} operations have completed")]
    QueueFull { completed: u64 },
    #[error("unknown event slot")]
    InvalidEvent,
    #[error("the shared allocation no longer exists")]
    StaleSharedAlloc,
    #[error(transparent)]
    Image(#[from] crate::contents::ImageError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    pub slot: u32,
    pub generation: u64,
}

/// The owner of a shared allocation whose exporter exited while others held it.
const NO_OWNER: u32 = u32::MAX;

/// A physical allocation registered for sharing between processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedAllocId {
    pub slot: u32,
    pub generation: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContextId {
    pub slot: u32,
    pub generation: u64,
}

/// What a recorded event knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventState {
    /// Never recorded: CUDA treats it as complete.
    pub recorded: bool,
    pub complete: bool,
    pub completed_at_ns: u64,
    /// Completion count the context must reach for the event to be complete.
    pub recorded_count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    pub slot: u32,
    /// Pid in the process's own namespace.
    pub pid: u32,
    pub ns: PidNamespace,
    pub memory_bytes: u64,
    pub contexts: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextInfo {
    pub slot: u32,
    pub process_slot: u32,
    pub pid: u32,
    pub gpu_time_ns: u64,
    pub submitted: u64,
    pub completed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSnapshot {
    pub index: u32,
    /// Physical memory (NVML's `total`).
    pub memory_total: u64,
    /// What the driver keeps for itself (NVML v2's `reserved`): never allocatable.
    pub memory_reserved: u64,
    /// Allocated by processes (contexts, modules, allocations), without `memory_reserved`.
    pub memory_used: u64,
    /// Total time the GPU has executed operations since the state was created.
    pub busy_ns: u64,
    /// Percent of the last second (or less, for a new state) the GPU was busy.
    pub utilization_percent: u32,
    pub switches: u64,
    pub now_ns: u64,
    pub processes: Vec<ProcessUsage>,
    pub contexts: Vec<ContextInfo>,
}

/// What one process did on one GPU over the utilisation periods a query covers (NVML's
/// per-process samples, `nvmlDeviceGetProcessUtilization`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessActivity {
    /// Pid in the process's own namespace.
    pub pid: u32,
    pub ns: PidNamespace,
    /// Time its kernels ran in the covered periods.
    pub kernel_ns: u64,
    /// Time its copies and memsets ran in the covered periods.
    pub copy_ns: u64,
    /// The covered periods it had a context in, summed (what the times are shares of).
    pub period_ns: u64,
    /// End of the latest covered period it ran anything in (device time, `crate::clock`).
    pub last_active_end_ns: u64,
}

/// This process's view of the shared device.
pub struct Device {
    pub(crate) region: Region,
    /// The descriptor through which this process holds its own owner byte.
    claim: OwnerLocks,
    /// A second descriptor to ask about others (OFD locks never conflict with their holder).
    observe: OwnerLocks,
    last_reap_ns: AtomicU64,
    /// The processes' memory contents (`SIMGPU_DIR/memory`).
    images: Images,
}

impl Device {
    pub fn open(config: &SimConfig) -> Result<Device, DeviceError> {
        let region = Region::open(&config.dir, config, now_ns())?;
        let owners = config.dir.join("owners.lock");
        Ok(Device {
            region,
            claim: OwnerLocks::open(&owners)?,
            observe: OwnerLocks::open(&owners)?,
            last_reap_ns: AtomicU64::new(0),
            images: Images::open(&config.dir)?,
        })
    }

    /// Where the processes' memory contents are kept.
    pub fn images(&self) -> &Images {
        &self.images
    }

    /// The configuration fixed when the state was created.
    pub fn config(&self) -> StoredConfig {
        // SAFETY: the configuration is written once before the state is published and never
        // changes afterwards, so reading it without the mutex races with nothing.
        unsafe { (*self.region.state_ptr()).config }
    }

    pub fn lock(&self) -> Result<Locked<'_>, DeviceError> {
        let state_ptr = self.region.state_ptr();
        // SAFETY: the mutex is initialised (the state is published) and lives in the mapping.
        let acquired = unsafe { (*state_ptr).mutex.lock()? };
        // SAFETY: we hold the process-shared mutex, which is what guards every other field; the
        // reference lives no longer than the guard, which unlocks on drop.
        let state = unsafe { &mut *state_ptr };
        let mut locked = Locked {
            device: self,
            state,
            now_ns: now_ns(),
        };
        let due = locked
            .now_ns
            .saturating_sub(self.last_reap_ns.load(Ordering::Relaxed))
            > REAP_INTERVAL_NS;
        if acquired == Acquired::PreviousOwnerDied || due {
            self.last_reap_ns.store(locked.now_ns, Ordering::Relaxed);
            locked.reap_dead();
        }
        Ok(locked)
    }

    /// Blocks until `count` operations of `ctx` have completed.
    ///
    /// Sleeps until the model's own prediction of the completion (a lower bound: new work from
    /// others can only delay it), then checks again; so waking is as exact as the OS allows.
    pub fn wait_until_completed(&self, ctx: ContextId, count: u64) -> Result<(), DeviceError> {
        self.wait_until_completed_by(ctx, count, Waiter::Prompt)
    }

    /// Blocks until `count` operations of `ctx` have completed, waiting the way `waiter`
    /// says: as a synchronisation that spins (burning the caller's CPU the whole time), that
    /// blocks (asleep until the completion), or the prompt hybrid of the pushbuffer waits.
    pub fn wait_until_completed_by(
        &self,
        ctx: ContextId,
        count: u64,
        waiter: Waiter,
    ) -> Result<(), DeviceError> {
        loop {
            let (now, wake) = {
                let mut locked = self.lock()?;
                if locked.completed_count(ctx)? >= count {
                    return Ok(());
                }
                let now = locked.now_ns;
                let limit = now + MAX_WAIT_SLICE_NS;
                (
                    now,
                    locked
                        .predict_completion(ctx, count, limit)?
                        .unwrap_or(limit)
                        .min(limit),
                )
            };
            let wake = wake.max(now + 1);
            match waiter {
                Waiter::Prompt => sleep_until(wake),
                Waiter::Spin => yield_until(wake),
                Waiter::Block => sleep_with_small_slack(wake),
            }
        }
    }

    /// Test hook: behave as if this process had died (its owner byte is released).
    pub fn simulate_death(&self, process: ProcessId) {
        self.claim.release(process.slot);
    }
}

/// The timer slack a waiter sleeps with. Linux lets a thread's timer fire up to its slack (50 µs
/// by default) late; the real driver does not sleep while a context is active (it spins, under
/// `CU_CTX_SCHED_AUTO`), so a synchronisation returns within a few µs of the work's completion.
/// 1 ns is the smallest slack Linux accepts (0 means "the default").
const WAIT_TIMER_SLACK_NS: libc::c_ulong = 1;
/// The last stretch before a predicted completion is spun rather than slept, as the real
/// driver spins: waking from a sleep costs the scheduler's wake-up latency on top of the timer.
/// Measured on the 2-core development VM, `clock_nanosleep` with a 1 ns slack wakes p50 44 µs,
/// p99 87 µs late; with a 20 µs spin a kernel-by-kernel loop of 100 µs kernels kept the GPU
/// only 80 % busy (a real driver: ~98 %), with 80 µs 97.7 %. Hence 100 µs.
const WAIT_SPIN_NS: u64 = 100_000;

/// How a thread waits for the GPU (the real driver's choice: `CU_EVENT_BLOCKING_SYNC` on the
/// event, else the context's `CU_CTX_SCHED_*` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiter {
    /// `CU_CTX_SCHED_SPIN`/`YIELD`, and `AUTO` (which picks one of them): the caller stays on
    /// the CPU, polling, for the whole wait. simgpu always yields between polls (the kinder
    /// of the two on a machine with few cores); either way the wait costs its whole length
    /// in CPU time.
    Spin,
    /// `CU_CTX_SCHED_BLOCKING_SYNC`, or an event created with `CU_EVENT_BLOCKING_SYNC`: the
    /// caller sleeps until the work is done and costs no CPU meanwhile.
    Block,
    /// The driver's internal waits (a full pushbuffer): asleep until just before the
    /// predicted completion, then yielding, so they return promptly at little CPU cost.
    Prompt,
}

/// Polls the clock, yielding the CPU between looks, until `deadline_ns`.
fn yield_until(deadline_ns: u64) {
    while now_ns() < deadline_ns {
        std::thread::yield_now();
    }
}

/// Returns at `deadline_ns` (or a little after), or earlier on a signal.
pub(crate) fn sleep_until(deadline_ns: u64) {
    let wake_ns = deadline_ns.saturating_sub(WAIT_SPIN_NS);
    if now_ns() < wake_ns {
        sleep_with_small_slack(wake_ns);
    }
    // Yielding, not pure spinning (the driver's CU_CTX_SCHED_YIELD, which its AUTO mode
    // picks when processes outnumber cores): on a 2-core machine a waiter that spun for
    // every 100 µs kernel kept a core from the other jobs' launch threads, and the
    // high-priority job's start latency p99 went from 0.18 to 0.9 ms.
    yield_until(deadline_ns);
}

fn sleep_with_small_slack(deadline_ns: u64) {
    // The kernel reads an absolute deadline on the caller's own (possibly shifted) clock.
    let deadline_ns = crate::clock::to_local_ns(deadline_ns);
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: PR_GET/SET_TIMERSLACK take and return plain integers and affect only the calling
    // thread; the previous slack is restored after the sleep, so the program's own sleeps
    // keep the slack it chose.
    let previous_slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
    // SAFETY: as above; the value is a plain integer (nanoseconds of slack).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, WAIT_TIMER_SLACK_NS) };
    // SAFETY: absolute sleep on CLOCK_MONOTONIC with a valid timespec; an early return (signal)
    // only makes the caller check again.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
    if previous_slack > 0 {
        // SAFETY: as above; restores the value read before the sleep.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, previous_slack as libc::c_ulong) };
    }
}

/// The operations of one GPU's contexts, as the pure model sees them.
struct GpuOps<'a> {
    submitted: [u64; MAX_CONTEXTS],
    queues: &'a [Queue; MAX_CONTEXTS],
}

impl OpSource for GpuOps<'_> {
    fn contexts(&self) -> usize {
        MAX_CONTEXTS
    }
    fn duration_ns(&self, ctx: usize, index: u64) -> Option<u64> {
        (index < self.submitted[ctx])
            .then(|| self.queues[ctx].ops[index as usize % QUEUE_DEPTH].duration_ns)
    }
    fn ready_ns(&self, ctx: usize, index: u64) -> u64 {
        if index < self.submitted[ctx] {
            self.queues[ctx].ops[index as usize % QUEUE_DEPTH].ready_ns
        } else {
            0
        }
    }
}

/// The shared state, locked; unlocks on drop.
pub struct Locked<'a> {
    pub(crate) device: &'a Device,
    pub(crate) state: &'a mut SharedState,
    /// The clock, read once the lock was held (so it never goes backwards across processes).
    pub now_ns: u64,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.state.mutex.unlock();
    }
}

fn add_busy(
    gpu_busy: &mut u64,
    util: &mut [crate::shared::UtilBucket; UTIL_BUCKETS],
    from: u64,
    to: u64,
) {
    *gpu_busy += to - from;
    add_to_buckets(util, from, to);
}

/// Adds `[from, to)` to the buckets it falls in (a bucket of an older period is reset first).
fn add_to_buckets(util: &mut [crate::shared::UtilBucket; UTIL_BUCKETS], from: u64, to: u64) {
    let mut t = from;
    while t < to {
        let id = t / UTIL_BUCKET_NS;
        let end = ((id + 1) * UTIL_BUCKET_NS).min(to);
        let bucket = &mut util[id as usize % UTIL_BUCKETS];
        if bucket.id != id {
            bucket.id = id;
            bucket.busy_ns = 0;
        }
        bucket.busy_ns += end - t;
        t = end;
    }
}

fn utilization_percent(gpu: &GpuState, now: u64) -> u32 {
    let now_id = now / UTIL_BUCKET_NS;
    let first_id = now_id.saturating_sub(9);
    let window_start = (first_id * UTIL_BUCKET_NS).max(gpu.created_ns);
    if now <= window_start {
        return 0;
    }
    let busy: u64 = (first_id..=now_id)
        .map(|id| gpu.util[id as usize % UTIL_BUCKETS])
        .filter(|b| b.id >= first_id && b.id <= now_id)
        .map(|b| b.busy_ns)
        .sum();
    ((busy * 100 + (now - window_start) / 2) / (now - window_start)).min(100) as u32
}

impl Locked<'_> {
    fn params(&self) -> SliceParams {
        SliceParams {
            slice_ns: self.state.config.slice_ns,
            switch_ns: self.state.config.switch_ns,
        }
    }

    fn gpu_cursors(&self, gpu: u32) -> ([Cursor; MAX_CONTEXTS], [u64; MAX_CONTEXTS]) {
        let mut cursors = [Cursor::default(); MAX_CONTEXTS];
        let mut submitted = [0u64; MAX_CONTEXTS];
        for (i, c) in self.state.contexts.iter().enumerate() {
            if c.state == SLOT_LIVE && c.gpu == gpu {
                cursors[i] = c.cursor;
                submitted[i] = c.submitted;
            }
        }
        (cursors, submitted)
    }

    /// Brings GPU `gpu` up to `self.now_ns`.
    pub fn advance_gpu(&mut self, gpu: u32) {
        let params = self.params();
        let (mut cursors, submitted) = self.gpu_cursors(gpu);
        let SharedState {
            queues,
            contexts,
            events,
            gpus,
            ..
        } = &mut *self.state;
        let GpuState {
            engine,
            busy_ns,
            util,
            ..
        } = &mut gpus[gpu as usize];
        let src = GpuOps { submitted, queues };
        timeslice::advance(
            engine,
            &src,
            &mut cursors,
            params,
            self.now_ns,
            &mut |p| match p {
                Progress::Ran {
                    ctx,
                    index,
                    from_ns,
                    to_ns,
                } => {
                    let c = &mut contexts[ctx];
                    c.gpu_time_ns += to_ns - from_ns;
                    let per_engine = match queues[ctx].ops[index as usize % QUEUE_DEPTH].kind {
                        OP_KERNEL => &mut c.kernel_busy,
                        _ => &mut c.copy_busy,
                    };
                    add_to_buckets(per_engine, from_ns, to_ns);
                    add_busy(busy_ns, util, from_ns, to_ns);
                }
                Progress::Completed { ctx, index, at_ns } => {
                    let op = queues[ctx].ops[index as usize % QUEUE_DEPTH];
                    if op.event != NO_EVENT {
                        let slot = &mut events[ctx].slots[op.event as usize];
                        // A re-recorded event waits for its latest marker only.
                        if slot.recorded_count == index + 1 {
                            slot.completed_at_ns = at_ns;
                        }
                    }
                }
                Progress::SwitchStarted { .. } => {}
            },
        );
        for (i, c) in contexts.iter_mut().enumerate() {
            if c.state == SLOT_LIVE && c.gpu == gpu {
                c.cursor = cursors[i];
            }
        }
    }

    fn context(&self, ctx: ContextId) -> Result<&crate::shared::ContextState, DeviceError> {
        let c = self
            .state
            .contexts
            .get(ctx.slot as usize)
            .ok_or(DeviceError::StaleContext)?;
        if c.state != SLOT_LIVE || c.generation != ctx.generation {
            return Err(DeviceError::StaleContext);
        }
        Ok(c)
    }

    pub(crate) fn process_slot(&self, p: ProcessId) -> Result<usize, DeviceError> {
        let slot = self
            .state
            .processes
            .get(p.slot as usize)
            .ok_or(DeviceError::StaleProcess)?;
        if slot.state != SLOT_LIVE || slot.generation != p.generation {
            return Err(DeviceError::StaleProcess);
        }
        Ok(p.slot as usize)
    }

    fn next_generation(&mut self) -> u64 {
        self.state.next_generation += 1;
        self.state.next_generation
    }

    pub fn config(&self) -> StoredConfig {
        self.state.config
    }

    /// Registers this process (its owner byte, pid and PID namespace).
    pub fn attach_process(&mut self) -> Result<ProcessId, DeviceError> {
        self.reap_dead();
        let ns = PidNamespace::of_self().unwrap_or_default();
        for slot in 0..MAX_PROCESSES {
            if self.state.processes[slot].state != SLOT_FREE
                || !self.device.claim.try_claim(slot as u32)?
            {
                continue;
            }
            let generation = self.next_generation();
            let p = &mut self.state.processes[slot];
            p.state = SLOT_LIVE;
            p.pid = std::process::id();
            p.ns = ns;
            p.generation = generation;
            p.memory = [0; crate::shared::MAX_GPUS];
            crate::checkpoint::reset(p);
            let id = ProcessId {
                slot: slot as u32,
                generation,
            };
            // Unwritten memory reads as zero: no image of an earlier state file (whose
            // generations started again from 1) may pass for this process's.
            self.device.images.remove(id);
            return Ok(id);
        }
        Err(DeviceError::NoFreeSlot("process"))
    }

    /// Unregisters a process that is still alive, releasing everything it holds.
    pub fn detach_process(&mut self, p: ProcessId) -> Result<(), DeviceError> {
        let slot = self.process_slot(p)?;
        self.reclaim_process(slot);
        self.device.claim.release(slot as u32);
        Ok(())
    }

    /// Reclaims the contexts, queued work and memory of every process whose owner byte is free.
    pub fn reap_dead(&mut self) -> usize {
        let mut reaped = 0;
        for slot in 0..MAX_PROCESSES {
            if self.state.processes[slot].state == SLOT_LIVE
                && matches!(self.device.observe.is_held(slot as u32), Ok(false))
            {
                self.reclaim_process(slot);
                reaped += 1;
            }
        }
        reaped
    }

    fn reclaim_process(&mut self, slot: usize) {
        for c in 0..MAX_CONTEXTS {
            let ctx = &self.state.contexts[c];
            if ctx.state == SLOT_LIVE && ctx.process == slot as u32 {
                let gpu = ctx.gpu;
                self.advance_gpu(gpu);
                self.free_context_slot(c);
            }
        }
        // Its references to shared allocations die with it. An allocation it exported lives
        // on while another process holds a reference (as on the real driver: the physical
        // memory is freed when the last handle goes), no longer any process's in the listing.
        for a in 0..self.state.shared_allocs.len() {
            if self.state.shared_allocs[a].state != SLOT_LIVE {
                continue;
            }
            self.state.shared_allocs[a].refs[slot] = 0;
            let alloc = &self.state.shared_allocs[a];
            let (gpu, bytes) = (alloc.gpu, alloc.bytes);
            let referenced = alloc.refs.iter().any(|&r| r > 0);
            if alloc.owner == slot as u32 && referenced {
                let owner = &mut self.state.processes[slot];
                let held = &mut owner.memory[gpu as usize];
                *held = held.saturating_sub(bytes);
                let alloc = &mut self.state.shared_allocs[a];
                alloc.owner = NO_OWNER;
                alloc.owner_generation = 0;
            } else if alloc.owner == slot as u32 {
                // Freed with the exporter's memory below.
                self.state.shared_allocs[a].state = SLOT_FREE;
            } else if !referenced {
                self.free_shared(a);
            }
        }
        let p = &mut self.state.processes[slot];
        for (gpu, bytes) in p.memory.iter_mut().enumerate() {
            let used = &mut self.state.gpus[gpu].memory_used;
            *used = used.saturating_sub(*bytes);
            *bytes = 0;
        }
        // Memory a checkpoint moved to the host is no longer counted on the GPU: it goes
        // with the process without touching the GPU's use.
        crate::checkpoint::reset(p);
        p.state = SLOT_FREE;
        // Its contents go with it, on the device or checkpointed to the host.
        let id = ProcessId {
            slot: slot as u32,
            generation: p.generation,
        };
        self.device.images.remove(id);
    }

    fn free_context_slot(&mut self, c: usize) {
        let gpu = self.state.contexts[c].gpu as usize;
        self.state.gpus[gpu].engine.forget_context(c);
        let ctx = &mut self.state.contexts[c];
        ctx.state = SLOT_FREE;
        ctx.submitted = 0;
        ctx.cursor = Cursor::default();
    }

    /// Creates a context on `gpu`, charging the driver's per-context memory overhead to `p`
    /// (`OutOfMemory`, nothing created, when the GPU cannot fit it, as the real driver fails
    /// `cuCtxCreate` / `cuDevicePrimaryCtxRetain` on a full GPU).
    pub fn create_context(&mut self, p: ProcessId, gpu: u32) -> Result<ContextId, DeviceError> {
        let process = self.process_slot(p)?;
        if gpu >= self.state.config.gpus {
            return Err(DeviceError::InvalidGpu(gpu));
        }
        let slot = (0..MAX_CONTEXTS)
            .find(|&c| self.state.contexts[c].state == SLOT_FREE)
            .ok_or(DeviceError::NoFreeSlot("context"))?;
        let overhead = self.state.config.context_memory_bytes;
        self.reserve_memory(p, gpu, overhead)?;
        self.advance_gpu(gpu);
        let generation = self.next_generation();
        let c = &mut self.state.contexts[slot];
        c.state = SLOT_LIVE;
        c.gpu = gpu;
        c.process = process as u32;
        c.generation = generation;
        c.cursor = Cursor::default();
        c.submitted = 0;
        c.gpu_time_ns = 0;
        c.overhead_bytes = overhead;
        c.created_ns = self.now_ns;
        c.kernel_busy = [UtilBucket { id: 0, busy_ns: 0 }; UTIL_BUCKETS];
        c.copy_busy = [UtilBucket { id: 0, busy_ns: 0 }; UTIL_BUCKETS];
        for e in self.state.events[slot].slots.iter_mut() {
            *e = EventSlot {
                state: SLOT_FREE,
                _pad: 0,
                recorded_count: 0,
                completed_at_ns: 0,
            };
        }
        Ok(ContextId {
            slot: slot as u32,
            generation,
        })
    }

    /// Destroys a context; its queued work is dropped (as when a process tears down a context).
    pub fn destroy_context(&mut self, ctx: ContextId) -> Result<(), DeviceError> {
        let c = self.context(ctx)?;
        let (gpu, process, overhead) = (c.gpu, c.process as usize, c.overhead_bytes);
        self.advance_gpu(gpu);
        self.free_context_slot(ctx.slot as usize);
        let owner = &mut self.state.processes[process];
        if owner.state == SLOT_LIVE {
            let held = &mut owner.memory[gpu as usize];
            let bytes = overhead.min(*held);
            *held -= bytes;
            let used = &mut self.state.gpus[gpu as usize].memory_used;
            *used = used.saturating_sub(bytes);
        }
        Ok(())
    }

    /// Charges `bytes` of GPU `gpu` to process `p`, or fails without charging anything.
    pub fn reserve_memory(
        &mut self,
        p: ProcessId,
        gpu: u32,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        let slot = self.process_slot(p)?;
        if gpu >= self.state.config.gpus {
            return Err(DeviceError::InvalidGpu(gpu));
        }
        let capacity = self.state.config.allocatable_bytes();
        let used = &mut self.state.gpus[gpu as usize].memory_used;
        let free = capacity.saturating_sub(*used);
        if bytes > free {
            return Err(DeviceError::OutOfMemory {
                requested: bytes,
                free,
            });
        }
        *used += bytes;
        self.state.processes[slot].memory[gpu as usize] += bytes;
        Ok(())
    }

    pub fn release_memory(
        &mut self,
        p: ProcessId,
        gpu: u32,
        bytes: u64,
    ) -> Result<(), DeviceError> {
        let slot = self.process_slot(p)?;
        let held = &mut self.state.processes[slot].memory[gpu as usize];
        let bytes = bytes.min(*held);
        *held -= bytes;
        let used = &mut self.state.gpus[gpu as usize].memory_used;
        *used = used.saturating_sub(bytes);
        Ok(())
    }

    /// Registers `bytes` of GPU `gpu`, already charged to `p`, as a shared physical allocation
    /// with one reference (the exporter's own handle).
    pub fn share_allocation(
        &mut self,
        p: ProcessId,
        gpu: u32,
        bytes: u64,
    ) -> Result<SharedAllocId, DeviceError> {
        let process = self.process_slot(p)?;
        let slot = (0..MAX_SHARED_ALLOCS)
            .find(|&a| self.state.shared_allocs[a].state == SLOT_FREE)
            .ok_or(DeviceError::NoFreeSlot("shared allocation"))?;
        let generation = self.next_generation();
        let a = &mut self.state.shared_allocs[slot];
        a.state = SLOT_LIVE;
        a.gpu = gpu;
        a.owner = process as u32;
        a.owner_generation = p.generation;
        a.generation = generation;
        a.bytes = bytes;
        a.refs = [0; MAX_PROCESSES];
        a.refs[process] = 1;
        // The driver cannot checkpoint a process that shares memory with others.
        self.state.processes[process].checkpoint_refusals |= crate::checkpoint::REFUSE_IPC;
        Ok(SharedAllocId {
            slot: slot as u32,
            generation,
        })
    }

    fn shared_alloc(&mut self, id: SharedAllocId) -> Result<usize, DeviceError> {
        let a = self
            .state
            .shared_allocs
            .get(id.slot as usize)
            .ok_or(DeviceError::StaleSharedAlloc)?;
        if a.state != SLOT_LIVE || a.generation != id.generation {
            return Err(DeviceError::StaleSharedAlloc);
        }
        Ok(id.slot as usize)
    }

    /// Takes a reference for `p` (an imported handle); returns the allocation's (GPU, bytes).
    pub fn import_allocation(
        &mut self,
        p: ProcessId,
        id: SharedAllocId,
    ) -> Result<(u32, u64), DeviceError> {
        let process = self.process_slot(p)?;
        let a = self.shared_alloc(id)?;
        let a = &mut self.state.shared_allocs[a];
        a.refs[process] += 1;
        let (gpu, bytes) = (a.gpu, a.bytes);
        self.state.processes[process].checkpoint_refusals |= crate::checkpoint::REFUSE_IPC;
        Ok((gpu, bytes))
    }

    /// Drops a reference of `p`; the last one gives the bytes back to the exporter's charge.
    pub fn release_shared(&mut self, p: ProcessId, id: SharedAllocId) -> Result<(), DeviceError> {
        let process = self.process_slot(p)?;
        let slot = self.shared_alloc(id)?;
        let a = &mut self.state.shared_allocs[slot];
        a.refs[process] = a.refs[process].saturating_sub(1);
        if a.refs.iter().any(|&r| r > 0) {
            return Ok(());
        }
        self.free_shared(slot);
        Ok(())
    }

    /// Frees a shared allocation nobody references: from its exporter's charge, or, once
    /// the exporter is gone, from the GPU's use alone.
    fn free_shared(&mut self, slot: usize) {
        let a = &mut self.state.shared_allocs[slot];
        a.state = SLOT_FREE;
        let (owner, generation, gpu, bytes) = (a.owner, a.owner_generation, a.gpu, a.bytes);
        let bytes = if owner == NO_OWNER {
            bytes
        } else {
            let owner = &mut self.state.processes[owner as usize];
            if owner.state != SLOT_LIVE || owner.generation != generation {
                return;
            }
            let held = &mut owner.memory[gpu as usize];
            let bytes = bytes.min(*held);
            *held -= bytes;
            bytes
        };
        let used = &mut self.state.gpus[gpu as usize].memory_used;
        *used = used.saturating_sub(bytes);
    }

    /// (free, total) bytes of GPU `gpu` as CUDA sees them (`cuMemGetInfo`): the total is what
    /// can be allocated, the physical memory less what the driver reserved.
    pub fn memory_info(&self, gpu: u32) -> (u64, u64) {
        let total = self.state.config.allocatable_bytes();
        let used = self
            .state
            .gpus
            .get(gpu as usize)
            .map_or(0, |g| g.memory_used);
        (total.saturating_sub(used), total)
    }

    /// Queues an operation of `duration_ns` (0 for a marker) and returns the count of operations
    /// that must complete for it to be done.
    pub fn submit(
        &mut self,
        ctx: ContextId,
        duration_ns: u64,
        event: u32,
    ) -> Result<u64, DeviceError> {
        self.submit_at(ctx, duration_ns, event, 0)
    }

    /// Queues a kernel launched now: it cannot start before the configured launch latency has
    /// passed (the doorbell write, the front end fetching the launch), even on an idle GPU.
    pub fn submit_kernel(&mut self, ctx: ContextId, duration_ns: u64) -> Result<u64, DeviceError> {
        let ready = self.now_ns + self.state.config.launch_latency_ns;
        self.queue(ctx, duration_ns, NO_EVENT, ready, OP_KERNEL)
    }

    /// Queues an operation that may not start before `ready_ns`.
    pub fn submit_at(
        &mut self,
        ctx: ContextId,
        duration_ns: u64,
        event: u32,
        ready_ns: u64,
    ) -> Result<u64, DeviceError> {
        self.queue(ctx, duration_ns, event, ready_ns, OP_COPY)
    }

    fn queue(
        &mut self,
        ctx: ContextId,
        duration_ns: u64,
        event: u32,
        ready_ns: u64,
        kind: u32,
    ) -> Result<u64, DeviceError> {
        let gpu = self.context(ctx)?.gpu;
        self.advance_gpu(gpu);
        let c = &mut self.state.contexts[ctx.slot as usize];
        if c.submitted - c.cursor.next >= QUEUE_DEPTH as u64 {
            return Err(DeviceError::QueueFull {
                completed: c.submitted + 1 - QUEUE_DEPTH as u64,
            });
        }
        let index = c.submitted;
        self.state.queues[ctx.slot as usize].ops[index as usize % QUEUE_DEPTH] = QueuedOp {
            duration_ns,
            ready_ns,
            event,
            kind,
        };
        c.submitted += 1;
        Ok(c.submitted)
    }

    /// Operations of `ctx` completed by now.
    pub fn completed_count(&mut self, ctx: ContextId) -> Result<u64, DeviceError> {
        let gpu = self.context(ctx)?.gpu;
        self.advance_gpu(gpu);
        Ok(self.state.contexts[ctx.slot as usize].cursor.next)
    }

    /// Operations of `ctx` submitted so far.
    pub fn submitted_count(&self, ctx: ContextId) -> Result<u64, DeviceError> {
        Ok(self.context(ctx)?.submitted)
    }

    /// When `count` operations of `ctx` will have completed if nothing else is submitted, if that
    /// happens before `horizon_ns`.
    pub fn predict_completion(
        &self,
        ctx: ContextId,
        count: u64,
        horizon_ns: u64,
    ) -> Result<Option<u64>, DeviceError> {
        let c = self.context(ctx)?;
        if count == 0 || c.cursor.next >= count {
            return Ok(Some(self.now_ns));
        }
        let gpu = c.gpu;
        let (cursors, submitted) = self.gpu_cursors(gpu);
        let src = GpuOps {
            submitted,
            queues: &self.state.queues,
        };
        Ok(timeslice::predict_completion(
            &self.state.gpus[gpu as usize].engine,
            &src,
            &cursors,
            self.params(),
            ctx.slot as usize,
            count - 1,
            horizon_ns,
        ))
    }

    /// GPU time `ctx` has executed.
    pub fn context_gpu_time_ns(&mut self, ctx: ContextId) -> Result<u64, DeviceError> {
        let gpu = self.context(ctx)?.gpu;
        self.advance_gpu(gpu);
        Ok(self.state.contexts[ctx.slot as usize].gpu_time_ns)
    }

    pub fn create_event(&mut self, ctx: ContextId) -> Result<u32, DeviceError> {
        self.context(ctx)?;
        let table = &mut self.state.events[ctx.slot as usize];
        let slot = (0..EVENTS_PER_CONTEXT)
            .find(|&e| table.slots[e].state == SLOT_FREE)
            .ok_or(DeviceError::NoFreeSlot("event"))?;
        table.slots[slot] = EventSlot {
            state: SLOT_LIVE,
            _pad: 0,
            recorded_count: 0,
            completed_at_ns: 0,
        };
        Ok(slot as u32)
    }

    pub fn destroy_event(&mut self, ctx: ContextId, event: u32) -> Result<(), DeviceError> {
        self.context(ctx)?;
        let slot = self.state.events[ctx.slot as usize]
            .slots
            .get_mut(event as usize)
            .ok_or(DeviceError::InvalidEvent)?;
        // A marker still queued for this slot finds recorded_count 0 and leaves it alone.
        *slot = EventSlot {
            state: SLOT_FREE,
            _pad: 0,
            recorded_count: 0,
            completed_at_ns: 0,
        };
        Ok(())
    }

    /// Queues the event's marker behind everything `ctx` has queued; returns its count.
    pub fn record_event(&mut self, ctx: ContextId, event: u32) -> Result<u64, DeviceError> {
        self.context(ctx)?;
        if self.state.events[ctx.slot as usize]
            .slots
            .get(event as usize)
            .map(|e| e.state)
            != Some(SLOT_LIVE)
        {
            return Err(DeviceError::InvalidEvent);
        }
        let count = self.submit(ctx, 0, event)?;
        let slot = &mut self.state.events[ctx.slot as usize].slots[event as usize];
        slot.recorded_count = count;
        slot.completed_at_ns = 0;
        Ok(count)
    }

    pub fn event_state(&mut self, ctx: ContextId, event: u32) -> Result<EventState, DeviceError> {
        let done = self.completed_count(ctx)?;
        let slot = self.state.events[ctx.slot as usize]
            .slots
            .get(event as usize)
            .ok_or(DeviceError::InvalidEvent)?;
        if slot.state != SLOT_LIVE {
            return Err(DeviceError::InvalidEvent);
        }
        Ok(EventState {
            recorded: slot.recorded_count > 0,
            complete: done >= slot.recorded_count,
            completed_at_ns: slot.completed_at_ns,
            recorded_count: slot.recorded_count,
        })
    }

    /// Per process, what ran on GPU `gpu` in the complete utilisation periods that end after
    /// `since_ns` (device time) and are still kept (the last `UTIL_BUCKETS - 1`, like the
    /// driver's sample buffer): only processes that ran something, as NVML reports "every
    /// process that had some non-zero utilization". The period in progress is not covered:
    /// a sample is taken when its period ends.
    pub fn process_activity(
        &mut self,
        gpu: u32,
        since_ns: u64,
    ) -> Result<Vec<ProcessActivity>, DeviceError> {
        if gpu >= self.state.config.gpus {
            return Err(DeviceError::InvalidGpu(gpu));
        }
        self.advance_gpu(gpu);
        let now_id = self.now_ns / UTIL_BUCKET_NS;
        let oldest = now_id.saturating_sub(UTIL_BUCKETS as u64 - 1);
        let created = self.state.gpus[gpu as usize].created_ns;
        let periods: Vec<u64> = (oldest..now_id)
            .filter(|&id| {
                let end = (id + 1) * UTIL_BUCKET_NS;
                end > since_ns && end > created
            })
            .collect();
        let s = &*self.state;
        let mut found: Vec<(usize, ProcessActivity)> = Vec::new();
        for c in s
            .contexts
            .iter()
            .filter(|c| c.state == SLOT_LIVE && c.gpu == gpu)
        {
            let process = c.process as usize;
            let slot = &s.processes[process];
            let i = match found.iter().position(|(p, _)| *p == process) {
                Some(i) => i,
                None => {
                    found.push((
                        process,
                        ProcessActivity {
                            pid: slot.pid,
                            ns: slot.ns,
                            kernel_ns: 0,
                            copy_ns: 0,
                            period_ns: 0,
                            last_active_end_ns: 0,
                        },
                    ));
                    found.len() - 1
                }
            };
            let a = &mut found[i].1;
            let in_period = |buckets: &[UtilBucket; UTIL_BUCKETS], id: u64| {
                let b = buckets[id as usize % UTIL_BUCKETS];
                if b.id == id {
                    b.busy_ns
                } else {
                    0
                }
            };
            for &id in &periods {
                let end = (id + 1) * UTIL_BUCKET_NS;
                if c.created_ns >= end {
                    continue;
                }
                let (k, m) = (in_period(&c.kernel_busy, id), in_period(&c.copy_busy, id));
                a.kernel_ns += k;
                a.copy_ns += m;
                if k + m > 0 {
                    a.last_active_end_ns = a.last_active_end_ns.max(end);
                }
            }
        }
        // A process's periods: those any of its contexts existed in (counted once).
        for (process, a) in found.iter_mut() {
            a.period_ns = periods
                .iter()
                .filter(|&&id| {
                    s.contexts.iter().any(|c| {
                        c.state == SLOT_LIVE
                            && c.gpu == gpu
                            && c.process as usize == *process
                            && c.created_ns < (id + 1) * UTIL_BUCKET_NS
                    })
                })
                .count() as u64
                * UTIL_BUCKET_NS;
        }
        Ok(found
            .into_iter()
            .map(|(_, a)| a)
            .filter(|a| a.kernel_ns + a.copy_ns > 0)
            .collect())
    }

    /// The GPU as NVML and tests see it (advanced to now).
    pub fn snapshot(&mut self, gpu: u32) -> Result<GpuSnapshot, DeviceError> {
        if gpu >= self.state.config.gpus {
            return Err(DeviceError::InvalidGpu(gpu));
        }
        self.advance_gpu(gpu);
        let s = &*self.state;
        let g = &s.gpus[gpu as usize];
        let contexts: Vec<ContextInfo> = (0..MAX_CONTEXTS)
            .filter(|&c| s.contexts[c].state == SLOT_LIVE && s.contexts[c].gpu == gpu)
            .map(|c| {
                let ctx = &s.contexts[c];
                ContextInfo {
                    slot: c as u32,
                    process_slot: ctx.process,
                    pid: s.processes[ctx.process as usize].pid,
                    gpu_time_ns: ctx.gpu_time_ns,
                    submitted: ctx.submitted,
                    completed: ctx.cursor.next,
                }
            })
            .collect();
        let processes = (0..MAX_PROCESSES)
            .filter(|&p| s.processes[p].state == SLOT_LIVE)
            .map(|p| ProcessUsage {
                slot: p as u32,
                pid: s.processes[p].pid,
                ns: s.processes[p].ns,
                memory_bytes: s.processes[p].memory[gpu as usize],
                contexts: contexts
                    .iter()
                    .filter(|c| c.process_slot == p as u32)
                    .count() as u32,
            })
            // A checkpointed process has released every GPU resource: NVML lists it no more.
            .filter(|u| {
                (u.memory_bytes > 0 || u.contexts > 0)
                    && !crate::checkpoint::is_checkpointed(&s.processes[u.slot as usize])
            })
            .collect();
        Ok(GpuSnapshot {
            index: gpu,
            memory_total: s.config.memory_bytes,
            memory_reserved: s.config.reserved_memory_bytes,
            memory_used: g.memory_used,
            busy_ns: g.busy_ns,
            utilization_percent: utilization_percent(g, self.now_ns),
            switches: g.engine.switches,
            now_ns: self.now_ns,
            processes,
            contexts,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A private device; nothing reserved unless `extra` says so, so the byte counts below
    /// are the allocations' own.
    pub(crate) fn device(dir: &std::path::Path, extra: &[(&str, &str)]) -> Device {
        let mut vars: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        vars.push(("SIMGPU_DIR".to_string(), dir.display().to_string()));
        vars.push(("SIMGPU_RESERVED_MEMORY".to_string(), "0".to_string()));
        let config =
            SimConfig::from_lookup(|n| vars.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
                .unwrap();
        Device::open(&config).unwrap()
    }

    #[test]
    fn memory_is_finite_and_charged_per_process() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[("SIMGPU_MEMORY", "1Gi")]);
        let mut l = dev.lock().unwrap();
        let p = l.attach_process().unwrap();
        l.reserve_memory(p, 0, 600 << 20).unwrap();
        let err = l.reserve_memory(p, 0, 600 << 20).unwrap_err();
        assert!(
            matches!(err, DeviceError::OutOfMemory { free, .. } if free == 424 << 20),
            "{err}"
        );
        l.reserve_memory(p, 1, 600 << 20).unwrap();
        assert_eq!(l.memory_info(0), (424 << 20, 1 << 30));
        let snap = l.snapshot(0).unwrap();
        assert_eq!(snap.processes.len(), 1);
        assert_eq!(snap.processes[0].memory_bytes, 600 << 20);
        assert_eq!(snap.processes[0].pid, std::process::id());
        l.release_memory(p, 0, 600 << 20).unwrap();
        assert_eq!(l.memory_info(0), (1 << 30, 1 << 30));
    }

    #[test]
    fn reserved_memory_is_never_allocatable_and_cuda_s_total_leaves_it_out() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(
            dir.path(),
            &[("SIMGPU_MEMORY", "1Gi"), ("SIMGPU_RESERVED_MEMORY", "24Mi")],
        );
        let mut l = dev.lock().unwrap();
        let p = l.attach_process().unwrap();
        assert_eq!(l.memory_info(0), (1000 << 20, 1000 << 20), "(free, total)");
        let err = l.reserve_memory(p, 0, 1 << 30).unwrap_err();
        assert!(
            matches!(err, DeviceError::OutOfMemory { free, .. } if free == 1000 << 20),
            "{err}"
        );
        l.reserve_memory(p, 0, 1000 << 20).unwrap();
        assert!(
            l.reserve_memory(p, 0, 1).is_err(),
            "the reserve is never handed out"
        );
        let snap = l.snapshot(0).unwrap();
        assert_eq!(
            (snap.memory_total, snap.memory_reserved, snap.memory_used),
            (1 << 30, 24 << 20, 1000 << 20),
            "NVML: the physical total, the reserve, what processes hold"
        );
    }

    #[test]
    fn a_context_costs_its_overhead_until_destroyed_and_fails_on_a_full_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(
            dir.path(),
            &[("SIMGPU_MEMORY", "1Gi"), ("SIMGPU_CONTEXT_MEMORY", "300Mi")],
        );
        let mut l = dev.lock().unwrap();
        let p = l.attach_process().unwrap();
        let ctx = l.create_context(p, 0).unwrap();
        assert_eq!(l.memory_info(0).0, (1 << 30) - (300 << 20));
        let snap = l.snapshot(0).unwrap();
        assert_eq!(snap.processes[0].memory_bytes, 300 << 20, "NVML sees it");
        l.reserve_memory(p, 0, 600 << 20).unwrap();
        // 124 MiB left: a second context does not fit, and nothing is charged for trying.
        let err = l.create_context(p, 0).unwrap_err();
        assert!(matches!(err, DeviceError::OutOfMemory { .. }), "{err}");
        assert_eq!(l.memory_info(0).0, 124 << 20);
        assert_eq!(l.snapshot(0).unwrap().contexts.len(), 1);
        l.destroy_context(ctx).unwrap();
        assert_eq!(
            l.memory_info(0).0,
            424 << 20,
            "the overhead goes with the context"
        );
        assert_eq!(l.snapshot(0).unwrap().processes[0].memory_bytes, 600 << 20);
    }

    #[test]
    fn a_shared_allocation_stays_charged_to_its_exporter_until_every_reference_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_MEMORY", "4Gi"), ("SIMGPU_CONTEXT_MEMORY", "0")];
        let (exporter, importer) = (device(dir.path(), &vars), device(dir.path(), &vars));
        // One statement per lock: a guard lives to the end of its statement.
        let p = exporter.lock().unwrap().attach_process().unwrap();
        let q = importer.lock().unwrap().attach_process().unwrap();
        let mut l = exporter.lock().unwrap();
        l.reserve_memory(p, 0, 1 << 30).unwrap();
        let id = l.share_allocation(p, 0, 1 << 30).unwrap();
        drop(l);
        let mut l = importer.lock().unwrap();
        assert_eq!(l.import_allocation(q, id).unwrap(), (0, 1 << 30));
        l.release_shared(p, id).unwrap(); // the exporter releases its handle
        let snap = l.snapshot(0).unwrap();
        assert_eq!(snap.memory_used, 1 << 30, "the importer still holds it");
        let owner = snap.processes.iter().find(|u| u.slot == p.slot).unwrap();
        assert_eq!(owner.memory_bytes, 1 << 30, "charged to the exporter");
        assert!(
            snap.processes.iter().all(|u| u.slot != q.slot),
            "not to the importer"
        );
        l.release_shared(q, id).unwrap();
        assert_eq!(l.memory_info(0).0, 4 << 30);
        assert!(matches!(
            l.import_allocation(q, id),
            Err(DeviceError::StaleSharedAlloc)
        ));
        // An importer that dies drops its references.
        l.reserve_memory(p, 0, 1 << 30).unwrap();
        let id = l.share_allocation(p, 0, 1 << 30).unwrap();
        l.import_allocation(q, id).unwrap();
        l.release_shared(p, id).unwrap();
        drop(l);
        importer.simulate_death(q);
        let mut l = exporter.lock().unwrap();
        l.reap_dead();
        assert_eq!(l.memory_info(0).0, 4 << 30);
    }

    #[test]
    fn a_shared_allocation_outlives_its_exporter_while_an_importer_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_MEMORY", "4Gi"), ("SIMGPU_CONTEXT_MEMORY", "0")];
        let (exporter, importer) = (device(dir.path(), &vars), device(dir.path(), &vars));
        let p = exporter.lock().unwrap().attach_process().unwrap();
        let q = importer.lock().unwrap().attach_process().unwrap();
        let mut l = exporter.lock().unwrap();
        l.reserve_memory(p, 0, 1 << 30).unwrap();
        let id = l.share_allocation(p, 0, 1 << 30).unwrap();
        drop(l);
        importer.lock().unwrap().import_allocation(q, id).unwrap();
        exporter.simulate_death(p);
        let mut l = importer.lock().unwrap();
        l.reap_dead();
        let snap = l.snapshot(0).unwrap();
        assert_eq!(snap.memory_used, 1 << 30, "the importer's handle keeps it");
        assert!(
            snap.processes.iter().all(|u| u.memory_bytes == 0),
            "no process's in the listing: {:?}",
            snap.processes
                .iter()
                .map(|u| u.memory_bytes)
                .collect::<Vec<_>>()
        );
        l.release_shared(q, id).unwrap();
        assert_eq!(l.memory_info(0).0, 4 << 30, "freed with the last handle");
    }

    #[test]
    fn a_kernel_starts_a_launch_latency_after_its_submission() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[("SIMGPU_LAUNCH_LATENCY_NS", "50000")]);
        let mut l = dev.lock().unwrap();
        let p = l.attach_process().unwrap();
        let ctx = l.create_context(p, 0).unwrap();
        let event = l.create_event(ctx).unwrap();
        let submitted = l.now_ns;
        l.submit_kernel(ctx, 1_000_000).unwrap();
        let count = l.record_event(ctx, event).unwrap();
        let done = l.predict_completion(ctx, count, u64::MAX).unwrap();
        assert_eq!(done, Some(submitted + 50_000 + 1_000_000));
    }

    #[test]
    fn work_completes_after_its_duration_and_events_carry_the_time() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[]);
        let (ctx, start, count, event) = {
            let mut l = dev.lock().unwrap();
            let p = l.attach_process().unwrap();
            let ctx = l.create_context(p, 0).unwrap();
            let event = l.create_event(ctx).unwrap();
            let start = l.now_ns;
            l.submit(ctx, 20_000_000, NO_EVENT).unwrap();
            let count = l.record_event(ctx, event).unwrap();
            assert!(!l.event_state(ctx, event).unwrap().complete);
            (ctx, start, count, event)
        };
        dev.wait_until_completed(ctx, count).unwrap();
        let waited = now_ns() - start;
        let mut l = dev.lock().unwrap();
        let state = l.event_state(ctx, event).unwrap();
        assert!(state.complete && state.recorded);
        // The model's completion time is exact; the wall clock only adds wake-up latency.
        assert!(
            state.completed_at_ns >= start + 20_000_000
                && state.completed_at_ns < start + 20_500_000
        );
        assert!(waited >= 20_000_000, "{waited}");
        assert_eq!(l.context_gpu_time_ns(ctx).unwrap(), 20_000_000);
    }

    #[test]
    fn a_dead_process_is_reaped_with_its_contexts_work_and_memory() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[]);
        let other = device(dir.path(), &[]);
        let (p, ctx) = {
            let mut l = dev.lock().unwrap();
            let p = l.attach_process().unwrap();
            let ctx = l.create_context(p, 0).unwrap();
            l.reserve_memory(p, 0, 1 << 30).unwrap();
            l.submit(ctx, 10_000_000_000, NO_EVENT).unwrap();
            (p, ctx)
        };
        let mut l = other.lock().unwrap();
        assert_eq!(l.reap_dead(), 0, "a live owner is not reaped");
        dev.simulate_death(p);
        assert_eq!(l.reap_dead(), 1);
        let snap = l.snapshot(0).unwrap();
        assert!(snap.processes.is_empty() && snap.contexts.is_empty());
        assert_eq!(snap.memory_used, 0);
        assert!(matches!(
            l.completed_count(ctx),
            Err(DeviceError::StaleContext)
        ));
        // The next process's work runs at once, not behind the dead one's 10 s kernel.
        let q = l.attach_process().unwrap();
        let c2 = l.create_context(q, 0).unwrap();
        let count = l.submit(c2, 1_000_000, NO_EVENT).unwrap();
        drop(l);
        let start = now_ns();
        other.wait_until_completed(c2, count).unwrap();
        assert!(now_ns() - start < 500_000_000);
    }

    #[test]
    fn a_full_queue_refuses_more_work() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[]);
        let mut l = dev.lock().unwrap();
        let p = l.attach_process().unwrap();
        let ctx = l.create_context(p, 0).unwrap();
        for _ in 0..QUEUE_DEPTH {
            l.submit(ctx, 1_000_000_000, NO_EVENT).unwrap();
        }
        assert!(matches!(
            l.submit(ctx, 1, NO_EVENT),
            Err(DeviceError::QueueFull { completed: 1 })
        ));
    }

    #[test]
    fn process_activity_counts_kernels_and_copies_of_complete_periods_only() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[("SIMGPU_LAUNCH_LATENCY_NS", "0")]);
        let idle = device(dir.path(), &[]);
        let q = idle.lock().unwrap().attach_process().unwrap();
        idle.lock().unwrap().create_context(q, 0).unwrap();
        let start = {
            let mut l = dev.lock().unwrap();
            let p = l.attach_process().unwrap();
            let ctx = l.create_context(p, 0).unwrap();
            l.submit_kernel(ctx, 150_000_000).unwrap();
            l.submit(ctx, 100_000_000, NO_EVENT).unwrap();
            l.now_ns
        };
        assert!(
            dev.lock()
                .unwrap()
                .process_activity(0, 0)
                .unwrap()
                .is_empty(),
            "the period in progress is not sampled yet"
        );
        // The work ends by start + 250 ms; its period has ended by start + 350 ms.
        std::thread::sleep(std::time::Duration::from_millis(450));
        let mut l = dev.lock().unwrap();
        let found = l.process_activity(0, start).unwrap();
        assert_eq!(found.len(), 1, "the idle process is not listed: {found:?}");
        let a = &found[0];
        assert_eq!(a.pid, std::process::id());
        assert_eq!((a.kernel_ns, a.copy_ns), (150_000_000, 100_000_000));
        assert!(
            a.period_ns >= 300_000_000 && a.period_ns.is_multiple_of(UTIL_BUCKET_NS),
            "{a:?}"
        );
        assert!(a.last_active_end_ns > start + 250_000_000);
        assert!(a.last_active_end_ns <= start + 350_000_000 + UTIL_BUCKET_NS);
        let now = l.now_ns;
        assert!(
            l.process_activity(0, now).unwrap().is_empty(),
            "nothing since now"
        );
        assert!(
            l.process_activity(1, 0).unwrap().is_empty(),
            "nothing on GPU 1"
        );
        // Only the periods after `since` count.
        let later = l.process_activity(0, a.last_active_end_ns).unwrap();
        assert!(later.is_empty(), "{later:?}");
    }

    #[test]
    fn utilization_reflects_recent_busy_time() {
        let dir = tempfile::tempdir().unwrap();
        let dev = device(dir.path(), &[]);
        let ctx = {
            let mut l = dev.lock().unwrap();
            let p = l.attach_process().unwrap();
            let ctx = l.create_context(p, 1).unwrap();
            assert_eq!(l.snapshot(1).unwrap().utilization_percent, 0);
            l.submit(ctx, 10_000_000_000, NO_EVENT).unwrap();
            ctx
        };
        // Past one whole window (10 buckets of 100 ms) after the submit, so no idle time
        // before it (the device's creation, slow on a loaded machine) is in the window: with
        // only 150 ms here, 15 ms of set-up read as 91 % busy.
        std::thread::sleep(std::time::Duration::from_millis(1_250));
        let mut l = dev.lock().unwrap();
        let snap = l.snapshot(1).unwrap();
        assert!(
            snap.utilization_percent >= 95,
            "{}",
            snap.utilization_percent
        );
        assert_eq!(l.snapshot(0).unwrap().utilization_percent, 0);
        assert!(l.context_gpu_time_ns(ctx).unwrap() >= 150_000_000);
    }
}
