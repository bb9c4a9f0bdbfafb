//! The process's link to its lease's ledger in the arbiter, over the lease socket
//! (`/run/gpushare/arbiter.sock` inside the container).
//!
//! One connection per process: the arbiter keeps the ledger per connection, so when
//! the process dies its memory is credited back. The library speaks the protocol of
//! `gpushare_proto::lease_socket` itself (its frames and messages) rather than
//! through `LeaseClient`, because it must know the socket's descriptor: a fork child
//! closes its inherited copy without touching any lock (see `fork`).
//!
//! If the arbiter goes away (restart, crash) the process's watcher thread (`watch`)
//! notices the connection close and re-attaches with what the process still holds as
//! soon as the arbiter is back, so the new arbiter's ledger is rebuilt without waiting
//! for a CUDA call; a ledger operation that finds the connection dead first
//! reconnects itself. While it cannot be reached, charges fail closed
//! (`CUDA_ERROR_OUT_OF_MEMORY`): the quota is never exceeded for want of a ledger.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use gpushare_proto::frame::{read_message, write_message, FrameError};

use crate::watch::{self, Reattach};
use gpushare_proto::{
    ErrorKind, LeaseRequest, LeaseResponse, LeaseState, Quota, ShareKey, PROTOCOL_VERSION,
};

/// Bound on every read and write: a wedged arbiter cannot hang an allocation for ever.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a charge keeps trying to reach an arbiter that is away (a restart takes
/// about a second).
pub const CHARGE_PATIENCE: Duration = Duration::from_secs(3);
/// How long a memory query waits for it (it can answer from what it last knew).
pub const QUERY_PATIENCE: Duration = Duration::from_millis(200);
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The connection's descriptor, for a fork child to close (-1: none). Stored after
/// the socket exists and cleared before it is closed, so at any instant — the one a
/// fork snapshots — a value here is our socket.
static CONNECTION_FD: AtomicI32 = AtomicI32::new(-1);

#[derive(Debug)]
pub enum LinkError {
    Io(String),
    Refused { kind: ErrorKind, message: String },
    Version(u32),
    Unexpected(String),
}

impl std::error::Error for LinkError {}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Io(e) => write!(f, "{e}"),
            LinkError::Refused { kind, message } => write!(f, "refused ({kind:?}): {message}"),
            LinkError::Version(v) => write!(
                f,
                "the arbiter speaks protocol {v}, this library {PROTOCOL_VERSION}"
            ),
            LinkError::Unexpected(r) => write!(f, "unexpected answer {r}"),
        }
    }
}

impl From<FrameError> for LinkError {
    fn from(e: FrameError) -> Self {
        LinkError::Io(e.to_string())
    }
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> Self {
        LinkError::Io(e.to_string())
    }
}

struct Connection {
    stream: UnixStream,
}

impl Connection {
    fn open(path: &std::path::Path) -> Result<Connection, LinkError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let mut c = Connection { stream };
        match c.call(&LeaseRequest::Hello {
            protocol: PROTOCOL_VERSION,
        })? {
            LeaseResponse::Hello { protocol } if protocol == PROTOCOL_VERSION => Ok(c),
            LeaseResponse::Hello { protocol } => Err(LinkError::Version(protocol)),
            other => Err(LinkError::Unexpected(format!("{other:?}"))),
        }
    }

    fn call(&mut self, request: &LeaseRequest) -> Result<LeaseResponse, LinkError> {
        write_message(&mut self.stream, request)?;
        match read_message(&mut self.stream)? {
            LeaseResponse::Error { kind, message } => Err(LinkError::Refused { kind, message }),
            response => Ok(response),
        }
    }
}

/// What the library knows of its lease's share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaView {
    /// The lease's memory quota (its per-GPU memory × its GPUs).
    pub quota: u64,
    /// In use across every process of the lease: their charges plus each one's
    /// overhead (context, modules: what NVML shows beyond the charges).
    pub used: u64,
    /// The part of `used` that is overhead.
    pub overhead: u64,
    pub gpus: u32,
    pub released: bool,
}

impl QuotaView {
    fn from_quota(q: &Quota) -> QuotaView {
        crate::gate::lease_class_learned(q.priority);
        QuotaView {
            quota: q.memory_quota,
            used: q.memory_used,
            overhead: q.memory_overhead,
            gpus: q.gpus.len() as u32,
            released: q.state == LeaseState::Released,
        }
    }

    /// The quota of one GPU of the lease.
    pub fn per_gpu(&self) -> u64 {
        self.quota / u64::from(self.gpus.max(1))
    }

