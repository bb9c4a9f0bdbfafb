//! Failure handling of the time-slice token, end to end: a private arbiter, leases,
//! `simgpu-workload` processes under the interposer, the simulated GPU. A token holder is
//! SIGKILLed, then the arbiter itself. Each process's GPU time is read straight from the
//! simulated device (`simgpu-model`), the token's state from the arbiter's status.
//!
//! The binaries come from `GPUSHARE_BIN_DIR` / `GPUSHARE_PRELOAD_LIB` (see quick.rs). The tests
//! take turns (`SERIAL`): each starts its own arbiter and jobs, and two at once on two cores
//! would only slow each other down. They assert what happened — who held the token, who ran,
//! what was revoked or reported — never how fast: a loaded machine stretches every interval
//! here, and the figures they print belong to `make bench`.

use std::collections::HashMap;
use std::io::Read;
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpushare_bench::experiment::{collect_within, simgpu_env, spawn_job, Job};
use gpushare_bench::setup::{self, scheduler_config, Binaries};
use gpushare_proto::{ControlClient, LeaseId, Priority, TokenStatus};
use gpushare_testkit::config::{SchedulerConfig, SchedulingPolicy::Priority as PriorityPolicy};
use gpushare_testkit::stats::median_duration;
use gpushare_testkit::Arbiter;
use serde_json::Value;
use simgpu_model::{Device, SimConfig};

static SERIAL: Mutex<()> = Mutex::new(());

/// How long jobs get to load the driver and attach before their barrier opens.
const SETTLE: Duration = Duration::from_millis(400);

/// The high-priority job: bursts of 20 × 100 µs kernels, 3 ms of CPU between them, and when
/// each burst's first kernel started on the GPU.
fn high_job(duration: Duration) -> Job {
    job(
        "high",
        Priority::High,
        &[
            "--kernels",
            "20",
            "--kernel",
            "fixed:100us",
            "--gap",
            "3ms",
            "--sync",
            "event",
            "--report-start",
            "--duration",
            &format!("{}ms", duration.as_millis()),
        ],
    )
}

/// A low-priority job that keeps the GPU busy: no gap, two iterations queued.
fn saturating_low_job(name: &str, duration: Duration) -> Job {
    job(
        name,
        Priority::Low,
        &[
            "--kernels",
            "10",
            "--kernel",
            "fixed:100us",
            "--sync",
            "event",
            "--pipeline",
            "2",
            "--duration",
            &format!("{}ms", duration.as_millis()),
        ],
    )
}

fn job(name: &str, priority: Priority, args: &[&str]) -> Job {
    Job {
        name: name.into(),
        priority,
        compute_request: 0.0,
        compute_limit: 1.0,
        args: args.iter().map(|a| a.to_string()).collect(),
    }
}

/// A running workload.
struct Running {
    name: String,
    lease: LeaseId,
    pid: u32,
    stderr: String,
    child: Option<Child>,
}

impl Running {
    /// SIGKILL; returns the instant just before the signal was sent. What the job wrote to
    /// stderr (the interposer's log, with `GPUSHARE_LOG`) goes to `self.stderr`.
    fn kill(&mut self) -> Instant {
        let child = self.child.as_mut().expect("not killed yet");
        let at = Instant::now();
        child.kill().expect("SIGKILL a workload");
        child.wait().expect("reap a workload");
        if let Some(mut pipe) = child.stderr.take() {
            let _ = pipe.read_to_string(&mut self.stderr);
        }
        self.child = None;
        at
    }

