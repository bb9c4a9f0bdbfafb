//! What a container asks for, read from its OCI spec.
//!
//! Annotations first (`gpushare.io/*`), then `GPUSHARE_*` environment variables
//! when the policy accepts them (docker 20.10 has no annotations). An image's
//! `ENV` cannot be told from its creator's `-e`, so the environment may ask only
//! what the node grants any container (low priority, no tenant, memory and a
//! compute request within `requests.env_*_ceiling`) unless the operator trusts it
//! (`requests.trust_environment`); beyond that come annotations, which the creator
//! sets through the engine's API, and the runtime profile an entry point was
//! started with (`Profile`: the operator's grant, and the container's defaults).
//! Memory is held to its ceiling once the GPUs are known
//! (`ContainerRequest::check_environment_memory`). Every error
//! names the key, the value and the accepted forms. An unknown key is refused, in
//! either place: a misspelt one would otherwise leave the container without its
//! share and without an error (`env_keys` says which variables are known).
//!
//! Kubernetes: the grants gpushare-kube's `Allocate` answers name
//! (`grant.gpushare.io/*`) are read from the spec's annotations only, never from
//! the environment: a pod's author writes its containers' environment, while
//! containerd passes grant keys through `container_annotations` alone, which only
//! kubelet and its device plugins fill. The pod and container names come from the
//! CRI runtime's own annotations.

use gpushare_config::{Config, KubernetesConfig, RequestPolicy, RuntimeProfile, TenantSource};
use gpushare_proto::quantity::{
    ambiguous_bytes, FRACTION_FORMS, GPU_FORMS, MEMORY_FORMS, PRIORITY_FORMS,
};
use gpushare_proto::{Fraction, GpuSelector, MemoryRequest, PodBinding, Priority, ReserveRequest};
use gpushare_types::kubernetes::{
    GrantId, GRANT_ANNOTATION_PREFIX, GRANT_COMPUTE_ANNOTATION, GRANT_HIGH_ANNOTATION,
    GRANT_ID_FORM, GRANT_MEMORY_ANNOTATION, MEMORY_RESOURCE,
};

use crate::env_keys::{self, OWN_VARIABLES};
use crate::kubernetes;
use crate::spec::Spec;
use crate::{ANNOTATION_ASSIGNED_GPUS, ANNOTATION_LEASE, ANNOTATION_MARKER};

#[derive(Debug, Clone, PartialEq)]
pub struct ContainerRequest {
    pub priority: Priority,
    /// None: the arbiter's configured default.
    pub memory: Option<MemoryRequest>,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
    pub gpu: GpuSelector,
    pub tenant: Option<String>,
    /// The container's pod and its grants, where Kubernetes named any.
    pub pod: Option<PodBinding>,
    /// The memory the environment asked for, still to be held to what it may ask
    /// ([`ContainerRequest::check_environment_memory`]): a fraction and a size
    /// compare only on a GPU.
    pub environment_memory: Option<EnvironmentMemory>,
}

/// Memory asked for by a `GPUSHARE_MEMORY` variable, and the most the environment
/// may ask for on this node.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvironmentMemory {
    key: String,
    value: String,
    asked: MemoryRequest,
    /// Within any of these (the node's ceiling, a runtime profile's memory) is allowed.
    ceilings: Vec<MemoryRequest>,
}

impl ContainerRequest {
    /// Refuses memory asked for by the environment beyond what it may ask on any of
    /// the node's GPUs (`allocatable`: the bytes each can allocate, as placement
    /// resolves fractions against them): the lease may land on any of them.
    pub fn check_environment_memory(&self, allocatable: &[u64]) -> Result<(), RequestError> {
        let Some(env) = &self.environment_memory else {
            return Ok(());
        };
        // No GPU listed: only what compares without one can be told.
        let gpus: Vec<Option<u64>> = if allocatable.is_empty() {
            vec![None]
        } else {
            allocatable.iter().copied().map(Some).collect()
        };
        let within = |gpu: &Option<u64>| {
            env.ceilings
                .iter()
                .any(|&ceiling| at_most(env.asked, ceiling, *gpu))
        };
        if gpus.iter().all(within) {
            return Ok(());
        }
        Err(RequestError::BeyondEnvironment {
            key: env.key.clone(),
            value: env.value.clone(),
            allowed: format!(
                "at most {} of GPU memory",
                env.ceilings
                    .iter()
                    .map(|c| memory_text(*c))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
            setting: "requests.env_memory_ceiling",
            annotation: MEMORY.0,
        })
    }

    /// `namespace`: the id space of `container_id` as the entry point knows it from
    /// its engine (never from the spec): see `ReserveRequest::namespace`.
    pub fn into_reserve(
        self,
        container_id: String,
        namespace: Option<String>,
        sandbox_id: Option<String>,
    ) -> ReserveRequest {
        ReserveRequest {
            container_id,
            namespace,
            sandbox_id,
            priority: self.priority,
            memory: self.memory,
            compute_request: self.compute_request,
            compute_limit: self.compute_limit,
            gpu: self.gpu,
            tenant: self.tenant,
            pod: self.pod,
        }
    }
}

/// Whether `asked` is no more than `ceiling`: directly when both are sizes or
/// both fractions, else on a GPU that can allocate `gpu` bytes.
fn at_most(asked: MemoryRequest, ceiling: MemoryRequest, gpu: Option<u64>) -> bool {
    match (asked, ceiling, gpu) {
        (MemoryRequest::Bytes(a), MemoryRequest::Bytes(c), _) => a <= c,
        (MemoryRequest::Fraction(a), MemoryRequest::Fraction(c), _) => a.get() <= c.get(),
        (_, _, Some(gpu)) => asked.resolve(gpu) <= ceiling.resolve(gpu),
        (_, _, None) => false,
    }
}

/// A memory amount as users write it: `4Gi`, `25%`.
fn memory_text(memory: MemoryRequest) -> String {
    match memory {
        MemoryRequest::Bytes(_) => memory.to_string(),
        MemoryRequest::Fraction(f) => format!("{}%", f.get() * 100.0),
    }
}

/// Every entry point reports these after "gpushare: ", and each key names gpushare
/// (gpushare.io/…, GPUSHARE_…): the messages do not say "gpushare" again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("invalid request {key}={value:?}: expected {accepted}")]
    InvalidValue {
        key: String,
        value: String,
        accepted: &'static str,
    },
    #[error("unknown annotation {key:?}: accepted keys are {}", ANNOTATION_KEYS.join(", "))]
    UnknownKey { key: String },
    #[error(
        "unknown variable {key}={value:?}{}: accepted keys are {}; gpushare's own {} and \
         the names in requests.allowed_env ({}) are let through too",
        did_you_mean(.suggestion),
        ENV_KEYS.join(", "),
        OWN_VARIABLES.join(", "),
        listed(.allowed)
    )]
    UnknownEnvKey {
        key: String,
        value: String,
        suggestion: Option<&'static str>,
        /// The node's `requests.allowed_env`.
        allowed: Vec<String>,
    },
    #[error("invalid request {key}={value:?}: the unit reads two ways, did you mean {}? Expected {MEMORY_FORMS}", .readings.join(" or "))]
    AmbiguousMemoryUnit {
        key: String,
        value: String,
        /// Each reading as its unambiguous spelling and its bytes: `4Gi (4294967296 bytes)`.
        readings: Vec<String>,
    },
    #[error("invalid request: compute-request {request} is above compute-limit {limit}")]
    RequestAboveLimit { request: String, limit: String },
    #[error("invalid request {key}={value:?}: this node takes a pod's tenant from its Kubernetes namespace (requests.tenant_from), not from the request; remove {key}")]
    TenantNotAccepted { key: String, value: String },
    #[error("invalid request {key}=high: {tenant} may not ask for high priority (allowed tenants: {allowed})")]
    HighPriorityNotAllowed {
        key: String,
        tenant: String,
        allowed: String,
    },
    #[error(
        "invalid request {key}={value:?}: the environment may ask for {allowed} on this node \
         ({setting}); an image's own environment cannot be told from its creator's, so more \
         comes only from the {annotation} annotation (docker 24's --annotation, podman's, \
         containerd's and Kubernetes') or a runtime profile the operator defined \
         (runtime.profiles, a docker runtime entry such as gpushare-high); where every \
         container's creator and image are trusted, the operator may set \
         requests.trust_environment = true"
    )]
    BeyondEnvironment {
        key: String,
        value: String,
        /// What the environment may ask for, in words: "low priority", "at most 25%".
        allowed: String,
        /// The setting (or profile) that decides it.
        setting: &'static str,
        annotation: &'static str,
    },
    #[error("unknown runtime profile {name:?}: this runtime entry names --gpushare-profile={name} but the configuration defines {} (runtime.profiles)", listed(.defined))]
    UnknownProfile { name: String, defined: Vec<String> },
    #[error("invalid grant {key}={value:?}: expected {GRANT_ID_FORM} (the id gpushare-kube's Allocate answer names)")]
    InvalidGrant { key: String, value: String },
    #[error("unknown grant annotation {key:?}: accepted keys are {}", GRANT_KEYS.join(", "))]
    UnknownGrantKey { key: String },
    #[error("this pod's container asks for a GPU share without a memory grant ({GRANT_MEMORY_ANNOTATION}) from gpushare-kube, and this node sets kubernetes.require_grant = true: ask for {MEMORY_RESOURCE} in the container's resources.limits")]
    GrantRequired,
}

