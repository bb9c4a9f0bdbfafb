//! The machinery around an experiment: the built binaries, the simulated GPU's libraries, and a
//! private `gpushare-arbiter` with its own configuration, run directory and simulated GPU.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpushare_proto::{
    ControlClient, Fraction, GpuSelector, Lease, MemoryRequest, Priority, ReserveRequest,
};

/// Simulated GPU: one device (every job shares it), its UUID as simgpu derives it.
pub const GPU_UUID: &str = "GPU-51a6d0e0-0000-4000-8000-000000000000";
const GPU_MEMORY: &str = "16Gi";
/// Each lease's memory: the workloads allocate nothing, so any amount that fits four times.
const LEASE_MEMORY_BYTES: u64 = 1 << 30;
const ARBITER_START_TIMEOUT: Duration = Duration::from_secs(10);
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{path} is missing: build it first (cargo build --release -p simgpu-libcuda -p simgpu-libnvml -p simgpu-workload -p gpushare-arbiter -p gpushare-preload), or point GPUSHARE_BIN_DIR / GPUSHARE_PRELOAD_LIB at the build")]
    Missing { path: PathBuf },
    #[error("tests/simgpu/install.sh {dest} {profile} failed: {why}")]
    Install {
        dest: PathBuf,
        profile: String,
        why: String,
    },
    #[error("the arbiter refused its configuration {config}: {log_tail}")]
    ConfigRefused { config: PathBuf, log_tail: String },
    #[error("the arbiter did not open {socket} within {ARBITER_START_TIMEOUT:?}: {log_tail}")]
    ArbiterSilent { socket: PathBuf, log_tail: String },
    #[error("reserving a lease for {job}: {source}")]
    Reserve {
        job: String,
        source: gpushare_proto::ClientError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SetupError {
    let what = what.into();
    move |source| SetupError::Io { what, source }
}

/// Where the programs an experiment runs were built.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
    pub preload: PathBuf,
    /// `debug` or `release`: which simgpu libraries install.sh takes.
    pub profile: String,
}

impl Binaries {
    /// `GPUSHARE_BIN_DIR`, else the cargo profile directory this program runs from;
    /// `GPUSHARE_PRELOAD_LIB`, else `libgpushare.so` in that directory. Builds nothing.
    pub fn locate() -> Result<Binaries, SetupError> {
        let dir = match std::env::var_os("GPUSHARE_BIN_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => std::env::current_exe()
                .map_err(io("the path of gpushare-bench"))?
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
        };
        let dir = dir
            .canonicalize()
            .map_err(|_| SetupError::Missing { path: dir.clone() })?;
        let preload = std::env::var_os("GPUSHARE_PRELOAD_LIB")
            .map_or_else(|| dir.join("libgpushare.so"), PathBuf::from);
        let profile = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| n == "release")
            .unwrap_or_else(|| "debug".into());
        let binaries = Binaries {
            dir,
            preload,
            profile,
        };
        for path in [
            binaries.program("gpushare-arbiter"),
            binaries.program("simgpu-workload"),
            binaries.dir.join("libcuda.so"),
            binaries.dir.join("libnvidia_ml.so"),
            binaries.preload.clone(),
        ] {
            if !path.exists() {
                return Err(SetupError::Missing { path });
            }
        }
        Ok(binaries)
    }

    pub fn program(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Installs `libcuda.so.1` and `libnvidia-ml.so.1` into `dest` with tests/simgpu/install.sh.
    pub fn install_simgpu(&self, dest: &Path) -> Result<(), SetupError> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../simgpu/install.sh");
        let failed = |why: String| SetupError::Install {
            dest: dest.to_owned(),
            profile: self.profile.clone(),
            why,
        };
        // install.sh looks in $CARGO_TARGET_DIR/<profile>: the directory above ours.
        let target = self.dir.parent().unwrap_or(Path::new("/"));
        let out = Command::new(&script)
            .arg(dest)
            .arg(&self.profile)
            .env("CARGO_TARGET_DIR", target)
            .output()
            .map_err(|e| failed(e.to_string()))?;
        if !out.status.success() {
            return Err(failed(String::from_utf8_lossy(&out.stderr).into_owned()));
        }
        Ok(())
    }
}

