//! A high-priority job's rhythm on one GPU, learned from its token requests: a gap
//! runs from the moment the last high-priority holder released (its burst's work had
//! completed: the interposer drains before it releases) to the next high-priority
//! `Want` (its next burst's first launch is already queued by then). From the recent
//! gaps it predicts an *admission window*: the instant until which low-priority work
//! may occupy the GPU with a risk of `risk_percent` that the high job is back first.
//!
//! The prediction is the `risk_percent` percentile of what remains of the recent gaps
//! that are longer than the time already waited (the high job is not back yet, so
//! shorter gaps no longer describe it), and never more than that percentile of all the
//! gaps counted from now. A periodic job's window is therefore nearly its whole gap
//! and closes just before it returns; a random (Poisson) job's window is about a tenth
//! of its mean gap and rolls forward while it stays away, each window carrying the same
//! risk. The cap matters for a job that has been away long: the few gaps longer than
//! that are no evidence of a long absence ahead (the smallest of three exponential
//! gaps averages a third of the mean, not a tenth), and trusting them let 5–20 ms low
//! kernels into windows an inference job came back inside (simulated E3: p99 +26 to
//! +75 %). A job later than every gap on record gets fresh windows of the usual size.
//! Pure: times are CLOCK_MONOTONIC nanoseconds passed in.

use std::collections::VecDeque;

/// Gaps remembered: enough for a percentile to mean something, few enough to follow a
/// job that changes its rhythm within a second or so.
pub const GAPS_KEPT: usize = 32;

/// A window is re-evaluated no sooner than this after the previous evaluation: a
/// periodic job's conditional windows shrink towards nothing just before it returns,
/// and re-evaluating each of them would make the timer spin. 250 µs is about two
/// handoffs; nothing that fits in less would be worth a grant.
pub const MIN_REEVALUATION_NS: u64 = 250_000;

/// A release followed by a want this soon is one busy period, not a gap: the high job's
/// agent releases as soon as its burst drains, and a job with requests queued launches
/// the next one right after its own wait returns (the simulated inference job showed
/// 10 % of its "gaps" under 141 µs). Counting them would shrink every window to
/// nothing; a window this short admits nothing worth a grant anyway.
pub const MIN_GAP_NS: u64 = MIN_REEVALUATION_NS;

/// What the low-priority holder may fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Work admitted now should be finished by this instant.
    pub fit_by: u64,
    /// When to evaluate the window again if the high job has not come back.
    pub reevaluate_at: u64,
}

#[derive(Debug, Clone, Default)]
pub struct HighRhythm {
    /// Recent gaps (ns), oldest first.
    gaps: VecDeque<u64>,
    /// When the last high-priority holder released, while none holds.
    released_at: Option<u64>,
}

impl HighRhythm {
    /// A high-priority client wants the GPU while none held it: a gap ends. Gaps
    /// longer than `longest` (the job went inactive) are not its rhythm.
    pub fn wanted(&mut self, now: u64, longest: u64) {
        if let Some(released) = self.released_at.take() {
            let gap = now.saturating_sub(released);
            if (MIN_GAP_NS..=longest).contains(&gap) {
                if self.gaps.len() == GAPS_KEPT {
                    self.gaps.pop_front();
                }
                self.gaps.push_back(gap);
            }
        }
    }

    /// The last high-priority holder released: a gap begins.
    pub fn released(&mut self, now: u64) {
        self.released_at = Some(now);
    }

    /// No high-priority client is left: nothing to predict until one comes.
    pub fn forget(&mut self) {
        self.gaps.clear();
        self.released_at = None;
    }

    pub fn gaps(&self) -> impl Iterator<Item = u64> + '_ {
        self.gaps.iter().copied()
    }

    /// The window at `now`, or None when nothing can be predicted (no gap on record,
    /// or a high-priority client holds).
    pub fn window(&self, now: u64, risk_percent: u32) -> Option<Window> {
        let released = self.released_at?;
        if self.gaps.is_empty() {
            return None;
        }
        let waited = now.saturating_sub(released);
        let mut all: Vec<u64> = self.gaps.iter().copied().collect();
        let fresh = percentile(&mut all, risk_percent);
        let mut remaining: Vec<u64> = self
            .gaps
            .iter()
            .filter(|&&g| g > waited)
            .map(|&g| g - waited)
            .collect();
        // Later than ever: a fresh window of the usual size, from now.
        let ahead = if remaining.is_empty() {
            fresh
        } else {
            percentile(&mut remaining, risk_percent).min(fresh)
        };
        let fit_by = now.saturating_add(ahead);
        Some(Window {
            fit_by,
            reevaluate_at: fit_by.max(now.saturating_add(MIN_REEVALUATION_NS)),
        })
    }
}

