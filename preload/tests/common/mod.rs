//! Harness for the interposer's tests against the simulated GPU: a private
//! gpushare-arbiter (the test kit's) with a lease, and the probe program run with
//! `LD_PRELOAD=libgpushare.so` as a container's process would be.
// Each test file uses some of these.
#![allow(dead_code, unused_imports)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Once, OnceLock};
use std::time::Duration;

use gpushare_proto::{ControlClient, Fraction, GpuSelector, Priority, ReserveRequest};
use gpushare_testkit::Config;
pub use gpushare_testkit::{binaries, simgpu, wait_until, Arbiter};

pub const MI: u64 = 1 << 20;

/// The probe program (tests/probe, package `gpushare-cuda-probe`), as a program to run:
/// `Command::new(PROBE)`. It is another package's binary, so no `CARGO_BIN_EXE_…` names
/// it; the test kit finds it in [`binaries::bin_dir`] (`GPUSHARE_BIN_DIR`, else this
/// test's `target/<profile>`), built there first by [`build_what_the_tests_run`].
pub const PROBE: Probe = Probe;

#[derive(Clone, Copy, Debug)]
pub struct Probe;

impl Probe {
    /// The probe's path, built (or, under `GPUSHARE_BIN_DIR`, checked) on first use.
    pub fn path(self) -> &'static Path {
        static PATH: OnceLock<PathBuf> = OnceLock::new();
        PATH.get_or_init(|| {
            build_what_the_tests_run();
            binaries::require(&["gpushare-cuda-probe"]);
            binaries::program("gpushare-cuda-probe")
        })
    }
}

impl AsRef<OsStr> for Probe {
    fn as_ref(&self) -> &OsStr {
        self.path().as_os_str()
    }
}

/// What the tests run besides this package: `cargo test -p gpushare-preload` does not
/// build them (they are no dependencies of it), so the suite builds them once.
pub fn build_what_the_tests_run() {
    static BUILT: Once = Once::new();
    BUILT.call_once(|| {
        binaries::cargo_build(&[
            "simgpu-libcuda",
            "simgpu-libnvml",
            "gpushare-arbiter",
            "gpushare-cuda-probe",
        ])
    });
}

/// The simulated `libcuda.so.1` and `libnvidia-ml.so.1`, built and installed once per test binary.
pub fn sim_libs() -> &'static Path {
    build_what_the_tests_run();
    simgpu::libs()
}

/// The library under test: `GPUSHARE_PRELOAD_LIB` (the glibc-baseline build `make
/// test` makes), else this profile's `libgpushare.so`.
pub fn library() -> PathBuf {
    binaries::preload_library()
}

/// A private arbiter with two declared 16 GiB GPUs, and a private simulated machine.
pub struct Machine {
    arbiter: Arbiter,
    containers: Vec<Child>,
}

impl Machine {
    pub fn start() -> Machine {
        Machine::start_with(|_| {})
    }

    /// A machine whose arbiter configuration `configure` changes (e.g. the scheduler's).
    pub fn start_with(configure: impl FnOnce(&mut Config)) -> Machine {
        sim_libs();
        let arbiter = Arbiter::builder()
            .declared_gpus(2, "16Gi")
            .configure(configure)
            .start();
        std::fs::create_dir_all(arbiter.dir().join("simgpu")).unwrap();
        Machine {
            arbiter,
            containers: Vec::new(),
        }
    }

    /// A machine whose arbiter also measures the simulated GPUs through their NVML (the
    /// state the probes share), as on a node with a driver: per-process utilisation
    /// included, which the arbiter's bypass check needs.
    pub fn start_measured_with(configure: impl FnOnce(&mut Config)) -> Machine {
        sim_libs();
        let builder = Arbiter::builder().declared_gpus(2, "16Gi");
        // The probes' machine: simgpu's defaults (two 16 GiB GPUs), no reserve.
        let machine = simgpu::SimMachine::new(builder.dir().join("simgpu"), 2, "16Gi")
            .set("SIMGPU_RESERVED_MEMORY", 0);
        let arbiter = builder.simulated(&machine).configure(configure).start();
        std::fs::create_dir_all(arbiter.dir().join("simgpu")).unwrap();
        Machine {
            arbiter,
            containers: Vec::new(),
        }
    }

