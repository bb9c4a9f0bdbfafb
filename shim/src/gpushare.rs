//! What the gpushare shim adds to the runc shim, through gpushare-oci's
//! admission, the one path every entry point takes: this module only supplies
//! the shim's inputs (the bundle, the container id, containerd's namespace, the
//! configuration). Blocking (files and the arbiter's Unix socket): callers run it
//! off the async threads.

use std::path::Path;

use gpushare_config::{ArbiterConfig, Config, ConfigError};
use gpushare_oci::admission::{
    self, AdmissionError, Admitted, Arbiter, ControlSocket, ErrorClass, Identity, Namespace,
};
use gpushare_oci::broken_config::{self, Decision, Unconfigured};
use gpushare_oci::bundle::{BundleError, BundleSpec};
use gpushare_oci::mutate;
use gpushare_oci::spec::{Process, SpecError};
use gpushare_proto::{ClientError, LeaseId};

/// The containerd namespace this shim serves (one shim process serves one): the id
/// space of its container ids, which two namespaces may share.
static NAMESPACE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Called once, with containerd's `-namespace` argument, before any container.
pub fn set_namespace(namespace: &str) {
    let _ = NAMESPACE.set(namespace.to_owned());
}

fn identity(container_id: &str) -> Identity {
    let namespace = match NAMESPACE.get() {
        Some(ns) => Namespace::Containerd(ns.clone()),
        None => Namespace::Unknown,
    };
    Identity::container(container_id, namespace)
}

#[derive(Debug, thiserror::Error)]
pub enum GpushareError {
    #[error("gpushare configuration: {0}")]
    Config(#[from] ConfigError),
    /// The container asks for gpushare while the configuration is refused.
    #[error(transparent)]
    Unconfigured(#[from] Unconfigured),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("container {container_id}: {source}")]
    Arbiter {
        container_id: String,
        source: ClientError,
    },
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("exec process spec is not JSON: {0}")]
    ExecSpec(serde_json::Error),
}

impl GpushareError {
    /// Whose fault, and whether trying again may help: the ttrpc code.
    pub fn class(&self) -> ErrorClass {
        match self {
            GpushareError::Admission(e) => e.class(),
            GpushareError::Arbiter { .. } => ErrorClass::Unavailable,
            _ => ErrorClass::Failed,
        }
    }
}

/// A container's admission, written to its bundle, with what undoes it.
pub struct Prepared {
    admitted: admission::Prepared,
    /// The arbiter it was reserved with, which the undo releases it with.
    arbiter: ArbiterConfig,
}

impl Prepared {
    pub fn lease(&self) -> Option<&LeaseId> {
        self.admitted.lease()
    }
}

/// Read at each use, never kept: a fix to the file takes effect at the next
/// container without restarting containerd or the shim.
fn load_config() -> Result<Config, GpushareError> {
    Ok(Config::load_default()?.0)
}

/// Admits the container of `bundle_dir`: `None` when its spec is left as it is
/// (no request, a pod's pause container, or already edited upstream). A refused
/// container leaves no lease and its spec untouched.
pub fn prepare_create(
    container_id: &str,
    bundle_dir: &Path,
) -> Result<Option<Prepared>, GpushareError> {
    let config = match Config::load_default() {
        Ok((config, _)) => config,
        Err(error) => return prepare_unconfigured(container_id, bundle_dir, error),
    };
    let mut arbiter = ControlSocket::new(&config.arbiter);
    match admission::prepare_bundle(bundle_dir, &identity(container_id), &config, &mut arbiter)? {
        Admitted::Untouched(why) => {
            log::debug!("container {container_id}: spec left as it is ({why:?})");
            Ok(None)
        }
        Admitted::Edited(admitted) => Ok(Some(Prepared {
            admitted,
            arbiter: config.arbiter,
        })),
    }
}

/// `prepare_create` while the configuration is refused: a container that asks
/// nothing of gpushare is left as it is, with a warning in containerd's log; one
/// that asks is refused naming the file, its problems and the fix.
fn prepare_unconfigured(
    container_id: &str,
    bundle_dir: &Path,
    error: ConfigError,
) -> Result<Option<Prepared>, GpushareError> {
    let (_, spec) = BundleSpec::open(bundle_dir)?;
    match broken_config::decide(&spec, Some(container_id), error) {
        Decision::RunUntouched { warning } => {
            log::warn!("{warning}");
            Ok(None)
        }
        Decision::Refuse(refusal) => Err(refusal.into()),
    }
}

/// Undoes `prepare_create` after the runc shim failed to create the container:
/// the spec back byte for byte, the lease released.
pub fn undo_create(container_id: &str, prepared: Prepared) {
    let mut arbiter = ControlSocket::new(&prepared.arbiter);
    if let Err(e) = prepared.admitted.undo(&mut arbiter) {
        log::warn!("container {container_id}: undoing its create: {e}");
    }
}

/// Gives an exec process the container's injected environment. `Ok(false)` when
/// the container has none (it was not edited by gpushare).
pub fn edit_exec_process(
    container_bundle: &Path,
    process_json: &mut Vec<u8>,
) -> Result<bool, GpushareError> {
    let (_, container_spec) = BundleSpec::open(container_bundle)?;
    let mut process = Process::from_slice(process_json).map_err(GpushareError::ExecSpec)?;
    if !mutate::apply_to_exec_process(&mut process, &container_spec)? {
        return Ok(false);
    }
    *process_json = process.to_vec();
    Ok(true)
}

/// Releases every lease of a container. Idempotent: `Ok(false)` when there was none.
pub fn release_container(container_id: &str) -> Result<bool, GpushareError> {
    release(container_id, None)
}

/// Releases one lease (the container may since hold a newer one).
pub fn release_lease(container_id: &str, lease: &LeaseId) -> Result<bool, GpushareError> {
    release(container_id, Some(lease.clone()))
}

fn release(container_id: &str, lease: Option<LeaseId>) -> Result<bool, GpushareError> {
    let config = load_config()?;
    ControlSocket::new(&config.arbiter)
        .release(identity(container_id).holder(lease))
        .map_err(|source| GpushareError::Arbiter {
            container_id: container_id.to_owned(),
            source,
        })
}
