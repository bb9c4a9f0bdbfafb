//! deploy/kubernetes as the cluster would read it: every document a typed object
//! with no field lost, the embedded config.toml valid, and the names that tie the
//! files to each other and to gpushare's code in agreement.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpushare_config::Config;
use gpushare_deploy_check::{annotation_pattern_matches, load_dir, Document, Object};
use gpushare_types::kubernetes::{
    COMPUTE_RESOURCE, GRANT_ANNOTATION_PREFIX, GRANT_COMPUTE_ANNOTATION, GRANT_HIGH_ANNOTATION,
    GRANT_MEMORY_ANNOTATION, HIGH_RESOURCE, MEMORY_RESOURCE,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, ResourceQuota};
use k8s_openapi::api::node::v1::RuntimeClass;

const HANDLER: &str = "gpushare";
const RESOURCES: [&str; 3] = [MEMORY_RESOURCE, HIGH_RESOURCE, COMPUTE_RESOURCE];
const GRANT_KEYS: [&str; 3] = [
    GRANT_MEMORY_ANNOTATION,
    GRANT_HIGH_ANNOTATION,
    GRANT_COMPUTE_ANNOTATION,
];
/// What the init container installs onto the node (README "Kubernetes").
const INSTALLED: [&str; 5] = [
    "gpushare-runc",
    "gpushare-hook",
    "containerd-shim-gpushare-v2",
    "gpusharectl",
    "libgpushare.so",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

fn documents() -> Vec<Document> {
    load_dir(&repo().join("deploy/kubernetes")).unwrap_or_else(|e| panic!("{e}"))
}

fn all<'a, T>(documents: &'a [Document], pick: fn(&'a Object) -> Option<&'a T>) -> Vec<&'a T> {
    documents.iter().filter_map(|d| pick(&d.object)).collect()
}

fn daemonset(documents: &[Document]) -> &DaemonSet {
    let sets = all(documents, |o| match o {
        Object::DaemonSet(d) => Some(&**d),
        _ => None,
    });
    assert_eq!(sets.len(), 1, "one DaemonSet");
    sets[0]
}

fn config(documents: &[Document]) -> Config {
    let maps: Vec<&ConfigMap> = all(documents, |o| match o {
        Object::ConfigMap(c) => Some(&**c),
        _ => None,
    });
    assert_eq!(maps.len(), 1, "one ConfigMap");
    let text = maps[0]
        .data
        .as_ref()
        .and_then(|d| d.get("config.toml"))
        .expect("the ConfigMap carries config.toml");
    Config::parse(text, Path::new("deploy/kubernetes ConfigMap config.toml"))
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_document_is_a_known_kind_with_no_field_lost() {
    let documents = documents();
    let kinds: BTreeSet<&str> = documents
        .iter()
        .map(|d| match d.object {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ConfigMap(_) => "ConfigMap",
            Object::DaemonSet(_) => "DaemonSet",
            Object::RuntimeClass(_) => "RuntimeClass",
            Object::ResourceQuota(_) => "ResourceQuota",
            Object::Pod(_) => "Pod",
        })
        .collect();
    let expected: BTreeSet<&str> = gpushare_deploy_check::KINDS.into_iter().collect();
    assert_eq!(kinds, expected, "the deployment has each kind");
}

#[test]
fn the_configmap_config_parses_and_requires_grants() {
    let config = config(&documents());
    assert!(config.kubernetes.require_grant);
}

#[test]
fn the_daemonset_mounts_every_host_path_the_config_names() {
    let documents = documents();
    let config = config(&documents);
    let spec = daemonset(&documents)
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec");
    assert_eq!(
        spec.host_pid,
        Some(true),
        "the arbiter reads other pods' /proc"
    );
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let host_paths: BTreeSet<PathBuf> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| PathBuf::from(&h.path)))
        .collect();
    let parent = |p: &Path| p.parent().unwrap().to_owned();
    let needed = [
        ("runtime.library", parent(&config.runtime.library)),
        ("runtime.hook", parent(&config.runtime.hook)),
        ("arbiter.run_dir", config.arbiter.run_dir.clone()),
        ("arbiter.state_dir", config.arbiter.state_dir.clone()),
        (
            "kubernetes.device_plugin_dir",
            config.kubernetes.device_plugin_dir.clone(),
        ),
        (
            "kubernetes.pod_resources_socket",
            parent(&config.kubernetes.pod_resources_socket),
        ),
        (
            "the configuration",
            parent(Path::new(gpushare_config::DEFAULT_PATH)),
        ),
    ];
    for (key, path) in needed {
        assert!(
            host_paths.contains(&path),
            "{key} needs host path {path:?}; the DaemonSet has {host_paths:?}"
        );
    }
    // The runtime side defaults must be where the node's containerd configuration and
    // config.toml's defaults expect them, not only where the ConfigMap says.
    let defaults = Config::default();
    assert_eq!(config.runtime.library, defaults.runtime.library);
    assert_eq!(config.runtime.hook, defaults.runtime.hook);

    // The config's paths are host paths that the runtime side on the host and the
    // containers both compute from it (a lease's directory, the control socket), so
    // each container sees every host directory at the host's own path.
    let host_path_of = |volume: &str| {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone())
    };
    for container in &spec.containers {
        for mount in container.volume_mounts.iter().flatten() {
            if let Some(host) = host_path_of(&mount.name) {
                assert_eq!(
                    mount.mount_path, host,
                    "container {}: volume {} is host path {host} mounted elsewhere",
                    container.name, mount.name
                );
            }
        }
    }

    let install: &Container = &spec.init_containers.as_ref().expect("init container")[0];
    let script = install
        .command
        .iter()
        .flatten()
        .cloned()
        .collect::<String>();
    for name in INSTALLED {
        assert!(script.contains(name), "the init container installs {name}");
    }
    let containers: BTreeSet<&str> = spec
        .containers
        .iter()
        .flat_map(|c| c.command.iter().flatten())
        .filter_map(|arg| arg.rsplit('/').next())
        .collect();
    for program in ["gpushare-arbiter", "gpushare-kube"] {
        assert!(containers.contains(program), "a container runs {program}");
    }
}

