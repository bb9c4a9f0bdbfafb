//! E4, the control path: gathers the figures the benchmarks write as JSON into the results
//! directory (`GPUSHARE_BENCH_RESULTS`, set by `make bench`) and sets each against its target
//! (docs/ARCHITECTURE.md, "Performance targets", and the arbiter benchmark's own). A file that is absent
//! gives a row saying so; nothing here measures anything.
//!
//! | file | written by |
//! |---|---|
//! | `interposer.json` | `cargo bench -p gpushare-preload --bench interposer` |
//! | `token-handoff.json` | `cargo bench -p gpushare-arbiter --bench token_handoff` |
//! | `arbiter.json` | `cargo bench -p gpushare-arbiter --bench arbiter` |
//! | `start-overhead.json` | `cargo bench -p gpushare-e2e --bench start_overhead` (root, dockerd) |
//! | `shim-start-overhead.json` | `cargo bench -p gpushare-e2e --bench shim_start_overhead` (root, containerd) |
//! | `kube-allocate.json` | `cargo bench -p gpushare-kube --bench allocate` (the device plugin's Allocate) |

use std::fmt::Write as _;
use std::path::Path;
use std::time::UNIX_EPOCH;

use serde_json::{json, Map, Value};

/// (key in the results, file name).
const FILES: [(&str, &str); 6] = [
    ("interposer", "interposer.json"),
    ("token_handoff", "token-handoff.json"),
    ("arbiter", "arbiter.json"),
    ("start_overhead_docker", "start-overhead.json"),
    ("start_overhead_containerd", "shim-start-overhead.json"),
    ("kube_allocate", "kube-allocate.json"),
];

const NOT_MEASURED: &str = "not measured in this run (`make bench` runs it)";

