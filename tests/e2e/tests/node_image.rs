//! The Kubernetes node image (`make image`, scripts/build-image.sh) against real engines:
//! the archive imports into a private containerd and loads into a private dockerd; its
//! node-setup.sh, run in a container from the image as the DaemonSet's init container
//! runs it, installs the runtime side into a scratch "host" root and configures that
//! root's containerd file keeping its other content, and its undo (the arbiter's preStop)
//! gives the tree back byte for byte; the image's arbiter runs on the simulated GPU.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gpushare_e2e::containerd::{Containerd, ContainerdOptions};
use gpushare_e2e::*;

use gpushare_testkit::binaries::SHIPPED_PROGRAMS as PROGRAMS;
/// Where node-setup.sh installs on the host: the image's own layout.
const PREFIX: &str = "opt/gpushare";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The reference the archive carries, as containerd names it.
fn image() -> String {
    format!("docker.io/gpushare/node:{}", env!("CARGO_PKG_VERSION"))
}

/// scripts/build-image.sh from this build's programs and interposer.
fn build_image(archive: &Path) {
    gpushare_testkit::binaries::require(&PROGRAMS);
    let out = Command::new(repo().join("scripts/build-image.sh"))
        .arg(archive)
        .env("BIN_DIR", bin_dir())
        .env("PRELOAD_LIB", gpushare_testkit::binaries::preload_library())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/build-image.sh: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every entry under `root`: a directory's mode, a file's mode and bytes.
fn tree(root: &Path) -> BTreeMap<PathBuf, (u32, Option<Vec<u8>>)> {
    let mut entries = BTreeMap::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let relative = path.strip_prefix(root).unwrap().to_owned();
            let mode = meta.permissions().mode();
            if meta.is_dir() {
                pending.push(path);
                entries.insert(relative, (mode, None));
            } else {
                entries.insert(relative, (mode, Some(std::fs::read(&path).unwrap())));
            }
        }
    }
    entries
}

fn bind(src: &Path, dst: &str, mode: &str) -> String {
    format!(
        "type=bind,src={},dst={dst},options=rbind:{mode}",
        src.display()
    )
}

/// node-setup.sh ACTION in a fresh container from the image, `host` as the node's root;
/// each containerd restart it asks for is a line in `restarts`.
fn node_setup(containerd: &Containerd, action: &str, host: &Path, config: &Path, restarts: &Path) {
    let id = format!("node-setup-{action}");
    containerd.ok(&[
        "run",
        "--rm",
        "--mount",
        &bind(host, "/host", "rw"),
        "--mount",
        &bind(config.parent().unwrap(), "/config", "ro"),
        "--mount",
        &bind(restarts.parent().unwrap(), "/restarts", "rw"),
        "--env",
        "HOST_ROOT=/host",
        "--env",
        "CONTAINERD_CONFIG=/etc/containerd/config.toml",
        "--env",
        "RESTART_CONTAINERD=echo restart >>/restarts/log",
        &image(),
        &id,
        "/opt/gpushare/node-setup.sh",
        action,
    ]);
}

