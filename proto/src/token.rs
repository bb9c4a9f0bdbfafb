//! The time-slice token: how a client process learns, without a system call, whether it
//! may submit GPU work, and how it asks for and returns the token.
//!
//! Two channels, each in the direction where it is cheap:
//!
//! * **arbiter → client: a shared page** ([`TokenPage`]). The arbiter creates one memfd
//!   per scheduled connection, maps it writable, seals it against further writable
//!   mappings and passes the descriptor with the `Scheduled` answer (`SCM_RIGHTS`). The
//!   client maps it read-only. A grant or a revocation is a store to the page, seen by
//!   the client's next launch (one atomic load and one vDSO clock read); the arbiter
//!   then bumps [`TokenPage::seq`] and `FUTEX_WAKE`s it, so a client blocked waiting for
//!   the token wakes without another message. Revocation therefore needs no round trip:
//!   the holder stops submitting at its next launch.
//! * **client → arbiter: frames on the connection** ([`TokenRequest`]), one-way; the
//!   arbiter never answers them on the socket.
//!
//! Opening: `Hello`, then `LeaseRequest::Schedule` on a connection of its own (not the
//! ledger's). The answer is `LeaseResponse::Scheduled` with the memfd attached to the
//! frame's first byte. From then on only `TokenRequest` frames may follow; anything else
//! closes the connection, which — like the client's death — loses the token at once.
//!
//! A page is per connection, so a container can neither read nor write another's; what
//! a client does to its own mapping only affects itself (it could as well skip the
//! interposer, which is what the watchdog is for).

use std::sync::atomic::{AtomicU32, AtomicU64};

use serde::{Deserialize, Serialize};

use crate::quantity::Priority;

/// `TokenPage::magic` once the arbiter has initialised the page.
pub const TOKEN_PAGE_MAGIC: u32 = 0x6770_746b; // "gptk"
/// Bytes the arbiter allocates (and the client maps) for one page.
pub const TOKEN_PAGE_SIZE: usize = 4096;

/// `deadline_ns`: the token is not held.
pub const NOT_HELD: u64 = 0;
/// `deadline_ns`: held until the client releases it or the arbiter revokes it.
pub const HELD_UNTIL_RELEASED: u64 = u64::MAX;

/// `fit_by_ns`: no admission window; a launch is bounded by `launch_ahead` only.
pub const FIT_UNBOUNDED: u64 = u64::MAX;

/// `flags`: the arbiter has cut this client off (it ignored a revocation, or its lease
/// ended). The connection is closed right after; the client must not ask again on it.
pub const FLAG_CUT_OFF: u32 = 1;

/// The shared page, as both sides see it. All fields are written by the arbiter only.
///
/// Store order, which the client relies on: `launch_ahead` and `flags` before
/// `deadline_ns` (Release), `deadline_ns` before `seq` (Release), then `FUTEX_WAKE` on
/// `seq`. A client that reads `deadline_ns` with Acquire therefore sees the limits that
/// came with the grant.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct TokenPage {
    pub magic: AtomicU32,
    /// Futex word: incremented (wrapping) on every change, then woken.
    pub seq: AtomicU32,
    /// CLOCK_MONOTONIC nanoseconds until which the client may submit work;
    /// [`NOT_HELD`] or [`HELD_UNTIL_RELEASED`].
    pub deadline_ns: AtomicU64,
    /// At most this many submitted-but-unfinished launches while holding; 0 = unbounded.
    /// Small while a high-priority client shares the GPU, so that a revoked holder's
    /// queued work drains in about one kernel.
    pub launch_ahead: AtomicU32,
    /// [`FLAG_CUT_OFF`].
    pub flags: AtomicU32,
    /// Bumped with each grant (the count of grants so far); lets a client tell a new
    /// grant from the one it already answered.
    pub grants: AtomicU64,
    /// Duration-aware admission (when the terms say `fit_launches`): while holding with
    /// `launch_ahead > 0`, a launch whose estimated GPU time would end after this
    /// CLOCK_MONOTONIC instant waits — a high-priority job is expected back then.
    /// [`FIT_UNBOUNDED`]: no window. Written before `deadline_ns` on a grant; a change
    /// within a grant bumps `seq` and wakes, like any other.
    pub fit_by_ns: AtomicU64,
}

impl TokenPage {
    /// A page in its initial state (not held, unbounded), for the arbiter to write into a
    /// fresh mapping and for tests.
    pub const fn new() -> TokenPage {
        TokenPage {
            magic: AtomicU32::new(TOKEN_PAGE_MAGIC),
            seq: AtomicU32::new(0),
            deadline_ns: AtomicU64::new(NOT_HELD),
            launch_ahead: AtomicU32::new(0),
            flags: AtomicU32::new(0),
            grants: AtomicU64::new(0),
            fit_by_ns: AtomicU64::new(FIT_UNBOUNDED),
        }
    }
}

