//! Scenario `e5` (scaling) under gpushare: (a) one high-priority job with 1, 2, 4, 8 saturating
//! low-priority jobs on one GPU; (b) 1, 2, 4, 8 GPUs, each with one high and one low job. Per
//! case: the high jobs' slowdown against one high job alone, the low jobs' aggregate GPU share
//! (per GPU), and the arbiter's CPU use (utime + stime from `/proc/<pid>/stat` from the barrier
//! until every job reported, as % of one core). Every figure is simulated (the CPU use is the
//! arbiter's real CPU time serving simulated clients).

use std::path::Path;
use std::time::Instant;

use gpushare_proto::Priority;
use serde_json::{json, Value};

use gpushare_testkit::config::SchedulingPolicy;
use gpushare_testkit::stats;

use crate::cluster::{multi_gpu_machine, spawn_pinned, start_multi_gpu_arbiter};
use crate::experiment::{collect_within, ExperimentError, Parameters};
use crate::metrics::{self, number};
use crate::setup::{self, Binaries};

/// E5's parameters; written into the results (the jobs are the priority scenario's).
#[derive(Debug, Clone, serde::Serialize)]
pub struct E5Parameters {
    pub low_counts: Vec<usize>,
    pub gpu_counts: Vec<usize>,
    pub low_nums_limit: u32,
    pub gpu_util_limit: f64,
}

impl E5Parameters {
    pub fn new(quick: bool) -> Self {
        let counts = if quick { vec![1, 2] } else { vec![1, 2, 4, 8] };
        E5Parameters {
            low_counts: counts.clone(),
            gpu_counts: counts,
            // Eight low jobs must fit on the one GPU of part (a).
            low_nums_limit: 8,
            gpu_util_limit: 1.0,
        }
    }
}

/// utime + stime of `pid` in seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|ticks| {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
        ticks as f64 / hz as f64
    })
}

/// Fields 14 and 15 (utime, stime) of a `/proc/<pid>/stat` line; the command name (field 2)
/// may hold spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ")": field 3 is fields[0], so utime (14) is fields[11], stime (15) fields[12].
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// One case: `gpus` simulated GPUs, one high job on each of the first `highs` of them (0 or
/// `gpus`), and `lows_per_gpu` low jobs per GPU, placed by the arbiter. Returns the reports
/// (highs first) and the arbiter's CPU use in % of one core.
fn run_case(
    binaries: &Binaries,
    libs: &Path,
    parameters: &Parameters,
    e5: &E5Parameters,
    gpus: usize,
    high: bool,
    lows_per_gpu: usize,
) -> Result<(Vec<Value>, Vec<Value>, f64), ExperimentError> {
    let dir = tempfile::Builder::new()
        .prefix("gsb-e5-")
        .tempdir_in("/tmp")
        .map_err(|source| ExperimentError::Io {
            what: "a private directory".into(),
            source,
        })?;
    let (machine, env) = multi_gpu_machine(dir.path(), libs, gpus);
    let arbiter = start_multi_gpu_arbiter(
        dir.path(),
        &machine,
        &env,
        e5.gpu_util_limit,
        e5.low_nums_limit,
        SchedulingPolicy::Priority,
    )?;
    let barrier = dir.path().join("go");
    let mut children = Vec::new();
    let mut jobs = Vec::new();
    if high {
        jobs.extend((0..gpus).map(|g| {
            let mut job = parameters.high_job();
            job.name = format!("high-{g}");
            job
        }));
    }
    jobs.extend((0..gpus * lows_per_gpu).map(|i| parameters.low_job(i, 0.0, 1.0)));
    for job in &jobs {
        let lease = setup::reserve(
            &arbiter,
            &job.name,
            job.priority,
            job.compute_request,
            job.compute_limit,
        )?;
        let gpu = lease.gpus.first().cloned().unwrap_or_default();
        let child = spawn_pinned(
            binaries,
            &env,
            &gpu,
            Some((&arbiter, &lease)),
            &job.args,
            Some(&barrier),
        )?;
        children.push((job.name.clone(), job.priority, child));
    }
    std::thread::sleep(std::time::Duration::from_millis(400));
    let cpu_before = cpu_seconds(arbiter.pid()).unwrap_or(0.0);
    let opened = Instant::now();
    std::fs::write(&barrier, b"").map_err(|source| ExperimentError::Io {
        what: "opening the start barrier".into(),
        source,
    })?;
    let limit = std::time::Duration::from_secs_f64(parameters.duration_s)
        + std::time::Duration::from_secs(60);
    let (mut highs, mut lows) = (Vec::new(), Vec::new());
    for (name, priority, child) in children {
        let report = collect_within(child, limit).map_err(|why| ExperimentError::Job {
            job: name,
            mode: "e5 gpushare".into(),
            why: format!("{why}\narbiter log:\n{}", setup::log_tail(&arbiter)),
        })?;
        match priority {
            Priority::High => highs.push(report),
            Priority::Low => lows.push(report),
        }
    }
    let cpu = cpu_seconds(arbiter.pid()).unwrap_or(cpu_before) - cpu_before;
    let wall = opened.elapsed().as_secs_f64();
    Ok((
        highs,
        lows,
        if wall > 0.0 { cpu / wall * 100.0 } else { 0.0 },
    ))
}

