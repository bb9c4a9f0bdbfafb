//! containerd's own runc shim (`containerd-shim-runc-v2`), run as a separate
//! process through its public command line: `start`, `delete`, `-info`, `-v`.
//! The gpushare shim never reimplements what it does (stdio, terminals, exec,
//! exits, OOM events); it only has to start it, find its socket and clean up
//! after it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use containerd_shim::api::{DeleteResponse, Options as RuncOptions};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::Message;

use crate::layout::Bundle;

pub const RUNC_SHIM: &str = "containerd-shim-runc-v2";
/// An explicit path to the runc shim, for hosts that keep it off containerd's PATH.
pub const RUNC_SHIM_ENV: &str = "GPUSHARE_RUNC_SHIM";
/// The type of containerd's runc options (`typeurl` of `runc.v1.Options`).
const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";

#[derive(Debug, thiserror::Error)]
pub enum InnerError {
    #[error("{RUNC_SHIM} not found on PATH or beside {beside}; install containerd's runc shim or set {RUNC_SHIM_ENV}")]
    NotFound { beside: String },
    #[error("cannot run {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("{binary} {action} failed ({status}): {stderr}")]
    Failed {
        binary: PathBuf,
        action: &'static str,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("cannot prepare the runc shim's directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the runc shim answered `start` with {output:?}: {reason}")]
    Bootstrap { output: String, reason: String },
    #[error("the runc shim's `delete` answer is not a DeleteResponse: {0}")]
    DeleteAnswer(containerd_shim::protos::protobuf::Error),
}

/// Which task API the runc shim serves: containerd ≤ 1.7's shims print a bare
/// address and serve `containerd.task.v2.Task`; containerd 2.x's print bootstrap
/// JSON with version 3 and serve only `containerd.task.v3.Task`. The messages are
/// the same on the wire, so the gpushare shim serves v2 to containerd and speaks
/// whichever the runc shim does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskApi {
    V2,
    V3,
}

impl TaskApi {
    pub fn service(self) -> &'static str {
        match self {
            TaskApi::V2 => "containerd.task.v2.Task",
            TaskApi::V3 => "containerd.task.v3.Task",
        }
    }
    pub fn as_env(self) -> &'static str {
        match self {
            TaskApi::V2 => "2",
            TaskApi::V3 => "3",
        }
    }
    pub fn from_env(value: &str) -> Option<TaskApi> {
        match value {
            "2" => Some(TaskApi::V2),
            "3" => Some(TaskApi::V3),
            _ => None,
        }
    }
}

/// Where a started runc shim listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub address: String,
    pub api: TaskApi,
}

/// Reads what a shim's `start` printed: a bare address (containerd ≤ 1.7), bootstrap
/// parameters as JSON `{"version":3,"address":"unix://…","protocol":"ttrpc"}`
/// (containerd 2.0–2.2), or the same parameters protobuf-encoded (containerd ≥ 2.3's
/// `BootstrapParams`: version = 1, address = 2, protocol = 3).
pub fn parse_bootstrap(output: &[u8]) -> Result<Endpoint, InnerError> {
    let fail = |reason: &str| InnerError::Bootstrap {
        output: String::from_utf8_lossy(output).into_owned(),
        reason: reason.to_owned(),
    };
    let params = match std::str::from_utf8(output).map(str::trim) {
        Ok("") => return Err(fail("no address")),
        Ok(json) if json.starts_with('{') => {
            let params: serde_json::Value =
                serde_json::from_str(json).map_err(|e| fail(&e.to_string()))?;
            BootstrapParams {
                version: params["version"].as_u64(),
                address: params["address"].as_str().unwrap_or_default().to_owned(),
                protocol: params["protocol"].as_str().unwrap_or_default().to_owned(),
            }
        }
        // An address is printable text; protobuf starts with a field's tag byte.
        Ok(address) if !address.chars().any(char::is_control) => {
            return Ok(Endpoint {
                address: address.to_owned(),
                api: TaskApi::V2,
            })
        }
        _ => BootstrapParams::from_protobuf(output).map_err(|e| fail(&e))?,
    };
    let api = match params.version {
        Some(2) => TaskApi::V2,
        Some(3) => TaskApi::V3,
        _ => return Err(fail("unknown bootstrap version (expected 2 or 3)")),
    };
    match params.protocol.as_str() {
        "" | "ttrpc" => {}
        other => return Err(fail(&format!("protocol {other} (only ttrpc is spoken)"))),
    }
    if params.address.is_empty() {
        return Err(fail("no address"));
    }
    Ok(Endpoint {
        address: params.address,
        api,
    })
}

