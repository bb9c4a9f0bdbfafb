//! The checkpoint API (`cuCheckpointProcess*`) as a controller uses it: this test process
//! calls it through `libcuda.so.1` on workloads running beside it, by pid.

mod common;
use common::{f, Lib, Sim, P1, P2};
use libc::{c_int, c_uint, c_void};
use nvml_wrapper::enums::device::UsedGpuMemory;
use std::process::Child;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const GIB: u64 = 1 << 30;
/// A workload's context and lazily loaded module (the defaults), besides its allocations.
const OVERHEAD: u64 = (300 << 20) + (2 << 20);

const RUNNING: c_int = 0;
const LOCKED: c_int = 1;
const CHECKPOINTED: c_int = 2;

const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const OUT_OF_MEMORY: c_int = 2;
const ILLEGAL_STATE: c_int = 401;
const NOT_READY: c_int = 600;
const NOT_SUPPORTED: c_int = 801;

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Default)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// One simulated GPU for the whole file (the driver reads `SIMGPU_*` once per process); the
/// tests take turns, as they assert on the GPU's free memory.
fn sim() -> &'static Sim {
    static SIM: OnceLock<Sim> = OnceLock::new();
    SIM.get_or_init(|| {
        Sim::new(&[
            ("SIMGPU_GPUS", "1"),
            ("SIMGPU_MEMORY", "4Gi"),
            ("SIMGPU_RESERVED_MEMORY", "0"),
            ("SIMGPU_CHECKPOINT_GBPS", "50"),
        ])
    })
}

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

/// The controller: the checkpoint API of the installed driver, in this process.
struct Controller {
    lib: Lib,
}

impl Controller {
    fn new() -> Controller {
        static LIB: OnceLock<()> = OnceLock::new();
        let lib = Lib::open(sim());
        LIB.get_or_init(|| {
            // SAFETY: cuInit with the only valid flags.
            assert_eq!(unsafe { lib.f::<P1<c_uint>>("cuInit")(0) }, SUCCESS);
        });
        Controller { lib }
    }

    fn state(&self, pid: u32) -> Result<c_int, c_int> {
        let mut state = -1;
        // SAFETY: a valid out-pointer.
        let code = unsafe {
            self.lib
                .f::<P2<c_int, *mut c_int>>("cuCheckpointProcessGetState")(
                pid as c_int, &mut state
            )
        };
        if code == SUCCESS {
            Ok(state)
        } else {
            Err(code)
        }
    }

    fn lock(&self, pid: u32, timeout_ms: c_uint) -> c_int {
        let args = LockArgs {
            timeout_ms,
            ..LockArgs::default()
        };
        // SAFETY: valid arguments.
        unsafe {
            self.lib
                .f::<P2<c_int, *const LockArgs>>("cuCheckpointProcessLock")(
                pid as c_int, &args
            )
        }
    }

    /// Checkpoint, Restore or Unlock, with no arguments (all optional).
    fn call(&self, name: &str, pid: u32) -> c_int {
        // SAFETY: NULL optional arguments.
        unsafe { self.lib.f::<P2<c_int, *const c_void>>(name)(pid as c_int, std::ptr::null()) }
    }

    fn checkpoint(&self, pid: u32) -> c_int {
        self.call("cuCheckpointProcessCheckpoint", pid)
    }

    fn restore(&self, pid: u32) -> c_int {
        self.call("cuCheckpointProcessRestore", pid)
    }

    fn unlock(&self, pid: u32) -> c_int {
        self.call("cuCheckpointProcessUnlock", pid)
    }
}

/// Operations `pid` has submitted and completed on GPU 0 (all its contexts).
fn work(pid: u32) -> (u64, u64) {
    let model = sim().model();
    let snap = model.lock().unwrap().snapshot(0).unwrap();
    snap.contexts
        .iter()
        .filter(|c| c.pid == pid)
        .fold((0, 0), |(s, c), ctx| (s + ctx.submitted, c + ctx.completed))
}

fn nvml_used(gpu: &nvml_wrapper::Device, pid: u32) -> Option<u64> {
    gpu.running_compute_processes()
        .unwrap()
        .iter()
        .find(|p| p.pid == pid)
        .map(|p| match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => b,
            UsedGpuMemory::Unavailable => u64::MAX,
        })
}

