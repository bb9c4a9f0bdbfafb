//! A pod through containerd's real CRI plugin (Debian 12's containerd 1.6), with
//! the test playing kubelet over the CRI gRPC API (tests/cri): no kubelet and no
//! cri-tools can be installed here. For both ways gpushare plugs into containerd
//! (the shim as the handler's runtime; gpushare-runc as runc's BinaryName) the
//! pod's pause container must get no lease and no GPU, its app container must,
//! and stopping and removing the pod must leave nothing behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_cri::image::{self, ImageConfig};
use gpushare_cri::{api, Cri, CONTAINER_TYPE_ANNOTATION, CRI_NAMESPACE};
use gpushare_e2e::containerd::{processes_with, Containerd, ContainerdOptions};
use gpushare_e2e::*;

/// The RuntimeClass handler: a pod with `runtimeClassName` naming a RuntimeClass
/// whose `handler: gpushare` reaches the CRI plugin as this runtime_handler.
const HANDLER: &str = "gpushare";
/// One image serves as the sandbox (pause) image and the app's: its command
/// sleeps, which is all a pause container has to do.
const IMAGE: &str = "docker.io/gpushare/busybox:e2e";
/// overlayfs cannot be mounted on the overlay these tests run on (the docker and
/// podman tests use vfs for the same reason); native copies, and busybox is small.
const SNAPSHOTTER: &str = "native";

#[derive(Clone, Copy, Debug)]
enum Entry {
    /// containerd-shim-gpushare-v2, named by its runtime type.
    Shim,
    /// runc's own shim running gpushare-runc as its BinaryName
    /// (config/containerd/config-v3.toml's way, spelled for containerd 1.6).
    RuncBinary,
}

/// The gpushare handler's runtime table.
///
/// The shim is named by its runtime type (containerd finds
/// containerd-shim-gpushare-v2 on its PATH), not by runtime_path as
/// config/containerd/config-v2.toml does: containerd before 1.6.21 and 1.7.2 reads
/// runtime_path but drops it on the way to the task service (the client's
/// WithRuntimePath never reached the create request; containerd commit f49254f0b
/// fixed it), so Debian 12's 1.6.20 runs such a pod under plain runc, without
/// gpushare and without a word. The runtime type gets no runc options from the
/// CRI plugin, so runc keeps its state under the host's /run/containerd/runc/k8s.io.
///
/// gpushare-runc rides on the runc type, whose typed options carry BinaryName and
/// Root: runc's state goes under the test's directory.
fn handler_config(entry: Entry, dir: &Path) -> String {
    let table = format!("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.{HANDLER}]");
    let annotations =
        "  pod_annotations = [\"gpushare.io/*\"]\n  container_annotations = [\"gpushare.io/*\"]\n";
    match entry {
        Entry::Shim => {
            format!("{table}\n  runtime_type = \"io.containerd.gpushare.v2\"\n{annotations}")
        }
        Entry::RuncBinary => format!(
            "{table}\n  runtime_type = \"io.containerd.runc.v2\"\n{annotations}\
             {table_options}\n    BinaryName = \"{binary}\"\n    Root = \"{root}\"\n",
            table_options = table.replace("]", ".options]"),
            binary = bin("gpushare-runc").display(),
            root = dir.join("runc").display(),
        ),
    }
}

/// The CRI plugin's part of containerd's configuration.
fn cri_config(entry: Entry, dir: &Path) -> String {
    let d = dir.display();
    // CNI: the pods here use the node's network, for which the CRI plugin calls no
    // CNI plugin; it only logs that it found no network config at start. The
    // directories are named so that it never reads the host's /etc/cni.
    // restrict_oom_score_adj: the CRI plugin gives pause containers an OOM score
    // adjustment of -998, below the test machine's own, which it may not lower
    // (runc's init dies writing it); restricted, it keeps to containerd's own.
    // runc stays the default runtime (a table of runtimes replaces the built-in one,
    // and the CRI plugin refuses to start without its default): gpushare serves only
    // the pods whose RuntimeClass names it, as on a real node.
    // No SystemdCgroup (the shipped snippets set it): there is no systemd here.
    format!(
        "[plugins.\"io.containerd.grpc.v1.cri\"]\n\
         \x20 disable_tcp_service = true\n\
         \x20 stream_server_address = \"127.0.0.1\"\n\
         \x20 sandbox_image = \"{IMAGE}\"\n\
         \x20 restrict_oom_score_adj = true\n\
         [plugins.\"io.containerd.grpc.v1.cri\".cni]\n\
         \x20 bin_dir = \"{d}/cni-bin\"\n\
         \x20 conf_dir = \"{d}/cni-conf\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n\
         \x20 snapshotter = \"{SNAPSHOTTER}\"\n\
         [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n\
         \x20 runtime_type = \"io.containerd.runc.v2\"\n\
         {handler}",
        handler = handler_config(entry, dir),
    )
}

