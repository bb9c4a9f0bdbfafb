//! Is the process that owns a slot still alive? Asked across PID namespaces.
//!
//! Each process slot has one byte of a lock file; its owner holds an open-file-description (OFD)
//! write lock on that byte for as long as it lives. The kernel drops the lock when the last
//! descriptor of that open file goes away, i.e. when the process dies, however it dies. Pids
//! cannot be compared across containers (each has its own PID namespace) and can be reused; a
//! lock held through a bind-mounted file works everywhere.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum LivenessError {
    #[error("cannot open the owner-lock file {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("fcntl on the owner-lock file failed: {0}")]
    Fcntl(std::io::Error),
}

/// The owner-lock file, opened by one process.
pub struct OwnerLocks {
    file: File,
}

fn flock_for(byte: u32, kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is plain old data; all-zero is a valid value (and OFD locks require l_pid 0).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

impl OwnerLocks {
    pub fn open(path: &Path) -> Result<OwnerLocks, LivenessError> {
        // O_CLOEXEC (std's default) so that programs this process execs do not keep its slot alive.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|source| LivenessError::Open {
                path: path.display().to_string(),
                source,
            })?;
        Ok(OwnerLocks { file })
    }

    /// Takes ownership of `byte`; false if a live process holds it.
    pub fn try_claim(&self, byte: u32) -> Result<bool, LivenessError> {
        let fl = flock_for(byte, libc::F_WRLCK);
        // SAFETY: fcntl with a valid descriptor and a pointer to a flock that outlives the call.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
        if rc == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
            _ => Err(LivenessError::Fcntl(err)),
        }
    }

    /// Gives up `byte` (a process detaching without exiting).
    pub fn release(&self, byte: u32) {
        let fl = flock_for(byte, libc::F_UNLCK);
        // SAFETY: as in try_claim.
        unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    }

    /// Whether some open file description other than this one holds `byte`.
    ///
    /// Call it through a handle that does not own the byte: OFD locks never conflict with the
    /// description that holds them, so the owner would see its own byte as free.
    pub fn is_held(&self, byte: u32) -> Result<bool, LivenessError> {
        let mut fl = flock_for(byte, libc::F_WRLCK);
        // SAFETY: as in try_claim; F_OFD_GETLK writes into fl.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
        if rc != 0 {
            return Err(LivenessError::Fcntl(std::io::Error::last_os_error()));
        }
        Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_byte_is_held_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owners");
        let owner = OwnerLocks::open(&path).unwrap();
        let observer = OwnerLocks::open(&path).unwrap();
        assert!(!observer.is_held(3).unwrap());
        assert!(owner.try_claim(3).unwrap());
        assert!(observer.is_held(3).unwrap());
        assert!(
            !observer.try_claim(3).unwrap(),
            "a second description cannot take a held byte"
        );
        assert!(!observer.is_held(4).unwrap());
        owner.release(3);
        assert!(!observer.is_held(3).unwrap());
        drop(owner);
    }

    #[test]
    fn closing_the_owner_frees_the_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owners");
        let owner = OwnerLocks::open(&path).unwrap();
        let observer = OwnerLocks::open(&path).unwrap();
        assert!(owner.try_claim(0).unwrap());
        drop(owner);
        assert!(!observer.is_held(0).unwrap());
    }
}
