use std::sync::Mutex;

use super::*;

const MS: u64 = 1_000_000;
const GPU: &str = "GPU-0";
const PID: u32 = 10;

fn place() -> Place {
    (GPU.to_owned(), PID)
}

/// One interval's busy and held ms for pid 10 on GPU-0.
type Row = (u64, u64);

struct Case {
    gpus: usize,
    registered: bool,
    /// Its lease is a high-priority one.
    high_lease: bool,
    /// Its token connection's priority (None: it has none).
    priority: Option<Priority>,
    contested: bool,
    /// How far apart the intervals are.
    step: Duration,
    rows: Vec<Row>,
}

impl Default for Case {
    fn default() -> Case {
        Case {
            gpus: 1,
            registered: true,
            high_lease: false,
            priority: Some(Priority::Low),
            contested: true,
            step: CHECK_INTERVAL,
            rows: Vec::new(),
        }
    }
}

/// Per interval (100 ms apart, past the restart grace), whether pid 10 was found.
fn found_at(case: &Case) -> Vec<bool> {
    let start = Instant::now();
    let id = LeaseId("low".into());
    let mut check = BypassCheck::new(start, BTreeSet::from([id.clone()]));
    let gpus: Vec<String> = (0..case.gpus).map(|i| format!("GPU-{i}")).collect();
    let leases = [LeaseView {
        id: &id,
        gpus: &gpus,
        memory_quota: 0,
        client_pids: if case.registered { vec![PID] } else { vec![] },
    }];
    let contested: BTreeSet<String> = case.contested.then(|| GPU.to_owned()).into_iter().collect();
    case.rows
        .iter()
        .enumerate()
        .map(|(i, &(busy_ms, held_ms))| {
            let now = start + RESTART_GRACE + case.step * (i as u32 + 1);
            let busy = BTreeMap::from([(place(), busy_ms * MS)]);
            let held: BTreeMap<Place, Held> = case
                .priority
                .map(|priority| {
                    (
                        place(),
                        Held {
                            priority,
                            held_ns: held_ms * MS,
                        },
                    )
                })
                .into_iter()
                .collect();
            let high: BTreeSet<LeaseId> = case.high_lease.then(|| id.clone()).into_iter().collect();
            let found = check.judge(now, &contested, &busy, &held, &leases, &high);
            assert!(found
                .iter()
                .all(|b| b.pid == PID && b.lease == id && b.gpu == GPU));
            !found.is_empty()
        })
        .collect()
}

fn rows(n: usize, row: Row) -> Vec<Row> {
    vec![row; n]
}

/// A case bypassing every interval (busy throughout, no token time), as `edit` changes it.
fn bypassing(edit: impl FnOnce(&mut Case)) -> Case {
    let mut case = Case {
        rows: rows(9, (100, 0)),
        ..Case::default()
    };
    edit(&mut case);
    case
}

#[test]
fn busy_time_beyond_token_time_beside_an_active_high_job_is_a_bypass() {
    let no = |n: usize| vec![false; n];
    // 100 ms intervals; the tolerance is 200 ms over a second.
    assert_eq!(
        (CHECK_INTERVAL, TOLERANCE),
        (Duration::from_millis(100), Duration::from_millis(200))
    );
    let found_twice = [false, false, true].repeat(3);
    let cases: Vec<(&str, Case, Vec<bool>)> = vec![
        (
            "busy with no token time: found once past the tolerance, then again if it goes on",
            bypassing(|_| {}),
            found_twice.clone(),
        ),
        (
            "with no token connection at all",
            bypassing(|c| c.priority = None),
            found_twice,
        ),
        (
            "busy inside its holds",
            bypassing(|c| c.rows = rows(30, (100, 100))),
            no(30),
        ),
        (
            "a sampling edge: each hold's busy time counted an interval late",
            bypassing(|c| {
                c.rows = [(0, 100)]
                    .into_iter()
                    .chain(rows(29, (100, 100)))
                    .chain([(100, 0)])
                    .collect()
            }),
            no(31),
        ),
        (
            "a loaded node's delayed ticks: 300 ms intervals, busy time seen one late",
            bypassing(|c| {
                c.step = Duration::from_millis(300);
                c.rows = [(0, 300)]
                    .into_iter()
                    .chain(rows(19, (300, 300)))
                    .chain([(300, 0)])
                    .collect()
            }),
            no(21),
        ),
        (
            "busy a little beyond its holds, within the tolerance over the window",
            bypassing(|c| c.rows = rows(30, (100, 85))),
            no(30),
        ),
        (
            "a high-priority job submits without a grant",
            bypassing(|c| c.priority = Some(Priority::High)),
            no(9),
        ),
        (
            "a process of a high-priority lease with no token connection is never stopped",
            bypassing(|c| {
                c.high_lease = true;
                c.priority = None;
            }),
            no(9),
        ),
        (
            "a multi-GPU lease runs ungated by design",
            bypassing(|c| c.gpus = 2),
            no(9),
        ),
        (
            "unregistered: the watchdog's finding",
            bypassing(|c| c.registered = false),
            no(9),
        ),
        (
            "no high-priority job active: low jobs soak up the GPU",
            bypassing(|c| c.contested = false),
            no(9),
        ),
    ];
    for (name, case, expected) in cases {
        assert_eq!(found_at(&case), expected, "{name}");
    }
}

