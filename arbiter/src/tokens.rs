//! The time-slice token's I/O edge: one scheduler per GPU (the pure
//! [`TokenPolicy`] behind a mutex, the pages of its clients, a timer thread), the
//! shared pages themselves (memfd, mapped writable here, sealed so the client can
//! only map them read-only), and one blocking thread per token connection.
//!
//! Token traffic never goes through the async runtime: a handoff is a frame read by
//! the releasing client's thread, a policy step and a few stores plus `FUTEX_WAKE`
//! on the next holder's page — tens of microseconds, which a hop through tokio's
//! scheduler would multiply.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use gpushare_config::{SchedulerConfig, SchedulingPolicy};
use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::token::{FLAG_CUT_OFF, NOT_HELD, TOKEN_PAGE_SIZE};
use gpushare_proto::token_client::futex_wake;
use gpushare_proto::{
    AdmissionStatus, ErrorKind, FitCounts, LeaseId, LeaseResponse, Priority, ScheduleTerms,
    TokenHolder, TokenPage, TokenRequest, TokenStatus, WindowWaiter,
};

use crate::timeslice::{Action, ClientId, Event, TokenPolicy};

/// Longest frame a token connection may send: `{"op":"release","again":false}` is 31
/// bytes, a `fit` report with every count at `u64::MAX` about 210. Anything bigger is
/// not a token request, and a bound this small means a hostile client cannot make the
/// arbiter buffer anything.
pub const MAX_TOKEN_FRAME: usize = 256;

