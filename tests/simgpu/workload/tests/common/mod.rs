//! Shared test harness: builds and installs the simulated driver libraries, runs workloads
//! against a private simulated machine (its own SIMGPU_DIR), reads their JSON.
#![allow(dead_code)]

use nvml_wrapper::Nvml;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `target/<profile>` of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// A directory holding `libcuda.so.1` and `libnvidia-ml.so.1`, built from this workspace for
/// this test's profile and installed by `install.sh`, once per test binary.
pub fn libs_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile_dir = profile_dir();
        let profile = profile_dir
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let target_dir = profile_dir.parent().unwrap();
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build
            .args([
                "build",
                "-q",
                "-p",
                "simgpu-libcuda",
                "-p",
                "simgpu-libnvml",
                "--target-dir",
            ])
            .arg(target_dir);
        if profile == "release" {
            build.arg("--release");
        }
        let status = build
            .current_dir(manifest)
            .status()
            .expect("run cargo build");
        assert!(
            status.success(),
            "building the simulated driver libraries failed"
        );
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new(manifest.join("../install.sh"))
            .arg(dir.path())
            .arg(&profile)
            .env("CARGO_TARGET_DIR", target_dir)
            .status()
            .expect("run install.sh");
        assert!(status.success(), "install.sh failed");
        dir
    })
    .path()
}

/// A saturating job: iterations of five 2 ms kernels, two iterations queued, so the GPU never
/// waits for a late CPU unless a process is descheduled for a whole iteration.
pub const SATURATING_JOB: &[&str] = &[
    "--kernel",
    "fixed:2ms",
    "--kernels",
    "5",
    "--sync",
    "event",
    "--pipeline",
    "2",
];

/// A private simulated machine.
pub struct Sim {
    pub dir: tempfile::TempDir,
    pub vars: Vec<(String, String)>,
}

impl Sim {
    pub fn new(vars: &[(&str, &str)]) -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let mut all = vec![("SIMGPU_DIR".to_string(), dir.path().display().to_string())];
        all.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Sim { dir, vars: all }
    }

    pub fn workload(&self, args: &[&str]) -> Command {
        self.workload_under(&[], args)
    }

    /// [`Self::workload`] run by `wrapper` (a program and its arguments, e.g. `unshare …`),
    /// which runs the workload's command line as its own.
    pub fn workload_under(&self, wrapper: &[&str], args: &[&str]) -> Command {
        self.program_under(env!("CARGO_BIN_EXE_simgpu-workload"), wrapper, args)
    }

    /// `simgpu-pattern` (see its source): holds memory with known contents until told to read
    /// it back.
    pub fn pattern(&self, args: &[&str]) -> Command {
        self.program_under(env!("CARGO_BIN_EXE_simgpu-pattern"), &[], args)
    }

    fn program_under(&self, program: &str, wrapper: &[&str], args: &[&str]) -> Command {
        let mut cmd = match wrapper.split_first() {
            Some((wrapper_program, wrapper_args)) => {
                let mut cmd = Command::new(wrapper_program);
                cmd.args(wrapper_args).arg(program);
                cmd
            }
            None => Command::new(program),
        };
        cmd.args(args)
            .env("LD_LIBRARY_PATH", libs_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs a workload to completion and returns its report.
    pub fn run(&self, args: &[&str]) -> serde_json::Value {
        let out = self.workload(args).output().expect("spawn simgpu-workload");
        report(&out.stdout, &out.stderr)
    }

    /// The names of the memory images (`simgpu_model::contents`) in this machine's directory.
    pub fn memory_images(&self) -> Vec<String> {
        let dir = self.dir.path().join(simgpu_model::contents::MEMORY_DIR);
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The model itself, for checks against its own accounting.
    pub fn model(&self) -> simgpu_model::Device {
        let vars = self.vars.clone();
        let config = simgpu_model::SimConfig::from_lookup(|n| {
            vars.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone())
        })
        .unwrap();
        simgpu_model::Device::open(&config).unwrap()
    }

    /// NVML through nvml-wrapper, on this machine's libnvidia-ml.so.1. Each test binary uses one
    /// Sim at a time: the library reads SIMGPU_DIR when initialised.
    pub fn nvml(&self) -> Nvml {
        for (k, v) in &self.vars {
            // Safe in practice: std serialises set_var against Command::spawn and env::var, the
            // only readers in these tests and the NVML library.
            std::env::set_var(k, v);
        }
        Nvml::builder()
            .lib_path(libs_dir().join("libnvidia-ml.so.1").as_os_str())
            .init()
            .expect("nvml init")
    }
}

pub fn report(stdout: &[u8], stderr: &[u8]) -> serde_json::Value {
    serde_json::from_slice(stdout).unwrap_or_else(|e| {
        panic!(
            "workload output is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(stdout),
            String::from_utf8_lossy(stderr)
        )
    })
}

pub fn wait_for_child(child: Child) -> serde_json::Value {
    let out = child.wait_with_output().expect("wait for workload");
    report(&out.stdout, &out.stderr)
}

/// Polls `check` until it holds or `timeout` passes.
pub fn eventually(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

pub fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// The installed `libcuda.so.1`, opened in this test process with `dlopen`, as an interposer or
/// the CUDA runtime reaches it. The handle is kept as an integer so that threads can share it.
pub struct Lib(usize);

impl Lib {
    /// Opens the library after pointing this process at `sim` (the driver reads `SIMGPU_*` at
    /// `cuInit`, once per process).
    pub fn open(sim: &Sim) -> Lib {
        for (k, v) in &sim.vars {
            // Set before any thread of this test binary reads the environment through libc.
            std::env::set_var(k, v);
        }
        let path =
            std::ffi::CString::new(libs_dir().join("libcuda.so.1").to_str().unwrap()).unwrap();
        // SAFETY: dlopen of our own library; never closed.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen libcuda.so.1");
        Lib(handle as usize)
    }

    /// The exported function `name`, typed by the caller.
    pub fn f<T: Copy>(&self, name: &str) -> T {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: dlsym on a live handle; the caller names the C signature of that export.
        let p = unsafe { libc::dlsym(self.0 as *mut libc::c_void, c.as_ptr()) };
        assert!(!p.is_null(), "{name} not exported");
        assert_eq!(
            std::mem::size_of::<T>(),
            std::mem::size_of::<*mut libc::c_void>()
        );
        // SAFETY: T is a function pointer type of the export's signature (size checked above).
        unsafe { std::mem::transmute_copy(&p) }
    }
}

/// Driver entry-point signatures by arity, for [`Lib::f`].
pub type P0 = unsafe extern "C" fn() -> libc::c_int;
pub type P1<A> = unsafe extern "C" fn(A) -> libc::c_int;
pub type P2<A, B> = unsafe extern "C" fn(A, B) -> libc::c_int;
pub type P3<A, B, C> = unsafe extern "C" fn(A, B, C) -> libc::c_int;
pub type P4<A, B, C, D> = unsafe extern "C" fn(A, B, C, D) -> libc::c_int;
pub type P5<A, B, C, D, E> = unsafe extern "C" fn(A, B, C, D, E) -> libc::c_int;
pub type P6<A, B, C, D, E, F> = unsafe extern "C" fn(A, B, C, D, E, F) -> libc::c_int;
/// `cuLaunchKernel`.
pub type Launch = unsafe extern "C" fn(
    usize,
    libc::c_uint,
    libc::c_uint,
    libc::c_uint,
    libc::c_uint,
    libc::c_uint,
    libc::c_uint,
    libc::c_uint,
    usize,
    *mut *mut libc::c_void,
    *mut *mut libc::c_void,
) -> libc::c_int;
