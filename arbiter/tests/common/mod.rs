//! The arbiter suite's own helpers: its private arbiter (gpushare-testkit's, on this
//! crate's binary), stand-in containers and requests.
// Each test file uses some of these.
#![allow(dead_code, unused_imports)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_proto::token_client::TokenConnection;
use gpushare_proto::{ControlClient, Fraction, GpuSelector, Lease, Priority, ReserveRequest};
pub use gpushare_testkit::simgpu::{self, gpu_uuid as sim_uuid, wait_for_workloads, SimMachine};
pub use gpushare_testkit::{
    binaries, free_port, reserve_request, wait_until, Arbiter, ArbiterBuilder,
};

pub const ARBITER: &str = env!("CARGO_BIN_EXE_gpushare-arbiter");
/// `gpusharectl`, built from its own crate (which this one does not depend on).
pub fn ctl() -> std::path::PathBuf {
    binaries::gpusharectl()
}

/// A private arbiter of this build with `gpus` declared GPUs of `memory` each, and the
/// production client timeout (10 s) the suite's timings were chosen against.
pub fn daemon(gpus: u32, memory: &str) -> ArbiterBuilder {
    Arbiter::builder()
        .program(ARBITER)
        .declared_gpus(gpus, memory)
        .configure(|c| c.arbiter.client_timeout_ms = 10_000)
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
        pod: None,
    }
}

/// A lease of 1 GiB for `container`, confirmed with this test process as its init.
pub fn reserve_here(d: &Arbiter, container: &str, priority: Priority) -> Lease {
    let mut c = d.client();
    let lease = c.reserve(request(container, "1Gi", priority)).unwrap();
    confirm_here(&mut c, container);
    lease
}

/// A token connection on `lease`'s socket.
pub fn open_token(d: &Arbiter, lease: &Lease) -> TokenConnection {
    TokenConnection::open(&d.lease_socket(&lease.id.0), Duration::from_secs(10)).unwrap()
}

/// A token client of `lease` that really runs: simgpu-workload under the interposer,
/// back to back kernels of 2 ms for `duration` ("2s") on the simulated GPU whose state
/// is in `simgpu_dir`. Wait for it with [`wait_for_workloads`].
pub fn token_workload(
    d: &Arbiter,
    lease: &str,
    simgpu_dir: &std::path::Path,
    duration: &str,
) -> Child {
    Command::new(binaries::program("simgpu-workload"))
        .args(["--kernels", "4", "--kernel", "fixed:2ms", "--duration", duration])
        .env("LD_PRELOAD", binaries::preload_library())
        .env("LD_LIBRARY_PATH", simgpu::libs())
        .env("SIMGPU_DIR", simgpu_dir)
        .env("GPUSHARE_LEASE", lease)
        .env("GPUSHARE_SOCKET", d.lease_socket(lease))
        // Stdio null: a leaked one must not hold a caller's pipe open.
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Stand-in containers' init processes ([`container_process`]), killed however the
/// test ends.
pub struct Inits(pub Vec<Child>);

impl Drop for Inits {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A stand-in container: a real process whose pid confirms a lease.
/// Its output goes nowhere: a process left behind by a failing test must not
/// hold the test runner's output pipe open (CI reads it through `tee`).
pub fn container_process() -> Child {
    gpushare_testkit::stand_in_init()
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

/// This test process's descriptor limit raised to at least `want`.
pub fn raise_descriptor_limit(want: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < want {
        // Root may raise the hard limit too (up to fs.nr_open).
        setrlimit(Resource::RLIMIT_NOFILE, want, hard.max(want)).unwrap();
    }
}

/// This test binary running only the ignored helper `test`, through `prefix`
/// (such as nsenter) when there is one.
pub fn helper_command(prefix: &[String], test: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    command.args(["--ignored", "--exact", test, "--nocapture"]);
    command
}
