//! Harness for end-to-end tests against real runtimes.
//!
//! Every test starts its own daemons in a private temporary directory (root,
//! state, sockets), builds its busybox root filesystem from the host's
//! busybox-static, and never touches a system instance. The tests need root and
//! the Debian packages `make test` installs; they fail, never skip, without them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub use gpushare_testkit::results::write_results;
pub use gpushare_testkit::rootfs::{busybox_rootfs, BUSYBOX};
pub use gpushare_testkit::simgpu::{self, gpu_uuid as sim_uuid, SimMachine};
pub use gpushare_testkit::stats::median;
pub use gpushare_testkit::{wait_until, Config};

pub mod containerd;
pub mod cri;
pub mod engines;
pub const DOCKER: &str = "/usr/bin/docker";
pub const DOCKERD: &str = "/usr/sbin/dockerd";

pub fn require_root() {
    assert!(
        nix_is_root(),
        "the e2e tests drive real runc/containerd/dockerd and need root: run `make test` as root"
    );
}

fn nix_is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// Where `cargo build` put the gpushare binaries (`GPUSHARE_BIN_DIR`, else this
/// profile's); fails the test unless every one the suite runs is there.
pub fn bin_dir() -> PathBuf {
    gpushare_testkit::binaries::require(&[
        "gpushare-arbiter",
        "gpusharectl",
        "gpushare-runc",
        "gpushare-hook",
        "libgpushare.so",
        "containerd-shim-gpushare-v2",
    ]);
    gpushare_testkit::binaries::bin_dir()
}

pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// A short private directory: unix socket paths must stay under 108 bytes.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("gs-")
        .tempdir_in("/tmp")
        .expect("temporary directory")
}

/// A change to a configuration, applied once.
pub type ConfigEdit = Box<dyn FnOnce(&mut Config)>;

pub struct ArbiterOptions {
    pub gpus: u32,
    pub memory: &'static str,
    /// Some(CUDA version as NVML encodes it, e.g. "12020"): the arbiter takes its
    /// inventory through the simulated GPU's NVML instead of declared devices.
    pub simulated_driver: Option<&'static str>,
    /// Changes to the configuration the arbiter and the runtimes read (the
    /// `[kubernetes]` table of the device plugin tests, shorter waits).
    pub configure: Option<ConfigEdit>,
}

impl ArbiterOptions {
    /// Two GPUs, placing with `policy` (the `[placement]` table's).
    pub fn placing(policy: gpushare_testkit::config::PlacementPolicy) -> Self {
        ArbiterOptions {
            configure: Some(Box::new(move |config: &mut Config| {
                config.placement.policy = policy;
            })),
            ..Default::default()
        }
    }
}

impl Default for ArbiterOptions {
    fn default() -> Self {
        ArbiterOptions {
            gpus: 2,
            memory: "16Gi",
            simulated_driver: None,
            configure: None,
        }
    }
}

/// The test kit's private arbiter, with what the end-to-end tests read of it.
pub struct Arbiter {
    arbiter: gpushare_testkit::Arbiter,
    /// Its configuration file, which the runtimes under test read too.
    pub config_path: PathBuf,
    pub run_dir: PathBuf,
}

impl std::ops::Deref for Arbiter {
    type Target = gpushare_testkit::Arbiter;
    fn deref(&self) -> &gpushare_testkit::Arbiter {
        &self.arbiter
    }
}

/// For what changes it: `kill`, `restart`.
impl std::ops::DerefMut for Arbiter {
    fn deref_mut(&mut self) -> &mut gpushare_testkit::Arbiter {
        &mut self.arbiter
    }
}

