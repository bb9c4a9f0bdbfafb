//! Putting the daemon together: inventory, store, sockets, background work,
//! and taking it apart again on a clean stop. Shared by the binary and the
//! recovery benchmark.

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_config::{ArbiterConfig, PlacementConfig, SchedulerConfig};
use nix::fcntl::{Flock, FlockArg};

use crate::inventory::{self, GpuBackend};
use crate::process::ProcFs;
use crate::server::{self, SocketEndpoints};
use crate::shutdown::Tasks;
use crate::state::{Arbiter, ArbiterHandle, Inventory, StateError};
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

pub use crate::background::STORE_RETRY_INTERVAL;

/// A recovered arbiter: the handle on its state and its tasks (the lease
/// sockets at once; the background work and the control socket once the caller
/// starts them on [`Running::tasks`]). Dropping it stops the tasks.
pub struct Running {
    arbiter: ArbiterHandle,
    tasks: Tasks,
}

impl Running {
    pub fn handle(&self) -> &ArbiterHandle {
        &self.arbiter
    }

    pub fn tasks(&self) -> &Tasks {
        &self.tasks
    }

    /// A clean stop: ends every task (a task stuck past `within` is abandoned),
    /// then makes every change durable and folds the log into the snapshot.
    /// Lease directories and sockets stay: containers hold them mounted, and the
    /// next start serves them again exactly as after a kill.
    pub async fn stop(self, within: Duration) -> Result<(), StateError> {
        let stuck = self.tasks.stop(within).await;
        if stuck > 0 {
            tracing::warn!(stuck, "tasks still running at the stop were abandoned");
        }
        self.arbiter.flush().await
    }
}

/// Loads the lease table, re-creates every lease socket (served at once) and
/// reconciles once; new leases are placed by `placement` (the `[placement]`
/// table). Must run inside the tokio runtime.
pub fn recover(
    config: &ArbiterConfig,
    scheduler: &SchedulerConfig,
    placement: &PlacementConfig,
    backend: &dyn GpuBackend,
) -> Result<Running, DaemonError> {
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
    let (endpoints, endpoint_events) = SocketEndpoints::new(
        config.run_dir.clone(),
        tokio::runtime::Handle::current(),
        tokens.clone(),
    );
    let mut arbiter = Arbiter::open(
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
    arbiter.set_tokens(tokens.clone());
    arbiter.set_placement(placement.clone());
    arbiter.set_unshareable(survey.unshareable);
    let arbiter = ArbiterHandle::new(arbiter);
    let tasks = Tasks::default();
    tasks.spawn(server::serve_lease_sockets(
        endpoint_events,
        arbiter.clone(),
        tokens,
    ));
    // Start the grace period of leases whose containers died while we were down.
    arbiter.reconcile(Instant::now());
    Ok(Running { arbiter, tasks })
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
