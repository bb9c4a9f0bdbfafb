//! The watchdog against the simulated GPU (its libnvidia-ml.so.1): well-behaved
//! processes are never reported or killed (one that has a context before it
//! registers, processes re-attaching after an arbiter restart), one that never
//! registers is, once the grace is over; a registered process busy on the GPU
//! without holding the time-slice token is reported ungated, and a gated job beside
//! a high-priority one is not. Beside an active high-priority job, the bypass check
//! reports such a process within about a second and stops it until the high job is
//! quiet (or a restarted arbiter continues it).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use gpushare_proto::frame::{read_message, write_message};
use gpushare_proto::token::NOT_HELD;
use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{
    Lease, LeaseClient, LeaseRequest, LeaseResponse, Priority, TokenRequest, ViolationKind,
    PROTOCOL_VERSION,
};

const GI: u64 = 1 << 30;
/// The arbiter's `RESTART_GRACE`: nothing is reported unregistered or ungated
/// before it is over.
const RESTART_GRACE: Duration = Duration::from_secs(10);
/// The arbiter's `UNREGISTERED_GRACE` (the interval here is shorter than half).
const UNREGISTERED_GRACE: Duration = Duration::from_secs(2);
const HELPER: &str = "GPUSHARE_TEST_WATCHDOG_HELPER";

fn workload() -> PathBuf {
    binaries::require(&["simgpu-workload"]);
    binaries::program("simgpu-workload")
}

/// The interposer: the glibc-baseline build `make test` names, else cargo's own.
fn interposer() -> PathBuf {
    let library = binaries::preload_library();
    assert!(
        library.exists(),
        "{} missing: cargo build -p gpushare-preload",
        library.display()
    );
    library
}

/// A private arbiter on a simulated GPU, NVML included.
struct Sim {
    d: Arbiter,
    /// The simulated machine the arbiter's NVML and the test's processes share.
    machine: SimMachine,
    started: Instant,
}

impl Sim {
    fn start(kill: bool, interval_ms: u64) -> Sim {
        Sim::start_with(kill, interval_ms, |_| {})
    }

    fn start_with(
        kill: bool,
        interval_ms: u64,
        edit: impl FnOnce(&mut gpushare_config::Config),
    ) -> Sim {
        workload();
        let builder = Arbiter::builder().program(ARBITER);
        // Device copies at 10 GB/s: one 512 MiB copy of the copying helper keeps the GPU
        // busy ~50 ms per call, so its GPU time does not depend on how much CPU a loaded
        // machine gives its loop (at the default 900 GB/s, two busy loops beside it cut
        // it below the ungated tolerance).
        let machine =
            SimMachine::new(builder.dir().join("state"), 1, "16Gi").set("SIMGPU_DEVICE_GBPS", 10);
        let started = Instant::now();
        let d = builder
            .simulated(&machine)
            .configure(|c| {
                c.arbiter.watchdog_interval_ms = interval_ms;
                c.arbiter.watchdog_kill = kill;
                // Off by default (config says why): these tests are its own.
                c.scheduler.bypass_check = true;
                edit(c);
            })
            .start();
        Sim {
            d,
            machine,
            started,
        }
    }

    fn reserve(&self, container: &str, memory: &str, priority: Priority) -> Lease {
        let mut c = self.d.client();
        let lease = c.reserve(request(container, memory, priority)).unwrap();
        confirm_here(&mut c, container);
        lease
    }

    fn socket(&self, lease: &Lease) -> PathBuf {
        self.d.lease_socket(&lease.id.0)
    }

    fn violations_of(&self, pid: u32) -> Vec<gpushare_proto::Violation> {
        let status = self.d.client().status().unwrap();
        status
            .violations
            .into_iter()
            .filter(|v| v.pid == pid)
            .collect()
    }

    fn sleep_past_restart_grace(&self) {
        let until = self.started + RESTART_GRACE + Duration::from_millis(500);
        if let Some(left) = until.checked_duration_since(Instant::now()) {
            std::thread::sleep(left);
        }
    }

    fn helper(&self, socket: &Path, settings: &[(&str, &str)]) -> Helper {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", "watchdog_helper", "--nocapture"])
            .env(HELPER, socket)
            .env("WD_CUDA", simgpu::libs().join("libcuda.so.1"))
            .envs(self.machine.env().to_vec())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in settings {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap());
        Helper { child, lines }
    }
}

