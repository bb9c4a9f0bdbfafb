//! The time-slice token's decisions for one GPU, as a pure state machine: events in
//! (a client joined, wants, released, left; the clock ticked), page changes out. No
//! I/O and no clock reads: the caller passes CLOCK_MONOTONIC nanoseconds, so every rule
//! is testable from a table and a simulated saturated run takes microseconds.
//!
//! Rules (docs/ARCHITECTURE.md, "Time-slice tokens", gives the overview):
//! * `priority` policy: a high-priority client's `Want` is granted at once
//!   (deadline [`HELD_UNTIL_RELEASED`]) and any low-priority holder is revoked in the
//!   same step, without waiting for its acknowledgement. Low-priority clients share
//!   what is left, one at a time.
//! * Among low-priority clients: GPU time is measured by the arbiter as the holding
//!   intervals [grant, release received] within a sliding window; the token goes to the
//!   one with the smallest usage/request (request 0 comes after every client with a
//!   request, least usage first).
//! * Limit: a rate cap. A client earns `limit` ns of GPU time per ns of wall time, up to
//!   a small burst allowance (`limit × slice`), and spends it while it holds the token;
//!   it is skipped until it has earned `min_slice` back. A sliding-window budget alone
//!   let a lone client with limit 0.5 run flat out for a whole second (half the 2 s
//!   window) and then wait a second, and measured 0.60 over a 4 s run instead of 0.50;
//!   the earned-credit cap holds it to the limit over any span longer than a slice.
//! * Slice: `max_slice` when nobody else wants the GPU ("slices grow"), else the
//!   client's burst estimate clamped to [min_slice, slice]; never longer than its
//!   credit.
//! * A holder whose slice ends while others wait (or whose budget is spent) is
//!   revoked; with nobody waiting its slice is simply extended. Nobody else gets a low
//!   grant while a revoked client drains (its queued kernels still run), for at most
//!   `revoke_grace`.
//! * Nobody is ever cut off for a slow drain. The interposer's gate stops a revoked
//!   holder from submitting anything new, so a drain is only the GPU finishing work
//!   queued before the revocation — one 2 s kernel or CUDA graph is one "launch", and
//!   real training kernels and graphs are that long. A revoked client that has not
//!   released after `revoke_grace` is *overdue*: reported once (counted, listed in
//!   status, logged) and no longer waited for — the next low-priority waiter is
//!   granted (high priority never waited). It stays connected, and when it releases
//!   it is an ordinary client again.
//! * GPU-time accounting is the holding interval [grant, release received] whatever
//!   happened in between, a drain (overdue or not) included: its kernels occupied the
//!   GPU all that time and the arbiter cannot tell how much of it they got. So a long
//!   drain costs the client exactly the time it used — in its usage (fair share) and
//!   its credit (limit) — and nothing more: no hold-off, no cut-off. A stuck agent is
//!   charged the same way (the arbiter cannot tell it from a long kernel); usage
//!   forgets it after one window, and a limited client waits until it has earned the
//!   time back, as it would after a long kernel.
//! * Launch-ahead of a low-priority holder is `launch_ahead_with_high` only while a
//!   high-priority client is *active* — holding, or having wanted or released the
//!   token within `high_active` — and `launch_ahead` otherwise. A high-priority client
//!   that is merely registered (an idle inference server) costs the low job nothing.
//!   The bound follows the high client's activity within the holder's slice
//!   (`SetLaunchAhead`); the timer fires when the window expires.
//! * Duration-aware admission (`admit_by_duration`): while a high-priority
//!   client is active and its rhythm is known (`rhythm`: gaps from its last release to
//!   its next want), a low holder's page carries an admission window (`fit_by_ns`): the
//!   interposer submits a launch only if its measured duration ends inside it, so the
//!   high job comes back to an idle GPU instead of waiting out the rest of a long low
//!   kernel. A client whose waiting launch does not fit (`Need`) is not granted until a
//!   window it fits opens or the high client goes quiet — no grants it cannot use. A
//!   high client that returns inside a window it predicted is counted (`early_returns`).
//! * Overrun: a low holder revoked while a high-priority client is active and still
//!   draining when the grace ends ran into the high job's time, whatever its
//!   interposer admitted (a kernel never measured, a fresh process whose estimates
//!   started empty, launches that bypassed the gate). It is reported (`Overrun`, on
//!   the arbiter's clock: the drain's end is its release or nothing) and its *lease*
//!   — every client of it, present and future — is granted only while no high client
//!   is active, for `overrun_penalty`. Keyed by lease, not connection: a container
//!   that starts a new process per kernel inherits the record. A revoked holder that
//!   had an admission window and whose drain ends (release or departure) more than
//!   `window_overrun_grace` after the later of the window's end and its revocation
//!   (plus, when the high job came back early, the part of the window it took back:
//!   the admitted work then shares the GPU with it) overran the same way: an honest interposer admits only what it measured to fit,
//!   so the grace cannot see a blind 200 ms kernel or work admitted against a clock
//!   of its own, but the window's end can.
//! * Leave (death, disconnect) loses the token at once; it passes on in the same step.
//! * `round-robin` (a baseline): no priority, FIFO order of wanting, fixed `slice`,
//!   no launch-ahead bound, no limits.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use gpushare_config::{SchedulerConfig, SchedulingPolicy};
use gpushare_proto::token::{FIT_UNBOUNDED, HELD_UNTIL_RELEASED};
use gpushare_proto::Priority;

use crate::rhythm::{HighRhythm, Window};

/// One token connection, numbered by the I/O layer.
pub type ClientId = u64;
/// The lease a connection belongs to, numbered by the I/O layer: its clients share one
/// overrun record.
pub type LeaseKey = u64;

const MS: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// A connection became a token connection. `request`/`limit`: the lease's compute
    /// fractions (0..=1).
    Join {
        client: ClientId,
        lease: LeaseKey,
        priority: Priority,
        request: f64,
        limit: f64,
    },
    Want {
        client: ClientId,
    },
    Release {
        client: ClientId,
        again: bool,
    },
    Leave {
        client: ClientId,
    },
    /// The client's waiting launch needs this much GPU time to fit a window (0: none
    /// waits for one).
    Need {
        client: ClientId,
        need_ns: u64,
    },
    /// The arbiter measured a process of `lease` busy on the GPU beyond its token time
    /// while a high-priority client was active (launches past the gate): the lease is
    /// penalised as for an overrun.
    Bypassed {
        lease: LeaseKey,
    },
    /// The time given by `next_wakeup` has come.
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Grant {
        client: ClientId,
        deadline_ns: u64,
        launch_ahead: u32,
    },
    Revoke {
        client: ClientId,
    },
    /// The holder's launch-ahead bound follows high-priority activity (it started, or
    /// the last active high client went quiet or left) within its slice.
    SetLaunchAhead {
        client: ClientId,
        n: u32,
    },
    /// The client's admission window ([`FIT_UNBOUNDED`]: none). Comes before the
    /// `Grant` it belongs to, so the page shows it with the grant.
    SetFitBy {
        client: ClientId,
        fit_by_ns: u64,
    },
    /// A revoked client has not released within the grace period: report it (once).
    /// Its page is unchanged (it is already revoked) and it stays connected; the
    /// policy no longer waits for it.
    Overdue {
        client: ClientId,
    },
    /// The client just went overdue after a revocation beside an active high-priority
    /// client: its drain from `from_ns` on is the high job's time (report it; its
    /// lease is penalised).
    Overrun {
        client: ClientId,
        lease: LeaseKey,
        from_ns: u64,
    },
    /// An overdue client released at last and is an ordinary client again: report it.
    Recovered {
        client: ClientId,
        /// From the revocation to the release.
        drained_ns: u64,
    },
}

/// Counters and the current holders, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySnapshot {
    pub holders: Vec<ClientId>,
    pub waiting: usize,
    pub clients: usize,
    pub grants: u64,
    pub revocations: u64,
    /// Revoked clients that passed the grace period without releasing (a total).
    pub overdue_total: u64,
    /// Revoked clients overdue now (still draining past the grace period).
    pub overdue: Vec<ClientId>,
    /// Admission windows published to low holders (a total).
    pub windows: u64,
    /// Times the high-priority job came back while a low holder's window was still
    /// open: the rhythm mis-predicted (a total).
    pub early_returns: u64,
    /// The high-priority job's recent gaps (ns), oldest first.
    pub high_gaps: Vec<u64>,
    /// Waiting clients whose next launch fits no window now: (client, need ns).
    pub needs: Vec<(ClientId, u64)>,
    /// Revoked low holders still draining beside an active high client after the
    /// grace (a total).
    pub overruns: u64,
    /// Leases whose overrun penalty runs now.
    pub penalized: Vec<LeaseKey>,
}

