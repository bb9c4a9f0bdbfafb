//! gpushare-arbiter: the node daemon.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use gpushare_arbiter::cli::{ArbiterArgs, ArbiterCommand};
use gpushare_arbiter::{background, capabilities, control, daemon, inventory, metrics};

fn main() -> ExitCode {
    let args = ArbiterArgs::parse();
    if let Some(ArbiterCommand::CheckConfig(check)) = &args.command {
        return check.run(args.config.as_deref());
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUSHARE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-arbiter: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: ArbiterArgs) -> anyhow::Result<()> {
    let source = daemon::ConfigSource::new(args.config);
    let (config, path) = source.load()?;
    match &path {
        Some(path) => tracing::info!(config = %path.display(), "configuration loaded"),
        None => tracing::info!("no configuration file; using defaults"),
    }
    // Before any socket or file is touched: a capability the unit withholds is named
    // now, not found later as a signal or a /proc read that fails.
    capabilities::check_at_start(&config.arbiter, &config.scheduler)?;
    // What SIGHUP's reload compares the file with.
    let in_effect = config.clone();
    let scheduler = config.scheduler;
    let placement = config.placement;
    let memory = config.memory;
    let config = config.arbiter;
    let _lock = daemon::lock_state_dir(&config)?;
    daemon::raise_open_files_limit();
    let backend: Arc<dyn inventory::GpuBackend> = Arc::from(inventory::open_backend(&config));
    let shared_gpus = inventory::narrow_to_shared(backend.gpus(), &config.shared_gpus)?;
    if shared_gpus.is_empty() {
        tracing::warn!("no GPUs to share: no NVML GPUs and no [[arbiter.devices]] declared");
    }
    // Which of them can be shared is logged by the recovery (inventory::survey).
    let socket = config.control_socket();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let served = runtime.block_on(async move {
        // Before anything else: a stop asked for during recovery is a clean stop
        // once recovery is done, not the default action (death mid-write).
        let stop_asked = stop_signal().context("installing the SIGTERM and SIGINT handlers")?;
        // SIGHUP's default action ends the process: a reload asked for during
        // recovery waits for it.
        let hangups = daemon::hangup_signal().context("installing the SIGHUP handler")?;
        // Bind first: it refuses to start beside a live arbiter before any lease
        // socket is touched. Connections wait in the backlog until recovery is done.
        let listener = control::bind_control_socket(&socket)?;
        let started = std::time::Instant::now();
        let running = daemon::recover(&config, &scheduler, &placement, &memory, backend.as_ref())
            .context("recovering the lease table")?;
        let arbiter = running.handle().clone();
        tracing::info!(
            leases = arbiter.lease_count(),
            recovery_ms = started.elapsed().as_millis() as u64,
            "lease table recovered"
        );
        let tasks = running.tasks();
        background::spawn_background(&arbiter, backend.clone(), tasks);
        if let Some(address) = &config.metrics_address {
            let tcp = tokio::net::TcpListener::bind(address)
                .await
                .with_context(|| format!("binding the metrics endpoint {address}"))?;
            tracing::info!(address, "serving metrics at /metrics");
            let arbiter = arbiter.clone();
            let cap = config.metrics_max_connections;
            tasks.spawn(metrics::serve(tcp, move || arbiter.metrics(), cap));
        }
        tasks.spawn(daemon::reload_on_hangup(
            hangups,
            source,
            in_effect,
            arbiter.clone(),
        ));
        tasks.spawn(control::serve(listener, arbiter));
        tracing::info!(socket = %socket.display(), "serving");
        daemon::notify_ready();
        stop_asked.await;
        daemon::notify_stopping();
        tracing::info!("stopping; leases stay on disk");
        // Leave no stale socket behind for the next start to trip over.
        let _ = std::fs::remove_file(&socket);
        running
            .stop(STOP_WITHIN)
            .await
            .context("making the lease table durable at the stop")
    });
    // What is left (a blocking NVML call, a metrics answer) is not waited for.
    runtime.shutdown_timeout(STOP_WITHIN);
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// How long a stop waits for tasks, and then for the runtime's threads: a task
/// ends at its next await, within milliseconds, unless a call it made is stuck.
const STOP_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// Resolves at the first SIGTERM or SIGINT; the handlers are in place once this
/// returns, so neither signal kills the process from then on.
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
