//! The driver's checkpoint API (cuda.h "CUDA Checkpointing", r570+), called on another
//! process by pid: lock it (its CUDA calls then wait; the lock itself waits for the work it
//! submitted), checkpoint it (its device memory moves to host memory the driver keeps, and
//! leaves the GPU), restore it (back at the same addresses; it stays locked) and unlock it.
//!
//! The reclaim calls it through [`CheckpointDriver`], so its decisions are tested without a
//! driver; [`CudaCheckpoint`] loads `libcuda.so.1` at run time (the arbiter never links it:
//! it must start on a node whose driver is older, with reclaim off).

use std::ffi::{c_int, c_uint};
use std::time::Duration;

/// `CUprocessState` as `cuCheckpointProcessGetState` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    /// A checkpoint or restore failed: the process cannot run on.
    Failed,
}

/// A driver call that failed, by what the reclaim does about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// `CUDA_ERROR_INVALID_VALUE`: no CUDA process has this pid (it exited).
    #[error("no CUDA process has pid {0}")]
    NoSuchProcess(u32),
    /// `CUDA_ERROR_NOT_READY` from the lock: the work the process submitted did not
    /// finish within the lock's timeout.
    #[error("the process's submitted work did not finish within the lock timeout")]
    LockTimeout,
    /// `CUDA_ERROR_NOT_SUPPORTED`: it holds memory the driver cannot checkpoint (IPC,
    /// managed).
    #[error("the driver cannot checkpoint this process (it holds IPC or managed memory)")]
    NotSupported,
    /// `CUDA_ERROR_OUT_OF_MEMORY` from a restore: its memory does not fit on the GPU now.
    #[error("the process's memory does not fit on the GPU now")]
    OutOfMemory,
    /// `CUDA_ERROR_ILLEGAL_STATE`: the step does not apply to the process's state.
    #[error("the process is not in a state this step applies to")]
    IllegalState,
    #[error("{call} failed: CUDA error {code}")]
    Other { call: &'static str, code: i32 },
}

/// The checkpoint API, one process at a time.
pub trait CheckpointDriver: Send + Sync {
    fn state(&self, pid: u32) -> Result<ProcessState, DriverError>;
    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError>;
    fn checkpoint(&self, pid: u32) -> Result<(), DriverError>;
    fn restore(&self, pid: u32) -> Result<(), DriverError>;
    fn unlock(&self, pid: u32) -> Result<(), DriverError>;
}

/// The CUDA error codes the API returns (cuda.h).
const CUDA_SUCCESS: i32 = 0;
const CUDA_ERROR_INVALID_VALUE: i32 = 1;
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
const CUDA_ERROR_ILLEGAL_STATE: i32 = 401;
const CUDA_ERROR_NOT_READY: i32 = 600;
const CUDA_ERROR_NOT_SUPPORTED: i32 = 801;

/// What a CUDA result means for the reclaim.
pub fn classify(call: &'static str, pid: u32, code: i32) -> Result<(), DriverError> {
    match code {
        CUDA_SUCCESS => Ok(()),
        CUDA_ERROR_INVALID_VALUE => Err(DriverError::NoSuchProcess(pid)),
        CUDA_ERROR_NOT_READY => Err(DriverError::LockTimeout),
        CUDA_ERROR_NOT_SUPPORTED => Err(DriverError::NotSupported),
        CUDA_ERROR_OUT_OF_MEMORY => Err(DriverError::OutOfMemory),
        CUDA_ERROR_ILLEGAL_STATE => Err(DriverError::IllegalState),
        code => Err(DriverError::Other { call, code }),
    }
}

/// `CUprocessState`'s values (cuda.h).
pub fn process_state(raw: c_int) -> Option<ProcessState> {
    match raw {
        0 => Some(ProcessState::Running),
        1 => Some(ProcessState::Locked),
        2 => Some(ProcessState::Checkpointed),
        3 => Some(ProcessState::Failed),
        _ => None,
    }
}

/// Every step's optional argument block is 64 bytes (`CUcheckpoint*Args`); only the
/// lock's has a field (`timeoutMs`, its first 32 bits), the rest must be zero.
#[repr(C)]
struct ArgBlock([u64; 8]);

type StepFn = unsafe extern "C" fn(c_int, *mut ArgBlock) -> c_int;
type GetStateFn = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type InitFn = unsafe extern "C" fn(c_uint) -> c_int;

/// The API from the CUDA driver library, loaded at run time.
pub struct CudaCheckpoint {
    get_state: GetStateFn,
    lock: StepFn,
    checkpoint: StepFn,
    restore: StepFn,
    unlock: StepFn,
    /// Keeps the functions above loaded.
    _library: libloading::Library,
}

