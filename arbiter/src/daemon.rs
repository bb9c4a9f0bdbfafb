//! Putting the daemon together: inventory, store, sockets, background work,
//! reloading its configuration on SIGHUP, and taking it apart again on a clean
//! stop. Shared by the binary and the recovery benchmark.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_config::{
    keys, ArbiterConfig, Config, ConfigError, MemoryConfig, PlacementConfig, SchedulerConfig,
};
use nix::fcntl::{Flock, FlockArg};

use crate::checkpoint::CudaCheckpoint;
use crate::inventory::{self, GpuBackend};
use crate::process::ProcFs;
use crate::reclaimer::{Fault, Reclaimer};
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
    #[error("memory.reclaim = true: {0}")]
    Reclaim(String),
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
    // Whoever can open it can flock it, and so keep the arbiter from starting.
    crate::store::owner_only(&path)?;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(crate::store::OWNER_ONLY)
        .open(&path)
        .map_err(|source| DaemonError::Io {
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
    memory: &MemoryConfig,
    backend: &dyn GpuBackend,
) -> Result<Running, DaemonError> {
    let survey = inventory::survey(
        backend,
        &config.shared_gpus,
        &inventory::HostMps::from_env(),
    )?;
    for gpu in &survey.shareable {
        tracing::info!(index = gpu.index, uuid = %gpu.uuid, name = %gpu.name, memory = gpu.memory_total, allocatable = gpu.memory_allocatable, source = backend.source(), "sharing GPU");
    }
    for set_aside in &survey.unshareable {
        tracing::warn!(uuid = %set_aside.gpu.uuid, "{}", set_aside.describe());
    }
    let no_gpus_reason = inventory::no_gpus_reason(
        &survey,
        backend.source(),
        backend.fallback_reason(),
        config.devices.len(),
    );
    if let Some(why) = &no_gpus_reason {
        tracing::warn!("no GPU to share: {why}");
    }
    let (store, table) = LeaseStore::open(&config.state_dir, StoreOptions::default())?;
    let tokens = TokenService::with_budget(
        scheduler.clone(),
        crate::connections::ConnectionBudget::for_this_process_with_floor(
            config.lease_connection_floor,
        ),
    );
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
    arbiter.set_no_gpus_reason(no_gpus_reason);
    arbiter.set_memory_config(memory.clone());
    let arbiter = ArbiterHandle::new(arbiter);
    let tasks = Tasks::default();
    if memory.reclaim {
        // Before any client is served: processes a killed arbiter left locked or
        // checkpointed are found first.
        let reclaimer = start_reclaim(memory, &config.state_dir, &arbiter)?;
        tasks.spawn(reclaimer.restore_loop(arbiter.clone()));
    }
    tasks.spawn(server::serve_lease_sockets(
        endpoint_events,
        arbiter.clone(),
        tokens,
    ));
    // Start the grace period of leases whose containers died while we were down.
    arbiter.reconcile(Instant::now());
    let naming = arbiter.clone();
    tasks.spawn(async move { naming.relearn_engine_names().await });
    Ok(Running { arbiter, tasks })
}

/// Loads the driver's checkpoint API and finishes what the journal says a killed
/// arbiter left half done.
fn start_reclaim(
    memory: &MemoryConfig,
    state_dir: &std::path::Path,
    arbiter: &ArbiterHandle,
) -> Result<Arc<Reclaimer>, DaemonError> {
    let driver = CudaCheckpoint::load(&memory.cuda_library).map_err(DaemonError::Reclaim)?;
    let reclaimer = Reclaimer::new(Arc::new(driver), state_dir, Fault::from_env());
    reclaimer.recover(arbiter).map_err(DaemonError::Reclaim)?;
    arbiter.set_reclaimer(reclaimer.clone());
    tracing::info!(
        low_overcommit = memory.low_overcommit,
        floor_ms = memory.reclaim_floor_ms,
        checkpoint_gbps = memory.checkpoint_gbps,
        "memory reclaim on: low-priority leases lend their memory to high-priority ones"
    );
    Ok(reclaimer)
}

/// Tells systemd (`Type=notify`) that the daemon is ready: called once the control socket
/// is bound and served and the lease table recovered, so `Before=containerd.service`
/// orders the engines after a socket that answers, not after a fork. Nothing without
/// `NOTIFY_SOCKET` (not started by systemd); a failure to notify is logged, not fatal
/// (systemd then times the start out and says so).
pub fn notify_ready() {
    if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
        tracing::warn!(error = %e, "could not tell systemd the arbiter is ready (NOTIFY_SOCKET)");
    }
}

