//! What a container asks for, read from its OCI spec.
//!
//! Annotations first (`gpushare.io/*`), then `GPUSHARE_*` environment variables
//! when the policy accepts them (docker 20.10 has no annotations). Every error
//! names the key, the value and the accepted forms.

use gpushare_config::{RequestPolicy, TenantSource};
use gpushare_proto::quantity::{FRACTION_FORMS, GPU_FORMS, MEMORY_FORMS, PRIORITY_FORMS};
use gpushare_proto::{Fraction, GpuSelector, MemoryRequest, Priority, ReserveRequest};

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
}

impl ContainerRequest {
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
            pod: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("invalid gpushare request {key}={value:?}: expected {accepted}")]
    InvalidValue {
        key: String,
        value: String,
        accepted: &'static str,
    },
    #[error("unknown gpushare annotation {key:?}: accepted keys are {}", ANNOTATION_KEYS.join(", "))]
    UnknownKey { key: String },
    #[error("invalid gpushare request: compute-request {request} is above compute-limit {limit}")]
    RequestAboveLimit { request: String, limit: String },
    #[error("invalid gpushare request {key}={value:?}: this node takes a pod's tenant from its Kubernetes namespace (requests.tenant_from), not from the request; remove {key}")]
    TenantNotAccepted { key: String, value: String },
    #[error("invalid gpushare request {key}=high: {tenant} may not ask for high priority (allowed tenants: {allowed})")]
    HighPriorityNotAllowed {
        key: String,
        tenant: String,
        allowed: String,
    },
}

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
/// Written by gpushare itself; not requests.
const OUTPUT_ANNOTATIONS: [&str; 3] = [
    ANNOTATION_LEASE,
    ANNOTATION_ASSIGNED_GPUS,
    ANNOTATION_MARKER,
];

