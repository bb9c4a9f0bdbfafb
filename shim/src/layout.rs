//! Which container groups into which shim, and which files and sockets belong
//! to the gpushare shim (the "outer" one containerd talks to) and which to the
//! runc shim it decorates (the "inner" one). Pure functions: the decisions here
//! are unit-tested without containerd.
//!
//! Both shims derive their socket from containerd's address, the namespace and
//! the group, hashed the same way (`containerd_shim::socket_address` is the Go
//! `shim.SocketAddress`). Left alone, the runc shim would find the gpushare
//! shim's socket already listening and hand back *its* address, so the gpushare
//! shim hashes a group name of its own. Likewise the runc shim writes an
//! `address` file into its working directory, which containerd reads from the
//! bundle to reconnect after a restart: the runc shim therefore runs in a
//! directory of its own inside the bundle, so the bundle's `address` stays the
//! gpushare shim's.

use std::path::{Path, PathBuf};

use gpushare_oci::spec::Spec;

/// Annotations that put several containers into one shim, in the order the runc
/// shim honours them. The gpushare shim uses the same order so that one gpushare
/// shim always fronts exactly one runc shim.
pub const GROUP_LABELS: [&str; 2] = [
    "io.containerd.runc.v2.group",
    // containerd's CRI plugin's pod id (the runc shim knows no other runtime's).
    gpushare_oci::kubernetes::SANDBOX_ID_KEYS[0],
];

/// The runc shim's working directory, inside the bundle.
pub const INNER_DIR: &str = "runc-shim";
/// Written by whichever shim runs in a directory: its own socket address.
pub const ADDRESS_FILE: &str = "address";
/// containerd's log fifo for the shim, in the bundle.
pub const LOG_FIFO: &str = "log";
pub const SPEC_FILE: &str = "config.json";

/// The group a container's shim serves: the first group label present, else the
/// container itself.
pub fn grouping(spec: &Spec, container_id: &str) -> String {
    GROUP_LABELS
        .iter()
        .find_map(|label| spec.annotation(label))
        .filter(|group| !group.is_empty())
        .unwrap_or(container_id)
        .to_owned()
}

/// The gpushare shim's socket for a group.
pub fn outer_socket(containerd_address: &str, namespace: &str, group: &str) -> String {
    containerd_shim::socket_address(containerd_address, namespace, &format!("{group}/gpushare"))
}

/// Where the runc shim puts its socket for a group (its own hash of the plain
/// group name); used only when its `address` file is not at hand.
pub fn inner_socket(containerd_address: &str, namespace: &str, group: &str) -> String {
    containerd_shim::socket_address(containerd_address, namespace, group)
}

/// `unix:///run/…` → `/run/…`.
pub fn socket_path(address: &str) -> &Path {
    Path::new(address.strip_prefix("unix://").unwrap_or(address))
}

/// The files of one container's bundle.
#[derive(Debug, Clone)]
pub struct Bundle {
    pub dir: PathBuf,
}

impl Bundle {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Bundle { dir: dir.into() }
    }
    pub fn spec(&self) -> PathBuf {
        self.dir.join(SPEC_FILE)
    }
    /// The gpushare shim's address, read by containerd.
    pub fn address_file(&self) -> PathBuf {
        self.dir.join(ADDRESS_FILE)
    }
    pub fn inner_dir(&self) -> PathBuf {
        self.dir.join(INNER_DIR)
    }
    /// The runc shim's address; only in the bundle of the group's first container.
    pub fn inner_address_file(&self) -> PathBuf {
        self.inner_dir().join(ADDRESS_FILE)
    }
    /// What the runc shim's directory must hold before its `start`: the spec (it
    /// reads the group labels from it) and containerd's log fifo (its server
    /// opens `log` in its working directory and exits without it). Links, not
    /// copies: one fifo, one spec. (name in the inner directory, target)
    pub fn inner_links(&self) -> [(PathBuf, PathBuf); 2] {
        [
            (
                self.inner_dir().join(SPEC_FILE),
                Path::new("..").join(SPEC_FILE),
            ),
            (
                self.inner_dir().join(LOG_FIFO),
                Path::new("..").join(LOG_FIFO),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const SANDBOX_ID: &str = GROUP_LABELS[1];

    fn spec(value: Value) -> Spec {
        Spec::from_value(value).unwrap()
    }

    #[test]
    fn a_container_alone_is_its_own_group() {
        assert_eq!(grouping(&spec(json!({})), "c1"), "c1");
        assert_eq!(
            grouping(&spec(json!({"annotations": {"x": "y"}})), "c1"),
            "c1"
        );
    }

    #[test]
    fn pod_containers_group_by_sandbox_and_the_runc_label_wins() {
        let pod = spec(json!({"annotations": {SANDBOX_ID: "pod1"}}));
        assert_eq!(grouping(&pod, "c1"), "pod1");
        let both =
            spec(json!({"annotations": {SANDBOX_ID: "pod1", "io.containerd.runc.v2.group": "g"}}));
        assert_eq!(grouping(&both, "c1"), "g");
        let empty = spec(json!({"annotations": {SANDBOX_ID: ""}}));
        assert_eq!(grouping(&empty, "c1"), "c1");
    }

    #[test]
    fn the_two_shims_never_share_a_socket() {
        let addr = "/run/containerd/containerd.sock";
        let outer = outer_socket(addr, "default", "c1");
        let inner = inner_socket(addr, "default", "c1");
        assert_ne!(outer, inner);
        assert!(outer.starts_with("unix:///run/containerd/s/"), "{outer}");
        // Deterministic: a second container of the group finds the same shim.
        assert_eq!(outer, outer_socket(addr, "default", "c1"));
        assert_ne!(outer, outer_socket(addr, "other", "c1"));
        // The runc shim's own formula (sha256 of address/namespace/group).
        assert_eq!(
            inner,
            containerd_shim::socket_address(addr, "default", "c1")
        );
        assert!(socket_path(&outer).starts_with("/run/containerd/s"));
        assert!(socket_path(&outer).as_os_str().len() < 108);
    }

    #[test]
    fn the_runc_shim_lives_in_its_own_directory() {
        let b = Bundle::new("/b");
        assert_eq!(b.address_file(), Path::new("/b/address"));
        assert_eq!(b.inner_address_file(), Path::new("/b/runc-shim/address"));
        assert_ne!(b.address_file(), b.inner_address_file());
        let links = b.inner_links();
        assert_eq!(links[0].0, Path::new("/b/runc-shim/config.json"));
        assert_eq!(links[0].1, Path::new("../config.json"));
        assert_eq!(links[1].0, Path::new("/b/runc-shim/log"));
    }
}
