//! The root-only control socket: reserve, confirm, bind, release, drain, status.
//! Every change is answered only once the lease store says it is durable.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::frame::FrameError;
use gpushare_proto::{ControlRequest, ControlResponse, ErrorKind, PROTOCOL_VERSION};
use tokio::net::{UnixListener, UnixStream};

use crate::server::{lock, read_frame, write_frame, ServerError, SharedArbiter};
use crate::state::StateError;
use crate::store::LeaseStore;

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
                    if let Err(e) = handle_control(stream, arbiter).await {
                        tracing::debug!(error = %e, "control connection closed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn error_response(kind: ErrorKind, message: String) -> ControlResponse {
    ControlResponse::Error { kind, message }
}

async fn handle_control(mut stream: UnixStream, arbiter: SharedArbiter) -> Result<(), FrameError> {
    let admission_wait_ms = lock(&arbiter).config().admission_wait_ms;
    let mut greeted = false;
    loop {
        let request: ControlRequest = match read_frame(&mut stream).await {
            Ok(r) => r,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => {
                let _ = write_frame(
                    &mut stream,
                    &error_response(ErrorKind::Protocol, e.to_string()),
                )
                .await;
                return Err(e);
            }
        };
        let response = match (&request, greeted) {
            (ControlRequest::Hello { protocol }, false) => {
                let answer = ControlResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                    admission_wait_ms: Some(admission_wait_ms),
                };
                if *protocol != PROTOCOL_VERSION {
                    write_frame(&mut stream, &answer).await?;
                    tracing::info!(theirs = protocol, "client speaks another protocol version");
                    return Ok(());
                }
                greeted = true;
                answer
            }
            (_, false) => {
                let e = error_response(
                    ErrorKind::Protocol,
                    "the first message must be hello".into(),
                );
                write_frame(&mut stream, &e).await?;
                return Ok(());
            }
            (ControlRequest::Hello { .. }, true) => {
                let e = error_response(ErrorKind::Protocol, "hello sent twice".into());
                write_frame(&mut stream, &e).await?;
                return Ok(());
            }
            (_, true) => dispatch(&arbiter, request).await,
        };
        write_frame(&mut stream, &response).await?;
    }
}

fn refused(e: StateError) -> ControlResponse {
    error_response(e.kind(), e.to_string())
}

/// Runs one request; a change is answered only once it is durable.
async fn dispatch(arbiter: &SharedArbiter, request: ControlRequest) -> ControlResponse {
    let store: Arc<LeaseStore> = lock(arbiter).store().clone();
    let durable = |ticket| {
        let store = store.clone();
        async move {
            match ticket {
                Some(t) => store.wait(t).await.map_err(StateError::from),
                None => Ok(()),
            }
        }
    };
    match request {
        ControlRequest::Reserve(r) => {
            let refusal = lock(arbiter).unshareable_refusal(&r.gpu);
            if let Some(message) = refusal {
                tracing::warn!(container = %r.container_id, "refused: {message}");
                return error_response(ErrorKind::InvalidRequest, message);
            }
            let reply = lock(arbiter).submit(r, Instant::now());
            let granted = match reply.await {
                Ok(Ok(g)) => g,
                Ok(Err(e)) => return refused(e),
                Err(_) => {
                    return error_response(ErrorKind::Internal, "the reserve was dropped".into())
                }
            };
            match durable(granted.ticket).await {
                Ok(()) => ControlResponse::Reserved {
                    lease: granted.lease,
                },
                Err(e) => refused(e),
            }
        }
        ControlRequest::Confirm { container_id, pid } => {
            let ticket = lock(arbiter).confirm(&container_id, pid);
            match ticket {
                Ok(t) => match durable(t).await {
                    Ok(()) => {
                        tracing::info!(container = container_id, pid, "confirmed");
                        ControlResponse::Confirmed
                    }
                    Err(e) => refused(e),
                },
                Err(e) => refused(e),
            }
        }
        ControlRequest::Release { lease } => {
            let result = lock(arbiter).release(&lease);
            released(result, durable, format!("lease {lease}")).await
        }
        ControlRequest::Bind {
            lease,
            container_id,
            pid,
        } => {
            let result = lock(arbiter).bind(&lease, &container_id, pid);
            match result {
                Ok(t) => match durable(t).await {
                    Ok(()) => {
                        tracing::info!(%lease, container = container_id, pid, "bound and confirmed");
                        ControlResponse::Confirmed
                    }
                    Err(e) => refused(e),
                },
                Err(e) => refused(e),
            }
        }
        ControlRequest::ReleaseContainer { container_id } => {
            let result = lock(arbiter).release_container(&container_id);
            released(result, durable, format!("container {container_id}")).await
        }
        ControlRequest::Status => ControlResponse::Status(lock(arbiter).status()),
        ControlRequest::List => ControlResponse::Leases {
            leases: lock(arbiter).list(),
        },
        ControlRequest::Drain { gpu, drain } => {
            let result = lock(arbiter).drain(&gpu, drain);
            match result {
                Ok((uuid, ticket)) => match durable(Some(ticket)).await {
                    Ok(()) => {
                        tracing::info!(gpu = uuid, drained = drain, "drain changed");
                        ControlResponse::Drained {
                            gpu: uuid,
                            drained: drain,
                        }
                    }
                    Err(e) => refused(e),
                },
                Err(e) => refused(e),
            }
        }
        ControlRequest::Hello { .. } => unreachable!("hello is handled by the connection"),
    }
}

async fn released<F, Fut>(
    result: Result<(bool, Option<crate::store::Ticket>), StateError>,
    durable: F,
    what: String,
) -> ControlResponse
where
    F: FnOnce(Option<crate::store::Ticket>) -> Fut,
    Fut: std::future::Future<Output = Result<(), StateError>>,
{
    match result {
        Ok((existed, ticket)) => match durable(ticket).await {
            Ok(()) => {
                if existed {
                    tracing::info!(what, "released");
                }
                ControlResponse::Released { existed }
            }
            Err(e) => refused(e),
        },
        Err(e) => refused(e),
    }
}
