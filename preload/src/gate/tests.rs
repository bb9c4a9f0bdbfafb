//! The gate's client logic against a stand-in arbiter over a real socket and memfd
//! page (no driver: draining and events are no-ops here).

use super::*;
use gpushare_proto::{LossPolicy, Priority};
use gpushare_testkit::fake_arbiter::{Answer, FakeArbiter};
use std::sync::mpsc;
use std::time::Instant;

const PATIENCE: Duration = Duration::from_secs(5);
const STREAM: Target = Target {
    stream: 7,
    per_thread: false,
};
const KERNEL: estimate::What = estimate::What::Kernel(0x1000);

fn terms(priority: Priority, idle: Duration, on_loss: LossPolicy) -> ScheduleTerms {
    ScheduleTerms {
        gpu: "GPU-0".into(),
        priority,
        idle_ns: idle.as_nanos() as u64,
        on_arbiter_loss: on_loss,
        fit_launches: false,
    }
}

use gpushare_proto::ScheduleTerms;

fn setup(answer: Answer) -> (tempfile::TempDir, FakeArbiter, &'static Gate) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("arbiter.sock");
    let arbiter = FakeArbiter::start(&socket, answer, NOT_HELD);
    let gate = Gate::for_socket(socket);
    (dir, arbiter, gate)
}

/// Runs one launch's admission on another thread; the receiver hears when it passed.
fn launch_in_background(gate: &'static Gate) -> mpsc::Receiver<bool> {
    let (sender, passed) = mpsc::channel();
    std::thread::spawn(move || {
        let ticket = gate.admit(STREAM, KERNEL);
        let bounded = matches!(ticket.pass, Pass::Bounded(_));
        launched(ticket, CUDA_SUCCESS);
        let _ = sender.send(bounded);
    });
    passed
}

/// A low-priority client (long idle threshold, waits while the arbiter is lost) whose
/// first launch asked for the token and was granted it unbounded.
fn holding_low_unbounded() -> (tempfile::TempDir, FakeArbiter, &'static Gate) {
    let (dir, arbiter, gate) = setup(Answer::Schedule(terms(
        Priority::Low,
        Duration::from_secs(60),
        LossPolicy::Wait,
    )));
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    arbiter.grant(HELD_UNTIL_RELEASED, 0);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
    (dir, arbiter, gate)
}

fn wait_until(what: &str, condition: impl Fn() -> bool) {
    gpushare_testkit::wait_until(what, PATIENCE, condition);
}

#[test]
fn a_low_priority_launch_waits_for_the_grant_and_the_token_goes_back_when_revoked() {
    let long_idle = Duration::from_secs(60);
    let (_dir, arbiter, gate) = setup(Answer::Schedule(terms(
        Priority::Low,
        long_idle,
        LossPolicy::Wait,
    )));
    // The first launch opens the connection and asks for the token...
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    // ...and does not run before the grant.
    assert!(passed.recv_timeout(Duration::from_millis(100)).is_err());
    assert_eq!(gate.launches(), 0);
    arbiter.grant(HELD_UNTIL_RELEASED, 0);
    assert_eq!(
        passed.recv_timeout(PATIENCE),
        Ok(false),
        "granted: unbounded"
    );
    assert_eq!(gate.launches(), 1);
    // While holding, launches pass on the hot path without asking.
    assert!(matches!(gate.admit(STREAM, KERNEL).pass, Pass::Free));
    assert_eq!(gate.launches(), 2);
    // A revocation: the agent drains and acknowledges; nobody waits.
    arbiter.revoke();
    assert_eq!(
        arbiter.next_request(PATIENCE),
        Some(TokenRequest::Release { again: false })
    );
    // The next launch waits again and asks again (a new episode).
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    assert!(passed.recv_timeout(Duration::from_millis(50)).is_err());
    // A slice with a deadline: granted, then it runs out while a launch waits.
    let slice = Duration::from_millis(100);
    arbiter.grant(monotonic_ns() + slice.as_nanos() as u64, 0);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
    let began = Instant::now();
    let late = launch_in_background(gate);
    // (the late launch passes if it came before the deadline, else it waits)
    let release = arbiter.next_request(PATIENCE);
    assert!(began.elapsed() < PATIENCE);
    match late.try_recv() {
        Ok(_) => assert_eq!(release, Some(TokenRequest::Release { again: false })),
        Err(_) => {
            assert_eq!(
                release,
                Some(TokenRequest::Release { again: true }),
                "a launch waits"
            );
            arbiter.grant(HELD_UNTIL_RELEASED, 0);
            assert_eq!(late.recv_timeout(PATIENCE), Ok(false));
        }
    }
}