/// The arbiter's `[scheduler]` table for a mode (keys as the token design names them), or
/// none. Pure, so the configuration each mode runs under is table-tested.
pub fn scheduler_table(policy: Option<&str>, slice_ms: Option<u64>) -> String {
    let Some(policy) = policy else {
        return String::new();
    };
    let mut table = format!("\n[scheduler]\npolicy = \"{policy}\"\n");
    if let Some(ms) = slice_ms {
        // A fixed slice: the shortest one the arbiter may cut it to is the slice itself.
        table += &format!("slice_ms = {ms}\nmin_slice_ms = {ms}\n");
        // And the longest: the arbiter requires slice_ms <= max_slice_ms (default 200), which
        // a Gemini-like 250 ms quota exceeds. Round-robin never grows a slice, so there this
        // only satisfies the check; under the priority policy it keeps slices from growing
        // past the fixed one (200 ms, as faults.rs asks, is the default anyway).
        table += &format!("max_slice_ms = {ms}\n");
    }
    table
}

/// The whole configuration of a private arbiter over the simulated GPU.
pub fn arbiter_config(dir: &Path, libs: &Path, binaries: &Binaries, scheduler: &str) -> String {
    format!(
        "[arbiter]\n\
         nvml_library = \"{nvml}\"\n\
         run_dir = \"{run}\"\n\
         state_dir = \"{state}\"\n\
         client_timeout_ms = 5000\n\
         # Every job goes on the one simulated GPU, whatever its recent utilisation.\n\
         gpu_util_limit = 1.0\n\
         low_nums_limit = 8\n\n\
         [[arbiter.devices]]\n\
         uuid = \"{GPU_UUID}\"\n\
         name = \"simulated GPU 0\"\n\
         memory = \"{GPU_MEMORY}\"\n\n\
         [runtime]\n\
         runtimes = [\"runc\"]\n\
         library = \"{preload}\"\n\
         hook = \"{hook}\"\n\
         {scheduler}",
        nvml = libs.join("libnvidia-ml.so.1").display(),
        run = dir.join("run").display(),
        state = dir.join("state").display(),
        preload = binaries.preload.display(),
        hook = binaries.program("gpushare-hook").display(),
    )
}

/// A private arbiter; stopped (SIGTERM, then waited for) on drop.
pub struct Arbiter {
    child: Child,
    pub run_dir: PathBuf,
    log: PathBuf,
}

impl Arbiter {
    /// Starts the arbiter on `config` with the simulated GPU's environment, and waits for its
    /// control socket. A configuration it refuses is [`SetupError::ConfigRefused`].
    pub fn start(
        binaries: &Binaries,
        dir: &Path,
        config: &str,
        simgpu_env: &[(String, String)],
    ) -> Result<Arbiter, SetupError> {
        let config_path = dir.join("arbiter.toml");
        std::fs::write(&config_path, config).map_err(io("writing the arbiter's configuration"))?;
        let log_file =
            std::fs::File::create(dir.join("arbiter.log")).map_err(io("creating arbiter.log"))?;
        Arbiter::launch(binaries, dir, log_file, simgpu_env)
    }

    /// Starts a new arbiter on the configuration, run and state directories in `dir` that an
    /// earlier one (typically [`Arbiter::kill`]ed) left behind, as a supervisor would after a
    /// crash: it reloads the leases from its store and re-creates their sockets. Its log is
    /// appended to the earlier one's.
    pub fn restart(
        binaries: &Binaries,
        dir: &Path,
        simgpu_env: &[(String, String)],
    ) -> Result<Arbiter, SetupError> {
        let log_file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(dir.join("arbiter.log"))
            .map_err(io("opening arbiter.log"))?;
        Arbiter::launch(binaries, dir, log_file, simgpu_env)
    }

