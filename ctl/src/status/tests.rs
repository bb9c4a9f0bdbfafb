use super::*;
use crate::fixtures::lease;
use gpushare_proto::grant::{GrantId, PodBinding};
use gpushare_proto::{
    AdmissionStatus, FitCounts, GpuUtilization, Priority, QueuedRequest, TokenHolder, TokenStatus,
    UnshareableGpuStatus, Violation, WindowWaiter,
};

use crate::render::WIDTH;

fn gpu(index: u32) -> GpuStatus {
    GpuStatus {
        index,
        uuid: format!("GPU-{index}"),
        name: "sim".into(),
        memory_total: 16 << 30,
        memory_leased: 4 << 30,
        ..Default::default()
    }
}

/// The usage of a lease with `share` of the token over both windows, if any.
fn usage(id: &str, name: &str, used: u64, token_ms: u64, share: Option<f64>) -> LeaseUsage {
    crate::fixtures::usage(id, name, used, token_ms, share.map(|s| (s, s)))
}

/// Two GPUs, a container on each, nothing waiting, nothing wrong.
fn two_gpus() -> StatusReport {
    StatusReport {
        gpus: vec![gpu(0), gpu(1)],
        gpu_utilization: vec![GpuUtilization {
            uuid: "GPU-0".into(),
            last_10s: Some(0.97),
        }],
        leases: vec![
            lease("l-a", "c-a", "GPU-0", Priority::High),
            lease("l-b", "c-b", "GPU-1", Priority::Low),
        ],
        usage: vec![
            usage("l-a", "trainer-a", 1 << 30, 2_100, Some(0.59)),
            usage("l-b", "trainer-b", 512 << 20, 0, None),
        ],
        ..Default::default()
    }
}

fn squeeze(line: &str) -> String {
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn each_gpu_comes_first_with_its_containers_under_it() {
    let text = render(&two_gpus(), false);
    let lines: Vec<String> = text.lines().map(squeeze).collect();
    assert_eq!(
        lines,
        [
            "GPU 0 sim GPU-0",
            "memory 4Gi leased of 16Gi util 10 s 97 %",
            "CONTAINER LEASE PRIORITY MEMORY USED/QUOTA TOKEN TIME TOKEN SHARE 10 s",
            "trainer-a l-a high 1Gi / 4Gi 2.10 s 59 %",
            "GPU 1 sim GPU-1",
            "memory 4Gi leased of 16Gi",
            "CONTAINER LEASE PRIORITY MEMORY USED/QUOTA TOKEN TIME TOKEN SHARE 10 s",
            "trainer-b l-b low 512Mi / 4Gi - -",
            "WAITING: nothing waiting",
            "PROBLEMS: no problems",
        ],
        "{text}"
    );
    // The internals only when asked for.
    for internal in ["DETAILS", "inventory", "token of", "admission"] {
        assert!(!text.contains(internal), "{internal} in\n{text}");
    }
    let verbose = render(&two_gpus(), true);
    assert!(verbose.starts_with(&text), "{verbose}");
    assert!(
        verbose.contains("DETAILS\n  inventory ?  driver CUDA -"),
        "{verbose}"
    );
}

#[test]
fn with_no_gpu_status_says_why() {
    for (reason, want) in [
        (
            Some("arbiter.devices declares none"),
            "NO GPU is shared on this node: arbiter.devices declares none",
        ),
        (
            None,
            "NO GPU is shared on this node: the arbiter did not say why (an older arbiter: see its log)",
        ),
    ] {
        let text = render(
            &StatusReport {
                no_gpus_reason: reason.map(str::to_owned),
                ..Default::default()
            },
            false,
        );
        assert_eq!(text.lines().next(), Some(want), "{text}");
        assert!(text.contains("PROBLEMS: no problems"), "{text}");
    }
}

#[test]
fn what_waits_is_listed_with_why() {
    let mut report = two_gpus();
    report.queue = vec![QueuedRequest {
        container_id: "ab".repeat(32),
        priority: Priority::Low,
        memory: Some("8Gi".parse().unwrap()),
        gpu: gpushare_proto::GpuSelector::Count(1),
        position: 0,
        waited_ms: 3_400,
    }];
    report.grants = vec![Grant {
        id: GrantId("g-2".into()),
        amount: GrantAmount::Memory { bytes: 2 << 30 },
        device_ids: vec!["d".into()],
        gpu: None,
        lease: None,
        created_unix_ms: 0,
    }];
    report.tokens = vec![TokenStatus {
        gpu: "GPU-1".into(),
        admission: AdmissionStatus {
            waiting_for_window: vec![WindowWaiter {
                lease: LeaseId("l-b".into()),
                pid: Some(9),
                need_us: 5_000,
            }],
            ..Default::default()
        },
        ..Default::default()
    }];
    let text = render(&report, false);
    let section: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("WAITING"))
        .take_while(|l| !l.starts_with("PROBLEMS"))
        .collect();
    assert_eq!(
        section,
        [
            "WAITING (3)",
            "  abababababab (low) wants 8Gi on any GPU: no GPU has room for it now; waited 3 s, #1 in the queue",
            "  grant g-2 wants memory 2Gi: no GPU has room for it now",
            "  trainer-b on GPU 1 waits for an admission window: its next launch needs 5000 µs",
        ],
        "{text}"
    );
}