/// A helper process: a CUDA context holding 1 GiB, registered (or not) on a lease
/// socket as the interposer would, optionally copying on the GPU without any gate.
struct Helper {
    child: Child,
    lines: BufReader<ChildStdout>,
}

impl Helper {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a line starting with `what` from the helper.
    fn expect(&mut self, what: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.lines.read_line(&mut line).unwrap();
            assert!(n > 0, "the helper ended before saying {what:?}");
            if line.starts_with(what) {
                return line.trim_end().to_owned();
            }
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ----- the helper process -----

type CuResult = libc::c_int;

type CuInit = unsafe extern "C" fn(libc::c_uint) -> CuResult;
type CuDeviceGet = unsafe extern "C" fn(*mut libc::c_int, libc::c_int) -> CuResult;
type CuCtxCreate =
    unsafe extern "C" fn(*mut *mut libc::c_void, libc::c_uint, libc::c_int) -> CuResult;
type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> CuResult;
type CuMemcpyDtoD = unsafe extern "C" fn(u64, u64, usize) -> CuResult;

/// The simulated driver's entry points the helper needs, found with dlsym.
struct Cuda {
    init: CuInit,
    device_get: CuDeviceGet,
    ctx_create: CuCtxCreate,
    mem_alloc: CuMemAlloc,
    copy: CuMemcpyDtoD,
}

impl Cuda {
    fn open(path: &str) -> Cuda {
        let path = std::ffi::CString::new(path).unwrap();
        // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is never closed,
        // and each symbol is the driver function of the C signature it is cast to.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
            assert!(!handle.is_null(), "dlopen {path:?}");
            let sym = |name: &std::ffi::CStr| {
                let f = libc::dlsym(handle, name.as_ptr());
                assert!(!f.is_null(), "{name:?}");
                f
            };
            type Sym = *mut libc::c_void;
            Cuda {
                init: std::mem::transmute::<Sym, CuInit>(sym(c"cuInit")),
                device_get: std::mem::transmute::<Sym, CuDeviceGet>(sym(c"cuDeviceGet")),
                ctx_create: std::mem::transmute::<Sym, CuCtxCreate>(sym(c"cuCtxCreate_v2")),
                mem_alloc: std::mem::transmute::<Sym, CuMemAlloc>(sym(c"cuMemAlloc_v2")),
                copy: std::mem::transmute::<Sym, CuMemcpyDtoD>(sym(c"cuMemcpyDtoD_v2")),
            }
        }
    }
}

/// Keeps this process registered on `socket` from `after` on, re-attaching (after
/// `reattach_delay`, as the interposer does) whenever the arbiter goes away.
fn stay_registered(socket: PathBuf, after: Duration, reattach_delay: Duration) {
    std::thread::sleep(after);
    loop {
        let attached = LeaseClient::connect(&socket, Duration::from_secs(2))
            .and_then(|mut c| c.attach(GI).map(|(pid, _)| (c, pid)));
        let Ok((mut client, pid)) = attached else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        println!("attached {pid}");
        std::io::stdout().flush().unwrap();
        while client.query().is_ok() {
            std::thread::sleep(Duration::from_millis(20));
        }
        println!("lost");
        std::io::stdout().flush().unwrap();
        std::thread::sleep(reattach_delay);
    }
}

#[test]
#[ignore = "helper process of the watchdog tests"]
fn watchdog_helper() {
    let socket = PathBuf::from(std::env::var(HELPER).expect("run by a watchdog test"));
    let ms = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| Duration::from_millis(v.parse().unwrap()))
    };
    let cuda = Cuda::open(&std::env::var("WD_CUDA").unwrap());
    let (mut device, mut ctx, mut a, mut b) = (0, std::ptr::null_mut(), 0u64, 0u64);
    // SAFETY: out-parameters of the right types.
    unsafe {
        assert_eq!((cuda.init)(0), 0);
        assert_eq!((cuda.device_get)(&mut device, 0), 0);
        assert_eq!((cuda.ctx_create)(&mut ctx, 0, device), 0);
        assert_eq!((cuda.mem_alloc)(&mut a, (GI / 2) as usize), 0);
        assert_eq!((cuda.mem_alloc)(&mut b, (GI / 2) as usize), 0);
    }
    println!("context");
    std::io::stdout().flush().unwrap();
    if let Some(after) = ms("WD_ATTACH_AFTER_MS") {
        let delay = ms("WD_REATTACH_DELAY_MS").unwrap_or_default();
        std::thread::spawn(move || stay_registered(socket, after, delay));
    }
    let copying = std::env::var_os("WD_COPY").is_some();
    loop {
        if copying {
            // SAFETY: two live 512 MiB allocations of this context.
            assert_eq!(unsafe { (cuda.copy)(a, b, (GI / 2) as usize) }, 0);
        } else {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

// ----- finding 4: well-behaved processes are not reported -----

#[test]
fn a_process_is_reported_unregistered_only_after_the_grace_and_one_that_registers_in_it_never() {
    let sim = Sim::start(true, 100);
    let lease = sim.reserve("c", "4Gi", Priority::Low);
    sim.sleep_past_restart_grace();
    // Registers 1 s after its context exists (10 passes of the watchdog).
    let mut late = sim.helper(&sim.socket(&lease), &[("WD_ATTACH_AFTER_MS", "1000")]);
    // Never registers.
    let mut rogue = sim.helper(&sim.socket(&lease), &[]);
    late.expect("context");
    rogue.expect("context");
    let seen = Instant::now();
    late.expect("attached");
    let observe_until = seen + UNREGISTERED_GRACE + Duration::from_secs(2);
    let mut rogue_gone = None;
    while Instant::now() < observe_until {
        assert!(
            late.alive(),
            "the process that registered within the grace was killed:\n{}",
            sim.d.log()
        );
        assert!(
            sim.violations_of(late.pid()).is_empty(),
            "{:?}",
            sim.violations_of(late.pid())
        );
        if rogue_gone.is_none() && !rogue.alive() {
            rogue_gone = Some(seen.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_until("the rogue to be killed", Duration::from_secs(10), || {
        !rogue.alive()
    });
    let gone = rogue_gone.unwrap_or(seen.elapsed());
    assert!(
        gone >= UNREGISTERED_GRACE - Duration::from_millis(200),
        "killed {gone:?} after its context appeared, within the grace"
    );
    assert!(sim.d.log().contains("watchdog killed the process"));
}

#[test]
fn after_a_restart_an_idle_process_holding_memory_is_seen_again_and_never_reported_or_killed() {
    let mut sim = Sim::start(true, 100);
    let lease = sim.reserve("c", "4Gi", Priority::Low);
    // Attached from the start; after losing the arbiter it re-attaches 0.5 s after
    // the socket answers again, as the interposer does.
    let mut idle = sim.helper(
        &sim.socket(&lease),
        &[("WD_ATTACH_AFTER_MS", "0"), ("WD_REATTACH_DELAY_MS", "500")],
    );
    idle.expect("attached");
    sim.d.kill();
    idle.expect("lost");
    let restart = Instant::now();
    sim.d.restart();
    let mut c = sim.d.client();
    wait_until(
        "the lease's holdings to be seen again",
        Duration::from_secs(5),
        || {
            assert!(idle.alive(), "killed after the restart:\n{}", sim.d.log());
            c.status()
                .unwrap()
                .usage
                .iter()
                .any(|u| u.lease == lease.id && u.memory_used >= GI)
        },
    );
    let seen_again = restart.elapsed();
    assert!(
        seen_again < Duration::from_secs(1),
        "holdings seen again {seen_again:?} after the restart began"
    );
    // Through the whole restart grace and beyond: never reported, never killed.
    let until = restart + RESTART_GRACE + Duration::from_secs(2);
    while Instant::now() < until {
        assert!(idle.alive(), "killed after the restart:\n{}", sim.d.log());
        let v = sim.violations_of(idle.pid());
        assert!(v.is_empty(), "{v:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ----- finding 3: ungated work -----

/// Starts `simgpu-workload` without the interposer, its pid attached on `socket`
/// for `memory_held` (the lease socket sees the workload's own credentials: it
/// connects before it execs).
fn attached_workload(sim: &Sim, lease_socket: &Path, args: &[&str]) -> (Child, UnixStream) {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    let address = UnixAddr::new(lease_socket).unwrap();
    let raw = fd.as_raw_fd();
    let mut cmd = Command::new(workload());
    cmd.args(args)
        .envs(sim.machine.env().to_vec())
        .env("LD_LIBRARY_PATH", simgpu::libs())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: connect(2) is async-signal-safe; the descriptor is the parent's, open
    // in the child until its exec (CLOEXEC).
    unsafe {
        cmd.pre_exec(move || connect(raw, &address).map_err(std::io::Error::from));
    }
    let child = cmd.spawn().unwrap();
    let mut stream = UnixStream::from(fd);
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write_message(
        &mut stream,
        &LeaseRequest::Hello {
            protocol: PROTOCOL_VERSION,
        },
    )
    .unwrap();
    let hello: LeaseResponse = read_message(&mut stream).unwrap();
    assert!(matches!(hello, LeaseResponse::Hello { .. }), "{hello:?}");
    write_message(&mut stream, &LeaseRequest::Attach { memory_held: GI }).unwrap();
    match read_message(&mut stream).unwrap() {
        LeaseResponse::Attached { pid, .. } => assert_eq!(pid, child.id()),
        other => panic!("attach: {other:?}"),
    }
    (child, stream)
}

/// A high-priority client of the test that holds the token.
fn high_holder(sim: &Sim) -> TokenConnection {
    let high = sim.reserve("high", "1Gi", Priority::High);
    let token = TokenConnection::open(&sim.socket(&high), Duration::from_secs(10)).unwrap();
    token.send(TokenRequest::Want).unwrap();
    wait_until("the high grant", Duration::from_secs(10), || {
        token.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
    });
    token
}

fn ungated_reported(sim: &Sim, pid: u32, timeout: Duration) {
    let mut c = sim.d.client();
    wait_until("the ungated report", timeout, || {
        c.status().unwrap().violations.iter().any(|v| {
            v.kind == ViolationKind::Ungated
                && v.pid == pid
                && v.gpu == sim_uuid(0)
                && v.lease.is_some()
                && !v.killed
        })
    });
    let text = String::from_utf8_lossy(&sim.d.ctl(&["status"]).stdout).into_owned();
    assert!(
        text.contains(&format!("violation on GPU 0: pid {pid} of "))
            && text.contains("ran on the GPU without holding the token"),
        "{text}"
    );
    assert!(sim.d.log().contains("without holding its time-slice token"));
}

#[test]
fn kernels_of_a_registered_process_that_bypass_the_gate_are_reported_ungated() {
    let sim = Sim::start(false, 200);
    let low = sim.reserve("low", "4Gi", Priority::Low);
    // No high-priority job is active, so the bypass check does not look: the watchdog's
    // own check finds it. Registered for its memory, running kernels with no token at all.
    let (mut workload, _registration) = bypassing_workload(&sim, &low);
    ungated_reported(&sim, workload.id(), RESTART_GRACE + Duration::from_secs(20));
    assert!(
        workload.try_wait().unwrap().is_none(),
        "reported, not killed"
    );
    let _ = workload.kill();
    let _ = workload.wait();
}

#[test]
fn copies_of_a_low_client_that_holds_no_token_are_reported_ungated() {
    let sim = Sim::start(false, 200);
    let low = sim.reserve("low", "4Gi", Priority::Low);
    // Registered, copying device to device with no token (copies were never gated). No
    // high-priority job is active: the watchdog's own check finds it, not the bypass check.
    let mut copier = sim.helper(
        &sim.socket(&low),
        &[("WD_ATTACH_AFTER_MS", "0"), ("WD_COPY", "1")],
    );
    copier.expect("attached");
    ungated_reported(&sim, copier.pid(), RESTART_GRACE + Duration::from_secs(20));
}

#[test]
fn a_gated_low_job_beside_a_high_one_is_never_reported() {
    let sim = Sim::start(false, 200);
    let low = sim.reserve("low", "4Gi", Priority::Low);
    let high = sim.reserve("high", "4Gi", Priority::High);
    let gated = |lease: &Lease, kernel: &str, gap: &str| {
        Command::new(workload())
            .args(["--device", "0", "--memory", "536870912", "--kernels", "4"])
            .args(["--kernel", kernel, "--gap", gap, "--duration", "60s"])
            .envs(sim.machine.env().to_vec())
            .env("LD_LIBRARY_PATH", simgpu::libs())
            .env("LD_PRELOAD", interposer())
            .env("GPUSHARE_LEASE", &lease.id.0)
            .env("GPUSHARE_SOCKET", sim.socket(lease))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    // The high job leaves most of the GPU to the low one, which uses it while it
    // holds the token: busy most of the time, never without the token.
    let mut high_job = gated(&high, "fixed:1ms", "20ms");
    let mut low_job = gated(&low, "fixed:1ms", "0");
    sim.sleep_past_restart_grace();
    let mut c = sim.d.client();
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        let status = c.status().unwrap();
        let found: Vec<_> = status
            .violations
            .iter()
            .filter(|v| v.pid == low_job.id() || v.pid == high_job.id())
            .collect();
        assert!(found.is_empty(), "{found:?}\n{}", sim.d.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    // Both ran, both through the token.
    let status = c.status().unwrap();
    let token = &status.tokens[0];
    assert!(token.grants > 10, "{token:?}");
    for job in [&mut high_job, &mut low_job] {
        assert!(job.try_wait().unwrap().is_none());
        let _ = job.kill();
        let _ = job.wait();
    }
}

// ----- the bypass check: launches past the gate beside an active high job -----

/// A watchdog interval that keeps the watchdog's own ungated check silent for the
/// test (its window and restart grace are three intervals): only the bypass check can
/// report.
const WATCHDOG_SILENT_MS: u64 = 60_000;

/// The process's state letter in /proc/<pid>/stat ('T': stopped).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A registered low-priority workload running kernels with no token at all.
fn bypassing_workload(sim: &Sim, low: &Lease) -> (Child, UnixStream) {
    attached_workload(
        sim,
        &sim.socket(low),
        &[
            "--device",
            "0",
            "--memory",
            "1073741824",
            "--kernels",
            "8",
            "--kernel",
            "fixed:2ms",
            "--gap",
            "0",
            "--duration",
            "60s",
        ],
    )
}

fn bypass_reported(sim: &Sim, pid: u32) {
    let mut c = sim.d.client();
    wait_until(
        "the bypass check's ungated report",
        RESTART_GRACE + Duration::from_secs(20),
        || {
            c.status()
                .unwrap()
                .violations
                .iter()
                .any(|v| v.kind == ViolationKind::Ungated && v.pid == pid && v.lease.is_some())
        },
    );
    assert!(
        sim.d
            .log()
            .contains("beyond its token time beside an active high-priority job"),
        "{}",
        sim.d.log_tail(20)
    );
}

#[test]
fn launches_past_the_gate_beside_an_active_high_job_are_reported_and_stopped_until_it_is_quiet() {
    let sim = Sim::start(false, WATCHDOG_SILENT_MS);
    let low = sim.reserve("low", "4Gi", Priority::Low);
    let high = high_holder(&sim);
    let (mut workload, _registration) = bypassing_workload(&sim, &low);
    let pid = workload.id();
    bypass_reported(&sim, pid);
    wait_until(
        "the bypassing process stopped",
        Duration::from_secs(10),
        || process_state(pid) == Some('T'),
    );
    let paused = sim.d.run_dir().join("paused");
    assert!(
        paused.exists(),
        "stopped processes are listed for a restart"
    );
    // Still stopped while the high job holds the GPU.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(process_state(pid), Some('T'));
    // The high job leaves: once it is no longer active, the process goes on.
    drop(high);
    wait_until(
        "the stopped process continued",
        Duration::from_secs(10),
        || process_state(pid).is_some_and(|s| s != 'T'),
    );
    assert!(
        workload.try_wait().unwrap().is_none(),
        "continued, not killed"
    );
    assert!(!paused.exists());
    let _ = workload.kill();
    let _ = workload.wait();
}

#[test]
fn an_arbiter_killed_while_a_process_is_stopped_continues_it_when_it_starts_again() {
    let mut sim = Sim::start(false, WATCHDOG_SILENT_MS);
    let low = sim.reserve("low", "4Gi", Priority::Low);
    let _high = high_holder(&sim);
    let (mut workload, _registration) = bypassing_workload(&sim, &low);
    let pid = workload.id();
    wait_until(
        "the bypassing process stopped",
        RESTART_GRACE + Duration::from_secs(20),
        || process_state(pid) == Some('T'),
    );
    sim.d.kill();
    assert_eq!(process_state(pid), Some('T'), "nobody continued it yet");
    sim.d.restart();
    wait_until(
        "the stopped process continued",
        Duration::from_secs(10),
        || process_state(pid).is_some_and(|s| s != 'T'),
    );
    assert!(workload.try_wait().unwrap().is_none());
    let _ = workload.kill();
    let _ = workload.wait();
}

#[test]
fn with_pausing_off_a_process_launching_past_the_gate_is_reported_and_never_stopped() {
    let sim = Sim::start_with(false, WATCHDOG_SILENT_MS, |c| {
        c.scheduler.pause_bypassing = false;
    });
    let low = sim.reserve("low", "4Gi", Priority::Low);
    let _high = high_holder(&sim);
    let (mut workload, _registration) = bypassing_workload(&sim, &low);
    let pid = workload.id();
    bypass_reported(&sim, pid);
    for _ in 0..10 {
        assert_ne!(process_state(pid), Some('T'));
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = workload.kill();
    let _ = workload.wait();
}
