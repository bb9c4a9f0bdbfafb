//! The spec edits for a lease, applied once and only once.
//!
//! The spec is edited through `spec::Spec`, which keeps every field it does not
//! know (see there). Every edit removes its own earlier copy before adding, so
//! applying twice gives the same spec as applying once.

use std::path::{Path, PathBuf};

use gpushare_config::{ArbiterConfig, RuntimeConfig};
use gpushare_proto::Lease;

use crate::spec::{self, EnvMut, HookStage, Mount, Process, Spec, SpecError};
use crate::{
    ANNOTATION_ASSIGNED_GPUS, ANNOTATION_LEASE, ANNOTATION_MARKER, CONTAINER_RUN_DIR,
    CONTAINER_SOCKET, MARKER_VALUE,
};

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

/// Whether gpushare's marker is on the spec (whatever its value).
pub fn is_marked(spec: &Spec) -> bool {
    spec.has_annotation(ANNOTATION_MARKER)
}

/// A marked spec is genuine only if its lease annotation names a lease the
/// arbiter granted to this very container, or a still-pending one (podman's
/// precreate hook edited the spec before the container had an id; the
/// createRuntime hook binds it). Otherwise someone copied gpushare's annotations
/// to skip gpushare (and a `void` policy with it). A pending lease's id is 64
/// random bits written only into the spec it was reserved for.
pub fn marker_is_genuine(
    spec: &Spec,
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

pub fn lease_annotation(spec: &Spec) -> Option<&str> {
    spec.annotation(ANNOTATION_LEASE)
}

fn display(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn bind_mount(source: &Path, destination: &Path, options: &[&str]) -> Mount {
    spec::mount(
        display(destination),
        "bind",
        display(source),
        options.iter().map(|o| o.to_string()).collect(),
    )
}

/// Applies `lease` to `spec`. Idempotent.
pub fn apply_lease(spec: &mut Spec, lease: &Lease, paths: &HostPaths) -> Result<(), SpecError> {
    InjectedEnv::for_lease(lease, paths).apply(&mut spec.env_mut()?);

    let mut mounts = spec.mounts_mut()?;
    mounts.replace(bind_mount(
        &paths.library,
        &paths.container_library,
        &["rbind", "ro", "nosuid", "nodev"],
    ));
    // Read-only: the container may connect to its socket (sockets ignore the
    // mount's ro flag) but cannot plant anything beside it.
    mounts.replace(bind_mount(
        &paths.lease_dir,
        Path::new(CONTAINER_RUN_DIR),
        &["rbind", "ro", "nosuid", "nodev", "noexec"],
    ));
    if let Some(preload_file) = &paths.ld_so_preload {
        mounts.replace(bind_mount(
            preload_file,
            Path::new("/etc/ld.so.preload"),
            &["rbind", "ro", "nosuid", "nodev"],
        ));
    }

    for (stage, action) in [
        (HookStage::CreateRuntime, "create-runtime"),
        (HookStage::Poststop, "poststop"),
    ] {
        let hook = display(&paths.hook);
        let args = vec![
            hook.clone(),
            "--control-socket".into(),
            display(&paths.control_socket),
            action.into(),
        ];
        // A non-empty env is the hook's whole environment: keep it minimal and explicit.
        let env = vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()];
        spec.hooks_mut(stage)?
            .replace(spec::hook(hook, args, env, paths.hook_timeout_seconds));
    }

    let mut annotations = spec.annotations_mut()?;
    annotations.set(ANNOTATION_LEASE, lease.id.0.clone());
    annotations.set(ANNOTATION_ASSIGNED_GPUS, lease.gpus.join(","));
    annotations.set(ANNOTATION_MARKER, MARKER_VALUE);
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
            library: display(&paths.container_library),
        }
    }

    /// From a spec gpushare already edited; `None` when it is not marked.
    pub fn from_marked_spec(spec: &Spec) -> Option<Self> {
        if !is_marked(spec) {
            return None;
        }
        let env = spec.env();
        let value = |key: &str| env.get(key).map(str::to_owned);
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

    pub fn apply(&self, env: &mut EnvMut<'_>) {
        for (i, (key, value)) in self.replace.iter().enumerate() {
            env.set(key, value);
            // Right after NVIDIA_VISIBLE_DEVICES, where the NVIDIA toolkit's users expect it.
            if i == 0 && !env.has("NVIDIA_DRIVER_CAPABILITIES") {
                env.set("NVIDIA_DRIVER_CAPABILITIES", &self.capabilities);
            }
        }
        // The library goes first so its `dlsym` is found before anything else's;
        // the image's own preloads are kept after it.
        env.prepend_to_list("LD_PRELOAD", &self.library);
    }
}

/// Applies the container's injected environment to an exec process
/// (`runc exec --process process.json`). Idempotent.
pub fn apply_to_exec_process(
    process: &mut Process,
    container_spec: &Spec,
) -> Result<bool, SpecError> {
    let Some(injected) = InjectedEnv::from_marked_spec(container_spec) else {
        return Ok(false);
    };
    injected.apply(&mut process.env_mut()?);
    Ok(true)
}

/// Makes the container's creation fail with `message`, through a createRuntime
/// hook that prints it and exits non-zero. For podman's precreate stage, whose
/// hook stderr podman 4.x discards: runc does put a failing hook's stderr into
/// its error, which podman shows. Nothing else in the spec changes.
pub fn apply_failure(spec: &mut Spec, hook: &Path, message: &str) -> Result<(), SpecError> {
    let hook = display(hook);
    spec.hooks_mut(HookStage::CreateRuntime)?
        .insert_first(spec::hook(
            hook.clone(),
            vec![hook, "fail".into(), "--message".into(), message.into()],
            vec![],
            5,
        ));
    Ok(())
}