#[test]
fn a_recovered_lease_is_not_judged_within_the_restart_grace_nor_counted_from_it() {
    let start = Instant::now();
    let recovered = LeaseId("recovered".into());
    let new = LeaseId("new".into());
    let mut check = BypassCheck::new(start, BTreeSet::from([recovered.clone()]));
    let gpus = vec![GPU.to_owned()];
    let leases = [
        LeaseView {
            id: &recovered,
            gpus: &gpus,
            memory_quota: 0,
            client_pids: vec![PID],
        },
        LeaseView {
            id: &new,
            gpus: &gpus,
            memory_quota: 0,
            client_pids: vec![PID + 1],
        },
    ];
    let contested = BTreeSet::from([GPU.to_owned()]);
    let busy = BTreeMap::from([(place(), 100 * MS), ((GPU.to_owned(), PID + 1), 100 * MS)]);
    let held = BTreeMap::new();
    let found_pids = |check: &mut BypassCheck, now| -> Vec<u32> {
        check
            .judge(now, &contested, &busy, &held, &leases, &BTreeSet::new())
            .iter()
            .map(|b| b.pid)
            .collect()
    };
    // The recovered lease's processes re-attach after a restart; until then they run
    // ungated. A lease made since the start has no such excuse.
    let mut found_new = Vec::new();
    for i in 1..=20u32 {
        let now = start + CHECK_INTERVAL * i;
        found_new.extend(found_pids(&mut check, now));
    }
    assert_eq!(found_new, [PID + 1; 6]);
    // Past the grace, the recovered lease's window starts empty: found on its third.
    let past = start + RESTART_GRACE;
    let found: Vec<Vec<u32>> = (1..=3u32)
        .map(|i| found_pids(&mut check, past + CHECK_INTERVAL * i))
        .map(|pids| pids.into_iter().filter(|&p| p == PID).collect())
        .collect();
    assert_eq!(found, [vec![], vec![], vec![PID]]);
}

#[test]
fn an_overrun_counts_as_token_time_here() {
    let holding = |held_ns, overran_ns| Holding {
        gpu: GPU.into(),
        lease: LeaseId("low".into()),
        pid: Some(PID),
        priority: Priority::Low,
        held_ns,
        overran_ns,
    };
    let totals = token_time(&[holding(5, 7), holding(1, 0)]);
    assert_eq!(totals[&place()].held_ns, 13);
}

// ----- stopping and continuing -----

#[derive(Default)]
struct FakeProcesses {
    /// pid → start time of the processes alive.
    alive: Mutex<BTreeMap<u32, u64>>,
    /// ("stop" | "resume", pid), in order.
    sent: Mutex<Vec<(&'static str, u32)>>,
}

struct Fake<'a>(&'a FakeProcesses);

impl Signals for Fake<'_> {
    fn start_time(&self, pid: u32) -> Option<u64> {
        self.0.alive.lock().unwrap().get(&pid).copied()
    }
    fn stop(&self, pid: u32) -> std::io::Result<()> {
        self.0.sent.lock().unwrap().push(("stop", pid));
        Ok(())
    }
    fn resume(&self, pid: u32) -> std::io::Result<()> {
        self.0.sent.lock().unwrap().push(("resume", pid));
        Ok(())
    }
}

/// A run directory, and processes 10 and 11 alive.
fn two_processes() -> (tempfile::TempDir, FakeProcesses) {
    let processes = FakeProcesses::default();
    processes
        .alive
        .lock()
        .unwrap()
        .extend([(10, 100), (11, 110)]);
    (tempfile::tempdir().unwrap(), processes)
}

#[test]
fn a_process_is_stopped_while_its_gpu_is_contested_and_continued_after() {
    let (dir, processes) = two_processes();
    let file = paused_file(dir.path());
    let mut pauses = Pauses::recover(Fake(&processes), file.clone());
    pauses.pause(10, "GPU-0");
    pauses.pause(10, "GPU-0");
    pauses.pause(11, "GPU-1");
    pauses.pause(12, "GPU-0"); // gone already
    assert_eq!(
        *processes.sent.lock().unwrap(),
        [("stop", 10), ("stop", 11)]
    );
    let listed: Vec<Paused> = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(listed, pauses.paused());
    // GPU-0's high job went quiet; GPU-1's goes on.
    pauses.resume_where_not(&BTreeSet::from(["GPU-1".to_owned()]));
    assert_eq!(processes.sent.lock().unwrap().last(), Some(&("resume", 10)));
    assert_eq!(pauses.paused().len(), 1);
    // Pid 11 exits and its pid is reused: the new process is never continued.
    processes.alive.lock().unwrap().insert(11, 999);
    pauses.resume_all();
    assert_eq!(
        processes.sent.lock().unwrap().len(),
        3,
        "no resume of a reused pid"
    );
    assert!(!file.exists(), "nothing stopped, nothing listed");
}

#[test]
fn an_arbiter_killed_while_processes_were_stopped_continues_them_when_it_starts() {
    let (dir, processes) = two_processes();
    let file = paused_file(dir.path());
    let mut killed = Pauses::recover(Fake(&processes), file.clone());
    killed.pause(10, "GPU-0");
    killed.pause(11, "GPU-0");
    // Killed: nothing runs its Drop.
    std::mem::forget(killed);
    processes.alive.lock().unwrap().insert(11, 999); // 11 exited, its pid reused
    processes.sent.lock().unwrap().clear();
    let restarted = Pauses::recover(Fake(&processes), file.clone());
    assert_eq!(*processes.sent.lock().unwrap(), [("resume", 10)]);
    assert!(restarted.paused().is_empty());
    assert!(!file.exists());
}

#[test]
fn a_clean_stop_continues_every_stopped_process() {
    let dir = tempfile::tempdir().unwrap();
    let processes = FakeProcesses::default();
    processes.alive.lock().unwrap().insert(10, 100);
    let mut pauses = Pauses::recover(Fake(&processes), paused_file(dir.path()));
    pauses.pause(10, "GPU-0");
    drop(pauses);
    assert_eq!(
        *processes.sent.lock().unwrap(),
        [("stop", 10), ("resume", 10)]
    );
}
