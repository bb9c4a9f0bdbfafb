//! Who held a GPU's token: the pure bookkeeping behind the token service's per-lease
//! token time (how long a lease held the GPU's time-slice token; its kernels run only
//! then, so it bounds the lease's GPU time), its recent shares, and the timeline of holds. No clock and no I/O here:
//! every function takes `now` (CLOCK_MONOTONIC ns, the token service's clock).
//!
//! Both structures are sized once and never grow on the token's hot path: a hold that
//! ends adds to a fixed ring of buckets and pushes one `Copy` entry into a ring
//! allocated up front, so recording it costs no allocation.

use std::collections::VecDeque;

/// Width of one bucket of [`HeldWindow`]. 100 ms keeps the error of the 10 s share
/// (the oldest bucket is weighted by how much of it falls in the window, assuming its
/// time was spread evenly) within 1 % of the window.
pub const BUCKET_NS: u64 = 100_000_000;
/// Buckets kept: one minute, the longest window asked for.
pub const BUCKETS: usize = 600;
/// The longest window [`HeldWindow::held_in_last`] can answer.
pub const LONGEST_WINDOW_NS: u64 = BUCKET_NS * BUCKETS as u64;

/// Token-held time over the last minute, in fixed buckets.
#[derive(Debug, Clone)]
pub struct HeldWindow {
    buckets: Box<[u64; BUCKETS]>,
    /// Absolute number (`ns / BUCKET_NS`) of the newest bucket written.
    newest: u64,
}

impl Default for HeldWindow {
    fn default() -> Self {
        HeldWindow {
            buckets: Box::new([0; BUCKETS]),
            newest: 0,
        }
    }
}

impl HeldWindow {
    /// Records that the token was held from `start_ns` to `end_ns`. Time older than
    /// the newest bucket's minute is dropped: no window can ask for it.
    pub fn add(&mut self, start_ns: u64, end_ns: u64) {
        if end_ns <= start_ns {
            return;
        }
        let last = (end_ns - 1) / BUCKET_NS;
        if last > self.newest {
            // Buckets between the newest and this one are a minute old, or held nothing.
            let stale = (last - self.newest).min(BUCKETS as u64);
            for b in (last + 1 - stale)..=last {
                self.buckets[(b % BUCKETS as u64) as usize] = 0;
            }
            self.newest = last;
        }
        let oldest_kept = self.newest.saturating_sub(BUCKETS as u64 - 1);
        let first = (start_ns / BUCKET_NS).max(oldest_kept);
        for b in first..=last {
            let from = start_ns.max(b * BUCKET_NS);
            let to = end_ns.min((b + 1) * BUCKET_NS);
            if to > from {
                self.buckets[(b % BUCKETS as u64) as usize] += to - from;
            }
        }
    }

    /// Time held within the `window_ns` before `now_ns` (at most [`LONGEST_WINDOW_NS`]),
    /// counting a hold still going since `open_since`.
    pub fn held_in_last(&self, now_ns: u64, window_ns: u64, open_since: Option<u64>) -> u64 {
        let window_ns = window_ns.min(LONGEST_WINDOW_NS);
        let start = now_ns.saturating_sub(window_ns);
        let oldest_kept = self.newest.saturating_sub(BUCKETS as u64 - 1);
        let mut held = 0.0_f64;
        let first = (start / BUCKET_NS).max(oldest_kept);
        let last = self.newest.min(now_ns / BUCKET_NS);
        if first <= last {
            for b in first..=last {
                let value = self.buckets[(b % BUCKETS as u64) as usize] as f64;
                // The bucket's time so far, and its part inside the window: only the
                // oldest bucket can be partly outside, and counts in proportion.
                let bucket_start = b * BUCKET_NS;
                let bucket_end = (bucket_start + BUCKET_NS).min(now_ns);
                let span = bucket_end.saturating_sub(bucket_start);
                let inside = bucket_end.saturating_sub(start.max(bucket_start));
                if span == 0 {
                    continue;
                }
                held += value * inside as f64 / BUCKET_NS as f64;
            }
        }
        let open = open_since.map_or(0, |since| now_ns.saturating_sub(since.max(start)));
        held.round() as u64 + open
    }
}

/// Holds closer than this to the same lease's previous one extend it rather than
/// start an entry: a release answered at once by a grant (`again`) is one hold to a
/// person reading the timeline, and merging keeps the ring's minutes long.
pub const MERGE_GAP_NS: u64 = 2_000_000;

/// One hold of a GPU's token by one lease's client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// Which lease account (the token service's numbering) held it.
    pub account: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// The most recent holds of one GPU's token: at most `capacity` entries and none
/// that ended more than `keep_ns` ago.
#[derive(Debug)]
pub struct HoldRing {
    holds: VecDeque<Hold>,
    capacity: usize,
    keep_ns: u64,
}

impl HoldRing {
    pub fn new(capacity: usize, keep_ns: u64) -> HoldRing {
        HoldRing {
            holds: VecDeque::with_capacity(capacity),
            capacity: capacity.max(1),
            keep_ns,
        }
    }

