//! gpusharectl: look at and act on the node's gpushare arbiter.

use std::io::Write as _;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use gpushare_config::Config;
use gpushare_ctl::cli::{CtlArgs, CtlCommand as Command};
use gpushare_ctl::setup::{self, Engine, Programs};
use gpushare_proto::{ControlClient, LeaseId};

fn main() -> ExitCode {
    let args = CtlArgs::parse();
    // Before any configuration is loaded: the file to check may be the broken one.
    if let Command::CheckConfig(check) = &args.command {
        return check.run(args.config.as_deref());
    }
    let result = run(args).and_then(|out| emit(&out));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // Not eprintln!: it panics when stderr is closed too.
            let _ = writeln!(std::io::stderr(), "gpusharectl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Writes the whole output at once. println! would panic when the reader has
/// gone (`gpusharectl list | head -1`: Rust ignores SIGPIPE, so the write fails
/// with EPIPE instead of killing us).
fn emit(out: &str) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// The reader of our output went away: it took what it wanted (`| head`), so
/// this is a quiet, successful exit, not an error.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Runs the command; returns what to print.
fn run(args: CtlArgs) -> anyhow::Result<String> {
    // Needs no arbiter, and --config names the engine's file, not gpushare's.
    if let Command::Setup {
        engine,
        undo,
        dry_run,
        bin_dir,
        profile,
        set_as_default,
    } = &args.command
    {
        if *set_as_default && !matches!(engine, Engine::Docker | Engine::Containerd) {
            anyhow::bail!(
                "--set-as-default is for docker and containerd; {engine}'s default runtime is \
                 left to its own configuration (podman: engine.runtime in containers.conf; \
                 CRI-O: crio.runtime.default_runtime)"
            );
        }
        let programs = setup_programs(bin_dir.as_deref(), *engine, profile, *undo)?
            .as_default(*set_as_default);
        return setup(*engine, args.config.as_deref(), programs, *undo, *dry_run);
    }
    let loaded = match &args.config {
        Some(path) => Config::load(path),
        None => Config::load_default().map(|(config, _)| config),
    };
    // A refused file must not also hide the node: the arbiter keeps running on the
    // last file it read, and status is what an operator fixing the file wants.
    let (config, socket_from_file) = match loaded {
        Ok(config) => {
            let socket = config.arbiter.control_socket();
            (config, socket)
        }
        Err(error) => {
            let socket = gpushare_config::ArbiterConfig::control_socket_despite(&error);
            let _ = writeln!(
                std::io::stderr(),
                "gpusharectl: warning: {error:#}\ngpusharectl: warning: going on with the defaults and control socket {} (gpusharectl check-config says what to fix)",
                socket.display()
            );
            (Config::default(), socket)
        }
    };
    let socket = args.socket.unwrap_or(socket_from_file);
    let mut client = ControlClient::connect(&socket, config.arbiter.client_timeout())?;
    Ok(match args.command {
        Command::Status { json: true, .. } => {
            serde_json::to_string_pretty(&client.status()?).context("encoding status")? + "\n"
        }
        Command::Status {
            json: false,
            verbose,
        } => gpushare_ctl::status::render(&client.status()?, verbose),
        Command::List { json: true } => {
            serde_json::to_string_pretty(&client.list()?).context("encoding leases")? + "\n"
        }
        // The status report, not the bare list: it has the names the arbiter knows the
        // containers by (their engines'), so list names them as status does.
        Command::List { json: false } => {
            let report = client.status()?;
            gpushare_ctl::list::render(&report.leases, &report.usage, &report.gpus)
        }
        Command::CheckConfig(_) => unreachable!("answered before any configuration is read"),
        Command::Release { lease } => {
            if client.release(LeaseId(lease.clone()))? {
                format!("released {lease}\n")
            } else {
                format!("no lease {lease}\n")
            }
        }
        Command::Drain { gpu } => format!("drained {}\n", client.drain(gpu, true)?),
        Command::Undrain { gpu } => format!("undrained {}\n", client.drain(gpu, false)?),
        Command::Setup { .. } => unreachable!("setup returns before connecting"),
        Command::Timeline { since, json, svg } => {
            let report = client.timeline(since.map(|s| s.saturating_mul(1000)))?;
            let mut out = if json {
                serde_json::to_string_pretty(&report).context("encoding the timeline")? + "\n"
            } else {
                gpushare_ctl::timeline::render_text(&report)
            };
            if let Some(path) = svg {
                let chart = gpushare_ctl::timeline::render_svg(&report)?;
                std::fs::write(&path, chart)
                    .with_context(|| format!("writing the timeline chart to {}", path.display()))?;
                if !json {
                    out += &format!("chart written to {}\n", path.display());
                }
            }
            out
        }
        Command::Top { once } => {
            // Not a terminal (a pipe, a file, a test): one frame, no control codes.
            if once || !std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                gpushare_ctl::top::render_frame(&client.status()?)
            } else {
                loop {
                    let frame = gpushare_ctl::top::render_frame(&client.status()?);
                    // Home the cursor and clear the screen, then the frame.
                    emit(&format!("\x1b[H\x1b[2J{frame}"))?;
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            }
        }
    })
}

/// `gpusharectl setup`: the edit is gpushare_ctl::setup's; this finds the programs
/// and says what happened (with --dry-run, the content it would write).
fn setup(
    engine: Engine,
    file: Option<&std::path::Path>,
    programs: Programs,
    undo: bool,
    dry_run: bool,
) -> anyhow::Result<String> {
    // An engine pointed at a missing program fails every gpushare container start later,
    // far from this command.
    if !undo && !programs.runc.is_file() {
        anyhow::bail!(
            "{} does not exist: name the directory of gpushare-runc with --bin-dir",
            programs.runc.display()
        );
    }
    let path = file.unwrap_or_else(|| engine.default_config());
    let outcome = setup::apply(engine, path, &programs, undo, dry_run)?;
    Ok(match (dry_run, &outcome.content) {
        (true, Some(content)) if outcome.action != setup::Action::Unchanged => {
            format!("{content}(dry run: {outcome})\n")
        }
        (true, _) => format!("(dry run) {outcome}\n"),
        (false, _) => format!("{outcome}\n"),
    })
}

/// The programs `setup` points the engine at, and the docker runtime entries of the
/// runtime profiles named with --profile, each of which gpushare's configuration
/// must define (an entry naming an undefined profile would fail every container
/// started through it).
fn setup_programs(
    bin_dir: Option<&std::path::Path>,
    engine: Engine,
    profiles: &[String],
    undo: bool,
) -> anyhow::Result<Programs> {
    if !profiles.is_empty() && engine != Engine::Docker {
        anyhow::bail!(
            "--profile is for docker, whose runtime entries are the only way its users can \
             be granted more than their environment may ask; {engine}'s users set \
             gpushare.io/* annotations, which the container's creator sets and its image cannot"
        );
    }
    if !profiles.is_empty() && !undo {
        let (config, path) = Config::load_default()?;
        let file = path.map_or_else(
            || format!("{} (absent)", gpushare_config::DEFAULT_PATH),
            |p| p.display().to_string(),
        );
        for profile in profiles {
            if !config.runtime.profiles.contains_key(profile) {
                let defined: Vec<&str> =
                    config.runtime.profiles.keys().map(String::as_str).collect();
                anyhow::bail!(
                    "--profile {profile:?}: gpushare's configuration {file} defines no \
                     [runtime.profiles.{profile}] (defined: {}); define it there first",
                    if defined.is_empty() {
                        "none".to_owned()
                    } else {
                        defined.join(", ")
                    }
                );
            }
        }
    }
    let bin_dir = match bin_dir {
        Some(dir) => dir.to_owned(),
        None => std::env::current_exe()
            .context("finding gpusharectl's own directory (name one with --bin-dir)")?
            .parent()
            .context("gpusharectl's path has no directory (name one with --bin-dir)")?
            .to_owned(),
    };
    Ok(Programs::in_dir(&bin_dir).with_docker_profiles(profiles.to_vec()))
}
