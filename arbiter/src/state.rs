//! The lease table: every grant, confirmation and release, persisted before it is acknowledged.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use gpushare_config::ArbiterConfig;
use gpushare_proto::message::PENDING_PREFIX;
use gpushare_proto::{
    ErrorKind, GpuStatus, Lease, LeaseId, LeaseState, MemoryRequest, ReserveRequest, StatusReport,
};

use crate::inventory::Gpu;
use crate::placement::{self, GpuLoad, PlacementError};
use crate::store::{LeaseStore, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("container id {0:?}: must be 1 to 1024 printable characters")]
    BadContainerId(String),
    #[error("lease {0} is not waiting to be bound to a container")]
    NotPending(LeaseId),
    #[error("container {0:?} already holds a lease")]
    AlreadyHoldsLease(String),
    #[error("container {0:?} holds no lease")]
    NoLeaseForContainer(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("lease directory {path}: {source}")]
    LeaseDir {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl StateError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            StateError::Placement(PlacementError::NoRoom { .. }) => ErrorKind::Unplaceable,
            StateError::Placement(_)
            | StateError::BadContainerId(_)
            | StateError::NotPending(_)
            | StateError::AlreadyHoldsLease(_) => ErrorKind::InvalidRequest,
            StateError::NoLeaseForContainer(_) => ErrorKind::NotFound,
            StateError::Store(_) | StateError::LeaseDir { .. } => ErrorKind::Internal,
        }
    }
}

pub struct Arbiter {
    config: ArbiterConfig,
    gpus: Vec<Gpu>,
    leases: BTreeMap<LeaseId, Lease>,
    store: LeaseStore,
}

impl Arbiter {
    /// Loads the persisted leases; their directories are re-created so running
    /// containers' mounts keep pointing at something after a reboot of /run.
    pub fn open(config: ArbiterConfig, gpus: Vec<Gpu>) -> Result<Self, StateError> {
        let store = LeaseStore::open(&config.state_dir)?;
        let leases = store
            .load()?
            .into_iter()
            .map(|l| (l.id.clone(), l))
            .collect();
        let arbiter = Arbiter {
            config,
            gpus,
            leases,
            store,
        };
        for id in arbiter.leases.keys() {
            arbiter.create_lease_dir(id)?;
        }
        Ok(arbiter)
    }

