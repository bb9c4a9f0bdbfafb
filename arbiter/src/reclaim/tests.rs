use super::*;

const GIB: u64 = 1 << 30;

fn lease(gib: u64, admitted: u64) -> Suspendable {
    Suspendable {
        bytes: gib * GIB,
        checkpointable: true,
        admitted,
    }
}

fn pinned(gib: u64, admitted: u64) -> Suspendable {
    Suspendable {
        checkpointable: false,
        ..lease(gib, admitted)
    }
}

#[test]
fn victims_are_the_fewest_then_the_least_memory_then_the_youngest() {
    let cases: &[(&str, u64, Vec<Suspendable>, Victims)] = &[
        (
            "nothing needed",
            0,
            vec![lease(4, 1)],
            Victims::Suspend(vec![]),
        ),
        (
            "one large rather than two small",
            6,
            vec![lease(4, 1), lease(4, 2), lease(8, 3)],
            Victims::Suspend(vec![2]),
        ),
        (
            "as few, the smaller that covers",
            5,
            vec![lease(16, 1), lease(6, 2), lease(5, 3)],
            Victims::Suspend(vec![2]),
        ),
        (
            "equal sizes: the youngest",
            4,
            vec![lease(4, 1), lease(4, 7), lease(4, 3)],
            Victims::Suspend(vec![1]),
        ),
        (
            "two needed: the pair moving the least, youngest first",
            10,
            vec![lease(8, 1), lease(6, 2), lease(4, 3), lease(3, 4)],
            // 8+3 = 11 and 6+4 = 10: the second moves less.
            Victims::Suspend(vec![2, 1]),
        ),
        (
            "never a lease with IPC or managed memory",
            6,
            vec![pinned(16, 1), lease(4, 2), lease(4, 3)],
            Victims::Suspend(vec![2, 1]),
        ),
        (
            "not enough even with every checkpointable lease",
            10,
            vec![pinned(16, 1), lease(4, 2), lease(4, 3)],
            Victims::NotEnough {
                reclaimable: 8 * GIB,
            },
        ),
        (
            "a lease holding nothing frees nothing",
            1,
            vec![lease(0, 1)],
            Victims::NotEnough { reclaimable: 0 },
        ),
    ];
    for (name, shortfall_gib, candidates, expected) in cases {
        assert_eq!(
            &choose_victims(shortfall_gib * GIB, candidates),
            expected,
            "{name}"
        );
    }
}

#[test]
fn many_candidates_still_give_the_fewest() {
    // 40 leases of 1 GiB and two of 20 GiB: 30 GiB needs both large ones (2), not 30 small.
    let mut candidates: Vec<Suspendable> = (0..40).map(|i| lease(1, i)).collect();
    candidates.push(lease(20, 100));
    candidates.push(lease(20, 101));
    let Victims::Suspend(chosen) = choose_victims(30 * GIB, &candidates) else {
        panic!("enough is there");
    };
    assert_eq!(chosen, vec![41, 40]);
    // 21 GiB: one large and one small, the youngest small one.
    let Victims::Suspend(chosen) = choose_victims(21 * GIB, &candidates) else {
        panic!("enough is there");
    };
    assert_eq!(chosen.len(), 2, "{chosen:?}");
    let freed: u64 = chosen.iter().map(|&i| candidates[i].bytes).sum();
    assert_eq!(freed, 21 * GIB, "{chosen:?}");
}

#[test]
fn the_oldest_come_back_first_and_none_overtakes_one_that_does_not_fit() {
    let s = |gib: u64, admitted: u64| Suspended {
        bytes: gib * GIB,
        admitted,
    };
    let suspended = [s(4, 5), s(8, 2), s(2, 9)];
    assert_eq!(restore_order(16 * GIB, &suspended), vec![1, 0, 2]);
    assert_eq!(restore_order(12 * GIB, &suspended), vec![1, 0]);
    // The oldest (8 GiB) does not fit: nobody passes it.
    assert_eq!(restore_order(6 * GIB, &suspended), Vec::<usize>::new());
    assert_eq!(restore_order(0, &[]), Vec::<usize>::new());
}
