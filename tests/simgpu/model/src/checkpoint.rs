//! CUDA checkpointing as the driver offers it from r570 (cuda.h, "CUDA Checkpointing"): another
//! process locks a CUDA process by pid (its driver calls then block), checkpoints it (its
//! device memory moves to the host and leaves the GPU), restores it (the memory comes back,
//! at the same device addresses) and unlocks it.
//!
//! The transitions are a pure function ([`next_phase`]); the operations on the shared state
//! apply them under the device mutex; the waits (a lock draining submitted work, the copies'
//! time at `checkpoint_copy_bytes_per_s`) happen outside it.

use crate::contents::Side;
use crate::device::{sleep_until, ContextId, Device, DeviceError, Locked, ProcessId};
use crate::shared::{ProcessSlot, MAX_CONTEXTS, MAX_GPUS, MAX_PROCESSES, SLOT_LIVE};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The process holds IPC memory (exported or imported): the driver cannot checkpoint it.
pub const REFUSE_IPC: u32 = 1;
/// The process holds managed (unified) memory: the driver cannot checkpoint it.
pub const REFUSE_MANAGED: u32 = 2;

/// How often a process whose calls are held looks whether it may proceed.
const HELD_CALL_POLL: Duration = Duration::from_millis(1);

/// `CUprocessState`, what `cuCheckpointProcessGetState` reports (cuda.h values).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    Running = 0,
    Locked = 1,
    Checkpointed = 2,
    Failed = 3,
}

/// The model's phase of a process: `ProcessState` plus `Locking`, a lock still waiting for the
/// work the process submitted before it (reported as RUNNING, as the lock has not succeeded
/// yet, but already holding the process's new calls).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Running,
    Locking,
    Locked,
    Checkpointed,
    Failed,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::Running,
        Phase::Locking,
        Phase::Locked,
        Phase::Checkpointed,
        Phase::Failed,
    ];

    fn raw(self) -> u32 {
        self as u32
    }

    fn from_raw(raw: u32) -> Phase {
        Phase::ALL
            .into_iter()
            .find(|p| p.raw() == raw)
            .unwrap_or(Phase::Failed)
    }

    pub fn reported(self) -> ProcessState {
        match self {
            Phase::Running | Phase::Locking => ProcessState::Running,
            Phase::Locked => ProcessState::Locked,
            Phase::Checkpointed => ProcessState::Checkpointed,
            Phase::Failed => ProcessState::Failed,
        }
    }

    /// Whether the process's own driver calls wait (the driver's API locks are taken).
    pub fn holds_calls(self) -> bool {
        matches!(self, Phase::Locking | Phase::Locked | Phase::Checkpointed)
    }
}

/// A checkpoint API operation on a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

/// The phase `step` leads to from `from`, or `None` where the driver refuses it
/// (`CUDA_ERROR_ILLEGAL_STATE`): lock only a running process, checkpoint only a locked one,
/// restore only a checkpointed one (it comes back locked), unlock only a locked one.
pub fn next_phase(from: Phase, step: Step) -> Option<Phase> {
    match (from, step) {
        (Phase::Running, Step::Lock) => Some(Phase::Locking),
        (Phase::Locked, Step::Checkpoint) => Some(Phase::Checkpointed),
        (Phase::Checkpointed, Step::Restore) => Some(Phase::Locked),
        (Phase::Locked, Step::Unlock) => Some(Phase::Running),
        _ => None,
    }
}