#[derive(Debug, Clone, Copy)]
struct Settings {
    round_robin: bool,
    slice: u64,
    min_slice: u64,
    max_slice: u64,
    launch_ahead: u32,
    launch_ahead_with_high: u32,
    window: u64,
    revoke_grace: u64,
    high_active: u64,
    admit_by_duration: bool,
    risk_percent: u32,
    overrun_penalty: u64,
    window_overrun_grace: u64,
}

#[derive(Debug)]
struct Client {
    lease: LeaseKey,
    priority: Priority,
    request: f64,
    limit: f64,
    wanting: bool,
    /// Order of the latest `Want` (FIFO under round-robin, tie-break otherwise).
    queued: u64,
    /// Closed holding intervals still (partly) inside the window, oldest first.
    history: VecDeque<(u64, u64)>,
    /// Start of the open holding interval (holding, or revoked and draining).
    held_since: Option<u64>,
    revoked_at: Option<u64>,
    /// Revoked, past the grace period and not released yet: no longer waited for.
    overdue: bool,
    /// This drain was already reported as an overrun (once per revocation).
    drain_overran: bool,
    /// The latest `Want` or `Release` (high priority: what makes it active).
    last_active: Option<u64>,
    /// Moving average of the bursts that ended with a release (ns).
    burst: f64,
    /// GPU time earned and not yet spent (ns) as of `credit_at`, outside any open
    /// holding interval; negative after a drain that overran the credit.
    credit: f64,
    credit_at: u64,
    /// The most credit a client can save up: its burst allowance.
    credit_cap: f64,
    /// What its waiting launch needs to fit a window (0: unknown or none).
    need_ns: u64,
    /// The admission window on its page now.
    page_fit_by: u64,
}

impl Client {
    fn usage(&self, now: u64, window: u64) -> u64 {
        let from = now.saturating_sub(window);
        let overlap = |start: u64, end: u64| end.min(now).saturating_sub(start.max(from));
        let closed: u64 = self.history.iter().map(|&(s, e)| overlap(s, e)).sum();
        closed + self.held_since.map_or(0, |s| overlap(s, now))
    }

    /// Earned GPU time at `t`, the open holding interval spent from it. A bucket: it
    /// fills at `limit` up to the cap and, while held, drains at `1 − limit`.
    fn credit_at(&self, t: u64) -> f64 {
        let fill = |from: u64, to: u64| self.limit * to.saturating_sub(from) as f64;
        match self.held_since {
            None => (self.credit + fill(self.credit_at, t)).min(self.credit_cap),
            Some(since) => {
                let at_grant = (self.credit + fill(self.credit_at, since)).min(self.credit_cap);
                at_grant + fill(since, t) - t.saturating_sub(since) as f64
            }
        }
    }

    /// Nanoseconds of GPU time the limit allows now; None when the limit is the whole
    /// GPU.
    fn budget(&self, now: u64) -> Option<u64> {
        if self.limit >= 1.0 {
            return None;
        }
        Some(self.credit_at(now).max(0.0) as u64)
    }

    /// Closes the open holding interval at `now` against the credit.
    fn settle_credit(&mut self, now: u64) {
        self.credit = self.credit_at(now);
        self.credit_at = now;
    }

