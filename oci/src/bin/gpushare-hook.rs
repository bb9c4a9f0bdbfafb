//! gpushare-hook: the OCI hooks that tie a lease to its container's life.
//!
//! - `precreate` (podman, via hooks.d): the proposed spec on stdin, the edited spec
//!   on stdout. podman shows the hook no container id, so the lease is reserved as
//!   *pending* and bound to the container by `create-runtime`.
//! - `create-runtime`: confirms the lease with the container's pid (or binds the
//!   pending one).
//! - `poststop`: releases it.
//! - `fail --message M`: prints M and fails; precreate plants it to report errors
//!   (podman discards a precreate hook's own stderr, but shows runc's errors,
//!   which include a failing hook's stderr).
//!
//! The state hooks go by the container id runc reports, never by annotations,
//! which the container's creator controls; the one annotation used (to bind a
//! pending lease) only works for a lease that is still pending.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use gpushare_config::{Config, Unrequested};
use gpushare_oci::{mutate, request};
use gpushare_proto::message::PENDING_PREFIX;
use gpushare_proto::{ClientError, ContainerRef, ControlClient, ErrorKind, LeaseId};
use serde_json::Value;

const USAGE: &str = "usage: gpushare-hook [--config FILE] [--control-socket PATH] \
                     precreate|create-runtime|poststop < spec-or-state.json, or gpushare-hook fail --message M";
/// An OCI spec or state is a few KiB; anything near this is not one.
const MAX_INPUT: u64 = 16 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpushare-hook: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut config_path: Option<PathBuf> = None;
    let mut socket: Option<PathBuf> = None;
    let mut action: Option<String> = None;
    let mut message: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--message" => message = Some(args.next().ok_or(USAGE)?),
            "fail" if action.is_none() => action = Some(arg),
            "--config" => config_path = Some(args.next().ok_or(USAGE)?.into()),
            "--control-socket" => socket = Some(args.next().ok_or(USAGE)?.into()),
            "precreate" | "create-runtime" | "poststop" if action.is_none() => action = Some(arg),
            _ => return Err(USAGE.into()),
        }
    }
    let action = action.ok_or(USAGE)?;
    if action == "fail" {
        return Err(message.unwrap_or_else(|| "container creation refused".into()));
    }
    let config = match &config_path {
        Some(path) => Config::load(path).map_err(|e| e.to_string())?,
        None => Config::load_default().map_err(|e| e.to_string())?.0,
    };
    let socket = socket.unwrap_or_else(|| config.arbiter.control_socket());
    let connect = || {
        ControlClient::connect(&socket, config.arbiter.client_timeout()).map_err(|e| e.to_string())
    };

    let mut input = Vec::new();
    std::io::stdin()
        .take(MAX_INPUT)
        .read_to_end(&mut input)
        .map_err(|e| format!("reading stdin: {e}"))?;
    let document: Value =
        serde_json::from_slice(&input).map_err(|e| format!("stdin is not JSON: {e}"))?;

    if action == "precreate" {
        let original = document.clone();
        return match precreate(&input, document, &config, connect) {
            Ok(()) => Ok(()),
            Err(message) => {
                let mut spec = original;
                mutate::apply_failure(
                    &mut spec,
                    &config.runtime.hook,
                    &format!("gpushare: {message}"),
                )
                .map_err(|e| format!("{message} (and cannot report it: {e})"))?;
                std::io::stdout()
                    .write_all(&serde_json::to_vec(&spec).expect("JSON serialises"))
                    .map_err(|e| format!("writing the spec: {e}"))
            }
        };
    }
    let container_id = document["id"]
        .as_str()
        .ok_or("the OCI state on stdin has no id")?
        .to_owned();
    // The lease gpushare's own edit named in the spec (runc passes the spec's
    // annotations in the state): it tells apart two containers with one id in two
    // namespaces, which the id alone cannot.
    let lease_annotation = document
        .pointer(&format!(
            "/annotations/{}",
            gpushare_oci::ANNOTATION_LEASE.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let container = ContainerRef {
        container_id: container_id.clone(),
        namespace: None,
        lease: lease_annotation.clone().map(LeaseId),
    };
    if action == "poststop" {
        return connect()?
            .release_container_in(container)
            .map(|_| ())
            .map_err(|e| e.to_string());
    }
    let pid = document["pid"]
        .as_u64()
        .filter(|&p| p > 0 && p <= u32::MAX as u64)
        .ok_or("the OCI state has no pid")? as u32;
    let mut client = connect()?;
    match client.confirm_in(container, pid) {
        Err(ClientError::Refused {
            kind: ErrorKind::NotFound,
            ..
        }) => {
            // Reserved by precreate before the container had an id: bind it now.
            let lease = lease_annotation
                .as_deref()
                .ok_or_else(|| format!("container {container_id} holds no gpushare lease"))?;
            client
                .bind(LeaseId(lease.to_owned()), container_id, pid)
                .map_err(|e| e.to_string())
        }
        other => other.map_err(|e| e.to_string()),
    }
}

fn precreate(
    input: &[u8],
    mut spec: Value,
    config: &Config,
    connect: impl Fn() -> Result<ControlClient, String>,
) -> Result<(), String> {
    let emit = |bytes: &[u8]| {
        std::io::stdout()
            .write_all(bytes)
            .map_err(|e| format!("writing the spec: {e}"))
    };
    if gpushare_oci::kubernetes::is_pod_sandbox(&spec) {
        // A pod's pause container (CRI-O runs hooks for it too): no GPU.
        return emit(input);
    }
    if mutate::is_marked(&spec) {
        return Err(format!(
            "the spec already carries {}: gpushare's annotations cannot be set by hand",
            gpushare_oci::ANNOTATION_MARKER
        ));
    }
    let Some(wanted) = request::from_spec(&spec, &config.requests).map_err(|e| e.to_string())?
    else {
        if config.requests.unrequested == Unrequested::Void {
            mutate::apply_void(&mut spec).map_err(|e| e.to_string())?;
            return emit(&serde_json::to_vec(&spec).expect("JSON serialises"));
        }
        return emit(input);
    };
    let pending_id = format!("{PENDING_PREFIX}{}", random_hex()?);
    let mut client = connect()?;
    let driver = client
        .status()
        .map_err(|e| e.to_string())?
        .driver_cuda_version;
    gpushare_oci::cuda_compat::check_spec(&spec, driver).map_err(|e| e.to_string())?;
    let lease = client
        .reserve(wanted.into_reserve(pending_id, None, None))
        .map_err(|e| e.to_string())?;
    let paths = mutate::HostPaths::new(&config.runtime, &config.arbiter, &lease);
    let edited = mutate::apply_lease(&mut spec, &lease, &paths)
        .map_err(|e| e.to_string())
        .and_then(|()| emit(&serde_json::to_vec(&spec).expect("JSON serialises")));
    if edited.is_err() {
        let _ = client.release(lease.id);
    }
    edited
}

/// 128 random bits: the pending lease's container id must not be guessable.
fn random_hex() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| format!("/dev/urandom: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