    pub fn push(&mut self, hold: Hold) {
        if hold.end_ns <= hold.start_ns {
            return;
        }
        while self
            .holds
            .front()
            .is_some_and(|h| h.end_ns.saturating_add(self.keep_ns) < hold.end_ns)
        {
            self.holds.pop_front();
        }
        if let Some(last) = self.holds.back_mut() {
            if last.account == hold.account
                && hold.start_ns >= last.end_ns
                && hold.start_ns - last.end_ns <= MERGE_GAP_NS
            {
                last.end_ns = hold.end_ns;
                return;
            }
        }
        if self.holds.len() == self.capacity {
            self.holds.pop_front();
        }
        self.holds.push_back(hold);
    }

    /// Oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Hold> {
        self.holds.iter()
    }

    pub fn references(&self, account: u64) -> bool {
        self.holds.iter().any(|h| h.account == account)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;

    #[test]
    fn held_time_in_a_window_counts_what_fell_inside_it() {
        // (holds, open since, now, window, expected held)
        /// Closed holds, a hold open since, now, the window, and what it held.
        type Case = (&'static [(u64, u64)], Option<u64>, u64, u64, u64);
        let cases: &[Case] = &[
            (&[], None, 100 * S, 10 * S, 0),
            // Wholly inside both windows.
            (&[(95 * S, 97 * S)], None, 100 * S, 10 * S, 2 * S),
            (&[(95 * S, 97 * S)], None, 100 * S, 60 * S, 2 * S),
            // Straddling the 10 s window's start: only its part inside.
            (&[(88 * S, 92 * S)], None, 100 * S, 10 * S, 2 * S),
            // Older than the window.
            (&[(50 * S, 60 * S)], None, 100 * S, 10 * S, 0),
            (&[(50 * S, 60 * S)], None, 100 * S, 60 * S, 10 * S),
            // Older than a minute: dropped.
            (&[(10 * S, 20 * S)], None, 100 * S, 60 * S, 0),
            // A hold still going counts up to now, clipped to the window.
            (&[], Some(85 * S), 100 * S, 10 * S, 10 * S),
            (&[(91 * S, 92 * S)], Some(99 * S), 100 * S, 10 * S, 2 * S),
            // A window asked for longer than kept is answered over a minute.
            (&[(30 * S, 100 * S)], None, 100 * S, 120 * S, 60 * S),
        ];
        for (i, (holds, open, now, window, want)) in cases.iter().enumerate() {
            let mut w = HeldWindow::default();
            for &(a, b) in *holds {
                w.add(a, b);
            }
            let got = w.held_in_last(*now, *window, *open);
            let tolerance = window / 100;
            assert!(
                got.abs_diff(*want) <= tolerance,
                "case {i}: held {got} ns, want {want} ± {tolerance}"
            );
        }
        // Many short holds, as a time-sliced GPU sees them: 5 ms of every 10 ms.
        let mut w = HeldWindow::default();
        let mut t = 40 * S;
        while t < 100 * S {
            w.add(t, t + 5 * MS);
            t += 10 * MS;
        }
        for window in [10 * S, 60 * S] {
            let got = w.held_in_last(100 * S, window, None) as f64 / window as f64;
            assert!((got - 0.5).abs() < 0.01, "share over {window} ns: {got}");
        }
    }

    #[test]
    fn a_window_forgets_what_a_minute_of_silence_pushed_out() {
        let mut w = HeldWindow::default();
        w.add(S, 2 * S);
        // Far later: every bucket of the old minute is stale.
        w.add(500 * S, 501 * S);
        assert_eq!(w.held_in_last(501 * S, 60 * S, None), S);
        // Out of order (a concurrent holder's release seen late) still counts.
        w.add(499 * S, 500 * S);
        assert_eq!(w.held_in_last(501 * S, 60 * S, None), 2 * S);
    }

    #[test]
    fn the_ring_merges_back_to_back_holds_and_drops_the_oldest() {
        let hold = |account, start_ns, end_ns| Hold {
            account,
            start_ns,
            end_ns,
        };
        let mut ring = HoldRing::new(3, 600 * S);
        ring.push(hold(1, 0, 10 * MS));
        ring.push(hold(1, 11 * MS, 20 * MS)); // 1 ms later: the same hold
        ring.push(hold(2, 20 * MS, 30 * MS));
        ring.push(hold(1, 40 * MS, 50 * MS)); // another lease came between
        ring.push(hold(1, 60 * MS, 70 * MS)); // 10 ms later: a new hold
        let kept: Vec<Hold> = ring.iter().copied().collect();
        assert_eq!(
            kept,
            [
                hold(2, 20 * MS, 30 * MS),
                hold(1, 40 * MS, 50 * MS),
                hold(1, 60 * MS, 70 * MS)
            ]
        );
        assert!(ring.references(2) && !ring.references(3));
        // Entries that ended longer than keep_ns ago go when a new one comes.
        let mut ring = HoldRing::new(100, 10 * S);
        ring.push(hold(1, 0, S));
        ring.push(hold(2, 20 * S, 21 * S));
        assert_eq!(ring.iter().count(), 1);
        // An empty or backwards hold is nothing.
        ring.push(hold(3, 5 * S, 5 * S));
        assert!(!ring.references(3));
    }
}
