use super::*;
use gpushare_proto::{
    Fraction, GpuStatus, Lease, LeaseId, LeaseTokenAccount, LeaseUsage, TokenStatus, Violation,
};

fn grant(id: &str, amount: GrantAmount, gpu: Option<&str>, lease: Option<&str>) -> Grant {
    Grant {
        id: gpushare_proto::grant::GrantId(id.into()),
        amount,
        device_ids: vec![id.into()],
        gpu: gpu.map(str::to_owned),
        lease: lease.map(|l| LeaseId(l.into())),
        created_unix_ms: 0,
    }
}

fn lease(id: &str, priority: Priority, state: LeaseState, pod: Option<PodBinding>) -> Lease {
    Lease {
        id: LeaseId(id.into()),
        container_id: format!("c-{id}"),
        namespace: None,
        sandbox_id: None,
        gpus: vec!["GPU-0".into()],
        priority,
        memory_bytes: 40,
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        tenant: None,
        state,
        pid: Some(1),
        created_unix_ms: 0,
        pod,
    }
}

fn pod(namespace: &str, name: &str, container: Option<&str>) -> Option<PodBinding> {
    Some(PodBinding {
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        container: container.map(str::to_owned),
        grants: vec![],
    })
}

/// A lease's usage with nothing counted yet.
fn usage(id: &str, container: &str) -> LeaseUsage {
    LeaseUsage {
        lease: LeaseId(id.into()),
        memory_used: 12,
        memory_quota: 40,
        clients: vec![],
        cgroup: None,
        container: container.into(),
        token_time_ms: 0,
        token_share_10s: None,
        token_share_1m: None,
        memory_refusals: 0,
        token_revocations: 0,
        token_cut_offs: 0,
        token_overdue: 0,
    }
}

#[test]
fn renders_grants_and_the_pod_of_each_lease() {
    let gib = 1u64 << 30;
    let report = StatusReport {
        leases: vec![lease(
            "l1",
            Priority::Low,
            LeaseState::Confirmed,
            pod("team-a", "web\"1", None),
        )],
        usage: vec![LeaseUsage {
            memory_used: 5,
            memory_quota: gib,
            ..usage("l1", "team-a/web\"1")
        }],
        grants: vec![
            grant(
                "g-1",
                GrantAmount::Memory { bytes: gib },
                Some("GPU-0"),
                Some("l1"),
            ),
            grant("g-2", GrantAmount::Memory { bytes: 2 * gib }, None, None),
            grant("g-3", GrantAmount::Memory { bytes: 3 * gib }, None, None),
            grant(
                "g-4",
                GrantAmount::Memory { bytes: gib },
                Some("GPU-0"),
                None,
            ),
            grant("g-5", GrantAmount::High, None, None),
        ],
        ..Default::default()
    };
    let text = render(&report, &BTreeMap::new());
    for line in [
        "gpushare_lease_memory_used_bytes{lease=\"l1\",name=\"team-a/web\\\"1\",pod=\"web\\\"1\",namespace=\"team-a\",container=\"\",gpu=\"GPU-0\",gpu_index=\"\"} 5",
        "gpushare_lease_memory_quota_bytes{lease=\"l1\",name=\"team-a/web\\\"1\",pod=\"web\\\"1\",namespace=\"team-a\",container=\"\",gpu=\"GPU-0\",gpu_index=\"\"} 1073741824",
        "gpushare_grants{state=\"bound\",resource=\"memory\"} 1",
        "gpushare_grants{state=\"waiting\",resource=\"memory\"} 2",
        "gpushare_grants{state=\"placed\",resource=\"memory\"} 1",
        "gpushare_grants{state=\"placed\",resource=\"high\"} 1",
        "gpushare_grants{state=\"waiting\",resource=\"high\"} 0",
        "gpushare_grants{state=\"bound\",resource=\"compute\"} 0",
        "gpushare_grants_waiting_memory_bytes 5368709120",
    ] {
        assert!(has_sample(&text, line), "missing {line:?} in\n{text}");
    }
}

