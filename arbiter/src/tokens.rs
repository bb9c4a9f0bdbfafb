//! The time-slice token's I/O edge: one scheduler per GPU (the pure
//! [`TokenPolicy`] behind a mutex, the pages of its clients, a timer thread), the
//! shared pages themselves (memfd, mapped writable here, sealed so the client can
//! only map them read-only), and one I/O thread per GPU serving every token
//! connection of that GPU (epoll, through mio).
//!
//! Token traffic never goes through the async runtime: a handoff is a frame read by
//! the GPU's I/O thread, a policy step and a few stores plus `FUTEX_WAKE` on the next
//! holder's page — tens of microseconds, which a hop through tokio's scheduler would
//! multiply. Why not a thread per connection (the first version): a container could
//! open thousands of token connections and with them thousands of arbiter threads;
//! an idle connection now costs a descriptor, a page and a slot in the GPU's table.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use gpushare_config::{SchedulerConfig, SchedulingPolicy};
use gpushare_proto::frame::{self, FrameError};
use gpushare_proto::token::{FLAG_CUT_OFF, NOT_HELD, TOKEN_PAGE_SIZE};
use gpushare_proto::token_client::futex_wake;
use gpushare_proto::{
    AdmissionStatus, ErrorKind, FitCounts, GpuTimeline, LeaseGpuTime, LeaseId, LeaseResponse,
    Priority, ScheduleTerms, TimelineReport, TokenHold, TokenHolder, TokenPage, TokenRequest,
    TokenStatus, Violation, ViolationKind, WindowWaiter,
};

use crate::connections::{ConnectionBudget, Permit};
use crate::gpu_time::{HeldWindow, Hold, HoldRing};
use crate::peer_clock::{self, ClockOffset};
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
    #[error("reading the clock offset of token client pid {pid:?} (/proc/<pid>/timens_offsets): {source}")]
    PeerClock { pid: Option<u32>, source: io::Error },
    #[error("a {0}-byte frame on a token connection (at most {MAX_TOKEN_FRAME})")]
    Oversized(usize),
    #[error("not a token request: {0}")]
    Malformed(serde_json::Error),
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the clients compare deadlines with.
pub use gpushare_types::monotonic_ns;

// ----- the page -----

/// The arbiter's writable mapping of one client's page.
struct PageMapping {
    page: NonNull<TokenPage>,
    /// The client's clock: every instant goes onto the page in it.
    clock: ClockOffset,
}

// SAFETY: the mapping is only accessed through the page's atomics.
unsafe impl Send for PageMapping {}
// SAFETY: as above.
unsafe impl Sync for PageMapping {}

impl PageMapping {
    /// A fresh memfd holding an initialised page, mapped writable here and sealed
    /// so that nobody else can ever map it writable or change its size.
    fn create(clock: ClockOffset) -> Result<(PageMapping, OwnedFd), TokenError> {
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
        let mapping = PageMapping { page, clock };
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
                page.deadline_ns
                    .store(self.clock.to_client(deadline_ns), Ordering::Release);
                page.grants.fetch_add(1, Ordering::Release);
            }
            Action::Revoke { .. } => page.deadline_ns.store(NOT_HELD, Ordering::Release),
            Action::SetLaunchAhead { n, .. } => page.launch_ahead.store(n, Ordering::Release),
            Action::SetFitBy { fit_by_ns, .. } => page
                .fit_by_ns
                .store(self.clock.to_client(fit_by_ns), Ordering::Release),
            Action::Overdue { .. } | Action::Overrun { .. } | Action::Recovered { .. } => {
                return false
            }
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
    /// The connection, shared with the GPU's I/O thread, to close it from outside.
    stream: Arc<UnixStream>,
    lease: LeaseId,
    pid: Option<u32>,
    priority: Priority,
    /// Its latest admission report (cumulative since it connected).
    fit: FitCounts,
    /// Since when it holds the token (granted and not yet released), and how long it
    /// held it before: the watchdog compares this with the GPU time NVML saw it use.
    held_since: Option<u64>,
    held_ns: u64,
    /// Its lease's account on this GPU (`GpuState::accounts`).
    account: u64,
    /// It overran beside an active high-priority job: from this instant on its hold is
    /// the high job's time, counted as overrun and not as token time.
    overrun_from: Option<u64>,
    /// The parts of its ended holds that were overruns (ns).
    overran_ns: u64,
}

impl Registered {
    /// Its token time up to `now`: an open hold counts until it overran, if it did.
    fn held_ns_at(&self, now: u64) -> u64 {
        self.held_ns
            + self.held_since.map_or(0, |since| {
                let until = self
                    .overrun_from
                    .map_or(now, |from| from.max(since).min(now));
                until.saturating_sub(since)
            })
    }

    /// Its overrun time up to `now`, the open hold's included.
    fn overran_ns_at(&self, now: u64) -> u64 {
        self.overran_ns
            + match (self.held_since, self.overrun_from) {
                (Some(since), Some(from)) => now.saturating_sub(from.max(since)),
                _ => 0,
            }
    }
}

/// One lease's GPU time on one GPU, kept while the lease lives and, after it ended,
/// while the timeline still shows one of its holds.
struct LeaseAccount {
    lease: LeaseId,
    container: String,
    priority: Priority,
    /// Every ended hold of every client it had, gone ones included.
    held_ns: u64,
    recent: HeldWindow,
    /// Its clients connected now.
    clients: usize,
    /// The lease ended (`close_lease`).
    closed: bool,
    revocations: u64,
    cut_offs: u64,
    overdue: u64,
    overruns: u64,
}

/// Holds the timeline keeps per GPU, at most: at a hold every 10 ms (a tight
/// time-slicing rhythm, merged where one lease holds back to back) about 10 minutes.
pub const TIMELINE_HOLDS: usize = 65_536;
/// And none that ended longer ago than this.
pub const TIMELINE_KEEP_NS: u64 = 10 * 60 * 1_000_000_000;

