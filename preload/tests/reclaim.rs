//! Memory that follows priority, end to end on the simulated GPU: a real arbiter with
//! `[memory] reclaim` (the simulated driver's checkpoint API behind it), the interposer in
//! every process, the probe as the CUDA programs. Low-priority processes write a pattern
//! into device memory; a high-priority allocation that needs their memory makes the
//! arbiter checkpoint them off the GPU; once it is freed they are restored and read back
//! exactly what they wrote. The fault tests SIGKILL the arbiter at each step of a reclaim
//! and a restore (`GPUSHARE_FAULT_RECLAIM`): nothing is left locked or lost.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::*;
use gpushare_proto::{ControlClient, Priority, ViolationKind};

const GI: u64 = 1 << 30;
/// Small, so the figures below are about the allocations.
const CONTEXT: &str = "64Mi";

/// A private arbiter with memory reclaim on one simulated 16 GiB GPU (no driver reserve),
/// seen through the simulated NVML and checkpointing through the simulated driver.
struct ReclaimMachine {
    arbiter: Arbiter,
    machine: simgpu::SimMachine,
    containers: Vec<Child>,
}

impl ReclaimMachine {
    fn start(fault: Option<&str>) -> ReclaimMachine {
        let libs = sim_libs();
        let mut builder = Arbiter::builder();
        let machine = simgpu::SimMachine::new(builder.dir().join("simgpu"), 1, "16Gi")
            .set("SIMGPU_CONTEXT_MEMORY", CONTEXT)
            .set("SIMGPU_RESERVED_MEMORY", 0);
        std::fs::create_dir_all(&machine.state_dir).unwrap();
        if let Some(point) = fault {
            // Once: the restarted arbiter must not die again at the same step.
            let once = builder.dir().join("fault-fired");
            builder = builder.env(
                "GPUSHARE_FAULT_RECLAIM",
                format!("{point}:{}", once.display()),
            );
        }
        let arbiter = builder
            .simulated(&machine)
            .configure(|c| {
                c.memory.reclaim = true;
                c.memory.cuda_library = libs.join("libcuda.so.1").display().to_string();
                c.arbiter.watchdog_interval_ms = 200;
            })
            .start();
        ReclaimMachine {
            arbiter,
            machine,
            containers: Vec::new(),
        }
    }

    fn control(&self) -> ControlClient {
        self.arbiter.client()
    }

    /// A confirmed lease of `memory` whose "container" is a sleeping process of this test.
    fn lease(&mut self, memory: &str, priority: Priority) -> String {
        let container = format!("c{}", self.containers.len());
        let mut request = low_request(&container, Some(memory));
        request.priority = priority;
        let lease = self.control().reserve(request).unwrap().id.0;
        let init = sleeping_container(&mut self.control(), container);
        self.containers.push(init);
        lease
    }

    fn probe(&self, lease: &str, args: &[&str]) -> Command {
        probe_on(&self.machine, lease, self.arbiter.lease_socket(lease), args)
    }

    fn file(&self, name: &str) -> PathBuf {
        self.arbiter.dir().join(name)
    }

    fn status(&self) -> gpushare_proto::StatusReport {
        self.control().status().unwrap()
    }
}

