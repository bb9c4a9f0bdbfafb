//! A node as the CRI end-to-end tests see it: a private containerd with its CRI
//! plugin and the gpushare RuntimeClass handler, a locally built image serving as
//! sandbox (pause) image and app image, and the gpushare-cri client playing kubelet
//! (no kubelet and no cri-tools can be installed here). Shared by tests/cri.rs and
//! tests/kubernetes.rs.

use std::path::{Path, PathBuf};

use gpushare_cri::image::{self, ImageConfig};
use gpushare_cri::{Cri, CRI_NAMESPACE};
use serde_json::Value;

use crate::bin;
use crate::containerd::{Containerd, ContainerdOptions};

/// The RuntimeClass handler: a pod with `runtimeClassName` naming a RuntimeClass
/// whose `handler: gpushare` reaches the CRI plugin as this runtime_handler.
pub const HANDLER: &str = "gpushare";
/// One image serves as the sandbox (pause) image and the app's: its command
/// sleeps, which is all a pause container has to do.
pub const IMAGE: &str = "docker.io/gpushare/busybox:e2e";
/// overlayfs cannot be mounted on the overlay these tests run on (the docker and
/// podman tests use vfs for the same reason); native copies, and busybox is small.
pub const SNAPSHOTTER: &str = "native";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// containerd-shim-gpushare-v2, named by its runtime type.
    Shim,
    /// runc's own shim running gpushare-runc as its BinaryName
    /// (the shipped config/containerd/config-v2.toml and config-v3.toml).
    RuncBinary,
}

impl Entry {
    /// The shim binary containerd starts for the handler's pods.
    pub fn shim(self) -> &'static str {
        match self {
            Entry::Shim => "containerd-shim-gpushare-v2",
            Entry::RuncBinary => "containerd-shim-runc-v2",
        }
    }
}

/// The annotation patterns of the shipped snippets (config/containerd): requests
/// from the pod and its containers, grants from the containers' CRI annotations
/// only (kubelet's and its device plugins'), never from the pod's.
const ANNOTATIONS: &str = "  pod_annotations = [\"gpushare.io/*\"]\n  \
     container_annotations = [\"gpushare.io/*\", \"grant.gpushare.io/*\"]\n";

/// The gpushare handler's runtime table.
///
/// The shim is named by its runtime type (containerd finds
/// containerd-shim-gpushare-v2 on its PATH), not by runtime_path: containerd before
/// 1.6.21 and 1.7.2 reads runtime_path but drops it on the way to the task service
/// (the client's WithRuntimePath never reached the create request; containerd commit
/// f49254f0b fixed it), so Debian 12's 1.6.20 runs such a pod under plain runc,
/// without gpushare and without a word; that is why the shipped
/// config/containerd/config-v2.toml uses gpushare-runc instead. The runtime type gets
/// no runc options from the CRI plugin, so runc keeps its state under the host's
/// /run/containerd/runc/k8s.io.
///
/// gpushare-runc rides on the runc type, whose typed options carry BinaryName and
/// Root: runc's state goes under the test's directory.
pub fn handler_config(entry: Entry, dir: &Path) -> String {
    let table = format!("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.{HANDLER}]");
    match entry {
        Entry::Shim => {
            format!("{table}\n  runtime_type = \"io.containerd.gpushare.v2\"\n{ANNOTATIONS}")
        }
        Entry::RuncBinary => format!(
            "{table}\n  runtime_type = \"io.containerd.runc.v2\"\n{ANNOTATIONS}\
             {table_options}\n    BinaryName = \"{binary}\"\n    Root = \"{root}\"\n",
            table_options = table.replace("]", ".options]"),
            binary = bin("gpushare-runc").display(),
            root = dir.join("runc").display(),
        ),
    }
}

