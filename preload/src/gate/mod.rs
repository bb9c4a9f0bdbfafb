//! The launch gate: every kernel-submitting entry point (`cuLaunchKernel`, `…Ex`,
//! `…CooperativeKernel`, `cuGraphLaunch`, the legacy `cuLaunch*`, each `_ptsz`)
//! passes [`admit`] before it reaches the driver and [`launched`] after.
//!
//! The time-slice token (docs/ARCHITECTURE.md, `gpushare_proto::token`): the arbiter writes a
//! shared page per process; the process may submit while its `deadline_ns` is
//! `u64::MAX` or in the future. The hot path is one load of the published page's
//! address, one atomic load of its deadline, one vDSO clock read (skipped for
//! `u64::MAX`), one load of `launch_ahead` (same cache line) and a relaxed bump of the
//! launch counter the agent's idle detection reads, all inside a count of launches on
//! their way to the driver that a drain waits for (`Submitting`: one atomic increment
//! before, one decrement after the driver call) — no system call, lock, allocation or
//! logging.
//!
//! The published page is the arbiter's mapping while connected, else one of two static
//! pages: [`UNGATED`] (deadline `u64::MAX`: the library is inactive, the arbiter refused
//! to schedule, or it is lost and the class's policy is to run) and [`WAITING`]
//! (deadline 0: the initial state, so the first launch of an active library takes the
//! cold path; and a lost arbiter whose policy is to wait).
//!
//! Everything else is cold: the first launch starts the process's agent thread
//! (`agent`), which opens the token connection, answers revocations, returns expired
//! and idle tokens after draining the context, and reconnects. Launching threads that
//! do not hold the token send `Want` (once per episode) and wait on the page's futex
//! word — except high-priority ones, which submit at once, and launches into a stream
//! being captured (they run nothing; their graph's launch is gated).
//!
//! Duration-aware admission (`estimate`) lives on the launch-ahead path only (a
//! low-priority holder while a high-priority job is active): a launch whose measured
//! duration would end after the page's `fit_by_ns` waits for the window to change.

mod agent;
pub mod ahead;
pub mod decide;
pub mod estimate;
pub mod work;

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use gpushare_proto::token::{FIT_UNBOUNDED, HELD_UNTIL_RELEASED, NOT_HELD};
use gpushare_proto::token_client::{futex_wake, TokenClientError, TokenConnection};
use gpushare_proto::{TokenPage, TokenRequest};

use crate::cuda::{CUresult, Handle, CUDA_SUCCESS};
use ahead::{DriverEvents, Ring, Timed};
use estimate::{Admission, Estimates, What};
use work::{ContextEntry, StreamEntry, Work};

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream, as a handle any
/// entry point accepts.
const CU_STREAM_PER_THREAD: Handle = 0x2;
/// How long a waiting launch sleeps between looks at the page (it is woken sooner by
/// the arbiter's futex wake, or by the agent when it publishes another page).
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// The page of a process that submits freely: deadline `u64::MAX`, unbounded.
pub static UNGATED: TokenPage = static_page(HELD_UNTIL_RELEASED);
/// The page of a process that may not submit until the agent publishes another.
pub static WAITING: TokenPage = static_page(NOT_HELD);

const fn static_page(deadline_ns: u64) -> TokenPage {
    let mut page = TokenPage::new();
    page.deadline_ns = AtomicU64::new(deadline_ns);
    page
}

/// Where a launch goes: its stream, and whether stream 0 means the thread's default
/// stream (`_ptsz` variants) rather than the legacy one. (What it runs travels beside
/// it, not in it: a 16-byte `Target` is passed in registers, and a 32-byte one made
/// the hot path spill it to the stack, +3.5 ns per launch holding a timed token.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub stream: Handle,
    pub per_thread: bool,
}

/// Launches per stream that may be submitted and unfinished inside an admission
/// window (at least; the page's bound applies if larger): the second waits in the
/// stream while the first runs. Measured (simulated, 100 µs low kernels beside the
/// training-like high job): depth 1 captured 83 % of the idle time, the host's round
/// trip between kernels being the rest.
const WINDOW_DEPTH: u32 = 2;

