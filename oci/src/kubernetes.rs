//! What the CRI runtimes (containerd's CRI plugin, CRI-O) write into a pod's
//! container specs, and what gpushare reads from it.

use serde_json::Value;

/// Where each CRI runtime says whether a container is the pod's pause container
/// ("sandbox") or one of its workloads ("container"): containerd, then CRI-O.
pub const CONTAINER_TYPE_KEYS: [&str; 2] = [
    "io.kubernetes.cri.container-type",
    "io.kubernetes.cri-o.ContainerType",
];
/// The value of a `CONTAINER_TYPE_KEYS` annotation on a pod's pause container.
pub const SANDBOX: &str = "sandbox";
/// Where each CRI runtime names the pod (sandbox) a container belongs to.
pub const SANDBOX_ID_KEYS: [&str; 2] = [
    "io.kubernetes.cri.sandbox-id",
    "io.kubernetes.cri-o.SandboxID",
];

fn annotation<'a>(spec: &'a Value, key: &str) -> Option<&'a str> {
    spec.get("annotations")?.get(key)?.as_str()
}

/// A pod's pause container: it holds the pod's namespaces and runs no workload,
/// so it gets no GPU, even though the pod's annotations (its request among them)
/// were copied into its spec.
pub fn is_pod_sandbox(spec: &Value) -> bool {
    CONTAINER_TYPE_KEYS
        .iter()
        .any(|key| annotation(spec, key) == Some(SANDBOX))
}

/// The id of the pod a container belongs to, where a CRI runtime recorded one.
pub fn sandbox_id(spec: &Value) -> Option<String> {
    SANDBOX_ID_KEYS
        .iter()
        .find_map(|key| annotation(spec, key).filter(|id| !id.is_empty()))
        .map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_pause_container_of_either_cri_runtime_is_a_sandbox() {
        for key in CONTAINER_TYPE_KEYS {
            assert!(
                is_pod_sandbox(&json!({"annotations": {key: "sandbox"}})),
                "{key}"
            );
            assert!(
                !is_pod_sandbox(&json!({"annotations": {key: "container"}})),
                "{key}"
            );
        }
        assert!(!is_pod_sandbox(&json!({})));
        assert!(!is_pod_sandbox(
            &json!({"annotations": {"io.kubernetes.cri.sandbox-id": "p"}})
        ));
    }

    #[test]
    fn the_pod_is_named_by_either_cri_runtime() {
        for key in SANDBOX_ID_KEYS {
            assert_eq!(
                sandbox_id(&json!({"annotations": {key: "p"}})).as_deref(),
                Some("p")
            );
            assert_eq!(sandbox_id(&json!({"annotations": {key: ""}})), None);
        }
        assert_eq!(sandbox_id(&json!({})), None);
    }
}
