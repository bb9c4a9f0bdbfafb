//! gpushare-arbiter: the node daemon that owns every lease and every decision.
//!
//! Decisions (placement, queue order, the ledger, reconciliation, the watchdog's
//! audit) are plain functions and structs that unit tests drive directly;
//! sockets, NVML, /proc and files sit at the edges behind small traits.

pub mod background;
pub mod balance;
pub mod batch;
pub mod bypass;
pub mod capabilities;
pub mod checkpoint;
pub mod cli;
pub mod connections;
pub mod control;
pub mod daemon;
pub mod engine_names;
pub mod files;
pub mod grants;
pub mod inventory;
pub mod lease_connection;
pub mod ledger;
pub mod metrics;
pub mod peer_clock;
pub mod placement;
pub mod process;
pub mod queue;
pub mod reclaim;
pub mod reclaimer;
pub mod reconcile;
pub mod rhythm;
pub mod server;
pub mod shutdown;
pub mod state;
pub mod store;
pub mod timeslice;
pub mod token_time;
pub mod tokens;
pub mod watchdog;
