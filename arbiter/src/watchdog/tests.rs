use super::*;

const GI: u64 = 1 << 30;

fn procs(list: &[(&str, u32, u64)]) -> BTreeMap<String, Vec<GpuProcess>> {
    let mut m: BTreeMap<String, Vec<GpuProcess>> = BTreeMap::new();
    for &(gpu, pid, gib) in list {
        m.entry(gpu.into()).or_default().push(GpuProcess {
            pid,
            memory_used: Some(gib * GI),
        });
    }
    m
}

#[test]
fn registered_processes_within_quota_are_fine() {
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10, 11],
    }];
    assert!(listing_findings(&procs(&[("GPU-0", 10, 2), ("GPU-0", 11, 2)]), &leases).is_empty());
}

#[test]
fn unregistered_and_wrong_gpu_processes_are_reported() {
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10],
    }];
    let found = listing_findings(&procs(&[("GPU-0", 99, 1), ("GPU-1", 10, 1)]), &leases);
    let summary: Vec<_> = found
        .iter()
        .map(|v| (v.kind, v.gpu.as_str(), v.pid))
        .collect();
    assert_eq!(
        summary,
        [
            (ViolationKind::Unregistered, "GPU-0", 99),
            (ViolationKind::Unregistered, "GPU-1", 10),
        ],
        "a registered process on a GPU its lease does not hold bypassed the interposer"
    );
}

#[test]
fn a_lease_over_quota_on_a_gpu_reports_each_of_its_processes_there() {
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10, 11],
    }];
    let found = listing_findings(&procs(&[("GPU-0", 10, 3), ("GPU-0", 11, 2)]), &leases);
    assert_eq!(found.len(), 2);
    for v in &found {
        assert_eq!(v.kind, ViolationKind::OverQuota);
        assert_eq!((v.memory_used, v.memory_quota), (5 * GI, Some(4 * GI)));
        assert_eq!(v.lease.as_ref(), Some(&id));
    }
}

#[test]
fn a_process_with_its_context_up_to_the_quota_is_not_over() {
    // 1 GiB quota; the process's context (300 MiB) was charged, so it could
    // allocate only 724 MiB: NVML shows exactly the quota.
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: GI,
        client_pids: vec![10],
    }];
    let mut table = procs(&[]);
    table.insert(
        "GPU-0".into(),
        vec![GpuProcess {
            pid: 10,
            memory_used: Some(GI),
        }],
    );
    assert!(listing_findings(&table, &leases).is_empty());
    table.get_mut("GPU-0").unwrap()[0].memory_used = Some(GI + 1);
    assert_eq!(listing_findings(&table, &leases).len(), 1);
}

#[test]
fn a_multi_gpu_lease_is_measured_against_its_whole_quota() {
    // 2 GPUs × 4 GiB: the ledger grants 8 GiB across them, used unevenly.
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string(), "GPU-1".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 8 * GI,
        client_pids: vec![10],
    }];
    assert!(listing_findings(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 2)]), &leases).is_empty());
    let over = listing_findings(&procs(&[("GPU-0", 10, 6), ("GPU-1", 10, 3)]), &leases);
    let summary: Vec<_> = over
        .iter()
        .map(|v| (v.kind, v.gpu.as_str(), v.memory_used, v.memory_quota))
        .collect();
    assert_eq!(
        summary,
        [
            (ViolationKind::OverQuota, "GPU-0", 9 * GI, Some(8 * GI)),
            (ViolationKind::OverQuota, "GPU-1", 9 * GI, Some(8 * GI)),
        ]
    );
}

// ----- graces (finding 4) -----

const SECOND: Duration = Duration::from_secs(1);

fn scheduling(policy: SchedulingPolicy) -> Scheduling {
    Scheduling {
        policy,
        revoke_grace: Duration::from_millis(500),
    }
}

/// Passes at the given seconds after `t0` with pid 99 on GPU-0 when `present`;
/// whether each pass reported it unregistered.
fn unregistered_passes(started_before_t0: Duration, passes: &[(f64, bool)]) -> Vec<bool> {
    let t0 = Instant::now() + Duration::from_secs(3600);
    let mut w = Watchdog::new(
        t0 - started_before_t0,
        SECOND,
        scheduling(SchedulingPolicy::Priority),
    );
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10],
    }];
    passes
        .iter()
        .map(|&(at, present)| {
            let mut list = vec![("GPU-0", 10, 1)];
            if present {
                list.push(("GPU-0", 99, 1));
            }
            let found = w.audit(
                t0 + Duration::from_secs_f64(at),
                &procs(&list),
                &leases,
                None,
            );
            assert!(found.iter().all(|v| v.pid == 99), "{found:?}");
            !found.is_empty()
        })
        .collect()
}

