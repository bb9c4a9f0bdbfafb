//! gpushare-runc: a runc-compatible wrapper for engines that take a runtime binary
//! (docker's path runtimes, CRI-O, podman `--runtime`, containerd `BinaryName`).
//!
//! On `create` (and `run`) it reads the request from the bundle's config.json,
//! reserves a lease, edits the spec, and runs the next runtime with the very same
//! arguments. Every other subcommand is handed over untouched with `exec`.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use gpushare_config::{Config, Unrequested};
use gpushare_oci::bundle::BundleSpec;
use gpushare_oci::runc_args::{self, Invocation};
use gpushare_oci::{cuda_compat, kubernetes, mutate, request};
use gpushare_proto::{ContainerRef, ControlClient};
use serde_json::Value;

fn main() -> ExitCode {
    let given: Vec<OsString> = std::env::args_os().skip(1).collect();
    let invocation = runc_args::scan(&given);
    // What the next runtime sees: the command line without gpushare's own flag.
    let args = runc_args::strip_gpushare_flags(&given);
    match run(&args, &invocation) {
        Ok(code) => code,
        Err(message) => {
            report_error(&invocation, &message);
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[OsString], inv: &Invocation) -> Result<ExitCode, String> {
    let config = match &inv.gpushare_config {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None => Config::load_default().map_err(|e| e.to_string())?.0,
    };
    let runtime = next_runtime(&config.runtime.runtimes)?;
    match inv.subcommand.as_deref() {
        Some("create") | Some("run") => create(args, inv, &config, &runtime),
        Some("exec") => exec(args, inv, &runtime),
        _ => Err(format!(
            "cannot run {}: {}",
            runtime.display(),
            hand_over(&runtime, args)
        )),
    }
}

fn create(
    args: &[OsString],
    inv: &Invocation,
    config: &Config,
    runtime: &Path,
) -> Result<ExitCode, String> {
    let bundle_dir = match &inv.bundle {
        Some(dir) => dir.clone(),
        None => std::env::current_dir().map_err(|e| format!("working directory: {e}"))?,
    };
    let (bundle, mut spec) = BundleSpec::open(&bundle_dir).map_err(|e| e.to_string())?;
    let container_id = inv
        .container_id
        .clone()
        .ok_or("create: no container id on the command line")?;

    if kubernetes::is_pod_sandbox(&spec) {
        // A pod's pause container: no GPU, its spec as it is.
        return Err(format!(
            "cannot run {}: {}",
            runtime.display(),
            hand_over(runtime, args)
        ));
    }
    if mutate::is_marked(&spec) {
        // Already edited upstream (the gpushare shim): only check it is genuine.
        verify_marker(&spec, &container_id, config)?;
        return Err(format!(
            "cannot run {}: {}",
            runtime.display(),
            hand_over(runtime, args)
        ));
    }

    let Some(wanted) = request::from_spec(&spec, &config.requests).map_err(|e| e.to_string())?
    else {
        if config.requests.unrequested == Unrequested::Void {
            mutate::apply_void(&mut spec).map_err(|e| e.to_string())?;
            bundle.write(&spec).map_err(|e| e.to_string())?;
            return run_and_wait(runtime, args, || {
                let _ = bundle.restore();
            });
        }
        return Err(format!(
            "cannot run {}: {}",
            runtime.display(),
            hand_over(runtime, args)
        ));
    };

    let sandbox_id = kubernetes::sandbox_id(&spec);
    let socket = config.arbiter.control_socket();
    let timeout = config.arbiter.client_timeout();
    let mut client = ControlClient::connect(&socket, timeout).map_err(|e| e.to_string())?;
    // Before anything is reserved: an image the driver cannot run is refused here.
    let driver = client
        .status()
        .map_err(|e| e.to_string())?
        .driver_cuda_version;
    cuda_compat::check_spec(&spec, driver).map_err(|e| format!("container {container_id}: {e}"))?;
    let lease = client
        .reserve(wanted.into_reserve(container_id.clone(), inv.namespace(), sandbox_id))
        .map_err(|e| format!("container {container_id}: {e}"))?;

    let release = || {
        // A fresh connection: the first may have timed out.
        if let Ok(mut c) = ControlClient::connect(&socket, timeout) {
            let _ = c.release_container_in(ContainerRef {
                container_id: container_id.clone(),
                namespace: inv.namespace(),
                lease: Some(lease.id.clone()),
            });
        }
    };
    let paths = mutate::HostPaths::new(&config.runtime, &config.arbiter, &lease);
    if let Err(e) = mutate::apply_lease(&mut spec, &lease, &paths) {
        release();
        return Err(e.to_string());
    }
    if let Err(e) = bundle.write(&spec) {
        let _ = bundle.restore();
        release();
        return Err(e.to_string());
    }
    run_and_wait(runtime, args, || {
        let _ = bundle.restore();
        release();
    })
}

/// `exec --process <file>` (how containerd's shim and so `docker exec` run
/// processes): the exec process gets the container's injected environment.
fn exec(args: &[OsString], inv: &Invocation, runtime: &Path) -> Result<ExitCode, String> {
    let (Some(process_file), Some(container_id), Some(index)) = (
        &inv.process,
        &inv.container_id,
        runc_args::scan(args).subcommand_index,
    ) else {
        // `runc exec <id> <command…>` without a process file: nothing to edit.
        return Err(format!(
            "cannot run {}: {}",
            runtime.display(),
            hand_over(runtime, args)
        ));
    };
    let state = Command::new(runtime)
        .args(&args[..index])
        .arg("state")
        .arg(container_id)
        .output()
        .map_err(|e| format!("cannot run {} state: {e}", runtime.display()))?;
    // An unknown container: let the runtime give its own error for the exec.
    let bundle = serde_json::from_slice::<Value>(&state.stdout)
        .ok()
        .and_then(|s| s["bundle"].as_str().map(PathBuf::from))
        .filter(|_| state.status.success());
    if let Some(bundle) = bundle {
        let (_, container_spec) = BundleSpec::open(&bundle).map_err(|e| e.to_string())?;
        let (process, mut process_spec) =
            BundleSpec::open_file(process_file).map_err(|e| e.to_string())?;
        if mutate::apply_to_exec_process(&mut process_spec, &container_spec)
            .map_err(|e| e.to_string())?
        {
            process.write(&process_spec).map_err(|e| e.to_string())?;
        }
    }
    Err(format!(
        "cannot run {}: {}",
        runtime.display(),
        hand_over(runtime, args)
    ))
}

/// Runs the runtime as a child (not `exec`) so a failed create can be undone:
/// the spec restored and the lease released.
fn run_and_wait(
    runtime: &Path,
    args: &[OsString],
    undo: impl FnOnce(),
) -> Result<ExitCode, String> {
    let status = Command::new(runtime).args(args).status();
    match status {
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
            Err(format!("cannot run {}: {e}", runtime.display()))
        }
    }
}

/// Replaces this process with the runtime; returns only on failure.
fn hand_over(runtime: &Path, args: &[OsString]) -> std::io::Error {
    Command::new(runtime).args(args).exec()
}

fn verify_marker(spec: &Value, container_id: &str, config: &Config) -> Result<(), String> {
    let mut client = ControlClient::connect(
        &config.arbiter.control_socket(),
        config.arbiter.client_timeout(),
    )
    .map_err(|e| e.to_string())?;
    let status = client.status().map_err(|e| e.to_string())?;
    if mutate::marker_is_genuine(spec, container_id, &status) {
        Ok(())
    } else {
        Err(format!(
            "container {container_id}: its spec carries gpushare's own annotations ({}) but the arbiter granted it no such lease; \
             these annotations are written by gpushare and cannot be set by hand",
            gpushare_oci::ANNOTATION_MARKER
        ))
    }
}

/// The first configured runtime that exists and is not this wrapper itself.
fn next_runtime(names: &[String]) -> Result<PathBuf, String> {
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
    Err(format!(
        "none of the runtimes in runtime.runtimes ({}) was found",
        names.join(", ")
    ))
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
    if let Some(log) = &inv.log {
        use std::io::Write;
        let entry = if inv.log_format_json {
            serde_json::json!({ "level": "error", "msg": line }).to_string()
        } else {
            format!("level=error msg={line:?}")
        };
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "{entry}");
        }
    }
}
