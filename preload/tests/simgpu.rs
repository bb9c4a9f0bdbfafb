//! The interposer against the simulated GPU, with a real gpushare-arbiter: the probe
//! resolves the driver like the CUDA runtime (`dlopen` + `cuGetProcAddress_v2`) and
//! runs with `LD_PRELOAD=libgpushare.so` and a lease, as a container's process does.

mod common;

use common::*;

/// Each allocation path: (steps that take 40 MiB, the bytes they take).
/// 40 MiB fits a 64 MiB quota once, not twice.
const PATHS: &[(&[&str], u64)] = &[
    (&["alloc", "40Mi"], 40 * MI),
    (&["managed", "40Mi"], 40 * MI),
    // 40000-byte rows are padded to a 40448-byte pitch: the real pitch is charged.
    (&["pitch", "40000", "1000"], 40448 * 1000),
    (&["array", "4096", "2560"], 40 * MI),
    (&["array3d", "1024", "1024", "10"], 40 * MI),
    // 32 MiB + 8 MiB for the second level.
    (&["mipmap", "4096", "2048", "2"], 40 * MI),
    (&["async", "40Mi"], 40 * MI),
    (&["pool-async", "40Mi"], 40 * MI),
    (&["vmm", "40Mi"], 40 * MI),
];

fn every_path_is_charged(flags: &[&str]) {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    for (path, bytes) in PATHS {
        let step = path[0];
        let mut args: Vec<&str> = flags.to_vec();
        args.extend_from_slice(&["meminfo"]);
        args.extend_from_slice(path);
        args.push("meminfo");
        args.extend_from_slice(path);
        args.extend_from_slice(&["free-all", "sync", "trim", "meminfo"]);
        let s = run(&mut m.probe(Some(&lease), &args));
        assert_eq!(
            s.number("meminfo", 0, "total"),
            64 * MI,
            "{step}: the quota is the GPU's size"
        );
        assert_eq!(s.number("meminfo", 0, "free"), 64 * MI, "{step}");
        assert_eq!(s.result(step, 0), "CUDA_SUCCESS", "{step}: {}", s.stderr);
        assert_eq!(
            s.number("meminfo", 1, "free"),
            64 * MI - bytes,
            "{step}: charged exactly"
        );
        assert_eq!(
            s.result(step, 1),
            "CUDA_ERROR_OUT_OF_MEMORY",
            "{step}: over the quota"
        );
        assert_eq!(s.result("free-all", 0), "CUDA_SUCCESS", "{step}");
        assert_eq!(
            s.number("meminfo", 2, "free"),
            64 * MI,
            "{step}: all credited"
        );
        assert_eq!(
            m.ledger_used(&lease),
            0,
            "{step}: the process's exit left nothing charged"
        );
    }
}

#[test]
fn every_allocation_path_is_charged_and_refused_over_quota() {
    every_path_is_charged(&[]);
}

#[test]
fn every_allocation_path_with_the_per_thread_default_stream() {
    // --ptds: the _ptsz variants of the stream-ordered calls.
    every_path_is_charged(&["--ptds"]);
}

#[test]
fn destroying_a_pool_credits_its_cache_and_keeps_its_live_blocks_charged() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "pool-async",
            "40Mi",
            "pool-destroy",
            "meminfo",
            "free-all",
            "meminfo",
        ],
    ));
    assert_eq!(s.result("pool-destroy", 0), "CUDA_SUCCESS");
    assert_eq!(
        s.number("meminfo", 0, "free"),
        24 * MI,
        "the live block still holds the device"
    );
    assert_eq!(
        s.number("meminfo", 1, "free"),
        64 * MI,
        "freed after its pool was destroyed"
    );
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "pool-async",
            "40Mi",
            "free-all",
            "meminfo",
            "pool-destroy",
            "meminfo",
        ],
    ));
    assert_eq!(
        s.number("meminfo", 0, "free"),
        24 * MI,
        "freed blocks stay reserved in the pool"
    );
    assert_eq!(
        s.number("meminfo", 1, "free"),
        64 * MI,
        "destroying the pool gives its cache back"
    );
}

