//! "The quota means what nvidia-smi shows", against the simulated GPU with a real
//! gpushare-arbiter that reads the simulated NVML: a process's CUDA context (its
//! overhead, `SIMGPU_CONTEXT_MEMORY`) is charged to its lease, `cuMemGetInfo`
//! reports what is left after it, and the watchdog (killing, here) leaves a process
//! that filled exactly what it was told was free alone.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use gpushare_proto::ControlClient;

/// The simulated context's size: not the arbiter's estimate (300 MiB), so only a
/// measurement gets the numbers below right.
const CONTEXT: u64 = 256 * MI;
const QUOTA: u64 = 1024 * MI;

/// A private arbiter on one simulated 16 GiB GPU, seen through the simulated NVML,
/// with the watchdog every 200 ms and killing what it reports.
struct NvmlMachine {
    arbiter: Arbiter,
    /// The same simulated machine for the arbiter (NVML) and the programs.
    machine: simgpu::SimMachine,
    containers: Vec<Child>,
}

impl NvmlMachine {
    fn start() -> NvmlMachine {
        NvmlMachine::start_with_module_memory(0)
    }

    /// The simulated modules cost `module_memory` each once loaded (the arbiter's
    /// NVML creates the simulated machine, so its environment sets it for all).
    fn start_with_module_memory(module_memory: u64) -> NvmlMachine {
        sim_libs();
        let builder = Arbiter::builder();
        let machine = simgpu::SimMachine::new(builder.dir().join("simgpu"), 1, "16Gi")
            .set("SIMGPU_CONTEXT_MEMORY", CONTEXT)
            .set("SIMGPU_MODULE_MEMORY", module_memory);
        std::fs::create_dir_all(&machine.state_dir).unwrap();
        let arbiter = builder
            .simulated(&machine)
            .configure(|c| {
                c.arbiter.watchdog_interval_ms = 200;
                c.arbiter.watchdog_kill = true;
            })
            .start();
        NvmlMachine {
            arbiter,
            machine,
            containers: Vec::new(),
        }
    }

    fn dir(&self) -> &Path {
        self.arbiter.dir()
    }

    /// SIGKILLs the arbiter, leaves it away for `away`, and starts it again on the same
    /// state (an upgrade, a crash); returns when its control socket answers.
    fn restart_arbiter(&mut self, away: Duration) {
        self.arbiter.kill();
        std::thread::sleep(away);
        self.arbiter.restart();
    }

    /// The lease's processes as the arbiter's ledger lists them.
    fn clients(&self, lease: &str) -> Vec<gpushare_proto::ClientStatus> {
        let report = self.control().status().unwrap();
        report
            .usage
            .into_iter()
            .find(|u| u.lease.0 == lease)
            .map_or_else(Vec::new, |u| u.clients)
    }

    fn control(&self) -> ControlClient {
        self.arbiter.client()
    }

    fn reserve(&self, container: &str, memory: &str) -> Result<String, String> {
        self.control()
            .reserve(low_request(container, Some(memory)))
            .map(|l| l.id.0)
            .map_err(|e| e.to_string())
    }

    /// A confirmed lease whose "container" is a sleeping process of this test.
    fn lease(&mut self, memory: &str) -> String {
        let container = format!("c{}", self.containers.len());
        let lease = self.reserve(&container, memory).unwrap();
        let init = sleeping_container(&mut self.control(), container);
        self.containers.push(init);
        lease
    }

    fn probe(&self, lease: &str, args: &[&str]) -> Command {
        probe_on(&self.machine, lease, self.arbiter.lease_socket(lease), args)
    }

    fn log(&self) -> String {
        self.arbiter.log()
    }
}

