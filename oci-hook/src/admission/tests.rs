//! Every branch of admission against a recording fake arbiter: it records each
//! call and answers from a script, and a call nobody scripted fails the test.
//! The branches are the union of what the shim, gpushare-runc and the precreate
//! hook each did before they shared this path.

use std::collections::VecDeque;
use std::path::Path;

use gpushare_config::{Config, TenantSource, Unrequested};
use gpushare_proto::{
    ClientError, ContainerRef, ErrorKind, Fraction, GrantId, Lease, LeaseId, LeaseState,
    MemoryRequest, PodBinding, Priority, ReserveRequest, StatusReport,
};
use gpushare_types::kubernetes::{GRANT_HIGH_ANNOTATION, GRANT_MEMORY_ANNOTATION};
use serde_json::{json, Value};

use super::*;
use crate::kubernetes::CONTAINER_TYPE_KEYS;
use crate::spec::HookStage;

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Status,
    Reserve(ReserveRequest),
    Release(ContainerRef),
}

#[derive(Default)]
struct RecordingArbiter {
    calls: Vec<Call>,
    status: VecDeque<Result<StatusReport, ClientError>>,
    reserve: VecDeque<Result<Lease, ClientError>>,
    release: VecDeque<Result<bool, ClientError>>,
}

impl RecordingArbiter {
    fn status(mut self, answer: Result<StatusReport, ClientError>) -> Self {
        self.status.push_back(answer);
        self
    }
    fn reserve(mut self, answer: Result<Lease, ClientError>) -> Self {
        self.reserve.push_back(answer);
        self
    }
    fn release(mut self, answer: Result<bool, ClientError>) -> Self {
        self.release.push_back(answer);
        self
    }
    /// A node whose driver runs CUDA 12.2 and that grants `lease()`.
    fn granting() -> Self {
        RecordingArbiter::default()
            .status(Ok(driver(12020)))
            .reserve(Ok(lease()))
    }
    fn reserved(&self) -> Vec<&ReserveRequest> {
        self.calls
            .iter()
            .filter_map(|c| match c {
                Call::Reserve(r) => Some(r),
                _ => None,
            })
            .collect()
    }
}

fn unscripted(call: &str) -> ! {
    panic!("admission made a {call} call the test did not expect")
}

impl Arbiter for RecordingArbiter {
    fn status(&mut self) -> Result<StatusReport, ClientError> {
        self.calls.push(Call::Status);
        self.status
            .pop_front()
            .unwrap_or_else(|| unscripted("status"))
    }
    fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, ClientError> {
        self.calls.push(Call::Reserve(request));
        self.reserve
            .pop_front()
            .unwrap_or_else(|| unscripted("reserve"))
    }
    fn release(&mut self, holder: ContainerRef) -> Result<bool, ClientError> {
        self.calls.push(Call::Release(holder));
        self.release
            .pop_front()
            .unwrap_or_else(|| unscripted("release"))
    }
}

const LEASE: &str = "00000000000000ab";
const GPU: &str = "GPU-51a6d0e0-0000-4000-8000-000000000000";

fn lease() -> Lease {
    Lease {
        id: LeaseId(LEASE.into()),
        container_id: "c1".into(),
        namespace: Some("containerd:k8s.io".into()),
        sandbox_id: None,
        gpus: vec![GPU.into()],
        priority: Priority::Low,
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

fn driver(cuda: u32) -> StatusReport {
    StatusReport {
        driver_cuda_version: Some(cuda),
        ..Default::default()
    }
}

fn unreachable_arbiter() -> ClientError {
    ClientError::Connect {
        path: "/run/gpushare/control.sock".into(),
        error: std::io::ErrorKind::NotFound.into(),
    }
}

fn refused(kind: ErrorKind) -> ClientError {
    ClientError::Refused {
        kind,
        message: "refused by the arbiter".into(),
    }
}

fn spec(annotations: Value, env: &[&str]) -> Spec {
    Spec::from_value(json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["sh"], "env": env},
        "root": {"path": "rootfs"},
        "annotations": annotations,
    }))
    .unwrap()
}

fn asking() -> Spec {
    spec(json!({"gpushare.io/memory": "1Gi"}), &["PATH=/bin"])
}

fn config() -> Config {
    Config::default()
}

fn void_config() -> Config {
    let mut config = Config::default();
    config.requests.unrequested = Unrequested::Void;
    config
}

fn container() -> Identity {
    Identity::container("c1", Namespace::Containerd("k8s.io".into()))
}

fn holder() -> ContainerRef {
    ContainerRef {
        container_id: "c1".into(),
        namespace: Some("containerd:k8s.io".into()),
        lease: Some(LeaseId(LEASE.into())),
    }
}

fn edited(admitted: Admitted<Edit>) -> Edit {
    match admitted {
        Admitted::Edited(edit) => edit,
        Admitted::Untouched(why) => panic!("untouched ({why:?}), expected an edit"),
    }
}

fn untouched<E: std::fmt::Debug>(admitted: Admitted<E>) -> Untouched {
    match admitted {
        Admitted::Untouched(why) => why,
        Admitted::Edited(edit) => panic!("edited ({edit:?}), expected it untouched"),
    }
}

