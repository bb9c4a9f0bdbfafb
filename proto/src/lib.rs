//! The language the gpushare components speak to each other.
//!
//! Everything here is plain data plus a blocking client, so the interposer
//! (`libgpushare.so`) can use it without an async runtime, and every entry point
//! (wrapper, hook, shim, CLI) shares one definition of a request and a lease.

pub mod client;
pub mod frame;
pub mod grant;
pub mod lease;
pub mod lease_socket;
pub mod message;
pub mod quantity;
pub mod timing;
pub mod token;
pub mod token_client;

pub use client::{ChargeOutcome, ClientError, ContainerRef, ControlClient, LeaseClient};
pub use grant::{Grant, GrantAmount, GrantId, GrantRequest, PodBinding};
pub use lease::{Lease, LeaseId, LeaseState};
pub use lease_socket::{LeaseRequest, LeaseResponse, Quota, ShareKey};
pub use message::{
    AdmissionRejections, AdmissionStatus, ClientStatus, ConnectionStatus, ControlRequest,
    ControlResponse, ErrorKind, GpuStatus, GpuTimeline, GpuUtilization, LeaseTokenAccount,
    LeaseTokenTime, LeaseUsage, QueuedRequest, ReclaimReport, ReclaimStatus, ReserveRequest,
    StatusReport, SuspendedLease, TimelineReport, TokenHold, TokenHolder, TokenStatus,
    UnshareableGpuStatus, Violation, ViolationKind, WindowWaiter,
};
pub use quantity::{ByteSize, Fraction, GpuSelector, MemoryRequest, Priority, QuantityError};
pub use token::{FitCounts, LossPolicy, ScheduleTerms, TokenPage, TokenRequest};

/// Bumped on any incompatible change to the messages; the first frame of every
/// connection carries it and a mismatch closes the connection with a clear error.
pub const PROTOCOL_VERSION: u32 = 1;