impl Drop for NvmlMachine {
    fn drop(&mut self) {
        for c in &mut self.containers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn the_context_is_charged_within_the_quota_and_free_memory_says_so() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let left = QUOTA - CONTEXT;
    let room = left.to_string();
    let s = run(&mut m.probe(
        &lease,
        &["meminfo", "alloc", &room, "meminfo", "alloc", "1Mi"],
    ));
    assert_eq!(
        s.number("meminfo", 0, "free"),
        left,
        "free is the quota less the measured context\n{}",
        s.stderr
    );
    assert_eq!(s.number("meminfo", 0, "total"), QUOTA);
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(s.number("meminfo", 1, "free"), 0);
    assert_eq!(
        s.result("alloc", 1),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "the context filled the rest of the quota"
    );
    assert!(
        s.stderr.contains("of them its processes' own overhead"),
        "the refusal names the overhead:\n{}",
        s.stderr
    );
}

#[test]
fn a_process_that_fills_what_it_was_told_is_free_is_not_killed() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    // What a framework does: ask what is free, then take all of it, then work.
    let s = run(&mut m.probe(&lease, &["meminfo"]));
    let free = s.number("meminfo", 0, "free").to_string();
    // Several watchdog passes (200 ms each) while it holds everything.
    let s = run(&mut m.probe(&lease, &["alloc", &free, "sleep", "1500", "meminfo"]));
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS", "{}", s.stderr);
    let status = m.control().status().unwrap();
    assert!(
        !status
            .violations
            .iter()
            .any(|v| v.kind == gpushare_proto::ViolationKind::OverQuota),
        "{:?}\n{}",
        status.violations,
        m.log()
    );
    assert!(!m.log().contains("watchdog killed"), "{}", m.log());
}

/// A process used to register only at its first allocation, so one with
/// a context that had not allocated yet was reported unregistered by the watchdog and,
/// with `watchdog_kill = true`, SIGKILLed. It attaches (holding nothing) when it creates
/// its context: listed by the ledger at once, and left alone.
#[test]
fn a_process_with_a_context_and_no_allocation_is_registered_and_not_killed() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let ready = m.dir().join("ready");
    // The probe retains the primary context and loads its module, then allocates nothing.
    let probe = m
        .probe(&lease, &["touch", ready.to_str().unwrap(), "sleep", "1500"])
        .spawn()
        .unwrap();
    wait_until("the probe's context", Duration::from_secs(30), || {
        ready.exists()
    });
    let clients = m.clients(&lease);
    assert_eq!(
        clients.iter().map(|c| c.memory_held).collect::<Vec<_>>(),
        vec![0],
        "attached, holding nothing, as soon as its context exists: {clients:?}"
    );
    // Several watchdog passes (200 ms each) while it sleeps.
    let s = finish(probe);
    assert!(!m.log().contains("watchdog killed"), "{}", m.log());
    assert!(s.stderr.contains("attached to lease"), "{}", s.stderr);
}

