//! `gpusharectl status`: a pure function of a status report, answering an operator's
//! questions in their order: which containers are on which GPU getting what (memory,
//! token time, token share), what is waiting and why, what is wrong. The scheduler's
//! internals (placement, admission windows, reclaim totals, token counters) follow only
//! with `--verbose`. Every line fits [`WIDTH`](crate::render::WIDTH) columns.

use std::fmt::Write as _;

use gpushare_proto::grant::{Grant, GrantAmount};
use gpushare_proto::{
    ByteSize, GpuStatus, Lease, LeaseId, LeaseState, LeaseUsage, StatusReport, ViolationKind,
};

use crate::render::{container_of, duration, fit, percent, wrap};
use crate::terminal::{shown_name, shown_text};

/// The CONTAINER column: a pod's `namespace/name/container` mostly fits; a longer name
/// is cut with '…' (the whole name is in `--json`).
const NAME_COLUMN: usize = 28;

/// Who the report calls what: GPUs by index, leases by their container's name.
struct Names<'a> {
    report: &'a StatusReport,
}

impl Names<'_> {
    fn usage(&self, lease: &LeaseId) -> Option<&LeaseUsage> {
        self.report.usage.iter().find(|u| &u.lease == lease)
    }

    /// The container's name, or the lease id when the lease is gone from the report.
    fn lease(&self, lease: &LeaseId) -> String {
        self.report
            .leases
            .iter()
            .find(|l| &l.id == lease)
            .map_or_else(|| lease.to_string(), |l| container_of(l, self.usage(lease)))
    }

    /// "GPU 1" for a GPU of the report (shared or set aside), else its short UUID.
    fn gpu(&self, uuid: &str) -> String {
        let shared = self.report.gpus.iter().find(|g| g.uuid == uuid);
        let set_aside = self.report.unshareable.iter().find(|u| u.uuid == uuid);
        match (shared.map(|g| g.index), set_aside.map(|u| u.index)) {
            (Some(index), _) | (None, Some(index)) => format!("GPU {index}"),
            (None, None) => shown_name(uuid),
        }
    }
}

/// The whole `status` text; `verbose` adds the internals.
pub fn render(report: &StatusReport, verbose: bool) -> String {
    let names = Names { report };
    let mut out = gpus(report, &names);
    out += &waiting(report, &names);
    out += &problems(report, &names);
    if verbose {
        out += &details(report, &names);
    }
    wrap(&out)
}

/// Each GPU with its containers under it; with no GPU, why.
fn gpus(report: &StatusReport, names: &Names) -> String {
    let mut out = String::new();
    if report.gpus.is_empty() {
        let why = report.no_gpus_reason.as_deref().map_or_else(
            || "the arbiter did not say why (an older arbiter: see its log)".to_owned(),
            shown_text,
        );
        let _ = writeln!(out, "NO GPU is shared on this node: {why}");
    }
    for g in &report.gpus {
        out += &gpu_line(report, g);
        let mut leases: Vec<&Lease> = report
            .leases
            .iter()
            .filter(|l| l.gpus.contains(&g.uuid))
            .collect();
        // The containers that take the GPU first come first, then by name.
        leases.sort_by_key(|l| (std::cmp::Reverse(l.priority), l.display_name()));
        out += &container_rows(report, names, &leases);
    }
    for u in &report.unshareable {
        let _ = writeln!(
            out,
            "GPU {}  {}  {}  NOT SHARED: unshareable (see PROBLEMS)\n  memory {}",
            u.index,
            fit(&shown_name(&u.name), 24),
            shown_name(&u.uuid),
            ByteSize(u.memory_total)
        );
    }
    // A lease naming no GPU of the report (its GPU left the inventory): still shown.
    let elsewhere: Vec<&Lease> = report
        .leases
        .iter()
        .filter(|l| {
            !l.gpus
                .iter()
                .any(|u| report.gpus.iter().any(|g| &g.uuid == u))
        })
        .collect();
    if !elsewhere.is_empty() {
        out += "ON NO GPU OF THIS REPORT\n";
        out += &container_rows(report, names, &elsewhere);
    }
    out
}

