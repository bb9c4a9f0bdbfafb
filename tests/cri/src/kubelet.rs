//! A test kubelet: the device-plugin side of kubelet only, over real gRPC on unix
//! sockets, for the device plugin's tests and the CRI end-to-end tests (no kubelet
//! can run on the test machines).
//!
//! What it does as kubelet does: serves `Registration` on `<plugin_dir>/kubelet.sock`;
//! on `Register` connects to the plugin's endpoint, asks its options and keeps a
//! `ListAndWatch` stream; allocates free healthy ids (not held by a live pod's
//! container) and calls `Allocate`; serves PodResources v1 with what it allocated;
//! and a restart deletes every file in its plugin directory. What it does not: the
//! pod lifecycle (tests call [`TestKubelet::allocate`] and
//! [`TestKubelet::remove_pod`]), checkpoints of device health, topology. One
//! difference is stricter than kubelet: `Register` dials the plugin before it
//! answers (kubelet answers, then dials), so a plugin that registers before it
//! serves fails here at once rather than by a log line in kubelet's journal.
//!
//! Blocking, like [`crate::Cri`]: it runs its servers on a runtime of its own.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpushare_kube::api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpushare_kube::api::deviceplugin::registration_server::{Registration, RegistrationServer};
use gpushare_kube::api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse, Empty,
    ListAndWatchResponse, RegisterRequest,
};
use gpushare_kube::api::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpushare_kube::api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, GetPodResourcesRequest, GetPodResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, PodResources,
};
use gpushare_kube::unix::{self, UnixError};
use gpushare_kube::{DEVICE_PLUGIN_VERSION, HEALTHY, KUBELET_SOCKET};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::api;

/// How often the blocking waits look again.
const POLL: Duration = Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("could not start the test kubelet's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Unix(#[from] UnixError),
    #[error("could not empty the plugin directory {}: {source}", dir.display())]
    Clean {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no device plugin registered {resource}; registered: {registered:?}")]
    UnknownResource {
        resource: String,
        registered: Vec<String>,
    },
    #[error("{resource}: {wanted} devices wanted, {free} free and healthy")]
    Insufficient {
        resource: String,
        wanted: usize,
        free: usize,
    },
    #[error("Allocate of {resource} failed: {} ({:?})", status.message(), status.code())]
    Allocate {
        resource: String,
        #[source]
        status: Box<Status>,
    },
    #[error(
        "the device plugin answered Allocate of {resource} with {answers} container answers for 1"
    )]
    Answers { resource: String, answers: usize },
    #[error("waited {waited:?} for {what}; now: {now}")]
    Timeout {
        what: String,
        waited: Duration,
        now: String,
    },
}

impl KubeletError {
    /// The gRPC status code of a refused Allocate (None for other errors).
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            KubeletError::Allocate { status, .. } => Some(status.code()),
            _ => None,
        }
    }
}

/// What kubelet merges into a container's CRI config from its device plugins'
/// `Allocate` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    pub annotations: HashMap<String, String>,
    pub envs: HashMap<String, String>,
    /// Resource name → the ids allocated.
    pub devices: HashMap<String, Vec<String>>,
}

impl Allocation {
    /// Merges the answers as kubelet does: annotations into the container's (CRI)
    /// annotations, envs appended to its environment (sorted, for stable configs).
    pub fn apply(&self, config: &mut api::ContainerConfig) {
        config
            .annotations
            .extend(self.annotations.iter().map(|(k, v)| (k.clone(), v.clone())));
        let mut envs: Vec<_> = self.envs.iter().collect();
        envs.sort();
        config
            .envs
            .extend(envs.into_iter().map(|(key, value)| api::KeyValue {
                key: key.clone(),
                value: value.clone(),
            }));
    }
}

/// A registered plugin endpoint: its devices as its ListAndWatch says.
struct Plugin {
    client: DevicePluginClient<Channel>,
    /// Id → healthy.
    devices: BTreeMap<String, bool>,
    watcher: JoinHandle<()>,
}

/// One container's devices of one resource, as PodResources reports them.
#[derive(Debug, Clone)]
struct Assignment {
    pod_uid: String,
    namespace: String,
    pod: String,
    container: String,
    resource: String,
    ids: Vec<String>,
}