#[test]
fn a_refused_allocation_allocates_nothing_and_the_process_can_retry() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let ready = m.dir().join("ready");
    let go = m.dir().join("go");
    let holder = m
        .probe(
            Some(&lease),
            &[
                "alloc",
                "40Mi",
                "alloc",
                "40Mi",
                "async",
                "40Mi",
                "touch",
                ready.to_str().unwrap(),
                "wait",
                go.to_str().unwrap(),
                "free-all",
                "alloc",
                "60Mi",
                "meminfo",
            ],
        )
        // The truth below counts allocations only: no simulated context overhead
        // (the holder creates the simulated machine, so this holds for the probe too).
        .env("SIMGPU_CONTEXT_MEMORY", "0")
        .spawn()
        .unwrap();
    wait_until("the holder", std::time::Duration::from_secs(30), || {
        ready.exists()
    });
    let truth = run(&mut m.bare_probe(&["nvml-meminfo"]));
    assert_eq!(
        truth.number("nvml-meminfo", 0, "used"),
        40 * MI,
        "the simulated GPU holds only the granted 40 MiB"
    );
    assert_eq!(m.ledger_used(&lease), 40 * MI);
    std::fs::write(&go, "").unwrap();
    let s = finish(holder);
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS");
    assert_eq!(s.result("alloc", 1), "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(s.result("async", 0), "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(s.result("alloc", 2), "CUDA_SUCCESS", "freed, then retried");
    assert_eq!(s.number("meminfo", 0, "free"), 4 * MI);
}

#[test]
fn the_quota_holds_across_two_processes_of_one_container() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let p = |name: &str| m.dir().join(name).to_str().unwrap().to_owned();
    let (a_holds, b_tried, a_freed) = (p("a-holds"), p("b-tried"), p("a-freed"));
    let a = m
        .probe(
            Some(&lease),
            &[
                "alloc", "40Mi", "touch", &a_holds, "wait", &b_tried, "free-all", "touch", &a_freed,
            ],
        )
        .spawn()
        .unwrap();
    let b = m
        .probe(
            Some(&lease),
            &[
                "wait", &a_holds, "alloc", "40Mi", "alloc", "20Mi", "meminfo", "touch", &b_tried,
                "wait", &a_freed, "alloc", "40Mi", "meminfo",
            ],
        )
        .spawn()
        .unwrap();
    let (a, b) = (finish(a), finish(b));
    assert_eq!(a.result("alloc", 0), "CUDA_SUCCESS");
    assert_eq!(
        b.result("alloc", 0),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "40 + 40 > 64 across the two"
    );
    assert_eq!(b.result("alloc", 1), "CUDA_SUCCESS", "40 + 20 fits");
    assert_eq!(
        b.number("meminfo", 0, "free"),
        4 * MI,
        "the other process's use counts"
    );
    assert_eq!(
        b.result("alloc", 2),
        "CUDA_SUCCESS",
        "after the other freed"
    );
    assert_eq!(b.number("meminfo", 1, "free"), 4 * MI);
}

#[test]
fn memory_answers_report_the_quota() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let s = run(&mut m.probe(
        Some(&lease),
        &["alloc", "16Mi", "meminfo", "totalmem", "nvml-meminfo"],
    ));
    assert_eq!(s.number("meminfo", 0, "total"), 64 * MI);
    assert_eq!(s.number("meminfo", 0, "free"), 48 * MI);
    assert_eq!(s.number("totalmem", 0, "total"), 64 * MI);
    assert_eq!(s.result("nvml-meminfo", 0), "0");
    for prefix in ["", "v2_"] {
        assert_eq!(
            s.number("nvml-meminfo", 0, &format!("{prefix}total")),
            64 * MI
        );
        assert_eq!(
            s.number("nvml-meminfo", 0, &format!("{prefix}free")),
            48 * MI
        );
        assert_eq!(
            s.number("nvml-meminfo", 0, &format!("{prefix}used")),
            16 * MI
        );
    }
}

