//! The arbiter, from async code: its client is blocking (no runtime, for the hooks
//! and the interposer), so every call runs on tokio's blocking pool.
//!
//! One connection is kept between calls: a fresh one costs a connect and the hello
//! exchange on top of the request (kube/benches/allocate.rs measures both). A
//! kept connection the arbiter has since closed (it restarted, or dropped an idle
//! client) fails at once, and the call is made again on a fresh one; that is safe
//! for every call made here: a repeated grant names the same device ids, so the
//! arbiter lets it supersede the first, and releases are idempotent.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare_proto::client::ClientError;
use gpushare_proto::grant::{Grant, GrantId, GrantRequest};
use gpushare_proto::message::{ErrorKind, StatusReport};
use gpushare_proto::ControlClient;

#[derive(Debug, thiserror::Error)]
pub enum ArbiterError {
    /// Connecting, or the connection broke: the arbiter is down or restarting.
    #[error("the gpushare arbiter at {} is unreachable: {source}", socket.display())]
    Unreachable {
        socket: PathBuf,
        #[source]
        source: ClientError,
    },
    #[error("the gpushare arbiter refused {what} ({kind:?}): {message}")]
    Refused {
        what: &'static str,
        kind: ErrorKind,
        message: String,
    },
    #[error("the call to the gpushare arbiter ({what}) did not finish: {source}")]
    Aborted {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

#[derive(Clone)]
pub struct Arbiter {
    pub socket: PathBuf,
    pub timeout: Duration,
    kept: Arc<Mutex<Option<ControlClient>>>,
}

impl std::fmt::Debug for Arbiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arbiter")
            .field("socket", &self.socket)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Arbiter {
    pub fn new(socket: PathBuf, timeout: Duration) -> Arbiter {
        Arbiter {
            socket,
            timeout,
            kept: Arc::default(),
        }
    }

    async fn call<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl Fn(&mut ControlClient) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, ArbiterError> {
        let (socket, timeout, kept) = (self.socket.clone(), self.timeout, self.kept.clone());
        tokio::task::spawn_blocking(move || {
            // The arbiter answered, refusing or not: the connection is good to keep.
            let answered =
                |r: &Result<T, ClientError>| matches!(r, Ok(_) | Err(ClientError::Refused { .. }));
            let taken = kept.lock().unwrap_or_else(|e| e.into_inner()).take();
            let mut good = None;
            let mut answer = None;
            if let Some(mut client) = taken {
                let r = f(&mut client);
                if answered(&r) {
                    answer = Some(r);
                    good = Some(client);
                }
            }
            let answer = match answer {
                Some(r) => r,
                None => ControlClient::connect(&socket, timeout).and_then(|mut client| {
                    let r = f(&mut client);
                    if answered(&r) {
                        good = Some(client);
                    }
                    r
                }),
            };
            if let Some(client) = good {
                kept.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(client);
            }
            answer.map_err(|e| match e {
                ClientError::Refused { kind, message } => ArbiterError::Refused {
                    what,
                    kind,
                    message,
                },
                source => ArbiterError::Unreachable { socket, source },
            })
        })
        .await
        .map_err(|source| ArbiterError::Aborted { what, source })?
    }

    pub async fn status(&self) -> Result<StatusReport, ArbiterError> {
        self.call("a status report", |c| c.status()).await
    }

    pub async fn grant(&self, request: GrantRequest) -> Result<Grant, ArbiterError> {
        self.call("a grant", move |c| c.grant(request.clone()))
            .await
    }

    pub async fn grants(&self) -> Result<Vec<Grant>, ArbiterError> {
        self.call("the list of grants", |c| c.grants()).await
    }

    pub async fn release_grant(&self, id: GrantId) -> Result<bool, ArbiterError> {
        self.call("a grant's release", move |c| c.release_grant(id.clone()))
            .await
    }
}