#[derive(Default)]
struct State {
    plugins: HashMap<String, Plugin>,
    /// Registrations since start, per resource (a restart does not reset it).
    registrations: HashMap<String, usize>,
    assignments: Vec<Assignment>,
}

type Shared = Arc<Mutex<State>>;

fn lock(state: &Shared) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// `memory-10` after `memory-9`: kubelet's order is a set's, any order will do,
/// and numeric order makes tests readable.
fn id_order(id: &str) -> (usize, &str) {
    (id.len(), id)
}

fn device_health(answer: ListAndWatchResponse) -> BTreeMap<String, bool> {
    answer
        .devices
        .into_iter()
        .map(|d| (d.id, d.health == HEALTHY))
        .collect()
}

struct RegistrationService {
    dir: PathBuf,
    state: Shared,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != DEVICE_PLUGIN_VERSION {
            return Err(Status::invalid_argument(format!(
                "version {:?}: this kubelet speaks {DEVICE_PLUGIN_VERSION}",
                request.version
            )));
        }
        if request.resource_name.is_empty() || request.endpoint.is_empty() {
            return Err(Status::invalid_argument(
                "a registration names a resource and an endpoint",
            ));
        }
        let endpoint = self.dir.join(&request.endpoint);
        let channel = unix::connect(&endpoint)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut client = DevicePluginClient::new(channel);
        client.get_device_plugin_options(Empty {}).await?;
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        // The first list before the plugin is recorded, so that no answer can come
        // before there is a plugin to record it on.
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::unavailable("ListAndWatch ended before its first list"))?;
        let resource = request.resource_name.clone();
        let state = self.state.clone();
        let watcher = tokio::spawn({
            let resource = resource.clone();
            async move {
                while let Ok(Some(answer)) = stream.message().await {
                    let mut state = lock(&state);
                    if let Some(plugin) = state.plugins.get_mut(&resource) {
                        plugin.devices = device_health(answer);
                    }
                }
            }
        });
        let mut state = lock(&self.state);
        if let Some(old) = state.plugins.insert(
            resource.clone(),
            Plugin {
                client,
                devices: device_health(first),
                watcher,
            },
        ) {
            old.watcher.abort();
        }
        *state.registrations.entry(resource).or_default() += 1;
        Ok(Response::new(Empty {}))
    }
}

struct PodResourcesService {
    state: Shared,
}

fn pod_resources(assignments: &[Assignment]) -> Vec<PodResources> {
    let mut pods: BTreeMap<&str, PodResources> = BTreeMap::new();
    for a in assignments {
        let pod = pods.entry(&a.pod_uid).or_insert_with(|| PodResources {
            name: a.pod.clone(),
            namespace: a.namespace.clone(),
            ..Default::default()
        });
        let devices = ContainerDevices {
            resource_name: a.resource.clone(),
            device_ids: a.ids.clone(),
            topology: None,
        };
        match pod.containers.iter_mut().find(|c| c.name == a.container) {
            Some(container) => container.devices.push(devices),
            None => pod.containers.push(ContainerResources {
                name: a.container.clone(),
                devices: vec![devices],
                ..Default::default()
            }),
        }
    }
    pods.into_values().collect()
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let state = lock(&self.state);
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: pod_resources(&state.assignments),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let state = lock(&self.state);
        let devices = state
            .plugins
            .iter()
            .map(|(resource, plugin)| ContainerDevices {
                resource_name: resource.clone(),
                device_ids: plugin
                    .devices
                    .iter()
                    .filter(|(_, &healthy)| healthy)
                    .map(|(id, _)| id.clone())
                    .collect(),
                topology: None,
            })
            .collect();
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        let state = lock(&self.state);
        pod_resources(&state.assignments)
            .into_iter()
            .find(|p| p.name == request.pod_name && p.namespace == request.pod_namespace)
            .map(|pod| {
                Response::new(GetPodResourcesResponse {
                    pod_resources: Some(pod),
                })
            })
            .ok_or_else(|| {
                Status::not_found(format!(
                    "pod {}/{} holds no devices",
                    request.pod_namespace, request.pod_name
                ))
            })
    }
}

/// The servers of one kubelet run: stopped together by a restart.
struct Servers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

