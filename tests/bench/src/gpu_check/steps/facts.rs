//! Hardware facts the simulator guesses, measured (PASS when measured). On the simulated GPU
//! they are simgpu's own values, labelled simulated.

use crate::gpu_check::jobs::{probe, probe_value, run, wait_for};
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

/// The sizes a checkpointed process holds.
const CHECKPOINT_SIZES: [&str; 4] = ["256Mi", "1Gi", "4Gi", "8Gi"];

/// `cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}` (r570+) on a bare probe holding
/// 256 MiB, 1 GiB, 4 GiB and 8 GiB: each operation's latency; after the restore and unlock the
/// process must launch again. SKIP where the driver lacks the API.
pub fn checkpoint(env: &StepEnv) -> Verdict {
    let mut seen = Vec::new();
    for size in CHECKPOINT_SIZES {
        let (ready, go) = (
            env.work.join(format!("ready-{size}")),
            env.work.join(format!("go-{size}")),
        );
        let (ready_arg, go_arg) = (
            ready.to_str().unwrap_or_default(),
            go.to_str().unwrap_or_default(),
        );
        let holder = probe(
            env,
            None,
            &[
                "alloc", size, "touch", ready_arg, "wait", go_arg, "launch", "1", "sync",
            ],
        )
        .spawn();
        let holder = match holder {
            Ok(h) => h,
            Err(e) => return Verdict::fail(format!("starting the {size} holder: {e}")),
        };
        let pid = holder.id().to_string();
        if !wait_for(&ready, std::time::Duration::from_secs(20)) {
            let _ = std::fs::write(&go, "");
            let holder = holder.wait_with_output();
            return Verdict::fail(format!("the {size} holder never allocated: {holder:?}"));
        }
        let out = run(&mut probe(env, None, &["checkpoint", &pid]));
        let _ = std::fs::write(&go, "");
        let holder = holder.wait_with_output();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with("checkpoint "))
            .unwrap_or("");
        if let Some(missing) = line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("missing="))
        {
            return Verdict::skip(format!(
                "{} lacks {missing} (cuCheckpointProcess*: r570+, CUDA 12.8)",
                env.driver
            ));
        }
        let resumed = holder.as_ref().is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("sync CUDA_SUCCESS")
        });
        if !line.starts_with("checkpoint CUDA_SUCCESS") || !resumed {
            return Verdict::fail(format!(
                "{size}: {line} {}; the process afterwards: {}",
                String::from_utf8_lossy(&out.stderr).trim(),
                holder.map_or_else(
                    |e| e.to_string(),
                    |o| String::from_utf8_lossy(&o.stdout)
                        .trim()
                        .replace('\n', "; ")
                )
            ));
        }
        let times = line.trim_start_matches("checkpoint CUDA_SUCCESS").trim();
        seen.push(format!("{size}: {times}"));
    }
    // simgpu models the copy at SIMGPU_CHECKPOINT_GBPS: its latencies are its own.
    let label = if env.simulated { " (simulated)" } else { "" };
    Verdict::pass(format!("{}{label}", seen.join("; ")))
}
