//! Admission: the one path by which a container gets (or is refused) a lease,
//! for every entry point: the containerd shim's `Create`, `gpushare-runc create`
//! and podman's `precreate` hook. Each entry point only gathers what its engine
//! tells it (the spec, the container id and the id space it belongs to) and calls
//! `admit` (a spec in memory) or `prepare_bundle` (a bundle's config.json).
//!
//! In order:
//! 1. a pod's pause container is left as it is (`kubernetes::is_pod_sandbox`);
//! 2. a spec gpushare already edited (the marker) is left as it is if the arbiter
//!    granted its lease to this container, and refused otherwise;
//! 3. the request is read, with the grants gpushare-kube's `Allocate` named and the
//!    pod the CRI runtime recorded (`request::from_spec`); a bad one, or a pod's
//!    share without a memory grant under `kubernetes.require_grant`, is refused
//!    before anything is reserved; no request leaves the spec as it is (or, under the
//!    `void` policy, hides the GPUs). The arbiter judges the grants themselves. A
//!    runtime profile (`admit_through`) is the operator's grant and a request by
//!    itself; what the environment asks beyond the node's policy is refused, its
//!    memory once the arbiter's status names the GPUs;
//! 4. an image whose CUDA the driver cannot run is refused, before anything is reserved;
//! 5. the lease is reserved and the spec edited; if the edit fails, the lease is
//!    released before the error is returned.
//!
//! What is returned carries its own undo: the reservation released and, for a
//! bundle, the spec on disk put back byte for byte.

mod arbiter;
#[cfg(test)]
mod tests;

use std::io::Read;
use std::path::{Path, PathBuf};

use gpushare_config::{Config, Unrequested};
use gpushare_proto::message::PENDING_PREFIX;
use gpushare_proto::{ClientError, ContainerRef, ErrorKind, Lease, LeaseId};

pub use arbiter::{Arbiter, ControlSocket};

use crate::bundle::{BundleError, BundleSpec};
use crate::cuda_compat::{self, CompatError};
use crate::mutate::{self, HostPaths};
use crate::request::{self, RequestError};
use crate::spec::{Spec, SpecError};
use crate::{kubernetes, ANNOTATION_MARKER};

/// The id space a container id belongs to, as the entry point learns it from its
/// engine, never from the spec: two engines, or two containerd namespaces, may
/// use one id at once (see `ReserveRequest::namespace`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Namespace {
    /// The shim: the containerd namespace it serves (its `-namespace`).
    Containerd(String),
    /// gpushare-runc: the OCI runtime's state root (its `--root`).
    RuntimeRoot(PathBuf),
    /// The entry point is not told.
    Unknown,
}

impl Namespace {
    /// The lease key's namespace, as the arbiter stores it.
    pub fn key(&self) -> Option<String> {
        match self {
            Namespace::Containerd(ns) => Some(format!("containerd:{ns}")),
            Namespace::RuntimeRoot(root) => Some(format!("runtime-root:{}", root.display())),
            Namespace::Unknown => None,
        }
    }
}

/// Who is being admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A container its engine named.
    Container { id: String, namespace: Namespace },
    /// podman's precreate hook runs before the container has an id: the lease is
    /// reserved under this unguessable pending id, and the createRuntime hook binds
    /// it to the container. Nothing before precreate edits a spec, so a marked one
    /// is refused outright.
    Pending(String),
}

impl Identity {
    pub fn container(id: impl Into<String>, namespace: Namespace) -> Self {
        Identity::Container {
            id: id.into(),
            namespace,
        }
    }

    /// A fresh pending id: 128 random bits.
    pub fn pending() -> std::io::Result<Self> {
        let mut bytes = [0u8; 16];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Identity::Pending(format!("{PENDING_PREFIX}{hex}")))
    }

    pub fn container_id(&self) -> &str {
        match self {
            Identity::Container { id, .. } | Identity::Pending(id) => id,
        }
    }

    fn namespace_key(&self) -> Option<String> {
        match self {
            Identity::Container { namespace, .. } => namespace.key(),
            Identity::Pending(_) => None,
        }
    }

    /// How the arbiter finds this container's lease.
    pub fn holder(&self, lease: Option<LeaseId>) -> ContainerRef {
        ContainerRef {
            container_id: self.container_id().to_owned(),
            namespace: self.namespace_key(),
            lease,
        }
    }
}

/// How an entry point reports a refusal: the shim maps these to ttrpc codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The container's own fault: fix the request (or the image).
    InvalidRequest,
    /// The arbiter could not be reached, or nothing on this node can hold the
    /// request now: trying again later may succeed.
    Unavailable,
    /// The bundle or the spec cannot be edited.
    Failed,
}

