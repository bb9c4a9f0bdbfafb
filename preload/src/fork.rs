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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounts;

    #[test]
    fn a_fork_child_starts_from_fresh_accounts_and_its_own_connection() {
        let (_d, path) = crate::lease_link::tests::fake_arbiter(1000);
        crate::config::install(crate::config::Settings {
            lease: Some("l".into()),
            socket: path,
            log: crate::log::Level::Off,
        });
        let parent = {
            let mut a = accounts::lock().expect("active");
            assert_eq!(
                a.allocate_device(100, "t", || Ok(1)),
                crate::cuda::CUDA_SUCCESS
            );
            assert_eq!(a.link.held(), 100);
            &*a as *const accounts::Accounts
        };
        // What the pthread_atfork child handler does; a lock held elsewhere at the
        // fork would not matter: the child never touches the parent's mutex again.
        let held_elsewhere = accounts::lock().expect("active");
        // The unit tests cannot fork a test harness: the handler is called directly.
        in_child();
        let mut child = accounts::lock().expect("active");
        assert_ne!(
            &*child as *const accounts::Accounts, parent,
            "fresh accounts"
        );
        assert_eq!(child.link.held(), 0, "the parent's memory is the parent's");
        assert_eq!(
            child.allocate_device(100, "t", || Ok(2)),
            crate::cuda::CUDA_SUCCESS,
            "its own connection works"
        );
        drop(held_elsewhere);
    }
}
