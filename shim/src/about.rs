//! `-v`, `-info` and `-h`, which the crate's bootstrap leaves to the shim.

use std::io::Read;

use containerd_shim::protos::protobuf::{Message, MessageField};
use containerd_shim::protos::types::introspection::{RuntimeInfo, RuntimeVersion};

pub use crate::cli::BINARY;
use crate::inner::{self, RuncShim};
use crate::RUNTIME_ID;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Annotation naming the runc shim in `-info`'s answer.
const RUNC_SHIM_ANNOTATION: &str = "io.containerd.gpushare.v2.runc-shim";

#[derive(Debug, thiserror::Error)]
pub enum AboutError {
    #[error("read runtime options from stdin: {0}")]
    Stdin(std::io::Error),
    #[error("encode RuntimeInfo: {0}")]
    Encode(containerd_shim::protos::protobuf::Error),
}

/// The text `-h` prints.
pub fn help_text() -> String {
    crate::cli::usage(VERSION)
}

/// The text `-v` prints, in the layout of containerd's shims.
pub fn version_text(publish_binary: &str) -> String {
    let runc = match RuncShim::locate(publish_binary) {
        Ok(runc) => {
            let version = runc
                .version()
                .ok()
                .and_then(|v| {
                    v.lines().find_map(|l| {
                        l.trim()
                            .strip_prefix("Version:")
                            .map(|s| s.trim().to_owned())
                    })
                })
                .unwrap_or_else(|| "unknown version".into());
            format!("{} ({version})", runc.binary.display())
        }
        Err(e) => format!("none: {e}"),
    };
    format!("{BINARY}:\n  Version:  {VERSION}\n  Runtime:  {RUNTIME_ID}\n  Decorates: {runc}\n")
}

/// `-info`: the runc shim's RuntimeInfo (features, options) under this shim's
/// name and version; when the runc shim predates `-info` (containerd 1.6), just
/// the name, version and runc options.
pub fn runtime_info(publish_binary: &str) -> Result<Vec<u8>, AboutError> {
    let mut options = Vec::new();
    std::io::stdin()
        .read_to_end(&mut options)
        .map_err(AboutError::Stdin)?;
    let runc_options = inner::runc_options(&options);
    let stdin_for_runc: &[u8] = if runc_options.is_some() {
        &options
    } else {
        &[]
    };
    let runc = RuncShim::locate(publish_binary).ok();
    let from_runc = runc
        .as_ref()
        .and_then(|r| r.info(stdin_for_runc).ok())
        .and_then(|bytes| RuntimeInfo::parse_from_bytes(&bytes).ok());
    let mut info = from_runc.clone().unwrap_or_default();
    if let Some(theirs) = &from_runc {
        let version = theirs
            .version
            .as_ref()
            .map(|v| v.version.clone())
            .unwrap_or_default();
        info.annotations.insert(
            RUNC_SHIM_ANNOTATION.into(),
            format!("{} {version}", theirs.name).trim().to_owned(),
        );
    } else if runc_options.is_some() {
        info.options = MessageField::some(
            containerd_shim::protos::protobuf::well_known_types::any::Any::parse_from_bytes(
                &options,
            )
            .unwrap_or_default(),
        );
    }
    info.name = RUNTIME_ID.into();
    info.version = MessageField::some(RuntimeVersion {
        version: VERSION.into(),
        ..Default::default()
    });
    info.write_to_bytes().map_err(AboutError::Encode)
}
