//! What to do when the forwarded Create fails. An error says that the runc
//! shim did not *answer* success, not always that it created nothing: a
//! deadline that passed on this side or a broken connection leaves the
//! container possibly created and running on the edited spec. Undoing then
//! would take the lease of a live container (its processes lose their lease
//! socket and quota, and the arbiter may place another job in its room) and
//! put the original spec back under it. So:
//!
//! - the runc shim answered with an error status of its own (runc create failed,
//!   an invalid request, …): nothing was created, undo;
//! - no answer (deadline, cancelled, unavailable, a broken connection): ask the
//!   runc shim for the container's state, on a fresh connection with a short
//!   timeout of its own; undo only if it answers NotFound, and only where that
//!   answer is final: containerd 1.x's runc shim (task API v2) answers State only
//!   once its Create has returned, containerd 2.x's (task API v3) answers NotFound
//!   while a stalled Create is still creating the container;
//! - it exists: keep the lease and record the container as created with it,
//!   exactly as a successful Create does (its exit or its Delete releases);
//! - the state cannot be had either: keep the lease too (it is released by the
//!   container's Delete or exit, or by the arbiter's reconciliation once the
//!   confirmed pid is dead) rather than release one that may be in use.

use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::api::{StateRequest, StateResponse};
use containerd_shim::protos::ttrpc::{context, Code};

use crate::forward::{CallError, Forwarder};
use crate::inner::Endpoint;

/// How long the State probe after an ambiguous failure may take. containerd 1.x's
/// runc shim answers State only once its own Create has returned (one lock guards
/// both), and that Create ends at the same deadline: a few seconds cover it, and keep
/// the probe well inside containerd's 5 s cleanup of a failed Create (its
/// Delete waits for this decision).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// What is done after a failed forwarded Create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing was created: restore the spec, release the lease.
    Undo,
    /// It is not known whether the container exists: ask the runc shim.
    ProbeState,
    /// Keep the lease and the edited spec; record the container as created.
    Keep(Kept),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kept {
    /// The runc shim knows the container: it was created after all.
    Exists,
    /// Not even its state could be had; the reason, for the log.
    Unknown(String),
}

/// A status the runc shim answered that does not say whether the request was
/// carried out (its deadline, a cancellation, or a proxy's "unavailable").
fn is_ambiguous_status(code: Code) -> bool {
    matches!(
        code,
        Code::DEADLINE_EXCEEDED | Code::CANCELLED | Code::UNAVAILABLE
    )
}

/// The decision, from the Create's error and, once asked, the State probe's
/// outcome (`Ok`: the runc shim knows the container) and whether its NotFound is
/// final (the runc shim's Create had returned when it answered). Pure.
pub fn decide(
    create: &CallError,
    probe: Option<&Result<(), CallError>>,
    not_found_is_final: bool,
) -> Decision {
    let ambiguous = match create {
        CallError::NotSent(_) => false,
        CallError::Answered(status) => is_ambiguous_status(status.code()),
        CallError::NoAnswer(_) => true,
    };
    if !ambiguous {
        return Decision::Undo;
    }
    match probe {
        None => Decision::ProbeState,
        Some(Ok(())) => Decision::Keep(Kept::Exists),
        Some(Err(CallError::Answered(status))) if status.code() == Code::NOT_FOUND => {
            if not_found_is_final {
                Decision::Undo
            } else {
                Decision::Keep(Kept::Unknown(
                    "its runc shim (task API v3, containerd 2.x) answers State while a stalled \
                     Create may still be creating it: not found yet"
                        .into(),
                ))
            }
        }
        Some(Err(e)) => Decision::Keep(Kept::Unknown(format!("its state: {e}"))),
    }
}

/// Asks the runc shim whether it knows a container.
#[async_trait]
pub trait StateProbe: Send + Sync {
    async fn state(&self, container_id: &str) -> Result<(), CallError>;
    /// Whether a NotFound it answers means the container was not created.
    fn not_found_is_final(&self) -> bool;
}

/// The real probe: a fresh connection (the one the Create went over may be the
/// one that broke) and a State request with `PROBE_TIMEOUT`.
pub struct RuncShimProbe {
    pub endpoint: Endpoint,
    /// containerd's metadata (its namespace) from the Create.
    pub ctx: context::Context,
}

#[async_trait]
impl StateProbe for RuncShimProbe {
    async fn state(&self, container_id: &str) -> Result<(), CallError> {
        let ask = async {
            let forwarder = Forwarder::connect(&self.endpoint)
                .await
                .map_err(|e| CallError::NoAnswer(ttrpc_others(e.to_string())))?;
            let ctx = context::Context {
                metadata: self.ctx.metadata.clone(),
                timeout_nano: PROBE_TIMEOUT.as_nanos() as i64,
            };
            let request = StateRequest {
                id: container_id.to_owned(),
                ..Default::default()
            };
            forwarder
                .call_raw::<_, StateResponse>(&ctx, "State", &request)
                .await
                .map(|_| ())
        };
        // The connect too is bounded.
        tokio::time::timeout(PROBE_TIMEOUT, ask)
            .await
            .unwrap_or_else(|_| {
                Err(CallError::NoAnswer(ttrpc_others(format!(
                    "no answer to State within {PROBE_TIMEOUT:?}"
                ))))
            })
    }