/// For containers without a request when the policy is `void`: images that bake
/// in `NVIDIA_VISIBLE_DEVICES=all` would otherwise see every GPU of the node.
pub fn apply_void(spec: &mut Spec) -> Result<(), SpecError> {
    spec.env_mut()?.set("NVIDIA_VISIBLE_DEVICES", "void");
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gpushare_proto::{Fraction, LeaseId, LeaseState, Priority};
    use serde_json::{json, Value};

    fn spec(value: Value) -> Spec {
        Spec::from_value(value).unwrap()
    }

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
            pod: None,
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
            let mut spec = Spec::from_slice(&std::fs::read(&path).unwrap()).unwrap();
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
        let mut spec = spec(json!({"process": {"env": [
            "NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0", "LD_PRELOAD=/a.so /b.so",
            "NVIDIA_DRIVER_CAPABILITIES=all"
        ]}}));
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        let env: Vec<&str> = spec.env().entries().collect();
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
        let mut spec = spec(
            json!({"process": {"env": [], "ioPriority": {"class": "IOPRIO_CLASS_IDLE"}}, "futureField": [1, 2]}),
        );
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        let spec = spec.into_value();
        assert_eq!(spec["futureField"], json!([1, 2]));
        assert_eq!(spec["process"]["ioPriority"]["class"], "IOPRIO_CLASS_IDLE");
    }

    #[test]
    fn exec_process_gets_the_containers_injected_env() {
        let mut container =
            spec(json!({"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]}}));
        apply_lease(&mut container, &lease(), &paths(false)).unwrap();
        // What docker writes for `docker exec`: the image's env, not the edited spec's.
        let mut process: Process = serde_json::from_value(json!({"args": ["sh"], "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "LD_PRELOAD=/x.so"], "cwd": "/"})).unwrap();
        assert!(apply_to_exec_process(&mut process, &container).unwrap());
        let env: Vec<&str> = process.env().entries().collect();
        assert!(
            env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-51a6d0e0-0000-4000-8000-000000000000"),
            "{env:?}"
        );
        assert!(env.contains(&"GPUSHARE_LEASE=00000000000000ab"));
        assert!(env.contains(&"LD_PRELOAD=/usr/local/gpushare/libgpushare.so:/x.so"));
        assert!(env.contains(&"NVIDIA_DRIVER_CAPABILITIES=compute,utility"));
        let once = process.clone();
        apply_to_exec_process(&mut process, &container).unwrap();
        assert_eq!(process, once, "idempotent");
        assert_eq!(process.args(), ["sh"], "nothing but env changes");
        let text = String::from_utf8(process.to_vec()).unwrap();
        assert!(
            text.starts_with(r#"{"args":["sh"],"env":["#) && text.ends_with(r#"],"cwd":"/"}"#),
            "every field in its place: {text}"
        );

        let unmarked = spec(json!({"process": {"env": ["PATH=/bin"]}}));
        let mut untouched: Process = serde_json::from_value(json!({"env": ["PATH=/bin"]})).unwrap();
        assert!(!apply_to_exec_process(&mut untouched, &unmarked).unwrap());
        assert_eq!(untouched.to_vec(), br#"{"env":["PATH=/bin"]}"#);
    }

    #[test]
    fn failure_hook_runs_first_and_changes_nothing_else() {
        let mut spec = spec(
            json!({"process": {"env": ["A=1"]}, "hooks": {"createRuntime": [{"path": "/other"}]}}),
        );
        apply_failure(&mut spec, Path::new("/h"), "bad request").unwrap();
        let spec = spec.into_value();
        assert_eq!(
            spec["hooks"]["createRuntime"][0]["args"],
            json!(["/h", "fail", "--message", "bad request"])
        );
        assert_eq!(spec["hooks"]["createRuntime"][1]["path"], "/other");
        assert_eq!(spec["process"], json!({"env": ["A=1"]}));
    }

    #[test]
    fn void_replaces_visible_devices() {
        let mut spec = spec(json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}));
        apply_void(&mut spec).unwrap();
        assert_eq!(
            spec.into_value()["process"]["env"],
            json!(["NVIDIA_VISIBLE_DEVICES=void"])
        );
    }

    #[test]
    fn marker_detection() {
        let mut spec = spec(json!({"process": {"env": []}}));
        assert!(!is_marked(&spec));
        apply_lease(&mut spec, &lease(), &paths(false)).unwrap();
        assert!(is_marked(&spec));
        assert_eq!(lease_annotation(&spec), Some("00000000000000ab"));
    }

    #[test]
    fn marker_is_genuine_only_for_the_leases_own_container() {
        let mut spec = spec(json!({"process": {"env": []}}));
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
        assert!(Spec::from_value(json!([])).is_err(), "a spec is an object");
        for value in [
            json!({"process": 3}),
            json!({"process": {"env": "x"}}),
            json!({"hooks": []}),
            json!({"mounts": {}}),
            json!({"annotations": []}),
        ] {
            let mut spec = spec(value.clone());
            assert!(
                apply_lease(&mut spec, &lease(), &paths(false)).is_err(),
                "{value}"
            );
        }
    }
}