/// The process's launch durations and admission counts.
static ESTIMATES: Estimates = Estimates::new();

impl Target {
    /// The stream as a handle valid in any entry point.
    fn handle(self) -> Handle {
        if self.per_thread && self.stream == 0 {
            CU_STREAM_PER_THREAD
        } else {
            self.stream
        }
    }
}

/// What [`admit`] hands the wrapper, for [`launched`]: how the launch passed, and its
/// count among the launches on their way to the driver.
#[must_use]
pub struct Ticket {
    pub pass: Pass,
    submitting: Submitting,
}

/// How a launch passed: nothing to do afterwards, the launch-ahead ring (held, so the
/// bound holds across threads) to record the launch's event in, or a high-priority
/// client's `Want` to send once the launch is queued.
pub enum Pass {
    Free,
    Bounded(Bounded),
    Announce(&'static Client),
}

/// One launch the gate let through that the driver does not have yet: counted in the
/// gate's `submitting` from before the page is read until the driver call returns (or
/// the wrapper unwinds). Why: a launching thread may be preempted between the gate and
/// the driver for as long as a loaded node's scheduler likes; if a revocation lands
/// meanwhile, the agent's drain finds nothing of that launch in the streams and gives
/// the token back, and the kernel then runs after the release, in the next holder's
/// time. A CI run saw an honest job's 2 s kernel do exactly that. So a drain first waits
/// for the count to reach zero ([`Gate::await_submissions`]).
///
/// The count is raised (SeqCst) before the page's deadline is read (SeqCst), and the
/// agent reads the deadline before the count (SeqCst): as in Dekker's algorithm, a
/// launch that saw the token held is counted by the time a drain for its revocation
/// looks. Two locked instructions per launch: the price of never running past a release.
struct Submitting(&'static AtomicU64);

impl Submitting {
    #[inline(always)]
    fn enter(count: &'static AtomicU64) -> Submitting {
        count.fetch_add(1, SeqCst);
        Submitting(count)
    }
}

impl Drop for Submitting {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.fetch_sub(1, Release);
    }
}

/// How long a drain waits for launches on their way to the driver before it goes on
/// anyway: far beyond any scheduling delay, but a thread stopped for good (a debugger's
/// breakpoint between the gate and the driver) must not keep the token for ever.
const SUBMISSIONS_PATIENCE: Duration = Duration::from_secs(2);

pub struct Bounded {
    ring: RingOf,
    stream: Handle,
    /// `begin` recorded a start event for it.
    timed: bool,
}

/// Which stream's launch-ahead ring a bounded launch uses.
enum RingOf {
    Created(Arc<StreamEntry>),
    Legacy(Arc<ContextEntry>),
    /// The launching thread's own default stream: a thread-local ring, no lock.
    PerThread,
}

thread_local! {
    static PER_THREAD_RING: RefCell<Ring> = const { RefCell::new(Ring::new()) };
}

impl RingOf {
    fn for_target(target: Target, work: &Work) -> Option<RingOf> {
        match target.handle() {
            CU_STREAM_PER_THREAD => Some(RingOf::PerThread),
            0 | crate::driver::CU_STREAM_LEGACY => {
                let context = crate::driver::current_context();
                work.context_seen(context);
                work.context(context).map(RingOf::Legacy)
            }
            handle => work.stream(handle).map(RingOf::Created),
        }
    }

