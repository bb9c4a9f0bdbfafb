//! A private containerd (Debian's 1.6, or the 2.3.4 build: `engines`) for the shim's
//! end-to-end tests: its own
//! root, state and sockets in a scratch directory, the gpushare binaries first on
//! its PATH (that is how it finds `containerd-shim-gpushare-v2`), and the test
//! arbiter's configuration in its environment (shims inherit it). Containers run
//! from a busybox directory with `ctr run --rootfs`: no image, no snapshotter.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::engines::containerd_build;
use crate::{bin_dir, busybox_rootfs, unmount_under, wait_until};

/// The ctr of the containerd build under test.
pub fn ctr_binary() -> &'static Path {
    &containerd_build().ctr
}
pub const RUNTIME: &str = "io.containerd.gpushare.v2";
pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
pub const NAMESPACE: &str = "gpushare-e2e";

pub struct Containerd {
    child: Child,
    pub dir: PathBuf,
    /// containerd's gRPC socket (what `ctr --address` takes).
    pub address: PathBuf,
    pub rootfs: PathBuf,
}

#[derive(Default)]
pub struct ContainerdOptions<'a> {
    /// Extra configuration (TOML) appended to the generated file, e.g. a CRI runtime.
    pub extra_config: &'a str,
    /// Keep the CRI plugin (it is disabled otherwise: it wants CNI and an image service).
    pub cri: bool,
}

impl Containerd {
    pub fn start(dir: &Path, gpushare_config: &Path, options: ContainerdOptions) -> Containerd {
        let address = dir.join("c.sock");
        let disabled = if options.cri {
            ""
        } else {
            "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"
        };
        let config = format!(
            "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n{disabled}\n\
             [grpc]\n  address = \"{address}\"\n\n\
             [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{opt}\"\n{extra}",
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            address = address.display(),
            opt = dir.join("opt").display(),
            extra = options.extra_config,
        );
        std::fs::write(dir.join("containerd.toml"), config).unwrap();
        let build = containerd_build();
        let own_shims = build
            .shim_dir
            .as_ref()
            .map(|d| format!("{}:", d.display()))
            .unwrap_or_default();
        let path = format!(
            "{}:{own_shims}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            bin_dir().display()
        );
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new(&build.containerd)
            .arg("--config")
            .arg(dir.join("containerd.toml"))
            .args(["--log-level", "debug"])
            .env("PATH", path)
            .env("GPUSHARE_CONFIG", gpushare_config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {} ({e}): containerd installed?",
                    build.containerd.display()
                )
            });
        let rootfs = dir.join("rootfs");
        busybox_rootfs(&rootfs);
        let c = Containerd {
            child,
            dir: dir.to_owned(),
            address,
            rootfs,
        };
        wait_until("containerd to answer", Duration::from_secs(30), || {
            c.ctr(&["version"]).status.success()
        });
        c
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(ctr_binary());
        c.arg("--address")
            .arg(&self.address)
            .args(["--namespace", NAMESPACE])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    pub fn ctr(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run ctr")
    }

    /// Runs ctr and returns stdout, failing the test with stderr and the log if it fails.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ctr run --rootfs <busybox> --runtime <runtime> [extra…] <id> <command…>`
    pub fn run_args<'a>(
        &'a self,
        runtime: &'a str,
        extra: &[&'a str],
        id: &'a str,
        command: &[&'a str],
    ) -> Vec<&'a str> {
        let mut args = vec!["run", "--rootfs", "--runtime", runtime];
        args.extend_from_slice(extra);
        args.push(self.rootfs.to_str().unwrap());
        args.push(id);
        args.extend_from_slice(command);
        args
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().rev().take(25).collect();
        format!(
            "\n--- containerd.log (last lines) ---\n{}",
            lines.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    /// A container's bundle directory (config.json, address, the runc shim's directory).
    pub fn bundle(&self, id: &str) -> PathBuf {
        self.dir
            .join("state/io.containerd.runtime.v2.task")
            .join(NAMESPACE)
            .join(id)
    }

    pub fn bundle_config(&self, id: &str) -> serde_json::Value {
        let path = self.bundle(id).join("config.json");
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }

    /// Task ids `ctr task ls` lists.
    pub fn tasks(&self) -> Vec<String> {
        self.ok(&["task", "ls", "-q"])
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Container ids `ctr container ls` lists.
    pub fn containers(&self) -> Vec<String> {
        self.ok(&["container", "ls", "-q"])
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

/// Processes whose command line contains `needle` (the shims of a test:
/// their arguments name the test's private containerd socket).
pub fn processes_with(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for id in self.tasks_quiet() {
            let _ = self
                .command(&["task", "kill", "-s", "SIGKILL", &id])
                .output();
            let _ = self.command(&["task", "delete", "-f", &id]).output();
        }
        for id in self.containers_quiet() {
            let _ = self.command(&["container", "rm", &id]).output();
        }
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
        // Shims of this daemon that outlived it (a failed test): their command
        // lines name its socket.
        for (pid, _) in processes_with(&self.address.to_string_lossy()) {
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .status();
        }
        unmount_under(&self.dir);
    }
}

impl Containerd {
    fn tasks_quiet(&self) -> Vec<String> {
        let out = self.ctr(&["task", "ls", "-q"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
    fn containers_quiet(&self) -> Vec<String> {
        let out = self.ctr(&["container", "ls", "-q"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Containerd {
    /// `ctr` in another containerd namespace than the tests' own (which `command`
    /// uses), returning stdout and failing the test if ctr fails.
    pub fn ok_in(&self, namespace: &str, args: &[&str]) -> String {
        let out = Command::new(ctr_binary())
            .arg("--address")
            .arg(&self.address)
            .args(["--namespace", namespace])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run ctr");
        assert!(
            out.status.success(),
            "ctr -n {namespace} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_tail()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}
