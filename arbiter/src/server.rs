//! The lease sockets: one per lease, one task per connection; the control socket
//! is in `control`, the periodic work in `background`.
//!
//! The state opens and closes lease sockets under its lock and tells this module
//! so on a channel ([`EndpointEvent`]); the task that serves them holds the
//! state's handle. A socket is bound (and so connectable) before its lease is
//! acknowledged, and its connections wait in the listen backlog until it is served.
//!
//! A connection that breaks the protocol (bad version, malformed, oversized or
//! out-of-order frame) gets one error answer and is closed; nothing else is
//! affected. A lease-socket client is identified by the socket it came through
//! and by SO_PEERCRED, never by anything it says.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::lease_socket::{HELLO_TIMEOUT, MAX_LEASE_REQUEST_BYTES};
use gpushare_proto::{ErrorKind, LeaseId, LeaseRequest, LeaseResponse, PROTOCOL_VERSION};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use crate::connections::{say_and_close, AcceptFailures, ConnectionBudget, Permit, Refusal};
use crate::lease_connection::{self, Phase, Step};
use crate::state::{ArbiterHandle, LeaseDirs, LeaseEndpoints, StateError};
use crate::tokens::{TokenLease, TokenService};

/// Name of the socket inside each lease directory (`/run/gpushare/arbiter.sock`
/// in the container).
pub const LEASE_SOCKET: &str = "arbiter.sock";

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

// ----- framing over tokio -----

pub(crate) async fn read_frame<T: DeserializeOwned>(
    stream: &mut UnixStream,
) -> Result<T, FrameError> {
    read_frame_within(stream, frame::MAX_FRAME_BYTES).await
}

pub(crate) async fn read_frame_within<T: DeserializeOwned>(
    stream: &mut UnixStream,
    limit: usize,
) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).await?;
    let mut body = vec![0u8; frame::body_len_within(header, limit)?];
    stream.read_exact(&mut body).await?;
    frame::decode(&body)
}

/// A frame that may be long in coming (an idle ledger connection waits for its
/// process's next allocation) but, once begun, must be complete within
/// [`FRAME_TIMEOUT`].
pub(crate) async fn read_started_frame<T: DeserializeOwned>(
    stream: &mut UnixStream,
    limit: usize,
) -> Result<T, FrameError> {
    let mut header = [0u8; 4];
    if stream.read(&mut header[..1]).await? == 0 {
        return Err(FrameError::Closed);
    }
    let rest = async {
        stream.read_exact(&mut header[1..]).await?;
        let mut body = vec![0u8; frame::body_len_within(header, limit)?];
        stream.read_exact(&mut body).await?;
        frame::decode(&body)
    };
    match tokio::time::timeout(FRAME_TIMEOUT, rest).await {
        Ok(read) => read,
        Err(_) => Err(FrameError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "a frame begun and not finished within {} s",
                FRAME_TIMEOUT.as_secs()
            ),
        ))),
    }
}

pub(crate) async fn write_frame<T: Serialize>(
    stream: &mut UnixStream,
    message: &T,
) -> Result<(), FrameError> {
    stream.write_all(&frame::encode(message)?).await?;
    Ok(())
}

// ----- lease sockets -----

static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

/// What the state did to a lease's socket.
#[derive(Debug)]
pub enum EndpointEvent {
    /// Bound and listening: serve it.
    Opened {
        lease: LeaseId,
        listener: UnixListener,
    },
    /// Released: stop serving it and drop its connections.
    Closed { lease: LeaseId },
}

pub type EndpointEvents = mpsc::UnboundedReceiver<EndpointEvent>;

/// Creates each lease's directory and socket, and tells [`serve_lease_sockets`].
pub struct SocketEndpoints {
    dirs: LeaseDirs,
    runtime: tokio::runtime::Handle,
    events: mpsc::UnboundedSender<EndpointEvent>,
    open: HashSet<LeaseId>,
    tokens: Arc<TokenService>,
}

impl SocketEndpoints {
    /// The endpoints and the events [`serve_lease_sockets`] serves: unbounded, so
    /// the state never waits under its lock (one event per lease change).
    pub fn new(
        run_dir: PathBuf,
        runtime: tokio::runtime::Handle,
        tokens: Arc<TokenService>,
    ) -> (Self, EndpointEvents) {
        let (events, received) = mpsc::unbounded_channel();
        let endpoints = SocketEndpoints {
            dirs: LeaseDirs { run_dir },
            runtime,
            events,
            open: HashSet::new(),
            tokens,
        };
        (endpoints, received)
    }
}