#[test]
fn a_container_that_asks_for_nothing_is_untouched_and_the_arbiter_is_not_asked() {
    let mut arbiter = RecordingArbiter::default();
    let plain = spec(json!({"other.io/x": "1"}), &["NVIDIA_VISIBLE_DEVICES=all"]);
    let admitted = admit(&plain, &container(), &config(), &mut arbiter).unwrap();
    assert_eq!(untouched(admitted), Untouched::NoRequest);
    assert!(arbiter.calls.is_empty(), "{:?}", arbiter.calls);
}

#[test]
fn a_pods_pause_container_is_untouched_whichever_cri_runtime_marked_it() {
    for key in CONTAINER_TYPE_KEYS {
        // The pod's request is copied into its pause container's spec too; and
        // neither the void policy nor a marker changes anything for it.
        for config in [config(), void_config()] {
            for marker in [json!(null), json!("v1")] {
                let mut annotations = json!({key: "sandbox", "gpushare.io/memory": "1Gi", "io.kubernetes.cri.sandbox-id": "pod1"});
                if !marker.is_null() {
                    annotations[crate::ANNOTATION_MARKER] = marker;
                }
                let pause = spec(annotations, &["NVIDIA_VISIBLE_DEVICES=all"]);
                let mut arbiter = RecordingArbiter::default();
                let admitted = admit(&pause, &container(), &config, &mut arbiter).unwrap();
                assert_eq!(untouched(admitted), Untouched::PodSandbox, "{key}");
                assert!(arbiter.calls.is_empty(), "{key}: {:?}", arbiter.calls);
            }
        }
        // The workload containers of the same pod are admitted.
        let workload = spec(json!({key: "container", "gpushare.io/memory": "1Gi"}), &[]);
        let mut arbiter = RecordingArbiter::granting();
        let edit = edited(admit(&workload, &container(), &config(), &mut arbiter).unwrap());
        assert_eq!(edit.lease().map(|l| l.id.0.as_str()), Some(LEASE), "{key}");
    }
}

#[test]
fn a_pods_pause_container_keeps_its_bundle_byte_for_byte() {
    for key in CONTAINER_TYPE_KEYS {
        let dir = tempfile::tempdir().unwrap();
        let original = format!(
            "{{\"annotations\": {{\"{key}\": \"sandbox\", \"gpushare.io/memory\": \"1Gi\"}}}}\n"
        );
        std::fs::write(dir.path().join("config.json"), &original).unwrap();
        let mut arbiter = RecordingArbiter::default();
        let admitted =
            prepare_bundle(dir.path(), &container(), &void_config(), &mut arbiter).unwrap();
        assert_eq!(untouched(admitted), Untouched::PodSandbox);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("config.json")).unwrap(),
            original
        );
        assert!(arbiter.calls.is_empty());
    }
}

#[test]
fn the_void_policy_hides_the_gpus_of_a_container_that_asks_for_nothing_without_a_lease() {
    let plain = spec(json!({}), &["NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"]);
    let mut arbiter = RecordingArbiter::default();
    let edit = edited(admit(&plain, &container(), &void_config(), &mut arbiter).unwrap());
    assert_eq!(
        edit.spec().env().get("NVIDIA_VISIBLE_DEVICES"),
        Some("void")
    );
    assert_eq!(edit.spec().env().get("PATH"), Some("/bin"));
    assert!(edit.lease().is_none());
    edit.withdraw(&mut arbiter).unwrap();
    assert!(arbiter.calls.is_empty(), "{:?}", arbiter.calls);
}

#[test]
fn an_invalid_request_is_refused_before_the_arbiter_is_asked() {
    for bad in [
        spec(json!({"gpushare.io/memory": "lots"}), &[]),
        spec(json!({"gpushare.io/memroy": "1Gi"}), &[]),
        spec(json!({}), &["GPUSHARE_GPU=all"]),
    ] {
        let mut arbiter = RecordingArbiter::default();
        let error = admit(&bad, &container(), &config(), &mut arbiter).unwrap_err();
        assert!(matches!(error, AdmissionError::Request(_)), "{error}");
        assert_eq!(error.class(), ErrorClass::InvalidRequest);
        assert!(
            error.to_string().starts_with("invalid request")
                || error.to_string().starts_with("unknown annotation"),
            "the parser's own words: {error}"
        );
        assert!(arbiter.calls.is_empty(), "{:?}", arbiter.calls);
    }
    // A tenant named where the node takes it from the pod's namespace: the policy applies.
    let mut config = config();
    config.requests.tenant_from = TenantSource::KubernetesNamespace;
    let forged_tenant = spec(json!({"gpushare.io/tenant": "inference"}), &[]);
    let mut arbiter = RecordingArbiter::default();
    let error = admit(&forged_tenant, &container(), &config, &mut arbiter).unwrap_err();
    assert_eq!(error.class(), ErrorClass::InvalidRequest);
    assert!(arbiter.calls.is_empty());
}

