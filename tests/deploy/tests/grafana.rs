//! deploy/grafana/gpushare.json as Grafana reads it, and the arbiter's /metrics as
//! Prometheus reads it. No Grafana can be installed here, so the dashboard is read
//! into a typed model of Grafana's dashboard schema (grafana/grafana
//! kinds/dashboard/dashboard_kind.cue, schema 0.0: the fields it declares, the
//! required ones required, unknown ones refused where the schema is closed), its
//! constraints checked (grid within 24 columns, unique panel ids, non-empty panel
//! types, a ref id per query), and every metric its PromQL names must be one a
//! running gpushare-arbiter serves on /metrics. A live arbiter on two simulated
//! GPUs, with a named container on each running token clients, is scraped:
//! `promtool check metrics` must find nothing in the scrape, and a real Prometheus
//! scraping it must answer every panel's query with at least one series.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpushare_proto::{PodBinding, Priority, ReserveRequest};
use gpushare_testkit::simgpu::{self, SimMachine};
use gpushare_testkit::{binaries, free_port, reserve_request, stand_in_init, wait_until, Arbiter};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)] // read to be checked, not used
struct Dashboard {
    id: Option<i64>,
    uid: Option<String>,
    title: Option<String>,
    description: Option<String>,
    revision: Option<i64>,
    gnet_id: Option<String>,
    tags: Option<Vec<String>>,
    style: Style,
    timezone: Option<String>,
    editable: bool,
    graph_tooltip: CursorSync,
    time: Option<TimeRange>,
    timepicker: Option<Value>,
    fiscal_year_start_month: Option<u8>,
    live_now: Option<bool>,
    week_start: Option<String>,
    refresh: Option<Value>,
    schema_version: u16,
    version: Option<u32>,
    panels: Option<Vec<AnyPanel>>,
    templating: Option<Templating>,
    annotations: Option<Annotations>,
    links: Option<Vec<Value>>,
    snapshot: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Style {
    Light,
    Dark,
}

/// 0 off, 1 shared crosshair, 2 shared crosshair and tooltip.
#[derive(Debug, Deserialize)]
#[serde(try_from = "u8")]
struct CursorSync(#[allow(dead_code)] u8);

impl TryFrom<u8> for CursorSync {
    type Error = String;
    fn try_from(v: u8) -> Result<Self, String> {
        (v <= 2)
            .then_some(CursorSync(v))
            .ok_or_else(|| format!("graphTooltip {v}: accepted 0, 1 or 2"))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct TimeRange {
    from: String,
    to: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Templating {
    list: Option<Vec<Variable>>,
}

/// `#VariableModel`: open in the schema (`...`), so only its declared fields are typed.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct Variable {
    id: String,
    #[serde(rename = "type")]
    kind: VariableType,
    name: String,
    label: Option<String>,
    global: bool,
    hide: u8,
    #[serde(rename = "skipUrlSync")]
    skip_url_sync: bool,
    index: i32,
    state: String,
    query: Option<Value>,
    datasource: Option<DataSourceRef>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum VariableType {
    Query,
    Adhoc,
    Constant,
    Datasource,
    Interval,
    Textbox,
    Custom,
    System,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Annotations {
    #[allow(dead_code)]
    list: Option<Vec<Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct DataSourceRef {
    #[serde(rename = "type")]
    kind: Option<String>,
    uid: Option<String>,
}

/// A panel of the dashboard's list: a row (`#RowPanel`, type "row") or any other
/// (`#Panel`).
#[derive(Debug)]
enum AnyPanel {
    Row(RowPanel),
    Panel(Box<Panel>),
}

impl<'de> Deserialize<'de> for AnyPanel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let panel = if value["type"] == "row" {
            serde_json::from_value(value).map(AnyPanel::Row)
        } else {
            serde_json::from_value(value).map(|p| AnyPanel::Panel(Box::new(p)))
        };
        panel.map_err(serde::de::Error::custom)
    }
}

impl AnyPanel {
    fn id(&self) -> Option<u32> {
        match self {
            AnyPanel::Row(r) => Some(r.id),
            AnyPanel::Panel(p) => p.id,
        }
    }

    fn title(&self) -> String {
        match self {
            AnyPanel::Row(r) => r.title.clone(),
            AnyPanel::Panel(p) => p.title.clone(),
        }
        .unwrap_or_default()
    }

    fn grid_pos(&self) -> Option<&GridPos> {
        match self {
            AnyPanel::Row(r) => r.grid_pos.as_ref(),
            AnyPanel::Panel(p) => p.grid_pos.as_ref(),
        }
    }
}

/// `#RowPanel`: a heading across the grid; its panels are listed after it (open) or
/// inside it (collapsed).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct RowPanel {
    #[serde(rename = "type")]
    kind: String,
    collapsed: bool,
    title: Option<String>,
    datasource: Option<DataSourceRef>,
    grid_pos: Option<GridPos>,
    id: u32,
    panels: Vec<Value>,
    repeat: Option<String>,
}

/// `#Panel` (not a graph or heatmap panel: the dashboard uses none).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct Panel {
    #[serde(rename = "type")]
    kind: String,
    id: Option<u32>,
    plugin_version: Option<String>,
    tags: Option<Vec<String>>,
    targets: Option<Vec<Target>>,
    title: Option<String>,
    description: Option<String>,
    transparent: bool,
    datasource: Option<DataSourceRef>,
    grid_pos: Option<GridPos>,
    links: Option<Vec<Value>>,
    repeat: Option<String>,
    repeat_direction: RepeatDirection,
    max_data_points: Option<f64>,
    transformations: Vec<Value>,
    interval: Option<String>,
    time_from: Option<String>,
    time_shift: Option<String>,
    options: serde_json::Map<String, Value>,
    field_config: FieldConfigSource,
}

#[derive(Debug, Deserialize)]
enum RepeatDirection {
    #[serde(rename = "h")]
    Horizontal,
    #[serde(rename = "v")]
    Vertical,
}

/// A Prometheus query, as the Prometheus data source writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct Target {
    datasource: Option<DataSourceRef>,
    expr: String,
    legend_format: Option<String>,
    ref_id: String,
    /// Only the latest value (a table of what is now), not a range.
    instant: Option<bool>,
    format: Option<TargetFormat>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum TargetFormat {
    TimeSeries,
    Table,
    Heatmap,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GridPos {
    h: u32,
    w: u32,
    x: u32,
    y: u32,
    #[serde(rename = "static")]
    #[allow(dead_code)]
    fixed: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct FieldConfigSource {
    defaults: FieldConfig,
    overrides: Vec<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
struct FieldConfig {
    display_name: Option<String>,
    description: Option<String>,
    unit: Option<String>,
    decimals: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    mappings: Option<Vec<Value>>,
    thresholds: Option<Value>,
    color: Option<Value>,
    links: Option<Vec<Value>>,
    no_value: Option<String>,
    custom: Option<serde_json::Map<String, Value>>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

fn dashboard() -> Dashboard {
    let path = repo().join("deploy/grafana/gpushare.json");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `gpushare_…` name in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("gpushare_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The panels that query (every one but the rows).
fn query_panels(d: &Dashboard) -> Vec<&Panel> {
    d.panels
        .iter()
        .flatten()
        .filter_map(|p| match p {
            AnyPanel::Panel(p) => Some(&**p),
            AnyPanel::Row(_) => None,
        })
        .collect()
}

/// Every panel's queries: (panel title, target).
fn targets(d: &Dashboard) -> Vec<(String, &Target)> {
    query_panels(d)
        .into_iter()
        .flat_map(|p| {
            let title = p.title.clone().unwrap_or_default();
            p.targets.iter().flatten().map(move |t| (title.clone(), t))
        })
        .collect()
}

#[test]
fn the_dashboard_follows_grafanas_schema_and_lays_out_within_the_grid() {
    let d = dashboard();
    let panels = d.panels.as_ref().expect("panels");
    assert!(!panels.is_empty());
    let mut ids = BTreeSet::new();
    let mut cells: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for p in panels {
        let title = p.title();
        assert!(
            ids.insert(p.id().expect("a panel id")),
            "{title}: id reused"
        );
        let g = p.grid_pos().expect("gridPos");
        assert!(
            g.h > 0 && g.w > 0 && g.w <= 24 && g.x < 24 && g.x + g.w <= 24,
            "{title}: {g:?} leaves the 24-column grid"
        );
        for x in g.x..g.x + g.w {
            for y in g.y..g.y + g.h {
                let before = cells.insert((x, y), p.id().unwrap());
                assert!(before.is_none(), "{title} overlaps panel {before:?}");
            }
        }
        if let AnyPanel::Row(r) = p {
            assert_eq!(r.kind, "row");
        }
    }
    for p in query_panels(&d) {
        let title = p.title.clone().unwrap_or_default();
        assert!(!p.kind.is_empty(), "{title}: an empty panel type");
        let targets = p.targets.as_ref().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let refs: BTreeSet<&str> = targets.iter().map(|t| t.ref_id.as_str()).collect();
        assert_eq!(refs.len(), targets.len(), "{title}: ref ids repeat");
    }
    // An unknown key is refused, as Grafana's closed schema refuses it, in a row too.
    let text = std::fs::read_to_string(repo().join("deploy/grafana/gpushare.json")).unwrap();
    let original: Value = serde_json::from_str(&text).unwrap();
    let row = original["panels"]
        .as_array()
        .unwrap()
        .iter()
        .position(|p| p["type"] == "row")
        .expect("a row");
    let plain = original["panels"]
        .as_array()
        .unwrap()
        .iter()
        .position(|p| p["type"] != "row")
        .expect("a panel");
    for at in [row, plain] {
        let mut bent = original.clone();
        bent["panels"][at]["gridpos"] = bent["panels"][at]["gridPos"].clone();
        assert!(
            serde_json::from_value::<Dashboard>(bent).is_err(),
            "panel {at}"
        );
    }
}

/// The families whose series are one per lease and GPU.
fn is_per_lease(family: &str) -> bool {
    family.starts_with("gpushare_lease_") && family != "gpushare_lease_connections_refused_total"
}

#[test]
fn legends_name_containers_and_gpus_never_lease_ids() {
    for (title, t) in targets(&dashboard()) {
        let legend = t.legend_format.as_deref().unwrap_or_default();
        assert!(!legend.is_empty(), "{title}: {:?} has no legend", t.expr);
        assert!(
            !legend.contains("{{lease}}"),
            "{title}: {legend:?} shows a lease id"
        );
        if metric_names(&t.expr).iter().any(|n| is_per_lease(n)) {
            assert!(
                legend.contains("{{name}}"),
                "{title}: {legend:?} lacks the container's name"
            );
        }
        if legend.contains("{{gpu}}") {
            panic!("{title}: {legend:?} shows a GPU's UUID where {{{{gpu_index}}}} is shorter");
        }
    }
}

/// Routine events (the token passing between containers) come by the thousand per
/// second; errors should be 0. Drawn on one axis, the errors would vanish.
#[test]
fn routine_rates_are_on_panels_apart_from_errors_and_each_problem_has_a_panel() {
    let routine = [
        "gpushare_token_grants_total",
        "gpushare_token_revocations_total",
        "gpushare_lease_token_revocations_total",
    ];
    let errors = [
        "gpushare_lease_memory_refusals_total",
        "gpushare_admission_rejections_total",
        "gpushare_watchdog_violations_total",
        "gpushare_watchdog_current_violations",
        "gpushare_lease_token_overdue_total",
        "gpushare_token_overdue_clients",
        "gpushare_lease_connections_refused_total",
    ];
    let d = dashboard();
    for p in query_panels(&d) {
        let names: BTreeSet<String> = p
            .targets
            .iter()
            .flatten()
            .flat_map(|t| metric_names(&t.expr))
            .collect();
        let has = |list: &[&str]| list.iter().any(|n| names.contains(*n));
        assert!(
            !(has(&routine) && has(&errors)),
            "{:?} draws routine events beside errors: {names:?}",
            p.title
        );
    }
    let queried: Vec<String> = targets(&d).iter().map(|(_, t)| t.expr.clone()).collect();
    let asks = |what: &str| queried.iter().any(|e| e.contains(what));
    for (problem, query) in [
        (
            "watchdog violations",
            "gpushare_watchdog_current_violations",
        ),
        ("overdue token holders", "gpushare_token_overdue_clients"),
        ("drained GPUs", "gpushare_gpu_drained"),
        ("unshareable GPUs", "gpushare_gpu_unshareable"),
        ("waiting grants", "gpushare_grants{state=\"waiting\""),
        ("the admission queue", "gpushare_queue_length"),
        ("memory per container", "gpushare_lease_memory_used_bytes"),
        (
            "token share per container",
            "gpushare_lease_token_share_ratio",
        ),
        ("who is on the GPU", "gpushare_lease_info"),
    ] {
        assert!(asks(query), "no panel shows {problem} ({query})");
    }
    // Every query that can name a GPU follows the GPU picked.
    let gpu = d
        .templating
        .as_ref()
        .and_then(|t| t.list.as_ref())
        .and_then(|l| l.iter().find(|v| v.name == "gpu"))
        .expect("a gpu template variable");
    assert!(matches!(gpu.kind, VariableType::Query), "{gpu:?}");
    for (title, t) in targets(&d) {
        let per_gpu = metric_names(&t.expr).iter().any(|n| {
            is_per_lease(n) || n.starts_with("gpushare_gpu_") || n.starts_with("gpushare_token_")
        });
        if per_gpu && !t.expr.starts_with("max(gpushare_token_thread_failed") {
            assert!(
                t.expr.contains("gpu_index=~\"$gpu\""),
                "{title}: {:?} ignores $gpu",
                t.expr
            );
        }
    }
}

/// One HTTP/1.0 GET on the loopback: the body, or the status line and body of
/// anything but a 200.
fn get(port: u16, path: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .map_err(|e| e.to_string())?;
    let (head, body) = answer.split_once("\r\n\r\n").ok_or(answer.clone())?;
    if head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200") {
        Ok(body.to_owned())
    } else {
        Err(answer)
    }
}

fn scrape(port: u16) -> String {
    get(port, "/metrics").unwrap_or_else(|e| panic!("scraping /metrics: {e}"))
}

#[test]
fn every_metric_the_dashboard_queries_is_served_by_the_arbiter() {
    binaries::require(&["gpushare-arbiter"]);
    let port = free_port();
    let arbiter = Arbiter::builder()
        .declared_gpus(1, "16Gi")
        .configure(|c| c.arbiter.metrics_address = Some(format!("127.0.0.1:{port}")))
        .start();
    let exposition = scrape(port);
    // Families are declared (# TYPE) even while no series has a value (no lease yet).
    // Prometheus text 0.0.4 names a counter's and an info's family as their samples;
    // a histogram's samples add _bucket, _sum and _count, which is what a query names.
    let served: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .flat_map(|(family, kind)| {
            let suffixes: &[&str] = match kind {
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            suffixes.iter().map(move |s| format!("{family}{s}"))
        })
        .collect();
    assert!(served.contains("gpushare_build_info"), "{exposition}");
    let mut queried = BTreeSet::new();
    for (_, t) in targets(&dashboard()) {
        let names = metric_names(&t.expr);
        assert!(!names.is_empty(), "{:?}: no gpushare metric", t.expr);
        queried.extend(names);
    }
    let missing: Vec<&String> = queried
        .iter()
        .filter(|n| !served.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, which the arbiter does not serve"
    );
    drop(arbiter);
}

/// A node as an operator sees it: an arbiter on two simulated GPUs, a named
/// container on each (pods team-a/trainer/main on GPU 0, team-a/server/main on
/// GPU 1) whose token clients ran there, and its metrics on a loopback port.
struct Node {
    arbiter: Arbiter,
    metrics_port: u16,
    /// The containers' stand-in init processes, killed with the node.
    inits: Vec<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for init in &mut self.inits {
            let _ = init.kill();
            let _ = init.wait();
        }
    }
}

const CONTAINERS: [(&str, u32); 2] = [("trainer", 0), ("server", 1)];

fn node_with_two_named_containers() -> Node {
    binaries::require(&["gpushare-arbiter", "simgpu-workload"]);
    let libgpushare = binaries::preload_library();
    assert!(
        libgpushare.exists(),
        "{} missing: build gpushare-preload",
        libgpushare.display()
    );
    let metrics_port = free_port();
    let builder = Arbiter::builder();
    let machine = SimMachine::new(builder.dir().join("simgpu"), 2, "16Gi");
    let arbiter = builder
        .simulated(&machine)
        .configure(|c| c.arbiter.metrics_address = Some(format!("127.0.0.1:{metrics_port}")))
        .start();
    let mut node = Node {
        arbiter,
        metrics_port,
        inits: Vec::new(),
    };
    let mut control = node.arbiter.client();
    let mut jobs = Vec::new();
    for (pod, gpu) in CONTAINERS {
        let container_id = format!("{pod}-container");
        let lease = control
            .reserve(ReserveRequest {
                pod: Some(PodBinding {
                    namespace: Some("team-a".into()),
                    name: Some(pod.into()),
                    container: Some("main".into()),
                    grants: vec![],
                }),
                ..reserve_request(&container_id, Priority::Low, "1Gi", gpu)
            })
            .unwrap();
        let init = stand_in_init();
        control.confirm(container_id, init.id()).unwrap();
        node.inits.push(init);
        // A short job of back-to-back kernels: its token client holds the GPU's token.
        let mut job = Command::new(binaries::program("simgpu-workload"));
        machine.apply(&mut job);
        let job = job
            .args(["--device", &gpu.to_string()])
            .args([
                "--kernels",
                "2",
                "--kernel",
                "fixed:1ms",
                "--duration",
                "1s",
            ])
            .env("LD_PRELOAD", &libgpushare)
            .env("GPUSHARE_LEASE", &lease.id.0)
            .env("GPUSHARE_SOCKET", node.arbiter.lease_socket(&lease.id.0))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        jobs.push(job);
    }
    simgpu::wait_for_workloads(jobs);
    node
}

#[test]
fn a_live_scrape_passes_promtool_check_metrics() {
    let node = node_with_two_named_containers();
    let exposition = scrape(node.metrics_port);
    // The per-lease series are there: each container on its own GPU, by name.
    for (pod, gpu) in CONTAINERS {
        let labels = format!("name=\"team-a/{pod}/main\",pod=\"{pod}\",namespace=\"team-a\",container=\"main\",gpu=\"{}\",gpu_index=\"{gpu}\"", simgpu::gpu_uuid(gpu));
        let series = "gpushare_lease_token_time_seconds_total{lease=\"";
        assert!(
            exposition
                .lines()
                .any(|l| l.starts_with(series) && l.contains(&labels)),
            "no token time of {pod} on GPU {gpu} in\n{exposition}"
        );
    }
    let promtool = Path::new("/usr/bin/promtool");
    let promtool = if promtool.exists() {
        promtool.to_owned()
    } else {
        which("promtool").unwrap_or_else(|| {
            panic!("promtool missing: install the distribution's `prometheus` package (make test's dependencies install it)")
        })
    };
    let mut check = Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics ({}): {said}\non\n{exposition}",
        out.status
    );
}

/// `program` on PATH.
fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// A Prometheus of its own: `/usr/bin/prometheus` (or on PATH) in a scratch
/// directory on a loopback port, scraping `target` every second.
struct Prometheus {
    process: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Prometheus {
    fn scraping(target: u16) -> Prometheus {
        let program = which("prometheus").unwrap_or_else(|| {
            panic!("prometheus missing: install the distribution's `prometheus` package (make test's dependencies install it)")
        });
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: gpushare\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let process = Command::new(program)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Prometheus { process, port, dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `/api/v1/<what>` with the query string `args`: its `data`, or why not.
    fn api(&self, what: &str, args: &[(&str, &str)]) -> Result<Value, String> {
        let query: Vec<String> = args
            .iter()
            .map(|(k, v)| format!("{k}={}", url_encoded(v)))
            .collect();
        let body = get(self.port, &format!("/api/v1/{what}?{}", query.join("&")))?;
        let answer: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if answer["status"] != "success" {
            return Err(body);
        }
        Ok(answer["data"].clone())
    }

    /// The instant query's series (or scalar) and whether there is any.
    fn query(&self, expr: &str) -> Result<(bool, Value), String> {
        let data = self.api("query", &[("query", expr)])?;
        let any = match data["resultType"].as_str() {
            Some("vector") | Some("matrix") => {
                data["result"].as_array().is_some_and(|r| !r.is_empty())
            }
            Some("scalar") | Some("string") => true,
            _ => false,
        };
        Ok((any, data))
    }
}

/// `text` as a URL's query component.
fn url_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `expr` with the dashboard's variables replaced as Grafana replaces them for a
/// Prometheus query: a multi-value variable by its values as a regex alternation,
/// `$__rate_interval` by an interval.
fn substituted(expr: &str, variables: &BTreeMap<String, Vec<String>>) -> String {
    let mut expr = expr.replace("$__rate_interval", "1m");
    // Longest names first: `$gpu` must not eat the start of a `$gpus`.
    let mut names: Vec<&String> = variables.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for name in names {
        let values = &variables[name];
        let value = if values.len() == 1 {
            values[0].clone()
        } else {
            format!("({})", values.join("|"))
        };
        for spelling in [
            format!("${{{name}}}"),
            format!("[[{name}]]"),
            format!("${name}"),
        ] {
            expr = expr.replace(&spelling, &value);
        }
    }
    expr
}

#[test]
fn a_prometheus_scraping_a_live_arbiter_answers_every_dashboard_query() {
    let node = node_with_two_named_containers();
    let prometheus = Prometheus::scraping(node.metrics_port);
    // Hang guards only: a loaded machine may be slow to start it and to scrape.
    let guard = Duration::from_secs(90);
    wait_until("Prometheus's first scrape of the arbiter", guard, || {
        matches!(prometheus.query("gpushare_build_info"), Ok((true, _)))
    });
    let d = dashboard();
    // The template variables, resolved as Grafana resolves them: label_values(…).
    let mut variables: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for v in d.templating.iter().flat_map(|t| t.list.iter().flatten()) {
        if !matches!(v.kind, VariableType::Query) {
            continue;
        }
        let query = v
            .query
            .as_ref()
            .and_then(Value::as_str)
            .expect("a query variable's query");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {}: {query:?} is not label_values(…)", v.name));
        let (selector, label) = inner.rsplit_once(',').unwrap();
        let selector = substituted(selector.trim(), &variables);
        let values = prometheus
            .api(
                &format!("label/{}/values", label.trim()),
                &[("match[]", &selector)],
            )
            .unwrap_or_else(|e| panic!("variable {}: {e}", v.name));
        let values: Vec<String> = values
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
        assert!(
            !values.is_empty(),
            "variable {}: no value for {query:?}",
            v.name
        );
        variables.insert(v.name.clone(), values);
    }
    assert_eq!(variables["gpu"], ["0", "1"], "{variables:?}");
    for (title, t) in targets(&d) {
        let expr = substituted(&t.expr, &variables);
        assert!(!expr.contains('$'), "{title}: {expr:?} keeps a variable");
        // A rate needs two scrapes; each query waits for its series, within the guard.
        let started = Instant::now();
        let mut last = prometheus.query(&expr);
        while !matches!(last, Ok((true, _))) && started.elapsed() < guard {
            if let Err(e) = &last {
                // A query Prometheus refuses will not get better.
                panic!("{title}: Prometheus refuses {expr:?}: {e}");
            }
            std::thread::sleep(Duration::from_millis(500));
            last = prometheus.query(&expr);
        }
        assert!(
            matches!(last, Ok((true, _))),
            "{title}: {expr:?} has no series after {guard:?}: {last:?}\nscrape:\n{}\nPrometheus's log:\n{}",
            scrape(node.metrics_port),
            prometheus.log()
        );
    }
    // The per-lease panels' series carry each container's name, on its own GPU.
    let (_, info) = prometheus
        .query("gpushare_lease_info")
        .expect("gpushare_lease_info");
    let mut seen: Vec<(String, String)> = info["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let m = &s["metric"];
            (
                m["name"].as_str().unwrap().to_owned(),
                m["gpu_index"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("team-a/server/main".to_owned(), "1".to_owned()),
            ("team-a/trainer/main".to_owned(), "0".to_owned())
        ]
    );
}

#[test]
fn metric_names_are_read_out_of_promql() {
    assert_eq!(
        metric_names("sum by (name) (rate(gpushare_a_total{x=\"gpushare\"}[5m])) / gpushare_b"),
        BTreeSet::from(["gpushare_a_total".to_owned(), "gpushare_b".to_owned()])
    );
}

#[test]
fn variables_are_substituted_as_grafana_does() {
    let variables = BTreeMap::from([
        ("gpu".to_owned(), vec!["0".to_owned(), "1".to_owned()]),
        ("gpus".to_owned(), vec!["7".to_owned()]),
    ]);
    for (expr, want) in [
        ("x{gpu_index=~\"$gpu\"}", "x{gpu_index=~\"(0|1)\"}"),
        ("x{a=\"${gpus}\",b=\"[[gpu]]\"}", "x{a=\"7\",b=\"(0|1)\"}"),
        ("rate(x[$__rate_interval])", "rate(x[1m])"),
    ] {
        assert_eq!(substituted(expr, &variables), want);
    }
}
