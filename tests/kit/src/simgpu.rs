//! The simulated GPU (tests/simgpu): its driver libraries, installed once per process, and
//! the environment that puts a program on a simulated machine.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::binaries;

/// The UUID of simulated GPU `index`, as the simulated driver reports it (and as declared
/// devices name the GPUs of an arbiter without NVML).
pub use simgpu_model::gpu_uuid;

/// tests/simgpu/install.sh, which installs the libraries under their sonames.
fn install_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../simgpu/install.sh")
}

/// Installs `libcuda.so.1` and `libnvidia-ml.so.1` of [`binaries::bin_dir`]'s build into `dest`.
pub fn install(dest: &Path) -> Result<(), String> {
    let bin_dir = binaries::bin_dir();
    // install.sh looks in $CARGO_TARGET_DIR/<profile>: the directory above the binaries.
    let target = bin_dir.parent().unwrap_or(Path::new("/"));
    let out = Command::new(install_script())
        .arg(dest)
        .arg(binaries::profile())
        .env("CARGO_TARGET_DIR", target)
        .output()
        .map_err(|e| format!("running {}: {e}", install_script().display()))?;
    if !out.status.success() {
        return Err(format!(
            "tests/simgpu/install.sh {} {} failed (build simgpu-libcuda and simgpu-libnvml first): {}",
            dest.display(),
            binaries::profile(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

static LIBS: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Removes the installed libraries when the process exits: they live in a static, which
/// Rust never drops.
extern "C" fn remove_installed_libs() {
    if let Some(Ok(dir)) = LIBS.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The directory holding the simulated `libcuda.so.1` and `libnvidia-ml.so.1` (what
/// `LD_LIBRARY_PATH` names), installed on first use and shared by the whole process.
pub fn try_libs() -> Result<&'static Path, String> {
    LIBS.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("gs-simgpu-")
            .tempdir_in("/tmp")
            .map_err(|e| format!("a directory for the simulated driver: {e}"))?
            .keep();
        // SAFETY: registers a plain function with no arguments, run once at exit.
        unsafe { libc::atexit(remove_installed_libs) };
        install(&dir)?;
        Ok(dir)
    })
    .as_ref()
    .map(PathBuf::as_path)
    .map_err(Clone::clone)
}

/// [`try_libs`], failing the test when the libraries cannot be installed.
pub fn libs() -> &'static Path {
    try_libs().unwrap_or_else(|e| panic!("{e}"))
}

/// The simulated NVML, for an arbiter's `nvml_library`.
pub fn nvml_library() -> PathBuf {
    libs().join("libnvidia-ml.so.1")
}

/// One simulated machine: every process given its environment (the arbiter's NVML, the
/// workloads, the probes) sees the same GPUs through the state under `state_dir`.
#[derive(Debug, Clone)]
pub struct SimMachine {
    pub state_dir: PathBuf,
    env: Vec<(String, String)>,
}

impl SimMachine {
    /// `gpus` simulated GPUs of `memory` each (`16Gi`), their state under `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>, gpus: u32, memory: &str) -> SimMachine {
        let state_dir = state_dir.into();
        SimMachine {
            env: vec![
                ("SIMGPU_DIR".into(), state_dir.display().to_string()),
                ("SIMGPU_GPUS".into(), gpus.to_string()),
                ("SIMGPU_MEMORY".into(), memory.into()),
            ],
            state_dir,
        }
    }

    /// Another `SIMGPU_*` setting (e.g. `SIMGPU_CUDA_VERSION`, `SIMGPU_CONTEXT_MEMORY`);
    /// a second call for the same key replaces the first.
    pub fn set(mut self, key: &str, value: impl ToString) -> SimMachine {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.into(), value.to_string()));
        self
    }

    /// The `SIMGPU_*` variables.
    pub fn env(&self) -> &[(String, String)] {
        &self.env
    }

    /// Puts `cmd` on this machine: the `SIMGPU_*` variables and the simulated driver
    /// first on `LD_LIBRARY_PATH`.
    pub fn apply<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("LD_LIBRARY_PATH", libs())
    }
}

/// Waits for each simgpu-workload job, started with its stderr piped; fails the test,
/// with the job's errors, when one failed.
pub fn wait_for_workloads(jobs: Vec<std::process::Child>) {
    for job in jobs {
        let out = job.wait_with_output().expect("waiting for simgpu-workload");
        assert!(
            out.status.success(),
            "workload failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