impl Drop for ReclaimMachine {
    fn drop(&mut self) {
        for c in &mut self.containers {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The buffer a low-priority process writes its pattern over: the simulated device keeps
/// the bytes in a file, so the rest of its memory is allocated but not written.
const WRITTEN: u64 = 64 << 20;

/// A low-priority process: allocates `gib` GiB, writes the pattern of `byte` over its
/// last 64 MiB, says so (`<name>-ready`), waits for `go`, reads it back, runs kernels and
/// exits.
fn low_job(m: &ReclaimMachine, lease: &str, name: &str, gib: u64, byte: u8) -> Child {
    let ready = m.file(&format!("{name}-ready"));
    let go = m.file("go");
    let bytes = (gib * GI - WRITTEN).to_string();
    let written = WRITTEN.to_string();
    let byte = byte.to_string();
    m.probe(
        lease,
        &[
            "alloc",
            &bytes,
            "alloc",
            &written,
            "fill",
            &byte,
            "touch",
            ready.to_str().unwrap(),
            "wait",
            go.to_str().unwrap(),
            "check",
            &byte,
            "kernel-ms",
            "2",
            "meminfo",
        ],
    )
    .spawn()
    .unwrap()
}

/// Two low-priority leases of 6 GiB, each with a job holding 5 GiB (`low_job`, patterns
/// `bytes`), ready; and a high-priority lease of 12 GiB. Returns (a, b, high, jobs).
fn two_lows_and_a_high(
    m: &mut ReclaimMachine,
    bytes: [u8; 2],
) -> (String, String, String, [Child; 2]) {
    let a = m.lease("6Gi", Priority::Low);
    let b = m.lease("6Gi", Priority::Low);
    let high = m.lease("12Gi", Priority::High);
    let jobs = [
        low_job(m, &a, "a", 5, bytes[0]),
        low_job(m, &b, "b", 5, bytes[1]),
    ];
    wait_for_file(&m.file("a-ready"));
    wait_for_file(&m.file("b-ready"));
    (a, b, high, jobs)
}

/// The high-priority process: allocates `bytes` (with `meminfo` before and after), says so,
/// and holds it until the file this returns is written. Returns once it holds it.
fn high_job_holding(m: &ReclaimMachine, lease: &str, bytes: u64) -> (Child, PathBuf) {
    let (holding, release) = (m.file("high-holds"), m.file("high-frees"));
    let bytes = bytes.to_string();
    let job = m
        .probe(
            lease,
            &[
                "meminfo",
                "alloc",
                &bytes,
                "meminfo",
                "touch",
                holding.to_str().unwrap(),
                "wait",
                release.to_str().unwrap(),
                "free-all",
            ],
        )
        .spawn()
        .unwrap();
    wait_for_file(&holding);
    (job, release)
}

fn wait_for_file(path: &Path) {
    wait_until(
        &format!("{}", path.display()),
        Duration::from_secs(60),
        || path.exists(),
    );
}

#[test]
fn a_high_allocation_takes_two_low_leases_memory_and_both_come_back_with_their_data() {
    let mut m = ReclaimMachine::start(None);
    let a = m.lease("6Gi", Priority::Low);
    let b = m.lease("6Gi", Priority::Low);
    let ipc = m.lease("3Gi", Priority::Low);
    // The IPC process exports its allocation first: its lease is guaranteed from then on.
    let ipc_ready = m.file("ipc-ready");
    let ipc_job = m
        .probe(
            &ipc,
            &[
                "vmm-export",
                &(2 * GI).to_string(),
                "touch",
                ipc_ready.to_str().unwrap(),
                "wait",
                m.file("go").to_str().unwrap(),
            ],
        )
        .spawn()
        .unwrap();
    wait_for_file(&ipc_ready);
    let high = m.lease("12Gi", Priority::High);
    let low_a = low_job(&m, &a, "a", 5, 0x11);
    let low_b = low_job(&m, &b, "b", 5, 0x22);
    wait_for_file(&m.file("a-ready"));
    wait_for_file(&m.file("b-ready"));
    // 5 + 5 + 2 GiB and four 64 MiB contexts are in use: 11 GiB more is 7.25 GiB over
    // the GPU, which only both 5 GiB low leases cover (the IPC one cannot be checkpointed).
    let (high_job, release) = high_job_holding(&m, &high, 11 * GI);
    // While the low leases are off the GPU, NVML (as the arbiter reads it) shows the GPU
    // within its memory.
    let during = m.status();
    let gpu = &during.gpus[0];
    assert!(
        gpu.memory_used.is_some_and(|used| used <= gpu.memory_total),
        "{gpu:?}"
    );
    let suspended = &during.reclaim.as_ref().unwrap().suspended;
    assert_eq!(suspended.len(), 2, "{suspended:?}");
    std::fs::write(&release, "").unwrap();
    let s = finish_within(high_job, Duration::from_secs(60), "high");
    assert_eq!(
        s.result("alloc", 0),
        "CUDA_SUCCESS",
        "{}\n{}",
        s.stderr,
        m.arbiter.log()
    );
    assert!(
        s.number("meminfo", 1, "free") <= 12 * GI,
        "cuMemGetInfo stays within the quota"
    );
    let report = m.status();
    let reclaim = report.reclaim.clone().expect("reclaim is on");
    let last = reclaim.recent.last().expect("a reclaim").clone();
    assert!(last.succeeded, "{last:?}");
    assert_eq!(last.victims.len(), 2, "{last:?}");
    assert!(
        last.victims.contains(&a) && last.victims.contains(&b),
        "{last:?}"
    );
    assert!(
        !last.victims.contains(&ipc),
        "the IPC lease is never chosen"
    );
    eprintln!(
        "reclaim (simulated): {} from 2 leases in {:.0} ms (lock {:.0} ms, checkpoint {:.0} ms), bound {:.0} ms",
        gpushare_proto::ByteSize(last.bytes),
        last.total_ms,
        last.lock_ms,
        last.checkpoint_ms,
        last.bound_ms
    );
    // The high process freed its memory and exited: both low leases come back.
    std::fs::write(m.file("go"), "").unwrap();
    for (job, name) in [(low_a, "a"), (low_b, "b")] {
        let s = finish_within(job, Duration::from_secs(60), name);
        assert_eq!(s.result("check", 0), "CUDA_SUCCESS", "{name}: {}", s.stderr);
        assert_eq!(
            s.result("kernel-ms", 0),
            "CUDA_SUCCESS",
            "{name}: {}",
            s.stderr
        );
    }
    finish_within(ipc_job, Duration::from_secs(60), "ipc");
    let report = m.status();
    let reclaim = report.reclaim.unwrap();
    assert!(reclaim.suspended.is_empty(), "{:?}", reclaim.suspended);
    assert_eq!(reclaim.restores, 2);
    assert!(
        !report
            .violations
            .iter()
            .any(|v| v.kind == ViolationKind::OverQuota),
        "no process exceeded its quota: {:?}",
        report.violations
    );
}

/// The arbiter SIGKILLs itself at `point` of a reclaim of two low leases' memory (once)
/// and is started again: both low processes end restored with their data, the high
/// process's allocation either succeeds or fails cleanly, nothing stays suspended, every
/// lease is still there.
fn killed_at(point: &str) {
    let mut m = ReclaimMachine::start(Some(point));
    let (_a, _b, high, [low_a, low_b]) = two_lows_and_a_high(&mut m, [0x33, 0x44]);
    let eleven = (11 * GI).to_string();
    let high_job = m
        .probe(&high, &["alloc", &eleven, "free-all"])
        .spawn()
        .unwrap();
    wait_until(
        &format!("the arbiter to kill itself at {point}"),
        Duration::from_secs(60),
        || m.arbiter.exited().is_some(),
    );
    m.arbiter.restart();
    let s = finish_within(high_job, Duration::from_secs(60), "high");
    let alloc = s.result("alloc", 0).to_owned();
    assert!(
        alloc == "CUDA_SUCCESS" || alloc == "CUDA_ERROR_OUT_OF_MEMORY",
        "{point}: the allocation succeeds or fails cleanly: {alloc}\n{}",
        s.stderr
    );
    std::fs::write(m.file("go"), "").unwrap();
    for (job, name) in [(low_a, "a"), (low_b, "b")] {
        let s = finish_within(job, Duration::from_secs(60), name);
        assert_eq!(
            s.result("check", 0),
            "CUDA_SUCCESS",
            "{point}: {name} reads back what it wrote\n{}\n{}",
            s.stderr,
            m.arbiter.log()
        );
    }
    let report = m.status();
    assert_eq!(
        report.leases.len(),
        3,
        "{point}: every lease is still there"
    );
    let reclaim = report.reclaim.unwrap();
    assert!(
        reclaim.suspended.is_empty(),
        "{point}: nothing stays suspended: {:?}",
        reclaim.suspended
    );
    let journal = std::fs::read_to_string(m.arbiter.dir().join("state/reclaim.json")).unwrap();
    assert_eq!(journal.trim(), "{}", "{point}: the journal lists nothing");
    eprintln!("{point}: high allocation {alloc}");
}

#[test]
fn killed_once_the_victims_are_journalled_nothing_is_locked() {
    killed_at("suspending");
}

#[test]
fn killed_with_a_victim_locked_it_is_unlocked() {
    killed_at("locked");
}

#[test]
fn killed_with_a_victim_checkpointed_it_is_restored() {
    killed_at("checkpointed");
}

#[test]
fn killed_before_the_charge_is_answered_the_suspended_come_back() {
    killed_at("suspended");
}

#[test]
fn killed_between_a_restore_and_its_unlock_the_process_is_unlocked() {
    killed_at("restored");
}

/// A low process SIGKILLed while its lease is suspended: the arbiter lets its suspension
/// go (nothing to restore), the other victim comes back, and the lease is released
/// cleanly, leaving nothing in the simulated driver.
#[test]
fn a_victim_killed_while_suspended_leaves_its_lease_to_release_cleanly() {
    let mut m = ReclaimMachine::start(None);
    let (a, _b, high, [mut low_a, low_b]) = two_lows_and_a_high(&mut m, [0x55, 0x66]);
    let (high_job, release) = high_job_holding(&m, &high, 11 * GI);
    let suspended = m.status().reclaim.unwrap().suspended;
    assert!(suspended.iter().any(|s| s.lease == a), "{suspended:?}");
    low_a.kill().unwrap();
    low_a.wait().unwrap();
    std::fs::write(&release, "").unwrap();
    std::fs::write(m.file("go"), "").unwrap();
    finish_within(high_job, Duration::from_secs(60), "high");
    let s = finish_within(low_b, Duration::from_secs(60), "b");
    assert_eq!(s.result("check", 0), "CUDA_SUCCESS", "{}", s.stderr);
    wait_until("no lease suspended", Duration::from_secs(30), || {
        m.status().reclaim.unwrap().suspended.is_empty()
    });
    let a_id = gpushare_proto::LeaseId(a.clone());
    let usage = m.status().usage;
    let a_usage = usage.iter().find(|u| u.lease == a_id).unwrap();
    assert!(a_usage.clients.is_empty(), "{a_usage:?}");
    assert!(m.control().release(a_id).unwrap(), "released");
    // The killed process's memory images went with it.
    let images = m.machine.state_dir.join("memory");
    wait_until(
        "the killed process's images removed",
        Duration::from_secs(30),
        || {
            std::fs::read_dir(&images)
                .map(|d| d.count() == 0)
                .unwrap_or(true)
        },
    );
}