/// A launch that passed the gate just before a revocation reaches the driver only
/// afterwards (its thread was preempted in between, as on a loaded node): the agent's
/// drain cannot see it yet, so the token must not go back until it has been submitted,
/// or its kernel runs on after the release, in the high job's time. A CI run saw that:
/// an honest job's 2 s kernel ran past its release and was judged a bypass.
#[test]
fn a_launch_admitted_before_a_revocation_is_submitted_before_the_token_goes_back() {
    let (_dir, arbiter, gate) = holding_low_unbounded();
    // Admitted on the hot path; the driver has not seen the launch yet.
    let ticket = gate.admit(STREAM, KERNEL);
    assert!(matches!(ticket.pass, Pass::Free));
    arbiter.revoke();
    assert_eq!(
        arbiter.next_request(Duration::from_millis(300)),
        None,
        "the token went back while an admitted launch was still on its way to the driver"
    );
    launched(ticket, CUDA_SUCCESS);
    assert_eq!(
        arbiter.next_request(PATIENCE),
        Some(TokenRequest::Release { again: false }),
        "released once the launch was submitted"
    );
}

#[test]
fn an_idle_holder_returns_the_token() {
    let (_dir, arbiter, gate) = setup(Answer::Schedule(terms(
        Priority::Low,
        Duration::from_millis(30),
        LossPolicy::Wait,
    )));
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    arbiter.grant(HELD_UNTIL_RELEASED, 0);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
    let granted = Instant::now();
    assert_eq!(
        arbiter.next_request(PATIENCE),
        Some(TokenRequest::Release { again: false })
    );
    assert!(
        granted.elapsed() >= Duration::from_millis(25),
        "released after {:?}, before the idle threshold",
        granted.elapsed()
    );
}

#[test]
fn a_high_priority_launch_submits_at_once_and_asks_for_the_token() {
    let (_dir, arbiter, gate) = setup(Answer::Schedule(terms(
        Priority::High,
        Duration::from_secs(60),
        LossPolicy::Run,
    )));
    // The very first launch waits only for the connection (its class is unknown
    // before), then goes without a grant.
    let passed = launch_in_background(gate);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    // Once per episode: further launches do not repeat it.
    assert!(matches!(gate.admit(STREAM, KERNEL).pass, Pass::Free));
    assert_eq!(arbiter.next_request(Duration::from_millis(50)), None);
}

#[test]
fn a_launch_ahead_bound_hands_out_the_ring() {
    let (_dir, arbiter, gate) = setup(Answer::Schedule(terms(
        Priority::Low,
        Duration::from_secs(60),
        LossPolicy::Wait,
    )));
    // The stream's ring is its own (no driver here to ask which context it is in).
    gate.client().work.stream_created(STREAM.stream, 1, 0);
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    arbiter.grant(HELD_UNTIL_RELEASED, 1);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(true), "bounded launch");
    let ticket = gate.admit(STREAM, KERNEL);
    assert!(matches!(ticket.pass, Pass::Bounded(_)));
    launched(ticket, CUDA_SUCCESS);
}

#[test]
fn a_refused_schedule_runs_ungated_for_good() {
    let (_dir, arbiter, gate) = setup(Answer::Refuse);
    let passed = launch_in_background(gate);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
    assert!(std::ptr::eq(gate.page(), &UNGATED));
    assert_eq!(arbiter.connections(), 1);
}

#[test]
fn a_lost_arbiter_applies_the_policy_and_the_client_reconnects() {
    let (_dir, arbiter, gate) = holding_low_unbounded();
    let first_page = gate.page();
    // The arbiter exits: the holder loses the token, and reconnects.
    arbiter.hang_up();
    wait_until("a second connection", || arbiter.connections() == 2);
    wait_until("the new page is published", || {
        !std::ptr::eq(gate.page(), first_page) && !std::ptr::eq(gate.page(), &WAITING)
    });
    // The old mapping is still readable (leaked, never unmapped).
    assert_eq!(first_page.deadline_ns.load(Acquire), HELD_UNTIL_RELEASED);
    // Not held on the new page: a launch waits and asks on the new connection.
    let passed = launch_in_background(gate);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    assert!(passed.recv_timeout(Duration::from_millis(50)).is_err());
    // Cut off, and refused afterwards: it waits.
    arbiter.set_answer(Answer::Refuse);
    arbiter.cut_off();
    wait_until("the cut-off client waits", || {
        std::ptr::eq(gate.page(), &WAITING)
    });
    wait_until("it asked again", || arbiter.connections() >= 3);
    assert!(
        std::ptr::eq(gate.page(), &WAITING),
        "refused after a cut-off: waits"
    );
    assert!(passed.try_recv().is_err());
}