impl Default for TokenPage {
    fn default() -> Self {
        TokenPage::new()
    }
}

const _: () = assert!(std::mem::size_of::<TokenPage>() <= TOKEN_PAGE_SIZE);

pub use gpushare_types::token::LossPolicy;

/// What the arbiter tells a client when its connection becomes a token connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleTerms {
    /// The GPU whose token this connection competes for.
    pub gpu: String,
    /// The lease's class, as the arbiter recorded it (never what the container says).
    pub priority: Priority,
    /// A holder whose submitted work has all completed and that has launched nothing for
    /// this long returns the token.
    pub idle_ns: u64,
    /// What to do while the arbiter is unreachable.
    pub on_arbiter_loss: LossPolicy,
    /// The arbiter publishes admission windows (`TokenPage::fit_by_ns`) and accepts
    /// [`TokenRequest::Fit`] reports. Absent (false) from arbiters that predate them,
    /// whose connections would close on an unknown frame.
    #[serde(default)]
    pub fit_launches: bool,
}

/// Client → arbiter, after `Scheduled`. One-way: the answer is a change of the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TokenRequest {
    /// The client has work to submit and wants the token. Repeating it is harmless.
    Want,
    /// The client gives the token back (it went idle, its slice ran out, or it was
    /// revoked — this is also the acknowledgement of a revocation). Its submitted work
    /// has completed. `again`: it still has work and wants the token back.
    Release { again: bool },
    /// Sent just before a `Release` when the terms say `fit_launches`: what the client's
    /// duration-aware admission saw since the connection opened (cumulative counts, so a
    /// lost frame loses nothing) and what its waiting launch needs. The arbiter grants a
    /// client whose `need_ns` does not fit the current window only once one does (or the
    /// high-priority job is no longer active), rather than churning grants it cannot use.
    Fit {
        /// Estimated GPU time of the launch waiting for a window (0: none waits for one).
        need_ns: u64,
        #[serde(flatten)]
        counts: FitCounts,
    },
}

/// A client's duration-aware admission, counted since its connection opened. Every
/// field defaults, so a client that reports fewer (or later more) counts still parses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FitCounts {
    /// Launches admitted inside a window (their estimate fitted, or nothing was known yet).
    pub fitted: u64,
    /// Of those, launches nothing was known about (first of their kind): admitted to learn.
    pub unestimated: u64,
    /// Times a launch waited because its estimate did not fit the window.
    pub held_back: u64,
    /// Admitted launches measured still running after the window's end: mis-predictions.
    pub overran: u64,
    /// Their total time past the window's end.
    pub overran_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_layout_is_stable() {
        // The layout is an ABI between two binaries built at different times.
        assert_eq!(std::mem::offset_of!(TokenPage, magic), 0);
        assert_eq!(std::mem::offset_of!(TokenPage, seq), 4);
        assert_eq!(std::mem::offset_of!(TokenPage, deadline_ns), 8);
        assert_eq!(std::mem::offset_of!(TokenPage, launch_ahead), 16);
        assert_eq!(std::mem::offset_of!(TokenPage, flags), 20);
        assert_eq!(std::mem::offset_of!(TokenPage, grants), 24);
        assert_eq!(std::mem::offset_of!(TokenPage, fit_by_ns), 32);
        assert_eq!(std::mem::size_of::<TokenPage>(), 64);
    }

    #[test]
    fn token_requests_are_tagged_json() {
        let json = serde_json::to_string(&TokenRequest::Release { again: true }).unwrap();
        assert_eq!(json, r#"{"op":"release","again":true}"#);
        let back: TokenRequest = serde_json::from_str(r#"{"op":"want"}"#).unwrap();
        assert_eq!(back, TokenRequest::Want);
        let fit = TokenRequest::Fit {
            need_ns: 5,
            counts: FitCounts {
                fitted: 1,
                overran: 2,
                ..FitCounts::default()
            },
        };
        let json = serde_json::to_string(&fit).unwrap();
        assert_eq!(
            json,
            r#"{"op":"fit","need_ns":5,"fitted":1,"unestimated":0,"held_back":0,"overran":2,"overran_ns":0}"#
        );
        assert_eq!(serde_json::from_str::<TokenRequest>(&json).unwrap(), fit);
        // Terms from an arbiter that predates windows: no fit reports.
        let old = r#"{"gpu":"GPU-0","priority":"low","idle_ns":1,"on_arbiter_loss":"wait"}"#;
        assert!(
            !serde_json::from_str::<ScheduleTerms>(old)
                .unwrap()
                .fit_launches
        );
    }
}
