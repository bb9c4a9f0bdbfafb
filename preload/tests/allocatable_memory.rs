//! A GPU packed to its limit gives every process its whole quota: placement shares out the
//! memory CUDA can really allocate (NVML's total less what the driver reserves), and a
//! lazily loaded module counts against its lease before the lease's next charge, so no
//! process meets an out-of-memory from the driver below its quota. Against the simulated
//! GPU (`SIMGPU_RESERVED_MEMORY`, `SIMGPU_MODULE_MEMORY`) with a real gpushare-arbiter
//! that reads the simulated NVML.

mod common;

use std::process::Child;
use std::time::Duration;

use common::*;
use gpushare_proto::ControlClient;

const GPU: u64 = 4 << 30;
/// Each process's CUDA context, not the arbiter's estimate (300 MiB): only a
/// measurement gets the quotas' remainders right.
const CONTEXT: u64 = 256 * MI;

/// One simulated GPU of 4 GiB seen by the arbiter through the simulated NVML, with the
/// watchdog's periodic measurement out of the way (a minute), so that only what the
/// arbiter does on its own at attach and at a charge can notice memory.
struct PackedGpu {
    arbiter: Arbiter,
    machine: simgpu::SimMachine,
    containers: Vec<Child>,
}

impl PackedGpu {
    fn start(reserved: u64, module: u64) -> PackedGpu {
        sim_libs();
        let builder = Arbiter::builder();
        let machine = simgpu::SimMachine::new(builder.dir().join("simgpu"), 1, "4Gi")
            .set("SIMGPU_RESERVED_MEMORY", reserved)
            .set("SIMGPU_CONTEXT_MEMORY", CONTEXT)
            .set("SIMGPU_MODULE_MEMORY", module);
        std::fs::create_dir_all(&machine.state_dir).unwrap();
        let arbiter = builder
            .simulated(&machine)
            .configure(|c| c.arbiter.watchdog_interval_ms = 60_000)
            .start();
        PackedGpu {
            arbiter,
            machine,
            containers: Vec::new(),
        }
    }

    fn control(&self) -> ControlClient {
        self.arbiter.client()
    }

    /// A confirmed lease (`memory`: None asks for the arbiter's `default_memory`) whose
    /// "container" is a sleeping process of this test; (lease, quota).
    fn lease(&mut self, memory: Option<&str>) -> (String, u64) {
        let container = format!("c{}", self.containers.len());
        let lease = self
            .control()
            .reserve(low_request(&container, memory))
            .unwrap_or_else(|e| panic!("reserve {memory:?}: {e}\n{}", self.arbiter.log()));
        let init = sleeping_container(&mut self.control(), container);
        self.containers.push(init);
        (lease.id.0, lease.memory_bytes)
    }

    /// The probe as a process of `lease`, running `args`, then telling the test it is done
    /// (`<dir>/<name>.done`) and holding what it has until the test ends.
    fn hold(&self, lease: &str, name: &str, args: &[&str]) -> Child {
        let done = self.arbiter.dir().join(format!("{name}.done"));
        let end = self.arbiter.dir().join("end");
        let mut all: Vec<&str> = args.to_vec();
        all.extend([
            "touch",
            done.to_str().unwrap(),
            "wait",
            end.to_str().unwrap(),
        ]);
        let child = probe_on(&self.machine, lease, self.arbiter.lease_socket(lease), &all)
            .spawn()
            .unwrap();
        wait_until(name, Duration::from_secs(60), || done.exists());
        child
    }

    /// Lets every holding probe end; their steps, in the order given.
    fn finish(&self, probes: Vec<Child>) -> Vec<Steps> {
        std::fs::write(self.arbiter.dir().join("end"), "").unwrap();
        probes.into_iter().map(finish).collect()
    }

    fn allocatable(&self) -> u64 {
        self.control().status().unwrap().gpus[0].memory_allocatable
    }
}