/// A case's figures: the high jobs' median slowdown against `alone` (iteration period), the low
/// jobs' GPU share summed and divided by `gpus`, the arbiter's CPU.
fn figures(
    alone: &Value,
    highs: &[Value],
    lows: &[Value],
    gpus: usize,
    arbiter_cpu_percent: f64,
) -> Result<Value, ExperimentError> {
    let alone_mean = number("high (alone)", alone, "period_ms/mean")?;
    let mut slowdowns = Vec::new();
    for (i, h) in highs.iter().enumerate() {
        let mean = number(&format!("high {i}"), h, "period_ms/mean")?;
        slowdowns.push(metrics::slowdown_percent(alone_mean, mean));
    }
    slowdowns.sort_by(f64::total_cmp);
    let mut low_share = 0.0;
    for (i, l) in lows.iter().enumerate() {
        low_share += metrics::gpu_fraction(&format!("low {i}"), l)?;
    }
    Ok(json!({
        // The nearest-sample median (the upper middle of an even count), as the results
        // have always reported it; 0 without high jobs.
        "high_median_slowdown_percent": if slowdowns.is_empty() {
            0.0
        } else {
            stats::percentile(&slowdowns, 50.0)
        },
        "high_max_slowdown_percent": slowdowns.last().copied().unwrap_or(0.0),
        "low_gpu_share_per_gpu": low_share / gpus.max(1) as f64,
        "arbiter_cpu_percent": arbiter_cpu_percent,
    }))
}

/// Runs E5; the `scenarios.e5` object.
pub fn run_all(
    binaries: &Binaries,
    libs: &Path,
    parameters: &Parameters,
    e5: &E5Parameters,
) -> Result<Value, ExperimentError> {
    eprintln!("gpushare-bench: e5, high alone (simulated)");
    let (alone, _, alone_cpu) = run_case(binaries, libs, parameters, e5, 1, true, 0)?;
    let alone = alone.into_iter().next().unwrap_or_default();
    let mut per_gpu = serde_json::Map::new();
    for &n in &e5.low_counts {
        eprintln!("gpushare-bench: e5, 1 high + {n} low on one GPU (simulated)");
        let (highs, lows, cpu) = run_case(binaries, libs, parameters, e5, 1, true, n)?;
        let m = figures(&alone, &highs, &lows, 1, cpu)?;
        per_gpu.insert(
            n.to_string(),
            json!({"metrics": m, "jobs": ([highs, lows].concat())}),
        );
    }
    let mut gpus = serde_json::Map::new();
    for &g in &e5.gpu_counts {
        eprintln!("gpushare-bench: e5, {g} GPUs with 1 high + 1 low each (simulated)");
        let (highs, lows, cpu) = run_case(binaries, libs, parameters, e5, g, true, 1)?;
        let m = figures(&alone, &highs, &lows, g, cpu)?;
        gpus.insert(
            g.to_string(),
            json!({"metrics": m, "jobs": ([highs, lows].concat())}),
        );
    }
    Ok(json!({
        "parameters": e5,
        "alone": {"metrics": {"arbiter_cpu_percent": alone_cpu}, "jobs": [alone]},
        "low_clients": Value::Object(per_gpu),
        "gpus": Value::Object(gpus),
    }))
}

/// The Markdown table of `scenarios.e5`, or nothing.
pub fn markdown(results: &Value) -> String {
    let e5 = &results["scenarios"]["e5"];
    if e5.is_null() {
        return String::new();
    }
    let mut md = String::from(
        "## Scenario `e5`: scaling under gpushare (simulated)\n\n\
         The priority scenario's high and low jobs. `low clients`: one GPU, one high job and N \
         low jobs; `GPUs`: N GPUs, each with one high and one low job. Slowdown: the high \
         jobs' mean iteration period against one alone (median over GPUs, max beside it); low \
         share: the low jobs' GPU time per GPU; arbiter CPU: its utime + stime over the case, \
         % of one core.\n\n\
         | part | N | high slowdown (median) | high slowdown (max) | low share per GPU | arbiter CPU |\n\
         |---|---|---|---|---|---|\n",
    );
    for (part, key) in [("low clients", "low_clients"), ("GPUs", "gpus")] {
        let Some(cases) = e5[key].as_object() else {
            continue;
        };
        for (n, case) in cases {
            let m = &case["metrics"];
            let f = |k: &str, d: usize| m[k].as_f64().map_or("–".into(), |x| format!("{x:.d$}"));
            md += &format!(
                "| {part} | {n} | {}% | {}% | {} | {}% |\n",
                f("high_median_slowdown_percent", 1),
                f("high_max_slowdown_percent", 1),
                f("low_gpu_share_per_gpu", 3),
                f("arbiter_cpu_percent", 2),
            );
        }
    }
    md + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_come_from_fields_14_and_15() {
        let stat = "4242 (gpushare) arb) S 1 2 3 4 5 6 7 8 9 10 110 25 0 0 20 0 4 0 100";
        assert_eq!(parse_cpu_ticks(stat), Some(135));
        assert_eq!(parse_cpu_ticks("garbage"), None);
        assert!(cpu_seconds(std::process::id()).is_some());
    }
}
