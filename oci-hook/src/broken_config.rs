//! A configuration file that cannot be used (a typo, a half-saved edit) must not
//! stop every container on the node: it fails only those that ask something of
//! gpushare. Without a configuration there is no policy to read a request with, so
//! the decision is the spec's alone and errs towards asking: any `gpushare.io/` or
//! `grant.gpushare.io/` annotation, or any `GPUSHARE_*` variable that is not one
//! gpushare writes itself (a spec handed back from a sharing container carries
//! those) nor, in a pod, one of kubelet's service links. A pod's pause container
//! never asks. A container that asks is refused naming the file, its problems and
//! how to check it; one that does not runs untouched, and the entry point logs why
//! gpushare let it through.

use gpushare_config::{ConfigError, RequestPolicy};
use gpushare_types::kubernetes::GRANT_ANNOTATION_PREFIX;

use crate::env_keys;
use crate::kubernetes;
use crate::spec::Spec;

/// What in a spec asks something of gpushare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    Annotation(String),
    Variable(String),
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asked::Annotation(key) => write!(f, "annotation {key}"),
            Asked::Variable(name) => write!(f, "variable {name}"),
        }
    }
}

/// A container that asks for gpushare while its configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "{}asks for gpushare ({asked}), but {error}; fix the file (check it with `gpushare-arbiter check-config {}`) and start the container again",
    who(.container_id),
    .error.path().display()
)]
pub struct Unconfigured {
    pub container_id: Option<String>,
    pub asked: Asked,
    pub error: ConfigError,
}

fn who(container_id: &Option<String>) -> String {
    match container_id {
        Some(id) => format!("container {id} "),
        None => "the container ".into(),
    }
}

/// What an entry point does with a container when its configuration is refused.
#[derive(Debug)]
pub enum Decision {
    /// Hand the spec on exactly as it is, and log this warning.
    RunUntouched {
        warning: String,
    },
    Refuse(Unconfigured),
}

/// Decides for the container `spec` (`container_id` where the engine named it)
/// when the configuration could not be loaded (`error`).
pub fn decide(spec: &Spec, container_id: Option<&str>, error: ConfigError) -> Decision {
    match what_asks(spec) {
        Some(asked) => Decision::Refuse(Unconfigured {
            container_id: container_id.map(str::to_owned),
            asked,
            error,
        }),
        None => Decision::RunUntouched {
            warning: format!(
                "{error}; {}asks nothing of gpushare and starts untouched",
                who(&container_id.map(str::to_owned))
            ),
        },
    }
}