/// containerd's bootstrap parameters, however they were encoded.
struct BootstrapParams {
    version: Option<u64>,
    address: String,
    protocol: String,
}

impl BootstrapParams {
    /// The protobuf encoding: read as an empty message, so every field is an unknown
    /// field the protobuf library decoded (no generated type for one small message).
    fn from_protobuf(bytes: &[u8]) -> Result<BootstrapParams, String> {
        use containerd_shim::protos::protobuf::{
            well_known_types::empty::Empty, Message, UnknownValueRef,
        };
        let message = Empty::parse_from_bytes(bytes).map_err(|e| format!("not protobuf: {e}"))?;
        let fields = message.special_fields.unknown_fields();
        let text = |number: u32, name: &str| match fields.get(number) {
            None => Ok(String::new()),
            Some(UnknownValueRef::LengthDelimited(bytes)) => String::from_utf8(bytes.to_vec())
                .map_err(|_| format!("its {name} (field {number}) is not UTF-8")),
            Some(_) => Err(format!("its {name} (field {number}) is not a string")),
        };
        let version = match fields.get(1) {
            None => None,
            Some(UnknownValueRef::Varint(v)) => Some(v),
            Some(_) => return Err("its version (field 1) is not an integer".into()),
        };
        Ok(BootstrapParams {
            version,
            address: text(2, "address")?,
            protocol: text(3, "protocol")?,
        })
    }
}

/// The runtime options containerd passes on `start`'s stdin (and in `Create`),
/// kept only when they are runc's own. The runc shim fails on any other type:
/// containerd's CRI plugin sends `runtimeoptions.v1` for every runtime type but
/// runc's when the runtime has an `options` table.
pub fn runc_options(any_bytes: &[u8]) -> Option<RuncOptions> {
    let any = Any::parse_from_bytes(any_bytes).ok()?;
    if !is_runc_options(&any.type_url) {
        return None;
    }
    RuncOptions::parse_from_bytes(&any.value).ok()
}

pub fn is_runc_options(type_url: &str) -> bool {
    type_url
        .trim_start_matches('/')
        .ends_with(RUNC_OPTIONS_TYPE)
        && type_url
            .strip_suffix(RUNC_OPTIONS_TYPE)
            .is_some_and(|prefix| prefix.is_empty() || prefix.ends_with('/'))
}

/// The flags containerd gives every shim invocation.
#[derive(Debug, Clone)]
pub struct ShimCall {
    pub namespace: String,
    pub address: String,
    pub publish_binary: String,
    pub id: String,
    pub debug: bool,
}

impl ShimCall {
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "-namespace".into(),
            self.namespace.clone(),
            "-address".into(),
            self.address.clone(),
            "-publish-binary".into(),
            self.publish_binary.clone(),
            "-id".into(),
            self.id.clone(),
        ];
        if self.debug {
            args.push("-debug".into());
        }
        args
    }
}

/// The runc shim binary.
#[derive(Debug, Clone)]
pub struct RuncShim {
    pub binary: PathBuf,
}

impl RuncShim {
    /// `$GPUSHARE_RUNC_SHIM`, else containerd's own lookup: PATH, then beside
    /// the containerd binary (`-publish-binary`).
    pub fn locate(publish_binary: &str) -> Result<RuncShim, InnerError> {
        if let Some(explicit) = std::env::var_os(RUNC_SHIM_ENV).filter(|v| !v.is_empty()) {
            return Ok(RuncShim {
                binary: explicit.into(),
            });
        }
        let on_path = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default();
        let beside = Path::new(publish_binary).parent().map(Path::to_owned);
        on_path
            .into_iter()
            .chain(beside)
            .map(|dir| dir.join(RUNC_SHIM))
            .find(|candidate| is_executable(candidate))
            .map(|binary| RuncShim { binary })
            .ok_or_else(|| InnerError::NotFound {
                beside: publish_binary.to_owned(),
            })
    }

