//! Duration-aware admission windows and overruns: the window a low holder gets from
//! the high job's rhythm, waiters whose launch fits no window, releases past their
//! window or the grace, and the penalties that follow.

use super::*;

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