impl Arbiter {
    /// A private arbiter in `dir`, with declared GPUs or the simulated driver's; its
    /// configuration names this build's interposer and hook for the runtimes.
    pub fn start(dir: &Path, options: ArbiterOptions) -> Arbiter {
        bin_dir();
        let builder = gpushare_testkit::Arbiter::builder_in(dir);
        let builder = match options.simulated_driver {
            Some(cuda) => {
                // Nothing reserved by the simulated driver: these suites count quotas and
                // Kubernetes units of the whole `memory` (the reserve is
                // preload/tests/allocatable_memory.rs's subject).
                let machine = SimMachine::new(dir.join("simgpu"), options.gpus, options.memory)
                    .set("SIMGPU_CUDA_VERSION", cuda)
                    .set("SIMGPU_RESERVED_MEMORY", 0);
                builder.simulated(&machine)
            }
            None => builder.declared_gpus(options.gpus, options.memory),
        };
        let builder = match options.configure {
            Some(edit) => builder.configure(edit),
            None => builder,
        };
        let arbiter = builder.start();
        Arbiter {
            config_path: arbiter.config_path().to_owned(),
            run_dir: arbiter.run_dir().to_owned(),
            arbiter,
        }
    }

    /// `gpusharectl status --json`.
    pub fn status(&self) -> Value {
        self.status_json()
    }