#[test]
fn cu_get_proc_address_honours_version_and_flags() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "procaddr",
            "cuMemAlloc",
            "12040",
            "0",
            "procaddr",
            "cuMemAlloc",
            "3020",
            "0",
            "procaddr",
            "cuLaunchKernel",
            "12040",
            "2",
            "procaddr",
            "cuLaunchKernel",
            "12040",
            "1",
            "procaddr",
            "cuMemFreeAsync",
            "12040",
            "2",
            "procaddr",
            "cuGetProcAddress",
            "11030",
            "0",
            "procaddr",
            "cuGetProcAddress",
            "12000",
            "0",
            "procaddr",
            "cuMemAllocAsync",
            "11010",
            "0",
            "procaddr",
            "cuCtxSynchronize",
            "12040",
            "0",
            "dlsym",
            "cuMemAlloc_v2",
            "dlsym",
            "cuGetProcAddress_v2",
            "dlsym",
            "cuCtxSynchronize",
            "legacy-launch",
        ],
    ));
    let via = |n| s.value("procaddr", n, "via");
    assert_eq!(via(0), "libgpushare.so:cuMemAlloc_v2");
    assert_eq!(
        via(1),
        "libgpushare.so:cuMemAlloc_v2",
        "3.2 selects _v2 too"
    );
    assert_eq!(
        via(2),
        "libgpushare.so:cuLaunchKernel_ptsz",
        "per-thread default stream"
    );
    assert_eq!(via(3), "libgpushare.so:cuLaunchKernel", "legacy stream");
    assert_eq!(via(4), "libgpushare.so:cuMemFreeAsync_ptsz");
    assert_eq!(
        via(5),
        "libgpushare.so:cuGetProcAddress",
        "the 11.3 ABI, without symbolStatus"
    );
    assert_eq!(via(6), "libgpushare.so:cuGetProcAddress_v2");
    assert_eq!(
        s.result("procaddr", 7),
        "CUDA_ERROR_NOT_FOUND",
        "older than the entry point"
    );
    assert_eq!(
        via(8),
        "libcuda.so.1:cuCtxSynchronize",
        "not wrapped: the driver's own"
    );
    assert_eq!(s.value("dlsym", 0, "via"), "libgpushare.so:cuMemAlloc_v2");
    assert_eq!(
        s.value("dlsym", 1, "via"),
        "libgpushare.so:cuGetProcAddress_v2"
    );
    assert_eq!(s.value("dlsym", 2, "via"), "libcuda.so.1:cuCtxSynchronize");
    assert_eq!(
        s.result("legacy-launch", 0),
        "CUDA_ERROR_NOT_FOUND",
        "the simulated driver has no cuLaunch"
    );
}

#[test]
fn rtld_next_lookups_stay_relative_to_their_caller() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    // glibc finds the caller from the return address: the exported dlsym jumps to the
    // real one for RTLD_NEXT, so the probe's lookup searches after the probe, where
    // the preloaded library is. Forwarded from inside libgpushare, it would find libc.
    let s = run(&mut m.probe(
        Some(&lease),
        &["next", "dlsym", "next", "cuMemAlloc_v2", "next", "malloc"],
    ));
    assert_eq!(s.value("next", 0, "via"), "libgpushare.so:dlsym");
    assert_eq!(s.value("next", 1, "via"), "libgpushare.so:cuMemAlloc_v2");
    assert!(
        s.value("next", 2, "via").starts_with("libc.so"),
        "{}",
        s.nth("next", 2)
    );
    let bare = run(&mut m.bare_probe(&["next", "dlsym"]));
    assert!(bare.value("next", 0, "via").starts_with("libc.so"));
}

#[test]
fn programs_linked_against_libcuda_are_caught_by_the_exported_names() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    // The first call of the export resolves the driver's function itself (no
    // dlsym or cuGetProcAddress lookup of it happened before).
    let s = run(&mut m.probe(
        Some(&lease),
        &["linked-alloc", "40Mi", "linked-alloc", "40Mi", "meminfo"],
    ));
    assert_eq!(
        s.value("linked-alloc", 0, "via"),
        "libgpushare.so:cuMemAlloc_v2"
    );
    assert_eq!(s.result("linked-alloc", 0), "CUDA_SUCCESS", "{}", s.stderr);
    assert_eq!(s.result("linked-alloc", 1), "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(s.number("meminfo", 0, "free"), 24 * MI);
}

