//! The running plugin: three endpoints registered with kubelet, the arbiter's GPUs
//! polled into device lists, re-registration after a kubelet restart, and the
//! collection of grants no pod holds.

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpushare_config::Config;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::deviceplugin::device_plugin_server::DevicePluginServer;
use crate::api::deviceplugin::registration_client::RegistrationClient;
use crate::api::deviceplugin::{DevicePluginOptions, RegisterRequest};
use crate::api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::api::podresources::ListPodResourcesRequest;
use crate::arbiter::{Arbiter, ArbiterError};
use crate::collect::{grants_to_collect, held_device_ids};
use crate::devices::{device_lists, DeviceLists, Inventory};
use crate::plugin::{ResourcePlugin, Shared};
use crate::resource::Resource;
use crate::unix::{self, UnixError};
use crate::{DEVICE_PLUGIN_VERSION, KUBELET_SOCKET};

/// How long a call to kubelet (Register, PodResources List) may take.
const KUBELET_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the endpoints of a departed kubelet may take to stop.
const SHUT_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Unix(#[from] UnixError),
    #[error("kubelet refused to register {resource} ({endpoint}): {} ({:?})", status.message(), status.code())]
    Register {
        resource: &'static str,
        endpoint: &'static str,
        #[source]
        status: Box<tonic::Status>,
    },
    #[error("kubelet did not answer the registration of {resource} within {KUBELET_TIMEOUT:?}")]
    RegisterTimeout { resource: &'static str },
    #[error("PodResources List failed: {}", .0.message())]
    PodResources(Box<tonic::Status>),
    #[error("PodResources did not answer List within {KUBELET_TIMEOUT:?}")]
    PodResourcesTimeout,
    #[error(transparent)]
    Arbiter(#[from] ArbiterError),
}

/// The plugin's settings, from the `[kubernetes]` and `[arbiter]` tables.
#[derive(Debug, Clone)]
pub struct Settings {
    pub plugin_dir: PathBuf,
    pub pod_resources_socket: PathBuf,
    pub arbiter: Arbiter,
    pub memory_unit: u64,
    pub poll_interval: Duration,
    pub collect_interval: Duration,
    pub collect_grace: Duration,
}

impl Settings {
    pub fn from_config(config: &Config) -> Settings {
        let k = &config.kubernetes;
        Settings {
            plugin_dir: k.device_plugin_dir.clone(),
            pod_resources_socket: k.pod_resources_socket.clone(),
            arbiter: Arbiter::new(
                config.arbiter.control_socket(),
                Duration::from_millis(config.arbiter.client_timeout_ms),
            ),
            memory_unit: k.memory_unit.0,
            poll_interval: Duration::from_millis(k.poll_interval_ms),
            collect_interval: Duration::from_millis(k.collect_interval_ms),
            collect_grace: Duration::from_millis(k.collect_grace_ms),
        }
    }
}

/// What the registration watch does on one poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// kubelet's socket is not there (kubelet is down): nothing to register with.
    Wait,
    /// Registered with this kubelet, and our sockets are in place.
    Keep,
    /// Serve fresh sockets and register: kubelet restarted (it deletes every
    /// socket in its directory and recreates its own), or never took us.
    Restart,
}

/// `kubelet`: the inode of kubelet.sock now; `registered_with`: the one the last
/// successful registration went to.
pub fn next_step(
    kubelet: Option<u64>,
    sockets_present: bool,
    registered_with: Option<u64>,
) -> Step {
    match kubelet {
        None => Step::Wait,
        Some(inode) if sockets_present && registered_with == Some(inode) => Step::Keep,
        Some(_) => Step::Restart,
    }
}

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// The servers of one registration: stopped together when kubelet restarts.
struct Endpoints {
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
}

impl Endpoints {
    fn serve(dir: &Path, shared: &Arc<Shared>) -> Result<Endpoints, NodeError> {
        let (stop, stopped) = watch::channel(false);
        let mut servers = Vec::new();
        for resource in Resource::ALL {
            let incoming = unix::listen(&dir.join(resource.socket_name()))?;
            let plugin = ResourcePlugin {
                resource,
                shared: shared.clone(),
                stop: stopped.clone(),
            };
            let mut until = stopped.clone();
            servers.push(tokio::spawn(async move {
                let served = tonic::transport::Server::builder()
                    .add_service(DevicePluginServer::new(plugin))
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = until.wait_for(|&s| s).await;
                    })
                    .await;
                if let Err(e) = served {
                    tracing::error!(resource = resource.name(), error = %e, "endpoint failed");
                }
            }));
        }
        Ok(Endpoints { stop, servers })
    }

    /// Stops the servers: gracefully (the ListAndWatch streams end on `stop`), but
    /// a connection a departed kubelet left half-open must not hold up the new
    /// registration, so after [`SHUT_GRACE`] they are aborted.
    async fn shut(self) {
        let _ = self.stop.send(true);
        for mut server in self.servers {
            if tokio::time::timeout(SHUT_GRACE, &mut server).await.is_err() {
                tracing::warn!("an endpoint did not stop within {SHUT_GRACE:?}; aborting it");
                server.abort();
            }
        }
    }
}

