//! Suspended leases (memory reclaim): a holder revoked and not waited for, no grant
//! while suspended, wants served after the resumption, nothing reported or penalised
//! for the time suspended.

use super::*;

fn suspend(lease: LeaseKey) -> Event {
    Event::Suspend { lease }
}

fn resume(lease: LeaseKey) -> Event {
    Event::Resume { lease }
}

#[test]
fn a_suspended_holder_is_revoked_and_the_next_waiter_granted_in_the_same_step() {
    let mut policy = run_table(
        config(),
        &[
            (0, join(1, LOW), &[]),
            (0, join(2, LOW), &[]),
            (0, want(1), &[grant(1, 0, 200, 0)]),
            (1, want(2), &[]),
            // No grace: 1's process is about to be locked and cannot launch anything.
            // 2 gets a grown slice: 1 still wants, but is not eligible.
            (5, suspend(1), &[Revoke { client: 1 }, grant(2, 5, 200, 0)]),
            // Past the grace: 1 never released, and is not overdue.
            (600, Event::Tick, &[grant(2, 600, 200, 0)]),
        ],
    );
    let snapshot = policy.snapshot();
    assert_eq!(snapshot.suspended, vec![1]);
    assert_eq!((snapshot.overdue_total, snapshot.overdue.len()), (0, 0));
    assert_eq!((snapshot.revocations, snapshot.holders), (1, vec![2]));
    assert_eq!(snapshot.waiting, 1, "1's want is remembered");
    // Its release, seconds later, ends nothing and grants nobody.
    assert_eq!(policy.handle(700 * MS, release(1, true)), vec![]);
    assert_eq!(policy.snapshot().holders, vec![2]);
    // Resumed: it waits its turn, which ends 2's grown slice at a contended one's end.
    assert_eq!(
        policy.handle(800 * MS, resume(1)),
        vec![Revoke { client: 2 }]
    );
    assert_eq!(
        policy.handle(801 * MS, release(2, false)),
        vec![grant(1, 801, 200, 0)]
    );
    assert_eq!(policy.snapshot().suspended, Vec::<LeaseKey>::new());
    // Its usage is the 5 ms it held before the suspension: the suspension is not
    // GPU time it used.
    assert_eq!(policy.clients[&1].usage(801 * MS, 20_000 * MS), 5 * MS);
}

#[test]
fn a_want_made_while_suspended_is_granted_only_after_the_resumption() {
    let mut policy = run_table(
        config(),
        &[
            (0, join(1, LOW), &[]),
            (0, suspend(1), &[]),
            // Nobody else wants the GPU, and still no grant.
            (1, want(1), &[]),
        ],
    );
    assert_eq!(
        policy.next_wakeup(),
        None,
        "nothing to wait for but the resumption"
    );
    assert_eq!(policy.snapshot().waiting, 1);
    assert_eq!(policy.handle(1_000 * MS, Event::Tick), vec![]);
    assert_eq!(
        policy.handle(1_000 * MS, resume(1)),
        vec![grant(1, 1_000, 200, 0)]
    );
}

#[test]
fn suspending_and_resuming_are_idempotent_and_belong_to_the_lease() {
    let policy = run_table(
        config(),
        &[
            (0, join_lease(1, 7, LOW), &[]),
            (0, want(1), &[grant(1, 0, 200, 0)]),
            (1, suspend(7), &[Revoke { client: 1 }]),
            // Retried (say after an arbiter restart): nothing more happens.
            (2, suspend(7), &[]),
            // A new process of the lease joins while it is suspended: suspended too.
            (3, join_lease(2, 7, LOW), &[]),
            (3, want(2), &[]),
            // Resuming a lease that is not suspended does nothing.
            (4, resume(8), &[]),
            // Both want: 2, which has used less, first.
            (5, resume(7), &[grant(2, 5, 20, 0)]),
            (6, resume(7), &[]),
        ],
    );
    assert_eq!(policy.snapshot().revocations, 1);
    // Once its clients are gone the policy forgets the suspension (the I/O layer
    // keeps it for clients joining later), and a lease with no client here is not
    // suspended at all.
    let mut policy = run_table(
        config(),
        &[
            (0, join_lease(1, 7, LOW), &[]),
            (0, suspend(7), &[]),
            (1, Event::Leave { client: 1 }, &[]),
            (2, suspend(8), &[]),
        ],
    );
    assert_eq!(policy.snapshot().suspended, Vec::<LeaseKey>::new());
    assert_eq!(policy.handle(3 * MS, join_lease(2, 7, LOW)), vec![]);
    assert_eq!(policy.handle(3 * MS, want(2)), vec![grant(2, 3, 200, 0)]);
}