    /// Runs `f` on the ring. The stream's lock is held only inside: a second thread
    /// launching into the same stream at the same instant may overshoot the bound by
    /// one launch, which the next wait absorbs (waiting for a later event implies the
    /// earlier ones completed).
    fn with<R>(&self, f: impl FnOnce(&mut Ring) -> R) -> R {
        match self {
            RingOf::Created(stream) => {
                f(&mut stream.ring.lock().unwrap_or_else(|e| e.into_inner()))
            }
            RingOf::Legacy(context) => f(&mut context
                .legacy_ring
                .lock()
                .unwrap_or_else(|e| e.into_inner())),
            RingOf::PerThread => PER_THREAD_RING.with(|ring| f(&mut ring.borrow_mut())),
        }
    }
}

/// The process's gate. In the unit-test binary it never schedules: tests there
/// install configurations for fake ledgers that come and go, and test the token
/// client on gates of their own.
static GATE: Gate = Gate::new(if cfg!(test) {
    Socket::Never
} else {
    Socket::FromConfig
});

/// Returns when the process may submit a launch of `what` into `target`.
#[inline(always)]
pub fn admit(target: Target, what: What) -> Ticket {
    GATE.admit(target, what)
}

/// Called first in every cold admission: the crate root sets it to the accounts' attach
/// (a layer above the gate). The CUDA runtime gets its primary context through the
/// driver's private export table, past every creation wrapper, so a process may reach
/// its first gated call unattached; attaching there (once: later calls return at a
/// flag) registers it and teaches the gate its class before that call is admitted.
static ON_COLD_ADMIT: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets what a cold admission calls first (once; later calls change nothing).
pub fn on_cold_admit(attach: fn()) {
    let _ = ON_COLD_ADMIT.set(attach);
}

/// After the real launch: a bounded launch records its completion event.
#[inline(always)]
pub fn launched(ticket: Ticket, result: CUresult) {
    let Ticket { pass, submitting } = ticket;
    // The driver has the launch (or refused it): a drain sees it in its stream now.
    drop(submitting);
    match pass {
        Pass::Free => {}
        Pass::Bounded(bounded) => bounded.finish(result),
        Pass::Announce(client) => client.want(),
    }
}

/// The process's record of its contexts, streams and captures, which the wrappers of
/// their creation and destruction keep and the agent drains.
pub fn work() -> &'static Work {
    &GATE.client().work
}

/// A forked child holds no token: back to the initial state, the parent's connection
/// closed (see `fork`).
pub fn reset_after_fork() {
    GATE.reset_after_fork();
}

/// Publishes `page` as the process's (benchmarks: a page that holds a real deadline).
#[doc(hidden)]
pub fn publish_for_benchmark(page: &'static TokenPage) {
    GATE.publish(page);
}

/// CLOCK_MONOTONIC in nanoseconds (vDSO: no system call): the token clock, shared with
/// the arbiter. `#[inline]` there, so the launch path pays no call.
pub use gpushare_types::monotonic_ns;

/// Whether a page lets a launch through now (ignoring `launch_ahead`). SeqCst: read
/// after a [`Submitting`] count is raised (the same instruction as Acquire on x86-64
/// and aarch64).
#[inline(always)]
fn holds(page: &TokenPage) -> bool {
    let deadline = page.deadline_ns.load(SeqCst);
    deadline == HELD_UNTIL_RELEASED || monotonic_ns() < deadline
}

/// Where the token connection is opened.
#[derive(Debug)]
pub enum Socket {
    /// The library's configuration (`GPUSHARE_SOCKET`), when a lease is in force.
    FromConfig,
    /// A given socket, always active (tests).
    At(PathBuf),
    /// Never scheduled: ungated from the first launch.
    Never,
}

/// One process's gate: the published page, the launch counter, and the client state
/// of the cold path (replaced wholesale in a fork child).
#[derive(Debug)]
pub struct Gate {
    page: AtomicPtr<TokenPage>,
    launches: AtomicU64,
    /// Launches let through that the driver does not have yet ([`Submitting`]).
    submitting: AtomicU64,
    client: AtomicPtr<Client>,
    /// The token connection's descriptor, for a fork child to close (-1: none).
    token_fd: AtomicI32,
    socket: Socket,
    /// The lease's class as the ledger learned it from the arbiter ([`CLASS_UNKNOWN`],
    /// [`CLASS_LOW`], [`CLASS_HIGH`]): lets a high-priority process run before its token
    /// connection is open, and while the arbiter it has never reached is away.
    class_hint: AtomicU32,
}