    /// Its report once it finishes on its own (within `limit`). Its pipes are read while it
    /// runs, so a chatty interposer (`GPUSHARE_LOG`) cannot block it on a full pipe.
    fn report(&mut self, limit: Duration, rig: &Rig) -> Value {
        let child = self.child.take().expect("still running");
        let pid = child.id();
        collect_within(child, limit).unwrap_or_else(|why| {
            panic!(
                "{} (pid {pid}): {why}\narbiter log:\n{}",
                self.name,
                rig.arbiter_log()
            )
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One process's use of the simulated GPU so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Usage {
    gpu_time_ns: u64,
}

/// A private arbiter on its own simulated GPU, and the means to look at both.
struct Rig {
    dir: tempfile::TempDir,
    binaries: Binaries,
    env: Vec<(String, String)>,
    arbiter: Arbiter,
    control: ControlClient,
    device: Device,
    barriers: usize,
}

impl Rig {
    fn new(scheduler: SchedulerConfig) -> Rig {
        let binaries = Binaries::locate().expect("built binaries (see GPUSHARE_BIN_DIR)");
        let dir = tempfile::Builder::new()
            .prefix("gsf-")
            .tempdir_in("/tmp")
            .unwrap();
        let libs = setup::simgpu_libs().expect("install the simulated GPU");
        let machine = setup::sim_machine(dir.path(), 1, 1_000, 25);
        let mut env = simgpu_env(&machine, libs);
        if let Ok(level) = std::env::var("GPUSHARE_LOG") {
            env.push(("GPUSHARE_LOG".into(), level));
        }
        let arbiter = setup::start(
            setup::arbiter_on(dir.path(), &machine, &env)
                .configure(|c| setup::single_gpu_config(c, scheduler)),
        )
        .expect("arbiter");
        let control = connect(&arbiter);
        // The arbiter's NVML created the device's state already; this only maps it.
        let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let device = Device::open(&SimConfig::from_lookup(lookup).unwrap()).expect("simgpu");
        Rig {
            dir,
            binaries,
            env,
            arbiter,
            control,
            device,
            barriers: 0,
        }
    }

    /// Reserves a lease for each job, starts them, and opens their common start barrier
    /// once they have attached.
    fn start(&mut self, jobs: &[Job]) -> Vec<Running> {
        self.barriers += 1;
        let barrier = self.dir.path().join(format!("go-{}", self.barriers));
        let running: Vec<Running> = jobs
            .iter()
            .map(|job| {
                let lease = setup::reserve(
                    &self.arbiter,
                    &format!("{}-{}", job.name, self.barriers),
                    job.priority,
                    job.compute_request,
                    job.compute_limit,
                )
                .expect("reserve");
                let child = spawn_job(
                    &self.binaries,
                    &self.env,
                    &self.arbiter,
                    &lease,
                    job,
                    &barrier,
                )
                .expect("spawn");
                Running {
                    name: job.name.clone(),
                    lease: lease.id.clone(),
                    pid: child.id(),
                    stderr: String::new(),
                    child: Some(child),
                }
            })
            .collect();
        std::thread::sleep(SETTLE);
        std::fs::write(&barrier, b"").unwrap();
        running
    }

    /// Ends a finished job's lease, as the runtime does when its container stops.
    fn release(&mut self, job: &Running) {
        self.control.release(job.lease.clone()).expect("release");
    }

    /// The one GPU's token, as the arbiter reports it.
    fn token(&mut self) -> TokenStatus {
        let report = self.control.status().unwrap_or_else(|e| {
            panic!("arbiter status: {e}\narbiter log:\n{}", self.arbiter_log())
        });
        report.tokens.into_iter().next().unwrap_or_default()
    }

    fn holds(&mut self, pid: u32) -> bool {
        self.token().holders.iter().any(|h| h.pid == Some(pid))
    }

    /// Per pid, the GPU time of its contexts.
    fn usage(&self) -> HashMap<u32, Usage> {
        let snapshot = self
            .device
            .lock()
            .and_then(|mut locked| locked.snapshot(0))
            .expect("simgpu snapshot");
        let mut usage: HashMap<u32, Usage> = HashMap::new();
        for context in snapshot.contexts {
            let entry = usage.entry(context.pid).or_default();
            entry.gpu_time_ns += context.gpu_time_ns;
        }
        usage
    }

    fn gpu_time_ns(&self, pid: u32) -> u64 {
        self.usage().get(&pid).map_or(0, |u| u.gpu_time_ns)
    }

    fn kill_arbiter(&mut self) -> Instant {
        let at = Instant::now();
        self.arbiter.kill();
        at
    }

    fn restart_arbiter(&mut self) -> Instant {
        self.arbiter
            .try_restart()
            .unwrap_or_else(|e| panic!("restart the arbiter: {e}"));
        let up = Instant::now();
        self.control = connect(&self.arbiter);
        up
    }

    fn arbiter_log(&self) -> String {
        self.arbiter.log()
    }
}

fn connect(arbiter: &Arbiter) -> ControlClient {
    ControlClient::connect(&arbiter.control_socket(), Duration::from_secs(5))
        .expect("control connection")
}

/// Polls `done` every `every` until it holds or `limit` passes; returns how long it took.
fn wait_for(limit: Duration, every: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if done() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(every);
    }
}

fn number(report: &Value, pointer: &str) -> f64 {
    report
        .pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{pointer} missing in {report}"))
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A low-priority holder killed beside a high-priority job: its connection leaves the
/// token at once and the high job runs on. How much the high job is slowed (iterations
/// against a run alone, start latencies) is printed here and measured by `make bench`.
#[test]
fn killing_a_low_priority_holder_does_not_stall_the_high_priority_job() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, None));
    // Long enough to outlast the kill however late a loaded machine gets to it.
    let duration = Duration::from_secs(6);
    let mut jobs = rig.start(&[
        high_job(duration),
        saturating_low_job("low", Duration::from_secs(20)),
    ]);
    let began = Instant::now();
    let (high_pid, low_pid) = (jobs[0].pid, jobs[1].pid);
    let connected = wait_for(Duration::from_secs(5), Duration::from_millis(2), || {
        rig.token().clients == 2
    });
    assert!(connected.is_some(), "token clients: {:?}", rig.token());