/// The CRI plugin's part of containerd's configuration.
pub fn cri_config(entry: Entry, dir: &Path) -> String {
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

/// containerd with its CRI plugin and the gpushare handler for `entry`, the test
/// image imported, and a CRI client. Dropped, it stops and removes every pod the
/// CRI plugin still has (containerd's own Drop only cleans its `ctr` namespace,
/// not `k8s.io`), then containerd.
pub struct CriNode {
    pub cri: Cri,
    pub ctr: Containerd,
}

impl CriNode {
    /// `gpushare_config`: the configuration the shim and gpushare-runc read.
    pub fn start(entry: Entry, dir: &Path, gpushare_config: &Path) -> CriNode {
        let extra = cri_config(entry, dir);
        let ctr = Containerd::start(
            dir,
            gpushare_config,
            ContainerdOptions {
                extra_config: &extra,
                cri: true,
            },
        );
        let archive = dir.join("image.tar");
        image::write_archive(
            &ctr.rootfs,
            &ImageConfig {
                name: IMAGE,
                cmd: &["/bin/sleep", "3600"],
            },
            &dir.join("image-layout"),
            &archive,
        )
        .unwrap();
        image::import(&ctr.address, &archive, SNAPSHOTTER).unwrap();
        let cri = Cri::connect(&ctr.address).unwrap();
        let node = CriNode { cri, ctr };
        let version = node
            .cri
            .version()
            .unwrap_or_else(|e| panic!("CRI Version: {e}{}", node.log()));
        assert_eq!(version.runtime_api_version, "v1", "{version:?}");
        node
    }

    /// The CRI plugin's lines of containerd's log: why it did not come up, or what
    /// it did with a pod.
    pub fn log(&self) -> String {
        let log = std::fs::read_to_string(self.ctr.dir.join("containerd.log")).unwrap_or_default();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("cri") && (l.contains("level=error") || l.contains("level=warn"))
            })
            .collect();
        format!(
            "\n--- containerd.log (CRI warnings and errors) ---\n{}{}",
            lines.join("\n"),
            self.ctr.log_tail()
        )
    }

    /// Where containerd keeps the bundle of a CRI container or pause container.
    pub fn bundle_dir(&self, id: &str) -> PathBuf {
        self.ctr
            .dir
            .join("state/io.containerd.runtime.v2.task")
            .join(CRI_NAMESPACE)
            .join(id)
    }

    /// The OCI spec the runtime received (as gpushare left it).
    pub fn spec(&self, id: &str) -> Value {
        read_json(&self.bundle_dir(id).join("config.json"))
    }

    /// Asserts that `entry`'s handler serves container `id` (without this, a configuration
    /// containerd ignored would test plain runc). containerd 1.6 records the shim binary it
    /// started in the bundle (`shim-binary-path`); 2.x records no shim for runc's type but
    /// the OCI runtime that shim runs (`runtime`: the BinaryName option's path).
    pub fn assert_served_by(&self, id: &str, entry: Entry) {
        let bundle = self.bundle_dir(id);
        if let Ok(path) = std::fs::read_to_string(bundle.join("shim-binary-path")) {
            let shim = PathBuf::from(path);
            assert_eq!(
                shim.file_name().and_then(|n| n.to_str()),
                Some(entry.shim()),
                "{id} is served by {}",
                shim.display()
            );
            return;
        }
        let runtime_file = bundle.join("runtime");
        let runtime = std::fs::read_to_string(&runtime_file).unwrap_or_else(|e| {
            let listing: Vec<String> = std::fs::read_dir(&bundle)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            panic!(
                "{}: {e}, and no shim-binary-path (the bundle holds {listing:?})",
                runtime_file.display()
            )
        });
        let expected = match entry {
            Entry::Shim => "io.containerd.gpushare.v2".to_owned(),
            Entry::RuncBinary => bin("gpushare-runc").display().to_string(),
        };
        assert_eq!(runtime.trim(), expected, "{}", runtime_file.display());
    }
}

impl Drop for CriNode {
    fn drop(&mut self) {
        for pod in self.cri.list_pod_sandboxes().unwrap_or_default() {
            let _ = self.cri.stop_pod_sandbox(&pod.id);
            let _ = self.cri.remove_pod_sandbox(&pod.id);
        }
    }
}

pub fn read_json(path: &Path) -> Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn annotation<'a>(spec: &'a Value, key: &str) -> Option<&'a str> {
    spec["annotations"][key].as_str()
}

/// The first `key=` entry of the spec's environment, as getenv reads it.
pub fn env<'a>(spec: &'a Value, key: &str) -> Option<&'a str> {
    spec["process"]["env"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|e| e.strip_prefix(key)?.strip_prefix('='))
}
