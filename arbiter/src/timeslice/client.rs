//! What the policy keeps of each client — its class, its request and limit, its usage
//! over the window and its credit, where it stands with the token — and of the holder.

use super::*;

#[derive(Debug)]
pub(super) struct Client {
    pub(super) lease: LeaseKey,
    pub(super) priority: Priority,
    pub(super) request: f64,
    pub(super) limit: f64,
    pub(super) wanting: bool,
    /// Order of the latest `Want` (FIFO under round-robin, tie-break otherwise).
    pub(super) queued: u64,
    /// Closed holding intervals still (partly) inside the window, oldest first.
    pub(super) history: VecDeque<(u64, u64)>,
    /// Start of the open holding interval (holding, or revoked and draining).
    pub(super) held_since: Option<u64>,
    pub(super) revoked_at: Option<u64>,
    /// Revoked, past the grace period and not released yet: no longer waited for.
    pub(super) overdue: bool,
    /// This drain was already reported as an overrun (once per revocation).
    pub(super) drain_overran: bool,
    /// The latest `Want` or `Release` (high priority: what makes it active).
    pub(super) last_active: Option<u64>,
    /// Moving average of the bursts that ended with a release (ns).
    pub(super) burst: f64,
    /// GPU time earned and not yet spent (ns) as of `credit_at`, outside any open
    /// holding interval; negative after a drain that overran the credit.
    pub(super) credit: f64,
    pub(super) credit_at: u64,
    /// The most credit a client can save up: its burst allowance.
    pub(super) credit_cap: f64,
    /// What its waiting launch needs to fit a window (0: unknown or none).
    pub(super) need_ns: u64,
    /// The admission window on its page now.
    pub(super) page_fit_by: u64,
}

impl Client {
    pub(super) fn usage(&self, now: u64, window: u64) -> u64 {
        let from = now.saturating_sub(window);
        let overlap = |start: u64, end: u64| end.min(now).saturating_sub(start.max(from));
        let closed: u64 = self.history.iter().map(|&(s, e)| overlap(s, e)).sum();
        closed + self.held_since.map_or(0, |s| overlap(s, now))
    }

    /// Earned GPU time at `t`, the open holding interval spent from it. A bucket: it
    /// fills at `limit` up to the cap and, while held, drains at `1 − limit`.
    pub(super) fn credit_at(&self, t: u64) -> f64 {
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
    pub(super) fn budget(&self, now: u64) -> Option<u64> {
        if self.limit >= 1.0 {
            return None;
        }
        Some(self.credit_at(now).max(0.0) as u64)
    }

    /// Closes the open holding interval at `now` against the credit.
    pub(super) fn settle_credit(&mut self, now: u64) {
        self.credit = self.credit_at(now);
        self.credit_at = now;
    }

    pub(super) fn forget_before(&mut self, from: u64) {
        while self.history.front().is_some_and(|&(_, end)| end <= from) {
            self.history.pop_front();
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Holder {
    pub(super) client: ClientId,
    pub(super) since: u64,
    pub(super) revoke_at: u64,
    /// The launch-ahead bound on its page now.
    pub(super) launch_ahead: u32,
}
