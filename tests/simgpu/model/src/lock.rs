//! The process-shared, robust mutex that guards the shared state.
//!
//! A process can be killed while it holds the lock (SIGKILL in the middle of an allocation). A
//! plain process-shared mutex would then stay locked forever and hang every other process on the
//! machine (the failure HAMi-core#86 reports). A robust mutex is handed to the next locker with
//! `EOWNERDEAD`; it marks the mutex consistent and tells the caller to repair the state.

use std::cell::UnsafeCell;

/// glibc's value; the libc crate does not export it for linux-gnu.
const PTHREAD_MUTEX_ROBUST: libc::c_int = 1;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("pthread mutex initialisation failed: {0}")]
    Init(std::io::Error),
    #[error("pthread_mutex_lock failed: {0}")]
    Lock(std::io::Error),
}

/// A `pthread_mutex_t` that lives in shared memory.
#[repr(C)]
pub struct RobustMutex {
    raw: UnsafeCell<libc::pthread_mutex_t>,
}

/// How the lock was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    Clean,
    /// The previous owner died holding it: the protected state may be half-updated.
    PreviousOwnerDied,
}

impl RobustMutex {
    /// Initialises the mutex in place.
    ///
    /// # Safety
    /// `this` must point to writable memory that no other thread or process uses yet.
    pub unsafe fn init(this: *mut RobustMutex) -> Result<(), LockError> {
        let mut attr = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
        // SAFETY: standard pthread attribute initialisation on memory we own; the mutex memory is
        // exclusively ours per this function's contract.
        unsafe {
            check(libc::pthread_mutexattr_init(attr.as_mut_ptr())).map_err(LockError::Init)?;
            let result = check(libc::pthread_mutexattr_setpshared(
                attr.as_mut_ptr(),
                libc::PTHREAD_PROCESS_SHARED,
            ))
            .and_then(|_| {
                check(libc::pthread_mutexattr_setrobust(
                    attr.as_mut_ptr(),
                    PTHREAD_MUTEX_ROBUST,
                ))
            })
            .and_then(|_| check(libc::pthread_mutex_init((*this).raw.get(), attr.as_ptr())));
            libc::pthread_mutexattr_destroy(attr.as_mut_ptr());
            result.map_err(LockError::Init)
        }
    }

    /// Locks, recovering a mutex whose owner died.
    pub fn lock(&self) -> Result<Acquired, LockError> {
        // SAFETY: the mutex was initialised by `init` before the state was published (the state's
        // magic is written last), and it lives as long as the mapping that holds `self`.
        let rc = unsafe { libc::pthread_mutex_lock(self.raw.get()) };
        match rc {
            0 => Ok(Acquired::Clean),
            libc::EOWNERDEAD => {
                // SAFETY: we own the mutex now (EOWNERDEAD hands it over); marking it consistent
                // is the documented recovery.
                unsafe { libc::pthread_mutex_consistent(self.raw.get()) };
                Ok(Acquired::PreviousOwnerDied)
            }
            e => Err(LockError::Lock(std::io::Error::from_raw_os_error(e))),
        }
    }

    pub fn unlock(&self) {
        // SAFETY: only called by the guard that locked it.
        unsafe { libc::pthread_mutex_unlock(self.raw.get()) };
    }
}

fn check(rc: libc::c_int) -> Result<(), std::io::Error> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}
