//! The Linux capabilities the arbiter needs, checked once at start, so that a unit or a
//! container that withholds one fails the start with the capability's name instead of
//! leaving a feature that silently cannot act.
//!
//! Running as root, the arbiter acts on other users' processes (containers run as any
//! uid), and for that alone it needs:
//! - `CAP_SYS_PTRACE`: `/proc/<pid>/ns/*` of another user's process is behind a
//!   ptrace-mode access check. The lease sockets' peer check reads `ns/pid` (without
//!   the capability every such peer is only "unverified") and a token client's clock
//!   offset reads `ns/time` (without it the connection is refused). Always needed.
//! - `CAP_KILL`: signalling another user's process. Needed when a policy that
//!   signals is on: `arbiter.watchdog_kill` (SIGKILL) or the bypass check's pause
//!   (`scheduler.pause_bypassing`: SIGSTOP, then SIGCONT).
//!
//! Nothing else: the sockets, lease directories and state files are the arbiter's own
//! (it chmods only what it created, and chowns nothing), so root's ownership suffices
//! without CAP_CHOWN, CAP_FOWNER or CAP_DAC_OVERRIDE. The systemd unit grants exactly
//! these two (a test below holds the check to the unit).
//!
//! Not root, the arbiter is a developer's or a test's, serving its own user's processes,
//! which it may signal and inspect with no capability: the check is skipped.

use std::collections::HashSet;

use caps::{CapSet, Capability};
use gpushare_config::{ArbiterConfig, SchedulerConfig, SchedulingPolicy};

/// A capability and what in the arbiter needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub capability: Capability,
    pub needed_to: &'static str,
    /// The configuration key whose policy needs it; none: always needed.
    pub turned_on_by: Option<&'static str>,
}

/// What the arbiter needs with this configuration.
///
/// A capability for an optional policy is required only while that policy is on, and
/// then it fails the start rather than warns: the operator turned the policy on, and a
/// warning in the log would leave them believing it enforced while every signal fails.
/// Both keys take effect only at a restart, so this start's check covers them for the
/// whole life of the process.
pub fn required(arbiter: &ArbiterConfig, scheduler: &SchedulerConfig) -> Vec<Need> {
    let mut needs = vec![Need {
        capability: Capability::CAP_SYS_PTRACE,
        needed_to: "read /proc/<pid>/ns of clients that run as another user \
                    (the lease sockets' peer check, the token clients' clock offsets)",
        turned_on_by: None,
    }];
    if arbiter.watchdog_kill {
        needs.push(Need {
            capability: Capability::CAP_KILL,
            needed_to: "kill the processes the watchdog reports (arbiter.watchdog_kill)",
            turned_on_by: Some("arbiter.watchdog_kill"),
        });
    }
    // As background.rs runs the bypass check: the priority policy only.
    if scheduler.policy == SchedulingPolicy::Priority
        && scheduler.bypass_check
        && scheduler.pause_bypassing
    {
        needs.push(Need {
            capability: Capability::CAP_KILL,
            needed_to: "stop and continue a process that launches past the interposer \
                        beside a high-priority job (scheduler.pause_bypassing)",
            turned_on_by: Some("scheduler.pause_bypassing"),
        });
    }
    needs
}

/// The needs whose capability `effective` lacks, in the order of `required`.
pub fn missing(required: &[Need], effective: &HashSet<Capability>) -> Vec<Need> {
    required
        .iter()
        .filter(|need| !effective.contains(&need.capability))
        .cloned()
        .collect()
}

/// The start refused: one line per missing need.
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("{}", describe(.0))]
    Missing(Vec<Need>),
    #[error("reading the arbiter's effective capabilities: {0}")]
    Unreadable(String),
}

