//! Kubernetes end to end: pods through containerd's real CRI plugin (Debian 12's
//! containerd 1.6), with the gpushare handler's shim or gpushare-runc, runc, the
//! real arbiter and the real device plugin `gpushare-kube`, registered with the
//! test kubelet (`gpushare_cri::kubelet::TestKubelet`: kubelet's device-plugin
//! manager and PodResources server), the test playing the rest of kubelet over CRI.
//!
//! What must hold: each app container's lease is reserved against the grant its
//! `Allocate` answer named, with exactly the grant's quota and its pod's names; the
//! pause container gets nothing; a restart reuses the grant; deleting the pod
//! releases the leases and the plugin collects the grants; a grant forged in the
//! pod's own annotations never reaches a container; kubelet and arbiter restarts
//! keep live pods' leases and grants; a grant that waits for room makes its
//! container's create wait, not the pod fail.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpushare_cri::kubelet::{Allocation, TestKubelet};
use gpushare_cri::{api, CONTAINER_TYPE_ANNOTATION};
use gpushare_e2e::cri::{annotation, env, CriNode, Entry, HANDLER, IMAGE};
use gpushare_e2e::*;
use gpushare_types::kubernetes::{GRANT_MEMORY_ANNOTATION, MEMORY_RESOURCE};
use serde_json::Value;

const GIB: u64 = 1 << 30;

/// The test machine's GPUs: two simulated 8 GiB GPUs, 16 units of 1 GiB.
const GPUS: u32 = 2;
const GPU_MEMORY: &str = "8Gi";
const UNITS: usize = 16;

/// The device plugin, as its DaemonSet runs it: `gpushare-kube --config`.
struct KubePlugin {
    child: Child,
    log: PathBuf,
}