fn marked(lease: &str) -> Spec {
    spec(
        json!({"gpushare.io/memory": "1Gi", "gpushare.io/lease": lease, "gpushare.io/injected": "v1"}),
        &[],
    )
}

fn granted_to(container_id: &str) -> StatusReport {
    let mut granted = lease();
    granted.container_id = container_id.into();
    StatusReport {
        leases: vec![granted],
        ..Default::default()
    }
}

#[test]
fn a_spec_gpushare_edited_upstream_is_left_alone_when_its_lease_is_the_containers() {
    for holder in ["c1", &format!("{PENDING_PREFIX}5eed")] {
        let mut arbiter = RecordingArbiter::default().status(Ok(granted_to(holder)));
        let admitted = admit(&marked(LEASE), &container(), &void_config(), &mut arbiter).unwrap();
        assert_eq!(untouched(admitted), Untouched::AlreadyAdmitted, "{holder}");
        assert_eq!(arbiter.calls, [Call::Status], "checked, nothing reserved");
    }
}

#[test]
fn a_forged_marker_is_refused() {
    for (status, claimed) in [
        (granted_to("someone-else"), LEASE),
        (granted_to("c1"), "0000000000000bad"),
        (StatusReport::default(), LEASE),
    ] {
        let mut arbiter = RecordingArbiter::default().status(Ok(status));
        let error = admit(&marked(claimed), &container(), &config(), &mut arbiter).unwrap_err();
        assert!(
            matches!(error, AdmissionError::ForgedMarker { .. }),
            "{error}"
        );
        assert_eq!(error.class(), ErrorClass::InvalidRequest);
        let message = error.to_string();
        assert!(
            message.starts_with("container c1: ") && message.contains("cannot be set by hand"),
            "{message}"
        );
        assert_eq!(arbiter.calls, [Call::Status]);
    }
}

#[test]
fn a_marker_on_a_spec_that_has_no_container_yet_is_refused_without_asking() {
    let mut arbiter = RecordingArbiter::default();
    let pending = Identity::pending().unwrap();
    let error = admit(&marked(LEASE), &pending, &config(), &mut arbiter).unwrap_err();
    assert!(
        matches!(error, AdmissionError::MarkedBeforeCreation),
        "{error}"
    );
    assert_eq!(error.class(), ErrorClass::InvalidRequest);
    assert!(error.to_string().contains("cannot be set by hand"));
    assert!(arbiter.calls.is_empty());
}

#[test]
fn a_marker_that_cannot_be_checked_is_unavailable() {
    let mut arbiter = RecordingArbiter::default().status(Err(unreachable_arbiter()));
    let error = admit(&marked(LEASE), &container(), &config(), &mut arbiter).unwrap_err();
    assert_eq!(error.class(), ErrorClass::Unavailable, "{error}");
    assert!(error
        .to_string()
        .contains("cannot reach the gpushare arbiter"));
}

#[test]
fn an_image_the_driver_cannot_run_is_refused_before_anything_is_reserved() {
    let image = spec(
        json!({"gpushare.io/memory": "1Gi"}),
        &["CUDA_VERSION=12.4.1"],
    );
    let mut arbiter = RecordingArbiter::default().status(Ok(driver(12020)));
    let error = admit(&image, &container(), &config(), &mut arbiter).unwrap_err();
    assert!(
        matches!(error, AdmissionError::Incompatible { .. }),
        "{error}"
    );
    assert_eq!(error.class(), ErrorClass::InvalidRequest);
    let message = error.to_string();
    assert!(
        message.starts_with("container c1: ")
            && message.contains("CUDA_VERSION=12.4.1")
            && message.contains("CUDA 12.2"),
        "{message}"
    );
    assert_eq!(arbiter.calls, [Call::Status]);
    // The same image where the driver is new enough, or its version unknown.
    for status in [driver(12040), StatusReport::default()] {
        let mut arbiter = RecordingArbiter::default()
            .status(Ok(status))
            .reserve(Ok(lease()));
        assert!(admit(&image, &container(), &config(), &mut arbiter).is_ok());
    }
}

#[test]
fn without_the_arbiter_nothing_is_reserved_and_the_error_is_unavailable() {
    let mut arbiter = RecordingArbiter::default().status(Err(unreachable_arbiter()));
    let error = admit(&asking(), &container(), &config(), &mut arbiter).unwrap_err();
    assert_eq!(error.class(), ErrorClass::Unavailable);
    assert!(
        error
            .to_string()
            .starts_with("container c1: cannot reach the gpushare arbiter"),
        "{error}"
    );
    assert_eq!(arbiter.calls, [Call::Status]);
}