    /// The machine's private directory (the arbiter's, the simulated GPU's state).
    pub fn dir(&self) -> &Path {
        self.arbiter.dir()
    }

    /// Starts the arbiter again on the same state (after `kill_arbiter`).
    pub fn start_arbiter(&mut self) {
        self.arbiter.restart();
    }

    pub fn kill_arbiter(&mut self) {
        self.arbiter.kill();
    }

    pub fn control(&self) -> ControlClient {
        self.arbiter.client()
    }

    /// A confirmed lease of `memory` on one GPU, whose "container" is a sleeping
    /// process of this test (same pid namespace and cgroup as the probes).
    pub fn lease(&mut self, memory: &str) -> String {
        self.reserve_lease(memory, Priority::Low, GpuSelector::Count(1))
    }

    /// A confirmed lease of `memory` and `priority` on GPU 0 (leases made this way
    /// share one GPU's token).
    pub fn lease_of(&mut self, memory: &str, priority: Priority) -> String {
        self.reserve_lease(memory, priority, GpuSelector::Index(vec![0]))
    }

    fn reserve_lease(&mut self, memory: &str, priority: Priority, gpu: GpuSelector) -> String {
        let mut control = self.control();
        let container_id = format!("c{}", self.containers.len());
        let lease = control
            .reserve(ReserveRequest {
                container_id: container_id.clone(),
                namespace: None,
                sandbox_id: None,
                priority,
                memory: Some(memory.parse().unwrap()),
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                gpu,
                tenant: None,
                pod: None,
            })
            .unwrap();
        let init = Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        control.confirm(container_id, init.id()).unwrap();
        self.containers.push(init);
        lease.id.0
    }

    pub fn lease_socket(&self, lease: &str) -> PathBuf {
        self.arbiter.lease_socket(lease)
    }

    /// The probe as a process of the lease's container.
    pub fn probe(&self, lease: Option<&str>, args: &[&str]) -> Command {
        let mut cmd = Command::new(PROBE);
        cmd.args(args)
            .env("LD_PRELOAD", library())
            .env("LD_LIBRARY_PATH", sim_libs())
            .env("SIMGPU_DIR", self.dir().join("simgpu"))
            // The arbiter here has declared devices, not the simulated NVML: nothing
            // places leases within the driver's reserve, and the physical figures these
            // tests read (`bare_probe`) are the allocations' own.
            .env("SIMGPU_RESERVED_MEMORY", "0")
            .env("GPUSHARE_LOG", "debug")
            .env_remove("GPUSHARE_LEASE")
            .env_remove("GPUSHARE_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(lease) = lease {
            cmd.env("GPUSHARE_LEASE", lease)
                .env("GPUSHARE_SOCKET", self.lease_socket(lease));
        }
        cmd
    }

    /// The probe without the library: the physical truth.
    pub fn bare_probe(&self, args: &[&str]) -> Command {
        let mut cmd = self.probe(None, args);
        cmd.env_remove("LD_PRELOAD");
        cmd
    }

    pub fn ledger_used(&self, lease: &str) -> u64 {
        let report = self.control().status().unwrap();
        report
            .usage
            .iter()
            .find(|u| u.lease.0 == lease)
            .map_or(0, |u| u.memory_used)
    }

