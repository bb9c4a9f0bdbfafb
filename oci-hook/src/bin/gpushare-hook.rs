//! gpushare-hook: the OCI hooks that tie a lease to its container's life.
//!
//! `create-runtime` confirms the lease with the container's pid; `poststop`
//! releases it. Both read the OCI state on stdin and go by the container id runc
//! reports, never by annotations, which the container's creator controls.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use gpushare_proto::ControlClient;
use serde_json::Value;

const USAGE: &str = "usage: gpushare-hook [--control-socket PATH] [--timeout-ms N] create-runtime|poststop < state.json";

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
    let mut socket: Option<PathBuf> = None;
    // Below runc's hook timeout (configured at 10 s by default) so we fail with our own message first.
    let mut timeout = Duration::from_secs(5);
    let mut action: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--control-socket" => socket = Some(args.next().ok_or(USAGE)?.into()),
            "--timeout-ms" => {
                let ms: u64 = args.next().and_then(|v| v.parse().ok()).ok_or(USAGE)?;
                timeout = Duration::from_millis(ms);
            }
            "create-runtime" | "poststop" if action.is_none() => action = Some(arg),
            _ => return Err(USAGE.into()),
        }
    }
    let action = action.ok_or(USAGE)?;
    let socket = match socket {
        Some(s) => s,
        None => gpushare_config::Config::load_default()
            .map_err(|e| e.to_string())?
            .0
            .arbiter
            .control_socket(),
    };

    let mut state = String::new();
    std::io::stdin()
        .take(1 << 20)
        .read_to_string(&mut state)
        .map_err(|e| format!("reading the OCI state: {e}"))?;
    let state: Value = serde_json::from_str(&state)
        .map_err(|e| format!("the OCI state on stdin is not JSON: {e}"))?;
    let container_id = state["id"]
        .as_str()
        .ok_or("the OCI state has no id")?
        .to_owned();

    let mut client = ControlClient::connect(&socket, timeout).map_err(|e| e.to_string())?;
    match action.as_str() {
        "create-runtime" => {
            let pid = state["pid"]
                .as_u64()
                .filter(|&p| p > 0 && p <= u32::MAX as u64)
                .ok_or("the OCI state has no pid")?;
            client
                .confirm(container_id, pid as u32)
                .map_err(|e| e.to_string())
        }
        _ => client
            .release_container(container_id)
            .map(|_| ())
            .map_err(|e| e.to_string()),
    }
}