    // Until the kill: the low job holds the token in the high job's gaps, and runs.
    let mut low_held = 0;
    let mut samples = 0;
    while began.elapsed() < Duration::from_millis(1500) || low_held == 0 {
        if began.elapsed() > Duration::from_secs(10) {
            break;
        }
        samples += 1;
        if rig.holds(low_pid) {
            low_held += 1;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        low_held > 0,
        "the low job never held the token in {samples} samples; its stderr:\n{}\narbiter log:\n{}",
        jobs[1].stderr,
        rig.arbiter_log()
    );
    let low_gpu_before_kill = rig.gpu_time_ns(low_pid);
    let killed_at = jobs[1].kill();
    let gone_after = wait_for(Duration::from_secs(5), Duration::from_millis(1), || {
        let token = rig.token();
        token.clients == 1 && token.holders.iter().all(|h| h.pid != Some(low_pid))
    });
    // The token right after the death, while the high job still runs.
    let token = rig.token();
    assert!(
        gone_after.is_some(),
        "the dead client stays on the token: {token:?}"
    );
    // The high job is not stalled by the dead holder: it keeps running on the GPU.
    let high_at_gone = rig.gpu_time_ns(high_pid);
    let high_ran_on = wait_for(Duration::from_secs(5), Duration::from_millis(10), || {
        rig.gpu_time_ns(high_pid) > high_at_gone + 1_000_000
    });
    let high = jobs[0].report(Duration::from_secs(30), &rig);
    eprintln!(
        "low held the token in {low_held}/{samples} samples and ran {:.0} ms on the GPU before \
         the kill at {:?}; dead client gone from the token after {gone_after:?}; high ran on \
         {high_ran_on:?} later; high (simulated GPU, this machine's load): {} iterations, start \
         latency p50 {:.0} µs p99 {:.0} µs max {:.0} µs, period max {:.1} ms",
        low_gpu_before_kill as f64 / 1e6,
        killed_at - began,
        number(&high, "/iterations"),
        number(&high, "/start_latency_us/p50"),
        number(&high, "/start_latency_us/p99"),
        number(&high, "/start_latency_us/max"),
        number(&high, "/period_ms/max"),
    );
    assert!(
        low_gpu_before_kill > 0,
        "the low job never ran on the GPU before the kill"
    );
    assert_eq!(token.clients, 1, "{token:?}");
    assert!(
        high_ran_on.is_some(),
        "the high job stopped running after the low holder's death: {:?}",
        rig.token()
    );
    assert!(
        high["errors"].as_object().is_some_and(|e| e.is_empty()),
        "{high}"
    );
}

/// A holder that dies hands the token on at once: the arbiter acts on the connection's
/// end, not on the holder's slice running out. The slices are fixed at 2 s, so a handoff
/// that waited for the dead holder's slice (and its grace) would first revoke it: the
/// proof is that the waiting job holds the token with no revocation and no overdue report
/// since the death — however slowly a loaded machine runs the test. How fast the handoff
/// is, is measured by `make bench` (the token-handoff bench's `death` case).
#[test]
fn a_waiting_low_priority_job_gets_the_token_when_the_holder_dies_not_when_its_slice_ends() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, Some(2_000)));
    let mut b = rig
        .start(&[saturating_low_job("b", Duration::from_secs(60))])
        .remove(0);
    let mut handoffs = Vec::new();
    for trial in 0..3 {
        let mut a = rig
            .start(&[saturating_low_job(
                &format!("a{trial}"),
                Duration::from_secs(60),
            )])
            .remove(0);
        let a_pid = a.pid;
        // A gets the token when B's 2 s slice ends.
        let a_holds = wait_for(Duration::from_secs(10), Duration::from_millis(1), || {
            rig.holds(a_pid)
        });
        assert!(
            a_holds.is_some(),
            "trial {trial}: A never held the token: {:?}",
            rig.token()
        );
        let before = rig.token();
        let killed_at = a.kill();
        // B holds and the dead client has left (a CPU-starved A may have gone idle and
        // given the token back just before its death: then B held first).
        let b_holds = wait_for(Duration::from_secs(10), Duration::from_millis(1), || {
            let token = rig.token();
            token.clients == 1 && token.holders.iter().any(|h| h.pid == Some(b.pid))
        })
        .map(|_| killed_at.elapsed());
        let after = rig.token();
        let handoff = b_holds.unwrap_or_else(|| {
            panic!(
                "trial {trial}: B did not get the token, or the dead A stayed on it, for 10 s \
                 after A's death: {after:?}"
            )
        });
        assert_eq!(
            (after.revocations, after.overdue),
            (before.revocations, before.overdue),
            "trial {trial}: the dead holder was revoked or reported overdue before B got the \
             token ({handoff:?} after the kill): the handoff waited for its slice, not for its \
             connection's end\nbefore: {before:?}\nafter: {after:?}"
        );
        handoffs.push(handoff);
    }
    // B alone now runs on.
    let before = rig.gpu_time_ns(b.pid);
    let ran = wait_for(Duration::from_secs(5), Duration::from_millis(10), || {
        rig.gpu_time_ns(b.pid) > before
    });
    let token = rig.token();
    let _ = b.kill();
    eprintln!(
        "kill of the holder → the waiting job holds (simulated GPU, this machine's load): \
         {handoffs:?} (median {:?}); token {token:?}",
        median_duration(handoffs.iter().copied())
    );
    assert!(
        ran.is_some(),
        "B stopped running after the kills: {token:?}"
    );
}

