//! The rules of one lease-socket connection, as a pure state machine: which
//! request may come in which phase, and what the connection does with it.
//!
//! `Hello` first (answered with our version, and the connection closed when the
//! client's differs); `Attach` before `Charge`/`Credit`/`Share`/`Hold`/`Unhold`,
//! once; `Query` any time after `Hello`; or, on a connection that has not attached,
//! `Schedule`, which
//! hands the connection to the token service. Anything else is answered with a
//! protocol error and closes the connection.

use gpushare_proto::{LeaseRequest, ShareKey, PROTOCOL_VERSION};

/// Where a connection is in its protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing said yet: the whole `Hello` must come within `HELLO_TIMEOUT`.
    AwaitingHello,
    /// Greeted, not attached to the ledger.
    Greeted,
    /// Attached to the ledger: may charge and credit.
    Attached,
}

/// What the connection does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Answer the hello; `accepted` false: the versions differ, close after it.
    Greet {
        accepted: bool,
    },
    Attach {
        memory_held: u64,
    },
    Query,
    Charge {
        bytes: u64,
    },
    Credit {
        bytes: u64,
    },
    /// An exported allocation shared, held or let go of.
    Share(ShareChange),
    /// From here on the token service serves the connection.
    Schedule,
    /// A protocol error: answer it and close.
    Refuse(&'static str),
}

/// A change to an exported allocation's record (`Ledger::share`, `hold`, `unhold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareChange {
    Share {
        key: ShareKey,
        bytes: u64,
        same_as: Option<ShareKey>,
    },
    Hold {
        key: ShareKey,
    },
    Unhold {
        key: ShareKey,
    },
}

/// The step `request` takes in `phase`.
pub fn step(phase: Phase, request: &LeaseRequest) -> Step {
    use LeaseRequest as R;
    use Phase as P;
    match (phase, request) {
        (P::AwaitingHello, R::Hello { protocol }) => Step::Greet {
            accepted: *protocol == PROTOCOL_VERSION,
        },
        (P::AwaitingHello, _) => Step::Refuse("the first message must be hello"),
        (_, R::Hello { .. }) => Step::Refuse("hello sent twice"),
        (_, R::Query) => Step::Query,
        (P::Greeted, R::Attach { memory_held }) => Step::Attach {
            memory_held: *memory_held,
        },
        (P::Attached, R::Attach { .. }) => Step::Refuse("attach sent twice"),
        (
            P::Greeted,
            R::Charge { .. }
            | R::Credit { .. }
            | R::Share { .. }
            | R::Hold { .. }
            | R::Unhold { .. },
        ) => Step::Refuse("attach before charging or crediting"),
        (
            P::Attached,
            R::Share {
                key,
                bytes,
                same_as,
            },
        ) => Step::Share(ShareChange::Share {
            key: *key,
            bytes: *bytes,
            same_as: *same_as,
        }),
        (P::Attached, R::Hold { key }) => Step::Share(ShareChange::Hold { key: *key }),
        (P::Attached, R::Unhold { key }) => Step::Share(ShareChange::Unhold { key: *key }),
        (P::Attached, R::Charge { bytes }) => Step::Charge { bytes: *bytes },
        (P::Attached, R::Credit { bytes }) => Step::Credit { bytes: *bytes },
        (P::Greeted, R::Schedule) => Step::Schedule,
        (P::Attached, R::Schedule) => {
            Step::Refuse("schedule on a connection of its own, not on the ledger's")
        }
    }
}

/// The phase after a greeting that was accepted, or after an attach that succeeded.
pub fn after(phase: Phase, step: Step) -> Phase {
    match step {
        Step::Greet { accepted: true } => Phase::Greeted,
        Step::Attach { .. } => Phase::Attached,
        _ => phase,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_in_each_phase() {
        use LeaseRequest as R;
        use Phase::*;
        let hello = R::Hello {
            protocol: PROTOCOL_VERSION,
        };
        let other_version = R::Hello {
            protocol: PROTOCOL_VERSION + 1,
        };
        let attach = R::Attach { memory_held: 7 };
        let charge = R::Charge { bytes: 5 };
        let credit = R::Credit { bytes: 3 };
        let key = ShareKey { dev: 1, ino: 2 };
        let share = R::Share {
            key,
            bytes: 4,
            same_as: None,
        };
        let hold = R::Hold { key };
        let unhold = R::Unhold { key };
        let first = Step::Refuse("the first message must be hello");
        let twice = Step::Refuse("hello sent twice");
        let unattached = Step::Refuse("attach before charging or crediting");
        let rows: [(Phase, &LeaseRequest, Step); 27] = [
            (AwaitingHello, &hello, Step::Greet { accepted: true }),
            (
                AwaitingHello,
                &other_version,
                Step::Greet { accepted: false },
            ),
            (AwaitingHello, &attach, first),
            (AwaitingHello, &R::Query, first),
            (AwaitingHello, &charge, first),
            (AwaitingHello, &credit, first),
            (AwaitingHello, &R::Schedule, first),
            (Greeted, &hello, twice),
            (Greeted, &attach, Step::Attach { memory_held: 7 }),
            (Greeted, &R::Query, Step::Query),
            (Greeted, &charge, unattached),
            (Greeted, &credit, unattached),
            (Greeted, &R::Schedule, Step::Schedule),
            (Attached, &hello, twice),
            (Attached, &attach, Step::Refuse("attach sent twice")),
            (Attached, &R::Query, Step::Query),
            (Attached, &charge, Step::Charge { bytes: 5 }),
            (Attached, &credit, Step::Credit { bytes: 3 }),
            (
                Attached,
                &R::Schedule,
                Step::Refuse("schedule on a connection of its own, not on the ledger's"),
            ),
            (Attached, &other_version, twice),
            (Greeted, &other_version, twice),
            (Greeted, &share, unattached),
            (Greeted, &hold, unattached),
            (Greeted, &unhold, unattached),
            (
                Attached,
                &share,
                Step::Share(ShareChange::Share {
                    key,
                    bytes: 4,
                    same_as: None,
                }),
            ),
            (Attached, &hold, Step::Share(ShareChange::Hold { key })),
            (Attached, &unhold, Step::Share(ShareChange::Unhold { key })),
        ];
        for (phase, request, want) in rows {
            assert_eq!(step(phase, request), want, "{request:?} when {phase:?}");
        }
    }

    #[test]
    fn only_an_accepted_hello_and_an_attach_move_the_phase() {
        use Phase::*;
        let rows = [
            (AwaitingHello, Step::Greet { accepted: true }, Greeted),
            (
                AwaitingHello,
                Step::Greet { accepted: false },
                AwaitingHello,
            ),
            (AwaitingHello, Step::Refuse("x"), AwaitingHello),
            (Greeted, Step::Attach { memory_held: 0 }, Attached),
            (Greeted, Step::Query, Greeted),
            (Greeted, Step::Schedule, Greeted),
            (Attached, Step::Charge { bytes: 1 }, Attached),
            (Attached, Step::Credit { bytes: 1 }, Attached),
        ];
        for (phase, taken, want) in rows {
            assert_eq!(after(phase, taken), want, "{taken:?} when {phase:?}");
        }
    }
}