#[test]
fn what_is_wrong_is_listed_with_the_reason() {
    let mut report = two_gpus();
    report.gpus[1].drained = true;
    report.store_failure = Some("writing leases.log: No space left on device".into());
    report.violations = vec![Violation {
        kind: ViolationKind::OverQuota,
        gpu: "GPU-0".into(),
        pid: 42,
        lease: Some(LeaseId("l-a".into())),
        memory_used: 5 << 30,
        memory_quota: Some(4 << 30),
        killed: true,
    }];
    report.tokens = vec![TokenStatus {
        gpu: "GPU-1".into(),
        overdue_clients: vec![TokenHolder {
            lease: LeaseId("l-b".into()),
            pid: Some(9),
            priority: Priority::Low,
        }],
        ..Default::default()
    }];
    report.unshareable = vec![UnshareableGpuStatus {
        index: 2,
        uuid: "GPU-2".into(),
        name: "big".into(),
        memory_total: 80 << 30,
        reason: "MIG mode is enabled; disable it with `nvidia-smi -i GPU-2 -mig 0`".into(),
    }];
    let text = render(&report, false);
    assert!(text.lines().all(|l| l.chars().count() <= WIDTH), "{text}");
    let problems: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("PROBLEMS"))
        .map(squeeze)
        .collect();
    assert_eq!(
        problems,
        [
            "PROBLEMS (5)",
            "STORE FAILING: writing leases.log: No space left on device: new reserves and releases are refused until the lease",
            "store can be written again (free space in arbiter.state_dir); it retries every second",
            "violation on GPU 0: pid 42 of trainer-a holds more memory than its quota: 5Gi of quota 4Gi, killed",
            "overdue on GPU 1: trainer-b (pid 9) was revoked and still runs past scheduler.revoke_grace_ms",
            "GPU 2 (GPU-2) cannot be shared: MIG mode is enabled; disable it with `nvidia-smi -i GPU-2 -mig 0`",
            "GPU 1 is drained: no new leases are placed on it (`gpusharectl undrain 1`)",
        ],
        "{text}"
    );
    assert!(
        text.contains("GPU 1  sim  GPU-1  DRAINED\n  memory 4Gi leased of 16Gi\n"),
        "{text}"
    );
    assert!(
        text.contains("GPU 2  big  GPU-2  NOT SHARED: unshareable (see PROBLEMS)\n  memory 80Gi\n"),
        "{text}"
    );
}

