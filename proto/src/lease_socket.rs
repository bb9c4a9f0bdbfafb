//! Messages on a lease's own socket, `/run/gpushare/arbiter.sock` inside the
//! container. The arbiter knows which lease a client belongs to from the socket
//! it connected through, so no message names a lease.
//!
//! Order: `Hello` first; `Attach` before `Charge`/`Credit` and the exported-allocation
//! requests (`Share`/`Hold`/`Unhold`); `Query` any time after `Hello`; or, on a
//! connection of its own, `Schedule` right after `Hello`, which turns it into a token
//! connection (see `token`). Anything else closes the connection.

use serde::{Deserialize, Serialize};

/// The largest request the arbiter reads on a lease socket. The longest is a `Share` with
/// two keys and 20-digit counts, under 200 bytes; the bound keeps what a container can make
/// the arbiter buffer to 4 KiB per connection (256 connections per lease: 1 MiB), where the
/// general frame bound (1 MiB, sized for status reports) would allow 256 MiB.
pub const MAX_LEASE_REQUEST_BYTES: usize = 4096;
/// How long a new lease-socket connection may take to send its `Hello`; one that says
/// nothing is closed rather than left holding one of the lease's connection slots.
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

use crate::lease::{LeaseId, LeaseState};
use crate::message::ErrorKind;
use crate::quantity::{Fraction, Priority};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LeaseRequest {
    Hello {
        protocol: u32,
    },
    /// Registers this process (the arbiter takes its pid from SO_PEERCRED).
    /// `memory_held` is what the process already holds: non-zero only when it
    /// reconnects after an arbiter restart, so the ledger is rebuilt.
    Attach {
        memory_held: u64,
    },
    Query,
    /// Ask to allocate `bytes` more device memory; refused beyond the quota.
    Charge {
        bytes: u64,
    },
    /// `bytes` of device memory were freed.
    Credit {
        bytes: u64,
    },
    /// `bytes` this connection charged are an exported allocation (VMM memory handed
    /// to other processes through a shareable handle), named `key`: from now on they
    /// are charged to the lease until the allocation's last holder lets go, not to
    /// this connection. `same_as`: a key this connection shared the same allocation
    /// under before (a second export); `bytes` is then 0. Answered with `Quota`.
    /// Added within protocol 1: sent only to an arbiter whose `Quota` says `shares`
    /// (an older one would close the connection); otherwise the client keeps the
    /// charge itself.
    Share {
        key: ShareKey,
        bytes: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        same_as: Option<ShareKey>,
    },
    /// This connection holds the exported allocation `key` (imported it). Answered
    /// with `Quota`; a key no connection shared is ignored.
    Hold {
        key: ShareKey,
    },
    /// This connection let go of `key` (released its handle and unmapped it); the
    /// last holder's lets the lease's charge for it go. Answered with `Quota`.
    Unhold {
        key: ShareKey,
    },
    /// Make this connection a token connection for the lease's GPU: the answer is
    /// `Scheduled` with the token page's memfd attached (`SCM_RIGHTS`), and only
    /// `token::TokenRequest` frames may follow.
    Schedule,
}

/// Names an exported allocation across processes: the device and inode of the shareable
/// descriptor (`fstat`), the same in every process the descriptor reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShareKey {
    pub dev: u64,
    pub ino: u64,
}

/// The share a lease grants, and how much of its memory is in use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quota {
    pub lease: LeaseId,
    pub state: LeaseState,
    pub gpus: Vec<String>,
    pub priority: Priority,
    pub memory_quota: u64,
    /// Across every process of the lease: what they charged plus each one's
    /// overhead (context, modules, ... : NVML's usage beyond its charges).
    pub memory_used: u64,
    /// This connection's own charges (its overhead not included).
    pub memory_held: u64,
    /// The part of `memory_used` that is per-process overhead, measured or estimated.
    /// Absent from an older arbiter (which charged none): 0.
    #[serde(default)]
    pub memory_overhead: u64,
    /// Whether the arbiter takes `Share`/`Hold`/`Unhold` (absent from an older one: false).
    #[serde(default)]
    pub shares: bool,
    pub compute_request: Fraction,
    pub compute_limit: Fraction,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum LeaseResponse {
    Hello {
        protocol: u32,
    },
    Attached {
        /// Host pid the arbiter recorded for this connection.
        pid: u32,
        quota: Quota,
    },
    Quota(Quota),
    /// `granted`: the bytes are now charged; otherwise nothing changed.
    Charged {
        granted: bool,
        /// Charges plus overhead across the lease (see `Quota::memory_used`).
        memory_used: u64,
        memory_quota: u64,
        /// The part of `memory_used` that is per-process overhead (0 from an older arbiter).
        #[serde(default)]
        memory_overhead: u64,
    },
    Credited {
        memory_used: u64,
    },
    /// The connection is now a token connection; the page's descriptor travels with
    /// this frame.
    Scheduled(crate::token::ScheduleTerms),
    Error {
        kind: ErrorKind,
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exported_allocation_requests_are_additive() {
        let key = ShareKey {
            dev: 64769,
            ino: 1234,
        };
        let share = LeaseRequest::Share {
            key,
            bytes: 2 << 20,
            same_as: None,
        };
        let text = serde_json::to_string(&share).unwrap();
        assert_eq!(
            text,
            r#"{"op":"share","key":{"dev":64769,"ino":1234},"bytes":2097152}"#
        );
        assert_eq!(serde_json::from_str::<LeaseRequest>(&text).unwrap(), share);
        for request in [LeaseRequest::Hold { key }, LeaseRequest::Unhold { key }] {
            let text = serde_json::to_string(&request).unwrap();
            assert_eq!(
                serde_json::from_str::<LeaseRequest>(&text).unwrap(),
                request
            );
        }
        // An older arbiter's quota has no `shares`: the client must not send them.
        let quota = Quota {
            lease: LeaseId("l1".into()),
            state: LeaseState::Confirmed,
            gpus: Vec::new(),
            priority: Priority::Low,
            memory_quota: 1,
            memory_used: 0,
            memory_held: 0,
            memory_overhead: 0,
            shares: true,
            compute_request: Fraction::ZERO,
            compute_limit: Fraction::ZERO,
        };
        let mut older = serde_json::to_value(&quota).unwrap();
        older.as_object_mut().unwrap().remove("shares").unwrap();
        let quota: Quota = serde_json::from_value(older).unwrap();
        assert!(!quota.shares);
    }
}