/// A GPU of index `index` with nothing in use.
fn idle_gpu(index: u32, uuid: &str) -> GpuStatus {
    GpuStatus {
        index,
        uuid: uuid.into(),
        name: "t".into(),
        memory_total: 100,
        memory_allocatable: 90,
        memory_leased: 0,
        memory_used: None,
        utilization_last_minute: None,
        drained: false,
        reserved_for: None,
    }
}

/// `lease`'s account on a GPU's token.
fn account(lease: &str, token_time_ms: u64, share_10s: f64, revocations: u64) -> LeaseTokenAccount {
    LeaseTokenAccount {
        lease: LeaseId(lease.into()),
        token_time_ms,
        token_share_10s: share_10s,
        token_share_1m: share_10s / 2.0,
        revocations,
        cut_offs: 0,
        overdue: 0,
    }
}

#[test]
fn each_lease_has_a_series_per_gpu_with_that_gpus_token_account() {
    // l1 on GPU-A (index 0) and GPU-B (index 3), with token clients on both;
    // l2 on GPU-B only, whose clients never came to a token.
    let mut two_gpus = lease("l1", Priority::Low, LeaseState::Confirmed, None);
    two_gpus.gpus = vec!["GPU-A".into(), "GPU-B".into()];
    let mut one_gpu = lease("l2", Priority::High, LeaseState::Confirmed, None);
    one_gpu.gpus = vec!["GPU-B".into()];
    let token = |gpu: &str, leases| TokenStatus {
        gpu: gpu.into(),
        leases,
        ..Default::default()
    };
    let report = StatusReport {
        gpus: vec![idle_gpu(0, "GPU-A"), idle_gpu(3, "GPU-B")],
        leases: vec![two_gpus, one_gpu],
        usage: vec![
            LeaseUsage {
                memory_used: 7,
                memory_refusals: 2,
                ..usage("l1", "trainer")
            },
            usage("l2", "server"),
        ],
        tokens: vec![
            token("GPU-A", vec![account("l1", 12_345, 0.6, 4)]),
            token("GPU-B", vec![account("l1", 500, 0.2, 1)]),
        ],
        ..Default::default()
    };
    let text = render(&report, &BTreeMap::new());
    let on = |lease: &str, name: &str, gpu: &str, index: u32| {
        format!("lease=\"{lease}\",name=\"{name}\",pod=\"\",namespace=\"\",container=\"\",gpu=\"{gpu}\",gpu_index=\"{index}\"")
    };
    let (l1_a, l1_b, l2_b) = (
        on("l1", "trainer", "GPU-A", 0),
        on("l1", "trainer", "GPU-B", 3),
        on("l2", "server", "GPU-B", 3),
    );
    for (family, labels, value) in [
        // The token's accounts are per GPU: each GPU's own.
        ("gpushare_lease_token_time_seconds_total", &l1_a, "12.345"),
        ("gpushare_lease_token_time_seconds_total", &l1_b, "0.5"),
        ("gpushare_lease_token_time_seconds_total", &l2_b, "0"),
        ("gpushare_lease_token_revocations_total", &l1_a, "4"),
        ("gpushare_lease_token_revocations_total", &l1_b, "1"),
        ("gpushare_lease_token_revocations_total", &l2_b, "0"),
        ("gpushare_lease_token_overdue_total", &l2_b, "0"),
        ("gpushare_lease_token_cut_offs_total", &l2_b, "0"),
        // The memory ledger is per process, not per GPU: the lease's on each.
        ("gpushare_lease_memory_used_bytes", &l1_a, "7"),
        ("gpushare_lease_memory_used_bytes", &l1_b, "7"),
        ("gpushare_lease_memory_quota_bytes", &l2_b, "40"),
        ("gpushare_lease_memory_refusals_total", &l1_a, "2"),
        ("gpushare_lease_memory_refusals_total", &l1_b, "2"),
        ("gpushare_lease_memory_refusals_total", &l2_b, "0"),
    ] {
        let line = format!("{family}{{{labels}}} {value}");
        assert!(has_sample(&text, &line), "missing {line:?} in\n{text}");
    }
    for (labels, window, value) in [
        (&l1_a, "10s", "0.6"),
        (&l1_a, "1m", "0.3"),
        (&l1_b, "10s", "0.2"),
        (&l1_b, "1m", "0.1"),
    ] {
        let line =
            format!("gpushare_lease_token_share_ratio{{{labels},window=\"{window}\"}} {value}");
        assert!(has_sample(&text, &line), "missing {line:?} in\n{text}");
    }
    for line in [
        format!("gpushare_lease_info{{{l1_a},priority=\"low\"}} 1"),
        format!("gpushare_lease_info{{{l1_b},priority=\"low\"}} 1"),
        format!("gpushare_lease_info{{{l2_b},priority=\"high\"}} 1"),
    ] {
        assert!(has_sample(&text, &line), "missing {line:?} in\n{text}");
    }
    // No token client of l2 came to a token: no share rather than a made-up 0.
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("gpushare_lease_token_share_ratio{lease=\"l2\"")),
        "{text}"
    );
    // One series per lease and GPU in every per-lease family.
    for family in [
        "gpushare_lease_info",
        "gpushare_lease_memory_used_bytes",
        "gpushare_lease_memory_quota_bytes",
        "gpushare_lease_token_time_seconds_total",
        "gpushare_lease_memory_refusals_total",
        "gpushare_lease_token_revocations_total",
        "gpushare_lease_token_cut_offs_total",
        "gpushare_lease_token_overdue_total",
    ] {
        let n = text
            .lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .count();
        assert_eq!(n, 3, "{family}:\n{text}");
    }
}