    pub fn remaining(&self) -> u64 {
        self.quota.saturating_sub(self.used)
    }
}

/// Why a charge was not granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    OverQuota {
        /// Charges plus overhead across the lease.
        used: u64,
        quota: u64,
        /// The part of `used` that is the processes' overhead.
        overhead: u64,
    },
    /// The arbiter could not be reached within the patience.
    Unreachable,
    /// The lease is gone (the container is being torn down, or an operator released it).
    Released,
}

#[derive(Debug)]
struct Backoff {
    next_attempt: Option<Instant>,
    delay: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff {
            next_attempt: None,
            delay: FIRST_BACKOFF,
        }
    }

    fn failed(&mut self, now: Instant) {
        self.next_attempt = Some(now + self.delay);
        self.delay = (self.delay * 2).min(MAX_BACKOFF);
    }

    fn succeeded(&mut self) {
        *self = Backoff::new();
    }
}

pub struct LeaseLink {
    socket: PathBuf,
    connection: Option<Connection>,
    /// What this process has charged and not credited: re-attached after a reconnect.
    held: u64,
    last: Option<QuotaView>,
    /// When `last.used` was last heard (any answer that carries it).
    heard_at: Option<Instant>,
    backoff: Backoff,
    /// Whether the arbiter takes exported allocations (`Share`/`Hold`/`Unhold`), as its
    /// last attach said.
    arbiter_shares: bool,
    /// The process's own link publishes its descriptor for a fork child to close, and
    /// starts the watcher with this step at its first attach; other links (tests)
    /// leave CONNECTION_FD alone.
    watcher: Option<watch::Step>,
}

impl LeaseLink {
    pub fn new(socket: PathBuf) -> LeaseLink {
        LeaseLink {
            socket,
            connection: None,
            held: 0,
            last: None,
            heard_at: None,
            backoff: Backoff::new(),
            arbiter_shares: false,
            watcher: None,
        }
    }

    /// The link of the process's accounts (the one a fork child must close), whose
    /// watcher re-attaches it with `step`.
    pub fn for_process(socket: PathBuf, step: watch::Step) -> LeaseLink {
        LeaseLink {
            watcher: Some(step),
            ..LeaseLink::new(socket)
        }
    }

    pub fn held(&self) -> u64 {
        self.held
    }

    /// What was last heard from the arbiter.
    pub fn last_known(&self) -> Option<QuotaView> {
        self.last
    }

    /// What was last heard, if it was heard less than `max_age` before `now`.
    pub fn heard_within(&self, now: Instant, max_age: Duration) -> Option<QuotaView> {
        let at = self.heard_at?;
        (now.saturating_duration_since(at) < max_age)
            .then_some(self.last)
            .flatten()
    }

    /// When the share was last heard from the arbiter.
    pub fn heard_at(&self) -> Option<Instant> {
        self.heard_at
    }

    fn heard(&mut self) {
        self.heard_at = Some(Instant::now());
    }

    fn drop_connection(&mut self) {
        if self.connection.is_some() {
            if self.watcher.is_some() {
                CONNECTION_FD.store(-1, Ordering::Release);
            }
            self.connection = None;
            if self.watcher.is_some() {
                // Nobody re-attaches a dropped connection until the next ledger
                // operation: the watcher does it now.
                watch::wake();
            }
        }
    }

    /// Whether a connection is open (attached), as far as this side knows.
    pub fn is_connected(&self) -> bool {
        self.connection.is_some()
    }

    /// Connected (and attached), trying until `patience` runs out.
    pub fn connect(&mut self, patience: Duration) -> bool {
        self.ensure_connected(patience)
    }

    /// The watcher's step, under the accounts' lock: a connection the arbiter closed is
    /// dropped, and a missing one attached once (no backoff wait: the watcher paces its
    /// own retries).
    pub fn reattach_once(&mut self) -> Reattach {
        if let Some(c) = &self.connection {
            if !peer_hung_up(c.stream.as_raw_fd()) {
                return Reattach::Open(c.stream.as_raw_fd());
            }
            crate::log_info!("the arbiter closed the ledger connection; re-attaching");
            self.drop_connection();
        }
        match self.attach() {
            Ok(()) => {
                self.backoff.succeeded();
                match &self.connection {
                    Some(c) => Reattach::Open(c.stream.as_raw_fd()),
                    None => Reattach::Away,
                }
            }
            Err(e @ LinkError::Refused { .. }) | Err(e @ LinkError::Version(_)) => {
                crate::log_error!("re-attach to {} refused: {e}", self.socket.display());
                Reattach::Refused
            }
            Err(e) => {
                crate::log_debug!("re-attach to {}: {e}", self.socket.display());
                Reattach::Away
            }
        }
    }