    pub fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, StateError> {
        let id_ok = !request.container_id.is_empty()
            && request.container_id.len() <= 1024
            && !request.container_id.chars().any(char::is_control);
        if !id_ok {
            return Err(StateError::BadContainerId(request.container_id));
        }
        // A retried reserve for the same container (a wrapper that timed out after
        // the arbiter answered) gets its existing lease, not a second one.
        if let Some(existing) = self
            .leases
            .values()
            .find(|l| l.container_id == request.container_id)
        {
            return Ok(existing.clone());
        }
        let memory: MemoryRequest = request.memory.unwrap_or(self.config.default_memory);
        let chosen = placement::place(&request.gpu, memory, &self.gpus, &self.loads())?;
        let lease = Lease {
            id: new_lease_id(),
            container_id: request.container_id,
            sandbox_id: request.sandbox_id,
            gpus: chosen
                .gpus
                .iter()
                .map(|&i| self.gpus[i].uuid.clone())
                .collect(),
            priority: request.priority,
            memory_bytes: chosen.memory_bytes,
            compute_request: request.compute_request,
            compute_limit: request.compute_limit,
            tenant: request.tenant,
            state: LeaseState::Reserved,
            pid: None,
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        self.create_lease_dir(&lease.id)?;
        self.leases.insert(lease.id.clone(), lease.clone());
        if let Err(e) = self.persist() {
            self.leases.remove(&lease.id);
            self.remove_lease_dir(&lease.id);
            return Err(e);
        }
        Ok(lease)
    }

    pub fn confirm(&mut self, container_id: &str, pid: u32) -> Result<(), StateError> {
        let id = self
            .leases
            .values()
            .find(|l| l.container_id == container_id)
            .map(|l| l.id.clone())
            .ok_or_else(|| StateError::NoLeaseForContainer(container_id.to_owned()))?;
        let id = &id;
        let lease = self.leases.get_mut(id).expect("found above");
        let before = (lease.state, lease.pid);
        lease.state = LeaseState::Confirmed;
        lease.pid = Some(pid);
        if let Err(e) = self.persist() {
            let lease = self.leases.get_mut(id).expect("present above");
            (lease.state, lease.pid) = before;
            return Err(e);
        }
        Ok(())
    }

    /// Binds a pending lease (reserved by podman's precreate hook, which sees no
    /// container id) to its container, and confirms it.
    pub fn bind(&mut self, id: &LeaseId, container_id: &str, pid: u32) -> Result<(), StateError> {
        let pending = self
            .leases
            .get(id)
            .is_some_and(|l| l.container_id.starts_with(PENDING_PREFIX));
        if !pending {
            return Err(StateError::NotPending(id.clone()));
        }
        if self.leases.values().any(|l| l.container_id == container_id) {
            return Err(StateError::AlreadyHoldsLease(container_id.to_owned()));
        }
        let lease = self.leases.get_mut(id).expect("checked above");
        let before = lease.clone();
        lease.container_id = container_id.to_owned();
        lease.state = LeaseState::Confirmed;
        lease.pid = Some(pid);
        if let Err(e) = self.persist() {
            self.leases.insert(id.clone(), before);
            return Err(e);
        }
        Ok(())
    }

    /// Idempotent: returns whether the lease existed.
    pub fn release(&mut self, id: &LeaseId) -> Result<bool, StateError> {
        let Some(lease) = self.leases.remove(id) else {
            return Ok(false);
        };
        if let Err(e) = self.persist() {
            self.leases.insert(id.clone(), lease);
            return Err(e);
        }
        self.remove_lease_dir(id);
        Ok(true)
    }

    pub fn release_container(&mut self, container_id: &str) -> Result<bool, StateError> {
        match self
            .leases
            .values()
            .find(|l| l.container_id == container_id)
            .map(|l| l.id.clone())
        {
            Some(id) => self.release(&id),
            None => Ok(false),
        }
    }

    pub fn status(&self) -> StatusReport {
        let loads = self.loads();
        StatusReport {
            gpus: self
                .gpus
                .iter()
                .zip(&loads)
                .map(|(g, load)| GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_total: g.memory_total,
                    memory_leased: load.memory_leased,
                })
                .collect(),
            leases: self.leases.values().cloned().collect(),
        }
    }

    fn loads(&self) -> Vec<GpuLoad> {
        self.gpus
            .iter()
            .map(|g| {
                self.leases
                    .values()
                    .filter(|l| l.gpus.contains(&g.uuid))
                    .fold(GpuLoad::default(), |acc, l| GpuLoad {
                        leases: acc.leases + 1,
                        memory_leased: acc.memory_leased + l.memory_bytes,
                    })
            })
            .collect()
    }

    fn persist(&self) -> Result<(), StateError> {
        Ok(self.store.save(&self.leases.values().collect::<Vec<_>>())?)
    }

    fn create_lease_dir(&self, id: &LeaseId) -> Result<(), StateError> {
        let path = self.config.lease_dir(id);
        let err = |source| StateError::LeaseDir {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&path).map_err(err)?;
        // Containers may run as any user and must reach the lease socket inside.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(err)
    }

    fn remove_lease_dir(&self, id: &LeaseId) {
        let path = self.config.lease_dir(id);
        if let Err(e) = fs::remove_dir_all(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "could not remove lease directory");
            }
        }
    }
}

