//! Keeps the harness from rotting: a `--quick` run end to end (private arbiter, leases, the
//! interposer, simulated GPU), and every scenario and mode in the results with finite numbers.
//! The binaries come from `GPUSHARE_BIN_DIR` (default: next to this test's binary), which
//! `make test` builds; missing ones fail the test.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn run_quick(out: &Path, extra: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .args(["--quick", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("run gpushare-bench");
    assert!(
        output.status.success(),
        "gpushare-bench {extra:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let md = std::fs::read_to_string(out.join("compute-isolation.md")).expect("Markdown written");
    assert!(md.contains("simulated"), "{md}");
    serde_json::from_slice(&std::fs::read(out.join("compute-isolation.json")).unwrap())
        .expect("results are JSON")
}

/// Every metric of every case is a finite number, and every case kept its raw reports.
fn assert_case(scenario: &str, mode: &str, name: &str, case: &Value) {
    let metrics = case["metrics"]
        .as_object()
        .unwrap_or_else(|| panic!("{scenario}/{mode}/{name}: no metrics in {case}"));
    assert!(
        !metrics.is_empty(),
        "{scenario}/{mode}/{name}: empty metrics"
    );
    for (key, value) in metrics {
        assert!(
            value.as_f64().is_some_and(f64::is_finite),
            "{scenario}/{mode}/{name}: {key} = {value}"
        );
    }
    let jobs = case["jobs"].as_array().expect("raw job reports");
    assert!(!jobs.is_empty());
    for job in jobs {
        assert_eq!(job["simulated"], true, "{job}");
        assert!(job["iterations"].as_u64().unwrap_or(0) > 0, "{job}");
    }
}

