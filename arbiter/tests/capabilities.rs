//! The arbiter started as root without a capability it needs: the start fails, naming
//! the capability and what needs it; without one only a policy that is off would need,
//! it starts.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{daemon, Arbiter, ARBITER};
use gpushare_config::{Config, SchedulingPolicy};
use gpushare_testkit::arbiter::StartError;

/// This build's arbiter started as root with `dropped` (setpriv's name) taken out of its
/// bounding set and none inheritable, so its effective set after the exec is the rest;
/// `None` (the test skipped) when this test is not root.
fn start_without(
    dropped: &str,
    edit: impl FnOnce(&mut Config),
) -> Option<Result<Arbiter, StartError>> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: dropping a capability from the arbiter's set needs root");
        return None;
    }
    let builder = daemon(1, "16Gi").configure(edit);
    let script = builder.dir().join(format!("arbiter-without-{dropped}"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec setpriv --bounding-set=-{dropped} --inh-caps=-all '{ARBITER}' \"$@\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    Some(builder.program(script).try_start())
}

/// The round-robin policy (no bypass check, so no pause) and the watchdog's kill
/// `on` or off: whether anything the arbiter does needs CAP_KILL.
fn round_robin_with_watchdog_kill(on: bool) -> impl FnOnce(&mut Config) {
    move |c| {
        c.arbiter.watchdog_kill = on;
        c.scheduler.policy = SchedulingPolicy::RoundRobin;
    }
}

/// The log of an arbiter that exited non-zero at start.
fn refusal(started: Result<Arbiter, StartError>) -> String {
    match started {
        Err(StartError::Exited {
            status, log_tail, ..
        }) => {
            assert!(!status.success(), "{status}: {log_tail}");
            log_tail
        }
        Err(other) => panic!("expected the arbiter to exit, got: {other}"),
        Ok(arbiter) => panic!(
            "the arbiter started without the capability: {}",
            arbiter.log_tail(20)
        ),
    }
}

#[test]
fn without_cap_kill_a_signalling_policy_refuses_the_start_and_names_it() {
    let Some(started) = start_without("kill", round_robin_with_watchdog_kill(true)) else {
        return;
    };
    let log = refusal(started);
    assert!(
        log.contains(
            "CAP_KILL is not in the arbiter's effective set: needed to kill the processes \
             the watchdog reports (arbiter.watchdog_kill)"
        ),
        "{log}"
    );
    assert!(
        !log.contains("CAP_SYS_PTRACE"),
        "only the missing one: {log}"
    );
}

#[test]
fn without_cap_sys_ptrace_the_start_is_refused_and_names_it() {
    let Some(started) = start_without("sys_ptrace", |_| {}) else {
        return;
    };
    let log = refusal(started);
    assert!(
        log.contains(
            "CAP_SYS_PTRACE is not in the arbiter's effective set: needed to read /proc/<pid>/ns"
        ),
        "{log}"
    );
}

#[test]
fn without_cap_kill_and_no_signalling_policy_the_arbiter_starts() {
    let Some(started) = start_without("kill", round_robin_with_watchdog_kill(false)) else {
        return;
    };
    let arbiter = started.unwrap_or_else(|e| panic!("{e}"));
    let status = arbiter.status_json();
    assert_eq!(status["gpus"].as_array().map(Vec::len), Some(1), "{status}");
}
