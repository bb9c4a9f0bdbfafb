//! Prometheus text exposition: a pure renderer over the status report, and a
//! tiny HTTP/1.0 responder (`GET /metrics`) for the configured local address.

use std::collections::BTreeMap;
use std::fmt::Write;

use gpushare_proto::grant::{Grant, GrantAmount, PodBinding};
use gpushare_proto::timing::{DurationHistogram, BUCKET_BOUNDS_US};
use gpushare_proto::{LeaseId, LeaseState, Priority, StatusReport, ViolationKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The version and the commit this arbiter was built from (`build.rs`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("GPUSHARE_COMMIT");

/// How long the background loop may go without a GPU sample before `/healthz`
/// fails: it samples every few seconds, so this is many missed rounds.
pub const SAMPLE_STALL_MS: u64 = 30_000;

/// `/healthz`'s verdict, read from the exposition the arbiter just rendered (so a
/// wedged state, whose lock the rendering needs, answers nothing and fails the probe
/// by its timeout): Ok, or why the arbiter is unhealthy.
pub fn health_of(exposition: &str) -> Result<(), String> {
    let value = |name: &str| {
        exposition.lines().find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
    };
    if value("gpushare_store_failing").is_some_and(|v| v > 0.0) {
        return Err(
            "store_failure: the lease store cannot be written (see gpusharectl status)".into(),
        );
    }
    match value("gpushare_last_sample_age_seconds") {
        Some(age) if age * 1000.0 > SAMPLE_STALL_MS as f64 => Err(format!(
            "sampling_stalled: no GPU sample for {age:.0} s (the sampling loop is stuck, or NVML fails for every GPU)"
        )),
        _ => Ok(()),
    }
}

pub fn render(report: &StatusReport, violation_totals: &BTreeMap<&'static str, u64>) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "gpushare_build_info",
        "gauge",
        "Always 1; the arbiter's version and the commit it was built from.",
    );
    let _ = writeln!(
        out,
        "gpushare_build_info{{version=\"{}\",commit=\"{}\"}} 1",
        escape(VERSION),
        escape(COMMIT)
    );
    render_tokens(&mut out, report);
    render_connections(&mut out, report);
    family(
        &mut out,
        "gpushare_gpu_memory_total_bytes",
        "gauge",
        "GPU memory.",
    );
    for g in &report.gpus {
        let _ = writeln!(
            out,
            "gpushare_gpu_memory_total_bytes{{gpu=\"{}\",index=\"{}\"}} {}",
            escape(&g.uuid),
            g.index,
            g.memory_total
        );
    }
    family(
        &mut out,
        "gpushare_gpu_memory_leased_bytes",
        "gauge",
        "Sum of the memory quotas of the leases on the GPU, plus the room of memory grants held there that no lease uses yet.",
    );
    for g in &report.gpus {
        let _ = writeln!(
            out,
            "gpushare_gpu_memory_leased_bytes{{gpu=\"{}\"}} {}",
            escape(&g.uuid),
            g.memory_leased
        );
    }
    family(
        &mut out,
        "gpushare_gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use as NVML reports it.",
    );
    for g in &report.gpus {
        if let Some(used) = g.memory_used {
            let _ = writeln!(
                out,
                "gpushare_gpu_memory_used_bytes{{gpu=\"{}\"}} {used}",
                escape(&g.uuid)
            );
        }
    }
    family(
        &mut out,
        "gpushare_gpu_utilization_ratio",
        "gauge",
        "Mean GPU utilisation over the last minute (0-1).",
    );
    for g in &report.gpus {
        if let Some(u) = g.utilization_last_minute {
            let _ = writeln!(
                out,
                "gpushare_gpu_utilization_ratio{{gpu=\"{}\"}} {u}",
                escape(&g.uuid)
            );
        }
    }
    family(
        &mut out,
        "gpushare_last_sample_age_seconds",
        "gauge",
        "How long ago the background loop last sampled the GPUs.",
    );
    if let Some(ms) = report.last_sample_age_ms {
        let _ = writeln!(
            out,
            "gpushare_last_sample_age_seconds {}",
            ms as f64 / 1000.0
        );
    }
    family(
        &mut out,
        "gpushare_gpu_utilization_10s_ratio",
        "gauge",
        "Mean GPU utilisation over the last 10 s (0-1): follows a change within seconds.",
    );
    for u in &report.gpu_utilization {
        if let Some(ratio) = u.last_10s {
            let _ = writeln!(
                out,
                "gpushare_gpu_utilization_10s_ratio{{gpu=\"{}\"}} {ratio}",
                escape(&u.uuid)
            );
        }
    }
    family(
        &mut out,
        "gpushare_gpu_expected_demand",
        "gauge",
        "Expected GPU demand of the leases on the GPU, in GPUs (measured token time, else the requests, else an assumption by priority).",
    );
    for h in &report.placement {
        let _ = writeln!(
            out,
            "gpushare_gpu_expected_demand{{gpu=\"{}\"}} {}",
            escape(&h.uuid),
            h.expected_demand
        );
    }
    family(
        &mut out,
        "gpushare_gpu_largest_free_hole_bytes",
        "gauge",
        "The largest quota a new lease could get on the GPU now: memory neither promised nor in use.",
    );
    for h in &report.placement {
        let _ = writeln!(
            out,
            "gpushare_gpu_largest_free_hole_bytes{{gpu=\"{}\"}} {}",
            escape(&h.uuid),
            h.largest_free_hole
        );
    }
    family(
        &mut out,
        "gpushare_placement_waits_fragmented_total",
        "counter",
        "Reserves that waited although the free memory of the open GPUs, added up, would have held them.",
    );
    let _ = writeln!(
        out,
        "gpushare_placement_waits_fragmented_total {}",
        report.placement_waits_fragmented
    );
    render_histogram(
        &mut out,
        "gpushare_placement_decision_seconds",
        "Time to place one request with the configured policy (issue 18's bound: 100 µs).",
        &report.placement_times.decisions,
    );
    render_histogram(
        &mut out,
        "gpushare_placement_batch_search_seconds",
        "Time of one batch search over the waiting requests (placement.batch).",
        &report.placement_times.batch_searches,
    );
    family(
        &mut out,
        "gpushare_gpu_drained",
        "gauge",
        "1 when no new leases are placed on the GPU.",
    );
    for g in &report.gpus {
        let _ = writeln!(
            out,
            "gpushare_gpu_drained{{gpu=\"{}\"}} {}",
            escape(&g.uuid),
            u8::from(g.drained)
        );
    }
    family(
        &mut out,
        "gpushare_gpu_unshareable",
        "gauge",
        "1 for a GPU set aside at inventory because gpushare cannot share it (compute mode, MIG, MPS; see gpusharectl status).",
    );
    for u in &report.unshareable {
        let _ = writeln!(
            out,
            "gpushare_gpu_unshareable{{gpu=\"{}\",index=\"{}\"}} 1",
            escape(&u.uuid),
            u.index
        );
    }
    family(
        &mut out,
        "gpushare_leases",
        "gauge",
        "Leases by priority and state.",
    );
    for priority in [Priority::High, Priority::Low] {
        for state in [LeaseState::Reserved, LeaseState::Confirmed] {
            let n = report
                .leases
                .iter()
                .filter(|l| l.priority == priority && l.state == state)
                .count();
            let state = if state == LeaseState::Reserved {
                "reserved"
            } else {
                "confirmed"
            };
            let _ = writeln!(
                out,
                "gpushare_leases{{priority=\"{priority}\",state=\"{state}\"}} {n}"
            );
        }
    }
    family(
        &mut out,
        "gpushare_lease_memory_used_bytes",
        "gauge",
        "GPU memory charged to the lease by its processes.",
    );
    for u in &report.usage {
        let _ = writeln!(
            out,
            "gpushare_lease_memory_used_bytes{{{}}} {}",
            lease_labels(report, &u.lease),
            u.memory_used
        );
    }
    family(
        &mut out,
        "gpushare_lease_memory_quota_bytes",
        "gauge",
        "The lease's memory quota.",
    );
    for u in &report.usage {
        let _ = writeln!(
            out,
            "gpushare_lease_memory_quota_bytes{{{}}} {}",
            lease_labels(report, &u.lease),
            u.memory_quota
        );
    }
    render_lease_time(&mut out, report);
    render_grants(&mut out, report);
    family(
        &mut out,
        "gpushare_admission_rejections_total",
        "counter",
        "Reserves refused after waiting out the admission bound (they never became leases).",
    );
    for (priority, n) in [
        ("high", report.admission_rejections.high),
        ("low", report.admission_rejections.low),
    ] {
        let _ = writeln!(
            out,
            "gpushare_admission_rejections_total{{priority=\"{priority}\"}} {n}"
        );
    }
    family(
        &mut out,
        "gpushare_queue_length",
        "gauge",
        "Requests waiting in the admission queue.",
    );
    for priority in [Priority::High, Priority::Low] {
        let n = report
            .queue
            .iter()
            .filter(|q| q.priority == priority)
            .count();
        let _ = writeln!(out, "gpushare_queue_length{{priority=\"{priority}\"}} {n}");
    }
    family(
        &mut out,
        "gpushare_watchdog_violations",
        "gauge",
        "Violations seen by the watchdog's latest pass.",
    );
    for (kind, name) in [
        (ViolationKind::Unregistered, "unregistered"),
        (ViolationKind::OverQuota, "over_quota"),
        (ViolationKind::Ungated, "ungated"),
    ] {
        let n = report.violations.iter().filter(|v| v.kind == kind).count();
        let _ = writeln!(out, "gpushare_watchdog_violations{{kind=\"{name}\"}} {n}");
    }
    family(
        &mut out,
        "gpushare_watchdog_violations_total",
        "counter",
        "Violations seen by the watchdog, summed over its passes.",
    );
    for name in ["unregistered", "over_quota", "ungated"] {
        let n = violation_totals.get(name).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "gpushare_watchdog_violations_total{{kind=\"{name}\"}} {n}"
        );
    }
    out
}