#[test]
fn a_refused_reserve_leaves_nothing_to_release() {
    for (kind, class) in [
        (ErrorKind::Unplaceable, ErrorClass::Unavailable),
        (ErrorKind::Internal, ErrorClass::Unavailable),
        // The arbiter's verdict on the request itself (an index it does not have).
        (ErrorKind::InvalidRequest, ErrorClass::InvalidRequest),
    ] {
        let mut arbiter = RecordingArbiter::default()
            .status(Ok(driver(12020)))
            .reserve(Err(refused(kind)));
        let error = admit(&asking(), &container(), &config(), &mut arbiter).unwrap_err();
        assert_eq!(error.class(), class, "{kind:?}");
        assert_eq!(error.to_string(), "container c1: refused by the arbiter");
        assert_eq!(arbiter.reserved().len(), 1);
        assert!(!arbiter.calls.iter().any(|c| matches!(c, Call::Release(_))));
    }
    // A reserve whose answer never came is an arbiter error too (the arbiter
    // releases a lease that is never confirmed).
    let mut arbiter = RecordingArbiter::default()
        .status(Ok(driver(12020)))
        .reserve(Err(ClientError::Broken("timed out".into())));
    let error = admit(&asking(), &container(), &config(), &mut arbiter).unwrap_err();
    assert_eq!(error.class(), ErrorClass::Unavailable);
}

#[test]
fn an_edit_that_fails_after_the_reserve_releases_the_lease() {
    // Parses (the request is an annotation) but cannot be edited: process.env is no list.
    for broken in [
        json!({"process": {"env": "PATH=/bin"}, "annotations": {"gpushare.io/memory": "1Gi"}}),
        json!({"hooks": [], "annotations": {"gpushare.io/memory": "1Gi"}}),
        json!({"mounts": {}, "annotations": {"gpushare.io/memory": "1Gi"}}),
    ] {
        let spec = Spec::from_value(broken.clone()).unwrap();
        let mut arbiter = RecordingArbiter::granting().release(Ok(true));
        let error = admit(&spec, &container(), &config(), &mut arbiter).unwrap_err();
        assert!(
            matches!(error, AdmissionError::Spec(_)),
            "{broken}: {error}"
        );
        assert_eq!(error.class(), ErrorClass::Failed);
        assert_eq!(
            arbiter.calls.last(),
            Some(&Call::Release(holder())),
            "{broken}: {:?}",
            arbiter.calls
        );
    }
    // The release failing too: the edit's error is still the one reported.
    let spec = Spec::from_value(
        json!({"process": {"env": "x"}, "annotations": {"gpushare.io/memory": "1Gi"}}),
    )
    .unwrap();
    let mut arbiter = RecordingArbiter::granting().release(Err(unreachable_arbiter()));
    let error = admit(&spec, &container(), &config(), &mut arbiter).unwrap_err();
    assert!(matches!(error, AdmissionError::Spec(_)), "{error}");
}

#[test]
fn a_granted_lease_is_edited_into_the_spec_and_its_undo_releases_it() {
    let pod_workload = spec(
        json!({"gpushare.io/memory": "1Gi", "gpushare.io/priority": "high",
               "io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "pod1",
               "io.kubernetes.cri.sandbox-namespace": "inference"}),
        &["NVIDIA_VISIBLE_DEVICES=all", "PATH=/bin"],
    );
    let mut arbiter = RecordingArbiter::granting();
    let edit = edited(admit(&pod_workload, &container(), &config(), &mut arbiter).unwrap());
    assert_eq!(
        arbiter.reserved(),
        [&ReserveRequest {
            container_id: "c1".into(),
            namespace: Some("containerd:k8s.io".into()),
            sandbox_id: Some("pod1".into()),
            priority: Priority::High,
            memory: Some(MemoryRequest::Bytes(1 << 30)),
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            gpu: Default::default(),
            // tenant_from = auto: the pod's namespace.
            tenant: Some("inference".into()),
            // Kubernetes: the arbiter is told the pod (no grant here).
            pod: Some(PodBinding {
                namespace: Some("inference".into()),
                ..PodBinding::default()
            }),
        }]
    );
    assert_eq!(arbiter.calls[0], Call::Status, "the CUDA check comes first");
    let spec = edit.spec();
    assert_eq!(spec.env().get("NVIDIA_VISIBLE_DEVICES"), Some(GPU));
    assert_eq!(spec.env().get("GPUSHARE_LEASE"), Some(LEASE));
    assert!(spec
        .env()
        .get("LD_PRELOAD")
        .is_some_and(|p| p.contains("libgpushare.so")));
    assert!(mutate::is_marked(spec));
    assert_eq!(mutate::lease_annotation(spec), Some(LEASE));
    assert_eq!(spec.hooks(HookStage::CreateRuntime).len(), 1);
    assert_eq!(spec.hooks(HookStage::Poststop).len(), 1);
    assert_eq!(spec.args(), ["sh"], "the command is not touched");
    assert_eq!(
        spec.clone().into_value()["root"],
        json!({"path": "rootfs"}),
        "nor anything else"
    );
    assert!(
        !mutate::is_marked(&pod_workload),
        "the spec admission was given is not changed"
    );

    let mut arbiter = RecordingArbiter::default().release(Ok(true));
    edit.withdraw(&mut arbiter).unwrap();
    assert_eq!(arbiter.calls, [Call::Release(holder())]);
}

