//! A private gpushare-arbiter for integration tests: the real binary, a
//! temporary run and state directory, declared devices (or the simulated GPU).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_proto::{ControlClient, Fraction, GpuSelector, Priority, ReserveRequest};

pub const ARBITER: &str = env!("CARGO_BIN_EXE_gpushare-arbiter");
pub const CTL: &str = env!("CARGO_BIN_EXE_gpusharectl");

pub fn sim_uuid(index: u32) -> String {
    format!("GPU-51a6d0e0-0000-4000-8000-{index:012x}")
}

pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub struct Daemon {
    child: Option<Child>,
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub run_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

/// `gpus` declared 16 GiB devices unless `extra` sets its own; NVML is skipped
/// unless `extra` names a library.
pub fn config_text(dir: &Path, gpus: u32, memory: &str, extra: &str) -> String {
    let mut text = format!(
        "[arbiter]\nrun_dir = \"{run}\"\nstate_dir = \"{state}\"\nclient_timeout_ms = 10000\n{nvml}{extra}\n",
        run = dir.join("run").display(),
        state = dir.join("state").display(),
        nvml = if extra.contains("nvml_library") { "" } else { "nvml_library = \"\"\n" },
    );
    for i in 0..gpus {
        text += &format!(
            "\n[[arbiter.devices]]\nuuid = \"{}\"\nname = \"declared GPU {i}\"\nmemory = \"{memory}\"\n",
            sim_uuid(i)
        );
    }
    text
}

impl Daemon {
    pub fn start(gpus: u32, memory: &str, extra: &str) -> Daemon {
        let tmp = tempfile::Builder::new()
            .prefix("gsa-")
            .tempdir_in("/tmp")
            .unwrap();
        let dir = tmp.path().to_owned();
        std::fs::write(
            dir.join("config.toml"),
            config_text(&dir, gpus, memory, extra),
        )
        .unwrap();
        let mut d = Daemon {
            child: None,
            config_path: dir.join("config.toml"),
            run_dir: dir.join("run"),
            dir,
            _tmp: Some(tmp),
        };
        d.restart();
        d
    }

    pub fn start_with_env(gpus: u32, memory: &str, extra: &str, env: &[(&str, &str)]) -> Daemon {
        let tmp = tempfile::Builder::new()
            .prefix("gsa-")
            .tempdir_in("/tmp")
            .unwrap();
        let dir = tmp.path().to_owned();
        std::fs::write(
            dir.join("config.toml"),
            config_text(&dir, gpus, memory, extra),
        )
        .unwrap();
        let mut d = Daemon {
            child: None,
            config_path: dir.join("config.toml"),
            run_dir: dir.join("run"),
            dir,
            _tmp: Some(tmp),
        };
        d.spawn(env);
        d
    }

    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("control.sock")
    }

    fn spawn(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("arbiter.log"))
            .unwrap();
        // GPUSHARE_TEST_ARBITER runs these tests against another build (an older
        // one, to show that a test fails without the fix it covers).
        let binary = std::env::var("GPUSHARE_TEST_ARBITER").unwrap_or_else(|_| ARBITER.into());
        let mut cmd = Command::new(binary);
        cmd.arg("--config")
            .arg(&self.config_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().expect("start gpushare-arbiter"));
        let socket = self.control_socket();
        let child = self.child.as_mut().unwrap();
        wait_until(
            "the arbiter's control socket",
            Duration::from_secs(30),
            || {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "the arbiter exited with {status}: {}",
                        std::fs::read_to_string(self.dir.join("arbiter.log")).unwrap_or_default()
                    );
                }
                ControlClient::connect(&socket, Duration::from_secs(5)).is_ok()
            },
        );
    }

    /// Starts (again) on the same directories.
    pub fn restart(&mut self) {
        self.spawn(&[]);
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn client(&self) -> ControlClient {
        ControlClient::connect(&self.control_socket(), Duration::from_secs(10)).unwrap()
    }

    pub fn lease_socket(&self, lease: &str) -> PathBuf {
        self.run_dir.join("leases").join(lease).join("arbiter.sock")
    }

    pub fn lease_dirs(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.run_dir.join("leases"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("arbiter.log")).unwrap_or_default()
    }

    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        Command::new(CTL)
            .arg("--config")
            .arg(&self.config_path)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn request(container: &str, memory: &str, priority: Priority) -> ReserveRequest {
    ReserveRequest {
        container_id: container.into(),
        namespace: None,
        sandbox_id: None,
        priority,
        memory: Some(memory.parse().unwrap()),
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        gpu: GpuSelector::Count(1),
        tenant: None,
    }
}

/// A stand-in container: a real process whose pid confirms a lease.
/// Its output goes nowhere: a process left behind by a failing test must not
/// hold the test runner's output pipe open (CI reads it through `tee`).
pub fn container_process() -> Child {
    Command::new("sleep")
        .arg("1000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Confirms `container` with this test process as its init: the test's own
/// connections then come from inside "the container" (same pid namespace and
/// cgroup), as the arbiter requires of every lease-socket peer.
pub fn confirm_here(c: &mut ControlClient, container: &str) {
    c.confirm(container.into(), std::process::id()).unwrap();
}

/// A stand-in container with a pid namespace of its own: `sleep` as its init.
/// Stop it with `stop`: killing unshare alone would orphan the init.
pub struct NamespacedContainer {
    unshare: Child,
    /// The init's host pid.
    pub init: u32,
}

impl NamespacedContainer {
    pub fn start() -> NamespacedContainer {
        let unshare = Command::new("unshare")
            .args(["--pid", "--fork", "sleep", "1000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // unshare forks: the container's init is its child.
        let mut init = None;
        wait_until("the namespaced child", Duration::from_secs(10), || {
            let children =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.id()))
                    .unwrap_or_default();
            init = children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse::<u32>().ok());
            init.is_some()
        });
        NamespacedContainer {
            unshare,
            init: init.unwrap(),
        }
    }
}

impl Drop for NamespacedContainer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-9", &self.init.to_string()])
            .status();
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}