struct GpuState {
    policy: TokenPolicy,
    clients: HashMap<ClientId, Registered>,
    /// Per-lease GPU time, by account number (never reused).
    accounts: HashMap<u64, LeaseAccount>,
    /// Who held the token when, recently.
    timeline: HoldRing,
    /// Every client's admission reports summed, gone clients included (monotonic).
    fit_totals: FitCounts,
    /// What the timer thread sleeps until (None: until notified).
    timer_at: Option<u64>,
    /// Drains past the grace beside an active high job, summed (ns, ended ones).
    overrun_ns: u64,
    /// Overruns found in the current step, reported once the GPU's lock is dropped.
    to_report: Vec<Violation>,
}

struct GpuToken {
    gpu: String,
    overruns: Arc<OverrunLog>,
    state: Mutex<GpuState>,
    timer: Condvar,
    /// Hands new connections to the GPU's I/O thread.
    io: IoHandoff,
    /// Its timer and I/O threads' failures (panics), each followed by a restart.
    restarts: ThreadRestarts,
}

impl GpuState {
    /// A client's hold ended at `now`: its lease's account and the timeline learn it.
    /// No allocation: the account exists since the client joined, the ring is sized.
    fn end_hold(&mut self, client: ClientId, now: u64) {
        let Some(registered) = self.clients.get_mut(&client) else {
            return;
        };
        let Some(since) = registered.held_since.take() else {
            return;
        };
        // The part of a drain past the grace beside an active high job is not token
        // time: it was taken from the high job (the watchdog's ungated check must not
        // count it as gated).
        let overrun_from = registered.overrun_from.take().map(|from| from.max(since));
        let gated_until = overrun_from.map_or(now, |from| from.min(now));
        registered.held_ns += gated_until.saturating_sub(since);
        registered.overran_ns += now.saturating_sub(gated_until);
        self.overrun_ns += now.saturating_sub(gated_until);
        let account = registered.account;
        if let Some(a) = self.accounts.get_mut(&account) {
            a.held_ns += now.saturating_sub(since);
            a.recent.add(since, now);
        }
        self.timeline.push(Hold {
            account,
            start_ns: since,
            end_ns: now,
        });
    }

    /// Forgets ended leases the timeline no longer shows (on a join: rare, and the
    /// only time an account is added).
    fn prune_accounts(&mut self) {
        let timeline = &self.timeline;
        self.accounts
            .retain(|id, a| !a.closed || a.clients > 0 || timeline.references(*id));
    }
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
        #[cfg(test)]
        tests::maybe_inject_panic(&event);
        let mut wakes: Vec<Arc<PageMapping>> = Vec::new();
        let notify_timer;
        let reports;
        {
            let mut state = self.lock();
            let now = monotonic_ns();
            if let Event::Release { client, .. } = event {
                // The page must not go on saying "held" after the client gave it back,
                // or its next launch would pass the check; a grant in this same step
                // (again = true) overwrites it. Nobody waits on it: no bump.
                if let Some(registered) = state.clients.get(&client) {
                    let page = registered.page.page();
                    page.deadline_ns.store(NOT_HELD, Ordering::Release);
                }
            }
            let actions = state.policy.handle(now, event);
            if let Event::Release { client, .. } = event {
                // Ended before this step's actions, so that a grant in it (again =
                // true) starts a new hold; an overrun judged at this release splits
                // the hold that ends here.
                let overran_from = actions.iter().find_map(|a| match *a {
                    Action::Overrun {
                        client: c, from_ns, ..
                    } if c == client => Some(from_ns),
                    _ => None,
                });
                if let (Some(from), Some(registered)) =
                    (overran_from, state.clients.get_mut(&client))
                {
                    registered.overrun_from = Some(from);
                }
                state.end_hold(client, now);
            }
            for action in &actions {
                self.apply(&mut state, action, &mut wakes);
            }
            notify_timer = match (state.policy.next_wakeup(), state.timer_at) {
                (Some(next), Some(sleeping_until)) => next < sleeping_until,
                (Some(_), None) => true,
                (None, _) => false,
            };
            reports = std::mem::take(&mut state.to_report);
        }
        // The reporter takes the arbiter's lock, and the arbiter's status reads GPU
        // time under it (a GPU's lock inside the arbiter's): ours is dropped first.
        for violation in reports {
            self.overruns.report(violation);
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
            | Action::Overrun { client, .. }
            | Action::Recovered { client, .. } => client,
        };
        let Some(registered) = state.clients.get_mut(&client) else {
            return;
        };
        if matches!(action, Action::Grant { .. }) && registered.held_since.is_none() {
            registered.held_since = Some(monotonic_ns());
        }
        if registered.page.apply(action) {
            wakes.push(registered.page.clone());
        }
        let account = registered.account;
        if let Some(a) = state.accounts.get_mut(&account) {
            match action {
                Action::Revoke { .. } => a.revocations += 1,
                Action::Overdue { .. } => a.overdue += 1,
                Action::Overrun { .. } => a.overruns += 1,
                _ => {}
            }
        }
        if let Action::Overrun { from_ns, .. } = *action {
            // Splits the hold still open (a drain past the grace, or a client that
            // went); a hold its release already ended was split there.
            if let Some(registered) = state
                .clients
                .get_mut(&client)
                .filter(|r| r.held_since.is_some())
            {
                registered.overrun_from = Some(from_ns);
            }
            if let Some(registered) = state.clients.get(&client) {
                let violation = Violation {
                    kind: ViolationKind::Overrun,
                    gpu: self.gpu.clone(),
                    pid: registered.pid.unwrap_or(0),
                    lease: Some(registered.lease.clone()),
                    memory_used: 0,
                    memory_quota: None,
                    killed: false,
                };
                state.to_report.push(violation);
            }
        }
        let Some(registered) = state.clients.get(&client) else {
            return;
        };
        match *action {
            Action::Overdue { .. } => {
                tracing::warn!(gpu = %self.gpu, lease = %registered.lease, pid = ?registered.pid, "token client overdue: revoked and not released within scheduler.revoke_grace_ms; no longer waited for (a long kernel or CUDA graph is still draining, or its agent is stuck)");
            }
            Action::Overrun { .. } => {
                tracing::warn!(gpu = %self.gpu, lease = %registered.lease, pid = ?registered.pid, "token client overran: revoked while a high-priority job is active and still running after scheduler.revoke_grace_ms, or past its admission window by more than scheduler.window_overrun_grace_ms; its lease gets no admission window for scheduler.overrun_penalty_ms (a launch its interposer had never measured, a new process, or launches past the gate)");
            }
            Action::Recovered { drained_ns, .. } => {
                tracing::info!(gpu = %self.gpu, lease = %registered.lease, pid = ?registered.pid, drained_ms = drained_ns / 1_000_000, "overdue token client released; scheduled as usual again");
            }
            _ => {}
        }
    }

    /// The GPU's timer thread; a panic in a policy step restarts it.
    fn run_timer(&self) {
        while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve_timer())).is_err()
        {
            self.restarts.failed(&self.gpu, "token-timer");
        }
    }

    fn serve_timer(&self) {
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
            thread_restarts: self.restarts.count.load(Ordering::Relaxed),
            thread_failed_recently: self.restarts.recent(monotonic_ns()),
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
                measured_overruns: snapshot.overruns,
                measured_overrun_ms: state.overrun_ns / 1_000_000,
                penalized_leases: snapshot
                    .penalized
                    .iter()
                    .filter_map(|account| state.accounts.get(account))
                    .map(|a| a.lease.clone())
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
        // The counts are the client's word: a total saturates rather than overflows
        // (a panic here would stop the GPU's token for everyone).
        let grow = |total: &mut u64, now: u64, was: u64| {
            *total = total.saturating_add(now.saturating_sub(was));
        };
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

// ----- the GPU's I/O thread -----

/// What the I/O thread keeps across a restart: its epoll set and connections, and
/// which connection it was serving (the one a panic is blamed on).
struct IoLoop {
    poll: mio::Poll,
    connections: HashMap<ClientId, Connection>,
    serving: Option<ClientId>,
}

/// How long after a token thread's failure the arbiter reports itself unhealthy.
pub const THREAD_FAILURE_SHOWN_NS: u64 = 60 * 1_000_000_000;

/// A GPU's token thread failures: counted, and the latest one's time.
#[derive(Default)]
struct ThreadRestarts {
    count: AtomicU64,
    /// CLOCK_MONOTONIC of the latest failure; 0: none yet.
    latest_ns: AtomicU64,
}

impl ThreadRestarts {
    fn failed(&self, gpu: &str, thread: &str) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.latest_ns
            .store(monotonic_ns().max(1), Ordering::Relaxed);
        tracing::error!(gpu = %gpu, thread, "a token thread failed (panicked) and was restarted; its clients go on being scheduled, the connection it was serving was dropped");
    }

    /// Whether a failure happened within [`THREAD_FAILURE_SHOWN_NS`] of `now`.
    fn recent(&self, now: u64) -> bool {
        let latest = self.latest_ns.load(Ordering::Relaxed);
        latest != 0 && now.saturating_sub(latest) < THREAD_FAILURE_SHOWN_NS
    }
}

