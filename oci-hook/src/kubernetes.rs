//! What the CRI runtimes (containerd's CRI plugin, CRI-O) write into a pod's
//! container specs, and what gpushare reads from it. Both write these after the
//! pod's own annotations, from the sandbox's metadata, so a pod's author cannot
//! choose them (unless the runtime handler passes such keys through).

use gpushare_types::kubernetes::{
    CONTAINER_NAME_ANNOTATIONS, POD_NAMESPACE_ANNOTATIONS, POD_NAME_ANNOTATIONS,
};

use crate::spec::Spec;

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
/// Where each CRI runtime records the pod's Kubernetes namespace.
pub const NAMESPACE_KEYS: [&str; 2] = POD_NAMESPACE_ANNOTATIONS;

/// A pod's pause container: it holds the pod's namespaces and runs no workload,
/// so it gets no GPU, even though the pod's annotations (its request among them)
/// were copied into its spec.
pub fn is_pod_sandbox(spec: &Spec) -> bool {
    CONTAINER_TYPE_KEYS
        .iter()
        .any(|key| spec.annotation(key) == Some(SANDBOX))
}

/// The id of the pod a container belongs to, where a CRI runtime recorded one.
pub fn sandbox_id(spec: &Spec) -> Option<String> {
    first_set(spec, &SANDBOX_ID_KEYS).map(|(_, id)| id.to_owned())
}

/// The pod's namespace as (annotation key, value), where a CRI runtime recorded one.
pub fn pod_namespace(spec: &Spec) -> Option<(&'static str, &str)> {
    first_set(spec, &NAMESPACE_KEYS)
}

/// The pod's name, where a CRI runtime recorded one.
pub fn pod_name(spec: &Spec) -> Option<&str> {
    first_set(spec, &POD_NAME_ANNOTATIONS).map(|(_, name)| name)
}

/// The container's name within its pod, where a CRI runtime recorded one.
pub fn container_name(spec: &Spec) -> Option<&str> {
    first_set(spec, &CONTAINER_NAME_ANNOTATIONS).map(|(_, name)| name)
}

/// Whether a CRI runtime says this container belongs to a Kubernetes pod.
pub fn in_pod(spec: &Spec) -> bool {
    pod_namespace(spec).is_some() || pod_name(spec).is_some()
}

fn first_set<'a>(spec: &'a Spec, keys: &[&'static str]) -> Option<(&'static str, &'a str)> {
    keys.iter().find_map(|key| {
        spec.annotation(key)
            .filter(|v| !v.is_empty())
            .map(|v| (*key, v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn annotated(annotations: serde_json::Value) -> Spec {
        Spec::from_value(json!({ "annotations": annotations })).unwrap()
    }

    #[test]
    fn the_pause_container_of_either_cri_runtime_is_a_sandbox() {
        for key in CONTAINER_TYPE_KEYS {
            assert!(is_pod_sandbox(&annotated(json!({key: "sandbox"}))), "{key}");
            assert!(
                !is_pod_sandbox(&annotated(json!({key: "container"}))),
                "{key}"
            );
        }
        assert!(!is_pod_sandbox(&annotated(json!({}))));
        assert!(!is_pod_sandbox(&annotated(
            json!({"io.kubernetes.cri.sandbox-id": "p"})
        )));
    }

    #[test]
    fn the_pod_and_its_namespace_are_named_by_either_cri_runtime() {
        for key in SANDBOX_ID_KEYS {
            assert_eq!(
                sandbox_id(&annotated(json!({key: "p"}))).as_deref(),
                Some("p")
            );
            assert_eq!(sandbox_id(&annotated(json!({key: ""}))), None);
        }
        for key in NAMESPACE_KEYS {
            assert_eq!(
                pod_namespace(&annotated(json!({key: "ns"}))),
                Some((key, "ns"))
            );
        }
        // containerd's key first.
        let both = annotated(json!({NAMESPACE_KEYS[1]: "b", NAMESPACE_KEYS[0]: "a"}));
        assert_eq!(pod_namespace(&both), Some((NAMESPACE_KEYS[0], "a")));
        assert_eq!(sandbox_id(&annotated(json!({}))), None);
    }

    #[test]
    fn the_pod_and_container_names_are_read_from_either_cri_runtime() {
        for (pod_key, container_key) in POD_NAME_ANNOTATIONS
            .into_iter()
            .zip(CONTAINER_NAME_ANNOTATIONS)
        {
            let spec = annotated(json!({pod_key: "web-0", container_key: "app"}));
            assert_eq!(
                (pod_name(&spec), container_name(&spec)),
                (Some("web-0"), Some("app"))
            );
            assert!(in_pod(&spec), "{pod_key}");
            assert_eq!(pod_name(&annotated(json!({pod_key: ""}))), None);
        }
        for key in NAMESPACE_KEYS {
            assert!(in_pod(&annotated(json!({key: "ns"}))), "{key}");
        }
        // A container name alone (no pod) is not a pod's container.
        assert!(!in_pod(&annotated(
            json!({CONTAINER_NAME_ANNOTATIONS[0]: "app"})
        )));
        assert!(!in_pod(&annotated(json!({}))));
    }
}