fn describe(missing: &[Need]) -> String {
    missing
        .iter()
        .map(|need| {
            format!(
                "{} is not in the arbiter's effective set: needed to {}; add it to the \
                 systemd unit's CapabilityBoundingSet (or the arbiter container's \
                 capabilities){}",
                need.capability,
                need.needed_to,
                need.turned_on_by
                    .map(|key| format!(", or set {key} = false"))
                    .unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The check at start: as root, each required capability must be in this process's
/// effective set (the arbiter never raises one from its permitted set).
pub fn check_at_start(
    arbiter: &ArbiterConfig,
    scheduler: &SchedulerConfig,
) -> Result<(), CapabilityError> {
    if !nix::unistd::geteuid().is_root() {
        tracing::debug!("not root: serving only this user's processes, no capability needed");
        return Ok(());
    }
    let effective = caps::read(None, CapSet::Effective)
        .map_err(|e| CapabilityError::Unreadable(e.to_string()))?;
    let missing = missing(&required(arbiter, scheduler), &effective);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CapabilityError::Missing(missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(capabilities: &[Capability]) -> HashSet<Capability> {
        capabilities.iter().copied().collect()
    }

    fn capabilities(needs: &[Need]) -> Vec<Capability> {
        needs.iter().map(|n| n.capability).collect()
    }

    fn configs(
        watchdog_kill: bool,
        policy: SchedulingPolicy,
        pause_bypassing: bool,
    ) -> (ArbiterConfig, SchedulerConfig) {
        let arbiter = ArbiterConfig {
            watchdog_kill,
            ..ArbiterConfig::default()
        };
        let scheduler = SchedulerConfig {
            policy,
            pause_bypassing,
            ..SchedulerConfig::default()
        };
        (arbiter, scheduler)
    }

    #[test]
    fn each_signalling_policy_requires_cap_kill_and_ptrace_is_always_required() {
        use Capability::{CAP_KILL, CAP_SYS_PTRACE};
        use SchedulingPolicy::{Priority, RoundRobin};
        let table = [
            // watchdog_kill, policy, pause_bypassing: required
            (false, RoundRobin, true, vec![CAP_SYS_PTRACE]),
            (false, Priority, false, vec![CAP_SYS_PTRACE]),
            (false, Priority, true, vec![CAP_SYS_PTRACE, CAP_KILL]),
            (true, RoundRobin, false, vec![CAP_SYS_PTRACE, CAP_KILL]),
            (
                true,
                Priority,
                true,
                vec![CAP_SYS_PTRACE, CAP_KILL, CAP_KILL],
            ),
        ];
        for (watchdog_kill, policy, pause, expected) in table {
            let (arbiter, scheduler) = configs(watchdog_kill, policy, pause);
            assert_eq!(
                capabilities(&required(&arbiter, &scheduler)),
                expected,
                "watchdog_kill={watchdog_kill} policy={policy:?} pause_bypassing={pause}"
            );
        }
        let (arbiter, mut scheduler) = configs(false, Priority, true);
        scheduler.bypass_check = false;
        assert_eq!(
            capabilities(&required(&arbiter, &scheduler)),
            [CAP_SYS_PTRACE],
            "no bypass check, no pause"
        );
    }

    #[test]
    fn missing_keeps_each_need_the_effective_set_lacks() {
        use Capability::{CAP_CHOWN, CAP_KILL, CAP_SYS_PTRACE};
        let (arbiter, scheduler) = configs(true, SchedulingPolicy::Priority, true);
        let needs = required(&arbiter, &scheduler);
        let table: [(HashSet<Capability>, Vec<Capability>); 4] = [
            (set(&[CAP_KILL, CAP_SYS_PTRACE]), vec![]),
            (set(&[CAP_KILL, CAP_SYS_PTRACE, CAP_CHOWN]), vec![]),
            (set(&[CAP_SYS_PTRACE]), vec![CAP_KILL, CAP_KILL]),
            (set(&[]), vec![CAP_SYS_PTRACE, CAP_KILL, CAP_KILL]),
        ];
        for (effective, expected) in table {
            assert_eq!(
                capabilities(&missing(&needs, &effective)),
                expected,
                "{effective:?}"
            );
        }
    }

    #[test]
    fn the_refusal_names_the_capability_and_what_needs_it() {
        let (arbiter, scheduler) = configs(true, SchedulingPolicy::RoundRobin, false);
        let message = CapabilityError::Missing(missing(
            &required(&arbiter, &scheduler),
            &set(&[Capability::CAP_SYS_PTRACE]),
        ))
        .to_string();
        assert_eq!(
            message,
            "CAP_KILL is not in the arbiter's effective set: needed to kill the processes the \
             watchdog reports (arbiter.watchdog_kill); add it to the systemd unit's \
             CapabilityBoundingSet (or the arbiter container's capabilities), or set \
             arbiter.watchdog_kill = false"
        );
        let always = CapabilityError::Missing(missing(
            &required(&arbiter, &scheduler),
            &set(&[Capability::CAP_KILL]),
        ))
        .to_string();
        assert!(
            always.starts_with("CAP_SYS_PTRACE is not in the arbiter's effective set")
                && always.ends_with("(or the arbiter container's capabilities)"),
            "an always-needed capability offers no key to turn off: {always}"
        );
    }

    /// The unit the packages install grants every capability the check can require,
    /// with every optional policy on: the check never refuses a start under it.
    #[test]
    fn the_systemd_unit_grants_every_capability_the_check_can_require() {
        let unit = include_str!("../../config/systemd/gpushare-arbiter.service");
        let granted: HashSet<Capability> = unit
            .lines()
            .filter_map(|l| l.strip_prefix("CapabilityBoundingSet="))
            .flat_map(str::split_whitespace)
            .map(|name| {
                name.parse()
                    .unwrap_or_else(|_| panic!("{name} in the unit"))
            })
            .collect();
        assert!(!granted.is_empty(), "the unit names its capabilities");
        let (arbiter, scheduler) = configs(true, SchedulingPolicy::Priority, true);
        let needs = required(&arbiter, &scheduler);
        assert_eq!(
            capabilities(&needs)
                .into_iter()
                .collect::<HashSet<_>>()
                .len(),
            2,
            "every capability the check knows is required here"
        );
        assert_eq!(missing(&needs, &granted), [], "{granted:?}");
    }
}
