//! Putting the daemon together: inventory, store, sockets, background work.
//! Shared by the binary and the recovery benchmark.

use std::fs::File;
use std::sync::{Arc, Mutex};

use gpushare_config::{ArbiterConfig, SchedulerConfig};
use nix::fcntl::{Flock, FlockArg};

use crate::inventory::{self, GpuBackend};
use crate::process::ProcFs;
use crate::server::{self, SharedArbiter, SocketEndpoints};
use crate::state::{Arbiter, Inventory, StateError};
use crate::store::{LeaseStore, StoreError, StoreOptions};
use crate::tokens::TokenService;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("another gpushare-arbiter holds {0} (one arbiter per state directory)")]
    AlreadyRunning(std::path::PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Inventory(#[from] inventory::InventoryError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    State(#[from] StateError),
}

/// Held for the daemon's lifetime: a second arbiter on the same state directory
/// would fight over the lease sockets. The kernel drops it when the process dies.
pub fn lock_state_dir(config: &ArbiterConfig) -> Result<Flock<File>, DaemonError> {
    let dir = &config.state_dir;
    std::fs::create_dir_all(dir).map_err(|source| DaemonError::Io {
        path: dir.clone(),
        source,
    })?;
    let path = dir.join("arbiter.lock");
    let file = File::create(&path).map_err(|source| DaemonError::Io {
        path: path.clone(),
        source,
    })?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock)
        .map_err(|_| DaemonError::AlreadyRunning(path))
}

/// Loads the lease table, re-creates every lease socket and reconciles once.
/// Must run inside the tokio runtime (lease sockets are served on it).
pub fn recover(
    config: &ArbiterConfig,
    scheduler: &SchedulerConfig,
    backend: &dyn GpuBackend,
) -> Result<SharedArbiter, DaemonError> {
    let survey = inventory::survey(
        backend,
        &config.shared_gpus,
        &inventory::HostMps::from_env(),
    )?;
    for gpu in &survey.shareable {
        tracing::info!(index = gpu.index, uuid = %gpu.uuid, name = %gpu.name, memory = gpu.memory_total, source = backend.source(), "sharing GPU");
    }
    for set_aside in &survey.unshareable {
        tracing::warn!(uuid = %set_aside.gpu.uuid, "{}", set_aside.describe());
    }
    let (store, table) = LeaseStore::open(&config.state_dir, StoreOptions::default())?;
    let tokens = TokenService::new(scheduler.clone());
    let endpoints = SocketEndpoints::new(
        config.run_dir.clone(),
        tokio::runtime::Handle::current(),
        tokens.clone(),
    );
    let slot = endpoints.arbiter_slot();
    let arbiter = Arbiter::open(
        config.clone(),
        Inventory {
            gpus: survey.shareable,
            source: backend.source(),
            cuda_driver_version: backend.cuda_driver_version(),
        },
        Arc::new(store),
        table,
        Box::new(endpoints),
        Box::new(ProcFs),
    )?;
    let mut arbiter = arbiter;
    arbiter.set_tokens(tokens);
    arbiter.set_unshareable(survey.unshareable);
    let shared = Arc::new(Mutex::new(arbiter));
    let _ = slot.set(Arc::downgrade(&shared));
    // Start the grace period of leases whose containers died while we were down.
    server::lock(&shared).reconcile(std::time::Instant::now());
    Ok(shared)
}

/// How often a lease store that cannot be written is tried again while no
/// change comes to try it (each change tries too): a second keeps a freed disk
/// from leaving the arbiter refusing for long, at the cost of one failed
/// snapshot write per second while it stays full.
pub const STORE_RETRY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Retries a failed lease store (`Arbiter::recover_store`) until it can be
/// written again. Must run inside the tokio runtime.
pub fn spawn_store_recovery(arbiter: SharedArbiter) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(STORE_RETRY_INTERVAL);
        loop {
            tick.tick().await;
            let mut a = server::lock(&arbiter);
            if a.store().failure().is_some() {
                if let Err(e) = a.recover_store() {
                    tracing::debug!(error = %e, "the lease store still cannot be written");
                }
            }
        }
    });
}

/// Lease sockets plus client connections: one descriptor each. The default soft
/// limit (1024) would cap a node at a few hundred leases.
pub fn raise_open_files_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(error = %e, soft, hard, "could not raise the open-files limit");
            }
        }
    }
}
