//! The layout of the state file every process maps, and its creation.
//!
//! Everything is `repr(C)` plain data of fixed size, so that processes built separately (the
//! driver, NVML, a test) agree on it; `LAYOUT_VERSION` changes whenever it does. Fields are only
//! read or written while holding `SharedState::mutex`, except `magic`, which publishes the
//! initialised state, and a process's `checkpoint_phase`, `calls_in_flight` and `images_moved`,
//! which its own driver calls read and count on.

use crate::lock::RobustMutex;
use crate::pidns::PidNamespace;
use crate::timeslice::{Cursor, Engine};
use crate::SimConfig;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

pub const MAX_GPUS: usize = 16;
pub const MAX_PROCESSES: usize = 64;
pub const MAX_CONTEXTS: usize = 64;
/// Operations a context may have queued; a launch beyond it blocks, like a full pushbuffer.
pub const QUEUE_DEPTH: usize = 1024;
pub const EVENTS_PER_CONTEXT: usize = 1024;
/// Physical allocations exported for sharing (`cuMemExportToShareableHandle`) at once.
pub const MAX_SHARED_ALLOCS: usize = 256;
pub const UTIL_BUCKETS: usize = 32;
/// Utilisation is kept in buckets of this length; NVML averages the last second of them.
pub const UTIL_BUCKET_NS: u64 = 100_000_000;

const MAGIC: u64 = 0x5349_4d47_5055_5354; // "SIMGPUST"
pub const LAYOUT_VERSION: u64 = 6;

pub const SLOT_FREE: u32 = 0;
pub const SLOT_LIVE: u32 = 1;
pub const NO_EVENT: u32 = u32::MAX;

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("cannot create the state directory {path}: {source}")]
    CreateDir {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot open the state file {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot size or map the state file: {0}")]
    Map(std::io::Error),
    #[error("the state file was written by another simgpu layout (version {found}, expected {LAYOUT_VERSION}); remove it")]
    Layout { found: u64 },
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
}

/// The configuration fixed by the process that created the state.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct StoredConfig {
    pub gpus: u32,
    pub sms: u32,
    pub memory_bytes: u64,
    pub slice_ns: u64,
    pub switch_ns: u64,
    pub host_copy_bytes_per_s: u64,
    pub device_copy_bytes_per_s: u64,
    pub checkpoint_copy_bytes_per_s: u64,
    pub default_kernel_ns: u64,
    pub cuda_version: i64,
    pub context_memory_bytes: u64,
    pub module_memory_bytes: u64,
    pub launch_host_ns: u64,
    pub launch_latency_ns: u64,
    pub reserved_memory_bytes: u64,
}

