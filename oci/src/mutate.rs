//! The spec edits for a lease, applied once and only once.
//!
//! The spec is edited as JSON, not through oci-spec's structs: those drop any
//! field they do not know, and a wrapper must never silently remove a newer
//! engine's settings from a container. Every edit removes its own earlier copy
//! before adding, so applying twice gives the same spec as applying once.

use std::path::{Path, PathBuf};

use gpushare_config::{ArbiterConfig, RuntimeConfig};
use gpushare_proto::Lease;
use serde_json::{json, Map, Value};

use crate::{
    ANNOTATION_ASSIGNED_GPUS, ANNOTATION_LEASE, ANNOTATION_MARKER, CONTAINER_RUN_DIR,
    CONTAINER_SOCKET, MARKER_VALUE,
};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("config.json: {0} is not a JSON object")]
    NotAnObject(&'static str),
}

/// Where things are on the host, from the configuration.
#[derive(Debug, Clone)]
pub struct HostPaths {
    pub library: PathBuf,
    pub container_library: PathBuf,
    pub hook: PathBuf,
    pub hook_timeout_seconds: u32,
    pub control_socket: PathBuf,
    pub lease_dir: PathBuf,
    /// Some: also mount this file (it names the library) at /etc/ld.so.preload.
    pub ld_so_preload: Option<PathBuf>,
}

impl HostPaths {
    pub fn new(runtime: &RuntimeConfig, arbiter: &ArbiterConfig, lease: &Lease) -> Self {
        HostPaths {
            library: runtime.library.clone(),
            container_library: runtime.container_library.clone(),
            hook: runtime.hook.clone(),
            hook_timeout_seconds: runtime.hook_timeout_seconds,
            control_socket: arbiter.control_socket(),
            lease_dir: arbiter.lease_dir(&lease.id),
            ld_so_preload: runtime
                .ld_so_preload
                .then(|| arbiter.run_dir.join("ld.so.preload")),
        }
    }
}

pub fn is_marked(spec: &Value) -> bool {
    spec.pointer(&format!(
        "/annotations/{}",
        ANNOTATION_MARKER.replace('/', "~1")
    ))
    .is_some()
}

/// A marked spec is genuine only if its lease annotation names a lease the
/// arbiter granted to this very container, or a still-pending one (podman's
/// precreate hook edited the spec before the container had an id; the
/// createRuntime hook binds it). Otherwise someone copied gpushare's annotations
/// to skip gpushare (and a `void` policy with it). A pending lease's id is 64
/// random bits written only into the spec it was reserved for.
pub fn marker_is_genuine(
    spec: &Value,
    container_id: &str,
    status: &gpushare_proto::StatusReport,
) -> bool {
    let claimed = lease_annotation(spec).unwrap_or("");
    status.leases.iter().any(|l| {
        l.id.0 == claimed
            && (l.container_id == container_id
                || l.container_id
                    .starts_with(gpushare_proto::message::PENDING_PREFIX))
    })
}

pub fn lease_annotation(spec: &Value) -> Option<&str> {
    spec.pointer(&format!(
        "/annotations/{}",
        ANNOTATION_LEASE.replace('/', "~1")
    ))
    .and_then(Value::as_str)
}