async fn register(dir: &Path) -> Result<(), NodeError> {
    let channel = unix::connect(&dir.join(KUBELET_SOCKET)).await?;
    let mut kubelet = RegistrationClient::new(channel);
    for resource in Resource::ALL {
        let request = RegisterRequest {
            version: DEVICE_PLUGIN_VERSION.into(),
            endpoint: resource.socket_name().into(),
            resource_name: resource.name().into(),
            options: Some(DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: false,
            }),
        };
        let resource_name = resource.name();
        tokio::time::timeout(KUBELET_TIMEOUT, kubelet.register(request))
            .await
            .map_err(|_| NodeError::RegisterTimeout {
                resource: resource_name,
            })?
            .map_err(|status| NodeError::Register {
                resource: resource_name,
                endpoint: resource.socket_name(),
                status: Box::new(status),
            })?;
    }
    Ok(())
}

/// Keeps the endpoints served and registered with whichever kubelet is running.
async fn keep_registered(settings: Settings, shared: Arc<Shared>) {
    let dir = &settings.plugin_dir;
    let kubelet_socket = dir.join(KUBELET_SOCKET);
    let mut endpoints: Option<Endpoints> = None;
    let mut registered_with: Option<u64> = None;
    let mut waiting_logged = false;
    let mut ticks = tokio::time::interval(settings.poll_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let kubelet = inode(&kubelet_socket);
        let sockets_present = endpoints.is_some()
            && Resource::ALL
                .iter()
                .all(|r| dir.join(r.socket_name()).exists());
        match next_step(kubelet, sockets_present, registered_with) {
            Step::Keep => {}
            Step::Wait => {
                if !waiting_logged {
                    tracing::warn!(socket = %kubelet_socket.display(), "kubelet's registration socket is not there; waiting for kubelet");
                    waiting_logged = true;
                }
            }
            Step::Restart => {
                waiting_logged = false;
                if registered_with.is_some() {
                    tracing::info!(dir = %dir.display(), "kubelet restarted (its socket or ours was replaced): serving and registering again");
                }
                registered_with = None;
                if let Some(old) = endpoints.take() {
                    old.shut().await;
                }
                match Endpoints::serve(dir, &shared) {
                    Ok(served) => endpoints = Some(served),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot serve the plugin endpoints");
                        continue;
                    }
                }
                match register(dir).await {
                    Ok(()) => {
                        registered_with = kubelet;
                        tracing::info!(
                            resources = ?Resource::ALL.map(Resource::name),
                            dir = %dir.display(),
                            "registered with kubelet"
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "registration failed; retrying"),
                }
            }
        }
    }
}

