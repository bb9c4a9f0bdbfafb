//! containerd-shim-gpushare-v2 against a private containerd 1.6 (Debian's): the
//! shim decorates containerd's runc shim, so every test drives real containers
//! through `ctr` and checks the lease, the injected environment and the cleanup.

use std::time::Duration;

use gpushare_e2e::containerd::{
    processes_with, Containerd, ContainerdOptions, RUNC_RUNTIME, RUNTIME,
};
use gpushare_e2e::*;

fn setup() -> (tempfile::TempDir, Arbiter, Containerd) {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(dir.path(), ArbiterOptions::default());
    let containerd = Containerd::start(
        dir.path(),
        &arbiter.config_path,
        ContainerdOptions::default(),
    );
    (dir, arbiter, containerd)
}

/// Sockets under containerd's shim directory that belong to this daemon's shims
/// (they are hashes: compare before/after instead of by name).
fn shim_sockets() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/run/containerd/s")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn ctr_run_gets_a_lease_and_the_injected_environment() {
    let (_dir, arbiter, ctr) = setup();
    let sockets_before = shim_sockets();
    let args = ctr.run_args(
        RUNTIME,
        &["--rm", "--annotation", "gpushare.io/memory=1Gi"],
        "leased",
        &["/bin/sh", "-c", "/bin/env"],
    );
    // Watch the lease while the container runs: `--rm` deletes it at the end.
    let out = ctr.ok(&args);
    let env = env_map(&out);
    assert_eq!(
        env.get("NVIDIA_VISIBLE_DEVICES"),
        Some(&sim_uuid(0)),
        "{out}"
    );
    assert_eq!(
        env.get("GPUSHARE_QUOTA_MEMORY").map(String::as_str),
        Some("1073741824"),
        "{out}"
    );
    assert!(
        env.get("GPUSHARE_LEASE").is_some_and(|l| !l.is_empty()),
        "{out}"
    );
    assert!(
        env.get("LD_PRELOAD")
            .is_some_and(|p| p.contains("libgpushare.so")),
        "{out}"
    );
    wait_until("the lease to be released", Duration::from_secs(10), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(arbiter.lease_dirs(), 0, "lease directory removed");
    wait_until(
        "both shims' sockets to be removed",
        Duration::from_secs(10),
        || shim_sockets() == sockets_before,
    );
    let addr = ctr.address.to_string_lossy().into_owned();
    wait_until("both shims to exit", Duration::from_secs(10), || {
        processes_with(&addr)
            .iter()
            .all(|(_, c)| !c.contains("containerd-shim"))
    });
    let _ = RUNC_RUNTIME;
}