/// Applies `lease` to `spec`. Idempotent.
pub fn apply_lease(spec: &mut Value, lease: &Lease, paths: &HostPaths) -> Result<(), SpecError> {
    let root = spec
        .as_object_mut()
        .ok_or(SpecError::NotAnObject("the spec"))?;

    InjectedEnv::for_lease(lease, paths).apply(env_mut(root)?);

    let mounts = array_mut(root, "mounts")?;
    let library = bind_mount(
        &paths.library,
        &paths.container_library,
        &["rbind", "ro", "nosuid", "nodev"],
    );
    // Read-only: the container may connect to its socket (sockets ignore the
    // mount's ro flag) but cannot plant anything beside it.
    let lease_dir = bind_mount(
        &paths.lease_dir,
        Path::new(CONTAINER_RUN_DIR),
        &["rbind", "ro", "nosuid", "nodev", "noexec"],
    );
    replace_mount(mounts, library);
    replace_mount(mounts, lease_dir);
    if let Some(preload_file) = &paths.ld_so_preload {
        replace_mount(
            mounts,
            bind_mount(
                preload_file,
                Path::new("/etc/ld.so.preload"),
                &["rbind", "ro", "nosuid", "nodev"],
            ),
        );
    }

    let hooks = object_mut(root, "hooks")?;
    for (stage, action) in [
        ("createRuntime", "create-runtime"),
        ("poststop", "poststop"),
    ] {
        let list = array_mut(hooks, stage)?;
        let hook = paths.hook.to_string_lossy().into_owned();
        list.retain(|h| h.get("path").and_then(Value::as_str) != Some(hook.as_str()));
        list.push(json!({
            "path": hook,
            "args": [hook, "--control-socket", paths.control_socket.to_string_lossy(), action],
            // A non-empty env is the hook's whole environment: keep it minimal and explicit.
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "timeout": paths.hook_timeout_seconds,
        }));
    }

    let annotations = object_mut(root, "annotations")?;
    annotations.insert(ANNOTATION_LEASE.into(), lease.id.0.clone().into());
    annotations.insert(ANNOTATION_ASSIGNED_GPUS.into(), lease.gpus.join(",").into());
    annotations.insert(ANNOTATION_MARKER.into(), MARKER_VALUE.into());
    Ok(())
}

/// The environment a sharing container's processes get. Built from the lease
/// when the container is created, and read back from the container's (marked)
/// spec for `exec`: engines build an exec process's environment from their own
/// records, not from the edited spec, so without this an exec session would run
/// without the interposer and see every GPU the image names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectedEnv {
    /// Set (replacing any existing entries), in this order.
    replace: Vec<(String, String)>,
    /// `NVIDIA_DRIVER_CAPABILITIES` when the container names none.
    capabilities: String,
    library: String,
}

/// Variables gpushare sets; informational only: the interposer learns the quota
/// from the arbiter, never from here.
const INJECTED_KEYS: [&str; 5] = [
    "NVIDIA_VISIBLE_DEVICES",
    "GPUSHARE_LEASE",
    "GPUSHARE_SOCKET",
    "GPUSHARE_QUOTA_MEMORY",
    "GPUSHARE_QUOTA_PRIORITY",
];
const DEFAULT_CAPABILITIES: &str = "compute,utility";

impl InjectedEnv {
    pub fn for_lease(lease: &Lease, paths: &HostPaths) -> Self {
        let values = [
            lease.gpus.join(","),
            lease.id.0.clone(),
            CONTAINER_SOCKET.to_owned(),
            lease.memory_bytes.to_string(),
            lease.priority.to_string(),
        ];
        InjectedEnv {
            replace: INJECTED_KEYS
                .iter()
                .map(|k| k.to_string())
                .zip(values)
                .collect(),
            capabilities: DEFAULT_CAPABILITIES.to_owned(),
            library: paths.container_library.to_string_lossy().into_owned(),
        }
    }