    /// containerd 1.x's runc shim (task API v2) serialises State behind Create;
    /// 2.x's (task API v3) does not.
    fn not_found_is_final(&self) -> bool {
        self.endpoint.api == crate::inner::TaskApi::V2
    }
}

fn ttrpc_others(message: String) -> containerd_shim::protos::ttrpc::Error {
    containerd_shim::protos::ttrpc::Error::Others(message)
}

/// Decides what to do after a failed Create, asking `probe` when the error
/// leaves the container's existence open.
pub async fn settle(container_id: &str, create: &CallError, probe: &dyn StateProbe) -> Decision {
    let final_not_found = probe.not_found_is_final();
    match decide(create, None, final_not_found) {
        Decision::ProbeState => {
            let state = probe.state(container_id).await;
            decide(create, Some(&state), final_not_found)
        }
        decided => decided,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim::protos::ttrpc::Error;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn answered(code: Code) -> CallError {
        CallError::answered(code, "from the runc shim")
    }
    fn timed_out() -> CallError {
        CallError::NoAnswer(Error::Others("Receive packet timeout Elapsed(())".into()))
    }
    fn closed() -> CallError {
        CallError::NoAnswer(Error::RemoteClosed)
    }
    fn unknown() -> Decision {
        Decision::Keep(Kept::Unknown(String::new()))
    }
    /// `Unknown`'s reason is for the log: compare the kind only.
    fn kind(d: Decision) -> Decision {
        match d {
            Decision::Keep(Kept::Unknown(_)) => unknown(),
            other => other,
        }
    }

    #[test]
    fn the_decision_table() {
        use Decision::*;
        let exists: Result<(), CallError> = Ok(());
        let not_found = Err(answered(Code::NOT_FOUND));
        let probe_timed_out = Err(timed_out());
        let probe_refused = Err(CallError::NoAnswer(Error::Others(
            "cannot connect to the runc shim".into(),
        )));
        let probe_other_status = Err(answered(Code::INTERNAL));
        let probe_unavailable = Err(answered(Code::UNAVAILABLE));
        type Case<'a> = (
            &'a str,
            CallError,
            Option<&'a Result<(), CallError>>,
            Decision,
        );
        let cases: Vec<Case> = vec![
            // The runc shim answered: definitive, undone without asking.
            (
                "runc create failed (Unknown)",
                answered(Code::UNKNOWN),
                None,
                Undo,
            ),
            ("not found", answered(Code::NOT_FOUND), None, Undo),
            (
                "invalid argument",
                answered(Code::INVALID_ARGUMENT),
                None,
                Undo,
            ),
            ("internal", answered(Code::INTERNAL), None, Undo),
            ("already exists", answered(Code::ALREADY_EXISTS), None, Undo),
            (
                "failed precondition",
                answered(Code::FAILED_PRECONDITION),
                None,
                Undo,
            ),
            (
                "never sent",
                CallError::NotSent(Error::Others("encode".into())),
                None,
                Undo,
            ),
            // Even if a probe result were at hand, a definitive answer decides.
            (
                "definitive, probe says exists",
                answered(Code::UNKNOWN),
                Some(&exists),
                Undo,
            ),
            // Ambiguous: ask first.
            ("deadline on this side", timed_out(), None, ProbeState),
            ("connection closed", closed(), None, ProbeState),
            (
                "broken socket",
                CallError::NoAnswer(Error::Socket("EPIPE".into())),
                None,
                ProbeState,
            ),
            (
                "garbled answer",
                CallError::NoAnswer(Error::Others("decode".into())),
                None,
                ProbeState,
            ),
            (
                "deadline status",
                answered(Code::DEADLINE_EXCEEDED),
                None,
                ProbeState,
            ),
            (
                "cancelled status",
                answered(Code::CANCELLED),
                None,
                ProbeState,
            ),
            (
                "unavailable status",
                answered(Code::UNAVAILABLE),
                None,
                ProbeState,
            ),
            // Ambiguous, then the probe's answer.
            (
                "timeout, exists",
                timed_out(),
                Some(&exists),
                Keep(Kept::Exists),
            ),
            (
                "closed, exists",
                closed(),
                Some(&exists),
                Keep(Kept::Exists),
            ),
            ("timeout, not found", timed_out(), Some(&not_found), Undo),
            ("closed, not found", closed(), Some(&not_found), Undo),
            (
                "deadline status, not found",
                answered(Code::DEADLINE_EXCEEDED),
                Some(&not_found),
                Undo,
            ),
            (
                "timeout, probe timed out",
                timed_out(),
                Some(&probe_timed_out),
                unknown(),
            ),
            (
                "closed, probe cannot connect",
                closed(),
                Some(&probe_refused),
                unknown(),
            ),
            (
                "timeout, probe internal",
                timed_out(),
                Some(&probe_other_status),
                unknown(),
            ),
            (
                "timeout, probe unavailable",
                timed_out(),
                Some(&probe_unavailable),
                unknown(),
            ),
        ];
        for (what, create, probe, expected) in cases {
            assert_eq!(kind(decide(&create, probe, true)), expected, "{what}");
        }
    }

    #[test]
    fn an_unknown_state_says_why() {
        match decide(&timed_out(), Some(&Err(closed())), true) {
            Decision::Keep(Kept::Unknown(why)) => assert!(why.contains("no answer"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// A probe that answers as told and counts its calls.
    struct FakeProbe {
        answer: Result<(), CallError>,
        not_found_is_final: bool,
        calls: AtomicUsize,
        asked_for: std::sync::Mutex<Vec<String>>,
    }

    impl FakeProbe {
        fn new(answer: Result<(), CallError>) -> FakeProbe {
            FakeProbe {
                answer,
                not_found_is_final: true,
                calls: AtomicUsize::new(0),
                asked_for: Default::default(),
            }
        }
    }

    #[async_trait]
    impl StateProbe for FakeProbe {
        async fn state(&self, container_id: &str) -> Result<(), CallError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.asked_for.lock().unwrap().push(container_id.to_owned());
            self.answer.clone()
        }

        fn not_found_is_final(&self) -> bool {
            self.not_found_is_final
        }
    }

    fn settle_now(create: &CallError, probe: &FakeProbe) -> Decision {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(settle("c1", create, probe))
    }

    #[test]
    fn a_definitive_failure_is_undone_without_asking() {
        let probe = FakeProbe::new(Ok(()));
        assert_eq!(settle_now(&answered(Code::UNKNOWN), &probe), Decision::Undo);
        assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_timed_out_create_of_a_container_that_exists_keeps_the_lease() {
        let probe = FakeProbe::new(Ok(()));
        assert_eq!(
            settle_now(&timed_out(), &probe),
            Decision::Keep(Kept::Exists)
        );
        assert_eq!(*probe.asked_for.lock().unwrap(), vec!["c1".to_owned()]);
    }

    #[test]
    fn a_timed_out_create_of_a_container_the_runc_shim_does_not_know_is_undone() {
        let probe = FakeProbe::new(Err(answered(Code::NOT_FOUND)));
        assert_eq!(settle_now(&closed(), &probe), Decision::Undo);
        assert_eq!(probe.calls.load(Ordering::SeqCst), 1);
    }

    /// containerd 2.x's runc shim answers State while its stalled Create still runs:
    /// its NotFound may turn into a created container a moment later.
    #[test]
    fn a_not_found_from_a_runc_shim_that_does_not_wait_for_its_create_keeps_the_lease() {
        let mut probe = FakeProbe::new(Err(answered(Code::NOT_FOUND)));
        probe.not_found_is_final = false;
        assert_eq!(kind(settle_now(&timed_out(), &probe)), unknown());
        // A definitive failure is still undone without asking.
        assert_eq!(settle_now(&answered(Code::UNKNOWN), &probe), Decision::Undo);
        assert_eq!(probe.calls.load(Ordering::SeqCst), 1);
        let v3 = RuncShimProbe {
            endpoint: Endpoint {
                address: "unix:///nowhere".into(),
                api: crate::inner::TaskApi::V3,
            },
            ctx: context::Context::default(),
        };
        assert!(!v3.not_found_is_final());
    }

    #[test]
    fn an_unanswered_probe_keeps_the_lease() {
        let probe = FakeProbe::new(Err(timed_out()));
        assert_eq!(kind(settle_now(&timed_out(), &probe)), unknown());
        assert_eq!(probe.calls.load(Ordering::SeqCst), 1);
    }

    /// The real probe against an address nobody listens on: no answer, within
    /// its timeout, and so the lease is kept.
    #[test]
    fn the_real_probe_without_a_runc_shim_is_unknown() {
        let dir = tempfile::tempdir().unwrap();
        let probe = RuncShimProbe {
            endpoint: Endpoint {
                address: format!("unix://{}", dir.path().join("none.sock").display()),
                api: crate::inner::TaskApi::V2,
            },
            ctx: context::Context::default(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let started = std::time::Instant::now();
        let decided = runtime.block_on(settle("c1", &timed_out(), &probe));
        assert_eq!(kind(decided), unknown());
        assert!(started.elapsed() <= PROBE_TIMEOUT + Duration::from_secs(1));
    }
}