/// Reads the arbiter's GPUs into device lists. An unreachable arbiter changes
/// nothing: the last lists stay (kubelet would otherwise see every device flap
/// unhealthy through an arbiter restart).
async fn poll_arbiter(
    settings: Settings,
    inventory: &mut Inventory,
    devices: &watch::Sender<DeviceLists>,
    failing: &mut bool,
) {
    match settings.arbiter.status().await {
        Ok(report) => {
            if *failing {
                tracing::info!("the arbiter answers again");
                *failing = false;
            }
            let lists = device_lists(&inventory.observe(&report), settings.memory_unit);
            devices.send_if_modified(|current| {
                if *current == lists {
                    return false;
                }
                tracing::info!(
                    memory = ?lists.counts(Resource::Memory),
                    high = ?lists.counts(Resource::High),
                    compute = ?lists.counts(Resource::Compute),
                    "devices (healthy, unhealthy) changed"
                );
                *current = lists;
                true
            });
        }
        Err(e) => {
            if !*failing {
                tracing::warn!(error = %e, "cannot read the arbiter's GPUs; keeping the last device lists");
                *failing = true;
            }
        }
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One collection pass; returns how many grants were released.
pub async fn collect_once(settings: &Settings) -> Result<usize, NodeError> {
    let channel = unix::connect(&settings.pod_resources_socket).await?;
    let mut pod_resources = PodResourcesListerClient::new(channel);
    let answer = tokio::time::timeout(
        KUBELET_TIMEOUT,
        pod_resources.list(ListPodResourcesRequest {}),
    )
    .await
    .map_err(|_| NodeError::PodResourcesTimeout)?
    .map_err(|s| NodeError::PodResources(Box::new(s)))?
    .into_inner();
    let held = held_device_ids(&answer);
    let grants = settings.arbiter.grants().await?;
    let grace = settings.collect_grace.as_millis() as u64;
    let mut released = 0;
    for id in grants_to_collect(&grants, &held, now_unix_ms(), grace) {
        if settings.arbiter.release_grant(id.clone()).await? {
            tracing::info!(grant = %id, "released a grant no pod holds any more");
            released += 1;
        }
    }
    Ok(released)
}

async fn keep_collecting(settings: Settings) {
    let mut ticks = tokio::time::interval(settings.collect_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if let Err(e) = collect_once(&settings).await {
            tracing::warn!(error = %e, "collection skipped");
        }
    }
}

/// Runs the plugin until `shutdown` completes.
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()>) {
    let (devices_tx, devices) = watch::channel(DeviceLists::default());
    let mut inventory = Inventory::default();
    let mut failing = false;
    // The first lists before the first registration, so kubelet's first
    // ListAndWatch answer is already the node's.
    poll_arbiter(settings.clone(), &mut inventory, &devices_tx, &mut failing).await;
    let shared = Arc::new(Shared {
        arbiter: settings.arbiter.clone(),
        memory_unit: settings.memory_unit,
        devices,
    });
    let poller = {
        let settings = settings.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(settings.poll_interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                poll_arbiter(settings.clone(), &mut inventory, &devices_tx, &mut failing).await;
            }
        })
    };
    let registration = tokio::spawn(keep_registered(settings.clone(), shared));
    let collection = tokio::spawn(keep_collecting(settings));
    shutdown.await;
    for task in [poller, registration, collection] {
        task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_follows_kubelet() {
        for (kubelet, present, registered, expected) in [
            (None, true, Some(1), Step::Wait),
            (None, false, None, Step::Wait),
            (Some(1), true, Some(1), Step::Keep),
            // kubelet restarted: a new kubelet.sock, ours deleted.
            (Some(2), false, Some(1), Step::Restart),
            // A new kubelet.sock but ours still there: register again all the same.
            (Some(2), true, Some(1), Step::Restart),
            // Our socket deleted under the same kubelet.
            (Some(1), false, Some(1), Step::Restart),
            // Never registered (kubelet refused, or was not up).
            (Some(1), true, None, Step::Restart),
        ] {
            assert_eq!(
                next_step(kubelet, present, registered),
                expected,
                "{kubelet:?} {present} {registered:?}"
            );
        }
    }
}