    /// Connected (and attached), trying until `patience` runs out, with backoff.
    fn ensure_connected(&mut self, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        loop {
            if self.connection.is_some() {
                return true;
            }
            let now = Instant::now();
            if let Some(at) = self.backoff.next_attempt {
                if at > now {
                    if at > deadline {
                        return false;
                    }
                    std::thread::sleep(at - now);
                }
            }
            match self.attach() {
                Ok(()) => {
                    self.backoff.succeeded();
                    return true;
                }
                Err(e) => {
                    crate::log_info!("arbiter at {} unreachable: {e}", self.socket.display());
                    self.backoff.failed(Instant::now());
                    if Instant::now() >= deadline {
                        return false;
                    }
                }
            }
        }
    }

    fn attach(&mut self) -> Result<(), LinkError> {
        let mut c = Connection::open(&self.socket)?;
        match c.call(&LeaseRequest::Attach {
            memory_held: self.held,
        })? {
            LeaseResponse::Attached { pid, quota } => {
                let view = QuotaView::from_quota(&quota);
                crate::log_info!(
                    "attached to lease {} as pid {pid}: quota {} bytes on {} GPU(s), {} in use, {} held here",
                    quota.lease,
                    view.quota,
                    view.gpus,
                    view.used,
                    self.held
                );
                if let Some(step) = self.watcher {
                    CONNECTION_FD.store(c.stream.as_raw_fd(), Ordering::Release);
                    // From the first attach on, a closed connection is re-attached
                    // without waiting for a CUDA call.
                    watch::start(step);
                }
                self.connection = Some(c);
                self.last = Some(view);
                self.arbiter_shares = quota.shares;
                self.heard();
                Ok(())
            }
            other => Err(LinkError::Unexpected(format!("{other:?}"))),
        }
    }

    /// One request, reconnecting once if the connection turns out dead (the arbiter
    /// restarted since the last request).
    fn request(
        &mut self,
        request: &LeaseRequest,
        patience: Duration,
    ) -> Result<LeaseResponse, LinkError> {
        let mut last_error = LinkError::Io("not connected".into());
        for _ in 0..2 {
            if !self.ensure_connected(patience) {
                return Err(last_error);
            }
            let c = self.connection.as_mut().expect("connected above");
            match c.call(request) {
                Ok(r) => return Ok(r),
                Err(e @ LinkError::Refused { .. }) => return Err(e),
                Err(e) => {
                    crate::log_info!("arbiter connection lost: {e}; reconnecting");
                    self.drop_connection();
                    last_error = e;
                }
            }
        }
        Err(last_error)
    }

    /// Asks to hold `bytes` more. Zero is granted without asking.
    pub fn charge(&mut self, bytes: u64) -> Result<(), Refusal> {
        if bytes == 0 {
            return Ok(());
        }
        match self.request(&LeaseRequest::Charge { bytes }, CHARGE_PATIENCE) {
            Ok(LeaseResponse::Charged {
                granted,
                memory_used,
                memory_quota,
                memory_overhead,
            }) => {
                if let Some(last) = self.last.as_mut() {
                    last.used = memory_used;
                    last.quota = memory_quota;
                    last.overhead = memory_overhead;
                    self.heard();
                }
                if granted {
                    self.held += bytes;
                    Ok(())
                } else {
                    Err(Refusal::OverQuota {
                        used: memory_used,
                        quota: memory_quota,
                        overhead: memory_overhead,
                    })
                }
            }
            Ok(other) => {
                crate::log_error!("charge answered with {other:?}");
                Err(Refusal::Unreachable)
            }
            Err(LinkError::Refused {
                kind: ErrorKind::NotFound,
                ..
            }) => {
                if let Some(last) = self.last.as_mut() {
                    last.released = true;
                }
                Err(Refusal::Released)
            }
            Err(e) => {
                crate::log_error!("charge of {bytes} bytes not granted: {e}");
                Err(Refusal::Unreachable)
            }
        }
    }