/// "GPU 0  NVIDIA H100  GPU-5a3b2c1d-…  DRAINED", then "  memory 3Gi used, 8Gi leased of
/// 79Gi  util 10 s 97 %". The whole UUID: it is what `nvidia-smi -L` prints and what
/// `arbiter.shared_gpus` and `drain` take, and GPUs of one node may share its first digits.
fn gpu_line(report: &StatusReport, g: &GpuStatus) -> String {
    let allocatable = match g.memory_allocatable {
        0 => g.memory_total,
        a => a,
    };
    let used = g
        .memory_used
        .map(|b| format!("{} used, ", ByteSize(b)))
        .unwrap_or_default();
    let util = report
        .gpu_utilization
        .iter()
        .find(|u| u.uuid == g.uuid)
        .and_then(|u| u.last_10s);
    let mut flags = Vec::new();
    if g.drained {
        flags.push("DRAINED".to_owned());
    }
    if let Some(tenant) = &g.reserved_for {
        flags.push(format!("reserved for {}", shown_name(tenant)));
    }
    format!(
        "GPU {}  {}  {}{}\n  memory {used}{} leased of {}{}\n",
        g.index,
        fit(&shown_name(&g.name), 24),
        shown_name(&g.uuid),
        if flags.is_empty() {
            String::new()
        } else {
            format!("  {}", flags.join(", "))
        },
        ByteSize(g.memory_leased),
        ByteSize(allocatable),
        util.map(|u| format!("  util 10 s {}", percent(Some(u))))
            .unwrap_or_default(),
    )
}

/// The table of `leases` (under a GPU): name, lease id, priority, memory used of its
/// quota, token time and token share of the last 10 s.
fn container_rows(report: &StatusReport, names: &Names, leases: &[&Lease]) -> String {
    if leases.is_empty() {
        return "  no containers\n".into();
    }
    let mut out = format!(
        "  {:<NAME_COLUMN$} {:<16}  {:<8}  {:>17}  {:>10}  {:>16}\n",
        "CONTAINER", "LEASE", "PRIORITY", "MEMORY USED/QUOTA", "TOKEN TIME", "TOKEN SHARE 10 s"
    );
    for l in leases {
        let usage = names.usage(&l.id);
        let memory = format!(
            "{} / {}",
            ByteSize(usage.map_or(0, |u| u.memory_used)),
            ByteSize(usage.map_or(l.memory_bytes, |u| u.memory_quota))
        );
        // Token time is only known for a lease that had token clients.
        let (time, share) = match usage.filter(|u| u.token_share_10s.is_some()) {
            Some(u) => (duration(u.token_time_ms), percent(u.token_share_10s)),
            None => ("-".into(), "-".into()),
        };
        let mut notes = Vec::new();
        if l.state != LeaseState::Confirmed {
            notes.push(format!("{:?}", l.state).to_lowercase());
        }
        if let Some(s) = report
            .reclaim
            .as_ref()
            .and_then(|r| r.suspended.iter().find(|s| s.lease == l.id.0))
        {
            // Why is under WAITING.
            notes.push(s.phase.clone());
        }
        let _ = writeln!(
            out,
            "  {:<NAME_COLUMN$} {:<16}  {:<8}  {:>17}  {:>10}  {:>16}{}",
            fit(&container_of(l, usage), NAME_COLUMN),
            fit(&l.id.to_string(), 16),
            l.priority.to_string(),
            memory,
            time,
            share,
            if notes.is_empty() {
                String::new()
            } else {
                format!("  {}", notes.join(", "))
            }
        );
    }
    out
}

/// What waits and why: reserves in the admission queue, grants with no GPU yet,
/// launches waiting for an admission window, leases whose memory was reclaimed.
fn waiting(report: &StatusReport, names: &Names) -> String {
    let mut lines = Vec::new();
    for q in &report.queue {
        lines.push(format!(
            "{} ({}) wants {} on {}: no GPU has room for it now; waited {} s, #{} in the queue",
            shown_name(gpushare_proto::lease::short_container_id(&q.container_id)),
            q.priority,
            q.memory
                .map_or_else(|| "the default memory".into(), |m| m.to_string()),
            wanted_gpus(&q.gpu),
            q.waited_ms / 1000,
            q.position + 1
        ));
    }
    for g in &report.grants {
        if g.gpu.is_none() && matches!(g.amount, GrantAmount::Memory { .. }) {
            lines.push(format!(
                "grant {} wants {}: no GPU has room for it now",
                shown_name(&g.id.0),
                grant_amount(g)
            ));
        }
    }
    for t in &report.tokens {
        for w in &t.admission.waiting_for_window {
            lines.push(format!(
                "{} on {} waits for an admission window: its next launch needs {} µs",
                names.lease(&w.lease),
                names.gpu(&t.gpu),
                w.need_us
            ));
        }
    }
    if let Some(r) = &report.reclaim {
        for s in &r.suspended {
            let name = if s.name.is_empty() { &s.lease } else { &s.name };
            lines.push(format!(
                "{} on {}: {}, {} off the GPU until it fits back",
                shown_name(name),
                names.gpu(&s.gpu),
                s.phase,
                ByteSize(s.bytes)
            ));
        }
    }
    section("WAITING", "nothing waiting", &lines)
}

