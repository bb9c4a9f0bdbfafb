//! The real NVML path, against the simulated GPU's libnvidia-ml.so.1: inventory,
//! driver CUDA version, utilisation sampling, GPUs that cannot be shared (compute
//! mode, MIG, MPS) set aside and refused, and the watchdog catching a process that
//! uses a shared GPU without registering (and killing it when configured).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::*;
use gpushare_proto::{ClientError, ErrorKind, GpuSelector, Priority, ViolationKind};

const GI: u64 = 1 << 30;

/// The simulated GPU's CUDA program (the libraries come from the test kit).
fn workload() -> PathBuf {
    binaries::require(&["simgpu-workload"]);
    binaries::program("simgpu-workload")
}

/// A CUDA program on GPU 0 that never talks to the arbiter (it "bypassed the interposer").
fn rogue_workload(sim_dir: &Path, lib_dir: &Path, workload: &Path) -> Child {
    Command::new(workload)
        .args([
            "--device",
            "0",
            "--memory",
            "1073741824",
            "--kernels",
            "4",
            "--kernel",
            "fixed:1ms",
        ])
        .args(["--gap", "1ms", "--duration", "60s"])
        .env("SIMGPU_DIR", sim_dir)
        .env("LD_LIBRARY_PATH", lib_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The daemon on two simulated GPUs, the simulated machine's state directory and the
/// directory of its driver libraries.
fn nvml_daemon(kill: bool) -> (Arbiter, PathBuf, &'static Path) {
    nvml_daemon_with(kill, &[("SIMGPU_GPUS", "2")])
}

/// `settings`: the simulated GPU's settings (`SIMGPU_GPUS`, modes), which the arbiter's
/// NVML reads.
fn nvml_daemon_with(kill: bool, settings: &[(&str, &str)]) -> (Arbiter, PathBuf, &'static Path) {
    let builder = Arbiter::builder().program(ARBITER);
    let mut machine = SimMachine::new(builder.dir().join("state"), 1, "16Gi");
    for (key, value) in settings {
        machine = machine.set(key, value);
    }
    let d = builder
        .simulated(&machine)
        .configure(|c| {
            c.arbiter.watchdog_interval_ms = 200;
            c.arbiter.watchdog_kill = kill;
        })
        .start();
    (d, machine.state_dir, simgpu::libs())
}

fn reserve_on(d: &Arbiter, container: &str, gpu: GpuSelector) -> Result<String, ClientError> {
    let mut r = request(container, "1Gi", Priority::Low);
    r.gpu = gpu;
    d.client().reserve(r).map(|lease| lease.gpus.join(","))
}

fn refusal(result: Result<String, ClientError>) -> String {
    match result {
        Err(ClientError::Refused { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest, "{message}");
            message
        }
        other => panic!("expected a refusal: {other:?}"),
    }
}

#[test]
fn gpus_in_exclusive_process_mode_or_with_mig_are_set_aside_reported_and_refused() {
    let (d, _sim, _lib) = nvml_daemon_with(
        false,
        &[
            ("SIMGPU_GPUS", "3"),
            ("SIMGPU_COMPUTE_MODE", "1:exclusive_process"),
            ("SIMGPU_MIG", "2"),
        ],
    );
    let status = d.client().status().unwrap();
    assert_eq!(status.inventory_source, "nvml", "{}", d.log());
    assert_eq!(
        status
            .gpus
            .iter()
            .map(|g| g.uuid.clone())
            .collect::<Vec<_>>(),
        vec![sim_uuid(0)],
        "only GPU 0 is shared"
    );
    let set_aside: Vec<(u32, String, String)> = status
        .unshareable
        .iter()
        .map(|u| (u.index, u.uuid.clone(), u.reason.clone()))
        .collect();
    assert_eq!(set_aside.len(), 2, "{set_aside:?}");
    assert_eq!((set_aside[0].0, &set_aside[0].1), (1, &sim_uuid(1)));
    assert!(
        set_aside[0].2.contains("compute mode EXCLUSIVE_PROCESS")
            && set_aside[0]
                .2
                .contains(&format!("nvidia-smi -i {} -c DEFAULT", sim_uuid(1))),
        "{}",
        set_aside[0].2
    );
    assert_eq!((set_aside[1].0, &set_aside[1].1), (2, &sim_uuid(2)));
    assert!(
        set_aside[1].2.contains("MIG mode is enabled"),
        "{}",
        set_aside[1].2
    );

    let text = String::from_utf8_lossy(&d.ctl(&["status"]).stdout).into_owned();
    assert!(
        text.contains(&format!("GPU 1 ({}) cannot be shared: ", sim_uuid(1)))
            && text.contains(&format!("GPU 2 ({}) cannot be shared: ", sim_uuid(2)))
            && text.contains("EXCLUSIVE_PROCESS")
            && text.contains("NOT SHARED: unshareable"),
        "{text}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&d.ctl(&["status", "--json"]).stdout).unwrap();
    assert_eq!(json["unshareable"][1]["uuid"], sim_uuid(2));

    let named = refusal(reserve_on(&d, "x", GpuSelector::Index(vec![1])));
    assert!(
        named.contains(&sim_uuid(1))
            && named.contains("EXCLUSIVE_PROCESS")
            && named.contains("set it to DEFAULT"),
        "{named}"
    );
    let by_uuid = refusal(reserve_on(&d, "y", GpuSelector::Uuid(vec![sim_uuid(2)])));
    assert!(by_uuid.contains("MIG"), "{by_uuid}");
    let two = refusal(reserve_on(&d, "z", GpuSelector::Count(2)));
    assert!(
        two.contains("only 1 GPU(s) on this node can be shared"),
        "{two}"
    );
    assert_eq!(
        reserve_on(&d, "fits", GpuSelector::Count(1)).unwrap(),
        sim_uuid(0),
        "the shareable GPU still takes requests"
    );
    assert!(d.log().contains("cannot be shared"), "{}", d.log());
}

#[test]
fn a_running_mps_daemon_sets_every_gpu_aside() {
    let pipes = tempfile::tempdir().unwrap();
    nix::unistd::mkfifo(
        &pipes.path().join("control"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let (d, _sim, _lib) = nvml_daemon_with(
        false,
        &[
            ("SIMGPU_GPUS", "2"),
            ("CUDA_MPS_PIPE_DIRECTORY", pipes.path().to_str().unwrap()),
        ],
    );
    let status = d.client().status().unwrap();
    assert!(status.gpus.is_empty(), "{:?}", status.gpus);
    assert_eq!(status.unshareable.len(), 2);
    let message = refusal(reserve_on(&d, "x", GpuSelector::Count(1)));
    assert!(
        message.contains("MPS control daemon is running")
            && message.contains("control pipe")
            && message.contains("echo quit | nvidia-cuda-mps-control"),
        "{message}"
    );
}

/// A driver without `nvmlDeviceGetMemoryInfo_v2` (before R510) cannot say what it
/// reserves: the arbiter reads the original call and takes `driver_reserved_fraction` of
/// the total as reserved.
#[test]
fn without_nvml_v2_a_configured_share_of_the_total_is_taken_as_reserved() {
    let (d, _sim, _lib) = nvml_daemon_with(
        false,
        &[
            ("SIMGPU_RESERVED_MEMORY", "512Mi"),
            ("SIMGPU_NVML_WITHOUT_MEMORY_V2", "1"),
        ],
    );
    let status = d.client().status().unwrap();
    assert_eq!(status.inventory_source, "nvml", "{}", d.log());
    let gpu = &status.gpus[0];
    assert_eq!(gpu.memory_total, 16 * GI, "the original call's total");
    assert_eq!(
        gpu.memory_allocatable,
        16 * GI - (16 * GI).div_ceil(100),
        "1 % (arbiter.driver_reserved_fraction) taken as reserved\n{}",
        d.log()
    );
    assert!(
        d.log().contains("arbiter.driver_reserved_fraction"),
        "the log says which figure stands in: {}",
        d.log()
    );
}

#[test]
fn inventory_utilisation_and_driver_version_come_from_nvml() {
    // What NVML v2 reports the driver keeps for itself: never handed out as quota.
    const RESERVED: u64 = 1 << 29;
    let (d, _sim, _lib) = nvml_daemon_with(
        false,
        &[("SIMGPU_GPUS", "2"), ("SIMGPU_RESERVED_MEMORY", "512Mi")],
    );
    let mut c = d.client();
    let status = c.status().unwrap();
    assert_eq!(status.inventory_source, "nvml", "{}", d.log());
    assert_eq!(status.gpus.len(), 2);
    assert_eq!(status.gpus[1].uuid, sim_uuid(1));
    assert_eq!(status.gpus[0].memory_total, 16 * GI);
    assert_eq!(status.gpus[0].memory_allocatable, 16 * GI - RESERVED);
    assert_eq!(status.driver_cuda_version, Some(12080));
    wait_until("a utilisation sample", Duration::from_secs(20), || {
        c.status()
            .unwrap()
            .gpus
            .iter()
            .all(|g| g.utilization_last_minute.is_some() && g.memory_used.is_some())
    });
    let lease = c
        .reserve(request("n", "25%", gpushare_proto::Priority::Low))
        .unwrap();
    assert_eq!(
        lease.memory_bytes,
        (16 * GI - RESERVED) / 4,
        "a fraction resolves against the memory CUDA can allocate (NVML's total less its reserve)"
    );
}

#[test]
fn the_watchdog_reports_an_unregistered_process() {
    let (d, sim, lib) = nvml_daemon(false);
    let workload = workload();
    let mut rogue = rogue_workload(&sim, lib, &workload);
    let mut c = d.client();
    wait_until(
        "the watchdog to report the rogue process",
        Duration::from_secs(30),
        || {
            c.status().unwrap().violations.iter().any(|v| {
                v.kind == ViolationKind::Unregistered
                    && v.pid == rogue.id()
                    && v.gpu == sim_uuid(0)
                    && !v.killed
            })
        },
    );
    let text = String::from_utf8_lossy(&d.ctl(&["status"]).stdout).into_owned();
    assert!(
        text.contains(&format!(
            "violation on GPU 0: pid {} uses the GPU without a lease",
            rogue.id()
        )),
        "{text}"
    );
    assert!(
        rogue.try_wait().unwrap().is_none(),
        "reported, not killed, by default"
    );
    let _ = rogue.kill();
    let _ = rogue.wait();
}

#[test]
fn the_watchdog_kills_an_unregistered_process_when_configured() {
    let (d, sim, lib) = nvml_daemon(true);
    let workload = workload();
    let mut rogue = rogue_workload(&sim, lib, &workload);
    let mut exited = None;
    wait_until(
        "the watchdog to kill the rogue process",
        Duration::from_secs(30),
        || {
            exited = rogue.try_wait().unwrap();
            exited.is_some()
        },
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(exited.unwrap().signal(), Some(9), "killed by SIGKILL");
    assert!(d.log().contains("watchdog killed the process"));
}

/// Ungated work: per-process utilisation through nvml-wrapper, as the watchdog
/// reads it to notice GPU work done outside the gate (run in a helper process, so
/// this test's NVML sees its own simulated GPU).
#[test]
#[ignore = "helper process of per_process_utilisation_comes_from_nvml"]
fn nvml_utilisation_helper() {
    let lib = std::env::var("NVML_HELPER_LIB").expect("run by its test");
    let since: u64 = std::env::var("NVML_HELPER_SINCE").unwrap().parse().unwrap();
    let backend = gpushare_arbiter::inventory::NvmlBackend::load(&lib, 0.01).unwrap();
    let queries = [
        ("busy", sim_uuid(0), since),
        ("idle", sim_uuid(1), 0),
        ("later", sim_uuid(0), since + 3_600_000_000),
    ];
    for (name, gpu, since) in queries {
        use gpushare_arbiter::inventory::GpuBackend;
        for s in backend.process_utilization(&gpu, since).unwrap().unwrap() {
            println!(
                "{name} {} {} {} {}",
                s.pid, s.timestamp_us, s.sm_percent, s.memory_percent
            );
        }
    }
}

#[test]
fn per_process_utilisation_comes_from_nvml() {
    let workload = workload();
    let tmp = tempfile::Builder::new()
        .prefix("gss-")
        .tempdir_in("/tmp")
        .unwrap();
    let lib_dir = simgpu::libs();
    let sim_dir = tmp.path().join("state");
    let wall_us = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    };
    let since = wall_us();
    // Bursts of four 1 ms kernels 1 ms apart: the GPU is busy about 80 % of the time.
    let mut busy = Command::new(&workload)
        .args(["--device", "0", "--memory", "1073741824", "--kernels", "4"])
        .args(["--kernel", "fixed:1ms", "--gap", "1ms", "--duration", "60s"])
        .env("SIMGPU_DIR", &sim_dir)
        .env("SIMGPU_GPUS", "2")
        .env("LD_LIBRARY_PATH", lib_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "nvml_utilisation_helper",
            "--nocapture",
        ])
        .env("SIMGPU_DIR", &sim_dir)
        .env("NVML_HELPER_LIB", lib_dir.join("libnvidia-ml.so.1"))
        .env("NVML_HELPER_SINCE", since.to_string())
        .output()
        .unwrap();
    let after = wall_us();
    let _ = busy.kill();
    let _ = busy.wait();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let samples: Vec<(&str, u32, u64, u32, u32)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = *f.first()?;
            if !["busy", "idle", "later"].contains(&name) || f.len() != 5 {
                return None;
            }
            Some((
                name,
                f[1].parse().ok()?,
                f[2].parse().ok()?,
                f[3].parse().ok()?,
                f[4].parse().ok()?,
            ))
        })
        .collect();
    assert_eq!(samples.len(), 1, "one busy process on GPU 0 only: {text}");
    let (name, pid, timestamp_us, sm, memory) = samples[0];
    assert_eq!((name, pid), ("busy", busy.id()), "{text}");
    assert!(
        timestamp_us > since && timestamp_us <= after,
        "a wall-clock µs stamp between the start and now: {text}"
    );
    // Averaged over the periods since `since`, its start-up included. How busy it kept
    // the GPU depends on how much CPU it got between kernels (about 80 % alone, 37 % seen
    // beside busy loops), so this asserts only that the work shows, as a percentage.
    assert!((1..=100).contains(&sm), "{text}");
    assert!(memory < 10, "it runs kernels, not copies: {text}");
}

/// Memory held by a process of the lease's container
/// that has not attached — every process for an instant after an arbiter restart,
/// or one that bypasses the interposer — counts against the lease, so a sibling is
/// not granted what that process already holds.
#[test]
fn memory_held_by_an_unattached_process_of_the_container_counts_against_its_lease() {
    let (d, sim, lib) = nvml_daemon(false);
    let workload = workload();
    let mut c = d.client();
    let mut r = request("held", "2Gi", Priority::Low);
    r.gpu = GpuSelector::Index(vec![0]);
    let lease = c.reserve(r).unwrap();
    // This test process is the container's init: its children are the container.
    confirm_here(&mut c, "held");
    let mut unattached = rogue_workload(&sim, lib, &workload);
    let used = |c: &mut gpushare_proto::ControlClient| {
        c.status()
            .unwrap()
            .usage
            .iter()
            .find(|u| u.lease == lease.id)
            .map_or(0, |u| u.memory_used)
    };
    wait_until(
        "the unattached process's 1 GiB to be counted",
        Duration::from_secs(10),
        || used(&mut c) >= GI,
    );
    let mut sibling =
        gpushare_proto::LeaseClient::connect(&d.lease_socket(&lease.id.0), Duration::from_secs(10))
            .unwrap();
    sibling.attach(0).unwrap();
    // 1.5 GiB fits an empty 2 GiB lease, not one whose container holds 1 GiB already.
    let refused = sibling.charge(3 * GI / 2).unwrap();
    assert!(!refused.granted, "{refused:?}");
    unattached.kill().unwrap();
    unattached.wait().unwrap();
    wait_until(
        "the room to come back once the process is gone",
        Duration::from_secs(10),
        || sibling.charge(3 * GI / 2).unwrap().granted,
    );
}