    /// `bytes` were freed. Never fails: if the arbiter is away, the re-attach after
    /// the reconnect carries the corrected holdings.
    pub fn credit(&mut self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.held = self.held.saturating_sub(bytes);
        // Only on the connection that existed when the memory was freed, never
        // resent after a reconnect: the re-attach already reports the lowered
        // holdings, so a resent credit would be subtracted twice and let the
        // container allocate past its quota.
        let Some(connection) = self.connection.as_mut() else {
            return;
        };
        match connection.call(&LeaseRequest::Credit { bytes }) {
            Ok(LeaseResponse::Credited { memory_used }) => {
                if let Some(last) = self.last.as_mut() {
                    last.used = memory_used;
                    self.heard();
                }
            }
            Ok(other) => crate::log_error!("credit answered with {other:?}"),
            Err(e) => {
                crate::log_error!("credit of {bytes} bytes: {e}");
                // Out of step with the arbiter: a fresh attach reports the truth.
                self.drop_connection();
            }
        }
    }

    /// `bytes` this process charged are exported under `key` (`same_as`: the key it
    /// first shared them under, `bytes` then 0): from now on the lease pays for them
    /// until their last holder lets go, not this process. False when the arbiter
    /// cannot take it (an older one, or away): the process keeps the charge.
    pub fn share(&mut self, key: ShareKey, bytes: u64, same_as: Option<ShareKey>) -> bool {
        let request = LeaseRequest::Share {
            key,
            bytes,
            same_as,
        };
        if !self.shared_call(&request) {
            return false;
        }
        self.held = self.held.saturating_sub(bytes);
        true
    }

    /// This process holds the exported allocation `key` (imported it).
    pub fn hold(&mut self, key: ShareKey) {
        self.shared_call(&LeaseRequest::Hold { key });
    }

    /// This process let go of the exported allocation `key`.
    pub fn unhold(&mut self, key: ShareKey) {
        self.shared_call(&LeaseRequest::Unhold { key });
    }

    /// A `Share`/`Hold`/`Unhold` on the current connection (never resent after a
    /// reconnect, like a credit); whether the arbiter took it.
    fn shared_call(&mut self, request: &LeaseRequest) -> bool {
        if !self.arbiter_shares {
            return false;
        }
        let Some(connection) = self.connection.as_mut() else {
            return false;
        };
        match connection.call(request) {
            Ok(LeaseResponse::Quota(q)) => {
                self.last = Some(QuotaView::from_quota(&q));
                self.heard();
                true
            }
            Ok(other) => {
                crate::log_error!("{request:?} answered with {other:?}");
                false
            }
            Err(e) => {
                crate::log_error!("{request:?}: {e}");
                false
            }
        }
    }

    /// The lease's share as the arbiter sees it now, or what was last heard.
    pub fn query(&mut self) -> Option<QuotaView> {
        match self.request(&LeaseRequest::Query, QUERY_PATIENCE) {
            Ok(LeaseResponse::Quota(q)) => {
                self.last = Some(QuotaView::from_quota(&q));
                self.heard();
            }
            Ok(other) => crate::log_error!("query answered with {other:?}"),
            Err(e) => crate::log_info!("query: {e}; answering from what was last known"),
        }
        self.last
    }

    /// The quota, connecting if nothing is known yet.
    pub fn known_quota(&mut self) -> Option<QuotaView> {
        if self.last.is_none() {
            self.ensure_connected(QUERY_PATIENCE);
        }
        self.last
    }
}

