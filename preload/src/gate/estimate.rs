//! Duration-aware admission's client side (issue 14): how long each kind of launch
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
}

impl What {
    /// A table key: the handle, with the top bit telling graphs from kernels (a
    /// handle is a pointer, whose top bit is clear in user space). Never 0.
    pub fn key(self) -> u64 {
        match self {
            What::Kernel(f) => (f as u64 & !GRAPH_BIT).max(1),
            What::Graph(g) => (g as u64 & !GRAPH_BIT) | GRAPH_BIT,
        }
    }
}

const GRAPH_BIT: u64 = 1 << 63;
/// Kinds remembered: a training step launches tens to a few hundred distinct kernels;
/// a collision only costs a re-measurement.
const SLOTS: usize = 512;

/// What the gate does with a launch, given its estimate and the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Submit it. `unestimated`: nothing was known, it runs to be measured.
    Run { unestimated: bool },
    /// Hold it until the window changes (the high job came and went, the arbiter moved
    /// the window, or it went quiet): it needs this much GPU time (0: unknown).
    Wait { need_ns: u64 },
}

/// The admission rule: a launch runs if the window is unbounded, or its estimate ends
/// inside the window; a launch nothing is known about runs while the window is open.
pub fn admit(now_ns: u64, estimate_ns: Option<u64>, fit_by_ns: u64) -> Admission {
    if fit_by_ns == FIT_UNBOUNDED {
        return Admission::Run { unestimated: false };
    }
    match estimate_ns {
        Some(d) if now_ns.saturating_add(d) <= fit_by_ns => Admission::Run { unestimated: false },
        Some(d) => Admission::Wait { need_ns: d },
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

/// Whether an admitted launch ran past its window, and by how much: it was submitted
/// at `admitted_ns` to an empty stream (the launch-ahead bound of 1 waited for the one
/// before), so it ended at about `admitted_ns + duration_ns`.
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
                }
            }; SLOTS],
            longest_kernel: AtomicU64::new(0),
            longest_graph: AtomicU64::new(0),
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

    fn longest(&self, key: u64) -> &AtomicU64 {
        if key & GRAPH_BIT != 0 {
            &self.longest_graph
        } else {
            &self.longest_kernel
        }
    }

    /// This kind's own estimate, if it was measured.
    fn own(&self, key: u64) -> Option<u64> {
        let slot = self.slot(key);
        let ns = slot.ns.load(Relaxed);
        (slot.key.load(Relaxed) == key && ns > 0).then_some(ns)
    }

    /// How long a launch of `what` is expected to occupy the GPU.
    pub fn estimate(&self, what: What) -> Option<u64> {
        let key = what.key();
        self.own(key).or_else(|| {
            let longest = self.longest(key).load(Relaxed);
            (longest > 0).then_some(longest)
        })
    }

    /// A launch of kind `key` was measured: it ran `duration_ns`, admitted at
    /// `admitted_ns` against the window `fit_by_ns`.
    pub fn measured(&self, key: u64, duration_ns: u64, admitted_ns: u64, fit_by_ns: u64) {
        if key == 0 {
            return;
        }
        let next = learn(self.own(key), duration_ns).max(1);
        let slot = self.slot(key);
        slot.ns.store(next, Relaxed);
        slot.key.store(key, Relaxed);
        let longest = self.longest(key);
        let previous = longest.load(Relaxed);
        longest.store(duration_ns.max(previous - previous / 16), Relaxed);
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

    /// (estimate, window end) → what the gate does with the launch.
    #[test]
    fn the_admission_rule() {
        let run = Admission::Run { unestimated: false };
        let table: &[(&str, Option<u64>, u64, Admission)] = &[
            ("no window", Some(50 * MS), FIT_UNBOUNDED, run),
            ("no window, nothing known", None, FIT_UNBOUNDED, run),
            ("100 µs in 3.3 ms", Some(100 * US), NOW + 3_300 * US, run),
            ("ends exactly at the window's end", Some(MS), NOW + MS, run),
            (
                "5 ms in 3.3 ms",
                Some(5 * MS),
                NOW + 3_300 * US,
                Admission::Wait { need_ns: 5 * MS },
            ),
            (
                "1 ms with 0.5 ms left",
                Some(MS),
                NOW + 500 * US,
                Admission::Wait { need_ns: MS },
            ),
            (
                "the window has closed",
                Some(1),
                NOW,
                Admission::Wait { need_ns: 1 },
            ),
            (
                "nothing known, window open: run to measure it",
                None,
                NOW + 1,
                Admission::Run { unestimated: true },
            ),
            (
                "nothing known, window closed",
                None,
                NOW - 1,
                Admission::Wait { need_ns: 0 },
            ),
        ];
        for &(what, estimate, fit_by, expected) in table {
            assert_eq!(admit(NOW, estimate, fit_by), expected, "{what}");
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
        assert_eq!(e.estimate(kernel), None, "never seen");
        for _ in 0..3 {
            e.measured(kernel.key(), MS, NOW, window);
        }
        assert_eq!(
            admit(NOW, e.estimate(kernel), window),
            Admission::Run { unestimated: false }
        );
        // It grows: the first 5 ms run overruns the window it was admitted into...
        e.measured(kernel.key(), 5 * MS, NOW, window);
        assert_eq!(e.counts().overran, 1);
        assert_eq!(e.counts().overran_ns, 5 * MS - 3_300 * US);
        // ...and from then on it waits.
        assert_eq!(
            admit(NOW, e.estimate(kernel), window),
            Admission::Wait { need_ns: 5 * MS }
        );
        // It shrinks back to 1 ms (measured while the high job is away, or after a
        // window was granted that it fits): 5 → 4 → 3.25 ms, which fits again.
        e.measured(kernel.key(), MS, NOW, FIT_UNBOUNDED);
        assert_eq!(e.estimate(kernel), Some(4 * MS));
        e.measured(kernel.key(), MS, NOW, FIT_UNBOUNDED);
        assert_eq!(e.estimate(kernel), Some(3_250 * US));
        assert_eq!(
            admit(NOW, e.estimate(kernel), window),
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
        e.measured(a.key(), 2 * MS, NOW, FIT_UNBOUNDED);
        assert_eq!(e.estimate(b), Some(2 * MS), "the longest kernel");
        assert_eq!(e.estimate(graph), None, "no graph measured yet");
        e.measured(graph.key(), 50 * MS, NOW, FIT_UNBOUNDED);
        assert_eq!(e.estimate(What::Graph(0x9000)), Some(50 * MS));
        assert_eq!(e.estimate(b), Some(2 * MS), "graphs do not inflate kernels");
        // The longest decays with later, shorter measurements of its sort.
        for _ in 0..16 {
            e.measured(a.key(), 100 * US, NOW, FIT_UNBOUNDED);
        }
        assert!(e.estimate(b).unwrap() < 2 * MS);
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
}
