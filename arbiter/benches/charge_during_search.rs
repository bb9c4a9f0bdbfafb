//! Memory-charge latency while the batch placement search runs, against no search.
//!
//! An in-process arbiter (the state behind its handle, as the daemon holds it) on
//! 17 declared GPUs of 80 GiB: one GPU carries the charging lease, whose client
//! charges and credits 4 KiB every 100 µs (open loop: a charge's latency counts
//! from when it was due), as a program allocating does; on the other
//! 16, each cycle fills every GPU, queues 64 single-GPU requests of 1-40 GiB (a
//! quarter high-priority) behind the fillers, releases the fillers one by one (each
//! release an admission pass over the whole queue), withdraws what is left waiting
//! and releases what was placed. Three modes run the same cycles, alternating:
//!
//! - `no_search`: `placement.batch = false` (one request at a time): the baseline;
//! - `under_lock`: the batch search inside the admission pass, under the state's
//!   lock, as it ran before the search moved off it;
//! - `off_lock`: the batch search on the blocking pool, its outcome applied under
//!   the lock after a check (the shipped behaviour).
//!
//! Reports each mode's latency of the charges due from the fillers' release until
//! 30 ms after the last (each release an admission pass over the queue, and the
//! placements that follow; median, p99, max over every round), the searches run, and the p99 ratios against `no_search`. Asserts
//! nothing.
//! `GPUSHARE_BENCH_RESULTS=dir` writes `dir/charge_during_search.json`;
//! `GPUSHARE_BENCH_CYCLES` sets the cycles per round (default 40).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_arbiter::inventory::Gpu;
use gpushare_arbiter::process::ProcFs;
use gpushare_arbiter::state::{Arbiter, ArbiterHandle, Inventory, LeaseDirs};
use gpushare_arbiter::store::{LeaseStore, StoreOptions};
use gpushare_config::{ArbiterConfig, PlacementConfig};
use gpushare_proto::{
    ContainerRef, Fraction, GpuSelector, LeaseId, MemoryRequest, Priority, ReserveRequest,
};
use gpushare_testkit::results::write_results;
use gpushare_testkit::stats::percentile;
use tokio::sync::oneshot;

const GIB: u64 = 1 << 30;
const GPUS: u32 = 16;
const WAITERS: usize = 64;
const ROUNDS: usize = 3;
/// A program allocating in a loop charges about this often.
const CHARGE_EVERY: Duration = Duration::from_micros(100);

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    NoSearch,
    UnderLock,
    OffLock,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::NoSearch => "no_search",
            Mode::UnderLock => "under_lock",
            Mode::OffLock => "off_lock",
        }
    }
}

fn request(name: String, gib: u64, priority: Priority, gpu: GpuSelector) -> ReserveRequest {
    ReserveRequest {
        container_id: name,
        namespace: None,
        sandbox_id: None,
        priority,
        memory: Some(MemoryRequest::Bytes(gib * GIB)),
        compute_request: Fraction::ZERO,
        compute_limit: Fraction::ONE,
        gpu,
        tenant: None,
        pod: None,
    }
}

/// A fixed sequence of request sizes and priorities (same in every mode).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn open(dir: &std::path::Path) -> Arbiter {
    let config = ArbiterConfig {
        run_dir: dir.join("run"),
        state_dir: dir.join("state"),
        admission_wait_ms: 60_000,
        ..Default::default()
    };
    let (store, table) = LeaseStore::open(&config.state_dir, StoreOptions::default()).unwrap();
    let inventory = Inventory {
        gpus: (0..=GPUS)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i}"),
                name: "declared".into(),
                memory_total: 80 * GIB,
                memory_allocatable: 80 * GIB,
            })
            .collect(),
        source: "declared",
        cuda_driver_version: None,
    };
    let endpoints = Box::new(LeaseDirs {
        run_dir: config.run_dir.clone(),
    });
    Arbiter::open(
        config,
        inventory,
        Arc::new(store),
        table,
        endpoints,
        Box::new(ProcFs),
    )
    .unwrap()
}

async fn reserve(handle: &ArbiterHandle, r: ReserveRequest) -> LeaseId {
    handle
        .reserve(r, std::future::pending::<bool>())
        .await
        .unwrap()
        .unwrap()
        .id
}

