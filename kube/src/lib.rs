//! gpushare's Kubernetes device plugin, `gpushare-kube`.
//!
//! It advertises three extended resources to kubelet, one plugin endpoint each
//! (kubelet registers one resource name per endpoint): `gpushare.io/memory` (pooled
//! units of `kubernetes.memory_unit`), `gpushare.io/high` (one per GPU) and
//! `gpushare.io/compute` (100 per GPU). kubelet's `Allocate` becomes an arbiter
//! grant whose id the answer carries as a container annotation; the runtime side
//! reserves the container's lease against it.
//!
//! - [`arbiter`]: the blocking arbiter client, from async code;
//! - [`devices`]: the pure device lists from the arbiter's GPUs;
//! - [`arbiter`]: the blocking arbiter client, from async code;
//! - [`collect`]: the pure choice of grants no pod holds any more;
//! - [`resource`]: the three resources, their sockets, annotations and amounts;
//! - [`plugin`]: the DevicePlugin gRPC service of one resource;
//! - [`node`]: the running plugin: endpoints, registration, polling, collection;
//! - [`unix`]: gRPC channels and listeners on unix sockets;
//! - [`api`]: the generated Kubernetes APIs (both halves, for the test kubelet too).

pub mod arbiter;
pub mod cli;
pub mod collect;
pub mod devices;
pub mod node;
pub mod plugin;
pub mod resource;
pub mod unix;

/// The generated Kubernetes APIs (vendored protos under proto/).
pub mod api {
    /// Device plugin API v1beta1: `Registration` (kubelet's) and `DevicePlugin`.
    pub mod deviceplugin {
        tonic::include_proto!("v1beta1");
    }
    /// PodResources v1: which pods hold which devices (kubelet's).
    pub mod podresources {
        tonic::include_proto!("v1");
    }
}

/// The device plugin API version kubelet is told at registration.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";
/// kubelet's registration socket, in its device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// What ListAndWatch calls a device kubelet may allocate, and one it may not.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";
