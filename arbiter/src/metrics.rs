//! The metrics endpoint: the Prometheus text exposition of the status report, written
//! by `prometheus-client` (a pure function of the report, built afresh for each
//! scrape), and served with `/healthz` by axum over hyper on the configured local
//! address.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use gpushare_proto::grant::{Grant, GrantAmount, PodBinding};
use gpushare_proto::timing::{DurationHistogram, BUCKET_BOUNDS_US};
use gpushare_proto::{LeaseId, LeaseState, Priority, StatusReport, ViolationKind};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;

use crate::connections::{say_and_close, AcceptFailures};

/// The version and the commit this arbiter was built from (`build.rs`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("GPUSHARE_COMMIT");

/// What `prometheus_client::encoding::prometheus_text` writes: Prometheus's text format
/// 0.0.4, which every Prometheus scrapes. Not OpenMetrics: there a counter's family is
/// named without `_total`, and `gpushare_watchdog_violations_total` would then clash
/// with the gauge `gpushare_watchdog_violations` (a strict parser refuses the scrape);
/// 0.0.4 also keeps the `# TYPE` lines dashboards and alerts were written against.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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
    // Labelled per GPU: any GPU's series at 1.
    let token_thread_failed = exposition.lines().any(|l| {
        l.starts_with("gpushare_token_thread_failed{")
            && l.rsplit(' ')
                .next()
                .and_then(|v| v.trim().parse::<f64>().ok())
                > Some(0.0)
    });
    if token_thread_failed {
        return Err("token_thread_failed: a GPU's time-slice token thread panicked within the last minute and was restarted (see the arbiter's log)".into());
    }
    match value("gpushare_last_sample_age_seconds") {
        Some(age) if age * 1000.0 > SAMPLE_STALL_MS as f64 => Err(format!(
            "sampling_stalled: no GPU sample for {age:.0} s (the sampling loop is stuck, or NVML fails for every GPU)"
        )),
        _ => Ok(()),
    }
}

