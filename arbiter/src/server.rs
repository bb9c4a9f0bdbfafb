//! The control socket: root-only, one task per connection.
//!
//! A connection that breaks the protocol (bad version, malformed or oversized
//! frame) gets one error answer and is closed; nothing else is affected.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::{ControlRequest, ControlResponse, ErrorKind, PROTOCOL_VERSION};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::state::Arbiter;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("another gpushare-arbiter is already serving {0}")]
    AlreadyRunning(PathBuf),
    #[error("control socket {path}: {source}")]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type SharedArbiter = Arc<Mutex<Arbiter>>;

/// Binds the control socket with mode 0600 (only root may reserve or release).
pub fn bind_control_socket(path: &Path) -> Result<UnixListener, ServerError> {
    let err = |source| ServerError::Socket {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(err)?;
    }
    if path.exists() {
        // A socket that still answers belongs to a live arbiter: never steal it.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServerError::AlreadyRunning(path.to_owned()));
        }
        fs::remove_file(path).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(listener)
}

pub async fn serve(listener: UnixListener, arbiter: SharedArbiter) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let arbiter = arbiter.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle_connection(stream, arbiter).await {
                        tracing::debug!(error = %e, "control connection closed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn read_request(stream: &mut UnixStream) -> Result<ControlRequest, FrameError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await?;
    let mut body = vec![0u8; frame::body_len(header)?];
    stream.read_exact(&mut body).await?;
    frame::decode(&body)
}

async fn write_response(
    stream: &mut UnixStream,
    response: &ControlResponse,
) -> Result<(), FrameError> {
    stream.write_all(&frame::encode(response)?).await?;
    Ok(())
}

async fn handle_connection(
    mut stream: UnixStream,
    arbiter: SharedArbiter,
) -> Result<(), FrameError> {
    let mut greeted = false;
    loop {
        let request = match read_request(&mut stream).await {
            Ok(r) => r,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => {
                let _ = write_response(&mut stream, &protocol_error(format!("{e}"))).await;
                return Err(e);
            }
        };
        let response = match (&request, greeted) {
            (ControlRequest::Hello { protocol }, false) if *protocol == PROTOCOL_VERSION => {
                greeted = true;
                ControlResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                }
            }
            (ControlRequest::Hello { protocol }, false) => {
                let answer = ControlResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                };
                write_response(&mut stream, &answer).await?;
                tracing::info!(theirs = protocol, "client speaks another protocol version");
                return Ok(());
            }
            (_, false) => {
                write_response(
                    &mut stream,
                    &protocol_error("the first message must be hello".into()),
                )
                .await?;
                return Ok(());
            }
            (ControlRequest::Hello { .. }, true) => {
                write_response(&mut stream, &protocol_error("hello sent twice".into())).await?;
                return Ok(());
            }
            (_, true) => {
                let arbiter = arbiter.clone();
                tokio::task::spawn_blocking(move || dispatch(&arbiter, request))
                    .await
                    .unwrap_or_else(|e| internal_error(format!("handler failed: {e}")))
            }
        };
        write_response(&mut stream, &response).await?;
    }
}

/// Lease changes persist to disk (fsync), so they run off the async workers.
fn dispatch(arbiter: &SharedArbiter, request: ControlRequest) -> ControlResponse {
    let mut arbiter = match arbiter.lock() {
        Ok(guard) => guard,
        // A panic mid-change never left memory ahead of disk (every change persists
        // before it is visible), so the table is still the durable one.
        Err(poisoned) => poisoned.into_inner(),
    };
    let result = match request {
        ControlRequest::Reserve(r) => {
            let container = r.container_id.clone();
            arbiter.reserve(r).map(|lease| {
                tracing::info!(lease = %lease.id, container, gpus = ?lease.gpus, memory = lease.memory_bytes, priority = %lease.priority, "reserved");
                ControlResponse::Reserved { lease }
            })
        }
        ControlRequest::Confirm { container_id, pid } => {
            arbiter.confirm(&container_id, pid).map(|()| {
                tracing::info!(container = container_id, pid, "confirmed");
                ControlResponse::Confirmed
            })
        }
        ControlRequest::Release { lease } => arbiter.release(&lease).map(|existed| {
            tracing::info!(%lease, existed, "released");
            ControlResponse::Released { existed }
        }),
        ControlRequest::Bind {
            lease,
            container_id,
            pid,
        } => arbiter.bind(&lease, &container_id, pid).map(|()| {
            tracing::info!(%lease, container = container_id, pid, "bound and confirmed");
            ControlResponse::Confirmed
        }),
        ControlRequest::ReleaseContainer { container_id } => {
            arbiter.release_container(&container_id).map(|existed| {
                tracing::info!(container = container_id, existed, "released by container");
                ControlResponse::Released { existed }
            })
        }
        ControlRequest::Status => Ok(ControlResponse::Status(arbiter.status())),
        ControlRequest::Hello { .. } => unreachable!("hello is handled by the connection"),
    };
    result.unwrap_or_else(|e| ControlResponse::Error {
        kind: e.kind(),
        message: e.to_string(),
    })
}

fn protocol_error(message: String) -> ControlResponse {
    ControlResponse::Error {
        kind: ErrorKind::Protocol,
        message,
    }
}

fn internal_error(message: String) -> ControlResponse {
    ControlResponse::Error {
        kind: ErrorKind::Internal,
        message,
    }
}
