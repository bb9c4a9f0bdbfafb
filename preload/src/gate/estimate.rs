//! Duration-aware admission's client side: how long each kind of launch
//! occupies the GPU, learned from the launch-ahead ring's timing events, and the pure
//! decision whether a launch fits the admission window the arbiter published
//! (`TokenPage::fit_by_ns`: when the high-priority job is expected back).
//!
//! A launch is known by what it runs: the kernel's `CUfunction` or the graph's
//! `CUgraphExec` handle — never its name, and nothing the program has to tell. The
//! same kernel is usually launched with the same shapes over and over (a training or
//! decode step), so its last durations predict its next. A kind never seen takes the
//! longest duration seen of its sort (kernels, graphs) in this process; with nothing
//! seen at all it is admitted to be measured, and counted as such.
//!
//! Estimates lean long: a measurement longer than the estimate replaces it at once,
//! a shorter one pulls it down by a quarter of the difference — so a kernel that
//! slowed down (contention, a bigger batch) stops being admitted where it no longer
//! fits at its first slow run, and one that sped up earns its shorter estimate over a
//! few runs.
//!
//! An estimate not refreshed for [`REMEASURE_NS`] is treated as unknown: a kind held
//! back by one inflated measurement (its first run, or one stretched by the device
//! time-slicing it with the returning high job) would otherwise never run again while
//! the high job stays active, since only admitted launches are measured. So it runs
//! once more inside a window, at most every ten seconds, and is measured afresh.
//!
//! Only the launch-ahead path (a low-priority holder while a high-priority job is
//! active) reads or writes these: the unbounded hot path never touches them.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use gpushare_proto::token::FIT_UNBOUNDED;
use gpushare_proto::FitCounts;

use crate::cuda::Handle;

/// What a launch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    Kernel(Handle),
    Graph(Handle),
    /// A copy or memset, with its duration estimated from its bytes (never measured:
    /// its length follows its size, not its kind).
    Copy(u64),
}

impl What {
    /// A table key: the handle, with the top bit telling graphs from kernels (a
    /// handle is a pointer, whose top bit is clear in user space). Never 0 for a kernel or graph; 0 for a copy.
    pub fn key(self) -> u64 {
        match self {
            What::Kernel(f) => (f as u64 & !GRAPH_BIT).max(1),
            What::Graph(g) => (g as u64 & !GRAPH_BIT) | GRAPH_BIT,
            // Not a kind: its measurements teach nothing (`measured` ignores key 0).
            What::Copy(_) => 0,
        }
    }
}

const GRAPH_BIT: u64 = 1 << 63;
/// How long an estimate is trusted without a new measurement: long enough that a kind
/// that truly does not fit costs the high job one overrun per ten seconds at most (at
/// 2 s, the probes of 5–20 ms kernels showed in the simulated inference job's p99 over
/// a 3 s run: +22 % against +0.2 %), short enough that a stale estimate does not
/// starve its job for long.
pub const REMEASURE_NS: u64 = 10_000_000_000;
/// Kinds remembered: a training step launches tens to a few hundred distinct kernels;
/// a collision only costs a re-measurement.
const SLOTS: usize = 512;

/// What the gate does with a launch, given its estimate and the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Submit it. `unestimated`: nothing was known, it runs to be measured.
    Run { unestimated: bool },
    /// It fits once its stream's own queued work has run: wait for that, then decide
    /// again (not a hold: the window is not the obstacle).
    AfterQueue,
    /// Hold it until the window changes (the high job came and went, the arbiter moved
    /// the window, or it went quiet): it needs this much GPU time (0: unknown).
    Wait { need_ns: u64 },
}