/// The shim binary containerd started for a container (it records it in the bundle).
fn shim_binary(ctr: &Containerd, id: &str) -> PathBuf {
    let path = bundle_dir(ctr, id).join("shim-binary-path");
    PathBuf::from(
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
}

/// Stops and removes every pod the CRI plugin still has, however the test ends
/// (containerd's own Drop only cleans its `ctr` namespace, not `k8s.io`): dropped
/// before the containerd it talks to.
struct Kubelet {
    cri: Cri,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        for pod in self.cri.list_pod_sandboxes().unwrap_or_default() {
            let _ = self.cri.stop_pod_sandbox(&pod.id);
            let _ = self.cri.remove_pod_sandbox(&pod.id);
        }
    }
}

/// The CRI plugin's lines of containerd's log: why it did not come up, or what it
/// did with a pod.
fn cri_log(ctr: &Containerd) -> String {
    let log = std::fs::read_to_string(ctr.dir.join("containerd.log")).unwrap_or_default();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cri") && (l.contains("level=error") || l.contains("level=warn")))
        .collect();
    format!(
        "\n--- containerd.log (CRI warnings and errors) ---\n{}{}",
        lines.join("\n"),
        ctr.log_tail()
    )
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn bundle_dir(ctr: &Containerd, id: &str) -> PathBuf {
    ctr.dir
        .join("state/io.containerd.runtime.v2.task")
        .join(CRI_NAMESPACE)
        .join(id)
}

fn annotation<'a>(spec: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    spec["annotations"][key].as_str()
}

fn env<'a>(spec: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    spec["process"]["env"]
        .as_array()?
        .iter()
        .filter_map(serde_json::Value::as_str)
        .find_map(|e| e.strip_prefix(key)?.strip_prefix('='))
}

