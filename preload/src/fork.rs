//! Fork safety. A child of a multithreaded process has one thread; any lock another
//! thread held at the fork stays held for ever in the child, and the child shares the
//! parent's arbiter connection. So the child handler takes no lock and allocates
//! nothing: it closes the child's copy of the connection (`close` is
//! async-signal-safe) and detaches the child from the parent's state, which the child
//! then rebuilds on first use (its own connection, its own zero holdings — the
//! parent's device memory is the parent's). The parent is untouched.

use std::sync::Once;

static INSTALLED: Once = Once::new();

extern "C" fn in_child() {
    crate::watch::forget_after_fork();
    crate::accounts::forget_after_fork();
    crate::gate::reset_after_fork();
}

/// The child handler, for the unit tests (which cannot fork a test harness).
#[cfg(test)]
pub fn in_child_for_tests() {
    in_child();
}

pub fn install_handlers() {
    INSTALLED.call_once(|| {
        // SAFETY: registers a handler with the signature pthread_atfork expects.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            crate::log_error!(
                "pthread_atfork failed ({rc}): fork children would share the arbiter connection"
            );
        }
    });
}