#[test]
fn verbose_shows_admission_windows_and_who_waits_for_one() {
    let token = |admission| TokenStatus {
        gpu: "GPU-0".into(),
        policy: "priority".into(),
        admission,
        ..Default::default()
    };
    let report = |admission| StatusReport {
        tokens: vec![token(admission)],
        ..Default::default()
    };
    let quiet = render(&report(AdmissionStatus::default()), true);
    assert!(!quiet.contains("admission:"), "{quiet}");
    let busy = render(
        &report(AdmissionStatus {
            windows: 12,
            early_returns: 1,
            launches: FitCounts {
                fitted: 40,
                held_back: 3,
                overran: 2,
                overran_ns: 1_500_000,
                ..Default::default()
            },
            waiting_for_window: vec![WindowWaiter {
                lease: LeaseId("l1".into()),
                pid: Some(7),
                need_us: 5_000,
            }],
            ..Default::default()
        }),
        true,
    );
    for line in [
        "admission: windows=12 early_returns=1 fitted=40 held_back=3 overran=2 (1500 µs)",
        "waiting for a window: l1/7 needs 5000 µs",
    ] {
        assert!(busy.contains(line), "{line} in\n{busy}");
    }
    let plain = render(
        &report(AdmissionStatus {
            windows: 12,
            ..Default::default()
        }),
        false,
    );
    assert!(!plain.contains("admission:"), "{plain}");
}

#[test]
fn verbose_shows_grants_and_the_pod_of_each_lease() {
    let grant = |id: &str, amount, gpu: Option<&str>, lease: Option<&str>| Grant {
        id: GrantId(id.into()),
        amount,
        device_ids: vec![format!("d-{id}")],
        gpu: gpu.map(str::to_owned),
        lease: lease.map(|l| LeaseId(l.into())),
        created_unix_ms: 0,
    };
    let mut l1 = lease("l1", "abc", "GPU-0", Priority::Low);
    l1.pod = Some(PodBinding {
        namespace: Some("team-a".into()),
        name: Some("trainer".into()),
        container: Some("main".into()),
        grants: vec![GrantId("g-1".into())],
    });
    let report = StatusReport {
        gpus: vec![gpu(0)],
        leases: vec![l1],
        grants: vec![
            grant(
                "g-1",
                GrantAmount::Memory { bytes: 4 << 30 },
                Some("GPU-0"),
                Some("l1"),
            ),
            grant("g-2", GrantAmount::Memory { bytes: 2 << 30 }, None, None),
            grant("g-3", GrantAmount::Compute { percent: 30 }, None, None),
        ],
        ..Default::default()
    };
    let text = render(&report, true);
    for line in [
        "  team-a/trainer/main          l1                low",
        "clients=- token share 1 min - pod=team-a/trainer/main grants=g-1\n",
        "  grants (3)\n",
        "    g-1 memory 4Gi gpu=GPU-0 lease=l1 devices=d-g-1\n",
        "    g-2 memory 2Gi gpu=waiting lease=- devices=d-g-2\n",
        "    g-3 compute 30% gpu=- lease=- devices=d-g-3\n",
        "  grant g-2 wants memory 2Gi: no GPU has room for it now\n",
    ] {
        assert!(text.contains(line), "{line:?} in\n{text}");
    }
    assert!(!render(&StatusReport::default(), true).contains("grants"));
}

#[test]
fn verbose_shows_each_gpus_demand_largest_hole_and_placement_times() {
    let report = StatusReport {
        gpus: vec![gpu(0), gpu(1)],
        placement: vec![gpushare_proto::message::GpuPlacementHint {
            uuid: "GPU-1".into(),
            expected_demand: 1.25,
            largest_free_hole: 3 << 30,
        }],
        placement_waits_fragmented: 2,
        ..Default::default()
    };
    let text = render(&report, true);
    let line = |start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("{start} in {text}"))
            .to_owned()
    };
    assert!(
        line("  GPU 1 GPU-1").contains("demand 1.25 GPU  largest hole 3Gi"),
        "{text}"
    );
    assert!(!line("  GPU 0 GPU-0").contains("demand"), "{text}");
    assert!(text.contains("2 reserve(s) waited"), "{text}");
    assert!(!render(&report, false).contains("demand"), "{text}");
    let mut timed = StatusReport::default();
    for us in [4, 8] {
        timed
            .placement_times
            .decisions
            .record(std::time::Duration::from_micros(us));
    }
    let text = render(&timed, true);
    assert!(
        text.contains("placement: 2 decisions, mean 6.0µs, p99 ≤ 8.0µs, max 8.0µs"),
        "{text}"
    );
    assert!(!text.contains("batch searches"), "{text}");
    assert!(!render(&timed, false).contains("placement"));
}

