//! deploy/kubernetes as the cluster would read it: every document a typed object
//! with no field lost, the embedded config.toml valid, and the names that tie the
//! files to each other and to gpushare's code in agreement.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpushare_config::Config;
use gpushare_deploy_check::ServiceMonitor;
use gpushare_deploy_check::{annotation_pattern_matches, load_dir, Document, Object};
use gpushare_types::kubernetes::{
    COMPUTE_RESOURCE, GRANT_ANNOTATION_PREFIX, GRANT_COMPUTE_ANNOTATION, GRANT_HIGH_ANNOTATION,
    GRANT_MEMORY_ANNOTATION, HIGH_RESOURCE, MEMORY_RESOURCE,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, ResourceQuota, Service};
use k8s_openapi::api::node::v1::RuntimeClass;

const HANDLER: &str = "gpushare";
const RESOURCES: [&str; 3] = [MEMORY_RESOURCE, HIGH_RESOURCE, COMPUTE_RESOURCE];
const GRANT_KEYS: [&str; 3] = [
    GRANT_MEMORY_ANNOTATION,
    GRANT_HIGH_ANNOTATION,
    GRANT_COMPUTE_ANNOTATION,
];
/// What the init container installs onto the node (docs/kubernetes.md, step 2), by name in
/// the image's node-setup.sh.
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

/// Every manifest: deploy/kubernetes, and the optional ones under its monitoring/.
fn documents() -> Vec<Document> {
    let dir = repo().join("deploy/kubernetes");
    [dir.clone(), dir.join("monitoring")]
        .iter()
        .flat_map(|d| load_dir(d).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// The one object of a kind.
fn only<'a, T>(
    documents: &'a [Document],
    kind: &str,
    pick: fn(&'a Object) -> Option<&'a T>,
) -> &'a T {
    let found = all(documents, pick);
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

/// The image's install/undo script, which the DaemonSet runs.
const NODE_SETUP: &str = "/opt/gpushare/node-setup.sh";

fn node_setup_script() -> String {
    let path = repo().join("deploy/kubernetes/image/node-setup.sh");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A shell variable's value as node-setup.sh assigns it (`NAME=value`, unquoted).
fn script_value(script: &str, name: &str) -> String {
    script
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("node-setup.sh assigns no {name}"))
        .to_owned()
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
            Object::Service(_) => "Service",
            Object::ServiceMonitor(_) => "ServiceMonitor",
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
    // The runtime side (library, hook, the configuration) is installed through the
    // host's root; what the containers themselves use is mounted at its host path.
    let needed = [
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
        ("the node's root, for node-setup.sh", PathBuf::from("/")),
    ];
    for (key, path) in needed {
        assert!(
            host_paths.contains(&path),
            "{key} needs host path {path:?}; the DaemonSet has {host_paths:?}"
        );
    }
    // The runtime side runs on the host with the ConfigMap's config.toml, so its paths
    // must be where node-setup.sh installs the library and the hook.
    let script = node_setup_script();
    let prefix = PathBuf::from(script_value(&script, "PREFIX"));
    assert_eq!(
        config.runtime.library,
        prefix.join(script_value(&script, "LIBRARY"))
    );
    assert_eq!(config.runtime.hook, prefix.join("bin/gpushare-hook"));
    assert_eq!(
        script_value(&script, "CONFIG"),
        gpushare_config::DEFAULT_PATH,
        "the runtime side reads the configuration node-setup.sh installs"
    );
    for name in INSTALLED {
        assert!(script.contains(name), "node-setup.sh installs {name}");
    }

    // The config's paths are host paths that the runtime side on the host and the
    // containers both compute from it (a lease's directory, the control socket), so
    // each container sees every host directory at the host's own path; the node's
    // root alone is mounted elsewhere (HOST_ROOT), for node-setup.sh.
    let host_path_of = |volume: &str| {
        spec.volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone())
    };
    for container in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        for mount in container.volume_mounts.iter().flatten() {
            match host_path_of(&mount.name).as_deref() {
                Some("/") => assert_eq!(
                    Some(mount.mount_path.as_str()),
                    env_value(container, "HOST_ROOT").as_deref(),
                    "container {}: the node's root is mounted where HOST_ROOT says",
                    container.name
                ),
                Some(host) => assert_eq!(
                    mount.mount_path, host,
                    "container {}: volume {} is host path {host} mounted elsewhere",
                    container.name, mount.name
                ),
                None => {}
            }
        }
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

fn env_value(container: &Container, name: &str) -> Option<String> {
    container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

fn pod_spec(daemonset: &DaemonSet) -> &k8s_openapi::api::core::v1::PodSpec {
    daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
}

fn container<'a>(daemonset: &'a DaemonSet, name: &str) -> &'a Container {
    pod_spec(daemonset)
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("a container {name}"))
}

