//! Hardware facts the simulator guesses, measured (PASS when measured). On the simulated GPU
//! they are simgpu's own values, labelled simulated.

use crate::gpu_check::jobs::{probe, probe_value, run};
use crate::gpu_check::{StepEnv, Verdict};

const MIB: u64 = 1 << 20;

/// NVML's total (v1) and reserved (v2), cuMemGetInfo's total, and the largest single
/// cuMemAlloc that succeeds, all without the interposer: what placement can really pack.
pub fn memory(env: &StepEnv) -> Verdict {
    let out = run(&mut probe(
        env,
        None,
        &["nvml-meminfo", "meminfo", "max-alloc"],
    ));
    let value = |step, key| probe_value(&out, step, key);
    let found = (
        value("nvml-meminfo", "total"),
        value("nvml-meminfo", "v2_reserved"),
        value("meminfo", "total"),
        value("max-alloc", "bytes"),
    );
    let (Some(nvml_total), Some(reserved), Some(cuda_total), Some(allocatable)) = found else {
        return Verdict::fail(format!(
            "not measured: {} / {}",
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .replace('\n', "; "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    };
    let label = if env.simulated { " (simulated)" } else { "" };
    Verdict::pass(format!(
        "NVML total {} MiB, NVML v2 reserved {} MiB, cuMemGetInfo total {} MiB, allocatable {} MiB \
         (NVML total minus allocatable: {} MiB){label}",
        nvml_total / MIB,
        reserved / MIB,
        cuda_total / MIB,
        allocatable / MIB,
        nvml_total.saturating_sub(allocatable) / MIB
    ))
}