fn restart_count(restarts: &Path) -> usize {
    std::fs::read_to_string(restarts)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn the_image_installs_onto_a_node_tree_undoes_byte_for_byte_and_runs_the_arbiter() {
    require_root();
    let dir = scratch();
    let archive = dir.path().join("gpushare-node.oci.tar");
    build_image(&archive);

    // The daemon's own gpushare configuration is not used: containers here run runc.
    let unused = dir.path().join("unused-config.toml");
    std::fs::write(&unused, "").unwrap();
    let containerd_dir = dir.path().join("containerd");
    std::fs::create_dir(&containerd_dir).unwrap();
    let containerd = Containerd::start(&containerd_dir, &unused, ContainerdOptions::default());
    let imported = containerd.ok(&["images", "import", archive.to_str().unwrap()]);
    assert!(imported.contains(&image()), "{imported}");
    let listed = containerd.ok(&["images", "ls", "-q"]);
    assert!(listed.lines().any(|l| l == image()), "{listed}");

    // A node: containerd's file as an operator's might be, with settings of its own.
    let host = dir.path().join("host");
    let containerd_file = host.join("etc/containerd/config.toml");
    std::fs::create_dir_all(containerd_file.parent().unwrap()).unwrap();
    let original = "version = 2\n\
        # the node's own settings, which must survive\n\
        [plugins.\"io.containerd.grpc.v1.cri\"]\n  \
        sandbox_image = \"registry.k8s.io/pause:3.9\"\n\
        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n  \
        SystemdCgroup = true\n";
    std::fs::write(&containerd_file, original).unwrap();
    std::fs::create_dir_all(host.join("usr/bin")).unwrap();
    std::fs::write(host.join("usr/bin/other"), "a program of the node's").unwrap();
    let before = tree(&host);

    let config = dir.path().join("configmap/config.toml");
    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
    let config_text = format!(
        "[runtime]\nlibrary = \"/{PREFIX}/lib/gpushare/libgpushare.so\"\nhook = \"/{PREFIX}/bin/gpushare-hook\"\n"
    );
    std::fs::write(&config, &config_text).unwrap();
    let restarts = dir.path().join("restarts/log");
    std::fs::create_dir_all(restarts.parent().unwrap()).unwrap();

    node_setup(&containerd, "install", &host, &config, &restarts);
    let prefix = host.join(PREFIX);
    for program in PROGRAMS
        .iter()
        .filter(|p| !["gpushare-arbiter", "gpushare-kube"].contains(p))
    {
        let installed = prefix.join("bin").join(program);
        assert_eq!(
            std::fs::read(&installed).unwrap_or_else(|e| panic!("{}: {e}", installed.display())),
            std::fs::read(bin(program)).unwrap(),
            "{program} installed as built"
        );
    }
    assert_eq!(
        std::fs::read(prefix.join("lib/gpushare/libgpushare.so")).unwrap(),
        std::fs::read(gpushare_testkit::binaries::preload_library()).unwrap()
    );
    assert_eq!(
        std::fs::read_to_string(host.join("etc/gpushare/config.toml")).unwrap(),
        config_text
    );
    let configured = std::fs::read_to_string(&containerd_file).unwrap();
    for line in original.lines() {
        assert!(configured.contains(line), "kept {line:?}:\n{configured}");
    }
    assert!(
        configured.contains("containerd.runtimes.gpushare]")
            && configured.contains(&format!("BinaryName = \"/{PREFIX}/bin/gpushare-runc\"")),
        "gpushare's runtime, naming the host's installed gpushare-runc:\n{configured}"
    );
    assert_eq!(restart_count(&restarts), 1, "the file changed: one restart");

    // The pod restarted: nothing changes, so containerd is left alone.
    let installed = tree(&host);
    node_setup(&containerd, "install", &host, &config, &restarts);
    assert_eq!(tree(&host), installed);
    assert_eq!(restart_count(&restarts), 1, "unchanged: no restart");

    node_setup(&containerd, "undo", &host, &config, &restarts);
    let after = tree(&host);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>(),
        "undo removes what install added"
    );
    assert!(after == before, "undo gives every file back byte for byte");
    assert_eq!(
        restart_count(&restarts),
        2,
        "undo changed the file: a restart"
    );

    // The arbiter container: the image's arbiter on the simulated GPU's NVML.
    let node = dir.path().join("arbiter");
    for sub in ["simgpu", "simgpu-state", "run", "state", "etc"] {
        std::fs::create_dir_all(node.join(sub)).unwrap();
    }
    for entry in std::fs::read_dir(simgpu::libs()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, node.join("simgpu").join(path.file_name().unwrap())).unwrap();
    }
    std::fs::write(
        node.join("etc/config.toml"),
        "[arbiter]\nrun_dir = \"/run/gpushare\"\nstate_dir = \"/var/lib/gpushare\"\n\
         nvml_library = \"/simgpu/libnvidia-ml.so.1\"\nmetrics_address = \"127.0.0.1:9447\"\n",
    )
    .unwrap();
    let machine = SimMachine::new("/simgpu-state", 1, "16Gi");
    // Privileged, as the DaemonSet runs it: the arbiter checks at start that it holds
    // CAP_SYS_PTRACE and CAP_KILL, which a default container's set lacks (the first).
    let mut run = vec![
        "run".to_owned(),
        "-d".to_owned(),
        "--privileged".to_owned(),
        "--mount".to_owned(),
        bind(&node.join("simgpu"), "/simgpu", "ro"),
        "--mount".to_owned(),
        bind(&node.join("simgpu-state"), "/simgpu-state", "rw"),
        "--mount".to_owned(),
        bind(&node.join("run"), "/run/gpushare", "rw"),
        "--mount".to_owned(),
        bind(&node.join("state"), "/var/lib/gpushare", "rw"),
        "--mount".to_owned(),
        bind(&node.join("etc"), "/etc/gpushare", "ro"),
    ];
    for (key, value) in machine.env() {
        run.extend(["--env".to_owned(), format!("{key}={value}")]);
    }
    run.extend(
        [
            &image(),
            "arbiter",
            "/opt/gpushare/bin/gpushare-arbiter",
            "--config",
            "/etc/gpushare/config.toml",
        ]
        .map(str::to_owned),
    );
    containerd.ok(&run.iter().map(String::as_str).collect::<Vec<_>>());
    let exec = |id: &str, command: &[&str]| {
        let mut args = vec!["task", "exec", "--exec-id", id, "arbiter"];
        args.extend_from_slice(command);
        containerd.ctr(&args)
    };
    let mut status = String::new();
    wait_until(
        "the image's arbiter to answer",
        Duration::from_secs(30),
        || {
            let out = exec(
                "status",
                &[
                    "/opt/gpushare/bin/gpusharectl",
                    "--config",
                    "/etc/gpushare/config.toml",
                    "status",
                ],
            );
            status = String::from_utf8_lossy(&out.stdout).into_owned();
            out.status.success()
        },
    );
    assert!(
        status.contains(&sim_uuid(0)),
        "the simulated GPU:\n{status}"
    );
    let health = exec(
        "healthz",
        &["wget", "-qO-", "http://127.0.0.1:9447/healthz"],
    );
    assert!(
        health.status.success(),
        "GET /healthz: {}",
        String::from_utf8_lossy(&health.stderr)
    );

    // The same archive loads into docker, named as the DaemonSet names it.
    let docker_dir = dir.path().join("docker");
    std::fs::create_dir(&docker_dir).unwrap();
    let docker = Dockerd::start(&docker_dir, &unused);
    let loaded = docker.ok(&["load", "-i", archive.to_str().unwrap()]);
    let tag = image().trim_start_matches("docker.io/").to_owned();
    assert!(loaded.contains(&tag), "{loaded}");
    let version = docker.ok(&[
        "run",
        "--rm",
        "--network",
        "none",
        &tag,
        "gpusharectl",
        "--version",
    ]);
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
}