/// The waker's token; clients' tokens are their ids, which start at 1.
const WAKE: mio::Token = mio::Token(0);

/// A connection on its way to the GPU's I/O thread.
struct Arriving {
    client: ClientId,
    connection: Connection,
}

/// The GPU's side of its I/O thread: new connections are queued here and the thread
/// is woken to register them.
struct IoHandoff {
    arriving: Mutex<Vec<Arriving>>,
    waker: mio::Waker,
}

impl IoHandoff {
    fn new() -> io::Result<(IoHandoff, mio::Poll)> {
        let poll = mio::Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let handoff = IoHandoff {
            arriving: Mutex::new(Vec::new()),
            waker,
        };
        Ok((handoff, poll))
    }

    fn hand_over(&self, arriving: Arriving) {
        self.arriving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(arriving);
        if let Err(e) = self.waker.wake() {
            tracing::error!(error = %e, "cannot wake the token I/O thread");
        }
    }

    fn take(&self) -> Vec<Arriving> {
        std::mem::take(&mut *self.arriving.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One token connection as its I/O thread holds it: the socket, the bytes of a frame
/// not yet complete, and its place in the connection budget.
struct Connection {
    stream: Arc<UnixStream>,
    buffer: [u8; MAX_TOKEN_FRAME],
    filled: usize,
    _permit: Permit,
}

impl Connection {
    fn new(stream: Arc<UnixStream>, permit: Permit) -> Connection {
        Connection {
            stream,
            buffer: [0; MAX_TOKEN_FRAME],
            filled: 0,
            _permit: permit,
        }
    }

    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Reads what the socket has (edge-triggered: until it would block) and passes
    /// every complete request to `handle`. Err ends the connection (EOF included).
    fn pump(&mut self, mut handle: impl FnMut(TokenRequest)) -> Result<(), TokenError> {
        loop {
            let read = (&*self.stream).read(&mut self.buffer[self.filled..]);
            match read {
                Ok(0) => return Err(FrameError::Closed.into()),
                Ok(n) => self.filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
            while let Some(request) = self.next_request()? {
                handle(request);
            }
        }
    }

    /// The first complete frame in the buffer, removed from it.
    fn next_request(&mut self) -> Result<Option<TokenRequest>, TokenError> {
        let Some(length) = frame_length(&self.buffer[..self.filled])? else {
            return Ok(None);
        };
        let end = 4 + length;
        if self.filled < end {
            return Ok(None);
        }
        let request = serde_json::from_slice(&self.buffer[4..end]).map_err(TokenError::Malformed);
        self.buffer.copy_within(end..self.filled, 0);
        self.filled -= end;
        request.map(Some)
    }
}

/// The body length a frame header announces, once all four bytes are there; a frame
/// longer than [`MAX_TOKEN_FRAME`] is refused before any of its body is read.
fn frame_length(bytes: &[u8]) -> Result<Option<usize>, TokenError> {
    let Some(header) = bytes.first_chunk::<4>() else {
        return Ok(None);
    };
    let length = u32::from_be_bytes(*header) as usize;
    if length > MAX_TOKEN_FRAME - 4 {
        return Err(TokenError::Oversized(length.saturating_add(4)));
    }
    Ok(Some(length))
}

impl GpuToken {
    /// The GPU's I/O thread: every token connection of the GPU, on one epoll set. A
    /// panic while serving one connection drops that connection (its token is lost, as
    /// at its death) and the loop starts again with every other connection still
    /// registered, so their clients go on being granted.
    fn run_io(&self, poll: mio::Poll) {
        let mut io = IoLoop {
            poll,
            connections: HashMap::new(),
            serving: None,
        };
        let mut restarted = false;
        while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if restarted {
                self.recover_io(&mut io);
            }
            self.serve_io(&mut io)
        }))
        .is_err()
        {
            self.restarts.failed(&self.gpu, "token-io");
            restarted = true;
        }
    }

    /// After a failure: the connection being served is dropped, and whatever the
    /// failed step left undone (a grant, a wake) is decided again.
    fn recover_io(&self, io: &mut IoLoop) {
        if let Some(client) = io.serving.take() {
            if let Some(connection) = io.connections.remove(&client) {
                let fd = connection.fd();
                let _ = io.poll.registry().deregister(&mut mio::unix::SourceFd(&fd));
            }
            self.leave(client, None);
        }
        self.handle(Event::Tick);
    }

    fn serve_io(&self, io: &mut IoLoop) {
        let IoLoop {
            poll,
            connections,
            serving,
        } = io;
        let mut events = mio::Events::with_capacity(256);
        loop {
            if let Err(e) = poll.poll(&mut events, None) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(gpu = %self.gpu, error = %e, "token I/O poll failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            for event in events.iter() {
                if event.token() == WAKE {
                    for arriving in self.io.take() {
                        let fd = arriving.connection.fd();
                        let token = mio::Token(arriving.client as usize);
                        let registered = poll.registry().register(
                            &mut mio::unix::SourceFd(&fd),
                            token,
                            mio::Interest::READABLE,
                        );
                        match registered {
                            // Registering a socket that is already readable reports
                            // it, so a request sent before this moment is not lost.
                            Ok(()) => {
                                connections.insert(arriving.client, arriving.connection);
                            }
                            Err(e) => {
                                tracing::warn!(gpu = %self.gpu, error = %e, "cannot watch a token connection");
                                self.leave(arriving.client, None);
                            }
                        }
                    }
                    continue;
                }
                let client = event.token().0 as ClientId;
                let Some(connection) = connections.get_mut(&client) else {
                    continue;
                };
                *serving = Some(client);
                let pumped = connection.pump(|request| {
                    let event = match request {
                        TokenRequest::Want => Event::Want { client },
                        TokenRequest::Release { again } => Event::Release { client, again },
                        TokenRequest::Fit { need_ns, counts } => {
                            self.record_fit(client, counts);
                            Event::Need { client, need_ns }
                        }
                    };
                    self.handle(event);
                });
                if let Err(e) = pumped {
                    if let Some(connection) = connections.remove(&client) {
                        let fd = connection.fd();
                        let _ = poll.registry().deregister(&mut mio::unix::SourceFd(&fd));
                    }
                    self.leave(client, Some(e));
                }
                *serving = None;
            }
        }
    }

    /// EOF, a protocol error, or the arbiter closed it: the token is lost at once.
    fn leave(&self, client: ClientId, why: Option<TokenError>) {
        self.handle(Event::Leave { client });
        let gone = {
            let mut state = self.lock();
            // A client that goes while holding loses the token now: its hold ends.
            state.end_hold(client, monotonic_ns());
            let gone = state.clients.remove(&client);
            if let Some(r) = &gone {
                if let Some(a) = state.accounts.get_mut(&r.account) {
                    a.clients = a.clients.saturating_sub(1);
                }
            }
            gone
        };
        if let Some(r) = gone {
            match why {
                None | Some(TokenError::Frame(FrameError::Closed)) => {
                    tracing::info!(gpu = %self.gpu, lease = %r.lease, pid = ?r.pid, "token client left")
                }
                Some(e) => {
                    tracing::info!(gpu = %self.gpu, lease = %r.lease, pid = ?r.pid, error = %e, "token client dropped")
                }
            }
        }
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
    next_account: AtomicU64,
    /// A lease's display name, asked once when its first client joins a GPU.
    namer: OnceLock<Namer>,
    overruns: Arc<OverrunLog>,
    /// Every lease-socket connection's place, token connections included.
    budget: Arc<ConnectionBudget>,
}

/// Names a lease for people (its container's display name); None: the lease is gone.
pub type Namer = Box<dyn Fn(&LeaseId) -> Option<String> + Send + Sync>;

/// Hands a violation the token service measured to the arbiter's status.
pub type Reporter = Box<dyn Fn(Violation) + Send + Sync>;

/// Overruns, shared by every GPU's token: reported at once (the watchdog's pass may
/// be seconds away) and kept a while so the watchdog's passes list them too.
#[derive(Default)]
struct OverrunLog {
    reporter: OnceLock<Reporter>,
    recent: Mutex<VecDeque<(Instant, Violation)>>,
}

/// Overruns kept for the watchdog's listing, at most (a bound, whatever clients do).
const RECENT_OVERRUNS: usize = 256;

impl OverrunLog {
    fn report(&self, violation: Violation) {
        {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() == RECENT_OVERRUNS {
                recent.pop_front();
            }
            recent.push_back((Instant::now(), violation.clone()));
        }
        if let Some(report) = self.reporter.get() {
            report(violation);
        }
    }

    fn since(&self, from: Instant) -> Vec<Violation> {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.retain(|(at, _)| *at >= from);
        recent.iter().map(|(_, v)| v.clone()).collect()
    }
}

/// The short and the long window of [`LeaseTime`]'s recent shares.
pub const SHARE_SHORT_NS: u64 = 10 * 1_000_000_000;
pub const SHARE_LONG_NS: u64 = 60 * 1_000_000_000;

/// A lease's GPU time from the token service's accounting, summed over its GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseTime {
    pub lease: LeaseId,
    pub container: String,
    pub priority: Priority,
    /// Every hold of every client it had (gone ones included), the ones going
    /// on now counted up to now.
    pub held_ns: u64,
    /// Held within the last [`SHARE_SHORT_NS`] and [`SHARE_LONG_NS`].
    pub held_short_ns: u64,
    pub held_long_ns: u64,
    /// Token clients connected now.
    pub clients: usize,
    /// Whether the lease has ended (kept for the timeline).
    pub closed: bool,
    pub revocations: u64,
    pub cut_offs: u64,
    pub overdue: u64,
    /// Times a client of it overran beside an active high-priority job.
    pub overruns: u64,
}

impl LeaseTime {
    /// Share (0–1) of one GPU's time over the short window.
    pub fn share_short(&self) -> f64 {
        self.held_short_ns as f64 / SHARE_SHORT_NS as f64
    }