#[test]
fn the_ptsz_wrapper_reaches_the_per_thread_stream() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    // A kernel launched through the PTDS-resolved cuLaunchKernel lands on the
    // thread's own stream: the legacy stream stays idle.
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "--ptds",
            "ptsz-check",
            "launch",
            "2",
            "launch-ex",
            "coop",
            "graph",
        ],
    ));
    assert_eq!(
        s.value("ptsz-check", 0, "legacy"),
        "CUDA_SUCCESS",
        "{}",
        s.stderr
    );
    assert_eq!(
        s.value("ptsz-check", 0, "per_thread"),
        "CUDA_ERROR_NOT_READY"
    );
    for step in ["launch", "launch-ex", "coop", "graph"] {
        assert_eq!(s.result(step, 0), "CUDA_SUCCESS", "{step}");
    }
    assert!(s.stderr.contains("-> cuLaunchKernel_ptsz"), "{}", s.stderr);
    let legacy = run(&mut m.probe(
        Some(&lease),
        &["ptsz-check", "launch", "2", "launch-ex", "coop", "graph"],
    ));
    assert_eq!(
        legacy.value("ptsz-check", 0, "legacy"),
        "CUDA_ERROR_NOT_READY"
    );
    for step in ["launch", "launch-ex", "coop", "graph"] {
        assert_eq!(legacy.result(step, 0), "CUDA_SUCCESS", "{step}");
    }
}

#[test]
fn without_a_lease_the_library_is_inert() {
    let m = Machine::start();
    let s = run(&mut m.probe(
        None,
        &[
            "procaddr",
            "cuMemAlloc",
            "12040",
            "0",
            "dlsym",
            "cuMemAlloc_v2",
            "alloc",
            "1Gi",
            "meminfo",
        ],
    ));
    assert_eq!(s.value("procaddr", 0, "via"), "libcuda.so.1:cuMemAlloc_v2");
    assert_eq!(s.value("dlsym", 0, "via"), "libcuda.so.1:cuMemAlloc_v2");
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS");
    assert_eq!(
        s.number("meminfo", 0, "total"),
        16 << 30,
        "the physical GPU"
    );
    assert!(
        s.stderr.is_empty(),
        "an inert library says nothing: {}",
        s.stderr
    );
}

#[test]
fn reconnects_after_an_arbiter_restart_with_what_it_holds() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let p = |name: &str| m.dir().join(name).to_str().unwrap().to_owned();
    let (held, restarted) = (p("held"), p("restarted"));
    let child = m
        .probe(
            Some(&lease),
            &[
                "alloc", "40Mi", "touch", &held, "wait", &restarted, "alloc", "20Mi", "alloc",
                "10Mi", "meminfo",
            ],
        )
        .spawn()
        .unwrap();
    wait_until(
        "the probe to hold",
        std::time::Duration::from_secs(30),
        || std::path::Path::new(&held).exists(),
    );
    m.kill_arbiter();
    m.start_arbiter();
    std::fs::write(&restarted, "").unwrap();
    let s = finish(child);
    assert_eq!(
        s.result("alloc", 1),
        "CUDA_SUCCESS",
        "reconnected: {}",
        s.stderr
    );
    assert_eq!(
        s.result("alloc", 2),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "the 40 MiB held before the restart still count"
    );
    assert_eq!(s.number("meminfo", 0, "free"), 4 * MI);
    assert!(
        s.stderr.contains("reconnecting")
            || s.stderr.contains("unreachable")
            || s.stderr.contains("closed the ledger connection"),
        "{}",
        s.stderr
    );
}

