//! Where a lease's socket lives: its directory under the run directory.

use super::*;

/// Where a lease's socket lives: created when the lease is granted (or reloaded),
/// removed when it is released.
pub trait LeaseEndpoints: Send {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError>;
    fn close(&mut self, lease: &LeaseId);
}

/// Only the directory (unit tests, and what a socket is created in).
pub struct LeaseDirs {
    pub run_dir: PathBuf,
}

impl LeaseDirs {
    /// Refuses an id that is not a plain name: `../../x` would name a directory
    /// outside `run_dir` (ids are checked where they are read, and again here,
    /// where one becomes a path).
    pub fn path(&self, lease: &LeaseId) -> Result<PathBuf, StateError> {
        if !LeaseId::is_well_formed(&lease.0) {
            return Err(BadLeaseId {
                value: lease.0.clone(),
            }
            .into());
        }
        Ok(self.run_dir.join("leases").join(&lease.0))
    }

    pub fn create(&self, lease: &LeaseId) -> Result<PathBuf, StateError> {
        let path = self.path(lease)?;
        let err = |source| StateError::LeaseDir {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&path).map_err(err)?;
        // Searchable but not listable: a lease id is what entitles a pending lease
        // to be bound (podman's precreate), so host users must not be able to read
        // the ids off the directory. Containers see only their own lease directory.
        let leases = self.run_dir.join("leases");
        fs::set_permissions(&leases, fs::Permissions::from_mode(0o711)).map_err(|source| {
            StateError::LeaseDir {
                path: leases.clone(),
                source,
            }
        })?;
        // Containers may run as any user and must reach the lease socket inside.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(err)?;
        Ok(path)
    }

    pub fn remove(&self, lease: &LeaseId) {
        let path = match self.path(lease) {
            Ok(path) => path,
            Err(e) => {
                tracing::error!(error = %e, "not removing a lease directory");
                return;
            }
        };
        if let Err(e) = fs::remove_dir_all(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %path.display(), error = %e, "could not remove lease directory");
            }
        }
    }
}

impl LeaseEndpoints for LeaseDirs {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError> {
        self.create(lease).map(|_| ())
    }
    fn close(&mut self, lease: &LeaseId) {
        self.remove(lease)
    }
}
