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
use gpushare_proto::{
    LeaseState, LeaseTokenAccount, LeaseUsage, Priority, StatusReport, ViolationKind,
};
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
/// 0.0.4, which every Prometheus scrapes, and whose `# TYPE` lines name a counter's
/// family with its `_total` (as dashboards and alerts were written against). No family
/// is named as another's counter without `_total`, so the names would hold in
/// OpenMetrics too.
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

/// A GPU's labels: its UUID and its NVML index (empty for a GPU the report does not
/// list, which no series of a live arbiter names).
fn gpu_labels(report: &StatusReport, uuid: &str) -> Labels {
    let index = report
        .gpus
        .iter()
        .map(|g| (&g.uuid, g.index))
        .chain(report.unshareable.iter().map(|u| (&u.uuid, u.index)))
        .find(|(u, _)| u.as_str() == uuid)
        .map_or(String::new(), |(_, index)| index.to_string());
    vec![("gpu", uuid.to_owned()), ("gpu_index", index)]
}

/// `labels` and one more.
fn with(mut labels: Labels, key: &'static str, value: impl Into<String>) -> Labels {
    labels.push((key, value.into()));
    labels
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
    render_reclaim(&mut out, report);
    out.gauges(
        "gpushare_gpu_memory_total_bytes",
        "GPU memory.",
        report
            .gpus
            .iter()
            .map(|g| (gpu_labels(report, &g.uuid), g.memory_total))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_memory_leased_bytes",
        "Sum of the memory quotas of the leases on the GPU, plus the room of memory grants held there that no lease uses yet.",
        report
            .gpus
            .iter()
            .map(|g| (gpu_labels(report, &g.uuid), g.memory_leased))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_memory_used_bytes",
        "GPU memory in use as NVML reports it.",
        report
            .gpus
            .iter()
            .filter_map(|g| Some((gpu_labels(report, &g.uuid), g.memory_used?)))
            .collect(),
    );
    let utilization_1m = report.gpus.iter().filter_map(|g| {
        let labels = with(gpu_labels(report, &g.uuid), "window", "1m");
        Some((labels, g.utilization_last_minute?))
    });
    let utilization_10s = report.gpu_utilization.iter().filter_map(|u| {
        let labels = with(gpu_labels(report, &u.uuid), "window", "10s");
        Some((labels, u.last_10s?))
    });
    out.gauges(
        "gpushare_gpu_utilization_ratio",
        "Mean GPU utilisation as NVML samples it (0-1), over the last minute (window=\"1m\") and the last 10 s (window=\"10s\", follows a change within seconds).",
        utilization_1m.chain(utilization_10s).collect(),
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
        "gpushare_gpu_expected_demand",
        "Expected GPU demand of the leases on the GPU, in GPUs (measured token time, else the requests, else an assumption by priority).",
        report
            .placement
            .iter()
            .map(|h| (gpu_labels(report, &h.uuid), h.expected_demand))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_largest_free_hole_bytes",
        "The largest quota a new lease could get on the GPU now: memory neither promised nor in use.",
        report
            .placement
            .iter()
            .map(|h| (gpu_labels(report, &h.uuid), h.largest_free_hole))
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
            .map(|g| (gpu_labels(report, &g.uuid), u64::from(g.drained)))
            .collect(),
    );
    out.gauges(
        "gpushare_gpu_unshareable",
        "1 for a GPU set aside at inventory because gpushare cannot share it (compute mode, MIG, MPS; see gpusharectl status), 0 for each GPU it shares.",
        report
            .gpus
            .iter()
            .map(|g| (gpu_labels(report, &g.uuid), 0u64))
            .chain(
                report
                    .unshareable
                    .iter()
                    .map(|u| (gpu_labels(report, &u.uuid), 1u64)),
            )
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
    render_leases(&mut out, report);
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
        "gpushare_watchdog_current_violations",
        "Violations listed now: the watchdog's latest pass, and the overruns and bypasses measured since.",
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

/// One lease on one of its GPUs: a series of each per-lease family.
struct LeaseOnGpu<'a> {
    usage: &'a LeaseUsage,
    labels: Labels,
    /// The GPU's token account of the lease (None: no token client of it came there).
    account: Option<&'a LeaseTokenAccount>,
}

/// Each live lease on each of its GPUs (a lease on two GPUs has two), labelled
/// `lease`, `name` (the container's display name: the pod's namespace/name/container,
/// else the engine's name, else the container id shortened as docker shows it),
/// `pod`, `namespace` and `container` (its Kubernetes pod; empty when the runtime
/// did not say), `gpu` and `gpu_index`. A lease whose GPUs are unknown keeps one
/// series with the GPU labels empty.
fn leases_on_gpus(report: &StatusReport) -> Vec<LeaseOnGpu<'_>> {
    let mut out = Vec::new();
    for usage in &report.usage {
        let lease = report.leases.iter().find(|l| l.id == usage.lease);
        let pod = lease.and_then(|l| l.pod.as_ref());
        let part = |f: fn(&PodBinding) -> &Option<String>| {
            pod.and_then(|p| f(p).clone()).unwrap_or_default()
        };
        let account_on = |uuid: &str| {
            report
                .tokens
                .iter()
                .filter(|t| t.gpu == uuid)
                .flat_map(|t| &t.leases)
                .find(|a| a.lease == usage.lease)
        };
        // Its GPUs, and any other GPU whose token keeps an account of it.
        let mut gpus: Vec<&str> =
            lease.map_or(vec![], |l| l.gpus.iter().map(String::as_str).collect());
        for t in &report.tokens {
            if !gpus.contains(&t.gpu.as_str()) && t.leases.iter().any(|a| a.lease == usage.lease) {
                gpus.push(&t.gpu);
            }
        }
        let lease_labels = vec![
            ("lease", usage.lease.0.clone()),
            ("name", usage.container.clone()),
            ("pod", part(|p| &p.name)),
            ("namespace", part(|p| &p.namespace)),
            ("container", part(|p| &p.container)),
        ];
        if gpus.is_empty() {
            let labels = with(with(lease_labels, "gpu", ""), "gpu_index", "");
            out.push(LeaseOnGpu {
                usage,
                labels,
                account: None,
            });
            continue;
        }
        for uuid in gpus {
            let mut labels = lease_labels.clone();
            labels.extend(gpu_labels(report, uuid));
            out.push(LeaseOnGpu {
                usage,
                labels,
                account: account_on(uuid),
            });
        }
    }
    out
}