/// What is wrong: the store, the watchdog's findings, overdue holders, GPUs that take
/// no new leases and why, memory reclaim in trouble, failed token threads.
fn problems(report: &StatusReport, names: &Names) -> String {
    let mut lines = Vec::new();
    if let Some(why) = &report.store_failure {
        lines.push(format!(
            "STORE FAILING: {}: new reserves and releases are refused until the lease store can \
             be written again (free space in arbiter.state_dir); it retries every second",
            shown_text(why)
        ));
    }
    for v in &report.violations {
        let whose = v
            .lease
            .as_ref()
            .map(|l| format!(" of {}", names.lease(l)))
            .unwrap_or_default();
        let what = match v.kind {
            ViolationKind::Unregistered => "uses the GPU without a lease (bypassed gpushare)",
            ViolationKind::OverQuota => "holds more memory than its quota",
            ViolationKind::Ungated => "ran on the GPU without holding the token",
            ViolationKind::Overrun => "kept running past the revoke grace beside a high job",
            ViolationKind::ShiftedClock => "runs in a time namespace of its own",
        };
        lines.push(format!(
            "violation on {}: pid {}{whose} {what}: {}{}{}",
            names.gpu(&v.gpu),
            v.pid,
            ByteSize(v.memory_used),
            v.memory_quota
                .map(|q| format!(" of quota {}", ByteSize(q)))
                .unwrap_or_default(),
            if v.killed { ", killed" } else { "" }
        ));
    }
    for t in &report.tokens {
        for h in &t.overdue_clients {
            // Revoked and still draining past scheduler.revoke_grace_ms: a long kernel or
            // graph, or a stuck agent. Not waited for; scheduled again once released.
            lines.push(format!(
                "overdue on {}: {} (pid {}) was revoked and still runs past scheduler.revoke_grace_ms",
                names.gpu(&t.gpu),
                names.lease(&h.lease),
                h.pid.map_or_else(|| "-".into(), |p| p.to_string())
            ));
        }
        if t.thread_failed_recently {
            lines.push(format!(
                "the token thread of {} failed within the last minute and was restarted \
                 ({} restart(s) in all)",
                names.gpu(&t.gpu),
                t.thread_restarts
            ));
        }
    }
    for u in &report.unshareable {
        lines.push(format!(
            "GPU {} ({}) cannot be shared: {}",
            u.index,
            shown_name(&u.uuid),
            shown_text(&u.reason)
        ));
    }
    for g in report.gpus.iter().filter(|g| g.drained) {
        lines.push(format!(
            "GPU {} is drained: no new leases are placed on it (`gpusharectl undrain {}`)",
            g.index, g.index
        ));
    }
    if let Some(r) = &report.reclaim {
        if r.reclaims_failed > 0 {
            lines.push(format!(
                "memory reclaim failed {} of {} time(s)",
                r.reclaims_failed, r.reclaims
            ));
        }
        for (lease, why) in &r.never_again {
            lines.push(format!(
                "memory of {} is never reclaimed again: {}",
                names.lease(&LeaseId(lease.clone())),
                shown_text(why)
            ));
        }
    }
    section("PROBLEMS", "no problems", &lines)
}

/// "TITLE\n  line\n…", or "TITLE: empty\n".
fn section(title: &str, empty: &str, lines: &[String]) -> String {
    if lines.is_empty() {
        return format!("{title}: {empty}\n");
    }
    let mut out = format!("{title} ({})\n", lines.len());
    for line in lines {
        let _ = writeln!(out, "  {line}");
    }
    out
}