#[test]
fn a_lease_whose_gpu_is_unknown_keeps_one_series_with_empty_gpu_labels() {
    let mut nowhere = lease("l1", Priority::Low, LeaseState::Reserved, None);
    nowhere.gpus = vec![];
    let report = StatusReport {
        leases: vec![nowhere],
        usage: vec![usage("l1", "c-l1")],
        ..Default::default()
    };
    let text = render(&report, &BTreeMap::new());
    let line = "gpushare_lease_memory_used_bytes{lease=\"l1\",name=\"c-l1\",pod=\"\",namespace=\"\",container=\"\",gpu=\"\",gpu_index=\"\"} 12";
    assert!(has_sample(&text, line), "missing {line:?} in\n{text}");
}

#[test]
fn renders_build_info_utilization_windows_and_rejections() {
    let report = StatusReport {
        gpus: vec![GpuStatus {
            utilization_last_minute: Some(0.5),
            ..idle_gpu(1, "GPU-0")
        }],
        gpu_utilization: vec![gpushare_proto::GpuUtilization {
            uuid: "GPU-0".into(),
            last_10s: Some(0.97),
        }],
        admission_rejections: gpushare_proto::AdmissionRejections { high: 0, low: 2 },
        ..Default::default()
    };
    let text = render(&report, &BTreeMap::new());
    for line in [
        format!("gpushare_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\"}} 1"),
        "gpushare_gpu_utilization_ratio{gpu=\"GPU-0\",gpu_index=\"1\",window=\"1m\"} 0.5".into(),
        "gpushare_gpu_utilization_ratio{gpu=\"GPU-0\",gpu_index=\"1\",window=\"10s\"} 0.97".into(),
        "gpushare_admission_rejections_total{priority=\"low\"} 2".into(),
    ] {
        assert!(has_sample(&text, &line), "missing {line:?} in\n{text}");
    }
    assert!(!COMMIT.is_empty());
}

/// Prometheus's naming rules, which `promtool check metrics` applies: a counter's
/// family ends in `_total`, no family is another's name without its `_total` (a
/// parser that names counters without it would see one family twice), and
/// durations are in seconds.
#[test]
fn family_names_follow_prometheus_conventions() {
    let (report, totals) = full_report();
    let text = render(&report, &totals);
    let families: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let names: std::collections::BTreeSet<&str> = families.iter().map(|(n, _)| *n).collect();
    for (name, kind) in &families {
        assert_eq!(
            kind == &"counter",
            name.ends_with("_total"),
            "{name} is a {kind}"
        );
        if let Some(bare) = name.strip_suffix("_total") {
            assert!(!names.contains(bare), "{name} and {bare} share a family");
        }
        for unit in ["_microseconds", "_milliseconds", "_nanoseconds", "_minutes"] {
            assert!(!name.contains(unit), "{name}: use seconds");
        }
    }
}