/// Starts a workload and waits until it holds `held` bytes and has submitted work.
fn start(args: &str, held: u64) -> Child {
    let args: Vec<&str> = args.split_whitespace().collect();
    let child = sim().workload(&args).spawn().unwrap();
    let pid = child.id();
    let nvml = sim().nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    assert!(
        common::eventually(Duration::from_secs(30), || nvml_used(&gpu, pid)
            == Some(held)
            && work(pid).0 > 0),
        "workload {pid} never held {held} bytes with work submitted"
    );
    child
}

#[test]
fn lock_checkpoint_restore_unlock_keeps_the_process_and_frees_its_memory_meanwhile() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let nvml = sim().nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    let target = start(
        "--memory 1Gi --kernel fixed:2ms --kernels 2 --sync event --pipeline 2 --iterations 1500",
        GIB + OVERHEAD,
    );
    let pid = target.id();

    assert_eq!(ctl.state(pid), Ok(RUNNING));
    assert_eq!(
        ctl.checkpoint(pid),
        ILLEGAL_STATE,
        "checkpoint while running"
    );
    assert_eq!(ctl.restore(pid), ILLEGAL_STATE, "restore while running");
    assert_eq!(ctl.unlock(pid), ILLEGAL_STATE, "unlock while running");

    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    assert_eq!(ctl.state(pid), Ok(LOCKED));
    let (submitted, completed) = work(pid);
    assert_eq!(
        completed, submitted,
        "the lock waited for the submitted work"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        work(pid),
        (submitted, completed),
        "a locked process submits nothing: its driver calls wait"
    );
    assert_eq!(ctl.lock(pid, 0), ILLEGAL_STATE, "lock while locked");
    assert_eq!(ctl.restore(pid), ILLEGAL_STATE, "restore while locked");

    let before = gpu.memory_info().unwrap();
    assert_eq!(ctl.checkpoint(pid), SUCCESS);
    assert_eq!(ctl.state(pid), Ok(CHECKPOINTED));
    let during = gpu.memory_info().unwrap();
    assert_eq!(
        nvml_used(&gpu, pid),
        None,
        "NVML lists a checkpointed process no more"
    );
    assert_eq!(
        during.free,
        before.free + GIB + OVERHEAD,
        "its allocations, context and module left the GPU"
    );
    assert_eq!(
        ctl.checkpoint(pid),
        ILLEGAL_STATE,
        "checkpoint while checkpointed"
    );
    assert_eq!(ctl.unlock(pid), ILLEGAL_STATE, "unlock while checkpointed");
    assert_eq!(ctl.lock(pid, 0), ILLEGAL_STATE, "lock while checkpointed");

    // Someone else takes the memory: the restore cannot fit and changes nothing.
    let blocker = Blocker::take(&ctl, GIB);
    assert_eq!(ctl.restore(pid), OUT_OF_MEMORY);
    assert_eq!(ctl.state(pid), Ok(CHECKPOINTED));
    drop(blocker);

    assert_eq!(ctl.restore(pid), SUCCESS);
    assert_eq!(ctl.state(pid), Ok(LOCKED));
    assert_eq!(nvml_used(&gpu, pid), Some(GIB + OVERHEAD));
    assert_eq!(gpu.memory_info().unwrap().free, before.free);
    assert_eq!(
        work(pid),
        (submitted, completed),
        "still locked after the restore"
    );

    assert_eq!(ctl.unlock(pid), SUCCESS);
    assert_eq!(ctl.state(pid), Ok(RUNNING));
    assert!(
        common::eventually(Duration::from_secs(30), || work(pid).0 > submitted),
        "the process ran on after the unlock"
    );
    let report = common::wait_for_child(target);
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(
        report["allocations"]["succeeded"], 1,
        "{report}: its allocation, freed at the end at the address it had before the checkpoint"
    );
    assert_eq!(f(&report, "iterations"), 1500.0, "{report}");
}

/// Memory this test process holds on the GPU until dropped: `bytes` less than what is free,
/// through its own primary context.
struct Blocker<'a> {
    ctl: &'a Controller,
    ptr: u64,
}