    /// From a spec gpushare already edited; `None` when it is not marked.
    pub fn from_marked_spec(spec: &Value) -> Option<Self> {
        if !is_marked(spec) {
            return None;
        }
        let env = crate::request::env_list(spec);
        let value = |key: &str| {
            env.iter()
                .find_map(|e| e.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
                .map(str::to_owned)
        };
        let replace = INJECTED_KEYS
            .iter()
            .map(|k| Some((k.to_string(), value(k)?)))
            .collect::<Option<Vec<_>>>()?;
        let library = value("LD_PRELOAD")?.split([':', ' ']).next()?.to_owned();
        let capabilities =
            value("NVIDIA_DRIVER_CAPABILITIES").unwrap_or_else(|| DEFAULT_CAPABILITIES.to_owned());
        Some(InjectedEnv {
            replace,
            capabilities,
            library,
        })
    }

    pub fn apply(&self, env: &mut Vec<Value>) {
        for (i, (key, value)) in self.replace.iter().enumerate() {
            set_env(env, key, value);
            // Right after NVIDIA_VISIBLE_DEVICES, where the NVIDIA toolkit's users expect it.
            if i == 0 && !has_env(env, "NVIDIA_DRIVER_CAPABILITIES") {
                set_env(env, "NVIDIA_DRIVER_CAPABILITIES", &self.capabilities);
            }
        }
        prepend_preload(env, &self.library);
    }
}

/// Applies the container's injected environment to an exec process
/// (`runc exec --process process.json`). Idempotent.
pub fn apply_to_exec_process(
    process: &mut Value,
    container_spec: &Value,
) -> Result<bool, SpecError> {
    let Some(injected) = InjectedEnv::from_marked_spec(container_spec) else {
        return Ok(false);
    };
    let process = process
        .as_object_mut()
        .ok_or(SpecError::NotAnObject("the exec process"))?;
    injected.apply(array_mut(process, "env")?);
    Ok(true)
}

/// Makes the container's creation fail with `message`, through a createRuntime
/// hook that prints it and exits non-zero. For podman's precreate stage, whose
/// hook stderr podman 4.x discards: runc does put a failing hook's stderr into
/// its error, which podman shows. Nothing else in the spec changes.
pub fn apply_failure(spec: &mut Value, hook: &Path, message: &str) -> Result<(), SpecError> {
    let root = spec
        .as_object_mut()
        .ok_or(SpecError::NotAnObject("the spec"))?;
    let hooks = object_mut(root, "hooks")?;
    let hook = hook.to_string_lossy();
    array_mut(hooks, "createRuntime")?.insert(
        0,
        json!({ "path": hook, "args": [hook, "fail", "--message", message], "timeout": 5 }),
    );
    Ok(())
}

/// For containers without a request when the policy is `void`: images that bake
/// in `NVIDIA_VISIBLE_DEVICES=all` would otherwise see every GPU of the node.
pub fn apply_void(spec: &mut Value) -> Result<(), SpecError> {
    let root = spec
        .as_object_mut()
        .ok_or(SpecError::NotAnObject("the spec"))?;
    set_env(env_mut(root)?, "NVIDIA_VISIBLE_DEVICES", "void");
    Ok(())
}

fn env_mut(root: &mut Map<String, Value>) -> Result<&mut Vec<Value>, SpecError> {
    let process = object_mut(root, "process")?;
    array_mut(process, "env")
}

fn object_mut<'a>(
    parent: &'a mut Map<String, Value>,
    key: &'static str,
) -> Result<&'a mut Map<String, Value>, SpecError> {
    parent
        .entry(key)
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .ok_or(SpecError::NotAnObject(key))
}

fn array_mut<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
) -> Result<&'a mut Vec<Value>, SpecError> {
    let slot = parent
        .entry(key)
        .or_insert_with(|| Value::Array(Vec::new()));
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut()
        .ok_or(SpecError::NotAnObject("an array field"))
}

fn env_key(entry: &Value) -> Option<&str> {
    entry
        .as_str()
        .map(|e| e.split_once('=').map_or(e, |(k, _)| k))
}

fn has_env(env: &[Value], key: &str) -> bool {
    env.iter().any(|e| env_key(e) == Some(key))
}

/// Replaces every entry for `key` with one, at the place of the first: images
/// often bake in `NVIDIA_VISIBLE_DEVICES=all`, which must be replaced, never appended to.
fn set_env(env: &mut Vec<Value>, key: &str, value: &str) {
    let entry = Value::String(format!("{key}={value}"));
    match env.iter().position(|e| env_key(e) == Some(key)) {
        Some(first) => {
            env[first] = entry;
            let mut index = 0;
            env.retain(|e| {
                let keep = index <= first || env_key(e) != Some(key);
                index += 1;
                keep
            });
        }
        None => env.push(entry),
    }
}

/// The library goes first so its `dlsym` is found before anything else's; the
/// image's own preloads are kept after it.
fn prepend_preload(env: &mut Vec<Value>, library: &str) {
    let existing = env
        .iter()
        .find_map(|e| e.as_str().and_then(|s| s.strip_prefix("LD_PRELOAD=")))
        .unwrap_or("")
        .to_owned();
    let mut entries: Vec<&str> = vec![library];
    entries.extend(
        existing
            .split([':', ' '])
            .filter(|p| !p.is_empty() && *p != library),
    );
    set_env(env, "LD_PRELOAD", &entries.join(":"));
}