/// A sample's labels, in the order they are written.
type Labels = Vec<(&'static str, String)>;

/// One family's series, written in the order given (a `Family` would write them
/// in hash order, reshuffled at every scrape), each a constant read off the report.
#[derive(Debug)]
struct Series<M>(Vec<(Labels, M)>);

impl<M: EncodeMetric + TypedMetric> EncodeMetric for Series<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        for (labels, metric) in &self.0 {
            metric.encode(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

/// A histogram already counted (`DurationHistogram`'s buckets of
/// `BUCKET_BOUNDS_US`), written as `_bucket{le}`, `_sum` and `_count` in seconds.
#[derive(Debug)]
struct Buckets {
    sum_seconds: f64,
    count: u64,
    /// Upper bound in seconds and the count in that bucket alone: the encoder
    /// sums them into cumulative buckets itself.
    buckets: Vec<(f64, u64)>,
}

impl Buckets {
    fn of(h: &DurationHistogram) -> Self {
        // The last count is of those above every bound (+Inf); never recorded:
        // no counts, all zero.
        let buckets = BUCKET_BOUNDS_US
            .iter()
            .map(|&bound_us| bound_us as f64 / 1e6)
            .chain([f64::INFINITY])
            .enumerate()
            .map(|(i, bound)| (bound, h.counts.get(i).copied().unwrap_or(0)))
            .collect();
        Buckets {
            sum_seconds: h.sum_ns as f64 / 1e9,
            count: h.count,
            buckets,
        }
    }
}

impl EncodeMetric for Buckets {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        encoder.encode_histogram::<NoLabelSet>(self.sum_seconds, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// The registry one scrape is written from.
struct Exposition(Registry);

impl Exposition {
    fn add(&mut self, name: &str, help: &str, metric: impl Metric) {
        // prometheus-client ends every help with a full stop of its own.
        self.0
            .register(name, help.strip_suffix('.').unwrap_or(help), metric);
    }

    fn gauges<N>(&mut self, name: &str, help: &str, series: Vec<(Labels, N)>)
    where
        ConstGauge<N>: Metric,
    {
        let series = series
            .into_iter()
            .map(|(labels, v)| (labels, ConstGauge::new(v)))
            .collect();
        self.add(name, help, Series(series));
    }

    /// `sample_name` is the name of the samples, `_total` included: the registry takes
    /// the name without it and the encoder adds it back.
    fn counters<N>(&mut self, sample_name: &str, help: &str, series: Vec<(Labels, N)>)
    where
        ConstCounter<N>: Metric,
    {
        let family = sample_name
            .strip_suffix("_total")
            .expect("a counter's samples end in _total");
        let series = series
            .into_iter()
            .map(|(labels, v)| (labels, ConstCounter::new(v)))
            .collect();
        self.add(family, help, Series(series));
    }
}

/// One label for a GPU, by UUID.
fn gpu(uuid: &str) -> Labels {
    vec![("gpu", uuid.to_owned())]
}

pub fn render(report: &StatusReport, violation_totals: &BTreeMap<&'static str, u64>) -> String {
    let mut out = Exposition(Registry::default());
    // An info metric, registered as gpushare_build: the encoder writes the series
    // dashboards join on, gpushare_build_info{...} 1, typed as a gauge.
    out.add(
        "gpushare_build",
        "Always 1; the arbiter's version and the commit it was built from.",
        Info::new(vec![("version", VERSION), ("commit", COMMIT)]),
    );
    render_tokens(&mut out, report);
    render_connections(&mut out, report);
    out.gauges(
        "gpushare_gpu_memory_total_bytes",
        "GPU memory.",
        report
            .gpus
            .iter()
            .map(|g| {
                let labels = vec![("gpu", g.uuid.clone()), ("index", g.index.to_string())];
                (labels, g.memory_total)
            })
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_memory_leased_bytes",
        "Sum of the memory quotas of the leases on the GPU, plus the room of memory grants held there that no lease uses yet.",
        report
            .gpus
            .iter()
            .map(|g| (gpu(&g.uuid), g.memory_leased))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_memory_used_bytes",
        "GPU memory in use as NVML reports it.",
        report
            .gpus
            .iter()
            .filter_map(|g| Some((gpu(&g.uuid), g.memory_used?)))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_utilization_ratio",
        "Mean GPU utilisation over the last minute (0-1).",
        report
            .gpus
            .iter()
            .filter_map(|g| Some((gpu(&g.uuid), g.utilization_last_minute?)))
            .collect(),
    );
    out.gauges(
        "gpushare_last_sample_age_seconds",
        "How long ago the background loop last sampled the GPUs.",
        report
            .last_sample_age_ms
            .map(|ms| (Labels::new(), ms as f64 / 1000.0))
            .into_iter()
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_utilization_10s_ratio",
        "Mean GPU utilisation over the last 10 s (0-1): follows a change within seconds.",
        report
            .gpu_utilization
            .iter()
            .filter_map(|u| Some((gpu(&u.uuid), u.last_10s?)))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_expected_demand",
        "Expected GPU demand of the leases on the GPU, in GPUs (measured token time, else the requests, else an assumption by priority).",
        report
            .placement
            .iter()
            .map(|h| (gpu(&h.uuid), h.expected_demand))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_largest_free_hole_bytes",
        "The largest quota a new lease could get on the GPU now: memory neither promised nor in use.",
        report
            .placement
            .iter()
            .map(|h| (gpu(&h.uuid), h.largest_free_hole))
            .collect(),
    );
    out.counters(
        "gpushare_placement_waits_fragmented_total",
        "Reserves that waited although the free memory of the open GPUs, added up, would have held them.",
        vec![(Labels::new(), report.placement_waits_fragmented)],
    );
    out.add(
        "gpushare_placement_decision_seconds",
        "Time to place one request with the configured policy (target: ≤ 100 µs).",
        Buckets::of(&report.placement_times.decisions),
    );
    out.add(
        "gpushare_placement_batch_search_seconds",
        "Time of one batch search over the waiting requests (placement.batch).",
        Buckets::of(&report.placement_times.batch_searches),
    );
    out.gauges(
        "gpushare_gpu_drained",
        "1 when no new leases are placed on the GPU.",
        report
            .gpus
            .iter()
            .map(|g| (gpu(&g.uuid), u64::from(g.drained)))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_unshareable",
        "1 for a GPU set aside at inventory because gpushare cannot share it (compute mode, MIG, MPS; see gpusharectl status).",
        report
            .unshareable
            .iter()
            .map(|u| {
                let labels = vec![("gpu", u.uuid.clone()), ("index", u.index.to_string())];
                (labels, 1u64)
            })
            .collect(),
    );
    let mut leases = Vec::new();
    for priority in [Priority::High, Priority::Low] {
        for (state, name) in [
            (LeaseState::Reserved, "reserved"),
            (LeaseState::Confirmed, "confirmed"),
        ] {
            let n = report
                .leases
                .iter()
                .filter(|l| l.priority == priority && l.state == state)
                .count();
            let labels = vec![("priority", priority.to_string()), ("state", name.into())];
            leases.push((labels, n as u64));
        }
    }
    out.gauges("gpushare_leases", "Leases by priority and state.", leases);
    out.gauges(
        "gpushare_lease_memory_used_bytes",
        "GPU memory charged to the lease by its processes.",
        report
            .usage
            .iter()
            .map(|u| (lease_labels(report, &u.lease), u.memory_used))
            .collect(),
    );
    out.gauges(
        "gpushare_lease_memory_quota_bytes",
        "The lease's memory quota.",
        report
            .usage
            .iter()
            .map(|u| (lease_labels(report, &u.lease), u.memory_quota))
            .collect(),
    );
    render_lease_time(&mut out, report);
    render_grants(&mut out, report);
    out.counters(
        "gpushare_admission_rejections_total",
        "Reserves refused after waiting out the admission bound (they never became leases).",
        vec![
            (
                vec![("priority", "high".into())],
                report.admission_rejections.high,
            ),
            (
                vec![("priority", "low".into())],
                report.admission_rejections.low,
            ),
        ],
    );
    out.gauges(
        "gpushare_queue_length",
        "Requests waiting in the admission queue.",
        [Priority::High, Priority::Low]
            .into_iter()
            .map(|priority| {
                let n = report
                    .queue
                    .iter()
                    .filter(|q| q.priority == priority)
                    .count();
                (vec![("priority", priority.to_string())], n as u64)
            })
            .collect(),
    );
    out.gauges(
        "gpushare_watchdog_violations",
        "Violations seen by the watchdog's latest pass.",
        [
            (ViolationKind::Unregistered, "unregistered"),
            (ViolationKind::OverQuota, "over_quota"),
            (ViolationKind::Ungated, "ungated"),
            (ViolationKind::Overrun, "overrun"),
            (ViolationKind::ShiftedClock, "shifted_clock"),
        ]
        .into_iter()
        .map(|(kind, name)| {
            let n = report.violations.iter().filter(|v| v.kind == kind).count();
            (vec![("kind", name.to_owned())], n as u64)
        })
        .collect(),
    );
    out.counters(
        "gpushare_watchdog_violations_total",
        "Violations seen by the watchdog, summed over its passes.",
        [
            "unregistered",
            "over_quota",
            "ungated",
            "overrun",
            "shifted_clock",
        ]
        .into_iter()
        .map(|name| {
            let n = violation_totals.get(name).copied().unwrap_or(0);
            (vec![("kind", name.to_owned())], n)
        })
        .collect(),
    );
    let mut text = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut text, &out.0)
        .expect("writing into a String does not fail");
    text
}

/// A lease's labels: its id, and its Kubernetes pod and container (empty when the
/// runtime did not say), so dashboards can join on the pod without the lease id.
fn lease_labels(report: &StatusReport, lease: &LeaseId) -> Labels {
    let pod = report
        .leases
        .iter()
        .find(|l| &l.id == lease)
        .and_then(|l| l.pod.as_ref());
    let part =
        |f: fn(&PodBinding) -> &Option<String>| pod.and_then(|p| f(p).clone()).unwrap_or_default();
    vec![
        ("lease", lease.0.clone()),
        ("pod_namespace", part(|p| &p.namespace)),
        ("pod", part(|p| &p.name)),
        ("container", part(|p| &p.container)),
    ]
}

/// [`lease_labels`] and `name`: the container's display name (the pod's
/// namespace/name/container, else the container id, shortened as docker shows it),
/// which docker and ctr containers, having no pod, are known by.
fn named_lease_labels(report: &StatusReport, usage: &gpushare_proto::LeaseUsage) -> Labels {
    let mut labels = lease_labels(report, &usage.lease);
    labels.push(("name", usage.container.clone()));
    labels
}

/// Per lease: GPU time and recent shares from the token service, and the counts
/// of what was refused or taken from it.
fn render_lease_time(out: &mut Exposition, report: &StatusReport) {
    type Value = fn(&gpushare_proto::LeaseUsage) -> Option<f64>;
    out.gauges(
        "gpushare_lease_info",
        "Always 1, one per lease: its labels, to join other series on `lease`.",
        report
            .usage
            .iter()
            .map(|u| {
                let priority = report
                    .leases
                    .iter()
                    .find(|l| l.id == u.lease)
                    .map_or(String::new(), |l| l.priority.to_string());
                let mut labels = named_lease_labels(report, u);
                labels.push(("priority", priority));
                (labels, 1u64)
            })
            .collect(),
    );
    let per_lease = |value: Value| -> Vec<(Labels, f64)> {
        report
            .usage
            .iter()
            .filter_map(|u| Some((named_lease_labels(report, u), value(u)?)))
            .collect()
    };
    out.counters(
        "gpushare_lease_gpu_time_seconds_total",
        "GPU time the lease's token clients held the token, gone clients included.",
        per_lease(|u| Some(u.gpu_time_ms as f64 / 1000.0)),
    );
    out.gauges(
        "gpushare_lease_gpu_share_10s_ratio",
        "The lease's share of one GPU's time over the last 10 s (0-1).",
        per_lease(|u| u.gpu_share_10s),
    );
    out.gauges(
        "gpushare_lease_gpu_share_1m_ratio",
        "The lease's share of one GPU's time over the last minute (0-1).",
        per_lease(|u| u.gpu_share_1m),
    );
    type Count = fn(&gpushare_proto::LeaseUsage) -> u64;
    let counts: [(&str, &str, Count); 4] = [
        (
            "gpushare_lease_memory_refusals_total",
            "Allocations refused because they would have passed the lease's memory quota.",
            |u| u.memory_refusals,
        ),
        (
            "gpushare_lease_token_revocations_total",
            "Times the lease's token clients were revoked (a higher-priority job, or the slice ran out).",
            |u| u.token_revocations,
        ),
        (
            "gpushare_lease_token_cut_offs_total",
            "Token clients cut off because the lease ended while they were connected.",
            |u| u.token_cut_offs,
        ),
        (
            "gpushare_lease_token_overdue_total",
            "Times a revoked token client of the lease had not released within scheduler.revoke_grace_ms.",
            |u| u.token_overdue,
        ),
    ];
    for (name, help, count) in counts {
        let series = report
            .usage
            .iter()
            .map(|u| (named_lease_labels(report, u), count(u)))
            .collect();
        out.counters(name, help, series);
    }
}

/// Grants by state and resource: placed (holding room, no lease yet), bound (a
/// live lease uses it) and waiting (a memory grant no GPU could hold yet), and
/// the bytes the waiting ones ask for: a node whose pods wait on fragmentation.
fn render_grants(out: &mut Exposition, report: &StatusReport) {
    let state = |g: &Grant| match (&g.lease, &g.gpu, g.amount) {
        (Some(_), _, _) => "bound",
        (None, None, GrantAmount::Memory { .. }) => "waiting",
        (None, _, _) => "placed",
    };
    let mut grants = Vec::new();
    for resource in ["memory", "high", "compute"] {
        for s in ["placed", "bound", "waiting"] {
            let n = report
                .grants
                .iter()
                .filter(|g| state(g) == s && crate::grants::resource_name(&g.amount) == resource)
                .count();
            let labels = vec![("state", s.to_owned()), ("resource", resource.to_owned())];
            grants.push((labels, n as u64));
        }
    }
    out.gauges(
        "gpushare_grants",
        "Device-plugin grants by state (placed: room held, no lease yet; bound: a live lease uses it; waiting: no GPU could hold it yet) and resource.",
        grants,
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
    out.gauges(
        "gpushare_grants_waiting_memory_bytes",
        "Memory the waiting grants ask for: their containers cannot start until a GPU has that much room.",
        vec![(Labels::new(), waiting)],
    );
}

/// How long a client may take to send its request's headers (a scrape sends them
/// at once), and how long one connection may live in all, its answer included:
/// a stuck or slow client holds nothing past them.
const HEADER_READ_LIMIT: Duration = Duration::from_secs(5);
const CONNECTION_LIMIT: Duration = Duration::from_secs(30);

/// The routes: `GET /metrics` with whatever `report` returns, `GET /healthz` with
/// [`health_of`] it, anything else a 404 naming them.
fn routes<F>(report: F) -> Router
where
    F: Fn() -> String + Send + Sync + Clone + 'static,
{
    let metrics = {
        let report = report.clone();
        move || async move { ([(header::CONTENT_TYPE, CONTENT_TYPE)], report()) }
    };
    let healthz = move || async move {
        match health_of(&report()) {
            Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
        }
    };
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: try GET /metrics or GET /healthz\n",
            )
        })
}

/// Answered, then closed, to a connection beyond the cap.
const TOO_MANY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 29\r\nconnection: close\r\n\r\ntoo many metrics connections\n";

/// Serves [`routes`] on `listener`, one request per connection, at most
/// `max_connections` at once (`arbiter.metrics_max_connections`): anyone who can
/// reach the address may connect, and each connection is a descriptor the
/// control socket and the lease sockets may need. One beyond the cap is answered
/// 503 and closed at once.
///
/// Not `axum::serve`: it spawns each connection as a task of its own, which
/// stopping this one would leave running, and gives hyper no timer, so hyper's
/// header-read timeout is off. Here the connections are this task's (stopping it
/// ends them too) and each is bounded in time.
pub async fn serve<F>(listener: TcpListener, report: F, max_connections: usize)
where
    F: Fn() -> String + Send + Sync + Clone + 'static,
{
    let routes = routes(report);
    let mut connections = tokio::task::JoinSet::new();
    let mut failures = AcceptFailures::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                failures.wait_after(&"metrics endpoint", &e).await;
                continue;
            }
        };
        failures.accepted();
        // Connections that ended but are not yet reaped do not count.
        while connections.try_join_next().is_some() {}
        if connections.len() >= max_connections {
            if let Ok(socket) = stream.into_std() {
                say_and_close(socket, TOO_MANY);
            }
            continue;
        }
        let service = TowerToHyperService::new(routes.clone());
        connections.spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_LIMIT)
                // A scrape comes every few seconds at most: an idle connection
                // kept for it would only be one more thing to bound.
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIMIT, connection).await;
        });
    }
}