/// How long moving `bytes` at `bytes_per_s` takes.
pub fn copy_ns(bytes: u64, bytes_per_s: u64) -> u64 {
    (bytes as u128 * 1_000_000_000 / bytes_per_s.max(1) as u128) as u64
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("no process of the simulated driver has pid {0}")]
    NoSuchProcess(u32),
    #[error("cannot {step:?} a process that is {phase:?}")]
    IllegalState { step: Step, phase: Phase },
    #[error("the work the process submitted did not finish within timeoutMs = {timeout_ms}")]
    LockTimeout { timeout_ms: u32 },
    #[error("the process holds IPC or managed memory, which cannot be checkpointed")]
    Unsupported,
    #[error("restoring needs {needed} bytes on GPU {gpu}, {free} are free")]
    OutOfMemory { gpu: usize, needed: u64, free: u64 },
    #[error("cannot move the process's memory contents: {0}")]
    Image(#[from] crate::contents::ImageError),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// A fresh or departing process slot: running, nothing refused, nothing checkpointed.
pub(crate) fn reset(p: &mut ProcessSlot) {
    p.checkpoint_phase
        .store(Phase::Running.raw(), Ordering::SeqCst);
    p.calls_in_flight.store(0, Ordering::SeqCst);
    p.checkpoint_refusals = 0;
    p.checkpointed = [0; MAX_GPUS];
}

/// Whether a checkpoint has moved the process off the GPU.
pub(crate) fn is_checkpointed(p: &ProcessSlot) -> bool {
    Phase::from_raw(p.checkpoint_phase.load(Ordering::SeqCst)) == Phase::Checkpointed
}

impl Locked<'_> {
    /// The live process of the simulated driver that the caller knows as `pid` (in its own PID
    /// namespace).
    pub fn find_process(&self, pid: u32) -> Result<ProcessId, CheckpointError> {
        (0..MAX_PROCESSES)
            .find(|&slot| {
                let p = &self.state.processes[slot];
                p.state == SLOT_LIVE && crate::pidns::resolve_pid(p.ns, p.pid) == Some(pid)
            })
            .map(|slot| ProcessId {
                slot: slot as u32,
                generation: self.state.processes[slot].generation,
            })
            .ok_or(CheckpointError::NoSuchProcess(pid))
    }

    pub fn checkpoint_phase(&self, p: ProcessId) -> Result<Phase, CheckpointError> {
        let slot = self.process_slot(p)?;
        Ok(Phase::from_raw(
            self.state.processes[slot]
                .checkpoint_phase
                .load(Ordering::SeqCst),
        ))
    }

    fn step(&mut self, p: ProcessId, step: Step) -> Result<usize, CheckpointError> {
        let phase = self.checkpoint_phase(p)?;
        let next = next_phase(phase, step).ok_or(CheckpointError::IllegalState { step, phase })?;
        let slot = self.process_slot(p)?;
        self.set_phase(slot, next);
        Ok(slot)
    }

    fn set_phase(&mut self, slot: usize, phase: Phase) {
        self.state.processes[slot]
            .checkpoint_phase
            .store(phase.raw(), Ordering::SeqCst);
    }

    /// Marks `p` as holding memory the driver cannot checkpoint (`REFUSE_*` bits).
    pub fn refuse_checkpoint(&mut self, p: ProcessId, reason: u32) -> Result<(), DeviceError> {
        let slot = self.process_slot(p)?;
        self.state.processes[slot].checkpoint_refusals |= reason;
        Ok(())
    }

    /// `None` once every operation `p` submitted has completed; else when the model expects
    /// the next look to be worth it (no later than one wait slice from now).
    fn pending_work_until(&mut self, p: ProcessId) -> Result<Option<u64>, CheckpointError> {
        let slot = self.process_slot(p)? as u32;
        let limit = self.now_ns + crate::device::MAX_WAIT_SLICE_NS;
        let mut wake: Option<u64> = None;
        for c in 0..MAX_CONTEXTS {
            let ctx = &self.state.contexts[c];
            if ctx.state != SLOT_LIVE || ctx.process != slot {
                continue;
            }
            let (id, submitted) = (
                ContextId {
                    slot: c as u32,
                    generation: ctx.generation,
                },
                ctx.submitted,
            );
            if self.completed_count(id)? >= submitted {
                continue;
            }
            let at = self
                .predict_completion(id, submitted, limit)?
                .unwrap_or(limit);
            wake = Some(wake.map_or(at, |w| w.min(at)));
        }
        Ok(wake.map(|w| w.min(limit)))
    }

    /// Moves `p`'s device memory off the GPU; returns the bytes to copy.
    fn checkpoint_memory(&mut self, p: ProcessId) -> Result<u64, CheckpointError> {
        let phase = self.checkpoint_phase(p)?;
        next_phase(phase, Step::Checkpoint).ok_or(CheckpointError::IllegalState {
            step: Step::Checkpoint,
            phase,
        })?;
        let slot = self.process_slot(p)?;
        if self.state.processes[slot].checkpoint_refusals != 0 {
            return Err(CheckpointError::Unsupported);
        }
        self.move_image(p, Side::Device, Side::Host)?;
        self.step(p, Step::Checkpoint)?;
        let mut total = 0;
        for gpu in 0..MAX_GPUS {
            let process = &mut self.state.processes[slot];
            let bytes = std::mem::take(&mut process.memory[gpu]);
            process.checkpointed[gpu] += bytes;
            let used = &mut self.state.gpus[gpu].memory_used;
            *used = used.saturating_sub(bytes);
            total += bytes;
        }
        Ok(total)
    }

    /// Brings `p`'s checkpointed memory back onto the GPU if all of it fits; returns the bytes
    /// to copy.
    fn restore_memory(&mut self, p: ProcessId) -> Result<u64, CheckpointError> {
        let phase = self.checkpoint_phase(p)?;
        next_phase(phase, Step::Restore).ok_or(CheckpointError::IllegalState {
            step: Step::Restore,
            phase,
        })?;
        let slot = self.process_slot(p)?;
        let capacity = self.state.config.allocatable_bytes();
        for gpu in 0..MAX_GPUS {
            let needed = self.state.processes[slot].checkpointed[gpu];
            let free = capacity.saturating_sub(self.state.gpus[gpu].memory_used);
            if needed > free {
                return Err(CheckpointError::OutOfMemory { gpu, needed, free });
            }
        }
        self.move_image(p, Side::Host, Side::Device)?;
        self.step(p, Step::Restore)?;
        let mut total = 0;
        for gpu in 0..MAX_GPUS {
            let process = &mut self.state.processes[slot];
            let bytes = std::mem::take(&mut process.checkpointed[gpu]);
            process.memory[gpu] += bytes;
            self.state.gpus[gpu].memory_used += bytes;
            total += bytes;
        }
        Ok(total)
    }
}