#[test]
fn a_container_without_an_id_yet_reserves_under_its_pending_id() {
    let pending = Identity::pending().unwrap();
    let id = pending.container_id().to_owned();
    assert!(
        id.starts_with(PENDING_PREFIX) && id.len() == PENDING_PREFIX.len() + 32,
        "{id}"
    );
    assert_ne!(Identity::pending().unwrap(), pending, "random");
    let mut arbiter = RecordingArbiter::granting();
    let edit = edited(admit(&asking(), &pending, &config(), &mut arbiter).unwrap());
    let reserved = arbiter.reserved()[0];
    assert_eq!(
        (
            reserved.container_id.as_str(),
            reserved.namespace.as_deref()
        ),
        (id.as_str(), None)
    );
    let mut arbiter = RecordingArbiter::default().release(Ok(true));
    edit.withdraw(&mut arbiter).unwrap();
    assert_eq!(
        arbiter.calls,
        [Call::Release(ContainerRef {
            container_id: id.clone(),
            namespace: None,
            lease: Some(LeaseId(LEASE.into())),
        })]
    );
    // Errors do not name the pending id, which means nothing to the user.
    let mut arbiter = RecordingArbiter::default().status(Err(unreachable_arbiter()));
    let error = admit(&asking(), &pending, &config(), &mut arbiter).unwrap_err();
    assert!(error.to_string().starts_with("cannot reach"), "{error}");
}

#[test]
fn each_entry_points_namespace_keys_the_lease() {
    let cases = [
        (
            Namespace::Containerd("k8s.io".into()),
            Some("containerd:k8s.io"),
        ),
        (
            Namespace::RuntimeRoot("/run/docker/runtime-runc/moby".into()),
            Some("runtime-root:/run/docker/runtime-runc/moby"),
        ),
        (Namespace::Unknown, None),
    ];
    for (namespace, key) in cases {
        assert_eq!(namespace.key().as_deref(), key);
        let identity = Identity::container("c1", namespace);
        let mut arbiter = RecordingArbiter::granting();
        let _ = edited(admit(&asking(), &identity, &config(), &mut arbiter).unwrap());
        assert_eq!(arbiter.reserved()[0].namespace.as_deref(), key);
        assert_eq!(identity.holder(None).namespace.as_deref(), key);
    }
}

fn bundle_with(text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), text).unwrap();
    dir
}

fn on_disk(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("config.json")).unwrap()
}

const ASKING: &str = "{ \"ociVersion\": \"1.0.2\", \"process\": {\"env\": [\"PATH=/bin\"]},\n  \"annotations\": {\"gpushare.io/memory\": \"1Gi\"}, \"vendor.example/x\": [1, 2] }\n";

#[test]
fn a_prepared_bundle_holds_the_edit_and_its_undo_puts_the_bytes_back_and_releases() {
    let dir = bundle_with(ASKING);
    let mut arbiter = RecordingArbiter::granting();
    let prepared = match prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap()
    {
        Admitted::Edited(prepared) => prepared,
        Admitted::Untouched(why) => panic!("{why:?}"),
    };
    assert_eq!(prepared.lease(), Some(&LeaseId(LEASE.into())));
    let written = Spec::from_slice(on_disk(dir.path()).as_bytes()).unwrap();
    assert_eq!(written.env().get("GPUSHARE_LEASE"), Some(LEASE));
    assert_eq!(
        written.clone().into_value()["vendor.example/x"],
        json!([1, 2]),
        "unknown fields kept"
    );

    let mut arbiter = RecordingArbiter::default().release(Ok(true));
    prepared.undo(&mut arbiter).unwrap();
    assert_eq!(on_disk(dir.path()), ASKING, "byte for byte");
    assert_eq!(arbiter.calls, [Call::Release(holder())]);
}

#[test]
fn an_undo_whose_release_fails_still_restores_the_spec() {
    let dir = bundle_with(ASKING);
    let mut arbiter = RecordingArbiter::granting();
    let Admitted::Edited(prepared) =
        prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap()
    else {
        panic!("untouched")
    };
    let mut arbiter = RecordingArbiter::default().release(Err(unreachable_arbiter()));
    let error = prepared.undo(&mut arbiter).unwrap_err();
    assert!(error.restore.is_none());
    assert!(
        error
            .to_string()
            .starts_with(&format!("cannot release lease {LEASE}: cannot reach")),
        "{error}"
    );
    assert_eq!(on_disk(dir.path()), ASKING);
}

#[test]
fn a_void_bundle_is_undone_without_the_arbiter() {
    let original = "{\"process\": {\"env\": [\"NVIDIA_VISIBLE_DEVICES=all\"]}}";
    let dir = bundle_with(original);
    let mut arbiter = RecordingArbiter::default();
    let Admitted::Edited(prepared) =
        prepare_bundle(dir.path(), &container(), &void_config(), &mut arbiter).unwrap()
    else {
        panic!("untouched")
    };
    assert!(on_disk(dir.path()).contains("NVIDIA_VISIBLE_DEVICES=void"));
    assert_eq!(prepared.lease(), None);
    prepared.undo(&mut arbiter).unwrap();
    assert_eq!(on_disk(dir.path()), original);
    assert!(arbiter.calls.is_empty());
}