/// "any 2 GPUs", "GPU 0,1", "GPU-5a3b2c1d": the GPUs a queued request asked for.
fn wanted_gpus(selector: &gpushare_proto::GpuSelector) -> String {
    use gpushare_proto::GpuSelector;
    match selector {
        GpuSelector::Count(1) => "any GPU".into(),
        GpuSelector::Count(n) => format!("any {n} GPUs"),
        GpuSelector::Index(indices) => format!(
            "GPU {}",
            indices
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
        GpuSelector::Uuid(uuids) => uuids
            .iter()
            .map(|u| shown_name(u))
            .collect::<Vec<_>>()
            .join(","),
    }
}

fn grant_amount(g: &Grant) -> String {
    match g.amount {
        GrantAmount::Memory { bytes } => format!("memory {}", ByteSize(bytes)),
        GrantAmount::High => "high".into(),
        GrantAmount::Compute { percent } => format!("compute {percent}%"),
    }
}

/// `--verbose`: the inventory, each GPU's placement hints, the leases' processes and
/// pods, every grant, the tokens' counters and admission windows, memory reclaim.
fn details(report: &StatusReport, names: &Names) -> String {
    let mut out = format!(
        "DETAILS\n  inventory {}  driver CUDA {}  last GPU sample {}\n",
        if report.inventory_source.is_empty() {
            "?"
        } else {
            &report.inventory_source
        },
        report
            .driver_cuda_version
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_else(|| "-".into()),
        report
            .last_sample_age_ms
            .map_or_else(|| "-".into(), |ms| format!("{} ago", duration(ms)))
    );
    for g in &report.gpus {
        // Rebalancing hints (balanced placement): absent from an older arbiter's report.
        let hint = report
            .placement
            .iter()
            .find(|h| h.uuid == g.uuid)
            .map(|h| {
                format!(
                    "  demand {:.2} GPU  largest hole {}",
                    h.expected_demand,
                    ByteSize(h.largest_free_hole)
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  GPU {} {}  {}  util 1 min {}{hint}",
            g.index,
            shown_name(&g.uuid),
            capacity(g),
            percent(g.utilization_last_minute),
        );
    }
    if report.placement_waits_fragmented > 0 {
        let _ = writeln!(
            out,
            "  {} reserve(s) waited although the GPUs' free memory added up would have held them \
             (fragmented: moving a lease would open a hole)",
            report.placement_waits_fragmented
        );
    }
    for (what, h) in [
        ("decisions", &report.placement_times.decisions),
        ("batch searches", &report.placement_times.batch_searches),
    ] {
        if let (Some(mean), Some(p99)) = (h.mean(), h.quantile_bound(0.99)) {
            let _ = writeln!(
                out,
                "  placement: {} {what}, mean {mean:.1?}, p99 ≤ {p99:.1?}, max {:.1?}",
                h.count,
                std::time::Duration::from_nanos(h.max_ns)
            );
        }
    }
    let rejected = &report.admission_rejections;
    if rejected.high + rejected.low > 0 {
        let _ = writeln!(
            out,
            "  reserves refused after waiting out the admission bound: {} high, {} low",
            rejected.high, rejected.low
        );
    }
    for l in &report.leases {
        let usage = names.usage(&l.id);
        let _ = writeln!(
            out,
            "  lease {} {}: state={:?} pid={} clients={} token share 1 min {}{}",
            l.id,
            container_of(l, usage),
            l.state,
            l.pid.map_or_else(|| "-".into(), |p| p.to_string()),
            usage
                .map(|u| u
                    .clients
                    .iter()
                    .map(|c| c.pid.to_string())
                    .collect::<Vec<_>>()
                    .join(","))
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".into()),
            percent(usage.and_then(|u| u.token_share_1m)),
            pod_of(l)
        );
    }
    if !report.grants.is_empty() {
        let _ = writeln!(out, "  grants ({})", report.grants.len());
        for g in &report.grants {
            let gpu = match (&g.gpu, g.amount) {
                (Some(gpu), _) => shown_name(gpu),
                (None, GrantAmount::Memory { .. }) => "waiting".into(),
                (None, _) => "-".into(),
            };
            let _ = writeln!(
                out,
                "    {} {} gpu={gpu} lease={} devices={}",
                shown_name(&g.id.0),
                grant_amount(g),
                g.lease.as_ref().map(|l| l.0.as_str()).unwrap_or("-"),
                shown_name(&g.device_ids.join(","))
            );
        }
    }
    for t in &report.tokens {
        out += &token_details(t, names);
    }
    if let Some(r) = &report.reclaim {
        out += &reclaim_details(r);
    }
    out
}

/// One GPU's token: policy, holders, counters, admission windows and overruns.
fn token_details(t: &gpushare_proto::TokenStatus, names: &Names) -> String {
    let holders: Vec<String> = t
        .holders
        .iter()
        .map(|h| {
            let pid = h.pid.map_or_else(|| "-".into(), |p| p.to_string());
            format!("{}/{pid}({})", names.lease(&h.lease), h.priority)
        })
        .collect();
    let mut out = format!(
        "  token of {}: policy={} holder={} clients={} waiting={} grants={} revocations={} overdue={}\n",
        names.gpu(&t.gpu),
        t.policy,
        if holders.is_empty() {
            "-".into()
        } else {
            holders.join(",")
        },
        t.clients,
        t.waiting,
        t.grants,
        t.revocations,
        t.overdue
    );
    let a = &t.admission;
    if a.windows > 0 || a.launches.fitted > 0 || !a.waiting_for_window.is_empty() {
        // Duration-aware admission: low work admitted only when it fits before the
        // high-priority job is expected back; mis-predictions counted both ways.
        let _ = writeln!(
            out,
            "    admission: windows={} early_returns={} fitted={} held_back={} overran={} ({} µs)",
            a.windows,
            a.early_returns,
            a.launches.fitted,
            a.launches.held_back,
            a.launches.overran,
            a.launches.overran_ns / 1_000
        );
        for w in &a.waiting_for_window {
            let pid = w.pid.map_or_else(|| "-".into(), |p| p.to_string());
            let _ = writeln!(
                out,
                "    waiting for a window: {}/{pid} needs {} µs",
                w.lease, w.need_us
            );
        }
    }
    if a.measured_overruns > 0 {
        // Measured by the arbiter, whatever the interposers reported above.
        let penalised: Vec<String> = a.penalized_leases.iter().map(|l| names.lease(l)).collect();
        let _ = writeln!(
            out,
            "    overruns: {} ({} ms past the grace); penalised now: {}",
            a.measured_overruns,
            a.measured_overrun_ms,
            if penalised.is_empty() {
                "-".to_string()
            } else {
                penalised.join(",")
            }
        );
    }
    out
}

/// Memory reclaim: the bound, the totals and the last reclaim against its bound.
fn reclaim_details(r: &gpushare_proto::ReclaimStatus) -> String {
    let mut out = format!(
        "  MEMORY RECLAIM on: low-priority quotas up to {:.2}x what guaranteed leases leave; \
         bound max({} ms, 1.5 x bytes / {} GB/s)\n",
        r.low_overcommit, r.floor_ms, r.checkpoint_gbps
    );
    let _ = writeln!(
        out,
        "    reclaims {} ({} failed), freed {}, restores {}",
        r.reclaims,
        r.reclaims_failed,
        ByteSize(r.reclaimed_bytes),
        r.restores
    );
    if let Some(last) = r.recent.last() {
        let _ = writeln!(
            out,
            "    last: {} needed {} more on {}: {} from {} lease(s) in {:.0} ms (lock {:.0} ms, \
             checkpoint {:.0} ms; bound {:.0} ms){}",
            last.lease,
            ByteSize(last.shortfall),
            shown_name(&last.gpu),
            ByteSize(last.bytes),
            last.victims.len(),
            last.total_ms,
            last.lock_ms,
            last.checkpoint_ms,
            last.bound_ms,
            if last.succeeded { "" } else { ", refused" }
        );
    }
    out
}

/// What leases are placed within, with NVML's total beside it where the driver reserves
/// part of it ("79.1 GiB allocatable of 79.6 GiB").
fn capacity(g: &GpuStatus) -> String {
    match g.memory_allocatable {
        0 => ByteSize(g.memory_total).to_string(),
        a if a == g.memory_total => ByteSize(a).to_string(),
        a => format!(
            "{} allocatable of {}",
            ByteSize(a),
            ByteSize(g.memory_total)
        ),
    }
}

/// " pod=namespace/name/container grants=…" for a Kubernetes container's lease;
/// "-" stands for what the runtime did not know.
pub fn pod_of(lease: &Lease) -> String {
    let Some(pod) = &lease.pod else {
        return String::new();
    };
    let part = |p: &Option<String>| p.as_deref().map_or_else(|| "-".into(), shown_name);
    let mut out = format!(
        " pod={}/{}/{}",
        part(&pod.namespace),
        part(&pod.name),
        part(&pod.container)
    );
    if !pod.grants.is_empty() {
        let ids: Vec<String> = pod.grants.iter().map(|g| shown_name(&g.0)).collect();
        out += &format!(" grants={}", ids.join(","));
    }
    out
}

#[cfg(test)]
mod tests;
