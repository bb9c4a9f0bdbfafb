//! A lease: what the arbiter granted one container.

use serde::{Deserialize, Serialize};

use crate::quantity::{Fraction, Priority};
pub use gpushare_types::lease_id::{BadLeaseId, LeaseId, LEASE_ID_FORM};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Granted, container not yet started.
    Reserved,
    /// The runtime reported the container's pid.
    Confirmed,
    /// Given back (poststop, shim, reconciliation or an operator). The arbiter
    /// drops released leases from its table; a lease-socket client whose lease
    /// was released hears this state so it can stop using the GPU.
    Released,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    pub id: LeaseId,
    pub container_id: String,
    /// The id space of `container_id` (see `ReserveRequest::namespace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub sandbox_id: Option<String>,
    /// Always UUIDs: indices can change across driver reloads.
    pub gpus: Vec<String>,
    pub priority: Priority,
    /// Resolved to bytes at placement, even when the request was a fraction.
    pub memory_bytes: u64,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
    pub tenant: Option<String>,
    pub state: LeaseState,
    pub pid: Option<u32>,
    pub created_unix_ms: u64,
    /// The container's pod and the grants it was reserved against (Kubernetes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<crate::grant::PodBinding>,
}

/// How many characters of a 64-character container id `docker ps` shows.
pub const SHORT_ID_LEN: usize = 12;

impl Lease {
    /// What a person calls the container: the pod's `namespace/name/container`
    /// from the CRI runtime's annotations, else the container id, shortened to 12
    /// characters as docker shows it when it is a 64-character hex id.
    pub fn display_name(&self) -> String {
        if let Some(pod) = &self.pod {
            if let (Some(namespace), Some(name)) = (&pod.namespace, &pod.name) {
                return match &pod.container {
                    Some(container) => format!("{namespace}/{name}/{container}"),
                    None => format!("{namespace}/{name}"),
                };
            }
        }
        short_container_id(&self.container_id).to_owned()
    }
}

/// A 64-character hex id (docker's, containerd's generated ones) shortened to
/// [`SHORT_ID_LEN`]; any other id (a ctr id a person chose) whole.
pub fn short_container_id(id: &str) -> &str {
    if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &id[..SHORT_ID_LEN]
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grant::PodBinding;

    fn lease(container_id: &str, pod: Option<PodBinding>) -> Lease {
        Lease {
            id: LeaseId("l1".into()),
            container_id: container_id.into(),
            namespace: None,
            sandbox_id: None,
            gpus: vec![],
            priority: crate::quantity::Priority::Low,
            memory_bytes: 0,
            compute_request: crate::quantity::Fraction::ZERO,
            compute_limit: crate::quantity::Fraction::ONE,
            tenant: None,
            state: LeaseState::Confirmed,
            pid: None,
            created_unix_ms: 0,
            pod,
        }
    }

    #[test]
    fn a_lease_is_named_by_its_pod_else_its_short_id() {
        let docker = "0123456789abcdef".repeat(4);
        let pod = |namespace: Option<&str>, name: Option<&str>, container: Option<&str>| {
            Some(PodBinding {
                namespace: namespace.map(str::to_owned),
                name: name.map(str::to_owned),
                container: container.map(str::to_owned),
                grants: vec![],
            })
        };
        for (container_id, pod, want) in [
            (docker.as_str(), None, "0123456789ab"),
            ("trainer-1", None, "trainer-1"),
            // 64 characters but not hex: a name someone chose, kept whole.
            (&"z".repeat(64)[..], None, &"z".repeat(64)[..]),
            (
                docker.as_str(),
                pod(Some("team-a"), Some("train"), Some("main")),
                "team-a/train/main",
            ),
            (
                docker.as_str(),
                pod(Some("team-a"), Some("train"), None),
                "team-a/train",
            ),
            (
                docker.as_str(),
                pod(None, Some("train"), Some("main")),
                "0123456789ab",
            ),
        ] {
            assert_eq!(lease(container_id, pod).display_name(), want);
        }
    }
}