impl LeaseEndpoints for SocketEndpoints {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError> {
        if self.open.contains(lease) {
            return Ok(());
        }
        let dir = self.dirs.create(lease)?;
        let path = dir.join(LEASE_SOCKET);
        let err = |source| StateError::LeaseDir {
            path: path.clone(),
            source,
        };
        // A socket file left by the previous arbiter is dead: its listener died with it.
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
            _ => {}
        }
        let std_listener = std::os::unix::net::UnixListener::bind(&path).map_err(err)?;
        // Any uid inside the container may connect; only that container sees this directory.
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).map_err(err)?;
        std_listener.set_nonblocking(true).map_err(err)?;
        let listener = {
            let _guard = self.runtime.enter();
            UnixListener::from_std(std_listener).map_err(err)?
        };
        // Nobody serving any more (the daemon is stopping): the listener is dropped
        // and the socket refuses, as it would after a kill.
        let _ = self.events.send(EndpointEvent::Opened {
            lease: lease.clone(),
            listener,
        });
        self.open.insert(lease.clone());
        Ok(())
    }

    fn close(&mut self, lease: &LeaseId) {
        if self.open.remove(lease) {
            let _ = self.events.send(EndpointEvent::Closed {
                lease: lease.clone(),
            });
        }
        // Token connections live on threads of their own, out of the task's reach.
        self.tokens.close_lease(lease);
        self.dirs.remove(lease);
    }
}

/// How often a refused flood is logged: the first refusal, then a summary at most
/// this often, so a container that floods its socket cannot flood the log too.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Once a frame has begun, the rest of it must arrive within this: a client that
/// sends half a frame and then nothing is dropped rather than kept for ever.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

/// Each lease's accept loop; dropping it (a stop) aborts them all, and with them
/// every connection they hold.
#[derive(Default)]
struct AcceptLoops(HashMap<LeaseId, JoinHandle<()>>);

impl Drop for AcceptLoops {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.abort();
        }
    }
}

/// Serves every lease socket the state opens until the state is gone or this
/// task is stopped.
pub async fn serve_lease_sockets(
    mut events: EndpointEvents,
    arbiter: ArbiterHandle,
    tokens: Arc<TokenService>,
) {
    let mut accepting = AcceptLoops::default();
    while let Some(event) = events.recv().await {
        match event {
            EndpointEvent::Opened { lease, listener } => {
                let task = tokio::spawn(serve_lease(
                    listener,
                    lease.clone(),
                    arbiter.clone(),
                    tokens.clone(),
                ));
                if let Some(old) = accepting.0.insert(lease, task) {
                    old.abort();
                }
            }
            EndpointEvent::Closed { lease } => {
                // Aborting the accept loop drops its JoinSet, which aborts (and so
                // closes) every connection of the lease.
                if let Some(task) = accepting.0.remove(&lease) {
                    task.abort();
                }
            }
        }
    }
}

async fn serve_lease(
    listener: UnixListener,
    lease: LeaseId,
    arbiter: ArbiterHandle,
    tokens: Arc<TokenService>,
) {
    let budget = tokens.budget().clone();
    // The lease has a floor of connections for as long as its socket is served.
    let _live = budget.live(&lease);
    let mut connections = JoinSet::new();
    let mut refusals = RefusalLog::default();
    let mut failures = AcceptFailures::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    failures.accepted();
                    match admit_connection(stream, &lease, &arbiter, &budget) {
                        Err(Some(why)) => refusals.note(&lease, why, Instant::now(), &budget),
                        Err(None) => {}
                        Ok(admitted) => {
                            let lease = lease.clone();
                            let arbiter = arbiter.clone();
                            let tokens = tokens.clone();
                            connections.spawn(async move {
                                if let Err(e) = handle_lease_connection(admitted, &lease, &arbiter, &tokens).await {
                                    tracing::debug!(%lease, error = %e, "lease connection closed");
                                }
                            });
                        }
                    }
                }
                Err(e) => failures.wait_after(&lease, &e).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// A connection the accept loop admitted: its peer is inside the lease's
/// container, and it holds a place in the budget.
struct Admitted {
    stream: UnixStream,
    peer_pid: u32,
    permit: Permit,
}

