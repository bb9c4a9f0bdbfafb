//! `gpusharectl top`: one frame of the live view, a pure function of a status report
//! (the command fetches a report each second and redraws it).

use std::fmt::Write as _;

use gpushare_proto::{ByteSize, Lease, LeaseUsage, StatusReport};

use crate::terminal::shown_name;

/// "61 %", or "-" when unknown.
fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{:.0} %", x * 100.0))
}

/// "1.23 s" below ten seconds (a short job's split must read within 1 %), "12.3 s"
/// below ten minutes, "12.3 min" below ten hours, else "12.3 h".
pub fn gpu_time(ms: u64) -> String {
    let s = ms as f64 / 1000.0;
    if s < 10.0 {
        format!("{s:.2} s")
    } else if s < 600.0 {
        format!("{s:.1} s")
    } else if s < 36_000.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// The name a person knows the lease's container by: the arbiter's display name,
/// else (an older arbiter) the pod or short id worked out here.
/// Made inert for a terminal: the name is whatever the container's creator wrote.
pub fn container_of(lease: &Lease, usage: Option<&LeaseUsage>) -> String {
    let name = usage
        .map(|u| u.container.clone())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| lease.display_name());
    shown_name(&name)
}

/// One frame: per GPU its utilisation (10 s and 1 min), memory, the token's holder
/// and waiters, and a row per lease on it; then the admission queue.
pub fn render_frame(report: &StatusReport) -> String {
    let mut out = format!(
        "gpushare top: {} GPU(s), {} lease(s), {} queued\n",
        report.gpus.len(),
        report.leases.len(),
        report.queue.len()
    );
    if let Some(why) = &report.store_failure {
        let _ = writeln!(out, "STORE FAILING: {why}");
    }
    for g in &report.gpus {
        let short = report
            .gpu_utilization
            .iter()
            .find(|u| u.uuid == g.uuid)
            .and_then(|u| u.last_10s);
        let _ = writeln!(
            out,
            "\nGPU {} {} {}{}\n  util 10 s {}  1 min {}   memory used {}  leased {} of {}",
            g.index,
            g.uuid,
            g.name,
            if g.drained { " (drained)" } else { "" },
            percent(short),
            percent(g.utilization_last_minute),
            g.memory_used
                .map_or_else(|| "-".into(), |b| ByteSize(b).to_string()),
            ByteSize(g.memory_leased),
            ByteSize(g.memory_total),
        );
        let leases: Vec<&Lease> = report
            .leases
            .iter()
            .filter(|l| l.gpus.contains(&g.uuid))
            .collect();
        let name_of = |lease: &gpushare_proto::LeaseId| {
            report.leases.iter().find(|l| &l.id == lease).map_or_else(
                || lease.to_string(),
                |l| container_of(l, report.usage.iter().find(|u| u.lease == l.id)),
            )
        };
        if let Some(t) = report.tokens.iter().find(|t| t.gpu == g.uuid) {
            let holders: Vec<String> = t.holders.iter().map(|h| name_of(&h.lease)).collect();
            let _ = writeln!(
                out,
                "  token ({}): holder {}  waiting {}",
                t.policy,
                if holders.is_empty() {
                    "-".into()
                } else {
                    holders.join(", ")
                },
                t.waiting
            );
        }
        if leases.is_empty() {
            out += "  no leases\n";
            continue;
        }
        let _ = writeln!(
            out,
            "  {:<28} {:<4} {:>21}  {:>9} {:>6} {:>6}",
            "CONTAINER", "PRIO", "MEMORY USED/QUOTA", "GPU TIME", "10 s", "1 min"
        );
        for l in leases {
            let usage = report.usage.iter().find(|u| u.lease == l.id);
            let suspended = report.reclaim.as_ref().and_then(|r| {
                r.suspended
                    .iter()
                    .find(|s| s.lease == l.id.0)
                    .map(|s| format!("  {} (memory reclaimed)", s.phase))
            });
            let memory = format!(
                "{} / {}",
                ByteSize(usage.map_or(0, |u| u.memory_used)),
                ByteSize(usage.map_or(l.memory_bytes, |u| u.memory_quota))
            );
            let _ = writeln!(
                out,
                "  {:<28} {:<4} {:>21}  {:>9} {:>6} {:>6}{}",
                container_of(l, usage),
                l.priority.to_string(),
                memory,
                usage.map_or_else(|| "-".into(), |u| gpu_time(u.token_time_ms)),
                percent(usage.and_then(|u| u.token_share_10s)),
                percent(usage.and_then(|u| u.token_share_1m)),
                suspended.unwrap_or_default(),
            );
        }
    }
    if !report.queue.is_empty() {
        let _ = writeln!(out, "\nQUEUE ({})", report.queue.len());
        for q in &report.queue {
            let _ = writeln!(
                out,
                "  {}. {} {} memory {} waited {} s",
                q.position,
                shown_name(gpushare_proto::lease::short_container_id(&q.container_id)),
                q.priority,
                q.memory.map_or_else(|| "default".into(), |m| m.to_string()),
                q.waited_ms / 1000
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{
        Fraction, GpuStatus, GpuUtilization, LeaseId, LeaseState, Priority, TokenHolder,
        TokenStatus,
    };

    fn lease(id: &str, container_id: &str, priority: Priority) -> Lease {
        Lease {
            id: LeaseId(id.into()),
            container_id: container_id.into(),
            namespace: None,
            sandbox_id: None,
            gpus: vec!["GPU-0".into()],
            priority,
            memory_bytes: 4 << 30,
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ONE,
            tenant: None,
            state: LeaseState::Confirmed,
            pid: None,
            created_unix_ms: 0,
            pod: None,
        }
    }

    fn usage(
        id: &str,
        container: &str,
        used: u64,
        ms: u64,
        shares: Option<(f64, f64)>,
    ) -> LeaseUsage {
        LeaseUsage {
            lease: LeaseId(id.into()),
            memory_used: used,
            memory_quota: 4 << 30,
            clients: vec![],
            cgroup: None,
            container: container.into(),
            token_time_ms: ms,
            token_share_10s: shares.map(|s| s.0),
            token_share_1m: shares.map(|s| s.1),
            memory_refusals: 0,
            token_revocations: 0,
            token_cut_offs: 0,
            token_overdue: 0,
        }
    }

    #[test]
    fn a_frame_shows_each_lease_with_memory_gpu_time_and_shares() {
        let docker_id = "ab".repeat(32);
        let report = StatusReport {
            gpus: vec![GpuStatus {
                index: 0,
                uuid: "GPU-0".into(),
                name: "sim".into(),
                memory_total: 16 << 30,
                memory_leased: 8 << 30,
                memory_used: Some(3 << 30),
                utilization_last_minute: Some(0.4),
                ..Default::default()
            }],
            gpu_utilization: vec![GpuUtilization {
                uuid: "GPU-0".into(),
                last_10s: Some(0.97),
            }],
            leases: vec![
                lease("l1", &docker_id, Priority::High),
                lease("l2", "trainer", Priority::Low),
            ],
            usage: vec![
                usage("l1", "", 1 << 30, 12_345, Some((0.61, 0.48))),
                usage("l2", "trainer", 2 << 30, 754_000, None),
            ],
            tokens: vec![TokenStatus {
                gpu: "GPU-0".into(),
                policy: "priority".into(),
                holders: vec![TokenHolder {
                    lease: LeaseId("l1".into()),
                    pid: Some(7),
                    priority: Priority::High,
                }],
                waiting: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let frame = render_frame(&report);
        assert!(!frame.contains('\x1b'), "no control codes in a frame");
        let row = |name: &str| {
            frame
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("{name} in\n{frame}"))
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            row("abababababab"),
            "abababababab high 1Gi / 4Gi 12.3 s 61 % 48 %"
        );
        assert_eq!(row("trainer"), "trainer low 2Gi / 4Gi 12.6 min - -");
        let mut reclaimed = report.clone();
        reclaimed.reclaim = Some(Box::new(gpushare_proto::ReclaimStatus {
            suspended: vec![gpushare_proto::SuspendedLease {
                lease: "l2".into(),
                phase: "suspended".into(),
                ..Default::default()
            }],
            ..Default::default()
        }));
        let frame = render_frame(&reclaimed);
        assert!(
            frame.contains("12.6 min      -      -  suspended (memory reclaimed)"),
            "{frame}"
        );
        for line in [
            "gpushare top: 1 GPU(s), 2 lease(s), 0 queued",
            "util 10 s 97 %  1 min 40 %   memory used 3Gi  leased 8Gi of 16Gi",
            "token (priority): holder abababababab  waiting 1",
        ] {
            assert!(frame.contains(line), "{line:?} in\n{frame}");
        }
        let empty = render_frame(&StatusReport {
            gpus: report.gpus.clone(),
            ..Default::default()
        });
        assert!(empty.contains("  no leases\n"), "{empty}");
        assert!(!empty.contains("QUEUE"), "{empty}");
    }

    /// A pod or engine name is whatever its creator wrote: shown, it must not move
    /// the cursor, retitle the terminal or forge a row of its own.
    #[test]
    fn names_with_terminal_escapes_and_newlines_are_shown_inert() {
        let hostile = "evil\x1b[2J\x1b]0;owned\x07\r\nGPU 9 fake \u{9b}31m";
        let mut pod_lease = lease("l1", "c1", Priority::Low);
        pod_lease.pod = Some(gpushare_proto::grant::PodBinding {
            namespace: Some("ns".into()),
            name: Some(hostile.into()),
            container: Some("main".into()),
            grants: vec![],
        });
        let report = StatusReport {
            gpus: vec![GpuStatus {
                uuid: "GPU-0".into(),
                ..Default::default()
            }],
            leases: vec![pod_lease, lease("l2", "c2", Priority::Low)],
            // l2: the name the arbiter worked out (an engine's); l1: none, so the pod's.
            usage: vec![usage("l2", hostile, 0, 0, None)],
            ..Default::default()
        };
        let frame = render_frame(&report);
        assert!(
            !frame.chars().any(|c| c.is_control() && c != '\n'),
            "{frame:?}"
        );
        assert!(!frame.lines().any(|l| l.starts_with("GPU 9")), "{frame}");
        assert_eq!(frame.matches("evil").count(), 2, "{frame}");
    }

    #[test]
    fn gpu_time_reads_in_the_unit_that_fits() {
        for (ms, want) in [
            (0, "0.00 s"),
            (1_949, "1.95 s"),
            (9_994, "9.99 s"),
            (12_345, "12.3 s"),
            (599_949, "599.9 s"),
            (600_000, "10.0 min"),
            (36_000_000, "10.0 h"),
        ] {
            assert_eq!(gpu_time(ms), want);
        }
    }
}