#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The container asked for something malformed: the parser's own message.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The image needs a newer CUDA than the host driver provides.
    #[error("{}{source}", who(.container_id))]
    Incompatible {
        container_id: String,
        source: CompatError,
    },
    #[error(
        "{}its spec carries gpushare's own annotations ({ANNOTATION_MARKER}) but the arbiter granted it no such lease; \
         these annotations are written by gpushare and cannot be set by hand",
        who(.container_id)
    )]
    ForgedMarker { container_id: String },
    #[error("the spec already carries {ANNOTATION_MARKER}: gpushare's annotations cannot be set by hand")]
    MarkedBeforeCreation,
    #[error("{}{source}", who(.container_id))]
    Arbiter {
        container_id: String,
        source: ClientError,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
}

/// "container ID: ", or nothing for a pending id, which names nothing the user knows.
fn who(container_id: &str) -> String {
    if container_id.starts_with(PENDING_PREFIX) {
        String::new()
    } else {
        format!("container {container_id}: ")
    }
}

impl AdmissionError {
    pub fn class(&self) -> ErrorClass {
        match self {
            AdmissionError::Request(_)
            | AdmissionError::Incompatible { .. }
            | AdmissionError::ForgedMarker { .. }
            | AdmissionError::MarkedBeforeCreation => ErrorClass::InvalidRequest,
            // The arbiter's verdict on the request itself (a GPU index it does not have).
            AdmissionError::Arbiter {
                source:
                    ClientError::Refused {
                        kind: ErrorKind::InvalidRequest,
                        ..
                    },
                ..
            } => ErrorClass::InvalidRequest,
            AdmissionError::Arbiter { .. } => ErrorClass::Unavailable,
            AdmissionError::Spec(_) | AdmissionError::Bundle(_) => ErrorClass::Failed,
        }
    }

    fn arbiter(identity: &Identity) -> impl FnOnce(ClientError) -> AdmissionError + '_ {
        |source| AdmissionError::Arbiter {
            container_id: identity.container_id().to_owned(),
            source,
        }
    }
}

/// The outcome of admission: the spec left exactly as it was, or `E`, an edit
/// with its undo.
#[derive(Debug)]
pub enum Admitted<E> {
    Untouched(Untouched),
    Edited(E),
}

/// Why a spec was left as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untouched {
    /// The container asks for nothing (and the policy is `ignore`).
    NoRequest,
    /// A pod's pause container.
    PodSandbox,
    /// gpushare upstream in the chain (the shim, the precreate hook) already
    /// edited it, with a lease the arbiter granted to this container.
    AlreadyAdmitted,
}

/// A lease reserved for a container, and how to release it.
#[derive(Debug)]
struct Reservation {
    lease: Lease,
    holder: ContainerRef,
}

impl Reservation {
    fn release(&self, arbiter: &mut dyn Arbiter) -> Result<(), ClientError> {
        arbiter.release(self.holder.clone()).map(|_| ())
    }
}

/// An edited spec in memory, and its reservation (none under the `void` policy).
#[derive(Debug)]
#[must_use = "an edit that is not used must be withdrawn"]
pub struct Edit {
    spec: Spec,
    reservation: Option<Reservation>,
}

impl Edit {
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    pub fn lease(&self) -> Option<&Lease> {
        self.reservation.as_ref().map(|r| &r.lease)
    }

    /// The edited spec will not be used: its lease is released.
    pub fn withdraw(self, arbiter: &mut dyn Arbiter) -> Result<(), ClientError> {
        match &self.reservation {
            Some(reservation) => reservation.release(arbiter),
            None => Ok(()),
        }
    }
}

/// Admits the container whose spec is `spec`: see the module's documentation.
/// Nothing is reserved unless the edit is returned; the arbiter is asked only
/// once there is a request (or a marker) to ask about.
pub fn admit(
    spec: &Spec,
    identity: &Identity,
    config: &Config,
    arbiter: &mut dyn Arbiter,
) -> Result<Admitted<Edit>, AdmissionError> {
    admit_through(spec, identity, config, None, arbiter)
}