/// Decides a new connection at once, in this order: the peer first, so that a
/// process outside the lease's container never holds one of its places, even
/// for a moment (a host flood would otherwise fill the lease's bound); then the
/// budget. Err(None): a foreign peer, already answered; Err(Some): no place left,
/// closed without an answer (the client sees the arbiter as unreachable and
/// retries with backoff under its loss policy, rather than taking a refusal as
/// "run ungated").
fn admit_connection(
    stream: UnixStream,
    lease: &LeaseId,
    arbiter: &ArbiterHandle,
    budget: &Arc<ConnectionBudget>,
) -> Result<Admitted, Option<Refusal>> {
    let peer_pid = match admit_peer(&stream, lease, arbiter) {
        Ok(pid) => pid,
        Err(why) => {
            budget.refused_peer();
            let refusal = lease_error(ErrorKind::PermissionDenied, why);
            if let (Ok(bytes), Ok(socket)) = (frame::encode(&refusal), stream.into_std()) {
                say_and_close(socket, &bytes);
            }
            return Err(None);
        }
    };
    let permit = budget.admit(lease).map_err(Some)?;
    Ok(Admitted {
        stream,
        peer_pid,
        permit,
    })
}

/// Logs the first refused connection of a burst and then a count at most every
/// [`REFUSAL_LOG_INTERVAL`].
#[derive(Default)]
struct RefusalLog {
    last: Option<Instant>,
    since_last: u64,
}

impl RefusalLog {
    /// Whether this refusal is logged (with the count since the last one logged).
    fn due(&mut self, now: Instant) -> Option<u64> {
        self.since_last += 1;
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since_last))
    }

    fn note(&mut self, lease: &LeaseId, why: Refusal, now: Instant, budget: &ConnectionBudget) {
        let Some(refused) = self.due(now) else {
            return;
        };
        let status = budget.status();
        match why {
            Refusal::LeaseLimit => {
                tracing::warn!(%lease, limit = status.per_lease_limit, refused, "too many connections on a lease socket; refusing")
            }
            Refusal::TotalLimit => {
                tracing::warn!(%lease, limit = status.total_limit, refused, "too many lease-socket connections on the node; refusing")
            }
            Refusal::FairShare => {
                tracing::warn!(%lease, floor = budget.floor(), refused, "lease beyond its share of a full node's connections; refusing")
            }
        }
    }
}

fn lease_error(kind: ErrorKind, message: String) -> LeaseResponse {
    LeaseResponse::Error { kind, message }
}

/// Detaches the connection from the ledger however the handler ends.
struct Attachment<'a> {
    arbiter: &'a ArbiterHandle,
    lease: &'a LeaseId,
    connection: u64,
    attached: bool,
}

impl Drop for Attachment<'_> {
    fn drop(&mut self) {
        if self.attached {
            self.arbiter.detach(self.lease, self.connection);
        }
    }
}

/// Why a `Schedule` is refused, if it is. Terms come from the arbiter's own lease
/// record, never from the client.
fn schedule_terms(
    tokens: &TokenService,
    arbiter: &ArbiterHandle,
    lease: &LeaseId,
) -> Result<TokenLease, LeaseResponse> {
    let ungated = "; the client runs ungated (memory quotas still apply)";
    if tokens.policy() == gpushare_config::SchedulingPolicy::Off {
        return Err(lease_error(
            ErrorKind::InvalidRequest,
            format!("GPU time is not scheduled on this node (scheduler.policy = \"off\"){ungated}"),
        ));
    }
    let Some(record) = arbiter.lease(lease) else {
        return Err(lease_error(
            ErrorKind::NotFound,
            format!("lease {lease} was released: there is no GPU time to schedule{ungated}"),
        ));
    };
    let [gpu] = record.gpus.as_slice() else {
        return Err(lease_error(
            ErrorKind::InvalidRequest,
            format!(
                "lease {lease} has {} GPUs; time-slice tokens cover single-GPU leases only{ungated}",
                record.gpus.len()
            ),
        ));
    };
    Ok(TokenLease {
        lease: lease.clone(),
        gpu: gpu.clone(),
        priority: record.priority,
        request: record.compute_request.get(),
        limit: record.compute_limit.get(),
    })
}

/// Whether the peer may use this lease's socket at all, decided before it is
/// answered anything: a foreign peer learns nothing and costs nothing more.
fn admit_peer(
    stream: &UnixStream,
    lease: &LeaseId,
    arbiter: &ArbiterHandle,
) -> Result<u32, String> {
    let pid = stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| "cannot read the peer's credentials".to_owned())?;
    arbiter
        .lease_peer(lease, pid)
        .map(|()| pid)
        .map_err(|e| e.to_string())
}