    /// Runs the runc shim's `start` in its own directory inside the bundle (see
    /// `layout`), handing it `options` on stdin as containerd would.
    pub fn start(
        &self,
        call: &ShimCall,
        bundle: &Bundle,
        options: &[u8],
    ) -> Result<Endpoint, InnerError> {
        let dir = bundle.inner_dir();
        let state_err = |path: &Path| {
            let path = path.to_owned();
            move |source| InnerError::StateDir { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(state_err(&dir))?;
        for (link, target) in bundle.inner_links() {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&target, &link).map_err(state_err(&link))?;
        }
        let mut child = Command::new(&self.binary)
            .args(call.args())
            .arg("start")
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| self.spawn_error(source))?;
        if let Some(mut stdin) = child.stdin.take() {
            // Small (a few hundred bytes): fits the pipe, so this cannot block.
            let _ = stdin.write_all(options);
        }
        let out = child
            .wait_with_output()
            .map_err(|source| self.spawn_error(source))?;
        if !out.status.success() {
            return Err(self.failed("start", out.status, &out.stderr));
        }
        parse_bootstrap(&out.stdout)
    }

    /// The runc shim's cleanup of one container (`runc delete --force`, rootfs
    /// unmount). It finds the bundle as `<cwd>/../<id>`, so it runs in the bundle
    /// itself, not in its own directory.
    pub fn delete(&self, call: &ShimCall, bundle: &Path) -> Result<DeleteResponse, InnerError> {
        let out = Command::new(&self.binary)
            .args(call.args())
            .arg("-bundle")
            .arg(bundle)
            .arg("delete")
            .current_dir(bundle)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| self.spawn_error(source))?;
        if !out.status.success() {
            return Err(self.failed("delete", out.status, &out.stderr));
        }
        DeleteResponse::parse_from_bytes(&out.stdout).map_err(InnerError::DeleteAnswer)
    }

    /// `-info` (containerd 2.x asks shims for their RuntimeInfo): the runc shim's
    /// answer, raw.
    pub fn info(&self, options: &[u8]) -> Result<Vec<u8>, InnerError> {
        let mut child = Command::new(&self.binary)
            .arg("-info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| self.spawn_error(source))?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(options);
        }
        let out = child
            .wait_with_output()
            .map_err(|source| self.spawn_error(source))?;
        if !out.status.success() {
            return Err(self.failed("-info", out.status, &out.stderr));
        }
        Ok(out.stdout)
    }

    /// `-v`: its version text.
    pub fn version(&self) -> Result<String, InnerError> {
        let out = Command::new(&self.binary)
            .arg("-v")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| self.spawn_error(source))?;
        if !out.status.success() {
            return Err(self.failed("-v", out.status, &out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn spawn_error(&self, source: std::io::Error) -> InnerError {
        InnerError::Spawn {
            binary: self.binary.clone(),
            source,
        }
    }

    fn failed(
        &self,
        action: &'static str,
        status: std::process::ExitStatus,
        stderr: &[u8],
    ) -> InnerError {
        InnerError::Failed {
            binary: self.binary.clone(),
            action,
            status,
            stderr: String::from_utf8_lossy(stderr).trim().to_owned(),
        }
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_address_is_task_api_v2() {
        let e = parse_bootstrap(b"unix:///run/containerd/s/abc\n").unwrap();
        assert_eq!(e.address, "unix:///run/containerd/s/abc");
        assert_eq!(e.api, TaskApi::V2);
        assert_eq!(e.api.service(), "containerd.task.v2.Task");
    }

    #[test]
    fn containerd_2_bootstrap_json_is_understood() {
        let e = parse_bootstrap(
            br#"{"version":3,"address":"unix:///run/containerd/s/x","protocol":"ttrpc"}"#,
        )
        .unwrap();
        assert_eq!(e.address, "unix:///run/containerd/s/x");
        assert_eq!(e.api, TaskApi::V3);
        assert_eq!(e.api.service(), "containerd.task.v3.Task");
        let v2 =
            parse_bootstrap(br#"{"version":2,"address":"unix:///s","protocol":"ttrpc"}"#).unwrap();
        assert_eq!(v2.api, TaskApi::V2);
    }

    /// Exactly what containerd 2.3.4's `containerd-shim-runc-v2 start` printed (the
    /// engine in ../shared/engines): protobuf, no newline.
    const RUNC_SHIM_2_3_4: &[u8] = include_bytes!("testdata/bootstrap-runc-shim-2.3.4.bin");

    #[test]
    fn containerd_2_3_protobuf_bootstrap_is_understood() {
        let e = parse_bootstrap(RUNC_SHIM_2_3_4).unwrap();
        assert_eq!(
            e.address,
            "unix:///run/containerd/s/f4c1db8a20165cc3f23b85c7b88b595e7fe1cc54ca6f72f252d24d4547bcf36d"
        );
        assert_eq!(e.api, TaskApi::V3);
        // Fields in another order, and protocol left out (its default), still read.
        let reordered = b"\x12\x0aunix:///s1\x08\x03";
        let e = parse_bootstrap(reordered).unwrap();
        assert_eq!((e.address.as_str(), e.api), ("unix:///s1", TaskApi::V3));
    }

    #[test]
    fn unusable_bootstrap_answers_are_errors() {
        let bad: &[&[u8]] = &[
            b"",
            b"  \n",
            br#"{"version":4,"address":"unix:///s"}"#,
            br#"{"version":3,"address":"unix:///s","protocol":"grpc"}"#,
            br#"{"version":3}"#,
            b"{not json",
            // protobuf: version 4; protocol grpc; no address; address not a string;
            // truncated; not UTF-8.
            b"\x08\x04\x12\x09unix:///s",
            b"\x08\x03\x12\x09unix:///s\x1a\x04grpc",
            b"\x08\x03",
            b"\x08\x03\x10\x05",
            b"\x08\x03\x12\x59unix",
            b"\x08\x03\x12\x02\xff\xfe",
        ];
        for bad in bad {
            assert!(
                parse_bootstrap(bad).is_err(),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
        // The error shows what the shim printed and why it is unusable.
        let message = parse_bootstrap(b"\x08\x03\x12\x09unix:///s\x1a\x04grpc")
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("unix:///s") && message.contains("protocol grpc"),
            "{message}"
        );
    }

    #[test]
    fn the_task_api_round_trips_through_the_environment() {
        for api in [TaskApi::V2, TaskApi::V3] {
            assert_eq!(TaskApi::from_env(api.as_env()), Some(api));
        }
        assert_eq!(TaskApi::from_env("1"), None);
    }

    fn any(type_url: &str, value: Vec<u8>) -> Vec<u8> {
        let mut a = Any::new();
        a.type_url = type_url.into();
        a.value = value;
        a.write_to_bytes().unwrap()
    }

    #[test]
    fn only_runc_options_are_passed_on() {
        let mut opts = RuncOptions::new();
        opts.shim_cgroup = "/pods/x".into();
        opts.binary_name = "runc".into();
        let runc = any("containerd.runc.v1.Options", opts.write_to_bytes().unwrap());
        assert_eq!(runc_options(&runc).unwrap().shim_cgroup, "/pods/x");
        let prefixed = any(
            "types.containerd.io/containerd.runc.v1.Options",
            opts.write_to_bytes().unwrap(),
        );
        assert!(runc_options(&prefixed).is_some());
        // CRI's runtimeoptions for a custom runtime type: field 1 is a string there,
        // a bool in runc's options; it must be dropped, not misread.
        let cri = any("runtimeoptions.v1.Options", b"\x0a\x03abc".to_vec());
        assert!(runc_options(&cri).is_none());
        assert!(runc_options(b"").is_none());
        assert!(runc_options(b"\xff\xff").is_none());
        assert!(!is_runc_options("evilcontainerd.runc.v1.Options"));
    }

    #[test]
    fn call_arguments_are_containerds_flags() {
        let call = ShimCall {
            namespace: "ns".into(),
            address: "/run/c.sock".into(),
            publish_binary: "/usr/bin/containerd".into(),
            id: "c1".into(),
            debug: true,
        };
        assert_eq!(
            call.args(),
            [
                "-namespace",
                "ns",
                "-address",
                "/run/c.sock",
                "-publish-binary",
                "/usr/bin/containerd",
                "-id",
                "c1",
                "-debug"
            ]
        );
    }
}
