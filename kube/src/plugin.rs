//! The DevicePlugin service of one resource: what kubelet calls on the plugin's
//! endpoint.

use std::collections::HashMap;
use std::sync::Arc;

use gpushare_proto::grant::{GrantId, GrantRequest};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::api::deviceplugin::device_plugin_server::DevicePlugin;
use crate::api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, DevicePluginOptions, Empty,
    ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};
use crate::arbiter::{Arbiter, ArbiterError};
use crate::devices::{check_allocated, DeviceLists};
use crate::resource::Resource;
use crate::{HEALTHY, UNHEALTHY};

/// What every endpoint shares.
pub struct Shared {
    pub arbiter: Arbiter,
    pub memory_unit: u64,
    /// The latest device lists (the node's poller publishes them).
    pub devices: watch::Receiver<DeviceLists>,
}

/// One resource's endpoint. `stop` ends its ListAndWatch streams, so that the
/// server's graceful shutdown (a kubelet restart) does not wait for them forever.
#[derive(Clone)]
pub struct ResourcePlugin {
    pub resource: Resource,
    pub shared: Arc<Shared>,
    pub stop: watch::Receiver<bool>,
}

fn list_response(resource: Resource, lists: &DeviceLists) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: lists
            .of(resource)
            .iter()
            .map(|d| crate::api::deviceplugin::Device {
                id: d.id.clone(),
                health: if d.healthy { HEALTHY } else { UNHEALTHY }.into(),
                topology: None,
            })
            .collect(),
    }
}

fn arbiter_status(resource: Resource, e: ArbiterError) -> Status {
    let message = format!("gpushare-kube could not grant {}: {e}", resource.name());
    match e {
        ArbiterError::Unreachable { .. } => Status::unavailable(message),
        ArbiterError::Refused { .. } | ArbiterError::Aborted { .. } => Status::internal(message),
    }
}

impl ResourcePlugin {
    async fn release_all(&self, grants: Vec<GrantId>) {
        for id in grants {
            if let Err(e) = self.shared.arbiter.release_grant(id.clone()).await {
                // Collection takes it later: no pod holds its ids.
                tracing::warn!(grant = %id, error = %e, "could not release a grant of a failed Allocate");
            }
        }
    }
}

#[tonic::async_trait]
impl DevicePlugin for ResourcePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: false,
        }))
    }

    type ListAndWatchStream = ReceiverStream<Result<ListAndWatchResponse, Status>>;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let resource = self.resource;
        let mut devices = self.shared.devices.clone();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            let mut sent: Option<ListAndWatchResponse> = None;
            loop {
                let now = list_response(resource, &devices.borrow_and_update());
                if sent.as_ref() != Some(&now) {
                    if tx.send(Ok(now.clone())).await.is_err() {
                        return;
                    }
                    sent = Some(now);
                }
                if *stop.borrow_and_update() {
                    return;
                }
                tokio::select! {
                    changed = devices.changed() => if changed.is_err() { return },
                    _ = stop.changed() => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let resource = self.resource;
        let mut answers = Vec::new();
        let mut granted = Vec::new();
        for container in request.into_inner().container_requests {
            let checked = check_allocated(
                resource,
                &container.devices_ids,
                self.shared.devices.borrow().of(resource),
            )
            .map_err(|e| e.to_string())
            .and_then(|()| {
                resource
                    .amount(container.devices_ids.len(), self.shared.memory_unit)
                    .map_err(|e| e.to_string())
            });
            let amount = match checked {
                Ok(amount) => amount,
                Err(e) => {
                    tracing::warn!(resource = resource.name(), error = %e, "Allocate refused");
                    self.release_all(granted).await;
                    return Err(Status::invalid_argument(e));
                }
            };
            let request = GrantRequest {
                amount,
                device_ids: container.devices_ids,
            };
            let grant = match self.shared.arbiter.grant(request).await {
                Ok(grant) => grant,
                Err(e) => {
                    tracing::warn!(resource = resource.name(), error = %e, "Allocate failed");
                    self.release_all(granted).await;
                    return Err(arbiter_status(resource, e));
                }
            };
            tracing::info!(
                resource = resource.name(),
                grant = %grant.id,
                devices = ?grant.device_ids,
                gpu = grant.gpu.as_deref().unwrap_or("waiting"),
                "granted"
            );
            let id = grant.id.to_string();
            answers.push(ContainerAllocateResponse {
                envs: HashMap::from([(resource.env().to_owned(), id.clone())]),
                annotations: HashMap::from([(resource.annotation().to_owned(), id)]),
                ..Default::default()
            });
            granted.push(grant.id);
        }
        Ok(Response::new(AllocateResponse {
            container_responses: answers,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse::default()))
    }
}