    pub fn share_long(&self) -> f64 {
        self.held_long_ns as f64 / SHARE_LONG_NS as f64
    }
}

/// How long one token client has held its GPU's token, for the watchdog.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    pub gpu: String,
    pub lease: LeaseId,
    pub pid: Option<u32>,
    pub priority: Priority,
    /// Nanoseconds it held the token (granted, not yet released) since it joined, less
    /// its overruns.
    pub held_ns: u64,
    /// Nanoseconds of its holds that were overruns (drains past the grace beside an
    /// active high-priority job), already reported as such.
    pub overran_ns: u64,
}

impl TokenService {
    pub fn new(config: SchedulerConfig) -> Arc<TokenService> {
        TokenService::with_budget(config, ConnectionBudget::for_this_process())
    }

    pub fn with_budget(
        config: SchedulerConfig,
        budget: Arc<ConnectionBudget>,
    ) -> Arc<TokenService> {
        Arc::new(TokenService {
            config,
            gpus: Mutex::new(HashMap::new()),
            next_client: AtomicU64::new(1),
            next_account: AtomicU64::new(1),
            namer: OnceLock::new(),
            overruns: Arc::new(OverrunLog::default()),
            budget,
        })
    }

    pub fn budget(&self) -> &Arc<ConnectionBudget> {
        &self.budget
    }