/// Per lease and GPU: its memory, its token time and token shares from the GPU's
/// token account, and the counts of what was refused or taken from it.
fn render_leases(out: &mut Exposition, report: &StatusReport) {
    let leases = leases_on_gpus(report);
    let per_lease = |value: &dyn Fn(&LeaseOnGpu) -> u64| -> Vec<(Labels, u64)> {
        leases
            .iter()
            .map(|l| (l.labels.clone(), value(l)))
            .collect()
    };
    out.gauges(
        "gpushare_lease_info",
        "Always 1, one per lease and GPU: its labels and priority, to join other series on `lease`.",
        leases
            .iter()
            .map(|l| {
                let priority = report
                    .leases
                    .iter()
                    .find(|lease| lease.id == l.usage.lease)
                    .map_or(String::new(), |lease| lease.priority.to_string());
                (with(l.labels.clone(), "priority", priority), 1u64)
            })
            .collect(),
    );
    out.gauges(
        "gpushare_lease_memory_used_bytes",
        "GPU memory charged to the lease by its processes, over all its GPUs (the ledger counts per process, not per GPU): a lease on several GPUs shows this same value on each GPU's series.",
        per_lease(&|l| l.usage.memory_used),
    );
    out.gauges(
        "gpushare_lease_memory_quota_bytes",
        "The lease's memory quota over all its GPUs (its per-GPU quota times its GPUs), the same on each GPU's series.",
        per_lease(&|l| l.usage.memory_quota),
    );
    out.counters(
        "gpushare_lease_token_time_seconds_total",
        "Token time: how long the lease's token clients held this GPU's time-slice token (its turn on the GPU), gone clients included. Its kernels run only while it holds the token, so this bounds its GPU time.",
        leases
            .iter()
            .map(|l| {
                let ms = l.account.map_or(0, |a| a.token_time_ms);
                (l.labels.clone(), ms as f64 / 1000.0)
            })
            .collect(),
    );
    let share = |window: &'static str, value: fn(&LeaseTokenAccount) -> f64| {
        leases.iter().filter_map(move |l| {
            let account = l.account?;
            Some((with(l.labels.clone(), "window", window), value(account)))
        })
    };
    out.gauges(
        "gpushare_lease_token_share_ratio",
        "Token share: the lease's token time on this GPU over the last 10 s (window=\"10s\") or minute (window=\"1m\"), over the window's length (0-1). No series while no token client of the lease came to the GPU.",
        share("10s", |a| a.token_share_10s)
            .chain(share("1m", |a| a.token_share_1m))
            .collect(),
    );
    let on_gpu =
        |field: fn(&LeaseTokenAccount) -> u64| move |l: &LeaseOnGpu| l.account.map_or(0, field);
    out.counters(
        "gpushare_lease_memory_refusals_total",
        "Allocations refused because they would have passed the lease's memory quota, over all its GPUs: the same on each GPU's series.",
        per_lease(&|l| l.usage.memory_refusals),
    );
    out.counters(
        "gpushare_lease_token_revocations_total",
        "Times the lease's token clients on this GPU were revoked (a higher-priority job, or the slice ran out): routine.",
        per_lease(&on_gpu(|a| a.revocations)),
    );
    out.counters(
        "gpushare_lease_token_cut_offs_total",
        "Token clients of the lease on this GPU cut off because the lease ended while they were connected.",
        per_lease(&on_gpu(|a| a.cut_offs)),
    );
    out.counters(
        "gpushare_lease_token_overdue_total",
        "Times a revoked token client of the lease on this GPU had not released within scheduler.revoke_grace_ms.",
        per_lease(&on_gpu(|a| a.overdue)),
    );
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
/// Memory reclaim (`[memory] reclaim`): nothing when it is off.
fn render_reclaim(out: &mut Exposition, report: &StatusReport) {
    let Some(r) = &report.reclaim else {
        return;
    };
    let mut suspended: BTreeMap<String, u64> = BTreeMap::new();
    for s in &r.suspended {
        *suspended.entry(s.gpu.clone()).or_default() += 1;
    }
    out.gauges(
        "gpushare_suspended_leases",
        "Low-priority leases checkpointed off the GPU (or being suspended or restored) to give their memory to a high-priority one.",
        suspended
            .into_iter()
            .map(|(g, n)| (gpu_labels(report, &g), n))
            .collect(),
    );
    out.counters(
        "gpushare_memory_reclaims_total",
        "High-priority charges that needed memory lent to low-priority leases, by outcome (succeeded: the charge was granted).",
        vec![
            (
                vec![("outcome", "succeeded".to_owned())],
                r.reclaims - r.reclaims_failed,
            ),
            (vec![("outcome", "failed".to_owned())], r.reclaims_failed),
        ],
    );
    out.counters(
        "gpushare_memory_reclaimed_bytes_total",
        "Memory the reclaims freed: what the suspended leases held.",
        vec![(Labels::new(), r.reclaimed_bytes)],
    );
    out.counters(
        "gpushare_memory_restores_total",
        "Suspended leases restored onto their GPU.",
        vec![(Labels::new(), r.restores)],
    );
    out.gauges(
        "gpushare_memory_reclaim_last_seconds",
        "The last reclaim's time, from the charge to its answer, beside its bound.",
        r.recent
            .last()
            .map(|last| {
                vec![
                    (vec![("of", "reclaim".to_owned())], last.total_ms / 1e3),
                    (vec![("of", "bound".to_owned())], last.bound_ms / 1e3),
                ]
            })
            .unwrap_or_default(),
    );
}

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
    let families: [(&str, Kind, &str, Field); 15] = [
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
            "gpushare_admission_measured_overruns_total",
            Counter,
            "Low-priority holders revoked beside an active high-priority job and still running after scheduler.revoke_grace_ms, or past their admission window by more than scheduler.window_overrun_grace_ms, on the arbiter's clock.",
            |t| t.admission.measured_overruns,
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
            .map(|t| (gpu_labels(report, &t.gpu), field(t)))
            .collect();
        if kind == Counter {
            out.counters(name, help, series);
        } else {
            out.gauges(name, help, series);
        }
    }
    type Seconds = fn(&gpushare_proto::TokenStatus) -> f64;
    let durations: [(&str, &str, Seconds); 2] = [
        (
            "gpushare_admission_overran_seconds_total",
            "The overran launches' total time past their window's end, in seconds.",
            |t| t.admission.launches.overran_ns as f64 / 1e9,
        ),
        (
            "gpushare_admission_measured_overrun_seconds_total",
            "The measured overruns' token time past the grace or the window, in seconds (ended drains).",
            |t| t.admission.measured_overrun_ms as f64 / 1e3,
        ),
    ];
    for (name, help, seconds) in durations {
        let series = report
            .tokens
            .iter()
            .map(|t| (gpu_labels(report, &t.gpu), seconds(t)))
            .collect();
        out.counters(name, help, series);
    }
}

#[cfg(test)]
mod tests;