/// 64 random bits: unique across restarts without coordinating with the store.
fn new_lease_id() -> LeaseId {
    let mut bytes = [0u8; 8];
    let random = fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if random.is_err() {
        // /dev/urandom is always there on Linux; fall back to time + pid rather than fail a container.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = ((nanos as u64) ^ ((std::process::id() as u64) << 40)).to_le_bytes();
    }
    LeaseId(format!("{:016x}", u64::from_le_bytes(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{Fraction, GpuSelector, Priority};

    fn setup() -> (tempfile::TempDir, Arbiter) {
        let dir = tempfile::tempdir().unwrap();
        let config = ArbiterConfig {
            run_dir: dir.path().join("run"),
            state_dir: dir.path().join("state"),
            ..Default::default()
        };
        let gpus = vec![Gpu {
            index: 0,
            uuid: "GPU-0".into(),
            name: "t".into(),
            memory_total: 8 << 30,
        }];
        let arbiter = Arbiter::open(config, gpus).unwrap();
        (dir, arbiter)
    }

    fn request(container: &str, memory: &str) -> ReserveRequest {
        ReserveRequest {
            container_id: container.into(),
            sandbox_id: None,
            priority: Priority::Low,
            memory: Some(memory.parse().unwrap()),
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            gpu: GpuSelector::Count(1),
            tenant: None,
        }
    }

    #[test]
    fn reserve_persists_and_survives_reopen() {
        let (dir, mut arbiter) = setup();
        let lease = arbiter.reserve(request("c1", "1Gi")).unwrap();
        assert_eq!(lease.gpus, vec!["GPU-0".to_string()]);
        assert!(dir.path().join("run/leases").join(&lease.id.0).is_dir());
        arbiter.confirm("c1", 42).unwrap();
        let config = arbiter.config.clone();
        let gpus = arbiter.gpus.clone();
        drop(arbiter);
        let reopened = Arbiter::open(config, gpus).unwrap();
        let status = reopened.status();
        assert_eq!(status.leases.len(), 1);
        assert_eq!(status.leases[0].pid, Some(42));
        assert_eq!(status.leases[0].state, LeaseState::Confirmed);
        assert_eq!(status.gpus[0].memory_leased, 1 << 30);
    }

    #[test]
    fn release_is_idempotent_and_removes_the_directory() {
        let (dir, mut arbiter) = setup();
        let lease = arbiter.reserve(request("c1", "1Gi")).unwrap();
        assert!(arbiter.release(&lease.id).unwrap());
        assert!(!arbiter.release(&lease.id).unwrap());
        assert!(!dir.path().join("run/leases").join(&lease.id.0).exists());
        assert!(arbiter.status().leases.is_empty());
    }

    #[test]
    fn same_container_gets_the_same_lease() {
        let (_dir, mut arbiter) = setup();
        let a = arbiter.reserve(request("c1", "1Gi")).unwrap();
        let b = arbiter.reserve(request("c1", "1Gi")).unwrap();
        assert_eq!(a.id, b.id);
        assert_eq!(arbiter.status().leases.len(), 1);
        assert!(arbiter.release_container("c1").unwrap());
        assert!(!arbiter.release_container("c1").unwrap());
    }

    #[test]
    fn only_a_pending_lease_can_be_bound_and_only_once() {
        let (_dir, mut arbiter) = setup();
        let victim = arbiter.reserve(request("victim", "1Gi")).unwrap();
        let err = arbiter.bind(&victim.id, "attacker", 7).unwrap_err();
        assert!(matches!(err, StateError::NotPending(_)), "{err}");
        assert_eq!(
            arbiter
                .status()
                .leases
                .iter()
                .find(|l| l.id == victim.id)
                .unwrap()
                .container_id,
            "victim"
        );

        let pending = arbiter.reserve(request("pending:5eed", "1Gi")).unwrap();
        let err = arbiter.bind(&pending.id, "victim", 7).unwrap_err();
        assert!(
            matches!(err, StateError::AlreadyHoldsLease(_)),
            "one lease per container: {err}"
        );
        arbiter.bind(&pending.id, "podman-ctr", 42).unwrap();
        let bound = arbiter
            .status()
            .leases
            .into_iter()
            .find(|l| l.id == pending.id)
            .unwrap();
        assert_eq!(
            (bound.container_id.as_str(), bound.pid, bound.state),
            ("podman-ctr", Some(42), LeaseState::Confirmed)
        );
        assert!(
            matches!(
                arbiter.bind(&pending.id, "other", 1),
                Err(StateError::NotPending(_))
            ),
            "bound once"
        );
        assert!(arbiter.release_container("podman-ctr").unwrap());
    }

    #[test]
    fn memory_is_accounted_across_leases() {
        let (_dir, mut arbiter) = setup();
        arbiter.reserve(request("c1", "6Gi")).unwrap();
        let err = arbiter.reserve(request("c2", "3Gi")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unplaceable);
        arbiter.reserve(request("c3", "2Gi")).unwrap();
    }

    #[test]
    fn confirm_of_unknown_container_is_not_found() {
        let (_dir, mut arbiter) = setup();
        let err = arbiter.confirm("nope", 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
    }
}