impl Drop for PackedGpu {
    fn drop(&mut self) {
        let _ = std::fs::write(self.arbiter.dir().join("end"), "");
        for c in &mut self.containers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whose out-of-memory an allocation met: the interposer refuses over the quota (and
/// says so in its log); anything else came from the driver.
fn who_refused(s: &Steps) -> &'static str {
    if s.stderr.contains("bytes refused: the lease uses") {
        "the interposer (over the quota)"
    } else {
        "the DRIVER (below the quota)"
    }
}

fn assert_allocated(s: &Steps, what: &str, n: usize, context: &dyn Fn() -> String) {
    let result = s.result("alloc", n);
    assert_eq!(
        result,
        "CUDA_SUCCESS",
        "{what}: refused by {}\n{}\n{}",
        who_refused(s),
        s.stderr,
        context()
    );
}

/// Four leases of the default size (a quarter of the GPU each) fill it; each process
/// creates its context and allocates the rest of its quota. NVML's total is more than
/// CUDA can allocate: quotas that add up to it leave the last process a driver
/// out-of-memory, below its quota.
#[test]
fn a_gpu_packed_with_default_leases_gives_every_process_its_whole_quota() {
    const RESERVED: u64 = 96 * MI;
    let mut gpu = PackedGpu::start(RESERVED, 0);
    assert_eq!(
        gpu.allocatable(),
        GPU - RESERVED,
        "NVML v2's reserve is left out"
    );
    let leases: Vec<(String, u64)> = (0..4).map(|_| gpu.lease(None)).collect();
    let quotas: u64 = leases.iter().map(|(_, q)| q).sum();
    let mut probes = Vec::new();
    for (i, (lease, quota)) in leases.iter().enumerate() {
        let rest = (quota - CONTEXT).to_string();
        probes.push(gpu.hold(lease, &format!("p{i}"), &["meminfo", "alloc", &rest]));
    }
    let steps = gpu.finish(probes);
    for (i, (s, (_, quota))) in steps.iter().zip(&leases).enumerate() {
        let context = || format!("quotas {quotas}\n{}", gpu.arbiter.log());
        assert_allocated(s, &format!("process {i}"), 0, &context);
        assert_eq!(
            s.number("meminfo", 0, "free"),
            quota - CONTEXT,
            "process {i}: cuMemGetInfo promises the quota less the context"
        );
    }
    assert!(
        quotas <= GPU - RESERVED,
        "quotas of {quotas} bytes placed on {} allocatable",
        GPU - RESERVED
    );
}

/// A process whose first launch loaded a module (cuBLAS loads hundreds of MiB that way)
/// and then asks for the rest of its quota as measured at its attach: the module is
/// counted before that charge, so the process is refused by its quota rather than taking
/// room its neighbour was promised, whose allocation then fails in the driver.
#[test]
fn a_lazily_loaded_module_counts_against_its_lease_before_the_next_charge() {
    const MODULE: u64 = 64 * MI;
    // Nothing reserved: only the module can over-commit the GPU here.
    let mut gpu = PackedGpu::start(0, MODULE);
    let (a, quota_a) = gpu.lease(Some("50%"));
    let (b, quota_b) = gpu.lease(Some("50%"));
    assert!(quota_a + quota_b <= GPU);
    let rest_a = (quota_a - CONTEXT).to_string();
    let rest_b = (quota_b - CONTEXT).to_string();
    let within_a = (quota_a - CONTEXT - MODULE).to_string();
    // Longer than the arbiter's measurement stays fresh (`MEASURE_FRESH`, 100 ms): the
    // charge after the launch is not judged on the measurement taken at attach.
    let first = gpu.hold(
        &a,
        "a",
        &[
            "launch", "1", "sync", "sleep", "300", "alloc", &rest_a, "alloc", &within_a,
        ],
    );
    let second = gpu.hold(&b, "b", &["alloc", &rest_b]);
    let steps = gpu.finish(vec![first, second]);
    let context = || gpu.arbiter.log();
    assert_eq!(
        steps[0].result("launch", 0),
        "CUDA_SUCCESS",
        "{}",
        steps[0].stderr
    );
    assert_eq!(
        steps[0].result("alloc", 0),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "the module is part of what the lease's processes use\n{}",
        steps[0].stderr
    );
    assert_eq!(who_refused(&steps[0]), "the interposer (over the quota)");
    assert_allocated(&steps[0], "a, within its quota", 1, &context);
    assert_allocated(&steps[1], "b, its whole quota", 0, &context);
}