const CLASS_UNKNOWN: u32 = 0;
const CLASS_LOW: u32 = 1;
const CLASS_HIGH: u32 = 2;

/// The ledger learned the lease's class from the arbiter (never from the container's
/// environment, which is not authority).
pub fn lease_class_learned(priority: gpushare_proto::Priority) {
    GATE.learn_class(priority);
}

impl Gate {
    pub const fn new(socket: Socket) -> Gate {
        Gate {
            page: AtomicPtr::new(&raw const WAITING as *mut TokenPage),
            launches: AtomicU64::new(0),
            submitting: AtomicU64::new(0),
            client: AtomicPtr::new(std::ptr::null_mut()),
            token_fd: AtomicI32::new(-1),
            socket,
            class_hint: AtomicU32::new(CLASS_UNKNOWN),
        }
    }

    pub fn learn_class(&self, priority: gpushare_proto::Priority) {
        let class = match priority {
            gpushare_proto::Priority::High => CLASS_HIGH,
            gpushare_proto::Priority::Low => CLASS_LOW,
        };
        self.class_hint.store(class, Relaxed);
    }

    /// A high-priority process never waits for a grant, so it need not wait for the
    /// connection either: before one is open (or while an arbiter it never reached is
    /// away) its launches run, as they would once connected.
    fn known_high(&self) -> bool {
        self.class_hint.load(Relaxed) == CLASS_HIGH
    }