pub struct TestKubelet {
    runtime: tokio::runtime::Runtime,
    dir: PathBuf,
    pod_resources_socket: PathBuf,
    state: Shared,
    servers: Option<Servers>,
}

impl TestKubelet {
    /// Serves Registration on `<plugin_dir>/kubelet.sock` and PodResources on
    /// `pod_resources_socket`; panics (a test's setup) if it cannot.
    pub fn start(plugin_dir: &Path, pod_resources_socket: &Path) -> TestKubelet {
        TestKubelet::try_start(plugin_dir, pod_resources_socket)
            .unwrap_or_else(|e| panic!("starting the test kubelet: {e}"))
    }

    pub fn try_start(
        plugin_dir: &Path,
        pod_resources_socket: &Path,
    ) -> Result<TestKubelet, KubeletError> {
        // Two workers: the servers and ListAndWatch streams run between the
        // blocking calls, not only inside them.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(KubeletError::Runtime)?;
        let mut kubelet = TestKubelet {
            runtime,
            dir: plugin_dir.to_owned(),
            pod_resources_socket: pod_resources_socket.to_owned(),
            state: Shared::default(),
            servers: None,
        };
        kubelet.serve()?;
        Ok(kubelet)
    }

    pub fn plugin_dir(&self) -> &Path {
        &self.dir
    }

    pub fn pod_resources_socket(&self) -> &Path {
        &self.pod_resources_socket
    }