/// A lease's labels: its id, and its Kubernetes pod and container (empty when the
/// runtime did not say), so dashboards can join on the pod without the lease id.
fn lease_labels(report: &StatusReport, lease: &LeaseId) -> String {
    let pod = report
        .leases
        .iter()
        .find(|l| &l.id == lease)
        .and_then(|l| l.pod.as_ref());
    let part = |f: fn(&PodBinding) -> &Option<String>| {
        escape(pod.and_then(|p| f(p).as_deref()).unwrap_or(""))
    };
    format!(
        "lease=\"{}\",pod_namespace=\"{}\",pod=\"{}\",container=\"{}\"",
        escape(&lease.0),
        part(|p| &p.namespace),
        part(|p| &p.name),
        part(|p| &p.container)
    )
}

/// [`lease_labels`] and `name`: the container's display name (the pod's
/// namespace/name/container, else the container id, shortened as docker shows it),
/// which docker and ctr containers, having no pod, are known by.
fn named_lease_labels(report: &StatusReport, usage: &gpushare_proto::LeaseUsage) -> String {
    format!(
        "{},name=\"{}\"",
        lease_labels(report, &usage.lease),
        escape(&usage.container)
    )
}

/// Per lease: GPU time and recent shares from the token service, and the counts
/// of what was refused or taken from it.
fn render_lease_time(out: &mut String, report: &StatusReport) {
    type Value = fn(&gpushare_proto::LeaseUsage) -> Option<f64>;
    family(
        out,
        "gpushare_lease_info",
        "gauge",
        "Always 1, one per lease: its labels, to join other series on `lease`.",
    );
    for u in &report.usage {
        let priority = report
            .leases
            .iter()
            .find(|l| l.id == u.lease)
            .map_or(String::new(), |l| l.priority.to_string());
        let _ = writeln!(
            out,
            "gpushare_lease_info{{{},priority=\"{priority}\"}} 1",
            named_lease_labels(report, u)
        );
    }
    let series: [(&str, &str, &str, Value); 7] = [
        (
            "gpushare_lease_gpu_time_seconds_total",
            "counter",
            "GPU time the lease's token clients held the token, gone clients included.",
            |u| Some(u.gpu_time_ms as f64 / 1000.0),
        ),
        (
            "gpushare_lease_gpu_share_10s_ratio",
            "gauge",
            "The lease's share of one GPU's time over the last 10 s (0-1).",
            |u| u.gpu_share_10s,
        ),
        (
            "gpushare_lease_gpu_share_1m_ratio",
            "gauge",
            "The lease's share of one GPU's time over the last minute (0-1).",
            |u| u.gpu_share_1m,
        ),
        (
            "gpushare_lease_memory_refusals_total",
            "counter",
            "Allocations refused because they would have passed the lease's memory quota.",
            |u| Some(u.memory_refusals as f64),
        ),
        (
            "gpushare_lease_token_revocations_total",
            "counter",
            "Times the lease's token clients were revoked (a higher-priority job, or the slice ran out).",
            |u| Some(u.token_revocations as f64),
        ),
        (
            "gpushare_lease_token_cut_offs_total",
            "counter",
            "Token clients cut off because the lease ended while they were connected.",
            |u| Some(u.token_cut_offs as f64),
        ),
        (
            "gpushare_lease_token_overdue_total",
            "counter",
            "Times a revoked token client of the lease had not released within scheduler.revoke_grace_ms.",
            |u| Some(u.token_overdue as f64),
        ),
    ];
    for (name, kind, help, value) in series {
        family(out, name, kind, help);
        for u in &report.usage {
            if let Some(v) = value(u) {
                let _ = writeln!(out, "{name}{{{}}} {v}", named_lease_labels(report, u));
            }
        }
    }
}