#[test]
fn reclaimed_leases_wait_and_the_reclaim_details_are_verbose() {
    let mut report = two_gpus();
    report.reclaim = Some(Box::new(gpushare_proto::ReclaimStatus {
        low_overcommit: 1.5,
        floor_ms: 250,
        checkpoint_gbps: 25.0,
        suspended: vec![gpushare_proto::SuspendedLease {
            lease: "l-b".into(),
            name: "trainer-b".into(),
            gpu: "GPU-1".into(),
            bytes: 3 << 30,
            phase: "suspended".into(),
            since_unix_ms: 1,
        }],
        never_again: vec![("l-b".into(), "the driver cannot checkpoint it".into())],
        recent: vec![gpushare_proto::ReclaimReport {
            lease: "h1".into(),
            gpu: "GPU-1".into(),
            shortfall: 2 << 30,
            bytes: 3 << 30,
            victims: vec!["l-b".into()],
            succeeded: true,
            lock_ms: 4.0,
            checkpoint_ms: 120.0,
            total_ms: 130.0,
            bound_ms: 250.0,
            at_unix_ms: 2,
        }],
        reclaims: 1,
        reclaimed_bytes: 3 << 30,
        ..Default::default()
    }));
    let text = render(&report, false);
    for line in [
        "trainer-b l-b low 512Mi / 4Gi - - suspended",
        "trainer-b on GPU 1: suspended, 3Gi off the GPU until it fits back",
        "memory of trainer-b is never reclaimed again: the driver cannot checkpoint it",
    ] {
        assert!(
            text.lines().any(|l| squeeze(l) == line),
            "{line:?} in\n{text}"
        );
    }
    assert!(!text.contains("MEMORY RECLAIM"), "{text}");
    let verbose = render(&report, true);
    assert!(verbose.contains("MEMORY RECLAIM on"), "{verbose}");
    assert!(
        verbose.contains("in 130 ms (lock 4 ms, checkpoint 120 ms; bound 250 ms)"),
        "{verbose}"
    );
    assert!(
        verbose.lines().all(|l| l.chars().count() <= WIDTH),
        "{verbose}"
    );
}

/// A pod or engine name is whatever its creator wrote: shown, it must not move the
/// cursor, forge a row, nor push a line past the width.
#[test]
fn hostile_and_long_names_stay_inert_and_within_the_width() {
    let mut report = two_gpus();
    report.usage[0].container = format!("evil\x1b[2J\r\nGPU 9 fake \u{9b}31m{}", "x".repeat(200));
    report.gpus[0].name = "n".repeat(300);
    report.no_gpus_reason = Some("never shown: there are GPUs".into());
    for verbose in [false, true] {
        let text = render(&report, verbose);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "{text:?}"
        );
        assert!(!text.lines().any(|l| l.starts_with("GPU 9")), "{text}");
        assert!(text.lines().all(|l| l.chars().count() <= WIDTH), "{text}");
        assert!(!text.contains("never shown"), "{text}");
    }
}

#[test]
fn on_one_gpu_high_priority_containers_come_first_then_by_name() {
    let report = StatusReport {
        gpus: vec![gpu(0)],
        leases: vec![
            lease("l-1", "zeta-low", "GPU-0", Priority::Low),
            lease("l-2", "beta-high", "GPU-0", Priority::High),
            lease("l-3", "alpha-low", "GPU-0", Priority::Low),
        ],
        ..Default::default()
    };
    let text = render(&report, false);
    let order: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|word| word.contains('-'))
        .collect();
    assert_eq!(order, ["beta-high", "alpha-low", "zeta-low"], "{text}");
}