#[test]
fn pods_name_a_runtime_class_that_exists_and_only_gpushare_resources() {
    let documents = documents();
    let classes: Vec<&RuntimeClass> = all(&documents, |o| match o {
        Object::RuntimeClass(r) => Some(&**r),
        _ => None,
    });
    for class in &classes {
        assert_eq!(
            class.handler, HANDLER,
            "RuntimeClass {:?}",
            class.metadata.name
        );
    }
    // kube-scheduler adds a RuntimeClass's nodeSelector to its pods: they must land
    // only where the DaemonSet installs the handler.
    let gpushare_nodes = daemonset(&documents)
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.node_selector.clone());
    for class in &classes {
        let selector = class
            .scheduling
            .as_ref()
            .and_then(|s| s.node_selector.clone());
        assert_eq!(
            selector, gpushare_nodes,
            "RuntimeClass {:?}",
            class.metadata.name
        );
    }
    let class_names: BTreeSet<&str> = classes
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    let pods: Vec<&Pod> = all(&documents, |o| match o {
        Object::Pod(p) => Some(&**p),
        _ => None,
    });
    assert!(!pods.is_empty());
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let spec = pod.spec.as_ref().expect("pod spec");
        let class = spec.runtime_class_name.as_deref().unwrap_or_default();
        assert!(
            class_names.contains(class),
            "pod {name}: runtimeClassName {class:?}"
        );
        for key in pod.metadata.annotations.iter().flatten().map(|(k, _)| k) {
            assert!(
                !key.starts_with(GRANT_ANNOTATION_PREFIX),
                "pod {name}: {key}: a pod cannot supply a grant"
            );
        }
        let mut asked = BTreeSet::new();
        for container in &spec.containers {
            let resources = container.resources.as_ref();
            for map in [
                resources.and_then(|r| r.limits.as_ref()),
                resources.and_then(|r| r.requests.as_ref()),
            ]
            .into_iter()
            .flatten()
            {
                for resource in map.keys().filter(|k| k.starts_with("gpushare.io/")) {
                    assert!(
                        RESOURCES.contains(&resource.as_str()),
                        "pod {name}: {resource}"
                    );
                    asked.insert(resource.as_str());
                }
            }
        }
        assert!(
            asked.contains(MEMORY_RESOURCE),
            "pod {name} asks for {MEMORY_RESOURCE}"
        );
    }
}

#[test]
fn the_quota_bounds_gpushare_resources_by_their_names() {
    let documents = documents();
    let quotas: Vec<&ResourceQuota> = all(&documents, |o| match o {
        Object::ResourceQuota(q) => Some(&**q),
        _ => None,
    });
    assert!(!quotas.is_empty());
    for quota in quotas {
        let hard: BTreeSet<&str> = quota
            .spec
            .as_ref()
            .and_then(|s| s.hard.as_ref())
            .into_iter()
            .flat_map(|h| h.keys().map(String::as_str))
            .collect();
        for key in &hard {
            if let Some(resource) = key
                .strip_prefix("requests.")
                .filter(|r| r.starts_with("gpushare.io/"))
            {
                assert!(RESOURCES.contains(&resource), "quota key {key}");
            }
        }
        for resource in [MEMORY_RESOURCE, HIGH_RESOURCE] {
            let key = format!("requests.{resource}");
            assert!(hard.contains(key.as_str()), "the quota bounds {key}");
        }
    }
}

/// The RuntimeClass handler is a runtime of the node's containerd configuration, and
/// that configuration lets grant annotations through container annotations only.
#[test]
fn containerd_configuration_has_the_handler_and_passes_grants_per_container_only() {
    let path = repo().join("config/containerd/config-v2.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let table: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let runtime = table["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
        .get(HANDLER)
        .unwrap_or_else(|| panic!("{path:?} has no runtime {HANDLER:?}"));
    let patterns = |key: &str| -> Vec<String> {
        runtime
            .get(key)
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
            .map(|v| v.as_str().expect("pattern").to_owned())
            .collect()
    };
    let passes = |list: &[String], key: &str| {
        list.iter().any(|p| {
            annotation_pattern_matches(p, key)
                .unwrap_or_else(|| panic!("{path:?}: pattern {p:?} is beyond this check"))
        })
    };
    let pod = patterns("pod_annotations");
    let container = patterns("container_annotations");
    for key in GRANT_KEYS {
        assert!(
            !passes(&pod, key),
            "{path:?}: pod_annotations {pod:?} pass {key}"
        );
        assert!(
            passes(&container, key),
            "{path:?}: container_annotations {container:?} drop {key}"
        );
    }
}
