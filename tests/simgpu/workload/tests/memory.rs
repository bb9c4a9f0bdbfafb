//! Finite memory and what NVML (through nvml-wrapper, as the arbiter will use it) reports.

mod common;
use common::{f, Sim};
use nvml_wrapper::enums::device::UsedGpuMemory;
use std::time::Duration;

const GIB: u64 = 1 << 30;
/// What a workload holds besides its allocations: its context (SIMGPU_CONTEXT_MEMORY, 300 MiB
/// by default) and its lazily loaded module (SIMGPU_MODULE_MEMORY, 2 MiB), as nvidia-smi shows.
const OVERHEAD: u64 = (300 << 20) + (2 << 20);
/// What the driver keeps for itself on each GPU (NVML v2's `reserved`): never allocatable.
const RESERVED: u64 = 100 << 20;

#[test]
fn over_capacity_is_out_of_memory_and_nvml_reports_per_process_usage() {
    let sim = Sim::new(&[
        ("SIMGPU_GPUS", "2"),
        ("SIMGPU_MEMORY", "4Gi"),
        ("SIMGPU_RESERVED_MEMORY", "100Mi"),
    ]);
    let nvml = sim.nvml();
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
    let gpu = nvml.device_by_index(0).unwrap();
    assert_eq!(
        gpu.uuid().unwrap(),
        "GPU-51a6d0e0-0000-4000-8000-000000000000"
    );
    let by_uuid = nvml
        .device_by_uuid("GPU-51a6d0e0-0000-4000-8000-000000000001")
        .unwrap();
    assert_eq!(by_uuid.index().unwrap(), 1);
    assert!(gpu.name().unwrap().contains("simgpu"));
    let idle = gpu.memory_info().unwrap();
    assert_eq!(
        (idle.total, idle.reserved, idle.free, idle.used),
        (4 * GIB, RESERVED, 4 * GIB - RESERVED, 0),
        "NVML v2: the physical total, the reserved part apart, used without it"
    );
    assert!(gpu.running_compute_processes().unwrap().is_empty());

    // A holds 3 GiB and keeps the GPU busy for a while.
    let holder = sim
        .workload(&[
            "--memory",
            "3Gi",
            "--kernel",
            "fixed:1ms",
            "--kernels",
            "5",
            "--sync",
            "event",
            "--pipeline",
            "2",
            "--duration",
            "3s",
        ])
        .spawn()
        .unwrap();
    let holder_pid = holder.id();
    let seen = common::eventually(Duration::from_secs(20), || {
        gpu.running_compute_processes().unwrap().iter().any(|p| {
            p.pid == holder_pid && p.used_gpu_memory == UsedGpuMemory::Used(3 * GIB + OVERHEAD)
        })
    });

    // B asks for 2 GiB more than is left: a clean CUDA_ERROR_OUT_OF_MEMORY, nothing charged.
    let over = sim.run(&["--memory", "2Gi", "--iterations", "1", "--kernels", "1"]);
    // B's own context and module are reclaimed once its exit is noticed (within 100 ms).
    let mut during = gpu.memory_info().unwrap();
    common::eventually(Duration::from_secs(2), || {
        during = gpu.memory_info().unwrap();
        during.used <= 3 * GIB + OVERHEAD
    });
    let processes = gpu.running_compute_processes().unwrap();
    // Utilisation covers the last second: once the holder has run that long it reads ~100 %.
    let mut utilization = 0;
    let busy = common::eventually(Duration::from_millis(2500), || {
        utilization = gpu.utilization_rates().unwrap().gpu;
        utilization >= 90
    });
    let held = common::wait_for_child(holder);

    assert!(seen, "NVML never showed the holder with its 3 GiB");
    assert_eq!(over["allocations"]["failed"], 1, "{over}");
    assert_eq!(over["allocations"]["succeeded"], 0, "{over}");
    assert_eq!(
        over["allocations"]["last_error"], "CUDA_ERROR_OUT_OF_MEMORY",
        "{over}"
    );
    assert_eq!(held["allocations"]["succeeded"], 1, "{held}");
    assert_eq!(
        during.used,
        3 * GIB + OVERHEAD,
        "the failed allocation charged nothing"
    );
    assert_eq!(during.free, GIB - OVERHEAD - RESERVED);
    let holder_entry = processes
        .iter()
        .find(|p| p.pid == holder_pid)
        .expect("holder listed with its host pid");
    assert_eq!(
        holder_entry.used_gpu_memory,
        UsedGpuMemory::Used(3 * GIB + OVERHEAD),
        "NVML's per-process usage includes the context and module overhead"
    );
    assert!(
        busy,
        "GPU busy with the holder's kernels, yet NVML says {utilization}%"
    );
    assert!(f(&held, "iterations") > 0.0);

    // Once the holder has exited its memory is reclaimed.
    assert!(common::eventually(Duration::from_secs(5), || gpu
        .memory_info()
        .unwrap()
        .used
        == 0));
    assert!(gpu.running_compute_processes().unwrap().is_empty());

    // NVML's total is more than CUDA can ever allocate: the driver's view (cuMemGetInfo)
    // leaves the reserved part out, and an allocation that fits NVML's total but not that
    // fails with CUDA_ERROR_OUT_OF_MEMORY.
    let model = sim.model();
    assert_eq!(
        model.lock().unwrap().memory_info(0),
        (4 * GIB - RESERVED, 4 * GIB - RESERVED)
    );
    let nvml_room = (4 * GIB - OVERHEAD).to_string();
    let too_big = sim.run(&[
        "--memory",
        &nvml_room,
        "--iterations",
        "1",
        "--kernels",
        "1",
    ]);
    assert_eq!(
        too_big["allocations"]["last_error"], "CUDA_ERROR_OUT_OF_MEMORY",
        "{too_big}"
    );
    let cuda_room = (4 * GIB - RESERVED - OVERHEAD).to_string();
    let fits = sim.run(&[
        "--memory",
        &cuda_room,
        "--iterations",
        "1",
        "--kernels",
        "1",
    ]);
    assert_eq!(fits["allocations"]["succeeded"], 1, "{fits}");
}