fn did_you_mean(suggestion: &Option<&str>) -> String {
    suggestion.map_or_else(String::new, |s| format!(" (did you mean {s}?)"))
}

fn listed(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// The grant annotations, in `PodBinding::grants` order: memory (which decides
/// the GPU), high, compute.
const GRANT_KEYS: [&str; 3] = [
    GRANT_MEMORY_ANNOTATION,
    GRANT_HIGH_ANNOTATION,
    GRANT_COMPUTE_ANNOTATION,
];

const TENANT_FORMS: &str = "a name of 1 to 63 characters from a-z, 0-9, '-', '_' and '.'";

/// (annotation, environment variable) for each request field.
const PRIORITY: (&str, &str) = ("gpushare.io/priority", "GPUSHARE_PRIORITY");
const MEMORY: (&str, &str) = ("gpushare.io/memory", "GPUSHARE_MEMORY");
const COMPUTE_REQUEST: (&str, &str) = ("gpushare.io/compute-request", "GPUSHARE_COMPUTE_REQUEST");
const COMPUTE_LIMIT: (&str, &str) = ("gpushare.io/compute-limit", "GPUSHARE_COMPUTE_LIMIT");
const GPU: (&str, &str) = ("gpushare.io/gpu", "GPUSHARE_GPU");
const TENANT: (&str, &str) = ("gpushare.io/tenant", "GPUSHARE_TENANT");
const FIELDS: [(&str, &str); 6] = [
    PRIORITY,
    MEMORY,
    COMPUTE_REQUEST,
    COMPUTE_LIMIT,
    GPU,
    TENANT,
];
const ANNOTATION_KEYS: [&str; 6] = [
    PRIORITY.0,
    MEMORY.0,
    COMPUTE_REQUEST.0,
    COMPUTE_LIMIT.0,
    GPU.0,
    TENANT.0,
];
const ENV_KEYS: [&str; 6] = [
    PRIORITY.1,
    MEMORY.1,
    COMPUTE_REQUEST.1,
    COMPUTE_LIMIT.1,
    GPU.1,
    TENANT.1,
];
/// Written by gpushare itself; not requests.
const OUTPUT_ANNOTATIONS: [&str; 3] = [
    ANNOTATION_LEASE,
    ANNOTATION_ASSIGNED_GPUS,
    ANNOTATION_MARKER,
];

/// The runtime profile an entry point was started with (`--gpushare-profile`).
#[derive(Debug, Clone, Copy)]
pub struct Profile<'a> {
    pub name: &'a str,
    pub terms: &'a RuntimeProfile,
}

impl<'a> Profile<'a> {
    /// The profile `name` of `config`, or why there is none.
    pub fn named(config: &'a Config, name: &'a str) -> Result<Profile<'a>, RequestError> {
        match config.runtime.profiles.get(name) {
            Some(terms) => Ok(Profile { name, terms }),
            None => Err(RequestError::UnknownProfile {
                name: name.to_owned(),
                defined: config.runtime.profiles.keys().cloned().collect(),
            }),
        }
    }
}

/// Everything that decides what a container may ask for, from the configuration
/// and the entry point.
#[derive(Debug, Clone, Copy)]
pub struct Asking<'a> {
    pub policy: &'a RequestPolicy,
    pub kubernetes: &'a KubernetesConfig,
    /// `requests.env_memory_ceiling`, else `arbiter.default_memory`.
    pub env_memory_ceiling: MemoryRequest,
    pub profile: Option<Profile<'a>>,
}

impl<'a> Asking<'a> {
    pub fn new(config: &'a Config, profile: Option<Profile<'a>>) -> Asking<'a> {
        Asking {
            policy: &config.requests,
            kubernetes: &config.kubernetes,
            env_memory_ceiling: config
                .requests
                .env_memory_ceiling
                .unwrap_or(config.arbiter.default_memory),
            profile,
        }
    }
}