fn bind_mount(source: &Path, destination: &Path, options: &[&str]) -> Value {
    json!({
        "destination": destination.to_string_lossy(),
        "type": "bind",
        "source": source.to_string_lossy(),
        "options": options,
    })
}

fn replace_mount(mounts: &mut Vec<Value>, mount: Value) {
    let destination = mount["destination"].clone();
    mounts.retain(|m| m.get("destination") != Some(&destination));
    mounts.push(mount);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{Fraction, LeaseId, LeaseState, Priority};

    pub(crate) fn lease() -> Lease {
        Lease {
            id: LeaseId("00000000000000ab".into()),
            container_id: "c1".into(),
            namespace: None,
            sandbox_id: None,
            gpus: vec!["GPU-51a6d0e0-0000-4000-8000-000000000000".into()],
            priority: Priority::High,
            memory_bytes: 1 << 30,
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            tenant: None,
            state: LeaseState::Reserved,
            pid: None,
            created_unix_ms: 0,
        }
    }

    pub(crate) fn paths(ld_so_preload: bool) -> HostPaths {
        HostPaths {
            library: "/usr/local/lib/gpushare/libgpushare.so".into(),
            container_library: "/usr/local/gpushare/libgpushare.so".into(),
            hook: "/usr/local/bin/gpushare-hook".into(),
            hook_timeout_seconds: 10,
            control_socket: "/run/gpushare/control.sock".into(),
            lease_dir: "/run/gpushare/leases/00000000000000ab".into(),
            ld_so_preload: ld_so_preload.then(|| "/run/gpushare/ld.so.preload".into()),
        }
    }

    /// Golden files: testdata/<name>.in.json + lease → testdata/<name>.out.json.
    /// Set GPUSHARE_BLESS=1 to rewrite the expected files after a deliberate change.
    #[test]
    fn golden_specs() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(".in.json") else {
                continue;
            };
            seen += 1;
            let mut spec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            apply_lease(&mut spec, &lease(), &paths(stem.contains("ld-so-preload"))).unwrap();
            let expected_path = dir.join(format!("{stem}.out.json"));
            let rendered = serde_json::to_string_pretty(&spec).unwrap() + "\n";
            if std::env::var_os("GPUSHARE_BLESS").is_some() {
                std::fs::write(&expected_path, &rendered).unwrap();
            }
            let expected = std::fs::read_to_string(&expected_path).unwrap();
            assert_eq!(
                rendered,
                expected,
                "{stem}: spec differs from {}",
                expected_path.display()
            );
            apply_lease(&mut spec, &lease(), &paths(stem.contains("ld-so-preload"))).unwrap();
            assert_eq!(
                serde_json::to_string_pretty(&spec).unwrap() + "\n",
                expected,
                "{stem}: not idempotent"
            );
        }
        assert!(seen >= 3, "golden inputs missing from {}", dir.display());
    }

    #[test]
    fn env_replaced_not_appended_and_duplicates_removed() {
        let mut spec = json!({"process": {"env": [
            "NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0", "LD_PRELOAD=/a.so /b.so",
            "NVIDIA_DRIVER_CAPABILITIES=all"
        ]}});
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        let env = crate::request::env_list(&spec);
        assert_eq!(
            env.iter()
                .filter(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES="))
                .count(),
            1
        );
        assert_eq!(
            env[0],
            "NVIDIA_VISIBLE_DEVICES=GPU-51a6d0e0-0000-4000-8000-000000000000"
        );
        assert!(env.contains(&"LD_PRELOAD=/usr/local/gpushare/libgpushare.so:/a.so:/b.so"));
        assert!(
            env.contains(&"NVIDIA_DRIVER_CAPABILITIES=all"),
            "an explicit capability list is kept"
        );
    }

    #[test]
    fn unknown_fields_survive() {
        let mut spec = json!({"process": {"env": [], "ioPriority": {"class": "IOPRIO_CLASS_IDLE"}}, "futureField": [1, 2]});
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        assert_eq!(spec["futureField"], json!([1, 2]));
        assert_eq!(spec["process"]["ioPriority"]["class"], "IOPRIO_CLASS_IDLE");
    }

    #[test]
    fn exec_process_gets_the_containers_injected_env() {
        let mut spec = json!({"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]}});
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        // What docker writes for `docker exec`: the image's env, not the edited spec's.
        let mut process = json!({"args": ["sh"], "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "LD_PRELOAD=/x.so"], "cwd": "/"});
        assert!(apply_to_exec_process(&mut process, &spec).unwrap());
        let env: Vec<&str> = process["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(
            env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-51a6d0e0-0000-4000-8000-000000000000"),
            "{env:?}"
        );
        assert!(env.contains(&"GPUSHARE_LEASE=00000000000000ab"));
        assert!(env.contains(&"LD_PRELOAD=/usr/local/gpushare/libgpushare.so:/x.so"));
        assert!(env.contains(&"NVIDIA_DRIVER_CAPABILITIES=compute,utility"));
        let once = process.clone();
        apply_to_exec_process(&mut process, &spec).unwrap();
        assert_eq!(process, once, "idempotent");
        assert_eq!(process["args"], json!(["sh"]), "nothing but env changes");

        let unmarked = json!({"process": {"env": ["PATH=/bin"]}});
        let mut untouched = json!({"env": ["PATH=/bin"]});
        assert!(!apply_to_exec_process(&mut untouched, &unmarked).unwrap());
        assert_eq!(untouched, json!({"env": ["PATH=/bin"]}));
    }

    #[test]
    fn failure_hook_runs_first_and_changes_nothing_else() {
        let mut spec =
            json!({"process": {"env": ["A=1"]}, "hooks": {"createRuntime": [{"path": "/other"}]}});
        apply_failure(&mut spec, Path::new("/h"), "bad request").unwrap();
        assert_eq!(
            spec["hooks"]["createRuntime"][0]["args"],
            json!(["/h", "fail", "--message", "bad request"])
        );
        assert_eq!(spec["hooks"]["createRuntime"][1]["path"], "/other");
        assert_eq!(spec["process"], json!({"env": ["A=1"]}));
    }

    #[test]
    fn void_replaces_visible_devices() {
        let mut spec = json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}});
        apply_void(&mut spec).unwrap();
        assert_eq!(
            spec["process"]["env"],
            json!(["NVIDIA_VISIBLE_DEVICES=void"])
        );
    }

    #[test]
    fn marker_detection() {
        let mut spec = json!({"process": {"env": []}});
        assert!(!is_marked(&spec));
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        assert!(is_marked(&spec));
        assert_eq!(lease_annotation(&spec), Some("00000000000000ab"));
    }

    #[test]
    fn marker_is_genuine_only_for_the_leases_own_container() {
        let mut spec = json!({"process": {"env": []}});
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        let status = gpushare_proto::StatusReport {
            leases: vec![lease()],
            ..Default::default()
        };
        assert!(marker_is_genuine(&spec, "c1", &status));
        assert!(!marker_is_genuine(&spec, "someone-else", &status));
        // podman's precreate hook, then gpushare-runc as its runtime: the lease is still pending.
        let mut pending = lease();
        pending.container_id = format!("{}5eed", gpushare_proto::message::PENDING_PREFIX);
        let status_pending = gpushare_proto::StatusReport {
            leases: vec![pending],
            ..Default::default()
        };
        assert!(marker_is_genuine(&spec, "podman-ctr", &status_pending));
        let empty = gpushare_proto::StatusReport::default();
        assert!(!marker_is_genuine(&spec, "c1", &empty));
    }

    #[test]
    fn malformed_specs_are_errors_not_panics() {
        for mut spec in [
            json!([]),
            json!({"process": 3}),
            json!({"process": {"env": "x"}}),
            json!({"hooks": []}),
        ] {
            assert!(
                apply_lease(&mut spec, &lease(), &paths(false)).is_err(),
                "{spec}"
            );
        }
    }
}