#[test]
fn health_fails_on_a_failing_store_or_a_stalled_sampler() {
    for (exposition, want) in [
        (
            "gpushare_store_failing 0\ngpushare_last_sample_age_seconds 2\n",
            Ok(()),
        ),
        ("gpushare_store_failing 0\n", Ok(())),
        ("gpushare_store_failing 1\n", Err("store_failure")),
        (
            "gpushare_store_failing 0\ngpushare_last_sample_age_seconds 31\n",
            Err("sampling_stalled"),
        ),
        (
            "gpushare_token_thread_failed{gpu=\"GPU-0\"} 0\ngpushare_token_thread_failed{gpu=\"GPU-1\"} 0\n",
            Ok(()),
        ),
        (
            "gpushare_token_thread_failed{gpu=\"GPU-0\"} 0\ngpushare_token_thread_failed{gpu=\"GPU-1\"} 1\n",
            Err("token_thread_failed"),
        ),
    ] {
        let got = health_of(exposition);
        match want {
            Ok(()) => assert_eq!(got, Ok(()), "{exposition}"),
            Err(reason) => assert!(
                got.as_ref().is_err_and(|e| e.starts_with(reason)),
                "{exposition}: {got:?}"
            ),
        }
    }
}

#[test]
fn renders_gpus_leases_queue_and_violations() {
    // A histogram never recorded has no counts: zero buckets, not none.
    let (mut report, totals) = full_report();
    report.placement_times.batch_searches = DurationHistogram::default();
    let text = render(&report, &totals);
    for line in [
        "gpushare_gpu_memory_total_bytes{gpu=\"GPU-0\",gpu_index=\"0\"} 100",
        "gpushare_gpu_memory_leased_bytes{gpu=\"GPU-0\",gpu_index=\"0\"} 40",
        "gpushare_gpu_memory_used_bytes{gpu=\"GPU-0\",gpu_index=\"0\"} 30",
        "gpushare_gpu_utilization_ratio{gpu=\"GPU-0\",gpu_index=\"0\",window=\"1m\"} 0.5",
        "gpushare_leases{priority=\"high\",state=\"confirmed\"} 1",
        "gpushare_leases{priority=\"low\",state=\"reserved\"} 1",
        // The Kubernetes labels are empty for a lease without a pod.
        "gpushare_lease_memory_used_bytes{lease=\"l3\",name=\"odd \\\"name\\\" \\\\ with\\nnewline\",pod=\"\",namespace=\"\",container=\"\",gpu=\"GPU-0\",gpu_index=\"0\"} 12",
        "gpushare_queue_length{priority=\"high\"} 0",
        "gpushare_watchdog_current_violations{kind=\"unregistered\"} 1",
        "gpushare_watchdog_violations_total{kind=\"unregistered\"} 3",
        "gpushare_watchdog_violations_total{kind=\"over_quota\"} 0",
        "gpushare_token_grants_total{gpu=\"GPU-0\",gpu_index=\"0\"} 7",
        "gpushare_token_overdue_total{gpu=\"GPU-0\",gpu_index=\"0\"} 2",
        "gpushare_token_overdue_clients{gpu=\"GPU-0\",gpu_index=\"0\"} 1",
        "gpushare_admission_windows_total{gpu=\"GPU-0\",gpu_index=\"0\"} 11",
        "gpushare_admission_early_returns_total{gpu=\"GPU-0\",gpu_index=\"0\"} 3",
        "gpushare_admission_fitted_launches_total{gpu=\"GPU-0\",gpu_index=\"0\"} 40",
        "gpushare_admission_held_back_total{gpu=\"GPU-0\",gpu_index=\"0\"} 5",
        "gpushare_admission_overran_launches_total{gpu=\"GPU-0\",gpu_index=\"0\"} 2",
        "gpushare_admission_overran_seconds_total{gpu=\"GPU-0\",gpu_index=\"0\"} 0.000007",
        "gpushare_gpu_unshareable{gpu=\"GPU-1\",gpu_index=\"1\"} 1",
        "gpushare_gpu_unshareable{gpu=\"GPU-0\",gpu_index=\"0\"} 0",
        "gpushare_lease_connections 5",
        "gpushare_store_failing 1",
        "gpushare_lease_connections_refused_total{reason=\"lease_limit\"} 9744",
        "gpushare_lease_connections_refused_total{reason=\"total_limit\"} 8",
        "gpushare_lease_connections_refused_total{reason=\"peer\"} 2",
        "gpushare_gpu_expected_demand{gpu=\"GPU-0\",gpu_index=\"0\"} 0.75",
        "gpushare_gpu_largest_free_hole_bytes{gpu=\"GPU-0\",gpu_index=\"0\"} 60",
        "gpushare_placement_waits_fragmented_total 4",
        "gpushare_placement_decision_seconds_bucket{le=\"0.000005\"} 1",
        "gpushare_placement_decision_seconds_bucket{le=\"0.000025\"} 1",
        "gpushare_placement_decision_seconds_bucket{le=\"0.00005\"} 3",
        "gpushare_placement_decision_seconds_bucket{le=\"+Inf\"} 5",
        "gpushare_placement_decision_seconds_sum 0.030783",
        "gpushare_placement_decision_seconds_count 5",
        "gpushare_placement_batch_search_seconds_bucket{le=\"+Inf\"} 0",
        "gpushare_placement_batch_search_seconds_count 0",
    ] {
        assert!(has_sample(&text, line), "missing {line:?} in\n{text}");
    }
}

