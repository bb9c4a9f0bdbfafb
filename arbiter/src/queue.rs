//! The admission queue (Sun et al.): a request that fits nowhere waits instead
//! of failing, ordered by priority, then arrival, for a bounded time.
//!
//! Pure bookkeeping: the caller supplies the clock and a placement attempt.
//! The one ordering promise beyond the sort: a waiting high-priority request is
//! never overtaken by a later low-priority one, even when the later one would fit.

use std::time::{Duration, Instant};

use gpushare_proto::Priority;

#[derive(Debug)]
pub struct Waiting<T> {
    pub seq: u64,
    pub priority: Priority,
    pub arrived: Instant,
    pub deadline: Instant,
    pub item: T,
}

/// What one admission attempt made of a waiting request.
#[derive(Debug, PartialEq, Eq)]
pub enum Attempt<R, E> {
    /// Placed: leaves the queue with this result.
    Admitted(R),
    /// Still no room: stays.
    Wait,
    /// Can never be placed: leaves the queue with this error.
    Failed(E),
}

#[derive(Debug)]
pub struct AdmissionQueue<T> {
    /// Always sorted: high priority first, then by arrival (seq).
    waiting: Vec<Waiting<T>>,
    next_seq: u64,
}

impl<T> Default for AdmissionQueue<T> {
    fn default() -> Self {
        AdmissionQueue {
            waiting: Vec::new(),
            next_seq: 0,
        }
    }
}

fn order_key<T>(w: &Waiting<T>) -> (std::cmp::Reverse<Priority>, u64) {
    (std::cmp::Reverse(w.priority), w.seq)
}

impl<T> AdmissionQueue<T> {
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Adds a request that may wait up to `bound`; returns its ticket.
    pub fn push(&mut self, priority: Priority, now: Instant, bound: Duration, item: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Waiting {
            seq,
            priority,
            arrived: now,
            deadline: now + bound,
            item,
        };
        let at = self
            .waiting
            .partition_point(|w| order_key(w) < order_key(&entry));
        self.waiting.insert(at, entry);
        seq
    }

    /// In admission order.
    pub fn iter(&self) -> impl Iterator<Item = &Waiting<T>> {
        self.waiting.iter()
    }

    pub fn remove(&mut self, seq: u64) -> Option<Waiting<T>> {
        let at = self.waiting.iter().position(|w| w.seq == seq)?;
        Some(self.waiting.remove(at))
    }

    /// Removes and returns the requests whose bound has passed.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Waiting<T>> {
        let (expired, kept) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| w.deadline <= now);
        self.waiting = kept;
        expired
    }

    /// Tries the waiting requests in order; `attempt` places one (and commits it,
    /// so later attempts see the room it took). Returns those that left the queue.
    ///
    /// A high-priority request that must keep waiting blocks every low-priority
    /// request that arrived after it; requests of its own priority may still be
    /// admitted around it (they may want other GPUs: an `index:` request waiting
    /// for one GPU must not hold up the whole node).
    pub fn admit<R, E>(
        &mut self,
        mut attempt: impl FnMut(&T) -> Attempt<R, E>,
    ) -> Vec<(Waiting<T>, Result<R, E>)> {
        let mut left = Vec::new();
        let mut first_blocked_high: Option<u64> = None;
        let mut kept = Vec::with_capacity(self.waiting.len());
        for w in std::mem::take(&mut self.waiting) {
            let overtakes_high = w.priority == Priority::Low
                && first_blocked_high.is_some_and(|high_seq| w.seq > high_seq);
            if overtakes_high {
                kept.push(w);
                continue;
            }
            match attempt(&w.item) {
                Attempt::Admitted(r) => left.push((w, Ok(r))),
                Attempt::Failed(e) => left.push((w, Err(e))),
                Attempt::Wait => {
                    if w.priority == Priority::High && first_blocked_high.is_none() {
                        first_blocked_high = Some(w.seq);
                    }
                    kept.push(w);
                }
            }
        }
        self.waiting = kept;
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Priority::{High, Low};

    const BOUND: Duration = Duration::from_secs(30);

    fn names(q: &AdmissionQueue<&'static str>) -> Vec<&'static str> {
        q.iter().map(|w| w.item).collect()
    }

    #[test]
    fn ordered_by_priority_then_arrival() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(Low, t, BOUND, "low1");
        q.push(High, t, BOUND, "high1");
        q.push(Low, t, BOUND, "low2");
        q.push(High, t, BOUND, "high2");
        assert_eq!(names(&q), ["high1", "high2", "low1", "low2"]);
    }

    #[test]
    fn admission_places_in_order_and_each_sees_the_room_the_previous_took() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(Low, t, BOUND, "low");
        q.push(High, t, BOUND, "high");
        let mut room = 1;
        let mut tried = Vec::new();
        let left = q.admit(|name: &&str| {
            tried.push(*name);
            if room > 0 {
                room -= 1;
                Attempt::<(), ()>::Admitted(())
            } else {
                Attempt::Wait
            }
        });
        assert_eq!(tried, ["high", "low"]);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].0.item, "high");
        assert_eq!(names(&q), ["low"]);
    }

    #[test]
    fn a_waiting_high_request_is_never_overtaken_by_a_later_low_one() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(Low, t, BOUND, "early-low");
        q.push(High, t, BOUND, "big-high");
        q.push(Low, t, BOUND, "late-low");
        // Only the high request lacks room; both lows would fit.
        let left = q.admit(|name: &&str| {
            if *name == "big-high" {
                Attempt::<(), ()>::Wait
            } else {
                Attempt::Admitted(())
            }
        });
        let admitted: Vec<_> = left.iter().map(|(w, _)| w.item).collect();
        assert_eq!(admitted, ["early-low"], "the low that arrived first may go");
        assert_eq!(names(&q), ["big-high", "late-low"]);
    }

    #[test]
    fn same_priority_requests_may_go_around_a_blocked_one() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(High, t, BOUND, "index0");
        q.push(High, t, BOUND, "count1");
        let left = q.admit(|name: &&str| {
            if *name == "index0" {
                Attempt::<(), ()>::Wait
            } else {
                Attempt::Admitted(())
            }
        });
        assert_eq!(left.len(), 1);
        assert_eq!(names(&q), ["index0"]);
    }

    #[test]
    fn failures_leave_the_queue_with_their_error() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(Low, t, BOUND, "bad");
        let left = q.admit(|_: &&str| Attempt::<(), &str>::Failed("no such GPU"));
        assert_eq!(left[0].1, Err("no such GPU"));
        assert!(q.is_empty());
    }

    #[test]
    fn expiry_removes_only_requests_past_their_bound() {
        let t = Instant::now();
        let mut q = AdmissionQueue::default();
        q.push(Low, t, Duration::from_secs(1), "short");
        q.push(Low, t, Duration::from_secs(60), "long");
        assert!(q.take_expired(t + Duration::from_millis(999)).is_empty());
        let expired = q.take_expired(t + Duration::from_secs(1));
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].item, "short");
        assert_eq!(names(&q), ["long"]);
        assert!(q.remove(99).is_none());
        let seq = q.iter().next().unwrap().seq;
        assert_eq!(q.remove(seq).unwrap().item, "long");
    }
}
