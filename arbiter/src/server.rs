//! The lease sockets (one per lease, one task per connection) and the periodic
//! work (sampling, queue expiry, memory measurement); the control socket is in
//! `control`, the watchdog's loop in `watchdog`.
//!
//! A connection that breaks the protocol (bad version, malformed, oversized or
//! out-of-order frame) gets one error answer and is closed; nothing else is
//! affected. A lease-socket client is identified by the socket it came through
//! and by SO_PEERCRED, never by anything it says.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::lease_socket::{HELLO_TIMEOUT, MAX_LEASE_REQUEST_BYTES};
use gpushare_proto::{ErrorKind, LeaseId, LeaseRequest, LeaseResponse, PROTOCOL_VERSION};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::connections::{ConnectionBudget, Permit, Refusal};
use crate::inventory::GpuBackend;
use crate::state::{Arbiter, LeaseDirs, LeaseEndpoints, ProcessTable, StateError};
use crate::tokens::{TokenLease, TokenService};
use crate::watchdog;

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

pub use crate::control::{bind_control_socket, serve};

pub type SharedArbiter = Arc<Mutex<Arbiter>>;

pub fn lock(arbiter: &Mutex<Arbiter>) -> MutexGuard<'_, Arbiter> {
    // A panic mid-change never left memory ahead of the log's order (changes are
    // appended before they are applied), so the table is still usable.
    arbiter.lock().unwrap_or_else(|p| p.into_inner())
}

// ----- framing over tokio -----

pub(crate) async fn read_frame<T: DeserializeOwned>(
    stream: &mut UnixStream,
) -> Result<T, FrameError> {
    read_frame_within(stream, frame::MAX_FRAME_BYTES).await
}

