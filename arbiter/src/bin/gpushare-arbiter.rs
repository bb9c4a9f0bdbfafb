//! gpushare-arbiter: the node daemon.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::Parser;
use gpushare_arbiter::{inventory, server, state::Arbiter};
use gpushare_config::Config;

#[derive(Parser)]
#[command(
    version,
    about = "gpushare node daemon: places containers on GPUs and owns their leases"
)]
struct Args {
    /// Configuration file (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUSHARE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-arbiter: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let (config, source) = match args.config {
        Some(path) => (Config::load(&path)?, Some(path)),
        None => Config::load_default()?,
    };
    match &source {
        Some(path) => tracing::info!(config = %path.display(), "configuration loaded"),
        None => tracing::info!("no configuration file; using defaults"),
    }
    let gpus = inventory::from_declared(&config.arbiter)?;
    if gpus.is_empty() {
        tracing::warn!("no GPUs to share: declare [[arbiter.devices]] in the configuration");
    }
    for gpu in &gpus {
        tracing::info!(index = gpu.index, uuid = %gpu.uuid, name = %gpu.name, memory = gpu.memory_total, "sharing GPU");
    }
    let socket = config.arbiter.control_socket();
    let arbiter = Arbiter::open(config.arbiter.clone(), gpus).context("opening the lease table")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = server::bind_control_socket(&socket)?;
        tracing::info!(socket = %socket.display(), "serving");
        let shared = Arc::new(Mutex::new(arbiter));
        tokio::select! {
            () = server::serve(listener, shared) => {}
            _ = shutdown_signal() => tracing::info!("shutting down; leases stay on disk"),
        }
        // Leave no stale socket behind for the next start to trip over.
        let _ = std::fs::remove_file(&socket);
        anyhow::Ok(())
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