/// A report in which every series the renderer knows has something to show:
/// two GPUs (one drained, one without NVML readings), an unshareable GPU,
/// leases of both priorities and states (one with a pod, one whose container's
/// name needs escaping), usage with and without a token account (token time and shares), every
/// violation kind, a token service with admission counts, refused connections,
/// placement hints, both histograms, grants of every resource and state, a
/// failing store and a queue.
fn full_report() -> (StatusReport, BTreeMap<&'static str, u64>) {
    use gpushare_proto::QueuedRequest;
    use gpushare_types::{GpuSelector, MemoryRequest};
    let counted = |usage: LeaseUsage| LeaseUsage {
        memory_refusals: 3,
        token_revocations: 4,
        token_cut_offs: 1,
        token_overdue: 2,
        ..usage
    };
    let queued = |priority| QueuedRequest {
        container_id: "q".into(),
        priority,
        memory: Some(MemoryRequest::Bytes(1)),
        gpu: GpuSelector::Count(1),
        position: 0,
        waited_ms: 5,
    };
    let gpu = |index, uuid: &str, used, util, drained| GpuStatus {
        index,
        uuid: uuid.into(),
        name: "t".into(),
        memory_total: 100,
        memory_allocatable: 90,
        memory_leased: 40,
        memory_used: used,
        utilization_last_minute: util,
        drained,
        reserved_for: None,
    };
    let violation = |kind| Violation {
        kind,
        gpu: "GPU-0".into(),
        pid: 9,
        lease: None,
        memory_used: 1,
        memory_quota: None,
        killed: false,
    };
    let mut placement_times = gpushare_proto::timing::PlacementTimes::default();
    for us in [3, 40, 40, 700, 30_000] {
        placement_times
            .decisions
            .record(std::time::Duration::from_micros(us));
    }
    placement_times
        .batch_searches
        .record(std::time::Duration::from_micros(9));
    let report = StatusReport {
        gpus: vec![
            gpu(0, "GPU-0", Some(30), Some(0.5), false),
            gpu(2, "GPU-2", None, None, true),
        ],
        leases: vec![
            lease(
                "l1",
                Priority::High,
                LeaseState::Confirmed,
                pod("team-a", "web-0", Some("main")),
            ),
            lease("l2", Priority::Low, LeaseState::Reserved, None),
            lease("l3", Priority::Low, LeaseState::Confirmed, None),
            lease("l4", Priority::High, LeaseState::Reserved, None),
        ],
        driver_cuda_version: None,
        inventory_source: "declared".into(),
        usage: vec![
            counted(LeaseUsage {
                token_time_ms: 12_345,
                token_share_10s: Some(0.61),
                token_share_1m: Some(0.25),
                ..usage("l1", "team-a/web-0/main")
            }),
            counted(usage("l3", "odd \"name\" \\ with\nnewline")),
        ],
        queue: vec![queued(Priority::Low), queued(Priority::Low)],
        violations: vec![
            violation(ViolationKind::Unregistered),
            violation(ViolationKind::OverQuota),
            violation(ViolationKind::OverQuota),
            violation(ViolationKind::Ungated),
        ],
        tokens: vec![gpushare_proto::TokenStatus {
            gpu: "GPU-0".into(),
            policy: "priority".into(),
            clients: 3,
            waiting: 1,
            grants: 7,
            revocations: 6,
            cut_offs: 1,
            overdue: 2,
            overdue_clients: vec![gpushare_proto::TokenHolder {
                lease: LeaseId("l1".into()),
                pid: Some(4),
                priority: Priority::Low,
            }],
            admission: gpushare_proto::AdmissionStatus {
                windows: 11,
                early_returns: 3,
                launches: gpushare_proto::FitCounts {
                    fitted: 40,
                    held_back: 5,
                    overran: 2,
                    overran_ns: 7_000,
                    ..Default::default()
                },
                ..Default::default()
            },
            leases: vec![LeaseTokenAccount {
                cut_offs: 1,
                overdue: 2,
                ..account("l1", 12_345, 0.61, 4)
            }],
            ..Default::default()
        }],
        unshareable: vec![gpushare_proto::UnshareableGpuStatus {
            index: 1,
            uuid: "GPU-1".into(),
            reason: "MIG mode is enabled".into(),
            ..Default::default()
        }],
        connections: gpushare_proto::ConnectionStatus {
            open: 5,
            refused_lease_limit: 9_744,
            refused_total_limit: 8,
            refused_fair_share: 3,
            refused_peer: 2,
            ..Default::default()
        },
        store_failure: Some("disk full".into()),
        grants: vec![
            grant(
                "g-1",
                GrantAmount::Memory { bytes: 1 << 30 },
                Some("GPU-0"),
                Some("l1"),
            ),
            grant("g-2", GrantAmount::Memory { bytes: 2 << 30 }, None, None),
            grant(
                "g-3",
                GrantAmount::Memory { bytes: 1 << 30 },
                Some("GPU-0"),
                None,
            ),
            grant("g-4", GrantAmount::High, Some("GPU-0"), Some("l1")),
            grant("g-5", GrantAmount::High, None, None),
            grant(
                "g-6",
                GrantAmount::Compute { percent: 30 },
                Some("GPU-0"),
                None,
            ),
            grant(
                "g-7",
                GrantAmount::Compute { percent: 20 },
                None,
                Some("l3"),
            ),
        ],
        placement: vec![gpushare_proto::message::GpuPlacementHint {
            uuid: "GPU-0".into(),
            expected_demand: 0.75,
            largest_free_hole: 60,
        }],
        placement_waits_fragmented: 4,
        placement_times,
        gpu_utilization: vec![
            gpushare_proto::GpuUtilization {
                uuid: "GPU-0".into(),
                last_10s: Some(0.97),
            },
            gpushare_proto::GpuUtilization {
                uuid: "GPU-2".into(),
                last_10s: None,
            },
        ],
        admission_rejections: gpushare_proto::AdmissionRejections { high: 1, low: 2 },
        last_sample_age_ms: Some(2_500),
        reclaim: None,
        no_gpus_reason: None,
    };
    let mut totals = BTreeMap::new();
    totals.insert("unregistered", 3);
    totals.insert("ungated", 1);
    (report, totals)
}

