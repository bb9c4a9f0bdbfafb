//! The results files: the machine, every parameter, each case's figures and raw reports
//! (JSON), and the tables a reader wants (Markdown). Every figure is labelled simulated.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

pub const JSON_FILE: &str = "compute-isolation.json";
pub const MARKDOWN_FILE: &str = "compute-isolation.md";

/// `uname -a`, the CPU count, the date and the git commit of the sources.
pub fn machine() -> Value {
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    json!({
        "uname": run("uname", &["-a"]),
        "nproc": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "date": run("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "git_commit": run("git", &["rev-parse", "HEAD"]),
        "git_dirty": run("git", &["status", "--porcelain"]).map(|s| !s.is_empty()),
    })
}

/// A figure with `digits` decimals and its unit, or a dash where the case has none.
fn cell(v: &Value, key: &str, digits: usize, unit: &str) -> String {
    v[key]
        .as_f64()
        .map_or_else(|| "–".into(), |x| format!("{x:.digits$}{unit}"))
}

/// The Markdown tables for a results document (as written to the JSON file).
pub fn markdown(results: &Value) -> String {
    let mut md = String::new();
    let machine = &results["machine"];
    let _ = writeln!(
        md,
        "# Compute isolation on the simulated GPU\n\n\
         **Every figure is simulated**: GPU time is the simgpu model's, not a device's. \
         Machine: `{}`, {} CPUs, {}, commit {}. Parameters and raw reports: `{JSON_FILE}`.\n",
        machine["uname"].as_str().unwrap_or("?"),
        machine["nproc"],
        machine["date"].as_str().unwrap_or("?"),
        machine["git_commit"].as_str().unwrap_or("?"),
    );
    if let Some(settings) = results["parameters"]["gpushare_settings"].as_array() {
        if !settings.is_empty() {
            let lines: Vec<&str> = settings.iter().filter_map(Value::as_str).collect();
            md += &format!(
                "The gpushare mode ran with non-default scheduler settings: `{}`.\n\n",
                lines.join("`, `")
            );
        }
    }
    if let Some(priority) = results["scenarios"]["priority"].as_object() {
        md += "## Scenario `priority` (simulated)\n\n\
               A high-priority training-like job (50 lognormal kernels, median 100 µs, then a \
               CPU gap) with N saturating low-priority jobs (100 µs kernels). The high job's \
               iteration time is the period from one iteration's start to the next (burst and \
               gap); its GPU phase (first launch until completion seen) is the stricter figure \
               beside it. Slowdowns are against the high job alone; start latency is from just \
               before an iteration's first launch until that kernel ran (the preemption \
               latency); idle captured is the low jobs' GPU time over the GPU time the high job \
               leaves idle alone.\n\n\
               | mode | low jobs | iteration ms | slowdown | iteration p99 ms | p99 slowdown | GPU phase slowdown | GPU phase p99 slowdown | start p50 µs | start p99 µs | low GPU share | idle captured |\n\
               |---|---|---|---|---|---|---|---|---|---|---|---|\n";
        for (mode, cases) in priority {
            let Some(cases) = cases.as_object() else {
                continue;
            };
            for (low_jobs, case) in cases {
                let m = &case["metrics"];
                let _ = writeln!(
                    md,
                    "| {mode} | {low_jobs} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    cell(m, "high_mean_ms", 2, ""),
                    cell(m, "high_mean_slowdown_percent", 1, "%"),
                    cell(m, "high_p99_ms", 2, ""),
                    cell(m, "high_p99_slowdown_percent", 1, "%"),
                    cell(m, "high_gpu_phase_slowdown_percent", 1, "%"),
                    cell(m, "high_gpu_phase_p99_slowdown_percent", 1, "%"),
                    cell(m, "high_start_p50_us", 1, ""),
                    cell(m, "high_start_p99_us", 1, ""),
                    cell(m, "low_gpu_fraction", 3, ""),
                    cell(m, "idle_captured_percent", 1, "%"),
                );
            }
        }
        let _ = writeln!(
            md,
            "\nLow kernels: {} µs each (the granularity a preempted low job drains at).\n",
            results["parameters"]["low_kernel_us"]
        );
    }
    md += &kernels_markdown(&results["scenarios"]["kernels"]);
    if let Some(shares) = results["scenarios"]["shares"].as_object() {
        md += "## Scenario `shares` (simulated)\n\n\
               `pair`: two saturating low jobs with compute requests 0.3 and 0.6 (limit 1.0); \
               `limited`: one saturating low job alone with limit 0.5.\n\n\
               | mode | case | shares | ratio (0.6 / 0.3) |\n|---|---|---|---|\n";
        for (mode, cases) in shares {
            let pair = &cases["pair"]["metrics"];
            let _ = writeln!(
                md,
                "| {mode} | pair | {} / {} | {} |",
                cell(pair, "small_share", 3, ""),
                cell(pair, "large_share", 3, ""),
                cell(pair, "share_ratio", 2, ""),
            );
            let limited = &cases["limited"]["metrics"];
            let _ = writeln!(
                md,
                "| {mode} | limited 0.5 | {} | – |",
                cell(limited, "share", 3, "")
            );
        }
    }
    if let Some(pairs) = results["scenarios"]["e1"]["pairs"].as_object() {
        md += "## E1: training pairs (simulated)\n\n\
               One high- and one low-priority training-like job, each from five profiles that \
               stand in for VGG11/16/19, MobileNet and SqueezeNet (shapes, not measurements of \
               those networks; see `profiles.rs`). High slowdown: iteration time (burst and \
               CPU gap) against the high job alone; low throughput: iterations/s over the low \
               job's own exclusive run. `alone` is the exclusive runs.\n\n\
               | pair (high + low) | mode | high iteration ms | mean slowdown | p99 slowdown | low throughput / exclusive | low GPU share |\n\
               |---|---|---|---|---|---|---|\n";
        for (pair, modes) in pairs {
            let Some(modes) = modes.as_object() else {
                continue;
            };
            for (mode, case) in modes.iter().filter(|(_, c)| c.is_object()) {
                let m = &case["metrics"];
                let _ = writeln!(
                    md,
                    "| {pair} | {mode} | {} | {} | {} | {} | {} |",
                    cell(m, "high_mean_ms", 2, ""),
                    cell(m, "high_mean_slowdown_percent", 1, "%"),
                    cell(m, "high_p99_slowdown_percent", 1, "%"),
                    cell(m, "low_throughput_fraction", 3, ""),
                    cell(m, "low_gpu_fraction", 3, ""),
                );
            }
        }
        md += "\n";
    }
    if let Some(modes) = results["scenarios"]["e3"]["modes"].as_object() {
        let e3 = &results["scenarios"]["e3"];
        let _ = writeln!(
            md,
            "## E3: inference latency (simulated)\n\n\
             A high-priority inference job (Poisson requests, {} per s, each {} kernels `{}` \
             then a sync; latency from the scheduled arrival, so queueing counts) next to one \
             saturating low-priority job. Slowdowns are against the inference job alone.\n\n\
             | mode | p50 ms | p50 slowdown | p99 ms | p99 slowdown | max ms | low GPU share |\n\
             |---|---|---|---|---|---|---|",
            e3["requests_per_s"],
            e3["kernels_per_request"],
            e3["kernel"].as_str().unwrap_or("?"),
        );
        for (mode, case) in modes {
            let m = &case["metrics"];
            let _ = writeln!(
                md,
                "| {mode} | {} | {} | {} | {} | {} | {} |",
                cell(m, "high_p50_ms", 2, ""),
                cell(m, "high_p50_slowdown_percent", 1, "%"),
                cell(m, "high_p99_ms", 2, ""),
                cell(m, "high_p99_slowdown_percent", 1, "%"),
                cell(m, "high_max_ms", 2, ""),
                cell(m, "low_gpu_fraction", 3, ""),
            );
        }
        md += "\n";
    }
    md += &crate::control_path::markdown(results);
    md += &crate::plot::markdown_links(results);
    md += &crate::cluster::markdown(results);
    md += &crate::e2_mixed::markdown(results);
    md += &crate::scaling::markdown(results);
    md
}

/// One length of the kernels scenario's sweep: its key in the results, a label for tables
/// and charts, and the cases by mode.
#[derive(Debug, PartialEq)]
pub struct SweepRow<'a> {
    pub key: &'a str,
    pub label: String,
    pub modes: &'a Value,
}