async fn read_frame_within<T: DeserializeOwned>(
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

/// Creates each lease's directory and socket and serves it; closing a lease
/// stops its accept loop and drops its connections.
pub struct SocketEndpoints {
    dirs: LeaseDirs,
    runtime: tokio::runtime::Handle,
    arbiter: Arc<OnceLock<Weak<Mutex<Arbiter>>>>,
    tasks: HashMap<LeaseId, JoinHandle<()>>,
    tokens: Arc<TokenService>,
}

impl SocketEndpoints {
    /// Call `attach` with the arbiter once it exists; connections arriving before
    /// that wait for it.
    pub fn new(
        run_dir: PathBuf,
        runtime: tokio::runtime::Handle,
        tokens: Arc<TokenService>,
    ) -> Self {
        SocketEndpoints {
            dirs: LeaseDirs { run_dir },
            runtime,
            arbiter: Arc::new(OnceLock::new()),
            tasks: HashMap::new(),
            tokens,
        }
    }

    pub fn arbiter_slot(&self) -> Arc<OnceLock<Weak<Mutex<Arbiter>>>> {
        self.arbiter.clone()
    }
}

impl LeaseEndpoints for SocketEndpoints {
    fn open(&mut self, lease: &LeaseId) -> Result<(), StateError> {
        if self.tasks.contains_key(lease) {
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
        let slot = self.arbiter.clone();
        let id = lease.clone();
        let tokens = self.tokens.clone();
        let task = self.runtime.spawn(serve_lease(listener, id, slot, tokens));
        self.tasks.insert(lease.clone(), task);
        Ok(())
    }

    fn close(&mut self, lease: &LeaseId) {
        // Aborting the accept loop drops its JoinSet, which aborts (and so closes)
        // every connection of the lease.
        if let Some(task) = self.tasks.remove(lease) {
            task.abort();
        }
        // Token connections live on threads of their own, out of the task's reach.
        self.tokens.close_lease(lease);
        self.dirs.remove(lease);
    }
}

impl Drop for SocketEndpoints {
    /// A dropped arbiter (tests, benchmarks) stops serving its lease sockets.
    fn drop(&mut self) {
        for task in self.tasks.values() {
            task.abort();
        }
    }
}

pub use crate::connections::MAX_CONNECTIONS_PER_LEASE;

/// How often a refused flood is logged: the first refusal, then a summary at most
/// this often, so a container that floods its socket cannot flood the log too.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Once a frame has begun, the rest of it must arrive within this: a client that
/// sends half a frame and then nothing is dropped rather than kept for ever.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

async fn serve_lease(
    listener: UnixListener,
    lease: LeaseId,
    slot: Arc<OnceLock<Weak<Mutex<Arbiter>>>>,
    tokens: Arc<TokenService>,
) {
    let budget = tokens.budget().clone();
    let mut connections = JoinSet::new();
    let mut refusals = RefusalLog::default();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => match budget.admit(&lease) {
                    Err(why) => {
                        // Closed without an answer: the client sees the arbiter as
                        // unreachable and retries with backoff, under its loss policy,
                        // rather than taking a refusal as "run ungated".
                        drop(stream);
                        refusals.note(&lease, why, &budget);
                    }
                    Ok(permit) => {
                        let lease = lease.clone();
                        let slot = slot.clone();
                        let tokens = tokens.clone();
                        connections.spawn(async move {
                            let Some(arbiter) = wait_for_arbiter(&slot).await else { return };
                            if let Err(e) = handle_lease_connection(stream, &lease, &arbiter, &tokens, permit).await {
                                tracing::debug!(%lease, error = %e, "lease connection closed");
                            }
                        });
                    }
                },
                Err(e) => {
                    tracing::warn!(%lease, error = %e, "lease socket accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Logs the first refused connection of a burst and then a count at most every
/// [`REFUSAL_LOG_INTERVAL`].
#[derive(Default)]
struct RefusalLog {
    last: Option<Instant>,
    since_last: u64,
}

impl RefusalLog {
    fn note(&mut self, lease: &LeaseId, why: Refusal, budget: &ConnectionBudget) {
        self.since_last += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        let status = budget.status();
        match why {
            Refusal::LeaseLimit => {
                tracing::warn!(%lease, limit = status.per_lease_limit, refused = self.since_last, "too many connections on a lease socket; refusing")
            }
            Refusal::TotalLimit => {
                tracing::warn!(%lease, limit = status.total_limit, refused = self.since_last, "too many lease-socket connections on the node; refusing")
            }
        }
        self.last = Some(now);
        self.since_last = 0;
    }
}

async fn wait_for_arbiter(slot: &OnceLock<Weak<Mutex<Arbiter>>>) -> Option<SharedArbiter> {
    loop {
        if let Some(weak) = slot.get() {
            return weak.upgrade();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn lease_error(kind: ErrorKind, message: String) -> LeaseResponse {
    LeaseResponse::Error { kind, message }
}

/// Detaches the connection from the ledger however the handler ends.
struct Attachment<'a> {
    arbiter: &'a SharedArbiter,
    lease: &'a LeaseId,
    connection: u64,
    attached: bool,
}

impl Drop for Attachment<'_> {
    fn drop(&mut self) {
        if self.attached {
            lock(self.arbiter).lease_detach(self.lease, self.connection);
        }
    }
}

/// Why a `Schedule` is refused, if it is. Terms come from the arbiter's own lease
/// record, never from the client.
fn schedule_terms(
    tokens: &TokenService,
    arbiter: &SharedArbiter,
    lease: &LeaseId,
) -> Result<TokenLease, LeaseResponse> {
    let ungated = "; the client runs ungated (memory quotas still apply)";
    if tokens.policy() == gpushare_config::SchedulingPolicy::Off {
        return Err(lease_error(
            ErrorKind::InvalidRequest,
            format!("GPU time is not scheduled on this node (scheduler.policy = \"off\"){ungated}"),
        ));
    }
    let record = lock(arbiter).lease(lease).cloned();
    let Some(record) = record else {
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
    arbiter: &SharedArbiter,
) -> Result<u32, String> {
    let pid = stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .ok_or_else(|| "cannot read the peer's credentials".to_owned())?;
    lock(arbiter)
        .lease_peer(lease, pid)
        .map(|()| pid)
        .map_err(|e| e.to_string())
}

async fn handle_lease_connection(
    mut stream: UnixStream,
    lease: &LeaseId,
    arbiter: &SharedArbiter,
    tokens: &Arc<TokenService>,
    permit: Permit,
) -> Result<(), FrameError> {
    let connection = NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed);
    let peer_pid = match admit_peer(&stream, lease, arbiter) {
        Ok(pid) => pid,
        Err(why) => {
            tokens.budget().refused_peer();
            let refusal = lease_error(ErrorKind::PermissionDenied, why);
            // Best effort and bounded: a foreign peer gets one answer, never a wait.
            let _ = tokio::time::timeout(FRAME_TIMEOUT, write_frame(&mut stream, &refusal)).await;
            return Ok(());
        }
    };
    let mut state = Attachment {
        arbiter,
        lease,
        connection,
        attached: false,
    };
    let mut greeted = false;
    loop {
        let read = if greeted {
            read_started_frame(&mut stream, MAX_LEASE_REQUEST_BYTES).await
        } else {
            let next = read_frame_within(&mut stream, MAX_LEASE_REQUEST_BYTES);
            match tokio::time::timeout(HELLO_TIMEOUT, next).await {
                Ok(read) => read,
                Err(_) => {
                    let why = format!("no hello within {} s", HELLO_TIMEOUT.as_secs());
                    let _ = write_frame(&mut stream, &lease_error(ErrorKind::Protocol, why)).await;
                    return Ok(());
                }
            }
        };
        let request: LeaseRequest = match read {
            Ok(r) => r,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => {
                let _ = write_frame(
                    &mut stream,
                    &lease_error(ErrorKind::Protocol, e.to_string()),
                )
                .await;
                return Err(e);
            }
        };
        if greeted && request == LeaseRequest::Schedule {
            if state.attached {
                let e = lease_error(
                    ErrorKind::Protocol,
                    "schedule on a connection of its own, not on the ledger's".into(),
                );
                write_frame(&mut stream, &e).await?;
                return Ok(());
            }
            match schedule_terms(tokens, arbiter, lease) {
                Ok(terms) => {
                    // From here on the GPU's token I/O thread serves it: token traffic
                    // must not wait for the async runtime's scheduler.
                    tokens.serve(stream.into_std()?, terms, Some(peer_pid), permit);
                }
                Err(refusal) => write_frame(&mut stream, &refusal).await?,
            }
            return Ok(());
        }
        let out_of_order = |why: &str| lease_error(ErrorKind::Protocol, why.to_owned());
        let (response, close) = match (request, greeted, state.attached) {
            (LeaseRequest::Hello { protocol }, false, _) => {
                let answer = LeaseResponse::Hello {
                    protocol: PROTOCOL_VERSION,
                };
                greeted = protocol == PROTOCOL_VERSION;
                (answer, !greeted)
            }
            (_, false, _) => (out_of_order("the first message must be hello"), true),
            (LeaseRequest::Hello { .. }, true, _) => (out_of_order("hello sent twice"), true),
            (LeaseRequest::Attach { .. }, true, true) => (out_of_order("attach sent twice"), true),
            (LeaseRequest::Attach { memory_held }, true, false) => {
                let result = lock(arbiter).lease_attach(lease, connection, peer_pid, memory_held);
                match result {
                    Ok(quota) => {
                        state.attached = true;
                        // Measure now, so the answer (and the charges right after it)
                        // carry this process's real overhead rather than the estimate
                        // whenever NVML already lists it.
                        let quota = if measure_memory(arbiter, Some(lease)).await {
                            lock(arbiter).lease_query(lease, connection)
                        } else {
                            quota
                        };
                        (
                            LeaseResponse::Attached {
                                pid: peer_pid,
                                quota,
                            },
                            false,
                        )
                    }
                    Err(e) => {
                        let close =
                            matches!(e.kind(), ErrorKind::PermissionDenied | ErrorKind::Protocol);
                        (lease_error(e.kind(), e.to_string()), close)
                    }
                }
            }
            (LeaseRequest::Query, true, _) => (
                LeaseResponse::Quota(lock(arbiter).lease_query(lease, connection)),
                false,
            ),
            (LeaseRequest::Charge { .. } | LeaseRequest::Credit { .. }, true, false) => {
                (out_of_order("attach before charging or crediting"), true)
            }
            (LeaseRequest::Charge { bytes }, true, true) => {
                let mut result = lock(arbiter).lease_charge(lease, connection, bytes);
                // A refusal is final for the process, so it rests on a fresh
                // measurement: an estimate, or an overhead that shrank since
                // (a trimmed graph pool), must not refuse memory that fits.
                let refused = matches!(&result, Ok(c) if !c.granted);
                let stale = || !lock(arbiter).measured_within(lease, Instant::now(), MEASURE_FRESH);
                if refused && stale() && measure_memory(arbiter, Some(lease)).await {
                    result = lock(arbiter).lease_charge(lease, connection, bytes);
                }
                match result {
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
                }
            }
            (LeaseRequest::Schedule, true, _) => unreachable!("handled above"),
            (LeaseRequest::Credit { bytes }, true, true) => {
                let result = lock(arbiter).lease_credit(lease, connection, bytes);
                match result {
                    Ok(used) => (LeaseResponse::Credited { memory_used: used }, false),
                    Err(e) => (lease_error(e.kind(), e.to_string()), false),
                }
            }
        };
        write_frame(&mut stream, &response).await?;
        if close {
            return Ok(());
        }
    }
}

// ----- per-process memory -----

/// A refused charge re-measures its lease unless it was measured this recently:
/// NVML's process listing is one driver call per GPU, and a program probing for the
/// largest allocation that fits retries in a tight loop.
pub const MEASURE_FRESH: Duration = Duration::from_millis(100);
/// How often processes still charged the estimate (attached before NVML listed
/// them: no context yet) are looked for. Only runs while there are such
/// processes, so an idle node pays nothing.
pub const NEW_CLIENT_MEASURE_INTERVAL: Duration = Duration::from_millis(200);

/// Lists per-process memory on the GPUs of `lease` (every GPU: None) and records
/// it in the ledger. False when overhead is not measured or NVML failed.
pub async fn measure_memory(arbiter: &SharedArbiter, lease: Option<&LeaseId>) -> bool {
    let Some((probe, gpus)) = lock(arbiter).measurement(lease) else {
        return false;
    };
    let table = tokio::task::spawn_blocking(move || list_processes(probe.as_ref(), gpus))
        .await
        .ok()
        .flatten();
    match table {
        Some(table) => {
            lock(arbiter).record_process_memory(&table, Instant::now());
            true
        }
        None => false,
    }
}

/// NVML's processes on `gpus`; None when the backend cannot list them.
pub(crate) fn list_processes(backend: &dyn GpuBackend, gpus: Vec<String>) -> Option<ProcessTable> {
    let mut table = ProcessTable::new();
    for uuid in gpus {
        match backend.processes(&uuid) {
            Ok(Some(list)) => {
                table.insert(uuid, list);
            }
            Ok(None) => return None,
            Err(e) => tracing::warn!(error = %e, gpu = %uuid, "listing GPU processes failed"),
        }
    }
    Some(table)
}

/// Turns overhead accounting on when the backend can list processes, and keeps
/// new clients measured; says in the log which way it went.
fn start_memory_measurement(arbiter: &SharedArbiter, backend: &Arc<dyn GpuBackend>) {
    let first = backend.gpus().into_iter().next();
    let lists = first.is_some_and(|g| matches!(backend.processes(&g.uuid), Ok(Some(_))));
    if !lists {
        tracing::warn!(source = backend.source(), "per-process GPU memory cannot be read here (no NVML): quotas cover explicit allocations only, not the processes' CUDA contexts");
        return;
    }
    {
        let mut a = lock(arbiter);
        a.set_memory_probe(backend.clone());
        tracing::info!(estimate = a.overhead_estimate(), "per-process overhead (context, modules) is measured with NVML and charged to each lease");
    }
    let arbiter = arbiter.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(NEW_CLIENT_MEASURE_INTERVAL);
        loop {
            tick.tick().await;
            if lock(&arbiter).has_unmeasured_clients() {
                measure_memory(&arbiter, None).await;
            }
        }
    });
}

// ----- periodic work -----

/// How often utilisation is sampled (Algorithm 1 looks at the last minute).
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// How often waiting requests are checked against their bound.
const QUEUE_TICK: Duration = Duration::from_millis(200);

pub fn spawn_background(arbiter: SharedArbiter, backend: Arc<dyn GpuBackend>) {
    let (watchdog_interval, kill) = {
        let a = lock(&arbiter);
        (
            Duration::from_millis(a.config().watchdog_interval_ms),
            a.config().watchdog_kill,
        )
    };
    {
        let arbiter = arbiter.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(QUEUE_TICK);
            loop {
                tick.tick().await;
                lock(&arbiter).expire_waiters(Instant::now());
            }
        });
    }
    {
        let arbiter = arbiter.clone();
        let backend = backend.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
            loop {
                tick.tick().await;
                let backend = backend.clone();
                let samples = tokio::task::spawn_blocking(move || {
                    backend
                        .gpus()
                        .into_iter()
                        .filter_map(|g| match backend.sample(&g.uuid) {
                            Ok(Some(s)) => Some((g.uuid, s)),
                            Ok(None) => None,
                            Err(e) => {
                                tracing::warn!(error = %e, "sampling failed");
                                None
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .await
                .unwrap_or_default();
                if !samples.is_empty() {
                    lock(&arbiter).record_samples(Instant::now(), &samples);
                }
            }
        });
    }
    start_memory_measurement(&arbiter, &backend);
    let tokens = lock(&arbiter).tokens();
    match tokens {
        Some(tokens) => watchdog::spawn(arbiter, backend, watchdog_interval, kill, tokens),
        None => tracing::error!("no token service: the watchdog does not run"),
    }
}