/// The arbiter killed while a high and a low job share the GPU: the high job runs on (it
/// never waits for a grant), the low job stops once its agent sees the hang-up and stays
/// stopped until the arbiter is back, then both reconnect and the low job runs again.
/// The shares before and during the outage are printed; `make bench` measures speed.
#[test]
fn a_lost_arbiter_lets_high_run_and_holds_low() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, None));
    // Long enough to outlast a slow start on a loaded 2-core machine, the outage and the
    // reconnection.
    let duration = Duration::from_secs(12);
    let mut jobs = rig.start(&[high_job(duration), saturating_low_job("low", duration)]);
    let began = Instant::now();
    let (high_pid, low_pid) = (jobs[0].pid, jobs[1].pid);

    // On a loaded CI machine both jobs may take a while to launch their first kernel (one CI
    // run saw the low job idle for the whole first second): the outage starts once both run,
    // so that the low job's silence during it is the arbiter's doing.
    let started = wait_for(Duration::from_secs(5), Duration::from_millis(5), || {
        rig.gpu_time_ns(high_pid) > 1_000_000 && rig.gpu_time_ns(low_pid) > 1_000_000
    });
    assert!(
        started.is_some(),
        "the jobs did not both run within 5 s: {:?}",
        rig.token()
    );
    let (t0, u0) = (Instant::now(), rig.usage());
    std::thread::sleep(Duration::from_millis(500));
    let (t1, u1) = (Instant::now(), rig.usage());
    let killed_at = rig.kill_arbiter();
    // The low job's agent notices the hang-up within its longest sleep (100 ms) on an idle
    // machine, and its launched work drains; until then it may use the rest of its slice.
    // Settled: no GPU time for 500 ms (a loaded machine may take longer to get there).
    let mut last = rig.gpu_time_ns(low_pid);
    let mut quiet_since = Instant::now();
    let settled = wait_for(Duration::from_secs(5), Duration::from_millis(20), || {
        let now = rig.gpu_time_ns(low_pid);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
        quiet_since.elapsed() >= Duration::from_millis(500)
    });
    let (t2, u2) = (Instant::now(), rig.usage());
    std::thread::sleep(Duration::from_millis(1000));
    let (t3, u3) = (Instant::now(), rig.usage());
    let outage = killed_at.elapsed();
    let up_at = rig.restart_arbiter();
    let low_resumed = wait_for(Duration::from_secs(5), Duration::from_millis(2), || {
        rig.gpu_time_ns(low_pid) > u3[&low_pid].gpu_time_ns + 1_000_000
    });
    let both_back = wait_for(Duration::from_secs(5), Duration::from_millis(5), || {
        rig.token().clients == 2
    });
    let high = jobs[0].report(Duration::from_secs(30), &rig);
    let low = jobs[1].report(Duration::from_secs(30), &rig);

    let rate = |a: &HashMap<u32, Usage>, b: &HashMap<u32, Usage>, pid: u32, dt: Duration| {
        (b[&pid].gpu_time_ns - a[&pid].gpu_time_ns) as f64 / dt.as_nanos() as f64
    };
    let high_outage_ns = u3[&high_pid].gpu_time_ns - u2[&high_pid].gpu_time_ns;
    let low_outage_ns = u3[&low_pid].gpu_time_ns - u2[&low_pid].gpu_time_ns;
    eprintln!(
        "both jobs ran {started:?} after the start; GPU share before the kill (simulated, this \
         machine's load): high {:.3}, low {:.3}; the low job settled {settled:?} after the kill; \
         during the {outage:?} outage: high {:.3}, low {:.3} ms in the {:?} after it settled; \
         restarted arbiter up {:?} after the start; low resumed {low_resumed:?} after the \
         restart, both clients back after {both_back:?}; high start latency max {:.0} µs, {} \
         iterations; low period max {:.0} ms",
        rate(&u0, &u1, high_pid, t1 - t0),
        rate(&u0, &u1, low_pid, t1 - t0),
        rate(&u2, &u3, high_pid, t3 - t2),
        low_outage_ns as f64 / 1e6,
        t3 - t2,
        up_at - began,
        number(&high, "/start_latency_us/max"),
        number(&high, "/iterations"),
        number(&low, "/period_ms/max"),
    );
    assert!(
        settled.is_some(),
        "the low job kept running for 5 s after the arbiter was killed"
    );
    assert!(
        high_outage_ns > 1_000_000,
        "the high job stopped running without the arbiter: {high_outage_ns} ns in {:?}",
        t3 - t2
    );
    assert!(
        low_outage_ns == 0,
        "the low job ran {low_outage_ns} ns on the GPU while the arbiter was gone"
    );
    assert!(
        low_resumed.is_some(),
        "the low job did not run again within 5 s of the arbiter's restart: {:?}\n{}",
        rig.token(),
        rig.arbiter_log()
    );
    assert!(
        both_back.is_some(),
        "the clients did not reconnect: {:?}",
        rig.token()
    );
}

