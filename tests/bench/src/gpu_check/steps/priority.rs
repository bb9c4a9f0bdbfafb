//! The scheduler's promises on the GPU: long kernels are never cut off, and a high job
//! beside a saturating low one (its slowdown reported, not judged).

use crate::gpu_check::jobs::{
    beside, lease, probe, probe_verdict, program, run, start_arbiter, status, GIB,
};
use crate::gpu_check::{StepEnv, Verdict};
use gpushare_proto::Priority;
use std::process::Output;

/// A low job of 2 s kernels while a high job launches: it finishes every step (a cut-off
/// client would wait for ever); how often its drain outlasted the grace is reported.
pub fn long_kernels(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, 4 * GIB)?;
        let low = lease(&arbiter, "low", Priority::Low, 4 * GIB)?;
        let started = env.work.join("long-started");
        let started = started.to_str().unwrap_or_default();
        let long = probe(
            env,
            Some(&low),
            &[
                "launch",
                "1",
                "kernel-ms",
                "2000",
                "touch",
                started,
                "kernel-ms",
                "2000",
                "kernel-ms",
                "2000",
                "sync",
            ],
        );
        let high_job = probe(
            env,
            Some(&high),
            &["wait", started, "launch", "20", "sleep", "200"],
        );
        let (long_out, _, after_high) = beside(long, high_job)?;
        let verdict = probe_verdict(&long_out);
        let overdue: u64 = status(&arbiter)?.tokens.iter().map(|t| t.overdue).sum();
        Ok(Verdict {
            detail: format!(
                "{}; reported overdue {overdue} times; finished {:.1} s after the high job left",
                verdict.detail,
                after_high.as_secs_f64()
            ),
            ..verdict
        })
    };
    run_it().unwrap_or_else(Verdict::fail)
}

/// The high job alone, then beside a low job of back-to-back 1 ms kernels.
pub fn pair(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, 4 * GIB)?;
        let low = lease(&arbiter, "low", Priority::Low, 4 * GIB)?;
        let high_args = [
            "--kernel",
            "fixed:100us",
            "--kernels",
            "50",
            "--gap",
            "3300us",
            "--duration",
            "10s",
        ];
        let low_args = [
            "--kernel",
            "fixed:1ms",
            "--kernels",
            "20",
            "--duration",
            "12s",
        ];
        let workload = |lease, args: &[&str]| program(env, "simgpu-workload", Some(lease), args);
        let alone = run(&mut workload(&high, &high_args));
        let (low_out, shared, _) = beside(workload(&low, &low_args), workload(&high, &high_args))?;
        let throughput = |out: &Output| {
            serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .ok()
                .and_then(|v| v["throughput_iters_per_s"].as_f64())
        };
        let (a, s, l) = (
            throughput(&alone),
            throughput(&shared),
            throughput(&low_out),
        );
        Ok(match (a, s, l) {
            (Some(a), Some(s), Some(l)) => Verdict::pass(format!(
                "high alone {a:.1} it/s, beside low {s:.1} it/s: slowdown {:.1} %; low {l:.1} it/s",
                (1.0 - s / a) * 100.0
            )),
            _ => Verdict::fail(format!(
                "no report: {} / {} / {}",
                String::from_utf8_lossy(&alone.stderr).trim(),
                String::from_utf8_lossy(&shared.stderr).trim(),
                String::from_utf8_lossy(&low_out.stderr).trim()
            )),
        })
    };
    run_it().unwrap_or_else(Verdict::fail)
}
