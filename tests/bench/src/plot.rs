//! SVG bar charts of a results document, one file per experiment (`<dir>/<scenario>.svg`),
//! each with one or more panels: groups along the x axis (e.g. the number of low jobs), one
//! bar per system/mode in each group. The charts are drawn from the JSON alone, so a
//! scenario absent from a run simply has no chart.
//!
//! To plot a new scenario, add one extraction function to the marked section below and list
//! it in [`figures`]; the drawing code is generic over [`Panel`].

use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord, ValueFormatter};
use plotters::coord::types::RangedCoordu32;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

/// One bar chart: a title, the y axis label, and per group (x axis) the bars `(mode, value)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<(String, Vec<(String, f64)>)>,
}

/// One SVG file (`<name>.svg`): its panels, stacked top to bottom.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    pub name: String,
    pub panels: Vec<Panel>,
}

impl Figure {
    pub fn file_name(&self) -> String {
        format!("{}.svg", self.name)
    }
}

impl Panel {
    fn is_empty(&self) -> bool {
        self.groups.iter().all(|(_, bars)| bars.is_empty())
    }
}

/// A figure from its panels, or `None` when none of them has a bar.
fn figure(name: &str, panels: Vec<Option<Panel>>) -> Option<Figure> {
    let panels: Vec<Panel> = panels
        .into_iter()
        .flatten()
        .filter(|p| !p.is_empty())
        .collect();
    (!panels.is_empty()).then(|| Figure {
        name: name.into(),
        panels,
    })
}

// ---------------------------------------------------------------------------------------------
// Data extraction, one function per scenario. THE SHAPES OF e1, e2, e3 AND e5 ARE GUESSES from
// the issue text (scenarios.<name>[mode][case].metrics.<key>, or scenarios.<name>[mode].metrics
// for one case per mode): adjust the keys here. Each returns `None` when its scenario is absent.
// ---------------------------------------------------------------------------------------------

