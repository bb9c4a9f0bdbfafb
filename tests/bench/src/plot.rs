//! SVG bar charts of a results document, one file per experiment (`<dir>/<scenario>.svg`),
//! each with one or more panels: groups along the x axis (e.g. the number of low jobs), one
//! bar per system/mode in each group. The charts are drawn from the JSON alone, so a
//! scenario absent from a run simply has no chart.
//!
//! To plot a new scenario, add one extraction function to the marked section below and list
//! it in [`figures`]; the drawing code is generic over [`Panel`].

use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::SegmentValue;
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

/// E2-mixed (issue 18): `e2-mixed.modes[mode].metrics`, mixed priorities arriving on 4 GPUs.
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

fn draw_panel(panel: &Panel, area: &Area<'_>) -> Result<(), Box<dyn std::error::Error>> {
    // Modes in order of first appearance; each keeps one colour across groups.
    let mut modes: Vec<&str> = Vec::new();
    for (_, bars) in &panel.groups {
        for (mode, _) in bars {
            if !modes.contains(&mode.as_str()) {
                modes.push(mode);
            }
        }
    }
    // One slot per bar, one empty slot between groups.
    let mut slots: Vec<(usize, &str, f64)> = Vec::new(); // (slot, mode, value)
    let mut centres: Vec<(usize, &str)> = Vec::new(); // (slot, group label)
    let mut next = 0usize;
    for (group, bars) in &panel.groups {
        if bars.is_empty() {
            continue;
        }
        for (i, (mode, v)) in bars.iter().enumerate() {
            slots.push((next + i, mode, *v));
        }
        centres.push((next + (bars.len() - 1) / 2, group));
        next += bars.len() + 1;
    }
    let total = next.saturating_sub(1).max(1) as u32;
    let (lo, hi) = slots
        .iter()
        .fold((0f64, 0f64), |(lo, hi), &(_, _, v)| (lo.min(v), hi.max(v)));
    let span = (hi - lo).max(1e-9);
    let (y0, y1) = (
        if lo < 0.0 { lo - 0.1 * span } else { 0.0 },
        hi + 0.25 * span,
    );
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d((0u32..total).into_segmented(), y0..y1)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(total as usize + 1)
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(slot) => centres
                .iter()
                .find(|(s, _)| *s as u32 == *slot)
                .map(|(_, g)| g.to_string())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc(panel.y_label.as_str())
        .draw()?;
    for (index, mode) in modes.iter().enumerate() {
        let colour = Palette99::pick(index).to_rgba();
        let bars = slots
            .iter()
            .filter(|(_, m, _)| m == mode)
            .map(|&(slot, _, v)| {
                let slot = slot as u32;
                let mut bar = Rectangle::new(
                    [
                        (SegmentValue::Exact(slot), v),
                        (SegmentValue::Exact(slot + 1), 0.0),
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
    chart.draw_series(slots.iter().map(|&(slot, _, v)| {
        Text::new(
            format_value(v),
            (
                SegmentValue::CenterOf(slot as u32),
                v.max(0.0) + 0.02 * span,
            ),
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