/// Found by the tests above (a low job "never held the token" about once in ten runs): a low
/// client whose first grant lands while its token agent is between opening the connection
/// and starting to serve it treats that grant as already answered, never releases it, and
/// is cut off after the revocation grace. Several low jobs and a high one join at once,
/// round after round; none may be cut off.
#[test]
fn low_priority_clients_joining_together_are_not_cut_off() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, None));
    let rounds = 5;
    let mut ran_nothing = Vec::new();
    let mut stderr = HashMap::new();
    for round in 0..rounds {
        let mut jobs = vec![high_job(Duration::from_secs(30))];
        jobs.extend(
            (0..4).map(|i| saturating_low_job(&format!("low{i}"), Duration::from_secs(30))),
        );
        let mut running = rig.start(&jobs);
        std::thread::sleep(Duration::from_millis(800));
        let usage = rig.usage();
        for job in &running[1..] {
            if usage.get(&job.pid).map_or(0, |u| u.gpu_time_ns) == 0 {
                ran_nothing.push(format!("round {round}: {}", job.name));
            }
        }
        for job in &mut running {
            job.kill();
            rig.release(job);
            stderr.insert(job.pid, std::mem::take(&mut job.stderr));
        }
    }
    let token = rig.token();
    let overdue_lines: Vec<String> = rig
        .arbiter_log()
        .lines()
        .filter(|l| l.contains("overdue"))
        .map(String::from)
        .collect();
    // With GPUSHARE_LOG=debug: what the overdue clients' interposers said.
    let interposer_logs: Vec<String> = stderr
        .iter()
        .filter(|(pid, _)| {
            overdue_lines
                .iter()
                .any(|l| l.contains(&format!("pid=Some({pid})")))
        })
        .map(|(pid, log)| format!("pid {pid}:\n{log}"))
        .collect();
    // A grant that is never answered now makes its client overdue rather than cut off.
    assert!(
        token.overdue == 0 && ran_nothing.is_empty(),
        "{} of {} low clients went overdue; these ran nothing on the GPU: {ran_nothing:?}\n{}\n{}",
        token.overdue,
        4 * rounds,
        overdue_lines.join("\n"),
        interposer_logs.join("\n")
    );
}

