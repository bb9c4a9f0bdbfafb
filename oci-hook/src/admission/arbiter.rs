//! The arbiter as admission sees it: three calls behind a trait, so admission is
//! tested against a recording fake (`super::tests`) and runs against the control
//! socket.

use std::path::PathBuf;
use std::time::Duration;

use gpushare_config::ArbiterConfig;
use gpushare_proto::{
    ClientError, ContainerRef, ControlClient, Lease, ReserveRequest, StatusReport,
};

/// What admission asks of the arbiter.
pub trait Arbiter {
    /// The driver's CUDA version and the leases granted (to check a marker).
    fn status(&mut self) -> Result<StatusReport, ClientError>;
    /// Places the request on a GPU; may wait in the arbiter's admission queue.
    fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, ClientError>;
    /// Releases the lease of `holder`; whether there was one.
    fn release(&mut self, holder: ContainerRef) -> Result<bool, ClientError>;
}

/// The arbiter's control socket, connected on first use: a container that asks
/// for nothing never needs the arbiter. A connection whose exchange failed is
/// dropped (its late answer may still arrive) and the next call opens a new one;
/// a refusal is an answer and keeps it.
pub struct ControlSocket {
    path: PathBuf,
    timeout: Duration,
    connection: Option<ControlClient>,
}

impl ControlSocket {
    pub fn new(config: &ArbiterConfig) -> Self {
        Self::at(config.control_socket(), config.client_timeout())
    }

    pub fn at(path: PathBuf, timeout: Duration) -> Self {
        ControlSocket {
            path,
            timeout,
            connection: None,
        }
    }

    /// Runs one call on the connection, opening it first if needed.
    pub fn with<T>(
        &mut self,
        call: impl FnOnce(&mut ControlClient) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let client = match &mut self.connection {
            Some(client) => client,
            None => self
                .connection
                .insert(ControlClient::connect(&self.path, self.timeout)?),
        };
        let answer = call(client);
        if matches!(&answer, Err(e) if !matches!(e, ClientError::Refused { .. })) {
            self.connection = None;
        }
        answer
    }
}

impl Arbiter for ControlSocket {
    fn status(&mut self) -> Result<StatusReport, ClientError> {
        self.with(ControlClient::status)
    }

    fn reserve(&mut self, request: ReserveRequest) -> Result<Lease, ClientError> {
        self.with(|c| c.reserve(request))
    }

    fn release(&mut self, holder: ContainerRef) -> Result<bool, ClientError> {
        self.with(|c| c.release_container_in(holder))
    }
}
