//! The `cluster` scenario's files: the JSON as run, a Markdown table per load level, and a
//! bar chart (`cluster.svg`, drawn with the bench's own [`crate::plot`]).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use plotters::prelude::*;

use crate::plot::{render_svg, Figure, Panel};

pub const SVG_NAME: &str = "cluster";
pub const SERIES_SVG: &str = "cluster-utilisation.svg";

fn minutes(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "–".into(), |s| format!("{:.1}", s / 60.0))
}

fn percent(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "–".into(), |f| format!("{:.1} %", f * 100.0))
}

pub fn markdown(results: &Value) -> String {
    let p = &results["parameters"];
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Cluster-scale simulation of kube-scheduler — simulated\n"
    );
    let list = |key: &str, scale: f64| {
        p["mix"][key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| format!("{}", v.as_f64().unwrap_or(f64::NAN) * scale))
            .collect::<Vec<_>>()
            .join("/")
    };
    let nodes = p["nodes"].as_u64().unwrap_or(0);
    let _ = writeln!(
        md,
        "**Every figure is simulated**: a discrete-event model of kube-scheduler (NodeResourcesFit \
         filter, LeastAllocated score, a search that stops at {} feasible nodes as kube-scheduler's \
         does for {nodes}, ties drawn at random) and of the arbiter's grant placement (the real \
         `place_memory_grant`, waiting grants placed oldest first); no cluster, arbiter or GPU \
         ran. {nodes} nodes × {} GPUs × {} GiB; pods of {} GiB at {} %, {:.0} % of them high \
         (one high pod per GPU); lognormal run time (median {:.0} min, σ {}); Poisson arrivals \
         for {} h; the steady window runs from {} h until arrivals stop (long pods are still \
         building up in it: each level's heading gives what the window is offered); seed {}. Machine: \
         {}, commit {}.\n",
        crate::kube_sim::kube::feasible_nodes_to_find(nodes as usize),
        p["gpus_per_node"],
        p["gpu_memory_gib"],
        list("memory_gib", 1.0),
        list("weights", 100.0),
        p["mix"]["high_fraction"].as_f64().unwrap_or(0.0) * 100.0,
        p["mix"]["duration_median_s"].as_f64().unwrap_or(0.0) / 60.0,
        p["mix"]["duration_sigma"],
        p["arrival_horizon_h"],
        p["warm_up_h"],
        p["seed"],
        results["machine"]["uname"].as_str().unwrap_or("?"),
        results["machine"]["git_commit"].as_str().unwrap_or("?"),
    );
    let _ = writeln!(
        md,
        "Modes: `gpushare` (kube-scheduler counts node totals of `gpushare.io/memory` and \
         `gpushare.io/high`; the node places each grant on one GPU, worst fit, or the pod waits \
         on the node), `gpushare-most-allocated` (the same, scored MostAllocated: nodes packed by \
         their totals), `gpu-aware` (an oracle scheduler that filters on a node's largest free \
         hole on one GPU: the upper bound), `whole-gpu` (`nvidia.com/gpu: 1`, a FIFO queue for \
         the cluster). Columns: *no GPU fits*: pods bound to a node where no single GPU could \
         hold them, and how long they waited there (minutes); *pending*: arrival to running, \
         every pod (minutes); utilisation and occupancy are time-weighted means over the steady \
         window; *stranded*: memory kube-scheduler counts as taken by pods waiting on a node; \
         *started/h*: pods started per hour in the steady window, against the arrivals; the \
         makespan (until the last pod ends) is mostly the longest pod's run. Whole GPUs serve at \
         most GPUs / mean run time pods an hour, whatever memory the pods ask for: past that \
         their queue grows as long as pods arrive, and its wait grows with the trace.\n"
    );
    for level in results["levels"].as_array().into_iter().flatten() {
        let _ =
            writeln!(
            md,
            "## Offered load {:.0} % of the cluster's GPU memory ({:.1} % in the steady window)\n",
            level["offered_load"].as_f64().unwrap_or(0.0) * 100.0,
            level["offered_in_steady_window"].as_f64().unwrap_or(f64::NAN) * 100.0,
        );
        md += "| mode | pods | no GPU fits | their wait mean / p50 / p95 / p99 | pending mean / p50 / p95 / p99 | memory used | GPUs occupied | stranded | started/h (arrivals/h) | makespan h |\n";
        md += "|---|---|---|---|---|---|---|---|---|---|\n";
        for (mode, m) in level["modes"].as_object().into_iter().flatten() {
            let w = &m["admitted_where_no_gpu_fits"];
            let nw = &w["node_wait_s"];
            let pe = &m["pending_s"];
            let _ = writeln!(
                md,
                "| {mode} | {} | {} ({}) | {} / {} / {} / {} | {} / {} / {} / {} | {} | {} | {} | {:.0} ({:.0}) | {:.1} |",
                m["pods"],
                w["pods"],
                percent(&w["fraction"]),
                minutes(&nw["mean"]),
                minutes(&nw["p50"]),
                minutes(&nw["p95"]),
                minutes(&nw["p99"]),
                minutes(&pe["mean"]),
                minutes(&pe["p50"]),
                minutes(&pe["p95"]),
                minutes(&pe["p99"]),
                percent(&m["steady"]["memory_utilisation"]),
                percent(&m["steady"]["gpu_occupancy"]),
                percent(&m["steady"]["stranded_memory"]),
                m["started_per_h_steady"].as_f64().unwrap_or(f64::NAN),
                m["arrivals_per_h"].as_f64().unwrap_or(f64::NAN),
                m["makespan_h"].as_f64().unwrap_or(f64::NAN),
            );
        }
        md += "\n";
    }
    let _ = writeln!(
        md,
        "![cluster](cluster.svg)\n\n![memory in use over time]({SERIES_SVG})"
    );
    md
}

