//! The probe on the driver, alone and under a memory quota.

use crate::gpu_check::jobs::{lease, probe, probe_verdict, run, start_arbiter, GIB};
use crate::gpu_check::{StepEnv, Verdict};
use gpushare_proto::Priority;

/// The probe without the interposer: the PTX kernel JIT-compiles and runs, a graph captures.
pub fn alone(env: &StepEnv) -> Verdict {
    probe_verdict(&run(&mut probe(
        env,
        None,
        &[
            "launch",
            "10",
            "kernel-ms",
            "100",
            "capture-begin",
            "global",
            "capture-launch",
            "3",
            "capture-end",
        ],
    )))
}

/// A 2 GiB lease, its context included: one 1 GiB allocation fits, a second does not.
pub fn memory_quota(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let small = lease(&arbiter, "memory", Priority::Low, 2 * GIB)?;
        let out = run(&mut probe(
            env,
            Some(&small),
            &["meminfo", "alloc", "1Gi", "meminfo", "alloc", "1Gi"],
        ));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let allocs: Vec<&str> = text.lines().filter(|l| l.starts_with("alloc ")).collect();
        let passed = allocs.len() == 2
            && allocs[0].contains("CUDA_SUCCESS")
            && allocs[1].contains("CUDA_ERROR_OUT_OF_MEMORY");
        Ok(Verdict::judged(
            passed,
            format!(
                "{} {}",
                text.trim().replace('\n', "; "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ))
    };
    run_it().unwrap_or_else(Verdict::fail)
}