/// The admission rule: a launch runs if the window is unbounded, or if it ends inside
/// the window starting when its stream's queue ends (`queued_until`); a launch nothing
/// is known about runs while the window is open, once its stream is idle.
pub fn admit(
    now_ns: u64,
    queued_until: u64,
    estimate_ns: Option<u64>,
    fit_by_ns: u64,
) -> Admission {
    if fit_by_ns == FIT_UNBOUNDED {
        return Admission::Run { unestimated: false };
    }
    let start = now_ns.max(queued_until);
    let fits_from = |t: u64, d: u64| t.saturating_add(d) <= fit_by_ns;
    match estimate_ns {
        Some(d) if fits_from(start, d) => Admission::Run { unestimated: false },
        Some(d) if fits_from(now_ns, d) => Admission::AfterQueue,
        Some(d) => Admission::Wait { need_ns: d },
        None if now_ns < fit_by_ns && start > now_ns => Admission::AfterQueue,
        None if now_ns < fit_by_ns => Admission::Run { unestimated: true },
        None => Admission::Wait { need_ns: 0 },
    }
}

/// The next estimate after measuring `measured_ns` (`None`: the first measurement).
pub fn learn(previous: Option<u64>, measured_ns: u64) -> u64 {
    match previous {
        Some(e) if measured_ns < e => e - (e - measured_ns) / 4,
        _ => measured_ns,
    }
}

/// Whether an admitted launch ran past its window, and by how much: it was expected to
/// start at `admitted_ns` (when it was submitted, or when the stream's queue ahead of it
/// was estimated to end), so it ended at about `admitted_ns + duration_ns` — as exact
/// as the estimate of the launch queued before it.
pub fn overrun(admitted_ns: u64, duration_ns: u64, fit_by_ns: u64) -> Option<u64> {
    if fit_by_ns == FIT_UNBOUNDED {
        return None;
    }
    let ended = admitted_ns.saturating_add(duration_ns);
    (ended > fit_by_ns).then(|| ended - fit_by_ns)
}

#[derive(Debug)]
struct Slot {
    key: AtomicU64,
    ns: AtomicU64,
    /// When it was last measured (or admitted to be measured again).
    at: AtomicU64,
}

/// The process's estimates and admission counts. Lock-free: two threads updating one
/// slot at once may lose one measurement, which the next replaces.
#[derive(Debug)]
pub struct Estimates {
    slots: [Slot; SLOTS],
    /// The longest recent duration of each sort, for kinds not seen yet (decays by
    /// 1/16 per measurement of that sort, so one outlier does not rule for ever).
    longest_kernel: AtomicU64,
    longest_graph: AtomicU64,
    longest_kernel_at: AtomicU64,
    longest_graph_at: AtomicU64,
    fitted: AtomicU64,
    unestimated: AtomicU64,
    held_back: AtomicU64,
    overran: AtomicU64,
    overran_ns: AtomicU64,
}

impl Default for Estimates {
    fn default() -> Self {
        Estimates::new()
    }
}

impl Estimates {
    pub const fn new() -> Estimates {
        Estimates {
            slots: [const {
                Slot {
                    key: AtomicU64::new(0),
                    ns: AtomicU64::new(0),
                    at: AtomicU64::new(0),
                }
            }; SLOTS],
            longest_kernel: AtomicU64::new(0),
            longest_graph: AtomicU64::new(0),
            longest_kernel_at: AtomicU64::new(0),
            longest_graph_at: AtomicU64::new(0),
            fitted: AtomicU64::new(0),
            unestimated: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
            overran: AtomicU64::new(0),
            overran_ns: AtomicU64::new(0),
        }
    }

    fn slot(&self, key: u64) -> &Slot {
        // Handles are aligned pointers: mix the bits so neighbours spread out.
        let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        &self.slots[h as usize % SLOTS]
    }

    /// The longest recent duration of `key`'s sort, and when it was last set.
    fn longest(&self, key: u64) -> (&AtomicU64, &AtomicU64) {
        if key & GRAPH_BIT != 0 {
            (&self.longest_graph, &self.longest_graph_at)
        } else {
            (&self.longest_kernel, &self.longest_kernel_at)
        }
    }

    /// This kind's own estimate and when it was measured, if it was.
    fn own(&self, key: u64) -> Option<(u64, u64)> {
        let slot = self.slot(key);
        let ns = slot.ns.load(Relaxed);
        (slot.key.load(Relaxed) == key && ns > 0).then(|| (ns, slot.at.load(Relaxed)))
    }