    pub fn leases(&self) -> Vec<Value> {
        self.status()["leases"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The container name status shows for `lease` (its id), once it is no longer
    /// the 12-character short id or after 10 s: engine names are learned off the
    /// lock, just after confirmation.
    pub fn shown_name(&self, lease: &Value) -> String {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let status = self.status();
            let name = status["usage"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|u| &u["lease"] == lease)
                .map(|u| u["container"].as_str().unwrap_or_default().to_owned())
                .unwrap_or_default();
            if name.len() != 12 || std::time::Instant::now() > deadline {
                return name;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// How many lease directories are left under its run directory.
    pub fn lease_dirs(&self) -> usize {
        self.arbiter.lease_dirs().len()
    }

    /// Its configuration changed by `edit`, written to `name` in its directory for a
    /// runtime to read.
    pub fn config_variant(&self, name: &str, edit: impl FnOnce(&mut Config)) -> PathBuf {
        let mut config = self.config().clone();
        edit(&mut config);
        let path = self.dir().join(name);
        std::fs::write(&path, config.to_toml().unwrap()).unwrap();
        path
    }
}

/// The runtime profile of the private dockerd's second gpushare runtime,
/// `gpushare-high`, as `gpusharectl setup docker --profile high` writes it.
pub const HIGH_PROFILE: &str = "high";

/// Defines `[runtime.profiles.high]`: high priority, and `memory` as its default
/// and the most its containers' environment may ask.
pub fn define_high_profile(config: &mut Config, memory: &str) {
    let profile = serde_json::json!({ "priority": "high", "memory": memory });
    config.runtime.profiles.insert(
        HIGH_PROFILE.into(),
        serde_json::from_value(profile).expect("a runtime profile"),
    );
}

/// A private dockerd (Debian's docker.io 20.10) with gpushare-runc as a path runtime,
/// `gpushare`, and again as `gpushare-high`, naming the runtime profile `high`.
pub struct Dockerd {
    child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub exec_root: PathBuf,
}

pub const IMAGE: &str = "busybox:e2e";

impl Dockerd {
    pub fn start(dir: &Path, gpushare_config: &Path) -> Dockerd {
        let daemon_json = serde_json::json!({
            "runtimes": {
                "gpushare": { "path": bin("gpushare-runc") },
                "gpushare-high": {
                    "path": bin("gpushare-runc"),
                    "runtimeArgs": [format!("--gpushare-profile={HIGH_PROFILE}")],
                },
            },
        });
        std::fs::write(dir.join("daemon.json"), daemon_json.to_string()).unwrap();
        Dockerd::start_on(dir, &dir.join("daemon.json"), gpushare_config)
    }

    /// dockerd on a `daemon.json` the caller wrote (an operator's file, as
    /// `gpusharectl setup docker` left it), in the private directory `dir`.
    pub fn start_on(dir: &Path, daemon_json: &Path, gpushare_config: &Path) -> Dockerd {
        let socket = dir.join("docker.sock");
        let exec_root = dir.join("exec");
        let log = std::fs::File::create(dir.join("dockerd.log")).unwrap();
        let child = Command::new(DOCKERD)
            .arg("--config-file")
            .arg(daemon_json)
            .arg("--data-root")
            .arg(dir.join("docker-root"))
            .arg("--exec-root")
            .arg(&exec_root)
            .arg("--pidfile")
            .arg(dir.join("docker.pid"))
            .arg("-H")
            .arg(format!("unix://{}", socket.display()))
            .args([
                "--iptables=false",
                "--ip-masq=false",
                "--bridge=none",
                "--storage-driver=vfs",
            ])
            // The wrapper reads its configuration from the engine's environment,
            // which dockerd passes through containerd and the shim to the runtime.
            .env("GPUSHARE_CONFIG", gpushare_config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start dockerd (docker.io installed?)");
        let d = Dockerd {
            child,
            dir: dir.to_owned(),
            socket,
            exec_root,
        };
        wait_until("dockerd to answer", Duration::from_secs(60), || {
            d.docker(&["version"]).status.success()
        });
        import_busybox_image(
            &dir.join("image-rootfs"),
            d.command(&["import", "-", IMAGE]),
            "docker import",
        );
        d
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(DOCKER);
        c.arg("-H")
            .arg(format!("unix://{}", self.socket.display()))
            .args(args);
        c
    }

    pub fn docker(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run docker")
    }

    /// Runs docker and returns stdout, failing the test with stderr if it fails.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.docker(args);
        assert!(
            out.status.success(),
            "docker {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().rev().take(15).collect();
        format!(
            "\n--- dockerd.log (last lines) ---\n{}",
            lines.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// The OCI bundle of a running container, as the runtime received it.
    pub fn bundle_config(&self, container_id: &str) -> Value {
        let path = self
            .exec_root
            .join("containerd/daemon/io.containerd.runtime.v2.task/moby")
            .join(container_id)
            .join("config.json");
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let _ = self
            .command(&["rm", "-f", "-v"])
            .args(String::from_utf8_lossy(&self.docker(&["ps", "-aq"]).stdout).split_whitespace())
            .output();
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Anything dockerd left mounted under the private directory must go before it is deleted.
        unmount_under(&self.dir);
    }
}

/// Runs a runc-compatible `program` (gpushare-runc from this build or from an
/// installed package) with `--root state`, reading its configuration from `config`.
/// stdout and stderr go to files, not pipes: a created container inherits its
/// creator's stdio, so pipes would stay open for the container's whole life.
pub fn run_runtime(program: &Path, config: &Path, state: &Path, args: &[&str]) -> Output {
    let out = tempfile::tempfile().unwrap();
    let err = tempfile::tempfile().unwrap();
    let status = Command::new(program)
        .env("GPUSHARE_CONFIG", config)
        .arg("--root")
        .arg(state)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(err.try_clone().unwrap())
        .status()
        .unwrap();
    let read = |mut f: std::fs::File| {
        use std::io::{Read, Seek};
        let mut v = Vec::new();
        f.rewind().unwrap();
        f.read_to_end(&mut v).unwrap();
        v
    };
    Output {
        status,
        stdout: read(out),
        stderr: read(err),
    }
}

/// Builds a busybox root filesystem at `rootfs` and streams it as a tar into
/// `import` (`docker import - IMAGE`, `podman import - IMAGE`): no registry here.
pub fn import_busybox_image(rootfs: &Path, mut import: Command, what: &str) {
    busybox_rootfs(rootfs);
    let mut tar = Command::new("tar")
        .arg("-C")
        .arg(rootfs)
        .args(["-c", "."])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = import.stdin(tar.stdout.take().unwrap()).output().unwrap();
    assert!(
        tar.wait().unwrap().success(),
        "tar of the busybox rootfs failed"
    );
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Lazily unmounts everything a daemon left mounted below `dir`, deepest first,
/// so the temporary directory can be deleted.
pub fn unmount_under(dir: &Path) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "grep -o ' {}/[^ ]*' /proc/self/mounts | sort -r | xargs -r -n1 umount -l",
            dir.display()
        ))
        .status();
}

/// `runc spec` in `bundle` (which must exist), read back with a terminal-less
/// process, for tests that drive runc or gpushare-runc without an engine.
pub fn runc_default_spec(bundle: &Path) -> Value {
    let out = Command::new("runc")
        .arg("spec")
        .current_dir(bundle)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "runc spec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut spec: Value =
        serde_json::from_slice(&std::fs::read(bundle.join("config.json")).unwrap()).unwrap();
    spec["process"]["terminal"] = serde_json::json!(false);
    spec
}

/// `KEY=value` lines into (key, value) pairs.
pub fn env_map(output: &str) -> std::collections::BTreeMap<String, String> {
    output
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// A private podman (Debian's 4.3): its own storage, run and tmp directories, a
/// hooks.d holding gpushare's precreate hook, runc as the runtime.
pub struct Podman {
    pub dir: PathBuf,
    hooks_dir: PathBuf,
    conf: PathBuf,
    runtime: PathBuf,
    gpushare_config: PathBuf,
}

pub const PODMAN: &str = "/usr/bin/podman";
pub const PODMAN_IMAGE: &str = "localhost/busybox:e2e";

impl Podman {
    /// podman with runc as its runtime and gpushare's precreate hook.
    pub fn start(dir: &Path, gpushare_config: &Path) -> Podman {
        Self::with_runtime(dir, gpushare_config, Path::new("runc"))
    }

    /// podman with another runtime (e.g. gpushare-runc), the precreate hook still installed.
    pub fn with_runtime(dir: &Path, gpushare_config: &Path, runtime: &Path) -> Podman {
        let dir = dir.join("podman");
        let hooks_dir = dir.join("hooks.d");
        std::fs::create_dir_all(&hooks_dir).unwrap();
        // What config/hooks.d/gpushare.json installs, with this test's paths.
        let hook = serde_json::json!({
            "version": "1.0.0",
            "hook": {
                "path": bin("gpushare-hook"),
                "args": ["gpushare-hook", "--config", gpushare_config, "precreate"],
                "timeout": 10
            },
            "when": { "annotations": { "^gpushare\\.io/": ".*" } },
            "stages": ["precreate"]
        });
        std::fs::write(hooks_dir.join("gpushare.json"), hook.to_string()).unwrap();
        // This sandbox refuses to raise rlimits above the caller's hard limits,
        // and podman's defaults (nofile, nproc) are higher.
        let conf = dir.join("containers.conf");
        std::fs::write(
            &conf,
            "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\
             [engine]\nevents_logger = \"file\"\ncgroup_manager = \"cgroupfs\"\n",
        )
        .unwrap();
        let podman = Podman {
            dir: dir.clone(),
            hooks_dir,
            conf,
            runtime: runtime.to_owned(),
            gpushare_config: gpushare_config.to_owned(),
        };
        import_busybox_image(
            &dir.join("image-rootfs"),
            podman.command(&["import", "-", PODMAN_IMAGE]),
            "podman import",
        );
        podman
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(PODMAN);
        c.env("CONTAINERS_CONF", &self.conf)
            .arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .arg("--hooks-dir")
            .arg(&self.hooks_dir)
            .args(["--storage-driver", "vfs", "--runtime"])
            .arg(&self.runtime);
        if self.runtime != Path::new("runc") {
            // podman (through conmon) does not pass its environment on to the
            // runtime: gpushare-runc takes its configuration as a runtime flag.
            c.arg("--runtime-flag").arg(format!(
                "gpushare-config={}",
                self.gpushare_config.display()
            ));
        }
        c.args(args);
        c
    }

    pub fn podman(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run podman")
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.podman(args);
        assert!(
            out.status.success(),
            "podman {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.command(&["rm", "-a", "-f", "-t", "0"]).output();
        unmount_under(&self.dir);
    }
}