/// The lengths of `by_length` (`scenarios.kernels.low_kernel_us` or its inference twin) in
/// launch-length order, a graph after plain kernels of its length. Labels come from
/// `kernels.lows`; results from before the sweep had graphs (keys are µs only) get
/// `"<ms> ms"`.
/// One Markdown row per (length, mode): the label, the mode, then `columns` (metric key,
/// digits, unit) of the case's metrics.
fn sweep_table(md: &mut String, rows: &[SweepRow], columns: &[(&str, usize, &str)]) {
    for row in rows {
        for (mode, case) in row.modes.as_object().into_iter().flatten() {
            let metrics = &case["metrics"];
            let cells: Vec<String> = columns
                .iter()
                .map(|&(key, digits, unit)| cell(metrics, key, digits, unit))
                .collect();
            let _ = writeln!(md, "| {} | {mode} | {} |", row.label, cells.join(" | "));
        }
    }
}

pub fn sweep_rows<'a>(kernels: &Value, by_length: &'a Value) -> Vec<SweepRow<'a>> {
    let Some(lengths) = by_length.as_object() else {
        return Vec::new();
    };
    let mut rows: Vec<(u64, bool, SweepRow<'a>)> = lengths
        .iter()
        .map(|(key, modes)| {
            let digits: String = key.chars().take_while(char::is_ascii_digit).collect();
            let us: u64 = digits.parse().unwrap_or(0);
            let label = kernels["lows"][key]["label"]
                .as_str()
                .map_or_else(|| format!("{} ms", us as f64 / 1e3), str::to_owned);
            let graph = key.ends_with("-graph");
            (us, graph, SweepRow { key, label, modes })
        })
        .collect();
    rows.sort_by_key(|(us, graph, _)| (*us, *graph));
    rows.into_iter().map(|(_, _, row)| row).collect()
}