/// After an arbiter restart the ledger was empty
/// until each process re-attached at its next allocation, so an idle process holding
/// memory was missing (a sibling could over-allocate) and, with `watchdog_kill = true`,
/// reported and killed as unregistered. Its watcher re-attaches it, with its holdings,
/// within a second of the arbiter being back, without any CUDA call.
///
/// The arbiter's watchdog reports nothing unregistered within its restart grace
/// (`arbiter/src/watchdog.rs`), which is what lets the re-attach land first; before
/// that grace its first pass killed every process of the empty ledger.
#[test]
fn an_idle_process_is_seen_again_with_its_holdings_within_a_second_of_an_arbiter_restart() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let ready = m.dir().join("ready");
    let probe = m
        .probe(
            &lease,
            &[
                "alloc",
                "100Mi",
                "touch",
                ready.to_str().unwrap(),
                "sleep",
                "5000",
            ],
        )
        .spawn()
        .unwrap();
    wait_until("the probe's allocation", Duration::from_secs(30), || {
        ready.exists()
    });
    let held = |m: &NvmlMachine| {
        m.clients(&lease)
            .iter()
            .map(|c| c.memory_held)
            .collect::<Vec<_>>()
    };
    assert_eq!(held(&m), vec![100 * MI]);
    // Away for longer than the watcher's retry ceiling, so it is in its slowest retry.
    m.restart_arbiter(Duration::from_millis(1500));
    let back = std::time::Instant::now();
    let mut seen = None;
    while back.elapsed() < Duration::from_secs(5) {
        if held(&m) == vec![100 * MI] {
            seen = Some(back.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let seen = seen.unwrap_or_else(|| panic!("not re-attached: {:?}\n{}", held(&m), m.log()));
    eprintln!("re-attached with its holdings {seen:?} after the arbiter answered again");
    assert!(seen < Duration::from_secs(1), "re-attached after {seen:?}");
    // Watchdog passes (200 ms) for the rest of its sleep: never reported, never killed.
    let s = finish(probe);
    let status = m.control().status().unwrap();
    assert!(status.violations.is_empty(), "{:?}", status.violations);
    assert!(!m.log().contains("watchdog killed"), "{}", m.log());
    assert!(
        s.stderr.contains("closed the ledger connection"),
        "{}",
        s.stderr
    );
}

#[test]
fn a_lazily_loaded_module_is_counted_once_measured() {
    const MODULE: u64 = 8 * MI;
    let mut m = NvmlMachine::start_with_module_memory(MODULE);
    let lease = m.lease("1Gi");
    let go = m.dir().join("go");
    let probe = m
        .probe(
            &lease,
            &[
                "meminfo",
                "launch",
                "1",
                "sync",
                "wait",
                go.to_str().unwrap(),
                "meminfo",
            ],
        )
        .spawn()
        .unwrap();
    // Its first launch loaded the probe's module: the watchdog's next measurement
    // (every 200 ms) counts it as the process's overhead.
    wait_until("the module to be measured", Duration::from_secs(30), || {
        m.used(&lease) == CONTEXT + MODULE
    });
    std::fs::write(&go, "").unwrap();
    let s = finish(probe);
    assert_eq!(s.result("launch", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(s.number("meminfo", 0, "free"), QUOTA - CONTEXT);
    assert_eq!(
        s.number("meminfo", 1, "free"),
        QUOTA - CONTEXT - MODULE,
        "cuMemGetInfo counts the loaded module"
    );
}

#[test]
fn a_quota_that_cannot_hold_one_context_is_refused_at_reserve() {
    let m = NvmlMachine::start();
    let err = m.reserve("tiny", "256Mi").unwrap_err();
    assert!(
        err.contains("cannot hold even one CUDA process")
            && err.contains("arbiter.context_memory_estimate")
            && err.contains("300Mi"),
        "{err}"
    );
    assert!(m.reserve("ok", "512Mi").is_ok());
}

// ----- a CUDA program of this test binary -----
//
// The probe (src/bin) has no steps for graph memory nodes or VMM export; this
// binary runs itself as the program instead: the `program` test, under
// `LD_PRELOAD=libgpushare.so`, resolves the driver as the CUDA runtime does
// (`dlopen`, `cuGetProcAddress_v2`) and prints `step <name> <result> k=v ...` lines.

const PROGRAM_ENV: &str = "GPUSHARE_MEMTEST_PROGRAM";

type R = i32;
type GetProc =
    unsafe extern "C" fn(*const libc::c_char, *mut *mut libc::c_void, i32, u64, *mut i32) -> R;

struct Cuda {
    get_proc: GetProc,
}

impl Cuda {
    fn load() -> Cuda {
        // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is never closed.
        unsafe {
            let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
            assert!(!handle.is_null(), "dlopen(libcuda.so.1)");
            let sym = libc::dlsym(handle, c"cuGetProcAddress_v2".as_ptr());
            assert!(!sym.is_null(), "no cuGetProcAddress_v2");
            Cuda {
                get_proc: std::mem::transmute::<*mut libc::c_void, GetProc>(sym),
            }
        }
    }

    /// The entry point `name` for CUDA 12.4 (what a program built with it asks for).
    fn get<T: Copy>(&self, name: &str) -> T {
        assert_eq!(
            std::mem::size_of::<T>(),
            std::mem::size_of::<*mut libc::c_void>()
        );
        let c = std::ffi::CString::new(name).unwrap();
        let (mut p, mut status) = (std::ptr::null_mut(), 0);
        // SAFETY: cuGetProcAddress_v2's signature; out-pointers valid.
        let rc = unsafe { (self.get_proc)(c.as_ptr(), &mut p, 12040, 0, &mut status) };
        assert!(rc == 0 && !p.is_null(), "cuGetProcAddress_v2({name}): {rc}");
        // SAFETY: T is the C signature of `name` (asserted pointer-sized above).
        unsafe { std::mem::transmute_copy::<*mut libc::c_void, T>(&p) }
    }

    fn free_memory(&self) -> u64 {
        let f: unsafe extern "C" fn(*mut usize, *mut usize) -> R = self.get("cuMemGetInfo");
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        assert_eq!(unsafe { f(&mut free, &mut total) }, 0);
        free as u64
    }
}

fn step(name: &str, rc: R, rest: &str) {
    println!("step {name} {rc} {rest}");
}

/// cuInit and the primary context of device 0, current on this thread.
fn context(c: &Cuda) {
    let init: unsafe extern "C" fn(u32) -> R = c.get("cuInit");
    let retain: unsafe extern "C" fn(*mut usize, i32) -> R = c.get("cuDevicePrimaryCtxRetain");
    let set: unsafe extern "C" fn(usize) -> R = c.get("cuCtxSetCurrent");
    let mut ctx = 0;
    // SAFETY: the driver API's signatures; valid out-pointers.
    unsafe {
        assert_eq!(init(0), 0);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set(ctx), 0);
    }
}

/// A stream capturing a graph whose allocation nodes have `sizes`, all live at once and
/// freed inside the graph, instantiated: the worst result, the stream and the
/// executable graph.
fn memory_node_graph(c: &Cuda, sizes: &[usize]) -> (R, usize, usize) {
    let create: unsafe extern "C" fn(*mut usize, u32) -> R = c.get("cuStreamCreate");
    let begin: unsafe extern "C" fn(usize, i32) -> R = c.get("cuStreamBeginCapture");
    let alloc: unsafe extern "C" fn(*mut u64, usize, usize) -> R = c.get("cuMemAllocAsync");
    let free: unsafe extern "C" fn(u64, usize) -> R = c.get("cuMemFreeAsync");
    let end: unsafe extern "C" fn(usize, *mut usize) -> R = c.get("cuStreamEndCapture");
    let instantiate: unsafe extern "C" fn(*mut usize, usize, u64) -> R =
        c.get("cuGraphInstantiateWithFlags");
    let (mut stream, mut graph, mut exec) = (0, 0, 0);
    let mut pointers = vec![0u64; sizes.len()];
    // SAFETY: the driver API's signatures; valid out-pointers.
    let rc = unsafe {
        let mut rc = create(&mut stream, 1);
        rc = rc.max(begin(stream, 2)); // relaxed
        for (ptr, &bytes) in pointers.iter_mut().zip(sizes) {
            rc = rc.max(alloc(ptr, bytes, stream));
        }
        for &ptr in &pointers {
            rc = rc.max(free(ptr, stream));
        }
        rc = rc.max(end(stream, &mut graph));
        rc.max(instantiate(&mut exec, graph, 0))
    };
    (rc, stream, exec)
}

/// Launches `exec` on `stream` and waits: the launch's result and the wait's.
fn launch_and_wait(c: &Cuda, exec: usize, stream: usize) -> (R, R) {
    let launch: unsafe extern "C" fn(usize, usize) -> R = c.get("cuGraphLaunch");
    let sync: unsafe extern "C" fn(usize) -> R = c.get("cuStreamSynchronize");
    // SAFETY: the driver API's signatures, handles it gave.
    unsafe { (launch(exec, stream), sync(stream)) }
}

/// What device 0's graph memory pool reserves (and the query's result).
fn graph_pool_reserved(c: &Cuda) -> (R, u64) {
    let attribute: unsafe extern "C" fn(i32, i32, *mut u64) -> R =
        c.get("cuDeviceGetGraphMemAttribute");
    let mut reserved = 0u64;
    // SAFETY: CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT (2) is a cuuint64_t.
    let rc = unsafe { attribute(0, 2, &mut reserved) };
    (rc, reserved)
}

/// A graph with a memory node: `bytes` allocated and freed inside a stream
/// capture, instantiated and launched, which reserves the graph pool's memory.
fn graph_program(c: &Cuda, bytes: usize) {
    context(c);
    step("meminfo", 0, &format!("free={}", c.free_memory()));
    let (rc, stream, exec) = memory_node_graph(c, &[bytes]);
    let (launched, synced) = launch_and_wait(c, exec, stream);
    let (attr_rc, reserved) = graph_pool_reserved(c);
    let rc = rc.max(launched).max(synced).max(attr_rc);
    step("graph", rc, &format!("reserved={reserved}"));
    // At once: the launch settled the graph pool (accounts::graph_launched).
    step("meminfo", 0, &format!("free={}", c.free_memory()));
    // After a few watchdog passes (200 ms each), which measure the graph pool in
    // NVML's usage of the process: it must not be counted again as overhead.
    std::thread::sleep(Duration::from_millis(700));
    let seen = c.free_memory();
    step("meminfo", 0, &format!("free={seen}"));
    let alloc_sync: unsafe extern "C" fn(*mut u64, usize) -> R = c.get("cuMemAlloc");
    let mut ptr = 0u64;
    // SAFETY: valid out-pointer.
    let rc = unsafe { alloc_sync(&mut ptr, (seen + MI) as usize) };
    step("alloc-beyond", rc, "");
}

/// A graph whose two memory nodes need the whole quota together (the context already
/// uses some of it): captured, instantiated, launched. Reports the launch's result
/// and what the device's graph pool reserved after it.
fn graph_over_quota_program(c: &Cuda) {
    context(c);
    // Each node alone fits in what the context leaves of the quota; both together,
    // live at once in the graph, do not.
    let half = (QUOTA / 2) as usize;
    let (rc, stream, exec) = memory_node_graph(c, &[half, half]);
    step("capture", rc, "");
    let (launched, synced) = launch_and_wait(c, exec, stream);
    let (attr_rc, reserved) = graph_pool_reserved(c);
    step(
        "launch",
        launched,
        &format!("reserved={reserved} sync={synced} attr={attr_rc}"),
    );
    step("meminfo", 0, &format!("free={}", c.free_memory()));
}

#[repr(C)]
struct AllocationProp {
    kind: u32,
    handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32: *mut libc::c_void,
    flags: [u8; 8],
}

/// Waits (polling) for `path` to exist: the programs' and the test's handshakes.
fn wait_for(path: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited 30 s for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn handshake_dir() -> PathBuf {
    PathBuf::from(std::env::var_os(HANDSHAKE_ENV).expect("the handshake directory"))
}

const HANDSHAKE_ENV: &str = "GPUSHARE_MEMTEST_DIR";

/// Physical memory exported as a POSIX descriptor; released once another process
/// imported it. Handshakes in `$GPUSHARE_MEMTEST_DIR`: writes `exported` ("pid fd"),
/// waits for `imported`, releases, writes `released`, waits for `finish`.
fn exporter_program(c: &Cuda, bytes: usize) {
    let dir = handshake_dir();
    context(c);
    let create: unsafe extern "C" fn(*mut u64, usize, *const AllocationProp, u64) -> R =
        c.get("cuMemCreate");
    let export: unsafe extern "C" fn(*mut libc::c_void, u64, u32, u64) -> R =
        c.get("cuMemExportToShareableHandle");
    let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
    let prop = AllocationProp {
        kind: 1,          // CU_MEM_ALLOCATION_TYPE_PINNED
        handle_types: 1,  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
        location_id: 0,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    };
    let (mut handle, mut fd) = (0u64, -1i32);
    // SAFETY: cuMemCreate (its cuda.h signature), given a live
    // CUmemGenericAllocationHandle (u64) to write and a CUmemAllocationProp
    // (AllocationProp is its repr(C) layout) that lives until the call returns.
    let rc = unsafe { create(&mut handle, bytes, &prop, 0) };
    step("create", rc, "");
    // SAFETY: cuMemExportToShareableHandle with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    // writes an int: `fd` is a live i32; the handle is a value the driver checks.
    let rc = unsafe { export((&mut fd as *mut i32).cast(), handle, 1, 0) };
    step("export", rc, &format!("fd={fd}"));
    std::fs::write(
        dir.join("exported.tmp"),
        format!("{} {fd}", std::process::id()),
    )
    .unwrap();
    std::fs::rename(dir.join("exported.tmp"), dir.join("exported")).unwrap();
    wait_for(&dir.join("imported"));
    // SAFETY: cuMemRelease of the handle this program created.
    let rc = unsafe { release(handle) };
    step("release", rc, "");
    step("meminfo", 0, &format!("free={}", c.free_memory()));
    std::fs::write(dir.join("released"), "").unwrap();
    // Told to, it exits with the importer still holding the memory.
    if !dir.join("exporter-exits").exists() {
        wait_for(&dir.join("finish"));
    }
}

/// Imports the exporter's allocation (its descriptor through /proc) and maps it.
fn importer_program(c: &Cuda) {
    let dir = handshake_dir();
    context(c);
    wait_for(&dir.join("exported"));
    let text = std::fs::read_to_string(dir.join("exported")).unwrap();
    let (pid, fd) = text.split_once(' ').unwrap();
    let theirs = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::File::open(&theirs).unwrap();
    let import: unsafe extern "C" fn(*mut u64, *mut libc::c_void, u32) -> R =
        c.get("cuMemImportFromShareableHandle");
    let reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> R =
        c.get("cuMemAddressReserve");
    let map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> R = c.get("cuMemMap");
    let (mut handle, mut address) = (0u64, 0u64);
    let os_handle = std::os::fd::AsRawFd::as_raw_fd(&file) as usize as *mut libc::c_void;
    // SAFETY: cuMemImportFromShareableHandle, given a live u64 handle to write; for a
    // POSIX descriptor the "pointer" argument is the descriptor's value (of `file`,
    // open for the call), which the driver does not dereference.
    let rc = unsafe { import(&mut handle, os_handle, 1) };
    step("import", rc, "");
    let bytes = (64 * MI) as usize;
    // SAFETY: cuMemAddressReserve, given a live CUdeviceptr (u64) to write.
    let reserved = unsafe { reserve(&mut address, bytes, 0, 0, 0) };
    // SAFETY: cuMemMap takes the range and the handle as values the driver checks;
    // nothing here touches the mapping from the host.
    let mapped = unsafe { map(address, bytes, 0, handle, 0) };
    let rc = reserved.max(mapped);
    step("map", rc, "");
    // Both "containers" here are host processes, which no container check tells
    // apart: until the exporter attached, a listing counted its context on every
    // lease as unattached (measured: the importer attached to "512 MiB in use"), and
    // cuMemGetInfo answers from the view of the last ledger answer while it is
    // younger than VIEW_MAX_AGE. Past that it asks, and the exporter has attached
    // (before it exported), so only this process's own context is in the answer.
    std::thread::sleep(2 * gpushare::accounts::VIEW_MAX_AGE);
    step("meminfo", 0, &format!("free={}", c.free_memory()));
    std::fs::write(dir.join("imported"), "").unwrap();
    // Lets go of it when told: unmapped and released, the last holder.
    wait_for(&dir.join("let-go"));
    let unmap: unsafe extern "C" fn(u64, usize) -> R = c.get("cuMemUnmap");
    let release: unsafe extern "C" fn(u64) -> R = c.get("cuMemRelease");
    // SAFETY: the range mapped above and the handle imported above.
    let rc = unsafe { unmap(address, bytes).max(release(handle)) };
    step("let-go", rc, "");
    std::fs::write(dir.join("let-go-done"), "").unwrap();
    wait_for(&dir.join("finish"));
}

#[test]
#[ignore = "the CUDA program the other tests run under the interposer"]
fn program() {
    let Ok(which) = std::env::var(PROGRAM_ENV) else {
        return;
    };
    let c = Cuda::load();
    match which.as_str() {
        "graph" => graph_program(&c, (64 * MI) as usize),
        "graph-over-quota" => graph_over_quota_program(&c),
        "exporter" => exporter_program(&c, (64 * MI) as usize),
        "importer" => importer_program(&c),
        other => panic!("no program {other:?}"),
    }
}

impl NvmlMachine {
    /// This test binary as the program `which`, a process of `lease`.
    fn program_command(&self, lease: &str, which: &str) -> Command {
        // The probe's environment (interposer, lease, simulated machine), this binary.
        let probe = self.probe(lease, &[]);
        let mut program = Command::new(std::env::current_exe().unwrap());
        program
            .args([
                "--exact",
                "program",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PROGRAM_ENV, which)
            .envs(probe.get_envs().filter_map(|(k, v)| Some((k, v?))))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        program
    }

    /// Runs the program `which` to its end.
    fn program(&self, lease: &str, which: &str) -> Steps {
        program_steps(self.program_command(lease, which).spawn().unwrap(), which)
    }

    fn used(&self, lease: &str) -> u64 {
        let report = self.control().status().unwrap();
        report
            .usage
            .iter()
            .find(|u| u.lease.0 == lease)
            .map_or(0, |u| u.memory_used)
    }
}

/// A program's `step` lines, once it exited successfully.
fn program_steps(child: Child, which: &str) -> Steps {
    let out = child.wait_with_output().unwrap();
    let steps = Steps::from(&out);
    assert!(
        out.status.success(),
        "program {which} failed: {}\n{:?}\n{}",
        out.status,
        steps.lines,
        steps.stderr
    );
    Steps {
        lines: steps
            .lines
            .iter()
            // libtest may print "test program ... " on the first step's line.
            .filter_map(|l| l.find("step ").map(|at| l[at + "step ".len()..].to_owned()))
            .collect(),
        stderr: steps.stderr,
    }
}

/// Recovery under load: restarting the arbiter lets no process exceed its
/// lease's quota meanwhile. A holds 400 MiB (and its context) and idles; the arbiter
/// is SIGKILLed and restarted, and B, started as it comes back, asks for 400 MiB more:
/// refused whether or not A has re-attached yet (A's memory counts from NVML as the
/// container's unattached process until it has), while 64 MiB, which fits, is granted.
#[test]
fn a_restart_under_load_lets_no_process_exceed_the_quota_meanwhile() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let ready = m.dir().join("ready");
    let holder = m
        .probe(
            &lease,
            &[
                "alloc",
                "400Mi",
                "touch",
                ready.to_str().unwrap(),
                "sleep",
                "4000",
            ],
        )
        .spawn()
        .unwrap();
    wait_until("the holder's allocation", Duration::from_secs(30), || {
        ready.exists()
    });
    m.restart_arbiter(Duration::ZERO);
    let sibling = finish(
        m.probe(&lease, &["alloc", "400Mi", "alloc", "64Mi"])
            .spawn()
            .unwrap(),
    );
    assert_eq!(
        sibling.result("alloc", 0),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "400 MiB beyond what the lease's processes hold was granted\n{}",
        sibling.stderr
    );
    assert_eq!(
        sibling.result("alloc", 1),
        "CUDA_SUCCESS",
        "{}",
        sibling.stderr
    );
    assert!(m.used(&lease) <= QUOTA, "{} over the quota", m.used(&lease));
    finish(holder);
    let status = m.control().status().unwrap();
    assert!(status.violations.is_empty(), "{:?}", status.violations);
}

#[test]
fn graph_memory_nodes_count_against_the_quota_after_the_launch() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let s = m.program(&lease, "graph");
    assert_eq!(s.number("meminfo", 0, "free"), QUOTA - CONTEXT);
    assert_eq!(s.result("graph", 0), "0", "{}", s.stderr);
    let reserved = s.number("graph", 0, "reserved");
    assert!(
        reserved >= 64 * MI,
        "the launch reserved the node's memory: {reserved}"
    );
    assert_eq!(
        s.number("meminfo", 1, "free"),
        QUOTA - CONTEXT - reserved,
        "the launch charged the graph pool at once\n{}",
        s.stderr
    );
    assert_eq!(
        s.number("meminfo", 2, "free"),
        QUOTA - CONTEXT - reserved,
        "and the arbiter's measurements agree (not counted twice)"
    );
    assert_eq!(s.result("alloc-beyond", 0), "2", "CUDA_ERROR_OUT_OF_MEMORY");
}

/// The driver reserves a graph's memory nodes inside `cuGraphLaunch`, where nothing
/// after it can refuse: a graph whose nodes need more than the quota left must be
/// refused at its launch, nothing run or reserved, the lease never over its quota.
#[test]
fn a_graph_whose_memory_nodes_exceed_the_quota_is_refused_at_its_launch() {
    let mut m = NvmlMachine::start();
    let lease = m.lease("1Gi");
    let s = m.program(&lease, "graph-over-quota");
    assert_eq!(s.result("capture", 0), "0", "{}", s.stderr);
    assert_eq!(
        (s.result("launch", 0), s.number("launch", 0, "reserved")),
        ("2", 0),
        "CUDA_ERROR_OUT_OF_MEMORY, and the graph pool reserved nothing\n{}",
        s.stderr
    );
    assert_eq!(
        s.number("meminfo", 0, "free"),
        QUOTA - CONTEXT,
        "the refused growth is not left charged"
    );
    let status = m.control().status().unwrap();
    assert!(status.violations.is_empty(), "{:?}", status.violations);
}

/// The exporter and the importer, on leases of their own, through the exporter's
/// release (the importer maps the memory then); `exporter_exits`: the exporter exits
/// after its release instead of waiting.
fn export_then_release(
    m: &mut NvmlMachine,
    dir: &Path,
    exporter_exits: bool,
) -> (String, String, Child, Child) {
    let exporter_lease = m.lease("1Gi");
    let importer_lease = m.lease("1Gi");
    if exporter_exits {
        std::fs::write(dir.join("exporter-exits"), "").unwrap();
    }
    let exporter = m
        .program_command(&exporter_lease, "exporter")
        .env(HANDSHAKE_ENV, dir)
        .spawn()
        .unwrap();
    let importer = m
        .program_command(&importer_lease, "importer")
        .env(HANDSHAKE_ENV, dir)
        .spawn()
        .unwrap();
    wait_for(&dir.join("released"));
    (exporter_lease, importer_lease, exporter, importer)
}

/// The importer lets go (unmaps and releases: the last holder) and finishes.
fn importer_lets_go(dir: &Path) {
    std::fs::write(dir.join("let-go"), "").unwrap();
    wait_for(&dir.join("let-go-done"));
}

/// Exported memory lives while any process holds it: released by the exporter and
/// mapped by an importer (another lease), it stays charged to the exporter's lease,
/// not the importer's, and is credited when the importer, the last holder, lets go
/// — then, while the exporter still runs, not at its exit.
#[test]
fn exported_memory_is_credited_when_the_last_holder_releases_it() {
    let mut m = NvmlMachine::start();
    let dir = tempfile::tempdir().unwrap();
    let (exporter_lease, importer_lease, exporter, importer) =
        export_then_release(&mut m, dir.path(), false);
    // Whatever the watchdog measures meanwhile (NVML counts the memory for the
    // exporter), the exporter's lease pays for it once and the importer's does not.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        (m.used(&exporter_lease), m.used(&importer_lease)),
        (CONTEXT + 64 * MI, CONTEXT),
        "{}",
        m.log()
    );
    importer_lets_go(dir.path());
    assert_eq!(
        m.used(&exporter_lease),
        CONTEXT,
        "credited at the importer's release, the exporter still running"
    );
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let e = program_steps(exporter, "exporter");
    let i = program_steps(importer, "importer");
    for (s, step) in [
        (&e, "create"),
        (&e, "export"),
        (&e, "release"),
        (&i, "import"),
        (&i, "map"),
        (&i, "let-go"),
    ] {
        assert_eq!(s.result(step, 0), "0", "{step}: {}", s.stderr);
    }
    assert_eq!(
        e.number("meminfo", 0, "free"),
        QUOTA - CONTEXT - 64 * MI,
        "released by the exporter, still charged to its lease at once"
    );
    assert_eq!(
        i.number("meminfo", 0, "free"),
        QUOTA - CONTEXT,
        "the importer is not charged for what it maps"
    );
}

/// The exporter releases and exits while the importer still maps the memory: the
/// memory lives on, so it stays charged to the exporter's lease until the importer
/// lets go, and then nothing remains charged.
#[test]
fn exported_memory_stays_charged_after_its_exporter_exits_until_the_importer_releases_it() {
    let mut m = NvmlMachine::start();
    let dir = tempfile::tempdir().unwrap();
    let (exporter_lease, importer_lease, exporter, importer) =
        export_then_release(&mut m, dir.path(), true);
    let e = program_steps(exporter, "exporter");
    assert_eq!(e.result("release", 0), "0", "{}", e.stderr);
    // The exporter's connection closed with its exit; give the watchdog a few
    // passes (200 ms each) to measure the node without it.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        (m.used(&exporter_lease), m.used(&importer_lease)),
        (64 * MI, CONTEXT),
        "the importer still maps it: charged to the exporter's lease\n{}",
        m.log()
    );
    importer_lets_go(dir.path());
    assert_eq!(
        m.used(&exporter_lease),
        0,
        "the last holder let go: nothing remains charged"
    );
    std::fs::write(dir.path().join("finish"), "").unwrap();
    let i = program_steps(importer, "importer");
    assert_eq!(i.result("let-go", 0), "0", "{}", i.stderr);
}