fn assert_results(results: &Value, modes: &[&str]) {
    assert_eq!(results["simulated"], true);
    for key in ["uname", "nproc", "date", "git_commit"] {
        assert!(!results["machine"][key].is_null(), "machine.{key} missing");
    }
    let priority = &results["scenarios"]["priority"];
    assert_case("priority", "alone", "0", &priority["alone"]["0"]);
    for mode in modes.iter().filter(|m| **m != "alone") {
        for n in ["1", "2", "3"] {
            assert_case("priority", mode, n, &priority[mode][n]);
        }
        for case in ["pair", "limited"] {
            assert_case(
                "shares",
                mode,
                case,
                &results["scenarios"]["shares"][mode][case],
            );
        }
    }
    assert_kernels(&results["scenarios"]["kernels"], modes);
    // E1: every pair in every mode, `alone` being the exclusive runs.
    let pairs = results["scenarios"]["e1"]["pairs"]
        .as_object()
        .expect("e1 pairs");
    assert_eq!(pairs.len(), 5, "five (high, low) pairs");
    for (pair, by_mode) in pairs {
        for mode in modes {
            assert_case("e1", mode, pair, &by_mode[mode]);
        }
    }
    // E3: the inference job alone and beside the low job in every mode, with its latencies.
    for mode in modes {
        let case = &results["scenarios"]["e3"]["modes"][mode];
        assert_case("e3", mode, "inference", case);
        let latency = &case["jobs"][0]["request_latency_ms"];
        assert!(
            latency["n"].as_u64().unwrap_or(0) > 0,
            "e3/{mode}: {latency}"
        );
    }
    let listed: Vec<&str> = results["modes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(listed, modes);
    assert_e2_e5(results);
}

/// The kernel-length sweep (quick: 0.1 ms and 20 ms kernels, and the 50 ms graph): every
/// length in every shared mode plus `gpushare-before`, beside both high jobs; the graph job
/// launched real graphs whose kernels count in its GPU time.
fn assert_kernels(kernels: &Value, modes: &[&str]) {
    assert_case("kernels", "alone", "high", &kernels["alone"]);
    assert_case(
        "kernels",
        "alone",
        "inference",
        &kernels["inference"]["alone"],
    );
    let mut kernel_modes: Vec<&str> = modes.iter().copied().filter(|m| *m != "alone").collect();
    kernel_modes.push("gpushare-before");
    let listed: Vec<&str> = kernels["modes"]
        .as_array()
        .expect("the kernels scenario's modes")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for mode in &kernel_modes {
        assert!(listed.contains(mode), "{mode} missing from {listed:?}");
    }
    for by_length in [
        &kernels["low_kernel_us"],
        &kernels["inference"]["low_kernel_us"],
    ] {
        let keys: Vec<&String> = by_length
            .as_object()
            .expect("kernel lengths")
            .keys()
            .collect();
        assert_eq!(keys, ["100", "20000", "50000-graph"], "the quick sweep");
        for (length, by_mode) in by_length.as_object().unwrap() {
            for mode in &kernel_modes {
                assert_case("kernels", mode, length, &by_mode[mode]);
            }
        }
    }
    assert_eq!(
        kernels["lows"]["50000-graph"]["graph"], true,
        "{}",
        kernels["lows"]
    );
    for mode in &kernel_modes {
        let low = &kernels["low_kernel_us"]["50000-graph"][mode]["jobs"][1];
        let launches = low["graph"]["launches"].as_f64().unwrap_or(0.0);
        assert!(launches > 0.0, "kernels/{mode}: no graph launches in {low}");
        // Ten 5 ms kernels a launch, all of them counted.
        assert_eq!(low["kernels"].as_f64(), Some(10.0 * launches), "{low}");
        let kernel_s = low["kernel_time_s"].as_f64().unwrap();
        assert!((kernel_s - 0.05 * launches).abs() < 1e-6, "{low}");
    }
}

/// E2: every mode finished every job with finite makespan, completion times and NVML
/// utilisation; E2-mixed likewise, with its slowdowns; E5: every case of both parts.
fn assert_e2_e5(results: &Value) {
    let e2 = &results["scenarios"]["e2"];
    let jobs = e2["parameters"]["jobs"].as_u64().expect("e2 parameters");
    for mode in ["exclusive", "uncontrolled", "wang", "balanced", "batch"] {
        let case = &e2["modes"][mode];
        assert_case("e2", mode, "run", case);
        assert_eq!(
            case["jobs"].as_array().unwrap().len() as u64,
            jobs,
            "{case}"
        );
        let makespan = case["metrics"]["makespan_s"].as_f64().unwrap();
        assert!(makespan > 0.0, "{case}");
        let util = case["metrics"]["mean_gpu_utilisation_percent"]
            .as_f64()
            .unwrap();
        assert!(
            (0.0..=100.0).contains(&util) && util > 0.0,
            "e2 {mode}: {util}"
        );
    }
    // E2-mixed: the same modes, every job finished, the high jobs' slowdown against their
    // runs alone, each mode set against exclusive GPUs.
    let mixed = &results["scenarios"]["e2-mixed"];
    let jobs = mixed["parameters"]["jobs"]
        .as_u64()
        .expect("e2-mixed parameters");
    assert_eq!(
        mixed["alone"].as_object().map(|a| a.len()),
        Some(2),
        "{}",
        mixed["alone"]
    );
    for mode in ["exclusive", "uncontrolled", "wang", "balanced", "batch"] {
        let case = &mixed["modes"][mode];
        assert_case("e2-mixed", mode, "run", case);
        assert_eq!(
            case["schedule"].as_array().unwrap().len() as u64,
            jobs,
            "{case}"
        );
        for key in [
            "high_mean_slowdown_percent",
            "high_p95_completion_s",
            "low_mean_completion_s",
            "mean_completion_vs_exclusive_percent",
        ] {
            assert!(case["metrics"][key].is_number(), "e2-mixed {mode}: {key}");
        }
    }
    let e5 = &results["scenarios"]["e5"];
    assert_case("e5", "gpushare", "alone", &e5["alone"]);
    for (part, n) in [
        ("low_clients", "1"),
        ("low_clients", "2"),
        ("gpus", "1"),
        ("gpus", "2"),
    ] {
        assert_case("e5", part, n, &e5[part][n]);
    }
}

/// A chart per scenario run, linked from the Markdown, and the control-path section (its
/// benchmark files are absent from a fresh directory, so every row says so).
fn assert_charts_and_control_path(out: &Path, results: &Value) {
    let md = std::fs::read_to_string(out.join("compute-isolation.md")).unwrap();
    for scenario in results["scenarios"].as_object().unwrap().keys() {
        let svg = std::fs::read_to_string(out.join(format!("{scenario}.svg")))
            .unwrap_or_else(|e| panic!("{scenario}.svg: {e}"));
        assert!(
            svg.contains("<svg") && svg.to_lowercase().contains(scenario.as_str()),
            "{svg}"
        );
        assert!(md.contains(&format!("({scenario}.svg)")), "{md}");
    }
    let svg = std::fs::read_to_string(out.join("kernels-inference.svg")).unwrap();
    assert!(svg.contains("inference p99 latency slowdown"), "{svg}");
    assert!(md.contains("(kernels-inference.svg)"), "{md}");
    let rows = results["control_path"]["summary"].as_array().unwrap();
    assert!(!rows.is_empty());
    assert!(md.contains("## Control path (E4)"), "{md}");
    assert!(md.contains("not measured in this run"), "{md}");
}

#[test]
fn quick_run_covers_every_mode() {
    let out = tempfile::tempdir().unwrap();
    let results = run_quick(out.path(), &[]);
    let md = std::fs::read_to_string(out.path().join("compute-isolation.md")).unwrap();
    assert!(
        md.contains("Scenario `e2`")
            && md.contains("Scenario `e2-mixed`")
            && md.contains("Scenario `e5`"),
        "{md}"
    );
    assert_results(
        &results,
        &[
            "alone",
            "uncontrolled",
            "round-robin-1ms",
            "round-robin-10ms",
            "round-robin-250ms",
            "gpushare",
            "tgs",
        ],
    );
    assert_charts_and_control_path(out.path(), &results);
}

/// `--quick --scenario reclaim` (a few seconds): every latency series has finite figures and
/// a verdict against its bound, the high job never meets an out-of-memory below its quota in
/// either configuration, only the over-committed one reclaims, and the files are written.
#[test]
fn quick_reclaim_run_measures_both_parts() {
    let out = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_gpushare-bench"))
        .args(["--quick", "--scenario", "reclaim", "--out"])
        .arg(out.path())
        .output()
        .expect("run gpushare-bench");
    assert!(
        output.status.success(),
        "gpushare-bench --scenario reclaim failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let dir = out.path().join("reclaim");
    let results: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reclaim.json")).unwrap()).unwrap();
    assert_eq!(results["simulated"], true);
    let series = results["latency"]["series"].as_array().unwrap();
    assert!(!series.is_empty());
    for s in series {
        for key in ["reclaim_ms", "checkpoint_ms", "high_alloc_ms", "restore_ms"] {
            let p99 = s[key]["p99"].as_f64().unwrap_or(f64::NAN);
            assert!(p99.is_finite() && p99 >= 0.0, "{key}: {s}");
        }
        assert!(s["p99_within_bound"].is_boolean(), "{s}");
        assert!(s["bound_ms"].as_f64().unwrap() >= 250.0, "{s}");
    }
    let configurations = &results["scenario"]["configurations"];
    for name in ["static", "reclaim"] {
        let c = &configurations[name];
        assert_eq!(c["high"]["oom_below_quota"], 0, "{name}: {c}");
        assert!(c["high"]["requests"].as_u64().unwrap() > 0, "{name}: {c}");
        for low in ["low-0", "low-1"] {
            let rate = c["lows"][low]["iterations_per_s"].as_f64().unwrap();
            assert!(rate > 0.0, "{name}/{low}: {c}");
        }
    }
    assert_eq!(configurations["static"]["reclaims"], 0);
    assert!(configurations["reclaim"]["reclaims"].as_u64().unwrap() >= 1);
    let md = std::fs::read_to_string(dir.join("reclaim.md")).unwrap();
    assert!(
        md.contains("simulated") && md.contains("| static | reclaim |"),
        "{md}"
    );
    for chart in ["reclaim-latency.svg", "reclaim-scenario.svg"] {
        let svg = std::fs::read_to_string(dir.join(chart)).unwrap();
        assert!(svg.contains("<svg"), "{chart}");
        assert!(md.contains(&format!("({chart})")), "{md}");
    }
}