/// As [`admit`], for a container started through a runtime entry that names the
/// runtime profile `profile` (`gpushare-runc --gpushare-profile`): the operator's
/// grant, beyond what the environment may ask.
pub fn admit_through(
    spec: &Spec,
    identity: &Identity,
    config: &Config,
    profile: Option<&str>,
    arbiter: &mut dyn Arbiter,
) -> Result<Admitted<Edit>, AdmissionError> {
    if kubernetes::is_pod_sandbox(spec) {
        return Ok(Admitted::Untouched(Untouched::PodSandbox));
    }
    if mutate::is_marked(spec) {
        let Identity::Container { id, .. } = identity else {
            return Err(AdmissionError::MarkedBeforeCreation);
        };
        let status = arbiter
            .status()
            .map_err(AdmissionError::arbiter(identity))?;
        return if mutate::marker_is_genuine(spec, id, &status) {
            Ok(Admitted::Untouched(Untouched::AlreadyAdmitted))
        } else {
            Err(AdmissionError::ForgedMarker {
                container_id: id.clone(),
            })
        };
    }
    let profile = match profile {
        Some(name) => Some(request::Profile::named(config, name)?),
        None => None,
    };
    let asking = request::Asking::new(config, profile);
    let Some(wanted) = request::from_spec(spec, &asking)? else {
        if config.requests.unrequested == Unrequested::Void {
            let mut spec = spec.clone();
            mutate::apply_void(&mut spec)?;
            return Ok(Admitted::Edited(Edit {
                spec,
                reservation: None,
            }));
        }
        return Ok(Admitted::Untouched(Untouched::NoRequest));
    };

    let status = arbiter
        .status()
        .map_err(AdmissionError::arbiter(identity))?;
    let allocatable: Vec<u64> = status
        .gpus
        .iter()
        .map(|gpu| match gpu.memory_allocatable {
            0 => gpu.memory_total,
            bytes => bytes,
        })
        .collect();
    wanted.check_environment_memory(&allocatable)?;
    let driver = status.driver_cuda_version;
    cuda_compat::check_spec(spec, driver).map_err(|source| AdmissionError::Incompatible {
        container_id: identity.container_id().to_owned(),
        source,
    })?;
    let lease = arbiter
        .reserve(wanted.into_reserve(
            identity.container_id().to_owned(),
            identity.namespace_key(),
            kubernetes::sandbox_id(spec),
        ))
        .map_err(AdmissionError::arbiter(identity))?;
    let reservation = Reservation {
        holder: identity.holder(Some(lease.id.clone())),
        lease,
    };

    let mut edited = spec.clone();
    let paths = HostPaths::new(&config.runtime, &config.arbiter, &reservation.lease);
    if let Err(e) = mutate::apply_lease(&mut edited, &reservation.lease, &paths) {
        // The edit's error is the one to report; the release is best effort
        // (the arbiter's reconciliation releases an unconfirmed lease anyway).
        let _ = reservation.release(arbiter);
        return Err(e.into());
    }
    Ok(Admitted::Edited(Edit {
        spec: edited,
        reservation: Some(reservation),
    }))
}

/// An edit written to a bundle's config.json, with what undoes it.
#[derive(Debug)]
#[must_use = "a prepared container is either created or undone"]
pub struct Prepared {
    bundle: BundleSpec,
    reservation: Option<Reservation>,
}

impl Prepared {
    /// The lease reserved for the container (none under the `void` policy).
    pub fn lease(&self) -> Option<&LeaseId> {
        self.reservation.as_ref().map(|r| &r.lease.id)
    }

    /// The container was not created: its spec goes back byte for byte and its
    /// lease is released. Both are attempted whatever the other's outcome.
    pub fn undo(self, arbiter: &mut dyn Arbiter) -> Result<(), UndoError> {
        let restore = self.bundle.restore().err();
        let release = self
            .reservation
            .and_then(|r| r.release(arbiter).err().map(|e| (r.lease.id, e)));
        match (restore, release) {
            (None, None) => Ok(()),
            (restore, release) => Err(UndoError { restore, release }),
        }
    }
}

/// What an undo could not do.
#[derive(Debug)]
pub struct UndoError {
    pub restore: Option<BundleError>,
    pub release: Option<(LeaseId, ClientError)>,
}

impl std::fmt::Display for UndoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(e) = &self.restore {
            parts.push(format!("cannot restore the spec: {e}"));
        }
        if let Some((lease, e)) = &self.release {
            parts.push(format!("cannot release lease {}: {e}", lease.0));
        }
        f.write_str(&parts.join("; "))
    }
}

impl std::error::Error for UndoError {}

/// Admits the container of the bundle in `bundle_dir`, writing the edit into its
/// config.json. A failed write puts the original back and releases the lease.
pub fn prepare_bundle(
    bundle_dir: &Path,
    identity: &Identity,
    config: &Config,
    arbiter: &mut dyn Arbiter,
) -> Result<Admitted<Prepared>, AdmissionError> {
    prepare_bundle_through(bundle_dir, identity, config, None, arbiter)
}

/// As [`prepare_bundle`], through the runtime profile `profile` (see [`admit_through`]).
pub fn prepare_bundle_through(
    bundle_dir: &Path,
    identity: &Identity,
    config: &Config,
    profile: Option<&str>,
    arbiter: &mut dyn Arbiter,
) -> Result<Admitted<Prepared>, AdmissionError> {
    let (bundle, spec) = BundleSpec::open(bundle_dir)?;
    let edit = match admit_through(&spec, identity, config, profile, arbiter)? {
        Admitted::Untouched(why) => return Ok(Admitted::Untouched(why)),
        Admitted::Edited(edit) => edit,
    };
    if let Err(e) = bundle.write(&edit.spec) {
        let prepared = Prepared {
            bundle,
            reservation: edit.reservation,
        };
        let _ = prepared.undo(arbiter);
        return Err(e.into());
    }
    Ok(Admitted::Edited(Prepared {
        bundle,
        reservation: edit.reservation,
    }))
}