impl KubePlugin {
    fn start(dir: &Path, config: &Path) -> KubePlugin {
        gpushare_testkit::binaries::require(&["gpushare-kube"]);
        let log = dir.join("gpushare-kube.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(bin("gpushare-kube"))
            .arg("--config")
            .arg(config)
            .env("GPUSHARE_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start gpushare-kube");
        KubePlugin { child, log }
    }

    fn log(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().rev().take(20).collect();
        format!(
            "\n--- gpushare-kube.log (last lines) ---\n{}",
            lines.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }
}

impl Drop for KubePlugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One node: dropped in field order (pods, containerd, the plugin, the kubelet,
/// the arbiter, the directory).
struct Cluster {
    node: CriNode,
    plugin: KubePlugin,
    kubelet: TestKubelet,
    arbiter: Arbiter,
    _dir: tempfile::TempDir,
}

#[derive(Clone, Copy)]
struct Settings {
    require_grant: bool,
    /// How long a reserve waits in the arbiter's admission queue.
    admission_wait_ms: u64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            require_grant: false,
            admission_wait_ms: 5_000,
        }
    }
}

impl Cluster {
    fn start(entry: Entry, settings: Settings) -> Cluster {
        require_root();
        let dir = scratch();
        let plugin_dir = dir.path().join("device-plugins");
        let pod_resources = dir.path().join("pod-resources/kubelet.sock");
        std::fs::create_dir_all(&plugin_dir).unwrap();
        std::fs::create_dir_all(pod_resources.parent().unwrap()).unwrap();
        let (plugins, resources) = (plugin_dir.clone(), pod_resources.clone());
        let arbiter = Arbiter::start(
            dir.path(),
            ArbiterOptions {
                gpus: GPUS,
                memory: GPU_MEMORY,
                simulated_driver: Some("12020"),
                configure: Some(Box::new(move |config: &mut Config| {
                    let k = &mut config.kubernetes;
                    k.memory_unit = gpushare_proto::ByteSize(GIB);
                    k.device_plugin_dir = plugins;
                    k.pod_resources_socket = resources;
                    k.poll_interval_ms = 100;
                    k.collect_interval_ms = 200;
                    k.collect_grace_ms = 500;
                    k.require_grant = settings.require_grant;
                    config.arbiter.admission_wait_ms = settings.admission_wait_ms;
                })),
            },
        );
        let kubelet = TestKubelet::start(&plugin_dir, &pod_resources);
        let plugin = KubePlugin::start(dir.path(), &arbiter.config_path);
        kubelet
            .wait_for_resource(MEMORY_RESOURCE, UNITS, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{MEMORY_RESOURCE} never advertised: {e}{}", plugin.log()));
        let node = CriNode::start(entry, dir.path(), &arbiter.config_path);
        Cluster {
            node,
            plugin,
            kubelet,
            arbiter,
            _dir: dir,
        }
    }

    fn cri(&self) -> &gpushare_cri::Cri {
        &self.node.cri
    }

    /// What went wrong, from every daemon's log.
    fn logs(&self) -> String {
        format!(
            "{}{}\n--- arbiter.log ---\n{}",
            self.node.log(),
            self.plugin.log(),
            self.arbiter.log_tail(20)
        )
    }

    fn run_pod(&self, pod: &Pod) -> String {
        self.cri()
            .run_pod_sandbox(&pod.config, HANDLER)
            .unwrap_or_else(|e| panic!("RunPodSandbox {}: {e}{}", pod.name, self.logs()))
    }

    /// kubelet's Allocate for one container, memory units only.
    fn allocate(&self, pod: &Pod, container: &str, units: usize) -> Allocation {
        self.kubelet
            .allocate(
                &pod.uid,
                &pod.namespace,
                &pod.name,
                container,
                &[(MEMORY_RESOURCE, units)],
            )
            .unwrap_or_else(|e| panic!("Allocate {container}: {e}{}", self.plugin.log()))
    }

    /// kubelet's CreateContainer for `container` (attempt `attempt`) with its
    /// allocation applied.
    fn try_create(
        &self,
        sandbox: &str,
        pod: &Pod,
        container: &str,
        attempt: u32,
        allocation: Option<&Allocation>,
    ) -> Result<String, gpushare_cri::CriError> {
        let mut config = gpushare_cri::container(container, IMAGE, &["/bin/sleep", "3600"]);
        config.metadata.as_mut().unwrap().attempt = attempt;
        if let Some(allocation) = allocation {
            allocation.apply(&mut config);
        }
        self.cri().create_container(sandbox, &config, &pod.config)
    }

    /// Creates and starts it, failing the test if either fails.
    fn start_container(
        &self,
        sandbox: &str,
        pod: &Pod,
        container: &str,
        attempt: u32,
        allocation: Option<&Allocation>,
    ) -> String {
        let id = self
            .try_create(sandbox, pod, container, attempt, allocation)
            .unwrap_or_else(|e| panic!("CreateContainer {container}: {e}{}", self.logs()));
        self.cri()
            .start_container(&id)
            .unwrap_or_else(|e| panic!("StartContainer {container}: {e}{}", self.logs()));
        id
    }

    /// What kubelet does when a pod is deleted: its containers stopped, the
    /// sandbox stopped and removed, its devices forgotten (PodResources).
    fn delete_pod(&self, sandbox: &str, pod: &Pod) {
        let filter = api::ContainerFilter {
            pod_sandbox_id: sandbox.into(),
            ..Default::default()
        };
        for c in self.cri().list_containers(Some(filter)).unwrap() {
            self.cri().stop_container(&c.id, Duration::ZERO).unwrap();
            self.cri().remove_container(&c.id).unwrap();
        }
        self.cri().stop_pod_sandbox(sandbox).unwrap();
        self.cri().remove_pod_sandbox(sandbox).unwrap();
        self.kubelet.remove_pod(&pod.uid);
    }

    fn leases(&self) -> Vec<Value> {
        self.arbiter.leases()
    }

    fn grants(&self) -> Vec<Value> {
        self.arbiter.status()["grants"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    fn lease_of(&self, container_id: &str) -> Value {
        let leases = self.leases();
        leases
            .iter()
            .find(|l| l["container_id"] == container_id)
            .cloned()
            .unwrap_or_else(|| panic!("no lease for {container_id}: {leases:#?}"))
    }

    fn grant(&self, id: &str) -> Value {
        let grants = self.grants();
        grants
            .iter()
            .find(|g| g["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no grant {id}: {grants:#?}"))
    }
}

struct Pod {
    name: String,
    namespace: String,
    uid: String,
    config: api::PodSandboxConfig,
}

fn pod(name: &str, uid_suffix: u32, annotations: HashMap<String, String>) -> Pod {
    let uid = format!("c6a3c9a2-0017-4000-8000-{uid_suffix:012}");
    Pod {
        config: gpushare_cri::host_network_pod(name, "team-a", &uid, annotations),
        name: name.into(),
        namespace: "team-a".into(),
        uid,
    }
}

fn grant_id(allocation: &Allocation) -> String {
    allocation
        .annotations
        .get(GRANT_MEMORY_ANNOTATION)
        .unwrap_or_else(|| panic!("Allocate named no memory grant: {allocation:?}"))
        .clone()
}

/// The lease's binding as the arbiter reports it.
fn binding(lease: &Value) -> (Value, Value, Value, Value) {
    let pod = &lease["pod"];
    (
        pod["namespace"].clone(),
        pod["name"].clone(),
        pod["container"].clone(),
        pod["grants"].clone(),
    )
}

fn bound_to(pod: &Pod, container: &str, grant: &str) -> (Value, Value, Value, Value) {
    (
        pod.namespace.as_str().into(),
        pod.name.as_str().into(),
        container.into(),
        serde_json::json!([grant]),
    )
}

// --- a pod with two app containers ---------------------------------------------

fn two_app_containers_each_get_their_grant(entry: Entry) {
    let c = Cluster::start(entry, Settings::default());
    let trainer = pod("trainer", 1, HashMap::new());
    let sandbox = c.run_pod(&trainer);
    let mut apps = Vec::new();
    for (name, units) in [("app-a", 2u64), ("app-b", 3)] {
        let allocation = c.allocate(&trainer, name, units as usize);
        let id = c.start_container(&sandbox, &trainer, name, 0, Some(&allocation));
        apps.push((name, units, grant_id(&allocation), id));
    }

    c.node.assert_served_by(&sandbox, entry);
    for (name, units, grant, id) in &apps {
        let spec = c.node.spec(id);
        assert_eq!(
            annotation(&spec, GRANT_MEMORY_ANNOTATION),
            Some(grant.as_str()),
            "{entry:?} {name}: container_annotations passes the grant: {}",
            spec["annotations"]
        );
        let lease = c.lease_of(id);
        assert_eq!(
            annotation(&spec, "gpushare.io/lease"),
            lease["id"].as_str(),
            "{entry:?} {name}"
        );
        assert_eq!(
            lease["memory_bytes"].as_u64(),
            Some(units * GIB),
            "{entry:?} {name}: the quota is the grant's: {lease:#}"
        );
        assert_eq!(
            binding(&lease),
            bound_to(&trainer, name, grant),
            "{entry:?} {name}: {lease:#}"
        );
        let g = c.grant(grant);
        assert_eq!(g["lease"], lease["id"], "{entry:?} {name}: {g:#}");
        assert_eq!(
            g["amount"],
            serde_json::json!({"resource": "memory", "bytes": units * GIB}),
            "{g:#}"
        );
        assert_eq!(
            lease["gpus"],
            serde_json::json!([g["gpu"]]),
            "{entry:?} {name}: the lease is on its grant's GPU"
        );
    }
    let pause = c.node.spec(&sandbox);
    assert_eq!(
        annotation(&pause, CONTAINER_TYPE_ANNOTATION),
        Some("sandbox")
    );
    assert_eq!(annotation(&pause, "gpushare.io/lease"), None, "{entry:?}");
    assert_eq!(env(&pause, "NVIDIA_VISIBLE_DEVICES"), None, "{entry:?}");
    let leases = c.leases();
    assert_eq!(leases.len(), 2, "{entry:?}: the apps' only: {leases:#?}");
    assert!(leases.iter().all(|l| l["container_id"] != sandbox.as_str()));
}

#[test]
fn through_the_shim_two_app_containers_each_get_their_grant() {
    two_app_containers_each_get_their_grant(Entry::Shim);
}

#[test]
fn through_gpushare_runc_two_app_containers_each_get_their_grant() {
    two_app_containers_each_get_their_grant(Entry::RuncBinary);
}

// --- a container restart -------------------------------------------------------

fn a_restarted_container_reuses_its_grant(entry: Entry) {
    let c = Cluster::start(entry, Settings::default());
    let web = pod("web", 2, HashMap::new());
    let sandbox = c.run_pod(&web);
    let allocation = c.allocate(&web, "app", 2);
    let grant = grant_id(&allocation);
    let first = c.start_container(&sandbox, &web, "app", 0, Some(&allocation));
    let first_lease = c.lease_of(&first)["id"].clone();

    // The container ends (a failed liveness probe: kubelet kills it), and kubelet
    // creates attempt 1 with the allocation it recorded, then removes the old one.
    c.cri().stop_container(&first, Duration::ZERO).unwrap();
    wait_until(
        "the first attempt's lease to end",
        Duration::from_secs(10),
        || c.leases().is_empty(),
    );
    let second = c.start_container(&sandbox, &web, "app", 1, Some(&allocation));
    c.cri().remove_container(&first).unwrap();

    let lease = c.lease_of(&second);
    assert_ne!(lease["id"], first_lease, "{entry:?}: a new lease");
    assert_eq!(
        binding(&lease),
        bound_to(&web, "app", &grant),
        "{entry:?}: {lease:#}"
    );
    assert_eq!(lease["memory_bytes"].as_u64(), Some(2 * GIB), "{lease:#}");
    let grants = c.grants();
    assert_eq!(grants.len(), 1, "{entry:?}: no second grant: {grants:#?}");
    assert_eq!(grants[0]["id"], grant.as_str());
    assert_eq!(grants[0]["lease"], lease["id"], "{grants:#?}");
}

#[test]
fn through_the_shim_a_restarted_container_reuses_its_grant() {
    a_restarted_container_reuses_its_grant(Entry::Shim);
}

#[test]
fn through_gpushare_runc_a_restarted_container_reuses_its_grant() {
    a_restarted_container_reuses_its_grant(Entry::RuncBinary);
}

// --- pod deletion --------------------------------------------------------------

fn deleting_the_pod_releases_its_leases_and_its_grants_are_collected(entry: Entry) {
    let c = Cluster::start(entry, Settings::default());
    let job = pod("job", 3, HashMap::new());
    let sandbox = c.run_pod(&job);
    for name in ["app-a", "app-b"] {
        let allocation = c.allocate(&job, name, 1);
        let app = c.start_container(&sandbox, &job, name, 0, Some(&allocation));
        let grant = grant_id(&allocation);
        assert_eq!(binding(&c.lease_of(&app)), bound_to(&job, name, &grant));
        assert_eq!(c.grant(&grant)["lease"], c.lease_of(&app)["id"]);
    }
    assert_eq!(c.leases().len(), 2);
    assert_eq!(c.grants().len(), 2);

    c.delete_pod(&sandbox, &job);
    wait_until(
        "every lease to be released",
        Duration::from_secs(10),
        || c.leases().is_empty(),
    );
    wait_until(
        "the plugin to collect the grants (no pod holds their devices)",
        Duration::from_secs(10),
        || c.grants().is_empty(),
    );
    assert_eq!(
        c.arbiter.lease_dirs(),
        0,
        "{entry:?}: lease directories left"
    );
}

#[test]
fn through_the_shim_deleting_the_pod_releases_its_leases_and_grants() {
    deleting_the_pod_releases_its_leases_and_its_grants_are_collected(Entry::Shim);
}

#[test]
fn through_gpushare_runc_deleting_the_pod_releases_its_leases_and_grants() {
    deleting_the_pod_releases_its_leases_and_its_grants_are_collected(Entry::RuncBinary);
}

// --- a forged pod-level grant --------------------------------------------------

/// A pod naming `stolen` (another pod's grant) in its own annotations, which
/// pod_annotations would copy into its containers if the pattern matched, beside
/// an ordinary request (which it does copy).
fn forger(uid_suffix: u32, stolen: &str) -> Pod {
    pod(
        "forger",
        uid_suffix,
        HashMap::from([
            (GRANT_MEMORY_ANNOTATION.to_owned(), stolen.to_owned()),
            ("gpushare.io/memory".to_owned(), "1Gi".to_owned()),
        ]),
    )
}

/// The victim's grant is allocated but not yet used; the forger's pod names it
/// in its own annotations (which pod_annotations would copy if it matched).
fn a_forged_pod_level_grant_is_dropped(entry: Entry) {
    let c = Cluster::start(entry, Settings::default());
    let victim = pod("victim", 4, HashMap::new());
    let victim_sandbox = c.run_pod(&victim);
    let victims = c.allocate(&victim, "app", 4);
    let stolen = grant_id(&victims);

    let forger = forger(5, &stolen);
    let forger_sandbox = c.run_pod(&forger);
    let app = c.start_container(&forger_sandbox, &forger, "app", 0, None);
    let spec = c.node.spec(&app);
    assert_eq!(
        annotation(&spec, GRANT_MEMORY_ANNOTATION),
        None,
        "{entry:?}: the pod's grant key reached the container: {}",
        spec["annotations"]
    );
    assert_eq!(
        annotation(&spec, "gpushare.io/memory"),
        Some("1Gi"),
        "the pod's request does (else this test proves nothing)"
    );
    let lease = c.lease_of(&app);
    assert_eq!(
        lease["memory_bytes"].as_u64(),
        Some(GIB),
        "not enlarged: {lease:#}"
    );
    assert_eq!(lease["pod"]["grants"], Value::Null, "not bound: {lease:#}");
    assert_eq!(c.grant(&stolen)["lease"], Value::Null);

    // The rightful owner still uses it.
    let owner = c.start_container(&victim_sandbox, &victim, "app", 0, Some(&victims));
    let lease = c.lease_of(&owner);
    assert_eq!(
        binding(&lease),
        bound_to(&victim, "app", &stolen),
        "{lease:#}"
    );
    assert_eq!(lease["memory_bytes"].as_u64(), Some(4 * GIB));
}

#[test]
fn through_the_shim_a_forged_pod_level_grant_is_dropped() {
    a_forged_pod_level_grant_is_dropped(Entry::Shim);
}

#[test]
fn through_gpushare_runc_a_forged_pod_level_grant_is_dropped() {
    a_forged_pod_level_grant_is_dropped(Entry::RuncBinary);
}

/// With `kubernetes.require_grant`, the forger's container (which has only the
/// dropped grant) is refused at create, while a granted container runs.
fn with_require_grant_a_forged_grant_alone_is_refused(entry: Entry) {
    let c = Cluster::start(
        entry,
        Settings {
            require_grant: true,
            ..Settings::default()
        },
    );
    let victim = pod("victim", 6, HashMap::new());
    let victim_sandbox = c.run_pod(&victim);
    let victims = c.allocate(&victim, "app", 2);
    let stolen = grant_id(&victims);
    let forger = forger(7, &stolen);
    let forger_sandbox = c.run_pod(&forger);
    let error = c
        .try_create(&forger_sandbox, &forger, "app", 0, None)
        .and_then(|id| c.cri().start_container(&id).map(|()| id))
        .expect_err("a pod's share without a grant ran under require_grant");
    assert!(
        error.to_string().contains("kubernetes.require_grant"),
        "{entry:?}: {error}"
    );
    assert!(c.leases().is_empty(), "{:#?}", c.leases());
    let owner = c.start_container(&victim_sandbox, &victim, "app", 0, Some(&victims));
    assert_eq!(
        binding(&c.lease_of(&owner)),
        bound_to(&victim, "app", &stolen)
    );
}

#[test]
fn through_the_shim_with_require_grant_a_forged_grant_alone_is_refused() {
    with_require_grant_a_forged_grant_alone_is_refused(Entry::Shim);
}

#[test]
fn through_gpushare_runc_with_require_grant_a_forged_grant_alone_is_refused() {
    with_require_grant_a_forged_grant_alone_is_refused(Entry::RuncBinary);
}

// --- kubelet and arbiter restarts ----------------------------------------------

#[test]
fn after_a_kubelet_restart_the_plugin_registers_again_and_pods_keep_their_leases() {
    let mut c = Cluster::start(Entry::Shim, Settings::default());
    let old = pod("old", 8, HashMap::new());
    let old_sandbox = c.run_pod(&old);
    let allocation = c.allocate(&old, "app", 2);
    let app = c.start_container(&old_sandbox, &old, "app", 0, Some(&allocation));
    let before = c.lease_of(&app);

    c.kubelet.restart().unwrap();
    c.kubelet
        .wait_registered(MEMORY_RESOURCE, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the plugin did not register again: {e}{}", c.plugin.log()));
    c.kubelet
        .wait_for_resource(MEMORY_RESOURCE, UNITS, Duration::from_secs(30))
        .unwrap();
    assert!(
        c.kubelet.registrations(MEMORY_RESOURCE) >= 2,
        "registered again after the restart"
    );
    assert_eq!(
        c.lease_of(&app),
        before,
        "the running pod's lease is untouched"
    );
    assert_eq!(c.grant(&grant_id(&allocation))["lease"], before["id"]);

    let new = pod("new", 9, HashMap::new());
    let new_sandbox = c.run_pod(&new);
    let fresh = c.allocate(&new, "app", 3);
    let app = c.start_container(&new_sandbox, &new, "app", 0, Some(&fresh));
    let lease = c.lease_of(&app);
    assert_eq!(binding(&lease), bound_to(&new, "app", &grant_id(&fresh)));
    assert_eq!(lease["memory_bytes"].as_u64(), Some(3 * GIB));
}

fn after_an_arbiter_restart_leases_and_grants_survive(entry: Entry) {
    let mut c = Cluster::start(entry, Settings::default());
    let svc = pod("svc", 10, HashMap::new());
    let sandbox = c.run_pod(&svc);
    let first = c.allocate(&svc, "app-a", 2);
    let second = c.allocate(&svc, "app-b", 1);
    let a = c.start_container(&sandbox, &svc, "app-a", 0, Some(&first));
    let lease = c.lease_of(&a);
    let grants = c.grants();

    c.arbiter.restart();
    assert_eq!(c.lease_of(&a), lease, "{entry:?}: same lease, same binding");
    let mut after = c.grants();
    let mut before = grants.clone();
    for list in [&mut after, &mut before] {
        list.sort_by_key(|g| g["id"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(after, before, "{entry:?}: same grants");

    // A new container of the live pod uses its grant (allocated before the restart).
    let b = c.start_container(&sandbox, &svc, "app-b", 0, Some(&second));
    let lease = c.lease_of(&b);
    assert_eq!(
        binding(&lease),
        bound_to(&svc, "app-b", &grant_id(&second)),
        "{lease:#}"
    );
    assert_eq!(lease["memory_bytes"].as_u64(), Some(GIB));
}

#[test]
fn through_the_shim_after_an_arbiter_restart_leases_and_grants_survive() {
    after_an_arbiter_restart_leases_and_grants_survive(Entry::Shim);
}

#[test]
fn through_gpushare_runc_after_an_arbiter_restart_leases_and_grants_survive() {
    after_an_arbiter_restart_leases_and_grants_survive(Entry::RuncBinary);
}

// --- a grant that waits for room -----------------------------------------------

/// Two pods take 6 of each GPU's 8 GiB; 4 units are left in the pool, but no GPU
/// has 4 GiB: the grant is recorded as waiting (Allocate succeeds), the
/// container's create fails while the room is taken (kubelet would retry), and
/// succeeds once a pod is deleted.
fn a_grant_waits_for_room(entry: Entry) {
    let c = Cluster::start(
        entry,
        Settings {
            admission_wait_ms: 500,
            ..Settings::default()
        },
    );
    let mut fillers = Vec::new();
    for (i, name) in ["fill-a", "fill-b"].into_iter().enumerate() {
        let filler = pod(name, 11 + i as u32, HashMap::new());
        let sandbox = c.run_pod(&filler);
        let allocation = c.allocate(&filler, "app", 6);
        c.start_container(&sandbox, &filler, "app", 0, Some(&allocation));
        fillers.push((filler, sandbox));
    }
    let gpus: Vec<Value> = c.leases().iter().map(|l| l["gpus"][0].clone()).collect();
    assert_ne!(gpus[0], gpus[1], "worst fit spreads the fillers: {gpus:?}");

    let late = pod("late", 13, HashMap::new());
    let sandbox = c.run_pod(&late);
    let allocation = c.allocate(&late, "app", 4);
    let grant = grant_id(&allocation);
    assert_eq!(c.grant(&grant)["gpu"], Value::Null, "waiting for room");
    let error = c
        .try_create(&sandbox, &late, "app", 0, Some(&allocation))
        .and_then(|id| c.cri().start_container(&id).map(|()| id))
        .expect_err("a container whose grant has no room yet ran");
    let message = error.to_string();
    assert!(
        message.contains("gpushare") && message.contains("4Gi"),
        "{entry:?}: refused by gpushare for the grant's 4Gi, not for another reason: {message}"
    );
    assert_eq!(c.leases().len(), 2, "{entry:?}: {error}: {:#?}", c.leases());

    let (filler, filler_sandbox) = &fillers[0];
    c.delete_pod(filler_sandbox, filler);
    wait_until(
        "the waiting grant to be placed",
        Duration::from_secs(10),
        || !c.grant(&grant)["gpu"].is_null(),
    );
    // kubelet retries the create (with the next attempt's name, the failed one is gone).
    let app = c.start_container(&sandbox, &late, "app", 1, Some(&allocation));
    let lease = c.lease_of(&app);
    assert_eq!(binding(&lease), bound_to(&late, "app", &grant), "{lease:#}");
    assert_eq!(lease["memory_bytes"].as_u64(), Some(4 * GIB));
    assert_eq!(lease["gpus"], serde_json::json!([c.grant(&grant)["gpu"]]));
}

#[test]
fn through_the_shim_a_grant_waits_for_room() {
    a_grant_waits_for_room(Entry::Shim);
}

#[test]
fn through_gpushare_runc_a_grant_waits_for_room() {
    a_grant_waits_for_room(Entry::RuncBinary);
}

// --- what a grant does not allow ------------------------------------------------

/// The arbiter's grant rules, through the runtime: an annotation asking for more
/// memory than the container's grant is refused naming both, and a grant backs one
/// live lease (a second container given the same allocation is refused).
fn a_container_can_neither_exceed_nor_share_its_grant(entry: Entry) {
    let c = Cluster::start(entry, Settings::default());
    let greedy = pod("greedy", 14, HashMap::new());
    let sandbox = c.run_pod(&greedy);
    let allocation = c.allocate(&greedy, "app", 2);
    let grant = grant_id(&allocation);

    let start = |name: &str, extra: &[(&str, &str)]| {
        let mut config = gpushare_cri::container(name, IMAGE, &["/bin/sleep", "3600"]);
        allocation.apply(&mut config);
        for (key, value) in extra {
            config
                .annotations
                .insert((*key).to_owned(), (*value).to_owned());
        }
        c.cri()
            .create_container(&sandbox, &config, &greedy.config)
            .and_then(|id| c.cri().start_container(&id).map(|()| id))
    };
    let error = start("big", &[("gpushare.io/memory", "4Gi")])
        .expect_err("a container above its grant ran")
        .to_string();
    assert!(
        error.contains(&grant) && error.contains("4Gi") && error.contains("2Gi"),
        "{entry:?}: names the grant, the ask and the grant's size: {error}"
    );
    assert!(c.leases().is_empty(), "{:#?}", c.leases());
    assert_eq!(c.grant(&grant)["lease"], Value::Null);

    let app = start("app", &[]).unwrap_or_else(|e| panic!("{e}{}", c.logs()));
    let lease = c.lease_of(&app);
    let error = start("twin", &[])
        .expect_err("two live leases on one grant")
        .to_string();
    assert!(
        error.contains(&grant) && error.contains(lease["id"].as_str().unwrap()),
        "{entry:?}: names the grant and the lease it backs: {error}"
    );
    assert_eq!(c.leases().len(), 1, "{:#?}", c.leases());
    assert_eq!(c.grant(&grant)["lease"], lease["id"]);
}

#[test]
fn through_the_shim_a_container_can_neither_exceed_nor_share_its_grant() {
    a_container_can_neither_exceed_nor_share_its_grant(Entry::Shim);
}

#[test]
fn through_gpushare_runc_a_container_can_neither_exceed_nor_share_its_grant() {
    a_container_can_neither_exceed_nor_share_its_grant(Entry::RuncBinary);
}
