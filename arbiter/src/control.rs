//! The root-only control socket: reserve, confirm, bind, release, drain, status.
//! Every change is answered only once the lease store says it is durable.
//!
//! Bounded like the lease sockets, though only root can connect: a runaway
//! tool must not exhaust the arbiter. At most `MAX_CONTROL_CONNECTIONS` at once;
//! the hello must come within `HELLO_TIMEOUT`, and a frame once begun must be
//! finished (and an answer taken) within `FRAME_TIMEOUT`. A reserve whose client
//! disconnects while it waits in the admission queue is withdrawn.
//!
//! Root must reach the arbiter even when something else took every descriptor
//! (the other listeners are bounded, but a bound can be misjudged): one
//! descriptor is held in reserve and closed to accept root's connection when an
//! accept fails with EMFILE/ENFILE. Other accept failures wait, doubling up to a
//! second, rather than spin.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::lease_socket::HELLO_TIMEOUT;
use gpushare_proto::{ContainerRef, ControlRequest, ControlResponse, ErrorKind, PROTOCOL_VERSION};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::connections::{out_of_descriptors, say_and_close, AcceptFailures};
use crate::server::{read_frame, read_started_frame, write_frame, ServerError, FRAME_TIMEOUT};
use crate::state::{ArbiterHandle, StateError};

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

/// Control connections served at once. Each container start in progress holds
/// one (the wrapper's reserve waits in the admission queue up to
/// `admission_wait_ms`), plus hooks, shims and gpusharectl: a node starts tens of
/// containers at once, not hundreds, so 512 never refuses real work, while it
/// caps what a runaway root tool can take (a task, a descriptor and up to one
/// 1 MiB frame each) well inside the descriptor headroom kept for this socket.
pub const MAX_CONTROL_CONNECTIONS: usize = 512;

/// One descriptor held back for the control socket: when the process has none
/// left (whatever took them), it is closed so that root's next connection can
/// still be accepted, and taken again once descriptors are free.
struct ReserveDescriptor(Option<fs::File>);

impl ReserveDescriptor {
    fn take() -> ReserveDescriptor {
        ReserveDescriptor(fs::File::open("/dev/null").ok())
    }

    /// Gives the descriptor back to the process; false when it was already.
    fn release(&mut self) -> bool {
        self.0.take().is_some()
    }

    fn restore(&mut self) {
        if self.0.is_none() {
            self.0 = fs::File::open("/dev/null").ok();
        }
    }
}

/// Serves the control socket until the task is stopped; the connections in
/// flight end with it (they are this task's).
pub async fn serve(listener: UnixListener, arbiter: ArbiterHandle) {
    let slots = Arc::new(Semaphore::new(MAX_CONTROL_CONNECTIONS));
    let mut connections = JoinSet::new();
    let mut refused: u64 = 0;
    let mut reserve = ReserveDescriptor::take();
    let mut failures = AcceptFailures::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => {
                reserve.restore();
                continue;
            }
        };
        match accepted {
            Ok((stream, _)) => {
                failures.accepted();
                reserve.restore();
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            limit = MAX_CONTROL_CONNECTIONS,
                            refused,
                            "too many control connections; refusing"
                        );
                    }
                    let message = format!(
                        "too many control connections ({MAX_CONTROL_CONNECTIONS} open); try again"
                    );
                    if let (Ok(bytes), Ok(socket)) = (
                        frame::encode(&error_response(ErrorKind::Internal, message)),
                        stream.into_std(),
                    ) {
                        say_and_close(socket, &bytes);
                    }
                    continue;
                };
                let arbiter = arbiter.clone();
                connections.spawn(async move {
                    if let Err(e) = handle_control(stream, arbiter).await {
                        tracing::debug!(error = %e, "control connection closed");
                    }
                    drop(permit);
                });
            }
            // Out of descriptors: the reserve makes room for root's connection
            // waiting in the backlog, which the next accept takes.
            Err(e) if out_of_descriptors(&e) && reserve.release() => {
                tracing::warn!(error = %e, "out of descriptors; using the control socket's reserve");
            }
            Err(e) => failures.wait_after(&"control socket", &e).await,
        }
    }
}

fn error_response(kind: ErrorKind, message: String) -> ControlResponse {
    ControlResponse::Error { kind, message }
}

fn timed_out(what: String) -> FrameError {
    FrameError::Io(io::Error::new(io::ErrorKind::TimedOut, what))
}

/// The next request. Before the hello, the whole frame must come within
/// `HELLO_TIMEOUT`; after it, a client may stay idle between requests (a root
/// tool holding its connection), but a frame once begun must be finished within
/// `FRAME_TIMEOUT`, so half a frame cannot hold a connection slot for ever.
async fn read_request(
    stream: &mut UnixStream,
    greeted: bool,
) -> Result<ControlRequest, FrameError> {
    if !greeted {
        return tokio::time::timeout(HELLO_TIMEOUT, read_frame(stream))
            .await
            .map_err(|_| timed_out(format!("no hello within {} s", HELLO_TIMEOUT.as_secs())))?;
    }
    read_started_frame(stream, frame::MAX_FRAME_BYTES).await
}

/// An answer the client does not take within `FRAME_TIMEOUT` closes the connection.
async fn answer(stream: &mut UnixStream, response: &ControlResponse) -> Result<(), FrameError> {
    tokio::time::timeout(FRAME_TIMEOUT, write_frame(stream, response))
        .await
        .map_err(|_| {
            timed_out(format!(
                "the client took no answer within {} s",
                FRAME_TIMEOUT.as_secs()
            ))
        })?
}