impl<'a> Blocker<'a> {
    fn take(ctl: &'a Controller, leave_free: u64) -> Blocker<'a> {
        let lib = &ctl.lib;
        let mut ctx = 0usize;
        let (mut free, mut total, mut ptr) = (0usize, 0usize, 0u64);
        // SAFETY: valid out-pointers; device 0 exists.
        unsafe {
            assert_eq!(
                lib.f::<P2<*mut usize, c_int>>("cuDevicePrimaryCtxRetain")(&mut ctx, 0),
                SUCCESS
            );
            assert_eq!(lib.f::<P1<usize>>("cuCtxSetCurrent")(ctx), SUCCESS);
            assert_eq!(
                lib.f::<P2<*mut usize, *mut usize>>("cuMemGetInfo_v2")(&mut free, &mut total),
                SUCCESS
            );
            assert_eq!(
                lib.f::<P2<*mut u64, usize>>("cuMemAlloc_v2")(&mut ptr, free - leave_free as usize),
                SUCCESS
            );
        }
        Blocker { ctl, ptr }
    }
}

impl Drop for Blocker<'_> {
    fn drop(&mut self) {
        let lib = &self.ctl.lib;
        // SAFETY: our allocation and our primary context on device 0.
        unsafe {
            assert_eq!(lib.f::<P1<u64>>("cuMemFree_v2")(self.ptr), SUCCESS);
            assert_eq!(
                lib.f::<P1<c_int>>("cuDevicePrimaryCtxRelease_v2")(0),
                SUCCESS
            );
        }
    }
}

#[test]
fn a_lock_that_outlasts_its_timeout_leaves_the_process_running() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let target = start(
        "--kernel fixed:2s --kernels 1 --sync event --iterations 2",
        OVERHEAD,
    );
    let pid = target.id();
    let (submitted, completed) = work(pid);
    assert!(completed < submitted, "the 2 s kernel is queued or running");

    assert_eq!(ctl.lock(pid, 100), NOT_READY, "the kernel outlasts 100 ms");
    assert_eq!(ctl.state(pid), Ok(RUNNING));

    // Without a timeout the lock waits for all the work submitted before it.
    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    let (submitted, completed) = work(pid);
    assert_eq!(
        completed, submitted,
        "the lock returned after the queued kernels"
    );
    assert_eq!(ctl.unlock(pid), SUCCESS);
    let report = common::wait_for_child(target);
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(f(&report, "iterations"), 2.0, "{report}");
}

#[test]
fn managed_memory_cannot_be_checkpointed_and_other_pids_are_no_cuda_processes() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let target = start(
        "--managed --memory 64Mi --kernel fixed:1ms --kernels 1 --sync event --duration 2s",
        (64 << 20) + OVERHEAD,
    );
    let pid = target.id();
    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    assert_eq!(ctl.checkpoint(pid), NOT_SUPPORTED);
    assert_eq!(ctl.state(pid), Ok(LOCKED));
    assert_eq!(ctl.unlock(pid), SUCCESS);
    let report = common::wait_for_child(target);
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");

    let mut not_cuda = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let other = not_cuda.id();
    assert_eq!(ctl.state(other), Err(INVALID_VALUE));
    assert_eq!(ctl.lock(other, 0), INVALID_VALUE);
    assert_eq!(ctl.checkpoint(other), INVALID_VALUE);
    not_cuda.kill().unwrap();
    not_cuda.wait().unwrap();
}

#[test]
fn a_process_killed_while_checkpointed_leaves_nothing_behind() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let nvml = sim().nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    // Memory held by another process, so that taking the victim's bytes off twice would show.
    let _other = Blocker::take(&ctl, 2 * GIB);
    let baseline = gpu.memory_info().unwrap().used;
    let mut target = start(
        "--memory 1Gi --kernel fixed:1ms --kernels 1 --sync event --duration 30s",
        GIB + OVERHEAD,
    );
    let pid = target.id();
    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    assert_eq!(ctl.checkpoint(pid), SUCCESS);
    assert_eq!(gpu.memory_info().unwrap().used, baseline);

    target.kill().unwrap();
    target.wait().unwrap();
    assert!(
        common::eventually(Duration::from_secs(5), || ctl.state(pid)
            == Err(INVALID_VALUE)),
        "the dead process is forgotten"
    );
    assert_eq!(
        gpu.memory_info().unwrap().used,
        baseline,
        "its checkpointed memory is not taken off the GPU a second time"
    );
}

/// A `simgpu-pattern` process holding memory with known contents until told to read it back.
struct PatternHolder {
    child: Child,
    files: tempfile::TempDir,
    /// Its device memory image's name, without the `device-` prefix (`<slot>-<generation>`).
    image: String,
}