#[test]
fn an_inactive_library_is_ungated_from_the_first_launch() {
    let gate: &'static Gate = Box::leak(Box::new(Gate::new(Socket::Never)));
    assert!(
        std::ptr::eq(gate.page(), &WAITING),
        "the first launch takes the cold path"
    );
    assert!(matches!(gate.admit(STREAM, KERNEL).pass, Pass::Free));
    assert!(std::ptr::eq(gate.page(), &UNGATED));
    assert_eq!(gate.launches(), 1);
}

#[test]
fn a_fork_child_starts_from_the_initial_state_and_closes_the_token_socket() {
    let (_dir, arbiter, gate) = holding_low_unbounded();
    let fd = gate.token_fd.load(Acquire);
    assert!(fd >= 0);
    let socket_inode = inode_of(fd).expect("the token socket is open");
    // What the child handler does (a test harness cannot fork): a lock the parent's
    // threads hold must not matter.
    let client = gate.client();
    let _held = client.send_lock.lock().unwrap();
    gate.reset_after_fork();
    assert!(std::ptr::eq(gate.page(), &WAITING), "holds no token");
    assert!(
        gate.client.load(Acquire).is_null(),
        "the parent's client is abandoned"
    );
    // Closed: the number is free, or (other tests of this binary open descriptors all
    // the time) already reused for something else.
    assert_ne!(inode_of(fd), Some(socket_inode), "the socket is closed");
    // Its first launch starts afresh: a connection of its own.
    let passed = launch_in_background(gate);
    wait_until("a second connection", || arbiter.connections() == 2);
    assert_eq!(arbiter.next_request(PATIENCE), Some(TokenRequest::Want));
    arbiter.grant(HELD_UNTIL_RELEASED, 0);
    assert_eq!(passed.recv_timeout(PATIENCE), Ok(false));
}

#[test]
fn the_gate_clock_is_monotonic_nanoseconds() {
    let before = monotonic_ns();
    std::thread::sleep(std::time::Duration::from_millis(2));
    let elapsed = monotonic_ns() - before;
    assert!(elapsed >= 2_000_000, "{elapsed} ns for a 2 ms sleep");
    assert!(elapsed < 10_000_000_000, "{elapsed} ns: not nanoseconds");
}

#[test]
fn per_thread_launches_name_the_threads_default_stream() {
    let t = |stream, per_thread| Target { stream, per_thread }.handle();
    assert_eq!(t(0, true), CU_STREAM_PER_THREAD);
    assert_eq!(t(0, false), 0);
    assert_eq!(t(9, true), 9);
}

#[test]
fn a_process_known_to_be_high_priority_runs_while_the_arbiter_was_never_reached() {
    let dir = tempfile::tempdir().unwrap();
    // Nobody listens here: the arbiter is away from the start.
    let gate = Gate::for_socket(dir.path().join("arbiter.sock"));
    gate.learn_class(Priority::High);
    let passed = launch_in_background(gate);
    assert_eq!(
        passed.recv_timeout(PATIENCE),
        Ok(false),
        "a high-priority launch waited for an arbiter that is away"
    );
    // A process whose class is low (or unknown) waits instead.
    let low = Gate::for_socket(dir.path().join("arbiter.sock"));
    low.learn_class(Priority::Low);
    let waiting = launch_in_background(low);
    assert!(waiting.recv_timeout(Duration::from_millis(200)).is_err());
    let unknown = Gate::for_socket(dir.path().join("arbiter.sock"));
    let waiting = launch_in_background(unknown);
    assert!(waiting.recv_timeout(Duration::from_millis(200)).is_err());
}

/// The inode a descriptor refers to, if it is open.
fn inode_of(fd: i32) -> Option<u64> {
    // SAFETY: fstat writes into a zeroed stat buffer; an invalid descriptor only fails.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    (unsafe { libc::fstat(fd, &mut stat) } == 0).then_some(stat.st_ino)
}
