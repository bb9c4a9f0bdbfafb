//! gpushare-kube: the Kubernetes device plugin (one per node, beside the arbiter).

use std::process::ExitCode;

use clap::Parser;
use gpushare_config::Config;
use gpushare_kube::cli::KubeArgs;
use gpushare_kube::node::{self, Settings};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUSHARE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = KubeArgs::parse();
    let loaded = match args.config {
        Some(path) => Config::load(&path).map(|c| (c, Some(path))),
        None => Config::load_default(),
    };
    let config = match loaded {
        Ok((config, source)) => {
            match source {
                Some(path) => tracing::info!(config = %path.display(), "configuration loaded"),
                None => tracing::info!("no configuration file; using defaults"),
            }
            config
        }
        Err(e) => {
            eprintln!("gpushare-kube: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("gpushare-kube: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let settings = Settings::from_config(&config);
    tracing::info!(
        dir = %settings.plugin_dir.display(),
        arbiter = %settings.arbiter.socket.display(),
        memory_unit = settings.memory_unit,
        "gpushare-kube starting"
    );
    runtime.block_on(node::run(settings, async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(e) => {
                    tracing::error!(error = %e, "cannot watch SIGTERM");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("stopping");
    }));
    ExitCode::SUCCESS
}
