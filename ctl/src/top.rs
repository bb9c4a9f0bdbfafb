//! `gpusharectl top`: one frame of the live view, a pure function of a status report
//! (the command fetches a report each second and redraws it).

use std::fmt::Write as _;

use gpushare_proto::{ByteSize, Lease, StatusReport};

use crate::render::{container_of, duration, fit, percent, wrap};
use crate::terminal::shown_name;

/// The CONTAINER column, as in `status` and `list`.
const NAME_COLUMN: usize = 28;

/// One frame: per GPU its utilisation (10 s and 1 min), memory, the token's holder
/// and waiters, and a row per container on it (token time, token share of the last
/// 10 s and minute); then the admission queue.
pub fn render_frame(report: &StatusReport) -> String {
    let mut out = format!(
        "gpushare top: {} GPU(s), {} lease(s), {} queued\n",
        report.gpus.len(),
        report.leases.len(),
        report.queue.len()
    );
    if let Some(why) = &report.store_failure {
        let _ = writeln!(out, "STORE FAILING: {}", crate::terminal::shown_text(why));
    }
    if let (true, Some(why)) = (report.gpus.is_empty(), &report.no_gpus_reason) {
        let _ = writeln!(
            out,
            "NO GPU is shared on this node: {}",
            crate::terminal::shown_text(why)
        );
    }
    for g in &report.gpus {
        let short = report
            .gpu_utilization
            .iter()
            .find(|u| u.uuid == g.uuid)
            .and_then(|u| u.last_10s);
        let _ = writeln!(
            out,
            "\nGPU {}  {}  {}{}\n  util 10 s {}  1 min {}   memory used {}  leased {} of {}",
            g.index,
            fit(&shown_name(&g.name), 24),
            shown_name(&g.uuid),
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
            "  {:<NAME_COLUMN$} {:<8}  {:>17}  {:>10}  {:>16}  {:>5}",
            "CONTAINER", "PRIORITY", "MEMORY USED/QUOTA", "TOKEN TIME", "TOKEN SHARE 10 s", "1 min"
        );
        for l in leases {
            let usage = report.usage.iter().find(|u| u.lease == l.id);
            let suspended = report.reclaim.as_ref().and_then(|r| {
                r.suspended
                    .iter()
                    .find(|s| s.lease == l.id.0)
                    .map(|s| format!("  {} (reclaimed)", s.phase))
            });
            let memory = format!(
                "{} / {}",
                ByteSize(usage.map_or(0, |u| u.memory_used)),
                ByteSize(usage.map_or(l.memory_bytes, |u| u.memory_quota))
            );
            let _ = writeln!(
                out,
                "  {:<NAME_COLUMN$} {:<8}  {:>17}  {:>10}  {:>16}  {:>5}{}",
                fit(&container_of(l, usage), NAME_COLUMN),
                l.priority.to_string(),
                memory,
                usage.map_or_else(|| "-".into(), |u| duration(u.token_time_ms)),
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
    wrap(&out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::usage;
    use gpushare_proto::{GpuStatus, GpuUtilization, LeaseId, Priority, TokenHolder, TokenStatus};

    fn lease(id: &str, container_id: &str, priority: Priority) -> Lease {
        crate::fixtures::lease(id, container_id, "GPU-0", priority)
    }

    #[test]
    fn a_frame_shows_each_container_with_memory_token_time_and_token_shares() {
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
        let suspended = render_frame(&reclaimed);
        let row = suspended
            .lines()
            .find(|l| l.trim_start().starts_with("trainer"))
            .unwrap_or_else(|| panic!("trainer in\n{suspended}"));
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>().join(" "),
            "trainer low 2Gi / 4Gi 12.6 min - - suspended (reclaimed)"
        );
        // The token's account is named for what it is, within the width.
        assert!(
            frame.contains("TOKEN TIME  TOKEN SHARE 10 s  1 min") && !frame.contains("GPU TIME"),
            "{frame}"
        );
        assert!(frame
            .lines()
            .all(|l| l.chars().count() <= crate::render::WIDTH));
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
        let none = render_frame(&StatusReport {
            no_gpus_reason: Some("arbiter.devices declares none".into()),
            ..Default::default()
        });
        assert!(
            none.contains("\nNO GPU is shared on this node: arbiter.devices declares none\n"),
            "{none}"
        );
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
}
