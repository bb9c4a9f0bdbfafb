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
    if let Some(lengths) = results["scenarios"]["kernels"]["low_kernel_us"].as_object() {
        md += "## Scenario `kernels` (simulated)\n\n\
               The `priority` scenario's high job beside one saturating low-priority job whose \
               kernels last 0.1–50 ms (50 ms stands in for a captured CUDA graph: one launch). \
               A preempted low job drains for about the rest of one kernel, so the high job's \
               slowdown grows with the kernel length until admission knows how long low work \
               runs (issue 14).\n\n\
               | low kernel | mode | slowdown | p99 slowdown | start p50 µs | start p99 µs | idle captured |\n\
               |---|---|---|---|---|---|---|\n";
        let mut rows: Vec<(&String, &Value)> = lengths.iter().collect();
        rows.sort_by_key(|(us, _)| us.parse::<u64>().unwrap_or(0));
        for (kernel_us, modes) in rows {
            let Some(modes) = modes.as_object() else {
                continue;
            };
            for (mode, case) in modes {
                let m = &case["metrics"];
                let _ = writeln!(
                    md,
                    "| {kernel_us} µs | {mode} | {} | {} | {} | {} | {} |",
                    cell(m, "high_mean_slowdown_percent", 1, "%"),
                    cell(m, "high_p99_slowdown_percent", 1, "%"),
                    cell(m, "high_start_p50_us", 1, ""),
                    cell(m, "high_start_p99_us", 1, ""),
                    cell(m, "idle_captured_percent", 1, "%"),
                );
            }
        }
        md += "\n";
    }
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
    md += &crate::scaling::markdown(results);
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
}