    /// A gate of its own for a test, on `socket` (leaked: its agent outlives borrows).
    pub fn for_socket(socket: PathBuf) -> &'static Gate {
        Box::leak(Box::new(Gate::new(Socket::At(socket))))
    }

    #[inline(always)]
    pub fn admit(&'static self, target: Target, what: What) -> Ticket {
        let submitting = Submitting::enter(&self.submitting);
        // SAFETY: the pointer is always a static page or a token mapping, never
        // unmapped (see `Link`).
        let page = unsafe { &*self.page.load(Acquire) };
        if holds(page) && page.launch_ahead.load(Relaxed) == 0 {
            self.count_launch();
            return Ticket {
                pass: Pass::Free,
                submitting,
            };
        }
        drop(submitting);
        self.admit_cold(target, what)
    }

    /// Waits until every launch the gate let through has reached the driver (see
    /// [`Submitting`]), at most [`SUBMISSIONS_PATIENCE`]. The agent's cold path.
    pub fn await_submissions(&self) {
        let start = monotonic_ns();
        while self.submitting.load(SeqCst) != 0 {
            if monotonic_ns().saturating_sub(start) > SUBMISSIONS_PATIENCE.as_nanos() as u64 {
                crate::log_debug!(
                    "draining: launches still on their way to the driver after {SUBMISSIONS_PATIENCE:?}; draining without them"
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn ticket(&'static self, pass: Pass) -> Ticket {
        Ticket {
            pass,
            submitting: Submitting::enter(&self.submitting),
        }
    }

    /// The idle detector only needs to see the counter change: a plain load and store
    /// (no locked instruction); a bump lost to a concurrent one still changes it.
    #[inline(always)]
    fn count_launch(&self) {
        self.launches
            .store(self.launches.load(Relaxed).wrapping_add(1), Relaxed);
    }

    pub fn launches(&self) -> u64 {
        self.launches.load(Relaxed)
    }

    /// The published page.
    pub fn page(&self) -> &'static TokenPage {
        // SAFETY: as in `admit`.
        unsafe { &*self.page.load(Acquire) }
    }

    /// Publishes a page and wakes launches waiting on the static pages' futex words
    /// (a launch waiting on a connection's page wakes by its timeout).
    fn publish(&self, page: &'static TokenPage) {
        self.page
            .store(page as *const TokenPage as *mut TokenPage, Release);
        for static_page in [&WAITING, &UNGATED] {
            static_page.seq.fetch_add(1, Release);
            futex_wake(&static_page.seq);
        }
    }

    fn client(&'static self) -> &'static Client {
        let current = self.client.load(Acquire);
        if !current.is_null() {
            // SAFETY: clients are leaked, never freed.
            return unsafe { &*current };
        }
        let fresh = Box::into_raw(Box::new(Client::new()));
        match self
            .client
            .compare_exchange(std::ptr::null_mut(), fresh, AcqRel, Acquire)
        {
            // SAFETY: just stored; leaked from here on.
            Ok(_) => unsafe { &*fresh },
            Err(winner) => {
                // SAFETY: `fresh` came from Box::into_raw above and was never shared.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: the winner's gate was leaked by the thread that stored it and
                // is never freed.
                unsafe { &*winner }
            }
        }
    }

    fn socket_path(&self) -> Option<PathBuf> {
        match &self.socket {
            Socket::FromConfig => crate::config::is_active()
                .then(crate::config::get)
                .flatten()
                .map(|c| c.socket.clone()),
            Socket::At(path) => Some(path.clone()),
            Socket::Never => None,
        }
    }

    #[cold]
    #[inline(never)]
    fn admit_cold(&'static self, target: Target, what: What) -> Ticket {
        if let Some(attach) = ON_COLD_ADMIT.get() {
            attach();
        }
        let client = self.client();
        client.start(self);
        // Every ticket below is counted as submitting from before the page it passed on
        // was read (see `Submitting`); none is counted while it waits.
        let submitting = Submitting::enter(&self.submitting);
        if self.page().launch_ahead.load(Acquire) == 0 && holds(self.page()) {
            self.count_launch();
            return Ticket {
                pass: Pass::Free,
                submitting,
            };
        }
        drop(submitting);
        // A context the wrappers did not see created still gets drained.
        client.work.context_seen(crate::driver::current_context());
        // Captured launches run nothing now: the graph's launch is gated.
        let stream = target.handle();
        if crate::driver::stream_is_capturing(stream) {
            return self.ticket(Pass::Free);
        }
        let mut waiting: Option<Waiting> = None;
        // This launch was held back for not fitting the window (counted once).
        let mut held: Option<HeldBack> = None;
        loop {
            let mut submitting = Submitting::enter(&self.submitting);
            let page = self.page();
            let seq = page.seq.load(Acquire);
            if holds(page) {
                let limit = page.launch_ahead.load(Acquire);
                if limit == 0 {
                    self.count_launch();
                    return Ticket {
                        pass: Pass::Free,
                        submitting,
                    };
                }
                let Some(ring) = RingOf::for_target(target, &client.work) else {
                    // A stream the driver cannot place: unbounded rather than wedged.
                    self.count_launch();
                    return Ticket {
                        pass: Pass::Free,
                        submitting,
                    };
                };
                let fit_launches = client.fit_launches.load(Relaxed);
                let window = |page: &TokenPage| {
                    if fit_launches {
                        page.fit_by_ns.load(Acquire)
                    } else {
                        FIT_UNBOUNDED
                    }
                };
                // Inside a window every launch is checked against its end, queue
                // included, so one more may wait in the stream: the GPU goes from one
                // low kernel to the next without the host's round trip in between —
                // unless the launch before it is of unknown length, which is waited for
                // (and so measured) first.
                let limit = if window(page) == FIT_UNBOUNDED || ring.with(|r| r.blind()) {
                    limit
                } else {
                    limit.max(WINDOW_DEPTH)
                };
                drop(submitting);
                self.wait_on_ring(client, &ring, limit);
                submitting = Submitting::enter(&self.submitting);
                let page = self.page();
                if !holds(page) {
                    // Revoked while the ring drained: wait for the token again.
                    continue;
                }
                let fit_by = window(page);
                let now = monotonic_ns();
                let queued_until = ring.with(|r| r.queued_until());
                let estimate = ESTIMATES.estimate(what, now);
                let admission = estimate::admit(now, queued_until, estimate, fit_by);
                // Each launch counts once as held back, and once as admitted.
                match admission {
                    Admission::AfterQueue => {
                        // It fits once its stream's own queue has run: wait for that.
                        drop(submitting);
                        self.wait_on_ring(client, &ring, 1);
                        continue;
                    }
                    Admission::Wait { need_ns } => {
                        // Not before the high job is expected back: wait for the window
                        // to change (a revocation, a moved window, or the high job's
                        // quiet).
                        if held.is_none() {
                            ESTIMATES.count(admission);
                            held = Some(HeldBack(client));
                        }
                        client.need_ns.store(need_ns, Relaxed);
                        waiting.get_or_insert_with(|| Waiting::new(client));
                        drop(submitting);
                        gpushare_proto::token_client::futex_wait(&page.seq, seq, WAIT_SLICE);
                        continue;
                    }
                    Admission::Run { unestimated } => {
                        if fit_by != FIT_UNBOUNDED {
                            ESTIMATES.count(admission);
                        }
                        if unestimated {
                            // Measured now: no second launch of its kind runs blind
                            // meanwhile.
                            ESTIMATES.probing(what, now);
                        }
                    }
                }
                drop(held.take());
                let start = now.max(queued_until);
                let queued = match (estimate, fit_by) {
                    (_, FIT_UNBOUNDED) => Some(0),
                    (Some(d), _) => Some(start.saturating_add(d)),
                    // Unknown length: nothing queues behind it.
                    (None, _) => None,
                };
                if fit_launches {
                    ring.with(|r| {
                        let timed = Timed {
                            key: what.key(),
                            admitted_ns: start,
                            fit_by_ns: fit_by,
                        };
                        r.begin(stream, timed, &DriverEvents);
                        r.set_queued_until(queued);
                    });
                }
                self.count_launch();
                return Ticket {
                    pass: Pass::Bounded(Bounded {
                        ring,
                        stream,
                        timed: fit_launches,
                    }),
                    submitting,
                };
            }
            let connected = !std::ptr::eq(page, &WAITING) && !std::ptr::eq(page, &UNGATED);
            if connected {
                if client.high.load(Acquire) {
                    // High priority never waits: the arbiter revokes the holder. The
                    // `Want` goes out after the launch is queued, so its system call (and
                    // the arbiter thread it wakes, on a machine with few cores) is not on
                    // the path to the first kernel: that cut the start latency's p50 by
                    // the send's cost on the simulated GPU.
                    self.count_launch();
                    let pass = if client.want_sent.load(SeqCst) {
                        Pass::Free
                    } else {
                        Pass::Announce(client)
                    };
                    return Ticket { pass, submitting };
                }
                drop(submitting);
                client.want();
            } else {
                drop(submitting);
            }
            waiting.get_or_insert_with(|| Waiting::new(client));
            gpushare_proto::token_client::futex_wait(&page.seq, seq, WAIT_SLICE);
        }
    }

    /// Waits until fewer than `limit` launches of the ring's stream are unfinished
    /// (busy meanwhile, for the agent's idle detection).
    fn wait_on_ring(&self, client: &'static Client, ring: &RingOf, limit: u32) {
        let _busy = RingWait::new(client);
        quietly_for_captures(|| ring.with(|r| r.wait_below(limit, &DriverEvents, &ESTIMATES)));
    }

    pub fn reset_after_fork(&self) {
        self.page
            .store(&raw const WAITING as *mut TokenPage, Release);
        // The parent's client (its locks, its connection, its agent) is abandoned.
        self.client.store(std::ptr::null_mut(), Release);
        // Only the forking thread lives on here, and it is not between the gate and
        // the driver: launches its parent's other threads had under way are not ours.
        self.submitting.store(0, SeqCst);
        let fd = self.token_fd.swap(-1, AcqRel);
        if fd >= 0 {
            // SAFETY: the child's copy of the token socket (see `token_fd`); the
            // parent's connection object that owns the number is never dropped here.
            unsafe { libc::close(fd) };
        }
    }
}

impl Bounded {
    #[cold]
    #[inline(never)]
    fn finish(self, result: CUresult) {
        let stream = self.stream;
        if result == CUDA_SUCCESS {
            self.ring.with(|r| {
                if r.pending() >= ahead::RING {
                    // Full (threads overshot the bound together): recording waits first.
                    quietly_for_captures(|| r.record(stream, &DriverEvents, &ESTIMATES));
                } else {
                    r.record(stream, &DriverEvents, &ESTIMATES);
                }
            });
        } else if self.timed {
            self.ring.with(|r| r.abandon());
        }
    }
}

/// Runs `f` (which waits on events) in RELAXED capture mode: in the thread's default
/// GLOBAL mode the wait would fail and invalidate a capture another thread has begun in
/// GLOBAL mode (PyTorch's default). Always, not only while a capture is known to be under
/// way: one could begin between the look and the wait. The exchange is a thread-local
/// store in the driver; the previous mode is restored.
fn quietly_for_captures<R>(f: impl FnOnce() -> R) -> R {
    let previous =
        crate::driver::exchange_capture_mode(crate::driver::CU_STREAM_CAPTURE_MODE_RELAXED);
    let result = f();
    if let Some(mode) = previous {
        crate::driver::exchange_capture_mode(mode);
    }
    result
}

/// A launching thread counted among the waiters while it lives.
struct Waiting(&'static Client);

impl Waiting {
    fn new(client: &'static Client) -> Waiting {
        client.waiters.fetch_add(1, SeqCst);
        Waiting(client)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, SeqCst);
    }
}

/// A launch held back for not fitting the window: its need is the client's until it
/// leaves the gate, whichever way.
struct HeldBack(&'static Client);

impl Drop for HeldBack {
    fn drop(&mut self) {
        self.0.need_ns.store(0, Relaxed);
    }
}

/// A launching thread waiting on the launch-ahead ring (busy, not idle) while it lives.
struct RingWait(&'static Client);

impl RingWait {
    fn new(client: &'static Client) -> RingWait {
        client.ring_waiters.fetch_add(1, SeqCst);
        RingWait(client)
    }
}

impl Drop for RingWait {
    fn drop(&mut self) {
        self.0.ring_waiters.fetch_sub(1, SeqCst);
    }
}

/// The cold path's state: one per process (a fork child makes its own).
#[derive(Debug)]
pub struct Client {
    started: Once,
    link: Mutex<Option<Arc<Link>>>,
    /// The terms' class: high priority submits without waiting for the grant.
    high: AtomicBool,
    /// A `Want` was sent for the current episode (cleared by `Release { again: false }`).
    want_sent: AtomicBool,
    /// Launching threads waiting for the token (or for a window their launch fits).
    waiters: AtomicU32,
    /// Launching threads waiting on the launch-ahead ring for their previous launch.
    ring_waiters: AtomicU32,
    /// The terms say the arbiter publishes admission windows and takes `Fit` reports.
    fit_launches: AtomicBool,
    /// The estimated duration of a launch waiting for a window (0: none).
    need_ns: AtomicU64,
    /// Orders frames: a `Want` decided after a `Release` is sent after it. Holds the
    /// admission report last sent and the counts when the connection opened.
    send_lock: Mutex<Reported>,
    /// The process's contexts, streams and captures: what the agent drains.
    pub work: Work,
}

impl Client {
    fn new() -> Client {
        Client {
            started: Once::new(),
            link: Mutex::new(None),
            high: AtomicBool::new(false),
            want_sent: AtomicBool::new(false),
            waiters: AtomicU32::new(0),
            ring_waiters: AtomicU32::new(0),
            fit_launches: AtomicBool::new(false),
            need_ns: AtomicU64::new(0),
            send_lock: Mutex::new(Reported::default()),
            work: Work::new(),
        }
    }

    /// Once per process: an inactive library is ungated for good; an active one
    /// starts the agent, which connects.
    fn start(&'static self, gate: &'static Gate) {
        self.started.call_once(|| {
            let Some(socket) = gate.socket_path() else {
                gate.publish(&UNGATED);
                return;
            };
            if gate.known_high() {
                // Before the agent exists, so its own publications come after this one.
                gate.publish(&UNGATED);
            }
            let spawned = std::thread::Builder::new()
                .name("gpushare-token".into())
                .spawn(move || agent::run(gate, self, socket));
            if let Err(e) = spawned {
                crate::log_error!("cannot start the token agent ({e}): launches run ungated");
                gate.publish(&UNGATED);
            }
        });
    }

    fn link(&self) -> Option<Arc<Link>> {
        self.link.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_link(&self, link: Option<Arc<Link>>) {
        let old = std::mem::replace(
            &mut *self.link.lock().unwrap_or_else(|e| e.into_inner()),
            link,
        );
        drop(old);
    }

    /// Sends `Want` unless this episode already did.
    fn want(&self) {
        if self.want_sent.load(SeqCst) {
            return;
        }
        let _order = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        if self.want_sent.load(SeqCst) {
            return;
        }
        if let Some(link) = self.link() {
            // A failed send is the agent's to notice (the connection is closed).
            if link.connection.send(TokenRequest::Want).is_ok() {
                self.want_sent.store(true, SeqCst);
            }
        }
    }

    /// A new connection: admission counts restart from here.
    fn connected(&self, fit_launches: bool) {
        self.fit_launches.store(fit_launches, Relaxed);
        let mut reported = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        *reported = Reported {
            base: ESTIMATES.counts(),
            last: None,
        };
    }

    /// Sends the release `decide` chose after the drain; `again` is decided here,
    /// under the lock, so a thread that starts waiting later sends its own `Want`
    /// after this frame. An admission report that changed goes just before it.
    fn release(
        &self,
        link: &Link,
        choose: impl FnOnce(u32) -> Option<TokenRequest>,
    ) -> Result<Option<TokenRequest>, TokenClientError> {
        let mut reported = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.want_sent.store(false, SeqCst);
        let waiters = self.waiters.load(SeqCst);
        let Some(request) = choose(waiters) else {
            return Ok(None);
        };
        if self.fit_launches.load(Relaxed) {
            let need_ns = if waiters > 0 {
                self.need_ns.load(Relaxed)
            } else {
                0
            };
            let report = TokenRequest::Fit {
                need_ns,
                counts: estimate::since(ESTIMATES.counts(), reported.base),
            };
            // The arbiter forgets a need when it grants, so a need is sent every time;
            // unchanged counts without one are not.
            if need_ns > 0 || reported.last != Some(report) {
                link.connection.send(report)?;
                reported.last = Some(report);
            }
        }
        link.connection.send(request)?;
        if request == (TokenRequest::Release { again: true }) {
            self.want_sent.store(true, SeqCst);
        }
        Ok(Some(request))
    }
}

/// What the client last reported of its admission, on this connection.
#[derive(Debug, Default)]
struct Reported {
    /// The counts when the connection opened.
    base: gpushare_proto::FitCounts,
    last: Option<TokenRequest>,
}

/// A token connection whose page may be published. Dropping it closes the socket but
/// leaks the page's mapping: a launching thread may still be reading it.
#[derive(Debug)]
struct Link {
    connection: std::mem::ManuallyDrop<TokenConnection>,
    gate: &'static Gate,
}

impl Link {
    fn new(connection: TokenConnection, gate: &'static Gate) -> Link {
        gate.token_fd.store(connection.raw_fd(), Release);
        Link {
            connection: std::mem::ManuallyDrop::new(connection),
            gate,
        }
    }

    fn page(&self) -> &'static TokenPage {
        // SAFETY: the mapping is never unmapped (Drop leaks it).
        unsafe { &*self.connection.page_ptr() }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let fd = self.connection.raw_fd();
        let _ = self.gate.token_fd.compare_exchange(fd, -1, AcqRel, Relaxed);
        // SAFETY: the connection's socket, closed once: the connection itself is
        // never dropped (its Drop would unmap the page).
        unsafe { libc::close(fd) };
    }
}

#[cfg(test)]
mod tests;
