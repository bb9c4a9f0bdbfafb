//! The daemon's periodic work: utilisation sampling, the admission queue's
//! bound, measuring new clients' memory, retrying a lease store that cannot be
//! written, and the watchdog. Each loop is a task of the daemon's [`Tasks`], so
//! a stop ends them all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bypass;
use crate::inventory::GpuBackend;
use crate::shutdown::Tasks;
use crate::state::ArbiterHandle;
use crate::watchdog;
use gpushare_config::SchedulingPolicy;

/// How often utilisation is sampled (Algorithm 1 looks at the last minute).
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// How often waiting requests are checked against their bound.
const QUEUE_TICK: Duration = Duration::from_millis(200);
/// How often processes still charged the estimate (attached before NVML listed
/// them: no context yet) are looked for. Only runs while there are such
/// processes, so an idle node pays nothing.
pub const NEW_CLIENT_MEASURE_INTERVAL: Duration = Duration::from_millis(200);
/// How often a lease store that cannot be written is tried again while no
/// change comes to try it (each change tries too): a second keeps a freed disk
/// from leaving the arbiter refusing for long, at the cost of one failed
/// snapshot write per second while it stays full.
pub const STORE_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// Starts every periodic task. Must run inside the tokio runtime.
pub fn spawn_background(arbiter: &ArbiterHandle, backend: Arc<dyn GpuBackend>, tasks: &Tasks) {
    let config = arbiter.config();
    let watchdog_interval = Duration::from_millis(config.watchdog_interval_ms);
    tasks.spawn(expire_waiters(arbiter.clone()));
    tasks.spawn(sample_utilization(arbiter.clone(), backend.clone()));
    tasks.spawn(retry_failed_store(arbiter.clone()));
    start_memory_measurement(arbiter, &backend, tasks);
    match arbiter.tokens() {
        Some(tokens) => {
            if tokens.policy() == SchedulingPolicy::Priority && tokens.config().bypass_check {
                tasks.spawn(bypass::run(
                    arbiter.clone(),
                    backend.clone(),
                    tokens.clone(),
                    tokens.config().pause_bypassing,
                    config.run_dir.clone(),
                ));
            }
            tasks.spawn(watchdog::run(
                arbiter.clone(),
                backend,
                watchdog_interval,
                config.watchdog_kill,
                tokens,
            ))
        }
        None => tracing::error!("no token service: the watchdog does not run"),
    }
}

async fn expire_waiters(arbiter: ArbiterHandle) {
    let mut tick = tokio::time::interval(QUEUE_TICK);
    loop {
        tick.tick().await;
        arbiter.expire_waiters(Instant::now());
    }
}

async fn sample_utilization(arbiter: ArbiterHandle, backend: Arc<dyn GpuBackend>) {
    let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
    loop {
        tick.tick().await;
        let backend = backend.clone();
        let samples = tokio::task::spawn_blocking(move || {
            backend
                .gpus()
                .into_iter()
                .filter_map(|g| match backend.sample(&g.uuid) {
                    Ok(Some(s)) => Some((g.uuid, s)),
                    Ok(None) => None,
                    Err(e) => {
                        tracing::warn!(error = %e, "sampling failed");
                        None
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        if !samples.is_empty() {
            arbiter.record_samples(Instant::now(), &samples);
        }
    }
}

/// Retries a failed lease store (`Arbiter::recover_store`) until it can be
/// written again.
async fn retry_failed_store(arbiter: ArbiterHandle) {
    let mut tick = tokio::time::interval(STORE_RETRY_INTERVAL);
    loop {
        tick.tick().await;
        if let Err(e) = arbiter.retry_failed_store() {
            tracing::debug!(error = %e, "the lease store still cannot be written");
        }
    }
}

/// Turns overhead accounting on when the backend can list processes, and keeps
/// new clients measured; says in the log which way it went.
fn start_memory_measurement(arbiter: &ArbiterHandle, backend: &Arc<dyn GpuBackend>, tasks: &Tasks) {
    let first = backend.gpus().into_iter().next();
    let lists = first.is_some_and(|g| matches!(backend.processes(&g.uuid), Ok(Some(_))));
    if !lists {
        tracing::warn!(source = backend.source(), "per-process GPU memory cannot be read here (no NVML): quotas cover explicit allocations only, not the processes' CUDA contexts");
        return;
    }
    let estimate = arbiter.enable_memory_measurement(backend.clone());
    tracing::info!(
        estimate,
        "per-process overhead (context, modules) is measured with NVML and charged to each lease"
    );
    let arbiter = arbiter.clone();
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(NEW_CLIENT_MEASURE_INTERVAL);
        loop {
            tick.tick().await;
            if arbiter.has_unmeasured_clients() {
                arbiter.measure_memory(None).await;
            }
        }
    });
}
