//! A blocking client for the control socket: no async runtime, so short-lived
//! tools (hook, wrapper, CLI) and the interposer can all use it.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::frame::{read_message, write_message, FrameError};
use crate::lease::{Lease, LeaseId};
use crate::message::{ControlRequest, ControlResponse, ErrorKind, ReserveRequest, StatusReport};
use crate::PROTOCOL_VERSION;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the gpushare arbiter at {path}: {source} (is gpushare-arbiter running?)"
    )]
    Connect { path: PathBuf, source: io::Error },
    #[error("talking to the gpushare arbiter: {0}")]
    Frame(#[from] FrameError),
    #[error(
        "the gpushare arbiter speaks protocol {theirs}, this client speaks {PROTOCOL_VERSION}"
    )]
    Version { theirs: u32 },
    #[error("{message}")]
    Refused { kind: ErrorKind, message: String },
    #[error("unexpected answer from the gpushare arbiter: {0:?}")]
    Unexpected(Box<ControlResponse>),
}

pub struct ControlClient {
    stream: UnixStream,
}

impl ControlClient {
    /// `timeout` bounds every read and write, so a wedged arbiter cannot hang a
    /// container start (runc hooks have no timeout of their own).
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let connect_err = |source| ClientError::Connect {
            path: path.to_owned(),
            source,
        };
        let stream = UnixStream::connect(path).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(connect_err)?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(connect_err)?;
        let mut client = ControlClient { stream };
        match client.call(&ControlRequest::Hello {
            protocol: PROTOCOL_VERSION,
        })? {
            ControlResponse::Hello { protocol } if protocol == PROTOCOL_VERSION => Ok(client),
            ControlResponse::Hello { protocol } => Err(ClientError::Version { theirs: protocol }),
            other => Err(unexpected(other)),
        }
    }

    pub fn call(&mut self, request: &ControlRequest) -> Result<ControlResponse, ClientError> {
        write_message(&mut self.stream, request)?;
        match read_message(&mut self.stream)? {
            ControlResponse::Error { kind, message } => Err(ClientError::Refused { kind, message }),
            response => Ok(response),
        }
    }

    pub fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, ClientError> {
        match self.call(&ControlRequest::Reserve(request))? {
            ControlResponse::Reserved { lease } => Ok(lease),
            other => Err(unexpected(other)),
        }
    }

    pub fn confirm(&mut self, container_id: String, pid: u32) -> Result<(), ClientError> {
        match self.call(&ControlRequest::Confirm { container_id, pid })? {
            ControlResponse::Confirmed => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Returns whether the lease still existed; releasing twice is not an error.
    pub fn release(&mut self, lease: LeaseId) -> Result<bool, ClientError> {
        match self.call(&ControlRequest::Release { lease })? {
            ControlResponse::Released { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }

    pub fn bind(
        &mut self,
        lease: LeaseId,
        container_id: String,
        pid: u32,
    ) -> Result<(), ClientError> {
        match self.call(&ControlRequest::Bind {
            lease,
            container_id,
            pid,
        })? {
            ControlResponse::Confirmed => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    pub fn release_container(&mut self, container_id: String) -> Result<bool, ClientError> {
        match self.call(&ControlRequest::ReleaseContainer { container_id })? {
            ControlResponse::Released { existed } => Ok(existed),
            other => Err(unexpected(other)),
        }
    }

    pub fn status(&mut self) -> Result<StatusReport, ClientError> {
        match self.call(&ControlRequest::Status)? {
            ControlResponse::Status(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(response: ControlResponse) -> ClientError {
    ClientError::Unexpected(Box::new(response))
}