    fn forget_before(&mut self, from: u64) {
        while self.history.front().is_some_and(|&(_, end)| end <= from) {
            self.history.pop_front();
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    client: ClientId,
    since: u64,
    revoke_at: u64,
    /// The launch-ahead bound on its page now.
    launch_ahead: u32,
}

/// The policy for one GPU's token.
#[derive(Debug)]
pub struct TokenPolicy {
    settings: Settings,
    clients: BTreeMap<ClientId, Client>,
    /// The holder of the shared slice (low priority, or anyone under round-robin).
    holder: Option<Holder>,
    /// High-priority clients holding (they never wait, so several may).
    high_holders: BTreeSet<ClientId>,
    next_queued: u64,
    /// When a waiter blocked by its limit will have budget again.
    retry_at: Option<u64>,
    grants: u64,
    revocations: u64,
    overdue_total: u64,
    rhythm: HighRhythm,
    /// The current admission window, cached until it is due for re-evaluation (or the
    /// high job's activity changes): every event evaluating it afresh would move a
    /// late job's window with each step.
    window: Option<Window>,
    windows: u64,
    early_returns: u64,
    overruns: u64,
    /// Until when each lease that overran gets no grant while a high client is active.
    penalties: BTreeMap<LeaseKey, u64>,
    /// The latest instant an event was handled at (`next_wakeup` has no clock).
    last_now: u64,
}

impl TokenPolicy {
    /// `policy = "off"` never reaches here (Schedule is refused); it is treated as
    /// round-robin should it ever be.
    pub fn new(config: &SchedulerConfig) -> TokenPolicy {
        TokenPolicy {
            settings: Settings {
                round_robin: config.policy != SchedulingPolicy::Priority,
                slice: config.slice_ms * MS,
                min_slice: config.min_slice_ms * MS,
                max_slice: config.max_slice_ms * MS,
                launch_ahead: config.launch_ahead,
                launch_ahead_with_high: config.launch_ahead_with_high,
                window: config.window_ms * MS,
                revoke_grace: config.revoke_grace_ms * MS,
                high_active: config.high_active_ms * MS,
                admit_by_duration: config.admit_by_duration,
                risk_percent: config.high_return_risk_percent,
                overrun_penalty: config.overrun_penalty_ms.saturating_mul(MS),
                window_overrun_grace: config.window_overrun_grace_ms.saturating_mul(MS),
            },
            clients: BTreeMap::new(),
            holder: None,
            high_holders: BTreeSet::new(),
            next_queued: 0,
            retry_at: None,
            grants: 0,
            revocations: 0,
            overdue_total: 0,
            rhythm: HighRhythm::default(),
            window: None,
            windows: 0,
            early_returns: 0,
            overruns: 0,
            penalties: BTreeMap::new(),
            last_now: 0,
        }
    }

    /// When the caller must send `Tick` next (CLOCK_MONOTONIC ns), if ever.
    pub fn next_wakeup(&self) -> Option<u64> {
        let revoke = self.holder.map(|h| h.revoke_at);
        let overdue = self
            .clients
            .values()
            .filter(|c| !c.overdue)
            .filter_map(|c| c.revoked_at)
            .map(|at| at.saturating_add(self.settings.revoke_grace))
            .min();
        // The holder's launch-ahead bound relaxes when the last high client goes quiet.
        let high_quiet = self
            .holder
            .filter(|h| h.launch_ahead != self.settings.launch_ahead)
            .and_then(|_| self.high_active_until());
        // A window is looked at again while a holder has one or a waiter needs one;
        // a waiter that fits no window is granted once the high client goes quiet.
        // (Needs are cleared while no high client is active: then the quiet instant
        // below lies ahead, never behind, and the timer cannot spin on it.)
        let needs_window = self
            .clients
            .iter()
            .any(|(&id, c)| c.wanting && c.need_ns > 0 && !self.holds(id));
        let windowed = self
            .holder
            .is_some_and(|h| self.clients[&h.client].page_fit_by != FIT_UNBOUNDED);
        let window = self
            .window
            .filter(|_| windowed || needs_window)
            .map(|w| w.reevaluate_at);
        let waiter_unblocked = if needs_window {
            self.high_active_until()
        } else {
            None
        };
        [
            revoke,
            overdue,
            self.retry_at,
            high_quiet,
            window,
            waiter_unblocked,
            self.penalty_ends(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    pub fn snapshot(&self) -> PolicySnapshot {
        let mut holders: Vec<ClientId> = self.high_holders.iter().copied().collect();
        holders.extend(self.holder.map(|h| h.client));
        PolicySnapshot {
            holders,
            waiting: self
                .clients
                .iter()
                .filter(|(id, c)| c.wanting && !self.holds(**id))
                .count(),
            clients: self.clients.len(),
            grants: self.grants,
            revocations: self.revocations,
            overdue_total: self.overdue_total,
            overdue: self
                .clients
                .iter()
                .filter(|(_, c)| c.overdue)
                .map(|(&id, _)| id)
                .collect(),
            windows: self.windows,
            early_returns: self.early_returns,
            high_gaps: self.rhythm.gaps().collect(),
            needs: self
                .clients
                .iter()
                .filter(|(&id, c)| c.wanting && c.need_ns > 0 && !self.holds(id))
                .map(|(&id, c)| (id, c.need_ns))
                .collect(),
            overruns: self.overruns,
            penalized: self.penalties.keys().copied().collect(),
        }
    }

    pub fn handle(&mut self, now: u64, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        self.last_now = self.last_now.max(now);
        match event {
            Event::Join {
                client,
                lease,
                priority,
                request,
                limit,
            } => self.join(now, client, lease, priority, request, limit),
            Event::Want { client } => self.want(now, client, &mut actions),
            Event::Release { client, again } => self.release(now, client, again, &mut actions),
            Event::Leave { client } => self.leave(now, client, &mut actions),
            Event::Need { client, need_ns } => {
                if let Some(c) = self.clients.get_mut(&client) {
                    c.need_ns = need_ns;
                }
            }
            Event::Bypassed { lease } => {
                penalize(&mut self.penalties, &self.settings, lease, now);
            }
            Event::Tick => {}
        }
        self.dispatch(now, &mut actions);
        actions
    }

    fn holds(&self, client: ClientId) -> bool {
        self.high_holders.contains(&client) || self.holder.is_some_and(|h| h.client == client)
    }

    /// Under `priority`, high-priority clients bypass the queue.
    fn is_preemptive(&self, client: &Client) -> bool {
        !self.settings.round_robin && client.priority == Priority::High
    }

    /// While a high-priority client holds: None (active until it releases). Otherwise
    /// the end of the latest high client's activity window, if any high client is
    /// registered; it may lie in the past.
    fn high_active_until(&self) -> Option<u64> {
        if self.settings.round_robin || !self.high_holders.is_empty() {
            return None;
        }
        self.clients
            .values()
            .filter(|c| c.priority == Priority::High)
            .filter_map(|c| c.last_active)
            .map(|at| at.saturating_add(self.settings.high_active))
            .max()
    }

    /// A high-priority client holds, or wanted or released the token within
    /// `high_active`: a low holder must stay preemptible within about one kernel.
    pub fn high_active(&self, now: u64) -> bool {
        !self.settings.round_robin
            && (!self.high_holders.is_empty()
                || self.high_active_until().is_some_and(|until| now < until))
    }

    fn low_launch_ahead(&self, now: u64) -> u32 {
        if self.settings.round_robin {
            0
        } else if self.high_active(now) {
            self.settings.launch_ahead_with_high
        } else {
            self.settings.launch_ahead
        }
    }

    /// The admission window a low holder gets now: [`FIT_UNBOUNDED`] unless windows
    /// are on, a high-priority client is active and its rhythm is known.
    fn fit_by(&self, now: u64) -> u64 {
        if !self.settings.admit_by_duration || !self.high_active(now) {
            return FIT_UNBOUNDED;
        }
        self.window.map_or(FIT_UNBOUNDED, |w| w.fit_by)
    }

    /// Re-evaluates the cached window when it is due (or was dropped by a change of
    /// the high job's activity).
    fn refresh_window(&mut self, now: u64) {
        if self.window.is_none_or(|w| now >= w.reevaluate_at) {
            self.window = self.rhythm.window(now, self.settings.risk_percent);
        }
    }

    /// Whether a waiter's known need fits the window (an unknown need always does:
    /// the interposer holds back what it measured not to fit).
    fn need_fits(&self, now: u64, client: &Client) -> bool {
        let fit_by = self.fit_by(now);
        client.need_ns == 0
            || fit_by == FIT_UNBOUNDED
            || fit_by.saturating_sub(now) >= client.need_ns
    }

    fn join(
        &mut self,
        now: u64,
        client: ClientId,
        lease: LeaseKey,
        priority: Priority,
        request: f64,
        limit: f64,
    ) {
        let limit = limit.clamp(0.0, 1.0);
        // Enough for one contended slice at the limit's pace, and never less than two
        // of the shortest slices, so a low limit still gets slices worth a handoff.
        let credit_cap =
            (limit * self.settings.slice as f64).max(2.0 * self.settings.min_slice as f64);
        self.clients.insert(
            client,
            Client {
                lease,
                priority,
                request: request.clamp(0.0, 1.0),
                limit,
                credit: credit_cap,
                credit_at: now,
                credit_cap,
                wanting: false,
                queued: 0,
                history: VecDeque::new(),
                held_since: None,
                revoked_at: None,
                overdue: false,
                drain_overran: false,
                // Joining is not activity: a registered high client bounds nobody
                // until it wants the GPU.
                last_active: None,
                burst: self.settings.slice as f64,
                need_ns: 0,
                page_fit_by: FIT_UNBOUNDED,
            },
        );
    }

    fn want(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        let Some(client) = self.clients.get(&id) else {
            return;
        };
        let preemptive = self.is_preemptive(client);
        if let Some(client) = self.clients.get_mut(&id) {
            client.last_active = Some(now);
        }
        if self.holds(id) {
            return;
        }
        if preemptive {
            if self.high_holders.is_empty() {
                // A gap of the high job's rhythm ends; was it back inside a window?
                if let Some(holder) = self.holder {
                    let fit_by = self.clients[&holder.client].page_fit_by;
                    if fit_by != FIT_UNBOUNDED && fit_by > now {
                        self.early_returns += 1;
                    }
                }
                self.rhythm.wanted(now, self.settings.high_active);
                self.window = None;
            }
            // Revoke first, so the low holder's page changes before the high client's
            // kernels reach the GPU; no waiting for its acknowledgement.
            if let Some(low) = self.holder.take() {
                self.revoke(now, low.client, actions);
            }
            self.high_holders.insert(id);
            let client = self.clients.get_mut(&id).expect("checked above");
            client.wanting = true;
            client.held_since = Some(now);
            self.grants += 1;
            actions.push(Action::Grant {
                client: id,
                deadline_ns: HELD_UNTIL_RELEASED,
                launch_ahead: 0,
            });
            return;
        }
        let queued = self.next_queued;
        let client = self.clients.get_mut(&id).expect("checked above");
        if !client.wanting {
            client.wanting = true;
            client.queued = queued;
            self.next_queued += 1;
        }
    }

    fn revoke(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        if let Some(client) = self.clients.get_mut(&id) {
            client.revoked_at = Some(now);
            self.revocations += 1;
            actions.push(Action::Revoke { client: id });
        }
    }

    /// A revoked client's drain ended (it released, or went): work it ran past the
    /// window it was given is the high job's time, on the arbiter's clock (its
    /// revocation, its window, now), whatever its interposer believed about its
    /// kernels or its clock.
    fn judge_drain_end(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        let grace = self.settings.window_overrun_grace;
        let Some(client) = self.clients.get_mut(&id) else {
            return;
        };
        let late_from = client.revoked_at.and_then(|revoked_at| {
            let window_end = client.page_fit_by;
            // A high job back before the window's end shares the GPU with what the
            // holder admitted to fit it, which then runs up to twice as long: the part
            // of the window it took back is allowed once more.
            let taken_back = window_end.saturating_sub(revoked_at);
            let from = window_end
                .max(revoked_at)
                .saturating_add(taken_back)
                .saturating_add(grace);
            (window_end != FIT_UNBOUNDED && !client.drain_overran && now > from).then_some(from)
        });
        client.drain_overran = false;
        if let Some(from_ns) = late_from {
            let lease = client.lease;
            self.overruns += 1;
            actions.push(Action::Overrun {
                client: id,
                lease,
                from_ns,
            });
            penalize(&mut self.penalties, &self.settings, lease, now);
        }
    }

    fn release(&mut self, now: u64, id: ClientId, again: bool, actions: &mut Vec<Action>) {
        self.judge_drain_end(now, id, actions);
        let was_high_holder = self.high_holders.remove(&id);
        let was_holder = self.holder.is_some_and(|h| h.client == id);
        if was_holder {
            self.holder = None;
        }
        let queued = self.next_queued;
        let window = self.settings.window;
        let Some(client) = self.clients.get_mut(&id) else {
            return;
        };
        client.settle_credit(now);
        if let Some(since) = client.held_since.take() {
            client.history.push_back((since, now));
            client.forget_before(now.saturating_sub(window));
            if !again && client.revoked_at.is_none() {
                // A burst that ended on its own: what this client's slices should fit.
                client.burst = 0.5 * client.burst + 0.5 * (now - since) as f64;
            }
        }
        client.last_active = Some(now);
        if client.overdue {
            client.overdue = false;
            actions.push(Action::Recovered {
                client: id,
                drained_ns: now.saturating_sub(client.revoked_at.unwrap_or(now)),
            });
        }
        client.revoked_at = None;
        client.wanting = again;
        if again {
            client.queued = queued;
            self.next_queued += 1;
        }
        if was_high_holder && again {
            // A high-priority client never waits: it is granted again at once.
            self.want(now, id, actions);
        } else if was_high_holder && self.high_holders.is_empty() {
            self.rhythm.released(now);
            self.window = None;
        }
    }

    fn leave(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        // A process that exits with its drain is judged like one that released.
        self.judge_drain_end(now, id, actions);
        let was_high_holder = self.high_holders.remove(&id);
        if self.holder.is_some_and(|h| h.client == id) {
            self.holder = None;
        }
        self.clients.remove(&id);
        if !self.clients.values().any(|c| c.priority == Priority::High) {
            self.rhythm.forget();
            self.window = None;
        } else if was_high_holder && self.high_holders.is_empty() {
            self.rhythm.released(now);
            self.window = None;
        }
    }

    /// High-priority activity started or ended: the low holder's launch-ahead bound
    /// and admission window follow it.
    fn retune_holder(&mut self, now: u64, actions: &mut Vec<Action>) {
        let n = self.low_launch_ahead(now);
        if let Some(holder) = self.holder.as_mut().filter(|h| h.launch_ahead != n) {
            holder.launch_ahead = n;
            actions.push(Action::SetLaunchAhead {
                client: holder.client,
                n,
            });
        }
        if let Some(holder) = self.holder {
            self.publish_window(now, holder.client, actions);
        }
    }

    /// Puts the current window on `id`'s page if it shows another.
    fn publish_window(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        let fit_by_ns = self.fit_by(now);
        let client = self.clients.get_mut(&id).expect("a holder exists");
        if client.page_fit_by != fit_by_ns {
            client.page_fit_by = fit_by_ns;
            if fit_by_ns != FIT_UNBOUNDED {
                self.windows += 1;
            }
            actions.push(Action::SetFitBy {
                client: id,
                fit_by_ns,
            });
        }
    }

    /// Waiters that may be granted now (not holding, not draining, within budget).
    fn eligible(&self, now: u64) -> impl Iterator<Item = (ClientId, &Client)> + '_ {
        self.clients.iter().filter_map(move |(&id, c)| {
            let ok = c.wanting
                && !self.holds(id)
                && c.revoked_at.is_none()
                && !self.is_preemptive(c)
                && self.need_fits(now, c)
                && !self.penalized(now, c)
                && (self.settings.round_robin
                    || c.budget(now).is_none_or(|b| b >= self.settings.min_slice));
            ok.then_some((id, c))
        })
    }

    fn others_eligible(&self, now: u64, id: ClientId) -> bool {
        self.eligible(now).any(|(other, _)| other != id)
    }

    fn pick_next(&self, now: u64) -> Option<ClientId> {
        let window = self.settings.window;
        if self.settings.round_robin {
            return self
                .eligible(now)
                .min_by_key(|(_, c)| c.queued)
                .map(|(id, _)| id);
        }
        self.eligible(now)
            .min_by(|(_, a), (_, b)| {
                let key = |c: &Client| {
                    let usage = c.usage(now, window) as f64;
                    let share = if c.request > 0.0 {
                        usage / c.request
                    } else {
                        usage
                    };
                    (c.request <= 0.0, share)
                };
                let (ka, kb) = (key(a), key(b));
                ka.0.cmp(&kb.0)
                    .then(ka.1.total_cmp(&kb.1))
                    .then(a.queued.cmp(&b.queued))
            })
            .map(|(id, _)| id)
    }

    /// The slice `id` gets starting now.
    fn slice_for(&self, now: u64, id: ClientId) -> u64 {
        let s = &self.settings;
        if s.round_robin {
            return s.slice;
        }
        let client = &self.clients[&id];
        let wanted = if self.others_eligible(now, id) {
            // 1.5× the burst estimate: a burst a little longer than the last ones still
            // fits, so it is not revoked a hair before its end.
            ((client.burst * 1.5) as u64).clamp(s.min_slice, s.slice)
        } else {
            s.max_slice
        };
        match client.budget(now) {
            Some(budget) => wanted.min(budget),
            None => wanted,
        }
    }

    fn grant_low(&mut self, now: u64, id: ClientId, actions: &mut Vec<Action>) {
        self.publish_window(now, id, actions);
        // What it needed was for this grant; its next `Fit` says what it needs next.
        if let Some(client) = self.clients.get_mut(&id) {
            client.need_ns = 0;
        }
        let slice = self.slice_for(now, id);
        let deadline_ns = now.saturating_add(slice);
        let launch_ahead = self.low_launch_ahead(now);
        let client = self.clients.get_mut(&id).expect("a granted client exists");
        if client.held_since.is_none() {
            client.held_since = Some(now);
        }
        let since = client.held_since.expect("set above");
        self.holder = Some(Holder {
            client: id,
            since,
            revoke_at: deadline_ns,
            launch_ahead,
        });
        self.grants += 1;
        actions.push(Action::Grant {
            client: id,
            deadline_ns,
            launch_ahead,
        });
    }

    /// Runs after every event: overdue drains, slice ends, the next grant, the
    /// launch-ahead bound, the retry timer.
    fn dispatch(&mut self, now: u64, actions: &mut Vec<Action>) {
        self.refresh_window(now);
        if !self.high_active(now) {
            // No windows without an active high client: every need fits.
            for client in self.clients.values_mut() {
                client.need_ns = 0;
            }
        }
        let grace = self.settings.revoke_grace;
        let high_active = self.high_active(now);
        for (&id, client) in self.clients.iter_mut() {
            let Some(revoked_at) = client.revoked_at else {
                continue;
            };
            let grace_ends = revoked_at.saturating_add(grace);
            if now >= grace_ends && !client.overdue {
                client.overdue = true;
                self.overdue_total += 1;
                actions.push(Action::Overdue { client: id });
                if high_active && !client.drain_overran {
                    client.drain_overran = true;
                    self.overruns += 1;
                    actions.push(Action::Overrun {
                        client: id,
                        lease: client.lease,
                        from_ns: grace_ends,
                    });
                    penalize(&mut self.penalties, &self.settings, client.lease, now);
                }
            }
        }
        self.penalties.retain(|_, until| *until > now);

        if let Some(mut holder) = self.holder {
            let contended = self.others_eligible(now, holder.client);
            if contended && !self.settings.round_robin {
                // Someone started waiting during a grown slice: end it where a
                // contended slice would have ended.
                let contended_slice = self.slice_for(now, holder.client);
                holder.revoke_at = holder
                    .revoke_at
                    .min(holder.since.saturating_add(contended_slice).max(now));
                self.holder = Some(holder);
            }
            if now >= holder.revoke_at {
                let spent = self.clients[&holder.client]
                    .budget(now)
                    .is_some_and(|b| b < self.settings.min_slice);
                if contended || spent {
                    self.holder = None;
                    self.revoke(now, holder.client, actions);
                } else {
                    // Nobody else wants it: extend rather than make it hand back and ask again.
                    self.grant_low(now, holder.client, actions);
                }
            }
        }

        // An overdue client drains on, but nobody waits for it any longer.
        let draining = self
            .clients
            .values()
            .any(|c| c.revoked_at.is_some() && !c.overdue);
        let high_holding = !self.high_holders.is_empty();
        if self.holder.is_none() && !draining && !high_holding {
            if let Some(next) = self.pick_next(now) {
                self.grant_low(now, next, actions);
            }
        }

        self.retune_holder(now, actions);

        self.retry_at = if self.holder.is_none() && !draining && !high_holding {
            self.clients
                .values()
                .filter(|c| c.wanting && c.revoked_at.is_none() && !self.is_preemptive(c))
                .filter_map(|c| self.budget_returns_at(now, c))
                .min()
        } else {
            None
        };
        let from = now.saturating_sub(self.settings.window);
        for client in self.clients.values_mut() {
            client.forget_before(from);
        }
    }

    /// Whether `client`'s lease overran recently and a high client is active now: then
    /// it is not granted (the window it would get is what it overran).
    fn penalized(&self, now: u64, client: &Client) -> bool {
        self.high_active(now)
            && self
                .penalties
                .get(&client.lease)
                .is_some_and(|&until| now < until)
    }

    /// When a waiter held back by its lease's penalty may be granted: the penalty
    /// ends, or the high client goes quiet. None when no waiter is held back now (so
    /// the timer never spins on an instant already past).
    fn penalty_ends(&self) -> Option<u64> {
        let now = self.last_now;
        self.clients
            .iter()
            .filter(|(&id, c)| c.wanting && !self.holds(id) && self.penalized(now, c))
            .filter_map(|(_, c)| {
                let until = self.penalties.get(&c.lease).copied()?;
                Some(
                    self.high_active_until()
                        .map_or(until, |quiet| quiet.min(until)),
                )
            })
            .min()
    }

    /// When a waiter held back by its limit will have `min_slice` of credit again: it
    /// earns `limit` per ns while it waits, so the instant is exact.
    fn budget_returns_at(&self, now: u64, client: &Client) -> Option<u64> {
        let min_slice = self.settings.min_slice;
        if client.budget(now).is_none_or(|b| b >= min_slice) || client.limit <= 0.0 {
            return None;
        }
        let missing = min_slice as f64 - client.credit_at(now);
        Some(now.saturating_add((missing / client.limit).ceil() as u64))
    }
}

/// `lease` gets no grant while a high client is active until `overrun_penalty` from
/// `now` (a later penalty never shortens an earlier one).
fn penalize(
    penalties: &mut BTreeMap<LeaseKey, u64>,
    settings: &Settings,
    lease: LeaseKey,
    now: u64,
) {
    if settings.overrun_penalty > 0 {
        let until = now.saturating_add(settings.overrun_penalty);
        let entry = penalties.entry(lease).or_insert(until);
        *entry = (*entry).max(until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::*;

    const LOW: Priority = Priority::Low;
    const HIGH: Priority = Priority::High;

    /// The rules before admission windows and overrun penalties: the tables below
    /// predate them (windows and penalties have tables of their own, with the shipped
    /// default). Overruns are still reported.
    fn config() -> SchedulerConfig {
        SchedulerConfig {
            admit_by_duration: false,
            overrun_penalty_ms: 0,
            ..SchedulerConfig::default()
        }
    }

    fn join(client: ClientId, priority: Priority) -> Event {
        Event::Join {
            client,
            lease: client,
            priority,
            request: 0.0,
            limit: 1.0,
        }
    }

    fn want(client: ClientId) -> Event {
        Event::Want { client }
    }

    fn release(client: ClientId, again: bool) -> Event {
        Event::Release { client, again }
    }

    /// Runs (time in ms, event, expected actions) rows against one policy.
    fn run_table(config: SchedulerConfig, rows: &[(u64, Event, &[Action])]) -> TokenPolicy {
        let mut policy = TokenPolicy::new(&config);
        for (i, (at_ms, event, expected)) in rows.iter().enumerate() {
            let actions = policy.handle(at_ms * MS, *event);
            assert_eq!(&actions, expected, "row {i}: {event:?} at {at_ms} ms");
        }
        policy
    }

    fn grant(client: ClientId, at_ms: u64, slice_ms: u64, launch_ahead: u32) -> Action {
        Grant {
            client,
            deadline_ns: (at_ms + slice_ms) * MS,
            launch_ahead,
        }
    }

    const FOREVER: u64 = HELD_UNTIL_RELEASED;

    #[test]
    fn a_lone_low_client_gets_a_grown_slice_and_it_is_extended_while_nobody_waits() {
        run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (100, want(1), &[]),
                (200, Event::Tick, &[grant(1, 200, 200, 0)]),
            ],
        );
    }

    #[test]
    fn work_conservation_a_release_hands_over_at_once() {
        run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                // B waits; A's grown slice now ends at a contended slice's end.
                (1, want(2), &[]),
                (3, release(1, false), &[grant(2, 3, 200, 0)]),
            ],
        );
    }

    #[test]
    fn a_waiter_shortens_a_grown_slice_and_the_overrunning_holder_is_revoked() {
        let policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (5, want(2), &[]),
            ],
        );
        assert_eq!(policy.next_wakeup(), Some(20 * MS), "0 + slice_ms");
        let mut policy = policy;
        assert_eq!(
            policy.handle(20 * MS, Event::Tick),
            vec![Revoke { client: 1 }]
        );
        // B waits for A's acknowledgement: A's queued work still runs.
        assert_eq!(policy.handle(21 * MS, Event::Tick), vec![]);
        assert_eq!(
            policy.handle(22 * MS, release(1, true)),
            vec![grant(2, 22, 20, 0)],
            "A still wants, so B's slice is a contended one"
        );
    }