/// Where a request's value came from: only an annotation (or the operator's
/// profile) may ask beyond what the node grants any container.
fn from_environment(key: &str) -> bool {
    key.starts_with(gpushare_config::ENV_PREFIX)
}

/// Reads the request; `Ok(None)` when the container asks for nothing. A grant
/// annotation is a request by itself (its quota is the grant's), and so is a
/// runtime profile. What the environment asks is held to what the node grants
/// any container, raised by the profile, unless `requests.trust_environment`.
pub fn from_spec(spec: &Spec, asking: &Asking) -> Result<Option<ContainerRequest>, RequestError> {
    let (policy, kubernetes_config) = (asking.policy, asking.kubernetes);
    let profile = asking.profile.map(|p| p.terms);
    let held = !policy.trust_environment;
    let beyond = |key: &str, value: &str, allowed: String, setting: &'static str, annotation| {
        RequestError::BeyondEnvironment {
            key: key.to_owned(),
            value: value.to_owned(),
            allowed,
            setting,
            annotation,
        }
    };
    if let Some(key) = spec.annotation_keys().find(|key| {
        key.starts_with("gpushare.io/")
            && !ANNOTATION_KEYS.contains(key)
            && !OUTPUT_ANNOTATIONS.contains(key)
    }) {
        return Err(RequestError::UnknownKey {
            key: key.to_owned(),
        });
    }
    let env = spec.env();
    // Without accept_env no GPUSHARE_* variable is read, spelt right or not.
    if policy.accept_env {
        if let Some(unknown) =
            env_keys::first_unknown(env.entries(), &ENV_KEYS, policy, kubernetes::in_pod(spec))
        {
            return Err(RequestError::UnknownEnvKey {
                key: unknown.name.to_owned(),
                value: unknown.value.to_owned(),
                suggestion: unknown.suggestion,
                allowed: policy.allowed_env.clone(),
            });
        }
    }
    // (key as the user wrote it, value) per field, annotation winning over env.
    let lookup = |(annotation, variable): (&str, &str)| -> Option<(String, String)> {
        if let Some(v) = spec.annotation(annotation) {
            return Some((annotation.to_owned(), v.to_owned()));
        }
        if !policy.accept_env {
            return None;
        }
        // The first entry, as glibc's getenv returns it to the container.
        env.get(variable)
            .map(|v| (variable.to_owned(), v.to_owned()))
    };
    let grants = grants_from(spec)?;
    let values: Vec<Option<(String, String)>> = FIELDS.iter().map(|&f| lookup(f)).collect();
    if values.iter().all(Option::is_none) && grants.is_empty() && profile.is_none() {
        return Ok(None);
    }
    // With gpushare-kube deployed, kube-scheduler counts only what was granted: a
    // pod's share taken by annotations alone would land where it thinks room is free.
    // (A pod's pause container never gets here: admission leaves it alone first.)
    if kubernetes_config.require_grant
        && kubernetes::in_pod(spec)
        && spec.annotation(GRANT_MEMORY_ANNOTATION).is_none()
    {
        return Err(RequestError::GrantRequired);
    }
    let [priority, memory, compute_request, compute_limit, gpu, tenant] =
        <[Option<(String, String)>; 6]>::try_from(values).expect("six fields");
    let asked_by_env = |entry: &Option<(String, String)>| {
        entry
            .as_ref()
            .filter(|(key, _)| held && from_environment(key))
            .cloned()
    };

    let granted_priority = profile.and_then(|p| p.priority).unwrap_or_default();
    let priority_from_env = asked_by_env(&priority);
    let priority = parse(priority, PRIORITY_FORMS)?.unwrap_or(granted_priority);
    if let Some((key, value)) = priority_from_env {
        if priority > granted_priority {
            return Err(beyond(
                &key,
                &value,
                format!("{granted_priority} priority"),
                setting(asking, "requests.trust_environment"),
                PRIORITY.0,
            ));
        }
    }
    let environment_memory = asked_by_env(&memory);
    let memory = parse_memory(memory)?;
    let environment_memory = match (environment_memory, memory) {
        (Some((key, value)), Some(asked)) => Some(EnvironmentMemory {
            key,
            value,
            asked,
            ceilings: std::iter::once(asking.env_memory_ceiling)
                .chain(profile.and_then(|p| p.memory))
                .collect(),
        }),
        _ => None,
    };
    let memory = memory.or(profile.and_then(|p| p.memory));
    let granted_compute = profile.and_then(|p| p.compute_request);
    let compute_from_env = asked_by_env(&compute_request);
    let compute_request_value = parse::<Fraction>(compute_request, FRACTION_FORMS)?
        .or(granted_compute)
        .unwrap_or(Fraction::ZERO);
    if let Some((key, value)) = compute_from_env {
        let ceiling = policy
            .env_compute_request_ceiling
            .get()
            .max(granted_compute.map_or(0.0, Fraction::get));
        if compute_request_value.get() > ceiling {
            return Err(beyond(
                &key,
                &value,
                format!("a compute request of at most {ceiling}"),
                setting(asking, "requests.env_compute_request_ceiling"),
                COMPUTE_REQUEST.0,
            ));
        }
    }
    let compute_limit_value =
        parse::<Fraction>(compute_limit, FRACTION_FORMS)?.unwrap_or(Fraction::ONE);
    if compute_request_value.get() > compute_limit_value.get() {
        return Err(RequestError::RequestAboveLimit {
            request: compute_request_value.to_string(),
            limit: compute_limit_value.to_string(),
        });
    }
    let gpu = parse(gpu, GPU_FORMS)?.unwrap_or_default();
    let pod_namespace =
        kubernetes::pod_namespace(spec).map(|(key, value)| (key.to_owned(), value.to_owned()));
    let from_namespace = match policy.tenant_from {
        TenantSource::Request => false,
        TenantSource::KubernetesNamespace => true,
        TenantSource::Auto => pod_namespace.is_some(),
    };
    let granted_tenant = profile.and_then(|p| p.tenant.clone());
    let tenant = if from_namespace {
        if let Some((key, value)) = tenant {
            return Err(RequestError::TenantNotAccepted { key, value });
        }
        pod_namespace
    } else {
        if let Some((key, value)) = asked_by_env(&tenant) {
            if granted_tenant.as_ref() != Some(&value) {
                let allowed = match &granted_tenant {
                    Some(t) => format!("tenant {t:?} only"),
                    None => "no tenant".to_owned(),
                };
                return Err(beyond(
                    &key,
                    &value,
                    allowed,
                    setting(asking, "requests.trust_environment"),
                    TENANT.0,
                ));
            }
        }
        let profile_tenant = |t: String| {
            let name = asking.profile.map_or("", |p| p.name);
            (format!("runtime.profiles.{name}.tenant"), t)
        };
        tenant.or_else(|| granted_tenant.clone().map(profile_tenant))
    };
    let tenant_key = tenant.as_ref().map(|(k, _)| k.clone());
    let tenant = match tenant {
        Some((key, value)) if is_tenant_name(&value) => Some((key, value)),
        Some((key, value)) => {
            return Err(RequestError::InvalidValue {
                key,
                value,
                accepted: TENANT_FORMS,
            })
        }
        None => None,
    }
    .map(|(_, v)| v);

    if priority == Priority::High {
        if let Some(allowed) = &policy.high_priority_tenants {
            let who = tenant.clone().unwrap_or_default();
            if !allowed.contains(&who) {
                let key = lookup(PRIORITY)
                    .map(|(k, _)| k)
                    .unwrap_or_else(|| PRIORITY.0.to_owned());
                return Err(RequestError::HighPriorityNotAllowed {
                    key,
                    tenant: match &tenant {
                        Some(t) => format!("tenant {t:?}"),
                        None => format!(
                            "a container without {}",
                            tenant_key.unwrap_or_else(|| TENANT.0.to_owned())
                        ),
                    },
                    allowed: if allowed.is_empty() {
                        "none".into()
                    } else {
                        allowed.join(", ")
                    },
                });
            }
        }
    }
    Ok(Some(ContainerRequest {
        priority,
        memory,
        compute_request: compute_request_value,
        compute_limit: compute_limit_value,
        gpu,
        tenant,
        pod: pod_binding(spec, grants),
        environment_memory,
    }))
}