/// The lower nearest-rank percentile of a non-empty sample: with fewer than
/// `100 / percent` values it is the smallest, which errs towards a short window.
fn percentile(values: &mut [u64], percent: u32) -> u64 {
    values.sort_unstable();
    let rank = (values.len() - 1) * percent.min(100) as usize / 100;
    values[rank]
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;
    const LONGEST: u64 = 500 * MS;

    /// A rhythm that saw these gaps, the last release at `released`.
    fn rhythm(gaps: &[u64], released: u64) -> HighRhythm {
        let mut r = HighRhythm::default();
        let mut t = 0;
        for &gap in gaps {
            r.released(t);
            t += gap;
            r.wanted(t, LONGEST);
            t += 5 * MS; // its burst
        }
        r.released(released);
        r
    }

    #[test]
    fn percentiles_err_towards_the_short_side() {
        let table: &[(&[u64], u32, u64)] = &[
            (&[7], 10, 7),
            (&[9, 3, 5], 10, 3),
            (&[9, 3, 5], 50, 5),
            (&[9, 3, 5], 100, 9),
            (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 10, 2),
        ];
        for &(values, percent, expected) in table {
            let mut v = values.to_vec();
            assert_eq!(
                percentile(&mut v, percent),
                expected,
                "{values:?} p{percent}"
            );
        }
    }

    /// (what, gaps seen, time since the release, risk, the window's end and when it
    /// is looked at again, both relative to the release).
    type Row<'a> = (&'a str, &'a [u64], u64, u32, Option<(u64, u64)>);

    #[test]
    fn windows() {
        let periodic: Vec<u64> = (0..20).map(|i| 3_300 * US + (i % 5) * 20 * US).collect();
        let table: &[Row] = &[
            ("nothing learned yet", &[], 0, 10, None),
            (
                "a periodic job: nearly the whole gap",
                &periodic,
                10 * US,
                10,
                Some((3_300 * US, 3_300 * US)),
            ),
            (
                "later than most of its gaps: what is left of the rest, re-evaluated \
                 no sooner than the minimum",
                &periodic,
                3_340 * US,
                10,
                Some((3_360 * US, 3_340 * US + MIN_REEVALUATION_NS)),
            ),
            (
                "later than every gap: a fresh window from now",
                &periodic,
                10 * MS,
                10,
                Some((10 * MS + 3_300 * US, 10 * MS + 3_300 * US)),
            ),
            (
                "a higher risk: a longer window",
                &[MS, 2 * MS, 3 * MS, 4 * MS, 5 * MS],
                0,
                50,
                Some((3 * MS, 3 * MS)),
            ),
            (
                "away long: the few longer gaps are no licence for a long window",
                &[MS, 2 * MS, 3 * MS, 40 * MS, 80 * MS],
                30 * MS,
                10,
                Some((31 * MS, 31 * MS)),
            ),
        ];
        for &(what, gaps, waited, risk, expected) in table {
            let released = 100 * MS;
            let r = rhythm(gaps, released);
            let window = r.window(released + waited, risk);
            let expected = expected.map(|(fit_by, again)| Window {
                fit_by: released + fit_by,
                reevaluate_at: released + again,
            });
            assert_eq!(window, expected, "{what}");
        }
    }

    #[test]
    fn a_holding_high_job_has_no_window_and_long_pauses_are_not_its_rhythm() {
        let mut r = rhythm(&[3 * MS, 3 * MS], 50 * MS);
        // Wanted again 100 µs after its release: one busy period, not a gap.
        r.wanted(50 * MS + 100 * US, LONGEST);
        r.released(50 * MS + 900 * US);
        r.wanted(51 * MS + 900 * US, LONGEST);
        assert_eq!(r.window(52 * MS, 10), None, "holding: no window");
        r.released(60 * MS);
        // Away for longer than the activity window: not a gap of its rhythm.
        r.wanted(60 * MS + 2 * LONGEST, LONGEST);
        assert_eq!(r.gaps().collect::<Vec<_>>(), [3 * MS, 3 * MS, MS]);
        r.forget();
        r.released(0);
        assert_eq!(r.window(MS, 10), None, "forgotten");
    }

    #[test]
    fn a_job_that_changes_its_rhythm_is_followed_within_the_gaps_kept() {
        let mut gaps = vec![10 * MS; GAPS_KEPT];
        gaps.extend(vec![2 * MS; GAPS_KEPT]);
        let r = rhythm(&gaps, 0);
        assert_eq!(r.window(0, 10).unwrap().fit_by, 2 * MS);
    }
}
