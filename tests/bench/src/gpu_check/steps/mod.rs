//! The matrix, one function per step, grouped by what they exercise. Each step's budget is
//! what it needs on a real GPU with room to spare; together they fit in 8 minutes.

mod capture;
mod facts;
mod frameworks;
mod priority;
mod probe;
mod timeslice;

use super::Step;
use std::time::Duration;

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

pub const STEPS: &[Step] = &[
    Step {
        name: "probe-alone",
        what: "the probe on the driver without the interposer: the PTX kernel, a captured graph",
        budget: secs(20),
        run: probe::alone,
    },
    Step {
        name: "memory-quota",
        what: "a 2 GiB lease (context included): 1 GiB granted, a second refused",
        budget: secs(20),
        run: probe::memory_quota,
    },
    Step {
        name: "capture-high-idle",
        what: "a GLOBAL capture across a high-priority holder's idle time",
        budget: secs(20),
        run: capture::high_idle,
    },
    Step {
        name: "capture-low-revoked",
        what: "a GLOBAL capture across a low-priority holder's revocation",
        budget: secs(20),
        run: capture::low_revoked,
    },
    Step {
        name: "capture-join-churn",
        what: "a capture that forks to a second stream and joins (probe capture-join), by a low-priority holder while a high-priority job churns the token",
        budget: secs(20),
        run: capture::join_under_churn,
    },
    Step {
        name: "long-kernels",
        what: "a low-priority job of 2 s kernels beside a high-priority job: finishes, never cut off",
        budget: secs(40),
        run: priority::long_kernels,
    },
    Step {
        name: "priority-pair",
        what: "high (50 × 100 µs + 3.3 ms gap) alone and beside a saturating low job (1 ms kernels); slowdown reported",
        budget: secs(45),
        run: priority::pair,
    },
    Step {
        name: "torch-eager",
        what: "PyTorch MLP training under a 2 GiB quota: registered before its first allocation, mem_get_info total == quota, past the quota torch.OutOfMemoryError",
        budget: secs(55),
        run: frameworks::torch_eager,
    },
    Step {
        name: "torch-graphs",
        what: "torch.cuda.graph capture/replay and torch.compile(mode=\"reduce-overhead\") as a low job under high-priority churn: results correct",
        budget: secs(70),
        run: frameworks::torch_graphs,
    },
    Step {
        name: "cupy",
        what: "CuPy RawKernel and ElementwiseKernel, its memory pool under a 1 GiB quota: growth past it raises cupy.cuda.memory.OutOfMemoryError",
        budget: secs(25),
        run: frameworks::cupy,
    },
    Step {
        name: "triton",
        what: "a Triton vector-add kernel under a lease: result correct",
        budget: secs(35),
        run: frameworks::triton,
    },
    Step {
        name: "memory-facts",
        what: "NVML total (v1), NVML v2 reserved, cuMemGetInfo total, the largest single cuMemAlloc (allocatable)",
        budget: secs(20),
        run: facts::memory,
    },
    Step {
        name: "timeslice",
        what: "the hardware time slice (default; short/medium/long as root, default restored) and the context-switch cost, in µs, from two kernels' %globaltimer traces",
        budget: secs(45),
        run: timeslice::timeslice,
    },
    Step {
        name: "checkpoint",
        what: "cuCheckpointProcess lock/checkpoint/restore/unlock latency of a process holding 256 MiB, 1 GiB, 4 GiB, 8 GiB (r570+)",
        budget: secs(45),
        run: facts::checkpoint,
    },
];