#[test]
fn a_refused_bundle_is_left_byte_for_byte() {
    let image = ASKING.replace("PATH=/bin", "CUDA_VERSION=12.4.1");
    let cases: Vec<(String, RecordingArbiter, ErrorClass)> = vec![
        (
            ASKING.replace("1Gi", "lots"),
            RecordingArbiter::default(),
            ErrorClass::InvalidRequest,
        ),
        (
            image,
            RecordingArbiter::default().status(Ok(driver(12020))),
            ErrorClass::InvalidRequest,
        ),
        (
            ASKING.to_owned(),
            RecordingArbiter::default()
                .status(Ok(driver(12020)))
                .reserve(Err(refused(ErrorKind::Unplaceable))),
            ErrorClass::Unavailable,
        ),
    ];
    for (text, mut arbiter, class) in cases {
        let dir = bundle_with(&text);
        let error = prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap_err();
        assert_eq!(error.class(), class, "{error}");
        assert_eq!(on_disk(dir.path()), text);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing left beside it"
        );
    }
}

#[test]
fn a_bundle_that_cannot_be_written_releases_the_lease_and_keeps_its_spec() {
    let dir = bundle_with(ASKING);
    // The atomic replace writes a temporary file beside config.json first: a
    // directory in its place makes the write fail, even for root.
    let blocker = dir
        .path()
        .join(format!(".config.json.gpushare-{}", std::process::id()));
    std::fs::create_dir(&blocker).unwrap();
    let mut arbiter = RecordingArbiter::granting().release(Ok(true));
    let error = prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap_err();
    assert!(matches!(error, AdmissionError::Bundle(_)), "{error}");
    assert_eq!(error.class(), ErrorClass::Failed);
    assert_eq!(arbiter.calls.last(), Some(&Call::Release(holder())));
    assert_eq!(on_disk(dir.path()), ASKING);
}

#[test]
fn a_bundle_without_a_spec_is_a_bundle_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut arbiter = RecordingArbiter::default();
    let error = prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap_err();
    assert!(matches!(error, AdmissionError::Bundle(_)), "{error}");
    assert!(error.to_string().contains("config.json"), "{error}");
    let dir = bundle_with("[]");
    let error = prepare_bundle(dir.path(), &container(), &config(), &mut arbiter).unwrap_err();
    assert!(error.to_string().contains("config.json"), "{error}");
    assert!(arbiter.calls.is_empty());
}

/// A pod's container as containerd's CRI plugin writes it, with `extra` annotations.
fn pod_container(extra: Value) -> Spec {
    let mut annotations = json!({
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.sandbox-id": "sandbox1",
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-name": "trainer-0",
        "io.kubernetes.cri.container-name": "app",
    });
    for (key, value) in extra.as_object().unwrap() {
        annotations[key] = value.clone();
    }
    spec(annotations, &["PATH=/bin"])
}

#[test]
fn a_granted_container_reserves_against_its_grants_with_its_pod() {
    let granted =
        pod_container(json!({GRANT_MEMORY_ANNOTATION: "g-m", GRANT_HIGH_ANNOTATION: "g-h"}));
    let mut arbiter = RecordingArbiter::granting();
    let edit = edited(admit(&granted, &container(), &config(), &mut arbiter).unwrap());
    assert_eq!(edit.lease().map(|l| l.id.0.as_str()), Some(LEASE));
    let reserved = arbiter.reserved()[0];
    assert_eq!(
        reserved.memory, None,
        "the arbiter takes the quota from the grant"
    );
    assert_eq!(reserved.sandbox_id.as_deref(), Some("sandbox1"));
    assert_eq!(
        reserved.pod,
        Some(PodBinding {
            namespace: Some("team-a".into()),
            name: Some("trainer-0".into()),
            container: Some("app".into()),
            grants: vec![GrantId("g-m".into()), GrantId("g-h".into())],
        })
    );
    // An annotation beside the grant is passed through: the arbiter judges it.
    let both = pod_container(json!({GRANT_MEMORY_ANNOTATION: "g-m", "gpushare.io/memory": "2Gi"}));
    let mut arbiter = RecordingArbiter::granting();
    let _ = edited(admit(&both, &container(), &config(), &mut arbiter).unwrap());
    assert_eq!(
        arbiter.reserved()[0].memory,
        Some(MemoryRequest::Bytes(2 << 30))
    );
}

#[test]
fn a_pause_container_holding_a_grant_annotation_is_still_untouched() {
    let pause = pod_container(
        json!({GRANT_MEMORY_ANNOTATION: "g-m", "io.kubernetes.cri.container-type": "sandbox"}),
    );
    let mut config = config();
    config.kubernetes.require_grant = true;
    let mut arbiter = RecordingArbiter::default();
    let admitted = admit(&pause, &container(), &config, &mut arbiter).unwrap();
    assert_eq!(untouched(admitted), Untouched::PodSandbox);
    assert!(arbiter.calls.is_empty());
}

