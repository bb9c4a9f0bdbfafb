//! The findings: which violations are counted and listed when, refusals per
//! lease, suspicion kept from its start, and a gone lease's entries forgotten.

use std::time::Duration;

use super::*;

fn lease(id: &str) -> LeaseId {
    LeaseId(id.to_owned())
}

fn violation(kind: ViolationKind) -> Violation {
    Violation {
        kind,
        gpu: "GPU-0".to_owned(),
        pid: 7,
        lease: Some(lease("a")),
        memory_used: 0,
        memory_quota: None,
        killed: false,
    }
}

#[test]
fn a_watchdog_pass_replaces_the_list_and_counts_all_but_overruns() {
    let mut f = Findings::default();
    f.record_watchdog_pass(vec![
        violation(ViolationKind::OverQuota),
        violation(ViolationKind::Overrun),
    ]);
    f.record_watchdog_pass(vec![violation(ViolationKind::Unregistered)]);
    assert_eq!(f.violations(), &[violation(ViolationKind::Unregistered)]);
    let totals: Vec<(&str, u64)> = f.totals().iter().map(|(k, n)| (*k, *n)).collect();
    assert_eq!(totals, [("over_quota", 1), ("unregistered", 1)]);
}

#[test]
fn a_violation_reported_at_once_is_counted_by_kind_and_listed_until_the_next_pass() {
    // (kind reported, the total it counts in)
    let table = [
        (ViolationKind::Overrun, "overrun"),
        (ViolationKind::Ungated, "ungated"),
        (ViolationKind::ShiftedClock, "shifted_clock"),
    ];
    for (kind, counted_as) in table {
        let mut f = Findings::default();
        f.record_at_once(violation(kind));
        assert_eq!(f.violations(), &[violation(kind)], "{kind:?}");
        assert_eq!(f.totals().get(counted_as), Some(&1), "{kind:?}");
        f.record_watchdog_pass(Vec::new());
        assert!(f.violations().is_empty(), "{kind:?}");
        assert_eq!(
            f.totals().get(counted_as),
            Some(&1),
            "totals stay: {kind:?}"
        );
    }
}

#[test]
fn memory_refusals_are_counted_per_lease() {
    let mut f = Findings::default();
    f.count_memory_refusal(&lease("a"));
    f.count_memory_refusal(&lease("a"));
    f.count_memory_refusal(&lease("b"));
    assert_eq!(f.memory_refusals(&lease("a")), 2);
    assert_eq!(f.memory_refusals(&lease("b")), 1);
    assert_eq!(f.memory_refusals(&lease("c")), 0);
}

#[test]
fn a_suspect_keeps_the_time_it_was_first_suspected_until_cleared() {
    let mut f = Findings::default();
    let t = Instant::now();
    f.set_suspects(vec![lease("a")], t);
    let later = t + Duration::from_secs(3);
    f.set_suspects(vec![lease("a"), lease("b")], later);
    assert_eq!(f.suspected_since(&lease("a")), Some(t));
    assert_eq!(f.suspected_since(&lease("b")), Some(later));
    // Not named by the next pass: no longer a suspect.
    f.set_suspects(vec![lease("b")], later);
    assert_eq!(f.suspected_since(&lease("a")), None);
    f.clear_suspicion(&lease("b"));
    assert_eq!(f.suspected_since(&lease("b")), None);
}

#[test]
fn a_gone_lease_is_forgotten_but_its_violations_stay_listed() {
    let mut f = Findings::default();
    let t = Instant::now();
    f.count_memory_refusal(&lease("a"));
    f.count_memory_refusal(&lease("b"));
    f.set_suspects(vec![lease("a"), lease("b")], t);
    f.record_at_once(violation(ViolationKind::Overrun));
    f.forget(&lease("a"));
    assert_eq!(f.memory_refusals(&lease("a")), 0);
    assert_eq!(f.suspected_since(&lease("a")), None);
    assert_eq!(f.memory_refusals(&lease("b")), 1, "another lease's stay");
    assert_eq!(f.suspected_since(&lease("b")), Some(t));
    assert_eq!(f.violations().len(), 1);
}
