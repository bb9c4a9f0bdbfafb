//! What the library learns from its environment, once, when it is loaded.
//!
//! Only the lease's presence, the socket path and the log level come from here: the
//! quota itself is learned from the arbiter, never trusted from the container's
//! environment (the informational `GPUSHARE_QUOTA_*` variables are ignored).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::log::Level;

/// Where the runtime mounts the lease's directory inside the container.
pub const DEFAULT_SOCKET: &str = "/run/gpushare/arbiter.sock";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `GPUSHARE_LEASE`: without it the library is inert.
    pub lease: Option<String>,
    /// `GPUSHARE_SOCKET`, else [`DEFAULT_SOCKET`].
    pub socket: PathBuf,
    /// `GPUSHARE_LOG`: off unless asked for.
    pub log: Level,
}

/// The settings of an active library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Active {
    pub lease: String,
    pub socket: PathBuf,
}

/// What stands for the lease's name where only its socket says there is one (the
/// name is only ever logged: the arbiter knows a client by its socket).
pub const MOUNTED_LEASE: &str = "(the mounted lease socket)";

impl Settings {
    /// `socket_exists`: whether the lease's socket is there (the runtime mounts it
    /// into the container).
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
        socket_exists: impl Fn(&std::path::Path) -> bool,
    ) -> Settings {
        let socket = lookup("GPUSHARE_SOCKET")
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from(DEFAULT_SOCKET), PathBuf::from);
        // The container controls its environment: a process whose entrypoint reset it
        // (`env -i`, sudo, a login shell) but still loads the library (through
        // /etc/ld.so.preload, `runtime.ld_so_preload`) is gated all the same, because
        // the lease's socket mounted into the container is what arms the library.
        let lease = lookup("GPUSHARE_LEASE")
            .filter(|v| !v.is_empty())
            .or_else(|| socket_exists(&socket).then(|| MOUNTED_LEASE.to_owned()));
        let log = lookup("GPUSHARE_LOG").map_or(Level::Off, |v| Level::parse(&v));
        Settings { lease, socket, log }
    }

    pub fn from_environment() -> Settings {
        Settings::from_lookup(|name| std::env::var(name).ok(), |path| path.exists())
    }
}

static ACTIVE: AtomicBool = AtomicBool::new(false);
static SETTINGS: OnceLock<Active> = OnceLock::new();

/// Arms the library when the settings name a lease; returns whether it did.
pub fn install(settings: Settings) -> bool {
    let Some(lease) = settings.lease else {
        return false;
    };
    let _ = SETTINGS.set(Active {
        lease,
        socket: settings.socket,
    });
    ACTIVE.store(true, Ordering::Release);
    true
}

/// Whether a lease is in force (one relaxed load: callable on any path).
#[inline(always)]
pub fn is_active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

pub fn get() -> Option<&'static Active> {
    SETTINGS.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Settings {
        Settings::from_lookup(
            |n| {
                vars.iter()
                    .find(|(k, _)| *k == n)
                    .map(|(_, v)| v.to_string())
            },
            |_| false,
        )
    }

    #[test]
    fn the_mounted_lease_socket_arms_the_library_without_its_variable() {
        let mounted = |vars: &[(&str, &str)]| {
            Settings::from_lookup(
                |n| {
                    vars.iter()
                        .find(|(k, _)| *k == n)
                        .map(|(_, v)| v.to_string())
                },
                |p| p == std::path::Path::new(DEFAULT_SOCKET),
            )
        };
        // An environment reset: no GPUSHARE_* at all, the default socket is there.
        assert_eq!(mounted(&[]).lease.as_deref(), Some(MOUNTED_LEASE));
        // The variable, where present, names it.
        assert_eq!(
            mounted(&[("GPUSHARE_LEASE", "abc")]).lease.as_deref(),
            Some("abc")
        );
        // Another socket that is not there: inert.
        assert_eq!(mounted(&[("GPUSHARE_SOCKET", "/nowhere.sock")]).lease, None);
    }

    #[test]
    fn inert_without_a_lease_and_default_socket() {
        let s = settings(&[("GPUSHARE_QUOTA_MEMORY", "1")]);
        assert_eq!(s.lease, None);
        assert_eq!(s.socket, PathBuf::from(DEFAULT_SOCKET));
        assert_eq!(s.log, Level::Off);
        assert_eq!(settings(&[("GPUSHARE_LEASE", "")]).lease, None);
    }

    #[test]
    fn lease_socket_and_log_level() {
        let s = settings(&[
            ("GPUSHARE_LEASE", "abc-1"),
            ("GPUSHARE_SOCKET", "/tmp/x.sock"),
            ("GPUSHARE_LOG", "debug"),
        ]);
        assert_eq!(s.lease.as_deref(), Some("abc-1"));
        assert_eq!(s.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(s.log, Level::Debug);
    }
}