/// Grants by state and resource: placed (holding room, no lease yet), bound (a
/// live lease uses it) and waiting (a memory grant no GPU could hold yet), and
/// the bytes the waiting ones ask for: a node whose pods wait on fragmentation.
/// A Prometheus histogram: cumulative buckets by upper bound in seconds, `+Inf`,
/// sum and count.
fn render_histogram(out: &mut String, name: &str, help: &str, h: &DurationHistogram) {
    family(out, name, "histogram", help);
    let mut cumulative = 0;
    for (i, bound_us) in BUCKET_BOUNDS_US.iter().enumerate() {
        cumulative += h.counts.get(i).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"{}\"}} {cumulative}",
            *bound_us as f64 / 1e6
        );
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum_ns as f64 / 1e9);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

fn render_grants(out: &mut String, report: &StatusReport) {
    family(
        out,
        "gpushare_grants",
        "gauge",
        "Device-plugin grants by state (placed: room held, no lease yet; bound: a live lease uses it; waiting: no GPU could hold it yet) and resource.",
    );
    let state = |g: &Grant| match (&g.lease, &g.gpu, g.amount) {
        (Some(_), _, _) => "bound",
        (None, None, GrantAmount::Memory { .. }) => "waiting",
        (None, _, _) => "placed",
    };
    for resource in ["memory", "high", "compute"] {
        for s in ["placed", "bound", "waiting"] {
            let n = report
                .grants
                .iter()
                .filter(|g| state(g) == s && crate::grants::resource_name(&g.amount) == resource)
                .count();
            let _ = writeln!(
                out,
                "gpushare_grants{{state=\"{s}\",resource=\"{resource}\"}} {n}"
            );
        }
    }
    family(
        out,
        "gpushare_grants_waiting_memory_bytes",
        "gauge",
        "Memory the waiting grants ask for: their containers cannot start until a GPU has that much room.",
    );
    let waiting: u64 = report
        .grants
        .iter()
        .filter(|g| state(g) == "waiting")
        .map(|g| match g.amount {
            GrantAmount::Memory { bytes } => bytes,
            _ => 0,
        })
        .sum();
    let _ = writeln!(out, "gpushare_grants_waiting_memory_bytes {waiting}");
}