impl StoredConfig {
    /// What CUDA can allocate on each GPU: the physical memory less the driver's reserve.
    pub fn allocatable_bytes(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.reserved_memory_bytes)
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct UtilBucket {
    pub id: u64,
    pub busy_ns: u64,
}

#[repr(C)]
pub struct GpuState {
    pub engine: Engine,
    pub created_ns: u64,
    pub memory_used: u64,
    pub busy_ns: u64,
    pub util: [UtilBucket; UTIL_BUCKETS],
}

#[repr(C)]
pub struct ProcessSlot {
    pub state: u32,
    /// The pid in the process's own PID namespace.
    pub pid: u32,
    pub ns: PidNamespace,
    pub generation: u64,
    /// Device memory this process holds, per GPU.
    pub memory: [u64; MAX_GPUS],
    /// Its `checkpoint::Phase`. Written under the mutex; read without it by the process's own
    /// driver calls, which must not take the mutex merely to learn that they may proceed.
    pub checkpoint_phase: AtomicU32,
    /// Its driver calls under way (outermost entries only); a lock waits for them to leave,
    /// as the real driver's lock takes the API locks they hold. Read and written without
    /// the mutex, like `checkpoint_phase`.
    pub calls_in_flight: AtomicU32,
    /// `checkpoint::REFUSE_*` bits: what it holds that the driver cannot checkpoint.
    pub checkpoint_refusals: u32,
    /// Device memory moved to the host by a checkpoint, per GPU (no longer on the GPU).
    pub checkpointed: [u64; MAX_GPUS],
    /// How many times a checkpoint or a restore has moved its memory image
    /// (`crate::contents`): its driver reopens the image by name when this changes. Written
    /// under the mutex, read without it, like `checkpoint_phase`.
    pub images_moved: AtomicU64,
}

#[repr(C)]
pub struct ContextState {
    pub state: u32,
    pub gpu: u32,
    pub process: u32,
    pub _pad: u32,
    pub generation: u64,
    pub cursor: Cursor,
    /// Operations ever submitted; operation `i` lives at `queue[i % QUEUE_DEPTH]`.
    pub submitted: u64,
    /// GPU time this context has executed.
    pub gpu_time_ns: u64,
    /// Device memory charged to the process for the context itself (the driver's per-context
    /// overhead), given back when the context is destroyed.
    pub overhead_bytes: u64,
    /// When the context was created (NVML samples only the periods it existed in).
    pub created_ns: u64,
    /// Its kernels' run time per utilisation bucket (NVML's per-process `smUtil`).
    pub kernel_busy: [UtilBucket; UTIL_BUCKETS],
    /// Its copies' and memsets' run time per utilisation bucket (`memUtil`).
    pub copy_busy: [UtilBucket; UTIL_BUCKETS],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct QueuedOp {
    pub duration_ns: u64,
    /// Earliest start on the device (a kernel's submission plus the launch latency; 0 for
    /// markers and copies).
    pub ready_ns: u64,
    /// The event slot this marker completes, or `NO_EVENT`.
    pub event: u32,
    /// `OP_KERNEL` or `OP_COPY` (markers are copies of no length): which engine's
    /// utilisation its run time counts in (NVML's `smUtil` or `memUtil`).
    pub kind: u32,
}

/// `QueuedOp::kind` of a copy, a memset or a marker.
pub const OP_COPY: u32 = 0;
/// `QueuedOp::kind` of a kernel launch.
pub const OP_KERNEL: u32 = 1;

#[repr(C)]
pub struct Queue {
    pub ops: [QueuedOp; QUEUE_DEPTH],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EventSlot {
    pub state: u32,
    pub _pad: u32,
    /// `submitted` count right after the event's marker; 0 if never recorded.
    pub recorded_count: u64,
    pub completed_at_ns: u64,
}

#[repr(C)]
pub struct EventTable {
    pub slots: [EventSlot; EVENTS_PER_CONTEXT],
}

/// A physical allocation shared between processes: charged to the exporter (`owner`) until
/// no process holds a reference (a handle or a mapping) any more.
#[repr(C)]
pub struct SharedAlloc {
    pub state: u32,
    pub gpu: u32,
    pub owner: u32,
    pub _pad: u32,
    pub owner_generation: u64,
    pub generation: u64,
    pub bytes: u64,
    /// References held, per process slot.
    pub refs: [u32; MAX_PROCESSES],
}

#[repr(C)]
pub struct SharedState {
    pub magic: AtomicU64,
    pub layout_version: u64,
    pub mutex: RobustMutex,
    pub config: StoredConfig,
    pub next_generation: u64,
    pub gpus: [GpuState; MAX_GPUS],
    pub processes: [ProcessSlot; MAX_PROCESSES],
    pub contexts: [ContextState; MAX_CONTEXTS],
    pub queues: [Queue; MAX_CONTEXTS],
    pub events: [EventTable; MAX_CONTEXTS],
    pub shared_allocs: [SharedAlloc; MAX_SHARED_ALLOCS],
}

/// The state file, mapped into this process.
pub struct Region {
    ptr: NonNull<SharedState>,
}

// SAFETY: the mapping is shared memory whose mutable contents are only touched under the
// process-shared mutex; the pointer itself is immutable.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

/// Opens `path` for reading and writing, created (empty) if missing, as every process of the
/// machine may, whatever its user: the state file, and the memory images of
/// `crate::contents`.
pub(crate) fn open_shared_file(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o666)
        .open(path)
}

impl Region {
    /// Maps `dir/state`, creating and initialising it from `config` if it does not exist.
    pub fn open(dir: &Path, config: &SimConfig, now_ns: u64) -> Result<Region, SharedError> {
        std::fs::create_dir_all(dir).map_err(|source| SharedError::CreateDir {
            path: dir.display().to_string(),
            source,
        })?;
        let path = dir.join("state");
        let file = open_shared_file(&path).map_err(|source| SharedError::Open {
            path: path.display().to_string(),
            source,
        })?;
        let fd = file.as_raw_fd();
        let size = std::mem::size_of::<SharedState>();
        // Creation is serialised by an exclusive flock: two processes starting at once must not
        // both initialise the mutex.
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(SharedError::Map(std::io::Error::last_os_error()));
        }
        let result = (|| {
            let len = file.metadata().map_err(SharedError::Map)?.len();
            if len < size as u64 {
                file.set_len(size as u64).map_err(SharedError::Map)?;
            }
            // SAFETY: mapping `size` bytes of a file that is at least that long; MAP_SHARED so
            // every process sees the same memory.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if addr == libc::MAP_FAILED {
                return Err(SharedError::Map(std::io::Error::last_os_error()));
            }
            let ptr =
                NonNull::new(addr as *mut SharedState).expect("mmap never returns null on success");
            let region = Region { ptr };
            // SAFETY: the mapping is valid and at least size_of::<SharedState>() long; magic is
            // an atomic read without the mutex, which is what it is for.
            let state = unsafe { &*ptr.as_ptr() };
            if state.magic.load(Ordering::Acquire) != MAGIC {
                // SAFETY: the flock is held and the magic is not set, so no other process uses
                // the state; the file was zero-filled by set_len or holds a torn initialisation.
                unsafe { initialise(ptr.as_ptr(), config, now_ns)? };
            } else if state.layout_version != LAYOUT_VERSION {
                return Err(SharedError::Layout {
                    found: state.layout_version,
                });
            }
            Ok(region)
        })();
        // SAFETY: releasing the flock taken above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        result
    }