    pub fn arbiter_log(&self) -> String {
        self.arbiter.log()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        for c in &mut self.containers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A low-priority request for one GPU by `container` (`memory`: None asks for the
/// arbiter's `default_memory`).
pub fn low_request(container: &str, memory: Option<&str>) -> ReserveRequest {
    ReserveRequest {
        container_id: container.into(),
        namespace: None,
        sandbox_id: None,
        priority: Priority::Low,
        memory: memory.map(|m| m.parse().unwrap()),
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        gpu: GpuSelector::Count(1),
        tenant: None,
        pod: None,
    }
}

/// Confirms `container`'s lease with a sleeping process of this test as its "container"
/// (same pid namespace and cgroup as the probes); the caller ends it.
pub fn sleeping_container(control: &mut ControlClient, container: String) -> Child {
    let init = Command::new("sleep")
        .arg("1000")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    control.confirm(container, init.id()).unwrap();
    init
}

/// The probe as a process of `lease` (its socket: `socket`) on the simulated `machine`,
/// where the arbiter reads the same machine through the simulated NVML.
pub fn probe_on(
    machine: &simgpu::SimMachine,
    lease: &str,
    socket: PathBuf,
    args: &[&str],
) -> Command {
    let mut cmd = Command::new(PROBE);
    cmd.args(args)
        .env("LD_PRELOAD", library())
        .env("GPUSHARE_LOG", "debug")
        .env("GPUSHARE_LEASE", lease)
        .env("GPUSHARE_SOCKET", socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    machine.apply(&mut cmd);
    cmd
}

/// Runs to completion; fails the test, with the probe's stderr, if it failed.
pub fn run(cmd: &mut Command) -> Steps {
    let out = cmd.output().unwrap();
    let steps = Steps::from(&out);
    assert!(
        out.status.success(),
        "probe failed: {}\n{}",
        out.status,
        steps.stderr
    );
    steps
}

/// The probe's output: one line per step, `<step> <result> [key=value ...]`.
pub struct Steps {
    pub lines: Vec<String>,
    pub stderr: String,
}

impl Steps {
    pub fn from(out: &Output) -> Steps {
        Steps {
            lines: String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_owned)
                .collect(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// The `n`th line of step `step`.
    pub fn nth(&self, step: &str, n: usize) -> &str {
        self.lines
            .iter()
            .filter(|l| l.split(' ').next() == Some(step))
            .nth(n)
            .unwrap_or_else(|| {
                panic!(
                    "no {step} #{n} in {:?}\nstderr: {}",
                    self.lines, self.stderr
                )
            })
    }

    pub fn result(&self, step: &str, n: usize) -> &str {
        self.nth(step, n).split(' ').nth(1).unwrap()
    }

    pub fn value(&self, step: &str, n: usize, key: &str) -> String {
        let line = self.nth(step, n);
        line.split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {line}"))
            .to_owned()
    }

    pub fn number(&self, step: &str, n: usize, key: &str) -> u64 {
        self.value(step, n, key).parse().unwrap()
    }
}

/// Waits for a child probe and returns its steps.
pub fn finish(child: Child) -> Steps {
    let out = child.wait_with_output().unwrap();
    let steps = Steps::from(&out);
    assert!(
        out.status.success(),
        "probe failed: {}\n{:?}\n{}",
        out.status,
        steps.lines,
        steps.stderr
    );
    steps
}

/// Waits for a child probe to exit, at most `limit` (a bound that catches a hang, not a
/// speed): past it the probe is killed and the test fails with `hung` and its stderr.
pub fn finish_within(mut child: Child, limit: Duration, hung: &str) -> Steps {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("{hung}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    finish(child)
}

/// What [`revoke_mid_work`] saw.
pub struct Revoked {
    pub high: Steps,
    pub low: Steps,
    /// The GPU's token status once the high-priority job finished.
    pub token: gpushare_proto::TokenStatus,
}

/// On a low- and a high-priority lease of `memory` each: a low-priority probe (`options`, then `launch 1` to hold the token, then `work`, then
/// 3.5 s alive) revoked mid-work: a high-priority probe waits until `work` was submitted,
/// launches (revoking the low holder) and stays 600 ms. The high job starts first, so the
/// revocation lands early in work of some seconds however slowly processes start.
pub fn revoke_mid_work(m: &mut Machine, memory: &str, options: &[&str], work: &[&str]) -> Revoked {
    let low = &m.lease_of(memory, Priority::Low);
    let high = &m.lease_of(memory, Priority::High);
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let started = started.to_str().unwrap();
    let high_job = m
        .probe(
            Some(high),
            &["wait", started, "launch", "1", "sleep", "600"],
        )
        .spawn()
        .unwrap();
    let steps = [
        options,
        &["launch", "1"],
        work,
        &["touch", started, "sleep", "3500"],
    ];
    let low_job = m.probe(Some(low), &steps.concat()).spawn().unwrap();
    let high = finish(high_job);
    let token = m
        .control()
        .status()
        .unwrap()
        .tokens
        .into_iter()
        .next()
        .unwrap();
    Revoked {
        high,
        low: finish(low_job),
        token,
    }
}