/// Serves `GET /metrics` with whatever `report` returns; anything else is a 404.
/// Each connection gets one answer and is closed (HTTP/1.0), with a bounded
/// request size and time, so a stuck client cannot hold anything.
pub async fn serve<F>(listener: TcpListener, report: F)
where
    F: Fn() -> String + Send + Sync + Clone + 'static,
{
    // The connections are this task's: stopping it ends them too.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let Ok((mut stream, _)) = accepted else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let report = report.clone();
        connections.spawn(async move {
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let line = String::from_utf8_lossy(&request);
            let is = |path: &str| {
                line.starts_with(&format!("GET {path} ")) || line.starts_with(&format!("GET {path}?"))
            };
            let (status, body) = if is("/metrics") {
                ("200 OK", report())
            } else if is("/healthz") {
                match health_of(&report()) {
                    Ok(()) => ("200 OK", "ok\n".to_owned()),
                    Err(why) => ("503 Service Unavailable", format!("{why}\n")),
                }
            } else {
                (
                    "404 Not Found",
                    "not found: try GET /metrics or GET /healthz\n".to_owned(),
                )
            };
            let answer = format!(
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

/// The lease sockets' connections: how many are open, and the refused floods.
fn render_connections(out: &mut String, report: &StatusReport) {
    family(
        out,
        "gpushare_store_failing",
        "gauge",
        "1 while the lease store cannot be written (a full state_dir): new work is refused until it recovers.",
    );
    let _ = writeln!(
        out,
        "gpushare_store_failing {}",
        u8::from(report.store_failure.is_some())
    );
    let c = &report.connections;
    family(
        out,
        "gpushare_lease_connections",
        "gauge",
        "Open lease-socket connections (token connections included).",
    );
    let _ = writeln!(out, "gpushare_lease_connections {}", c.open);
    family(
        out,
        "gpushare_lease_connections_refused_total",
        "counter",
        "Lease-socket connections refused: over the per-lease or node-wide bound, or from a peer outside the lease's container.",
    );
    for (reason, n) in [
        ("lease_limit", c.refused_lease_limit),
        ("total_limit", c.refused_total_limit),
        ("peer", c.refused_peer),
    ] {
        let _ = writeln!(
            out,
            "gpushare_lease_connections_refused_total{{reason=\"{reason}\"}} {n}"
        );
    }
}

/// The time-slice tokens: counters per GPU (only GPUs that had token clients).
fn render_tokens(out: &mut String, report: &StatusReport) {
    type Field = fn(&gpushare_proto::TokenStatus) -> u64;
    let families: [(&str, &str, &str, Field); 13] = [
        (
            "gpushare_token_grants_total",
            "counter",
            "Time-slice token grants.",
            |t| t.grants,
        ),
        (
            "gpushare_token_revocations_total",
            "counter",
            "Time-slice tokens revoked (slice over, or preempted by high priority).",
            |t| t.revocations,
        ),
        (
            "gpushare_token_overdue_total",
            "counter",
            "Revoked clients that had not released within scheduler.revoke_grace_ms (no longer waited for; never cut off).",
            |t| t.overdue,
        ),
        (
            "gpushare_token_overdue_clients",
            "gauge",
            "Revoked clients still draining past scheduler.revoke_grace_ms.",
            |t| t.overdue_clients.len() as u64,
        ),
        (
            "gpushare_token_cut_offs_total",
            "counter",
            "Always 0 (kept for compatibility): nobody is cut off for a slow drain; see gpushare_token_overdue_total.",
            |t| t.cut_offs,
        ),
        (
            "gpushare_token_clients",
            "gauge",
            "Token connections.",
            |t| t.clients as u64,
        ),
        (
            "gpushare_token_waiting",
            "gauge",
            "Token clients waiting for the token.",
            |t| t.waiting as u64,
        ),
        (
            "gpushare_admission_windows_total",
            "counter",
            "Admission windows published to low-priority holders (the time until the high-priority job is expected back).",
            |t| t.admission.windows,
        ),
        (
            "gpushare_admission_early_returns_total",
            "counter",
            "Times the high-priority job came back while a low-priority window was still open (rhythm mis-predictions).",
            |t| t.admission.early_returns,
        ),
        (
            "gpushare_admission_fitted_launches_total",
            "counter",
            "Low-priority launches admitted inside a window.",
            |t| t.admission.launches.fitted,
        ),
        (
            "gpushare_admission_held_back_total",
            "counter",
            "Low-priority launches that waited because their measured duration did not fit the window.",
            |t| t.admission.launches.held_back,
        ),
        (
            "gpushare_admission_overran_launches_total",
            "counter",
            "Admitted launches measured still running after their window's end (duration mis-predictions).",
            |t| t.admission.launches.overran,
        ),
        (
            "gpushare_admission_overran_microseconds_total",
            "counter",
            "Their total time past the window's end, in microseconds.",
            |t| t.admission.launches.overran_ns / 1_000,
        ),
    ];
    for (name, kind, help, field) in families {
        family(out, name, kind, help);
        for t in &report.tokens {
            let _ = writeln!(out, "{name}{{gpu=\"{}\"}} {}", escape(&t.gpu), field(t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{Fraction, GpuStatus, Lease, LeaseId, LeaseUsage, Violation};

    #[test]
    fn renders_grants_and_the_pod_of_each_lease() {
        use gpushare_proto::grant::GrantId;
        use gpushare_proto::{Fraction, Lease, LeaseUsage};
        let grant = |id: &str, amount, gpu: Option<&str>, lease: Option<&str>| Grant {
            id: GrantId(id.into()),
            amount,
            device_ids: vec![id.into()],
            gpu: gpu.map(str::to_owned),
            lease: lease.map(|l| LeaseId(l.into())),
            created_unix_ms: 0,
        };
        let gib = 1u64 << 30;
        let report = StatusReport {
            leases: vec![Lease {
                id: LeaseId("l1".into()),
                container_id: "abc".into(),
                namespace: None,
                sandbox_id: None,
                gpus: vec!["GPU-0".into()],
                priority: Priority::Low,
                memory_bytes: gib,
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                tenant: None,
                state: LeaseState::Confirmed,
                pid: Some(1),
                created_unix_ms: 0,
                pod: Some(PodBinding {
                    namespace: Some("team-a".into()),
                    name: Some("web\"1".into()),
                    container: None,
                    grants: vec![],
                }),
            }],
            usage: vec![LeaseUsage {
                lease: LeaseId("l1".into()),
                memory_used: 5,
                memory_quota: gib,
                clients: vec![],
                cgroup: None,
                container: String::new(),
                gpu_time_ms: 0,
                gpu_share_10s: None,
                gpu_share_1m: None,
                memory_refusals: 0,
                token_revocations: 0,
                token_cut_offs: 0,
                token_overdue: 0,
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
            "gpushare_lease_memory_used_bytes{lease=\"l1\",pod_namespace=\"team-a\",pod=\"web\\\"1\",container=\"\"} 5",
            "gpushare_lease_memory_quota_bytes{lease=\"l1\",pod_namespace=\"team-a\",pod=\"web\\\"1\",container=\"\"} 1073741824",
            "gpushare_grants{state=\"bound\",resource=\"memory\"} 1",
            "gpushare_grants{state=\"waiting\",resource=\"memory\"} 2",
            "gpushare_grants{state=\"placed\",resource=\"memory\"} 1",
            "gpushare_grants{state=\"placed\",resource=\"high\"} 1",
            "gpushare_grants{state=\"waiting\",resource=\"high\"} 0",
            "gpushare_grants{state=\"bound\",resource=\"compute\"} 0",
            "gpushare_grants_waiting_memory_bytes 5368709120",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn renders_build_info_gpu_time_shares_and_refusals_per_lease() {
        let report = StatusReport {
            usage: vec![LeaseUsage {
                lease: LeaseId("l1".into()),
                memory_used: 0,
                memory_quota: 1,
                clients: vec![],
                cgroup: None,
                container: "0123456789ab".into(),
                gpu_time_ms: 12_345,
                gpu_share_10s: Some(0.61),
                gpu_share_1m: None,
                memory_refusals: 3,
                token_revocations: 4,
                token_cut_offs: 1,
                token_overdue: 0,
            }],
            gpu_utilization: vec![gpushare_proto::GpuUtilization {
                uuid: "GPU-0".into(),
                last_10s: Some(0.97),
            }],
            admission_rejections: gpushare_proto::AdmissionRejections { high: 0, low: 2 },
            ..Default::default()
        };
        let text = render(&report, &BTreeMap::new());
        let labels =
            "lease=\"l1\",pod_namespace=\"\",pod=\"\",container=\"\",name=\"0123456789ab\"";
        for line in [
            format!("gpushare_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\"}} 1"),
            format!("gpushare_lease_gpu_time_seconds_total{{{labels}}} 12.345"),
            format!("gpushare_lease_gpu_share_10s_ratio{{{labels}}} 0.61"),
            format!("gpushare_lease_memory_refusals_total{{{labels}}} 3"),
            format!("gpushare_lease_token_revocations_total{{{labels}}} 4"),
            format!("gpushare_lease_token_cut_offs_total{{{labels}}} 1"),
            "gpushare_gpu_utilization_10s_ratio{gpu=\"GPU-0\"} 0.97".into(),
            "gpushare_admission_rejections_total{priority=\"low\"} 2".into(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // No share over a minute yet: no series rather than a made-up 0.
        assert!(
            !text.contains("gpushare_lease_gpu_share_1m_ratio{"),
            "{text}"
        );
        assert!(!COMMIT.is_empty());
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
        let report = StatusReport {
            gpus: vec![GpuStatus {
                index: 0,
                uuid: "GPU-0".into(),
                name: "t".into(),
                memory_total: 100,
                memory_leased: 40,
                memory_used: Some(30),
                utilization_last_minute: Some(0.5),
                drained: false,
                reserved_for: None,
            }],
            leases: vec![Lease {
                id: LeaseId("l1".into()),
                container_id: "c".into(),
                namespace: None,
                sandbox_id: None,
                gpus: vec!["GPU-0".into()],
                priority: Priority::High,
                memory_bytes: 40,
                compute_request: Fraction::ZERO,
                compute_limit: Fraction::ONE,
                tenant: None,
                state: LeaseState::Confirmed,
                pid: Some(1),
                created_unix_ms: 0,
                pod: None,
            }],
            driver_cuda_version: None,
            inventory_source: "declared".into(),
            usage: vec![LeaseUsage {
                lease: LeaseId("l1".into()),
                memory_used: 12,
                memory_quota: 40,
                clients: vec![],
                cgroup: None,
                container: String::new(),
                gpu_time_ms: 0,
                gpu_share_10s: None,
                gpu_share_1m: None,
                memory_refusals: 0,
                token_revocations: 0,
                token_cut_offs: 0,
                token_overdue: 0,
            }],
            queue: vec![],
            violations: vec![Violation {
                kind: ViolationKind::Unregistered,
                gpu: "GPU-0".into(),
                pid: 9,
                lease: None,
                memory_used: 1,
                memory_quota: None,
                killed: false,
            }],
            tokens: vec![gpushare_proto::TokenStatus {
                gpu: "GPU-0".into(),
                policy: "priority".into(),
                grants: 7,
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
                refused_peer: 2,
                ..Default::default()
            },
            store_failure: None,
            grants: Vec::new(),
            placement: vec![gpushare_proto::message::GpuPlacementHint {
                uuid: "GPU-0".into(),
                expected_demand: 0.75,
                largest_free_hole: 60,
            }],
            placement_waits_fragmented: 4,
            placement_times: {
                let mut times = gpushare_proto::timing::PlacementTimes::default();
                times.decisions.record(std::time::Duration::from_micros(3));
                times.decisions.record(std::time::Duration::from_micros(40));
                times
            },
            gpu_utilization: Vec::new(),
            admission_rejections: Default::default(),
            last_sample_age_ms: Some(2_000),
        };
        let mut totals = BTreeMap::new();
        totals.insert("unregistered", 3);
        let text = render(&report, &totals);
        for line in [
            "gpushare_gpu_memory_total_bytes{gpu=\"GPU-0\",index=\"0\"} 100",
            "gpushare_gpu_memory_leased_bytes{gpu=\"GPU-0\"} 40",
            "gpushare_gpu_memory_used_bytes{gpu=\"GPU-0\"} 30",
            "gpushare_gpu_utilization_ratio{gpu=\"GPU-0\"} 0.5",
            "gpushare_leases{priority=\"high\",state=\"confirmed\"} 1",
            "gpushare_leases{priority=\"low\",state=\"reserved\"} 0",
            // Labels added for Kubernetes (issue 17): empty for a lease without a pod.
            "gpushare_lease_memory_used_bytes{lease=\"l1\",pod_namespace=\"\",pod=\"\",container=\"\"} 12",
            "gpushare_queue_length{priority=\"high\"} 0",
            "gpushare_watchdog_violations{kind=\"unregistered\"} 1",
            "gpushare_watchdog_violations_total{kind=\"unregistered\"} 3",
            "gpushare_watchdog_violations_total{kind=\"over_quota\"} 0",
            "gpushare_token_grants_total{gpu=\"GPU-0\"} 7",
            "gpushare_token_cut_offs_total{gpu=\"GPU-0\"} 1",
            "gpushare_token_overdue_total{gpu=\"GPU-0\"} 2",
            "gpushare_token_overdue_clients{gpu=\"GPU-0\"} 1",
            "gpushare_admission_windows_total{gpu=\"GPU-0\"} 11",
            "gpushare_admission_early_returns_total{gpu=\"GPU-0\"} 3",
            "gpushare_admission_fitted_launches_total{gpu=\"GPU-0\"} 40",
            "gpushare_admission_held_back_total{gpu=\"GPU-0\"} 5",
            "gpushare_admission_overran_launches_total{gpu=\"GPU-0\"} 2",
            "gpushare_admission_overran_microseconds_total{gpu=\"GPU-0\"} 7",
            "gpushare_gpu_unshareable{gpu=\"GPU-1\",index=\"1\"} 1",
            "gpushare_lease_connections 5",
            "gpushare_store_failing 0",
            "gpushare_lease_connections_refused_total{reason=\"lease_limit\"} 9744",
            "gpushare_lease_connections_refused_total{reason=\"total_limit\"} 0",
            "gpushare_lease_connections_refused_total{reason=\"peer\"} 2",
            "gpushare_gpu_expected_demand{gpu=\"GPU-0\"} 0.75",
            "gpushare_gpu_largest_free_hole_bytes{gpu=\"GPU-0\"} 60",
            "gpushare_placement_waits_fragmented_total 4",
            "gpushare_placement_decision_seconds_bucket{le=\"0.000005\"} 1",
            "gpushare_placement_decision_seconds_bucket{le=\"0.000025\"} 1",
            "gpushare_placement_decision_seconds_bucket{le=\"0.00005\"} 2",
            "gpushare_placement_decision_seconds_bucket{le=\"+Inf\"} 2",
            "gpushare_placement_decision_seconds_sum 0.000043",
            "gpushare_placement_decision_seconds_count 2",
            "gpushare_placement_batch_search_seconds_bucket{le=\"+Inf\"} 0",
            "gpushare_placement_batch_search_seconds_count 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(escape("a\"b\\c"), "a\\\"b\\\\c");
    }
}
