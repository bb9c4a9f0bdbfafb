//! gpushare-runc: a runc-compatible wrapper for engines that take a runtime binary
//! (docker's path runtimes, CRI-O, podman `--runtime`, containerd `BinaryName`).
//!
//! On `create` (and `run`) it reads the request from the bundle's config.json,
//! reserves a lease, edits the spec, and runs the next runtime with the very same
//! arguments. Every other subcommand is handed over untouched with `exec`.
//! `--version` and `--help` print gpushare's line, then hand over for the
//! runtime's own answer. A create is watched by a forked guard (`guard`), which
//! undoes it if the wrapper is killed before it finishes and no container came of it.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{anyhow, bail, Context};
use gpushare_config::{Config, ConfigError, RuntimeConfig};
use gpushare_oci::admission::{self, Admitted, ControlSocket, Identity};
use gpushare_oci::broken_config::{self, Decision};
use gpushare_oci::bundle::BundleSpec;
use gpushare_oci::cli::{self, WrapperQuery};
use gpushare_oci::mutate;
use gpushare_oci::runc_args::{self, Invocation};
use gpushare_oci::spec::{Process, Spec};

#[path = "gpushare-runc/guard.rs"]
mod guard;

fn main() -> ExitCode {
    let given: Vec<OsString> = std::env::args_os().skip(1).collect();
    let invocation = runc_args::scan(&given);
    // What the next runtime sees: the command line without gpushare's own flag.
    let args = runc_args::strip_gpushare_flags(&given);
    match run(&args, &invocation) {
        Ok(code) => code,
        Err(error) => {
            report_error(&invocation, &gpushare_oci::describe(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[OsString], inv: &Invocation) -> anyhow::Result<ExitCode> {
    let query = cli::wrapper_query(args);
    // Our own line first: it must be out before the runtime replaces this process.
    match query {
        Some(WrapperQuery::Version) => say(&format!("{}\n", cli::runc_wrapper_version_line()))?,
        Some(WrapperQuery::Help) => say(&format!("{}\n", cli::runc_wrapper_help()))?,
        None => {}
    }
    // The file is read at each use: a fix takes effect at the next container. A
    // refused file fails only the containers that ask for gpushare (`create`); every
    // other command still reaches the runtime, the file's own if it still reads.
    let config = load_config(inv);
    let runtimes = match &config {
        Ok(config) => config.runtime.runtimes.clone(),
        Err(error) => RuntimeConfig::runtimes_despite(error),
    };
    let runtime = match next_runtime(&runtimes) {
        Ok(runtime) => runtime,
        Err(e) if query == Some(WrapperQuery::Help) => {
            // The wrapper's part is told; the runtime's help is runc(8)'s to give.
            say(&format!(
                "The runtime's own help is not shown ({}): see runc --help.\n",
                gpushare_oci::describe(e.as_ref())
            ))?;
            return Ok(ExitCode::SUCCESS);
        }
        Err(e) => return Err(e),
    };
    if query.is_some() {
        return Err(hand_over(&runtime, args));
    }
    match (inv.subcommand.as_deref(), config) {
        (Some("create") | Some("run"), Ok(config)) => create(args, inv, &config, &runtime),
        (Some("create") | Some("run"), Err(error)) => {
            create_unconfigured(args, inv, error, &runtime)
        }
        (Some("exec"), _) => exec(args, inv, &runtime),
        _ => Err(hand_over(&runtime, args)),
    }
}

fn load_config(inv: &Invocation) -> Result<Config, ConfigError> {
    match &inv.gpushare_config {
        Some(path) => Config::load(path),
        None => Config::load_default().map(|(config, _)| config),
    }
}

fn bundle_dir(inv: &Invocation) -> anyhow::Result<PathBuf> {
    match &inv.bundle {
        Some(dir) => Ok(dir.clone()),
        None => std::env::current_dir().context("working directory"),
    }
}

/// `create` while the configuration is refused: a container that asks nothing of
/// gpushare is handed over untouched, with a warning in the runtime's log; one
/// that asks is refused naming the file, its problems and the fix.
fn create_unconfigured(
    args: &[OsString],
    inv: &Invocation,
    error: ConfigError,
    runtime: &Path,
) -> anyhow::Result<ExitCode> {
    // A profile's container asks for its share by being started through it.
    if let Some(profile) = &inv.gpushare_profile {
        return Err(anyhow::Error::new(error)
            .context(format!("runtime profile {profile:?} cannot be read")));
    }
    let (_, spec) = BundleSpec::open(&bundle_dir(inv)?)?;
    match broken_config::decide(&spec, inv.container_id.as_deref(), error) {
        Decision::RunUntouched { warning } => {
            // Only the runtime's log: during `create` stderr is the container's own.
            append_to_runtime_log(inv, "warning", &format!("gpushare: {warning}"));
            Err(hand_over(runtime, args))
        }
        Decision::Refuse(refusal) => Err(refusal.into()),
    }
}

/// Writes and flushes `text` to stdout: before an `exec`, nothing may stay buffered.
fn say(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Admits the container (its lease and its spec edits), then runs the next
/// runtime; a create that fails is undone.
fn create(
    args: &[OsString],
    inv: &Invocation,
    config: &Config,
    runtime: &Path,
) -> anyhow::Result<ExitCode> {
    let bundle_dir = bundle_dir(inv)?;
    let container_id = inv
        .container_id
        .clone()
        .context("create: no container id on the command line")?;
    let identity = Identity::container(container_id, inv.namespace());
    let mut arbiter = ControlSocket::new(&config.arbiter);
    let profile = inv.gpushare_profile.as_deref();
    match admission::prepare_bundle_through(&bundle_dir, &identity, config, profile, &mut arbiter)?
    {
        Admitted::Untouched(_) => Err(hand_over(runtime, args)),
        Admitted::Edited(prepared) => {
            // A fresh connection for an undo: runc may have run for long (`run` waits
            // for the container), and the first may since have timed out.
            let undo = |prepared: admission::Prepared| {
                prepared.undo(&mut ControlSocket::new(&config.arbiter))
            };
            let mut watch = match guard::start() {
                guard::Started::Wrapper(watch) => watch,
                guard::Started::Guard(wrapper_said) => {
                    // The forked guard: it never returns into the wrapper's path.
                    guard_create(wrapper_said, runtime, args, inv, || undo(prepared));
                }
            };
            run_and_wait(runtime, args, &mut watch, || {
                let _ = undo(prepared);
            })
        }
    }
}

/// The guard of a create whose wrapper died before it finished (SIGKILL from an
/// engine's timeout, an OOM kill): without it the spec stays edited and the lease
/// held until the reservation's bound. A create the runtime still completed is left
/// to the engine's `delete`; one it did not is undone here.
fn guard_create(
    wrapper_said: Vec<u8>,
    runtime: &Path,
    args: &[OsString],
    inv: &Invocation,
    undo: impl FnOnce() -> Result<(), admission::UndoError>,
) -> ! {
    let outcome = match guard::wrapper_fate(&wrapper_said) {
        guard::WrapperFate::Finished => None,
        guard::WrapperFate::KilledBeforeRuntime => Some(undo()),
        guard::WrapperFate::KilledWhileRuntimeRan(pid) => {
            guard::wait_for_exit(pid);
            if container_exists(runtime, args, inv) {
                None
            } else {
                Some(undo())
            }
        }
    };
    let line = match outcome {
        None => None,
        Some(Ok(())) => Some(("warning", "gpushare: gpushare-runc was killed before its create finished and no container was created: the spec is restored and the lease released".to_owned())),
        Some(Err(e)) => Some(("error", format!("gpushare: gpushare-runc was killed before its create finished; undoing it: {e}"))),
    };
    if let Some((level, line)) = line {
        append_to_runtime_log(inv, level, &line);
    }
    guard::exit()
}

/// Whether the runtime knows the container (`state` answers): its create finished.
fn container_exists(runtime: &Path, args: &[OsString], inv: &Invocation) -> bool {
    let (Some(id), Some(index)) = (&inv.container_id, runc_args::scan(args).subcommand_index)
    else {
        return false;
    };
    Command::new(runtime)
        .args(&args[..index])
        .arg("state")
        .arg(id)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `exec --process <file>` (how containerd's shim and so `docker exec` run
/// processes): the exec process gets the container's injected environment.
fn exec(args: &[OsString], inv: &Invocation, runtime: &Path) -> anyhow::Result<ExitCode> {
    let (Some(process_file), Some(container_id), Some(index)) = (
        &inv.process,
        &inv.container_id,
        runc_args::scan(args).subcommand_index,
    ) else {
        // `runc exec <id> <command…>` without a process file: nothing to edit.
        return Err(hand_over(runtime, args));
    };
    let state = Command::new(runtime)
        .args(&args[..index])
        .arg("state")
        .arg(container_id)
        .output()
        .with_context(|| format!("cannot run {} state", runtime.display()))?;
    // An unknown container: let the runtime give its own error for the exec.
    let bundle = serde_json::from_slice::<serde_json::Value>(&state.stdout)
        .ok()
        .and_then(|s| s["bundle"].as_str().map(PathBuf::from))
        .filter(|_| state.status.success());
    if let Some(bundle) = bundle {
        let (_, container_spec): (_, Spec) = BundleSpec::open(&bundle)?;
        let (process, mut process_spec): (_, Process) = BundleSpec::open_file(process_file)?;
        if mutate::apply_to_exec_process(&mut process_spec, &container_spec)? {
            process.write(&process_spec)?;
        }
    }
    Err(hand_over(runtime, args))
}

/// Runs the runtime as a child (not `exec`) so a failed create can be undone:
/// the spec restored and the lease released.
fn run_and_wait(
    runtime: &Path,
    args: &[OsString],
    watch: &mut guard::Watch,
    undo: impl FnOnce(),
) -> anyhow::Result<ExitCode> {
    let status = Command::new(runtime)
        .args(args)
        .spawn()
        .and_then(|mut child| {
            watch.runtime_started(child.id());
            child.wait()
        });
    let result = match status {
        Ok(s) if s.success() => Ok(ExitCode::SUCCESS),
        Ok(s) => {
            undo();
            // runc already reported its own error; pass its exit status on.
            let code = s
                .code()
                .or_else(|| s.signal().map(|sig| 128 + sig))
                .unwrap_or(1);
            Ok(ExitCode::from(code.clamp(1, 255) as u8))
        }
        Err(e) => {
            undo();
            Err(anyhow!("cannot run {}: {e}", runtime.display()))
        }
    };
    watch.finished();
    result
}

/// Replaces this process with the runtime; returns only on failure, with why.
fn hand_over(runtime: &Path, args: &[OsString]) -> anyhow::Error {
    let error = Command::new(runtime).args(args).exec();
    anyhow!("cannot run {}: {error}", runtime.display())
}

/// The first configured runtime that exists and is not this wrapper itself.
fn next_runtime(names: &[String]) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()
        .ok()
        .and_then(|p| p.canonicalize().ok());
    let path_dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_else(|| {
            vec![
                "/usr/local/sbin".into(),
                "/usr/local/bin".into(),
                "/usr/sbin".into(),
                "/usr/bin".into(),
                "/sbin".into(),
                "/bin".into(),
            ]
        });
    for name in names {
        let candidates: Vec<PathBuf> = if name.contains('/') {
            vec![PathBuf::from(name)]
        } else {
            path_dirs.iter().map(|d| d.join(name)).collect()
        };
        for candidate in candidates {
            let Ok(real) = candidate.canonicalize() else {
                continue;
            };
            if Some(&real) != me.as_ref() && is_executable(&real) {
                return Ok(candidate);
            }
        }
    }
    bail!(
        "none of the runtimes in runtime.runtimes ({}) was found",
        names.join(", ")
    )
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// containerd's runc shim reports the last error line of runc's JSON log, so the
/// message goes there as well as to stderr; otherwise `docker run` would show only
/// "exit status 1".
fn report_error(inv: &Invocation, message: &str) {
    let line = format!("gpushare: {message}");
    eprintln!("{line}");
    append_to_runtime_log(inv, "error", &line);
}

/// One line in the runtime's log (`--log`), in its format: where containerd and
/// docker look for what a runtime said.
fn append_to_runtime_log(inv: &Invocation, level: &str, line: &str) {
    use std::io::Write;
    let Some(log) = &inv.log else {
        return;
    };
    let entry = if inv.log_format_json {
        serde_json::json!({ "level": level, "msg": line }).to_string()
    } else {
        format!("level={level} msg={line:?}")
    };
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        let _ = writeln!(f, "{entry}");
    }
}