/// The lease sockets' connections: how many are open, and the refused floods.
fn render_connections(out: &mut Exposition, report: &StatusReport) {
    out.gauges(
        "gpushare_store_failing",
        "1 while the lease store cannot be written (a full state_dir): new work is refused until it recovers.",
        vec![(Labels::new(), u64::from(report.store_failure.is_some()))],
    );
    let c = &report.connections;
    out.gauges(
        "gpushare_lease_connections",
        "Open lease-socket connections (token connections included).",
        vec![(Labels::new(), c.open as u64)],
    );
    out.counters(
        "gpushare_lease_connections_refused_total",
        "Lease-socket connections refused: over the per-lease or node-wide bound, beyond the lease's floor on a full node, or from a peer outside the lease's container.",
        [
            ("lease_limit", c.refused_lease_limit),
            ("total_limit", c.refused_total_limit),
            ("fair_share", c.refused_fair_share),
            ("peer", c.refused_peer),
        ]
        .into_iter()
        .map(|(reason, n)| (vec![("reason", reason.to_owned())], n))
        .collect(),
    );
}

/// The time-slice tokens: counters per GPU (only GPUs that had token clients).
fn render_tokens(out: &mut Exposition, report: &StatusReport) {
    type Field = fn(&gpushare_proto::TokenStatus) -> u64;
    #[derive(PartialEq)]
    enum Kind {
        Counter,
        Gauge,
    }
    use Kind::{Counter, Gauge};
    let families: [(&str, Kind, &str, Field); 18] = [
        (
            "gpushare_token_grants_total",
            Counter,
            "Time-slice token grants.",
            |t| t.grants,
        ),
        (
            "gpushare_token_revocations_total",
            Counter,
            "Time-slice tokens revoked (slice over, or preempted by high priority).",
            |t| t.revocations,
        ),
        (
            "gpushare_token_overdue_total",
            Counter,
            "Revoked clients that had not released within scheduler.revoke_grace_ms (no longer waited for; never cut off).",
            |t| t.overdue,
        ),
        (
            "gpushare_token_overdue_clients",
            Gauge,
            "Revoked clients still draining past scheduler.revoke_grace_ms.",
            |t| t.overdue_clients.len() as u64,
        ),
        (
            "gpushare_token_cut_offs_total",
            Counter,
            "Always 0 (kept for compatibility): nobody is cut off for a slow drain; see gpushare_token_overdue_total.",
            |t| t.cut_offs,
        ),
        (
            "gpushare_token_thread_restarts_total",
            Counter,
            "Times one of the GPU's token threads failed (panicked) and was restarted.",
            |t| t.thread_restarts,
        ),
        (
            "gpushare_token_thread_failed",
            Gauge,
            "1 while a token thread of the GPU failed within the last minute (/healthz fails meanwhile).",
            |t| u64::from(t.thread_failed_recently),
        ),
        (
            "gpushare_token_clients",
            Gauge,
            "Token connections.",
            |t| t.clients as u64,
        ),
        (
            "gpushare_token_waiting",
            Gauge,
            "Token clients waiting for the token.",
            |t| t.waiting as u64,
        ),
        (
            "gpushare_admission_windows_total",
            Counter,
            "Admission windows published to low-priority holders (the time until the high-priority job is expected back).",
            |t| t.admission.windows,
        ),
        (
            "gpushare_admission_early_returns_total",
            Counter,
            "Times the high-priority job came back while a low-priority window was still open (rhythm mis-predictions).",
            |t| t.admission.early_returns,
        ),
        (
            "gpushare_admission_fitted_launches_total",
            Counter,
            "Low-priority launches admitted inside a window.",
            |t| t.admission.launches.fitted,
        ),
        (
            "gpushare_admission_held_back_total",
            Counter,
            "Low-priority launches that waited because their measured duration did not fit the window.",
            |t| t.admission.launches.held_back,
        ),
        (
            "gpushare_admission_overran_launches_total",
            Counter,
            "Admitted launches measured still running after their window's end (duration mis-predictions).",
            |t| t.admission.launches.overran,
        ),
        (
            "gpushare_admission_overran_microseconds_total",
            Counter,
            "Their total time past the window's end, in microseconds.",
            |t| t.admission.launches.overran_ns / 1_000,
        ),
        (
            "gpushare_admission_measured_overruns_total",
            Counter,
            "Low-priority holders revoked beside an active high-priority job and still running after scheduler.revoke_grace_ms, or past their admission window by more than scheduler.window_overrun_grace_ms, on the arbiter's clock.",
            |t| t.admission.measured_overruns,
        ),
        (
            "gpushare_admission_measured_overrun_milliseconds_total",
            Counter,
            "Their GPU time past the grace or the window, in milliseconds (ended drains).",
            |t| t.admission.measured_overrun_ms,
        ),
        (
            "gpushare_admission_penalized_leases",
            Gauge,
            "Leases that overran recently: granted only while no high-priority job is active.",
            |t| t.admission.penalized_leases.len() as u64,
        ),
    ];
    for (name, kind, help, field) in families {
        let series = report
            .tokens
            .iter()
            .map(|t| (gpu(&t.gpu), field(t)))
            .collect();
        if kind == Counter {
            out.counters(name, help, series);
        } else {
            out.gauges(name, help, series);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_proto::{Fraction, GpuStatus, Lease, LeaseId, LeaseUsage, Violation};

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
            gpu_time_ms: 0,
            gpu_share_10s: None,
            gpu_share_1m: None,
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
                ..usage("l1", "")
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
            assert!(has_sample(&text, line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn renders_build_info_gpu_time_shares_and_refusals_per_lease() {
        let report = StatusReport {
            usage: vec![LeaseUsage {
                memory_used: 0,
                memory_quota: 1,
                gpu_time_ms: 12_345,
                gpu_share_10s: Some(0.61),
                memory_refusals: 3,
                token_revocations: 4,
                token_cut_offs: 1,
                ..usage("l1", "0123456789ab")
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
            assert!(has_sample(&text, &line), "missing {line:?} in\n{text}");
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
            "gpushare_gpu_memory_total_bytes{gpu=\"GPU-0\",index=\"0\"} 100",
            "gpushare_gpu_memory_leased_bytes{gpu=\"GPU-0\"} 40",
            "gpushare_gpu_memory_used_bytes{gpu=\"GPU-0\"} 30",
            "gpushare_gpu_utilization_ratio{gpu=\"GPU-0\"} 0.5",
            "gpushare_leases{priority=\"high\",state=\"confirmed\"} 1",
            "gpushare_leases{priority=\"low\",state=\"reserved\"} 1",
            // Labels added for Kubernetes: empty for a lease without a pod.
            "gpushare_lease_memory_used_bytes{lease=\"l3\",pod_namespace=\"\",pod=\"\",container=\"\"} 12",
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
            "gpushare_store_failing 1",
            "gpushare_lease_connections_refused_total{reason=\"lease_limit\"} 9744",
            "gpushare_lease_connections_refused_total{reason=\"total_limit\"} 8",
            "gpushare_lease_connections_refused_total{reason=\"peer\"} 2",
            "gpushare_gpu_expected_demand{gpu=\"GPU-0\"} 0.75",
            "gpushare_gpu_largest_free_hole_bytes{gpu=\"GPU-0\"} 60",
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
    /// name needs escaping), usage with and without GPU time and shares, every
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
                    gpu_time_ms: 12_345,
                    gpu_share_10s: Some(0.61),
                    gpu_share_1m: Some(0.25),
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

    /// The samples of `full_report` as the hand-written renderer that came before
    /// prometheus-client wrote them (through `samples`): what dashboards and alerts
    /// were built on.
    const REFERENCE: &str = include_str!("metrics/reference_samples.txt");

    /// Whether the exposition has the sample `line` (in either format's spelling of
    /// numbers).
    fn has_sample(exposition: &str, line: &str) -> bool {
        let want = samples(line);
        want.len() == 1 && samples(exposition).contains(&want[0])
    }

    #[test]
    fn every_sample_of_the_hand_written_renderer_is_kept() {
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
            "# TYPE gpushare_lease_gpu_time_seconds_total counter",
            "# TYPE gpushare_watchdog_violations_total counter",
            "# TYPE gpushare_watchdog_violations gauge",
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
        let read =
            tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut rest)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "still open 2 s after the stop: {read:?} {rest:?}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let (report, totals) = full_report();
        let text = render(&report, &totals);
        let line = r#"gpushare_lease_info{lease="l3",pod_namespace="",pod="",container="",name="odd \"name\" \\ with\nnewline",priority="low"} 1"#;
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
}
