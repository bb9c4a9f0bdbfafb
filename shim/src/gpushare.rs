//! What the gpushare shim adds to the runc shim: the lease and the spec edits,
//! with exactly the edits `gpushare-runc` makes (one library, `gpushare-oci`).
//! Blocking (files and the arbiter's Unix socket): callers run it off the async
//! threads.

use std::path::Path;

use gpushare_config::{Config, ConfigError, Unrequested};
use gpushare_oci::bundle::{BundleError, BundleSpec};
use gpushare_oci::mutate::{self, SpecError};
use gpushare_oci::request::{self, RequestError};
use gpushare_proto::{ClientError, ContainerRef, ControlClient, LeaseId};
use serde_json::Value;

/// The containerd namespace this shim serves (one shim process serves one): the id
/// space of its container ids, which two namespaces may share.
static NAMESPACE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Called once, with containerd's `-namespace` argument, before any container.
pub fn set_namespace(namespace: &str) {
    let _ = NAMESPACE.set(namespace.to_owned());
}

/// The lease key's namespace for this shim's containers.
fn namespace() -> Option<String> {
    NAMESPACE.get().map(|ns| format!("containerd:{ns}"))
}

fn container(container_id: &str, lease: Option<&LeaseId>) -> ContainerRef {
    ContainerRef {
        container_id: container_id.to_owned(),
        namespace: namespace(),
        lease: lease.cloned(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpushareError {
    #[error("gpushare configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    /// The container asked for something malformed: the parser's own message.
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("container {container_id}: {source}")]
    Arbiter {
        container_id: String,
        source: ClientError,
    },
    #[error(
        "container {container_id}: its spec carries gpushare's own annotations ({marker}) but the arbiter granted it no such lease; \
         these annotations are written by gpushare and cannot be set by hand"
    )]
    ForgedMarker {
        container_id: String,
        marker: &'static str,
    },
    /// The image needs a newer CUDA than the host driver provides.
    #[error(transparent)]
    Incompatible(#[from] gpushare_oci::cuda_compat::CompatError),
    #[error("exec process spec is not JSON: {0}")]
    ExecSpec(serde_json::Error),
}

impl GpushareError {
    /// The user's mistake (fix the request), as opposed to the node's.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            GpushareError::Request(_)
                | GpushareError::ForgedMarker { .. }
                | GpushareError::Incompatible(_)
        )
    }
}

/// The outcome of preparing a container's creation.
pub enum Prepared {
    /// Nothing to do: no request, a pod's pause container, or already edited upstream.
    Untouched,
    /// The spec on disk was edited; `lease` was reserved for it (None: `void` only).
    Edited {
        bundle: BundleSpec,
        lease: Option<LeaseId>,
    },
}

impl Prepared {
    pub fn lease(&self) -> Option<&LeaseId> {
        match self {
            Prepared::Edited { lease, .. } => lease.as_ref(),
            Prepared::Untouched => None,
        }
    }
}

fn load_config() -> Result<Config, GpushareError> {
    Ok(Config::load_default()?.0)
}

/// Reads the request from the bundle's spec, reserves a lease and writes the
/// edited spec. A bad request fails here with no lease and the spec untouched.
pub fn prepare_create(container_id: &str, bundle_dir: &Path) -> Result<Prepared, GpushareError> {
    let config = load_config()?;
    let (bundle, mut spec) = BundleSpec::open(bundle_dir)?;
    if gpushare_oci::kubernetes::is_pod_sandbox(&spec) {
        return Ok(Prepared::Untouched);
    }
    if mutate::is_marked(&spec) {
        verify_marker(&spec, container_id, &config)?;
        return Ok(Prepared::Untouched);
    }
    let Some(wanted) = request::from_spec(&spec, &config.requests)? else {
        if config.requests.unrequested == Unrequested::Void {
            mutate::apply_void(&mut spec)?;
            bundle.write(&spec)?;
            return Ok(Prepared::Edited {
                bundle,
                lease: None,
            });
        }
        return Ok(Prepared::Untouched);
    };

    let arbiter_error = |source| GpushareError::Arbiter {
        container_id: container_id.to_owned(),
        source,
    };
    let mut client = ControlClient::connect(
        &config.arbiter.control_socket(),
        config.arbiter.client_timeout(),
    )
    .map_err(arbiter_error)?;
    // Before anything is reserved: an image the driver cannot run is refused here.
    let driver = client.status().map_err(arbiter_error)?.driver_cuda_version;
    gpushare_oci::cuda_compat::check_spec(&spec, driver)?;
    let lease = client
        .reserve(wanted.into_reserve(
            container_id.to_owned(),
            namespace(),
            gpushare_oci::kubernetes::sandbox_id(&spec),
        ))
        .map_err(arbiter_error)?;
    let paths = mutate::HostPaths::new(&config.runtime, &config.arbiter, &lease);
    let edited = mutate::apply_lease(&mut spec, &lease, &paths)
        .map_err(GpushareError::from)
        .and_then(|()| bundle.write(&spec).map_err(GpushareError::from));
    if let Err(e) = edited {
        let _ = bundle.restore();
        let _ = with_client(container_id, |c| {
            c.release_container_in(container(container_id, Some(&lease.id)))
        });
        return Err(e);
    }
    Ok(Prepared::Edited {
        bundle,
        lease: Some(lease.id),
    })
}

