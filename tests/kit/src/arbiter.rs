//! A private `gpushare-arbiter` for a test or benchmark: the real binary, run as a child
//! process on a directory of its own (run and state directories, configuration, log), its
//! GPUs declared or simulated. Its configuration is a typed [`Config`], written by the
//! config crate, so a suite can never hand the arbiter a file it would read differently.
//!
//! ```no_run
//! use gpushare_testkit::Arbiter;
//! let arbiter = Arbiter::builder()
//!     .declared_gpus(2, "16Gi")
//!     .configure(|c| c.scheduler.revoke_grace_ms = 100)
//!     .start();
//! let status = arbiter.client().status().unwrap();
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

use gpushare_config::{Config, DeclaredDevice};
use gpushare_proto::ControlClient;

use crate::simgpu::{self, SimMachine};
use crate::{binaries, layout};

/// How long a starting arbiter may take to answer on its control socket: generous, for a
/// loaded 2-core CI machine running several suites.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopping arbiter may take to clean up after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How long [`Arbiter::client`] waits to connect.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// The client timeout private arbiters are configured with (the production default is
/// 10 s): a test that hangs on an arbiter should fail sooner.
const CLIENT_TIMEOUT_MS: u64 = 5_000;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("the arbiter exited with {status} (configuration {config}): {log_tail}")]
    Exited {
        status: ExitStatus,
        config: PathBuf,
        log_tail: String,
    },
    #[error("the arbiter did not open {socket} within {timeout:?}: {log_tail}")]
    Silent {
        socket: PathBuf,
        timeout: Duration,
        log_tail: String,
    },
    #[error("the configuration does not serialise as TOML: {0}")]
    Config(#[from] toml::ser::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Io { what, source }
}

/// How a private arbiter is to be started; [`ArbiterBuilder::start`] starts it.
pub struct ArbiterBuilder {
    dir: PathBuf,
    owned_dir: Option<tempfile::TempDir>,
    config: Config,
    program: Option<PathBuf>,
    env: Vec<(String, String)>,
}

impl ArbiterBuilder {
    fn new(dir: PathBuf, owned_dir: Option<tempfile::TempDir>) -> ArbiterBuilder {
        let mut config = Config::default();
        config.arbiter.run_dir = dir.join("run");
        config.arbiter.state_dir = dir.join("state");
        config.arbiter.client_timeout_ms = CLIENT_TIMEOUT_MS;
        // No NVML unless the GPUs are simulated: the GPUs are declared.
        config.arbiter.nvml_library = String::new();
        // The runtime side (gpushare-runc, the hook, the shim) reads the same file: point it
        // at this build's interposer and hook, and at plain runc.
        config.runtime.runtimes = vec!["runc".into()];
        config.runtime.library = binaries::preload_library();
        config.runtime.hook = binaries::program("gpushare-hook");
        ArbiterBuilder {
            dir,
            owned_dir,
            config,
            program: None,
            env: Vec::new(),
        }
    }

    /// The arbiter's directory: the configuration, the log, and the run and state
    /// directories are there.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration it will be started with, as configured so far.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// `count` declared GPUs of `memory` each (`"16Gi"`), named by the simulated GPU's
    /// UUIDs; no NVML.
    pub fn declared_gpus(mut self, count: u32, memory: &str) -> ArbiterBuilder {
        let memory = memory
            .parse()
            .unwrap_or_else(|e| panic!("GPU memory {memory:?}: {e}"));
        self.config.arbiter.devices = (0..count)
            .map(|i| DeclaredDevice {
                uuid: simgpu::gpu_uuid(i),
                name: format!("declared GPU {i}"),
                memory,
            })
            .collect();
        self
    }

    /// Takes the inventory through the simulated NVML of `machine` (its GPUs, its state),
    /// which the arbiter then shares with every program run on the same machine.
    pub fn simulated(mut self, machine: &SimMachine) -> ArbiterBuilder {
        self.config.arbiter.nvml_library = simgpu::nvml_library().display().to_string();
        self.env.extend(machine.env().iter().cloned());
        self
    }

    /// Any other setting, on the typed configuration.
    pub fn configure(mut self, edit: impl FnOnce(&mut Config)) -> ArbiterBuilder {
        edit(&mut self.config);
        self
    }

    /// An environment variable for the arbiter's process.
    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> ArbiterBuilder {
        self.env
            .push((key.into(), value.as_ref().to_string_lossy().into_owned()));
        self
    }

    /// The arbiter binary the suite built (`CARGO_BIN_EXE_gpushare-arbiter`), unless
    /// `GPUSHARE_TEST_ARBITER` names another; see [`binaries::arbiter`].
    pub fn program(mut self, built: impl Into<PathBuf>) -> ArbiterBuilder {
        self.program = Some(built.into());
        self
    }

    /// Starts the arbiter; fails the test, with the arbiter's log, if it does not come up.
    pub fn start(self) -> Arbiter {
        self.try_start().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Writes the configuration, starts the arbiter and waits until its control socket
    /// answers.
    pub fn try_start(self) -> Result<Arbiter, StartError> {
        let config_path = self.dir.join("config.toml");
        std::fs::write(&config_path, self.config.to_toml()?)
            .map_err(io(format!("writing {}", config_path.display())))?;
        let mut arbiter = Arbiter {
            child: None,
            program: binaries::arbiter(self.program.as_deref()),
            dir: self.dir,
            config: self.config,
            config_path,
            env: self.env,
            _owned_dir: self.owned_dir,
        };
        arbiter.try_restart()?;
        Ok(arbiter)
    }
}

/// A running private arbiter; stopped (SIGTERM, so it removes its sockets, then waited
/// for) when dropped.
pub struct Arbiter {
    child: Option<Child>,
    program: PathBuf,
    dir: PathBuf,
    config: Config,
    config_path: PathBuf,
    env: Vec<(String, String)>,
    /// Dropped after the arbiter is stopped (fields drop after `drop` runs).
    _owned_dir: Option<tempfile::TempDir>,
}

impl Arbiter {
    /// An arbiter in a new private directory under /tmp (short: unix socket paths must
    /// stay under 108 bytes), removed when it is dropped.
    pub fn builder() -> ArbiterBuilder {
        let dir = tempfile::Builder::new()
            .prefix("gs-")
            .tempdir_in("/tmp")
            .expect("a temporary directory under /tmp");
        ArbiterBuilder::new(dir.path().to_owned(), Some(dir))
    }