/// The samples of an exposition, one canonical line each: name, labels sorted
/// by key (values as escaped on the wire), value as a number; `le` compared as a
/// number too, since formats spell bounds differently (0.0001 or 1e-4). The
/// build's version and commit are replaced by placeholders so the reference
/// holds across builds.
fn samples(exposition: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in exposition.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("a sample line has a value");
        let name = &line[..name_end];
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(inner) = rest.strip_prefix('{') {
            let mut chars = inner.char_indices();
            let mut key = String::new();
            let mut value = String::new();
            let mut in_value = false;
            let mut close = None;
            while let Some((i, c)) = chars.next() {
                match (in_value, c) {
                    (false, '}') => {
                        close = Some(i);
                        break;
                    }
                    (false, '=' | ',') => {}
                    (false, '"') => in_value = true,
                    (false, c) => key.push(c),
                    (true, '\\') => {
                        value.push('\\');
                        value.push(chars.next().expect("an escape has a second character").1);
                    }
                    (true, '"') => {
                        in_value = false;
                        let value = std::mem::take(&mut value);
                        let value = if key == "le" && value != "+Inf" {
                            value.parse::<f64>().expect("le is a number").to_string()
                        } else {
                            value
                        };
                        labels.push((std::mem::take(&mut key), value));
                    }
                    (true, c) => value.push(c),
                }
            }
            rest = &inner[close.expect("labels end with }") + 1..];
        }
        labels.sort();
        let value: f64 = rest.trim().parse().expect("a sample's value is a number");
        let labels: Vec<String> = labels
            .iter()
            .map(|(k, v)| match k.as_str() {
                "version" if v == VERSION => format!("{k}=\"VERSION\""),
                "commit" if v == COMMIT => format!("{k}=\"COMMIT\""),
                _ => format!("{k}=\"{v}\""),
            })
            .collect();
        out.push(format!("{name}{{{}}} {value}", labels.join(",")));
    }
    out.sort();
    out
}

