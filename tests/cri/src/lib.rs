//! A CRI (runtime.v1) client for end-to-end tests through containerd's CRI plugin,
//! playing kubelet: no kubelet and no cri-tools can be installed on the test
//! machines, so the tests speak the CRI gRPC API to containerd's socket themselves.
//!
//! [`Cri`] is blocking (the end-to-end tests drive processes synchronously); it runs
//! the generated async client ([`api`]) on a runtime of its own. [`image`] builds a
//! registry-free OCI image for the CRI plugin's image store. [`kubelet`] plays
//! kubelet's device-plugin side (registration, Allocate, PodResources).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

pub mod image;
pub mod kubelet;

/// The generated messages and client of `runtime.v1` (proto/api.proto).
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::runtime_service_client::RuntimeServiceClient;

/// The containerd namespace the CRI plugin keeps its images, pods and containers in.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// What the CRI plugin writes into each spec to tell a pause container from an app's.
pub const CONTAINER_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("could not start the CRI client's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("could not connect to the CRI socket {}: {source}", socket.display())]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("CRI {rpc} failed: {} ({:?})", status.message(), status.code())]
    Call {
        rpc: &'static str,
        #[source]
        status: Box<tonic::Status>,
    },
    #[error("CRI {rpc} answered without {what}")]
    Incomplete {
        rpc: &'static str,
        what: &'static str,
    },
}

impl CriError {
    /// The gRPC status code of a refused call (None for other errors).
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            CriError::Call { status, .. } => Some(status.code()),
            _ => None,
        }
    }
}

/// A blocking CRI runtime-service client over a unix socket.
pub struct Cri {
    runtime: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
}

impl Cri {
    /// Connects to `socket` (containerd's gRPC address: the CRI plugin serves there).
    pub fn connect(socket: &Path) -> Result<Cri, CriError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(CriError::Runtime)?;
        let path = socket.to_owned();
        // tonic wants a URI; the connector ignores it and dials the socket instead.
        let endpoint = Endpoint::from_static("http://[::1]:0");
        let channel = runtime
            .block_on(endpoint.connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            })))
            .map_err(|source| CriError::Connect {
                socket: socket.to_owned(),
                source,
            })?;
        Ok(Cri {
            runtime,
            client: RuntimeServiceClient::new(channel),
        })
    }

    fn call<T, F>(
        &self,
        rpc: &'static str,
        f: impl FnOnce(RuntimeServiceClient<Channel>) -> F,
    ) -> Result<T, CriError>
    where
        F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        self.runtime
            .block_on(f(self.client.clone()))
            .map(tonic::Response::into_inner)
            .map_err(|status| CriError::Call {
                rpc,
                status: Box::new(status),
            })
    }

    pub fn version(&self) -> Result<api::VersionResponse, CriError> {
        self.call("Version", |mut c| async move {
            c.version(api::VersionRequest {
                version: "v1".into(),
            })
            .await
        })
    }

    /// Runs a pod's sandbox with `runtime_handler` (a RuntimeClass's `handler`, one of
    /// the CRI plugin's `runtimes`); returns its id.
    pub fn run_pod_sandbox(
        &self,
        config: &api::PodSandboxConfig,
        runtime_handler: &str,
    ) -> Result<String, CriError> {
        let request = api::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: runtime_handler.into(),
        };
        self.call("RunPodSandbox", |mut c| async move {
            c.run_pod_sandbox(request).await
        })
        .map(|r| r.pod_sandbox_id)
    }

    pub fn stop_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let request = api::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call("StopPodSandbox", |mut c| async move {
            c.stop_pod_sandbox(request).await
        })
        .map(drop)
    }

    pub fn remove_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let request = api::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call("RemovePodSandbox", |mut c| async move {
            c.remove_pod_sandbox(request).await
        })
        .map(drop)
    }

    pub fn list_pod_sandboxes(&self) -> Result<Vec<api::PodSandbox>, CriError> {
        self.call("ListPodSandbox", |mut c| async move {
            c.list_pod_sandbox(api::ListPodSandboxRequest { filter: None })
                .await
        })
        .map(|r| r.items)
    }

    /// Creates a container in the pod `pod_id`; `sandbox_config` is the pod's config
    /// as it was run (kubelet sends it again: the CRI plugin reads the pod's
    /// annotations and namespaces from it). Returns the container's id.
    pub fn create_container(
        &self,
        pod_id: &str,
        config: &api::ContainerConfig,
        sandbox_config: &api::PodSandboxConfig,
    ) -> Result<String, CriError> {
        let request = api::CreateContainerRequest {
            pod_sandbox_id: pod_id.into(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox_config.clone()),
        };
        self.call("CreateContainer", |mut c| async move {
            c.create_container(request).await
        })
        .map(|r| r.container_id)
    }

    pub fn start_container(&self, id: &str) -> Result<(), CriError> {
        let request = api::StartContainerRequest {
            container_id: id.into(),
        };
        self.call("StartContainer", |mut c| async move {
            c.start_container(request).await
        })
        .map(drop)
    }

    /// Stops a container: its stop signal, then SIGKILL once `grace` has passed
    /// (a zero grace kills at once).
    pub fn stop_container(&self, id: &str, grace: Duration) -> Result<(), CriError> {
        let request = api::StopContainerRequest {
            container_id: id.into(),
            timeout: grace.as_secs() as i64,
        };
        self.call("StopContainer", |mut c| async move {
            c.stop_container(request).await
        })
        .map(drop)
    }

    pub fn remove_container(&self, id: &str) -> Result<(), CriError> {
        let request = api::RemoveContainerRequest {
            container_id: id.into(),
        };
        self.call("RemoveContainer", |mut c| async move {
            c.remove_container(request).await
        })
        .map(drop)
    }

    /// Containers (not pause containers: the CRI hides those), all of them with no filter.
    pub fn list_containers(
        &self,
        filter: Option<api::ContainerFilter>,
    ) -> Result<Vec<api::Container>, CriError> {
        self.call("ListContainers", |mut c| async move {
            c.list_containers(api::ListContainersRequest { filter })
                .await
        })
        .map(|r| r.containers)
    }

    pub fn container_status(&self, id: &str) -> Result<api::ContainerStatus, CriError> {
        let request = api::ContainerStatusRequest {
            container_id: id.into(),
            verbose: false,
        };
        self.call("ContainerStatus", |mut c| async move {
            c.container_status(request).await
        })?
        .status
        .ok_or(CriError::Incomplete {
            rpc: "ContainerStatus",
            what: "a status",
        })
    }
}

/// A pod config as kubelet sends it for a host-network pod: the pod shares the
/// node's network namespace, so the CRI plugin calls no CNI plugin for it.
pub fn host_network_pod(
    name: &str,
    namespace: &str,
    uid: &str,
    annotations: HashMap<String, String>,
) -> api::PodSandboxConfig {
    api::PodSandboxConfig {
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: namespace.into(),
            attempt: 0,
        }),
        // kubelet sends no hostname for a host-network pod: runc refuses to set one
        // without a UTS namespace of the pod's own.
        annotations,
        linux: Some(api::LinuxPodSandboxConfig {
            security_context: Some(api::LinuxSandboxSecurityContext {
                namespace_options: Some(api::NamespaceOption {
                    network: api::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A container config running `command` from `image` (a reference the CRI plugin
/// resolves in its own image store).
pub fn container(name: &str, image: &str, command: &[&str]) -> api::ContainerConfig {
    api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(api::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: command.iter().map(|&s| s.into()).collect(),
        ..Default::default()
    }
}