#[test]
fn an_unregistered_process_is_reported_once_seen_so_for_the_grace() {
    // Interval 1 s: the grace is 2 s (two passes would be less).
    assert_eq!(Timing::for_interval(SECOND).unregistered_grace, 2 * SECOND);
    assert_eq!(
        Timing::for_interval(3 * SECOND).unregistered_grace,
        6 * SECOND
    );
    let hour = Duration::from_secs(3600);
    for (passes, expected) in [
        // Seen at 0, 1, 2: reported at 2 s, and on.
        (
            vec![(0.0, true), (1.0, true), (2.0, true), (3.0, true)],
            vec![false, false, true, true],
        ),
        // Registered in time (gone from the unregistered list at 1 s): never.
        (
            vec![(0.0, true), (1.0, false), (2.0, false)],
            vec![false, false, false],
        ),
        // Continuity: a gap restarts the grace.
        (
            vec![
                (0.0, true),
                (1.5, false),
                (2.0, true),
                (3.0, true),
                (4.0, true),
            ],
            vec![false, false, false, false, true],
        ),
    ] {
        assert_eq!(unregistered_passes(hour, &passes), expected, "{passes:?}");
    }
}

#[test]
fn nothing_is_reported_unregistered_within_the_restart_grace() {
    assert_eq!(Timing::for_interval(SECOND).restart_grace, 10 * SECOND);
    // The arbiter started at t0; the process is there from the first pass on and
    // never registers: reported once the restart grace is over (it has been
    // unregistered far longer than the grace by then).
    let passes: Vec<(f64, bool)> = (0..13).map(|s| (s as f64 + 0.2, true)).collect();
    let reported = unregistered_passes(Duration::ZERO, &passes);
    let first = reported.iter().position(|r| *r).unwrap();
    assert_eq!(passes[first].0, 10.2, "{reported:?}");
    assert!(reported[first..].iter().all(|r| *r));
}

// ----- ungated work (finding 3) -----

struct Case {
    policy: SchedulingPolicy,
    lease_gpus: usize,
    /// The process's token connection, if it has one.
    token: Option<Priority>,
    /// Per 1 s pass: (busy ms, held ms).
    passes: Vec<(u64, u64)>,
}

const MS: u64 = 1_000_000;

/// Whether each pass reported pid 10 ungated.
fn ungated_passes(case: &Case) -> Vec<bool> {
    let t0 = Instant::now() + Duration::from_secs(3600);
    let mut w = Watchdog::new(
        t0 - Duration::from_secs(600),
        SECOND,
        scheduling(case.policy),
    );
    let id = LeaseId("a".into());
    let gpus: Vec<String> = (0..case.lease_gpus).map(|g| format!("GPU-{g}")).collect();
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10],
    }];
    let place = ("GPU-0".to_string(), 10);
    case.passes
        .iter()
        .enumerate()
        .map(|(i, &(busy, held))| {
            let activity = PassActivity {
                span: SECOND,
                busy: BTreeMap::from([(place.clone(), busy * MS)]),
                held: case
                    .token
                    .map(|priority| {
                        (
                            place.clone(),
                            Held {
                                priority,
                                held_ns: held * MS,
                            },
                        )
                    })
                    .into_iter()
                    .collect(),
            };
            let now = t0 + SECOND * i as u32;
            let found = w.audit(now, &procs(&[("GPU-0", 10, 1)]), &leases, Some(&activity));
            found.iter().any(|v| {
                assert_eq!(
                    (v.kind, v.lease.as_ref(), v.memory_used),
                    (ViolationKind::Ungated, Some(&id), GI)
                );
                true
            })
        })
        .collect()
}

#[test]
fn busy_time_beyond_token_time_is_ungated_and_well_behaved_work_is_not() {
    use Priority::{High, Low};
    use SchedulingPolicy::{Off, RoundRobin};
    let full = vec![(1000, 0); 6];
    let half = vec![(500, 0); 6];
    let no = vec![false; 6];
    // Interval 1 s, revoke grace 0.5 s: the window is 5 s; over k passes the
    // tolerance is 1.5 s + k/10 s.
    for (name, case, expected) in [
        (
            "a low job busy the whole time while holding nothing",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(Low),
                passes: full.clone(),
            },
            vec![false, true, true, true, true, true],
        ),
        (
            "a low job taking half the GPU beside a high holder",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(Low),
                passes: half.clone(),
            },
            vec![false, false, false, true, true, true],
        ),
        (
            "busy with no token connection at all",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: None,
                passes: full.clone(),
            },
            vec![false, true, true, true, true, true],
        ),
        (
            "a gated low job: busy inside its token time",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(Low),
                passes: vec![(900, 950); 6],
            },
            no.clone(),
        ),
        (
            "a gated low job whose samples straddle the passes (one period late)",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(Low),
                passes: vec![
                    (0, 1000),
                    (1000, 0),
                    (0, 1000),
                    (1000, 0),
                    (1000, 1000),
                    (1000, 0),
                ],
            },
            no.clone(),
        ),
        (
            "a gated low job draining one long kernel past its release",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(Low),
                passes: vec![(1000, 1000), (1000, 500), (1000, 0), (0, 0), (0, 0), (0, 0)],
            },
            no.clone(),
        ),
        (
            "a high job under the priority policy submits without a grant",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 1,
                token: Some(High),
                passes: full.clone(),
            },
            no.clone(),
        ),
        (
            "any job under round-robin",
            Case {
                policy: RoundRobin,
                lease_gpus: 1,
                token: Some(High),
                passes: full.clone(),
            },
            vec![false, true, true, true, true, true],
        ),
        (
            "a multi-GPU lease runs ungated by design",
            Case {
                policy: SchedulingPolicy::Priority,
                lease_gpus: 2,
                token: None,
                passes: full.clone(),
            },
            no.clone(),
        ),
        (
            "GPU time is not scheduled",
            Case {
                policy: Off,
                lease_gpus: 1,
                token: None,
                passes: full.clone(),
            },
            no.clone(),
        ),
    ] {
        assert_eq!(ungated_passes(&case), expected, "{name}");
    }
}

