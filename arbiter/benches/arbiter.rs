//! `cargo bench -p gpushare-arbiter`: prints medians; asserts nothing about speed.
//!
//! - placement: one decision over 16 GPUs carrying 64 leases (views rebuilt from
//!   the lease table each time, as the daemon does), Algorithm 1 and the balanced
//!   policy (with each GPU's expected demand summed from its leases, as the state does);
//! - commit: one durable lease change, append-only log vs rewriting the table;
//! - reserve+release round trips per second over the control socket of the real
//!   daemon (spawned binary, declared devices), 1 and 32 concurrent clients;
//! - recovery of 1,000 leases: load, re-create 1,000 lease sockets, reconcile.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_arbiter::balance::Weights;
use gpushare_arbiter::inventory::DeclaredBackend;
use gpushare_arbiter::placement::balanced::{expected_demand, Balanced};
use gpushare_arbiter::placement::{self, GpuView, Policy};
use gpushare_arbiter::store::{LeaseRecord, LeaseStore, Record, StoreOptions};
use gpushare_config::{ArbiterConfig, DeclaredDevice};
use gpushare_proto::{
    ByteSize, ControlClient, Fraction, GpuSelector, Lease, LeaseId, LeaseState, MemoryRequest,
    Priority, ReserveRequest,
};
use gpushare_testkit::results::write_results;
use gpushare_testkit::stats::median;
use gpushare_testkit::{layout, Arbiter};

const GI: u64 = 1 << 30;
const BALANCED: Balanced = Balanced {
    weights: Weights {
        memory: 1.0,
        compute: 1.0,
        jobs: 1.0,
    },
};

fn lease(i: usize, gpus: usize) -> Lease {
    Lease {
        id: LeaseId(format!("{i:016x}")),
        container_id: format!("bench-{i}"),
        namespace: None,
        sandbox_id: None,
        gpus: vec![format!("GPU-{}", i % gpus)],
        priority: if i.is_multiple_of(16) {
            Priority::High
        } else {
            Priority::Low
        },
        memory_bytes: GI,
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        tenant: None,
        state: LeaseState::Confirmed,
        pid: Some(1),
        created_unix_ms: 0,
        pod: None,
    }
}

/// Median µs per decision of `policy` (Algorithm 1 or the balanced policy).
fn bench_placement_with(balanced: bool) -> f64 {
    const GPUS: usize = 16;
    let uuids: Vec<String> = (0..GPUS).map(|i| format!("GPU-{i}")).collect();
    let leases: Vec<Lease> = (0..64).map(|i| lease(i, GPUS)).collect();
    let policy = Policy {
        gpu_util_limit: 0.8,
        low_nums_limit: 8,
    };
    let selector = GpuSelector::Count(1);
    let decide = || {
        let mut views: Vec<GpuView> = uuids
            .iter()
            .enumerate()
            .map(|(i, u)| GpuView {
                index: i as u32,
                uuid: u,
                memory_allocatable: 80 * GI,
                memory_leased: 0,
                lending: None,
                high_leases: 0,
                low_leases: 0,
                ungated_leases: 0,
                utilization: 0.5,
                drained: false,
                reserved_for: None,
            })
            .collect();
        for l in &leases {
            for g in &l.gpus {
                if let Some(v) = views.iter_mut().find(|v| v.uuid == g) {
                    v.memory_leased += l.memory_bytes;
                    match l.priority {
                        Priority::High => v.high_leases += 1,
                        Priority::Low => v.low_leases += 1,
                    }
                }
            }
        }
        let r = placement::Request {
            priority: Priority::Low,
            memory: MemoryRequest::Bytes(2 * GI),
            gpu: &selector,
            tenant: None,
        };
        if balanced {
            // As the state does: each GPU's expected demand summed from its leases.
            let mut expected = vec![0.0; GPUS];
            for l in &leases {
                let demand = expected_demand(l.priority, l.compute_request.get(), None);
                for g in &l.gpus {
                    if let Some(i) = uuids.iter().position(|u| u == g) {
                        expected[i] += demand;
                    }
                }
            }
            placement::place_balanced(&r, &views, &expected, 0.5, &BALANCED).map(|p| p.gpus[0])
        } else {
            placement::place(&r, &views, &policy).map(|p| p.gpus[0])
        }
    };
    assert!(decide().is_ok());
    let mut samples = Vec::new();
    for _ in 0..200 {
        let start = Instant::now();
        for _ in 0..100 {
            std::hint::black_box(decide()).ok();
        }
        samples.push(start.elapsed().as_secs_f64() / 100.0 * 1e6);
    }
    median(samples)
}

