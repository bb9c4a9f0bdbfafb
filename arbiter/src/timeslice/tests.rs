use super::*;
use Action::*;

mod suspend;
mod windows;

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

/// The `round-robin` baseline, with the rules of [`config`] otherwise.
fn round_robin() -> SchedulerConfig {
    SchedulerConfig {
        policy: SchedulingPolicy::RoundRobin,
        ..config()
    }
}

/// Client `client`, the only one of its lease (numbered the same).
fn join(client: ClientId, priority: Priority) -> Event {
    join_lease(client, client, priority)
}

fn join_lease(client: ClientId, lease: LeaseKey, priority: Priority) -> Event {
    Event::Join {
        client,
        lease,
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

fn overrun(client: ClientId, lease: LeaseKey, from_ms: u64) -> Action {
    Overrun {
        client,
        lease,
        from_ns: from_ms * MS,
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
        launch_ahead: 4,
        ..round_robin()
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

#[test]
fn round_robin_is_fifo_with_a_fixed_slice_and_no_priority() {
    run_table(
        round_robin(),
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