    #[test]
    fn high_preempts_a_low_holder_at_once_and_low_resumes_after() {
        run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                // Registered but idle: it bounds nobody.
                (1, join(2, HIGH), &[]),
                (
                    2,
                    want(2),
                    &[
                        Revoke { client: 1 },
                        Grant {
                            client: 2,
                            deadline_ns: FOREVER,
                            launch_ahead: 0,
                        },
                    ],
                ),
                (3, want(2), &[]),
                // The low client acknowledges; it still has work, but high holds.
                (4, release(1, true), &[]),
                (10, release(2, false), &[grant(1, 10, 200, 1)]),
                (
                    11,
                    Event::Leave { client: 2 },
                    &[SetLaunchAhead { client: 1, n: 0 }],
                ),
            ],
        );
    }

    #[test]
    fn high_clients_never_wait_even_for_each_other() {
        run_table(
            config(),
            &[
                (0, join(1, HIGH), &[]),
                (0, join(2, HIGH), &[]),
                (
                    0,
                    want(1),
                    &[Grant {
                        client: 1,
                        deadline_ns: FOREVER,
                        launch_ahead: 0,
                    }],
                ),
                (
                    1,
                    want(2),
                    &[Grant {
                        client: 2,
                        deadline_ns: FOREVER,
                        launch_ahead: 0,
                    }],
                ),
                (
                    2,
                    release(1, true),
                    &[Grant {
                        client: 1,
                        deadline_ns: FOREVER,
                        launch_ahead: 0,
                    }],
                ),
            ],
        );
    }

    #[test]
    fn a_dead_holder_token_passes_on_at_once() {
        run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (1, want(2), &[]),
                (2, Event::Leave { client: 1 }, &[grant(2, 2, 200, 0)]),
            ],
        );
    }

    fn high_grant(client: ClientId) -> Action {
        Grant {
            client,
            deadline_ns: FOREVER,
            launch_ahead: 0,
        }
    }

    #[test]
    fn a_revoked_client_that_never_releases_is_overdue_not_cut_off() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, LOW), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (1, want(2), &[]),
                (20, Event::Tick, &[Revoke { client: 1 }]),
            ],
        );
        assert_eq!(
            policy.next_wakeup(),
            Some(520 * MS),
            "revoked at 20 + 500 grace"
        );
        assert_eq!(policy.handle(519 * MS, Event::Tick), vec![]);
        // No longer waited for: B is granted. A is reported once and stays a client.
        assert_eq!(
            policy.handle(520 * MS, Event::Tick),
            vec![Overdue { client: 1 }, grant(2, 520, 200, 0)]
        );
        assert_eq!(policy.handle(600 * MS, Event::Tick), vec![]);
        let snapshot = policy.snapshot();
        assert_eq!((snapshot.overdue_total, snapshot.revocations), (1, 1));
        assert_eq!(snapshot.overdue, vec![1]);
        assert_eq!(
            (snapshot.overruns, snapshot.penalized.len()),
            (0, 0),
            "no high client was active: a slow drain, not an overrun"
        );
        assert_eq!((snapshot.holders, snapshot.clients), (vec![2], 2));
        assert_ne!(
            policy.next_wakeup(),
            Some(520 * MS),
            "the overdue deadline is not polled again"
        );
        // A's late release makes it an ordinary client: its want now ends B's slice.
        assert_eq!(
            policy.handle(1_000 * MS, release(1, true)),
            vec![
                Recovered {
                    client: 1,
                    drained_ns: 980 * MS
                },
                Revoke { client: 2 }
            ]
        );
        assert_eq!(policy.snapshot().overdue, Vec::<ClientId>::new());
        assert_eq!(
            policy.handle(1_001 * MS, release(2, false)),
            vec![grant(1, 1_001, 200, 0)]
        );
        assert_eq!(policy.snapshot().overdue_total, 1, "a total, not a gauge");
    }

    #[test]
    fn a_holder_draining_2s_is_never_cut_off_and_gets_the_token_back_after_the_high_job_leaves() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (10, want(2), &[Revoke { client: 1 }, high_grant(2)]),
                // The low job's 2 s kernel keeps running; it wants more afterwards.
                (10, want(1), &[]),
                (509, Event::Tick, &[]),
                (
                    510,
                    Event::Tick,
                    &[Overdue { client: 1 }, overrun(1, 1, 510)],
                ),
                (1_500, Event::Tick, &[]),
                (
                    2_010,
                    release(1, true),
                    &[Recovered {
                        client: 1,
                        drained_ns: 2_000 * MS,
                    }],
                ),
                // The high job finishes its burst: low runs again, bounded while the
                // high job was active recently…
                (2_100, release(2, false), &[grant(1, 2_100, 200, 1)]),
                // …and unbounded once it has left.
                (
                    2_200,
                    Event::Leave { client: 2 },
                    &[SetLaunchAhead { client: 1, n: 0 }],
                ),
            ],
        );
        let snapshot = policy.snapshot();
        assert_eq!(snapshot.holders, vec![1]);
        assert_eq!((snapshot.overdue_total, snapshot.overdue.len()), (1, 0));
        // Its drain counts as GPU time it used, nothing more: the holding interval
        // [0, 2010] and the current one from 2100.
        assert_eq!(
            policy.clients[&1].usage(2_200 * MS, 20_000 * MS),
            2_110 * MS
        );
        assert_eq!(policy.handle(2_250 * MS, Event::Tick), vec![]);
    }

    #[test]
    fn an_overdue_client_wanting_again_waits_for_its_own_release() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (1, want(2), &[Revoke { client: 1 }, high_grant(2)]),
                (
                    501,
                    Event::Tick,
                    &[Overdue { client: 1 }, overrun(1, 1, 501)],
                ),
                (600, release(2, false), &[]),
                (700, want(1), &[]),
            ],
        );
        assert_eq!(policy.snapshot().waiting, 1);
        assert_eq!(
            policy.next_wakeup(),
            None,
            "nothing to do until it releases"
        );
        assert_eq!(
            policy.handle(900 * MS, release(1, true)),
            vec![
                Recovered {
                    client: 1,
                    drained_ns: 899 * MS
                },
                grant(1, 900, 200, 1)
            ],
            "the high client released at 600: still active until 1100"
        );
    }

    #[test]
    fn a_high_preemption_is_also_subject_to_the_grace() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (1, want(2), &[Revoke { client: 1 }, high_grant(2)]),
            ],
        );
        assert_eq!(
            policy.handle(501 * MS, Event::Tick),
            vec![Overdue { client: 1 }, overrun(1, 1, 501)],
            "revoked for a high client that is still active: an overrun too"
        );
    }

    /// `launch_ahead_with_high` = 1, `launch_ahead` = 0, `high_active_ms` = 500.
    #[test]
    fn launch_ahead_is_bounded_only_while_a_high_client_is_active() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                // A registered, idle high client: unbounded.
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (5, want(2), &[Revoke { client: 1 }, high_grant(2)]),
                (6, release(1, true), &[]),
                // Active: it released 0 ms ago.
                (10, release(2, false), &[grant(1, 10, 200, 1)]),
            ],
        );
        // The slice ends at 210 (extended, still bounded: active until 510).
        assert_eq!(policy.next_wakeup(), Some(210 * MS));
        assert_eq!(
            policy.handle(210 * MS, Event::Tick),
            vec![grant(1, 210, 200, 1)]
        );
        // The window's end wakes the timer before the slice's end.
        assert_eq!(policy.next_wakeup(), Some(410 * MS));
        assert_eq!(
            policy.handle(410 * MS, Event::Tick),
            vec![grant(1, 410, 200, 1)]
        );
        assert_eq!(policy.next_wakeup(), Some(510 * MS));
        assert_eq!(policy.handle(509 * MS, Event::Tick), vec![]);
        assert_eq!(
            policy.handle(510 * MS, Event::Tick),
            vec![SetLaunchAhead { client: 1, n: 0 }]
        );
        assert_eq!(policy.next_wakeup(), Some(610 * MS), "the slice's end only");
        assert_eq!(
            policy.handle(610 * MS, Event::Tick),
            vec![grant(1, 610, 200, 0)]
        );
        // The high client wants again: preempted, and bounded at the next grant.
        assert_eq!(
            policy.handle(700 * MS, want(2)),
            vec![Revoke { client: 1 }, high_grant(2)]
        );
        assert_eq!(policy.handle(701 * MS, release(1, true)), vec![]);
        assert_eq!(
            policy.handle(703 * MS, release(2, false)),
            vec![grant(1, 703, 200, 1)]
        );
        // The high client leaves inside its window: unbounded at once.
        assert_eq!(
            policy.handle(800 * MS, Event::Leave { client: 2 }),
            vec![SetLaunchAhead { client: 1, n: 0 }]
        );
        assert_eq!(policy.next_wakeup(), Some(903 * MS));
    }

    #[test]
    fn the_latest_active_high_client_keeps_the_bound() {
        let mut policy = run_table(
            config(),
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, join(3, HIGH), &[]),
                (0, want(2), &[high_grant(2)]),
                (1, release(2, false), &[]),
                (300, want(3), &[high_grant(3)]),
                (301, release(3, false), &[]),
                (302, want(1), &[grant(1, 302, 200, 1)]),
                // 2's window ended at 501, 3's lasts until 801.
                (501, Event::Tick, &[]),
                (502, Event::Tick, &[grant(1, 502, 200, 1)]),
                // 3 leaves: 2 is registered but quiet.
                (
                    600,
                    Event::Leave { client: 3 },
                    &[SetLaunchAhead { client: 1, n: 0 }],
                ),
                // 2 wants again: it preempts, as ever.
                (650, want(2), &[Revoke { client: 1 }, high_grant(2)]),
            ],
        );
        assert_eq!(policy.snapshot().holders, vec![2]);
        assert_eq!(policy.handle(660 * MS, release(1, true)), vec![]);
        assert_eq!(policy.next_wakeup(), None, "high holds: no timer");
    }

    #[test]
    fn equal_bounds_or_round_robin_never_retune() {
        let same = SchedulerConfig {
            launch_ahead: 1,
            ..config()
        };
        let policy = run_table(
            same,
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(2), &[high_grant(2)]),
                (1, release(2, false), &[]),
                (2, want(1), &[grant(1, 2, 200, 1)]),
                (150, Event::Leave { client: 2 }, &[]),
            ],
        );
        assert_eq!(policy.next_wakeup(), Some(202 * MS), "the slice only");
        let round_robin = SchedulerConfig {
            policy: SchedulingPolicy::RoundRobin,
            launch_ahead: 4,
            ..config()
        };
        let policy = run_table(
            round_robin,
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(1), &[grant(1, 0, 20, 0)]),
                (1, Event::Leave { client: 2 }, &[]),
            ],
        );
        assert_eq!(policy.next_wakeup(), Some(20 * MS));
    }

    fn fit_by(client: ClientId, at_ms: u64) -> Action {
        SetFitBy {
            client,
            fit_by_ns: at_ms * MS,
        }
    }

    fn unbounded(client: ClientId) -> Action {
        SetFitBy {
            client,
            fit_by_ns: FIT_UNBOUNDED,
        }
    }

    fn need(client: ClientId, need_ms: u64) -> Event {
        Event::Need {
            client,
            need_ns: need_ms * MS,
        }
    }

    /// The high job (2) bursts 0–5 and 8–13: one gap of 3 ms learned by the time the
    /// low job (1) is granted at 13.
    fn rhythm_rows() -> Vec<(u64, Event, &'static [Action])> {
        vec![
            (0, join(1, LOW), &[]),
            (0, join(2, HIGH), &[]),
            (0, want(2), &[]),
            (5, release(2, false), &[]),
            (8, want(2), &[]),
            (13, release(2, false), &[]),
        ]
    }

    /// Runs the rows, checking their actions when `check`.
    fn run_rows(policy: &mut TokenPolicy, rows: &[(u64, Event, &[Action])], check: bool) {
        for (i, (at_ms, event, expected)) in rows.iter().enumerate() {
            let actions = policy.handle(at_ms * MS, *event);
            if check {
                assert_eq!(&actions, expected, "row {i}: {event:?} at {at_ms} ms");
            }
        }
    }

    #[test]
    fn a_low_holder_gets_the_high_jobs_predicted_gap_as_its_window() {
        let mut policy = TokenPolicy::new(&SchedulerConfig::default());
        run_rows(&mut policy, &rhythm_rows(), false);
        assert_eq!(policy.snapshot().high_gaps, vec![3 * MS]);
        run_rows(
            &mut policy,
            &[
                // The window: the release at 13 plus the 3 ms gap, on the page first.
                (13, want(1), &[fit_by(1, 16), grant(1, 13, 200, 1)]),
            ],
            true,
        );
        assert_eq!(policy.next_wakeup(), Some(16 * MS), "the window's end");
        run_rows(
            &mut policy,
            &[
                // Back early (2 ms): counted as a mis-prediction, preempted as ever.
                (15, want(2), &[Revoke { client: 1 }, high_grant(2)]),
                (16, release(1, true), &[]),
                // Gaps 3 and 2: the shorter decides (10 % of two gaps is the smallest).
                (
                    20,
                    release(2, false),
                    &[fit_by(1, 22), grant(1, 20, 200, 1)],
                ),
                // Not back by 22: of its gaps only 3 ms is longer than 2, so until 23…
                (22, Event::Tick, &[fit_by(1, 23)]),
                // …and later than every gap: fresh windows of 2 ms from now.
                (23, Event::Tick, &[fit_by(1, 25)]),
                (24, Event::Tick, &[]),
                // Quiet for high_active_ms (500) after its release at 20: no window, no
                // bound (the slice that ended at 220 is extended at the same step).
                (520, Event::Tick, &[unbounded(1), grant(1, 520, 200, 0)]),
            ],
            true,
        );
        let snapshot = policy.snapshot();
        assert_eq!((snapshot.early_returns, snapshot.windows), (1, 4));
        assert_eq!(snapshot.high_gaps, vec![3 * MS, 2 * MS]);
    }

    #[test]
    fn a_waiter_whose_launch_fits_no_window_waits_for_one_or_for_the_high_job_to_go_quiet() {
        let mut policy = TokenPolicy::new(&SchedulerConfig::default());
        run_rows(&mut policy, &rhythm_rows(), false);
        run_rows(
            &mut policy,
            &[
                (13, want(1), &[fit_by(1, 16), grant(1, 13, 200, 1)]),
                // Its next launch measured 5 ms: it waits, released, and is not granted
                // a window of 2 ms it cannot use.
                (14, need(1, 5), &[]),
                (14, release(1, true), &[]),
            ],
            true,
        );
        assert_eq!(policy.snapshot().needs, vec![(1, 5 * MS)]);
        assert_eq!(
            policy.next_wakeup(),
            Some(16 * MS),
            "the window is looked at again"
        );
        run_rows(
            &mut policy,
            &[
                // Later than every gap: a fresh 3 ms window, still too short.
                (16, Event::Tick, &[]),
                (17, want(2), &[high_grant(2)]),
                (22, release(2, false), &[]),
            ],
            true,
        );
        assert_eq!(policy.next_wakeup(), Some(25 * MS));
        // The high job goes quiet (500 ms after 22): unbounded, granted at once.
        assert_eq!(
            policy.handle(522 * MS, Event::Tick),
            vec![unbounded(1), grant(1, 522, 200, 0)]
        );
        assert_eq!(
            policy.next_wakeup(),
            Some(722 * MS),
            "the slice's end only: no past instant for the timer to spin on"
        );
        assert!(policy.snapshot().needs.is_empty());
        // A need that fits is granted inside the window.
        let mut policy = TokenPolicy::new(&SchedulerConfig::default());
        run_rows(&mut policy, &rhythm_rows(), false);
        run_rows(
            &mut policy,
            &[
                (13, need(1, 2), &[]),
                (13, want(1), &[fit_by(1, 16), grant(1, 13, 200, 1)]),
            ],
            true,
        );
    }

    /// The high job's rhythm is known; low client 1 (lease 1) is granted a window at
    /// 13 and preempted at 15 by the high job, which then holds; client 1 does not
    /// release (a blind 400 ms kernel, or 25 kernels launched past the gate, drain).
    fn overrun_setup(config: &SchedulerConfig) -> TokenPolicy {
        let mut policy = TokenPolicy::new(config);
        run_rows(&mut policy, &rhythm_rows(), false);
        run_rows(
            &mut policy,
            &[
                (13, want(1), &[fit_by(1, 16), grant(1, 13, 200, 1)]),
                (15, want(2), &[Revoke { client: 1 }, high_grant(2)]),
            ],
            true,
        );
        policy
    }

    fn overrun(client: ClientId, lease: LeaseKey, from_ms: u64) -> Action {
        Overrun {
            client,
            lease,
            from_ns: from_ms * MS,
        }
    }

    /// A fresh process of lease 1 (client 3) wants at 601, after client 1 drained
    /// until 600 and exited; the high job releases at 605.
    fn fresh_process_of_the_same_lease() -> [(u64, Event, &'static [Action]); 4] {
        [
            (
                600,
                release(1, false),
                &[Recovered {
                    client: 1,
                    drained_ns: 585 * MS,
                }],
            ),
            (600, Event::Leave { client: 1 }, &[]),
            (
                600,
                Event::Join {
                    client: 3,
                    lease: 1,
                    priority: LOW,
                    request: 0.0,
                    limit: 1.0,
                },
                &[],
            ),
            (601, want(3), &[]),
        ]
    }

    /// Window 13..16, revoked at 15 for the high job: a release is judged against
    /// the window's end, plus the part of it the high job took back, plus
    /// `window_overrun_grace` (10 ms), on the arbiter's clock.
    #[test]
    fn a_release_past_its_window_beside_an_active_high_job_is_an_overrun_of_its_lease() {
        // (release at ms, overrun reported from ms): an honest drain ends inside its
        // window or within the grace after it; a blind 400 ms kernel, or one launched
        // into the window by a clock that called the window long, does not.
        // The high job took 1 ms of the window back (revoked at 15, not 16): that is
        // allowed once more, as the admitted work shares the GPU with it.
        let table: &[(u64, Option<u64>)] = &[
            (15, None),
            (16, None),
            (27, None),
            (28, Some(27)),
            (35, Some(27)),
            (413, Some(27)),
        ];
        // A process that exits with its drain (the connection closes) is judged alike.
        let ends = [release(1, false), Event::Leave { client: 1 }];
        for (&(release_ms, overrun_from), end) in table
            .iter()
            .flat_map(|row| ends.iter().map(move |end| (row, *end)))
        {
            let mut policy = overrun_setup(&SchedulerConfig::default());
            let actions = policy.handle(release_ms * MS, end);
            let want: Vec<Action> = overrun_from
                .map(|from| overrun(1, 1, from))
                .into_iter()
                .collect();
            assert_eq!(actions, want, "{end:?} at {release_ms} ms");
            let snapshot = policy.snapshot();
            assert_eq!(
                (snapshot.overruns, snapshot.penalized.len()),
                (
                    u64::from(overrun_from.is_some()),
                    usize::from(overrun_from.is_some())
                ),
                "released at {release_ms} ms"
            );
        }
    }

    #[test]
    fn a_late_release_is_not_judged_without_a_window_and_an_overdue_overrun_is_reported_once() {
        // No window on the page (the high job's rhythm was unknown): only the grace
        // judges, as before windows.
        let mut policy = TokenPolicy::new(&SchedulerConfig::default());
        run_rows(
            &mut policy,
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, want(1), &[grant(1, 0, 200, 0)]),
                (1, want(2), &[Revoke { client: 1 }, high_grant(2)]),
                (100, release(1, false), &[]),
            ],
            true,
        );
        assert_eq!(policy.snapshot().overruns, 0);
        // Past the grace and then released: reported when the grace ended, not again
        // at the release.
        let mut policy = overrun_setup(&SchedulerConfig::default());
        assert_eq!(
            policy.handle(515 * MS, Event::Tick),
            [Overdue { client: 1 }, overrun(1, 1, 515)]
        );
        assert_eq!(
            policy.handle(600 * MS, release(1, false)),
            [Recovered {
                client: 1,
                drained_ns: 585 * MS,
            }]
        );
        assert_eq!(policy.snapshot().overruns, 1);
    }

    #[test]
    fn a_drain_past_the_grace_beside_an_active_high_job_is_an_overrun_and_its_lease_waits_for_the_high_job_to_go_quiet(
    ) {
        let mut policy = overrun_setup(&SchedulerConfig::default());
        assert_eq!(policy.next_wakeup(), Some(515 * MS), "the grace's end");
        run_rows(
            &mut policy,
            &[(
                515,
                Event::Tick,
                &[Overdue { client: 1 }, overrun(1, 1, 515)],
            )],
            true,
        );
        let snapshot = policy.snapshot();
        assert_eq!((snapshot.overruns, snapshot.penalized), (1, vec![1]));
        run_rows(&mut policy, &fresh_process_of_the_same_lease(), true);
        run_rows(
            &mut policy,
            &[
                // The high job's gap: an honest lease would get a window now; this one
                // overran, and its new process inherits that.
                (605, release(2, false), &[]),
                (608, want(2), &[high_grant(2)]),
                (613, release(2, false), &[]),
            ],
            true,
        );
        assert_eq!(
            policy.next_wakeup(),
            Some(1113 * MS),
            "the high job goes quiet before the penalty ends"
        );
        run_rows(
            &mut policy,
            &[(1113, Event::Tick, &[grant(3, 1113, 200, 0)])],
            true,
        );
    }

    #[test]
    fn an_overrun_penalty_ends_and_without_one_an_overrun_is_only_reported() {
        let short = SchedulerConfig {
            overrun_penalty_ms: 100,
            ..SchedulerConfig::default()
        };
        let off = SchedulerConfig {
            overrun_penalty_ms: 0,
            ..SchedulerConfig::default()
        };
        for (config, granted_at_605) in [(short, false), (off, true)] {
            let mut policy = overrun_setup(&config);
            let actions = policy.handle(515 * MS, Event::Tick);
            assert_eq!(actions, [Overdue { client: 1 }, overrun(1, 1, 515)]);
            run_rows(&mut policy, &fresh_process_of_the_same_lease(), true);
            let granted =
                |actions: &[Action]| actions.iter().any(|a| matches!(a, Grant { client: 3, .. }));
            // A penalty of 100 ms from 515 still runs at 605; none lets it in at once.
            assert_eq!(
                granted(&policy.handle(605 * MS, release(2, false))),
                granted_at_605,
                "{config:?}"
            );
            assert_eq!(policy.snapshot().overruns, 1);
            if !granted_at_605 {
                assert_eq!(policy.next_wakeup(), Some(615 * MS), "the penalty's end");
                assert!(granted(&policy.handle(615 * MS, Event::Tick)));
                assert!(policy.snapshot().penalized.is_empty());
            }
        }
    }

    #[test]
    fn a_lease_found_bypassing_the_gate_waits_like_an_overrunning_one() {
        let mut policy = TokenPolicy::new(&SchedulerConfig::default());
        run_rows(&mut policy, &rhythm_rows(), false);
        // Unpenalised, client 1 (lease 1) gets the high job's gap at 13 (the test above).
        assert!(policy
            .handle(12 * MS, Event::Bypassed { lease: 1 })
            .is_empty());
        assert_eq!(policy.snapshot().penalized, [1]);
        let actions = policy.handle(13 * MS, want(1));
        assert!(
            !actions.iter().any(|a| matches!(a, Grant { client: 1, .. })),
            "{actions:?}"
        );
        // Once no high-priority job is active it is granted as ever.
        let quiet = policy
            .next_wakeup()
            .expect("a wake-up at the activity's end");
        let actions = policy.handle(quiet, Event::Tick);
        assert!(
            actions.iter().any(|a| matches!(a, Grant { client: 1, .. })),
            "{actions:?}"
        );
    }

    #[test]
    fn a_penalised_lease_waits_while_an_honest_one_gets_the_window() {
        let mut policy = overrun_setup(&SchedulerConfig::default());
        policy.handle(515 * MS, Event::Tick);
        run_rows(&mut policy, &fresh_process_of_the_same_lease(), true);
        // An honest lease's client wants too; it is granted the gap, client 3 is not.
        policy.handle(
            602 * MS,
            Event::Join {
                client: 4,
                lease: 4,
                priority: LOW,
                request: 0.0,
                limit: 1.0,
            },
        );
        policy.handle(602 * MS, want(4));
        let actions = policy.handle(605 * MS, release(2, false));
        let granted: Vec<ClientId> = actions
            .iter()
            .filter_map(|a| match a {
                Grant { client, .. } => Some(*client),
                _ => None,
            })
            .collect();
        assert_eq!(granted, [4], "{actions:?}");
    }

    #[test]
    fn without_duration_admission_no_window_is_ever_published() {
        let mut policy = TokenPolicy::new(&config());
        run_rows(&mut policy, &rhythm_rows(), false);
        run_rows(
            &mut policy,
            &[
                (13, need(1, 5), &[]),
                (13, want(1), &[grant(1, 13, 200, 1)]),
            ],
            true,
        );
        assert_eq!(policy.snapshot().windows, 0);
    }

    #[test]
    fn round_robin_is_fifo_with_a_fixed_slice_and_no_priority() {
        let config = SchedulerConfig {
            policy: SchedulingPolicy::RoundRobin,
            ..config()
        };
        run_table(
            config,
            &[
                (0, join(1, LOW), &[]),
                (0, join(2, HIGH), &[]),
                (0, join(3, LOW), &[]),
                (0, want(1), &[grant(1, 0, 20, 0)]),
                (1, want(3), &[]),
                // High waits like everyone: behind 3.
                (2, want(2), &[]),
                (20, Event::Tick, &[Revoke { client: 1 }]),
                (21, release(1, true), &[grant(3, 21, 20, 0)]),
                (22, release(3, false), &[grant(2, 22, 20, 0)]),
                (42, Event::Tick, &[Revoke { client: 2 }]),
                (43, release(2, true), &[grant(1, 43, 20, 0)]),
            ],
        );
    }

    #[test]
    fn request_zero_comes_after_clients_with_a_request() {
        let mut policy = TokenPolicy::new(&config());
        for (client, request) in [(1, 0.0), (2, 0.5), (3, 0.0)] {
            policy.handle(
                0,
                Event::Join {
                    client,
                    lease: client,
                    priority: LOW,
                    request,
                    limit: 1.0,
                },
            );
        }
        policy.handle(0, want(1));
        policy.handle(0, want(3));
        policy.handle(0, want(2));
        // 1 holds; at release, 2 (with a request) goes before 3 although 3 queued first.
        assert_eq!(
            policy.handle(MS, release(1, false)),
            vec![grant(2, 1, 20, 0)]
        );
    }

    #[test]
    fn a_slice_never_exceeds_the_remaining_limit_budget() {
        let mut policy = TokenPolicy::new(&config());
        policy.handle(
            0,
            Event::Join {
                client: 1,
                lease: 1,
                priority: LOW,
                request: 0.0,
                limit: 0.05,
            },
        );
        // A 5 % limit saves up at most two minimum slices (4 ms): far less than max_slice.
        assert_eq!(policy.handle(0, want(1)), vec![grant(1, 0, 4, 0)]);
        assert_eq!(
            policy.handle(4 * MS, Event::Tick),
            vec![Revoke { client: 1 }]
        );
        assert_eq!(policy.handle(5 * MS, release(1, true)), vec![]);
        // 5 ms spent (the drain until its release included) against 4 + 0.25 earned:
        // 0.75 ms in debt, so 2 ms of credit are back after (2 + 0.75) / 0.05 = 55 ms.
        let retry = policy.next_wakeup().unwrap();
        assert!((59_999_000..=60_001_000).contains(&retry), "{retry}");
        assert_eq!(policy.handle(retry - 100_000, Event::Tick), vec![]);
        assert_eq!(policy.handle(retry, Event::Tick), vec![grant(1, 60, 2, 0)]);
    }

    #[test]
    fn burst_history_shrinks_contended_slices_to_fit_short_bursts() {
        let mut policy = TokenPolicy::new(&config());
        for client in [1, 2] {
            policy.handle(0, join(client, LOW));
        }
        let mut now = 0;
        for _ in 0..8 {
            policy.handle(now, want(1));
            now += 2 * MS;
            policy.handle(now, release(1, false));
        }
        policy.handle(now, want(2));
        let actions = policy.handle(now, want(1));
        assert_eq!(actions, vec![]);
        // 2 has used more than 1 when it hands back; 1's estimate (~2 ms) sizes its
        // contended slice.
        policy.handle(now + 50 * MS, release(2, true));
        let holder = policy.holder.unwrap();
        assert_eq!(holder.client, 1);
        let slice = holder.revoke_at - holder.since;
        assert!((2 * MS..=4 * MS).contains(&slice), "slice {slice}");
    }

    /// A saturated run driven by the policy alone: every client always has work and
    /// releases the moment it is revoked. Returns GPU time per client.
    fn saturated_run(clients: &[(ClientId, f64, f64)], seconds: u64) -> BTreeMap<ClientId, u64> {
        let mut policy = TokenPolicy::new(&config());
        let mut held: BTreeMap<ClientId, u64> = BTreeMap::new();
        let mut since: BTreeMap<ClientId, u64> = BTreeMap::new();
        let mut pending = Vec::new();
        for &(client, request, limit) in clients {
            pending.extend(policy.handle(
                0,
                Event::Join {
                    client,
                    lease: client,
                    priority: LOW,
                    request,
                    limit,
                },
            ));
            pending.extend(policy.handle(0, want(client)));
        }
        let end = seconds * 1_000 * MS;
        let mut now = 0;
        loop {
            while let Some(action) = pending.pop() {
                match action {
                    Grant { client, .. } => {
                        since.entry(client).or_insert(now);
                    }
                    Revoke { client } => {
                        let start = since.remove(&client).expect("revoked while holding");
                        *held.entry(client).or_default() += now - start;
                        pending.extend(policy.handle(now, release(client, true)));
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            now = policy.next_wakeup().expect("someone always wants the GPU");
            if now >= end {
                break;
            }
            pending.extend(policy.handle(now, Event::Tick));
        }
        for (client, start) in since {
            *held.entry(client).or_default() += end - start;
        }
        held
    }

    #[test]
    fn requests_of_a_third_and_two_thirds_converge_to_one_to_two() {
        let held = saturated_run(&[(1, 0.3, 1.0), (2, 0.6, 1.0)], 30);
        let ratio = held[&2] as f64 / held[&1] as f64;
        assert!((ratio - 2.0).abs() <= 0.1, "ratio {ratio:.3} ({held:?})");
        let total: u64 = held.values().sum();
        assert!(total >= 29_900 * MS, "work-conserving: {total}");
    }

    #[test]
    fn a_lone_client_limited_to_half_gets_half() {
        let held = saturated_run(&[(1, 0.0, 0.5)], 30);
        let share = held[&1] as f64 / (30_000 * MS) as f64;
        assert!((share - 0.5).abs() <= 0.025, "share {share:.3}");
    }

    #[test]
    fn limits_cap_and_requests_split_among_several() {
        // Limits below the fair split: each is capped at its limit.
        let held = saturated_run(&[(1, 0.0, 0.2), (2, 0.0, 0.3)], 30);
        for (client, limit) in [(1, 0.2), (2, 0.3)] {
            let share = held[&client] as f64 / (30_000 * MS) as f64;
            assert!(
                (share - limit).abs() <= 0.05 * limit,
                "client {client}: {share:.3}"
            );
        }
    }
}
