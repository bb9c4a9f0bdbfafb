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
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Parser;
use gpushare_config::{ArbiterConfig, Config, ConfigError};
use gpushare_oci::admission::{self, Admitted, ControlSocket, Identity};
use gpushare_oci::broken_config::{self, Decision};
use gpushare_oci::cli::{HookCli, Stage};
use gpushare_oci::mutate;
use gpushare_oci::spec::{self, Spec, State};
use gpushare_proto::{ClientError, ContainerRef, ErrorKind, LeaseId};

/// An OCI spec or state is a few KiB; anything near this is not one.
const MAX_INPUT: u64 = 16 << 20;

fn main() -> ExitCode {
    match run(HookCli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpushare-hook: {}", gpushare_oci::describe(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: HookCli) -> anyhow::Result<()> {
    if let Stage::Fail { message } = cli.stage {
        bail!(message.unwrap_or_else(|| "container creation refused".into()));
    }
    // Read at each use, so a fix takes effect at the next container.
    let loaded = match &cli.config {
        Some(path) => Config::load(path),
        None => Config::load_default().map(|(config, _)| config),
    };
    let mut input = Vec::new();
    std::io::stdin()
        .take(MAX_INPUT)
        .read_to_end(&mut input)
        .context("reading stdin")?;
    let config = match loaded {
        Ok(config) => config,
        Err(error) => return run_unconfigured(&cli, &input, error),
    };
    let mut arbiter = match cli.control_socket {
        Some(socket) => ControlSocket::at(socket, config.arbiter.client_timeout()),
        None => ControlSocket::new(&config.arbiter),
    };
    match cli.stage {
        Stage::Precreate => precreate(&input, &config, &mut arbiter),
        Stage::CreateRuntime => create_runtime(&input, &mut arbiter),
        Stage::Poststop => poststop(&input, &mut arbiter),
        Stage::Fail { .. } => unreachable!("handled first"),
    }
}

/// A stage while the configuration is refused. precreate: a container that asks
/// nothing of gpushare goes on byte for byte (with a warning); one that asks gets
/// the refusal planted. The state hooks act only for a container gpushare edited
/// (its lease annotation), and then only with `--control-socket` to reach the
/// arbiter by; otherwise the file's problems are the error.
fn run_unconfigured(cli: &HookCli, input: &[u8], error: ConfigError) -> anyhow::Result<()> {
    if let Stage::Precreate = cli.stage {
        let spec = Spec::from_slice(input).context("stdin is not an OCI spec")?;
        return match broken_config::decide(&spec, None, error) {
            Decision::RunUntouched { warning } => {
                eprintln!("gpushare-hook: warning: {warning}");
                emit(input)
            }
            Decision::Refuse(refusal) => {
                let hook = std::env::current_exe().context("this hook's own path")?;
                // `gpushare-hook fail` says "gpushare-hook: " before it.
                let message = refusal.to_string();
                let mut failing = spec;
                mutate::apply_failure(&mut failing, &hook, &message)
                    .with_context(|| format!("{message} (and cannot report it)"))?;
                emit(&failing.to_vec())
            }
        };
    }
    let edited = spec::state_annotation(&state(input)?, gpushare_oci::ANNOTATION_LEASE).is_some();
    let mut arbiter = match (&cli.control_socket, edited) {
        (_, false) => return Ok(()),
        (Some(socket), true) => {
            ControlSocket::at(socket.clone(), ArbiterConfig::default().client_timeout())
        }
        (None, true) => return Err(error.into()),
    };
    match cli.stage {
        Stage::CreateRuntime => create_runtime(input, &mut arbiter),
        Stage::Poststop => poststop(input, &mut arbiter),
        Stage::Precreate | Stage::Fail { .. } => unreachable!("handled first"),
    }
}

fn emit(bytes: &[u8]) -> anyhow::Result<()> {
    std::io::stdout()
        .write_all(bytes)
        .context("writing the spec")
}

/// Admits the container; a refusal is planted in the spec as a failing
/// createRuntime hook, whose message podman shows.
fn precreate(input: &[u8], config: &Config, arbiter: &mut ControlSocket) -> anyhow::Result<()> {
    let spec = Spec::from_slice(input).context("stdin is not an OCI spec")?;
    let refusal = match admit(input, &spec, config, arbiter) {
        Ok(()) => return Ok(()),
        Err(error) => gpushare_oci::describe(error.as_ref()),
    };
    let mut failing = spec;
    mutate::apply_failure(
        &mut failing,
        &config.runtime.hook,
        // `gpushare-hook fail` says "gpushare-hook: " before it.
        &refusal,
    )
    .with_context(|| format!("{refusal} (and cannot report it)"))?;
    emit(&failing.to_vec())
}

fn admit(
    input: &[u8],
    spec: &Spec,
    config: &Config,
    arbiter: &mut ControlSocket,
) -> anyhow::Result<()> {
    let identity = Identity::pending().context("/dev/urandom")?;
    match admission::admit(spec, &identity, config, arbiter)? {
        // Byte for byte as podman proposed it.
        Admitted::Untouched(_) => emit(input),
        Admitted::Edited(edit) => {
            let emitted = emit(&edit.spec().to_vec());
            if emitted.is_err() {
                let _ = edit.withdraw(arbiter);
            }
            emitted
        }
    }
}

/// The container runc reports on stdin, and the lease gpushare's own edit named
/// in its spec (runc passes the spec's annotations in the state): it tells apart
/// two containers with one id in two namespaces, which the id alone cannot.
fn container_of(state: &State) -> anyhow::Result<ContainerRef> {
    let container_id = Some(state.id().as_str())
        .filter(|id| !id.is_empty())
        .context("the OCI state on stdin has no id")?;
    let lease = spec::state_annotation(state, gpushare_oci::ANNOTATION_LEASE)
        .map(|l| LeaseId(l.to_owned()));
    Ok(ContainerRef {
        container_id: container_id.to_owned(),
        namespace: None,
        lease,
    })
}

fn state(input: &[u8]) -> anyhow::Result<State> {
    spec::state_from_slice(input).context("stdin is not an OCI state")
}

fn poststop(input: &[u8], arbiter: &mut ControlSocket) -> anyhow::Result<()> {
    let container = container_of(&state(input)?)?;
    arbiter.with(|c| c.release_container_in(container))?;
    Ok(())
}

fn create_runtime(input: &[u8], arbiter: &mut ControlSocket) -> anyhow::Result<()> {
    let state = state(input)?;
    let container = container_of(&state)?;
    let pid = spec::state_pid(&state).context("the OCI state has no pid")?;
    let (container_id, lease) = (container.container_id.clone(), container.lease.clone());
    match arbiter.with(|c| c.confirm_in(container, pid)) {
        Err(ClientError::Refused {
            kind: ErrorKind::NotFound,
            ..
        }) => {
            // Reserved by precreate before the container had an id: bind it now.
            let lease = lease
                .with_context(|| format!("container {container_id} holds no gpushare lease"))?;
            Ok(arbiter.with(|c| c.bind(lease, container_id, pid))?)
        }
        other => Ok(other?),
    }
}