fn pause_container_gets_no_lease(entry: Entry) {
    require_root();
    let dir = scratch();
    let arbiter = Arbiter::start(
        dir.path(),
        ArbiterOptions {
            simulated_driver: Some("12020"),
            ..Default::default()
        },
    );
    let extra = cri_config(entry, dir.path());
    let ctr = Containerd::start(
        dir.path(),
        &arbiter.config_path,
        ContainerdOptions {
            extra_config: &extra,
            cri: true,
        },
    );
    let archive = dir.path().join("image.tar");
    image::write_archive(
        &ctr.rootfs,
        &ImageConfig {
            name: IMAGE,
            cmd: &["/bin/sleep", "3600"],
        },
        &dir.path().join("image-layout"),
        &archive,
    )
    .unwrap();
    image::import(&ctr.address, &archive, SNAPSHOTTER).unwrap();
    let kubelet = Kubelet {
        cri: Cri::connect(&ctr.address).unwrap(),
    };
    let cri = &kubelet.cri;
    let version = cri
        .version()
        .unwrap_or_else(|e| panic!("CRI Version: {e}{}", cri_log(&ctr)));
    assert_eq!(version.runtime_api_version, "v1", "{version:?}");

    // Kubernetes users ask on the pod: kubelet hands the pod's annotations to the
    // CRI, and pod_annotations copies them into the spec of every container of the
    // pod, the pause container's too. That is why the pause container would be
    // leased if nothing told it apart.
    let pod_config = gpushare_cri::host_network_pod(
        "gpu-pod",
        "default",
        "c6a3c9a2-0001-4000-8000-000000000001",
        HashMap::from([("gpushare.io/memory".to_owned(), "1Gi".to_owned())]),
    );
    let pod = cri
        .run_pod_sandbox(&pod_config, HANDLER)
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}{}", ctr.log_tail()));
    let app_config = gpushare_cri::container("app", IMAGE, &["/bin/sleep", "3600"]);
    let app = cri
        .create_container(&pod, &app_config, &pod_config)
        .unwrap_or_else(|e| panic!("CreateContainer: {e}{}", ctr.log_tail()));
    cri.start_container(&app)
        .unwrap_or_else(|e| panic!("StartContainer: {e}{}", ctr.log_tail()));
    let status = cri.container_status(&app).unwrap();
    assert_eq!(
        status.state,
        api::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );

    // Which shim serves the pod: without this, a configuration containerd ignores
    // would test plain runc.
    let expected_shim = match entry {
        Entry::Shim => "containerd-shim-gpushare-v2",
        Entry::RuncBinary => "containerd-shim-runc-v2",
    };
    for id in [&pod, &app] {
        let shim = shim_binary(&ctr, id);
        assert_eq!(
            shim.file_name().unwrap(),
            expected_shim,
            "{}",
            shim.display()
        );
    }

    let pause = read_json(&bundle_dir(&ctr, &pod).join("config.json"));
    assert_eq!(
        annotation(&pause, CONTAINER_TYPE_ANNOTATION),
        Some("sandbox")
    );
    assert_eq!(
        annotation(&pause, "gpushare.io/memory"),
        Some("1Gi"),
        "the pause container carries the pod's request (else this test proves nothing)"
    );
    assert_eq!(
        annotation(&pause, "gpushare.io/lease"),
        None,
        "{entry:?}: the pause container was leased: {}",
        pause["annotations"]
    );
    assert_eq!(
        env(&pause, "NVIDIA_VISIBLE_DEVICES"),
        None,
        "{entry:?}: the pause container was given a GPU: {}",
        pause["process"]["env"]
    );

    let spec = read_json(&bundle_dir(&ctr, &app).join("config.json"));
    assert_eq!(
        annotation(&spec, CONTAINER_TYPE_ANNOTATION),
        Some("container")
    );
    let lease_id = annotation(&spec, "gpushare.io/lease")
        .unwrap_or_else(|| panic!("{entry:?}: the app has no lease: {}", spec["annotations"]));
    assert_eq!(
        env(&spec, "NVIDIA_VISIBLE_DEVICES"),
        Some(sim_uuid(0).as_str())
    );

    let leases = arbiter.leases();
    assert_eq!(
        leases.len(),
        1,
        "{entry:?}: one lease, the app's: {leases:#?}"
    );
    assert_eq!(leases[0]["container_id"], app.as_str(), "{leases:#?}");
    assert_eq!(leases[0]["sandbox_id"], pod.as_str(), "{leases:#?}");
    assert_eq!(leases[0]["id"], lease_id, "{leases:#?}");
    assert_eq!(
        leases[0]["gpus"],
        serde_json::json!([sim_uuid(0)]),
        "{leases:#?}"
    );
    // requests.tenant_from = auto: the tenant is the namespace the CRI plugin
    // recorded for the pod, not anything the pod wrote.
    assert_eq!(leases[0]["tenant"], "default", "{leases:#?}");

    // What kubelet does when the pod is deleted.
    cri.stop_container(&app, Duration::ZERO).unwrap();
    cri.remove_container(&app).unwrap();
    cri.stop_pod_sandbox(&pod).unwrap();
    cri.remove_pod_sandbox(&pod).unwrap();
    assert!(cri.list_containers(None).unwrap().is_empty());
    assert!(cri.list_pod_sandboxes().unwrap().is_empty());
    wait_until("the lease to be released", Duration::from_secs(10), || {
        arbiter.leases().is_empty()
    });
    assert_eq!(arbiter.lease_dirs(), 0, "lease directories left");
    let address = ctr.address.to_string_lossy().into_owned();
    wait_until("the pod's shims to exit", Duration::from_secs(10), || {
        processes_with(&address)
            .iter()
            .all(|(_, cmd)| !cmd.contains("containerd-shim"))
    });
    // Dropped in reverse order: the pods (already gone), containerd, the arbiter.
}

#[test]
fn through_the_shim_the_pause_container_gets_no_lease() {
    pause_container_gets_no_lease(Entry::Shim);
}

#[test]
fn through_gpushare_runc_the_pause_container_gets_no_lease() {
    pause_container_gets_no_lease(Entry::RuncBinary);
}
