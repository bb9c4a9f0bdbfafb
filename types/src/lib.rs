//! gpushare's shared vocabulary: the values every component speaks of — priorities,
//! byte sizes, fractions, GPU selectors, lease ids, the token clock, what a client does
//! when it loses the arbiter, the host path layout, and the binaries' help layout.
//!
//! Configuration (`gpushare-config`) and the wire protocol (`gpushare-proto`) both use
//! these, so neither depends on the other for plain values. The crate depends on
//! nothing but libc (for the clock); `serde` is an optional feature, turned on by the
//! crates that put these values in files or on the wire.

pub mod cli;
pub mod clock;
pub mod kubernetes;
pub mod layout;
pub mod lease_id;
pub mod quantity;
pub mod token;

pub use clock::monotonic_ns;
pub use kubernetes::{BadGrantId, GrantId};
pub use layout::HostLayout;
pub use lease_id::{BadLeaseId, LeaseId, LEASE_ID_FORM};
pub use quantity::{ByteSize, Fraction, GpuSelector, MemoryRequest, Priority, QuantityError};
pub use token::LossPolicy;