impl Locked<'_> {
    /// Moves `p`'s memory contents between the device and the host (`crate::contents`), and
    /// tells its driver to reopen them.
    fn move_image(&mut self, p: ProcessId, from: Side, to: Side) -> Result<(), CheckpointError> {
        let slot = self.process_slot(p)?;
        self.device.images().move_image(p, from, to)?;
        self.state.processes[slot]
            .images_moved
            .fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl Device {
    /// How many times a checkpoint or restore has moved `p`'s memory image: its driver
    /// reopens the image when this changes.
    pub fn images_moved(&self, p: ProcessId) -> u64 {
        self.process_atomics(p).images_moved.load(Ordering::SeqCst)
    }

    fn process_atomics(&self, p: ProcessId) -> &ProcessSlot {
        let state = self.region.state_ptr();
        // SAFETY: the mapping lives as long as `self`; only the slot's atomics are used through
        // this reference (`checkpoint_phase`, `calls_in_flight`, `images_moved`), which are
        // meant to be read and written without the mutex.
        unsafe { &(*state).processes[p.slot as usize] }
    }

    /// Whether `p`'s driver calls must wait now (it is locking, locked or checkpointed).
    pub fn calls_held(&self, p: ProcessId) -> bool {
        let phase = &self.process_atomics(p).checkpoint_phase;
        Phase::from_raw(phase.load(Ordering::SeqCst)).holds_calls()
    }

    /// Enters a driver call of `p` (its own): waits while its calls are held (its other
    /// threads run on), then counts the call in flight until [`Device::leave_call`].
    ///
    /// Counting before looking, and the lock setting the phase before counting (both
    /// sequentially consistent), means a call either sees the lock and waits, or the lock sees
    /// the call and waits for it to leave.
    pub fn enter_call(&self, p: ProcessId) {
        let in_flight = &self.process_atomics(p).calls_in_flight;
        loop {
            in_flight.fetch_add(1, Ordering::SeqCst);
            if !self.calls_held(p) {
                return;
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
            std::thread::sleep(HELD_CALL_POLL);
        }
    }

    pub fn leave_call(&self, p: ProcessId) {
        let in_flight = &self.process_atomics(p).calls_in_flight;
        // Never below zero: a reset (the slot reaped and taken again) may have cleared it.
        let _ = in_flight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// `cuCheckpointProcessGetState`.
    pub fn process_state(&self, pid: u32) -> Result<ProcessState, CheckpointError> {
        let locked = self.lock()?;
        let p = locked.find_process(pid)?;
        Ok(locked.checkpoint_phase(p)?.reported())
    }

    /// `cuCheckpointProcessLock`: holds the process's new calls, then waits until the calls
    /// under way have left and the work it had submitted has completed on the model's clock. Past `timeout_ms` (0: no limit) it
    /// lets the process run again and fails, leaving it RUNNING.
    pub fn lock_process(&self, pid: u32, timeout_ms: u32) -> Result<(), CheckpointError> {
        let (p, deadline) = {
            let mut locked = self.lock()?;
            let p = locked.find_process(pid)?;
            locked.step(p, Step::Lock)?;
            let deadline = (timeout_ms > 0).then(|| locked.now_ns + timeout_ms as u64 * 1_000_000);
            (p, deadline)
        };
        loop {
            let mut locked = self.lock()?;
            let slot = locked.process_slot(p)?;
            let calls = locked.state.processes[slot]
                .calls_in_flight
                .load(Ordering::SeqCst);
            let wake = match locked.pending_work_until(p)? {
                None if calls == 0 => {
                    locked.set_phase(slot, Phase::Locked);
                    return Ok(());
                }
                None => locked.now_ns + HELD_CALL_POLL.as_nanos() as u64,
                Some(wake) => wake,
            };
            if deadline.is_some_and(|d| locked.now_ns >= d) {
                locked.set_phase(slot, Phase::Running);
                return Err(CheckpointError::LockTimeout { timeout_ms });
            }
            let now = locked.now_ns;
            drop(locked);
            sleep_until(wake.min(deadline.unwrap_or(u64::MAX)).max(now + 1));
        }
    }

    /// `cuCheckpointProcessCheckpoint`: the memory leaves the GPU at once (NVML and
    /// `cuMemGetInfo` show it free); the call returns when the copy to the host has taken its
    /// time at the checkpoint bandwidth.
    pub fn checkpoint_process(&self, pid: u32) -> Result<u64, CheckpointError> {
        let bytes = {
            let mut locked = self.lock()?;
            let p = locked.find_process(pid)?;
            locked.checkpoint_memory(p)?
        };
        self.copy_time(bytes);
        Ok(bytes)
    }

    /// `cuCheckpointProcessRestore`: takes the memory back on the GPU (all of it or nothing),
    /// then returns when the copy from the host has taken its time. The process stays locked.
    pub fn restore_process(&self, pid: u32) -> Result<u64, CheckpointError> {
        let bytes = {
            let mut locked = self.lock()?;
            let p = locked.find_process(pid)?;
            locked.restore_memory(p)?
        };
        self.copy_time(bytes);
        Ok(bytes)
    }

    /// `cuCheckpointProcessUnlock`: the process's calls proceed.
    pub fn unlock_process(&self, pid: u32) -> Result<(), CheckpointError> {
        let mut locked = self.lock()?;
        let p = locked.find_process(pid)?;
        locked.step(p, Step::Unlock)?;
        Ok(())
    }

    fn copy_time(&self, bytes: u64) {
        let ns = copy_ns(bytes, self.config().checkpoint_copy_bytes_per_s);
        std::thread::sleep(Duration::from_nanos(ns));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_follow_the_driver() {
        use Phase::*;
        use Step::*;
        let table = [
            (Running, Lock, Some(Locking)),
            (Running, Checkpoint, None),
            (Running, Restore, None),
            (Running, Unlock, None),
            (Locking, Lock, None),
            (Locking, Checkpoint, None),
            (Locking, Restore, None),
            (Locking, Unlock, None),
            (Locked, Lock, None),
            (Locked, Checkpoint, Some(Checkpointed)),
            (Locked, Restore, None),
            (Locked, Unlock, Some(Running)),
            (Checkpointed, Lock, None),
            (Checkpointed, Checkpoint, None),
            (Checkpointed, Restore, Some(Locked)),
            (Checkpointed, Unlock, None),
            (Failed, Lock, None),
            (Failed, Checkpoint, None),
            (Failed, Restore, None),
            (Failed, Unlock, None),
        ];
        for (from, step, to) in table {
            assert_eq!(next_phase(from, step), to, "{step:?} from {from:?}");
        }
    }

    #[test]
    fn phases_report_cuda_states_and_hold_calls_while_suspended() {
        let table = [
            (Phase::Running, ProcessState::Running, false),
            (Phase::Locking, ProcessState::Running, true),
            (Phase::Locked, ProcessState::Locked, true),
            (Phase::Checkpointed, ProcessState::Checkpointed, true),
            (Phase::Failed, ProcessState::Failed, false),
        ];
        for (phase, state, held) in table {
            assert_eq!(phase.reported(), state, "{phase:?}");
            assert_eq!(phase.holds_calls(), held, "{phase:?}");
            assert_eq!(Phase::from_raw(phase.raw()), phase);
        }
        assert_eq!(ProcessState::Checkpointed as i32, 2);
    }

    #[test]
    fn copies_take_bytes_over_bandwidth() {
        assert_eq!(copy_ns(25_000_000_000, 25_000_000_000), 1_000_000_000);
        assert_eq!(copy_ns(1 << 30, 25_000_000_000), 42_949_672);
        assert_eq!(copy_ns(0, 25_000_000_000), 0);
    }

    #[test]
    fn a_process_with_ipc_memory_locks_but_cannot_be_checkpointed() {
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_MEMORY", "4Gi"), ("SIMGPU_CONTEXT_MEMORY", "0")];
        let (exporter, importer) = (
            crate::device::tests::device(dir.path(), &vars),
            crate::device::tests::device(dir.path(), &vars),
        );
        let pid = std::process::id();
        let p = exporter.lock().unwrap().attach_process().unwrap();
        let mut l = exporter.lock().unwrap();
        l.reserve_memory(p, 0, 1 << 30).unwrap();
        let id = l.share_allocation(p, 0, 1 << 30).unwrap();
        drop(l);
        exporter.lock_process(pid, 0).unwrap();
        assert!(matches!(
            exporter.checkpoint_process(pid),
            Err(CheckpointError::Unsupported)
        ));
        assert_eq!(exporter.process_state(pid).unwrap(), ProcessState::Locked);
        assert_eq!(exporter.lock().unwrap().memory_info(0).0, 3 << 30);
        exporter.unlock_process(pid).unwrap();

        // The importer (this test's pid too, alone once the exporter is gone) is refused alike.
        let q = importer.lock().unwrap().attach_process().unwrap();
        importer.lock().unwrap().import_allocation(q, id).unwrap();
        exporter.simulate_death(p);
        importer.lock().unwrap().reap_dead();
        importer.lock_process(pid, 0).unwrap();
        assert!(matches!(
            importer.checkpoint_process(pid),
            Err(CheckpointError::Unsupported)
        ));
    }

    #[test]
    fn a_process_without_shared_memory_checkpoints_and_restores_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_MEMORY", "4Gi"), ("SIMGPU_CONTEXT_MEMORY", "0")];
        let device = crate::device::tests::device(dir.path(), &vars);
        let pid = std::process::id();
        let p = device.lock().unwrap().attach_process().unwrap();
        device
            .lock()
            .unwrap()
            .reserve_memory(p, 0, 1 << 30)
            .unwrap();
        device.lock_process(pid, 0).unwrap();
        assert_eq!(device.checkpoint_process(pid).unwrap(), 1 << 30);
        assert_eq!(device.lock().unwrap().memory_info(0).0, 4 << 30);
        assert_eq!(device.restore_process(pid).unwrap(), 1 << 30);
        assert_eq!(device.lock().unwrap().memory_info(0).0, 3 << 30);
        assert_eq!(device.process_state(pid).unwrap(), ProcessState::Locked);
    }

    #[test]
    fn a_checkpoint_moves_the_memory_image_to_the_host_and_a_restore_brings_it_back() {
        use crate::contents::Side;
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_MEMORY", "4Gi"), ("SIMGPU_CONTEXT_MEMORY", "0")];
        let (device, other) = (
            crate::device::tests::device(dir.path(), &vars),
            crate::device::tests::device(dir.path(), &vars),
        );
        let pid = std::process::id();
        let p = device.lock().unwrap().attach_process().unwrap();
        device
            .lock()
            .unwrap()
            .reserve_memory(p, 0, 3 << 30)
            .unwrap();
        let images = device.images().clone();
        images
            .open_device(p)
            .unwrap()
            .write(4096, b"contents")
            .unwrap();
        let (on_device, on_host) = (images.path(Side::Device, p), images.path(Side::Host, p));
        let moved = device.images_moved(p);

        device.lock_process(pid, 0).unwrap();
        device.checkpoint_process(pid).unwrap();
        assert!(!on_device.exists(), "no device image while checkpointed");
        assert!(on_host.exists());
        assert_eq!(device.images_moved(p), moved + 1, "the driver reopens it");

        // Another process takes the memory: the restore fails and the image stays on the host.
        let q = other.lock().unwrap().attach_process().unwrap();
        other.lock().unwrap().reserve_memory(q, 0, 2 << 30).unwrap();
        assert!(matches!(
            device.restore_process(pid),
            Err(CheckpointError::OutOfMemory { .. })
        ));
        assert!(!on_device.exists() && on_host.exists());
        assert_eq!(device.images_moved(p), moved + 1);
        other.lock().unwrap().release_memory(q, 0, 2 << 30).unwrap();

        device.restore_process(pid).unwrap();
        assert!(!on_host.exists());
        let mut back = [0u8; 10];
        images
            .open_device(p)
            .unwrap()
            .read(4095, &mut back)
            .unwrap();
        assert_eq!(&back, b"\0contents\0");
        assert_eq!(device.images_moved(p), moved + 2);
    }

    #[test]
    fn a_process_that_dies_checkpointed_or_not_leaves_no_image() {
        use crate::contents::Side;
        let dir = tempfile::tempdir().unwrap();
        let vars = [("SIMGPU_CONTEXT_MEMORY", "0")];
        let (first, second, reaper) = (
            crate::device::tests::device(dir.path(), &vars),
            crate::device::tests::device(dir.path(), &vars),
            crate::device::tests::device(dir.path(), &vars),
        );
        let images = reaper.images().clone();
        let running = first.lock().unwrap().attach_process().unwrap();
        images.open_device(running).unwrap().write(0, b"x").unwrap();
        // This test's pid belongs to both; the checkpoint finds the first live one, so the
        // checkpointed process is attached once the other is dead.
        first.simulate_death(running);
        reaper.lock().unwrap().reap_dead();
        assert!(!images.path(Side::Device, running).exists());

        let checkpointed = second.lock().unwrap().attach_process().unwrap();
        images
            .open_device(checkpointed)
            .unwrap()
            .write(0, b"y")
            .unwrap();
        let pid = std::process::id();
        second.lock_process(pid, 0).unwrap();
        second.checkpoint_process(pid).unwrap();
        assert!(images.path(Side::Host, checkpointed).exists());
        second.simulate_death(checkpointed);
        reaper.lock().unwrap().reap_dead();
        assert!(!images.path(Side::Host, checkpointed).exists());
        assert_eq!(
            std::fs::read_dir(dir.path().join(crate::contents::MEMORY_DIR))
                .unwrap()
                .count(),
            0,
            "nothing left in the memory directory"
        );
    }

    #[test]
    fn a_lock_waits_for_the_calls_under_way_to_leave() {
        let dir = tempfile::tempdir().unwrap();
        let device = crate::device::tests::device(dir.path(), &[("SIMGPU_CONTEXT_MEMORY", "0")]);
        let pid = std::process::id();
        let p = device.lock().unwrap().attach_process().unwrap();
        device.enter_call(p);
        assert!(matches!(
            device.lock_process(pid, 50),
            Err(CheckpointError::LockTimeout { timeout_ms: 50 })
        ));
        assert_eq!(device.process_state(pid).unwrap(), ProcessState::Running);
        assert!(!device.calls_held(p), "a failed lock lets the calls go");
        device.leave_call(p);
        device.lock_process(pid, 0).unwrap();
        assert!(device.calls_held(p));
        device.unlock_process(pid).unwrap();
        assert!(!device.calls_held(p));
    }
}