    /// How long a launch of `what` is expected to occupy the GPU, at `now_ns`: its
    /// kind's estimate, else its sort's longest; `None` when neither is known or the
    /// one that applies is older than [`REMEASURE_NS`].
    pub fn estimate(&self, what: What, now_ns: u64) -> Option<u64> {
        if let What::Copy(ns) = what {
            return Some(ns.max(1));
        }
        let key = what.key();
        let (ns, at) = self.own(key).or_else(|| {
            let (longest, at) = self.longest(key);
            let ns = longest.load(Relaxed);
            (ns > 0).then(|| (ns, at.load(Relaxed)))
        })?;
        (now_ns.saturating_sub(at) < REMEASURE_NS).then_some(ns)
    }

    /// A launch of `what` runs unestimated at `now_ns` to be measured: until its
    /// measurement arrives, the old figures count as fresh (no second one runs blind).
    pub fn probing(&self, what: What, now_ns: u64) {
        if let What::Copy(_) = what {
            return;
        }
        let key = what.key();
        let slot = self.slot(key);
        if slot.key.load(Relaxed) == key {
            slot.at.store(now_ns, Relaxed);
        } else {
            let (longest, at) = self.longest(key);
            if longest.load(Relaxed) > 0 {
                at.store(now_ns, Relaxed);
            }
        }
    }

    /// A launch of kind `key` was measured at `now`: it ran `duration_ns`, admitted at
    /// `admitted_ns` against the window `fit_by_ns`.
    pub fn measured(&self, key: u64, duration_ns: u64, admitted_ns: u64, fit_by_ns: u64, now: u64) {
        if key == 0 {
            return;
        }
        let next = learn(self.own(key).map(|(ns, _)| ns), duration_ns).max(1);
        let slot = self.slot(key);
        slot.ns.store(next, Relaxed);
        slot.at.store(now, Relaxed);
        slot.key.store(key, Relaxed);
        let (longest, at) = self.longest(key);
        let previous = longest.load(Relaxed);
        longest.store(duration_ns.max(previous - previous / 16), Relaxed);
        at.store(now, Relaxed);
        if let Some(past) = overrun(admitted_ns, duration_ns, fit_by_ns) {
            self.overran.fetch_add(1, Relaxed);
            self.overran_ns.fetch_add(past, Relaxed);
        }
    }

    pub fn count(&self, admission: Admission) {
        match admission {
            Admission::Run { unestimated } => {
                self.fitted.fetch_add(1, Relaxed);
                if unestimated {
                    self.unestimated.fetch_add(1, Relaxed);
                }
            }
            Admission::Wait { .. } => {
                self.held_back.fetch_add(1, Relaxed);
            }
            // Decided again once the stream's queue has run.
            Admission::AfterQueue => {}
        }
    }

    /// The counts so far (since the process started).
    pub fn counts(&self) -> FitCounts {
        FitCounts {
            fitted: self.fitted.load(Relaxed),
            unestimated: self.unestimated.load(Relaxed),
            held_back: self.held_back.load(Relaxed),
            overran: self.overran.load(Relaxed),
            overran_ns: self.overran_ns.load(Relaxed),
        }
    }
}