/// The kernels scenario's tables: the priority high job's, and (since the sweep has them)
/// the inference job's, by low launch length and mode.
fn kernels_markdown(kernels: &Value) -> String {
    let rows = sweep_rows(kernels, &kernels["low_kernel_us"]);
    if rows.is_empty() {
        return String::new();
    }
    let mut md = String::from("## Scenario `kernels` (simulated)\n\n");
    if kernels["lows"].is_object() {
        md += "The `priority` scenario's high job, and E3's inference job, each beside one \
               saturating low-priority job that launches plain kernels of 0.1–20 ms or a real \
               CUDA graph (ten 5 ms kernels captured once into a graph on its own stream, one \
               `cuGraphLaunch` per iteration: 50 ms that reach the device as one launch). A \
               preempted low job drains for about the rest of one launch, so without admission \
               that knows how long low work runs the high job's slowdown grows with the launch \
               length. `gpushare-before` is gpushare with that admission switched \
               off (`admit_by_duration = false`); each high job alone is measured once.\n\n";
    } else {
        md += "The `priority` scenario's high job beside one saturating low-priority job whose \
               kernels last 0.1–50 ms (50 ms stands in for a captured CUDA graph: one launch). \
               A preempted low job drains for about the rest of one kernel, so the high job's \
               slowdown grows with the kernel length until admission knows how long low work \
               runs (duration-aware admission).\n\n";
    }
    if let Some(mean) = kernels["alone"]["metrics"]["high_mean_ms"].as_f64() {
        let _ = writeln!(
            md,
            "Priority high job alone: iteration {mean:.2} ms, start p99 {} µs (simulated).\n",
            cell(&kernels["alone"]["metrics"], "high_start_p99_us", 1, "")
        );
    }
    md += "Priority high job (training-like) against itself alone:\n\n\
           | low launches | mode | slowdown | p99 slowdown | start p50 µs | start p99 µs | idle captured |\n\
           |---|---|---|---|---|---|---|\n";
    sweep_table(
        &mut md,
        &rows,
        &[
            ("high_mean_slowdown_percent", 1, "%"),
            ("high_p99_slowdown_percent", 1, "%"),
            ("high_start_p50_us", 1, ""),
            ("high_start_p99_us", 1, ""),
            ("idle_captured_percent", 1, "%"),
        ],
    );
    md += "\n";
    let inference = &kernels["inference"];
    let rows = sweep_rows(kernels, &inference["low_kernel_us"]);
    if !rows.is_empty() {
        let alone = &inference["alone"]["metrics"];
        let _ = writeln!(
            md,
            "E3's inference job (Poisson requests; latency from the scheduled arrival) against \
             itself alone (p50 {} ms, p99 {} ms, simulated):\n\n\
             | low launches | mode | p50 ms | p50 slowdown | p99 ms | p99 slowdown | low GPU share |\n\
             |---|---|---|---|---|---|---|",
            cell(alone, "high_p50_ms", 2, ""),
            cell(alone, "high_p99_ms", 2, ""),
        );
        sweep_table(
            &mut md,
            &rows,
            &[
                ("high_p50_ms", 2, ""),
                ("high_p50_slowdown_percent", 1, "%"),
                ("high_p99_ms", 2, ""),
                ("high_p99_slowdown_percent", 1, "%"),
                ("low_gpu_fraction", 3, ""),
            ],
        );
        md += "\n";
    }
    md
}

