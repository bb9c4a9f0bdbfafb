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
use gpushare_proto::{ControlClient, Fraction, GpuSelector, Priority, ReserveRequest};

/// The simulated context's size: not the arbiter's estimate (300 MiB), so only a
/// measurement gets the numbers below right.
const CONTEXT: u64 = 256 * MI;
const QUOTA: u64 = 1024 * MI;

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// A private arbiter on one simulated 16 GiB GPU, seen through the simulated NVML,
/// with the watchdog every 200 ms and killing what it reports.
struct NvmlMachine {
    dir: tempfile::TempDir,
    arbiter: Child,
    containers: Vec<Child>,
}

impl NvmlMachine {
    fn start() -> NvmlMachine {
        let libs = sim_libs();
        let dir = tempfile::Builder::new()
            .prefix("gsm-")
            .tempdir_in("/tmp")
            .unwrap();
        let config = format!(
            "[arbiter]\nrun_dir = \"{}\"\nstate_dir = \"{}\"\nclient_timeout_ms = 5000\n\
             nvml_library = \"{}\"\nwatchdog_interval_ms = 200\nwatchdog_kill = true\n",
            dir.path().join("run").display(),
            dir.path().join("state").display(),
            libs.join("libnvidia-ml.so.1").display(),
        );
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        std::fs::create_dir_all(dir.path().join("simgpu")).unwrap();
        let log = std::fs::File::create(dir.path().join("arbiter.log")).unwrap();
        let mut arbiter = Command::new(profile_dir().join("gpushare-arbiter"));
        arbiter
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        sim_env(&mut arbiter, dir.path());
        let arbiter = arbiter.spawn().expect("start gpushare-arbiter");
        let socket = dir.path().join("run/control.sock");
        wait_until("the arbiter", Duration::from_secs(30), || {
            ControlClient::connect(&socket, Duration::from_secs(5)).is_ok()
        });
        NvmlMachine {
            dir,
            arbiter,
            containers: Vec::new(),
        }
    }

    fn control(&self) -> ControlClient {
        ControlClient::connect(
            &self.dir.path().join("run/control.sock"),
            Duration::from_secs(10),
        )
        .unwrap()
    }

    fn reserve(&self, container: &str, memory: &str) -> Result<String, String> {
        self.control()
            .reserve(ReserveRequest {
                container_id: container.into(),
                sandbox_id: None,
                priority: Priority::Low,
                memory: Some(memory.parse().unwrap()),
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                gpu: GpuSelector::Count(1),
                tenant: None,
            })
            .map(|l| l.id.0)
            .map_err(|e| e.to_string())
    }

    /// A confirmed lease whose "container" is a sleeping process of this test.
    fn lease(&mut self, memory: &str) -> String {
        let container = format!("c{}", self.containers.len());
        let lease = self.reserve(&container, memory).unwrap();
        let init = Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.control().confirm(container, init.id()).unwrap();
        self.containers.push(init);
        lease
    }

    fn probe(&self, lease: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(PROBE);
        cmd.args(args)
            .env("LD_PRELOAD", library())
            .env("LD_LIBRARY_PATH", sim_libs())
            .env("GPUSHARE_LOG", "debug")
            .env("GPUSHARE_LEASE", lease)
            .env(
                "GPUSHARE_SOCKET",
                self.dir
                    .path()
                    .join("run/leases")
                    .join(lease)
                    .join("arbiter.sock"),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sim_env(&mut cmd, self.dir.path());
        cmd
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("arbiter.log")).unwrap_or_default()
    }
}

/// The same simulated machine for the arbiter (NVML) and the programs.
fn sim_env(cmd: &mut Command, dir: &Path) {
    cmd.env("SIMGPU_DIR", dir.join("simgpu"))
        .env("SIMGPU_GPUS", "1")
        .env("SIMGPU_MEMORY", "16Gi")
        .env("SIMGPU_CONTEXT_MEMORY", CONTEXT.to_string())
        .env("SIMGPU_MODULE_MEMORY", "0");
}

impl Drop for NvmlMachine {
    fn drop(&mut self) {
        let _ = self.arbiter.kill();
        let _ = self.arbiter.wait();
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