fn bench_placement() -> serde_json::Value {
    let wang = bench_placement_with(false);
    println!("placement (wang), 16 GPUs x 64 leases: median {wang:.2} us per decision (target <= 100 us)");
    let balanced = bench_placement_with(true);
    println!("placement (balanced), 16 GPUs x 64 leases: median {balanced:.2} us per decision (target <= 100 us)");
    serde_json::json!({"gpus": 16, "leases": 64, "median_us": wang, "balanced_median_us": balanced})
}

fn bench_commit() -> serde_json::Value {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (store, _) = LeaseStore::open(dir.path(), StoreOptions::default()).unwrap();
    let records: Vec<LeaseRecord> = (0..64)
        .map(|i| LeaseRecord {
            lease: lease(i, 16),
            cgroup: None,
            pid_start_time: None,
        })
        .collect();
    let mut log_samples = Vec::new();
    for r in records.iter().cycle().take(100) {
        let start = Instant::now();
        let t = store
            .append(Record::Put {
                lease: Box::new(r.clone()),
            })
            .unwrap();
        store.wait_blocking(t).unwrap();
        log_samples.push(start.elapsed().as_secs_f64() * 1e3);
    }
    // The first arbiter's way: rewrite the whole table, fsync it, rename, fsync the directory.
    let mut rewrite_samples = Vec::new();
    let leases: Vec<&Lease> = records.iter().map(|r| &r.lease).collect();
    for _ in 0..100 {
        let start = Instant::now();
        let tmp = dir.path().join("rewrite.tmp");
        let body = serde_json::to_vec_pretty(&leases).unwrap();
        let mut f = std::fs::File::create(&tmp).unwrap();
        std::io::Write::write_all(&mut f, &body).unwrap();
        f.sync_all().unwrap();
        std::fs::rename(&tmp, dir.path().join("rewrite.json")).unwrap();
        std::fs::File::open(dir.path()).unwrap().sync_all().unwrap();
        rewrite_samples.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let (log, rewrite) = (median(log_samples), median(rewrite_samples));
    println!(
        "one durable change with 64 leases: append-only log median {log:.2} ms, whole-table rewrite median {rewrite:.2} ms"
    );
    serde_json::json!({"leases": 64, "log_median_ms": log, "rewrite_median_ms": rewrite})
}

/// The daemon and the tmpfs directory its run directory is in (removed after it stops).
struct Daemon {
    arbiter: Arbiter,
    _run: tempfile::TempDir,
}

/// The run directory on tmpfs, as `/run/gpushare` is in production (lease
/// directories and sockets live there); the lease log on the disk, fsynced.
fn run_dir_on_tmpfs() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("gsb-run-")
        .tempdir_in("/dev/shm")
        .expect("a tmpfs at /dev/shm")
}

fn start_daemon() -> Daemon {
    let run = run_dir_on_tmpfs();
    let arbiter = Arbiter::builder()
        .program(env!("CARGO_BIN_EXE_gpushare-arbiter"))
        .declared_gpus(4, "1Ti")
        .configure(|c| {
            c.arbiter.run_dir = run.path().to_owned();
            c.arbiter.low_nums_limit = 1_000_000;
        })
        .env("GPUSHARE_LOG", "warn")
        .start();
    Daemon { arbiter, _run: run }
}