/// Long kernels: real training kernels and captured graphs last far longer than the
/// revocation grace (500 ms). A low-priority job of 2 s kernels beside a high-priority job
/// is revoked mid-kernel again and again; its drain outlasts the grace, so it is reported
/// overdue — and never cut off: it finishes all its work once the high job leaves.
#[test]
fn a_job_of_2_s_kernels_beside_a_high_job_keeps_running_and_is_never_cut_off() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, None));
    let long = job(
        "long",
        Priority::Low,
        &[
            "--kernels",
            "1",
            "--kernel",
            "fixed:2s",
            "--sync",
            "event",
            "--iterations",
            "4",
        ],
    );
    let mut jobs = rig.start(&[high_job(Duration::from_secs(3)), long]);
    let high = jobs[0].report(Duration::from_secs(30), &rig);
    assert!(number(&high, "/iterations") > 0.0, "{high}");
    let high_left = Instant::now();
    rig.release(&jobs[0]);
    // A cut-off client waited for ever: finishing all four kernels within the limit is
    // the proof it was not stranded.
    let report = jobs[1].report(Duration::from_secs(60), &rig);
    let token = rig.token();
    for line in rig.arbiter_log().lines().filter(|l| {
        l.contains("beyond its token") || l.contains("overran") || l.contains("overdue")
    }) {
        eprintln!("XXLOG {line}");
    }
    eprintln!("XXTOKEN {token:?}");
    assert_eq!(number(&report, "/iterations"), 4.0, "{report}");
    assert!(
        report["errors"].as_object().is_some_and(|e| e.is_empty()),
        "{report}"
    );
    assert!(
        token.overdue >= 1,
        "the 2 s drains outlasted the grace, so the job was reported overdue at least once: {token:?}\n{}", rig.arbiter_log()
    );
    assert!(
        token.overdue_clients.is_empty(),
        "nobody is still overdue after the job finished: {token:?}"
    );
    eprintln!(
        "long job finished {:.1} s after the high job left; overdue reports: {}",
        high_left.elapsed().as_secs_f64(),
        token.overdue
    );
}