#[test]
fn a_bad_grant_or_a_missing_required_one_is_refused_before_the_arbiter_is_asked() {
    let mut require = config();
    require.kubernetes.require_grant = true;
    for (spec, config, words) in [
        (
            pod_container(json!({GRANT_MEMORY_ANNOTATION: "G/1"})),
            config(),
            vec![
                GRANT_MEMORY_ANNOTATION,
                "\"G/1\"",
                gpushare_types::kubernetes::GRANT_ID_FORM,
            ],
        ),
        (
            pod_container(json!({"grant.gpushare.io/mem": "g-1"})),
            config(),
            vec!["grant.gpushare.io/mem", GRANT_MEMORY_ANNOTATION],
        ),
        (
            pod_container(json!({"gpushare.io/memory": "1Gi"})),
            require.clone(),
            vec!["kubernetes.require_grant"],
        ),
    ] {
        let mut arbiter = RecordingArbiter::default();
        let error = admit(&spec, &container(), &config, &mut arbiter).unwrap_err();
        assert!(matches!(error, AdmissionError::Request(_)), "{error}");
        assert_eq!(error.class(), ErrorClass::InvalidRequest);
        let message = error.to_string();
        for word in words {
            assert!(message.contains(word), "{word}: {message}");
        }
        assert!(arbiter.calls.is_empty(), "{:?}", arbiter.calls);
    }
    // With the grant, require_grant admits it.
    let granted = pod_container(json!({GRANT_MEMORY_ANNOTATION: "g-m"}));
    let mut arbiter = RecordingArbiter::granting();
    assert!(admit(&granted, &container(), &require, &mut arbiter).is_ok());
}

#[test]
fn the_arbiters_verdict_on_a_grant_is_passed_on_as_given() {
    // An unknown grant, one already backing a live lease, an annotation above the
    // grant: the arbiter's words, classed as the container's fault; a grant still
    // waiting for room: try again later.
    for (kind, class) in [
        (ErrorKind::InvalidRequest, ErrorClass::InvalidRequest),
        (ErrorKind::Unplaceable, ErrorClass::Unavailable),
    ] {
        let granted = pod_container(json!({GRANT_MEMORY_ANNOTATION: "g-m"}));
        let mut arbiter = RecordingArbiter::default()
            .status(Ok(driver(12020)))
            .reserve(Err(refused(kind)));
        let error = admit(&granted, &container(), &config(), &mut arbiter).unwrap_err();
        assert_eq!(error.class(), class, "{kind:?}");
        assert_eq!(error.to_string(), "container c1: refused by the arbiter");
        assert!(!arbiter.calls.iter().any(|c| matches!(c, Call::Release(_))));
    }
}

/// What an image can bake into its own environment (`ENV` in its Dockerfile): the
/// runtime sees it exactly as a variable the container's creator set.
const AN_IMAGES_OWN_ASKS: [&str; 3] = [
    "GPUSHARE_PRIORITY=high",
    "GPUSHARE_MEMORY=100%",
    "GPUSHARE_TENANT=inference",
];

/// A node of one 16 GiB GPU (all of it allocatable) whose driver runs CUDA 12.2.
fn one_gpu_node() -> StatusReport {
    let gpu: gpushare_proto::GpuStatus = serde_json::from_value(json!({
        "index": 0, "uuid": GPU, "name": "GPU 0", "memory_total": 16u64 << 30,
        "memory_allocatable": 16u64 << 30, "memory_leased": 0,
    }))
    .unwrap();
    StatusReport {
        gpus: vec![gpu],
        ..driver(12020)
    }
}

#[test]
fn an_images_own_environment_cannot_grant_it_priority_a_whole_gpu_or_a_tenant() {
    // high_priority_tenants names the tenant the image claims: outside Kubernetes
    // the tenant came from the request, so the image passed it too.
    let mut config = config();
    config.requests.high_priority_tenants = Some(vec!["inference".into()]);
    for (ask, what) in [
        ("GPUSHARE_PRIORITY=high", "low"),
        ("GPUSHARE_MEMORY=100%", "25%"),
        ("GPUSHARE_TENANT=inference", "no tenant"),
        ("GPUSHARE_COMPUTE_REQUEST=1", "0.25"),
    ] {
        for env in [AN_IMAGES_OWN_ASKS.to_vec(), vec![ask]] {
            let image = spec(json!({}), &env);
            let mut arbiter = RecordingArbiter::default()
                .status(Ok(one_gpu_node()))
                .reserve(Ok(lease()));
            let refused = admit(&image, &container(), &config, &mut arbiter);
            assert!(
                arbiter.reserved().is_empty(),
                "{env:?} reserved {:?}",
                arbiter.reserved()
            );
            let error = refused.unwrap_err();
            assert_eq!(error.class(), ErrorClass::InvalidRequest, "{error}");
            if env.len() > 1 {
                continue;
            }
            let msg = error.to_string();
            let (key, value) = ask.split_once('=').unwrap();
            for said in [
                format!("{key}={value:?}"),
                what.to_owned(),
                "requests.trust_environment".into(),
                "runtime.profiles".into(),
            ] {
                assert!(msg.contains(&said), "{ask}: says {said:?}: {msg}");
            }
        }
    }
}