fn round_trips(daemon: &Daemon, clients: usize, for_: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|t| {
            let (socket, stop, done) =
                (daemon.arbiter.control_socket(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = ControlClient::connect(&socket, Duration::from_secs(30)).unwrap();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let lease = c
                        .reserve(ReserveRequest {
                            container_id: format!("rt-{t}-{i}"),
                            namespace: None,
                            sandbox_id: None,
                            priority: Priority::Low,
                            memory: Some(MemoryRequest::Bytes(1 << 20)),
                            compute_request: Fraction::ZERO,
                            compute_limit: Fraction::ONE,
                            gpu: GpuSelector::Count(1),
                            tenant: None,
                            pod: None,
                        })
                        .unwrap();
                    c.release(lease.id).unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    std::thread::sleep(for_);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn bench_round_trips() -> serde_json::Value {
    let daemon = start_daemon();
    let mut figures = serde_json::Map::new();
    for clients in [1, 32] {
        let rates: Vec<f64> = (0..3)
            .map(|_| round_trips(&daemon, clients, Duration::from_secs(3)))
            .collect();
        println!(
            "reserve+release round trips over the control socket, {clients} client(s): median {:.0}/s (target >= 5,000/s)",
            median(rates.clone())
        );
        figures.insert(format!("clients_{clients}_per_s"), median(rates).into());
    }
    figures.into()
}

fn bench_recovery() -> serde_json::Value {
    let dir = tempfile::Builder::new()
        .prefix("gsr-")
        .tempdir_in("/tmp")
        .unwrap();
    let run = run_dir_on_tmpfs();
    let config = ArbiterConfig {
        run_dir: run.path().to_owned(),
        state_dir: dir.path().join("state"),
        nvml_library: String::new(),
        devices: (0..4)
            .map(|i| DeclaredDevice {
                uuid: format!("GPU-{i}"),
                name: "bench".into(),
                memory: ByteSize(1 << 40),
            })
            .collect(),
        ..Default::default()
    };
    {
        let (store, _) = LeaseStore::open(&config.state_dir, StoreOptions::default()).unwrap();
        let me = std::process::id();
        let mut last = None;
        for i in 0..1000 {
            let mut l = lease(i, 4);
            l.pid = Some(me);
            last = Some(
                store
                    .append(Record::Put {
                        lease: Box::new(LeaseRecord {
                            lease: l,
                            cgroup: None,
                            pid_start_time: None,
                        }),
                    })
                    .unwrap(),
            );
        }
        store.wait_blocking(last.unwrap()).unwrap();
    }
    gpushare_arbiter::daemon::raise_open_files_limit();
    let backend = DeclaredBackend::new(&config);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut samples = Vec::new();
    for _ in 0..5 {
        let elapsed = runtime.block_on(async {
            let start = Instant::now();
            let shared = gpushare_arbiter::daemon::recover(
                &config,
                &Default::default(),
                &Default::default(),
                &Default::default(),
                &backend,
            )
            .unwrap();
            let elapsed = start.elapsed();
            assert_eq!(shared.handle().lease_count(), 1000);
            assert!(layout::lease_socket(run.path(), &format!("{:016x}", 999)).exists());
            drop(shared);
            elapsed
        });
        samples.push(elapsed.as_secs_f64() * 1e3);
    }
    let m = median(samples);
    println!(
        "recovery of 1,000 leases (load, 1,000 lease sockets, reconcile): median {m:.1} ms (target <= 1 s)"
    );
    serde_json::json!({"leases": 1000, "median_ms": m})
}

fn main() {
    // `cargo test --benches` passes --bench-less flags; run everything only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // GPUSHARE_BENCH=round_trips (etc.) runs one part only, e.g. under a profiler.
    let only = std::env::var("GPUSHARE_BENCH").ok();
    let run = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let mut figures = serde_json::Map::new();
    if run("placement") {
        figures.insert("placement".into(), bench_placement());
    }
    if run("commit") {
        figures.insert("commit".into(), bench_commit());
    }
    if run("recovery") {
        figures.insert("recovery".into(), bench_recovery());
    }
    if run("round_trips") {
        figures.insert("round_trips".into(), bench_round_trips());
    }
    write_results("arbiter", figures.into());
}