/// Re-attachment after an arbiter restart ("seen again, with its holdings, within 1 s
/// of the restart"): re-attaching only at the next ledger operation left an idle process
/// holding memory out of the new arbiter's ledger for as long as it stayed idle. Its
/// watcher re-attaches it with what it holds as soon as the arbiter answers, with no
/// CUDA call.
#[test]
fn an_idle_process_is_seen_again_with_its_holdings_within_a_second_of_a_restart() {
    let mut m = Machine::start();
    let lease = m.lease("1Gi");
    let ready = m.dir().join("ready");
    let child = m
        .probe(
            Some(&lease),
            &[
                "alloc",
                "100Mi",
                "touch",
                ready.to_str().unwrap(),
                "sleep",
                "4000",
            ],
        )
        .spawn()
        .unwrap();
    wait_until(
        "the probe to hold",
        std::time::Duration::from_secs(30),
        || ready.exists(),
    );
    let held = |m: &Machine| {
        m.control()
            .status()
            .unwrap()
            .usage
            .into_iter()
            .find(|u| u.lease.0 == lease)
            .map_or_else(Vec::new, |u| {
                u.clients.iter().map(|c| c.memory_held).collect::<Vec<_>>()
            })
    };
    assert_eq!(held(&m), vec![100 * MI]);
    m.kill_arbiter();
    // Away for longer than the watcher's retry ceiling: it is at its slowest retry (its
    // tries fall at about 50, 150, 350, 750, 1150, 1550 ms: 1.2 s away puts the restart
    // just after one, near the worst case).
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let restarted = std::time::Instant::now();
    m.start_arbiter();
    let back = std::time::Instant::now();
    let mut seen = None;
    while back.elapsed() < std::time::Duration::from_secs(3) {
        if held(&m) == vec![100 * MI] {
            seen = Some(back.elapsed());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let Some(seen) = seen else {
        panic!("not seen again: {:?}\n{}", held(&m), m.arbiter_log());
    };
    let since_restart = back.duration_since(restarted) + seen;
    eprintln!(
        "seen again with its holdings {seen:?} after the arbiter answered, {since_restart:?} after it was started"
    );
    assert!(
        since_restart < std::time::Duration::from_secs(1),
        "seen again {since_restart:?} after the restart"
    );
    let s = finish(child);
    assert!(
        s.stderr.contains("closed the ledger connection"),
        "{}",
        s.stderr
    );
}

#[test]
fn threads_forks_and_exit_during_a_kernel() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let start = std::time::Instant::now();
    let s = run(&mut m.probe(Some(&lease), &["alloc", "8Mi", "chaos"]));
    assert_eq!(s.result("chaos", 0), "CUDA_SUCCESS");
    assert_eq!(
        s.value("chaos", 0, "children_ok"),
        "20",
        "every fork child ran and exited cleanly"
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "exited with a 30 s kernel in flight"
    );
    // The process's connection closed with it: the arbiter credited its memory.
    wait_until(
        "the ledger to empty",
        std::time::Duration::from_secs(10),
        || m.ledger_used(&lease) == 0,
    );
}

/// `cuDevicePrimaryCtxReset` freed everything made in the primary
/// context without a credit to the ledger, so the next allocation was refused for a
/// quota nothing used any more. Every kind the reset frees is credited: plain, pool
/// (the default pool and a created one, whose reserve the reset gives back) and arrays.
#[test]
fn a_primary_context_reset_credits_what_it_freed() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let s = run(&mut m.probe(
        Some(&lease),
        &[
            "alloc",
            "40Mi",
            "reset",
            "async",
            "40Mi",
            "reset",
            "array",
            "4096",
            "2560",
            "reset",
            "pool-async",
            "40Mi",
            "reset",
            "alloc",
            "40Mi",
            "reset",
            "meminfo",
        ],
    ));
    for n in 0..5 {
        assert_eq!(s.result("reset", n), "CUDA_SUCCESS", "{}", s.stderr);
        assert_eq!(s.value("reset", n, "again"), "CUDA_SUCCESS", "{}", s.stderr);
    }
    assert_eq!(s.result("alloc", 0), "CUDA_SUCCESS", "{}", s.stderr);
    for (step, n) in [("async", 0), ("array", 0), ("pool-async", 0), ("alloc", 1)] {
        assert_eq!(
            s.result(step, n),
            "CUDA_SUCCESS",
            "{step} after a reset: the 40 MiB the reset freed are still charged\n{}",
            s.stderr
        );
    }
    assert_eq!(
        s.number("meminfo", 0, "free"),
        64 * MI,
        "everything credited after the last reset"
    );
}

/// The library used to key on `GPUSHARE_LEASE`, which the container
/// controls: a process whose entrypoint reset its environment, but which still
/// loads the library (`runtime.ld_so_preload`), ran with no quota at all. The
/// lease's socket, mounted where the runtime puts it, now arms it.
#[test]
fn a_process_without_the_lease_variable_is_still_held_to_the_quota() {
    let mut m = Machine::start();
    let lease = m.lease("64Mi");
    let mut probe = m.probe(Some(&lease), &["meminfo", "alloc", "128Mi"]);
    probe.env_remove("GPUSHARE_LEASE");
    let s = run(&mut probe);
    assert_eq!(s.number("meminfo", 0, "total"), 64 * MI, "{}", s.stderr);
    assert_eq!(
        s.result("alloc", 0),
        "CUDA_ERROR_OUT_OF_MEMORY",
        "{}",
        s.stderr
    );
}
