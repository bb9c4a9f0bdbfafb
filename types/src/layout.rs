//! Where gpushare's files live: on the host under the arbiter's `run_dir`, and inside a
//! sharing container. Every component that makes one of these paths asks here, so the
//! arbiter that creates a lease's socket and the runtime that mounts it cannot disagree.
//!
//! ```text
//! <run_dir>/control.sock              the control socket (root only)
//! <run_dir>/leases/                   0711: searchable, not listable
//! <run_dir>/leases/<lease>/           bind-mounted at /run/gpushare in the container
//! <run_dir>/leases/<lease>/arbiter.sock   the lease's own socket
//! ```

use std::path::{Path, PathBuf};

use crate::lease_id::{BadLeaseId, LeaseId};

/// The directory a lease's container sees as its own gpushare directory.
pub const CONTAINER_DIR: &str = "/run/gpushare";
/// The lease socket as the container sees it (`CONTAINER_DIR` + `LEASE_SOCKET`).
pub const CONTAINER_SOCKET: &str = "/run/gpushare/arbiter.sock";
/// The lease socket's file name inside a lease directory.
pub const LEASE_SOCKET: &str = "arbiter.sock";
/// The directory of lease directories, under `run_dir`.
pub const LEASES_DIR: &str = "leases";
/// The control socket's file name under `run_dir` (when not configured elsewhere).
pub const CONTROL_SOCKET: &str = "control.sock";

/// The host side of the layout, rooted at the arbiter's `run_dir`.
#[derive(Debug, Clone, Copy)]
pub struct HostLayout<'a> {
    pub run_dir: &'a Path,
}

impl<'a> HostLayout<'a> {
    pub fn new(run_dir: &'a Path) -> HostLayout<'a> {
        HostLayout { run_dir }
    }

    pub fn leases_dir(&self) -> PathBuf {
        self.run_dir.join(LEASES_DIR)
    }

    /// A lease's directory. The id is checked here, where it becomes a path: `../../x`
    /// would name a place outside `run_dir`.
    pub fn lease_dir(&self, lease: &LeaseId) -> Result<PathBuf, BadLeaseId> {
        if !LeaseId::is_well_formed(&lease.0) {
            return Err(BadLeaseId {
                value: lease.0.clone(),
            });
        }
        Ok(self.leases_dir().join(&lease.0))
    }

    /// A lease's socket, as the host sees it.
    pub fn lease_socket(&self, lease: &LeaseId) -> Result<PathBuf, BadLeaseId> {
        Ok(self.lease_dir(lease)?.join(LEASE_SOCKET))
    }

    pub fn default_control_socket(&self) -> PathBuf {
        self.run_dir.join(CONTROL_SOCKET)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_documented_layout_and_refuse_ids_that_escape() {
        let layout = HostLayout::new(Path::new("/run/gpushare"));
        let lease = LeaseId::parse("00ab").unwrap();
        assert_eq!(
            layout.lease_socket(&lease).unwrap(),
            Path::new("/run/gpushare/leases/00ab/arbiter.sock")
        );
        assert_eq!(
            Path::new(CONTAINER_DIR).join(LEASE_SOCKET),
            Path::new(CONTAINER_SOCKET)
        );
        let err = layout
            .lease_dir(&LeaseId("../../x".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"../../x\""), "{err}");
    }
}