    fn launch(
        binaries: &Binaries,
        dir: &Path,
        log_file: std::fs::File,
        simgpu_env: &[(String, String)],
    ) -> Result<Arbiter, SetupError> {
        let config_path = dir.join("arbiter.toml");
        let child = Command::new(binaries.program("gpushare-arbiter"))
            .arg("--config")
            .arg(&config_path)
            .envs(simgpu_env.iter().map(|(k, v)| (k, v)))
            .stdout(log_file.try_clone().map_err(io("arbiter.log"))?)
            .stderr(log_file)
            .spawn()
            .map_err(io("starting gpushare-arbiter"))?;
        let mut arbiter = Arbiter {
            child,
            run_dir: dir.join("run"),
            log: dir.join("arbiter.log"),
        };
        let socket = arbiter.control_socket();
        let start = Instant::now();
        loop {
            if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
                return Ok(arbiter);
            }
            if let Ok(Some(_)) = arbiter.child.try_wait() {
                return Err(SetupError::ConfigRefused {
                    config: config_path,
                    log_tail: arbiter.log_tail(),
                });
            }
            if start.elapsed() > ARBITER_START_TIMEOUT {
                return Err(SetupError::ArbiterSilent {
                    socket,
                    log_tail: arbiter.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash would: the arbiter cleans nothing up, so its sockets and state stay
    /// for [`Arbiter::restart`]. Returns once it is reaped.
    pub fn kill(&mut self) -> Result<(), SetupError> {
        self.child.kill().map_err(io("killing gpushare-arbiter"))?;
        self.child.wait().map_err(io("reaping gpushare-arbiter"))?;
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn control_socket(&self) -> PathBuf {
        self.run_dir.join("control.sock")
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// Reserves a lease on the simulated GPU, as an entry point would for a container.
    pub fn reserve(
        &self,
        job: &str,
        priority: Priority,
        compute_request: f64,
        compute_limit: f64,
    ) -> Result<Lease, SetupError> {
        let fraction = |v: f64| Fraction::new(v).unwrap_or(Fraction::ONE);
        let reserve = || -> Result<Lease, gpushare_proto::ClientError> {
            let mut client = ControlClient::connect(&self.control_socket(), CONTROL_TIMEOUT)?;
            let lease = client.reserve(ReserveRequest {
                container_id: format!("bench-{job}"),
                namespace: None,
                sandbox_id: None,
                priority,
                memory: Some(MemoryRequest::Bytes(LEASE_MEMORY_BYTES)),
                compute_request: fraction(compute_request),
                compute_limit: fraction(compute_limit),
                gpu: GpuSelector::Count(1),
                tenant: None,
            })?;
            // The jobs are this process's children: confirming with its own pid puts
            // them inside "the container" (pid namespace and cgroup), as lease sockets
            // require of every peer.
            client.confirm(format!("bench-{job}"), std::process::id())?;
            Ok(lease)
        };
        reserve().map_err(|source| SetupError::Reserve {
            job: job.to_owned(),
            source,
        })
    }

    /// The socket a lease's interposer talks to (what the runtime mounts in a container).
    pub fn lease_socket(&self, lease: &Lease) -> PathBuf {
        self.run_dir
            .join("leases")
            .join(&lease.id.0)
            .join("arbiter.sock")
    }
}

impl Drop for Arbiter {
    fn drop(&mut self) {
        // A killed arbiter is reaped already: its pid may belong to another process now.
        if let Ok(None) = self.child.try_wait() {
            // SIGTERM, so the arbiter removes its sockets and state before the directory goes.
            // SAFETY: kill(2) on the pid of a child we started and have not reaped yet.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_tables_per_mode() {
        assert_eq!(scheduler_table(None, Some(10)), "");
        assert_eq!(
            scheduler_table(Some("off"), None),
            "\n[scheduler]\npolicy = \"off\"\n"
        );
        assert_eq!(
            scheduler_table(Some("round-robin"), Some(1)),
            "\n[scheduler]\npolicy = \"round-robin\"\nslice_ms = 1\nmin_slice_ms = 1\nmax_slice_ms = 1\n"
        );
        assert!(scheduler_table(Some("round-robin"), Some(250))
            .ends_with("slice_ms = 250\nmin_slice_ms = 250\nmax_slice_ms = 250\n"));
    }

    #[test]
    fn arbiter_config_names_the_simulated_nvml_and_the_scheduler() {
        let binaries = Binaries {
            dir: PathBuf::from("/b"),
            preload: PathBuf::from("/b/libgpushare.so"),
            profile: "release".into(),
        };
        let config = arbiter_config(
            Path::new("/w"),
            Path::new("/l"),
            &binaries,
            &scheduler_table(Some("priority"), None),
        );
        for expected in [
            "nvml_library = \"/l/libnvidia-ml.so.1\"",
            "run_dir = \"/w/run\"",
            "library = \"/b/libgpushare.so\"",
            "[scheduler]\npolicy = \"priority\"",
            GPU_UUID,
        ] {
            assert!(config.contains(expected), "{expected} missing in\n{config}");
        }
    }
}