    /// An arbiter in `dir`, which the caller owns (and may share with other daemons).
    pub fn builder_in(dir: &Path) -> ArbiterBuilder {
        ArbiterBuilder::new(dir.to_owned(), None)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Its configuration file, for the tools that read the same one (gpusharectl,
    /// gpushare-runc, the hook, the shim).
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn run_dir(&self) -> &Path {
        &self.config.arbiter.run_dir
    }

    pub fn control_socket(&self) -> PathBuf {
        self.config.arbiter.control_socket()
    }

    /// A connected control client.
    pub fn client(&self) -> ControlClient {
        ControlClient::connect(&self.control_socket(), CONTROL_TIMEOUT)
            .unwrap_or_else(|e| panic!("connecting to the arbiter: {e}"))
    }

    pub fn lease_dir(&self, lease: &str) -> PathBuf {
        layout::lease_dir(self.run_dir(), lease)
    }

    pub fn lease_socket(&self, lease: &str) -> PathBuf {
        layout::lease_socket(self.run_dir(), lease)
    }

    /// The lease directories present under the run directory, sorted.
    pub fn lease_dirs(&self) -> Vec<String> {
        layout::lease_dirs(self.run_dir())
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("arbiter.log")
    }

    /// Everything it (and earlier arbiters on the same directory) logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The last `lines` lines of [`Arbiter::log`].
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the arbiter is running").id()
    }

    /// Whether the arbiter exited by itself (reaped, its status); None while it runs.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(status)
    }

    /// SIGKILL, as a crash would: the arbiter cleans nothing up, so its sockets and state
    /// stay for [`Arbiter::restart`]. Returns once it is reaped.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, and waits for it to exit (SIGKILL after a while).
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            // SAFETY: kill(2) on the pid of a child we started and have not reaped, so the
            // pid cannot belong to another process.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts a new arbiter on the same configuration and directories (after
    /// [`Arbiter::kill`], as a supervisor would after a crash), its log appended.
    pub fn restart(&mut self) {
        self.try_restart().unwrap_or_else(|e| panic!("{e}"));
    }

    /// [`Arbiter::restart`] with its failure as a value.
    pub fn try_restart(&mut self) -> Result<(), StartError> {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(io("opening arbiter.log"))?;
        let child = Command::new(&self.program)
            .arg("--config")
            .arg(&self.config_path)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(log.try_clone().map_err(io("arbiter.log"))?)
            .stderr(log)
            .spawn()
            .map_err(io(format!("starting {}", self.program.display())))?;
        self.child = Some(child);
        let socket = self.config.arbiter.control_socket();
        let start = Instant::now();
        loop {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                return Err(StartError::Exited {
                    status,
                    config: self.config_path.clone(),
                    log_tail: self.log_tail(20),
                });
            }
            if ControlClient::connect(&socket, Duration::from_secs(5)).is_ok() {
                return Ok(());
            }
            if start.elapsed() > START_TIMEOUT {
                return Err(StartError::Silent {
                    socket,
                    timeout: START_TIMEOUT,
                    log_tail: self.log_tail(20),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `gpusharectl --config <its configuration> args…`.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(binaries::gpusharectl())
            .arg("--config")
            .arg(&self.config_path)
            .args(args)
            .output()
            .expect("run gpusharectl")
    }

    /// `gpusharectl status --json`, failing the test if gpusharectl fails.
    pub fn status_json(&self) -> serde_json::Value {
        let out = self.ctl(&["status", "--json"]);
        assert!(
            out.status.success(),
            "gpusharectl status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("gpusharectl status --json prints JSON")
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A stand-in for a container's init process, whose pid confirms a lease: `sleep
/// 1000`, its stdio null so that a leaked one holds no caller's pipe open. The caller
/// kills it when the container is to end.
pub fn stand_in_init() -> Child {
    Command::new("sleep")
        .arg("1000")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting sleep, a container's stand-in init")
}

/// A loopback TCP port free a moment ago, for a listener a test configures (the metrics
/// address). Another process may take it in between; the tests that use it start one
/// listener each, soon after.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a loopback port")
        .port()
}

/// A request for `memory` on GPU `index` at `priority`, for `container_id`, with no
/// compute request or limit and nothing of Kubernetes: what a plain `docker run` asks.
pub fn reserve_request(
    container_id: &str,
    priority: gpushare_proto::Priority,
    memory: &str,
    index: u32,
) -> gpushare_proto::ReserveRequest {
    gpushare_proto::ReserveRequest {
        container_id: container_id.into(),
        namespace: None,
        sandbox_id: None,
        priority,
        memory: Some(memory.parse().expect("a memory quantity")),
        compute_request: gpushare_proto::Fraction::ZERO,
        compute_limit: gpushare_proto::Fraction::ONE,
        gpu: gpushare_proto::GpuSelector::Index(vec![index]),
        tenant: None,
        pod: None,
    }
}
