//! A workload killed with SIGKILL in the middle of a kernel leaves the device usable: its
//! context, queued work and memory are reclaimed, and the next process runs at full speed.

mod common;
use common::{f, Sim, SATURATING_JOB};
use std::time::Duration;

#[test]
fn killed_mid_kernel_the_device_is_reclaimed_for_the_next_process() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "1"), ("SIMGPU_MEMORY", "2Gi")]);
    let nvml = sim.nvml();
    let gpu = nvml.device_by_index(0).unwrap();

    // One 30 s kernel and 1.5 GiB: killed long before the kernel ends.
    let mut victim = sim
        .workload(&[
            "--memory",
            "1536Mi",
            "--kernel",
            "fixed:30s",
            "--kernels",
            "1",
            "--iterations",
            "1",
        ])
        .spawn()
        .unwrap();
    let pid = victim.id();
    let running = common::eventually(Duration::from_secs(20), || {
        let model = sim.model();
        let mut l = model.lock().unwrap();
        let snap = l.snapshot(0).unwrap();
        snap.contexts.iter().any(|c| {
            c.pid == pid && c.submitted == 2 && c.completed == 0 && c.gpu_time_ns > 50_000_000
        })
    });
    assert!(running, "the victim's kernel never started");
    // Its allocation, its context (300 MiB) and its lazily loaded module (2 MiB).
    assert_eq!(gpu.memory_info().unwrap().used, (1536 + 300 + 2) << 20);
    victim.kill().unwrap(); // SIGKILL
    victim.wait().unwrap();

    // The next process needs more memory than was free while the victim lived, and must not
    // share the GPU with the victim's remaining 29 s kernel.
    let next = sim.run(
        &[
            &["--memory", "1Gi"],
            SATURATING_JOB,
            &["--iterations", "50"],
        ]
        .concat(),
    );
    assert_eq!(next["allocations"]["succeeded"], 1, "{next}");
    assert_eq!(next["errors"], serde_json::json!({}), "{next}");
    let ratio = f(&next, "throughput_iters_per_s") / f(&next, "predicted_iters_per_s");
    assert!(
        ratio >= 0.97,
        "the next process ran at {ratio:.3} of its predicted speed"
    );

    // Nothing of the victim is left: no process, no context, no memory.
    let processes = gpu.running_compute_processes().unwrap();
    assert!(processes.iter().all(|p| p.pid != pid), "{processes:?}");
    let model = sim.model();
    assert!(common::eventually(Duration::from_secs(5), || {
        let snap = model.lock().unwrap().snapshot(0).unwrap();
        snap.contexts.is_empty() && snap.memory_used == 0 && snap.processes.is_empty()
    }));
}