/// The drain below would be overdue and an overrun at 510 without the suspension
/// (`a_holder_draining_2s_is_never_cut_off_...`), and its lease penalised.
#[test]
fn a_suspended_drain_beside_a_high_job_is_not_overdue_not_an_overrun_and_not_penalised() {
    let with_penalties = SchedulerConfig {
        admit_by_duration: false,
        ..SchedulerConfig::default()
    };
    let policy = run_table(
        with_penalties,
        &[
            (0, join(1, LOW), &[]),
            (0, join(2, HIGH), &[]),
            (0, join(3, LOW), &[]),
            (0, want(1), &[grant(1, 0, 200, 0)]),
            (10, want(2), &[Revoke { client: 1 }, high_grant(2)]),
            (11, want(3), &[]),
            // 1 drains (revoked, no release): its lease is suspended meanwhile.
            (20, suspend(1), &[]),
            (510, Event::Tick, &[]),
            (600, Event::Tick, &[]),
            // The high job pauses: 3 is granted without waiting for 1's drain, bounded
            // as ever beside an active high job.
            (700, release(2, false), &[grant(3, 700, 200, 1)]),
            (800, resume(1), &[Revoke { client: 3 }]),
            // Not penalised: granted beside the active high job.
            (801, release(3, false), &[grant(1, 801, 200, 1)]),
        ],
    );
    let snapshot = policy.snapshot();
    assert_eq!(
        (
            snapshot.overdue_total,
            snapshot.overruns,
            snapshot.penalized
        ),
        (0, 0, vec![])
    );
}

#[test]
fn a_suspended_high_holder_is_revoked_and_granted_again_at_once_when_resumed() {
    let policy = run_table(
        config(),
        &[
            (0, join(1, HIGH), &[]),
            (0, join(2, LOW), &[]),
            (0, want(1), &[high_grant(1)]),
            (1, want(2), &[]),
            // The high job was active a moment ago: the low grant is bounded.
            (5, suspend(1), &[Revoke { client: 1 }, grant(2, 5, 200, 1)]),
            // Its want while suspended does not preempt anyone.
            (6, want(1), &[]),
            (50, resume(1), &[Revoke { client: 2 }, high_grant(1)]),
        ],
    );
    assert_eq!(policy.snapshot().holders, vec![1]);
}

#[test]
fn round_robin_skips_a_suspended_waiter_and_serves_it_in_its_place_after() {
    run_table(
        round_robin(),
        &[
            (0, join(1, LOW), &[]),
            (0, join(2, LOW), &[]),
            (0, join(3, LOW), &[]),
            (0, want(1), &[grant(1, 0, 20, 0)]),
            (1, want(2), &[]),
            (2, want(3), &[]),
            (3, suspend(2), &[]),
            (20, Event::Tick, &[Revoke { client: 1 }]),
            (21, release(1, true), &[grant(3, 21, 20, 0)]),
            (22, resume(2), &[]),
            // 2 queued before 1 wanted again.
            (41, Event::Tick, &[Revoke { client: 3 }]),
            (42, release(3, false), &[grant(2, 42, 20, 0)]),
        ],
    );
}