/// Tells systemd the daemon is stopping (no more requests are served).
pub fn notify_stopping() {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
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

/// Where the daemon's configuration comes from: read at the start and again at
/// each SIGHUP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigSource {
    /// `--config FILE`.
    Named(PathBuf),
    /// `$GPUSHARE_CONFIG`, else /etc/gpushare/config.toml if present.
    Default,
}

impl ConfigSource {
    pub fn new(named: Option<PathBuf>) -> ConfigSource {
        named.map_or(ConfigSource::Default, ConfigSource::Named)
    }

    /// The configuration, and the file it came from (none: all defaults).
    pub fn load(&self) -> Result<(Config, Option<PathBuf>), ConfigError> {
        match self {
            ConfigSource::Named(path) => Ok((Config::load(path)?, Some(path.clone()))),
            ConfigSource::Default => Config::load_default(),
        }
    }
}

/// How a change to a key of the file takes effect when the arbiter reloads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The arbiter applies it now.
    Applied,
    /// Not the arbiter's: the runtimes (or gpusharectl) read it from the file at
    /// each use, so it is in effect from their next use.
    ReadAtEachUse,
    /// Only a restart of this daemon applies it; the running value is kept.
    NeedsRestart(&'static str),
}

/// Each key of the configuration, and how a change to it takes effect.
///
/// Applied live: what the arbiter reads from its configuration at each decision
/// (placement and its limits, the default quota, the admission wait, tenant
/// reservations, reconciliation's grace and timeout), so a new value changes the
/// next decision and leaves every lease as it is. A restart is needed for what is
/// bound when the daemon starts: sockets and directories (run_dir, state_dir,
/// control_socket, metrics_address), the inventory (devices, shared_gpus,
/// nvml_library), the watchdog's timer and policy, the overhead estimate already
/// charged to running processes, and the scheduler (each GPU's time-slice policy
/// and the terms its connected clients were given).
pub fn effect(key: &str) -> Effect {
    const APPLIED: [&str; 7] = [
        "arbiter.default_memory",
        "arbiter.gpu_util_limit",
        "arbiter.low_nums_limit",
        "arbiter.admission_wait_ms",
        "arbiter.reservations",
        "arbiter.reconcile_grace_ms",
        "arbiter.reserved_timeout_ms",
    ];
    let section = key.split('.').next().unwrap_or_default();
    match section {
        _ if APPLIED.contains(&key) => Effect::Applied,
        "placement" => Effect::Applied,
        "requests" | "runtime" => Effect::ReadAtEachUse,
        _ if key == "arbiter.client_timeout_ms" => Effect::ReadAtEachUse,
        "kubernetes" => Effect::NeedsRestart("gpushare-kube"),
        _ => Effect::NeedsRestart("gpushare-arbiter"),
    }
}

/// What a reload from `running` to the file's `loaded` changes.
#[derive(Debug, Clone, PartialEq)]
pub struct ReloadPlan {
    /// Each changed key, in key order, and how it takes effect.
    pub changes: Vec<(String, Effect)>,
    /// The configuration in effect afterwards: the file's, with the running value
    /// of every key that needs a restart. The next reload compares against it, so
    /// such a key is reported again until the daemon restarts.
    pub effective: Config,
}

pub fn plan_reload(running: &Config, loaded: &Config) -> ReloadPlan {
    let changes: Vec<(String, Effect)> = keys::changed(running, loaded)
        .into_iter()
        .map(|key| {
            let effect = effect(&key);
            (key, effect)
        })
        .collect();
    let takes_effect = |key: &str| !matches!(effect(key), Effect::NeedsRestart(_));
    let effective = keys::merged(running, loaded, takes_effect).unwrap_or_else(|| running.clone());
    ReloadPlan { changes, effective }
}

/// Installs the SIGHUP handler, whose default action would end the daemon: from
/// here on a hangup is queued for [`reload_on_hangup`].
pub fn hangup_signal() -> std::io::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
}

/// Reads the configuration again at each SIGHUP, applies what can change live and
/// logs, per changed key, whether it was applied or needs a restart. A file that
/// cannot be used changes nothing: the error is logged, the running configuration kept.
pub async fn reload_on_hangup(
    mut hangups: tokio::signal::unix::Signal,
    source: ConfigSource,
    mut running: Config,
    arbiter: ArbiterHandle,
) {
    while hangups.recv().await.is_some() {
        running = reload(&source, running, &arbiter);
    }
}

