//! deploy/grafana/gpushare.json as Grafana reads it. No Grafana can be installed
//! here, so the dashboard is read into a typed model of Grafana's dashboard schema
//! (grafana/grafana kinds/dashboard/dashboard_kind.cue, schema 0.0: the fields it
//! declares, the required ones required, unknown ones refused where the schema is
//! closed), its constraints checked (grid within 24 columns, unique panel ids,
//! non-empty panel types, a ref id per query), and every metric its PromQL names
//! must be one a running gpushare-arbiter serves on /metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_testkit::{binaries, Arbiter};
use serde::Deserialize;
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
    panels: Option<Vec<Panel>>,
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

/// `#Panel` (not a row, graph or heatmap panel: the dashboard uses none).
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

#[test]
fn the_dashboard_follows_grafanas_schema_and_lays_out_within_the_grid() {
    let d = dashboard();
    let panels = d.panels.expect("panels");
    assert!(!panels.is_empty());
    let mut ids = BTreeSet::new();
    let mut cells: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for p in &panels {
        let title = p.title.clone().unwrap_or_default();
        assert!(!p.kind.is_empty(), "{title}: an empty panel type");
        assert!(ids.insert(p.id.expect("a panel id")), "{title}: id reused");
        let g = p.grid_pos.as_ref().expect("gridPos");
        assert!(
            g.h > 0 && g.w > 0 && g.w <= 24 && g.x < 24 && g.x + g.w <= 24,
            "{title}: {g:?} leaves the 24-column grid"
        );
        for x in g.x..g.x + g.w {
            for y in g.y..g.y + g.h {
                let before = cells.insert((x, y), p.id.unwrap());
                assert!(before.is_none(), "{title} overlaps panel {before:?}");
            }
        }
        let targets = p.targets.as_ref().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let refs: BTreeSet<&str> = targets.iter().map(|t| t.ref_id.as_str()).collect();
        assert_eq!(refs.len(), targets.len(), "{title}: ref ids repeat");
    }
    // An unknown key is refused, as Grafana's closed schema refuses it.
    let mut bent: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/gpushare.json")).unwrap(),
    )
    .unwrap();
    bent["panels"][0]["gridpos"] = bent["panels"][0]["gridPos"].clone();
    assert!(serde_json::from_value::<Dashboard>(bent).is_err());
}

fn scrape(port: u16) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn every_metric_the_dashboard_queries_is_served_by_the_arbiter() {
    binaries::require(&["gpushare-arbiter"]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
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
    for p in dashboard().panels.unwrap() {
        for t in p.targets.unwrap() {
            let names = metric_names(&t.expr);
            assert!(!names.is_empty(), "{:?}: no gpushare metric", t.expr);
            queried.extend(names);
        }
    }
    let missing: Vec<&String> = queried
        .iter()
        .filter(|n| !served.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries {missing:?}, which the arbiter does not serve"
    );
    // What the dashboard is for (who uses the GPU, and how): each of these is on it.
    for needed in [
        "gpushare_gpu_utilization_ratio",
        "gpushare_gpu_utilization_10s_ratio",
        "gpushare_lease_memory_used_bytes",
        "gpushare_lease_memory_quota_bytes",
        "gpushare_lease_gpu_share_10s_ratio",
        "gpushare_lease_memory_refusals_total",
        "gpushare_admission_rejections_total",
        "gpushare_lease_token_cut_offs_total",
        "gpushare_build_info",
        "gpushare_queue_length",
    ] {
        assert!(queried.contains(needed), "the dashboard lacks {needed}");
    }
    drop(arbiter);
}

#[test]
fn metric_names_are_read_out_of_promql() {
    assert_eq!(
        metric_names("sum by (name) (rate(gpushare_a_total{x=\"gpushare\"}[5m])) / gpushare_b"),
        BTreeSet::from(["gpushare_a_total".to_owned(), "gpushare_b".to_owned()])
    );
}