/// Whether the peer of a connected socket has closed it (or it is unusable): a
/// zero-timeout poll. The arbiter never writes unasked on a ledger connection, so
/// POLLIN alone (an answer another thread is about to read) is not asked for.
pub fn peer_hung_up(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// In a fork child: close the child's copy of the parent's connection, so the
/// parent's ledger entry closes when the parent's does. Async-signal-safe.
pub fn close_inherited_connection() {
    let fd = CONNECTION_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: this descriptor is the child's copy of our socket (see CONNECTION_FD);
        // the parent's state that owns the number is abandoned in the child, never dropped.
        unsafe { libc::close(fd) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    use gpushare_proto::{Fraction, LeaseId, Priority};

    /// A stand-in arbiter: one lease of `quota` bytes, a ledger for this one client.
    pub(crate) fn fake_arbiter(quota: u64) -> (tempfile::TempDir, std::path::PathBuf) {
        let (dir, path, _) = fake_arbiter_with(quota, 0);
        (dir, path)
    }

    /// The stand-in with a process overhead of `overhead` bytes charged besides the
    /// allocations (as the arbiter measures it), counting the requests it answers.
    pub(crate) fn fake_arbiter_with(
        quota: u64,
        overhead: u64,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arbiter.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { return };
                let mut used = overhead;
                let q = |used| Quota {
                    lease: LeaseId("l".into()),
                    state: LeaseState::Confirmed,
                    gpus: vec!["GPU-0".into()],
                    priority: Priority::Low,
                    memory_quota: quota,
                    memory_used: used,
                    memory_held: used - overhead,
                    memory_overhead: overhead,
                    shares: false,
                    compute_request: Fraction::ZERO,
                    compute_limit: Fraction::ONE,
                };
                while let Ok(req) = read_message::<LeaseRequest>(&mut s) {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let resp = match req {
                        LeaseRequest::Hello { protocol } => LeaseResponse::Hello { protocol },
                        LeaseRequest::Attach { memory_held } => {
                            used = memory_held + overhead;
                            LeaseResponse::Attached {
                                pid: 1,
                                quota: q(used),
                            }
                        }
                        LeaseRequest::Query => LeaseResponse::Quota(q(used)),
                        LeaseRequest::Charge { bytes } => {
                            let granted = used + bytes <= quota;
                            if granted {
                                used += bytes;
                            }
                            LeaseResponse::Charged {
                                granted,
                                memory_used: used,
                                memory_quota: quota,
                                memory_overhead: overhead,
                            }
                        }
                        LeaseRequest::Credit { bytes } => {
                            used -= bytes;
                            LeaseResponse::Credited { memory_used: used }
                        }
                        LeaseRequest::Schedule
                        | LeaseRequest::Share { .. }
                        | LeaseRequest::Hold { .. }
                        | LeaseRequest::Unhold { .. } => LeaseResponse::Error {
                            kind: gpushare_proto::ErrorKind::InvalidRequest,
                            message: "this stand-in does not schedule or share".into(),
                        },
                    };
                    if write_message(&mut s, &resp).is_err() {
                        break;
                    }
                }
            }
        });
        (dir, path, requests)
    }

    const MAX_AGE: Duration = Duration::from_millis(100);

    #[test]
    fn what_was_heard_answers_within_the_staleness_bound_then_one_query_refreshes_it() {
        let (_d, path, requests) = fake_arbiter_with(1000, 300);
        let mut link = LeaseLink::new(path);
        assert_eq!(link.charge(100), Ok(()));
        let count = || requests.load(std::sync::atomic::Ordering::SeqCst);
        let after_charge = count();
        let heard = link.heard_at().expect("the charge's answer");
        let v = link.heard_within(heard, MAX_AGE).expect("fresh");
        assert_eq!(
            (v.used, v.overhead, v.remaining()),
            (400, 300, 600),
            "free is the quota less charges and the process's overhead"
        );
        let almost = heard + MAX_AGE - Duration::from_millis(1);
        assert!(link.heard_within(almost, MAX_AGE).is_some());
        assert_eq!(count(), after_charge, "no round trip within the bound");
        assert_eq!(link.heard_within(heard + MAX_AGE, MAX_AGE), None);
        // The process's own credit is in the next answer at once.
        link.credit(100);
        assert_eq!(link.query().map(|v| v.used), Some(300));
        assert_eq!(count(), after_charge + 2, "one credit, one query");
    }

    #[test]
    fn a_refusal_counts_the_overhead() {
        let (_d, path, _) = fake_arbiter_with(1000, 300);
        let mut link = LeaseLink::new(path);
        assert_eq!(
            link.charge(701),
            Err(Refusal::OverQuota {
                used: 300,
                quota: 1000,
                overhead: 300
            })
        );
        assert_eq!(link.charge(700), Ok(()));
    }

    #[test]
    fn backoff_doubles_to_a_ceiling_and_resets() {
        let mut b = Backoff::new();
        let t = Instant::now();
        b.failed(t);
        assert_eq!(b.next_attempt, Some(t + FIRST_BACKOFF));
        for _ in 0..20 {
            b.failed(t);
        }
        assert_eq!(b.delay, MAX_BACKOFF);
        b.succeeded();
        assert_eq!(b.next_attempt, None);
        assert_eq!(b.delay, FIRST_BACKOFF);
    }

    #[test]
    fn unreachable_arbiter_fails_closed_within_the_patience() {
        let mut link = LeaseLink::new("/nonexistent/gpushare.sock".into());
        let start = Instant::now();
        assert_eq!(link.charge(1), Err(Refusal::Unreachable));
        assert!(start.elapsed() < CHARGE_PATIENCE * 2);
        assert_eq!(link.held(), 0);
        link.credit(5);
        assert_eq!(link.query(), None);
    }

    #[test]
    fn per_gpu_share() {
        let v = QuotaView {
            quota: 8,
            used: 3,
            overhead: 1,
            gpus: 2,
            released: false,
        };
        assert_eq!(v.per_gpu(), 4);
        assert_eq!(v.remaining(), 5);
        let none = QuotaView { gpus: 0, ..v };
        assert_eq!(none.per_gpu(), 8);
    }
}