/// Duration-aware admission, end to end: a low job beside the training-like high job
/// (3 ms CPU gaps), its kernels growing mid-run from 1 ms (they fit the gaps) to 50 ms
/// (they do not). The 1 ms kernels are admitted inside the arbiter's windows; the first
/// 50 ms one is reported as a mis-prediction (it ran past its window) and the rest wait
/// while the high job is active — and the low job is never stranded: it runs flat out
/// once the high job has gone.
///
/// How the rest wait depends on how late that first 50 ms kernel's release came: within
/// the window-overrun grace (10 ms), the job waits for a window its 50 ms launch fits;
/// past it — nearly always — the arbiter measured the overrun itself and the lease's
/// penalty holds it back until the high job is quiet. Both are the designed answer, so
/// either is accepted; what may not happen is the low job running beside the high job.
/// Why 50 ms, far past the 3 ms gap: a loaded machine stretches the high job's 3 ms
/// sleeps, and a test run under load saw 5 ms launches fit the stretched gaps, so
/// nothing waited (correctly: those gaps were real idle time).
#[test]
fn a_low_job_whose_kernels_outgrow_the_high_jobs_gaps_is_held_back_and_runs_once_it_leaves() {
    let _turn = serial();
    let mut rig = Rig::new(scheduler_config(PriorityPolicy, None));
    let low = job(
        "low",
        Priority::Low,
        &[
            "--kernels",
            "1",
            "--kernel",
            "fixed:1ms",
            "--then-kernel",
            "1500ms:fixed:50ms",
            "--sync",
            "event",
            "--pipeline",
            "2",
            "--duration",
            "9s",
        ],
    );
    // The high job outlasts the low job's switch to 5 ms kernels by seconds, however late
    // a loaded machine starts the low job (a CI run saw the high job gone by then with 3 s).
    let mut jobs = rig.start(&[high_job(Duration::from_millis(6_000)), low]);
    let low_pid = jobs[1].pid;

    // 1 ms kernels fit the gaps: admitted inside windows.
    let fitted = wait_for(Duration::from_secs(3), Duration::from_millis(20), || {
        let admission = rig.token().admission;
        admission.windows > 0 && admission.launches.fitted >= 20
    });
    assert!(
        fitted.is_some(),
        "never admitted inside a window: {:?}",
        rig.token()
    );

    // After the switch: held back, waiting for a window its 50 ms launch fits, or by its
    // lease's penalty for a measured overrun.
    let low_lease = jobs[1].lease.clone();
    let held = wait_for(Duration::from_secs(6), Duration::from_millis(10), || {
        let admission = rig.token().admission;
        let waits_for_window = admission.launches.held_back > 0
            && admission
                .waiting_for_window
                .iter()
                .any(|w| w.pid == Some(low_pid) && w.need_us >= 40_000);
        let penalized =
            admission.measured_overruns > 0 && admission.penalized_leases.contains(&low_lease);
        waits_for_window || penalized
    });
    assert!(held.is_some(), "never held back: {:?}", rig.token());
    // The overrun is reported by the interposer (its next admission report, sent with a
    // release) or measured by the arbiter itself (a release past the window's grace). On
    // the penalty path the interposer may not release again while the high job runs, so
    // its own report can come only later: either counts.
    let token = rig.token();
    let told = token.admission.launches.overran >= 1 && token.admission.launches.overran_ns > 0;
    let measured = token.admission.measured_overruns >= 1;
    assert!(
        told || measured,
        "the first 50 ms kernel ran past its window and is reported: {token:?}"
    );
    // While the high job runs, the held-back job gets little of the GPU (it had most of
    // the idle ~40 % before admission knew durations).
    let before = rig.gpu_time_ns(low_pid);
    std::thread::sleep(Duration::from_millis(500));
    let while_high = rig.gpu_time_ns(low_pid) - before;
    assert!(
        while_high < 125_000_000,
        "the low job ran {} ms of 500 beside the high job",
        while_high / 1_000_000
    );

    // The high job ends: the low job runs at once, unbounded.
    jobs[0].report(Duration::from_secs(20), &rig);
    rig.release(&jobs[0]);
    let before = rig.gpu_time_ns(low_pid);
    let ran = wait_for(Duration::from_secs(3), Duration::from_millis(10), || {
        rig.gpu_time_ns(low_pid) >= before + 250_000_000
    });
    assert!(
        ran.is_some(),
        "stranded after the high job left: {:?}",
        rig.token()
    );
    let report = jobs[1].report(Duration::from_secs(30), &rig);
    assert!(number(&report, "/kernels") > 0.0, "{report}");
}