impl PatternHolder {
    /// Starts one with `allocations` (`SIZE:BYTE` each) and waits until it has written them.
    fn start(allocations: &[&str]) -> PatternHolder {
        let files = tempfile::tempdir().unwrap();
        let (ready, go) = (files.path().join("ready"), files.path().join("go"));
        let mut args = vec![
            "--ready",
            ready.to_str().unwrap(),
            "--go",
            go.to_str().unwrap(),
        ];
        args.extend(allocations);
        let child = sim().pattern(&args).spawn().unwrap();
        assert!(
            common::eventually(Duration::from_secs(30), || ready.exists()),
            "simgpu-pattern never wrote its memory"
        );
        let model = sim().model();
        let slot = model
            .lock()
            .unwrap()
            .snapshot(0)
            .unwrap()
            .processes
            .iter()
            .find(|u| u.pid == child.id())
            .expect("the holder is listed")
            .slot;
        let image = sim()
            .memory_images()
            .iter()
            .find_map(|name| name.strip_prefix(&format!("device-{slot}-")))
            .map(|generation| format!("{slot}-{generation}"))
            .expect("the holder's device image exists once it wrote");
        PatternHolder {
            child,
            files,
            image,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether its image exists on the device side and on the host side.
    fn images(&self) -> (bool, bool) {
        let names = sim().memory_images();
        let has = |side: &str| names.contains(&format!("{side}-{}", self.image));
        (has("device"), has("host"))
    }

    /// Lets it read its memory back; its report.
    fn finish(self) -> serde_json::Value {
        std::fs::write(self.files.path().join("go"), b"").unwrap();
        let out = self.child.wait_with_output().unwrap();
        common::report(&out.stdout, &out.stderr)
    }
}

#[test]
fn a_restored_process_reads_back_every_byte_it_wrote_at_the_same_addresses() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let nvml = sim().nvml();
    let gpu = nvml.device_by_index(0).unwrap();
    // Several allocations, one over the driver's 4 MiB copy chunk, each its own pattern.
    let holder = PatternHolder::start(&["3Mi:11", "5Mi:200", "1Mi:0", "4097:77"]);
    let pid = holder.pid();
    assert_eq!(holder.images(), (true, false), "written on the device");
    let before = gpu.memory_info().unwrap().free;

    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    assert_eq!(ctl.checkpoint(pid), SUCCESS);
    assert_eq!(
        holder.images(),
        (false, true),
        "checkpointed: the contents are on the host, none on the device"
    );
    assert!(gpu.memory_info().unwrap().free > before);

    // A restore that does not fit leaves the contents on the host.
    let blocker = Blocker::take(&ctl, 0);
    assert_eq!(ctl.restore(pid), OUT_OF_MEMORY);
    assert_eq!(holder.images(), (false, true));
    drop(blocker);

    assert_eq!(ctl.restore(pid), SUCCESS);
    assert_eq!(holder.images(), (true, false), "restored onto the device");
    assert_eq!(ctl.unlock(pid), SUCCESS);

    let report = holder.finish();
    assert_eq!(report["error"], serde_json::Value::Null, "{report}");
    let allocations = report["allocations"].as_array().unwrap();
    assert_eq!(allocations.len(), 4, "{report}");
    for a in allocations {
        assert_eq!(a["mismatch"], serde_json::Value::Null, "{report}");
    }
    let mut addresses: Vec<u64> = allocations
        .iter()
        .map(|a| a["ptr"].as_u64().unwrap())
        .collect();
    addresses.dedup();
    assert_eq!(addresses.len(), 4, "distinct allocations: {report}");
}

#[test]
fn a_process_s_memory_contents_go_with_it_whether_it_exits_is_killed_or_is_checkpointed() {
    let _turn = one_at_a_time();
    let ctl = Controller::new();
    let gone = |holder_image: &str| {
        common::eventually(Duration::from_secs(5), || {
            // Opening the model reaps dead processes.
            drop(sim().model().lock().unwrap());
            !sim()
                .memory_images()
                .iter()
                .any(|name| name.ends_with(&format!("-{holder_image}")))
        })
    };

    let exits = PatternHolder::start(&["1Mi:1"]);
    let image = exits.image.clone();
    let report = exits.finish();
    assert_eq!(report["error"], serde_json::Value::Null, "{report}");
    assert!(
        gone(&image),
        "the image of a process that exited is removed"
    );

    let mut killed = PatternHolder::start(&["1Mi:2"]);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    assert!(
        gone(&killed.image),
        "nor does a SIGKILLed one leave its image"
    );

    let mut checkpointed = PatternHolder::start(&["1Mi:3"]);
    let pid = checkpointed.pid();
    assert_eq!(ctl.lock(pid, 0), SUCCESS);
    assert_eq!(ctl.checkpoint(pid), SUCCESS);
    assert_eq!(checkpointed.images(), (false, true));
    checkpointed.child.kill().unwrap();
    checkpointed.child.wait().unwrap();
    assert!(
        gone(&checkpointed.image),
        "the host-side image of a process killed while checkpointed is removed"
    );
}