/// The first thing in `spec` that asks something of gpushare, if any.
pub fn what_asks(spec: &Spec) -> Option<Asked> {
    if kubernetes::is_pod_sandbox(spec) {
        return None;
    }
    if let Some(key) = spec
        .annotation_keys()
        .find(|key| key.starts_with("gpushare.io/") || key.starts_with(GRANT_ANNOTATION_PREFIX))
    {
        return Some(Asked::Annotation(key.to_owned()));
    }
    // No request keys and no allow-list: every GPUSHARE_* name but gpushare's own
    // (and, in a pod, kubelet's service links) counts.
    let nothing_allowed = RequestPolicy {
        allowed_env: Vec::new(),
        ..RequestPolicy::default()
    };
    env_keys::first_unknown(
        spec.env().entries(),
        &[],
        &nothing_allowed,
        kubernetes::in_pod(spec),
    )
    .map(|unknown| Asked::Variable(unknown.name.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(annotations: serde_json::Value, env: &[&str]) -> Spec {
        Spec::from_value(json!({
            "ociVersion": "1.0.2",
            "process": { "args": ["sh"], "env": env },
            "annotations": annotations,
        }))
        .unwrap()
    }

    #[test]
    fn what_asks_is_any_annotation_or_variable_of_gpushare_but_its_own() {
        let pod = json!({
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.sandbox-name": "train",
        });
        for (annotations, env, expected) in [
            (json!({}), vec!["PATH=/bin", "HOME=/root"], None),
            (
                json!({"gpushare.io/memory": "4Gi"}),
                vec![],
                Some(Asked::Annotation("gpushare.io/memory".into())),
            ),
            (
                json!({"gpushare.io/memroy": "4Gi"}),
                vec![],
                Some(Asked::Annotation("gpushare.io/memroy".into())),
            ),
            (
                json!({"grant.gpushare.io/memory": "g-1"}),
                vec![],
                Some(Asked::Annotation("grant.gpushare.io/memory".into())),
            ),
            (
                json!({}),
                vec!["GPUSHARE_MEMORY=4Gi"],
                Some(Asked::Variable("GPUSHARE_MEMORY".into())),
            ),
            (
                json!({}),
                vec!["gpushare_priority=high"],
                Some(Asked::Variable("gpushare_priority".into())),
            ),
            (
                json!({}),
                vec!["GPUSHARE_MYTOOL_MODE=fast"],
                Some(Asked::Variable("GPUSHARE_MYTOOL_MODE".into())),
            ),
            // What gpushare writes into a sharing container asks for nothing by itself.
            (
                json!({}),
                vec![
                    "GPUSHARE_LEASE=l-1",
                    "GPUSHARE_SOCKET=/run/gpushare/arbiter.sock",
                    "GPUSHARE_QUOTA_MEMORY=1",
                    "GPUSHARE_LOG=debug",
                ],
                None,
            ),
            // kubelet's service links of a Service named gpushare-x, in a pod only.
            (pod.clone(), vec!["GPUSHARE_X_SERVICE_HOST=10.0.0.1"], None),
            (
                json!({}),
                vec!["GPUSHARE_X_SERVICE_HOST=10.0.0.1"],
                Some(Asked::Variable("GPUSHARE_X_SERVICE_HOST".into())),
            ),
            // A pod's pause container carries the pod's annotations but runs nothing.
            (
                json!({"io.kubernetes.cri.container-type": "sandbox", "gpushare.io/memory": "4Gi"}),
                vec![],
                None,
            ),
        ] {
            assert_eq!(
                what_asks(&spec(annotations.clone(), &env)),
                expected,
                "{annotations} {env:?}"
            );
        }
    }

    fn refused_file() -> ConfigError {
        gpushare_config::Config::parse(
            "[runtime]\nlibary = \"/x.so\"\n",
            std::path::Path::new("/etc/gpushare/config.toml"),
        )
        .unwrap_err()
    }

    #[test]
    fn a_container_that_asks_is_refused_naming_the_file_the_key_and_the_fix() {
        let asking = spec(json!({"gpushare.io/memory": "4Gi"}), &[]);
        let Decision::Refuse(refusal) = decide(&asking, Some("web"), refused_file()) else {
            panic!("ran")
        };
        let message = refusal.to_string();
        for part in [
            "container web asks for gpushare (annotation gpushare.io/memory)",
            "invalid gpushare configuration /etc/gpushare/config.toml",
            "line 2: runtime.libary = \"/x.so\": unknown key",
            "did you mean runtime.library?",
            "gpushare-arbiter check-config /etc/gpushare/config.toml",
        ] {
            assert!(message.contains(part), "{part:?} missing: {message}");
        }
    }

    #[test]
    fn a_container_that_asks_nothing_runs_with_a_warning_naming_the_file_and_error() {
        let plain = spec(json!({}), &["PATH=/bin"]);
        let Decision::RunUntouched { warning } = decide(&plain, None, refused_file()) else {
            panic!("refused")
        };
        assert!(
            warning.starts_with(
                "invalid gpushare configuration /etc/gpushare/config.toml: line 2: runtime.libary"
            ) && warning.ends_with("; the container asks nothing of gpushare and starts untouched"),
            "{warning}"
        );
    }
}