fn reload(source: &ConfigSource, running: Config, arbiter: &ArbiterHandle) -> Config {
    let (loaded, path) = match source.load() {
        Ok(loaded) => loaded,
        Err(error) => {
            tracing::error!(
                "configuration reload refused, the running configuration is kept: {error}"
            );
            return running;
        }
    };
    let file = path.map_or_else(|| "the defaults".to_owned(), |p| p.display().to_string());
    let plan = plan_reload(&running, &loaded);
    if plan.changes.is_empty() {
        tracing::info!("configuration reloaded from {file}: nothing changed");
        return running;
    }
    let placement =
        (plan.effective.placement != running.placement).then(|| plan.effective.placement.clone());
    arbiter.reconfigure(plan.effective.arbiter.clone(), placement);
    for (key, effect) in &plan.changes {
        match effect {
            Effect::Applied => tracing::info!("configuration reload: {key} applied"),
            Effect::ReadAtEachUse => tracing::info!(
                "configuration reload: {key} applied (the runtimes and gpusharectl read it at each use)"
            ),
            Effect::NeedsRestart(daemon) => tracing::warn!(
                "configuration reload: {key} needs a restart of {daemon}; the running value is kept"
            ),
        }
    }
    tracing::info!(
        changed = plan.changes.len(),
        "configuration reloaded from {file}"
    );
    plan.effective
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_config::{DeclaredDevice, PlacementPolicy, SchedulingPolicy};
    use gpushare_types::ByteSize;

    /// A host user who can open the lock file can flock it too, and so keep the
    /// arbiter from starting: it is root's alone, an older readable one closed.
    #[test]
    fn the_state_lock_is_openable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let dir = tempfile::tempdir().unwrap();
        let config = crate::state::tests::config(dir.path());
        let path = config.state_dir.join("arbiter.lock");
        drop(lock_state_dir(&config).unwrap());
        assert_eq!(mode(&path), 0o600, "as created");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(lock_state_dir(&config).unwrap());
        assert_eq!(mode(&path), 0o600, "an older one after a start");
    }

    /// Every key of the configuration (a file setting each one), with the effect
    /// decided for it: a key added to the configuration fails here until decided.
    #[test]
    fn every_key_has_its_effect() {
        use Effect::*;
        let restart = NeedsRestart("gpushare-arbiter");
        let mut every = Config::default();
        every.arbiter.control_socket = Some("/run/x.sock".into());
        every.arbiter.metrics_address = Some("127.0.0.1:9400".into());
        every.requests.high_priority_tenants = Some(vec![]);
        every.requests.env_memory_ceiling = Some(gpushare_types::MemoryRequest::Bytes(1 << 30));
        every
            .runtime
            .profiles
            .insert("high".into(), Default::default());
        let expected: Vec<(&str, Effect)> = vec![
            ("arbiter.admission_wait_ms", Applied),
            ("arbiter.client_timeout_ms", ReadAtEachUse),
            ("arbiter.context_memory_estimate", restart),
            ("arbiter.control_socket", restart),
            ("arbiter.default_memory", Applied),
            ("arbiter.devices", restart),
            ("arbiter.driver_reserved_fraction", restart),
            ("arbiter.gpu_util_limit", Applied),
            ("arbiter.lease_connection_floor", restart),
            ("arbiter.low_nums_limit", Applied),
            ("arbiter.metrics_address", restart),
            ("arbiter.metrics_max_connections", restart),
            ("arbiter.nvml_library", restart),
            ("arbiter.reconcile_grace_ms", Applied),
            ("arbiter.reservations", Applied),
            ("arbiter.reserved_timeout_ms", Applied),
            ("arbiter.run_dir", restart),
            ("arbiter.shared_gpus", restart),
            ("arbiter.state_dir", restart),
            ("arbiter.watchdog_interval_ms", restart),
            ("arbiter.watchdog_kill", restart),
            ("kubernetes.collect_grace_ms", NeedsRestart("gpushare-kube")),
            (
                "kubernetes.collect_interval_ms",
                NeedsRestart("gpushare-kube"),
            ),
            (
                "kubernetes.device_plugin_dir",
                NeedsRestart("gpushare-kube"),
            ),
            ("kubernetes.memory_unit", NeedsRestart("gpushare-kube")),
            (
                "kubernetes.pod_resources_socket",
                NeedsRestart("gpushare-kube"),
            ),
            ("kubernetes.poll_interval_ms", NeedsRestart("gpushare-kube")),
            ("kubernetes.require_grant", NeedsRestart("gpushare-kube")),
            ("memory.checkpoint_gbps", restart),
            ("memory.cuda_library", restart),
            ("memory.low_overcommit", restart),
            ("memory.reclaim", restart),
            ("memory.reclaim_floor_ms", restart),
            ("memory.restore_delay_ms", restart),
            ("placement.batch", Applied),
            ("placement.batch_budget_us", Applied),
            ("placement.compute_weight", Applied),
            ("placement.jobs_weight", Applied),
            ("placement.memory_weight", Applied),
            ("placement.policy", Applied),
            ("placement.utilization_window_ms", Applied),
            ("requests.accept_env", ReadAtEachUse),
            ("requests.allowed_env", ReadAtEachUse),
            ("requests.env_compute_request_ceiling", ReadAtEachUse),
            ("requests.env_memory_ceiling", ReadAtEachUse),
            ("requests.high_priority_tenants", ReadAtEachUse),
            ("requests.tenant_from", ReadAtEachUse),
            ("requests.trust_environment", ReadAtEachUse),
            ("requests.unrequested", ReadAtEachUse),
            ("runtime.container_library", ReadAtEachUse),
            ("runtime.hook", ReadAtEachUse),
            ("runtime.hook_timeout_seconds", ReadAtEachUse),
            ("runtime.ld_so_preload", ReadAtEachUse),
            ("runtime.library", ReadAtEachUse),
            ("runtime.profiles", ReadAtEachUse),
            ("runtime.runtimes", ReadAtEachUse),
            ("scheduler.admit_by_duration", restart),
            ("scheduler.bypass_check", restart),
            ("scheduler.high_active_ms", restart),
            ("scheduler.high_on_arbiter_loss", restart),
            ("scheduler.high_return_risk_percent", restart),
            ("scheduler.idle_us", restart),
            ("scheduler.launch_ahead", restart),
            ("scheduler.launch_ahead_with_high", restart),
            ("scheduler.low_on_arbiter_loss", restart),
            ("scheduler.max_slice_ms", restart),
            ("scheduler.min_slice_ms", restart),
            ("scheduler.overrun_penalty_ms", restart),
            ("scheduler.pause_bypassing", restart),
            ("scheduler.policy", restart),
            ("scheduler.revoke_grace_ms", restart),
            ("scheduler.slice_ms", restart),
            ("scheduler.window_ms", restart),
            ("scheduler.window_overrun_grace_ms", restart),
        ];
        let keys: Vec<String> = keys::settings(&every).into_keys().collect();
        let listed: Vec<&str> = expected.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, listed, "the configuration's keys");
        for (key, wanted) in expected {
            assert_eq!(effect(key), wanted, "{key}");
        }
    }

    #[test]
    fn a_reload_applies_live_keys_and_keeps_the_running_value_of_the_rest() {
        let running = Config::default();
        let mut loaded = running.clone();
        loaded.arbiter.default_memory = "2Gi".parse().unwrap();
        loaded.arbiter.low_nums_limit = 2;
        loaded.arbiter.run_dir = "/elsewhere".into();
        loaded.arbiter.devices = vec![DeclaredDevice {
            uuid: "GPU-1".into(),
            name: "x".into(),
            memory: ByteSize(1 << 30),
        }];
        loaded.placement.policy = PlacementPolicy::Wang;
        loaded.scheduler.policy = SchedulingPolicy::RoundRobin;
        loaded.requests.allowed_env = vec!["GPUSHARE_X".into()];
        loaded.kubernetes.require_grant = true;
        let plan = plan_reload(&running, &loaded);
        assert_eq!(
            plan.changes,
            [
                ("arbiter.default_memory".to_string(), Effect::Applied),
                (
                    "arbiter.devices".into(),
                    Effect::NeedsRestart("gpushare-arbiter")
                ),
                ("arbiter.low_nums_limit".into(), Effect::Applied),
                (
                    "arbiter.run_dir".into(),
                    Effect::NeedsRestart("gpushare-arbiter")
                ),
                (
                    "kubernetes.require_grant".into(),
                    Effect::NeedsRestart("gpushare-kube")
                ),
                ("placement.policy".into(), Effect::Applied),
                ("requests.allowed_env".into(), Effect::ReadAtEachUse),
                (
                    "scheduler.policy".into(),
                    Effect::NeedsRestart("gpushare-arbiter")
                ),
            ]
        );
        let e = &plan.effective;
        assert_eq!(e.arbiter.default_memory, loaded.arbiter.default_memory);
        assert_eq!(e.arbiter.low_nums_limit, 2);
        assert_eq!(e.placement.policy, PlacementPolicy::Wang);
        assert_eq!(e.requests.allowed_env, loaded.requests.allowed_env);
        // Kept as running until a restart, and so reported again at the next reload.
        assert_eq!(e.arbiter.run_dir, running.arbiter.run_dir);
        assert!(e.arbiter.devices.is_empty());
        assert_eq!(e.scheduler.policy, SchedulingPolicy::Priority);
        assert!(!e.kubernetes.require_grant);
        let again = plan_reload(e, &loaded);
        let still: Vec<&str> = again.changes.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            still,
            [
                "arbiter.devices",
                "arbiter.run_dir",
                "kubernetes.require_grant",
                "scheduler.policy"
            ]
        );
        assert!(plan_reload(&running, &running).changes.is_empty());
    }
}