/// Writes both files into `dir`, and the charts (`plot`) beside them.
pub fn write(dir: &Path, results: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let text = serde_json::to_string_pretty(results).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(JSON_FILE), text + "\n")?;
    std::fs::write(dir.join(MARKDOWN_FILE), markdown(results))?;
    crate::plot::write_all(dir, results).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_has_a_row_per_case_and_says_simulated() {
        let results = json!({
            "machine": {"uname": "Linux x", "nproc": 2, "date": "d", "git_commit": "c"},
            "parameters": {"gpushare_settings": ["idle_us = 100"], "low_kernel_us": 100},
            "scenarios": {
                "priority": {"uncontrolled": {"1": {"metrics": {"high_mean_ms": 5.5, "idle_captured_percent": 80.0}}}},
                "shares": {"uncontrolled": {"pair": {"metrics": {"share_ratio": 1.0}}, "limited": {"metrics": {"share": 0.97}}}},
            }
        });
        let md = markdown(&results);
        assert!(md.contains("simulated"));
        assert!(
            md.contains("non-default scheduler settings: `idle_us = 100`"),
            "{md}"
        );
        assert!(md.contains("| uncontrolled | 1 | 5.50 |"), "{md}");
        assert!(md.contains("| 80.0% |"), "{md}");
        assert!(
            md.contains("| uncontrolled | limited 0.5 | 0.970 |"),
            "{md}"
        );
    }

    #[test]
    fn markdown_tables_of_e1_and_e3() {
        let results = json!({
            "machine": {},
            "parameters": {},
            "scenarios": {
                "e1": {"pairs": {"vgg11+mobilenet": {"high": "vgg11", "low": "mobilenet",
                    "gpushare": {"metrics": {"high_mean_ms": 14.0, "high_mean_slowdown_percent": 2.0,
                        "low_throughput_fraction": 0.75}}}}},
                "e3": {"requests_per_s": 75.0, "kernels_per_request": 50, "kernel": "lognormal:100us:0.3",
                    "modes": {"uncontrolled": {"metrics": {"high_p99_ms": 81.0, "low_gpu_fraction": 0.5}}}},
            }
        });
        let md = markdown(&results);
        assert!(md.contains("## E1: training pairs (simulated)"), "{md}");
        assert!(
            md.contains("| vgg11+mobilenet | gpushare | 14.00 | 2.0% | – | 0.750 | – |"),
            "{md}"
        );
        assert!(!md.contains("| vgg11+mobilenet | high |"), "{md}");
        assert!(md.contains("## E3: inference latency (simulated)"), "{md}");
        assert!(
            md.contains("| uncontrolled | – | – | 81.00 | – | – | 0.500 |"),
            "{md}"
        );
    }

    #[test]
    fn sweep_rows_order_lengths_and_label_graphs() {
        let kernels = json!({
            "lows": {"50000-graph": {"label": "50 ms graphs (10 × 5 ms)"}, "100": {"label": "0.1 ms kernels"}},
            "low_kernel_us": {"50000-graph": {}, "20000": {}, "100": {}, "50000": {}},
        });
        let rows = sweep_rows(&kernels, &kernels["low_kernel_us"]);
        let keys: Vec<&str> = rows.iter().map(|r| r.key).collect();
        assert_eq!(keys, ["100", "20000", "50000", "50000-graph"]);
        let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "0.1 ms kernels",
                "20 ms",
                "50 ms",
                "50 ms graphs (10 × 5 ms)"
            ]
        );
        assert!(sweep_rows(&kernels, &json!(null)).is_empty());
    }

    #[test]
    fn kernels_tables_for_both_high_jobs_and_the_old_shape() {
        let results = json!({
            "machine": {}, "parameters": {},
            "scenarios": {"kernels": {
                "lows": {"50000-graph": {"label": "50 ms graphs (10 × 5 ms)"}},
                "alone": {"metrics": {"high_mean_ms": 8.5, "high_start_p99_us": 40.0}},
                "low_kernel_us": {"50000-graph": {"gpushare-before": {"metrics": {
                    "high_mean_slowdown_percent": 60.0, "idle_captured_percent": 95.0}}}},
                "inference": {
                    "alone": {"metrics": {"high_p50_ms": 5.5, "high_p99_ms": 9.0}},
                    "low_kernel_us": {"50000-graph": {"gpushare": {"metrics": {
                        "high_p99_ms": 18.0, "high_p99_slowdown_percent": 100.0, "low_gpu_fraction": 0.4}}}},
                },
            }},
        });
        let md = markdown(&results);
        assert!(md.contains("## Scenario `kernels` (simulated)"), "{md}");
        assert!(md.contains("`admit_by_duration = false`"), "{md}");
        assert!(md.contains("iteration 8.50 ms, start p99 40.0 µs"), "{md}");
        assert!(
            md.contains(
                "| 50 ms graphs (10 × 5 ms) | gpushare-before | 60.0% | – | – | – | 95.0% |"
            ),
            "{md}"
        );
        assert!(md.contains("(p50 5.50 ms, p99 9.00 ms, simulated)"), "{md}");
        assert!(
            md.contains("| 50 ms graphs (10 × 5 ms) | gpushare | – | – | 18.00 | 100.0% | 0.400 |"),
            "{md}"
        );
        // The shape committed before the sweep had graphs: µs keys, no inference job.
        let old = json!({"machine": {}, "parameters": {}, "scenarios": {"kernels": {
            "alone": {"metrics": {}},
            "low_kernel_us": {"50000": {"gpushare": {"metrics": {"high_mean_slowdown_percent": 64.0}}},
                              "100": {"gpushare": {"metrics": {"high_mean_slowdown_percent": 0.5}}}},
        }}});
        let md = markdown(&old);
        assert!(
            md.contains("50 ms stands in for a captured CUDA graph"),
            "{md}"
        );
        let (short, long) = (
            md.find("| 0.1 ms | gpushare | 0.5% |").expect("0.1 ms row"),
            md.find("| 50 ms | gpushare | 64.0% |").expect("50 ms row"),
        );
        assert!(short < long, "{md}");
        assert!(!md.contains("inference job"), "{md}");
    }
}