/// Undoes `prepare_create` after the runc shim failed to create the container:
/// the spec back byte for byte, the lease released.
pub fn undo_create(container_id: &str, prepared: Prepared) {
    if let Prepared::Edited { bundle, lease } = prepared {
        if let Err(e) = bundle.restore() {
            log::warn!("container {container_id}: cannot restore config.json: {e}");
        }
        if let Some(lease) = lease {
            let released = with_client(container_id, |c| {
                c.release_container_in(container(container_id, Some(&lease)))
            });
            if let Err(e) = released {
                log::warn!("container {container_id}: cannot release its lease: {e}");
            }
        }
    }
}

/// Gives an exec process the container's injected environment. `Ok(false)` when
/// the container has none (it was not edited by gpushare).
pub fn edit_exec_process(
    container_bundle: &Path,
    process_json: &mut Vec<u8>,
) -> Result<bool, GpushareError> {
    let (_, container_spec) = BundleSpec::open(container_bundle)?;
    let mut process: Value =
        serde_json::from_slice(process_json).map_err(GpushareError::ExecSpec)?;
    if !mutate::apply_to_exec_process(&mut process, &container_spec)? {
        return Ok(false);
    }
    *process_json = serde_json::to_vec(&process).expect("a JSON value always serialises");
    Ok(true)
}

/// Releases every lease of a container. Idempotent: `Ok(false)` when there was none.
pub fn release_container(container_id: &str) -> Result<bool, GpushareError> {
    with_client(container_id, |c| {
        c.release_container_in(container(container_id, None))
    })
}

/// Releases one lease (the container may since hold a newer one).
pub fn release_lease(container_id: &str, lease: &LeaseId) -> Result<bool, GpushareError> {
    with_client(container_id, |c| c.release(lease.clone()))
}

fn with_client<T>(
    container_id: &str,
    call: impl FnOnce(&mut ControlClient) -> Result<T, ClientError>,
) -> Result<T, GpushareError> {
    let config = load_config()?;
    let arbiter_error = |source| GpushareError::Arbiter {
        container_id: container_id.to_owned(),
        source,
    };
    let mut client = ControlClient::connect(
        &config.arbiter.control_socket(),
        config.arbiter.client_timeout(),
    )
    .map_err(arbiter_error)?;
    call(&mut client).map_err(arbiter_error)
}

/// A spec that arrives already marked must carry a lease the arbiter really
/// granted to this container: otherwise anyone could mount another's lease.
fn verify_marker(spec: &Value, container_id: &str, config: &Config) -> Result<(), GpushareError> {
    let arbiter_error = |source| GpushareError::Arbiter {
        container_id: container_id.to_owned(),
        source,
    };
    let mut client = ControlClient::connect(
        &config.arbiter.control_socket(),
        config.arbiter.client_timeout(),
    )
    .map_err(arbiter_error)?;
    let status = client.status().map_err(arbiter_error)?;
    if mutate::marker_is_genuine(spec, container_id, &status) {
        Ok(())
    } else {
        Err(GpushareError::ForgedMarker {
            container_id: container_id.to_owned(),
            marker: gpushare_oci::ANNOTATION_MARKER,
        })
    }
}
