//! Grants: what the Kubernetes device plugin (`gpushare-kube`) obtained from the
//! arbiter in `Allocate`, before any container exists, and what a container's
//! lease is later reserved against.
//!
//! kube-scheduler counts gpushare's capacity as node totals of pooled units; the
//! node alone chooses the GPU. A memory grant is placed at once when a GPU has room
//! (worst fit) or recorded as waiting, so `Allocate` never fails for
//! fragmentation: a waiting grant makes the container's create wait (and kubelet
//! retry it), never the pod fail.

use serde::{Deserialize, Serialize};

pub use gpushare_types::kubernetes::{BadGrantId, GrantId, GRANT_ID_FORM};

use gpushare_types::LeaseId;

/// How much of which resource a grant holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "resource", rename_all = "snake_case")]
pub enum GrantAmount {
    /// `gpushare.io/memory`: units times `kubernetes.memory_unit`, in bytes. The
    /// lease reserved against it gets exactly this quota.
    Memory { bytes: u64 },
    /// `gpushare.io/high`: the right to run at high priority (one per GPU).
    High,
    /// `gpushare.io/compute`: guaranteed compute, in percent of one GPU.
    Compute { percent: u32 },
}

/// `ControlRequest::Grant`: one `Allocate` answer for one container and resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRequest {
    pub amount: GrantAmount,
    /// The pooled device ids kubelet allocated (they carry no placement meaning).
    /// A grant whose ids overlap an older grant's supersedes it: kubelet hands an id
    /// out again only once the pod that had it is gone.
    pub device_ids: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub id: GrantId,
    pub amount: GrantAmount,
    pub device_ids: Vec<String>,
    /// Memory grants: the GPU (UUID) holding its room; None while it waits for room.
    /// Other grants name a GPU only while a lease uses them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The live lease reserved against this grant, if any. A grant backs one lease
    /// at a time; when that container ends, a restart of it may use the grant again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseId>,
    pub created_unix_ms: u64,
}

/// What Kubernetes says of a container: its pod (from the CRI runtime's own
/// annotations) and the grants its device plugin answers named.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodBinding {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// At most one of each kind (memory, high, compute).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<GrantId>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_round_trips_with_its_resource_as_a_tag() {
        let g = Grant {
            id: GrantId("g-1".into()),
            amount: GrantAmount::Memory { bytes: 1 << 30 },
            device_ids: vec!["memory-0".into()],
            gpu: None,
            lease: None,
            created_unix_ms: 5,
        };
        let json = serde_json::to_string(&g).unwrap();
        assert!(json.contains(r#""resource":"memory""#), "{json}");
        assert!(!json.contains("gpu"), "{json}");
        assert_eq!(serde_json::from_str::<Grant>(&json).unwrap(), g);
    }

    #[test]
    fn an_empty_binding_reads_from_nothing() {
        assert_eq!(
            serde_json::from_str::<PodBinding>("{}").unwrap(),
            PodBinding::default()
        );
    }
}