#[test]
fn ungated_work_is_not_judged_within_the_restart_grace_nor_for_unregistered_processes() {
    let t0 = Instant::now() + Duration::from_secs(3600);
    let mut w = Watchdog::new(t0, SECOND, scheduling(SchedulingPolicy::Priority));
    let id = LeaseId("a".into());
    let gpus = vec!["GPU-0".to_string()];
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 4 * GI,
        client_pids: vec![10],
    }];
    let busy = |pid: u32| PassActivity {
        span: SECOND,
        busy: BTreeMap::from([(("GPU-0".to_string(), pid), 1000 * MS)]),
        held: BTreeMap::new(),
    };
    let table = procs(&[("GPU-0", 10, 1), ("GPU-0", 99, 1)]);
    // Processes re-attaching after a restart ran ungated meanwhile (a high job
    // keeps running): none of it counts.
    for s in 1..=9 {
        let found = w.audit(t0 + SECOND * s, &table, &leases, Some(&busy(10)));
        assert!(found.is_empty(), "{s} s: {found:?}");
    }
    let kinds: Vec<_> = (10..=12)
        .flat_map(|s| w.audit(t0 + SECOND * s, &table, &leases, Some(&busy(99))))
        .map(|v| (v.kind, v.pid))
        .collect();
    assert!(
        kinds
            .iter()
            .all(|&(k, pid)| k == ViolationKind::Unregistered && pid == 99),
        "a process no lease registered is unregistered, not ungated: {kinds:?}"
    );
    let found = w.audit(t0 + SECOND * 13, &table, &leases, Some(&busy(10)));
    assert!(
        found.iter().all(|v| v.kind != ViolationKind::Ungated),
        "one pass is within the tolerance"
    );
    let found = w.audit(t0 + SECOND * 14, &table, &leases, Some(&busy(10)));
    assert!(
        found
            .iter()
            .any(|v| v.kind == ViolationKind::Ungated && v.pid == 10),
        "{found:?}"
    );
}

#[test]
fn token_time_is_summed_per_process_and_differenced_per_pass() {
    let holding = |gpu: &str, pid: Option<u32>, priority, held_ns| Holding {
        overran_ns: 0,
        gpu: gpu.into(),
        lease: LeaseId("a".into()),
        pid,
        priority,
        held_ns,
    };
    let before = token_totals(&[
        holding("GPU-0", Some(10), Priority::Low, 100),
        holding("GPU-0", Some(10), Priority::Low, 50),
        holding("GPU-0", None, Priority::Low, 999),
        holding("GPU-1", Some(11), Priority::High, 7),
    ]);
    assert_eq!(before.len(), 2, "pid unknown: left out");
    assert_eq!(before[&("GPU-0".to_string(), 10)].held_ns, 150);
    let after = token_totals(&[
        holding("GPU-0", Some(10), Priority::Low, 400),
        holding("GPU-1", Some(11), Priority::High, 3),
        holding("GPU-1", Some(12), Priority::Low, 20),
    ]);
    let held = held_between(&before, &after);
    let summary: Vec<_> = held
        .iter()
        .map(|((gpu, pid), h)| (gpu.as_str(), *pid, h.priority, h.held_ns))
        .collect();
    assert_eq!(
        summary,
        [
            ("GPU-0", 10, Priority::Low, 250),
            ("GPU-1", 11, Priority::High, 3), // reconnected: counts from zero
            ("GPU-1", 12, Priority::Low, 20),
        ]
    );
}

#[test]
fn busy_time_is_the_larger_of_sm_and_memory_utilisation() {
    let sample = |pid, sm_percent, memory_percent| ProcessUtilization {
        pid,
        timestamp_us: 1,
        sm_percent,
        memory_percent,
    };
    let samples = BTreeMap::from([(
        "GPU-0".to_string(),
        vec![sample(10, 40, 5), sample(11, 0, 90), sample(12, 250, 0)],
    )]);
    let busy = busy_from_samples(&samples, 2 * SECOND);
    let ms = |pid| busy[&("GPU-0".to_string(), pid)] / MS;
    assert_eq!((ms(10), ms(11), ms(12)), (800, 1800, 2000));
}