/// The samples of `full_report` (through `samples`): what dashboards and alerts are
/// built on, so a change here is a visible one (a renamed family or label).
const REFERENCE: &str = include_str!("reference_samples.txt");

/// Whether the exposition has the sample `line` (in either format's spelling of
/// numbers).
fn has_sample(exposition: &str, line: &str) -> bool {
    let want = samples(line);
    want.len() == 1 && samples(exposition).contains(&want[0])
}

#[test]
fn full_report_renders_the_reference_samples() {
    let (report, totals) = full_report();
    let text = render(&report, &totals);
    let want: Vec<&str> = REFERENCE.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(samples(&text), want, "{text}");
    // Each family is declared once, and each sample belongs to the family
    // declared last, under a name its type allows.
    let mut declared = std::collections::BTreeSet::new();
    let mut family = ("", "");
    for line in text.lines().filter(|l| !l.starts_with("# HELP ")) {
        if let Some(typed) = line.strip_prefix("# TYPE ") {
            family = typed.split_once(' ').unwrap();
            assert!(declared.insert(family.0), "{} declared twice", family.0);
            continue;
        }
        let name = &line[..line.find(['{', ' ']).unwrap()];
        // Prometheus text 0.0.4: a counter's and an info's family carry their
        // samples' whole name; a histogram's samples add their suffixes.
        let suffixes: &[&str] = match family.1 {
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        assert!(
            suffixes.iter().any(|s| name == format!("{}{s}", family.0)),
            "{line} under {family:?}"
        );
    }
    for line in [
        "# TYPE gpushare_build_info gauge",
        "# TYPE gpushare_lease_token_time_seconds_total counter",
        "# TYPE gpushare_watchdog_violations_total counter",
        "# TYPE gpushare_watchdog_current_violations gauge",
        "# TYPE gpushare_leases gauge",
        "# TYPE gpushare_placement_decision_seconds histogram",
        "# HELP gpushare_gpu_drained 1 when no new leases are placed on the GPU.",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}

#[test]
fn health_reads_the_rendered_exposition() {
    let (mut report, totals) = full_report();
    let verdict = |report: &StatusReport| health_of(&render(report, &totals));
    assert!(verdict(&report).is_err_and(|e| e.starts_with("store_failure")));
    report.store_failure = None;
    assert_eq!(verdict(&report), Ok(()));
    report.last_sample_age_ms = Some(SAMPLE_STALL_MS + 1_000);
    assert!(verdict(&report).is_err_and(|e| e.starts_with("sampling_stalled")));
    report.last_sample_age_ms = None;
    assert_eq!(verdict(&report), Ok(()));
}

/// `serve` on a free local port, answering with `full_report` (whose store
/// is failing, so /healthz says 503).
async fn serve_full_report() -> (tokio::task::JoinHandle<()>, std::net::SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let report = || {
        let (report, totals) = full_report();
        render(&report, &totals)
    };
    (tokio::spawn(serve(listener, report, 64)), address)
}

/// A raw request, and the answer up to the server's close.
async fn ask(address: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection after its answer")
        .unwrap();
    String::from_utf8(answer).unwrap()
}

#[tokio::test]
async fn serves_metrics_health_and_a_404_to_http_1_0_without_host() {
    let (server, address) = serve_full_report().await;
    let metrics = ask(address, "GET /metrics HTTP/1.0\r\n\r\n").await;
    assert!(metrics.starts_with("HTTP/1.0 200 OK\r\n"), "{metrics}");
    assert!(
        metrics
            .to_ascii_lowercase()
            .contains(&format!("\r\ncontent-type: {CONTENT_TYPE}\r\n")),
        "{metrics}"
    );
    let (_, body) = metrics.split_once("\r\n\r\n").unwrap();
    let (report, totals) = full_report();
    assert_eq!(body, render(&report, &totals));
    // What Prometheus sends: HTTP/1.1 with a Host.
    let metrics = ask(
        address,
        "GET /metrics HTTP/1.1\r\nHost: node:9400\r\nAccept: text/plain;version=0.0.4\r\n\r\n",
    )
    .await;
    assert!(metrics.starts_with("HTTP/1.1 200 OK\r\n"), "{metrics}");
    assert!(metrics.ends_with(&render(&report, &totals)), "{metrics}");
    let health = ask(address, "GET /healthz HTTP/1.0\r\n\r\n").await;
    assert!(
        health.starts_with("HTTP/1.0 503 Service Unavailable\r\n")
            && health.ends_with("\r\n\r\nstore_failure: the lease store cannot be written (see gpusharectl status)\n"),
        "{health}"
    );
    let other = ask(address, "GET /nothing HTTP/1.0\r\n\r\n").await;
    assert!(
        other.starts_with("HTTP/1.0 404 Not Found\r\n")
            && other.ends_with("\r\n\r\nnot found: try GET /metrics or GET /healthz\n"),
        "{other}"
    );
    server.abort();
}

#[tokio::test]
async fn a_client_that_never_ends_its_request_is_dropped() {
    let (server, address) = serve_full_report().await;
    let started = std::time::Instant::now();
    let answer = ask(address, "GET /metrics HTTP/1.1\r\nHost: x\r\n").await;
    let took = started.elapsed();
    assert!(!answer.contains("200 OK"), "{answer}");
    assert!(
        took >= HEADER_READ_LIMIT - Duration::from_millis(100)
            && took < HEADER_READ_LIMIT + Duration::from_secs(3),
        "closed after {took:?}"
    );
    server.abort();
}

#[tokio::test]
async fn a_connection_beyond_the_cap_is_answered_503_and_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener, String::new, 1));
    // A client that has not sent its request holds the only place; the
    // backlog is accepted in order, so it is served before the next.
    let holder = tokio::net::TcpStream::connect(address).await.unwrap();
    // Nothing sent: closing a socket with an unread request would reset it
    // and could lose the answer before this test reads it.
    let refused = ask(address, "").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.ends_with("too many metrics connections\n"),
        "{refused}"
    );
    // Its place is free again once it goes.
    drop(holder);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = ask(address, "GET /metrics HTTP/1.0\r\n\r\n").await;
        if answer.contains(" 200 OK") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still refused: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.abort();
}

#[tokio::test]
async fn stopping_the_server_ends_its_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, address) = serve_full_report().await;
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\n")
        .await
        .unwrap();
    // Accepted and being read before the stop.
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.abort();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "still open 2 s after the stop: {read:?} {rest:?}"
    );
}

#[test]
fn label_values_are_escaped() {
    let (report, totals) = full_report();
    let text = render(&report, &totals);
    let line = r#"gpushare_lease_info{lease="l3",name="odd \"name\" \\ with\nnewline",pod="",namespace="",container="",gpu="GPU-0",gpu_index="0",priority="low"} 1"#;
    assert!(
        text.lines().any(|l| l == line),
        "missing {line:?} in\n{text}"
    );
}