/// One mode's round: the charge latencies, and the searches run.
async fn round(mode: Mode, cycles: usize) -> (Vec<f64>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let handle = ArbiterHandle::new(open(dir.path()));
    handle.reconfigure(
        handle.config(),
        Some(PlacementConfig {
            batch: mode != Mode::NoSearch,
            ..Default::default()
        }),
    );
    handle.set_batch_search_off_the_lock(mode == Mode::OffLock);

    // The charging client: its own lease on the last GPU, confirmed to this process.
    let charger = reserve(
        &handle,
        request(
            "charger".into(),
            80,
            Priority::High,
            GpuSelector::Index(vec![GPUS]),
        ),
    )
    .await;
    let pid = std::process::id();
    handle
        .confirm(&ContainerRef::id("charger".into()), pid)
        .await
        .unwrap();
    handle.attach(&charger, 1, pid, 0).await.unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let charging = {
        let (handle, done, charger) = (handle.clone(), done.clone(), charger.clone());
        tokio::spawn(async move {
            // Open loop: a charge is due every CHARGE_EVERY, and its latency counts
            // from when it was due, so a charge held up by the lock also counts the
            // charges that could not start behind it (a closed loop would record
            // one slow charge per stall and thousands of fast ones).
            let mut latencies = Vec::new();
            let mut due = Instant::now();
            while !done.load(Ordering::Relaxed) {
                while Instant::now() < due {
                    tokio::task::yield_now().await;
                }
                let charge = handle.charge(&charger, 1, 4096).await.unwrap();
                latencies.push((due, due.elapsed().as_secs_f64() * 1e6));
                assert!(charge.granted, "{charge:?}");
                handle.credit(&charger, 1, 4096).unwrap();
                due += CHARGE_EVERY;
            }
            latencies
        })
    };

    let mut sizes = Lcg(7);
    // From the fillers' release until the placements that follow are made: every
    // release an admission pass over the 64 waiters, so a search each (or one
    // coalesced, off the lock).
    let mut windows = Vec::new();
    for cycle in 0..cycles {
        let mut fillers = Vec::new();
        for g in 0..GPUS {
            let r = request(
                format!("filler-{cycle}-{g}"),
                80,
                Priority::Low,
                GpuSelector::Index(vec![g]),
            );
            fillers.push(reserve(&handle, r).await);
        }
        let mut waiters = Vec::new();
        for i in 0..WAITERS {
            let gib = 1 + sizes.next() % 40;
            let priority = if sizes.next().is_multiple_of(4) {
                Priority::High
            } else {
                Priority::Low
            };
            let r = request(
                format!("w-{cycle}-{i}"),
                gib,
                priority,
                GpuSelector::Count(1),
            );
            let (withdraw, gone) = oneshot::channel::<()>();
            let handle = handle.clone();
            waiters.push((
                withdraw,
                tokio::spawn(async move {
                    handle
                        .reserve(r, async move { gone.await.is_ok() })
                        .await
                        .unwrap()
                }),
            ));
        }
        while handle.status().queue.len() < WAITERS {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let releasing = Instant::now();
        for filler in &fillers {
            handle.release(filler).await.unwrap();
        }
        // Let the last passes' searches finish and their plans be applied: the window
        // covers the placements too, which each mode makes (one at a time or planned).
        tokio::time::sleep(Duration::from_millis(30)).await;
        windows.push(releasing..Instant::now());
        for (withdraw, task) in waiters {
            let _ = withdraw.send(());
            if let Some(lease) = task.await.unwrap() {
                handle.release(&lease.id).await.unwrap();
            }
        }
    }
    done.store(true, Ordering::Relaxed);
    let latencies = charging
        .await
        .unwrap()
        .into_iter()
        .filter(|(at, _)| windows.iter().any(|w| w.contains(at)))
        .map(|(_, latency)| latency)
        .collect();
    let searches = handle.status().placement_times.batch_searches.count;
    (latencies, searches)
}

fn main() {
    // `cargo test --benches` passes --bench-less flags; run only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let cycles: usize = std::env::var("GPUSHARE_BENCH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let modes = [Mode::NoSearch, Mode::UnderLock, Mode::OffLock];
    let mut all: Vec<(Vec<f64>, u64)> = vec![(Vec::new(), 0); modes.len()];
    for _ in 0..ROUNDS {
        for (i, mode) in modes.iter().enumerate() {
            let (latencies, searches) = runtime.block_on(round(*mode, cycles));
            all[i].0.extend(latencies);
            all[i].1 += searches;
        }
    }
    let mut figures = serde_json::Map::new();
    for (latencies, _) in &mut all {
        latencies.sort_by(f64::total_cmp);
    }
    let p99 = |l: &[f64]| percentile(l, 99.0);
    let baseline = p99(&all[0].0);
    println!("charge latency during admission cycles (µs; {ROUNDS} rounds of {cycles} cycles, modes alternating)");
    for (mode, (latencies, searches)) in modes.iter().zip(&all) {
        let figure = serde_json::json!({
            "charges": latencies.len(),
            "searches": searches,
            "median_us": percentile(latencies, 50.0),
            "p99_us": p99(latencies),
            "max_us": latencies.iter().cloned().fold(0.0, f64::max),
            "p99_vs_no_search": p99(latencies) / baseline,
        });
        println!(
            "  {:<10} charges {:>7}  searches {:>5}  median {:>7.1}  p99 {:>8.1}  max {:>9.1}  p99/no_search {:.2}",
            mode.name(),
            latencies.len(),
            searches,
            percentile(latencies, 50.0),
            p99(latencies),
            figure["max_us"].as_f64().unwrap(),
            p99(latencies) / baseline
        );
        figures.insert(mode.name().into(), figure);
    }
    write_results("charge_during_search", figures.into());
}
