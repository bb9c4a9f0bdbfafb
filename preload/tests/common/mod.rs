//! Harness for the interposer's tests against the simulated GPU: the simulated
//! driver libraries, a private gpushare-arbiter with a lease, and the probe program
//! run with `LD_PRELOAD=libgpushare.so` as a container's process would be.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpushare_proto::{ControlClient, Fraction, GpuSelector, Priority, ReserveRequest};

pub const MI: u64 = 1 << 20;
pub const PROBE: &str = env!("CARGO_BIN_EXE_gpushare-cuda-probe");

/// `target/<profile>` of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

fn cargo_build(packages: &[&str]) {
    let profile_dir = profile_dir();
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build.args(["build", "-q"]);
    for p in packages {
        build.args(["-p", p]);
    }
    build.arg("--target-dir").arg(profile_dir.parent().unwrap());
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build {packages:?} failed");
}

/// The simulated `libcuda.so.1` and `libnvidia-ml.so.1`, installed once per test binary.
pub fn sim_libs() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        cargo_build(&["simgpu-libcuda", "simgpu-libnvml", "gpushare-arbiter"]);
        let dir = tempfile::tempdir().unwrap();
        let profile_dir = profile_dir();
        let status =
            Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/simgpu/install.sh"))
                .arg(dir.path())
                .arg(profile_dir.file_name().unwrap())
                .env("CARGO_TARGET_DIR", profile_dir.parent().unwrap())
                .status()
                .unwrap();
        assert!(status.success(), "install.sh failed");
        dir
    })
    .path()
}

/// The library under test: `GPUSHARE_PRELOAD_LIB` (the glibc-baseline build `make
/// test` makes), else this profile's `libgpushare.so`.
pub fn library() -> PathBuf {
    std::env::var_os("GPUSHARE_PRELOAD_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| profile_dir().join("libgpushare.so"))
}

pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A private arbiter with two declared 16 GiB GPUs, and a private simulated machine.
pub struct Machine {
    pub dir: tempfile::TempDir,
    arbiter: Option<Child>,
    containers: Vec<Child>,
}

impl Machine {
    pub fn start() -> Machine {
        Machine::start_with("")
    }

    /// A machine whose arbiter configuration ends with `extra` (whole TOML sections,
    /// e.g. "[scheduler]\nlaunch_ahead = 1\n").
    pub fn start_with(extra: &str) -> Machine {
        sim_libs();
        let dir = tempfile::Builder::new()
            .prefix("gsp-")
            .tempdir_in("/tmp")
            .unwrap();
        let mut config = format!(
            "[arbiter]\nrun_dir = \"{}\"\nstate_dir = \"{}\"\nclient_timeout_ms = 5000\nnvml_library = \"\"\n",
            dir.path().join("run").display(),
            dir.path().join("state").display()
        );
        for i in 0..2 {
            config += &format!(
                "\n[[arbiter.devices]]\nuuid = \"GPU-51a6d0e0-0000-4000-8000-{i:012x}\"\nname = \"sim {i}\"\nmemory = \"16Gi\"\n"
            );
        }
        config += "\n";
        config += extra;
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        std::fs::create_dir_all(dir.path().join("simgpu")).unwrap();
        let mut m = Machine {
            dir,
            arbiter: None,
            containers: Vec::new(),
        };
        m.start_arbiter();
        m
    }

    pub fn start_arbiter(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("arbiter.log"))
            .unwrap();
        let child = Command::new(profile_dir().join("gpushare-arbiter"))
            .arg("--config")
            .arg(self.dir.path().join("config.toml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start gpushare-arbiter");
        self.arbiter = Some(child);
        let socket = self.dir.path().join("run/control.sock");
        wait_until("the arbiter", Duration::from_secs(30), || {
            ControlClient::connect(&socket, Duration::from_secs(5)).is_ok()
        });
    }

    pub fn kill_arbiter(&mut self) {
        if let Some(mut c) = self.arbiter.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn control(&self) -> ControlClient {
        ControlClient::connect(
            &self.dir.path().join("run/control.sock"),
            Duration::from_secs(10),
        )
        .unwrap()
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
        self.dir
            .path()
            .join("run/leases")
            .join(lease)
            .join("arbiter.sock")
    }

    /// The probe as a process of the lease's container.
    pub fn probe(&self, lease: Option<&str>, args: &[&str]) -> Command {
        let mut cmd = Command::new(PROBE);
        cmd.args(args)
            .env("LD_PRELOAD", library())
            .env("LD_LIBRARY_PATH", sim_libs())
            .env("SIMGPU_DIR", self.dir.path().join("simgpu"))
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
        std::fs::read_to_string(self.dir.path().join("arbiter.log")).unwrap_or_default()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.kill_arbiter();
        for c in &mut self.containers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
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