/// Bars by load level (x) and mode: memory used, pods stranded on a node, mean pending.
pub fn figure(results: &Value) -> Figure {
    let panel = |title: &str, y_label: &str, value: &dyn Fn(&Value) -> Option<f64>| Panel {
        title: title.into(),
        y_label: y_label.into(),
        groups: results["levels"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|level| {
                let bars = level["modes"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(mode, m)| value(m).map(|v| (mode.clone(), v)))
                    .collect();
                let load = level["offered_load"].as_f64().unwrap_or(0.0) * 100.0;
                (format!("{load:.0} % offered"), bars)
            })
            .collect(),
    };
    let f = |v: &Value| v.as_f64();
    Figure {
        name: SVG_NAME.into(),
        panels: vec![
            panel(
                "cluster (simulated): GPU memory in use, steady window",
                "% of the cluster's memory",
                &|m| f(&m["steady"]["memory_utilisation"]).map(|x| x * 100.0),
            ),
            panel(
                "cluster (simulated): pods bound to a node where no GPU fits",
                "% of pods",
                &|m| f(&m["admitted_where_no_gpu_fits"]["fraction"]).map(|x| x * 100.0),
            ),
            panel(
                "cluster (simulated): those pods' wait on the node, p95",
                "minutes",
                &|m| {
                    Some(
                        f(&m["admitted_where_no_gpu_fits"]["node_wait_s"]["p95"]).unwrap_or(0.0)
                            / 60.0,
                    )
                },
            ),
            panel(
                "cluster (simulated): pending time of every pod, mean (log10 of minutes + 1)",
                "log10(1 + minutes)",
                &|m| f(&m["pending_s"]["mean"]).map(|s| (1.0 + s / 60.0).log10()),
            ),
        ],
    }
}

/// GPU memory in use over time, one panel per load level, one line per mode (the bench's bar
/// charts have no time axis).
pub fn utilisation_svg(results: &Value) -> Result<String, String> {
    let levels = results["levels"].as_array().cloned().unwrap_or_default();
    let p = &results["parameters"];
    let until_h = p["sample_until_h"].as_f64().unwrap_or(1.0);
    let total_gib = ["nodes", "gpus_per_node", "gpu_memory_gib"]
        .iter()
        .map(|k| p[*k].as_f64().unwrap_or(0.0))
        .product::<f64>()
        .max(1.0);
    let (width, height) = (960u32, 320u32);
    let mut svg = String::new();
    {
        let total = height * levels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (width, total)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((levels.len().max(1), 1));
        for (level, area) in levels.iter().zip(areas) {
            draw_series_panel(level, until_h, total_gib, &area).map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

fn draw_series_panel(
    level: &Value,
    until_h: f64,
    total_gib: f64,
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
) -> Result<(), Box<dyn std::error::Error>> {
    let offered = level["offered_load"].as_f64().unwrap_or(0.0) * 100.0;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("cluster (simulated): GPU memory in use, offered {offered:.0} %"),
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..until_h, 0f64..100f64)?;
    chart
        .configure_mesh()
        .x_desc("hours (arrivals stop at the steady window's end)")
        .y_desc("% of the cluster's memory")
        .draw()?;
    for (index, (mode, m)) in level["modes"].as_object().into_iter().flatten().enumerate() {
        let colour = Palette99::pick(index).to_rgba();
        let points: Vec<(f64, f64)> = m["series"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| Some((s["t_h"].as_f64()?, s["granted_gib"].as_f64()?)))
            .collect();
        chart
            .draw_series(std::iter::once(PathElement::new(
                points
                    .into_iter()
                    .map(|(t, gib)| (t, gib / total_gib * 100.0))
                    .collect::<Vec<_>>(),
                colour.stroke_width(2),
            )))?
            .label(mode.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// The JSON, the Markdown and the charts.
pub fn write(dir: &Path, results: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let text = serde_json::to_string_pretty(results).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(super::JSON_FILE), text + "\n")?;
    write_rendered(dir, results)
}

/// The Markdown and the chart of `results`.
pub fn write_rendered(dir: &Path, results: &Value) -> std::io::Result<()> {
    std::fs::write(dir.join(super::MARKDOWN_FILE), markdown(results))?;
    let fig = figure(results);
    let svg = render_svg(&fig).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(fig.file_name()), svg)?;
    let svg = utilisation_svg(results).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(SERIES_SVG), svg)
}