/// How long the arbiter waits to hand a client its `Scheduled` answer; a client that
/// does not read it is dropped rather than allowed to stall its thread.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("creating the token page ({step}): {source}")]
    Page {
        step: &'static str,
        source: nix::Error,
    },
    #[error("token connection: {0}")]
    Io(#[from] io::Error),
    #[error("token connection: {0}")]
    Frame(#[from] FrameError),
    #[error("sending the token page: {0}")]
    Send(nix::Error),
    #[error("a {0}-byte frame on a token connection (at most {MAX_TOKEN_FRAME})")]
    Oversized(usize),
    #[error("not a token request: {0}")]
    Malformed(serde_json::Error),
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the clients compare deadlines with.
pub fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always readable");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

// ----- the page -----

/// The arbiter's writable mapping of one client's page.
struct PageMapping {
    page: NonNull<TokenPage>,
}

// SAFETY: the mapping is only accessed through the page's atomics.
unsafe impl Send for PageMapping {}
// SAFETY: as above.
unsafe impl Sync for PageMapping {}

impl PageMapping {
    /// A fresh memfd holding an initialised page, mapped writable here and sealed
    /// so that nobody else can ever map it writable or change its size.
    fn create() -> Result<(PageMapping, OwnedFd), TokenError> {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        use nix::sys::memfd::{memfd_create, MFdFlags};
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let err = |step| move |source| TokenError::Page { step, source };
        let fd = memfd_create(
            c"gpushare-token",
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(err("memfd_create"))?;
        nix::unistd::ftruncate(&fd, TOKEN_PAGE_SIZE as i64).map_err(err("ftruncate"))?;
        let length = NonZeroUsize::new(TOKEN_PAGE_SIZE).expect("non-zero");
        // SAFETY: a new shared mapping of a memfd we own, at a kernel-chosen address.
        let address = unsafe {
            mmap(
                None,
                length,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(err("mmap"))?;
        let page = address.cast::<TokenPage>();
        // SAFETY: the mapping is TOKEN_PAGE_SIZE bytes, page-aligned (≥ TokenPage's
        // 64-byte alignment), and nobody else can see it yet.
        unsafe { page.as_ptr().write(TokenPage::new()) };
        let mapping = PageMapping { page };
        // FUTURE_WRITE (Linux 5.1) forbids new writable mappings and write(2), while
        // ours stays writable: the client can then only map the page read-only.
        let sealed = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        match fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(sealed | SealFlag::F_SEAL_FUTURE_WRITE),
        ) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINVAL) => {
                tracing::debug!("F_SEAL_FUTURE_WRITE unsupported; sealing the size only");
                fcntl(&fd, FcntlArg::F_ADD_SEALS(sealed)).map_err(err("F_ADD_SEALS"))?;
            }
            Err(e) => return Err(err("F_ADD_SEALS")(e)),
        }
        Ok((mapping, fd))
    }

    fn page(&self) -> &TokenPage {
        // SAFETY: mapped for as long as `self` lives.
        unsafe { self.page.as_ref() }
    }

    /// Publishes a change: everything stored before is visible to a client that sees
    /// the new `seq` (Release), and a client blocked on `seq` wakes (by the caller,
    /// after it dropped its lock).
    fn bump(&self) {
        self.page().seq.fetch_add(1, Ordering::Release);
    }

    /// Changes the page for `action` and returns true, or false when the action only
    /// reports something (the page stays as it is: nothing to publish).
    fn apply(&self, action: &Action) -> bool {
        let page = self.page();
        match *action {
            Action::Grant {
                deadline_ns,
                launch_ahead,
                ..
            } => {
                // Order per token.rs: limits, then the deadline, then seq.
                page.launch_ahead.store(launch_ahead, Ordering::Relaxed);
                page.deadline_ns.store(deadline_ns, Ordering::Release);
                page.grants.fetch_add(1, Ordering::Release);
            }
            Action::Revoke { .. } => page.deadline_ns.store(NOT_HELD, Ordering::Release),
            Action::SetLaunchAhead { n, .. } => page.launch_ahead.store(n, Ordering::Release),
            Action::SetFitBy { fit_by_ns, .. } => {
                page.fit_by_ns.store(fit_by_ns, Ordering::Release)
            }
            Action::Overdue { .. } | Action::Recovered { .. } => return false,
        }
        self.bump();
        true
    }

    /// The lease ended: the client must stop for good (the only cut-off there is).
    fn cut_off(&self) {
        let page = self.page();
        page.flags.fetch_or(FLAG_CUT_OFF, Ordering::Relaxed);
        page.deadline_ns.store(NOT_HELD, Ordering::Release);
    }
}

impl Drop for PageMapping {
    fn drop(&mut self) {
        // SAFETY: mapped by `create`, unmapped once, here.
        let _ = unsafe { nix::sys::mman::munmap(self.page.cast(), TOKEN_PAGE_SIZE) };
    }
}

// ----- one GPU -----

struct Registered {
    page: Arc<PageMapping>,
    /// A second handle on the connection, to close it from outside its thread.
    stream: UnixStream,
    lease: LeaseId,
    pid: Option<u32>,
    priority: Priority,
    /// Its latest admission report (cumulative since it connected).
    fit: FitCounts,
}

struct GpuState {
    policy: TokenPolicy,
    clients: HashMap<ClientId, Registered>,
    /// Every client's admission reports summed, gone clients included (monotonic).
    fit_totals: FitCounts,
    /// What the timer thread sleeps until (None: until notified).
    timer_at: Option<u64>,
}

struct GpuToken {
    gpu: String,
    state: Mutex<GpuState>,
    timer: Condvar,
}

impl GpuToken {
    fn lock(&self) -> MutexGuard<'_, GpuState> {
        // The policy is updated in one call; a panic cannot leave it half-changed
        // in a way that is worse than stopping the GPU's token altogether.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One policy step and its page changes. Wakes happen after the lock is dropped,
    /// so the woken client's first frame does not find the lock still held.
    fn handle(&self, event: Event) {
        let mut wakes: Vec<Arc<PageMapping>> = Vec::new();
        let notify_timer;
        {
            let mut state = self.lock();
            if let Event::Release { client, .. } = event {
                // The page must not go on saying "held" after the client gave it back,
                // or its next launch would pass the check; a grant in this same step
                // (again = true) overwrites it. Nobody waits on it: no bump.
                if let Some(registered) = state.clients.get(&client) {
                    let page = registered.page.page();
                    page.deadline_ns.store(NOT_HELD, Ordering::Release);
                }
            }
            let actions = state.policy.handle(monotonic_ns(), event);
            for action in &actions {
                self.apply(&mut state, action, &mut wakes);
            }
            notify_timer = match (state.policy.next_wakeup(), state.timer_at) {
                (Some(next), Some(sleeping_until)) => next < sleeping_until,
                (Some(_), None) => true,
                (None, _) => false,
            };
        }
        for page in wakes {
            futex_wake(&page.page().seq);
        }
        if notify_timer {
            self.timer.notify_one();
        }
    }

    fn apply(&self, state: &mut GpuState, action: &Action, wakes: &mut Vec<Arc<PageMapping>>) {
        let client = match *action {
            Action::Grant { client, .. }
            | Action::Revoke { client }
            | Action::SetLaunchAhead { client, .. }
            | Action::SetFitBy { client, .. }
            | Action::Overdue { client }
            | Action::Recovered { client, .. } => client,
        };
        let Some(registered) = state.clients.get(&client) else {
            return;
        };
        if registered.page.apply(action) {
            wakes.push(registered.page.clone());
        }
        match *action {
            Action::Overdue { .. } => {
                tracing::warn!(gpu = %self.gpu, lease = %registered.lease, pid = ?registered.pid, "token client overdue: revoked and not released within scheduler.revoke_grace_ms; no longer waited for (a long kernel or CUDA graph is still draining, or its agent is stuck)");
            }
            Action::Recovered { drained_ns, .. } => {
                tracing::info!(gpu = %self.gpu, lease = %registered.lease, pid = ?registered.pid, drained_ms = drained_ns / 1_000_000, "overdue token client released; scheduled as usual again");
            }
            _ => {}
        }
    }

    fn run_timer(&self) {
        loop {
            let mut state = self.lock();
            let now = monotonic_ns();
            match state.policy.next_wakeup() {
                Some(at) if at <= now => {
                    state.timer_at = None;
                    drop(state);
                    self.handle(Event::Tick);
                }
                Some(at) => {
                    state.timer_at = Some(at);
                    let _unused = self
                        .timer
                        .wait_timeout(state, Duration::from_nanos(at - now))
                        .unwrap_or_else(|p| p.into_inner());
                }
                None => {
                    state.timer_at = None;
                    let _unused = self.timer.wait(state).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    fn status(&self, policy: SchedulingPolicy) -> TokenStatus {
        let state = self.lock();
        let snapshot = state.policy.snapshot();
        let describe = |ids: &[ClientId]| -> Vec<TokenHolder> {
            ids.iter()
                .filter_map(|id| state.clients.get(id))
                .map(|r| TokenHolder {
                    lease: r.lease.clone(),
                    pid: r.pid,
                    priority: r.priority,
                })
                .collect()
        };
        TokenStatus {
            gpu: self.gpu.clone(),
            policy: match policy {
                SchedulingPolicy::Priority => "priority",
                SchedulingPolicy::RoundRobin => "round-robin",
                SchedulingPolicy::Off => "off",
            }
            .into(),
            holders: describe(&snapshot.holders),
            clients: snapshot.clients,
            waiting: snapshot.waiting,
            grants: snapshot.grants,
            revocations: snapshot.revocations,
            // Nobody is cut off for a slow drain any more; a lease's end is routine.
            cut_offs: 0,
            overdue: snapshot.overdue_total,
            overdue_clients: describe(&snapshot.overdue),
            admission: AdmissionStatus {
                windows: snapshot.windows,
                early_returns: snapshot.early_returns,
                high_gaps_us: snapshot.high_gaps.iter().map(|g| g / 1_000).collect(),
                launches: state.fit_totals,
                waiting_for_window: snapshot
                    .needs
                    .iter()
                    .filter_map(|(id, need)| {
                        state.clients.get(id).map(|r| WindowWaiter {
                            lease: r.lease.clone(),
                            pid: r.pid,
                            need_us: need / 1_000,
                        })
                    })
                    .collect(),
            },
        }
    }

    /// A client's admission report: the GPU's totals grow by what is new in it (the
    /// counts are cumulative per connection, so a repeated report adds nothing).
    fn record_fit(&self, client: ClientId, counts: FitCounts) {
        let mut state = self.lock();
        let GpuState {
            clients,
            fit_totals,
            ..
        } = &mut *state;
        let Some(registered) = clients.get_mut(&client) else {
            return;
        };
        let before = registered.fit;
        let grow = |total: &mut u64, now: u64, was: u64| *total += now.saturating_sub(was);
        grow(&mut fit_totals.fitted, counts.fitted, before.fitted);
        grow(
            &mut fit_totals.unestimated,
            counts.unestimated,
            before.unestimated,
        );
        grow(
            &mut fit_totals.held_back,
            counts.held_back,
            before.held_back,
        );
        grow(&mut fit_totals.overran, counts.overran, before.overran);
        grow(
            &mut fit_totals.overran_ns,
            counts.overran_ns,
            before.overran_ns,
        );
        registered.fit = counts;
    }
}

// ----- the service -----

/// What the arbiter recorded for the lease a token connection belongs to.
#[derive(Debug, Clone)]
pub struct TokenLease {
    pub lease: LeaseId,
    pub gpu: String,
    pub priority: Priority,
    pub request: f64,
    pub limit: f64,
}

/// Every GPU's token; shared by the lease sockets (new connections), the lease
/// table (closing a lease) and status.
pub struct TokenService {
    config: SchedulerConfig,
    gpus: Mutex<HashMap<String, Arc<GpuToken>>>,
    next_client: AtomicU64,
}

impl TokenService {
    pub fn new(config: SchedulerConfig) -> Arc<TokenService> {
        Arc::new(TokenService {
            config,
            gpus: Mutex::new(HashMap::new()),
            next_client: AtomicU64::new(1),
        })
    }

    pub fn policy(&self) -> SchedulingPolicy {
        self.config.policy
    }

    fn gpu(&self, uuid: &str) -> Arc<GpuToken> {
        let mut gpus = self.gpus.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(gpu) = gpus.get(uuid) {
            return gpu.clone();
        }
        let gpu = Arc::new(GpuToken {
            gpu: uuid.to_owned(),
            state: Mutex::new(GpuState {
                policy: TokenPolicy::new(&self.config),
                clients: HashMap::new(),
                fit_totals: FitCounts::default(),
                timer_at: None,
            }),
            timer: Condvar::new(),
        });
        let timer = gpu.clone();
        std::thread::Builder::new()
            .name("token-timer".into())
            .spawn(move || timer.run_timer())
            .expect("spawning a token timer thread");
        gpus.insert(uuid.to_owned(), gpu.clone());
        gpu
    }

    /// Takes over a connection that asked to be scheduled (and passed the checks):
    /// from here on it is served by a thread of its own.
    pub fn serve(self: &Arc<Self>, stream: UnixStream, lease: TokenLease, pid: Option<u32>) {
        let service = self.clone();
        let spawned = std::thread::Builder::new()
            .name("token-conn".into())
            .spawn(move || {
                if let Err(e) = service.run_connection(stream, lease.clone(), pid) {
                    tracing::debug!(lease = %lease.lease, error = %e, "token connection closed");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot spawn a token connection thread");
        }
    }

    fn run_connection(
        &self,
        mut stream: UnixStream,
        lease: TokenLease,
        pid: Option<u32>,
    ) -> Result<(), TokenError> {
        let (page, fd) = match PageMapping::create() {
            Ok(created) => created,
            Err(e) => {
                let refusal = LeaseResponse::Error {
                    kind: ErrorKind::Internal,
                    message: format!("{e}; the client runs ungated"),
                };
                let _ = frame::write_message(&mut stream, &refusal);
                return Err(e);
            }
        };
        let client = self.next_client.fetch_add(1, Ordering::Relaxed);
        let gpu = self.gpu(&lease.gpu);
        {
            let mut state = gpu.lock();
            state.clients.insert(
                client,
                Registered {
                    page: Arc::new(page),
                    stream: stream.try_clone()?,
                    lease: lease.lease.clone(),
                    pid,
                    priority: lease.priority,
                    fit: FitCounts::default(),
                },
            );
        }
        gpu.handle(Event::Join {
            client,
            priority: lease.priority,
            request: lease.request,
            limit: lease.limit,
        });
        tracing::info!(gpu = %lease.gpu, lease = %lease.lease, ?pid, priority = ?lease.priority, "token client joined");
        // The interposer decides from `priority` whether it may submit before a grant;
        // the round-robin baseline has no classes, so everyone waits for the token.
        let class_for_client = match self.config.policy {
            SchedulingPolicy::RoundRobin => Priority::Low,
            _ => lease.priority,
        };
        let terms = ScheduleTerms {
            gpu: lease.gpu.clone(),
            priority: class_for_client,
            idle_ns: self.config.idle_us * 1_000,
            on_arbiter_loss: self.config.on_arbiter_loss(lease.priority),
            fit_launches: self.config.admit_by_duration
                && self.config.policy == SchedulingPolicy::Priority,
        };
        let result = send_scheduled(&stream, &terms, &fd).and_then(|()| {
            drop(fd);
            stream.set_write_timeout(None)?;
            loop {
                let event = match read_request(&mut stream)? {
                    TokenRequest::Want => Event::Want { client },
                    TokenRequest::Release { again } => Event::Release { client, again },
                    TokenRequest::Fit { need_ns, counts } => {
                        gpu.record_fit(client, counts);
                        Event::Need { client, need_ns }
                    }
                };
                gpu.handle(event);
            }
        });
        // EOF, a protocol error, or the arbiter closed it: the token is lost at once.
        gpu.handle(Event::Leave { client });
        gpu.lock().clients.remove(&client);
        tracing::info!(gpu = %lease.gpu, lease = %lease.lease, ?pid, "token client left");
        match result {
            Err(TokenError::Frame(FrameError::Closed)) => Ok(()),
            other => other,
        }
    }

    /// The lease ended: its clients are flagged cut off (the only cut-off there is:
    /// nobody is cut off for a slow drain) and their connections closed, which loses
    /// their tokens. Not counted: the processes of an ended lease are normally gone or
    /// going, their EOF merely not seen yet.
    pub fn close_lease(&self, lease: &LeaseId) {
        let gpus: Vec<Arc<GpuToken>> = self
            .gpus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for gpu in gpus {
            let state = gpu.lock();
            for registered in state.clients.values().filter(|r| &r.lease == lease) {
                registered.page.cut_off();
                registered.page.bump();
                futex_wake(&registered.page.page().seq);
                let _ = registered.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    pub fn status(&self) -> Vec<TokenStatus> {
        let gpus: Vec<Arc<GpuToken>> = self
            .gpus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        let mut status: Vec<TokenStatus> =
            gpus.iter().map(|g| g.status(self.config.policy)).collect();
        status.sort_by(|a, b| a.gpu.cmp(&b.gpu));
        status
    }
}

/// The `Scheduled` frame, with the page's descriptor attached to its first byte.
fn send_scheduled(
    stream: &UnixStream,
    terms: &ScheduleTerms,
    fd: &OwnedFd,
) -> Result<(), TokenError> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
    stream.set_write_timeout(Some(SEND_TIMEOUT))?;
    let bytes = frame::encode(&LeaseResponse::Scheduled(terms.clone()))?;
    let fds = [fd.as_raw_fd()];
    let sent = sendmsg::<UnixAddr>(
        stream.as_raw_fd(),
        &[IoSlice::new(&bytes)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(TokenError::Send)?;
    // A stream socket may take part of it; the descriptor went with the first byte.
    (&*stream).write_all(&bytes[sent..])?;
    Ok(())
}

/// One `TokenRequest` frame, at most [`MAX_TOKEN_FRAME`] bytes.
fn read_request(stream: &mut UnixStream) -> Result<TokenRequest, TokenError> {
    let mut header = [0u8; 4];
    match stream.read_exact(&mut header) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed.into()),
        other => other?,
    }
    let length = u32::from_be_bytes(header) as usize;
    if length > MAX_TOKEN_FRAME - 4 {
        return Err(TokenError::Oversized(length + 4));
    }
    let mut body = [0u8; MAX_TOKEN_FRAME];
    stream.read_exact(&mut body[..length])?;
    serde_json::from_slice(&body[..length]).map_err(TokenError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_initialised_and_sealed_against_writable_mappings() {
        let (mapping, fd) = PageMapping::create().unwrap();
        assert_eq!(
            mapping.page().magic.load(Ordering::Relaxed),
            gpushare_proto::token::TOKEN_PAGE_MAGIC
        );
        let seals = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GET_SEALS).unwrap();
        assert_ne!(seals & libc::F_SEAL_SHRINK, 0);
        assert_ne!(seals & libc::F_SEAL_GROW, 0);
        if seals & libc::F_SEAL_FUTURE_WRITE != 0 {
            // SAFETY: probing a fresh mapping; unmapped right away if it succeeds.
            let writable = unsafe {
                nix::sys::mman::mmap(
                    None,
                    NonZeroUsize::new(TOKEN_PAGE_SIZE).unwrap(),
                    nix::sys::mman::ProtFlags::PROT_WRITE,
                    nix::sys::mman::MapFlags::MAP_SHARED,
                    &fd,
                    0,
                )
            };
            assert!(writable.is_err(), "a client could map the page writable");
        }
        assert!(mapping.apply(&Action::Grant {
            client: 1,
            deadline_ns: 42,
            launch_ahead: 3,
        }));
        let page = mapping.page();
        assert_eq!(page.deadline_ns.load(Ordering::Acquire), 42);
        assert_eq!(page.launch_ahead.load(Ordering::Relaxed), 3);
        assert_eq!(page.grants.load(Ordering::Relaxed), 1);
        assert_eq!(page.seq.load(Ordering::Relaxed), 1);
        // Reports leave the page alone: an overdue client is neither woken nor flagged.
        assert!(!mapping.apply(&Action::Overdue { client: 1 }));
        assert_eq!(page.seq.load(Ordering::Relaxed), 1);
        assert_eq!(page.deadline_ns.load(Ordering::Acquire), 42);
        mapping.cut_off();
        assert_eq!(page.deadline_ns.load(Ordering::Acquire), NOT_HELD);
        assert_eq!(page.flags.load(Ordering::Relaxed), FLAG_CUT_OFF);
    }

    #[test]
    fn token_frames_are_bounded_and_must_be_requests() {
        for (bytes, expect) in [
            (
                frame::encode(&TokenRequest::Release { again: true }).unwrap(),
                "ok",
            ),
            (
                {
                    let mut b = (1000u32).to_be_bytes().to_vec();
                    b.extend([b'x'; 8]);
                    b
                },
                "1004-byte",
            ),
            (frame::encode(&"hello").unwrap(), "not a token request"),
        ] {
            let (mut ours, mut theirs) = UnixStream::pair().unwrap();
            theirs.write_all(&bytes).unwrap();
            match read_request(&mut ours) {
                Ok(request) => {
                    assert_eq!(expect, "ok");
                    assert_eq!(request, TokenRequest::Release { again: true });
                }
                Err(e) => assert!(e.to_string().contains(expect), "{e}"),
            }
        }
    }
}