    fn serve(&mut self) -> Result<(), KubeletError> {
        let _entered = self.runtime.enter();
        let (stop, stopped) = watch::channel(false);
        let until = move || {
            let mut stopped = stopped.clone();
            async move {
                let _ = stopped.wait_for(|&s| s).await;
            }
        };
        let registration = unix::listen(&self.dir.join(KUBELET_SOCKET))?;
        let pod_resources = unix::listen(&self.pod_resources_socket)?;
        let registration = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(RegistrationService {
                dir: self.dir.clone(),
                state: self.state.clone(),
            }))
            .serve_with_incoming_shutdown(registration, until());
        let pod_resources = tonic::transport::Server::builder()
            .add_service(PodResourcesListerServer::new(PodResourcesService {
                state: self.state.clone(),
            }))
            .serve_with_incoming_shutdown(pod_resources, until());
        let tasks = vec![
            tokio::spawn(async move {
                let _ = registration.await;
            }),
            tokio::spawn(async move {
                let _ = pod_resources.await;
            }),
        ];
        self.servers = Some(Servers { stop, tasks });
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(servers) = self.servers.take() {
            let _ = servers.stop.send(true);
            for task in servers.tasks {
                let _ = self.runtime.block_on(task);
            }
        }
        let mut state = lock(&self.state);
        for (_, plugin) in state.plugins.drain() {
            plugin.watcher.abort();
        }
    }

    /// What a kubelet restart does to device plugins: it stops serving, deletes
    /// every file in its plugin directory (the plugins' sockets too) and serves
    /// kubelet.sock again; plugins must notice and register again. Allocations
    /// survive (kubelet checkpoints them).
    pub fn restart(&mut self) -> Result<(), KubeletError> {
        self.stop();
        let clean = |source| KubeletError::Clean {
            dir: self.dir.clone(),
            source,
        };
        for entry in std::fs::read_dir(&self.dir).map_err(clean)? {
            let path = entry.map_err(clean)?.path();
            if !path.is_dir() {
                std::fs::remove_file(&path).map_err(clean)?;
            }
        }
        self.serve()
    }

    /// How many times `resource` registered since this kubelet started.
    pub fn registrations(&self, resource: &str) -> usize {
        lock(&self.state)
            .registrations
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    /// (healthy, unhealthy) devices of `resource`; (0, 0) if not registered.
    pub fn devices(&self, resource: &str) -> (usize, usize) {
        lock(&self.state).plugins.get(resource).map_or((0, 0), |p| {
            let healthy = p.devices.values().filter(|&&h| h).count();
            (healthy, p.devices.len() - healthy)
        })
    }

    /// The ids of `resource` and whether each is healthy, in numeric order.
    pub fn device_ids(&self, resource: &str) -> Vec<(String, bool)> {
        let mut ids: Vec<(String, bool)> = lock(&self.state)
            .plugins
            .get(resource)
            .map(|p| p.devices.iter().map(|(id, &h)| (id.clone(), h)).collect())
            .unwrap_or_default();
        ids.sort_by(|a, b| id_order(&a.0).cmp(&id_order(&b.0)));
        ids
    }

    fn describe(&self) -> String {
        let state = lock(&self.state);
        let mut names: Vec<_> = state.plugins.keys().cloned().collect();
        names.sort();
        drop(state);
        let described: Vec<String> = names
            .iter()
            .map(|n| {
                let (h, u) = self.devices(n);
                format!("{n}: {h} healthy, {u} unhealthy")
            })
            .collect();
        if described.is_empty() {
            "no plugin registered".into()
        } else {
            described.join("; ")
        }
    }

    fn wait(
        &self,
        what: String,
        timeout: Duration,
        done: impl Fn(&State) -> bool,
    ) -> Result<(), KubeletError> {
        let start = Instant::now();
        loop {
            if done(&lock(&self.state)) {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(KubeletError::Timeout {
                    what,
                    waited: timeout,
                    now: self.describe(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Waits until `resource` is registered (since the last start or restart) and
    /// has listed its devices.
    pub fn wait_registered(&self, resource: &str, timeout: Duration) -> Result<(), KubeletError> {
        self.wait(format!("{resource} to register"), timeout, |s| {
            s.plugins.contains_key(resource)
        })
    }

    /// Waits until `resource` is registered with exactly `healthy` healthy devices.
    pub fn wait_for_resource(
        &self,
        resource: &str,
        healthy: usize,
        timeout: Duration,
    ) -> Result<(), KubeletError> {
        self.wait(
            format!("{resource} with {healthy} healthy devices"),
            timeout,
            |s| {
                s.plugins
                    .get(resource)
                    .is_some_and(|p| p.devices.values().filter(|&&h| h).count() == healthy)
            },
        )
    }

    /// What kubelet does when it admits a pod's container asking for `requests`
    /// (resource name, count): free healthy ids of each, the plugin's `Allocate`,
    /// and the ids recorded for PodResources. Nothing is recorded if any fails.
    pub fn allocate(
        &self,
        pod_uid: &str,
        pod_namespace: &str,
        pod_name: &str,
        container_name: &str,
        requests: &[(&str, usize)],
    ) -> Result<Allocation, KubeletError> {
        let mut allocation = Allocation::default();
        let mut assigned = Vec::new();
        for &(resource, wanted) in requests {
            let (ids, mut client) = {
                let state = lock(&self.state);
                let Some(plugin) = state.plugins.get(resource) else {
                    return Err(KubeletError::UnknownResource {
                        resource: resource.into(),
                        registered: state.plugins.keys().cloned().collect(),
                    });
                };
                let held: std::collections::HashSet<&str> = state
                    .assignments
                    .iter()
                    .chain(&assigned)
                    .filter(|a| a.resource == resource)
                    .flat_map(|a| a.ids.iter().map(String::as_str))
                    .collect();
                let mut free: Vec<&String> = plugin
                    .devices
                    .iter()
                    .filter(|(id, &healthy)| healthy && !held.contains(id.as_str()))
                    .map(|(id, _)| id)
                    .collect();
                if free.len() < wanted {
                    return Err(KubeletError::Insufficient {
                        resource: resource.into(),
                        wanted,
                        free: free.len(),
                    });
                }
                free.sort_by_key(|id| id_order(id));
                let ids: Vec<String> = free.into_iter().take(wanted).cloned().collect();
                (ids, plugin.client.clone())
            };
            let container = self.allocate_one(resource, &mut client, ids.clone())?;
            allocation.annotations.extend(container.annotations);
            allocation.envs.extend(container.envs);
            allocation.devices.insert(resource.into(), ids.clone());
            assigned.push(Assignment {
                pod_uid: pod_uid.into(),
                namespace: pod_namespace.into(),
                pod: pod_name.into(),
                container: container_name.into(),
                resource: resource.into(),
                ids,
            });
        }
        lock(&self.state).assignments.extend(assigned);
        Ok(allocation)
    }

    /// One `Allocate` of exactly `ids` on `resource`'s plugin, whatever it
    /// advertised: what a kubelet that lies (or a local caller of the plugin's
    /// socket) could send. Nothing is recorded for PodResources.
    pub fn allocate_ids(
        &self,
        resource: &str,
        ids: Vec<String>,
    ) -> Result<HashMap<String, String>, KubeletError> {
        let mut client = {
            let state = lock(&self.state);
            let Some(plugin) = state.plugins.get(resource) else {
                return Err(KubeletError::UnknownResource {
                    resource: resource.into(),
                    registered: state.plugins.keys().cloned().collect(),
                });
            };
            plugin.client.clone()
        };
        Ok(self.allocate_one(resource, &mut client, ids)?.annotations)
    }

    /// The plugin's `Allocate` for one container of `ids`, and its one answer.
    fn allocate_one(
        &self,
        resource: &str,
        client: &mut DevicePluginClient<Channel>,
        ids: Vec<String>,
    ) -> Result<ContainerAllocateResponse, KubeletError> {
        let request = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
        };
        let answer = self
            .runtime
            .block_on(client.allocate(request))
            .map_err(|status| KubeletError::Allocate {
                resource: resource.into(),
                status: Box::new(status),
            })?
            .into_inner();
        let [container] = <[_; 1]>::try_from(answer.container_responses).map_err(|all| {
            KubeletError::Answers {
                resource: resource.into(),
                answers: all.len(),
            }
        })?;
        Ok(container)
    }

    /// The pod is gone: its ids are free again and vanish from PodResources.
    pub fn remove_pod(&self, pod_uid: &str) {
        lock(&self.state)
            .assignments
            .retain(|a| a.pod_uid != pod_uid);
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_merges_as_kubelet_does() {
        let allocation = Allocation {
            annotations: HashMap::from([("grant.gpushare.io/id".into(), "g-1".into())]),
            envs: HashMap::from([
                ("GPUSHARE_GRANT_HIGH".into(), "g-2".into()),
                ("GPUSHARE_GRANT".into(), "g-1".into()),
            ]),
            devices: HashMap::new(),
        };
        let mut config = crate::container("app", "image", &["true"]);
        config.annotations.insert("mine".into(), "kept".into());
        config.envs.push(api::KeyValue {
            key: "PATH".into(),
            value: "/bin".into(),
        });
        allocation.apply(&mut config);
        assert_eq!(config.annotations["mine"], "kept");
        assert_eq!(config.annotations["grant.gpushare.io/id"], "g-1");
        let envs: Vec<_> = config
            .envs
            .iter()
            .map(|kv| format!("{}={}", kv.key, kv.value))
            .collect();
        assert_eq!(
            envs,
            ["PATH=/bin", "GPUSHARE_GRANT=g-1", "GPUSHARE_GRANT_HIGH=g-2"]
        );
    }

    #[test]
    fn pod_resources_group_by_pod_and_container() {
        let a = |uid: &str, container: &str, resource: &str, ids: &[&str]| Assignment {
            pod_uid: uid.into(),
            namespace: "ns".into(),
            pod: format!("pod-{uid}"),
            container: container.into(),
            resource: resource.into(),
            ids: ids.iter().map(|&s| s.into()).collect(),
        };
        let pods = pod_resources(&[
            a("1", "c", "gpushare.io/memory", &["memory-0"]),
            a("1", "c", "gpushare.io/high", &["high-0"]),
            a("1", "d", "gpushare.io/memory", &["memory-1"]),
            a("2", "c", "gpushare.io/memory", &["memory-2"]),
        ]);
        assert_eq!(pods.len(), 2);
        assert_eq!(pods[0].name, "pod-1");
        assert_eq!(pods[0].containers.len(), 2);
        assert_eq!(pods[0].containers[0].devices.len(), 2);
        assert_eq!(pods[1].containers[0].devices[0].device_ids, ["memory-2"]);
    }

    #[test]
    fn ids_are_taken_in_numeric_order() {
        let mut ids = vec!["memory-10", "memory-9", "memory-1"];
        ids.sort_by_key(|id| id_order(id));
        assert_eq!(ids, ["memory-1", "memory-9", "memory-10"]);
    }
}