/// The setting that decides what the environment may ask: the runtime profile
/// where the container came through one, else the node's own `setting`.
fn setting(asking: &Asking, setting: &'static str) -> &'static str {
    match asking.profile {
        Some(_) => "runtime.profiles",
        None => setting,
    }
}

/// The grants the spec's annotations name, in `GRANT_KEYS` order; every
/// `grant.gpushare.io/` key must be one of those and name a well-formed id.
fn grants_from(spec: &Spec) -> Result<Vec<GrantId>, RequestError> {
    if let Some(key) = spec
        .annotation_keys()
        .find(|key| key.starts_with(GRANT_ANNOTATION_PREFIX) && !GRANT_KEYS.contains(key))
    {
        return Err(RequestError::UnknownGrantKey {
            key: key.to_owned(),
        });
    }
    GRANT_KEYS
        .iter()
        .filter_map(|&key| spec.annotation(key).map(|value| (key, value)))
        .map(|(key, value)| {
            GrantId::parse(value).map_err(|_| RequestError::InvalidGrant {
                key: key.to_owned(),
                value: value.to_owned(),
            })
        })
        .collect()
}

/// What the arbiter is told of the container's pod: None outside Kubernetes.
fn pod_binding(spec: &Spec, grants: Vec<GrantId>) -> Option<PodBinding> {
    let binding = PodBinding {
        namespace: kubernetes::pod_namespace(spec).map(|(_, ns)| ns.to_owned()),
        name: kubernetes::pod_name(spec).map(str::to_owned),
        container: kubernetes::container_name(spec).map(str::to_owned),
        grants,
    };
    (binding != PodBinding::default()).then_some(binding)
}

fn parse<T: std::str::FromStr>(
    entry: Option<(String, String)>,
    accepted: &'static str,
) -> Result<Option<T>, RequestError> {
    match entry {
        None => Ok(None),
        Some((key, value)) => value
            .parse()
            .map(Some)
            .map_err(|_| RequestError::InvalidValue {
                key,
                value,
                accepted,
            }),
    }
}

/// As `parse`, but a unit that reads two ways (`4GB`) is answered with both readings.
fn parse_memory(entry: Option<(String, String)>) -> Result<Option<MemoryRequest>, RequestError> {
    parse(entry, MEMORY_FORMS).map_err(|error| match error {
        RequestError::InvalidValue { key, value, .. } if !ambiguous_bytes(&value).is_empty() => {
            let readings = ambiguous_bytes(&value)
                .into_iter()
                .map(|(spelling, bytes)| format!("{spelling} ({bytes} bytes)"))
                .collect();
            RequestError::AmbiguousMemoryUnit {
                key,
                value,
                readings,
            }
        }
        other => other,
    })
}

fn is_tenant_name(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn spec(annotations: Value, env: &[&str]) -> Spec {
        Spec::from_value(
            json!({ "ociVersion": "1.0.2", "process": { "env": env }, "annotations": annotations }),
        )
        .unwrap()
    }

    /// The parsing tests read the environment as annotations are read; what it
    /// may ask by default is `the_environment_asks_*`'s subject.
    fn policy() -> RequestPolicy {
        RequestPolicy {
            trust_environment: true,
            ..RequestPolicy::default()
        }
    }

    /// The request under `policy`, with the `[kubernetes]` table's defaults.
    fn request_of(
        spec: &Spec,
        policy: &RequestPolicy,
    ) -> Result<Option<ContainerRequest>, RequestError> {
        request_in(spec, policy, &KubernetesConfig::default())
    }

    fn request_in(
        spec: &Spec,
        policy: &RequestPolicy,
        kubernetes: &KubernetesConfig,
    ) -> Result<Option<ContainerRequest>, RequestError> {
        let asking = Asking {
            policy,
            kubernetes,
            env_memory_ceiling: MemoryRequest::Fraction(Fraction::ONE),
            profile: None,
        };
        from_spec(spec, &asking)
    }

    #[test]
    fn nothing_asked_is_none() {
        let s = spec(
            json!({"other.io/x": "1"}),
            &["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"],
        );
        assert_eq!(request_of(&s, &policy()).unwrap(), None);
        assert_eq!(
            request_of(&Spec::from_value(json!({})).unwrap(), &policy()).unwrap(),
            None
        );
    }

    #[test]
    fn annotations_win_over_env() {
        let s = spec(
            json!({"gpushare.io/memory": "2Gi"}),
            &["GPUSHARE_MEMORY=1Gi", "GPUSHARE_PRIORITY=high"],
        );
        let r = request_of(&s, &policy()).unwrap().unwrap();
        assert_eq!(r.memory, Some(MemoryRequest::Bytes(2 << 30)));
        assert_eq!(r.priority, Priority::High);
    }

    #[test]
    fn env_ignored_when_policy_says_so() {
        let s = spec(json!({}), &["GPUSHARE_MEMORY=1Gi"]);
        let p = RequestPolicy {
            accept_env: false,
            ..policy()
        };
        assert_eq!(request_of(&s, &p).unwrap(), None);
    }

    #[test]
    fn defaults() {
        let r = request_of(&spec(json!({}), &["GPUSHARE_MEMORY=1Gi"]), &policy())
            .unwrap()
            .unwrap();
        assert_eq!(r.priority, Priority::Low);
        assert_eq!(r.gpu, GpuSelector::Count(1));
        assert_eq!((r.compute_request.get(), r.compute_limit.get()), (0.0, 1.0));
        assert_eq!(r.tenant, None);
    }

    #[test]
    fn errors_name_key_value_and_forms() {
        let cases = [
            (
                spec(json!({}), &["GPUSHARE_MEMORY=lots"]),
                "GPUSHARE_MEMORY",
                "\"lots\"",
                "512Mi",
            ),
            (
                spec(json!({"gpushare.io/memory": "lots"}), &[]),
                "gpushare.io/memory",
                "\"lots\"",
                "40%",
            ),
            (
                spec(json!({"gpushare.io/priority": "urgent"}), &[]),
                "gpushare.io/priority",
                "\"urgent\"",
                "`high`",
            ),
            (
                spec(json!({}), &["GPUSHARE_GPU=all"]),
                "GPUSHARE_GPU",
                "\"all\"",
                "count:N",
            ),
            (
                spec(json!({}), &["GPUSHARE_COMPUTE_LIMIT=2"]),
                "GPUSHARE_COMPUTE_LIMIT",
                "\"2\"",
                "0 to 1",
            ),
            (
                spec(json!({}), &["GPUSHARE_TENANT=Team A"]),
                "GPUSHARE_TENANT",
                "\"Team A\"",
                "a-z",
            ),
        ];
        for (s, key, value, form) in cases {
            let msg = request_of(&s, &policy()).unwrap_err().to_string();
            assert!(
                msg.contains(key) && msg.contains(value) && msg.contains(form),
                "{msg}"
            );
        }
    }

    #[test]
    fn unknown_annotation_is_named_but_our_outputs_are_not_requests() {
        let msg = request_of(&spec(json!({"gpushare.io/memroy": "1Gi"}), &[]), &policy())
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("gpushare.io/memroy") && msg.contains("gpushare.io/memory"),
            "{msg}"
        );
        let s = spec(
            json!({"gpushare.io/lease": "x", "gpushare.io/injected": "v1"}),
            &[],
        );
        assert_eq!(request_of(&s, &policy()).unwrap(), None);
    }

    #[test]
    fn request_above_limit() {
        let s = spec(
            json!({"gpushare.io/compute-request": "0.6", "gpushare.io/compute-limit": "0.5"}),
            &[],
        );
        assert!(matches!(
            request_of(&s, &policy()),
            Err(RequestError::RequestAboveLimit { .. })
        ));
    }

    #[test]
    fn high_priority_policy() {
        let p = RequestPolicy {
            high_priority_tenants: Some(vec!["inference".into()]),
            ..policy()
        };
        let ok = spec(
            json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "inference"}),
            &[],
        );
        assert_eq!(
            request_of(&ok, &p).unwrap().unwrap().priority,
            Priority::High
        );
        let other = spec(
            json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "batch"}),
            &[],
        );
        let msg = request_of(&other, &p).unwrap_err().to_string();
        assert!(
            msg.contains("\"batch\"") && msg.contains("inference"),
            "{msg}"
        );
        let anonymous = spec(json!({}), &["GPUSHARE_PRIORITY=high"]);
        let msg = request_of(&anonymous, &p).unwrap_err().to_string();
        assert!(msg.contains("GPUSHARE_PRIORITY=high"), "{msg}");
        let low = spec(json!({"gpushare.io/priority": "low"}), &[]);
        assert!(request_of(&low, &p).is_ok());
    }

    /// Trusted tenants: with the tenant taken from the pod's namespace, a container's
    /// author can no longer name the tenant that may ask for high priority.
    #[test]
    fn the_tenant_can_come_from_the_pods_namespace_and_then_not_from_the_request() {
        let p = RequestPolicy {
            high_priority_tenants: Some(vec!["inference".into()]),
            tenant_from: TenantSource::KubernetesNamespace,
            ..policy()
        };
        let in_namespace = |ns: &str| {
            spec(
                json!({"gpushare.io/priority": "high", "io.kubernetes.cri.sandbox-namespace": ns}),
                &[],
            )
        };
        let r = request_of(&in_namespace("inference"), &p).unwrap().unwrap();
        assert_eq!(
            (r.priority, r.tenant.as_deref()),
            (Priority::High, Some("inference"))
        );
        let msg = request_of(&in_namespace("batch"), &p)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("\"batch\""), "{msg}");
        // CRI-O's key serves as well.
        let crio = spec(
            json!({"gpushare.io/priority": "high", "io.kubernetes.pod.namespace": "inference"}),
            &[],
        );
        assert!(request_of(&crio, &p).is_ok());
        // Naming a tenant is refused outright, annotation or environment, even the right one.
        for forged in [
            spec(
                json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "inference",
                       "io.kubernetes.cri.sandbox-namespace": "batch"}),
                &[],
            ),
            spec(
                json!({}),
                &["GPUSHARE_PRIORITY=high", "GPUSHARE_TENANT=inference"],
            ),
        ] {
            let msg = request_of(&forged, &p).unwrap_err().to_string();
            assert!(
                msg.contains("tenant_from") && msg.contains("inference"),
                "{msg}"
            );
        }
        // Outside Kubernetes there is no tenant, so no high priority on this node.
        let docker = spec(json!({}), &["GPUSHARE_PRIORITY=high"]);
        assert!(request_of(&docker, &p).is_err());
        // "auto", the default: the pod's namespace where there is one...
        let auto = RequestPolicy {
            tenant_from: TenantSource::Auto,
            ..p.clone()
        };
        assert!(request_of(&in_namespace("inference"), &auto).is_ok());
        assert!(request_of(&in_namespace("batch"), &auto).is_err());
        let forged_pod = spec(
            json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "inference",
                   "io.kubernetes.cri.sandbox-namespace": "batch"}),
            &[],
        );
        let msg = request_of(&forged_pod, &auto).unwrap_err().to_string();
        assert!(msg.contains("tenant_from"), "{msg}");
        // ...and the request's tenant outside Kubernetes (its author is root already).
        let docker = spec(
            json!({}),
            &["GPUSHARE_PRIORITY=high", "GPUSHARE_TENANT=inference"],
        );
        assert_eq!(
            request_of(&docker, &auto)
                .unwrap()
                .unwrap()
                .tenant
                .as_deref(),
            Some("inference")
        );
        // "request": the request alone, whatever the pod's namespace.
        let request_only = RequestPolicy {
            tenant_from: TenantSource::Request,
            ..policy()
        };
        let r = request_of(&in_namespace("batch"), &request_only)
            .unwrap()
            .unwrap();
        assert_eq!(r.tenant, None);
    }

    #[test]
    fn first_env_entry_wins_like_getenv() {
        let s = spec(json!({}), &["GPUSHARE_MEMORY=1Gi", "GPUSHARE_MEMORY=2Gi"]);
        assert_eq!(
            request_of(&s, &policy()).unwrap().unwrap().memory,
            Some(MemoryRequest::Bytes(1 << 30))
        );
    }

    const POD: [(&str, &str); 3] = [
        ("io.kubernetes.cri.sandbox-namespace", "team-a"),
        ("io.kubernetes.cri.sandbox-name", "trainer-0"),
        ("io.kubernetes.cri.container-name", "app"),
    ];

    /// `annotations` plus the names containerd's CRI plugin writes for a pod's container.
    fn in_pod(mut annotations: Value) -> Value {
        for (key, value) in POD {
            annotations[key] = json!(value);
        }
        annotations
    }

    fn require_grant() -> KubernetesConfig {
        KubernetesConfig {
            require_grant: true,
            ..KubernetesConfig::default()
        }
    }

    #[test]
    fn a_grant_annotation_alone_is_a_request_bound_to_its_pod() {
        let s = spec(in_pod(json!({GRANT_MEMORY_ANNOTATION: "g-1"})), &[]);
        let r = request_of(&s, &policy()).unwrap().unwrap();
        assert_eq!(r.memory, None, "the quota is the grant's");
        assert_eq!(
            r.pod,
            Some(PodBinding {
                namespace: Some("team-a".into()),
                name: Some("trainer-0".into()),
                container: Some("app".into()),
                grants: vec![GrantId("g-1".into())],
            })
        );
        assert_eq!(
            r.into_reserve("c1".into(), None, None).pod.unwrap().grants,
            [GrantId("g-1".into())],
            "the reserve carries the binding"
        );
        // Outside a pod too (the id is the authority), with no names.
        let bare = spec(json!({GRANT_HIGH_ANNOTATION: "g-2"}), &[]);
        assert_eq!(
            request_of(&bare, &policy()).unwrap().unwrap().pod,
            Some(PodBinding {
                grants: vec![GrantId("g-2".into())],
                ..PodBinding::default()
            })
        );
    }

    #[test]
    fn grants_are_never_taken_from_the_environment() {
        use gpushare_types::kubernetes::{GRANT_COMPUTE_ENV, GRANT_HIGH_ENV, GRANT_MEMORY_ENV};
        let env = [
            format!("{GRANT_MEMORY_ENV}=g-1"),
            format!("{GRANT_HIGH_ENV}=g-2"),
            format!("{GRANT_COMPUTE_ENV}=g-3"),
        ];
        let env: Vec<&str> = env.iter().map(String::as_str).collect();
        assert_eq!(
            request_of(&spec(in_pod(json!({})), &env), &policy()),
            Ok(None)
        );
        let asking = spec(in_pod(json!({"gpushare.io/memory": "1Gi"})), &env);
        let pod = request_of(&asking, &policy())
            .unwrap()
            .unwrap()
            .pod
            .unwrap();
        assert!(pod.grants.is_empty(), "{pod:?}");
        // Nor does an environment grant satisfy require_grant.
        assert_eq!(
            request_in(&asking, &policy(), &require_grant()),
            Err(RequestError::GrantRequired)
        );
    }

    #[test]
    fn every_grant_is_bound_memory_first_whatever_the_annotation_order() {
        let s = spec(
            json!({GRANT_COMPUTE_ANNOTATION: "g-c", GRANT_HIGH_ANNOTATION: "g-h", GRANT_MEMORY_ANNOTATION: "g-m",
                   "gpushare.io/priority": "high"}),
            &[],
        );
        let r = request_of(&s, &policy()).unwrap().unwrap();
        assert_eq!(
            r.priority,
            Priority::High,
            "the request's own fields still apply"
        );
        let grants: Vec<String> = r.pod.unwrap().grants.into_iter().map(|g| g.0).collect();
        assert_eq!(grants, ["g-m", "g-h", "g-c"]);
    }

    #[test]
    fn a_malformed_grant_id_names_the_key_the_value_and_the_form() {
        for key in GRANT_KEYS {
            for bad in ["", "../g", "G-1", "g 1", &"g".repeat(65)] {
                let s = spec(json!({key: bad, "gpushare.io/memory": "1Gi"}), &[]);
                let error = request_of(&s, &policy()).unwrap_err();
                assert_eq!(
                    error,
                    RequestError::InvalidGrant {
                        key: key.into(),
                        value: bad.into()
                    }
                );
                let msg = error.to_string();
                assert!(
                    msg.contains(key)
                        && msg.contains(&format!("{bad:?}"))
                        && msg.contains(GRANT_ID_FORM),
                    "{msg}"
                );
            }
        }
    }

    #[test]
    fn an_unknown_grant_key_names_it_and_the_accepted_ones() {
        for key in [
            "grant.gpushare.io/memory",
            "grant.gpushare.io/",
            "grant.gpushare.io/ID",
        ] {
            let s = spec(json!({key: "g-1", GRANT_MEMORY_ANNOTATION: "g-2"}), &[]);
            let msg = request_of(&s, &policy()).unwrap_err().to_string();
            assert!(msg.contains(&format!("{key:?}")), "{msg}");
            for accepted in GRANT_KEYS {
                assert!(msg.contains(accepted), "{msg}");
            }
        }
        // Other vendors' keys that merely contain the prefix are not ours.
        let s = spec(
            json!({"x.grant.gpushare.io/id": "1", "gpushare.io/memory": "1Gi"}),
            &[],
        );
        assert!(request_of(&s, &policy()).is_ok());
    }

    #[test]
    fn the_pod_is_named_without_grants_and_not_at_all_outside_kubernetes() {
        let pod = spec(in_pod(json!({"gpushare.io/memory": "1Gi"})), &[]);
        let binding = request_of(&pod, &policy()).unwrap().unwrap().pod.unwrap();
        assert_eq!(
            (
                binding.namespace.as_deref(),
                binding.name.as_deref(),
                binding.container.as_deref()
            ),
            (Some("team-a"), Some("trainer-0"), Some("app"))
        );
        assert!(binding.grants.is_empty());
        // CRI-O's keys.
        let crio = spec(
            json!({"gpushare.io/memory": "1Gi", "io.kubernetes.pod.namespace": "ns",
                   "io.kubernetes.pod.name": "p", "io.kubernetes.container.name": "c"}),
            &[],
        );
        let binding = request_of(&crio, &policy()).unwrap().unwrap().pod.unwrap();
        assert_eq!(
            (binding.namespace, binding.name, binding.container),
            (Some("ns".into()), Some("p".into()), Some("c".into()))
        );
        let docker = spec(json!({}), &["GPUSHARE_MEMORY=1Gi"]);
        assert_eq!(request_of(&docker, &policy()).unwrap().unwrap().pod, None);
    }

    #[test]
    fn require_grant_refuses_a_pods_share_without_a_memory_grant() {
        let k = require_grant();
        let refused = [
            spec(in_pod(json!({"gpushare.io/memory": "1Gi"})), &[]),
            spec(in_pod(json!({})), &["GPUSHARE_MEMORY=1Gi"]),
            // A high or compute grant decides no GPU memory.
            spec(in_pod(json!({GRANT_HIGH_ANNOTATION: "g-h"})), &[]),
            // A pod name or namespace alone marks a pod's container.
            spec(
                json!({"gpushare.io/memory": "1Gi", "io.kubernetes.pod.name": "p"}),
                &[],
            ),
            spec(
                json!({"gpushare.io/memory": "1Gi", "io.kubernetes.cri.sandbox-namespace": "ns"}),
                &[],
            ),
        ];
        for s in refused {
            let error = request_in(&s, &policy(), &k).unwrap_err();
            assert_eq!(error, RequestError::GrantRequired);
            let msg = error.to_string();
            assert!(
                msg.contains("kubernetes.require_grant")
                    && msg.contains(GRANT_MEMORY_ANNOTATION)
                    && msg.contains(MEMORY_RESOURCE),
                "{msg}"
            );
        }
        let granted = spec(
            in_pod(json!({GRANT_MEMORY_ANNOTATION: "g-m", "gpushare.io/priority": "high"})),
            &[],
        );
        assert!(request_in(&granted, &policy(), &k).unwrap().is_some());
        // A pod's container asking for nothing, and containers outside Kubernetes, as before.
        assert_eq!(
            request_in(&spec(in_pod(json!({})), &[]), &policy(), &k),
            Ok(None)
        );
        let docker = spec(json!({"gpushare.io/memory": "1Gi"}), &[]);
        assert!(request_in(&docker, &policy(), &k).unwrap().is_some());
        // Off (the default): the same pod container is admitted on its annotation.
        let pod = spec(in_pod(json!({"gpushare.io/memory": "1Gi"})), &[]);
        assert!(request_of(&pod, &policy()).unwrap().is_some());
    }

    /// Misspelt variables: a misspelt variable used to be ignored, leaving the container
    /// without its share (`GPUSHARE_MEMROY`) or at low priority (`GPUSHARE_PRIORTY`).
    #[test]
    fn an_unknown_variable_is_refused_naming_it_its_value_and_the_accepted_keys() {
        for (entry, key, value, suggestion) in [
            (
                "GPUSHARE_MEMROY=4Gi",
                "GPUSHARE_MEMROY",
                "4Gi",
                Some("GPUSHARE_MEMORY"),
            ),
            (
                "GPUSHARE_PRIORTY=high",
                "GPUSHARE_PRIORTY",
                "high",
                Some("GPUSHARE_PRIORITY"),
            ),
            (
                "gpushare_memory=4Gi",
                "gpushare_memory",
                "4Gi",
                Some("GPUSHARE_MEMORY"),
            ),
            ("GPUSHARE_COLOUR=red", "GPUSHARE_COLOUR", "red", None),
        ] {
            // Alone (it used to mean no request at all), and beside a good request.
            for env in [vec![entry], vec!["GPUSHARE_GPU=count:1", entry]] {
                let error = request_of(&spec(json!({}), &env), &policy()).unwrap_err();
                assert_eq!(
                    error,
                    RequestError::UnknownEnvKey {
                        key: key.into(),
                        value: value.into(),
                        suggestion,
                        allowed: vec![],
                    }
                );
                let msg = error.to_string();
                assert!(msg.contains(&format!("{key}={value:?}")), "{msg}");
                for accepted in ENV_KEYS.iter().chain(&OWN_VARIABLES) {
                    assert!(msg.contains(accepted), "{msg}");
                }
                assert!(msg.contains("requests.allowed_env (none)"), "{msg}");
                match suggestion {
                    Some(s) => assert!(msg.contains(&format!("(did you mean {s}?)")), "{msg}"),
                    None => assert!(!msg.contains("did you mean"), "{msg}"),
                }
            }
        }
        // Annotations are checked first, as before.
        let both = spec(
            json!({"gpushare.io/colour": "red"}),
            &["GPUSHARE_COLOUR=red"],
        );
        assert!(matches!(
            request_of(&both, &policy()),
            Err(RequestError::UnknownKey { .. })
        ));
    }

    #[test]
    fn allowed_env_lets_other_tools_variables_through_and_names_itself_when_they_are_not() {
        let p = RequestPolicy {
            allowed_env: vec!["GPUSHARE_MYTOOL_*".into(), "GPUSHARE_BUILD".into()],
            ..policy()
        };
        let s = spec(
            json!({}),
            &[
                "GPUSHARE_MYTOOL_MODE=fast",
                "GPUSHARE_BUILD=7",
                "GPUSHARE_MEMORY=1Gi",
            ],
        );
        let r = request_of(&s, &p).unwrap().unwrap();
        assert_eq!(r.memory, Some(MemoryRequest::Bytes(1 << 30)));
        let alone = spec(json!({}), &["GPUSHARE_MYTOOL_MODE=fast"]);
        assert_eq!(request_of(&alone, &p), Ok(None));
        let other = spec(json!({}), &["GPUSHARE_BUILD_ID=7"]);
        let msg = request_of(&other, &p).unwrap_err().to_string();
        assert!(
            msg.contains("requests.allowed_env (GPUSHARE_MYTOOL_*, GPUSHARE_BUILD)"),
            "{msg}"
        );
    }

    #[test]
    fn without_accept_env_no_variable_is_read_or_refused() {
        let p = RequestPolicy {
            accept_env: false,
            ..policy()
        };
        let s = spec(json!({}), &["GPUSHARE_MEMROY=4Gi"]);
        assert_eq!(request_of(&s, &p), Ok(None));
    }

    /// A spec that already carries what the runtime writes into a sharing container
    /// (an image committed from one keeps its environment, without the marker) and
    /// what gpushare-kube and the test suites set, is read as any other.
    #[test]
    fn gpushares_own_variables_are_never_refused() {
        use gpushare_config::{ArbiterConfig, RuntimeConfig};
        let lease = crate::mutate::tests::lease();
        let paths = crate::mutate::HostPaths::new(
            &RuntimeConfig::default(),
            &ArbiterConfig::default(),
            &lease,
        );
        let mut edited = spec(json!({}), &["PATH=/bin", "GPUSHARE_MEMORY=1Gi"]);
        crate::mutate::apply_lease(&mut edited, &lease, &paths).unwrap();
        let written: Vec<String> = edited.env().entries().map(str::to_owned).collect();
        let ours = written
            .iter()
            .filter(|e| e.starts_with("GPUSHARE_"))
            .count();
        assert!(
            ours >= 5,
            "the edit wrote gpushare's variables: {written:?}"
        );
        let mut env: Vec<&str> = written.iter().map(String::as_str).collect();
        env.extend([
            "GPUSHARE_GRANT=g-1",
            "GPUSHARE_GRANT_HIGH=g-2",
            "GPUSHARE_GRANT_COMPUTE=g-3",
            "GPUSHARE_LOG=info",
            "GPUSHARE_CONFIG=/etc/gpushare/config.toml",
        ]);
        let committed = spec(json!({}), &env);
        let r = request_of(&committed, &policy()).unwrap().unwrap();
        assert_eq!(r.memory, Some(MemoryRequest::Bytes(1 << 30)));
        // Without the request, nothing is asked for.
        let env: Vec<&str> = env
            .into_iter()
            .filter(|e| !e.starts_with("GPUSHARE_MEMORY="))
            .collect();
        assert_eq!(request_of(&spec(json!({}), &env), &policy()), Ok(None));
    }

    /// kubelet's service links for a Service named `gpushare-metrics`, in a pod.
    #[test]
    fn service_links_in_a_pod_are_not_refused() {
        let env = [
            "GPUSHARE_METRICS_SERVICE_HOST=10.0.0.1",
            "GPUSHARE_METRICS_PORT_9400_TCP=tcp://10.0.0.1:9400",
        ];
        assert_eq!(
            request_of(&spec(in_pod(json!({})), &env), &policy()),
            Ok(None)
        );
        assert!(request_of(&spec(json!({}), &env), &policy()).is_err());
    }

    #[test]
    fn memory_spellings_table() {
        let gi = |n: u64| Some(MemoryRequest::Bytes(n << 30));
        for (value, want) in [
            ("4Gi", gi(4)),
            ("4gi", gi(4)),
            ("4GI", gi(4)),
            ("4GiB", gi(4)),
            ("4gib", gi(4)),
            ("4G", Some(MemoryRequest::Bytes(4_000_000_000))),
            ("4096Mi", gi(4)),
            ("4096mib", gi(4)),
        ] {
            for s in [
                spec(json!({}), &[format!("GPUSHARE_MEMORY={value}").as_str()]),
                spec(json!({"gpushare.io/memory": value}), &[]),
            ] {
                let r = request_of(&s, &policy()).unwrap().unwrap();
                assert_eq!(r.memory, want, "{value}");
            }
        }
        for (value, readings) in [
            ("4GB", "4Gi (4294967296 bytes) or 4G (4000000000 bytes)"),
            ("4gb", "4Gi (4294967296 bytes) or 4G (4000000000 bytes)"),
            ("4g", "4Gi (4294967296 bytes) or 4G (4000000000 bytes)"),
            ("512MB", "512Mi (536870912 bytes) or 512M (512000000 bytes)"),
            ("512m", "512Mi (536870912 bytes) or 512M (512000000 bytes)"),
        ] {
            let s = spec(json!({}), &[format!("GPUSHARE_MEMORY={value}").as_str()]);
            let error = request_of(&s, &policy()).unwrap_err();
            assert!(
                matches!(&error, RequestError::AmbiguousMemoryUnit { key, .. } if key == "GPUSHARE_MEMORY"),
                "{error:?}"
            );
            let msg = error.to_string();
            assert!(
                msg.contains(&format!("GPUSHARE_MEMORY={value:?}"))
                    && msg.contains(&format!("did you mean {readings}?"))
                    && msg.contains(MEMORY_FORMS),
                "{msg}"
            );
        }
        // Not a unit at all: the plain error, as before.
        let s = spec(json!({}), &["GPUSHARE_MEMORY=4Gx"]);
        assert!(matches!(
            request_of(&s, &policy()),
            Err(RequestError::InvalidValue { .. })
        ));
    }

    #[test]
    fn memory_is_compared_directly_in_one_kind_and_on_a_gpu_across_kinds() {
        let bytes = MemoryRequest::Bytes;
        let share = |f| MemoryRequest::Fraction(Fraction::new(f).unwrap());
        const GI: u64 = 1 << 30;
        for (asked, ceiling, gpu, within) in [
            (bytes(4 * GI), bytes(4 * GI), None, true),
            (bytes(4 * GI + 1), bytes(4 * GI), None, false),
            (share(0.25), share(0.25), None, true),
            (share(0.26), share(0.25), None, false),
            // Across kinds only a GPU tells.
            (bytes(4 * GI), share(0.25), None, false),
            (bytes(4 * GI), share(0.25), Some(16 * GI), true),
            (bytes(4 * GI), share(0.25), Some(15 * GI), false),
            (share(0.5), bytes(8 * GI), Some(16 * GI), true),
            (share(0.5), bytes(8 * GI), Some(17 * GI), false),
        ] {
            assert_eq!(
                at_most(asked, ceiling, gpu),
                within,
                "{asked} within {ceiling} on {gpu:?}"
            );
        }
        assert_eq!(memory_text(share(0.25)), "25%");
        assert_eq!(memory_text(bytes(4 * GI)), "4Gi");
    }

    proptest::proptest! {
        /// Whatever a user writes, parsing returns an answer (never panics), and an
        /// error always names the key it came from.
        #[test]
        fn any_value_is_handled(value in ".{0,40}", field in 0usize..6) {
            let (annotation, variable) = FIELDS[field];
            let s = spec(json!({ annotation: value.clone() }), &[&format!("{variable}={value}")]);
            if let Err(e) = request_of(&s, &policy()) {
                let msg = e.to_string();
                proptest::prop_assert!(msg.contains(annotation) || msg.contains("compute-request"), "{}", msg);
            }
        }

        #[test]
        fn memory_in_units_round_trips(n in 1u64..1_000_000, unit in proptest::sample::select(vec!["Ki", "Mi", "Gi", "K", "M", "G", ""])) {
            let text = format!("{n}{unit}");
            let r = request_of(&spec(json!({"gpushare.io/memory": text}), &[]), &policy()).unwrap().unwrap();
            let multiplier: u64 = match unit { "Ki" => 1 << 10, "Mi" => 1 << 20, "Gi" => 1 << 30, "K" => 1000, "M" => 1_000_000, "G" => 1_000_000_000, _ => 1 };
            proptest::prop_assert_eq!(r.memory, Some(MemoryRequest::Bytes(n * multiplier)));
        }
    }
}