/// Resolves when the client hangs up (true), or sends something while it should
/// be waiting for an answer (false: stop watching). Peeks, so nothing is consumed.
async fn hung_up(stream: &UnixStream) -> bool {
    loop {
        if stream.readable().await.is_err() {
            return true;
        }
        let mut byte = [0u8; 1];
        let peeked = stream.try_io(Interest::READABLE, || {
            // SAFETY: recv into a live one-byte buffer on the stream's own descriptor.
            let n = unsafe {
                libc::recv(
                    stream.as_raw_fd(),
                    byte.as_mut_ptr().cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n)
            }
        });
        match peeked {
            Ok(0) => return true,
            Ok(_) => return false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => return true,
        }
    }
}

async fn handle_control(mut stream: UnixStream, arbiter: ArbiterHandle) -> Result<(), FrameError> {
    let admission_wait_ms = arbiter.admission_wait_ms();
    let mut greeted = false;
    loop {
        let request: ControlRequest = match read_request(&mut stream, greeted).await {
            Ok(r) => r,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => {
                let _ = answer(
                    &mut stream,
                    &error_response(ErrorKind::Protocol, e.to_string()),
                )
                .await;
                return Err(e);
            }
        };
        let response = match (&request, greeted) {
            (ControlRequest::Hello { protocol }, false) => {
                let hello = ControlResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                    admission_wait_ms: Some(admission_wait_ms),
                };
                if *protocol != PROTOCOL_VERSION {
                    answer(&mut stream, &hello).await?;
                    tracing::info!(theirs = protocol, "client speaks another protocol version");
                    return Ok(());
                }
                greeted = true;
                hello
            }
            (_, false) => {
                let e = error_response(
                    ErrorKind::Protocol,
                    "the first message must be hello".into(),
                );
                answer(&mut stream, &e).await?;
                return Ok(());
            }
            (ControlRequest::Hello { .. }, true) => {
                let e = error_response(ErrorKind::Protocol, "hello sent twice".into());
                answer(&mut stream, &e).await?;
                return Ok(());
            }
            (_, true) => match dispatch(&arbiter, request, &stream).await {
                Some(response) => response,
                None => return Ok(()),
            },
        };
        answer(&mut stream, &response).await?;
    }
}

fn refused(e: StateError) -> ControlResponse {
    error_response(e.kind(), e.to_string())
}

/// Runs one request; a change is answered only once it is durable (the handle
/// waits). None: the client hung up while its reserve waited (nobody to answer).
async fn dispatch(
    arbiter: &ArbiterHandle,
    request: ControlRequest,
    stream: &UnixStream,
) -> Option<ControlResponse> {
    let answer = match request {
        ControlRequest::Reserve(r) => match arbiter.reserve(r, hung_up(stream)).await {
            Ok(None) => return None,
            Ok(Some(lease)) => Ok(ControlResponse::Reserved { lease }),
            Err(e) => Err(e),
        },
        ControlRequest::Confirm {
            container_id,
            pid,
            namespace,
            lease,
        } => {
            let container = ContainerRef {
                container_id,
                namespace,
                lease,
            };
            arbiter.confirm(&container, pid).await.map(|()| {
                tracing::info!(container = container.container_id, pid, "confirmed");
                ControlResponse::Confirmed
            })
        }
        ControlRequest::Bind {
            lease,
            container_id,
            pid,
        } => arbiter.bind(&lease, &container_id, pid).await.map(|()| {
            tracing::info!(%lease, container = container_id, pid, "confirmed");
            ControlResponse::Confirmed
        }),
        ControlRequest::Release { lease } => arbiter.release(&lease).await.map(|existed| {
            if existed {
                tracing::info!(%lease, "released");
            }
            ControlResponse::Released { existed }
        }),
        ControlRequest::ReleaseContainer {
            container_id,
            namespace,
            lease,
        } => {
            let container = ContainerRef {
                container_id,
                namespace,
                lease,
            };
            arbiter.release_container(&container).await.map(|existed| {
                if existed {
                    tracing::info!(container = container.container_id, "released");
                }
                ControlResponse::Released { existed }
            })
        }
        ControlRequest::Status => Ok(ControlResponse::Status(Box::new(arbiter.status()))),
        ControlRequest::List => Ok(ControlResponse::Leases {
            leases: arbiter.list(),
        }),
        ControlRequest::Drain { gpu, drain } => arbiter.drain(&gpu, drain).await.map(|uuid| {
            tracing::info!(gpu = uuid, drained = drain, "drain changed");
            ControlResponse::Drained {
                gpu: uuid,
                drained: drain,
            }
        }),
        ControlRequest::Grant(request) => arbiter
            .grant(request)
            .await
            .map(|grant| ControlResponse::Granted { grant }),
        ControlRequest::Timeline { since_ms } => {
            Ok(ControlResponse::Timeline(arbiter.timeline(since_ms)))
        }
        ControlRequest::Grants => Ok(ControlResponse::Grants {
            grants: arbiter.grants(),
        }),
        ControlRequest::ReleaseGrant { id } => arbiter
            .release_grant(&id)
            .await
            .map(|existed| ControlResponse::GrantReleased { existed }),
        ControlRequest::Hello { .. } => unreachable!("hello is handled by the connection"),
    };
    Some(answer.unwrap_or_else(refused))
}
