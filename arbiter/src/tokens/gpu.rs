//! One GPU's token: a scheduling step (the policy's actions applied to the clients'
//! pages and accounts), and what status, the timeline and the watchdog read of it.

use super::*;

impl GpuToken {
    pub(super) fn lock(&self) -> MutexGuard<'_, GpuState> {
        // The policy is updated in one call; a panic cannot leave it half-changed
        // in a way that is worse than stopping the GPU's token altogether.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The per-GPU key (account) of `lease` while it lives, if a client of it ever
    /// joined this GPU.
    pub(super) fn account_of(&self, lease: &LeaseId) -> Option<u64> {
        self.lock()
            .accounts
            .iter()
            .find(|(_, a)| &a.lease == lease && !a.closed)
            .map(|(&id, _)| id)
    }

    /// One policy step and its page changes. Wakes happen after the lock is dropped,
    /// so the woken client's first frame does not find the lock still held.
    pub(super) fn handle(&self, event: Event) {
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
                state.end_suspended_drain(client, now);
            }
            match event {
                Event::Suspend { lease } => state.suspend_holds(lease, now),
                // Before this step's grants, which start new holds.
                Event::Resume { lease } => state.resume_drains(lease, now),
                _ => {}
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

    pub(super) fn apply(
        &self,
        state: &mut GpuState,
        action: &Action,
        wakes: &mut Vec<Arc<PageMapping>>,
    ) {
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
    pub(super) fn run_timer(&self) {
        while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve_timer())).is_err()
        {
            self.restarts.failed(&self.gpu, "token-timer");
        }
    }

    pub(super) fn serve_timer(&self) {
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

    pub(super) fn status(&self, policy: SchedulingPolicy) -> TokenStatus {
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
            // Filled by the service, which sums the accounts into each lease's time.
            leases: Vec::new(),
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
    pub(super) fn record_fit(&self, client: ClientId, counts: FitCounts) {
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
