//! Reads Kubernetes manifests into k8s-openapi's typed objects and proves nothing
//! was lost on the way.
//!
//! k8s-openapi's deserialisers ignore unknown fields (as kube-apiserver's lenient
//! decoding does), so `contianers:` or `resource:` would parse into an object that
//! simply lacks them, and the cluster would run something other than the file says.
//! Each document is therefore also serialised back from its typed object and
//! compared with the document as written ([`lost_fields`]): a field present in the
//! file and absent after the round trip is misspelt or misplaced.

use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, Pod, ResourceQuota, Service, ServiceAccount,
};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Which document of which file, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub file: PathBuf,
    /// 1-based, in the order of the file's `---` separators.
    pub document: usize,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, document {}", self.file.display(), self.document)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{source_doc}: not YAML: {message}")]
    Yaml { source_doc: Source, message: String },
    #[error("{source_doc}: no string `kind`: every document must name its kind")]
    NoKind { source_doc: Source },
    #[error("{source_doc}: kind {kind:?} is not checked here: expected one of {}", KINDS.join(", "))]
    UnknownKind { source_doc: Source, kind: String },
    #[error("{source_doc}: apiVersion {found:?} for kind {kind}: expected {expected:?}")]
    ApiVersion {
        source_doc: Source,
        kind: String,
        found: String,
        expected: &'static str,
    },
    #[error("{source_doc}: not a valid {kind}: {message}")]
    Invalid {
        source_doc: Source,
        kind: String,
        message: String,
    },
    #[error("{source_doc}: {kind} field {path} {difference}")]
    Lost {
        source_doc: Source,
        kind: String,
        path: String,
        difference: Box<Difference>,
    },
}

/// How a field of the file fared in the typed round trip.
#[derive(Debug, Clone, PartialEq)]
pub enum Difference {
    /// Absent afterwards: not a field of the object there (misspelt or misplaced).
    Dropped,
    /// Present with another value, e.g. a list of the wrong length.
    Changed { written: Value, typed: Value },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Dropped => f.write_str(
                "is not a field there (the typed object dropped it: misspelt or misplaced?)",
            ),
            Difference::Changed { written, typed } => {
                write!(f, "is written {written} but reads as {typed}")
            }
        }
    }
}

/// Every field of `written` that `typed` lost or changed, by path
/// (`spec.template.spec.containers[0].resources`), in document order.
///
/// What k8s-openapi legitimately changes is not a loss: a null or an empty map or
/// list that it omits, and a number or boolean it keeps as a string (a `Quantity`
/// written `4`, an annotation written `true` in a lenient reader). Fields it adds
/// (`apiVersion` and `kind` are always written) are not compared.
pub fn lost_fields(written: &Value, typed: &Value) -> Vec<(String, Difference)> {
    let mut lost = Vec::new();
    compare(&mut String::new(), written, typed, &mut lost);
    lost
}

fn compare(
    path: &mut String,
    written: &Value,
    typed: &Value,
    lost: &mut Vec<(String, Difference)>,
) {
    match (written, typed) {
        (Value::Null, _) => {}
        (Value::Object(written), Value::Object(typed)) => {
            for (key, value) in written {
                let len = path.len();
                push_key(path, key);
                match typed.get(key) {
                    Some(after) => compare(path, value, after, lost),
                    None if is_empty(value) => {}
                    None => lost.push((path.clone(), Difference::Dropped)),
                }
                path.truncate(len);
            }
        }
        (Value::Array(written), Value::Array(typed)) if written.len() == typed.len() => {
            for (index, (value, after)) in written.iter().zip(typed).enumerate() {
                let len = path.len();
                path.push_str(&format!("[{index}]"));
                compare(path, value, after, lost);
                path.truncate(len);
            }
        }
        (written, Value::Null) if is_empty(written) => {}
        (written, typed) if same_scalar(written, typed) => {}
        (written, typed) => lost.push((
            path.clone(),
            Difference::Changed {
                written: written.clone(),
                typed: typed.clone(),
            },
        )),
    }
}

/// `metadata.name`, but `metadata.annotations["gpushare.io/priority"]`.
fn push_key(path: &mut String, key: &str) {
    if key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(key);
    } else {
        path.push_str(&format!("[{key:?}]"));
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Object(map) => map.is_empty(),
        Value::Array(list) => list.is_empty(),
        _ => false,
    }
}

fn same_scalar(written: &Value, typed: &Value) -> bool {
    match (written, typed) {
        (Value::Number(_) | Value::Bool(_), Value::String(text)) => {
            let rendered = written.to_string();
            rendered == *text
        }
        _ => written == typed,
    }
}

/// The kinds this check knows, each read into its k8s-openapi type.
#[derive(Debug, Clone)]
pub enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ConfigMap(Box<ConfigMap>),
    DaemonSet(Box<DaemonSet>),
    RuntimeClass(Box<RuntimeClass>),
    ResourceQuota(Box<ResourceQuota>),
    Pod(Box<Pod>),
    Service(Box<Service>),
    ServiceMonitor(Box<ServiceMonitor>),
}

pub const KINDS: [&str; 9] = [
    Namespace::KIND,
    ServiceAccount::KIND,
    ConfigMap::KIND,
    DaemonSet::KIND,
    RuntimeClass::KIND,
    ResourceQuota::KIND,
    Pod::KIND,
    Service::KIND,
    ServiceMonitor::KIND,
];

/// Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), which k8s-openapi
/// does not know: the fields a scrape of a Service's named port needs, and only those,
/// so any other field written fails the round trip as lost rather than being trusted
/// unchecked.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitor {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ServiceMonitorSpec,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitorSpec {
    /// The Services whose endpoints are scraped.
    pub selector: LabelSelector,
    pub endpoints: Vec<ServiceMonitorEndpoint>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceMonitorEndpoint {
    /// The Service port's name.
    pub port: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
}

impl Resource for ServiceMonitor {
    const API_VERSION: &'static str = "monitoring.coreos.com/v1";
    const GROUP: &'static str = "monitoring.coreos.com";
    const KIND: &'static str = "ServiceMonitor";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "servicemonitors";
    type Scope = k8s_openapi::NamespaceResourceScope;
}

#[derive(Debug, Clone)]
pub struct Document {
    pub source: Source,
    pub object: Object,
}

/// Every document of one YAML text, typed and round-trip checked; documents that
/// are empty (comments only) are skipped. Stops at the first error.
pub fn parse_documents(file: &Path, text: &str) -> Result<Vec<Document>, ManifestError> {
    let mut documents = Vec::new();
    for (index, yaml) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let source = Source {
            file: file.to_owned(),
            document: index + 1,
        };
        let written = Value::deserialize(yaml).map_err(|e| ManifestError::Yaml {
            source_doc: source.clone(),
            message: e.to_string(),
        })?;
        if written.is_null() {
            continue;
        }
        let object = typed_object(&source, &written)?;
        documents.push(Document { source, object });
    }
    Ok(documents)
}

/// Every `.yaml` file directly under `dir`, in name order.
pub fn load_dir(dir: &Path) -> Result<Vec<Document>, ManifestError> {
    let read = |path: &Path| -> Result<_, ManifestError> {
        std::fs::read_dir(path).map_err(|source| ManifestError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let mut files: Vec<PathBuf> = read(dir)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let mut documents = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).map_err(|source| ManifestError::Read {
            path: file.clone(),
            source,
        })?;
        documents.extend(parse_documents(&file, &text)?);
    }
    Ok(documents)
}

fn typed_object(source: &Source, written: &Value) -> Result<Object, ManifestError> {
    let kind =
        written
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| ManifestError::NoKind {
                source_doc: source.clone(),
            })?;
    Ok(match kind {
        Namespace::KIND => Object::Namespace(round_trip(source, written)?),
        ServiceAccount::KIND => Object::ServiceAccount(round_trip(source, written)?),
        ConfigMap::KIND => Object::ConfigMap(round_trip(source, written)?),
        DaemonSet::KIND => Object::DaemonSet(round_trip(source, written)?),
        RuntimeClass::KIND => Object::RuntimeClass(round_trip(source, written)?),
        ResourceQuota::KIND => Object::ResourceQuota(round_trip(source, written)?),
        Pod::KIND => Object::Pod(round_trip(source, written)?),
        Service::KIND => Object::Service(round_trip(source, written)?),
        ServiceMonitor::KIND => Object::ServiceMonitor(round_trip(source, written)?),
        other => {
            return Err(ManifestError::UnknownKind {
                source_doc: source.clone(),
                kind: other.to_owned(),
            })
        }
    })
}

fn round_trip<T>(source: &Source, written: &Value) -> Result<Box<T>, ManifestError>
where
    T: Resource + DeserializeOwned + Serialize,
{
    let found = written.get("apiVersion").and_then(Value::as_str);
    if found != Some(T::API_VERSION) {
        return Err(ManifestError::ApiVersion {
            source_doc: source.clone(),
            kind: T::KIND.to_owned(),
            found: found.unwrap_or_default().to_owned(),
            expected: T::API_VERSION,
        });
    }
    let invalid = |message: String| ManifestError::Invalid {
        source_doc: source.clone(),
        kind: T::KIND.to_owned(),
        message,
    };
    let object: T = serde_json::from_value(written.clone()).map_err(|e| invalid(e.to_string()))?;
    let typed = serde_json::to_value(&object).map_err(|e| invalid(e.to_string()))?;
    if let Some((path, difference)) = lost_fields(written, &typed).into_iter().next() {
        return Err(ManifestError::Lost {
            source_doc: source.clone(),
            kind: T::KIND.to_owned(),
            path,
            difference: Box::new(difference),
        });
    }
    Ok(Box::new(object))
}

/// Go's `path.Match`, which containerd applies to `pod_annotations` and
/// `container_annotations`, for the patterns gpushare's configuration uses: `*`
/// matches any run of characters other than `/`, `?` one such character. Character
/// classes are not supported (`None`), so a check never guesses.
pub fn annotation_pattern_matches(pattern: &str, key: &str) -> Option<bool> {
    if pattern.contains(['[', '\\']) {
        return None;
    }
    fn matches(pattern: &[u8], key: &[u8]) -> bool {
        match pattern.split_first() {
            None => key.is_empty(),
            Some((b'*', rest)) => (0..=key.len())
                .take_while(|&n| n == 0 || key[n - 1] != b'/')
                .any(|n| matches(rest, &key[n..])),
            Some((b'?', rest)) => key
                .split_first()
                .is_some_and(|(&c, tail)| c != b'/' && matches(rest, tail)),
            Some((&c, rest)) => key
                .split_first()
                .is_some_and(|(&k, tail)| k == c && matches(rest, tail)),
        }
    }
    Some(matches(pattern.as_bytes(), key.as_bytes()))
}

#[cfg(test)]
mod tests;
