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
    AdmissionStatus, ErrorKind, FitCounts, GpuTimeline, LeaseId, LeaseResponse, LeaseTokenAccount,
    LeaseTokenTime, Priority, ScheduleTerms, TimelineReport, TokenHold, TokenHolder, TokenPage,
    TokenRequest, TokenStatus, Violation, ViolationKind, WindowWaiter,
};

use crate::connections::{ConnectionBudget, Permit};
use crate::peer_clock::{self, ClockOffset};
use crate::timeslice::{Action, ClientId, Event, TokenPolicy};
use crate::token_time::{HeldWindow, Hold, HoldRing};

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

mod gpu;
mod io_thread;
mod page;
#[cfg(test)]
mod tests;

use io_thread::{Arriving, Connection, IoHandoff, ThreadRestarts};
use page::PageMapping;

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
    /// Its lease was suspended while it held or drained: its hold ended there (the
    /// timeline and its lease's token time stop at the suspension), but until it
    /// releases, or the lease is resumed, the GPU may still be finishing what it
    /// queued before the driver's lock — token time for the watchdog and the bypass
    /// check, as any drain after a revocation is.
    suspended_drain_since: Option<u64>,
}

impl Registered {
    /// Its token time up to `now`: an open hold counts until it overran, if it did.
    fn held_ns_at(&self, now: u64) -> u64 {
        self.held_ns
            + self
                .suspended_drain_since
                .map_or(0, |since| now.saturating_sub(since))
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

/// One lease's token time on one GPU, kept while the lease lives and, after it ended,
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
    /// Per-lease token time, by account number (never reused).
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

    /// `account`'s lease was suspended at `now`: the holds of its clients end there,
    /// their drains (if any) go on as token time for the watchdog only.
    fn suspend_holds(&mut self, account: u64, now: u64) {
        let holding: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, r)| r.account == account && r.held_since.is_some())
            .map(|(&id, _)| id)
            .collect();
        for client in holding {
            self.end_hold(client, now);
            if let Some(registered) = self.clients.get_mut(&client) {
                registered.suspended_drain_since = Some(now);
            }
        }
    }

    /// `account`'s lease was resumed at `now`: whatever its clients still drained
    /// from before their suspension is done.
    fn resume_drains(&mut self, account: u64, now: u64) {
        let members: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, r)| r.account == account)
            .map(|(&id, _)| id)
            .collect();
        for client in members {
            self.end_suspended_drain(client, now);
        }
    }

    /// What `client` had queued before its suspension is done (it released, or its
    /// lease was resumed): that drain is counted as its token time.
    fn end_suspended_drain(&mut self, client: ClientId, now: u64) {
        if let Some(registered) = self.clients.get_mut(&client) {
            if let Some(since) = registered.suspended_drain_since.take() {
                registered.held_ns += now.saturating_sub(since);
            }
        }
    }

    /// Forgets ended leases the timeline no longer shows (on a join: rare, and the
    /// only time an account is added).
    fn prune_accounts(&mut self) {
        let timeline = &self.timeline;
        self.accounts
            .retain(|id, a| !a.closed || a.clients > 0 || timeline.references(*id));
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
    /// Leases suspended now (memory reclaim), kept here rather than in the GPUs'
    /// policies so that a client joining one later, on any GPU, is suspended too.
    suspended: Mutex<BTreeSet<LeaseId>>,
    /// Held while a suspension, a resumption or a joining client's suspension is
    /// applied to the policies, so that a resumption cannot come between a joining
    /// client's check of `suspended` and its suspension. Never taken under
    /// `suspended`, which is only ever held for a moment.
    suspension_steps: Mutex<()>,
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

/// A lease's token time from the token service's accounting, summed over its GPUs.
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
            suspended: Mutex::new(BTreeSet::new()),
            suspension_steps: Mutex::new(()),
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
            if let Some(account) = token.account_of(lease) {
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

    /// Every lease's token time (leases that had a token client and are still live,
    /// or ended but still on the timeline), summed over its GPUs, by lease id.
    pub fn lease_times(&self) -> Vec<LeaseTime> {
        let mut times: Vec<LeaseTime> = Vec::new();
        for (_, time) in self.lease_times_per_gpu() {
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
        times.sort_by(|a, b| a.lease.cmp(&b.lease));
        times
    }

    /// Each GPU's account of each lease (the token keeps one per lease per GPU), as
    /// (GPU UUID, its token time there).
    fn lease_times_per_gpu(&self) -> Vec<(String, LeaseTime)> {
        let now = monotonic_ns();
        let mut times = Vec::new();
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
                times.push((gpu.gpu.clone(), time));
            }
        }
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
            .map(|t| LeaseTokenTime {
                lease: t.lease,
                container: t.container,
                priority: t.priority,
                token_time_ms: t.held_ns / 1_000_000,
            })
            .collect();
        TimelineReport {
            gpus,
            leases,
            reclaims: Vec::new(),
        }
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
                suspended_drain_since: None,
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
        {
            let _steps = self.lock_suspension_steps();
            if self.is_suspended(&lease.lease) {
                gpu.handle(Event::Suspend { lease: account });
            }
        }
        tracing::info!(gpu = %lease.gpu, lease = %lease.lease, ?pid, priority = ?lease.priority, "token client joined");
        gpu.io.hand_over(Arriving {
            client,
            connection: Connection::new(stream, permit),
        });
        Ok(())
    }

    /// The lease's processes are about to be locked by the driver (memory reclaim):
    /// from now on no client of it is granted the token on any GPU, and one holding it
    /// is revoked at once (its page says so) and not waited for. They are never
    /// overdue, overrun or penalised for the time suspended; their wants are kept.
    /// Clients joining the lease later are suspended too: a lease with no token
    /// client yet is remembered for its first. Suspending a lease already suspended
    /// changes nothing.
    ///
    /// Not to be called under the arbiter's lock: a policy step may report an
    /// overrun, which takes it.
    pub fn suspend_lease(&self, lease: &LeaseId) {
        let _steps = self.lock_suspension_steps();
        self.lock_suspended().insert(lease.clone());
        self.step_lease(lease, |account| Event::Suspend { lease: account });
    }

    /// The lease's processes run again: its clients take their turn as usual. A
    /// lease not suspended is left as it is. Not under the arbiter's lock either.
    pub fn resume_lease(&self, lease: &LeaseId) {
        let _steps = self.lock_suspension_steps();
        if self.lock_suspended().remove(lease) {
            self.step_lease(lease, |account| Event::Resume { lease: account });
        }
    }

    /// The leases suspended now, sorted.
    pub fn suspended_leases(&self) -> Vec<LeaseId> {
        self.lock_suspended().iter().cloned().collect()
    }

    fn is_suspended(&self, lease: &LeaseId) -> bool {
        self.lock_suspended().contains(lease)
    }

    fn lock_suspended(&self) -> MutexGuard<'_, BTreeSet<LeaseId>> {
        self.suspended.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_suspension_steps(&self) -> MutexGuard<'_, ()> {
        self.suspension_steps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// One policy step on every GPU where `lease` has an account (its per-GPU key).
    fn step_lease(&self, lease: &LeaseId, event: impl Fn(u64) -> Event) {
        for gpu in self.all_gpus() {
            if let Some(account) = gpu.account_of(lease) {
                gpu.handle(event(account));
            }
        }
    }

    /// The lease ended: its clients are flagged cut off (the only cut-off there is:
    /// nobody is cut off for a slow drain) and their connections closed, which loses
    /// their tokens. Not counted: the processes of an ended lease are normally gone or
    /// going, their EOF merely not seen yet.
    pub fn close_lease(&self, lease: &LeaseId) {
        // Its clients stay suspended in the policies until their connections close
        // (none of them is granted meanwhile); the lease's suspension ends with it.
        self.lock_suspended().remove(lease);
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
        for (gpu, t) in self.lease_times_per_gpu() {
            if let Some(s) = status.iter_mut().find(|s| s.gpu == gpu) {
                s.leases.push(LeaseTokenAccount {
                    lease: t.lease.clone(),
                    token_time_ms: t.held_ns / 1_000_000,
                    token_share_10s: t.share_short(),
                    token_share_1m: t.share_long(),
                    revocations: t.revocations,
                    cut_offs: t.cut_offs,
                    overdue: t.overdue,
                });
            }
        }
        for s in &mut status {
            s.leases.sort_by(|a, b| a.lease.cmp(&b.lease));
        }
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