    pub fn state_ptr(&self) -> *mut SharedState {
        self.ptr.as_ptr()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what open mapped; no reference outlives the Region.
        unsafe {
            libc::munmap(
                self.ptr.as_ptr() as *mut libc::c_void,
                std::mem::size_of::<SharedState>(),
            )
        };
    }
}

/// # Safety
/// `state` must be mapped, writable and used by no one else.
unsafe fn initialise(
    state: *mut SharedState,
    config: &SimConfig,
    now_ns: u64,
) -> Result<(), SharedError> {
    // SAFETY: exclusive access per the contract; zeroing plain data is valid for every field.
    unsafe {
        std::ptr::write_bytes(state as *mut u8, 0, std::mem::size_of::<SharedState>());
        let s = &mut *state;
        s.layout_version = LAYOUT_VERSION;
        s.config = StoredConfig {
            gpus: config.gpus,
            sms: config.sms,
            memory_bytes: config.memory_bytes,
            slice_ns: config.slice_ns,
            switch_ns: config.switch_ns,
            host_copy_bytes_per_s: config.host_copy_bytes_per_s,
            device_copy_bytes_per_s: config.device_copy_bytes_per_s,
            checkpoint_copy_bytes_per_s: config.checkpoint_copy_bytes_per_s,
            default_kernel_ns: config.default_kernel_ns,
            cuda_version: config.cuda_version as i64,
            context_memory_bytes: config.context_memory_bytes,
            module_memory_bytes: config.module_memory_bytes,
            launch_host_ns: config.launch_host_ns,
            launch_latency_ns: config.launch_latency_ns,
            reserved_memory_bytes: config.reserved_memory_bytes,
        };
        s.next_generation = 1;
        for gpu in s.gpus.iter_mut() {
            gpu.engine = Engine::new(now_ns);
            gpu.created_ns = now_ns;
        }
        RobustMutex::init(&mut s.mutex)?;
        s.magic.store(MAGIC, Ordering::Release);
    }
    Ok(())
}