#[test]
fn what_the_environment_may_not_ask_an_annotation_or_the_operators_profile_grants() {
    let reserved_for = |spec: &Spec, config: &Config, profile: Option<&str>| {
        let mut arbiter = RecordingArbiter::default()
            .status(Ok(one_gpu_node()))
            .reserve(Ok(lease()));
        admit_through(spec, &container(), config, profile, &mut arbiter)
            .unwrap_or_else(|e| panic!("{e}"));
        arbiter.reserved()[0].clone()
    };
    let mut config = config();
    config.requests.high_priority_tenants = Some(vec!["inference".into()]);
    let high_whole_inference = |r: &ReserveRequest| {
        assert_eq!(
            (r.priority, r.memory, r.tenant.as_deref()),
            (
                Priority::High,
                Some(MemoryRequest::Fraction(Fraction::ONE)),
                Some("inference")
            ),
            "{r:?}"
        )
    };
    // The creator's annotations (docker 24, podman, containerd).
    let annotated = spec(
        json!({"gpushare.io/priority": "high", "gpushare.io/memory": "100%", "gpushare.io/tenant": "inference"}),
        &[],
    );
    high_whole_inference(&reserved_for(&annotated, &config, None));
    // A runtime profile the operator defined, and a container that names nothing.
    config.runtime.profiles.insert(
        "high".into(),
        gpushare_config::RuntimeProfile {
            priority: Some(Priority::High),
            memory: Some(MemoryRequest::Fraction(Fraction::ONE)),
            tenant: Some("inference".into()),
            compute_request: None,
        },
    );
    let plain = spec(json!({}), &["PATH=/bin"]);
    high_whole_inference(&reserved_for(&plain, &config, Some("high")));
    // Through the profile, the environment may ask what it grants, or less.
    let image = spec(json!({}), &AN_IMAGES_OWN_ASKS);
    high_whole_inference(&reserved_for(&image, &config, Some("high")));
    let modest = spec(json!({}), &["GPUSHARE_PRIORITY=low", "GPUSHARE_MEMORY=2Gi"]);
    let r = reserved_for(&modest, &config, Some("high"));
    assert_eq!(
        (r.priority, r.memory, r.tenant.as_deref()),
        (
            Priority::Low,
            Some(MemoryRequest::Bytes(2 << 30)),
            Some("inference")
        )
    );
    // The operator's escape hatch: the environment is read as annotations are.
    config.requests.trust_environment = true;
    high_whole_inference(&reserved_for(&image, &config, None));
    // A profile the configuration does not define refuses the container, naming it.
    let mut arbiter = RecordingArbiter::default();
    let error =
        admit_through(&plain, &container(), &config, Some("hgih"), &mut arbiter).unwrap_err();
    assert_eq!(error.class(), ErrorClass::InvalidRequest);
    let msg = error.to_string();
    assert!(
        msg.contains("\"hgih\"") && msg.contains("high") && msg.contains("runtime.profiles"),
        "{msg}"
    );
    assert!(arbiter.calls.is_empty());
}

#[test]
fn the_environment_may_ask_up_to_the_nodes_ceilings() {
    // Default ceilings: arbiter.default_memory (25 %) and a 0.25 compute request.
    for env in [
        vec!["GPUSHARE_MEMORY=4Gi"],
        vec!["GPUSHARE_MEMORY=25%", "GPUSHARE_COMPUTE_REQUEST=0.25"],
        vec!["GPUSHARE_PRIORITY=low", "GPUSHARE_MEMORY=0.1"],
    ] {
        let mut arbiter = RecordingArbiter::default()
            .status(Ok(one_gpu_node()))
            .reserve(Ok(lease()));
        let admitted = admit(
            &spec(json!({}), &env),
            &container(),
            &config(),
            &mut arbiter,
        );
        assert!(admitted.is_ok(), "{env:?}: {:?}", admitted.err());
    }
    // 4 GiB and a byte more, of a 16 GiB GPU; then the ceiling set in bytes.
    let over = spec(json!({}), &["GPUSHARE_MEMORY=4294967297"]);
    let mut arbiter = RecordingArbiter::default().status(Ok(one_gpu_node()));
    let error = admit(&over, &container(), &config(), &mut arbiter).unwrap_err();
    assert!(
        error.to_string().contains("requests.env_memory_ceiling"),
        "{error}"
    );
    let mut config = config();
    config.requests.env_memory_ceiling = Some(MemoryRequest::Bytes(8 << 30));
    let mut arbiter = RecordingArbiter::default()
        .status(Ok(one_gpu_node()))
        .reserve(Ok(lease()));
    admit(&over, &container(), &config, &mut arbiter).unwrap();
    let half = spec(json!({}), &["GPUSHARE_MEMORY=51%"]);
    let mut arbiter = RecordingArbiter::default().status(Ok(one_gpu_node()));
    let msg = admit(&half, &container(), &config, &mut arbiter)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("at most 8Gi"), "{msg}");
}
