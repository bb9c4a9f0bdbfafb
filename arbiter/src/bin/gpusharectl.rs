//! gpusharectl: look at and act on the node's gpushare arbiter.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use gpushare_config::Config;
use gpushare_proto::{ByteSize, ControlClient, LeaseId, StatusReport};

#[derive(Parser)]
#[command(version, about = "Inspect and manage the gpushare arbiter")]
struct Args {
    /// Configuration file (default: $GPUSHARE_CONFIG, then /etc/gpushare/config.toml).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Control socket (default: from the configuration).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// GPUs and the leases on them.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Release a lease by id (idempotent).
    Release { lease: String },
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpusharectl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::load_default()?.0,
    };
    let socket = args
        .socket
        .unwrap_or_else(|| config.arbiter.control_socket());
    let mut client = ControlClient::connect(&socket, config.arbiter.client_timeout())?;
    match args.command {
        Command::Status { json } => {
            let report = client.status()?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).context("encoding status")?
                );
            } else {
                print!("{}", render_status(&report));
            }
        }
        Command::Release { lease } => {
            let existed = client.release(LeaseId(lease.clone()))?;
            println!(
                "{}",
                if existed {
                    format!("released {lease}")
                } else {
                    format!("no lease {lease}")
                }
            );
        }
    }
    Ok(())
}

fn render_status(report: &StatusReport) -> String {
    let mut out = String::from("GPUS\n");
    for g in &report.gpus {
        out += &format!(
            "  {} {} {}  memory leased {} of {}\n",
            g.index,
            g.uuid,
            g.name,
            ByteSize(g.memory_leased),
            ByteSize(g.memory_total)
        );
    }
    out += &format!("LEASES ({})\n", report.leases.len());
    for l in &report.leases {
        out += &format!(
            "  {} container={} gpus={} priority={} memory={} state={:?} pid={}\n",
            l.id,
            l.container_id,
            l.gpus.join(","),
            l.priority,
            ByteSize(l.memory_bytes),
            l.state,
            l.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
        );
    }
    out
}