/// `now - base`, field by field: the counts since a connection opened.
pub fn since(now: FitCounts, base: FitCounts) -> FitCounts {
    FitCounts {
        fitted: now.fitted.saturating_sub(base.fitted),
        unestimated: now.unestimated.saturating_sub(base.unestimated),
        held_back: now.held_back.saturating_sub(base.held_back),
        overran: now.overran.saturating_sub(base.overran),
        overran_ns: now.overran_ns.saturating_sub(base.overran_ns),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;
    const NOW: u64 = 100 * MS;

    /// (what, stream's queue end, estimate, window end) → what the gate does.
    type Row = (&'static str, u64, Option<u64>, u64, Admission);

    #[test]
    fn the_admission_rule() {
        let run = Admission::Run { unestimated: false };
        let idle = 0;
        let table: &[Row] = &[
            ("no window", idle, Some(50 * MS), FIT_UNBOUNDED, run),
            ("no window, nothing known", idle, None, FIT_UNBOUNDED, run),
            (
                "100 µs in 3.3 ms",
                idle,
                Some(100 * US),
                NOW + 3_300 * US,
                run,
            ),
            (
                "ends exactly at the window's end",
                idle,
                Some(MS),
                NOW + MS,
                run,
            ),
            (
                "5 ms in 3.3 ms",
                idle,
                Some(5 * MS),
                NOW + 3_300 * US,
                Admission::Wait { need_ns: 5 * MS },
            ),
            (
                "1 ms with 0.5 ms left",
                idle,
                Some(MS),
                NOW + 500 * US,
                Admission::Wait { need_ns: MS },
            ),
            (
                "the window has closed",
                idle,
                Some(1),
                NOW,
                Admission::Wait { need_ns: 1 },
            ),
            (
                "1 ms behind 1 ms of queue in 3 ms: queued",
                NOW + MS,
                Some(MS),
                NOW + 3 * MS,
                run,
            ),
            (
                "1 ms behind 2.5 ms of queue in 3 ms: after the queue, not a hold",
                NOW + 2_500 * US,
                Some(MS),
                NOW + 3 * MS,
                Admission::AfterQueue,
            ),
            (
                "a queue already run counts for nothing",
                NOW - MS,
                Some(MS),
                NOW + MS,
                run,
            ),
            (
                "nothing known, window open, stream idle: run to measure it",
                idle,
                None,
                NOW + 1,
                Admission::Run { unestimated: true },
            ),
            (
                "nothing known behind a queue: after the queue",
                NOW + 10,
                None,
                NOW + MS,
                Admission::AfterQueue,
            ),
            (
                "nothing known, window closed",
                idle,
                None,
                NOW - 1,
                Admission::Wait { need_ns: 0 },
            ),
        ];
        for &(what, queued_until, estimate, fit_by, expected) in table {
            assert_eq!(
                admit(NOW, queued_until, estimate, fit_by),
                expected,
                "{what}"
            );
        }
    }

    #[test]
    fn estimates_rise_at_once_and_fall_by_quarters() {
        let table: &[(Option<u64>, u64, u64)] = &[
            (None, 700, 700),
            (Some(1_000), 5_000, 5_000),
            (Some(5_000), 1_000, 4_000),
            (Some(4_000), 1_000, 3_250),
            (Some(1_000), 1_000, 1_000),
        ];
        for &(previous, measured, expected) in table {
            assert_eq!(
                learn(previous, measured),
                expected,
                "{previous:?} {measured}"
            );
        }
    }

    #[test]
    fn overruns_are_measured_against_the_window() {
        assert_eq!(overrun(NOW, MS, NOW + 2 * MS), None);
        assert_eq!(overrun(NOW, 3 * MS, NOW + 2 * MS), Some(MS));
        assert_eq!(overrun(NOW, 3 * MS, FIT_UNBOUNDED), None);
    }

    /// A job whose kernel grows from 1 ms to 5 ms mid-run and shrinks back: held back
    /// from a 3.3 ms window at its first slow measurement (the slow launch that taught
    /// it is counted as overrunning), admitted again a few runs after it shrank.
    #[test]
    fn a_kernel_whose_length_changes_mid_run() {
        let e = Estimates::new();
        let kernel = What::Kernel(0x7f00_1000);
        let window = NOW + 3_300 * US;
        assert_eq!(e.estimate(kernel, NOW), None, "never seen");
        for _ in 0..3 {
            e.measured(kernel.key(), MS, NOW, window, NOW);
        }
        assert_eq!(
            admit(NOW, 0, e.estimate(kernel, NOW), window),
            Admission::Run { unestimated: false }
        );
        // It grows: the first 5 ms run overruns the window it was admitted into...
        e.measured(kernel.key(), 5 * MS, NOW, window, NOW);
        assert_eq!(e.counts().overran, 1);
        assert_eq!(e.counts().overran_ns, 5 * MS - 3_300 * US);
        // ...and from then on it waits.
        assert_eq!(
            admit(NOW, 0, e.estimate(kernel, NOW), window),
            Admission::Wait { need_ns: 5 * MS }
        );
        // It shrinks back to 1 ms (measured while the high job is away, or after a
        // window was granted that it fits): 5 → 4 → 3.25 ms, which fits again.
        e.measured(kernel.key(), MS, NOW, FIT_UNBOUNDED, NOW);
        assert_eq!(e.estimate(kernel, NOW), Some(4 * MS));
        e.measured(kernel.key(), MS, NOW, FIT_UNBOUNDED, NOW);
        assert_eq!(e.estimate(kernel, NOW), Some(3_250 * US));
        assert_eq!(
            admit(NOW, 0, e.estimate(kernel, NOW), window),
            Admission::Run { unestimated: false }
        );
        assert_eq!(e.counts().overran, 1, "unbounded runs never overrun");
    }

    #[test]
    fn unseen_kinds_take_the_longest_of_their_sort() {
        let e = Estimates::new();
        let (a, b) = (What::Kernel(0x1000), What::Kernel(0x2000));
        let graph = What::Graph(0x1000);
        assert_ne!(
            a.key(),
            graph.key(),
            "a graph and a kernel at one address differ"
        );
        e.measured(a.key(), 2 * MS, NOW, FIT_UNBOUNDED, NOW);
        assert_eq!(e.estimate(b, NOW), Some(2 * MS), "the longest kernel");
        assert_eq!(e.estimate(graph, NOW), None, "no graph measured yet");
        e.measured(graph.key(), 50 * MS, NOW, FIT_UNBOUNDED, NOW);
        assert_eq!(e.estimate(What::Graph(0x9000), NOW), Some(50 * MS));
        assert_eq!(
            e.estimate(b, NOW),
            Some(2 * MS),
            "graphs do not inflate kernels"
        );
        // The longest decays with later, shorter measurements of its sort.
        for _ in 0..16 {
            e.measured(a.key(), 100 * US, NOW, FIT_UNBOUNDED, NOW);
        }
        assert!(e.estimate(b, NOW).unwrap() < 2 * MS);
    }

    #[test]
    fn counts_since_a_connection_opened() {
        let e = Estimates::new();
        e.count(Admission::Run { unestimated: true });
        let base = e.counts();
        e.count(Admission::Run { unestimated: false });
        e.count(Admission::Wait { need_ns: 3 });
        let c = since(e.counts(), base);
        assert_eq!((c.fitted, c.unestimated, c.held_back), (1, 0, 1));
    }

    /// A kind held back for ten seconds without a measurement runs once more to be
    /// measured afresh (one inflated measurement cannot hold it back for good), and only
    /// once until that measurement arrives.
    #[test]
    fn a_stale_estimate_is_measured_again() {
        let e = Estimates::new();
        let kernel = What::Kernel(0x3000);
        let window = NOW + 3 * MS;
        e.measured(kernel.key(), 8 * MS, NOW, window, NOW);
        assert_eq!(e.estimate(kernel, NOW + REMEASURE_NS - 1), Some(8 * MS));
        let later = NOW + REMEASURE_NS;
        assert_eq!(e.estimate(kernel, later), None, "stale");
        assert_eq!(
            admit(later, 0, e.estimate(kernel, later), later + 3 * MS),
            Admission::Run { unestimated: true }
        );
        e.probing(kernel, later);
        assert_eq!(
            e.estimate(kernel, later + 1),
            Some(8 * MS),
            "one probe at a time"
        );
        // It measured 2 ms this time (the 8 ms was stretched by contention).
        e.measured(kernel.key(), 2 * MS, later, later + 3 * MS, later + 2 * MS);
        assert_eq!(e.estimate(kernel, later + 2 * MS), Some(6_500 * US));
    }
}