/// The next request: before the hello, the whole frame within `HELLO_TIMEOUT`;
/// after it, whenever the process next needs the arbiter, but once begun within
/// `FRAME_TIMEOUT`. Err(None): the hello never came.
async fn next_request(
    stream: &mut UnixStream,
    phase: Phase,
) -> Result<LeaseRequest, Option<FrameError>> {
    if phase != Phase::AwaitingHello {
        return read_started_frame(stream, MAX_LEASE_REQUEST_BYTES)
            .await
            .map_err(Some);
    }
    let next = read_frame_within(stream, MAX_LEASE_REQUEST_BYTES);
    match tokio::time::timeout(HELLO_TIMEOUT, next).await {
        Ok(read) => read.map_err(Some),
        Err(_) => Err(None),
    }
}

/// A refusal of the state: answered; a foreign peer or a broken protocol closes.
fn refusal(e: &StateError) -> (LeaseResponse, bool) {
    let close = matches!(e.kind(), ErrorKind::PermissionDenied | ErrorKind::Protocol);
    (lease_error(e.kind(), e.to_string()), close)
}

async fn handle_lease_connection(
    admitted: Admitted,
    lease: &LeaseId,
    arbiter: &ArbiterHandle,
    tokens: &Arc<TokenService>,
) -> Result<(), FrameError> {
    let Admitted {
        mut stream,
        peer_pid,
        permit,
    } = admitted;
    let connection = NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed);
    let mut attachment = Attachment {
        arbiter,
        lease,
        connection,
        attached: false,
    };
    let mut phase = Phase::AwaitingHello;
    loop {
        let request = match next_request(&mut stream, phase).await {
            Ok(r) => r,
            Err(Some(FrameError::Closed)) => return Ok(()),
            Err(Some(e)) => {
                let _ = write_frame(
                    &mut stream,
                    &lease_error(ErrorKind::Protocol, e.to_string()),
                )
                .await;
                return Err(e);
            }
            Err(None) => {
                let why = format!("no hello within {} s", HELLO_TIMEOUT.as_secs());
                let _ = write_frame(&mut stream, &lease_error(ErrorKind::Protocol, why)).await;
                return Ok(());
            }
        };
        let step = lease_connection::step(phase, &request);
        let (response, close) = match step {
            Step::Greet { accepted } => (
                LeaseResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                },
                !accepted,
            ),
            Step::Refuse(why) => (lease_error(ErrorKind::Protocol, why.to_owned()), true),
            Step::Schedule => {
                match schedule_terms(tokens, arbiter, lease) {
                    // From here on the GPU's token I/O thread serves it: token traffic
                    // must not wait for the async runtime's scheduler.
                    Ok(terms) => tokens.serve(stream.into_std()?, terms, Some(peer_pid), permit),
                    Err(refusal) => write_frame(&mut stream, &refusal).await?,
                }
                return Ok(());
            }
            Step::Attach { memory_held } => {
                match arbiter
                    .attach(lease, connection, peer_pid, memory_held)
                    .await
                {
                    Ok(quota) => {
                        attachment.attached = true;
                        let answer = LeaseResponse::Attached {
                            pid: peer_pid,
                            quota,
                        };
                        (answer, false)
                    }
                    Err(e) => refusal(&e),
                }
            }
            Step::Query => (
                LeaseResponse::Quota(arbiter.query(lease, connection)),
                false,
            ),
            Step::Charge { bytes } => match arbiter.charge(lease, connection, bytes).await {
                Ok(c) => (
                    LeaseResponse::Charged {
                        granted: c.granted,
                        memory_used: c.used,
                        memory_quota: c.quota,
                        memory_overhead: c.overhead,
                    },
                    false,
                ),
                Err(e) => (lease_error(e.kind(), e.to_string()), false),
            },
            Step::Credit { bytes } => match arbiter.credit(lease, connection, bytes) {
                Ok(used) => (LeaseResponse::Credited { memory_used: used }, false),
                Err(e) => (lease_error(e.kind(), e.to_string()), false),
            },
            Step::Share(change) => match arbiter.share(lease, connection, change) {
                Ok(quota) => (LeaseResponse::Quota(quota), false),
                Err(e) => (lease_error(e.kind(), e.to_string()), false),
            },
        };
        if !matches!(step, Step::Attach { .. }) || attachment.attached {
            phase = lease_connection::after(phase, step);
        }
        write_frame(&mut stream, &response).await?;
        if close {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests;