/// Reads the request; `Ok(None)` when the container asks for nothing.
pub fn from_spec(
    spec: &Spec,
    policy: &RequestPolicy,
) -> Result<Option<ContainerRequest>, RequestError> {
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
    let values: Vec<Option<(String, String)>> = FIELDS.iter().map(|&f| lookup(f)).collect();
    if values.iter().all(Option::is_none) {
        return Ok(None);
    }
    let [priority, memory, compute_request, compute_limit, gpu, tenant] =
        <[Option<(String, String)>; 6]>::try_from(values).expect("six fields");

    let priority = parse(priority, PRIORITY_FORMS)?.unwrap_or_default();
    let memory = parse(memory, MEMORY_FORMS)?;
    let compute_request_value =
        parse::<Fraction>(compute_request, FRACTION_FORMS)?.unwrap_or(Fraction::ZERO);
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
    let tenant = if from_namespace {
        if let Some((key, value)) = tenant {
            return Err(RequestError::TenantNotAccepted { key, value });
        }
        pod_namespace
    } else {
        tenant
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
    }))
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

    fn policy() -> RequestPolicy {
        RequestPolicy::default()
    }

    #[test]
    fn nothing_asked_is_none() {
        let s = spec(
            json!({"other.io/x": "1"}),
            &["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"],
        );
        assert_eq!(from_spec(&s, &policy()).unwrap(), None);
        assert_eq!(
            from_spec(&Spec::from_value(json!({})).unwrap(), &policy()).unwrap(),
            None
        );
    }

    #[test]
    fn annotations_win_over_env() {
        let s = spec(
            json!({"gpushare.io/memory": "2Gi"}),
            &["GPUSHARE_MEMORY=1Gi", "GPUSHARE_PRIORITY=high"],
        );
        let r = from_spec(&s, &policy()).unwrap().unwrap();
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
        assert_eq!(from_spec(&s, &p).unwrap(), None);
    }

    #[test]
    fn defaults() {
        let r = from_spec(&spec(json!({}), &["GPUSHARE_MEMORY=1Gi"]), &policy())
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
            let msg = from_spec(&s, &policy()).unwrap_err().to_string();
            assert!(
                msg.contains(key) && msg.contains(value) && msg.contains(form),
                "{msg}"
            );
        }
    }

    #[test]
    fn unknown_annotation_is_named_but_our_outputs_are_not_requests() {
        let msg = from_spec(&spec(json!({"gpushare.io/memroy": "1Gi"}), &[]), &policy())
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
        assert_eq!(from_spec(&s, &policy()).unwrap(), None);
    }

    #[test]
    fn request_above_limit() {
        let s = spec(
            json!({"gpushare.io/compute-request": "0.6", "gpushare.io/compute-limit": "0.5"}),
            &[],
        );
        assert!(matches!(
            from_spec(&s, &policy()),
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
            from_spec(&ok, &p).unwrap().unwrap().priority,
            Priority::High
        );
        let other = spec(
            json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "batch"}),
            &[],
        );
        let msg = from_spec(&other, &p).unwrap_err().to_string();
        assert!(
            msg.contains("\"batch\"") && msg.contains("inference"),
            "{msg}"
        );
        let anonymous = spec(json!({}), &["GPUSHARE_PRIORITY=high"]);
        let msg = from_spec(&anonymous, &p).unwrap_err().to_string();
        assert!(msg.contains("GPUSHARE_PRIORITY=high"), "{msg}");
        let low = spec(json!({"gpushare.io/priority": "low"}), &[]);
        assert!(from_spec(&low, &p).is_ok());
    }

    /// Issue 15: with the tenant taken from the pod's namespace, a container's
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
        let r = from_spec(&in_namespace("inference"), &p).unwrap().unwrap();
        assert_eq!(
            (r.priority, r.tenant.as_deref()),
            (Priority::High, Some("inference"))
        );
        let msg = from_spec(&in_namespace("batch"), &p)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("\"batch\""), "{msg}");
        // CRI-O's key serves as well.
        let crio = spec(
            json!({"gpushare.io/priority": "high", "io.kubernetes.pod.namespace": "inference"}),
            &[],
        );
        assert!(from_spec(&crio, &p).is_ok());
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
            let msg = from_spec(&forged, &p).unwrap_err().to_string();
            assert!(
                msg.contains("tenant_from") && msg.contains("inference"),
                "{msg}"
            );
        }
        // Outside Kubernetes there is no tenant, so no high priority on this node.
        let docker = spec(json!({}), &["GPUSHARE_PRIORITY=high"]);
        assert!(from_spec(&docker, &p).is_err());
        // "auto", the default: the pod's namespace where there is one...
        let auto = RequestPolicy {
            tenant_from: TenantSource::Auto,
            ..p.clone()
        };
        assert!(from_spec(&in_namespace("inference"), &auto).is_ok());
        assert!(from_spec(&in_namespace("batch"), &auto).is_err());
        let forged_pod = spec(
            json!({"gpushare.io/priority": "high", "gpushare.io/tenant": "inference",
                   "io.kubernetes.cri.sandbox-namespace": "batch"}),
            &[],
        );
        let msg = from_spec(&forged_pod, &auto).unwrap_err().to_string();
        assert!(msg.contains("tenant_from"), "{msg}");
        // ...and the request's tenant outside Kubernetes (its author is root already).
        let docker = spec(
            json!({}),
            &["GPUSHARE_PRIORITY=high", "GPUSHARE_TENANT=inference"],
        );
        assert_eq!(
            from_spec(&docker, &auto)
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
        let r = from_spec(&in_namespace("batch"), &request_only)
            .unwrap()
            .unwrap();
        assert_eq!(r.tenant, None);
    }

    #[test]
    fn first_env_entry_wins_like_getenv() {
        let s = spec(json!({}), &["GPUSHARE_MEMORY=1Gi", "GPUSHARE_MEMORY=2Gi"]);
        assert_eq!(
            from_spec(&s, &policy()).unwrap().unwrap().memory,
            Some(MemoryRequest::Bytes(1 << 30))
        );
    }

    proptest::proptest! {
        /// Whatever a user writes, parsing returns an answer (never panics), and an
        /// error always names the key it came from.
        #[test]
        fn any_value_is_handled(value in ".{0,40}", field in 0usize..6) {
            let (annotation, variable) = FIELDS[field];
            let s = spec(json!({ annotation: value.clone() }), &[&format!("{variable}={value}")]);
            if let Err(e) = from_spec(&s, &policy()) {
                let msg = e.to_string();
                proptest::prop_assert!(msg.contains(annotation) || msg.contains("compute-request"), "{}", msg);
            }
        }

        #[test]
        fn memory_in_units_round_trips(n in 1u64..1_000_000, unit in proptest::sample::select(vec!["Ki", "Mi", "Gi", "K", "M", "G", ""])) {
            let text = format!("{n}{unit}");
            let r = from_spec(&spec(json!({"gpushare.io/memory": text}), &[]), &policy()).unwrap().unwrap();
            let multiplier: u64 = match unit { "Ki" => 1 << 10, "Mi" => 1 << 20, "Gi" => 1 << 30, "K" => 1000, "M" => 1_000_000, "G" => 1_000_000_000, _ => 1 };
            proptest::prop_assert_eq!(r.memory, Some(MemoryRequest::Bytes(n * multiplier)));
        }
    }
}