/// A file's JSON and when it was written, or null when absent or unreadable.
fn read(dir: &Path, file: &str) -> Value {
    let path = dir.join(file);
    let Ok(bytes) = std::fs::read(&path) else {
        return Value::Null;
    };
    let modified = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| utc_date(d.as_secs()));
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(figures) => json!({"file": file, "written": modified, "figures": figures}),
        Err(e) => json!({"file": file, "written": modified, "error": e.to_string()}),
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` from seconds since the epoch (civil-from-days).
fn utc_date(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// One row of the table: where the figure comes from, how it is shown, its target.
struct Spec {
    figure: &'static str,
    source: &'static str,
    /// Path inside the file's `figures`.
    path: &'static [&'static str],
    unit: &'static str,
    target: &'static str,
    /// `Some(limit)`: met when the value is ≤ limit (`at_least`: ≥ limit).
    limit: Option<f64>,
    at_least: bool,
}

const SPECS: &[Spec] = &[
    Spec {
        figure: "per-launch cost holding the token (in process, added to cuLaunchKernel)",
        source: "interposer",
        path: &["in_process", "launch_holding_token", "added_ns"],
        unit: "ns",
        target: "≤ 100 ns",
        limit: Some(100.0),
        at_least: false,
    },
    Spec {
        figure: "pass-through call cost (in process, cuDeviceTotalMem_v2)",
        source: "interposer",
        path: &["in_process", "pass_through_total_mem", "added_ns"],
        unit: "ns",
        target: "≤ 50 ns",
        limit: Some(50.0),
        at_least: false,
    },
    Spec {
        figure: "per-launch difference on the simulated GPU (context; simulated driver's noise dominates)",
        source: "interposer",
        path: &["simulated_gpu", "launch_holding_token", "difference_ns"],
        unit: "ns",
        target: "– (context)",
        limit: None,
        at_least: false,
    },
    Spec {
        figure: "token handoff p50",
        source: "token_handoff",
        path: &["handoff", "p50_us"],
        unit: "µs",
        target: "≤ 20 µs",
        limit: Some(20.0),
        at_least: false,
    },
    Spec {
        figure: "token handoff p99",
        source: "token_handoff",
        path: &["handoff", "p99_us"],
        unit: "µs",
        target: "≤ 100 µs",
        limit: Some(100.0),
        at_least: false,
    },
    Spec {
        figure: "preemption signal p50 (Want to the holder's page showing deadline 0)",
        source: "token_handoff",
        path: &["preemption_signal", "p50_us"],
        unit: "µs",
        target: "≤ 50 µs beyond the remaining low kernel",
        limit: Some(50.0),
        at_least: false,
    },
    Spec {
        figure: "preemption signal p99",
        source: "token_handoff",
        path: &["preemption_signal", "p99_us"],
        unit: "µs",
        target: "≤ 50 µs beyond the remaining low kernel",
        limit: Some(50.0),
        at_least: false,
    },
    Spec {
        figure: "arbiter reserve+release round trips, 1 client (median)",
        source: "arbiter",
        path: &["round_trips", "clients_1_per_s"],
        unit: "/s",
        target: "≥ 5,000/s (arbiter bench)",
        limit: Some(5_000.0),
        at_least: true,
    },
    Spec {
        figure: "arbiter reserve+release round trips, 32 clients (median)",
        source: "arbiter",
        path: &["round_trips", "clients_32_per_s"],
        unit: "/s",
        target: "≥ 5,000/s (arbiter bench)",
        limit: Some(5_000.0),
        at_least: true,
    },
    Spec {
        figure: "placement decision, 16 GPUs × 64 leases (median)",
        source: "arbiter",
        path: &["placement", "median_us"],
        unit: "µs",
        target: "≤ 100 µs (arbiter bench)",
        limit: Some(100.0),
        at_least: false,
    },
    Spec {
        figure: "recovery of 1,000 leases (median)",
        source: "arbiter",
        path: &["recovery", "median_ms"],
        unit: "ms",
        target: "≤ 1 s (arbiter bench)",
        limit: Some(1_000.0),
        at_least: false,
    },
    Spec {
        figure: "container start, docker: gpushare-runc / runc (medians)",
        source: "start_overhead_docker",
        path: &["ratio"],
        unit: "×",
        target: "≤ 1.25×",
        limit: Some(1.25),
        at_least: false,
    },
    Spec {
        figure: "container start, containerd: gpushare shim / runc shim (medians)",
        source: "start_overhead_containerd",
        path: &["ratio"],
        unit: "×",
        target: "≤ 1.25×",
        limit: Some(1.25),
        at_least: false,
    },
    Spec {
        figure: "device plugin Allocate, p99 (test kubelet → gpushare-kube → arbiter grant, durable)",
        source: "kube_allocate",
        path: &["p99_ms"],
        unit: "ms",
        target: "≤ 5 ms (device plugin target)",
        limit: Some(5.0),
        at_least: false,
    },
];

fn lookup<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

fn format_value(x: f64, unit: &str) -> String {
    match unit {
        "×" => format!("{x:.3}×"),
        "/s" => format!("{x:.0}/s"),
        _ if x.abs() >= 100.0 => format!("{x:.0} {unit}"),
        _ => format!("{x:.2} {unit}"),
    }
}

/// The `control_path` section of the results: every file found in `dir` (null when absent),
/// the container start medians for the chart, and the summary rows.
pub fn gather(dir: &Path) -> Value {
    let mut files = Map::new();
    for (key, file) in FILES {
        files.insert(key.into(), read(dir, file));
    }
    let files = Value::Object(files);
    let summary: Vec<Value> = SPECS
        .iter()
        .map(|spec| {
            let entry = &files[spec.source];
            let file = FILES.iter().find(|(k, _)| *k == spec.source).unwrap().1;
            let value = lookup(&entry["figures"], spec.path).as_f64();
            let shown = match (entry.is_null(), value) {
                (true, _) => NOT_MEASURED.to_string(),
                (false, Some(x)) => format_value(x, spec.unit),
                (false, None) => format!("missing from `{file}`"),
            };
            let met = value.zip(spec.limit).map(|(x, limit)| {
                if spec.at_least {
                    x >= limit
                } else {
                    x <= limit
                }
            });
            json!({
                "figure": spec.figure,
                "value": value,
                "shown": shown,
                "target": spec.target,
                "met": met,
                "file": file,
                "written": entry["written"],
            })
        })
        .collect();
    let start = |key: &str| files[key]["figures"].clone();
    json!({
        "note": "Measured by `make bench` on this machine with real processes; the interposer's \
                 simulated_gpu figures are simulated. Each file records when it was written.",
        "dir": dir,
        "files": files,
        "start_overhead": {"docker": start("start_overhead_docker"), "containerd": start("start_overhead_containerd")},
        "summary": summary,
    })
}

/// The Markdown section for `results["control_path"]` (empty when the run has none).
pub fn markdown(results: &Value) -> String {
    let Some(rows) = results["control_path"]["summary"].as_array() else {
        return String::new();
    };
    let mut md = String::from(
        "## Control path (E4)\n\n\
         Gathered from the benchmarks' JSON files in the results directory (`make bench` \
         writes them; `cargo bench` prints the same figures). Real processes on this machine; \
         only the simulated-GPU interposer row is simulated.\n\n\
         | figure | measured | target | met | file (written) |\n|---|---|---|---|---|\n",
    );
    for row in rows {
        let met = match row["met"].as_bool() {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "–",
        };
        let file = match row["written"].as_str() {
            Some(when) => format!("`{}` ({when})", row["file"].as_str().unwrap_or("?")),
            None => format!("`{}`", row["file"].as_str().unwrap_or("?")),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {met} | {file} |",
            row["figure"].as_str().unwrap_or("?"),
            row["shown"].as_str().unwrap_or("?"),
            row["target"].as_str().unwrap_or("?"),
        );
    }
    md.push('\n');
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_files_say_not_measured_and_present_ones_are_judged() {
        let dir = tempfile::tempdir().unwrap();
        let empty = gather(dir.path());
        let rows = empty["summary"].as_array().unwrap();
        assert_eq!(rows.len(), SPECS.len());
        assert!(rows
            .iter()
            .all(|r| r["shown"] == NOT_MEASURED && r["met"].is_null()));
        let md = markdown(&json!({"control_path": empty}));
        assert!(md.contains(NOT_MEASURED), "{md}");

        std::fs::write(
            dir.path().join("token-handoff.json"),
            r#"{"handoff": {"n": 10, "p50_us": 23.05, "p99_us": 95.5, "max_us": 2000.0},
                "preemption_signal": {"n": 10, "p50_us": 13.5}}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("start-overhead.json"),
            r#"{"engine": "docker 20.10", "runs": 20, "median_ms": {"runc": 400.0, "gpushare": 440.0}, "ratio": 1.1}"#,
        )
        .unwrap();
        let found = gather(dir.path());
        let row = |figure: &str| {
            found["summary"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["figure"] == figure)
                .unwrap()
                .clone()
        };
        assert_eq!(row("token handoff p50")["met"], false);
        assert_eq!(row("token handoff p50")["shown"], "23.05 µs");
        assert_eq!(row("token handoff p99")["met"], true);
        assert_eq!(
            row("preemption signal p99")["shown"],
            "missing from `token-handoff.json`"
        );
        assert!(row("token handoff p99")["written"]
            .as_str()
            .unwrap()
            .ends_with('Z'));
        assert_eq!(
            row("container start, docker: gpushare-runc / runc (medians)")["shown"],
            "1.100×"
        );
        assert_eq!(
            found["start_overhead"]["docker"]["median_ms"]["gpushare"],
            440.0
        );
        let md = markdown(&json!({"control_path": found}));
        assert!(
            md.contains("| token handoff p50 | 23.05 µs | ≤ 20 µs | **no** |"),
            "{md}"
        );
        // The start overheads become a chart.
        let figs = crate::plot::figures(&json!({"control_path": found}));
        assert_eq!(figs.len(), 1);
        assert_eq!(figs[0].name, "start-overhead");
        assert_eq!(
            figs[0].panels[0].groups,
            vec![(
                "docker".to_string(),
                vec![("runc".into(), 400.0), ("gpushare".into(), 440.0)]
            )]
        );
    }

    #[test]
    fn dates() {
        assert_eq!(utc_date(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_date(1_795_300_000), "2026-11-21T22:26:40Z");
    }
}
