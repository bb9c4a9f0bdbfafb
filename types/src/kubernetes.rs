//! Kubernetes names gpushare shares between its device plugin (`gpushare-kube`), the
//! runtime side (shim, `gpushare-runc`, hooks) and the arbiter: the extended
//! resources it advertises, the annotations a device plugin's `Allocate` answer
//! carries, and the grant id those annotations name.
//!
//! Why one annotation per resource: kubelet calls `Allocate` once per extended
//! resource of a container and merges the answers' annotations into one map, so
//! answers for `gpushare.io/memory` and `gpushare.io/high` must not use the same key.

use std::fmt;

/// GPU memory in pooled units (`kubernetes.memory_unit`, 1 GiB by default).
pub const MEMORY_RESOURCE: &str = "gpushare.io/memory";
/// One slot per shared GPU: at most one high-priority job per GPU.
pub const HIGH_RESOURCE: &str = "gpushare.io/high";
/// 100 per shared GPU: guaranteed compute in percent of one GPU.
pub const COMPUTE_RESOURCE: &str = "gpushare.io/compute";

/// Every grant annotation starts with this. containerd passes it through
/// `container_annotations` only: container-level CRI annotations come from kubelet
/// and its device plugins, while a pod's own annotations reach the sandbox config
/// (and `pod_annotations`), so a pod cannot supply a grant.
pub const GRANT_ANNOTATION_PREFIX: &str = "grant.gpushare.io/";
/// The memory grant (the primary one: it decides the GPU).
pub const GRANT_MEMORY_ANNOTATION: &str = "grant.gpushare.io/id";
pub const GRANT_HIGH_ANNOTATION: &str = "grant.gpushare.io/high";
pub const GRANT_COMPUTE_ANNOTATION: &str = "grant.gpushare.io/compute";

/// The same ids in the environment, for runtimes that drop annotations. The
/// environment is the container's own (a pod spec can set any variable), so the
/// runtime side never takes a grant from it: these are for the workload to read.
pub const GRANT_MEMORY_ENV: &str = "GPUSHARE_GRANT";
pub const GRANT_HIGH_ENV: &str = "GPUSHARE_GRANT_HIGH";
pub const GRANT_COMPUTE_ENV: &str = "GPUSHARE_GRANT_COMPUTE";

/// Where the CRI runtime records a container's pod. containerd's CRI plugin writes
/// the `cri` keys, CRI-O the others; both from kubelet's sandbox and container
/// metadata, which a pod's author does not write.
pub const POD_NAMESPACE_ANNOTATIONS: [&str; 2] = [
    "io.kubernetes.cri.sandbox-namespace",
    "io.kubernetes.pod.namespace",
];
pub const POD_NAME_ANNOTATIONS: [&str; 2] =
    ["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"];
pub const CONTAINER_NAME_ANNOTATIONS: [&str; 2] = [
    "io.kubernetes.cri.container-name",
    "io.kubernetes.container.name",
];

/// Names one grant: what a device plugin's `Allocate` obtained from the arbiter.
/// Random, so knowing one is the only way to name it; a plain name (it appears in
/// annotations, logs and metric labels).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct GrantId(pub String);

/// What a grant id may look like, for error messages.
pub const GRANT_ID_FORM: &str = "1 to 64 characters of a-z, 0-9 and '-'";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadGrantId {
    pub value: String,
}

impl fmt::Display for BadGrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "grant id {:?} is not a plain name: expected {GRANT_ID_FORM}",
            self.value
        )
    }
}

impl std::error::Error for BadGrantId {}

impl GrantId {
    pub fn is_well_formed(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    }

    pub fn parse(s: impl Into<String>) -> Result<GrantId, BadGrantId> {
        let s = s.into();
        if GrantId::is_well_formed(&s) {
            Ok(GrantId(s))
        } else {
            Err(BadGrantId { value: s })
        }
    }
}

impl fmt::Display for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_ids_are_plain_names() {
        assert!(GrantId::parse("g-0123abcd").is_ok());
        for bad in ["", "../x", "G-1", "a b", &"a".repeat(65)] {
            let e = GrantId::parse(bad).unwrap_err();
            assert!(e.to_string().contains(GRANT_ID_FORM), "{e}");
        }
    }

    #[test]
    fn every_grant_annotation_carries_the_prefix() {
        for key in [
            GRANT_MEMORY_ANNOTATION,
            GRANT_HIGH_ANNOTATION,
            GRANT_COMPUTE_ANNOTATION,
        ] {
            assert!(key.starts_with(GRANT_ANNOTATION_PREFIX), "{key}");
        }
    }
}
