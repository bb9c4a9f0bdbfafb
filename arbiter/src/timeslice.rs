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
//! * Suspension (memory reclaim: the lease's processes are about to be locked and
//!   checkpointed by the driver): a client of the lease that holds the token, or
//!   drains after a revocation, is revoked and no longer waited for in the same step —
//!   a locked process launches nothing, and its release may come only once it is
//!   restored. Its holding interval ends there, so the suspension costs it no usage
//!   and no credit; it is never overdue, never an overrun, never penalised for it, and
//!   a release it sends while suspended ends nothing more. No client of the lease is
//!   granted until it is resumed; their wants stay queued and are served by the
//!   ordinary rules after (a high-priority one at once). The suspension belongs to the
//!   lease: a client joining it meanwhile is suspended too.
//! * `round-robin` (a baseline): no priority, FIFO order of wanting, fixed `slice`,
//!   no launch-ahead bound, no limits.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use gpushare_config::{SchedulerConfig, SchedulingPolicy};
use gpushare_proto::token::{FIT_UNBOUNDED, HELD_UNTIL_RELEASED};
use gpushare_proto::Priority;

use crate::rhythm::{HighRhythm, Window};

mod client;
mod events;

use client::{Client, Holder};
pub use events::{Action, ClientId, Event, LeaseKey, PolicySnapshot};

const MS: u64 = 1_000_000;

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
    /// Leases whose processes are suspended (locked or checkpointed by the driver):
    /// none of their clients is granted. Only leases with a client here are kept.
    suspended: BTreeSet<LeaseKey>,
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
            suspended: BTreeSet::new(),
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
            .any(|(&id, c)| self.waits_for_window(id, c));
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
                .filter(|(&id, c)| self.waits_for_window(id, c))
                .map(|(&id, c)| (id, c.need_ns))
                .collect(),
            overruns: self.overruns,
            penalized: self.penalties.keys().copied().collect(),
            suspended: self.suspended.iter().copied().collect(),
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
            Event::Suspend { lease } => self.suspend(now, lease, &mut actions),
            Event::Resume { lease } => self.resume(now, lease, &mut actions),
            Event::Tick => {}
        }
        self.dispatch(now, &mut actions);
        actions
    }

    fn holds(&self, client: ClientId) -> bool {
        self.high_holders.contains(&client) || self.holder.is_some_and(|h| h.client == client)
    }

    fn is_suspended(&self, client: &Client) -> bool {
        self.suspended.contains(&client.lease)
    }

    /// A waiter whose next launch fits no window now (a suspended one waits for its
    /// resumption, not for a window).
    fn waits_for_window(&self, id: ClientId, client: &Client) -> bool {
        client.wanting && client.need_ns > 0 && !self.holds(id) && !self.is_suspended(client)
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
        if self.is_suspended(client) {
            // Remembered for its resumption; a locked process is no activity of the
            // high job's.
            self.queue(id);
            return;
        }
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
        self.queue(id);
    }

    /// `id` waits for the token, in the order of its first `Want` since it last held.
    fn queue(&mut self, id: ClientId) {
        let queued = self.next_queued;
        let Some(client) = self.clients.get_mut(&id) else {
            return;
        };
        if !client.wanting {
            client.wanting = true;
            client.queued = queued;
            self.next_queued += 1;
        }
    }

    /// Revokes every client of `lease` that holds or drains, without waiting for any,
    /// and grants none of them until `resume`.
    fn suspend(&mut self, now: u64, lease: LeaseKey, actions: &mut Vec<Action>) {
        let members: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.lease == lease)
            .map(|(&id, _)| id)
            .collect();
        // A lease with no client here has nothing to suspend; the I/O layer suspends
        // the clients that join it later.
        if members.is_empty() || !self.suspended.insert(lease) {
            return;
        }
        let window = self.settings.window;
        for id in members {
            let was_holder = self.holder.is_some_and(|h| h.client == id);
            if was_holder {
                self.holder = None;
            }
            let was_high_holder = self.high_holders.remove(&id);
            let client = self.clients.get_mut(&id).expect("listed above");
            // Its hold (or its drain after an earlier revocation) ends here: what the
            // GPU still finishes of it before the driver's lock is not worth a
            // penalty, and the time it is suspended is not GPU time it used.
            client.settle_credit(now);
            if let Some(since) = client.held_since.take() {
                client.history.push_back((since, now));
                client.forget_before(now.saturating_sub(window));
            }
            client.revoked_at = None;
            client.overdue = false;
            client.drain_overran = false;
            if was_high_holder {
                client.last_active = Some(now);
            }
            if was_holder || was_high_holder {
                self.revocations += 1;
                actions.push(Action::Revoke { client: id });
            }
            if was_high_holder && self.high_holders.is_empty() {
                self.rhythm.released(now);
                self.window = None;
            }
        }
    }

    fn resume(&mut self, now: u64, lease: LeaseKey, actions: &mut Vec<Action>) {
        if !self.suspended.remove(&lease) {
            return;
        }
        // High-priority waiters never wait: granted at once, as if they wanted now.
        // Low ones take their turn in the dispatch that follows.
        let high_waiters: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.lease == lease && c.wanting && self.is_preemptive(c))
            .map(|(&id, _)| id)
            .collect();
        for id in high_waiters {
            self.want(now, id, actions);
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
        if !self.suspended.contains(&client.lease) {
            client.last_active = Some(now);
        }
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
        if let Some(gone) = self.clients.remove(&id) {
            if !self.clients.values().any(|c| c.lease == gone.lease) {
                // Kept only while the lease has a client here (the I/O layer keeps the
                // lease's suspension for clients joining later).
                self.suspended.remove(&gone.lease);
            }
        }
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
                && !self.is_suspended(c)
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
                .filter(|c| !self.is_suspended(c))
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
            .filter(|(_, c)| !self.is_suspended(c))
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
mod tests;