#[test]
fn the_namespace_enforces_privileged_pod_security() {
    let documents = documents();
    let namespace = only(&documents, "Namespace", |o| match o {
        Object::Namespace(n) => Some(&**n),
        _ => None,
    });
    let labels = namespace.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("privileged"),
        "the arbiter pod is privileged with hostPID: {labels:?}"
    );
    let daemonset = daemonset(&documents);
    assert_eq!(
        daemonset.metadata.namespace, namespace.metadata.name,
        "the DaemonSet is in the labelled namespace"
    );
}

#[test]
fn every_container_runs_the_image_make_image_tags() {
    let documents = documents();
    let spec = pod_spec(daemonset(&documents));
    // scripts/build-image.sh tags the workspace version, which this crate inherits.
    let tag = format!("gpushare/node:{}", env!("CARGO_PKG_VERSION"));
    let build_image = std::fs::read_to_string(repo().join("scripts/build-image.sh")).unwrap();
    assert!(
        build_image.contains("docker.io/gpushare/node:$VERSION"),
        "scripts/build-image.sh tags gpushare/node with the version"
    );
    for container in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        assert_eq!(
            container.image.as_deref(),
            Some(tag.as_str()),
            "{}",
            container.name
        );
        assert_eq!(
            container.image_pull_policy.as_deref(),
            Some("IfNotPresent"),
            "{}: the image is imported on each node",
            container.name
        );
    }
}

#[test]
fn the_init_container_installs_and_the_arbiter_stopping_undoes_with_the_same_parameters() {
    let documents = documents();
    let daemonset = daemonset(&documents);
    let spec = pod_spec(daemonset);
    let install = &spec.init_containers.as_ref().expect("an init container")[0];
    assert_eq!(
        install.command.as_deref(),
        Some(&[NODE_SETUP.to_owned(), "install".to_owned()][..])
    );
    let arbiter = container(daemonset, "arbiter");
    let undo = arbiter
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.clone());
    assert_eq!(
        undo.as_deref(),
        Some(&[NODE_SETUP.to_owned(), "undo".to_owned()][..]),
        "deleting the DaemonSet runs the arbiter's preStop"
    );
    let script = node_setup_script();
    for name in ["HOST_ROOT", "CONTAINERD_CONFIG", "RESTART_CONTAINERD"] {
        assert!(
            script.contains(&format!("{name}=${{{name}:-")),
            "node-setup.sh takes {name}"
        );
        let installed = env_value(install, name);
        assert!(installed.is_some(), "the init container sets {name}");
        assert_eq!(installed, env_value(arbiter, name), "{name}");
    }
    // nsenter -t 1 reaches the host's pid 1 only in the host's pid namespace.
    assert_eq!(spec.host_pid, Some(true));
    for c in [install, arbiter] {
        assert_eq!(
            c.security_context.as_ref().and_then(|s| s.privileged),
            Some(true),
            "{}",
            c.name
        );
    }
}

#[test]
fn metrics_are_on_and_the_configmap_port_service_and_servicemonitor_agree() {
    let documents = documents();
    let config = config(&documents);
    let address = config
        .arbiter
        .metrics_address
        .as_deref()
        .expect("arbiter.metrics_address is set: metrics on by default");
    let (host, port) = address.rsplit_once(':').expect("host:port");
    assert_eq!(host, "0.0.0.0", "reachable on the pod's address");
    let port: i32 = port.parse().expect("a port number");
    assert_eq!(port, 9447, "no common GPU exporter's port");

    let daemonset = daemonset(&documents);
    let arbiter = container(daemonset, "arbiter");
    let metrics = arbiter
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("the arbiter has a container port named metrics");
    assert_eq!(metrics.container_port, port);

    let service: &Service = only(&documents, "Service", |o| match o {
        Object::Service(s) => Some(&**s),
        _ => None,
    });
    assert_eq!(service.metadata.namespace, daemonset.metadata.namespace);
    let service_spec = service.spec.as_ref().expect("service spec");
    let pod_labels = daemonset
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let selector = service_spec.selector.clone().unwrap_or_default();
    assert!(!selector.is_empty());
    for (key, value) in &selector {
        assert_eq!(
            pod_labels.get(key),
            Some(value),
            "the Service selects the pods"
        );
    }
    let service_port = service_spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("a Service port named metrics");
    assert_eq!(service_port.port, port);
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    assert_eq!(
        service_port.target_port,
        Some(IntOrString::String("metrics".into()))
    );

    let monitor: &ServiceMonitor = only(&documents, "ServiceMonitor", |o| match o {
        Object::ServiceMonitor(m) => Some(&**m),
        _ => None,
    });
    assert_eq!(monitor.metadata.namespace, service.metadata.namespace);
    let service_labels = service.metadata.labels.clone().unwrap_or_default();
    let wanted = monitor
        .spec
        .selector
        .match_labels
        .clone()
        .unwrap_or_default();
    assert!(!wanted.is_empty());
    for (key, value) in &wanted {
        assert_eq!(
            service_labels.get(key),
            Some(value),
            "the ServiceMonitor selects the Service"
        );
    }
    let endpoints: Vec<&str> = monitor
        .spec
        .endpoints
        .iter()
        .map(|e| e.port.as_str())
        .collect();
    assert_eq!(endpoints, ["metrics"]);
}