    /// Every GPU's token, taken out of the table so no GPU's lock is taken under it.
    fn all_gpus(&self) -> Vec<Arc<GpuToken>> {
        self.gpus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Every token client's time holding the token so far.
    pub fn holdings(&self) -> Vec<Holding> {
        let gpus = self.all_gpus();
        let now = monotonic_ns();
        let mut holdings = Vec::new();
        for gpu in gpus {
            let state = gpu.lock();
            holdings.extend(state.clients.values().map(|r| Holding {
                gpu: gpu.gpu.clone(),
                lease: r.lease.clone(),
                pid: r.pid,
                priority: r.priority,
                held_ns: r.held_ns_at(now),
                overran_ns: r.overran_ns_at(now),
            }));
        }
        holdings
    }

    pub fn policy(&self) -> SchedulingPolicy {
        self.config.policy
    }

    /// Sets how leases are named for people (once; later calls are ignored).
    pub fn set_namer(&self, namer: Namer) {
        let _ = self.namer.set(namer);
    }

    /// Where overruns are reported (once; later calls are ignored).
    pub fn set_reporter(&self, reporter: Reporter) {
        let _ = self.overruns.reporter.set(reporter);
    }

    /// Overruns and bypasses reported since `from` (for the watchdog's listing; already
    /// counted).
    pub fn overruns_since(&self, from: Instant) -> Vec<Violation> {
        self.overruns.since(from)
    }

    /// The GPUs on which a high-priority job is active now (a high client holds, or
    /// wanted or released within `scheduler.high_active_ms`).
    pub fn high_active_gpus(&self) -> BTreeSet<String> {
        let now = monotonic_ns();
        self.all_gpus()
            .into_iter()
            .filter(|gpu| gpu.lock().policy.high_active(now))
            .map(|gpu| gpu.gpu.clone())
            .collect()
    }

    /// The arbiter measured `pid` of `lease` busy on `gpu` past the gate beside an active
    /// high-priority job: reported at once as `ungated` (kept for the watchdog's
    /// listing, like an overrun) and the lease is penalised on that GPU as for an
    /// overrun.
    pub fn report_bypass(&self, gpu: &str, lease: &LeaseId, pid: u32) {
        let token = self.all_gpus().into_iter().find(|g| g.gpu == gpu);
        if let Some(token) = token {
            let account = token
                .lock()
                .accounts
                .iter()
                .find(|(_, a)| a.lease == *lease && !a.closed)
                .map(|(&id, _)| id);
            if let Some(account) = account {
                token.handle(Event::Bypassed { lease: account });
            }
        }
        self.overruns.report(Violation {
            kind: ViolationKind::Ungated,
            gpu: gpu.to_owned(),
            pid,
            lease: Some(lease.clone()),
            memory_used: 0,
            memory_quota: None,
            killed: false,
        });
    }

    /// Every lease's GPU time (leases that had a token client and are still live,
    /// or ended but still on the timeline), by lease id.
    pub fn lease_times(&self) -> Vec<LeaseTime> {
        let now = monotonic_ns();
        let mut times: Vec<LeaseTime> = Vec::new();
        for gpu in self.all_gpus() {
            let state = gpu.lock();
            for (id, a) in &state.accounts {
                // A lease rarely has more than one client holding at once (several
                // high-priority processes of one container); each counts.
                let open: Vec<u64> = state
                    .clients
                    .values()
                    .filter(|r| r.account == *id)
                    .filter_map(|r| r.held_since)
                    .collect();
                let open_ns: u64 = open.iter().map(|&since| now.saturating_sub(since)).sum();
                let recent = |window| -> u64 {
                    let closed = a.recent.held_in_last(now, window, None);
                    closed
                        + open
                            .iter()
                            .map(|&since| now.saturating_sub(since.max(now.saturating_sub(window))))
                            .sum::<u64>()
                };
                let time = LeaseTime {
                    lease: a.lease.clone(),
                    container: a.container.clone(),
                    priority: a.priority,
                    held_ns: a.held_ns + open_ns,
                    held_short_ns: recent(SHARE_SHORT_NS),
                    held_long_ns: recent(SHARE_LONG_NS),
                    clients: a.clients,
                    closed: a.closed,
                    revocations: a.revocations,
                    cut_offs: a.cut_offs,
                    overdue: a.overdue,
                    overruns: a.overruns,
                };
                match times.iter_mut().find(|t| t.lease == time.lease) {
                    Some(t) => {
                        t.held_ns += time.held_ns;
                        t.held_short_ns += time.held_short_ns;
                        t.held_long_ns += time.held_long_ns;
                        t.clients += time.clients;
                        t.closed &= time.closed;
                        t.revocations += time.revocations;
                        t.cut_offs += time.cut_offs;
                        t.overdue += time.overdue;
                        t.overruns += time.overruns;
                    }
                    None => times.push(time),
                }
            }
        }
        times.sort_by(|a, b| a.lease.cmp(&b.lease));
        times
    }

    /// Who held each GPU's token when, holds that ended within `since_ns` of now
    /// (None: every one kept); a hold going on now ends now.
    pub fn timeline(&self, since_ns: Option<u64>) -> TimelineReport {
        let now = monotonic_ns();
        let unix_now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let to_unix_ms = |ns: u64| unix_now_ms.saturating_sub(now.saturating_sub(ns) / 1_000_000);
        let from = since_ns.map_or(0, |since| now.saturating_sub(since));
        let mut gpus = Vec::new();
        for gpu in self.all_gpus() {
            let state = gpu.lock();
            let mut ongoing: Vec<Hold> = state
                .clients
                .values()
                .filter_map(|r| {
                    r.held_since.map(|since| Hold {
                        account: r.account,
                        start_ns: since,
                        end_ns: now,
                    })
                })
                .collect();
            ongoing.sort_by_key(|h| h.start_ns);
            let holds = state
                .timeline
                .iter()
                .chain(&ongoing)
                .filter(|h| h.end_ns >= from)
                .filter_map(|h| {
                    let a = state.accounts.get(&h.account)?;
                    Some(TokenHold {
                        lease: a.lease.clone(),
                        container: a.container.clone(),
                        priority: a.priority,
                        start_unix_ms: to_unix_ms(h.start_ns),
                        end_unix_ms: to_unix_ms(h.end_ns),
                    })
                })
                .collect();
            gpus.push(GpuTimeline {
                gpu: gpu.gpu.clone(),
                holds,
            });
        }
        gpus.sort_by(|a, b| a.gpu.cmp(&b.gpu));
        let leases = self
            .lease_times()
            .into_iter()
            .map(|t| LeaseGpuTime {
                lease: t.lease,
                container: t.container,
                priority: t.priority,
                gpu_time_ms: t.held_ns / 1_000_000,
            })
            .collect();
        TimelineReport { gpus, leases }
    }

    /// The scheduler's configuration (the watchdog reads its policy and grace).
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    fn gpu(&self, uuid: &str) -> Arc<GpuToken> {
        let mut gpus = self.gpus.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(gpu) = gpus.get(uuid) {
            return gpu.clone();
        }
        let (io, poll) = IoHandoff::new().expect("creating a token I/O poller");
        let gpu = Arc::new(GpuToken {
            gpu: uuid.to_owned(),
            overruns: self.overruns.clone(),
            state: Mutex::new(GpuState {
                policy: TokenPolicy::new(&self.config),
                clients: HashMap::new(),
                fit_totals: FitCounts::default(),
                timer_at: None,
                overrun_ns: 0,
                to_report: Vec::new(),
                accounts: HashMap::new(),
                timeline: HoldRing::new(TIMELINE_HOLDS, TIMELINE_KEEP_NS),
            }),
            timer: Condvar::new(),
            io,
            restarts: ThreadRestarts::default(),
        });
        let timer = gpu.clone();
        std::thread::Builder::new()
            .name("token-timer".into())
            .spawn(move || timer.run_timer())
            .expect("spawning a token timer thread");
        let served = gpu.clone();
        std::thread::Builder::new()
            .name("token-io".into())
            .spawn(move || served.run_io(poll))
            .expect("spawning a token I/O thread");
        gpus.insert(uuid.to_owned(), gpu.clone());
        gpu
    }

    /// Takes over a connection that asked to be scheduled (and passed the checks):
    /// registers it, sends its page, and hands it to the GPU's I/O thread. Never
    /// blocks: the socket is non-blocking, and a client that does not take its
    /// `Scheduled` answer at once (the buffer holds far more) is dropped.
    pub fn serve(&self, stream: UnixStream, lease: TokenLease, pid: Option<u32>, permit: Permit) {
        if let Err(e) = self.join(stream, &lease, pid, permit) {
            tracing::debug!(lease = %lease.lease, error = %e, "token connection closed");
        }
    }

    fn join(
        &self,
        stream: UnixStream,
        lease: &TokenLease,
        pid: Option<u32>,
        permit: Permit,
    ) -> Result<(), TokenError> {
        stream.set_nonblocking(true)?;
        let refuse = |e: TokenError| {
            let refusal = LeaseResponse::Error {
                kind: ErrorKind::Internal,
                message: format!("{e}; the client runs ungated"),
            };
            let _ = frame::write_message(&mut &stream, &refusal);
            Err(e)
        };
        let clock = match pid.map(peer_clock::offset_of).transpose() {
            Ok(offset) => offset.unwrap_or_default(),
            Err(source) => return refuse(TokenError::PeerClock { pid, source }),
        };
        if clock != ClockOffset::default() {
            tracing::warn!(lease = %lease.lease, ?pid, offset_ns = clock.0, "token client in a time namespace of its own: its page's instants are written in its clock (reported: shifted_clock)");
            self.overruns.report(Violation {
                kind: ViolationKind::ShiftedClock,
                gpu: lease.gpu.clone(),
                pid: pid.unwrap_or(0),
                lease: Some(lease.lease.clone()),
                memory_used: 0,
                memory_quota: None,
                killed: false,
            });
        }
        let (page, fd) = match PageMapping::create(clock) {
            Ok(created) => created,
            Err(e) => return refuse(e),
        };
        let client = self.next_client.fetch_add(1, Ordering::Relaxed);
        let gpu = self.gpu(&lease.gpu);
        let stream = Arc::new(stream);
        // The round-robin baseline has no classes, so everyone waits for the token; the
        // interposer decides from `priority` whether it may submit before a grant.
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
        // Sent before the client joins the policy: a client that cannot be told its
        // terms never holds the token.
        send_scheduled(&stream, &terms, &fd)?;
        drop(fd);
        // Named before the GPU's lock is taken: the namer takes the arbiter's.
        let container = self
            .namer
            .get()
            .and_then(|name| name(&lease.lease))
            .unwrap_or_else(|| lease.lease.to_string());
        let mut state = gpu.lock();
        let account = match state
            .accounts
            .iter()
            .find(|(_, a)| a.lease == lease.lease && !a.closed)
        {
            Some((&id, _)) => id,
            None => {
                state.prune_accounts();
                let id = self.next_account.fetch_add(1, Ordering::Relaxed);
                state.accounts.insert(
                    id,
                    LeaseAccount {
                        lease: lease.lease.clone(),
                        container,
                        priority: lease.priority,
                        held_ns: 0,
                        recent: HeldWindow::default(),
                        clients: 0,
                        closed: false,
                        revocations: 0,
                        cut_offs: 0,
                        overdue: 0,
                        overruns: 0,
                    },
                );
                id
            }
        };
        if let Some(a) = state.accounts.get_mut(&account) {
            a.clients += 1;
        }
        state.clients.insert(
            client,
            Registered {
                page: Arc::new(page),
                stream: stream.clone(),
                lease: lease.lease.clone(),
                pid,
                priority: lease.priority,
                fit: FitCounts::default(),
                held_since: None,
                held_ns: 0,
                account,
                overrun_from: None,
                overran_ns: 0,
            },
        );
        drop(state);
        gpu.handle(Event::Join {
            client,
            lease: account,
            priority: lease.priority,
            request: lease.request,
            limit: lease.limit,
        });
        tracing::info!(gpu = %lease.gpu, lease = %lease.lease, ?pid, priority = ?lease.priority, "token client joined");
        gpu.io.hand_over(Arriving {
            client,
            connection: Connection::new(stream, permit),
        });
        Ok(())
    }

    /// The lease ended: its clients are flagged cut off (the only cut-off there is:
    /// nobody is cut off for a slow drain) and their connections closed, which loses
    /// their tokens. Not counted: the processes of an ended lease are normally gone or
    /// going, their EOF merely not seen yet.
    pub fn close_lease(&self, lease: &LeaseId) {
        let gpus = self.all_gpus();
        for gpu in gpus {
            let mut state = gpu.lock();
            for a in state.accounts.values_mut().filter(|a| &a.lease == lease) {
                a.closed = true;
                // Every client connected now is cut off.
                a.cut_offs += a.clients as u64;
            }
            for registered in state.clients.values().filter(|r| &r.lease == lease) {
                registered.page.cut_off();
                registered.page.bump();
                futex_wake(&registered.page.page().seq);
                let _ = registered.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    pub fn status(&self) -> Vec<TokenStatus> {
        let gpus = self.all_gpus();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_initialised_and_sealed_against_writable_mappings() {
        let (mapping, fd) = PageMapping::create(ClockOffset::default()).unwrap();
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

    /// A client whose clock runs ten minutes behind reads its deadline and window in
    /// its own clock: as long as they are on the arbiter's.
    #[test]
    fn a_shifted_clients_page_shows_instants_in_its_own_clock() {
        const BEHIND: i64 = -600_000_000_000;
        let (mapping, _fd) = PageMapping::create(ClockOffset(BEHIND)).unwrap();
        let page = mapping.page();
        let at = 700_000_000_000;
        mapping.apply(&Action::SetFitBy {
            client: 1,
            fit_by_ns: at + 5_000_000,
        });
        mapping.apply(&Action::Grant {
            client: 1,
            deadline_ns: at + 20_000_000,
            launch_ahead: 1,
        });
        assert_eq!(
            page.deadline_ns.load(Ordering::Acquire),
            100_000_000_000 + 20_000_000
        );
        assert_eq!(
            page.fit_by_ns.load(Ordering::Acquire),
            100_000_000_000 + 5_000_000
        );
        mapping.apply(&Action::SetFitBy {
            client: 1,
            fit_by_ns: gpushare_proto::token::FIT_UNBOUNDED,
        });
        assert_eq!(
            page.fit_by_ns.load(Ordering::Acquire),
            gpushare_proto::token::FIT_UNBOUNDED
        );
        mapping.apply(&Action::Revoke { client: 1 });
        assert_eq!(page.deadline_ns.load(Ordering::Acquire), NOT_HELD);
    }

    /// A client whose `Release` makes the policy step panic (0: none): stands in for
    /// a bug no socket can reach, to show what a failed token thread does.
    static PANIC_AT_RELEASE_OF: AtomicU64 = AtomicU64::new(0);

    pub(super) fn maybe_inject_panic(event: &Event) {
        if let Event::Release { client, .. } = *event {
            if PANIC_AT_RELEASE_OF
                .compare_exchange(client, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                panic!("injected: a policy step fails while serving client {client}");
            }
        }
    }

    /// A token client of `service` on `lease`, through a lease socket's opening (as
    /// `lease_connection` serves it) on a socket in `dir`.
    fn token_client(
        service: &Arc<TokenService>,
        dir: &std::path::Path,
        lease: &str,
    ) -> gpushare_proto::token_client::TokenConnection {
        let path = dir.join(format!("{lease}.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let served = service.clone();
        let lease = TokenLease {
            lease: LeaseId(lease.into()),
            gpu: "GPU-0".into(),
            priority: Priority::Low,
            request: 0.0,
            limit: 1.0,
        };
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let hello: gpushare_proto::LeaseRequest = frame::read_message(&mut stream).unwrap();
            assert!(matches!(hello, gpushare_proto::LeaseRequest::Hello { .. }));
            let answer = LeaseResponse::Hello {
                protocol: gpushare_proto::PROTOCOL_VERSION,
            };
            frame::write_message(&mut stream, &answer).unwrap();
            let schedule: gpushare_proto::LeaseRequest = frame::read_message(&mut stream).unwrap();
            assert_eq!(schedule, gpushare_proto::LeaseRequest::Schedule);
            let permit = served.budget().admit(&lease.lease).unwrap();
            served.serve(stream, lease, None, permit);
        });
        let client =
            gpushare_proto::token_client::TokenConnection::open(&path, Duration::from_secs(10))
                .unwrap();
        server.join().unwrap();
        client
    }

    fn wait_for(what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A panic in the GPU's I/O thread drops only the connection it was serving; the
    /// thread starts again, the other clients are granted as before, and the failure
    /// shows in status (and so in the metrics and `/healthz`).
    #[test]
    fn a_token_thread_that_fails_is_restarted_and_shown_and_the_others_are_granted() {
        let dir = tempfile::tempdir().unwrap();
        let service = TokenService::new(SchedulerConfig::default());
        let a = token_client(&service, dir.path(), "a");
        let b = token_client(&service, dir.path(), "b");
        let held = |c: &gpushare_proto::token_client::TokenConnection| {
            c.page().deadline_ns.load(Ordering::Acquire) != NOT_HELD
        };
        a.send(TokenRequest::Want).unwrap();
        wait_for("a's grant", || held(&a));
        b.send(TokenRequest::Want).unwrap();
        wait_for("b waiting", || service.status()[0].waiting == 1);
        assert!(!held(&b));
        // Connections are numbered from 1 in the order they joined.
        PANIC_AT_RELEASE_OF.store(1, Ordering::SeqCst);
        a.send(TokenRequest::Release { again: false }).unwrap();
        wait_for("b's grant after the failure", || held(&b));
        wait_for("a dropped", || a.is_closed());
        let status = &service.status()[0];
        assert_eq!(status.thread_restarts, 1);
        assert!(status.thread_failed_recently);
        assert_eq!(status.clients, 1, "only the connection it was serving went");
        // And the restarted thread goes on serving.
        b.send(TokenRequest::Release { again: false }).unwrap();
        wait_for("b's release", || !held(&b));
        let c = token_client(&service, dir.path(), "c");
        c.send(TokenRequest::Want).unwrap();
        wait_for("a new client's grant", || held(&c));
    }

    /// A connection as the I/O thread holds it, with the peer's end.
    fn connection() -> (Connection, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let permit = ConnectionBudget::new(1, 1)
            .admit(&LeaseId("l".into()))
            .unwrap();
        (Connection::new(Arc::new(ours), permit), theirs)
    }

    fn pump(connection: &mut Connection) -> (Vec<TokenRequest>, Result<(), TokenError>) {
        let mut seen = Vec::new();
        let result = connection.pump(|r| seen.push(r));
        (seen, result)
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
            let (mut connection, mut theirs) = connection();
            theirs.write_all(&bytes).unwrap();
            match pump(&mut connection) {
                (seen, Ok(())) => {
                    assert_eq!(expect, "ok");
                    assert_eq!(seen, [TokenRequest::Release { again: true }]);
                }
                (_, Err(e)) => assert!(e.to_string().contains(expect), "{e}"),
            }
        }
    }

    #[test]
    fn frames_split_across_reads_or_sharing_one_are_each_read_once() {
        let (mut connection, mut theirs) = connection();
        let want = frame::encode(&TokenRequest::Want).unwrap();
        let release = frame::encode(&TokenRequest::Release { again: false }).unwrap();
        // Half a frame: nothing yet, and the connection stays.
        theirs.write_all(&want[..3]).unwrap();
        assert!(matches!(pump(&mut connection), (seen, Ok(())) if seen.is_empty()));
        // Its rest and a whole second frame in one write.
        let mut rest = want[3..].to_vec();
        rest.extend(&release);
        theirs.write_all(&rest).unwrap();
        let (seen, result) = pump(&mut connection);
        assert!(result.is_ok());
        assert_eq!(
            seen,
            [TokenRequest::Want, TokenRequest::Release { again: false }]
        );
        assert_eq!(connection.filled, 0);
        // The peer closing ends it.
        drop(theirs);
        assert!(matches!(
            pump(&mut connection),
            (_, Err(TokenError::Frame(FrameError::Closed)))
        ));
    }
}