impl CudaCheckpoint {
    /// Loads `library` and initialises the driver (no context is created: the calls
    /// act on other processes).
    pub fn load(library: &str) -> Result<CudaCheckpoint, String> {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no
        // preconditions on the loading process.
        let lib = unsafe { libloading::Library::new(library) }
            .map_err(|e| format!("cannot load {library}: {e}"))?;
        // SAFETY: each name is looked up with the signature cuda.h gives it.
        let (init, get_state, lock, checkpoint, restore, unlock) = unsafe {
            let sym = |name: &str| {
                format!("{library} has no {name} (the checkpoint API needs driver r570 or later)")
            };
            (
                *lib.get::<InitFn>(b"cuInit\0").map_err(|_| sym("cuInit"))?,
                *lib.get::<GetStateFn>(b"cuCheckpointProcessGetState\0")
                    .map_err(|_| sym("cuCheckpointProcessGetState"))?,
                *lib.get::<StepFn>(b"cuCheckpointProcessLock\0")
                    .map_err(|_| sym("cuCheckpointProcessLock"))?,
                *lib.get::<StepFn>(b"cuCheckpointProcessCheckpoint\0")
                    .map_err(|_| sym("cuCheckpointProcessCheckpoint"))?,
                *lib.get::<StepFn>(b"cuCheckpointProcessRestore\0")
                    .map_err(|_| sym("cuCheckpointProcessRestore"))?,
                *lib.get::<StepFn>(b"cuCheckpointProcessUnlock\0")
                    .map_err(|_| sym("cuCheckpointProcessUnlock"))?,
            )
        };
        // SAFETY: cuInit takes flags, which must be 0.
        let rc = unsafe { init(0) };
        if rc != CUDA_SUCCESS {
            return Err(format!("cuInit failed in {library}: CUDA error {rc}"));
        }
        Ok(CudaCheckpoint {
            get_state,
            lock,
            checkpoint,
            restore,
            unlock,
            _library: lib,
        })
    }

    fn step(
        &self,
        call: &'static str,
        f: StepFn,
        pid: u32,
        timeout_ms: u32,
    ) -> Result<(), DriverError> {
        let mut args = ArgBlock([0; 8]);
        args.0[0] = u64::from(timeout_ms);
        // SAFETY: a pid and a live, zeroed 64-byte argument block, as cuda.h specifies.
        let rc = unsafe { f(pid as c_int, &mut args) };
        classify(call, pid, rc)
    }
}

impl CheckpointDriver for CudaCheckpoint {
    fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        let mut raw: c_int = -1;
        // SAFETY: a pid and a live out-parameter.
        let rc = unsafe { (self.get_state)(pid as c_int, &mut raw) };
        classify("cuCheckpointProcessGetState", pid, rc)?;
        process_state(raw).ok_or(DriverError::Other {
            call: "cuCheckpointProcessGetState",
            code: raw,
        })
    }

    fn lock(&self, pid: u32, timeout: Duration) -> Result<(), DriverError> {
        let ms = u32::try_from(timeout.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        self.step("cuCheckpointProcessLock", self.lock, pid, ms)
    }

    fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        self.step("cuCheckpointProcessCheckpoint", self.checkpoint, pid, 0)
    }

    fn restore(&self, pid: u32) -> Result<(), DriverError> {
        self.step("cuCheckpointProcessRestore", self.restore, pid, 0)
    }

    fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        self.step("cuCheckpointProcessUnlock", self.unlock, pid, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_results_map_to_what_the_reclaim_does() {
        for (code, expected) in [
            (0, Ok(())),
            (1, Err(DriverError::NoSuchProcess(7))),
            (2, Err(DriverError::OutOfMemory)),
            (401, Err(DriverError::IllegalState)),
            (600, Err(DriverError::LockTimeout)),
            (801, Err(DriverError::NotSupported)),
            (
                999,
                Err(DriverError::Other {
                    call: "x",
                    code: 999,
                }),
            ),
        ] {
            assert_eq!(classify("x", 7, code), expected, "{code}");
        }
        assert_eq!(process_state(2), Some(ProcessState::Checkpointed));
        assert_eq!(process_state(4), None);
    }

    #[test]
    fn a_library_without_the_api_is_refused_by_name() {
        let err = CudaCheckpoint::load("libdoes-not-exist.so.1")
            .err()
            .unwrap();
        assert!(err.contains("libdoes-not-exist.so.1"), "{err}");
    }
}
