//! NVIDIA_VISIBLE_DEVICES: inside a container the NVIDIA toolkit exposes only the
//! named GPUs, renumbered from 0; the simulated driver applies the same rule, so a
//! container's device 0 is the GPU its lease names.

mod common;
use common::{wait_for_child, Sim};
use std::time::Duration;

#[test]
fn device_zero_is_the_gpu_named_by_nvidia_visible_devices() {
    let sim = Sim::new(&[("SIMGPU_GPUS", "2"), ("SIMGPU_MEMORY", "4Gi")]);
    let nvml = sim.nvml();
    let uuid1 = "GPU-51a6d0e0-0000-4000-8000-000000000001";
    let job = sim
        .workload(&[
            "--device",
            "0",
            "--memory",
            "1Gi",
            "--kernel",
            "fixed:1ms",
            "--kernels",
            "5",
            "--duration",
            "2s",
        ])
        .env("NVIDIA_VISIBLE_DEVICES", uuid1)
        .spawn()
        .unwrap();
    let pid = job.id();
    let on_gpu1 = common::eventually(Duration::from_secs(20), || {
        nvml.device_by_index(1)
            .unwrap()
            .running_compute_processes()
            .unwrap()
            .iter()
            .any(|p| p.pid == pid)
    });
    let on_gpu0 = nvml
        .device_by_index(0)
        .unwrap()
        .running_compute_processes()
        .unwrap()
        .iter()
        .any(|p| p.pid == pid);
    let report = wait_for_child(job);
    assert!(
        on_gpu1 && !on_gpu0,
        "device 0 of the process must be GPU 1: {report}"
    );
    assert_eq!(report["allocations"]["succeeded"], 1);

    // A second visible device does not exist for it, and `void` hides every GPU.
    let out = sim
        .workload(&["--device", "1", "--iterations", "1", "--kernels", "1"])
        .env("NVIDIA_VISIBLE_DEVICES", uuid1)
        .output()
        .unwrap();
    assert!(!out.status.success(), "device 1 is not visible");
    let out = sim
        .workload(&["--iterations", "1", "--kernels", "1"])
        .env("NVIDIA_VISIBLE_DEVICES", "void")
        .output()
        .unwrap();
    assert!(!out.status.success(), "no GPU is visible with void");
}