/// Every figure the results hold, in a fixed order.
pub fn figures(results: &Value) -> Vec<Figure> {
    let s = &results["scenarios"];
    [
        priority(&s["priority"]),
        shares(&s["shares"]),
        kernels(&s["kernels"]),
        kernels_inference(&s["kernels"]),
        e1(&s["e1"]),
        e2(&s["e2"]),
        e2_mixed(&s["e2-mixed"]),
        e3(&s["e3"]),
        e5(&s["e5"]),
        start_overhead(&results["control_path"]),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// `scenario[mode][case].metrics[key]` (or `scenario[mode].metrics[key]`, one group named
/// `single`) as groups by case, bars by mode; modes in `skip` are left out.
fn by_case_and_mode(
    scenario: &Value,
    key: &str,
    single: &str,
    skip: &[&str],
    title: &str,
    y_label: &str,
) -> Option<Panel> {
    let modes = scenario.as_object()?;
    let mut groups: Vec<(String, Vec<(String, f64)>)> = Vec::new();
    let mut add =
        |group: &str, mode: &str, value: f64| match groups.iter_mut().find(|(g, _)| g == group) {
            Some((_, bars)) => bars.push((mode.into(), value)),
            None => groups.push((group.into(), vec![(mode.into(), value)])),
        };
    for (mode, cases) in modes {
        if skip.contains(&mode.as_str()) {
            continue;
        }
        if let Some(v) = cases["metrics"][key].as_f64() {
            add(single, mode, v);
            continue;
        }
        for (case, body) in cases.as_object().into_iter().flatten() {
            if let Some(v) = body["metrics"][key].as_f64() {
                add(case, mode, v);
            }
        }
    }
    let panel = Panel {
        title: title.into(),
        y_label: y_label.into(),
        groups,
    };
    (!panel.is_empty()).then_some(panel)
}

/// `by_length[length][mode].metrics[key]` as groups by low launch length (in
/// [`crate::report::sweep_rows`] order and labels), one bar per mode; the 250 ms round robin,
/// at +2,600 % and more, is left out so the rest stay readable (it is in the table).
fn sweep_panel(kernels: &Value, by_length: &Value, key: &str, title: &str, y_label: &str) -> Panel {
    Panel {
        title: title.into(),
        y_label: y_label.into(),
        groups: crate::report::sweep_rows(kernels, by_length)
            .into_iter()
            .map(|row| {
                let bars = row
                    .modes
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter(|(mode, _)| mode.as_str() != "round-robin-250ms")
                    .filter_map(|(mode, case)| Some((mode.clone(), case["metrics"][key].as_f64()?)))
                    .collect();
                (row.label, bars)
            })
            .collect(),
    }
}

/// `kernels.low_kernel_us[length][mode].metrics`: the priority high job's slowdown and the
/// idle time the low job captured, by low launch length.
fn kernels(s: &Value) -> Option<Figure> {
    let by_length = &s["low_kernel_us"];
    by_length.as_object()?;
    figure(
        "kernels",
        vec![
            Some(sweep_panel(
                s,
                by_length,
                "high_mean_slowdown_percent",
                "kernels: high job iteration slowdown vs alone, by low launch length (simulated)",
                "mean slowdown %",
            )),
            Some(sweep_panel(
                s,
                by_length,
                "idle_captured_percent",
                "kernels: low job's GPU time over the time the high job leaves idle (simulated)",
                "idle captured %",
            )),
        ],
    )
}

/// `kernels.inference.low_kernel_us[length][mode].metrics`: E3's inference job's p99
/// request latency slowdown, by low launch length.
fn kernels_inference(s: &Value) -> Option<Figure> {
    let by_length = &s["inference"]["low_kernel_us"];
    by_length.as_object()?;
    figure(
        "kernels-inference",
        vec![Some(sweep_panel(
            s,
            by_length,
            "high_p99_slowdown_percent",
            "kernels: inference p99 latency slowdown vs alone, by low launch length (simulated)",
            "p99 slowdown %",
        ))],
    )
}

/// `priority[mode][low jobs].metrics`: the high job's slowdown and the idle time captured.
fn priority(s: &Value) -> Option<Figure> {
    let with_low_jobs = |p: Option<Panel>| {
        p.map(|mut p| {
            for (g, _) in &mut p.groups {
                *g = format!("{g} low job{}", if g == "1" { "" } else { "s" });
            }
            p
        })
    };
    figure(
        "priority",
        vec![
            with_low_jobs(by_case_and_mode(
                s,
                "high_mean_slowdown_percent",
                "all",
                &["alone"],
                "priority: high job iteration slowdown vs alone (simulated)",
                "mean slowdown %",
            )),
            with_low_jobs(by_case_and_mode(
                s,
                "idle_captured_percent",
                "all",
                &["alone"],
                "priority: idle GPU time captured by the low jobs (simulated)",
                "idle captured %",
            )),
        ],
    )
}

/// `shares[mode].{pair,limited}.metrics`: the measured shares beside their targets (the pair's
/// requests 0.3 and 0.6 in proportion, the limit 0.5).
fn shares(s: &Value) -> Option<Figure> {
    let modes = s.as_object()?;
    let cases = [
        ("pair, request 0.3", "pair", "small_share", 0.3 / 0.9),
        ("pair, request 0.6", "pair", "large_share", 0.6 / 0.9),
        ("alone, limit 0.5", "limited", "share", 0.5),
    ];
    let groups = cases
        .iter()
        .map(|&(group, case, key, target)| {
            let mut bars: Vec<(String, f64)> = modes
                .iter()
                .filter_map(|(mode, c)| Some((mode.clone(), c[case]["metrics"][key].as_f64()?)))
                .collect();
            if !bars.is_empty() {
                bars.push(("target".into(), target));
            }
            (group.to_string(), bars)
        })
        .collect();
    figure(
        "shares",
        vec![Some(Panel {
            title: "shares: measured GPU share vs target (simulated)".into(),
            y_label: "share of GPU time".into(),
            groups,
        })],
    )
}

/// `scenario[case][mode].metrics[key]` as groups by case, bars by mode (the nesting E1 uses);
/// modes in `skip` and entries that are not objects are left out.
fn by_case_then_mode(
    scenario: &Value,
    key: &str,
    skip: &[&str],
    title: &str,
    y_label: &str,
) -> Option<Panel> {
    let groups: Vec<(String, Vec<(String, f64)>)> = scenario
        .as_object()?
        .iter()
        .map(|(case, modes)| {
            let bars = modes
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(mode, _)| !skip.contains(&mode.as_str()))
                .filter_map(|(mode, body)| Some((mode.clone(), body["metrics"][key].as_f64()?)))
                .collect();
            (case.clone(), bars)
        })
        .filter(|(_, bars): &(String, Vec<(String, f64)>)| !bars.is_empty())
        .collect();
    let panel = Panel {
        title: title.into(),
        y_label: y_label.into(),
        groups,
    };
    (!panel.is_empty()).then_some(panel)
}

/// E1 (Wang Fig 4/5): `e1.pairs[pair][mode].metrics`, pairs of one high and one low job.
fn e1(s: &Value) -> Option<Figure> {
    let pairs = &s["pairs"];
    figure(
        "e1",
        vec![
            by_case_then_mode(
                pairs,
                "high_mean_slowdown_percent",
                &["alone", "exclusive"],
                "E1: high job iteration slowdown vs exclusive, per pair (simulated)",
                "mean slowdown %",
            ),
            by_case_then_mode(
                pairs,
                "low_throughput_fraction",
                &["alone", "exclusive"],
                "E1: low job throughput over its exclusive throughput (simulated)",
                "fraction of exclusive",
            ),
        ],
    )
}

/// E2 (Wang Table 4): `e2.modes[mode].metrics`, 12 jobs arriving on 4 GPUs.
fn e2(s: &Value) -> Option<Figure> {
    let modes = &s["modes"];
    figure(
        "e2",
        vec![
            by_case_and_mode(
                modes,
                "makespan_s",
                "12 jobs, 4 GPUs",
                &[],
                "E2: total completion time of 12 jobs on 4 GPUs (simulated)",
                "seconds",
            ),
            by_case_and_mode(
                modes,
                "mean_gpu_utilisation_percent",
                "12 jobs, 4 GPUs",
                &[],
                "E2: mean GPU utilisation, sampled every second through NVML (simulated)",
                "utilisation %",
            ),
        ],
    )
}

/// E2-mixed: `e2-mixed.modes[mode].metrics`, mixed priorities arriving on 4 GPUs.
fn e2_mixed(s: &Value) -> Option<Figure> {
    let modes = &s["modes"];
    let panel = |key: &str, title: &str, y_label: &str| {
        by_case_and_mode(modes, key, "12 jobs, 4 GPUs", &[], title, y_label)
    };
    figure(
        "e2-mixed",
        vec![
            panel(
                "mean_completion_s",
                "E2-mixed: mean job completion time, queueing included (simulated)",
                "seconds",
            ),
            panel(
                "high_mean_slowdown_percent",
                "E2-mixed: high-priority jobs' mean slowdown against alone (simulated)",
                "slowdown %",
            ),
            panel(
                "mean_gpu_utilisation_percent",
                "E2-mixed: mean GPU utilisation, sampled every second through NVML (simulated)",
                "utilisation %",
            ),
        ],
    )
}

/// E3: `e3.modes[mode].metrics`, inference p99 latency next to a low job.
fn e3(s: &Value) -> Option<Figure> {
    figure(
        "e3",
        vec![by_case_and_mode(
            &s["modes"],
            "high_p99_ms",
            "inference + saturating low job",
            &[],
            "E3: inference request p99 latency (simulated)",
            "p99 latency ms",
        )],
    )
}

/// `scenario[case].metrics[key]` for one mode (E5 runs gpushare only): a group per case.
fn by_case(scenario: &Value, key: &str, mode: &str, title: &str, y_label: &str) -> Option<Panel> {
    let groups: Vec<(String, Vec<(String, f64)>)> = scenario
        .as_object()?
        .iter()
        .filter_map(|(case, body)| {
            let value = body["metrics"][key].as_f64()?;
            Some((case.clone(), vec![(mode.to_string(), value)]))
        })
        .collect();
    let panel = Panel {
        title: title.into(),
        y_label: y_label.into(),
        groups,
    };
    (!panel.is_empty()).then_some(panel)
}

/// E5: `e5.low_clients[n].metrics` (1 high + n low on one GPU) and `e5.gpus[g].metrics`
/// (1 high + 1 low on each of g GPUs), gpushare only.
fn e5(s: &Value) -> Option<Figure> {
    figure(
        "e5",
        vec![
            by_case(
                &s["low_clients"],
                "high_median_slowdown_percent",
                "gpushare",
                "E5: high job slowdown vs number of low clients on its GPU (simulated)",
                "slowdown %",
            ),
            by_case(
                &s["gpus"],
                "arbiter_cpu_percent",
                "gpushare",
                "E5: arbiter CPU use vs number of GPUs, 1 high + 1 low each",
                "% of one core",
            ),
        ],
    )
}

/// E4: container start medians from `control_path.start_overhead` (see `control_path`).
fn start_overhead(c: &Value) -> Option<Figure> {
    let groups: Vec<(String, Vec<(String, f64)>)> = c["start_overhead"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(engine, medians): (&String, &Value)| {
            let bars: Vec<(String, f64)> = medians["median_ms"]
                .as_object()?
                .iter()
                .filter_map(|(runtime, v)| Some((runtime.clone(), v.as_f64()?)))
                .collect();
            Some((engine.clone(), bars))
        })
        .collect();
    figure(
        "start-overhead",
        vec![Some(Panel {
            title: "E4: container start, median `run --rm … true` (real runtimes)".into(),
            y_label: "ms".into(),
            groups,
        })],
    )
}

// ---------------------------------------------------------------------------------------------
// Drawing (generic).
// ---------------------------------------------------------------------------------------------

const PANEL_WIDTH: u32 = 960;
const PANEL_HEIGHT: u32 = 420;

/// The figure as SVG text.
pub fn render_svg(fig: &Figure) -> Result<String, String> {
    let mut svg = String::new();
    {
        let height = PANEL_HEIGHT * fig.panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (PANEL_WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((fig.panels.len().max(1), 1));
        for (panel, area) in fig.panels.iter().zip(areas) {
            draw_panel(panel, &area).map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// How a panel's y axis is scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
enum YScale {
    /// From `from` (0, or below the lowest negative value) to `to`, with room above for the
    /// values and the legend.
    Linear { from: f64, to: f64 },
    /// Whole decades from `from` to `to`: every value is positive and the largest is at least
    /// [`WIDE_RANGE`] times the smallest, so on a linear axis the small bars (gpushare's +1.5 %
    /// beside a 250 ms round robin's +8,000 %) would be flat lines.
    Log { from: f64, to: f64 },
}

/// The largest value over the smallest from which a panel is drawn on a log scale.
const WIDE_RANGE: f64 = 50.0;

/// The y axis for `values` (a panel's bars).
fn y_scale(values: &[f64]) -> YScale {
    let (lo, hi) = values
        .iter()
        .fold((0f64, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let smallest = values.iter().copied().fold(f64::INFINITY, f64::min);
    if smallest > 0.0 && hi / smallest >= WIDE_RANGE {
        // A decade below the smallest value, so its bar is still a decade tall; the decade(s)
        // above the largest hold its label and the legend.
        return YScale::Log {
            from: 10f64.powf(smallest.log10().floor() - 1.0),
            to: 10f64.powf((hi * 4.0).log10().ceil()),
        };
    }
    let span = (hi - lo).max(1e-9);
    YScale::Linear {
        from: if lo < 0.0 { lo - 0.1 * span } else { 0.0 },
        to: hi + 0.25 * span,
    }
}

/// The bars of one panel, laid out: one slot per bar, one empty slot between groups.
struct Layout<'a> {
    /// Modes in order of first appearance; each keeps one colour across groups.
    modes: Vec<&'a str>,
    /// (slot, mode, value)
    slots: Vec<(usize, &'a str, f64)>,
    /// (slot, group label), the slot under which the group's label goes.
    centres: Vec<(usize, &'a str)>,
    total: u32,
}

fn layout(panel: &Panel) -> Layout<'_> {
    let mut modes: Vec<&str> = Vec::new();
    for (_, bars) in &panel.groups {
        for (mode, _) in bars {
            if !modes.contains(&mode.as_str()) {
                modes.push(mode);
            }
        }
    }
    let mut slots = Vec::new();
    let mut centres = Vec::new();
    let mut next = 0usize;
    for (group, bars) in &panel.groups {
        if bars.is_empty() {
            continue;
        }
        for (i, (mode, v)) in bars.iter().enumerate() {
            slots.push((next + i, mode.as_str(), *v));
        }
        centres.push((next + (bars.len() - 1) / 2, group.as_str()));
        next += bars.len() + 1;
    }
    Layout {
        modes,
        slots,
        centres,
        total: next.saturating_sub(1).max(1) as u32,
    }
}

fn draw_panel(panel: &Panel, area: &Area<'_>) -> Result<(), Box<dyn std::error::Error>> {
    let layout = layout(panel);
    let values: Vec<f64> = layout.slots.iter().map(|&(_, _, v)| v).collect();
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&panel.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60);
    let x = (0u32..layout.total).into_segmented();
    match y_scale(&values) {
        YScale::Linear { from, to } => {
            // The values' own span, as before the log axis existed (the same charts, byte for byte).
            let (lo, hi) = values
                .iter()
                .fold((0f64, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let span = (hi - lo).max(1e-9);
            let chart = builder.build_cartesian_2d(x, from..to)?;
            let label_at = |v: f64| v.max(0.0) + 0.02 * span;
            draw_bars(
                chart,
                panel.y_label.clone(),
                &layout,
                area,
                0.0,
                label_at,
                None,
            )
        }
        YScale::Log { from, to } => {
            let chart = builder.build_cartesian_2d(x, (from..to).log_scale())?;
            let y_label = format!("{} (log scale)", panel.y_label);
            let label_at = |v: f64| v * 1.12;
            draw_bars(chart, y_label, &layout, area, from, label_at, Some(decade))
        }
    }
}

/// The mesh, the bars (from `base` up), each value above its bar (at `label_at(value)`) and
/// the legend, on either y axis.
fn draw_bars<'a, Y>(
    mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<SegmentedCoord<RangedCoordu32>, Y>>,
    y_label: String,
    layout: &Layout<'_>,
    area: &Area<'_>,
    base: f64,
    label_at: impl Fn(f64) -> f64,
    y_ticks: Option<fn(&f64) -> String>,
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let centres = &layout.centres;
    let x_label = |x: &SegmentValue<u32>| match x {
        SegmentValue::CenterOf(slot) => centres
            .iter()
            .find(|(s, _)| *s as u32 == *slot)
            .map(|(_, g)| g.to_string())
            .unwrap_or_default(),
        _ => String::new(),
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh()
        .x_labels(layout.total as usize + 1)
        .x_label_formatter(&x_label)
        .y_desc(y_label);
    if let Some(format) = &y_ticks {
        mesh.y_label_formatter(format);
    }
    mesh.draw()?;
    for (index, mode) in layout.modes.iter().enumerate() {
        let colour = Palette99::pick(index).to_rgba();
        let bars = layout
            .slots
            .iter()
            .filter(|(_, m, _)| m == mode)
            .map(|&(slot, _, v)| {
                let slot = slot as u32;
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(slot), v),
                        (SegmentValue::Exact(slot + 1), base),
                    ],
                    colour.filled(),
                );
                bar.set_margin(0, 0, 3, 3);
                bar
            });
        chart
            .draw_series(bars)?
            .label(*mode)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled()));
    }
    // The values above the bars, so the chart can be read without the table.
    chart.draw_series(layout.slots.iter().map(|&(slot, _, v)| {
        Text::new(
            format_value(v),
            (SegmentValue::CenterOf(slot as u32), label_at(v)),
            ("sans-serif", 11)
                .into_font()
                .into_text_style(area)
                .pos(Pos::new(HPos::Center, VPos::Bottom)),
        )
    }))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// A log axis's tick (a power of ten) as written: 0.1, 1, 10, 10000.
fn decade(v: &f64) -> String {
    let rounded = (v * 1e6).round() / 1e6;
    format!("{rounded}")
}

fn format_value(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Writes every figure of `results` into `dir`; returns the files written.
pub fn write_all(dir: &Path, results: &Value) -> std::io::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for fig in figures(results) {
        let svg = render_svg(&fig).map_err(std::io::Error::other)?;
        let path = dir.join(fig.file_name());
        std::fs::write(&path, svg)?;
        written.push(path);
    }
    Ok(written)
}

/// A Markdown line linking each figure (the same list `write_all` writes).
pub fn markdown_links(results: &Value) -> String {
    let figures = figures(results);
    if figures.is_empty() {
        return String::new();
    }
    let mut md = String::from("## Charts\n\n");
    for fig in figures {
        md += &format!("![{}]({})\n\n", fig.name, fig.file_name());
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Value {
        json!({"scenarios": {
            "priority": {
                "alone": {"0": {"metrics": {"high_mean_ms": 8.0}}},
                "uncontrolled": {
                    "1": {"metrics": {"high_mean_slowdown_percent": 70.0, "idle_captured_percent": 95.0}},
                    "2": {"metrics": {"high_mean_slowdown_percent": 120.0, "idle_captured_percent": 96.0}},
                },
                "gpushare": {
                    "1": {"metrics": {"high_mean_slowdown_percent": 1.5, "idle_captured_percent": 91.0}},
                    "2": {"metrics": {"high_mean_slowdown_percent": -0.5, "idle_captured_percent": 90.0}},
                },
            },
            "shares": {
                "gpushare": {
                    "pair": {"metrics": {"small_share": 0.33, "large_share": 0.66, "share_ratio": 2.0}},
                    "limited": {"metrics": {"share": 0.5, "limit": 0.5}},
                },
            },
        }})
    }

    #[test]
    fn extraction_groups_by_case_and_skips_absent_scenarios() {
        let figs = figures(&sample());
        let names: Vec<&str> = figs.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["priority", "shares"]);
        let slowdown = &figs[0].panels[0];
        assert_eq!(
            slowdown.groups,
            vec![
                (
                    "1 low job".to_string(),
                    vec![("uncontrolled".into(), 70.0), ("gpushare".into(), 1.5)]
                ),
                (
                    "2 low jobs".to_string(),
                    vec![("uncontrolled".into(), 120.0), ("gpushare".into(), -0.5)]
                ),
            ]
        );
        assert_eq!(figs[0].panels[1].groups[1].1[1], ("gpushare".into(), 90.0));
        let shares = &figs[1].panels[0].groups;
        assert_eq!(
            shares[0].1,
            vec![("gpushare".into(), 0.33), ("target".into(), 0.3 / 0.9)]
        );
        assert_eq!(
            shares[2].1,
            vec![("gpushare".into(), 0.5), ("target".into(), 0.5)]
        );
        assert!(figures(&json!({})).is_empty());
        assert!(figures(&json!({"scenarios": {"e1": {"x": 1}}})).is_empty());
    }

    #[test]
    fn guessed_shapes_of_the_other_experiments() {
        let results = json!({"scenarios": {
            "e1": {"pairs": {"vgg16+mobilenet": {"gpushare": {"metrics": {"high_mean_slowdown_percent": 3.0}}}}},
            "e2": {"modes": {"exclusive": {"metrics": {"makespan_s": 100.0}}, "gpushare": {"metrics": {"makespan_s": 70.0}}}},
        }});
        let figs = figures(&results);
        assert_eq!(figs.len(), 2);
        assert_eq!(figs[0].panels[0].groups[0].0, "vgg16+mobilenet");
        assert_eq!(
            figs[1].panels[0].groups,
            vec![(
                "12 jobs, 4 GPUs".to_string(),
                vec![("exclusive".into(), 100.0), ("gpushare".into(), 70.0)]
            )]
        );
    }

    #[test]
    fn wide_positive_ranges_get_a_log_axis() {
        let log = |from: f64, to: f64| YScale::Log { from, to };
        let cases: [(&[f64], YScale); 6] = [
            // priority.svg: gpushare's +1.5 % beside the 250 ms round robin's +8,134 %.
            (&[1.53, 70.5, 2658.0, 8133.6], log(0.1, 100_000.0)),
            // Exactly WIDE_RANGE apart.
            (&[2.0, 100.0], log(0.1, 1000.0)),
            // Narrower: linear from 0 with a quarter of the span above.
            (
                &[2.0, 99.0],
                YScale::Linear {
                    from: 0.0,
                    to: 99.0 + 0.25 * 99.0,
                },
            ),
            (
                &[0.33, 0.66, 0.5],
                YScale::Linear {
                    from: 0.0,
                    to: 0.66 + 0.25 * 0.66,
                },
            ),
            // A zero or negative value has no logarithm: linear, below the lowest.
            (
                &[-0.3, 64.0],
                YScale::Linear {
                    from: -0.3 - 0.1 * 64.3,
                    to: 64.0 + 0.25 * 64.3,
                },
            ),
            (
                &[0.0, 5000.0],
                YScale::Linear {
                    from: 0.0,
                    to: 6250.0,
                },
            ),
        ];
        for (values, expected) in cases {
            let got = y_scale(values);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            let same = match (got, expected) {
                (YScale::Log { from, to }, YScale::Log { from: f, to: t })
                | (YScale::Linear { from, to }, YScale::Linear { from: f, to: t }) => {
                    close(from, f) && close(to, t)
                }
                _ => false,
            };
            assert!(same, "{values:?}: {got:?}, expected {expected:?}");
        }
    }

    #[test]
    fn a_log_axis_says_so_and_keeps_every_bar_above_its_floor() {
        let results = json!({"scenarios": {"priority": {
            "round-robin-250ms": {"1": {"metrics": {"high_mean_slowdown_percent": 2658.0}}},
            "gpushare": {"1": {"metrics": {"high_mean_slowdown_percent": 1.5}}},
        }}});
        let fig = &figures(&results)[0];
        let svg = render_svg(fig).unwrap();
        assert!(svg.contains("mean slowdown % (log scale)"), "{svg}");
        assert!(
            svg.contains("\n1.5\n</text>") && svg.contains("\n2658\n</text>"),
            "{svg}"
        );
        // gpushare's bar is over a decade tall (0.1 to 1.5), not a line.
        let heights: Vec<f64> = svg
            .split("<rect")
            .skip(1)
            .filter(|r| !r.contains("fill=\"#FFFFFF\"") && r.contains("opacity=\"1\""))
            .filter_map(|r| r.split("height=\"").nth(1)?.split('"').next()?.parse().ok())
            .collect();
        assert!(
            heights.iter().filter(|&&h| h > 20.0).count() >= 2,
            "{heights:?}"
        );
    }

    #[test]
    fn renders_svg_files_with_titles() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_all(dir.path(), &sample()).unwrap();
        assert_eq!(written.len(), 2);
        let svg = std::fs::read_to_string(dir.path().join("priority.svg")).unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(
            svg.contains("priority: high job iteration slowdown"),
            "{svg}"
        );
        assert!(
            svg.contains("gpushare") && svg.contains("2 low jobs"),
            "{svg}"
        );
        assert!(svg.matches("<rect").count() >= 8, "{svg}");
        let svg = std::fs::read_to_string(dir.path().join("shares.svg")).unwrap();
        assert!(svg.contains("shares: measured GPU share vs target"));
        let md = markdown_links(&sample());
        assert!(md.contains("![priority](priority.svg)"), "{md}");
    }

    #[test]
    fn kernels_charts_by_launch_length_for_both_high_jobs() {
        let case = |v: f64| {
            json!({"metrics": {"high_mean_slowdown_percent": v, "idle_captured_percent": 90.0,
            "high_p99_slowdown_percent": v * 2.0}})
        };
        let by_length = json!({
            "50000-graph": {"gpushare": case(3.0), "round-robin-250ms": case(2600.0)},
            "100": {"gpushare": case(0.5), "gpushare-before": case(0.6)},
        });
        let results = json!({"scenarios": {"kernels": {
            "lows": {"50000-graph": {"label": "50 ms graphs (10 × 5 ms)"}, "100": {"label": "0.1 ms kernels"}},
            "low_kernel_us": by_length.clone(),
            "inference": {"low_kernel_us": by_length},
        }}});
        let figs = figures(&results);
        let names: Vec<&str> = figs.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["kernels", "kernels-inference"]);
        assert_eq!(
            figs[0].panels[0].groups,
            vec![
                (
                    "0.1 ms kernels".to_string(),
                    vec![("gpushare".into(), 0.5), ("gpushare-before".into(), 0.6)]
                ),
                (
                    "50 ms graphs (10 × 5 ms)".to_string(),
                    vec![("gpushare".into(), 3.0)]
                ),
            ]
        );
        assert_eq!(
            figs[1].panels[0].groups[1].1,
            vec![("gpushare".into(), 6.0)]
        );
        // Results from before the sweep had graphs: one chart, labelled by milliseconds.
        let old = json!({"scenarios": {"kernels": {"low_kernel_us": {"50000": {"gpushare": case(64.0)}}}}});
        let figs = figures(&old);
        assert_eq!(figs.len(), 1);
        assert_eq!(figs[0].panels[0].groups[0].0, "50 ms");
    }
}
